//! Hugging Face tokenizers, chat templates (minijinja with transformers' extensions) and
//! UTF-8-safe streaming detokenization. Nothing here touches MLX.

pub mod chat_template;
pub mod error;
pub mod tokenizer;

pub use chat_template::{ChatTemplate, Content, ContentPart, ImageSource, Message, RenderOptions};
pub use error::{Error, Result};
pub use tokenizer::{StreamDecodeState, StreamDecoder, Tokenizer, TokenizerKind};
