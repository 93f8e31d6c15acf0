//! SmolVLM (Idefics3) on tiny random weights against mlx-vlm 0.7.10's
//! goldens (tests/reference/make_vlm_goldens.py): the chat template and the
//! image-token expansion give the reference's prompt ids; the vision tower,
//! the connector and the full-prompt logits agree within 5e-4 of the largest
//! |value| (measured 1.1e-4: the reference's own float32 vision tower is
//! 1.0e-4 of its largest value away from a float64 evaluation of the same
//! weights, which this tiny random tower amplifies); and 16 greedy tokens
//! over the KV cache are the reference's.
//!
//! The model checks take the reference's pixel values (so they measure the
//! model alone); `greedy_from_our_own_preprocessing` then runs the whole
//! path from the image files (decoding and resizing in Rust) and must give
//! the same tokens.

use std::path::{Path, PathBuf};

use mlx_sys::Array;
use mlxcel_models::{merge_image_features, Model};
use mlxcel_vision::{decode_image, DecodeLimits};
use safetensors::SafeTensors;
use serde_json::Value;

/// Tolerance relative to the largest |value| of each compared tensor.
const REL_TOL: f32 = 5e-4;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny/smolvlm")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

struct Tensors(Vec<u8>);

impl Tensors {
    fn load() -> Self {
        Tensors(std::fs::read(dir().join("golden.safetensors")).unwrap())
    }
    fn get(&self, name: &str) -> (Vec<f32>, Vec<i32>) {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let view = st.tensor(name).unwrap_or_else(|_| panic!("no {name}"));
        let data = view.data().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        (data, view.shape().iter().map(|&d| d as i32).collect())
    }
    fn array(&self, name: &str) -> Array {
        let (data, shape) = self.get(name);
        Array::from_slice(&data, &shape).unwrap()
    }
}

/// max |a - b| / max |b|.
fn rel_diff(actual: &Array, expected: &[f32]) -> f32 {
    let actual = actual.astype(mlx_sys::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(actual.len(), expected.len());
    let scale = expected.iter().fold(0f32, |m, x| m.max(x.abs()));
    actual.iter().zip(expected).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale
}

fn load() -> Model {
    Model::load(&dir()).unwrap()
}

/// The prompt ids our chat template and image-token expansion give.
fn prompt_ids(model: &Model, case: &Value) -> (String, Vec<u32>, Vec<mlxcel_vision::ProcessedImage>) {
    let messages = case["messages"].as_array().unwrap();
    let text = model.tokenizer().apply_chat_template(messages, true).unwrap();
    let processor = model.image_processor().expect("a vision-language model");
    let images: Vec<_> = case["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let f = f.as_str().unwrap();
            let image = decode_image(&std::fs::read(dir().join(f)).unwrap(), f, &DecodeLimits::default()).unwrap();
            processor.process(&image).unwrap()
        })
        .collect();
    let expanded = processor.expand_prompt(&text, &images).unwrap();
    (text, model.tokenizer().encode(&expanded, false).unwrap(), images)
}

fn golden_ids(case: &Value) -> Vec<u32> {
    case["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// Input embeddings of `ids` with the features of `pixels` at the image tokens.
fn embeddings(model: &Model, ids: &[u32], pixels: &Array) -> Array {
    let network = model.network();
    let vision = network.vision().unwrap();
    let tokens: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    let h = network.embed(&Array::from_slice(&tokens, &[1, tokens.len() as i32]).unwrap()).unwrap();
    merge_image_features(&h, ids, vision.image_token_id(), &vision.encode(pixels).unwrap()).unwrap()
}

/// Prefill from embeddings, then `n` greedy steps over the KV cache.
fn greedy(model: &Model, h: &Array, n: usize) -> Vec<u32> {
    let network = model.network();
    let mut caches = network.new_caches();
    let mut logits = network.forward_last_embedded(h, &mut caches, Default::default()).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let token = logits.reshape(&[-1]).unwrap().argmax(0, false).unwrap().item::<u32>().unwrap();
        out.push(token);
        logits = network.forward_last(&Array::from_slice(&[token as i32], &[1, 1]).unwrap(), &mut caches).unwrap();
    }
    out
}

#[test]
fn prompts_tokenize_as_mlx_vlm() {
    let model = load();
    for case in golden()["cases"].as_array().unwrap() {
        let (text, ids, _) = prompt_ids(&model, case);
        assert_eq!(text, case["prompt"].as_str().unwrap(), "{}: chat template", case["name"]);
        assert_eq!(ids, golden_ids(case), "{}: prompt ids", case["name"]);
    }
}

#[test]
fn vision_connector_logits_and_greedy_match_mlx_vlm() {
    let model = load();
    let tensors = Tensors::load();
    let golden = golden();
    let vision = model.network().vision().unwrap();
    assert_eq!(vision.tokens_per_tile(), golden["image_seq_len"].as_u64().unwrap() as usize);
    assert_eq!(vision.image_token_id(), golden["image_token_id"].as_u64().unwrap() as u32);
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        // The reference's pixel values: each image's tiles, in prompt order.
        let images: Vec<usize> = case["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| golden["images"].as_array().unwrap().iter().position(|i| i["file"] == *f).unwrap())
            .collect();
        let parts: Vec<Array> = images.iter().map(|i| tensors.array(&format!("image{i}.pixel_values"))).collect();
        let pixels = mlx_sys::concatenate(&parts, 0).unwrap();

        let tower = vision.vision_tower(&pixels).unwrap();
        let d_tower = rel_diff(&tower, &tensors.get(&format!("{name}.vision")).0);
        let connected = vision.connect(&tower).unwrap();
        let d_connector = rel_diff(&connected, &tensors.get(&format!("{name}.connector")).0);

        let ids = golden_ids(case);
        let h = embeddings(&model, &ids, &pixels);
        let mut caches = model.network().new_caches();
        let logits = model.network().forward_embedded(&h, &mut caches).unwrap();
        let d_logits = rel_diff(&logits.squeeze(0).unwrap(), &tensors.get(&format!("{name}.logits")).0);
        eprintln!("{name}: vision {d_tower:.2e}, connector {d_connector:.2e}, logits {d_logits:.2e} (of the largest |value|)");
        assert!(d_tower <= REL_TOL && d_connector <= REL_TOL && d_logits <= REL_TOL, "{name}");

        let want: Vec<u32> = case["greedy_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(greedy(&model, &h, want.len()), want, "{name}: greedy tokens");
    }
}

#[test]
fn greedy_from_our_own_preprocessing() {
    let model = load();
    for case in golden()["cases"].as_array().unwrap() {
        let (_, ids, images) = prompt_ids(&model, case);
        let side = images[0].side as i32;
        let tiles: usize = images.iter().map(|i| i.tiles).sum();
        let data: Vec<f32> = images.iter().flat_map(|i| i.pixel_values.iter().copied()).collect();
        let pixels = Array::from_slice(&data, &[tiles as i32, 3, side, side]).unwrap();
        let h = embeddings(&model, &ids, &pixels);
        let want: Vec<u32> = case["greedy_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(greedy(&model, &h, want.len()), want, "{}", case["name"]);
    }
}

#[test]
fn image_features_must_match_the_image_tokens() {
    let model = load();
    let network = model.network();
    let vision = network.vision().unwrap();
    let ids = [1u32, vision.image_token_id(), 7];
    let h = network.embed(&Array::from_slice(&[1i32, vision.image_token_id() as i32, 7], &[1, 3]).unwrap()).unwrap();
    let two = Array::zeros(&[2, network.shape().hidden_size as i32], mlx_sys::Dtype::Float32).unwrap();
    let err = merge_image_features(&h, &ids, vision.image_token_id(), &two).unwrap_err().to_string();
    assert!(err.contains("1 image tokens for 2 image features"), "{err}");
}
