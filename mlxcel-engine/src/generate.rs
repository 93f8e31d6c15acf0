//! Prefill and decode: chunked prompt evaluation, then one token per step with
//! the next step queued (`async_eval`) before the current token is handed out.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx_sys::{async_eval, eval, memory, Array, Dtype};
use mlxcel_models::chat_template::Message;
use mlxcel_models::{runtime, KvCache, Model};

use crate::error::{Error, Result};
use crate::sampling::{recent_tokens, Sampler, SamplingParams};
use crate::stop::{StopMatcher, StopOutcome};

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
    /// Prompt tokens evaluated per forward pass during prefill.
    pub prefill_chunk: usize,
    /// Set from any thread to stop between prefill chunks or decode steps.
    pub cancel: Option<CancelFlag>,
    /// Keep decoding past EOS tokens (they are still sampled and counted, and
    /// their text, if any, is streamed) until `max_tokens`, a stop string or
    /// cancellation. For benchmarks that need an exact token count; default false.
    pub ignore_eos: bool,
}

impl GenerationRequest {
    pub fn new(prompt: Prompt) -> Self {
        GenerationRequest { prompt, params: SamplingParams::default(), prefill_chunk: 512, cancel: None, ignore_eos: false }
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
    /// `mlx_sys::memory::reset_peak_memory`). Generations never reset it.
    pub process_peak_memory_bytes: usize,
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
    pub finish_reason: FinishReason,
    pub stats: GenerationStats,
}

/// Runs generations on one model.
///
/// Thread safety: `Engine` is `Send + Sync` and cheap to clone; each call to
/// [`generate`](Self::generate) uses its own KV caches, so several threads
/// may generate with one engine at the same time.
#[derive(Clone)]
pub struct Engine {
    model: Arc<Model>,
}

impl Engine {
    /// Process-wide settings (MLX's buffer cache, backend switches) are not
    /// the engine's: they are fixed once per process by
    /// [`RuntimeConfig`](crate::RuntimeConfig), from the environment at the
    /// first model load unless [`runtime::init`](crate::runtime::init) came first.
    pub fn new(model: Arc<Model>) -> Self {
        Engine { model }
    }

    pub fn load(dir: &Path) -> Result<Self> {
        Ok(Engine::new(Arc::new(Model::load(dir)?)))
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The token ids a prompt becomes.
    pub fn tokenize_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let tokenizer = &self.model.tokenizer;
        let ids = match prompt {
            Prompt::Text(text) => tokenizer.encode(text, true)?,
            Prompt::Chat(messages) => tokenizer.encode(&tokenizer.apply_chat_template(messages, true)?, false)?,
            Prompt::Tokens(ids) => ids.clone(),
        };
        let vocab = self.model.network.shape().vocab_size;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::InvalidParameter { name: "prompt", message: format!("token id {bad} is outside the vocabulary of {vocab}") });
        }
        Ok(ids)
    }

    /// Generates a continuation, calling `on_piece` with each piece of text as
    /// soon as it is complete UTF-8. Returning `false` from it stops early.
    pub fn generate(&self, request: &GenerationRequest, mut on_piece: impl FnMut(Piece<'_>) -> bool) -> Result<GenerationOutput> {
        runtime::get()?;
        let params = &request.params;
        let mut sampler = Sampler::new(params)?;
        if request.prefill_chunk == 0 {
            return Err(Error::InvalidParameter { name: "prefill_chunk", message: "must be at least 1".into() });
        }
        let prompt = self.tokenize_prompt(&request.prompt)?;
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if let Some(context) = self.model.network.shape().max_position_embeddings {
            if prompt.len() > context {
                return Err(Error::PromptTooLong { prompt: prompt.len(), context });
            }
        }
        let cancelled = || request.cancel.as_ref().is_some_and(CancelFlag::is_cancelled);
        let network = &self.model.network;
        let tokenizer = &self.model.tokenizer;
        let mut caches = network.new_caches();
        let start = Instant::now();
        let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
        let mut output = GenerationOutput { text: String::new(), tokens: Vec::new(), finish_reason: FinishReason::Length, stats: stats.clone() };

        // Prefill all but the last chunk, evaluating the caches as we go.
        let (head, last) = prompt.split_at(prompt.len() - ((prompt.len() - 1) % request.prefill_chunk + 1));
        for chunk in head.chunks(request.prefill_chunk) {
            if cancelled() {
                break;
            }
            network.forward_last(&token_array(chunk)?, &mut caches)?;
            eval(caches.iter().flat_map(|c| c.state()).collect::<Vec<_>>().iter())?;
        }
        if cancelled() {
            output.finish_reason = FinishReason::Cancelled;
            stats.kv_cache_bytes = caches.iter().map(|c| c.nbytes()).sum();
            stats.process_peak_memory_bytes = memory::peak_memory();
            output.stats = stats;
            return Ok(output);
        }
        let use_penalty = params.repetition_penalty != 1.0;
        let step = |input: &Array, caches: &mut [Box<dyn KvCache>], sampler: &mut Sampler, history: &[u32]| -> Result<Array> {
            let last = network.forward_last(input, caches)?.squeeze(1)?;
            let recent = if use_penalty {
                let prev = input.reshape(&[-1])?;
                Some(recent_tokens(history, &prev.slice_axis(0, prev.dim(0) - 1, prev.dim(0))?, params.repetition_context_size)?)
            } else {
                None
            };
            sampler.sample(&last, recent.as_ref())
        };
        let mut history: Vec<u32> = prompt.clone();
        let mut next = step(&token_array(last)?, &mut caches, &mut sampler, &history[..history.len() - 1])?;
        async_eval([&next])?;

        let mut decoder = tokenizer.stream_decoder(true);
        let mut stops = StopMatcher::new(&params.stop);
        let mut decode_start = None;
        let mut stop_string_hit = false;
        let finish = loop {
            let current = next;
            let generated = output.tokens.len() + 1;
            // Queue step n+1 before handing out token n.
            let more = generated < params.max_tokens;
            next = if more {
                let input = current.reshape(&[1, 1])?.astype(Dtype::Int32)?;
                let n = step(&input, &mut caches, &mut sampler, &history)?;
                async_eval([&n])?;
                n
            } else {
                current.clone()
            };
            let token = current.astype(Dtype::Uint32)?.item::<u32>()?;
            if decode_start.is_none() {
                stats.prompt_time = start.elapsed();
                decode_start = Some(Instant::now());
            }
            output.tokens.push(token);
            history.push(token);
            if !request.ignore_eos && tokenizer.is_eos(token) {
                break FinishReason::Stop;
            }
            if let Some(piece) = decoder.step(token)? {
                let text = match stops.push(&piece) {
                    StopOutcome::Continue(text) => text,
                    StopOutcome::Stopped(text) => {
                        stop_string_hit = true;
                        text
                    }
                };
                if !text.is_empty() {
                    output.text.push_str(&text);
                    if !on_piece(Piece { text: &text, token }) {
                        break FinishReason::Cancelled;
                    }
                }
            }
            if stop_string_hit {
                break FinishReason::Stop;
            }
            if cancelled() {
                break FinishReason::Cancelled;
            }
            if !more {
                break FinishReason::Length;
            }
        };
        if finish != FinishReason::Cancelled && !stop_string_hit {
            // Flush what the decoder and the stop matcher still hold.
            let rest = decoder.finish()?.unwrap_or_default();
            let tail = match stops.push(&rest) {
                StopOutcome::Continue(text) => text + &stops.finish(),
                StopOutcome::Stopped(text) => text,
            };
            if !tail.is_empty() {
                output.text.push_str(&tail);
                on_piece(Piece { text: &tail, token: *output.tokens.last().unwrap_or(&0) });
            }
        }
        stats.generated_tokens = output.tokens.len();
        stats.decode_time = decode_start.map_or(Duration::ZERO, |t| t.elapsed());
        stats.kv_cache_bytes = caches.iter().map(|c| c.nbytes()).sum();
        stats.process_peak_memory_bytes = memory::peak_memory();
        output.finish_reason = finish;
        output.stats = stats;
        Ok(output)
    }
}

fn token_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&ids, &[1, ids.len() as i32])?)
}
