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
use unmask_gpu::model::{ForwardState, LayerPass, SelectBuffers, SeqWindow};
use unmask_gpu::ops::sampling::SelectParams;

use crate::{
    BicacheReport, Engine, EngineError, Finished, Generation, PrefixRun, Prepared, StepEvent,
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
    pub fn build(seqs: &[SeqStep]) -> Self {
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
                    .map(|_| Err(EngineError::Request(why.clone())))
                    .collect();
            }
        };
        let depth = requests
            .iter()
            .filter_map(|r| r.shared.map(|s| s.0))
            .min()
            .unwrap_or(0);
        let mut members = Vec::with_capacity(n);
        let mut alone = Vec::new();
        let mut kv_base = 0;
        for (i, mut r) in requests.into_iter().enumerate() {
            let base = kv_base;
            kv_base += r.sampler.tokens().len();
            let Some((requested_depth, ratio)) = r.shared else {
                alone.push((i, r));
                continue;
            };
            let prefix = &r.prompt[..r.prefix_len];
            match self.acquire_prefix(&st, prefix, depth, &mut r.timings) {
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
                    members.push((
                        i,
                        Member {
                            prepared: r,
                            run,
                            kv_base: base,
                            records: Vec::new(),
                            last_block: None,
                        },
                    ));
                }
                Ok(Err(why)) => {
                    r.fall_back(why);
                    alone.push((i, r));
                }
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let batch = members.len();
        for (_, m) in &mut members {
            if let Some(report) = &mut m.prepared.report {
                report.batch = batch;
            }
        }
        let mut running: Vec<(usize, Member)> = members;
        if let Err(e) = self
            .run_members(&st, depth, &mut running, &mut results, on_step)
            .await
        {
            // A GPU or sampler error stops every request still running.
            let why = e.to_string();
            for (i, m) in running.drain(..) {
                self.release_prefix(m.run.id);
                results[i] = Some(Err(EngineError::Request(why.clone())));
            }
        }
        drop(st);
        for (i, r) in alone {
            let result = self.run_alone(r, &mut |event| on_step(i, event)).await;
            results[i] = Some(result);
        }
        all_ran(results)
    }

    /// The denoising loop of a batch: one forward and one read-back per step for every
    /// request still running. Finished requests leave `running` with their result.
    async fn run_members(
        &self,
        st: &ForwardState,
        depth: usize,
        running: &mut Vec<(usize, Member<'_>)>,
        results: &mut [Option<Result<Generation, EngineError>>],
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Result<(), EngineError> {
        let n_layers = self.model.cfg.n_layers;
        let select_rows: usize = running
            .iter()
            .map(|(_, m)| m.prepared.request.params.gen_length)
            .sum();
        let mut selects: Vec<SelectBuffers> = Vec::new();
        for (_, m) in running.iter_mut() {
            m.prepared.timings.setup_s = m.prepared.start.elapsed_s();
        }
        while !running.is_empty() {
            let steps: Vec<MemberStep> = running
                .iter_mut()
                .enumerate()
                .map(|(k, (_, m))| {
                    let s = &m.prepared.sampler;
                    let block_start = m.last_block != Some(s.block_index());
                    m.last_block = Some(s.block_index());
                    let r = m.prepared.request;
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
                    return Err(EngineError::Request(format!(
                        "position {bad} must be predicted but BiCache computes rows from {first} this step"
                    )));
                }
            }
            let seqs: Vec<SeqStep> = steps.iter().map(|s| s.seq.clone()).collect();
            let layout = StepLayout::build(&seqs);
            let mut step = StepEncoder::new(&self.ctx, "bicache step");
            self.encode_batch_step(&mut step, st, running, &steps, &layout, depth)?;

            // Rows whose token choice is made the same way share one LM-head pass.
            let mut groups: Vec<(SelectParams, Vec<usize>)> = Vec::new();
            for (k, s) in steps.iter().enumerate() {
                let m = &running[s.member].1;
                let params = self.select_params(&m.prepared.sampler, m.prepared.conf_exclude);
                let key = selection_key(params);
                match groups.iter_mut().find(|(g, _)| selection_key(*g) == key) {
                    Some((_, ks)) => ks.push(k),
                    None => groups.push((params, vec![k])),
                }
            }
            while selects.len() < groups.len() {
                selects.push(self.model.new_select(select_rows)?);
            }
            for ((params, ks), sel) in groups.iter().zip(&selects) {
                let mut row_index = Vec::new();
                let mut positions = Vec::new();
                for &k in ks {
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
                    row_index.len(),
                    params,
                )?;
            }
            step.submit()?;

            let mut predictions: Vec<Vec<(u32, f32)>> = vec![Vec::new(); steps.len()];
            for ((_, ks), sel) in groups.iter().zip(&selects) {
                let count = ks.iter().map(|&k| steps[k].predict.len()).sum();
                let choices = self.model.read_choices_async(sel, count).await?;
                let mut it = choices.into_iter();
                for &k in ks {
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
            let mut k = 0;
            while k < running.len() {
                if running[k].1.prepared.sampler.is_done() {
                    let (index, m) = running.remove(k);
                    self.release_prefix(m.run.id);
                    let p = m.prepared;
                    results[index] = Some(self.finish(Finished {
                        request: p.request,
                        start: p.start,
                        prompt: p.prompt,
                        prefix_len: p.prefix_len,
                        sampler: p.sampler,
                        records: m.records,
                        timings: p.timings,
                        report: p.report,
                    }));
                } else {
                    k += 1;
                }
            }
        }
        Ok(())
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
        let entry = &running
            .first()
            .ok_or_else(|| EngineError::Request("an empty batch".into()))?
            .1
            .run
            .entry;
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
                    let boundary = entry.boundary(depth).ok_or_else(|| {
                        EngineError::Request(format!(
                            "the shared entry has no boundary state for depth {depth}"
                        ))
                    })?;
                    step.copy(
                        &boundary.buffer,
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
