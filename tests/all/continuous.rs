//! Continuous batching (`Engine::generate_continuous*`) on the tiny fixture: at most N
//! requests at once, a finished request's place taken at the next step, each result equal
//! to its run alone, sessions per prefix and depth, errors per request, a stop that leaves
//! nothing pinned.

use std::ops::ControlFlow;

use crate::common;

use common::{fixture_dir, params, shared_prefix as prefix, shared_prefix_prompt as prompt};

use unmask::{CacheMode, Engine, EngineOptions, GenerationParams, Request};
use unmask_gpu::WeightFormat;
use unmask_gpu::ops::matmul::MatmulKernel;

fn engine() -> Engine {
    let options = EngineOptions {
        backend: None,
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let mut engine = Engine::load_on(common::ctx(), &fixture_dir(), &options, &mut |_| {})
        .expect("tiny model loads");
    // One matmul kernel whatever the row count, so batched rows round exactly as alone.
    engine.set_matmul_kernel(MatmulKernel::Tiled);
    engine
}

fn shared(q: u32, mode: CacheMode, depth: usize, p: GenerationParams) -> Request {
    let mut req = Request::ids(prompt(q)).with_params(p).with_cache(mode);
    req.prefix_len = Some(prefix().len());
    req.depth = Some(depth);
    req.refresh_every = 4;
    req
}

/// What the callbacks saw, in event order: each request's first step and its end.
#[derive(Default)]
struct Seen {
    clock: usize,
    first_step: Vec<Option<usize>>,
    done: Vec<Option<usize>>,
    /// Most requests between their first step and their end at once.
    most_running: usize,
}

impl Seen {
    fn new(n: usize) -> Self {
        Self {
            first_step: vec![None; n],
            done: vec![None; n],
            ..Self::default()
        }
    }

    fn running(&self) -> usize {
        (0..self.done.len())
            .filter(|&i| self.first_step[i].is_some() && self.done[i].is_none())
            .count()
    }
}

#[test]
fn continuous_batching_refills_as_requests_finish_and_each_equals_its_run_alone() {
    let engine = engine();
    let mut too_long = shared(5, CacheMode::BicacheDual, 1, params(8, 4, 4));
    too_long.prefix_len = Some(1000);
    // A short request first and a long one second: the third must start while the
    // second still runs (a static batch of two would wait for both).
    let requests = vec![
        shared(0, CacheMode::BicacheDual, 1, params(4, 2, 4)),
        shared(1, CacheMode::BicacheDual, 1, params(16, 16, 4)),
        shared(2, CacheMode::BicacheDual, 1, params(8, 4, 4)),
        too_long,
        Request::ids(prompt(3))
            .with_params(params(8, 4, 4))
            .with_cache(CacheMode::FastDllmDual),
        shared(4, CacheMode::Bicache, 1, params(12, 6, 12)),
    ];
    let n = requests.len();
    let seen = std::cell::RefCell::new(Seen::new(n));
    let mut results: Vec<Option<Result<unmask::Generation, unmask::EngineError>>> =
        (0..n).map(|_| None).collect();
    pollster::block_on(engine.generate_continuous_async(
        &requests,
        2,
        &mut |i, _| {
            let mut s = seen.borrow_mut();
            s.clock += 1;
            if s.first_step[i].is_none() {
                s.first_step[i] = Some(s.clock);
            }
            let running = s.running();
            s.most_running = s.most_running.max(running);
        },
        &mut |i, g| {
            let mut s = seen.borrow_mut();
            s.clock += 1;
            s.done[i] = Some(s.clock);
            results[i] = Some(g);
            ControlFlow::Continue(())
        },
    ));
    let seen = seen.into_inner();
    assert_eq!(
        seen.most_running, 2,
        "at most 2 at once, and 2 at some point"
    );
    assert!(
        seen.first_step[2] < seen.done[1],
        "request 2 joined while request 1 ran: {:?} / {:?}",
        seen.first_step,
        seen.done
    );
    for (i, (req, got)) in requests.iter().zip(results).enumerate() {
        let got = got.unwrap_or_else(|| panic!("request {i} got no result"));
        if i == 3 {
            let err = got
                .expect_err("a prefix longer than the prompt")
                .to_string();
            assert!(err.contains("prefix_len") && err.contains("1000"), "{err}");
            continue;
        }
        let got = got.unwrap_or_else(|e| panic!("request {i}: {e}"));
        if let Some(report) = &got.bicache {
            assert!(report.fallback.is_none(), "request {i}: {report:?}");
            assert_eq!(report.depth, 1, "request {i}");
        }
        let alone = engine.generate(req).unwrap();
        assert_eq!(
            got.ids, alone.ids,
            "request {i}: in the queue and alone differ"
        );
        assert_eq!(got.steps, alone.steps, "request {i}: step records differ");
    }
    assert_eq!(engine.clear_prefix_store(), 1, "an entry was left pinned");
    eprintln!(
        "[continuous] 6 requests, 2 at once: the third joined while the second ran; each equals its run alone, the bad one its error"
    );
}

#[test]
fn continuous_batching_keeps_each_depth_and_stops_when_asked() {
    let engine = engine();
    // b = 2 opens a session at depth 2; the b = 1 request cannot join it (it would reuse a
    // layer more than it allows) and gets its own; the second b = 2 request joins the first.
    let requests = vec![
        shared(0, CacheMode::BicacheDual, 2, params(8, 4, 4)),
        shared(1, CacheMode::BicacheDual, 1, params(8, 4, 4)),
        shared(2, CacheMode::BicacheDual, 2, params(8, 4, 4)),
    ];
    let got = engine.generate_continuous(&requests, 3);
    for (i, (req, got)) in requests.iter().zip(got).enumerate() {
        let got = got.unwrap_or_else(|e| panic!("request {i}: {e}"));
        let report = got.bicache.clone().expect("a BiCache report");
        assert_eq!(Some(report.depth), req.depth, "request {i}: {report:?}");
        let alone = engine.generate(req).unwrap();
        assert_eq!(got.ids, alone.ids, "request {i}");
    }
    // Breaking at the first answer stops the rest and lets every pin go.
    let mut answers = 0;
    pollster::block_on(engine.generate_continuous_async(
        &requests,
        3,
        &mut |_, _| {},
        &mut |_, g| {
            g.expect("an answer");
            answers += 1;
            ControlFlow::Break(())
        },
    ));
    assert_eq!(answers, 1);
    let stored = engine.prefix_store_stats().entries;
    assert!(stored >= 1);
    assert_eq!(
        engine.clear_prefix_store(),
        stored,
        "an entry was left pinned"
    );
    eprintln!(
        "[continuous] depths 2, 1, 2: two sessions, each at its own depth; a stop leaves no pin"
    );
}

/// Requests whose longest one is over one storage binding's rows: the long one gets its
/// refusal and the others still run, packed by length in what the binding holds (slots of
/// the longest would leave them no room).
#[test]
fn continuous_batching_runs_the_rest_when_one_request_is_over_the_binding() {
    let probe = engine();
    let row_bytes = probe.model().state_row_bytes();
    drop(probe);
    // 100 rows of state fit one binding of this context.
    let ctx = common::ctx_with_binding_limit(100 * row_bytes as u64);
    let options = EngineOptions {
        backend: None,
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let mut engine =
        Engine::load_on(ctx, &fixture_dir(), &options, &mut |_| {}).expect("tiny model loads");
    engine.set_matmul_kernel(MatmulKernel::Tiled);
    assert_eq!(engine.model().max_state_rows(), 100);
    let short = |q: u32| Request::ids(vec![3 + q, 4, 5, 6]).with_params(params(32, 8, 32));
    let requests = vec![
        short(0),
        Request::ids(vec![3, 4, 5, 6]).with_params(params(128, 8, 32)),
        short(1),
        short(2),
    ];
    let results = engine.generate_continuous(&requests, 2);
    for (i, r) in results.iter().enumerate() {
        if i == 1 {
            let e = r.as_ref().expect_err("over the binding").to_string();
            assert!(e.contains("132"), "{e}");
        } else {
            let g = r.as_ref().unwrap_or_else(|e| panic!("request {i}: {e}"));
            let alone = engine.generate(&requests[i]).unwrap();
            assert_eq!(g.ids, alone.ids, "request {i}");
        }
    }
    eprintln!(
        "[continuous] a request over the binding's 100 rows refused, the 3 others run and equal their runs alone"
    );
}
