//! `LanguageModel::layout`, what `mlxcel inspect` prints: each family's
//! blocks described from what was loaded, on the tiny random checkpoints.

use std::path::Path;

use mlxcel_models::model::load_network;
use mlxcel_models::ModelLayout;

fn layout(name: &str) -> ModelLayout {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny").join(name);
    load_network(&dir).unwrap_or_else(|e| panic!("{name}: {e}")).0.layout()
}

#[test]
fn each_family_describes_its_blocks() {
    let llama = layout("llama");
    assert_eq!(llama.grouped(), [("0-1".to_string(), "pre-norm: attention 4 heads × 16 (2 KV heads) → SwiGLU MLP 128")]);
    assert_eq!(llama.head, "lm_head");
    assert_eq!(layout("llama_tied").head, "tied embeddings");
    assert!(layout("llama_q4_g32").layers[0].ends_with("[one fused kernel node at decode]"));
    assert!(layout("qwen2").layers[0].contains("q/k/v biases"));
    assert!(layout("qwen3").layers[0].contains("q/k norms per head"));
    let olmo2 = layout("olmo2");
    assert!(olmo2.layers[0].starts_with("post-norm") && olmo2.layers[0].contains("q/k norms over the projection"), "{olmo2:?}");
    assert!(layout("phi3").layers[0].contains("fused qkv_proj (split at load)"));
    let gemma2 = layout("gemma2");
    assert!(gemma2.layers[0].starts_with("pre- and post-norms (1 + w gains)") && gemma2.layers[0].contains("score soft-cap"), "{gemma2:?}");
    assert!(gemma2.layers[0].contains("GeGLU (tanh) MLP"));
    assert!(gemma2.head.starts_with("embeddings × 8.00; tied embeddings, logit soft-cap"), "{}", gemma2.head);
    // Mixture of experts: the experts and routing; qwen3_moe's dense layer apart.
    let mixtral = layout("mixtral");
    assert!(mixtral.layers[0].contains("MoE: 4 experts, top 2 (softmax over the top k), each a SwiGLU MLP 64"), "{mixtral:?}");
    let qwen3_moe = layout("qwen3_moe_q4_g32");
    let qwen3_moe = qwen3_moe.grouped();
    assert_eq!(qwen3_moe.len(), 2, "{qwen3_moe:?}");
    assert!(qwen3_moe[0].0 == "0, 2" && qwen3_moe[0].1.contains("top k of the softmax, renormalized") && qwen3_moe[0].1.ends_with("[one fused kernel node at decode]"));
    assert!(qwen3_moe[1].0 == "1" && !qwen3_moe[1].1.contains("MoE"));
    // Gemma 3: sliding layers grouped apart from the global ones.
    let gemma3 = layout("gemma3_text");
    let groups = gemma3.grouped();
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert!(groups.iter().any(|(_, line)| line.contains("sliding window")) && groups.iter().any(|(_, line)| !line.contains("sliding window")));
}

#[test]
fn grouped_layers_are_written_as_ranges() {
    let layout = ModelLayout { layers: ["a", "a", "b", "a", "a", "a", "b", "c"].map(String::from).to_vec(), head: String::new() };
    assert_eq!(layout.grouped(), [("0-1, 3-5".to_string(), "a"), ("2, 6".to_string(), "b"), ("7".to_string(), "c")]);
}
