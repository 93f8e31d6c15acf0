//! `mlxcel serve`: OpenAI's and llama-server's HTTP APIs over one batch
//! [`Engine`]. Each request takes one of `-np` slots and runs as a row of
//! the engine's continuous batch; the listener is up before the model has
//! loaded (`/health` answers 503 until then); SIGTERM or Ctrl-C cancels
//! what runs and exits cleanly.
//!
//! Layout: [`cli`] (flags), [`state`] (slots, queue, metrics), [`params`]
//! (request fields → engine options), [`completion`] and [`bridge`]
//! (requests → engine rows → JSON / SSE), [`openai`] and [`llama`] (routes).

pub mod api_error;
mod audio;
#[cfg(test)]
mod audio_http_tests;
#[cfg(test)]
mod image_http_tests;
mod bridge;
pub mod cli;
mod completion;
mod fields;
mod gbnf;
mod llama;
mod openai;
mod params;
mod state;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use mlxcel_engine::{Engine, GenerationOptions, LimitOptions, ModelSummary, Prompt};
use mlxcel_tokenizer::ChatTemplate;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::api_error::ApiError;
pub use crate::cli::ServeArgs;
use crate::state::{AppState, Config, Loaded};

/// Reported as `system_fingerprint` in OpenAI responses.
pub const SYSTEM_FINGERPRINT: &str = concat!("mlxcel-", env!("CARGO_PKG_VERSION"));

/// The chat page served at `/`: one file, no external resources.
const WEB_UI: &str = include_str!("../ui/index.html");

/// Where models come from, supplied by the binary (which owns the
/// progress bars): the default model, and GGUF conversion.
pub trait ModelSource: Send + Sync + 'static {
    /// The default model's directory, downloading it unless `offline`.
    fn default_model(&self, offline: bool) -> Result<PathBuf, String>;
    /// Converts `gguf` into an MLX checkpoint at `out`.
    fn convert_gguf(&self, gguf: &Path, out: &Path) -> Result<(), String>;
    /// The directory of the packaged model `name` (`mlxcel models`), downloading it unless
    /// `offline`; None when no packaged model has that name.
    fn packaged_model(&self, name: &str, offline: bool) -> Option<Result<PathBuf, String>> {
        let _ = (name, offline);
        None
    }
}

/// Runs the server until SIGTERM or Ctrl-C.
pub fn run(args: ServeArgs, source: Box<dyn ModelSource>) -> Result<(), String> {
    args.validate()?;
    for notice in args.notices() {
        eprintln!("mlxcel serve: {notice}");
    }
    if let Some(threads) = args.threads.filter(|&t| t > 0) {
        // Read once by the kernels when they first run, after this.
        std::env::set_var("MLXCEL_NUM_THREADS", threads.to_string());
    }
    let api_keys = args.api_keys()?;
    let config = Config {
        alias: args.alias.clone().unwrap_or_default(),
        parallel: args.parallel,
        max_queue: args.max_queue,
        metrics: args.metrics,
        slots_endpoint: !args.no_slots,
        web_ui: !args.no_webui,
        body_limit: args.max_body_bytes,
        audio_limit: args.max_audio_bytes,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let result = runtime.block_on(serve(args, config, api_keys, source));
    // A model still loading (stopped during a download) is not waited for.
    runtime.shutdown_timeout(Duration::from_secs(5));
    result
}

async fn serve(args: ServeArgs, mut config: Config, api_keys: Vec<String>, source: Box<dyn ModelSource>) -> Result<(), String> {
    let address = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&address).await.map_err(|e| format!("cannot listen on {address}: {e}"))?;
    let local: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;

    // The alias needs the model path; resolve it (a download or conversion
    // may follow, while /health says 503).
    let model_arg = args.model.clone();
    if config.alias.is_empty() {
        config.alias = model_arg
            .as_deref()
            .and_then(|p| p.file_stem())
            .map_or_else(|| mlxcel_hub::DEFAULT_MODEL.name.to_string(), |s| s.to_string_lossy().into_owned());
    }
    let state = AppState::new(config);
    let app = router(state.clone(), api_keys);
    eprintln!("mlxcel serve: listening on http://{local} (model {}, {} slots)", state.config.alias, state.config.parallel);

    let (load_failed_tx, load_failed_rx) = tokio::sync::oneshot::channel::<String>();
    {
        let state = state.clone();
        tokio::task::spawn_blocking(move || match load(&args, source.as_ref()) {
            Ok(loaded) => {
                eprintln!(
                    "mlxcel serve: model loaded: {} slots of {} positions ({} in all){}",
                    state.config.parallel,
                    loaded.n_ctx_slot,
                    loaded.n_ctx,
                    if loaded.context_shift { ", context shift on" } else { "" }
                );
                state.set_loaded(loaded);
            }
            Err(error) => {
                state.set_load_error(error.clone());
                let _ = load_failed_tx.send(error);
            }
        });
    }

    let shutdown_state = state.clone();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<Option<String>>();
    tokio::spawn(async move {
        // The sender is dropped unused when the model loads.
        let load_failed = async {
            match load_failed_rx.await {
                Ok(error) => error,
                Err(_) => std::future::pending().await,
            }
        };
        let reason = tokio::select! {
            _ = termination() => None,
            error = load_failed => Some(error),
        };
        shutdown_state.shut_down();
        let _ = stop_tx.send(reason);
    });
    let (reason_tx, reason_rx) = tokio::sync::oneshot::channel();
    let graceful = async move {
        let reason = stop_rx.await.ok().flatten();
        let _ = reason_tx.send(reason);
    };
    axum::serve(listener, app).with_graceful_shutdown(graceful).await.map_err(|e| format!("server error: {e}"))?;
    let reason = reason_rx.await.ok().flatten();
    // Rows were cancelled above; let the scheduler finish its step.
    mlxcel_engine::shutdown(Duration::from_secs(10));
    match reason {
        Some(error) => Err(format!("cannot load the model: {error}")),
        None => {
            eprintln!("mlxcel serve: stopped");
            Ok(())
        }
    }
}

async fn termination() {
    // A signal that cannot be watched (SIGINT ignored in a background job) never fires.
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("mlxcel serve: shutting down");
}

fn router(state: Arc<AppState>, api_keys: Vec<String>) -> Router {
    let keys: Arc<Vec<[u8; 32]>> = Arc::new(api_keys.iter().map(|k| Sha256::digest(k.as_bytes()).into()).collect());
    let body_limit = state.config.body_limit;
    let mut app = Router::new()
        .route("/health", get(llama::health))
        .route("/v1/health", get(llama::health))
        .route("/v1/models", get(openai::models))
        .route("/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/completion", post(llama::completion))
        .route("/completions", post(llama::completion))
        .route("/tokenize", post(llama::tokenize))
        .route("/detokenize", post(llama::detokenize))
        .route("/apply-template", post(llama::apply_template))
        .route("/props", get(llama::props))
        .route("/slots", get(llama::slots))
        .route("/metrics", get(llama::metrics))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/embeddings", post(openai::embeddings))
        .route("/infill", post(llama::infill_unsupported))
        // llama-server's own embedding format (`content`, pooling none).
        .route("/embedding", post(llama::embeddings_unsupported));
    for path in ["/rerank", "/reranking", "/v1/rerank", "/v1/reranking"] {
        app = app.route(path, post(llama::rerank));
    }
    // Uploads have their own limit (the route's layer wins over the one below).
    let audio_limit = DefaultBodyLimit::max(state.config.audio_limit);
    app = app
        .route("/v1/audio/transcriptions", post(audio::transcriptions).layer(audio_limit))
        .route("/v1/audio/translations", post(audio::translations).layer(audio_limit));
    if state.config.web_ui {
        app = app.route("/", get(|| async { Html(WEB_UI) }));
    }
    app.fallback(llama::not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(middleware::from_fn(json_rejections))
        .layer(middleware::from_fn_with_state(keys, require_api_key))
        .with_state(state)
}

/// Every route but `/health` and the chat page needs a key, when keys are set.
/// Keys are compared as SHA-256 digests in constant time.
async fn require_api_key(State(keys): State<Arc<Vec<[u8; 32]>>>, request: Request, next: Next) -> Response {
    let public = matches!(request.uri().path(), "/health" | "/v1/health" | "/");
    if keys.is_empty() || public {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(|k| -> [u8; 32] { Sha256::digest(k.trim().as_bytes()).into() });
    let accepted = given.is_some_and(|digest| keys.iter().fold(0u8, |ok, key| ok | key.ct_eq(&digest).unwrap_u8()) == 1);
    if accepted {
        next.run(request).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// axum's own plain-text rejections (body too large, wrong method) in the
/// one error shape.
async fn json_rejections(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let is_json = response.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json") || v.as_bytes().starts_with(b"text/event-stream"));
    match response.status() {
        StatusCode::PAYLOAD_TOO_LARGE if !is_json => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "the request body is too large (raise --max-body-bytes)").into_response(),
        StatusCode::METHOD_NOT_ALLOWED if !is_json => ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "this route does not take that HTTP method").into_response(),
        _ => response,
    }
}

/// The model directory `-m` names: a checkpoint directory as it is, a GGUF
/// file converted once into `<cache>/models/`, or the default model.
fn resolve_model(args: &ServeArgs, source: &dyn ModelSource) -> Result<PathBuf, String> {
    let Some(path) = &args.model else { return source.default_model(args.offline) };
    if path.is_dir() {
        return Ok(path.clone());
    }
    if !path.exists() {
        if let Some(dir) = path.to_str().and_then(|name| source.packaged_model(name, args.offline)) {
            return dir;
        }
    }
    let metadata = std::fs::metadata(path).map_err(|e| format!("-m {}: {e}", path.display()))?;
    if path.extension().is_none_or(|e| !e.eq_ignore_ascii_case("gguf")) {
        return Err(format!("-m {}: expected an MLX checkpoint directory or a .gguf file", path.display()));
    }
    let canonical = std::fs::canonicalize(path).map_err(|e| format!("-m {}: {e}", path.display()))?;
    let modified = metadata.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_secs());
    let key = Sha256::digest(format!("{}:{}:{modified}", canonical.display(), metadata.len()));
    let stem = path.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let out = mlxcel_hub::cache_dir().join("models").join(format!("{stem}-{:02x}{:02x}{:02x}{:02x}", key[0], key[1], key[2], key[3]));
    if out.join(mlxcel_hub::COMPLETE_MARKER).exists() {
        return Ok(out);
    }
    let partial = out.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    eprintln!("mlxcel serve: converting {} into {}", path.display(), out.display());
    source.convert_gguf(path, &partial)?;
    std::fs::write(partial.join(mlxcel_hub::COMPLETE_MARKER), b"").map_err(|e| format!("{}: {e}", partial.display()))?;
    let _ = std::fs::remove_dir_all(&out);
    std::fs::rename(&partial, &out).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(out)
}

/// Loads the model with a KV pool sized for `-c` positions over `-np` slots.
fn load(args: &ServeArgs, source: &dyn ModelSource) -> Result<Loaded, String> {
    let dir = resolve_model(args, source)?;
    let kv_bits = args.kv_bits()?;
    let context_shift = args.context_shift && !args.no_context_shift;
    let quantize = LimitOptions {
        q_bits: args.q_bits.map(i128::from),
        q_group_size: args.q_group_size.map(i128::from),
        ..Default::default()
    }
    .resolve()
    .map_err(|e| e.to_string())?
    .quantize;
    let model = Engine::load_model_quantizing(&dir, quantize).map_err(|e| e.to_string())?;
    let draft = args.model_draft.as_deref().map(Engine::load_model).transpose().map_err(|e| e.to_string())?;
    let summary = ModelSummary::new(&model);
    let n_ctx = match args.ctx_size {
        0 => summary.context_length.unwrap_or(4096),
        n => n,
    };
    let n_ctx_slot = if args.kv_unified { n_ctx } else { (n_ctx / args.parallel).max(16) };
    let mut limits = LimitOptions {
        kv_pool_bytes: None,
        max_kv_size: context_shift.then_some(n_ctx_slot as i128),
        kv_keep: None,
        kv_bits,
        max_rows: Some(args.parallel as i128),
        ..Default::default()
    }
    .resolve()
    .map_err(|e| e.to_string())?;
    // The pool holds -c positions, plus a partly filled block per slot.
    let blocks = n_ctx.div_ceil(mlxcel_models::paged::BLOCK_TOKENS) + 2 * args.parallel;
    limits.kv_pool_bytes = (blocks * limits.kv_format.block_bytes(model.network().shape())).max(1 << 20);
    let engine = Engine::with_draft(model, limits, draft).map_err(|e| e.to_string())?;

    let chat_template = chat_template(args, &engine)?;
    // A path as given, else a packaged model's name.
    let resolve = |given: &PathBuf| -> Result<PathBuf, String> {
        if given.exists() {
            return Ok(given.clone());
        }
        match given.to_str().and_then(|name| source.packaged_model(name, args.offline)) {
            Some(dir) => dir,
            None => Ok(given.clone()),
        }
    };
    let model_name = |given: &PathBuf, fallback: &str| given.file_name().map_or_else(|| fallback.into(), |n| n.to_string_lossy().into_owned());
    let embedder = match &args.embedding_model {
        None => None,
        Some(given) => {
            let embedder = mlxcel_engine::Embedder::load_resolved(&resolve(given)?).map_err(|e| format!("--embedding-model: {e}"))?;
            Some((model_name(given, "embeddings"), embedder))
        }
    };
    let reranker = match &args.rerank_model {
        None => None,
        Some(given) => {
            let reranker = mlxcel_engine::Reranker::load_resolved(&resolve(given)?).map_err(|e| format!("--rerank-model: {e}"))?;
            Some((model_name(given, "reranker"), reranker))
        }
    };
    let transcriber = match &args.whisper_model {
        None => None,
        Some(given) => {
            // A directory, else a packaged Whisper model's name (fetched and converted on first use).
            let dir = resolve(given)?;
            let transcriber = if dir.exists() { mlxcel_engine::Transcriber::load_resolved(&dir) } else { mlxcel_engine::Transcriber::load(&dir) }
                .map_err(|e| format!("--whisper-model: {e}"))?;
            Some((model_name(given, "whisper"), transcriber))
        }
    };
    let defaults = GenerationOptions {
        temperature: args.temp,
        top_k: args.top_k.max(0),
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repeat_penalty,
        repetition_context_size: if args.repeat_last_n == -1 { n_ctx_slot as i64 } else { args.repeat_last_n },
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        seed: (args.seed != -1).then_some(args.seed as i128),
        prefill_chunk: args.ubatch_size as i64,
        speculation: args.model_draft.as_ref().map(|_| "draft".to_string()),
        draft_max: args.draft_max.unwrap_or(GenerationOptions::default().draft_max),
        draft_min: args.draft_min.unwrap_or(GenerationOptions::default().draft_min),
        ..GenerationOptions::default()
    };
    // Bad sampling flags fail here, at start, not on every request.
    defaults.request(Prompt::Tokens(vec![0])).map_err(|e| format!("sampling flags: {e}"))?;
    Ok(Loaded {
        engine,
        summary,
        defaults,
        n_predict: (args.n_predict > 0).then_some(args.n_predict as i128),
        n_ctx,
        n_ctx_slot,
        context_shift,
        chat_template,
        embedder,
        reranker,
        transcriber,
        max_image_bytes: args.max_image_bytes,
    })
}

const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// `--chat-template NAME|SOURCE` or `--chat-template-file FILE`.
fn chat_template(args: &ServeArgs, engine: &Engine) -> Result<Option<ChatTemplate>, String> {
    let source = if let Some(file) = &args.chat_template_file {
        std::fs::read_to_string(file).map_err(|e| format!("--chat-template-file {}: {e}", file.display()))?
    } else if let Some(name) = &args.chat_template {
        let tokenizer = engine.model().tokenizer();
        match name.as_str() {
            name if tokenizer.named_chat_template(name).is_some() => tokenizer.named_chat_template(name).expect("checked").source().to_string(),
            "chatml" => CHATML.to_string(),
            source if source.contains("{%") || source.contains("{{") => source.to_string(),
            other => {
                let mut known: Vec<&str> = tokenizer.chat_template_names().collect();
                known.push("chatml");
                return Err(format!("--chat-template {other:?}: unknown (known: {}; or pass Jinja source)", known.join(", ")));
            }
        }
    } else {
        return Ok(None);
    };
    ChatTemplate::new(source).map(Some).map_err(|e| format!("chat template: {e}"))
}
