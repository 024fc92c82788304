//! Read-back through a small ring of map-read buffers reused from step to step: the copy
//! into one is recorded in the step's own command buffer, so a step is one submit and a
//! steady-state step creates no buffer.

use std::sync::Mutex;

use crate::context::GpuContext;
use crate::error::{GpuError, Result};

/// Staging buffers kept for reuse; more are made when a step reads more at once.
const RING_LIMIT: usize = 8;

#[derive(Default)]
pub(crate) struct ReadbackRing {
    free: Mutex<Vec<wgpu::Buffer>>,
}

impl ReadbackRing {
    /// A map-read buffer of at least `size` bytes: the smallest free one that fits, else a
    /// new one (sized to a power of two so later steps of other sizes reuse it).
    pub(crate) fn take(&self, ctx: &GpuContext, size: u64) -> wgpu::Buffer {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.size() >= size)
            .min_by_key(|(_, b)| b.size())
            .map(|(i, _)| i);
        if let Some(i) = best {
            return free.swap_remove(i);
        }
        drop(free);
        ctx.host.count_staging();
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unmask readback"),
            size: size.max(256).next_power_of_two(),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Returns an unmapped buffer to the ring.
    pub(crate) fn give(&self, buffer: wgpu::Buffer) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < RING_LIMIT {
            free.push(buffer);
        }
    }
}

/// One region being read back: `size` bytes at the start of a staging buffer.
pub(crate) struct Staged {
    pub(crate) buffer: Option<wgpu::Buffer>,
    pub(crate) size: u64,
}

/// The read-backs of a submitted step, in the order they were recorded. Dropping it
/// unread returns the staging buffers to the ring.
pub struct Submitted<'a> {
    pub(crate) ctx: &'a GpuContext,
    pub(crate) staged: Vec<Staged>,
}

impl Submitted<'_> {
    /// Waits for the step and returns the bytes of each read-back.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read(self) -> Result<Vec<Vec<u8>>> {
        pollster::block_on(self.read_async())
    }

    /// The read-backs, once the device has finished the step. Natively the device is polled
    /// until they are mapped; in a browser the future resolves when the page's event loop
    /// delivers the mappings, so it must be awaited, never blocked on.
    pub async fn read_async(mut self) -> Result<Vec<Vec<u8>>> {
        let staged = std::mem::take(&mut self.staged);
        let mut waits = Vec::with_capacity(staged.len());
        for s in &staged {
            let (tx, rx) = crate::oneshot::channel();
            if let Some(b) = &s.buffer {
                b.map_async(wgpu::MapMode::Read, ..s.size, move |r| tx.send(r));
            }
            waits.push(rx);
        }
        // Natively nothing drives the device but a poll; it runs the callbacks above.
        #[cfg(not(target_arch = "wasm32"))]
        self.ctx.wait_idle()?;
        let mut out = Vec::with_capacity(staged.len());
        let mut failure = None;
        for (s, rx) in staged.into_iter().zip(waits) {
            let Some(buffer) = s.buffer else { continue };
            let mapped = match rx.await {
                None => Err(GpuError::Readback(
                    "the mapping callback was dropped".into(),
                )),
                Some(r) => r.map_err(|e| GpuError::Readback(e.to_string())),
            };
            match mapped {
                Ok(()) => {
                    match buffer.get_mapped_range(..s.size) {
                        Ok(view) => {
                            self.ctx.host.count_read_back(s.size);
                            out.push(view.to_vec());
                        }
                        Err(e) => failure = Some(GpuError::Readback(e.to_string())),
                    }
                    buffer.unmap();
                    self.ctx.readback.give(buffer);
                }
                // A buffer whose mapping failed is not reused.
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        // An error in the work just read (recorded by the device's handler) makes the
        // bytes meaningless.
        self.ctx.check_faults()?;
        Ok(out)
    }
}

impl Drop for Submitted<'_> {
    fn drop(&mut self) {
        for s in self.staged.drain(..) {
            if let Some(b) = s.buffer {
                self.ctx.readback.give(b);
            }
        }
    }
}
