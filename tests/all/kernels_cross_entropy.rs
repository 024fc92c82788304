//! The GPU cross-entropy of scoring against the f64 oracle (`unmask_core`'s
//! `cross_entropy`): one or several vocabulary chunks, targets at the chunks' edges,
//! guidance, rows placed by `row_base`, and the errors of bad arguments.

use crate::common::select::chunk_ranges;
use crate::common::{ctx, random_vec};
use unmask_core::likelihood::cross_entropy;
use unmask_gpu::ops::cross_entropy::{self as ce, ChunkRows};
use unmask_gpu::{DType, GpuContext, GpuError, StepEncoder, Tensor};

/// Columns `[lo, hi)` of a row-major `[rows, n]` matrix.
fn columns(data: &[f32], n: usize, lo: usize, hi: usize) -> Vec<f32> {
    data.chunks(n)
        .flat_map(|row| row[lo..hi].iter().copied())
        .collect()
}

/// The kernel's losses of `targets` over `logits` `[rows, n]` fed in `chunks`, the state
/// rows from `row_base` on.
fn run_gpu(
    ctx: &GpuContext,
    logits: &[f32],
    uncond: Option<(&[f32], f32)>,
    n: usize,
    targets: &[u32],
    chunks: &[(usize, usize)],
    row_base: usize,
) -> Vec<f64> {
    let rows = targets.len();
    let mut all_targets = vec![0u32; row_base];
    all_targets.extend_from_slice(targets);
    let target_ids = Tensor::from_u32(ctx, &[all_targets.len()], &all_targets, "targets").unwrap();
    let state = Tensor::zeros(
        ctx,
        DType::F32,
        &[(row_base + rows) * ce::STATE_WORDS],
        "state",
    )
    .unwrap();
    for (i, &(lo, hi)) in chunks.iter().enumerate() {
        let part = columns(logits, n, lo, hi);
        let part = Tensor::from_f32(ctx, &[rows, hi - lo], &part, "logits").unwrap();
        let guide = uncond.map(|(u, s)| {
            let u = columns(u, n, lo, hi);
            (
                Tensor::from_f32(ctx, &[rows, hi - lo], &u, "uncond").unwrap(),
                s,
            )
        });
        let mut step = StepEncoder::new(ctx, "cross entropy");
        let at = ChunkRows {
            rows,
            n: hi - lo,
            vocab_offset: lo,
            row_base,
            first: i == 0,
        };
        let guide_ref = guide.as_ref().map(|(t, s)| (t, *s));
        ce::cross_entropy_accumulate(&mut step, &part, guide_ref, &target_ids, &state, at).unwrap();
        step.submit().unwrap();
    }
    let words = state.read_f32(ctx).unwrap();
    ce::cross_entropy_of(&words[row_base * ce::STATE_WORDS..])
}

/// The oracle: each row guided on the host, then its f64 cross-entropy.
fn oracle(logits: &[f32], uncond: Option<(&[f32], f32)>, n: usize, targets: &[u32]) -> Vec<f64> {
    targets
        .iter()
        .enumerate()
        .map(|(r, &t)| {
            let mut row = logits[r * n..(r + 1) * n].to_vec();
            if let Some((u, s)) = uncond {
                for (c, u) in row.iter_mut().zip(&u[r * n..(r + 1) * n]) {
                    *c = u + (s + 1.0) * (*c - u);
                }
            }
            cross_entropy(&row, t as usize)
        })
        .collect()
}

fn assert_losses(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 2e-5 * w.abs().max(1.0),
            "{what}: row {r}: {g} against the oracle's {w}"
        );
    }
}

#[test]
fn matches_the_oracle_over_chunks_with_and_without_guidance() {
    let ctx = ctx();
    for &n in &[7usize, 1000, 5003] {
        let rows = 6;
        let logits = random_vec(n as u64, rows * n, 6.0);
        let uncond = random_vec(n as u64 + 1, rows * n, 6.0);
        // Targets at both ends of the vocabulary and of the three-way chunks' edges.
        let edges = chunk_ranges(n, 3);
        let targets: Vec<u32> = [0, n - 1, edges[1].0, edges[1].0 - 1, edges[2].1 - 1, n / 2]
            .iter()
            .map(|&t| t as u32)
            .collect();
        for guide in [None, Some((uncond.as_slice(), 1.5f32))] {
            let want = oracle(&logits, guide, n, &targets);
            for parts in [1, 3] {
                let chunks = chunk_ranges(n, parts);
                for row_base in [0, 5] {
                    let got = run_gpu(&ctx, &logits, guide, n, &targets, &chunks, row_base);
                    let what = format!(
                        "n={n} {parts} chunk(s) guided={} row_base={row_base}",
                        guide.is_some()
                    );
                    assert_losses(&what, &got, &want);
                }
            }
            // The chunks in another order give the same losses.
            let mut reversed = chunk_ranges(n, 3);
            reversed.reverse();
            let got = run_gpu(&ctx, &logits, guide, n, &targets, &reversed, 0);
            assert_losses(&format!("n={n} reversed chunks"), &got, &want);
        }
    }
}

#[test]
fn extreme_logits_stay_finite_and_exact() {
    // A dominant target (loss near 0), a target far below the max (loss near 1000), and a
    // row of equal logits (ln n).
    let ctx = ctx();
    let n = 300;
    let mut logits = vec![0f32; 3 * n];
    logits[7] = 80.0;
    logits[n + 200] = 500.0;
    logits[n + 3] = -500.0;
    let targets = [7u32, 3, 299];
    let want = oracle(&logits, None, n, &targets);
    let got = run_gpu(&ctx, &logits, None, n, &targets, &chunk_ranges(n, 2), 0);
    assert_losses("extreme logits", &got, &want);
    assert!(got[0] < 1e-6 && (got[1] - 1000.0).abs() < 1e-2);
    assert!(
        (got[2] - (n as f64).ln()).abs() < 1e-5,
        "equal logits: {}",
        got[2]
    );
}

#[test]
fn bad_arguments_are_named() {
    let ctx = ctx();
    let logits = Tensor::zeros(&ctx, DType::F32, &[4, 10], "logits").unwrap();
    let targets = Tensor::zeros(&ctx, DType::U32, &[4], "targets").unwrap();
    let state = Tensor::zeros(&ctx, DType::F32, &[12], "state").unwrap();
    let short_state = Tensor::zeros(&ctx, DType::F32, &[11], "state").unwrap();
    let at = ChunkRows {
        rows: 4,
        n: 10,
        vocab_offset: 0,
        row_base: 0,
        first: true,
    };
    let mut step = StepEncoder::new(&ctx, "bad");
    let cases: Vec<(ChunkRows, &Tensor, &str)> = vec![
        (ChunkRows { n: 11, ..at }, &state, "logits"),
        (ChunkRows { row_base: 1, ..at }, &state, "targets"),
        (at, &short_state, "state"),
    ];
    for (at, state, field) in cases {
        let err = ce::cross_entropy_accumulate(&mut step, &logits, None, &targets, state, at)
            .expect_err(field);
        let GpuError::Shape { op, .. } = &err else {
            panic!("{field}: {err}");
        };
        assert!(op.contains(field), "{field}: {err}");
    }
    // An unconditioned tensor smaller than the logits.
    let small = Tensor::zeros(&ctx, DType::F32, &[4, 9], "uncond").unwrap();
    let err = ce::cross_entropy_accumulate(
        &mut step,
        &logits,
        Some((&small, 1.0)),
        &targets,
        &state,
        at,
    )
    .unwrap_err();
    assert!(err.to_string().contains("uncond"), "{err}");
}
