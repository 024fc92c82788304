//! `/metrics`: Prometheus text exposition of what the server did and holds.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// ok, error (the engine's or the request's), cancelled (the client went away),
    /// rejected (queue full, bad request, unauthorized).
    pub outcome: &'static str,
}

/// The kind of session a step ran: with a shared prefix (BiCache) or without.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SessionKind {
    /// shared_prefix or no_prefix.
    pub session: &'static str,
}

/// Every metric, shared by the handlers and the scheduler (updates are atomic).
pub struct Metrics {
    registry: Registry,
    pub requests: Family<Outcome, Counter>,
    pub queue_depth: Gauge,
    pub running: Gauge,
    pub sessions: Gauge,
    /// Requests stepped together in one forward pass, by session kind.
    pub batch_size: Family<SessionKind, Histogram>,
    pub steps: Counter,
    pub completion_tokens: Counter,
    pub prompt_tokens: Counter,
    /// Completion tokens per second over the last window.
    pub tokens_per_second: Gauge<f64, AtomicU64>,
    pub bicache_hits: Counter,
    pub bicache_misses: Counter,
    pub bicache_fallbacks: Counter,
    pub acache_hits: Counter,
    pub acache_misses: Counter,
    pub acache_fallbacks: Counter,
    pub acache_anchors: Counter,
    pub acache_span_tokens: Counter,
    /// dLLM-Cache forwards by what they did with the response.
    pub dllm_refreshes: Counter,
    pub dllm_verify_steps: Counter,
    /// Rows × layers a dLLM-Cache request ran attention and the MLP for, and V-verified.
    pub dllm_computed_row_layers: Counter,
    pub dllm_verified_row_layers: Counter,
    pub store_bytes: Gauge,
    pub store_entries: Gauge,
    pub store_pins: Gauge,
    pub gpu_memory_bytes: Gauge,
    /// Most canvases one DiffusionGemma decoder pass takes (0: no limit).
    pub pass_limit: Gauge,
    /// vLLM's names for what routers read (`vllm_metrics`).
    pub vllm: crate::vllm_metrics::VllmMetrics,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("unmask");
        let m = Self {
            requests: Family::default(),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            sessions: Gauge::default(),
            batch_size: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(1.0, 2.0, 8))
            }),
            steps: Counter::default(),
            completion_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            tokens_per_second: Gauge::default(),
            bicache_hits: Counter::default(),
            bicache_misses: Counter::default(),
            bicache_fallbacks: Counter::default(),
            acache_hits: Counter::default(),
            acache_misses: Counter::default(),
            acache_fallbacks: Counter::default(),
            acache_anchors: Counter::default(),
            acache_span_tokens: Counter::default(),
            dllm_refreshes: Counter::default(),
            dllm_verify_steps: Counter::default(),
            dllm_computed_row_layers: Counter::default(),
            dllm_verified_row_layers: Counter::default(),
            store_bytes: Gauge::default(),
            store_entries: Gauge::default(),
            store_pins: Gauge::default(),
            gpu_memory_bytes: Gauge::default(),
            pass_limit: Gauge::default(),
            vllm: crate::vllm_metrics::VllmMetrics::new(),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "Generation requests by outcome",
            m.requests.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests accepted and not yet running",
            m.queue_depth.clone(),
        );
        registry.register("running_requests", "Requests running", m.running.clone());
        registry.register(
            "batch_sessions",
            "Sessions (one per shared prefix and depth, and those without a prefix)",
            m.sessions.clone(),
        );
        registry.register(
            "batch_size",
            "Requests run in one forward pass, by session kind",
            m.batch_size.clone(),
        );
        registry.register(
            "steps",
            "Denoising steps run (one per forward pass of a batch or request)",
            m.steps.clone(),
        );
        registry.register(
            "completion_tokens",
            "Answer tokens generated",
            m.completion_tokens.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of finished requests",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "tokens_per_second",
            "Answer tokens per second over the last 10 s",
            m.tokens_per_second.clone(),
        );
        registry.register(
            "bicache_hits",
            "BiCache requests whose prefix entry was stored",
            m.bicache_hits.clone(),
        );
        registry.register(
            "bicache_misses",
            "BiCache requests that built their prefix entry",
            m.bicache_misses.clone(),
        );
        registry.register(
            "bicache_fallbacks",
            "BiCache requests that ran without the shared entry",
            m.bicache_fallbacks.clone(),
        );
        registry.register(
            "acache_hits",
            "ACache requests whose span entry was stored",
            m.acache_hits.clone(),
        );
        registry.register(
            "acache_misses",
            "ACache requests that built their span entry",
            m.acache_misses.clone(),
        );
        registry.register(
            "acache_fallbacks",
            "ACache requests that ran without a shared span (as fast-dllm-dual)",
            m.acache_fallbacks.clone(),
        );
        registry.register(
            "acache_anchors",
            "Span tokens ACache recomputed with their request (anchors)",
            m.acache_anchors.clone(),
        );
        registry.register(
            "acache_span_tokens",
            "Span tokens of ACache requests (anchors and reused tokens)",
            m.acache_span_tokens.clone(),
        );
        for (name, help, counter) in [
            (
                "dllm_cache_response_refreshes",
                "dLLM-Cache forwards that recomputed the whole response",
                &m.dllm_refreshes,
            ),
            (
                "dllm_cache_verify_steps",
                "dLLM-Cache forwards that V-verified the response",
                &m.dllm_verify_steps,
            ),
            (
                "dllm_cache_computed_row_layers",
                "Rows x layers dLLM-Cache requests ran attention and the MLP for",
                &m.dllm_computed_row_layers,
            ),
            (
                "dllm_cache_verified_row_layers",
                "Response rows x layers dLLM-Cache requests V-verified",
                &m.dllm_verified_row_layers,
            ),
        ] {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "prefix_store_bytes",
            "GPU bytes held by the shared prefix store",
            m.store_bytes.clone(),
        );
        registry.register(
            "prefix_store_entries",
            "Entries in the shared prefix store",
            m.store_entries.clone(),
        );
        registry.register(
            "prefix_store_pins",
            "Pins held on prefix entries",
            m.store_pins.clone(),
        );
        registry.register(
            "gpu_memory_bytes",
            "GPU memory held by the engine",
            m.gpu_memory_bytes.clone(),
        );
        registry.register(
            "decoder_pass_limit",
            "Most requests one DiffusionGemma decoder pass takes, lowered while a larger batch \
             does not fit in GPU memory (0: no limit)",
            m.pass_limit.clone(),
        );
        Self { registry, ..m }
    }

    /// A finished generation's tokens and what the shared caches did for it (BiCache's
    /// prefix entry, ACache's span entry and anchors).
    pub fn record_finished(&self, g: &unmask::Generation) {
        self.vllm.record_finished(g);
        self.completion_tokens
            .inc_by(g.timings.answer_tokens as u64);
        // An infilling suffix is input too.
        self.prompt_tokens
            .inc_by((g.prompt_ids.len() + g.suffix_len) as u64);
        if let Some(r) = &g.bicache {
            if r.fallback.is_some() {
                self.bicache_fallbacks.inc();
            } else if r.hit {
                self.bicache_hits.inc();
            } else {
                self.bicache_misses.inc();
            }
        }
        if let Some(r) = &g.acache {
            if r.fallback.is_some() {
                self.acache_fallbacks.inc();
            } else {
                if r.hit {
                    self.acache_hits.inc();
                } else {
                    self.acache_misses.inc();
                }
                self.acache_anchors.inc_by(r.anchors.len() as u64);
                self.acache_span_tokens.inc_by(r.span_tokens as u64);
            }
        }
        if let Some(r) = &g.adaptive {
            self.dllm_refreshes.inc_by(r.response_refreshes as u64);
            self.dllm_verify_steps.inc_by(r.verify_steps as u64);
            let t = &g.timings;
            self.dllm_computed_row_layers
                .inc_by(t.token_layer_passes as u64);
            self.dllm_verified_row_layers
                .inc_by(t.verified_row_layers as u64);
        }
    }

    pub fn count(&self, outcome: &'static str) {
        self.requests.get_or_create(&Outcome { outcome }).inc();
    }

    pub fn encode(&self) -> String {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry)
            .and_then(|()| encode_registry(&mut out, self.vllm.registry()))
            .and_then(|()| encode_eof(&mut out));
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
