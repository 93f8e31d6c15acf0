//! Qwen3-MoE: Qwen3 attention, stacked experts (`ffn_{gate,up,down}_exps`, router
//! `ffn_gate_inp`); llama.cpp's `qwen3moe`.

use serde_json::{Map, Value as Json};

use super::{expert_config, ArchSpec, HParams};
use crate::reader::GgufFile;

pub(super) const SPEC: ArchSpec = ArchSpec {
    model_type: "qwen3_moe",
    aliases: &[],
    gguf_name: "qwen3moe",
    hf_class: "Qwen3MoeForCausalLM",
    permuted_qk: false,
    block_module,
    bias_modules: &[],
    norm_shift: 0.0,
    config,
};

fn block_module(module: &str) -> Option<&'static str> {
    match module {
        "attn_q_norm" => Some("self_attn.q_norm"),
        "attn_k_norm" => Some("self_attn.k_norm"),
        "ffn_gate_inp" => Some("mlp.gate"),
        "ffn_gate_exps" => Some("mlp.switch_mlp.gate_proj"),
        "ffn_up_exps" => Some("mlp.switch_mlp.up_proj"),
        "ffn_down_exps" => Some("mlp.switch_mlp.down_proj"),
        _ => None,
    }
}

fn config(gguf: &GgufFile, hp: &HParams, c: &mut Map<String, Json>) {
    c.insert("hidden_act".into(), "silu".into());
    c.insert("attention_bias".into(), false.into());
    let (experts, used, expert_ffn) = expert_config(gguf, hp);
    c.insert("num_experts".into(), experts.into());
    c.insert("num_experts_per_tok".into(), used.into());
    c.insert("moe_intermediate_size".into(), expert_ffn.into());
    // llama.cpp's qwen3moe renormalizes the top-k weights and has every layer sparse.
    c.insert("norm_topk_prob".into(), true.into());
    c.insert("decoder_sparse_step".into(), 1.into());
    c.insert("mlp_only_layers".into(), Json::Array(vec![]));
}
