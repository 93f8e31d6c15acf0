//! OpenAI's routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine::{messages_from_json, Content, ContentPart, GenerationOutput, ImagePolicy, MessageError, Prompt, StreamEvent};
use serde_json::{json, Value};

use crate::api_error::{ApiError, ApiResult};
use crate::completion::{self, chat_logprobs, completion_logprobs, finish_reason, response_id, timings, unix_time, usage};
use crate::fields::{parse_body, type_name, Fields};
use crate::params::{self, Dialect, Parsed};
use crate::state::{AppState, Loaded};

pub async fn models(State(state): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let loaded = state.loaded()?;
    let mut data = vec![json!({
        "id": state.config.alias,
        "object": "model",
        "created": unix_time(),
        "owned_by": "mlxcel",
        "meta": {
            "n_ctx_train": loaded.summary.context_length,
            "n_params": loaded.summary.parameters,
            "n_vocab": loaded.summary.vocab_size,
            "size": loaded.summary.weight_bytes,
        },
    })];
    if let Some((name, embedder)) = &loaded.embedder {
        data.push(json!({
            "id": name,
            "object": "model",
            "created": unix_time(),
            "owned_by": "mlxcel",
            "meta": { "n_embd": embedder.dims(), "n_ctx_train": embedder.max_tokens(), "pooling": embedder.model().pooling().name() },
        }));
    }
    if let Some((name, reranker)) = &loaded.reranker {
        data.push(json!({
            "id": name,
            "object": "model",
            "created": unix_time(),
            "owned_by": "mlxcel",
            "meta": { "n_ctx_train": reranker.model().max_tokens(), "pooling": "rank" },
        }));
    }
    if let Some((name, transcriber)) = &loaded.transcriber {
        data.push(json!({
            "id": name,
            "object": "model",
            "created": unix_time(),
            "owned_by": "mlxcel",
            "meta": { "task": "speech-to-text", "multilingual": transcriber.is_multilingual() },
        }));
    }
    Ok(Json(json!({ "object": "list", "data": data })))
}

/// The OpenAI-only fields: `n`, `logprobs`/`top_logprobs`, `stream_options`.
struct OpenAiExtras {
    include_usage: bool,
}

fn openai_fields(fields: &Fields, parsed: &mut Parsed, chat: bool) -> ApiResult<OpenAiExtras> {
    if let Some(n) = fields.int("n")? {
        if n != 1 {
            return Err(ApiError::field("n", format!("only n = 1 is supported, got {n}")));
        }
    }
    if chat {
        let wanted = fields.bool("logprobs")?.unwrap_or(false);
        let top = fields.int("top_logprobs")?;
        if top.is_some() && !wanted {
            return Err(ApiError::field("top_logprobs", "needs `logprobs: true`"));
        }
        if wanted {
            parsed.options.logprobs = Some(top.unwrap_or(0).clamp(i64::MIN as i128, i64::MAX as i128) as i64);
        }
    } else if let Some(n) = fields.int("logprobs")? {
        parsed.options.logprobs = Some(n.clamp(i64::MIN as i128, i64::MAX as i128) as i64);
    }
    if fields.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::field("echo", "echo is not supported"));
    }
    if let Some(tools) = fields.array("tools")? {
        if !tools.is_empty() {
            return Err(ApiError::field("tools", "tool calling is not supported yet"));
        }
    }
    let include_usage = match fields.object("stream_options")? {
        Some(options) => match options.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(ApiError::field("stream_options.include_usage", format!("must be a boolean, got {}", type_name(other)))),
        },
        None => false,
    };
    Ok(OpenAiExtras { include_usage })
}

/// `messages`: each an object with a string `role`; `content` a string, an
/// array of parts (OpenAI's `text` and `image_url` with a data URL), or null.
fn chat_messages(fields: &Fields) -> ApiResult<Vec<Value>> {
    let messages = fields.array("messages")?.ok_or_else(|| ApiError::field("messages", "is required"))?;
    if messages.is_empty() {
        return Err(ApiError::field("messages", "must not be empty"));
    }
    for (i, message) in messages.iter().enumerate() {
        let name = format!("messages[{i}]");
        let message = message.as_object().ok_or_else(|| ApiError::field(&name, format!("must be an object, got {}", type_name(message))))?;
        if !message.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::field(&format!("{name}.role"), "must be a string"));
        }
    }
    Ok(messages.clone())
}

/// The engine's reading of JSON messages (content parts, data URLs, the
/// image size limit) as an HTTP error: 413 for an image over
/// `--max-image-bytes`, else 400 naming the part.
fn message_error(e: MessageError) -> ApiError {
    if e.too_large {
        let message = format!("{e} (raise --max-image-bytes)");
        return ApiError::new(axum::http::StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message);
    }
    ApiError::field(&e.part, &e.message)
}

/// The prompt and its token count: text-only messages rendered with the
/// server's template (any extra keys kept); messages with images as the
/// engine's chat prompt (the model's own template, image tokens counted).
fn chat_prompt(loaded: &Loaded, messages: &[Value]) -> ApiResult<(Prompt, usize)> {
    let policy = ImagePolicy { local_files: false, max_bytes: loaded.max_image_bytes };
    let parsed = messages_from_json(messages, &policy).map_err(message_error)?;
    if !parsed.iter().any(|m| m.content.images().next().is_some()) {
        // Text parts joined, as the server's (or any) template reads a string.
        let texts: Vec<Value> = messages
            .iter()
            .zip(&parsed)
            .map(|(raw, m)| {
                let mut raw = raw.as_object().cloned().unwrap_or_default();
                let text = match &m.content {
                    Content::Text(t) => t.clone(),
                    Content::Parts(parts) => parts.iter().map(|p| if let ContentPart::Text(t) = p { t.as_str() } else { "" }).collect(),
                };
                raw.insert("content".into(), Value::String(text));
                Value::Object(raw)
            })
            .collect();
        let text = loaded.render_chat(&texts, true)?;
        let ids = loaded.engine.tokenize(&text, false).map_err(|e| ApiError::field("messages", e))?;
        let n = ids.len();
        return Ok((Prompt::Tokens(ids), n));
    }
    if loaded.chat_template.is_some() {
        return Err(ApiError::field("messages", "images need the model's own chat template (this server runs with --chat-template)"));
    }
    let prompt = Prompt::Chat(parsed);
    let ids = loaded.engine.tokenize_prompt(&prompt).map_err(|e| ApiError::from_engine(&e, |n| n))?;
    Ok((prompt, ids.len()))
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    chat(state, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn chat(state: Arc<AppState>, body: Bytes) -> ApiResult<Response> {
    let loaded = state.loaded()?;
    let fields = parse_body(&body)?;
    let messages = chat_messages(&fields)?;
    let mut parsed = params::parse(&fields, &loaded, Dialect::OpenAiChat)?;
    let extras = openai_fields(&fields, &mut parsed, true)?;
    let (prompt, n_prompt) = chat_prompt(&loaded, &messages)?;
    let prepared = completion::prepare_prompt(&loaded, prompt, n_prompt, &parsed, Dialect::OpenAiChat)?;
    let (generation, first) = completion::start(&state, &loaded, prepared).await?;
    let envelope = Envelope::new(&state, "chatcmpl");
    let want_logprobs = parsed.options.logprobs.is_some();

    if !parsed.stream {
        let output = completion::collect(generation, first, Dialect::OpenAiChat).await?;
        let choice = json!({
            "index": 0,
            "message": { "role": "assistant", "content": output.text },
            "logprobs": if want_logprobs { chat_logprobs(&loaded, &output.logprobs) } else { Value::Null },
            "finish_reason": finish_reason(&output),
        });
        return Ok(Json(envelope.response("chat.completion", choice, &output)).into_response());
    }

    let mut first_piece = true;
    let to_json = move |event: StreamEvent| -> Vec<Value> {
        match event {
            StreamEvent::Piece { text, logprobs, .. } => {
                let mut delta = json!({ "content": text });
                if std::mem::take(&mut first_piece) {
                    delta["role"] = json!("assistant");
                }
                let logprobs = if want_logprobs { chat_logprobs(&loaded, &logprobs) } else { Value::Null };
                vec![envelope.wrap("chat.completion.chunk", json!([{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": Value::Null }]))]
            }
            StreamEvent::Done(output) => {
                let last = json!({ "index": 0, "delta": {}, "logprobs": Value::Null, "finish_reason": finish_reason(&output) });
                envelope.last_chunks("chat.completion.chunk", last, &output, extras.include_usage)
            }
            StreamEvent::Failed(_) => Vec::new(),
        }
    };
    Ok(completion::sse(generation, first, to_json, true, Dialect::OpenAiChat))
}

/// What every OpenAI response and chunk of one request shares.
struct Envelope {
    id: String,
    created: u64,
    model: String,
}

impl Envelope {
    fn new(state: &AppState, prefix: &str) -> Self {
        Envelope { id: response_id(prefix), created: unix_time(), model: state.config.alias.clone() }
    }

    fn wrap(&self, object: &str, choices: Value) -> Value {
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "system_fingerprint": crate::SYSTEM_FINGERPRINT, "choices": choices })
    }

    /// A whole (unstreamed) response.
    fn response(&self, object: &str, choice: Value, output: &GenerationOutput) -> Value {
        let mut body = self.wrap(object, json!([choice]));
        body["usage"] = usage(&output.stats);
        body["timings"] = timings(&output.stats);
        body
    }

    /// The chunk with the finish reason (and llama-server's `timings`), then the usage chunk if asked for.
    fn last_chunks(&self, object: &str, last_choice: Value, output: &GenerationOutput, include_usage: bool) -> Vec<Value> {
        let mut last = self.wrap(object, json!([last_choice]));
        last["timings"] = timings(&output.stats);
        let mut chunks = vec![last];
        if include_usage {
            let mut usage_chunk = self.wrap(object, json!([]));
            usage_chunk["usage"] = usage(&output.stats);
            usage_chunk["timings"] = timings(&output.stats);
            chunks.push(usage_chunk);
        }
        chunks
    }
}

pub async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    text_completion(state, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// OpenAI's `prompt`: a string, one string in an array, or token ids.
fn prompt_tokens(loaded: &Loaded, fields: &Fields) -> ApiResult<Vec<u32>> {
    let name = "prompt";
    let value = fields.get(name).ok_or_else(|| ApiError::field(name, "is required"))?;
    let from_ids = |items: &[Value]| -> ApiResult<Vec<u32>> {
        items
            .iter()
            .map(|v| {
                let id = crate::fields::as_integer(name, v)?;
                u32::try_from(id).map_err(|_| ApiError::field(name, format!("token id {id} is out of range")))
            })
            .collect()
    };
    let tokenize = |text: &str| loaded.engine.tokenize(text, true).map_err(|e| ApiError::field(name, e));
    match value {
        Value::String(text) => tokenize(text),
        Value::Array(items) => match items.as_slice() {
            [Value::String(text)] => tokenize(text),
            [Value::Array(ids)] => from_ids(ids),
            items if !items.is_empty() && items.iter().all(Value::is_number) => from_ids(items),
            [] => Err(ApiError::field(name, "must not be empty")),
            _ => Err(ApiError::field(name, "give one prompt (a string or token ids); batches of prompts are not supported, send them as concurrent requests")),
        },
        other => Err(ApiError::field(name, format!("must be a string or token ids, got {}", type_name(other)))),
    }
}

async fn text_completion(state: Arc<AppState>, body: Bytes) -> ApiResult<Response> {
    let loaded = state.loaded()?;
    let fields = parse_body(&body)?;
    let prompt = prompt_tokens(&loaded, &fields)?;
    let mut parsed = params::parse(&fields, &loaded, Dialect::OpenAiCompletions)?;
    let extras = openai_fields(&fields, &mut parsed, false)?;
    let prepared = completion::prepare(&loaded, prompt, &parsed, Dialect::OpenAiCompletions)?;
    let (generation, first) = completion::start(&state, &loaded, prepared).await?;
    let envelope = Envelope::new(&state, "cmpl");
    let want_logprobs = parsed.options.logprobs.is_some();

    if !parsed.stream {
        let output = completion::collect(generation, first, Dialect::OpenAiCompletions).await?;
        let choice = json!({
            "index": 0,
            "text": output.text,
            "logprobs": if want_logprobs { completion_logprobs(&loaded, &output.logprobs, 0) } else { Value::Null },
            "finish_reason": finish_reason(&output),
        });
        return Ok(Json(envelope.response("text_completion", choice, &output)).into_response());
    }

    let mut offset = 0;
    let to_json = move |event: StreamEvent| -> Vec<Value> {
        match event {
            StreamEvent::Piece { text, logprobs, .. } => {
                let logprobs = if want_logprobs { completion_logprobs(&loaded, &logprobs, offset) } else { Value::Null };
                offset += text.len();
                vec![envelope.wrap("text_completion", json!([{ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": Value::Null }]))]
            }
            StreamEvent::Done(output) => {
                let last = json!({ "index": 0, "text": "", "logprobs": Value::Null, "finish_reason": finish_reason(&output) });
                envelope.last_chunks("text_completion", last, &output, extras.include_usage)
            }
            StreamEvent::Failed(_) => Vec::new(),
        }
    };
    Ok(completion::sse(generation, first, to_json, true, Dialect::OpenAiCompletions))
}

/// OpenAI's embeddings: `input` a string or an array of strings (token-id
/// inputs are refused), `encoding_format` `float` or `base64` (little-endian
/// float32, the SDKs' default), `dimensions` only the model's own.
pub async fn embeddings(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    embed(state, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn embed(state: Arc<AppState>, body: Bytes) -> ApiResult<Response> {
    let loaded = state.loaded()?;
    let Some((name, embedder)) = loaded.embedder.clone() else {
        return Err(ApiError::not_supported(
            "this server has no embedding model: start it with --embedding-model PATH|NAME (e.g. all-MiniLM-L6-v2)",
        ));
    };
    let fields = parse_body(&body)?;
    let input = fields.get("input").ok_or_else(|| ApiError::field("input", "is required"))?;
    let texts: Vec<String> = match input {
        Value::String(text) => vec![text.clone()],
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Ok(text.clone()),
                Value::Number(_) | Value::Array(_) => Err(ApiError::field("input", "token-id inputs are not supported; send text")),
                other => Err(ApiError::field("input", format!("items must be strings, got {}", type_name(other)))),
            })
            .collect::<ApiResult<_>>()?,
        other => Err(ApiError::field("input", format!("must be a string or an array of strings, got {}", type_name(other))))?,
    };
    let base64 = match fields.str("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::field("encoding_format", format!("`{other}` (float or base64)"))),
    };
    if let Some(dimensions) = fields.int("dimensions")? {
        if dimensions != embedder.dims() as i128 {
            return Err(ApiError::field("dimensions", format!("{name} makes vectors of {} dimensions only, got {dimensions}", embedder.dims())));
        }
    }
    let out = tokio::task::spawn_blocking(move || embedder.embed(&texts))
        .await
        .map_err(|e| ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("the embedding task failed: {e}")))?
        .map_err(|e| ApiError::from_engine(&e, |n| n))?;
    let data: Vec<Value> = out
        .vectors
        .iter()
        .enumerate()
        .map(|(index, vector)| {
            let embedding = if base64 {
                use base64::Engine as _;
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({ "object": "embedding", "index": index, "embedding": embedding })
        })
        .collect();
    let tokens: usize = out.token_counts.iter().sum();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": name,
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
    }))
    .into_response())
}
