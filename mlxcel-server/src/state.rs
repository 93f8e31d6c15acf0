//! What every route shares: the loaded model (absent while it loads), the
//! slots that bound concurrency, the queue bound, and the counters behind
//! `/metrics` and `/slots`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use mlxcel_engine::{CancelFlag, Embedder, Engine, GenerationOptions, ModelSummary, Reranker, Transcriber};
use mlxcel_tokenizer::{ChatTemplate, RenderOptions};
use serde::Serialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api_error::{ApiError, ApiResult};

/// The server's settings, fixed at start.
#[derive(Debug, Clone)]
pub struct Config {
    /// The name `/v1/models` and responses report (`--alias`, else the directory's name).
    pub alias: String,
    pub parallel: usize,
    /// Requests that may wait for a slot before new ones get 503.
    pub max_queue: usize,
    pub metrics: bool,
    pub slots_endpoint: bool,
    pub web_ui: bool,
    /// Largest request body accepted, in bytes.
    pub body_limit: usize,
    /// Largest upload to the audio routes, in bytes (`--max-audio-bytes`).
    pub audio_limit: usize,
}

/// The model once loaded, with the settings that depend on it.
pub struct Loaded {
    pub engine: Engine,
    pub summary: ModelSummary,
    /// Request defaults: llama-server's sampling flags over the engine's.
    pub defaults: GenerationOptions,
    /// `-n`: None = until the slot's context is full.
    pub n_predict: Option<i128>,
    /// Positions in all (`-c`) and per slot.
    pub n_ctx: usize,
    pub n_ctx_slot: usize,
    /// Slots keep generating past their context on a rotating window (`--context-shift`).
    pub context_shift: bool,
    /// `--chat-template(-file)`: replaces the checkpoint's template.
    pub chat_template: Option<ChatTemplate>,
    /// `--embedding-model`, with the name /v1/models and responses report.
    pub embedder: Option<(String, Embedder)>,
    /// `--rerank-model`, with the name /v1/models and responses report.
    pub reranker: Option<(String, Reranker)>,
    /// `--whisper-model`, with the name /v1/models reports.
    pub transcriber: Option<(String, Transcriber)>,
    /// `--max-image-bytes`: the largest image in a chat message.
    pub max_image_bytes: usize,
}

impl Loaded {
    /// `messages` rendered with the server's chat template.
    pub fn render_chat(&self, messages: &[serde_json::Value], add_generation_prompt: bool) -> ApiResult<String> {
        let result = match &self.chat_template {
            None => self.engine.apply_chat_template(messages, add_generation_prompt),
            Some(template) => {
                let tokenizer = self.engine.model().tokenizer();
                let options = RenderOptions {
                    add_generation_prompt,
                    bos_token: tokenizer.bos_token().map(str::to_string),
                    eos_token: tokenizer.eos_token().map(str::to_string),
                    pad_token: tokenizer.pad_token().map(str::to_string),
                    ..RenderOptions::default()
                };
                template.render(messages, &options).map_err(mlxcel_engine::Error::from)
            }
        };
        result.map_err(|e| ApiError::field("messages", e))
    }

    /// The chat template's source, for `/props`.
    pub fn chat_template_source(&self) -> String {
        match &self.chat_template {
            Some(t) => t.source().to_string(),
            None => self.engine.model().tokenizer().chat_template().map(|t| t.source().to_string()).unwrap_or_default(),
        }
    }
}

/// What a slot is doing, for `/slots`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SlotStatus {
    pub id: usize,
    pub is_processing: bool,
    pub id_task: u64,
    pub n_ctx: usize,
    pub n_prompt_tokens: usize,
    pub n_decoded: usize,
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    pub prompt_tokens_total: AtomicU64,
    pub prompt_seconds_total_us: AtomicU64,
    pub tokens_predicted_total: AtomicU64,
    pub tokens_predicted_seconds_total_us: AtomicU64,
    pub cached_tokens_total: AtomicU64,
    pub requests_total: AtomicU64,
    pub requests_rejected_total: AtomicU64,
    pub requests_cancelled_total: AtomicU64,
}

pub struct AppState {
    pub config: Config,
    loaded: OnceLock<Arc<Loaded>>,
    load_error: Mutex<Option<String>>,
    slot_permits: Arc<Semaphore>,
    slots: Mutex<Vec<SlotStatus>>,
    waiting: AtomicUsize,
    next_task: AtomicU64,
    pub metrics: Metrics,
    /// Cancel flags of the generations in flight, for shutdown.
    in_flight: Mutex<Vec<(u64, CancelFlag)>>,
    shutting_down: AtomicBool,
}

impl AppState {
    pub fn new(config: Config) -> Arc<Self> {
        let slots = (0..config.parallel).map(|id| SlotStatus { id, ..SlotStatus::default() }).collect();
        Arc::new(AppState {
            slot_permits: Arc::new(Semaphore::new(config.parallel)),
            slots: Mutex::new(slots),
            config,
            loaded: OnceLock::new(),
            load_error: Mutex::new(None),
            waiting: AtomicUsize::new(0),
            next_task: AtomicU64::new(0),
            metrics: Metrics::default(),
            in_flight: Mutex::new(Vec::new()),
            shutting_down: AtomicBool::new(false),
        })
    }

    pub fn set_loaded(&self, loaded: Loaded) {
        let n_ctx_slot = loaded.n_ctx_slot;
        let _ = self.loaded.set(Arc::new(loaded));
        for slot in self.slots.lock().unwrap().iter_mut() {
            slot.n_ctx = n_ctx_slot;
        }
    }

    pub fn set_load_error(&self, message: String) {
        *self.load_error.lock().unwrap() = Some(message);
    }

    /// The model, or 503 while it loads (llama-server's "Loading model").
    pub fn loaded(&self) -> ApiResult<Arc<Loaded>> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        if let Some(loaded) = self.loaded.get() {
            return Ok(loaded.clone());
        }
        match self.load_error.lock().unwrap().as_ref() {
            Some(error) => Err(ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "server_error", format!("the model failed to load: {error}"))),
            None => Err(ApiError::unavailable("Loading model")),
        }
    }

    /// Waits for a free slot; 503 at once when `max_queue` requests already wait.
    pub async fn acquire_slot(self: &Arc<Self>, n_prompt_tokens: usize, cancel: &CancelFlag) -> ApiResult<SlotGuard> {
        let permit = match self.slot_permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.config.max_queue {
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    self.metrics.requests_rejected_total.fetch_add(1, Ordering::Relaxed);
                    return Err(ApiError::unavailable(format!(
                        "the server is busy: {} slots in use and {} requests waiting (raise -np or --max-queue)",
                        self.config.parallel, self.config.max_queue
                    )));
                }
                let waited = self.slot_permits.clone().acquire_owned().await;
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                waited.map_err(|_| ApiError::unavailable("the server is shutting down"))?
            }
        };
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let task = self.next_task.fetch_add(1, Ordering::Relaxed);
        let slot = {
            let mut slots = self.slots.lock().unwrap();
            let slot = slots.iter_mut().find(|s| !s.is_processing).expect("a permit guarantees a free slot");
            slot.is_processing = true;
            slot.id_task = task;
            slot.n_prompt_tokens = n_prompt_tokens;
            slot.n_decoded = 0;
            slot.id
        };
        self.in_flight.lock().unwrap().push((task, cancel.clone()));
        self.metrics.requests_total.fetch_add(1, Ordering::Relaxed);
        Ok(SlotGuard { state: self.clone(), slot, task, _permit: permit })
    }

    pub fn slots(&self) -> Vec<SlotStatus> {
        self.slots.lock().unwrap().clone()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn processing(&self) -> usize {
        self.config.parallel - self.slot_permits.available_permits()
    }

    /// Refuses new work, cancels what runs (each row ends within one step).
    pub fn shut_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.slot_permits.close();
        for (_, cancel) in self.in_flight.lock().unwrap().iter() {
            cancel.cancel();
        }
    }
}

/// A slot held by one request; dropping it frees the slot.
pub struct SlotGuard {
    state: Arc<AppState>,
    pub slot: usize,
    pub task: u64,
    _permit: OwnedSemaphorePermit,
}

impl SlotGuard {
    pub fn decoded(&self, n: usize) {
        if let Some(slot) = self.state.slots.lock().unwrap().get_mut(self.slot) {
            slot.n_decoded = n;
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(slot) = self.state.slots.lock().unwrap().get_mut(self.slot) {
            slot.is_processing = false;
        }
        self.state.in_flight.lock().unwrap().retain(|(task, _)| *task != self.task);
    }
}
