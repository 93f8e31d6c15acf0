//! The reader and the Whisper converter: on a small hand-written model.bin
//! (every rule of the layout), on broken files, and on the packaged tiny.en
//! model when it is in the cache (`tests/reference/fetch_whisper_ct2.sh`).

use std::fs;
use std::path::{Path, PathBuf};

use half::f16;
use mlxcel_ctranslate2::{convert_whisper, Ct2File, Error};
use safetensors::SafeTensors;

#[derive(Default)]
struct Builder {
    vars: Vec<(String, Vec<usize>, u8, Vec<u8>)>,
    aliases: Vec<(String, String)>,
}

fn s(out: &mut Vec<u8>, text: &str) {
    out.extend(((text.len() + 1) as u16).to_le_bytes());
    out.extend(text.as_bytes());
    out.push(0);
}

impl Builder {
    /// float16 values `base + i * 0.001`.
    fn f16(&mut self, name: &str, shape: &[usize], base: f32) {
        let n: usize = shape.iter().product();
        let data = (0..n).flat_map(|i| f16::from_f32(base + i as f32 * 0.001).to_le_bytes()).collect();
        self.vars.push((name.into(), shape.to_vec(), 4, data));
    }
    fn int16(&mut self, name: &str, value: i16) {
        self.vars.push((name.into(), vec![], 2, value.to_le_bytes().to_vec()));
    }
    fn int8(&mut self, name: &str, value: i8) {
        self.vars.push((name.into(), vec![], 1, vec![value as u8]));
    }
    fn bytes(&self, spec: &str) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(6u32.to_le_bytes());
        s(&mut out, spec);
        out.extend(3u32.to_le_bytes());
        out.extend((self.vars.len() as u32).to_le_bytes());
        for (name, shape, dtype, data) in &self.vars {
            s(&mut out, name);
            out.push(shape.len() as u8);
            for d in shape {
                out.extend((*d as u32).to_le_bytes());
            }
            out.push(*dtype);
            out.extend((data.len() as u32).to_le_bytes());
            out.extend(data);
        }
        out.extend((self.aliases.len() as u32).to_le_bytes());
        for (a, t) in &self.aliases {
            s(&mut out, a);
            s(&mut out, t);
        }
        out
    }
}

const D: usize = 8;
const MELS: usize = 4;
const VOCAB: usize = 20;

fn attention(b: &mut Builder, scope: &str, fused: bool) {
    b.f16(&format!("{scope}/layer_norm/gamma"), &[D], 1.0);
    b.f16(&format!("{scope}/layer_norm/beta"), &[D], 0.1);
    if fused {
        b.f16(&format!("{scope}/linear_0/weight"), &[3 * D, D], 0.0);
        b.f16(&format!("{scope}/linear_0/bias"), &[3 * D], 0.5);
        b.f16(&format!("{scope}/linear_1/weight"), &[D, D], 0.2);
        b.f16(&format!("{scope}/linear_1/bias"), &[D], 0.3);
    } else {
        b.f16(&format!("{scope}/linear_0/weight"), &[D, D], 0.0);
        b.f16(&format!("{scope}/linear_0/bias"), &[D], 0.5);
        b.f16(&format!("{scope}/linear_1/weight"), &[2 * D, D], 0.1);
        b.f16(&format!("{scope}/linear_1/bias"), &[2 * D], 0.6);
        b.f16(&format!("{scope}/linear_2/weight"), &[D, D], 0.2);
        b.f16(&format!("{scope}/linear_2/bias"), &[D], 0.3);
    }
}

fn ffn(b: &mut Builder, scope: &str) {
    b.f16(&format!("{scope}/layer_norm/gamma"), &[D], 1.0);
    b.f16(&format!("{scope}/layer_norm/beta"), &[D], 0.1);
    b.f16(&format!("{scope}/linear_0/weight"), &[4 * D, D], 0.0);
    b.f16(&format!("{scope}/linear_0/bias"), &[4 * D], 0.0);
    b.f16(&format!("{scope}/linear_1/weight"), &[D, 4 * D], 0.0);
    b.f16(&format!("{scope}/linear_1/bias"), &[D], 0.0);
}

fn tiny_whisper() -> Builder {
    let mut b = Builder::default();
    b.int8("decoder/activation", 3);
    b.int8("decoder/alibi", 0);
    b.int16("decoder/num_heads", 2);
    b.int8("decoder/pre_norm", 1);
    b.int8("decoder/scale_embeddings", 0);
    b.f16("decoder/embeddings/weight", &[VOCAB, D], 0.0);
    b.f16("decoder/position_encodings/encodings", &[6, D], 0.0);
    attention(&mut b, "decoder/layer_0/self_attention", true);
    attention(&mut b, "decoder/layer_0/attention", false);
    ffn(&mut b, "decoder/layer_0/ffn");
    b.f16("decoder/layer_norm/gamma", &[D], 1.0);
    b.f16("decoder/layer_norm/beta", &[D], 0.0);
    b.int16("encoder/num_heads", 2);
    b.f16("encoder/conv1/weight", &[D, MELS, 3], 0.0);
    b.f16("encoder/conv1/bias", &[D], 0.0);
    b.f16("encoder/conv2/weight", &[D, D, 3], 0.0);
    b.f16("encoder/conv2/bias", &[D], 0.0);
    b.f16("encoder/position_encodings/encodings", &[5, D], 0.0);
    for i in 0..2 {
        attention(&mut b, &format!("encoder/layer_{i}/self_attention"), true);
        ffn(&mut b, &format!("encoder/layer_{i}/ffn"));
    }
    b.f16("encoder/layer_norm/gamma", &[D], 1.0);
    b.f16("encoder/layer_norm/beta", &[D], 0.0);
    b.aliases.push(("decoder/projection/weight".into(), "decoder/embeddings/weight".into()));
    b
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlxcel-ct2-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_model(dir: &Path, bytes: &[u8]) {
    fs::write(dir.join("model.bin"), bytes).unwrap();
    fs::write(dir.join("tokenizer.json"), r#"{"added_tokens":[{"id":3,"content":"<|en|>"}]}"#).unwrap();
    fs::write(dir.join("config.json"), r#"{"suppress_ids":[1,2],"suppress_ids_begin":[5],"lang_ids":[3],"alignment_heads":[[0,1]]}"#).unwrap();
}

fn f16_values(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let v = t.data().chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
    (t.shape().to_vec(), v)
}

fn source(base: f32, range: std::ops::Range<usize>) -> Vec<f32> {
    range.map(|i| f16::from_f32(base + i as f32 * 0.001).to_f32()).collect()
}

#[test]
fn converts_the_layout() {
    let dir = scratch("layout");
    write_model(&dir, &tiny_whisper().bytes("WhisperSpec"));
    let out = dir.join("out");
    let mut seen = 0;
    let report = convert_whisper(&dir, &out, &mut |p| seen = p.done.max(seen)).unwrap();
    assert_eq!(report.dims.n_audio_layer, 2);
    assert_eq!(report.dims.n_text_layer, 1);
    assert_eq!((report.dims.n_audio_head, report.dims.n_text_head, report.dims.n_mels), (2, 2, MELS));
    assert_eq!((report.dims.n_audio_ctx, report.dims.n_text_ctx, report.dims.n_vocab), (5, 6, VOCAB));
    assert_eq!(seen, report.tensors);

    let bytes = fs::read(out.join("weights.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // Fused QKV rows split in order; the key has no bias.
    let (shape, q) = f16_values(&st, "encoder.blocks.1.attn.query.weight");
    assert_eq!(shape, [D, D]);
    assert_eq!(q, source(0.0, 0..D * D));
    assert_eq!(f16_values(&st, "encoder.blocks.1.attn.key.weight").1, source(0.0, D * D..2 * D * D));
    assert_eq!(f16_values(&st, "encoder.blocks.1.attn.value.weight").1, source(0.0, 2 * D * D..3 * D * D));
    assert_eq!(f16_values(&st, "encoder.blocks.1.attn.value.bias").1, source(0.5, 2 * D..3 * D));
    assert!(st.tensor("encoder.blocks.1.attn.key.bias").is_err());
    // Cross-attention: linear_1 is [key; value].
    assert_eq!(f16_values(&st, "decoder.blocks.0.cross_attn.value.weight").1, source(0.1, D * D..2 * D * D));
    assert_eq!(f16_values(&st, "decoder.blocks.0.cross_attn.value.bias").1, source(0.6, D..2 * D));
    assert_eq!(f16_values(&st, "decoder.blocks.0.cross_attn.out.bias").1, source(0.3, 0..D));
    // Conv (out, in, k) -> (out, k, in).
    let (shape, conv) = f16_values(&st, "encoder.conv1.weight");
    assert_eq!(shape, [D, 3, MELS]);
    let src = source(0.0, 0..D * MELS * 3);
    for (o, i, k) in [(0, 0, 1), (3, 2, 2), (7, 3, 0)] {
        assert_eq!(conv[(o * 3 + k) * MELS + i], src[(o * MELS + i) * 3 + k], "conv ({o}, {i}, {k})");
    }
    assert_eq!(f16_values(&st, "decoder.blocks.0.mlp2.weight").0, [D, 4 * D]);
    assert_eq!(f16_values(&st, "decoder.ln.weight").1, source(1.0, 0..D));
    assert_eq!(f16_values(&st, "decoder.positional_embedding").0, [6, D]);
    // Every name mlx-whisper expects and nothing else: 2 conv x 2, 2 encoder blocks of 15,
    // ln_post 2, embeddings 2, one decoder block of 24, ln 2.
    assert_eq!(st.len(), 4 + 2 * 15 + 2 + 2 + 24 + 2);

    let pos = fs::read(out.join("encoder_positions.safetensors")).unwrap();
    let pos = SafeTensors::deserialize(&pos).unwrap();
    assert_eq!(f16_values(&pos, "encoder.positional_embedding").0, [5, D]);
    let config: serde_json::Value = serde_json::from_str(&fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "whisper");
    assert_eq!(config["n_text_state"], D);
    assert_eq!(config.as_object().unwrap().len(), 11, "only mlx-whisper's ModelDimensions and model_type");
    let generation: serde_json::Value = serde_json::from_str(&fs::read_to_string(out.join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(generation["suppress_tokens"], serde_json::json!([1, 2]));
    assert_eq!(generation["begin_suppress_tokens"], serde_json::json!([5]));
    assert_eq!(generation["is_multilingual"], false);
    assert!(out.join("tokenizer.json").exists());
}

fn error_of(bytes: &[u8]) -> String {
    let dir = scratch("bad");
    write_model(&dir, bytes);
    match convert_whisper(&dir, &dir.join("out"), &mut |_| {}) {
        Ok(_) => panic!("converted a broken model"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn refuses_broken_files_by_name() {
    let good = tiny_whisper().bytes("WhisperSpec");
    assert!(error_of(&[]).contains("empty file"), "{}", error_of(&[]));
    let truncated = error_of(&good[..good.len() / 2]);
    assert!(truncated.contains("truncated"), "{truncated}");
    let mut wrong_version = good.clone();
    wrong_version[0] = 2;
    assert!(error_of(&wrong_version).contains("binary version 2"));
    let other = error_of(&tiny_whisper().bytes("TransformerSpec"));
    assert!(other.contains("`TransformerSpec`"), "{other}");
    let mut trailing = good.clone();
    trailing.extend([1, 2, 3]);
    assert!(error_of(&trailing).contains("3 unexpected bytes"));

    let mut b = tiny_whisper();
    b.vars.retain(|v| v.0 != "decoder/layer_0/attention/linear_2/bias");
    let missing = error_of(&b.bytes("WhisperSpec"));
    assert!(missing.contains("missing variable `decoder/layer_0/attention/linear_2/bias`"), "{missing}");
    let mut b = tiny_whisper();
    b.vars.iter_mut().find(|v| v.0 == "encoder/conv2/bias").unwrap().1 = vec![D / 2, 2];
    let shape = error_of(&b.bytes("WhisperSpec"));
    assert!(shape.contains("`encoder/conv2/bias` has shape [4, 2], expected [8]"), "{shape}");
    let mut b = tiny_whisper();
    b.vars.iter_mut().find(|v| v.0 == "decoder/pre_norm").unwrap().3 = vec![0];
    assert!(error_of(&b.bytes("WhisperSpec")).contains("`decoder/pre_norm` = 0"));
    let mut b = tiny_whisper();
    let v = b.vars.iter_mut().find(|v| v.0 == "encoder/layer_0/ffn/linear_0/weight").unwrap();
    v.2 = 1; // int8 with weight_scale: quantized
    v.3.truncate(v.3.len() / 2);
    let quantized = error_of(&b.bytes("WhisperSpec"));
    assert!(quantized.contains("is int8") && quantized.contains("float16 model"), "{quantized}");

    let dir = scratch("missing");
    let missing_dir = convert_whisper(&dir.join("nope"), &dir.join("out"), &mut |_| {}).unwrap_err();
    assert!(matches!(missing_dir, Error::Io { .. }) && missing_dir.to_string().contains("nope"), "{missing_dir}");
}

/// The packaged tiny.en model's own `model.bin`, fetched by
/// `tests/reference/fetch_whisper_ct2.sh` (the default suite reads it
/// through the hub's conversion in `tests/whisper.rs`).
#[test]
#[ignore = "needs tests/reference/fetch_whisper_ct2.sh"]
fn reads_the_packaged_tiny_en() {
    let cache = std::env::var_os("MLXCEL_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/mlxcel")
    });
    let dir = cache.join("ct2/whisper-tiny.en");
    assert!(dir.join("model.bin").exists(), "{} not fetched: run tests/reference/fetch_whisper_ct2.sh", dir.display());
    let file = Ct2File::open(&dir).unwrap();
    assert_eq!((file.spec.as_str(), file.revision), ("WhisperSpec", 3));
    let dims = mlxcel_ctranslate2::whisper_dims(&file).unwrap();
    assert_eq!((dims.n_audio_state, dims.n_audio_layer, dims.n_audio_head, dims.n_vocab), (384, 4, 6, 51864));
    // The k-bias the converter drops is all zeros.
    let bias = file.to_f32("encoder/layer_0/self_attention/linear_0/bias").unwrap();
    assert!(bias[384..768].iter().all(|&b| b == 0.0));
}
