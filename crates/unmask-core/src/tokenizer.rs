//! The model's tokenizer: a Hugging Face `tokenizer.json` loaded with the `tokenizers`
//! crate, encoding without automatically added special tokens (as the LLaDA scripts do)
//! and decoding the way a user wants to read the answer.

use std::path::Path;

use tokenizers::DecoderWrapper;

use crate::config::ModelConfig;
use crate::error::TokenizerError;

/// Token strings of LLaDA's special tokens.
pub const MASK_TOKEN: &str = "<|mdm_mask|>";
pub const EOS_TOKEN: &str = "<|endoftext|>";
pub const BOS_TOKEN: &str = "<|startoftext|>";
pub const EOT_TOKEN: &str = "<|eot_id|>";
pub const START_HEADER_TOKEN: &str = "<|start_header_id|>";
pub const END_HEADER_TOKEN: &str = "<|end_header_id|>";
/// Dream's mask token.
pub const DREAM_MASK_TOKEN: &str = "<|mask|>";

/// How generated ids become text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeMode {
    /// The answer only: text up to the first end-of-turn or end-of-text token, without
    /// special tokens.
    Clean,
    /// The reference's `batch_decode(skip_special_tokens=True)` over every id, which keeps
    /// any ordinary text after an end-of-turn token.
    Raw,
}

/// Ids of the special tokens the runtime uses, checked against the model config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    pub mask: u32,
    pub eos: u32,
    pub bos: u32,
    pub eot: Option<u32>,
    pub start_header: Option<u32>,
    pub end_header: Option<u32>,
}

impl SpecialTokens {
    /// The ids a model without `tokenizer.json` uses: mask and EOS from the config, BOS
    /// from `generation_config.json` (else EOS); no chat-template tokens.
    pub fn from_config(config: &ModelConfig) -> Self {
        Self {
            mask: config.mask_token_id,
            eos: config.eos_token_id,
            bos: config.bos_token_id.unwrap_or(config.eos_token_id),
            eot: None,
            start_header: None,
            end_header: None,
        }
    }

    /// Ids from the tokenizer when there is one, else from the config.
    pub fn resolve(
        tokenizer: Option<&Tokenizer>,
        config: &ModelConfig,
    ) -> Result<Self, TokenizerError> {
        match tokenizer {
            Some(t) => t.special_tokens(config),
            None => Ok(Self::from_config(config)),
        }
    }
}

/// Token strings the runtime gives a role: the mask, the text and turn boundaries, the
/// chat markup. User text must never become one of them (it would forge a turn, or a mask
/// to infill), whatever the tokenizer's `special` flag says of them: they are made special
/// before the tokenizer is built, so that encoding keeps their markup as text.
const ROLE_TOKENS: [&str; 9] = [
    MASK_TOKEN,
    EOS_TOKEN,
    BOS_TOKEN,
    EOT_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    DREAM_MASK_TOKEN,
    crate::chat::IM_START_TOKEN,
    crate::chat::IM_END_TOKEN,
];

/// Builds a tokenizer from the text of a `tokenizer.json`, in two steps: the text to a JSON
/// value, then the value to a tokenizer. `tokenizers` 0.23 deserializing the text itself
/// panics (`expect("Helper")` in its decoder's deserializer) when the `decoder` value is not
/// well-formed JSON; parsed first, every syntax error comes back as an error, and the
/// decoder's deserializer only ever sees a well-formed value.
fn parse_json(bytes: &[u8]) -> Result<tokenizers::Tokenizer, tokenizers::Error> {
    let mut value: serde_json::Value = serde_json::from_slice(bytes)?;
    if let Some(model) = value.get("model") {
        check_bpe_merges(model)?;
    }
    let declared = declared_added_tokens(&mut value)?;
    let inner: tokenizers::Tokenizer = serde_json::from_value(value)?;
    // `tokenizers` gives an added token the next free id when its declared one is not
    // (a gap after the vocabulary, a clash), and only logs a warning: the model would then
    // read another embedding row than the file says. Refused instead, by name.
    for (at, id, content) in declared {
        let given = inner.token_to_id(&content);
        if given != Some(id) {
            return Err(format!(
                "added_tokens[{at}] {content:?}: declared with id {id}, but the tokenizer \
                 gives it {} (an added token keeps its id only when it is the vocabulary's \
                 next free one, or the vocabulary's own id for that string); expected the \
                 ids the model was trained with",
                given.map_or("no id".to_string(), |g| format!("id {g}"))
            )
            .into());
        }
    }
    Ok(inner)
}

/// The (index, id, content) of each entry of `added_tokens`, with the runtime's role tokens
/// marked special (`ROLE_TOKENS`). Entries without a whole-number id or a string content
/// are left for `tokenizers` to refuse.
fn declared_added_tokens(
    value: &mut serde_json::Value,
) -> Result<Vec<(usize, u32, String)>, String> {
    let Some(serde_json::Value::Array(tokens)) = value.get_mut("added_tokens") else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(tokens.len());
    for (at, token) in tokens.iter_mut().enumerate() {
        let (Some(id), Some(content)) = (
            token.get("id").and_then(serde_json::Value::as_u64),
            token.get("content").and_then(serde_json::Value::as_str),
        ) else {
            continue;
        };
        let id = u32::try_from(id).map_err(|_| {
            format!("added_tokens[{at}] {content:?}: expected an id below 2^32, found {id}")
        })?;
        let content = content.to_string();
        if ROLE_TOKENS.contains(&content.as_str())
            && let Some(obj) = token.as_object_mut()
        {
            obj.insert("special".into(), serde_json::Value::Bool(true));
        }
        out.push((at, id, content));
    }
    Ok(out)
}

/// Refuses the BPE merges `tokenizers` 0.23 cannot build without panicking. It writes each
/// merge's first token and its second, less the continuing-subword prefix cut off by byte
/// count, into a buffer as long as the longest vocabulary entry: a concatenation longer
/// than every entry panics (slice out of range), and a second token that does not start
/// with the prefix is cut wherever the byte count falls, possibly inside a character (the
/// result is then made a `&str` unchecked). Neither merge can be valid, since its result
/// must be in the vocabulary; the error names the merge. Merges whose tokens are not in the
/// vocabulary are left to `tokenizers`, which reports them.
fn check_bpe_merges(model: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value;
    // Untagged models are tried as BPE first; other types ignore `merges`.
    if model.get("type").is_some_and(|t| t != "BPE") {
        return Ok(());
    }
    let (Some(Value::Object(vocab)), Some(Value::Array(merges))) =
        (model.get("vocab"), model.get("merges"))
    else {
        return Ok(());
    };
    let prefix = model
        .get("continuing_subword_prefix")
        .and_then(Value::as_str)
        .unwrap_or("");
    for (at, merge) in merges.iter().enumerate() {
        // Legacy merges are "a b" lines, where `tokenizers` skips "#version" lines; a merge
        // of another shape is an error `tokenizers` reports.
        let (a, b) = match merge {
            Value::String(line) if !line.starts_with("#version") => match line.split_once(' ') {
                Some(pair) => pair,
                None => continue,
            },
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                _ => continue,
            },
            _ => continue,
        };
        if !vocab.contains_key(a) || !vocab.contains_key(b) {
            continue;
        }
        let Some(rest) = b.strip_prefix(prefix) else {
            return Err(format!(
                "model.merges[{at}] = ({a:?}, {b:?}): expected the second token to start \
                 with the continuing_subword_prefix {prefix:?}"
            ));
        };
        let merged = format!("{a}{rest}");
        if !vocab.contains_key(&merged) {
            return Err(format!(
                "model.merges[{at}] = ({a:?}, {b:?}): expected the merged token {merged:?} \
                 in model.vocab, found no such entry"
            ));
        }
    }
    Ok(())
}

/// A loaded `tokenizer.json`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Decoding in `DecodeMode::Clean` stops at these ids.
    stop_ids: Vec<u32>,
    /// Ids of the added tokens marked special, of the role tokens (`ROLE_TOKENS`) and of
    /// the ids the model's config gives a role (`reserve`); `encode` never returns one.
    special_ids: std::collections::HashSet<u32>,
    /// Its decoder maps characters back to bytes (GPT-2's byte-level scheme).
    byte_level: bool,
}

/// Whether byte `b` stands for itself in GPT-2's byte-level alphabet (printable Latin-1).
fn byte_is_printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The byte a character of a byte-level token stands for: a printable byte is its own
/// character; the other 68 bytes, in increasing order, are the characters from U+0100 on.
fn byte_of_char(c: char) -> Option<u8> {
    let code = c as u32;
    if code < 256 {
        return Some(code as u8).filter(|&b| byte_is_printable(b));
    }
    let k = code.checked_sub(256)? as usize;
    (0..=255u8).filter(|&b| !byte_is_printable(b)).nth(k)
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

impl Tokenizer {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        // Regular files only (a FIFO would block `read` forever), within the size bound.
        let inner = crate::small_files::read(path)
            .map_err(Into::into)
            .and_then(|bytes| parse_json(&bytes))
            .map_err(|source| TokenizerError::Load {
                source_name: path.display().to_string(),
                source,
            })?;
        Ok(Self::wrap(inner))
    }

    /// Loads the contents of a `tokenizer.json` (for the browser, where there are no files).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TokenizerError> {
        let inner = crate::small_files::check_len("tokenizer.json", bytes.len() as u64)
            .map_err(Into::into)
            .and_then(|()| parse_json(bytes))
            .map_err(|source| TokenizerError::Load {
                source_name: format!("tokenizer.json ({} bytes)", bytes.len()),
                source,
            })?;
        Ok(Self::wrap(inner))
    }

    fn wrap(mut inner: tokenizers::Tokenizer) -> Self {
        // Text is always encoded as text: markup such as `<|eot_id|>` typed by a user must
        // not become the special token (it would forge a turn, or a mask to infill). Only
        // the chat template places special tokens, by id.
        inner.set_encode_special_tokens(true);
        let stop_ids = [EOT_TOKEN, EOS_TOKEN]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        let mut special_ids: std::collections::HashSet<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        special_ids.extend(ROLE_TOKENS.iter().filter_map(|t| inner.token_to_id(t)));
        let byte_level = match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => true,
            Some(DecoderWrapper::Sequence(s)) => s
                .get_decoders()
                .iter()
                .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
            _ => false,
        };
        Self {
            inner,
            stop_ids,
            special_ids,
            byte_level,
        }
    }

    /// Token ids of `text`, with no special tokens added around it. Special-token markup
    /// inside the text (`<|eot_id|>`, `<|mdm_mask|>`, ...) is encoded as the plain text it
    /// is, never as the special token: no id this returns is a special token's.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.inner
                .encode_fast(text, false)
                .map_err(|source| TokenizerError::Encode {
                    chars: text.chars().count(),
                    source,
                })?;
        let ids = encoding.get_ids();
        // The tokenizer's own promise, checked: a vocabulary whose merges spell a special
        // token would otherwise let text through as one.
        if let Some(&id) = ids.iter().find(|id| self.special_ids.contains(id)) {
            return Err(TokenizerError::SpecialTokenInText {
                token: self.id_to_token(id).unwrap_or_default(),
                id,
            });
        }
        Ok(ids.to_vec())
    }

    /// Makes the ids of `special` (mask, EOS, BOS, turn markup, from the tokenizer or the
    /// config) ids that `encode` never returns, whatever token string they have.
    pub fn reserve(&mut self, special: &SpecialTokens) {
        let SpecialTokens {
            mask,
            eos,
            bos,
            eot,
            start_header,
            end_header,
        } = *special;
        self.special_ids.extend([mask, eos, bos]);
        self.special_ids
            .extend([eot, start_header, end_header].into_iter().flatten());
    }

    /// Whether `id` is one of the tokenizer's special tokens (BOS, EOS, mask, chat markup,
    /// reserved ids).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Text of `ids`. Special tokens are left out in both modes. Ids the tokenizer does not
    /// know (embedding rows past its vocabulary, which the model can still predict) decode
    /// to nothing.
    pub fn decode(&self, ids: &[u32], mode: DecodeMode) -> Result<String, TokenizerError> {
        let end = match mode {
            DecodeMode::Clean => ids
                .iter()
                .position(|id| self.stop_ids.contains(id))
                .unwrap_or(ids.len()),
            DecodeMode::Raw => ids.len(),
        };
        let known: Vec<u32> = ids[..end]
            .iter()
            .copied()
            .filter(|&id| self.inner.id_to_token(id).is_some())
            .collect();
        self.inner
            .decode(&known, true)
            .map_err(|source| TokenizerError::Decode {
                ids: known.len(),
                source,
            })
    }

    /// The bytes token `id` adds to decoded text, which may end inside a character: a
    /// byte-level token's characters mapped back to bytes, a byte-fallback token `<0xNN>`
    /// as its byte, any other token decoded alone. `None` for special tokens and ids the
    /// tokenizer does not know (they add nothing to the text).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if self.is_special(id) {
            return None;
        }
        let token = self.inner.id_to_token(id)?;
        if self.byte_level {
            // Every character of a byte-level token stands for one byte.
            if let Some(bytes) = token.chars().map(byte_of_char).collect::<Option<Vec<u8>>>() {
                return Some(bytes);
            }
        }
        if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
            && hex.len() == 2
            && let Ok(byte) = u8::from_str_radix(hex, 16)
        {
            return Some(vec![byte]);
        }
        self.inner.decode(&[id], true).ok().map(String::into_bytes)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids the tokenizer defines, added special tokens included. The model's
    /// embedding may have more rows than this.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The special tokens, looked up by the family's token strings (`FamilySpec`). Where
    /// the config also names an id (mask, EOS, BOS), the two must agree: a disagreement
    /// means the tokenizer belongs to another model. A token the tokenizer lacks falls back
    /// to the config's id.
    pub fn special_tokens(&self, config: &ModelConfig) -> Result<SpecialTokens, TokenizerError> {
        let names = &config.family.spec().special_tokens;
        let mask = self.agreeing_id(
            "mask",
            names.mask,
            "mask_token_id",
            Some(config.mask_token_id),
        )?;
        let eos = self.agreeing_id("EOS", names.eos, "eos_token_id", Some(config.eos_token_id))?;
        let bos = match names.bos {
            Some(token) => self.agreeing_id("BOS", token, "bos_token_id", config.bos_token_id)?,
            None => config.bos_token_id.unwrap_or(config.eos_token_id),
        };
        Ok(SpecialTokens {
            mask,
            eos,
            bos,
            eot: self.token_to_id(names.eot),
            start_header: names.headers.and_then(|(start, _)| self.token_to_id(start)),
            end_header: names.headers.and_then(|(_, end)| self.token_to_id(end)),
        })
    }

    fn agreeing_id(
        &self,
        role: &'static str,
        token: &'static str,
        config_field: &'static str,
        config_id: Option<u32>,
    ) -> Result<u32, TokenizerError> {
        match (self.token_to_id(token), config_id) {
            (Some(tokenizer_id), Some(config_id)) if tokenizer_id != config_id => {
                Err(TokenizerError::SpecialTokenMismatch {
                    token,
                    config_file: if config_field == "bos_token_id" {
                        "config.json (or generation_config.json)"
                    } else {
                        "config.json"
                    },
                    config_field,
                    config_id,
                    tokenizer_id,
                })
            }
            (Some(id), _) | (None, Some(id)) => Ok(id),
            (None, None) => Err(TokenizerError::MissingSpecialToken {
                role,
                token,
                config_field,
            }),
        }
    }
}
