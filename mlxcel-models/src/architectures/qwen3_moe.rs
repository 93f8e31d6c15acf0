//! Qwen3-MoE: Qwen3 attention (per-head q/k norms); layer i's feed-forward is
//! a sparse MoE (`mlp`: router `gate`, softmax over all experts, top-k,
//! renormalized when `norm_topk_prob`) when i is not in `mlp_only_layers`
//! and (i + 1) is a multiple of `decoder_sparse_step`, else a dense MLP of
//! `intermediate_size`.
//!
//! Sanitize (as mlx-lm's): a tied lm_head is dropped; Hugging Face's
//! per-expert `mlp.experts.<e>.{gate,up,down}_proj` load as they are where
//! mlx-lm stacks them into `mlp.switch_mlp.*`.

use serde::Deserialize;

use super::decoder::{parse_args, DecoderArgs};
use super::LoadContext;
use crate::error::{Error, Result};
use crate::model::LanguageModel;
use crate::moe::{FeedForward, MoeModel, MoeSpec, Routing, SparseMoe};
use crate::nn::GatedMlp;

#[derive(Debug, Deserialize)]
pub struct Qwen3MoeArgs {
    #[serde(flatten)]
    pub base: DecoderArgs,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub moe_intermediate_size: i32,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: i32,
    pub mlp_only_layers: Vec<i32>,
    #[serde(default)]
    pub attention_bias: bool,
}

pub fn load(ctx: &LoadContext) -> Result<Box<dyn LanguageModel>> {
    let args: Qwen3MoeArgs = parse_args(ctx.config, ctx.config_path)?;
    let refuse = |message: String| Error::Unsupported { path: ctx.config_path.into(), message };
    if args.attention_bias {
        return Err(refuse("qwen3_moe with `attention_bias: true` (mlx-lm's qwen3_moe has no q/k/v/o biases)".into()));
    }
    if args.decoder_sparse_step <= 0 {
        return Err(refuse(format!("`decoder_sparse_step` must be positive, got {}", args.decoder_sparse_step)));
    }
    let spec = MoeSpec {
        hidden: args.base.hidden_size,
        intermediate: args.moe_intermediate_size,
        experts: args.num_experts,
        top_k: args.num_experts_per_tok,
        routing: Routing::TopKOfSoftmax { normalize: args.norm_topk_prob },
    };
    let model = MoeModel::load(ctx, &args.base, true, |layer, i| {
        let mlp = layer.pp("mlp");
        let sparse = !args.mlp_only_layers.contains(&i) && args.num_experts > 0 && (i + 1) % args.decoder_sparse_step == 0;
        Ok(if sparse {
            FeedForward::Sparse(SparseMoe::load(
                &mlp.pp("gate"),
                &mlp.pp("switch_mlp"),
                &mlp.pp("experts"),
                ["gate_proj", "up_proj", "down_proj"],
                spec,
            )?)
        } else {
            FeedForward::Dense(GatedMlp::load(&mlp, args.base.hidden_size, args.base.intermediate_size, false)?)
        })
    })?;
    Ok(Box::new(model))
}
