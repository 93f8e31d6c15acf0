/// Everything generation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Loading or running the model failed (the message names file and tensor).
    #[error(transparent)]
    Model(#[from] mlxcel_models::Error),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_sys::Error),
    /// A sampling or generation parameter is out of range.
    #[error("invalid parameter `{name}`: {message}")]
    InvalidParameter { name: &'static str, message: String },
    #[error("the prompt is empty after tokenization")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens, more than the model's context of {context}")]
    PromptTooLong { prompt: usize, context: usize },
    /// The request could never fit the model's KV pool, even alone.
    #[error(
        "the request needs up to {} MiB of KV cache (its prompt plus max_tokens), more than the KV pool's budget of {} MiB",
        needed_bytes.div_ceil(1 << 20),
        budget_bytes >> 20
    )]
    KvPoolTooSmall { needed_bytes: usize, budget_bytes: usize },
    /// The process is exiting ([`shutdown`](crate::shutdown) ran): no new generation starts.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Tokenizer and chat-template errors stay `Error::Model(mlxcel_models::Error::Tokenizer | ChatTemplate)`,
/// which the C, Python and Node bindings map to their tokenizer errors.
impl From<mlxcel_tokenizer::Error> for Error {
    fn from(e: mlxcel_tokenizer::Error) -> Self {
        Error::Model(e.into())
    }
}
