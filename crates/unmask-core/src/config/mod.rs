//! A model's configuration (`config.json`), read the way the reference reads it: the
//! family's defaults overwritten by the file's keys. The family comes from `model_type`:
//! `"llada"` (or none) reads LLaDA's keys as `LLaDAConfig` does, `"Dream"` reads the Qwen2
//! keys of Dream-7B and DiffuCoder (`dream`). Unknown keys are ignored; options this
//! runtime has no kernels for are rejected with an error that names the field.

mod defaults;
mod dgemma;
mod dgemma_generation;
mod dream;
mod fields;
pub mod limits;
mod names;
mod parse;
mod presets;

use std::path::Path;

use serde_json::Value;

use crate::error::ConfigError;
use fields::Fields;
use parse::{check_token_in_range, parse_object};

pub use dgemma::{DIFFUSION_GEMMA_26B_A4B_CONFIG_JSON, DiffusionGemmaConfig, LayerAttention};
pub use dgemma_generation::{entropy_bound_params, entropy_bound_params_from_map};
pub use fields::json_kind;
pub use names::LayerTensor;
pub use presets::{DREAM_7B_CONFIG_JSON, LLADA_8B_CONFIG_JSON, PresetFiles};

/// Largest head dimension the attention kernels support (they stage heads wider than 128
/// dimensions 128 at a time; `unmask_gpu::ops::attention::MAX_HEAD_DIM` is the same bound).
pub const MAX_HEAD_DIM: usize = 512;

/// The published architecture a checkpoint follows. Its facts (tensor names, config keys,
/// logit shift, chat format, sampler defaults, shipped depth tables) are its `FamilySpec`
/// (`crate::family`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// LLaDA-8B (Base, Instruct, 1.5): `model.transformer.*` names, no biases.
    #[default]
    Llada,
    /// Dream-v0-7B (Base, Instruct) and DiffuCoder: Qwen2 names, q/k/v biases, logits
    /// shifted by one position (the AR alignment Dream was initialised from).
    Dream,
}

/// What the runtime needs to know about a model, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: ModelFamily,
    /// The q, k and v projections add a bias (Qwen2 / Dream).
    pub qkv_bias: bool,
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
    /// The top_k a request gets when it gives none (`None`: no cut). Dream's reference
    /// `diffusion_generate` cuts to the model's `top_k`, which transformers (up to 4.4x)
    /// sets to 50 in every config it does not name: so for Dream it is
    /// generation_config.json's `top_k`, else config.json's, else 50 (0 in either file: no
    /// cut). LLaDA's reference applies none.
    pub default_top_k: Option<u32>,
}

impl ModelConfig {
    /// Reads `config.json` (or `<dir>/config.json` when given a directory), and
    /// `generation_config.json` beside it when that file exists.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let config_path = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        // Regular files only (a FIFO would block `read` forever), within their size bound,
        // and a broken symbolic link is named as one (never skipped as absent).
        let read = |path: &Path| -> Result<String, ConfigError> {
            let io = |message: String| ConfigError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, message),
            };
            let bytes = crate::small_files::read(path).map_err(io)?;
            String::from_utf8(bytes).map_err(|e| io(e.to_string()))
        };
        let text = read(&config_path)?;
        let config = Self::parse(&text, &config_path.display().to_string())?;
        let generation_path = config_path.with_file_name("generation_config.json");
        let present =
            crate::small_files::exists(&generation_path).map_err(|message| ConfigError::Io {
                path: generation_path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, message),
            })?;
        if !present {
            return Ok(config);
        }
        let text = read(&generation_path)?;
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
        if self.family == ModelFamily::Dream
            && let Some(top_k) = fields.opt_top_k("generation_config.top_k", "top_k")?
        {
            self.default_top_k = top_k;
        }
        Ok(self)
    }

    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        Self::parse(text, "config.json")
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

    /// Every tensor of the checkpoint with its expected shape (`[out, in]` for linear
    /// weights, `[n]` for norms and biases), named as the family's published files name
    /// them, in checkpoint order.
    pub fn tensor_specs(&self) -> Vec<(String, Vec<usize>)> {
        let d = self.d_model;
        let q = self.n_heads * self.head_dim();
        let kv = self.n_kv_heads * self.head_dim();
        let hidden = self.mlp_hidden_size;
        let mut specs = Vec::with_capacity(3 + 12 * self.n_layers);
        specs.push((
            self.family.embedding_name().to_string(),
            vec![self.embedding_size, d],
        ));
        for i in 0..self.n_layers {
            for part in LayerTensor::ALL {
                let shape = match part {
                    LayerTensor::AttnNorm | LayerTensor::FfnNorm => vec![d],
                    LayerTensor::Q => vec![q, d],
                    LayerTensor::K | LayerTensor::V => vec![kv, d],
                    LayerTensor::QBias => vec![q],
                    LayerTensor::KBias | LayerTensor::VBias => vec![kv],
                    LayerTensor::O => vec![d, q],
                    LayerTensor::Gate | LayerTensor::Up => vec![hidden, d],
                    LayerTensor::Down => vec![d, hidden],
                };
                if part.is_bias() && !self.qkv_bias {
                    continue;
                }
                specs.push((self.family.layer_name(i, part), shape));
            }
        }
        specs.push((self.family.final_norm_name().to_string(), vec![d]));
        if !self.weight_tying {
            specs.push((
                self.family.lm_head_name().to_string(),
                vec![self.embedding_size, d],
            ));
        }
        specs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const LLADA_8B: &str = LLADA_8B_CONFIG_JSON;

    pub(super) fn fixture_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
    }

    /// The 8B config with one key replaced (or removed when `value` is None).
    pub(super) fn with(key: &str, value: Option<Value>) -> Result<ModelConfig, ConfigError> {
        with_in(LLADA_8B, key, value)
    }

    /// The config `base` with one key replaced (or removed when `value` is None).
    pub(super) fn with_in(
        base: &str,
        key: &str,
        value: Option<Value>,
    ) -> Result<ModelConfig, ConfigError> {
        let mut v: Value = serde_json::from_str(base).unwrap();
        let map = v.as_object_mut().unwrap();
        match value {
            Some(value) => map.insert(key.to_string(), value),
            None => map.remove(key),
        };
        ModelConfig::from_json_value(&v)
    }

    #[test]
    fn llada_8b_parses() {
        let c = ModelConfig::from_json_str(LLADA_8B).unwrap();
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
        let c = ModelConfig::from_json_str(LLADA_8B).unwrap();
        let specs = c.tensor_specs();
        // llada.md §2.1: 291 tensors, 8,015,581,184 parameters.
        assert_eq!(specs.len(), 291);
        let params: usize = specs.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(params, 8_015_581_184);
        assert_eq!(c.parameter_count(), 8_015_581_184);
        for (name, shape) in [
            ("model.transformer.wte.weight", [126464, 4096]),
            ("model.transformer.ff_out.weight", [126464, 4096]),
            ("model.transformer.blocks.31.ff_out.weight", [4096, 12288]),
            ("model.transformer.blocks.0.ff_proj.weight", [12288, 4096]),
        ] {
            let found = specs.iter().find(|(n, _)| n == name).map(|(_, s)| s);
            assert_eq!(found, Some(&shape.to_vec()), "{name}");
        }
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
        let c = ModelConfig::from_file(fixture_dir().join("config.json")).unwrap();
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
        assert_eq!(ModelConfig::from_file(fixture_dir()).unwrap(), c);
    }

    #[test]
    fn fixture_tensor_specs_match_the_index() {
        let c = ModelConfig::from_file(fixture_dir()).unwrap();
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
    fn file_errors_name_the_file() {
        let err = ModelConfig::from_file("/nonexistent/config.json").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/config.json"),
            "{err}"
        );
        let err = ModelConfig::from_json_str("{ not json").unwrap_err();
        assert!(matches!(err, ConfigError::Json { .. }), "{err:?}");
        let err = ModelConfig::from_json_str("[1, 2]").unwrap_err();
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
        let result = ModelConfig::from_file(&dir);
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"bos_token_id": 126080}"#,
        )
        .unwrap();
        let good = ModelConfig::from_file(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        match result {
            Err(ConfigError::WrongType { field, .. }) => {
                assert_eq!(field, "generation_config.bos_token_id")
            }
            other => panic!("expected WrongType, got {other:?}"),
        }
        assert_eq!(good.unwrap().bos_token_id, Some(126080));
    }
}
