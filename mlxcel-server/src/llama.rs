//! llama-server's routes: `/completion`, `/tokenize`, `/detokenize`,
//! `/apply-template`, `/props`, `/slots`, `/health`, `/metrics`.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlxcel_engine::{FinishReason, GenerationOutput, StreamEvent};
use serde_json::{json, Value};

use crate::api_error::{ApiError, ApiResult};
use crate::completion::{self, llama_probabilities, timings};
use crate::fields::{as_integer, parse_body, type_name, Fields};
use crate::params::{self, Dialect};
use crate::state::{AppState, Loaded};

pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.loaded() {
        Ok(_) => Json(json!({ "status": "ok" })).into_response(),
        Err(error) => error.into_response(),
    }
}

/// `prompt`: a string, token ids, or a mix of both.
fn llama_prompt(loaded: &Loaded, fields: &Fields) -> ApiResult<Vec<u32>> {
    let value = fields.get("prompt").ok_or_else(|| ApiError::field("prompt", "is required"))?;
    let tokenize = |text: &str, special: bool| loaded.engine.tokenize(text, special).map_err(|e| ApiError::field("prompt", e));
    match value {
        Value::String(text) => tokenize(text, true),
        Value::Array(items) => {
            let mut ids = Vec::new();
            for (i, item) in items.iter().enumerate() {
                match item {
                    Value::String(text) => ids.extend(tokenize(text, i == 0)?),
                    Value::Array(_) => return Err(ApiError::field("prompt", "batches of prompts are not supported; send them as concurrent requests")),
                    other => {
                        let id = as_integer("prompt", other)?;
                        ids.push(u32::try_from(id).map_err(|_| ApiError::field("prompt", format!("token id {id} is out of range")))?);
                    }
                }
            }
            Ok(ids)
        }
        other => Err(ApiError::field("prompt", format!("must be a string or token ids, got {}", type_name(other)))),
    }
}

pub async fn completion(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    run_completion(state, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn run_completion(state: Arc<AppState>, body: Bytes) -> ApiResult<Response> {
    let loaded = state.loaded()?;
    let fields = parse_body(&body)?;
    let prompt = llama_prompt(&loaded, &fields)?;
    let parsed = params::parse(&fields, &loaded, Dialect::Llama)?;
    let return_tokens = fields.bool("return_tokens")?.unwrap_or(false);
    let timings_per_token = fields.bool("timings_per_token")?.unwrap_or(false);
    let stop_strings = parsed.options.stop.clone();
    let n_prompt = prompt.len();
    let prepared = completion::prepare(&loaded, prompt, &parsed, Dialect::Llama)?;
    let (generation, first) = completion::start(&state, &loaded, prepared).await?;
    let slot = generation.slot;
    let model = state.config.alias.clone();
    let want_probs = parsed.options.logprobs.is_some();

    let final_body = {
        let loaded = loaded.clone();
        move |output: &GenerationOutput, content: &str| {
            let (stop_type, stopping_word) = stop_type(&loaded, output, &stop_strings);
            let mut body = json!({
                "index": 0,
                "content": content,
                "id_slot": slot,
                "stop": true,
                "model": model,
                "tokens_predicted": output.stats.generated_tokens,
                "tokens_evaluated": n_prompt,
                "tokens_cached": output.stats.cached_tokens,
                "truncated": false,
                "has_new_line": output.text.contains('\n'),
                "stop_type": stop_type,
                "stopping_word": stopping_word,
                "timings": timings(&output.stats),
            });
            if return_tokens {
                body["tokens"] = json!(output.tokens);
            }
            body
        }
    };

    if !parsed.stream {
        let output = completion::collect(generation, first, Dialect::Llama).await?;
        let mut body = final_body(&output, &output.text);
        if want_probs {
            body["completion_probabilities"] = llama_probabilities(&loaded, &output.logprobs);
        }
        return Ok(Json(body).into_response());
    }

    let started = std::time::Instant::now();
    let mut decoded = 0usize;
    let to_json = move |event: StreamEvent| -> Vec<Value> {
        match event {
            StreamEvent::Piece { text, token, logprobs } => {
                decoded += 1;
                let mut chunk = json!({ "index": 0, "content": text, "stop": false, "id_slot": slot, "tokens_predicted": decoded, "tokens_evaluated": n_prompt });
                if return_tokens {
                    chunk["tokens"] = json!([token]);
                }
                if want_probs {
                    chunk["completion_probabilities"] = llama_probabilities(&loaded, &logprobs);
                }
                if timings_per_token {
                    chunk["timings"] = json!({ "predicted_n": decoded, "predicted_ms": started.elapsed().as_secs_f64() * 1e3 });
                }
                vec![chunk]
            }
            StreamEvent::Done(output) => {
                let mut body = final_body(&output, "");
                body.as_object_mut().expect("object").remove("tokens");
                vec![body]
            }
            StreamEvent::Failed(_) => Vec::new(),
        }
    };
    Ok(completion::sse(generation, first, to_json, false, Dialect::Llama))
}

/// llama-server's `stop_type`: `eos`, `word` (a stop string) or `limit`.
fn stop_type(loaded: &Loaded, output: &GenerationOutput, stop: &[String]) -> (&'static str, String) {
    match output.finish_reason {
        FinishReason::Length => ("limit", String::new()),
        FinishReason::Cancelled => ("none", String::new()),
        FinishReason::Stop => {
            let ended_on_eos = output.tokens.last().is_some_and(|&t| loaded.engine.model().tokenizer().is_eos(t));
            if ended_on_eos || stop.is_empty() {
                ("eos", String::new())
            } else {
                ("word", if stop.len() == 1 { stop[0].clone() } else { String::new() })
            }
        }
    }
}

pub async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Json<Value>> {
    let loaded = state.loaded()?;
    let fields = parse_body(&body)?;
    let content = fields.str("content")?.ok_or_else(|| ApiError::field("content", "is required"))?;
    let add_special = fields.bool("add_special")?.unwrap_or(false);
    let with_pieces = fields.bool("with_pieces")?.unwrap_or(false);
    let ids = loaded.engine.tokenize(content, add_special).map_err(|e| ApiError::field("content", e))?;
    if !with_pieces {
        return Ok(Json(json!({ "tokens": ids })));
    }
    let tokenizer = loaded.engine.model().tokenizer();
    let pieces: Vec<Value> = ids
        .iter()
        .map(|&id| {
            // A piece that is not UTF-8 on its own (part of a character) is given as bytes.
            let text = tokenizer.decode(&[id], false).unwrap_or_default();
            let piece = if text.contains('\u{FFFD}') { json!(piece_bytes(&loaded, id)) } else { json!(text) };
            json!({ "id": id, "piece": piece })
        })
        .collect();
    Ok(Json(json!({ "tokens": pieces })))
}

/// The raw bytes of a byte-level BPE or byte-fallback token.
fn piece_bytes(loaded: &Loaded, id: u32) -> Vec<u8> {
    let tokenizer = loaded.engine.model().tokenizer();
    let Some(token) = tokenizer.id_to_token(id) else { return Vec::new() };
    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
        return u8::from_str_radix(hex, 16).map(|b| vec![b]).unwrap_or_default();
    }
    token.chars().filter_map(byte_level_char).collect()
}

/// GPT-2's byte-level alphabet, inverted.
fn byte_level_char(c: char) -> Option<u8> {
    let c = c as u32;
    let direct = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    if direct(c) {
        return Some(c as u8);
    }
    let mut shifted = 0u32;
    for b in 0..=255u32 {
        if !direct(b) {
            if c == 256 + shifted {
                return Some(b as u8);
            }
            shifted += 1;
        }
    }
    None
}

pub async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Json<Value>> {
    let loaded = state.loaded()?;
    let fields = parse_body(&body)?;
    let tokens = fields.array("tokens")?.ok_or_else(|| ApiError::field("tokens", "is required"))?;
    let ids = tokens
        .iter()
        .map(|v| {
            let id = as_integer("tokens", v)?;
            u32::try_from(id).map_err(|_| ApiError::field("tokens", format!("token id {id} is out of range")))
        })
        .collect::<ApiResult<Vec<u32>>>()?;
    let content = loaded.engine.detokenize(&ids, false).map_err(|e| ApiError::from_engine(&e, |n| n))?;
    Ok(Json(json!({ "content": content })))
}

pub async fn apply_template(State(state): State<Arc<AppState>>, body: Bytes) -> ApiResult<Json<Value>> {
    let loaded = state.loaded()?;
    let fields = parse_body(&body)?;
    let messages = fields.array("messages")?.ok_or_else(|| ApiError::field("messages", "is required"))?;
    let prompt = loaded.render_chat(messages, true)?;
    Ok(Json(json!({ "prompt": prompt })))
}

fn generation_settings(state: &AppState, loaded: &Loaded) -> Value {
    let d = &loaded.defaults;
    json!({
        "n_ctx": loaded.n_ctx_slot,
        "params": {
            "n_predict": loaded.n_predict.map_or(-1, |n| n as i64),
            "temperature": d.temperature,
            "top_k": d.top_k,
            "top_p": d.top_p,
            "min_p": d.min_p,
            "typical_p": d.typical_p,
            "repeat_penalty": d.repetition_penalty,
            "repeat_last_n": d.repetition_context_size,
            "presence_penalty": d.presence_penalty,
            "frequency_penalty": d.frequency_penalty,
            "seed": d.seed.map_or(-1, |s| s as i64),
            "stop": d.stop,
        },
        "total_slots": state.config.parallel,
    })
}

pub async fn props(State(state): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let loaded = state.loaded()?;
    Ok(Json(json!({
        "default_generation_settings": generation_settings(&state, &loaded),
        "total_slots": state.config.parallel,
        "model_alias": state.config.alias,
        "model_path": loaded.summary.directory,
        "chat_template": loaded.chat_template_source(),
        "bos_token": loaded.summary.tokenizer.bos_token,
        "eos_token": loaded.summary.tokenizer.eos_token,
        "modalities": { "vision": false, "audio": false },
        "build_info": format!("mlxcel {}", env!("CARGO_PKG_VERSION")),
        "n_ctx": loaded.n_ctx,
    })))
}

pub async fn slots(State(state): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    if !state.config.slots_endpoint {
        return Err(ApiError::not_supported("the /slots endpoint is disabled (start the server without --no-slots)"));
    }
    state.loaded()?;
    Ok(Json(json!(state.slots())))
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> ApiResult<Response> {
    if !state.config.metrics {
        return Err(ApiError::not_supported("metrics are disabled (start the server with --metrics)"));
    }
    let loaded = state.loaded()?;
    let m = &state.metrics;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let prompt_tokens = load(&m.prompt_tokens_total);
    let prompt_seconds = load(&m.prompt_seconds_total_us) as f64 / 1e6;
    let predicted = load(&m.tokens_predicted_total);
    let predicted_seconds = load(&m.tokens_predicted_seconds_total_us) as f64 / 1e6;
    let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let pool = loaded.engine.kv_pool().usage();
    let metrics: [(&str, &str, &str, f64); 14] = [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens processed (not counting prefix-cache hits).", prompt_tokens as f64),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt processing time.", prompt_seconds),
        ("llamacpp:tokens_predicted_total", "counter", "Generated tokens.", predicted as f64),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Generation time.", predicted_seconds),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", rate(prompt_tokens, prompt_seconds)),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.", rate(predicted, predicted_seconds)),
        ("llamacpp:requests_processing", "gauge", "Requests holding a slot.", state.processing() as f64),
        ("llamacpp:requests_deferred", "gauge", "Requests waiting for a slot.", state.waiting() as f64),
        ("llamacpp:kv_cache_usage_ratio", "gauge", "Share of the KV pool's blocks held by rows.", pool.in_use as f64 / pool.total.max(1) as f64),
        ("mlxcel:kv_pool_blocks_total", "gauge", "Blocks in the paged KV pool.", pool.total as f64),
        ("mlxcel:kv_pool_blocks_in_use", "gauge", "KV pool blocks referenced by running rows.", pool.in_use as f64),
        ("mlxcel:kv_pool_blocks_cached_idle", "gauge", "Prefix-cache blocks no row references.", pool.cached_idle as f64),
        ("mlxcel:prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.", load(&m.cached_tokens_total) as f64),
        ("mlxcel:requests_rejected_total", "counter", "Requests refused with 503 because the queue was full.", load(&m.requests_rejected_total) as f64),
    ];
    let mut text = String::new();
    for (name, kind, help, value) in metrics {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
    let _ = writeln!(
        text,
        "# HELP mlxcel:requests_total Requests that took a slot.\n# TYPE mlxcel:requests_total counter\nmlxcel:requests_total {}",
        load(&m.requests_total)
    );
    let _ = writeln!(
        text,
        "# HELP mlxcel:requests_cancelled_total Generations cancelled (client gone or shutdown).\n# TYPE mlxcel:requests_cancelled_total counter\nmlxcel:requests_cancelled_total {}",
        load(&m.requests_cancelled_total)
    );
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// Routes for work this server does not do: a clear 501, not a 404.
pub async fn embeddings_unsupported() -> ApiError {
    ApiError::not_supported("llama-server's /embedding (unpooled vectors) is not supported: send OpenAI's /v1/embeddings (with --embedding-model)")
}

/// llama-server's reranking (`/rerank`, `/reranking`, `/v1/rerank`): the Jina
/// and Cohere shape, `query` and `documents` (strings) with `top_n` and
/// `return_documents`, answered with `results` best first; or Text
/// Embeddings Inference's, `query` and `texts` with `return_text`, answered
/// with an array of `{index, score}` best first. Scores are the
/// cross-encoder's raw logits, as llama-server returns them.
pub async fn rerank(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    score_documents(state, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn score_documents(state: Arc<AppState>, body: Bytes) -> ApiResult<Response> {
    let loaded = state.loaded()?;
    let Some((name, reranker)) = loaded.reranker.clone() else {
        return Err(ApiError::not_supported("this server has no reranker: start it with --rerank-model PATH (a cross-encoder checkpoint)"));
    };
    let fields = parse_body(&body)?;
    let query = fields.str("query")?.ok_or_else(|| ApiError::field("query", "is required"))?.to_string();
    // TEI's field names, else Jina's.
    let tei = fields.has("texts") && !fields.has("documents");
    let documents_field = if tei { "texts" } else { "documents" };
    let documents = match fields.array(documents_field)? {
        None => return Err(ApiError::field("documents", "is required")),
        Some(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(text) => Ok(text.clone()),
                // Jina and Cohere also take `{"text": ...}` objects.
                Value::Object(map) if map.get("text").is_some_and(Value::is_string) => Ok(map["text"].as_str().unwrap_or_default().to_string()),
                other => Err(ApiError::field(&format!("{documents_field}[{i}]"), format!("must be a string, got {}", type_name(other)))),
            })
            .collect::<ApiResult<Vec<String>>>()?,
    };
    let top_n = match fields.int("top_n")? {
        None => documents.len(),
        Some(n) if n >= 1 => (n as usize).min(documents.len()),
        Some(n) => return Err(ApiError::field("top_n", format!("must be at least 1, got {n}"))),
    };
    let with_text = fields.bool(if tei { "return_text" } else { "return_documents" })?.unwrap_or(false);
    let scored = documents.clone();
    let out = tokio::task::spawn_blocking(move || reranker.rerank(&query, &scored))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("the rerank task failed: {e}")))?
        .map_err(|e| ApiError::from_engine(&e, |n| if n == "documents" { documents_field } else { n }))?;
    let mut order: Vec<usize> = (0..documents.len()).collect();
    order.sort_by(|&a, &b| out.scores[b].total_cmp(&out.scores[a]));
    order.truncate(top_n);
    if tei {
        let results: Vec<Value> = order
            .iter()
            .map(|&i| {
                let mut entry = json!({ "index": i, "score": out.scores[i] });
                if with_text {
                    entry["text"] = json!(documents[i]);
                }
                entry
            })
            .collect();
        return Ok(Json(Value::Array(results)).into_response());
    }
    let results: Vec<Value> = order
        .iter()
        .map(|&i| {
            let mut entry = json!({ "index": i, "relevance_score": out.scores[i] });
            if with_text {
                entry["document"] = json!({ "text": documents[i] });
            }
            entry
        })
        .collect();
    let tokens: usize = out.token_counts.iter().sum();
    Ok(Json(json!({
        "model": name,
        "object": "list",
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens },
        "results": results,
    }))
    .into_response())
}

pub async fn infill_unsupported() -> ApiError {
    ApiError::not_supported("/infill (fill-in-the-middle) is not supported yet; send the prefix to /completion")
}

pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found_error", format!("no route for {}", uri.path()))
}
