//! Per-architecture facts: Hugging Face names of tensors and `config.json`.

use serde_json::{json, Map, Value as Json};

use super::reader::GgufFile;
use crate::error::{Error, Result};

/// Architectures (`general.architecture`) the converter knows.
pub const SUPPORTED: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

/// Model hyper-parameters read from `<arch>.*` metadata.
#[derive(Debug, Clone)]
pub struct HParams {
    pub arch: Arch,
    /// `general.architecture`, the prefix of the metadata keys.
    pub name: String,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: u64,
    pub vocab_size: u64,
    pub tied_embeddings: bool,
}

impl Arch {
    pub fn from_gguf(gguf: &GgufFile) -> Result<(Arch, String)> {
        let name = gguf.get_str("general.architecture").ok_or_else(|| {
            Error::invalid_file(&gguf.path, "missing metadata `general.architecture`")
        })?;
        let arch = match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            other => {
                return Err(Error::Unsupported {
                    path: gguf.path.clone(),
                    message: format!(
                        "architecture `{other}` (the GGUF converter supports: {})",
                        SUPPORTED.join(", ")
                    ),
                })
            }
        };
        Ok((arch, name.to_string()))
    }

    /// llama.cpp permutes the rows of Q and K of llama-family checkpoints (for its RoPE layout).
    pub fn permuted_qk(self) -> bool {
        self == Arch::Llama
    }

    /// Gemma stores RMSNorm gains as `1 + w`; llama.cpp's GGUF holds `1 + w`, HF holds `w`.
    pub fn norm_offset(self) -> f32 {
        if self == Arch::Gemma3 {
            1.0
        } else {
            0.0
        }
    }

    /// The Hugging Face name of a GGUF tensor, `None` for tensors with no HF counterpart.
    pub fn hf_name(self, gguf_name: &str) -> Option<String> {
        let global = match gguf_name {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            "output.weight" => Some("lm_head.weight"),
            _ => None,
        };
        if let Some(name) = global {
            return Some(name.to_string());
        }
        let rest = gguf_name.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        layer.parse::<u32>().ok()?;
        let (module, param) = rest.rsplit_once('.')?;
        let hf_module = match (module, self) {
            ("attn_q", _) => "self_attn.q_proj",
            ("attn_k", _) => "self_attn.k_proj",
            ("attn_v", _) => "self_attn.v_proj",
            ("attn_output", _) => "self_attn.o_proj",
            ("attn_q_norm", _) => "self_attn.q_norm",
            ("attn_k_norm", _) => "self_attn.k_norm",
            ("ffn_gate", _) => "mlp.gate_proj",
            ("ffn_up", _) => "mlp.up_proj",
            ("ffn_down", _) => "mlp.down_proj",
            ("attn_norm", _) => "input_layernorm",
            ("ffn_norm", Arch::Gemma3) => "pre_feedforward_layernorm",
            ("ffn_norm", _) => "post_attention_layernorm",
            ("post_attention_norm", Arch::Gemma3) => "post_attention_layernorm",
            ("post_ffw_norm", Arch::Gemma3) => "post_feedforward_layernorm",
            _ => return None,
        };
        Some(format!("model.layers.{layer}.{hf_module}.{param}"))
    }
}

/// Whether a HF tensor name is a normalization gain.
pub fn is_norm(hf_name: &str) -> bool {
    hf_name.ends_with("norm.weight")
}

/// Whether a HF tensor is a weight mlx-lm would quantize (linear layers and the embedding).
pub fn is_quantizable(hf_name: &str, ndim: usize) -> bool {
    ndim == 2
        && (hf_name.ends_with("_proj.weight")
            || hf_name == "model.embed_tokens.weight"
            || hf_name == "lm_head.weight")
}

impl HParams {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let (arch, name) = Arch::from_gguf(gguf)?;
        let key = |k: &str| format!("{name}.{k}");
        let req = |k: &str| {
            gguf.get_u64(&key(k)).ok_or_else(|| {
                Error::invalid_file(&gguf.path, format!("missing metadata `{}`", key(k)))
            })
        };
        let hidden_size = req("embedding_length")?;
        let num_heads = req("attention.head_count")?;
        if num_heads == 0 {
            return Err(Error::invalid_file(
                &gguf.path,
                format!("`{}` is 0", key("attention.head_count")),
            ));
        }
        let vocab_size = match gguf.get_u64(&key("vocab_size")) {
            Some(v) => v,
            None => match (
                gguf.get_array("tokenizer.ggml.tokens"),
                gguf.tensor("token_embd.weight"),
            ) {
                (Some(tokens), _) => tokens.len() as u64,
                (None, Some(t)) => t.dims.get(1).copied().unwrap_or(0),
                _ => {
                    return Err(Error::invalid_file(
                        &gguf.path,
                        "cannot tell the vocabulary size",
                    ))
                }
            },
        };
        Ok(HParams {
            arch,
            hidden_size,
            intermediate_size: req("feed_forward_length")?,
            num_layers: req("block_count")?,
            num_heads,
            num_kv_heads: gguf
                .get_u64(&key("attention.head_count_kv"))
                .unwrap_or(num_heads),
            head_dim: gguf
                .get_u64(&key("attention.key_length"))
                .unwrap_or(hidden_size / num_heads),
            rms_norm_eps: gguf
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            rope_theta: gguf.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
            max_position_embeddings: gguf.get_u64(&key("context_length")).unwrap_or(2048),
            vocab_size,
            tied_embeddings: gguf.tensor("output.weight").is_none(),
            name,
        })
    }

    /// `config.json` in Hugging Face / mlx-lm form (without `quantization`).
    pub fn config_json(&self, gguf: &GgufFile, bos: Option<u64>, eos: &[u64]) -> Json {
        let (model_type, class) = match self.arch {
            Arch::Llama => ("llama", "LlamaForCausalLM"),
            Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            Arch::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
        };
        let mut c = json!({
            "model_type": model_type,
            "architectures": [class],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": f32_json(self.rms_norm_eps),
            "rope_theta": f32_json(self.rope_theta),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tied_embeddings,
            "torch_dtype": "float16",
        });
        let obj = c.as_object_mut().expect("object literal");
        if let Some(bos) = bos {
            obj.insert("bos_token_id".into(), bos.into());
        }
        if let Some(eos_json) = ids_json(eos) {
            obj.insert("eos_token_id".into(), eos_json);
        }
        match self.arch {
            Arch::Llama => {
                obj.insert("hidden_act".into(), "silu".into());
                obj.insert(
                    "attention_bias".into(),
                    has_tensor(gguf, "attn_q.bias").into(),
                );
                obj.insert("mlp_bias".into(), false.into());
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                obj.insert("hidden_act".into(), "silu".into());
                if self.arch == Arch::Qwen3 {
                    obj.insert(
                        "attention_bias".into(),
                        has_tensor(gguf, "attn_q.bias").into(),
                    );
                }
            }
            Arch::Gemma3 => {
                let key = |k: &str| format!("{}.{k}", self.name);
                obj.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
                obj.insert("query_pre_attn_scalar".into(), self.head_dim.into());
                obj.insert(
                    "sliding_window".into(),
                    gguf.get_u64(&key("attention.sliding_window"))
                        .unwrap_or(512)
                        .into(),
                );
                obj.insert("sliding_window_pattern".into(), 6.into());
                let local_base = gguf.get_f64(&key("rope.freq_base_swa")).unwrap_or(10_000.0);
                obj.insert("rope_local_base_freq".into(), f32_json(local_base));
                obj.insert("final_logit_softcapping".into(), Json::Null);
                obj.insert("attn_logit_softcapping".into(), Json::Null);
            }
        }
        if let Some(scaling) = rope_scaling(gguf, &self.name) {
            obj.insert("rope_scaling".into(), scaling);
        }
        c
    }
}

/// `rope_scaling` from `<arch>.rope.scaling.*` (linear and yarn), if present.
fn rope_scaling(gguf: &GgufFile, arch: &str) -> Option<Json> {
    let kind = gguf.get_str(&format!("{arch}.rope.scaling.type"))?;
    let factor = gguf.get_f64(&format!("{arch}.rope.scaling.factor"))?;
    if kind == "none" || factor == 1.0 {
        return None;
    }
    let mut m = Map::new();
    m.insert("rope_type".into(), kind.into());
    m.insert("type".into(), kind.into());
    m.insert("factor".into(), f32_json(factor));
    if let Some(orig) = gguf.get_u64(&format!("{arch}.rope.scaling.original_context_length")) {
        m.insert("original_max_position_embeddings".into(), orig.into());
    }
    Some(Json::Object(m))
}

fn has_tensor(gguf: &GgufFile, suffix: &str) -> bool {
    gguf.tensors.iter().any(|t| t.name.ends_with(suffix))
}

/// One id as a number, several as a list (Hugging Face's convention).
pub fn ids_json(ids: &[u64]) -> Option<Json> {
    match ids {
        [] => None,
        [one] => Some((*one).into()),
        many => Some(many.into()),
    }
}

/// GGUF stores these as `f32`: print the shortest decimal that round-trips to the same `f32`
/// (`1e-5`, not `9.999999747378752e-06`).
fn f32_json(v: f64) -> Json {
    let short: f64 = (v as f32).to_string().parse().unwrap_or(v);
    Json::from(short)
}
