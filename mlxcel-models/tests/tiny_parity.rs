//! Every architecture on tiny random weights against mlx-lm's goldens
//! (tests/reference/make_tiny_goldens.py): full-sequence logits within a
//! tolerance, and greedy decoding over the KV cache token for token.

use std::path::{Path, PathBuf};

use mlx_sys::Array;
use mlxcel_models::model::load_network;
use serde_json::Value;

fn tiny_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny")
}

fn golden(name: &str) -> Value {
    let text = std::fs::read_to_string(tiny_dir().join(name).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<i32> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32).collect()
}

fn flat(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32)).collect()
}

/// Checks one tiny model. `rel_tol` is relative to the largest |logit|.
fn check(name: &str, rel_tol: f32) {
    let golden = golden(name);
    let (model, info) = load_network(&tiny_dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(info.model_type, golden["model_type"].as_str().unwrap());
    let input = ids(&golden["input_ids"]);
    let tokens = Array::from_slice(&input, &[1, input.len() as i32]).unwrap();

    // Our compute dtype is float32, so half-precision checkpoints compare
    // against the reference's float32 run on the same weights.
    let expected = flat(golden.get("logits_upcast_f32").unwrap_or(&golden["logits"]));
    let mut caches = model.new_caches();
    let logits = model.forward(&tokens, &mut caches).unwrap();
    assert_eq!(logits.shape(), [1, input.len() as i32, 512]);
    let actual = logits.astype(mlx_sys::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = actual.iter().zip(&expected).map(|(a, e)| (a - e).abs()).fold(0f32, f32::max);
    assert!(worst <= rel_tol * scale, "{name}: max |logit diff| {worst} > {rel_tol} × {scale}");

    // Greedy decoding over the cache, one token at a time.
    let want = ids(&golden["greedy"]["tokens"]);
    let mut next = logits.slice_axis(1, input.len() as i32 - 1, input.len() as i32).unwrap().argmax(-1, false).unwrap();
    let mut got = Vec::new();
    for _ in 0..want.len() {
        let token = next.astype(mlx_sys::Dtype::Int32).unwrap().item::<i32>().unwrap();
        got.push(token);
        let step = Array::from_slice(&[token], &[1, 1]).unwrap();
        next = model.forward(&step, &mut caches).unwrap().argmax(-1, false).unwrap();
    }
    assert_eq!(got, want, "{name}: greedy tokens");
    assert_eq!(caches[0].offset(), input.len() + want.len());
}

// f32: the reference's own rerun and OpenBLAS-vs-reference-BLAS differences
// are below 1e-5 absolute on logits of magnitude ~10 (tests/reference/README.md);
// 1e-4 relative leaves room for a different summation order.
#[test]
fn llama() {
    check("llama", 1e-4);
}
#[test]
fn llama_tied() {
    check("llama_tied", 1e-4);
}
#[test]
fn llama_rope_llama3() {
    check("llama_rope_llama3", 1e-4);
}
#[test]
fn llama_rope_linear() {
    check("llama_rope_linear", 1e-4);
}
#[test]
fn mistral() {
    check("mistral", 1e-4);
}
#[test]
fn qwen2() {
    check("qwen2", 1e-4);
}
#[test]
fn qwen3() {
    check("qwen3", 1e-4);
}
#[test]
fn llama_bf16_weights() {
    check("llama_bf16", 1e-4);
}
#[test]
fn llama_f16_weights() {
    check("llama_f16", 1e-4);
}
#[test]
fn llama_q4_g32() {
    check("llama_q4_g32", 1e-4);
}
#[test]
fn qwen3_q8_g64() {
    check("qwen3_q8_g64", 1e-4);
}
#[test]
fn llama_q3_g128() {
    check("llama_q3_g128", 1e-4);
}
#[test]
fn llama_q4_mixed_overrides() {
    check("llama_q4_mixed", 1e-4);
}
#[test]
fn llama_q4_mixed_with_false_override() {
    check("llama_q4_mixed_false", 1e-4);
}
