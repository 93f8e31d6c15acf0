// Memory for paged KV pools: float32 [kv_heads, blocks, block, head_dim]
// arrays whose pages are mapped on first touch and can be handed back, so a
// pool sized for its whole byte budget costs only the blocks in use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "mlx/mlx.h"

namespace mlxcel::kernels {

// An evaluated float32 [kv_heads, blocks, block, head_dim] array over an
// anonymous mapping: untouched pages are not resident, and read as zeros.
// Throws std::invalid_argument on non-positive dimensions and
// std::bad_alloc when the mapping fails.
mlx::core::array kv_pool_buffer(int blocks, int kv_heads, int block, int head_dim);

// The same for an 8-bit pool (mlx-lm's QuantizedKVCache, group 64): one
// uint8 [blocks, layers, 2, kv_heads, section] array for every layer's keys
// and values (kv_q8.h has the layout). head_dim must be a multiple of 64.
mlx::core::array kv_pool_buffer_q8(int blocks, int layers, int kv_heads, int block, int head_dim);

// Returns the pages that lie wholly inside blocks `ids` of `pool` (an array
// from kv_pool_buffer, where a block is one run of rows per KV head, or from
// kv_pool_buffer_q8, where it is one run) to the system; they read as zeros
// afterwards. The caller guarantees that no queued evaluation reads those
// blocks.
void kv_pool_release(const mlx::core::array& pool, const std::vector<int32_t>& ids);

// Bytes of `a`'s buffer (evaluated) that are resident in memory.
size_t resident_bytes(const mlx::core::array& a);

}  // namespace mlxcel::kernels
