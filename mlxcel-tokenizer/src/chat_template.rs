//! Hugging Face chat templates rendered with minijinja.
//!
//! The environment mirrors the one `transformers` builds for `apply_chat_template`:
//! `trim_blocks` and `lstrip_blocks` on, `raise_exception(msg)`, `strftime_now(fmt)`,
//! a `tojson` filter that behaves like Python's `json.dumps(..., ensure_ascii=False)`,
//! loop controls, and Python string/dict methods (`.strip()`, `.split()`, `.items()`, ...).
//! `{% generation %}` blocks (used by transformers to mark assistant spans) render their body.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Value};
use serde::Serialize;

use crate::error::{Error, Result};

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template. Cheap to render many times; `Send + Sync`.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

/// One chat message; templates see it as `{"role": ..., "content": ...}`.
///
/// `content` is a string, or a list of parts (text and images) that
/// templates see as Hugging Face's `[{"type": "text", "text": ...},
/// {"type": "image"}]`: vision-language chat templates write their image
/// placeholder for each image part.
///
/// Any other `Serialize` type (e.g. `serde_json::Value` with `tool_calls`) works too.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// A message's content: plain text, or text and image parts in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentPart {
    Text(String),
    Image(ImageSource),
}

/// Where an image part's file comes from. The bytes are the whole file
/// (PNG, JPEG, WebP, GIF or BMP); they are decoded when the prompt is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    Path(std::path::PathBuf),
    Bytes(std::sync::Arc<[u8]>),
}

impl ImageSource {
    /// What errors call this image: its path, or `image N` (1-based).
    pub fn describe(&self, index: usize) -> String {
        match self {
            ImageSource::Path(path) => path.display().to_string(),
            ImageSource::Bytes(_) => format!("image {}", index + 1),
        }
    }
}

impl Content {
    /// The image parts, in order.
    pub fn images(&self) -> impl Iterator<Item = &ImageSource> {
        let parts: &[ContentPart] = match self {
            Content::Text(_) => &[],
            Content::Parts(parts) => parts,
        };
        parts.iter().filter_map(|p| match p {
            ContentPart::Image(source) => Some(source),
            ContentPart::Text(_) => None,
        })
    }

    /// As a list of parts (plain text becomes one text part): how
    /// vision-language templates, which loop over parts, need it.
    pub fn into_parts(self) -> Content {
        match self {
            Content::Text(text) => Content::Parts(vec![ContentPart::Text(text)]),
            parts => parts,
        }
    }
}

impl From<String> for Content {
    fn from(text: String) -> Self {
        Content::Text(text)
    }
}

impl From<&str> for Content {
    fn from(text: &str) -> Self {
        Content::Text(text.to_string())
    }
}

impl From<&String> for Content {
    fn from(text: &String) -> Self {
        Content::Text(text.clone())
    }
}

impl From<Vec<ContentPart>> for Content {
    fn from(parts: Vec<ContentPart>) -> Self {
        Content::Parts(parts)
    }
}

impl Serialize for Content {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Content::Text(text) => serializer.serialize_str(text),
            Content::Parts(parts) => parts.serialize(serializer),
        }
    }
}

impl Serialize for ContentPart {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(if matches!(self, ContentPart::Text(_)) { 2 } else { 1 }))?;
        match self {
            ContentPart::Text(text) => {
                map.serialize_entry("type", "text")?;
                map.serialize_entry("text", text)?;
            }
            ContentPart::Image(_) => map.serialize_entry("type", "image")?,
        }
        map.end()
    }
}

impl ContentPart {
    pub fn text(text: impl Into<String>) -> Self {
        ContentPart::Text(text.into())
    }
    pub fn image_path(path: impl Into<std::path::PathBuf>) -> Self {
        ContentPart::Image(ImageSource::Path(path.into()))
    }
    pub fn image_bytes(bytes: impl Into<std::sync::Arc<[u8]>>) -> Self {
        ContentPart::Image(ImageSource::Bytes(bytes.into()))
    }
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<Content>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<Content>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<Content>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<Content>) -> Self {
        Self::new("assistant", content)
    }
}

/// Template variables besides `messages`.
///
/// Unset `tools` / `documents` are passed as `none`, as transformers does.
/// Maps built from `serde_json::Value` keep key order only with serde_json's
/// `preserve_order` feature; `Serialize` structs always keep field order.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    pub tools: Option<serde_json::Value>,
    pub documents: Option<serde_json::Value>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
    /// Extra variables such as `enable_thinking`; they override the ones above.
    pub extra: Vec<(String, serde_json::Value)>,
}

impl RenderOptions {
    pub fn with_generation_prompt(add_generation_prompt: bool) -> Self {
        Self {
            add_generation_prompt,
            ..Self::default()
        }
    }
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors become [`Error::ChatTemplate`] with the line.
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let source: String = source.into();
        let mut env = hf_environment();
        env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(&source))
            .map_err(template_error)?;
        Ok(Self { env, source })
    }

    /// The template text as given (before `{% generation %}` rewriting).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (anything serializable: [`Message`], `serde_json::Value`, ...).
    pub fn render<M: Serialize>(&self, messages: &[M], options: &RenderOptions) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from_serialize(messages)),
            (
                "add_generation_prompt".into(),
                Value::from(options.add_generation_prompt),
            ),
            ("tools".into(), optional_value(options.tools.as_ref())),
            (
                "documents".into(),
                optional_value(options.documents.as_ref()),
            ),
        ];
        let tokens = [
            ("bos_token", &options.bos_token),
            ("eos_token", &options.eos_token),
            ("pad_token", &options.pad_token),
            ("unk_token", &options.unk_token),
        ];
        for (name, token) in tokens {
            if let Some(token) = token {
                ctx.push((name.into(), Value::from(token.as_str())));
            }
        }
        for (name, value) in &options.extra {
            ctx.push((name.clone(), Value::from_serialize(value)));
        }
        let ctx: Value = ctx.into_iter().collect();
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(template_error)?;
        template.render(ctx).map_err(template_error)
    }
}

fn optional_value(value: Option<&serde_json::Value>) -> Value {
    value.map_or(Value::from(()), Value::from_serialize)
}

fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.set_formatter(python_formatter);
    env
}

/// Prints values as jinja2 does: `True`/`False`/`None`, Python float and container reprs.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &minijinja::State<'_, '_>,
    value: &Value,
) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => {}
        ValueKind::Number if !value.is_integer() => {}
        _ => return minijinja::escape_formatter(out, state, value),
    }
    let mut repr = String::new();
    python_repr(value, &mut repr)?;
    out.write_str(&repr).map_err(minijinja::Error::from)
}

fn python_repr(value: &Value, out: &mut String) -> Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Number => out.push_str(&python_float_repr(
            f64::try_from(value.clone()).unwrap_or(f64::NAN),
        )),
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

fn python_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, minijinja::Error> {
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        )
    })?;
    Ok(out)
}

fn template_error(err: minijinja::Error) -> Error {
    let mut message = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    if let Some(line) = err.line() {
        let _ = write!(message, " (line {line})");
    }
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        let _ = write!(message, ": {cause}");
        source = cause.source();
    }
    Error::ChatTemplate(message)
}

/// Rewrites `{% generation %}` / `{% endgeneration %}` to `{% if true %}` / `{% endif %}`,
/// keeping whitespace-control markers.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match rewrite_generation_tag(tag) {
            Some((replacement, consumed)) => {
                out.push_str(&replacement);
                rest = &tag[consumed..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// For a tag starting at `tag[0..2] == "{%"`, returns the rewritten tag and its length.
fn rewrite_generation_tag(tag: &str) -> Option<(String, usize)> {
    let end = tag.find("%}")? + 2;
    let inner = &tag[2..end - 2];
    let (open, inner) = split_marker_start(inner);
    let (inner, close) = split_marker_end(inner);
    let keyword = match inner.trim() {
        "generation" => "if true",
        "endgeneration" => "endif",
        _ => return None,
    };
    Some((format!("{{%{open} {keyword} {close}%}}"), end))
}

fn split_marker_start(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some(c @ ('-' | '+')) => s.split_at(c.len_utf8()),
        _ => ("", s),
    }
}

fn split_marker_end(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some(c @ ('-' | '+')) => s.split_at(s.len() - c.len_utf8()),
        _ => (s, ""),
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
        },
    };
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(seps) if seps.len() == 2 => (seps[0].clone(), seps[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut writer = PyJsonWriter {
        out: String::new(),
        ensure_ascii,
        sort_keys,
        indent,
        item_sep,
        key_sep,
    };
    writer.write_value(&value, 0)?;
    // Output is JSON, never HTML-escaped.
    Ok(Value::from_safe_string(writer.out))
}

struct PyJsonWriter {
    out: String,
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

impl PyJsonWriter {
    fn write_value(&mut self, value: &Value, depth: usize) -> Result<(), minijinja::Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.write_number(value),
            ValueKind::String => self.write_string(value.as_str().unwrap_or_default()),
            ValueKind::Map => self.write_map(value, depth)?,
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container('[', ']', items.len(), depth, |w, i, depth| {
                    w.write_value(&items[i], depth)
                })?;
            }
            ValueKind::Invalid => {
                // Propagates the stored error.
                value.try_iter()?;
                return Err(unserializable(value));
            }
            _ => return Err(unserializable(value)),
        }
        Ok(())
    }

    fn write_map(&mut self, value: &Value, depth: usize) -> Result<(), minijinja::Error> {
        let mut entries: Vec<(String, Value)> = Vec::new();
        for key in value.try_iter()? {
            let item = value.get_item(&key)?;
            let key = match key.kind() {
                ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                ValueKind::None | ValueKind::Undefined => "null".into(),
                ValueKind::Bool | ValueKind::Number => {
                    let mut key_writer = self.nested();
                    key_writer.write_value(&key, 0)?;
                    key_writer.out
                }
                _ => return Err(unserializable(&key)),
            };
            entries.push((key, item));
        }
        if self.sort_keys {
            entries.sort_by(|a, b| a.0.cmp(&b.0));
        }
        self.write_container('{', '}', entries.len(), depth, |w, i, depth| {
            let (key, item) = &entries[i];
            w.write_string(key);
            let key_sep = w.key_sep.clone();
            w.out.push_str(&key_sep);
            w.write_value(item, depth)
        })
    }

    fn write_container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut write_item: impl FnMut(&mut Self, usize, usize) -> Result<(), minijinja::Error>,
    ) -> Result<(), minijinja::Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                let sep = self.item_sep.clone();
                self.out.push_str(&sep);
            }
            self.newline(depth + 1);
            write_item(self, i, depth + 1)?;
        }
        self.newline(depth);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn nested(&self) -> Self {
        Self {
            out: String::new(),
            ensure_ascii: self.ensure_ascii,
            sort_keys: self.sort_keys,
            indent: None,
            item_sep: self.item_sep.clone(),
            key_sep: self.key_sep.clone(),
        }
    }

    fn write_number(&mut self, value: &Value) {
        if value.is_integer() {
            let _ = write!(self.out, "{value}");
            return;
        }
        let float = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        self.out.push_str(&python_float_repr(float));
    }

    fn write_string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

fn unserializable(value: &Value) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "tojson: object of kind {} is not JSON serializable",
            value.kind()
        ),
    )
}

/// Python's `repr(float)`: shortest round-trip digits, exponent outside `[1e-4, 1e16)`.
fn python_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's Debug uses the same shortest digits and the same exponent thresholds.
    let repr = format!("{x:?}");
    match repr.split_once('e') {
        None => repr,
        Some((mantissa, exponent)) => {
            let (sign, digits) = match exponent.strip_prefix('-') {
                Some(digits) => ('-', digits),
                None => ('+', exponent),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1e15), "1000000000000000.0");
        assert_eq!(python_float_repr(1.5e-7), "1.5e-07");
        assert_eq!(python_float_repr(0.0001), "0.0001");
        assert_eq!(python_float_repr(-2.5e300), "-2.5e+300");
    }

    #[test]
    fn generation_tags_are_rewritten() {
        assert_eq!(
            strip_generation_tags("a{%- generation -%}b{% endgeneration %}{% if x %}"),
            "a{%- if true -%}b{% endif %}{% if x %}"
        );
    }

    #[test]
    fn chat_template_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
