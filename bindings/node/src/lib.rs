//! Node bindings for mlxcel: the native half of `require('mlxcel')`.
//!
//! A translation layer over the engine facade; `index.js` builds the public
//! API (promises, async iterators, AbortSignal) on top of it:
//!
//! - `loadModel(path?)` loads a checkpoint on the libuv thread pool
//!   (an `AsyncTask`) and resolves to a `NativeModel`.
//! - `NativeModel.start(prompt, options)` queues one generation as a row of
//!   the engine's scheduler and returns a `NativeGeneration`, the engine's
//!   `GenerationStream`: `next()` resolves (on the thread pool, off the
//!   event loop) to the events that have arrived, pieces then one `done` or
//!   `error`; `cancel()` stops it between prefill chunks or decode steps.
//!   No thread of this addon's own runs a generation.
//! - `loadEmbedder(path?)` loads a sentence-embedding model the same way and
//!   resolves to a `NativeEmbedder`, the engine's `Embedder`: `embed(texts)`
//!   runs on the thread pool, `embedSync(texts)` on the calling thread;
//!   `loadReranker(path)` gives a `NativeReranker`, the engine's `Reranker`.
//! - `loadTranscriber(path?)` gives a `NativeTranscriber`, the engine's
//!   Whisper `Transcriber`: `transcribe(audio, options)` runs on the thread pool.
//!
//! Defaults and checks are the engine's (`GenerationOptions`), and so are
//! the error kinds: every error, thrown or as an `error` event, carries the
//! public code of its `Error::code()` (see [`code_of`]).

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mlxcel_engine::{
    CancelFlag, Embedder, Embeddings, Engine, EngineLimits, Error as EngineError, ErrorKind, GenerationOptions, GenerationStream,
    LimitOptions, Message, ContentPart, Prompt, Reranker, Scores, StreamEvent, Audio, Task as WhisperTask, TranscribeOptions, Transcriber,
    Transcription,
};
use napi::bindgen_prelude::*;
use napi_derive::napi;

/// The public error code of each engine error kind: Node's one error table.
fn code_of(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidParameter => "INVALID_PARAMETER",
        ErrorKind::EmptyPrompt => "EMPTY_PROMPT",
        ErrorKind::PromptTooLong => "PROMPT_TOO_LONG",
        ErrorKind::ModelLoad => "MODEL_LOAD",
        ErrorKind::Tokenizer => "TOKENIZER",
        ErrorKind::KvPoolTooSmall => "KV_POOL_TOO_SMALL",
        _ => "GENERATION",
    }
}

/// The `code` of a thrown error: an engine error's public code, or napi's
/// own status for failures of the bridge itself.
pub enum Code {
    Napi(Status),
    Public(&'static str),
}

impl AsRef<str> for Code {
    fn as_ref(&self) -> &str {
        match self {
            Code::Napi(status) => status.as_ref(),
            Code::Public(code) => code,
        }
    }
}

impl From<Status> for Code {
    fn from(status: Status) -> Self {
        Code::Napi(status)
    }
}

fn coded(e: EngineError) -> Error<Code> {
    Error::new(Code::Public(code_of(e.code())), e.to_string())
}

// ---------------------------------------------------------------- loading

/// A checkpoint directory, a packaged model's name (fetched on first use) or,
/// without a path, the default model, reported on stderr when `progress`.
fn resolve_model(path: Option<&str>, progress: bool) -> Result<std::path::PathBuf> {
    let mut lines = progress.then(|| mlxcel_hub::ProgressText::new(std::io::stderr().is_terminal()));
    let mut report = |p: mlxcel_hub::Progress| {
        if let Some(text) = lines.as_mut().and_then(|l| l.text(&p)) {
            // Best effort: a closed stderr does not fail the load.
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
        }
    };
    match path {
        Some(path) => mlxcel_hub::resolve_model(std::path::Path::new(path), &Default::default(), &mut report),
        None => mlxcel_hub::fetch_default_model(&Default::default(), &mut report),
    }
    .map_err(|e| Error::from_reason(e.to_string()))
}

pub struct LoadTask {
    path: Option<String>,
    progress: bool,
    limits: EngineLimits,
    draft_model: Option<String>,
}

impl Task for LoadTask {
    type Output = Engine;
    type JsValue = NativeModel;

    /// A failure is always `MODEL_LOAD` (the engine's `ErrorKind::ModelLoad`);
    /// `index.js` gives the rejection that code.
    fn compute(&mut self) -> Result<Engine> {
        let dir = resolve_model(self.path.as_deref(), self.progress)?;
        let draft = self.draft_model.as_deref().map(std::path::Path::new);
        Engine::load_with_draft(&dir, self.limits, draft).map_err(|e| Error::from_reason(e.to_string()))
    }

    fn resolve(&mut self, _env: Env, engine: Engine) -> Result<NativeModel> {
        Ok(NativeModel { engine })
    }
}

/// Loads a checkpoint directory (or, without a path, the default model,
/// downloading and converting it on first use, reported on stderr when
/// `progress` is not false) off the event loop.
/// The limits (whole numbers: `kv_pool_bytes` at least 1 MiB, `max_kv_size`
/// larger than `kv_keep`, `kv_bits` 8) are checked before the load starts: a bad one
/// throws INVALID_PARAMETER. `draft_model`: a checkpoint directory loaded
/// beside the model, drafting for `speculation: "draft"`. `q_bits` /
/// `q_group_size`: quantize a dense checkpoint as it loads.
#[napi(ts_return_type = "Promise<NativeModel>")]
#[allow(clippy::too_many_arguments)]
pub fn load_model(
    path: Option<String>,
    progress: Option<bool>,
    kv_pool_bytes: Option<f64>,
    max_kv_size: Option<f64>,
    kv_keep: Option<f64>,
    kv_bits: Option<f64>,
    draft_model: Option<String>,
    q_bits: Option<f64>,
    q_group_size: Option<f64>,
) -> Result<AsyncTask<LoadTask>, Code> {
    let whole = |name, v: Option<f64>| v.map(|v| GenerationOptions::whole_number(name, v)).transpose().map_err(coded);
    let limits = LimitOptions {
        kv_pool_bytes: whole("kv_pool_bytes", kv_pool_bytes)?,
        max_kv_size: whole("max_kv_size", max_kv_size)?,
        kv_keep: whole("kv_keep", kv_keep)?,
        kv_bits: whole("kv_bits", kv_bits)?,
        max_rows: None,
        q_bits: whole("q_bits", q_bits)?,
        q_group_size: whole("q_group_size", q_group_size)?,
    }
    .resolve()
    .map_err(coded)?;
    Ok(AsyncTask::new(LoadTask { path, progress: progress.unwrap_or(true), limits, draft_model }))
}

// ---------------------------------------------------------------- model

/// The engine's `ModelSummary`, in the names `info` has always used.
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
    /// `{ bits, groupSize }` of the quantization covering most parameters; null when unquantized.
    pub quantization: Option<NativeQuantization>,
}

#[napi(object)]
pub struct NativeQuantization {
    pub bits: i32,
    pub group_size: i32,
}

/// Exactly one of `content` and `parts` is set (index.js checks the shapes).
#[napi(object)]
pub struct NativeMessage {
    pub role: String,
    pub content: Option<String>,
    pub parts: Option<Vec<NativeContentPart>>,
}

/// `kind` "text" with `text`, or "image" with `path` or `data` (a whole image file).
#[napi(object)]
pub struct NativeContentPart {
    pub kind: String,
    pub text: Option<String>,
    pub path: Option<String>,
    pub data: Option<Buffer>,
}

/// Exactly one field is set.
#[napi(object)]
pub struct NativePrompt {
    pub text: Option<String>,
    pub messages: Option<Vec<NativeMessage>>,
    pub tokens: Option<Vec<u32>>,
}

/// Generation options as JavaScript numbers; absent ones take the engine's
/// defaults, and the engine checks them all.
#[napi(object)]
pub struct NativeOptions {
    pub max_tokens: Option<f64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub repetition_context_size: Option<f64>,
    pub seed: Option<f64>,
    pub stop: Option<Vec<String>>,
    pub prefill_chunk: Option<f64>,
    // The sampler chain's options (llama-server's names).
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub dry_multiplier: Option<f64>,
    pub dry_base: Option<f64>,
    pub dry_allowed_length: Option<f64>,
    pub dry_penalty_last_n: Option<f64>,
    pub dry_sequence_breakers: Option<Vec<String>>,
    pub top_n_sigma: Option<f64>,
    pub typical_p: Option<f64>,
    pub xtc_probability: Option<f64>,
    pub xtc_threshold: Option<f64>,
    pub min_keep: Option<f64>,
    /// Token id (a decimal string, as JavaScript object keys are) to bias.
    pub logit_bias: Option<std::collections::HashMap<String, f64>>,
    pub samplers: Option<Vec<String>>,
    pub logprobs: Option<f64>,
    pub post_sampling_probs: Option<bool>,
    // Speculative decoding.
    pub speculation: Option<String>,
    pub draft_max: Option<f64>,
    pub draft_min: Option<f64>,
    // Structured output (a JSON schema as text: index.js serializes objects).
    pub json_schema: Option<String>,
    pub regex: Option<String>,
    pub grammar: Option<String>,
}

/// A generated token's log-probability and its most likely alternatives.
#[napi(object)]
pub struct NativeLogprob {
    pub token: u32,
    pub logprob: f64,
    pub top_tokens: Vec<u32>,
    pub top_logprobs: Vec<f64>,
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
    /// done: speculative decoding's draft tokens proposed and accepted.
    pub draft_tokens: Option<u32>,
    pub accepted_tokens: Option<u32>,
    /// done: structured output's time computing token masks.
    pub mask_ms: Option<f64>,
    /// error: the public error code and message.
    pub code: Option<String>,
    pub message: Option<String>,
    /// piece: the logprobs of its tokens (with the `logprobs` option).
    pub logprobs: Option<Vec<NativeLogprob>>,
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
            draft_tokens: None,
            accepted_tokens: None,
            mask_ms: None,
            code: None,
            message: None,
            logprobs: None,
        }
    }

    fn of(event: StreamEvent) -> Self {
        match event {
            StreamEvent::Piece { text, token, logprobs } => {
                let mut event = NativeEvent::empty("piece");
                event.text = Some(text);
                event.token = Some(token);
                event.logprobs = Some(
                    logprobs
                        .into_iter()
                        .map(|l| NativeLogprob {
                            token: l.token,
                            logprob: l.logprob as f64,
                            top_tokens: l.top.iter().map(|t| t.0).collect(),
                            top_logprobs: l.top.iter().map(|t| t.1 as f64).collect(),
                        })
                        .collect(),
                );
                event
            }
            StreamEvent::Done(output) => {
                let stats = &output.stats;
                let mut event = NativeEvent::empty("done");
                event.finish_reason = Some(output.finish_reason.as_str().to_string());
                event.prompt_tokens = Some(stats.prompt_tokens as u32);
                event.generated_tokens = Some(stats.generated_tokens as u32);
                event.prompt_ms = Some(ms(stats.prompt_time));
                event.decode_ms = Some(ms(stats.decode_time));
                event.kv_cache_bytes = Some(stats.kv_cache_bytes as f64);
                event.cached_tokens = Some(stats.cached_tokens as u32);
                event.draft_tokens = Some(stats.draft_tokens as u32);
                event.accepted_tokens = Some(stats.accepted_tokens as u32);
                event.mask_ms = Some(ms(stats.mask_time));
                event.process_peak_memory_bytes = Some(stats.process_peak_memory_bytes as f64);
                event
            }
            StreamEvent::Failed(e) => {
                let mut event = NativeEvent::empty("error");
                event.code = Some(code_of(e.code()).to_string());
                event.message = Some(e.to_string());
                event
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A translation into the engine's `Message` / `ContentPart`.
fn messages(list: Vec<NativeMessage>) -> Vec<Message> {
    let part = |p: NativeContentPart| match (p.kind.as_str(), p.path, p.data) {
        ("image", _, Some(data)) => ContentPart::image_bytes(data.to_vec()),
        ("image", Some(path), None) => ContentPart::image_path(path),
        _ => ContentPart::text(p.text.unwrap_or_default()),
    };
    list.into_iter()
        .map(|m| match m.parts {
            Some(parts) => Message::new(m.role, parts.into_iter().map(part).collect::<Vec<_>>()),
            None => Message::new(m.role, m.content.unwrap_or_default()),
        })
        .collect()
}

/// The engine's options with the given ones set: integers must be whole numbers.
fn generation_options(o: &NativeOptions) -> Result<GenerationOptions, Code> {
    let d = GenerationOptions::default();
    let integer = |name: &'static str, value: Option<f64>| -> Result<Option<i128>, Code> {
        value.map(|v| GenerationOptions::whole_number(name, v)).transpose().map_err(coded)
    };
    // Wider than every integer option's range, so the engine reports the value.
    let count = |name, value, default: i64| -> Result<i64, Code> {
        Ok(integer(name, value)?.map_or(default, |v| v.clamp(i64::MIN as i128, i64::MAX as i128) as i64))
    };
    let options = GenerationOptions {
        max_tokens: count("max_tokens", o.max_tokens, d.max_tokens)?,
        temperature: o.temperature.unwrap_or(d.temperature),
        top_p: o.top_p.unwrap_or(d.top_p),
        top_k: count("top_k", o.top_k, d.top_k)?,
        min_p: o.min_p.unwrap_or(d.min_p),
        repetition_penalty: o.repetition_penalty.unwrap_or(d.repetition_penalty),
        repetition_context_size: count("repetition_context_size", o.repetition_context_size, d.repetition_context_size)?,
        seed: integer("seed", o.seed)?.or(d.seed),
        stop: o.stop.clone().unwrap_or(d.stop),
        prefill_chunk: count("prefill_chunk", o.prefill_chunk, d.prefill_chunk)?,
        frequency_penalty: o.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: o.presence_penalty.unwrap_or(d.presence_penalty),
        dry_multiplier: o.dry_multiplier.unwrap_or(d.dry_multiplier),
        dry_base: o.dry_base.unwrap_or(d.dry_base),
        dry_allowed_length: count("dry_allowed_length", o.dry_allowed_length, d.dry_allowed_length)?,
        dry_penalty_last_n: count("dry_penalty_last_n", o.dry_penalty_last_n, d.dry_penalty_last_n)?,
        dry_sequence_breakers: o.dry_sequence_breakers.clone(),
        top_n_sigma: o.top_n_sigma.unwrap_or(d.top_n_sigma),
        typical_p: o.typical_p.unwrap_or(d.typical_p),
        xtc_probability: o.xtc_probability.unwrap_or(d.xtc_probability),
        xtc_threshold: o.xtc_threshold.unwrap_or(d.xtc_threshold),
        min_keep: count("min_keep", o.min_keep, d.min_keep)?,
        logit_bias: match &o.logit_bias {
            None => Vec::new(),
            Some(map) => {
                let mut pairs = map
                    .iter()
                    .map(|(id, &bias)| {
                        let id = id.trim().parse::<i128>().map_err(|_| {
                            coded(mlxcel_engine::Error::InvalidParameter {
                                name: "logit_bias",
                                message: format!("keys must be token ids, got {id:?}"),
                            })
                        })?;
                        Ok((id, bias))
                    })
                    .collect::<Result<Vec<_>, Code>>()?;
                pairs.sort_by_key(|p| p.0);
                pairs
            }
        },
        samplers: o.samplers.clone(),
        logprobs: integer("logprobs", o.logprobs)?.map(|v| v.clamp(i64::MIN as i128, i64::MAX as i128) as i64),
        post_sampling_probs: o.post_sampling_probs.unwrap_or(d.post_sampling_probs),
        speculation: o.speculation.clone(),
        draft_max: count("draft_max", o.draft_max, d.draft_max)?,
        draft_min: count("draft_min", o.draft_min, d.draft_min)?,
        json_schema: o.json_schema.clone(),
        regex: o.regex.clone(),
        grammar: o.grammar.clone(),
    };
    options.validate().map_err(coded)?;
    Ok(options)
}

/// The engine's defaults of the generation options (what an absent option means).
#[napi]
pub fn generation_defaults() -> NativeOptions {
    let d = GenerationOptions::default();
    NativeOptions {
        max_tokens: Some(d.max_tokens as f64),
        temperature: Some(d.temperature),
        top_p: Some(d.top_p),
        top_k: Some(d.top_k as f64),
        min_p: Some(d.min_p),
        repetition_penalty: Some(d.repetition_penalty),
        repetition_context_size: Some(d.repetition_context_size as f64),
        seed: d.seed.map(|s| s as f64),
        stop: Some(d.stop),
        prefill_chunk: Some(d.prefill_chunk as f64),
        frequency_penalty: Some(d.frequency_penalty),
        presence_penalty: Some(d.presence_penalty),
        dry_multiplier: Some(d.dry_multiplier),
        dry_base: Some(d.dry_base),
        dry_allowed_length: Some(d.dry_allowed_length as f64),
        dry_penalty_last_n: Some(d.dry_penalty_last_n as f64),
        dry_sequence_breakers: Some(mlxcel_engine::SamplingParams::default().dry_sequence_breakers),
        top_n_sigma: Some(d.top_n_sigma),
        typical_p: Some(d.typical_p),
        xtc_probability: Some(d.xtc_probability),
        xtc_threshold: Some(d.xtc_threshold),
        min_keep: Some(d.min_keep as f64),
        logit_bias: Some(Default::default()),
        samplers: Some(mlxcel_engine::sampler_chain::DEFAULT_STAGES.iter().map(|s| s.name().to_string()).collect()),
        logprobs: None,
        post_sampling_probs: Some(d.post_sampling_probs),
        speculation: Some(d.speculation.unwrap_or_else(|| mlxcel_engine::Speculation::default().name().to_string())),
        draft_max: Some(d.draft_max as f64),
        draft_min: Some(d.draft_min as f64),
        json_schema: d.json_schema,
        regex: d.regex,
        grammar: d.grammar,
    }
}

/// A loaded model. Every method may be called while generations run, and
/// several generations may run at once (rows of one batch).
#[napi]
pub struct NativeModel {
    engine: Engine,
}

#[napi]
impl NativeModel {
    /// Whether chat messages may hold images (a vision-language model).
    #[napi(getter)]
    pub fn supports_images(&self) -> bool {
        self.engine.supports_images()
    }

    #[napi(getter)]
    pub fn info(&self) -> ModelInfo {
        let s = self.engine.summary();
        ModelInfo {
            model_type: s.architecture,
            path: s.directory.display().to_string(),
            parameters: s.parameters as f64,
            weight_bytes: s.weight_bytes as f64,
            num_layers: s.num_layers as u32,
            hidden_size: s.hidden_size as u32,
            vocab_size: s.vocab_size as u32,
            context_length: s.context_length.map(|c| c as u32),
            dtype: s.dtype,
            tokenizer_kind: s.tokenizer.kind,
            tokenizer_vocab_size: s.tokenizer.vocab_size as u32,
            eos_token_ids: s.tokenizer.eos_token_ids,
            bos_token_id: s.tokenizer.bos_token_id,
            has_chat_template: !s.tokenizer.chat_templates.is_empty(),
            quantization: s.main_quantization.map(|q| NativeQuantization { bits: q.bits, group_size: q.group_size }),
        }
    }

    #[napi]
    pub fn tokenize(&self, text: String, add_special_tokens: Option<bool>) -> Result<Vec<u32>, Code> {
        self.engine.tokenize(&text, add_special_tokens.unwrap_or(true)).map_err(coded)
    }

    #[napi]
    pub fn detokenize(&self, ids: Vec<u32>, skip_special_tokens: Option<bool>) -> Result<String, Code> {
        self.engine.detokenize(&ids, skip_special_tokens.unwrap_or(false)).map_err(coded)
    }

    #[napi]
    pub fn apply_chat_template(
        &self,
        list: Vec<NativeMessage>,
        add_generation_prompt: Option<bool>,
    ) -> Result<String, Code> {
        self.engine
            .apply_chat_template(&messages(list), add_generation_prompt.unwrap_or(true))
            .map_err(coded)
    }

    /// Checks options as `start` would, without generating.
    #[napi]
    pub fn validate_options(&self, options: NativeOptions) -> Result<(), Code> {
        generation_options(&options).map(|_| ())
    }

    /// Queues a generation; read its events with `next()`.
    #[napi]
    pub fn start(&self, prompt: NativePrompt, options: NativeOptions) -> Result<NativeGeneration, Code> {
        let prompt = match (prompt.text, prompt.messages, prompt.tokens) {
            (Some(text), None, None) => Prompt::Text(text),
            (None, Some(list), None) => Prompt::Chat(messages(list)),
            (None, None, Some(ids)) => Prompt::Tokens(ids),
            _ => {
                return Err(Error::new(
                    Code::Napi(Status::InvalidArg),
                    "the prompt needs exactly one of text, messages or tokens".to_string(),
                ))
            }
        };
        let request = generation_options(&options)?.request(prompt).map_err(coded)?;
        let stream = GenerationStream::start(&self.engine, request);
        let cancel = stream.cancel_flag().clone();
        Ok(NativeGeneration { stream: Arc::new(Mutex::new(stream)), cancel })
    }
}

/// Stops every engine's scheduler thread for process exit
/// (`mlxcel_engine::shutdown`): running generations end as cancelled, new
/// ones fail. Waits at most `timeoutMs`; true if all stopped.
#[napi]
pub fn shutdown_engines(timeout_ms: u32) -> bool {
    mlxcel_engine::shutdown(Duration::from_millis(timeout_ms as u64))
}

/// A running generation: the engine's `GenerationStream`. Dropping it (when
/// JavaScript collects it) cancels the generation.
#[napi]
pub struct NativeGeneration {
    stream: Arc<Mutex<GenerationStream>>,
    cancel: CancelFlag,
}

/// Waits on the thread pool for the next events of a generation.
pub struct NextEvents(Arc<Mutex<GenerationStream>>);

impl Task for NextEvents {
    type Output = Vec<NativeEvent>;
    type JsValue = Vec<NativeEvent>;

    /// The next event (waiting for it) and every one already queued behind it;
    /// empty once the generation has ended.
    fn compute(&mut self) -> Result<Vec<NativeEvent>> {
        let mut stream = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut events: Vec<NativeEvent> = stream.next().map(NativeEvent::of).into_iter().collect();
        while let Ok(Some(event)) = stream.next_timeout(Duration::ZERO) {
            events.push(NativeEvent::of(event));
        }
        Ok(events)
    }

    fn resolve(&mut self, _env: Env, events: Vec<NativeEvent>) -> Result<Vec<NativeEvent>> {
        Ok(events)
    }
}

#[napi]
impl NativeGeneration {
    /// Resolves to the events that have arrived (at least one, waiting for
    /// it off the event loop): pieces, then one `done` or `error`; `[]` after that.
    #[napi(ts_return_type = "Promise<NativeEvent[]>")]
    pub fn next(&self) -> AsyncTask<NextEvents> {
        AsyncTask::new(NextEvents(self.stream.clone()))
    }

    /// Asks the generation to stop at the next prefill chunk or decode step;
    /// it then reports `done` with finish reason "cancelled".
    #[napi]
    pub fn cancel(&self) {
        self.cancel.cancel();
    }
}

// ---------------------------------------------------------------- embeddings

pub struct LoadEmbedderTask {
    path: Option<String>,
    progress: bool,
}

impl Task for LoadEmbedderTask {
    type Output = Embedder;
    type JsValue = NativeEmbedder;

    /// A failure is always `MODEL_LOAD` (the engine's `ErrorKind::ModelLoad`);
    /// `index.js` gives the rejection that code.
    fn compute(&mut self) -> Result<Embedder> {
        // Without a path, the packaged all-MiniLM-L6-v2 (as `mlxcel embed`).
        let path = self.path.as_deref().unwrap_or(mlxcel_hub::ALL_MINILM_L6_V2.name);
        let dir = resolve_model(Some(path), self.progress)?;
        Embedder::load_resolved(&dir).map_err(|e| Error::from_reason(e.to_string()))
    }

    fn resolve(&mut self, _env: Env, embedder: Embedder) -> Result<NativeEmbedder> {
        Ok(NativeEmbedder { embedder })
    }
}

/// Loads a sentence-embedding checkpoint directory or packaged model (by
/// default all-MiniLM-L6-v2, fetched on first use, reported on stderr when
/// `progress` is not false) off the event loop.
#[napi(ts_return_type = "Promise<NativeEmbedder>")]
pub fn load_embedder(path: Option<String>, progress: Option<bool>) -> AsyncTask<LoadEmbedderTask> {
    AsyncTask::new(LoadEmbedderTask { path, progress: progress.unwrap_or(true) })
}

/// What `embed()` resolves to: the vectors and token counts, or the error's
/// public code and message (a rejection of the task itself could not carry the code).
#[napi(object, object_from_js = false)]
pub struct NativeEmbeddings {
    pub vectors: Option<Vec<Float32Array>>,
    /// Tokens each text ran as, special tokens included, after truncation.
    pub token_counts: Option<Vec<u32>>,
    pub code: Option<String>,
    pub message: Option<String>,
}

/// Embeds on the thread pool.
pub struct EmbedTask {
    embedder: Embedder,
    texts: Vec<String>,
}

impl Task for EmbedTask {
    type Output = std::result::Result<Embeddings, EngineError>;
    type JsValue = NativeEmbeddings;

    fn compute(&mut self) -> Result<Self::Output> {
        Ok(self.embedder.embed(&self.texts))
    }

    fn resolve(&mut self, _env: Env, outcome: Self::Output) -> Result<NativeEmbeddings> {
        Ok(match outcome {
            Ok(out) => NativeEmbeddings {
                vectors: Some(out.vectors.into_iter().map(Float32Array::new).collect()),
                token_counts: Some(out.token_counts.into_iter().map(|n| n as u32).collect()),
                code: None,
                message: None,
            },
            Err(e) => NativeEmbeddings {
                vectors: None,
                token_counts: None,
                code: Some(code_of(e.code()).to_string()),
                message: Some(e.to_string()),
            },
        })
    }
}

/// A loaded embedding model, the engine's `Embedder`: any number of `embed`
/// calls may run at once, and a text's vector is the same whatever it is
/// embedded with.
#[napi]
pub struct NativeEmbedder {
    embedder: Embedder,
}

#[napi]
impl NativeEmbedder {
    /// The length of every vector.
    #[napi(getter)]
    pub fn dims(&self) -> u32 {
        self.embedder.dims() as u32
    }

    /// Tokens a text keeps, special tokens included; longer texts are truncated.
    #[napi(getter)]
    pub fn max_tokens(&self) -> u32 {
        self.embedder.max_tokens() as u32
    }

    /// The checkpoint directory the model was loaded from.
    #[napi(getter)]
    pub fn path(&self) -> String {
        self.embedder.model().dir().display().to_string()
    }

    /// One vector per text, computed on the thread pool.
    #[napi(ts_return_type = "Promise<NativeEmbeddings>")]
    pub fn embed(&self, texts: Vec<String>) -> AsyncTask<EmbedTask> {
        AsyncTask::new(EmbedTask { embedder: self.embedder.clone(), texts })
    }

    /// One vector per text, computed on the calling thread.
    #[napi]
    pub fn embed_sync(&self, texts: Vec<String>) -> Result<Vec<Float32Array>, Code> {
        let out = self.embedder.embed(&texts).map_err(coded)?;
        Ok(out.vectors.into_iter().map(Float32Array::new).collect())
    }
}

// ---------------------------------------------------------------- reranking

pub struct LoadRerankerTask {
    path: String,
    progress: bool,
}

impl Task for LoadRerankerTask {
    type Output = Reranker;
    type JsValue = NativeReranker;

    /// A failure is always `MODEL_LOAD`, as for `LoadEmbedderTask`.
    fn compute(&mut self) -> Result<Reranker> {
        let dir = resolve_model(Some(&self.path), self.progress)?;
        Reranker::load_resolved(&dir).map_err(|e| Error::from_reason(e.to_string()))
    }

    fn resolve(&mut self, _env: Env, reranker: Reranker) -> Result<NativeReranker> {
        Ok(NativeReranker { reranker })
    }
}

/// Loads a cross-encoder checkpoint directory off the event loop.
#[napi(ts_return_type = "Promise<NativeReranker>")]
pub fn load_reranker(path: String, progress: Option<bool>) -> AsyncTask<LoadRerankerTask> {
    AsyncTask::new(LoadRerankerTask { path, progress: progress.unwrap_or(true) })
}

/// What `rerank()` resolves to: the scores and token counts, or the error's
/// public code and message.
#[napi(object, object_from_js = false)]
pub struct NativeScores {
    pub scores: Option<Vec<f64>>,
    /// Tokens each (query, document) pair ran as, after truncation.
    pub token_counts: Option<Vec<u32>>,
    pub code: Option<String>,
    pub message: Option<String>,
}

/// Scores on the thread pool.
pub struct RerankTask {
    reranker: Reranker,
    query: String,
    documents: Vec<String>,
}

impl Task for RerankTask {
    type Output = std::result::Result<Scores, EngineError>;
    type JsValue = NativeScores;

    fn compute(&mut self) -> Result<Self::Output> {
        Ok(self.reranker.rerank(&self.query, &self.documents))
    }

    fn resolve(&mut self, _env: Env, outcome: Self::Output) -> Result<NativeScores> {
        Ok(match outcome {
            Ok(out) => NativeScores {
                scores: Some(out.scores.into_iter().map(f64::from).collect()),
                token_counts: Some(out.token_counts.into_iter().map(|n| n as u32).collect()),
                code: None,
                message: None,
            },
            Err(e) => NativeScores { scores: None, token_counts: None, code: Some(code_of(e.code()).to_string()), message: Some(e.to_string()) },
        })
    }
}

/// A loaded cross-encoder, the engine's `Reranker`: any number of `rerank`
/// calls may run at once, and a pair's score is the same whatever it is
/// scored with.
#[napi]
pub struct NativeReranker {
    reranker: Reranker,
}

#[napi]
impl NativeReranker {
    /// Tokens a (query, document) pair keeps; longer pairs are truncated.
    #[napi(getter)]
    pub fn max_tokens(&self) -> u32 {
        self.reranker.model().max_tokens() as u32
    }

    /// One score per document, computed on the thread pool.
    #[napi(ts_return_type = "Promise<NativeScores>")]
    pub fn rerank(&self, query: String, documents: Vec<String>) -> AsyncTask<RerankTask> {
        AsyncTask::new(RerankTask { reranker: self.reranker.clone(), query, documents })
    }
}

// ---------------------------------------------------------------- speech to text

pub struct LoadTranscriberTask {
    path: Option<String>,
    progress: bool,
}

impl Task for LoadTranscriberTask {
    type Output = Transcriber;
    type JsValue = NativeTranscriber;

    /// A failure is always `MODEL_LOAD`, as for `LoadEmbedderTask`.
    fn compute(&mut self) -> Result<Transcriber> {
        // Without a path, the packaged whisper-tiny.en (as `mlxcel transcribe`).
        let path = self.path.as_deref().unwrap_or(mlxcel_hub::WHISPER_TINY_EN.name);
        let dir = resolve_model(Some(path), self.progress)?;
        Transcriber::load_resolved(&dir).map_err(|e| Error::from_reason(e.to_string()))
    }

    fn resolve(&mut self, _env: Env, transcriber: Transcriber) -> Result<NativeTranscriber> {
        Ok(NativeTranscriber { transcriber })
    }
}

/// Loads a Whisper checkpoint directory or packaged model (by default
/// whisper-tiny.en, fetched and converted on first use, reported on stderr
/// when `progress` is not false) off the event loop.
#[napi(ts_return_type = "Promise<NativeTranscriber>")]
pub fn load_transcriber(path: Option<String>, progress: Option<bool>) -> AsyncTask<LoadTranscriberTask> {
    AsyncTask::new(LoadTranscriberTask { path, progress: progress.unwrap_or(true) })
}

/// `transcribe()`'s options; an absent one is the engine's default, and a
/// threshold of NaN is off (index.js passes `null` as NaN).
#[napi(object)]
pub struct NativeTranscribeOptions {
    pub language: Option<String>,
    pub task: Option<String>,
    pub temperatures: Option<Vec<f64>>,
    pub best_of: Option<u32>,
    pub initial_prompt: Option<String>,
    pub condition_on_previous_text: Option<bool>,
    pub without_timestamps: Option<bool>,
    pub compression_ratio_threshold: Option<f64>,
    pub log_prob_threshold: Option<f64>,
    pub no_speech_threshold: Option<f64>,
    pub prompt_reset_on_temperature: Option<f64>,
    pub max_initial_timestamp: Option<f64>,
    pub suppress_blank: Option<bool>,
    pub seed: Option<i64>,
}

fn transcribe_options(o: NativeTranscribeOptions) -> std::result::Result<TranscribeOptions, EngineError> {
    let d = TranscribeOptions::default();
    let threshold = |given: Option<f64>, default: Option<f32>| match given {
        Some(t) if t.is_nan() => None,
        Some(t) => Some(t as f32),
        None => default,
    };
    Ok(TranscribeOptions {
        task: o.task.as_deref().map(WhisperTask::parse).transpose()?.unwrap_or(d.task),
        language: o.language,
        temperatures: o.temperatures.map(|t| t.into_iter().map(|x| x as f32).collect()).unwrap_or(d.temperatures),
        best_of: o.best_of.map_or(d.best_of, |n| n as usize),
        compression_ratio_threshold: threshold(o.compression_ratio_threshold, d.compression_ratio_threshold),
        log_prob_threshold: threshold(o.log_prob_threshold, d.log_prob_threshold),
        no_speech_threshold: threshold(o.no_speech_threshold, d.no_speech_threshold),
        condition_on_previous_text: o.condition_on_previous_text.unwrap_or(d.condition_on_previous_text),
        prompt_reset_on_temperature: o.prompt_reset_on_temperature.map_or(d.prompt_reset_on_temperature, |t| t as f32),
        initial_prompt: o.initial_prompt,
        without_timestamps: o.without_timestamps.unwrap_or(d.without_timestamps),
        max_initial_timestamp: o.max_initial_timestamp.map_or(d.max_initial_timestamp, |t| t as f32),
        suppress_blank: o.suppress_blank.unwrap_or(d.suppress_blank),
        seed: o.seed.map_or(d.seed, |s| s as u64),
    })
}

/// One segment of a transcription.
#[napi(object, object_from_js = false)]
pub struct NativeSegment {
    pub id: u32,
    pub seek: u32,
    pub start: f64,
    pub end: f64,
    pub text: String,
    pub tokens: Vec<u32>,
    pub temperature: f64,
    pub avg_logprob: f64,
    pub compression_ratio: f64,
    pub no_speech_prob: f64,
}

/// What `transcribe()` resolves to: the transcription, or the error's public
/// code and message.
#[napi(object, object_from_js = false)]
pub struct NativeTranscription {
    pub task: Option<String>,
    pub text: Option<String>,
    pub language: Option<String>,
    pub language_probability: Option<f64>,
    pub duration: Option<f64>,
    pub segments: Option<Vec<NativeSegment>>,
    pub code: Option<String>,
    pub message: Option<String>,
}

enum OwnedAudio {
    File(String),
    Bytes(Vec<u8>),
    Samples(Vec<f32>),
}

/// Transcribes on the thread pool.
pub struct TranscribeTask {
    transcriber: Transcriber,
    audio: OwnedAudio,
    options: std::result::Result<TranscribeOptions, EngineError>,
}

impl Task for TranscribeTask {
    type Output = std::result::Result<(Transcription, WhisperTask), EngineError>;
    type JsValue = NativeTranscription;

    fn compute(&mut self) -> Result<Self::Output> {
        let options = match std::mem::replace(&mut self.options, Ok(TranscribeOptions::default())) {
            Ok(options) => options,
            Err(e) => return Ok(Err(e)),
        };
        let audio = match &self.audio {
            OwnedAudio::File(path) => Audio::File(std::path::Path::new(path)),
            OwnedAudio::Bytes(bytes) => Audio::Bytes(bytes),
            OwnedAudio::Samples(samples) => Audio::Samples(samples),
        };
        Ok(self.transcriber.transcribe(audio, &options).map(|t| (t, options.task)))
    }

    fn resolve(&mut self, _env: Env, outcome: Self::Output) -> Result<NativeTranscription> {
        let empty = NativeTranscription {
            task: None,
            text: None,
            language: None,
            language_probability: None,
            duration: None,
            segments: None,
            code: None,
            message: None,
        };
        Ok(match outcome {
            Ok((t, task)) => NativeTranscription {
                task: Some(task.name().to_string()),
                language_probability: Some(t.language_probability.into()),
                duration: Some(t.duration),
                segments: Some(
                    t.segments
                        .into_iter()
                        .map(|s| NativeSegment {
                            id: s.id as u32,
                            seek: s.seek as u32,
                            start: s.start,
                            end: s.end,
                            text: s.text,
                            tokens: s.tokens,
                            temperature: s.temperature.into(),
                            avg_logprob: s.avg_logprob,
                            compression_ratio: s.compression_ratio,
                            no_speech_prob: s.no_speech_prob,
                        })
                        .collect(),
                ),
                text: Some(t.text),
                language: Some(t.language),
                ..empty
            },
            Err(e) => NativeTranscription { code: Some(code_of(e.code()).to_string()), message: Some(e.to_string()), ..empty },
        })
    }
}

/// A loaded Whisper model, the engine's `Transcriber`: any number of
/// `transcribe` calls may run at once, each on its own pool thread.
#[napi]
pub struct NativeTranscriber {
    transcriber: Transcriber,
}

#[napi]
impl NativeTranscriber {
    /// Whether the model knows languages other than English (and can translate).
    #[napi(getter)]
    pub fn is_multilingual(&self) -> bool {
        self.transcriber.is_multilingual()
    }

    /// The language codes the model knows (empty for English-only models).
    #[napi(getter)]
    pub fn languages(&self) -> Vec<String> {
        self.transcriber.languages()
    }

    /// The checkpoint directory the model was loaded from.
    #[napi(getter)]
    pub fn path(&self) -> String {
        self.transcriber.model_dir().display().to_string()
    }

    /// Transcribes a file (path), an audio file's bytes (Buffer) or mono
    /// 16 kHz samples (Float32Array) on the thread pool.
    #[napi(ts_return_type = "Promise<NativeTranscription>")]
    /// (Float32Array before Buffer: napi's Buffer takes any typed array's bytes.)
    pub fn transcribe(&self, audio: Either3<String, Float32Array, Buffer>, options: NativeTranscribeOptions) -> AsyncTask<TranscribeTask> {
        let audio = match audio {
            Either3::A(path) => OwnedAudio::File(path),
            Either3::B(samples) => OwnedAudio::Samples(samples.to_vec()),
            Either3::C(bytes) => OwnedAudio::Bytes(bytes.to_vec()),
        };
        AsyncTask::new(TranscribeTask { transcriber: self.transcriber.clone(), audio, options: transcribe_options(options) })
    }
}
