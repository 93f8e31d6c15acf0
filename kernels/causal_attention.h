// mlxcel's CPU kernel for causal scaled-dot-product attention over many new
// tokens (prefill): the same result as
// `mlx::core::fast::scaled_dot_product_attention(q, k, v, scale, "causal")`.
//
// MLX 0.32's CPU path builds it from ops: a [L, S] score matrix per head
// through BLAS, a where() for the mask, a scalar-exp softmax and a second
// matmul, all over the full square although half of it is masked. Here it is
// one graph node: keys and values are packed once per KV head (K transposed),
// and each task takes 8 query rows of one head: scores against the keys they
// may see (8x32 AVX-512 register tiles, or 4x16 tiles on AVX2 + FMA and in
// the portable vector code every other CPU runs), an exact softmax with a
// vectorized exp, and probabilities times values (the same tiles again). Grouped-query
// attention reads the KV head h / (H / H_kv) in place of repeating K and V.
//
// Numerics follow MLX's decomposition: q is multiplied by `scale` first,
// scores and sums are f32, softmax subtracts the row maximum and multiplies
// by the reciprocal of the sum.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"

namespace mlxcel::kernels {

// Whether `causal_attention` computes these inputs itself: a CPU stream,
// float32 q, k, v of rank 4, head_dim a multiple of 16, H a multiple of H_kv,
// S >= L (any CPU: the loops follow MLXCEL_KERNELS and the CPU's features).
bool causal_attention_supports(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v);

// q [B, H, L, D], k and v [B, H_kv, S, D] (any strides) -> [B, H, L, D]:
// query i sits at position S - L + i and sees keys 0 ..= S - L + i. The
// result is a transposed view of a row-contiguous [B, L, H, D] buffer, so
// `transpose(out, {0, 2, 1, 3})` followed by a reshape to [B, L, H * D]
// copies nothing. Anything `causal_attention_supports` rejects is handed to
// MLX's own scaled_dot_product_attention with the causal mask.
mlx::core::array causal_attention(
    const mlx::core::array& q,
    const mlx::core::array& k,
    const mlx::core::array& v,
    float scale,
    mlx::core::StreamOrDevice s = {});

// Whether `attention` computes these inputs itself: as
// causal_attention_supports, and without the mask S may be any length.
bool attention_supports(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, bool causal);

// causal_attention, or with `causal` false every query sees every key (an
// encoder's self-attention, cross-attention): MLX's
// scaled_dot_product_attention without a mask, on the same kernel.
mlx::core::array attention(
    const mlx::core::array& q,
    const mlx::core::array& k,
    const mlx::core::array& v,
    float scale,
    bool causal,
    mlx::core::StreamOrDevice s = {});

// causal_attention for one sequence whose keys and values live in a paged
// pool: k and v [1, H_kv, L, D] are the new positions offset .. offset + L,
// written into the pools (float32 [H_kv, blocks, block, D], block a power of
// two >= 8; position t at block table[t / block], row t % block) in place when
// they are dense, and q [1, H, L, D] attends over positions 0 .. offset + L
// read from the blocks. The same result as causal_attention over the
// contiguous keys and values. With a `window` > 0, the token at position p
// sees only positions [0, keep) and [p + 1 - window, p] (as
// DecoderLayerSpec::kv_window), table entries of blocks no new token sees
// may be -1, and the result still does not depend on how a prompt is cut
// into calls. An 8-bit pool (kv_pool_buffer_q8, passed as both pools) holds
// every layer: `layer` is this one, the new rows are quantized as
// decoder_layer_paged does, and attention reads them dequantized. Returns
// {out [1, H, L, D] as causal_attention does, keys pool, values pool}. CPU only; throws std::invalid_argument naming the
// input that does not fit.
std::vector<mlx::core::array> paged_causal_attention(
    const mlx::core::array& q,
    const mlx::core::array& k,
    const mlx::core::array& v,
    const mlx::core::array& pool_keys,
    const mlx::core::array& pool_values,
    const std::vector<int32_t>& table,
    int offset,
    float scale,
    int window = 0,
    int keep = 0,
    int layer = 0,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlxcel::kernels
