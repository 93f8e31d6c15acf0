//! Automatic prefix caching: the keys and values of prompt blocks that were
//! computed once are never computed again.
//!
//! A prompt is cut into blocks of [`BLOCK_TOKENS`] tokens, the blocks of the
//! paged KV pool ([`mlxcel_models::paged`]). Each full block is keyed, as in
//! vLLM, by a hash chain: the hash of its parent block's key and its own
//! tokens, so a key names the whole prefix up to the block's end. A new row
//! adopts every cached block of its longest cached prefix (keeping at least
//! one prompt token to prefill, for its first logits) into its block table,
//! without a copy, and prefills only the rest; after its prefill, its
//! prompt's full blocks are cached in place. Unreferenced cached blocks are
//! evicted least recently used first (deepest first among equals) when the
//! pool needs room.
//!
//! Results never depend on a cache hit: only prompts prefilled with
//! [`RowKernels::Prefill`](mlxcel_models::nn::RowKernels) take part (longer
//! than [`MIN_PROMPT_TOKENS`], on models whose prefill is chunking invariant
//! and reads the paged pool), so a cached block holds exactly the keys and
//! values a fresh prefill of the same prefix computes. Blocks written by
//! decode steps are not cached, and no row writes a cached block again.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use mlxcel_models::paged::{BlockId, KvPool};

pub use mlxcel_models::paged::BLOCK_TOKENS;

/// Prompts this long or shorter run as one fused pass and skip the cache.
pub const MIN_PROMPT_TOKENS: usize = 32;

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

/// The cached blocks of the longest cached prefix of `prompt` (at most
/// `max_blocks`), each with a new reference for the caller's table.
pub fn adopt(pool: &KvPool, prompt: &[u32], hashes: &[u64], max_blocks: usize) -> Vec<BlockId> {
    let mut found = Vec::new();
    for (i, &hash) in hashes.iter().take(max_blocks).enumerate() {
        match pool.lookup(hash, &prompt[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS]) {
            Some(block) => found.push(block),
            None => break,
        }
    }
    found
}

/// Caches the full blocks of `prompt` that are not cached yet: block `i` is
/// `table[i]`, written by the prefill of this prompt (`-1`: handed back
/// under a window, after it was cached).
pub fn store(pool: &KvPool, prompt: &[u32], hashes: &[u64], table: &[BlockId]) {
    for (i, (&hash, &block)) in hashes.iter().zip(table).enumerate() {
        if block >= 0 && !pool.is_cached(hash) {
            pool.cache(hash, block, &prompt[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS], i);
        }
    }
}
