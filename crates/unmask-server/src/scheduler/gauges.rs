//! The scheduler's view published on `/metrics`: the `unmask_*` gauges, vLLM's names
//! (`crate::vllm_metrics`) and the prefix store's changes for the KV-event publisher,
//! updated after every round and when the engine goes idle.

use std::sync::atomic::Ordering;

use super::Scheduler;

impl Scheduler<'_> {
    /// `vllm:cache_config_info`'s labels, once at start.
    pub(super) fn publish_cache_config(&self) {
        let model = self.engine.model();
        let per_position = model.kv_bytes(1).max(1);
        self.shared
            .metrics
            .vllm
            .set_cache_config(crate::vllm_metrics::CacheConfigLabels {
                block_size: "1".into(),
                cache_dtype: format!("{:?}", model.kv_dtype).to_lowercase(),
                enable_prefix_caching: "True".into(),
                num_gpu_blocks: (self.kv_capacity_bytes() / per_position).to_string(),
            });
    }

    pub(super) fn update_gauges(&mut self) {
        if let Some(tx) = &self.config.kv_events {
            let changes = self.engine.take_store_events();
            if !changes.is_empty() {
                let _ = tx.send(changes);
            }
        }
        let m = &self.shared.metrics;
        m.tokens_per_second.set(self.recent.per_second());
        let running: usize = self.slots.iter().map(|s| s.session.running()).sum();
        let queued = self.shared.queued.load(Ordering::Relaxed) as i64;
        m.queue_depth.set(queued);
        m.running.set(running as i64);
        m.sessions.set(self.slots.len() as i64);
        let stats = self.engine.prefix_store_recount();
        m.store_bytes.set(stats.bytes as i64);
        m.store_entries.set(stats.entries as i64);
        m.store_pins.set(stats.pins as i64);
        m.gpu_memory_bytes
            .set(self.engine.ctx().memory.live_bytes() as i64);
        let v = &m.vllm;
        v.running.set(running as i64);
        v.waiting.set(queued);
        let positions: usize = self
            .slots
            .iter()
            .map(|s| s.session.running_positions())
            .sum();
        let model = self.engine.model();
        let held = model.kv_bytes(positions) + stats.bytes;
        let capacity = self.kv_capacity_bytes().max(1);
        v.kv_cache_usage
            .set((held as f64 / capacity as f64).min(1.0));
    }

    /// The K/V the server is configured for: the prefix store's byte budget and the arena
    /// rows of `max_solo` sessions of `batch_rows` positions.
    pub fn kv_capacity_bytes(&self) -> u64 {
        let rows = self.config.batch_rows * self.config.max_solo.max(1);
        let store = self.engine.prefix_store_budget().max_bytes;
        self.engine.model().kv_bytes(rows).saturating_add(store)
    }
}
