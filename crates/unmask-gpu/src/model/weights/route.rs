//! Planning an upload: allocating the model's buffers and recording where each
//! checkpoint tensor goes (`Planner`), incl. the fused QKV and paired gate|up matrices.

use std::collections::HashMap;
use std::path::PathBuf;

use unmask_core::quant::QuantFormat;

use crate::context::GpuContext;
use crate::model::ModelError;
use crate::model::checkpoint::{CheckpointError, CheckpointLayout, Span, StoredDType};
use crate::tensor::{DType, Tensor, Weight, WeightFormat};

/// Where one checkpoint tensor goes.
pub(super) enum Part {
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
    /// A norm weight or a bias, kept in f32 (tiny, and read by every row): one row of
    /// `cols` values, written from element `offset` of `dst`.
    Vector {
        dst: Tensor,
        offset: usize,
        dtype: StoredDType,
    },
}

pub(super) struct Target {
    pub(super) part: Part,
    pub(super) path: PathBuf,
    pub(super) span: Span,
    /// Rows and values per row of the matrix (1 row for a vector).
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Stored bytes per row.
    pub(super) row_bytes: usize,
    /// Rows uploaded so far (rows arrive in order).
    pub(super) received: usize,
}

/// Allocates the model's buffers and records where each checkpoint tensor goes.
pub(super) struct Planner<'a> {
    pub(super) ctx: &'a GpuContext,
    pub(super) layout: &'a CheckpointLayout,
    pub(super) targets: HashMap<String, Target>,
    pub(super) order: Vec<String>,
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

    pub(super) fn matrix(
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
    pub(super) fn stacked(
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
    pub(super) fn paired(
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

    pub(super) fn vector(&mut self, name: &str, len: usize) -> Result<Tensor, ModelError> {
        self.stacked_vector(name, &[(name.to_string(), len)])
    }

    /// Concatenates several 1-D tensors into one f32 vector, in order (the q, k and v
    /// biases of the fused projection).
    pub(super) fn stacked_vector(
        &mut self,
        label: &str,
        parts: &[(String, usize)],
    ) -> Result<Tensor, ModelError> {
        let total = parts.iter().map(|(_, len)| len).sum::<usize>();
        let dst = Tensor::zeros(self.ctx, DType::F32, &[total], label)?;
        let mut offset = 0;
        for (name, len) in parts {
            self.route_vector(&dst, name, *len, offset)?;
            offset += len;
        }
        Ok(dst)
    }

    fn route_vector(
        &mut self,
        dst: &Tensor,
        name: &str,
        len: usize,
        offset: usize,
    ) -> Result<(), ModelError> {
        let t = self.layout.tensor_entry(name, &[len])?;
        let target = Target {
            part: Part::Vector {
                dst: dst.clone(),
                offset,
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
        Ok(())
    }
}
