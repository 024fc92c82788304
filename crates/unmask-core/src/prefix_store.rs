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
mod tests;
