//! `unmask trace`: the dispatch list of one denoising step per cache mode (DiffusionGemma:
//! of its decoder step), counted per layer and timed per dispatch and per kernel family (GPU
//! timestamps where the adapter has them).

use std::collections::BTreeMap;

use clap::Args;
use serde_json::{Value, json};
use unmask::{CacheMode, Prompt, Request};
use unmask_gpu::{HostCounts, StepTrace, TraceClock, TraceOptions};

use crate::error::CliError;
use crate::options::{self, GenerationArgs, ModelArgs, RunArgs};
use crate::{output, values};

/// Labels of the submits that are denoising steps (others build prefix entries, encode
/// prompts and commits, or warm up).
const STEP_LABELS: [&str; 3] = [
    "denoise step",
    "bicache step",
    "diffusion gemma denoising step",
];

#[derive(Args, Debug)]
#[command(
    about = "List (and time) the dispatches of one denoising step per cache mode.",
    override_usage = "unmask trace [--model <DIR>] [--prompt <TEXT> | --prompt-ids <IDS>] [--cache all] \
                      [--step 2] [--timing] [--list] [OPTIONS]",
    after_help = "A step is one submit: the list shows its dispatches in order with their kernel,\n\
                  variant, layer and workgroups; the counts say what the host created for it\n\
                  (a steady-state step creates no buffer and no bind group)."
)]
pub struct TraceArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// the user message (default: a fixed question; needs a tokenizer)
    #[arg(long, value_name = "TEXT", conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// a system message before the prompt
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// token ids used as they are, e.g. 1,2,3 (no tokenizer needed)
    // The path spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    prompt_ids: Option<::std::vec::Vec<u32>>,
    #[command(flatten)]
    generation: GenerationArgs,
    /// `all` (default) or a comma-separated list of cache modes to trace
    #[arg(long, value_name = "MODES", value_parser = values::cache_modes)]
    cache: Option<::std::vec::Vec<CacheMode>>,
    /// tokens of the shared prefix for prefix-arm and BiCache (default: the turns before the
    /// last user message; every token with --prompt-ids)
    #[arg(long, value_name = "N", value_parser = values::whole, allow_negative_numbers = true)]
    prefix_len: Option<usize>,
    /// which denoising step to show, from 1 (default 2: a step that reuses the cache)
    #[arg(
        long,
        value_name = "N",
        value_parser = values::positive,
        allow_negative_numbers = true,
        default_value_t = 2,
        hide_default_value = true
    )]
    step: usize,
    /// time every dispatch (GPU timestamps where the adapter has them, else CPU wall clock
    /// around each dispatch alone; the output says which)
    #[arg(long)]
    timing: bool,
    /// print every dispatch, not only the counts and families
    #[arg(long)]
    list: bool,
    #[command(flatten)]
    run: RunArgs,
    /// print one JSON object per mode: the step's dispatches, counts and times
    #[arg(long)]
    json: bool,
}

pub fn run(args: &TraceArgs) -> Result<(), CliError> {
    let (params, decode) = args.generation.params()?;
    let modes = args
        .cache
        .clone()
        .unwrap_or_else(|| CacheMode::ALL.to_vec());
    let prefix_len = args.prefix_len;
    let step = args.step;
    let bicache = args.run.bicache.settings(&modes);
    let engine_options = args.run.engine_options()?;
    let timing = args.timing;
    let json = args.json;
    let list = args.list;
    let dir = args.model.dir()?;
    if crate::dgemma::is_diffusion_gemma(&dir) {
        crate::dgemma::refuse_masked_flags(&args.generation.sampling)?;
        return trace_dgemma(args, &dir, &engine_options);
    }
    let engine = options::load_engine(&dir, &engine_options)?;
    let prompt = prompt(args, engine.tokenizer().is_some())?;
    if let Prompt::Ids(ids) = &prompt {
        options::check_ids(&engine, "prompt-ids", ids)?;
    }
    let prompt_len = engine.encode_prompt(&prompt)?.len();
    options::check_length(&engine, prompt_len, 0, &params)?;
    let n_layers = engine.config().n_layers;
    for mode in modes {
        let mut request = Request {
            prompt: prompt.clone(),
            params: params.clone(),
            decode,
            cache: mode,
            prefix_len,
            recompute_all: false,
            depth: bicache.depth,
            refresh_every: bicache.refresh_every,
            span: None,
            anchor_ratio: bicache.anchor_ratio,
            adaptive: bicache.adaptive,
            record_picks: false,
            suffix: Vec::new(),
            full_canvas: bicache.full_canvas,
            logprobs: false,
            top_logprobs: 0,
        };
        // ACache's span: the shared prefix after its first token (a span at an offset).
        if mode == CacheMode::Acache {
            let (_, p) = engine.encode_with_prefix(&request)?;
            request.span = (p > 1).then_some(unmask::Span::Tokens(1..p));
        }
        // Untraced first: pipelines compile and the prefix store fills (BiCache hits).
        engine.generate(&request)?;
        engine.ctx().start_trace(TraceOptions { timing });
        let generated = engine.generate(&request);
        let traces = engine.ctx().finish_trace();
        let generation = generated?;
        let report = StepReport::pick(&traces, step, mode.name())?;
        let traced = Traced {
            cache: Some(mode),
            ctx: engine.ctx(),
            canvas_tokens_per_s: generation.timings.throughput_canvas,
            n_layers,
        };
        if json {
            output::line(&report.json(&traced).to_string())?;
        } else {
            output::partial(&report.text(&traced, list))?;
        }
    }
    Ok(())
}

/// `unmask trace` on a DiffusionGemma folder: one decoder step of a request (the family has
/// no cache modes; its prompt K/V are exact).
fn trace_dgemma(
    args: &TraceArgs,
    dir: &std::path::Path,
    engine_options: &unmask::EngineOptions,
) -> Result<(), CliError> {
    if let Some(m) = args.cache.iter().flatten().find(|m| **m != CacheMode::None) {
        return Err(CliError::usage(format!(
            "--cache {m}: DiffusionGemma has no cache modes (its prompt's K/V never change): \
             leave --cache out"
        )));
    }
    let engine = unmask::DgemmaEngine::load(dir, engine_options)?;
    let request = unmask::DgemmaRequest {
        seed: args.generation.sampling.seed.unwrap_or(0),
        max_new_tokens: args.generation.sampling.gen_length,
        max_denoising_steps: args.generation.sampling.steps,
        logit_bias: args.generation.sampling.logit_bias.clone(),
        ..unmask::DgemmaRequest::new(prompt(args, engine.tokenizer().is_some())?)
    };
    // Untraced first: pipelines compile and the prefix store takes the system turn.
    engine.generate(&request)?;
    engine.ctx().start_trace(TraceOptions {
        timing: args.timing,
    });
    let generated = engine.generate(&request);
    let traces = engine.ctx().finish_trace();
    let out = generated?;
    let report = StepReport::pick(&traces, args.step, "diffusion_gemma")?;
    let canvas = engine.config().canvas_length;
    let traced = Traced {
        cache: None,
        ctx: engine.ctx(),
        canvas_tokens_per_s: (out.canvases.len() * canvas) as f64 / out.seconds.max(1e-9),
        n_layers: engine.config().layers.len(),
    };
    if args.json {
        output::line(&report.json(&traced).to_string())
    } else {
        output::partial(&report.text(&traced, args.list))
    }
}

/// What a traced request ran on and gave.
struct Traced<'a> {
    /// The cache mode (`None`: DiffusionGemma).
    cache: Option<CacheMode>,
    ctx: &'a unmask_gpu::GpuContext,
    canvas_tokens_per_s: f64,
    n_layers: usize,
}

/// `--prompt-ids`, else a chat of `--system` and `--prompt` (clap lets only one of
/// `--prompt` and `--prompt-ids` through), each with a default.
fn prompt(args: &TraceArgs, has_tokenizer: bool) -> Result<Prompt, CliError> {
    match &args.prompt_ids {
        Some(ids) => Ok(Prompt::Ids(ids.clone())),
        None => {
            if !has_tokenizer {
                return Err(CliError::usage(
                    "the model has no tokenizer.json: give the prompt as --prompt-ids 1,2,3",
                ));
            }
            // A system turn by default, so prefix-arm and BiCache have a prefix to share.
            let system = args
                .system
                .as_deref()
                .unwrap_or("You are a careful assistant. Answer briefly.");
            let mut messages = vec![unmask_core::chat::Message::system(system)];
            messages.push(unmask_core::chat::Message::user(
                args.prompt
                    .as_deref()
                    .unwrap_or("What is 17 plus 25? Answer with the number."),
            ));
            Ok(Prompt::Chat(messages))
        }
    }
}

/// One traced step of a request and what the host did for it.
struct StepReport<'t> {
    /// The cache mode's name, or the family's.
    subject: &'static str,
    /// 1-based among the request's denoising steps.
    index: usize,
    steps: usize,
    trace: &'t StepTrace,
    /// Host counters from the previous submit's to this one's.
    host: HostCounts,
    /// Submits of the whole request, and those that were not denoising steps.
    submits: usize,
}

impl<'t> StepReport<'t> {
    fn pick(traces: &'t [StepTrace], step: usize, subject: &'static str) -> Result<Self, CliError> {
        let steps: Vec<usize> = (0..traces.len())
            .filter(|&i| STEP_LABELS.contains(&traces[i].label))
            .collect();
        let &at = steps.get(step - 1).ok_or_else(|| {
            CliError::usage(format!(
                "--step {step}: the {subject} request ran {} denoising steps",
                steps.len()
            ))
        })?;
        let trace = &traces[at];
        let before = if at == 0 {
            HostCounts::default()
        } else {
            traces[at - 1].host
        };
        // The first submit of the request has no predecessor to subtract; report it whole
        // only when asked for (step 1 of a request whose first submit is this step).
        let host = if at == 0 {
            HostCounts {
                submits: 1,
                dispatches: trace.dispatches.len() as u64,
                ..HostCounts::default()
            }
        } else {
            trace.host - before
        };
        Ok(Self {
            subject,
            index: step,
            steps: steps.len(),
            trace,
            host,
            submits: traces.len(),
        })
    }

    /// (family, dispatches, ms) per kernel family, most time (or most dispatches) first.
    fn families(&self) -> Vec<(String, usize, Option<f64>)> {
        let mut by: BTreeMap<String, (usize, Option<f64>)> = BTreeMap::new();
        for d in &self.trace.dispatches {
            let e = by.entry(d.kernel.clone()).or_insert((0, None));
            e.0 += 1;
            if let Some(ms) = d.ms {
                e.1 = Some(e.1.unwrap_or(0.0) + ms);
            }
        }
        let mut out: Vec<_> = by.into_iter().map(|(k, (n, ms))| (k, n, ms)).collect();
        out.sort_by(|a, b| {
            b.2.unwrap_or(0.0)
                .total_cmp(&a.2.unwrap_or(0.0))
                .then(b.1.cmp(&a.1))
        });
        out
    }

    fn total_ms(&self) -> Option<f64> {
        self.trace
            .dispatches
            .iter()
            .map(|d| d.ms)
            .sum::<Option<f64>>()
    }

    fn per_layer_text(counts: &[usize]) -> String {
        let first = counts.first().copied().unwrap_or(0);
        if counts.iter().all(|&c| c == first) {
            format!("{first} in each of {} layers", counts.len())
        } else {
            format!("{counts:?}")
        }
    }

    fn text(&self, run: &Traced<'_>, list: bool) -> String {
        let t = self.trace;
        let per_layer = t.per_layer(run.n_layers);
        let in_layers: usize = per_layer.iter().sum();
        let mut out = format!(
            "{} — step {} of {} (\"{}\"), clock {}\n",
            self.subject,
            self.index,
            self.steps,
            t.label,
            t.clock.name()
        );
        out.push_str(&format!(
            "  dispatches {} ({} in layers: {}; {} outside), copies {}, submits {}\n",
            t.dispatches.len(),
            in_layers,
            Self::per_layer_text(&per_layer),
            t.dispatches.len() - in_layers,
            t.copies,
            self.host.submits
        ));
        out.push_str(&format!(
            "  created for this step: {} buffers, {} bind groups, {} read-back buffers{}\n",
            self.host.buffers_created,
            self.host.bind_groups_created,
            self.host.staging_buffers_created,
            t.encode_ms
                .map(|ms| format!("; host recorded and submitted it in {ms:.3} ms"))
                .unwrap_or_default()
        ));
        out.push_str(&format!(
            "  request: {} submits for {} steps, {:.1} canvas tokens/s (adapter {})\n",
            self.submits, self.steps, run.canvas_tokens_per_s, run.ctx.info.name
        ));
        let total = self.total_ms();
        out.push_str("  kernel family              dispatches        ms   share\n");
        for (family, n, ms) in self.families() {
            let (ms_text, share) = match (ms, total) {
                (Some(ms), Some(total)) if total > 0.0 => {
                    (format!("{ms:9.3}"), format!("{:6.1}%", 100.0 * ms / total))
                }
                _ => ("        -".into(), "      -".into()),
            };
            out.push_str(&format!("  {family:<26} {n:>10} {ms_text} {share}\n"));
        }
        if let Some(total) = total {
            out.push_str(&format!("  {:<26} {:>10} {total:9.3}\n", "total", ""));
        }
        if list {
            out.push_str("  #    layer  kernel                     workgroups      ms  variant\n");
            for (i, d) in t.dispatches.iter().enumerate() {
                let layer = d.layer.map_or("-".to_string(), |l| l.to_string());
                let groups = format!(
                    "{}x{}x{}",
                    d.workgroups[0], d.workgroups[1], d.workgroups[2]
                );
                let ms = d.ms.map_or("-".to_string(), |ms| format!("{ms:.3}"));
                out.push_str(&format!(
                    "  {i:<4} {layer:>5}  {:<26} {groups:>10} {ms:>7}  {}\n",
                    d.kernel, d.variant
                ));
            }
        }
        out.push('\n');
        out
    }

    fn json(&self, run: &Traced<'_>) -> Value {
        let n_layers = run.n_layers;
        let t = self.trace;
        let families: Vec<Value> = self
            .families()
            .into_iter()
            .map(|(family, n, ms)| json!({"kernel": family, "dispatches": n, "ms": ms}))
            .collect();
        let dispatches: Vec<Value> = t
            .dispatches
            .iter()
            .map(|d| {
                json!({
                    "kernel": d.kernel,
                    "variant": d.variant,
                    "layer": d.layer,
                    "workgroups": d.workgroups,
                    "ms": d.ms,
                })
            })
            .collect();
        json!({
            "cache": run.cache.map(|m| m.name()),
            // Set for DiffusionGemma, whose step has no cache mode.
            "family": run.cache.is_none().then_some(self.subject),
            "step": self.index,
            "steps": self.steps,
            "label": t.label,
            "clock": t.clock.name(),
            "adapter": run.ctx.info.name,
            "backend": format!("{:?}", run.ctx.info.backend),
            "n_layers": n_layers,
            "dispatches_per_layer": t.per_layer(n_layers),
            "dispatch_count": t.dispatches.len(),
            "copies": t.copies,
            "encode_ms": t.encode_ms,
            "host": {
                "submits": self.host.submits,
                "bind_groups_created": self.host.bind_groups_created,
                "buffers_created": self.host.buffers_created,
                "staging_buffers_created": self.host.staging_buffers_created,
            },
            "request_submits": self.submits,
            "canvas_tokens_per_s": run.canvas_tokens_per_s,
            "total_ms": self.total_ms(),
            "families": families,
            "dispatches": dispatches,
            "timed": t.clock != TraceClock::None,
        })
    }
}
