//! Test helpers: a small GGUF writer and independent decoders of GGML blocks.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use half::f16;
use mlxcel_gguf::{GgmlType, Value};

/// A GGUF file under construction.
pub struct GgufBuilder {
    pub version: u32,
    pub alignment: u64,
    pub metadata: Vec<(String, Value)>,
    /// `(name, ggml dims, type id, data)`.
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Default for GgufBuilder {
    fn default() -> Self {
        GgufBuilder {
            version: 3,
            alignment: 32,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            let ty = items.first().map_or(4, value_type);
            out.extend(ty.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}

impl GgufBuilder {
    pub fn meta(&mut self, key: &str, v: Value) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// The file bytes, and the offset where the tensor data section starts.
    pub fn build(&self) -> (Vec<u8>, usize) {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend(value_type(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let align = |n: usize| n.div_ceil(self.alignment as usize) * self.alignment as usize;
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(ty.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = align(offset + data.len());
        }
        let data_start = align(out.len());
        out.resize(data_start, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend(data);
            out.resize(data_start + align(out.len() - data_start), 0);
        }
        (out, data_start)
    }
}

pub fn s(v: &str) -> Value {
    Value::String(v.to_string())
}

/// A deterministic xorshift generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
}

/// Random blocks of a GGML type with finite, modest f16 scale fields.
/// `f16_fields`: byte offsets of the f16 fields in a block.
pub fn random_blocks(
    rng: &mut Rng,
    n_blocks: usize,
    block_bytes: usize,
    f16_fields: &[usize],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(n_blocks * block_bytes);
    for _ in 0..n_blocks {
        let mut b = rng.bytes(block_bytes);
        for (i, &off) in f16_fields.iter().enumerate() {
            let v = if i == 0 {
                rng.uniform(0.001, 0.05)
            } else {
                rng.uniform(-0.05, 0.05)
            };
            b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        out.extend(b);
    }
    out
}

fn h(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Reference decoders written straight from ggml-common.h, for Q4_0 / Q4_1 / Q8_0.
pub fn decode_q4_0(data: &[u8]) -> Vec<f32> {
    data.chunks(18)
        .flat_map(|b| {
            let d = h(b, 0);
            (0..32).map(move |j| {
                let q = if j < 16 {
                    b[2 + j] & 15
                } else {
                    b[2 + j - 16] >> 4
                };
                (q as f32 - 8.0) * d
            })
        })
        .collect()
}

pub fn decode_q4_1(data: &[u8]) -> Vec<f32> {
    data.chunks(20)
        .flat_map(|b| {
            let (d, m) = (h(b, 0), h(b, 2));
            (0..32).map(move |j| {
                let q = if j < 16 {
                    b[4 + j] & 15
                } else {
                    b[4 + j - 16] >> 4
                };
                q as f32 * d + m
            })
        })
        .collect()
}

pub fn decode_q8_0(data: &[u8]) -> Vec<f32> {
    data.chunks(34)
        .flat_map(|b| (0..32).map(move |j| b[2 + j] as i8 as f32 * h(b, 0)))
        .collect()
}

/// `scale * q + bias` of an MLX affine tensor (independent of the library's unpacking).
pub fn affine_dequantize(
    weight: &[u32],
    scales: &[f16],
    biases: &[f16],
    rows: usize,
    cols: usize,
    bits: usize,
) -> Vec<f32> {
    let group = cols / (scales.len() / rows);
    let words = cols * bits / 32;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        // The row as a little-endian bit string.
        let bits_of_row: Vec<bool> = weight[r * words..(r + 1) * words]
            .iter()
            .flat_map(|w| (0..32).map(move |k| (w >> k) & 1 == 1))
            .collect();
        for c in 0..cols {
            let q = (0..bits).fold(0u32, |acc, k| acc | (bits_of_row[c * bits + k] as u32) << k);
            let g = r * (cols / group) + c / group;
            out.push(scales[g].to_f32() * q as f32 + biases[g].to_f32());
        }
    }
    out
}

/// Tensors of a safetensors file: name -> (dtype, shape, bytes).
pub fn read_safetensors(
    path: &std::path::Path,
) -> std::collections::HashMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).expect("read safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                (
                    format!("{:?}", view.dtype()),
                    view.shape().to_vec(),
                    view.data().to_vec(),
                ),
            )
        })
        .collect()
}

pub fn as_u32(b: &[u8]) -> Vec<u32> {
    b.chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn as_f16(b: &[u8]) -> Vec<f16> {
    b.chunks(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

pub fn as_f32(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub const HIDDEN: usize = 256;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 64;
pub const FFN: usize = 256;

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("mlxcel-gguf-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Byte-level vocabulary: the 256 byte symbols, "ab", two control tokens.
pub fn vocab() -> Vec<String> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut n = 0;
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char).to_string()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap().to_string()
            }
        })
        .collect();
    tokens.extend(["ab".into(), "<|bos|>".into(), "<|eos|>".into()]);
    tokens
}

pub fn tiny_llama(rng: &mut Rng) -> GgufBuilder {
    tiny_model(rng, "llama")
}

/// A one-layer model of `arch` (`general.architecture`) with a byte-level BPE vocabulary and a
/// mix of block types: Q8_0 embedding, Q4_0/Q4_1/Q5_0/Q4_K/Q6_K/F16 projections, F32 lm_head.
pub fn tiny_model(rng: &mut Rng, arch: &str) -> GgufBuilder {
    let tokens = vocab();
    let n_vocab = tokens.len();
    let mut types = vec![Value::I32(1); n_vocab];
    types[n_vocab - 2] = Value::I32(3);
    types[n_vocab - 1] = Value::I32(3);
    let mut g = GgufBuilder::default();
    let h = HIDDEN as u64;
    g.meta("general.architecture", s(arch))
        .meta(&format!("{arch}.block_count"), Value::U32(1))
        .meta(
            &format!("{arch}.embedding_length"),
            Value::U32(HIDDEN as u32),
        )
        .meta(
            &format!("{arch}.feed_forward_length"),
            Value::U32(FFN as u32),
        )
        .meta(
            &format!("{arch}.attention.head_count"),
            Value::U32(HEADS as u32),
        )
        .meta(
            &format!("{arch}.attention.head_count_kv"),
            Value::U32(KV_HEADS as u32),
        )
        .meta(
            &format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        )
        .meta(&format!("{arch}.rope.freq_base"), Value::F32(10000.0))
        .meta(&format!("{arch}.context_length"), Value::U64(512))
        .meta("tokenizer.ggml.model", s("gpt2"))
        .meta("tokenizer.ggml.pre", s("smollm"))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        )
        .meta("tokenizer.ggml.token_type", Value::Array(types))
        .meta("tokenizer.ggml.merges", Value::Array(vec![s("a b")]))
        .meta(
            "tokenizer.ggml.bos_token_id",
            Value::U32(n_vocab as u32 - 2),
        )
        .meta(
            "tokenizer.ggml.eos_token_id",
            Value::U32(n_vocab as u32 - 1),
        )
        .meta("tokenizer.chat_template", s("{{ messages }}"));
    let norm = |rng: &mut Rng, n: usize| {
        (0..n)
            .flat_map(|_| rng.uniform(0.5, 1.5).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let f16s = |rng: &mut Rng, n: usize| {
        (0..n)
            .flat_map(|_| f16::from_f32(rng.uniform(-0.1, 0.1)).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let blocks = |rng: &mut Rng, n: usize, ty: GgmlType, fields: &[usize]| {
        random_blocks(rng, n / ty.block_size(), ty.type_size(), fields)
    };
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let t = |ty: GgmlType| ty.id();
    g.tensor(
        "token_embd.weight",
        &[h, n_vocab as u64],
        t(GgmlType::Q8_0),
        blocks(rng, HIDDEN * n_vocab, GgmlType::Q8_0, &[0]),
    )
    .tensor(
        "blk.0.attn_norm.weight",
        &[h],
        t(GgmlType::F32),
        norm(rng, HIDDEN),
    )
    .tensor(
        "blk.0.attn_q.weight",
        &[h, q as u64],
        t(GgmlType::Q4_0),
        blocks(rng, HIDDEN * q, GgmlType::Q4_0, &[0]),
    )
    .tensor(
        "blk.0.attn_k.weight",
        &[h, kv as u64],
        t(GgmlType::Q4_1),
        blocks(rng, HIDDEN * kv, GgmlType::Q4_1, &[0, 2]),
    )
    .tensor(
        "blk.0.attn_v.weight",
        &[h, kv as u64],
        t(GgmlType::F16),
        f16s(rng, HIDDEN * kv),
    )
    .tensor(
        "blk.0.attn_output.weight",
        &[q as u64, h],
        t(GgmlType::Q5_0),
        blocks(rng, HIDDEN * q, GgmlType::Q5_0, &[0]),
    )
    .tensor(
        "blk.0.ffn_norm.weight",
        &[h],
        t(GgmlType::F32),
        norm(rng, HIDDEN),
    )
    .tensor(
        "blk.0.ffn_gate.weight",
        &[h, FFN as u64],
        t(GgmlType::Q4K),
        blocks(rng, HIDDEN * FFN, GgmlType::Q4K, &[0, 2]),
    )
    .tensor(
        "blk.0.ffn_up.weight",
        &[h, FFN as u64],
        t(GgmlType::Q6K),
        blocks(rng, HIDDEN * FFN, GgmlType::Q6K, &[208]),
    )
    .tensor(
        "blk.0.ffn_down.weight",
        &[FFN as u64, h],
        t(GgmlType::F16),
        f16s(rng, HIDDEN * FFN),
    )
    .tensor(
        "output_norm.weight",
        &[h],
        t(GgmlType::F32),
        norm(rng, HIDDEN),
    )
    .tensor(
        "output.weight",
        &[h, n_vocab as u64],
        t(GgmlType::F32),
        (0..HIDDEN * n_vocab)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect(),
    );
    if arch == "gemma3" {
        // Gemma's two extra norms per block (its `ffn_norm` is the pre-MLP norm), and
        // llama.cpp's Gemma metadata: the sliding window; tied embeddings.
        for name in ["post_attention_norm", "post_ffw_norm"] {
            g.tensor(&format!("blk.0.{name}.weight"), &[h], t(GgmlType::F32), norm(rng, HIDDEN));
        }
        g.meta("gemma3.attention.sliding_window", Value::U32(4))
            .meta("gemma3.attention.key_length", Value::U32(HEAD_DIM as u32))
            .meta("gemma3.attention.value_length", Value::U32(HEAD_DIM as u32));
        g.tensors.retain(|t| t.0 != "output.weight");
    }
    if arch == "gemma2" {
        // Gemma's post-norms (no q/k norms in Gemma 2), the window and soft-caps; tied.
        for name in ["post_attention_norm", "post_ffw_norm"] {
            g.tensor(&format!("blk.0.{name}.weight"), &[h], t(GgmlType::F32), norm(rng, HIDDEN));
        }
        g.meta("gemma2.attention.sliding_window", Value::U32(4))
            .meta("gemma2.attention.key_length", Value::U32(HEAD_DIM as u32))
            .meta("gemma2.attn_logit_softcapping", Value::F32(50.0))
            .meta("gemma2.final_logit_softcapping", Value::F32(30.0));
        g.tensors.retain(|t| t.0 != "output.weight");
    }
    if arch == "olmo2" {
        // Post-norms only, and q/k norms over the whole projection.
        g.tensors.retain(|t| t.0 != "blk.0.attn_norm.weight" && t.0 != "blk.0.ffn_norm.weight");
        for (name, n) in [("post_attention_norm", HIDDEN), ("post_ffw_norm", HIDDEN), ("attn_q_norm", q), ("attn_k_norm", kv)] {
            g.tensor(&format!("blk.0.{name}.weight"), &[n as u64], t(GgmlType::F32), norm(rng, n));
        }
    }
    if arch == "phi3" {
        // q, k and v in one matrix; gate and up in one `ffn_up` of 2 * FFN rows.
        let fused = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"];
        g.tensors.retain(|t| !fused.contains(&t.0.as_str()));
        let qkv = q + 2 * kv;
        g.tensor("blk.0.attn_qkv.weight", &[h, qkv as u64], t(GgmlType::Q4_0), blocks(rng, HIDDEN * qkv, GgmlType::Q4_0, &[0]))
            .tensor("blk.0.ffn_up.weight", &[h, 2 * FFN as u64], t(GgmlType::Q8_0), blocks(rng, HIDDEN * 2 * FFN, GgmlType::Q8_0, &[0]))
            .meta("phi3.rope.dimension_count", Value::U32(HEAD_DIM as u32));
    }
    if arch == "qwen3" || arch == "gemma3" {
        let hd = HEAD_DIM as u64;
        g.tensor(
            "blk.0.attn_q_norm.weight",
            &[hd],
            t(GgmlType::F32),
            norm(rng, HEAD_DIM),
        )
        .tensor(
            "blk.0.attn_k_norm.weight",
            &[hd],
            t(GgmlType::F32),
            norm(rng, HEAD_DIM),
        );
    }
    if arch == "qwen2" {
        for (name, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
            g.tensor(
                &format!("blk.0.{name}.bias"),
                &[n as u64],
                t(GgmlType::F32),
                (0..n).flat_map(|_| rng.uniform(-0.1, 0.1).to_le_bytes()).collect(),
            );
        }
    }
    g
}

/// [`tiny_model`] with a mixture of experts for its FFN, as llama.cpp stores one: 4
/// experts, 2 per token, stacked `ffn_{gate,up,down}_exps` (f16) and an f32 router
/// `ffn_gate_inp`. `llama` is Mixtral's layout; `qwen3moe` adds q/k norms and an expert
/// width (`expert_feed_forward_length`, 128) of its own.
pub fn tiny_moe(rng: &mut Rng, arch: &str) -> GgufBuilder {
    const EXPERTS: usize = 4;
    let mut g = tiny_model(rng, arch);
    g.tensors.retain(|t| !matches!(t.0.as_str(), "blk.0.ffn_gate.weight" | "blk.0.ffn_up.weight" | "blk.0.ffn_down.weight"));
    let ffn = if arch == "qwen3moe" { 128 } else { FFN };
    g.meta(&format!("{arch}.expert_count"), Value::U32(EXPERTS as u32))
        .meta(&format!("{arch}.expert_used_count"), Value::U32(2));
    if arch == "qwen3moe" {
        g.meta("qwen3moe.expert_feed_forward_length", Value::U32(ffn as u32));
        for name in ["attn_q_norm", "attn_k_norm"] {
            let gains = (0..HEAD_DIM).flat_map(|_| rng.uniform(0.5, 1.5).to_le_bytes()).collect();
            g.tensor(&format!("blk.0.{name}.weight"), &[HEAD_DIM as u64], GgmlType::F32.id(), gains);
        }
    }
    let f16s = |rng: &mut Rng, n: usize, range: f32| -> Vec<u8> {
        (0..n).flat_map(|_| f16::from_f32(rng.uniform(-range, range)).to_le_bytes()).collect()
    };
    let (h, f, e) = (HIDDEN as u64, ffn as u64, EXPERTS as u64);
    let router = (0..HIDDEN * EXPERTS).flat_map(|_| rng.uniform(-0.5, 0.5).to_le_bytes()).collect();
    g.tensor("blk.0.ffn_gate_inp.weight", &[h, e], GgmlType::F32.id(), router);
    for (name, dims) in [("ffn_gate_exps", [h, f, e]), ("ffn_up_exps", [h, f, e]), ("ffn_down_exps", [f, h, e])] {
        let data = f16s(rng, HIDDEN * ffn * EXPERTS, 0.1);
        g.tensor(&format!("blk.0.{name}.weight"), &dims, GgmlType::F16.id(), data);
    }
    g
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}


/// llama.cpp's `rope_freqs.weight` for a llama3 `rope_scaling` (convert_hf_to_gguf.py: f32
/// rates, the rest in f64), as F32 bytes.
pub fn llama_cpp_rope_freqs(dims: usize, base: f32, factor: f64, low: f64, high: f64, old: f64) -> Vec<u8> {
    (0..dims / 2)
        .flat_map(|i| {
            let rate = 1.0 / base.powf((2 * i) as f32 / dims as f32);
            let wavelen = 2.0 * std::f64::consts::PI / rate as f64;
            let f = if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            (f as f32).to_le_bytes()
        })
        .collect()
}

/// Replaces metadata `key` (which must exist).
pub fn set_meta(g: &mut GgufBuilder, key: &str, v: Value) {
    let entry = g.metadata.iter_mut().find(|(k, _)| k == key).unwrap_or_else(|| panic!("no `{key}`"));
    entry.1 = v;
}

/// A tiny llama with Llama 3's RoPE: base 500000 and llama.cpp's `rope_freqs.weight` for
/// `factor`, low/high frequency factors 1 and 4, original context 8192.
pub fn tiny_llama3(rng: &mut Rng, factor: f64) -> GgufBuilder {
    let mut g = tiny_model(rng, "llama");
    set_meta(&mut g, "llama.rope.freq_base", Value::F32(500_000.0));
    let freqs = llama_cpp_rope_freqs(HEAD_DIM, 500_000.0, factor, 1.0, 4.0, 8192.0);
    g.tensor("rope_freqs.weight", &[HEAD_DIM as u64 / 2], GgmlType::F32.id(), freqs);
    g
}

/// A tiny Phi-3 with llama.cpp's LongRoPE factors (long 1, 1.5, 2, ...; short 1, 1.01, ...),
/// original context 128 (of 512), and `attn_factor` when given.
pub fn tiny_phi3_longrope(rng: &mut Rng, attn_factor: Option<f32>) -> GgufBuilder {
    let mut g = tiny_model(rng, "phi3");
    let half = HEAD_DIM / 2;
    let factors = |step: f32| (0..half).flat_map(|i| (1.0 + i as f32 * step).to_le_bytes()).collect::<Vec<u8>>();
    g.tensor("rope_factors_long.weight", &[half as u64], GgmlType::F32.id(), factors(0.5))
        .tensor("rope_factors_short.weight", &[half as u64], GgmlType::F32.id(), factors(0.01))
        .meta("phi3.rope.scaling.original_context_length", Value::U32(128));
    if let Some(f) = attn_factor {
        g.meta("phi3.rope.scaling.attn_factor", Value::F32(f));
    }
    g
}
