//! A continuation's log-likelihood: LLaDA's Monte Carlo estimate
//! (`unmask_core::likelihood`) with one forward pass per sample (two under guidance) and
//! the LM head on the masked positions alone.

use unmask_core::likelihood::{
    LikelihoodParams, MaskSample, cross_entropy, draw_masks, estimate, sample_loss,
};

use crate::{Engine, EngineError, Stopwatch};

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
    /// Forward passes run (a guided sample counts two).
    pub forward_passes: usize,
    pub total_s: f64,
}

impl Engine {
    /// The log-likelihood of `answer` after `prompt` (token ids), estimated from
    /// `params.mc_num` masked samples drawn with `params.seed`.
    pub fn log_likelihood(
        &self,
        prompt: &[u32],
        answer: &[u32],
        params: &LikelihoodParams,
    ) -> Result<Likelihood, EngineError> {
        params.check().map_err(|e| EngineError::Invalid {
            field: e.field,
            expected: e.expected,
            found: e.found,
        })?;
        // `log_likelihood_of` checks prompt and answer before any pass.
        let samples = draw_masks(answer.len(), params);
        self.log_likelihood_of(prompt, answer, &samples, params.cfg_scale)
    }

    /// The estimate over the given samples (masks drawn elsewhere: a reference's, to
    /// compare with it).
    pub fn log_likelihood_of(
        &self,
        prompt: &[u32],
        answer: &[u32],
        samples: &[MaskSample],
        cfg_scale: f32,
    ) -> Result<Likelihood, EngineError> {
        let start = Stopwatch::start();
        self.check_scored(prompt, answer)?;
        let mut losses = Vec::with_capacity(samples.len());
        for (i, sample) in samples.iter().enumerate() {
            if sample.masked.is_empty() || sample.masked.iter().any(|&m| m >= answer.len()) {
                return Err(EngineError::Invalid {
                    field: "samples",
                    expected: format!("masks of 1 or more answer positions below {}", answer.len()),
                    found: format!("sample {i}: {:?}", sample.masked),
                });
            }
            losses.push(self.sample_loss(prompt, answer, sample, cfg_scale)?);
        }
        let n = losses.len() as f64;
        let mean = losses.iter().sum::<f64>() / n.max(1.0);
        let variance = losses.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        let passes = if cfg_scale > 0.0 { 2 } else { 1 };
        Ok(Likelihood {
            log_likelihood: estimate(&losses),
            standard_error: (variance / n.max(1.0)).sqrt(),
            sample_losses: losses,
            answer_tokens: answer.len(),
            forward_passes: samples.len() * passes,
            total_s: start.elapsed_s(),
        })
    }

    /// Prompt and answer must be ids of the model's vocabulary, neither empty nor holding
    /// the mask token, and fit its positions together.
    fn check_scored(&self, prompt: &[u32], answer: &[u32]) -> Result<(), EngineError> {
        let cfg = &self.model.cfg;
        let mask = self.special().mask;
        for (field, ids) in [("prompt", prompt), ("answer", answer)] {
            if ids.is_empty() {
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

    /// One sample's loss: the answer with `sample.masked` masked, the logits of those
    /// positions (Dream's from the row before each), guided by the prompt-masked pass
    /// when `cfg_scale` > 0 as generation guides them.
    fn sample_loss(
        &self,
        prompt: &[u32],
        answer: &[u32],
        sample: &MaskSample,
        cfg_scale: f32,
    ) -> Result<f64, EngineError> {
        let mask = self.special().mask;
        let p = prompt.len();
        let mut seq: Vec<u32> = prompt.iter().chain(answer).copied().collect();
        for &m in &sample.masked {
            seq[p + m] = mask;
        }
        let shift = usize::from(self.model.cfg.family.shifts_logits());
        let rows: Vec<usize> = sample.masked.iter().map(|&m| p + m - shift).collect();
        let vocab = self.model.cfg.embedding_size;
        let mut logits = self.model.logits_at(&seq, &rows)?;
        if cfg_scale > 0.0 {
            let mut uncond = seq.clone();
            uncond[..p].fill(mask);
            let u = self.model.logits_at(&uncond, &rows)?;
            let w = cfg_scale + 1.0;
            for (c, u) in logits.iter_mut().zip(&u) {
                *c = u + w * (*c - u);
            }
        }
        let entropies: Vec<f64> = sample
            .masked
            .iter()
            .enumerate()
            .map(|(k, &m)| cross_entropy(&logits[k * vocab..(k + 1) * vocab], answer[m] as usize))
            .collect();
        Ok(sample_loss(&entropies, sample.p_mask))
    }
}
