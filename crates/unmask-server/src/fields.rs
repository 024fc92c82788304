//! Reading a request body's fields: the body as a JSON object, a field's type with its
//! path named in the error, and the numbers every endpoint checks the same way.

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

/// A number in (0, 1] as the f32 the sampler uses, checked in f32: a value that is in
/// range as f64 but rounds to 0 in f32 (1e-300) is refused with the value given and what
/// it becomes, not accepted here and refused later as "0".
pub(crate) fn fraction_f32(field: &'static str, value: f64) -> Result<f32, ApiError> {
    let single = value as f32;
    if single > 0.0 && single <= 1.0 {
        return Ok(single);
    }
    let rounded = if value > 0.0 && value <= 1.0 {
        format!(
            " (it is {single} in single precision, which the sampler uses; the smallest \
             positive value is {:e})",
            f32::from_bits(1)
        )
    } else {
        String::new()
    };
    Err(ApiError::invalid(
        field,
        format!(
            "{field}: expected a number in (0, 1], found {}{rounded}",
            number(value)
        ),
    ))
}

/// A number as a person would write it: 0.5, 1e-300 (not 300 zeros), 1e300.
pub(crate) fn number(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-4..1e6).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}
