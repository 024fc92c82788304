//! Bind groups built once per (kernel, parameter buffer, storage buffer set) and reused by
//! every later step: a steady-state step creates none. Parameters sit behind a dynamic
//! offset, so the same group serves every step whatever its parameter values.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::Binding;
use crate::pipeline::ComputeKernel;

/// Ids of buffers dropped since the cache last looked: their groups are forgotten at the
/// next submit.
#[derive(Debug, Default)]
pub(crate) struct DroppedBuffers(Mutex<Vec<u64>>);

impl DroppedBuffers {
    pub(crate) fn note(&self, id: u64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(id);
    }

    fn take(&self) -> Vec<u64> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct BindKey {
    kernel: u64,
    /// Generation of the parameter buffer (it is replaced when a step outgrows it).
    params: u64,
    params_len: u64,
    /// (buffer id, offset, size or 0 for the whole buffer) per storage binding.
    buffers: Vec<(u64, u64, u64)>,
}

#[derive(Default)]
pub(crate) struct BindGroupCache {
    groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    pub(crate) dropped: Arc<DroppedBuffers>,
}

impl BindGroupCache {
    /// Forgets the groups of dropped buffers (or every group, when the parameter buffer
    /// was replaced).
    pub(crate) fn purge(&self, everything: bool) {
        let dead = self.dropped.take();
        if dead.is_empty() && !everything {
            return;
        }
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if everything {
            groups.clear();
            return;
        }
        groups.retain(|k, _| !k.buffers.iter().any(|b| dead.contains(&b.0)));
    }

    /// Groups held now.
    pub(crate) fn len(&self) -> usize {
        self.groups.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The group binding `params` (at a dynamic offset) and `bindings` for `kernel`.
    pub(crate) fn get(
        &self,
        device: &wgpu::Device,
        host: &HostCounters,
        kernel: &ComputeKernel,
        params: (&wgpu::Buffer, u64),
        params_len: u64,
        bindings: &[Binding],
    ) -> wgpu::BindGroup {
        let key = BindKey {
            kernel: kernel.id,
            params: params.1,
            params_len,
            buffers: bindings
                .iter()
                .map(|b| (b.buffer.id(), b.offset, b.size.map_or(0, NonZeroU64::get)))
                .collect(),
        };
        let mut groups = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(g) = groups.get(&key) {
            return g.clone();
        }
        let mut entries = Vec::with_capacity(bindings.len() + 1);
        entries.push(wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: params.0,
                offset: 0,
                size: NonZeroU64::new(params_len),
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
        let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &kernel.layout,
            entries: &entries,
        });
        host.bind_groups.fetch_add(1, Ordering::Relaxed);
        groups.insert(key, group.clone());
        group
    }
}

/// What the host has done on the device since the context was made: a steady-state step
/// adds one submit and its dispatches, and nothing else.
#[derive(Debug, Default)]
pub struct HostCounters {
    submits: AtomicU64,
    dispatches: AtomicU64,
    bind_groups: AtomicU64,
    buffers: AtomicU64,
    staging_buffers: AtomicU64,
    bytes_read_back: AtomicU64,
}

/// A reading of `HostCounters`; subtract two to count what happened in between.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCounts {
    pub submits: u64,
    pub dispatches: u64,
    pub bind_groups_created: u64,
    /// Storage buffers created.
    pub buffers_created: u64,
    /// Read-back (map-read) buffers created.
    pub staging_buffers_created: u64,
    /// Bytes copied back to the host.
    pub bytes_read_back: u64,
}

impl std::ops::Sub for HostCounts {
    type Output = HostCounts;
    fn sub(self, o: HostCounts) -> HostCounts {
        HostCounts {
            submits: self.submits - o.submits,
            dispatches: self.dispatches - o.dispatches,
            bind_groups_created: self.bind_groups_created - o.bind_groups_created,
            buffers_created: self.buffers_created - o.buffers_created,
            staging_buffers_created: self.staging_buffers_created - o.staging_buffers_created,
            bytes_read_back: self.bytes_read_back - o.bytes_read_back,
        }
    }
}

impl HostCounters {
    pub fn snapshot(&self) -> HostCounts {
        HostCounts {
            submits: self.submits.load(Ordering::Relaxed),
            dispatches: self.dispatches.load(Ordering::Relaxed),
            bind_groups_created: self.bind_groups.load(Ordering::Relaxed),
            buffers_created: self.buffers.load(Ordering::Relaxed),
            staging_buffers_created: self.staging_buffers.load(Ordering::Relaxed),
            bytes_read_back: self.bytes_read_back.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn count_buffer(&self) {
        self.buffers.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_staging(&self) {
        self.staging_buffers.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_read_back(&self, bytes: u64) {
        self.bytes_read_back.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn count_submit(&self, dispatches: usize) {
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.dispatches
            .fetch_add(dispatches as u64, Ordering::Relaxed);
    }
}
