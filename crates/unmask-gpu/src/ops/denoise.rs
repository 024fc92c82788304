//! The per-row statistics of DiffusionGemma's sampler on the GPU (`shaders/denoise_rows.wgsl`):
//! argmax, entropy and a drawn token of `softmax(logits / T)` per canvas row, the argmax's
//! log-probability under `softmax(logits)`, and that softmax for the next step's
//! self-conditioning, so a denoising step reads back 5 words per row instead of the row's
//! logits. Hand-written: the sampler is this runtime's own.

use bytemuck::{Pod, Zeroable};

use super::ShaderVariant;
use super::elementwise::{check, check_f32, check_u32, u32_of};
use crate::error::Result;
use crate::kernel_source;
use crate::pipeline::{KernelSource, Spec};
use crate::step::{StepEncoder, groups_2d};
use crate::tensor::Tensor;

const DENOISE_ROWS: KernelSource = kernel_source!("denoise_rows", "rng");
/// u32 words per row in `stats`: argmax, drawn token, entropy (f32 bits), max of z (f32 bits),
/// the argmax's log-probability under the untempered softmax (f32 bits).
pub const STATS_WORDS: usize = 5;

pub fn variants() -> Vec<ShaderVariant> {
    vec![ShaderVariant {
        kernel: DENOISE_ROWS,
        entry: "main",
        spec: Spec::new(),
    }]
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct DenoiseParams {
    rows: u32,
    vocab: u32,
    temperature: f32,
    seed_lo: u32,
    seed_hi: u32,
    step: u32,
    write_probs: u32,
    first_row: u32,
}

#[cfg(test)]
pub(crate) fn host_params() -> Vec<super::HostParams> {
    use super::host_params;
    vec![host_params!(
        "denoise_rows",
        "main",
        DenoiseParams {
            rows,
            vocab,
            temperature,
            seed_lo,
            seed_hi,
            step,
            write_probs,
            first_row
        }
    )]
}

/// The draws' stream: token v of row r at step `step` gets Gumbel noise from
/// `hash4(seed, step, r, v)` (`unmask_core::rng`).
#[derive(Clone, Copy, Debug)]
pub struct DrawStream {
    pub seed: u64,
    pub step: u32,
}

/// One row's statistics as read back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowStats {
    pub argmax: u32,
    pub sampled: u32,
    pub entropy: f32,
    /// `log softmax(logits)[argmax]`: the model's own log-probability of the argmax, at
    /// temperature 1 whatever the step's.
    pub logprob: f32,
}

/// Decodes `STATS_WORDS` words per row.
pub fn parse_stats(words: &[u32]) -> Vec<RowStats> {
    words
        .chunks_exact(STATS_WORDS)
        .map(|w| RowStats {
            argmax: w[0],
            sampled: w[1],
            entropy: f32::from_bits(w[2]),
            logprob: f32::from_bits(w[4]),
        })
        .collect()
}

/// Per row of `logits` (f32 `[rows, vocab]`) at `temperature`: the statistics into `stats`
/// (u32 `[rows, STATS_WORDS]`) and, with `write_probs`, `softmax(logits / temperature)` into
/// `probs` (f32 `[rows, vocab]`, bound either way).
#[allow(clippy::too_many_arguments)] // the buffers of one dispatch and its settings
pub fn denoise_rows(
    step: &mut StepEncoder,
    logits: &Tensor,
    probs: &Tensor,
    write_probs: bool,
    stats: &Tensor,
    (rows, vocab): (usize, usize),
    temperature: f32,
    draws: DrawStream,
) -> Result<()> {
    let shape = (0, rows, vocab);
    denoise_rows_at(
        step,
        logits,
        probs,
        write_probs,
        stats,
        shape,
        temperature,
        draws,
    )
}

/// `denoise_rows` of rows `first .. first + rows` of `logits` and `stats` (a batched step's
/// canvases share them), `probs` holding this canvas's `rows` alone; the draws take the
/// rows' numbers within the canvas, as the canvas alone would.
#[allow(clippy::too_many_arguments)] // the buffers of one dispatch and its settings
pub fn denoise_rows_at(
    step: &mut StepEncoder,
    logits: &Tensor,
    probs: &Tensor,
    write_probs: bool,
    stats: &Tensor,
    (first, rows, vocab): (usize, usize, usize),
    temperature: f32,
    draws: DrawStream,
) -> Result<()> {
    check(
        "denoise_rows",
        vocab > 0 && temperature.is_finite() && temperature > 0.0,
        || "a vocabulary and a finite temperature above 0".into(),
        || format!("vocab {vocab}, temperature {temperature}"),
    )?;
    check_f32("denoise_rows logits", logits, (first + rows) * vocab)?;
    check_u32("denoise_rows stats", stats, (first + rows) * STATS_WORDS)?;
    check_f32(
        "denoise_rows probs",
        probs,
        if write_probs { rows * vocab } else { 0 },
    )?;
    if rows == 0 {
        return Ok(());
    }
    let params = DenoiseParams {
        rows: u32_of(rows),
        vocab: u32_of(vocab),
        temperature,
        seed_lo: draws.seed as u32,
        seed_hi: (draws.seed >> 32) as u32,
        step: draws.step,
        write_probs: u32::from(write_probs),
        first_row: u32_of(first),
    };
    let ctx = step.ctx();
    let pipeline = ctx.pipeline(&DENOISE_ROWS, "main", &Spec::new())?;
    step.dispatch(
        &pipeline,
        &params,
        &[logits.into(), probs.into(), stats.into()],
        groups_2d(ctx, u32_of(rows)),
    );
    Ok(())
}
