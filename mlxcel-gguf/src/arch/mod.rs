//! The architecture table: every architecture mlxcel supports, one module each.
//!
//! An architecture module declares its Hugging Face `model_type` (and aliases), its llama.cpp
//! name, its GGUF tensor names and the `config.json` keys it adds. The converter reads this
//! table, and `mlxcel-models` loads exactly [`Architecture::ALL`] (its constructor table is an
//! exhaustive `match` on [`Architecture`]), so every convertible architecture loads.

mod gemma2;
mod gemma3;
mod llama;
mod mixtral;
mod olmo2;
mod phi3;
mod qwen2;
mod qwen3;
mod qwen3_moe;

use serde_json::{json, Map, Value as Json};

use crate::error::{Error, Result};
use crate::reader::GgufFile;
use crate::rope::Llama3Scaling;

/// An architecture that mlxcel converts from GGUF and loads.
///
/// Deliberately exhaustive: adding a variant is a compile error in the loader until it
/// can build the architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Olmo2,
    Phi3,
    Mixtral,
    Qwen3Moe,
}

/// What one architecture module declares.
pub(crate) struct ArchSpec {
    /// `model_type` of `config.json`, as the loader reads it.
    model_type: &'static str,
    /// Other `model_type`s with the same checkpoint layout (loaded, never written).
    aliases: &'static [&'static str],
    /// `general.architecture` of llama.cpp's GGUF files.
    gguf_name: &'static str,
    /// `architectures[0]` of `config.json`.
    hf_class: &'static str,
    /// llama.cpp permutes the rows of Q and K (for its RoPE layout); the converter undoes it.
    permuted_qk: bool,
    /// The Hugging Face module of a GGUF block module that [`common_block_module`] lacks.
    block_module: fn(&str) -> Option<&'static str>,
    /// GGUF block modules whose `.bias` the loader reads; any other bias is refused, since
    /// the loader would drop it.
    bias_modules: &'static [&'static str],
    /// What llama.cpp added to every norm gain (Gemma's `1 +`); the converter subtracts it.
    norm_shift: f32,
    /// Adds the architecture's own `config.json` keys.
    config: fn(&GgufFile, &HParams, &mut Map<String, Json>),
}

/// `<arch>.rope.scaling.type` values the converter writes as `rope_scaling`. Llama 3's
/// scaling has no type in GGUF: llama.cpp stores its per-pair factors as [`ROPE_FREQS`].
pub const SUPPORTED_ROPE_SCALING: &[&str] = &["linear", "yarn"];

/// llama.cpp's tensor of RoPE frequency factors (Llama 3), written as a `llama3` `rope_scaling`.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// llama.cpp's LongRoPE factors (Phi-3's long-context models), written as a `longrope`
/// `rope_scaling` with `long_factor` and `short_factor`.
pub const ROPE_FACTORS: [&str; 2] = ["rope_factors_long.weight", "rope_factors_short.weight"];

impl Architecture {
    /// Llama before Mixtral: a `llama` GGUF file is Mixtral only when it has experts.
    pub const ALL: [Architecture; 9] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Olmo2,
        Architecture::Phi3,
        Architecture::Mixtral,
        Architecture::Qwen3Moe,
    ];

    fn spec(self) -> &'static ArchSpec {
        match self {
            Architecture::Llama => &llama::SPEC,
            Architecture::Qwen2 => &qwen2::SPEC,
            Architecture::Qwen3 => &qwen3::SPEC,
            Architecture::Gemma2 => &gemma2::SPEC,
            Architecture::Gemma3 => &gemma3::SPEC,
            Architecture::Olmo2 => &olmo2::SPEC,
            Architecture::Phi3 => &phi3::SPEC,
            Architecture::Mixtral => &mixtral::SPEC,
            Architecture::Qwen3Moe => &qwen3_moe::SPEC,
        }
    }

    /// The `model_type` written to `config.json`.
    pub fn model_type(self) -> &'static str {
        self.spec().model_type
    }

    /// Other `model_type`s loaded as this architecture.
    pub fn aliases(self) -> &'static [&'static str] {
        self.spec().aliases
    }

    /// `general.architecture` in GGUF files.
    pub fn gguf_name(self) -> &'static str {
        self.spec().gguf_name
    }

    /// The Hugging Face class name (`architectures` in `config.json`).
    pub fn hf_class(self) -> &'static str {
        self.spec().hf_class
    }

    /// The architecture of a `config.json` `model_type`, aliases included.
    pub fn from_model_type(model_type: &str) -> Option<Architecture> {
        Self::ALL
            .into_iter()
            .find(|a| a.model_type() == model_type || a.aliases().contains(&model_type))
    }

    /// The architecture of a GGUF `general.architecture`.
    pub fn from_gguf_name(name: &str) -> Option<Architecture> {
        Self::ALL.into_iter().find(|a| a.gguf_name() == name)
    }

    /// Every loadable `model_type`: the architectures' own, then the aliases.
    pub fn model_types() -> Vec<&'static str> {
        let aliases = Self::ALL.iter().flat_map(|a| a.aliases().iter().copied());
        Self::ALL.iter().map(|a| a.model_type()).chain(aliases).collect()
    }

    /// Every convertible `general.architecture` (for error messages).
    pub fn gguf_names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Vec::new();
        for name in Self::ALL.iter().map(|a| a.gguf_name()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The architecture of a GGUF file; an unsupported one is an error that lists the supported.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Architecture> {
        let name = gguf.get_str("general.architecture").ok_or_else(|| {
            Error::invalid_file(&gguf.path, "missing metadata `general.architecture`")
        })?;
        if name == "llama" && gguf.get_u64("llama.expert_count").is_some_and(|n| n > 0) {
            return Ok(Architecture::Mixtral);
        }
        Architecture::from_gguf_name(name).ok_or_else(|| Error::Unsupported {
            path: gguf.path.clone(),
            message: format!(
                "architecture `{name}` (mlxcel converts and loads: {})",
                Architecture::gguf_names().join(", ")
            ),
        })
    }

    /// What llama.cpp added to this architecture's norm gains, subtracted on conversion.
    pub fn norm_shift(self) -> f32 {
        self.spec().norm_shift
    }

    /// llama.cpp permutes the rows of Q and K of this architecture.
    pub fn permuted_qk(self) -> bool {
        self.spec().permuted_qk
    }

    /// GGUF block modules (`attn_q`, ...) that may carry a `.bias` in this architecture.
    pub fn bias_modules(self) -> &'static [&'static str] {
        self.spec().bias_modules
    }

    /// A GGUF block bias (`blk.N.<module>.bias`) the loader would not read: an error naming
    /// the tensor and the biases this architecture has.
    pub fn check_bias(self, gguf: &GgufFile, gguf_name: &str) -> Result<()> {
        let module = gguf_name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(_, rest)| rest.strip_suffix(".bias"));
        match module {
            Some(module) if !self.bias_modules().contains(&module) => Err(Error::Unsupported {
                path: gguf.path.clone(),
                message: format!(
                    "tensor `{gguf_name}`: {} has no bias on `{module}` (biases it has: {})",
                    self.gguf_name(),
                    match self.bias_modules() {
                        [] => "none".to_string(),
                        some => some.join(", "),
                    }
                ),
            }),
            _ => Ok(()),
        }
    }

    /// The Hugging Face name of a GGUF tensor, `None` for tensors this architecture lacks.
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
        // The architecture's own names first: Gemma's `ffn_norm` is not llama's.
        let hf_module = (self.spec().block_module)(module).or_else(|| common_block_module(module))?;
        Some(format!("model.layers.{layer}.{hf_module}.{param}"))
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// Block modules every supported architecture has, GGUF name → Hugging Face name.
fn common_block_module(module: &str) -> Option<&'static str> {
    Some(match module {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        _ => return None,
    })
}

/// The q and k norms (per head in Qwen3 and Gemma 3, over the whole projection in OLMo 2).
fn qk_norm_module(module: &str) -> Option<&'static str> {
    match module {
        "attn_q_norm" => Some("self_attn.q_norm"),
        "attn_k_norm" => Some("self_attn.k_norm"),
        _ => None,
    }
}

/// Gemma's block norms (2 and 3): its `ffn_norm` is the MLP's input norm, and the attention
/// and MLP outputs have norms of their own.
fn gemma_block_module(module: &str) -> Option<&'static str> {
    match module {
        "post_attention_norm" => Some("post_attention_layernorm"),
        "ffn_norm" => Some("pre_feedforward_layernorm"),
        "post_ffw_norm" => Some("post_feedforward_layernorm"),
        _ => None,
    }
}

/// Gemma's `query_pre_attn_scalar`: from `<arch>.attention.scale` when set, else `default`
/// (llama.cpp's rule for the model); an integer when whole, as Hugging Face's config class
/// wants (transformers refuses 256.0).
fn query_pre_attn_scalar(gguf: &GgufFile, hp: &HParams, default: u64) -> Json {
    let scalar = match gguf.get_f64(&format!("{}.attention.scale", hp.name)) {
        Some(scale) if scale > 0.0 => 1.0 / (scale * scale),
        _ => default as f64,
    };
    if scalar.fract() == 0.0 {
        Json::from(scalar as u64)
    } else {
        f32_json(scalar)
    }
}

/// `<arch>.expert_count`, `<arch>.expert_used_count` and the expert FFN width
/// (`<arch>.expert_feed_forward_length`, else `feed_forward_length`) of an MoE file;
/// `HParams::from_gguf` checked that they are present.
fn expert_config(gguf: &GgufFile, hp: &HParams) -> (u64, u64, u64) {
    let key = |k: &str| gguf.get_u64(&format!("{}.{k}", hp.name));
    (
        key("expert_count").unwrap_or(0),
        key("expert_used_count").unwrap_or(0),
        key("expert_feed_forward_length").unwrap_or(hp.intermediate_size),
    )
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

/// Model hyper-parameters read from `<arch>.*` metadata.
#[derive(Debug, Clone)]
pub struct HParams {
    pub arch: Architecture,
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
    /// `rope_scaling` for `config.json`: one of [`SUPPORTED_ROPE_SCALING`], or `llama3`
    /// recovered from [`ROPE_FREQS`].
    pub rope_scaling: Option<Json>,
}

impl HParams {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch = Architecture::from_gguf(gguf)?;
        let name = arch.gguf_name();
        let key = |k: &str| format!("{name}.{k}");
        let req = |k: &str| {
            gguf.get_u64(&key(k)).ok_or_else(|| {
                Error::invalid_file(&gguf.path, format!("missing metadata `{}`", key(k)))
            })
        };
        let hidden_size = req("embedding_length")?;
        if matches!(arch, Architecture::Mixtral | Architecture::Qwen3Moe) {
            req("expert_count")?;
            req("expert_used_count")?;
        }
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
        let head_dim = gguf
            .get_u64(&key("attention.key_length"))
            .unwrap_or(hidden_size / num_heads);
        let rope_theta = gguf.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0);
        let rope_scaling = match rope_scaling(gguf, name)? {
            Some(scaling) => {
                if gguf.tensor(ROPE_FREQS).is_some() {
                    return Err(Error::Unsupported {
                        path: gguf.path.clone(),
                        message: format!(
                            "both `{name}.rope.scaling.type` and `{ROPE_FREQS}` (mlxcel runs one RoPE scaling at a time)"
                        ),
                    });
                }
                Some(scaling)
            }
            None => llama3_rope_scaling(gguf, head_dim, rope_theta)?,
        };
        let rope_scaling = match longrope_scaling(gguf, arch, head_dim)? {
            Some(_) if rope_scaling.is_some() => {
                return Err(Error::Unsupported {
                    path: gguf.path.clone(),
                    message: format!(
                        "both LongRoPE factors ({}) and another RoPE scaling (mlxcel runs one at a time)",
                        ROPE_FACTORS.join(", ")
                    ),
                })
            }
            Some(longrope) => Some(longrope),
            None => rope_scaling,
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
            head_dim,
            rms_norm_eps: gguf
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6),
            rope_theta,
            max_position_embeddings: gguf.get_u64(&key("context_length")).unwrap_or(2048),
            vocab_size,
            tied_embeddings: gguf.tensor("output.weight").is_none(),
            rope_scaling,
            name: name.to_string(),
        })
    }

    /// `config.json` in Hugging Face / mlx-lm form (without `quantization`).
    pub fn config_json(&self, gguf: &GgufFile, bos: Option<u64>, eos: &[u64]) -> Json {
        let mut c = json!({
            "model_type": self.arch.model_type(),
            "architectures": [self.arch.hf_class()],
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
        (self.arch.spec().config)(gguf, self, obj);
        if let Some(scaling) = &self.rope_scaling {
            obj.insert("rope_scaling".into(), scaling.clone());
        }
        c
    }
}

/// `rope_scaling` from `<arch>.rope.scaling.*`; a kind the loader cannot run is an error.
fn rope_scaling(gguf: &GgufFile, arch: &str) -> Result<Option<Json>> {
    let type_key = format!("{arch}.rope.scaling.type");
    let Some(kind) = gguf.get_str(&type_key) else {
        return Ok(None);
    };
    let factor = gguf.get_f64(&format!("{arch}.rope.scaling.factor"));
    if kind == "none" || factor == Some(1.0) {
        return Ok(None);
    }
    if !SUPPORTED_ROPE_SCALING.contains(&kind) {
        return Err(Error::Unsupported {
            path: gguf.path.clone(),
            message: format!(
                "RoPE scaling `{kind}` (`{type_key}`; mlxcel converts and loads: {})",
                SUPPORTED_ROPE_SCALING.join(", ")
            ),
        });
    }
    let factor = factor.ok_or_else(|| {
        Error::invalid_file(
            &gguf.path,
            format!("`{type_key}` is `{kind}` but `{arch}.rope.scaling.factor` is missing"),
        )
    })?;
    let mut m = Map::new();
    // `rope_type` only: mlx-lm reads either name, and the loader refuses both at once.
    m.insert("rope_type".into(), kind.into());
    m.insert("factor".into(), f32_json(factor));
    if let Some(orig) = gguf.get_u64(&format!("{arch}.rope.scaling.original_context_length")) {
        m.insert("original_max_position_embeddings".into(), orig.into());
    }
    if kind == "yarn" {
        for (key, name) in [("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")] {
            if let Some(v) = gguf.get_f64(&format!("{arch}.rope.scaling.{key}")) {
                m.insert(name.into(), f32_json(v));
            }
        }
        // llama.cpp's own attention-factor overrides have no mlx-lm counterpart: refused
        // unless they are its defaults.
        for (key, default) in [("attn_factor", 1.0), ("yarn_log_multiplier", 0.1)] {
            let full = format!("{arch}.rope.scaling.{key}");
            if let Some(v) = gguf.get_f64(&full).filter(|v| (v - default).abs() > 1e-6) {
                return Err(Error::Unsupported {
                    path: gguf.path.clone(),
                    message: format!("yarn RoPE with `{full}` = {v} (mlxcel computes mlx-lm's YaRN: {key} {default})"),
                });
            }
        }
    }
    Ok(Some(Json::Object(m)))
}

/// A `llama3` `rope_scaling` whose per-pair factors (computed as the loader computes them)
/// equal llama.cpp's [`ROPE_FREQS`] tensor; none without the tensor or when it is all ones.
/// Factors no llama3 schedule reproduces are refused: the model would run with the wrong RoPE.
fn llama3_rope_scaling(gguf: &GgufFile, head_dim: u64, rope_theta: f64) -> Result<Option<Json>> {
    let Some(info) = gguf.tensor(ROPE_FREQS) else {
        return Ok(None);
    };
    let pairs = head_dim as usize / 2;
    let refuse = |why: String| Error::Unsupported {
        path: gguf.path.clone(),
        message: format!(
            "tensor `{ROPE_FREQS}` {why} (mlxcel converts RoPE frequency factors only when they are \
             a llama3 schedule: `rope_scaling` {{factor, low_freq_factor, high_freq_factor, \
             original_max_position_embeddings}} for head_dim {head_dim}, rope_theta {rope_theta})"
        ),
    };
    let factors = float_vector(gguf, info, pairs).map_err(refuse)?;
    if factors.iter().all(|&f| f == 1.0) {
        return Ok(None);
    }
    let s = Llama3Scaling::from_factors(&factors, head_dim as usize, rope_theta as f32)
        .ok_or_else(|| refuse("holds factors that no llama3 RoPE scaling reproduces".into()))?;
    Ok(Some(json!({
        "rope_type": "llama3",
        "factor": f32_json(s.factor as f64),
        "low_freq_factor": f32_json(s.low_freq_factor as f64),
        "high_freq_factor": f32_json(s.high_freq_factor as f64),
        "original_max_position_embeddings": s.original_max_position_embeddings as u64,
    })))
}

/// The `len` floats of a 1-D tensor, or why not (another shape, a type the converter cannot
/// decode).
fn float_vector(gguf: &GgufFile, info: &crate::reader::TensorInfo, len: usize) -> std::result::Result<Vec<f32>, String> {
    if info.dims != [len as u64] || !crate::dequant::can_dequantize(info.ggml_type) {
        return Err(format!(
            "has shape {:?} and type {} where [{len}] floats are expected",
            info.dims, info.ggml_type
        ));
    }
    let mut values = vec![0f32; len];
    crate::dequant::dequantize(info.ggml_type, gguf.tensor_data(info), &mut values)
        .ok_or_else(|| "holds data that cannot be decoded".to_string())?;
    Ok(values)
}

/// A `longrope` `rope_scaling` from llama.cpp's [`ROPE_FACTORS`] (Phi-3 only; none without
/// them). mlx-lm's phi3 derives the attention factor from `max_position_embeddings /
/// original_max_position_embeddings`; a `rope.scaling.attn_factor` that differs is refused.
fn longrope_scaling(gguf: &GgufFile, arch: Architecture, head_dim: u64) -> Result<Option<Json>> {
    let [long, short] = ROPE_FACTORS.map(|name| gguf.tensor(name));
    if long.is_none() && short.is_none() {
        return Ok(None);
    }
    let name = arch.gguf_name();
    let refuse = |why: String| Error::Unsupported { path: gguf.path.clone(), message: why };
    if arch != Architecture::Phi3 {
        return Err(refuse(format!("LongRoPE factors in a `{name}` file (mlxcel converts them for phi3)")));
    }
    let (Some(long), Some(short)) = (long, short) else {
        return Err(Error::invalid_file(&gguf.path, format!("only one of {} is present", ROPE_FACTORS.join(", "))));
    };
    let rope_dims = gguf.get_u64(&format!("{name}.rope.dimension_count")).unwrap_or(head_dim);
    let read = |info| {
        float_vector(gguf, info, rope_dims as usize / 2).map_err(|why| refuse(format!("tensor `{}` {why}", info.name)))
    };
    let (long, short) = (read(long)?, read(short)?);
    let context = gguf.get_u64(&format!("{name}.context_length")).unwrap_or(2048) as f64;
    let original_key = format!("{name}.rope.scaling.original_context_length");
    let original = gguf.get_u64(&original_key).ok_or_else(|| {
        Error::invalid_file(&gguf.path, format!("LongRoPE factors without `{original_key}`"))
    })? as f64;
    let factor = context / original;
    let derived = if factor <= 1.0 { 1.0 } else { (1.0 + factor.ln() / original.ln()).sqrt() };
    let attn_key = format!("{name}.rope.scaling.attn_factor");
    if let Some(stated) = gguf.get_f64(&attn_key).filter(|v| (v - derived).abs() > 1e-4 * derived) {
        return Err(refuse(format!(
            "`{attn_key}` = {stated} (mlx-lm's phi3 derives {derived} from the context lengths)"
        )));
    }
    let list = |v: &[f32]| Json::from(v.iter().map(|&f| f32_json(f as f64)).collect::<Vec<_>>());
    // `type`, not `rope_type`: mlx-lm's phi3 requires that key.
    Ok(Some(json!({"type": "longrope", "long_factor": list(&long), "short_factor": list(&short)})))
}

/// Whether any tensor's name ends with `suffix` (e.g. `attn_q.bias`).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for arch in Architecture::ALL {
            assert_eq!(Architecture::from_model_type(arch.model_type()), Some(arch));
            // Mixtral shares llama.cpp's `llama` (told apart by its experts).
            let by_gguf = Architecture::from_gguf_name(arch.gguf_name()).unwrap();
            assert!(by_gguf == arch || (arch, by_gguf) == (Architecture::Mixtral, Architecture::Llama));
            for name in std::iter::once(arch.model_type()).chain(arch.aliases().iter().copied()) {
                assert!(seen.insert(name), "model_type `{name}` is claimed twice");
            }
        }
        assert_eq!(Architecture::from_model_type("mistral"), Some(Architecture::Llama));
        assert_eq!(Architecture::from_gguf_name("gemma3"), Some(Architecture::Gemma3));
        assert_eq!(Architecture::from_model_type("gemma3"), Some(Architecture::Gemma3));
        assert_eq!(Architecture::from_gguf_name("phi3"), Some(Architecture::Phi3));
        assert_eq!(Architecture::from_gguf_name("starcoder2"), None);
    }

    #[test]
    fn block_names_follow_each_architecture() {
        let q_norm = "blk.3.attn_q_norm.weight";
        assert_eq!(
            Architecture::Qwen3.hf_name(q_norm).as_deref(),
            Some("model.layers.3.self_attn.q_norm.weight")
        );
        assert_eq!(Architecture::Llama.hf_name(q_norm), None);
        assert_eq!(Architecture::Qwen2.hf_name(q_norm), None);
        assert_eq!(
            Architecture::Qwen2.hf_name("blk.0.attn_k.bias").as_deref(),
            Some("model.layers.0.self_attn.k_proj.bias")
        );
        assert_eq!(Architecture::Llama.hf_name("blk.x.attn_q.weight"), None);
        // Gemma's `ffn_norm` is the MLP's input norm; its post-norms are its own.
        assert_eq!(
            Architecture::Gemma3.hf_name("blk.2.ffn_norm.weight").as_deref(),
            Some("model.layers.2.pre_feedforward_layernorm.weight")
        );
        assert_eq!(
            Architecture::Gemma3.hf_name("blk.2.post_attention_norm.weight").as_deref(),
            Some("model.layers.2.post_attention_layernorm.weight")
        );
        assert_eq!(
            Architecture::Llama.hf_name("blk.2.ffn_norm.weight").as_deref(),
            Some("model.layers.2.post_attention_layernorm.weight")
        );
        assert_eq!(Architecture::Llama.hf_name("blk.2.post_ffw_norm.weight"), None);
        // Stacked experts and routers.
        assert_eq!(
            Architecture::Qwen3Moe.hf_name("blk.1.ffn_up_exps.weight").as_deref(),
            Some("model.layers.1.mlp.switch_mlp.up_proj.weight")
        );
        assert_eq!(
            Architecture::Mixtral.hf_name("blk.1.ffn_gate_inp.weight").as_deref(),
            Some("model.layers.1.block_sparse_moe.gate.weight")
        );
        assert_eq!(Architecture::Llama.hf_name("blk.1.ffn_gate_exps.weight"), None);
    }
}
