//! The engine thread of a DiffusionGemma server: up to `max_running` requests at once, their
//! canvases denoised together, one decoder pass per step for all of them (each request keeps
//! its own cache, temperature schedule and draws). A request joins at the next step once
//! there is room (the others wait in the queue, `--max-queue` bounds it) and leaves when its
//! last canvas ends. A request's system turn goes through the engine's prefix store, so a
//! system prompt many requests share is encoded once per server.
//!
//! A canvas's tokens are final only when the canvas is (its last step's argmax), so text
//! streams canvas by canvas; with `include_canvas` every step shows the canvas being
//! denoised (accepted positions with their text, the rest as masked).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::mpsc::error::TryRecvError;
use unmask::{
    DecodeMode, DgemmaEngine, DgemmaOutput, DgemmaRequest, DgemmaStep, DgemmaTask, EngineError,
    Logprob, ModelError, PrefixUse, Prompt,
};

use super::{
    CanvasView, Finished, Job, JobEvent, RecentTokens, Shared, Tracker, api_error, finish_text,
};
use crate::api::{GemmaSampling, Input, Sampling};
use crate::error::ApiError;
use crate::text::FinishReason;

/// A request running on the engine thread.
struct Running {
    task: DgemmaTask,
    tracker: Tracker,
    stream: CanvasStream,
    sampling: GemmaSampling,
    /// Most requests in one of its decoder passes (fewer than were running when a batch
    /// did not fit in memory).
    batch: usize,
}

/// Runs the engine thread until every sender of `jobs` is gone and the work is done, with
/// at most `max_running` requests denoised together.
pub fn run(
    engine: &DgemmaEngine,
    mut jobs: UnboundedReceiver<Job>,
    shared: Arc<Shared>,
    max_running: usize,
) {
    let max_running = max_running.max(1);
    let mut recent = RecentTokens::default();
    let mut running: Vec<Running> = Vec::new();
    let mut open = true;
    update_gauges(engine, &shared, &mut recent, 0);
    loop {
        // Wait for work when there is none; else take what arrived, up to the room left.
        if running.is_empty() {
            if !open {
                break;
            }
            match jobs.blocking_recv() {
                Some(job) => admit(engine, job, &shared, &mut running),
                None => break,
            }
        }
        while open && running.len() < max_running {
            match jobs.try_recv() {
                Ok(job) => admit(engine, job, &shared, &mut running),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        // A client gone stops its request here too (one still encoding its prompt has no
        // step to stop at).
        let before = running.len();
        running.retain(|r| {
            let gone = r.tracker.gone();
            if gone {
                shared.metrics.count("cancelled");
            }
            !gone
        });
        if running.len() < before {
            update_gauges(engine, &shared, &mut recent, running.len());
        }
        if running.is_empty() {
            continue;
        }
        let n = running.len();
        update_gauges(engine, &shared, &mut recent, n);
        // The tasks step together (in passes that fit in memory); each step's report goes
        // to its request's stream.
        let (mut tasks, mut streams): (Vec<&mut DgemmaTask>, Vec<_>) = running
            .iter_mut()
            .map(|r| (&mut r.task, (&mut r.tracker, &mut r.stream, &mut r.batch)))
            .unzip();
        // A client gone stops its request at the next step.
        let stepped = pollster::block_on(engine.step_async(&mut tasks, &mut |i, r| {
            let (tracker, stream, batch) = &mut streams[i];
            if tracker.gone() {
                return ControlFlow::Break(());
            }
            **batch = (**batch).max(r.pass_canvases);
            stream.step(&r, engine, tracker);
            ControlFlow::Continue(())
        }));
        if let Err(e) = stepped {
            // Not a matter of memory (a device lost): every request in the step fails.
            for run in running.drain(..) {
                let e = api_error(&e, run.tracker.completion);
                finish(run.tracker, &shared, Err(e));
            }
            continue;
        }
        let mut k = 0;
        while k < running.len() {
            if !running[k].task.is_done() {
                k += 1;
                continue;
            }
            if let Some(tokens) = done(engine, running.remove(k), &shared) {
                recent.push(tokens);
            }
        }
        update_gauges(engine, &shared, &mut recent, running.len());
    }
    update_gauges(engine, &shared, &mut recent, 0);
}

/// Starts `job` (a stored system turn copied, its first canvas drawn; its prompt is encoded
/// by the next steps) or answers its error.
fn admit(engine: &DgemmaEngine, job: Job, shared: &Shared, running: &mut Vec<Running>) {
    if job.events.is_closed() {
        shared.queued.fetch_sub(1, Ordering::Relaxed);
        shared.metrics.count("cancelled");
        return;
    }
    let mut tracker = Tracker::new(&job);
    tracker.start(shared);
    let Sampling::Gemma(sampling) = &job.spec.sampling else {
        let e = ApiError::server("a LLaDA/Dream request reached a DiffusionGemma engine");
        finish(tracker, shared, Err(e));
        return;
    };
    let started = prompt_of(engine, &job.spec.input)
        .and_then(|prompt| engine.start(&request_of(prompt, sampling)));
    match started {
        Ok(task) => {
            running.push(Running {
                task,
                tracker,
                stream: CanvasStream::default(),
                sampling: sampling.clone(),
                batch: 0,
            });
        }
        Err(e) => {
            let e = api_error(&e, tracker.completion);
            finish(tracker, shared, Err(e));
        }
    }
}

/// Answers a request whose task ended; returns its answer's tokens when it finished.
fn done(engine: &DgemmaEngine, run: Running, shared: &Shared) -> Option<usize> {
    let Running {
        task,
        mut tracker,
        sampling,
        batch,
        ..
    } = run;
    match engine.finish(task) {
        Ok(out) => {
            let tokens = answer_tokens(engine, &out, sampling.max_new_tokens);
            let mut done = finished(engine, &mut tracker, &out, sampling.seed, tokens);
            done.report["batch"] = batch.into();
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

fn request_of(prompt: Prompt, sampling: &GemmaSampling) -> DgemmaRequest {
    DgemmaRequest {
        seed: sampling.seed,
        max_new_tokens: sampling.max_new_tokens,
        max_denoising_steps: sampling.max_denoising_steps,
        share_system: true,
        share_prompt: sampling.share_prompt,
        logit_bias: sampling.logit_bias.clone(),
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
    let (text, stopped, delta) = finish_text(&mut tracker.text, &full);
    if let Some(tokenizer) = engine.tokenizer() {
        let lps: Vec<Option<Logprob>> = out.logprobs().into_iter().map(alone).collect();
        let answer = answer_of(engine, kept);
        tracker.send_text(delta, tokenizer, answer, Some(&lps), true);
    }
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
        logprobs: tracker.logprobs.take().map(|(_, all)| all),
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

/// A DiffusionGemma token's log-probability (it reports no alternatives).
fn alone(logprob: f32) -> Option<Logprob> {
    Some(Logprob {
        logprob,
        top: Vec::new(),
    })
}

/// An answer's tokens among `tokens`: those before its first eos.
fn answer_of<'a>(engine: &DgemmaEngine, tokens: &'a [u32]) -> &'a [u32] {
    let end = tokens
        .iter()
        .position(|t| engine.params().eos.contains(t))
        .unwrap_or(tokens.len());
    &tokens[..end]
}

/// What a request's stream has seen: the finished canvases' tokens and the current one.
#[derive(Default)]
struct CanvasStream {
    done: Vec<u32>,
    /// The finished canvases' log-probabilities, and the current canvas's last step's.
    done_logprobs: Vec<Option<Logprob>>,
    current: Option<usize>,
    argmax: Vec<u32>,
    logprobs: Vec<f32>,
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
            self.done_logprobs
                .extend(self.logprobs.drain(..).map(alone));
            if let Ok(text) = tokenizer.decode(&self.done, DecodeMode::Clean)
                && let Some(delta) = tracker.text.advance(&text, false)
            {
                let answer = answer_of(engine, &self.done);
                let lps = Some(&self.done_logprobs[..]);
                tracker.send_text(Some(delta), tokenizer, answer, lps, false);
            }
        }
        self.current = Some(r.canvas);
        self.argmax.clone_from(&r.step.argmax);
        self.logprobs.clear();
        self.logprobs.extend_from_slice(r.logprobs);
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

/// The `/metrics` gauges: `running` requests denoised together (one batch while any runs).
fn update_gauges(
    engine: &DgemmaEngine,
    shared: &Shared,
    recent: &mut RecentTokens,
    running: usize,
) {
    let m = &shared.metrics;
    m.tokens_per_second.set(recent.per_second());
    let queued = shared.queued.load(Ordering::Relaxed) as i64;
    m.queue_depth.set(queued);
    m.running.set(running as i64);
    m.sessions.set(i64::from(running > 0));
    let stats = engine.prefix_stats();
    m.store_entries.set(stats.entries as i64);
    m.store_bytes.set(stats.bytes as i64);
    // The K/V the server keeps between requests is the store's (a request's own cache is
    // made for it and freed when it ends).
    let budget = engine.prefix_store_budget().max_bytes.max(1);
    m.vllm
        .kv_cache_usage
        .set((stats.bytes as f64 / budget as f64).min(1.0));
    m.gpu_memory_bytes
        .set(engine.ctx().memory.live_bytes() as i64);
    m.pass_limit
        .set(engine.model().pass_limit().map_or(0, |l| l as i64));
    m.vllm.running.set(running as i64);
    m.vllm.waiting.set(queued);
}
