//! The engine thread of a DiffusionGemma server: one request at a time, in the order they
//! came, each running its canvases to the end before the next starts. The others wait in
//! the queue (`--max-queue` bounds it); denoising several requests' canvases in one
//! decoder pass is not built. A request's system turn goes through the engine's prefix
//! store, so a system prompt many requests share is encoded once per server.
//!
//! A canvas's tokens are final only when the canvas is (its last step's argmax), so text
//! streams canvas by canvas; with `include_canvas` every step shows the canvas being
//! denoised (accepted positions with their text, the rest as masked).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;
use unmask::{
    DecodeMode, DgemmaEngine, DgemmaOutput, DgemmaRequest, DgemmaStep, EngineError, ModelError,
    PrefixUse, Prompt,
};

use super::{
    CanvasView, Finished, Job, JobEvent, RecentTokens, Shared, Tracker, api_error, finish_text,
};
use crate::api::{GemmaSampling, Input, Sampling};
use crate::error::ApiError;
use crate::text::FinishReason;

/// Runs the engine thread until every sender of `jobs` is gone and the work is done.
pub fn run(engine: &DgemmaEngine, mut jobs: UnboundedReceiver<Job>, shared: Arc<Shared>) {
    let mut recent = RecentTokens::default();
    update_gauges(engine, &shared, &mut recent, false);
    while let Some(job) = jobs.blocking_recv() {
        if job.events.is_closed() {
            shared.queued.fetch_sub(1, Ordering::Relaxed);
            shared.metrics.count("cancelled");
            continue;
        }
        update_gauges(engine, &shared, &mut recent, true);
        if let Some(tokens) = run_one(engine, job, &shared) {
            recent.push(tokens);
        }
        update_gauges(engine, &shared, &mut recent, false);
    }
}

/// The prompt the engine encodes (a completion's text through the tokenizer).
fn prompt_of(engine: &DgemmaEngine, input: &Input) -> Result<Prompt, EngineError> {
    Ok(match input {
        Input::Chat(messages) => Prompt::Chat(messages.clone()),
        Input::Ids(ids) | Input::Encoded { ids, .. } => Prompt::Ids(ids.clone()),
        Input::Text(text) => match engine.tokenizer() {
            Some(t) => Prompt::Ids(t.encode(text)?),
            None => {
                return Err(EngineError::NoTokenizer {
                    dir: engine.dir().to_path_buf(),
                });
            }
        },
    })
}

/// Runs one request to its end; returns its answer's tokens when it finished.
fn run_one(engine: &DgemmaEngine, job: Job, shared: &Shared) -> Option<usize> {
    let mut tracker = Tracker::new(&job);
    tracker.start(shared);
    let Sampling::Gemma(sampling) = &job.spec.sampling else {
        let e = ApiError::server("a LLaDA/Dream request reached a DiffusionGemma engine");
        finish(tracker, shared, Err(e));
        return None;
    };
    let request = match prompt_of(engine, &job.spec.input) {
        Ok(prompt) => request_of(prompt, sampling),
        Err(e) => {
            let e = api_error(&e, tracker.completion);
            finish(tracker, shared, Err(e));
            return None;
        }
    };
    let result = {
        let mut stream = CanvasStream::default();
        // A client gone stops its request at the next step.
        let mut on_step = |r: DgemmaStep<'_>| {
            if tracker.gone() {
                return ControlFlow::Break(());
            }
            stream.step(&r, engine, &mut tracker);
            ControlFlow::Continue(())
        };
        pollster::block_on(engine.generate_async(&request, &mut on_step))
    };
    match result {
        Ok(out) => {
            let tokens = answer_tokens(engine, &out, sampling.max_new_tokens);
            let done = finished(engine, &mut tracker, &out, sampling.seed, tokens);
            shared.metrics.count("ok");
            shared.metrics.completion_tokens.inc_by(tokens as u64);
            shared
                .metrics
                .prompt_tokens
                .inc_by(out.prompt_ids.len() as u64);
            let _ = tracker.events.send(JobEvent::Done(Ok(done)));
            Some(tokens)
        }
        Err(EngineError::Model(ModelError::Cancelled { .. })) => {
            shared.metrics.count("cancelled");
            None
        }
        Err(e) => {
            let e = api_error(&e, tracker.completion);
            finish(tracker, shared, Err(e));
            None
        }
    }
}

fn request_of(prompt: Prompt, sampling: &GemmaSampling) -> DgemmaRequest {
    DgemmaRequest {
        seed: sampling.seed,
        max_new_tokens: sampling.max_new_tokens,
        max_denoising_steps: sampling.max_denoising_steps,
        share_system: true,
        ..DgemmaRequest::new(prompt)
    }
}

/// Ends a request that failed.
fn finish(tracker: Tracker, shared: &Shared, result: Result<Finished, ApiError>) {
    if result.is_err() {
        shared.metrics.count("error");
    }
    let _ = tracker.events.send(JobEvent::Done(result));
}

/// The answer's tokens: up to and with its first end of turn (the pad after it is not
/// generated), at most `max_tokens` (the engine generates whole canvases; a client asked
/// for at most that many).
fn answer_tokens(engine: &DgemmaEngine, out: &DgemmaOutput, max_tokens: Option<usize>) -> usize {
    let eos = &engine.params().eos;
    let ended = out
        .ids
        .iter()
        .position(|t| eos.contains(t))
        .map_or(out.ids.len(), |at| at + 1);
    ended.min(max_tokens.unwrap_or(usize::MAX))
}

/// The finished request: the rest of its text sent, its report.
fn finished(
    engine: &DgemmaEngine,
    tracker: &mut Tracker,
    out: &DgemmaOutput,
    seed: u64,
    tokens: usize,
) -> Finished {
    let kept = &out.ids[..tokens];
    let full = match engine.tokenizer() {
        Some(t) => t.decode(kept, DecodeMode::Clean).unwrap_or_default(),
        None => String::new(),
    };
    let (text, stopped) = finish_text(&mut tracker.text, &tracker.events, &full);
    let ended = kept.iter().any(|t| engine.params().eos.contains(t));
    let prefix = out.prefix.as_ref().map(|p| match p {
        PrefixUse::Hit { reused } => json!({ "use": "hit", "reused_tokens": reused }),
        PrefixUse::Stored { tokens } => json!({ "use": "stored", "tokens": tokens }),
        PrefixUse::Uncached => json!({ "use": "uncached" }),
    });
    let canvases: Vec<_> = out
        .canvases
        .iter()
        .map(|c| {
            json!({
                "steps": c.steps.len(),
                "stopped_early": c.steps.last().is_some_and(|s| s.stop),
            })
        })
        .collect();
    Finished {
        text,
        finish_reason: FinishReason::of(stopped || ended),
        prompt_tokens: out.prompt_ids.len(),
        completion_tokens: tokens,
        report: json!({
            "family": "diffusion_gemma",
            "seed": seed,
            "prefix": prefix,
            "canvases": canvases,
            "seconds": out.seconds,
        }),
    }
}

/// What a request's stream has seen: the finished canvases' tokens and the current one.
#[derive(Default)]
struct CanvasStream {
    done: Vec<u32>,
    current: Option<usize>,
    argmax: Vec<u32>,
    steps: usize,
}

impl CanvasStream {
    /// One denoising step: a finished canvas's text, then the canvas view when asked for.
    fn step(&mut self, r: &DgemmaStep<'_>, engine: &DgemmaEngine, tracker: &mut Tracker) {
        let Some(tokenizer) = engine.tokenizer() else {
            return;
        };
        if self.current.is_some_and(|c| c != r.canvas) {
            self.done.append(&mut self.argmax);
            if let Ok(text) = tokenizer.decode(&self.done, DecodeMode::Clean)
                && let Some(delta) = tracker.text.advance(&text, false)
                && !delta.is_empty()
            {
                let _ = tracker.events.send(JobEvent::Text(delta));
            }
        }
        self.current = Some(r.canvas);
        self.argmax.clone_from(&r.step.argmax);
        self.steps += 1;
        if !tracker.include_canvas {
            return;
        }
        let piece = |t: u32| tokenizer.decode(&[t], DecodeMode::Raw).unwrap_or_default();
        let mut tokens: Vec<Option<String>> = self.done.iter().map(|&t| Some(piece(t))).collect();
        tokens.extend(
            self.argmax
                .iter()
                .enumerate()
                .map(|(i, &t)| r.step.accepted.binary_search(&i).is_ok().then(|| piece(t))),
        );
        let masked = tokens.iter().filter(|t| t.is_none()).count();
        let _ = tracker.events.send(JobEvent::Canvas(CanvasView {
            step: self.steps,
            tokens,
            masked,
        }));
    }
}

/// The `/metrics` gauges of a server that runs one request at a time.
fn update_gauges(engine: &DgemmaEngine, shared: &Shared, recent: &mut RecentTokens, running: bool) {
    let m = &shared.metrics;
    m.tokens_per_second.set(recent.per_second());
    let queued = shared.queued.load(Ordering::Relaxed) as i64;
    m.queue_depth.set(queued);
    m.running.set(i64::from(running));
    m.sessions.set(i64::from(running));
    // The store is out of its slot while a request runs: the gauges keep their last values.
    if let Some(stats) = engine.prefix_stats() {
        m.store_entries.set(stats.entries as i64);
        m.store_bytes.set(stats.bytes as i64);
        // The K/V the server keeps between requests is the store's (a request's own cache
        // is made for it and freed when it ends).
        let budget = engine.prefix_store_budget().max_bytes.max(1);
        m.vllm
            .kv_cache_usage
            .set((stats.bytes as f64 / budget as f64).min(1.0));
    }
    m.gpu_memory_bytes
        .set(engine.ctx().memory.live_bytes() as i64);
    m.vllm.running.set(i64::from(running));
    m.vllm.waiting.set(queued);
}
