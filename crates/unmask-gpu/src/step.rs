//! Recording a step: every dispatch of one denoising step goes into one command encoder.
//!
//! Kernel parameters of the whole step are packed into one uniform buffer (`ParamArena`)
//! that is written once per submit; no other buffer is created while a step is encoded.

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};

use crate::context::GpuContext;
use crate::error::{GpuError, Result};
use crate::tensor::{GpuBuffer, Tensor, WeightChunk};

/// A buffer range bound to one storage binding of a kernel.
#[derive(Clone, Debug)]
pub struct Binding {
    pub buffer: Arc<GpuBuffer>,
    pub offset: u64,
    pub size: Option<NonZeroU64>,
}

impl From<&Tensor> for Binding {
    fn from(t: &Tensor) -> Self {
        Binding {
            buffer: t.buffer.clone(),
            offset: 0,
            size: None,
        }
    }
}

impl From<&WeightChunk> for Binding {
    fn from(c: &WeightChunk) -> Self {
        Binding {
            buffer: c.buffer.clone(),
            offset: 0,
            size: None,
        }
    }
}

impl Binding {
    /// A sub-range of a buffer; `offset` must respect the device's storage offset alignment.
    pub fn range(buffer: &Arc<GpuBuffer>, offset: u64, size: u64) -> Self {
        Binding {
            buffer: buffer.clone(),
            offset,
            size: NonZeroU64::new(size),
        }
    }
}

enum Command {
    Dispatch {
        pipeline: Arc<wgpu::ComputePipeline>,
        bindings: Vec<Binding>,
        param_offset: u64,
        param_len: u64,
        groups: [u32; 3],
    },
    Copy {
        src: Arc<GpuBuffer>,
        src_offset: u64,
        dst: Arc<GpuBuffer>,
        dst_offset: u64,
        size: u64,
    },
}

/// The uniform buffer holding the parameters of every dispatch of a step; grows rarely.
pub(crate) struct ParamArena {
    align: u64,
    buffer: Mutex<Option<wgpu::Buffer>>,
}

impl ParamArena {
    pub(crate) fn new(_device: &wgpu::Device, align: u32) -> Self {
        Self {
            align: u64::from(align.max(16)),
            buffer: Mutex::new(None),
        }
    }
}

/// Records the dispatches and copies of one step, then submits them in one command buffer.
pub struct StepEncoder<'a> {
    ctx: &'a GpuContext,
    commands: Vec<Command>,
    params: Vec<u8>,
    label: &'static str,
}

/// Number of workgroups along x and y for `n` groups, within the per-dimension limit.
/// Kernels recover the linear group id as `wid.x + wid.y * num_workgroups.x`.
pub fn groups_2d(ctx: &GpuContext, n: u32) -> [u32; 3] {
    let max = ctx.features.max_workgroups_per_dim.max(1);
    if n <= max {
        [n.max(1), 1, 1]
    } else {
        let y = n.div_ceil(max);
        [n.div_ceil(y), y, 1]
    }
}

impl<'a> StepEncoder<'a> {
    pub fn new(ctx: &'a GpuContext, label: &'static str) -> Self {
        Self {
            ctx,
            commands: Vec::new(),
            params: Vec::new(),
            label,
        }
    }

    pub fn ctx(&self) -> &'a GpuContext {
        self.ctx
    }

    /// Records one dispatch. Binding 0 of the kernel is the uniform `params`; the storage
    /// buffers follow at bindings 1, 2, ... in the order given.
    pub fn dispatch<P: bytemuck::Pod>(
        &mut self,
        pipeline: &Arc<wgpu::ComputePipeline>,
        params: &P,
        bindings: &[Binding],
        groups: [u32; 3],
    ) {
        let align = self.ctx.params.align as usize;
        let offset = self.params.len().div_ceil(align) * align;
        self.params.resize(offset, 0);
        self.params.extend_from_slice(bytemuck::bytes_of(params));
        let len = (std::mem::size_of::<P>() as u64).div_ceil(16) * 16;
        self.params.resize(offset + len as usize, 0);
        self.commands.push(Command::Dispatch {
            pipeline: pipeline.clone(),
            bindings: bindings.to_vec(),
            param_offset: offset as u64,
            param_len: len,
            groups,
        });
    }

    /// Records a buffer-to-buffer copy (byte offsets and size multiples of 4).
    pub fn copy(
        &mut self,
        src: &Arc<GpuBuffer>,
        src_offset: u64,
        dst: &Arc<GpuBuffer>,
        dst_offset: u64,
        size: u64,
    ) {
        if size == 0 {
            return;
        }
        self.commands.push(Command::Copy {
            src: src.clone(),
            src_offset,
            dst: dst.clone(),
            dst_offset,
            size,
        });
    }

    /// Number of dispatches recorded so far (every dispatch of a step can be counted).
    pub fn dispatch_count(&self) -> usize {
        self.commands
            .iter()
            .filter(|c| matches!(c, Command::Dispatch { .. }))
            .count()
    }

    /// Encodes everything into one command buffer and submits it.
    pub fn submit(self) -> Result<wgpu::SubmissionIndex> {
        let ctx = self.ctx;
        let mut arena = ctx.params.buffer.lock().expect("param arena poisoned");
        let needed = (self.params.len() as u64).max(256);
        if arena.as_ref().is_none_or(|b| b.size() < needed) {
            let size = needed.next_power_of_two().max(64 * 1024);
            *arena = Some(ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("unmask params"),
                size,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let param_buffer = arena.as_ref().expect("arena allocated");
        if !self.params.is_empty() {
            ctx.queue.write_buffer(param_buffer, 0, &self.params);
        }
        let label = self.label;
        let commands = self.commands;
        let submission = ctx.capture_errors(label, || {
            let mut encoder = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
            let mut i = 0;
            while i < commands.len() {
                match &commands[i] {
                    Command::Copy {
                        src,
                        src_offset,
                        dst,
                        dst_offset,
                        size,
                    } => {
                        encoder.copy_buffer_to_buffer(src, *src_offset, dst, *dst_offset, *size);
                        i += 1;
                    }
                    Command::Dispatch { .. } => {
                        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some(label),
                            timestamp_writes: None,
                        });
                        while let Some(Command::Dispatch {
                            pipeline,
                            bindings,
                            param_offset,
                            param_len,
                            groups,
                        }) = commands.get(i)
                        {
                            let layout = pipeline.get_bind_group_layout(0);
                            let mut entries = Vec::with_capacity(bindings.len() + 1);
                            entries.push(wgpu::BindGroupEntry {
                                binding: 0,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: param_buffer,
                                    offset: *param_offset,
                                    size: NonZeroU64::new(*param_len),
                                }),
                            });
                            for (j, b) in bindings.iter().enumerate() {
                                entries.push(wgpu::BindGroupEntry {
                                    binding: j as u32 + 1,
                                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                        buffer: &b.buffer,
                                        offset: b.offset,
                                        size: b.size,
                                    }),
                                });
                            }
                            let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                                label: None,
                                layout: &layout,
                                entries: &entries,
                            });
                            pass.set_pipeline(pipeline);
                            pass.set_bind_group(0, &group, &[]);
                            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                            i += 1;
                        }
                    }
                }
            }
            ctx.queue.submit([encoder.finish()])
        })?;
        Ok(submission)
    }
}

impl GpuContext {
    /// Copies `size` bytes at `offset` of `buffer` back to the host and waits for them.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_bytes(&self, buffer: &wgpu::Buffer, offset: u64, size: u64) -> Result<Vec<u8>> {
        pollster::block_on(self.read_bytes_async(buffer, offset, size))
    }

    /// Copies `size` bytes at `offset` of `buffer` back to the host. Natively the device is
    /// polled until the copy is mapped; in a browser the future resolves when the page's
    /// event loop delivers the mapping, so it must be awaited, never blocked on.
    pub async fn read_bytes_async(
        &self,
        buffer: &wgpu::Buffer,
        offset: u64,
        size: u64,
    ) -> Result<Vec<u8>> {
        self.check_faults()?;
        let padded = size.div_ceil(4) * 4;
        if padded == 0 {
            return Ok(Vec::new());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unmask readback"),
            size: padded,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("readback"),
            });
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, padded);
        self.queue.submit([encoder.finish()]);
        let (tx, rx) = crate::oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| tx.send(r));
        // Natively nothing drives the device but a poll; it runs the callback above.
        #[cfg(not(target_arch = "wasm32"))]
        self.wait_idle()?;
        rx.await
            .ok_or_else(|| GpuError::Readback("the mapping callback was dropped".into()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let mut out = view.to_vec();
        out.truncate(size as usize);
        drop(view);
        staging.unmap();
        // An error in the work just read (recorded by the device's handler) makes the
        // bytes meaningless.
        self.check_faults()?;
        Ok(out)
    }
}
