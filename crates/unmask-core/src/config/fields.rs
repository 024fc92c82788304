//! Typed access to the keys of a JSON object, with the errors that name the key.

use serde_json::{Map, Value};

use crate::error::ConfigError;

/// What kind of JSON value `value` is, for "expected …, found …" messages.
pub fn json_kind(value: &Value) -> &'static str {
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
pub(super) struct Fields<'a> {
    pub(super) map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn wrong(field: &'static str, expected: &'static str, value: &Value) -> ConfigError {
        ConfigError::WrongType {
            field,
            expected,
            found: describe(value),
        }
    }

    pub(super) fn opt_str(&self, field: &'static str) -> Result<Option<String>, ConfigError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(Self::wrong(field, "a string", other)),
        }
    }

    pub(super) fn str_or(&self, field: &'static str, default: &str) -> Result<String, ConfigError> {
        match self.map.get(field) {
            None => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(Self::wrong(field, "a string", other)),
        }
    }

    pub(super) fn opt_bool(&self, field: &'static str) -> Result<Option<bool>, ConfigError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(Self::wrong(field, "true, false or null", other)),
        }
    }

    pub(super) fn bool_or(&self, field: &'static str, default: bool) -> Result<bool, ConfigError> {
        match self.map.get(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(Self::wrong(field, "true or false", other)),
        }
    }

    /// The value of `key` read by `read`, or None when missing or null.
    fn opt<T>(
        &self,
        key: &str,
        read: impl FnOnce(&Value) -> Result<T, ConfigError>,
    ) -> Result<Option<T>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => read(value).map(Some),
        }
    }

    /// A positive integer, or None when missing or null.
    pub(super) fn opt_size(&self, field: &'static str) -> Result<Option<usize>, ConfigError> {
        self.opt(field, |v| Self::size(field, v))
    }

    /// A `top_k`: `None` when missing or null, `Some(None)` for 0 (transformers' "no cut"),
    /// `Some(Some(k))` for k >= 1. `field` names it in errors.
    pub(super) fn opt_top_k(
        &self,
        field: &'static str,
        key: &str,
    ) -> Result<Option<Option<u32>>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some_and(|k| k <= u32::MAX as u64) => {
                let k = n.as_u64().unwrap_or(0) as u32;
                Ok(Some((k > 0).then_some(k)))
            }
            Some(value) => Err(Self::wrong(
                field,
                "a whole number >= 0 (0: no cut) or null",
                value,
            )),
        }
    }

    pub(super) fn size_or(&self, field: &'static str, default: u64) -> Result<usize, ConfigError> {
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

    pub(super) fn opt_token_id(
        &self,
        field: &'static str,
        key: &str,
    ) -> Result<Option<u32>, ConfigError> {
        self.opt(key, |v| Self::token_id(field, v))
    }

    pub(super) fn token_id_or(
        &self,
        field: &'static str,
        default: u64,
    ) -> Result<u32, ConfigError> {
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

    pub(super) fn positive_float_or(
        &self,
        field: &'static str,
        default: f64,
    ) -> Result<f64, ConfigError> {
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
    use crate::config::tests::with;
    use crate::error::ConfigError;
    use serde_json::Value;

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
}
