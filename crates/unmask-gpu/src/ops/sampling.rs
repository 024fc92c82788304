//! Token selection from LM-head logits (DESIGN.md §2): per row, the argmax of the
//! CFG-combined logits (plus Gumbel noise when T > 0) and a confidence from the untempered
//! softmax: the chosen token's probability, the top-1 minus top-2 margin or the negative
//! entropy (`ConfidenceKind`), and on request the token's log-probability under the model's
//! own softmax. Logits stay on the GPU; a row reads back 12 bytes.
//!
//! The LM head may produce the logits one vocabulary chunk at a time, so selection is a
//! streaming reduction: `select_reset`, then `select_accumulate` once per chunk (any order
//! of chunks gives the same answer), then `select_finalize`.
//!
//! A top-p / top-k cut needs whole rows: `select_threshold` finds each row's cut over full
//! rows, then `select_accumulate_cut` folds those rows in one pass.

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use crate::error::{GpuError, Result};
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{Binding, StepEncoder, groups_2d};
use crate::tensor::{DType, Tensor};

pub use unmask_core::sampler::{ConfidenceKind, SelectParams};

const SELECT: KernelSource = kernel_source!("select", "rng");

/// u32 words of selection state per row, the same for every confidence kind: best score,
/// best id, its logit, softmax max, S0, second largest logit (margin), S1 (entropy), and
/// the model softmax's best logit, max and sum (log-probabilities).
pub const STATE_WORDS: usize = 10;

/// u32 words per row written by `select_finalize`: token id, confidence bits, and the bits
/// of the token's log-probability (NaN unless `SelectParams::logprob`).
pub const OUT_WORDS: usize = 3;

/// Invocations of the per-row `reset` / `finalize` kernels.
const ROW_WG: usize = 64;

/// Words of state needed for `rows` rows.
pub fn state_len(rows: usize) -> usize {
    rows * STATE_WORDS
}

/// Id value the kernel reserves for "none".
const NONE: u32 = u32::MAX;

const KINDS: [ConfidenceKind; 3] = [
    ConfidenceKind::Probability,
    ConfidenceKind::Margin,
    ConfidenceKind::NegEntropy,
];

/// The confidence kind is a shader flag of `accumulate` and `finalize` (none for the
/// probability), so each variant only carries the statistics its kind needs.
fn with_kind(spec: Spec, kind: ConfidenceKind) -> Spec {
    match kind {
        ConfidenceKind::Probability => spec,
        ConfidenceKind::Margin => spec.flag("MARGIN"),
        ConfidenceKind::NegEntropy => spec.flag("ENTROPY"),
    }
}

/// What `accumulate` computes besides the token: the confidence kind, and the model's
/// log-probability of the token when asked (one more exp per logit).
#[derive(Clone, Copy)]
struct Stats {
    kind: ConfidenceKind,
    logprob: bool,
}

impl Stats {
    fn of(params: &SelectParams) -> Self {
        Self {
            kind: params.confidence,
            // The alternatives' log-probabilities need the same softmax.
            logprob: params.logprob || params.top_logprobs > 0,
        }
    }

    fn all() -> impl Iterator<Item = Self> {
        KINDS.into_iter().flat_map(|kind| {
            [false, true]
                .into_iter()
                .map(move |logprob| Self { kind, logprob })
        })
    }

    fn apply(self, spec: Spec) -> Spec {
        with_kind(spec, self.kind).flag_if(self.logprob, "LOGPROB")
    }
}

fn accumulate_spec(cfg: bool, noise: bool, vec4: bool, cut: bool, stats: Stats) -> Spec {
    // Optional bindings follow the fixed ones in this order: uncond (3), cut, positions.
    let cut_binding = if cfg { 4 } else { 3 };
    let spec = Spec::new()
        .flag("ACCUMULATE")
        .flag_if(cfg, "CFG")
        .flag_if(noise, "NOISE")
        .flag_if(vec4, "VEC4")
        .flag_if(cut, "CUT")
        .constant("CUT_BINDING", cut_binding)
        .constant("POS_BINDING", cut_binding + cut as u32);
    stats.apply(spec)
}

fn threshold_spec() -> Spec {
    Spec::new().flag("THRESHOLD")
}

fn finalize_spec(stats: Stats) -> Spec {
    stats.apply(Spec::new().flag("FINALIZE"))
}

pub fn variants() -> Vec<ShaderVariant> {
    let mut v = vec![
        ShaderVariant {
            kernel: SELECT,
            entry: "reset",
            spec: Spec::new().flag("RESET"),
        },
        ShaderVariant {
            kernel: SELECT,
            entry: "threshold",
            spec: threshold_spec(),
        },
    ];
    for stats in Stats::all() {
        v.push(ShaderVariant {
            kernel: SELECT,
            entry: "finalize",
            spec: finalize_spec(stats),
        });
        // The cut never runs with CFG (`GenerationParams::validate` refuses it).
        for (cfg, cut) in [(false, false), (true, false), (false, true)] {
            for noise in [false, true] {
                for vec4 in [false, true] {
                    v.push(ShaderVariant {
                        kernel: SELECT,
                        entry: "accumulate",
                        spec: accumulate_spec(cfg, noise, vec4, cut, stats),
                    });
                }
            }
        }
    }
    v
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct RowParams {
    rows: u32,
    _pad: [u32; 3],
}

/// The uniform of `accumulate`, built from `SelectParams` (which is not passed as is: its
/// `Option`s become `NONE`, the seed two words). The confidence kind needs no word here: it
/// picks the shader variant.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct AccumulateParams {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    step: u32,
    seed_lo: u32,
    seed_hi: u32,
    suppress: u32,
    exclude0: u32,
    exclude1: u32,
    noise_scale: f32,
    cfg_scale: f32,
    logit_scale: f32,
    row_base: u32,
    _pad: [u32; 3],
}

/// `ThresholdParams::min_gap` without a min-p cut: the shader's NEG.
const NO_MIN_GAP: f32 = -3.0e38;

/// The uniform of `threshold`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct ThresholdParams {
    rows: u32,
    n: u32,
    row_base: u32,
    suppress: u32,
    top_k: u32,
    top_p: f32,
    scale: f32,
    min_gap: f32,
}

pub(super) fn shape_error(op: &'static str, expected: String, found: String) -> GpuError {
    GpuError::Shape {
        op,
        expected,
        found,
    }
}

pub(super) fn check_tensor(
    op: &'static str,
    what: &str,
    t: &Tensor,
    dtype: DType,
    min_elems: usize,
) -> Result<()> {
    if t.dtype == dtype && t.numel() >= min_elems {
        Ok(())
    } else {
        Err(shape_error(
            op,
            format!("{what}: {dtype:?} tensor with at least {min_elems} elements"),
            format!("{:?} {:?}", t.dtype, t.shape),
        ))
    }
}

fn rows_u32(op: &'static str, rows: usize) -> Result<u32> {
    u32::try_from(rows).map_err(|_| shape_error(op, "rows below 2^32".into(), rows.to_string()))
}

fn row_groups(step: &StepEncoder, rows: u32) -> [u32; 3] {
    groups_2d(step.ctx(), rows.div_ceil(ROW_WG as u32))
}

/// Clears the state of `rows` rows before the first chunk.
pub fn select_reset(step: &mut StepEncoder, state: &Tensor, rows: usize) -> Result<()> {
    const OP: &str = "select_reset";
    check_tensor(OP, "state", state, DType::U32, state_len(rows))?;
    if rows == 0 {
        return Ok(());
    }
    let n = rows_u32(OP, rows)?;
    let pipeline = step
        .ctx()
        .pipeline(&SELECT, "reset", &Spec::new().flag("RESET"))?;
    let params = RowParams {
        rows: n,
        _pad: [0; 3],
    };
    let groups = row_groups(step, n);
    step.dispatch(&pipeline, &params, &[state.into()], groups);
    Ok(())
}

fn id_param(what: &str, id: Option<u32>) -> Result<u32> {
    match id {
        Some(NONE) => Err(shape_error(
            "select_accumulate",
            format!("{what} below {NONE}"),
            NONE.to_string(),
        )),
        Some(id) => Ok(id),
        None => Ok(NONE),
    }
}

/// Folds one vocabulary chunk of logits into the state: `logits` (and `uncond` with CFG)
/// hold f32 `[rows, n]` for vocabulary ids `[vocab_offset, vocab_offset + n)`;
/// `positions` (u32 `[rows]`) are the rows' sequence positions, a counter of the noise.
#[allow(clippy::too_many_arguments)]
pub fn select_accumulate(
    step: &mut StepEncoder,
    logits: &Tensor,
    uncond: Option<&Tensor>,
    rows: usize,
    n: usize,
    vocab_offset: usize,
    positions: &Tensor,
    state: &Tensor,
    params: &SelectParams,
) -> Result<()> {
    if params.cuts() {
        return Err(shape_error(
            "select_accumulate",
            "no top-p / top-k cut (whole rows go through select_accumulate_cut)".into(),
            format!("top_p {:?}, top_k {:?}", params.top_p, params.top_k),
        ));
    }
    accumulate(
        step,
        logits,
        uncond,
        rows,
        n,
        vocab_offset,
        positions,
        state,
        params,
        None,
    )
}

/// Where rows of full logits sit among the rows of the state: logits row r is state (and
/// positions, and cut) row `row_base + r`.
#[derive(Clone, Copy)]
pub struct FullRows<'a> {
    pub row_base: usize,
    /// u32 `[row_base + rows]`: each row's threshold key from `select_threshold`.
    pub cut: &'a Tensor,
}

/// Writes each row's cut (`SelectParams::top_p`, `top_k`) into `cut[row_base + r]`:
/// `logits` holds f32 `[rows, vocab]`, whole rows. The tempered probabilities of the cut
/// use `params.temperature`.
pub fn select_threshold(
    step: &mut StepEncoder,
    logits: &Tensor,
    rows: usize,
    vocab: usize,
    at: FullRows<'_>,
    params: &SelectParams,
) -> Result<()> {
    const OP: &str = "select_threshold";
    let elems = rows
        .checked_mul(vocab)
        .filter(|&e| e <= u32::MAX as usize)
        .ok_or_else(|| {
            shape_error(
                OP,
                "rows * vocab below 2^32".into(),
                format!("{rows} x {vocab}"),
            )
        })?;
    check_tensor(OP, "logits", logits, DType::F32, elems)?;
    check_tensor(OP, "cut", at.cut, DType::U32, at.row_base + rows)?;
    if Arc::ptr_eq(&logits.buffer, &at.cut.buffer) {
        return Err(shape_error(
            OP,
            "cut in a buffer of its own".into(),
            "cut shares its buffer with logits".into(),
        ));
    }
    if let Some(top_p) = params.top_p
        && !(top_p > 0.0 && top_p <= 1.0)
    {
        return Err(shape_error(OP, "top_p in (0, 1]".into(), top_p.to_string()));
    }
    if params.top_k == Some(0) {
        return Err(shape_error(OP, "top_k >= 1".into(), "0".into()));
    }
    if let Some(min_p) = params.min_p
        && !(0.0..=1.0).contains(&min_p)
    {
        return Err(shape_error(OP, "min_p in [0, 1]".into(), min_p.to_string()));
    }
    if rows == 0 {
        return Ok(());
    }
    let t = params.temperature;
    let p = ThresholdParams {
        rows: rows_u32(OP, rows)?,
        n: vocab as u32,
        row_base: rows_u32(OP, at.row_base)?,
        suppress: id_param("suppress_token", params.suppress_token)?,
        top_k: params.top_k.unwrap_or(0),
        top_p: params.top_p.filter(|&p| p < 1.0).unwrap_or(2.0),
        scale: if t > 0.0 { 1.0 / t } else { 1.0 },
        min_gap: params.min_p_gap().unwrap_or(NO_MIN_GAP),
    };
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&SELECT, "threshold", &threshold_spec())?;
    let groups = groups_2d(ctx, p.rows);
    step.dispatch(&pipeline, &p, &[logits.into(), at.cut.into()], groups);
    Ok(())
}

/// `select_accumulate` over whole rows after `select_threshold`: ids below their row's cut
/// take no part. `logits` holds f32 `[rows, vocab]`; their state rows start at
/// `at.row_base`. No CFG.
#[allow(clippy::too_many_arguments)]
pub fn select_accumulate_cut(
    step: &mut StepEncoder,
    logits: &Tensor,
    rows: usize,
    vocab: usize,
    at: FullRows<'_>,
    positions: &Tensor,
    state: &Tensor,
    params: &SelectParams,
) -> Result<()> {
    accumulate(
        step,
        logits,
        None,
        rows,
        vocab,
        0,
        positions,
        state,
        params,
        Some(at),
    )
}

#[allow(clippy::too_many_arguments)]
fn accumulate(
    step: &mut StepEncoder,
    logits: &Tensor,
    uncond: Option<&Tensor>,
    rows: usize,
    n: usize,
    vocab_offset: usize,
    positions: &Tensor,
    state: &Tensor,
    params: &SelectParams,
    full: Option<FullRows<'_>>,
) -> Result<()> {
    const OP: &str = "select_accumulate";
    if n == 0
        || vocab_offset
            .checked_add(n)
            .is_none_or(|end| end > NONE as usize)
    {
        return Err(shape_error(
            OP,
            format!("a non-empty chunk ending below {NONE}"),
            format!("{n} ids at offset {vocab_offset}"),
        ));
    }
    if !(params.temperature.is_finite()
        && params.temperature >= 0.0
        && params.cfg_scale.is_finite())
    {
        return Err(shape_error(
            OP,
            "a finite temperature >= 0 and a finite cfg_scale".into(),
            format!(
                "temperature {}, cfg_scale {}",
                params.temperature, params.cfg_scale
            ),
        ));
    }
    let suppress = id_param("suppress_token", params.suppress_token)?;
    let exclude0 = id_param("conf_exclude[0]", params.conf_exclude[0])?;
    let exclude1 = id_param("conf_exclude[1]", params.conf_exclude[1])?;
    // Only the probability leaves ids out of its softmax; margin and entropy see the row.
    let (exclude0, exclude1) = match params.confidence {
        ConfidenceKind::Probability => (exclude0, exclude1),
        ConfidenceKind::Margin | ConfidenceKind::NegEntropy => (NONE, NONE),
    };
    let elems = rows
        .checked_mul(n)
        .ok_or_else(|| shape_error(OP, "rows * n below 2^32".into(), format!("{rows} x {n}")))?;
    check_tensor(OP, "logits", logits, DType::F32, elems)?;
    if let Some(u) = uncond {
        check_tensor(OP, "uncond logits", u, DType::F32, elems)?;
    }
    let row_base = full.map_or(0, |f| f.row_base);
    let state_rows = row_base.checked_add(rows).ok_or_else(|| {
        shape_error(
            OP,
            "row_base + rows below 2^32".into(),
            row_base.to_string(),
        )
    })?;
    check_tensor(OP, "positions", positions, DType::U32, state_rows)?;
    check_tensor(OP, "state", state, DType::U32, state_len(state_rows))?;
    if let Some(f) = full {
        check_tensor(OP, "cut", f.cut, DType::U32, state_rows)?;
        if uncond.is_some() {
            return Err(shape_error(
                OP,
                "no unconditional logits with a cut".into(),
                "unconditional logits".into(),
            ));
        }
    }
    let mut inputs = vec![("logits", logits), ("positions", positions)];
    inputs.extend(uncond.map(|u| ("uncond logits", u)));
    inputs.extend(full.map(|f| ("cut", f.cut)));
    if let Some((name, _)) = inputs
        .iter()
        .find(|(_, t)| Arc::ptr_eq(&t.buffer, &state.buffer))
    {
        return Err(shape_error(
            OP,
            "state in a buffer of its own".into(),
            format!("state shares its buffer with {name}"),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let rows32 = rows_u32(OP, rows)?;
    let noise = params.temperature > 0.0;
    // Rows of a multiple of 4 logits are read as vec4 (tensor buffers are 16-byte sized).
    let vec4 = n.is_multiple_of(4)
        && logits.buffer.size().is_multiple_of(16)
        && uncond.is_none_or(|u| u.buffer.size().is_multiple_of(16));
    let spec = accumulate_spec(
        uncond.is_some(),
        noise,
        vec4,
        full.is_some(),
        Stats::of(params),
    );
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&SELECT, "accumulate", &spec)?;
    let logit_scale = if params.tempered && noise {
        1.0 / params.temperature
    } else {
        1.0
    };
    let p = AccumulateParams {
        rows: rows32,
        n: n as u32,
        vocab_offset: vocab_offset as u32,
        step: params.step,
        seed_lo: params.seed as u32,
        seed_hi: (params.seed >> 32) as u32,
        suppress,
        exclude0,
        exclude1,
        noise_scale: params.temperature * logit_scale,
        cfg_scale: params.cfg_scale,
        logit_scale,
        row_base: row_base as u32,
        _pad: [0; 3],
    };
    let mut bindings: Vec<Binding> = vec![logits.into(), state.into()];
    if let Some(u) = uncond {
        bindings.push(u.into());
    }
    if let Some(f) = full {
        bindings.push(f.cut.into());
    }
    if noise {
        bindings.push(positions.into());
    }
    let groups = groups_2d(ctx, rows32);
    step.dispatch(&pipeline, &p, &bindings, groups);
    Ok(())
}

/// Writes `out` as u32 `[rows, OUT_WORDS]`: the chosen token id, the bits of its f32
/// confidence, and the bits of its f32 log-probability under the model's softmax (NaN
/// unless `params.logprob`). `params` must be the ones the chunks were accumulated with
/// (only their statistics are kept).
pub fn select_finalize(
    step: &mut StepEncoder,
    state: &Tensor,
    out: &Tensor,
    rows: usize,
    params: &SelectParams,
) -> Result<()> {
    const OP: &str = "select_finalize";
    check_tensor(OP, "state", state, DType::U32, state_len(rows))?;
    check_tensor(OP, "out", out, DType::U32, OUT_WORDS * rows)?;
    if Arc::ptr_eq(&state.buffer, &out.buffer) {
        return Err(shape_error(
            OP,
            "out in a buffer of its own".into(),
            "out shares its buffer with state".into(),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let n = rows_u32(OP, rows)?;
    let pipeline = step
        .ctx()
        .pipeline(&SELECT, "finalize", &finalize_spec(Stats::of(params)))?;
    let params = RowParams {
        rows: n,
        _pad: [0; 3],
    };
    let groups = row_groups(step, n);
    step.dispatch(&pipeline, &params, &[state.into(), out.into()], groups);
    Ok(())
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![
        host_params!("select", "reset", RowParams { rows }),
        host_params!("select", "finalize", RowParams { rows }),
        host_params!(
            "select",
            "threshold",
            ThresholdParams {
                rows,
                n,
                row_base,
                suppress,
                top_k,
                top_p,
                scale,
                min_gap,
            }
        ),
        host_params!(
            "select",
            "accumulate",
            AccumulateParams {
                rows,
                n,
                vocab_offset,
                step,
                seed_lo,
                seed_hi,
                suppress,
                exclude0,
                exclude1,
                noise_scale,
                cfg_scale,
                logit_scale,
                row_base,
            }
        ),
    ]
}
