//! Shared helpers for the end-to-end tests.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use mlxcel_engine::Engine;
use mlxcel_models::Model;

/// The default model's checkpoint, fetched and converted on first use.
pub fn default_model_dir() -> PathBuf {
    mlxcel_hub::default_model_dir().expect("the default model could not be prepared")
}

/// One engine over the default model, shared by every test in a binary.
pub fn default_engine() -> Engine {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    let model = MODEL.get_or_init(|| Arc::new(Model::load(&default_model_dir()).expect("load the default model")));
    Engine::new(model.clone())
}

pub fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}
