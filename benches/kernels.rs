//! Kernel benchmark: `cargo bench --bench kernels -- [--small] [--only matmul|attention]`.
//!
//! Prints one JSON object per line on stdout (adapter, backend, kernel, variant, format, shape,
//! median milliseconds, GFLOP/s) and a short human summary on stderr. Each measurement is the
//! wall clock around submit + device wait, median of several runs after one warm-up run.
//! `--small` divides K and N by 8 (and uses 8 heads for attention); it is implied on CPU
//! adapters (lavapipe, llvmpipe), where the full shapes would take far too long.

use std::time::{Duration, Instant};

use serde_json::json;
use unmask_gpu::ops::attention::{AttentionShape, KvSegment, attention};
use unmask_gpu::ops::matmul::{MatmulKernel, matmul};
use unmask_gpu::{ContextOptions, DType, GpuContext, StepEncoder, Tensor, Weight, WeightFormat};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Fewest and most timed runs per measurement, and the time after which no more are started.
const MIN_RUNS: usize = 3;
const MAX_RUNS: usize = 15;
const TIME_BUDGET: Duration = Duration::from_millis(1500);

struct Options {
    small: bool,
    matmul: bool,
    attention: bool,
}

fn parse_args(ctx_is_cpu: bool) -> BenchResult<Options> {
    let mut small = ctx_is_cpu;
    let (mut matmul, mut attention) = (true, true);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--small" => small = true,
            "--only" => match args.next().as_deref() {
                Some("matmul") => attention = false,
                Some("attention") => matmul = false,
                other => {
                    return Err(format!("--only takes matmul or attention, got {other:?}").into());
                }
            },
            // `cargo bench` passes `--bench`; other harness flags are ignored too.
            _ => {}
        }
    }
    Ok(Options {
        small,
        matmul,
        attention,
    })
}

/// Deterministic values in [-scale, scale), never zero (weights, activations).
fn pseudo_random(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            let v = (u * 2.0 - 1.0) * scale;
            if v == 0.0 { scale * 1e-3 } else { v }
        })
        .collect()
}

/// Median wall-clock milliseconds of `record` + submit + wait, after one warm-up run
/// (which also compiles the pipelines).
fn time_step(
    ctx: &GpuContext,
    mut record: impl FnMut(&mut StepEncoder) -> unmask_gpu::Result<()>,
) -> BenchResult<f64> {
    let mut run = || -> BenchResult<f64> {
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
    while times.len() < MIN_RUNS || (times.len() < MAX_RUNS && began.elapsed() < TIME_BUDGET) {
        times.push(run()?);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

struct Adapter {
    name: String,
    backend: String,
}

fn matmul_section(ctx: &GpuContext, adapter: &Adapter, small: bool) -> BenchResult<()> {
    let div = if small { 8 } else { 1 };
    let mut formats = vec![WeightFormat::F32, WeightFormat::F16Packed];
    if ctx.features.shader_f16 {
        formats.push(WeightFormat::F16Native);
    }
    for &format in &formats {
        for m in [32, 256] {
            let (kernel, decode) = MatmulKernel::Auto.plan(ctx, m, format);
            eprintln!(
                "matmul: auto, {} weights, m={m}: {} kernel reading {}",
                format.name(),
                kernel.name(),
                decode.name()
            );
        }
    }
    let mut summary = Vec::new();
    for m in [32usize, 256] {
        for (k, n) in [(4096usize, 4096usize), (4096, 12288), (12288, 4096)] {
            let (k, n) = (k / div, n / div);
            let x = Tensor::from_f32(ctx, &[m, k], &pseudo_random(1, m * k, 1.0), "x")?;
            let y = Tensor::zeros(ctx, DType::F32, &[m, n], "y")?;
            let w_data = pseudo_random(2, n * k, 0.05);
            for &format in &formats {
                let w = Weight::from_f32(ctx, n, k, &w_data, format, "w")?;
                let flops = 2.0 * (m * n * k) as f64;
                let mut naive_ms = None;
                let mut best: Option<(&str, f64)> = None;
                for kernel in MatmulKernel::CONCRETE
                    .into_iter()
                    .chain([MatmulKernel::Auto])
                {
                    let ms = time_step(ctx, |step| matmul(step, &x, &w, &y, m, kernel))?;
                    let gflops = flops / (ms * 1e6);
                    println!(
                        "{}",
                        json!({
                            "adapter": adapter.name,
                            "backend": adapter.backend,
                            "kernel": "matmul",
                            "variant": kernel.name(),
                            "format": format.name(),
                            "m": m, "n": n, "k": k,
                            "ms": round3(ms),
                            "gflops": round3(gflops),
                        })
                    );
                    if kernel == MatmulKernel::Naive {
                        naive_ms = Some(ms);
                    }
                    if best.is_none_or(|(_, b)| ms < b) {
                        best = Some((kernel.name(), ms));
                    }
                }
                if let (Some(naive), Some((name, ms))) = (naive_ms, best) {
                    summary.push(format!(
                        "  m={m:<4} n={n:<6} k={k:<6} {:<11} best {name:<12} {:>6.2} GFLOP/s, {:.2}x naive",
                        format.name(),
                        flops / (ms * 1e6),
                        naive / ms
                    ));
                }
            }
        }
    }
    eprintln!("matmul summary (best variant, speed-up over naive):");
    for line in summary {
        eprintln!("{line}");
    }
    Ok(())
}

fn round3(v: f64) -> f64 {
    (v * 1e3).round() / 1e3
}

/// Attention of Lq query rows over Lkv keys (head_dim 128, as many KV heads as query heads,
/// like LLaDA-8B), once with all keys in segment B and once split evenly over segments A and
/// B (the BiCache layout). FLOPs: 4 * heads * Lq * Lkv * head_dim.
fn attention_section(ctx: &GpuContext, adapter: &Adapter, small: bool) -> BenchResult<()> {
    let heads = if small { 8 } else { 32 };
    let head_dim = 128;
    let width = heads * head_dim;
    let shape = AttentionShape {
        n_heads: heads,
        n_kv_heads: heads,
        head_dim,
    };
    let max_q = 256;
    let max_kv = 512;
    let q = Tensor::from_f32(
        ctx,
        &[max_q, width],
        &pseudo_random(3, max_q * width, 1.0),
        "q",
    )?;
    let out = Tensor::zeros(ctx, DType::F32, &[max_q, width], "out")?;
    let k = Tensor::from_f32(
        ctx,
        &[max_kv, width],
        &pseudo_random(4, max_kv * width, 1.0),
        "k",
    )?;
    let v = Tensor::from_f32(
        ctx,
        &[max_kv, width],
        &pseudo_random(5, max_kv * width, 1.0),
        "v",
    )?;
    // Segment A gets its own buffers: the kernel reads each segment from row 0.
    let half = max_kv / 2;
    let ka = Tensor::from_f32(
        ctx,
        &[half, width],
        &pseudo_random(6, half * width, 1.0),
        "ka",
    )?;
    let va = Tensor::from_f32(
        ctx,
        &[half, width],
        &pseudo_random(7, half * width, 1.0),
        "va",
    )?;
    for lq in [32usize, 256] {
        for lkv in [256usize, 512] {
            for split in [false, true] {
                let ms = time_step(ctx, |step| {
                    let (seg_a, len_b) = if split {
                        let a = KvSegment {
                            k: &ka,
                            v: &va,
                            len: lkv / 2,
                        };
                        (Some(a), lkv - lkv / 2)
                    } else {
                        (None, lkv)
                    };
                    let seg_b = KvSegment {
                        k: &k,
                        v: &v,
                        len: len_b,
                    };
                    attention(step, &q, width, 0, lq, seg_a, seg_b, &out, shape)
                })?;
                let flops = 4.0 * (heads * lq * lkv * head_dim) as f64;
                println!(
                    "{}",
                    json!({
                        "adapter": adapter.name,
                        "backend": adapter.backend,
                        "kernel": "attention",
                        "variant": if split { "two-segments" } else { "one-segment" },
                        "format": "f32",
                        "heads": heads, "head_dim": head_dim, "lq": lq, "lkv": lkv,
                        "ms": round3(ms),
                        "gflops": round3(flops / (ms * 1e6)),
                    })
                );
            }
        }
    }
    Ok(())
}

fn main() -> BenchResult<()> {
    let ctx = GpuContext::new(&ContextOptions::default())?;
    let adapter = Adapter {
        name: ctx.info.name.clone(),
        backend: format!("{:?}", ctx.info.backend),
    };
    let is_cpu = format!("{:?}", ctx.info.device_type) == "Cpu";
    let options = parse_args(is_cpu)?;
    eprintln!(
        "[gpu] {}{}",
        ctx.describe(),
        if options.small {
            " (small shapes: K and N / 8)"
        } else {
            ""
        }
    );
    if options.matmul {
        matmul_section(&ctx, &adapter, options.small)?;
    }
    if options.attention {
        attention_section(&ctx, &adapter, options.small)?;
    }
    Ok(())
}
