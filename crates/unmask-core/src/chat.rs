//! The chat templates of the supported families, reproduced exactly (LLaDA-Instruct's
//! header/eot markup, and ChatML as Dream and Qwen2 write it), and the split of a chat
//! prompt into a shared prefix (system prompt and earlier turns) and the part that changes.

use serde::{Deserialize, Serialize};

use crate::config::ModelFamily;
use crate::error::TokenizerError;
use crate::tokenizer::{BOS_TOKEN, END_HEADER_TOKEN, EOT_TOKEN, START_HEADER_TOKEN, Tokenizer};

/// ChatML's turn markup (Dream, Qwen2).
pub const IM_START_TOKEN: &str = "<|im_start|>";
pub const IM_END_TOKEN: &str = "<|im_end|>";

/// The system prompt Dream-v0-Instruct's (and Qwen2's) template adds when the messages
/// have none.
pub const CHATML_DEFAULT_SYSTEM: &str = "You are a helpful assistant.";

/// How a model's chat template lays out a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatFormat {
    /// LLaDA-Instruct: BOS, then `<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>`
    /// per message, then the assistant header.
    Llada,
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message (content as is),
    /// then `<|im_start|>assistant\n`; `default_system` opens a conversation that has no
    /// system message.
    ChatMl { default_system: Option<String> },
}

impl ChatFormat {
    /// The format a family's published template uses.
    pub fn for_family(family: ModelFamily) -> Self {
        family.chat_format()
    }

    /// Recognizes a `tokenizer_config.json` `chat_template`: ChatML when it writes
    /// `<|im_start|>` (its default system prompt read from the template's
    /// `<|im_start|>system\n…<|im_end|>` literal, if it has one), LLaDA's when it writes
    /// `<|start_header_id|>`; None for a template of another kind.
    pub fn from_template(template: &str) -> Option<Self> {
        if template.contains(IM_START_TOKEN) {
            let literal = format!("{IM_START_TOKEN}system\\n");
            let default_system = template.find(&literal).and_then(|at| {
                let rest = &template[at + literal.len()..];
                let end = rest.find(IM_END_TOKEN)?;
                // A Jinja expression there (`' + messages[0]...`) is no literal default.
                let text = &rest[..end];
                (!text.contains('\'') && !text.contains("{{")).then(|| text.replace("\\n", "\n"))
            });
            Some(Self::ChatMl { default_system })
        } else if template.contains(START_HEADER_TOKEN) {
            Some(Self::Llada)
        } else {
            None
        }
    }

    /// The prompt text exactly as the template renders it with `add_generation_prompt`
    /// (`bos` is LLaDA's BOS text; ChatML has none).
    pub fn render(&self, messages: &[Message], bos: &str) -> String {
        match self {
            Self::Llada => render_chat(messages, bos),
            Self::ChatMl { default_system } => {
                let mut out = String::new();
                if let Some(system) = chatml_default(default_system, messages) {
                    push_chatml_turn(&mut out, Role::System.as_str(), system);
                }
                for m in messages {
                    push_chatml_turn(&mut out, m.role.as_str(), &m.content);
                }
                out.push_str(IM_START_TOKEN);
                out.push_str("assistant\n");
                out
            }
        }
    }

    /// Token ids of `render`'s prompt, the markup placed by id and the messages encoded as
    /// text (markup inside a message stays text).
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
    ) -> Result<Vec<u32>, TokenizerError> {
        Ok(self.prefix_split_at(tokenizer, messages, 0)?.whole)
    }

    /// Splits the prompt before its last user turn and encodes both halves.
    pub fn prefix_split(
        &self,
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
        self.prefix_split_at(tokenizer, messages, last_user)
    }

    /// The prompt encoded in two halves: before message `cut`, and from it on.
    fn prefix_split_at(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        cut: usize,
    ) -> Result<PrefixSplit, TokenizerError> {
        if messages.is_empty() {
            return Err(TokenizerError::NoMessages);
        }
        let (prefix, rest) = match self {
            Self::Llada => {
                let chat = ChatTokens::of(tokenizer)?;
                let mut prefix = vec![chat.bos];
                for message in &messages[..cut] {
                    chat.turn(tokenizer, message, &mut prefix)?;
                }
                let mut rest = Vec::new();
                for message in &messages[cut..] {
                    chat.turn(tokenizer, message, &mut rest)?;
                }
                chat.assistant_header(tokenizer, &mut rest)?;
                (prefix, rest)
            }
            Self::ChatMl { default_system } => {
                let id = |token: &'static str| {
                    tokenizer
                        .token_to_id(token)
                        .ok_or(TokenizerError::MissingChatToken { token })
                };
                let (start, end) = (id(IM_START_TOKEN)?, id(IM_END_TOKEN)?);
                // Text between two markup tokens is one piece, as the tokenizer splits it.
                let turn = |role: &str, content: &str, out: &mut Vec<u32>| {
                    out.push(start);
                    out.extend(tokenizer.encode(&format!("{role}\n{content}"))?);
                    out.push(end);
                    out.extend(tokenizer.encode("\n")?);
                    Ok::<_, TokenizerError>(())
                };
                let mut prefix = Vec::new();
                if let Some(system) = chatml_default(default_system, messages) {
                    turn(Role::System.as_str(), system, &mut prefix)?;
                }
                for m in &messages[..cut] {
                    turn(m.role.as_str(), &m.content, &mut prefix)?;
                }
                let mut rest = Vec::new();
                for m in &messages[cut..] {
                    turn(m.role.as_str(), &m.content, &mut rest)?;
                }
                rest.push(start);
                rest.extend(tokenizer.encode("assistant\n")?);
                (prefix, rest)
            }
        };
        let whole = [prefix.as_slice(), rest.as_slice()].concat();
        Ok(PrefixSplit {
            prefix,
            rest,
            whole,
        })
    }
}

/// The default system prompt when the conversation does not open with its own.
fn chatml_default<'a>(default: &'a Option<String>, messages: &[Message]) -> Option<&'a str> {
    match messages.first() {
        Some(m) if m.role == Role::System => None,
        _ => default.as_deref(),
    }
}

fn push_chatml_turn(out: &mut String, role: &str, content: &str) {
    out.push_str(IM_START_TOKEN);
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str(IM_END_TOKEN);
    out.push('\n');
}

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

/// The ids of the template's markup, which must be single special tokens, or the model
/// sees text it was never trained on.
struct ChatTokens {
    bos: u32,
    start_header: u32,
    end_header: u32,
    eot: u32,
}

impl ChatTokens {
    fn of(tokenizer: &Tokenizer) -> Result<Self, TokenizerError> {
        let id = |token: &'static str| {
            tokenizer
                .token_to_id(token)
                .ok_or(TokenizerError::MissingChatToken { token })
        };
        Ok(Self {
            bos: id(BOS_TOKEN)?,
            start_header: id(START_HEADER_TOKEN)?,
            end_header: id(END_HEADER_TOKEN)?,
            eot: id(EOT_TOKEN)?,
        })
    }

    /// `<|start_header_id|>{role}<|end_header_id|>` then `\n\n`, as ids.
    fn header(
        &self,
        tokenizer: &Tokenizer,
        role: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        out.push(self.start_header);
        out.extend(tokenizer.encode(role)?);
        out.push(self.end_header);
        Ok(())
    }

    /// One turn as `render_chat` writes it. The markup is placed by id and the text
    /// between it encoded as text, so markup inside a message stays text. The tokenizer
    /// splits a string at special tokens and encodes the pieces apart, so for text without
    /// markup this equals encoding the rendered string.
    fn turn(
        &self,
        tokenizer: &Tokenizer,
        message: &Message,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        self.header(tokenizer, message.role.as_str(), out)?;
        out.extend(tokenizer.encode(&format!("\n\n{}", python_strip(&message.content)))?);
        out.push(self.eot);
        Ok(())
    }

    fn assistant_header(
        &self,
        tokenizer: &Tokenizer,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        self.header(tokenizer, Role::Assistant.as_str(), out)?;
        out.extend(tokenizer.encode("\n\n")?);
        Ok(())
    }
}

/// Token ids of the chat prompt `render_chat` renders (LLaDA's template): BOS, the turns and
/// the assistant header, with the template's special tokens placed by id and the messages
/// encoded as text (special-token markup a message contains is not a special token).
pub fn encode_chat(
    tokenizer: &Tokenizer,
    messages: &[Message],
) -> Result<Vec<u32>, TokenizerError> {
    ChatFormat::Llada.encode(tokenizer, messages)
}

/// A chat prompt cut where its last user turn begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixSplit {
    /// BOS, system prompt and earlier turns: the part requests can share.
    pub prefix: Vec<u32>,
    /// The last user turn onwards, ending with the assistant header.
    pub rest: Vec<u32>,
    /// `prefix ++ rest`: what `encode_chat` returns. The cut is at a special token, where
    /// the tokenizer splits anyway, so the halves encode exactly as the whole does.
    pub whole: Vec<u32>,
}

impl PrefixSplit {
    /// Token index where the last user turn begins.
    pub fn split_at(&self) -> usize {
        self.prefix.len()
    }
}

/// Splits LLaDA's chat prompt before its last user turn and encodes both halves.
pub fn prefix_split(
    tokenizer: &Tokenizer,
    messages: &[Message],
) -> Result<PrefixSplit, TokenizerError> {
    ChatFormat::Llada.prefix_split(tokenizer, messages)
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

    /// Dream-v0-Instruct's template as its tokenizer_config.json holds it (Qwen2's).
    const DREAM_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn chatml_is_recognized_with_its_default_system_prompt() {
        let format = ChatFormat::from_template(DREAM_TEMPLATE).unwrap();
        assert_eq!(format, ChatFormat::for_family(ModelFamily::Dream));
        let text = format.render(&[Message::user(" Hi\n")], "");
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\n Hi\n<|im_end|>\n<|im_start|>assistant\n"
        );
        let own = format.render(&[Message::system("S"), Message::user("q")], "");
        assert!(
            own.starts_with("<|im_start|>system\nS<|im_end|>\n"),
            "{own}"
        );
        assert_eq!(own.matches("system").count(), 1);
        // A template whose system turn is an expression has no default.
        let t = "{{'<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>'}}";
        assert_eq!(
            ChatFormat::from_template(t),
            Some(ChatFormat::ChatMl {
                default_system: None
            })
        );
        assert_eq!(
            ChatFormat::from_template("<|start_header_id|>"),
            Some(ChatFormat::Llada)
        );
        assert_eq!(ChatFormat::from_template("{{ messages }}"), None);
    }

    #[test]
    fn roles_parse_from_json() {
        let m: Message = serde_json::from_str(r#"{"role":"assistant","content":"x"}"#).unwrap();
        assert_eq!(m, Message::assistant("x"));
        assert!(serde_json::from_str::<Message>(r#"{"role":"tool","content":"x"}"#).is_err());
    }
}
