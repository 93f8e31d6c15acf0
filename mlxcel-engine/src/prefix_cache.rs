//! Automatic prefix caching: the keys and values of prompt blocks that were
//! computed once are never computed again.
//!
//! A prompt is cut into blocks of [`BLOCK_TOKENS`] tokens. Each full block is
//! keyed, as in vLLM, by a hash chain: the hash of its parent block's key and
//! its own tokens, so a key names the whole prefix up to the block's end. A
//! new row adopts every cached block of its longest cached prefix (keeping at
//! least one prompt token to prefill, for its first logits) and prefills only
//! the rest; after its prefill, its prompt's full blocks are stored.
//!
//! Results never depend on a cache hit: only prompts prefilled with
//! [`RowKernels::Prefill`](mlxcel_models::nn::RowKernels) take part (longer
//! than [`MIN_PROMPT_TOKENS`], on models whose prefill is chunking invariant),
//! so a cached block holds exactly the keys and values a fresh prefill of the
//! same prefix computes. Blocks written by decode steps are not stored.
//!
//! Blocks are copied out of a row's cache when stored and into a new row's
//! cache when adopted (one copy per layer), so rows never share buffers and
//! any block may be evicted at any time: least recently used first, deepest
//! first among equals, whenever the store exceeds its byte budget.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use mlx_sys::{eval, stack, Array};
use mlxcel_models::{KvCache, StandardKvCache};

use crate::error::Result;

/// Tokens per block: small enough that a request reuses all but at most 15
/// tokens of its cached prefix, large enough that hashing and the per-block
/// copies cost little next to the prefill they replace.
pub const BLOCK_TOKENS: usize = 16;

/// Prompts this long or shorter run as one fused pass and skip the cache.
pub const MIN_PROMPT_TOKENS: usize = 32;

/// The default byte budget of the store.
pub const DEFAULT_BUDGET_BYTES: usize = 512 << 20;

struct Block {
    tokens: Vec<u32>,
    /// Keys and values of every layer: [layers, kv_heads, BLOCK_TOKENS, head_dim].
    keys: Array,
    values: Array,
    bytes: usize,
    depth: usize,
    last_used: u64,
}

/// The block store of one engine; see the module docs. Owned by the
/// scheduler thread.
pub struct PrefixCache {
    blocks: HashMap<u64, Block>,
    budget_bytes: usize,
    used_bytes: usize,
    clock: u64,
}

/// The hash chain of `prompt`'s full blocks.
pub fn block_hashes(prompt: &[u32]) -> Vec<u64> {
    let mut parent = 0u64;
    prompt
        .chunks_exact(BLOCK_TOKENS)
        .map(|tokens| {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            tokens.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

impl PrefixCache {
    pub fn new(budget_bytes: usize) -> Self {
        PrefixCache { blocks: HashMap::new(), budget_bytes, used_bytes: 0, clock: 0 }
    }

    /// Bytes held by stored blocks.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Stored blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Caches holding the longest cached prefix of `prompt` (at most
    /// `max_blocks` blocks), and its length in tokens; None on a miss.
    pub fn adopt(&mut self, prompt: &[u32], hashes: &[u64], max_blocks: usize) -> Result<Option<(Vec<Box<dyn KvCache>>, usize)>> {
        let mut found = Vec::new();
        for (i, hash) in hashes.iter().take(max_blocks).enumerate() {
            match self.blocks.get(hash) {
                Some(b) if b.tokens == prompt[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS] => found.push(*hash),
                _ => break,
            }
        }
        if found.is_empty() {
            return Ok(None);
        }
        self.clock += 1;
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for hash in &found {
            let b = self.blocks.get_mut(hash).expect("found above");
            b.last_used = self.clock;
            keys.push(b.keys.clone());
            values.push(b.values.clone());
        }
        // One [1, kv_heads, n, head_dim] cache per layer, each built by one
        // copy of that layer's slice of every block.
        let layers = keys[0].dim(0);
        let mut caches: Vec<Box<dyn KvCache>> = Vec::with_capacity(layers as usize);
        for l in 0..layers {
            let layer = |blocks: &[Array]| -> Result<Vec<Array>> {
                Ok(blocks.iter().map(|b| b.slice_axis(0, l, l + 1)).collect::<mlx_sys::Result<Vec<_>>>()?)
            };
            caches.push(Box::new(StandardKvCache::with_prefix_parts(&layer(&keys)?, &layer(&values)?)?));
        }
        eval(caches.iter().flat_map(|c| c.state()).collect::<Vec<_>>().iter())?;
        Ok(Some((caches, found.len() * BLOCK_TOKENS)))
    }

    /// Stores the full blocks of `prompt` that are not stored yet, copied
    /// out of `caches` (which hold at least the prompt's positions).
    pub fn store(&mut self, prompt: &[u32], hashes: &[u64], caches: &[Box<dyn KvCache>]) -> Result<()> {
        let missing: Vec<usize> = (0..hashes.len()).filter(|&i| !self.blocks.contains_key(&hashes[i])).collect();
        let (Some(&first), Some(&last)) = (missing.first(), missing.last()) else { return Ok(()) };
        let (start, end) = ((first * BLOCK_TOKENS) as i32, ((last + 1) * BLOCK_TOKENS) as i32);
        // Each layer's positions start..end as [kv_heads, blocks, BLOCK, D],
        // stacked over layers: [layers, kv_heads, blocks, BLOCK, D].
        let gather = |which: usize| -> Result<Array> {
            let per_layer = caches
                .iter()
                .map(|c| {
                    let a = c.state()[which].slice_axis(2, start, end)?;
                    let (h, d) = (a.dim(1), a.dim(3));
                    a.reshape(&[h, (end - start) / BLOCK_TOKENS as i32, BLOCK_TOKENS as i32, d])
                })
                .collect::<mlx_sys::Result<Vec<_>>>()?;
            Ok(stack(&per_layer, 0)?)
        };
        let (all_keys, all_values) = (gather(0)?, gather(1)?);
        self.clock += 1;
        let mut new = Vec::with_capacity(missing.len());
        for &i in &missing {
            // A copy of the block alone (x * 1 is exact), so that evicting it
            // frees its bytes.
            let at = (i - first) as i32;
            let block = |all: &Array| -> Result<Array> { Ok(all.slice_axis(2, at, at + 1)?.squeeze(2)?.mul_scalar(1.0)?) };
            new.push((i, block(&all_keys)?, block(&all_values)?));
        }
        eval(new.iter().flat_map(|(_, k, v)| [k, v]))?;
        for (i, keys, values) in new {
            let bytes = keys.nbytes() + values.nbytes();
            self.used_bytes += bytes;
            let tokens = prompt[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS].to_vec();
            self.blocks.insert(hashes[i], Block { tokens, keys, values, bytes, depth: i, last_used: self.clock });
        }
        self.evict();
        Ok(())
    }

    /// Drops blocks until the store fits its budget.
    fn evict(&mut self) {
        while self.used_bytes > self.budget_bytes {
            let Some((&hash, _)) = self.blocks.iter().min_by_key(|(_, b)| (b.last_used, std::cmp::Reverse(b.depth))) else { break };
            let block = self.blocks.remove(&hash).expect("present");
            self.used_bytes -= block.bytes;
        }
    }
}
