//! Architectures, layers, KV caches and checkpoint loading on MLX.
//!
//! The tokenizer and chat templates live in `mlxcel-tokenizer` (re-exported here as
//! [`tokenizer`] and [`chat_template`]); GGUF conversion and the architecture table in
//! `mlxcel-gguf`; the cache and the default model in `mlxcel-hub`.

pub mod architectures;
pub mod cache;
pub mod embedding;
pub mod error;
pub mod model;
pub mod moe;
pub mod nn;
pub mod paged;
pub mod quantization;
pub mod rerank;
pub mod runtime;
pub mod weights;
pub mod whisper;

pub use cache::{KvCache, StandardKvCache};
pub use paged::{KvFormat, KvPool, PagedKvCache, RowBlocks};
pub use mlxcel_tokenizer::{chat_template, tokenizer};
pub use embedding::{EmbeddingModel, Pooling};
pub use error::{Error, Result};
pub use rerank::CrossEncoder;
pub use model::{merge_image_features, LanguageModel, Model, ModelInfo, ModelLayout, ModelShape, VisionEncoder};
pub use quantization::QuantParams;
