//! Idefics3 and SmolVLM (`model_type` `idefics3`, `smolvlm`), as mlx-vlm
//! 0.7.10 runs them: a SigLIP vision tower ([`super::siglip`],
//! `vision_model.`), the Idefics3 connector (pixel shuffle by
//! `scale_factor`, then the bias-free `connector.modality_projection.proj`),
//! and a llama text model (`language_model.`: `layers`, `embed_tokens`,
//! `norm`, `lm_head`), which is our llama decoder unchanged. The image
//! features replace the embeddings of the `<image>` tokens
//! ([`crate::model::merge_image_features`]); everything after the prefill is
//! the text model's.

use mlx_sys::Array;
use serde::Deserialize;
use serde_json::Value;

use super::decoder::{parse_args, DecoderArgs, DecoderModel, DecoderOptions};
use super::siglip::{SiglipArgs, SiglipVision};
use super::LoadContext;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::model::{LanguageModel, ModelLayout, ModelShape, VisionEncoder};
use crate::nn::{Linear, RowKernels};

/// The `model_type`s this file loads.
pub const MODEL_TYPES: &[&str] = &["idefics3", "smolvlm"];

#[derive(Debug, Deserialize)]
struct Idefics3Args {
    #[serde(default = "default_scale_factor")]
    scale_factor: i32,
    image_token_id: Option<u32>,
    image_token_index: Option<u32>,
}

fn default_scale_factor() -> i32 {
    2
}

pub struct Idefics3 {
    text: DecoderModel,
    vision: SiglipVision,
    projection: Linear,
    scale_factor: i32,
    image_token_id: u32,
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let path = ctx.config_path;
    let invalid = |message: String| Error::InvalidConfig { path: path.into(), message };
    let args: Idefics3Args = parse_args(ctx.config, path)?;
    let image_token_id = args
        .image_token_index
        .or(args.image_token_id)
        .unwrap_or(49153); // mlx-vlm's default
    let section = |key: &str| ctx.config.get(key).filter(|v| v.is_object()).ok_or_else(|| invalid(format!("no `{key}` object")));
    let mut text = section("text_config")?.clone();
    let map = text.as_object_mut().expect("an object");
    if map.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        return Err(Error::Unsupported {
            path: path.into(),
            message: "text_config.rope_scaling: mlx-vlm's idefics3 text model has no RoPE scaling".into(),
        });
    }
    // mlx-vlm's idefics3 TextConfig: RoPE base 1e6 unless given, head_dim = hidden / heads.
    map.entry("rope_theta").or_insert(Value::from(1_000_000.0));
    map.remove("head_dim");
    if !map.contains_key("vocab_size") {
        if let Some(v) = ctx.config.get("vocab_size") {
            map.insert("vocab_size".into(), v.clone());
        }
    }
    let mut text_args: DecoderArgs = parse_args(&text, path)?;
    let body = ctx.scope.pp("language_model");
    // mlx-vlm's text model always has an lm_head; a checkpoint without one is tied.
    text_args.tie_word_embeddings = Some(!body.contains("lm_head.weight"));
    let text = DecoderModel::load_in(ctx, &body, &body, &text_args, DecoderOptions::default())?;

    let vision_args: SiglipArgs = parse_args(section("vision_config")?, path)?;
    let vision = SiglipVision::load(&ctx.scope.pp("vision_model"), vision_args, path)?;
    let v = vision.args();
    let s = args.scale_factor;
    if s <= 0 || v.patches_per_side() % s != 0 {
        return Err(invalid(format!(
            "scale_factor {s} does not divide the {} patches a side of a tile",
            v.patches_per_side()
        )));
    }
    let projection = Linear::load(
        &ctx.scope.pp("connector").pp("modality_projection").pp("proj"),
        v.hidden_size * s * s,
        text_args.hidden_size,
        false,
    )?;
    if image_token_id as i32 >= text_args.vocab_size {
        return Err(invalid(format!("image_token_id {image_token_id} is outside the vocabulary of {}", text_args.vocab_size)));
    }
    Ok(Box::new(Idefics3 { text, vision, projection, scale_factor: s, image_token_id }))
}

impl VisionEncoder for Idefics3 {
    fn image_token_id(&self) -> u32 {
        self.image_token_id
    }

    fn tokens_per_tile(&self) -> usize {
        let side = self.vision.args().patches_per_side() / self.scale_factor;
        (side * side) as usize
    }

    fn tile_side(&self) -> usize {
        self.vision.args().image_size as usize
    }

    fn vision_tower(&self, pixel_values: &Array) -> Result<Array> {
        self.vision.forward(pixel_values)
    }

    /// mlx-vlm's `Idefics3Connector`: pixel shuffle, then the projection.
    fn connect(&self, x: &Array) -> Result<Array> {
        let (n, seq, d) = (x.dim(0), x.dim(1), x.dim(2));
        let side = self.vision.args().patches_per_side();
        let s = self.scale_factor;
        let x = x
            .reshape(&[n, side, side / s, d * s])?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[n, side / s, side / s, d * s * s])?
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[n, seq / (s * s), d * s * s])?;
        self.projection.forward(&x)
    }
}

/// Everything but the prefill of a prompt with images is the text model's.
impl LanguageModel for Idefics3 {
    fn forward(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        self.text.forward(tokens, caches)
    }
    fn forward_last(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        self.text.forward_last(tokens, caches)
    }
    fn forward_last_with(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        self.text.forward_last_with(tokens, caches, kernels)
    }
    fn chunking_invariant_prefill(&self) -> bool {
        self.text.chunking_invariant_prefill()
    }
    fn forward_batch(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        self.text.forward_batch(tokens, caches)
    }
    fn forward_batch_all(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        self.text.forward_batch_all(tokens, caches)
    }
    fn forward_hidden(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        self.text.forward_hidden(tokens, caches)
    }
    fn new_caches(&self) -> Vec<Box<dyn KvCache>> {
        self.text.new_caches()
    }
    fn reads_paged_kv(&self) -> bool {
        self.text.reads_paged_kv()
    }
    fn shape(&self) -> &ModelShape {
        self.text.shape()
    }
    fn attention_windows(&self) -> Vec<Option<usize>> {
        self.text.attention_windows()
    }
    fn layout(&self) -> ModelLayout {
        let mut layout = self.text.layout();
        let v = self.vision.args();
        layout.head = format!(
            "{}; images: SigLIP {} layers, hidden {}, {}×{} tiles of {}-pixel patches → pixel shuffle ×{} → {} tokens a tile",
            layout.head,
            v.num_hidden_layers,
            v.hidden_size,
            v.image_size,
            v.image_size,
            v.patch_size,
            self.scale_factor,
            self.tokens_per_tile()
        );
        layout
    }
    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.text.embed(tokens)
    }
    fn forward_last_embedded(&self, h: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        self.text.forward_last_embedded(h, caches, kernels)
    }
    fn forward_embedded(&self, h: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        self.text.forward_embedded(h, caches)
    }
    fn vision(&self) -> Option<&dyn VisionEncoder> {
        Some(self)
    }
}
