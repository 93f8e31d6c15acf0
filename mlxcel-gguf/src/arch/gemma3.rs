//! Gemma 3 (text): llama.cpp's `gemma3`, written as Hugging Face's `gemma3_text`.
//!
//! llama.cpp stores every norm gain with Gemma's `+ 1` folded in (the converter takes it
//! out again, [`ArchSpec::norm_shift`]), does not permute Q and K, and keeps the local RoPE
//! base (10,000) and the layer pattern (every sixth layer global) in code, not metadata.

use serde_json::{Map, Value as Json};

use super::{query_pre_attn_scalar, ArchSpec, HParams};
use crate::reader::GgufFile;

/// Every `SLIDING_WINDOW_PATTERN`-th layer attends globally (llama.cpp's `set_swa_pattern(6)`).
const SLIDING_WINDOW_PATTERN: u64 = 6;
/// The RoPE base of the sliding-window layers (llama.cpp's `rope_freq_base_train_swa`).
const ROPE_LOCAL_BASE_FREQ: f64 = 10_000.0;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "gemma3_text",
    // The multimodal checkpoints' text model (`text_config`, `language_model.` weights).
    aliases: &["gemma3"],
    gguf_name: "gemma3",
    hf_class: "Gemma3ForCausalLM",
    permuted_qk: false,
    block_module,
    bias_modules: &[],
    norm_shift: 1.0,
    config,
};

fn block_module(module: &str) -> Option<&'static str> {
    super::qk_norm_module(module).or_else(|| super::gemma_block_module(module))
}

fn config(gguf: &GgufFile, hp: &HParams, c: &mut Map<String, Json>) {
    let key = |k: &str| format!("{}.{k}", hp.name);
    c.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
    // Gemma 3's query scale is head_dim ^ -0.5 in every size llama.cpp converts.
    c.insert("query_pre_attn_scalar".into(), query_pre_attn_scalar(gguf, hp, hp.head_dim));
    if let Some(window) = gguf.get_u64(&key("attention.sliding_window")) {
        c.insert("sliding_window".into(), window.into());
    }
    c.insert("sliding_window_pattern".into(), SLIDING_WINDOW_PATTERN.into());
    c.insert("rope_local_base_freq".into(), super::f32_json(ROPE_LOCAL_BASE_FREQ));
    c.insert("final_logit_softcapping".into(), Json::Null);
    c.insert("attn_logit_softcapping".into(), Json::Null);
}
