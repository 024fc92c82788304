//! A request's `logprobs`, in OpenAI's two spellings: chat's `logprobs: true` with
//! `top_logprobs: k`, the legacy completions' `logprobs: k`.

use serde_json::Value;

use super::{Common, Input, MOST_LEGACY_LOGPROBS, MOST_TOP_LOGPROBS};
use crate::error::ApiError;

impl Common {
    /// OpenAI's two spellings of log-probabilities: chat's `logprobs: true` with
    /// `top_logprobs: k`, the legacy completions' `logprobs: k`.
    /// `gemma`: a DiffusionGemma server, which reports no alternatives.
    pub(super) fn logprobs(&self, input: &Input, gemma: bool) -> Result<Option<usize>, ApiError> {
        let chat = matches!(input, Input::Chat(_));
        let top = match &self.top_logprobs {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .filter(|&k| chat && k as usize <= MOST_TOP_LOGPROBS)
                    .ok_or_else(|| {
                        let expected = if chat {
                            format!("an integer in 0..={MOST_TOP_LOGPROBS}")
                        } else {
                            "no top_logprobs in /v1/completions (its logprobs is the count)".into()
                        };
                        ApiError::invalid(
                            "top_logprobs",
                            format!("top_logprobs: expected {expected}, found {v}"),
                        )
                    })? as usize,
            ),
        };
        let asked = match (&self.logprobs, chat) {
            // false is OpenAI's neutral value in either spelling.
            (None | Some(Value::Null | Value::Bool(false)), _) => None,
            (Some(Value::Bool(b)), true) => b.then_some(top.unwrap_or(0)),
            (Some(v), false) if v.as_u64().is_some_and(|k| k <= MOST_LEGACY_LOGPROBS) => {
                v.as_u64().map(|k| k as usize)
            }
            (Some(v), _) => {
                let expected = if chat {
                    "true or false".to_string()
                } else {
                    format!("an integer in 0..={MOST_LEGACY_LOGPROBS} (alternatives per token)")
                };
                return Err(ApiError::invalid(
                    "logprobs",
                    format!("logprobs: expected {expected}, found {v}"),
                ));
            }
        };
        if top.is_some_and(|k| k > 0) && asked.is_none() {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs: needs \"logprobs\": true",
            ));
        }
        if let Some(k) = asked.filter(|&k| gemma && k > 0) {
            let field = if chat { "top_logprobs" } else { "logprobs" };
            return Err(ApiError::invalid(
                field,
                format!(
                    "{field}: expected 0 alternatives per token (DiffusionGemma reports each \
                     token's own log-probability, not the most likely others), found {k}"
                ),
            ));
        }
        Ok(asked)
    }
}
