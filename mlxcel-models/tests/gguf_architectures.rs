//! Every architecture the GGUF converter accepts loads and runs: a tiny GGUF of each
//! `mlxcel_gguf::Architecture` (and a llama with linear RoPE scaling) is converted, loaded
//! with its rebuilt tokenizer, and a forward pass gives finite logits of the right shape,
//! with the KV cache agreeing with the full-sequence pass on the last position.

#[path = "../../mlxcel-gguf/tests/gguf_common/mod.rs"]
mod gguf_common;

use gguf_common::*;
use mlx_sys::{Array, Dtype};
use mlxcel_gguf::{convert_gguf, Architecture, ConvertOptions, Value};
use mlxcel_models::Model;

fn logits(model: &Model, tokens: &[i32], caches: &mut [Box<dyn mlxcel_models::KvCache>]) -> (Vec<i32>, Vec<f32>) {
    let input = Array::from_slice(tokens, &[1, tokens.len() as i32]).unwrap();
    let out = model.network.forward(&input, caches).unwrap();
    (out.shape(), out.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap())
}

fn convert_load_and_run(tmp: &TempDir, name: &str, gguf: &GgufBuilder, expected_type: &str) {
    let path = tmp.0.join(format!("{name}.gguf"));
    std::fs::write(&path, gguf.build().0).unwrap();
    let out = tmp.0.join(name);
    let report = convert_gguf(&path, &out, &ConvertOptions::default()).unwrap_or_else(|e| panic!("{name}: convert: {e}"));
    assert_eq!(report.model_type, expected_type);
    let model = Model::load(&out).unwrap_or_else(|e| panic!("{name}: load: {e}"));
    assert_eq!(model.info.model_type, expected_type);

    let vocab = vocab().len();
    let prompt = model.tokenizer.encode("ab ab", false).unwrap();
    let prompt: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    assert!(prompt.len() >= 2, "{name}: prompt {prompt:?}");
    let (shape, full) = logits(&model, &prompt, &mut model.network.new_caches());
    assert_eq!(shape, [1, prompt.len() as i32, vocab as i32], "{name}");
    assert!(full.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
    assert!(full.iter().any(|&v| v != 0.0), "{name}: all-zero logits");

    // The same last position through the cache, one token at a time.
    let mut caches = model.network.new_caches();
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
        let gguf = tiny_model(&mut Rng(11), arch.gguf_name());
        convert_load_and_run(&tmp, arch.gguf_name(), &gguf, arch.model_type());
    }
    let mut scaled = tiny_model(&mut Rng(12), "llama");
    scaled
        .meta("llama.rope.scaling.type", s("linear"))
        .meta("llama.rope.scaling.factor", Value::F32(2.0));
    convert_load_and_run(&tmp, "llama_rope_linear", &scaled, "llama");
}
