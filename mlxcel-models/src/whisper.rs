//! Whisper (OpenAI's speech recognition transformer) as mlx-whisper computes
//! it, from a checkpoint in mlx-whisper's layout (`mlxcel convert
//! --ctranslate2` writes one from faster-whisper's CTranslate2 files):
//!
//! - the encoder: two convolutions (kernel 3; the second of stride 2) with
//!   GELU, the sinusoid position table, pre-norm blocks of full attention,
//!   a final LayerNorm; 30 s of log-mel frames (80 × 3000) -> 1500 states;
//! - the decoder: token + learned position embeddings, pre-norm blocks of
//!   causal self-attention, cross-attention over the audio states and a GELU
//!   MLP, a final LayerNorm, logits through the tied token embeddings.
//!
//! Everything computes in float32 with the stored weight values (float16
//! for the packaged models, widened exactly, as CTranslate2's float32
//! compute type sees them), every matrix product on mlxcel's dense kernel
//! with f32 accumulation. The encoder's weights are widened once at load
//! (its products have 1500 rows); the decoder's stay float16, which the
//! kernel reads in place for the few rows of a decoding step: half the
//! bytes per token, the same products. The convolutions run as one matrix product over
//! three shifted copies of the input (`im2col`), and attention on the
//! attention kernel (unmasked in the encoder and cross-attention).
//!
//! Decoding state lives in [`WhisperDecoder`]: the cross-attention keys and
//! values of one window, computed once, and the self-attention cache.

use std::path::{Path, PathBuf};

use mlx_sys::kernels;
use mlx_sys::{Array, Dtype};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::nn::LayerNorm;
use crate::quantization::QuantizationConfig;
use crate::weights::{Scope, Weights};

/// PyTorch's and MLX's LayerNorm default epsilon, Whisper's.
const LN_EPS: f32 = 1e-5;

/// mlx-whisper's `ModelDimensions` (`config.json`).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct WhisperDims {
    pub n_mels: i32,
    pub n_audio_ctx: i32,
    pub n_audio_state: i32,
    pub n_audio_head: i32,
    pub n_audio_layer: i32,
    pub n_vocab: i32,
    pub n_text_ctx: i32,
    pub n_text_state: i32,
    pub n_text_head: i32,
    pub n_text_layer: i32,
}

impl WhisperDims {
    /// Log-mel frames of one window: two per audio state (the second convolution has stride 2).
    pub fn n_frames(&self) -> i32 {
        2 * self.n_audio_ctx
    }
}

struct Dense {
    /// [out, in]: float32, or float16 as stored (the decoder's).
    weight: Array,
    /// float32.
    bias: Option<Array>,
}

impl Dense {
    fn load(scope: &Scope, in_features: i32, out_features: i32, bias: bool, stored: bool) -> Result<Dense> {
        let weight = if stored { scope.get_stored("weight", &[out_features, in_features])? } else { scope.get("weight", &[out_features, in_features])? };
        let bias = if bias { Some(scope.get("bias", &[out_features])?) } else { None };
        Ok(Dense { weight, bias })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let y = kernels::dense_matmul(x, &self.weight)?;
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

struct MultiHeadAttention {
    query: Dense,
    key: Dense,
    value: Dense,
    out: Dense,
    heads: i32,
}

impl MultiHeadAttention {
    fn load(scope: &Scope, state: i32, heads: i32, stored: bool) -> Result<Self> {
        Ok(MultiHeadAttention {
            query: Dense::load(&scope.pp("query"), state, state, true, stored)?,
            key: Dense::load(&scope.pp("key"), state, state, false, stored)?,
            value: Dense::load(&scope.pp("value"), state, state, true, stored)?,
            out: Dense::load(&scope.pp("out"), state, state, true, stored)?,
            heads,
        })
    }

    /// `[L, state]` -> `[1, heads, L, head_dim]`.
    fn split_heads(&self, x: &Array) -> Result<Array> {
        let (rows, state) = (x.dim(0), x.dim(1));
        Ok(x.reshape(&[1, rows, self.heads, state / self.heads])?.transpose(&[0, 2, 1, 3])?)
    }

    /// `[1, heads, L, head_dim]` -> `[L, state]`.
    fn merge_heads(&self, x: &Array) -> Result<Array> {
        let rows = x.dim(2);
        Ok(x.transpose(&[0, 2, 1, 3])?.reshape(&[rows, -1])?)
    }

    fn keys_values(&self, x: &Array) -> Result<(Array, Array)> {
        Ok((self.split_heads(&self.key.forward(x)?)?, self.split_heads(&self.value.forward(x)?)?))
    }

    fn attend(&self, x: &Array, keys: &Array, values: &Array, causal: bool) -> Result<Array> {
        let q = self.split_heads(&self.query.forward(x)?)?;
        let head_dim = x.dim(1) / self.heads;
        let context = kernels::attention(&q, keys, values, (head_dim as f32).powf(-0.5), causal)?;
        self.out.forward(&self.merge_heads(&context)?)
    }
}

struct Block {
    attn_ln: LayerNorm,
    attn: MultiHeadAttention,
    cross: Option<(LayerNorm, MultiHeadAttention)>,
    mlp_ln: LayerNorm,
    mlp1: Dense,
    mlp2: Dense,
}

impl Block {
    /// An encoder block (weights widened), or a decoder block with
    /// cross-attention (weights as stored).
    fn load(scope: &Scope, state: i32, heads: i32, decoder: bool) -> Result<Block> {
        let cross = if decoder {
            Some((LayerNorm::load(&scope.pp("cross_attn_ln"), state, LN_EPS)?, MultiHeadAttention::load(&scope.pp("cross_attn"), state, heads, true)?))
        } else {
            None
        };
        Ok(Block {
            attn_ln: LayerNorm::load(&scope.pp("attn_ln"), state, LN_EPS)?,
            attn: MultiHeadAttention::load(&scope.pp("attn"), state, heads, decoder)?,
            cross,
            mlp_ln: LayerNorm::load(&scope.pp("mlp_ln"), state, LN_EPS)?,
            mlp1: Dense::load(&scope.pp("mlp1"), state, 4 * state, true, decoder)?,
            mlp2: Dense::load(&scope.pp("mlp2"), 4 * state, state, true, decoder)?,
        })
    }

    fn mlp(&self, x: &Array) -> Result<Array> {
        let h = kernels::gelu_erf(&self.mlp1.forward(&self.mlp_ln.forward(x)?)?)?;
        Ok(x.add(&self.mlp2.forward(&h)?)?)
    }
}

/// A loaded Whisper model. Holds only evaluated arrays: one model serves
/// any number of threads at once, each with its own [`WhisperDecoder`].
pub struct Whisper {
    dims: WhisperDims,
    dir: PathBuf,
    conv1: Dense,
    conv2: Dense,
    encoder_positions: Array,
    encoder_blocks: Vec<Block>,
    ln_post: LayerNorm,
    token_embedding: Array,
    decoder_positions: Array,
    decoder_blocks: Vec<Block>,
    ln: LayerNorm,
}

/// Sinusoids as OpenAI's (and mlx-whisper's) `sinusoids(length, channels)`.
fn sinusoids(length: i32, channels: i32) -> Vec<f32> {
    let half = (channels / 2) as usize;
    let increment = (10000f64).ln() / (half as f64 - 1.0);
    let mut out = vec![0f32; length as usize * channels as usize];
    for t in 0..length as usize {
        for i in 0..half {
            let angle = t as f64 * (-increment * i as f64).exp();
            out[t * channels as usize + i] = angle.sin() as f32;
            out[t * channels as usize + half + i] = angle.cos() as f32;
        }
    }
    out
}

impl Whisper {
    /// Loads a checkpoint directory in mlx-whisper's layout (`config.json`,
    /// `weights.safetensors`, and `encoder_positions.safetensors` when the
    /// converter kept the stored table; else the table is computed).
    pub fn load(dir: &Path) -> Result<Whisper> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json { path: config_path.clone(), source })?;
        let model_type = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("whisper");
        if model_type != "whisper" {
            return Err(Error::UnknownArchitecture { path: config_path, model_type: model_type.into(), supported: "whisper".into() });
        }
        let dims: WhisperDims = serde_json::from_value(json).map_err(|source| Error::Json { path: config_path.clone(), source })?;
        let positive = [dims.n_mels, dims.n_audio_ctx, dims.n_audio_state, dims.n_audio_head, dims.n_audio_layer, dims.n_vocab, dims.n_text_ctx, dims.n_text_state, dims.n_text_head, dims.n_text_layer];
        if positive.iter().any(|&d| d <= 0) || dims.n_audio_state % dims.n_audio_head != 0 || dims.n_text_state % dims.n_text_head != 0 || dims.n_audio_state % 2 != 0 {
            return Err(Error::InvalidConfig { path: config_path, message: format!("inconsistent dimensions {dims:?}") });
        }
        let weights = Weights::load(dir)?;
        let quantization = QuantizationConfig::default();
        let root = Scope::root(&weights, &quantization, Dtype::Float32);
        if weights.contains("decoder.token_embedding.scales") {
            return Err(Error::Unsupported { path: dir.into(), message: "quantized Whisper checkpoints are not supported yet; use the float16 conversion".into() });
        }
        let (da, dt) = (dims.n_audio_state, dims.n_text_state);
        let enc = root.pp("encoder");
        let conv = |name: &str, in_ch: i32| -> Result<Dense> {
            let scope = enc.pp(name);
            let weight = scope.get("weight", &[da, 3, in_ch])?.reshape(&[da, 3 * in_ch])?;
            weight.eval()?;
            Ok(Dense { weight, bias: Some(scope.get("bias", &[da])?) })
        };
        let conv1 = conv("conv1", dims.n_mels)?;
        let conv2 = conv("conv2", da)?;
        let encoder_positions = if weights.contains("encoder.positional_embedding") {
            enc.get("positional_embedding", &[dims.n_audio_ctx, da])?
        } else {
            let table = Array::from_slice(&sinusoids(dims.n_audio_ctx, da), &[dims.n_audio_ctx, da])?;
            table.eval()?;
            table
        };
        let encoder_blocks = (0..dims.n_audio_layer)
            .map(|i| Block::load(&enc.pp("blocks").pp(i), da, dims.n_audio_head, false))
            .collect::<Result<Vec<_>>>()?;
        let ln_post = LayerNorm::load(&enc.pp("ln_post"), da, LN_EPS)?;
        let dec = root.pp("decoder");
        let token_embedding = dec.pp("token_embedding").get_stored("weight", &[dims.n_vocab, dt])?;
        let decoder_positions = dec.get("positional_embedding", &[dims.n_text_ctx, dt])?;
        let decoder_blocks = (0..dims.n_text_layer)
            .map(|i| Block::load(&dec.pp("blocks").pp(i), dt, dims.n_text_head, true))
            .collect::<Result<Vec<_>>>()?;
        let ln = LayerNorm::load(&dec.pp("ln"), dt, LN_EPS)?;
        weights.check_all_read("whisper")?;
        Ok(Whisper {
            dims,
            dir: dir.to_path_buf(),
            conv1,
            conv2,
            encoder_positions,
            encoder_blocks,
            ln_post,
            token_embedding,
            decoder_positions,
            decoder_blocks,
            ln,
        })
    }

    pub fn dims(&self) -> &WhisperDims {
        &self.dims
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The audio states of one window: `mel` is `n_mels × n_frames` float32,
    /// row-major (a mel bin's frames together, as Whisper's feature
    /// extractors return them) -> a lazy `[n_audio_ctx, n_audio_state]` array.
    pub fn encode(&self, mel: &[f32]) -> Result<Array> {
        let (mels, frames) = (self.dims.n_mels, self.dims.n_frames());
        if mel.len() != (mels * frames) as usize {
            return Err(Error::InvalidInput(format!("{} log-mel values for one window (expected {mels} × {frames})", mel.len())));
        }
        let x = Array::from_slice(mel, &[mels, frames])?.transpose(&[1, 0])?;
        // conv1 (stride 1, padding 1): rows t-1, t, t+1 side by side.
        let padded = zero_pad_rows(&x)?;
        let cols = mlx_sys::concatenate(&[padded.slice_axis(0, 0, frames)?, padded.slice_axis(0, 1, frames + 1)?, padded.slice_axis(0, 2, frames + 2)?], 1)?;
        let h = kernels::gelu_erf(&self.conv1.forward(&cols)?)?;
        // conv2 (stride 2, padding 1): output t sees padded rows 2t, 2t+1, 2t+2.
        let (ctx, state) = (self.dims.n_audio_ctx, self.dims.n_audio_state);
        let padded = zero_pad_rows(&h)?;
        let pairs = padded.slice_axis(0, 0, frames)?.reshape(&[ctx, 2 * state])?;
        let next = padded.slice_axis(0, 2, frames + 2)?.reshape(&[ctx, 2 * state])?.slice_axis(1, 0, state)?;
        let cols = mlx_sys::concatenate(&[pairs, next], 1)?;
        let mut x = kernels::gelu_erf(&self.conv2.forward(&cols)?)?.add(&self.encoder_positions)?;
        for block in &self.encoder_blocks {
            let h = block.attn_ln.forward(&x)?;
            let (k, v) = block.attn.keys_values(&h)?;
            x = x.add(&block.attn.attend(&h, &k, &v, false)?)?;
            x = block.mlp(&x)?;
        }
        self.ln_post.forward(&x)
    }

    /// A decoder over `audio` (from [`encode`](Self::encode)): computes and
    /// evaluates every layer's cross-attention keys and values once.
    pub fn decoder(&self, audio: &Array) -> Result<WhisperDecoder<'_>> {
        let mut cross = Vec::with_capacity(self.decoder_blocks.len());
        for block in &self.decoder_blocks {
            let (_, attn) = block.cross.as_ref().expect("decoder blocks have cross-attention");
            let (k, v) = attn.keys_values(audio)?;
            mlx_sys::eval([&k, &v])?;
            cross.push((k, v));
        }
        Ok(WhisperDecoder { model: self, cross, cache: Vec::new(), length: 0 })
    }
}

fn zero_pad_rows(x: &Array) -> Result<Array> {
    let zero = Array::zeros(&[1, x.dim(1)], x.dtype())?;
    Ok(mlx_sys::concatenate(&[zero.clone(), x.clone(), zero], 0)?)
}

/// One window's decoding state: cross-attention keys and values, and the
/// self-attention cache of the tokens so far. Cheap to [`fork`](Self::fork)
/// (arrays are shared, never mutated).
#[derive(Clone)]
pub struct WhisperDecoder<'a> {
    model: &'a Whisper,
    cross: Vec<(Array, Array)>,
    /// Per layer: keys and values `[1, heads, length, head_dim]`.
    cache: Vec<(Array, Array)>,
    length: i32,
}

impl WhisperDecoder<'_> {
    /// Tokens decoded so far.
    pub fn len(&self) -> usize {
        self.length as usize
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// This state, to continue along another path (sampling several candidates).
    pub fn fork(&self) -> Self {
        self.clone()
    }

    /// Forgets the decoded tokens (the audio stays).
    pub fn reset(&mut self) {
        self.cache.clear();
        self.length = 0;
    }

    /// Runs `tokens` after the ones decoded so far and returns the float32
    /// logits at each of `rows` (indices into `tokens`), `n_vocab` each.
    pub fn forward(&mut self, tokens: &[u32], rows: &[usize]) -> Result<Vec<Vec<f32>>> {
        let m = self.model;
        let count = tokens.len() as i32;
        if tokens.is_empty() || self.length + count > m.dims.n_text_ctx {
            return Err(Error::InvalidInput(format!(
                "{} tokens after {} (the decoder takes 1 to {} in all)",
                tokens.len(),
                self.length,
                m.dims.n_text_ctx
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as i32 >= m.dims.n_vocab) {
            return Err(Error::InvalidInput(format!("token id {bad} is outside the vocabulary of {}", m.dims.n_vocab)));
        }
        if let Some(bad) = rows.iter().find(|&&r| r >= tokens.len()) {
            return Err(Error::InvalidInput(format!("logits row {bad} of {} tokens", tokens.len())));
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let ids = Array::from_slice(&ids, &[count])?;
        let mut x = m
            .token_embedding
            .take(&ids, 0)?
            .astype(Dtype::Float32)?
            .add(&m.decoder_positions.slice_axis(0, self.length, self.length + count)?)?;
        let first = self.cache.is_empty();
        for (i, block) in m.decoder_blocks.iter().enumerate() {
            let h = block.attn_ln.forward(&x)?;
            let (k, v) = block.attn.keys_values(&h)?;
            let (k, v) = if first {
                (k, v)
            } else {
                let (pk, pv) = &self.cache[i];
                (mlx_sys::concatenate(&[pk.clone(), k], 2)?, mlx_sys::concatenate(&[pv.clone(), v], 2)?)
            };
            x = x.add(&block.attn.attend(&h, &k, &v, true)?)?;
            if first {
                self.cache.push((k, v));
            } else {
                self.cache[i] = (k, v);
            }
            let (cross_ln, cross) = block.cross.as_ref().expect("decoder blocks have cross-attention");
            let (ck, cv) = &self.cross[i];
            x = x.add(&cross.attend(&cross_ln.forward(&x)?, ck, cv, false)?)?;
            x = block.mlp(&x)?;
        }
        let picked: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let last = m.ln.forward(&x.take(&Array::from_slice(&picked, &[picked.len() as i32])?, 0)?)?;
        let logits = kernels::dense_matmul(&last, &m.token_embedding)?;
        let mut outputs: Vec<&Array> = vec![&logits];
        for (k, v) in &self.cache {
            outputs.push(k);
            outputs.push(v);
        }
        mlx_sys::eval(outputs)?;
        self.length += count;
        let flat = logits.to_vec::<f32>()?;
        Ok(flat.chunks_exact(m.dims.n_vocab as usize).map(<[f32]>::to_vec).collect())
    }
}

/// Whisper's tokenizer (`tokenizer.json`) and its special tokens. The
/// timestamp tokens (`<|0.00|>` ... `<|30.00|>`) are not in the file: they
/// are the ids from `<|notimestamps|>` + 1 up to the vocabulary's end.
pub struct WhisperTokenizer {
    inner: tokenizers::Tokenizer,
    pub eot: u32,
    pub sot: u32,
    pub sot_prev: u32,
    pub sot_lm: u32,
    pub transcribe: u32,
    pub translate: u32,
    pub no_timestamps: u32,
    /// `<|nospeech|>`, or `<|nocaptions|>` in older vocabularies.
    pub no_speech: u32,
    /// The first timestamp token, `<|0.00|>`.
    pub timestamp_begin: u32,
    /// The vocabulary's size (the logits' width): the last id is `<|30.00|>`.
    pub vocab_size: u32,
}

impl WhisperTokenizer {
    pub fn load(dir: &Path, vocab_size: i32) -> Result<WhisperTokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::invalid_file(dir, "no tokenizer.json in the Whisper checkpoint"));
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        let id = |token: &str| -> Result<u32> {
            inner.token_to_id(token).ok_or_else(|| Error::Tokenizer(format!("{}: no `{token}` token", path.display())))
        };
        let no_timestamps = id("<|notimestamps|>")?;
        let no_speech = inner.token_to_id("<|nospeech|>").map(Ok).unwrap_or_else(|| id("<|nocaptions|>"))?;
        let tokenizer = WhisperTokenizer {
            eot: id("<|endoftext|>")?,
            sot: id("<|startoftranscript|>")?,
            sot_prev: id("<|startofprev|>")?,
            sot_lm: id("<|startoflm|>")?,
            transcribe: id("<|transcribe|>")?,
            translate: id("<|translate|>")?,
            no_timestamps,
            no_speech,
            timestamp_begin: no_timestamps + 1,
            vocab_size: vocab_size as u32,
            inner,
        };
        if tokenizer.timestamp_begin >= tokenizer.vocab_size {
            return Err(Error::Tokenizer(format!("{}: no room for timestamp tokens in a vocabulary of {vocab_size}", path.display())));
        }
        Ok(tokenizer)
    }

    /// The id of a token (a language token such as `<|de|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token spelled by `id` (`<|de|>`), if the vocabulary has it.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// `text` as token ids, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?.get_ids().to_vec())
    }

    /// The text of `tokens`' text tokens (ids below `<|endoftext|>`; timestamps and specials dropped).
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        let text: Vec<u32> = tokens.iter().copied().filter(|&t| t < self.eot).collect();
        self.inner.decode(&text, true).map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// Tokens that would spell speaker tags or non-speech annotations
    /// (`♪`, `[`, `(`, ...), suppressed while decoding: Whisper's rule,
    /// as OpenAI's and faster-whisper's tokenizers build the list.
    pub fn non_speech_tokens(&self) -> Result<Vec<u32>> {
        let mut symbols: Vec<String> = "\"#()*+/:;<=>@[\\]^_`{|}~「」『』".chars().map(String::from).collect();
        symbols.extend("<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split(' ').map(String::from));
        let miscellaneous: Vec<String> = "♩♪♫♬♭♮♯".chars().map(String::from).collect();
        let mut result = std::collections::BTreeSet::new();
        for start in [" -", " '"] {
            if let Some(&first) = self.encode(start)?.first() {
                result.insert(first);
            }
        }
        for (symbol, misc) in symbols.iter().map(|s| (s, false)).chain(miscellaneous.iter().map(|s| (s, true))) {
            for text in [symbol.clone(), format!(" {symbol}")] {
                let tokens = self.encode(&text)?;
                if tokens.len() == 1 || (misc && !tokens.is_empty()) {
                    result.insert(tokens[0]);
                }
            }
        }
        Ok(result.into_iter().collect())
    }
}
