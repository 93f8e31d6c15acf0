//! GGUF reading and conversion to MLX checkpoints.
//!
//! [`convert_gguf`] turns a llama.cpp GGUF file into a Hugging Face-layout MLX checkpoint
//! directory (`model.safetensors` in MLX's affine quantization layout, `config.json`,
//! `tokenizer.json`, ...).

pub mod affine;
pub mod arch;
mod convert;
pub mod dequant;
pub mod ggml_type;
pub mod hf_tokenizer;
pub mod reader;
mod safetensors_out;

pub use convert::{
    convert_gguf, unpermute_source_row, ConvertOptions, ConvertReport, SUPPORTED_GROUP_SIZES,
};
pub use ggml_type::GgmlType;
pub use reader::{GgufFile, TensorInfo, Value};
