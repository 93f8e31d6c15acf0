/// Everything generation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Loading or running the model failed (the message names file and tensor).
    #[error(transparent)]
    Model(#[from] mlxcel_models::Error),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_sys::Error),
    /// A model could not be loaded: whatever failed (files, tokenizer,
    /// fetching the default model) is reported as a load failure.
    #[error("{0}")]
    Load(Box<dyn std::error::Error + Send + Sync>),
    /// A sampling or generation parameter is out of range.
    #[error("invalid parameter `{name}`: {message}")]
    InvalidParameter { name: &'static str, message: String },
    #[error("the prompt is empty after tokenization")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens, more than the model's context of {context}")]
    PromptTooLong { prompt: usize, context: usize },
    /// The request could never fit the model's KV pool, even alone.
    #[error(
        "the request needs up to {:.1} MiB of KV cache (its prompt plus max_tokens), more than the KV pool's budget of {} MiB",
        *needed_bytes as f64 / (1 << 20) as f64,
        budget_bytes >> 20
    )]
    KvPoolTooSmall { needed_bytes: usize, budget_bytes: usize },
    /// The process is exiting ([`shutdown`](crate::shutdown) ran): no new generation starts.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The kinds of [`Error`] every front end tells apart: the C ABI's status
/// codes, Python's exception classes and Node's error codes are each mapped
/// from this enum in one table, so an error has the same kind everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A parameter (or the prompt's token ids) is out of range; see [`Error::parameter`].
    InvalidParameter,
    EmptyPrompt,
    PromptTooLong,
    /// The checkpoint (or the default model) could not be loaded.
    ModelLoad,
    /// The tokenizer or the chat template failed.
    Tokenizer,
    /// MLX failed while computing.
    Mlx,
    /// The request needs more KV cache than the model's whole pool.
    KvPoolTooSmall,
    /// The process is exiting.
    ShuttingDown,
}

impl ErrorKind {
    /// A stable upper-case name, e.g. `"TOKENIZER"`.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidParameter => "INVALID_PARAMETER",
            ErrorKind::EmptyPrompt => "EMPTY_PROMPT",
            ErrorKind::PromptTooLong => "PROMPT_TOO_LONG",
            ErrorKind::ModelLoad => "MODEL_LOAD",
            ErrorKind::Tokenizer => "TOKENIZER",
            ErrorKind::Mlx => "MLX",
            ErrorKind::KvPoolTooSmall => "KV_POOL_TOO_SMALL",
            ErrorKind::ShuttingDown => "SHUTTING_DOWN",
        }
    }
}

impl Error {
    /// A structured-output error, filed under the request option that set
    /// the constraint (`json_schema`, `regex` or `grammar`) unless the
    /// grammar crate names one itself.
    pub(crate) fn constraint(option: &'static str, error: mlxcel_grammar::Error) -> Error {
        match error {
            mlxcel_grammar::Error::Invalid { name, message } => Error::InvalidParameter { name, message },
            other => Error::InvalidParameter { name: option, message: other.to_string() },
        }
    }

    /// What kind of error this is, for front ends that map errors to codes.
    pub fn code(&self) -> ErrorKind {
        use mlxcel_models::Error as M;
        match self {
            Error::Model(M::Tokenizer(_) | M::ChatTemplate(_)) => ErrorKind::Tokenizer,
            Error::Model(M::Mlx(_)) | Error::Mlx(_) => ErrorKind::Mlx,
            Error::Model(M::InvalidInput(_)) => ErrorKind::InvalidParameter,
            Error::Model(_) | Error::Load(_) => ErrorKind::ModelLoad,
            Error::InvalidParameter { .. } => ErrorKind::InvalidParameter,
            Error::EmptyPrompt => ErrorKind::EmptyPrompt,
            Error::PromptTooLong { .. } => ErrorKind::PromptTooLong,
            Error::KvPoolTooSmall { .. } => ErrorKind::KvPoolTooSmall,
            Error::ShuttingDown => ErrorKind::ShuttingDown,
        }
    }

    /// The parameter at fault: its name for `InvalidParameter`, `"prompt"`
    /// for prompt errors, else `None`.
    pub fn parameter(&self) -> Option<&'static str> {
        match self {
            Error::InvalidParameter { name, .. } => Some(name),
            Error::EmptyPrompt | Error::PromptTooLong { .. } => Some("prompt"),
            // The prompt plus max_tokens: max_tokens is the one to lower.
            Error::KvPoolTooSmall { .. } => Some("max_tokens"),
            _ => None,
        }
    }

    /// A load failure, whatever its cause (see [`ErrorKind::ModelLoad`]).
    pub fn load(cause: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error::Load(cause.into())
    }
}

/// Tokenizer and chat-template errors stay `Error::Model(mlxcel_models::Error::Tokenizer | ChatTemplate)`,
/// whose [`Error::code`] is [`ErrorKind::Tokenizer`].
impl From<mlxcel_tokenizer::Error> for Error {
    fn from(e: mlxcel_tokenizer::Error) -> Self {
        Error::Model(e.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_and_chat_template_errors_are_one_kind() {
        let tokenizer: Error = mlxcel_tokenizer::Error::Tokenizer("bad".into()).into();
        let template: Error = mlxcel_tokenizer::Error::ChatTemplate("no template".into()).into();
        assert_eq!(tokenizer.code(), ErrorKind::Tokenizer);
        assert_eq!(template.code(), ErrorKind::Tokenizer);
        assert_eq!(tokenizer.parameter(), None);
    }

    #[test]
    fn load_failures_are_model_load_whatever_their_cause() {
        let tokenizer = mlxcel_models::Error::Tokenizer("broken tokenizer.json".into());
        assert_eq!(Error::load(tokenizer).code(), ErrorKind::ModelLoad);
        assert_eq!(Error::load("no network").to_string(), "no network");
    }

    #[test]
    fn prompt_errors_name_the_prompt() {
        assert_eq!(Error::EmptyPrompt.parameter(), Some("prompt"));
        assert_eq!(Error::PromptTooLong { prompt: 9, context: 8 }.code(), ErrorKind::PromptTooLong);
        let bad = Error::InvalidParameter { name: "top_p", message: "x".into() };
        assert_eq!((bad.code(), bad.parameter()), (ErrorKind::InvalidParameter, Some("top_p")));
    }
}
