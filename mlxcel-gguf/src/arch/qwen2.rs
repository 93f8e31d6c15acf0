//! Qwen2: llama with biases on the q, k and v projections, no Q/K permutation in GGUF.

use serde_json::{Map, Value as Json};

use super::{ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "qwen2",
    aliases: &[],
    gguf_name: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    permuted_qk: false,
    block_module: |_| None,
    bias_modules: &["attn_q", "attn_k", "attn_v"],
    norm_shift: 0.0,
    config,
};

fn config(_: &GgufFile, _: &HParams, c: &mut Map<String, Json>) {
    c.insert("hidden_act".into(), "silu".into());
}
