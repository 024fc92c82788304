//! DiffusionGemma's `generation_config.json` (§1 of `docs/models/diffusion-gemma.md`): the
//! sampler's settings, each key defaulting to the published value when absent.

use serde_json::{Map, Value};

use super::fields::{Fields, json_kind};
use super::parse::parse_object;
use crate::error::ConfigError;
use crate::sampler::entropy_bound::EntropyBoundParams;

/// The sampler settings of a `generation_config.json` text (`file` names it in errors).
pub fn entropy_bound_params(text: &str, file: &str) -> Result<EntropyBoundParams, ConfigError> {
    entropy_bound_params_from_map(&parse_object(text, file)?)
}

pub fn entropy_bound_params_from_map(
    map: &Map<String, Value>,
) -> Result<EntropyBoundParams, ConfigError> {
    let f = Fields { map };
    let d = EntropyBoundParams::default();
    let bound = match map.get("sampler_config") {
        None | Some(Value::Null) => d.entropy_bound as f64,
        Some(Value::Object(sampler)) => {
            Fields { map: sampler }.positive_float_or("entropy_bound", d.entropy_bound as f64)?
        }
        Some(other) => {
            return Err(ConfigError::WrongType {
                field: "sampler_config",
                expected: "an object with entropy_bound",
                found: json_kind(other).into(),
            });
        }
    };
    let params = EntropyBoundParams {
        max_new_tokens: f.size_or("max_new_tokens", d.max_new_tokens as u64)?,
        max_denoising_steps: f.size_or("max_denoising_steps", d.max_denoising_steps as u64)?,
        entropy_bound: bound as f32,
        t_min: f.positive_float_or("t_min", d.t_min)?,
        t_max: f.positive_float_or("t_max", d.t_max)?,
        stability_threshold: count(map, "stability_threshold", d.stability_threshold)?,
        confidence_threshold: f
            .positive_float_or("confidence_threshold", d.confidence_threshold as f64)?
            as f32,
        eos: token_ids(map, "eos_token_id", d.eos)?,
        pad: match map.get("pad_token_id") {
            None => d.pad,
            Some(Value::Null) => None,
            Some(v) => Some(token_id("pad_token_id", v)?),
        },
    };
    if params.t_min > params.t_max {
        return Err(ConfigError::Invalid {
            field: "t_min",
            expected: format!("at most t_max ({})", params.t_max),
            found: params.t_min.to_string(),
        });
    }
    Ok(params)
}

/// A non-negative integer (0 allowed: the stability threshold 0 means always stable).
fn count(
    map: &Map<String, Value>,
    field: &'static str,
    default: usize,
) -> Result<usize, ConfigError> {
    match map.get(field) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .filter(|&n| n <= u32::MAX as u64)
            .map(|n| n as usize)
            .ok_or_else(|| ConfigError::Invalid {
                field,
                expected: "a non-negative integer".into(),
                found: v.to_string(),
            }),
    }
}

fn token_id(field: &'static str, v: &Value) -> Result<u32, ConfigError> {
    v.as_u64()
        .filter(|&n| n <= u32::MAX as u64)
        .map(|n| n as u32)
        .ok_or_else(|| ConfigError::Invalid {
            field,
            expected: "a token id (a non-negative integer)".into(),
            found: v.to_string(),
        })
}

/// One id or a list of ids.
fn token_ids(
    map: &Map<String, Value>,
    field: &'static str,
    default: Vec<u32>,
) -> Result<Vec<u32>, ConfigError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Array(a)) => a.iter().map(|v| token_id(field, v)).collect(),
        Some(v) => Ok(vec![token_id(field, v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_file_and_missing_keys_give_the_published_settings() {
        let text = r#"{"max_new_tokens": 256, "max_denoising_steps": 48,
            "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
            "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
            "confidence_threshold": 0.005, "eos_token_id": [1, 106, 50], "pad_token_id": 0}"#;
        let p = entropy_bound_params(text, "generation_config.json").unwrap();
        assert_eq!(p, EntropyBoundParams::default());
        assert_eq!(entropy_bound_params("{}", "g.json").unwrap(), p);
        let p = entropy_bound_params(
            r#"{"stability_threshold": 0, "eos_token_id": 7, "pad_token_id": null}"#,
            "g",
        )
        .unwrap();
        assert_eq!((p.stability_threshold, p.eos, p.pad), (0, vec![7], None));
    }

    #[test]
    fn bad_values_are_named() {
        let err = |t: &str| entropy_bound_params(t, "g.json").unwrap_err().to_string();
        assert!(err(r#"{"t_min": 0.9}"#).contains("`t_min`"));
        assert!(err(r#"{"sampler_config": 3}"#).contains("`sampler_config`"));
        assert!(err(r#"{"sampler_config": {"entropy_bound": -1}}"#).contains("`entropy_bound`"));
        assert!(err(r#"{"eos_token_id": [1, "x"]}"#).contains("`eos_token_id`"));
        assert!(err(r#"{"max_denoising_steps": 0}"#).contains("`max_denoising_steps`"));
        assert!(err("[]").contains("g.json"));
    }
}
