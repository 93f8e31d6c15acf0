//! What the generation routes share: a prompt and its parsed fields become
//! an engine request bounded by the slot's context; a slot is taken; the
//! first event is awaited (so a request the engine rejects gets an HTTP
//! error, not a broken stream); events become JSON for SSE or one body.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use mlxcel_engine::{CancelFlag, GenerationOutput, GenerationRequest, GenerationStats, Prompt, StreamEvent, TokenLogprobs};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::api_error::{ApiError, ApiResult};
use crate::bridge::Generation;
use crate::params::{rename, Dialect, Parsed};
use crate::state::{AppState, Loaded};

/// A request ready to queue.
pub struct Prepared {
    pub request: GenerationRequest,
    pub n_prompt: usize,
    pub cancel: CancelFlag,
    pub dialect: Dialect,
}

/// The engine request for `prompt`: generation is bounded by the slot's
/// context (unless `--context-shift`), and a prompt that leaves no room fails.
pub fn prepare(loaded: &Loaded, prompt: Vec<u32>, parsed: &Parsed, dialect: Dialect) -> ApiResult<Prepared> {
    let n_prompt = prompt.len();
    prepare_prompt(loaded, Prompt::Tokens(prompt), n_prompt, parsed, dialect)
}

/// [`prepare`] for any engine prompt of `n_prompt` tokens (a chat prompt
/// with images: its image tokens counted).
pub fn prepare_prompt(loaded: &Loaded, prompt: Prompt, n_prompt: usize, parsed: &Parsed, dialect: Dialect) -> ApiResult<Prepared> {
    let room = loaded.n_ctx_slot.saturating_sub(n_prompt);
    if !loaded.context_shift && room == 0 {
        return Err(ApiError::context(n_prompt, loaded.n_ctx_slot));
    }
    let mut options = parsed.options.clone();
    options.max_tokens = match (parsed.max_tokens, loaded.context_shift) {
        (Some(n), true) => n.min(i64::MAX as i128) as i64,
        (Some(n), false) => n.min(room as i128) as i64,
        (None, true) => loaded.n_ctx_slot.max(1) as i64,
        (None, false) => room as i64,
    };
    // Token ids outside the vocabulary fail when the engine queues the row (`start`).
    let mut request = options.request(prompt).map_err(|e| ApiError::from_engine(&e, rename(dialect)))?;
    request.ignore_eos = parsed.ignore_eos;
    request.cache_prompt = parsed.cache_prompt;
    let cancel = CancelFlag::new();
    request.cancel = Some(cancel.clone());
    Ok(Prepared { request, n_prompt, cancel, dialect })
}

/// Takes a slot, queues the request and waits for its first event.
pub async fn start(state: &Arc<AppState>, loaded: &Loaded, prepared: Prepared) -> ApiResult<(Generation, StreamEvent)> {
    let slot = state.acquire_slot(prepared.n_prompt, &prepared.cancel).await?;
    let mut generation = Generation::start(state, &loaded.engine, prepared.request, prepared.cancel, slot);
    match generation.next().await {
        Some(StreamEvent::Failed(error)) => Err(ApiError::from_engine(&error, rename(prepared.dialect))),
        Some(event) => Ok((generation, event)),
        None => Err(ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the generation ended without a result")),
    }
}

/// Runs to the end; the output, or the engine's error.
pub async fn collect(mut generation: Generation, first: StreamEvent, dialect: Dialect) -> ApiResult<GenerationOutput> {
    let mut event = Some(first);
    loop {
        let next = match event.take() {
            Some(e) => Some(e),
            None => generation.next().await,
        };
        match next {
            Some(StreamEvent::Done(output)) => return Ok(output),
            Some(StreamEvent::Failed(error)) => return Err(ApiError::from_engine(&error, rename(dialect))),
            Some(StreamEvent::Piece { .. }) => {}
            None => return Err(ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the generation ended without a result")),
        }
    }
}

/// An SSE response: `to_json` turns each event into the `data:` payloads to
/// send; the stream ends after `Done` or `Failed` (an error payload), with
/// `data: [DONE]` when `done_marker`. A client that hangs up drops the
/// generation, which cancels its row.
pub fn sse(
    mut generation: Generation,
    first: StreamEvent,
    mut to_json: impl FnMut(StreamEvent) -> Vec<Value> + Send + 'static,
    done_marker: bool,
    dialect: Dialect,
) -> Response {
    let (sender, receiver) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    tokio::spawn(async move {
        let mut event = Some(first);
        loop {
            let next = match event.take() {
                Some(e) => Some(e),
                None => tokio::select! {
                    e = generation.next() => e,
                    _ = sender.closed() => return,
                },
            };
            let Some(next) = next else { return };
            let last = !matches!(next, StreamEvent::Piece { .. });
            let payloads = match next {
                StreamEvent::Failed(error) => vec![ApiError::from_engine(&error, rename(dialect)).body()],
                other => to_json(other),
            };
            for payload in payloads {
                if sender.send(Ok(Event::default().data(payload.to_string()))).is_err() {
                    return;
                }
            }
            if last {
                if done_marker {
                    let _ = sender.send(Ok(Event::default().data("[DONE]")));
                }
                return;
            }
        }
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(receiver)).keep_alive(KeepAlive::default()).into_response()
}

/// llama-server's `timings` object.
pub fn timings(stats: &GenerationStats) -> Value {
    let prompt_n = stats.prompt_tokens - stats.cached_tokens.min(stats.prompt_tokens);
    let prompt_ms = stats.prompt_time.as_secs_f64() * 1e3;
    let predicted_n = stats.generated_tokens;
    let predicted_ms = stats.decode_time.as_secs_f64() * 1e3;
    let per_second = |n: usize, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
    let per_token = |n: usize, ms: f64| if n > 0 { ms / n as f64 } else { 0.0 };
    json!({
        "cache_n": stats.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_n, prompt_ms),
        "prompt_per_second": per_second(prompt_n, prompt_ms),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_n, predicted_ms),
        "predicted_per_second": per_second(predicted_n, predicted_ms),
    })
}

/// OpenAI's `usage`, with the prompt tokens served from the prefix cache.
pub fn usage(stats: &GenerationStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": { "cached_tokens": stats.cached_tokens },
    })
}

/// A token's text and UTF-8 bytes (a byte-fallback token's bytes may not be valid UTF-8 alone).
pub fn token_text(loaded: &Loaded, id: u32) -> (String, Vec<u8>) {
    let text = loaded.engine.model().tokenizer().decode(&[id], false).unwrap_or_default();
    let bytes = text.as_bytes().to_vec();
    (text, bytes)
}

/// Each token's `{token, bytes, logprob, top_logprobs}` (with `id`s for llama-server).
fn logprob_entries(loaded: &Loaded, logprobs: &[TokenLogprobs], with_id: bool) -> Vec<Value> {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = token_text(loaded, id);
        let mut entry = json!({ "token": token, "bytes": bytes, "logprob": logprob });
        if with_id {
            entry["id"] = json!(id);
        }
        entry
    };
    logprobs
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            e
        })
        .collect()
}

/// llama-server's `completion_probabilities` entries.
pub fn llama_probabilities(loaded: &Loaded, logprobs: &[TokenLogprobs]) -> Value {
    Value::Array(logprob_entries(loaded, logprobs, true))
}

/// OpenAI chat's `logprobs.content` entries.
pub fn chat_logprobs(loaded: &Loaded, logprobs: &[TokenLogprobs]) -> Value {
    json!({ "content": logprob_entries(loaded, logprobs, false) })
}

/// OpenAI legacy completions' `logprobs` (parallel arrays).
pub fn completion_logprobs(loaded: &Loaded, logprobs: &[TokenLogprobs], text_offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut offsets = Vec::new();
    let mut offset = text_offset;
    for l in logprobs {
        let (token, _) = token_text(loaded, l.token);
        offsets.push(offset);
        offset += token.len();
        let top: serde_json::Map<String, Value> = l.top.iter().map(|&(id, lp)| (token_text(loaded, id).0, json!(lp))).collect();
        tokens.push(token);
        token_logprobs.push(l.logprob);
        top_logprobs.push(Value::Object(top));
    }
    json!({ "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets })
}

pub fn finish_reason(output: &GenerationOutput) -> &'static str {
    match output.finish_reason {
        mlxcel_engine::FinishReason::Length => "length",
        _ => "stop",
    }
}

pub fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A response id: a prefix, the time and a process-wide counter.
pub fn response_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{:x}{:06x}", unix_time(), NEXT.fetch_add(1, Ordering::Relaxed))
}
