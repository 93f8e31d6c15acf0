//! CTranslate2 models for mlxcel, without MLX: [`Ct2File`] reads a
//! `model.bin`, and [`convert_whisper`] turns a CTranslate2 Whisper model
//! (faster-whisper's format) into an MLX checkpoint in mlx-whisper's layout.

pub mod error;
pub mod reader;
pub mod whisper;

pub use error::{Error, Result};
pub use reader::{Ct2File, DataType, Variable};
pub use whisper::{convert_whisper, whisper_dims, ConvertProgress, WhisperDims, WhisperReport};
