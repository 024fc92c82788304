//! The text side of a LLaDA or Dream model folder: its configuration, tokenizer, chat
//! format and special tokens, read without the weights or a GPU. The engine loads it first;
//! tools that only encode and decode (`unmask tokenize`, an app counting a prompt's tokens)
//! stop there.

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use unmask_core::chat::ChatFormat;
use unmask_core::config::ModelConfig;
use unmask_core::tokenizer::{SpecialTokens, Tokenizer};

#[cfg(not(target_arch = "wasm32"))]
use crate::files::DirFiles;
use crate::files::{self, ModelFiles};
use crate::{EngineError, Prompt};

/// A model folder's text side.
pub struct TextSide {
    /// config.json, with generation_config.json's settings.
    pub config: ModelConfig,
    /// tokenizer.json, with the special ids reserved (text never encodes to them); `None`
    /// without one (token ids only).
    pub tokenizer: Option<Tokenizer>,
    /// How a conversation is laid out: recognized from tokenizer_config.json's
    /// `chat_template`, else the family's.
    pub chat: ChatFormat,
    /// Mask, EOS, BOS and the chat markup's ids: the tokenizer's (checked against the
    /// config), else the config's.
    pub special: SpecialTokens,
    /// Where the files came from (a folder, a URL).
    pub location: String,
}

impl TextSide {
    /// Reads config.json, generation_config.json, tokenizer.json and tokenizer_config.json
    /// from `files`.
    pub async fn read<F: ModelFiles>(files: &mut F) -> Result<Self, EngineError> {
        let config_text = files::read_text(files, "config.json")
            .await?
            .ok_or_else(|| EngineError::File {
                location: files.location("config.json"),
                message: "not found".into(),
            })?;
        let mut config = ModelConfig::from_json_str(&config_text)?;
        const GENERATION: &str = "generation_config.json";
        if let Some(text) = files::read_text(files, GENERATION).await? {
            config = config.with_generation_config(&text, &files.location(GENERATION))?;
        }
        let mut tokenizer = match files::read_small(files, "tokenizer.json").await? {
            Some(b) => Some(Tokenizer::from_bytes(&b)?),
            None => None,
        };
        const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
        let chat = files::read_text(files, TOKENIZER_CONFIG)
            .await?
            .and_then(|text| chat_format_of(&text))
            .unwrap_or_else(|| ChatFormat::for_family(config.family));
        let special = SpecialTokens::resolve(tokenizer.as_ref(), &config)?;
        // The config's role ids too, not only the tokenizer's role strings: text never
        // encodes to the mask or a boundary id, whatever token string that id has.
        if let Some(t) = &mut tokenizer {
            t.reserve(&special);
        }
        Ok(Self {
            config,
            tokenizer,
            chat,
            special,
            location: files.location(""),
        })
    }

    /// The text side of the model folder `dir`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        pollster::block_on(Self::read(&mut DirFiles::folder(dir)?))
    }

    pub fn require_tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| EngineError::NoTokenizer {
                dir: self.location.clone().into(),
            })
    }

    /// The prompt's token ids, as the engine runs them.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids.clone()),
            Prompt::Chat(messages) => Ok(self.chat.encode(self.require_tokenizer()?, messages)?),
        }
    }
}

/// The chat format of a `tokenizer_config.json`'s `chat_template` (a string, or Hugging
/// Face's list of named templates, whose `default` counts), when it is one this runtime
/// reproduces.
fn chat_format_of(tokenizer_config: &str) -> Option<ChatFormat> {
    let value: serde_json::Value = serde_json::from_str(tokenizer_config).ok()?;
    let template = match &value["chat_template"] {
        serde_json::Value::String(t) => t.clone(),
        serde_json::Value::Array(named) => {
            named.iter().find(|t| t["name"] == "default")?["template"]
                .as_str()?
                .to_string()
        }
        _ => return None,
    };
    ChatFormat::from_template(&template)
}
