//! Weight matrices split over chunks that each fit one storage binding: `Weight`, its
//! chunk plan (`WeightPlan`, incl. the paired gate|up layout) and the row writes.

use std::sync::Arc;

use half::f16;

use unmask_core::quant;

use super::{GpuBuffer, WeightFormat, buffer_size, storage_buffer};
use crate::context::GpuContext;
use crate::error::{GpuError, Result};

/// A contiguous range of rows of a `Weight`, in one buffer that fits one binding.
#[derive(Clone, Debug)]
pub struct WeightChunk {
    pub buffer: Arc<GpuBuffer>,
    pub row_start: usize,
    pub rows: usize,
}

/// A `[rows, cols]` matrix (an `nn.Linear` weight `[out, in]`, or an embedding table).
/// Rows are padded with zeros to `row_stride` elements so kernels can use vec4 loads; rows
/// are split over chunks so no binding exceeds the device limit.
///
/// Quantized formats (`Q8`, `Q4`) pad rows to `unmask_core::quant::ROW_ALIGN` elements and
/// lay out each chunk as one `array<u32>`: first the codes of all its rows (row-major, row
/// stride `row_stride` elements: 4 codes per word for q8, 8 for q4), then, starting at word
/// `Weight::scales_word_offset(chunk rows)`, the f16 scales of all its rows, two per word
/// (row-major, `row_stride / 32` per row). Element `i` of a chunk (`row * row_stride + col`)
/// therefore has its scale at index `i / 32` of the scales. The bytes of both parts are
/// those of `unmask_core::quant`, so a quantized checkpoint uploads without conversion.
#[derive(Clone, Debug)]
pub struct Weight {
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub format: WeightFormat,
    pub chunks: Vec<WeightChunk>,
    /// `Some(h)` for a gate|up pair (`Weight::zeros_paired`): logical rows `0..h` are the
    /// gate rows and `h..2h` the up rows, but each chunk holds the gate rows of its output
    /// columns `[row_start, row_start + rows / 2)` followed by the up rows of the same
    /// columns, so a fused SwiGLU matmul finds both halves of a column in one binding.
    pub paired: Option<usize>,
}

/// Rows per chunk are a multiple of this, so matmul tiles never straddle chunks.
pub const CHUNK_ROW_ALIGN: usize = 64;

/// How a weight is laid out over chunks, computed without a device: what `Weight::zeros`
/// allocates, so memory needs can be known before loading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightPlan {
    pub row_stride: usize,
    /// (first row, rows, bytes allocated) of each chunk.
    pub chunks: Vec<(usize, usize, u64)>,
}

impl WeightPlan {
    /// The chunks of a `[rows, cols]` weight in `format` (already resolved) when no binding
    /// may exceed `max_binding_bytes`.
    pub fn new(
        rows: usize,
        cols: usize,
        format: WeightFormat,
        max_binding_bytes: u64,
        label: &str,
    ) -> Result<Self> {
        let row_stride = format.row_stride(cols);
        let row_bytes = format.row_bytes(cols);
        // Buffers are rounded up to 16 bytes; keep the rounded size within the limit.
        let limit = max_binding_bytes - max_binding_bytes % 16;
        let mut rows_per_chunk = (limit / row_bytes) as usize;
        if rows_per_chunk == 0 {
            return Err(GpuError::TooLarge {
                what: format!("one row of weight {label} ({cols} columns)"),
                needed: row_bytes,
                limit: max_binding_bytes,
            });
        }
        if rows_per_chunk >= CHUNK_ROW_ALIGN {
            rows_per_chunk -= rows_per_chunk % CHUNK_ROW_ALIGN;
        }
        let mut chunks = Vec::new();
        let mut row_start = 0;
        while row_start < rows.max(1) {
            let n = rows_per_chunk.min(rows.max(1) - row_start);
            chunks.push((row_start, n, buffer_size(n as u64 * row_bytes)));
            row_start += n;
        }
        Ok(Self { row_stride, chunks })
    }

    /// The chunks of a stack of `count` matrices of `rows_each` rows (an expert tensor
    /// `[E, rows, cols]` seen as `[E · rows, cols]`): every chunk holds whole matrices, so a
    /// kernel finds each matrix in one binding.
    pub fn stacked(
        count: usize,
        rows_each: usize,
        cols: usize,
        format: WeightFormat,
        max_binding_bytes: u64,
        label: &str,
    ) -> Result<Self> {
        let row_stride = format.row_stride(cols);
        let matrix_bytes = rows_each.max(1) as u64 * format.row_bytes(cols);
        let limit = max_binding_bytes - max_binding_bytes % 16;
        let per_chunk = (limit / matrix_bytes) as usize;
        if per_chunk == 0 {
            return Err(GpuError::TooLarge {
                what: format!("one [{rows_each}, {cols}] matrix of weight {label}"),
                needed: matrix_bytes,
                limit: max_binding_bytes,
            });
        }
        let mut chunks = Vec::new();
        let mut first = 0;
        while first < count.max(1) {
            let n = per_chunk.min(count.max(1) - first);
            let rows = n * rows_each.max(1);
            chunks.push((
                first * rows_each.max(1),
                rows,
                buffer_size(rows as u64 * format.row_bytes(cols)),
            ));
            first += n;
        }
        Ok(Self { row_stride, chunks })
    }

    /// Bytes allocated over all chunks.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.2).sum()
    }

    /// The chunks of a gate|up pair of two `[half, cols]` weights (`Weight::paired`): chunk
    /// `(first output column, rows = 2 x its columns, bytes)`.
    pub fn paired(
        half: usize,
        cols: usize,
        format: WeightFormat,
        max_binding_bytes: u64,
        label: &str,
    ) -> Result<Self> {
        let single = Self::new(2 * half, cols, format, max_binding_bytes, label)?;
        let per_chunk = single.chunks.first().map_or(1, |c| c.1);
        if per_chunk < 2 {
            return Err(GpuError::TooLarge {
                what: format!("two rows of weight {label} ({cols} columns)"),
                needed: 2 * format.row_bytes(cols),
                limit: max_binding_bytes,
            });
        }
        let row_bytes = format.row_bytes(cols);
        // Output columns per chunk: half of its rows, kept a multiple of the matmul tile.
        let mut columns = (per_chunk / 2).min(half.max(1));
        if columns >= CHUNK_ROW_ALIGN && columns < half {
            columns -= columns % CHUNK_ROW_ALIGN;
        }
        let mut chunks = Vec::new();
        let mut start = 0;
        while start < half.max(1) {
            let n = columns.min(half.max(1) - start);
            chunks.push((start, 2 * n, buffer_size(2 * n as u64 * row_bytes)));
            start += n;
        }
        Ok(Self {
            row_stride: single.row_stride,
            chunks,
        })
    }
}

impl Weight {
    /// Allocates the chunks; contents are zero until written.
    pub fn zeros(
        ctx: &GpuContext,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        label: &str,
    ) -> Result<Self> {
        let format = format.resolve(ctx);
        let plan = WeightPlan::new(rows, cols, format, ctx.features.max_binding_bytes, label)?;
        Self::from_plan(ctx, rows, cols, format, label, plan, None)
    }

    /// A gate|up pair of two `[half, cols]` weights for the fused SwiGLU matmul: write the
    /// gate rows at logical rows `0..half` and the up rows at `half..2 half`.
    pub fn zeros_paired(
        ctx: &GpuContext,
        half: usize,
        cols: usize,
        format: WeightFormat,
        label: &str,
    ) -> Result<Self> {
        let format = format.resolve(ctx);
        let plan = WeightPlan::paired(half, cols, format, ctx.features.max_binding_bytes, label)?;
        Self::from_plan(ctx, 2 * half, cols, format, label, plan, Some(half))
    }

    /// A stack of `count` `[rows_each, cols]` matrices (an expert tensor `[E, rows, cols]`)
    /// as one `[count · rows_each, cols]` weight whose chunks hold whole matrices
    /// (`WeightPlan::stacked`): matrix `e` is rows `e · rows_each ..` and lies in one binding.
    pub fn zeros_stacked(
        ctx: &GpuContext,
        count: usize,
        rows_each: usize,
        cols: usize,
        format: WeightFormat,
        label: &str,
    ) -> Result<Self> {
        let format = format.resolve(ctx);
        let max = ctx.features.max_binding_bytes;
        let plan = WeightPlan::stacked(count, rows_each, cols, format, max, label)?;
        Self::from_plan(ctx, count * rows_each, cols, format, label, plan, None)
    }

    fn from_plan(
        ctx: &GpuContext,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        label: &str,
        plan: WeightPlan,
        paired: Option<usize>,
    ) -> Result<Self> {
        let mut chunks = Vec::with_capacity(plan.chunks.len());
        for &(row_start, n, _) in &plan.chunks {
            let buffer = storage_buffer(
                ctx,
                &format!("{label}[{row_start}..{}]", row_start + n),
                n as u64 * format.row_bytes(cols),
            )?;
            chunks.push(WeightChunk {
                buffer: Arc::new(buffer),
                row_start,
                rows: n,
            });
        }
        // Zero-filled scales make unwritten rows and padding decode to 0 whatever the codes.
        Ok(Self {
            rows,
            cols,
            row_stride: plan.row_stride,
            format,
            chunks,
            paired,
        })
    }

    pub fn from_f32(
        ctx: &GpuContext,
        rows: usize,
        cols: usize,
        data: &[f32],
        format: WeightFormat,
        label: &str,
    ) -> Result<Self> {
        let w = Self::zeros(ctx, rows, cols, format, label)?;
        w.write_rows_f32(ctx, 0, data)?;
        Ok(w)
    }

    /// Bytes of codes per row (quantized formats).
    fn row_code_bytes(&self) -> usize {
        self.format
            .quant()
            .map_or(0, |q| q.row_code_bytes(self.cols))
    }

    /// Word of a quantized chunk of `chunk_rows` rows where its scales start.
    pub fn scales_word_offset(&self, chunk_rows: usize) -> usize {
        chunk_rows * self.row_code_bytes() / 4
    }

    /// Writes whole rows starting at `row_start` from row-major `[n, cols]` data, converting
    /// (or quantizing) to the storage format. Callers stream big tensors through this in
    /// row blocks.
    pub fn write_rows_f32(&self, ctx: &GpuContext, row_start: usize, data: &[f32]) -> Result<()> {
        if let Some(q) = self.format.quant() {
            self.check_write(row_start, data.len())?;
            let rows = data.len() / self.cols;
            let mut codes = vec![0u8; rows * q.row_code_bytes(self.cols)];
            let mut scales = vec![0u8; rows * quant::row_scale_bytes(self.cols)];
            q.quantize_rows(data, self.cols, &mut codes, &mut scales)
                .map_err(|e| GpuError::Quantize {
                    what: format!(
                        "rows {row_start}.. of a [{}, {}] weight",
                        self.rows, self.cols
                    ),
                    message: e.to_string(),
                })?;
            return self.write_rows_quant(ctx, row_start, &codes, &scales);
        }
        self.write_rows_with(ctx, row_start, data.len(), |_, src_offset, out| {
            let src = &data[src_offset..src_offset + self.cols];
            match out {
                RowOut::F32(o) => o[..self.cols].copy_from_slice(src),
                RowOut::F16(o) => {
                    for (d, s) in o.iter_mut().zip(src) {
                        *d = f16::from_f32(*s);
                    }
                }
            }
        })
    }

    /// Like `write_rows_f32` for data already in f16.
    pub fn write_rows_f16(&self, ctx: &GpuContext, row_start: usize, data: &[f16]) -> Result<()> {
        if self.format.quant().is_some() {
            let wide: Vec<f32> = data.iter().map(|v| v.to_f32()).collect();
            return self.write_rows_f32(ctx, row_start, &wide);
        }
        self.write_rows_with(ctx, row_start, data.len(), |_, src_offset, out| {
            let src = &data[src_offset..src_offset + self.cols];
            match out {
                RowOut::F32(o) => {
                    for (d, s) in o.iter_mut().zip(src) {
                        *d = s.to_f32();
                    }
                }
                RowOut::F16(o) => o[..self.cols].copy_from_slice(src),
            }
        })
    }

    /// Writes whole rows of an already quantized weight: `codes` and `scales` hold the
    /// same number of rows in the byte layout of `unmask_core::quant`.
    pub fn write_rows_quant(
        &self,
        ctx: &GpuContext,
        row_start: usize,
        codes: &[u8],
        scales: &[u8],
    ) -> Result<()> {
        let (code_row, scale_row) = self.quant_row_bytes()?;
        let n_rows = codes.len() / code_row;
        if codes.len() != n_rows * code_row
            || scales.len() != n_rows * scale_row
            || row_start + n_rows > self.rows
        {
            return Err(GpuError::Shape {
                op: "weight write",
                expected: format!(
                    "whole rows of {code_row} code bytes and {scale_row} scale bytes within {} rows",
                    self.rows
                ),
                found: format!(
                    "{} code bytes and {} scale bytes at row {row_start}",
                    codes.len(),
                    scales.len()
                ),
            });
        }
        self.write_rows_codes(ctx, row_start, codes)?;
        self.write_rows_scales(ctx, row_start, scales)
    }

    /// Writes the codes alone of whole rows of a quantized weight (a streamed checkpoint
    /// delivers a matrix's codes and its scales as separate tensors).
    pub fn write_rows_codes(&self, ctx: &GpuContext, row_start: usize, codes: &[u8]) -> Result<()> {
        let (code_row, _) = self.quant_row_bytes()?;
        self.write_quant_part(ctx, row_start, codes, code_row, |_| 0)
    }

    /// Writes the scales alone of whole rows of a quantized weight.
    pub fn write_rows_scales(
        &self,
        ctx: &GpuContext,
        row_start: usize,
        scales: &[u8],
    ) -> Result<()> {
        let (_, scale_row) = self.quant_row_bytes()?;
        self.write_quant_part(ctx, row_start, scales, scale_row, |chunk_rows| {
            self.scales_word_offset(chunk_rows) * 4
        })
    }

    /// Bytes of codes and of scales per row; an error for a float weight.
    fn quant_row_bytes(&self) -> Result<(usize, usize)> {
        match self.format.quant() {
            Some(q) => Ok((
                q.row_code_bytes(self.cols),
                quant::row_scale_bytes(self.cols),
            )),
            None => Err(GpuError::Shape {
                op: "weight write",
                expected: "a quantized weight for quantized rows".into(),
                found: format!("a {} weight", self.format.name()),
            }),
        }
    }

    /// Writes rows of `row_bytes` bytes each into every chunk's part that starts at
    /// `base(chunk rows)` bytes.
    fn write_quant_part(
        &self,
        ctx: &GpuContext,
        row_start: usize,
        bytes: &[u8],
        row_bytes: usize,
        base: impl Fn(usize) -> usize,
    ) -> Result<()> {
        let n_rows = bytes.len() / row_bytes.max(1);
        if bytes.len() != n_rows * row_bytes || row_start + n_rows > self.rows {
            return Err(GpuError::Shape {
                op: "weight write",
                expected: format!("whole rows of {row_bytes} bytes within {} rows", self.rows),
                found: format!("{} bytes at row {row_start}", bytes.len()),
            });
        }
        self.for_chunk_runs(row_start, n_rows, |chunk, row, local, count| {
            let src = row - row_start;
            let at = base(chunk.rows) + local * row_bytes;
            ctx.queue.write_buffer(
                &chunk.buffer,
                at as u64,
                &bytes[src * row_bytes..(src + count) * row_bytes],
            );
        });
        Ok(())
    }

    fn check_write(&self, row_start: usize, len: usize) -> Result<()> {
        if self.cols == 0
            || !len.is_multiple_of(self.cols)
            || row_start + len / self.cols > self.rows
        {
            return Err(GpuError::Shape {
                op: "weight write",
                expected: format!(
                    "whole rows of {} columns within {} rows",
                    self.cols, self.rows
                ),
                found: format!("{len} values at row {row_start}"),
            });
        }
        Ok(())
    }

    /// Calls `f(chunk, first row, its row within the chunk, rows)` for each run of logical
    /// rows `[row_start, row_start + n)` that lies in one chunk, in order.
    fn for_chunk_runs(
        &self,
        row_start: usize,
        n: usize,
        mut f: impl FnMut(&WeightChunk, usize, usize, usize),
    ) {
        let mut row = row_start;
        while row < row_start + n {
            let (chunk, local, run) = self.locate(row);
            let count = run.min(row_start + n - row);
            f(chunk, row, local, count);
            row += count;
        }
    }

    /// The chunk holding logical row `row`, the row's place in it, and how many logical rows
    /// from `row` on follow it there contiguously.
    fn locate(&self, row: usize) -> (&WeightChunk, usize, usize) {
        let (column, up) = match self.paired {
            Some(h) if row >= h => (row - h, true),
            _ => (row, false),
        };
        let chunk = self
            .chunks
            .iter()
            .find(|c| {
                let width = if self.paired.is_some() {
                    c.rows / 2
                } else {
                    c.rows
                };
                column >= c.row_start && column < c.row_start + width
            })
            .expect("chunks cover all rows");
        let width = if self.paired.is_some() {
            chunk.rows / 2
        } else {
            chunk.rows
        };
        let within = column - chunk.row_start;
        let local = if up { width + within } else { within };
        (chunk, local, width - within)
    }

    fn write_rows_with(
        &self,
        ctx: &GpuContext,
        row_start: usize,
        len: usize,
        mut fill: impl FnMut(usize, usize, RowOut<'_>),
    ) -> Result<()> {
        self.check_write(row_start, len)?;
        let n_rows = len / self.cols;
        self.for_chunk_runs(row_start, n_rows, |chunk, row, local, count| {
            let offset = (local * self.row_stride * self.format.element_bytes()) as u64;
            match self.format {
                WeightFormat::F32 => {
                    let mut buf = vec![0f32; count * self.row_stride];
                    for r in 0..count {
                        let out = &mut buf[r * self.row_stride..(r + 1) * self.row_stride];
                        fill(row + r, (row + r - row_start) * self.cols, RowOut::F32(out));
                    }
                    ctx.queue
                        .write_buffer(&chunk.buffer, offset, bytemuck::cast_slice(&buf));
                }
                WeightFormat::F16Packed | WeightFormat::F16Native => {
                    let mut buf = vec![f16::ZERO; count * self.row_stride];
                    for r in 0..count {
                        let out = &mut buf[r * self.row_stride..(r + 1) * self.row_stride];
                        fill(row + r, (row + r - row_start) * self.cols, RowOut::F16(out));
                    }
                    ctx.queue
                        .write_buffer(&chunk.buffer, offset, bytemuck::cast_slice(&buf));
                }
                WeightFormat::Q8 | WeightFormat::Q4 => {
                    unreachable!("quantized rows are written by write_rows_quant")
                }
            }
        });
        Ok(())
    }

    /// Chunk `i` alone as a `[chunk rows, cols]` matrix (its rows renumbered from 0), so a
    /// consumer can process a huge matrix such as the LM head one chunk at a time.
    pub fn chunk_view(&self, i: usize) -> Weight {
        let c = &self.chunks[i];
        Weight {
            rows: c.rows,
            cols: self.cols,
            row_stride: self.row_stride,
            format: self.format,
            chunks: vec![WeightChunk {
                buffer: c.buffer.clone(),
                row_start: 0,
                rows: c.rows,
            }],
            paired: self.paired.map(|_| c.rows / 2),
        }
    }

    /// Total bytes on the GPU.
    pub fn size_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }
}

enum RowOut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
}
