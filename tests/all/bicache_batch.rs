//! BiCache requests run together: a batch equals each request alone at its smallest depth,
//! groups requests by prefix and keeps their order, runs uncached over the budget; a session
//! admits requests while others run, refuses what it cannot run, and serves continuously.

use crate::bicache::{at_depth, bicache_request, engine, engine_with};
use crate::common;

use common::{params, shared_prefix as prefix, shared_prefix_prompt as prompt};

use unmask::{CacheBudget, CacheMode, GenerationParams, Request};
use unmask_gpu::ops::matmul::MatmulKernel;

fn key(depth: usize) -> unmask::PrefixKey {
    unmask::PrefixKey {
        tokens: prefix(),
        depth,
    }
}

#[test]
fn a_batch_equals_each_request_alone_at_the_smallest_depth() {
    // One matmul kernel whatever the row count, so batched rows round exactly as alone.
    let mut engine = engine();
    engine.set_matmul_kernel(MatmulKernel::Tiled);
    // One block refreshing every 4 steps, four dual blocks, and a shorter request that
    // finishes first and leaves the batch while the others go on.
    let requests = [
        bicache_request(0, CacheMode::Bicache, 2, 4, params(12, 6, 12)),
        bicache_request(1, CacheMode::BicacheDual, 1, 4, params(16, 8, 4)),
        bicache_request(2, CacheMode::BicacheDual, 2, 4, params(8, 4, 4)),
    ];
    let mut steps_seen = [0usize; 3];
    let batch =
        pollster::block_on(engine.generate_batch_async(&requests, &mut |i, _| steps_seen[i] += 1));
    let p = prefix().len();
    let n_layers = engine.config().n_layers;
    for (i, (req, got)) in requests.iter().zip(batch).enumerate() {
        let got = got.unwrap_or_else(|e| panic!("request {i}: {e}"));
        let report = got.bicache.clone().expect("a BiCache report");
        assert!(report.fallback.is_none(), "{report:?}");
        assert_eq!((report.batch, report.depth), (3, 1), "{report:?}");
        assert_eq!(Some(report.requested_depth), req.depth);
        assert_eq!(steps_seen[i], got.steps.len(), "one callback per step");
        let alone = engine.generate(&at_depth(req, 1)).unwrap();
        assert_eq!(alone.bicache.as_ref().unwrap().batch, 1);
        assert_eq!(got.ids, alone.ids, "request {i}: batched and alone differ");
        assert_eq!(got.steps, alone.steps, "request {i}: step records differ");
        // The batch's first request built the entry; every other run found it.
        let build = if report.hit { 0 } else { p * n_layers };
        assert_eq!(
            got.timings.token_layer_passes - build,
            alone.timings.token_layer_passes,
            "request {i}"
        );
    }
    let stats = engine.prefix_store_stats();
    assert_eq!((stats.misses, stats.hits, stats.entries), (1, 5, 1));
    assert_eq!(
        engine.clear_prefix_store(),
        1,
        "a request left the entry pinned"
    );
    eprintln!("[bicache] batch of 3 at b = min(2, 1, 2): tokens and steps equal each run alone");
}

/// A prompt whose shared prefix differs from `prefix()` in its first token.
fn other_prompt(question: u32) -> Vec<u32> {
    let mut p = prompt(question);
    p[1] = 301;
    p
}

#[test]
fn a_batch_groups_requests_by_prefix_and_keeps_their_order() {
    let engine = engine();
    let mut other = bicache_request(4, CacheMode::BicacheDual, 2, 4, params(8, 4, 4));
    other.prompt = unmask::Prompt::Ids(other_prompt(4));
    let mut too_long = bicache_request(5, CacheMode::Bicache, 1, 4, params(8, 8, 8));
    too_long.prefix_len = Some(1000);
    let noisy = |q, seed| {
        let p = GenerationParams {
            temperature: 0.8,
            seed,
            ..params(8, 4, 4)
        };
        bicache_request(q, CacheMode::BicacheDual, 2, 4, p)
    };
    let requests = [
        noisy(0, 7),
        Request::ids(prompt(1)).with_params(params(8, 8, 8)),
        other,
        too_long,
        noisy(3, 8),
    ];
    let batch = engine.generate_batch(&requests);
    let expect_batch = [Some(2), None, Some(1), None, Some(2)];
    for (i, (req, got)) in requests.iter().zip(batch).enumerate() {
        if i == 3 {
            let err = got
                .expect_err("a prefix longer than the prompt")
                .to_string();
            assert!(err.contains("prefix_len") && err.contains("1000"), "{err}");
            continue;
        }
        let got = got.unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(
            got.bicache.as_ref().map(|r| r.batch),
            expect_batch[i],
            "request {i}"
        );
        let alone = engine.generate(req).unwrap();
        assert_eq!(got.ids, alone.ids, "request {i}: batched and alone differ");
    }
    assert_eq!(engine.prefix_store_stats().entries, 2);
    eprintln!(
        "[bicache] 5 requests: two share a prefix (T > 0, different seeds), one has its own, one runs none, one is refused; each equals its run alone"
    );
}

#[test]
fn a_batch_over_the_budget_runs_each_request_uncached() {
    let small = engine_with(CacheBudget {
        max_tokens: 8,
        max_bytes: 1 << 30,
    });
    let requests = [
        bicache_request(0, CacheMode::BicacheDual, 1, 4, params(8, 4, 4)),
        bicache_request(1, CacheMode::BicacheDual, 1, 4, params(8, 4, 4)),
    ];
    for (req, got) in requests.iter().zip(small.generate_batch(&requests)) {
        let got = got.unwrap();
        let why = got.bicache.as_ref().unwrap().fallback.clone().unwrap();
        assert!(
            why.contains("fast-dllm-dual") && why.contains("budget"),
            "{why}"
        );
        let mut dual = req.clone();
        dual.cache = CacheMode::FastDllmDual;
        assert_eq!(got.ids, small.generate(&dual).unwrap().ids);
    }
    assert_eq!(small.prefix_store_stats().entries, 0);
}

#[test]
fn a_session_admits_requests_while_others_run() {
    let mut engine = engine();
    engine.set_matmul_kernel(MatmulKernel::Tiled);
    let p = prefix().len();
    let short = |q| bicache_request(q, CacheMode::BicacheDual, 1, 4, params(8, 4, 4));
    let long = bicache_request(1, CacheMode::Bicache, 2, 4, params(16, 8, 16));
    // Room for the first two requests only (prompt 33 + gen 8, prompt 33 + gen 16).
    let rows = 2 * prompt(0).len() + 8 + 16 + 5;
    let mut finished = std::collections::BTreeMap::new();
    {
        let mut session = engine.session(Some(&key(1)), rows).unwrap();
        let a = session.submit(short(0)).unwrap();
        let b = session.submit(long.clone()).unwrap();
        assert!(session.step().is_empty());
        assert_eq!((session.running(), session.waiting()), (2, 0));
        // Submitted while the others run: it waits for room, then joins the batch.
        let c = session.submit(short(2)).unwrap();
        let mut waited = 0;
        while !session.is_idle() {
            if session.waiting() > 0 {
                waited += 1;
            }
            for (id, g) in session.step() {
                finished.insert(id, g.unwrap_or_else(|e| panic!("request {id}: {e}")));
            }
        }
        assert!(waited > 0, "the third request never had to wait");
        assert_eq!(finished.keys().copied().collect::<Vec<_>>(), vec![a, b, c]);
        assert_eq!(finished[&c].bicache.as_ref().unwrap().batch, 2);
    }
    for (id, req) in [short(0), long, short(2)].iter().enumerate() {
        let got = &finished[&id];
        assert_eq!(got.bicache.as_ref().unwrap().depth, 1);
        let alone = engine.generate(&at_depth(req, 1)).unwrap();
        assert_eq!(
            got.ids, alone.ids,
            "request {id}: in the session and alone differ"
        );
        assert_eq!(got.steps, alone.steps, "request {id}");
    }
    assert_eq!(
        engine.clear_prefix_store(),
        1,
        "the session left the entry pinned"
    );
    eprintln!(
        "[bicache] session of {rows} rows, prefix {p}: a request joined mid-run; each equals its run alone"
    );
}

#[test]
fn a_session_refuses_what_it_cannot_run() {
    let engine = engine();
    let too_small = engine.session(Some(&key(1)), prefix().len());
    assert!(too_small.err().unwrap().to_string().contains("max_rows"));
    let mut session = engine.session(Some(&key(1)), 200).unwrap();
    let mut other = bicache_request(0, CacheMode::Bicache, 1, 4, params(8, 8, 8));
    other.prompt = unmask::Prompt::Ids(other_prompt(0));
    let mut shallower = bicache_request(0, CacheMode::Bicache, 0, 4, params(8, 8, 8));
    shallower.depth = Some(0);
    let plain = Request::ids(prompt(0)).with_params(params(8, 8, 8));
    let huge = bicache_request(0, CacheMode::Bicache, 1, 4, params(200, 200, 200));
    for (req, expect) in [
        (other, "not the session's"),
        (shallower, "below the session's b = 1"),
        (plain, "BiCache requests only"),
        (huge, "the session holds 200"),
    ] {
        let err = session.submit(req).expect_err(expect).to_string();
        assert!(err.contains(expect), "{err}");
    }
    assert!(session.is_idle());
}

#[test]
fn serving_continuously_equals_each_request_alone() {
    let mut engine = engine();
    engine.set_matmul_kernel(MatmulKernel::Tiled);
    let mut other = bicache_request(3, CacheMode::BicacheDual, 2, 4, params(8, 4, 4));
    other.prompt = unmask::Prompt::Ids(other_prompt(3));
    let requests = [
        bicache_request(0, CacheMode::BicacheDual, 2, 4, params(8, 4, 4)),
        bicache_request(1, CacheMode::BicacheDual, 1, 4, params(16, 8, 4)),
        bicache_request(2, CacheMode::Bicache, 2, 4, params(8, 8, 8)),
        other,
    ];
    let (served, entry_passes) = unmask_bench::serve_continuously(&engine, &requests, 2).unwrap();
    let n_layers = engine.config().n_layers;
    assert_eq!(
        entry_passes,
        2 * prefix().len() * n_layers,
        "two entries built"
    );
    // The first three share a prefix (session depth min(2, 1, 2) = 1); the last is alone.
    for (i, (req, got)) in requests.iter().zip(&served).enumerate() {
        let depth = if i < 3 { 1 } else { 2 };
        let report = got.bicache.as_ref().unwrap();
        assert_eq!(report.depth, depth, "request {i}");
        let alone = engine.generate(&at_depth(req, depth)).unwrap();
        assert_eq!(got.ids, alone.ids, "request {i}: served and alone differ");
    }
    assert_eq!(served[0].bicache.as_ref().unwrap().batch, 2);
    assert_eq!(served[3].bicache.as_ref().unwrap().batch, 1);
}
