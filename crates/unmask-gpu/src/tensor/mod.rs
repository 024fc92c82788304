//! Typed GPU buffers: activations (`Tensor`) and weight matrices split into chunks that
//! each fit one storage binding (`Weight`).
//!
//! This module holds the buffers and `Tensor`; `format` the storage formats of weights
//! (`WeightFormat`) and `weight` the chunked matrices (`Weight`, `WeightPlan`).

mod format;
mod weight;

use std::sync::Arc;

use crate::context::{GpuContext, MemoryCounter};
use crate::error::{GpuError, Result};
use crate::step::bind_groups::DroppedBuffers;

pub use format::WeightFormat;
pub use weight::{CHUNK_ROW_ALIGN, Weight, WeightChunk, WeightPlan};

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

/// A storage buffer whose bytes count in the context's `MemoryCounter` while it lives, so
/// benchmarks and `unmask info` report what the GPU holds (weights, activations, KV)
/// rather than an estimate.
#[derive(Debug)]
pub struct GpuBuffer {
    raw: wgpu::Buffer,
    bytes: u64,
    /// Unique for the process: bind groups are cached by the ids of their buffers.
    id: u64,
    counter: Arc<MemoryCounter>,
    dropped: Arc<DroppedBuffers>,
}

impl GpuBuffer {
    /// Allocated size in bytes (rounded up as the buffer was created).
    pub fn allocated_bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

impl std::ops::Deref for GpuBuffer {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        &self.raw
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        self.counter.release(self.bytes);
        // Cached bind groups still reference the buffer: free its memory now (wgpu waits
        // for work in flight) and let the cache forget those groups at the next submit.
        self.raw.destroy();
        self.dropped.note(self.id);
    }
}

static NEXT_BUFFER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A dense GPU buffer with a shape; row-major.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub buffer: Arc<GpuBuffer>,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// Bytes a storage buffer of `bytes` bytes really takes: bindings of size zero are
/// invalid, and every buffer is kept a multiple of 16 bytes.
pub fn buffer_size(bytes: u64) -> u64 {
    round_up(bytes.max(16), 16)
}

pub(crate) fn storage_buffer(ctx: &GpuContext, label: &str, bytes: u64) -> Result<GpuBuffer> {
    let size = buffer_size(bytes);
    if size > ctx.features.max_buffer_bytes {
        return Err(GpuError::TooLarge {
            what: format!("buffer {label}"),
            needed: size,
            limit: ctx.features.max_buffer_bytes,
        });
    }
    ctx.check_faults()?;
    ctx.memory.allocate(&format!("buffer {label}"), size)?;
    let created = ctx.scoped_allocation(|| {
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    });
    let raw = created.map_err(|message| {
        ctx.memory.release(size);
        GpuError::OutOfMemory {
            what: format!("buffer {label}"),
            needed: size,
            live: ctx.memory.live_bytes(),
            message,
        }
    })?;
    ctx.host.count_buffer();
    Ok(GpuBuffer {
        raw,
        bytes: size,
        id: NEXT_BUFFER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        counter: ctx.memory.clone(),
        dropped: ctx.bind_groups.dropped.clone(),
    })
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

    /// An f16 tensor (`DType::F16`, two halves per 32-bit word) of `data` rounded to f16.
    pub fn from_f32_as_f16(
        ctx: &GpuContext,
        shape: &[usize],
        data: &[f32],
        label: &str,
    ) -> Result<Self> {
        let t = Self::zeros(ctx, DType::F16, shape, label)?;
        t.check_len(data.len(), "from_f32_as_f16")?;
        let mut halves: Vec<half::f16> = data.iter().map(|&x| half::f16::from_f32(x)).collect();
        // Buffer writes go in whole 32-bit words.
        if halves.len() % 2 == 1 {
            halves.push(half::f16::ZERO);
        }
        ctx.queue
            .write_buffer(&t.buffer, 0, bytemuck::cast_slice(&halves));
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
        pollster::block_on(self.read_f32_async(ctx))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_u32(&self, ctx: &GpuContext) -> Result<Vec<u32>> {
        pollster::block_on(self.read_u32_async(ctx))
    }

    pub async fn read_f32_async(&self, ctx: &GpuContext) -> Result<Vec<f32>> {
        let bytes = ctx
            .read_bytes_async(&self.buffer, 0, self.size_bytes())
            .await?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// The first `elems` values as f32, whatever the float dtype (f16 widened exactly).
    pub async fn read_values_async(&self, ctx: &GpuContext, elems: usize) -> Result<Vec<f32>> {
        let width = self.dtype.size_bytes();
        let elems = elems.min(self.numel());
        // Reads go in whole 32-bit words.
        let bytes = ((elems * width) as u64).next_multiple_of(4);
        let raw = ctx.read_bytes_async(&self.buffer, 0, bytes).await?;
        Ok(match self.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec(&raw),
            DType::F16 => raw
                .chunks_exact(2)
                .take(elems)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::U32 => {
                return Err(GpuError::Shape {
                    op: "read_values",
                    expected: "an f32 or f16 tensor".into(),
                    found: format!("{:?} {:?}", self.dtype, self.shape),
                });
            }
        })
    }

    /// Every value as f32 (f16 widened exactly).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_values(&self, ctx: &GpuContext) -> Result<Vec<f32>> {
        pollster::block_on(self.read_values_async(ctx, self.numel()))
    }

    pub async fn read_u32_async(&self, ctx: &GpuContext) -> Result<Vec<u32>> {
        let bytes = ctx
            .read_bytes_async(&self.buffer, 0, self.size_bytes())
            .await?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }
}
