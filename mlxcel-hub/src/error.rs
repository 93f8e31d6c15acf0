//! The one error type of `mlxcel-hub`.

use std::path::PathBuf;

/// Everything that can go wrong while fetching, verifying or converting a cached model.
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
    #[error("model download: {0}")]
    Download(String),
    #[error("model conversion: {0}")]
    Convert(#[from] mlxcel_gguf::Error),
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
