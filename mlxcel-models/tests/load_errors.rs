//! Bad checkpoints give clear errors that name the file and the tensor, and
//! never panic or abort.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mlxcel_models::model::load_network;
use mlxcel_models::Error;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

/// A private copy of a tiny checkpoint, with the single-file layout.
struct Scratch(PathBuf);

impl Scratch {
    fn of(name: &str) -> Scratch {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny").join(name);
        let dir = std::env::temp_dir().join(format!("mlxcel-load-errors-{}-{name}-{}", std::process::id(), rand_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(file), dir.join(file)).unwrap();
        }
        Scratch(dir)
    }

    fn weights(&self) -> PathBuf {
        self.0.join("model.safetensors")
    }

    fn edit_config(&self, edit: impl FnOnce(&mut serde_json::Value)) {
        let path = self.0.join("config.json");
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut config);
        std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    }

    /// Rewrites model.safetensors through `edit(name, shape) -> Some(new shape) | None (drop)`.
    fn edit_tensors(&self, edit: impl Fn(&str, &[usize]) -> Option<Vec<usize>>) {
        let bytes = std::fs::read(self.weights()).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut kept: HashMap<String, TensorView> = HashMap::new();
        for (name, view) in st.tensors() {
            if let Some(shape) = edit(&name, view.shape()) {
                let elements: usize = shape.iter().product();
                let data = &view.data()[..elements * view.dtype().bitsize() / 8];
                kept.insert(name.clone(), TensorView::new(view.dtype(), shape, data).unwrap());
            }
        }
        safetensors::serialize_to_file(&kept, None, &self.weights()).unwrap();
    }

    fn load_error(&self) -> Error {
        match load_network(&self.0) {
            Ok(_) => panic!("{} loaded", self.0.display()),
            Err(e) => e,
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

#[test]
fn truncated_safetensors_names_the_file() {
    let s = Scratch::of("llama");
    let len = std::fs::metadata(s.weights()).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(s.weights()).unwrap();
    file.set_len(len / 2).unwrap();
    let e = s.load_error();
    assert!(matches!(e, Error::InvalidFile { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("model.safetensors") && msg.contains("not a valid safetensors file"), "{msg}");
}

#[test]
fn corrupt_header_names_the_file() {
    let s = Scratch::of("llama");
    let mut bytes = std::fs::read(s.weights()).unwrap();
    bytes[8..24].copy_from_slice(b"this is no json!");
    std::fs::write(s.weights(), bytes).unwrap();
    let msg = s.load_error().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
}

#[test]
fn missing_tensor_names_it() {
    let s = Scratch::of("llama");
    s.edit_tensors(|name, shape| (name != "model.layers.1.mlp.up_proj.weight").then(|| shape.to_vec()));
    match s.load_error() {
        Error::MissingTensor { path, tensor } => {
            assert_eq!(tensor, "model.layers.1.mlp.up_proj.weight");
            assert!(path.ends_with("model.safetensors"), "{}", path.display());
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn wrong_shape_gives_both_shapes() {
    let s = Scratch::of("llama");
    s.edit_tensors(|name, shape| {
        Some(if name == "model.layers.0.self_attn.k_proj.weight" { vec![16, 64] } else { shape.to_vec() })
    });
    let e = s.load_error();
    let msg = e.to_string();
    match e {
        Error::ShapeMismatch { tensor, expected, actual, .. } => {
            assert_eq!(tensor, "model.layers.0.self_attn.k_proj.weight");
            assert_eq!((expected, actual), (vec![32, 64], vec![16, 64]));
            assert!(msg.contains("model.safetensors") && msg.contains("[16, 64]") && msg.contains("[32, 64]"), "{msg}");
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let s = Scratch::of("llama");
    s.edit_config(|c| c["model_type"] = "gpt_neo_plus".into());
    let msg = s.load_error().to_string();
    assert!(msg.contains("gpt_neo_plus") && msg.contains("config.json") && msg.contains("llama, qwen2, qwen3"), "{msg}");
}

#[test]
fn unsupported_rope_scaling_and_quantization_are_refused() {
    let s = Scratch::of("llama");
    s.edit_config(|c| c["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 4.0}));
    let msg = s.load_error().to_string();
    assert!(msg.contains("longrope") && msg.contains("linear, llama3, yarn"), "{msg}");
    assert!(msg.contains(&s.0.join("config.json").display().to_string()), "{msg}");

    let q = Scratch::of("llama_q4_g32");
    q.edit_config(|c| c["quantization"]["mode"] = "mxfp4".into());
    let msg = q.load_error().to_string();
    assert!(msg.contains("mxfp4") && msg.contains("affine"), "{msg}");

    let q = Scratch::of("llama_q4_g32");
    q.edit_config(|c| {
        c["quantization"]["bits"] = 7.into();
        c["quantization_config"]["bits"] = 7.into();
    });
    let msg = q.load_error().to_string();
    assert!(msg.contains("7-bit"), "{msg}");
}

#[test]
fn inconsistent_config_is_invalid() {
    let s = Scratch::of("llama");
    s.edit_config(|c| c["num_key_value_heads"] = 3.into());
    let msg = s.load_error().to_string();
    assert!(msg.contains("num_key_value_heads"), "{msg}");
    assert!(msg.contains(&s.0.join("config.json").display().to_string()), "{msg}");
    let s = Scratch::of("llama");
    s.edit_config(|c| c["hidden_size"] = "wide".into());
    assert!(matches!(s.load_error(), Error::InvalidConfig { .. }));
    std::fs::write(s.0.join("config.json"), "{ not json").unwrap();
    let msg = s.load_error().to_string();
    assert!(msg.contains("config.json") && msg.contains("invalid JSON"), "{msg}");
}

#[test]
fn missing_directory_and_files_are_named() {
    let msg = load_network(Path::new("/nonexistent/checkpoint")).err().unwrap().to_string();
    assert!(msg.contains("/nonexistent/checkpoint"), "{msg}");
    let s = Scratch::of("llama");
    std::fs::remove_file(s.weights()).unwrap();
    let msg = s.load_error().to_string();
    assert!(msg.contains("no model.safetensors"), "{msg}");
}

#[test]
fn tensors_no_layer_reads_are_an_error_that_names_them() {
    let s = Scratch::of("llama");
    let bytes = std::fs::read(s.weights()).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, TensorView> = st.tensors().into_iter().collect();
    let norm = tensors["model.norm.weight"].clone();
    tensors.insert("model.layers.0.mlp.extra_norm.weight".into(), norm.clone());
    tensors.insert("model.layers.1.self_attn.rotary_emb.inv_freq".into(), norm);
    safetensors::serialize_to_file(&tensors, None, &s.weights()).unwrap();
    let e = s.load_error();
    let msg = e.to_string();
    match e {
        // Precomputed RoPE frequencies are a stated skip (mlx-lm's sanitize drops them).
        Error::UnusedTensors { tensors, model_type, .. } => {
            assert_eq!((tensors, model_type.as_str()), (vec!["model.layers.0.mlp.extra_norm.weight".to_string()], "llama"));
            assert!(msg.contains("model.safetensors") && msg.contains("does not read"), "{msg}");
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn a_tied_config_skips_the_checkpoints_lm_head() {
    // As mlx-lm's llama sanitize: tie_word_embeddings drops lm_head.weight.
    let s = Scratch::of("llama");
    s.edit_config(|c| c["tie_word_embeddings"] = true.into());
    let (_, info) = load_network(&s.0).unwrap();
    assert!(info.groups.iter().all(|g| g.name != "lm_head"), "{:?}", info.groups);
}

#[test]
fn gemma2_olmo2_and_phi3_configs_are_checked_by_key() {
    let refused = |name: &str, edit: &dyn Fn(&mut serde_json::Value), words: &[&str], invalid: bool| {
        let s = Scratch::of(name);
        s.edit_config(|c| edit(c));
        let e = s.load_error();
        let msg = e.to_string();
        assert_eq!(matches!(e, Error::InvalidConfig { .. }), invalid, "{name}: {msg}");
        assert!(msg.contains("config.json") && words.iter().all(|w| msg.contains(w)), "{name}: {msg}");
    };
    // What mlx-lm would ignore (with a warning) is refused.
    refused("phi3", &|c| c["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0}), &["dynamic", "su, longrope, linear"], false);
    refused("phi3_su", &|c| c["rope_scaling"]["long_factor"] = serde_json::json!([1.0, 2.0, 3.0]), &["long_factor", "3 entries"], true);
    refused("phi3_su", &|c| drop(c["rope_scaling"].as_object_mut().unwrap().remove("short_factor")), &["short_factor"], true);
    refused("phi3_su", &|c| drop(c["rope_scaling"].as_object_mut().unwrap().remove("type")), &["rope_scaling", "type"], true);
    refused("phi3", &|c| c["head_dim"] = 8.into(), &["head_dim", "16"], true);
    refused("phi3", &|c| c["partial_rotary_factor"] = 0.1.into(), &["partial_rotary_factor"], true);
    refused("gemma2", &|c| c["hidden_activation"] = "gelu".into(), &["hidden_activation", "gelu_pytorch_tanh"], false);
    refused("gemma2", &|c| c["attn_logit_softcapping"] = (-1.0).into(), &["attn_logit_softcapping"], true);
    refused("gemma2", &|c| drop(c.as_object_mut().unwrap().remove("head_dim")), &["head_dim"], true);

    // OLMo 2 ties its head unless the config says otherwise (mlx-lm's default):
    // an untied checkpoint without `tie_word_embeddings` leaves lm_head unread.
    let s = Scratch::of("olmo2");
    s.edit_config(|c| drop(c.as_object_mut().unwrap().remove("tie_word_embeddings")));
    match s.load_error() {
        Error::UnusedTensors { tensors, .. } => assert_eq!(tensors, vec!["lm_head.weight".to_string()]),
        e => panic!("{e:?}"),
    }
}
