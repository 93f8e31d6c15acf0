// The 8-bit KV pool's layout and its row quantization, shared by the fused
// decoder block and the paged prefill attention. Not part of the public
// kernel API (kv_pool.h makes the pools).
//
// A quantized pool is one uint8 array [blocks, layers, 2, kv_heads, section]:
// a block holds its positions of every layer, keys (0) then values (1), so a
// freed block is one contiguous run of whole pages (a per-layer layout would
// give 1,152-byte runs, smaller than a page, that could never be handed back).
// A section is one head's `block` positions: `block` rows of head_dim uint8,
// then block x groups f32 scales, then block x groups f32 biases, one group
// per 64 features (mlx-lm's QuantizedKVCache: group 64, 8 bits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mlxcel::kernels::detail {

constexpr int kKvQ8Group = 64;

struct KvQ8Layout {
  int layers = 0, kv_heads = 0, block = 0, dim = 0;

  int groups() const { return dim / kKvQ8Group; }
  size_t row_bytes() const { return (size_t)dim + 8 * groups(); }
  size_t section_bytes() const { return (size_t)block * row_bytes(); }
  size_t block_bytes() const { return section_bytes() * 2 * kv_heads * layers; }
  // Byte offset of (layer, keys 0 / values 1, head) inside a block.
  size_t section(int layer, int kind, int head) const {
    return (((size_t)layer * 2 + kind) * kv_heads + head) * section_bytes();
  }
};

// One position of one head: dim quantized features and a scale and bias
// per group.
template <typename Byte, typename Float>
struct KvQ8RowT {
  Byte* q;
  Float* scales;
  Float* biases;
};
using KvQ8Row = KvQ8RowT<uint8_t, float>;
using KvQ8ConstRow = KvQ8RowT<const uint8_t, const float>;

// Row `r` (< block) of a section starting at `section`.
template <typename Byte>
inline auto kv_q8_row(Byte* section, const KvQ8Layout& l, int r) {
  using Float = std::conditional_t<std::is_const_v<Byte>, const float, float>;
  Byte* q = section + (size_t)r * l.dim;
  auto* scales = reinterpret_cast<Float*>(section + (size_t)l.block * l.dim) + (size_t)r * l.groups();
  return KvQ8RowT<Byte, Float>{q, scales, scales + (size_t)l.block * l.groups()};
}

// MLX's affine quantization (mx::quantize, 8 bits) of dim floats in groups
// of 64, in f32: per group the extreme of larger magnitude is represented
// exactly, w ~ scale * q + bias with q in [0, 255].
inline void kv_q8_quantize(const float* x, int dim, KvQ8Row row) {
  for (int g = 0; g < dim / kKvQ8Group; ++g) {
    const float* w = x + g * kKvQ8Group;
    float lo = w[0], hi = w[0];
    for (int i = 1; i < kKvQ8Group; ++i) {
      lo = std::min(lo, w[i]);
      hi = std::max(hi, w[i]);
    }
    const bool low_edge = std::fabs(lo) > std::fabs(hi);
    float scale = std::max((hi - lo) / 255.0f, 1e-7f);
    scale = low_edge ? scale : -scale;
    const float edge = low_edge ? lo : hi;
    const float q0 = std::nearbyint(edge / scale);
    if (q0 != 0.0f) scale = edge / q0;
    const float bias = q0 == 0.0f ? 0.0f : edge;
    for (int i = 0; i < kKvQ8Group; ++i) {
      const float q = std::nearbyint((w[i] - bias) / scale);
      row.q[g * kKvQ8Group + i] = (uint8_t)std::clamp(q, 0.0f, 255.0f);
    }
    row.scales[g] = scale;
    row.biases[g] = bias;
  }
}

// dim floats from a quantized row: scale * q + bias.
inline void kv_q8_dequantize(KvQ8ConstRow row, int dim, float* out, size_t stride = 1) {
  for (int g = 0; g < dim / kKvQ8Group; ++g) {
    const float s = row.scales[g], b = row.biases[g];
    for (int i = g * kKvQ8Group; i < (g + 1) * kKvQ8Group; ++i) out[i * stride] = s * (float)row.q[i] + b;
  }
}

}  // namespace mlxcel::kernels::detail
