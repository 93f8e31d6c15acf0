//! The mlxcel Engine: turns a prompt into streamed text over a loaded model.
//!
//! ```no_run
//! use mlxcel_engine::{Engine, GenerationRequest, Prompt};
//! let engine = Engine::load(std::path::Path::new("model-dir"))?;
//! let request = GenerationRequest::new(Prompt::Text("The capital of France is".into()));
//! let output = engine.generate(&request, |piece| {
//!     print!("{}", piece.text);
//!     true // keep going
//! })?;
//! eprintln!("{:.1} tok/s", output.stats.decode_tokens_per_second());
//! # Ok::<(), mlxcel_engine::Error>(())
//! ```

pub mod batch;
pub mod chat_json;
mod embed;
mod error;
mod generate;
mod options;
mod sampling;
pub mod sampler_chain;
pub mod speculative;
pub mod prefix_cache;
pub mod scheduler;
mod stop;
mod stream;
mod summary;
pub mod transcribe;

pub use embed::{Embedder, Embeddings, Reranker, Scores, EMBED_PASS_TOKENS, MAX_EMBED_TEXTS};
pub use error::{Error, ErrorKind, Result};
pub use mlxcel_models::Pooling;
pub use generate::{
    generate_batch, CancelFlag, Engine, EngineLimits, FinishReason, LimitOptions, DEFAULT_KV_KEEP, GenerationOutput, GenerationRequest, GenerationStats, Piece, Prompt,
};
pub use options::{GenerationOptions, DEFAULT_PREFILL_CHUNK};
pub use chat_json::{messages_from_json, ImagePolicy, MessageError, DEFAULT_MAX_IMAGE_BYTES};
pub use mlxcel_tokenizer::{Content, ContentPart, ImageSource, Message};
pub use mlxcel_models::runtime::{self, PrefillBackend, RuntimeConfig};
pub use mlxcel_models::KvFormat;
pub use mlxcel_models::QuantParams;
pub use sampling::{SamplingParams, TokenLogprobs, MAX_TOP_LOGPROBS};
pub use speculative::{Speculation, MAX_DRAFT_TOKENS};
pub use scheduler::shutdown;
pub use stream::{GenerationStream, StreamEvent};
pub use transcribe::{Audio, Segment, Task, TranscribeOptions, Transcriber, Transcription};
pub use summary::{GroupSummary, ModelSummary, Quantization, TokenizerSummary};
