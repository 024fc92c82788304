//! The settings of a request to a DiffusionGemma server: its sampler's schedule and bound
//! are the model's (generation_config.json), so a request gives only lengths, a seed and
//! `logit_bias`, and every masked-diffusion setting is refused by name rather than ignored.

use super::{Common, GemmaSampling, MOST_GEMMA_STEPS};
use crate::error::ApiError;
use crate::fields::whole;

impl Common {
    /// DiffusionGemma's few settings; every masked-diffusion one is refused by name.
    pub(super) fn gemma(&self, max_new_tokens: Option<usize>) -> Result<GemmaSampling, ApiError> {
        // Clients that send OpenAI's neutral values (0, {}) by default are served.
        let penalty = |p: Option<f64>| p.is_some_and(|p| p != 0.0);
        let masked_only: [(&str, bool); 21] = [
            ("presence_penalty", penalty(self.presence_penalty)),
            ("frequency_penalty", penalty(self.frequency_penalty)),
            (
                "repetition_penalty",
                self.repetition_penalty.is_some_and(|r| r != 1.0),
            ),
            ("min_p", penalty(self.min_p)),
            ("temperature", self.temperature.is_some()),
            ("top_p", self.top_p.is_some()),
            ("top_k", self.top_k.is_some()),
            ("block_length", self.block_length.is_some()),
            ("threshold", self.threshold.is_some()),
            ("cache", self.cache.is_some()),
            ("affix", self.affix.is_some()),
            ("anchor_ratio", self.anchor_ratio.is_some()),
            ("prompt_interval", self.prompt_interval.is_some()),
            ("response_interval", self.response_interval.is_some()),
            ("refresh_ratio", self.refresh_ratio.is_some()),
            ("verify_pick", self.verify_pick.is_some()),
            ("pin_block", self.pin_block.is_some()),
            ("full_canvas", self.full_canvas.is_some()),
            ("remasking", self.remasking.is_some()),
            ("alg_temp", self.alg_temp.is_some()),
            ("eps", self.eps.is_some()),
        ];
        if let Some((field, _)) = masked_only.iter().find(|(_, set)| *set) {
            return Err(ApiError::invalid(
                *field,
                format!(
                    "{field}: not a DiffusionGemma setting (its sampler's temperature schedule \
                     and entropy bound come from generation_config.json; a request may give \
                     max_tokens, steps, seed, logit_bias, stop and stream); leave it out"
                ),
            ));
        }
        let steps = whole("steps", self.steps)?;
        if let Some(s) = steps.filter(|&s| s == 0 || s as u64 > MOST_GEMMA_STEPS) {
            return Err(ApiError::invalid(
                "steps",
                format!(
                    "steps: expected denoising steps per canvas in 1..={MOST_GEMMA_STEPS}, \
                     found {s}"
                ),
            ));
        }
        // logit_bias by the rules every endpoint shares; ids past the vocabulary are the
        // engine's to refuse, which knows it.
        let logit_bias = match &self.logit_bias {
            Some(map) => unmask::logit_bias_ids(map, usize::MAX)
                .map_err(|e| ApiError::invalid(e.field, e.to_string()))?,
            None => Vec::new(),
        };
        Ok(GemmaSampling {
            max_new_tokens,
            max_denoising_steps: steps,
            seed: self.seed.unwrap_or(0),
            share_prompt: false,
            logit_bias,
        })
    }
}
