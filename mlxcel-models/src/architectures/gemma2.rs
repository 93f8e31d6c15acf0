//! Gemma 2, as mlx-lm's `gemma2`: Gemma's block (pre- and post-norms around
//! attention and the MLP, gains `1 + weight`, GELU (tanh) MLP; shared with
//! Gemma 3, [`GemmaBlock`]), queries scaled by `query_pre_attn_scalar^-0.5`,
//! attention scores soft-capped (`attn_logit_softcapping`), the embeddings
//! scaled by `sqrt(hidden)` and tied as the head, the logits soft-capped
//! (`final_logit_softcapping`).
//!
//! **No sliding window**: Hugging Face's Gemma 2 alternates sliding-window
//! and global layers (`sliding_window`), but mlx-lm's gemma2 ignores the key
//! and every layer attends to every position; mlxcel matches mlx-lm. Past
//! `sliding_window` positions both differ from Hugging Face's.
//!
//! A soft-cap of `null` (Hugging Face's "none") computes no cap; mlx-lm
//! cannot run such a config.

use serde::Deserialize;

use super::decoder::{parse_args, DecoderArgs};
use super::gemma3::{gelu_tanh_only, GemmaBlock};
use super::transformer::Transformer;
use super::LoadContext;
use crate::error::{Error, Result};
use crate::model::LanguageModel;
use crate::nn::{AttentionSpec, Embedding, RmsNorm, Rope};

/// `config.json` of `gemma2`: llama's keys (with `head_dim` required, as
/// mlx-lm requires it) and Gemma 2's own (mlx-lm's defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct Gemma2Args {
    #[serde(flatten)]
    pub base: DecoderArgs,
    #[serde(default = "defaults::attn_logit_softcapping")]
    pub attn_logit_softcapping: Option<f32>,
    #[serde(default = "defaults::final_logit_softcapping")]
    pub final_logit_softcapping: Option<f32>,
    #[serde(default = "defaults::query_pre_attn_scalar")]
    pub query_pre_attn_scalar: f32,
    /// Hugging Face's name for the MLP activation (`hidden_act` in older configs).
    #[serde(alias = "hidden_act")]
    pub hidden_activation: Option<String>,
}

mod defaults {
    pub fn attn_logit_softcapping() -> Option<f32> { Some(50.0) }
    pub fn final_logit_softcapping() -> Option<f32> { Some(30.0) }
    pub fn query_pre_attn_scalar() -> f32 { 144.0 }
}

impl Gemma2Args {
    fn validate(&self) -> std::result::Result<(), String> {
        self.base.validate()?;
        if self.base.head_dim.is_none() {
            return Err("gemma2 needs `head_dim` (it is not hidden_size / num_attention_heads in every size)".into());
        }
        let positive = [
            ("query_pre_attn_scalar", Some(self.query_pre_attn_scalar)),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ];
        for (name, value) in positive {
            if let Some(v) = value.filter(|v| !(*v > 0.0)) {
                return Err(format!("`{name}` must be positive, got {v}"));
            }
        }
        Ok(())
    }

    /// What mlx-lm's gemma2 does not compute: refused, not ignored.
    fn unsupported(&self) -> Option<String> {
        if let Some(message) = gelu_tanh_only("gemma2", self.hidden_activation.as_deref()) {
            return Some(message);
        }
        if let Some(scaling) = &self.base.rope_scaling {
            return Some(format!("rope_scaling `{}` (gemma2 has no RoPE scaling; supported: null)", scaling.rope_type));
        }
        None
    }
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let args: Gemma2Args = parse_args(ctx.config, ctx.config_path)?;
    let (base, config_path) = (&args.base, ctx.config_path);
    args.validate().map_err(|message| Error::InvalidConfig { path: config_path.into(), message })?;
    if let Some(message) = args.unsupported() {
        return Err(Error::Unsupported { path: config_path.into(), message });
    }
    let rope = Rope::new(base.head_dim(), base.rope_theta, base.rope_traditional, None)
        .map_err(|message| Error::Unsupported { path: config_path.into(), message })?;
    let (hidden, eps) = (base.hidden_size, base.rms_norm_eps);
    let spec = AttentionSpec {
        scale: Some((1.0 / (args.query_pre_attn_scalar as f64).sqrt()) as f32),
        softcap: args.attn_logit_softcapping,
        ..AttentionSpec::new(hidden, base.num_attention_heads, base.kv_heads(), base.head_dim())
    };
    let root = &ctx.scope;
    let model = root.pp("model");
    let layers = (0..base.num_hidden_layers)
        .map(|i| GemmaBlock::load(&model.pp("layers").pp(i), spec.clone(), rope.clone(), base.intermediate_size, eps, false))
        .collect::<Result<Vec<_>>>()?;
    // mlx-lm's gemma2 always ties the head to the embeddings, whatever
    // `tie_word_embeddings` says (an `lm_head` tensor stays unread, an error).
    Ok(Box::new(Transformer {
        shape: base.shape(root.dtype),
        embed_tokens: Embedding::load(&model.pp("embed_tokens"), base.vocab_size, hidden)?,
        // A Python float in mlx-lm: sqrt(hidden) in the activations' dtype.
        embed_scale: Some((hidden as f64).sqrt()),
        windows: vec![None; layers.len()],
        layers,
        norm: RmsNorm::load_with_offset(&model.pp("norm"), hidden, eps, 1.0)?,
        lm_head: None,
        final_softcap: args.final_logit_softcapping,
        stack: Default::default(),
    }))
}
