//! A job's input as the engine takes it: tokenized off the engine thread (`encode_input`)
//! and turned into a masked-diffusion `Request` with the server's defaults.

use unmask::{ChatFormat, Engine, EngineError, Prompt, Request, Role, Span};
use unmask_core::tokenizer::Tokenizer;

use super::SchedulerConfig;
use crate::api::{Input, MaskedSampling};

/// Tokenizes a chat or a text as the engine would (the same ids and shared prefix), so
/// that the handler can do it on a blocking thread before the job is queued: a large body
/// tokenized on the engine thread would hold every running stream meanwhile.
pub fn encode_input(
    tokenizer: &Tokenizer,
    chat: &ChatFormat,
    input: Input,
) -> Result<Input, EngineError> {
    Ok(match input {
        Input::Chat(messages) if messages.iter().any(|m| m.role == Role::User) => {
            let split = chat.prefix_split(tokenizer, &messages)?;
            let at = split.split_at();
            Input::Encoded {
                ids: split.whole,
                prefix_len: Some(at),
                chat: true,
            }
        }
        Input::Chat(messages) => Input::Encoded {
            ids: chat.encode(tokenizer, &messages)?,
            prefix_len: Some(0),
            chat: true,
        },
        Input::Text(text) => Input::Encoded {
            ids: tokenizer.encode(&text)?,
            prefix_len: None,
            chat: false,
        },
        other => other,
    })
}

/// A job's input as the engine's prompt (text tokenized here when the handler had no
/// tokenizer to do it), and the shared prefix's length the handler found.
pub(super) fn input_prompt(
    engine: &Engine,
    input: &Input,
) -> Result<(Prompt, Option<usize>), EngineError> {
    Ok(match input {
        Input::Chat(messages) => (Prompt::Chat(messages.clone()), None),
        Input::Ids(ids) => (Prompt::Ids(ids.clone()), None),
        Input::Encoded {
            ids, prefix_len, ..
        } => (Prompt::Ids(ids.clone()), *prefix_len),
        Input::Text(text) => match engine.tokenizer() {
            Some(t) => (Prompt::Ids(t.encode(text)?), None),
            None => {
                return Err(EngineError::NoTokenizer {
                    dir: engine.dir().to_path_buf(),
                });
            }
        },
    })
}

/// The request the engine runs for a job.
pub(super) fn engine_request(
    engine: &Engine,
    input: &Input,
    spec: &MaskedSampling,
    config: &SchedulerConfig,
) -> Result<Request, EngineError> {
    let (prompt, prefix_len) = input_prompt(engine, input)?;
    let mut request = Request::new(prompt)
        .with_params(spec.params.clone())
        .with_cache(spec.cache);
    request.prefix_len = prefix_len;
    request.depth = config.depth;
    request.refresh_every = config.refresh_every;
    request.anchor_ratio = spec.anchor_ratio.unwrap_or(config.anchor_ratio);
    request.adaptive = config.adaptive;
    spec.adaptive.apply(&mut request.adaptive);
    request.full_canvas = spec.full_canvas.unwrap_or(config.full_canvas);
    request.span = spec.affix.clone().map(Span::Text);
    if let Some(text) = &spec.suffix {
        request.suffix = engine.encode_text(text)?;
    }
    Ok(request)
}
