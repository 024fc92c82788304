//! Dream-family models on the tiny Dream checkpoint (tests/fixtures/tiny-dream: Qwen2 names,
//! q/k/v biases, GQA, ChatML): the forward against the independent numpy reference
//! (tools/dream_ref.py), and Dream's sampler (timestep schedule, each `alg`, `alg_temp`,
//! Fast-dLLM's blocks and threshold) step for step against its goldens.

use crate::common;

use common::{assert_close, dream_fixture_dir, flat};
use serde_json::Value;
use unmask::{CacheMode, Request};
use unmask_core::config::ModelFamily;
use unmask_core::oracle::sampling::{SelectParams, cut_mask};
use unmask_core::sampler::{Remasking, Sampler};
use unmask_goldens::{ids, params};
use unmask_gpu::WeightFormat;
use unmask_gpu::model::Model;

fn logits_goldens(dir: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(dir.join("goldens/logits.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn check_logits(format: WeightFormat, tol: f64) {
    check_logits_of(&dream_fixture_dir(), format, tol);
}

/// The Dream checkpoint in `dir` against its reference logits.
fn check_logits_of(dir: &std::path::Path, format: WeightFormat, tol: f64) {
    let model =
        Model::load(common::ctx(), dir, format, &mut |_| {}).expect("tiny Dream model loads");
    assert_eq!(model.cfg.family, ModelFamily::Dream);
    assert!(model.weights.layers.iter().all(|l| l.qkv_bias.is_some()));
    for case in logits_goldens(dir)["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        // The left-padded case's rows are the real tokens' under the reference's
        // pad-aware positions: they must equal the unpadded prompt's logits, which is what
        // the runtime computes (its batches are never padded).
        let ids = ids(&case["ids"]);
        let got = model.logits(&ids).expect("forward");
        assert_close(
            &format!(
                "Dream logits {name} (T={}) weights={}",
                ids.len(),
                format.name()
            ),
            &got,
            &flat(&case["logits_f32"]),
            tol,
        );
    }
}

#[test]
fn dream_logits_match_the_reference() {
    check_logits(WeightFormat::F32, 1e-4);
    check_logits(WeightFormat::F16Packed, 1e-2);
}

/// One 256-wide head with its q/k/v biases (the wide attention kernels stage it 128
/// dimensions at a time), against `tools/dream_ref.py`.
#[test]
fn dream_logits_match_the_reference_with_heads_256_wide() {
    let dir = dream_fixture_dir().with_file_name("tiny-dream-wide-heads");
    check_logits_of(&dir, WeightFormat::F32, 1e-4);
    check_logits_of(&dir, WeightFormat::F16Packed, 1e-2);
}

/// Per step, the positions committed (empty steps left out: the runtime skips steps that
/// would commit nothing), with the step index.
fn golden_steps(case: &Value) -> Vec<(usize, Vec<u32>)> {
    case["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["step"].as_u64().unwrap() as usize, ids(&s["committed"])))
        .filter(|(_, c)| !c.is_empty())
        .collect()
}

fn golden_draws(case: &Value) -> Vec<f32> {
    case["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["draws"].as_array())
        .flatten()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// (token, confidence) of one logits row as Dream's `sample_tokens` at temperature 0
/// ranks it, in f64.
fn dream_choice(row: &[f32], p: &unmask::GenerationParams) -> (u32, f32) {
    let kind = p.remasking;
    // Dream's top_p / top_k at temperature 0: the cut ids leave the softmax.
    let mut l: Vec<f64> = row.iter().map(|&x| x as f64).collect();
    let cut = SelectParams {
        top_p: p.top_p,
        top_k: p.top_k,
        ..SelectParams::default()
    };
    if cut.cuts() {
        let keep = cut_mask(&l, &cut);
        for (x, keep) in l.iter_mut().zip(keep) {
            if !keep {
                *x = f64::NEG_INFINITY;
            }
        }
    }
    let max = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = l.iter().map(|&x| (x - max).exp()).sum();
    let probs: Vec<f64> = l.iter().map(|&x| (x - max).exp() / z).collect();
    let (best, p1) = probs
        .iter()
        .enumerate()
        .fold((0, -1.0), |b, (i, &p)| if p > b.1 { (i, p) } else { b });
    let conf = match kind {
        Remasking::Margin => {
            let p2 = probs
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != best)
                .map(|(_, &p)| p)
                .fold(0.0, f64::max);
            p1 - p2
        }
        Remasking::Entropy => probs.iter().map(|&p| p * (p + 1e-10).ln()).sum(),
        _ => p1,
    };
    (best as u32, conf as f32)
}

/// Every case through the sampler with full-sequence logits read back from the GPU,
/// shifted as Dream shifts them, confidences computed on the host and the reference's
/// random numbers replayed: the schedule, each `alg`, `origin`, `alg_temp`, top_p and top_k.
#[test]
fn dream_sampler_matches_the_goldens_over_gpu_logits() {
    let engine = common::tiny_dream_engine();
    let mut checked = 0;
    for case in common::dream_golden_cases() {
        let name = case["name"].as_str().unwrap().to_string();
        let p = params(&case);
        let prompt = ids(&case["prompt"]);
        let sampler = Sampler::new(&prompt, p.clone(), engine.special().mask, 512)
            .unwrap()
            .with_draws(golden_draws(&case));
        let (tokens, steps) = reference_run(&engine, sampler);
        assert_eq!(tokens, ids(&case["output"]), "{name}: output");
        assert_eq!(steps, golden_steps(&case), "{name}: per-step commits");
        eprintln!("[golden] Dream {name}: {} steps equal", steps.len());
        checked += 1;
    }
    assert_eq!(checked, 11, "every Dream golden case ran");
}

/// The engine's own path (GPU token choice, the model family's schedule picked by
/// default, shifted rows planned on the GPU) gives the goldens of every case without
/// random draws, in `none` and in every cache mode that recomputes the whole sequence.
#[test]
fn dream_generation_through_the_engine_matches_the_goldens() {
    let engine = common::tiny_dream_engine();
    assert_eq!(
        engine_matches_goldens(&engine, &common::dream_golden_cases()),
        9
    );
}

/// The same on the checkpoint whose one head is 256 wide (the attention staged 128
/// dimensions at a time): one block, 4 blocks of 4 and threshold decoding, step for step.
#[test]
fn dream_generation_with_heads_256_wide_matches_the_goldens() {
    let dir = dream_fixture_dir().with_file_name("tiny-dream-wide-heads");
    let options = unmask::EngineOptions {
        weight_format: WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    let engine = unmask::Engine::load_on(common::ctx(), &dir, &options, &mut |_| {}).unwrap();
    let text = std::fs::read_to_string(dir.join("goldens/generate.json")).unwrap();
    assert_eq!(
        engine_matches_goldens(&engine, &unmask_goldens::cases(&text)),
        3
    );
}

/// Runs every golden case without random draws through `engine.generate`, asserting its
/// per-step commits and output; returns how many ran.
fn engine_matches_goldens(engine: &unmask::Engine, cases: &[Value]) -> usize {
    let mut checked = 0;
    for case in cases {
        if !golden_draws(case).is_empty() {
            continue; // the seeded draws are the runtime's own; replayed above
        }
        let name = case["name"].as_str().unwrap().to_string();
        let mut p = params(case);
        p.schedule = unmask::Schedule::Auto; // the engine picks Dream's for this model
        // The goldens ran the reference with the cut each case names, and none where it
        // names none; the engine's default for Dream is the reference's top_k 50
        // (`the_default_top_k_follows_the_model_folder`), so "none" is asked for.
        p.top_k.get_or_insert(u32::MAX);
        let eps = params(case).schedule;
        assert_eq!(eps, unmask::Schedule::DREAM);
        let prompt = ids(&case["prompt"]);
        let request = Request::ids(prompt.clone())
            .with_params(p)
            .with_full_canvas();
        let out = engine
            .generate(&request)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut got = prompt.clone();
        got.extend(&out.ids);
        let steps: Vec<(usize, Vec<u32>)> = out
            .steps
            .iter()
            .map(|r| (r.step, r.committed.iter().map(|c| c.0).collect()))
            .collect();
        assert_eq!(steps, golden_steps(case), "{name}: per-step commits");
        assert_eq!(got, ids(&case["output"]), "{name}: output");
        eprintln!("[golden] Dream {name}: {} steps equal", steps.len());
        checked += 1;
    }
    checked
}

const SYSTEM: &str = "You answer with one short sentence.";

/// A ChatML request on the fixture's tokenizer: the system turn is the shared prefix.
fn chat(question: &str, cache: CacheMode, p: unmask::GenerationParams) -> Request {
    Request::chat(Some(SYSTEM), question)
        .with_params(p)
        .with_cache(cache)
        .with_full_canvas()
}

/// BiCache at depth 0 refreshing every step computes every row in every layer; with the
/// shift, the first canvas position reads the refreshed prefix's last row. It must equal
/// `none` exactly, in both BiCache modes.
#[test]
fn dream_bicache_refreshing_every_step_from_depth_0_equals_none() {
    let (engine, p) = (common::tiny_dream_engine(), common::params(16, 8, 16));
    let none = engine.generate(&chat("What is 2 + 3?", CacheMode::None, p.clone()));
    let none = none.unwrap();
    for mode in [CacheMode::Bicache, CacheMode::BicacheDual] {
        let request = Request {
            depth: Some(0),
            refresh_every: 1,
            ..chat("What is 2 + 3?", mode, p.clone())
        };
        let out = engine.generate(&request).unwrap();
        let report = out.bicache.as_ref().expect("a BiCache report");
        assert!(report.fallback.is_none(), "{mode}: {report:?}");
        assert!(report.entry_tokens > 0, "the system turn is shared");
        assert_eq!(out.ids, none.ids, "{mode}");
        assert_eq!(out.steps, none.steps, "{mode}");
    }
}

/// BiCache reading the entry in every layer is prefix-arm's computation with the prefix's
/// K/V as a separate attention segment: the same tokens and commits.
#[test]
fn dream_bicache_at_full_depth_equals_prefix_arm() {
    let (engine, p) = (common::tiny_dream_engine(), common::params(16, 8, 16));
    let arm = engine.generate(&chat("Name a colour.", CacheMode::PrefixArm, p.clone()));
    let arm = arm.unwrap();
    let request = Request {
        depth: Some(engine.config().n_layers),
        ..chat("Name a colour.", CacheMode::Bicache, p)
    };
    let out = engine.generate(&request).unwrap();
    assert!(out.bicache.as_ref().is_some_and(|b| b.fallback.is_none()));
    assert_eq!(out.ids, arm.ids);
    assert_eq!(out.steps, arm.steps);
}

/// Every cache mode on Dream's block schedule: the canvas fills, every step commits inside
/// its block (the block's first step exactly its first position), the Fast-dLLM modes'
/// first step (a full pass) equals `none`'s, and a second request with the same system
/// prompt hits the shared entry. Agreement with `none` is printed: on random weights it
/// measures nothing about quality.
#[test]
fn dream_every_cache_mode_follows_the_block_schedule() {
    let engine = common::tiny_dream_engine();
    let p = common::params(16, 8, 8);
    let none = engine
        .generate(&chat("What is 7 times 8?", CacheMode::None, p.clone()))
        .unwrap();
    let prompt_len = engine
        .encode_prompt(&chat("What is 7 times 8?", CacheMode::None, p.clone()).prompt)
        .unwrap()
        .len();
    for mode in [
        CacheMode::FastDllmPrefix,
        CacheMode::FastDllmDual,
        CacheMode::PrefixArm,
        CacheMode::Bicache,
        CacheMode::BicacheDual,
    ] {
        let request = Request {
            depth: Some(1),
            ..chat("What is 7 times 8?", mode, p.clone())
        };
        let out = engine.generate(&request).unwrap();
        assert_eq!(out.ids.len(), 16, "{mode}");
        assert!(
            !out.ids.contains(&engine.special().mask),
            "{mode}: canvas filled"
        );
        for s in &out.steps {
            let block = prompt_len + 8 * s.block..prompt_len + 8 * (s.block + 1);
            assert!(
                s.committed
                    .iter()
                    .all(|(pos, _)| block.contains(&(*pos as usize))),
                "{mode}: step {s:?} outside block {block:?}"
            );
            if s.step == 0 {
                assert_eq!(
                    s.committed.len(),
                    1,
                    "{mode}: a block opens with one commit"
                );
                assert_eq!(s.committed[0].0 as usize, block.start, "{mode}");
            }
        }
        if matches!(mode, CacheMode::FastDllmPrefix | CacheMode::FastDllmDual) {
            assert_eq!(out.steps[0], none.steps[0], "{mode}: the block's full pass");
        }
        if mode.is_bicache() {
            let again = Request {
                depth: Some(1),
                ..chat("Name a colour.", mode, p.clone())
            };
            let second = engine.generate(&again).unwrap();
            let report = second.bicache.as_ref().expect("a report");
            assert!(
                report.hit && report.fallback.is_none(),
                "{mode}: {report:?}"
            );
        }
        eprintln!(
            "[dream] {mode}: {}/16 tokens as none, {} steps",
            common::same_tokens(&out.ids, &none.ids),
            out.steps.len()
        );
    }
}

/// Quantized weights on a Dream model (the q/k/v biases and norms stay f32): the logits
/// stay within about 1.5 times the measured distance to the reference (q8 3.6 %, q4 36 %:
/// random tiny weights are sensitive, as tests/all/quant_model.rs notes for LLaDA), and it
/// generates a whole canvas.
#[test]
fn dream_quantized_weights_stay_close_and_generate() {
    let case = &logits_goldens(&dream_fixture_dir())["cases"][2];
    let ids = ids(&case["ids"]);
    let want = flat(&case["logits_f32"]);
    for (format, bound) in [(WeightFormat::Q8, 0.06), (WeightFormat::Q4, 0.5)] {
        let options = unmask::EngineOptions {
            weight_format: format,
            ..unmask::EngineOptions::default()
        };
        let engine =
            unmask::Engine::load_on(common::ctx(), &dream_fixture_dir(), &options, &mut |_| {})
                .unwrap();
        let got = engine.model().logits(&ids).unwrap();
        let err = common::relative_error(&got, &want);
        eprintln!(
            "[check] Dream {} logits: relative error {err:.3e} (bound {bound})",
            format.name()
        );
        assert!(err <= bound, "{}: {err}", format.name());
        let out = engine
            .generate(&Request::chat(None, "What is 2 + 3?").with_params(common::params(16, 8, 8)))
            .unwrap();
        assert!(
            !out.ids.contains(&engine.special().mask),
            "{}",
            format.name()
        );
    }
}

/// Whole logits rows in groups of 3 rows (as a binding limit splits them) choose exactly
/// what one group does, and an LM head in vocabulary chunks (a 48 KiB binding limit)
/// chooses the same tokens, for every confidence kind, greedy and sampled.
#[test]
fn dream_cut_in_row_groups_and_head_chunks_equals_one_pass() {
    let options = unmask::EngineOptions {
        weight_format: WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    let load = |ctx| unmask::Engine::load_on(ctx, &dream_fixture_dir(), &options, &mut |_| {});
    let whole = load(common::ctx()).unwrap();
    let chunked = load(common::ctx_with_binding_limit(48 * 1024)).unwrap();
    assert_eq!(whole.model().weights.lm_head.chunks.len(), 1);
    assert!(chunked.model().weights.lm_head.chunks.len() > 1);
    let (n, d) = (11, whole.model().cfg.d_model);
    let hidden = common::random_vec(5, n * d, 2.0);
    let rows: Vec<u32> = (0..n as u32).collect();
    let positions: Vec<u32> = rows.iter().map(|r| 40 + r).collect();
    for (kind, temperature) in [
        (unmask_core::sampler::ConfidenceKind::Probability, 0.0),
        (unmask_core::sampler::ConfidenceKind::Margin, 0.8),
        (unmask_core::sampler::ConfidenceKind::NegEntropy, 0.0),
    ] {
        let params = SelectParams {
            temperature,
            tempered: true,
            top_p: Some(0.8),
            top_k: Some(6),
            confidence: kind,
            seed: 3,
            // The most likely ids come from the same whole rows as the cut.
            logprob: true,
            top_logprobs: 4,
            ..SelectParams::default()
        };
        let choose = |engine: &unmask::Engine, group_rows: Option<usize>| {
            let model = engine.model();
            let ctx = &model.ctx;
            let x = unmask_gpu::Tensor::from_f32(ctx, &[n, d], &hidden, "x").unwrap();
            let mut sel = model.new_select(n).unwrap();
            if let Some(g) = group_rows {
                sel.set_max_group_rows(g);
            }
            model.write_select(&sel, &rows, &positions).unwrap();
            let mut step = unmask_gpu::StepEncoder::new(ctx, "cut groups");
            model
                .encode_select_from(&mut step, &x, None, &sel, n, &params)
                .unwrap();
            let slot = model.read_back_choices(&mut step, &sel, n, &params);
            let read = pollster::block_on(step.submit().unwrap().read_async()).unwrap();
            Model::decode_choices(&read[slot], &params)
        };
        let one = choose(&whole, None);
        assert_eq!(one, choose(&whole, Some(3)), "{kind:?} T={temperature}");
        // Rows whose cut keeps several ids have a non-zero confidence of every kind.
        assert!(one.iter().any(|c| c.confidence != 0.0), "{one:?}");
        for got in [choose(&chunked, None), choose(&chunked, Some(3))] {
            for (g, w) in got.iter().zip(&one) {
                assert_eq!(g.token, w.token, "{kind:?} T={temperature}: chunked head");
                assert!(
                    (g.confidence - w.confidence).abs() <= 1e-5,
                    "{g:?} vs {w:?}"
                );
                let ids = |c: &unmask_gpu::model::TokenChoice| {
                    c.alternatives.iter().map(|a| a.0).collect::<Vec<_>>()
                };
                assert_eq!(ids(g), ids(w), "{kind:?} T={temperature}: alternatives");
                assert_eq!(w.alternatives.len(), 4);
                for (a, b) in g.alternatives.iter().zip(&w.alternatives) {
                    assert!((a.1 - b.1).abs() <= 1e-5, "{g:?} vs {w:?}");
                }
            }
        }
    }
}

/// The top_k a request without one gets follows the model folder as Dream's
/// `diffusion_generate` does: generation_config.json's, else config.json's, else
/// transformers' 50; 0 is no cut.
#[test]
fn the_default_top_k_follows_the_model_folder() {
    use unmask_core::config::ModelConfig;
    let fixture = ModelConfig::from_file(dream_fixture_dir().join("config.json")).unwrap();
    assert_eq!(fixture.default_top_k, Some(50), "top_k null in both files");
    let dir = std::env::temp_dir().join(format!("unmask-dream-top-k-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let edit = |name: &str, key: &str, value: Value| {
        let text = std::fs::read_to_string(dream_fixture_dir().join(name)).unwrap();
        let mut v: Value = serde_json::from_str(&text).unwrap();
        v[key] = value;
        std::fs::write(dir.join(name), v.to_string()).unwrap();
    };
    let null = Value::Null;
    for (config_top_k, generation_top_k, want) in [
        (null.clone(), Value::from(7), Some(7)),
        (Value::from(12), null.clone(), Some(12)),
        (Value::from(12), Value::from(7), Some(7)),
        (null.clone(), Value::from(0), None),
        (Value::from(0), null.clone(), None),
    ] {
        edit("config.json", "top_k", config_top_k.clone());
        edit("generation_config.json", "top_k", generation_top_k.clone());
        let c = ModelConfig::from_file(dir.join("config.json")).unwrap();
        assert_eq!(
            c.default_top_k, want,
            "config.json {config_top_k}, generation_config.json {generation_top_k}"
        );
    }
    edit("generation_config.json", "top_k", Value::from("fifty"));
    let err = ModelConfig::from_file(dir.join("config.json")).unwrap_err();
    assert!(err.to_string().contains("generation_config.top_k"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Dream's `sample_tokens` ported to the host (`dream_choice`) over the GPU's logits, row
/// p read from the logits of p - 1 as Dream shifts them: the final tokens and each step's
/// commits.
#[allow(clippy::type_complexity)] // (tokens, [(step, committed positions)])
fn reference_run(
    engine: &unmask::Engine,
    mut sampler: Sampler,
) -> (Vec<u32>, Vec<(usize, Vec<u32>)>) {
    let model = engine.model();
    let vocab = model.cfg.embedding_size;
    let p = sampler.params().clone();
    let mut steps = Vec::new();
    while !sampler.is_done() {
        let logits = model.logits(sampler.tokens()).unwrap();
        let preds: Vec<(u32, f32)> = sampler
            .rows_to_predict()
            .iter()
            .map(|&pos| {
                let src = (pos as usize).saturating_sub(1);
                dream_choice(&logits[src * vocab..(src + 1) * vocab], &p)
            })
            .collect();
        let record = sampler.commit(&preds).unwrap();
        if !record.committed.is_empty() {
            steps.push((record.step, record.committed.iter().map(|c| c.0).collect()));
        }
    }
    (sampler.tokens().to_vec(), steps)
}

/// The reference's own defaults, reference-style: each golden prompt through Dream's
/// `sample_tokens` ported to the host (`dream_choice`) over the GPU's logits with the top_k
/// `diffusion_generate` applies when the caller gives none (50), against the engine given
/// no top_k. The same prompts without the cut commit otherwise, so the default is seen.
#[test]
fn the_engine_default_matches_the_reference_with_its_own_defaults() {
    let engine = common::tiny_dream_engine();
    let reference = |p: &unmask::GenerationParams, prompt: &[u32]| {
        let sampler = Sampler::new(prompt, p.clone(), engine.special().mask, 512).unwrap();
        reference_run(&engine, sampler).1
    };
    let (mut checked, mut cut_mattered) = (0, 0);
    for case in common::dream_golden_cases() {
        let mut p = params(&case);
        if !golden_draws(&case).is_empty() || p.top_k.is_some() || p.top_p.is_some() {
            continue; // seeded draws, or a cut of the case's own
        }
        let name = case["name"].as_str().unwrap().to_string();
        let prompt = ids(&case["prompt"]);
        let with_default = unmask::GenerationParams {
            top_k: Some(50),
            ..p.clone()
        };
        let want = reference(&with_default, &prompt);
        p.schedule = unmask::Schedule::Auto;
        let out = engine
            .generate(
                &Request::ids(prompt.clone())
                    .with_params(p.clone())
                    .with_full_canvas(),
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let got: Vec<(usize, Vec<u32>)> = out
            .steps
            .iter()
            .map(|r| (r.step, r.committed.iter().map(|c| c.0).collect()))
            .collect();
        assert_eq!(got, want, "{name}: the default is the reference's top_k 50");
        if want != golden_steps(&case) {
            cut_mattered += 1;
        }
        checked += 1;
    }
    assert!(checked >= 5, "{checked} cases");
    assert!(
        cut_mattered >= 1,
        "no case commits differently with and without the cut: the test cannot tell"
    );
}
