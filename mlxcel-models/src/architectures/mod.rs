//! One module per architecture of `mlxcel_gguf::Architecture`, the table the GGUF converter
//! shares; [`constructor`] maps a `model_type` (or alias) to its module.

pub mod bert;
pub mod decoder;
pub mod gemma2;
pub mod gemma3;
pub mod idefics3;
pub mod llama;
pub mod mixtral;
pub mod olmo2;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_moe;
pub mod siglip;
pub mod transformer;

use std::path::Path;

pub use mlxcel_gguf::Architecture;

use crate::error::{Error, Result};
use crate::model::LanguageModel;
use crate::weights::Scope;

/// What an architecture's constructor reads.
pub struct LoadContext<'a> {
    pub config: &'a serde_json::Value,
    pub config_path: &'a Path,
    pub scope: Scope<'a>,
}

pub(crate) type Constructor = fn(&LoadContext) -> Result<Box<dyn LanguageModel>>;

/// The constructor of each architecture of the shared table (`mlxcel_gguf::Architecture`,
/// which also holds the `model_type` aliases). The match is exhaustive, so an architecture
/// the converter can write cannot lack a loader.
fn constructor_of(arch: Architecture) -> Constructor {
    match arch {
        Architecture::Llama => llama::load,
        Architecture::Qwen2 => qwen2::load,
        Architecture::Qwen3 => qwen3::load,
        Architecture::Gemma2 => gemma2::load,
        Architecture::Gemma3 => gemma3::load,
        Architecture::Olmo2 => olmo2::load,
        Architecture::Phi3 => phi3::load,
        Architecture::Mixtral => mixtral::load,
        Architecture::Qwen3Moe => qwen3_moe::load,
    }
}

/// Every loadable `model_type`, aliases included: the shared table's, then
/// the vision-language models (which the GGUF converter does not write).
pub fn supported_model_types() -> Vec<&'static str> {
    let mut types = Architecture::model_types();
    types.extend(idefics3::MODEL_TYPES);
    types
}

pub fn constructor(model_type: &str, config_path: &Path) -> Result<Constructor> {
    if idefics3::MODEL_TYPES.contains(&model_type) {
        return Ok(idefics3::load);
    }
    Architecture::from_model_type(model_type).map(constructor_of).ok_or_else(|| Error::UnknownArchitecture {
        path: config_path.into(),
        model_type: model_type.into(),
        supported: supported_model_types().join(", "),
    })
}
