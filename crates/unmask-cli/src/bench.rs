//! `unmask bench`: kernels at a model's shapes and whole requests per cache mode, on the
//! chosen adapter, as JSON lines (`unmask bench-report` turns several runs into tables and
//! plots).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;
use unmask::{CacheMode, GenerationParams};
use unmask_bench::{
    self as bench, Decoding, KernelBenchOptions, Peak, Repeats, RequestBenchOptions, Workload,
};
use unmask_core::config::LladaConfig;
use unmask_gpu::{ContextOptions, GpuContext, WeightFormat};

use crate::args::{CommandSpec, Flag, Matches, invalid};
use crate::error::CliError;
use crate::options::{self, BACKEND, CACHE, DTYPE, MODEL};

pub fn spec() -> CommandSpec {
    let mut flags = vec![
        MODEL,
        Flag::value(
            "config",
            "NAME|FILE",
            "kernel shapes without weights: llada-8b, tiny or a config.json (kernels only)",
        ),
        Flag::value(
            "only",
            "WHAT",
            "kernels or requests (default: both with --model, kernels with --config)",
        ),
        Flag::value(
            "rows",
            "LIST",
            "rows per step for the kernel shapes (default: the block length and the whole request)",
        ),
        Flag::value(
            "kv-lens",
            "LIST",
            "keys for the attention shapes (default: the whole request)",
        ),
        Flag::value(
            "formats",
            "LIST",
            "weight formats for the matmuls: f32, f16-packed, f16, q8, q4 (default f32,f16,q8,q4)",
        ),
        Flag::switch("auto-only", "time only the matmul kernel the runtime picks"),
        CACHE,
        Flag::value(
            "decoding",
            "LIST",
            "quota, threshold or both (default quota,threshold)",
        ),
        Flag::value(
            "threshold",
            "T",
            "confidence threshold of threshold decoding (default 0.9)",
        ),
        Flag::value(
            "gen-length",
            "N",
            "tokens generated per request (default 256)",
        ),
        Flag::value("steps", "N", "denoising steps per request (default 128)"),
        Flag::value("block-length", "N", "block size (default 32)"),
        Flag::value(
            "groups",
            "N",
            "shared system prompts in the workload (default 2)",
        ),
        Flag::value("per-group", "N", "requests per system prompt (default 4)"),
        Flag::value(
            "batch",
            "LIST",
            "requests in the batch at once, e.g. 1,4: BiCache requests sharing a prefix are \
             served by a batch session (continuous batching), up to N in the same forward \
             passes (default 1; sizes above 1 run BiCache modes only)",
        ),
        Flag::value(
            "prefix-tokens",
            "N",
            "tokens of each shared system prompt (default 1024)",
        ),
        Flag::value(
            "user-tokens",
            "N",
            "tokens of each request's own part (default 64)",
        ),
        Flag::value("seed", "S", "seed of the workload's token ids (default 0)"),
        Flag::value(
            "peak-gflops",
            "X",
            "the adapter's peak GFLOP/s, for the share-of-peak figures (known for H100/H200)",
        ),
        Flag::value("peak-gbs", "X", "the adapter's peak memory GB/s"),
        Flag::value(
            "out",
            "FILE",
            "write the JSON lines to FILE (default: standard output)",
        ),
        BACKEND,
        DTYPE,
        options::WEIGHTS,
        options::EMBED_WEIGHTS,
    ];
    flags.extend(options::bicache_flags());
    CommandSpec {
        name: "bench",
        summary: "Benchmark kernels at the model's shapes and requests per cache mode (JSON lines).",
        usage: "unmask bench [--model DIR | --config llada-8b] [--only kernels|requests] [--out FILE]",
        flags,
        notes: "Each line is one record: the adapter, backend, driver, commit and model, then the\n\
                figures (medians after a warm-up). Kernel records: GFLOP/s, GB/s and, when the\n\
                peak is known or given, the share of it. Request records: throughput (canvas and\n\
                answer tokens/s), time to the first step, forward passes, token-layer passes and\n\
                GPU memory, per cache mode and decoding, on a workload of shared system prompts\n\
                made of token ids (no tokenizer needed). The prefix store is emptied before each\n\
                mode, so BiCache figures include its first misses.",
    }
}

fn list<T>(
    m: &Matches,
    flag: &str,
    expected: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<Vec<T>>, CliError> {
    let Some(text) = m.value(flag) else {
        return Ok(None);
    };
    text.split(',')
        .map(|part| parse(part.trim()).ok_or_else(|| invalid(flag, expected, text)))
        .collect::<Result<Vec<T>, _>>()
        .map(Some)
}

fn positive(m: &Matches, flag: &str, default: usize) -> Result<usize, CliError> {
    Ok(m.checked(flag, "a whole number >= 1", |v: usize| v >= 1)?
        .unwrap_or(default))
}

/// The kernel shapes' config: the model's, `--config FILE`, or a preset.
fn shapes_config(m: &Matches, model: Option<&Path>) -> Result<(String, LladaConfig), CliError> {
    if let Some(dir) = model {
        let cfg = LladaConfig::from_file(dir)
            .map_err(|e| CliError::context(format!("cannot read {}", dir.display()), e))?;
        return Ok((model_name(dir), cfg));
    }
    let name = m.value("config").unwrap_or("tiny");
    let path = PathBuf::from(name);
    if path.exists() {
        let cfg = LladaConfig::from_file(&path)
            .map_err(|e| CliError::context(format!("cannot read {}", path.display()), e))?;
        return Ok((model_name(&path), cfg));
    }
    let cfg = LladaConfig::preset(name).ok_or_else(|| {
        invalid(
            "config",
            &format!(
                "a preset ({}) or an existing config.json",
                LladaConfig::PRESETS.join(", ")
            ),
            name,
        )
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

/// Where records go: a file or standard output, one JSON object per line, flushed per
/// record so a long run can be watched and a killed one keeps what it measured.
struct Sink {
    out: Box<dyn Write>,
    path: Option<PathBuf>,
}

impl Sink {
    fn open(path: Option<&str>) -> Result<Self, CliError> {
        match path {
            None => Ok(Self {
                out: Box::new(std::io::stdout()),
                path: None,
            }),
            Some(p) => {
                let path = PathBuf::from(p);
                if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent).map_err(|e| {
                        CliError::context(format!("cannot create {}", parent.display()), e)
                    })?;
                }
                let file = File::create(&path).map_err(|e| {
                    CliError::context(format!("cannot create {}", path.display()), e)
                })?;
                Ok(Self {
                    out: Box::new(BufWriter::new(file)),
                    path: Some(path),
                })
            }
        }
    }

    fn write(&mut self, record: &Value) -> Result<(), CliError> {
        let where_ = || {
            self.path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "standard output".into())
        };
        writeln!(self.out, "{record}")
            .and_then(|()| self.out.flush())
            .map_err(|e| CliError::context(format!("cannot write {}", where_()), e))
    }
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

pub fn run(m: &Matches) -> Result<(), CliError> {
    let model = match (m.value("model"), m.value("config")) {
        (Some(_), Some(_)) => {
            return Err(CliError::usage(
                "give --model (kernels and requests) or --config (kernels only), not both",
            ));
        }
        (Some(_), None) => Some(options::model_dir(m)?),
        (None, Some(_)) => None,
        (None, None) => Some(options::model_dir(m)?),
    };
    let (kernels, requests) = match m.choice("only", &["kernels", "requests"])? {
        Some("kernels") => (true, false),
        Some(_) => (false, true),
        None => (true, model.is_some()),
    };
    if requests && model.is_none() {
        return Err(CliError::usage(
            "request benchmarks need weights: give --model DIR (unmask synth makes a synthetic one)",
        ));
    }
    let gen_length = positive(m, "gen-length", 256)?;
    let steps = positive(m, "steps", 128)?;
    let block_length = positive(m, "block-length", 32)?;
    let params = GenerationParams {
        gen_length,
        steps,
        block_length,
        ..GenerationParams::default()
    };
    params.validate(1, usize::MAX).map_err(|e| {
        CliError::usage(format!("invalid --gen-length/--steps/--block-length: {e}"))
    })?;
    let workload = Workload {
        groups: positive(m, "groups", 2)?,
        per_group: positive(m, "per-group", 4)?,
        prefix_tokens: positive(m, "prefix-tokens", 1024)?,
        user_tokens: positive(m, "user-tokens", 64)?,
        seed: m.parsed("seed", "a whole number >= 0")?.unwrap_or(0),
    };
    let request_len = workload.prefix_tokens + workload.user_tokens + gen_length;
    let threshold = m
        .checked("threshold", "a number in (0, 1]", |t: f32| {
            t > 0.0 && t <= 1.0
        })?
        .unwrap_or(0.9);
    let decodings = list(
        m,
        "decoding",
        "quota, threshold or quota,threshold",
        |s| match s {
            "quota" => Some(Decoding::Quota),
            "threshold" => Some(Decoding::Threshold(threshold)),
            _ => None,
        },
    )?
    .unwrap_or(vec![Decoding::Quota, Decoding::Threshold(threshold)]);
    let modes = if m.value("cache").is_some() {
        options::cache_modes(m)?
    } else {
        CacheMode::ALL.to_vec()
    };
    let bicache = options::bicache_settings(m, &modes)?;
    let formats = list(
        m,
        "formats",
        "a list of f32, f16-packed, f16, q8, q4",
        // Also the name records give `f16` (`WeightFormat::name`), so a record's format can
        // be asked for again.
        |s| match s {
            "f16-native" => Some(WeightFormat::F16Native),
            s => options::parse_weight_format(s),
        },
    )?
    .unwrap_or(vec![
        WeightFormat::F32,
        WeightFormat::F16Native,
        WeightFormat::Q8,
        WeightFormat::Q4,
    ]);
    let rows = list(m, "rows", "a list of whole numbers >= 1", |s| {
        s.parse::<usize>().ok().filter(|&v| v >= 1)
    })?
    .unwrap_or(vec![block_length, request_len]);
    let kv_lens = list(m, "kv-lens", "a list of whole numbers >= 1", |s| {
        s.parse::<usize>().ok().filter(|&v| v >= 1)
    })?
    .unwrap_or(vec![request_len]);
    let peak_flag = |flag: &str| m.checked(flag, "a number > 0", |v: f64| v > 0.0);
    let (peak_gflops, peak_gbs) = (peak_flag("peak-gflops")?, peak_flag("peak-gbs")?);
    let mut sink = Sink::open(m.value("out"))?;

    let engine_options = options::engine_options(m)?;
    let engine = match (&model, requests) {
        (Some(dir), true) => Some(options::load_engine(dir, &engine_options)?),
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
                ..ContextOptions::default()
            })
            .map_err(|e| CliError::context("cannot open a GPU adapter", e))?
        }
    };
    eprintln!("[gpu] {}", ctx.describe());
    let (name, cfg) = shapes_config(m, model.as_deref())?;
    let peak = match (peak_gflops, peak_gbs) {
        (None, None) => bench::known_peak(&ctx.info.name),
        (g, b) => Some(Peak {
            gflops: g,
            gbs: b,
            source: "command line".into(),
        }),
    };
    if let Some(p) = &peak {
        eprintln!(
            "peak: {:?} GFLOP/s, {:?} GB/s ({})",
            p.gflops, p.gbs, p.source
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
            all_variants: !m.switch("auto-only"),
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
            bench::run_kernel_case(&ctx, &envelope, &case, &kernel_options, &mut on_record)
                .map_err(|e| CliError::context(format!("kernel benchmark {}", case.name()), e))?;
        }
    }
    if let Some(engine) = &engine {
        let max = engine.config().max_sequence_length;
        if request_len > max {
            return Err(CliError::usage(format!(
                "--prefix-tokens {} + --user-tokens {} + --gen-length {gen_length} = {request_len} \
                 exceed the model's maximum sequence length {max}",
                workload.prefix_tokens, workload.user_tokens
            )));
        }
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
        let reqs = workload.requests(ordinary, &avoid);
        let warmup = Workload {
            groups: 1,
            per_group: 1,
            seed: workload.seed ^ 0xFFFF,
            ..workload.clone()
        }
        .requests(ordinary, &avoid)
        .remove(0);
        let envelope = bench::envelope(engine.ctx(), &name, cfg, &weights);
        let request_options = RequestBenchOptions {
            params,
            modes,
            decodings,
            refresh_every: bicache.refresh_every,
            depth: bicache.depth,
            batches: list(m, "batch", "sizes >= 1, e.g. 1,2,4", |v| {
                v.parse().ok().filter(|&n: &usize| n >= 1)
            })?
            .unwrap_or_else(|| vec![1]),
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
