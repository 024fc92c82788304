//! Recording a step: every dispatch of one denoising step goes into one command encoder.
//!
//! Kernel parameters of the whole step are packed into one uniform buffer (`ParamArena`)
//! that is written once per submit and bound at a dynamic offset, so bind groups are built
//! once per buffer set and reused (`bind_groups`); read-backs are copies into a ring of
//! staging buffers recorded in the same command buffer (`readback`). A steady-state step
//! is one submit and creates no buffer and no bind group.

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};

pub(crate) mod bind_groups;
mod readback;
#[cfg(not(target_arch = "wasm32"))]
mod timed;
mod trace;

pub use bind_groups::{HostCounters, HostCounts};
pub(crate) use readback::ReadbackRing;
use readback::Staged;
pub use readback::Submitted;
pub(crate) use trace::TraceState;
pub use trace::{StepTrace, TraceClock, TraceOptions, TracedDispatch};

use crate::context::GpuContext;
use crate::error::Result;
use crate::pipeline::ComputeKernel;
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
        kernel: Arc<ComputeKernel>,
        bindings: Vec<Binding>,
        param_offset: u64,
        param_len: u64,
        groups: [u32; 3],
        layer: Option<u32>,
    },
    /// A buffer-to-buffer copy, or with no `src` a clear of the destination range to zeros.
    Copy {
        src: Option<Arc<GpuBuffer>>,
        src_offset: u64,
        dst: Arc<GpuBuffer>,
        dst_offset: u64,
        size: u64,
    },
}

/// The uniform buffer holding the parameters of every dispatch of a step; grows rarely.
/// Each replacement gets a new generation, which invalidates the cached bind groups.
pub(crate) struct ParamArena {
    align: u64,
    buffer: Mutex<Option<(wgpu::Buffer, u64)>>,
}

impl ParamArena {
    pub(crate) fn new(align: u32) -> Self {
        Self {
            align: u64::from(align.max(16)),
            buffer: Mutex::new(None),
        }
    }
}

/// Records the dispatches and copies of one step, then submits them in one command buffer,
/// read-back copies included.
pub struct StepEncoder<'a> {
    ctx: &'a GpuContext,
    commands: Vec<Command>,
    params: Vec<u8>,
    label: &'static str,
    layer: Option<u32>,
    readbacks: Vec<(Arc<GpuBuffer>, u64, u64)>,
}

/// Records a `Command::Copy` into `encoder` (dispatches are recorded into passes).
fn record_copy(encoder: &mut wgpu::CommandEncoder, command: &Command) {
    if let Command::Copy {
        src,
        src_offset,
        dst,
        dst_offset,
        size,
    } = command
    {
        match src {
            Some(src) => encoder.copy_buffer_to_buffer(src, *src_offset, dst, *dst_offset, *size),
            None => encoder.clear_buffer(dst, *dst_offset, Some(*size)),
        }
    }
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
            layer: None,
            readbacks: Vec::new(),
        }
    }

    pub fn ctx(&self) -> &'a GpuContext {
        self.ctx
    }

    /// Tags the dispatches recorded from now on with a transformer layer (`None`: outside
    /// the layers), for traces and per-layer counts.
    pub fn set_layer(&mut self, layer: Option<usize>) {
        self.layer = layer.map(|l| l as u32);
    }

    /// Records one dispatch. Binding 0 of the kernel is the uniform `params`; the storage
    /// buffers follow at bindings 1, 2, ... in the order given.
    pub fn dispatch<P: bytemuck::Pod>(
        &mut self,
        kernel: &Arc<ComputeKernel>,
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
            kernel: kernel.clone(),
            bindings: bindings.to_vec(),
            param_offset: offset as u64,
            param_len: len,
            groups,
            layer: self.layer,
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
            src: Some(src.clone()),
            src_offset,
            dst: dst.clone(),
            dst_offset,
            size,
        });
    }

    /// Records zeroing `size` bytes of `dst` from `offset` (multiples of 4), in order with
    /// the dispatches and copies around it.
    pub fn clear(&mut self, dst: &Arc<GpuBuffer>, offset: u64, size: u64) {
        if size == 0 {
            return;
        }
        self.commands.push(Command::Copy {
            src: None,
            src_offset: 0,
            dst: dst.clone(),
            dst_offset: offset,
            size,
        });
    }

    /// Asks for `size` bytes at `offset` of `buffer` back once the step has run; the copy
    /// goes into the step's own command buffer. Returns the index of these bytes in what
    /// `Submitted::read` returns.
    pub fn read_back(&mut self, buffer: &Arc<GpuBuffer>, offset: u64, size: u64) -> usize {
        self.readbacks.push((buffer.clone(), offset, size));
        self.readbacks.len() - 1
    }

    /// Number of dispatches recorded so far (every dispatch of a step can be counted).
    pub fn dispatch_count(&self) -> usize {
        self.commands
            .iter()
            .filter(|c| matches!(c, Command::Dispatch { .. }))
            .count()
    }

    /// Encodes everything into one command buffer and submits it; the read-backs asked for
    /// come back through the returned `Submitted`.
    pub fn submit(self) -> Result<Submitted<'a>> {
        let ctx = self.ctx;
        let mut arena = ctx.params.buffer.lock().expect("param arena poisoned");
        let needed = (self.params.len() as u64).max(256);
        let mut replaced = false;
        if arena.as_ref().is_none_or(|(b, _)| b.size() < needed) {
            let size = needed.next_power_of_two().max(64 * 1024);
            let generation = arena.as_ref().map_or(0, |(_, g)| g + 1);
            *arena = Some((
                ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("unmask params"),
                    size,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }),
                generation,
            ));
            replaced = true;
        }
        ctx.bind_groups.purge(replaced);
        let (param_buffer, generation) = arena.as_ref().expect("arena allocated");
        if !self.params.is_empty() {
            ctx.queue.write_buffer(param_buffer, 0, &self.params);
        }
        let trace = ctx.trace_options();
        let params = (param_buffer, *generation);
        let staged: Vec<Staged> = self
            .readbacks
            .iter()
            .map(|(_, _, size)| {
                let padded = size.div_ceil(4) * 4;
                Staged {
                    buffer: (padded > 0).then(|| ctx.readback.take(ctx, padded)),
                    size: padded,
                }
            })
            .collect();
        #[cfg(not(target_arch = "wasm32"))]
        let (times, encode_ms) = {
            let timed = trace.is_some_and(|t| t.timing);
            let started = std::time::Instant::now();
            let times = if timed && ctx.has_timestamps() {
                self.submit_timestamped(params, &staged)?
            } else if timed {
                self.submit_one_by_one(params, &staged)?
            } else {
                self.submit_once(params, &staged)?;
                None
            };
            (
                times,
                (!timed).then(|| started.elapsed().as_secs_f64() * 1e3),
            )
        };
        // Timing needs a blocking wait: in a browser the list is traced untimed.
        #[cfg(target_arch = "wasm32")]
        let (times, encode_ms) = {
            self.submit_once(params, &staged)?;
            (None, None)
        };
        if let Some(options) = trace {
            let clock = match (options.timing, ctx.has_timestamps()) {
                (false, _) => TraceClock::None,
                (true, true) => TraceClock::GpuTimestamps,
                (true, false) => TraceClock::CpuWallClock,
            };
            ctx.push_trace(self.trace(clock, times, encode_ms));
        }
        Ok(Submitted { ctx, staged })
    }

    fn trace(
        &self,
        clock: TraceClock,
        times: Option<Vec<f64>>,
        encode_ms: Option<f64>,
    ) -> StepTrace {
        let mut dispatches = Vec::new();
        let mut copies = self.readbacks.len();
        for c in &self.commands {
            match c {
                Command::Dispatch {
                    kernel,
                    groups,
                    layer,
                    ..
                } => dispatches.push(TracedDispatch {
                    kernel: kernel.family(),
                    variant: kernel.variant.clone(),
                    layer: *layer,
                    workgroups: *groups,
                    ms: times
                        .as_ref()
                        .and_then(|t| t.get(dispatches.len()).copied()),
                }),
                Command::Copy { .. } => copies += 1,
            }
        }
        StepTrace {
            label: self.label,
            clock,
            dispatches,
            copies,
            encode_ms,
            host: self.ctx.host.snapshot(),
        }
    }

    /// Records one dispatch into `pass`: its pipeline, its cached bind group (parameters at
    /// their dynamic offset) and its workgroups. Copies are not dispatches and are skipped.
    fn record_dispatch(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        params: (&wgpu::Buffer, u64),
        command: &Command,
    ) {
        let Command::Dispatch {
            kernel,
            bindings,
            param_offset,
            param_len,
            groups,
            ..
        } = command
        else {
            return;
        };
        let group = self.ctx.bind_groups.get(
            &self.ctx.device,
            &self.ctx.host,
            kernel,
            params,
            *param_len,
            bindings,
        );
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, &group, &[*param_offset as u32]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
    }

    fn encode_readbacks(&self, encoder: &mut wgpu::CommandEncoder, staged: &[Staged]) {
        for ((src, offset, _), s) in self.readbacks.iter().zip(staged) {
            if let Some(dst) = &s.buffer {
                encoder.copy_buffer_to_buffer(src, *offset, dst, 0, s.size);
            }
        }
    }

    /// The normal path: every command in one command buffer, consecutive dispatches in one
    /// compute pass, one submit.
    fn submit_once(&self, params: (&wgpu::Buffer, u64), staged: &[Staged]) -> Result<()> {
        let ctx = self.ctx;
        let label = self.label;
        let commands = &self.commands;
        ctx.capture_errors(label, || {
            let mut encoder = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
            let mut i = 0;
            while i < commands.len() {
                match &commands[i] {
                    Command::Copy { .. } => {
                        record_copy(&mut encoder, &commands[i]);
                        i += 1;
                    }
                    Command::Dispatch { .. } => {
                        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some(label),
                            timestamp_writes: None,
                        });
                        while let Some(command @ Command::Dispatch { .. }) = commands.get(i) {
                            self.record_dispatch(&mut pass, params, command);
                            i += 1;
                        }
                    }
                }
            }
            self.encode_readbacks(&mut encoder, staged);
            ctx.queue.submit([encoder.finish()]);
        })?;
        ctx.host.count_submit(self.dispatch_count());
        Ok(())
    }
}

impl GpuContext {
    /// Copies `size` bytes at `offset` of `buffer` back to the host and waits for them.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_bytes(&self, buffer: &wgpu::Buffer, offset: u64, size: u64) -> Result<Vec<u8>> {
        pollster::block_on(self.read_bytes_async(buffer, offset, size))
    }

    /// Copies `size` bytes at `offset` of `buffer` back to the host (one submit through
    /// the read-back ring). In a browser the future must be awaited, never blocked on.
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
        let staging = self.readback.take(self, padded);
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("readback"),
            });
        encoder.copy_buffer_to_buffer(buffer, offset, &staging, 0, padded);
        self.queue.submit([encoder.finish()]);
        self.host.count_submit(0);
        let submitted = Submitted {
            ctx: self,
            staged: vec![Staged {
                buffer: Some(staging),
                size: padded,
            }],
        };
        let mut out = submitted.read_async().await?.pop().unwrap_or_default();
        out.truncate(size as usize);
        Ok(out)
    }
}
