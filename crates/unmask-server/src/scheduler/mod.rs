//! The engine's thread: it owns the model and runs every request, one denoising step at a
//! time, in a fair round over its batches.
//!
//! - Requests run in `Session`s: one forward pass per step for all the members of one,
//!   joining at step boundaries while their arenas fit.
//! - BiCache requests that share a prefix (the same system prompt) and a depth b run in the
//!   session of that prefix. It pins the prefix entry while it has requests and is dropped
//!   when it has none (the entry stays stored for the next ones).
//! - Every other request (any other mode, or a BiCache one that cannot share) joins a
//!   session without a prefix, up to `max_solo` such requests at once.
//! - A request counts as queued until it runs: waiting for a session, or inside one for
//!   room in its arena.
//! - A round steps each session once, then takes new requests.
//! - A request whose client went away (its event channel closed) leaves before the next
//!   step; its pin and GPU state go with it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use unmask::{Engine, EngineError, Generation, PrefixKey, Refusal, Request, Session, StepEvent};

use crate::api::{JobSpec, Sampling};
use crate::error::ApiError;
use crate::logprobs::TokenLogprob;
use crate::metrics::{Metrics, SessionKind};
use crate::text::FinishReason;

mod gauges;
mod gemma;
mod recent;
mod request;
mod score;
mod tracker;

pub use gemma::run as run_gemma;
pub use request::encode_input;
pub use score::Scored;

use recent::RecentTokens;
use request::engine_request;
use tracker::{Tracker, finish_text};

/// A request handed to the engine thread, with the channel its events go back on.
pub struct Job {
    pub spec: JobSpec,
    pub events: UnboundedSender<JobEvent>,
}

/// What the engine thread tells a request's handler.
#[derive(Debug)]
pub enum JobEvent {
    /// The request was accepted and runs (or waits for room in its batch).
    Started,
    /// Final answer text, in order, with its tokens' log-probabilities when asked for.
    Text(String, Vec<TokenLogprob>),
    /// The whole canvas after a step (with `include_canvas`).
    Canvas(CanvasView),
    Done(Result<Finished, ApiError>),
    /// A scoring job's answer (its errors come as `Done(Err)`).
    Scored(Scored),
}

/// One step's canvas: each generated position's token text, `None` while masked.
#[derive(Debug, serde::Serialize)]
pub struct CanvasView {
    pub step: usize,
    pub tokens: Vec<Option<String>>,
    pub masked: usize,
}

/// A finished request.
#[derive(Debug)]
pub struct Finished {
    pub text: String,
    /// The answer's tokens with their log-probabilities, when asked for.
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// What the runtime did, beside OpenAI's fields (the answer's `unmask` object): the
    /// cache mode and its reports and timings, or DiffusionGemma's canvases and prefix.
    pub report: serde_json::Value,
}

/// How much the scheduler runs at once.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Requests without a shared prefix running at once (they share the forward passes of
    /// sessions without a prefix).
    pub max_solo: usize,
    /// Positions (prompts and canvases) one session holds; capped by the device (a longer
    /// request gets a session of its own size).
    pub batch_rows: usize,
    /// BiCache depth b for every request (`None`: the model's depth table).
    pub depth: Option<usize>,
    /// BiCache: steps between deep-prefix refreshes in one-block requests.
    pub refresh_every: usize,
    /// ACache: the anchor ratio of requests that name none.
    pub anchor_ratio: f32,
    /// dLLM-Cache: the intervals and ratio of requests that name none.
    pub adaptive: unmask::AdaptiveRefresh,
    /// Requests run every step of their canvas unless they say otherwise.
    pub full_canvas: bool,
    /// Where the prefix store's changes go, for the KV-event publisher.
    pub kv_events: Option<tokio::sync::mpsc::UnboundedSender<Vec<unmask::StoreEvent>>>,
}

/// What the handlers and the scheduler share.
pub struct Shared {
    pub metrics: Metrics,
    /// Requests accepted and not yet running (waiting for a session or inside one).
    pub queued: AtomicUsize,
}

/// A session and the requests in it, by their session ids.
struct Slot<'e> {
    session: Session<'e>,
    members: HashMap<usize, Tracker>,
}

impl Slot<'_> {
    /// Members that joined the running batch since the last look leave the queue.
    fn note_started(&mut self, shared: &Shared) {
        for (&id, t) in self.members.iter_mut() {
            if !t.started && !self.session.is_waiting(id) {
                t.start(shared);
            }
        }
    }
}

/// Where a waiting request went.
enum Placement {
    Placed,
    /// No session can take it now: it waits.
    NotNow,
    Failed(EngineError),
}

/// The scheduler's state: sessions and the requests waiting for one.
struct Scheduler<'e> {
    engine: &'e Engine,
    shared: Arc<Shared>,
    config: SchedulerConfig,
    slots: Vec<Slot<'e>>,
    /// Accepted requests not in a session yet, with their shared prefix (BiCache).
    waiting: VecDeque<(Job, Request, Option<PrefixKey>)>,
    /// Recent finishes, for tokens/s.
    recent: RecentTokens,
    /// Scoring jobs in arrival order; the first advances by one pass per round.
    scoring: VecDeque<score::ScoreTask<'e>>,
}

/// Runs the engine thread until every sender of `jobs` is gone and the work is done.
pub fn run(
    engine: &Engine,
    mut jobs: UnboundedReceiver<Job>,
    shared: Arc<Shared>,
    config: SchedulerConfig,
) {
    let mut s = Scheduler {
        engine,
        shared,
        config,
        slots: Vec::new(),
        waiting: VecDeque::new(),
        recent: RecentTokens::default(),
        scoring: VecDeque::new(),
    };
    if s.config.kv_events.is_some() {
        engine.record_store_events(true);
    }
    s.publish_cache_config();
    loop {
        // Idle: sleep until a request comes (or the server stops).
        if s.is_idle() {
            s.update_gauges();
            match jobs.blocking_recv() {
                Some(job) => s.accept(job),
                None => return,
            }
        }
        while let Ok(job) = jobs.try_recv() {
            s.accept(job);
        }
        s.place_waiting();
        s.drop_gone();
        s.round();
        s.update_gauges();
    }
}

impl<'e> Scheduler<'e> {
    fn is_idle(&self) -> bool {
        self.slots.is_empty() && self.waiting.is_empty() && self.scoring.is_empty()
    }

    fn reject(&self, job: Job, error: ApiError) {
        let error = if job.spec.is_completion() {
            error.for_completion()
        } else {
            error
        };
        self.shared.queued.fetch_sub(1, Ordering::Relaxed);
        self.shared.metrics.count("error");
        let _ = job.events.send(JobEvent::Done(Err(error)));
    }

    /// Turns a job into its request and the prefix it shares, and queues it.
    fn accept(&mut self, job: Job) {
        let engine = self.engine;
        if let Sampling::Score(spec) = &job.spec.sampling {
            let spec = spec.clone();
            match score::encode(engine, &job.spec.input, &spec) {
                Ok(ids) => self
                    .scoring
                    .push_back(score::ScoreTask::new(job, ids, &spec)),
                Err(e) => self.reject(job, e),
            }
            return;
        }
        let Sampling::Masked(sampling) = &job.spec.sampling else {
            let e = ApiError::server("a DiffusionGemma request reached a LLaDA/Dream engine");
            return self.reject(job, e);
        };
        let request = match engine_request(engine, &job.spec.input, sampling, &self.config) {
            Ok(r) => Request {
                logprobs: job.spec.logprobs.is_some(),
                top_logprobs: job.spec.logprobs.unwrap_or(0),
                ..r
            },
            Err(e) => return self.reject(job, ApiError::from_engine(&e)),
        };
        let key = if request.cache.is_bicache() {
            match engine.shared_prefix(&request) {
                Ok(key) => Some(key),
                // It cannot share (no depth table, guidance, ...): it runs with its
                // fallback mode, and its report says why.
                Err(EngineError::Refused(Refusal::NotShared(_))) => None,
                Err(e) => return self.reject(job, ApiError::from_engine(&e)),
            }
        } else {
            None
        };
        self.waiting.push_back((job, request, key));
    }

    /// Places waiting requests into sessions, in the order they came; one that cannot be
    /// placed now keeps its turn.
    fn place_waiting(&mut self) {
        let mut still = VecDeque::new();
        while let Some((job, request, key)) = self.waiting.pop_front() {
            if job.events.is_closed() {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
                self.shared.metrics.count("cancelled");
                continue;
            }
            match self.place(&job, &request, key.as_ref()) {
                Placement::Placed => {}
                Placement::NotNow => still.push_back((job, request, key)),
                Placement::Failed(e) => self.reject(job, ApiError::from_engine(&e)),
            }
        }
        self.waiting = still;
        let shared = Arc::clone(&self.shared);
        for slot in &mut self.slots {
            slot.note_started(&shared);
        }
    }

    /// Requests without a shared prefix in the sessions.
    fn solo_members(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.session.prefix().is_none())
            .map(|s| s.members.len())
            .sum()
    }

    /// Submits a request to a session of its prefix (or of none) that takes it, making
    /// one when none does.
    fn place(&mut self, job: &Job, request: &Request, key: Option<&PrefixKey>) -> Placement {
        if key.is_none() && self.solo_members() >= self.config.max_solo.max(1) {
            return Placement::NotNow;
        }
        for slot in self.slots.iter_mut() {
            if slot.session.prefix() != key {
                continue;
            }
            match slot.session.submit(request.clone()) {
                Ok(id) => {
                    slot.members.insert(id, Tracker::new(job));
                    return Placement::Placed;
                }
                // Another session of the same prefix, or a new one, may take it.
                Err(EngineError::Refused(_)) => {}
                Err(e) => return Placement::Failed(e),
            }
        }
        let engine = self.engine;
        let needed = match engine.encode_prompt(&request.prompt) {
            Ok(ids) => ids.len() + request.params.gen_length,
            Err(e) => return Placement::Failed(e),
        };
        let rows = self
            .config
            .batch_rows
            .max(needed)
            .min(engine.model().max_state_rows());
        let (session, id) = match engine.session(key, rows) {
            Ok(mut session) => match session.submit(request.clone()) {
                Ok(id) => (session, id),
                Err(e) => return Placement::Failed(e),
            },
            // The prefix cannot be stored (over the cache budget, ...): the request runs
            // without it, with its mode's fallback.
            Err(EngineError::Refused(why @ Refusal::PrefixNotStored(_))) => {
                if self.solo_members() >= self.config.max_solo.max(1) {
                    return Placement::NotNow;
                }
                let made = engine.session(None, rows).and_then(|mut session| {
                    let id = session.submit_fallback(request.clone(), &why.to_string())?;
                    Ok((session, id))
                });
                match made {
                    Ok(made) => made,
                    Err(e) => return Placement::Failed(e),
                }
            }
            Err(e) => return Placement::Failed(e),
        };
        let mut members = HashMap::new();
        members.insert(id, Tracker::new(job));
        self.slots.push(Slot { session, members });
        Placement::Placed
    }

    /// Requests whose clients went away leave their session (unpinning) or the queue.
    fn drop_gone(&mut self) {
        let shared = Arc::clone(&self.shared);
        let m = &shared.metrics;
        for slot in &mut self.slots {
            let gone: Vec<usize> = slot
                .members
                .iter()
                .filter(|(_, t)| t.gone())
                .map(|(&id, _)| id)
                .collect();
            for id in gone {
                slot.session.cancel(id);
                if let Some(t) = slot.members.remove(&id)
                    && !t.started
                {
                    shared.queued.fetch_sub(1, Ordering::Relaxed);
                }
                m.count("cancelled");
            }
        }
        self.scoring.retain(|task| {
            if task.gone() {
                if !task.started() {
                    shared.queued.fetch_sub(1, Ordering::Relaxed);
                }
                m.count("cancelled");
            }
            !task.gone()
        });
        let before = self.waiting.len();
        self.waiting.retain(|(job, _, _)| !job.events.is_closed());
        for _ in self.waiting.len()..before {
            shared.queued.fetch_sub(1, Ordering::Relaxed);
            m.count("cancelled");
        }
        self.slots.retain(|s| !s.session.is_idle());
    }

    /// One step of every session.
    fn round(&mut self) {
        let engine = self.engine;
        let shared = Arc::clone(&self.shared);
        let m = &shared.metrics;
        for slot in &mut self.slots {
            if slot.session.is_idle() {
                continue;
            }
            let Slot { session, members } = slot;
            let done = step_session(session, members, engine, &shared);
            if session.running() > 0 || !done.is_empty() {
                let kind = SessionKind {
                    session: if session.prefix().is_some() {
                        "shared_prefix"
                    } else {
                        "no_prefix"
                    },
                };
                m.batch_size
                    .get_or_create(&kind)
                    .observe((session.running() + done.len()) as f64);
                m.steps.inc();
            }
            for (id, result) in done {
                if let Some(t) = members.remove(&id) {
                    if let Ok(g) = &result {
                        self.recent.push(g.timings.answer_tokens);
                    }
                    t.finish(engine, &shared, result);
                }
            }
            slot.note_started(&shared);
        }
        self.slots.retain(|s| !s.session.is_idle());
        // The first scoring job: one pass (or greedy step) per round, as a session takes one
        // step; the others wait their turn, so one estimate's buffers are held at a time.
        if let Some(task) = self.scoring.front_mut()
            && task.advance(engine, &shared)
        {
            self.scoring.pop_front();
        }
    }
}

fn api_error(e: &EngineError, completion: bool) -> ApiError {
    let error = ApiError::from_engine(e);
    if completion {
        error.for_completion()
    } else {
        error
    }
}

/// One step of a session, blocking this thread until it is done, routing each request's
/// step to its tracker.
fn step_session(
    session: &mut Session<'_>,
    members: &mut HashMap<usize, Tracker>,
    engine: &Engine,
    shared: &Shared,
) -> Vec<(usize, Result<Generation, EngineError>)> {
    let mut on_step = |id: usize, event: &StepEvent<'_>| {
        if let Some(t) = members.get_mut(&id) {
            // Its first step: it left the queue (before its first text).
            t.start(shared);
            t.on_step(engine, event);
        }
    };
    pollster::block_on(session.step_async(&mut on_step))
}
