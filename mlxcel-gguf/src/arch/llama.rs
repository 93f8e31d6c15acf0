//! Llama (also Mistral and the SmolLM family): llama.cpp's `llama`.

use serde_json::{Map, Value as Json};

use super::{has_tensor, ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "llama",
    aliases: &["mistral", "smollm", "smollm2"],
    gguf_name: "llama",
    hf_class: "LlamaForCausalLM",
    permuted_qk: true,
    block_module: |_| None,
    // `attention_bias`; `mlp_bias` is written false, so no FFN biases.
    bias_modules: &["attn_q", "attn_k", "attn_v", "attn_output"],
    norm_shift: 0.0,
    config,
};

fn config(gguf: &GgufFile, _: &HParams, c: &mut Map<String, Json>) {
    c.insert("hidden_act".into(), "silu".into());
    c.insert("attention_bias".into(), has_tensor(gguf, "attn_q.bias").into());
    c.insert("mlp_bias".into(), false.into());
}
