//! One step of a session's running members: their plans, one forward over all of them, the
//! token choice grouped by select parameters, one read-back and the commits.

use std::borrow::Cow;

use unmask_core::adaptive::{AdaptivePass, AdaptiveStep};
use unmask_core::cache::{ModeStep, SeqState, plan_mode};
use unmask_core::step_plan::{SeqStep, StepPlan};
use unmask_gpu::StepEncoder;
use unmask_gpu::model::{
    AdaptiveInput, AdaptiveShared, ForwardState, Model, PlanBuffers, SharedPrefix,
};
use unmask_gpu::ops::logit_bias::RowBiases;
use unmask_gpu::ops::sampling::SelectParams;

use super::{Member, Session, SessionState};
use crate::{EngineError, Generation, Logprob, StepEvent};

/// The states a step runs over, each with the tokens of every running member: the
/// conditional pass (the canvases, borrowed), and the unconditional one under guidance.
fn pass_tokens<'s>(
    state: &'s SessionState,
    running: &'s [(usize, Member)],
) -> Vec<(&'s ForwardState, Vec<Cow<'s, [u32]>>)> {
    let cond = running
        .iter()
        .map(|(_, m)| Cow::Borrowed(m.prepared.sampler.tokens()))
        .collect();
    let mut out = vec![(&state.st, cond)];
    if let Some(u) = &state.uncond {
        let uncond = running
            .iter()
            .map(|(_, m)| Cow::Owned(m.prepared.sampler.unconditional_tokens()))
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

impl Session<'_> {
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
                    span: p.span.clone(),
                    anchors: &p.anchors,
                    response_start: self.engine.response_start(p),
                    adaptive: p.request.adaptive,
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
                if let Some(a) = &mode.adaptive {
                    t.verified_row_layers += a.verified_rows() * n_layers;
                }
                (mode, seq)
            })
            .collect()
    }

    /// One step of every running member: one forward and one read-back for all of them.
    /// Members that finish leave (unpinning their entry) and are returned with their
    /// generation.
    pub(super) async fn step_running(
        &mut self,
        on_step: &mut dyn FnMut(usize, &StepEvent<'_>),
    ) -> Result<Vec<(usize, Result<Generation, EngineError>)>, EngineError> {
        let engine = self.engine;
        let model = &engine.model;
        let n_layers = model.cfg.n_layers;
        let shift = model.cfg.family.shifts_logits();
        let (modes, seqs): (Vec<ModeStep>, Vec<SeqStep>) = self.plan_members().into_iter().unzip();
        let internal = |e: unmask_core::step_plan::PlanError| EngineError::Internal(e.to_string());
        let passes = pass_tokens(&self.state, &self.running);

        // Prefix-arm's prefix-only pass, in its own submit: the step rewrites the same rows.
        let warm: Vec<SeqStep> = modes
            .iter()
            .zip(&seqs)
            .filter_map(|(mode, seq)| {
                mode.warmup.map(|w| SeqStep {
                    rows: (0..w).into(),
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
                let ids: Vec<u32> = modes
                    .iter()
                    .zip(tokens)
                    .filter_map(|(mode, t)| mode.warmup.map(|w| &t[..w]))
                    .flatten()
                    .copied()
                    .collect();
                model.encode_plan(&mut step, st, None, &plan, &ids, Default::default())?;
            }
            step.submit()?;
        }

        let adaptive: Vec<&AdaptiveStep> =
            modes.iter().filter_map(|m| m.adaptive.as_ref()).collect();
        let shared = self.prefix.as_ref().map(|p| SharedPrefix {
            kv: &p.run.entry.kv,
            tokens: p.run.entry.tokens,
            boundary: &p.run.boundary,
        });
        let depth = self.prefix.as_ref().map(|p| p.key.depth);
        let (plan, label) = match depth {
            // dLLM-Cache lays its rows out without the entry (arena rows of the deep
            // layers) and runs the shallow layers against it (`shallow_layout`).
            _ if !adaptive.is_empty() => {
                let alone: Vec<SeqStep> = seqs
                    .iter()
                    .map(|s| SeqStep {
                        prefix_len: 0,
                        refresh: false,
                        ..s.clone()
                    })
                    .collect();
                let plan = StepPlan::alone(&alone, n_layers, shift).map_err(internal)?;
                (plan, "dllm-cache step")
            }
            Some(b) => (
                StepPlan::shared(&seqs, b, n_layers, shift).map_err(internal)?,
                "bicache step",
            ),
            None => (
                StepPlan::alone(&seqs, n_layers, shift).map_err(internal)?,
                "denoise step",
            ),
        };
        let mut step = StepEncoder::new(&engine.ctx, label);
        let mut hidden = Vec::with_capacity(passes.len());
        let mut picked: Option<(AdaptivePass, usize)> = None;
        if !adaptive.is_empty() {
            // dLLM-Cache: the members' rows through the adaptive layer path.
            let pass = AdaptivePass::new(&plan, &adaptive).map_err(internal)?;
            let (Some(rows), [(st, tokens)]) = (self.state.adaptive.as_ref(), &passes[..]) else {
                return Err(EngineError::Internal(
                    "an adaptive step without its scratch, or under guidance".into(),
                ));
            };
            let caches = self
                .running
                .iter()
                .map(|(_, m)| m.adaptive.as_ref())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    EngineError::Internal("a dLLM-Cache member without its cache".into())
                })?;
            let ids: Vec<u32> = seqs
                .iter()
                .zip(tokens)
                .flat_map(|(s, t)| s.rows.iter().map(|p| t[p]))
                .collect();
            let layout = match (shared, depth) {
                (Some(prefix), Some(b)) => Some(
                    pass.shallow_layout(&plan, &adaptive, prefix.tokens, b)
                        .map_err(internal)?,
                ),
                _ => None,
            };
            let input = AdaptiveInput {
                plan: &plan,
                ids: &ids,
                pass: &pass,
                caches: &caches,
                shared: shared
                    .zip(layout.as_ref())
                    .map(|(prefix, layout)| AdaptiveShared { prefix, layout }),
                record_picks: self
                    .running
                    .iter()
                    .any(|(_, m)| m.prepared.request.record_picks),
            };
            let out = model.encode_adaptive(&mut step, st, rows, input)?;
            hidden.push(out.hidden);
            picked = out.picks.map(|slot| (pass, slot));
        }
        for (st, tokens) in passes.iter().filter(|_| adaptive.is_empty()) {
            let ids: Vec<u32> = seqs
                .iter()
                .zip(tokens)
                .flat_map(|(s, t)| s.rows.iter().map(|p| t[p]))
                .collect();
            let deep = self.state.deep.as_ref();
            let buffers = PlanBuffers {
                prefix: shared,
                ..PlanBuffers::default()
            };
            hidden.push(model.encode_plan(&mut step, st, deep, &plan, &ids, buffers)?);
        }

        // Rows whose token choice is made the same way share one LM-head pass.
        let mut groups: Vec<SelectGroup> = Vec::new();
        for (k, (_, m)) in self.running.iter().enumerate() {
            let asked = m.prepared.logprobs.is_some();
            let params = SelectParams {
                // Rows that report log-probabilities take their own (slightly dearer) pass.
                logprob: asked,
                // Above 0 only where `asked` (it implies log-probabilities).
                top_logprobs: m.prepared.request.top_logprobs as u32,
                ..engine.select_params(&m.prepared.sampler, m.prepared.conf_exclude)
            };
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
        for (group, sel) in groups.iter().zip(&mut self.selects) {
            let (row_index, positions): (Vec<u32>, Vec<u32>) = group
                .members
                .iter()
                .flat_map(|&k| plan.sampled[k].iter().copied())
                .unzip();
            model.write_select(sel, &row_index, &positions)?;
            // Biases are per member (its canvas's penalties), so they do not split groups.
            let mut biases = RowBiases::default();
            for &k in &group.members {
                let sampler = &self.running[k].1.prepared.sampler;
                biases.push(&engine.step_biases(sampler), seqs[k].predict.len());
            }
            model.write_logit_bias(sel, &biases)?;
            let uncond = hidden.get(1).copied();
            model.encode_select_from(
                &mut step,
                hidden[0],
                uncond,
                sel,
                group.rows,
                &group.params,
            )?;
            slots.push(model.read_back_choices(&mut step, sel, group.rows, &group.params));
        }
        drop(passes);
        let read = step.submit()?.read_async().await?;

        let mut predictions: Vec<Vec<(u32, f32)>> = vec![Vec::new(); seqs.len()];
        let mut row_logprobs: Vec<Vec<Option<Logprob>>> = vec![Vec::new(); seqs.len()];
        for (group, slot) in groups.iter().zip(slots) {
            let mut it = Model::decode_choices(&read[slot], &group.params).into_iter();
            for &k in &group.members {
                (predictions[k], row_logprobs[k]) = it
                    .by_ref()
                    .take(seqs[k].predict.len())
                    .map(|c| {
                        let lp = c.logprob.map(|logprob| Logprob {
                            logprob,
                            top: c.alternatives,
                        });
                        ((c.token, c.confidence), lp)
                    })
                    .unzip();
            }
        }
        let words = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect()
        };
        let picks = picked.map(|(pass, slot)| (pass, words(&read[slot])));
        for (k, (mode, (_, m))) in modes.iter().zip(&mut self.running).enumerate() {
            if let (Some(a), Some(report)) = (&mode.adaptive, m.prepared.adaptive.as_mut()) {
                // A step that computes every row (or nothing) reads no list back.
                let picks = m.prepared.request.record_picks.then(|| {
                    picks.as_ref().map_or_else(Vec::new, |(pass, lists)| {
                        pass.picked(k, lists, a.response.start)
                    })
                });
                report.record(a, picks);
            }
        }
        let rows = seqs.iter().zip(&predictions).zip(&row_logprobs);
        for (((seq, preds), lps), (id, m)) in rows.zip(&mut self.running) {
            let id = *id;
            let record =
                engine.commit_step(&mut m.prepared, &seq.predict, preds, lps, &mut |e| {
                    on_step(id, e)
                })?;
            m.records.push(record);
        }
        // Finished members leave (and unpin) as soon as they end.
        let mut done = Vec::new();
        let mut k = 0;
        while k < self.running.len() {
            if self.running[k].1.prepared.is_finished() {
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
