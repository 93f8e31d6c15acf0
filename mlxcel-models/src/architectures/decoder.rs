//! The decoder-only transformer that the llama family shares: embeddings,
//! pre-norm blocks, a final norm and an (optionally tied) lm_head.

use mlx_sys::Array;
use serde::Deserialize;

use crate::cache::{KvCache, StandardKvCache};
use crate::error::{Error, Result};
use crate::model::{LanguageModel, ModelShape};
use crate::nn::{Attention, AttentionSpec, DecoderBlock, Embedding, GatedMlp, Linear, RmsNorm, Rope, RopeScaling, RowKernels};
use super::LoadContext;

/// Hugging Face config keys common to llama-style models.
#[derive(Debug, Clone, Deserialize)]
pub struct DecoderArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<i32>,
}

fn default_rope_theta() -> f32 {
    10000.0
}

impl DecoderArgs {
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> i32 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
            ("vocab_size", self.vocab_size),
        ];
        if let Some((name, value)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(format!("`{name}` must be positive, got {value}"));
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            return Err(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        Ok(())
    }
}

/// Per-architecture choices on top of [`DecoderArgs`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DecoderOptions {
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub qk_norm: bool,
}

pub struct DecoderModel {
    shape: ModelShape,
    embed_tokens: Embedding,
    layers: Vec<DecoderBlock>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
}

impl DecoderModel {
    pub fn load(ctx: &LoadContext, args: &DecoderArgs, options: DecoderOptions) -> Result<Self> {
        let (root, config_path) = (&ctx.scope, ctx.config_path);
        args.validate().map_err(|message| Error::InvalidConfig { path: config_path.into(), message })?;
        let rope = Rope::new(args.head_dim(), args.rope_theta, args.rope_traditional, args.rope_scaling.as_ref())
            .map_err(|message| Error::Unsupported { path: config_path.into(), message })?;
        let model = root.pp("model");
        let spec = AttentionSpec {
            qkv_bias: options.qkv_bias,
            o_bias: options.o_bias,
            qk_norm_eps: options.qk_norm.then_some(args.rms_norm_eps),
            ..AttentionSpec::new(args.hidden_size, args.num_attention_heads, args.kv_heads(), args.head_dim())
        };
        let layers = (0..args.num_hidden_layers)
            .map(|i| {
                let layer = model.pp("layers").pp(i);
                Ok(DecoderBlock::new(
                    RmsNorm::load(&layer.pp("input_layernorm"), args.hidden_size, args.rms_norm_eps)?,
                    Attention::load(&layer.pp("self_attn"), spec.clone(), rope.clone())?,
                    RmsNorm::load(&layer.pp("post_attention_layernorm"), args.hidden_size, args.rms_norm_eps)?,
                    GatedMlp::load(&layer.pp("mlp"), args.hidden_size, args.intermediate_size, options.mlp_bias)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        // Tied exactly when the config says so, or, when it is silent, when
        // the checkpoint has no lm_head.
        let tied = args.tie_word_embeddings.unwrap_or(!root.contains("lm_head.weight"));
        // What mlx-lm's llama, qwen2 and qwen3 `sanitize` drop: precomputed RoPE
        // frequencies, and an lm_head the config ties to the embeddings.
        root.weights.skip("self_attn.rotary_emb.inv_freq");
        if tied {
            root.weights.skip("lm_head.");
        }
        let lm_head = if tied {
            None
        } else {
            Some(Linear::load(&root.pp("lm_head"), args.hidden_size, args.vocab_size, false)?)
        };
        Ok(DecoderModel {
            shape: ModelShape {
                num_layers: args.num_hidden_layers as usize,
                hidden_size: args.hidden_size as usize,
                kv_heads: args.kv_heads() as usize,
                head_dim: args.head_dim() as usize,
                vocab_size: args.vocab_size as usize,
                dtype: root.dtype,
                max_position_embeddings: args.max_position_embeddings.map(|n| n as usize),
            },
            embed_tokens: Embedding::load(&model.pp("embed_tokens"), args.vocab_size, args.hidden_size)?,
            layers,
            norm: RmsNorm::load(&model.pp("norm"), args.hidden_size, args.rms_norm_eps)?,
            lm_head,
        })
    }
}

impl DecoderModel {
    /// The final hidden states ([B, L, hidden]) after every block.
    fn hidden(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        if caches.len() != self.layers.len() {
            return Err(Error::Mlx(format!("{} caches given for {} layers", caches.len(), self.layers.len())));
        }
        let mut h = self.embed_tokens.forward(tokens, self.shape.dtype)?;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = layer.forward_with(&h, cache.as_mut(), kernels)?;
        }
        Ok(h)
    }

    /// [`hidden`](Self::hidden) for B sequences over their own caches.
    fn hidden_batch(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        if let Some(c) = caches.iter().find(|c| c.len() != self.layers.len()) {
            return Err(Error::Mlx(format!("{} caches given for {} layers", c.len(), self.layers.len())));
        }
        let mut h = self.embed_tokens.forward(tokens, self.shape.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut layer_caches: Vec<&mut Box<dyn KvCache>> = caches.iter_mut().map(|c| &mut c[i]).collect();
            h = layer.forward_batch(&h, &mut layer_caches)?;
        }
        Ok(h)
    }

    fn logits(&self, h: &Array) -> Result<Array> {
        let h = self.norm.forward(h)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed_tokens.as_linear(&h),
        }
    }
}

impl LanguageModel for DecoderModel {
    fn forward(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        let h = self.hidden(tokens, caches, RowKernels::ByCount)?;
        self.logits(&h)
    }

    fn forward_last(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        self.forward_last_with(tokens, caches, RowKernels::ByCount)
    }

    fn forward_last_with(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        let h = self.hidden(tokens, caches, kernels)?;
        let length = h.dim(1);
        // The lm_head sees one row either way.
        self.logits(&h.slice_axis(1, length - 1, length)?)
    }

    fn chunking_invariant_prefill(&self) -> bool {
        mlx_sys::Device::default_device() == mlx_sys::Device::Cpu && self.layers.iter().all(|l| l.is_fused())
    }

    fn reads_paged_kv(&self) -> bool {
        // The paged prefill attention takes head sizes that are multiples of 16.
        self.chunking_invariant_prefill()
            && self.shape.head_dim % 16 == 0
            && crate::runtime::current().prefill != crate::runtime::PrefillBackend::Mlx
    }

    fn forward_batch(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        if caches.len() != tokens.dim(0) as usize {
            return Err(Error::Mlx(format!("{} cache sets given for a batch of {}", caches.len(), tokens.dim(0))));
        }
        let h = self.hidden_batch(tokens, caches)?;
        let length = h.dim(1);
        let h = self.norm.forward(&h.slice_axis(1, length - 1, length)?)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward_per_sequence(&h)?,
            None => self.embed_tokens.as_linear_per_sequence(&h)?,
        };
        Ok(logits.squeeze(1)?)
    }

    fn forward_batch_all(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        if caches.len() != tokens.dim(0) as usize {
            return Err(Error::Mlx(format!("{} cache sets given for a batch of {}", caches.len(), tokens.dim(0))));
        }
        let h = self.hidden_batch(tokens, caches)?;
        let (batch, length) = (h.dim(0), h.dim(1));
        // Each position through the lm_head as a sequence of one, as at decode.
        let h = self.norm.forward(&h)?.reshape(&[batch * length, 1, -1])?;
        let logits = match &self.lm_head {
            Some(head) => head.forward_per_sequence(&h)?,
            None => self.embed_tokens.as_linear_per_sequence(&h)?,
        };
        Ok(logits.reshape(&[batch, length, -1])?)
    }

    fn new_caches(&self) -> Vec<Box<dyn KvCache>> {
        (0..self.layers.len()).map(|_| Box::new(StandardKvCache::new()) as Box<dyn KvCache>).collect()
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }
}

/// Parses an architecture's args from config.json, naming the file on error.
pub fn parse_args<T: serde::de::DeserializeOwned>(config: &serde_json::Value, path: &std::path::Path) -> Result<T> {
    T::deserialize(config).map_err(|e| Error::InvalidConfig { path: path.into(), message: e.to_string() })
}
