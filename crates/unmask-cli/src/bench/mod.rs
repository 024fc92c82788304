//! `unmask bench`: kernels at a model's shapes and whole requests per cache mode, on the
//! chosen adapter, as JSON lines (`unmask bench-report` turns several runs into tables and
//! plots).

mod dgemma;
mod scoring;
mod sink;

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde_json::Value;
use unmask::{CacheMode, EngineOptions, GenerationParams};
use unmask_bench::{
    self as bench, Decoding, KernelBenchOptions, Peak, Repeats, RequestBenchOptions, Workload,
};
use unmask_core::config::ModelConfig;
use unmask_gpu::{ContextOptions, GpuContext, WeightFormat};

use crate::error::CliError;
use crate::options::{self, CacheFlags, EngineArgs, ModelArgs};
use crate::values;
use sink::Sink;

#[derive(Args, Debug)]
#[command(
    about = "Benchmark kernels at the model's shapes and requests per cache mode (JSON lines).",
    override_usage = "unmask bench [--model <DIR> | --config llada-8b] [--only <kernels|requests|work>] [--out <FILE>]",
    after_help = "Each line is one record: the adapter, backend, driver, commit and model, then the\n\
                  figures (medians after a warm-up). Kernel records: GFLOP/s, GB/s and, when the\n\
                  peak is known or given, the share of it. Request records: throughput (canvas and\n\
                  answer tokens/s), time to the first step, forward passes, token-layer passes and\n\
                  GPU memory, per cache mode and decoding, on a workload of shared system prompts\n\
                  made of token ids (no tokenizer needed). The prefix store is emptied before each\n\
                  mode, so BiCache figures include its first misses."
)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// kernel shapes without weights: llada-8b, tiny or a config.json (kernels only)
    #[arg(long, value_name = "NAME|FILE", conflicts_with = "model")]
    config: Option<String>,
    /// kernels or requests (default: both with --model, kernels with --config)
    #[arg(long, value_name = "WHAT")]
    only: Option<Only>,
    /// rows per step for the kernel shapes (default: the block length and the whole request)
    // The paths spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "LIST", value_parser = values::positive_list)]
    rows: Option<::std::vec::Vec<usize>>,
    /// keys for the attention shapes (default: the whole request)
    #[arg(long, value_name = "LIST", value_parser = values::positive_list)]
    kv_lens: Option<::std::vec::Vec<usize>>,
    /// weight formats for the matmuls: f32, f16-packed, f16, q8, q4 (default f32,f16,q8,q4)
    #[arg(long, value_name = "LIST", value_parser = formats)]
    formats: Option<::std::vec::Vec<WeightFormat>>,
    /// time only the matmul kernel the runtime picks
    #[arg(long)]
    auto_only: bool,
    /// time only these kernels besides the runtime's pick, comma-separated matmul and
    /// attention names (unmask info lists them; `unfused` adds the unfused baseline), e.g.
    /// coop,coop-split,gemm (default: every one)
    #[arg(
        long,
        value_name = "LIST",
        value_parser = values::kernel_names,
        conflicts_with = "auto_only"
    )]
    kernels: Option<::std::vec::Vec<String>>,
    /// cache modes to run, comma-separated: none, fast-dllm-prefix, fast-dllm-dual,
    /// prefix-arm, bicache, bicache-dual, acache, dllm-cache (default: all of them; with
    /// --only work: none, fast-dllm-prefix, fast-dllm-dual, dllm-cache)
    #[arg(long, value_name = "LIST", value_parser = values::cache_modes)]
    cache: Option<::std::vec::Vec<CacheMode>>,
    /// quota, threshold or both (default quota,threshold)
    #[arg(long, value_name = "LIST", value_parser = decodings)]
    decoding: Option<::std::vec::Vec<DecodingName>>,
    /// confidence threshold of threshold decoding (default 0.9)
    #[arg(
        long,
        value_name = "T",
        value_parser = values::fraction::<f32>,
        allow_negative_numbers = true,
        default_value_t = 0.9,
        hide_default_value = true
    )]
    threshold: f32,
    /// tokens generated per request (default 256)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 256, hide_default_value = true)]
    gen_length: usize,
    /// denoising steps per request (default 128)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 128, hide_default_value = true)]
    steps: usize,
    /// block size (default 32)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 32, hide_default_value = true)]
    block_length: usize,
    /// shared system prompts in the workload (default 2)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 2, hide_default_value = true)]
    groups: usize,
    /// requests per system prompt (default 4)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 4, hide_default_value = true)]
    per_group: usize,
    /// requests in the batch at once, e.g. 1,4: BiCache requests sharing a prefix are served
    /// by a batch session (continuous batching), up to N in the same forward passes (default
    /// 1; sizes above 1 run BiCache modes only)
    #[arg(long, value_name = "LIST", value_parser = values::positive_list)]
    batch: Option<::std::vec::Vec<usize>>,
    /// tokens of each shared system prompt (default 1024)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 1024, hide_default_value = true)]
    prefix_tokens: usize,
    /// tokens of each request's own part (default 64)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 64, hide_default_value = true)]
    user_tokens: usize,
    /// seed of the workload's token ids (default 0)
    #[arg(long, value_name = "S", value_parser = values::seed, allow_negative_numbers = true, default_value_t = 0, hide_default_value = true)]
    seed: u64,
    /// with --only scoring: tokens of the scored answer, after a prompt of --prefix-tokens
    /// + --user-tokens (default 8)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 8, hide_default_value = true)]
    answer_tokens: usize,
    /// with --only scoring: Monte Carlo samples per estimate (default 128)
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true, default_value_t = 128, hide_default_value = true)]
    mc_num: usize,
    /// with --only scoring: samples per forward pass to time, numbers or `auto` (the
    /// engine's choice), e.g. 1,4,auto (default 1,auto)
    #[arg(long, value_name = "LIST", value_parser = scoring::pass_sizes)]
    pass_samples: Option<::std::vec::Vec<Option<usize>>>,
    /// the adapter's peak GFLOP/s, for the share-of-peak figures (known for H100/H200)
    #[arg(long, value_name = "X", value_parser = values::positive_number, allow_negative_numbers = true)]
    peak_gflops: Option<f64>,
    /// the adapter's peak memory GB/s
    #[arg(long, value_name = "X", value_parser = values::positive_number, allow_negative_numbers = true)]
    peak_gbs: Option<f64>,
    /// write the JSON lines to FILE (default: standard output)
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// compile the kernels without wgpu's runtime bounds checks, as `generate
    /// --unchecked-shaders` runs them (native only; every record says which way it ran)
    #[arg(long)]
    unchecked_shaders: bool,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    bicache: CacheFlags,
}

/// `--only`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Only {
    Kernels,
    Requests,
    /// Each cache mode's rows × layers and FLOPs over one request's schedule, counted
    /// from the mode planner at the model's shapes (no GPU, no weights).
    Work,
    /// Likelihood estimates (`unmask score`) of one prompt and answer at each pass size
    /// of `--pass-samples`.
    Scoring,
}

/// A decoding of `--decoding`; threshold decoding takes `--threshold`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DecodingName {
    Quota,
    Threshold,
}

fn decodings(text: &str) -> Result<Vec<DecodingName>, String> {
    values::list(text, "quota, threshold or quota,threshold", |s| match s {
        "quota" => Some(DecodingName::Quota),
        "threshold" => Some(DecodingName::Threshold),
        _ => None,
    })
}

fn formats(text: &str) -> Result<Vec<WeightFormat>, String> {
    values::list(
        text,
        "a list of f32, f16-packed, f16, q8, q4",
        |s| match s {
            // Also the name records give `f16` (`WeightFormat::name`), so a record's format can
            // be asked for again.
            "f16-native" => Some(WeightFormat::F16Native),
            s => options::parse_weight_format(s),
        },
    )
}

/// The kernel shapes' config: the model's, `--config FILE`, or a preset.
fn shapes_config(
    config: Option<&str>,
    model: Option<&Path>,
) -> Result<(String, ModelConfig), CliError> {
    if let Some(dir) = model {
        let cfg = ModelConfig::from_file(dir)
            .map_err(|e| CliError::context(format!("cannot read {}", dir.display()), e))?;
        return Ok((model_name(dir), cfg));
    }
    let name = config.unwrap_or("tiny");
    let path = PathBuf::from(name);
    if path.exists() {
        let cfg = ModelConfig::from_file(&path)
            .map_err(|e| CliError::context(format!("cannot read {}", path.display()), e))?;
        return Ok((model_name(&path), cfg));
    }
    let cfg = ModelConfig::preset(name).ok_or_else(|| {
        CliError::usage(format!(
            "invalid value for --config: expected a preset ({}) or an existing config.json, \
             found `{name}`",
            ModelConfig::PRESETS.join(", ")
        ))
    })?;
    Ok((name.to_string(), cfg))
}

fn model_name(path: &Path) -> String {
    let dir = if path.is_file() {
        path.parent().unwrap_or(path)
    } else {
        path
    };
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

fn summary_line(r: &Value) -> String {
    let f = |k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let s = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    match r.get("record").and_then(Value::as_str) {
        Some("kernel") if s("kernel") == "matmul" => format!(
            "  {:<9} m={:<5} n={:<6} k={:<6} {:<11} {:<20} {:>9.3} ms {:>9.2} GFLOP/s {:>8.2} GB/s",
            s("case"),
            f("m"),
            f("n"),
            f("k"),
            s("format"),
            s("variant"),
            f("ms"),
            f("gflops"),
            f("gbs")
        ),
        Some("kernel") => format!(
            "  attention lq={:<5} lkv={:<5} {:<13} {:>9.3} ms {:>9.2} GFLOP/s {:>8.2} GB/s",
            f("lq"),
            f("lkv"),
            s("variant"),
            f("ms"),
            f("gflops"),
            f("gbs")
        ),
        Some("scoring") => format!(
            "  scoring {} + {} tokens, {} samples, {:>4} per pass ({} passes): {:>10.1} ms {:>8.1} samples/s  x{:.2} over one per pass",
            f("prompt_tokens"),
            f("answer_tokens"),
            f("mc_num"),
            f("pass_samples"),
            f("forward_passes"),
            f("estimate_ms"),
            f("samples_per_s"),
            f("speedup_over_one_per_pass")
        ),
        _ => format!(
            "  {:<16} {:<9} batch {:<3} {:>9.2} canvas tok/s {:>9.2} answer tok/s  TTFT {:.3} s  {:>10.0} token-layer passes  peak {:.1} MiB",
            s("cache"),
            s("decoding"),
            f("batch"),
            f("throughput_canvas"),
            f("throughput_answer"),
            f("ttft_s"),
            f("token_layer_passes"),
            f("gpu_peak_bytes") / (1024.0 * 1024.0)
        ),
    }
}

/// `--only work`: every cache mode's work over one request of `--prefix-tokens` +
/// `--user-tokens` prompt tokens, at the shapes of `--model`'s config or `--config`.
fn run_work(args: &BenchArgs, model: Option<&Path>) -> Result<(), CliError> {
    let (name, cfg) = shapes_config(args.config.as_deref(), model)?;
    let modes = args.cache.clone().unwrap_or_else(|| {
        vec![
            CacheMode::None,
            CacheMode::FastDllmPrefix,
            CacheMode::FastDllmDual,
            CacheMode::DllmCache,
        ]
    });
    let settings = args.bicache.settings(&modes);
    let depth = settings.depth.unwrap_or(cfg.n_layers / 2);
    let request = bench::WorkRequest {
        prompt_tokens: args.prefix_tokens + args.user_tokens,
        prefix_tokens: args.prefix_tokens,
        params: GenerationParams {
            gen_length: args.gen_length,
            steps: args.steps,
            block_length: args.block_length,
            ..GenerationParams::default()
        },
    };
    let mut records = Vec::new();
    for &cache in &modes {
        let mode = bench::WorkMode {
            cache,
            depth,
            adaptive: settings.adaptive,
        };
        let mut r = bench::request_work(&cfg, &request, mode)
            .map_err(|e| CliError::usage(format!("invalid request shape: {e}")))?;
        r["model"] = Value::from(name.as_str());
        records.push(r);
    }
    let mut sink = Sink::open(args.out.as_deref())?;
    for r in bench::with_ratios(records) {
        eprintln!(
            "  {:<16} {:>8.1} token-layer passes/step {:>9.1} GFLOP/step  {:.2}x less than none, {:.2}x less than fast-dllm-dual",
            r["cache"].as_str().unwrap_or("?"),
            r["token_layer_passes_per_step"].as_f64().unwrap_or(0.0),
            r["gflop_per_step"].as_f64().unwrap_or(0.0),
            r["less_work_than_none"].as_f64().unwrap_or(f64::NAN),
            r["less_work_than_fast_dllm_dual"]
                .as_f64()
                .unwrap_or(f64::NAN),
        );
        sink.write(&r)?;
    }
    Ok(())
}

/// How many leading ids are ordinary text, and the special ids a workload never draws.
fn ordinary_ids(engine: &unmask::Engine) -> (u32, Vec<u32>) {
    let cfg = engine.config();
    // LLaDA's special tokens come after the ordinary ones, so ids below the smallest
    // special id are ordinary text.
    let sp = engine.special();
    let mut avoid = vec![
        cfg.mask_token_id,
        cfg.eos_token_id,
        cfg.pad_token_id,
        sp.bos,
    ];
    avoid.extend(cfg.bos_token_id);
    avoid.extend(
        [sp.eot, sp.start_header, sp.end_header]
            .into_iter()
            .flatten(),
    );
    let ordinary = avoid
        .iter()
        .copied()
        .min()
        .unwrap_or(u32::MAX)
        .min(cfg.vocab_size as u32)
        .min(cfg.embedding_size as u32);
    (ordinary, avoid)
}

pub fn run(args: &BenchArgs) -> Result<(), CliError> {
    // `--model` and `--config` are exclusive (clap checks it).
    let model = match &args.config {
        Some(_) => None,
        None => Some(args.model.dir()?),
    };
    if let Some((name, cfg)) = dgemma::shapes(args.config.as_deref(), model.as_deref())? {
        return dgemma::run(args, &name, &cfg);
    }
    let (kernels, requests, scoring) = match args.only {
        Some(Only::Kernels) => (true, false, false),
        Some(Only::Requests) => (false, true, false),
        Some(Only::Scoring) => (false, false, true),
        Some(Only::Work) => return run_work(args, model.as_deref()),
        None => (true, model.is_some(), false),
    };
    if (requests || scoring) && model.is_none() {
        return Err(CliError::usage(
            "request and scoring benchmarks need weights: give --model DIR (unmask synth makes \
             a synthetic one)",
        ));
    }
    let gen_length = args.gen_length;
    let steps = args.steps;
    let block_length = args.block_length;
    let params = GenerationParams {
        gen_length,
        steps,
        block_length,
        ..GenerationParams::default()
    };
    params.validate(1, 0, usize::MAX).map_err(|e| {
        CliError::usage(format!("invalid --gen-length/--steps/--block-length: {e}"))
    })?;
    let workload = Workload {
        groups: args.groups,
        per_group: args.per_group,
        prefix_tokens: args.prefix_tokens,
        user_tokens: args.user_tokens,
        seed: args.seed,
    };
    let request_len = workload.prefix_tokens + workload.user_tokens + gen_length;
    let threshold = args.threshold;
    let decodings = match &args.decoding {
        Some(names) => names
            .iter()
            .map(|name| match name {
                DecodingName::Quota => Decoding::Quota,
                DecodingName::Threshold => Decoding::Threshold(threshold),
            })
            .collect(),
        None => vec![Decoding::Quota, Decoding::Threshold(threshold)],
    };
    let modes = args
        .cache
        .clone()
        .unwrap_or_else(|| CacheMode::ALL.to_vec());
    let bicache = args.bicache.settings(&modes);
    let formats = args.formats.clone().unwrap_or(vec![
        WeightFormat::F32,
        WeightFormat::F16Native,
        WeightFormat::Q8,
        WeightFormat::Q4,
    ]);
    let rows = args.rows.clone().unwrap_or(vec![block_length, request_len]);
    let kv_lens = args.kv_lens.clone().unwrap_or(vec![request_len]);
    let (peak_gflops, peak_gbs) = (args.peak_gflops, args.peak_gbs);
    let mut sink = Sink::open(args.out.as_deref())?;

    let engine_options = EngineOptions {
        cache_budget: args.bicache.budget(),
        shader_checks: !args.unchecked_shaders,
        ..args.engine.options()?
    };
    let engine = match &model {
        Some(dir) if requests || scoring => Some(options::load_engine(dir, &engine_options)?),
        _ => None,
    };
    let ctx = match &engine {
        Some(e) => e.ctx().clone(),
        None => {
            let backends = engine_options
                .backend
                .as_deref()
                .map(unmask_gpu::parse_backend)
                .transpose()
                .map_err(|e| CliError::context("invalid --backend", e))?;
            GpuContext::new(&ContextOptions {
                backends,
                runtime_checks: engine_options.shader_checks,
                ..ContextOptions::default()
            })
            .map_err(|e| CliError::context("cannot open a GPU adapter", e))?
        }
    };
    eprintln!("[gpu] {}", ctx.describe());
    // The engine's kernel choice (its tuner included), else one from the same options.
    let kernel_choice = match &engine {
        Some(e) => e.model().kernels().clone(),
        None => unmask_gpu::ops::Kernels::new(&ctx, &engine_options.kernel_options()),
    };
    let (name, cfg) = shapes_config(args.config.as_deref(), model.as_deref())?;
    let peak = match (peak_gflops, peak_gbs) {
        (None, None) => bench::known_peak(&ctx.info.name),
        (g, b) => Some(Peak {
            gflops: g,
            tensor_gflops: None,
            gbs: b,
            source: "command line".into(),
        }),
    };
    if let Some(p) = &peak {
        eprintln!(
            "peak: {:?} GFLOP/s ({:?} on tensor cores), {:?} GB/s ({})",
            p.gflops, p.tensor_gflops, p.gbs, p.source
        );
    }
    // What the loaded model holds (a quantized checkpoint keeps its stored format), else
    // what --weights asks for.
    let weights = match &engine {
        Some(e) => {
            let w = &e.model().weights;
            let layers = w
                .layers
                .first()
                .map_or(w.embedding.format, |l| l.qkv.format);
            if layers == w.embedding.format {
                layers.name().to_string()
            } else {
                format!("{}+{} embedding", layers.name(), w.embedding.format.name())
            }
        }
        None => engine_options
            .weight_format
            .resolve(&ctx)
            .name()
            .to_string(),
    };

    let mut failure: Option<CliError> = None;
    let mut on_record = |r: &Value| {
        eprintln!("{}", summary_line(r));
        if failure.is_none() {
            if let Err(e) = sink.write(r) {
                failure = Some(e);
            }
        }
    };
    if kernels {
        // The same envelope as the request records, so one machine is one source in
        // `bench-report`; each kernel record names the format it measured.
        let envelope = bench::envelope(&ctx, &name, &cfg, &weights);
        let kernel_options = KernelBenchOptions {
            formats,
            all_variants: !args.auto_only,
            only: args.kernels.clone(),
            repeats: Repeats::default(),
            peak: peak.clone(),
        };
        eprintln!(
            "kernels at {name}'s shapes: rows {rows:?}, keys {kv_lens:?}, formats {:?}",
            kernel_options
                .formats
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
        );
        for case in bench::model_kernel_cases(&cfg, &rows, &kv_lens) {
            bench::run_kernel_case(
                &ctx,
                &kernel_choice,
                &envelope,
                &case,
                &kernel_options,
                &mut on_record,
            )
            .map_err(|e| CliError::context(format!("kernel benchmark {}", case.name()), e))?;
        }
    }
    if let Some(engine) = &engine {
        // Which K/V storage the requests and estimates ran with (`--kv`); f16 K/V make a source of their
        // own in `bench-report` (its weights name says so).
        let kv = format!("{:?}", engine.model().kv_dtype).to_lowercase();
        let source_weights = match kv.as_str() {
            "f32" => weights.clone(),
            _ => format!("{weights}, kv {kv}"),
        };
        let envelope = bench::with_envelope(
            &bench::envelope(engine.ctx(), &name, engine.config(), &source_weights),
            serde_json::json!({ "kv": kv }),
        );
        if scoring {
            scoring::run(args, engine, &envelope, &mut on_record)?;
            return failure.map_or(Ok(()), Err);
        }
        let max = engine.config().max_sequence_length;
        if request_len > max {
            return Err(CliError::usage(format!(
                "--prefix-tokens {} + --user-tokens {} + --gen-length {gen_length} = {request_len} \
                 exceed the model's maximum sequence length {max}",
                workload.prefix_tokens, workload.user_tokens
            )));
        }
        let (ordinary, avoid) = ordinary_ids(engine);
        let reqs = workload.requests(ordinary, &avoid);
        let warmup = Workload {
            groups: 1,
            per_group: 1,
            seed: workload.seed ^ 0xFFFF,
            ..workload.clone()
        }
        .requests(ordinary, &avoid)
        .remove(0);
        let request_options = RequestBenchOptions {
            params,
            modes,
            decodings,
            refresh_every: bicache.refresh_every,
            depth: bicache.depth,
            batches: args.batch.clone().unwrap_or_else(|| vec![1]),
        };
        eprintln!(
            "requests: {} system prompts x {} requests, {} + {} tokens, gen {gen_length}, steps {steps}, block {block_length}",
            workload.groups, workload.per_group, workload.prefix_tokens, workload.user_tokens
        );
        bench::run_request_bench(
            engine,
            &envelope,
            &workload,
            &reqs,
            &warmup,
            &request_options,
            &mut on_record,
        )?;
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
