//! The one error type of `mlxcel-models`.

use std::path::PathBuf;

/// Everything that can go wrong while reading, converting or running a checkpoint.
///
/// Every variant names the file and, where there is one, the tensor involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    InvalidFile { path: PathBuf, message: String },
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: {} tensor(s) that the `{model_type}` model does not read: {}", tensors.len(), list_some(tensors))]
    UnusedTensors { path: PathBuf, model_type: String, tensors: Vec<String> },
    #[error("{path}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        expected: Vec<i64>,
        actual: Vec<i64>,
    },
    #[error("unknown model_type `{model_type}` in {path} (supported: {supported})")]
    UnknownArchitecture {
        path: PathBuf,
        model_type: String,
        supported: String,
    },
    #[error("{path}: unsupported: {message}")]
    Unsupported { path: PathBuf, message: String },
    #[error("invalid configuration in {path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },
    /// An input the model cannot take (for example a sequence longer than its positions).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("MLX: {0}")]
    Mlx(String),
    /// An environment variable of the runtime configuration has a value it does not accept.
    #[error("environment variable {name}={value:?}: {message}")]
    InvalidEnvVar { name: &'static str, value: String, message: String },
    /// The process-wide runtime configuration could not be set.
    #[error("runtime configuration: {0}")]
    RuntimeConfig(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub fn invalid_file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::InvalidFile { path: path.into(), message: message.into() }
    }
}

/// Keeps the variants (and so the C and Python error classes) a tokenizer error had when the
/// tokenizer lived in this crate.
impl From<mlxcel_tokenizer::Error> for Error {
    fn from(e: mlxcel_tokenizer::Error) -> Self {
        use mlxcel_tokenizer::Error as T;
        match e {
            T::Io { path, source } => Error::Io { path, source },
            T::Json { path, source } => Error::Json { path, source },
            T::InvalidFile { path, message } => Error::InvalidFile { path, message },
            T::Tokenizer(message) => Error::Tokenizer(message),
            T::ChatTemplate(message) => Error::ChatTemplate(message),
            other => Error::Tokenizer(other.to_string()),
        }
    }
}

impl From<mlx_sys::Error> for Error {
    fn from(e: mlx_sys::Error) -> Self {
        Error::Mlx(e.message().to_string())
    }
}

/// The first few names, and how many more.
fn list_some(names: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names.iter().take(SHOWN).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        text += &format!(" and {} more", names.len() - SHOWN);
    }
    text
}
