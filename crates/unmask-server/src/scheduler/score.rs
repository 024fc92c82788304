//! Scoring jobs (`/v1/loglikelihood`): run whole on the engine thread when accepted, so the
//! running generations wait for the estimate's forward passes (a few per continuation, its
//! samples side by side) as they wait for a prefix's setup.

use std::sync::atomic::Ordering;

use unmask::{Engine, EngineError, Likelihood, Prompt};

use super::{Job, JobEvent, Shared};
use crate::api::Input;
use crate::api::score::{Continuation, ScoreSpec};
use crate::error::ApiError;

/// A scored request: the prompt's length and each continuation's estimate, in order.
#[derive(Debug)]
pub struct Scored {
    pub prompt_tokens: usize,
    pub estimates: Vec<Likelihood>,
}

pub(super) fn run(engine: &Engine, shared: &Shared, job: Job, spec: &ScoreSpec) {
    shared.queued.fetch_sub(1, Ordering::Relaxed);
    let _ = job.events.send(JobEvent::Started);
    let completion = job.spec.is_completion();
    let result = score(engine, &job.spec.input, spec);
    shared
        .metrics
        .count(if result.is_ok() { "ok" } else { "error" });
    let event = match result {
        Ok(scored) => JobEvent::Scored(scored),
        Err(e) if completion => JobEvent::Done(Err(e.for_completion())),
        Err(e) => JobEvent::Done(Err(e)),
    };
    let _ = job.events.send(event);
}

fn score(engine: &Engine, input: &Input, spec: &ScoreSpec) -> Result<Scored, ApiError> {
    let engine_error = |e: EngineError| ApiError::from_engine(&e);
    let prompt = match input {
        Input::Ids(ids) | Input::Encoded { ids, .. } => ids.clone(),
        Input::Text(text) => engine.encode_text(text).map_err(engine_error)?,
        Input::Chat(messages) => engine
            .encode_prompt(&Prompt::Chat(messages.clone()))
            .map_err(engine_error)?,
    };
    let mut estimates = Vec::with_capacity(spec.continuations.len());
    for (i, c) in spec.continuations.iter().enumerate() {
        let field = format!("continuations[{i}]");
        let ids = match c {
            Continuation::Ids(ids) => ids.clone(),
            Continuation::Text(text) => engine
                .encode_text(text)
                .map_err(|e| ApiError::invalid(field.clone(), format!("{field}: {e}")))?,
        };
        let estimate = engine
            .log_likelihood(&prompt, &ids, &spec.params)
            .map_err(|e| match e {
                // The engine's `answer` is this request's continuation.
                EngineError::Invalid {
                    field: "answer", ..
                } => ApiError::invalid(field.clone(), format!("{field}: {e}")),
                e => ApiError::from_engine(&e),
            })?;
        estimates.push(estimate);
    }
    Ok(Scored {
        prompt_tokens: prompt.len(),
        estimates,
    })
}
