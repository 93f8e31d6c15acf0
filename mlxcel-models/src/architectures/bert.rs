//! BERT encoders (sentence-transformers' MiniLM, BGE, E5 and the like), as
//! mlx-embeddings' `bert` model computes them: token + position + token-type
//! embeddings, post-norm layers with full (bidirectional) attention. XLM-
//! RoBERTa (`xlm-roberta`: multilingual E5, BGE-M3 and the like) is the same
//! network with positions numbered from `pad_token_id + 1`.
//!
//! Sequences run packed, never padded: the linear layers see every token of
//! the batch as one matrix, attention runs per sequence over its own tokens.
//! A sequence's hidden states are then the same whatever it is batched with
//! (the linear kernels compute each row alone; see `tests/embeddings.rs`).

use mlx_sys::fast::{self, AttentionMask};
use mlx_sys::{Array, Dtype};
use serde::Deserialize;

use super::decoder::parse_args;
use super::LoadContext;
use crate::error::{Error, Result};
use crate::nn::{Embedding, LayerNorm, Linear};
use crate::weights::Scope;

/// `config.json` of a BERT checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct BertArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub intermediate_size: i32,
    pub max_position_embeddings: i32,
    pub vocab_size: i32,
    #[serde(default = "default_type_vocab_size")]
    pub type_vocab_size: i32,
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f32,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Only `absolute` (learned positions) is supported.
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    pub model_type: String,
    /// XLM-RoBERTa's positions start after it (default 1).
    pub pad_token_id: Option<i32>,
}

impl BertArgs {
    /// The first position id: 0 for BERT; `pad_token_id + 1` for
    /// XLM-RoBERTa, which numbers a sequence's tokens after the pad id.
    pub fn position_offset(&self) -> i32 {
        if self.model_type == "xlm-roberta" {
            self.pad_token_id.unwrap_or(1) + 1
        } else {
            0
        }
    }
}

fn default_type_vocab_size() -> i32 {
    2
}

fn default_layer_norm_eps() -> f32 {
    1e-12
}

fn default_hidden_act() -> String {
    "gelu".into()
}

/// The linear kernels switch loops below this many rows; packed batches are
/// padded up to it so that a short text alone runs the same loop as in a batch.
const MIN_ROWS: usize = 16;

#[derive(Debug, Clone, Copy)]
enum HiddenAct {
    /// `x * Φ(x)` with the exact normal CDF (`gelu`, MLX's `nn.GELU()`).
    Gelu,
    /// GELU's tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    Relu,
}

impl HiddenAct {
    fn parse(name: &str, ctx: &LoadContext) -> Result<Self> {
        match name {
            "gelu" => Ok(HiddenAct::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(HiddenAct::GeluTanh),
            "relu" => Ok(HiddenAct::Relu),
            other => Err(Error::InvalidConfig {
                path: ctx.config_path.into(),
                message: format!("hidden_act `{other}` is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu)"),
            }),
        }
    }

    fn apply(self, x: &Array) -> Result<Array> {
        match self {
            HiddenAct::Gelu => Ok(mlx_sys::kernels::gelu_erf(x)?),
            HiddenAct::GeluTanh => Ok(crate::nn::Activation::GeluTanh.apply(x)?),
            HiddenAct::Relu => Ok(x.maximum(&Array::scalar(0.0, x.dtype())?)?),
        }
    }
}

struct BertLayer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_out: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
}

impl BertLayer {
    fn load(scope: &Scope, args: &BertArgs) -> Result<Self> {
        let (hidden, inner, eps) = (args.hidden_size, args.intermediate_size, args.layer_norm_eps);
        let attention = scope.pp("attention");
        let own = attention.pp("self");
        Ok(BertLayer {
            query: Linear::load(&own.pp("query"), hidden, hidden, true)?,
            key: Linear::load(&own.pp("key"), hidden, hidden, true)?,
            value: Linear::load(&own.pp("value"), hidden, hidden, true)?,
            attention_out: Linear::load(&attention.pp("output").pp("dense"), hidden, hidden, true)?,
            attention_norm: LayerNorm::load(&attention.pp("output").pp("LayerNorm"), hidden, eps)?,
            intermediate: Linear::load(&scope.pp("intermediate").pp("dense"), hidden, inner, true)?,
            output: Linear::load(&scope.pp("output").pp("dense"), inner, hidden, true)?,
            output_norm: LayerNorm::load(&scope.pp("output").pp("LayerNorm"), hidden, eps)?,
        })
    }
}

/// A loaded BERT encoder. Holds only evaluated arrays: one encoder serves
/// any number of threads at once.
pub struct Bert {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    /// The token-type table, and its row 0 (what single-segment inputs add).
    token_types: Array,
    token_type: Array,
    /// `tanh(dense(h[CLS]))`, loaded for cross-encoders only.
    pooler: Option<Linear>,
    embeddings_norm: LayerNorm,
    layers: Vec<BertLayer>,
    act: HiddenAct,
    args: BertArgs,
}

impl Bert {
    /// Builds the encoder from a checkpoint's tensors, with or without the
    /// `bert.` (`roberta.` for XLM-RoBERTa) prefix that Hugging Face's task
    /// models save. The pre-training
    /// heads are skipped, and the pooler too unless `with_pooler` (sentence
    /// embeddings pool the hidden states; a cross-encoder's classifier reads
    /// the pooler's output).
    pub fn load(ctx: &LoadContext, with_pooler: bool) -> Result<Bert> {
        let args: BertArgs = parse_args(ctx.config, ctx.config_path)?;
        if let Some(kind) = args.position_embedding_type.as_deref().filter(|k| *k != "absolute") {
            return Err(Error::InvalidConfig {
                path: ctx.config_path.into(),
                message: format!("position_embedding_type `{kind}` is not supported (absolute)"),
            });
        }
        if args.hidden_size % args.num_attention_heads.max(1) != 0 {
            return Err(Error::InvalidConfig {
                path: ctx.config_path.into(),
                message: format!("hidden_size {} is not a multiple of num_attention_heads {}", args.hidden_size, args.num_attention_heads),
            });
        }
        let act = HiddenAct::parse(&args.hidden_act, ctx)?;
        let weights = ctx.scope.weights;
        // Unused by mean/CLS pooling of the hidden states, as in mlx-embeddings.
        // (`lm_head.`: XLM-RoBERTa's masked-LM head.)
        for part in ["embeddings.position_ids", "cls.predictions.", "cls.seq_relationship.", "lm_head."] {
            weights.skip(part);
        }
        if !with_pooler {
            weights.skip("pooler.");
        }
        if args.position_offset() >= args.max_position_embeddings {
            return Err(Error::InvalidConfig {
                path: ctx.config_path.into(),
                message: format!("pad_token_id {:?} leaves no positions below max_position_embeddings {}", args.pad_token_id, args.max_position_embeddings),
            });
        }
        let prefix = ["bert", "roberta"].into_iter().find(|p| weights.contains(&format!("{p}.embeddings.word_embeddings.weight")));
        let root = match prefix {
            Some(prefix) => ctx.scope.pp(prefix),
            None => ctx.scope.clone(),
        };
        let embeddings = root.pp("embeddings");
        let hidden = args.hidden_size;
        let token_types = embeddings.pp("token_type_embeddings").get("weight", &[args.type_vocab_size, hidden])?;
        // Evaluated here: a lazy node would belong to this thread's stream.
        let token_type = token_types.slice_axis(0, 0, 1)?;
        token_type.eval()?;
        let pooler = if with_pooler { Some(Linear::load(&root.pp("pooler").pp("dense"), hidden, hidden, true)?) } else { None };
        let layers = (0..args.num_hidden_layers)
            .map(|i| BertLayer::load(&root.pp("encoder").pp("layer").pp(i), &args))
            .collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            word_embeddings: Embedding::load(&embeddings.pp("word_embeddings"), args.vocab_size, hidden)?,
            position_embeddings: Embedding::load(&embeddings.pp("position_embeddings"), args.max_position_embeddings, hidden)?,
            token_types,
            token_type,
            pooler,
            embeddings_norm: LayerNorm::load(&embeddings.pp("LayerNorm"), hidden, args.layer_norm_eps)?,
            layers,
            act,
            args,
        })
    }

    pub fn args(&self) -> &BertArgs {
        &self.args
    }

    /// Most tokens one sequence may have (the learned positions).
    pub fn max_positions(&self) -> usize {
        (self.args.max_position_embeddings - self.args.position_offset()) as usize
    }

    /// The final hidden states of each sequence, packed: `sequences` of token
    /// ids (each 1..=[`max_positions`](Self::max_positions) long) → one
    /// lazy `[Σ len, hidden]` float32 array (rows in order, padding rows cut off).
    /// Every token has type 0 unless `type_ids` gives each sequence's.
    pub fn forward(&self, sequences: &[&[u32]], type_ids: Option<&[&[u32]]>) -> Result<Array> {
        let total: usize = sequences.iter().map(|s| s.len()).sum();
        let rows = total.max(MIN_ROWS);
        let mut ids = Vec::with_capacity(rows);
        let mut positions = Vec::with_capacity(rows);
        for sequence in sequences {
            if sequence.is_empty() || sequence.len() > self.max_positions() {
                return Err(Error::InvalidInput(format!(
                    "a sequence of {} tokens (this BERT takes 1 to {})",
                    sequence.len(),
                    self.max_positions()
                )));
            }
            ids.extend(sequence.iter().map(|&t| t as i32));
            let first = self.args.position_offset();
            positions.extend(first..first + sequence.len() as i32);
        }
        ids.resize(rows, 0);
        positions.resize(rows, 0);
        let ids = Array::from_slice(&ids, &[rows as i32])?;
        let positions = Array::from_slice(&positions, &[rows as i32])?;
        let dtype = Dtype::Float32;
        let x = self.word_embeddings.forward(&ids, dtype)?;
        let x = x.add(&self.position_embeddings.forward(&positions, dtype)?)?;
        let x = match type_ids {
            None => x.add(&self.token_type)?,
            Some(types) => {
                let limit = self.args.type_vocab_size as u32;
                let mut packed: Vec<i32> = Vec::with_capacity(rows);
                for (sequence, types) in sequences.iter().zip(types) {
                    if types.len() != sequence.len() || types.iter().any(|&t| t >= limit) {
                        return Err(Error::InvalidInput(format!(
                            "{} token types for {} tokens (each below {limit})",
                            types.len(),
                            sequence.len()
                        )));
                    }
                    packed.extend(types.iter().map(|&t| t as i32));
                }
                packed.resize(rows, 0);
                x.add(&self.token_types.take(&Array::from_slice(&packed, &[rows as i32])?, 0)?)?
            }
        };
        let mut x = self.embeddings_norm.forward(&x)?;
        for layer in &self.layers {
            x = self.layer_forward(layer, &x, sequences, rows - total)?;
        }
        Ok(x.slice_axis(0, 0, total as i32)?)
    }

    /// The pooler's output for each packed sequence of `hidden` (from
    /// [`forward`](Self::forward)): `tanh(dense(h[CLS]))`, `[R, hidden]`
    /// where the first B rows are the sequences' and R is at least 16 (the
    /// padding rows repeat the first: a head on these rows then runs the
    /// same kernel loop for one sequence as for many). An error unless
    /// loaded `with_pooler`.
    pub fn pool_cls(&self, hidden: &Array, sequences: &[&[u32]]) -> Result<Array> {
        let pooler = self.pooler.as_ref().ok_or_else(|| Error::InvalidInput("this encoder was loaded without its pooler".into()))?;
        Ok(pooler.forward(&self.first_tokens(hidden, sequences)?)?.tanh()?)
    }

    /// Each packed sequence's first state (`[CLS]`, `<s>`) from `hidden`,
    /// `[R, hidden]` with R at least 16 as in [`pool_cls`](Self::pool_cls).
    pub fn first_tokens(&self, hidden: &Array, sequences: &[&[u32]]) -> Result<Array> {
        let mut starts = Vec::with_capacity(sequences.len().max(MIN_ROWS));
        let mut start = 0i32;
        for sequence in sequences {
            starts.push(start);
            start += sequence.len() as i32;
        }
        starts.resize(starts.len().max(MIN_ROWS), 0);
        Ok(hidden.take(&Array::from_slice(&starts, &[starts.len() as i32])?, 0)?)
    }

    fn layer_forward(&self, layer: &BertLayer, x: &Array, sequences: &[&[u32]], padding: usize) -> Result<Array> {
        let (heads, hidden) = (self.args.num_attention_heads, self.args.hidden_size);
        let head_dim = hidden / heads;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let (q, k, v) = (layer.query.forward(x)?, layer.key.forward(x)?, layer.value.forward(x)?);
        let mut contexts = Vec::with_capacity(sequences.len() + 1);
        let mut start = 0i32;
        for sequence in sequences {
            let len = sequence.len() as i32;
            let split = |a: &Array| -> Result<Array> {
                Ok(a.slice_axis(0, start, start + len)?.reshape(&[1, len, heads, head_dim])?.transpose(&[0, 2, 1, 3])?)
            };
            let context = fast::scaled_dot_product_attention(&split(&q)?, &split(&k)?, &split(&v)?, scale, AttentionMask::None)?;
            contexts.push(context.transpose(&[0, 2, 1, 3])?.reshape(&[len, hidden])?);
            start += len;
        }
        if padding > 0 {
            contexts.push(Array::zeros(&[padding as i32, hidden], Dtype::Float32)?);
        }
        let context = mlx_sys::concatenate(&contexts, 0)?;
        let attended = layer.attention_norm.forward(&layer.attention_out.forward(&context)?.add(x)?)?;
        let inner = self.act.apply(&layer.intermediate.forward(&attended)?)?;
        layer.output_norm.forward(&layer.output.forward(&inner)?.add(&attended)?)
    }
}
