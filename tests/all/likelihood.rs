//! A continuation's log-likelihood (LLaDA's Monte Carlo estimate) against the numpy
//! reference over the same stored samples, for LLaDA and Dream, with and without guidance;
//! the seeded draw; and bad input named.

use std::path::Path;

use serde_json::Value;
use unmask::{Engine, LikelihoodParams, MaskSample};
use unmask_core::likelihood::{draw_masks, window_seed};
use unmask_goldens::ids;

use crate::common;

/// Every case of the fixture's goldens/likelihood.json: each sample's loss and the estimate
/// within f32 logits' rounding of the reference's. Returns how many cases ran.
fn check_goldens(engine: &Engine, dir: &Path) -> usize {
    let text = std::fs::read_to_string(dir.join("goldens/likelihood.json")).unwrap();
    let cases = unmask_goldens::cases(&text);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let samples: Vec<MaskSample> = case["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| MaskSample {
                masked: ids(&s["masked"]).iter().map(|&m| m as usize).collect(),
                p_mask: s["p_mask"].as_f64().unwrap(),
            })
            .collect();
        let cfg = case["cfg_scale"].as_f64().unwrap() as f32;
        let (prompt, answer) = (ids(&case["prompt"]), ids(&case["answer"]));
        let want: Vec<f64> = case["sample_losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let estimate = case["log_likelihood"].as_f64().unwrap();
        let twins = if cfg > 0.0 { 2 } else { 1 };
        // All samples side by side in one pass, one per pass, and passes of 3 (the last
        // one short): the same losses, as each sequence attends to itself alone.
        let mut got = None;
        for per_pass in [None, Some(1), Some(3)] {
            let l = engine
                .log_likelihood_of(&prompt, &answer, &samples, cfg, per_pass)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(l.sample_losses.len(), want.len(), "{name}");
            for (i, (g, w)) in l.sample_losses.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "{name} sample {i} in passes of {per_pass:?}: {g} against the \
                     reference's {w}"
                );
            }
            assert!(
                (l.log_likelihood - estimate).abs() <= 1e-4 * estimate.abs(),
                "{name}: {} against {estimate}",
                l.log_likelihood
            );
            assert_eq!(l.sequences, samples.len() * twins, "{name}");
            let n = per_pass.unwrap_or(samples.len());
            assert_eq!(l.pass_samples, n, "{name}: {per_pass:?}");
            assert_eq!(l.forward_passes, samples.len().div_ceil(n), "{name}");
            got.get_or_insert(l);
        }
        let got = got.unwrap();
        // A seeded case: the runtime's own draw gives the stored masks, and the estimate
        // from the seed alone is the reference's.
        if let Some(seed) = case["seed"].as_u64() {
            let params = LikelihoodParams {
                mc_num: samples.len(),
                batch: case["mc_batch"].as_u64().unwrap() as usize,
                cfg_scale: cfg,
                seed,
                pass_samples: None,
            };
            assert_eq!(draw_masks(answer.len(), &params), samples, "{name}");
            let l = engine.log_likelihood(&prompt, &answer, &params).unwrap();
            assert!(
                (l.log_likelihood - estimate).abs() <= 1e-4 * estimate.abs(),
                "{name}: {} from seed {seed} against {estimate}",
                l.log_likelihood
            );
        }
        eprintln!(
            "[likelihood] {name}: {:.4} (reference {estimate:.4}) over {} samples",
            got.log_likelihood,
            samples.len()
        );
    }
    cases.len()
}

/// The tiny fixture's first likelihood case: (prompt, answer).
fn first_case() -> (Vec<u32>, Vec<u32>) {
    let text = std::fs::read_to_string(common::fixture_dir().join("goldens/likelihood.json"));
    let cases: Value = serde_json::from_str(&text.unwrap()).unwrap();
    let case = &cases["cases"][0];
    (ids(&case["prompt"]), ids(&case["answer"]))
}

#[test]
fn the_estimate_matches_the_reference_over_the_same_samples() {
    // LLaDA's cases include an unconditional one (no prompt); Dream has none.
    assert_eq!(
        check_goldens(&common::tiny_engine(), &common::fixture_dir()),
        5
    );
    let dream = common::tiny_dream_engine();
    assert_eq!(check_goldens(&dream, &common::dream_fixture_dir()), 4);
}

#[test]
fn seeded_estimates_repeat_and_bad_input_is_named() {
    let engine = common::tiny_engine();
    let (prompt, answer) = first_case();
    let params = LikelihoodParams {
        mc_num: 8,
        batch: 4,
        ..LikelihoodParams::default()
    };
    let a = engine.log_likelihood(&prompt, &answer, &params).unwrap();
    let b = engine.log_likelihood(&prompt, &answer, &params).unwrap();
    assert_eq!(
        a.sample_losses, b.sample_losses,
        "the same seed draws the same masks"
    );
    assert_eq!((a.sequences, a.answer_tokens), (8, answer.len()));
    assert!(a.log_likelihood < 0.0 && a.standard_error > 0.0);
    let other = LikelihoodParams { seed: 3, ..params };
    let c = engine.log_likelihood(&prompt, &answer, &other).unwrap();
    assert_ne!(a.sample_losses, c.sample_losses);
    let mask = engine.special().mask;
    let err = |p: &[u32], a: &[u32], params: &LikelihoodParams| {
        engine.log_likelihood(p, a, params).unwrap_err().to_string()
    };
    let e = err(&prompt, &[1, mask], &params);
    assert!(
        e.starts_with("answer: ") && e.contains(&format!("{mask} at position 1")),
        "{e}"
    );
    // No prompt: an unconditional estimate, but not under guidance (which masks the
    // prompt), and not on Dream (a token's logits come from the row before it).
    let unconditional = engine.log_likelihood(&[], &answer, &params).unwrap();
    assert!(unconditional.log_likelihood < 0.0);
    let guided = LikelihoodParams {
        cfg_scale: 1.0,
        ..params
    };
    let e = err(&[], &answer, &guided);
    assert!(
        e.starts_with("prompt: expected at least one token under cfg_scale"),
        "{e}"
    );
    let dream = common::tiny_dream_engine();
    let e = dream.log_likelihood(&[], &answer, &params).unwrap_err();
    assert!(e.to_string().contains("the row before it"), "{e}");
    let e = err(&prompt, &[], &params);
    assert!(e.starts_with("answer: expected at least one token"), "{e}");
    let e = err(&prompt, &vec![7; 300], &params);
    assert!(e.contains("within the model's 256 positions"), "{e}");
    let e = err(
        &prompt,
        &answer,
        &LikelihoodParams {
            mc_num: 6,
            ..params
        },
    );
    assert!(
        e.starts_with("mc_num: expected a positive multiple of mc_batch 4"),
        "{e}"
    );
    let outside = [MaskSample {
        masked: vec![answer.len()],
        p_mask: 1.0,
    }];
    let e = engine
        .log_likelihood_of(&prompt, &answer, &outside, 0.0, None)
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("samples: "), "{e}");
}

#[test]
fn a_pass_never_outgrows_one_binding_whatever_the_caller_asks() {
    let (prompt, answer) = first_case();
    let rows = prompt.len() + answer.len();
    let wide = common::tiny_engine();
    let row_bytes = wide.model().state_row_bytes();
    // A binding of 3 sequences' rows: at most 3 samples side by side.
    let ctx = common::ctx_with_binding_limit((3 * rows * row_bytes) as u64);
    let narrow = common::tiny_engine_on(ctx);
    assert_eq!(narrow.model().max_state_rows() / rows, 3);
    let params = LikelihoodParams {
        mc_num: 8,
        batch: 4,
        pass_samples: Some(1000),
        ..LikelihoodParams::default()
    };
    let l = narrow.log_likelihood(&prompt, &answer, &params).unwrap();
    assert_eq!((l.pass_samples, l.forward_passes), (3, 3));
    let all = wide.log_likelihood(&prompt, &answer, &params).unwrap();
    assert_eq!((all.pass_samples, all.forward_passes), (8, 1));
    assert!(
        (l.log_likelihood - all.log_likelihood).abs() <= 1e-4 * all.log_likelihood.abs(),
        "{} against {}",
        l.log_likelihood,
        all.log_likelihood
    );
}

#[test]
fn gpu_cross_entropy_equals_the_logits_read_back_in_any_head_group() {
    use unmask_core::likelihood::cross_entropy;
    use unmask_gpu::model::{ScoredSeq, TargetSeq};

    let engine = common::tiny_engine();
    let model = engine.model();
    let vocab = model.cfg.embedding_size;
    // Three sequences of different lengths, each scored at a few rows with its own
    // targets, and a prompt-masked twin for guidance.
    let seqs: Vec<Vec<u32>> = (0..3u32)
        .map(|i| {
            (0..20 + 7 * i)
                .map(|k| (k * 13 + i * 5) % 300 + 3)
                .collect()
        })
        .collect();
    let twins: Vec<Vec<u32>> = seqs
        .iter()
        .map(|s| {
            s.iter()
                .enumerate()
                .map(|(k, &t)| if k < 6 { 4 } else { t })
                .collect()
        })
        .collect();
    let rows: Vec<Vec<usize>> = seqs.iter().map(|s| vec![0, 9, s.len() - 1, 12]).collect();
    let targets: Vec<Vec<u32>> = (0..3u32).map(|i| vec![i, 299, 17 + i, 0]).collect();
    let capacity: usize = seqs.iter().map(Vec::len).sum::<usize>() * 2;
    let full = |ids: &Vec<u32>, at: &Vec<usize>| {
        let mut state = model.logits_state(capacity).unwrap();
        let one = [ScoredSeq { ids, rows: at }];
        model.logits_batch(&mut state, &one).unwrap().remove(0)
    };
    for cfg in [0.0f32, 2.0] {
        let want: Vec<Vec<f64>> = (0..3)
            .map(|i| {
                let cond = full(&seqs[i], &rows[i]);
                let uncond = (cfg > 0.0).then(|| full(&twins[i], &rows[i]));
                (0..rows[i].len())
                    .map(|k| {
                        let mut row = cond[k * vocab..(k + 1) * vocab].to_vec();
                        if let Some(u) = &uncond {
                            for (c, u) in row.iter_mut().zip(&u[k * vocab..(k + 1) * vocab]) {
                                *c = u + (cfg + 1.0) * (*c - u);
                            }
                        }
                        cross_entropy(&row, targets[i][k] as usize)
                    })
                    .collect()
            })
            .collect();
        let scored: Vec<TargetSeq<'_>> = (0..3)
            .map(|i| TargetSeq {
                ids: &seqs[i],
                rows: &rows[i],
                targets: &targets[i],
                uncond: (cfg > 0.0).then_some(twins[i].as_slice()),
            })
            .collect();
        // One group of all 12 rows, then groups of 5 (the last one short): the index
        // buffers are rewritten between groups.
        for limit in [None, Some(5)] {
            let mut state = model.logits_state(capacity).unwrap();
            if let Some(n) = limit {
                state.limit_head_rows(n);
            }
            let got = model.cross_entropy_batch(&mut state, &scored, cfg).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                for (k, (g, w)) in g.iter().zip(w).enumerate() {
                    assert!(
                        (g - w).abs() <= 2e-5 * w.abs().max(1.0),
                        "cfg {cfg}, groups of {limit:?}, sequence {i} row {k}: {g} against {w}"
                    );
                }
            }
        }
    }
    // A twin missing under guidance, or given without it, and a target past the LM head.
    let mut state = model.logits_state(capacity).unwrap();
    let mut bad = TargetSeq {
        ids: &seqs[0],
        rows: &rows[0],
        targets: &targets[0],
        uncond: None,
    };
    let err = model
        .cross_entropy_batch(&mut state, &[bad], 1.0)
        .unwrap_err();
    assert!(
        err.to_string().contains("without an unconditioned twin"),
        "{err}"
    );
    bad.uncond = Some(&twins[0]);
    let err = model
        .cross_entropy_batch(&mut state, &[bad], 0.0)
        .unwrap_err();
    assert!(
        err.to_string().contains("exactly when cfg_scale > 0"),
        "{err}"
    );
    let past = [0, 1, vocab as u32, 2];
    bad.targets = &past;
    let err = model
        .cross_entropy_batch(&mut state, &[bad], 1.0)
        .unwrap_err();
    assert!(
        err.to_string().contains(&format!("target {vocab}")),
        "{err}"
    );
}

#[test]
fn passes_after_the_first_make_no_buffers_and_read_back_twelve_bytes_a_scored_row() {
    // A context of its own: the shared one's counters also count the tests beside it.
    let ctx = unmask_gpu::GpuContext::new(&common::options()).unwrap();
    let options = unmask::EngineOptions {
        weight_format: unmask_gpu::WeightFormat::F32,
        ..unmask::EngineOptions::default()
    };
    let engine = Engine::load_on(ctx, &common::fixture_dir(), &options, &mut |_| {}).unwrap();
    let (prompt, answer) = first_case();
    let params = LikelihoodParams {
        mc_num: 8,
        batch: 4,
        cfg_scale: 1.0,
        pass_samples: Some(2),
        ..LikelihoodParams::default()
    };
    let samples = draw_masks(answer.len(), &params);
    let mut run = engine
        .start_log_likelihood(&prompt, &answer, &params)
        .unwrap();
    run.pass().unwrap();
    let before = engine.ctx().host.snapshot();
    for _ in 0..3 {
        run.pass().unwrap();
    }
    let spent = engine.ctx().host.snapshot() - before;
    // Samples 2 to 7, each with its guiding twin: three floats a masked row come back,
    // however wide the vocabulary.
    let scored: usize = samples[2..].iter().map(|s| s.masked.len()).sum();
    assert_eq!(spent.bytes_read_back, (12 * scored) as u64, "{spent:?}");
    assert_eq!(spent.buffers_created, 0, "{spent:?}");
    assert_eq!(spent.staging_buffers_created, 0, "{spent:?}");
    assert!(run.is_done());
}

#[test]
fn a_rolling_estimate_is_its_windows_summed() {
    let engine = common::tiny_engine();
    let params = LikelihoodParams {
        mc_num: 4,
        batch: 4,
        ..LikelihoodParams::default()
    };
    // 300 ordinary tokens on a model of 256 positions: windows of 128, the second and third
    // after the 128 before them.
    let text: Vec<u32> = (0..300u32).map(|k| 3 + (k * 11) % 290).collect();
    let windows = engine.rolling_windows(&[], &text);
    let answers: Vec<_> = windows.iter().map(|w| w.answer.clone()).collect();
    assert_eq!(answers, [0..128, 128..256, 256..300]);
    assert_eq!(windows[2].context, text[128..256]);
    let rolled = engine.log_likelihood_rolling(&[], &text, &params).unwrap();
    assert_eq!((rolled.windows, rolled.answer_tokens), (3, 300));
    // Each window draws its masks with its own seed.
    let sum: f64 = windows
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let answer = &text[w.answer.clone()];
            let own = LikelihoodParams {
                seed: window_seed(params.seed, i),
                ..params
            };
            engine
                .log_likelihood(&w.context, answer, &own)
                .unwrap()
                .log_likelihood
        })
        .sum();
    assert!(
        (rolled.log_likelihood - sum).abs() <= 1e-9 * sum.abs(),
        "{} against the windows' {sum}",
        rolled.log_likelihood
    );
    // Dream reads a token's logits from the row before it: after no prompt it starts from
    // its end-of-text token.
    let dream = common::tiny_dream_engine();
    let eos = dream.special().eos;
    assert_eq!(dream.rolling_windows(&[], &text[..20])[0].context, [eos]);
    let l = dream
        .log_likelihood_rolling(&[], &text[..20], &params)
        .unwrap();
    let direct = dream.log_likelihood(&[eos], &text[..20], &params).unwrap();
    assert_eq!((l.log_likelihood, l.windows), (direct.log_likelihood, 1));
}
