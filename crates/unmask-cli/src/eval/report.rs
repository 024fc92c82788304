//! A mode's summary (accuracy per task, throughput, passes, cache use) and the report: JSON
//! with or without every item, and the markdown table.

use std::path::Path;

use serde_json::{Map, Value, json};
use unmask::{AcacheReport, CacheMode, Engine, GenerationParams};

use super::items::{Item, TASKS};
use super::{ItemResult, ModeRun};
use crate::generate::params_json;

/// A mode's row of the report.
pub(super) struct Summary {
    cache: CacheMode,
    anchor_ratio: Option<f32>,
    adaptive: Option<unmask::AdaptiveRefresh>,
    full_canvas: bool,
    same_text_as_full: Option<usize>,
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
    /// BiCache and ACache requests that found their shared entry stored / had to build it.
    cache_hits: usize,
    cache_misses: usize,
    /// BiCache and ACache requests that ran another mode, and why the first did.
    fallbacks: usize,
    first_fallback: Option<String>,
    /// ACache: anchors per request, and the share of them on the lines the question asks
    /// about.
    mean_anchors: Option<f64>,
    anchors_on_asked: Option<f64>,
    /// ACache: the share of the asked lines' tokens that are anchors.
    asked_recall: Option<f64>,
    /// KV arena plus the shared prefix store, for BiCache modes; the arena otherwise.
    cache_bytes: f64,
    /// Measured: the most GPU memory the engine held during the mode (weights included).
    peak_gpu_bytes: u64,
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
/// The standard task types, then any other task of the set in order of appearance.
pub(super) fn task_columns(items: &[Item]) -> Vec<String> {
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
pub(super) fn kv_arena_bytes_per_position(engine: &Engine, params: &GenerationParams) -> f64 {
    let c = engine.config();
    let arenas = if params.cfg_scale > 0.0 { 2 } else { 1 };
    (2 * c.n_layers * c.n_kv_heads * c.head_dim() * 4 * arenas) as f64
}

pub(super) fn summarize(
    run: &ModeRun,
    items: &[Item],
    tasks: &[String],
    none: Option<&ModeRun>,
    arena_bytes_per_position: f64,
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
    // (hit, fallback) of every request's shared entry, BiCache's or ACache's.
    let reports: Vec<(bool, Option<&String>)> = r
        .iter()
        .filter_map(|x| {
            let b = x.bicache.as_ref().map(|b| (b.hit, b.fallback.as_ref()));
            b.or_else(|| x.acache.as_ref().map(|a| (a.hit, a.fallback.as_ref())))
        })
        .collect();
    let used = || reports.iter().filter(|(_, why)| why.is_none());
    let fallbacks: Vec<&String> = reports.iter().filter_map(|(_, why)| *why).collect();
    let with_span: Vec<&AcacheReport> = r
        .iter()
        .filter_map(|x| x.acache.as_ref().filter(|a| a.fallback.is_none()))
        .collect();
    let mean_anchors = (!with_span.is_empty()).then(|| {
        with_span.iter().map(|a| a.anchors.len()).sum::<usize>() as f64 / with_span.len() as f64
    });
    let (on, all, asked) = r
        .iter()
        .filter_map(|x| x.anchors_on_asked)
        .fold((0, 0, 0), |(o, a, k), s| {
            (o + s.on_asked, a + s.anchors, k + s.asked_tokens)
        });
    let anchors_on_asked = (all > 0).then(|| on as f64 / all as f64);
    let asked_recall = (asked > 0 && all > 0).then(|| on as f64 / asked as f64);
    let kv_arena_bytes = mean(&|x| x.sequence_tokens as f64) * arena_bytes_per_position;
    let cache_bytes = if run.cache.is_bicache() {
        kv_arena_bytes + run.store_bytes as f64
    } else {
        kv_arena_bytes
    };
    Summary {
        cache: run.cache,
        anchor_ratio: run.anchor_ratio,
        adaptive: run.adaptive,
        full_canvas: run.full_canvas,
        same_text_as_full: run.same_text_as_full,
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
        cache_hits: used().filter(|(hit, _)| *hit).count(),
        cache_misses: used().filter(|(hit, _)| !*hit).count(),
        fallbacks: fallbacks.len(),
        first_fallback: fallbacks.first().map(|s| s.to_string()),
        cache_bytes,
        peak_gpu_bytes: run.peak_gpu_bytes,
        mean_anchors,
        anchors_on_asked,
        asked_recall,
    }
}

/// What every part of the report shares.
pub(super) struct Context<'a> {
    pub(super) engine: &'a Engine,
    pub(super) set: &'a Path,
    pub(super) set_items: usize,
    pub(super) limit: Option<usize>,
    pub(super) batch: usize,
    pub(super) params: &'a GenerationParams,
    /// `--infill`: each item's canvas is its hidden value (gen_length, block_length and
    /// steps are the value's token count).
    pub(super) infill: bool,
    pub(super) command: String,
}

impl Context<'_> {
    fn adapter(&self) -> &str {
        &self.engine.ctx().info.name
    }

    fn backend(&self) -> &'static str {
        self.engine.ctx().info.backend.to_str()
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
        // As written on the command line (0.05, not the f32's 0.05000000074505806).
        "anchor_ratio": s.anchor_ratio.and_then(|r| r.to_string().parse::<f64>().ok()),
        "dllm_cache": s.adaptive.map(|a| json!({
            "prompt_interval": a.prompt_interval,
            "response_interval": a.response_interval,
            "refresh_ratio": a.refresh_ratio.to_string().parse::<f64>().ok(),
            "verify_pick": a.pick.name(),
            "pin_block": a.pin_block,
        })),
        "full_canvas": s.full_canvas,
        "answers_equal_to_full_canvas": s.same_text_as_full,
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
        "peak_gpu_bytes": s.peak_gpu_bytes,
        "cache_hits": s.cache_hits,
        "cache_misses": s.cache_misses,
        "fallbacks": s.fallbacks,
        "first_fallback": s.first_fallback,
        "mean_anchors": s.mean_anchors,
        "anchors_on_asked_lines": s.anchors_on_asked,
        "asked_line_tokens_anchored": s.asked_recall,
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
                "sequence_tokens": r.sequence_tokens,
                "prefix_len": r.prefix_len,
                "total_s": r.total_s,
                "first_step_s": r.first_step_s,
                "steps": r.steps,
                "forward_passes": r.forward_passes,
                "token_layer_passes": r.token_layer_passes,
                "answer_tokens": r.answer_tokens,
                "bicache": r.bicache,
                "acache": r.acache,
                "anchors_on_asked_lines": r.anchors_on_asked.map(|s| json!({
                    "on_asked": s.on_asked,
                    "anchors": s.anchors,
                    "asked_tokens": s.asked_tokens,
                })),
            })
        })
        .collect()
}

pub(super) fn report_json(
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
        "adapter_details": cx.engine.ctx().describe(),
        "weight_format": cx.engine.model().weights.embedding.format.name(),
        "model": cx.engine.dir().display().to_string(),
        "set": cx.set.display().to_string(),
        "set_items": cx.set_items,
        "n_items": items.len(),
        "limit": cx.limit,
        "batch": cx.batch,
        "params": params_json(cx.params),
        "infill": cx.infill,
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
pub(super) fn markdown(
    cx: &Context<'_>,
    items: &[Item],
    tasks: &[String],
    summaries: &[Summary],
) -> String {
    let infill = if cx.infill {
        " · infill: the first fact's value hidden (canvas, block and steps: its tokens; the \
         rest of the answer after it)"
    } else {
        ""
    };
    let mut out = format!(
        "adapter: {} ({}) · model: {} · set: {} ({} of {} items) · batch: {} · params: {}{infill} · command: `{}`\n\n",
        cx.adapter(),
        cx.backend(),
        cx.engine.dir().display(),
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
            "shared entry hit/miss/fallback",
            "anchors (on asked lines / asked lines' tokens anchored)",
            "peak GPU memory (MiB)",
        ]
        .map(String::from),
    );
    out.push_str(&table_row(&header));
    let mut rule = vec!["---".to_string()];
    rule.extend(std::iter::repeat_n("---:".to_string(), header.len() - 1));
    out.push_str(&table_row(&rule));
    for s in summaries {
        let name = match (s.anchor_ratio, s.adaptive) {
            (Some(r), _) => format!("{} (ratio {r})", s.cache.name()),
            (None, Some(a)) => format!(
                "{} (ρ {}, K_r {}, K_p {}{})",
                s.cache.name(),
                a.refresh_ratio,
                a.response_interval,
                a.prompt_interval,
                [
                    (a.pick != unmask_core::adaptive::VerifyPick::LowestCosine)
                        .then(|| format!(", {}", a.pick.name())),
                    (!a.pin_block).then(|| ", block not pinned".to_string()),
                ]
                .into_iter()
                .flatten()
                .collect::<String>()
            ),
            (None, None) => s.cache.name().to_string(),
        };
        let name = if s.full_canvas {
            format!("{name} (full canvas)")
        } else {
            name
        };
        let mut cells = vec![name, fraction(s.correct, s.items)];
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
            if s.cache.is_bicache() || s.cache == CacheMode::Acache {
                format!("{}/{}/{}", s.cache_hits, s.cache_misses, s.fallbacks)
            } else {
                "–".to_string()
            },
            match (s.mean_anchors, s.anchors_on_asked) {
                (Some(n), Some(on)) => format!(
                    "{n:.1} ({:.0} % / {:.0} %)",
                    on * 100.0,
                    s.asked_recall.unwrap_or(0.0) * 100.0
                ),
                (Some(n), None) => format!("{n:.1}"),
                _ => "–".to_string(),
            },
            format!("{:.1}", s.peak_gpu_bytes as f64 / (1u64 << 20) as f64),
        ]);
        out.push_str(&table_row(&cells));
    }
    let same: Vec<String> = summaries
        .iter()
        .filter_map(|s| {
            s.same_text_as_full
                .map(|n| format!("{}: {n}/{}", s.cache.name(), s.items))
        })
        .collect();
    if !same.is_empty() {
        out.push_str(&format!(
            "\nAnswers identical with and without --full-canvas: {}.\n",
            same.join(", ")
        ));
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

#[cfg(test)]
mod tests {
    use super::*;

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
            affix: None,
            infill: None,
            choices: None,
        };
        let cols = task_columns(&[item("format"), item("riddle"), item("lookup")]);
        assert_eq!(cols, ["lookup", "pair", "record", "format", "riddle"]);
    }
    #[test]
    fn tables_escape_pipes() {
        assert_eq!(table_row(&["a|b".into(), "c".into()]), "| a\\|b | c |\n");
        assert_eq!(fraction(3, 4), "0.750 (3/4)");
        assert_eq!(fraction(0, 0), "0.000 (0/0)");
    }
}
