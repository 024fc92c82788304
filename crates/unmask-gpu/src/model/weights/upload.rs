//! An upload of a checkpoint's weights in progress (`WeightUpload`): planned from the
//! headers, then fed each tensor's rows.

use std::collections::HashMap;
use std::path::Path;

use unmask_core::config::{LayerTensor, ModelConfig};
use unmask_core::quant::{self, QuantFormat};

use super::convert::{Source, check_finite, convert_rows};
use super::route::{Part, Planner, Target};
use super::{LayerWeights, LoadProgress, ModelWeights, WeightFormats};
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::model::checkpoint::{CheckpointError, CheckpointLayout, QuantTensor, Span, TensorBytes};
use crate::tensor::Weight;

/// `queue.write_buffer` stages its bytes until the next submit; flushing this often keeps
/// the staging memory of a 16 GB checkpoint to a few hundred MiB instead of a second copy.
const FLUSH_BYTES: u64 = 256 << 20;

/// An upload of a checkpoint's weights in progress: buffers allocated, tensors arriving.
pub struct WeightUpload<'a> {
    ctx: &'a GpuContext,
    weights: ModelWeights,
    targets: HashMap<String, Target>,
    /// Tensor names in model order.
    order: Vec<String>,
    /// Codes or scales of a quantized matrix that must be converted, kept until the other
    /// half arrives (only a stacked matrix mixing formats needs this).
    pending: HashMap<String, Vec<u8>>,
    done: u64,
    total: u64,
    /// Bytes read since the last flush of the upload queue.
    unflushed: u64,
    progress: &'a mut dyn FnMut(LoadProgress<'_>),
}

impl<'a> WeightUpload<'a> {
    /// Checks every tensor `cfg` names against the checkpoint's headers (names, shapes,
    /// dtypes; before any buffer exists, so a bad checkpoint fails fast), then allocates
    /// every weight. Matrices stored quantized (a checkpoint written by `unmask quantize`)
    /// keep their format; the others are converted to `formats`.
    pub fn plan(
        ctx: &'a GpuContext,
        cfg: &ModelConfig,
        layout: &CheckpointLayout,
        formats: impl Into<WeightFormats>,
        progress: &'a mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        let formats = formats.into();
        let mut total = 0u64;
        for (name, shape) in cfg.tensor_specs() {
            total += match shape[..] {
                [rows, cols] => match layout.quantized_entry(&name, rows, cols)? {
                    Some(q) => q.stored_bytes(),
                    None => layout.tensor_entry(&name, &shape)?.span.bytes.len(),
                },
                _ => layout.tensor_entry(&name, &shape)?.span.bytes.len(),
            } as u64;
        }
        let mut p = Planner {
            ctx,
            layout,
            targets: HashMap::new(),
            order: Vec::new(),
        };
        let (layers_format, embed_format) =
            (formats.layers.resolve(ctx), formats.embed.resolve(ctx));
        let d = cfg.d_model;
        let hd = cfg.head_dim();
        let q_rows = cfg.n_heads * hd;
        let kv_rows = cfg.n_kv_heads * hd;
        let hidden = cfg.mlp_hidden_size;
        let family = cfg.family;
        let embedding = p.matrix(family.embedding_name(), cfg.embedding_size, d, embed_format)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let name = |part: LayerTensor| family.layer_name(i, part);
            let attn_norm = p.vector(&name(LayerTensor::AttnNorm), d)?;
            let qkv = p.stacked(
                &format!("blocks.{i}.qkv"),
                &[
                    (name(LayerTensor::Q), q_rows),
                    (name(LayerTensor::K), kv_rows),
                    (name(LayerTensor::V), kv_rows),
                ],
                d,
                layers_format,
            )?;
            let qkv_bias = if cfg.qkv_bias {
                Some(p.stacked_vector(
                    &format!("blocks.{i}.qkv_bias"),
                    &[
                        (name(LayerTensor::QBias), q_rows),
                        (name(LayerTensor::KBias), kv_rows),
                        (name(LayerTensor::VBias), kv_rows),
                    ],
                )?)
            } else {
                None
            };
            let attn_out = p.matrix(&name(LayerTensor::O), d, q_rows, layers_format)?;
            let ff_norm = p.vector(&name(LayerTensor::FfnNorm), d)?;
            let gate_up = p.paired(
                &format!("blocks.{i}.gate_up"),
                [name(LayerTensor::Gate), name(LayerTensor::Up)],
                hidden,
                d,
                layers_format,
            )?;
            let down = p.matrix(&name(LayerTensor::Down), d, hidden, layers_format)?;
            layers.push(LayerWeights {
                attn_norm,
                qkv,
                qkv_bias,
                attn_out,
                ff_norm,
                gate_up,
                down,
            });
        }
        let ln_f = p.vector(family.final_norm_name(), d)?;
        let lm_head = if cfg.weight_tying {
            embedding.clone()
        } else {
            p.matrix(family.lm_head_name(), cfg.embedding_size, d, embed_format)?
        };
        Ok(Self {
            ctx,
            weights: ModelWeights {
                embedding,
                layers,
                ln_f,
                lm_head,
            },
            targets: p.targets,
            order: p.order,
            pending: HashMap::new(),
            done: 0,
            total,
            unflushed: 0,
            progress,
        })
    }

    /// Bytes per stored row of checkpoint tensor `name` (a vector is one row); `None` for
    /// a tensor the model does not use, whose bytes may be skipped.
    pub fn row_bytes(&self, name: &str) -> Option<usize> {
        self.targets.get(name).map(|t| t.row_bytes)
    }

    /// Every tensor the model uses and where its bytes lie, in model order.
    pub fn spans(&self) -> Vec<(String, Span)> {
        self.order
            .iter()
            .map(|n| (n.clone(), self.targets[n].span.clone()))
            .collect()
    }

    /// Bytes of tensor data the model uses.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Uploads whole rows `first_row..` of checkpoint tensor `name` from its stored bytes.
    /// Rows of a tensor must arrive in order; a tensor the model does not use is ignored.
    pub fn rows(&mut self, name: &str, first_row: usize, data: &[u8]) -> Result<(), ModelError> {
        let Some(t) = self.targets.get(name) else {
            return Ok(());
        };
        let n = data.len() / t.row_bytes.max(1);
        if n * t.row_bytes != data.len() || first_row != t.received || first_row + n > t.rows {
            return Err(CheckpointError::Corrupt {
                path: t.path.clone(),
                message: format!(
                    "tensor {name}: {} bytes at row {first_row} are not whole rows of {} bytes \
                     following row {} of {}",
                    data.len(),
                    t.row_bytes,
                    t.received,
                    t.rows
                ),
            }
            .into());
        }
        let (path, cols) = (t.path.clone(), t.cols);
        match &t.part {
            Part::Float {
                dst,
                row_offset,
                dtype,
            } => {
                let shape = [n, cols];
                let src = Source::Float(TensorBytes {
                    name,
                    path: &path,
                    dtype: *dtype,
                    shape: &shape,
                    data,
                });
                convert_rows(self.ctx, dst, name, &src, n, cols, row_offset + first_row)?;
            }
            Part::Vector { dst, offset, dtype } => {
                let shape = [cols];
                let src = TensorBytes {
                    name,
                    path: &path,
                    dtype: *dtype,
                    shape: &shape,
                    data,
                };
                let mut v = vec![0f32; cols];
                src.read_f32(0, &mut v);
                check_finite(name, &path, &v, cols, 0)?;
                dst.write_at(self.ctx, (*offset * 4) as u64, bytemuck::cast_slice(&v))?;
            }
            Part::Quant {
                dst,
                row_offset,
                format,
                scales,
                partner,
            } => {
                let row = row_offset + first_row;
                if dst.format.quant() == Some(*format) {
                    // Already in the GPU's layout: upload the stored bytes as they are.
                    if *scales {
                        dst.write_rows_scales(self.ctx, row, data)?;
                    } else {
                        dst.write_rows_codes(self.ctx, row, data)?;
                    }
                } else {
                    let (dst, format, scales, partner) =
                        (dst.clone(), *format, *scales, partner.clone());
                    let rows = t.rows;
                    let row_offset = *row_offset;
                    self.pending
                        .entry(name.to_string())
                        .or_default()
                        .extend_from_slice(data);
                    self.convert_pair(
                        &dst, name, &partner, scales, format, rows, cols, row_offset, &path,
                    )?;
                }
            }
        }
        if let Some(t) = self.targets.get_mut(name) {
            t.received += n;
        }
        self.report(name, data.len());
        Ok(())
    }

    /// Converts a quantized matrix of another format than its destination once both its
    /// codes and its scales have arrived whole.
    #[allow(clippy::too_many_arguments)] // internal; the fields of one routing entry
    fn convert_pair(
        &mut self,
        dst: &Weight,
        name: &str,
        partner: &str,
        scales: bool,
        format: QuantFormat,
        rows: usize,
        cols: usize,
        row_offset: usize,
        path: &Path,
    ) -> Result<(), ModelError> {
        let whole = |n: &str, per_row: usize| {
            self.pending
                .get(n)
                .is_some_and(|b| b.len() == rows * per_row)
        };
        let (code_name, scale_name) = if scales {
            (partner, name)
        } else {
            (name, partner)
        };
        if !(whole(code_name, format.row_code_bytes(cols))
            && whole(scale_name, quant::row_scale_bytes(cols)))
        {
            return Ok(());
        }
        let codes = self.pending.remove(code_name).unwrap_or_default();
        let scale_bytes = self.pending.remove(scale_name).unwrap_or_default();
        let src = Source::Quant(QuantTensor {
            path,
            format,
            rows,
            cols,
            codes: &codes,
            scales: &scale_bytes,
        });
        convert_rows(self.ctx, dst, code_name, &src, rows, cols, row_offset)
    }

    fn report(&mut self, name: &str, bytes: usize) {
        self.done += bytes as u64;
        self.unflushed += bytes as u64;
        if self.unflushed >= FLUSH_BYTES {
            self.unflushed = 0;
            self.ctx.queue.submit([]);
            // A failed wait only delays freeing the staging buffers; loading goes on.
            let _ = self.ctx.wait_idle();
        }
        (self.progress)(LoadProgress {
            tensor: name,
            done_bytes: self.done,
            total_bytes: self.total,
        });
    }

    /// The weights, once every row of every tensor has arrived.
    pub fn finish(self) -> Result<ModelWeights, ModelError> {
        for name in &self.order {
            let t = &self.targets[name];
            if t.received < t.rows {
                return Err(CheckpointError::Corrupt {
                    path: t.path.clone(),
                    message: format!(
                        "tensor {name}: {} of its {} rows arrived (truncated?)",
                        t.received, t.rows
                    ),
                }
                .into());
            }
        }
        Ok(self.weights)
    }
}
