//! Qwen3: llama with a per-head RMSNorm on queries and keys.

use super::decoder::{parse_args, DecoderArgs, DecoderModel, DecoderOptions};
use super::LoadContext;
use crate::error::Result;
use crate::model::LanguageModel;

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let args: DecoderArgs = parse_args(ctx.config, ctx.config_path)?;
    let options = DecoderOptions { qk_norm: true, ..DecoderOptions::default() };
    Ok(Box::new(DecoderModel::load(ctx, &args, options)?))
}
