//! The BiCache prefix store: entries keyed by the model's identity and a hash of the
//! prefix's token ids, confirmed by a full comparison, evicted least-recently-used under a
//! budget in tokens and in bytes, and pinned while a request uses them (`Pin`, released when
//! dropped). Generic over the payload (on the GPU: per-layer K/V buffers and boundary hidden
//! states), so the policy is tested without a device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Limits on what the store may hold at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreBudget {
    pub max_tokens: usize,
    pub max_bytes: u64,
}

/// Counters for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub hits: u64,
    pub misses: u64,
    pub inserts: u64,
    pub evictions: u64,
    /// Entries refused because they could not fit (too big, or the rest pinned).
    pub rejected: u64,
    pub entries: usize,
    pub tokens: usize,
    pub bytes: u64,
}

/// What the store holds, counted from its entries rather than kept as running totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recount {
    pub entries: usize,
    pub tokens: usize,
    pub bytes: u64,
    /// Pins held over all entries.
    pub pins: usize,
}

/// Handle of a stored entry; valid until the entry is evicted (never while pinned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryId(u64);

/// Why an entry was not stored; the request then runs without the shared cache.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotStored {
    #[error(
        "prefix of {tokens} tokens / {bytes} bytes exceeds the cache budget of {max_tokens} tokens / {max_bytes} bytes"
    )]
    TooLarge {
        tokens: usize,
        bytes: u64,
        max_tokens: usize,
        max_bytes: u64,
    },
    #[error("the cache is full of entries in use by running requests ({pinned} pinned)")]
    AllPinned { pinned: usize },
    #[error("an entry for this prefix is already stored")]
    Duplicate,
    #[error("the entry is no longer stored")]
    Evicted,
}

/// A store shared by the requests of an engine.
pub type SharedStore<P> = Arc<Mutex<PrefixStore<P>>>;

/// One pin on a stored entry, released when dropped: on success, on every error path and
/// when the future or batch holding it is dropped, so no pin outlives its request.
pub struct Pin<P> {
    store: SharedStore<P>,
    id: EntryId,
}

impl<P> Pin<P> {
    /// Takes over a pin `acquire` or `insert` just made on `store`.
    pub fn adopt(store: &SharedStore<P>, id: EntryId) -> Self {
        Self {
            store: store.clone(),
            id,
        }
    }

    pub fn id(&self) -> EntryId {
        self.id
    }
}

impl<P> Drop for Pin<P> {
    fn drop(&mut self) {
        // A poisoned lock still holds consistent counters: release anyway.
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        store.release(self.id);
    }
}

struct Entry<P> {
    /// The weights the payload was computed with: an entry never meets other weights.
    model: u64,
    tokens: Vec<u32>,
    hash: u64,
    bytes: u64,
    pins: usize,
    last_use: u64,
    payload: P,
}

/// FNV-1a over the little-endian bytes of the ids: stable across platforms and runs.
pub fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

pub struct PrefixStore<P> {
    budget: StoreBudget,
    hasher: fn(&[u32]) -> u64,
    entries: HashMap<u64, Entry<P>>,
    by_hash: HashMap<u64, Vec<u64>>,
    next_id: u64,
    clock: u64,
    stats: StoreStats,
    /// What changed since the last `take_events`, when recorded.
    events: Option<Vec<StoreEvent>>,
}

/// A change to what the store holds, for a publisher of cache events (vLLM's KV events):
/// the tokens of an entry stored or removed, or every entry gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreEvent {
    Stored(Vec<u32>),
    Removed(Vec<u32>),
    Cleared,
}

impl<P> PrefixStore<P> {
    pub fn new(budget: StoreBudget) -> Self {
        Self::with_hasher(budget, hash_tokens)
    }

    /// A store with another hash function (tests force collisions with a constant one).
    pub fn with_hasher(budget: StoreBudget, hasher: fn(&[u32]) -> u64) -> Self {
        Self {
            budget,
            hasher,
            entries: HashMap::new(),
            by_hash: HashMap::new(),
            next_id: 0,
            clock: 0,
            stats: StoreStats::default(),
            events: None,
        }
    }

    /// Starts (or stops) recording what is stored and removed, for `take_events`.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(Vec::new);
    }

    /// The changes recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<StoreEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record(&mut self, event: StoreEvent) {
        if let Some(events) = self.events.as_mut() {
            events.push(event);
        }
    }

    pub fn budget(&self) -> StoreBudget {
        self.budget
    }

    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn key_hash(&self, model: u64, tokens: &[u32]) -> u64 {
        (self.hasher)(tokens) ^ model.rotate_left(29).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// The stored entry of `model` whose tokens equal `tokens` exactly.
    fn find(&self, model: u64, tokens: &[u32]) -> Option<u64> {
        let hash = self.key_hash(model, tokens);
        self.by_hash.get(&hash).and_then(|ids| {
            ids.iter().copied().find(|id| {
                self.entries
                    .get(id)
                    .is_some_and(|e| e.model == model && e.tokens == tokens)
            })
        })
    }

    /// The entry of `model` whose tokens equal `tokens` exactly, pinned for the caller;
    /// counts a hit or a miss. A hash match with different tokens or another model is a
    /// miss, never served.
    pub fn acquire(&mut self, model: u64, tokens: &[u32]) -> Option<EntryId> {
        let found = self.find(model, tokens);
        match found {
            Some(id) => {
                let now = self.tick();
                let e = self.entries.get_mut(&id).expect("indexed entry exists");
                e.pins += 1;
                e.last_use = now;
                self.stats.hits += 1;
                Some(EntryId(id))
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// The longest stored entry of `model` (of at least `min_len` tokens) whose tokens occur
    /// inside `tokens`, with the first position where they do: a shared span found in a
    /// prompt that does not name one (ACache). Neither pins nor counts.
    pub fn find_inside(
        &self,
        model: u64,
        tokens: &[u32],
        min_len: usize,
    ) -> Option<(usize, usize)> {
        self.entries
            .values()
            .filter(|e| e.model == model && e.tokens.len() >= min_len.max(1))
            .filter(|e| e.tokens.len() <= tokens.len())
            .filter_map(|e| {
                let at = tokens.windows(e.tokens.len()).position(|w| w == e.tokens)?;
                Some((at, e.tokens.len()))
            })
            .max_by_key(|&(at, len)| (len, std::cmp::Reverse(at)))
    }

    /// The entry of `model` whose tokens equal `tokens`, without pinning it or counting a
    /// hit.
    pub fn peek(&self, model: u64, tokens: &[u32]) -> Option<EntryId> {
        self.find(model, tokens).map(EntryId)
    }

    /// Stores a new entry, evicting least-recently-used unpinned entries to make room, and
    /// returns it pinned. Refused (payload handed back) when it cannot fit.
    pub fn insert(
        &mut self,
        model: u64,
        tokens: Vec<u32>,
        bytes: u64,
        payload: P,
    ) -> Result<EntryId, (NotStored, P)> {
        let n = tokens.len();
        if n > self.budget.max_tokens || bytes > self.budget.max_bytes {
            self.stats.rejected += 1;
            let err = NotStored::TooLarge {
                tokens: n,
                bytes,
                max_tokens: self.budget.max_tokens,
                max_bytes: self.budget.max_bytes,
            };
            return Err((err, payload));
        }
        let hash = self.key_hash(model, &tokens);
        if self.find(model, &tokens).is_some() {
            return Err((NotStored::Duplicate, payload));
        }
        if let Err(err) = self.make_room(n, bytes, None) {
            return Err((err, payload));
        }
        let id = self.next_id;
        self.next_id += 1;
        let now = self.tick();
        self.by_hash.entry(hash).or_default().push(id);
        self.stats.tokens += n;
        self.stats.bytes += bytes;
        self.stats.entries += 1;
        self.stats.inserts += 1;
        self.record(StoreEvent::Stored(tokens.clone()));
        self.entries.insert(
            id,
            Entry {
                model,
                tokens,
                hash,
                bytes,
                pins: 1,
                last_use: now,
                payload,
            },
        );
        Ok(EntryId(id))
    }

    /// Evicts least-recently-used unpinned entries (never `keep`) until `tokens` and
    /// `bytes` more fit the budget; refuses, evicting nothing, when even evicting all of
    /// them would not make enough room.
    fn make_room(&mut self, tokens: usize, bytes: u64, keep: Option<u64>) -> Result<(), NotStored> {
        let held = |e: &Entry<P>, id: u64| e.pins > 0 || Some(id) == keep;
        let (held_tokens, held_bytes, held_count) = self
            .entries
            .iter()
            .filter(|(id, e)| held(e, **id))
            .fold((0usize, 0u64, 0usize), |(t, b, c), (_, e)| {
                (t + e.tokens.len(), b + e.bytes, c + 1)
            });
        if held_tokens + tokens > self.budget.max_tokens
            || held_bytes + bytes > self.budget.max_bytes
        {
            self.stats.rejected += 1;
            return Err(NotStored::AllPinned { pinned: held_count });
        }
        while self.stats.tokens + tokens > self.budget.max_tokens
            || self.stats.bytes + bytes > self.budget.max_bytes
        {
            let victim = self
                .entries
                .iter()
                .filter(|(id, e)| !held(e, **id))
                .min_by_key(|(_, e)| e.last_use)
                .map(|(id, _)| *id)
                .expect("unpinned entries free enough room");
            self.remove(victim);
            self.stats.evictions += 1;
        }
        Ok(())
    }

    /// Charges `bytes` more to entry `id` (a payload that grew, such as a new boundary
    /// state), evicting other unpinned entries to make room; refused, with nothing
    /// charged, when they cannot fit. The caller then keeps the addition out of the entry.
    pub fn charge(&mut self, id: EntryId, bytes: u64) -> Result<(), NotStored> {
        let Some(entry) = self.entries.get(&id.0) else {
            return Err(NotStored::Evicted);
        };
        let (tokens, total) = (entry.tokens.len(), entry.bytes.saturating_add(bytes));
        if total > self.budget.max_bytes {
            self.stats.rejected += 1;
            return Err(NotStored::TooLarge {
                tokens,
                bytes: total,
                max_tokens: self.budget.max_tokens,
                max_bytes: self.budget.max_bytes,
            });
        }
        self.make_room(0, bytes, Some(id.0))?;
        if let Some(e) = self.entries.get_mut(&id.0) {
            e.bytes += bytes;
        }
        self.stats.bytes += bytes;
        Ok(())
    }

    /// Live entries, tokens and bytes recounted from the entries themselves, and the pins
    /// held (for tests that check the counters against them).
    pub fn recount(&self) -> Recount {
        self.entries
            .values()
            .fold(Recount::default(), |r, e| Recount {
                entries: r.entries + 1,
                tokens: r.tokens + e.tokens.len(),
                bytes: r.bytes + e.bytes,
                pins: r.pins + e.pins,
            })
    }

    fn remove(&mut self, id: u64) -> Option<P> {
        let e = self.entries.remove(&id)?;
        if let Some(ids) = self.by_hash.get_mut(&e.hash) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.by_hash.remove(&e.hash);
            }
        }
        self.stats.tokens -= e.tokens.len();
        self.stats.bytes -= e.bytes;
        self.stats.entries -= 1;
        if let Some(events) = self.events.as_mut() {
            events.push(StoreEvent::Removed(e.tokens));
        }
        Some(e.payload)
    }

    /// Drops every entry no request is using (pinned entries stay); returns how many went.
    /// Counters other than the current sizes are kept.
    pub fn clear_unpinned(&mut self) -> usize {
        let victims: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| e.pins == 0)
            .map(|(id, _)| *id)
            .collect();
        let recorded = self.events.as_ref().map_or(0, Vec::len);
        for id in &victims {
            self.remove(*id);
        }
        // Everything went: one event says so.
        if self.entries.is_empty() && !victims.is_empty() {
            if let Some(events) = self.events.as_mut() {
                events.truncate(recorded);
                events.push(StoreEvent::Cleared);
            }
        }
        victims.len()
    }

    /// Ends one use of a pinned entry.
    pub fn release(&mut self, id: EntryId) {
        if let Some(e) = self.entries.get_mut(&id.0) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    pub fn payload(&self, id: EntryId) -> Option<&P> {
        self.entries.get(&id.0).map(|e| &e.payload)
    }

    pub fn tokens(&self, id: EntryId) -> Option<&[u32]> {
        self.entries.get(&id.0).map(|e| e.tokens.as_slice())
    }

    pub fn is_pinned(&self, id: EntryId) -> bool {
        self.entries.get(&id.0).is_some_and(|e| e.pins > 0)
    }

    pub fn contains(&self, id: EntryId) -> bool {
        self.entries.contains_key(&id.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn budget(tokens: usize, bytes: u64) -> StoreBudget {
        StoreBudget {
            max_tokens: tokens,
            max_bytes: bytes,
        }
    }

    #[test]
    fn hit_miss_and_lru_eviction_order() {
        let mut s = PrefixStore::new(budget(10, 1000));
        let a = s.insert(0, vec![1, 2, 3, 4], 100, "a").unwrap();
        let b = s.insert(0, vec![5, 6, 7], 100, "b").unwrap();
        s.release(a);
        s.release(b);
        assert_eq!(s.acquire(0, &[1, 2, 3, 4]), Some(a)); // a is now the most recent
        s.release(a);
        assert_eq!(s.acquire(0, &[9]), None);
        let c = s.insert(0, vec![8, 8, 8, 8], 100, "c").unwrap(); // 11 tokens: evict LRU = b
        assert!(!s.contains(b) && s.contains(a) && s.contains(c));
        let st = s.stats();
        assert_eq!(
            (st.hits, st.misses, st.evictions, st.entries, st.tokens),
            (1, 1, 1, 2, 8)
        );
    }

    #[test]
    fn clear_unpinned_keeps_entries_in_use() {
        let mut s = PrefixStore::new(budget(100, 1000));
        let a = s.insert(0, vec![1, 2], 10, "a").unwrap(); // stays pinned
        let b = s.insert(0, vec![3, 4, 5], 20, "b").unwrap();
        s.release(b);
        assert_eq!(s.clear_unpinned(), 1);
        assert!(s.contains(a) && !s.contains(b));
        assert_eq!(s.acquire(0, &[3, 4, 5]), None);
        let st = s.stats();
        assert_eq!((st.entries, st.tokens, st.bytes), (1, 2, 10));
    }

    #[test]
    fn pinned_entries_are_never_evicted_and_oversized_entries_are_refused() {
        let mut s = PrefixStore::new(budget(8, 1000));
        let a = s.insert(0, vec![1; 6], 10, 1).unwrap(); // pinned
        let (err, payload) = s.insert(0, vec![2; 4], 10, 2).unwrap_err();
        assert!(matches!(err, NotStored::AllPinned { pinned: 1 }), "{err}");
        assert_eq!(payload, 2);
        let (err, _) = s.insert(0, vec![3; 9], 10, 3).unwrap_err();
        assert!(
            err.to_string().contains("exceeds the cache budget"),
            "{err}"
        );
        let (err, _) = s.insert(0, vec![4; 2], 2000, 4).unwrap_err();
        assert!(matches!(err, NotStored::TooLarge { .. }));
        s.release(a);
        s.insert(0, vec![2; 4], 10, 2).unwrap();
        assert!(!s.contains(a));
        assert_eq!(s.stats().rejected, 3);
    }

    #[test]
    fn forced_hash_collisions_never_serve_the_wrong_entry() {
        let mut s = PrefixStore::with_hasher(budget(100, 1000), |_| 42);
        let a = s.insert(0, vec![1, 2, 3], 1, "a").unwrap();
        let b = s.insert(0, vec![1, 2, 4], 1, "b").unwrap();
        assert_ne!(a, b);
        assert_eq!(
            s.acquire(0, &[1, 2, 4])
                .and_then(|id| s.payload(id).copied()),
            Some("b")
        );
        assert_eq!(
            s.acquire(0, &[1, 2, 3])
                .and_then(|id| s.payload(id).copied()),
            Some("a")
        );
        assert_eq!(s.acquire(0, &[1, 2]), None);
        assert_eq!(s.acquire(0, &[1, 2, 3, 4]), None);
        assert!(matches!(
            s.insert(0, vec![1, 2, 3], 1, "dup"),
            Err((NotStored::Duplicate, _))
        ));
    }

    /// A long random sequence of acquire / insert / release against a model of the rules:
    /// budgets hold, pinned entries survive, evictions take the least recently used unpinned
    /// entry, and every hit returns exactly the requested tokens.
    #[test]
    fn random_sequences_keep_every_invariant() {
        for seed in 0..20u64 {
            let mut rng = SplitMix64(seed);
            let hasher: fn(&[u32]) -> u64 = if seed % 2 == 0 {
                hash_tokens
            } else {
                |t| t.len() as u64 % 3
            };
            let max_tokens = 40 + (rng.next_u64() % 40) as usize;
            let max_bytes = 400 + rng.next_u64() % 400;
            let mut s = PrefixStore::with_hasher(budget(max_tokens, max_bytes), hasher);
            let mut pinned: Vec<EntryId> = Vec::new();
            let mut last_use: HashMap<EntryId, u64> = HashMap::new();
            let mut clock = 0u64;
            let mut charged = 0;
            for _ in 0..2000 {
                clock += 1;
                // Prefixes drawn from a small family so hits, collisions and duplicates happen.
                let len = 1 + (rng.next_u64() % 12) as usize;
                let fam = rng.next_u64() % 4;
                let tokens: Vec<u32> = (0..len as u32).map(|i| i * 7 + fam as u32).collect();
                // Two models with the same prefixes: an entry never serves the other.
                let model = rng.next_u64() % 2;
                match rng.next_u64() % 4 {
                    0 => {
                        if let Some(id) = s.acquire(model, &tokens) {
                            assert_eq!(
                                s.tokens(id),
                                Some(tokens.as_slice()),
                                "seed {seed}: wrong entry served"
                            );
                            assert_eq!(
                                s.payload(id).map(|&(m, _)| m),
                                Some(model),
                                "seed {seed}: another model's entry served"
                            );
                            pinned.push(id);
                            last_use.insert(id, clock);
                        }
                    }
                    1 => {
                        let bytes = 10 * len as u64 + rng.next_u64() % 50;
                        let before: Vec<EntryId> = last_use
                            .keys()
                            .copied()
                            .filter(|id| s.contains(*id))
                            .collect();
                        if let Ok(id) = s.insert(model, tokens.clone(), bytes, (model, len)) {
                            let evicted: Vec<EntryId> = before
                                .iter()
                                .copied()
                                .filter(|id| !s.contains(*id))
                                .collect();
                            for e in &evicted {
                                assert!(
                                    !pinned.contains(e),
                                    "seed {seed}: a pinned entry was evicted"
                                );
                                // Every survivor that is unpinned was used no earlier than the victim.
                                for other in before
                                    .iter()
                                    .filter(|o| s.contains(**o) && !pinned.contains(o))
                                {
                                    assert!(
                                        last_use[other] >= last_use[e],
                                        "seed {seed}: eviction not LRU"
                                    );
                                }
                            }
                            pinned.push(id);
                            last_use.insert(id, clock);
                        }
                    }
                    2 => {
                        // A pinned entry grows (a new boundary state): charged or refused.
                        if !pinned.is_empty() {
                            let id = pinned[(rng.next_u64() % pinned.len() as u64) as usize];
                            let before = s.stats().bytes;
                            let extra = rng.next_u64() % 80;
                            match s.charge(id, extra) {
                                Ok(()) => charged += 1,
                                Err(_) => assert_eq!(s.stats().bytes, before),
                            }
                        }
                    }
                    _ => {
                        if !pinned.is_empty() {
                            let i = (rng.next_u64() % pinned.len() as u64) as usize;
                            s.release(pinned.swap_remove(i));
                        }
                    }
                }
                let st = s.stats();
                assert!(
                    st.tokens <= max_tokens && st.bytes <= max_bytes,
                    "seed {seed}: over budget"
                );
                let r = s.recount();
                assert_eq!(
                    (st.entries, st.tokens, st.bytes, pinned.len()),
                    (r.entries, r.tokens, r.bytes, r.pins),
                    "seed {seed}: counters differ from the entries"
                );
                for id in &pinned {
                    assert!(
                        s.contains(*id) && s.is_pinned(*id),
                        "seed {seed}: pinned entry lost"
                    );
                }
            }
            let st = s.stats();
            assert!(
                st.hits > 0 && st.evictions > 0 && charged > 0,
                "seed {seed}: the sequence exercised hits, evictions and charges: {st:?}"
            );
        }
    }

    #[test]
    fn entries_of_another_model_are_never_served() {
        let mut s = PrefixStore::new(budget(100, 1000));
        let a = s.insert(1, vec![1, 2, 3], 10, "model 1").unwrap();
        assert_eq!(s.acquire(2, &[1, 2, 3]), None);
        assert_eq!(s.peek(2, &[1, 2, 3]), None);
        let b = s.insert(2, vec![1, 2, 3], 10, "model 2").unwrap();
        assert_ne!(a, b);
        assert_eq!(s.acquire(1, &[1, 2, 3]), Some(a));
        assert_eq!(s.acquire(2, &[1, 2, 3]), Some(b));
    }

    #[test]
    fn a_stored_span_is_found_inside_a_prompt() {
        let mut s = PrefixStore::new(budget(100, 1000));
        s.insert(1, vec![5, 6, 7], 10, "span").unwrap();
        s.insert(1, vec![5, 6], 10, "shorter").unwrap();
        s.insert(2, vec![1, 5, 6, 7, 8], 10, "other model").unwrap();
        let prompt = [1, 5, 6, 7, 8, 5, 6, 7];
        assert_eq!(
            s.find_inside(1, &prompt, 1),
            Some((1, 3)),
            "the longest, first place"
        );
        assert_eq!(s.find_inside(1, &prompt, 4), None);
        assert_eq!(s.find_inside(1, &[5, 6, 9], 1), Some((0, 2)));
        assert_eq!(s.find_inside(3, &prompt, 1), None);
        assert_eq!(
            s.stats().hits + s.stats().misses,
            0,
            "finding counts nothing"
        );
    }

    #[test]
    fn growth_is_charged_to_the_budget_or_refused() {
        let mut s = PrefixStore::new(budget(100, 100));
        let a = s.insert(0, vec![1, 2], 40, "a").unwrap();
        let b = s.insert(0, vec![3], 40, "b").unwrap();
        s.release(b);
        // 40 + 40 + 30 > 100: b (unpinned) is evicted to make room.
        s.charge(a, 30).unwrap();
        assert!(!s.contains(b));
        assert_eq!(s.stats().bytes, 70);
        assert_eq!(s.recount().bytes, 70);
        // Past the budget on its own: refused, nothing charged.
        assert!(matches!(s.charge(a, 31), Err(NotStored::TooLarge { .. })));
        let c = s.insert(0, vec![4], 30, "c").unwrap(); // pinned
        assert!(matches!(s.charge(a, 1), Err(NotStored::AllPinned { .. })));
        assert_eq!(s.stats().bytes, 100);
        s.release(c);
    }

    #[test]
    fn pins_are_released_when_dropped_on_every_path() {
        let store: SharedStore<&str> = Arc::new(Mutex::new(PrefixStore::new(budget(100, 1000))));
        let id = store.lock().unwrap().insert(0, vec![1], 1, "a").unwrap();
        let pin = Pin::adopt(&store, id);
        let failing = |pin: Pin<&str>| -> Result<(), String> {
            let _held = pin;
            Err("a step failed".into())
        };
        assert!(failing(pin).is_err());
        assert_eq!(store.lock().unwrap().recount().pins, 0);
        // A pin inside an abandoned future goes with it.
        let id = store.lock().unwrap().acquire(0, &[1]).unwrap();
        let pin = Pin::adopt(&store, id);
        let fut = async move {
            let _held = pin;
            std::future::pending::<()>().await;
        };
        assert_eq!(store.lock().unwrap().recount().pins, 1);
        drop(fut);
        assert_eq!(store.lock().unwrap().recount().pins, 0);
    }

    #[test]
    fn recorded_events_follow_inserts_evictions_and_clears() {
        let mut s: PrefixStore<()> = PrefixStore::new(budget(10, 1 << 20));
        s.insert(1, vec![1, 2, 3], 1, ()).unwrap();
        assert!(
            s.take_events().is_empty(),
            "nothing is recorded unless asked"
        );
        s.record_events(true);
        let a = s.insert(1, vec![4, 5, 6, 7], 1, ()).unwrap();
        s.release(a);
        let all = s.peek(1, &[1, 2, 3]).unwrap();
        s.release(all);
        // 4 + 3 + 5 > 10: the least recently used entry ([1, 2, 3]) goes.
        s.insert(1, vec![8, 9, 10, 11, 12], 1, ()).unwrap();
        assert_eq!(
            s.take_events(),
            vec![
                StoreEvent::Stored(vec![4, 5, 6, 7]),
                StoreEvent::Removed(vec![1, 2, 3]),
                StoreEvent::Stored(vec![8, 9, 10, 11, 12]),
            ]
        );
        // A pinned entry stays: the clear removes only [4, 5, 6, 7].
        s.clear_unpinned();
        assert_eq!(s.take_events(), vec![StoreEvent::Removed(vec![4, 5, 6, 7])]);
        let pinned = s.peek(1, &[8, 9, 10, 11, 12]).unwrap();
        s.release(pinned);
        s.clear_unpinned();
        assert_eq!(s.take_events(), vec![StoreEvent::Cleared]);
    }
}
