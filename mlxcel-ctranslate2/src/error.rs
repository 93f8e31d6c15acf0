//! The one error type of `mlxcel-ctranslate2`.

use std::path::PathBuf;

/// Everything that can go wrong reading or converting a CTranslate2 model.
/// Every variant names the file, and the variable where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    InvalidFile { path: PathBuf, message: String },
    #[error("{path}: missing variable `{variable}`")]
    MissingVariable { path: PathBuf, variable: String },
    #[error("{path}: unsupported: {message}")]
    Unsupported { path: PathBuf, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub(crate) fn invalid(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::InvalidFile { path: path.into(), message: message.into() }
    }
    pub(crate) fn unsupported(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Unsupported { path: path.into(), message: message.into() }
    }
}
