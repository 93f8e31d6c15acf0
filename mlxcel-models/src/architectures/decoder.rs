//! The decoder-only transformer that the llama family shares: embeddings,
//! pre-norm blocks, a final norm and an (optionally tied) lm_head, in the
//! shared [`Transformer`].

use mlx_sys::Array;
use serde::Deserialize;

use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::ModelShape;
use crate::nn::{Attention, AttentionSpec, DecoderBlock, Embedding, FusedBlock, GatedMlp, Linear, RmsNorm, Rope, RopeScaling, RowKernels};
use crate::weights::Scope;
use super::transformer::{Block, Transformer};
use super::LoadContext;

/// Hugging Face config keys common to llama-style models.
#[derive(Debug, Clone, Deserialize)]
pub struct DecoderArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<i32>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

impl DecoderArgs {
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i32 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// The sizes callers see, activations in `dtype`.
    pub fn shape(&self, dtype: mlx_sys::Dtype) -> ModelShape {
        ModelShape {
            num_layers: self.num_hidden_layers as usize,
            hidden_size: self.hidden_size as usize,
            kv_heads: self.kv_heads() as usize,
            head_dim: self.head_dim() as usize,
            vocab_size: self.vocab_size as usize,
            dtype,
            max_position_embeddings: self.max_position_embeddings.map(|n| n as usize),
        }
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        check_sizes(&[
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
            ("vocab_size", self.vocab_size),
        ])
    }
}

/// Every size in `sizes` (config key, value) positive, and
/// `num_attention_heads` a multiple of `num_key_value_heads` (when both are
/// among them); the error names the key.
pub fn check_sizes(sizes: &[(&str, i32)]) -> std::result::Result<(), String> {
    if let Some((name, value)) = sizes.iter().find(|(_, v)| *v <= 0) {
        return Err(format!("`{name}` must be positive, got {value}"));
    }
    let size = |key: &str| sizes.iter().find(|(name, _)| *name == key).map(|(_, v)| *v);
    if let (Some(heads), Some(kv_heads)) = (size("num_attention_heads"), size("num_key_value_heads")) {
        if heads % kv_heads != 0 {
            return Err(format!("num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"));
        }
    }
    Ok(())
}

/// Per-architecture choices on top of [`DecoderArgs`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DecoderOptions {
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub qk_norm: bool,
}

/// The llama family's model: [`DecoderBlock`]s in the shared [`Transformer`].
pub type DecoderModel = Transformer<DecoderBlock>;

impl Block for DecoderBlock {
    fn forward(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array> {
        self.forward_with(x, cache, kernels)
    }

    fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array> {
        DecoderBlock::forward_batch(self, x, caches)
    }

    fn chunking_invariant(&self) -> bool {
        self.is_fused()
    }

    fn describe(&self) -> String {
        DecoderBlock::describe(self)
    }

    fn stacked(&self, x: &Array) -> Option<&FusedBlock> {
        self.fused_for(x)
    }
}

impl DecoderModel {
    pub fn load(ctx: &LoadContext, args: &DecoderArgs, options: DecoderOptions) -> Result<Self> {
        Self::load_in(ctx, &ctx.scope.pp("model"), &ctx.scope, args, options)
    }

    /// [`load`](Self::load) with the body (`layers`, `embed_tokens`, `norm`)
    /// under `body` and the `lm_head` under `head` (a vision-language
    /// checkpoint's `language_model.`).
    pub fn load_in(ctx: &LoadContext, body: &Scope, head: &Scope, args: &DecoderArgs, options: DecoderOptions) -> Result<Self> {
        let spec = AttentionSpec {
            qkv_bias: options.qkv_bias,
            o_bias: options.o_bias,
            qk_norm_eps: options.qk_norm.then_some(args.rms_norm_eps),
            ..AttentionSpec::new(args.hidden_size, args.num_attention_heads, args.kv_heads(), args.head_dim())
        };
        load_pre_norm_in(ctx, body, head, args, spec, |parts, layer, _| {
            let mlp = GatedMlp::load(&layer.pp("mlp"), args.hidden_size, args.intermediate_size, options.mlp_bias)?;
            Ok(DecoderBlock::new(parts.input_layernorm, parts.self_attn, parts.post_attention_layernorm, mlp))
        })
    }
}

/// What every llama-style pre-norm block loads before its MLP.
pub struct PreNormParts {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
}

/// A llama-style pre-norm decoder (`model.layers.N.{input_layernorm,
/// self_attn, post_attention_layernorm}`, `model.embed_tokens`,
/// `model.norm`, `lm_head`): `block(parts, layer_scope, i)` completes layer
/// i with its MLP. The head is tied exactly when the config says so, or,
/// when it is silent, when the checkpoint has no lm_head.
pub fn load_pre_norm<B: Block>(
    ctx: &LoadContext,
    args: &DecoderArgs,
    spec: AttentionSpec,
    block: impl Fn(PreNormParts, &Scope, i32) -> Result<B>,
) -> Result<Transformer<B>> {
    load_pre_norm_in(ctx, &ctx.scope.pp("model"), &ctx.scope, args, spec, block)
}

/// [`load_pre_norm`] with the body under `model` and the `lm_head` under `root`.
pub fn load_pre_norm_in<B: Block>(
    ctx: &LoadContext,
    model: &Scope,
    root: &Scope,
    args: &DecoderArgs,
    spec: AttentionSpec,
    block: impl Fn(PreNormParts, &Scope, i32) -> Result<B>,
) -> Result<Transformer<B>> {
    let config_path = ctx.config_path;
    args.validate().map_err(|message| Error::InvalidConfig { path: config_path.into(), message })?;
    let rope = Rope::new(args.head_dim(), args.rope_theta, args.rope_traditional, args.rope_scaling.as_ref())
        .map_err(|message| Error::Unsupported { path: config_path.into(), message })?;
    let layers = (0..args.num_hidden_layers)
        .map(|i| {
            let layer = model.pp("layers").pp(i);
            let parts = PreNormParts {
                input_layernorm: RmsNorm::load(&layer.pp("input_layernorm"), args.hidden_size, args.rms_norm_eps)?,
                self_attn: Attention::load(&layer.pp("self_attn"), spec.clone(), rope.clone())?,
                post_attention_layernorm: RmsNorm::load(&layer.pp("post_attention_layernorm"), args.hidden_size, args.rms_norm_eps)?,
            };
            block(parts, &layer, i)
        })
        .collect::<Result<Vec<_>>>()?;
    let tied = args.tie_word_embeddings.unwrap_or(!root.contains("lm_head.weight"));
    // What mlx-lm's llama-family `sanitize` drops: precomputed RoPE
    // frequencies, and an lm_head the config ties to the embeddings.
    root.weights.skip("self_attn.rotary_emb.inv_freq");
    if tied {
        root.weights.skip(&root.path("lm_head."));
    }
    Ok(Transformer {
        shape: args.shape(root.dtype),
        embed_tokens: Embedding::load(&model.pp("embed_tokens"), args.vocab_size, args.hidden_size)?,
        embed_scale: None,
        windows: vec![None; layers.len()],
        layers,
        norm: RmsNorm::load(&model.pp("norm"), args.hidden_size, args.rms_norm_eps)?,
        lm_head: load_lm_head(root, args, tied)?,
        final_softcap: None,
        stack: Default::default(),
    })
}

/// The untied lm_head (None when `tied`).
pub fn load_lm_head(root: &Scope, args: &DecoderArgs, tied: bool) -> Result<Option<Linear>> {
    if tied {
        return Ok(None);
    }
    Ok(Some(Linear::load(&root.pp("lm_head"), args.hidden_size, args.vocab_size, false)?))
}

/// Parses an architecture's args from config.json, naming the file on error.
pub fn parse_args<T: serde::de::DeserializeOwned>(config: &serde_json::Value, path: &std::path::Path) -> Result<T> {
    T::deserialize(config).map_err(|e| Error::InvalidConfig { path: path.into(), message: e.to_string() })
}
