//! The request bodies of OpenAI's chat and text completion endpoints, checked and turned
//! into what the engine runs. Fields the runtime cannot honour are refused by name rather
//! than ignored; unknown fields are ignored, as OpenAI's clients send extras.

use crate::error::ApiError;
use crate::fields::{object, required, typed, whole};
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;
use unmask::{CacheMode, GenerationParams, Message, Role};

/// Server-wide limits and defaults a request is checked against.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest `max_tokens` accepted.
    pub max_tokens: usize,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// The cache mode when the request names none.
    pub default_cache: CacheMode,
    /// The served model's family: which settings a request may give.
    pub family: Family,
}

/// The kinds of model a server runs, each with its own request settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Family {
    /// LLaDA and Dream: masked diffusion with the cache modes and remasking rules.
    #[default]
    MaskedDiffusion,
    /// DiffusionGemma: canvases denoised by its entropy-bound sampler, whose settings come
    /// from the model's generation_config.json.
    DiffusionGemma,
}

/// Most denoising steps per canvas a DiffusionGemma request may ask for.
pub const MOST_GEMMA_STEPS: u64 = 4096;

/// Most choices (`n`) one request may ask for; the server's `--max-queue` bounds it too.
pub const MOST_CHOICES: u64 = 64;

/// Most alternatives per token chat's `top_logprobs` may ask for (OpenAI's limit).
pub const MOST_TOP_LOGPROBS: usize = 20;

/// Most alternatives per token the legacy completions' `logprobs` may ask for (OpenAI's).
pub const MOST_LEGACY_LOGPROBS: u64 = 5;

/// One message's content: a string, or OpenAI's list of parts (text parts only).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// A last chunk with the token counts (OpenAI's).
    #[serde(default)]
    pub include_usage: bool,
    /// Every step's whole canvas as an extra chunk (this server's extension), for UIs
    /// that draw the denoising.
    #[serde(default)]
    pub include_canvas: bool,
}

/// The fields both endpoints share: sampling, diffusion settings and what is refused.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    // `messages` / `prompt` are taken out before this is read.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Not OpenAI's; as vLLM and others take it (-1 and 0 turn it off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// vLLM's: ids less probable than this share of the most probable one are cut (0: off).
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    // Diffusion settings (this server's extension).
    #[serde(default)]
    pub steps: Option<u64>,
    #[serde(default)]
    pub block_length: Option<u64>,
    #[serde(default)]
    pub threshold: Option<f64>,
    #[serde(default)]
    pub cache: Option<String>,
    /// ACache: text of the prompt other requests share (a document, a table), anywhere in
    /// it; absent: a stored span found inside the prompt.
    #[serde(default)]
    pub affix: Option<String>,
    #[serde(default)]
    pub anchor_ratio: Option<f64>,
    /// dLLM-Cache: K_p, K_r, ρ and the V-verify rule (`None`: the server's defaults).
    #[serde(default)]
    pub prompt_interval: Option<u64>,
    #[serde(default)]
    pub response_interval: Option<u64>,
    #[serde(default)]
    pub refresh_ratio: Option<f64>,
    #[serde(default)]
    pub verify_pick: Option<String>,
    #[serde(default)]
    pub pin_block: Option<bool>,
    /// Run every step of the canvas instead of ending when the answer is final.
    #[serde(default)]
    pub full_canvas: Option<bool>,
    /// Also read as Dream's `alg` (maskgit_plus, topk_margin, entropy, origin).
    #[serde(default, alias = "alg")]
    pub remasking: Option<String>,
    /// Dream's `alg_temp`.
    #[serde(default)]
    pub alg_temp: Option<f64>,
    /// Dream's timestep schedule's last value; sets the Dream schedule.
    #[serde(default)]
    pub eps: Option<f64>,
    /// Chat: a boolean; completions: the alternatives per token (`api/logprobs.rs`).
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(default)]
    pub top_logprobs: Option<Value>,
    /// OpenAI's penalties, on the tokens committed in the canvas so far.
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    /// vLLM's multiplicative penalty on the tokens of the prompt and the canvas (1: off).
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// Token ids (decimal strings) to biases from -100 to 100.
    #[serde(default)]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    // OpenAI fields this runtime does not implement: refused when set to anything but
    // their neutral value.
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(default)]
    pub best_of: Option<u64>,
    #[serde(default)]
    pub echo: Option<bool>,
    /// Infilling (completions): text after the generated canvas.
    #[serde(default)]
    pub suffix: Option<String>,
}

#[derive(Debug)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub common: Common,
}

/// `prompt` of a text completion: a string, a one-string list, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Debug)]
pub struct CompletionRequest {
    pub prompt: CompletionPrompt,
    pub common: Common,
}

/// What to generate from, before tokenization (which needs the engine's tokenizer).
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    Chat(Vec<Message>),
    Text(String),
    Ids(Vec<u32>),
    /// A chat or a text the handler encoded (`scheduler::encode_input`, off the engine
    /// thread), with the shared prefix's length the engine would have found itself.
    Encoded {
        ids: Vec<u32>,
        prefix_len: Option<usize>,
        chat: bool,
    },
}

/// A masked-diffusion request's sampler and caches.
#[derive(Clone, Debug)]
pub struct MaskedSampling {
    pub params: GenerationParams,
    pub cache: CacheMode,
    /// ACache: the shared span's text and the anchor ratio (`None`: the server's default).
    pub affix: Option<String>,
    pub anchor_ratio: Option<f32>,
    /// dLLM-Cache's settings the request names (over the server's defaults).
    pub adaptive: unmask::AdaptiveOverrides,
    /// `None`: the server's default.
    pub full_canvas: Option<bool>,
    /// Infilling: the text after the canvas (OpenAI's completion `suffix`), tokenized as it
    /// is; the answer is the canvas between the prompt and it.
    pub suffix: Option<String>,
}

/// A DiffusionGemma request's limits, seed and logit biases (the rest is generation_config.json's).
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaSampling {
    /// `max_tokens` (`None`: generation_config.json's max_new_tokens).
    pub max_new_tokens: Option<usize>,
    /// `steps`: most denoising steps per canvas (`None`: generation_config.json's).
    pub max_denoising_steps: Option<usize>,
    pub seed: u64,
    /// One of a request's `n` choices (n > 1): the choices share the whole prompt, encoded
    /// once (`DgemmaRequest::share_prompt`).
    pub share_prompt: bool,
    /// OpenAI's `logit_bias` (`DgemmaRequest::logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
}

/// How a request samples, by the served model's family.
#[derive(Clone, Debug)]
pub enum Sampling {
    Masked(Box<MaskedSampling>),
    Gemma(GemmaSampling),
    /// Not a generation: continuations scored after the input (`/v1/loglikelihood`).
    Score(Box<score::ScoreSpec>),
}

/// A checked request: what the scheduler runs and how the answer is shaped.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub input: Input,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub include_canvas: bool,
    /// OpenAI's `n`: choices of the same prompt, each a request of its own with the seed
    /// `seed + index` (so choice 0 is the answer with `n` = 1).
    pub choices: usize,
    /// OpenAI's `logprobs`: each answer token's log-probability at the step that committed
    /// it, with this many most likely alternatives (`top_logprobs`, or the legacy
    /// completions' `logprobs` count). `None`: not asked for.
    pub logprobs: Option<usize>,
}

impl JobSpec {
    /// The request of choice `index`: this one with its seed moved on by `index`, alone.
    pub fn choice(&self, index: usize) -> JobSpec {
        let mut spec = self.clone();
        let offset = index as u64;
        match &mut spec.sampling {
            Sampling::Masked(m) => m.params.seed = m.params.seed.wrapping_add(offset),
            Sampling::Gemma(g) => {
                g.seed = g.seed.wrapping_add(offset);
                g.share_prompt = self.choices > 1;
            }
            // One answer per request: its draws are the seed's.
            Sampling::Score(_) => {}
        }
        spec.choices = 1;
        spec
    }

    /// A text completion rather than a chat.
    pub fn is_completion(&self) -> bool {
        !matches!(
            self.input,
            Input::Chat(_) | Input::Encoded { chat: true, .. }
        )
    }
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut body = object(body)?;
        let messages = typed(required(&mut body, "messages")?, "messages")?;
        let common = typed(body, "")?;
        Ok(Self { messages, common })
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let mut body = object(body)?;
        let prompt = typed(required(&mut body, "prompt")?, "prompt")?;
        let common = typed(body, "")?;
        Ok(Self { prompt, common })
    }
}

impl ChatRequest {
    pub fn check(self, limits: &Limits, served: &str) -> Result<JobSpec, ApiError> {
        let messages = chat_messages(self.messages)?;
        if self.common.suffix.is_some() {
            return Err(ApiError::invalid(
                "suffix",
                "suffix: a field of /v1/completions (infilling after the prompt), not of chat \
                 completions",
            ));
        }
        self.common.check(Input::Chat(messages), limits, served)
    }
}

/// OpenAI's messages as the chat template takes them: known roles, text parts only, and
/// at least one user turn.
pub(crate) fn chat_messages(messages_in: Vec<ChatMessage>) -> Result<Vec<Message>, ApiError> {
    if messages_in.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages: expected at least one message, found none",
        ));
    }
    let mut messages = Vec::with_capacity(messages_in.len());
    for (i, m) in messages_in.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role: expected system, developer, user or assistant, \
                         found {other:?}"
                    ),
                ));
            }
        };
        let text = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (k, p) in parts.into_iter().enumerate() {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{k}]"),
                                format!(
                                    "messages[{i}].content[{k}]: expected a text part, found \
                                     a part of type {kind:?} (this model reads text only)"
                                ),
                            ));
                        }
                    }
                }
                text
            }
        };
        messages.push(Message::new(role, text));
    }
    if !messages.iter().any(|m| m.role == Role::User) {
        return Err(ApiError::invalid(
            "messages",
            "messages: expected at least one user message, found none",
        ));
    }
    Ok(messages)
}

impl CompletionRequest {
    pub fn check(self, limits: &Limits, served: &str) -> Result<JobSpec, ApiError> {
        let input = match self.prompt {
            CompletionPrompt::Text(t) => Input::Text(t),
            CompletionPrompt::Texts(mut v) if v.len() == 1 => Input::Text(v.remove(0)),
            CompletionPrompt::Texts(v) => {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "prompt: expected one prompt (one completion per request), found {}",
                        v.len()
                    ),
                ));
            }
            CompletionPrompt::Ids(ids) => Input::Ids(ids),
        };
        let empty = match &input {
            Input::Text(t) => t.is_empty(),
            Input::Ids(ids) | Input::Encoded { ids, .. } => ids.is_empty(),
            Input::Chat(_) => false,
        };
        if empty {
            return Err(ApiError::invalid(
                "prompt",
                "prompt: expected a non-empty prompt, found an empty one",
            ));
        }
        if let Some(b) = self.common.best_of.filter(|&b| b != 1) {
            return Err(ApiError::invalid(
                "best_of",
                format!("best_of: expected 1 (one completion per request), found {b}"),
            ));
        }
        if self.common.echo == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "echo: expected false, found true (the prompt is not echoed)",
            ));
        }
        self.common.check(input, limits, served)
    }
}

/// A request's `model`, when it names one, must be the served one (404 otherwise).
pub(crate) fn served_model(model: Option<&str>, served: &str) -> Result<(), ApiError> {
    match model.filter(|m| *m != served) {
        None => Ok(()),
        Some(m) => Err(ApiError {
            status: axum::http::StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..ApiError::invalid(
                "model",
                format!("model: this server serves {served:?}, found {m:?}"),
            )
        }),
    }
}

impl Common {
    fn check(mut self, input: Input, limits: &Limits, served: &str) -> Result<JobSpec, ApiError> {
        served_model(self.model.as_deref(), served)?;
        let choices = match self.n {
            None => 1,
            Some(n) if (1..=MOST_CHOICES).contains(&n) => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "n",
                    format!("n: expected 1..={MOST_CHOICES} choices, found {n}"),
                ));
            }
        };
        let logprobs = self.logprobs(&input, limits.family == Family::DiffusionGemma)?;
        let refused: [(&str, bool); 2] = [
            ("tools", self.tools.as_ref().is_some_and(|v| !v.is_null())),
            (
                "response_format",
                self.response_format.as_ref().is_some_and(|v| {
                    v.get("type")
                        .and_then(Value::as_str)
                        .is_some_and(|t| t != "text")
                }),
            ),
        ];
        if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
            return Err(ApiError::invalid(
                *field,
                format!("{field}: not supported by this runtime; leave it out"),
            ));
        }
        if self
            .tool_choice
            .as_ref()
            .is_some_and(|v| !v.is_null() && v != "none")
        {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice: not supported by this runtime; leave it out",
            ));
        }
        let stop = match self.stop.take() {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop: expected up to 4 non-empty strings, found {} ({} empty)",
                    stop.len(),
                    stop.iter().filter(|s| s.is_empty()).count()
                ),
            ));
        }
        let stream = self.stream.unwrap_or(false);
        let options = self.stream_options.take().unwrap_or_default();
        if !stream && (options.include_usage || options.include_canvas) {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options: only allowed with \"stream\": true",
            ));
        }
        let requested = match (self.max_completion_tokens, self.max_tokens) {
            (Some(n), _) => whole("max_completion_tokens", Some(n))?,
            (None, n) => whole("max_tokens", n)?,
        };
        if let Some(n) = requested.filter(|&n| n > limits.max_tokens) {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "max_tokens: expected at most {} (the server's limit), found {n}",
                    limits.max_tokens
                ),
            ));
        }
        // An empty suffix is no suffix.
        let suffix = self.suffix.take().filter(|s| !s.is_empty());
        let sampling = match limits.family {
            Family::MaskedDiffusion => {
                let max_tokens = requested.unwrap_or(limits.default_max_tokens);
                let mut masked = self.masked(max_tokens, limits)?;
                masked.suffix = suffix;
                Sampling::Masked(Box::new(masked))
            }
            Family::DiffusionGemma if suffix.is_some() => {
                return Err(ApiError::invalid(
                    "suffix",
                    "suffix: not supported by DiffusionGemma (its canvases follow the prompt \
                     and end it); leave it out",
                ));
            }
            Family::DiffusionGemma => Sampling::Gemma(self.gemma(requested)?),
        };
        Ok(JobSpec {
            input,
            sampling,
            stop,
            stream,
            include_usage: options.include_usage,
            include_canvas: options.include_canvas,
            choices,
            logprobs,
        })
    }
}

mod gemma;
mod logprobs;
mod masked;
pub mod score;
#[cfg(test)]
mod tests;
