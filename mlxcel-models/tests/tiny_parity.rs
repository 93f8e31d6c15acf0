//! Every architecture on tiny random weights against mlx-lm's goldens
//! (tests/reference/make_tiny_goldens.py): full-sequence logits within a
//! tolerance, greedy decoding over the KV cache token for token, and (f32
//! goldens) the prompt plus the greedy tokens in one 27-row pass against the
//! reference's per-step log-probabilities.
//!
//! Quantized checkpoints run mlxcel's kernels. Their exact paths (f32
//! unpacking, `MLXCEL_KERNELS=avx512|avx2|portable`) keep the f32 tolerance
//! of 1e-4 of the largest |logit|. The integer paths, the default on x86-64
//! (AVX-512 VNNI, else AVX2), quantize activations to 16 bits (at most
//! max|x| / 65024 per activation of a group, see `mlx_sys::kernels`), which
//! on these random weights moves logits by up to ~1.1e-4 of the largest:
//! they get 5e-4. `quantized_models_on_the_other_kernel_paths` reruns the
//! quantized models with `MLXCEL_KERNELS=avx512` (exact, 1e-4) and
//! `avx2-int8` (read once per process), so every machine checks an exact
//! and an integer path, and AVX-512 machines the AVX2 one too; and with
//! `MLXCEL_FUSED=0`, so that the 27-row pass, which the fused decoder block
//! takes (up to 32 rows), runs the prefill GEMMs instead.

use std::path::{Path, PathBuf};

use mlx_sys::kernels::{self, KernelPath};
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
    let rel_tol = if info.groups.iter().any(|g| g.quantization.is_some()) && integer_path() {
        rel_tol.max(5e-4)
    } else {
        rel_tol
    };
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
    println!("{name}: max |logit diff| {worst:.2e} = {:.2e} of max |logit| (allowed {rel_tol:.0e})", worst / scale);

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

    // The prompt and the greedy tokens in one pass of 27 rows, which runs the
    // kernels of a multi-row pass (the fused block where it applies, else the
    // GEMMs, from 16 rows on): its log-softmax at each
    // decoded position against the reference's from the cached steps (which
    // half-precision goldens computed in their own dtype: not compared).
    if golden.get("logits_upcast_f32").is_some() {
        return;
    }
    let sequence: Vec<i32> = input.iter().chain(&want[..want.len() - 1]).copied().collect();
    let tokens = Array::from_slice(&sequence, &[1, sequence.len() as i32]).unwrap();
    let logits = model.forward(&tokens, &mut model.new_caches()).unwrap();
    let steps = logits.slice_axis(1, input.len() as i32 - 1, sequence.len() as i32).unwrap();
    let logprobs = steps.subtract(&steps.logsumexp(&[-1], true).unwrap()).unwrap();
    let actual = logprobs.astype(mlx_sys::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let expected = flat(&golden["greedy"]["step_logprobs"]);
    let worst = actual.iter().zip(&expected).map(|(a, e)| (a - e).abs()).fold(0f32, f32::max);
    assert!(worst <= rel_tol * scale, "{name}: one-pass log-probs differ by {worst} > {rel_tol} × {scale}");
    println!("{name}: one pass of {} rows: max |log-prob diff| {:.2e} of max |logit|", sequence.len(), worst / scale);
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
// YaRN: the attention factor on q and k, the ramped periods; the 4-bit one
// through the fused block.
#[test]
fn llama_rope_yarn() {
    check("llama_rope_yarn", 1e-4);
}
#[test]
fn llama_rope_yarn_q4() {
    check("llama_rope_yarn_q4", 1e-4);
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
// Gemma 3: sliding-window (5 positions) and global layers, local and global
// RoPE bases, pre- and post-norms with 1 + weight gains, q/k norms, the query
// scale, GELU (tanh), the embedding scale; tied and 4-bit in the second.
#[test]
fn gemma3_text() {
    check("gemma3_text", 1e-4);
}
#[test]
fn gemma3_text_tied_q4_g32() {
    check("gemma3_text_tied_q4_g32", 1e-4);
}
// Gemma 2: soft-capped attention scores (explicit scores path) and logits,
// Gemma's norms, query scale and embedding scale, always tied; the 4-bit one
// with the quantized embeddings as the head. mlx-lm applies no sliding window.
#[test]
fn gemma2() {
    check("gemma2", 1e-4);
}
#[test]
fn gemma2_q4_g32() {
    check("gemma2_q4_g32", 1e-4);
}
// OLMo 2: post-norm blocks, q/k norms over the whole projection.
#[test]
fn olmo2() {
    check("olmo2", 1e-4);
}
#[test]
fn olmo2_q4_g32() {
    check("olmo2_q4_g32", 1e-4);
}
// Phi-3: fused qkv_proj and gate_up_proj split at load (the 4-bit one through
// the fused block); su RoPE scaling with its long factors and attention factor.
#[test]
fn phi3() {
    check("phi3", 1e-4);
}
#[test]
fn phi3_su() {
    check("phi3_su", 1e-4);
}
#[test]
fn phi3_q4_g32() {
    check("phi3_q4_g32", 1e-4);
    // The quantized parts of the fused projections run the fused decoder
    // block (on the CPU, unless MLXCEL_FUSED=0 turns it off).
    if mlxcel_models::runtime::current().fused_decode_active() {
        let (model, _) = load_network(&tiny_dir().join("phi3_q4_g32")).unwrap();
        assert!(model.chunking_invariant_prefill(), "phi3_q4_g32: layers not on the fused block");
    }
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

// Mixtures of experts (4 experts, top 2): the 12-token prompt's rows pick
// different experts and run grouped by expert; decode runs one row per step.
#[test]
fn mixtral() {
    check("mixtral", 1e-4);
}
#[test]
fn mixtral_q4_g32() {
    check("mixtral_q4_g32", 1e-4);
}
#[test]
fn qwen3_moe() {
    check("qwen3_moe", 1e-4);
}
#[test]
fn qwen3_moe_q4_g32() {
    check("qwen3_moe_q4_g32", 1e-4);
}

/// Hugging Face's per-expert layout (`experts.<e>.w1/w3/w2`, what mlx-lm's
/// sanitize stacks) gives the stacked checkpoint's logits exactly.
#[test]
fn mixtral_per_expert_layout() {
    let src = tiny_dir().join("mixtral");
    let dir = std::env::temp_dir().join(format!("mlxcel-mixtral-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let stacked = mlx_sys::io::load_safetensors(&src.join("model.safetensors")).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for (name, array) in stacked.arrays.iter() {
        let Some((prefix, rest)) = name.split_once("switch_mlp.") else {
            out.insert(name.clone(), array.clone());
            continue;
        };
        let (proj, param) = rest.split_once('.').unwrap();
        let hf = match proj {
            "gate_proj" => "w1",
            "up_proj" => "w3",
            "down_proj" => "w2",
            other => panic!("{other}"),
        };
        for e in 0..array.dim(0) {
            let mut shape = array.shape();
            shape.remove(0);
            let slice = array.slice_axis(0, e, e + 1).unwrap().reshape(&shape).unwrap();
            out.insert(format!("{prefix}experts.{e}.{hf}.{param}"), slice);
        }
    }
    assert!(out.keys().any(|k| k.ends_with("experts.3.w2.weight")));
    mlx_sys::io::save_safetensors(&dir.join("model.safetensors"), &out, &Default::default()).unwrap();
    let input = ids(&golden("mixtral")["input_ids"]);
    let tokens = Array::from_slice(&input, &[1, input.len() as i32]).unwrap();
    let logits = |dir: &Path| {
        let (model, _) = load_network(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        model.forward(&tokens, &mut model.new_caches()).unwrap().to_vec::<f32>().unwrap()
    };
    let (a, b) = (logits(&src), logits(&dir));
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(a, b);
}

/// Whether this process's quantized matvec quantizes activations.
fn integer_path() -> bool {
    matches!(kernels::path_name(KernelPath::Auto).as_str(), "avx512-vnni" | "avx2-int8" | "neon-int8")
}

#[test]
fn quantized_models_on_the_other_kernel_paths() {
    if std::env::var_os("MLXCEL_TINY_PARITY_CHILD").is_some() {
        return;
    }
    let auto = kernels::path_name(KernelPath::Auto);
    for (var, value) in [("MLXCEL_KERNELS", "avx512"), ("MLXCEL_KERNELS", "avx2-int8"), ("MLXCEL_FUSED", "0")] {
        // A path this CPU lacks falls back to one the parent already runs.
        if var == "MLXCEL_KERNELS" && (auto == "portable" || (value == "avx2-int8" && auto == "avx2-int8")) {
            continue;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--test-threads=1",
                "--nocapture",
                "llama_q4",
                "qwen3_q8",
                "llama_q3",
                "gemma3_text_tied_q4",
                "llama_rope_yarn_q4",
                "gemma2_q4",
                "olmo2_q4",
                "phi3_q4",
                "mixtral_q4",
                "qwen3_moe_q4",
            ])
            .env(var, value)
            .env("MLXCEL_TINY_PARITY_CHILD", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let path = format!("{var}={value}");
        assert!(out.status.success(), "{path}:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("12 passed"), "{path}: expected the 12 quantized models to run:\n{stdout}");
    }
}
