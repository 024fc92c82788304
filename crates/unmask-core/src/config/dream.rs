//! Dream-7B and DiffuCoder's `config.json` (`DreamConfig`: Qwen2's keys, `model_type`
//! "Dream"): missing keys take `DreamConfig`'s defaults; what the kernels do not implement
//! (another activation, RoPE scaling, sliding-window attention) is refused by name.

use super::fields::Fields;
use super::{ModelConfig, ModelFamily};
use crate::error::ConfigError;

// `DreamConfig`'s defaults (the Qwen2 ones, plus Dream's mask and pad ids).
const VOCAB_SIZE: u64 = 151_936;
const HIDDEN_SIZE: u64 = 4096;
const INTERMEDIATE_SIZE: u64 = 22_016;
const NUM_HIDDEN_LAYERS: u64 = 32;
const NUM_ATTENTION_HEADS: u64 = 32;
const MAX_POSITION_EMBEDDINGS: u64 = 32_768;
const RMS_NORM_EPS: f64 = 1e-6;
const ROPE_THETA: f64 = 10_000.0;
const MASK_TOKEN_ID: u64 = 151_666;
const PAD_TOKEN_ID: u64 = 151_643;

impl ModelConfig {
    pub(super) fn from_dream_fields(f: &Fields<'_>) -> Result<Self, ConfigError> {
        let act = f.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(ConfigError::Unsupported {
                field: "hidden_act",
                expected: "\"silu\" (the SwiGLU kernel)".into(),
                found: format!("\"{act}\""),
            });
        }
        if let Some(kind) = f.map.get("rope_scaling").filter(|v| !v.is_null()) {
            return Err(ConfigError::Unsupported {
                field: "rope_scaling",
                expected: "null (plain RoPE)".into(),
                found: kind.to_string(),
            });
        }
        if f.bool_or("use_sliding_window", false)? {
            return Err(ConfigError::Unsupported {
                field: "use_sliding_window",
                expected: "false (every position attends to every other)".into(),
                found: "true".into(),
            });
        }
        let d_model = f.size_or("hidden_size", HIDDEN_SIZE)?;
        let n_heads = f.size_or("num_attention_heads", NUM_ATTENTION_HEADS)?;
        // Qwen2: a missing or null count of KV heads means plain multi-head attention.
        let n_kv_heads = f.opt_size("num_key_value_heads")?.unwrap_or(n_heads);
        if let Some(head_dim) = f.opt_size("head_dim")?
            && n_heads > 0
            && head_dim * n_heads != d_model
        {
            return Err(ConfigError::Unsupported {
                field: "head_dim",
                expected: format!("hidden_size / num_attention_heads = {}", d_model / n_heads),
                found: head_dim.to_string(),
            });
        }
        let vocab_size = f.size_or("vocab_size", VOCAB_SIZE)?;
        let pad_token_id = f.token_id_or("pad_token_id", PAD_TOKEN_ID)?;
        // `PretrainedConfig` has no EOS by default; Dream ends an answer with its pad
        // token (`<|endoftext|>`).
        let eos_token_id = f
            .opt_token_id("eos_token_id", "eos_token_id")?
            .unwrap_or(pad_token_id);
        Self {
            family: ModelFamily::Dream,
            qkv_bias: true,
            d_model,
            n_heads,
            n_kv_heads,
            n_layers: f.size_or("num_hidden_layers", NUM_HIDDEN_LAYERS)?,
            mlp_hidden_size: f.size_or("intermediate_size", INTERMEDIATE_SIZE)?,
            vocab_size,
            embedding_size: vocab_size,
            max_sequence_length: f.size_or("max_position_embeddings", MAX_POSITION_EMBEDDINGS)?,
            rope_theta: f.positive_float_or("rope_theta", ROPE_THETA)?,
            rms_norm_eps: f.positive_float_or("rms_norm_eps", RMS_NORM_EPS)?,
            weight_tying: f.bool_or("tie_word_embeddings", false)?,
            mask_token_id: f.token_id_or("mask_token_id", MASK_TOKEN_ID)?,
            eos_token_id,
            pad_token_id,
            bos_token_id: f.opt_token_id("bos_token_id", "bos_token_id")?,
            // generation_config.json's, when it names one, replaces it
            // (`with_generation_config`).
            default_top_k: f
                .opt_top_k("top_k", "top_k")?
                .unwrap_or(ModelFamily::Dream.spec().default_top_k),
        }
        .checked()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::super::{DREAM_7B_CONFIG_JSON, LayerTensor};
    use super::*;

    fn dream_with(key: &str, value: Option<Value>) -> Result<ModelConfig, ConfigError> {
        crate::config::tests::with_in(DREAM_7B_CONFIG_JSON, key, value)
    }

    #[test]
    fn dream_7b_parses_with_the_published_numbers() {
        let c = ModelConfig::from_json_str(DREAM_7B_CONFIG_JSON).unwrap();
        assert_eq!(c.family, ModelFamily::Dream);
        assert!(c.qkv_bias && !c.weight_tying);
        assert_eq!(
            (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim()),
            (3584, 28, 28, 4, 128)
        );
        assert_eq!((c.mlp_hidden_size, c.vocab_size), (18944, 152064));
        assert_eq!((c.rope_theta, c.rms_norm_eps), (1e6, 1e-6));
        assert_eq!(
            (c.mask_token_id, c.pad_token_id, c.eos_token_id),
            (151666, 151643, 151643)
        );
        // Qwen2.5-7B's 7.6 B parameters: 339 tensors, biases included.
        let specs = c.tensor_specs();
        assert_eq!(specs.len(), 3 + 28 * 12);
        assert_eq!(c.parameter_count(), 7_615_616_512);
        let find = |name: &str| {
            specs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
        };
        assert_eq!(find("model.embed_tokens.weight"), Some(vec![152064, 3584]));
        assert_eq!(find("lm_head.weight"), Some(vec![152064, 3584]));
        assert_eq!(
            find("model.layers.27.self_attn.k_proj.bias"),
            Some(vec![512])
        );
        assert_eq!(
            find("model.layers.0.self_attn.q_proj.bias"),
            Some(vec![3584])
        );
        assert_eq!(
            find("model.layers.3.mlp.down_proj.weight"),
            Some(vec![3584, 18944])
        );
        assert_eq!(
            ModelFamily::Dream.layer_name(5, LayerTensor::FfnNorm),
            "model.layers.5.post_attention_layernorm.weight"
        );
    }

    #[test]
    fn dream_options_without_kernels_are_refused_by_name() {
        let field = |r: Result<ModelConfig, ConfigError>| match r {
            Err(ConfigError::Unsupported { field, .. } | ConfigError::Invalid { field, .. }) => {
                field
            }
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(
            field(dream_with("hidden_act", Some("gelu".into()))),
            "hidden_act"
        );
        assert_eq!(
            field(dream_with(
                "rope_scaling",
                Some(serde_json::json!({"type": "yarn"}))
            )),
            "rope_scaling"
        );
        assert_eq!(
            field(dream_with("use_sliding_window", Some(true.into()))),
            "use_sliding_window"
        );
        assert_eq!(field(dream_with("head_dim", Some(64.into()))), "head_dim");
        // Size errors use Qwen2's key names.
        assert_eq!(
            field(dream_with("num_key_value_heads", Some(5.into()))),
            "num_key_value_heads"
        );
        assert_eq!(
            field(dream_with("mask_token_id", Some(200_000.into()))),
            "mask_token_id"
        );
        let unknown = ModelConfig::from_json_str(r#"{"model_type": "qwen2"}"#).unwrap_err();
        assert!(unknown.to_string().contains("model_type"), "{unknown}");
        // A missing count of KV heads is multi-head attention; a missing EOS is the pad id.
        let c = dream_with("num_key_value_heads", None).unwrap();
        assert_eq!(c.n_kv_heads, 28);
        let c = dream_with("eos_token_id", None).unwrap();
        assert_eq!(c.eos_token_id, 151643);
    }
}
