//! Errors of `unmask-core`. Every variant says which file or field is at fault, what was
//! expected and what was found, so a user can fix their input without reading the code.

use std::path::PathBuf;

/// A `config.json` (or `generation_config.json`) that cannot be read or describes a model
/// this runtime does not run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file} is not valid JSON: {source}")]
    Json {
        file: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{file}: expected a JSON object at the top level, found {found}")]
    NotAnObject { file: String, found: String },
    #[error("config field `{field}`: expected {expected}, found {found}")]
    WrongType {
        field: &'static str,
        expected: &'static str,
        found: String,
    },
    /// A valid LLaDA option that this runtime has no kernels for.
    #[error(
        "config field `{field}`: unsupported value {found}; this runtime supports only {expected}"
    )]
    Unsupported {
        field: &'static str,
        expected: String,
        found: String,
    },
    /// A value that breaks a numeric constraint (positive, divisible, within a limit).
    #[error("config field `{field}`: expected {expected}, found {found}")]
    Invalid {
        field: &'static str,
        expected: String,
        found: String,
    },
}

/// A tokenizer that cannot be loaded, does not fit the model, or text it cannot process.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {source_name}: {source}")]
    Load {
        source_name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("cannot encode text of {chars} characters: {source}")]
    Encode {
        chars: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("cannot decode {ids} token ids: {source}")]
    Decode {
        ids: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A mismatched tokenizer would make the model read the wrong embedding rows.
    #[error(
        "tokenizer.json gives {token} id {tokenizer_id} but {config_file} field `{config_field}` \
         is {config_id}; expected the same id (use the tokenizer that belongs to this model)"
    )]
    SpecialTokenMismatch {
        token: &'static str,
        /// The file the config's id comes from (config.json, or generation_config.json
        /// for LLaDA's BOS).
        config_file: &'static str,
        config_field: &'static str,
        config_id: u32,
        tokenizer_id: u32,
    },
    #[error(
        "no {role} token: the tokenizer has no {token} and the config gives no `{config_field}`"
    )]
    MissingSpecialToken {
        role: &'static str,
        token: &'static str,
        config_field: &'static str,
    },
    /// The chat template's markup must be single tokens; the Base tokenizer splits them.
    #[error(
        "the chat template needs the special token {token}, which the tokenizer does not have \
         (a LLaDA Base tokenizer lacks the chat tokens; use the Instruct tokenizer)"
    )]
    MissingChatToken { token: &'static str },
    #[error("{template} needs the special token {token}, which tokenizer.json does not have")]
    MissingTemplateToken {
        token: &'static str,
        template: &'static str,
    },
    /// `encode` keeps markup as text; a special id in its output would let text pose as
    /// a token only the template may place.
    #[error(
        "the tokenizer encoded text as the special token {token} (id {id}); only the chat \
         template may emit special tokens"
    )]
    SpecialTokenInText { token: String, id: u32 },
    #[error("chat: expected at least one message, found none")]
    NoMessages,
    #[error("chat: expected at least one user message, found roles [{roles}]")]
    NoUserTurn { roles: String },
}

/// Generation parameters that the reference sampler would reject or that do not fit the
/// model, and predictions that do not match what the sampler asked for.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplerError {
    #[error("gen_length: expected at least 1, found 0")]
    ZeroGenLength,
    #[error("block_length: expected at least 1, found 0")]
    ZeroBlockLength,
    #[error("gen_length {gen_length} is not a multiple of block_length {block_length}")]
    GenNotMultipleOfBlock {
        gen_length: usize,
        block_length: usize,
    },
    #[error("steps: expected at least one per block ({num_blocks} blocks), found {steps}")]
    TooFewSteps { steps: usize, num_blocks: usize },
    #[error("steps {steps} is not a multiple of the number of blocks {num_blocks}")]
    StepsNotMultipleOfBlocks { steps: usize, num_blocks: usize },
    #[error("threshold: expected a value in (0, 1], found {threshold}")]
    ThresholdOutOfRange { threshold: f32 },
    #[error("temperature: expected a finite value >= 0, found {temperature}")]
    BadTemperature { temperature: f32 },
    #[error("cfg_scale: expected a finite value >= 0, found {cfg_scale}")]
    BadCfgScale { cfg_scale: f32 },
    #[error("prompt: expected at least one token, found none")]
    EmptyPrompt,
    #[error(
        "prompt ({prompt_len} tokens) + gen_length ({gen_length}){} = {total} exceeds the \
         model's maximum sequence length {max_len}",
        suffix_term(*suffix_len)
    )]
    TooLong {
        prompt_len: usize,
        gen_length: usize,
        /// Tokens of an infilling suffix (0 without one).
        suffix_len: usize,
        total: usize,
        max_len: usize,
    },
    #[error(
        "suffix: expected no mask token (the canvas before it is what is predicted), found \
         one at suffix position {position}"
    )]
    MaskInSuffix { position: usize },
    #[error("commit: expected {expected} predictions (one per requested row), found {found}")]
    PredictionCount { expected: usize, found: usize },
    #[error("commit: expected as many confidences as tokens ({tokens}), found {confidences}")]
    ConfidenceCount { tokens: usize, confidences: usize },
    #[error("commit: generation is already finished")]
    Finished,
    #[error("eps: expected a value in (0, 1) for Dream's timestep schedule, found {eps}")]
    BadEps { eps: f64 },
    #[error("alg_temp: expected a finite value >= 0, found {alg_temp}")]
    BadAlgTemp { alg_temp: f32 },
    #[error("top_p: expected a value in (0, 1], found {top_p}")]
    BadTopP { top_p: f32 },
    #[error("top_k: expected at least 1, found 0")]
    ZeroTopK,
    #[error(
        "top_p / top_k / min_p with cfg_scale > 0: the cut is not implemented over guided logits; drop one of them"
    )]
    CutWithCfg,
    #[error(
        "steps: Dream's block schedule needs at least 2 steps per block (the first commits \
         the block's first position), found {steps} for {num_blocks} blocks"
    )]
    TooFewDreamSteps { steps: usize, num_blocks: usize },
    #[error(
        "remasking: threshold decoding ranks by the token's probability (low_confidence / \
         maskgit_plus), found {remasking}"
    )]
    ThresholdNeedsProbability { remasking: &'static str },
    #[error("logit_bias: expected {expected}, found {found}")]
    BadLogitBias { expected: String, found: String },
    #[error(
        "threshold decoding: every one of the {rows} masked positions left was predicted as the \
         mask token, so no step can fill them (the model cannot complete this canvas)"
    )]
    OnlyMaskPredicted { rows: usize },
    #[error("{field}: expected a value from -2 to 2, found {value}")]
    BadPenalty { field: &'static str, value: f32 },
    #[error("repetition_penalty: expected a value from 0.01 to 100 (1: none), found {value}")]
    BadRepetitionPenalty { value: f32 },
    #[error("min_p: expected a value from 0 to 1, found {min_p}")]
    BadMinP { min_p: f32 },
    #[error(
        "repetition_penalty with cfg_scale > 0: the penalty is not defined over guided logits; drop one of them"
    )]
    RepetitionWithCfg,
}

/// The suffix's term of a length sum, when there is one.
fn suffix_term(suffix_len: usize) -> String {
    if suffix_len == 0 {
        String::new()
    } else {
        format!(" + suffix ({suffix_len} tokens)")
    }
}
