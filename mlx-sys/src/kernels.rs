//! mlxcel's own CPU compute kernels (the C++ in `kernels/` at the workspace
//! root), run as MLX graph nodes so they compose with every other op.
//!
//! [`quantized_matmul`] is a drop-in for
//! `mlx_sys::quantized_matmul(x, w, scales, biases, true, group_size, bits)`:
//! the same shape, dtype and errors, much faster on CPU for a few rows of `x`
//! (decode). The exact paths unpack weights to f32 and accumulate in f32;
//! the default on CPUs with AVX-512 VNNI quantizes each group of activations
//! to 16 bits (two int8 halves) and runs integer dot products, with an error
//! of at most `max|x| / 65024` per activation. Output rows are split across a
//! persistent thread pool, and the inner loop is picked at run time. On a GPU
//! stream, or for a layout it does not handle, it returns MLX's own op.
//!
//! Environment (read once per process):
//! - `MLXCEL_KERNELS=portable|avx2|avx2-int8|avx512|avx512-vnni|neon-int8` caps the inner loop that
//!   [`KernelPath::Auto`] picks (default: the best the CPU runs). An explicit
//!   path ignores it.
//! - `MLXCEL_NUM_THREADS=n` sets the thread count (default: the hardware's).

use crate::array::{array_list, from_array_list, Array};
use crate::error::Result;
use crate::ffi;

/// Which inner loop evaluates a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// The best the CPU runs, unless `MLXCEL_KERNELS` says otherwise.
    Auto = -1,
    /// Plain C++, any CPU; every supported bit width.
    Portable = 0,
    /// 8-lane AVX2 + FMA (bits 2, 4, 8).
    Avx2 = 1,
    /// 16-lane AVX-512 (bits 2, 4, 8).
    Avx512 = 2,
    /// AVX-512 VNNI integer dot products (bits 4 and 8; others run
    /// `Avx512`), with activations quantized per group to 16 bits (two int8
    /// halves): error at most `max|x| / 65024` per activation of a group.
    Avx512Vnni = 3,
    /// AVX2 integer dot products (vpmaddwd; bits 2, 4, 8, others run
    /// `Avx2`), with activations quantized per group to int16: the same
    /// bound as `Avx512Vnni`, `max|x| / 65024` per activation.
    Avx2Int8 = 4,
    /// aarch64 NEON integer dot products (baseline ARMv8-A, `vmlal_s16`;
    /// bits 2, 4, 8, others run `Portable`), the default on aarch64 Linux
    /// and Apple Silicon, with the int16 activations of `Avx2Int8`: error at
    /// most `max|x| / 65024` per activation of a group. `Portable` off
    /// aarch64.
    NeonInt8 = 5,
}

/// `x @ dequantize(w, scales, biases).T` over the last axis of `x` (MLX's
/// affine quantization, `transpose = true`), with MLX's semantics.
///
/// `w` is `uint32 [N, K * bits / 32]`, `scales` and `biases` are
/// `[N, K / group_size]` in f32, f16 or bf16; `x` is `[..., K]` in f32, f16 or
/// bf16 and the result `[..., N]` in MLX's output dtype for those inputs.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    quantized_matmul_with_path(x, w, scales, biases, group_size, bits, KernelPath::Auto)
}

/// [`quantized_matmul`] on a chosen inner loop (tests and benchmarks). A path
/// the CPU cannot run falls back to the best one below it.
pub fn quantized_matmul_with_path(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    path: KernelPath,
) -> Result<Array> {
    Array::from_ffi(ffi::kernels_quantized_matmul(
        &x.raw,
        &w.raw,
        &scales.raw,
        &biases.raw,
        group_size,
        bits,
        path as i32,
    ))
}

/// The copy of a quantized weight that the AVX-512 VNNI matvec, and the AVX2
/// integer matvec for bits 4 and 8, stream in order (full blocks of 16 rows,
/// output-interleaved), for [`quantized_matmul_with_vnni_rows`] with the
/// same weight. `None` where this process's matvec would not read it:
/// another loop, a layout those loops do not take (VNNI: bits 4 and 8,
/// groups a multiple of 16 up to 256; AVX2: bits 4 and 8), fewer than 16 rows, or
/// `MLXCEL_REPACK=0`. It costs as much memory as the
/// weight (in MLX's memory) and is built once: keep it with
/// the weight. Evaluates `w`, `scales` and `biases`.
pub fn vnni_rows(w: &Array, scales: &Array, biases: &Array, group_size: i32, bits: i32) -> Result<Option<Array>> {
    let rows = ffi::kernels_vnni_rows(&w.raw, &scales.raw, &biases.raw, group_size, bits)?;
    Ok(if rows.is_null() { None } else { Some(Array::wrap(rows)) })
}

/// [`quantized_matmul`] reading `vnni_rows` (from [`vnni_rows`] of this
/// weight) where it runs a loop that reads it. On the VNNI loop that is the
/// same result bit for bit, without transposing each block of the weight; the
/// AVX2 integer loop sums each group of a copy in one lane, which rounds
/// differently from its loop over the rows (within the same bound).
pub fn quantized_matmul_with_vnni_rows(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    vnni_rows: &Array,
) -> Result<Array> {
    quantized_matmul_with_vnni_rows_on_path(x, w, scales, biases, group_size, bits, KernelPath::Auto, vnni_rows)
}

/// [`quantized_matmul_with_vnni_rows`] on the loop `path` resolves to (a copy
/// that loop does not read is ignored).
#[allow(clippy::too_many_arguments)]
pub fn quantized_matmul_with_vnni_rows_on_path(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    path: KernelPath,
    vnni_rows: &Array,
) -> Result<Array> {
    Array::from_ffi(ffi::kernels_quantized_matmul_vnni_rows(
        &x.raw,
        &w.raw,
        &scales.raw,
        &biases.raw,
        group_size,
        bits,
        path as i32,
        &vnni_rows.raw,
    ))
}

/// The loop `path` resolves to on this CPU: `"avx512"`, `"avx2"` or `"portable"`.
pub fn path_name(path: KernelPath) -> String {
    ffi::kernels_path_name(path as i32).unwrap_or_else(|_| "unknown".into())
}

/// The loop that reads a weight's interleaved copy ([`vnni_rows`]) on `path`
/// for `bits` on this CPU: `"avx512-vnni"` (bits 4 and 8), `"avx512-int16"`
/// (bits 4 and 8 on AMD CPUs: 16-bit activations, all 16 rows of a block per
/// vector), `"avx2-int16"` (`Avx2Int8`, bits 4 and 8; the same results as
/// `"avx512-int16"` bit for bit), or `""` where no copy is read.
pub fn copy_loop_name(path: KernelPath, bits: i32) -> String {
    ffi::kernels_copy_loop_name(path as i32, bits).unwrap_or_default()
}

/// Threads the kernels use, the evaluating thread included.
pub fn num_threads() -> usize {
    ffi::kernels_num_threads().max(1) as usize
}

/// Whether the kernel computes this `(group_size, bits)` itself; otherwise
/// [`quantized_matmul`] returns MLX's op (still correct, just MLX's speed).
pub fn supports(group_size: i32, bits: i32) -> bool {
    ffi::kernels_supports(group_size, bits)
}

/// Whether `a` is still an unevaluated node of one of these kernels (and not,
/// say, MLX's op that [`quantized_matmul`] falls back to). For tests.
pub fn is_kernel_node(a: &Array) -> bool {
    ffi::array_primitive_name(&a.raw).starts_with("Mlxcel")
}

/// The number of graph inputs of an unevaluated node (0 for a leaf). For tests.
pub fn array_inputs(a: &Array) -> usize {
    ffi::array_input_count(&a.raw)
}

/// Shape and options of a fused decoder block; see [`decoder_layer`].
pub use crate::ffi::DecoderLayerSpec;

/// An MLX affine-quantized projection (`weight` uint32 `[out, in * bits /
/// 32]`, `scales` and `biases` `[out, in / group_size]` of one float dtype, as
/// [`crate::quantize`] returns them; bits and group size follow from the
/// shapes), with an optional float `bias` `[out]` added to its output.
#[derive(Clone)]
pub struct QuantizedProjection {
    pub weight: Array,
    pub scales: Array,
    pub biases: Array,
    pub bias: Option<Array>,
}

/// The weights of one pre-norm decoder block for [`decoder_layer`], by name.
/// Norm weights are float vectors (f32, f16 or bf16).
#[derive(Clone)]
pub struct DecoderLayerWeights {
    /// `input_layernorm` weight `[hidden]`.
    pub input_norm: Array,
    pub q_proj: QuantizedProjection,
    pub k_proj: QuantizedProjection,
    pub v_proj: QuantizedProjection,
    pub o_proj: QuantizedProjection,
    /// `post_attention_layernorm` weight `[hidden]`.
    pub post_attention_norm: Array,
    pub gate_proj: QuantizedProjection,
    pub up_proj: QuantizedProjection,
    pub down_proj: QuantizedProjection,
    /// Qwen3's per-head RMSNorm of q and k (`[head_dim]`, eps
    /// `spec.norm_eps`): both or neither.
    pub q_norm: Option<Array>,
    pub k_norm: Option<Array>,
    /// Per-frequency periods `[rope_dims / 2]` (llama3 scaling) in place of
    /// `spec.rope_base`.
    pub rope_freqs: Option<Array>,
    /// Gemma's norms of the attention and MLP outputs before their residual
    /// adds (`[hidden]`, both or neither); `post_attention_norm` is then the
    /// MLP's input norm.
    pub attn_out_norm: Option<Array>,
    pub mlp_out_norm: Option<Array>,
    /// A mixture of experts' router `[experts, hidden]` (`spec.experts` > 0);
    /// gate_proj and up_proj then hold the experts stacked as `[experts *
    /// intermediate, hidden]`, down_proj as `[experts * hidden, intermediate]`.
    pub router: Option<QuantizedProjection>,
}

/// One pre-norm decoder block (the llama / mistral / qwen2 / qwen3 layout)
/// for `L` new tokens as a single CPU graph node: RMSNorm, the q/k/v
/// projections, RoPE, attention over the KV cache, the output projection,
/// residual, RMSNorm, the gated MLP and residual. MLX builds the same block
/// from ~25 nodes, whose dispatch dominates decode time on a CPU.
///
/// `x` is `f32 [1, L, hidden]`; `keys` and `values` are the `f32 [1,
/// kv_heads, capacity, head_dim]` cache buffers (`capacity >= spec.offset +
/// L`). Returns `(out, keys, values)`: the block output and the cache buffers
/// with positions `spec.offset..spec.offset + L` written (in the input
/// buffers when `spec.cache_in_place`). Errors name the input that does not
/// fit.
pub fn decoder_layer(
    x: &Array,
    weights: &DecoderLayerWeights,
    keys: &Array,
    values: &Array,
    spec: &DecoderLayerSpec,
) -> Result<(Array, Array, Array)> {
    let list = ffi::kernels_decoder_layer(&layer_arrays(x, weights, keys, values), spec)?;
    three_arrays(&list)
}

/// A block's weights checked, laid out and evaluated once, for
/// [`PreparedDecoderLayer::forward`]: the same block as [`decoder_layer`] as a
/// node whose only graph inputs are `x` and the caches (~25 fewer), which
/// keeps MLX's per-step graph work (building, traversal, scheduling) small.
/// Decode builds one such node per layer and step.
///
/// Immutable; `Send + Sync`, cheap to clone (shared).
#[derive(Clone)]
pub struct PreparedDecoderLayer {
    inner: std::sync::Arc<cxx::UniquePtr<ffi::PreparedLayer>>,
}

// SAFETY: the C++ object is immutable after construction, and its arrays are
// evaluated and detached; MLX reads them from any thread.
unsafe impl Send for PreparedDecoderLayer {}
unsafe impl Sync for PreparedDecoderLayer {}

impl PreparedDecoderLayer {
    /// Checks `weights` against `spec`'s dimensions (errors name the weight,
    /// as [`decoder_layer`]'s do) and evaluates them.
    pub fn new(weights: &DecoderLayerWeights, spec: &DecoderLayerSpec) -> Result<PreparedDecoderLayer> {
        // x, keys and values are not read by the preparation.
        let unused = &weights.input_norm;
        let prepared = ffi::kernels_prepare_decoder_layer(&layer_arrays(unused, weights, unused, unused), spec)?;
        Ok(PreparedDecoderLayer { inner: std::sync::Arc::new(prepared) })
    }

    /// [`decoder_layer`] on these weights. `spec` may differ from the
    /// prepared one in offset, RoPE and attention options and
    /// `cache_in_place`, not in dimensions.
    pub fn forward(&self, x: &Array, keys: &Array, values: &Array, spec: &DecoderLayerSpec) -> Result<(Array, Array, Array)> {
        let list = ffi::kernels_decoder_layer_prepared(&self.inner, &x.raw, &keys.raw, &values.raw, spec)?;
        three_arrays(&list)
    }
}

/// One sequence of a [`PreparedDecoderLayer::forward_batch`]: its key and
/// value caches (`[1, kv_heads, capacity, head_dim]` float32, capacity at
/// least `offset + L`) and the position of its first new token.
pub struct SequenceCache<'a> {
    pub keys: &'a Array,
    pub values: &'a Array,
    pub offset: i32,
}

impl PreparedDecoderLayer {
    /// The block for B sequences of L new tokens each in one node: `x` is
    /// `[B, L, hidden]` and `caches[b]` is sequence b's cache (`spec.offset`
    /// is not read). Each weight is read once for all rows, and each row is
    /// computed exactly as it would be alone, so a sequence's output does not
    /// depend on the others. Returns the output `[B, L, hidden]` and each
    /// sequence's (keys, values) with its new positions written.
    pub fn forward_batch(&self, x: &Array, caches: &[SequenceCache<'_>], spec: &DecoderLayerSpec) -> Result<(Array, Vec<(Array, Array)>)> {
        let keys = array_list(caches.iter().map(|c| c.keys));
        let values = array_list(caches.iter().map(|c| c.values));
        let offsets: Vec<i32> = caches.iter().map(|c| c.offset).collect();
        let list = ffi::kernels_decoder_layer_batch(&self.inner, &x.raw, &keys, &values, &offsets, spec)?;
        output_and_caches(&list, caches.len())
    }
}

/// One sequence of a [`PreparedDecoderLayer::forward_paged`]: its block
/// table (block ids by position / block) and the position of its first new
/// token.
pub struct PagedSequence<'a> {
    pub table: &'a [i32],
    pub offset: i32,
}

impl PreparedDecoderLayer {
    /// [`forward_batch`](Self::forward_batch) over a paged KV pool: every
    /// sequence's keys and values live in `pool_keys` / `pool_values`
    /// (`f32 [kv_heads, blocks, block, head_dim]`, block a power of two >= 8),
    /// position `t` of sequence b at block `sequences[b].table[t / block]`.
    /// Each table covers `offset + L` positions and no two sequences write
    /// the same block. Attention reads the blocks where they lie; each row is
    /// computed exactly as with a contiguous cache. Returns the output and
    /// the pools with the new positions written (in place when
    /// `spec.cache_in_place`).
    pub fn forward_paged(
        &self,
        x: &Array,
        pool_keys: &Array,
        pool_values: &Array,
        sequences: &[PagedSequence<'_>],
        spec: &DecoderLayerSpec,
    ) -> Result<(Array, Array, Array)> {
        let (tables, lens, offsets) = flat_tables(sequences);
        let list = ffi::kernels_decoder_layer_paged(&self.inner, &x.raw, &pool_keys.raw, &pool_values.raw, &tables, &lens, &offsets, spec)?;
        three_arrays(&list)
    }
}

/// Prepared blocks in model order, run as one node per call by
/// [`forward_paged`](Self::forward_paged): a decode step then costs MLX one
/// node for every layer (graph building, traversal, one task, and no wait
/// for queued tasks) instead of one node per layer.
///
/// Immutable; `Send + Sync`, cheap to clone (shared).
#[derive(Clone)]
pub struct PreparedDecoderStack {
    inner: std::sync::Arc<cxx::UniquePtr<ffi::PreparedStack>>,
    layers: usize,
}

// SAFETY: as for PreparedDecoderLayer: the C++ object is immutable once
// built and holds only prepared (evaluated, immutable) layers.
unsafe impl Send for PreparedDecoderStack {}
unsafe impl Sync for PreparedDecoderStack {}

impl PreparedDecoderStack {
    /// The stack of `layers`, first to last.
    pub fn new<'a>(layers: impl IntoIterator<Item = &'a PreparedDecoderLayer>) -> PreparedDecoderStack {
        let mut stack = ffi::kernels_prepared_stack_new();
        let mut count = 0;
        for layer in layers {
            ffi::kernels_prepared_stack_push(stack.pin_mut(), &layer.inner);
            count += 1;
        }
        PreparedDecoderStack { inner: std::sync::Arc::new(stack), layers: count }
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers
    }

    /// Whether the stack has no layer (it then cannot run).
    pub fn is_empty(&self) -> bool {
        self.layers == 0
    }

    /// Every layer's [`PreparedDecoderLayer::forward_paged`] in one node:
    /// layer i with `specs[i]` over `pools[i]` (keys, values), the output of
    /// each the input of the next, every layer over the same `sequences`.
    /// Each layer computes exactly what its own node computes. Returns the
    /// last layer's output and every layer's pools with the new positions
    /// written.
    pub fn forward_paged(
        &self,
        x: &Array,
        pools: &[(Array, Array)],
        sequences: &[PagedSequence<'_>],
        specs: &[DecoderLayerSpec],
    ) -> Result<(Array, Vec<(Array, Array)>)> {
        let (tables, lens, offsets) = flat_tables(sequences);
        let keys = array_list(pools.iter().map(|(k, _)| k));
        let values = array_list(pools.iter().map(|(_, v)| v));
        let list = ffi::kernels_decoder_stack_paged(&self.inner, &x.raw, &keys, &values, &tables, &lens, &offsets, specs)?;
        output_and_caches(&list, pools.len())
    }
}

/// Paged sequences as the FFI takes them: every table's ids in one list,
/// each table's length, each sequence's offset.
fn flat_tables(sequences: &[PagedSequence<'_>]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let tables = sequences.iter().flat_map(|s| s.table.iter().copied()).collect();
    let lens = sequences.iter().map(|s| s.table.len() as i32).collect();
    let offsets = sequences.iter().map(|s| s.offset).collect();
    (tables, lens, offsets)
}

/// `{out, keys[0..n), values[0..n)}` as the output and n (keys, values) pairs.
fn output_and_caches(list: &ffi::ArrayList, n: usize) -> Result<(Array, Vec<(Array, Array)>)> {
    let mut out = from_array_list(list)?;
    if out.len() != 1 + 2 * n {
        unreachable!("the decoder kernels return 1 + 2n arrays");
    }
    let values = out.split_off(1 + n);
    let keys = out.split_off(1);
    let h = out.pop().expect("the output");
    Ok((h, keys.into_iter().zip(values).collect()))
}

/// How many [`PreparedDecoderStack::forward_paged`] nodes this process has
/// built (a decode step builds one when its blocks run as a stack).
pub fn decoder_stack_nodes() -> u64 {
    ffi::kernels_decoder_stack_nodes()
}

/// [`causal_attention`] for one sequence whose keys and values live in a
/// paged pool: `k` and `v` (`[1, H_kv, L, D]`) are its positions
/// `offset..offset + L`, written into the pools (`f32 [H_kv, blocks, block,
/// D]`, in place when they are dense) at the blocks of `table`, and `q`
/// (`[1, H, L, D]`) attends over positions `0..offset + L` read from the
/// blocks. The same result as [`causal_attention`] over contiguous keys and
/// values. With `window.window > 0` the token at position `p` sees only
/// positions `0..keep` and `p + 1 - window..=p` (as
/// [`DecoderLayerSpec::kv_window`]), blocks no new token sees may be `-1`
/// in `table`, and the result still does not depend on how a prompt is cut
/// into calls. An 8-bit pool ([`kv_pool_buffer_q8`], passed as both pools)
/// holds every layer; `layer` picks this one (ignored for an f32 pool).
/// Returns (out `[1, H, L, D]`, keys pool, values pool). CPU only.
#[allow(clippy::too_many_arguments)]
pub fn paged_causal_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    pool_keys: &Array,
    pool_values: &Array,
    table: &[i32],
    offset: i32,
    scale: f32,
    window: KvWindow,
    layer: i32,
) -> Result<(Array, Array, Array)> {
    let list = ffi::kernels_paged_causal_attention(
        &q.raw,
        &k.raw,
        &v.raw,
        &pool_keys.raw,
        &pool_values.raw,
        table,
        offset,
        scale,
        window.window,
        window.keep,
        layer,
    )?;
    three_arrays(&list)
}

/// The positions a token sees: at position `p`, `0..keep` and
/// `p + 1 - window..=p`; `window == 0` (the default) sees them all. mlx-lm's
/// `RotatingKVCache(max_size, keep)` is `window = max_size - keep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvWindow {
    pub window: i32,
    pub keep: i32,
}

impl KvWindow {
    /// Every position.
    pub const ALL: KvWindow = KvWindow { window: 0, keep: 0 };

    /// The first position that a token at `position` sees after the kept
    /// ones (0 without a window).
    pub fn first_recent(&self, position: usize) -> usize {
        if self.window <= 0 {
            return 0;
        }
        (self.keep.max(0) as usize).max((position + 1).saturating_sub(self.window as usize))
    }

    /// Whether block `index` (`block` positions) holds no position that a
    /// token at `position` or later sees: its table entry may be `-1`.
    pub fn hides_block(&self, index: usize, block: usize, position: usize) -> bool {
        self.window > 0 && index * block >= self.keep.max(0) as usize && (index + 1) * block <= self.first_recent(position)
    }
}

/// An evaluated `f32 [kv_heads, blocks, block, head_dim]` pool over an
/// anonymous mapping: pages are resident only once written, so a pool sized
/// for a whole byte budget costs only the blocks in use.
pub fn kv_pool_buffer(blocks: i32, kv_heads: i32, block: i32, head_dim: i32) -> Result<Array> {
    Array::from_ffi(ffi::kernels_kv_pool_buffer(blocks, kv_heads, block, head_dim))
}

/// An evaluated 8-bit pool over an anonymous mapping, for every layer's keys
/// and values: `u8 [blocks, layers, 2, kv_heads, section]`, a section being one
/// head's `block` rows of `head_dim` bytes, then their f32 scales and biases
/// (one per 64 features; mlx-lm's `QuantizedKVCache`, group 64, 8 bits). A
/// block is one contiguous run, so its pages can be handed back. Pass it as
/// both pools of [`PreparedDecoderLayer::forward_paged`] (with
/// `spec.kv_layer` and `cache_in_place`) and [`paged_causal_attention`].
/// `head_dim` must be a multiple of 64.
pub fn kv_pool_buffer_q8(blocks: i32, layers: i32, kv_heads: i32, block: i32, head_dim: i32) -> Result<Array> {
    Array::from_ffi(ffi::kernels_kv_pool_buffer_q8(blocks, layers, kv_heads, block, head_dim))
}

/// Bytes of one block of an 8-bit pool: every layer's keys and values for
/// `block` positions.
pub fn kv_q8_block_bytes(layers: usize, kv_heads: usize, block: usize, head_dim: usize) -> usize {
    2 * layers * kv_heads * block * (head_dim + 8 * head_dim / 64)
}

/// Returns the pages wholly inside blocks `ids` of `pool` (from
/// [`kv_pool_buffer`] or [`kv_pool_buffer_q8`]) to the system; they read as zeros afterwards. No
/// queued evaluation may read those blocks.
pub fn kv_pool_release(pool: &Array, ids: &[i32]) -> Result<()> {
    Ok(ffi::kernels_kv_pool_release(&pool.raw, ids)?)
}

/// Bytes of an evaluated array's buffer that are resident in memory.
pub fn resident_bytes(a: &Array) -> Result<usize> {
    Ok(ffi::kernels_resident_bytes(&a.raw)?)
}

/// Bytes held by the weight copies the AVX-512 VNNI matvec (and the AVX2
/// integer matvec for bits 4 and 8) streams in its own order that live
/// [`PreparedDecoderLayer`]s hold (made by [`PreparedDecoderLayer::new`] on
/// CPUs where decode runs such a loop, unless
/// `MLXCEL_REPACK=0`), on top of the weights themselves. Copies from
/// [`vnni_rows`] are MLX arrays, counted in MLX's memory instead.
pub fn vnni_rows_bytes() -> usize {
    ffi::kernels_vnni_rows_bytes()
}

/// Copies `bytes` into a new evaluated array in the weight arena: memory that
/// Linux backs with 2 MiB transparent huge pages, for weights that decode
/// streams once a token (fewer TLB misses; `MLXCEL_HUGE_PAGES=0` leaves the
/// default pages). For arrays the CPU reads: the memory is not a GPU
/// allocator's. An error names a byte length that does not fill `shape`.
pub fn weight_array(bytes: &[u8], shape: &[i32], dtype: crate::Dtype) -> Result<Array> {
    Array::from_ffi(ffi::kernels_weight_array(bytes, shape, dtype as u8))
}

/// Bytes of the weight arena's live allocations: weights placed with
/// [`weight_array`] and the VNNI copies of [`vnni_rows_bytes`].
pub fn weight_arena_bytes() -> usize {
    ffi::kernels_weight_arena_bytes()
}

/// The weight arena's mappings as the kernel reports them
/// (`/proc/self/smaps`; zeros elsewhere than Linux).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArenaPages {
    /// Bytes in mappings eligible for transparent huge pages.
    pub eligible: usize,
    /// Bytes backed by huge pages now.
    pub huge: usize,
    /// Bytes resident in memory.
    pub resident: usize,
}

/// Where the weight arena's memory stands; see [`ArenaPages`].
pub fn weight_arena_pages() -> ArenaPages {
    let v = ffi::kernels_weight_arena_pages();
    ArenaPages { eligible: v[0], huge: v[1], resident: v[2] }
}

/// Whether the weight arena asks for huge pages: `MLXCEL_HUGE_PAGES` is not
/// `0` and the system's transparent huge pages are not `never`.
pub fn weight_arena_huge_pages() -> bool {
    ffi::kernels_weight_arena_huge_pages()
}

fn three_arrays(list: &ffi::ArrayList) -> Result<(Array, Array, Array)> {
    let mut out = from_array_list(list)?.into_iter();
    match (out.next(), out.next(), out.next()) {
        (Some(h), Some(k), Some(v)) => Ok((h, k, v)),
        _ => unreachable!("decoder_layer returns three arrays"),
    }
}

fn layer_arrays<'a>(x: &'a Array, weights: &'a DecoderLayerWeights, keys: &'a Array, values: &'a Array) -> ffi::DecoderLayerArrays<'a> {
    fn optional(a: &Option<Array>) -> *const ffi::MlxArray {
        a.as_ref().map_or(std::ptr::null(), |a| &*a.raw as *const ffi::MlxArray)
    }
    fn projection(p: &QuantizedProjection) -> ffi::DecoderProjection<'_> {
        ffi::DecoderProjection { weight: &p.weight.raw, scales: &p.scales.raw, biases: &p.biases.raw, bias: optional(&p.bias) }
    }
    let w = weights;
    ffi::DecoderLayerArrays {
        x: &*x.raw,
        input_norm: &*w.input_norm.raw,
        q_proj: projection(&w.q_proj),
        k_proj: projection(&w.k_proj),
        v_proj: projection(&w.v_proj),
        o_proj: projection(&w.o_proj),
        post_attention_norm: &*w.post_attention_norm.raw,
        gate_proj: projection(&w.gate_proj),
        up_proj: projection(&w.up_proj),
        down_proj: projection(&w.down_proj),
        keys: &*keys.raw,
        values: &*values.raw,
        q_norm: optional(&w.q_norm),
        k_norm: optional(&w.k_norm),
        rope_freqs: optional(&w.rope_freqs),
        attn_out_norm: optional(&w.attn_out_norm),
        mlp_out_norm: optional(&w.mlp_out_norm),
        router_weight: w.router.as_ref().map_or(std::ptr::null(), |r| &*r.weight.raw as *const ffi::MlxArray),
        router_scales: w.router.as_ref().map_or(std::ptr::null(), |r| &*r.scales.raw as *const ffi::MlxArray),
        router_biases: w.router.as_ref().map_or(std::ptr::null(), |r| &*r.biases.raw as *const ffi::MlxArray),
    }
}

/// `x @ dequantize(w, scales, biases).T` for many rows of `x` (prefill): the
/// same contract as [`quantized_matmul`], computed as a GEMM. Each task
/// dequantizes a panel of `w` into an L2-sized buffer and runs it against
/// blocks of rows of `x`: on CPUs with AMX (see [`gemm_uses_amx`]) as bf16
/// tile products of split operands (~16-bit precision per operand, f32
/// accumulation); 4- and 8-bit weights on AVX-512 VNNI without AMX, and
/// 8-bit weights on the AVX2 integer path, with integer loops on x quantized
/// per group to 16 bits,
/// as the decode matvec does (at most `max|x| / 65024` off per activation;
/// group sums exact in int32); otherwise with a register-blocked f32
/// microkernel (8x32 AVX-512, 6x16 AVX2 + FMA, or portable vector code on
/// every other CPU, aarch64 included): exact f32 dequantization, f32 FMAs and
/// accumulation, only the summation order differs from `x @ dequantize(w).T`. Where the GEMM
/// does not apply (a GPU stream, a layout [`gemm_supports`] rejects) it returns
/// [`quantized_matmul`]. It never calls BLAS.
pub fn quantized_gemm(x: &Array, w: &Array, scales: &Array, biases: &Array, group_size: i32, bits: i32) -> Result<Array> {
    quantized_gemm_with_path(x, w, scales, biases, group_size, bits, KernelPath::Auto)
}

/// [`quantized_gemm`] with a chosen path (tests and benchmarks): `Portable`,
/// `Avx2` and `Avx512` run that exact f32 loop (or the best one below it the
/// CPU runs; bits 3, 5 and 6 run the AVX2 or portable loop), `Avx512Vnni` the
/// AMX loop where [`gemm_uses_amx`] says so, `Avx512Vnni` without AMX the
/// integer loop for 4- and 8-bit weights, and `Avx2Int8` the integer loop for
/// 8-bit weights. [`gemm_loop_name`] tells which.
pub fn quantized_gemm_with_path(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    path: KernelPath,
) -> Result<Array> {
    Array::from_ffi(ffi::kernels_quantized_gemm(&x.raw, &w.raw, &scales.raw, &biases.raw, group_size, bits, path as i32))
}

/// The first half of a gated MLP in one node: `silu(x @ gate.T) * (x @ up.T)`
/// for many rows of `x`, with `gate` and `up` affine-quantized
/// `(weight, scales, biases)` of the same shape and dtypes. Each task packs the
/// same panel of both weights and combines the tiles as it stores them (silu
/// as MLX computes it, `g / (1 + e^-g)`, with a vectorized exponential).
/// Falls back to two [`quantized_gemm`] calls joined by MLX's ops where the
/// GEMM does not apply.
pub fn quantized_gemm_swiglu(
    x: &Array,
    gate: [&Array; 3],
    up: [&Array; 3],
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    Array::from_ffi(ffi::kernels_quantized_gemm_swiglu(
        &x.raw, &gate[0].raw, &gate[1].raw, &gate[2].raw, &up[0].raw, &up[1].raw, &up[2].raw, group_size, bits,
    ))
}

/// Whether [`quantized_gemm`] calls on `path` run the AMX tile loop: the
/// default (`Auto` or `Avx512Vnni`) on CPUs with AMX-BF16 whose OS grants the
/// tile state, unless `MLXCEL_AMX=0`. It splits activations and dequantized
/// weights into two bf16 halves each (`v ~ hi + lo`) and sums three bf16 tile
/// products in f32: at most ~3 * 2^-16 (4.6e-5) relative error per product
/// term (far less on average), the same class as the matvec's VNNI path. `Avx512` (or
/// `MLXCEL_KERNELS=avx512`) runs the exact f32 loop.
pub fn gemm_uses_amx(path: KernelPath) -> bool {
    ffi::kernels_gemm_uses_amx(path as i32).unwrap_or(false)
}

/// Whether [`quantized_gemm`] runs its own GEMM for `(group_size, bits)`: bits
/// 2, 4, 8 (group a multiple of 32 / bits) or 3, 5, 6 (group a multiple of
/// 32), on every CPU.
pub fn gemm_supports(group_size: i32, bits: i32) -> bool {
    ffi::kernels_gemm_supports(group_size, bits)
}

/// The loop a [`quantized_gemm`] call on `path` runs for `bits` (0: a dense
/// [`dense_matmul`]): `"amx"`, `"avx512-int16"`, `"avx512"`, `"avx2-int16"`,
/// `"avx2"` or `"portable"`.
pub fn gemm_loop_name(path: KernelPath, bits: i32) -> String {
    ffi::kernels_gemm_loop_name(path as i32, bits).unwrap_or_else(|_| "unknown".into())
}

/// GELU with the exact normal CDF, `0.5 * x * (1 + erf(x / sqrt(2)))`, as one
/// multithreaded node for float32 `x` (MLX's CPU erf is scalar): erf by
/// Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7) with a vectorized exp, so
/// within 2e-7 * |x| of the exact GELU. Other dtypes and GPU streams: MLX's ops.
pub fn gelu_erf(x: &Array) -> Result<Array> {
    gelu_erf_with_path(x, KernelPath::Auto)
}

/// [`gelu_erf`] on a chosen loop (`Portable`, `Avx2` or `Avx512`; the best
/// below it that this CPU runs).
pub fn gelu_erf_with_path(x: &Array, path: KernelPath) -> Result<Array> {
    Array::from_ffi(ffi::kernels_gelu_erf(&x.raw, path as i32))
}

/// `fast::rms_norm(x, weight, eps)` as one multithreaded CPU node for a
/// float32 `x` and a float32, float16 or bfloat16 `weight` (MLX evaluates its
/// own as five single-threaded elementwise passes on the CPU): the same
/// formula, `(x * rsqrt(mean(x^2) + eps)) * weight`, with the sum of squares in
/// eight interleaved partial sums, so it differs from MLX's in the last bits.
/// Other dtypes and GPU streams: MLX's op.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `weight` for the call.
    Array::from_ffi(unsafe { ffi::kernels_rms_norm(&x.raw, crate::fast::raw_ptr(weight), eps) })
}

/// `fast::rope(x, dims, traditional, base, scale, offset, freqs)` as one
/// multithreaded CPU node for a float32 `x` (`[.., L, D]`, any strides): the
/// angles of [`crate::fast::rope`] (positions `(offset + l) * scale`, inverse
/// frequencies `exp(-i * ln(base) / (dims / 2))` or `1 / freqs[i]`), computed
/// once and kept (the last four sets) for the next calls that ask for the same
/// ones: the q and k of every layer. The result is row-contiguous. Other
/// dtypes, shapes MLX refuses, and GPU streams: MLX's op.
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: i32,
    freqs: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `freqs` for the call.
    Array::from_ffi(unsafe {
        ffi::kernels_rope(&x.raw, dims, traditional, base, scale, offset, crate::fast::raw_ptr(freqs))
    })
}

/// `x @ w.T` for a dense `w` `[N, K]` (f32, f16 or bf16) and `x` `[..., K]`:
/// MLX's `x.matmul(w.T)` (promoted dtype) as one CPU node that never calls
/// BLAS. From 16 rows of `x` on it runs [`quantized_gemm`]'s packed panels and
/// microkernels (prefill); fewer rows dot rows of `w` in place, 4 rows of `x`
/// at a time (decode streams `w` once). AVX2 + FMA or portable vector code,
/// exact f32 accumulation: only the summation order differs from MLX. A `K` mismatch is an
/// error naming both shapes; on a GPU stream it returns MLX's matmul.
pub fn dense_matmul(x: &Array, w: &Array) -> Result<Array> {
    dense_matmul_with_path(x, w, KernelPath::Auto)
}

/// [`dense_matmul`] on a chosen loop (`Portable` or the AVX2 one above it).
pub fn dense_matmul_with_path(x: &Array, w: &Array, path: KernelPath) -> Result<Array> {
    Array::from_ffi(ffi::kernels_dense_matmul(&x.raw, &w.raw, path as i32))
}

/// Causal scaled-dot-product attention over many new tokens (prefill), the
/// result of `fast::scaled_dot_product_attention(q, k, v, scale,
/// AttentionMask::Causal)`: `q` `[B, H, L, D]`, `k` and `v` `[B, H_kv, S, D]`
/// (`H` a multiple of `H_kv`, `S >= L`; query `i` sees keys `0..=S - L + i`).
/// One CPU node: 8-query-row tasks with register-tiled scores and values
/// (AVX-512, AVX2 + FMA or portable vector code), an exact f32 softmax over
/// only the keys each block may see. The result is a transposed view of a
/// `[B, L, H, D]` buffer, so transposing it back to `[B, L, H, D]` and merging
/// the heads copies nothing. Inputs that [`causal_attention_supports`]
/// rejects (f16/bf16, a GPU stream, a head size not a multiple of 16) run
/// MLX's own attention.
pub fn causal_attention(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    Array::from_ffi(ffi::kernels_causal_attention(&q.raw, &k.raw, &v.raw, scale))
}

/// Whether [`causal_attention`] computes these inputs with its own kernel.
pub fn causal_attention_supports(q: &Array, k: &Array, v: &Array) -> bool {
    ffi::kernels_causal_attention_supports(&q.raw, &k.raw, &v.raw)
}

/// [`causal_attention`], or with `causal` false attention without a mask
/// (every query sees all `S` keys: an encoder, cross-attention), on the
/// same kernel; `S` may then be shorter than `L`. Inputs the kernel does not
/// take ([`attention_supports`]) run MLX's own attention.
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, causal: bool) -> Result<Array> {
    Array::from_ffi(ffi::kernels_attention(&q.raw, &k.raw, &v.raw, scale, causal))
}

/// Whether [`attention`] computes these inputs with its own kernel.
pub fn attention_supports(q: &Array, k: &Array, v: &Array, causal: bool) -> bool {
    ffi::kernels_attention_supports(&q.raw, &k.raw, &v.raw, causal)
}

/// `dequantize(w, scales, biases)[ids]` as one CPU node: the token
/// embedding lookup of a quantized checkpoint (MLX builds it from three
/// gathers and a dequantize). `ids` may be any integer dtype and shape; the
/// result is `[...ids, K]` in `dtype` (f32, f16 or bf16). An id outside the
/// table gives a row of zeros, since ids are often lazy and cannot be checked
/// when the node is built. On a GPU stream it returns MLX's ops.
pub fn quantized_embedding(
    ids: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    dtype: crate::Dtype,
) -> Result<Array> {
    Array::from_ffi(ffi::kernels_quantized_embedding(&ids.raw, &w.raw, &scales.raw, &biases.raw, group_size, bits, dtype as u8))
}
