//! vLLM's metric names, beside `unmask_*`, with vLLM's meanings: what the routers built for
//! OpenAI-compatible servers read to balance load and to route by prefix (the SGLang model
//! gateway, vllm-router, the Kubernetes Gateway API inference extension's endpoint picker).
//!
//! - `vllm:num_requests_running`: requests in the forward batches (running members of the
//!   scheduler's sessions).
//! - `vllm:num_requests_waiting`: requests accepted and not yet running.
//! - `vllm:kv_cache_usage_perc`: 0 to 1, the K/V held (the running requests' arena rows and
//!   the prefix store's entries) over the K/V the server is configured for (the prefix
//!   store's byte budget and `--batch-rows` × `--max-solo` arena positions); 1 when over.
//! - `vllm:cache_config_info`: 1, with the cache's configuration as labels.
//! - `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`: prompt tokens
//!   looked up in the prefix store (BiCache prefixes and ACache spans) and the tokens
//!   found, counted when a request finishes.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// `vllm:cache_config_info`'s labels, named as vLLM's `CacheConfig` fields are.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheConfigLabels {
    /// Positions per K/V block: 1 (arenas are per position).
    pub block_size: String,
    pub cache_dtype: String,
    pub enable_prefix_caching: String,
    /// The K/V capacity in blocks (positions) that `kv_cache_usage_perc` is a share of.
    pub num_gpu_blocks: String,
}

/// The vLLM-named metrics, in a registry of their own (no `unmask_` prefix).
pub struct VllmMetrics {
    registry: Registry,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_cache_usage: Gauge<f64, AtomicU64>,
    pub cache_config: Family<CacheConfigLabels, Gauge>,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
}

impl VllmMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            registry: Registry::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_cache_usage: Gauge::default(),
            cache_config: Family::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
        };
        registry.register(
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            m.running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            m.waiting.clone(),
        );
        registry.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: 1 means 100 percent usage",
            m.kv_cache_usage.clone(),
        );
        registry.register(
            "vllm:cache_config_info",
            "Information of the KV cache configuration",
            m.cache_config.clone(),
        );
        registry.register(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            m.prefix_cache_queries.clone(),
        );
        registry.register(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            m.prefix_cache_hits.clone(),
        );
        Self { registry, ..m }
    }

    /// The prefix-store lookups of a finished generation, in tokens.
    pub fn record_finished(&self, g: &unmask::Generation) {
        if let Some(r) = g.bicache.as_ref().filter(|r| r.fallback.is_none()) {
            self.prefix_cache_queries.inc_by(r.entry_tokens as u64);
            if r.hit {
                self.prefix_cache_hits.inc_by(r.entry_tokens as u64);
            }
        }
        if let Some(r) = g.acache.as_ref().filter(|r| r.fallback.is_none()) {
            self.prefix_cache_queries.inc_by(r.span_tokens as u64);
            if r.hit {
                self.prefix_cache_hits.inc_by(r.span_tokens as u64);
            }
        }
    }

    /// Sets the configuration labels (once, when the server starts).
    pub fn set_cache_config(&self, labels: CacheConfigLabels) {
        self.cache_config.get_or_create(&labels).set(1);
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

impl Default for VllmMetrics {
    fn default() -> Self {
        Self::new()
    }
}
