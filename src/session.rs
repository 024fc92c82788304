//! One session type: N ≥ 1 requests stepped together, with or without a shared prefix.
//!
//! Each member keeps its own sampler, positions and KV arena; the session lays their rows
//! one after the other in one set of activations and their arenas one after the other in
//! one buffer per layer. Every matmul, norm and RoPE then runs once over all the rows (the
//! weights are read once per step, not once per request), attention runs once per member
//! over its own arena window. A session with a shared prefix reads its BiCache entry as
//! segment A of every member's shallow layers, at one depth b for all of them: a shallow
//! layer must read the same entry K/V for every row it computes. A single request is a
//! session of one (`Engine::generate`, `Engine::start`).
//!
//! Every member's step comes from the one mode planner (`cache::plan_mode`), and every
//! step is one plan (`step_plan::StepPlan`) run by the executor (`Model::encode_plan`).

use std::collections::VecDeque;
use std::sync::Arc;

use unmask_core::cache::{ModeStep, SeqState, plan_mode};
use unmask_core::sampler::StepRecord;
use unmask_core::step_plan::{SeqStep, StepPlan, first_fit};
use unmask_gpu::StepEncoder;
use unmask_gpu::model::{DeepRows, ForwardState, Model, SelectBuffers, SharedPrefix};
use unmask_gpu::ops::sampling::SelectParams;

use crate::prefix::PrefixRun;
use crate::run::Prepared;
use crate::{BicacheReport, Engine, EngineError, Generation, Request, StepEvent};

/// The shared prefix a BiCache session reads: its tokens and the depth b of every member.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    pub tokens: Vec<u32>,
    pub depth: usize,
}

/// The prefix entry a session holds pinned while it lives.
struct SessionPrefix {
    key: PrefixKey,
    run: PrefixRun,
    /// Rows × layers and passes spent building the entry (or its boundary) at creation.
    setup_passes: usize,
    setup_forwards: usize,
}

/// The session's GPU state: activations and arenas for all its rows, the deep layers'
/// rows of a session with a shared prefix, and the unconditional pass's under guidance.
struct SessionState {
    st: ForwardState,
    deep: Option<DeepRows>,
    uncond: Option<ForwardState>,
}

/// A request of a session while it runs.
struct Member {
    prepared: Prepared<'static>,
    /// Its own pin on the session's entry (the first member uses the session's).
    _pin: Option<PrefixRun>,
    kv_base: usize,
    records: Vec<StepRecord>,
    last_block: Option<usize>,
}

/// The states a step runs over, each with the tokens of every running member: the
/// conditional pass, and the unconditional one under guidance.
fn pass_tokens<'s>(
    state: &'s SessionState,
    running: &[(usize, Member)],
) -> Vec<(&'s ForwardState, Vec<Vec<u32>>)> {
    let cond = running
        .iter()
        .map(|(_, m)| m.prepared.sampler.tokens().to_vec())
        .collect();
    let mut out = vec![(&state.st, cond)];
    if let Some(u) = &state.uncond {
        let uncond = running
            .iter()
            .map(|(_, m)| m.prepared.sampler.unconditional_tokens())
            .collect();
        out.push((u, uncond));
    }
    out
}

/// Members whose rows share one LM-head and select pass this step.
struct SelectGroup {
    key: SelectParams,
    params: SelectParams,
    members: Vec<usize>,
    /// Sampled rows of all its members.
    rows: usize,
}

/// The select parameters that decide whether two requests' rows can share one LM-head
/// pass: without noise (T = 0) the seed and step change nothing.
fn selection_key(mut p: SelectParams) -> SelectParams {
    if p.temperature == 0.0 {
        p.seed = 0;
        p.step = 0;
    }
    p
}

/// Requests stepped together, with continuous batching: requests are submitted at any time
/// and join at the next step once their arena fits; each finished request is handed back
/// as soon as it ends. Every step runs all running members in one forward pass.
///
/// A session with a shared prefix keeps its entry pinned while it lives and runs every
/// member at its depth b: a request whose own depth (`Request::depth`, else the model's
/// table) is smaller is refused, so no request reuses more shallow layers than its policy
/// allows. A session without one takes requests that share no prefix entry, in any mode
/// but BiCache's, all with classifier-free guidance or all without.
pub struct Session<'e> {
    engine: &'e Engine,
    prefix: Option<SessionPrefix>,
    state: SessionState,
    running: Vec<(usize, Member)>,
    waiting: VecDeque<(usize, Prepared<'static>)>,
    selects: Vec<SelectBuffers>,
    next_id: usize,
    /// Whether the members run classifier-free guidance (set by the first request).
    guidance: Option<bool>,
    /// No member has joined yet: the first takes the session's prefix acquisition (its
    /// hit or miss) as its own.
    first_to_join: bool,
    /// The first member's timings also carry the passes that built the entry (a request
    /// run by `generate`, whose report counts them); a session from `Engine::session`
    /// reports them apart (`entry_token_layer_passes`).
    charge_setup: bool,
}

impl Engine {
    /// A session holding up to `max_rows` positions of running requests at once (their
    /// prompts and canvases together): for requests whose shared prefix is `prefix` (at
    /// its depth b; the entry is built if it is not stored), or for requests that share no
    /// prefix.
    pub fn session(
        &self,
        prefix: Option<&PrefixKey>,
        max_rows: usize,
    ) -> Result<Session<'_>, EngineError> {
        let n_layers = self.model.cfg.n_layers;
        let prefix_len = prefix.map_or(0, |p| p.tokens.len());
        if let Some(key) = prefix {
            if key.tokens.is_empty() {
                return Err(EngineError::Invalid {
                    field: "prefix",
                    expected: "a non-empty shared prefix for a session".into(),
                    found: "none".into(),
                });
            }
            if key.depth > n_layers {
                return Err(EngineError::Invalid {
                    field: "depth",
                    expected: format!("at most the model's {n_layers} layers"),
                    found: key.depth.to_string(),
                });
            }
        }
        let limit = self.model.max_state_rows();
        if max_rows <= prefix_len || max_rows > limit {
            return Err(EngineError::Invalid {
                field: "max_rows",
                expected: format!(
                    "more than the prefix's {prefix_len} tokens and at most one storage \
                     binding's {limit} rows on this device"
                ),
                found: max_rows.to_string(),
            });
        }
        let st = self.model.new_batch_state(max_rows, max_rows)?;
        let (deep, prefix) = match prefix {
            None => (None, None),
            Some(key) => {
                let deep = self.model.new_deep_rows(max_rows)?;
                let mut timings = crate::Timings::default();
                let run = match self.acquire_prefix(&st, &key.tokens, key.depth, &mut timings)? {
                    Ok(run) => run,
                    Err(why) => {
                        return Err(EngineError::Refused(format!(
                            "the shared prefix cannot be stored: {why}"
                        )));
                    }
                };
                let prefix = SessionPrefix {
                    key: key.clone(),
                    run,
                    setup_passes: timings.token_layer_passes,
                    setup_forwards: timings.forward_passes,
                };
                (Some(deep), Some(prefix))
            }
        };
        Ok(Session {
            engine: self,
            prefix,
            state: SessionState {
                st,
                deep,
                uncond: None,
            },
            running: Vec::new(),
            waiting: VecDeque::new(),
            selects: Vec::new(),
            next_id: 0,
            guidance: None,
            first_to_join: true,
            charge_setup: false,
        })
    }

    /// The session a prepared request runs in alone: its shared prefix's when it has one
    /// and the entry can be stored, else one without (the request falls back, and its
    /// report says why).
    pub(crate) fn session_for(
        &self,
        mut prepared: Prepared<'static>,
        rows: usize,
    ) -> Result<(Session<'_>, usize), EngineError> {
        let key = prepared.shared.map(|(depth, _)| PrefixKey {
            tokens: prepared.prefix().to_vec(),
            depth,
        });
        let rows = rows.max(prepared.sampler.tokens().len());
        let mut session = match key {
            None => self.session(None, rows)?,
            Some(key) => match self.session(Some(&key), rows) {
                Ok(s) => s,
                Err(EngineError::Refused(why)) => {
                    prepared.fall_back(why);
                    self.session(None, rows)?
                }
                Err(e) => return Err(e),
            },
        };
        session.charge_setup = true;
        let id = session.admit(prepared)?;
        Ok((session, id))
    }

    /// Runs one request as a session of one.
    pub(crate) async fn run_one(
        &self,
        prepared: Prepared<'static>,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let rows = prepared.sampler.tokens().len();
        let (mut session, _) = self.session_for(prepared, rows)?;
        loop {
            let mut done = session.step_async(&mut |_, event| on_step(event)).await;
            if let Some((_, generation)) = done.pop() {
                return generation;
            }
            if session.is_idle() {
                return Err(EngineError::Internal(
                    "a session of one ended without a result".into(),
                ));
            }
        }
    }

    /// Runs prepared requests in one session (with the shared prefix `prefix`, or none),
    /// in its forward passes; results in the order given.
    pub(crate) async fn run_together(
        &self,
        prefix: Option<PrefixKey>,
        requests: Vec<Prepared<'static>>,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Vec<Result<Generation, EngineError>> {
        let n = requests.len();
        let rows: usize = requests.iter().map(|r| r.sampler.tokens().len()).sum();
        let mut session = match self.session(prefix.as_ref(), rows.max(1)) {
            Ok(s) => s,
            // The entry cannot be stored: every request runs with its fallback mode.
            Err(EngineError::Refused(why)) => {
                let mut out = Vec::with_capacity(n);
                for (i, mut r) in requests.into_iter().enumerate() {
                    r.fall_back(why.clone());
                    out.push(self.run_one(r, &mut |e| on_step(i, e)).await);
                }
                return out;
            }
            Err(e) if n == 1 => return vec![Err(e)],
            Err(e) => {
                let e = Arc::new(e);
                return (0..n)
                    .map(|_| Err(EngineError::BatchStopped(e.clone())))
                    .collect();
            }
        };
        session.charge_setup = true;
        let mut results: Vec<Option<Result<Generation, EngineError>>> =
            (0..n).map(|_| None).collect();
        let mut ids = Vec::with_capacity(n);
        for (i, r) in requests.into_iter().enumerate() {
            match session.admit(r) {
                Ok(id) => ids.push((id, i)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let index = |id: usize| ids.iter().find(|(s, _)| *s == id).map(|&(_, i)| i);
        while !session.is_idle() {
            let done = session
                .step_async(&mut |id, event| {
                    if let Some(i) = index(id) {
                        on_step(i, event)
                    }
                })
                .await;
            for (id, g) in done {
                if let Some(i) = index(id) {
                    results[i] = Some(g);
                }
            }
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(EngineError::Internal("a request did not run".into())))
            })
            .collect()
    }
}

impl Session<'_> {
    /// Queues a request; it joins at a coming step. Returns its id, which `step` hands
    /// back with its generation. A request the session cannot run is refused here, with
    /// the reason.
    pub fn submit(&mut self, request: Request) -> Result<usize, EngineError> {
        let p = self.engine.prepare(std::borrow::Cow::Owned(request))?;
        self.admit(p)
    }

    /// Queues a request that would share a prefix entry in a session without one: it runs
    /// with its mode's fallback (`bicache-dual` as `fast-dllm-dual`, `bicache` as `none`),
    /// and its report gives `why`.
    pub fn submit_fallback(&mut self, request: Request, why: &str) -> Result<usize, EngineError> {
        let mut p = self.engine.prepare(std::borrow::Cow::Owned(request))?;
        if self.prefix.is_none() && p.shared.is_some() {
            p.fall_back(why.to_string());
        }
        self.admit(p)
    }

    /// The one rule of who joins: a request that shares the session's prefix at a depth
    /// no smaller than the session's, or one that shares none in a session without one;
    /// guidance as the members have it; positions the session can hold.
    fn admit(&mut self, p: Prepared<'static>) -> Result<usize, EngineError> {
        match (&self.prefix, p.shared) {
            (Some(_), None) => {
                return Err(EngineError::Refused(format!(
                    "a session with a shared prefix runs BiCache requests only: {}",
                    p.why_not_shared()
                )));
            }
            (None, Some(_)) => {
                return Err(EngineError::Refused(
                    "the request shares a prefix entry: it runs in its prefix's session".into(),
                ));
            }
            (Some(prefix), Some((own_depth, _))) => {
                let key = &prefix.key;
                if p.prefix() != key.tokens {
                    return Err(EngineError::Refused(format!(
                        "the request's shared prefix ({} tokens) is not the session's ({} tokens)",
                        p.prefix_len,
                        key.tokens.len()
                    )));
                }
                if own_depth < key.depth {
                    return Err(EngineError::Refused(format!(
                        "the request's depth b = {own_depth} is below the session's b = {}: it \
                         would reuse more shallow layers than its policy allows",
                        key.depth
                    )));
                }
            }
            (None, None) => {}
        }
        let guided = p.request.params.cfg_scale > 0.0;
        if let Some(g) = self.guidance.filter(|&g| g != guided) {
            let has = |g: bool| if g { "with" } else { "without" };
            return Err(EngineError::Refused(format!(
                "the session runs requests {} classifier-free guidance; this one is {}",
                has(g),
                has(guided)
            )));
        }
        let len = p.sampler.tokens().len();
        if len > self.state.st.seq_len {
            return Err(EngineError::Refused(format!(
                "the request needs {len} positions; the session holds {}",
                self.state.st.seq_len
            )));
        }
        if guided && self.state.uncond.is_none() {
            let rows = self.state.st.seq_len;
            self.state.uncond = Some(self.engine.model.new_batch_state(rows, rows)?);
        }
        self.guidance = Some(guided);
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, p));
        Ok(id)
    }

    /// Withdraws request `id` (its client went away): it leaves the queue, or the session
    /// before the next step, and its GPU rows and pin go with it. False when the session
    /// holds no such request (it finished, or never was).
    pub fn cancel(&mut self, id: usize) -> bool {
        if let Some(k) = self.waiting.iter().position(|(i, _)| *i == id) {
            self.waiting.remove(k);
            return true;
        }
        if let Some(k) = self.running.iter().position(|(i, _)| *i == id) {
            self.running.remove(k);
            return true;
        }
        false
    }

    /// Whether request `id` was submitted and has not joined the running members yet.
    pub fn is_waiting(&self, id: usize) -> bool {
        self.waiting.iter().any(|(i, _)| *i == id)
    }

    /// Requests running in the session.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests submitted and waiting for room.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// The shared prefix and depth b of every member; `None` for a session without one.
    pub fn prefix(&self) -> Option<&PrefixKey> {
        self.prefix.as_ref().map(|p| &p.key)
    }

    /// Positions of prompts and canvases the session holds at once.
    pub fn max_rows(&self) -> usize {
        self.state.st.seq_len
    }

    /// Rows × layers the session spent building its prefix entry (0 when it was stored,
    /// or without a prefix); the members' own `token_layer_passes` do not include them.
    pub fn entry_token_layer_passes(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.setup_passes)
    }

    /// Admits the waiting requests that fit (in the order submitted), then runs one step
    /// of every running request. Returns the requests that finished.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&mut self) -> Vec<(usize, Result<Generation, EngineError>)> {
        pollster::block_on(self.step_async(&mut |_, _| {}))
    }

    /// `step`, calling `on_step` with each request's id and its step.
    pub async fn step_async(
        &mut self,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Vec<(usize, Result<Generation, EngineError>)> {
        let mut done = Vec::new();
        self.place_waiting(&mut done);
        if self.running.is_empty() {
            return done;
        }
        match self.step_running(on_step).await {
            Ok(finished) => done.extend(finished),
            Err(e) => done.extend(self.stop_all(e)),
        }
        done
    }

    /// Gives waiting requests arena windows, first come first served: a request that does
    /// not fit yet holds back later ones.
    fn place_waiting(&mut self, done: &mut Vec<(usize, Result<Generation, EngineError>)>) {
        let engine = self.engine;
        while let Some((_, p)) = self.waiting.front() {
            let len = p.sampler.tokens().len();
            let mut occupied: Vec<(usize, usize)> = self
                .running
                .iter()
                .map(|(_, m)| (m.kv_base, m.prepared.sampler.tokens().len()))
                .collect();
            let Some(kv_base) = first_fit(&mut occupied, len, self.state.st.seq_len) else {
                break;
            };
            let Some((id, mut p)) = self.waiting.pop_front() else {
                break;
            };
            let first = std::mem::take(&mut self.first_to_join);
            let mut pin = None;
            if let (Some(prefix), Some((requested_depth, ratio))) = (&self.prefix, p.shared) {
                let key = &prefix.key;
                let hit = if first {
                    prefix.run.hit
                } else {
                    // Its own pin: the store counts the hit, and a member that leaves
                    // unpins only its own.
                    match engine.acquire_prefix(
                        &self.state.st,
                        &key.tokens,
                        key.depth,
                        &mut p.timings,
                    ) {
                        Ok(Ok(run)) => {
                            let hit = run.hit;
                            pin = Some(run);
                            hit
                        }
                        Ok(Err(why)) => {
                            done.push((
                                id,
                                Err(EngineError::Refused(format!(
                                    "the request could not join the session: {why}"
                                ))),
                            ));
                            continue;
                        }
                        Err(e) => {
                            done.push((id, Err(e)));
                            continue;
                        }
                    }
                };
                if first && self.charge_setup {
                    p.timings.token_layer_passes += prefix.setup_passes;
                    p.timings.forward_passes += prefix.setup_forwards;
                }
                let entry = &prefix.run.entry;
                p.report = Some(BicacheReport {
                    depth: key.depth,
                    requested_depth,
                    ratio,
                    hit,
                    entry_tokens: p.prefix_len,
                    entry_bytes: entry.kv_bytes() + entry.boundary_bytes(),
                    batch: 0,
                    fallback: None,
                });
            }
            p.timings.setup_s = p.start.elapsed_s();
            self.running.push((
                id,
                Member {
                    prepared: p,
                    _pin: pin,
                    kv_base,
                    records: Vec::new(),
                    last_block: None,
                },
            ));
        }
    }

    /// A GPU or sampler error in a step stops every member still running: a member alone
    /// gets the error itself, members of a batch each get it as the cause of their stop.
    fn stop_all(&mut self, error: EngineError) -> Vec<(usize, Result<Generation, EngineError>)> {
        if self.running.len() == 1 {
            let (i, _) = self.running.remove(0);
            return vec![(i, Err(error))];
        }
        let error = Arc::new(error);
        self.running
            .drain(..)
            .map(|(i, _)| (i, Err(EngineError::BatchStopped(error.clone()))))
            .collect()
    }

    /// The mode planner's step of each running member, with its timings counted.
    fn plan_members(&mut self) -> Vec<(ModeStep, SeqStep)> {
        let n_layers = self.engine.model.cfg.n_layers;
        let depth = self.prefix.as_ref().map_or(n_layers, |p| p.key.depth);
        let passes = if self.state.uncond.is_some() { 2 } else { 1 };
        let batch = self.running.len();
        let shared = self.prefix.is_some();
        self.running
            .iter_mut()
            .map(|(_, m)| {
                let p = &mut m.prepared;
                if let Some(report) = p.report.as_mut().filter(|r| r.fallback.is_none()) {
                    report.batch = report.batch.max(batch);
                }
                let s = &p.sampler;
                let block_start = m.last_block != Some(s.block_index());
                m.last_block = Some(s.block_index());
                let seq_len = s.tokens().len();
                let mode = plan_mode(&SeqState {
                    mode: p.mode,
                    seq_len,
                    prefix_len: p.prefix_len,
                    block: s.block(),
                    block_start,
                    several_blocks: s.num_blocks() > 1,
                    steps_done: p.timings.steps,
                    refresh_every: p.request.refresh_every,
                    recompute_all: p.request.recompute_all,
                });
                let seq = SeqStep {
                    rows: mode.rows.clone(),
                    prefix_len: if shared { p.prefix_len } else { 0 },
                    refresh: mode.refresh,
                    seq_len,
                    kv_len: mode.kv_len,
                    kv_base: m.kv_base,
                    predict: s.rows_to_predict(),
                };
                let t = &mut p.timings;
                t.token_layer_passes +=
                    mode.token_layer_passes(depth, n_layers, seq.prefix_len) * passes;
                t.forward_passes += passes * (1 + usize::from(mode.warmup.is_some()));
                (mode, seq)
            })
            .collect()
    }

    /// One step of every running member: one forward and one read-back for all of them.
    /// Members that finish leave (unpinning their entry) and are returned with their
    /// generation.
    async fn step_running(
        &mut self,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Result<Vec<(usize, Result<Generation, EngineError>)>, EngineError> {
        let engine = self.engine;
        let model = &engine.model;
        let n_layers = model.cfg.n_layers;
        let shift = model.cfg.family.shifts_logits();
        let steps = self.plan_members();
        let internal = |e: unmask_core::step_plan::PlanError| EngineError::Internal(e.to_string());
        let passes = pass_tokens(&self.state, &self.running);

        // Prefix-arm's prefix-only pass, in its own submit: the step rewrites the same rows.
        let warm: Vec<SeqStep> = steps
            .iter()
            .filter_map(|(mode, seq)| {
                mode.warmup.map(|w| SeqStep {
                    rows: 0..w,
                    prefix_len: 0,
                    refresh: false,
                    seq_len: seq.seq_len,
                    kv_len: w,
                    kv_base: seq.kv_base,
                    predict: Vec::new(),
                })
            })
            .collect();
        if !warm.is_empty() {
            let plan = StepPlan::alone(&warm, n_layers, shift).map_err(internal)?;
            let mut step = StepEncoder::new(&engine.ctx, "prefix pass");
            for (st, tokens) in &passes {
                let ids: Vec<u32> = steps
                    .iter()
                    .zip(tokens)
                    .filter_map(|((mode, _), t)| mode.warmup.map(|w| &t[..w]))
                    .flatten()
                    .copied()
                    .collect();
                model.encode_plan(&mut step, st, None, &plan, &ids, None)?;
            }
            step.submit()?;
        }

        let seqs: Vec<SeqStep> = steps.iter().map(|(_, s)| s.clone()).collect();
        let (plan, shared, label) = match &self.prefix {
            Some(p) => (
                StepPlan::shared(&seqs, p.key.depth, n_layers, shift).map_err(internal)?,
                Some(SharedPrefix {
                    kv: &p.run.entry.kv,
                    tokens: p.run.entry.tokens,
                    boundary: &p.run.boundary,
                }),
                "bicache step",
            ),
            None => (
                StepPlan::alone(&seqs, n_layers, shift).map_err(internal)?,
                None,
                "denoise step",
            ),
        };
        let mut step = StepEncoder::new(&engine.ctx, label);
        let mut hidden = Vec::with_capacity(passes.len());
        for (st, tokens) in &passes {
            let ids: Vec<u32> = seqs
                .iter()
                .zip(tokens)
                .flat_map(|(s, t)| &t[s.rows.clone()])
                .copied()
                .collect();
            let deep = self.state.deep.as_ref();
            hidden.push(model.encode_plan(&mut step, st, deep, &plan, &ids, shared)?);
        }

        // Rows whose token choice is made the same way share one LM-head pass.
        let mut groups: Vec<SelectGroup> = Vec::new();
        for (k, (_, m)) in self.running.iter().enumerate() {
            let params = engine.select_params(&m.prepared.sampler, m.prepared.conf_exclude);
            let key = selection_key(params);
            let rows = seqs[k].predict.len();
            match groups.iter_mut().find(|g| g.key == key) {
                Some(g) => {
                    g.members.push(k);
                    g.rows += rows;
                }
                None => groups.push(SelectGroup {
                    key,
                    params,
                    members: vec![k],
                    rows,
                }),
            }
        }
        // Select buffers are reused from step to step and grow when a step needs more.
        for (g, group) in groups.iter().enumerate() {
            if self
                .selects
                .get(g)
                .is_none_or(|sel| sel.capacity < group.rows)
            {
                let sel = model.new_select(group.rows)?;
                match self.selects.get_mut(g) {
                    Some(slot) => *slot = sel,
                    None => self.selects.push(sel),
                }
            }
        }
        let mut slots = Vec::with_capacity(groups.len());
        for (group, sel) in groups.iter().zip(&self.selects) {
            let (row_index, positions): (Vec<u32>, Vec<u32>) = group
                .members
                .iter()
                .flat_map(|&k| plan.sampled[k].iter().copied())
                .unzip();
            model.write_select(sel, &row_index, &positions)?;
            let uncond = hidden.get(1).copied();
            model.encode_select_from(
                &mut step,
                hidden[0],
                uncond,
                sel,
                group.rows,
                &group.params,
            )?;
            slots.push(model.read_back_choices(&mut step, sel, group.rows));
        }
        drop(passes);
        let read = step.submit()?.read_async().await?;

        let mut predictions: Vec<Vec<(u32, f32)>> = vec![Vec::new(); seqs.len()];
        for (group, slot) in groups.iter().zip(slots) {
            let mut it = Model::decode_choices(&read[slot]).into_iter();
            for &k in &group.members {
                predictions[k] = it
                    .by_ref()
                    .take(seqs[k].predict.len())
                    .map(|c| (c.token, c.confidence))
                    .collect();
            }
        }
        for ((seq, preds), (id, m)) in seqs.iter().zip(&predictions).zip(&mut self.running) {
            let id = *id;
            let record = engine.commit_step(&mut m.prepared, &seq.predict, preds, &mut |e| {
                on_step(id, e)
            })?;
            m.records.push(record);
        }
        // Finished members leave (and unpin) as soon as they end.
        let mut done = Vec::new();
        let mut k = 0;
        while k < self.running.len() {
            if self.running[k].1.prepared.sampler.is_done() {
                let (id, m) = self.running.remove(k);
                done.push((id, engine.finish(m.prepared, m.records)));
            } else {
                k += 1;
            }
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_free_choices_group_across_seeds_and_steps() {
        let a = SelectParams {
            seed: 1,
            step: 3,
            ..SelectParams::default()
        };
        let b = SelectParams {
            seed: 2,
            step: 9,
            ..SelectParams::default()
        };
        assert_eq!(selection_key(a), selection_key(b));
        let noisy = |seed| SelectParams {
            temperature: 0.5,
            seed,
            ..SelectParams::default()
        };
        assert_ne!(selection_key(noisy(1)), selection_key(noisy(2)));
    }
}
