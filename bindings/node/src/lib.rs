//! Node bindings for mlxcel: the native half of `require('mlxcel')`.
//!
//! This layer is deliberately small; `index.js` builds the public API
//! (promises, async iterators, AbortSignal, error codes) on top of it:
//!
//! - `loadModel(path?)` loads a checkpoint on the libuv thread pool
//!   (an `AsyncTask`) and resolves to a `NativeModel`.
//! - `NativeModel.start(prompt, options, onEvent)` runs one generation on its
//!   own thread and reports each piece, then one `done` or `error` event,
//!   through a thread-safe function, so no JS thread ever waits on the model.
//!   It returns a `NativeGeneration` whose `cancel()` stops the generation
//!   between prefill chunks or decode steps.
//!
//! Errors thrown synchronously use napi's status as `code`: `InvalidArg` for
//! bad parameters, `GenericFailure` otherwise; `index.js` maps them to the
//! public codes. Generation errors arrive as `error` events carrying the
//! public code directly.

use std::io::{IsTerminal, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mlxcel_engine::{
    CancelFlag, Engine, Error as EngineError, GenerationRequest, Message, Prompt, SamplingParams,
};
use napi::bindgen_prelude::*;
use napi::threadsafe_function::{
    ThreadsafeFunction, ThreadsafeFunctionCallMode, UnknownReturnValue,
};
use napi_derive::napi;

/// Prompt tokens evaluated per forward pass when the caller does not say:
/// small, so a cancel during a long prompt lands within one short chunk.
const DEFAULT_PREFILL_CHUNK: usize = 64;

fn invalid_arg(message: impl Into<String>) -> Error {
    Error::new(Status::InvalidArg, message.into())
}

fn failure(message: impl Into<String>) -> Error {
    Error::new(Status::GenericFailure, message.into())
}

/// The public error code for an engine error.
fn engine_code(e: &EngineError) -> &'static str {
    match e {
        EngineError::InvalidParameter { .. } => "INVALID_PARAMETER",
        EngineError::EmptyPrompt => "EMPTY_PROMPT",
        EngineError::PromptTooLong { .. } => "PROMPT_TOO_LONG",
        _ => "GENERATION",
    }
}

fn engine_error(e: EngineError) -> Error {
    match e {
        EngineError::InvalidParameter { .. } => invalid_arg(e.to_string()),
        _ => failure(e.to_string()),
    }
}

// ---------------------------------------------------------------- loading

pub struct LoadTask {
    path: Option<String>,
    progress: bool,
}

impl Task for LoadTask {
    type Output = Engine;
    type JsValue = NativeModel;

    fn compute(&mut self) -> Result<Engine> {
        let dir = match &self.path {
            Some(path) => PathBuf::from(path),
            None => {
                let mut lines = self.progress.then(|| mlxcel_hub::ProgressText::new(std::io::stderr().is_terminal()));
                mlxcel_hub::fetch_default_model(&Default::default(), &mut |p| {
                    if let Some(text) = lines.as_mut().and_then(|l| l.text(&p)) {
                        // Best effort: a closed stderr does not fail the load.
                        let mut err = std::io::stderr().lock();
                        let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
                    }
                })
                .map_err(|e| failure(e.to_string()))?
            }
        };
        Engine::load(&dir).map_err(|e| failure(e.to_string()))
    }

    fn resolve(&mut self, _env: Env, engine: Engine) -> Result<NativeModel> {
        Ok(NativeModel { engine })
    }
}

/// Loads a checkpoint directory (or, without a path, the default model,
/// downloading and converting it on first use, reported on stderr when
/// `progress` is not false) off the event loop.
#[napi(ts_return_type = "Promise<NativeModel>")]
pub fn load_model(path: Option<String>, progress: Option<bool>) -> AsyncTask<LoadTask> {
    AsyncTask::new(LoadTask { path, progress: progress.unwrap_or(true) })
}

// ---------------------------------------------------------------- model

#[napi(object)]
pub struct ModelInfo {
    /// `model_type` from config.json, e.g. "llama".
    pub model_type: String,
    /// The checkpoint directory.
    pub path: String,
    pub parameters: f64,
    pub weight_bytes: f64,
    pub num_layers: u32,
    pub hidden_size: u32,
    pub vocab_size: u32,
    /// The largest prompt + generation the model supports, when known.
    pub context_length: Option<u32>,
    /// The dtype of activations and the KV cache, e.g. "float16".
    pub dtype: String,
    pub tokenizer_kind: String,
    pub tokenizer_vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub has_chat_template: bool,
}

#[napi(object)]
pub struct NativeMessage {
    pub role: String,
    pub content: String,
}

/// Exactly one field is set.
#[napi(object)]
pub struct NativePrompt {
    pub text: Option<String>,
    pub messages: Option<Vec<NativeMessage>>,
    pub tokens: Option<Vec<u32>>,
}

#[napi(object)]
pub struct NativeOptions {
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u32>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: Option<u32>,
    /// A non-negative integer below 2^53.
    pub seed: Option<f64>,
    pub stop: Option<Vec<String>>,
    pub prefill_chunk: Option<u32>,
}

/// One event of a generation: `kind` is "piece", "done" or "error".
#[napi(object)]
pub struct NativeEvent {
    pub kind: String,
    /// piece: the text (complete UTF-8).
    pub text: Option<String>,
    /// piece: the token that completed it.
    pub token: Option<u32>,
    /// done: "stop", "length" or "cancelled".
    pub finish_reason: Option<String>,
    /// done: statistics.
    pub prompt_tokens: Option<u32>,
    pub generated_tokens: Option<u32>,
    pub prompt_ms: Option<f64>,
    pub decode_ms: Option<f64>,
    pub kv_cache_bytes: Option<f64>,
    pub process_peak_memory_bytes: Option<f64>,
    pub cached_tokens: Option<u32>,
    /// error: the public error code and message.
    pub code: Option<String>,
    pub message: Option<String>,
}

impl NativeEvent {
    fn empty(kind: &str) -> Self {
        NativeEvent {
            kind: kind.to_string(),
            text: None,
            token: None,
            finish_reason: None,
            prompt_tokens: None,
            generated_tokens: None,
            prompt_ms: None,
            decode_ms: None,
            kv_cache_bytes: None,
            process_peak_memory_bytes: None,
            cached_tokens: None,
            code: None,
            message: None,
        }
    }
}

type EventCallback =
    ThreadsafeFunction<NativeEvent, UnknownReturnValue, NativeEvent, Status, false>;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn messages(list: Vec<NativeMessage>) -> Vec<Message> {
    list.into_iter()
        .map(|m| Message::new(m.role, m.content))
        .collect()
}

fn sampling_params(o: &NativeOptions) -> Result<SamplingParams> {
    let mut p = SamplingParams::default();
    if let Some(v) = o.max_tokens {
        p.max_tokens = v as usize;
    }
    if let Some(v) = o.temperature {
        p.temperature = v as f32;
    }
    if let Some(v) = o.top_p {
        p.top_p = v as f32;
    }
    if let Some(v) = o.top_k {
        p.top_k = v;
    }
    if let Some(v) = o.min_p {
        p.min_p = v as f32;
    }
    if let Some(v) = o.repetition_penalty {
        p.repetition_penalty = v as f32;
    }
    if let Some(v) = o.repetition_context_size {
        p.repetition_context_size = v as usize;
    }
    if let Some(seed) = o.seed {
        if !(seed.is_finite()
            && seed >= 0.0
            && seed.fract() == 0.0
            && seed < 9_007_199_254_740_992.0)
        {
            return Err(invalid_arg(format!(
                "invalid parameter `seed`: must be an integer in [0, 2^53), got {seed}"
            )));
        }
        p.seed = Some(seed as u64);
    }
    if let Some(stop) = &o.stop {
        p.stop = stop.clone();
    }
    p.validate().map_err(engine_error)?;
    Ok(p)
}

/// A loaded model. Every method may be called while generations run, and
/// several generations may run at once (each on its own thread and caches).
#[napi]
pub struct NativeModel {
    engine: Engine,
}

#[napi]
impl NativeModel {
    #[napi(getter)]
    pub fn info(&self) -> ModelInfo {
        let model = self.engine.model();
        let info = &model.info;
        let shape = model.network.shape();
        let tokenizer = &model.tokenizer;
        ModelInfo {
            model_type: info.model_type.clone(),
            path: model.dir.display().to_string(),
            parameters: info.parameters as f64,
            weight_bytes: info.weight_bytes as f64,
            num_layers: shape.num_layers as u32,
            hidden_size: shape.hidden_size as u32,
            vocab_size: shape.vocab_size as u32,
            context_length: shape.max_position_embeddings.map(|c| c as u32),
            dtype: shape.dtype.to_string(),
            tokenizer_kind: info.tokenizer_kind.clone(),
            tokenizer_vocab_size: info.tokenizer_vocab_size as u32,
            eos_token_ids: tokenizer.eos_token_ids().to_vec(),
            bos_token_id: tokenizer.bos_token_id(),
            has_chat_template: tokenizer.chat_template().is_some(),
        }
    }

    #[napi]
    pub fn tokenize(&self, text: String, add_special_tokens: Option<bool>) -> Result<Vec<u32>> {
        self.engine
            .model()
            .tokenizer
            .encode(&text, add_special_tokens.unwrap_or(true))
            .map_err(|e| failure(e.to_string()))
    }

    #[napi]
    pub fn detokenize(&self, ids: Vec<u32>, skip_special_tokens: Option<bool>) -> Result<String> {
        let model = self.engine.model();
        let vocab = model
            .network
            .shape()
            .vocab_size
            .max(model.tokenizer.vocab_size());
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(invalid_arg(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        model
            .tokenizer
            .decode(&ids, skip_special_tokens.unwrap_or(false))
            .map_err(|e| failure(e.to_string()))
    }

    #[napi]
    pub fn apply_chat_template(
        &self,
        list: Vec<NativeMessage>,
        add_generation_prompt: Option<bool>,
    ) -> Result<String> {
        self.engine
            .model()
            .tokenizer
            .apply_chat_template(&messages(list), add_generation_prompt.unwrap_or(true))
            .map_err(|e| failure(e.to_string()))
    }

    /// Checks options as `start` would, without generating.
    #[napi]
    pub fn validate_options(&self, options: NativeOptions) -> Result<()> {
        sampling_params(&options).map(|_| ())
    }

    /// Starts a generation on a new thread. `onEvent` receives each piece,
    /// then exactly one `done` or `error` event.
    #[napi(
        ts_args_type = "prompt: NativePrompt, options: NativeOptions, onEvent: (event: NativeEvent) => void"
    )]
    pub fn start(
        &self,
        prompt: NativePrompt,
        options: NativeOptions,
        on_event: EventCallback,
    ) -> Result<NativeGeneration> {
        let prompt = match (prompt.text, prompt.messages, prompt.tokens) {
            (Some(text), None, None) => Prompt::Text(text),
            (None, Some(list), None) => Prompt::Chat(messages(list)),
            (None, None, Some(ids)) => Prompt::Tokens(ids),
            _ => {
                return Err(invalid_arg(
                    "the prompt needs exactly one of text, messages or tokens",
                ))
            }
        };
        let params = sampling_params(&options)?;
        let prefill_chunk = match options.prefill_chunk {
            Some(0) => {
                return Err(invalid_arg(
                    "invalid parameter `prefill_chunk`: must be at least 1",
                ))
            }
            Some(n) => n as usize,
            None => DEFAULT_PREFILL_CHUNK,
        };
        let cancel = CancelFlag::new();
        let request = GenerationRequest {
            prompt,
            params,
            prefill_chunk,
            cancel: Some(cancel.clone()),
            ignore_eos: false,
            cache_prompt: true,
        };
        let engine = self.engine.clone();
        let finished = Arc::new(Finished::default());
        let guard = FinishGuard(finished.clone());
        std::thread::Builder::new()
            .name("mlxcel-generate".into())
            .spawn(move || {
                let _guard = guard;
                run_generation(engine, request, on_event)
            })
            .map_err(|e| failure(format!("could not start a generation thread: {e}")))?;
        Ok(NativeGeneration { cancel, finished })
    }
}

fn run_generation(engine: Engine, request: GenerationRequest, on_event: EventCallback) {
    let result = catch_unwind(AssertUnwindSafe(|| {
        engine.generate(&request, |piece| {
            let mut event = NativeEvent::empty("piece");
            event.text = Some(piece.text.to_string());
            event.token = Some(piece.token);
            // Anything but Ok means Node is shutting down: stop generating.
            on_event.call(event, ThreadsafeFunctionCallMode::NonBlocking) == Status::Ok
        })
    }));
    let event = match result {
        Ok(Ok(output)) => {
            let mut event = NativeEvent::empty("done");
            event.finish_reason = Some(output.finish_reason.as_str().to_string());
            event.prompt_tokens = Some(output.stats.prompt_tokens as u32);
            event.generated_tokens = Some(output.stats.generated_tokens as u32);
            event.prompt_ms = Some(ms(output.stats.prompt_time));
            event.decode_ms = Some(ms(output.stats.decode_time));
            event.kv_cache_bytes = Some(output.stats.kv_cache_bytes as f64);
            event.cached_tokens = Some(output.stats.cached_tokens as u32);
            event.process_peak_memory_bytes = Some(output.stats.process_peak_memory_bytes as f64);
            event
        }
        Ok(Err(e)) => {
            let mut event = NativeEvent::empty("error");
            event.code = Some(engine_code(&e).to_string());
            event.message = Some(e.to_string());
            event
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            let mut event = NativeEvent::empty("error");
            event.code = Some("GENERATION".into());
            event.message = Some(format!("internal error in the generation thread: {what}"));
            event
        }
    };
    on_event.call(event, ThreadsafeFunctionCallMode::NonBlocking);
}

/// Stops every engine's scheduler thread for process exit
/// (`mlxcel_engine::shutdown`): running generations end as cancelled, new
/// ones fail. Waits at most `timeoutMs`; true if all stopped.
#[napi]
pub fn shutdown_engines(timeout_ms: u32) -> bool {
    mlxcel_engine::shutdown(Duration::from_millis(timeout_ms as u64))
}

/// Set when a generation thread has returned.
#[derive(Default)]
struct Finished {
    done: Mutex<bool>,
    cv: Condvar,
}

/// Marks the generation finished when the thread ends, however it ends.
struct FinishGuard(Arc<Finished>);

impl Drop for FinishGuard {
    fn drop(&mut self) {
        *self.0.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0.cv.notify_all();
    }
}

/// A running generation.
#[napi]
pub struct NativeGeneration {
    cancel: CancelFlag,
    finished: Arc<Finished>,
}

#[napi]
impl NativeGeneration {
    /// Asks the generation to stop at the next prefill chunk or decode step;
    /// it then reports `done` with finish reason "cancelled".
    #[napi]
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Blocks the calling thread until the generation thread has returned,
    /// at most `timeoutMs`; true if it has. Only for process exit (index.js
    /// cancels and joins running generations there, so no thread is inside
    /// MLX or BLAS while the process tears the libraries down).
    #[napi]
    pub fn wait_finished(&self, timeout_ms: u32) -> bool {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
        let mut done = self.finished.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            done = self
                .finished
                .cv
                .wait_timeout(done, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}
