/// An error raised by MLX, with MLX's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    message: String,
}

impl Error {
    pub fn new(message: impl Into<String>) -> Self {
        Error { message: message.into() }
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error { message: e.what().to_string() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
