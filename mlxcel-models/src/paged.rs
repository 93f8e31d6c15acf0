//! The paged KV pool: every row's keys and values live in fixed-size blocks
//! of one pool per model, read and written in place by the CPU kernels
//! through each row's block table.
//!
//! - A block holds [`BLOCK_TOKENS`] positions of every layer: block `i` is
//!   slice `i` of axis 1 of each layer's key and value pools, `f32
//!   [kv_heads, blocks, BLOCK_TOKENS, head_dim]` (a head's blocks adjacent,
//!   so a row's blocks, taken lowest first, read as one stream).
//! - The pool has a byte budget, fixed when it is made. Its memory is an
//!   anonymous mapping: pages become resident when a block is first written
//!   and are handed back when a block is freed, so the resident bytes follow
//!   the blocks in use, not the budget.
//! - Blocks are reference counted. A full prompt block can be *cached* under
//!   its hash-chain key (see the engine's prefix cache): rows that share the
//!   prefix point at the same block, and an unreferenced cached block stays
//!   until the pool needs room (least recently used first).
//! - Rows reserve the blocks they may need before they start
//!   ([`KvPool::reserve`]), so a running row never finds the pool empty.
//! - A pool may have a sliding window ([`KvWindow`]): every token sees the
//!   first `keep` positions and the latest `window`. A row then hands back
//!   each block that no later token sees, one step after the last node that
//!   read it was built (that node may still be running), so a row holds at
//!   most [`KvPool::window_blocks`] blocks however long it runs.
//!
//! - A pool keeps its keys and values in f32 or, as mlx-lm's
//!   `QuantizedKVCache` (group 64, 8 bits), in 8 bits with an f32 scale and
//!   bias per 64 features ([`KvFormat`]): 72 bytes per position and head of
//!   64 features instead of 256. An 8-bit pool is one mapping for every
//!   layer, block-major, so a freed block is one run of whole pages.
//!
//! Models whose kernels cannot read a paged pool (GPUs, dense checkpoints)
//! get an accounting-only pool: the same budget, reservations and errors,
//! over their contiguous caches.
//!
//! Thread safety: `KvPool` is `Send + Sync` (one mutex); the engine's
//! scheduler thread is its only user in practice.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use mlx_sys::kernels::{self, KvWindow};
use mlx_sys::Array;

use crate::cache::{AppendWriter, CacheLayout, KvCache};
use crate::model::ModelShape;

/// Positions per block: a power of two >= 8 (the kernels read keys 8 at a time
/// and never across a block), small enough that a row wastes at most 15
/// positions and a shared prefix loses at most 15 tokens of reuse, large
/// enough that a table stays short (a 4,096-token row has 256 entries) and
/// each block is whole pages for common head sizes (SmolLM2: 12 KiB per
/// layer and tensor).
pub const BLOCK_TOKENS: usize = 16;

/// The default byte budget of a model's pool: 1 GiB, about 23,000
/// positions of SmolLM2-135M or 18,700 of Qwen2.5-1.5B in f32. Only the
/// blocks in use are resident.
pub const DEFAULT_POOL_BYTES: usize = 1 << 30;

pub type BlockId = i32;

/// How a pool keeps its keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvFormat {
    /// f32, as the kernels compute them.
    #[default]
    F32,
    /// mlx-lm's `QuantizedKVCache` with group 64 and 8 bits: each
    /// position's 64-feature groups as uint8 with an f32 scale and bias
    /// (quantized as `mx.quantize` does). Needs head_dim a multiple of 64.
    Q8,
}

impl KvFormat {
    /// Whether a pool over `shape` (`paged` or not) can keep this format.
    pub fn check(self, shape: &ModelShape, paged: bool) -> crate::Result<()> {
        if self == KvFormat::Q8 {
            if !paged {
                return Err(crate::Error::Mlx(
                    "an 8-bit KV cache needs the paged KV pool, which this model's kernels (CPU, quantized) do not read".into(),
                ));
            }
            if shape.head_dim % 64 != 0 {
                return Err(crate::Error::Mlx(format!(
                    "an 8-bit KV cache quantizes groups of 64 features; this model's head_dim {} is not a multiple of 64",
                    shape.head_dim
                )));
            }
        }
        Ok(())
    }

    /// Bits per stored feature (mlx-lm's `kv_bits`), 32 for f32.
    /// Bytes of one block ([`BLOCK_TOKENS`] positions of every layer) of `shape` in this format.
    pub fn block_bytes(self, shape: &ModelShape) -> usize {
        match self {
            KvFormat::F32 => 2 * shape.num_layers * shape.kv_heads * BLOCK_TOKENS * shape.head_dim * std::mem::size_of::<f32>(),
            KvFormat::Q8 => kernels::kv_q8_block_bytes(shape.num_layers, shape.kv_heads, BLOCK_TOKENS, shape.head_dim),
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            KvFormat::F32 => 32,
            KvFormat::Q8 => 8,
        }
    }
}

/// How much a pool holds, in blocks of [`KvPool::block_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    /// Blocks in the pool.
    pub total: usize,
    /// Blocks referenced by rows.
    pub in_use: usize,
    /// Cached blocks no row references (evicted first when room is needed).
    pub cached_idle: usize,
    /// Blocks promised to rows and not yet taken.
    pub reserved: usize,
    /// Free blocks whose pages are still resident: they are handed back
    /// once the node that may still read them has run.
    pub unmapping: usize,
}

impl PoolUsage {
    /// Blocks a new reservation can take.
    pub fn available(&self) -> usize {
        self.total.saturating_sub(self.in_use + self.reserved)
    }
}

struct Cached {
    hash: u64,
    tokens: Vec<u32>,
    last_used: u64,
    /// Position of the block in its prompt: deeper blocks go first among equals.
    depth: usize,
}

struct PoolState {
    /// Each layer's (keys, values) pool as the latest kernel node returned
    /// it (possibly not evaluated yet); empty for an accounting-only pool.
    layers: Vec<(Array, Array)>,
    /// The same pools as first mapped (evaluated, the same memory), for
    /// handing pages back and counting resident ones.
    mapped: Vec<Array>,
    refs: Vec<u32>,
    free: BTreeSet<BlockId>,
    cached: HashMap<BlockId, Cached>,
    by_hash: HashMap<u64, BlockId>,
    reserved: usize,
    clock: u64,
    /// Freed blocks whose pages are handed back once every node built so
    /// far has run (one may still read them).
    unmap_later: Vec<BlockId>,
}

impl PoolState {
    /// Blocks referenced by rows.
    fn in_use(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    /// Hands back the pages of freed blocks once no node that may read them
    /// is left to run (every layer's latest pool is computed).
    fn unmap_freed(&mut self) {
        if self.unmap_later.is_empty() || !self.layers.iter().all(|(k, v)| k.is_available() && v.is_available()) {
            return;
        }
        for pool in &self.mapped {
            let _ = kernels::kv_pool_release(pool, &self.unmap_later);
        }
        self.unmap_later.clear();
    }
}

/// One model's KV block pool; see the module docs.
pub struct KvPool {
    state: Mutex<PoolState>,
    total: usize,
    block_bytes: usize,
    /// The budget the pool was made with (`total` whole blocks fit in it).
    budget_bytes: usize,
    shape: PoolShape,
    paged: bool,
    window: KvWindow,
    format: KvFormat,
}

#[derive(Clone, Copy)]
struct PoolShape {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Why a reservation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// Not now: rows hold the blocks; wait for them to finish.
    Busy,
    /// Never: more blocks than the whole pool.
    TooLarge { needed: usize, total: usize },
}

impl KvPool {
    /// A pool of `budget_bytes` for `shape`'s layers. `paged` pools hold the
    /// keys and values themselves (CPU kernels); others only account for the
    /// contiguous caches of their rows. Every layer's attention over the pool
    /// sees `window`, and it keeps keys and values in `format` (both a paged
    /// pool only: contiguous caches keep every position in f32).
    pub fn new(shape: &ModelShape, budget_bytes: usize, paged: bool, window: KvWindow, format: KvFormat) -> crate::Result<Arc<KvPool>> {
        let block_bytes = format.block_bytes(shape);
        let total = (budget_bytes / block_bytes.max(1)).min(i32::MAX as usize);
        let state = PoolState {
            layers: Vec::new(),
            mapped: Vec::new(),
            refs: vec![0; total],
            free: (0..total as BlockId).collect(),
            cached: HashMap::new(),
            by_hash: HashMap::new(),
            reserved: 0,
            clock: 0,
            unmap_later: Vec::new(),
        };
        let paged = paged && total > 0;
        if window != KvWindow::ALL && !paged {
            return Err(crate::Error::Mlx(
                "a sliding KV window needs the paged KV pool, which this model's kernels (CPU, quantized) do not read".into(),
            ));
        }
        format.check(shape, paged)?;
        let shape = PoolShape { layers: shape.num_layers, kv_heads: shape.kv_heads, head_dim: shape.head_dim };
        Ok(Arc::new(KvPool { state: Mutex::new(state), total, block_bytes, budget_bytes, shape, paged, window, format }))
    }

    /// The positions every token sees (every position without a window).
    pub fn window(&self) -> KvWindow {
        self.window
    }

    /// How the pool keeps keys and values.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// The most blocks a row holds at once when its nodes take at most
    /// `chunk` new positions: without a window, all of `positions`; with
    /// one, the kept blocks, the window and two nodes' new positions (the
    /// blocks the node before still reads are handed back one step late),
    /// and the partial blocks at either end.
    pub fn window_blocks(&self, positions: usize, chunk: usize) -> usize {
        let all = Self::blocks_for(positions);
        if self.window == KvWindow::ALL {
            return all;
        }
        let kept = Self::blocks_for(self.window.keep.max(0) as usize);
        all.min(kept + Self::blocks_for(self.window.window as usize + 2 * chunk.max(1)) + 2)
    }

    /// Whether rows keep their keys and values in this pool.
    pub fn is_paged(&self) -> bool {
        self.paged
    }

    /// Bytes of one block: every layer's keys and values for
    /// [`BLOCK_TOKENS`] positions.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The budget the pool was made with; it holds
    /// `budget_bytes / block_bytes` whole blocks.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Blocks for `positions` positions.
    pub fn blocks_for(positions: usize) -> usize {
        positions.div_ceil(BLOCK_TOKENS)
    }

    pub fn usage(&self) -> PoolUsage {
        let mut s = self.lock();
        s.unmap_freed();
        let in_use = s.in_use();
        let cached_idle = s.cached.keys().filter(|&&b| s.refs[b as usize] == 0).count();
        PoolUsage { total: self.total, in_use, cached_idle, reserved: s.reserved, unmapping: s.unmap_later.len() }
    }

    /// Bytes of the pool's memory that are resident (0 for an
    /// accounting-only pool).
    pub fn resident_bytes(&self) -> crate::Result<usize> {
        // Counted outside the lock: the rows need it for every layer of a step.
        let mapped = {
            let mut s = self.lock();
            s.unmap_freed();
            s.mapped.clone()
        };
        let mut bytes = 0;
        for pool in &mapped {
            bytes += kernels::resident_bytes(pool)?;
        }
        Ok(bytes)
    }

    /// Promises `blocks` blocks to a row (taken later by its tables).
    /// Unreferenced cached blocks count as room: they are evicted when taken.
    pub fn reserve(&self, blocks: usize) -> Result<Reservation, ReserveError> {
        if blocks > self.total {
            return Err(ReserveError::TooLarge { needed: blocks, total: self.total });
        }
        let mut s = self.lock();
        if s.in_use() + s.reserved + blocks > self.total {
            return Err(ReserveError::Busy);
        }
        s.reserved += blocks;
        Ok(Reservation { blocks })
    }

    /// Gives back what is left of a reservation.
    pub fn unreserve(&self, reservation: &mut Reservation) {
        let mut s = self.lock();
        s.reserved -= reservation.blocks;
        reservation.blocks = 0;
    }

    /// A block for a row: from its reservation when it has one left, the
    /// lowest free block first, else the least recently used idle cached
    /// block. None when the pool is full.
    fn take(&self, reservation: &mut Reservation) -> crate::Result<Option<BlockId>> {
        let mut s = self.lock();
        if self.paged && s.layers.is_empty() {
            // Mapped on first use; pages become resident as blocks are written.
            let PoolShape { layers, kv_heads, head_dim } = self.shape;
            let (blocks, heads, block, dim) = (self.total as i32, kv_heads as i32, BLOCK_TOKENS as i32, head_dim as i32);
            match self.format {
                KvFormat::F32 => {
                    let pool = || kernels::kv_pool_buffer(blocks, heads, block, dim);
                    s.layers = (0..layers).map(|_| Ok((pool()?, pool()?))).collect::<mlx_sys::Result<Vec<_>>>()?;
                    s.mapped = s.layers.iter().flat_map(|(k, v)| [k.clone(), v.clone()]).collect();
                }
                KvFormat::Q8 => {
                    // One array for every layer's keys and values, passed as both.
                    let pool = kernels::kv_pool_buffer_q8(blocks, layers as i32, heads, block, dim)?;
                    s.layers = vec![(pool.clone(), pool.clone()); layers];
                    s.mapped = vec![pool];
                }
            }
        }
        Ok(self.take_locked(&mut s, reservation))
    }

    fn take_locked(&self, s: &mut PoolState, reservation: &mut Reservation) -> Option<BlockId> {
        let unreserved_room = self.total.saturating_sub(s.in_use() + s.reserved);
        if reservation.blocks == 0 && unreserved_room == 0 {
            return None;
        }
        let id = match s.free.pop_first() {
            Some(id) => id,
            None => {
                let (&id, _) = s
                    .cached
                    .iter()
                    .filter(|(&b, _)| s.refs[b as usize] == 0)
                    .min_by_key(|(_, c)| (c.last_used, std::cmp::Reverse(c.depth)))?;
                let evicted = s.cached.remove(&id).expect("found above");
                s.by_hash.remove(&evicted.hash);
                id
            }
        };
        if reservation.blocks > 0 {
            reservation.blocks -= 1;
            s.reserved -= 1;
        }
        // Written from here on: its pages stay.
        s.unmap_later.retain(|&b| b != id);
        s.refs[id as usize] = 1;
        Some(id)
    }

    /// Drops one reference to each of `blocks` (`-1` entries skipped); a
    /// block no row references is freed (its pages handed back) unless it is
    /// cached. With `reservation`, each block that no row references any more
    /// goes back to it, up to `bound` blocks held and reserved.
    fn release(&self, blocks: &[BlockId], mut reservation: Option<(&mut Reservation, usize)>) {
        let mut s = self.lock();
        let mut freed = Vec::new();
        for &b in blocks.iter().filter(|&&b| b >= 0) {
            let r = &mut s.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                if let Some((reservation, bound)) = reservation.as_mut() {
                    if reservation.blocks < *bound {
                        reservation.blocks += 1;
                        s.reserved += 1;
                    }
                }
                if !s.cached.contains_key(&b) {
                    s.free.insert(b);
                    freed.push(b);
                }
            }
        }
        // Later nodes that write these blocks come after every node that
        // read them (each node takes the pool its predecessor returned), but
        // handing pages back is immediate: it waits for the nodes built so far.
        s.unmap_later.extend(freed);
        s.unmap_freed();
    }

    /// Under a window, hands back the blocks of `table` (adopted by a row
    /// whose next token is at `position`) that no token from there on sees:
    /// their entries become `-1`.
    pub fn drop_hidden(&self, table: &mut [BlockId], position: usize) {
        let hidden: Vec<BlockId> = table
            .iter_mut()
            .enumerate()
            .filter(|(i, b)| **b >= 0 && self.window.hides_block(*i, BLOCK_TOKENS, position))
            .map(|(_, b)| std::mem::replace(b, -1))
            .collect();
        self.release(&hidden, None);
    }

    /// The cached block under `hash` holding `tokens`, with a new reference
    /// to it.
    pub fn lookup(&self, hash: u64, tokens: &[u32]) -> Option<BlockId> {
        let mut s = self.lock();
        let id = *s.by_hash.get(&hash)?;
        s.clock += 1;
        let clock = s.clock;
        let cached = s.cached.get_mut(&id).expect("indexed");
        if cached.tokens != tokens {
            return None;
        }
        cached.last_used = clock;
        s.refs[id as usize] += 1;
        Some(id)
    }

    /// Whether a block is cached under `hash`.
    pub fn is_cached(&self, hash: u64) -> bool {
        self.lock().by_hash.contains_key(&hash)
    }

    /// Caches `block` (full, written, referenced by the caller) under `hash`.
    pub fn cache(&self, hash: u64, block: BlockId, tokens: &[u32], depth: usize) {
        let mut s = self.lock();
        if s.by_hash.contains_key(&hash) || s.cached.contains_key(&block) {
            return;
        }
        s.clock += 1;
        let last_used = s.clock;
        s.by_hash.insert(hash, block);
        s.cached.insert(block, Cached { hash, tokens: tokens.to_vec(), last_used, depth });
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Blocks promised to a row by [`KvPool::reserve`].
#[derive(Debug, Default)]
pub struct Reservation {
    blocks: usize,
}

impl Reservation {
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

/// One row's blocks: its table, shared by the row's layer caches, and what
/// is left of its reservation. Dropping it releases both.
pub struct RowBlocks {
    pool: Arc<KvPool>,
    /// Block ids by position / [`BLOCK_TOKENS`]; `-1` for a block handed
    /// back under the pool's window.
    table: Vec<BlockId>,
    reservation: Reservation,
    /// The most blocks the row holds and reserves at once (what it reserved
    /// first): blocks handed back under a window refill the reservation up to it.
    bound: usize,
    /// Positions at the start of the table that other rows may share (cached
    /// or adopted blocks): never written again.
    sealed: usize,
    /// The offset of the latest node built over the table.
    built: Option<usize>,
    /// Blocks below this position, past the kept ones, may be handed back.
    released_below: usize,
}

impl RowBlocks {
    /// A table starting with `adopted` (referenced already, e.g. by
    /// [`KvPool::lookup`]; `-1` for blocks [`KvPool::drop_hidden`] handed
    /// back), drawing further blocks from `reservation`.
    pub fn new(pool: Arc<KvPool>, adopted: Vec<BlockId>, reservation: Reservation) -> Self {
        let sealed = adopted.len() * BLOCK_TOKENS;
        let released_below = adopted.iter().rposition(|&b| b < 0).map_or(0, |i| (i + 1) * BLOCK_TOKENS);
        let mut blocks = RowBlocks { pool, table: adopted, reservation, bound: 0, sealed, built: None, released_below };
        blocks.bound = blocks.held() + blocks.reservation.blocks;
        blocks
    }

    /// Block ids by position / [`BLOCK_TOKENS`] (`-1`: handed back).
    pub fn table(&self) -> &[BlockId] {
        &self.table
    }

    /// Blocks the row holds.
    pub fn held(&self) -> usize {
        self.table.iter().filter(|&&b| b >= 0).count()
    }

    /// Readies the table for a node writing `length` positions at `offset`:
    /// under a window, hands back the blocks that the previous node (which
    /// may still be running) did not read, then covers the new positions.
    fn prepare(&mut self, offset: usize, length: usize) -> crate::Result<()> {
        let window = self.pool.window;
        if let Some(previous) = self.built.filter(|&p| p != offset && window != KvWindow::ALL) {
            let hidden: Vec<usize> = (0..self.table.len())
                .filter(|&i| self.table[i] >= 0 && window.hides_block(i, BLOCK_TOKENS, previous.min(offset)))
                .collect();
            if !hidden.is_empty() {
                let ids: Vec<BlockId> = hidden.iter().map(|&i| std::mem::replace(&mut self.table[i], -1)).collect();
                let bound = self.bound.saturating_sub(self.held());
                self.pool.release(&ids, Some((&mut self.reservation, bound)));
                self.released_below = self.released_below.max((hidden[hidden.len() - 1] + 1) * BLOCK_TOKENS);
            }
        }
        self.built = Some(offset);
        self.cover(offset + length)
    }

    /// Extends the table to cover `positions` positions.
    fn cover(&mut self, positions: usize) -> crate::Result<()> {
        while self.table.len() * BLOCK_TOKENS < positions {
            let Some(id) = self.pool.take(&mut self.reservation)? else {
                let usage = self.pool.usage();
                return Err(crate::Error::Mlx(format!(
                    "the KV pool is full: {} of {} blocks in use and {} reserved by other rows",
                    usage.in_use, usage.total, usage.reserved
                )));
            };
            self.table.push(id);
        }
        Ok(())
    }

    /// Marks the first `positions` positions as shared (their full blocks
    /// are cached): trimming stops there.
    pub fn seal(&mut self, positions: usize) {
        self.sealed = self.sealed.max(positions / BLOCK_TOKENS * BLOCK_TOKENS);
    }

    /// The fewest positions the row can be trimmed back to: the sealed ones,
    /// and under a window those whose next token still sees every block it
    /// needs.
    fn trim_floor(&self) -> usize {
        let window = self.pool.window;
        let mut floor = self.sealed;
        if window != KvWindow::ALL && self.released_below > 0 {
            // A token at p sees p + 1 - window onwards: p >= released_below + window - 1.
            floor = floor.max((self.released_below + window.window as usize).saturating_sub(1));
        }
        floor
    }
}

impl Drop for RowBlocks {
    fn drop(&mut self) {
        self.pool.release(&self.table, None);
        self.pool.unreserve(&mut self.reservation);
    }
}

/// One layer's view of a row's blocks: a [`KvCache`] that the fused decoder
/// block and the paged attention kernel write in place.
pub struct PagedKvCache {
    pool: Arc<KvPool>,
    layer: usize,
    blocks: Arc<Mutex<RowBlocks>>,
    offset: usize,
}

impl PagedKvCache {
    /// The caches of every layer of one row, over `blocks`, with `offset`
    /// positions already in them (adopted blocks).
    pub fn for_row(blocks: RowBlocks, layers: usize, offset: usize) -> Vec<Box<dyn KvCache>> {
        let pool = blocks.pool.clone();
        let blocks = Arc::new(Mutex::new(blocks));
        (0..layers)
            .map(|layer| Box::new(PagedKvCache { pool: pool.clone(), layer, blocks: blocks.clone(), offset }) as Box<dyn KvCache>)
            .collect()
    }

    /// The row's blocks (shared by its layers).
    pub fn row_blocks(&self) -> &Arc<Mutex<RowBlocks>> {
        &self.blocks
    }

    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// The block table for a node writing `length` positions at the offset
    /// (extended to cover them; under a window, blocks no token from the
    /// previous node on sees are `-1`).
    pub fn table_for(&self, length: usize) -> crate::Result<Vec<BlockId>> {
        let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        blocks.prepare(self.offset, length)?;
        Ok(blocks.table.clone())
    }

    /// This layer's (keys, values) pools.
    pub fn layer_pools(&self) -> crate::Result<(Array, Array)> {
        let s = self.pool.lock();
        s.layers.get(self.layer).cloned().ok_or_else(|| crate::Error::Mlx("the KV pool holds no blocks yet".into()))
    }

    /// Takes the pools a kernel returned (with `length` new positions of
    /// every row it served written) as this layer's current ones. An 8-bit
    /// pool is one array: the keys output stands for both.
    pub fn set_layer_pools(&self, keys: Array, values: Array) {
        let pools = match self.pool.format {
            KvFormat::F32 => (keys, values),
            KvFormat::Q8 => (keys.clone(), keys),
        };
        self.pool.lock().layers[self.layer] = pools;
    }

    /// This cache's layer of the model (its place in an 8-bit pool).
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// Counts `length` positions written at the offset.
    pub fn advance(&mut self, length: usize) {
        self.offset += length;
    }
}

/// The window a layer with its own sliding `layer` window (keep 0) reads
/// from a pool whose rows keep `pool`: the layer's where it is narrower
/// (everything it shows, the pool still holds), else the pool's, whose
/// blocks outside it are handed back for every layer (its `keep` first
/// positions then stay visible to the layer too).
pub(crate) fn layer_window(pool: KvWindow, layer: KvWindow) -> KvWindow {
    match (pool.window, layer.window) {
        (_, 0) => pool,
        (0, _) => layer,
        (p, l) if l <= p => layer,
        _ => pool,
    }
}

impl KvCache for PagedKvCache {
    fn update_and_fetch(&mut self, _keys: &Array, _values: &Array) -> mlx_sys::Result<(Array, Array)> {
        Err(mlx_sys::Error::new("a paged KV cache is read by the CPU kernels in place; use KvCache::attend"))
    }

    fn offset(&self) -> usize {
        self.offset
    }

    fn trim(&mut self, n: usize) -> usize {
        let floor = self.blocks.lock().unwrap_or_else(|e| e.into_inner()).trim_floor();
        let n = n.min(self.offset.saturating_sub(floor));
        self.offset -= n;
        n
    }

    fn state(&self) -> Vec<Array> {
        self.layer_pools().map(|(k, v)| vec![k, v]).unwrap_or_default()
    }

    fn nbytes(&self) -> usize {
        // This layer's share of the row's blocks.
        let blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner()).held();
        blocks * self.pool.block_bytes / self.pool.shape.layers.max(1)
    }

    fn attend(&mut self, q: &Array, k: &Array, v: &Array, scale: f32, window: KvWindow) -> mlx_sys::Result<Option<Array>> {
        let length = k.dim(2) as usize;
        let table = self.table_for(length).map_err(|e| mlx_sys::Error::new(e.to_string()))?;
        let (pool_k, pool_v) = self.layer_pools().map_err(|e| mlx_sys::Error::new(e.to_string()))?;
        let window = layer_window(self.pool.window, window);
        let (out, pool_k, pool_v) = kernels::paged_causal_attention(q, k, v, &pool_k, &pool_v, &table, self.offset as i32, scale, window, self.layer as i32)?;
        self.set_layer_pools(pool_k, pool_v);
        self.offset += length;
        Ok(Some(out))
    }

    fn append_with(&mut self, _length: usize, _layout: CacheLayout, _write: &mut AppendWriter<'_>) -> mlx_sys::Result<bool> {
        Ok(false)
    }

    fn as_paged(&mut self) -> Option<&mut PagedKvCache> {
        Some(self)
    }
}
