//! Architectures, checkpoint loading, tokenizers and chat templates.

pub mod error;
pub mod gguf;
pub mod tokenizer;
pub mod chat_template;

pub use error::{Error, Result};
