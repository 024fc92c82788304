//! DiffusionGemma on the GPU (`docs/models/diffusion-gemma.md`): one stack run three ways
//! over a KV cache — the encoder over the prompt (causal, writes K/V), the decoder over a
//! canvas (bidirectional over the canvas, reads the cached K/V, writes nothing) and the commit
//! pass (the encoder again over an accepted canvas, appending its K/V). Every op is a kernel
//! of `ops`; logits come back to the host per pass.

mod generate;
mod pass;
mod prefix;
mod steps;
mod weights;

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use unmask_core::checkpoint::Checkpoint;
use unmask_core::config::DiffusionGemmaConfig;

pub use generate::{GeneratedCanvas, Generation, SharedPrefix, StepReport};
pub use pass::{Pass, SelfConditioning};
pub use prefix::{DgemmaPrefixStore, PrefixUse};
pub use weights::{
    DgemmaLayer, DgemmaWeights, SelfConditioningMlp, kv_bytes_per_position, weight_bytes,
};

use crate::context::GpuContext;
use crate::model::ModelError;
use crate::ops::heads::rope_table_partial;
use crate::tensor::{DType, Tensor, WeightFormat};

/// RoPE of the sliding layers (`default`, full rotation).
pub const SLIDING_THETA: f32 = 10_000.0;
/// RoPE of the full layers (`proportional`): θ and the share of the pairs that turn.
pub const FULL_THETA: f32 = 1_000_000.0;
pub const FULL_ROTARY_FACTOR: f64 = 0.25;

pub struct DgemmaModel {
    pub cfg: DiffusionGemmaConfig,
    pub weights: DgemmaWeights,
    /// Positions the RoPE tables cover: the cache's capacity cannot exceed it.
    pub max_positions: usize,
    /// `(cos, sin)` tables of the sliding and the full layers.
    rope_sliding: Tensor,
    rope_full: Tensor,
    /// Ones, as the weight of the norms that have none (v, the decoder input).
    ones: Tensor,
}

/// The K/V of every position encoded so far, per layer: f32 rows `[capacity, K·d]`.
pub struct DgemmaCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Positions written (the prompt and every committed canvas).
    pub len: usize,
    pub capacity: usize,
}

impl DgemmaModel {
    /// Loads `dir` (config.json and the safetensors by their index) with matrices in
    /// `format`, RoPE tables for `max_positions` positions.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load(
        ctx: &GpuContext,
        dir: &Path,
        format: WeightFormat,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        Self::load_rounded(ctx, dir, format, None, max_positions)
    }

    /// `load` in f32 with every matrix but the router rounded through `quant` on the host:
    /// the model a `quant`-quantized one must match up to summation order.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn load_dequantized(
        ctx: &GpuContext,
        dir: &Path,
        quant: unmask_core::quant::QuantFormat,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        Self::load_rounded(ctx, dir, WeightFormat::F32, Some(quant), max_positions)
    }

    #[cfg(not(target_arch = "wasm32"))]
    fn load_rounded(
        ctx: &GpuContext,
        dir: &Path,
        format: WeightFormat,
        round: Option<unmask_core::quant::QuantFormat>,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .map_err(|e| ModelError::Input(format!("reading {}: {e}", config_path.display())))?;
        let cfg = DiffusionGemmaConfig::from_json_str(&text, &config_path.display().to_string())?;
        let ck = Checkpoint::open(dir)?;
        let weights = DgemmaWeights::load_rounded(ctx, &ck, &cfg, format, round)?;
        Self::new(ctx, cfg, weights, max_positions)
    }

    /// A model from a parsed config and a checkpoint held anywhere (files on disk, or bytes
    /// a page downloaded: `Checkpoint::from_bytes`).
    pub fn from_checkpoint(
        ctx: &GpuContext,
        cfg: DiffusionGemmaConfig,
        ck: &Checkpoint,
        format: WeightFormat,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        let weights = DgemmaWeights::load_rounded(ctx, ck, &cfg, format, None)?;
        Self::new(ctx, cfg, weights, max_positions)
    }

    pub fn new(
        ctx: &GpuContext,
        cfg: DiffusionGemmaConfig,
        weights: DgemmaWeights,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        if max_positions == 0 {
            return Err(ModelError::Input(
                "max_positions: expected at least 1 position, found 0".into(),
            ));
        }
        let dim = |sliding: bool| {
            cfg.layers
                .iter()
                .find(|l| l.sliding == sliding)
                .map_or(2, |l| l.head_dim)
        };
        let (ds, df) = (dim(true), dim(false));
        let rotated_full = (FULL_ROTARY_FACTOR * df as f64 / 2.0) as usize;
        let table = |theta, d, rotated, label| {
            let t = rope_table_partial(theta, d, rotated, max_positions);
            Tensor::from_f32(ctx, &[max_positions, d], &t, label)
        };
        let rope_sliding = table(SLIDING_THETA, ds, ds / 2, "rope sliding")?;
        let rope_full = table(FULL_THETA, df, rotated_full, "rope full")?;
        let widest = cfg.layers.iter().map(|l| l.head_dim).max().unwrap_or(1);
        let ones = Tensor::from_f32(
            ctx,
            &[widest.max(cfg.hidden_size)],
            &vec![1.0; widest.max(cfg.hidden_size)],
            "ones",
        )?;
        Ok(Self {
            cfg,
            weights,
            max_positions,
            rope_sliding,
            rope_full,
            ones,
        })
    }

    /// An empty cache for `capacity` positions (the prompt and every canvas committed after it).
    pub fn new_cache(&self, ctx: &GpuContext, capacity: usize) -> Result<DgemmaCache, ModelError> {
        if capacity > self.max_positions {
            return Err(ModelError::Input(format!(
                "cache capacity: expected at most {} positions (the RoPE tables), found {capacity}",
                self.max_positions
            )));
        }
        let mut k = Vec::with_capacity(self.cfg.layers.len());
        let mut v = Vec::with_capacity(self.cfg.layers.len());
        for (l, a) in self.cfg.layers.iter().enumerate() {
            let shape = [capacity.max(1), a.kv_heads * a.head_dim];
            k.push(Tensor::zeros(
                ctx,
                DType::F32,
                &shape,
                &format!("k cache {l}"),
            )?);
            v.push(Tensor::zeros(
                ctx,
                DType::F32,
                &shape,
                &format!("v cache {l}"),
            )?);
        }
        Ok(DgemmaCache {
            k,
            v,
            len: 0,
            capacity,
        })
    }

    /// The embedding scale `sqrt(D)` in f32 (the reference casts it to the model dtype: 53.0
    /// for bf16 at D = 2816; f32 computation keeps it exact, like the float32 goldens).
    pub fn embed_scale(&self) -> f32 {
        (self.cfg.hidden_size as f32).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use unmask_core::config::DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON as PUBLISHED;

    /// The GPU memory of the published model's weights per format: q4 fits a 24 GB GPU with
    /// room for the K/V of a long prompt, q8 does not.
    #[test]
    fn the_published_weights_per_format() {
        let cfg = DiffusionGemmaConfig::from_json_str(PUBLISHED, "config.json").unwrap();
        let gib = |f| weight_bytes(&cfg, f) as f64 / (1u64 << 30) as f64;
        let (f16, q8, q4) = (
            gib(WeightFormat::F16Packed),
            gib(WeightFormat::Q8),
            gib(WeightFormat::Q4),
        );
        let kv = kv_bytes_per_position(&cfg);
        eprintln!(
            "[memory] DiffusionGemma 26B-A4B weights: f16 {f16:.1} GiB, q8 {q8:.1} GiB, \
             q4 {q4:.1} GiB; K/V {} KiB per position",
            kv / 1024
        );
        assert!((46.0..50.0).contains(&f16), "{f16}");
        assert!(q8 > 22.4 && q4 < 16.0, "{q8} {q4}");
        // 24 GB = 22.35 GiB: q4 plus 8192 positions of K/V still fit.
        assert!(q4 + (8192 * kv) as f64 / (1u64 << 30) as f64 <= 22.35);
    }
}
