//! CTranslate2 Whisper (`WhisperSpec` revision 3) -> an MLX checkpoint in
//! mlx-whisper's layout, so that `mlx_whisper.load_models.load_model(dir)`
//! loads it as a reference:
//!
//! - `config.json`: mlx-whisper's `ModelDimensions` and `"model_type": "whisper"`
//!   (nothing else: mlx-whisper passes every other key to `ModelDimensions`);
//! - `weights.safetensors`: OpenAI's names as mlx-whisper spells them
//!   (`encoder.blocks.0.attn.query.weight`, `mlp1`, `mlp2`, ...), the data
//!   type as stored (float16 for the packaged models);
//! - `encoder_positions.safetensors`: the encoder's stored sinusoid table
//!   (`encoder.positional_embedding`, [n_audio_ctx, n_audio_state]).
//!   mlx-whisper computes it instead (a key it does not know would fail its
//!   strict load), faster-whisper reads the stored one; mlxcel reads the
//!   stored one too, so its encoder sees the values faster-whisper's does;
//! - `generation_config.json`: what decoding needs from CTranslate2's
//!   `config.json` under Hugging Face's names (`suppress_tokens`,
//!   `begin_suppress_tokens`, `alignment_heads`, `lang_to_id`, `is_multilingual`);
//! - `tokenizer.json`, copied.
//!
//! The changes of layout:
//! - the fused self-attention `linear_0` ([3d, d]) is split into query, key
//!   and value, and cross-attention's fused `linear_1` ([2d, d]) into key and
//!   value;
//! - the key biases are dropped: CTranslate2 stores zeros there (OpenAI's key
//!   projection has no bias), and any bias on the keys adds the same `q·b` to
//!   every score of a query, which the softmax cancels, so dropping it is exact;
//! - convolution weights go from (out, in, kernel) to MLX's (out, kernel, in).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::reader::{Ct2File, DataType};

/// The spec this converter reads.
pub const WHISPER_SPEC: &str = "WhisperSpec";

/// mlx-whisper's model dimensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WhisperDims {
    pub n_mels: usize,
    pub n_audio_ctx: usize,
    pub n_audio_state: usize,
    pub n_audio_head: usize,
    pub n_audio_layer: usize,
    pub n_vocab: usize,
    pub n_text_ctx: usize,
    pub n_text_state: usize,
    pub n_text_head: usize,
    pub n_text_layer: usize,
}

/// What [`convert_whisper`] wrote.
#[derive(Debug, Clone)]
pub struct WhisperReport {
    pub out_dir: PathBuf,
    pub dims: WhisperDims,
    /// Tensors in `weights.safetensors`.
    pub tensors: usize,
    pub multilingual: bool,
}

/// Progress of a conversion: `done` of `total` tensors, the last one named.
#[derive(Debug, Clone, Copy)]
pub struct ConvertProgress<'a> {
    pub done: usize,
    pub total: usize,
    pub tensor: &'a str,
}

struct OutTensor {
    name: String,
    dtype: DataType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn st_dtype(d: DataType) -> Dtype {
    match d {
        DataType::F32 => Dtype::F32,
        DataType::F16 => Dtype::F16,
        DataType::BF16 => Dtype::BF16,
        DataType::I8 => Dtype::I8,
        DataType::I16 => Dtype::I16,
        DataType::I32 => Dtype::I32,
    }
}

struct Reader<'a> {
    file: &'a Ct2File,
}

impl Reader<'_> {
    fn float(&self, name: &str, shape: &[usize]) -> Result<(DataType, &[u8])> {
        let v = self.file.get(name)?;
        if v.shape != shape {
            return Err(Error::invalid(self.file.path(), format!("variable `{name}` has shape {:?}, expected {shape:?}", v.shape)));
        }
        if !matches!(v.dtype, DataType::F32 | DataType::F16 | DataType::BF16) {
            return Err(Error::unsupported(
                self.file.path(),
                format!("variable `{name}` is {} (quantized CTranslate2 models are not supported; convert from the float16 model)", v.dtype.name()),
            ));
        }
        Ok((v.dtype, self.file.bytes(name)?))
    }

    /// Rows `rows` of the [R, C] (or [R]) variable `name`.
    fn rows(&self, name: &str, shape: &[usize], rows: std::ops::Range<usize>) -> Result<OutTensor> {
        let (dtype, bytes) = self.float(name, shape)?;
        let row_bytes = shape[1..].iter().product::<usize>() * dtype.size();
        let mut out_shape = shape.to_vec();
        out_shape[0] = rows.len();
        Ok(OutTensor {
            name: String::new(),
            dtype,
            shape: out_shape,
            data: bytes[rows.start * row_bytes..rows.end * row_bytes].to_vec(),
        })
    }

    fn whole(&self, name: &str, shape: &[usize]) -> Result<OutTensor> {
        self.rows(name, shape, 0..shape[0])
    }
}

fn named(mut t: OutTensor, name: String) -> OutTensor {
    t.name = name;
    t
}

fn count_layers(file: &Ct2File, prefix: &str) -> usize {
    (0..).take_while(|i| file.contains(&format!("{prefix}/layer_{i}/ffn/linear_0/weight"))).count()
}

fn head_count(file: &Ct2File, name: &str, state: usize) -> Result<usize> {
    let heads = file.scalar(name)?;
    if heads <= 0 || state % heads as usize != 0 {
        return Err(Error::invalid(file.path(), format!("`{name}` = {heads} does not divide the width {state}")));
    }
    Ok(heads as usize)
}

/// Reads the dimensions of a CTranslate2 Whisper model.
pub fn whisper_dims(file: &Ct2File) -> Result<WhisperDims> {
    if file.spec != WHISPER_SPEC {
        return Err(Error::unsupported(file.path(), format!("model spec `{}`: mlxcel converts `{WHISPER_SPEC}` models", file.spec)));
    }
    let conv1 = &file.get("encoder/conv1/weight")?.shape;
    let enc_pos = &file.get("encoder/position_encodings/encodings")?.shape;
    let embed = &file.get("decoder/embeddings/weight")?.shape;
    let dec_pos = &file.get("decoder/position_encodings/encodings")?.shape;
    if conv1.len() != 3 || conv1[2] != 3 || enc_pos.len() != 2 || embed.len() != 2 || dec_pos.len() != 2 {
        return Err(Error::invalid(file.path(), "unexpected shapes of the convolution, embeddings or position tables"));
    }
    let (n_audio_state, n_text_state) = (conv1[0], embed[1]);
    let dims = WhisperDims {
        n_mels: conv1[1],
        n_audio_ctx: enc_pos[0],
        n_audio_state,
        n_audio_head: head_count(file, "encoder/num_heads", n_audio_state)?,
        n_audio_layer: count_layers(file, "encoder"),
        n_vocab: embed[0],
        n_text_ctx: dec_pos[0],
        n_text_state,
        n_text_head: head_count(file, "decoder/num_heads", n_text_state)?,
        n_text_layer: count_layers(file, "decoder"),
    };
    if dims.n_audio_layer == 0 || dims.n_text_layer == 0 {
        return Err(Error::invalid(file.path(), "no encoder or decoder layers"));
    }
    // The decoder flavour mlxcel implements: pre-norm, GELU, no ALiBi, unscaled embeddings.
    for (flag, want) in [("decoder/pre_norm", 1), ("decoder/activation", 3), ("decoder/alibi", 0), ("decoder/scale_embeddings", 0)] {
        if file.contains(flag) && file.scalar(flag)? != want {
            return Err(Error::unsupported(file.path(), format!("`{flag}` = {} (Whisper has {want})", file.scalar(flag)?)));
        }
    }
    Ok(dims)
}

fn attention(r: &Reader, src: &str, dst: &str, d: usize, fused_qkv: bool, out: &mut Vec<OutTensor>) -> Result<()> {
    if fused_qkv {
        let (w, b) = (format!("{src}/linear_0/weight"), format!("{src}/linear_0/bias"));
        out.push(named(r.rows(&w, &[3 * d, d], 0..d)?, format!("{dst}.query.weight")));
        out.push(named(r.rows(&b, &[3 * d], 0..d)?, format!("{dst}.query.bias")));
        out.push(named(r.rows(&w, &[3 * d, d], d..2 * d)?, format!("{dst}.key.weight")));
        out.push(named(r.rows(&w, &[3 * d, d], 2 * d..3 * d)?, format!("{dst}.value.weight")));
        out.push(named(r.rows(&b, &[3 * d], 2 * d..3 * d)?, format!("{dst}.value.bias")));
        out.push(named(r.whole(&format!("{src}/linear_1/weight"), &[d, d])?, format!("{dst}.out.weight")));
        out.push(named(r.whole(&format!("{src}/linear_1/bias"), &[d])?, format!("{dst}.out.bias")));
    } else {
        // Cross-attention: linear_0 is the query, linear_1 the fused key and value.
        out.push(named(r.whole(&format!("{src}/linear_0/weight"), &[d, d])?, format!("{dst}.query.weight")));
        out.push(named(r.whole(&format!("{src}/linear_0/bias"), &[d])?, format!("{dst}.query.bias")));
        let (w, b) = (format!("{src}/linear_1/weight"), format!("{src}/linear_1/bias"));
        out.push(named(r.rows(&w, &[2 * d, d], 0..d)?, format!("{dst}.key.weight")));
        out.push(named(r.rows(&w, &[2 * d, d], d..2 * d)?, format!("{dst}.value.weight")));
        out.push(named(r.rows(&b, &[2 * d], d..2 * d)?, format!("{dst}.value.bias")));
        out.push(named(r.whole(&format!("{src}/linear_2/weight"), &[d, d])?, format!("{dst}.out.weight")));
        out.push(named(r.whole(&format!("{src}/linear_2/bias"), &[d])?, format!("{dst}.out.bias")));
    }
    Ok(())
}

fn layer_norm(r: &Reader, src: &str, dst: &str, d: usize, out: &mut Vec<OutTensor>) -> Result<()> {
    out.push(named(r.whole(&format!("{src}/gamma"), &[d])?, format!("{dst}.weight")));
    out.push(named(r.whole(&format!("{src}/beta"), &[d])?, format!("{dst}.bias")));
    Ok(())
}

fn mlp(r: &Reader, src: &str, dst: &str, d: usize, out: &mut Vec<OutTensor>) -> Result<()> {
    let inner = r.file.get(&format!("{src}/linear_0/weight"))?.shape[0];
    layer_norm(r, &format!("{src}/layer_norm"), &format!("{dst}.mlp_ln"), d, out)?;
    out.push(named(r.whole(&format!("{src}/linear_0/weight"), &[inner, d])?, format!("{dst}.mlp1.weight")));
    out.push(named(r.whole(&format!("{src}/linear_0/bias"), &[inner])?, format!("{dst}.mlp1.bias")));
    out.push(named(r.whole(&format!("{src}/linear_1/weight"), &[d, inner])?, format!("{dst}.mlp2.weight")));
    out.push(named(r.whole(&format!("{src}/linear_1/bias"), &[d])?, format!("{dst}.mlp2.bias")));
    Ok(())
}

/// (out, in, k) -> (out, k, in).
fn conv(r: &Reader, src: &str, dst: &str, out_ch: usize, in_ch: usize, out: &mut Vec<OutTensor>) -> Result<()> {
    let (dtype, bytes) = r.float(&format!("{src}/weight"), &[out_ch, in_ch, 3])?;
    let es = dtype.size();
    let mut data = vec![0u8; bytes.len()];
    for o in 0..out_ch {
        for i in 0..in_ch {
            for k in 0..3 {
                let from = ((o * in_ch + i) * 3 + k) * es;
                let to = ((o * 3 + k) * in_ch + i) * es;
                data[to..to + es].copy_from_slice(&bytes[from..from + es]);
            }
        }
    }
    out.push(OutTensor { name: format!("{dst}.weight"), dtype, shape: vec![out_ch, 3, in_ch], data });
    out.push(named(r.whole(&format!("{src}/bias"), &[out_ch])?, format!("{dst}.bias")));
    Ok(())
}

fn write_safetensors(path: &Path, tensors: &[OutTensor], on_progress: &mut dyn FnMut(ConvertProgress)) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    for (done, t) in tensors.iter().enumerate() {
        let view = TensorView::new(st_dtype(t.dtype), t.shape.clone(), &t.data)
            .map_err(|e| Error::invalid(path, format!("tensor `{}`: {e}", t.name)))?;
        views.push((t.name.clone(), view));
        on_progress(ConvertProgress { done: done + 1, total: tensors.len(), tensor: &t.name });
    }
    let metadata = Some([("format".to_string(), "mlx".to_string())].into_iter().collect());
    safetensors::serialize_to_file(views, metadata, path).map_err(|e| Error::invalid(path, format!("writing: {e}")))
}

fn read_json(path: &Path) -> Result<Value> {
    let text = fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::invalid(path, format!("invalid JSON: {e}")))
}

/// `lang_to_id`: each language token (`<|en|>`) of `lang_ids`, from the tokenizer's added tokens.
fn languages(tokenizer: &Value, lang_ids: &[i64], path: &Path) -> Result<BTreeMap<String, i64>> {
    let mut by_id = BTreeMap::new();
    for t in tokenizer["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(content)) = (t["id"].as_i64(), t["content"].as_str()) {
            by_id.insert(id, content.to_string());
        }
    }
    lang_ids
        .iter()
        .map(|id| {
            by_id.get(id).map(|token| (token.clone(), *id)).ok_or_else(|| {
                Error::invalid(path, format!("language id {id} of config.json is not an added token of tokenizer.json"))
            })
        })
        .collect()
}

/// Converts the CTranslate2 Whisper model in `src_dir` (`model.bin`,
/// `config.json`, `tokenizer.json`) into `out_dir` (created if missing).
pub fn convert_whisper(src_dir: &Path, out_dir: &Path, on_progress: &mut dyn FnMut(ConvertProgress)) -> Result<WhisperReport> {
    let file = Ct2File::open(src_dir)?;
    let src_dir = file.path().parent().unwrap_or(Path::new(".")).to_path_buf();
    let dims = whisper_dims(&file)?;
    let tokenizer_path = src_dir.join("tokenizer.json");
    let tokenizer = read_json(&tokenizer_path)?;
    let ct2_config_path = src_dir.join("config.json");
    let ct2_config = if ct2_config_path.exists() { read_json(&ct2_config_path)? } else { json!({}) };
    let ids = |key: &str| -> Vec<i64> { ct2_config[key].as_array().into_iter().flatten().filter_map(Value::as_i64).collect() };

    let r = Reader { file: &file };
    let (da, dt) = (dims.n_audio_state, dims.n_text_state);
    let mut out = Vec::new();
    conv(&r, "encoder/conv1", "encoder.conv1", da, dims.n_mels, &mut out)?;
    conv(&r, "encoder/conv2", "encoder.conv2", da, da, &mut out)?;
    for i in 0..dims.n_audio_layer {
        let (src, dst) = (format!("encoder/layer_{i}"), format!("encoder.blocks.{i}"));
        layer_norm(&r, &format!("{src}/self_attention/layer_norm"), &format!("{dst}.attn_ln"), da, &mut out)?;
        attention(&r, &format!("{src}/self_attention"), &format!("{dst}.attn"), da, true, &mut out)?;
        mlp(&r, &format!("{src}/ffn"), &dst, da, &mut out)?;
    }
    layer_norm(&r, "encoder/layer_norm", "encoder.ln_post", da, &mut out)?;
    out.push(named(r.whole("decoder/embeddings/weight", &[dims.n_vocab, dt])?, "decoder.token_embedding.weight".into()));
    out.push(named(r.whole("decoder/position_encodings/encodings", &[dims.n_text_ctx, dt])?, "decoder.positional_embedding".into()));
    for i in 0..dims.n_text_layer {
        let (src, dst) = (format!("decoder/layer_{i}"), format!("decoder.blocks.{i}"));
        layer_norm(&r, &format!("{src}/self_attention/layer_norm"), &format!("{dst}.attn_ln"), dt, &mut out)?;
        attention(&r, &format!("{src}/self_attention"), &format!("{dst}.attn"), dt, true, &mut out)?;
        layer_norm(&r, &format!("{src}/attention/layer_norm"), &format!("{dst}.cross_attn_ln"), dt, &mut out)?;
        attention(&r, &format!("{src}/attention"), &format!("{dst}.cross_attn"), dt, false, &mut out)?;
        mlp(&r, &format!("{src}/ffn"), &dst, dt, &mut out)?;
    }
    layer_norm(&r, "decoder/layer_norm", "decoder.ln", dt, &mut out)?;
    if file.contains("decoder/projection/weight") && file.get("decoder/projection/weight")?.shape != [dims.n_vocab, dt] {
        return Err(Error::invalid(file.path(), "`decoder/projection/weight` is not the embeddings' shape (untied heads are not Whisper)"));
    }

    fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    write_safetensors(&out_dir.join("weights.safetensors"), &out, on_progress)?;
    let positions = named(r.whole("encoder/position_encodings/encodings", &[dims.n_audio_ctx, da])?, "encoder.positional_embedding".into());
    write_safetensors(&out_dir.join("encoder_positions.safetensors"), std::slice::from_ref(&positions), &mut |_| {})?;

    let config = json!({
        "n_mels": dims.n_mels, "n_audio_ctx": dims.n_audio_ctx, "n_audio_state": dims.n_audio_state,
        "n_audio_head": dims.n_audio_head, "n_audio_layer": dims.n_audio_layer, "n_vocab": dims.n_vocab,
        "n_text_ctx": dims.n_text_ctx, "n_text_state": dims.n_text_state, "n_text_head": dims.n_text_head,
        "n_text_layer": dims.n_text_layer, "model_type": "whisper",
    });
    write_json(&out_dir.join("config.json"), &config)?;
    // OpenAI's rule: the multilingual vocabularies have 51865 or more tokens.
    let multilingual = dims.n_vocab >= 51865;
    let lang_to_id = if multilingual { languages(&tokenizer, &ids("lang_ids"), &tokenizer_path)? } else { BTreeMap::new() };
    let generation = json!({
        "suppress_tokens": ids("suppress_ids"),
        "begin_suppress_tokens": ids("suppress_ids_begin"),
        "alignment_heads": ct2_config.get("alignment_heads").cloned().unwrap_or(json!([])),
        "is_multilingual": multilingual,
        "lang_to_id": lang_to_id,
        "converted_from": format!("CTranslate2 {} revision {}", file.spec, file.revision),
    });
    write_json(&out_dir.join("generation_config.json"), &generation)?;
    fs::copy(&tokenizer_path, out_dir.join("tokenizer.json")).map_err(|e| Error::io(&tokenizer_path, e))?;
    Ok(WhisperReport { out_dir: out_dir.to_path_buf(), dims, tensors: out.len(), multilingual })
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialize");
    fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}
