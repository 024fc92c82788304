//! `unmask score --set`: multiple-choice accuracy by likelihood. Every choice of an item is
//! scored as the reply the set's answers are written as (`#### <choice>` and the end of
//! the turn) after the item's chat prompt; the best-scored choice is the pick.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde_json::json;
use unmask::{Engine, LikelihoodParams, Request};

use crate::error::CliError;
use crate::eval::{ANSWER_MARKER, Item, load_set};
use crate::output;

/// One item's scores: every choice's estimate (in the set's order) and the pick.
struct Scored {
    estimates: Vec<(f64, f64)>,
    pick: usize,
    correct: bool,
}

pub fn run(
    engine: &Engine,
    set: &Path,
    limit: Option<usize>,
    params: &LikelihoodParams,
    json_out: bool,
) -> Result<(), CliError> {
    let mut items = load_set(set)?;
    if let Some(n) = limit {
        items.truncate(n);
    }
    if let Some(item) = items.iter().find(|i| i.choices.is_none()) {
        return Err(CliError::usage(format!(
            "--set {}: item {:?} (line {}) has no \"choices\" (tools/add_choices.py adds them)",
            set.display(),
            item.id,
            item.line
        )));
    }
    let eot = engine.special().eot.ok_or_else(|| {
        CliError::usage("score --set: the model has no end-of-turn token to end a reply with")
    })?;
    let start = Instant::now();
    let mut results = Vec::with_capacity(items.len());
    for (n, item) in items.iter().enumerate() {
        let scored = score_item(engine, item, eot, params)?;
        let choices = item.choices.as_deref().unwrap_or_default();
        eprintln!(
            "[score {}/{}] {} ({}): {} ({:?}, {:.3} nats ahead)",
            n + 1,
            items.len(),
            item.id,
            item.task,
            if scored.correct { "correct" } else { "wrong" },
            choices[scored.pick],
            margin(&scored.estimates, scored.pick),
        );
        results.push(scored);
    }
    let total_s = start.elapsed().as_secs_f64();
    let mut by_task: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (item, r) in items.iter().zip(&results) {
        let e = by_task.entry(item.task.as_str()).or_default();
        e.0 += usize::from(r.correct);
        e.1 += 1;
    }
    let correct = results.iter().filter(|r| r.correct).count();
    if json_out {
        let per_item: Vec<_> = items
            .iter()
            .zip(&results)
            .map(|(item, r)| {
                let choices = item.choices.as_deref().unwrap_or_default();
                json!({
                    "id": item.id,
                    "task": item.task,
                    "answer": item.answer,
                    "picked": choices[r.pick],
                    "correct": r.correct,
                    "choices": choices.iter().zip(&r.estimates).map(|(c, (l, se))| json!({
                        "choice": c, "log_likelihood": l, "standard_error": se,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        let v = json!({
            "model": engine.dir().display().to_string(),
            "adapter": engine.ctx().describe(),
            "set": set.display().to_string(),
            "items": items.len(),
            "correct": correct,
            "accuracy": correct as f64 / items.len().max(1) as f64,
            "by_task": by_task.iter().map(|(t, (c, n))| (t.to_string(), json!({"correct": c, "items": n}))).collect::<serde_json::Map<_, _>>(),
            "mc_num": params.mc_num,
            "mc_batch": params.batch,
            "cfg_scale": params.cfg_scale,
            "seed": params.seed,
            "total_s": total_s,
            "results": per_item,
        });
        return output::line(&v.to_string());
    }
    let tasks: Vec<String> = by_task
        .iter()
        .map(|(t, (c, n))| format!("{t} {c}/{n}"))
        .collect();
    output::line(&format!(
        "accuracy {:.3} ({correct}/{}) · {} · {} samples per choice · {total_s:.1} s",
        correct as f64 / items.len().max(1) as f64,
        items.len(),
        tasks.join(" · "),
        params.mc_num
    ))
}

/// Every choice of `item` scored over the same draws; the pick is the first best.
fn score_item(
    engine: &Engine,
    item: &Item,
    eot: u32,
    params: &LikelihoodParams,
) -> Result<Scored, CliError> {
    let at = |e: unmask::EngineError| {
        CliError::runtime(format!("item {:?} (line {}): {e}", item.id, item.line))
    };
    let chat = Request::chat(item.system.as_deref(), &item.user);
    let (prompt, _) = engine.encode_with_prefix(&chat).map_err(at)?;
    let choices = item.choices.as_deref().unwrap_or_default();
    let mut estimates = Vec::with_capacity(choices.len());
    for choice in choices {
        let mut reply = engine
            .encode_text(&format!("{ANSWER_MARKER} {choice}"))
            .map_err(at)?;
        reply.push(eot);
        let l = engine.log_likelihood(&prompt, &reply, params).map_err(at)?;
        estimates.push((l.log_likelihood, l.standard_error));
    }
    let pick = (0..estimates.len()).fold(0, |best, i| {
        if estimates[i].0 > estimates[best].0 {
            i
        } else {
            best
        }
    });
    Ok(Scored {
        correct: choices[pick] == item.answer,
        estimates,
        pick,
    })
}

/// How far the pick's estimate is ahead of the next best.
fn margin(estimates: &[(f64, f64)], pick: usize) -> f64 {
    let next = estimates
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != pick)
        .map(|(_, e)| e.0)
        .fold(f64::NEG_INFINITY, f64::max);
    estimates[pick].0 - next
}
