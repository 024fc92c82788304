//! LLaDA weights on the GPU. A `WeightUpload` is planned from the checkpoint's headers
//! alone (every name, shape and dtype checked, every buffer allocated), then fed each
//! tensor's bytes in whole rows, in any order and in pieces of any size: all of a file read
//! by `Checkpoint` at once natively, or a browser download as it arrives. Rows are converted to the
//! storage format in blocks (a few MiB of host memory at a time; quantized on the CPU for
//! q8 / q4; a quantized checkpoint's codes are uploaded as stored). Q/K/V are fused into one
//! `[q; k; v]` matrix and gate/up into one `[gate; up]` matrix so each projection is a
//! single matmul.
//!
//! `upload` holds the upload in progress (`WeightUpload`), `route` the planning that
//! allocates the buffers and records where each checkpoint tensor goes, and `convert` the
//! conversion of rows to the storage formats.

mod convert;
mod route;
mod upload;

use std::sync::Arc;

use unmask_core::config::ModelConfig;

use super::ModelError;
use super::checkpoint::Checkpoint;
use crate::context::GpuContext;
use crate::error::GpuError;
use crate::tensor::{Tensor, Weight, WeightFormat, WeightPlan, buffer_size};

pub(crate) use convert::{Source, index_row, matrix_source};
pub use upload::WeightUpload;

/// One transformer block.
pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// `[(n_heads + 2 n_kv_heads) head_dim, d_model]`: q rows, then k, then v.
    pub qkv: Weight,
    /// The q, k and v biases in the same order (Dream), added by the RoPE kernel.
    pub qkv_bias: Option<Tensor>,
    pub attn_out: Weight,
    pub ff_norm: Tensor,
    /// `[2 mlp_hidden, d_model]`: gate (ff_proj) rows, then up rows.
    pub gate_up: Weight,
    /// `[d_model, mlp_hidden]` (the block's ff_out).
    pub down: Weight,
}

pub struct ModelWeights {
    pub embedding: Weight,
    pub layers: Vec<LayerWeights>,
    pub ln_f: Tensor,
    /// The LM head; shares the embedding's buffers when the model ties them.
    pub lm_head: Weight,
}

/// Progress of a load, reported after each tensor.
#[derive(Clone, Debug)]
pub struct LoadProgress<'a> {
    pub tensor: &'a str,
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// Rows converted per upload, bounded so host memory stays small whatever the tensor size.
pub(crate) const BLOCK_VALUES: usize = 4 << 20;

/// Storage formats of a model's matrices: the transformer blocks', and the embedding
/// table's and LM head's, chosen separately because those two are the largest matrices and
/// the head decides the token choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WeightFormats {
    pub layers: WeightFormat,
    pub embed: WeightFormat,
}

impl WeightFormats {
    /// One format for every matrix.
    pub fn uniform(format: WeightFormat) -> Self {
        Self {
            layers: format,
            embed: format,
        }
    }
}

impl From<WeightFormat> for WeightFormats {
    fn from(format: WeightFormat) -> Self {
        Self::uniform(format)
    }
}

/// Bytes of GPU memory the weights of `cfg` take in `formats` when no binding may exceed
/// `max_binding_bytes`: exactly what `ModelWeights::load` allocates (chunk rounding
/// included), computed without a device or a checkpoint.
pub fn weight_bytes(
    cfg: &ModelConfig,
    formats: WeightFormats,
    max_binding_bytes: u64,
) -> Result<u64, GpuError> {
    let d = cfg.d_model;
    let hd = cfg.head_dim();
    let q_rows = cfg.n_heads * hd;
    let kv_rows = cfg.n_kv_heads * hd;
    let hidden = cfg.mlp_hidden_size;
    let matrix = |rows: usize, cols: usize, format: WeightFormat, label: &str| {
        WeightPlan::new(rows, cols, format, max_binding_bytes, label).map(|p| p.bytes())
    };
    let norm = buffer_size((d * 4) as u64);
    let mut layer = 2 * norm;
    if cfg.qkv_bias {
        layer += buffer_size(((q_rows + 2 * kv_rows) * 4) as u64);
    }
    layer += matrix(q_rows + 2 * kv_rows, d, formats.layers, "qkv")?;
    layer += matrix(d, q_rows, formats.layers, "attn_out")?;
    layer += WeightPlan::paired(hidden, d, formats.layers, max_binding_bytes, "gate_up")?.bytes();
    layer += matrix(d, hidden, formats.layers, "down")?;
    let table = matrix(cfg.embedding_size, d, formats.embed, "embedding")?;
    let tables = if cfg.weight_tying { table } else { 2 * table };
    Ok(tables + norm + cfg.n_layers as u64 * layer)
}

impl ModelWeights {
    /// Loads every tensor the config names from a checkpoint (its files read when first used),
    /// checking names, shapes and dtypes first (see `WeightUpload::plan`).
    pub fn load(
        ctx: &GpuContext,
        cfg: &ModelConfig,
        ckpt: &Checkpoint,
        formats: impl Into<WeightFormats>,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        let mut upload = WeightUpload::plan(ctx, cfg, ckpt.layout(), formats, progress)?;
        for (name, span) in upload.spans() {
            upload.rows(&name, 0, ckpt.span_bytes(&span)?)?;
        }
        upload.finish()
    }

    /// The formats the matrices were loaded in (a quantized checkpoint's own formats).
    pub fn formats(&self) -> WeightFormats {
        WeightFormats {
            layers: self
                .layers
                .first()
                .map_or(self.embedding.format, |l| l.qkv.format),
            embed: self.embedding.format,
        }
    }

    /// Bytes of GPU memory held by the weights (tied matrices counted once).
    pub fn size_bytes(&self) -> u64 {
        let mut total = self.embedding.size_bytes() + self.ln_f.size_bytes();
        if !Arc::ptr_eq(
            &self.embedding.chunks[0].buffer,
            &self.lm_head.chunks[0].buffer,
        ) {
            total += self.lm_head.size_bytes();
        }
        for l in &self.layers {
            total += l.attn_norm.size_bytes()
                + l.qkv.size_bytes()
                + l.attn_out.size_bytes()
                + l.ff_norm.size_bytes()
                + l.gate_up.size_bytes()
                + l.down.size_bytes();
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unmask_core::config::{DREAM_7B_CONFIG_JSON, LLADA_8B_CONFIG_JSON};

    /// Dream-7B's weights under a 128 MiB binding limit (the browser's and lavapipe's):
    /// every matrix is planned in chunks that fit, and f16 takes 2 bytes per parameter,
    /// biases included.
    #[test]
    fn dream_7b_plans_within_the_binding_limit() {
        let cfg = ModelConfig::from_json_str(DREAM_7B_CONFIG_JSON).unwrap();
        let limit = 128 << 20;
        let f16 = weight_bytes(&cfg, WeightFormat::F16Packed.into(), limit).unwrap();
        let q4 = weight_bytes(&cfg, WeightFormat::Q4.into(), limit).unwrap();
        let params = cfg.parameter_count() as f64;
        eprintln!("Dream-7B weights: f16 {f16}, q4 {q4} bytes");
        // Norms and biases are f32 (2 extra bytes each): under 1e-3 of the total.
        assert!((f16 as f64 / (params * 2.0) - 1.0).abs() < 1e-3, "{f16}");
        assert!(q4 < 4_600_000_000, "q4 Dream-7B takes {q4} bytes");
        // The vocabulary-wide tables are split; one row of each fits a binding.
        let table = WeightPlan::new(152_064, 3584, WeightFormat::F16Packed, limit, "t").unwrap();
        assert!(table.chunks.len() >= 9, "{} chunks", table.chunks.len());
    }

    #[test]
    fn llada_8b_fits_the_4_bit_budget() {
        let cfg = ModelConfig::from_json_str(LLADA_8B_CONFIG_JSON).unwrap();
        let limit = 128 << 20;
        let bytes =
            |layers, embed| weight_bytes(&cfg, WeightFormats { layers, embed }, limit).unwrap();
        let f16 = bytes(WeightFormat::F16Packed, WeightFormat::F16Packed);
        let q8 = bytes(WeightFormat::Q8, WeightFormat::Q8);
        let q4 = bytes(WeightFormat::Q4, WeightFormat::Q4);
        let q4_f16_tables = bytes(WeightFormat::Q4, WeightFormat::F16Packed);
        eprintln!(
            "LLaDA-8B weights: f16 {f16}, q8 {q8}, q4 {q4}, q4 with f16 tables {q4_f16_tables} bytes"
        );
        // 8.0e9 weights at 16, 8.5 and 4.5 bits (norms in f32, chunks rounded to 16 bytes).
        let params = cfg.parameter_count() as f64;
        assert!((f16 as f64 / (params * 2.0) - 1.0).abs() < 1e-3, "{f16}");
        assert!(
            (q8 as f64 / (params * 8.5 / 8.0) - 1.0).abs() < 1e-3,
            "{q8}"
        );
        assert!(
            (q4 as f64 / (params * 4.5 / 8.0) - 1.0).abs() < 1e-3,
            "{q4}"
        );
        assert!(q4 < 4_800_000_000, "q4 LLaDA-8B takes {q4} bytes");
        assert!(q4_f16_tables > 4_800_000_000, "f16 tables alone take 2 GB");
        assert_eq!(bytes(WeightFormat::F16Native, WeightFormat::F16Native), f16);
    }
}
