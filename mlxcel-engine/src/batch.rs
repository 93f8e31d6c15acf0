//! The batch engine: every generation is a row, and one forward pass decodes
//! every decoding row at once. A single sequence is a batch of one; there is
//! no other generation loop.
//!
//! - [`BatchEngine::open`] adds a row for a tokenized prompt;
//! - [`BatchEngine::prefill`] runs one chunk of a row's prompt, so that
//!   chunks of long prompts interleave with decode steps;
//! - [`BatchEngine::submit`] queues one forward over every decoding row
//!   (`async_eval`), and [`BatchEngine::finish_rows`] reads the tokens of the
//!   step before, so the next step computes while this one's tokens are
//!   detokenized and checked; [`BatchEngine::step`] does both;
//! - [`BatchEngine::close`] drops a row and its caches.
//!
//! Errors belong to a row: a row whose forward or sampling fails ends with
//! its own error, and the other rows go on. Each row's tokens are the ones
//! it gets alone: the model's batched forward computes every row exactly as
//! it would alone (`LanguageModel::forward_batch`), and each row samples
//! with its own sampler and seed.
//!
//! Not thread safe by design: one thread (the [`Scheduler`](crate::scheduler))
//! owns the engine. Other threads reach it through the scheduler's channel.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx_sys::kernels::KvWindow;
use mlx_sys::{async_eval, concatenate, eval, Array, Dtype};
use mlxcel_models::nn::RowKernels;
use mlxcel_models::paged::{KvFormat, KvPool, PagedKvCache, RowBlocks};
use mlxcel_models::{KvCache, LanguageModel, Model};
use mlxcel_tokenizer::StreamDecodeState;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::generate::{CancelFlag, FinishReason, GenerationOutput, GenerationStats};
use crate::prefix_cache::{self, BLOCK_TOKENS, MIN_PROMPT_TOKENS};
use crate::sampler_chain::DryBreakers;
use crate::sampling::{PendingLogprobs, Sampled, Sampler, SamplingParams, TokenLogprobs};
use crate::speculative::{self, DraftPolicy, Speculation, MAX_DRAFT_TOKENS};
use crate::stop::{StopMatcher, StopOutcome};

/// A row's handle inside one [`BatchEngine`].
pub type RowId = u64;

/// What [`BatchEngine::open`] takes: a tokenized prompt and how to continue it.
#[derive(Debug, Clone)]
pub struct RowRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Prompt tokens per prefill chunk (at least 1).
    pub prefill_chunk: usize,
    /// Keep decoding past EOS tokens (see `GenerationRequest::ignore_eos`).
    pub ignore_eos: bool,
    /// Adopt cached prompt blocks and store this prompt's.
    pub cache_prompt: bool,
    /// Checked between chunks and steps: a set flag finishes the row as cancelled.
    pub cancel: Option<CancelFlag>,
    /// The prompt's images, for a vision-language model: their features
    /// replace the embeddings of the prompt's image tokens in the prefill.
    pub images: Option<Arc<ImageInputs>>,
}

/// A prompt's images as the vision tower takes them: every image's tiles in
/// prompt order, `[tiles, 3, side, side]` f32, normalized.
#[derive(Debug, Clone)]
pub struct ImageInputs {
    pub pixel_values: Vec<f32>,
    pub tiles: usize,
    pub side: usize,
}

/// What a row reports, in order: pieces, then one `Finished` or `Failed`.
#[derive(Debug)]
pub enum RowEvent {
    /// Complete UTF-8 text and the token that completed it; `generated` is
    /// the number of tokens generated so far, this one included.
    /// `logprobs`: those of the tokens since the previous piece, when the
    /// request asks for them.
    Piece { row: RowId, text: String, token: u32, generated: usize, logprobs: Vec<TokenLogprobs> },
    /// The row ended and was closed.
    Finished { row: RowId, output: GenerationOutput },
    /// The row failed and was closed; the other rows go on.
    Failed { row: RowId, error: Error },
}

impl RowEvent {
    pub fn row(&self) -> RowId {
        match self {
            RowEvent::Piece { row, .. } | RowEvent::Finished { row, .. } | RowEvent::Failed { row, .. } => *row,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Prefilling,
    Decoding,
    /// Failed in `submit`; removed at its end.
    Failed,
}

struct Row {
    id: RowId,
    prompt: Vec<u32>,
    /// Prompt tokens in the caches.
    prefilled: usize,
    prefill_chunk: usize,
    phase: Phase,
    caches: Vec<Box<dyn KvCache>>,
    /// The pool blocks reserved for a row whose caches are not paged (its
    /// paged caches hold their blocks themselves).
    _reserved: Option<RowBlocks>,
    /// `Prefill` for rows that take part in the prefix cache.
    kernels: RowKernels,
    /// The hash chain of the prompt's full blocks, for rows that use the
    /// prefix cache (empty otherwise): they are stored after the prefill.
    block_hashes: Vec<u64>,
    /// Prompt tokens adopted from the prefix cache.
    cached_tokens: usize,
    /// The prompt's images, until the prefill has used them.
    images: Option<Arc<ImageInputs>>,
    /// The whole prompt's input embeddings with the image features merged
    /// in, made at the first chunk and sliced by each chunk.
    embeddings: Option<Array>,
    sampler: Sampler,
    params: SamplingParams,
    ignore_eos: bool,
    cancel: Option<CancelFlag>,
    /// The prompt and every token read back so far.
    history: Vec<u32>,
    /// The latest sampled token, not yet read back: the input of the next step.
    queued: Option<Array>,
    /// The token `submit` took out of `queued`, then the draft tokens a
    /// verify round accepted after it, for `finish_rows` to read in order.
    unread: Vec<Unread>,
    /// The logprobs of `queued`, when the request asks.
    queued_logprobs: Option<PendingLogprobs>,
    /// Speculative decoding state, for rows that speculate.
    spec: Option<SpecRow>,
    /// Every generated token's logprobs, and how many went out with pieces.
    logprobs: Vec<TokenLogprobs>,
    logprobs_sent: usize,
    text: String,
    tokens: Vec<u32>,
    decoder: StreamDecodeState,
    stops: StopMatcher,
    opened: Instant,
    prompt_time: Option<Duration>,
    decode_start: Option<Instant>,
}

/// A generated token waiting to be read back, with its logprobs.
struct Unread {
    token: Array,
    logprobs: Option<PendingLogprobs>,
}

/// A speculating row's drafter state.
struct SpecRow {
    policy: DraftPolicy,
    /// The draft model's caches, for `Speculation::Draft`.
    draft: Option<DraftCaches>,
}

/// A row's caches in the draft model and how many of its tokens they hold.
struct DraftCaches {
    caches: Vec<Box<dyn KvCache>>,
    cached: usize,
    /// Draws draft tokens at temperature > 0.
    rng: ChaCha8Rng,
}

/// One row's verify round: its index, its input token and drafts, and the
/// draft model's distributions when the round uses rejection sampling.
struct Round {
    index: usize,
    inputs: Vec<u32>,
    q: Option<Vec<Vec<f32>>>,
    /// The drafts are tokens a constraint forces, not a drafter's guesses.
    forced: bool,
}

impl Row {
    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(CancelFlag::is_cancelled)
    }

    /// The length of the row's next prompt chunk when it is the last one:
    /// the remainder of 1..=`prefill_chunk` tokens, as alone.
    fn last_chunk(&self) -> Option<usize> {
        let total = self.prompt.len();
        let last_start = total - ((total - 1) % self.prefill_chunk + 1);
        (self.phase == Phase::Prefilling && self.prefilled >= last_start).then(|| total - self.prefilled)
    }

    /// Positions in this row's caches.
    fn cached(&self) -> usize {
        self.caches.first().map_or(0, |c| c.offset())
    }

    /// Drops positions past `offset` from every layer's cache.
    fn rewind(&mut self, offset: usize) {
        for cache in &mut self.caches {
            let extra = cache.offset().saturating_sub(offset);
            cache.trim(extra);
        }
    }

    fn stats(&self) -> GenerationStats {
        GenerationStats {
            prompt_tokens: self.prompt.len(),
            generated_tokens: self.tokens.len(),
            prompt_time: self.prompt_time.unwrap_or_default(),
            decode_time: self.decode_start.map_or(Duration::ZERO, |t| t.elapsed()),
            kv_cache_bytes: self.caches.iter().map(|c| c.nbytes()).sum(),
            draft_tokens: self.spec.as_ref().map_or(0, |s| s.policy.drafted),
            accepted_tokens: self.spec.as_ref().map_or(0, |s| s.policy.accepted),
            process_peak_memory_bytes: crate::generate::process_peak_memory_bytes(),
            cached_tokens: self.cached_tokens,
            mask_time: self.sampler.mask_time(),
        }
    }
}

/// Rows of one model; see the module docs.
pub struct BatchEngine {
    model: Arc<Model>,
    pool: Arc<KvPool>,
    /// Whether full prompt blocks are cached and adopted.
    prefix_caching: bool,
    rows: Vec<Row>,
    next_id: RowId,
    /// Events of rows that ended outside `finish_rows` (prefill, cancel).
    pending: Vec<RowEvent>,
    /// DRY's breakers over the model's vocabulary, by breaker list.
    dry_breakers: HashMap<Vec<String>, Arc<DryBreakers>>,
    /// The draft model for `Speculation::Draft`, and its decode cost in
    /// target decode steps (the ratio of their weight bytes).
    draft: Option<(Arc<Model>, f64)>,
    /// Structured output's compiler over the model's vocabulary, built by
    /// the first constrained request.
    grammars: Option<Arc<mlxcel_grammar::GrammarCompiler>>,
}

impl BatchEngine {
    /// An engine whose rows keep their keys and values in `pool` (see
    /// [`pool_for`](Self::pool_for)). Prompt blocks are cached when
    /// `prefix_caching` is on and the pool is paged.
    pub fn new(model: Arc<Model>, pool: Arc<KvPool>, prefix_caching: bool) -> Self {
        let prefix_caching = caches_prefixes(model.network(), &pool, prefix_caching);
        BatchEngine { model, pool, prefix_caching, rows: Vec::new(), next_id: 1, pending: Vec::new(), dry_breakers: HashMap::new(), draft: None, grammars: None }
    }

    /// The structured-output compiler for this model's vocabulary.
    fn grammars(&mut self) -> Result<Arc<mlxcel_grammar::GrammarCompiler>> {
        if self.grammars.is_none() {
            let vocab = self.model.network().shape().vocab_size;
            let compiler = mlxcel_grammar::GrammarCompiler::new(self.model.tokenizer(), vocab)
                .map_err(|e| Error::InvalidParameter { name: "json_schema", message: e.to_string() })?;
            self.grammars = Some(Arc::new(compiler));
        }
        Ok(self.grammars.clone().expect("built above"))
    }

    /// Lets rows speculate with `draft` (`Speculation::Draft`): a smaller
    /// model with the same vocabulary. Its caches are per row, outside the pool.
    pub fn set_draft_model(&mut self, draft: Arc<Model>) -> Result<()> {
        check_draft_model(&self.model, &draft)?;
        let cost = draft.info().weight_bytes as f64 / self.model.info().weight_bytes.max(1) as f64;
        self.draft = Some((draft, cost));
        Ok(())
    }

    /// A pool of `bytes` for `model`'s rows: paged when its kernels read a
    /// paged pool, accounting only otherwise. A sliding `window` and an
    /// 8-bit `format` need a paged pool.
    pub fn pool_for(model: &Model, bytes: usize, window: KvWindow, format: KvFormat) -> Result<Arc<KvPool>> {
        let network = model.network();
        format
            .check(network.shape(), network.reads_paged_kv())
            .map_err(|e| Error::InvalidParameter { name: "kv_bits", message: e.to_string() })?;
        KvPool::new(network.shape(), bytes, network.reads_paged_kv(), window, format)
            .map_err(|e| Error::InvalidParameter { name: "max_kv_size", message: e.to_string() })
    }

    /// The KV pool of this engine's rows.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Pool blocks a row of `request` may hold at once: its prompt and
    /// `max_tokens` within the model's context, or under a window what the
    /// window keeps.
    fn blocks_needed(&self, request: &RowRequest) -> usize {
        let mut positions = request.prompt.len() + request.params.max_tokens;
        if let Some(context) = self.model.network().shape().max_position_embeddings {
            positions = positions.min(context.max(request.prompt.len()));
        }
        // No node takes more new positions than a prompt chunk.
        self.pool.window_blocks(positions, request.prefill_chunk.min(request.prompt.len()))
    }

    /// Whether [`open`](Self::open) can take `request` now: false while the
    /// pool's blocks are held or reserved by other rows (the request should
    /// wait), an error when it needs more than the whole pool.
    pub fn fits(&self, request: &RowRequest) -> Result<bool> {
        let needed = self.blocks_needed(request);
        let usage = self.pool.usage();
        if needed > usage.total {
            return Err(self.too_small(needed));
        }
        Ok(needed <= usage.available())
    }

    /// The error for a request of `needed` blocks that the pool cannot take.
    fn too_small(&self, needed: usize) -> Error {
        Error::KvPoolTooSmall { needed_bytes: needed * self.pool.block_bytes(), budget_bytes: self.pool.budget_bytes() }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Rows open (prefilling or decoding).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Adds a row; `opened` is when its request arrived (its time to first
    /// token counts from there). Invalid parameters, an empty prompt, token
    /// ids outside the vocabulary and prompts longer than the model's context
    /// are errors here, before the row exists.
    pub fn open(&mut self, request: RowRequest, opened: Instant) -> Result<RowId> {
        let vocab = self.model.network().shape().vocab_size;
        if let Some(&(id, _)) = request.params.logit_bias.iter().find(|&&(id, _)| id as usize >= vocab) {
            return Err(Error::InvalidParameter {
                name: "logit_bias",
                message: format!("token id {id} is outside the vocabulary of {vocab}"),
            });
        }
        let (model, cache) = (&self.model, &mut self.dry_breakers);
        let mut sampler = Sampler::new(&request.params, |breakers| {
            cache.entry(breakers.to_vec()).or_insert_with(|| Arc::new(dry_breakers(model, breakers))).clone()
        })?;
        if let Some(constraint) = request.params.constraint() {
            let option = constraint.option_name();
            sampler.constrain(self.grammars()?.compile(&constraint).map_err(|e| Error::constraint(option, e))?, option);
        }
        validate_prompt(&self.model, &request.prompt, request.prefill_chunk)?;
        let spec = self.spec_row(&request.params)?;
        let needed = self.blocks_needed(&request);
        let (mut kernels, mut block_hashes, mut adopted) = (RowKernels::ByCount, Vec::new(), Vec::new());
        if self.prefix_caching && request.prompt.len() > MIN_PROMPT_TOKENS {
            // The same kernels with or without the cache, so the tokens are too.
            kernels = RowKernels::Prefill;
            // A prompt with images neither adopts nor stores blocks: the same
            // token ids stand for different pixels.
            if request.cache_prompt && request.images.is_none() {
                block_hashes = prefix_cache::block_hashes(&request.prompt);
                // At least one prompt token is left to prefill, for the logits.
                let max_blocks = (request.prompt.len() - 1) / BLOCK_TOKENS;
                adopted = prefix_cache::adopt(&self.pool, &request.prompt, &block_hashes, max_blocks);
            }
        }
        let cached_tokens = adopted.len() * BLOCK_TOKENS;
        // Under a window the row holds only the adopted blocks it still sees.
        self.pool.drop_hidden(&mut adopted, cached_tokens);
        let held = adopted.iter().filter(|&&b| b >= 0).count();
        // `fits` was true: the pool has room for every block beyond the adopted ones.
        let Ok(reservation) = self.pool.reserve(needed.saturating_sub(held)) else {
            // Gives the adopted blocks back.
            drop(RowBlocks::new(self.pool.clone(), adopted, Default::default()));
            return Err(self.too_small(needed));
        };
        let blocks = RowBlocks::new(self.pool.clone(), adopted, reservation);
        let layers = self.model.network().shape().num_layers;
        let (caches, reserved) = if self.pool.is_paged() {
            (PagedKvCache::for_row(blocks, layers, cached_tokens), None)
        } else {
            (self.model.network().new_caches(), Some(blocks))
        };
        let id = self.next_id;
        self.next_id += 1;
        self.rows.push(Row {
            kernels,
            block_hashes,
            cached_tokens,
            images: request.images,
            embeddings: None,
            id,
            history: request.prompt.clone(),
            prompt: request.prompt,
            prefilled: cached_tokens,
            prefill_chunk: request.prefill_chunk,
            phase: Phase::Prefilling,
            caches,
            _reserved: reserved,
            sampler,
            stops: StopMatcher::new(&request.params.stop),
            params: request.params,
            ignore_eos: request.ignore_eos,
            cancel: request.cancel,
            queued: None,
            unread: Vec::new(),
            queued_logprobs: None,
            spec,
            logprobs: Vec::new(),
            logprobs_sent: 0,
            text: String::new(),
            tokens: Vec::new(),
            decoder: StreamDecodeState::new(true),
            opened,
            prompt_time: None,
            decode_start: None,
        });
        Ok(id)
    }

    /// The oldest row still prefilling, with its chunk size.
    pub fn next_prefill(&self) -> Option<(RowId, usize)> {
        self.rows.iter().find(|r| r.phase == Phase::Prefilling).map(|r| (r.id, r.prefill_chunk))
    }

    /// Runs prompt chunks of `row`: at least one, and more while `budget`
    /// tokens last. Chunks fall where they fall for the row alone (multiples
    /// of its `prefill_chunk`, the remainder last), so its numerics do not
    /// depend on the budget. After the last chunk the row samples its first
    /// token and decodes from the next [`submit`](Self::submit). When the
    /// row's next chunk is its last, the last chunks of the same length of
    /// other rows run with it in one batched forward, as the budget allows
    /// (each row still computed as alone). Returns the prompt tokens run; a
    /// failure ends its row with its error.
    pub fn prefill(&mut self, row: RowId, budget: usize) -> usize {
        let mut done = 0;
        loop {
            let Some(index) = self.index(row) else { return done };
            if self.rows[index].phase != Phase::Prefilling {
                return done;
            }
            if self.rows[index].cancelled() {
                self.end(index, FinishReason::Cancelled);
                return done;
            }
            let companions = self.last_chunk_companions(index, budget.saturating_sub(done));
            if !companions.is_empty() {
                let mut rows = vec![index];
                rows.extend(companions);
                return done + self.prefill_last_chunks(&rows);
            }
            match self.prefill_chunk(index) {
                Ok(n) => done += n,
                Err(error) => {
                    self.fail(index, error);
                    return done;
                }
            }
            if done >= budget {
                return done;
            }
        }
    }

    /// Other prefilling rows whose next chunk, like row `index`'s, is their
    /// last and of the same length: they can share its forward. Only on the
    /// kernels a batched forward picks (`ByCount`: prompts of up to 32
    /// tokens, or any without the prefix cache), and as many as fit in
    /// `budget` tokens with it (none when it alone takes the budget).
    fn last_chunk_companions(&self, index: usize, budget: usize) -> Vec<usize> {
        let Some(length) = self.rows[index].last_chunk() else { return Vec::new() };
        // Rows with images prefill from embeddings, alone.
        if self.rows[index].kernels != RowKernels::ByCount || self.rows[index].images.is_some() {
            return Vec::new();
        }
        let room = (budget / length).saturating_sub(1);
        (0..self.rows.len())
            .filter(|&i| i != index)
            .filter(|&i| {
                let r = &self.rows[i];
                r.kernels == RowKernels::ByCount && r.images.is_none() && r.last_chunk() == Some(length) && !r.cancelled()
            })
            .take(room)
            .collect()
    }

    /// The last prompt chunks of `rows` (of one length) in one batched
    /// forward, each row then sampling its first token. If the batch fails,
    /// each row runs alone, so only a row at fault fails. Returns the prompt
    /// tokens run.
    fn prefill_last_chunks(&mut self, rows: &[usize]) -> usize {
        let before: Vec<usize> = rows.iter().map(|&i| self.rows[i].cached()).collect();
        let result = (|| -> Result<Vec<Sampled>> {
            let inputs = rows
                .iter()
                .map(|&i| token_array(&self.rows[i].prompt[self.rows[i].prefilled..]))
                .collect::<Result<Vec<_>>>()?;
            let logits = {
                let mut caches: Vec<&mut [Box<dyn KvCache>]> = Vec::with_capacity(rows.len());
                let mut by_index: Vec<Option<&mut Row>> = self.rows.iter_mut().map(Some).collect();
                for &i in rows {
                    caches.push(&mut by_index[i].take().expect("each row once").caches);
                }
                self.model.network().forward_batch(&concatenate(&inputs, 0)?, &mut caches)?
            };
            let mut next = Vec::with_capacity(rows.len());
            for (b, (&i, tokens)) in rows.iter().zip(&inputs).enumerate() {
                let r = &mut self.rows[i];
                next.push(r.sampler.sample(&logits.slice_axis(0, b as i32, b as i32 + 1)?, &r.history[..r.prompt.len() - 1], tokens)?);
            }
            queue_sampled(&next)?;
            Ok(next)
        })();
        match result {
            Ok(next) => {
                let mut done = 0;
                for (&i, sampled) in rows.iter().zip(next) {
                    let r = &mut self.rows[i];
                    done += r.prompt.len() - r.prefilled;
                    r.prefilled = r.prompt.len();
                    r.queued = Some(sampled.token);
                    r.queued_logprobs = sampled.logprobs;
                    r.phase = Phase::Decoding;
                }
                done
            }
            Err(_) => {
                for (&i, &offset) in rows.iter().zip(&before) {
                    self.rows[i].rewind(offset);
                }
                let ids: Vec<RowId> = rows.iter().map(|&i| self.rows[i].id).collect();
                ids.into_iter().map(|id| self.prefill(id, 0)).sum()
            }
        }
    }

    /// The next prompt chunk of row `index`; returns its length.
    fn prefill_chunk(&mut self, index: usize) -> Result<usize> {
        let network = self.model.network();
        let r = &mut self.rows[index];
        let total = r.prompt.len();
        let start = r.prefilled;
        let end = if r.last_chunk().is_none() { (start + r.prefill_chunk).min(total) } else { total };
        let tokens = token_array(&r.prompt[start..end])?;
        let logits = match &r.images {
            None => network.forward_last_with(&tokens, &mut r.caches, r.kernels)?,
            Some(images) => {
                if r.embeddings.is_none() {
                    r.embeddings = Some(prompt_embeddings(network, &r.prompt, images)?);
                }
                let h = r.embeddings.as_ref().expect("made above").slice_axis(1, start as i32, end as i32)?;
                network.forward_last_embedded(&h, &mut r.caches, r.kernels)?
            }
        };
        if end == total {
            r.images = None;
            r.embeddings = None;
        }
        if !r.block_hashes.is_empty() {
            // Cached as they fill: under a window the next chunk may hand
            // this chunk's blocks back. Later readers come after this node.
            if let Some(paged) = r.caches.first_mut().and_then(|c| c.as_paged()) {
                let mut blocks = paged.row_blocks().lock().unwrap_or_else(|e| e.into_inner());
                let full = (end / BLOCK_TOKENS).min(r.block_hashes.len());
                prefix_cache::store(&self.pool, &r.prompt, &r.block_hashes[..full], blocks.table());
                blocks.seal(full * BLOCK_TOKENS);
            }
        }
        if end < total {
            eval(r.caches.iter().flat_map(|c| c.state()).collect::<Vec<_>>().iter())?;
        } else {
            let last = logits.squeeze(1)?;
            let next = r.sampler.sample(&last, &r.history[..total - 1], &tokens)?;
            queue_sampled(std::slice::from_ref(&next))?;
            r.queued = Some(next.token);
            r.queued_logprobs = next.logprobs;
            r.phase = Phase::Decoding;
        }
        r.prefilled = end;
        Ok(end - start)
    }

    /// Queues one forward over every decoding row: each row's queued token
    /// goes in, and the token sampled from it is queued (`async_eval`) before
    /// [`finish_rows`](Self::finish_rows) reads the previous one back. Rows
    /// that reach `max_tokens` with the token they hold are not stepped.
    /// Speculating rows with a draft verify it instead ([`Self::verify_rows`]).
    pub fn submit(&mut self) {
        let mut stepped = Vec::new();
        let mut rounds = Vec::new();
        for i in 0..self.rows.len() {
            let r = &mut self.rows[i];
            if r.phase != Phase::Decoding || !r.unread.is_empty() {
                continue;
            }
            let Some(current) = r.queued.take() else { continue };
            let generated = r.tokens.len();
            let more = generated + 1 < r.params.max_tokens;
            r.unread.push(Unread { token: current.clone(), logprobs: r.queued_logprobs.take() });
            if !more || r.cancelled() {
                continue;
            }
            match self.draft_round(i, &current) {
                Ok(Some(round)) => rounds.push(round),
                Ok(None) => stepped.push((i, current)),
                Err(error) => self.pending_failure(i, error),
            }
        }
        if !stepped.is_empty() && self.step_rows(&stepped).is_err() {
            // The batch failed as a whole: find the rows at fault by running
            // each alone; the others go on.
            for (i, token) in &stepped {
                if let Err(error) = self.step_rows(&[(*i, token.clone())]) {
                    self.pending_failure(*i, error);
                }
            }
        }
        // Rows whose drafts have the same length verify in one forward.
        rounds.sort_by_key(|r| r.inputs.len());
        while !rounds.is_empty() {
            let length = rounds[0].inputs.len();
            let split = rounds.iter().position(|r| r.inputs.len() != length).unwrap_or(rounds.len());
            let group: Vec<Round> = rounds.drain(..split).collect();
            if group.len() > 1 && self.verify_rows(&group).is_ok() {
                continue;
            }
            for round in group {
                if let Err(error) = self.verify_rows(std::slice::from_ref(&round)) {
                    self.pending_failure(round.index, error);
                }
            }
        }
        self.remove_failed();
    }

    /// The draft for row `index` whose next input is `current`, sized by its
    /// policy and by the tokens it may still generate; None when it does not
    /// speculate this step (plain decode step).
    fn draft_round(&mut self, index: usize, current: &Array) -> Result<Option<Round>> {
        let r = &mut self.rows[index];
        // The round reads back its input, its accepted drafts and queues
        // one more token: at most max_tokens in all.
        let room = r.params.max_tokens.saturating_sub(r.tokens.len() + 2);
        if r.sampler.is_constrained() {
            // Tokens the constraint forces are a draft the target accepts
            // (its mask leaves nothing else), verified in one pass.
            let mut forced = r.sampler.forced_tokens();
            forced.truncate(room.min(MAX_DRAFT_TOKENS));
            if !forced.is_empty() {
                let current = current.astype(Dtype::Uint32)?.item::<u32>()?;
                let mut inputs = vec![current];
                inputs.extend(forced);
                return Ok(Some(Round { index, inputs, q: None, forced: true }));
            }
        }
        let Some(spec) = r.spec.as_mut() else { return Ok(None) };
        let length = spec.policy.length(r.params.draft_max).max(r.params.draft_min).min(room);
        if length == 0 || length < r.params.draft_min {
            spec.policy.idle();
            return Ok(None);
        }
        let lookup = spec.draft.is_none();
        if !spec.policy.due() {
            return Ok(None);
        }
        if lookup && !speculative::prompt_lookup_possible(&r.history) {
            spec.policy.missed();
            return Ok(None);
        }
        let current = current.astype(Dtype::Uint32)?.item::<u32>()?;
        let mut known = r.history.clone();
        known.push(current);
        let (drafts, q) = match spec.draft.as_mut() {
            None => (speculative::prompt_lookup(&known, length), None),
            Some(caches) => {
                let (draft, _) = self.draft.as_ref().expect("draft rows need the draft model");
                let sample = r.params.temperature > 0.0;
                let (tokens, q) = draft_tokens(draft, caches, &r.sampler, &known, length, sample)?;
                (tokens, sample.then_some(q))
            }
        };
        if drafts.is_empty() || drafts.len() < r.params.draft_min {
            spec.policy.missed();
            return Ok(None);
        }
        let mut inputs = vec![current];
        inputs.extend(drafts);
        Ok(Some(Round { index, inputs, q, forced: false }))
    }

    /// One forward over the rounds' inputs (all of one length), each row
    /// then keeping the drafts its target samples agree with (see
    /// [`crate::speculative`]); the rejected positions are trimmed from its
    /// caches. On an error every row's caches are as before.
    fn verify_rows(&mut self, rounds: &[Round]) -> Result<()> {
        let before: Vec<usize> = rounds.iter().map(|round| self.rows[round.index].cached()).collect();
        let length = rounds[0].inputs.len();
        let result = (|| -> Result<Vec<Vec<(u32, Option<PendingLogprobs>)>>> {
            let ids: Vec<i32> = rounds.iter().flat_map(|round| round.inputs.iter().map(|&t| t as i32)).collect();
            let tokens = Array::from_slice(&ids, &[rounds.len() as i32, length as i32])?;
            let logits = {
                let mut caches: Vec<&mut [Box<dyn KvCache>]> = Vec::with_capacity(rounds.len());
                let mut by_index: Vec<Option<&mut Row>> = self.rows.iter_mut().map(Some).collect();
                for round in rounds {
                    caches.push(&mut by_index[round.index].take().expect("each row once").caches);
                }
                self.model.network().forward_batch_all(&tokens, &mut caches)?
            };
            let mut emitted = Vec::with_capacity(rounds.len());
            for (b, round) in rounds.iter().enumerate() {
                let r = &mut self.rows[round.index];
                let row_logits = logits.slice_axis(0, b as i32, b as i32 + 1)?;
                emitted.push(match &round.q {
                    Some(q) => r.sampler.verify_rejection(&row_logits, &r.history, &round.inputs, q)?,
                    None => r.sampler.verify(&row_logits, &r.history, &round.inputs)?,
                });
            }
            Ok(emitted)
        })();
        let emitted = match result {
            Ok(emitted) => emitted,
            Err(error) => {
                for (round, &offset) in rounds.iter().zip(&before) {
                    self.rows[round.index].rewind(offset);
                }
                return Err(error);
            }
        };
        for ((round, mut tokens), &offset) in rounds.iter().zip(emitted).zip(&before) {
            let r = &mut self.rows[round.index];
            let accepted = tokens.len() - 1;
            let keep = offset + 1 + accepted;
            r.rewind(keep);
            if r.cached() != keep {
                self.pending_failure(round.index, Error::Mlx(mlx_sys::Error::new(format!("the KV cache could not drop {} rejected draft positions", length - 1 - accepted))));
                continue;
            }
            let (last, last_logprobs) = tokens.pop().expect("a verify round emits a token");
            for (token, logprobs) in tokens {
                r.unread.push(Unread { token: Array::from_slice(&[token], &[1])?, logprobs });
            }
            r.queued = Some(Array::from_slice(&[last], &[1])?);
            r.queued_logprobs = last_logprobs;
            if let Some(spec) = r.spec.as_mut().filter(|_| !round.forced) {
                spec.policy.record(length - 1, accepted);
                if let Some(draft) = spec.draft.as_mut() {
                    // The draft caches hold the known tokens and all drafts but the last.
                    let known = r.history.len() + 1;
                    let keep = known + accepted.min(length - 2);
                    for cache in &mut draft.caches {
                        let extra = cache.offset().saturating_sub(keep);
                        cache.trim(extra);
                    }
                    draft.cached = keep;
                }
            }
        }
        Ok(())
    }

    /// Marks row `index` failed: its event is pending and it is removed at
    /// the end of [`submit`](Self::submit).
    fn pending_failure(&mut self, index: usize, error: Error) {
        let r = &mut self.rows[index];
        r.queued = None;
        r.unread.clear();
        r.phase = Phase::Failed;
        self.pending.push(RowEvent::Failed { row: r.id, error });
    }

    fn remove_failed(&mut self) {
        self.rows.retain(|r| r.phase != Phase::Failed);
    }

    /// One forward for `rows` (index, input token), then each row's sampling.
    /// On an error every row's caches are as before.
    fn step_rows(&mut self, rows: &[(usize, Array)]) -> Result<()> {
        let before: Vec<usize> = rows.iter().map(|&(i, _)| self.rows[i].cached()).collect();
        let result = (|| -> Result<Vec<Sampled>> {
            let inputs = rows.iter().map(|(_, t)| t.reshape(&[1, 1])?.astype(Dtype::Int32)).collect::<mlx_sys::Result<Vec<_>>>()?;
            let tokens = if inputs.len() == 1 { inputs[0].clone() } else { concatenate(&inputs, 0)? };
            let logits = {
                let mut caches: Vec<&mut [Box<dyn KvCache>]> = Vec::with_capacity(rows.len());
                // Disjoint rows: collect their caches in `rows` order.
                let mut by_index: Vec<Option<&mut Row>> = self.rows.iter_mut().map(Some).collect();
                for &(i, _) in rows {
                    caches.push(&mut by_index[i].take().expect("each row once").caches);
                }
                self.model.network().forward_batch(&tokens, &mut caches)?
            };
            let mut next = Vec::with_capacity(rows.len());
            for (b, (i, input)) in rows.iter().enumerate() {
                let r = &mut self.rows[*i];
                let row_logits = if rows.len() == 1 { logits.clone() } else { logits.slice_axis(0, b as i32, b as i32 + 1)? };
                next.push(r.sampler.sample(&row_logits, &r.history, input)?);
            }
            queue_sampled(&next)?;
            Ok(next)
        })();
        match result {
            Ok(next) => {
                for (&(i, _), sampled) in rows.iter().zip(next) {
                    self.rows[i].queued = Some(sampled.token);
                    self.rows[i].queued_logprobs = sampled.logprobs;
                }
                Ok(())
            }
            Err(error) => {
                for (&(i, _), &offset) in rows.iter().zip(&before) {
                    self.rows[i].rewind(offset);
                }
                Err(error)
            }
        }
    }

    /// Reads back the tokens [`submit`](Self::submit) took out, detokenizes
    /// them and checks every row's finish conditions (EOS, stop strings,
    /// `max_tokens`, cancellation). Returns the events of this step, and of
    /// rows that ended since the last call; ended rows are closed.
    pub fn finish_rows(&mut self) -> Vec<RowEvent> {
        let mut events = std::mem::take(&mut self.pending);
        let mut ended = Vec::new();
        for index in 0..self.rows.len() {
            let unread = std::mem::take(&mut self.rows[index].unread);
            let count = unread.len();
            for (n, u) in unread.into_iter().enumerate() {
                match self.read_token(index, u, n + 1 == count, &mut events) {
                    Ok(None) => {}
                    Ok(Some(end)) => {
                        ended.push((index, Ok(end)));
                        break;
                    }
                    Err(error) => {
                        ended.push((index, Err(error)));
                        break;
                    }
                }
            }
        }
        for (index, outcome) in ended.into_iter().rev() {
            match outcome {
                Ok(end) => events.extend(self.finished_events(index, end)),
                Err(error) => events.push(RowEvent::Failed { row: self.rows[index].id, error }),
            }
            self.rows.remove(index);
        }
        events
    }

    /// [`submit`](Self::submit) then [`finish_rows`](Self::finish_rows).
    pub fn step(&mut self) -> Vec<RowEvent> {
        self.submit();
        self.finish_rows()
    }

    /// Ends `row` as cancelled (its text so far) at once; its event comes
    /// with the next [`finish_rows`](Self::finish_rows).
    pub fn cancel(&mut self, row: RowId) {
        if let Some(index) = self.index(row) {
            self.end(index, FinishReason::Cancelled);
        }
    }

    /// Ends every row whose cancel flag is set.
    pub fn cancel_flagged(&mut self) {
        while let Some(index) = self.rows.iter().position(Row::cancelled) {
            self.end(index, FinishReason::Cancelled);
        }
    }

    /// Drops `row` and its caches without an event.
    pub fn close(&mut self, row: RowId) {
        if let Some(index) = self.index(row) {
            self.rows.remove(index);
        }
    }

    fn index(&self, row: RowId) -> Option<usize> {
        self.rows.iter().position(|r| r.id == row)
    }

    /// Processes one read-back token (`last`: the last one this step reads
    /// for the row); `Some` when the row ends.
    fn read_token(&mut self, index: usize, unread: Unread, last: bool, events: &mut Vec<RowEvent>) -> Result<Option<Ending>> {
        let tokenizer = self.model.tokenizer();
        let r = &mut self.rows[index];
        let token = unread.token.astype(Dtype::Uint32)?.item::<u32>()?;
        if r.prompt_time.is_none() {
            r.prompt_time = Some(r.opened.elapsed());
            r.decode_start = Some(Instant::now());
        }
        r.tokens.push(token);
        r.history.push(token);
        if let Some(pending) = unread.logprobs {
            r.logprobs.push(pending.resolve(token)?);
        }
        // A constrained row draws EOS only where its output may end.
        if (!r.ignore_eos || r.sampler.is_constrained()) && tokenizer.is_eos(token) {
            return Ok(Some(Ending::flushed(FinishReason::Stop)));
        }
        if let Some(piece) = r.decoder.step(tokenizer, token)? {
            let (text, stopped) = match r.stops.push(&piece) {
                StopOutcome::Continue(text) => (text, false),
                StopOutcome::Stopped(text) => (text, true),
            };
            if !text.is_empty() {
                r.text.push_str(&text);
                let logprobs = r.logprobs[r.logprobs_sent..].to_vec();
                r.logprobs_sent = r.logprobs.len();
                events.push(RowEvent::Piece { row: r.id, text, token, generated: r.tokens.len(), logprobs });
            }
            if stopped {
                return Ok(Some(Ending { reason: FinishReason::Stop, flush: false }));
            }
        }
        if r.cancelled() {
            return Ok(Some(Ending { reason: FinishReason::Cancelled, flush: false }));
        }
        if last && r.queued.is_none() {
            return Ok(Some(Ending::flushed(FinishReason::Length)));
        }
        Ok(None)
    }

    /// The last events of row `index`: the text its decoder and stop matcher
    /// still hold (when `end.flush`), then `Finished`.
    fn finished_events(&mut self, index: usize, end: Ending) -> Vec<RowEvent> {
        let tokenizer = self.model.tokenizer();
        let r = &mut self.rows[index];
        let mut events = Vec::new();
        if end.flush {
            let rest = match r.decoder.finish(tokenizer) {
                Ok(rest) => rest.unwrap_or_default(),
                Err(error) => return vec![RowEvent::Failed { row: r.id, error: error.into() }],
            };
            let tail = match r.stops.push(&rest) {
                StopOutcome::Continue(text) => text + &r.stops.finish(),
                StopOutcome::Stopped(text) => text,
            };
            if !tail.is_empty() {
                r.text.push_str(&tail);
                let token = *r.tokens.last().unwrap_or(&0);
                let logprobs = r.logprobs[r.logprobs_sent..].to_vec();
                r.logprobs_sent = r.logprobs.len();
                events.push(RowEvent::Piece { row: r.id, text: tail, token, generated: r.tokens.len(), logprobs });
            }
        }
        let output = GenerationOutput {
            text: r.text.clone(),
            tokens: r.tokens.clone(),
            logprobs: r.logprobs.clone(),
            finish_reason: end.reason,
            stats: r.stats(),
        };
        events.push(RowEvent::Finished { row: r.id, output });
        events
    }

    /// Ends row `index` now (outside `finish_rows`); its events are pending.
    fn end(&mut self, index: usize, reason: FinishReason) {
        let events = self.finished_events(index, Ending { reason, flush: false });
        self.pending.extend(events);
        self.rows.remove(index);
    }

    fn fail(&mut self, index: usize, error: Error) {
        let row = self.rows.remove(index);
        self.pending.push(RowEvent::Failed { row: row.id, error });
    }
}

/// How a row ends: its reason, and whether held-back text is flushed (not
/// after a stop string or a cancellation).
struct Ending {
    reason: FinishReason,
    flush: bool,
}

impl Ending {
    fn flushed(reason: FinishReason) -> Self {
        Ending { reason, flush: true }
    }
}

/// The input embeddings of `prompt` with the features of `images` at its
/// image tokens: the vision tower and connector run once per prompt.
fn prompt_embeddings(network: &dyn LanguageModel, prompt: &[u32], images: &ImageInputs) -> Result<Array> {
    let vision = network.vision().ok_or_else(|| Error::InvalidParameter {
        name: "images",
        message: "the model takes no images".into(),
    })?;
    let side = images.side as i32;
    let pixels = Array::from_slice(&images.pixel_values, &[images.tiles as i32, 3, side, side])?;
    let features = vision.encode(&pixels)?;
    let embedded = network.embed(&token_array(prompt)?)?;
    Ok(mlxcel_models::merge_image_features(&embedded, prompt, vision.image_token_id(), &features)?)
}

/// Whether an engine over `pool` caches prompt blocks for `network` when
/// `requested`: only a paged pool shares blocks, and only chunking-invariant
/// prefill makes a cached block equal to a fresh one.
pub fn caches_prefixes(network: &dyn LanguageModel, pool: &KvPool, requested: bool) -> bool {
    requested && pool.is_paged() && network.chunking_invariant_prefill()
}

/// The output of a request that ended before it was opened (cancelled in
/// the queue): no text, no tokens.
pub(crate) fn unopened_output(request: &RowRequest, reason: FinishReason) -> GenerationOutput {
    GenerationOutput {
        text: String::new(),
        tokens: Vec::new(),
        logprobs: Vec::new(),
        finish_reason: reason,
        stats: GenerationStats {
            prompt_tokens: request.prompt.len(),
            process_peak_memory_bytes: crate::generate::process_peak_memory_bytes(),
            ..GenerationStats::default()
        },
    }
}

/// The checks `open` makes on a prompt, shared with the clients that
/// tokenize before they submit.
pub(crate) fn validate_prompt(model: &Model, prompt: &[u32], prefill_chunk: usize) -> Result<()> {
    if prefill_chunk == 0 {
        return Err(Error::InvalidParameter { name: "prefill_chunk", message: "must be at least 1".into() });
    }
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let shape = model.network().shape();
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= shape.vocab_size) {
        return Err(Error::InvalidParameter {
            name: "prompt",
            message: format!("token id {bad} is outside the vocabulary of {}", shape.vocab_size),
        });
    }
    if let Some(context) = shape.max_position_embeddings {
        if prompt.len() > context {
            return Err(Error::PromptTooLong { prompt: prompt.len(), context });
        }
    }
    Ok(())
}

/// DRY's `breakers` over `model`'s vocabulary, as llama.cpp reads them:
/// each token's text with special tokens rendered, tails tokenized without
/// special tokens.
fn dry_breakers(model: &Model, breakers: &[String]) -> DryBreakers {
    let tokenizer = model.tokenizer();
    DryBreakers::new(
        breakers,
        tokenizer.vocab_size(),
        |id| tokenizer.decode(&[id], false).map(String::into_bytes).unwrap_or_default(),
        |text| tokenizer.encode(&String::from_utf8_lossy(text), false).unwrap_or_default(),
    )
}

/// Queues the evaluation of sampled tokens and their logprobs.
fn queue_sampled(sampled: &[Sampled]) -> Result<()> {
    let arrays: Vec<&Array> = sampled.iter().flat_map(|s| std::iter::once(&s.token).chain(s.logprobs.iter().flat_map(|l| l.arrays()))).collect();
    Ok(async_eval(arrays)?)
}

pub(crate) fn token_array(ids: &[u32]) -> Result<Array> {
    let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&ids, &[1, ids.len() as i32])?)
}

/// The speculation state for a row of `params`, or an error naming what
/// it needs and lacks.
impl BatchEngine {
    fn spec_row(&self, params: &SamplingParams) -> Result<Option<SpecRow>> {
        let invalid = |message: &str| Error::InvalidParameter { name: "speculation", message: message.into() };
        if params.speculation == Speculation::Off {
            return Ok(None);
        }
        if self.pool.window() != KvWindow::ALL {
            return Err(invalid("speculative decoding does not run under a rotating KV window (max_kv_size)"));
        }
        Ok(Some(match params.speculation {
            Speculation::Off => unreachable!(),
            Speculation::PromptLookup => SpecRow { policy: DraftPolicy::new(0.0), draft: None },
            Speculation::Draft => {
                let Some((draft, cost)) = &self.draft else {
                    return Err(invalid("\"draft\" needs a draft model, loaded with the model (draft_model)"));
                };
                let seed = params.seed.unwrap_or(0) ^ 0x9e37_79b9_7f4a_7c15;
                SpecRow {
                    policy: DraftPolicy::new(*cost),
                    draft: Some(DraftCaches { caches: draft.network().new_caches(), cached: 0, rng: ChaCha8Rng::seed_from_u64(seed) }),
                }
            }
        }))
    }
}

/// Whether `draft` can draft for `target`: the same vocabulary, token for token.
pub fn check_draft_model(target: &Model, draft: &Model) -> Result<()> {
    let invalid = |message: String| Error::InvalidParameter { name: "draft_model", message };
    let (t, d) = (target.tokenizer(), draft.tokenizer());
    let (tv, dv) = (target.network().shape().vocab_size, draft.network().shape().vocab_size);
    if tv != dv || t.vocab_size() != d.vocab_size() {
        return Err(invalid(format!(
            "{} has a vocabulary of {} (tokenizer {}), the target {} has {} (tokenizer {})",
            draft.dir().display(), dv, d.vocab_size(), target.dir().display(), tv, t.vocab_size()
        )));
    }
    if let Some(id) = (0..t.vocab_size() as u32).find(|&id| t.id_to_token(id) != d.id_to_token(id)) {
        return Err(invalid(format!(
            "{} does not share the target's tokenizer: token {id} is {:?} there and {:?} in {}",
            draft.dir().display(), d.id_to_token(id), t.id_to_token(id), target.dir().display()
        )));
    }
    Ok(())
}

/// Up to `length` draft tokens from the draft model after `known` (the
/// row's tokens and its next input): greedy, or drawn from the draft's
/// distribution under the row's chain when `sample` (returned with them).
/// The caches catch up on the tokens they lack first.
fn draft_tokens(draft: &Model, d: &mut DraftCaches, sampler: &Sampler, known: &[u32], length: usize, sample: bool) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let net = draft.network();
    let vocab = net.shape().vocab_size;
    let mut logits = None;
    for chunk in known[d.cached.min(known.len())..].chunks(crate::options::DEFAULT_PREFILL_CHUNK) {
        logits = Some(net.forward_last(&token_array(chunk)?, &mut d.caches)?);
    }
    d.cached = known.len();
    let mut logits = logits.ok_or_else(|| Error::Mlx(mlx_sys::Error::new("the draft model's caches are ahead of the row".to_string())))?;
    let (mut tokens, mut qs) = (Vec::with_capacity(length), Vec::new());
    let mut seq = known.to_vec();
    for i in 0..length {
        let token = if sample {
            let values = logits.astype(Dtype::Float32)?.reshape(&[-1])?.to_vec::<f32>()?;
            let c = sampler.draft_distribution(&values, &seq, &mut d.rng)?;
            let q = speculative::dense_probabilities(&c, vocab);
            let token = speculative::draw_dense(&q, &mut d.rng);
            qs.push(q);
            token
        } else {
            logits.reshape(&[-1])?.argmax(0, false)?.astype(Dtype::Uint32)?.item::<u32>()?
        };
        tokens.push(token);
        seq.push(token);
        if i + 1 < length {
            logits = net.forward_last(&token_array(&[token])?, &mut d.caches)?;
            d.cached += 1;
        }
    }
    Ok((tokens, qs))
}
