//! The text side of a DiffusionGemma folder: its configuration, positions and tokenizer,
//! read without the weights or a GPU, and Gemma 4's chat layout. The engine encodes its
//! prompts with it; tools that only count or find token ids (`unmask tokenize`, a server's
//! `/tokenize`) stop there.

#[cfg(not(target_arch = "wasm32"))]
use std::path::Path;

use unmask_core::config::DiffusionGemmaConfig;
use unmask_core::tokenizer::Tokenizer;

#[cfg(not(target_arch = "wasm32"))]
use crate::files::DirFiles;
use crate::{EngineError, Message, Prompt};

/// A DiffusionGemma folder's text side.
pub struct DgemmaTextSide {
    pub config: DiffusionGemmaConfig,
    /// Positions the model covers, prompt and canvases together.
    pub positions: usize,
    /// tokenizer.json; `None` without one (token ids only).
    pub tokenizer: Option<Tokenizer>,
    /// Where the files came from (a folder, a URL).
    pub location: String,
}

impl DgemmaTextSide {
    /// The text side of the DiffusionGemma folder `dir`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let mut files = DirFiles::folder(dir)?;
        let small = pollster::block_on(super::read_small_files(&mut files))?;
        Ok(Self {
            config: small.cfg,
            positions: small.positions,
            tokenizer: small.tokenizer,
            location: dir.display().to_string(),
        })
    }

    pub fn require_tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        require(self.tokenizer.as_ref(), &self.location)
    }

    /// The prompt's ids as the engine runs them, and how many of them the system turn takes.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<(Vec<u32>, usize), EngineError> {
        encode_prompt(self.tokenizer.as_ref(), &self.location, prompt)
    }
}

/// The tokenizer, or an error naming the file a text prompt needs.
pub(super) fn require<'a>(
    tokenizer: Option<&'a Tokenizer>,
    location: &str,
) -> Result<&'a Tokenizer, EngineError> {
    tokenizer.ok_or_else(|| EngineError::File {
        location: std::path::Path::new(location)
            .join("tokenizer.json")
            .display()
            .to_string(),
        message: "not found: a text prompt needs it (token ids do not)".into(),
    })
}

/// A prompt's ids (Gemma 4's chat layout for messages) and how many of them the system
/// turn takes (0 without one, and for ids).
pub(super) fn encode_prompt(
    tokenizer: Option<&Tokenizer>,
    location: &str,
    prompt: &Prompt,
) -> Result<(Vec<u32>, usize), EngineError> {
    match prompt {
        Prompt::Ids(ids) => Ok((ids.clone(), 0)),
        Prompt::Chat(messages) => encode_chat(require(tokenizer, location)?, messages),
    }
}

/// A conversation in Gemma 4's chat layout (thinking off), and its system turn's length.
pub fn encode_chat(
    tokenizer: &Tokenizer,
    messages: &[Message],
) -> Result<(Vec<u32>, usize), EngineError> {
    let ids = unmask_core::gemma_chat::encode(tokenizer, messages, false)?;
    let shared = unmask_core::gemma_chat::system_turn_len(tokenizer, messages, false)?;
    Ok((ids, shared))
}
