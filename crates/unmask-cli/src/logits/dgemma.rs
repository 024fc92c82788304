//! `unmask logits` on a DiffusionGemma folder: the encoder's logits over the prompt, or the
//! decoder's over each `--canvas-ids` canvas in turn, self-conditioned as the reference's
//! denoising loop does.

use std::path::Path;

use unmask::EngineOptions;
use unmask_gpu::GpuContext;
use unmask_gpu::dgemma::DgemmaModel;

use crate::dgemma::generation_params;
use crate::error::CliError;

/// (shape, logits): `[T, V]` of the encoder without canvases, else `[canvases, L, V]`.
pub fn logits(
    dir: &Path,
    options: &EngineOptions,
    prompt: &[u32],
    canvases: &[Vec<u32>],
) -> Result<(Vec<usize>, Vec<f32>), CliError> {
    if prompt.is_empty() {
        return Err(CliError::usage(
            "--prompt-ids: expected at least one token id",
        ));
    }
    let params = generation_params(dir)?;
    let ctx = GpuContext::new(&options.context_options()?)?;
    let positions = prompt.len() + canvases.iter().map(Vec::len).max().unwrap_or(0);
    let model = DgemmaModel::load(&ctx, dir, options.weight_format, positions)?;
    let v = model.cfg.vocab_size;
    let mut cache = model.new_cache(&ctx, positions)?;
    if canvases.is_empty() {
        let logits = model
            .encode(&ctx, &mut cache, prompt, true)?
            .unwrap_or_default();
        return Ok((vec![prompt.len(), v], logits));
    }
    let len = canvases[0].len();
    if let Some(c) = canvases.iter().find(|c| c.len() != len || c.is_empty()) {
        return Err(CliError::usage(format!(
            "--canvas-ids: expected every canvas of the first one's {len} tokens (at least one), found {}",
            c.len()
        )));
    }
    model.encode(&ctx, &mut cache, prompt, false)?;
    let mut out = Vec::with_capacity(canvases.len() * len * v);
    let mut self_conditioning: Option<Vec<f32>> = None;
    for (i, canvas) in canvases.iter().enumerate() {
        let raw = model.decode(&ctx, &cache, canvas, self_conditioning.as_deref())?;
        // Step i of the loop ran at the temperature of N - i steps left.
        let t = params.temperature(params.max_denoising_steps.saturating_sub(i).max(1));
        self_conditioning = Some(raw.iter().map(|x| x / t).collect());
        out.extend_from_slice(&raw);
    }
    Ok((vec![canvases.len(), len, v], out))
}
