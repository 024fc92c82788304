//! The cross-entropy of given target tokens from LM-head logits (`shaders/cross_entropy.wgsl`),
//! for likelihood scoring: a streaming log-softmax per row over the LM head's vocabulary
//! chunks, so the logits stay on the GPU and a row reads back three floats. Hand-written:
//! it is the sampler's streaming reduction with a given target in place of the argmax.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, check_u32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::Tensor;

const CROSS_ENTROPY: KernelSource = kernel_source!("cross_entropy");

/// f32 words of state per row: the running max, the sum of exponentials below it, the
/// target's logit.
pub const STATE_WORDS: usize = 3;

/// The kernel's finite minus infinity (`NEG` in the shader).
const NEG: f32 = -3.0e38;

fn spec(guided: bool, first: bool) -> Spec {
    Spec::new().flag_if(guided, "CFG").flag_if(first, "FIRST")
}

pub fn variants() -> Vec<ShaderVariant> {
    let mut v = Vec::new();
    for guided in [false, true] {
        for first in [false, true] {
            v.push(ShaderVariant {
                kernel: CROSS_ENTROPY,
                entry: "accumulate",
                spec: spec(guided, first),
            });
        }
    }
    v
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CrossEntropyParams {
    rows: u32,
    n: u32,
    vocab_offset: u32,
    row_base: u32,
    cfg_scale: f32,
    _pad: [u32; 3],
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "cross_entropy",
        "accumulate",
        CrossEntropyParams {
            rows,
            n,
            vocab_offset,
            row_base,
            cfg_scale
        }
    )]
}

/// One vocabulary chunk of one group of scored rows.
#[derive(Clone, Copy, Debug)]
pub struct ChunkRows {
    /// Rows of `logits` (f32 `[rows, n]`), for vocabulary ids `[vocab_offset, vocab_offset + n)`.
    pub rows: usize,
    pub n: usize,
    pub vocab_offset: usize,
    /// Row of `targets` and the state for row 0 of `logits`.
    pub row_base: usize,
    /// Whether this is the row's first chunk: its statistics replace the state's.
    pub first: bool,
}

/// Folds one chunk of logits into the state of its rows: `targets` (u32) holds each row's
/// target id, `state` (f32, `STATE_WORDS` a row) what `cross_entropy_of` finishes.
/// `uncond` (the unconditioned logits, same layout) and `cfg_scale` guide the logits as
/// generation does: u + (cfg_scale + 1)(c - u).
pub fn cross_entropy_accumulate(
    step: &mut StepEncoder,
    logits: &Tensor,
    uncond: Option<(&Tensor, f32)>,
    targets: &Tensor,
    state: &Tensor,
    at: ChunkRows,
) -> Result<()> {
    const OP: &str = "cross_entropy_accumulate";
    let elems = at
        .rows
        .checked_mul(at.n)
        .filter(|&e| e <= u32::MAX as usize);
    check(
        OP,
        elems.is_some() && at.vocab_offset + at.n <= u32::MAX as usize,
        || "rows * n and vocabulary ids below 2^32".into(),
        || format!("{} x {} from id {}", at.rows, at.n, at.vocab_offset),
    )?;
    let elems = elems.unwrap_or(0);
    check_f32("cross_entropy_accumulate logits", logits, elems)?;
    if let Some((u, _)) = uncond {
        check_f32("cross_entropy_accumulate uncond", u, elems)?;
    }
    let end = at.row_base + at.rows;
    check_u32("cross_entropy_accumulate targets", targets, end)?;
    check_f32("cross_entropy_accumulate state", state, end * STATE_WORDS)?;
    if at.rows == 0 || at.n == 0 {
        return Ok(());
    }
    let guided = uncond.is_some();
    let params = CrossEntropyParams {
        rows: u32_of(at.rows),
        n: u32_of(at.n),
        vocab_offset: u32_of(at.vocab_offset),
        row_base: u32_of(at.row_base),
        cfg_scale: uncond.map_or(0.0, |(_, s)| s),
        _pad: [0; 3],
    };
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&CROSS_ENTROPY, "accumulate", &spec(guided, at.first))?;
    let groups = groups_2d(ctx, params.rows);
    match uncond {
        Some((u, _)) => step.dispatch(
            &pipeline,
            &params,
            &[logits.into(), targets.into(), state.into(), u.into()],
            groups,
        ),
        None => step.dispatch(
            &pipeline,
            &params,
            &[logits.into(), targets.into(), state.into()],
            groups,
        ),
    }
    Ok(())
}

/// Each row's -log p(target) in nats from the state read back (`STATE_WORDS` a row),
/// finished in f64: max + ln(sum) - target logit. A row whose target was in no chunk
/// (its logit still the kernel's finite minus infinity) gives +inf.
pub fn cross_entropy_of(state: &[f32]) -> Vec<f64> {
    state
        .chunks_exact(STATE_WORDS)
        .map(|s| {
            if s[2] <= NEG {
                f64::INFINITY
            } else {
                s[0] as f64 + (s[1] as f64).ln() - s[2] as f64
            }
        })
        .collect()
}
