//! Phi-3, as mlx-lm's `phi3`: llama's pre-norm block with q, k and v stored
//! as one `qkv_proj` and the gate and up projections as one `gate_up_proj`
//! (gate rows first), both split into their parts at load (quantized ones
//! too: every output row has its own scales), so decode runs the fused
//! block. `head_dim` is `hidden_size / num_attention_heads`; RoPE covers
//! `partial_rotary_factor` of it.
//!
//! RoPE scaling `su` / `longrope` is mlx-lm's `SuScaledRoPE`
//! ([`Rope::su_scaled`]): `long_factor` at every position (mlx-lm never uses
//! `short_factor`, whatever the sequence length) and the attention factor
//! from `max_position_embeddings / original_max_position_embeddings`;
//! `linear` divides the positions by `factor`. mlx-lm ignores (with a
//! warning) any other type; mlxcel refuses it. Phi-3's `sliding_window` is
//! ignored by mlx-lm, and so here: every position is attended.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{check_sizes, load_lm_head, parse_args, DecoderArgs, DecoderModel};
use super::transformer::Transformer;
use super::LoadContext;
use crate::error::{Error, Result};
use crate::model::{LanguageModel, ModelShape};
use crate::nn::{Activation, Attention, AttentionSpec, DecoderBlock, Embedding, GatedMlp, RmsNorm, Rope, RopeScaling};

/// `config.json` of `phi3`: llama's keys and Phi-3's own (mlx-lm's defaults).
#[derive(Debug, Deserialize)]
pub struct Phi3Args {
    /// `head_dim` is derived (a config that states another is refused);
    /// `rope_scaling` is left to [`Phi3Args::rope`].
    #[serde(flatten)]
    pub base: DecoderArgs,
    #[serde(default = "defaults::partial_rotary_factor")]
    pub partial_rotary_factor: f32,
    #[serde(default = "defaults::original_max_position_embeddings")]
    pub original_max_position_embeddings: i32,
}

mod defaults {
    pub fn partial_rotary_factor() -> f32 { 1.0 }
    pub fn original_max_position_embeddings() -> i32 { 4096 }
}

/// mlx-lm's phi3 default for `max_position_embeddings`.
const MAX_POSITION_EMBEDDINGS: i32 = 131_072;

impl Phi3Args {
    fn max_positions(&self) -> i32 {
        self.base.max_position_embeddings.unwrap_or(MAX_POSITION_EMBEDDINGS)
    }

    /// The rotated features per head (mlx-lm's `int(head_dim * partial_rotary_factor)`).
    fn rope_dims(&self) -> i32 {
        (self.base.head_dim() as f32 * self.partial_rotary_factor) as i32
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let base = &self.base;
        base.validate()?;
        check_sizes(&[
            ("max_position_embeddings", self.max_positions()),
            ("original_max_position_embeddings", self.original_max_position_embeddings),
        ])?;
        if base.hidden_size % base.num_attention_heads != 0 {
            return Err(format!(
                "hidden_size ({}) is not a multiple of num_attention_heads ({})",
                base.hidden_size, base.num_attention_heads
            ));
        }
        let derived = base.hidden_size / base.num_attention_heads;
        if let Some(stated) = base.head_dim.filter(|&d| d != derived) {
            return Err(format!("`head_dim` {stated}: phi3's head_dim is hidden_size / num_attention_heads = {derived}"));
        }
        let dims = self.rope_dims();
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0) || dims % 2 != 0 || dims == 0 {
            return Err(format!(
                "`partial_rotary_factor` {} gives {dims} rotated features of {derived} (needs an even count, at least 2)",
                self.partial_rotary_factor
            ));
        }
        Ok(())
    }

    /// The RoPE of `rope_scaling` (in `config`, the file at `path`).
    fn rope(&self, config: &Value, path: &Path) -> Result<Rope> {
        let (dims, base) = (self.rope_dims(), &self.base);
        let invalid = |message: String| Error::InvalidConfig { path: path.into(), message };
        let unsupported = |message: String| Error::Unsupported { path: path.into(), message };
        let Some(scaling) = config.get("rope_scaling").filter(|s| !s.is_null()) else {
            return Rope::new(dims, base.rope_theta, base.rope_traditional, None).map_err(unsupported);
        };
        let kind = scaling
            .get("type")
            .or_else(|| scaling.get("rope_type"))
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("`rope_scaling` needs a `type` (su, longrope or linear)".into()))?;
        match kind {
            "su" | "longrope" => {
                let factors = |key: &str| -> Result<Vec<f32>> {
                    let list = scaling.get(key).and_then(Value::as_array).ok_or_else(|| {
                        invalid(format!("`rope_scaling.{key}` must be a list of numbers for type `{kind}`"))
                    })?;
                    list.iter()
                        .map(|v| v.as_f64().map(|f| f as f32))
                        .collect::<Option<Vec<f32>>>()
                        .ok_or_else(|| invalid(format!("`rope_scaling.{key}` holds a value that is not a number")))
                };
                // mlx-lm reads `short_factor` (it must be there) but never applies it.
                factors("short_factor")?;
                let long = factors("long_factor")?;
                Rope::su_scaled(
                    dims,
                    base.rope_theta,
                    &long,
                    self.max_positions() as f64,
                    self.original_max_position_embeddings as f64,
                )
                .map_err(invalid)
            }
            "linear" => {
                let factor = scaling.get("factor").and_then(Value::as_f64).filter(|f| *f > 0.0);
                let factor = factor.ok_or_else(|| invalid("`rope_scaling.factor` must be a positive number for type `linear`".into()))?;
                let linear = RopeScaling { rope_type: "linear".into(), factor: Some(factor as f32), ..Default::default() };
                Rope::new(dims, base.rope_theta, base.rope_traditional, Some(&linear)).map_err(invalid)
            }
            other => Err(unsupported(format!("phi3 rope_scaling type `{other}` (supported: su, longrope, linear)"))),
        }
    }
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    // `rope_scaling` is Phi-3's own (factor lists), read by `Phi3Args::rope`.
    let mut config = ctx.config.clone();
    if let Some(map) = config.as_object_mut() {
        map.remove("rope_scaling");
    }
    let args: Phi3Args = parse_args(&config, ctx.config_path)?;
    let (root, path, base) = (&ctx.scope, ctx.config_path, &args.base);
    args.validate().map_err(|message| Error::InvalidConfig { path: path.into(), message })?;
    let rope = args.rope(ctx.config, path)?;
    let (hidden, eps) = (base.hidden_size, base.rms_norm_eps);
    let spec = AttentionSpec {
        qkv_fused: true,
        ..AttentionSpec::new(hidden, base.num_attention_heads, base.kv_heads(), base.head_dim())
    };
    let model = root.pp("model");
    let layers = (0..base.num_hidden_layers)
        .map(|i| {
            let layer = model.pp("layers").pp(i);
            Ok(DecoderBlock::new(
                RmsNorm::load(&layer.pp("input_layernorm"), hidden, eps)?,
                Attention::load(&layer.pp("self_attn"), spec.clone(), rope.clone())?,
                RmsNorm::load(&layer.pp("post_attention_layernorm"), hidden, eps)?,
                GatedMlp::load_fused(&layer.pp("mlp"), hidden, base.intermediate_size, Activation::Silu)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let model_out: DecoderModel = Transformer {
        shape: ModelShape { max_position_embeddings: Some(args.max_positions() as usize), ..base.shape(root.dtype) },
        embed_tokens: Embedding::load(&model.pp("embed_tokens"), base.vocab_size, hidden)?,
        embed_scale: None,
        windows: vec![None; layers.len()],
        layers,
        norm: RmsNorm::load(&model.pp("norm"), hidden, eps)?,
        // mlx-lm: untied unless the config ties it (a tied checkpoint's lm_head
        // stays unread, an error, as mlx-lm refuses it).
        lm_head: load_lm_head(root, base, base.tie_word_embeddings.unwrap_or(false))?,
        final_softcap: None,
        stack: Default::default(),
    };
    Ok(Box::new(model_out))
}
