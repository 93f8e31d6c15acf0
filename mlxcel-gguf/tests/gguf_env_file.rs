//! Converts any GGUF file named by `MLXCEL_TEST_GGUF` (skipped when unset), optionally with
//! `MLXCEL_TEST_Q_BITS` / `MLXCEL_TEST_Q_GROUP`, into `MLXCEL_TEST_OUT` (default: a temp dir),
//! and checks the result loads: safetensors, config.json, tokenizer.json.

use std::path::PathBuf;

use mlxcel_gguf::{convert_gguf, ConvertOptions};

#[test]
fn converts_gguf_from_env() {
    let Some(gguf) = std::env::var_os("MLXCEL_TEST_GGUF") else {
        eprintln!("MLXCEL_TEST_GGUF is not set; skipping");
        return;
    };
    let num = |k: &str| std::env::var(k).ok().map(|v| v.parse::<u32>().expect(k));
    let opts = ConvertOptions {
        q_bits: num("MLXCEL_TEST_Q_BITS"),
        q_group_size: num("MLXCEL_TEST_Q_GROUP"),
    };
    let out = std::env::var_os("MLXCEL_TEST_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("mlxcel-gguf-env-{}", std::process::id()))
        });
    let report = convert_gguf(PathBuf::from(&gguf).as_path(), &out, &opts).expect("conversion");
    eprintln!("{report:#?}");
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    assert_eq!(st.len(), report.tensors);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], report.model_type.as_str());
    let tok =
        tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).expect("tokenizer.json loads");
    let enc = tok.encode("Hello world, 2024!", true).unwrap();
    eprintln!("tokens: {:?} {:?}", enc.get_ids(), enc.get_tokens());
    if std::env::var_os("MLXCEL_TEST_OUT").is_none() {
        std::fs::remove_dir_all(&out).unwrap();
    }
}
