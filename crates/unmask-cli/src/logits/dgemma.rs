//! `unmask logits` on a DiffusionGemma folder: the encoder's logits over the prompt, or the
//! decoder's over each `--canvas-ids` canvas in turn, self-conditioned as the reference's
//! denoising loop does.

use std::path::Path;

use unmask::EngineOptions;
use unmask_core::config::{DiffusionGemmaConfig, entropy_bound_params};
use unmask_core::sampler::entropy_bound::EntropyBoundParams;
use unmask_gpu::GpuContext;
use unmask_gpu::dgemma::DgemmaModel;

use crate::error::CliError;

/// Whether `dir/config.json` says `model_type: "diffusion_gemma"` (a missing or unreadable
/// config is left to the usual loader's error).
pub fn is_diffusion_gemma(dir: &Path) -> Result<bool, CliError> {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return Ok(false);
    };
    Ok(serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.as_object().map(DiffusionGemmaConfig::is_diffusion_gemma))
        .unwrap_or(false))
}

/// The sampler settings of `dir/generation_config.json`, the published ones without it.
pub fn generation_params(dir: &Path) -> Result<EntropyBoundParams, CliError> {
    let path = dir.join("generation_config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => entropy_bound_params(&text, &path.display().to_string())
            .map_err(|e| CliError::runtime(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(EntropyBoundParams::default()),
        Err(e) => Err(CliError::context(
            format!("cannot read {}", path.display()),
            e,
        )),
    }
}

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
