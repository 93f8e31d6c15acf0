//! One error enum for the crate; every variant names the image or file involved.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An image that cannot be used: empty, truncated, an unknown format,
    /// dimensions over the limits. `image` names it (a path, or e.g. `image 2`).
    #[error("{image}: {message}")]
    Image { image: String, message: String },
    /// A processor configuration file that cannot be read or is invalid.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A prompt whose image placeholders do not match the images given.
    #[error("{0}")]
    Prompt(String),
}

impl Error {
    pub fn image(image: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Image { image: image.into(), message: message.into() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
