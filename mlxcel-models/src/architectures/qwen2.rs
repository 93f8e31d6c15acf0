//! Qwen2: llama with biases on the q, k and v projections.

use super::decoder::{parse_args, DecoderArgs, DecoderModel, DecoderOptions};
use super::LoadContext;
use crate::error::Result;
use crate::model::LanguageModel;

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let args: DecoderArgs = parse_args(ctx.config, ctx.config_path)?;
    let options = DecoderOptions { qkv_bias: true, ..DecoderOptions::default() };
    Ok(Box::new(DecoderModel::load(ctx, &args, options)?))
}
