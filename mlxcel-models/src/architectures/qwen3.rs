//! Qwen3: llama with a per-head RMSNorm on queries and keys.

use serde::Deserialize;

use super::decoder::{parse_args, DecoderArgs, DecoderModel, DecoderOptions};
use super::LoadContext;
use crate::error::{Error, Result};
use crate::model::LanguageModel;

#[derive(Debug, Deserialize)]
pub struct Qwen3Args {
    #[serde(flatten)]
    pub base: DecoderArgs,
    #[serde(default)]
    pub attention_bias: bool,
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let args: Qwen3Args = parse_args(ctx.config, ctx.config_path)?;
    if args.attention_bias {
        // mlx-lm's qwen3 has no attention biases either; refuse rather than drop them.
        return Err(Error::Unsupported {
            path: ctx.config_path.into(),
            message: "qwen3 with `attention_bias: true` (mlxcel's qwen3, like mlx-lm's, has no q/k/v/o biases; \
                      supported: `attention_bias` false or absent)"
                .into(),
        });
    }
    let options = DecoderOptions { qk_norm: true, ..DecoderOptions::default() };
    Ok(Box::new(DecoderModel::load(ctx, &args.base, options)?))
}
