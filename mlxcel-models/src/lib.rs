//! Architectures, checkpoint loading, tokenizers and chat templates.

pub mod architectures;
pub mod cache;
pub mod chat_template;
pub mod error;
pub mod gguf;
pub mod default_model;
pub mod model;
pub mod nn;
pub mod quantization;
pub mod tokenizer;
pub mod weights;

pub use cache::{KvCache, StandardKvCache};
pub use error::{Error, Result};
pub use model::{LanguageModel, Model, ModelInfo, ModelShape};
