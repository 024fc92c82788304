//! `unmask generate`: one generation from a chat prompt or from token ids.

use std::io::IsTerminal;

use clap::{ArgGroup, Args};
use serde_json::{Value, json};
use unmask::{
    BicacheReport, CacheMode, Engine, Generation, GenerationParams, Prompt, Request, Schedule, Span,
};

use crate::error::CliError;
use crate::live::CanvasView;
use crate::options::{self, CacheArgs, GenerationArgs, ModelArgs, PromptArgs, RunArgs};
use crate::{output, values};

#[derive(Args, Debug)]
#[command(
    about = "Generate an answer by iterative unmasking.",
    override_usage = "unmask generate [--model <DIR>] (--prompt <TEXT> [--system <TEXT>] | --prompt-ids <IDS>) [OPTIONS]",
    after_help = "On a terminal the canvas is shown while it denoises; otherwise only the answer\n\
                  is printed (the generated ids, comma-separated, with --prompt-ids).",
    group(ArgGroup::new("input").required(true).args(["prompt", "prompt_ids"]))
)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: PromptArgs,
    /// infilling: text after the generated canvas, which every step sees and none predicts
    /// (tokenized as it is, no chat template); the answer is the canvas between
    #[arg(long, value_name = "TEXT", conflicts_with = "suffix_ids")]
    suffix: Option<String>,
    /// infilling: token ids after the generated canvas, e.g. 4,5,6
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    suffix_ids: Option<::std::vec::Vec<u32>>,
    #[command(flatten)]
    generation: GenerationArgs,
    #[command(flatten)]
    cache: CacheArgs,
    /// tokens of the shared prefix for --cache prefix-arm, bicache, bicache-dual (default:
    /// the turns before the last user message; every token with --prompt-ids)
    #[arg(long, value_name = "N", value_parser = values::whole, allow_negative_numbers = true)]
    prefix_len: Option<usize>,
    /// ACache: a file whose text is the prompt's shared span (a document, a table, few-shot
    /// examples); it goes where the system prompt says {affix}, else after the system
    /// prompt on a line of its own (or is the system prompt when there is none)
    #[arg(long, value_name = "FILE")]
    affix_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    run: RunArgs,
    /// print one JSON object: ids, text, cache mode, BiCache report, per-step commits, timings
    #[arg(long)]
    json: bool,
    /// with --json: each canvas token's log-probability under the model's softmax at the
    /// step that committed it ("logprobs", null where a position was never committed)
    #[arg(long, requires = "json")]
    logprobs: bool,
    /// with --json: also each position's N most likely ids with their log-probabilities
    /// ("top_logprobs", at most 20; implies --logprobs)
    #[arg(long, value_name = "N", requires = "json", value_parser = clap::value_parser!(u32).range(0..=unmask::MOST_TOP_LOGPROBS as i64))]
    top_logprobs: Option<u32>,
}

pub fn run(args: &GenerateArgs) -> Result<(), CliError> {
    let affix = affix(args)?;
    let prompt = prompt(args, affix.as_deref())?;
    let (params, decode) = args.generation.params()?;
    let cache = args.cache.mode;
    let prefix_len = args.prefix_len;
    if prefix_len.is_some() && cache != CacheMode::PrefixArm && !cache.is_bicache() {
        eprintln!(
            "note: --prefix-len is used only by --cache prefix-arm, bicache and bicache-dual \
             (the cache is {cache})"
        );
    }
    let bicache = args.run.bicache.settings(&[cache]);
    let engine_options = args.run.engine_options()?;
    let json = args.json;
    let dir = args.model.dir()?;
    if crate::dgemma::is_diffusion_gemma(&dir) {
        if let Some(k) = args.top_logprobs.filter(|&k| k > 0) {
            return Err(CliError::usage(format!(
                "--top-logprobs {k}: DiffusionGemma reports each token's own log-probability \
                 (--logprobs), not the most likely others"
            )));
        }
        crate::dgemma::refuse_masked_flags(&args.generation.sampling)?;
        let run = crate::dgemma::DgemmaRun {
            seed: params.seed,
            max_new_tokens: args.generation.sampling.gen_length,
            max_steps: args.generation.sampling.steps,
            json,
            logprobs: args.logprobs || args.top_logprobs.is_some(),
            logit_bias: params.bias.ids.clone(),
        };
        return crate::dgemma::generate(&dir, &engine_options, prompt, run);
    }
    let engine = options::load_engine(&dir, &engine_options)?;
    if let Prompt::Ids(ids) = &prompt {
        options::check_ids(&engine, "prompt-ids", ids)?;
        if cache != CacheMode::None && ids.contains(&engine.special().mask) {
            return Err(CliError::usage(format!(
                "--prompt-ids holds the mask token {}: infilling needs --cache none \
                 (--cache {cache} predicts only the current block)",
                engine.special().mask
            )));
        }
    }
    let suffix = suffix(&engine, args)?;
    let prompt_len = engine.encode_prompt(&prompt)?.len();
    options::check_length(&engine, prompt_len, suffix.len(), &params)?;
    if let Some(p) = prefix_len.filter(|&p| p > prompt_len) {
        return Err(CliError::usage(format!(
            "--prefix-len {p} exceeds the prompt's {prompt_len} tokens"
        )));
    }
    let by_ids = matches!(prompt, Prompt::Ids(_));
    if affix.is_some() && cache != CacheMode::Acache {
        eprintln!("note: --affix-file marks the shared span only for --cache acache");
    }
    let request = Request {
        prompt,
        params,
        decode,
        cache,
        prefix_len,
        recompute_all: false,
        depth: bicache.depth,
        refresh_every: bicache.refresh_every,
        span: affix.map(Span::Text),
        anchor_ratio: bicache.anchor_ratio,
        adaptive: bicache.adaptive,
        record_picks: false,
        suffix,
        full_canvas: bicache.full_canvas,
        logprobs: args.logprobs,
        top_logprobs: args.top_logprobs.unwrap_or(0) as usize,
    };
    let live = !json && std::io::stdout().is_terminal();
    let generation = generate(&engine, &request, live)?;
    let unfilled = generation
        .ids
        .iter()
        .filter(|&&t| t == engine.special().mask)
        .count();
    if unfilled > 0 && !generation.timings.finished_early {
        // The reference's rule: masks inside the prompt compete with the canvas for the
        // same per-step quota, so some can stay masked.
        eprintln!(
            "note: {unfilled} position(s) still hold the mask token {}: the prompt's masks \
             share the canvas's per-step quota; add steps or generated tokens to fill them",
            engine.special().mask
        );
    }
    if json {
        output::line(&generation_json(&engine, &request.params, &generation).to_string())?;
    } else if by_ids {
        output::line(&join_ids(&generation.ids))?;
    } else {
        output::line(generation.text.as_deref().unwrap_or(""))?;
    }
    eprintln!("{}", summary(&generation));
    Ok(())
}

/// `--suffix`'s or `--suffix-ids`' tokens (none without either).
fn suffix(engine: &Engine, args: &GenerateArgs) -> Result<Vec<u32>, CliError> {
    let (flag, ids) = match (&args.suffix, &args.suffix_ids) {
        (Some(text), _) => ("suffix", engine.encode_text(text)?),
        (None, Some(ids)) => ("suffix-ids", ids.clone()),
        (None, None) => return Ok(Vec::new()),
    };
    if ids.is_empty() {
        return Err(CliError::usage(format!(
            "--{flag}: expected at least one token, found none"
        )));
    }
    options::check_ids(engine, flag, &ids)?;
    if let Some(i) = ids.iter().position(|&t| t == engine.special().mask) {
        return Err(CliError::usage(format!(
            "--{flag}: holds the mask token {} at position {i}; the suffix is context, the \
             canvas before it is what is predicted",
            engine.special().mask
        )));
    }
    Ok(ids)
}

/// Where `--affix-file`'s text goes in the system prompt.
pub const AFFIX_MARKER: &str = "{affix}";

/// `--affix-file`'s text (its final line break dropped).
fn affix(args: &GenerateArgs) -> Result<Option<String>, CliError> {
    let Some(path) = &args.affix_file else {
        return Ok(None);
    };
    if args.input.prompt_ids.is_some() {
        return Err(CliError::usage(
            "--affix-file needs --prompt TEXT; with --prompt-ids the span is a range of the ids",
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        CliError::context(
            format!("cannot read the affix file {}: {e}", path.display()),
            e,
        )
    })?;
    let text = text.strip_suffix('\n').unwrap_or(&text).to_string();
    if text.trim().is_empty() {
        return Err(CliError::usage(format!(
            "the affix file {} is empty: expected the text of the shared span",
            path.display()
        )));
    }
    Ok(Some(text))
}

/// The system prompt with the affix in it: at `{affix}`, else on a line after it.
pub fn system_with_affix(system: Option<&str>, affix: &str) -> String {
    match system {
        Some(s) if s.contains(AFFIX_MARKER) => s.replacen(AFFIX_MARKER, affix, 1),
        Some(s) => format!("{s}\n{affix}"),
        None => affix.to_string(),
    }
}

/// The prompt: `--prompt` (with `--system` and the affix) or `--prompt-ids`; clap lets
/// exactly one of them through.
fn prompt(args: &GenerateArgs, affix: Option<&str>) -> Result<Prompt, CliError> {
    let system = match affix {
        Some(a) => Some(system_with_affix(args.input.system.as_deref(), a)),
        None => args.input.system.clone(),
    };
    args.input.prompt(system)
}

/// Runs one request, showing the canvas live when `live` is set.
pub fn generate(engine: &Engine, request: &Request, live: bool) -> Result<Generation, CliError> {
    if !live {
        return Ok(engine.generate(request)?);
    }
    let total = match request.params.threshold {
        Some(_) => None,
        None => Some(request.params.steps),
    };
    let end_ids = [Some(engine.special().eos), engine.special().eot]
        .into_iter()
        .flatten()
        .collect();
    let mut view = CanvasView::new(engine.tokenizer(), end_ids, total);
    let result = engine.generate_with(request, &mut |event| view.step(event));
    view.clear();
    Ok(result?)
}

pub fn join_ids(ids: &[u32]) -> String {
    ids.iter()
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// One line on stderr: how much was generated, how fast, and with which cache.
pub fn summary(g: &Generation) -> String {
    let t = &g.timings;
    format!(
        "{} tokens ({} before the end of the answer), {} steps, {} forward passes, \
         {} token-layer passes in {:.2} s ({:.1} tokens/s; first step {:.2} s; cache {}{})",
        g.ids.len(),
        t.answer_tokens,
        t.steps,
        t.forward_passes,
        t.token_layer_passes,
        t.total_s,
        tokens_per_s(g),
        t.first_step_s,
        g.cache,
        g.bicache.as_ref().map(bicache_text).unwrap_or_default()
    ) + &if t.finished_early {
        format!(
            "; the answer was final after {} steps, {} skipped (--full-canvas runs them)",
            t.steps, t.steps_skipped
        )
    } else {
        String::new()
    }
}

/// `: depth 3 at r = 85, hit` or `: ran as none: <why>`, for the summary line.
fn bicache_text(b: &BicacheReport) -> String {
    match &b.fallback {
        Some(why) => format!(": {why}"),
        None => format!(
            ": depth {} at r = {}, {}",
            b.depth,
            b.ratio,
            if b.hit { "hit" } else { "miss" }
        ),
    }
}

/// What BiCache did, or null for other modes.
pub fn bicache_json(g: &Generation) -> Value {
    match &g.bicache {
        Some(b) => json!({
            "depth": b.depth,
            "ratio": b.ratio,
            "hit": b.hit,
            "entry_tokens": b.entry_tokens,
            "entry_bytes": b.entry_bytes,
            "fallback": b.fallback,
        }),
        None => Value::Null,
    }
}

fn tokens_per_s(g: &Generation) -> f64 {
    if g.timings.total_s > 0.0 {
        g.ids.len() as f64 / g.timings.total_s
    } else {
        0.0
    }
}

/// An f32 as the JSON number a person would write (0.7, not 0.699999988).
fn short_f32(v: f32) -> Value {
    v.to_string()
        .parse::<f64>()
        .ok()
        .and_then(|f| serde_json::Number::from_f64(f).map(Value::Number))
        .unwrap_or(Value::Null)
}

pub fn params_json(p: &GenerationParams) -> Value {
    json!({
        "gen_length": p.gen_length,
        "steps": p.steps,
        "block_length": p.block_length,
        "temperature": short_f32(p.temperature),
        "remasking": p.remasking.name(),
        "schedule": match p.schedule {
            Schedule::Auto => json!("auto"),
            Schedule::Llada => json!("llada"),
            Schedule::Dream { eps } => json!({"dream": {"eps": eps}}),
        },
        "alg_temp": short_f32(p.alg_temp),
        "top_p": p.top_p.map(short_f32),
        "top_k": p.top_k,
        "min_p": p.min_p.map(short_f32),
        "cfg_scale": short_f32(p.cfg_scale),
        "threshold": p.threshold.map(short_f32),
        "seed": p.seed,
        "logits_eos_inf": p.logits_eos_inf,
        "confidence_eos_eot_inf": p.confidence_eos_eot_inf,
        "logit_bias": p.bias.ids.iter().map(|&(id, b)| (id.to_string(), short_f32(b))).collect::<serde_json::Map<_, _>>(),
        "presence_penalty": short_f32(p.bias.presence_penalty),
        "frequency_penalty": short_f32(p.bias.frequency_penalty),
        "repetition_penalty": short_f32(p.bias.repetition_penalty),
    })
}

pub fn timings_json(g: &Generation) -> Value {
    let t = &g.timings;
    json!({
        "setup_s": t.setup_s,
        "first_step_s": t.first_step_s,
        "total_s": t.total_s,
        "steps": t.steps,
        "forward_passes": t.forward_passes,
        "token_layer_passes": t.token_layer_passes,
        "tokens_per_s": tokens_per_s(g),
        "throughput_canvas": t.throughput_canvas,
        "throughput_answer": t.throughput_answer,
        "answer_tokens": t.answer_tokens,
        "finished_early": t.finished_early,
        "steps_skipped": t.steps_skipped,
        "forward_passes_skipped": t.forward_passes_skipped,
        "verified_row_layers": t.verified_row_layers,
    })
}

pub fn steps_json(g: &Generation) -> Value {
    g.steps
        .iter()
        .map(|r| {
            json!({
                "block": r.block,
                "step": r.step,
                "positions": r.committed.iter().map(|&(p, _)| p).collect::<Vec<_>>(),
                "tokens": r.committed.iter().map(|&(_, t)| t).collect::<Vec<_>>(),
            })
        })
        .collect()
}

/// The `--json` output of one generation.
pub fn generation_json(engine: &Engine, params: &GenerationParams, g: &Generation) -> Value {
    let mut params_value = params_json(params);
    // The cut the run used: the model's default when the flags named none.
    params_value["top_k"] = json!(engine.effective_top_k(params));
    json!({
        "adapter": engine.ctx().describe(),
        "model": engine.dir().display().to_string(),
        "weight_format": engine.model().weights.embedding.format.name(),
        "mask_id": engine.special().mask,
        "load_s": engine.load_s(),
        "params": params_value,
        "cache": g.cache.name(),
        "prefix_len": g.prefix_len,
        "bicache": bicache_json(g),
        "acache": g.acache,
        "prompt_ids": g.prompt_ids,
        "ids": g.ids,
        "suffix_len": g.suffix_len,
        "text": g.text,
        "logprobs": g.logprobs.as_ref().map(|l| l.iter().map(|t| t.as_ref().map(|t| t.logprob)).collect::<Vec<_>>()),
        "top_logprobs": g.logprobs.as_ref().filter(|l| l.iter().flatten().any(|t| !t.top.is_empty())).map(|l| l.iter().map(|t| t.as_ref().map(|t| &t.top)).collect::<Vec<_>>()),
        "steps": steps_json(g),
        "timings": timings_json(g),
    })
}
