//! Kernel benchmark:
//! `cargo bench -p unmask-bench --bench kernels -- [--small] [--only matmul|attention|select]
//! [--rows 32,256] [--keys 256,512] [--format NAME]...` (`--format` keeps only the named
//! weight formats, e.g. `f32`, `q8`).
//!
//! Prints one JSON record per line on stdout (the environment, the kernel, variant, format,
//! shape, median milliseconds, GFLOP/s and GB/s; the same records as `unmask bench`) and a
//! short summary on stderr. Shapes are LLaDA-8B's layer matmuls at 32 and 256 rows and its
//! attention (head_dim 128), and the LM head's token choice over its vocabulary with and
//! without log-probabilities. `--small` divides K and N by 8 (and uses 8 heads for
//! attention); it is implied on CPU adapters (lavapipe, llvmpipe), where the full shapes
//! would take far too long. `unmask bench` runs the same measurements at any model's shapes
//! and adds whole requests.

use serde_json::Value;
use unmask_bench::{self as bench, KernelBenchOptions, KernelCase, Repeats};
use unmask_core::config::ModelConfig;
use unmask_gpu::{ContextOptions, GpuContext, WeightFormat};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

struct Options {
    small: bool,
    matmul: bool,
    attention: bool,
    select: bool,
    /// Weight format names to keep; empty keeps all.
    formats: Vec<String>,
    /// Rows per step (query rows of attention).
    rows: Vec<usize>,
    /// Keys of the attention cases.
    keys: Vec<usize>,
}

/// A comma-separated list of positive counts, as `--rows` and `--keys` take.
fn counts(flag: &str, text: Option<String>) -> BenchResult<Vec<usize>> {
    let text = text.ok_or_else(|| format!("{flag} takes a list such as 32,256"))?;
    text.split(',')
        .map(|t| match t.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{flag}: `{t}` is not a positive count").into()),
        })
        .collect()
}

fn parse_args(ctx_is_cpu: bool) -> BenchResult<Options> {
    let mut small = ctx_is_cpu;
    let (mut matmul, mut attention, mut select) = (true, true, true);
    let mut formats = Vec::new();
    let (mut rows, mut keys) = (vec![32, 256], vec![256, 512]);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--small" => small = true,
            "--rows" => rows = counts("--rows", args.next())?,
            "--keys" => keys = counts("--keys", args.next())?,
            "--only" => {
                let only = args.next();
                (matmul, attention, select) = match only.as_deref() {
                    Some("matmul") => (true, false, false),
                    Some("attention") => (false, true, false),
                    Some("select") => (false, false, true),
                    other => {
                        return Err(format!(
                            "--only takes matmul, attention or select, got {other:?}"
                        )
                        .into());
                    }
                };
            }
            "--format" => match args.next() {
                Some(name) => formats.push(name),
                None => return Err("--format takes a weight format name".into()),
            },
            // `cargo bench` passes `--bench`; other harness flags are ignored too.
            _ => {}
        }
    }
    Ok(Options {
        small,
        matmul,
        attention,
        select,
        formats,
        rows,
        keys,
    })
}

/// LLaDA-8B's shapes, with K and N divided by `div`.
fn llada_8b_shapes(div: usize, heads: usize) -> ModelConfig {
    ModelConfig {
        family: unmask_core::config::ModelFamily::Llada,
        qkv_bias: false,
        d_model: 4096 / div,
        n_heads: heads,
        n_kv_heads: heads,
        n_layers: 32,
        mlp_hidden_size: 12288 / div,
        vocab_size: 126464 / div,
        embedding_size: 126464 / div,
        max_sequence_length: 4096,
        rope_theta: 500000.0,
        rms_norm_eps: 1e-5,
        weight_tying: false,
        mask_token_id: 126336 / div as u32,
        eos_token_id: 126081 / div as u32,
        pad_token_id: 126081 / div as u32,
        bos_token_id: Some(126080 / div as u32),
        default_top_k: None,
    }
}

fn main() -> BenchResult<()> {
    let ctx = GpuContext::new(&ContextOptions::default())?;
    let kernels = unmask_gpu::ops::Kernels::new(&ctx, &unmask_gpu::ops::KernelOptions::default());
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
    let (div, heads) = if options.small { (8, 8) } else { (1, 32) };
    // Attention cases are listed by hand below so that head_dim stays 128 at both sizes.
    let cfg = llada_8b_shapes(div, heads);
    let name = if options.small {
        "llada-8b/8"
    } else {
        "llada-8b"
    };
    let envelope = bench::envelope(&ctx, name, &cfg, "bench");
    let mut formats = vec![WeightFormat::F32, WeightFormat::F16Packed];
    if ctx.features.shader_f16 {
        formats.push(WeightFormat::F16Native);
    }
    // the quantized formats LLaDA-8B needs to fit 8-12 GB GPUs and browsers
    formats.extend([WeightFormat::Q8, WeightFormat::Q4]);
    if !options.formats.is_empty() {
        formats.retain(|f| options.formats.iter().any(|n| n == f.name()));
        if formats.is_empty() {
            return Err(format!("no weight format named {:?} here", options.formats).into());
        }
    }
    let kernel_options = KernelBenchOptions {
        formats,
        all_variants: true,
        only: None,
        repeats: Repeats::default(),
        peak: bench::known_peak(&ctx.info.name),
    };
    let mut cases = Vec::new();
    for &m in &options.rows {
        if options.matmul {
            cases.extend(
                bench::model_kernel_cases(&cfg, &[m], &[])
                    .into_iter()
                    .filter(|c| c.name() != "lm_head"),
            );
        }
        if options.select {
            // LLaDA-8B's whole vocabulary even with small shapes: one pass over the logits
            // is cheap everywhere, and the cost of the alternatives depends on it.
            cases.push(KernelCase::Select {
                rows: m,
                vocab: llada_8b_shapes(1, heads).embedding_size,
            });
        }
        if options.attention {
            for &lkv in &options.keys {
                for split in [false, true] {
                    cases.push(KernelCase::Attention {
                        lq: m,
                        lkv,
                        heads,
                        kv_heads: heads,
                        head_dim: 128,
                        split,
                    });
                }
            }
        }
    }
    let mut summary = Vec::new();
    for case in &cases {
        let records =
            bench::run_kernel_case(&ctx, &kernels, &envelope, case, &kernel_options, &mut |r| {
                println!("{r}");
            })?;
        summary.extend(summarize(&records));
    }
    eprintln!(
        "summary (best variant per shape and format, speed-up over naive matmul / register attention):"
    );
    for line in summary {
        eprintln!("{line}");
    }
    Ok(())
}

/// One line per (shape, format): the fastest variant and its speed-up over the naive one.
fn summarize(records: &[Value]) -> Vec<String> {
    let f = |r: &Value, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let s = |r: &Value, k: &str| r.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    let mut formats: Vec<String> = records.iter().map(|r| s(r, "format")).collect();
    formats.dedup();
    let mut out = Vec::new();
    for format in formats {
        let group: Vec<&Value> = records
            .iter()
            .filter(|r| s(r, "format") == format)
            .collect();
        let Some(best) = group
            .iter()
            .min_by(|a, b| f(a, "ms").total_cmp(&f(b, "ms")))
        else {
            continue;
        };
        let naive = group
            .iter()
            .find(|r| {
                let v = s(r, "variant");
                v == "naive" || v.starts_with("register/")
            })
            .map(|r| f(r, "ms"));
        let shape = if s(best, "kernel") == "select" {
            let costs: Vec<String> = group
                .iter()
                .map(|r| format!("{} {:.2}x", s(r, "variant"), f(r, "vs_plain")))
                .collect();
            out.push(format!(
                "  select rows={} vocab={}: {}",
                f(best, "rows"),
                f(best, "vocab"),
                costs.join(", ")
            ));
            continue;
        } else if s(best, "kernel") == "matmul" {
            format!(
                "{} m={} n={} k={}",
                s(best, "case"),
                f(best, "m"),
                f(best, "n"),
                f(best, "k")
            )
        } else {
            // The variant is `kernel/segments`: the segments are part of the shape.
            let variant = s(best, "variant");
            format!(
                "attention lq={} lkv={} {}",
                f(best, "lq"),
                f(best, "lkv"),
                variant.rsplit('/').next().unwrap_or("?")
            )
        };
        out.push(format!(
            "  {shape:<34} {format:<11} best {:<20} {:>8.2} GFLOP/s{}",
            s(best, "variant"),
            f(best, "gflops"),
            naive
                .map(|n| format!(", {:.2}x the baseline", n / f(best, "ms")))
                .unwrap_or_default()
        ));
    }
    out
}
