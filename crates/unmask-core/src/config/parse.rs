//! Reading `config.json` into a `ModelConfig`: the reference's defaults for missing keys,
//! every option this runtime has no kernels for refused by name, and every size checked
//! against `limits` before anything is built from it.

use serde_json::{Map, Value};

use super::fields::{Fields, json_kind};
use super::{MAX_HEAD_DIM, ModelConfig, ModelFamily, defaults, limits};
use crate::error::ConfigError;

impl ModelConfig {
    pub(super) fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::from_map(&parse_object(text, file)?)
    }

    pub(super) fn from_map(map: &Map<String, Value>) -> Result<Self, ConfigError> {
        let f = Fields { map };

        let model_type = f.opt_str("model_type")?;
        match ModelFamily::from_model_type(model_type.as_deref()) {
            Some(ModelFamily::Llada) => {}
            Some(ModelFamily::Dream) => return Self::from_dream_fields(&f),
            None => {
                let known: Vec<String> = ModelFamily::ALL
                    .iter()
                    .flat_map(|f| f.spec().model_types)
                    .map(|t| format!("\"{t}\""))
                    .collect();
                return Err(ConfigError::Unsupported {
                    field: "model_type",
                    expected: format!("one of {}", known.join(", ")),
                    found: format!("\"{}\"", model_type.unwrap_or_default()),
                });
            }
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
        Self {
            family: ModelFamily::Llada,
            qkv_bias: false,
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
            // LLaDA's reference `generate` has no top-k cut.
            default_top_k: None,
        }
        .checked()
    }

    /// Checks every size against its bound and against the kernels' limits, and every
    /// special token id against the embedding table: what both families need before
    /// anything is built from a config.
    pub(super) fn checked(self) -> Result<Self, ConfigError> {
        let Self {
            d_model,
            n_heads,
            n_kv_heads,
            n_layers,
            mlp_hidden_size,
            vocab_size,
            embedding_size,
            max_sequence_length,
            mask_token_id,
            eos_token_id,
            pad_token_id,
            bos_token_id,
            ..
        } = self;
        let config = self;
        // Errors name the key as the family's config.json spells it.
        let key = |field: &'static str| config.family.config_key(field);
        for (field, value, max) in [
            (key("d_model"), d_model, limits::MAX_D_MODEL),
            (key("n_heads"), n_heads, limits::MAX_HEADS),
            (key("n_layers"), n_layers, limits::MAX_LAYERS),
            (
                key("mlp_hidden_size"),
                mlp_hidden_size,
                limits::MAX_MLP_HIDDEN,
            ),
            (key("vocab_size"), vocab_size, limits::MAX_VOCAB),
            (key("embedding_size"), embedding_size, limits::MAX_VOCAB),
            (
                key("max_sequence_length"),
                max_sequence_length,
                limits::MAX_SEQUENCE_LENGTH,
            ),
        ] {
            limits::check_bound(field, value, max)?;
        }
        if !d_model.is_multiple_of(n_heads) {
            return Err(ConfigError::Invalid {
                field: key("d_model"),
                expected: format!("a multiple of {} ({n_heads})", key("n_heads")),
                found: d_model.to_string(),
            });
        }
        let head_dim = d_model / n_heads;
        if head_dim > MAX_HEAD_DIM {
            return Err(ConfigError::Invalid {
                field: key("d_model"),
                expected: format!(
                    "head_dim = d_model / n_heads <= {MAX_HEAD_DIM} (the attention kernel's limit)"
                ),
                found: format!("{d_model} / {n_heads} = {head_dim}"),
            });
        }
        // rotate_half pairs dimension d with d + head_dim/2.
        if !head_dim.is_multiple_of(2) {
            return Err(ConfigError::Invalid {
                field: key("d_model"),
                expected: "an even head_dim = d_model / n_heads (RoPE rotates pairs)".into(),
                found: format!("{d_model} / {n_heads} = {head_dim}"),
            });
        }
        if !n_heads.is_multiple_of(n_kv_heads) {
            return Err(ConfigError::Invalid {
                field: key("n_kv_heads"),
                expected: format!("a divisor of n_heads ({n_heads})"),
                found: n_kv_heads.to_string(),
            });
        }
        if vocab_size > embedding_size {
            return Err(ConfigError::Invalid {
                field: key("vocab_size"),
                expected: format!("at most embedding_size ({embedding_size})"),
                found: vocab_size.to_string(),
            });
        }

        check_token_in_range("mask_token_id", mask_token_id, embedding_size)?;
        check_token_in_range("eos_token_id", eos_token_id, embedding_size)?;
        check_token_in_range("pad_token_id", pad_token_id, embedding_size)?;
        if let Some(bos) = bos_token_id {
            check_token_in_range("bos_token_id", bos, embedding_size)?;
        }

        // Each size within its bound, the product still can be beyond any machine.
        let parameters = config.parameter_count();
        if parameters > limits::MAX_PARAMETERS {
            return Err(ConfigError::Invalid {
                field: key("n_layers"),
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

pub(super) fn parse_object(text: &str, file: &str) -> Result<Map<String, Value>, ConfigError> {
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

pub(super) fn check_token_in_range(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{LLADA_8B, with};

    fn unsupported_field(result: Result<ModelConfig, ConfigError>) -> &'static str {
        match result {
            Err(ConfigError::Unsupported { field, .. }) => field,
            other => panic!("expected ConfigError::Unsupported, got {other:?}"),
        }
    }

    fn invalid_field(result: Result<ModelConfig, ConfigError>) -> &'static str {
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
        let err = ModelConfig::from_json_value(&v).unwrap_err().to_string();
        assert!(err.contains("parameters"), "{err}");
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
            ("model_type", "qwen2".into()),
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
            unsupported_field(ModelConfig::from_json_value(&v)),
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
        assert_eq!(ModelConfig::from_json_value(&v).unwrap().n_kv_heads, 1);
        v["n_kv_heads"] = 8.into();
        assert_eq!(
            invalid_field(ModelConfig::from_json_value(&v)),
            "n_kv_heads"
        );
        v["n_kv_heads"] = 1.into();
        assert_eq!(ModelConfig::from_json_value(&v).unwrap().n_kv_heads, 1);
    }

    #[test]
    fn invalid_sizes_are_named() {
        assert_eq!(invalid_field(with("d_model", Some(4100.into()))), "d_model");
        assert_eq!(
            invalid_field(with("n_kv_heads", Some(5.into()))),
            "n_kv_heads"
        );
        // Heads up to 512 wide are taken (staged attention): d_model 4096 over 16 heads.
        let mut v: Value = serde_json::from_str(LLADA_8B).unwrap();
        v["n_heads"] = 16.into();
        v["n_kv_heads"] = 8.into();
        assert_eq!(ModelConfig::from_json_value(&v).unwrap().head_dim(), 256);
        // head_dim 1024 is over the attention kernel's limit (512).
        assert_eq!(invalid_field(with("n_heads", Some(4.into()))), "d_model");
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
        let err = with("n_heads", Some(4.into())).unwrap_err().to_string();
        assert!(err.contains("1024") && err.contains("512"), "{err}");
    }

    #[test]
    fn unknown_keys_are_ignored() {
        let c = with("some_future_option", Some(Value::from(42))).unwrap();
        assert_eq!(c.d_model, 4096);
    }
}
