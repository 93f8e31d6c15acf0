//! Gemma 3 (text), as mlx-lm's `gemma3_text`: local layers attend over a
//! sliding window with their own RoPE base and every `sliding_window_pattern`-th
//! layer is global; each block norms its attention and MLP outputs as well as
//! their inputs; the norms scale by `1 + weight`; q and k are normed per head;
//! the scores are scaled by `query_pre_attn_scalar ^ -0.5`; the MLP gate is
//! GELU (tanh); the embeddings are scaled by `sqrt(hidden)` rounded to bfloat16.
//!
//! `model_type: gemma3` (the multimodal checkpoints) loads the language model
//! from `text_config` and the `language_model.` weights; the vision tower and
//! projector are a stated skip ([`SKIPPED_MULTIMODAL`]).

use mlx_sys::{Array, Dtype};
use serde::Deserialize;

use super::decoder::{check_sizes, parse_args};
use super::transformer::{each_sequence_alone, Block, Transformer};
use super::LoadContext;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::{LanguageModel, ModelShape};
use crate::nn::{
    Activation, Attention, AttentionSpec, Embedding, FusedBlock, FusedParts, GatedMlp, Linear, RmsNorm, Rope, RopeScaling,
    fused_takes, RowKernels,
};
use crate::weights::Scope;

/// Weight prefixes of a multimodal `gemma3` checkpoint that the text model
/// does not read (as mlx-lm's `gemma3.Model.sanitize` drops them).
pub const SKIPPED_MULTIMODAL: &[&str] = &["vision_tower.", "multi_modal_projector."];

/// `config.json` of `gemma3_text` (mlx-lm's defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma3Args {
    #[serde(default = "defaults::hidden_size")]
    pub hidden_size: i32,
    #[serde(default = "defaults::num_hidden_layers")]
    pub num_hidden_layers: i32,
    #[serde(default = "defaults::intermediate_size")]
    pub intermediate_size: i32,
    #[serde(default = "defaults::num_attention_heads")]
    pub num_attention_heads: i32,
    #[serde(default = "defaults::head_dim")]
    pub head_dim: i32,
    #[serde(default = "defaults::rms_norm_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "defaults::vocab_size")]
    pub vocab_size: i32,
    #[serde(default = "defaults::num_key_value_heads")]
    pub num_key_value_heads: i32,
    #[serde(default = "defaults::rope_theta")]
    pub rope_theta: f32,
    #[serde(default = "defaults::rope_local_base_freq")]
    pub rope_local_base_freq: f32,
    #[serde(default = "defaults::query_pre_attn_scalar")]
    pub query_pre_attn_scalar: f32,
    #[serde(default = "defaults::sliding_window")]
    pub sliding_window: i32,
    #[serde(default = "defaults::sliding_window_pattern")]
    pub sliding_window_pattern: i32,
    pub max_position_embeddings: Option<i32>,
    pub rope_scaling: Option<RopeScaling>,
    /// Hugging Face's name for the MLP activation (`hidden_act` in older configs).
    #[serde(alias = "hidden_act")]
    pub hidden_activation: Option<String>,
    pub final_logit_softcapping: Option<f32>,
    pub attn_logit_softcapping: Option<f32>,
    pub tie_word_embeddings: Option<bool>,
}

mod defaults {
    pub fn hidden_size() -> i32 { 1152 }
    pub fn num_hidden_layers() -> i32 { 26 }
    pub fn intermediate_size() -> i32 { 6912 }
    pub fn num_attention_heads() -> i32 { 4 }
    pub fn head_dim() -> i32 { 256 }
    pub fn rms_norm_eps() -> f32 { 1e-6 }
    pub fn vocab_size() -> i32 { 262_144 }
    pub fn num_key_value_heads() -> i32 { 1 }
    pub fn rope_theta() -> f32 { 1_000_000.0 }
    pub fn rope_local_base_freq() -> f32 { 10_000.0 }
    pub fn query_pre_attn_scalar() -> f32 { 256.0 }
    pub fn sliding_window() -> i32 { 512 }
    pub fn sliding_window_pattern() -> i32 { 6 }
}

impl Gemma3Args {
    fn validate(&self) -> std::result::Result<(), String> {
        check_sizes(&[
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("sliding_window", self.sliding_window),
            ("sliding_window_pattern", self.sliding_window_pattern),
        ])?;
        if self.query_pre_attn_scalar <= 0.0 {
            return Err(format!("`query_pre_attn_scalar` must be positive, got {}", self.query_pre_attn_scalar));
        }
        Ok(())
    }

    /// What mlx-lm's gemma3_text does not compute: refused, not ignored.
    fn unsupported(&self) -> Option<String> {
        if let Some(message) = gelu_tanh_only("gemma3", self.hidden_activation.as_deref()) {
            return Some(message);
        }
        if let Some(cap) = self.final_logit_softcapping {
            return Some(format!("final_logit_softcapping {cap} (supported: null)"));
        }
        if let Some(cap) = self.attn_logit_softcapping {
            return Some(format!("attn_logit_softcapping {cap} (supported: null)"));
        }
        None
    }

    /// Layer `i` is global (full attention, the global RoPE base).
    pub fn is_global(&self, i: i32) -> bool {
        i % self.sliding_window_pattern == self.sliding_window_pattern - 1
    }
}

/// A Gemma `hidden_activation` other than the GELU (tanh) the block computes,
/// as the reason to refuse the config.
pub(super) fn gelu_tanh_only(family: &str, activation: Option<&str>) -> Option<String> {
    let act = activation.filter(|a| *a != "gelu_pytorch_tanh")?;
    Some(format!("hidden_activation `{act}` ({family} computes gelu_pytorch_tanh)"))
}

/// One Gemma block (2 and 3): pre- and post-norms around attention and the
/// MLP.
pub struct GemmaBlock {
    pub(super) input_layernorm: RmsNorm,
    pub(super) self_attn: Attention,
    pub(super) post_attention_layernorm: RmsNorm,
    pub(super) pre_feedforward_layernorm: RmsNorm,
    pub(super) mlp: GatedMlp,
    pub(super) post_feedforward_layernorm: RmsNorm,
    /// Residual sums kept within float16's range (Gemma 3's `clip_residual`;
    /// mlx-lm's Gemma 2 adds plainly).
    pub(super) clip_residuals: bool,
    /// The block as one kernel node for decode and short prompts (quantized
    /// projections on the CPU), as the llama family's.
    pub(super) fused: Option<FusedBlock>,
}

/// `x + y`, kept within float16's range when the activations are float16
/// (mlx-lm's `clip_residual`).
fn clipped_residual(x: &Array, y: &Array) -> Result<Array> {
    if x.dtype() != Dtype::Float16 {
        return Ok(x.add(y)?);
    }
    let bound = 65504.0;
    let sum = x.astype(Dtype::Float32)?.add(&y.astype(Dtype::Float32)?)?;
    let clipped = sum.minimum(&Array::scalar(bound, Dtype::Float32)?)?.maximum(&Array::scalar(-bound, Dtype::Float32)?)?;
    Ok(clipped.astype(Dtype::Float16)?)
}

impl GemmaBlock {
    /// The block's four norms, attention and GELU (tanh) MLP from `layer`,
    /// its norms' gains `1 + weight`.
    pub fn load(layer: &Scope, spec: AttentionSpec, rope: Rope, intermediate: i32, eps: f32, clip_residuals: bool) -> Result<Self> {
        let hidden = spec.hidden;
        let norm = |name: &str| RmsNorm::load_with_offset(&layer.pp(name), hidden, eps, 1.0);
        let mut block = GemmaBlock {
            input_layernorm: norm("input_layernorm")?,
            self_attn: Attention::load(&layer.pp("self_attn"), spec, rope)?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            pre_feedforward_layernorm: norm("pre_feedforward_layernorm")?,
            mlp: GatedMlp::load_with(&layer.pp("mlp"), hidden, intermediate, false, Activation::GeluTanh)?,
            post_feedforward_layernorm: norm("post_feedforward_layernorm")?,
            clip_residuals,
            fused: None,
        };
        block.fused = FusedBlock::new(FusedParts {
            input_norm: &block.input_layernorm,
            attn: &block.self_attn,
            mlp_norm: &block.pre_feedforward_layernorm,
            mlp: &block.mlp,
            output_norms: Some((&block.post_attention_layernorm, &block.post_feedforward_layernorm)),
        });
        Ok(block)
    }

    fn residual(&self, x: &Array, y: &Array) -> Result<Array> {
        if self.clip_residuals {
            clipped_residual(x, y)
        } else {
            Ok(x.add(y)?)
        }
    }

    fn forward_alone(&self, x: &Array, cache: &mut dyn KvCache) -> Result<Array> {
        if let Some(fused) = self.fused.as_ref().filter(|_| fused_takes(x) && x.dim(0) == 1) {
            if let Some(out) = fused.forward(x, cache)? {
                return Ok(out);
            }
        }
        let r = self.self_attn.forward(&self.input_layernorm.forward(x)?, cache, Default::default())?;
        let h = self.residual(x, &self.post_attention_layernorm.forward(&r)?)?;
        let r = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        self.residual(&h, &self.post_feedforward_layernorm.forward(&r)?)
    }
}

impl Block for GemmaBlock {
    fn forward(&self, x: &Array, cache: &mut dyn KvCache, _: RowKernels) -> Result<Array> {
        self.forward_alone(x, cache)
    }

    fn stacked(&self, x: &Array) -> Option<&FusedBlock> {
        self.fused.as_ref().filter(|_| fused_takes(x))
    }

    fn describe(&self) -> String {
        let fused = if self.fused.is_some() { " [one fused kernel node at decode]" } else { "" };
        format!("pre- and post-norms (1 + w gains): {} → {}{fused}", self.self_attn.describe(), self.mlp.describe())
    }

    /// B sequences, each exactly as alone: norms and projections over all
    /// rows, RoPE and attention per sequence.
    fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array> {
        if let [cache] = caches {
            return self.forward_alone(x, cache.as_mut());
        }
        if let Some(fused) = self.fused.as_ref().filter(|_| fused_takes(x)) {
            if let Some(out) = fused.forward_batch(x, caches)? {
                return Ok(out);
            }
            // A cache the kernel cannot write in place: each sequence alone.
            return each_sequence_alone(x, caches, |x, cache| self.forward_alone(x, cache));
        }
        let r = self.self_attn.forward_batch(&self.input_layernorm.forward(x)?, caches)?;
        let h = self.residual(x, &self.post_attention_layernorm.forward(&r)?)?;
        let r = self.mlp.forward_per_sequence(&self.pre_feedforward_layernorm.forward(&h)?)?;
        self.residual(&h, &self.post_feedforward_layernorm.forward(&r)?)
    }
}

pub type Gemma3Model = Transformer<GemmaBlock>;

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let multimodal = ctx.config.get("model_type").and_then(|t| t.as_str()) == Some("gemma3");
    let (config, root) = if multimodal {
        let text = ctx.config.get("text_config").ok_or_else(|| Error::InvalidConfig {
            path: ctx.config_path.into(),
            message: "model_type `gemma3` needs a `text_config`".into(),
        })?;
        let mut text = text.clone();
        // mlx-lm's gemma3.ModelArgs: the top-level vocabulary, and its own head defaults.
        if let Some(map) = text.as_object_mut() {
            let vocab = ctx.config.get("vocab_size").cloned().unwrap_or(262_208.into());
            map.insert("vocab_size".into(), vocab);
            map.entry("num_attention_heads").or_insert(8.into());
            map.entry("num_key_value_heads").or_insert(4.into());
        }
        for prefix in SKIPPED_MULTIMODAL {
            ctx.scope.weights.skip(prefix);
        }
        (text, ctx.scope.pp("language_model"))
    } else {
        (ctx.config.clone(), ctx.scope.clone())
    };
    let args: Gemma3Args = parse_args(&config, ctx.config_path)?;
    Ok(Box::new(load_model(&root, ctx.config_path, &args)?))
}

/// Gemma's embedding scale, `sqrt(hidden)`, rounded to bfloat16 as mlx-lm's Gemma 3 rounds it.
fn bf16_embed_scale(hidden: i32) -> f64 {
    half::bf16::from_f32((hidden as f32).sqrt()).to_f32() as f64
}

fn load_model(root: &Scope, config_path: &std::path::Path, args: &Gemma3Args) -> Result<Gemma3Model> {
    args.validate().map_err(|message| Error::InvalidConfig { path: config_path.into(), message })?;
    if let Some(message) = args.unsupported() {
        return Err(Error::Unsupported { path: config_path.into(), message });
    }
    let unsupported = |message: String| Error::Unsupported { path: config_path.into(), message };
    let local_rope = Rope::new(args.head_dim, args.rope_local_base_freq, false, None).map_err(unsupported)?;
    let global_rope = Rope::new(args.head_dim, args.rope_theta, false, args.rope_scaling.as_ref()).map_err(unsupported)?;
    let (hidden, eps) = (args.hidden_size, args.rms_norm_eps);
    let model = root.pp("model");
    let layers = (0..args.num_hidden_layers)
        .map(|i| {
            let global = args.is_global(i);
            let spec = AttentionSpec {
                qk_norm_eps: Some(eps),
                qk_norm_offset: 1.0,
                scale: Some(args.query_pre_attn_scalar.powf(-0.5)),
                window: (!global).then_some(args.sliding_window),
                ..AttentionSpec::new(hidden, args.num_attention_heads, args.num_key_value_heads, args.head_dim)
            };
            let rope = if global { global_rope.clone() } else { local_rope.clone() };
            GemmaBlock::load(&model.pp("layers").pp(i), spec, rope, args.intermediate_size, eps, true)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Transformer {
        shape: ModelShape {
            num_layers: args.num_hidden_layers as usize,
            hidden_size: hidden as usize,
            kv_heads: args.num_key_value_heads as usize,
            head_dim: args.head_dim as usize,
            vocab_size: args.vocab_size as usize,
            dtype: root.dtype,
            max_position_embeddings: args.max_position_embeddings.map(|n| n as usize),
        },
        embed_tokens: Embedding::load(&model.pp("embed_tokens"), args.vocab_size, hidden)?,
        embed_scale: Some(bf16_embed_scale(hidden)),
        windows: (0..args.num_hidden_layers).map(|i| (!args.is_global(i)).then_some(args.sliding_window as usize)).collect(),
        layers,
        norm: RmsNorm::load_with_offset(&model.pp("norm"), hidden, eps, 1.0)?,
        lm_head: untied_lm_head(root, hidden, args.vocab_size)?,
        final_softcap: None,
        stack: Default::default(),
    })
}

/// mlx-lm's Gemma sanitize: tied exactly when the checkpoint has no lm_head.
pub(super) fn untied_lm_head(root: &Scope, hidden: i32, vocab_size: i32) -> Result<Option<Linear>> {
    if !root.contains("lm_head.weight") {
        return Ok(None);
    }
    Ok(Some(Linear::load(&root.pp("lm_head"), hidden, vocab_size, false)?))
}
