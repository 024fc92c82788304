//! Reading a request body's fields: the body as a JSON object, a field's type with its
//! path named in the error, and the whole numbers of OpenAI's fields. The generation
//! settings are checked by `unmask::RequestSpec`.

use serde_json::Value;
use unmask_core::config::json_kind;

use crate::error::ApiError;

/// The body as a JSON object.
pub(crate) fn object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::unnamed(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::unnamed(format!(
            "the body: expected a JSON object, found {}",
            json_kind(&value)
        )));
    }
    Ok(value)
}

/// Deserializes `value`, naming the field at fault (`prefix` then serde's path).
pub(crate) fn typed<T: serde::de::DeserializeOwned>(
    value: Value,
    prefix: &str,
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let path = e.path().to_string();
        let field = match (prefix.is_empty(), path.as_str()) {
            (true, ".") => String::new(),
            (true, p) => p.to_string(),
            (false, ".") => prefix.to_string(),
            (false, p) if p.starts_with('[') => format!("{prefix}{p}"),
            (false, p) => format!("{prefix}.{p}"),
        };
        let inner = e.into_inner();
        if field.is_empty() {
            ApiError::unnamed(format!("the body does not fit the request: {inner}"))
        } else {
            ApiError::invalid(field.clone(), format!("{field}: {inner}"))
        }
    })
}

/// The field `name` of the body, which the request needs.
pub(crate) fn required(body: &mut Value, name: &str) -> Result<Value, ApiError> {
    match body.get_mut(name).map(Value::take) {
        Some(v) if !v.is_null() => Ok(v),
        _ => Err(ApiError::invalid(
            name,
            format!("{name}: this field is required"),
        )),
    }
}

pub(crate) fn whole(field: &str, v: Option<u64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(0) => Err(ApiError::invalid(
            field,
            format!("{field}: expected a whole number >= 1, found 0"),
        )),
        Some(n) => usize::try_from(n)
            .map(Some)
            .map_err(|_| ApiError::invalid(field, format!("{field}: {n} is too large"))),
    }
}
