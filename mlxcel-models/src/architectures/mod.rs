//! One module per Hugging Face `model_type`, registered in [`REGISTRY`].

pub mod decoder;
pub mod llama;
pub mod qwen2;
pub mod qwen3;

use std::path::Path;

use crate::error::{Error, Result};
use crate::model::LanguageModel;
use crate::weights::Scope;

/// What an architecture's constructor reads.
pub struct LoadContext<'a> {
    pub config: &'a serde_json::Value,
    pub config_path: &'a Path,
    pub scope: Scope<'a>,
}

type Constructor = fn(&LoadContext) -> Result<Box<dyn LanguageModel>>;

/// `model_type` → constructor.
pub const REGISTRY: &[(&str, Constructor)] = &[("llama", llama::load), ("qwen2", qwen2::load), ("qwen3", qwen3::load)];

/// Model types served by another architecture's code.
pub const ALIASES: &[(&str, &str)] = &[("mistral", "llama"), ("smollm", "llama"), ("smollm2", "llama")];

pub fn supported_model_types() -> Vec<&'static str> {
    REGISTRY.iter().map(|(name, _)| *name).chain(ALIASES.iter().map(|(alias, _)| *alias)).collect()
}

pub fn constructor(model_type: &str, config_path: &Path) -> Result<Constructor> {
    let canonical = ALIASES.iter().find(|(alias, _)| *alias == model_type).map_or(model_type, |(_, name)| name);
    REGISTRY.iter().find(|(name, _)| *name == canonical).map(|(_, c)| *c).ok_or_else(|| Error::UnknownArchitecture {
        path: config_path.into(),
        model_type: model_type.into(),
        supported: supported_model_types().join(", "),
    })
}
