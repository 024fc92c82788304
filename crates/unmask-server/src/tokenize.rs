//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: a prompt's token ids exactly as
//! the completion endpoints run it (a completion's text, or a chat rendered with the
//! model's template), and ids back to text. Clients use them to find the ids `logit_bias`
//! names and to count a prompt's tokens before sending it.
//!
//! ```json
//! POST /tokenize   {"prompt": "Hello"}  or  {"messages": [...], "return_token_strs": true}
//!               -> {"count": 2, "max_model_len": 4096, "tokens": [9906, 0], "token_strs": [...]}
//! POST /detokenize {"tokens": [9906, 0]} -> {"prompt": "Hello"}
//! ```

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use unmask::ChatFormat;
use unmask_core::tokenizer::{DecodeMode, Tokenizer};

use crate::api::{ChatMessage, chat_messages, served_model};
use crate::error::ApiError;
use crate::fields::{object, typed};
use crate::routes::{App, read_body};

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_special_tokens: Option<bool>,
    return_token_strs: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

/// How the served model turns prompts into ids: its tokenizer and chat layout.
pub struct PromptEncoder {
    pub tokenizer: Tokenizer,
    pub chat: ChatLayout,
}

/// A served model's chat layout.
pub enum ChatLayout {
    /// LLaDA's or Dream's (`unmask::ChatFormat`).
    Masked(ChatFormat),
    /// Gemma 4's, thinking off (`unmask::encode_gemma_chat`).
    Gemma,
}

impl PromptEncoder {
    /// A conversation's ids, as the completion endpoints run it.
    fn encode_chat(&self, messages: &[unmask::Message]) -> Result<Vec<u32>, String> {
        match &self.chat {
            ChatLayout::Masked(format) => format
                .encode(&self.tokenizer, messages)
                .map_err(|e| e.to_string()),
            ChatLayout::Gemma => unmask::encode_gemma_chat(&self.tokenizer, messages)
                .map(|(ids, _)| ids)
                .map_err(|e| e.to_string()),
        }
    }

    /// The masked-diffusion chat format, for the request path that encodes off the engine
    /// thread (a DiffusionGemma prompt is encoded on it, with its system turn's length).
    pub fn masked_format(&self) -> Option<&ChatFormat> {
        match &self.chat {
            ChatLayout::Masked(format) => Some(format),
            ChatLayout::Gemma => None,
        }
    }
}

/// The server's prompt encoder, or why it has none to offer.
fn encoder(app: &App) -> Result<&PromptEncoder, ApiError> {
    app.encoder.as_deref().ok_or_else(|| {
        ApiError::unnamed(
            "no tokenizer here: the model folder has no tokenizer.json: prompts are token ids \
             (send them to /v1/completions)",
        )
    })
}

/// The answer of `POST /tokenize` to `body`.
pub(crate) fn tokenize_answer(
    encoder: &PromptEncoder,
    body: &[u8],
    served: &str,
    max_model_len: usize,
) -> Result<Value, ApiError> {
    let r: TokenizeRequest = typed(object(body)?, "")?;
    served_model(r.model.as_deref(), served)?;
    let tokenizer = &encoder.tokenizer;
    let (field, ids) = match (r.prompt, r.messages) {
        (Some(text), None) => {
            // Completions run a prompt as it tokenizes, with nothing added around it.
            if r.add_special_tokens == Some(true) {
                return Err(ApiError::invalid(
                    "add_special_tokens",
                    "add_special_tokens: expected false or nothing (a completion's prompt runs \
                     with no special tokens added, and these ids are the ones it runs), found \
                     true",
                ));
            }
            ("prompt", tokenizer.encode(&text).map_err(|e| e.to_string()))
        }
        (None, Some(messages)) => ("messages", encoder.encode_chat(&chat_messages(messages)?)),
        (prompt, _) => {
            let found = if prompt.is_some() { "both" } else { "neither" };
            return Err(ApiError::invalid(
                "prompt",
                format!("prompt: expected a prompt (text) or messages (a chat), found {found}"),
            ));
        }
    };
    let ids = ids.map_err(|e| ApiError::invalid(field, format!("{field}: {e}")))?;
    let mut answer = json!({
        "count": ids.len(),
        "max_model_len": max_model_len,
        "tokens": ids,
    });
    if r.return_token_strs == Some(true) {
        let strs: Vec<String> = ids
            .iter()
            .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
            .collect();
        answer["token_strs"] = json!(strs);
    }
    Ok(answer)
}

/// The answer of `POST /detokenize` to `body`: the text of the ids, special tokens left out.
pub(crate) fn detokenize_answer(
    tokenizer: &Tokenizer,
    body: &[u8],
    served: &str,
) -> Result<Value, ApiError> {
    let r: DetokenizeRequest = typed(object(body)?, "")?;
    served_model(r.model.as_deref(), served)?;
    let Some(ids) = r.tokens else {
        return Err(ApiError::invalid(
            "tokens",
            "tokens: this field is required",
        ));
    };
    let vocab = tokenizer.vocab_size();
    if let Some((i, id)) = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab)
    {
        return Err(ApiError::invalid(
            format!("tokens[{i}]"),
            format!("tokens[{i}]: expected a token id below the tokenizer's {vocab}, found {id}"),
        ));
    }
    let text = tokenizer
        .decode(&ids, DecodeMode::Raw)
        .map_err(|e| ApiError::invalid("tokens", format!("tokens: {e}")))?;
    Ok(json!({ "prompt": text }))
}

pub async fn tokenize(State(app): State<Arc<App>>, request: Request) -> Response {
    let answer = read_body(&app, request)
        .await
        .and_then(|body| tokenize_answer(encoder(&app)?, &body, &app.model, app.max_model_len));
    respond(&app, answer)
}

pub async fn detokenize(State(app): State<Arc<App>>, request: Request) -> Response {
    let answer = read_body(&app, request)
        .await
        .and_then(|body| detokenize_answer(&encoder(&app)?.tokenizer, &body, &app.model));
    respond(&app, answer)
}

fn respond(app: &App, answer: Result<Value, ApiError>) -> Response {
    match answer {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => {
            app.shared.metrics.count("rejected");
            e.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoder(folder: &str, chat: ChatLayout) -> PromptEncoder {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let tokenizer = Tokenizer::from_file(dir.join(folder).join("tokenizer.json")).unwrap();
        PromptEncoder { tokenizer, chat }
    }

    fn bundled() -> PromptEncoder {
        encoder("models/tiny", ChatLayout::Masked(ChatFormat::Llada))
    }

    /// A DiffusionGemma server's chat ids are Gemma 4's layout, as its engine runs them.
    #[test]
    fn a_diffusion_gemma_chat_tokenizes_in_its_own_layout() {
        let enc = encoder("tests/fixtures/tiny-dgemma", ChatLayout::Gemma);
        let body = r#"{"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]}"#;
        let a = tokenize_answer(&enc, body.as_bytes(), "tiny-dgemma", 1024).unwrap();
        let messages = [
            unmask::Message::system("Be brief"),
            unmask::Message::user("Hi"),
        ];
        let (want, _) = unmask::encode_gemma_chat(&enc.tokenizer, &messages).unwrap();
        assert_eq!(a["tokens"], json!(want));
        assert_eq!(&want[..2], &[2, 105], "<bos><|turn>");
        assert!(enc.masked_format().is_none());
    }

    /// Ids are those the completion endpoints run, count and strings included, and decode
    /// back to the text; every bad body names its field.
    #[test]
    fn ids_round_trip_and_bad_bodies_name_their_field() {
        let enc = bundled();
        let tokenize = |body: &str| tokenize_answer(&enc, body.as_bytes(), "tiny", 4096);
        let a = tokenize(r#"{"prompt": "What is the city of Bella?", "return_token_strs": true}"#)
            .unwrap();
        let ids: Vec<u32> = serde_json::from_value(a["tokens"].clone()).unwrap();
        assert_eq!(
            ids,
            enc.tokenizer.encode("What is the city of Bella?").unwrap()
        );
        assert_eq!(a["count"], ids.len());
        assert_eq!(a["max_model_len"], 4096);
        assert_eq!(a["token_strs"].as_array().unwrap().len(), ids.len());
        let back = detokenize_answer(
            &enc.tokenizer,
            format!(r#"{{"tokens": {ids:?}}}"#).as_bytes(),
            "tiny",
        );
        assert_eq!(back.unwrap()["prompt"], "What is the city of Bella?");
        let chat = tokenize(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#).unwrap();
        let want = ChatFormat::Llada
            .encode(&enc.tokenizer, &[unmask::Message::user("Hi")])
            .unwrap();
        assert_eq!(chat["tokens"], json!(want));
        assert!(chat.get("token_strs").is_none());
        for (body, field) in [
            (r#"{}"#, "prompt"),
            (r#"{"prompt": "a", "messages": []}"#, "prompt"),
            (
                r#"{"prompt": "a", "add_special_tokens": true}"#,
                "add_special_tokens",
            ),
            (r#"{"messages": []}"#, "messages"),
            (r#"{"prompt": 3}"#, "prompt"),
            (r#"{"prompt": "a", "model": "other"}"#, "model"),
        ] {
            let e = tokenize(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
        }
        let detok = |body: &str| detokenize_answer(&enc.tokenizer, body.as_bytes(), "tiny");
        for (body, field) in [
            (r#"{}"#, "tokens"),
            (r#"{"tokens": [1, 99999]}"#, "tokens[1]"),
            (r#"{"tokens": [-1]}"#, "tokens[0]"),
        ] {
            let e = detok(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {e}");
        }
    }
}
