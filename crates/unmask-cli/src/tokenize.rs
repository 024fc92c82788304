//! `unmask tokenize`: a prompt's token ids exactly as `generate` runs them, each with its
//! text, or the text of ids, for LLaDA, Dream and DiffusionGemma folders. It reads the
//! model folder's text side only (no weights, no GPU), so it answers at once even for an
//! 8B folder: how to find the ids `--logit-bias` names, and how long a prompt is against
//! the context.

use clap::Args;
use serde_json::json;
use unmask::{DgemmaTextSide, EngineError, Message, Prompt, TextSide};
use unmask_core::tokenizer::{DecodeMode, Tokenizer};

use crate::error::CliError;
use crate::options::ModelArgs;
use crate::{output, values};

#[derive(Args, Debug)]
#[command(
    about = "Print a prompt's token ids as generate runs them, or the text of token ids.",
    override_usage = "unmask tokenize [--model <DIR>] (--text <TEXT> | --prompt <TEXT> [--system <TEXT>] | --decode <IDS>) [--json]",
    after_help = "Each token is printed as its id and the text it adds (a JSON string; a special\n\
                  token's name), then the count against the model's context. --text is tokenized as it is (a completion's\n\
                  prompt, a word for --logit-bias: mind its leading space); --prompt goes through\n\
                  the chat template as generate --prompt does. Only config.json and the tokenizer\n\
                  files are read (LLaDA, Dream and DiffusionGemma folders)."
)]
pub struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// text tokenized as it is, without the chat template
    #[arg(long, value_name = "TEXT", conflicts_with_all = ["prompt", "system", "decode"])]
    text: Option<String>,
    /// a user message, rendered with the chat template
    #[arg(long, value_name = "TEXT", conflicts_with = "decode")]
    prompt: Option<String>,
    /// a system message before --prompt
    #[arg(long, value_name = "TEXT", requires = "prompt")]
    system: Option<String>,
    /// token ids to turn back into text, e.g. 1,2,3
    #[arg(long, value_name = "IDS", value_parser = values::token_ids)]
    decode: Option<::std::vec::Vec<u32>>,
    /// print one JSON object instead of lines
    #[arg(long)]
    json: bool,
}

/// The text side of a folder of either kind.
enum Side {
    Masked(TextSide),
    Gemma(DgemmaTextSide),
}

impl Side {
    fn open(dir: &std::path::Path) -> Result<Self, EngineError> {
        Ok(if crate::dgemma::is_diffusion_gemma(dir) {
            Self::Gemma(DgemmaTextSide::open(dir)?)
        } else {
            Self::Masked(TextSide::open(dir)?)
        })
    }

    fn tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        match self {
            Self::Masked(s) => s.require_tokenizer(),
            Self::Gemma(s) => s.require_tokenizer(),
        }
    }

    /// Embedding rows: the ids there are.
    fn vocab(&self) -> usize {
        match self {
            Self::Masked(s) => s.config.embedding_size,
            Self::Gemma(s) => s.config.vocab_size,
        }
    }

    /// Positions the model covers, prompt and answer together.
    fn context(&self) -> usize {
        match self {
            Self::Masked(s) => s.config.max_sequence_length,
            Self::Gemma(s) => s.positions,
        }
    }

    fn encode_chat(&self, messages: Vec<Message>) -> Result<Vec<u32>, EngineError> {
        let prompt = Prompt::Chat(messages);
        match self {
            Self::Masked(s) => s.encode_prompt(&prompt),
            Self::Gemma(s) => Ok(s.encode_prompt(&prompt)?.0),
        }
    }
}

pub fn run(args: &TokenizeArgs) -> Result<(), CliError> {
    let dir = args.model.dir()?;
    let side = Side::open(&dir)?;
    let tokenizer = side.tokenizer()?;
    if let Some(ids) = &args.decode {
        crate::options::check_ids_below(side.vocab(), "decode", ids)?;
        let text = tokenizer.decode(ids, DecodeMode::Raw)?;
        return if args.json {
            output::line(&json!({ "text": text }).to_string())
        } else {
            output::line(&text)
        };
    }
    let ids = match (&args.text, &args.prompt) {
        (Some(text), _) => tokenizer.encode(text)?,
        (None, Some(user)) => {
            let mut messages: Vec<Message> = args.system.iter().map(Message::system).collect();
            messages.push(Message::user(user));
            side.encode_chat(messages)?
        }
        (None, None) => {
            return Err(CliError::usage(
                "tokenize needs --text TEXT, --prompt TEXT or --decode IDS",
            ));
        }
    };
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| match tokenizer.token_bytes(id) {
            Some(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            // A special token adds no text; its name says what it is.
            None => tokenizer.id_to_token(id).unwrap_or_default(),
        })
        .collect();
    let context = side.context();
    if args.json {
        let answer = json!({
            "tokens": ids,
            "texts": pieces,
            "count": ids.len(),
            "max_model_len": context,
        });
        return output::line(&answer.to_string());
    }
    for (id, piece) in ids.iter().zip(&pieces) {
        output::line(&format!("{id}\t{}", json!(piece)))?;
    }
    output::line(&format!(
        "{} tokens (the model's context: {context} positions, prompt and answer together)",
        ids.len()
    ))
}
