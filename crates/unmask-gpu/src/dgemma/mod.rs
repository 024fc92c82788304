//! DiffusionGemma on the GPU (`docs/models/diffusion-gemma.md`): one stack run three ways
//! over a KV cache — the encoder over the prompt (causal, writes K/V), the decoder over a
//! canvas (bidirectional over the canvas, reads the cached K/V, writes nothing) and the commit
//! pass (the encoder again over an accepted canvas, appending its K/V). Every op is a kernel
//! of `ops`; logits come back to the host per pass.

mod attend;
mod generate;
mod pass;
mod pass_limit;
mod prefix;
mod steps;
mod weights;

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use unmask_core::checkpoint::Checkpoint;
use unmask_core::config::{DiffusionGemmaConfig, LayerAttention};

pub use generate::{DgemmaRun, GeneratedCanvas, Generation, RoundStore, SharedPrefix, StepReport};
pub use pass::{Pass, SelfConditioning};
pub use pass_limit::PROBE_AFTER;
pub use prefix::{DgemmaPrefixStore, PrefixUse};
pub use steps::DecodeCanvas;
pub use weights::{DgemmaLayer, DgemmaWeights, SelfConditioningMlp, weight_bytes};

use crate::context::GpuContext;
use crate::model::{ModelError, WeightFormats};
use crate::ops::heads::rope_table_partial;
use crate::ops::{KernelOptions, Kernels};
#[cfg(not(target_arch = "wasm32"))]
use crate::tensor::WeightFormat;
use crate::tensor::{DType, Tensor};

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
    /// Most positions one encoder pass appends in the caches `new_cache` makes (`PASS_ROWS`).
    pub pass_rows: usize,
    /// Storage of the caches `new_cache` makes and of stored prefixes: `F32`, or `F16`
    /// (half the memory and the attention's reads; K and V rounded once, as written).
    pub kv_dtype: DType,
    /// The matmul and attention kernels its passes ask for and the tuner that measures
    /// `Auto`'s candidates on a GPU (a pinned kernel runs where it can, else its fallback),
    /// with the split-K and fused-norm scratch its matmuls share.
    pub kernels: Kernels,
    /// `(cos, sin)` tables of the sliding and the full layers.
    rope_sliding: Tensor,
    rope_full: Tensor,
    /// Ones, as the weight of the norms that have none (v, the decoder input).
    ones: Tensor,
    /// The last decoder step's buffers, kept for the next step of as many rows: a steady
    /// request (or batch) allocates nothing per step, and its bind groups are found again.
    step_buffers: std::sync::Mutex<Option<steps::StepBuffers>>,
    /// Most canvases one decoder pass takes, lowered when a batch did not fit in memory.
    pass_limit: std::sync::Mutex<pass_limit::PassLimit>,
}

/// The K/V of the positions encoded so far, per layer, f32 rows of `K·d`. A full-attention
/// layer keeps every position (row p is position p); a sliding layer keeps only what a
/// window can still see: its buffer holds `sliding_rows` rows, row 0 being position
/// `sliding_base`, and before a pass would write past its end the last W − 1 positions move
/// to its front. The encoder appends at most `pass_rows` positions per pass (longer inputs go
/// in pieces; the encoder is causal, so the pieces give the same K/V as one pass).
pub struct DgemmaCache {
    pub k: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Positions written (the prompt and every committed canvas).
    pub len: usize,
    pub capacity: usize,
    /// Most positions one encoder pass appends.
    pub pass_rows: usize,
    /// Rows of a sliding layer's buffer: W − 1 + `pass_rows`, or `capacity` when smaller.
    pub sliding_rows: usize,
    /// Position of row 0 of every sliding layer's buffer.
    pub sliding_base: usize,
    /// `F32` or `F16` rows.
    pub dtype: DType,
}

/// Positions one encoder pass appends unless a cache is made with another figure: a long
/// prompt is encoded in pieces this long (at least a canvas).
pub const PASS_ROWS: usize = 512;

impl DgemmaCache {
    /// The buffer row of position `p` in layer `a`'s K/V.
    pub fn row(&self, a: &LayerAttention, p: usize) -> usize {
        if a.sliding { p - self.sliding_base } else { p }
    }

    /// Bytes of one position's K (or V) in layer `a`.
    pub fn row_bytes(&self, a: &LayerAttention) -> u64 {
        (a.kv_heads * a.head_dim * self.dtype.size_bytes()) as u64
    }
}

/// GPU bytes of a cache for `positions` positions with passes of `pass_rows` (`PASS_ROWS`
/// for the runtime's caches): every position of the full layers, W − 1 + `pass_rows` rows of
/// the sliding ones.
pub fn kv_cache_bytes(
    cfg: &DiffusionGemmaConfig,
    positions: usize,
    pass_rows: usize,
    dtype: DType,
) -> u64 {
    let sliding = sliding_rows(cfg, positions, pass_rows.max(cfg.canvas_length));
    cfg.layers
        .iter()
        .map(|a| {
            let rows = if a.sliding { sliding } else { positions };
            (2 * dtype.size_bytes() * a.kv_heads * a.head_dim * rows) as u64
        })
        .sum()
}

fn sliding_rows(cfg: &DiffusionGemmaConfig, capacity: usize, pass_rows: usize) -> usize {
    (cfg.sliding_window.saturating_sub(1) + pass_rows).min(capacity)
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
        let weights = DgemmaWeights::load_rounded(ctx, &ck, &cfg, format.into(), round)?;
        Self::new(ctx, cfg, weights, max_positions)
    }

    /// A model from a parsed config and a checkpoint held anywhere (files on disk, or bytes
    /// a page downloaded: `Checkpoint::from_bytes`), the token table in `formats.embed`.
    pub fn from_checkpoint(
        ctx: &GpuContext,
        cfg: DiffusionGemmaConfig,
        ck: &Checkpoint,
        formats: impl Into<WeightFormats>,
        max_positions: usize,
    ) -> Result<Self, ModelError> {
        let weights = DgemmaWeights::load_rounded(ctx, ck, &cfg, formats.into(), None)?;
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
            pass_rows: PASS_ROWS,
            kv_dtype: DType::F32,
            kernels: Kernels::new(ctx, &KernelOptions::default()),
            rope_sliding,
            rope_full,
            ones,
            step_buffers: std::sync::Mutex::new(None),
            pass_limit: std::sync::Mutex::default(),
        })
    }

    /// An empty cache for `capacity` positions (the prompt and every canvas committed after
    /// it), encoder passes of at most `self.pass_rows` positions (at least a canvas): the
    /// sliding layers hold W − 1 + that many rows.
    pub fn new_cache(&self, ctx: &GpuContext, capacity: usize) -> Result<DgemmaCache, ModelError> {
        if capacity > self.max_positions {
            return Err(ModelError::Input(format!(
                "cache capacity: expected at most {} positions (the RoPE tables), found {capacity}",
                self.max_positions
            )));
        }
        let pass_rows = self.pass_rows.max(self.cfg.canvas_length).max(1);
        let sliding_rows = sliding_rows(&self.cfg, capacity, pass_rows);
        let mut k = Vec::with_capacity(self.cfg.layers.len());
        let mut v = Vec::with_capacity(self.cfg.layers.len());
        for (l, a) in self.cfg.layers.iter().enumerate() {
            let rows = if a.sliding { sliding_rows } else { capacity };
            let shape = [rows.max(1), a.kv_heads * a.head_dim];
            for (list, name) in [(&mut k, "k"), (&mut v, "v")] {
                let label = format!("{name} cache {l}");
                list.push(Tensor::zeros(ctx, self.kv_dtype, &shape, &label)?);
            }
        }
        Ok(DgemmaCache {
            k,
            v,
            len: 0,
            capacity,
            pass_rows,
            sliding_rows,
            sliding_base: 0,
            dtype: self.kv_dtype,
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
        let kv = |positions| {
            kv_cache_bytes(&cfg, positions, PASS_ROWS, DType::F32) as f64 / (1u64 << 30) as f64
        };
        // Every layer keeping every position, as a cache without the sliding window would.
        let every: u64 = cfg
            .layers
            .iter()
            .map(|a| 2 * 4 * (a.kv_heads * a.head_dim) as u64)
            .sum();
        let every = |positions: usize| (positions as u64 * every) as f64 / (1u64 << 30) as f64;
        eprintln!(
            "[memory] DiffusionGemma 26B-A4B weights: f16 {f16:.1} GiB, q8 {q8:.1} GiB, \
             q4 {q4:.1} GiB; K/V (f32) at 8192 positions {:.2} GiB (every position in every \
             layer: {:.2} GiB), at 32768 {:.2} GiB ({:.2} GiB)",
            kv(8192),
            every(8192),
            kv(32768),
            every(32768)
        );
        assert!((46.0..50.0).contains(&f16), "{f16}");
        assert!(q8 > 22.4 && q4 < 16.0, "{q8} {q4}");
        // The sliding layers (25 of 30, 91 % of a position's K/V) keep W - 1 + PASS_ROWS rows.
        assert!(kv(32768) < every(32768) / 4.0);
        // 24 GB = 22.35 GiB: q4 plus 32768 positions of K/V fit.
        assert!(q4 + kv(32768) <= 22.35, "{q4} + {}", kv(32768));
    }
}
