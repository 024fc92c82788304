//! A request's progress as the engine thread streams it back: its final text as it
//! appears (cut at stop strings), its tokens' log-probabilities with the text that holds
//! them, the canvas when asked for, and the finished answer.

use std::sync::atomic::Ordering;

use tokio::sync::mpsc::UnboundedSender;
use unmask::{
    AcacheReport, BicacheReport, CacheMode, Engine, EngineError, Generation, Logprob, StepEvent,
    Timings,
};
use unmask_core::tokenizer::Tokenizer;

use super::{CanvasView, Finished, Job, JobEvent, Shared, api_error};
use crate::logprobs::{LogprobStream, TokenLogprob};
use crate::text::{FinishReason, TextStream, final_tokens};

/// The report of a masked-diffusion generation.
fn masked_report(
    cache: CacheMode,
    bicache: Option<&BicacheReport>,
    acache: Option<&AcacheReport>,
    adaptive: Option<&unmask::AdaptiveReport>,
    timings: &Timings,
) -> serde_json::Value {
    serde_json::json!({
        "cache": cache.name(),
        "bicache": bicache,
        "acache": acache,
        "dllm_cache": adaptive,
        "timings": timings,
    })
}

/// A request's progress as it is streamed back.
pub(super) struct Tracker {
    pub(super) events: UnboundedSender<JobEvent>,
    /// A text completion (errors name `prompt`, not `messages`).
    pub(super) completion: bool,
    pub(super) text: TextStream,
    pub(super) include_canvas: bool,
    /// It runs (it left the queue).
    pub(super) started: bool,
    /// With `logprobs`: the answer's tokens reported so far, and how far they reach.
    pub(super) logprobs: Option<(LogprobStream, Vec<TokenLogprob>)>,
}

impl Tracker {
    pub(super) fn new(job: &Job) -> Self {
        Self {
            events: job.events.clone(),
            completion: job.spec.is_completion(),
            text: TextStream::new(job.spec.stop.clone()),
            include_canvas: job.spec.include_canvas,
            started: false,
            logprobs: job.spec.logprobs.map(|_| Default::default()),
        }
    }

    /// Sends `delta` of the text with the answer's tokens it completes: `answer` holds the
    /// final tokens up to the end token, `logprobs` theirs; `complete`: no more follow.
    pub(super) fn send_text(
        &mut self,
        delta: Option<String>,
        tokenizer: &Tokenizer,
        answer: &[u32],
        logprobs: Option<&[Option<Logprob>]>,
        complete: bool,
    ) {
        let sent = self.text.sent_len();
        let tokens = match (&mut self.logprobs, logprobs) {
            (Some((stream, all)), Some(lps)) => {
                let new = stream.advance(tokenizer, answer, lps, sent, complete);
                all.extend(new.iter().cloned());
                new
            }
            _ => Vec::new(),
        };
        let delta = delta.unwrap_or_default();
        if !delta.is_empty() || !tokens.is_empty() {
            let _ = self.events.send(JobEvent::Text(delta, tokens));
        }
    }

    pub(super) fn gone(&self) -> bool {
        self.events.is_closed()
    }

    pub(super) fn on_step(&mut self, engine: &Engine, event: &StepEvent<'_>) {
        let Some(tokenizer) = engine.tokenizer() else {
            return;
        };
        let generated = event.generated();
        let done = final_tokens(generated, event.mask_id);
        if let Ok(text) = tokenizer.decode(done, unmask::DecodeMode::Clean)
            && let Some(delta) = self.text.advance(&text, false)
        {
            let answer = answer_tokens(engine, done);
            self.send_text(Some(delta), tokenizer, answer, event.logprobs, false);
        }
        if self.include_canvas {
            let tokens: Vec<Option<String>> = generated
                .iter()
                .map(|&t| {
                    (t != event.mask_id).then(|| {
                        tokenizer
                            .decode(&[t], unmask::DecodeMode::Raw)
                            .unwrap_or_default()
                    })
                })
                .collect();
            let masked = tokens.iter().filter(|t| t.is_none()).count();
            let _ = self.events.send(JobEvent::Canvas(CanvasView {
                step: event.global_step,
                tokens,
                masked,
            }));
        }
    }

    /// Leaves the queue once: the request runs (or ended before it could).
    pub(super) fn start(&mut self, shared: &Shared) {
        if !std::mem::replace(&mut self.started, true) {
            shared.queued.fetch_sub(1, Ordering::Relaxed);
            let _ = self.events.send(JobEvent::Started);
        }
    }

    /// Sends the rest of the answer and the result.
    pub(super) fn finish(
        mut self,
        engine: &Engine,
        shared: &Shared,
        result: Result<Generation, EngineError>,
    ) {
        if !self.started {
            self.started = true;
            shared.queued.fetch_sub(1, Ordering::Relaxed);
        }
        let m = &shared.metrics;
        let result = match result {
            Err(e) => {
                m.count("error");
                Err(api_error(&e, self.completion))
            }
            Ok(g) => {
                let full = g.text.clone().unwrap_or_default();
                let (text, stopped, delta) = finish_text(&mut self.text, &full);
                if let Some(tokenizer) = engine.tokenizer() {
                    let answer = answer_tokens(engine, &g.ids);
                    self.send_text(delta, tokenizer, answer, g.logprobs.as_deref(), true);
                }
                let ended = g.timings.answer_tokens < g.ids.len();
                m.count("ok");
                m.record_finished(&g);
                Ok(Finished {
                    text,
                    logprobs: self.logprobs.take().map(|(_, all)| all),
                    finish_reason: FinishReason::of(stopped || ended),
                    // The suffix is input as the prompt is.
                    prompt_tokens: g.prompt_ids.len() + g.suffix_len,
                    completion_tokens: g.timings.answer_tokens,
                    report: masked_report(
                        g.cache,
                        g.bicache.as_ref(),
                        g.acache.as_ref(),
                        g.adaptive.as_ref(),
                        &g.timings,
                    ),
                })
            }
        };
        let _ = self.events.send(JobEvent::Done(result));
    }
}

/// The end of an answer whose whole text is `full`: the text cut at the first stop string,
/// whether one was met, and the part of it not sent yet.
pub(super) fn finish_text(stream: &mut TextStream, full: &str) -> (String, bool, Option<String>) {
    let (end, stopped) = stream.cut(full);
    let delta = stream.advance(full, true);
    (full[..end].to_string(), stopped, delta)
}

/// The answer's tokens among final ones: those before its first end token.
fn answer_tokens<'a>(engine: &Engine, tokens: &'a [u32]) -> &'a [u32] {
    let special = engine.special();
    let end = tokens
        .iter()
        .position(|&t| t == special.eos || Some(t) == special.eot)
        .unwrap_or(tokens.len());
    &tokens[..end]
}
