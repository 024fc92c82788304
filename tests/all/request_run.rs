//! `Engine::start` / `RequestRun`: a request run one step at a time gives exactly what
//! `generate` gives, in every cache mode; dropping a run midway frees what it held.

use crate::common;

use common::params;

use unmask::{CacheMode, Request};

/// A 24-token shared prefix and a question, shared at depth 1.
fn request(mode: CacheMode, question: u32) -> Request {
    let mut r = Request::ids(common::shared_prefix_prompt(question))
        .with_params(params(16, 8, 8))
        .with_cache(mode);
    r.prefix_len = Some(common::shared_prefix().len());
    r.depth = Some(1);
    r
}

#[test]
fn stepping_equals_generate_in_every_mode() {
    let engine = common::tiny_engine();
    for mode in CacheMode::ALL {
        let req = request(mode, 3);
        let whole = engine.generate(&req).expect("generates");
        let mut run = engine.start(req).expect("starts");
        let mut events = 0;
        let generation = loop {
            if let Some(g) = run.step(&mut |_| events += 1).expect("steps") {
                break g;
            }
        };
        assert!(run.is_done());
        assert!(
            run.step(&mut |_| {}).is_err(),
            "{mode}: a step after the end"
        );
        assert_eq!(generation.ids, whole.ids, "{mode}: tokens");
        assert_eq!(events, whole.steps.len(), "{mode}: one event per step");
        assert_eq!(run.steps(), whole.steps.len(), "{mode}: steps counted");
        assert_eq!(
            generation.bicache.as_ref().map(|b| b.fallback.is_some()),
            whole.bicache.as_ref().map(|b| b.fallback.is_some()),
            "{mode}: the same BiCache path"
        );
    }
}

#[test]
fn a_dropped_run_unpins_and_frees_its_state() {
    // Its own context: the live-byte count of the shared one moves with the tests that
    // run beside this one.
    let ctx = unmask_gpu::GpuContext::new(&common::options()).expect("GPU adapter");
    let options = unmask::EngineOptions {
        weight_format: unmask_gpu::WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    let engine = unmask::Engine::load_on(ctx, &common::fixture_dir(), &options, &mut |_| {})
        .expect("tiny model loads");
    let modes = [CacheMode::Bicache, CacheMode::FastDllmDual];
    // A first request of each mode stores the prefix entry and fills the read-back ring.
    for mode in modes {
        engine.generate(&request(mode, 5)).expect("generates");
    }
    let live = engine.ctx().memory.live_bytes();
    for mode in modes {
        let mut run = engine.start(request(mode, 5)).expect("starts");
        run.step(&mut |_| {}).expect("steps");
        run.step(&mut |_| {}).expect("steps");
        if mode.is_bicache() {
            // The session's pin, which its first request runs under.
            assert_eq!(
                engine.prefix_store_recount().pins,
                1,
                "{mode}: pinned while it runs"
            );
        }
        drop(run);
        assert_eq!(engine.prefix_store_recount().pins, 0, "{mode}: unpinned");
    }
    assert_eq!(
        engine.ctx().memory.live_bytes(),
        live,
        "the runs' GPU state is freed"
    );
}
