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
