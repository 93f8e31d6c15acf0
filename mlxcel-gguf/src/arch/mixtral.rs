//! Mixtral: llama.cpp stores it as `llama` with stacked experts (`ffn_{gate,up,down}_exps`,
//! router `ffn_gate_inp`, `llama.expert_count`); [`super::Architecture::from_gguf`] picks
//! this architecture for a `llama` file with experts.

use serde_json::{Map, Value as Json};

use super::{expert_config, ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "mixtral",
    aliases: &[],
    gguf_name: "llama",
    hf_class: "MixtralForCausalLM",
    permuted_qk: true,
    block_module,
    bias_modules: &[],
    norm_shift: 0.0,
    config,
};

fn block_module(module: &str) -> Option<&'static str> {
    match module {
        "ffn_gate_inp" => Some("block_sparse_moe.gate"),
        "ffn_gate_exps" => Some("block_sparse_moe.switch_mlp.gate_proj"),
        "ffn_up_exps" => Some("block_sparse_moe.switch_mlp.up_proj"),
        "ffn_down_exps" => Some("block_sparse_moe.switch_mlp.down_proj"),
        _ => None,
    }
}

fn config(gguf: &GgufFile, hp: &HParams, c: &mut Map<String, Json>) {
    c.insert("hidden_act".into(), "silu".into());
    let (experts, used, expert_ffn) = expert_config(gguf, hp);
    c.insert("num_local_experts".into(), experts.into());
    c.insert("num_experts_per_tok".into(), used.into());
    c.insert("intermediate_size".into(), expert_ffn.into());
}
