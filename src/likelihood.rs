//! A continuation's log-likelihood: LLaDA's Monte Carlo estimate
//! (`unmask_core::likelihood`), the samples carried side by side through as few forward
//! passes as fit (the guided ones with their prompt-masked twins), the LM head and the
//! cross-entropy on the masked positions alone, on the GPU (three floats a masked row come
//! back). Read-backs are awaited (`*_async`, for the browser); native callers have
//! blocking wrappers.

use unmask_core::likelihood::{
    LikelihoodParams, MaskSample, Window, draw_masks, estimate, rolling_windows, sample_loss,
};
use unmask_gpu::error::GpuError;
use unmask_gpu::model::{LogitsState, ModelError, TargetSeq};

use crate::{Engine, EngineError, Stopwatch};

/// Rows one scoring pass aims at when the caller sets no pass size: past a few thousand
/// rows a GPU's matmuls gain nothing from a wider pass, and the buffers keep growing.
pub const SCORE_PASS_ROWS: usize = 4096;

/// GPU memory one scoring pass's buffers may take when the caller sets no pass size: at
/// LLaDA-8B's shapes a row of activations and K/V is about 1 MiB (f32 K/V), so this keeps
/// a pass near a thousand rows, where the matmuls are already compute-bound, and leaves
/// room for the generations a server runs beside it.
const SCORE_PASS_STATE_BYTES: u64 = 1 << 30;

/// What the estimate gave.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Likelihood {
    /// The estimate of log p(answer | prompt), in nats (minus the mean sample loss).
    pub log_likelihood: f64,
    /// Every sample's loss (the masked tokens' cross-entropy over p_mask), in draw order.
    pub sample_losses: Vec<f64>,
    /// The estimate's standard error: the sample losses' standard deviation over √n.
    pub standard_error: f64,
    pub answer_tokens: usize,
    /// Sequences scored: one per sample, two under guidance.
    pub sequences: usize,
    /// Forward passes run, each carrying up to `pass_samples` samples side by side.
    pub forward_passes: usize,
    pub pass_samples: usize,
    pub total_s: f64,
    /// Windows the answer was scored in: 1, or more for a text summed over rolling windows
    /// (`Likelihood::summed`).
    pub windows: usize,
}

impl Likelihood {
    /// A text's estimate from its windows' (`Engine::rolling_windows`):
    /// the estimates and counts summed, the standard errors combined as independent ones
    /// (each window draws its masks with its own seed, `window_seed`), the sample losses in
    /// window order. None for no windows.
    pub fn summed(parts: Vec<Likelihood>) -> Option<Likelihood> {
        let mut parts = parts.into_iter();
        let mut sum = parts.next()?;
        let mut variance = sum.standard_error.powi(2);
        for part in parts {
            sum.log_likelihood += part.log_likelihood;
            variance += part.standard_error.powi(2);
            sum.sample_losses.extend(part.sample_losses);
            sum.answer_tokens += part.answer_tokens;
            sum.sequences += part.sequences;
            sum.forward_passes += part.forward_passes;
            sum.pass_samples = sum.pass_samples.max(part.pass_samples);
            sum.total_s += part.total_s;
            sum.windows += part.windows;
        }
        sum.standard_error = variance.sqrt();
        Some(sum)
    }
}

impl Engine {
    /// The log-likelihood of `answer` after `prompt` (token ids), estimated from
    /// `params.mc_num` masked samples drawn with `params.seed`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn log_likelihood(
        &self,
        prompt: &[u32],
        answer: &[u32],
        params: &LikelihoodParams,
    ) -> Result<Likelihood, EngineError> {
        self.start_log_likelihood(prompt, answer, params)?.finish()
    }

    /// `log_likelihood`, awaiting the read-backs (the browser's way).
    pub async fn log_likelihood_async(
        &self,
        prompt: &[u32],
        answer: &[u32],
        params: &LikelihoodParams,
    ) -> Result<Likelihood, EngineError> {
        self.start_log_likelihood(prompt, answer, params)?
            .finish_async()
            .await
    }

    /// The log-likelihood of a text of any length after `prompt` (which may be empty):
    /// one estimate per window of `Engine::rolling_windows`, each drawn with its own seed
    /// (`window_seed`), summed (`Likelihood::summed`). Perplexity's numerator over long
    /// documents.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn log_likelihood_rolling(
        &self,
        prompt: &[u32],
        text: &[u32],
        params: &LikelihoodParams,
    ) -> Result<Likelihood, EngineError> {
        pollster::block_on(self.log_likelihood_rolling_async(prompt, text, params))
    }

    /// `log_likelihood_rolling`, awaiting the read-backs (the browser's way).
    pub async fn log_likelihood_rolling_async(
        &self,
        prompt: &[u32],
        text: &[u32],
        params: &LikelihoodParams,
    ) -> Result<Likelihood, EngineError> {
        let mut parts = Vec::new();
        for (i, w) in self.rolling_windows(prompt, text).into_iter().enumerate() {
            let params = LikelihoodParams {
                seed: unmask_core::likelihood::window_seed(params.seed, i),
                ..*params
            };
            parts.push(
                self.log_likelihood_async(&w.context, &text[w.answer], &params)
                    .await?,
            );
        }
        Likelihood::summed(parts).ok_or_else(|| EngineError::Invalid {
            field: "answer",
            expected: "at least one token".into(),
            found: "none".into(),
        })
    }

    /// The windows a rolling estimate scores `text` in after `prompt`
    /// (`unmask_core::likelihood::rolling_windows` over the model's positions). After an
    /// empty prompt, a model that reads a token's logits from the row before it (Dream)
    /// starts from its end-of-text token, as left-to-right models' rolling windows do.
    pub fn rolling_windows(&self, prompt: &[u32], text: &[u32]) -> Vec<Window> {
        let cfg = &self.model.cfg;
        let mut context = prompt.to_vec();
        if context.is_empty() && cfg.family.shifts_logits() {
            context.push(self.special().eos);
        }
        rolling_windows(&context, text, cfg.max_sequence_length)
    }

    /// The estimate over the given samples (masks drawn elsewhere: a reference's, to
    /// compare with it), `pass_samples` of them per forward pass (None: as many as fit).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn log_likelihood_of(
        &self,
        prompt: &[u32],
        answer: &[u32],
        samples: &[MaskSample],
        cfg_scale: f32,
        pass_samples: Option<usize>,
    ) -> Result<Likelihood, EngineError> {
        self.start_log_likelihood_of(prompt, answer, samples.to_vec(), cfg_scale, pass_samples)?
            .finish()
    }

    /// `log_likelihood` as a run of forward passes, each run by `LikelihoodRun::pass`
    /// (a server interleaves them with its other work). Settings, prompt and answer are
    /// checked, and the buffers made, before it returns.
    pub fn start_log_likelihood(
        &self,
        prompt: &[u32],
        answer: &[u32],
        params: &LikelihoodParams,
    ) -> Result<LikelihoodRun<'_>, EngineError> {
        params.check().map_err(|e| EngineError::Invalid {
            field: e.field,
            expected: e.expected,
            found: e.found,
        })?;
        // `start_log_likelihood_of` checks prompt and answer before any pass.
        let samples = draw_masks(answer.len(), params);
        self.start_log_likelihood_of(
            prompt,
            answer,
            samples,
            params.cfg_scale,
            params.pass_samples,
        )
    }

    /// `log_likelihood_of` as a run of forward passes.
    pub fn start_log_likelihood_of(
        &self,
        prompt: &[u32],
        answer: &[u32],
        samples: Vec<MaskSample>,
        cfg_scale: f32,
        pass_samples: Option<usize>,
    ) -> Result<LikelihoodRun<'_>, EngineError> {
        let start = Stopwatch::start();
        self.check_scored(prompt, answer, cfg_scale)?;
        for (i, sample) in samples.iter().enumerate() {
            if sample.masked.is_empty() || sample.masked.iter().any(|&m| m >= answer.len()) {
                return Err(EngineError::Invalid {
                    field: "samples",
                    expected: format!("masks of 1 or more answer positions below {}", answer.len()),
                    found: format!("sample {i}: {:?}", sample.masked),
                });
            }
        }
        let twins = if cfg_scale > 0.0 { 2 } else { 1 };
        let len = prompt.len() + answer.len();
        let scoring = ScoringShape {
            rows: len * twins,
            scored_rows: answer.len(),
            guided: twins == 2,
        };
        let (state, per_pass) = self.scoring_state(scoring, samples.len(), pass_samples)?;
        Ok(LikelihoodRun {
            engine: self,
            prompt: prompt.to_vec(),
            answer: answer.to_vec(),
            losses: Vec::with_capacity(samples.len()),
            samples,
            cfg_scale,
            state,
            per_pass,
            passes: 0,
            start,
        })
    }

    /// Buffers for passes of `per_pass` samples of `shape`, the LM head's included, and
    /// that count: the caller's (within one binding), else as many as the row target, one
    /// storage binding and the state's memory cap allow. The logits stay on the GPU, in
    /// LM-head groups that fit one binding, so the answer's length does not bound a pass.
    /// Halved while the memory budget refuses the buffers, down to one sample (whose
    /// refusal is the error).
    fn scoring_state(
        &self,
        shape: ScoringShape,
        samples: usize,
        asked: Option<usize>,
    ) -> Result<(LogitsState, usize), EngineError> {
        let rows = shape.rows;
        let max_rows = self.model.max_state_rows();
        let mut per_pass = match asked {
            // The caller's size, within one storage binding (a buffer past it cannot be
            // made, and a request must not get that far).
            Some(n) => n.min(max_rows / rows.max(1)),
            None => auto_pass_samples(rows, max_rows, self.model.state_bytes(rows, rows)),
        };
        per_pass = per_pass.clamp(1, samples.max(1));
        loop {
            let made = self
                .model
                .logits_state(per_pass * rows)
                .and_then(|mut state| {
                    let scored = per_pass * shape.scored_rows;
                    self.model
                        .reserve_scored_rows(&mut state, scored, shape.guided)?;
                    Ok(state)
                });
            match made {
                Ok(state) => return Ok((state, per_pass)),
                Err(ModelError::Gpu(GpuError::OverBudget { .. })) if per_pass > 1 => {
                    per_pass = per_pass.div_ceil(2);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Prompt and answer must be ids of the model's vocabulary without the mask token, and
    /// fit its positions together. The answer needs a token. An empty prompt scores the
    /// answer unconditionally (the whole sequence's bound, as perplexity needs), except
    /// under guidance, which masks the prompt, and for Dream, which reads a token's logits
    /// from the row before it.
    fn check_scored(
        &self,
        prompt: &[u32],
        answer: &[u32],
        cfg_scale: f32,
    ) -> Result<(), EngineError> {
        let cfg = &self.model.cfg;
        let mask = self.special().mask;
        if prompt.is_empty() {
            let why = if cfg.family.shifts_logits() {
                Some("at least one token: this model reads a token's logits from the row before it")
            } else if cfg_scale > 0.0 {
                Some("at least one token under cfg_scale > 0, which guides by masking the prompt")
            } else {
                None
            };
            if let Some(expected) = why {
                return Err(EngineError::Invalid {
                    field: "prompt",
                    expected: expected.into(),
                    found: "none".into(),
                });
            }
        }
        for (field, ids) in [("prompt", prompt), ("answer", answer)] {
            if field == "answer" && ids.is_empty() {
                return Err(EngineError::Invalid {
                    field,
                    expected: "at least one token".into(),
                    found: "none".into(),
                });
            }
            let bad = ids
                .iter()
                .enumerate()
                .find(|&(_, &t)| t as usize >= cfg.embedding_size || t == mask);
            if let Some((i, &t)) = bad {
                return Err(EngineError::Invalid {
                    field,
                    expected: format!(
                        "token ids below the vocabulary's {} other than the mask token {mask}",
                        cfg.embedding_size
                    ),
                    found: format!("{t} at position {i}"),
                });
            }
        }
        let total = prompt.len() + answer.len();
        if total > cfg.max_sequence_length {
            return Err(EngineError::Invalid {
                field: "answer",
                expected: format!(
                    "prompt and answer within the model's {} positions",
                    cfg.max_sequence_length
                ),
                found: format!("{} + {} = {total}", prompt.len(), answer.len()),
            });
        }
        Ok(())
    }

    /// The losses of one pass's samples: each the answer with `sample.masked` masked, the
    /// cross-entropy at those positions (Dream's from the row before each) taken on the GPU,
    /// guided by the prompt-masked twin when `cfg_scale` > 0 as generation guides them.
    async fn pass_losses(
        &self,
        state: &mut LogitsState,
        prompt: &[u32],
        answer: &[u32],
        samples: &[MaskSample],
        cfg_scale: f32,
    ) -> Result<Vec<f64>, EngineError> {
        let mask = self.special().mask;
        let p = prompt.len();
        let shift = usize::from(self.model.cfg.family.shifts_logits());
        let guided = cfg_scale > 0.0;
        let mut seqs: Vec<Vec<u32>> = Vec::with_capacity(samples.len());
        let mut twins: Vec<Vec<u32>> = Vec::new();
        let mut rows: Vec<Vec<usize>> = Vec::with_capacity(samples.len());
        let mut targets: Vec<Vec<u32>> = Vec::with_capacity(samples.len());
        for sample in samples {
            let mut seq: Vec<u32> = prompt.iter().chain(answer).copied().collect();
            for &m in &sample.masked {
                seq[p + m] = mask;
            }
            rows.push(sample.masked.iter().map(|&m| p + m - shift).collect());
            targets.push(sample.masked.iter().map(|&m| answer[m]).collect());
            if guided {
                let mut uncond = seq.clone();
                uncond[..p].fill(mask);
                twins.push(uncond);
            }
            seqs.push(seq);
        }
        let scored: Vec<TargetSeq<'_>> = (0..samples.len())
            .map(|i| TargetSeq {
                ids: &seqs[i],
                rows: &rows[i],
                targets: &targets[i],
                uncond: twins.get(i).map(Vec::as_slice),
            })
            .collect();
        let entropies = self
            .model
            .cross_entropy_batch_async(state, &scored, cfg_scale)
            .await?;
        Ok(samples
            .iter()
            .zip(&entropies)
            .map(|(sample, e)| sample_loss(e, sample.p_mask))
            .collect())
    }
}

/// The index of the best estimate, the first of equal ones (as `unmask score` ranks
/// them); `None` for none.
pub fn best_estimate(estimates: &[Likelihood]) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    for (i, l) in estimates.iter().enumerate() {
        if best.is_none_or(|(_, b)| l.log_likelihood > b) {
            best = Some((i, l.log_likelihood));
        }
    }
    best.map(|(i, _)| i)
}

/// Samples per pass when the caller sets none: as many sequences of `rows` rows as the
/// row target and `max_state_rows` (one storage binding) allow, whose buffers
/// (`state_bytes` each) stay under their cap. At least one is left to the caller's clamp.
fn auto_pass_samples(rows: usize, max_state_rows: usize, state_bytes: u64) -> usize {
    let by_rows = SCORE_PASS_ROWS.min(max_state_rows) / rows.max(1);
    let by_bytes = (SCORE_PASS_STATE_BYTES / state_bytes.max(1)) as usize;
    by_rows.min(by_bytes)
}

/// What one sample of an estimate asks of a pass.
#[derive(Clone, Copy)]
struct ScoringShape {
    /// Positions in the pass: prompt and answer, twice under guidance.
    rows: usize,
    /// Rows the LM head scores at most (the answer's).
    scored_rows: usize,
    guided: bool,
}

/// An estimate a forward pass at a time (`Engine::start_log_likelihood`). Dropping it frees
/// its buffers.
pub struct LikelihoodRun<'e> {
    engine: &'e Engine,
    prompt: Vec<u32>,
    answer: Vec<u32>,
    samples: Vec<MaskSample>,
    cfg_scale: f32,
    state: LogitsState,
    per_pass: usize,
    /// One per sample scored so far, in draw order.
    losses: Vec<f64>,
    passes: usize,
    start: Stopwatch,
}

impl LikelihoodRun<'_> {
    /// Whether every sample has been scored.
    pub fn is_done(&self) -> bool {
        self.losses.len() >= self.samples.len()
    }

    /// Runs the next forward pass (up to `pass_samples` samples side by side); nothing once
    /// done.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn pass(&mut self) -> Result<(), EngineError> {
        pollster::block_on(self.pass_async())
    }

    /// `pass`, awaiting its read-backs.
    pub async fn pass_async(&mut self) -> Result<(), EngineError> {
        let at = self.losses.len();
        let group = &self.samples[at..(at + self.per_pass).min(self.samples.len())];
        if group.is_empty() {
            return Ok(());
        }
        let losses = self
            .engine
            .pass_losses(
                &mut self.state,
                &self.prompt,
                &self.answer,
                group,
                self.cfg_scale,
            )
            .await?;
        self.losses.extend(losses);
        self.passes += 1;
        Ok(())
    }

    /// The estimate, after running the passes left. `total_s` runs from the start, waits
    /// between passes included.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn finish(self) -> Result<Likelihood, EngineError> {
        pollster::block_on(self.finish_async())
    }

    /// `finish`, awaiting the read-backs.
    pub async fn finish_async(mut self) -> Result<Likelihood, EngineError> {
        while !self.is_done() {
            self.pass_async().await?;
        }
        let losses = self.losses;
        let n = losses.len() as f64;
        let mean = losses.iter().sum::<f64>() / n.max(1.0);
        let variance = losses.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        let twins = if self.cfg_scale > 0.0 { 2 } else { 1 };
        Ok(Likelihood {
            log_likelihood: estimate(&losses),
            standard_error: (variance / n.max(1.0)).sqrt(),
            sample_losses: losses,
            answer_tokens: self.answer.len(),
            sequences: self.samples.len() * twins,
            forward_passes: self.passes,
            pass_samples: self.per_pass,
            total_s: self.start.elapsed_s(),
            windows: 1,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_are_sized_by_rows_and_memory() {
        // The bundled model's 48-row items: the row target alone (85 of them).
        assert_eq!(auto_pass_samples(48, 100_000, 100_000), 85);
        // A binding that holds 1000 rows: 20 of them.
        assert_eq!(auto_pass_samples(48, 1000, 100_000), 20);
        // LLaDA-8B, a 330 + 8 token item with f32 K/V: about 398 MB of buffers a sample,
        // so two per pass under 1 GiB.
        let per_row = (4096 + 3 * 4096 + 4096 + 12288 + 3) * 4;
        let state = (338 * per_row + 2 * 32 * 338 * 4096 * 4) as u64;
        assert_eq!(auto_pass_samples(338, 1 << 20, state), 2);
        // A sequence longer than the row target: none, left to the caller's clamp.
        assert_eq!(auto_pass_samples(5000, 1 << 20, 1), 0);
    }
}
