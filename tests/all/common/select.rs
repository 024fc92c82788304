//! Token selection for the select kernel tests: reset / accumulate over vocabulary chunks /
//! finalize on the GPU, the f64 oracle's choice per row, and the check of tokens and
//! confidences against it at each confidence kind's tolerance.

use unmask_core::oracle::sampling::{model_logprob, select_token};
use unmask_gpu::ops::sampling::{self as sel, ConfidenceKind, SelectParams};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor};

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

pub const KINDS: [ConfidenceKind; 3] = [
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
pub fn chunk_ranges(n: usize, parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.min(n).max(1);
    (0..parts)
        .map(|i| (i * n / parts, (i + 1) * n / parts))
        .collect()
}

/// Columns `[lo, hi)` of a row-major `[rows, n]` matrix.
pub fn columns(data: &[f32], n: usize, lo: usize, hi: usize) -> Vec<f32> {
    data.chunks(n)
        .flat_map(|row| row[lo..hi].iter().copied())
        .collect()
}

/// (token, confidence) per row of `select_finalize`'s words.
pub fn pairs(words: &[u32]) -> Vec<(u32, f32)> {
    words
        .chunks(sel::OUT_WORDS)
        .map(|w| (w[0], f32::from_bits(w[1])))
        .collect()
}

/// The log-probability per row of `select_finalize`'s words (`None`: NaN, not asked for).
pub fn logprobs(words: &[u32]) -> Vec<Option<f32>> {
    words
        .chunks(sel::OUT_WORDS)
        .map(|w| Some(f32::from_bits(w[2])).filter(|l| !l.is_nan()))
        .collect()
}

/// Runs reset / accumulate per chunk (in the given order) / finalize in one step.
#[allow(clippy::too_many_arguments)]
pub fn run_gpu(
    ctx: &GpuContext,
    logits: &[f32],
    uncond: Option<&[f32]>,
    rows: usize,
    n: usize,
    positions: &[u32],
    chunks: &[(usize, usize)],
    params: &SelectParams,
) -> Vec<(u32, f32)> {
    pairs(&run_gpu_words(
        ctx, logits, uncond, rows, n, positions, chunks, params,
    ))
}

/// `run_gpu`'s words as `select_finalize` writes them (`sel::OUT_WORDS` per row).
#[allow(clippy::too_many_arguments)]
pub fn run_gpu_words(
    ctx: &GpuContext,
    logits: &[f32],
    uncond: Option<&[f32]>,
    rows: usize,
    n: usize,
    positions: &[u32],
    chunks: &[(usize, usize)],
    params: &SelectParams,
) -> Vec<u32> {
    let pos = Tensor::from_u32(ctx, &[rows], positions, "positions").unwrap();
    let state = Tensor::zeros(ctx, DType::U32, &[sel::state_len(rows)], "state").unwrap();
    let out = Tensor::zeros(ctx, DType::U32, &[rows, sel::OUT_WORDS], "out").unwrap();
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
    sel::select_finalize(&mut step, &state, &out, rows, params).unwrap();
    step.submit().unwrap();
    out.read_u32(ctx).unwrap()
}

pub fn oracle_rows(
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
pub fn assert_choices(what: &str, got: &[(u32, f32)], want: &[(u32, f32)]) {
    assert_kind_choices(what, ConfidenceKind::Probability, false, got, want);
}

/// Asserts identical tokens and confidences of `kind` within its tolerance (an oracle 0
/// must be exactly 0); prints the worst error. `cfg`: the logits were combined with CFG.
pub fn assert_kind_choices(
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

/// Log-probabilities: absolute error over max(1, |log p|). The kernel sums exp in f32 over
/// the row (and combines CFG in f32); the oracle in f64.
const LOGPROB_TOL: f64 = 5e-6;

/// Asserts each row's log-probability (from `select_finalize`'s `words`) against the
/// oracle's `log softmax(l)[token]` of the model's logits (`uncond`: CFG with `cfg_scale`).
pub fn assert_logprobs(
    what: &str,
    words: &[u32],
    logits: &[f32],
    uncond: Option<&[f32]>,
    n: usize,
    cfg_scale: f32,
) {
    let tokens = pairs(words);
    let mut worst = 0f64;
    for (r, (lp, (token, _))) in logprobs(words).into_iter().zip(tokens).enumerate() {
        let row = |m: &[f32]| m[r * n..(r + 1) * n].to_vec();
        let want = model_logprob(&row(logits), uncond.map(row).as_deref(), token, cfg_scale);
        let got = lp.unwrap_or_else(|| panic!("{what}: row {r} has no log-probability")) as f64;
        let err = (got - want).abs() / want.abs().max(1.0);
        assert!(
            got <= 0.0 && err <= LOGPROB_TOL,
            "{what}: row {r} log-probability {got} vs oracle {want}: error {err:.3e} over {LOGPROB_TOL:.0e}"
        );
        worst = worst.max(err);
    }
    eprintln!(
        "[check] {what}: {} log-probabilities, error {worst:.3e} (tolerance {LOGPROB_TOL:.0e})",
        words.len() / sel::OUT_WORDS
    );
}

/// Which accumulate variant the chunks take: vec4 loads when every chunk width is a
/// multiple of 4.
pub fn path(chunks: &[(usize, usize)]) -> String {
    let vec4 = chunks.iter().all(|(lo, hi)| (hi - lo) % 4 == 0);
    format!(
        "chunks={} {}",
        chunks.len(),
        if vec4 { "vec4" } else { "scalar" }
    )
}

pub fn positions(rows: usize) -> Vec<u32> {
    (0..rows as u32).map(|r| 17 + 5 * r).collect()
}
