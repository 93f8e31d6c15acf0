//! Gemma 2: llama.cpp's `gemma2`.
//!
//! llama.cpp stores every norm gain with Gemma's `+ 1` folded in (the converter takes it
//! out again, [`ArchSpec::norm_shift`]), does not permute Q and K, and keeps the soft-caps
//! in `gemma2.attn_logit_softcapping` / `gemma2.final_logit_softcapping` (its defaults, 50
//! and 30, when absent).

use serde_json::{Map, Value as Json};

use super::{query_pre_attn_scalar, ArchSpec, HParams};
use crate::reader::GgufFile;

/// llama.cpp's soft-caps when the metadata is silent (also Gemma 2's own).
const ATTN_LOGIT_SOFTCAPPING: f64 = 50.0;
const FINAL_LOGIT_SOFTCAPPING: f64 = 30.0;
/// Gemma 2 27B (llama.cpp tells it by its 46 layers) scales queries by
/// `(hidden / heads) ^ -0.5` rather than `head_dim ^ -0.5`.
const LAYERS_27B: u64 = 46;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "gemma2",
    aliases: &[],
    gguf_name: "gemma2",
    hf_class: "Gemma2ForCausalLM",
    permuted_qk: false,
    block_module: super::gemma_block_module,
    bias_modules: &[],
    norm_shift: 1.0,
    config,
};

fn config(gguf: &GgufFile, hp: &HParams, c: &mut Map<String, Json>) {
    let key = |k: &str| format!("{}.{k}", hp.name);
    c.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
    let per_head = if hp.num_layers == LAYERS_27B { hp.hidden_size / hp.num_heads } else { hp.head_dim };
    c.insert("query_pre_attn_scalar".into(), query_pre_attn_scalar(gguf, hp, per_head));
    if let Some(window) = gguf.get_u64(&key("attention.sliding_window")) {
        c.insert("sliding_window".into(), window.into());
    }
    for (name, default) in [
        ("attn_logit_softcapping", ATTN_LOGIT_SOFTCAPPING),
        ("final_logit_softcapping", FINAL_LOGIT_SOFTCAPPING),
    ] {
        let cap = gguf.get_f64(&key(name)).unwrap_or(default);
        c.insert(name.into(), super::f32_json(cap));
    }
}
