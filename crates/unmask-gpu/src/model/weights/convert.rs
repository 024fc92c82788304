//! Conversion of checkpoint rows to a weight's storage format, block by block, with the
//! checks that refuse non-finite or out-of-range weights.

use std::path::Path;

use half::f16;
use unmask_core::quant::{self, QuantError};

use super::BLOCK_VALUES;
use crate::context::GpuContext;
use crate::model::ModelError;
use crate::model::checkpoint::{Checkpoint, CheckpointError, QuantTensor, TensorBytes};
use crate::tensor::{Weight, WeightFormat};

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

/// Converts `rows` rows of `src` to `dst`'s storage format, block by block, and writes them
/// from row `row_offset`.
pub(super) fn convert_rows(
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
pub(super) fn check_finite(
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
