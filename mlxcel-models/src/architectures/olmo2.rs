//! OLMo 2, as mlx-lm's `olmo2`: post-norm blocks (the attention and MLP
//! outputs are normed before their residual adds; their inputs are not), and
//! q and k RMS-normed over the whole projection (all heads at once) before
//! RoPE. Otherwise llama: SiLU-gated MLP, optional biases, llama's RoPE
//! scalings; the head is tied unless `tie_word_embeddings` is false (mlx-lm's
//! default).
//!
//! Skipped on purpose, as mlx-lm's sanitize drops them: precomputed
//! `self_attn.rotary_emb.inv_freq`.

use mlx_sys::Array;

use super::decoder::{load_lm_head, parse_args};
use super::llama::LlamaArgs;
use super::transformer::{Block, Transformer};
use super::LoadContext;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::LanguageModel;
use crate::nn::{Attention, AttentionSpec, Embedding, GatedMlp, RmsNorm, Rope, RowKernels};

/// One OLMo 2 block: attention and MLP, each output normed, with residuals.
struct Olmo2Block {
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
    post_feedforward_layernorm: RmsNorm,
}

impl Block for Olmo2Block {
    fn forward(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array> {
        let h = x.add(&self.post_attention_layernorm.forward(&self.self_attn.forward(x, cache, kernels)?)?)?;
        Ok(h.add(&self.post_feedforward_layernorm.forward(&self.mlp.forward_with(&h, kernels)?)?)?)
    }

    fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array> {
        let h = x.add(&self.post_attention_layernorm.forward(&self.self_attn.forward_batch(x, caches)?)?)?;
        Ok(h.add(&self.post_feedforward_layernorm.forward(&self.mlp.forward_per_sequence(&h)?)?)?)
    }

    fn describe(&self) -> String {
        format!("post-norm (outputs normed before the residual adds): {} → {}", self.self_attn.describe(), self.mlp.describe())
    }
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    // llama's keys: biases on q/k/v/o (`attention_bias`) and the MLP (`mlp_bias`).
    let LlamaArgs { base: args, attention_bias, mlp_bias } = parse_args(ctx.config, ctx.config_path)?;
    let (root, config_path) = (&ctx.scope, ctx.config_path);
    args.validate().map_err(|message| Error::InvalidConfig { path: config_path.into(), message })?;
    let rope = Rope::new(args.head_dim(), args.rope_theta, args.rope_traditional, args.rope_scaling.as_ref())
        .map_err(|message| Error::Unsupported { path: config_path.into(), message })?;
    let (hidden, eps) = (args.hidden_size, args.rms_norm_eps);
    let spec = AttentionSpec {
        qkv_bias: attention_bias,
        o_bias: attention_bias,
        qk_norm_eps: Some(eps),
        qk_norm_whole: true,
        ..AttentionSpec::new(hidden, args.num_attention_heads, args.kv_heads(), args.head_dim())
    };
    let model = root.pp("model");
    let layers = (0..args.num_hidden_layers)
        .map(|i| {
            let layer = model.pp("layers").pp(i);
            Ok(Olmo2Block {
                self_attn: Attention::load(&layer.pp("self_attn"), spec.clone(), rope.clone())?,
                post_attention_layernorm: RmsNorm::load(&layer.pp("post_attention_layernorm"), hidden, eps)?,
                mlp: GatedMlp::load(&layer.pp("mlp"), hidden, args.intermediate_size, mlp_bias)?,
                post_feedforward_layernorm: RmsNorm::load(&layer.pp("post_feedforward_layernorm"), hidden, eps)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    root.weights.skip("self_attn.rotary_emb.inv_freq");
    Ok(Box::new(Transformer {
        shape: args.shape(root.dtype),
        embed_tokens: Embedding::load(&model.pp("embed_tokens"), args.vocab_size, hidden)?,
        embed_scale: None,
        windows: vec![None; layers.len()],
        layers,
        norm: RmsNorm::load(&model.pp("norm"), hidden, eps)?,
        // mlx-lm: tied unless the config says otherwise; an lm_head beside
        // tied embeddings stays unread (an error), as mlx-lm refuses it.
        lm_head: load_lm_head(root, &args, args.tie_word_embeddings.unwrap_or(true))?,
        final_softcap: None,
        stack: Default::default(),
    }))
}
