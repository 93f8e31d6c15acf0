//! OLMo 2: llama.cpp's `olmo2`. Post-norm blocks (`post_attention_norm`, `post_ffw_norm`,
//! no input norms), q and k normed over the whole projection; Q and K not permuted.

use serde_json::{Map, Value as Json};

use super::{ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "olmo2",
    aliases: &[],
    gguf_name: "olmo2",
    hf_class: "Olmo2ForCausalLM",
    permuted_qk: false,
    block_module,
    // llama.cpp's olmo2 reads no biases.
    bias_modules: &[],
    norm_shift: 0.0,
    config,
};

fn block_module(module: &str) -> Option<&'static str> {
    match module {
        "post_attention_norm" => Some("post_attention_layernorm"),
        "post_ffw_norm" => Some("post_feedforward_layernorm"),
        _ => super::qk_norm_module(module),
    }
}

fn config(_: &GgufFile, _: &HParams, c: &mut Map<String, Json>) {
    c.insert("hidden_act".into(), "silu".into());
    c.insert("attention_bias".into(), false.into());
    c.insert("mlp_bias".into(), false.into());
}
