//! Mixture-of-experts layers and the decoder built on them (Mixtral, Qwen3-MoE).
//!
//! Decode (up to `FUSED_MAX_ROWS` rows) of quantized stacked experts runs
//! each block as one fused kernel node whose MLP is the mixture (router,
//! top-k, the chosen experts over their rows; `DecoderLayerSpec::experts`).
//! Otherwise [`SparseMoe`] runs the router on the device, reads the chosen
//! experts and their weights back (one host sync per MoE layer), groups the
//! rows by expert and runs each chosen expert once over the rows routed to
//! it, on our quantized matvec (few rows) or GEMM (many rows) kernels over
//! that expert's slice of the stacked weights. Unchosen experts are never
//! read on either path.

use mlx_sys::{Array, Dtype};

use crate::architectures::decoder::{load_pre_norm, DecoderArgs};
use crate::architectures::transformer::{each_sequence_alone, Block, Transformer};
use crate::architectures::LoadContext;
use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::nn::{
    fused_takes, Attention, AttentionSpec, FusedBlock, FusedParts, GatedMlp, Linear, RmsNorm, RowKernels, StackedExperts,
};
use crate::weights::Scope;

/// How router logits become the top-k experts' weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Mixtral: the k largest logits, then a softmax over those k.
    SoftmaxOfTopK,
    /// Qwen3-MoE: a softmax over all experts, the k largest probabilities,
    /// renormalized to sum to 1 when `normalize` (`norm_topk_prob`).
    TopKOfSoftmax { normalize: bool },
}

impl Routing {
    /// `DecoderLayerSpec::routing` of the fused kernel.
    fn kernel_code(self) -> i32 {
        match self {
            Routing::SoftmaxOfTopK => 0,
            Routing::TopKOfSoftmax { normalize: false } => 1,
            Routing::TopKOfSoftmax { normalize: true } => 2,
        }
    }

    /// The k (expert, weight) pairs of one row of router logits.
    pub fn route(self, logits: &[f32], k: usize) -> Vec<(usize, f32)> {
        let softmax = |v: &[f32]| -> Vec<f32> {
            let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = v.iter().map(|x| (x - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            exp.iter().map(|e| e / sum).collect()
        };
        let top_k = |v: &[f32]| -> Vec<usize> {
            let mut order: Vec<usize> = (0..v.len()).collect();
            order.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
            order.truncate(k);
            order
        };
        match self {
            Routing::SoftmaxOfTopK => {
                let chosen = top_k(logits);
                let weights = softmax(&chosen.iter().map(|&e| logits[e]).collect::<Vec<_>>());
                chosen.into_iter().zip(weights).collect()
            }
            Routing::TopKOfSoftmax { normalize } => {
                let probs = softmax(logits);
                let chosen = top_k(&probs);
                let sum: f32 = chosen.iter().map(|&e| probs[e]).sum();
                let scale = if normalize { sum } else { 1.0 };
                chosen.into_iter().map(|e| (e, probs[e] / scale)).collect()
            }
        }
    }
}

/// A router plus SiLU-gated experts, top-k of them per token.
pub struct SparseMoe {
    router: Linear,
    experts: Vec<GatedMlp>,
    /// The quantized experts of a stacked checkpoint, for the fused block.
    stacked: Option<StackedExperts>,
    top_k: usize,
    routing: Routing,
}

/// Shape of a [`SparseMoe`].
#[derive(Debug, Clone, Copy)]
pub struct MoeSpec {
    pub hidden: i32,
    pub intermediate: i32,
    pub experts: i32,
    pub top_k: i32,
    pub routing: Routing,
}

impl SparseMoe {
    /// The router at `router` and the experts either stacked under
    /// `stacked.{gate_proj,up_proj,down_proj}` (mlx-lm's `switch_mlp`) or,
    /// when those are absent, one module per expert (Hugging Face's layout:
    /// `per_expert.<e>.<name>`, `names` the gate, up and down projections).
    /// mlx-lm's `sanitize` stacks the latter; we load each expert's tensors as
    /// they are, which computes the same thing without a copy.
    pub fn load(router: &Scope, stacked: &Scope, per_expert: &Scope, names: [&str; 3],
        spec: MoeSpec,
    ) -> Result<Self> {
        let MoeSpec { hidden, intermediate, experts, top_k, routing } = spec;
        if experts <= 0 || top_k <= 0 || top_k > experts {
            return Err(Error::Unsupported {
                path: router.module_path().into(),
                message: format!("{top_k} experts per token (`num_experts_per_tok`) of {experts} must be 1..={experts}"),
            });
        }
        let count = experts;
        let mut fused_experts = None;
        let experts = if stacked.pp("gate_proj").contains("weight") {
            let (gate, gate_all) = Linear::load_stacked(&stacked.pp("gate_proj"), experts, hidden, intermediate)?;
            let (up, up_all) = Linear::load_stacked(&stacked.pp("up_proj"), experts, hidden, intermediate)?;
            let (down, down_all) = Linear::load_stacked(&stacked.pp("down_proj"), experts, intermediate, hidden)?;
            if let (Some(gate), Some(up), Some(down)) = (gate_all, up_all, down_all) {
                fused_experts = Some(StackedExperts { count, gate, up, down });
            }
            gate.into_iter().zip(up).zip(down).map(|((g, u), d)| GatedMlp::from_parts(g, u, d)).collect()
        } else {
            (0..experts)
                .map(|e| {
                    let scope = per_expert.pp(e);
                    let [g, u, d] = names;
                    Ok(GatedMlp::from_parts(
                        Linear::load(&scope.pp(g), hidden, intermediate, false)?,
                        Linear::load(&scope.pp(u), hidden, intermediate, false)?,
                        Linear::load(&scope.pp(d), intermediate, hidden, false)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?
        };
        let router = Linear::load(router, hidden, spec.experts, false)?;
        Ok(SparseMoe { router, experts, stacked: fused_experts, top_k: top_k as usize, routing })
    }

    /// `x` [.., hidden] → [.., hidden].
    pub fn forward_with(&self, x: &Array, kernels: RowKernels) -> Result<Array> {
        let shape = x.shape();
        let hidden = *shape.last().unwrap_or(&0);
        let rows = x.reshape(&[-1, hidden])?;
        let n = rows.dim(0) as usize;
        let logits = self.router.forward_with(&rows, kernels)?.astype(Dtype::Float32)?.to_vec::<f32>()?;
        let experts = self.experts.len();
        let k = self.top_k;
        // Rows (and their weights) per expert, and where each (row, slot) lands
        // in the concatenated expert outputs.
        let mut routed: Vec<(Vec<i32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); experts];
        let mut slot_expert = Vec::with_capacity(n * k);
        for (row, logits) in logits.chunks(experts).enumerate() {
            for (e, w) in self.routing.route(logits, k) {
                slot_expert.push((e, routed[e].0.len()));
                routed[e].0.push(row as i32);
                routed[e].1.push(w);
            }
        }
        if n == 1 {
            // Decode: the k experts' outputs scaled and summed, in slot order.
            let mut y: Option<Array> = None;
            for &(e, _) in &slot_expert {
                let ye = self.experts[e].forward_with(&rows, kernels)?.mul_scalar(routed[e].1[0] as f64)?;
                y = Some(match y {
                    Some(y) => y.add(&ye)?,
                    None => ye,
                });
            }
            return Ok(y.expect("top_k >= 1").reshape(&shape)?);
        }
        let mut start = vec![0usize; experts];
        let mut parts = Vec::new();
        let mut offset = 0;
        for (e, (rows_e, weights_e)) in routed.iter().enumerate() {
            if rows_e.is_empty() {
                continue;
            }
            start[e] = offset;
            offset += rows_e.len();
            let m = rows_e.len() as i32;
            let xe = if m as usize == n && rows_e.iter().enumerate().all(|(i, &r)| i as i32 == r) {
                rows.clone()
            } else {
                rows.take(&Array::from_slice(rows_e, &[m])?, 0)?
            };
            let ye = self.experts[e].forward_with(&xe, kernels)?;
            let we = Array::from_slice(weights_e, &[m, 1])?.astype(ye.dtype())?;
            parts.push(ye.multiply(&we)?);
        }
        let order: Vec<i32> = slot_expert.iter().map(|&(e, i)| (start[e] + i) as i32).collect();
        let all = if parts.len() == 1 { parts.pop().unwrap() } else { mlx_sys::concatenate(&parts, 0)? };
        let y = all.take(&Array::from_slice(&order, &[(n * k) as i32])?, 0)?.reshape(&[n as i32, k as i32, hidden])?;
        Ok(y.sum(&[1], false)?.reshape(&shape)?)
    }
}

/// The feed-forward part of a block: a dense gated MLP or a sparse MoE.
pub enum FeedForward {
    Dense(GatedMlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    fn forward_with(&self, x: &Array, kernels: RowKernels) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward_with(x, kernels),
            FeedForward::Sparse(moe) => moe.forward_with(x, kernels),
        }
    }
}

pub struct MoeBlock {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    ffn: FeedForward,
    /// The block as one kernel node for decode (quantized stacked experts,
    /// or a dense MLP, in layouts the kernel takes).
    fused: Option<FusedBlock>,
}

impl MoeBlock {
    fn new(input_layernorm: RmsNorm, self_attn: Attention, post_attention_layernorm: RmsNorm, ffn: FeedForward) -> Self {
        let parts = |mlp| FusedParts {
            input_norm: &input_layernorm,
            attn: &self_attn,
            mlp_norm: &post_attention_layernorm,
            mlp,
            output_norms: None,
        };
        let fused = match &ffn {
            FeedForward::Dense(mlp) => FusedBlock::new(parts(mlp)),
            FeedForward::Sparse(moe) => moe.stacked.as_ref().and_then(|stacked| {
                FusedBlock::new_moe(parts(&moe.experts[0]), &moe.router, stacked, moe.top_k as i32, moe.routing.kernel_code())
            }),
        };
        MoeBlock { input_layernorm, self_attn, post_attention_layernorm, ffn, fused }
    }

    fn forward(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array> {
        if let (Some(fused), RowKernels::ByCount) = (&self.fused, kernels) {
            if fused_takes(x) && x.dim(0) == 1 {
                if let Some(out) = fused.forward(x, cache)? {
                    return Ok(out);
                }
            }
        }
        let h = x.add(&self.self_attn.forward(&self.input_layernorm.forward(x)?, cache, kernels)?)?;
        Ok(h.add(&self.ffn.forward_with(&self.post_attention_layernorm.forward(&h)?, kernels)?)?)
    }
}

impl Block for MoeBlock {
    fn forward(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array> {
        MoeBlock::forward(self, x, cache, kernels)
    }

    /// Each sequence alone: the router and the expert grouping are per row anyway.
    fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array> {
        each_sequence_alone(x, caches, |x, cache| MoeBlock::forward(self, x, cache, RowKernels::ByCount))
    }

    /// One sequence only: `forward_batch` runs sequences one by one.
    fn stacked(&self, x: &Array) -> Option<&FusedBlock> {
        self.fused.as_ref().filter(|_| fused_takes(x) && x.dim(0) == 1)
    }

    fn describe(&self) -> String {
        let ffn = match &self.ffn {
            FeedForward::Dense(mlp) => mlp.describe(),
            FeedForward::Sparse(moe) => {
                let routing = match moe.routing {
                    Routing::SoftmaxOfTopK => "softmax over the top k",
                    Routing::TopKOfSoftmax { normalize: true } => "top k of the softmax, renormalized",
                    Routing::TopKOfSoftmax { normalize: false } => "top k of the softmax",
                };
                format!("MoE: {} experts, top {} ({routing}), each a {}", moe.experts.len(), moe.top_k, moe.experts[0].describe())
            }
        };
        let fused = if self.fused.is_some() { " [one fused kernel node at decode]" } else { "" };
        format!("pre-norm: {} → {ffn}{fused}", self.self_attn.describe())
    }
}

/// A llama-style pre-norm decoder whose feed-forward parts may be MoEs.
pub type MoeModel = Transformer<MoeBlock>;

impl MoeModel {
    /// `ffn(layer_scope, i)` loads layer i's feed-forward part; `qk_norm`
    /// adds Qwen3's per-head q/k norms.
    pub fn load(
        ctx: &LoadContext,
        args: &DecoderArgs,
        qk_norm: bool,
        ffn: impl Fn(&Scope, i32) -> Result<FeedForward>,
    ) -> Result<Self> {
        let spec = AttentionSpec {
            qk_norm_eps: qk_norm.then_some(args.rms_norm_eps),
            ..AttentionSpec::new(args.hidden_size, args.num_attention_heads, args.kv_heads(), args.head_dim())
        };
        load_pre_norm(ctx, args, spec, |parts, layer, i| {
            Ok(MoeBlock::new(parts.input_layernorm, parts.self_attn, parts.post_attention_layernorm, ffn(layer, i)?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Routing;

    #[test]
    fn routing_follows_mlx_lm() {
        let logits = [0.5f32, 2.0, -1.0, 1.0];
        // Mixtral: the top 2 logits (2.0, 1.0), softmax over those two.
        let mixtral = Routing::SoftmaxOfTopK.route(&logits, 2);
        let w = 1.0 / (1.0 + (-1.0f32).exp());
        assert_eq!(mixtral.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 3]);
        assert!((mixtral[0].1 - w).abs() < 1e-6 && (mixtral[1].1 - (1.0 - w)).abs() < 1e-6);
        // Qwen3-MoE: softmax over all four, then the top 2, renormalized or not.
        let sum: f32 = logits.iter().map(|x| x.exp()).sum();
        let raw = Routing::TopKOfSoftmax { normalize: false }.route(&logits, 2);
        assert!((raw[0].1 - 2f32.exp() / sum).abs() < 1e-6 && (raw[1].1 - 1f32.exp() / sum).abs() < 1e-6);
        let normed = Routing::TopKOfSoftmax { normalize: true }.route(&logits, 2);
        assert!((normed[0].1 - w).abs() < 1e-6 && (normed[0].1 + normed[1].1 - 1.0).abs() < 1e-6);
    }
}
