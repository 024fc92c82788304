//! A step submitted for `unmask trace --timing`: each dispatch timed by GPU timestamps where
//! the device has them, else submitted and waited for alone under the host clock. Native
//! only: timing needs a blocking wait; in a browser the list is traced untimed.

use super::{Command, StepEncoder, record_copy};
use crate::error::Result;
use crate::step::readback::Staged;

impl StepEncoder<'_> {
    /// Timing with GPU timestamps: each dispatch in its own pass, timestamps at its start
    /// and end, resolved and read back after the step (one submit still).
    pub(super) fn submit_timestamped(
        &self,
        params: (&wgpu::Buffer, u64),
        staged: &[Staged],
    ) -> Result<Option<Vec<f64>>> {
        use crate::error::GpuError;
        /// Queries per query set (wgpu's limit is 4096).
        const QUERIES_PER_SET: u32 = 4096;
        let ctx = self.ctx;
        let n = self.dispatch_count() as u32;
        let per_set = QUERIES_PER_SET / 2;
        let sets: Vec<wgpu::QuerySet> = (0..n.div_ceil(per_set))
            .map(|i| {
                let count = (n - i * per_set).min(per_set) * 2;
                ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("unmask trace"),
                    ty: wgpu::QueryType::Timestamp,
                    count,
                })
            })
            .collect();
        let bytes = u64::from(n) * 16;
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unmask trace resolve"),
            size: bytes.max(16),
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let out = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unmask trace read"),
            size: bytes.max(16),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let label = self.label;
        ctx.capture_errors(label, || {
            let mut encoder = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
            let mut d = 0u32;
            for c in &self.commands {
                match c {
                    Command::Copy { .. } => record_copy(&mut encoder, c),
                    Command::Dispatch { .. } => {
                        let at = (d % per_set) * 2;
                        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some(label),
                            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                                query_set: &sets[(d / per_set) as usize],
                                beginning_of_pass_write_index: Some(at),
                                end_of_pass_write_index: Some(at + 1),
                            }),
                        });
                        self.record_dispatch(&mut pass, params, c);
                        d += 1;
                    }
                }
            }
            for (i, set) in sets.iter().enumerate() {
                let count = (n - i as u32 * per_set).min(per_set) * 2;
                encoder.resolve_query_set(
                    set,
                    0..count,
                    &resolve,
                    u64::from(i as u32 * per_set) * 16,
                );
            }
            encoder.copy_buffer_to_buffer(&resolve, 0, &out, 0, bytes.max(16));
            self.encode_readbacks(&mut encoder, staged);
            ctx.queue.submit([encoder.finish()]);
        })?;
        ctx.host.count_submit(n as usize);
        let (tx, rx) = crate::oneshot::channel();
        out.map_async(wgpu::MapMode::Read, .., move |r| tx.send(r));
        ctx.wait_idle()?;
        pollster::block_on(rx)
            .ok_or_else(|| GpuError::Readback("the mapping callback was dropped".into()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let ticks: Vec<u64> = {
            let view = out
                .get_mapped_range(..)
                .map_err(|e| GpuError::Readback(e.to_string()))?;
            bytemuck::pod_collect_to_vec(&view)
        };
        let period_ns = f64::from(ctx.queue.get_timestamp_period());
        Ok(Some(
            ticks
                .chunks_exact(2)
                .take(n as usize)
                .map(|t| t[1].saturating_sub(t[0]) as f64 * period_ns / 1e6)
                .collect(),
        ))
    }

    /// Timing without timestamps: each command submitted and waited for alone, timed by
    /// the host clock.
    pub(super) fn submit_one_by_one(
        &self,
        params: (&wgpu::Buffer, u64),
        staged: &[Staged],
    ) -> Result<Option<Vec<f64>>> {
        let ctx = self.ctx;
        let label = self.label;
        ctx.wait_idle()?;
        let mut times = Vec::new();
        for c in &self.commands {
            let start = std::time::Instant::now();
            ctx.capture_errors(label, || {
                let mut encoder = ctx
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
                match c {
                    Command::Copy { .. } => record_copy(&mut encoder, c),
                    Command::Dispatch { .. } => {
                        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some(label),
                            timestamp_writes: None,
                        });
                        self.record_dispatch(&mut pass, params, c);
                    }
                }
                ctx.queue.submit([encoder.finish()]);
            })?;
            ctx.wait_idle()?;
            if matches!(c, Command::Dispatch { .. }) {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        ctx.capture_errors(label, || {
            let mut encoder = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) });
            self.encode_readbacks(&mut encoder, staged);
            ctx.queue.submit([encoder.finish()]);
        })?;
        ctx.host.count_submit(self.dispatch_count());
        Ok(Some(times))
    }
}
