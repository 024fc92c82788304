//! BiCache requests that share one prefix entry run in the same forward passes.
//!
//! Each request keeps its own sampler, positions and KV arena; the batch lays their rows
//! one after the other in one set of activations and their arenas one after the other in
//! one buffer per layer. Every matmul, norm and RoPE then runs once over all the rows (the
//! weights are read once per step, not once per request), attention runs once per request
//! over its own arena window, and the shared entry is segment A of all of them. The depth
//! b is the smallest the requests ask for: a shallow layer must read the same entry K/V
//! for every row it computes. A request alone is a batch of one (`Engine::generate`).

use std::ops::Range;

use unmask_core::cache::bicache_step;
use unmask_core::sampler::StepRecord;
use unmask_gpu::StepEncoder;
use unmask_gpu::model::{ForwardState, LayerPass, LladaModel, SelectBuffers, SeqWindow};
use unmask_gpu::ops::sampling::SelectParams;

use crate::{
    BicacheReport, Engine, EngineError, Generation, PrefixRun, Prepared, Request, StepEvent,
    all_ran,
};

/// One sequence's part of a batched BiCache step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SeqStep {
    /// Positions computed this step (never prefix positions).
    pub rows: Range<usize>,
    /// The deep layers recompute the prefix rows from the entry's boundary state.
    pub refresh: bool,
    pub prefix_len: usize,
    pub seq_len: usize,
    /// First row of the sequence's arena in the batch's arena buffers.
    pub kv_base: usize,
}

/// A copy of hidden rows into the deep layers' input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RowCopy {
    /// The first `rows` rows of the entry's boundary state to `x_deep` row `dst`.
    Boundary { dst: usize, rows: usize },
    /// Rows `src..src + rows` of the shallow output to `x_deep` row `dst`.
    Shallow { src: usize, dst: usize, rows: usize },
}

/// Where every row of a batched step goes: the shallow pass (computed rows against the
/// shared entry), then the deep pass (the same rows, after the prefix rows of the
/// sequences that refresh).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct StepLayout {
    pub positions: Vec<u32>,
    /// Arena row of each shallow row: the shallow layers keep no prefix rows.
    pub shallow_kv: Vec<u32>,
    pub shallow: Vec<SeqWindow>,
    pub deep_positions: Vec<u32>,
    pub deep_kv: Vec<u32>,
    pub deep: Vec<SeqWindow>,
    pub copies: Vec<RowCopy>,
    /// Per sequence, the row of `x_deep` holding its position `rows.start`.
    deep_first: Vec<usize>,
    starts: Vec<usize>,
}

impl StepLayout {
    pub fn build<'a>(seqs: impl IntoIterator<Item = &'a SeqStep>) -> Self {
        let mut l = StepLayout::default();
        for s in seqs {
            let p = s.prefix_len;
            let n = s.rows.len();
            let src = l.positions.len();
            l.shallow.push(SeqWindow {
                rows: src..src + n,
                kv_start: s.kv_base,
                kv_len: s.seq_len - p,
            });
            for pos in s.rows.clone() {
                l.positions.push(pos as u32);
                l.shallow_kv.push((s.kv_base + pos - p) as u32);
            }
            let first = l.deep_positions.len();
            let mut deep_rows: Vec<usize> = Vec::with_capacity(n + p);
            if s.refresh {
                l.copies.push(RowCopy::Boundary {
                    dst: first,
                    rows: p,
                });
                deep_rows.extend(0..p);
            }
            l.copies.push(RowCopy::Shallow {
                src,
                dst: first + deep_rows.len(),
                rows: n,
            });
            l.deep_first.push(first + deep_rows.len());
            deep_rows.extend(s.rows.clone());
            l.deep.push(SeqWindow {
                rows: first..first + deep_rows.len(),
                kv_start: s.kv_base,
                kv_len: s.seq_len,
            });
            for pos in deep_rows {
                l.deep_positions.push(pos as u32);
                l.deep_kv.push((s.kv_base + pos) as u32);
            }
            l.starts.push(s.rows.start);
        }
        l
    }

    /// The row of `x_deep` holding position `pos` of sequence `i` (a computed position).
    pub fn deep_row(&self, i: usize, pos: usize) -> usize {
        self.deep_first[i] + pos - self.starts[i]
    }
}

/// Splits requests of `lengths` positions, in order, into consecutive batches of at most
/// `max_rows` positions in all (one state must fit the device); a request longer than that
/// is a batch of its own (and reports the limit when it runs).
pub(crate) fn split_by_rows(lengths: &[usize], max_rows: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut rows) = (0, 0);
    for (i, &len) in lengths.iter().enumerate() {
        if i > start && rows + len > max_rows {
            out.push(start..i);
            (start, rows) = (i, 0);
        }
        rows += len;
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
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
    predict: Vec<u32>,
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
        let st = match self.model.new_batch_state(total, total) {
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
            match self.admit(&st, depth, r, base) {
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
        st: &ForwardState,
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
                        refresh: plan.refresh,
                        prefix_len: m.prepared.prefix_len,
                        seq_len: s.tokens().len(),
                        kv_base: m.kv_base,
                    },
                    predict: s.rows_to_predict(),
                }
            })
            .collect();
        for s in &steps {
            let first = s.seq.rows.start;
            if let Some(bad) = s.predict.iter().find(|&&pos| (pos as usize) < first) {
                return Err(EngineError::Internal(format!(
                    "position {bad} must be predicted but BiCache computes rows from {first} this step"
                )));
            }
        }
        let layout = StepLayout::build(steps.iter().map(|s| &s.seq));
        let mut step = StepEncoder::new(&self.ctx, "bicache step");
        self.encode_batch_step(&mut step, st, running, &steps, &layout, depth)?;

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
            group.rows += s.predict.len();
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
        for (group, sel) in groups.iter().zip(selects.iter()) {
            let mut row_index = Vec::with_capacity(group.rows);
            let mut positions = Vec::with_capacity(group.rows);
            for &k in &group.members {
                for &pos in &steps[k].predict {
                    row_index.push(layout.deep_row(k, pos as usize) as u32);
                    positions.push(pos);
                }
            }
            self.model.write_select(sel, &row_index, &positions)?;
            self.model.encode_select_from(
                &mut step,
                &st.x_deep,
                None,
                sel,
                group.rows,
                &group.params,
            )?;
        }
        let slots: Vec<usize> = groups
            .iter()
            .zip(selects.iter())
            .map(|(group, sel)| self.model.read_back_choices(&mut step, sel, group.rows))
            .collect();
        let read = step.submit()?.read_async().await?;

        let mut predictions: Vec<Vec<(u32, f32)>> = vec![Vec::new(); steps.len()];
        for (group, slot) in groups.iter().zip(slots) {
            let choices = LladaModel::decode_choices(&read[slot]);
            let mut it = choices.into_iter();
            for &k in &group.members {
                predictions[k] = it
                    .by_ref()
                    .take(steps[k].predict.len())
                    .map(|c| (c.token, c.confidence))
                    .collect();
            }
        }
        for (s, preds) in steps.iter().zip(&predictions) {
            let (index, m) = &mut running[s.member];
            let p = &mut m.prepared;
            let record = p.sampler.commit(preds)?;
            p.timings.steps += 1;
            if p.timings.steps == 1 {
                p.timings.first_step_s = p.start.elapsed_s();
            }
            on_step(
                *index,
                &StepEvent {
                    record: &record,
                    global_step: p.timings.steps,
                    canvas: p.sampler.tokens(),
                    prompt_len: p.prompt.len(),
                    mask_id: self.special.mask,
                    elapsed_s: p.start.elapsed_s(),
                    rows: &s.predict,
                    predictions: preds,
                },
            );
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

    /// Records the layers of one batched step: the shallow layers over every computed row
    /// against the shared entry, then the deep layers over the rows of `layout.deep`
    /// (boundary state first for the sequences that refresh).
    fn encode_batch_step(
        &self,
        step: &mut StepEncoder,
        st: &ForwardState,
        running: &[(usize, Member<'_>)],
        steps: &[MemberStep],
        layout: &StepLayout,
        depth: usize,
    ) -> Result<(), EngineError> {
        let m = &self.model;
        let mut ids = Vec::with_capacity(layout.positions.len());
        for s in steps {
            let tokens = running[s.member].1.prepared.sampler.tokens();
            ids.extend_from_slice(&tokens[s.seq.rows.clone()]);
        }
        m.write_rows(st, &ids, &layout.positions)?;
        st.kv_shallow.write_u32(&self.ctx, &layout.shallow_kv)?;
        st.positions_deep
            .write_u32(&self.ctx, &layout.deep_positions)?;
        st.kv_deep.write_u32(&self.ctx, &layout.deep_kv)?;
        let run = &running
            .first()
            .ok_or_else(|| EngineError::Internal("an empty batch".into()))?
            .1
            .run;
        let entry = &run.entry;
        let rows = ids.len();
        m.encode_embed(step, st, rows)?;
        m.encode_pass(
            step,
            st,
            &LayerPass {
                x: &st.x,
                rows,
                positions: &st.positions,
                kv_index: &st.kv_shallow,
                layers: 0..depth,
                arena: &st.kv,
                seqs: &layout.shallow,
                seg_a: Some((&entry.kv, entry.tokens)),
            },
        )?;
        let row_bytes = (m.cfg.d_model * 4) as u64;
        for copy in &layout.copies {
            match *copy {
                RowCopy::Boundary { dst, rows } => {
                    step.copy(
                        &run.boundary.buffer,
                        0,
                        &st.x_deep.buffer,
                        dst as u64 * row_bytes,
                        rows as u64 * row_bytes,
                    );
                }
                RowCopy::Shallow { src, dst, rows } => step.copy(
                    &st.x.buffer,
                    src as u64 * row_bytes,
                    &st.x_deep.buffer,
                    dst as u64 * row_bytes,
                    rows as u64 * row_bytes,
                ),
            }
        }
        m.encode_pass(
            step,
            st,
            &LayerPass {
                x: &st.x_deep,
                rows: layout.deep_positions.len(),
                positions: &st.positions_deep,
                kv_index: &st.kv_deep,
                layers: depth..m.cfg.n_layers,
                arena: &st.kv,
                seqs: &layout.deep,
                seg_a: None,
            },
        )?;
        Ok(())
    }
}

/// The first row of a free window of `len` rows in an arena of `capacity` rows whose
/// occupied windows are `(start, len)`, if there is one.
pub(crate) fn first_fit(
    occupied: &mut [(usize, usize)],
    len: usize,
    capacity: usize,
) -> Option<usize> {
    occupied.sort_unstable();
    let mut free_from = 0;
    for &(start, used) in occupied.iter() {
        if start >= free_from + len {
            break;
        }
        free_from = free_from.max(start + used);
    }
    (free_from + len <= capacity).then_some(free_from)
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
    state: ForwardState,
    _pin: PrefixRun,
    running: Vec<(usize, Member<'static>)>,
    waiting: std::collections::VecDeque<(usize, Prepared<'static>)>,
    selects: Vec<SelectBuffers>,
    next_id: usize,
    /// Rows × layers spent building the prefix entry (0 when it was stored).
    entry_passes: usize,
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
        let state = self.model.new_batch_state(max_rows, max_rows)?;
        let mut timings = crate::Timings::default();
        let pin = match self.acquire_prefix(&state, prefix, depth, &mut timings)? {
            Ok(run) => run,
            Err(why) => {
                return Err(EngineError::Refused(format!(
                    "the shared prefix cannot be stored: {why}"
                )));
            }
        };
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
        if len > self.state.seq_len {
            return Err(EngineError::Refused(format!(
                "the request needs {len} positions; the session holds {}",
                self.state.seq_len
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
            let Some(base) = first_fit(&mut occupied, len, self.state.seq_len) else {
                break;
            };
            let Some((id, p)) = self.waiting.pop_front() else {
                break;
            };
            match engine.admit(&self.state, self.depth, p, base) {
                Admission::Joined(m) => self.running.push((id, *m)),
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

    fn seq(rows: Range<usize>, refresh: bool, kv_base: usize) -> SeqStep {
        SeqStep {
            rows,
            refresh,
            prefix_len: 6,
            seq_len: 20,
            kv_base,
        }
    }

    #[test]
    fn one_sequence_keeps_its_own_rows() {
        let l = StepLayout::build(&[seq(6..20, true, 0)]);
        assert_eq!(l.positions, (6..20).collect::<Vec<u32>>());
        assert_eq!(l.shallow_kv, (0..14).collect::<Vec<u32>>());
        assert_eq!(l.deep_positions, (0..20).collect::<Vec<u32>>());
        assert_eq!(l.deep_kv, (0..20).collect::<Vec<u32>>());
        assert_eq!(
            l.copies,
            vec![
                RowCopy::Boundary { dst: 0, rows: 6 },
                RowCopy::Shallow {
                    src: 0,
                    dst: 6,
                    rows: 14
                }
            ]
        );
        assert_eq!(l.deep_row(0, 6), 6);
        assert_eq!(l.deep_row(0, 19), 19);
    }

    #[test]
    fn sequences_get_disjoint_rows_and_arena_windows() {
        // A refreshing sequence between two that compute one block each.
        let seqs = [
            seq(8..12, false, 0),
            seq(6..20, true, 20),
            seq(16..20, false, 40),
        ];
        let l = StepLayout::build(&seqs);
        assert_eq!(l.positions.len(), 4 + 14 + 4);
        assert_eq!(l.deep_positions.len(), 4 + 20 + 4);
        for (i, s) in seqs.iter().enumerate() {
            let (sh, dp) = (&l.shallow[i], &l.deep[i]);
            // Shallow arena rows lie inside the sequence's window (no prefix rows there).
            for r in sh.rows.clone() {
                let kv = l.shallow_kv[r] as usize;
                assert!(kv >= s.kv_base && kv < s.kv_base + s.seq_len - s.prefix_len);
                assert_eq!(kv - s.kv_base + s.prefix_len, l.positions[r] as usize);
            }
            for r in dp.rows.clone() {
                let kv = l.deep_kv[r] as usize;
                assert_eq!(kv, s.kv_base + l.deep_positions[r] as usize);
                assert!(kv < s.kv_base + s.seq_len);
            }
            for pos in s.rows.clone() {
                assert_eq!(l.deep_positions[l.deep_row(i, pos)] as usize, pos);
            }
        }
        // Windows tile the rows in order, without gaps or overlaps.
        for w in [&l.shallow, &l.deep] {
            for pair in w.windows(2) {
                assert_eq!(pair[0].rows.end, pair[1].rows.start);
            }
        }
        assert_eq!(l.deep[1].rows, 4..24);
        assert_eq!(l.copies.len(), 4);
    }

    #[test]
    fn first_fit_finds_the_lowest_free_window() {
        assert_eq!(first_fit(&mut [], 10, 10), Some(0));
        assert_eq!(first_fit(&mut [], 11, 10), None);
        assert_eq!(first_fit(&mut [(0, 4), (10, 5)], 6, 20), Some(4));
        assert_eq!(first_fit(&mut [(10, 5), (0, 4)], 7, 20), None);
        assert_eq!(first_fit(&mut [(10, 5), (0, 4)], 5, 20), Some(4));
        assert_eq!(first_fit(&mut [(0, 4), (4, 6)], 10, 20), Some(10));
        assert_eq!(first_fit(&mut [(3, 4)], 3, 20), Some(0));
    }

    #[test]
    fn batches_are_split_to_fit_one_state() {
        assert_eq!(split_by_rows(&[10, 10, 10], 30), vec![0..3]);
        assert_eq!(split_by_rows(&[10, 10, 10], 25), vec![0..2, 2..3]);
        assert_eq!(split_by_rows(&[40, 10, 10], 25), vec![0..1, 1..3]);
        assert_eq!(split_by_rows(&[10, 40, 10], 25), vec![0..1, 1..2, 2..3]);
        assert_eq!(split_by_rows(&[], 25), Vec::<Range<usize>>::new());
        let parts = split_by_rows(&[7; 20], 30);
        assert!(parts.iter().all(|r| r.len() == 4 || r.end == 20));
        assert_eq!(parts.iter().map(|r| r.len()).sum::<usize>(), 20);
    }

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
