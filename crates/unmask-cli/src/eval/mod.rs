//! `unmask eval`: exact-match accuracy and speed over a JSON-lines task set, for one or more
//! cache modes run over the same items with one loaded model.
//!
//! Every line of the set is an object `{"id", "task", "system", "user", "answer",
//! "prompt_group"}`. An item's prompt is the chat template over its system and user turns;
//! its output is the text after the last `####` of the decoded answer (the whole answer when
//! there is none), trimmed, and it is correct when that equals the expected answer.

mod anchors;
mod dgemma;
mod infill;
mod items;
mod report;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use unmask::{
    AcacheReport, AdaptiveRefresh, BicacheReport, CacheMode, Engine, EngineError, Generation,
    GenerationParams, Request,
};

use crate::error::{CliError, ErrorKind};
use crate::options::{self, CacheSettings, GenerationDefaults, ModelArgs, RunArgs, SamplingArgs};
use crate::{output, values};

pub use items::{ANSWER_MARKER, Item, load_set};
use report::{
    Context, Summary, kv_arena_bytes_per_position, markdown, report_json, summarize, task_columns,
};

/// Used when `--gen-length` is not given; `--steps` and `--block-length` default to it.
const DEFAULT_GEN_LENGTH: usize = 32;

/// Eval takes the sampling flags with its own defaults (32 tokens in one block) and without
/// `--raw`: answers are always decoded up to the end of the turn.
#[derive(Args, Debug)]
#[command(
    about = "Score exact-match answers on a task set, comparing cache modes.",
    override_usage = "unmask eval [--model <DIR>] --set <FILE> [--cache <MODE[,MODE...]|all>] [--limit <N>] \
                      [--json] [--markdown <FILE>] [--out <FILE>] [OPTIONS]",
    after_help = "Each item's answer is the text after the last \"####\" of the output (the whole\n\
                  output when there is none), trimmed; it counts when it equals the expected\n\
                  answer exactly. The model is loaded once and every mode runs over the same\n\
                  items. A progress line per item goes to stderr; the table (or, with --json,\n\
                  the JSON object) to stdout. The shared prefix of an item is its system turn;\n\
                  BiCache modes share one prefix store over the whole run, and without a depth\n\
                  table (bicache_depth.json, or --depth) they fall back and report why.",
    mut_arg("gen_length", |a| a.help("tokens to generate (default 32)")),
    mut_arg("block_length", |a| {
        a.help("semi-autoregressive block size (default: gen-length, a single block)")
    })
)]
pub struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// the task set: JSON lines {id, task, system, user, answer, prompt_group}
    #[arg(long, value_name = "FILE")]
    set: PathBuf,
    /// cache modes to compare, in this order: MODE[,MODE...] or all (none, fast-dllm-prefix,
    /// fast-dllm-dual, prefix-arm, bicache, bicache-dual, acache; default none)
    // The path spelled out: one value holding the list, not a value per occurrence.
    #[arg(long, value_name = "MODES", value_parser = values::cache_modes)]
    cache: Option<::std::vec::Vec<CacheMode>>,
    /// evaluate only the first N items of the set
    #[arg(long, value_name = "N", value_parser = values::positive, allow_negative_numbers = true)]
    limit: Option<usize>,
    /// run up to N items at once with continuous batching, each finished item's place taken
    /// by the next at the following step; items sharing a system prompt (BiCache) or none
    /// run in the same forward passes (default 1)
    #[arg(
        long,
        value_name = "N",
        value_parser = values::positive,
        allow_negative_numbers = true,
        default_value_t = 1,
        hide_default_value = true
    )]
    batch: usize,
    /// ACache: run acache once per anchor ratio of the list, in this order (e.g.
    /// 0,0.05,0.1,0.2,0.3,1), each a row of the table (instead of --anchor-ratio)
    #[arg(long, value_name = "LIST", value_parser = values::shares)]
    anchor_ratios: Option<::std::vec::Vec<f32>>,
    /// dLLM-Cache: run dllm-cache once per refresh ratio ρ of the list (instead of
    /// --refresh-ratio), crossed with --response-intervals when both are given
    #[arg(long, value_name = "LIST", value_parser = values::shares)]
    refresh_ratios: Option<::std::vec::Vec<f32>>,
    /// dLLM-Cache: run dllm-cache once per response interval K_r of the list (instead of
    /// --response-interval)
    #[arg(long, value_name = "LIST", value_parser = values::positives)]
    response_intervals: Option<::std::vec::Vec<usize>>,
    /// also run every mode with --full-canvas (every step of the canvas), as a row of its
    /// own, and count the items whose answer text is the same both ways
    #[arg(long)]
    with_full_canvas: bool,
    /// infilling: hide the value of each answer's first fact (answers "<name> <field> :
    /// <value> ..."): the prompt ends with "#### <name> <field> :", the canvas is the
    /// value's length, the suffix the rest of the answer; the value must come back
    /// (--gen-length, --block-length and --steps are then the value's token count)
    #[arg(long)]
    infill: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    run: RunArgs,
    /// print one JSON object (with per-item results when a single mode runs)
    #[arg(long)]
    json: bool,
    /// also write the results table to FILE as Markdown
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// also write the JSON results with every item of every mode to FILE
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// What one item gave in one mode.
#[derive(Clone, Debug)]
struct ItemResult {
    output: String,
    text: String,
    correct: bool,
    ids: Vec<u32>,
    prompt_tokens: usize,
    /// Positions of the whole sequence: prompt, canvas and an infilling suffix.
    sequence_tokens: usize,
    prefix_len: usize,
    total_s: f64,
    first_step_s: f64,
    steps: usize,
    forward_passes: usize,
    token_layer_passes: usize,
    answer_tokens: usize,
    bicache: Option<BicacheReport>,
    acache: Option<AcacheReport>,
    /// ACache: where the anchors fall (the lines the question asks about).
    anchors_on_asked: Option<anchors::AnchorSpread>,
}

/// Every item of one mode, in the order of the set.
struct ModeRun {
    cache: CacheMode,
    /// ACache's anchor ratio, for a row of `--anchor-ratios`.
    anchor_ratio: Option<f32>,
    /// dLLM-Cache's settings, for its rows.
    adaptive: Option<AdaptiveRefresh>,
    /// The run ran every step of every canvas.
    full_canvas: bool,
    /// Under --with-full-canvas, for the early-finishing row: items whose answer text
    /// equals the full-canvas row's.
    same_text_as_full: Option<usize>,
    results: Vec<ItemResult>,
    /// Generation time: every request's own time at batch 1; the whole run's with
    /// continuous batching (the requests share the forward passes).
    busy_s: f64,
    wall_s: f64,
    /// Bytes held by the shared prefix store after the mode's last item.
    store_bytes: u64,
    /// The most GPU memory the engine held while the mode ran (weights included).
    peak_gpu_bytes: u64,
}
pub fn run(args: &EvalArgs) -> Result<(), CliError> {
    let dir = args.model.dir()?;
    if crate::dgemma::is_diffusion_gemma(&dir) {
        return dgemma::run(args, &dir);
    }
    let set_path = &args.set;
    let modes = args.cache.clone().unwrap_or_else(|| vec![CacheMode::None]);
    let bicache = args.run.bicache.settings(&modes);
    let limit = args.limit;
    let batch = args.batch;
    let params = args.sampling.params(GenerationDefaults {
        gen_length: DEFAULT_GEN_LENGTH,
        single_block: true,
    })?;
    let engine_options = args.run.engine_options()?;
    let json_stdout = args.json;
    let markdown_path = args.markdown.as_deref();
    let out_path = args.out.as_deref();
    check_output("markdown", markdown_path)?;
    check_output("out", out_path)?;

    let mut items = load_set(set_path)?;
    let set_items = items.len();
    if let Some(n) = limit {
        items.truncate(n);
    }
    let engine = options::load_engine(&dir, &engine_options)?;
    if engine.tokenizer().is_none() {
        return Err(CliError::runtime(format!(
            "{} has no tokenizer.json: eval renders text prompts and needs one",
            dir.display()
        )));
    }
    if args.infill {
        items = items
            .iter()
            .map(|item| infill::prepare(&engine, item))
            .collect::<Result<_, _>>()?;
    }
    // Every prompt must fit before anything runs, so a long run does not stop half-way.
    let max = engine.config().max_sequence_length;
    for item in &items {
        let (len, what) = match &item.infill {
            Some(f) => (f.len(), "the infilling task's prompt, value and suffix"),
            None => {
                let request = item.request(&params, CacheMode::None, bicache);
                let len = engine.encode_prompt(&request.prompt)?.len() + params.gen_length;
                (len, "the prompt's tokens + --gen-length")
            }
        };
        if len > max {
            return Err(CliError::usage(format!(
                "item {:?} ({}:{}): {what} = {len} tokens exceed the model's maximum \
                 sequence length {max}",
                item.id,
                set_path.display(),
                item.line,
            )));
        }
    }
    eprintln!(
        "evaluating {} of {set_items} items of {} with cache {}",
        items.len(),
        set_path.display(),
        modes
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", ")
    );

    if args.anchor_ratios.is_some() && args.run.bicache.anchor_ratio.is_some() {
        return Err(CliError::usage(
            "--anchor-ratios and --anchor-ratio: give one of them",
        ));
    }
    let flags = &args.run.bicache;
    if (args.refresh_ratios.is_some() && flags.refresh_ratio.is_some())
        || (args.response_intervals.is_some() && flags.response_interval.is_some())
    {
        return Err(CliError::usage(
            "--refresh-ratios with --refresh-ratio, or --response-intervals with \
             --response-interval: give one of each pair",
        ));
    }
    // One run per mode; per anchor ratio for acache under --anchor-ratios; per (ρ, K_r)
    // for dllm-cache under --refresh-ratios and --response-intervals.
    let mut arms: Vec<(CacheMode, CacheSettings)> = Vec::new();
    for &mode in &modes {
        match (&args.anchor_ratios, mode) {
            (Some(ratios), CacheMode::Acache) => {
                arms.extend(ratios.iter().map(|&r| {
                    let s = CacheSettings {
                        anchor_ratio: r,
                        ..bicache
                    };
                    (mode, s)
                }));
            }
            (_, m) if m.is_adaptive() => {
                let d = bicache.adaptive;
                let ratios = args.refresh_ratios.clone().unwrap_or(vec![d.refresh_ratio]);
                let intervals = args
                    .response_intervals
                    .clone()
                    .unwrap_or(vec![d.response_interval]);
                for &refresh_ratio in &ratios {
                    for &response_interval in &intervals {
                        let adaptive = AdaptiveRefresh {
                            refresh_ratio,
                            response_interval,
                            ..d
                        };
                        arms.push((
                            mode,
                            CacheSettings {
                                adaptive,
                                ..bicache
                            },
                        ));
                    }
                }
            }
            _ => arms.push((mode, bicache)),
        }
    }
    if args.with_full_canvas {
        arms = arms
            .into_iter()
            .flat_map(|(mode, s)| {
                let early = CacheSettings {
                    full_canvas: false,
                    ..s
                };
                let full = CacheSettings {
                    full_canvas: true,
                    ..s
                };
                [(mode, early), (mode, full)]
            })
            .collect();
    }
    let mut runs = arms
        .iter()
        .map(|&(mode, settings)| {
            let mut run = run_mode(&engine, &items, &params, mode, settings, batch)?;
            run.anchor_ratio = args
                .anchor_ratios
                .as_ref()
                .filter(|_| mode == CacheMode::Acache)
                .map(|_| settings.anchor_ratio);
            run.adaptive = mode.is_adaptive().then_some(settings.adaptive);
            run.full_canvas = settings.full_canvas;
            Ok(run)
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    if args.with_full_canvas {
        for pair in runs.chunks_mut(2) {
            if let [early, full] = pair {
                let same = early
                    .results
                    .iter()
                    .zip(&full.results)
                    .filter(|(a, b)| a.text == b.text)
                    .count();
                eprintln!(
                    "[eval] {}: {same}/{} answers identical with and without --full-canvas",
                    early.cache,
                    early.results.len()
                );
                early.same_text_as_full = Some(same);
            }
        }
    }
    // Agreement is with the `none` run of the same canvas kind (an early finish leaves masks
    // after the answer that a full canvas fills).
    let none_for = |r: &ModeRun| {
        runs.iter()
            .find(|n| n.cache == CacheMode::None && n.full_canvas == r.full_canvas)
    };
    let tasks = task_columns(&items);
    let arena_scale = kv_arena_bytes_per_position(&engine, &params);
    let summaries: Vec<Summary> = runs
        .iter()
        .map(|r| summarize(r, &items, &tasks, none_for(r), arena_scale))
        .collect();

    let context = Context {
        engine: &engine,
        set: set_path,
        set_items,
        limit,
        batch,
        params: &params,
        infill: args.infill,
        command: command_line(),
    };
    if let Some(path) = out_path {
        let report = report_json(&context, &items, &runs, &summaries, true);
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::context("cannot encode the JSON results", e))?;
        write_file("out", path, &(text + "\n"))?;
    }
    let table = markdown(&context, &items, &tasks, &summaries);
    if let Some(path) = markdown_path {
        write_file("markdown", path, &table)?;
    }
    if json_stdout {
        let report = report_json(&context, &items, &runs, &summaries, runs.len() == 1);
        output::line(&report.to_string())
    } else {
        output::partial(&table)
    }
}

/// Runs every item with one cache mode, with a progress line per item on stderr. With
/// `batch` > 1 up to that many items run at once with continuous batching (a finished
/// item's place goes to the next at the following step), as the server runs requests.
fn run_mode(
    engine: &Engine,
    items: &[Item],
    params: &GenerationParams,
    cache: CacheMode,
    bicache: CacheSettings,
    batch: usize,
) -> Result<ModeRun, CliError> {
    let start = Instant::now();
    engine.ctx().memory.reset_peak();
    let mut results: Vec<Option<ItemResult>> = items.iter().map(|_| None).collect();
    let mut busy_s = 0.0;
    let mut failed = None;
    if batch <= 1 {
        for (index, item) in items.iter().enumerate() {
            let g = engine.generate(&item.request(params, cache, bicache));
            if let Ok(g) = &g {
                busy_s += g.timings.total_s;
            }
            results[index] = Some(item_result(engine, items, index, cache, g)?);
        }
    } else {
        let requests: Vec<Request> = items
            .iter()
            .map(|item| item.request(params, cache, bicache))
            .collect();
        engine.generate_continuous_with(&requests, batch, &mut |index, g| match item_result(
            engine, items, index, cache, g,
        ) {
            Ok(r) => {
                results[index] = Some(r);
                ControlFlow::Continue(())
            }
            Err(e) => {
                failed = Some(e);
                ControlFlow::Break(())
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        // The items share the forward passes: the time is the run's.
        busy_s = start.elapsed().as_secs_f64();
    }
    let results = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.ok_or_else(|| {
                CliError::runtime(format!("item {:?}: no result came back", items[i].id))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ModeRun {
        cache,
        anchor_ratio: None,
        adaptive: None,
        full_canvas: false,
        same_text_as_full: None,
        results,
        busy_s,
        wall_s: start.elapsed().as_secs_f64(),
        store_bytes: engine.prefix_store_stats().bytes,
        peak_gpu_bytes: engine.ctx().memory.peak_bytes(),
    })
}

/// Scores item `index`'s generation and prints its progress line.
fn item_result(
    engine: &Engine,
    items: &[Item],
    index: usize,
    cache: CacheMode,
    g: Result<Generation, EngineError>,
) -> Result<ItemResult, CliError> {
    let item = &items[index];
    let g = g.map_err(|e| CliError {
        kind: ErrorKind::Runtime,
        message: format!(
            "item {:?} (line {}) with cache {cache}: {e}",
            item.id, item.line
        ),
        source: Some(Box::new(e)),
    })?;
    let anchors_on_asked = anchors::on_asked_lines(engine, &g, &item.user);
    let text = g.text.unwrap_or_default();
    let (output, correct, verdict) = item.score(&text);
    let t = g.timings;
    let reuse = match &g.bicache {
        Some(b) => match &b.fallback {
            Some(why) => format!(" ({why})"),
            None => format!(
                " (BiCache depth {} at r = {}, {})",
                b.depth,
                b.ratio,
                if b.hit { "hit" } else { "miss" }
            ),
        },
        None => match &g.acache {
            Some(a) => match &a.fallback {
                Some(why) => format!(" ({why})"),
                None => format!(
                    " (ACache span of {} at {}, {} anchors, {})",
                    a.span_tokens,
                    a.span_start,
                    a.anchors.len(),
                    if a.hit { "hit" } else { "miss" }
                ),
            },
            None => String::new(),
        },
    };
    eprintln!(
        "[{cache} {}/{}] {} ({}): {verdict} in {:.2} s{reuse}",
        index + 1,
        items.len(),
        item.id,
        item.task,
        t.total_s
    );
    Ok(ItemResult {
        output,
        text,
        correct,
        sequence_tokens: g.prompt_ids.len() + g.ids.len() + g.suffix_len,
        ids: g.ids,
        prompt_tokens: g.prompt_ids.len(),
        prefix_len: g.prefix_len,
        total_s: t.total_s,
        first_step_s: t.first_step_s,
        steps: t.steps,
        forward_passes: t.forward_passes,
        token_layer_passes: t.token_layer_passes,
        answer_tokens: t.answer_tokens,
        bicache: g.bicache,
        acache: g.acache,
        anchors_on_asked,
    })
}

fn shorten(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        text.to_string()
    } else {
        let mut s: String = text.chars().take(max_chars).collect();
        s.push('…');
        s
    }
}
/// The command line as typed, quoted for a POSIX shell where needed.
pub fn command_line() -> String {
    std::iter::once("unmask".to_string())
        .chain(std::env::args().skip(1).map(|a| shell_quote(&a)))
        .collect::<Vec<_>>()
        .join(" ")
}

fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// An output path must be a file in an existing folder; checked before the model loads.
fn check_output(flag: &str, path: Option<&Path>) -> Result<(), CliError> {
    let Some(path) = path else {
        return Ok(());
    };
    if path.is_dir() {
        return Err(CliError::usage(format!(
            "--{flag} {} is a directory: expected a file name",
            path.display()
        )));
    }
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() && !parent.is_dir() => {
            Err(CliError::usage(format!(
                "--{flag} {}: the folder {} does not exist",
                path.display(),
                parent.display()
            )))
        }
        _ => Ok(()),
    }
}

fn write_file(flag: &str, path: &Path, text: &str) -> Result<(), CliError> {
    std::fs::write(path, text)
        .map_err(|e| CliError::context(format!("cannot write --{flag} {}", path.display()), e))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--cache=all"), "--cache=all");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
