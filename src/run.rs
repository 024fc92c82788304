//! One request's preparation (tokens, sampler, cache decisions), the commit of its steps
//! and the generation it ends with; `session` steps it.

use unmask_core::cache::CacheMode;
use unmask_core::sampler::{ConfidenceKind, IdBias, Remasking, Sampler, Schedule, StepRecord};
use unmask_core::tokenizer::DecodeMode;
use unmask_gpu::ops::sampling::SelectParams;

use crate::Refusal;
use crate::session::{PrefixKey, Session};
use std::sync::Arc;

use crate::{
    AcacheReport, AdaptiveReport, BicacheReport, Engine, EngineError, Generation, Logprob,
    MOST_TOP_LOGPROBS, Request, StepEvent, Stopwatch, Timings,
};

/// A request ready to run: its tokens, its sampler and how it will use the caches.
pub(crate) struct Prepared<'r> {
    /// Borrowed from the caller, or owned by a `Session`.
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
    /// ACache: the prompt's shared span and, once the request has joined a session, its
    /// anchors (positions).
    pub(crate) span: Option<std::ops::Range<usize>>,
    pub(crate) anchors: Vec<u32>,
    pub(crate) acache: Option<AcacheReport>,
    pub(crate) adaptive: Option<AdaptiveReport>,
    pub(crate) timings: Timings,
    /// `Request::logprobs`: per canvas position, its token's log-probability once committed.
    pub(crate) logprobs: Option<Vec<Option<Logprob>>>,
}

impl Prepared<'_> {
    /// Whether the request has ended: its schedule ran out, or its answer became final.
    pub(crate) fn is_finished(&self) -> bool {
        self.sampler.is_done() || self.timings.finished_early
    }

    /// The request may end when its answer is final: the text it returns stops at the
    /// first end token, so the rest of the canvas cannot change it.
    fn may_finish_early(&self) -> bool {
        !self.request.full_canvas && self.request.decode == DecodeMode::Clean
    }

    /// Runs dLLM-Cache's adaptive steps (with their caches) rather than a step plan's.
    pub(crate) fn is_adaptive(&self) -> bool {
        self.mode.is_adaptive() && !self.request.recompute_all
    }

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

    /// Runs an ACache request without its span, as `fast-dllm-dual` (the cache it is built
    /// on); the report says why.
    pub(crate) fn fall_back_from_span(&mut self, why: String) {
        self.mode = CacheMode::FastDllmDual;
        self.span = None;
        self.anchors.clear();
        let report = self.acache.get_or_insert_with(AcacheReport::default);
        report.fallback = Some(format!("ran as {}: {why}", self.mode));
    }

    /// Runs without BiCache: `bicache-dual` as `fast-dllm-dual`, `bicache` as `none`.
    pub(crate) fn fall_back(&mut self, why: String) {
        let mode = match self.mode {
            CacheMode::BicacheDual => CacheMode::FastDllmDual,
            CacheMode::BicacheDllm => CacheMode::DllmCache,
            _ => CacheMode::None,
        };
        self.mode = mode;
        self.shared = None;
        self.report = Some(BicacheReport::fallback(mode, why));
    }
}

/// Commits the predictions of `rows` to a request's sampler, counts the step and reports
/// it through `on_step`; `prompt` is (prompt length, mask id) for the event.
#[allow(clippy::too_many_arguments)]
fn commit_predictions(
    sampler: &mut Sampler,
    timings: &mut Timings,
    start: Stopwatch,
    prompt: (usize, u32),
    rows: &[u32],
    predictions: &[(u32, f32)],
    row_logprobs: &[Option<Logprob>],
    mut logprobs: Option<&mut Vec<Option<Logprob>>>,
    on_step: &mut dyn FnMut(&StepEvent<'_>),
) -> Result<StepRecord, EngineError> {
    let record = sampler.commit(predictions)?;
    // A committed position keeps the log-probability of the prediction that committed it.
    if let Some(lps) = logprobs.as_deref_mut() {
        for &(pos, _) in &record.committed {
            let row = rows.iter().position(|&r| r == pos);
            let at = (pos as usize).checked_sub(prompt.0);
            if let (Some(row), Some(slot)) = (row, at.and_then(|i| lps.get_mut(i))) {
                *slot = row_logprobs.get(row).cloned().flatten();
            }
        }
    }
    timings.steps += 1;
    if timings.steps == 1 {
        timings.first_step_s = start.elapsed_s();
    }
    on_step(&StepEvent {
        record: &record,
        global_step: timings.steps,
        canvas: sampler.tokens(),
        prompt_len: prompt.0,
        suffix_len: sampler.suffix_len(),
        mask_id: prompt.1,
        elapsed_s: start.elapsed_s(),
        rows,
        predictions,
        logprobs: logprobs.map(|l| &l[..]),
    });
    Ok(record)
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
            params.schedule = cfg.family.spec().default_schedule;
        }
        // Like the schedule, the family's cut when the request names none.
        params.top_k = self.effective_top_k(&params);
        let sampler = Sampler::with_suffix(
            &prompt,
            &req.suffix,
            params,
            self.special().mask,
            cfg.max_sequence_length,
        )?;
        for (field, ids) in [("prompt", &prompt), ("suffix", &req.suffix)] {
            if let Some((i, t)) = ids
                .iter()
                .enumerate()
                .find(|&(_, &t)| t as usize >= cfg.embedding_size)
            {
                return Err(EngineError::Invalid {
                    field,
                    expected: format!("token ids below the vocabulary's {}", cfg.embedding_size),
                    found: format!("{t} at position {i}"),
                });
            }
        }
        if let Some(b) = req.depth.filter(|&b| b > cfg.n_layers) {
            return Err(EngineError::Invalid {
                field: "depth",
                expected: format!("at most the model's {} layers", cfg.n_layers),
                found: b.to_string(),
            });
        }
        if req.cache.is_adaptive() && !req.recompute_all {
            req.adaptive.check().map_err(|e| EngineError::Invalid {
                field: e.field,
                expected: e.expected.into(),
                found: e.found,
            })?;
            if p.cfg_scale > 0.0 {
                return Err(EngineError::Invalid {
                    field: "cfg_scale",
                    expected: "0 with cache dllm-cache (its caches hold the conditional pass \
                               only)"
                        .into(),
                    found: p.cfg_scale.to_string(),
                });
            }
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
            // The suffix is part of the request's own context, like the prompt after the
            // prefix.
            let u = prompt.len() - prefix_len + req.suffix.len();
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
        // ACache needs a shared span; without one it runs as the dual cache it is built on.
        let span = if req.cache == CacheMode::Acache && !req.recompute_all {
            crate::acache::check_ratio(req.anchor_ratio)?;
            let located = self.locate_span(req, &prompt)?;
            Some(match located {
                None => Err(
                    "the request names no shared span and no stored span is inside \
                             its prompt"
                        .to_string(),
                ),
                Some(_) if p.cfg_scale > 0.0 => Err("classifier-free guidance masks the \
                                                     prompt, so the span cannot be shared"
                    .to_string()),
                Some(found) => Ok(found),
            })
        } else {
            None
        };
        let mode = req.cache;
        let anchor_ratio = req.anchor_ratio;
        let adaptive = req.adaptive;
        if req.top_logprobs > MOST_TOP_LOGPROBS {
            return Err(EngineError::Invalid {
                field: "top_logprobs",
                expected: format!("at most {MOST_TOP_LOGPROBS} alternatives per token"),
                found: req.top_logprobs.to_string(),
            });
        }
        // The ranges were checked with the parameters; the ids need the model's vocabulary.
        p.bias.check(Some(cfg.embedding_size))?;
        let mask = self.special().mask;
        if p.bias.ids.iter().any(|&(id, _)| id == mask) {
            // A committed mask leaves its position masked: a request biased towards it
            // would never end under threshold decoding.
            return Err(EngineError::Invalid {
                field: "logit_bias",
                expected: format!("ids other than the mask token {mask}"),
                found: format!("id {mask}"),
            });
        }
        let asked = req.logprobs || req.top_logprobs > 0;
        let logprobs = asked.then(|| vec![None; sampler.generated().len()]);
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
            span: None,
            anchors: Vec::new(),
            acache: None,
            adaptive: None,
            timings: Timings::default(),
            logprobs,
        };
        if prepared.is_adaptive() {
            prepared.adaptive = Some(AdaptiveReport {
                prompt_interval: adaptive.prompt_interval,
                response_interval: adaptive.response_interval,
                refresh_ratio: adaptive.refresh_ratio,
                pin_block: adaptive.pin_block,
                response_rows: prepared.sampler.tokens().len() - self.response_start(&prepared),
                recomputed_rows: 0,
                ..AdaptiveReport::default()
            });
        }
        match span {
            Some(Ok((range, found_in_store))) => {
                prepared.acache = Some(AcacheReport {
                    span_start: range.start,
                    span_tokens: range.len(),
                    found_in_store,
                    anchor_ratio,
                    ..AcacheReport::default()
                });
                prepared.span = Some(range);
            }
            Some(Err(why)) => prepared.fall_back_from_span(why),
            None => {}
        }
        match sharing {
            Some(Ok(shared)) => prepared.shared = Some(shared),
            Some(Err(why)) => prepared.fall_back(why),
            None => {}
        }
        Ok(prepared)
    }

    /// dLLM-Cache's response start: the first position whose hidden row is sampled (the
    /// canvas, from the last prompt position when the family shifts its logits).
    pub(crate) fn response_start(&self, p: &Prepared<'_>) -> usize {
        let shift = usize::from(self.model.cfg.family.shifts_logits());
        p.prompt.len().saturating_sub(shift)
    }

    /// Commits one step's predictions of a request and reports the step.
    pub(crate) fn commit_step(
        &self,
        p: &mut Prepared<'_>,
        rows: &[u32],
        predictions: &[(u32, f32)],
        row_logprobs: &[Option<Logprob>],
        on_step: &mut dyn FnMut(&StepEvent<'_>),
    ) -> Result<StepRecord, EngineError> {
        let record = commit_predictions(
            &mut p.sampler,
            &mut p.timings,
            p.start,
            (p.prompt.len(), self.special().mask),
            rows,
            predictions,
            row_logprobs,
            p.logprobs.as_mut(),
            on_step,
        )?;
        let sp = self.special();
        let stops: Vec<u32> = std::iter::once(sp.eos).chain(sp.eot).collect();
        if p.may_finish_early()
            && !p.sampler.is_done()
            && p.sampler.final_answer_len(&stops).is_some()
        {
            let passes = if p.request.params.cfg_scale > 0.0 {
                2
            } else {
                1
            };
            let t = &mut p.timings;
            t.finished_early = true;
            t.steps_skipped = p.sampler.steps_left().unwrap_or(0);
            t.forward_passes_skipped = t.steps_skipped * passes;
        }
        Ok(record)
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
            min_p: p.min_p,
            logprob: false,
            top_logprobs: 0,
        }
    }

    /// The logit biases of a request's rows this step: its fixed ones, the penalties of
    /// the tokens committed in its canvas and the repetition penalty of the tokens of its
    /// whole sequence (end tokens, which pad a canvas, not counted).
    pub(crate) fn step_biases(&self, sampler: &Sampler) -> Vec<IdBias> {
        let s = self.special();
        let ends: Vec<u32> = [Some(s.eos), s.eot].into_iter().flatten().collect();
        let bias = &sampler.params().bias;
        bias.step_biases(sampler.tokens(), sampler.canvas(), sampler.mask_id(), &ends)
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
            suffix_len: f.sampler.suffix_len(),
            text,
            logprobs: f.logprobs,
            steps: records,
            timings,
            bicache: f.report,
            acache: f.acache,
            adaptive: f.adaptive,
        })
    }
}

impl Engine {
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
                Err(EngineError::Refused(why @ Refusal::PrefixNotStored(_))) => {
                    prepared.fall_back(why.to_string());
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
            Err(EngineError::Refused(why @ Refusal::PrefixNotStored(_))) => {
                let mut out = Vec::with_capacity(n);
                for (i, mut r) in requests.into_iter().enumerate() {
                    r.fall_back(why.to_string());
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
