//! Scoring jobs (`/v1/loglikelihood`): tasks that the scheduler runs in order, the first
//! one advanced by one unit of work per round beside the generations' steps: one forward
//! pass of an estimate, or one step of a greedy decoding. A long estimate never holds the
//! running streams for more than a pass, and one estimate's buffers are allocated at a
//! time (the others wait in the queue). A rolling job runs one estimate per window of each
//! continuation and sums them.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use unmask::{
    CacheMode, Engine, EngineError, GenerationParams, Likelihood, LikelihoodParams, LikelihoodRun,
    Request, RequestRun,
};

use unmask_core::likelihood::window_seed;

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

/// One estimate a task runs: continuation `of`'s tokens `answer` after `context` (the
/// prompt, or a rolling window's), its masks drawn with `seed`.
struct Unit {
    of: usize,
    context: Vec<u32>,
    answer: Vec<u32>,
    seed: u64,
}

/// A scoring job's ids: the prompt, each continuation, and the estimates to run.
pub(super) struct Encoded {
    prompt: Vec<u32>,
    continuations: Vec<Vec<u32>>,
    units: Vec<Unit>,
}

/// What a task runs next.
enum Stage<'e> {
    /// The next unit's estimate starts (or the task is done).
    Next,
    Estimate(Box<LikelihoodRun<'e>>),
    /// The greedy canvas of a continuation length.
    Greedy(usize, Box<RequestRun<'e>>),
}

/// A scoring job in progress.
pub(super) struct ScoreTask<'e> {
    job: Job,
    prompt: Vec<u32>,
    continuations: Vec<Vec<u32>>,
    units: Vec<Unit>,
    params: LikelihoodParams,
    greedy: bool,
    /// It left the queue: its handler heard `Started`.
    started: bool,
    /// One per unit run so far.
    estimates: Vec<Likelihood>,
    /// Greedy canvases by length: continuations of one length (most of a multiple-choice
    /// item's) share one decoding.
    canvases: HashMap<usize, Vec<u32>>,
    stage: Stage<'e>,
}

impl<'e> ScoreTask<'e> {
    /// The job with its prompt and continuations encoded (`encode`). It stays in the queue
    /// until its first unit of work.
    pub(super) fn new(job: Job, encoded: Encoded, spec: &ScoreSpec) -> Self {
        Self {
            job,
            prompt: encoded.prompt,
            continuations: encoded.continuations,
            units: encoded.units,
            params: spec.params,
            greedy: spec.greedy,
            started: false,
            estimates: Vec::new(),
            canvases: HashMap::new(),
            stage: Stage::Next,
        }
    }

    /// Whether it left the queue (it ran a unit of work).
    pub(super) fn started(&self) -> bool {
        self.started
    }

    /// The client went away: the task stops.
    pub(super) fn gone(&self) -> bool {
        self.job.events.is_closed()
    }

    /// Runs one unit of work; true once the answer (or the error) was sent.
    pub(super) fn advance(&mut self, engine: &'e Engine, shared: &Shared) -> bool {
        if !self.started {
            self.started = true;
            shared.queued.fetch_sub(1, Ordering::Relaxed);
            let _ = self.job.events.send(JobEvent::Started);
        }
        match self.work(engine) {
            Ok(false) => false,
            Ok(true) => {
                shared.metrics.count("ok");
                let greedy = self.greedy.then(|| {
                    self.continuations
                        .iter()
                        .map(|c| self.canvases.get(&c.len()) == Some(c))
                        .collect()
                });
                let mut windows: Vec<Vec<Likelihood>> = vec![Vec::new(); self.continuations.len()];
                for (unit, l) in self.units.iter().zip(std::mem::take(&mut self.estimates)) {
                    windows[unit.of].push(l);
                }
                let estimates: Option<Vec<Likelihood>> =
                    windows.into_iter().map(Likelihood::summed).collect();
                let Some(estimates) = estimates else {
                    let e = ApiError::server("a continuation of a scoring job had no estimate");
                    let _ = self.job.events.send(JobEvent::Done(Err(e)));
                    return true;
                };
                let scored = Scored {
                    prompt_tokens: self.prompt.len(),
                    estimates,
                    greedy,
                };
                let _ = self.job.events.send(JobEvent::Scored(scored));
                true
            }
            Err(e) => {
                shared.metrics.count("error");
                let e = if self.job.spec.is_completion() {
                    e.for_completion()
                } else {
                    e
                };
                let _ = self.job.events.send(JobEvent::Done(Err(e)));
                true
            }
        }
    }

    /// One pass or step; Ok(true) when every estimate (and greedy canvas) is in.
    fn work(&mut self, engine: &'e Engine) -> Result<bool, ApiError> {
        let i = self.estimates.len();
        match &mut self.stage {
            Stage::Next => {
                let Some(unit) = self.units.get(i) else {
                    return Ok(true);
                };
                let params = LikelihoodParams {
                    seed: unit.seed,
                    ..self.params
                };
                let run = engine
                    .start_log_likelihood(&unit.context, &unit.answer, &params)
                    .map_err(|e| continuation_error(unit.of, e))?;
                self.stage = Stage::Estimate(Box::new(run));
                self.work(engine)
            }
            Stage::Estimate(run) => {
                run.pass().map_err(|e| ApiError::from_engine(&e))?;
                if !run.is_done() {
                    return Ok(false);
                }
                let estimate = match std::mem::replace(&mut self.stage, Stage::Next) {
                    Stage::Estimate(run) => run.finish().map_err(|e| ApiError::from_engine(&e))?,
                    _ => return Err(ApiError::server("a scoring task lost its estimate")),
                };
                self.estimates.push(estimate);
                // Without rolling (as with greedy) a continuation is one unit.
                let n = self.continuations[self.units[i].of].len();
                if self.greedy && !self.canvases.contains_key(&n) {
                    let request = greedy_request(&self.prompt, n, self.params.cfg_scale);
                    let run = engine
                        .start(request)
                        .map_err(|e| ApiError::from_engine(&e))?;
                    self.stage = Stage::Greedy(n, Box::new(run));
                }
                Ok(false)
            }
            Stage::Greedy(n, run) => {
                let done = run
                    .step(&mut |_| {})
                    .map_err(|e| ApiError::from_engine(&e))?;
                if let Some(generation) = done {
                    self.canvases.insert(*n, generation.ids);
                    self.stage = Stage::Next;
                }
                Ok(false)
            }
        }
    }
}

/// The prompt's ids, each continuation's (text tokenized as it is) and the estimates to
/// run, or the error that names the field. With `rolling`, a continuation longer than fits
/// after the prompt is split into windows (`Engine::rolling_windows`).
pub(super) fn encode(
    engine: &Engine,
    input: &Input,
    spec: &ScoreSpec,
) -> Result<Encoded, ApiError> {
    let engine_error = |e: EngineError| ApiError::from_engine(&e);
    let (prompt, _) = super::request::input_prompt(engine, input).map_err(engine_error)?;
    let prompt = engine.encode_prompt(&prompt).map_err(engine_error)?;
    let mut continuations = Vec::with_capacity(spec.continuations.len());
    for (i, c) in spec.continuations.iter().enumerate() {
        continuations.push(match c {
            Continuation::Ids(ids) => ids.clone(),
            Continuation::Text(text) => engine
                .encode_text(text)
                .map_err(|e| continuation_error(i, e))?,
        });
    }
    if spec.greedy && prompt.is_empty() {
        return Err(ApiError::invalid(
            "greedy",
            "greedy: expected false with an empty prompt (is_greedy decodes a canvas after \
             the prompt, and there is none)",
        ));
    }
    let seed = spec.params.seed;
    let mut units = Vec::new();
    for (of, answer) in continuations.iter().enumerate() {
        if answer.is_empty() {
            let field = format!("continuations[{of}]");
            return Err(ApiError::invalid(
                field.clone(),
                format!("{field}: expected at least one token, found a text of none"),
            ));
        }
        if !spec.rolling {
            units.push(Unit {
                of,
                context: prompt.clone(),
                answer: answer.clone(),
                seed,
            });
            continue;
        }
        for (i, w) in engine
            .rolling_windows(&prompt, answer)
            .into_iter()
            .enumerate()
        {
            units.push(Unit {
                of,
                context: w.context,
                answer: answer[w.answer].to_vec(),
                seed: window_seed(seed, i),
            });
        }
    }
    Ok(Encoded {
        prompt,
        continuations,
        units,
    })
}

/// The engine's error about continuation `i`, whose `answer` it is.
fn continuation_error(i: usize, e: EngineError) -> ApiError {
    let field = format!("continuations[{i}]");
    match e {
        EngineError::Invalid {
            field: "answer", ..
        }
        | EngineError::Tokenizer(_) => ApiError::invalid(field.clone(), format!("{field}: {e}")),
        e => ApiError::from_engine(&e),
    }
}

/// Temperature-0 decoding of a canvas of `n` tokens after `prompt`, one token per step in
/// one block (the model's remasking order). A continuation is greedy when it is this
/// canvas: LLaDA's evaluation checks `is_greedy` this way, a masked model having no
/// left-to-right argmax.
fn greedy_request(prompt: &[u32], n: usize, cfg_scale: f32) -> Request {
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
    request
}
