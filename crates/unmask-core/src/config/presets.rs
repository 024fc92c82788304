//! Named models: the published `config.json` and `generation_config.json` of LLaDA-8B,
//! and the same keys at test size.

use serde_json::Value;

use super::ModelConfig;

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

/// Dream-v0-Instruct-7B's `config.json` keys (Base shares the numbers; DiffuCoder-7B has
/// the same architecture and ids, llada.md "Dream-7B"). `auto_map` is left out: the runtime
/// never runs the checkpoint's Python.
pub const DREAM_7B_CONFIG_JSON: &str = r#"{
  "architectures": [
    "DreamModel"
  ],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "mask_token_id": 151666,
  "max_position_embeddings": 131072,
  "max_window_layers": 28,
  "model_type": "Dream",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "pad_token_id": 151643,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.46.2",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
}"#;

/// Dream's `generation_config.json` ids.
const DREAM_7B_GENERATION_CONFIG_JSON: &str = r#"{
  "bos_token_id": 151643,
  "eos_token_id": 151643,
  "pad_token_id": 151643,
  "transformers_version": "4.46.2"
}
"#;

/// The files that define a named model's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PresetFiles {
    pub config_json: String,
    pub generation_config_json: String,
}

impl ModelConfig {
    /// Names accepted by [`ModelConfig::preset`].
    pub const PRESETS: [&str; 4] = ["llada-8b", "tiny", "dream-7b", "tiny-dream"];

    /// The config of a named model: `llada-8b` (LLaDA-8B-Instruct; Base and 1.5 share it),
    /// `tiny` (the same keys at test size, the shapes of tests/fixtures/tiny), `dream-7b`
    /// (Dream-v0-7B and DiffuCoder-7B) or `tiny-dream` (tests/fixtures/tiny-dream's shapes),
    /// with the BOS id of its generation_config.json. None for other names.
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
            "dream-7b" => Some(PresetFiles {
                config_json: DREAM_7B_CONFIG_JSON.to_string(),
                generation_config_json: DREAM_7B_GENERATION_CONFIG_JSON.to_string(),
            }),
            "tiny-dream" => {
                let mut value: Value =
                    serde_json::from_str(DREAM_7B_CONFIG_JSON).expect("the preset is JSON");
                let map = value.as_object_mut().expect("the preset is an object");
                for (key, v) in [
                    ("hidden_size", 64),
                    ("num_attention_heads", 4),
                    ("num_key_value_heads", 2),
                    ("num_hidden_layers", 2),
                    ("max_window_layers", 2),
                    ("intermediate_size", 96),
                    ("vocab_size", 320),
                    ("max_position_embeddings", 512),
                    ("bos_token_id", 303),
                    ("eos_token_id", 300),
                    ("pad_token_id", 300),
                    ("mask_token_id", 304),
                ] {
                    map.insert(key.to_string(), Value::from(v));
                }
                map.insert("rope_theta".into(), Value::from(10000.0));
                let generation = serde_json::json!({
                    "bos_token_id": 303,
                    "eos_token_id": 300,
                    "pad_token_id": 300,
                });
                let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON") + "\n";
                Some(PresetFiles {
                    config_json: pretty(&value),
                    generation_config_json: pretty(&generation),
                })
            }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::fixture_dir;

    #[test]
    fn presets() {
        let big = ModelConfig::preset("llada-8b").unwrap();
        assert_eq!(big.parameter_count(), 8_015_581_184);
        assert_eq!(big.bos_token_id, Some(126080));
        let files = ModelConfig::preset_files("llada-8b").unwrap();
        assert_eq!(files.config_json, LLADA_8B_CONFIG_JSON);
        // The tiny preset is the fixture's config, BOS from generation_config.json included.
        let tiny = ModelConfig::preset("tiny").unwrap();
        assert_eq!(tiny, ModelConfig::from_file(fixture_dir()).unwrap());
        for name in ModelConfig::PRESETS {
            assert!(ModelConfig::preset(name).is_some(), "{name}");
        }
        assert!(ModelConfig::preset("llada-7b").is_none());
        let dream = ModelConfig::preset("dream-7b").unwrap();
        assert_eq!(dream.family, crate::config::ModelFamily::Dream);
        assert_eq!(dream.bos_token_id, Some(151643));
    }
}
