//! Quantizing dense checkpoints at load (`q_bits`): every tensor the model
//! ends up with is bit-identical to what `mlx_lm.convert -q` writes for the
//! same dense weights (tests/reference/goldens/quantize_on_load.json, from
//! tests/reference/make_quantize_on_load_goldens.py), on a MiniLM-size llama
//! and on SmolLM2-135M dequantized from the default model; and a model
//! quantized at load computes the same logits as its converted copy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_sys::{Array, Dtype};
use mlxcel_models::model::{load_network, load_network_quantizing, load_tensors_quantizing, read_config};
use mlxcel_models::quantization::QuantizationConfig;
use mlxcel_models::{Model, QuantParams};
use mlxcel_tests::{default_model_dir, repo_root};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn goldens() -> Value {
    let text = std::fs::read_to_string(repo_root().join("tests/reference/goldens/quantize_on_load.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn digest(a: &Array) -> String {
    let hex: String = Sha256::digest(a.to_bytes().unwrap()).iter().map(|b| format!("{b:02x}")).collect();
    hex[..16].to_string()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlxcel-qload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_checkpoint(dir: &Path, config: &Value, tensors: &BTreeMap<String, Array>) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    let metadata = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    mlx_sys::io::save_safetensors(&dir.join("model.safetensors"), tensors, &metadata).unwrap();
}

/// make_quantize_on_load_goldens.py's `pattern`: n multiples of 2**-15 in [-1/16, 1/16).
fn pattern(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut h = i.wrapping_mul(2654435761).wrapping_add(seed * 40503 + 12345) & 0xFFFF_FFFF;
            h ^= h >> 13;
            h = (h * 0x5BD1_E995) & 0xFFFF_FFFF;
            h ^= h >> 15;
            ((h >> 20) as i64 - 2048) as f32 / 32768.0
        })
        .collect()
}

/// The MiniLM-size dense llama, from the shapes its config implies.
fn minilm_dense(config: &Value) -> BTreeMap<String, Array> {
    let n = |key: &str| config[key].as_i64().unwrap() as i32;
    let (h, i, v, hd) = (n("hidden_size"), n("intermediate_size"), n("vocab_size"), n("head_dim"));
    let (q, kv) = (n("num_attention_heads") * hd, n("num_key_value_heads") * hd);
    let mut shapes = BTreeMap::from([
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![v, h]),
    ]);
    for l in 0..n("num_hidden_layers") {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            shapes.insert(format!("{p}.{name}.weight"), shape);
        }
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(seed, (name, shape))| {
            let size = shape.iter().product::<i32>() as usize;
            let offset = if name.contains("norm") { 1.0 } else { 0.0 };
            let values: Vec<f32> = pattern(seed as u64, size).into_iter().map(|x| x + offset).collect();
            (name, Array::from_slice(&values, &shape).unwrap())
        })
        .collect()
}

/// The default model with every quantized module dequantized by MLX.
fn smollm2_dense() -> BTreeMap<String, Array> {
    let dir = default_model_dir();
    let (config, config_path) = read_config(&dir).unwrap();
    let quantization = QuantizationConfig::from_config(&config, &config_path).unwrap();
    let stored = mlx_sys::io::load_safetensors(&dir.join("model.safetensors")).unwrap().arrays;
    let mut dense = BTreeMap::new();
    for (name, array) in &stored {
        let module = name.rsplit_once('.').unwrap().0;
        let quantized = stored.contains_key(&format!("{module}.scales"));
        if quantized && (name.ends_with(".scales") || name.ends_with(".biases")) {
            continue;
        }
        let array = if quantized {
            let p = quantization.for_module(module).unwrap();
            let part = |s: &str| &stored[&format!("{module}.{s}")];
            mlx_sys::dequantize(array, part("scales"), part("biases"), p.group_size, p.bits).unwrap()
        } else {
            array.clone()
        };
        array.eval().unwrap();
        dense.insert(name.clone(), array);
    }
    dense
}

/// The dense checkpoint (its hashes checked against the ones the goldens
/// were made from), then each case: the tensors after quantizing at load
/// against the converted file's, name by name.
fn check_case(case: &str, dense: BTreeMap<String, Array>) -> PathBuf {
    let golden = &goldens()[case];
    let dir = temp_dir(case);
    write_checkpoint(&dir, &golden["config"], &dense);
    let got: BTreeMap<&str, String> = dense.iter().map(|(k, v)| (k.as_str(), digest(v))).collect();
    let want: BTreeMap<&str, String> =
        golden["dense"].as_object().unwrap().iter().map(|(k, v)| (k.as_str(), v.as_str().unwrap().to_string())).collect();
    assert_eq!(got, want, "{case}: the dense checkpoint differs from the one the goldens were made from");

    for (params, converted) in golden["converted"].as_object().unwrap() {
        let (bits, group_size) = params.split_once(',').unwrap();
        let params = QuantParams { bits: bits.parse().unwrap(), group_size: group_size.parse().unwrap() };
        let loaded = load_tensors_quantizing(&dir, params).unwrap();
        let want = converted["tensors"].as_object().unwrap();
        let names: Vec<&String> = loaded.keys().collect();
        assert_eq!(names, want.keys().collect::<Vec<_>>(), "{case} {params:?}: which tensors (so which modules are quantized)");
        for (name, array) in &loaded {
            let w = want[name].as_array().unwrap();
            let dtype = Dtype::from_name(w[0].as_str().unwrap()).unwrap();
            let shape: Vec<i32> = w[1].as_array().unwrap().iter().map(|d| d.as_i64().unwrap() as i32).collect();
            assert_eq!((array.dtype(), array.shape()), (dtype, shape), "{case} {params:?}: {name}");
            assert_eq!(digest(array), w[2].as_str().unwrap(), "{case} {params:?}: {name} is not bit-identical");
        }
        let quantized = loaded.keys().filter(|k| k.ends_with(".scales")).count();
        assert!(quantized > 0, "{case} {params:?}: nothing quantized");
    }
    dir
}

#[test]
fn minilm_size_llama_quantizes_bit_identically_to_mlx_lm_convert() {
    let config = goldens()["minilm"]["config"].clone();
    let dir = check_case("minilm", minilm_dense(&config));

    // The model quantized at load and its converted copy (the same tensors
    // with convert's quantization block) compute the same logits, bit for bit.
    let params = QuantParams { bits: 4, group_size: 64 };
    let converted = temp_dir("minilm-converted");
    let mut config = config;
    config["quantization"] = goldens()["minilm"]["converted"]["4,64"]["quantization"].clone();
    write_checkpoint(&converted, &config, &load_tensors_quantizing(&dir, params).unwrap());
    let (at_load, info) = load_network_quantizing(&dir, Some(params)).unwrap();
    let (ahead, ahead_info) = load_network(&converted).unwrap();
    assert_eq!(info.quantized_at_load, Some(params));
    assert_eq!(info.main_weight_bits(), 4);
    // The same modules quantized the same way (dense ones report their stored dtype).
    let groups = |i: &mlxcel_models::ModelInfo| -> Vec<_> {
        i.groups.iter().map(|g| (g.name.clone(), g.count, g.quantization, g.parameters)).collect()
    };
    assert_eq!(groups(&info), groups(&ahead_info));
    assert_eq!(info.parameters, ahead_info.parameters);
    let tokens = Array::from_slice(&[1i32, 17, 400, 3, 999, 42, 7, 7], &[1, 8]).unwrap();
    let logits = |net: &dyn mlxcel_models::LanguageModel| {
        let mut caches = net.new_caches();
        let prefill = net.forward(&tokens, &mut caches).unwrap();
        let step = net.forward_last(&Array::from_slice(&[5i32], &[1, 1]).unwrap(), &mut caches).unwrap();
        (prefill.to_vec::<f32>().unwrap(), step.to_vec::<f32>().unwrap())
    };
    assert_eq!(logits(at_load.as_ref()), logits(ahead.as_ref()));
    let _ = std::fs::remove_dir_all(&converted);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dense_smollm2_quantizes_bit_identically_to_mlx_lm_convert() {
    let dir = check_case("smollm2", smollm2_dense());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn quantized_checkpoints_and_unsupported_params_are_refused() {
    let err = Model::load_quantizing(&default_model_dir(), Some(QuantParams { bits: 4, group_size: 64 })).err().unwrap().to_string();
    assert!(err.contains("already quantized") && err.contains("q_bits"), "{err}");
    for (params, name) in [((7, 64), "q_bits"), ((4, 48), "q_group_size")] {
        let params = QuantParams { bits: params.0, group_size: params.1 };
        let err = Model::load_quantizing(&default_model_dir(), Some(params)).err().unwrap().to_string();
        assert!(err.contains(name), "{err}");
    }
}

#[test]
fn the_engine_checks_q_bits_and_q_group_size_once_for_every_surface() {
    use mlxcel_engine::{Error, LimitOptions};
    let resolve = |q_bits, q_group_size| LimitOptions { q_bits, q_group_size, ..Default::default() }.resolve();
    assert_eq!(resolve(None, None).unwrap().quantize, None);
    assert_eq!(resolve(Some(4), None).unwrap().quantize, Some(QuantParams { bits: 4, group_size: 64 }));
    assert_eq!(resolve(Some(3), Some(128)).unwrap().quantize, Some(QuantParams { bits: 3, group_size: 128 }));
    for (bits, group, name) in
        [(Some(7), None, "q_bits"), (Some(1), None, "q_bits"), (Some(16), None, "q_bits"), (Some(4), Some(48), "q_group_size"), (Some(4), Some(0), "q_group_size"), (None, Some(64), "q_group_size")]
    {
        match resolve(bits, group) {
            Err(Error::InvalidParameter { name: got, .. }) => assert_eq!(got, name, "{bits:?} {group:?}"),
            other => panic!("{bits:?} {group:?}: {other:?}"),
        }
    }
    // The engine's loaders read it: the MiniLM-size dense llama loads 8-bit.
    let config = goldens()["minilm"]["config"].clone();
    let dir = temp_dir("engine");
    write_checkpoint(&dir, &config, &minilm_dense(&config));
    for entry in std::fs::read_dir(default_model_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap().to_string_lossy().starts_with("tokenizer") {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    let engine = mlxcel_engine::Engine::load_with(&dir, resolve(Some(8), Some(32)).unwrap()).unwrap();
    let info = engine.model().info();
    assert_eq!(info.quantized_at_load, Some(QuantParams { bits: 8, group_size: 32 }));
    assert_eq!(info.main_weight_bits(), 8);
    assert_eq!(engine.summary().main_quantization.map(|q| (q.bits, q.group_size)), Some((8, 32)));
    let _ = std::fs::remove_dir_all(&dir);
}
