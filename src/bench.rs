//! Benchmarks shared by `unmask bench` and `cargo bench`: the kernels at a model's real
//! shapes, and whole requests through every cache mode on a workload of shared system
//! prompts.
//!
//! Every figure is one JSON object (a "record") carrying the environment it was measured in
//! (adapter, backend, driver, commit, model), so files from several machines can be merged
//! by `unmask bench-report`. Timings are medians after a warm-up run; variants of one
//! measurement run back to back in the same process, so their ratios are meaningful even on
//! a noisy machine.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use unmask_core::config::LladaConfig;
use unmask_core::rng::SplitMix64;
use unmask_gpu::ops::attention::{AttentionShape, KvSegment, attention};
use unmask_gpu::ops::matmul::{MatmulKernel, matmul};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

use crate::{CacheMode, Engine, EngineError, Generation, GenerationParams, Request};

/// How long one measurement may take: at least `min_runs` timed runs, then more until
/// `max_runs` or `budget` is reached.
#[derive(Clone, Copy, Debug)]
pub struct Repeats {
    pub min_runs: usize,
    pub max_runs: usize,
    pub budget: Duration,
}

impl Default for Repeats {
    fn default() -> Self {
        Self {
            min_runs: 3,
            max_runs: 15,
            budget: Duration::from_millis(1500),
        }
    }
}

/// Median and fastest of several timed runs, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub median_ms: f64,
    pub min_ms: f64,
    pub runs: usize,
}

/// Times `record` + submit + device wait: one untimed warm-up run (it also compiles the
/// pipelines), then `repeats`.
pub fn time_step(
    ctx: &GpuContext,
    repeats: Repeats,
    mut record: impl FnMut(&mut StepEncoder) -> unmask_gpu::Result<()>,
) -> unmask_gpu::Result<Sample> {
    let mut run = || -> unmask_gpu::Result<f64> {
        let mut step = StepEncoder::new(ctx, "bench");
        record(&mut step)?;
        let start = Instant::now();
        step.submit()?;
        ctx.wait_idle()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    run()?;
    let mut times = Vec::new();
    let began = Instant::now();
    while times.len() < repeats.min_runs.max(1)
        || (times.len() < repeats.max_runs && began.elapsed() < repeats.budget)
    {
        times.push(run()?);
    }
    times.sort_by(f64::total_cmp);
    Ok(Sample {
        median_ms: times[times.len() / 2],
        min_ms: times[0],
        runs: times.len(),
    })
}

/// Deterministic values in [-scale, scale), never zero.
pub fn pseudo_random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| {
            let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
            let v = (u * 2.0 - 1.0) * scale;
            if v == 0.0 { scale * 1e-3 } else { v }
        })
        .collect()
}

/// Peak arithmetic and memory throughput of an adapter, for the "share of peak" figures.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    pub gflops: Option<f64>,
    pub gbs: Option<f64>,
    /// Where the figures come from (a datasheet, or the command line).
    pub source: String,
}

/// Datasheet peaks of adapters the benchmarks were run on. The kernels use no tensor
/// cores (WGSL has no matrix instructions yet), so the arithmetic peak is the FP32
/// vector rate; memory is the HBM bandwidth. Figures from NVIDIA's H100/H200 datasheets
/// (SXM parts).
pub fn known_peak(adapter: &str) -> Option<Peak> {
    let name = adapter.to_ascii_uppercase();
    let (gflops, gbs, part) = if name.contains("H200") {
        (
            67_000.0,
            4_800.0,
            "NVIDIA H200 SXM datasheet: 67 TFLOP/s FP32, 4.8 TB/s",
        )
    } else if name.contains("H100") {
        (
            67_000.0,
            3_350.0,
            "NVIDIA H100 SXM datasheet: 67 TFLOP/s FP32, 3.35 TB/s",
        )
    } else {
        return None;
    };
    Some(Peak {
        gflops: Some(gflops),
        gbs: Some(gbs),
        source: part.to_string(),
    })
}

/// The commit the binary was built from: `UNMASK_COMMIT` at build or run time, else
/// `git rev-parse` in the source tree, else "unknown".
pub fn commit() -> String {
    if let Ok(c) = std::env::var("UNMASK_COMMIT") {
        if !c.is_empty() {
            return c;
        }
    }
    if let Some(c) = option_env!("UNMASK_COMMIT") {
        return c.to_string();
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// The environment every record carries.
pub fn envelope(ctx: &GpuContext, model_name: &str, cfg: &LladaConfig, weights: &str) -> Value {
    json!({
        "unmask": env!("CARGO_PKG_VERSION"),
        "commit": commit(),
        "adapter": ctx.info.name,
        "backend": format!("{:?}", ctx.info.backend),
        "device_type": format!("{:?}", ctx.info.device_type),
        "driver": format!("{} {}", ctx.info.driver, ctx.info.driver_info).trim().to_string(),
        "shader_f16": ctx.features.shader_f16,
        "subgroups": ctx.features.subgroups,
        "model": {
            "name": model_name,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "mlp_hidden_size": cfg.mlp_hidden_size,
            "vocab_size": cfg.vocab_size,
            "params": cfg.parameter_count(),
        },
        "weights": weights,
    })
}

/// `envelope` with the record's own fields added (theirs win on a name clash).
fn with_envelope(envelope: &Value, fields: Value) -> Value {
    let mut out: Map<String, Value> = envelope.as_object().cloned().unwrap_or_default();
    if let Value::Object(f) = fields {
        out.extend(f);
    }
    Value::Object(out)
}

fn round3(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

/// One kernel measurement at a model shape.
#[derive(Clone, Debug, PartialEq)]
pub enum KernelCase {
    /// `y[m, n] = x[m, k] · W[n, k]ᵀ`; `case` names the layer it stands for.
    Matmul {
        case: &'static str,
        m: usize,
        n: usize,
        k: usize,
    },
    /// `lq` query rows over `lkv` keys; `split` puts half the keys in segment A, the
    /// BiCache layout.
    Attention {
        lq: usize,
        lkv: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        split: bool,
    },
}

/// Most host memory one kernel case may build its random inputs in: above LLaDA-8B's
/// largest case (the LM head, 126464 x 4096 floats = 2 GiB).
pub const MAX_CASE_HOST_BYTES: u64 = 4 << 30;

impl KernelCase {
    /// Host bytes of the case's random inputs (weights and activations as f32).
    pub fn host_bytes(&self) -> u64 {
        let floats = match *self {
            KernelCase::Matmul { m, n, k, .. } => (m as u64) * (k as u64) + (n as u64) * (k as u64),
            KernelCase::Attention {
                lq,
                lkv,
                heads,
                kv_heads,
                head_dim,
                ..
            } => {
                let q = (lq as u64) * (heads as u64) * (head_dim as u64);
                q + 2 * (lkv as u64) * (kv_heads as u64) * (head_dim as u64)
            }
        };
        floats.saturating_mul(4)
    }

    pub fn name(&self) -> &'static str {
        match self {
            KernelCase::Matmul { case, .. } => case,
            KernelCase::Attention { .. } => "attention",
        }
    }
}

/// The matmuls of one layer and the LM head, for each row count in `rows` (the rows a step
/// computes: a block under a dual cache, the whole sequence without a cache), and the
/// attention of those rows over `kv_lens` keys.
pub fn model_kernel_cases(cfg: &LladaConfig, rows: &[usize], kv_lens: &[usize]) -> Vec<KernelCase> {
    let d = cfg.d_model;
    let hd = d / cfg.n_heads;
    let kv = cfg.n_kv_heads * hd;
    let mut cases = Vec::new();
    for &m in rows {
        for (case, n, k) in [
            ("qkv", d + 2 * kv, d),
            ("attn_out", d, d),
            ("gate_up", 2 * cfg.mlp_hidden_size, d),
            ("ff_out", d, cfg.mlp_hidden_size),
            ("lm_head", cfg.embedding_size, d),
        ] {
            cases.push(KernelCase::Matmul { case, m, n, k });
        }
        for &lkv in kv_lens {
            for split in [false, true] {
                cases.push(KernelCase::Attention {
                    lq: m,
                    lkv,
                    heads: cfg.n_heads,
                    kv_heads: cfg.n_kv_heads,
                    head_dim: hd,
                    split,
                });
            }
        }
    }
    cases
}

/// What to measure for each kernel case.
#[derive(Clone, Debug)]
pub struct KernelBenchOptions {
    /// Weight formats to try (resolved against the device: native f16 falls back to packed).
    pub formats: Vec<WeightFormat>,
    /// Also time every concrete matmul kernel, not only the one `Auto` picks.
    pub all_variants: bool,
    pub repeats: Repeats,
    pub peak: Option<Peak>,
}

/// A kernel record: the case's own fields, then the timing figures shared by every kernel
/// (median and fastest run, GFLOP/s and GB/s from the work done) and the shares of the
/// adapter's peak when it is known.
fn kernel_record(
    envelope: &Value,
    case_fields: Value,
    sample: Sample,
    flops: f64,
    bytes: f64,
    peak: &Option<Peak>,
) -> Value {
    let gflops = flops / (sample.median_ms * 1e6);
    let gbs = bytes / (sample.median_ms * 1e6);
    let mut fields = case_fields;
    if let Value::Object(f) = &mut fields {
        f.insert("record".into(), json!("kernel"));
        f.insert("ms".into(), json!(round3(sample.median_ms)));
        f.insert("ms_min".into(), json!(round3(sample.min_ms)));
        f.insert("runs".into(), json!(sample.runs));
        f.insert("gflops".into(), json!(round3(gflops)));
        f.insert("gbs".into(), json!(round3(gbs)));
        if let Some(p) = peak {
            if let Some(g) = p.gflops {
                f.insert(
                    "peak_gflops_share".into(),
                    json!(round3(gflops / g * 1e3) / 1e3),
                );
            }
            if let Some(b) = p.gbs {
                f.insert("peak_gbs_share".into(), json!(round3(gbs / b * 1e3) / 1e3));
            }
        }
    }
    with_envelope(envelope, fields)
}

/// Runs one case; returns one record per (format, variant). `on_record` sees each record
/// as soon as it is measured (for streaming output).
pub fn run_kernel_case(
    ctx: &GpuContext,
    envelope: &Value,
    case: &KernelCase,
    options: &KernelBenchOptions,
    on_record: &mut dyn FnMut(&Value),
) -> unmask_gpu::Result<Vec<Value>> {
    let host = case.host_bytes();
    if host > MAX_CASE_HOST_BYTES {
        return Err(unmask_gpu::GpuError::Shape {
            op: "a bench kernel case",
            expected: format!("random inputs of at most {MAX_CASE_HOST_BYTES} host bytes"),
            found: format!("{host} bytes for {case:?}"),
        });
    }
    let mut records = Vec::new();
    let mut emit = |r: Value| {
        on_record(&r);
        records.push(r);
    };
    match *case {
        KernelCase::Matmul { case, m, n, k } => {
            let x = Tensor::from_f32(ctx, &[m, k], &pseudo_random(1, m * k, 1.0), "bench.x")?;
            let y = Tensor::zeros(ctx, DType::F32, &[m, n], "bench.y")?;
            let w_data = pseudo_random(2, n * k, 0.05);
            let mut seen = Vec::new();
            for &requested in &options.formats {
                let format = requested.resolve(ctx);
                if seen.contains(&format) {
                    continue;
                }
                seen.push(format);
                let w = Weight::from_f32(ctx, n, k, &w_data, format, "bench.w")?;
                let variants: Vec<MatmulKernel> = if options.all_variants {
                    MatmulKernel::CONCRETE
                        .into_iter()
                        .chain([MatmulKernel::Auto])
                        .collect()
                } else {
                    vec![MatmulKernel::Auto]
                };
                for kernel in variants {
                    let s = time_step(ctx, options.repeats, |step| {
                        matmul(step, &x, &w, &y, m, kernel)
                    })?;
                    let flops = 2.0 * (m * n * k) as f64;
                    let bytes = w.size_bytes() as f64 + 4.0 * (m * k + m * n) as f64;
                    let variant = if kernel == MatmulKernel::Auto {
                        format!("auto:{}", kernel.plan(ctx, m, format).0.name())
                    } else {
                        kernel.name().to_string()
                    };
                    let fields = json!({
                        "kernel": "matmul",
                        "case": case,
                        "variant": variant,
                        "format": format.name(),
                        "m": m, "n": n, "k": k,
                    });
                    emit(kernel_record(
                        envelope,
                        fields,
                        s,
                        flops,
                        bytes,
                        &options.peak,
                    ));
                }
            }
        }
        KernelCase::Attention {
            lq,
            lkv,
            heads,
            kv_heads,
            head_dim,
            split,
        } => {
            let q_width = heads * head_dim;
            let kv_width = kv_heads * head_dim;
            let shape = AttentionShape {
                n_heads: heads,
                n_kv_heads: kv_heads,
                head_dim,
            };
            let q = Tensor::from_f32(
                ctx,
                &[lq, q_width],
                &pseudo_random(3, lq * q_width, 1.0),
                "bench.q",
            )?;
            let out = Tensor::zeros(ctx, DType::F32, &[lq, q_width], "bench.o")?;
            let len_a = if split { lkv / 2 } else { 0 };
            let len_b = lkv - len_a;
            let kv = |seed: u64, rows: usize, label: &str| {
                Tensor::from_f32(
                    ctx,
                    &[rows.max(1), kv_width],
                    &pseudo_random(seed, rows.max(1) * kv_width, 1.0),
                    label,
                )
            };
            let (kb, vb) = (kv(4, len_b, "bench.kb")?, kv(5, len_b, "bench.vb")?);
            let (ka, va) = (kv(6, len_a, "bench.ka")?, kv(7, len_a, "bench.va")?);
            let s = time_step(ctx, options.repeats, |step| {
                let seg_a = split.then_some(KvSegment::first(&ka, &va, len_a));
                let seg_b = KvSegment::first(&kb, &vb, len_b);
                attention(step, &q, q_width, 0, 0..lq, seg_a, seg_b, &out, shape)
            })?;
            let flops = 4.0 * (heads * lq * lkv * head_dim) as f64;
            let bytes = 4.0 * (2 * lq * q_width + 2 * lkv * kv_width) as f64;
            let fields = json!({
                "kernel": "attention",
                "case": "attention",
                "variant": if split { "two-segments" } else { "one-segment" },
                "format": "f32",
                "lq": lq, "lkv": lkv, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            });
            emit(kernel_record(
                envelope,
                fields,
                s,
                flops,
                bytes,
                &options.peak,
            ));
        }
    }
    Ok(records)
}

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
    /// served by a `BatchSession` (`serve_continuously`). Sizes above 1 run only for
    /// BiCache modes (the others would run one after another anyway).
    pub batches: Vec<usize>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Serves BiCache `requests` the way a server would: one `BatchSession` per run of
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
            let (prefix, depth) = engine.shared_prefix(r)?;
            let len = engine.encode_prompt(&r.prompt)?.len() + r.params.gen_length;
            Ok((prefix, depth, len))
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
        let rows = (concurrent * longest).min(engine.model.max_state_rows());
        let mut session = engine.batch_session(prefix, depth, rows)?;
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
            .depth_table
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
                req
            };
            engine.generate(&make(warmup))?;
            for &batch in &options.batches {
                if batch > 1 && !mode.is_bicache() {
                    continue;
                }
                engine.clear_prefix_store();
                let before = engine.prefix_store_stats();
                engine.ctx.memory.reset_peak();
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
                    "bicache_depth": if bicache && !depths.is_empty() { Some(median(depths)) } else { None },
                    "cache_bytes": after.bytes,
                    "gpu_weights_bytes": engine.model.weights.size_bytes(),
                    "gpu_peak_bytes": engine.ctx.memory.peak_bytes(),
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

    fn config(
        d: usize,
        heads: usize,
        kv: usize,
        layers: usize,
        mlp: usize,
        vocab: usize,
    ) -> LladaConfig {
        LladaConfig {
            d_model: d,
            n_heads: heads,
            n_kv_heads: kv,
            n_layers: layers,
            mlp_hidden_size: mlp,
            vocab_size: vocab,
            embedding_size: vocab,
            max_sequence_length: 4096,
            rope_theta: 500000.0,
            rms_norm_eps: 1e-5,
            weight_tying: false,
            mask_token_id: 3,
            eos_token_id: 1,
            pad_token_id: 1,
            bos_token_id: Some(0),
        }
    }

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

    #[test]
    fn llada_8b_cases_fit_the_host_bound() {
        let cfg = LladaConfig::preset("llada-8b").unwrap();
        let cases = model_kernel_cases(&cfg, &[1, 64, 512], &[512, 4096]);
        let largest = cases.iter().map(KernelCase::host_bytes).max().unwrap();
        assert!(
            largest > 1 << 30 && largest <= MAX_CASE_HOST_BYTES,
            "{largest}"
        );
    }

    #[test]
    fn model_cases_cover_every_layer_matmul_and_attention() {
        let cfg = config(64, 4, 2, 2, 96, 320);
        let cases = model_kernel_cases(&cfg, &[8, 64], &[100]);
        assert_eq!(cases.len(), 2 * (5 + 2));
        let hd = cfg.d_model / cfg.n_heads;
        assert!(cases.contains(&KernelCase::Matmul {
            case: "qkv",
            m: 8,
            n: cfg.d_model + 2 * cfg.n_kv_heads * hd,
            k: cfg.d_model,
        }));
    }

    #[test]
    fn known_peaks_match_adapter_names() {
        assert!(known_peak("NVIDIA H200").is_some());
        assert!(known_peak("llvmpipe (LLVM 15.0.6, 256 bits)").is_none());
    }
}
