//! Generation at temperature 0, token for token against the reference sampler's goldens
//! (tools/llada_ref.py `generate` on the tiny checkpoint): non-block and block schedules,
//! quota remainders, random remasking, CFG, Fast-dLLM threshold decoding and both EOS flags.

use crate::common;

use common::fixture_dir;

use serde_json::Value;
use unmask::{CacheMode, Engine, EngineOptions, GenerationParams, Request, Span};
use unmask_core::sampler::Sampler;
use unmask_core::step_plan::{SeqStep, StepPlan};
use unmask_goldens::{ids, params};
use unmask_gpu::StepEncoder;
use unmask_gpu::WeightFormat;
use unmask_gpu::model::Model;
use unmask_gpu::ops::sampling::SelectParams;

fn engine() -> Engine {
    common::tiny_engine()
}

fn committed_positions(case: &Value) -> Vec<Vec<u32>> {
    case["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| ids(&s["committed"]))
        .collect()
}

/// The positions a generation committed at each of its steps.
fn commits(out: &unmask::Generation) -> Vec<Vec<u32>> {
    out.steps
        .iter()
        .map(|s| s.committed.iter().map(|(p, _)| *p).collect())
        .collect()
}

#[test]
fn generation_matches_reference_goldens() {
    let checked = check_generations(&engine(), &common::golden_cases());
    assert_eq!(checked, 7, "every non-random golden case ran");
}

/// The reference's generations on the checkpoint with one 256-wide head: one block, several
/// blocks and threshold decoding, token for token and step for step.
#[test]
fn generation_matches_reference_goldens_with_heads_256_wide() {
    let dir = common::wide_head_fixture_dir();
    let options = EngineOptions {
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let engine = Engine::load_on(common::ctx(), &dir, &options, &mut |_| {}).unwrap();
    assert_eq!(engine.config().head_dim(), 256);
    let text = std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap();
    let goldens: Value = serde_json::from_str(&text).unwrap();
    let checked = check_generations(&engine, goldens["cases"].as_array().unwrap());
    assert_eq!(checked, 3, "every golden case ran");
    // The register kernel (heads up to 128) asked for by name: refused when loading.
    let register = EngineOptions {
        attention_kernel: unmask_gpu::ops::attention::AttentionKernel::Register,
        ..options
    };
    let err = Engine::load_on(common::ctx(), &dir, &register, &mut |_| {})
        .err()
        .expect("the register kernel is refused for 256-wide heads")
        .to_string();
    assert!(err.contains("register") && err.contains("256"), "{err}");
}

/// Every non-random case: the whole sequence and the positions committed at each step equal
/// the reference's. Returns how many cases ran.
fn check_generations(engine: &Engine, cases: &[Value]) -> usize {
    let mut checked = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap().to_string();
        if case["params"]["remasking"] == "random" {
            continue; // covered by random_remasking_matches_with_the_reference_numbers
        }
        let prompt = ids(&case["prompt"]);
        let want = ids(&case["output"]);
        let request = Request::ids(prompt.clone())
            .with_params(params(case))
            .with_full_canvas();
        let out = engine
            .generate(&request)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut got = prompt.clone();
        got.extend(&out.ids);
        assert_eq!(got, want, "{name}: tokens differ from the reference");
        assert_eq!(
            commits(&out),
            committed_positions(case),
            "{name}: per-step commits differ"
        );
        eprintln!(
            "[golden] {name}: {} steps, {} tokens equal",
            out.steps.len(),
            out.ids.len()
        );
        checked += 1;
    }
    checked
}

/// Random remasking draws its confidences on the host; the reference drew them with numpy's
/// PCG64, so this test feeds the reference's numbers through the same GPU step and sampler.
#[test]
fn random_remasking_matches_with_the_reference_numbers() {
    let engine = engine();
    let case = common::golden_cases()
        .into_iter()
        .find(|c| c["params"]["remasking"] == "random")
        .expect("a random case");
    let prompt = ids(&case["prompt"]);
    let randoms: Vec<Vec<f32>> = case["random_confidences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    let p = params(&case);
    let model = engine.model();
    let mut sampler = Sampler::new(
        &prompt,
        p.clone(),
        engine.special().mask,
        model.cfg.max_sequence_length,
    )
    .unwrap();
    let t = sampler.tokens().len();
    let whole = StepPlan::alone(&[SeqStep::whole(t)], model.cfg.n_layers, false).unwrap();
    let st = model.new_state(t, t).unwrap();
    let sel = model.new_select(t).unwrap();
    let mut step_index = 0;
    while !sampler.is_done() {
        let rows = sampler.rows_to_predict();
        model.write_select(&sel, &rows, &rows).unwrap();
        let mut step = StepEncoder::new(engine.ctx(), "golden step");
        model
            .encode_plan(
                &mut step,
                &st,
                None,
                &whole,
                sampler.tokens(),
                Default::default(),
            )
            .unwrap();
        let params = SelectParams {
            temperature: 0.0,
            cfg_scale: 0.0,
            seed: p.seed,
            step: step_index,
            suppress_token: None,
            conf_exclude: [None, None],
            ..SelectParams::default()
        };
        model
            .encode_select(&mut step, &st, None, &sel, rows.len(), &params)
            .unwrap();
        let slot = model.read_back_choices(&mut step, &sel, rows.len(), &params);
        let read = step.submit().unwrap().read().unwrap();
        let choices = Model::decode_choices(&read[slot], &params);
        let tokens: Vec<u32> = choices.iter().map(|c| c.token).collect();
        // The reference draws one number per position of the whole sequence.
        let conf: Vec<f32> = rows
            .iter()
            .map(|&r| randoms[step_index as usize][r as usize])
            .collect();
        sampler.commit_with_confidences(&tokens, &conf).unwrap();
        step_index += 1;
    }
    assert_eq!(
        sampler.tokens(),
        ids(&case["output"]).as_slice(),
        "random remasking output"
    );
    eprintln!("[golden] d_random: {step_index} steps equal");
}

#[test]
fn invalid_parameters_are_errors_that_say_why() {
    let engine = engine();
    let base = GenerationParams {
        gen_length: 16,
        steps: 16,
        block_length: 16,
        ..GenerationParams::default()
    };
    let bad = [
        (
            GenerationParams {
                block_length: 5,
                ..base.clone()
            },
            "16",
        ),
        (
            GenerationParams {
                block_length: 8,
                steps: 3,
                ..base.clone()
            },
            "3",
        ),
        (
            GenerationParams {
                gen_length: 4096,
                block_length: 4096,
                steps: 4096,
                ..base.clone()
            },
            "4096",
        ),
    ];
    for (p, needle) in bad {
        let err = engine
            .generate(&Request::ids(vec![300, 5, 6]).with_params(p))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "error should name the numbers: {err}");
        eprintln!("[error] {err}");
    }
    let err = engine
        .generate(&Request::ids(vec![300, 9999]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("9999"), "{err}");
    eprintln!("[error] {err}");
}

/// The same goldens with the LM head split over vocabulary chunks: the streaming token
/// choice must give the same tokens as one pass over the whole vocabulary.
#[test]
fn generation_matches_goldens_with_chunked_vocabulary() {
    // 48 KiB: the f32 LM head (320 rows of 256 bytes) splits in two; activations still fit.
    let ctx = common::ctx_with_binding_limit(48 * 1024);
    let options = EngineOptions {
        backend: None,
        weight_format: WeightFormat::F32,
        ..EngineOptions::default()
    };
    let engine = Engine::load_on(ctx, &fixture_dir(), &options, &mut |_| {}).unwrap();
    assert!(engine.model().weights.lm_head.chunks.len() > 1);
    for case in common::golden_cases()
        .into_iter()
        .filter(|c| c["params"]["remasking"] != "random")
        .take(3)
    {
        let prompt = ids(&case["prompt"]);
        let out = engine
            .generate(
                &Request::ids(prompt.clone())
                    .with_params(params(&case))
                    .with_full_canvas(),
            )
            .unwrap();
        let mut got = prompt;
        got.extend(&out.ids);
        assert_eq!(
            got,
            ids(&case["output"]),
            "{} with a chunked LM head",
            case["name"]
        );
    }
}

/// Infilling: the reference's generations with a suffix after the canvas (every case
/// generates other tokens without it), token for token and step for step; then every cache
/// mode, recomputing all rows, gives the same tokens through its own plumbing (entries,
/// spans, arena offsets with the suffix's rows after the canvas), and running as a cache
/// it fills the whole canvas.
#[test]
fn infilling_before_a_suffix_matches_reference_goldens_in_every_cache_mode() {
    let checked = check_infillings(&engine(), &common::fixture_dir());
    assert_eq!(checked, 4, "every LLaDA infilling case ran");
    // Dream predicts a position from the row before it: the suffix's rows are never read
    // for a prediction, the canvas's last row is.
    let checked = check_infillings(&common::tiny_dream_engine(), &common::dream_fixture_dir());
    assert_eq!(checked, 3, "every Dream infilling case ran");
}

/// The infilling goldens of the fixture at `dir` (goldens/infill.json) on `engine`; returns
/// how many cases ran.
fn check_infillings(engine: &Engine, dir: &std::path::Path) -> usize {
    let text = std::fs::read_to_string(dir.join("goldens/infill.json")).unwrap();
    let cases = unmask_goldens::cases(&text);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let (prompt, suffix) = (ids(&case["prompt"]), ids(&case["suffix"]));
        let want = ids(&case["output"]);
        let p = params(case);
        let request = Request::ids(prompt.clone())
            .with_params(p.clone())
            .with_suffix(suffix.clone())
            .with_full_canvas();
        let out = engine
            .generate(&request)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            (out.ids.len(), out.suffix_len),
            (p.gen_length, suffix.len()),
            "{name}: the canvas alone"
        );
        let mut got = prompt.clone();
        got.extend(&out.ids);
        got.extend(&suffix);
        assert_eq!(got, want, "{name}: tokens differ from the reference");
        // The reference's steps that commit nothing (a Dream quota of 0) are not run here.
        let mut want_steps = committed_positions(case);
        want_steps.retain(|s| !s.is_empty());
        assert_eq!(commits(&out), want_steps, "{name}: commits");
        let guided = p.cfg_scale > 0.0;
        for mode in CacheMode::ALL {
            if guided && (mode.is_adaptive() || mode.is_bicache() || mode == CacheMode::Acache) {
                continue; // refused with guidance, each with its reason
            }
            let cached = Request {
                prefix_len: Some(prompt.len() / 2),
                span: (mode == CacheMode::Acache).then_some(Span::Tokens(4..12)),
                ..request.clone().with_cache(mode)
            };
            let exact = Request {
                recompute_all: true,
                ..cached.clone()
            };
            let canvas = &want[prompt.len()..prompt.len() + p.gen_length];
            let out = engine
                .generate(&exact)
                .unwrap_or_else(|e| panic!("{name} {mode}: {e}"));
            assert_eq!(out.ids, canvas, "{name} {mode}");
            let out = engine
                .generate(&cached)
                .unwrap_or_else(|e| panic!("{name} {mode} cached: {e}"));
            assert_eq!(out.ids.len(), p.gen_length, "{name} {mode}");
            assert!(
                !out.ids.contains(&engine.special().mask),
                "{name} {mode}: a canvas position stayed masked"
            );
        }
        eprintln!(
            "[infill] {name}: {} steps equal, every cache mode ran",
            out.steps.len()
        );
    }
    cases.len()
}
