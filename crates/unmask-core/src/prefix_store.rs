//! The BiCache prefix store: entries keyed by a hash of the prefix's token ids and confirmed
//! by a full comparison, evicted least-recently-used under a budget in tokens and in bytes,
//! and pinned while a request uses them. Generic over the payload (on the GPU: per-layer K/V
//! buffers and boundary hidden states), so the policy is tested without a device.

use std::collections::HashMap;

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
}

struct Entry<P> {
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

    /// The entry whose tokens equal `tokens` exactly, pinned for the caller; counts a hit or
    /// a miss. A hash match with different tokens is a miss, never served.
    pub fn acquire(&mut self, tokens: &[u32]) -> Option<EntryId> {
        let hash = (self.hasher)(tokens);
        let found = self.by_hash.get(&hash).and_then(|ids| {
            ids.iter()
                .copied()
                .find(|id| self.entries.get(id).is_some_and(|e| e.tokens == tokens))
        });
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

    /// The entry whose tokens equal `tokens`, without pinning it or counting a hit.
    pub fn peek(&self, tokens: &[u32]) -> Option<EntryId> {
        let hash = (self.hasher)(tokens);
        self.by_hash.get(&hash).and_then(|ids| {
            ids.iter()
                .copied()
                .find(|id| self.entries.get(id).is_some_and(|e| e.tokens == tokens))
                .map(EntryId)
        })
    }

    /// Stores a new entry, evicting least-recently-used unpinned entries to make room, and
    /// returns it pinned. Refused (payload handed back) when it cannot fit.
    pub fn insert(
        &mut self,
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
        let hash = (self.hasher)(&tokens);
        if self
            .by_hash
            .get(&hash)
            .is_some_and(|ids| ids.iter().any(|id| self.entries[id].tokens == tokens))
        {
            return Err((NotStored::Duplicate, payload));
        }
        // Evict only if the whole set of unpinned entries can make enough room.
        let pinned_tokens: usize = self
            .entries
            .values()
            .filter(|e| e.pins > 0)
            .map(|e| e.tokens.len())
            .sum();
        let pinned_bytes: u64 = self
            .entries
            .values()
            .filter(|e| e.pins > 0)
            .map(|e| e.bytes)
            .sum();
        if pinned_tokens + n > self.budget.max_tokens
            || pinned_bytes + bytes > self.budget.max_bytes
        {
            self.stats.rejected += 1;
            let pinned = self.entries.values().filter(|e| e.pins > 0).count();
            return Err((NotStored::AllPinned { pinned }, payload));
        }
        while self.stats.tokens + n > self.budget.max_tokens
            || self.stats.bytes + bytes > self.budget.max_bytes
        {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| e.pins == 0)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(id, _)| *id)
                .expect("unpinned entries free enough room");
            self.remove(victim);
            self.stats.evictions += 1;
        }
        let id = self.next_id;
        self.next_id += 1;
        let now = self.tick();
        self.by_hash.entry(hash).or_default().push(id);
        self.stats.tokens += n;
        self.stats.bytes += bytes;
        self.stats.entries += 1;
        self.stats.inserts += 1;
        self.entries.insert(
            id,
            Entry {
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
        for id in &victims {
            self.remove(*id);
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
        let a = s.insert(vec![1, 2, 3, 4], 100, "a").unwrap();
        let b = s.insert(vec![5, 6, 7], 100, "b").unwrap();
        s.release(a);
        s.release(b);
        assert_eq!(s.acquire(&[1, 2, 3, 4]), Some(a)); // a is now the most recent
        s.release(a);
        assert_eq!(s.acquire(&[9]), None);
        let c = s.insert(vec![8, 8, 8, 8], 100, "c").unwrap(); // 11 tokens: evict LRU = b
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
        let a = s.insert(vec![1, 2], 10, "a").unwrap(); // stays pinned
        let b = s.insert(vec![3, 4, 5], 20, "b").unwrap();
        s.release(b);
        assert_eq!(s.clear_unpinned(), 1);
        assert!(s.contains(a) && !s.contains(b));
        assert_eq!(s.acquire(&[3, 4, 5]), None);
        let st = s.stats();
        assert_eq!((st.entries, st.tokens, st.bytes), (1, 2, 10));
    }

    #[test]
    fn pinned_entries_are_never_evicted_and_oversized_entries_are_refused() {
        let mut s = PrefixStore::new(budget(8, 1000));
        let a = s.insert(vec![1; 6], 10, 1).unwrap(); // pinned
        let (err, payload) = s.insert(vec![2; 4], 10, 2).unwrap_err();
        assert!(matches!(err, NotStored::AllPinned { pinned: 1 }), "{err}");
        assert_eq!(payload, 2);
        let (err, _) = s.insert(vec![3; 9], 10, 3).unwrap_err();
        assert!(
            err.to_string().contains("exceeds the cache budget"),
            "{err}"
        );
        let (err, _) = s.insert(vec![4; 2], 2000, 4).unwrap_err();
        assert!(matches!(err, NotStored::TooLarge { .. }));
        s.release(a);
        s.insert(vec![2; 4], 10, 2).unwrap();
        assert!(!s.contains(a));
        assert_eq!(s.stats().rejected, 3);
    }

    #[test]
    fn forced_hash_collisions_never_serve_the_wrong_entry() {
        let mut s = PrefixStore::with_hasher(budget(100, 1000), |_| 42);
        let a = s.insert(vec![1, 2, 3], 1, "a").unwrap();
        let b = s.insert(vec![1, 2, 4], 1, "b").unwrap();
        assert_ne!(a, b);
        assert_eq!(
            s.acquire(&[1, 2, 4]).and_then(|id| s.payload(id).copied()),
            Some("b")
        );
        assert_eq!(
            s.acquire(&[1, 2, 3]).and_then(|id| s.payload(id).copied()),
            Some("a")
        );
        assert_eq!(s.acquire(&[1, 2]), None);
        assert_eq!(s.acquire(&[1, 2, 3, 4]), None);
        assert!(matches!(
            s.insert(vec![1, 2, 3], 1, "dup"),
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
            for _ in 0..2000 {
                clock += 1;
                // Prefixes drawn from a small family so hits, collisions and duplicates happen.
                let len = 1 + (rng.next_u64() % 12) as usize;
                let fam = rng.next_u64() % 4;
                let tokens: Vec<u32> = (0..len as u32).map(|i| i * 7 + fam as u32).collect();
                match rng.next_u64() % 3 {
                    0 => {
                        if let Some(id) = s.acquire(&tokens) {
                            assert_eq!(
                                s.tokens(id),
                                Some(tokens.as_slice()),
                                "seed {seed}: wrong entry served"
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
                        if let Ok(id) = s.insert(tokens.clone(), bytes, len) {
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
                for id in &pinned {
                    assert!(
                        s.contains(*id) && s.is_pinned(*id),
                        "seed {seed}: pinned entry lost"
                    );
                }
            }
            let st = s.stats();
            assert!(
                st.hits > 0 && st.evictions > 0,
                "seed {seed}: the sequence exercised hits and evictions: {st:?}"
            );
        }
    }
}
