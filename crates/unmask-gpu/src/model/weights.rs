//! LLaDA weights on the GPU. A `WeightUpload` is planned from the checkpoint's headers
//! alone (every name, shape and dtype checked, every buffer allocated), then fed each
//! tensor's bytes in whole rows, in any order and in pieces of any size: all of a mapped
//! file at once natively, or a browser download as it arrives. Rows are converted to the
//! storage format in blocks (a few MiB of host memory at a time; quantized on the CPU for
//! q8 / q4; a quantized checkpoint's codes are uploaded as stored). Q/K/V are fused into one
//! `[q; k; v]` matrix and gate/up into one `[gate; up]` matrix so each projection is a
//! single matmul.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::f16;
use unmask_core::config::LladaConfig;
use unmask_core::quant::{self, QuantError, QuantFormat};

use super::ModelError;
use super::checkpoint::{
    Checkpoint, CheckpointError, CheckpointLayout, QuantTensor, Span, StoredDType, TensorBytes,
};
use crate::context::GpuContext;
use crate::error::GpuError;
use crate::tensor::{DType, Tensor, Weight, WeightFormat, WeightPlan, buffer_size};

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

/// Where one checkpoint tensor goes.
enum Part {
    /// Float rows of a matrix, written from row `row_offset` of `dst`.
    Float {
        dst: Weight,
        row_offset: usize,
        dtype: StoredDType,
    },
    /// The codes (or, when `scales`, the scales) of a quantized matrix; `partner` names
    /// the other tensor of the pair.
    Quant {
        dst: Weight,
        row_offset: usize,
        format: QuantFormat,
        scales: bool,
        partner: String,
    },
    /// A norm weight, kept in f32 (tiny, and read by every row): one row of `cols` values.
    Vector { dst: Tensor, dtype: StoredDType },
}

struct Target {
    part: Part,
    path: PathBuf,
    span: Span,
    /// Rows and values per row of the matrix (1 row for a vector).
    rows: usize,
    cols: usize,
    /// Stored bytes per row.
    row_bytes: usize,
    /// Rows uploaded so far (rows arrive in order).
    received: usize,
}

/// `queue.write_buffer` stages its bytes until the next submit; flushing this often keeps
/// the staging memory of a 16 GB checkpoint to a few hundred MiB instead of a second copy.
const FLUSH_BYTES: u64 = 256 << 20;

/// An upload of a checkpoint's weights in progress: buffers allocated, tensors arriving.
pub struct WeightUpload<'a> {
    ctx: &'a GpuContext,
    weights: LladaWeights,
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

/// Allocates the model's buffers and records where each checkpoint tensor goes.
struct Planner<'a> {
    ctx: &'a GpuContext,
    layout: &'a CheckpointLayout,
    targets: HashMap<String, Target>,
    order: Vec<String>,
}

impl Planner<'_> {
    /// The format to allocate a matrix in: a quantized checkpoint's own format (it is not
    /// converted), else the one asked for.
    fn format_of(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        wanted: WeightFormat,
    ) -> Result<WeightFormat, CheckpointError> {
        Ok(match self.layout.quantized_entry(name, rows, cols)? {
            Some(q) => q.format.into(),
            None => wanted,
        })
    }

    fn add(&mut self, name: String, target: Target) {
        self.order.push(name.clone());
        self.targets.insert(name, target);
    }

    /// Routes the `[rows, cols]` matrix `name` into `dst` from row `row_offset`.
    fn route(
        &mut self,
        dst: &Weight,
        name: &str,
        rows: usize,
        cols: usize,
        row_offset: usize,
    ) -> Result<(), CheckpointError> {
        if let Some(q) = self.layout.quantized_entry(name, rows, cols)? {
            let path = q.path.to_path_buf();
            let halves = [
                (&q.code_name, &q.scale_name, q.codes.clone(), false),
                (&q.scale_name, &q.code_name, q.scales.clone(), true),
            ];
            for (own, partner, span, scales) in halves {
                let row_bytes = span.bytes.len() / rows.max(1);
                let target = Target {
                    part: Part::Quant {
                        dst: dst.clone(),
                        row_offset,
                        format: q.format,
                        scales,
                        partner: partner.clone(),
                    },
                    path: path.clone(),
                    span,
                    rows,
                    cols,
                    row_bytes,
                    received: 0,
                };
                self.add(own.clone(), target);
            }
            return Ok(());
        }
        let t = self.layout.tensor_entry(name, &[rows, cols])?;
        let target = Target {
            part: Part::Float {
                dst: dst.clone(),
                row_offset,
                dtype: t.dtype,
            },
            path: t.path.to_path_buf(),
            row_bytes: t.span.bytes.len() / rows.max(1),
            span: t.span,
            rows,
            cols,
            received: 0,
        };
        self.add(name.to_string(), target);
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
        self.route(&w, name, rows, cols, 0)?;
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
            self.route(&w, name, *r, cols, offset)?;
            offset += r;
        }
        Ok(w)
    }

    /// A gate|up pair of `[half, cols]` matrices in one weight laid out for the fused
    /// SwiGLU matmul (`Weight::zeros_paired`).
    fn paired(
        &mut self,
        label: &str,
        [gate, up]: [String; 2],
        half: usize,
        cols: usize,
        wanted: WeightFormat,
    ) -> Result<Weight, ModelError> {
        let format = self.format_of(&gate, half, cols, wanted)?;
        let w = Weight::zeros_paired(self.ctx, half, cols, format, label)?;
        self.route(&w, &gate, half, cols, 0)?;
        self.route(&w, &up, half, cols, half)?;
        Ok(w)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor, ModelError> {
        let t = self.layout.tensor_entry(name, &[len])?;
        let dst = Tensor::zeros(self.ctx, DType::F32, &[len], name)?;
        let target = Target {
            part: Part::Vector {
                dst: dst.clone(),
                dtype: t.dtype,
            },
            path: t.path.to_path_buf(),
            row_bytes: t.span.bytes.len(),
            span: t.span,
            rows: 1,
            cols: len,
            received: 0,
        };
        self.add(name.to_string(), target);
        Ok(dst)
    }
}

impl<'a> WeightUpload<'a> {
    /// Checks every tensor `cfg` names against the checkpoint's headers (names, shapes,
    /// dtypes; before any buffer exists, so a bad checkpoint fails fast), then allocates
    /// every weight. Matrices stored quantized (a checkpoint written by `unmask quantize`)
    /// keep their format; the others are converted to `formats`.
    pub fn plan(
        ctx: &'a GpuContext,
        cfg: &LladaConfig,
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
        let embedding = p.matrix(
            "model.transformer.wte.weight",
            cfg.embedding_size,
            d,
            embed_format,
        )?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let name = |n: &str| format!("model.transformer.blocks.{i}.{n}.weight");
            let attn_norm = p.vector(&name("attn_norm"), d)?;
            let qkv = p.stacked(
                &format!("blocks.{i}.qkv"),
                &[
                    (name("q_proj"), q_rows),
                    (name("k_proj"), kv_rows),
                    (name("v_proj"), kv_rows),
                ],
                d,
                layers_format,
            )?;
            let attn_out = p.matrix(&name("attn_out"), d, q_rows, layers_format)?;
            let ff_norm = p.vector(&name("ff_norm"), d)?;
            let gate_up = p.paired(
                &format!("blocks.{i}.gate_up"),
                [name("ff_proj"), name("up_proj")],
                hidden,
                d,
                layers_format,
            )?;
            let down = p.matrix(&name("ff_out"), d, hidden, layers_format)?;
            layers.push(LayerWeights {
                attn_norm,
                qkv,
                attn_out,
                ff_norm,
                gate_up,
                down,
            });
        }
        let ln_f = p.vector("model.transformer.ln_f.weight", d)?;
        let lm_head = if cfg.weight_tying {
            embedding.clone()
        } else {
            p.matrix(
                "model.transformer.ff_out.weight",
                cfg.embedding_size,
                d,
                embed_format,
            )?
        };
        Ok(Self {
            ctx,
            weights: LladaWeights {
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
            Part::Vector { dst, dtype } => {
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
                dst.write_f32(self.ctx, &v)?;
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
    pub fn finish(self) -> Result<LladaWeights, ModelError> {
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

/// Converts `rows` rows of `src` to `dst`'s storage format, block by block, and writes them
/// from row `row_offset`.
fn convert_rows(
    ctx: &GpuContext,
    dst: &Weight,
    name: &str,
    src: &Source<'_>,
    rows: usize,
    cols: usize,
    row_offset: usize,
) -> Result<(), ModelError> {
    let rows_per_block = (BLOCK_VALUES / cols.max(1)).max(1);
    let mut buf = vec![0f32; rows_per_block.min(rows) * cols];
    let mut half_buf: Vec<f16> = Vec::new();
    let mut codes: Vec<u8> = Vec::new();
    let mut scales: Vec<u8> = Vec::new();
    let mut row = 0;
    while row < rows {
        let n = rows_per_block.min(rows - row);
        let block = &mut buf[..n * cols];
        src.read_f32(row, cols, block);
        check_finite(name, src.path(), block, cols, row_offset + row)?;
        match dst.format {
            WeightFormat::F32 => dst.write_rows_f32(ctx, row_offset + row, block)?,
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
                dst.write_rows_f16(ctx, row_offset + row, &half_buf)?
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
                dst.write_rows_quant(ctx, row_offset + row, &codes, &scales)?;
            }
        }
        row += n;
    }
    Ok(())
}

/// A NaN or infinite weight makes every logit NaN and the model predict token 0 forever;
/// it is refused while loading, naming the tensor and the place.
fn check_finite(
    name: &str,
    path: &Path,
    values: &[f32],
    cols: usize,
    first_row: usize,
) -> Result<(), ModelError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(ModelError::NonFinite {
            name: name.to_string(),
            path: path.to_path_buf(),
            row: first_row + i / cols.max(1),
            col: i % cols.max(1),
            value: values[i],
            count: values.iter().filter(|v| !v.is_finite()).count(),
        }),
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
    layer += WeightPlan::paired(hidden, d, formats.layers, max_binding_bytes, "gate_up")?.bytes();
    layer += matrix(d, hidden, formats.layers, "down")?;
    let table = matrix(cfg.embedding_size, d, formats.embed, "embedding")?;
    let tables = if cfg.weight_tying { table } else { 2 * table };
    Ok(tables + norm + cfg.n_layers as u64 * layer)
}

impl LladaWeights {
    /// Loads every tensor the config names from a checkpoint in memory (mapped natively),
    /// checking names, shapes and dtypes first (see `WeightUpload::plan`).
    pub fn load(
        ctx: &GpuContext,
        cfg: &LladaConfig,
        ckpt: &Checkpoint,
        formats: impl Into<WeightFormats>,
        progress: &mut dyn FnMut(LoadProgress<'_>),
    ) -> Result<Self, ModelError> {
        let mut upload = WeightUpload::plan(ctx, cfg, ckpt.layout(), formats, progress)?;
        for (name, span) in upload.spans() {
            upload.rows(&name, 0, ckpt.span_bytes(&span))?;
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
