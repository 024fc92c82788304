//! `Engine::start` / `RequestRun`: a request run one step at a time gives exactly what
//! `generate` gives, in every cache mode; dropping a run midway frees what it held; a
//! request ends as soon as its answer is final, with the text of the full canvas; each
//! committed token's log-probability is the model's at the step that committed it.

use crate::common;

use common::{params, steps};

use unmask::{CacheMode, DecodeMode, Request};

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

/// On the bundled model's demo question (gen 32 in 8 blocks of 4, 16 steps) the answer
/// and its end token are committed in the first blocks: the request ends there, with the
/// full canvas's text, in fewer steps, forward passes and token-layer passes, in every
/// mode that matters for serving. Raw decoding (the whole canvas is the text) runs to the
/// end.
#[test]
fn the_demo_question_finishes_when_its_answer_is_final() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let engine = common::bundled_engine();
    let system = std::fs::read_to_string(root.join("data/tasks/demo-system.txt")).unwrap();
    let ask = |mode| {
        Request::chat(Some(system.trim_end()), "What is the city of Bella?")
            .with_params(params(32, 16, 4))
            .with_cache(mode)
    };
    for mode in [
        CacheMode::None,
        CacheMode::BicacheDual,
        CacheMode::DllmCache,
    ] {
        let early = engine.generate(&ask(mode)).expect("early");
        let full = engine
            .generate(&ask(mode).with_full_canvas())
            .expect("full");
        let (e, f) = (&early.timings, &full.timings);
        assert_eq!(early.text, full.text, "{mode}: the same answer");
        assert!(
            early.text.as_deref().is_some_and(|t| t.contains("Lima")),
            "{mode}"
        );
        assert!(e.finished_early && !f.finished_early, "{mode}");
        assert_eq!((f.steps, f.steps_skipped), (16, 0), "{mode}");
        assert!(
            e.steps < 16 && e.steps + e.steps_skipped == 16,
            "{mode}: {e:?}"
        );
        assert_eq!(e.forward_passes_skipped, e.steps_skipped);
        assert!(e.forward_passes < f.forward_passes, "{mode}");
        assert!(e.token_layer_passes < f.token_layer_passes, "{mode}");
        eprintln!(
            "[early finish] {mode}: {} of 16 steps, {} of {} token-layer passes, text {:?}",
            e.steps,
            e.token_layer_passes,
            f.token_layer_passes,
            early.text.as_deref().unwrap_or("")
        );
    }
    let mut raw = ask(CacheMode::None);
    raw.decode = DecodeMode::Raw;
    let out = engine.generate(&raw).expect("raw");
    assert!(!out.timings.finished_early && out.timings.steps == 16);
}

/// Asked for, every committed token carries its log-probability and its step's most likely
/// ids: with no cache, those of the log softmax at its position of a full forward over the
/// canvas the step saw (the canvas after it with that step's commits masked again). Tokens
/// are those of a run without; the generation holds one per committed position and none
/// elsewhere.
#[test]
fn each_token_carries_its_log_probability_at_commit() {
    const TOP: usize = 3;
    let engine = common::tiny_engine();
    let mask = engine.model().cfg.mask_token_id;
    for mode in [CacheMode::None, CacheMode::FastDllmDual] {
        let plain = engine.generate(&request(mode, 3)).expect("plain");
        assert!(plain.logprobs.is_none(), "{mode}: not asked for");
        let mut req = request(mode, 3);
        req.top_logprobs = TOP;
        let (generation, seen) = steps::run_recording(&engine, req);
        assert_eq!(generation.ids, plain.ids, "{mode}: the same tokens");
        let lps = generation.logprobs.expect("log-probabilities");
        for (i, (&t, lp)) in generation.ids.iter().zip(&lps).enumerate() {
            assert_eq!(t != mask, lp.is_some(), "{mode}: position {i}");
            let Some(lp) = lp else { continue };
            assert!(
                lp.logprob <= 0.0 && lp.top.len() == TOP,
                "{mode}: position {i} {lp:?}"
            );
            // Greedy decoding commits the most likely id: the first alternative.
            assert_eq!(lp.top[0], (t, lp.logprob), "{mode}: position {i}");
            assert!(
                lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
                "{mode}: {lp:?}"
            );
        }
        if mode != CacheMode::None {
            continue;
        }
        let (worst, tokens) = steps::worst_logprob_error(&engine, &seen, &|_| Vec::new());
        eprintln!(
            "[check] {mode}: {tokens} tokens' log-probabilities and top {TOP} over {} steps, worst error {worst:.2e}",
            seen.len()
        );
        assert!(tokens > 0);
        assert!(worst < 1e-3, "{mode}: log-probabilities off by {worst}");
    }
}
