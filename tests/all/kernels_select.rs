//! Token selection from LM-head logits against the f64 oracle: greedy and Gumbel-noised
//! argmax, one or several vocabulary chunks, ties, CFG, suppressed and excluded ids, the
//! sampled frequencies at T > 0, the three confidence kinds (probability, margin,
//! negative entropy), tempered confidences and the top-p / top-k cut over whole rows.

use crate::common;

use std::time::Instant;

use common::{ctx, random_vec};
use unmask_core::oracle::sampling::{cut_mask, select_token};
use unmask_gpu::ops::sampling::{self as sel, ConfidenceKind, SelectParams};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor};

/// Probability: relative error (f32 exp and sums over up to 152k ids).
const CONF_TOL: f64 = 1e-5;
/// Margin: relative error without CFG (the logits are the same f32 values for the kernel and
/// the oracle, and the kernel's 1 - exp(l2 - l1) does not cancel next to a tie).
const MARGIN_TOL: f64 = 1e-5;
/// Margin with CFG or a tempered confidence: absolute error. The kernel combines (or
/// scales) the logits in f32, which moves the gap l1 - l2 by a few ulps of |l|; next to a
/// tie that has no relative bound.
const MARGIN_CFG_TOL: f64 = 1e-5;
/// Negative entropy: absolute error over max(1, |H|) (|H| reaches ln V, 12 at 152k ids).
const ENTROPY_TOL: f64 = 1e-5;

const KINDS: [ConfidenceKind; 3] = [
    ConfidenceKind::Probability,
    ConfidenceKind::Margin,
    ConfidenceKind::NegEntropy,
];

/// A confidence's error against the oracle's, as the kind's tolerance measures it, and
/// that tolerance.
fn conf_error(kind: ConfidenceKind, cfg: bool, got: f32, want: f32) -> (f64, f64) {
    let (g, w) = (got as f64, want as f64);
    match kind {
        ConfidenceKind::Probability => (((g - w) / w).abs(), CONF_TOL),
        ConfidenceKind::Margin if cfg => ((g - w).abs(), MARGIN_CFG_TOL),
        ConfidenceKind::Margin => (((g - w) / w).abs(), MARGIN_TOL),
        ConfidenceKind::NegEntropy => ((g - w).abs() / w.abs().max(1.0), ENTROPY_TOL),
    }
}

/// Splits `0..n` into `parts` nearly equal, non-empty ranges.
fn chunk_ranges(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.min(n).max(1);
    (0..parts)
        .map(|i| (i * n / parts, (i + 1) * n / parts))
        .collect()
}

/// Columns `[lo, hi)` of a row-major `[rows, n]` matrix.
fn columns(data: &[f32], n: usize, lo: usize, hi: usize) -> Vec<f32> {
    data.chunks(n)
        .flat_map(|row| row[lo..hi].iter().copied())
        .collect()
}

/// Runs reset / accumulate per chunk (in the given order) / finalize in one step.
#[allow(clippy::too_many_arguments)]
fn run_gpu(
    ctx: &GpuContext,
    logits: &[f32],
    uncond: Option<&[f32]>,
    rows: usize,
    n: usize,
    positions: &[u32],
    chunks: &[(usize, usize)],
    params: &SelectParams,
) -> Vec<(u32, f32)> {
    let pos = Tensor::from_u32(ctx, &[rows], positions, "positions").unwrap();
    let state = Tensor::zeros(ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let out = Tensor::zeros(ctx, DType::U32, &[rows, 2], "out").unwrap();
    let mut tensors = Vec::new();
    for &(lo, hi) in chunks {
        let c = columns(logits, n, lo, hi);
        let ct = Tensor::from_f32(ctx, &[rows, hi - lo], &c, "logits").unwrap();
        let ut = uncond.map(|u| {
            let c = columns(u, n, lo, hi);
            Tensor::from_f32(ctx, &[rows, hi - lo], &c, "uncond").unwrap()
        });
        tensors.push((lo, hi, ct, ut));
    }
    let mut step = StepEncoder::new(ctx, "select");
    sel::select_reset(&mut step, &state, rows).unwrap();
    for (lo, hi, ct, ut) in &tensors {
        sel::select_accumulate(
            &mut step,
            ct,
            ut.as_ref(),
            rows,
            hi - lo,
            *lo,
            &pos,
            &state,
            params,
        )
        .unwrap();
    }
    sel::select_finalize(&mut step, &state, &out, rows, params.confidence).unwrap();
    step.submit().unwrap();
    let words = out.read_u32(ctx).unwrap();
    words
        .chunks(2)
        .map(|w| (w[0], f32::from_bits(w[1])))
        .collect()
}

fn oracle_rows(
    logits: &[f32],
    uncond: Option<&[f32]>,
    n: usize,
    positions: &[u32],
    params: &SelectParams,
) -> Vec<(u32, f32)> {
    positions
        .iter()
        .enumerate()
        .map(|(r, &pos)| {
            let row = &logits[r * n..(r + 1) * n];
            select_token(row, uncond.map(|u| &u[r * n..(r + 1) * n]), pos, params)
        })
        .collect()
}

/// Asserts identical tokens and probabilities within `CONF_TOL`; prints the worst error.
fn assert_choices(what: &str, got: &[(u32, f32)], want: &[(u32, f32)]) {
    assert_kind_choices(what, ConfidenceKind::Probability, false, got, want);
}

/// Asserts identical tokens and confidences of `kind` within its tolerance (an oracle 0
/// must be exactly 0); prints the worst error. `cfg`: the logits were combined with CFG.
fn assert_kind_choices(
    what: &str,
    kind: ConfidenceKind,
    cfg: bool,
    got: &[(u32, f32)],
    want: &[(u32, f32)],
) {
    assert_eq!(got.len(), want.len());
    let mut worst = 0f64;
    let mut tol = 0f64;
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.0, w.0, "{what}: row {r} token {} != oracle {}", g.0, w.0);
        let (err, t) = conf_error(kind, cfg, g.1, w.1);
        tol = t;
        let err = if w.1 == 0.0 {
            assert_eq!(g.1, 0.0, "{what}: row {r} confidence must be exactly 0");
            0.0
        } else {
            err
        };
        assert!(
            err <= tol,
            "{what}: row {r} confidence {} vs oracle {}: error {err:.3e} over {tol:.0e}",
            g.1,
            w.1
        );
        worst = worst.max(err);
    }
    eprintln!(
        "[check] {what} ({kind:?}): {} rows, tokens equal, confidence error {worst:.3e} (tolerance {tol:.0e})",
        got.len()
    );
}

/// Which accumulate variant the chunks take: vec4 loads when every chunk width is a
/// multiple of 4.
fn path(chunks: &[(usize, usize)]) -> String {
    let vec4 = chunks.iter().all(|(lo, hi)| (hi - lo) % 4 == 0);
    format!(
        "chunks={} {}",
        chunks.len(),
        if vec4 { "vec4" } else { "scalar" }
    )
}

fn positions(rows: usize) -> Vec<u32> {
    (0..rows as u32).map(|r| 17 + 5 * r).collect()
}

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

#[test]
fn confidence_exclusions() {
    let ctx = ctx();
    let (rows, n) = (4, 600);
    let mut logits = random_vec(41, rows * n, 2.0);
    // Rows 0, 1: id 10 is the argmax and excluded -> confidence 0. Rows 2, 3: id 20 is the
    // argmax, ids 10 and 30 are excluded but not chosen -> larger confidence.
    for r in 0..rows {
        let top = if r < 2 { 10 } else { 20 };
        logits[r * n + top] = 9.0;
        if r >= 2 {
            logits[r * n + 10] = 8.5;
            logits[r * n + 30] = 8.0;
        }
    }
    let pos = positions(rows);
    let params = SelectParams {
        conf_exclude: [Some(10), Some(30)],
        ..SelectParams::default()
    };
    let want = oracle_rows(&logits, None, n, &pos, &params);
    let unexcluded = oracle_rows(&logits, None, n, &pos, &SelectParams::default());
    assert_eq!(want[0], (10, 0.0));
    assert!(want[2].0 == 20 && want[2].1 > unexcluded[2].1 * 1.5);
    for parts in [1, 7] {
        let chunks = chunk_ranges(n, parts);
        let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
        assert_choices(&format!("conf_exclude {}", path(&chunks)), &got, &want);
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

/// Every kind at odd and even vocabulary sizes and several chunkings (one reversed), with and
/// without CFG, greedy and noised: the token is the same for every kind and the confidence
/// (from the untempered softmax) matches the oracle's.
#[test]
fn confidence_kinds_match_oracle() {
    let ctx = ctx();
    let rows = 5;
    let pos = positions(rows);
    for &n in &[1usize, 7, 1000, 3001, 4096] {
        let cond = random_vec(100 + n as u64, rows * n, 4.0);
        let uncond = random_vec(200 + n as u64, rows * n, 4.0);
        for cfg in [false, true] {
            let u = cfg.then_some(uncond.as_slice());
            for temperature in [0.0f32, 0.8] {
                let mut tokens = Vec::new();
                for kind in KINDS {
                    let params = SelectParams {
                        temperature,
                        cfg_scale: if cfg { 1.5 } else { 0.0 },
                        seed: 0xfeed_beef,
                        step: 4,
                        confidence: kind,
                        ..SelectParams::default()
                    };
                    let want = oracle_rows(&cond, u, n, &pos, &params);
                    tokens.push(want.iter().map(|c| c.0).collect::<Vec<_>>());
                    for parts in [1, 4, 7] {
                        let mut chunks = chunk_ranges(n, parts);
                        let order = if parts == 7 {
                            chunks.reverse();
                            " reversed"
                        } else {
                            ""
                        };
                        let got = run_gpu(&ctx, &cond, u, rows, n, &pos, &chunks, &params);
                        assert_kind_choices(
                            &format!("n={n} cfg={cfg} T={temperature} {}{order}", path(&chunks)),
                            kind,
                            cfg,
                            &got,
                            &want,
                        );
                    }
                }
                assert!(
                    tokens.iter().all(|t| *t == tokens[0]),
                    "n={n} cfg={cfg} T={temperature}: the token depends on the kind"
                );
            }
        }
    }
}

/// Exact ties between the two largest logits give a margin of exactly 0 wherever the two
/// meet (different chunks, one vec4 load, one invocation's strided loop, every id), a near
/// tie a small margin without cancellation; one dominant logit gives margin ~1 and entropy
/// ~0.
#[test]
fn margin_ties_and_a_dominant_logit() {
    let ctx = ctx();
    let (rows, n) = (7, 1000);
    let mut logits = random_vec(7, rows * n, 1.0);
    // Row 0: ids 3 and 999 (different chunks); row 1: 600 and 601 (one vec4 load); row 2:
    // 40 and 296 (one lane of the scalar loop, 256 apart); row 3: every id ties; row 4: id
    // 123 is 59 or more above the rest; row 5: id 77 leads by 10 or more; row 6: id 500
    // leads id 900 by 2 ulps.
    for (row, ids) in [(0, [3, 999]), (1, [600, 601]), (2, [40, 296])] {
        for id in ids {
            logits[row * n + id] = 7.0;
        }
    }
    logits[3 * n..4 * n].fill(-0.75);
    logits[4 * n + 123] = 60.0;
    logits[5 * n + 77] = 12.0;
    logits[6 * n + 500] = 7.0;
    logits[6 * n + 900] = 7.0 - 2.0 * f32::EPSILON * 4.0;
    let pos = positions(rows);
    let three = chunk_ranges(n, 3);
    let reversed: Vec<_> = three.iter().rev().copied().collect();
    let chunkings = [chunk_ranges(n, 1), three, reversed];
    for kind in KINDS {
        let params = SelectParams {
            confidence: kind,
            ..SelectParams::default()
        };
        let want = oracle_rows(&logits, None, n, &pos, &params);
        assert_eq!(
            want.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![3, 600, 40, 0, 123, 77, 500]
        );
        match kind {
            ConfidenceKind::Margin => {
                assert!(want[..4].iter().all(|c| c.1 == 0.0), "{want:?}");
                assert!(want[4].1 == 1.0 && want[5].1 > 0.99, "{want:?}");
                assert!(want[6].1 > 0.0 && want[6].1 < 1e-5, "{want:?}");
            }
            ConfidenceKind::NegEntropy => {
                assert!((want[3].1 as f64 + (n as f64).ln()).abs() < 1e-6);
                assert!(want[4].1 <= 0.0 && want[4].1 > -1e-20, "{want:?}");
                assert!(want[5].1 < -1e-3 && want[5].1 > -0.2, "{want:?}");
            }
            ConfidenceKind::Probability => {}
        }
        for (i, chunks) in chunkings.iter().enumerate() {
            let got = run_gpu(&ctx, &logits, None, rows, n, &pos, chunks, &params);
            let order = if i == 2 { " reversed" } else { "" };
            assert_kind_choices(
                &format!("ties and a dominant logit {}{order}", path(chunks)),
                kind,
                false,
                &got,
                &want,
            );
            match kind {
                ConfidenceKind::Margin => assert_eq!(got[4].1, 1.0),
                ConfidenceKind::NegEntropy => assert!(got[4].1 <= 0.0 && got[4].1 > -1e-20),
                ConfidenceKind::Probability => {}
            }
        }
    }
}

/// `conf_exclude` only changes the probability; the suppressed id leaves every kind's
/// softmax.
#[test]
fn exclusions_only_change_the_probability() {
    let ctx = ctx();
    let (rows, n) = (3, 513);
    let mut logits = random_vec(51, rows * n, 2.0);
    // Id 10 is the argmax and excluded; id 20, the runner-up, is suppressed.
    for r in 0..rows {
        logits[r * n + 10] = 9.0;
        logits[r * n + 20] = 8.5;
    }
    let pos = positions(rows);
    for kind in KINDS {
        let params = SelectParams {
            conf_exclude: [Some(10), Some(30)],
            suppress_token: Some(20),
            confidence: kind,
            ..SelectParams::default()
        };
        let want = oracle_rows(&logits, None, n, &pos, &params);
        let unexcluded = SelectParams {
            conf_exclude: [None; 2],
            ..params
        };
        let unsuppressed = SelectParams {
            suppress_token: None,
            ..unexcluded
        };
        let unexcluded = oracle_rows(&logits, None, n, &pos, &unexcluded);
        let unsuppressed = oracle_rows(&logits, None, n, &pos, &unsuppressed);
        assert!(want.iter().all(|c| c.0 == 10));
        if kind == ConfidenceKind::Probability {
            assert!(want.iter().all(|c| c.1 == 0.0));
        } else {
            assert_eq!(want, unexcluded);
            assert!(want.iter().zip(&unsuppressed).all(|(a, b)| a.1 != b.1));
        }
        for parts in [1, 4] {
            let chunks = chunk_ranges(n, parts);
            let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
            assert_kind_choices(
                &format!("exclude 10, 30, suppress 20 {}", path(&chunks)),
                kind,
                false,
                &got,
                &want,
            );
        }
    }
}

/// A Dream-sized vocabulary (152064 ids) in 5 chunks, with noise: the tolerances hold at
/// full size.
#[test]
fn confidence_kinds_full_vocabulary() {
    let ctx = ctx();
    let (rows, n) = (4, 152_064);
    let logits = random_vec(98, rows * n, 5.0);
    let pos = positions(rows);
    let chunks = chunk_ranges(n, 5);
    for kind in KINDS {
        let params = SelectParams {
            temperature: 1.0,
            seed: 8,
            step: 1,
            confidence: kind,
            ..SelectParams::default()
        };
        let got = run_gpu(&ctx, &logits, None, rows, n, &pos, &chunks, &params);
        let want = oracle_rows(&logits, None, n, &pos, &params);
        assert_kind_choices(
            &format!("n={n} T=1 {}", path(&chunks)),
            kind,
            false,
            &got,
            &want,
        );
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
        sel::select_finalize(&mut step, &state, &state, 4, p.confidence),
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

/// The kernel's order-preserving map of f32 to u32 (`order_key` in shaders/select.wgsl).
fn order_key(x: f32) -> u32 {
    let b = if x == 0.0 { 0 } else { x.to_bits() };
    if b >> 31 != 0 { !b } else { b | 0x8000_0000 }
}

/// Threshold + accumulate over whole rows split in two groups (rows `[0, split)` and
/// `[split, rows)`, the second at row_base `split`): the choices and each row's cut key.
fn run_gpu_cut(
    ctx: &GpuContext,
    logits: &[f32],
    rows: usize,
    n: usize,
    split: usize,
    positions: &[u32],
    params: &SelectParams,
) -> (Vec<(u32, f32)>, Vec<u32>) {
    let pos = Tensor::from_u32(ctx, &[rows], positions, "positions").unwrap();
    let state = Tensor::zeros(ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let out = Tensor::zeros(ctx, DType::U32, &[rows, 2], "out").unwrap();
    let cut = Tensor::zeros(ctx, DType::U32, &[rows], "cut").unwrap();
    let groups: Vec<(usize, Tensor)> = [(0, split), (split, rows)]
        .into_iter()
        .map(|(lo, hi)| {
            let data = &logits[lo * n..hi * n];
            (
                lo,
                Tensor::from_f32(ctx, &[hi - lo, n], data, "rows").unwrap(),
            )
        })
        .collect();
    let mut step = StepEncoder::new(ctx, "cut select");
    sel::select_reset(&mut step, &state, rows).unwrap();
    for (lo, t) in &groups {
        let group_rows = t.shape[0];
        let at = sel::FullRows {
            row_base: *lo,
            cut: &cut,
        };
        sel::select_threshold(&mut step, t, group_rows, n, at, params).unwrap();
        sel::select_accumulate_cut(&mut step, t, group_rows, n, at, &pos, &state, params).unwrap();
    }
    sel::select_finalize(&mut step, &state, &out, rows, params.confidence).unwrap();
    step.submit().unwrap();
    let words = out.read_u32(ctx).unwrap();
    let choices = words
        .chunks(2)
        .map(|w| (w[0], f32::from_bits(w[1])))
        .collect();
    (choices, cut.read_u32(ctx).unwrap())
}

/// Whether a row's top-p cut lies within float noise of a boundary: the oracle's kept set
/// changes when p moves by a relative 1e-4.
fn knife_edge(row: &[f64], params: &SelectParams) -> bool {
    let Some(p) = params.top_p.filter(|&p| p < 1.0) else {
        return false;
    };
    let at = |q: f32| {
        cut_mask(
            row,
            &SelectParams {
                top_p: Some(q.min(1.0)),
                ..*params
            },
        )
    };
    at(p * (1.0 - 1e-4)) != at(p * (1.0 + 1e-4))
}

#[test]
fn top_p_top_k_cut_matches_oracle() {
    let ctx = ctx();
    let rows = 7;
    let mut checked = 0;
    let mut edges = 0;
    for &n in &[1000usize, 1003] {
        let mut logits = random_vec(40 + n as u64, rows * n, 6.0);
        // Row 1 on a coarse grid: many ties, also at the k-th value.
        for x in &mut logits[n..2 * n] {
            *x = (*x * 2.0).round() / 2.0;
        }
        // Row 2 peaked: its first id dominates (p cuts to one id).
        logits[2 * n] = 40.0;
        let pos = positions(rows);
        let cuts: [(Option<f32>, Option<u32>); 6] = [
            (None, Some(1)),
            (None, Some(9)),
            (Some(0.3), None),
            (Some(0.9), None),
            (Some(0.9), Some(5)),
            (Some(1.0), Some(40)),
        ];
        for (top_p, top_k) in cuts {
            for (temperature, tempered) in [(0.0f32, false), (0.7, false), (0.7, true)] {
                for kind in KINDS {
                    let params = SelectParams {
                        temperature,
                        tempered,
                        top_p,
                        top_k,
                        confidence: kind,
                        seed: 99,
                        step: 2,
                        suppress_token: Some(3),
                        ..SelectParams::default()
                    };
                    let (got, keys) = run_gpu_cut(&ctx, &logits, rows, n, 3, &pos, &params);
                    let want = oracle_rows(&logits, None, n, &pos, &params);
                    let what = format!(
                        "n={n} top_p={top_p:?} top_k={top_k:?} T={temperature} tempered={tempered}"
                    );
                    let (mut g, mut w) = (Vec::new(), Vec::new());
                    for r in 0..rows {
                        let row: Vec<f64> = logits[r * n..(r + 1) * n]
                            .iter()
                            .enumerate()
                            .map(|(v, &x)| if v == 3 { f64::NEG_INFINITY } else { x as f64 })
                            .collect();
                        if knife_edge(&row, &params) {
                            edges += 1;
                            continue;
                        }
                        // The kept set itself: key >= cut, the suppressed id aside.
                        let kept: Vec<bool> = logits[r * n..(r + 1) * n]
                            .iter()
                            .enumerate()
                            .map(|(v, &x)| v != 3 && order_key(x) >= keys[r])
                            .collect();
                        assert_eq!(kept, cut_mask(&row, &params), "{what}: row {r} kept set");
                        assert!(kept[got[r].0 as usize], "{what}: row {r} chose a cut id");
                        g.push(got[r]);
                        w.push(want[r]);
                        checked += 1;
                    }
                    // Tempered: the kernel scales the logits in f32, as CFG combines them.
                    assert_kind_choices(&what, kind, tempered, &g, &w);
                }
            }
        }
    }
    eprintln!(
        "[check] cut: {checked} rows equal to the oracle, {edges} within 1e-4 of a p boundary"
    );
    assert!(edges * 20 < checked, "{edges} knife-edge rows of {checked}");
}

#[test]
fn accumulate_refuses_a_cut_over_chunks() {
    let ctx = ctx();
    let logits = Tensor::from_f32(&ctx, &[1, 4], &[0.0; 4], "logits").unwrap();
    let pos = Tensor::from_u32(&ctx, &[1], &[0], "positions").unwrap();
    let state = Tensor::zeros(&ctx, DType::U32, &[sel::state_len(1)], "state").unwrap();
    let params = SelectParams {
        top_k: Some(2),
        ..SelectParams::default()
    };
    let mut step = StepEncoder::new(&ctx, "refuse");
    let err = sel::select_accumulate(&mut step, &logits, None, 1, 4, 0, &pos, &state, &params)
        .unwrap_err();
    assert!(err.to_string().contains("select_accumulate_cut"), "{err}");
}
