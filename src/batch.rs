//! BiCache requests that share one prefix entry run in the same forward passes.
//!
//! Each request keeps its own sampler, positions and KV arena; the batch lays their rows
//! one after the other in one set of activations and their arenas one after the other in
//! one buffer per layer. Every matmul, norm and RoPE then runs once over all the rows (the
//! weights are read once per step, not once per request), attention runs once per request
//! over its own arena window, and the shared entry is segment A of all of them. The depth
//! b is the smallest the requests ask for: a shallow layer must read the same entry K/V
//! for every row it computes. A request alone is a batch of one (`Engine::generate`).

use unmask_core::cache::bicache_step;
use unmask_core::sampler::StepRecord;
use unmask_core::step_plan::{SeqStep, StepPlan, first_fit};
use unmask_gpu::StepEncoder;
use unmask_gpu::model::{DeepRows, ForwardState, Model, SelectBuffers, SharedPrefix};
use unmask_gpu::ops::sampling::SelectParams;

use crate::prefix::PrefixRun;
use crate::run::{Prepared, all_ran};
use crate::{BicacheReport, Engine, EngineError, Generation, Request, StepEvent};

/// The GPU state of a batch: activations and arenas for all its rows, and the rows of the
/// deep layers (a batch always shares a prefix).
pub(crate) struct BatchState {
    pub st: ForwardState,
    pub deep: DeepRows,
}

impl Engine {
    /// A batch state for `rows` positions of running requests at once.
    pub(crate) fn new_batch_state(&self, rows: usize) -> Result<BatchState, EngineError> {
        Ok(BatchState {
            st: self.model.new_batch_state(rows, rows)?,
            deep: self.model.new_deep_rows(rows)?,
        })
    }
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

/// A request of a batch while it runs.
struct Member<'r> {
    prepared: Prepared<'r>,
    run: PrefixRun,
    kv_base: usize,
    records: Vec<StepRecord>,
    last_block: Option<usize>,
}

/// What became of a request offered to a batch.
enum Admission<'r> {
    Joined(Box<Member<'r>>),
    /// It cannot share the prefix (or its entry does not fit): it runs alone.
    Alone(Box<Prepared<'r>>),
    Failed(EngineError),
}

/// Members whose rows share one LM-head and select pass this step.
struct SelectGroup {
    key: SelectParams,
    params: SelectParams,
    members: Vec<usize>,
    /// Sampled rows of all its members.
    rows: usize,
}

/// One step of one running member: what it computes and which positions it samples.
struct MemberStep {
    member: usize,
    seq: SeqStep,
}

impl Engine {
    /// Runs requests that share one prefix (the same prompt tokens before `prefix_len`)
    /// through BiCache in the same forward passes; results in the order given. A request
    /// whose entry cannot be stored runs alone with its fallback mode afterwards.
    pub(crate) async fn run_shared_prefix(
        &self,
        requests: Vec<Prepared<'_>>,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Vec<Result<Generation, EngineError>> {
        let n = requests.len();
        let mut results: Vec<Option<Result<Generation, EngineError>>> =
            (0..n).map(|_| None).collect();
        let total: usize = requests.iter().map(|r| r.sampler.tokens().len()).sum();
        let st = match self.new_batch_state(total) {
            Ok(st) => st,
            Err(e) => {
                let why = e.to_string();
                return (0..n)
                    .map(|_| Err(EngineError::BatchStopped(why.clone())))
                    .collect();
            }
        };
        let depth = requests
            .iter()
            .filter_map(|r| r.shared.map(|s| s.0))
            .min()
            .unwrap_or(0);
        let mut running = Vec::with_capacity(n);
        let mut alone = Vec::new();
        let mut kv_base = 0;
        for (i, r) in requests.into_iter().enumerate() {
            let base = kv_base;
            kv_base += r.sampler.tokens().len();
            match self.admit(&st.st, depth, r, base) {
                Admission::Joined(m) => running.push((i, *m)),
                Admission::Alone(r) => alone.push((i, *r)),
                Admission::Failed(e) => results[i] = Some(Err(e)),
            }
        }
        let mut selects = Vec::new();
        while !running.is_empty() {
            match self
                .batch_step(&st, depth, &mut running, &mut selects, on_step)
                .await
            {
                Ok(done) => {
                    for (i, g) in done {
                        results[i] = Some(g);
                    }
                }
                Err(e) => {
                    for (i, g) in self.stop_all(&mut running, e) {
                        results[i] = Some(g);
                    }
                }
            }
        }
        drop(st);
        for (i, r) in alone {
            let result = self.run_alone(r, &mut |event| on_step(i, event)).await;
            results[i] = Some(result);
        }
        all_ran(results)
    }

    /// A GPU or sampler error in a step stops every request still running: each gets the
    /// error as its result and unpins the entry (its pin goes with it).
    fn stop_all(
        &self,
        running: &mut Vec<(usize, Member<'_>)>,
        error: EngineError,
    ) -> Vec<(usize, Result<Generation, EngineError>)> {
        let why = error.to_string();
        running
            .drain(..)
            .map(|(i, _member)| (i, Err(EngineError::BatchStopped(why.clone()))))
            .collect()
    }

    /// Pins the shared entry for a request whose arena starts at row `kv_base` of `st`
    /// (building the entry on a miss). A request whose entry cannot be stored falls back
    /// and runs alone.
    fn admit<'r>(
        &self,
        st: &ForwardState,
        depth: usize,
        mut r: Prepared<'r>,
        kv_base: usize,
    ) -> Admission<'r> {
        let Some((requested_depth, ratio)) = r.shared else {
            return Admission::Alone(Box::new(r));
        };
        // The prefix by its fields: the timings are borrowed mutably beside it.
        let prefix = &r.prompt[..r.prefix_len];
        match self.acquire_prefix(st, prefix, depth, &mut r.timings) {
            Ok(Ok(run)) => {
                r.report = Some(BicacheReport {
                    depth,
                    requested_depth,
                    ratio,
                    hit: run.hit,
                    entry_tokens: r.prefix_len,
                    entry_bytes: run.entry.kv_bytes() + run.entry.boundary_bytes(),
                    batch: 0,
                    fallback: None,
                });
                r.timings.setup_s = r.start.elapsed_s();
                Admission::Joined(Box::new(Member {
                    prepared: r,
                    run,
                    kv_base,
                    records: Vec::new(),
                    last_block: None,
                }))
            }
            Ok(Err(why)) => {
                r.fall_back(why);
                Admission::Alone(Box::new(r))
            }
            Err(e) => Admission::Failed(e),
        }
    }

    /// One step of a batch: one forward and one read-back for every running request.
    /// Requests that finish leave `running` (unpinning the entry) and are returned with
    /// their generation.
    async fn batch_step<'r>(
        &self,
        st: &BatchState,
        depth: usize,
        running: &mut Vec<(usize, Member<'r>)>,
        selects: &mut Vec<SelectBuffers>,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Result<Vec<(usize, Result<Generation, EngineError>)>, EngineError> {
        let n_layers = self.model.cfg.n_layers;
        let batch = running.len();
        for (_, m) in running.iter_mut() {
            if let Some(report) = &mut m.prepared.report {
                report.batch = report.batch.max(batch);
            }
        }
        let steps: Vec<MemberStep> = running
            .iter_mut()
            .enumerate()
            .map(|(k, (_, m))| {
                let s = &m.prepared.sampler;
                let block_start = m.last_block != Some(s.block_index());
                m.last_block = Some(s.block_index());
                let r = &m.prepared.request;
                let plan = bicache_step(
                    m.prepared.mode == crate::CacheMode::BicacheDual,
                    m.prepared.prefix_len,
                    s.tokens().len(),
                    s.block(),
                    block_start,
                    s.num_blocks() > 1,
                    m.prepared.timings.steps,
                    r.refresh_every,
                );
                let t = &mut m.prepared.timings;
                t.token_layer_passes +=
                    plan.token_layer_passes(depth, n_layers, m.prepared.prefix_len);
                t.forward_passes += 1;
                MemberStep {
                    member: k,
                    seq: SeqStep {
                        rows: plan.rows,
                        prefix_len: m.prepared.prefix_len,
                        refresh: plan.refresh,
                        seq_len: s.tokens().len(),
                        kv_len: s.tokens().len(),
                        kv_base: m.kv_base,
                        predict: s.rows_to_predict(),
                    },
                }
            })
            .collect();
        let seqs: Vec<SeqStep> = steps.iter().map(|s| s.seq.clone()).collect();
        let shift = self.model.cfg.family.shifts_logits();
        let plan = StepPlan::shared(&seqs, depth, n_layers, shift)
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        let mut ids = Vec::with_capacity(plan.shallow.len());
        for s in &steps {
            let tokens = running[s.member].1.prepared.sampler.tokens();
            ids.extend_from_slice(&tokens[s.seq.rows.clone()]);
        }
        let run = &running
            .first()
            .ok_or_else(|| EngineError::Internal("an empty batch".into()))?
            .1
            .run;
        let mut step = StepEncoder::new(&self.ctx, "bicache step");
        let hidden = self.model.encode_plan(
            &mut step,
            &st.st,
            Some(&st.deep),
            &plan,
            &ids,
            Some(SharedPrefix {
                kv: &run.entry.kv,
                tokens: run.entry.tokens,
                boundary: &run.boundary,
            }),
        )?;

        // Rows whose token choice is made the same way share one LM-head pass.
        let mut groups: Vec<SelectGroup> = Vec::new();
        for (k, s) in steps.iter().enumerate() {
            let m = &running[s.member].1;
            let params = self.select_params(&m.prepared.sampler, m.prepared.conf_exclude);
            let key = selection_key(params);
            let group = match groups.iter_mut().find(|g| g.key == key) {
                Some(g) => g,
                None => {
                    groups.push(SelectGroup {
                        key,
                        params,
                        members: Vec::new(),
                        rows: 0,
                    });
                    groups.last_mut().expect("just pushed")
                }
            };
            group.members.push(k);
            group.rows += s.seq.predict.len();
        }
        // Select buffers are reused from step to step and grow when a step needs more.
        for (g, group) in groups.iter().enumerate() {
            let rows = group.rows;
            if selects.get(g).is_none_or(|sel| sel.capacity < rows) {
                let sel = self.model.new_select(rows)?;
                if g < selects.len() {
                    selects[g] = sel;
                } else {
                    selects.push(sel);
                }
            }
        }
        let mut slots = Vec::with_capacity(groups.len());
        for (group, sel) in groups.iter().zip(selects.iter()) {
            let (row_index, positions): (Vec<u32>, Vec<u32>) = group
                .members
                .iter()
                .flat_map(|&k| plan.sampled[k].iter().copied())
                .unzip();
            self.model.write_select(sel, &row_index, &positions)?;
            self.model.encode_select_from(
                &mut step,
                hidden,
                None,
                sel,
                group.rows,
                &group.params,
            )?;
            slots.push(self.model.read_back_choices(&mut step, sel, group.rows));
        }
        let read = step.submit()?.read_async().await?;

        let mut predictions: Vec<Vec<(u32, f32)>> = vec![Vec::new(); steps.len()];
        for (group, slot) in groups.iter().zip(slots) {
            let mut it = Model::decode_choices(&read[slot]).into_iter();
            for &k in &group.members {
                predictions[k] = it
                    .by_ref()
                    .take(steps[k].seq.predict.len())
                    .map(|c| (c.token, c.confidence))
                    .collect();
            }
        }
        for (s, preds) in steps.iter().zip(&predictions) {
            let (index, m) = &mut running[s.member];
            let record = self.commit_step(&mut m.prepared, &s.seq.predict, preds, &mut |e| {
                on_step(*index, e)
            })?;
            m.records.push(record);
        }
        // Finished requests leave the batch (and unpin the entry) as soon as they end.
        let mut done = Vec::new();
        let mut k = 0;
        while k < running.len() {
            if running[k].1.prepared.sampler.is_done() {
                let (index, m) = running.remove(k);
                done.push((index, self.finish(m.prepared, m.records)));
            } else {
                k += 1;
            }
        }
        Ok(done)
    }
}

/// Continuous batching for one shared prefix: requests are submitted at any time and join
/// the running batch at the next step once their arena fits, and each finished request is
/// handed back as soon as it ends. Every step runs all running requests in one forward
/// pass, as `Engine::generate_batch` does.
///
/// The session keeps its prefix entry pinned while it lives and runs every request at its
/// depth b: a request whose own depth (`Request::depth`, else the model's table) is smaller
/// is refused, so no request reuses more shallow layers than its policy allows.
pub struct BatchSession<'e> {
    engine: &'e Engine,
    prefix: Vec<u32>,
    depth: usize,
    state: BatchState,
    _pin: PrefixRun,
    running: Vec<(usize, Member<'static>)>,
    waiting: std::collections::VecDeque<(usize, Prepared<'static>)>,
    selects: Vec<SelectBuffers>,
    next_id: usize,
    /// Rows × layers spent building the prefix entry (0 when it was stored).
    entry_passes: usize,
    /// The session stored a new entry (it was not in the store) and no request has joined
    /// yet: the first to join reports the miss.
    miss_to_report: bool,
}

impl Engine {
    /// A batch session for requests whose shared prefix is `prefix`, at BiCache depth
    /// `depth`, holding up to `max_rows` positions of running requests at once (their
    /// prompts and canvases together). Builds the prefix entry if it is not stored.
    pub fn batch_session(
        &self,
        prefix: &[u32],
        depth: usize,
        max_rows: usize,
    ) -> Result<BatchSession<'_>, EngineError> {
        let n_layers = self.model.cfg.n_layers;
        if prefix.is_empty() {
            return Err(EngineError::Invalid {
                field: "prefix",
                expected: "a non-empty shared prefix for a batch session".into(),
                found: "none".into(),
            });
        }
        if depth > n_layers {
            return Err(EngineError::Invalid {
                field: "depth",
                expected: format!("at most the model's {n_layers} layers"),
                found: depth.to_string(),
            });
        }
        let limit = self.model.max_state_rows();
        if max_rows <= prefix.len() || max_rows > limit {
            return Err(EngineError::Invalid {
                field: "max_rows",
                expected: format!(
                    "more than the prefix's {} tokens and at most one storage binding's {limit} \
                     rows on this device",
                    prefix.len()
                ),
                found: max_rows.to_string(),
            });
        }
        let state = self.new_batch_state(max_rows)?;
        let mut timings = crate::Timings::default();
        let pin = match self.acquire_prefix(&state.st, prefix, depth, &mut timings)? {
            Ok(run) => run,
            Err(why) => {
                return Err(EngineError::Refused(format!(
                    "the shared prefix cannot be stored: {why}"
                )));
            }
        };
        let miss = !pin.hit;
        Ok(BatchSession {
            engine: self,
            prefix: prefix.to_vec(),
            depth,
            state,
            _pin: pin,
            running: Vec::new(),
            waiting: Default::default(),
            selects: Vec::new(),
            next_id: 0,
            entry_passes: timings.token_layer_passes,
            miss_to_report: miss,
        })
    }
}

impl BatchSession<'_> {
    /// Queues a request; it joins the batch at a coming step. Returns its id, which
    /// `step` hands back with its generation. A request the session cannot run is refused
    /// here, with the reason.
    pub fn submit(&mut self, request: Request) -> Result<usize, EngineError> {
        let p = self.engine.prepare(std::borrow::Cow::Owned(request))?;
        let Some((own_depth, _)) = p.shared else {
            return Err(EngineError::Refused(format!(
                "a batch session runs BiCache requests only: {}",
                p.why_not_shared()
            )));
        };
        if p.prefix() != self.prefix {
            return Err(EngineError::Refused(format!(
                "the request's shared prefix ({} tokens) is not the session's ({} tokens)",
                p.prefix_len,
                self.prefix.len()
            )));
        }
        if own_depth < self.depth {
            return Err(EngineError::Refused(format!(
                "the request's depth b = {own_depth} is below the session's b = {}: it would \
                 reuse more shallow layers than its policy allows",
                self.depth
            )));
        }
        let len = p.sampler.tokens().len();
        if len > self.state.st.seq_len {
            return Err(EngineError::Refused(format!(
                "the request needs {len} positions; the session holds {}",
                self.state.st.seq_len
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, p));
        Ok(id)
    }

    /// Withdraws request `id` (its client went away): it leaves the queue, or the batch
    /// before the next step, and its pin on the entry goes with it. False when the session
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

    /// Requests running in the batch.
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

    /// BiCache depth of every request of the session.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Rows × layers the session spent building its prefix entry (0 when it was stored);
    /// the requests' own `token_layer_passes` do not include them.
    pub fn entry_token_layer_passes(&self) -> usize {
        self.entry_passes
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
        let engine = self.engine;
        let mut done = Vec::new();
        // First come, first served: a request that does not fit yet holds back later ones.
        while let Some((_, p)) = self.waiting.front() {
            let len = p.sampler.tokens().len();
            let mut occupied: Vec<(usize, usize)> = self
                .running
                .iter()
                .map(|(_, m)| (m.kv_base, m.prepared.sampler.tokens().len()))
                .collect();
            let Some(base) = first_fit(&mut occupied, len, self.state.st.seq_len) else {
                break;
            };
            let Some((id, p)) = self.waiting.pop_front() else {
                break;
            };
            match engine.admit(&self.state.st, self.depth, p, base) {
                Admission::Joined(mut m) => {
                    if std::mem::take(&mut self.miss_to_report)
                        && let Some(report) = &mut m.prepared.report
                    {
                        report.hit = false;
                    }
                    self.running.push((id, *m))
                }
                Admission::Alone(p) => done.push((
                    id,
                    Err(EngineError::Refused(format!(
                        "the request could not join the batch: {}",
                        p.why_not_shared()
                    ))),
                )),
                Admission::Failed(e) => done.push((id, Err(e))),
            }
        }
        if self.running.is_empty() {
            return done;
        }
        let step = engine
            .batch_step(
                &self.state,
                self.depth,
                &mut self.running,
                &mut self.selects,
                on_step,
            )
            .await;
        match step {
            Ok(finished) => done.extend(finished),
            Err(e) => done.extend(engine.stop_all(&mut self.running, e)),
        }
        done
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
