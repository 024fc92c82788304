//! Kernel cases at a model's shapes: every layer matmul and the LM head per weight format
//! and kernel variant, and attention over one or two KV segments (the BiCache layout).

use serde_json::{Value, json};
use unmask_core::config::ModelConfig;
use unmask_gpu::ops::Kernels;
use unmask_gpu::ops::attention::{
    AttentionKernel, AttentionOptions, AttentionShape, KvSegment, REGISTER_MAX_HEAD_DIM,
    attention_with, split_scratch_floats,
};
use unmask_gpu::ops::matmul::{Fusion, MatmulChoice, MatmulKernel, matmul_fused, tune_class};
use unmask_gpu::tune::{max_relative_error, output_from_zero};
use unmask_gpu::{DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

use crate::env::{Peak, with_envelope};
use crate::timing::{Repeats, Sample, pseudo_random, round3, time_step};

mod fusion;
mod select;

use fusion::{LayerFusion, Unfused};

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
    /// The LM head's token choice over `rows` rows of `vocab` logits: the selection alone,
    /// with the model's log-probability, and with the most likely alternatives.
    Select { rows: usize, vocab: usize },
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
            KernelCase::Select { rows, vocab } => (rows as u64) * (vocab as u64),
        };
        floats.saturating_mul(4)
    }

    pub fn name(&self) -> &'static str {
        match self {
            KernelCase::Matmul { case, .. } => case,
            KernelCase::Attention { .. } => "attention",
            KernelCase::Select { .. } => "select",
        }
    }
}

/// The matmuls of one layer and the LM head, for each row count in `rows` (the rows a step
/// computes: a block under a dual cache, the whole sequence without a cache), and the
/// attention of those rows over `kv_lens` keys.
pub fn model_kernel_cases(cfg: &ModelConfig, rows: &[usize], kv_lens: &[usize]) -> Vec<KernelCase> {
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
    /// With `all_variants`: only the kernels of these names (matmul and attention, e.g.
    /// `coop`, `coop-split`; `unfused` for the unfused baseline), besides `Auto`; `None`:
    /// every one.
    pub only: Option<Vec<String>>,
    pub repeats: Repeats,
    pub peak: Option<Peak>,
}

impl KernelBenchOptions {
    /// Whether the kernel (or baseline) of this name is timed.
    fn wants(&self, name: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| n == name))
    }
}

/// A kernel record: the case's own fields, then the timing figures shared by every kernel
/// (median and fastest run, GFLOP/s and GB/s from the work done) and the shares of the
/// adapter's peak when it is known.
/// One kernel record. `tensor_cores`: the kernel ran on tensor cores, so its FLOP/s are
/// compared with the adapter's f16 tensor peak (`peak_flops` says which peak).
pub(crate) fn kernel_record(
    envelope: &Value,
    case_fields: Value,
    sample: Sample,
    flops: f64,
    bytes: f64,
    peak: &Option<Peak>,
    tensor_cores: bool,
) -> Value {
    let gflops = flops / (sample.median_ms * 1e6);
    let gbs = bytes / (sample.median_ms * 1e6);
    let mut fields = case_fields;
    if let Value::Object(f) = &mut fields {
        f.insert("record".into(), json!("kernel"));
        f.insert("ms".into(), json!(round3(sample.median_ms)));
        f.insert("ms_min".into(), json!(round3(sample.min_ms)));
        f.insert("clock".into(), json!(sample.clock.name()));
        f.insert("wall_ms".into(), json!(round3(sample.wall_ms)));
        f.insert("runs".into(), json!(sample.runs));
        f.insert("gflops".into(), json!(round3(gflops)));
        f.insert("gbs".into(), json!(round3(gbs)));
        if let Some(p) = peak {
            let (arith, kind) = if tensor_cores {
                (p.tensor_gflops, "f16 tensor")
            } else {
                (p.gflops, "fp32")
            };
            if let Some(g) = arith {
                f.insert(
                    "peak_gflops_share".into(),
                    json!(round3(gflops / g * 1e3) / 1e3),
                );
                f.insert("peak_flops".into(), json!(kind));
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
    kernels: &Kernels,
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
            // As the forward runs it: RMSNorm folded into qkv and gate|up, SwiGLU into
            // gate|up (a paired weight, N / 2 output columns), the residual into the
            // projections back to the stream.
            let fused = LayerFusion::of(case);
            let y_cols = if fused.swiglu { n / 2 } else { n };
            let x = Tensor::from_f32(ctx, &[m, k], &pseudo_random(1, m * k, 1.0), "bench.x")?;
            let y = Tensor::zeros(ctx, DType::F32, &[m, y_cols], "bench.y")?;
            let g = Tensor::from_f32(ctx, &[k], &pseudo_random(8, k, 1.0), "bench.norm")?;
            let w_data = pseudo_random(2, n * k, 0.05);
            let mut seen = Vec::new();
            for &requested in &options.formats {
                let format = requested.resolve(ctx);
                if seen.contains(&format) {
                    continue;
                }
                seen.push(format);
                let w = if fused.swiglu {
                    let w = Weight::zeros_paired(ctx, n / 2, k, format, "bench.w")?;
                    w.write_rows_f32(ctx, 0, &w_data)?;
                    w
                } else {
                    Weight::from_f32(ctx, n, k, &w_data, format, "bench.w")?
                };
                let fusion = Fusion {
                    norm: fused.norm.then_some((&g, 1e-5)),
                    residual: fused.residual,
                    swiglu: fused.swiglu,
                };
                let variants: Vec<MatmulKernel> = if options.all_variants {
                    MatmulKernel::CONCRETE
                        .into_iter()
                        .filter(|k| options.wants(k.name()))
                        .chain([MatmulKernel::Auto])
                        .collect()
                } else {
                    vec![MatmulKernel::Auto]
                };
                let flops = 2.0 * (m * n * k) as f64;
                let bytes = w.size_bytes() as f64 + 4.0 * (m * k + m * y_cols) as f64;
                // Each variant's output from zero, checked against `Tiled`'s: a kernel that
                // is fast and wrong on this device shows in its record.
                // The model's choice: `Auto` measures with its tuner.
                let output = |kernel: MatmulKernel| {
                    let choice = MatmulChoice {
                        kernel,
                        kernels: Some(kernels),
                    };
                    output_from_zero(ctx, &y, |step| {
                        matmul_fused(step, &x, &w, &y, m, choice, fusion)
                    })
                };
                let reference = output(MatmulKernel::Tiled)?;
                for kernel in variants {
                    // (For `Auto` this first run also measures the class where the device
                    // tunes.)
                    let error = max_relative_error(&reference, &output(kernel)?);
                    // The kernel that ran: for `Auto` the measured winner, else the fixed
                    // choice; a pinned kernel as `plan` runs it (`coop` is `gemm` without
                    // cooperative matrices).
                    let ran = if kernel == MatmulKernel::Auto {
                        let class = tune_class(format, &fusion, m, y_cols, k);
                        kernels
                            .tuner
                            .winner(&class)
                            .and_then(|name| {
                                MatmulKernel::CONCRETE
                                    .into_iter()
                                    .find(|c| c.name() == name)
                            })
                            .unwrap_or_else(|| kernel.plan(ctx, m, format).0)
                    } else {
                        kernel.plan(ctx, m, format).0
                    };
                    let agrees = error <= ran.tolerance();
                    if !agrees {
                        eprintln!(
                            "unmask bench: matmul {case} {} ({}) m={m}: off the tiled kernel's \
                             output by {error:e} of its largest value",
                            kernel.name(),
                            format.name()
                        );
                    }
                    let s = time_step(ctx, options.repeats, |step| {
                        matmul_fused(step, &x, &w, &y, m, kernel, fusion)
                    })?;
                    let variant = if kernel == MatmulKernel::Auto {
                        format!("auto:{}", ran.name())
                    } else {
                        kernel.name().to_string()
                    };
                    let tensor_cores = matches!(ran, MatmulKernel::Coop | MatmulKernel::CoopSplit);
                    let fields = json!({
                        "kernel": "matmul",
                        "case": case,
                        "variant": variant,
                        "fused": fused.name(),
                        "format": format.name(),
                        "m": m, "n": n, "k": k,
                        "max_rel_err": error,
                        "agrees": agrees,
                        // What ran: the variant itself, or its fallback where it does not run
                        // here (gemm-f16 without shader-f16, coop without cooperative
                        // matrices, narrow-dot with float weights).
                        "ran": ran.name(),
                    });
                    emit(kernel_record(
                        envelope,
                        fields,
                        s,
                        flops,
                        bytes,
                        &options.peak,
                        tensor_cores,
                    ));
                }
                // The same work as separate dispatches (norm, matmul, SwiGLU or add), as
                // the forward ran it before the fusions: what fusing buys on this adapter.
                if options.all_variants && options.wants("unfused") && fused.name() != "none" {
                    let unfused = Unfused::new(ctx, m, n, k, format, &w_data, fused)?;
                    let s = time_step(ctx, options.repeats, |step| {
                        unfused.record(step, &x, &g, &y, m)
                    })?;
                    let fields = json!({
                        "kernel": "matmul",
                        "case": case,
                        "variant": format!(
                            "unfused:{}",
                            MatmulKernel::Auto.plan(ctx, m, format).0.name()
                        ),
                        "fused": "none",
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
                        false,
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
            let host = |seed: u64, rows: usize| pseudo_random(seed, rows.max(1) * kv_width, 1.0);
            let kv = |dtype: DType, seed: u64, rows: usize, label: &str| {
                let shape = [rows.max(1), kv_width];
                match dtype {
                    DType::F16 => Tensor::from_f32_as_f16(ctx, &shape, &host(seed, rows), label),
                    _ => Tensor::from_f32(ctx, &shape, &host(seed, rows), label),
                }
            };
            // A scratch for the split kernel at up to 64 slices (the plan stays below).
            let scratch = Tensor::zeros(
                ctx,
                DType::F32,
                &[split_scratch_floats(ctx, shape, lq, 64)],
                "bench.attention scratch",
            )?;
            let mut kv_formats = vec![DType::F32];
            if options.all_variants {
                kv_formats.push(DType::F16);
            }
            let segments = if split { "two-segments" } else { "one-segment" };
            let flops = 4.0 * (heads * lq * lkv * head_dim) as f64;
            for kv_dtype in kv_formats {
                let (kb, vb) = (
                    kv(kv_dtype, 4, len_b, "bench.kb")?,
                    kv(kv_dtype, 5, len_b, "bench.vb")?,
                );
                let (ka, va) = (
                    kv(kv_dtype, 6, len_a, "bench.ka")?,
                    kv(kv_dtype, 7, len_a, "bench.va")?,
                );
                // f16 K/V: the packed path always, the native one where the device has it.
                let native_paths: &[bool] = match kv_dtype {
                    DType::F16 if ctx.features.shader_f16 => &[false, true],
                    DType::F16 => &[false],
                    _ => &[true],
                };
                let variants: Vec<AttentionKernel> = if options.all_variants {
                    AttentionKernel::CONCRETE
                        .into_iter()
                        .filter(|&k| {
                            k != AttentionKernel::Register
                                || (kv_dtype == DType::F32 && head_dim <= REGISTER_MAX_HEAD_DIM)
                        })
                        .filter(|k| options.wants(k.name()))
                        .chain([AttentionKernel::Auto])
                        .collect()
                } else {
                    vec![AttentionKernel::Auto]
                };
                let record = |step: &mut StepEncoder, kernel, native_f16| {
                    let attn_options = AttentionOptions {
                        kernel,
                        tuner: Some(&kernels.tuner),
                        native_f16,
                        scratch: Some(&scratch),
                        ..AttentionOptions::default()
                    };
                    let seg_a = split.then_some(KvSegment::first(&ka, &va, len_a));
                    let seg_b = KvSegment::first(&kb, &vb, len_b);
                    attention_with(
                        step,
                        &q,
                        q_width,
                        0,
                        0..lq,
                        seg_a,
                        seg_b,
                        &out,
                        shape,
                        &attn_options,
                    )
                };
                // Each variant's output from zero against the wide kernel's on the same K/V
                // (it runs everywhere): a kernel fast and wrong on this device shows.
                let output = |kernel, native_f16| {
                    output_from_zero(ctx, &out, |step| {
                        record(step, kernel, native_f16).map(|_| ())
                    })
                };
                let reference = output(AttentionKernel::Wide, false)?;
                for &native_f16 in native_paths {
                    for &kernel in &variants {
                        let error = max_relative_error(&reference, &output(kernel, native_f16)?);
                        let mut plan = None;
                        let s = time_step(ctx, options.repeats, |step| {
                            plan = Some(record(step, kernel, native_f16)?);
                            Ok(())
                        })?;
                        let plan = plan.expect("the step ran at least once");
                        let agrees = error <= plan.kernel.tolerance();
                        if !agrees {
                            eprintln!(
                                "unmask bench: attention {} ({}) lq={lq} lkv={lkv}: off the wide \
                                 kernel's output by {error:e} of its largest value",
                                kernel.name(),
                                plan.read.name()
                            );
                        }
                        let kv_bytes = kv_dtype.size_bytes() as f64;
                        let bytes = 4.0 * (2 * lq * q_width) as f64
                            + kv_bytes * (2 * lkv * kv_width) as f64;
                        let name = if kernel == AttentionKernel::Auto {
                            format!("auto:{}", plan.kernel.name())
                        } else {
                            kernel.name().to_string()
                        };
                        let fields = json!({
                            "kernel": "attention",
                            "case": "attention",
                            "variant": format!("{name}/{segments}"),
                            "format": plan.read.name(),
                            "slices": plan.slices,
                            "tile": format!("{}x{}", plan.tile.0, plan.tile.1),
                            "lq": lq, "lkv": lkv, "heads": heads, "kv_heads": kv_heads,
                            "head_dim": head_dim,
                            "ran": plan.kernel.name(),
                            "max_rel_err": error,
                            "agrees": agrees,
                        });
                        // `coop` runs Q K^T twice (its two passes); its FLOP/s count the
                        // useful work, like the others'.
                        emit(kernel_record(
                            envelope,
                            fields,
                            s,
                            flops,
                            bytes,
                            &options.peak,
                            plan.kernel == AttentionKernel::Coop,
                        ));
                    }
                }
            }
        }
        KernelCase::Select { rows, vocab } => {
            for r in select::run(ctx, envelope, rows, vocab, options)? {
                emit(r);
            }
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests;
