//! A request's sampling fields → the engine's `GenerationOptions`, over the
//! server's defaults (llama-server's command-line sampling flags). The names
//! are llama-server's and OpenAI's; the ranges are the engine's.

use mlxcel_engine::GenerationOptions;
use serde_json::Value;

use crate::api_error::{ApiError, ApiResult};
use crate::fields::{as_integer, type_name, Fields};
use crate::state::Loaded;

/// Which API a request came in on: the names of its fields differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// `/v1/chat/completions`: `logprobs` is a switch, `top_logprobs` the count.
    OpenAiChat,
    /// `/v1/completions`: `logprobs` is the count.
    OpenAiCompletions,
    Llama,
}

/// What a generation route reads besides the prompt.
pub struct Parsed {
    pub options: GenerationOptions,
    /// None: generate until the slot's context is full (`n_predict` -1).
    pub max_tokens: Option<i128>,
    pub ignore_eos: bool,
    pub cache_prompt: bool,
    pub stream: bool,
}

/// The name a request uses for an engine option, for error messages.
pub fn rename(dialect: Dialect) -> impl Fn(&str) -> &str {
    move |engine_name| match (dialect, engine_name) {
        (Dialect::Llama, "max_tokens") => "n_predict",
        (Dialect::Llama, "repetition_penalty") => "repeat_penalty",
        (Dialect::Llama, "repetition_context_size") => "repeat_last_n",
        (Dialect::Llama, "logprobs") => "n_probs",
        (Dialect::OpenAiChat, "logprobs") => "top_logprobs",
        (_, other) => other,
    }
}

pub fn parse(fields: &Fields, loaded: &Loaded, dialect: Dialect) -> ApiResult<Parsed> {
    let mut o = loaded.defaults.clone();
    let mut max_tokens = loaded.n_predict;

    // Fields copied as they are (counts clamped into the engine's i64; its checks name the field).
    let real = |name: &str, slot: &mut f64| -> ApiResult<()> {
        if let Some(v) = fields.f64(name)? {
            *slot = v;
        }
        Ok(())
    };
    let count = |name: &str, slot: &mut i64| -> ApiResult<()> {
        if let Some(v) = fields.int(name)? {
            *slot = clamp_i64(v);
        }
        Ok(())
    };
    real("temperature", &mut o.temperature)?;
    real("top_p", &mut o.top_p)?;
    real("min_p", &mut o.min_p)?;
    real("typical_p", &mut o.typical_p)?;
    real("repeat_penalty", &mut o.repetition_penalty)?;
    real("presence_penalty", &mut o.presence_penalty)?;
    real("frequency_penalty", &mut o.frequency_penalty)?;
    real("dry_multiplier", &mut o.dry_multiplier)?;
    real("dry_base", &mut o.dry_base)?;
    real("xtc_probability", &mut o.xtc_probability)?;
    real("xtc_threshold", &mut o.xtc_threshold)?;
    count("dry_allowed_length", &mut o.dry_allowed_length)?;
    count("dry_penalty_last_n", &mut o.dry_penalty_last_n)?;
    count("min_keep", &mut o.min_keep)?;
    count("speculative.n_max", &mut o.draft_max)?;
    count("speculative.n_min", &mut o.draft_min)?;
    if let Some(k) = fields.int("top_k")? {
        // llama-server: top_k <= 0 keeps every token.
        o.top_k = if k <= 0 && dialect == Dialect::Llama { 0 } else { clamp_i64(k) };
    }
    if let Some(n) = fields.int("repeat_last_n")? {
        o.repetition_context_size = if n == -1 { loaded.n_ctx_slot as i64 } else { clamp_i64(n) };
    }
    if let Some(v) = fields.f64("top_n_sigma")? {
        o.top_n_sigma = if v < 0.0 { 0.0 } else { v };
    }
    if let Some(v) = fields.strings("dry_sequence_breakers")? {
        o.dry_sequence_breakers = Some(v);
    }
    if let Some(v) = fields.strings("samplers")? {
        o.samplers = Some(v);
    }
    if let Some(seed) = fields.int("seed")? {
        // llama-server: -1 (its default) draws a random seed.
        o.seed = (seed != -1).then_some(seed);
    }
    if let Some(stop) = fields.strings("stop")? {
        o.stop = stop;
    }
    if let Some(value) = fields.get("logit_bias") {
        o.logit_bias = logit_bias(value, loaded)?;
    }
    if let Some(v) = fields.bool("post_sampling_probs")? {
        o.post_sampling_probs = v;
    }
    if let Some(method) = fields.str("speculation")? {
        o.speculation = Some(method.to_string());
    }

    let names: &[&str] = match dialect {
        Dialect::OpenAiChat | Dialect::OpenAiCompletions => &["max_completion_tokens", "max_tokens", "n_predict"],
        Dialect::Llama => &["n_predict", "max_tokens"],
    };
    if let Some(name) = names.iter().copied().find(|n| fields.has(n)) {
        let n = fields.int(name)?.expect("present");
        max_tokens = match n {
            -1 => None,
            n if n < 1 => return Err(ApiError::field(name, format!("must be -1 (until the context is full) or an integer >= 1, got {n}"))),
            n => Some(n),
        };
    }

    // Logprobs: llama-server's n_probs, OpenAI's logprobs / top_logprobs.
    if let Some(n) = fields.int("n_probs")? {
        o.logprobs = (n > 0).then(|| clamp_i64(n));
    }

    // Structured output.
    let mut constraints: Vec<(&str, String)> = Vec::new();
    if let Some(schema) = fields.schema("json_schema")? {
        constraints.push(("json_schema", schema));
    }
    if let Some(grammar) = fields.str("grammar")? {
        if !grammar.trim().is_empty() {
            constraints.push(("grammar", crate::gbnf::to_lark_if_gbnf(grammar).map_err(|e| ApiError::field("grammar", e))?));
        }
    }
    if let Some(regex) = fields.str("regex")? {
        constraints.push(("regex", regex.to_string()));
    }
    if let Some(format) = fields.object("response_format")? {
        if let Some(schema) = response_format(format)? {
            constraints.push(("response_format", schema));
        }
    }
    if constraints.len() > 1 {
        let names: Vec<&str> = constraints.iter().map(|c| c.0).collect();
        return Err(ApiError::field(names[1], format!("give one constraint, not {}", names.join(" and "))));
    }
    if let Some((name, text)) = constraints.pop() {
        match name {
            "grammar" => o.grammar = Some(text),
            "regex" => o.regex = Some(text),
            _ => o.json_schema = Some(text),
        }
    }

    Ok(Parsed {
        options: o,
        max_tokens,
        ignore_eos: fields.bool("ignore_eos")?.unwrap_or(false),
        cache_prompt: fields.bool("cache_prompt")?.unwrap_or(true),
        stream: fields.bool("stream")?.unwrap_or(false),
    })
}

fn clamp_i64(v: i128) -> i64 {
    v.clamp(i64::MIN as i128, i64::MAX as i128) as i64
}

/// OpenAI's `response_format`: `{"type": "text" | "json_object" | "json_schema", ...}`.
fn response_format(format: &serde_json::Map<String, Value>) -> ApiResult<Option<String>> {
    let kind = format.get("type").and_then(Value::as_str).unwrap_or("text");
    match kind {
        "text" => Ok(None),
        // llama-server also takes a schema beside json_object.
        "json_object" => Ok(Some(format.get("schema").map_or_else(|| r#"{"type":"object"}"#.to_string(), Value::to_string))),
        "json_schema" => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .or_else(|| format.get("schema"))
                .ok_or_else(|| ApiError::field("response_format", "type json_schema needs `json_schema.schema`"))?;
            Ok(Some(schema.to_string()))
        }
        other => Err(ApiError::field("response_format", format!("unknown type {other:?} (known: text, json_object, json_schema)"))),
    }
}

/// OpenAI's `{"token id": bias}` or llama-server's `[[id or text, bias or false], ...]`;
/// a text entry biases each of its tokens, `false` bans.
fn logit_bias(value: &Value, loaded: &Loaded) -> ApiResult<Vec<(i128, f64)>> {
    let bias_of = |name: &str, v: &Value| -> ApiResult<f64> {
        match v {
            Value::Bool(false) => Ok(f64::NEG_INFINITY),
            v => v.as_f64().ok_or_else(|| ApiError::field(name, format!("a bias must be a number or false, got {}", type_name(v)))),
        }
    };
    let ids_of = |name: &str, key: &Value| -> ApiResult<Vec<i128>> {
        match key {
            Value::String(text) => {
                if let Ok(id) = text.parse::<i128>() {
                    return Ok(vec![id]);
                }
                let ids = loaded.engine.tokenize(text, false).map_err(|e| ApiError::field(name, e))?;
                Ok(ids.into_iter().map(i128::from).collect())
            }
            other => Ok(vec![as_integer(name, other)?]),
        }
    };
    let mut out = Vec::new();
    match value {
        Value::Object(map) => {
            for (key, bias) in map {
                let bias = bias_of("logit_bias", bias)?;
                out.extend(ids_of("logit_bias", &Value::String(key.clone()))?.into_iter().map(|id| (id, bias)));
            }
        }
        Value::Array(items) => {
            for item in items {
                let pair = item.as_array().filter(|p| p.len() == 2).ok_or_else(|| ApiError::field("logit_bias", "each entry must be [token id or text, bias]"))?;
                let bias = bias_of("logit_bias", &pair[1])?;
                out.extend(ids_of("logit_bias", &pair[0])?.into_iter().map(|id| (id, bias)));
            }
        }
        other => return Err(ApiError::field("logit_bias", format!("must be an object or an array, got {}", type_name(other)))),
    }
    Ok(out)
}
