//! LLaDA weights on the GPU. Tensors are streamed from the mapped checkpoint in row blocks
//! (a few MiB of host memory at a time) and converted to the storage format. Q/K/V are
//! fused into one `[q; k; v]` matrix and gate/up into one `[gate; up]` matrix so each
//! projection is a single matmul.

use std::sync::Arc;

use half::f16;
use unmask_core::config::LladaConfig;

use super::ModelError;
use super::checkpoint::{Checkpoint, CheckpointError, TensorBytes};
use crate::context::GpuContext;
use crate::tensor::{Tensor, Weight, WeightFormat};

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
const BLOCK_VALUES: usize = 4 << 20;

struct Loader<'a> {
    ctx: &'a GpuContext,
    ckpt: &'a Checkpoint,
    format: WeightFormat,
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

    /// Streams `name` ([rows, cols]) into `dst` starting at row `row_offset`.
    fn stream_into(
        &mut self,
        dst: &Weight,
        name: &str,
        rows: usize,
        cols: usize,
        row_offset: usize,
    ) -> Result<(), ModelError> {
        let t = self.tensor(name, &[rows, cols])?;
        let rows_per_block = (BLOCK_VALUES / cols.max(1)).max(1);
        let mut buf = vec![0f32; rows_per_block.min(rows) * cols];
        let mut half_buf: Vec<f16> = Vec::new();
        let mut row = 0;
        while row < rows {
            let n = rows_per_block.min(rows - row);
            let block = &mut buf[..n * cols];
            t.read_f32(row * cols, block);
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
                            path: t.path.to_path_buf(),
                            count: bad.len(),
                            max: bad.iter().copied().fold(0.0, f32::max),
                        }
                        .into());
                    }
                    dst.write_rows_f16(self.ctx, row_offset + row, &half_buf)?
                }
            }
            row += n;
        }
        let bytes = t.data.len();
        self.report(name, bytes);
        Ok(())
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight, ModelError> {
        let w = Weight::zeros(self.ctx, rows, cols, self.format, name)?;
        self.stream_into(&w, name, rows, cols, 0)?;
        Ok(w)
    }

    /// Stacks several `[rows_i, cols]` tensors into one matrix, in order.
    fn stacked(
        &mut self,
        label: &str,
        parts: &[(String, usize)],
        cols: usize,
    ) -> Result<Weight, ModelError> {
        let rows = parts.iter().map(|(_, r)| r).sum();
        let w = Weight::zeros(self.ctx, rows, cols, self.format, label)?;
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

impl LladaWeights {
    /// Loads every tensor the config names, checking names, shapes and dtypes.
    pub fn load(
        ctx: &GpuContext,
        cfg: &LladaConfig,
        ckpt: &Checkpoint,
        format: WeightFormat,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        // Check every name and shape before the first upload, so a bad checkpoint fails fast.
        let mut total = 0u64;
        for (name, shape) in cfg.tensor_specs() {
            total += ckpt.tensor(&name, &shape)?.data.len() as u64;
        }
        let mut l = Loader {
            ctx,
            ckpt,
            format: format.resolve(ctx),
            done: 0,
            total,
            progress,
        };
        let d = cfg.d_model;
        let hd = cfg.head_dim();
        let q_rows = cfg.n_heads * hd;
        let kv_rows = cfg.n_kv_heads * hd;
        let hidden = cfg.mlp_hidden_size;
        let embedding = l.matrix("model.transformer.wte.weight", cfg.embedding_size, d)?;
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
            )?;
            let attn_out = l.matrix(&name("attn_out"), d, q_rows)?;
            let ff_norm = l.vector(&name("ff_norm"), d)?;
            let gate_up = l.stacked(
                &format!("blocks.{i}.gate_up"),
                &[(name("ff_proj"), hidden), (name("up_proj"), hidden)],
                d,
            )?;
            let down = l.matrix(&name("ff_out"), d, hidden)?;
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
            l.matrix("model.transformer.ff_out.weight", cfg.embedding_size, d)?
        };
        Ok(Self {
            embedding,
            layers,
            ln_f,
            lm_head,
        })
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
