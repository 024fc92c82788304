//! Token selection from LM-head logits against the f64 oracle: greedy and Gumbel-noised
//! argmax, one or several vocabulary chunks in any order, ties, CFG, the suppressed id, the
//! sampled frequencies at T > 0, the errors of bad arguments, and a timed full vocabulary.

use std::time::Instant;

use crate::common::select::{
    KINDS, assert_choices, assert_logprobs, chunk_ranges, logprobs, oracle_rows, pairs, path,
    positions, run_gpu, run_gpu_words,
};
use crate::common::{ctx, random_vec};
use unmask_gpu::ops::sampling::{self as sel, SelectParams};
use unmask_gpu::{DType, GpuError, StepEncoder, Tensor};

#[test]
fn matches_oracle_one_and_three_chunks() {
    let ctx = ctx();
    let rows = 6;
    for &n in &[1usize, 7, 1000, 5003] {
        let logits = random_vec(n as u64, rows * n, 4.0);
        let pos = positions(rows);
        for temperature in [0.0f32, 1.0] {
            let params = SelectParams {
                temperature,
                seed: 0x1234_5678_9abc_def0,
                step: 3,
                ..SelectParams::default()
            };
            let want = oracle_rows(&logits, None, n, &pos, &params);
            let mut answers = Vec::new();
            for parts in [1, 3] {
                let chunks = chunk_ranges(n, parts);
                let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
                assert_choices(
                    &format!("n={n} T={temperature} {}", path(&chunks)),
                    &got,
                    &want,
                );
                answers.push(got);
            }
            assert_eq!(
                answers[0].iter().map(|c| c.0).collect::<Vec<_>>(),
                answers[1].iter().map(|c| c.0).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn log_probabilities_follow_the_model_softmax_and_change_no_choice() {
    // Asked for, every row also carries log softmax(l)[token] of the model's logits (CFG
    // combined, before the suppression and the temperature), over chunks in any order and
    // for every confidence kind; not asked for, the word is empty and nothing else moves.
    let ctx = ctx();
    let rows = 5;
    for &n in &[7usize, 1000, 5003] {
        let logits = random_vec(70 + n as u64, rows * n, 5.0);
        let uncond = random_vec(90 + n as u64, rows * n, 5.0);
        let pos = positions(rows);
        for (cfg, temperature, kind) in [
            (false, 0.0f32, KINDS[0]),
            (true, 0.0, KINDS[1]),
            (false, 0.8, KINDS[2]),
            (true, 0.8, KINDS[0]),
        ] {
            let params = SelectParams {
                temperature,
                cfg_scale: if cfg { 1.5 } else { 0.0 },
                seed: 4,
                step: 7,
                suppress_token: Some(2),
                confidence: kind,
                tempered: temperature > 0.0,
                ..SelectParams::default()
            };
            let u = cfg.then_some(&uncond[..]);
            let what = format!("n={n} cfg={cfg} T={temperature} {kind:?}");
            let mut chunks = chunk_ranges(n, 3);
            chunks.reverse();
            let plain = run_gpu_words(&ctx, &logits, u, rows, n, &pos, &chunks, &params);
            assert!(
                logprobs(&plain).iter().all(Option::is_none),
                "{what}: not asked for"
            );
            let asked = SelectParams {
                logprob: true,
                ..params
            };
            let words = run_gpu_words(&ctx, &logits, u, rows, n, &pos, &chunks, &asked);
            assert_eq!(pairs(&words), pairs(&plain), "{what}: choices moved");
            assert_logprobs(&what, &words, &logits, u, n, params.cfg_scale);
            let one = run_gpu_words(&ctx, &logits, u, rows, n, &pos, &chunk_ranges(n, 1), &asked);
            assert_logprobs(
                &format!("{what} one chunk"),
                &one,
                &logits,
                u,
                n,
                params.cfg_scale,
            );
        }
    }
}

#[test]
fn noise_changes_with_step_and_seed() {
    // Flat logits: the noise alone picks the token, so new counters must give new tokens.
    let ctx = ctx();
    let (rows, n) = (8, 257);
    let logits = vec![0.5f32; rows * n];
    let pos = positions(rows);
    let chunks = chunk_ranges(n, 1);
    let base = SelectParams {
        temperature: 1.0,
        seed: 9,
        step: 1,
        ..SelectParams::default()
    };
    let a = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &base);
    let b = run_gpu(
        &ctx,
        &logits,
        None,
        rows,
        n,
        &pos,
        &chunks,
        &SelectParams { step: 2, ..base },
    );
    let c = run_gpu(
        &ctx,
        &logits,
        None,
        rows,
        n,
        &pos,
        &chunks,
        &SelectParams { seed: 10, ..base },
    );
    assert_choices(
        "flat logits step 1",
        &a,
        &oracle_rows(&logits, None, n, &pos, &base),
    );
    let differ =
        |x: &[(u32, f32)], y: &[(u32, f32)]| x.iter().zip(y).filter(|(p, q)| p.0 != q.0).count();
    eprintln!(
        "[check] tokens changed: {}/{rows} with the step, {}/{rows} with the seed",
        differ(&a, &b),
        differ(&a, &c)
    );
    assert!(differ(&a, &b) >= rows / 2 && differ(&a, &c) >= rows / 2);
}

#[test]
fn ties_go_to_the_lowest_id_in_any_chunk_order() {
    let ctx = ctx();
    let (rows, n) = (3, 1000);
    let mut logits = random_vec(5, rows * n, 1.0);
    // Row 0: the maximum at 3 ids in three different chunks; row 1: ids 600 and 601 in the
    // same chunk; row 2: every id ties.
    for id in [999, 3, 500] {
        logits[id] = 7.0;
    }
    logits[n + 601] = 7.0;
    logits[n + 600] = 7.0;
    for x in &mut logits[2 * n..] {
        *x = -1.25;
    }
    let pos = positions(rows);
    let params = SelectParams::default();
    let want = oracle_rows(&logits, None, n, &pos, &params);
    assert_eq!(
        want.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![3, 600, 0]
    );
    let mut chunks = chunk_ranges(n, 3);
    let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
    assert_choices("ties, chunks in order", &got, &want);
    chunks.reverse();
    let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
    assert_choices("ties, chunks in reverse order", &got, &want);
    let got = run_gpu(
        &ctx,
        &logits,
        None,
        rows,
        n,
        &pos,
        &chunk_ranges(n, 1),
        &params,
    );
    assert_choices("ties, one vec4 chunk", &got, &want);
}

#[test]
fn classifier_free_guidance() {
    let ctx = ctx();
    let (rows, n) = (5, 1236);
    let cond = random_vec(21, rows * n, 3.0);
    let uncond = random_vec(22, rows * n, 3.0);
    let pos = positions(rows);
    for temperature in [0.0f32, 1.0] {
        let params = SelectParams {
            temperature,
            cfg_scale: 1.5,
            seed: 77,
            step: 11,
            ..SelectParams::default()
        };
        let want = oracle_rows(&cond, Some(&uncond), n, &pos, &params);
        let plain = oracle_rows(&cond, None, n, &pos, &params);
        assert_ne!(
            want, plain,
            "CFG must change the answer for this test to mean anything"
        );
        for parts in [1, 5] {
            let chunks = chunk_ranges(n, parts);
            let got = run_gpu(&ctx, &cond, Some(&uncond), rows, n, &pos, &chunks, &params);
            assert_choices(
                &format!("CFG w=1.5 T={temperature} {}", path(&chunks)),
                &got,
                &want,
            );
        }
    }
}

#[test]
fn suppressed_token_is_never_chosen() {
    let ctx = ctx();
    let (rows, n) = (4, 700);
    let mut logits = random_vec(31, rows * n, 2.0);
    let eos = 450u32;
    for r in 0..rows {
        logits[r * n + eos as usize] = 50.0;
    }
    let pos = positions(rows);
    for temperature in [0.0f32, 1.0] {
        let params = SelectParams {
            temperature,
            suppress_token: Some(eos),
            ..SelectParams::default()
        };
        let want = oracle_rows(&logits, None, n, &pos, &params);
        assert!(want.iter().all(|c| c.0 != eos));
        for parts in [1, 3] {
            let chunks = chunk_ranges(n, parts);
            let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
            assert_choices(
                &format!("suppress {eos} T={temperature} {}", path(&chunks)),
                &got,
                &want,
            );
        }
    }
}

/// Sampled frequencies over many positions follow softmax(l / T): Pearson chi-square with
/// 7 degrees of freedom against its 0.1% critical value (24.32).
#[test]
fn gumbel_frequencies_follow_softmax() {
    let ctx = ctx();
    let base = [0.0f32, 0.5, 1.0, 1.5, -1.0, 2.0, 0.2, -0.5];
    let n = base.len();
    let rows = 4000;
    let logits: Vec<f32> = (0..rows).flat_map(|_| base).collect();
    let pos: Vec<u32> = (0..rows as u32).collect();
    for temperature in [1.0f32, 0.5] {
        let params = SelectParams {
            temperature,
            seed: 2024,
            step: 7,
            ..SelectParams::default()
        };
        let got = run_gpu(
            &ctx,
            &logits,
            None,
            rows,
            n,
            &pos,
            &chunk_ranges(n, 2),
            &params,
        );
        let mut counts = vec![0usize; n];
        for c in &got {
            counts[c.0 as usize] += 1;
        }
        let z: f64 = base
            .iter()
            .map(|&l| (l as f64 / temperature as f64).exp())
            .sum();
        let chi2: f64 = base
            .iter()
            .zip(&counts)
            .map(|(&l, &c)| {
                let expected = rows as f64 * (l as f64 / temperature as f64).exp() / z;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        eprintln!(
            "[check] T={temperature}: counts {counts:?}, chi-square {chi2:.2} (limit 24.32, 7 dof)"
        );
        assert!(
            chi2 < 24.32,
            "frequencies do not follow softmax(l/T): chi2 {chi2:.2}"
        );
        // The confidence stays the untempered softmax probability of the chosen token.
        let want = oracle_rows(&logits, None, n, &pos, &params);
        assert_choices(&format!("frequency rows T={temperature}"), &got, &want);
    }
}

fn expect_shape_error(result: unmask_gpu::Result<()>, what: &str) {
    match result {
        Err(GpuError::Shape { .. }) => eprintln!("[check] {what}: rejected"),
        other => panic!("{what}: expected a shape error, got {other:?}"),
    }
}

#[test]
fn rejects_bad_arguments() {
    let ctx = ctx();
    let logits = Tensor::zeros(&ctx, DType::F32, &[4, 10], "logits").unwrap();
    let pos = Tensor::zeros(&ctx, DType::U32, &[4], "pos").unwrap();
    let state = Tensor::zeros(&ctx, DType::U32, &[sel::state_len(4)], "state").unwrap();
    let small = Tensor::zeros(&ctx, DType::U32, &[sel::state_len(4) - 1], "small").unwrap();
    let p = SelectParams::default();
    let mut step = StepEncoder::new(&ctx, "errors");
    expect_shape_error(
        sel::select_reset(&mut step, &small, 4),
        "state too small for reset",
    );
    expect_shape_error(
        sel::select_accumulate(&mut step, &logits, None, 4, 0, 0, &pos, &state, &p),
        "empty chunk",
    );
    expect_shape_error(
        sel::select_accumulate(&mut step, &logits, None, 4, 11, 0, &pos, &state, &p),
        "logits shorter than rows * n",
    );
    expect_shape_error(
        sel::select_accumulate(&mut step, &logits, None, 4, 10, 0, &pos, &small, &p),
        "state too small",
    );
    let bad = SelectParams {
        temperature: -1.0,
        ..p
    };
    expect_shape_error(
        sel::select_accumulate(&mut step, &logits, None, 4, 10, 0, &pos, &state, &bad),
        "negative temperature",
    );
    let bad = SelectParams {
        suppress_token: Some(u32::MAX),
        ..p
    };
    expect_shape_error(
        sel::select_accumulate(&mut step, &logits, None, 4, 10, 0, &pos, &state, &bad),
        "reserved id",
    );
    expect_shape_error(
        sel::select_accumulate(&mut step, &logits, Some(&logits), 4, 10, 0, &pos, &pos, &p),
        "state aliasing positions",
    );
    expect_shape_error(
        sel::select_finalize(&mut step, &state, &state, 4, &p),
        "out aliasing state",
    );
    assert_eq!(
        step.dispatch_count(),
        0,
        "rejected calls must record nothing"
    );
}

/// A LLaDA-sized vocabulary (126464) for a block of rows, with noise, timed.
#[test]
fn timed_full_vocabulary() {
    let ctx = ctx();
    let (rows, n) = (16, 126_464);
    let logits = random_vec(99, rows * n, 5.0);
    let pos = positions(rows);
    let params = SelectParams {
        temperature: 1.0,
        seed: 5,
        step: 2,
        conf_exclude: [Some(126_081), Some(126_348)],
        ..SelectParams::default()
    };
    let chunks = chunk_ranges(n, 1);
    let _ = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
    let start = Instant::now();
    let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
    eprintln!(
        "[time] select {rows} rows x {n} ids, T=1: {:.1} ms including the logits upload and readback",
        start.elapsed().as_secs_f64() * 1e3
    );
    let want = oracle_rows(&logits, None, n, &pos, &params);
    assert_choices("full vocabulary T=1", &got, &want);
}
