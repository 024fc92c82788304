//! Whole requests through every cache mode and decoding rule, on a workload of shared
//! system prompts made of token ids; BiCache requests served one at a time or in batches
//! (`serve_continuously`).

use std::time::Instant;

use serde_json::{Value, json};
use unmask::{CacheMode, Engine, EngineError, Generation, GenerationParams, Request};
use unmask_core::rng::SplitMix64;

use crate::env::with_envelope;
use crate::timing::{median, round3};

/// A workload of shared system prompts made of token ids: `groups` prefixes of
/// `prefix_tokens` ids, each followed by `per_group` different user turns of `user_tokens`
/// ids. Ids are drawn from the seed among ordinary tokens (never a special id), so the
/// workload needs no tokenizer and fits any checkpoint, synthetic ones included.
#[derive(Clone, Debug)]
pub struct Workload {
    pub groups: usize,
    pub per_group: usize,
    pub prefix_tokens: usize,
    pub user_tokens: usize,
    pub seed: u64,
}

/// One request of a workload: its ids and the length of its shared prefix.
#[derive(Clone, Debug)]
pub struct WorkloadRequest {
    pub group: usize,
    pub ids: Vec<u32>,
    pub prefix_len: usize,
}

impl Workload {
    /// The requests, group by group. `ordinary` is how many leading ids are ordinary
    /// tokens (the tokenizer's vocabulary without its special tokens, or the config's
    /// vocabulary less a margin for a checkpoint without tokenizer); `avoid` are ids never
    /// drawn (mask, EOS, ...).
    pub fn requests(&self, ordinary: u32, avoid: &[u32]) -> Vec<WorkloadRequest> {
        let mut rng = SplitMix64(self.seed ^ 0x5EED_B0A7);
        let mut draw = |n: usize| -> Vec<u32> {
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let id = (rng.next_u64() % u64::from(ordinary.max(1))) as u32;
                if !avoid.contains(&id) {
                    out.push(id);
                }
            }
            out
        };
        let mut out = Vec::new();
        for group in 0..self.groups {
            let prefix = draw(self.prefix_tokens);
            for _ in 0..self.per_group {
                let mut ids = prefix.clone();
                ids.extend(draw(self.user_tokens));
                out.push(WorkloadRequest {
                    group,
                    ids,
                    prefix_len: self.prefix_tokens,
                });
            }
        }
        out
    }
}

/// Decoding rule of a request benchmark.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decoding {
    /// A fixed number of tokens per step (gen_length / steps).
    Quota,
    /// Fast-dLLM's confidence threshold.
    Threshold(f32),
}

impl Decoding {
    pub fn name(self) -> &'static str {
        match self {
            Decoding::Quota => "quota",
            Decoding::Threshold(_) => "threshold",
        }
    }
}

/// What a request benchmark runs.
#[derive(Clone, Debug)]
pub struct RequestBenchOptions {
    pub params: GenerationParams,
    pub modes: Vec<CacheMode>,
    pub decodings: Vec<Decoding>,
    /// BiCache refresh period (steps) for single-block requests.
    pub refresh_every: usize,
    /// BiCache depth; `None` uses the model's table, else half the layers.
    pub depth: Option<usize>,
    /// Requests in the batch at once: above 1, BiCache requests that share a prefix are
    /// served by a `Session` (`serve_continuously`). Sizes above 1 run only for
    /// BiCache modes (the others would run one after another anyway).
    pub batches: Vec<usize>,
}

/// Serves BiCache `requests` the way a server would: one `Session` per run of
/// consecutive requests with the same shared prefix, all submitted at once, at most
/// `concurrent` of them in the batch at a time (a finished request's place goes to the next
/// at once). The session's depth is the smallest its requests ask for. Also returns the
/// token-layer passes the sessions spent building prefix entries.
pub fn serve_continuously(
    engine: &Engine,
    requests: &[Request],
    concurrent: usize,
) -> Result<(Vec<Generation>, usize), EngineError> {
    // Each request's shared prefix, its depth and its positions, worked out once.
    let plans = requests
        .iter()
        .map(|r| {
            let key = engine.shared_prefix(r)?;
            let len = engine.encode_prompt(&r.prompt)?.len() + r.params.gen_length;
            Ok((key.tokens, key.depth, len))
        })
        .collect::<Result<Vec<_>, EngineError>>()?;
    let mut entry_passes = 0;
    let mut out: Vec<Option<Generation>> = requests.iter().map(|_| None).collect();
    let mut start = 0;
    while start < requests.len() {
        let prefix = &plans[start].0;
        let end = start + plans[start..].iter().take_while(|p| &p.0 == prefix).count();
        let group = &plans[start..end];
        let depth = group.iter().map(|p| p.1).min().unwrap_or(0);
        let longest = group.iter().map(|p| p.2).max().unwrap_or(0);
        let rows = (concurrent * longest).min(engine.model().max_state_rows());
        let key = unmask::PrefixKey {
            tokens: prefix.clone(),
            depth,
        };
        let mut session = engine.session(Some(&key), rows)?;
        entry_passes += session.entry_token_layer_passes();
        let mut slot = std::collections::HashMap::new();
        for (i, r) in requests.iter().enumerate().take(end).skip(start) {
            slot.insert(session.submit(r.clone())?, i);
        }
        while !session.is_idle() {
            for (id, g) in session.step() {
                if let Some(&i) = slot.get(&id) {
                    out[i] = Some(g?);
                }
            }
        }
        start = end;
    }
    let generations = out
        .into_iter()
        .map(|g| g.ok_or_else(|| EngineError::Internal("a request did not finish".into())))
        .collect::<Result<_, _>>()?;
    Ok((generations, entry_passes))
}

/// Runs `requests` through every (mode, decoding): one warm-up request on a prefix of its
/// own first (compiles pipelines; not counted), the shared prefix store emptied before each
/// mode so BiCache starts cold, then every request in order. Returns one record per
/// (mode, decoding).
pub fn run_request_bench(
    engine: &Engine,
    envelope: &Value,
    workload: &Workload,
    requests: &[WorkloadRequest],
    warmup: &WorkloadRequest,
    options: &RequestBenchOptions,
    on_record: &mut dyn FnMut(&Value),
) -> Result<Vec<Value>, EngineError> {
    let depth = options.depth.or_else(|| {
        engine
            .depth_table()
            .is_none()
            .then_some(engine.config().n_layers / 2)
    });
    let mut records = Vec::new();
    for &decoding in &options.decodings {
        for &mode in &options.modes {
            let mut params = options.params.clone();
            params.threshold = match decoding {
                Decoding::Quota => None,
                Decoding::Threshold(t) => Some(t),
            };
            let make = |r: &WorkloadRequest| {
                let mut req = Request::ids(r.ids.clone())
                    .with_params(params.clone())
                    .with_cache(mode);
                req.prefix_len = Some(r.prefix_len);
                req.refresh_every = options.refresh_every;
                req.depth = depth;
                // ACache's span: the shared system prompt after its first token (so that the
                // span is placed at an offset, as a span after a preamble is).
                if mode == CacheMode::Acache && r.prefix_len > 1 {
                    req.span = Some(unmask::Span::Tokens(1..r.prefix_len));
                }
                req
            };
            engine.generate(&make(warmup))?;
            for &batch in &options.batches {
                if batch > 1 && !mode.is_bicache() {
                    continue;
                }
                engine.clear_prefix_store();
                let before = engine.prefix_store_stats();
                engine.ctx().memory.reset_peak();
                let (mut totals, mut ttft, mut nfe, mut tlp) =
                    (Vec::new(), Vec::new(), 0usize, 0usize);
                let (mut canvas_tokens, mut answer_tokens) = (0usize, 0usize);
                let mut depths = Vec::new();
                let mut fallbacks = 0usize;
                let began = Instant::now();
                let all: Vec<Request> = requests.iter().map(make).collect();
                let generations = if batch > 1 {
                    let (generations, entry_passes) = serve_continuously(engine, &all, batch)?;
                    tlp += entry_passes;
                    generations
                } else {
                    let mut out = Vec::with_capacity(all.len());
                    for r in &all {
                        out.push(engine.generate(r)?);
                    }
                    out
                };
                for g in generations {
                    let t = &g.timings;
                    totals.push(t.total_s);
                    ttft.push(t.first_step_s);
                    nfe += t.forward_passes;
                    tlp += t.token_layer_passes;
                    canvas_tokens += g.ids.len();
                    answer_tokens += t.answer_tokens;
                    if let Some(b) = &g.bicache {
                        if b.fallback.is_some() {
                            fallbacks += 1;
                        } else {
                            depths.push(b.depth as f64);
                        }
                    }
                    if g.acache.as_ref().is_some_and(|a| a.fallback.is_some()) {
                        fallbacks += 1;
                    }
                }
                let wall = began.elapsed().as_secs_f64();
                let after = engine.prefix_store_stats();
                let n = requests.len().max(1) as f64;
                let bicache = mode.is_bicache();
                let fields = json!({
                    "record": "request",
                    "cache": mode.name(),
                    "decoding": decoding.name(),
                    "threshold": params.threshold,
                    "gen_length": params.gen_length,
                    "steps": params.steps,
                    "block_length": params.block_length,
                    "batch": batch,
                    "requests": requests.len(),
                    "groups": workload.groups,
                    "prefix_tokens": workload.prefix_tokens,
                    "user_tokens": workload.user_tokens,
                    "wall_s": round3(wall),
                    "throughput_canvas": round3(canvas_tokens as f64 / wall),
                    "throughput_answer": round3(answer_tokens as f64 / wall),
                    "request_s_median": round3(median(totals) * 1e3) / 1e3,
                    "ttft_s": round3(median(ttft) * 1e3) / 1e3,
                    "nfe": round3(nfe as f64 / n),
                    "token_layer_passes": round3(tlp as f64 / n),
                    "bicache_hits": bicache.then_some(after.hits - before.hits),
                    "bicache_misses": bicache.then_some(after.misses - before.misses),
                    "bicache_fallbacks": bicache.then_some(fallbacks),
                    "acache_fallbacks": (mode == CacheMode::Acache).then_some(fallbacks),
                    "bicache_depth": if bicache && !depths.is_empty() { Some(median(depths)) } else { None },
                    "cache_bytes": after.bytes,
                    "gpu_weights_bytes": engine.model().weights.size_bytes(),
                    "gpu_peak_bytes": engine.ctx().memory.peak_bytes(),
                });
                let record = with_envelope(envelope, fields);
                on_record(&record);
                records.push(record);
            }
        }
    }
    engine.clear_prefix_store();
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_shares_prefixes_within_a_group_and_avoids_special_ids() {
        let w = Workload {
            groups: 2,
            per_group: 3,
            prefix_tokens: 20,
            user_tokens: 5,
            seed: 7,
        };
        let reqs = w.requests(50, &[3, 4]);
        assert_eq!(reqs.len(), 6);
        assert!(reqs.iter().all(|r| r.ids.len() == 25 && r.prefix_len == 20));
        assert_eq!(reqs[0].ids[..20], reqs[2].ids[..20]);
        assert_ne!(reqs[0].ids[..20], reqs[3].ids[..20]);
        assert_ne!(reqs[0].ids[20..], reqs[1].ids[20..]);
        assert!(
            reqs.iter()
                .flat_map(|r| &r.ids)
                .all(|&id| id < 50 && id != 3 && id != 4)
        );
        let again = w.requests(50, &[3, 4]);
        assert_eq!(again[5].ids, reqs[5].ids);
    }
}
