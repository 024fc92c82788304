//! Running one request: its preparation (tokens, sampler, cache decisions), the step loop
//! of a request that shares no prefix entry, and the generation it ends with.

use unmask_core::cache::{CacheMode, PassPlan, PlanInput, plan_step};
use unmask_core::config::ModelFamily;
use unmask_core::sampler::{ConfidenceKind, Remasking, Sampler, Schedule, StepRecord};
use unmask_core::step_plan::{SeqStep, StepPlan};
use unmask_gpu::StepEncoder;
use unmask_gpu::model::{ForwardState, Model, SelectBuffers};
use unmask_gpu::ops::sampling::SelectParams;

use crate::{
    BicacheReport, Engine, EngineError, Generation, Request, StepEvent, Stopwatch, Timings,
};

/// A request ready to run: its tokens, its sampler and how it will use the caches.
pub(crate) struct Prepared<'r> {
    /// Borrowed from the caller, or owned by a `BatchSession`.
    pub(crate) request: std::borrow::Cow<'r, Request>,
    pub(crate) start: Stopwatch,
    pub(crate) prompt: Vec<u32>,
    pub(crate) prefix_len: usize,
    pub(crate) sampler: Sampler,
    pub(crate) conf_exclude: [Option<u32>; 2],
    /// The mode that runs: a BiCache mode that cannot share its prefix falls back.
    pub(crate) mode: CacheMode,
    pub(crate) report: Option<BicacheReport>,
    /// (depth, ratio) of a request that shares its prefix through the store.
    pub(crate) shared: Option<(usize, u32)>,
    pub(crate) timings: Timings,
}

impl Prepared<'_> {
    /// The prompt's shared prefix.
    pub(crate) fn prefix(&self) -> &[u32] {
        &self.prompt[..self.prefix_len]
    }

    /// Why the request does not share a prefix entry: its fallback, or its mode.
    pub(crate) fn why_not_shared(&self) -> String {
        self.report
            .as_ref()
            .and_then(|r| r.fallback.clone())
            .unwrap_or_else(|| format!("cache mode {} is not a BiCache mode", self.mode))
    }

    /// Runs without BiCache: `bicache-dual` as `fast-dllm-dual`, `bicache` as `none`.
    pub(crate) fn fall_back(&mut self, why: String) {
        let mode = if self.mode == CacheMode::BicacheDual {
            CacheMode::FastDllmDual
        } else {
            CacheMode::None
        };
        self.mode = mode;
        self.shared = None;
        self.report = Some(BicacheReport::fallback(mode, why));
    }
}

/// Commits the predictions of `rows` to a request's sampler, counts the step and reports
/// it through `on_step`; `prompt` is (prompt length, mask id) for the event.
fn commit_predictions(
    sampler: &mut Sampler,
    timings: &mut Timings,
    start: Stopwatch,
    prompt: (usize, u32),
    rows: &[u32],
    predictions: &[(u32, f32)],
    on_step: &mut dyn FnMut(&StepEvent<'_>),
) -> Result<StepRecord, EngineError> {
    let record = sampler.commit(predictions)?;
    timings.steps += 1;
    if timings.steps == 1 {
        timings.first_step_s = start.elapsed_s();
    }
    on_step(&StepEvent {
        record: &record,
        global_step: timings.steps,
        canvas: sampler.tokens(),
        prompt_len: prompt.0,
        mask_id: prompt.1,
        elapsed_s: start.elapsed_s(),
        rows,
        predictions,
    });
    Ok(record)
}

/// The results of a set of requests, each of which ran.
pub(crate) fn all_ran(
    results: Vec<Option<Result<Generation, EngineError>>>,
) -> Vec<Result<Generation, EngineError>> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(EngineError::Internal("a request did not run".into()))))
        .collect()
}

impl Engine {
    /// Tokens, sampler and cache decisions of a request, before any GPU work.
    pub(crate) fn prepare<'r>(
        &self,
        request: std::borrow::Cow<'r, Request>,
    ) -> Result<Prepared<'r>, EngineError> {
        let start = Stopwatch::start();
        let req: &Request = &request;
        let (prompt, prefix_len, prefix_note) = self.prompt_and_prefix(req)?;
        let p = &req.params;
        let cfg = &self.model.cfg;
        let mut params = p.clone();
        if params.schedule == Schedule::Auto {
            params.schedule = match cfg.family {
                ModelFamily::Dream => Schedule::DREAM,
                ModelFamily::Llada => Schedule::Llada,
            };
        }
        // Like the schedule, the family's cut when the request names none.
        params.top_k = self.effective_top_k(&params);
        let sampler = Sampler::new(
            &prompt,
            params,
            self.special().mask,
            cfg.max_sequence_length,
        )?;
        if let Some((i, t)) = prompt
            .iter()
            .enumerate()
            .find(|&(_, &t)| t as usize >= cfg.embedding_size)
        {
            return Err(EngineError::Invalid {
                field: "prompt",
                expected: format!("token ids below the vocabulary's {}", cfg.embedding_size),
                found: format!("{t} at position {i}"),
            });
        }
        if let Some(b) = req.depth.filter(|&b| b > cfg.n_layers) {
            return Err(EngineError::Invalid {
                field: "depth",
                expected: format!("at most the model's {} layers", cfg.n_layers),
                found: b.to_string(),
            });
        }
        let cached = req.cache != CacheMode::None && !req.recompute_all;
        if cached && prompt.contains(&self.special().mask) {
            return Err(EngineError::Invalid {
                field: "cache",
                expected: "none for a prompt with masks inside it (infilling): cached modes \
                           predict only the current block"
                    .into(),
                found: req.cache.to_string(),
            });
        }
        let conf_exclude = match (p.confidence_eos_eot_inf, p.temperature == 0.0) {
            // The reference's chained assignment: at T = 0 both EOS and EoT drop out of the
            // confidence softmax; at T > 0 only EoT does (see llada.md §3.1).
            (true, true) => [Some(self.special().eos), self.special().eot],
            (true, false) => [self.special().eot, None],
            (false, _) => [None, None],
        };
        // BiCache needs a shared prefix it can key on; otherwise the request runs with the
        // mode's fallback and the report says why.
        let sharing = if req.cache.is_bicache() && !req.recompute_all {
            let u = prompt.len() - prefix_len;
            Some(if let Some(note) = prefix_note {
                Err(note)
            } else if p.cfg_scale > 0.0 {
                Err("classifier-free guidance masks the prefix, so it cannot be shared".into())
            } else {
                self.bicache_depth(req, prefix_len, u, p.gen_length)
            })
        } else {
            None
        };
        let mode = req.cache;
        let mut prepared = Prepared {
            request,
            start,
            prompt,
            prefix_len,
            sampler,
            conf_exclude,
            mode,
            report: None,
            shared: None,
            timings: Timings::default(),
        };
        match sharing {
            Some(Ok(shared)) => prepared.shared = Some(shared),
            Some(Err(why)) => prepared.fall_back(why),
            None => {}
        }
        Ok(prepared)
    }

    /// Runs a request that shares no prefix entry: every cache mode but BiCache's.
    pub(crate) async fn run_alone(
        &self,
        prepared: Prepared<'_>,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Generation, EngineError> {
        let mut run = AloneRun::new(self, prepared)?;
        loop {
            if let Some(generation) = run.step(on_step).await? {
                return Ok(generation);
            }
        }
    }

    /// Commits one step's predictions of a request and reports the step.
    pub(crate) fn commit_step(
        &self,
        p: &mut Prepared<'_>,
        rows: &[u32],
        predictions: &[(u32, f32)],
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<StepRecord, EngineError> {
        commit_predictions(
            &mut p.sampler,
            &mut p.timings,
            p.start,
            (p.prompt.len(), self.special().mask),
            rows,
            predictions,
            on_step,
        )
    }

    /// What the sampler's request asks of the token choice at its current step.
    pub(crate) fn select_params(
        &self,
        sampler: &Sampler,
        conf_exclude: [Option<u32>; 2],
    ) -> SelectParams {
        let p = sampler.params();
        SelectParams {
            temperature: p.temperature,
            cfg_scale: p.cfg_scale,
            seed: p.seed,
            step: sampler.global_step() as u32,
            suppress_token: p.logits_eos_inf.then_some(self.special().eos),
            conf_exclude,
            // Dream's `alg`s rank by other confidences than the token's probability.
            confidence: match p.remasking {
                Remasking::Margin => ConfidenceKind::Margin,
                Remasking::Entropy => ConfidenceKind::NegEntropy,
                Remasking::LowConfidence | Remasking::Random => ConfidenceKind::Probability,
            },
            // Dream's `sample_tokens` ranks by the tempered softmax; LLaDA's by the plain one.
            tempered: matches!(p.schedule, Schedule::Dream { .. }),
            top_p: p.top_p,
            top_k: p.top_k,
        }
    }

    /// The generation of a request whose sampler is done.
    pub(crate) fn finish(
        &self,
        f: Prepared<'_>,
        records: Vec<StepRecord>,
    ) -> Result<Generation, EngineError> {
        let mut timings = f.timings;
        timings.total_s = f.start.elapsed_s();
        let ids = f.sampler.generated().to_vec();
        let stop = |t: &u32| *t == self.special().eos || Some(*t) == self.special().eot;
        timings.answer_tokens = ids.iter().position(stop).unwrap_or(ids.len());
        if timings.total_s > 0.0 {
            timings.throughput_canvas = ids.len() as f64 / timings.total_s;
            timings.throughput_answer = timings.answer_tokens as f64 / timings.total_s;
        }
        let text = match self.tokenizer() {
            Some(t) => Some(t.decode(&ids, f.request.decode)?),
            None => None,
        };
        Ok(Generation {
            prompt_ids: f.prompt,
            prefix_len: f.prefix_len,
            cache: f.request.cache,
            ids,
            text,
            steps: records,
            timings,
            bicache: f.report,
        })
    }
}

/// A request that shares no prefix entry, run one step at a time: its GPU state (the
/// conditional pass, the unconditional one under CFG, the select buffers) lives as long
/// as the run.
pub(crate) struct AloneRun<'e, 'r> {
    engine: &'e Engine,
    prepared: Option<Prepared<'r>>,
    cond: ForwardState,
    uncond: Option<ForwardState>,
    sel: SelectBuffers,
    records: Vec<StepRecord>,
    last_block: Option<usize>,
}

impl<'e, 'r> AloneRun<'e, 'r> {
    pub(crate) fn new(engine: &'e Engine, mut prepared: Prepared<'r>) -> Result<Self, EngineError> {
        let seq_len = prepared.sampler.tokens().len();
        let model = &engine.model;
        let cond = model.new_state(seq_len, seq_len)?;
        let uncond = if prepared.request.params.cfg_scale > 0.0 {
            Some(model.new_state(seq_len, seq_len)?)
        } else {
            None
        };
        let sel = model.new_select(seq_len)?;
        prepared.timings.setup_s = prepared.start.elapsed_s();
        Ok(Self {
            engine,
            prepared: Some(prepared),
            cond,
            uncond,
            sel,
            records: Vec::new(),
            last_block: None,
        })
    }

    /// Runs one denoising step; the generation once the request is done (then the run is
    /// spent: a further step is an error).
    pub(crate) async fn step(
        &mut self,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<Option<Generation>, EngineError> {
        let engine = self.engine;
        let Some(prepared) = self.prepared.as_mut() else {
            return Err(EngineError::Internal(
                "a step of a request that has finished".into(),
            ));
        };
        if !prepared.sampler.is_done() {
            let record = engine
                .alone_step(
                    prepared,
                    &self.cond,
                    self.uncond.as_ref(),
                    &self.sel,
                    &mut self.last_block,
                    on_step,
                )
                .await?;
            self.records.push(record);
        }
        if !prepared.sampler.is_done() {
            return Ok(None);
        }
        let Some(prepared) = self.prepared.take() else {
            return Err(EngineError::Internal("the finished request is gone".into()));
        };
        engine
            .finish(prepared, std::mem::take(&mut self.records))
            .map(Some)
    }
}

impl Engine {
    /// One step of a request that shares no prefix entry: plan, encode, submit, read back
    /// and commit.
    async fn alone_step(
        &self,
        prepared: &mut Prepared<'_>,
        cond: &ForwardState,
        uncond: Option<&ForwardState>,
        sel: &SelectBuffers,
        last_block: &mut Option<usize>,
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<StepRecord, EngineError> {
        let Prepared {
            request,
            start,
            prompt,
            prefix_len,
            sampler,
            conf_exclude,
            mode,
            timings,
            ..
        } = prepared;
        let (start, prefix_len, conf_exclude, mode) = (*start, *prefix_len, *conf_exclude, *mode);
        let n_layers = self.model.cfg.n_layers;
        let shift = self.model.cfg.family.shifts_logits();
        let seq_len = sampler.tokens().len();
        let rows = sampler.rows_to_predict();
        let block_start = *last_block != Some(sampler.block_index());
        let first_step = last_block.is_none();
        *last_block = Some(sampler.block_index());
        let states: Vec<(&ForwardState, Vec<u32>)> =
            std::iter::once((cond, sampler.tokens().to_vec()))
                .chain(uncond.map(|u| (u, sampler.unconditional_tokens())))
                .collect();
        let planned = plan_step(&PlanInput {
            mode,
            seq_len,
            prefix_len,
            block: sampler.block(),
            block_start,
            first_step,
            recompute_all: request.recompute_all,
        });
        // Without a shared prefix a step is one pass over every layer.
        let single = |pass: &PassPlan, predict: Vec<u32>| {
            let seq = SeqStep {
                rows: pass.rows.clone(),
                prefix_len: 0,
                refresh: false,
                seq_len,
                kv_len: pass.kv_len,
                kv_base: 0,
                predict,
            };
            StepPlan::alone(&[seq], n_layers, shift)
                .map_err(|e| EngineError::Internal(format!("cache mode {mode}: {e}")))
        };
        if let Some(w) = &planned.warmup {
            // Its own submit: the main pass rewrites the same ids buffer.
            let plan = single(w, Vec::new())?;
            let mut warm = StepEncoder::new(&self.ctx, "prefix pass");
            for (st, tokens) in &states {
                let ids = &tokens[w.rows.clone()];
                self.model
                    .encode_plan(&mut warm, st, None, &plan, ids, None)?;
                timings.forward_passes += 1;
            }
            warm.submit()?;
        }
        let plan = single(&planned.pass, rows)?;
        let mut step = StepEncoder::new(&self.ctx, "denoise step");
        let mut hidden = Vec::with_capacity(states.len());
        for (st, tokens) in &states {
            let ids = &tokens[planned.pass.rows.clone()];
            hidden.push(
                self.model
                    .encode_plan(&mut step, st, None, &plan, ids, None)?,
            );
            timings.forward_passes += 1;
        }
        timings.token_layer_passes += planned.token_layer_passes(n_layers) * states.len();
        let (row_index, positions) = plan.sampled_rows();
        self.model.write_select(sel, &row_index, &positions)?;
        let params = self.select_params(sampler, conf_exclude);
        self.model.encode_select_from(
            &mut step,
            hidden[0],
            hidden.get(1).copied(),
            sel,
            row_index.len(),
            &params,
        )?;
        let slot = self
            .model
            .read_back_choices(&mut step, sel, row_index.len());
        let read = step.submit()?.read_async().await?;
        let predictions: Vec<(u32, f32)> = Model::decode_choices(&read[slot])
            .iter()
            .map(|c| (c.token, c.confidence))
            .collect();
        commit_predictions(
            sampler,
            timings,
            start,
            (prompt.len(), self.special().mask),
            &positions,
            &predictions,
            on_step,
        )
    }
}
