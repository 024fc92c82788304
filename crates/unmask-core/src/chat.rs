//! The LLaDA-Instruct chat template, reproduced exactly, and the split of a chat prompt
//! into a shared prefix (system prompt and earlier turns) and the part that changes.

use serde::{Deserialize, Serialize};

use crate::error::TokenizerError;
use crate::tokenizer::{BOS_TOKEN, END_HEADER_TOKEN, EOT_TOKEN, START_HEADER_TOKEN, Tokenizer};

/// Appended after the messages whatever `add_generation_prompt` says: the template
/// always asks the model for an assistant turn.
pub const ASSISTANT_HEADER: &str = "<|start_header_id|>assistant<|end_header_id|>\n\n";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

/// Jinja's `trim` is Python's `str.strip()`, whose whitespace also includes the
/// information separators U+001C..U+001F that Rust's `char::is_whitespace` leaves out.
fn python_strip(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

fn push_turn(out: &mut String, message: &Message) {
    out.push_str(START_HEADER_TOKEN);
    out.push_str(message.role.as_str());
    out.push_str(END_HEADER_TOKEN);
    out.push_str("\n\n");
    out.push_str(python_strip(&message.content));
    out.push_str(EOT_TOKEN);
}

/// The prompt text exactly as LLaDA-Instruct's `chat_template` renders it: `bos` before
/// the first message only, each message as
/// `<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>`, then the
/// assistant header.
pub fn render_chat(messages: &[Message], bos: &str) -> String {
    let mut out = String::new();
    for (i, message) in messages.iter().enumerate() {
        if i == 0 {
            out.push_str(bos);
        }
        push_turn(&mut out, message);
    }
    out.push_str(ASSISTANT_HEADER);
    out
}

/// The template's markup must map to single special tokens, or the model sees text it
/// was never trained on.
fn check_chat_tokens(tokenizer: &Tokenizer) -> Result<(), TokenizerError> {
    for token in [BOS_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN] {
        if tokenizer.token_to_id(token).is_none() {
            return Err(TokenizerError::MissingChatToken { token });
        }
    }
    Ok(())
}

/// Token ids of the rendered chat prompt, encoded without added special tokens (the BOS
/// comes from the template).
pub fn encode_chat(
    tokenizer: &Tokenizer,
    messages: &[Message],
) -> Result<Vec<u32>, TokenizerError> {
    if messages.is_empty() {
        return Err(TokenizerError::NoMessages);
    }
    check_chat_tokens(tokenizer)?;
    tokenizer.encode(&render_chat(messages, BOS_TOKEN))
}

/// A chat prompt cut where its last user turn begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixSplit {
    /// BOS, system prompt and earlier turns: the part requests can share.
    pub prefix: Vec<u32>,
    /// The last user turn onwards, ending with the assistant header.
    pub rest: Vec<u32>,
    /// The whole prompt encoded in one piece (what `encode_chat` returns).
    pub whole: Vec<u32>,
    /// Whether `prefix ++ rest == whole`. Encoding the two halves separately can differ
    /// from encoding the whole at the boundary; when false, use `whole` without a prefix.
    pub exact: bool,
}

impl PrefixSplit {
    /// Token index where the last user turn begins.
    pub fn split_at(&self) -> usize {
        self.prefix.len()
    }
}

/// Splits the chat prompt before its last user turn and encodes both halves.
pub fn prefix_split(
    tokenizer: &Tokenizer,
    messages: &[Message],
) -> Result<PrefixSplit, TokenizerError> {
    if messages.is_empty() {
        return Err(TokenizerError::NoMessages);
    }
    let Some(last_user) = messages.iter().rposition(|m| m.role == Role::User) else {
        let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
        return Err(TokenizerError::NoUserTurn {
            roles: roles.join(", "),
        });
    };
    check_chat_tokens(tokenizer)?;

    let mut prefix_text = String::from(BOS_TOKEN);
    for message in &messages[..last_user] {
        push_turn(&mut prefix_text, message);
    }
    let mut rest_text = String::new();
    for message in &messages[last_user..] {
        push_turn(&mut rest_text, message);
    }
    rest_text.push_str(ASSISTANT_HEADER);

    let prefix = tokenizer.encode(&prefix_text)?;
    let rest = tokenizer.encode(&rest_text)?;
    let whole = tokenizer.encode(&render_chat(messages, BOS_TOKEN))?;
    let exact = prefix.len() + rest.len() == whole.len()
        && whole[..prefix.len()] == prefix[..]
        && whole[prefix.len()..] == rest[..];
    Ok(PrefixSplit {
        prefix,
        rest,
        whole,
        exact,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_user_turn_matches_the_spec_example() {
        let text = render_chat(&[Message::user("Hi")], BOS_TOKEN);
        assert_eq!(
            text,
            "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn bos_only_before_the_first_message_and_content_is_trimmed() {
        let text = render_chat(
            &[
                Message::system(" sys\n"),
                Message::user("\u{1f}\tq "),
                Message::assistant("a\u{a0}"),
            ],
            "<B>",
        );
        assert_eq!(
            text,
            "<B><|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\na<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(text.matches("<B>").count(), 1);
    }

    #[test]
    fn no_messages_renders_only_the_assistant_header() {
        assert_eq!(render_chat(&[], BOS_TOKEN), ASSISTANT_HEADER);
    }

    #[test]
    fn roles_parse_from_json() {
        let m: Message = serde_json::from_str(r#"{"role":"assistant","content":"x"}"#).unwrap();
        assert_eq!(m, Message::assistant("x"));
        assert!(serde_json::from_str::<Message>(r#"{"role":"tool","content":"x"}"#).is_err());
    }
}
