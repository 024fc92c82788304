//! dLLM-Cache: the adaptive refresh against the numpy reference (tools/dllm_cache_ref.py,
//! goldens/dllm_cache.json: the rows V-verify picks in every layer and the tokens at
//! temperature 0), its exact limit (ρ = 1 with the prompt refreshed every forward is the
//! uncached model), and a wrong rule (the most similar rows recomputed) that changes the
//! commits.

use unmask::{AdaptiveRefresh, CacheMode, EngineError, Request};
use unmask_core::adaptive::VerifyPick;

use crate::common::{self, params};

fn goldens() -> Vec<serde_json::Value> {
    let path = common::fixture_dir().join("goldens/dllm_cache.json");
    let text = std::fs::read_to_string(&path)
        .expect("goldens/dllm_cache.json (tools/dllm_cache_ref.py --write-goldens)");
    unmask_goldens::cases(&text)
}

use unmask_goldens::ids as numbers;

fn golden_request(case: &serde_json::Value) -> Request {
    let n = |k: &str| case[k].as_u64().expect(k) as usize;
    let mut r = Request::ids(numbers(&case["prompt"]))
        .with_params(params(n("gen_length"), n("steps"), n("block_length")))
        .with_cache(CacheMode::DllmCache)
        .with_full_canvas();
    r.adaptive = AdaptiveRefresh {
        prompt_interval: n("prompt_interval"),
        response_interval: n("response_interval"),
        refresh_ratio: case["refresh_ratio"].as_f64().expect("ratio") as f32,
        pick: VerifyPick::LowestCosine,
        pin_block: case["pin_block"].as_bool().expect("pin_block"),
    };
    r.record_picks = true;
    r
}

/// The runtime picks the reference's rows in every layer of every V-verify step and
/// commits its tokens.
#[test]
fn picks_and_tokens_match_the_numpy_reference() {
    let engine = common::tiny_engine();
    for case in goldens() {
        let name = case["name"].as_str().unwrap_or("?");
        let out = engine.generate(&golden_request(&case)).expect("generation");
        let report = out.adaptive.as_ref().expect("a dLLM-Cache report");
        let trace = case["steps_trace"].as_array().expect("trace");
        assert_eq!(
            report.picks.len(),
            trace.len(),
            "{name}: one entry per step"
        );
        for (i, (got, step)) in report.picks.iter().zip(trace).enumerate() {
            let want: Vec<Vec<u32>> = step["verified"]
                .as_array()
                .expect("verified")
                .iter()
                .map(|layer| numbers(&layer["rows"]))
                .collect();
            assert_eq!(got, &want, "{name}: rows picked at step {i}");
            let committed = numbers(&step["committed"]);
            let record: Vec<u32> = out.steps[i].committed.iter().map(|c| c.0).collect();
            assert_eq!(record, committed, "{name}: positions committed at step {i}");
        }
        assert_eq!(out.ids, numbers(&case["output"]), "{name}: tokens");
        let verified = trace
            .iter()
            .filter(|t| t["verified"] != serde_json::json!([]))
            .count();
        assert_eq!(
            report.verify_steps,
            if report.refresh_ratio > 0.0 {
                verified
            } else {
                0
            }
        );
        eprintln!(
            "[dllm-cache] {name}: {} V-verify steps, picks and tokens equal the reference's",
            report.verify_steps
        );
    }
}

/// ρ = 1 with the prompt refreshed every forward recomputes every row of every layer: the
/// same tokens and confidences as no cache, bit for bit, with and without blocks.
#[test]
fn refresh_ratio_one_is_a_full_recompute() {
    let engine = common::tiny_engine();
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 300 + 1).collect();
    for block in [16, 4] {
        let none = Request::ids(prompt.clone()).with_params(params(16, 16, block));
        let mut full = none.clone().with_cache(CacheMode::DllmCache);
        full.adaptive = AdaptiveRefresh {
            prompt_interval: 1,
            response_interval: 5,
            refresh_ratio: 1.0,
            pick: VerifyPick::LowestCosine,
            pin_block: true,
        };
        // Every prediction of every step: (position, token, confidence bits).
        let run = |r: &Request| {
            let mut seen: Vec<(u32, u32, u32)> = Vec::new();
            let out = engine
                .generate_with(r, &mut |e| {
                    seen.extend(
                        e.rows
                            .iter()
                            .zip(e.predictions)
                            .map(|(&p, &(t, c))| (p, t, c.to_bits())),
                    )
                })
                .expect("generation");
            (out, seen)
        };
        let (want, want_seen) = run(&none);
        let (got, got_seen) = run(&full);
        let report = got.adaptive.as_ref().expect("report");
        // Blocks of 4: the block is pinned, V-verify picks the 12 others.
        let picked = if block == 16 { 16 } else { 12 };
        assert!(report.verify_steps > 0 && report.recomputed_rows == picked);
        assert_eq!(got.ids, want.ids, "block {block}: tokens");
        assert_eq!(
            got_seen, want_seen,
            "block {block}: every prediction and confidence"
        );
        assert!(got.timings.verified_row_layers > 0);
    }
}

/// Recomputing the rows whose V moved least, not most, is a wrong cache: its commits
/// differ from the reference rule's on the golden requests.
#[test]
fn the_most_similar_rows_recomputed_change_the_commits() {
    let engine = common::tiny_engine();
    let mut changed = Vec::new();
    for case in goldens()
        .iter()
        .filter(|c| c["refresh_ratio"].as_f64() != Some(0.0))
    {
        let mut wrong = golden_request(case);
        wrong.adaptive.pick = VerifyPick::HighestCosine;
        let out = engine.generate(&wrong).expect("generation");
        let right = numbers(&case["output"]);
        if out.ids != right {
            changed.push(case["name"].as_str().unwrap_or("?").to_string());
        }
    }
    assert!(
        !changed.is_empty(),
        "no golden request changed under the wrong rule"
    );
    eprintln!("[dllm-cache] the most similar rows recomputed change {changed:?}");
}

#[test]
fn bad_settings_are_refused_with_the_field() {
    let engine = common::tiny_engine();
    let base = Request::ids(vec![5, 6, 7])
        .with_params(params(8, 8, 8))
        .with_cache(CacheMode::DllmCache);
    let mut zero = base.clone();
    zero.adaptive.prompt_interval = 0;
    let mut ratio = base.clone();
    ratio.adaptive.refresh_ratio = f32::NAN;
    let mut guided = base;
    guided.params.cfg_scale = 1.0;
    for (r, field) in [
        (zero, "prompt_interval"),
        (ratio, "refresh_ratio"),
        (guided, "cfg_scale"),
    ] {
        match engine.generate(&r) {
            Err(EngineError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!(
                "{field}: expected a refusal, got {:?}",
                other.map(|g| g.ids)
            ),
        }
    }
}

/// A BiCache-sharing dLLM-Cache request on the fixture's shared prefix.
fn shared_request(
    q: u32,
    (mode, block): (CacheMode, usize),
    depth: usize,
    adaptive: AdaptiveRefresh,
) -> Request {
    let mut r = Request::ids(common::shared_prefix_prompt(q))
        .with_params(params(16, 8, block))
        .with_cache(mode);
    r.prefix_len = Some(common::shared_prefix().len());
    r.depth = Some(depth);
    r.refresh_every = 1;
    r.adaptive = adaptive;
    r
}

/// bicache-dllm at depth 0 reads nothing from the entry (the prefix rows enter layer 0 from
/// the entry's boundary state, their embeddings): it equals dllm-cache. With every part
/// refreshed at every forward it equals bicache refreshing its deep prefix every step, at
/// any depth (one block: BiCache refreshes every R steps only then). And a second request
/// reads the stored entry.
#[test]
fn bicache_dllm_composes_exactly() {
    let engine = common::tiny_engine();
    let settings = AdaptiveRefresh {
        prompt_interval: 3,
        response_interval: 3,
        refresh_ratio: 0.5,
        ..AdaptiveRefresh::default()
    };
    for q in [0, 1] {
        let plain = engine
            .generate(&shared_request(q, (CacheMode::DllmCache, 4), 0, settings))
            .expect("dllm-cache");
        let composed = engine
            .generate(&shared_request(q, (CacheMode::BicacheDllm, 4), 0, settings))
            .expect("bicache-dllm");
        let report = composed.bicache.as_ref().expect("a BiCache report");
        assert!(report.fallback.is_none(), "{report:?}");
        assert_eq!(
            composed.ids, plain.ids,
            "question {q}: depth 0 equals dllm-cache"
        );
    }
    let every = AdaptiveRefresh {
        prompt_interval: 1,
        response_interval: 1,
        ..settings
    };
    for depth in [1, 2] {
        let want = engine
            .generate(&shared_request(0, (CacheMode::Bicache, 16), depth, every))
            .expect("bicache");
        let got = engine
            .generate(&shared_request(
                0,
                (CacheMode::BicacheDllm, 16),
                depth,
                every,
            ))
            .expect("bicache-dllm");
        assert_eq!(
            got.ids, want.ids,
            "depth {depth}: equals bicache refreshing every step"
        );
        assert!(
            got.bicache.as_ref().is_some_and(|r| r.hit),
            "the entry is reused"
        );
    }
    eprintln!("[dllm-cache] bicache-dllm: depth 0 equals dllm-cache, refresh-all equals bicache");
}

/// Several dLLM-Cache requests step together in one session (one adaptive pass over all
/// their rows, each with its own caches and V-verify picks) and give what each gives alone;
/// a request of another mode is refused by that session.
#[test]
fn dllm_cache_requests_batch_with_their_own_caches() {
    let engine = common::tiny_engine();
    let request = |q: u32, ratio: f32| {
        let mut r = Request::ids(common::shared_prefix_prompt(q))
            .with_params(params(16, 8, 4))
            .with_cache(CacheMode::DllmCache)
            .with_full_canvas();
        r.adaptive.refresh_ratio = ratio;
        r.adaptive.response_interval = 3;
        r
    };
    let requests = [request(0, 0.25), request(1, 0.5), request(2, 0.0)];
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| engine.generate(r).expect("alone").ids)
        .collect();
    let mut session = engine.session(None, 256).expect("a session");
    let ids: Vec<usize> = requests
        .iter()
        .map(|r| session.submit(r.clone()).expect("joins"))
        .collect();
    let other = Request::ids(common::shared_prefix_prompt(3)).with_params(params(16, 8, 4));
    assert!(
        matches!(
            session.submit(other),
            Err(EngineError::Refused(unmask::Refusal::OtherCache { .. }))
        ),
        "a none request does not join dLLM-Cache members"
    );
    let mut got = std::collections::HashMap::new();
    let mut most_running = 0;
    while got.len() < requests.len() {
        let done = session.step();
        most_running = most_running.max(session.running() + done.len());
        for (id, g) in done {
            got.insert(id, g.expect("batched").ids);
        }
    }
    assert_eq!(most_running, 3, "all three ran in the same steps");
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(got[id], alone[k], "request {k}: batched equals alone");
    }
}
