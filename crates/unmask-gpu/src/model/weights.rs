//! LLaDA weights on the GPU. Tensors are streamed from the mapped checkpoint in row blocks
//! (a few MiB of host memory at a time) and converted to the storage format (quantized on
//! the CPU for q8 / q4; a quantized checkpoint's codes are uploaded as stored). Q/K/V are
//! fused into one `[q; k; v]` matrix and gate/up into one `[gate; up]` matrix so each
//! projection is a single matmul.

use std::path::Path;
use std::sync::Arc;

use half::f16;
use unmask_core::config::LladaConfig;
use unmask_core::quant::{self, QuantError};

use super::ModelError;
use super::checkpoint::{Checkpoint, CheckpointError, QuantTensor, TensorBytes};
use crate::context::GpuContext;
use crate::error::GpuError;
use crate::tensor::{Tensor, Weight, WeightFormat, WeightPlan, buffer_size};

/// One transformer block.
pub struct LayerWeights {
    pub attn_norm: Tensor,
    /// `[(n_heads + 2 n_kv_heads) head_dim, d_model]`: q rows, then k, then v.
    pub qkv: Weight,
    pub attn_out: Weight,
    pub ff_norm: Tensor,
    /// `[2 mlp_hidden, d_model]`: gate (ff_proj) rows, then up rows.
    pub gate_up: Weight,
    /// `[d_model, mlp_hidden]` (the block's ff_out).
    pub down: Weight,
}

pub struct LladaWeights {
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

/// Where a matrix's values come from: floats, or codes and scales of a quantized
/// checkpoint.
pub(crate) enum Source<'a> {
    Float(TensorBytes<'a>),
    Quant(QuantTensor<'a>),
}

impl Source<'_> {
    pub(crate) fn path(&self) -> &Path {
        match self {
            Source::Float(t) => t.path,
            Source::Quant(q) => q.path,
        }
    }

    pub(crate) fn stored_bytes(&self) -> usize {
        match self {
            Source::Float(t) => t.data.len(),
            Source::Quant(q) => q.stored_bytes(),
        }
    }

    /// Values of rows `[row, row + n)`, `n = out.len() / cols`.
    pub(crate) fn read_f32(&self, row: usize, cols: usize, out: &mut [f32]) {
        match self {
            Source::Float(t) => t.read_f32(row * cols, out),
            Source::Quant(q) => q.read_f32(row, out),
        }
    }
}

/// The `[rows, cols]` matrix `name` of a checkpoint, quantized or not.
pub(crate) fn matrix_source<'a>(
    ckpt: &'a Checkpoint,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Source<'a>, CheckpointError> {
    match ckpt.quantized(name, rows, cols)? {
        Some(q) => Ok(Source::Quant(q)),
        None => Ok(Source::Float(ckpt.tensor(name, &[rows, cols])?)),
    }
}

struct Loader<'a> {
    ctx: &'a GpuContext,
    ckpt: &'a Checkpoint,
    formats: WeightFormats,
    done: u64,
    total: u64,
    progress: &'a mut dyn FnMut(LoadProgress<'_>),
}

impl Loader<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<TensorBytes<'_>, CheckpointError> {
        self.ckpt.tensor(name, shape)
    }

    fn report(&mut self, name: &str, bytes: usize) {
        self.done += bytes as u64;
        (self.progress)(LoadProgress {
            tensor: name,
            done_bytes: self.done,
            total_bytes: self.total,
        });
    }

    /// The format to allocate a matrix in: a quantized checkpoint's own format (it is not
    /// converted), else the one asked for.
    fn format_of(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        wanted: WeightFormat,
    ) -> Result<WeightFormat, CheckpointError> {
        Ok(match self.ckpt.quantized(name, rows, cols)? {
            Some(q) => q.format.into(),
            None => wanted,
        })
    }

    /// Streams `name` ([rows, cols]) into `dst` starting at row `row_offset`.
    fn stream_into(
        &mut self,
        dst: &Weight,
        name: &str,
        rows: usize,
        cols: usize,
        row_offset: usize,
    ) -> Result<(), ModelError> {
        let src = matrix_source(self.ckpt, name, rows, cols)?;
        let rows_per_block = (BLOCK_VALUES / cols.max(1)).max(1);
        if let (Source::Quant(q), Some(wanted)) = (&src, dst.format.quant())
            && q.format == wanted
        {
            // Already in the GPU's layout: upload the stored bytes as they are.
            let mut row = 0;
            while row < rows {
                let n = rows_per_block.min(rows - row);
                let (codes, scales) = q.rows(row, n);
                dst.write_rows_quant(self.ctx, row_offset + row, codes, scales)?;
                row += n;
            }
            let bytes = src.stored_bytes();
            self.report(name, bytes);
            return Ok(());
        }
        let mut buf = vec![0f32; rows_per_block.min(rows) * cols];
        let mut half_buf: Vec<f16> = Vec::new();
        let mut codes: Vec<u8> = Vec::new();
        let mut scales: Vec<u8> = Vec::new();
        let mut row = 0;
        while row < rows {
            let n = rows_per_block.min(rows - row);
            let block = &mut buf[..n * cols];
            src.read_f32(row, cols, block);
            match dst.format {
                WeightFormat::F32 => dst.write_rows_f32(self.ctx, row_offset + row, block)?,
                WeightFormat::F16Packed | WeightFormat::F16Native => {
                    half_buf.clear();
                    half_buf.extend(block.iter().map(|&v| f16::from_f32(v)));
                    let bad: Vec<f32> = block
                        .iter()
                        .zip(&half_buf)
                        .filter(|(v, h)| v.is_finite() && !h.is_finite())
                        .map(|(v, _)| v.abs())
                        .collect();
                    if !bad.is_empty() {
                        return Err(CheckpointError::F16Range {
                            name: name.to_string(),
                            path: src.path().to_path_buf(),
                            count: bad.len(),
                            max: bad.iter().copied().fold(0.0, f32::max),
                        }
                        .into());
                    }
                    dst.write_rows_f16(self.ctx, row_offset + row, &half_buf)?
                }
                WeightFormat::Q8 | WeightFormat::Q4 => {
                    let q = dst.format.quant().expect("quantized format");
                    codes.resize(n * q.row_code_bytes(cols), 0);
                    scales.resize(n * quant::row_scale_bytes(cols), 0);
                    q.quantize_rows(block, cols, &mut codes, &mut scales)
                        .map_err(|e| CheckpointError::Quantized {
                            name: name.to_string(),
                            path: src.path().to_path_buf(),
                            message: format!(
                                "cannot quantize to {} (row {}): {e}",
                                q.name(),
                                row + index_row(&e, cols)
                            ),
                        })?;
                    dst.write_rows_quant(self.ctx, row_offset + row, &codes, &scales)?;
                }
            }
            row += n;
        }
        let bytes = src.stored_bytes();
        self.report(name, bytes);
        Ok(())
    }

    fn matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        wanted: WeightFormat,
    ) -> Result<Weight, ModelError> {
        let format = self.format_of(name, rows, cols, wanted)?;
        let w = Weight::zeros(self.ctx, rows, cols, format, name)?;
        self.stream_into(&w, name, rows, cols, 0)?;
        Ok(w)
    }

    /// Stacks several `[rows_i, cols]` tensors into one matrix, in order.
    fn stacked(
        &mut self,
        label: &str,
        parts: &[(String, usize)],
        cols: usize,
        wanted: WeightFormat,
    ) -> Result<Weight, ModelError> {
        let rows = parts.iter().map(|(_, r)| r).sum();
        // Parts stored in another format than the first are converted to it.
        let format = self.format_of(&parts[0].0, parts[0].1, cols, wanted)?;
        let w = Weight::zeros(self.ctx, rows, cols, format, label)?;
        let mut offset = 0;
        for (name, r) in parts {
            self.stream_into(&w, name, *r, cols, offset)?;
            offset += r;
        }
        Ok(w)
    }

    /// A norm weight, kept in f32 (tiny, and read by every row).
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor, ModelError> {
        let t = self.tensor(name, &[len])?;
        let mut v = vec![0f32; len];
        t.read_f32(0, &mut v);
        let bytes = t.data.len();
        let out = Tensor::from_f32(self.ctx, &[len], &v, name)?;
        self.report(name, bytes);
        Ok(out)
    }
}

/// The row (within a quantized block of rows) of the weight a quantization error names.
pub(crate) fn index_row(e: &QuantError, cols: usize) -> usize {
    match e {
        QuantError::NotFinite { index, .. } | QuantError::ScaleOverflow { index, .. } => {
            index / cols.max(1)
        }
    }
}

/// Bytes of GPU memory the weights of `cfg` take in `formats` when no binding may exceed
/// `max_binding_bytes`: exactly what `LladaWeights::load` allocates (chunk rounding
/// included), computed without a device or a checkpoint.
pub fn weight_bytes(
    cfg: &LladaConfig,
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
    layer += matrix(q_rows + 2 * kv_rows, d, formats.layers, "qkv")?;
    layer += matrix(d, q_rows, formats.layers, "attn_out")?;
    layer += matrix(2 * hidden, d, formats.layers, "gate_up")?;
    layer += matrix(d, hidden, formats.layers, "down")?;
    let table = matrix(cfg.embedding_size, d, formats.embed, "embedding")?;
    let tables = if cfg.weight_tying { table } else { 2 * table };
    Ok(tables + norm + cfg.n_layers as u64 * layer)
}

impl LladaWeights {
    /// Loads every tensor the config names, checking names, shapes and dtypes. Matrices
    /// stored quantized (a checkpoint written by `unmask quantize`) keep their format;
    /// the others are converted to `formats`.
    pub fn load(
        ctx: &GpuContext,
        cfg: &LladaConfig,
        ckpt: &Checkpoint,
        formats: impl Into<WeightFormats>,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        let formats = formats.into();
        // Check every name and shape before the first upload, so a bad checkpoint fails fast.
        let mut total = 0u64;
        for (name, shape) in cfg.tensor_specs() {
            total += match shape[..] {
                [rows, cols] => matrix_source(ckpt, &name, rows, cols)?.stored_bytes() as u64,
                _ => ckpt.tensor(&name, &shape)?.data.len() as u64,
            };
        }
        let mut l = Loader {
            ctx,
            ckpt,
            formats: WeightFormats {
                layers: formats.layers.resolve(ctx),
                embed: formats.embed.resolve(ctx),
            },
            done: 0,
            total,
            progress,
        };
        let d = cfg.d_model;
        let hd = cfg.head_dim();
        let q_rows = cfg.n_heads * hd;
        let kv_rows = cfg.n_kv_heads * hd;
        let hidden = cfg.mlp_hidden_size;
        let (layers_format, embed_format) = (l.formats.layers, l.formats.embed);
        let embedding = l.matrix(
            "model.transformer.wte.weight",
            cfg.embedding_size,
            d,
            embed_format,
        )?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let name = |n: &str| format!("model.transformer.blocks.{i}.{n}.weight");
            let attn_norm = l.vector(&name("attn_norm"), d)?;
            let qkv = l.stacked(
                &format!("blocks.{i}.qkv"),
                &[
                    (name("q_proj"), q_rows),
                    (name("k_proj"), kv_rows),
                    (name("v_proj"), kv_rows),
                ],
                d,
                layers_format,
            )?;
            let attn_out = l.matrix(&name("attn_out"), d, q_rows, layers_format)?;
            let ff_norm = l.vector(&name("ff_norm"), d)?;
            let gate_up = l.stacked(
                &format!("blocks.{i}.gate_up"),
                &[(name("ff_proj"), hidden), (name("up_proj"), hidden)],
                d,
                layers_format,
            )?;
            let down = l.matrix(&name("ff_out"), d, hidden, layers_format)?;
            layers.push(LayerWeights {
                attn_norm,
                qkv,
                attn_out,
                ff_norm,
                gate_up,
                down,
            });
        }
        let ln_f = l.vector("model.transformer.ln_f.weight", d)?;
        let lm_head = if cfg.weight_tying {
            embedding.clone()
        } else {
            l.matrix(
                "model.transformer.ff_out.weight",
                cfg.embedding_size,
                d,
                embed_format,
            )?
        };
        Ok(Self {
            embedding,
            layers,
            ln_f,
            lm_head,
        })
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
    use unmask_core::config::LLADA_8B_CONFIG_JSON;

    #[test]
    fn llada_8b_fits_the_4_bit_budget() {
        let cfg = LladaConfig::from_json_str(LLADA_8B_CONFIG_JSON).unwrap();
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
