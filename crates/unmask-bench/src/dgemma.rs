//! DiffusionGemma's kernels at a config's shapes: one decoder step over a canvas of `rows`
//! tokens after a prompt of `prompt` cached positions — every projection of a sliding and a
//! full layer, the router, the expert FFN (routing and the grouped experts), the attention of
//! both layer types and the LM head — per weight format. Weights are zeros (a kernel's time
//! does not depend on their values, and the published shapes need no host copy then); the
//! router's logits are random, so the experts get a realistic spread of tokens.

use serde_json::{Value, json};
use unmask_core::config::DiffusionGemmaConfig;
use unmask_gpu::ops::Kernels;
use unmask_gpu::ops::attention::{
    AttentionKernel, AttentionOptions, AttentionShape, KvSegment, attention_with, coop_attention,
    model_split_floats,
};
use unmask_gpu::ops::matmul::matmul;
use unmask_gpu::ops::moe::{
    ExpertScratch, ExpertShape, ExpertWeights, Route, moe_experts, moe_route,
};
use unmask_gpu::tune::{max_relative_error, output_from_zero};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

use crate::env::with_envelope;
use crate::timing::{Repeats, Sample, pseudo_random, round3, time_step};

/// What to measure.
#[derive(Clone)]
pub struct DgemmaBenchOptions {
    /// Canvas rows of the decoder step (the config's canvas length by default).
    pub rows: usize,
    /// Cached prompt positions the canvas attends to.
    pub prompt: usize,
    pub formats: Vec<WeightFormat>,
    pub repeats: Repeats,
    /// The kernels asked for (`Auto`: measured per shape class on a GPU, as a model's
    /// passes choose them).
    pub kernels: Kernels,
}

/// The environment of DiffusionGemma records (the model part of `env::envelope`).
pub fn dgemma_envelope(ctx: &GpuContext, name: &str, cfg: &DiffusionGemmaConfig) -> Value {
    let (total, active) = cfg.parameter_counts();
    json!({
        "unmask": env!("CARGO_PKG_VERSION"),
        "commit": crate::env::commit(),
        "adapter": ctx.info.name,
        "backend": format!("{:?}", ctx.info.backend),
        "device_type": format!("{:?}", ctx.info.device_type),
        "shader_f16": ctx.features.shader_f16,
        "shader_checks": ctx.runtime_checks,
        "model": {
            "name": name,
            "family": "diffusion_gemma",
            "hidden_size": cfg.hidden_size,
            "n_layers": cfg.layers.len(),
            "experts": cfg.num_experts,
            "top_k": cfg.top_k_experts,
            "vocab_size": cfg.vocab_size,
            "params": total,
            "active_params": active,
        },
    })
}

fn record(envelope: &Value, fields: Value, s: Sample, flops: f64) -> Value {
    let mut fields = fields;
    if let Value::Object(f) = &mut fields {
        f.insert("record".into(), json!("kernel"));
        f.insert("ms".into(), json!(round3(s.median_ms)));
        f.insert("ms_min".into(), json!(round3(s.min_ms)));
        f.insert("runs".into(), json!(s.runs));
        f.insert("clock".into(), json!(s.clock.name()));
        f.insert("gflops".into(), json!(round3(flops / (s.median_ms * 1e6))));
    }
    with_envelope(envelope, fields)
}

/// Times the step's kernels; one record each (`on_record` sees them as they come).
pub fn run_dgemma_kernels(
    ctx: &GpuContext,
    cfg: &DiffusionGemmaConfig,
    envelope: &Value,
    o: &DgemmaBenchOptions,
    on_record: &mut dyn FnMut(&Value),
) -> unmask_gpu::Result<Vec<Value>> {
    let mut out = Vec::new();
    let mut emit = |r: Value| {
        on_record(&r);
        out.push(r);
    };
    let (m, d, h) = (o.rows, cfg.hidden_size, cfg.heads);
    let x = Tensor::from_f32(ctx, &[m, d], &pseudo_random(1, m * d, 1.0), "bench.x")?;
    let mut layer_types: Vec<(&str, usize, usize)> = Vec::new();
    for a in &cfg.layers {
        let name = if a.sliding { "sliding" } else { "full" };
        if !layer_types.iter().any(|l| l.0 == name) {
            layer_types.push((name, a.head_dim, a.kv_heads));
        }
    }
    for &requested in &o.formats {
        let format = requested.resolve(ctx);
        let mut matmuls: Vec<(String, usize, usize, WeightFormat)> = Vec::new();
        for &(kind, hd, kv) in &layer_types {
            matmuls.push((format!("{kind}.q"), h * hd, d, format));
            matmuls.push((format!("{kind}.k"), kv * hd, d, format));
            if kind == "sliding" {
                matmuls.push((format!("{kind}.v"), kv * hd, d, format));
            }
            matmuls.push((format!("{kind}.o"), d, h * hd, format));
        }
        matmuls.push(("mlp.gate_up".into(), 2 * cfg.intermediate_size, d, format));
        matmuls.push(("mlp.down".into(), d, cfg.intermediate_size, format));
        matmuls.push(("router".into(), cfg.num_experts, d, WeightFormat::F32));
        matmuls.push(("lm_head".into(), cfg.vocab_size, d, format));
        for (case, n, k, wf) in matmuls {
            let w = Weight::zeros(ctx, n, k, wf, "bench.w")?;
            let xk = if k == d {
                x.clone()
            } else {
                Tensor::from_f32(ctx, &[m, k], &pseudo_random(2, m * k, 1.0), "bench.xk")?
            };
            let y = Tensor::zeros(ctx, DType::F32, &[m, n], "bench.y")?;
            let s = time_step(ctx, o.repeats, |step| {
                matmul(step, &xk, &w, &y, m, &o.kernels)
            })?;
            let fields = json!({"kernel": "matmul", "case": case, "m": m, "n": n, "k": k, "format": wf.name()});
            emit(record(envelope, fields, s, 2.0 * (m * n * k) as f64));
        }
        // The expert FFN: routing of random router logits, then the grouped experts.
        let (e, top_k, ie) = (
            cfg.num_experts,
            cfg.top_k_experts,
            cfg.moe_intermediate_size,
        );
        let logits = Tensor::from_f32(ctx, &[m, e], &pseudo_random(3, m * e, 4.0), "bench.router")?;
        let scale = Tensor::from_f32(ctx, &[e], &vec![1.0; e], "bench.expert_scale")?;
        let ids = Tensor::zeros(ctx, DType::U32, &[m, top_k], "bench.ids")?;
        let weights = Tensor::zeros(ctx, DType::F32, &[m, top_k], "bench.weights")?;
        let gate_up = Weight::zeros_stacked(ctx, e, 2 * ie, d, format, "bench.experts.gate_up")?;
        let down = Weight::zeros_stacked(ctx, e, d, ie, format, "bench.experts.down")?;
        let shape = ExpertShape {
            rows: m,
            experts: e,
            top_k,
            hidden: d,
            inter: ie,
        };
        let scratch = ExpertScratch::new(ctx, shape)?;
        let y = Tensor::zeros(ctx, DType::F32, &[m, d], "bench.experts.y")?;
        let s = time_step(ctx, o.repeats, |step| {
            moe_route(step, &logits, &scale, &ids, &weights, m, top_k)?;
            let route = Route {
                ids: &ids,
                weights: &weights,
            };
            let w = ExpertWeights {
                gate_up: &gate_up,
                down: &down,
            };
            moe_experts(step, &x, route, w, &y, &scratch, shape)
        })?;
        let flops = 2.0 * (m * top_k) as f64 * (3 * ie * d) as f64;
        let fields = json!({"kernel": "experts", "case": "experts", "m": m, "experts": e, "top_k": top_k, "inter": ie, "format": format.name()});
        emit(record(envelope, fields, s, flops));
    }
    // Attention of the canvas over the cached prompt (sliding layers: the last W - 1) and
    // itself, per layer type; f32 K/V.
    for &(kind, hd, kv) in &layer_types {
        let cached = if kind == "sliding" {
            o.prompt.min(cfg.sliding_window.saturating_sub(1))
        } else {
            o.prompt
        };
        let w = kv * hd;
        let q = Tensor::from_f32(
            ctx,
            &[m, h * hd],
            &pseudo_random(4, m * h * hd, 1.0),
            "bench.q",
        )?;
        let ka = Tensor::from_f32(
            ctx,
            &[cached.max(1), w],
            &pseudo_random(5, cached.max(1) * w, 1.0),
            "bench.ka",
        )?;
        let kb = Tensor::from_f32(ctx, &[m, w], &pseudo_random(6, m * w, 1.0), "bench.kb")?;
        let out = Tensor::zeros(ctx, DType::F32, &[m, h * hd], "bench.attn")?;
        let shape = AttentionShape {
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
        };
        let scratch = match model_split_floats(ctx, o.kernels.attention, &[shape], m) {
            0 => None,
            n => Some(Tensor::zeros(ctx, DType::F32, &[n], "bench.attn_parts")?),
        };
        // The kernel the step uses (`o.kernels.attention`; `Auto`: the measured choice),
        // and with `Auto` each candidate beside it (the wide kernel, the tensor-core one
        // where this device serves the head dim), each checked against the wide kernel's
        // output: the ratio a GPU run is for.
        let requested = o.kernels.attention;
        let mut kernels = Vec::new();
        if requested == AttentionKernel::Auto {
            kernels.push(AttentionKernel::Wide);
            if coop_attention(ctx, hd).is_some() {
                kernels.push(AttentionKernel::Coop);
            }
        }
        kernels.push(requested);
        let run = |step: &mut StepEncoder, kernel| {
            let options = AttentionOptions {
                kernel,
                tuner: Some(&o.kernels.tuner),
                scratch: scratch.as_ref(),
                scale: Some(1.0),
                ..Default::default()
            };
            let a = KvSegment::first(&ka, &ka, cached);
            let b = KvSegment::first(&kb, &kb, m);
            attention_with(step, &q, h * hd, 0, 0..m, Some(a), b, &out, shape, &options)
        };
        let output = |kernel| output_from_zero(ctx, &out, |step| run(step, kernel).map(|_| ()));
        let reference = output(AttentionKernel::Wide)?;
        for kernel in kernels {
            // The wide kernel is the reference itself: its output is not read back twice.
            let error = match kernel {
                AttentionKernel::Wide => 0.0,
                _ => max_relative_error(&reference, &output(kernel)?),
            };
            let mut plan = None;
            let s = time_step(ctx, o.repeats, |step| {
                plan = Some(run(step, kernel)?);
                Ok(())
            })?;
            let flops = 4.0 * (m * h * hd * (cached + m)) as f64;
            let ran = plan.map_or("?", |p| p.kernel.name());
            let fields = json!({"kernel": ran, "requested": kernel.name(), "in_step": kernel == requested, "case": format!("{kind}.attention"), "m": m, "keys": cached + m, "heads": h, "kv_heads": kv, "head_dim": hd, "max_rel_error_vs_wide": error});
            emit(record(envelope, fields, s, flops));
        }
    }
    let formats: Vec<WeightFormat> = o.formats.iter().map(|f| f.resolve(ctx)).collect();
    for step in step_estimates(cfg, envelope, o, &formats, &out) {
        on_record(&step);
        out.push(step);
    }
    Ok(out)
}

/// One whole decoder step per format from the kernel records: each layer type's projections
/// and attention times its layers, the dense MLP, router and experts times every layer, the
/// LM head once (the norms, RoPE and residual adds are left out: small beside these).
fn step_estimates(
    cfg: &DiffusionGemmaConfig,
    envelope: &Value,
    o: &DgemmaBenchOptions,
    formats: &[WeightFormat],
    records: &[Value],
) -> Vec<Value> {
    let sliding = cfg.layers.iter().filter(|a| a.sliding).count();
    let full = cfg.layers.len() - sliding;
    let times = |case: &str| match case.split_once('.') {
        Some(("sliding", _)) => sliding,
        Some(("full", _)) => full,
        _ if case == "lm_head" => 1,
        _ => cfg.layers.len(),
    };
    let ms_of = |r: &Value| r["ms"].as_f64().unwrap_or(0.0);
    // The kernel the step runs; the other candidates' records are for comparison.
    let attention: f64 = records
        .iter()
        .filter(|r| {
            r["case"]
                .as_str()
                .is_some_and(|c| c.ends_with(".attention"))
                && r["in_step"] == true
        })
        .map(|r| ms_of(r) * times(r["case"].as_str().unwrap_or("")) as f64)
        .sum();
    // The router's matrix stays f32 in every format: its first record counts for each.
    let router = records
        .iter()
        .find(|r| r["case"] == "router")
        .map_or(0.0, |r| ms_of(r) * cfg.layers.len() as f64);
    let mut out = Vec::new();
    for format in formats {
        let name = format.name();
        let (mut ms, mut experts, mut lm_head) = (attention + router, 0.0, 0.0);
        for r in records {
            let case = r["case"].as_str().unwrap_or("");
            let skip = case == "router" || case.ends_with(".attention");
            if skip || r["format"].as_str() != Some(name) {
                continue;
            }
            let t = ms_of(r) * times(case) as f64;
            ms += t;
            match case {
                "experts" => experts += t,
                "lm_head" => lm_head += t,
                _ => {}
            }
        }
        let fields = json!({
            "record": "step", "case": "decoder_step", "format": name, "m": o.rows,
            "cached": o.prompt, "layers": cfg.layers.len(), "ms": round3(ms),
            "experts_ms": round3(experts), "attention_ms": round3(attention),
            "lm_head_ms": round3(lm_head),
            "canvas_rows_per_s": round3(o.rows as f64 / (ms / 1e3)),
        });
        out.push(with_envelope(envelope, fields));
    }
    out
}
