//! The settings of a request to a LLaDA or Dream server: the masked-diffusion sampler and
//! caches, checked by the rules the library and the browser API share (`unmask::RequestSpec`).

use super::{Common, Limits, MaskedSampling};
use crate::error::ApiError;

impl Common {
    /// The masked-diffusion settings by the rules the library and the browser API share;
    /// the engine checks the model's context when the request runs.
    pub(super) fn masked(
        &self,
        max_tokens: usize,
        limits: &Limits,
    ) -> Result<MaskedSampling, ApiError> {
        let temperature = self.temperature.unwrap_or(0.0);
        if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
            return Err(ApiError::invalid(
                "temperature",
                format!("temperature: expected a number in [0, 2], found {temperature}"),
            ));
        }
        let spec = unmask::RequestSpec {
            gen_length: Some(max_tokens as u64),
            steps: self.steps,
            block_length: self.block_length,
            temperature: Some(temperature),
            remasking: self.remasking.clone(),
            threshold: self.threshold,
            seed: self.seed,
            eps: self.eps,
            alg_temp: self.alg_temp,
            top_p: self.top_p,
            top_k: self.top_k,
            cache: self.cache.clone(),
            affix: self.affix.clone(),
            anchor_ratio: self.anchor_ratio,
            prompt_interval: self.prompt_interval,
            response_interval: self.response_interval,
            refresh_ratio: self.refresh_ratio,
            verify_pick: self.verify_pick.clone(),
            pin_block: self.pin_block,
            full_canvas: self.full_canvas,
            ..unmask::RequestSpec::default()
        };
        let any_model = unmask::SpecLimits {
            context: usize::MAX,
            layers: usize::MAX,
        };
        let settings = spec.check(&any_model).map_err(|e| {
            // The canvas length is OpenAI's max_tokens here.
            let field = if e.field == "gen_length" {
                "max_tokens"
            } else {
                e.field
            };
            ApiError::invalid(
                field,
                format!("{field}: expected {}, found {}", e.expected, e.found),
            )
        })?;
        Ok(MaskedSampling {
            params: settings.params,
            cache: settings.cache.unwrap_or(limits.default_cache),
            affix: settings.affix,
            anchor_ratio: settings.anchor_ratio,
            adaptive: settings.adaptive,
            full_canvas: settings.full_canvas,
            suffix: None,
        })
    }
}
