//! The LLaDA model configuration (`config.json`), read the way the reference
//! `LLaDAConfig` reads it: start from the `ModelConfig` defaults and overwrite them with
//! the file's keys. Unknown keys are ignored; options this runtime has no kernels for are
//! rejected with an error that names the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::ConfigError;

/// Largest head dimension the attention kernel supports.
pub const MAX_HEAD_DIM: usize = 128;

/// LLaDA-8B-Instruct's `config.json` byte for byte (Base and 1.5 share it, llada.md §1):
/// Python's `json.dumps(indent=2)` of the reference keys, with no final newline, which
/// reproduces the SHA-256 (5f99fefe…) that checkpoint checkers pin.
pub const LLADA_8B_CONFIG_JSON: &str = r#"{
  "activation_type": "silu",
  "alibi": false,
  "alibi_bias_max": 8.0,
  "architectures": [
    "LLaDAModelLM"
  ],
  "attention_dropout": 0.0,
  "attention_layer_norm": false,
  "attention_layer_norm_with_affine": true,
  "auto_map": {
    "AutoConfig": "configuration_llada.LLaDAConfig",
    "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
    "AutoModel": "modeling_llada.LLaDAModelLM"
  },
  "bias_for_layer_norm": false,
  "block_group_size": 1,
  "block_type": "llama",
  "d_model": 4096,
  "embedding_dropout": 0.0,
  "embedding_size": 126464,
  "eos_token_id": 126081,
  "flash_attention": false,
  "include_bias": false,
  "include_qkv_bias": false,
  "init_cutoff_factor": null,
  "init_device": "meta",
  "init_fn": "mitchell",
  "init_std": 0.02,
  "input_emb_norm": false,
  "layer_norm_type": "rms",
  "layer_norm_with_affine": true,
  "mask_token_id": 126336,
  "max_sequence_length": 4096,
  "mlp_hidden_size": 12288,
  "mlp_ratio": 4,
  "model_type": "llada",
  "multi_query_attention": null,
  "n_heads": 32,
  "n_kv_heads": 32,
  "n_layers": 32,
  "pad_token_id": 126081,
  "precision": "amp_bf16",
  "residual_dropout": 0.0,
  "rms_norm_eps": 1e-05,
  "rope": true,
  "rope_full_precision": true,
  "rope_theta": 500000.0,
  "scale_logits": false,
  "transformers_version": "4.46.3",
  "use_cache": false,
  "vocab_size": 126464,
  "weight_tying": false
}"#;

/// LLaDA-8B's `generation_config.json` (llada.md §1): the BOS id lives only here.
const LLADA_8B_GENERATION_CONFIG_JSON: &str = r#"{
  "_from_model_config": true,
  "bos_token_id": 126080,
  "eos_token_id": 126081,
  "transformers_version": "4.38.2"
}
"#;

/// The files that define a named model's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresetFiles {
    pub config_json: String,
    pub generation_config_json: String,
}

/// Defaults of the reference `ModelConfig` dataclass. Several are dangerous for LLaDA
/// (`rope = false`, `weight_tying = true`, `embedding_size = 50304`, `block_type =
/// "sequential"`, ...), but a hand-written config that leaves a key out means exactly these.
mod defaults {
    pub const D_MODEL: u64 = 768;
    pub const N_HEADS: u64 = 12;
    pub const N_LAYERS: u64 = 12;
    pub const MLP_RATIO: u64 = 4;
    pub const ACTIVATION_TYPE: &str = "swiglu";
    pub const BLOCK_TYPE: &str = "sequential";
    pub const ALIBI: bool = false;
    pub const ROPE: bool = false;
    pub const ROPE_FULL_PRECISION: bool = true;
    pub const ATTENTION_LAYER_NORM: bool = false;
    pub const INPUT_EMB_NORM: bool = false;
    pub const LAYER_NORM_TYPE: &str = "default";
    pub const LAYER_NORM_WITH_AFFINE: bool = true;
    pub const RMS_NORM_EPS: f64 = 1e-5;
    pub const MAX_SEQUENCE_LENGTH: u64 = 1024;
    pub const ROPE_THETA: f64 = 10000.0;
    pub const INCLUDE_QKV_BIAS: bool = false;
    pub const INCLUDE_BIAS: bool = false;
    pub const SCALE_LOGITS: bool = false;
    pub const VOCAB_SIZE: u64 = 50257;
    pub const EMBEDDING_SIZE: u64 = 50304;
    pub const WEIGHT_TYING: bool = true;
    pub const EOS_TOKEN_ID: u64 = 50256;
    pub const PAD_TOKEN_ID: u64 = 50256;
    pub const MASK_TOKEN_ID: u64 = 50256;
}

/// Bounds on a config's sizes, checked before anything is allocated from them: far above
/// any published model (LLaDA-8B's value in each comment) and far below what overflows a
/// size computation or asks the allocator for terabytes.
pub mod limits {
    /// 32.
    pub const MAX_LAYERS: usize = 1024;
    /// 4096.
    pub const MAX_D_MODEL: usize = 1 << 17;
    /// 32.
    pub const MAX_HEADS: usize = 1024;
    /// 12288.
    pub const MAX_MLP_HIDDEN: usize = 1 << 20;
    /// 126464 (vocab_size and embedding_size).
    pub const MAX_VOCAB: usize = 1 << 24;
    /// 4096.
    pub const MAX_SEQUENCE_LENGTH: usize = 1 << 20;
    /// About 8.0e9.
    pub const MAX_PARAMETERS: u64 = 1 << 40;
}

/// What the runtime needs to know about a LLaDA model, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct LladaConfig {
    pub d_model: usize,
    pub n_heads: usize,
    /// Key/value heads; `n_heads` for plain multi-head attention, fewer for GQA.
    pub n_kv_heads: usize,
    pub n_layers: usize,
    /// Width of the SwiGLU MLP (gate and up projections).
    pub mlp_hidden_size: usize,
    /// Size of the tokenizer's vocabulary as the model was trained with it.
    pub vocab_size: usize,
    /// Rows of the embedding and of the LM head; the number of logits per position.
    pub embedding_size: usize,
    pub max_sequence_length: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    /// The LM head reuses the embedding matrix (no `model.transformer.ff_out.weight`).
    pub weight_tying: bool,
    pub mask_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    /// From `generation_config.json` when present (LLaDA's config.json has no BOS).
    pub bos_token_id: Option<u32>,
}

impl LladaConfig {
    /// Reads `config.json` (or `<dir>/config.json` when given a directory), and
    /// `generation_config.json` beside it when that file exists.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let config_path = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        // A FIFO named config.json would block `read` forever: only regular files are read.
        #[cfg(not(target_arch = "wasm32"))]
        crate::checkpoint::require_regular_file(&config_path).map_err(|e| ConfigError::Io {
            path: config_path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
        })?;
        let text = std::fs::read_to_string(&config_path).map_err(|source| ConfigError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config = Self::parse(&text, &config_path.display().to_string())?;
        let generation_path = config_path.with_file_name("generation_config.json");
        if !generation_path.is_file() {
            return Ok(config);
        }
        let text = std::fs::read_to_string(&generation_path).map_err(|source| ConfigError::Io {
            path: generation_path.clone(),
            source,
        })?;
        config.with_generation_config(&text, &generation_path.display().to_string())
    }

    /// Takes the BOS id from the text of a `generation_config.json` (named `file` in errors)
    /// when it has one.
    pub fn with_generation_config(mut self, text: &str, file: &str) -> Result<Self, ConfigError> {
        let map = parse_object(text, file)?;
        let fields = Fields { map: &map };
        if let Some(bos) = fields.opt_token_id("generation_config.bos_token_id", "bos_token_id")? {
            check_token_in_range("generation_config.bos_token_id", bos, self.embedding_size)?;
            self.bos_token_id = Some(bos);
        }
        Ok(self)
    }

    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, "config.json")
    }

    /// Names accepted by [`LladaConfig::preset`].
    pub const PRESETS: [&str; 2] = ["llada-8b", "tiny"];

    /// The config of a named model: `llada-8b` (LLaDA-8B-Instruct; Base and 1.5 share it)
    /// or `tiny` (the same keys at test size, the shapes of tests/fixtures/tiny), with the
    /// BOS id of its generation_config.json. None for other names.
    pub fn preset(name: &str) -> Option<Self> {
        let files = Self::preset_files(name)?;
        let mut config = Self::from_json_str(&files.config_json).expect("presets are valid");
        let generation: Value =
            serde_json::from_str(&files.generation_config_json).expect("presets are JSON");
        config.bos_token_id = generation["bos_token_id"].as_u64().map(|id| id as u32);
        Some(config)
    }

    /// The `config.json` and `generation_config.json` texts of a named model; `llada-8b`'s
    /// are the published files.
    pub fn preset_files(name: &str) -> Option<PresetFiles> {
        match name {
            "llada-8b" => Some(PresetFiles {
                config_json: LLADA_8B_CONFIG_JSON.to_string(),
                generation_config_json: LLADA_8B_GENERATION_CONFIG_JSON.to_string(),
            }),
            "tiny" => {
                let mut value: Value =
                    serde_json::from_str(LLADA_8B_CONFIG_JSON).expect("the preset is JSON");
                let map = value.as_object_mut().expect("the preset is an object");
                for (key, v) in [
                    ("d_model", 64),
                    ("n_heads", 4),
                    ("n_kv_heads", 2),
                    ("n_layers", 2),
                    ("mlp_hidden_size", 96),
                    ("vocab_size", 320),
                    ("embedding_size", 320),
                    ("max_sequence_length", 256),
                    ("mask_token_id", 305),
                    ("eos_token_id", 301),
                    ("pad_token_id", 301),
                ] {
                    map.insert(key.to_string(), Value::from(v));
                }
                let generation = serde_json::json!({
                    "_from_model_config": true,
                    "bos_token_id": 300,
                    "eos_token_id": 301,
                });
                // Indented like Hugging Face's files.
                let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON") + "\n";
                Some(PresetFiles {
                    config_json: pretty(&value),
                    generation_config_json: pretty(&generation),
                })
            }
            _ => None,
        }
    }

    /// Parses an already-decoded `config.json`.
    pub fn from_json_value(value: &Value) -> Result<Self, ConfigError> {
        match value {
            Value::Object(map) => Self::from_map(map),
            other => Err(ConfigError::NotAnObject {
                file: "config.json".into(),
                found: json_kind(other).into(),
            }),
        }
    }

    fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::from_map(&parse_object(text, file)?)
    }

    fn from_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let f = Fields { map };

        if let Some(model_type) = f.opt_str("model_type")? {
            require_str("model_type", &model_type, "llada")?;
        }
        require_str(
            "block_type",
            &f.str_or("block_type", defaults::BLOCK_TYPE)?,
            "llama",
        )?;
        require_str(
            "activation_type",
            &f.str_or("activation_type", defaults::ACTIVATION_TYPE)?,
            "silu",
        )?;
        require_str(
            "layer_norm_type",
            &f.str_or("layer_norm_type", defaults::LAYER_NORM_TYPE)?,
            "rms",
        )?;
        require_bool("alibi", f.bool_or("alibi", defaults::ALIBI)?, false)?;
        require_bool("rope", f.bool_or("rope", defaults::ROPE)?, true)?;
        // Half-precision RoPE would change the numerics the kernels are tested against.
        require_bool(
            "rope_full_precision",
            f.bool_or("rope_full_precision", defaults::ROPE_FULL_PRECISION)?,
            true,
        )?;
        let include_bias = f.bool_or("include_bias", defaults::INCLUDE_BIAS)?;
        require_bool("include_bias", include_bias, false)?;
        require_bool(
            "include_qkv_bias",
            f.opt_bool("include_qkv_bias")?
                .unwrap_or(defaults::INCLUDE_QKV_BIAS),
            false,
        )?;
        // The reference makes a null `bias_for_layer_norm` inherit `include_bias`.
        require_bool(
            "bias_for_layer_norm",
            f.opt_bool("bias_for_layer_norm")?.unwrap_or(include_bias),
            false,
        )?;
        require_bool(
            "attention_layer_norm",
            f.bool_or("attention_layer_norm", defaults::ATTENTION_LAYER_NORM)?,
            false,
        )?;
        require_bool(
            "layer_norm_with_affine",
            f.bool_or("layer_norm_with_affine", defaults::LAYER_NORM_WITH_AFFINE)?,
            true,
        )?;
        require_bool(
            "input_emb_norm",
            f.bool_or("input_emb_norm", defaults::INPUT_EMB_NORM)?,
            false,
        )?;
        require_bool(
            "scale_logits",
            f.bool_or("scale_logits", defaults::SCALE_LOGITS)?,
            false,
        )?;

        let d_model = f.size_or("d_model", defaults::D_MODEL)?;
        let n_heads = f.size_or("n_heads", defaults::N_HEADS)?;
        let n_layers = f.size_or("n_layers", defaults::N_LAYERS)?;
        let n_kv_heads = effective_n_kv_heads(&f, n_heads)?;
        let mlp_hidden_size = match f.opt_size("mlp_hidden_size")? {
            Some(size) => size,
            None => {
                let ratio = f.size_or("mlp_ratio", defaults::MLP_RATIO)?;
                ratio
                    .checked_mul(d_model)
                    .ok_or_else(|| ConfigError::Invalid {
                        field: "mlp_ratio",
                        expected: "mlp_ratio * d_model to fit in memory sizes".into(),
                        found: format!("{ratio} * {d_model}"),
                    })?
            }
        };
        let vocab_size = f.size_or("vocab_size", defaults::VOCAB_SIZE)?;
        // Missing means the dataclass default; an explicit null means "same as vocab_size".
        let embedding_size = match f.map.get("embedding_size") {
            None => defaults::EMBEDDING_SIZE as usize,
            Some(Value::Null) => vocab_size,
            Some(_) => f.size_or("embedding_size", defaults::EMBEDDING_SIZE)?,
        };
        let max_sequence_length =
            f.size_or("max_sequence_length", defaults::MAX_SEQUENCE_LENGTH)?;
        let rope_theta = f.positive_float_or("rope_theta", defaults::ROPE_THETA)?;
        let rms_norm_eps = f.positive_float_or("rms_norm_eps", defaults::RMS_NORM_EPS)?;
        let weight_tying = f.bool_or("weight_tying", defaults::WEIGHT_TYING)?;

        for (field, value, max) in [
            ("d_model", d_model, limits::MAX_D_MODEL),
            ("n_heads", n_heads, limits::MAX_HEADS),
            ("n_layers", n_layers, limits::MAX_LAYERS),
            ("mlp_hidden_size", mlp_hidden_size, limits::MAX_MLP_HIDDEN),
            ("vocab_size", vocab_size, limits::MAX_VOCAB),
            ("embedding_size", embedding_size, limits::MAX_VOCAB),
            (
                "max_sequence_length",
                max_sequence_length,
                limits::MAX_SEQUENCE_LENGTH,
            ),
        ] {
            if value > max {
                return Err(ConfigError::Invalid {
                    field,
                    expected: format!("at most {max} (the runtime's bound on this size)"),
                    found: value.to_string(),
                });
            }
        }
        if !d_model.is_multiple_of(n_heads) {
            return Err(ConfigError::Invalid {
                field: "d_model",
                expected: format!("a multiple of n_heads ({n_heads})"),
                found: d_model.to_string(),
            });
        }
        let head_dim = d_model / n_heads;
        if head_dim > MAX_HEAD_DIM {
            return Err(ConfigError::Invalid {
                field: "d_model",
                expected: format!(
                    "head_dim = d_model / n_heads <= {MAX_HEAD_DIM} (the attention kernel's limit)"
                ),
                found: format!("{d_model} / {n_heads} = {head_dim}"),
            });
        }
        // rotate_half pairs dimension d with d + head_dim/2.
        if !head_dim.is_multiple_of(2) {
            return Err(ConfigError::Invalid {
                field: "d_model",
                expected: "an even head_dim = d_model / n_heads (RoPE rotates pairs)".into(),
                found: format!("{d_model} / {n_heads} = {head_dim}"),
            });
        }
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(ConfigError::Invalid {
                field: "n_kv_heads",
                expected: format!("a divisor of n_heads ({n_heads})"),
                found: n_kv_heads.to_string(),
            });
        }
        if vocab_size > embedding_size {
            return Err(ConfigError::Invalid {
                field: "vocab_size",
                expected: format!("at most embedding_size ({embedding_size})"),
                found: vocab_size.to_string(),
            });
        }

        let mask_token_id = match f.opt_token_id("mask_token_id", "mask_token_id")? {
            Some(id) => id,
            None if f.map.contains_key("mask_token_id") => {
                return Err(ConfigError::WrongType {
                    field: "mask_token_id",
                    expected: "a token id (the runtime needs a mask token)",
                    found: "null".into(),
                });
            }
            None => defaults::MASK_TOKEN_ID as u32,
        };
        let eos_token_id = f.token_id_or("eos_token_id", defaults::EOS_TOKEN_ID)?;
        let pad_token_id = f.token_id_or("pad_token_id", defaults::PAD_TOKEN_ID)?;
        let bos_token_id = f.opt_token_id("bos_token_id", "bos_token_id")?;
        check_token_in_range("mask_token_id", mask_token_id, embedding_size)?;
        check_token_in_range("eos_token_id", eos_token_id, embedding_size)?;
        check_token_in_range("pad_token_id", pad_token_id, embedding_size)?;
        if let Some(bos) = bos_token_id {
            check_token_in_range("bos_token_id", bos, embedding_size)?;
        }

        let config = Self {
            d_model,
            n_heads,
            n_kv_heads,
            n_layers,
            mlp_hidden_size,
            vocab_size,
            embedding_size,
            max_sequence_length,
            rope_theta,
            rms_norm_eps,
            weight_tying,
            mask_token_id,
            eos_token_id,
            pad_token_id,
            bos_token_id,
        };
        // Each size within its bound, the product still can be beyond any machine.
        let parameters = config.parameter_count();
        if parameters > limits::MAX_PARAMETERS {
            return Err(ConfigError::Invalid {
                field: "n_layers",
                expected: format!(
                    "a model of at most {} parameters (the runtime's bound)",
                    limits::MAX_PARAMETERS
                ),
                found: format!(
                    "{parameters} parameters from d_model {d_model}, n_layers {n_layers}, \
                     mlp_hidden_size {mlp_hidden_size}, embedding_size {embedding_size}"
                ),
            });
        }
        Ok(config)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Query heads that share one key/value head.
    pub fn n_kv_groups(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    /// Parameters of the checkpoint: the elements of every tensor in `tensor_specs`.
    pub fn parameter_count(&self) -> u64 {
        self.tensor_specs()
            .iter()
            .map(|(_, shape)| shape.iter().map(|&d| d as u64).product::<u64>())
            .sum()
    }

    /// Every tensor of a Hugging Face LLaDA checkpoint with its expected shape
    /// (`[out, in]` for linear weights), in checkpoint order.
    pub fn tensor_specs(&self) -> Vec<(String, Vec<usize>)> {
        let d = self.d_model;
        let kv = self.n_kv_heads * self.head_dim();
        let hidden = self.mlp_hidden_size;
        let mut specs = Vec::with_capacity(3 + 9 * self.n_layers);
        specs.push((
            "model.transformer.wte.weight".to_string(),
            vec![self.embedding_size, d],
        ));
        for i in 0..self.n_layers {
            let block = |name: &str| format!("model.transformer.blocks.{i}.{name}.weight");
            specs.push((block("attn_norm"), vec![d]));
            specs.push((block("q_proj"), vec![d, d]));
            specs.push((block("k_proj"), vec![kv, d]));
            specs.push((block("v_proj"), vec![kv, d]));
            specs.push((block("attn_out"), vec![d, d]));
            specs.push((block("ff_norm"), vec![d]));
            specs.push((block("ff_proj"), vec![hidden, d]));
            specs.push((block("up_proj"), vec![hidden, d]));
            specs.push((block("ff_out"), vec![d, hidden]));
        }
        specs.push(("model.transformer.ln_f.weight".to_string(), vec![d]));
        if !self.weight_tying {
            specs.push((
                "model.transformer.ff_out.weight".to_string(),
                vec![self.embedding_size, d],
            ));
        }
        specs
    }
}

/// The reference's `effective_n_kv_heads`: `multi_query_attention` forces one KV head,
/// and may not contradict an explicit `n_kv_heads`.
fn effective_n_kv_heads(f: &Fields<'_>, n_heads: usize) -> Result<usize, ConfigError> {
    let multi_query = f.opt_bool("multi_query_attention")?;
    let n_kv_heads = f.opt_size("n_kv_heads")?;
    match (n_kv_heads, multi_query) {
        (None, Some(true)) => Ok(1),
        (None, _) => Ok(n_heads),
        (Some(n), None) => Ok(n),
        (Some(n), Some(mq)) => {
            let implied = if mq { 1 } else { n_heads };
            if n == implied {
                Ok(n)
            } else {
                Err(ConfigError::Invalid {
                    field: "n_kv_heads",
                    expected: format!(
                        "{implied} or null, as implied by multi_query_attention = {mq}"
                    ),
                    found: n.to_string(),
                })
            }
        }
    }
}

fn parse_object(text: &str, file: &str) -> Result<Map<String, Value>, ConfigError> {
    let value: Value = serde_json::from_str(text).map_err(|source| ConfigError::Json {
        file: file.to_string(),
        source,
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ConfigError::NotAnObject {
            file: file.to_string(),
            found: json_kind(&other).into(),
        }),
    }
}

fn require_str(field: &'static str, found: &str, supported: &str) -> Result<(), ConfigError> {
    if found == supported {
        Ok(())
    } else {
        Err(ConfigError::Unsupported {
            field,
            expected: format!("\"{supported}\""),
            found: format!("\"{found}\""),
        })
    }
}

fn require_bool(field: &'static str, found: bool, supported: bool) -> Result<(), ConfigError> {
    if found == supported {
        Ok(())
    } else {
        Err(ConfigError::Unsupported {
            field,
            expected: supported.to_string(),
            found: found.to_string(),
        })
    }
}

fn check_token_in_range(
    field: &'static str,
    id: u32,
    embedding_size: usize,
) -> Result<(), ConfigError> {
    if (id as usize) < embedding_size {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field,
            expected: format!("a token id below embedding_size ({embedding_size})"),
            found: id.to_string(),
        })
    }
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn describe(value: &Value) -> String {
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => value.to_string(),
        other => json_kind(other).to_string(),
    }
}

/// Typed access to the keys of a config object, with the reference's defaults.
struct Fields<'a> {
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn wrong(field: &'static str, expected: &'static str, value: &Value) -> ConfigError {
        ConfigError::WrongType {
            field,
            expected,
            found: describe(value),
        }
    }

    fn opt_str(&self, field: &'static str) -> Result<Option<String>, ConfigError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(Self::wrong(field, "a string", other)),
        }
    }

    fn str_or(&self, field: &'static str, default: &str) -> Result<String, ConfigError> {
        match self.map.get(field) {
            None => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(Self::wrong(field, "a string", other)),
        }
    }

    fn opt_bool(&self, field: &'static str) -> Result<Option<bool>, ConfigError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(Self::wrong(field, "true, false or null", other)),
        }
    }

    fn bool_or(&self, field: &'static str, default: bool) -> Result<bool, ConfigError> {
        match self.map.get(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(Self::wrong(field, "true or false", other)),
        }
    }

    /// A positive integer, or None when missing or null.
    fn opt_size(&self, field: &'static str) -> Result<Option<usize>, ConfigError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => Ok(Some(Self::size(field, value)?)),
        }
    }

    fn size_or(&self, field: &'static str, default: u64) -> Result<usize, ConfigError> {
        match self.map.get(field) {
            None => Ok(default as usize),
            Some(value) => Self::size(field, value),
        }
    }

    fn size(field: &'static str, value: &Value) -> Result<usize, ConfigError> {
        let Value::Number(n) = value else {
            return Err(Self::wrong(field, "a positive integer", value));
        };
        match (n.as_u64(), n.as_i64()) {
            (Some(v), _) if v > 0 && v <= u32::MAX as u64 => Ok(v as usize),
            (Some(0), _) | (None, Some(_)) => Err(ConfigError::Invalid {
                field,
                expected: "a positive integer".into(),
                found: n.to_string(),
            }),
            (Some(_), _) => Err(ConfigError::Invalid {
                field,
                expected: format!("a positive integer at most {}", u32::MAX),
                found: n.to_string(),
            }),
            (None, None) => Err(Self::wrong(field, "a positive integer", value)),
        }
    }

    fn opt_token_id(&self, field: &'static str, key: &str) -> Result<Option<u32>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => Ok(Some(Self::token_id(field, value)?)),
        }
    }

    fn token_id_or(&self, field: &'static str, default: u64) -> Result<u32, ConfigError> {
        match self.map.get(field) {
            None => Ok(default as u32),
            Some(value) => Self::token_id(field, value),
        }
    }

    fn token_id(field: &'static str, value: &Value) -> Result<u32, ConfigError> {
        match value.as_u64() {
            Some(v) if v <= u32::MAX as u64 => Ok(v as u32),
            _ => Err(Self::wrong(field, "a token id (an integer >= 0)", value)),
        }
    }

    fn positive_float_or(&self, field: &'static str, default: f64) -> Result<f64, ConfigError> {
        let value = match self.map.get(field) {
            None => return Ok(default),
            Some(value) => value,
        };
        let Some(v) = value.as_f64() else {
            return Err(Self::wrong(field, "a positive number", value));
        };
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(ConfigError::Invalid {
                field,
                expected: "a positive number".into(),
                found: describe(value),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLADA_8B: &str = LLADA_8B_CONFIG_JSON;

    fn fixture_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
    }

    /// The 8B config with one key replaced (or removed when `value` is None).
    fn with(key: &str, value: Option<Value>) -> Result<LladaConfig, ConfigError> {
        let mut v: Value = serde_json::from_str(LLADA_8B).unwrap();
        let map = v.as_object_mut().unwrap();
        match value {
            Some(value) => map.insert(key.to_string(), value),
            None => map.remove(key),
        };
        LladaConfig::from_json_value(&v)
    }

    fn unsupported_field(result: Result<LladaConfig, ConfigError>) -> &'static str {
        match result {
            Err(ConfigError::Unsupported { field, .. }) => field,
            other => panic!("expected ConfigError::Unsupported, got {other:?}"),
        }
    }

    fn invalid_field(result: Result<LladaConfig, ConfigError>) -> &'static str {
        match result {
            Err(ConfigError::Invalid { field, .. }) => field,
            other => panic!("expected ConfigError::Invalid, got {other:?}"),
        }
    }

    /// Sizes past their bound are refused by name before anything is built from them.
    #[test]
    fn sizes_beyond_their_bounds_are_refused() {
        let big = u64::from(u32::MAX);
        for field in [
            "n_layers",
            "d_model",
            "n_heads",
            "mlp_hidden_size",
            "vocab_size",
            "embedding_size",
            "max_sequence_length",
        ] {
            let err = with(field, Some(big.into())).unwrap_err();
            assert!(
                matches!(err, ConfigError::Invalid { field: f, .. } if f == field),
                "{field}: {err}"
            );
            assert!(err.to_string().contains("4294967295"), "{err}");
        }
        // At the bound: accepted.
        let at = with(
            "max_sequence_length",
            Some(limits::MAX_SEQUENCE_LENGTH.into()),
        )
        .unwrap();
        assert_eq!(at.max_sequence_length, limits::MAX_SEQUENCE_LENGTH);
        // Each size within bounds, together too many parameters: named with the total.
        let err = with("n_layers", Some(1000.into()))
            .and_then(|_| with("mlp_hidden_size", Some((1u64 << 20).into())));
        assert!(err.is_ok());
        let mut v: Value = serde_json::from_str(LLADA_8B).unwrap();
        v["n_layers"] = 1000.into();
        v["mlp_hidden_size"] = (1u64 << 20).into();
        let err = LladaConfig::from_json_value(&v).unwrap_err().to_string();
        assert!(err.contains("parameters"), "{err}");
    }

    #[test]
    fn llada_8b_parses() {
        let c = LladaConfig::from_json_str(LLADA_8B).unwrap();
        assert_eq!(c.head_dim(), 128);
        assert_eq!(c.n_layers, 32);
        assert_eq!(c.n_heads, 32);
        assert_eq!(c.n_kv_heads, 32);
        assert_eq!(c.mlp_hidden_size, 12288);
        assert_eq!(c.vocab_size, 126464);
        assert_eq!(c.embedding_size, 126464);
        assert_eq!(c.max_sequence_length, 4096);
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert!(!c.weight_tying);
        assert_eq!(
            (c.mask_token_id, c.eos_token_id, c.pad_token_id),
            (126336, 126081, 126081)
        );
        assert_eq!(c.bos_token_id, None);
    }

    #[test]
    fn llada_8b_tensor_inventory() {
        let c = LladaConfig::from_json_str(LLADA_8B).unwrap();
        let specs = c.tensor_specs();
        // llada.md §2.1: 291 tensors, 8,015,581,184 parameters.
        assert_eq!(specs.len(), 291);
        let params: usize = specs.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(params, 8_015_581_184);
        assert_eq!(c.parameter_count(), 8_015_581_184);
        let find = |name: &str| {
            specs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
        };
        assert_eq!(
            find("model.transformer.wte.weight"),
            Some(vec![126464, 4096])
        );
        assert_eq!(
            find("model.transformer.ff_out.weight"),
            Some(vec![126464, 4096])
        );
        assert_eq!(
            find("model.transformer.blocks.31.ff_out.weight"),
            Some(vec![4096, 12288])
        );
        assert_eq!(
            find("model.transformer.blocks.0.ff_proj.weight"),
            Some(vec![12288, 4096])
        );
    }

    #[test]
    fn tied_weights_have_no_lm_head() {
        let c = with("weight_tying", Some(Value::Bool(true))).unwrap();
        let specs = c.tensor_specs();
        assert_eq!(specs.len(), 290);
        assert!(
            !specs
                .iter()
                .any(|(n, _)| n == "model.transformer.ff_out.weight")
        );
    }

    #[test]
    fn fixture_config_parses_with_generation_config() {
        let c = LladaConfig::from_file(fixture_dir().join("config.json")).unwrap();
        assert_eq!(c.d_model, 64);
        assert_eq!(c.n_heads, 4);
        assert_eq!(c.n_kv_heads, 2);
        assert_eq!(c.n_layers, 2);
        assert_eq!(c.head_dim(), 16);
        assert_eq!(c.n_kv_groups(), 2);
        assert_eq!(c.mlp_hidden_size, 96);
        assert_eq!((c.vocab_size, c.embedding_size), (320, 320));
        assert_eq!(c.mask_token_id, 305);
        assert_eq!(c.eos_token_id, 301);
        assert_eq!(c.bos_token_id, Some(300));
        // A directory means its config.json.
        assert_eq!(LladaConfig::from_file(fixture_dir()).unwrap(), c);
    }

    #[test]
    fn fixture_tensor_specs_match_the_index() {
        let c = LladaConfig::from_file(fixture_dir()).unwrap();
        let index =
            std::fs::read_to_string(fixture_dir().join("model.safetensors.index.json")).unwrap();
        let index: Value = serde_json::from_str(&index).unwrap();
        let mut in_index: Vec<&str> = index["weight_map"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        in_index.sort();
        let specs = c.tensor_specs();
        let mut expected: Vec<&str> = specs.iter().map(|(n, _)| n.as_str()).collect();
        expected.sort();
        assert_eq!(in_index, expected);
        let k = specs
            .iter()
            .find(|(n, _)| n == "model.transformer.blocks.1.k_proj.weight")
            .unwrap();
        assert_eq!(k.1, vec![32, 64]);
    }

    #[test]
    fn unsupported_values_are_named() {
        let cases: Vec<(&str, Value)> = vec![
            ("block_type", "sequential".into()),
            ("alibi", true.into()),
            ("rope", false.into()),
            ("rope_full_precision", false.into()),
            ("include_bias", true.into()),
            ("include_qkv_bias", true.into()),
            ("bias_for_layer_norm", true.into()),
            ("attention_layer_norm", true.into()),
            ("layer_norm_type", "default".into()),
            ("layer_norm_with_affine", false.into()),
            ("activation_type", "swiglu".into()),
            ("input_emb_norm", true.into()),
            ("scale_logits", true.into()),
            ("model_type", "Dream".into()),
        ];
        for (key, value) in cases {
            assert_eq!(unsupported_field(with(key, Some(value))), key);
        }
    }

    #[test]
    fn include_bias_is_inherited_by_layer_norm_bias() {
        let mut v: Value = serde_json::from_str(LLADA_8B).unwrap();
        v["include_bias"] = true.into();
        v["bias_for_layer_norm"] = Value::Null;
        // include_bias itself is reported first.
        assert_eq!(
            unsupported_field(LladaConfig::from_json_value(&v)),
            "include_bias"
        );
    }

    #[test]
    fn dangerous_defaults_are_the_reference_ones() {
        // A config without `rope` means rope = false in the reference.
        assert_eq!(unsupported_field(with("rope", None)), "rope");
        assert_eq!(unsupported_field(with("block_type", None)), "block_type");
        assert_eq!(
            unsupported_field(with("layer_norm_type", None)),
            "layer_norm_type"
        );
        assert_eq!(
            unsupported_field(with("activation_type", None)),
            "activation_type"
        );
        assert!(with("weight_tying", None).unwrap().weight_tying);
        assert_eq!(with("rope_theta", None).unwrap().rope_theta, 10000.0);
        assert_eq!(
            with("max_sequence_length", None)
                .unwrap()
                .max_sequence_length,
            1024
        );
        // Missing embedding_size is 50304, which is smaller than LLaDA's vocabulary.
        assert_eq!(invalid_field(with("embedding_size", None)), "vocab_size");
    }

    #[test]
    fn null_defaults() {
        let c = with("n_kv_heads", Some(Value::Null)).unwrap();
        assert_eq!(c.n_kv_heads, 32);
        let c = with("mlp_hidden_size", Some(Value::Null)).unwrap();
        assert_eq!(c.mlp_hidden_size, 4 * 4096);
        let c = with("embedding_size", Some(Value::Null)).unwrap();
        assert_eq!(c.embedding_size, 126464);

        let mut v: Value = serde_json::from_str(LLADA_8B).unwrap();
        v["n_kv_heads"] = Value::Null;
        v["multi_query_attention"] = true.into();
        assert_eq!(LladaConfig::from_json_value(&v).unwrap().n_kv_heads, 1);
        v["n_kv_heads"] = 8.into();
        assert_eq!(
            invalid_field(LladaConfig::from_json_value(&v)),
            "n_kv_heads"
        );
        v["n_kv_heads"] = 1.into();
        assert_eq!(LladaConfig::from_json_value(&v).unwrap().n_kv_heads, 1);
    }

    #[test]
    fn invalid_sizes_are_named() {
        assert_eq!(invalid_field(with("d_model", Some(4100.into()))), "d_model");
        assert_eq!(
            invalid_field(with("n_kv_heads", Some(5.into()))),
            "n_kv_heads"
        );
        // head_dim 256 is over the attention kernel's limit.
        assert_eq!(invalid_field(with("n_heads", Some(16.into()))), "d_model");
        assert_eq!(
            invalid_field(with("vocab_size", Some(126465.into()))),
            "vocab_size"
        );
        assert_eq!(invalid_field(with("n_layers", Some(0.into()))), "n_layers");
        assert_eq!(
            invalid_field(with("d_model", Some((-64).into()))),
            "d_model"
        );
        assert_eq!(
            invalid_field(with("mlp_hidden_size", Some(0.into()))),
            "mlp_hidden_size"
        );
        assert_eq!(
            invalid_field(with("rope_theta", Some(0.into()))),
            "rope_theta"
        );
        assert_eq!(
            invalid_field(with("rms_norm_eps", Some((-1.0).into()))),
            "rms_norm_eps"
        );
        assert_eq!(
            invalid_field(with("mask_token_id", Some(126464.into()))),
            "mask_token_id"
        );
        let err = with("n_heads", Some(16.into())).unwrap_err().to_string();
        assert!(err.contains("256") && err.contains("128"), "{err}");
    }

    #[test]
    fn wrong_types_are_named() {
        for (key, value) in [
            ("d_model", Value::from("4096")),
            ("d_model", Value::from(4096.5)),
            ("alibi", Value::from(0)),
            ("block_type", Value::from(1)),
            ("mask_token_id", Value::Null),
            ("eos_token_id", Value::from(-1)),
        ] {
            match with(key, Some(value)) {
                Err(ConfigError::WrongType { field, .. }) => assert_eq!(field, key),
                other => panic!("{key}: expected WrongType, got {other:?}"),
            }
        }
    }

    #[test]
    fn file_errors_name_the_file() {
        let err = LladaConfig::from_file("/nonexistent/config.json").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/config.json"),
            "{err}"
        );
        let err = LladaConfig::from_json_str("{ not json").unwrap_err();
        assert!(matches!(err, ConfigError::Json { .. }), "{err:?}");
        let err = LladaConfig::from_json_str("[1, 2]").unwrap_err();
        assert!(matches!(err, ConfigError::NotAnObject { .. }), "{err:?}");
    }

    #[test]
    fn generation_config_errors_name_the_field() {
        let dir = std::env::temp_dir().join(format!("unmask-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), LLADA_8B).unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"bos_token_id": "x"}"#,
        )
        .unwrap();
        let result = LladaConfig::from_file(&dir);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"bos_token_id": 126080}"#,
        )
        .unwrap();
        let good = LladaConfig::from_file(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        match result {
            Err(ConfigError::WrongType { field, .. }) => {
                assert_eq!(field, "generation_config.bos_token_id")
            }
            other => panic!("expected WrongType, got {other:?}"),
        }
        assert_eq!(good.unwrap().bos_token_id, Some(126080));
    }

    #[test]
    fn presets() {
        let big = LladaConfig::preset("llada-8b").unwrap();
        assert_eq!(big.parameter_count(), 8_015_581_184);
        assert_eq!(big.bos_token_id, Some(126080));
        let files = LladaConfig::preset_files("llada-8b").unwrap();
        assert_eq!(files.config_json, LLADA_8B_CONFIG_JSON);
        // The tiny preset is the fixture's config, BOS from generation_config.json included.
        let tiny = LladaConfig::preset("tiny").unwrap();
        assert_eq!(tiny, LladaConfig::from_file(fixture_dir()).unwrap());
        for name in LladaConfig::PRESETS {
            assert!(LladaConfig::preset(name).is_some(), "{name}");
        }
        assert!(LladaConfig::preset("llada-7b").is_none());
    }

    #[test]
    fn unknown_keys_are_ignored() {
        let c = with("some_future_option", Some(Value::from(42))).unwrap();
        assert_eq!(c.d_model, 4096);
    }
}
