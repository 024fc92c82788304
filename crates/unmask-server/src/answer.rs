//! The JSON of OpenAI's answers and stream chunks: the envelope every answer and chunk of
//! a request shares, its choices (text, finish reason, log-probabilities) and usage.

use serde_json::{Value, json};

use crate::logprobs::{TokenLogprob, chat_json, completion_json};
use crate::routes::Endpoint;
use crate::scheduler::Finished;

/// The fields every answer and chunk of one request share.
pub(crate) struct Shape {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// The request asked for log-probabilities (with this many alternatives): every choice
    /// and chunk carries them.
    pub logprobs: Option<usize>,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    pub fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A choice's `logprobs`: null unless asked for.
    fn logprobs_json(&self, tokens: &[TokenLogprob]) -> Value {
        match (self.logprobs, self.endpoint) {
            (None, _) => Value::Null,
            (Some(_), Endpoint::Chat) => chat_json(tokens),
            (Some(top), Endpoint::Completion) => completion_json(tokens, top),
        }
    }

    /// A stream chunk of choice `index` carrying `text` and the log-probabilities of the
    /// tokens it completes (and `finish_reason` on the last).
    pub fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        tokens: &[TokenLogprob],
        role: bool,
        finish: Option<&str>,
    ) -> Value {
        // OpenAI's role chunk carries none.
        let logprobs = if text.is_some() && !role {
            self.logprobs_json(tokens)
        } else {
            Value::Null
        };
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
            }
            Endpoint::Completion => {
                json!({ "index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish })
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// The whole answer: one choice per finished job, in order. With one choice the
    /// runtime's report is the answer's `unmask`; with several each choice carries its own.
    pub fn whole(&self, finished: &[Finished]) -> Value {
        let many = finished.len() > 1;
        let choices: Vec<Value> = finished
            .iter()
            .enumerate()
            .map(|(index, f)| {
                let logprobs = self.logprobs_json(f.logprobs.as_deref().unwrap_or_default());
                let mut choice = match self.endpoint {
                    Endpoint::Chat => json!({
                        "index": index,
                        "message": { "role": "assistant", "content": f.text },
                        "logprobs": logprobs,
                        "finish_reason": f.finish_reason.as_str(),
                    }),
                    Endpoint::Completion => json!({
                        "index": index,
                        "text": f.text,
                        "logprobs": logprobs,
                        "finish_reason": f.finish_reason.as_str(),
                    }),
                };
                if many {
                    choice["unmask"] = extension(f);
                }
                choice
            })
            .collect();
        let mut v = self.envelope(false, json!(choices));
        v["usage"] = usage(finished);
        if let [one] = finished {
            v["unmask"] = extension(one);
        }
        v
    }
}

/// OpenAI's usage of a request's choices: the prompt counted once, every choice's tokens.
pub(crate) fn usage(finished: &[Finished]) -> Value {
    let prompt = finished.first().map_or(0, |f| f.prompt_tokens);
    let completion: usize = finished.iter().map(|f| f.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// What the runtime did, beside OpenAI's fields (`Finished::report`).
pub(crate) fn extension(f: &Finished) -> Value {
    f.report.clone()
}
