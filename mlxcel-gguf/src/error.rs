//! The one error type of `mlxcel-gguf`.

use std::path::PathBuf;

/// Everything that can go wrong while reading or converting a GGUF file.
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
    #[error("{path}: {message}")]
    InvalidFile { path: PathBuf, message: String },
    #[error("{path}: missing tensor `{tensor}`")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: unsupported: {message}")]
    Unsupported { path: PathBuf, message: String },
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
