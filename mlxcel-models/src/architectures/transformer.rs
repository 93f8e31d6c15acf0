//! The model around a stack of blocks that every decoder family shares:
//! token embeddings (optionally scaled), the blocks over their KV caches, a
//! final norm, and the lm_head or the tied embeddings (optionally
//! soft-capped). Each family brings its own [`Block`].

use std::sync::{Arc, OnceLock};

use mlx_sys::kernels::{PagedSequence, PreparedDecoderStack};
use mlx_sys::Array;

use crate::cache::{KvCache, StandardKvCache};
use crate::error::{Error, Result};
use crate::model::{LanguageModel, ModelLayout, ModelShape};
use crate::nn::{softcap, Embedding, FusedBlock, Linear, RmsNorm, RowKernels};

/// The most blocks one stacked node runs. A node's outputs are each
/// other's siblings in MLX's graph, which costs the thread that builds and
/// retires the step work quadratic in their number (two pools a block): 30
/// blocks in one node spent about a third of that thread's time there.
pub const MAX_STACKED_BLOCKS: usize = 16;

/// One decoder block as [`Transformer`] runs it.
pub trait Block: Send + Sync {
    /// `x` [B, L, hidden] → [B, L, hidden], appending to `cache`, with the
    /// kernels chosen by `kernels` where the block honours the choice.
    fn forward(&self, x: &Array, cache: &mut dyn KvCache, kernels: RowKernels) -> Result<Array>;
    /// `x` [B, L, hidden] as B sequences, `caches[b]` sequence b's cache:
    /// each sequence's output exactly what [`forward`](Self::forward) gives
    /// it alone.
    fn forward_batch(&self, x: &Array, caches: &mut [&mut Box<dyn KvCache>]) -> Result<Array>;
    /// Whether prefill with [`RowKernels::Prefill`] computes every position
    /// the same however the prompt is cut into chunks (on the CPU).
    fn chunking_invariant(&self) -> bool {
        false
    }
    /// The block's layout in a line (norms, attention, MLP), for `mlxcel inspect`.
    fn describe(&self) -> String;
    /// The fused kernel block that computes this block for `x` exactly as
    /// [`forward_batch`](Self::forward_batch) does over paged caches of one
    /// pool, so that consecutive blocks can run as one node; None where
    /// `forward_batch` would not run it.
    fn stacked(&self, _x: &Array) -> Option<&FusedBlock> {
        None
    }
}

/// Embeddings, blocks, final norm and head: a [`LanguageModel`].
pub struct Transformer<B> {
    pub shape: ModelShape,
    pub embed_tokens: Embedding,
    /// Multiplies the embeddings (Gemma's `sqrt(hidden)`).
    pub embed_scale: Option<f64>,
    pub layers: Vec<B>,
    /// Each layer's sliding window, for [`LanguageModel::attention_windows`]
    /// (all None: every layer sees every position).
    pub windows: Vec<Option<usize>>,
    pub norm: RmsNorm,
    /// None: the tied embeddings.
    pub lm_head: Option<Linear>,
    /// Gemma 2's `final_logit_softcapping`: `cap * tanh(logits / cap)`.
    pub final_softcap: Option<f32>,
    /// The blocks' fused kernels as a few nodes per step (consecutive runs
    /// of at most [`MAX_STACKED_BLOCKS`]), made the first time every block
    /// runs its fused kernel (see `stacked`).
    pub stack: OnceLock<Vec<PreparedDecoderStack>>,
}

impl<B: Block> Transformer<B> {
    fn embed(&self, tokens: &Array) -> Result<Array> {
        let h = self.embed_tokens.forward(tokens, self.shape.dtype)?;
        Ok(match self.embed_scale {
            Some(scale) => h.mul_scalar(scale)?,
            None => h,
        })
    }

    fn check_caches(&self, caches: usize) -> Result<()> {
        if caches != self.layers.len() {
            return Err(Error::Mlx(format!("{caches} caches given for {} layers", self.layers.len())));
        }
        Ok(())
    }

    /// The final hidden states ([B, L, hidden]) after every block.
    fn hidden(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        self.hidden_from(self.embed(tokens)?, caches, kernels)
    }

    /// [`hidden`](Self::hidden) from input embeddings [B, L, hidden].
    fn hidden_from(&self, mut h: Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        self.check_caches(caches.len())?;
        if kernels == RowKernels::ByCount && h.ndim() == 3 && h.dim(0) == 1 {
            if let Some(out) = self.stacked(&h, &mut [caches])? {
                return Ok(out);
            }
        }
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = layer.forward(&h, cache.as_mut(), kernels)?;
        }
        Ok(h)
    }

    /// [`hidden`](Self::hidden) for B sequences over their own caches.
    fn hidden_batch(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        if caches.len() != tokens.dim(0) as usize {
            return Err(Error::Mlx(format!("{} cache sets given for a batch of {}", caches.len(), tokens.dim(0))));
        }
        for c in caches.iter() {
            self.check_caches(c.len())?;
        }
        let mut h = self.embed(tokens)?;
        if let Some(out) = self.stacked(&h, caches)? {
            return Ok(out);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let mut layer_caches: Vec<&mut Box<dyn KvCache>> = caches.iter_mut().map(|c| &mut c[i]).collect();
            h = layer.forward_batch(&h, &mut layer_caches)?;
        }
        Ok(h)
    }

    /// Every block over `rows` (row b: sequence b's caches, one per layer)
    /// in a few kernel nodes (runs of up to [`MAX_STACKED_BLOCKS`] blocks),
    /// when every block runs its fused kernel for `h` ([`Block::stacked`])
    /// and every cache is a layer of one paged pool with the layers of a row
    /// at one offset: exactly what the blocks compute one node each, for a
    /// few nodes in MLX's graph per step instead of one a layer. None
    /// (nothing written) otherwise.
    fn stacked(&self, h: &Array, rows: &mut [&mut [Box<dyn KvCache>]]) -> Result<Option<Array>> {
        if !crate::runtime::current().stacked_decode || rows.is_empty() {
            return Ok(None);
        }
        let Some(blocks) = self.layers.iter().map(|l| l.stacked(h)).collect::<Option<Vec<&FusedBlock>>>() else {
            return Ok(None);
        };
        // The blocks' fused kernels are the same whatever `h` is.
        let stacks = self.stack.get_or_init(|| {
            let nodes = blocks.len().div_ceil(MAX_STACKED_BLOCKS);
            let per_node = blocks.len().div_ceil(nodes.max(1)).max(1);
            blocks.chunks(per_node).map(|c| PreparedDecoderStack::new(c.iter().map(|f| f.prepared()))).collect()
        });
        let length = h.dim(1) as usize;
        let mut tables = Vec::with_capacity(rows.len());
        let mut offsets = Vec::with_capacity(rows.len());
        let mut pool = None;
        for row in rows.iter_mut() {
            let mut first = None;
            for cache in row.iter_mut() {
                let Some(paged) = cache.as_paged() else { return Ok(None) };
                let pool = pool.get_or_insert_with(|| paged.pool().clone());
                let same_row = first.as_ref().is_none_or(|(blocks, offset)| {
                    Arc::ptr_eq(blocks, paged.row_blocks()) && *offset == paged.offset()
                });
                if !Arc::ptr_eq(pool, paged.pool()) || !same_row {
                    return Ok(None);
                }
                first.get_or_insert_with(|| (paged.row_blocks().clone(), paged.offset()));
            }
            let Some(first) = row.first_mut().and_then(|c| c.as_paged()) else { return Ok(None) };
            tables.push(first.table_for(length)?);
            offsets.push(first.offset() as i32);
        }
        let sequences: Vec<PagedSequence<'_>> =
            tables.iter().zip(&offsets).map(|(table, &offset)| PagedSequence { table, offset }).collect();
        let mut pools = Vec::with_capacity(blocks.len());
        let mut specs = Vec::with_capacity(blocks.len());
        for (i, block) in blocks.iter().enumerate() {
            let Some(cache) = rows[0][i].as_paged() else { return Ok(None) };
            pools.push(cache.layer_pools()?);
            specs.push(block.paged_spec(cache));
        }
        let mut out = h.clone();
        let mut start = 0;
        for stack in stacks {
            let layers = start..start + stack.len();
            let (o, written) = stack.forward_paged(&out, &pools[layers.clone()], &sequences, &specs[layers])?;
            out = o;
            for (i, (keys, values)) in written.into_iter().enumerate() {
                if let Some(cache) = rows[0][start + i].as_paged() {
                    cache.set_layer_pools(keys, values);
                }
            }
            start += stack.len();
        }
        for row in rows.iter_mut() {
            for cache in row.iter_mut() {
                if let Some(paged) = cache.as_paged() {
                    paged.advance(length);
                }
            }
        }
        Ok(Some(out))
    }

    /// Final norm, head and cap; `per_sequence`: `h` [B, L, hidden] as B
    /// sequences, each exactly as alone.
    fn logits(&self, h: &Array, per_sequence: bool) -> Result<Array> {
        let h = self.norm.forward(h)?;
        let logits = match (&self.lm_head, per_sequence) {
            (Some(head), false) => head.forward(&h)?,
            (Some(head), true) => head.forward_per_sequence(&h)?,
            (None, false) => self.embed_tokens.as_linear(&h)?,
            (None, true) => self.embed_tokens.as_linear_per_sequence(&h)?,
        };
        match self.final_softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }
}

impl<B: Block> LanguageModel for Transformer<B> {
    fn forward(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        let h = self.hidden(tokens, caches, RowKernels::ByCount)?;
        self.logits(&h, false)
    }

    fn forward_last(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        self.forward_last_with(tokens, caches, RowKernels::ByCount)
    }

    fn forward_last_with(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        let h = self.hidden(tokens, caches, kernels)?;
        let length = h.dim(1);
        // The lm_head sees one row either way.
        self.logits(&h.slice_axis(1, length - 1, length)?, false)
    }

    fn chunking_invariant_prefill(&self) -> bool {
        mlx_sys::Device::default_device() == mlx_sys::Device::Cpu && self.layers.iter().all(|l| l.chunking_invariant())
    }

    fn reads_paged_kv(&self) -> bool {
        // The paged prefill attention takes head sizes that are multiples of 16.
        self.chunking_invariant_prefill()
            && self.shape.head_dim % 16 == 0
            && crate::runtime::current().prefill != crate::runtime::PrefillBackend::Mlx
    }

    fn forward_batch(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        let h = self.hidden_batch(tokens, caches)?;
        let length = h.dim(1);
        Ok(self.logits(&h.slice_axis(1, length - 1, length)?, true)?.squeeze(1)?)
    }

    fn forward_batch_all(&self, tokens: &Array, caches: &mut [&mut [Box<dyn KvCache>]]) -> Result<Array> {
        let h = self.hidden_batch(tokens, caches)?;
        let (batch, length) = (h.dim(0), h.dim(1));
        // Each position through the lm_head as a sequence of one, as at decode.
        let logits = self.logits(&h.reshape(&[batch * length, 1, -1])?, true)?;
        Ok(logits.reshape(&[batch, length, -1])?)
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        Transformer::embed(self, tokens)
    }

    fn forward_last_embedded(&self, h: &Array, caches: &mut [Box<dyn KvCache>], kernels: RowKernels) -> Result<Array> {
        let h = self.hidden_from(h.clone(), caches, kernels)?;
        let length = h.dim(1);
        self.logits(&h.slice_axis(1, length - 1, length)?, false)
    }

    fn forward_embedded(&self, h: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        let h = self.hidden_from(h.clone(), caches, RowKernels::ByCount)?;
        self.logits(&h, false)
    }

    fn forward_hidden(&self, tokens: &Array, caches: &mut [Box<dyn KvCache>]) -> Result<Array> {
        Ok(self.norm.forward(&self.hidden(tokens, caches, RowKernels::ByCount)?)?)
    }

    fn new_caches(&self) -> Vec<Box<dyn KvCache>> {
        (0..self.layers.len()).map(|_| Box::new(StandardKvCache::new()) as Box<dyn KvCache>).collect()
    }

    fn shape(&self) -> &ModelShape {
        &self.shape
    }

    fn attention_windows(&self) -> Vec<Option<usize>> {
        self.windows.clone()
    }

    fn layout(&self) -> ModelLayout {
        let mut head = if self.lm_head.is_some() { "lm_head".to_string() } else { "tied embeddings".to_string() };
        if let Some(scale) = self.embed_scale {
            head = format!("embeddings × {scale:.2}; {head}");
        }
        if let Some(cap) = self.final_softcap {
            head.push_str(&format!(", logit soft-cap {cap}"));
        }
        ModelLayout { layers: self.layers.iter().map(Block::describe).collect(), head }
    }
}

/// Each sequence of `x` [B, L, hidden] through `alone` with its own cache,
/// concatenated: a batch that a block's shared kernels decline.
pub fn each_sequence_alone(
    x: &Array,
    caches: &mut [&mut Box<dyn KvCache>],
    alone: impl Fn(&Array, &mut dyn KvCache) -> Result<Array>,
) -> Result<Array> {
    let rows = caches
        .iter_mut()
        .enumerate()
        .map(|(b, cache)| alone(&x.slice_axis(0, b as i32, b as i32 + 1)?, cache.as_mut()))
        .collect::<Result<Vec<_>>>()?;
    Ok(mlx_sys::concatenate(&rows, 0)?)
}
