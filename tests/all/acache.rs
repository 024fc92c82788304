//! ACache: the span's K/V from a span-only pass placed at the request's offset, the anchors
//! of the probe pass, the dual-cache schedule that recomputes them; against the numpy
//! reference (tools/acache_ref.py, goldens/acache.json), against the dual cache it is built
//! on, through the shared store, and on the bundled model's affix task set.

use unmask::{CacheMode, Engine, EngineError, EngineOptions, Request, Span};

use crate::common::{self, params};

fn goldens() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(common::fixture_dir().join("goldens/acache.json"))
        .expect("goldens/acache.json (tools/acache_ref.py --write-goldens)");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    v["cases"].as_array().expect("cases").clone()
}

fn numbers(v: &serde_json::Value) -> Vec<usize> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|n| n.as_u64().expect("a whole number") as usize)
        .collect()
}

/// The golden case's request.
fn golden_request(case: &serde_json::Value) -> Request {
    let prompt: Vec<u32> = numbers(&case["prompt"])
        .into_iter()
        .map(|t| t as u32)
        .collect();
    let span = numbers(&case["span"]);
    let n = |k: &str| case[k].as_u64().expect(k) as usize;
    let mut r = Request::ids(prompt)
        .with_params(params(n("gen_length"), n("steps"), n("block_length")))
        .with_cache(CacheMode::Acache)
        .with_full_canvas();
    r.span = Some(Span::Tokens(span[0]..span[1]));
    r.anchor_ratio = case["anchor_ratio"].as_f64().expect("ratio") as f32;
    r
}

/// The runtime picks the numpy reference's anchors and commits its tokens at temperature 0,
/// with f32 K/V and (anchors only: f16 keys move the importance a little) with f16 K/V.
#[test]
fn anchors_and_tokens_match_the_numpy_reference() {
    let engine = common::tiny_engine();
    let f16 = Engine::load_on(
        common::ctx(),
        &common::fixture_dir(),
        &EngineOptions {
            weight_format: unmask_gpu::WeightFormat::F32,
            kv_dtype: unmask_gpu::DType::F16,
            ..EngineOptions::default()
        },
        &mut |_| {},
    )
    .expect("tiny model loads with f16 K/V");
    for case in goldens() {
        let name = case["name"].as_str().unwrap_or("?");
        let request = golden_request(&case);
        let want_anchors = numbers(&case["anchors"]);
        for (kv, engine) in [("f32", &engine), ("f16", &f16)] {
            let out = engine.generate(&request).expect("generation");
            let report = out.acache.as_ref().expect("an ACache report");
            assert!(report.fallback.is_none(), "{name}: {:?}", report.fallback);
            let span = numbers(&case["span"]);
            let anchors: Vec<usize> = report
                .anchors
                .iter()
                .map(|&a| span[0] + a as usize)
                .collect();
            assert_eq!(anchors, want_anchors, "{name} ({kv} K/V): anchors");
            if kv == "f32" {
                let want: Vec<u32> = numbers(&case["output"])
                    .into_iter()
                    .map(|t| t as u32)
                    .collect();
                assert_eq!(out.ids, want, "{name}: tokens");
            }
        }
        eprintln!("[acache] {name}: anchors {want_anchors:?} and tokens equal the reference's");
    }
}

/// With every span token an anchor (ratio 1) ACache computes what the dual cache computes;
/// with none (ratio 0) the span's K/V are the span-only pass's at every depth and the
/// canvas differs. The second request with the span hits its entry; a request that names
/// no span finds the stored one inside its prompt.
#[test]
fn ratio_one_is_the_dual_cache_and_the_span_entry_is_shared() {
    let engine = common::tiny_engine();
    let case = &goldens()[0];
    let mut all = golden_request(case);
    all.anchor_ratio = 1.0;
    let dual = Request {
        cache: CacheMode::FastDllmDual,
        span: None,
        ..all.clone()
    };
    let want = engine.generate(&dual).unwrap();
    engine.clear_prefix_store();
    let got = engine.generate(&all).unwrap();
    assert_eq!(got.ids, want.ids, "ratio 1 = fast-dllm-dual");
    let report = got.acache.unwrap();
    assert!(!report.hit);
    assert_eq!(report.anchors.len(), report.span_tokens);

    let mut none = golden_request(case);
    none.anchor_ratio = 0.0;
    let reused = engine.generate(&none).unwrap();
    let report = reused.acache.unwrap();
    assert!(
        report.hit,
        "the span's entry is stored after the first request"
    );
    assert!(report.anchors.is_empty());
    assert_ne!(reused.ids, want.ids, "direct span reuse changes the canvas");
    // The same span after another preamble: another offset, the same entry.
    let Span::Tokens(span) = golden_request(case).span.unwrap() else {
        unreachable!()
    };
    let mut prompt = match &golden_request(case).prompt {
        unmask::Prompt::Ids(ids) => ids.clone(),
        _ => unreachable!(),
    };
    prompt.insert(0, 11);
    prompt.insert(0, 12);
    let mut moved = golden_request(case);
    moved.prompt = unmask::Prompt::Ids(prompt.clone());
    moved.span = Some(Span::Tokens(span.start + 2..span.end + 2));
    let out = engine.generate(&moved).unwrap();
    let report = out.acache.unwrap();
    assert!(report.hit && report.span_start == span.start + 2);
    // Not named: the stored span is found in the prompt.
    moved.span = None;
    let found = engine.generate(&moved).unwrap();
    let report = found.acache.unwrap();
    assert!(report.found_in_store && report.hit, "{report:?}");
    assert_eq!(found.ids, out.ids);
    assert_eq!(engine.prefix_store_recount().pins, 0, "no pin is left");
    eprintln!("[acache] ratio 1 = fast-dllm-dual; the span entry served 3 requests at 2 offsets");
}

/// A span outside the prompt or absent from it is refused with the field named; a
/// request with no span and none stored runs as the dual cache and says why.
#[test]
fn bad_spans_are_named_and_a_missing_span_falls_back() {
    let engine = common::tiny_engine();
    engine.clear_prefix_store();
    let case = &goldens()[0];
    let mut r = golden_request(case);
    r.span = Some(Span::Tokens(20..99));
    let err = engine.generate(&r).unwrap_err();
    assert!(
        matches!(&err, EngineError::Invalid { field: "span", .. }),
        "{err}"
    );
    r.span = Some(Span::Tokens(5..5));
    assert!(engine.generate(&r).is_err());
    r.anchor_ratio = 1.5;
    r.span = Some(Span::Tokens(6..22));
    let err = engine.generate(&r).unwrap_err();
    assert!(
        matches!(
            &err,
            EngineError::Invalid {
                field: "anchor_ratio",
                ..
            }
        ),
        "{err}"
    );
    let mut plain = golden_request(case);
    plain.span = None;
    let out = engine.generate(&plain).unwrap();
    let why = out.acache.unwrap().fallback.expect("a fallback");
    assert!(
        why.contains("fast-dllm-dual") && why.contains("span"),
        "{why}"
    );
}

/// The bundled model's affix set: the table is a shared span after a per-request role
/// line. Reused as it is (ratio 0) the table rows lack the question's mark and lookups go
/// wrong; with every span token recomputed (ratio 1) every answer is right, and so with the
/// default 20 % anchors: the probe finds the asked member's rows (models/tiny's probe heads).
#[test]
fn bundled_model_loses_answers_with_direct_span_reuse_and_anchors_recover_them() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let engine = common::bundled_engine();
    let text = std::fs::read_to_string(root.join("data/tasks/heldout-affix-small.jsonl"))
        .expect("data/tasks/heldout-affix-small.jsonl");
    let items: Vec<serde_json::Value> = text
        .lines()
        .take(8)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let right = |ratio: f32| {
        items
            .iter()
            .filter(|item| {
                let f = |k: &str| item[k].as_str().expect(k).to_string();
                let mut r = Request::chat(Some(&f("system")), &f("user"))
                    .with_params(params(32, 16, 4))
                    .with_cache(CacheMode::Acache);
                r.span = Some(Span::Text(f("affix")));
                r.anchor_ratio = ratio;
                let out = engine.generate(&r).expect("generation");
                assert!(out.acache.unwrap().fallback.is_none());
                let text = out.text.unwrap_or_default();
                text.rsplit("####").next().unwrap_or("").trim() == f("answer")
            })
            .count()
    };
    let (all, some, none) = (right(1.0), right(0.2), right(0.0));
    eprintln!(
        "[acache] bundled model, 8 affix items: ratio 1: {all} right, 0.2: {some}, 0: {none}"
    );
    assert_eq!(all, items.len());
    assert_eq!(some, items.len(), "20 % anchors recover every answer");
    assert!(
        none <= 3,
        "direct span reuse answered {none} of {}",
        items.len()
    );
}

/// ACache requests joining a running session one after another (their probes run while
/// other members are mid-canvas) produce the tokens and anchors they produce alone.
#[test]
fn members_joining_a_running_session_match_their_runs_alone() {
    let engine = common::tiny_engine();
    let requests: Vec<Request> = goldens().iter().map(golden_request).collect();
    let alone: Vec<_> = requests
        .iter()
        .map(|r| engine.generate(r).expect("alone"))
        .collect();
    let rows: usize = alone.iter().map(|g| g.prompt_ids.len() + g.ids.len()).sum();
    let mut session = engine
        .session(None, rows)
        .expect("a session without a prefix");
    let mut ids = Vec::new();
    let mut done = Vec::new();
    for r in &requests {
        ids.push(session.submit(r.clone()).expect("admitted"));
        // One step between arrivals: the next member's probe runs beside running ones.
        done.extend(session.step());
    }
    while !session.is_idle() {
        done.extend(session.step());
    }
    assert_eq!(done.len(), requests.len());
    for (id, g) in done {
        let k = ids.iter().position(|&i| i == id).expect("a submitted id");
        let g = g.expect("generation");
        assert_eq!(g.ids, alone[k].ids, "request {k}: tokens");
        assert_eq!(
            g.acache.as_ref().map(|a| &a.anchors),
            alone[k].acache.as_ref().map(|a| &a.anchors),
            "request {k}: anchors"
        );
    }
}
