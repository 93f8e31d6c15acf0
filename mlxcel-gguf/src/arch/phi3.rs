//! Phi-3: llama.cpp's `phi3`. q, k and v in one `attn_qkv` and the gate and up projections
//! in one `ffn_up` (gate rows first), as Hugging Face's `qkv_proj` / `gate_up_proj`; Q and K
//! not permuted. A long-context model's `rope_factors_long` / `rope_factors_short` become a
//! `longrope` `rope_scaling` ([`super::longrope_scaling`]).

use serde_json::{Map, Value as Json};

use super::{ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "phi3",
    aliases: &[],
    gguf_name: "phi3",
    hf_class: "Phi3ForCausalLM",
    permuted_qk: false,
    block_module,
    bias_modules: &[],
    norm_shift: 0.0,
    config,
};

fn block_module(module: &str) -> Option<&'static str> {
    match module {
        "attn_qkv" => Some("self_attn.qkv_proj"),
        "ffn_up" => Some("mlp.gate_up_proj"),
        _ => None,
    }
}

fn config(gguf: &GgufFile, hp: &HParams, c: &mut Map<String, Json>) {
    let key = |k: &str| format!("{}.{k}", hp.name);
    c.insert("hidden_act".into(), "silu".into());
    let rope_dims = gguf.get_u64(&key("rope.dimension_count")).unwrap_or(hp.head_dim);
    if rope_dims != hp.head_dim {
        c.insert("partial_rotary_factor".into(), super::f32_json(rope_dims as f64 / hp.head_dim as f64));
    }
    if let Some(original) = gguf.get_u64(&key("rope.scaling.original_context_length")) {
        c.insert("original_max_position_embeddings".into(), original.into());
    }
}
