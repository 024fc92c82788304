//! A tensor's bytes once located in a file: floats (BF16, F16, F32) converted on read, or a
//! quantized matrix's codes and scales as `unmask quantize` writes them.

use std::path::Path;

use half::{bf16, f16};

use crate::quant::{self, QuantFormat};

/// Element type of a tensor as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDType {
    BF16,
    F16,
    F32,
}

/// A tensor's bytes inside a file's bytes.
pub struct TensorBytes<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: StoredDType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorBytes<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Converts elements `[start, start + out.len())` to f32. Panics past `numel()`: the
    /// caller sizes its reads from the shape, which the header validated against the data.
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self.dtype {
            StoredDType::F32 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[start * 4..(start + n) * 4].chunks_exact(4))
                {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            StoredDType::BF16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[start * 2..(start + n) * 2].chunks_exact(2))
                {
                    *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            StoredDType::F16 => {
                for (o, b) in out
                    .iter_mut()
                    .zip(self.data[start * 2..(start + n) * 2].chunks_exact(2))
                {
                    *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
        }
    }
}

/// Names and `__metadata__` keys of quantized checkpoints (`unmask quantize`).
pub const QWEIGHT_SUFFIX: &str = ".qweight";
pub const SCALES_SUFFIX: &str = ".scales";
/// Weights per block; must be `crate::quant::BLOCK`.
pub const META_BLOCK: &str = "unmask.quant.block";
/// Row padding; must be `crate::quant::ROW_ALIGN`.
pub const META_ROW_ALIGN: &str = "unmask.quant.row_align";
/// Format of the transformer blocks' matrices (`q8`, `q4` or `none`), informative.
pub const META_LAYERS: &str = "unmask.quant.layers";
/// Format of the embedding table and LM head (`q8`, `q4` or `none`), informative.
pub const META_EMBED: &str = "unmask.quant.embed";

/// A quantized matrix inside a file's bytes, in the byte layout of `crate::quant`.
pub struct QuantTensor<'a> {
    pub path: &'a Path,
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u8],
    pub scales: &'a [u8],
}

impl QuantTensor<'_> {
    /// Bytes stored (codes and scales).
    pub fn stored_bytes(&self) -> usize {
        self.codes.len() + self.scales.len()
    }

    /// Dequantizes rows `[row, row + n)` into `out` (`n * cols` values). Panics past
    /// `rows`, like `TensorBytes::read_f32`.
    pub fn read_f32(&self, row: usize, out: &mut [f32]) {
        let n = out.len() / self.cols;
        let code_row = self.format.row_code_bytes(self.cols);
        let scale_row = quant::row_scale_bytes(self.cols);
        let values = self.format.dequantize_rows(
            &self.codes[row * code_row..(row + n) * code_row],
            &self.scales[row * scale_row..(row + n) * scale_row],
            n,
            self.cols,
        );
        out.copy_from_slice(&values);
    }

    /// The stored bytes of rows `[row, row + n)`: (codes, scales).
    pub fn rows(&self, row: usize, n: usize) -> (&[u8], &[u8]) {
        let code_row = self.format.row_code_bytes(self.cols);
        let scale_row = quant::row_scale_bytes(self.cols);
        (
            &self.codes[row * code_row..(row + n) * code_row],
            &self.scales[row * scale_row..(row + n) * scale_row],
        )
    }
}

/// How a model tensor is stored, for reports: float or quantized alike.
#[derive(Clone, Debug)]
pub struct StoredTensor<'a> {
    pub path: &'a Path,
    /// `BF16`, `F16`, `F32`, or `q8` / `q4` for a quantized matrix.
    pub dtype: String,
    /// Bytes in the file (codes and scales for a quantized matrix).
    pub bytes: u64,
    /// Tensors of the file it takes: 1, or 2 for a quantized matrix (codes, scales).
    pub file_tensors: usize,
}
