//! Qwen3: llama with a per-head RMSNorm on queries and keys, no Q/K permutation in GGUF.

use serde_json::{Map, Value as Json};

use super::{ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "qwen3",
    aliases: &[],
    gguf_name: "qwen3",
    hf_class: "Qwen3ForCausalLM",
    permuted_qk: false,
    block_module: super::qk_norm_module,
    // Qwen3 has no attention biases (mlx-lm's qwen3 and llama.cpp's read none).
    bias_modules: &[],
    norm_shift: 0.0,
    config,
};

fn config(_: &GgufFile, _: &HParams, c: &mut Map<String, Json>) {
    c.insert("hidden_act".into(), "silu".into());
    // Bias tensors are refused (`bias_modules`), so there are none.
    c.insert("attention_bias".into(), false.into());
}
