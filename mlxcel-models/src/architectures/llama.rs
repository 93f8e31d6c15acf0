//! Llama (also Mistral and the SmolLM family).

use serde::Deserialize;

use super::decoder::{parse_args, DecoderArgs, DecoderModel, DecoderOptions};
use super::LoadContext;
use crate::error::Result;
use crate::model::LanguageModel;

#[derive(Debug, Deserialize)]
pub struct LlamaArgs {
    #[serde(flatten)]
    pub base: DecoderArgs,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let args: LlamaArgs = parse_args(ctx.config, ctx.config_path)?;
    let options = DecoderOptions {
        qkv_bias: args.attention_bias,
        o_bias: args.attention_bias,
        mlp_bias: args.mlp_bias,
        qk_norm: false,
    };
    Ok(Box::new(DecoderModel::load(ctx, &args.base, options)?))
}
