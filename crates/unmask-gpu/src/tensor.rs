//! Typed GPU buffers: activations (`Tensor`) and weight matrices split into chunks that
//! each fit one storage binding (`Weight`).

use std::sync::Arc;

use half::f16;

use crate::context::GpuContext;
use crate::error::{GpuError, Result};

/// Element type of a `Tensor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// IEEE half floats, two per 32-bit word (little-endian: element 2i in the low half).
    F16,
    U32,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 => 2,
        }
    }
}

/// A dense GPU buffer with a shape; row-major.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub buffer: Arc<wgpu::Buffer>,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

pub(crate) fn storage_buffer(ctx: &GpuContext, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
    // Bindings of size zero are invalid; keep every buffer a multiple of 16 bytes.
    let size = round_up(bytes.max(16), 16);
    if size > ctx.features.max_buffer_bytes {
        return Err(GpuError::TooLarge {
            what: format!("buffer {label}"),
            needed: size,
            limit: ctx.features.max_buffer_bytes,
        });
    }
    Ok(ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    }))
}

impl Tensor {
    pub fn zeros(ctx: &GpuContext, dtype: DType, shape: &[usize], label: &str) -> Result<Self> {
        let numel: usize = shape.iter().product();
        let bytes = (numel * dtype.size_bytes()) as u64;
        if bytes > ctx.features.max_binding_bytes {
            return Err(GpuError::TooLarge {
                what: format!("tensor {label} {shape:?}"),
                needed: bytes,
                limit: ctx.features.max_binding_bytes,
            });
        }
        let buffer = storage_buffer(ctx, label, bytes)?;
        Ok(Self {
            buffer: Arc::new(buffer),
            dtype,
            shape: shape.to_vec(),
        })
    }

    pub fn from_f32(ctx: &GpuContext, shape: &[usize], data: &[f32], label: &str) -> Result<Self> {
        let t = Self::zeros(ctx, DType::F32, shape, label)?;
        t.check_len(data.len(), "from_f32")?;
        ctx.queue
            .write_buffer(&t.buffer, 0, bytemuck::cast_slice(data));
        Ok(t)
    }

    pub fn from_u32(ctx: &GpuContext, shape: &[usize], data: &[u32], label: &str) -> Result<Self> {
        let t = Self::zeros(ctx, DType::U32, shape, label)?;
        t.check_len(data.len(), "from_u32")?;
        ctx.queue
            .write_buffer(&t.buffer, 0, bytemuck::cast_slice(data));
        Ok(t)
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn size_bytes(&self) -> u64 {
        (self.numel() * self.dtype.size_bytes()) as u64
    }

    fn check_len(&self, len: usize, op: &'static str) -> Result<()> {
        if len != self.numel() {
            return Err(GpuError::Shape {
                op,
                expected: format!("{} elements for shape {:?}", self.numel(), self.shape),
                found: format!("{len} elements"),
            });
        }
        Ok(())
    }

    /// Overwrites the first `data.len()` elements.
    pub fn write_f32(&self, ctx: &GpuContext, data: &[f32]) -> Result<()> {
        self.write_at(ctx, 0, bytemuck::cast_slice(data))
    }

    pub fn write_u32(&self, ctx: &GpuContext, data: &[u32]) -> Result<()> {
        self.write_at(ctx, 0, bytemuck::cast_slice(data))
    }

    /// Writes raw bytes at a byte offset; both must be multiples of 4.
    pub fn write_at(&self, ctx: &GpuContext, offset: u64, bytes: &[u8]) -> Result<()> {
        if offset + bytes.len() as u64 > self.buffer.size() {
            return Err(GpuError::Shape {
                op: "write",
                expected: format!("at most {} bytes", self.buffer.size()),
                found: format!("{} bytes at offset {offset}", bytes.len()),
            });
        }
        if !bytes.is_empty() {
            ctx.queue.write_buffer(&self.buffer, offset, bytes);
        }
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f32(&self, ctx: &GpuContext) -> Result<Vec<f32>> {
        let bytes = ctx.read_bytes(&self.buffer, 0, self.size_bytes())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_u32(&self, ctx: &GpuContext) -> Result<Vec<u32>> {
        let bytes = ctx.read_bytes(&self.buffer, 0, self.size_bytes())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}

/// How a weight matrix is stored and which kernel variant reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    /// f16 pairs in `u32` words, unpacked in the shader; works everywhere.
    F16Packed,
    /// `array<f16>` with `enable f16;`; needs `shader-f16`. Same bytes as `F16Packed`.
    F16Native,
}

impl WeightFormat {
    pub fn element_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16Packed | WeightFormat::F16Native => 2,
        }
    }

    /// The format actually usable on this device: native f16 falls back to packed.
    pub fn resolve(self, ctx: &GpuContext) -> Self {
        match self {
            WeightFormat::F16Native if !ctx.features.shader_f16 => WeightFormat::F16Packed,
            other => other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16Packed => "f16-packed",
            WeightFormat::F16Native => "f16-native",
        }
    }
}

/// A contiguous range of rows of a `Weight`, in one buffer that fits one binding.
#[derive(Clone, Debug)]
pub struct WeightChunk {
    pub buffer: Arc<wgpu::Buffer>,
    pub row_start: usize,
    pub rows: usize,
}

/// A `[rows, cols]` matrix (an `nn.Linear` weight `[out, in]`, or an embedding table).
/// Rows are padded with zeros to `row_stride` (a multiple of 4) so kernels can use vec4
/// loads; rows are split over chunks so no binding exceeds the device limit.
#[derive(Clone, Debug)]
pub struct Weight {
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub format: WeightFormat,
    pub chunks: Vec<WeightChunk>,
}

/// Rows per chunk are a multiple of this, so matmul tiles never straddle chunks.
pub const CHUNK_ROW_ALIGN: usize = 64;

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
        let row_stride = cols.div_ceil(4) * 4;
        let row_bytes = (row_stride * format.element_bytes()) as u64;
        let limit = ctx.features.max_binding_bytes;
        let mut rows_per_chunk = (limit / row_bytes) as usize;
        if rows_per_chunk == 0 {
            return Err(GpuError::TooLarge {
                what: format!("one row of weight {label} ({cols} columns)"),
                needed: row_bytes,
                limit,
            });
        }
        if rows_per_chunk >= CHUNK_ROW_ALIGN {
            rows_per_chunk -= rows_per_chunk % CHUNK_ROW_ALIGN;
        }
        let mut chunks = Vec::new();
        let mut row_start = 0;
        while row_start < rows.max(1) {
            let n = rows_per_chunk.min(rows.max(1) - row_start);
            let buffer = storage_buffer(
                ctx,
                &format!("{label}[{row_start}..{}]", row_start + n),
                n as u64 * row_bytes,
            )?;
            chunks.push(WeightChunk {
                buffer: Arc::new(buffer),
                row_start,
                rows: n,
            });
            row_start += n;
        }
        Ok(Self {
            rows,
            cols,
            row_stride,
            format,
            chunks,
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

    /// Writes whole rows starting at `row_start` from row-major `[n, cols]` data, converting
    /// to the storage format. Callers stream big tensors through this in row blocks.
    pub fn write_rows_f32(&self, ctx: &GpuContext, row_start: usize, data: &[f32]) -> Result<()> {
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

    fn write_rows_with(
        &self,
        ctx: &GpuContext,
        row_start: usize,
        len: usize,
        mut fill: impl FnMut(usize, usize, RowOut<'_>),
    ) -> Result<()> {
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
        let n_rows = len / self.cols;
        let mut row = row_start;
        while row < row_start + n_rows {
            let chunk = self
                .chunks
                .iter()
                .find(|c| row >= c.row_start && row < c.row_start + c.rows)
                .expect("chunks cover all rows");
            let end = (chunk.row_start + chunk.rows).min(row_start + n_rows);
            let count = end - row;
            let offset =
                ((row - chunk.row_start) * self.row_stride * self.format.element_bytes()) as u64;
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
            }
            row = end;
        }
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
