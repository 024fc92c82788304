//! Gemma 4's chat layout, as DiffusionGemma's published template writes a text conversation
//! (§1 of `docs/models/diffusion-gemma.md`): `<bos>`; a system turn when the conversation
//! opens with one or thinking is on (`<|think|>` first in it); per message
//! `<|turn>{user|model}\n{content}<turn|>\n`, contents trimmed and a model turn's thought
//! channels removed; then `<|turn>model\n`, followed by an empty thought channel unless
//! thinking is on. Special tokens are placed by id, the text between them encoded as text
//! (the tokenizer never turns typed markup into a special token), each span between two
//! special tokens in one piece, as a tokenizer splitting the rendered string at them does.

use crate::chat::{Message, Role};
use crate::error::TokenizerError;
use crate::tokenizer::Tokenizer;

pub const BOS: &str = "<bos>";
pub const TURN_START: &str = "<|turn>";
pub const TURN_END: &str = "<turn|>";
pub const CHANNEL_START: &str = "<|channel>";
pub const CHANNEL_END: &str = "<channel|>";
pub const THINK: &str = "<|think|>";

/// A piece of a rendered prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Special(&'static str),
    Text(String),
}

/// The pieces of `messages` with the generation prompt appended; adjacent text merged.
pub fn pieces(messages: &[Message], enable_thinking: bool) -> Vec<Piece> {
    let mut out: Vec<Piece> = vec![Piece::Special(BOS)];
    let text = |out: &mut Vec<Piece>, t: &str| match out.last_mut() {
        Some(Piece::Text(prev)) => prev.push_str(t),
        _ => out.push(Piece::Text(t.to_string())),
    };
    let (system, rest) = match messages.split_first() {
        Some((first, rest)) if first.role == Role::System => (Some(first), rest),
        _ => (None, messages),
    };
    if enable_thinking || system.is_some() {
        out.push(Piece::Special(TURN_START));
        text(&mut out, "system\n");
        if enable_thinking {
            out.push(Piece::Special(THINK));
            text(&mut out, "\n");
        }
        if let Some(s) = system {
            text(&mut out, s.content.trim());
        }
        out.push(Piece::Special(TURN_END));
        text(&mut out, "\n");
    }
    for m in rest {
        let (role, content) = match m.role {
            Role::Assistant => ("model", strip_thinking(&m.content)),
            Role::User => ("user", m.content.trim().to_string()),
            // A system message after the first is written as its own turn.
            Role::System => ("system", m.content.trim().to_string()),
        };
        out.push(Piece::Special(TURN_START));
        text(&mut out, &format!("{role}\n{content}"));
        out.push(Piece::Special(TURN_END));
        text(&mut out, "\n");
    }
    out.push(Piece::Special(TURN_START));
    text(&mut out, "model\n");
    if !enable_thinking {
        out.push(Piece::Special(CHANNEL_START));
        text(&mut out, "thought\n");
        out.push(Piece::Special(CHANNEL_END));
    }
    out.retain(|p| !matches!(p, Piece::Text(t) if t.is_empty()));
    out
}

/// The prompt as text (special tokens written out), as the published template renders it.
pub fn render(messages: &[Message], enable_thinking: bool) -> String {
    pieces(messages, enable_thinking)
        .iter()
        .map(|p| match p {
            Piece::Special(s) => *s,
            Piece::Text(t) => t.as_str(),
        })
        .collect()
}

/// The prompt's token ids: special tokens by id (a tokenizer without one is an error naming
/// it), each text span encoded as text.
pub fn encode(
    tokenizer: &Tokenizer,
    messages: &[Message],
    enable_thinking: bool,
) -> Result<Vec<u32>, TokenizerError> {
    encode_pieces(tokenizer, &pieces(messages, enable_thinking))
}

/// How many of `encode`'s ids the system turn takes (through its closing line break), the
/// part requests with the same system prompt share; 0 without a system turn.
pub fn system_turn_len(
    tokenizer: &Tokenizer,
    messages: &[Message],
    enable_thinking: bool,
) -> Result<usize, TokenizerError> {
    let all = pieces(messages, enable_thinking);
    let has_system = enable_thinking || messages.first().is_some_and(|m| m.role == Role::System);
    // Every piece is whole (text spans end at special tokens), so the system turn's pieces
    // encode to exactly the first ids of the prompt.
    match all.iter().position(|p| *p == Piece::Special(TURN_END)) {
        Some(end) if has_system => {
            let through = (end + 2).min(all.len());
            Ok(encode_pieces(tokenizer, &all[..through])?.len())
        }
        _ => Ok(0),
    }
}

fn encode_pieces(tokenizer: &Tokenizer, pieces: &[Piece]) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = Vec::new();
    for p in pieces {
        match p {
            Piece::Special(s) => ids.push(tokenizer.token_to_id(s).ok_or_else(|| {
                TokenizerError::MissingTemplateToken {
                    token: s,
                    template: "Gemma 4's chat layout",
                }
            })?),
            Piece::Text(t) => ids.extend(tokenizer.encode(t)?),
        }
    }
    Ok(ids)
}

/// A model turn without its thought channels: of each piece between channel ends, what comes
/// before a channel start; trimmed.
pub fn strip_thinking(text: &str) -> String {
    let mut out = String::new();
    for part in text.split(CHANNEL_END) {
        match part.find(CHANNEL_START) {
            Some(at) => out += &part[..at],
            None => out += part,
        }
    }
    out.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_of_the_template() {
        let user = Message::new(Role::User, " What is 2 + 3? ");
        assert_eq!(
            render(std::slice::from_ref(&user), false),
            "<bos><|turn>user\nWhat is 2 + 3?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
        );
        assert_eq!(
            render(std::slice::from_ref(&user), true),
            "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nWhat is 2 + 3?<turn|>\n<|turn>model\n"
        );
        assert_eq!(
            strip_thinking("<|channel>thought\nbe kind<channel|>Good, thank you."),
            "Good, thank you."
        );
        assert_eq!(strip_thinking("a<|channel>x<channel|>b<|channel>y"), "ab");
    }
}
