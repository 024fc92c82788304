//! Errors as OpenAI's API answers them: a 4xx or 5xx status and
//! `{"error": {"message", "type", "param", "code"}}`, where `param` names the field.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use unmask::EngineError;

/// An error answered to a client.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, authentication_error, rate_limit_error,
    /// server_error.
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A bad value in field `param` (400).
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: None,
        }
    }

    /// A bad request not tied to one field (400).
    pub fn unnamed(message: impl Into<String>) -> Self {
        Self {
            param: None,
            ..Self::invalid("", message)
        }
    }

    /// A request the server cannot take, not tied to one field.
    pub fn status(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: Some(code),
        }
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            message,
        )
    }

    /// The engine's verdict on a request: bad input is the client's (400, naming the field
    /// where the engine does), anything else is the server's (500).
    pub fn from_engine(e: &EngineError) -> Self {
        match e {
            EngineError::Invalid { field, .. } => {
                Self::invalid(request_field(field), e.to_string())
            }
            // The model, not a setting, is what fails here.
            EngineError::Sampler(
                s @ unmask_core::error::SamplerError::OnlyMaskPredicted { .. },
            ) => Self::unnamed(s.to_string()),
            EngineError::Sampler(s) => {
                let text = s.to_string();
                let field = text.split([':', ' ']).next().unwrap_or("");
                let param = match field {
                    "gen_length" => "max_tokens",
                    "block_length" => "block_length",
                    "steps" => "steps",
                    "threshold" => "threshold",
                    "temperature" => "temperature",
                    "logit_bias" => "logit_bias",
                    "presence_penalty" => "presence_penalty",
                    "frequency_penalty" => "frequency_penalty",
                    "repetition_penalty" => "repetition_penalty",
                    "min_p" => "min_p",
                    "top_p" => "top_p",
                    "prompt" => "messages",
                    _ => "",
                };
                if param.is_empty() {
                    Self::unnamed(text)
                } else {
                    Self::invalid(param, text)
                }
            }
            EngineError::Tokenizer(_) | EngineError::NoTokenizer { .. } => {
                Self::invalid("messages", e.to_string())
            }
            // DiffusionGemma's checks of a request, each naming its setting first.
            EngineError::Model(unmask::ModelError::Input(text)) => {
                let param = match text.split(':').next().unwrap_or("") {
                    "prompt" | "prompt ids" => "messages",
                    "max_new_tokens" | "prompt and answer" => "max_tokens",
                    "max_denoising_steps" => "steps",
                    "logit_bias" => "logit_bias",
                    _ => "",
                };
                if param.is_empty() {
                    Self::unnamed(e.to_string())
                } else {
                    Self::invalid(param, e.to_string())
                }
            }
            EngineError::Refused(_) | EngineError::DepthTable(_) => Self::unnamed(e.to_string()),
            _ => Self::server(e.to_string()),
        }
    }

    /// The error in terms of a text completion, whose prompt is `prompt` (not `messages`).
    pub fn for_completion(mut self) -> Self {
        if let Some(p) = &mut self.param
            && p.starts_with("messages")
        {
            *p = "prompt".into();
        }
        self
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// The engine's field names in the API's terms.
fn request_field(field: &str) -> String {
    match field {
        "prompt" => "messages".into(),
        "gen_length" => "max_tokens".into(),
        // The library names ACache's span `span`; this API, `affix`.
        "span" => "affix".into(),
        other => other.into(),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unmask_core::error::SamplerError;

    /// A sampler error names the request field its message starts with; a model that can
    /// only predict masks is no field's fault.
    #[test]
    fn sampler_errors_name_their_field_and_a_stalled_model_none() {
        let named = |e: SamplerError| ApiError::from_engine(&EngineError::Sampler(e)).param;
        let repetition = SamplerError::BadRepetitionPenalty { value: 0.0 };
        assert_eq!(named(repetition).as_deref(), Some("repetition_penalty"));
        assert_eq!(
            named(SamplerError::BadMinP { min_p: 2.0 }).as_deref(),
            Some("min_p")
        );
        assert_eq!(named(SamplerError::CutWithCfg).as_deref(), Some("top_p"));
        assert_eq!(named(SamplerError::OnlyMaskPredicted { rows: 3 }), None);
    }
}
