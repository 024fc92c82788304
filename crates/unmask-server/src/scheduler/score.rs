//! Scoring jobs (`/v1/loglikelihood`): run whole on the engine thread when accepted, so the
//! running generations wait for the estimate's forward passes (a few per continuation, its
//! samples side by side) as they wait for a prefix's setup.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::atomic::Ordering;

use unmask::{CacheMode, Engine, EngineError, GenerationParams, Likelihood, Prompt, Request};

use super::{Job, JobEvent, Shared};
use crate::api::Input;
use crate::api::score::{Continuation, ScoreSpec};
use crate::error::ApiError;

/// A scored request: the prompt's length and each continuation's estimate, in order.
#[derive(Debug)]
pub struct Scored {
    pub prompt_tokens: usize,
    pub estimates: Vec<Likelihood>,
    /// With `greedy`: per continuation, whether greedy decoding gives it.
    pub greedy: Option<Vec<bool>>,
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
    let mut greedy = spec.greedy.then(Vec::new);
    // The greedy canvas depends on its length alone: continuations of one length (most of
    // a multiple-choice item's) share one decoding.
    let mut canvases: HashMap<usize, Vec<u32>> = HashMap::new();
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
        if let Some(greedy) = &mut greedy {
            let canvas = match canvases.entry(ids.len()) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(
                    greedy_canvas(engine, &prompt, ids.len(), spec.params.cfg_scale)
                        .map_err(engine_error)?,
                ),
            };
            greedy.push(*canvas == ids);
        }
    }
    Ok(Scored {
        prompt_tokens: prompt.len(),
        estimates,
        greedy,
    })
}

/// Temperature-0 decoding of a canvas of `n` tokens after `prompt`, one token per step in
/// one block (the model's remasking order). A continuation is greedy when it is this
/// canvas: LLaDA's evaluation checks `is_greedy` this way, a masked model having no
/// left-to-right argmax.
fn greedy_canvas(
    engine: &Engine,
    prompt: &[u32],
    n: usize,
    cfg_scale: f32,
) -> Result<Vec<u32>, EngineError> {
    let mut request = Request::ids(prompt.to_vec())
        .with_params(GenerationParams {
            gen_length: n,
            steps: n,
            block_length: n,
            cfg_scale,
            ..GenerationParams::default()
        })
        .with_cache(CacheMode::None);
    request.full_canvas = true;
    Ok(engine.generate(&request)?.ids)
}
