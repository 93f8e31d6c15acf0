//! Typed reads of a JSON request body: every wrong type is a 400 naming the
//! field. Ranges are the engine's to check (`GenerationOptions::validate`).
//! Unknown fields are ignored, as OpenAI and llama-server do.

use serde_json::{Map, Value};

use crate::api_error::{ApiError, ApiResult};

pub struct Fields {
    map: Map<String, Value>,
}

/// Parses a body that must be one JSON object.
pub fn parse_body(bytes: &[u8]) -> ApiResult<Fields> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request("the request body is empty: send a JSON object"));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => Ok(Fields { map }),
        other => Err(ApiError::bad_request(format!("the request body must be a JSON object, got {}", type_name(&other)))),
    }
}

pub use mlxcel_engine::chat_json::json_type_name as type_name;

fn wrong(name: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::field(name, format!("must be {expected}, got {}", type_name(got)))
}

/// A JSON number as an integer: whole numbers only (`8` or `8.0`).
pub fn as_integer(name: &str, value: &Value) -> ApiResult<i128> {
    if let Some(i) = value.as_i64() {
        return Ok(i.into());
    }
    if let Some(u) = value.as_u64() {
        return Ok(u.into());
    }
    match value.as_f64() {
        Some(f) if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e30 => Ok(f as i128),
        Some(f) => Err(ApiError::field(name, format!("must be an integer, got {f}"))),
        None => Err(wrong(name, "an integer", value)),
    }
}

impl Fields {
    /// The field's value; JSON `null` reads as absent.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    pub fn f64(&self, name: &str) -> ApiResult<Option<f64>> {
        self.get(name).map(|v| v.as_f64().ok_or_else(|| wrong(name, "a number", v))).transpose()
    }

    pub fn int(&self, name: &str) -> ApiResult<Option<i128>> {
        self.get(name).map(|v| as_integer(name, v)).transpose()
    }

    pub fn bool(&self, name: &str) -> ApiResult<Option<bool>> {
        self.get(name).map(|v| v.as_bool().ok_or_else(|| wrong(name, "true or false", v))).transpose()
    }

    pub fn str(&self, name: &str) -> ApiResult<Option<&str>> {
        self.get(name).map(|v| v.as_str().ok_or_else(|| wrong(name, "a string", v))).transpose()
    }

    pub fn object(&self, name: &str) -> ApiResult<Option<&Map<String, Value>>> {
        self.get(name).map(|v| v.as_object().ok_or_else(|| wrong(name, "an object", v))).transpose()
    }

    pub fn array(&self, name: &str) -> ApiResult<Option<&Vec<Value>>> {
        self.get(name).map(|v| v.as_array().ok_or_else(|| wrong(name, "an array", v))).transpose()
    }

    /// A string or an array of strings (`stop`).
    pub fn strings(&self, name: &str) -> ApiResult<Option<Vec<String>>> {
        let Some(value) = self.get(name) else { return Ok(None) };
        match value {
            Value::String(s) => Ok(Some(vec![s.clone()])),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| item.as_str().map(str::to_string).ok_or_else(|| wrong(&format!("{name}[{i}]"), "a string", item)))
                .collect::<ApiResult<Vec<_>>>()
                .map(Some),
            other => Err(wrong(name, "a string or an array of strings", other)),
        }
    }

    /// A JSON schema given as an object (or as its text).
    pub fn schema(&self, name: &str) -> ApiResult<Option<String>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(_)) | Some(Value::Bool(_)) => Ok(Some(self.map[name].to_string())),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(other) => Err(wrong(name, "a JSON schema (an object)", other)),
        }
    }
}
