//! Chat messages in OpenAI's JSON shape (what the server receives and the
//! Python binding's dicts become) as engine [`Message`]s with image parts.
//! One place for the part shapes, data URLs and the image size limit, so
//! every surface that takes JSON messages accepts and refuses the same ones.
//!
//! Parts: `{"type": "text", "text": ...}`; OpenAI's
//! `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
//! (or `"image_url": "data:..."`); `{"type": "image", "path": ...}` where
//! local files are allowed. Only `data:` URLs: nothing is fetched.

use base64::Engine as _;
use serde_json::Value;

use crate::error::Error;
use mlxcel_tokenizer::{Content, ContentPart, Message};

/// The default cap on one image's decoded bytes (OpenAI's 20 MB per image).
pub const DEFAULT_MAX_IMAGE_BYTES: usize = 20 << 20;

/// What JSON image parts may do.
#[derive(Debug, Clone, Copy)]
pub struct ImagePolicy {
    /// Whether `{"type": "image", "path": ...}` may name a local file (the
    /// server says no: a client must not read the server's files).
    pub local_files: bool,
    /// The most bytes one image may have once decoded.
    pub max_bytes: usize,
}

impl Default for ImagePolicy {
    fn default() -> Self {
        Self { local_files: true, max_bytes: DEFAULT_MAX_IMAGE_BYTES }
    }
}

/// Why a JSON message was refused: which part (`messages[0].content[1]`),
/// the engine parameter it counts against (`messages` for its shape,
/// `images` for an image), and whether the image was over the size limit
/// (the server answers 413 then). Converts into [`Error::InvalidParameter`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageError {
    pub part: String,
    pub parameter: &'static str,
    pub too_large: bool,
    pub message: String,
}

impl std::fmt::Display for MessageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.part, self.message)
    }
}

impl std::error::Error for MessageError {}

impl From<MessageError> for Error {
    fn from(e: MessageError) -> Self {
        Error::InvalidParameter { name: e.parameter, message: e.to_string() }
    }
}

type Result<T> = std::result::Result<T, MessageError>;

fn image_error(part: &str, message: impl std::fmt::Display) -> MessageError {
    MessageError { part: part.to_string(), parameter: "images", too_large: false, message: message.to_string() }
}

fn shape_error(part: &str, message: impl std::fmt::Display) -> MessageError {
    MessageError { part: part.to_string(), parameter: "messages", too_large: false, message: message.to_string() }
}

/// What a JSON value is, for error messages: "a string", "an array", ...
pub fn json_type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// An image from a URL: a `data:` URL's base64 payload, at most
/// `max_bytes` decoded; http(s) and other URLs are refused (nothing is
/// fetched). `part` names the part in errors (`messages[0].content[1]`).
pub fn image_from_url(url: &str, max_bytes: usize, part: &str) -> Result<ContentPart> {
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split_once(':').map_or("", |(s, _)| s);
        return Err(image_error(
            part,
            if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") {
                "image URLs are not fetched: send the image inline as a data URL (data:image/png;base64,...)".to_string()
            } else {
                format!("expected a data URL (data:image/png;base64,...), got {:?}", url.chars().take(40).collect::<String>())
            },
        ));
    };
    let (header, payload) = rest.split_once(',').ok_or_else(|| image_error(part, "a data URL needs a `,` before its data"))?;
    if !header.split(';').any(|p| p.eq_ignore_ascii_case("base64")) {
        return Err(image_error(part, "only base64 data URLs are supported (data:image/png;base64,...)"));
    }
    // Checked before decoding: base64 takes 4 characters for 3 bytes.
    let estimate = payload.len() / 4 * 3;
    if estimate > max_bytes.saturating_add(3) {
        return Err(too_large(part, estimate, max_bytes));
    }
    let payload: String = payload.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.as_bytes())
        .map_err(|e| image_error(part, format!("the data URL's base64 is invalid: {e}")))?;
    if bytes.len() > max_bytes {
        return Err(too_large(part, bytes.len(), max_bytes));
    }
    Ok(ContentPart::image_bytes(bytes))
}

fn too_large(part: &str, bytes: usize, max: usize) -> MessageError {
    MessageError { too_large: true, ..image_error(part, format!("the image is {bytes} bytes, more than the limit of {max} bytes")) }
}

/// One JSON content part as a [`ContentPart`].
pub fn part_from_json(value: &Value, policy: &ImagePolicy, part: &str) -> Result<ContentPart> {
    let Some(object) = value.as_object() else {
        return Err(shape_error(part, format!("a content part must be an object, got {}", json_type_name(value))));
    };
    let string = |key: &str| match object.get(key) {
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        None | Some(Value::Null) => Ok(None),
        Some(other) => Err(shape_error(part, format!("`{key}` must be a string, got {}", json_type_name(other)))),
    };
    match object.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ContentPart::text(string("text")?.ok_or_else(|| shape_error(part, "a text part needs `text`"))?)),
        Some("image_url") => {
            let url = match object.get("image_url") {
                Some(Value::String(url)) => url.as_str(),
                Some(Value::Object(inner)) => inner
                    .get("url")
                    .and_then(Value::as_str)
                    .ok_or_else(|| shape_error(part, "an image_url part needs `image_url.url`"))?,
                _ => return Err(shape_error(part, "an image_url part needs `image_url.url`")),
            };
            image_from_url(url, policy.max_bytes, part)
        }
        Some("image") => {
            if let Some(url) = string("url")?.or(string("image_url")?) {
                return image_from_url(url, policy.max_bytes, part);
            }
            match string("path")? {
                Some(_) if !policy.local_files => Err(image_error(part, "image paths are not accepted here: send the image as a data URL")),
                Some(path) => Ok(ContentPart::image_path(path)),
                None => Err(shape_error(part, "an image part needs `path` (or `url`, a data URL)")),
            }
        }
        Some(other) => Err(shape_error(part, format!("content parts of type {other:?} are not supported (text, image, image_url)"))),
        None => Err(shape_error(part, "a content part needs a `type`")),
    }
}

/// Whether any message's content is a list holding a non-text part.
pub fn has_image_parts(messages: &[Value]) -> bool {
    messages.iter().any(|m| {
        m.get("content").and_then(Value::as_array).is_some_and(|parts| {
            parts.iter().any(|p| p.get("type").and_then(Value::as_str).is_some_and(|t| t != "text"))
        })
    })
}

/// JSON messages (`{"role": ..., "content": string | [parts] | null}`) as
/// engine messages; other keys are not kept.
pub fn messages_from_json(messages: &[Value], policy: &ImagePolicy) -> Result<Vec<Message>> {
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let name = format!("messages[{i}]");
            let role = message
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| shape_error(&name, "a message needs a string `role`"))?;
            let content = match message.get("content") {
                None | Some(Value::Null) => Content::Text(String::new()),
                Some(Value::String(s)) => Content::Text(s.clone()),
                Some(Value::Array(parts)) => Content::Parts(
                    parts
                        .iter()
                        .enumerate()
                        .map(|(j, p)| part_from_json(p, policy, &format!("{name}.content[{j}]")))
                        .collect::<Result<_>>()?,
                ),
                Some(other) => return Err(shape_error(&name, format!("`content` must be a string or a list of parts, got {}", json_type_name(other)))),
            };
            Ok(Message::new(role, content))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parts_and_refusals() {
        let policy = ImagePolicy { local_files: false, max_bytes: 8 };
        let m = json!([{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": "data:image/png;base64,aGVsbG8=" } },
            { "type": "text", "text": "hi" } ] }]);
        let out = messages_from_json(m.as_array().unwrap(), &policy).unwrap();
        assert_eq!(out[0].content, Content::Parts(vec![ContentPart::image_bytes(b"hello".to_vec()), ContentPart::text("hi")]));
        assert!(has_image_parts(m.as_array().unwrap()));
        let err = |part: Value| part_from_json(&part, &policy, "p").unwrap_err().to_string();
        assert!(err(json!({ "type": "image_url", "image_url": { "url": "https://x/a.png" } })).contains("not fetched"));
        assert!(err(json!({ "type": "image", "path": "/etc/passwd" })).contains("not accepted"));
        assert!(err(json!({ "type": "image_url", "image_url": { "url": "data:image/png;base64,aGVsbG8gd29ybGQh" } })).contains("limit of 8"));
        let big = part_from_json(&json!({ "type": "image_url", "image_url": { "url": "data:image/png;base64,aGVsbG8gd29ybGQh" } }), &policy, "p").unwrap_err();
        assert!(big.too_large && big.parameter == "images");
        assert!(err(json!({ "type": "image_url", "image_url": { "url": "data:image/png;base64,@@@@" } })).contains("base64"));
        assert!(err(json!({ "type": "audio" })).contains("\"audio\""));
        assert!(err(json!({ "type": "image_url", "image_url": {} })).contains("image_url.url"));
    }
}
