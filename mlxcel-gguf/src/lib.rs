//! GGUF reading and conversion to MLX checkpoints; nothing here touches MLX.
//!
//! [`convert_gguf`] turns a llama.cpp GGUF file into a Hugging Face-layout MLX checkpoint
//! directory (`model.safetensors` in MLX's affine quantization layout, `config.json`,
//! `tokenizer.json`, ...). [`arch`] is the table of supported architectures that the loader
//! in `mlxcel-models` shares.

pub mod affine;
pub mod arch;
mod convert;
pub mod dequant;
pub mod error;
pub mod ggml_type;
pub mod hf_tokenizer;
pub mod reader;
pub mod rope;
mod safetensors_out;

pub use arch::Architecture;
pub use convert::{
    convert_gguf, convert_gguf_with_progress, unpermute_source_row, ConvertOptions,
    ConvertProgress, ConvertReport, SUPPORTED_GROUP_SIZES,
};
pub use error::{Error, Result};
pub use ggml_type::GgmlType;
pub use reader::{GgufFile, TensorInfo, Value};
