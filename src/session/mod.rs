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

use unmask_core::sampler::StepRecord;
use unmask_core::step_plan::first_fit;
use unmask_gpu::model::{AdaptiveCache, AdaptiveRows, DeepRows, ForwardState, SelectBuffers};

use crate::prefix::PrefixRun;
use crate::run::Prepared;
use crate::{BicacheReport, Engine, EngineError, Generation, Refusal, Request, StepEvent};

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
    /// dLLM-Cache's step scratch, made when its first member joins.
    adaptive: Option<AdaptiveRows>,
}

/// A request of a session while it runs.
struct Member {
    prepared: Prepared<'static>,
    /// Its own pin on the session's entry (the first member uses the session's).
    _pin: Option<PrefixRun>,
    kv_base: usize,
    records: Vec<StepRecord>,
    last_block: Option<usize>,
    /// dLLM-Cache: the member's cached attention and MLP outputs of its response.
    adaptive: Option<AdaptiveCache>,
}

mod queue;
mod step;

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
    pub(crate) charge_setup: bool,
    /// Arena windows taken in whole slots of this many rows (`None`: as long as each
    /// request). With slots of the longest request, n slots always hold n requests whatever
    /// order they finish in (packed windows leave gaps that need up to 2n − 1 longest).
    pub(crate) slot_rows: Option<usize>,
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
                    Err(why) => return Err(Refusal::PrefixNotStored(why).into()),
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
                adaptive: None,
            },
            running: Vec::new(),
            waiting: VecDeque::new(),
            selects: Vec::new(),
            next_id: 0,
            guidance: None,
            first_to_join: true,
            charge_setup: false,
            slot_rows: None,
        })
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
    pub(crate) fn admit(&mut self, p: Prepared<'static>) -> Result<usize, EngineError> {
        match (&self.prefix, p.shared) {
            (Some(_), None) => {
                return Err(Refusal::NeedsSharedPrefix(p.why_not_shared()).into());
            }
            (None, Some(_)) => return Err(Refusal::SharesAPrefix.into()),
            (Some(prefix), Some((own_depth, _))) => {
                let key = &prefix.key;
                if p.prefix() != key.tokens {
                    return Err(Refusal::OtherPrefix {
                        request: p.prefix_len,
                        session: key.tokens.len(),
                    }
                    .into());
                }
                if own_depth < key.depth {
                    return Err(Refusal::ShallowerDepth {
                        request: own_depth,
                        session: key.depth,
                    }
                    .into());
                }
            }
            (None, None) => {}
        }
        // dLLM-Cache's steps run their own layer path: its members step with each other.
        let adaptive = p.is_adaptive();
        let members = self.running.iter().map(|(_, m)| &m.prepared);
        if let Some(other) = members
            .chain(self.waiting.iter().map(|(_, w)| w))
            .find(|o| o.is_adaptive() != adaptive)
        {
            return Err(Refusal::OtherCache {
                session: other.mode.to_string(),
                request: p.mode.to_string(),
            }
            .into());
        }
        let guided = p.request.params.cfg_scale > 0.0;
        if let Some(g) = self.guidance.filter(|&g| g != guided) {
            let has = |g: bool| if g { "with" } else { "without" };
            return Err(Refusal::Guidance {
                session: has(g),
                request: has(guided),
            }
            .into());
        }
        let len = p.sampler.tokens().len();
        if len > self.state.st.seq_len {
            return Err(Refusal::TooLong {
                needed: len,
                holds: self.state.st.seq_len,
            }
            .into());
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

    /// Positions (prompts and canvases) of the running requests: the arena rows in use.
    pub fn running_positions(&self) -> usize {
        self.running
            .iter()
            .map(|(_, m)| m.prepared.sampler.tokens().len())
            .sum()
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
        self.place_waiting(&mut done).await;
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
    async fn place_waiting(&mut self, done: &mut Vec<(usize, Result<Generation, EngineError>)>) {
        let engine = self.engine;
        let slot_rows = self.slot_rows;
        let window = move |len: usize| slot_rows.map_or(len, |s| len.div_ceil(s.max(1)) * s);
        while let Some((_, p)) = self.waiting.front() {
            let len = window(p.sampler.tokens().len());
            let mut occupied: Vec<(usize, usize)> = self
                .running
                .iter()
                .map(|(_, m)| (m.kv_base, window(m.prepared.sampler.tokens().len())))
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
                            done.push((id, Err(Refusal::CouldNotJoin(why).into())));
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
            if let Err(e) = self.join_span(&mut p, kv_base).await {
                done.push((id, Err(e)));
                continue;
            }
            let adaptive = match self.join_adaptive(&p) {
                Ok(cache) => cache,
                Err(e) => {
                    done.push((id, Err(e)));
                    continue;
                }
            };
            p.timings.setup_s = p.start.elapsed_s();
            self.running.push((
                id,
                Member {
                    prepared: p,
                    _pin: pin,
                    kv_base,
                    records: Vec::new(),
                    last_block: None,
                    adaptive,
                },
            ));
        }
    }

    /// A dLLM-Cache member's caches (and the session's step scratch, with the first).
    fn join_adaptive(
        &mut self,
        p: &Prepared<'static>,
    ) -> Result<Option<AdaptiveCache>, EngineError> {
        if !p.is_adaptive() {
            return Ok(None);
        }
        let model = &self.engine.model;
        if self.state.adaptive.is_none() {
            self.state.adaptive = Some(model.new_adaptive_rows(self.state.st.capacity)?);
        }
        let response = p.sampler.tokens().len() - self.engine.response_start(p);
        Ok(Some(model.new_adaptive_cache(response)?))
    }

    /// An ACache member's span: its entry (built on a miss), placed at the member's offset
    /// in its arena window from `kv_base`, and the probe that picks its anchors. The pin is
    /// held only while the span is copied. A span the store cannot take makes the member
    /// run as the dual cache.
    async fn join_span(
        &self,
        p: &mut Prepared<'static>,
        kv_base: usize,
    ) -> Result<(), EngineError> {
        let Some(span) = p.span.clone() else {
            return Ok(());
        };
        let engine = self.engine;
        let tokens = &p.prompt[span.clone()];
        let crate::prefix::HeldEntry { pin, entry, hit } =
            match engine.acquire_entry(&self.state.st, tokens, None, &mut p.timings)? {
                Ok(found) => found,
                Err(why) => {
                    p.fall_back_from_span(why);
                    return Ok(());
                }
            };
        let anchors = engine
            .place_span_and_probe(
                &self.state.st,
                kv_base,
                p.sampler.tokens(),
                span.clone(),
                &entry,
                p.request.anchor_ratio,
                &mut p.timings,
            )
            .await?;
        drop(pin);
        if let Some(report) = p.acache.as_mut() {
            report.hit = hit;
            report.entry_bytes = entry.kv_bytes() + entry.boundary_bytes();
            report.anchors = anchors.iter().map(|&a| a - span.start as u32).collect();
        }
        p.anchors = anchors;
        Ok(())
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
}
