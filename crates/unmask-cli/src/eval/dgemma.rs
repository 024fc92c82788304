//! `unmask eval` on a DiffusionGemma folder: every item through `unmask::DgemmaEngine` (the
//! system turn through its prefix store, the project's draws from `--seed`), exact-match
//! accuracy per task, the time and the store's use. The family has no cache modes: its
//! prompt K/V are exact, so `--cache` other than none and the cache sweeps are refused.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde_json::json;
use unmask::{DgemmaEngine, DgemmaRequest, DgemmaTask, EngineError, Message, Prompt};
use unmask_core::cache::CacheMode;
use unmask_gpu::dgemma::PrefixUse;

use super::{EvalArgs, Item, check_output, load_set, write_file};
use crate::error::CliError;
use crate::output;

/// One item's run.
struct Outcome {
    output: String,
    correct: bool,
    ids: Vec<u32>,
    prompt_tokens: usize,
    seconds: f64,
    steps: usize,
    stored_prefix: Option<PrefixUse>,
}

fn refuse_masked_settings(args: &EvalArgs) -> Result<(), CliError> {
    let modes = args.cache.as_deref().unwrap_or(&[]);
    if let Some(m) = modes.iter().find(|m| **m != CacheMode::None) {
        return Err(CliError::usage(format!(
            "--cache {m}: DiffusionGemma has no cache modes (its prompt's K/V never change; a \
             shared system turn is kept exactly by its prefix store): leave --cache out"
        )));
    }
    let sweeps = [
        ("--anchor-ratios", args.anchor_ratios.is_some()),
        ("--refresh-ratios", args.refresh_ratios.is_some()),
        ("--response-intervals", args.response_intervals.is_some()),
        ("--with-full-canvas", args.with_full_canvas),
        ("--infill", args.infill),
    ];
    if let Some((flag, _)) = sweeps.iter().find(|(_, given)| *given) {
        return Err(CliError::usage(format!(
            "{flag}: not a DiffusionGemma setting (eval takes --gen-length, --steps, --seed, \
             --logit-bias and --batch)"
        )));
    }
    crate::dgemma::refuse_masked_flags(&args.sampling)
}

fn request(item: &Item, args: &EvalArgs) -> DgemmaRequest {
    let mut messages = Vec::new();
    if let Some(s) = &item.system {
        messages.push(Message::system(s.as_str()));
    }
    messages.push(Message::user(item.user.as_str()));
    DgemmaRequest {
        seed: args.sampling.seed.unwrap_or(0),
        max_new_tokens: args.sampling.gen_length,
        max_denoising_steps: args.sampling.steps,
        logit_bias: args.sampling.logit_bias.clone(),
        ..DgemmaRequest::new(Prompt::Chat(messages))
    }
}

/// `unmask eval` over `dir`, a DiffusionGemma folder.
pub(super) fn run(args: &EvalArgs, dir: &Path) -> Result<(), CliError> {
    refuse_masked_settings(args)?;
    check_output("markdown", args.markdown.as_deref())?;
    check_output("out", args.out.as_deref())?;
    let mut items = load_set(&args.set)?;
    let set_items = items.len();
    if let Some(n) = args.limit {
        items.truncate(n);
    }
    let engine = DgemmaEngine::load(dir, &args.run.engine_options()?)?;
    if engine.tokenizer().is_none() {
        return Err(CliError::runtime(format!(
            "{} has no tokenizer.json: eval renders text prompts and needs one",
            dir.display()
        )));
    }
    // Every prompt must fit before anything runs, so a long run does not stop half-way.
    let canvas = engine.config().canvas_length;
    let answer = args
        .sampling
        .gen_length
        .unwrap_or(engine.params().max_new_tokens);
    let most = engine.model().max_positions;
    for item in &items {
        let (ids, _) = engine.encode_prompt(&request(item, args).prompt)?;
        let positions = ids.len() + answer.div_ceil(canvas) * canvas;
        if positions > most {
            return Err(CliError::usage(format!(
                "item {:?} ({}:{}): the prompt's {} tokens + {} canvases of {canvas} for \
                 --gen-length {answer} exceed the model's {most} positions",
                item.id,
                args.set.display(),
                item.line,
                ids.len(),
                answer.div_ceil(canvas)
            )));
        }
    }
    eprintln!(
        "evaluating {} of {set_items} items of {} with DiffusionGemma ({answer} tokens)",
        items.len(),
        args.set.display()
    );
    engine.ctx().memory.reset_peak();
    let (outcomes, wall_s) = run_items(&engine, args, &items)?;
    let report = report(&engine, args, &items, &outcomes, set_items, wall_s);
    if let Some(path) = &args.out {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::context("cannot encode the JSON results", e))?;
        write_file("out", path, &(text + "\n"))?;
    }
    let table = markdown(&report);
    if let Some(path) = &args.markdown {
        write_file("markdown", path, &table)?;
    }
    if args.json {
        output::line(&report.to_string())
    } else {
        output::partial(&table)
    }
}

/// Runs every item, up to `--batch` at once (their canvases denoised together, one decoder
/// pass per step; a finished item's place taken at the next step). Returns the outcomes in
/// the set's order and the seconds the generations took.
fn run_items(
    engine: &DgemmaEngine,
    args: &EvalArgs,
    items: &[Item],
) -> Result<(Vec<Outcome>, f64), CliError> {
    let failed = |item: &Item, e: EngineError| {
        CliError::runtime(format!("item {:?} (line {}): {e}", item.id, item.line))
    };
    let start = Instant::now();
    let mut outcomes: Vec<Option<Outcome>> = items.iter().map(|_| None).collect();
    let mut running: Vec<(usize, DgemmaTask)> = Vec::new();
    let mut next = 0;
    while next < items.len() || !running.is_empty() {
        while running.len() < args.batch.max(1) && next < items.len() {
            let task = engine
                .start(&request(&items[next], args))
                .map_err(|e| failed(&items[next], e))?;
            running.push((next, task));
            next += 1;
        }
        let mut tasks: Vec<&mut DgemmaTask> = running.iter_mut().map(|(_, t)| t).collect();
        if let Err(e) = engine.step(&mut tasks) {
            // The pass was every running item's.
            let ids: Vec<&str> = running.iter().map(|(i, _)| items[*i].id.as_str()).collect();
            return Err(CliError::runtime(format!(
                "the denoising step of items {ids:?}: {e}"
            )));
        }
        let mut k = 0;
        while k < running.len() {
            if !running[k].1.is_done() {
                k += 1;
                continue;
            }
            let (i, task) = running.remove(k);
            let item = &items[i];
            let out = engine.finish(task).map_err(|e| failed(item, e))?;
            let (output, correct, verdict) = item.score(out.text.as_deref().unwrap_or_default());
            eprintln!(
                "[{}/{}] {} {}: {verdict} ({:.2} s, system turn {:?})",
                i + 1,
                items.len(),
                item.id,
                item.task,
                out.seconds,
                out.prefix
            );
            outcomes[i] = Some(Outcome {
                output,
                correct,
                ids: out.ids,
                prompt_tokens: out.prompt_ids.len(),
                seconds: out.seconds,
                steps: out.canvases.iter().map(|c| c.steps.len()).sum(),
                stored_prefix: out.prefix,
            });
        }
    }
    let outcomes = outcomes.into_iter().flatten().collect();
    Ok((outcomes, start.elapsed().as_secs_f64()))
}

fn report(
    engine: &DgemmaEngine,
    args: &EvalArgs,
    items: &[Item],
    outcomes: &[Outcome],
    set_items: usize,
    wall_s: f64,
) -> serde_json::Value {
    let mut tasks: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (item, o) in items.iter().zip(outcomes) {
        let t = tasks.entry(item.task.as_str()).or_default();
        t.0 += usize::from(o.correct);
        t.1 += 1;
    }
    // One at a time, the items' own times; together, the run's (they share the passes).
    let seconds: f64 = if args.batch > 1 {
        wall_s
    } else {
        outcomes.iter().map(|o| o.seconds).sum()
    };
    let answer_tokens: usize = outcomes.iter().map(|o| o.ids.len()).sum();
    let hits = outcomes
        .iter()
        .filter(|o| matches!(o.stored_prefix, Some(PrefixUse::Hit { .. })))
        .count();
    json!({
        "family": "diffusion_gemma",
        "model": engine.dir().display().to_string(),
        "set": args.set.display().to_string(),
        "set_items": set_items,
        "items": items.len(),
        "correct": outcomes.iter().filter(|o| o.correct).count(),
        "tasks": tasks.iter().map(|(k, (c, n))| (k.to_string(), json!({"correct": c, "items": n}))).collect::<serde_json::Map<_, _>>(),
        "seed": args.sampling.seed.unwrap_or(0),
        "batch": args.batch.max(1),
        "seconds": seconds,
        "answer_tokens_per_s": answer_tokens as f64 / seconds.max(1e-9),
        "denoising_steps": outcomes.iter().map(|o| o.steps).sum::<usize>(),
        "system_turn_hits": hits,
        // The most GPU memory the engine held while the items ran (weights included).
        "peak_gpu_bytes": engine.ctx().memory.peak_bytes(),
        "results": items.iter().zip(outcomes).map(|(item, o)| json!({
            "id": item.id,
            "task": item.task,
            "expected": item.answer.trim(),
            "output": o.output,
            "correct": o.correct,
            "ids": o.ids,
            "prompt_tokens": o.prompt_tokens,
            "seconds": o.seconds,
            "steps": o.steps,
        })).collect::<Vec<_>>(),
    })
}

fn markdown(r: &serde_json::Value) -> String {
    let tasks = r["tasks"].as_object().cloned().unwrap_or_default();
    let mut head = "| model | accuracy |".to_string();
    let mut line = "|---|---|".to_string();
    let (correct, items) = (
        r["correct"].as_u64().unwrap_or(0),
        r["items"].as_u64().unwrap_or(0),
    );
    let mut row = format!("| DiffusionGemma | {correct}/{items} |");
    for (task, t) in &tasks {
        head += &format!(" {task} |");
        line += "---|";
        row += &format!(" {}/{} |", t["correct"], t["items"]);
    }
    head += " answer tok/s | steps | system turn from the store | peak GPU memory (MiB) |";
    line += "---|---|---|---|";
    row += &format!(
        " {:.1} | {} | {}/{} | {:.1} |",
        r["answer_tokens_per_s"].as_f64().unwrap_or(0.0),
        r["denoising_steps"],
        r["system_turn_hits"],
        items,
        r["peak_gpu_bytes"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64
    );
    format!(
        "{} ({} of {} items, seed {}, batch {})\n\n{head}\n{line}\n{row}\n",
        r["set"].as_str().unwrap_or(""),
        items,
        r["set_items"],
        r["seed"],
        r["batch"]
    )
}
