//! The one error type of `mlxcel-audio`.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while decoding, resampling or analysing audio.
///
/// Errors from [`load_file`](crate::load_file) come wrapped in [`Error::File`], which names the
/// path; [`Error::cause`] reaches the variant underneath. Nothing in this crate panics on bad
/// input: every malformed, truncated or absurd file ends in one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file could not be opened or read (missing, a directory, no permission...).
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A decoding error, in the file `path`.
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: Box<Error>,
    },
    /// The input has no bytes at all.
    #[error("empty input: 0 bytes")]
    EmptyInput,
    /// The bytes are not a container this crate reads (WAV, FLAC, MP3, Ogg).
    #[error("not audio, or an unknown format (expected WAV, FLAC, MP3 or Ogg Vorbis): {message}")]
    UnknownFormat { message: String },
    /// The input ends before its headers or its declared audio data do.
    #[error("truncated: {message}")]
    Truncated { message: String },
    /// The container is known but holds no audio track.
    #[error("no audio track in the container")]
    NoAudioTrack,
    /// The audio track is in a codec, or a codec variant, this crate does not decode.
    #[error("unsupported codec: {message}")]
    UnsupportedCodec { message: String },
    /// A header field has a value no real audio has (a 0 Hz sample rate, 0 or 70,000 channels...).
    #[error("invalid header: {message}")]
    InvalidHeader { message: String },
    /// The audio data is malformed.
    #[error("malformed audio data: {message}")]
    Malformed { message: String },
    /// The file is valid but decodes to no samples.
    #[error("the audio has no samples")]
    NoSamples,
    /// The audio is longer than [`MAX_DURATION_SECS`](crate::MAX_DURATION_SECS); nothing larger
    /// is allocated.
    #[error("the audio is longer than the limit of {max_secs} s ({max_frames} frames at {rate} Hz)")]
    TooLong { max_secs: u64, max_frames: u64, rate: u32 },
    /// A function was called with an argument it cannot use (a 0 Hz rate, 0 mel bands...).
    #[error("invalid argument `{name}`: {message}")]
    InvalidArgument { name: &'static str, message: String },
    /// The resampler refused its input (should not happen for validated rates).
    #[error("resampling failed: {message}")]
    Resample { message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The error underneath the [`Error::File`] layer, or `self`.
    pub fn cause(&self) -> &Error {
        match self {
            Error::File { source, .. } => source.cause(),
            other => other,
        }
    }

    pub(crate) fn in_file(self, path: &Path) -> Error {
        match self {
            e @ (Error::Io { .. } | Error::File { .. }) => e,
            e => Error::File { path: path.to_path_buf(), source: Box::new(e) },
        }
    }

    pub(crate) fn invalid_argument(name: &'static str, message: impl Into<String>) -> Error {
        Error::InvalidArgument { name, message: message.into() }
    }
}
