//! Mixtral: llama attention, every feed-forward a sparse MoE
//! (`block_sparse_moe`: router `gate`, top-k experts weighted by a softmax
//! over their k logits).
//!
//! Sanitize (as mlx-lm's): a tied lm_head is dropped; Hugging Face's
//! per-expert `block_sparse_moe.experts.<e>.{w1,w3,w2}` (gate, up, down) load
//! as they are where mlx-lm stacks them into `switch_mlp.{gate,up,down}_proj`.

use serde::Deserialize;

use super::decoder::{parse_args, DecoderArgs};
use super::LoadContext;
use crate::error::Result;
use crate::model::LanguageModel;
use crate::moe::{FeedForward, MoeModel, MoeSpec, Routing, SparseMoe};

#[derive(Debug, Deserialize)]
pub struct MixtralArgs {
    #[serde(flatten)]
    pub base: DecoderArgs,
    pub num_local_experts: i32,
    pub num_experts_per_tok: i32,
    /// mlx-lm's default differs from llama's.
    pub rope_theta: Option<f32>,
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let mut args: MixtralArgs = parse_args(ctx.config, ctx.config_path)?;
    args.base.rope_theta = args.rope_theta.unwrap_or(1e6);
    // mlx-lm's Mixtral derives head_dim from hidden_size / num_attention_heads.
    args.base.head_dim = None;
    let spec = MoeSpec {
        hidden: args.base.hidden_size,
        intermediate: args.base.intermediate_size,
        experts: args.num_local_experts,
        top_k: args.num_experts_per_tok,
        routing: Routing::SoftmaxOfTopK,
    };
    let model = MoeModel::load(ctx, &args.base, false, |layer, _| {
        let moe = layer.pp("block_sparse_moe");
        Ok(FeedForward::Sparse(SparseMoe::load(
            &moe.pp("gate"),
            &moe.pp("switch_mlp"),
            &moe.pp("experts"),
            ["w1", "w3", "w2"],
            spec,
        )?))
    })?;
    Ok(Box::new(model))
}
