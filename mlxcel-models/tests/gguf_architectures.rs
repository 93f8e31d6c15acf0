//! Every architecture the GGUF converter accepts loads and runs: a tiny GGUF of each
//! `mlxcel_gguf::Architecture` (and a llama with linear RoPE scaling) is converted, loaded
//! with its rebuilt tokenizer, and a forward pass gives finite logits of the right shape,
//! with the KV cache agreeing with the full-sequence pass on the last position (Phi-3's
//! LongRoPE factors too). Llama 3's `rope_freqs` reach the model; Qwen3 attention biases are
//! refused.

#[path = "../../mlxcel-gguf/tests/gguf_common/mod.rs"]
mod gguf_common;

use gguf_common::*;
use mlx_sys::{Array, Dtype};
use mlxcel_gguf::{convert_gguf, Architecture, ConvertOptions, Value};
use mlxcel_models::Model;

fn logits(model: &Model, tokens: &[i32], caches: &mut [Box<dyn mlxcel_models::KvCache>]) -> (Vec<i32>, Vec<f32>) {
    let input = Array::from_slice(tokens, &[1, tokens.len() as i32]).unwrap();
    let out = model.network().forward(&input, caches).unwrap();
    (out.shape(), out.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap())
}

fn convert_load_and_run(tmp: &TempDir, name: &str, gguf: &GgufBuilder, expected_type: &str) {
    let path = tmp.0.join(format!("{name}.gguf"));
    std::fs::write(&path, gguf.build().0).unwrap();
    let out = tmp.0.join(name);
    let report = convert_gguf(&path, &out, &ConvertOptions::default()).unwrap_or_else(|e| panic!("{name}: convert: {e}"));
    assert_eq!(report.model_type, expected_type);
    let model = Model::load(&out).unwrap_or_else(|e| panic!("{name}: load: {e}"));
    assert_eq!(model.info().model_type, expected_type);

    let vocab = vocab().len();
    let prompt = model.tokenizer().encode("ab ab", false).unwrap();
    let prompt: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    assert!(prompt.len() >= 2, "{name}: prompt {prompt:?}");
    let (shape, full) = logits(&model, &prompt, &mut model.network().new_caches());
    assert_eq!(shape, [1, prompt.len() as i32, vocab as i32], "{name}");
    assert!(full.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
    assert!(full.iter().any(|&v| v != 0.0), "{name}: all-zero logits");

    // The same last position through the cache, one token at a time.
    let mut caches = model.network().new_caches();
    logits(&model, &prompt[..prompt.len() - 1], &mut caches);
    let (shape, step) = logits(&model, &prompt[prompt.len() - 1..], &mut caches);
    assert_eq!(shape, [1, 1, vocab as i32], "{name}");
    let last = &full[(prompt.len() - 1) * vocab..];
    let scale = last.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = last.iter().zip(&step).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-3 * scale, "{name}: cached vs full logits differ by {worst} (scale {scale})");
}

#[test]
fn every_convertible_architecture_loads_and_runs() {
    let tmp = TempDir::new("load-every-arch");
    for arch in Architecture::ALL {
        let gguf = match arch {
            // llama.cpp's Mixtral is a `llama` file with experts.
            Architecture::Mixtral | Architecture::Qwen3Moe => tiny_moe(&mut Rng(11), arch.gguf_name()),
            _ => tiny_model(&mut Rng(11), arch.gguf_name()),
        };
        convert_load_and_run(&tmp, arch.model_type(), &gguf, arch.model_type());
    }
    let mut scaled = tiny_model(&mut Rng(12), "llama");
    scaled
        .meta("llama.rope.scaling.type", s("linear"))
        .meta("llama.rope.scaling.factor", Value::F32(2.0));
    convert_load_and_run(&tmp, "llama_rope_linear", &scaled, "llama");
    let mut yarn = tiny_model(&mut Rng(15), "qwen2");
    yarn.meta("qwen2.rope.scaling.type", s("yarn"))
        .meta("qwen2.rope.scaling.factor", Value::F32(4.0))
        .meta("qwen2.rope.scaling.original_context_length", Value::U32(128));
    convert_load_and_run(&tmp, "qwen2_rope_yarn", &yarn, "qwen2");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.0.join("qwen2_rope_yarn/config.json")).unwrap()).unwrap();
    assert_eq!(config["rope_scaling"], serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}));
    convert_load_and_run(&tmp, "llama3_rope_freqs", &tiny_llama3(&mut Rng(13), 32.0), "llama");
    convert_load_and_run(&tmp, "phi3_longrope", &tiny_phi3_longrope(&mut Rng(16), None), "phi3");
}

fn convert_and_load(tmp: &TempDir, name: &str, gguf: &GgufBuilder) -> Model {
    let path = tmp.0.join(format!("{name}.gguf"));
    std::fs::write(&path, gguf.build().0).unwrap();
    convert_gguf(&path, &tmp.0.join(name), &ConvertOptions::default()).unwrap_or_else(|e| panic!("{name}: convert: {e}"));
    Model::load(&tmp.0.join(name)).unwrap_or_else(|e| panic!("{name}: load: {e}"))
}

/// Llama 3's `rope_freqs.weight` reaches the loaded model: the same weights without it give
/// other logits (the scaled pairs turn `factor` times slower).
#[test]
fn llama3_rope_freqs_change_the_logits() {
    let tmp = TempDir::new("load-llama3");
    let llama3 = tiny_llama3(&mut Rng(14), 32.0);
    let mut plain = tiny_llama3(&mut Rng(14), 32.0);
    plain.tensors.retain(|t| t.0 != "rope_freqs.weight");
    let tokens: Vec<i32> = (0..64).map(|i| (i * 37 % 256) as i32).collect();
    let run = |model: &Model| logits(model, &tokens, &mut model.network().new_caches()).1;
    let (scaled, unscaled) = (run(&convert_and_load(&tmp, "llama3", &llama3)), run(&convert_and_load(&tmp, "plain", &plain)));
    let last = |v: &[f32]| v[v.len() - vocab().len()..].to_vec();
    let (scaled, unscaled) = (last(&scaled), last(&unscaled));
    let scale = unscaled.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = scaled.iter().zip(&unscaled).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(diff > 1e-3 * scale, "llama3 scaling had no effect: {diff} (scale {scale})");
}

/// mlx-lm's qwen3 has no attention biases: a config asking for them is refused, not ignored.
#[test]
fn qwen3_attention_bias_is_refused() {
    let tmp = TempDir::new("load-qwen3-bias");
    convert_and_load(&tmp, "qwen3", &tiny_model(&mut Rng(15), "qwen3"));
    let config_path = tmp.0.join("qwen3/config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    assert_eq!(config["attention_bias"], false);
    config["attention_bias"] = true.into();
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let msg = Model::load(&tmp.0.join("qwen3")).err().expect("attention_bias: true loads").to_string();
    assert!(msg.contains("config.json") && msg.contains("attention_bias"), "{msg}");
}
