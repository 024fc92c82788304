//! `unmask eval`: exact-match accuracy and speed over a JSON-lines task set, for one or more
//! cache modes run over the same items with one loaded model.
//!
//! Every line of the set is an object `{"id", "task", "system", "user", "answer",
//! "prompt_group"}`. An item's prompt is the chat template over its system and user turns;
//! its output is the text after the last `####` of the decoded answer (the whole answer when
//! there is none), trimmed, and it is correct when that equals the expected answer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{Map, Value, json};
use unmask::{BicacheReport, CacheMode, DecodeMode, Engine, GenerationParams, Request};

use crate::args::{CommandSpec, Flag, Matches};
use crate::error::{CliError, ErrorKind};
use crate::generate::params_json;
use crate::options::{self, BicacheSettings, GenerationDefaults, MODEL};
use crate::output;

/// The task types of the set format, in the order of the report's columns. Other task names
/// are accepted and get columns after these.
pub const TASKS: [&str; 3] = ["lookup", "pair", "record"];

/// Used when `--gen-length` is not given; `--steps` and `--block-length` default to it.
const DEFAULT_GEN_LENGTH: usize = 32;

/// Where the answer starts in a model's output: the text after the last marker.
const ANSWER_MARKER: &str = "####";

pub fn spec() -> CommandSpec {
    let mut flags = vec![
        MODEL,
        Flag::value(
            "set",
            "FILE",
            "the task set: JSON lines {id, task, system, user, answer, prompt_group}",
        ),
        Flag::value(
            "cache",
            "MODES",
            "cache modes to compare, in this order: MODE[,MODE...] or all \
             (none, fast-dllm-prefix, fast-dllm-dual, prefix-arm, bicache, bicache-dual; \
             default none)",
        ),
        Flag::value("limit", "N", "evaluate only the first N items of the set"),
        Flag::value(
            "batch",
            "N",
            "run N consecutive items per batched call: BiCache items sharing a system \
             prompt run in the same forward passes (default 1)",
        ),
    ];
    flags.extend(generation_flags());
    flags.extend(options::generation_run_flags(
        "print one JSON object (with per-item results when a single mode runs)",
    ));
    flags.extend([
        Flag::value(
            "markdown",
            "FILE",
            "also write the results table to FILE as Markdown",
        ),
        Flag::value(
            "out",
            "FILE",
            "also write the JSON results with every item of every mode to FILE",
        ),
    ]);
    CommandSpec {
        name: "eval",
        summary: "Score exact-match answers on a task set, comparing cache modes.",
        usage: "unmask eval [--model DIR] --set FILE [--cache MODE[,MODE...]|all] [--limit N] \
                [--json] [--markdown FILE] [--out FILE] [generation flags]",
        flags,
        notes: "Each item's answer is the text after the last \"####\" of the output (the whole\n\
                output when there is none), trimmed; it counts when it equals the expected\n\
                answer exactly. The model is loaded once and every mode runs over the same\n\
                items. A progress line per item goes to stderr; the table (or, with --json,\n\
                the JSON object) to stdout. The shared prefix of an item is its system turn;\n\
                BiCache modes share one prefix store over the whole run, and without a depth\n\
                table (bicache_depth.json, or --depth) they fall back and report why.",
    }
}

/// The shared generation flags with eval's defaults (32 tokens in one block) and without
/// `--raw`: answers are always decoded up to the end of the turn.
fn generation_flags() -> Vec<Flag> {
    options::generation_flags()
        .into_iter()
        .filter(|f| f.name != "raw")
        .map(|f| match f.name {
            "gen-length" => Flag::value("gen-length", "N", "tokens to generate (default 32)"),
            "block-length" => Flag::value(
                "block-length",
                "N",
                "semi-autoregressive block size (default: gen-length, a single block)",
            ),
            _ => f,
        })
        .collect()
}

/// One line of a task set.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// Line number in the set file, counting from 1.
    pub line: usize,
    pub id: String,
    pub task: String,
    pub system: Option<String>,
    pub user: String,
    pub answer: String,
    pub prompt_group: Option<String>,
}

impl Item {
    /// The item's chat request; the default split makes the system turn the shared prefix.
    fn request(
        &self,
        params: &GenerationParams,
        cache: CacheMode,
        bicache: BicacheSettings,
    ) -> Request {
        let mut request = Request::chat(self.system.as_deref(), &self.user)
            .with_params(params.clone())
            .with_cache(cache);
        request.decode = DecodeMode::Clean;
        request.prefix_len = None;
        request.depth = bicache.depth;
        request.refresh_every = bicache.refresh_every;
        request
    }
}

/// The answer in a model's output: the text after the last `####`, else the whole output,
/// trimmed.
pub fn extract_answer(text: &str) -> &str {
    match text.rfind(ANSWER_MARKER) {
        Some(at) => text[at + ANSWER_MARKER.len()..].trim(),
        None => text.trim(),
    }
}

/// Reads a task set; errors name the file and the line.
pub fn load_set(path: &Path) -> Result<Vec<Item>, CliError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        CliError::context(format!("cannot read the set {}: {e}", path.display()), e)
    })?;
    let mut items = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let at = |why: String| CliError::runtime(format!("{}:{number}: {why}", path.display()));
        let item = parse_item(line, number).map_err(at)?;
        if let Some(first) = first_line.insert(item.id.clone(), number) {
            return Err(at(format!(
                "id {:?} is already used on line {first}",
                item.id
            )));
        }
        items.push(item);
    }
    if items.is_empty() {
        return Err(CliError::runtime(format!(
            "the set {} holds no items (expected one JSON object per line)",
            path.display()
        )));
    }
    Ok(items)
}

/// One line of the set; the error says what is wrong with it.
fn parse_item(line: &str, number: usize) -> Result<Item, String> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| format!("not a valid JSON object ({e})"))?;
    let Value::Object(obj) = value else {
        return Err(format!(
            "expected a JSON object with id, task, system, user, answer; found {}",
            kind_of(&value)
        ));
    };
    let optional = |key: &str| -> Result<Option<String>, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!(
                "field \"{key}\" must be a string, found {}",
                kind_of(other)
            )),
        }
    };
    let required = |key: &str| -> Result<String, String> {
        match optional(key)? {
            Some(s) if !s.trim().is_empty() || key == "answer" => Ok(s),
            Some(_) => Err(format!("field \"{key}\" is empty")),
            None => Err(format!("missing field \"{key}\"")),
        }
    };
    Ok(Item {
        line: number,
        id: required("id")?,
        task: required("task")?,
        system: optional("system")?,
        user: required("user")?,
        answer: required("answer")?,
        prompt_group: optional("prompt_group")?,
    })
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What one item gave in one mode.
#[derive(Clone, Debug)]
struct ItemResult {
    output: String,
    text: String,
    correct: bool,
    ids: Vec<u32>,
    prompt_tokens: usize,
    prefix_len: usize,
    total_s: f64,
    first_step_s: f64,
    steps: usize,
    forward_passes: usize,
    token_layer_passes: usize,
    answer_tokens: usize,
    bicache: Option<BicacheReport>,
}

/// Every item of one mode, in the order of the set.
struct ModeRun {
    cache: CacheMode,
    results: Vec<ItemResult>,
    /// Generation time: each batch's slowest request (every request's own time at batch 1).
    busy_s: f64,
    wall_s: f64,
    /// Bytes held by the shared prefix store after the mode's last item.
    store_bytes: u64,
}

/// A mode's row of the report.
struct Summary {
    cache: CacheMode,
    items: usize,
    correct: usize,
    /// (task, items, correct) for every task column.
    per_task: Vec<(String, usize, usize)>,
    total_s: f64,
    wall_s: f64,
    canvas_tokens: usize,
    answer_tokens: usize,
    mean_token_layer_passes: f64,
    mean_forward_passes: f64,
    mean_steps: f64,
    mean_ttft_s: f64,
    agreement_with_none: Option<f64>,
    kv_arena_bytes: f64,
    /// BiCache requests that found their prefix stored / had to build it.
    cache_hits: usize,
    cache_misses: usize,
    /// BiCache requests that ran another mode, and why the first did.
    fallbacks: usize,
    first_fallback: Option<String>,
    /// KV arena plus the shared prefix store, for BiCache modes; the arena otherwise.
    cache_bytes: f64,
}

impl Summary {
    fn accuracy(&self) -> f64 {
        ratio(self.correct as f64, self.items as f64)
    }

    fn throughput_canvas(&self) -> f64 {
        ratio(self.canvas_tokens as f64, self.total_s)
    }

    fn throughput_answer(&self) -> f64 {
        ratio(self.answer_tokens as f64, self.total_s)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

pub fn run(m: &Matches) -> Result<(), CliError> {
    let set_path = PathBuf::from(m.required("set", "FILE")?);
    let modes = options::cache_modes(m)?;
    let bicache = options::bicache_settings(m, &modes)?;
    let limit = m.checked("limit", "a whole number >= 1", |n: usize| n >= 1)?;
    let batch = m
        .checked("batch", "a whole number >= 1", |n: usize| n >= 1)?
        .unwrap_or(1);
    let (params, _) = options::generation_params_with(
        m,
        GenerationDefaults {
            gen_length: DEFAULT_GEN_LENGTH,
            single_block: true,
        },
    )?;
    let engine_options = options::engine_options(m)?;
    let json_stdout = m.switch("json");
    let markdown_path = m.value("markdown").map(PathBuf::from);
    let out_path = m.value("out").map(PathBuf::from);
    check_output("markdown", markdown_path.as_deref())?;
    check_output("out", out_path.as_deref())?;

    let mut items = load_set(&set_path)?;
    let set_items = items.len();
    if let Some(n) = limit {
        items.truncate(n);
    }
    let dir = options::model_dir(m)?;
    let engine = options::load_engine(&dir, &engine_options)?;
    if engine.tokenizer.is_none() {
        return Err(CliError::runtime(format!(
            "{} has no tokenizer.json: eval renders text prompts and needs one",
            dir.display()
        )));
    }
    // Every prompt must fit before anything runs, so a long run does not stop half-way.
    let max = engine.config().max_sequence_length;
    for item in &items {
        let len = engine
            .encode_prompt(&item.request(&params, CacheMode::None, bicache).prompt)?
            .len();
        if len + params.gen_length > max {
            return Err(CliError::usage(format!(
                "item {:?} ({}:{}): the prompt's {len} tokens + --gen-length {} exceed the \
                 model's maximum sequence length {max}",
                item.id,
                set_path.display(),
                item.line,
                params.gen_length
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

    let runs = modes
        .iter()
        .map(|&mode| run_mode(&engine, &items, &params, mode, bicache, batch))
        .collect::<Result<Vec<_>, _>>()?;
    let none = runs.iter().find(|r| r.cache == CacheMode::None);
    let tasks = task_columns(&items);
    let arena_scale = kv_arena_bytes_per_position(&engine, &params);
    let summaries: Vec<Summary> = runs
        .iter()
        .map(|r| summarize(r, &items, &tasks, none, arena_scale, params.gen_length))
        .collect();

    let context = Context {
        engine: &engine,
        set: &set_path,
        set_items,
        limit,
        batch,
        params: &params,
        command: command_line(),
    };
    if let Some(path) = &out_path {
        let report = report_json(&context, &items, &runs, &summaries, true);
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::context("cannot encode the JSON results", e))?;
        write_file("out", path, &(text + "\n"))?;
    }
    let table = markdown(&context, &items, &tasks, &summaries);
    if let Some(path) = &markdown_path {
        write_file("markdown", path, &table)?;
    }
    if json_stdout {
        let report = report_json(&context, &items, &runs, &summaries, runs.len() == 1);
        output::line(&report.to_string())
    } else {
        output::partial(&table)
    }
}

/// Runs every item with one cache mode, with a progress line per item on stderr.
fn run_mode(
    engine: &Engine,
    items: &[Item],
    params: &GenerationParams,
    cache: CacheMode,
    bicache: BicacheSettings,
    batch: usize,
) -> Result<ModeRun, CliError> {
    let start = Instant::now();
    let mut results = Vec::with_capacity(items.len());
    let mut busy_s = 0.0;
    for chunk in items.chunks(batch.max(1)) {
        let requests: Vec<Request> = chunk
            .iter()
            .map(|item| item.request(params, cache, bicache))
            .collect();
        let generations = engine.generate_batch(&requests);
        // A batch's requests run together: its time is that of its slowest request.
        busy_s += generations
            .iter()
            .flatten()
            .map(|g| g.timings.total_s)
            .fold(0.0, f64::max);
        for (item, g) in chunk.iter().zip(generations) {
            let index = results.len();
            let g = g.map_err(|e| CliError {
                kind: ErrorKind::Runtime,
                message: format!(
                    "item {:?} (line {}) with cache {cache}: {e}",
                    item.id, item.line
                ),
                source: Some(Box::new(e)),
            })?;
            let text = g.text.unwrap_or_default();
            let output = extract_answer(&text).to_string();
            let correct = output == item.answer.trim();
            let t = g.timings;
            let verdict = if correct {
                "correct".to_string()
            } else {
                format!(
                    "wrong (expected {:?}, got {:?})",
                    item.answer.trim(),
                    shorten(&output, 40)
                )
            };
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
                None => String::new(),
            };
            eprintln!(
                "[{cache} {}/{}] {} ({}): {verdict} in {:.2} s{reuse}",
                index + 1,
                items.len(),
                item.id,
                item.task,
                t.total_s
            );
            results.push(ItemResult {
                output,
                text,
                correct,
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
            });
        }
    }
    Ok(ModeRun {
        cache,
        results,
        busy_s,
        wall_s: start.elapsed().as_secs_f64(),
        store_bytes: engine.prefix_store_stats().bytes,
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

/// The standard task types, then any other task of the set in order of appearance.
fn task_columns(items: &[Item]) -> Vec<String> {
    let mut tasks: Vec<String> = TASKS.iter().map(|t| t.to_string()).collect();
    for item in items {
        if !tasks.contains(&item.task) {
            tasks.push(item.task.clone());
        }
    }
    tasks
}

/// Bytes of a request's KV arenas per sequence position: K and V, every layer, every
/// key/value head, f32; two arenas when classifier-free guidance runs an unconditional pass.
fn kv_arena_bytes_per_position(engine: &Engine, params: &GenerationParams) -> f64 {
    let c = engine.config();
    let arenas = if params.cfg_scale > 0.0 { 2 } else { 1 };
    (2 * c.n_layers * c.n_kv_heads * c.head_dim() * 4 * arenas) as f64
}

fn summarize(
    run: &ModeRun,
    items: &[Item],
    tasks: &[String],
    none: Option<&ModeRun>,
    arena_bytes_per_position: f64,
    gen_length: usize,
) -> Summary {
    let r = &run.results;
    let n = r.len();
    let mean = |f: &dyn Fn(&ItemResult) -> f64| ratio(r.iter().map(f).sum(), n as f64);
    let per_task = tasks
        .iter()
        .map(|task| {
            let (count, correct) = items
                .iter()
                .zip(r)
                .filter(|(item, _)| &item.task == task)
                .fold((0, 0), |(c, k), (_, res)| {
                    (c + 1, k + usize::from(res.correct))
                });
            (task.clone(), count, correct)
        })
        .collect();
    let agreement_with_none = none.map(|base| {
        let same = base
            .results
            .iter()
            .zip(r)
            .filter(|(a, b)| a.ids == b.ids)
            .count();
        ratio(same as f64, n as f64)
    });
    let reports: Vec<&BicacheReport> = r.iter().filter_map(|x| x.bicache.as_ref()).collect();
    let used = || reports.iter().filter(|b| b.fallback.is_none());
    let fallbacks: Vec<&String> = reports.iter().filter_map(|b| b.fallback.as_ref()).collect();
    let kv_arena_bytes =
        mean(&|x| (x.prompt_tokens + gen_length) as f64) * arena_bytes_per_position;
    let cache_bytes = if run.cache.is_bicache() {
        kv_arena_bytes + run.store_bytes as f64
    } else {
        kv_arena_bytes
    };
    Summary {
        cache: run.cache,
        items: n,
        correct: r.iter().filter(|x| x.correct).count(),
        per_task,
        total_s: run.busy_s,
        wall_s: run.wall_s,
        canvas_tokens: r.iter().map(|x| x.ids.len()).sum(),
        answer_tokens: r.iter().map(|x| x.answer_tokens).sum(),
        mean_token_layer_passes: mean(&|x| x.token_layer_passes as f64),
        mean_forward_passes: mean(&|x| x.forward_passes as f64),
        mean_steps: mean(&|x| x.steps as f64),
        mean_ttft_s: mean(&|x| x.first_step_s),
        agreement_with_none,
        kv_arena_bytes,
        cache_hits: used().filter(|b| b.hit).count(),
        cache_misses: used().filter(|b| !b.hit).count(),
        fallbacks: fallbacks.len(),
        first_fallback: fallbacks.first().map(|s| s.to_string()),
        cache_bytes,
    }
}

/// What every part of the report shares.
struct Context<'a> {
    engine: &'a Engine,
    set: &'a Path,
    set_items: usize,
    limit: Option<usize>,
    batch: usize,
    params: &'a GenerationParams,
    command: String,
}

impl Context<'_> {
    fn adapter(&self) -> &str {
        &self.engine.ctx.info.name
    }

    fn backend(&self) -> &'static str {
        self.engine.ctx.info.backend.to_str()
    }
}

fn summary_json(s: &Summary) -> Map<String, Value> {
    let accuracy_per_task: Map<String, Value> = s
        .per_task
        .iter()
        .map(|(task, count, correct)| {
            let v = if *count > 0 {
                json!(*correct as f64 / *count as f64)
            } else {
                Value::Null
            };
            (task.clone(), v)
        })
        .collect();
    let items_per_task: Map<String, Value> = s
        .per_task
        .iter()
        .map(|(task, count, _)| (task.clone(), json!(count)))
        .collect();
    let kv = s.kv_arena_bytes.round() as u64;
    let row = json!({
        "cache": s.cache.name(),
        "n_items": s.items,
        "correct": s.correct,
        "accuracy": s.accuracy(),
        "accuracy_per_task": accuracy_per_task,
        "items_per_task": items_per_task,
        "total_s": s.total_s,
        "mean_s": ratio(s.total_s, s.items as f64),
        "wall_s": s.wall_s,
        "canvas_tokens": s.canvas_tokens,
        "answer_tokens": s.answer_tokens,
        "throughput_canvas": s.throughput_canvas(),
        "throughput_answer": s.throughput_answer(),
        "mean_token_layer_passes": s.mean_token_layer_passes,
        "mean_forward_passes": s.mean_forward_passes,
        "mean_steps": s.mean_steps,
        "mean_ttft_s": s.mean_ttft_s,
        "agreement_with_none": s.agreement_with_none,
        "cache_bytes": s.cache_bytes.round() as u64,
        "kv_arena_bytes": kv,
        "cache_hits": s.cache_hits,
        "cache_misses": s.cache_misses,
        "fallbacks": s.fallbacks,
        "first_fallback": s.first_fallback,
    });
    match row {
        Value::Object(map) => map,
        _ => unreachable!("json! of an object literal is an object"),
    }
}

fn items_json(items: &[Item], run: &ModeRun) -> Value {
    items
        .iter()
        .zip(&run.results)
        .map(|(item, r)| {
            json!({
                "id": item.id,
                "task": item.task,
                "prompt_group": item.prompt_group,
                "answer": item.answer,
                "output": r.output,
                "correct": r.correct,
                "text": r.text,
                "ids": r.ids,
                "prompt_tokens": r.prompt_tokens,
                "prefix_len": r.prefix_len,
                "total_s": r.total_s,
                "first_step_s": r.first_step_s,
                "steps": r.steps,
                "forward_passes": r.forward_passes,
                "token_layer_passes": r.token_layer_passes,
                "answer_tokens": r.answer_tokens,
                "bicache": r.bicache,
            })
        })
        .collect()
}

fn report_json(
    cx: &Context<'_>,
    items: &[Item],
    runs: &[ModeRun],
    summaries: &[Summary],
    with_items: bool,
) -> Value {
    let modes: Vec<Value> = runs
        .iter()
        .zip(summaries)
        .map(|(run, s)| {
            let mut row = summary_json(s);
            if with_items {
                row.insert("items".into(), items_json(items, run));
            }
            Value::Object(row)
        })
        .collect();
    json!({
        "adapter": cx.adapter(),
        "backend": cx.backend(),
        "adapter_details": cx.engine.ctx.describe(),
        "weight_format": cx.engine.model.weights.embedding.format.name(),
        "model": cx.engine.dir.display().to_string(),
        "set": cx.set.display().to_string(),
        "set_items": cx.set_items,
        "n_items": items.len(),
        "limit": cx.limit,
        "batch": cx.batch,
        "params": params_json(cx.params),
        "command": cx.command,
        "modes": modes,
    })
}

/// `key=value` pairs of the generation parameters, for the report's header line.
fn params_text(params: &GenerationParams) -> String {
    match params_json(params) {
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}={s}"),
                Value::Null => format!("{k}=none"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        other => other.to_string(),
    }
}

/// The header line and the table, one row per mode.
fn markdown(cx: &Context<'_>, items: &[Item], tasks: &[String], summaries: &[Summary]) -> String {
    let mut out = format!(
        "adapter: {} ({}) · model: {} · set: {} ({} of {} items) · batch: {} · params: {} · command: `{}`\n\n",
        cx.adapter(),
        cx.backend(),
        cx.engine.dir.display(),
        cx.set.display(),
        items.len(),
        cx.set_items,
        cx.batch,
        params_text(cx.params),
        cx.command.replace('`', "'")
    );
    let mut header = vec!["cache".to_string(), "accuracy".to_string()];
    header.extend(tasks.iter().cloned());
    header.extend(
        [
            "throughput canvas (tok/s)",
            "throughput answer (tok/s)",
            "token-layer passes",
            "NFE",
            "TTFT (s)",
            "agreement with none",
            "BiCache hit/miss/fallback",
        ]
        .map(String::from),
    );
    out.push_str(&table_row(&header));
    let mut rule = vec!["---".to_string()];
    rule.extend(std::iter::repeat_n("---:".to_string(), header.len() - 1));
    out.push_str(&table_row(&rule));
    for s in summaries {
        let mut cells = vec![s.cache.name().to_string(), fraction(s.correct, s.items)];
        cells.extend(s.per_task.iter().map(|(_, count, correct)| {
            if *count > 0 {
                fraction(*correct, *count)
            } else {
                "–".to_string()
            }
        }));
        cells.extend([
            format!("{:.1}", s.throughput_canvas()),
            format!("{:.1}", s.throughput_answer()),
            format!("{:.0}", s.mean_token_layer_passes),
            format!("{:.1}", s.mean_forward_passes),
            format!("{:.3}", s.mean_ttft_s),
            s.agreement_with_none
                .map_or_else(|| "–".to_string(), |a| format!("{a:.3}")),
            if s.cache.is_bicache() {
                format!("{}/{}/{}", s.cache_hits, s.cache_misses, s.fallbacks)
            } else {
                "–".to_string()
            },
        ]);
        out.push_str(&table_row(&cells));
    }
    out
}

fn table_row(cells: &[String]) -> String {
    let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
    format!("| {} |\n", cells.join(" | "))
}

/// `0.750 (3/4)`.
fn fraction(correct: usize, count: usize) -> String {
    format!(
        "{:.3} ({correct}/{count})",
        ratio(correct as f64, count as f64)
    )
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
    fn answer_is_the_text_after_the_last_marker() {
        assert_eq!(extract_answer("The city is Oslo. #### Oslo"), "Oslo");
        assert_eq!(extract_answer("a #### b #### c \n"), "c");
        assert_eq!(extract_answer("####42"), "42");
        assert_eq!(extract_answer("  no marker here \n"), "no marker here");
        assert_eq!(extract_answer("ends with ####"), "");
        assert_eq!(extract_answer("###  7"), "###  7");
        assert_eq!(extract_answer(""), "");
        // The last marker is the one that ends last, as Python's `rsplit("####", 1)`.
        assert_eq!(extract_answer("x #####5"), "5");
    }

    #[test]
    fn items_parse_and_errors_say_why() {
        let line = r#"{"id":"a1","task":"lookup","system":"S","user":"U?","answer":"Oslo","prompt_group":"g1"}"#;
        let item = parse_item(line, 3).unwrap();
        assert_eq!(item.line, 3);
        assert_eq!(item.id, "a1");
        assert_eq!(item.system.as_deref(), Some("S"));
        assert_eq!(item.prompt_group.as_deref(), Some("g1"));
        let minimal = parse_item(r#"{"id":"b","task":"t","user":"u","answer":""}"#, 1).unwrap();
        assert_eq!(minimal.system, None);
        assert_eq!(minimal.answer, "");

        let err = |line: &str| parse_item(line, 1).unwrap_err();
        assert!(err("{oops").contains("not a valid JSON"));
        assert!(err("[1]").contains("found an array"));
        assert!(err(r#"{"id":"a","task":"t","answer":"x"}"#).contains("missing field \"user\""));
        assert!(
            err(r#"{"id":1,"task":"t","user":"u","answer":"x"}"#)
                .contains("\"id\" must be a string")
        );
        assert!(
            err(r#"{"id":" ","task":"t","user":"u","answer":"x"}"#).contains("\"id\" is empty")
        );
    }

    #[test]
    fn task_columns_keep_the_standard_order() {
        let item = |task: &str| Item {
            line: 1,
            id: task.into(),
            task: task.into(),
            system: None,
            user: "u".into(),
            answer: "a".into(),
            prompt_group: None,
        };
        let cols = task_columns(&[item("format"), item("riddle"), item("lookup")]);
        assert_eq!(cols, ["lookup", "pair", "record", "format", "riddle"]);
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("--cache=all"), "--cache=all");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn tables_escape_pipes() {
        assert_eq!(table_row(&["a|b".into(), "c".into()]), "| a\\|b | c |\n");
        assert_eq!(fraction(3, 4), "0.750 (3/4)");
        assert_eq!(fraction(0, 0), "0.000 (0/0)");
    }
}
