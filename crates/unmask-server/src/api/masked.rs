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
            min_p: self.min_p,
            cache: self.cache.clone(),
            affix: self.affix.clone(),
            anchor_ratio: self.anchor_ratio,
            prompt_interval: self.prompt_interval,
            response_interval: self.response_interval,
            refresh_ratio: self.refresh_ratio,
            verify_pick: self.verify_pick.clone(),
            pin_block: self.pin_block,
            full_canvas: self.full_canvas,
            logit_bias: self.logit_bias.clone(),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            ..unmask::RequestSpec::default()
        };
        let any_model = unmask::SpecLimits {
            context: usize::MAX,
            layers: usize::MAX,
            vocab: usize::MAX,
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

#[cfg(test)]
mod tests {
    use super::super::{ChatRequest, Family, JobSpec, Limits, Sampling};
    use crate::error::ApiError;
    use unmask::CacheMode;

    fn check(body: &str, family: Family) -> Result<JobSpec, ApiError> {
        let limits = Limits {
            max_tokens: 256,
            default_max_tokens: 64,
            default_cache: CacheMode::None,
            family,
        };
        ChatRequest::parse(body.as_bytes())?.check(&limits, "tiny")
    }

    /// OpenAI's `logit_bias` and penalties reach the sampler, are checked by name, and a
    /// DiffusionGemma server refuses the penalties unless neutral (clients send 0 by default).
    #[test]
    fn logit_bias_and_penalties_reach_the_sampler() {
        let q = r#""messages":[{"role":"user","content":"q"}]"#;
        let body = format!(
            r#"{{{q},"logit_bias":{{"42":-100,"7":2.5}},"presence_penalty":0.5,"frequency_penalty":-1}}"#
        );
        let Sampling::Masked(m) = check(&body, Family::MaskedDiffusion).unwrap().sampling else {
            panic!("a masked-diffusion request");
        };
        let bias = &m.params.bias;
        assert_eq!(bias.ids, vec![(7, 2.5), (42, -100.0)]);
        assert_eq!((bias.presence_penalty, bias.frequency_penalty), (0.5, -1.0));
        assert_eq!((bias.repetition_penalty, m.params.min_p), (1.0, None));
        let body = format!(r#"{{{q},"repetition_penalty":1.3,"min_p":0.1}}"#);
        let Sampling::Masked(m) = check(&body, Family::MaskedDiffusion).unwrap().sampling else {
            panic!("a masked-diffusion request");
        };
        assert_eq!(
            (m.params.bias.repetition_penalty, m.params.min_p),
            (1.3, Some(0.1))
        );
        let e = check(&body, Family::DiffusionGemma).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("repetition_penalty"), "{e}");
        for (extra, field, needle) in [
            (r#""logit_bias":{"x":1}"#, "logit_bias", "the key \"x\""),
            (r#""logit_bias":{"3":-101}"#, "logit_bias", "-101 for id 3"),
            (r#""logit_bias":{"3":"a"}"#, "logit_bias.3", "expected f64"),
            (r#""presence_penalty":2.5"#, "presence_penalty", "-2 to 2"),
            (r#""frequency_penalty":-9"#, "frequency_penalty", "found -9"),
            (
                r#""repetition_penalty":0"#,
                "repetition_penalty",
                "from 0.01 to 100",
            ),
            (r#""min_p":2"#, "min_p", "from 0 to 1"),
        ] {
            let body = format!("{{{q},{extra}}}");
            let e = check(&body, Family::MaskedDiffusion).expect_err(&body);
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
            assert!(e.message.contains(needle), "{body}: {e}");
        }
        let neutral = format!(
            r#"{{{q},"logit_bias":{{}},"presence_penalty":0,"frequency_penalty":0,"repetition_penalty":1,"min_p":0}}"#
        );
        assert!(check(&neutral, Family::DiffusionGemma).is_ok());
        // DiffusionGemma takes logit_bias by the same rules (its penalties it refuses).
        let body = format!(r#"{{{q},"logit_bias":{{"42":-100}}}}"#);
        assert!(check(&body, Family::DiffusionGemma).is_ok());
        let body = format!(r#"{{{q},"logit_bias":{{"42":-101}}}}"#);
        let e = check(&body, Family::DiffusionGemma).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"), "{e}");
    }
}
