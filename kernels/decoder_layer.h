// One pre-norm decoder block (llama / mistral / qwen2 / qwen3 layout) for a
// few new tokens, as a single MLX graph node on the CPU:
//
//   h   = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1), cache))
//   out = h + down_proj(silu(gate_proj(n2)) * up_proj(n2)),
//   n1  = rms_norm(x, input_norm), n2 = rms_norm(h, post_attention_norm).
//
// MLX builds the same block out of ~25 nodes per layer; at decode time their
// dispatch costs more than the arithmetic. Here the whole block is one node:
// the seven projections run on the quantized matvec loops of
// quantized_matmul.cc, and the new keys and values are written into the KV
// cache buffers in place. The caches are inputs and outputs of the node: an
// output takes over its input's buffer when the caller owns it
// (`cache_in_place`), and is a copy otherwise, so the graph stays functional
// for other callers.
//
// Numerics follow MLX's own CPU ops (fast::rms_norm, fast::rope,
// scaled_dot_product_attention): f32 throughout, the same formulas and
// operation order, exact f32 dequantization.
#pragma once

#include <vector>

#include "mlx/mlx.h"

namespace mlxcel::kernels {

struct DecoderLayerSpec {
  int hidden = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int intermediate = 0;
  // Position of the first new token (the number of cached positions).
  int offset = 0;
  float norm_eps = 0.0f;
  // Rotary embedding over the first `rope_dims` features of each head.
  int rope_dims = 0;
  float rope_base = 0.0f;
  float rope_scale = 1.0f;
  bool rope_traditional = false;
  // Softmax scale, usually head_dim^-0.5.
  float attn_scale = 0.0f;
  bool qkv_bias = false;
  bool o_bias = false;
  bool mlp_bias = false;
  // Qwen3's per-head RMSNorm of q and k (eps `norm_eps`).
  bool qk_norm = false;
  // Per-frequency periods (llama3 scaling) instead of rope_base.
  bool rope_freqs = false;
  // The caller owns the cache buffers: nothing reads them at positions
  // >= offset except nodes evaluated after this one, so the new rows can be
  // written into the input buffers even while other references exist (the
  // previous step, still queued, holds them).
  bool cache_in_place = false;
};

// Inputs, in this order (each projection is an MLX affine-quantized triple
// weight, scales, biases; bits and group size follow from the shapes):
//    0  x [1, L, hidden] float32
//    1  input_layernorm weight [hidden]
//    2  q_proj (3 arrays), 5 k_proj, 8 v_proj, 11 o_proj
//   14  post_attention_layernorm weight [hidden]
//   15  gate_proj (3 arrays), 18 up_proj, 21 down_proj
//   24  keys, 25 values: float32 [1, kv_heads, capacity, head_dim] with
//       capacity >= offset + L; positions below `offset` hold the cache.
//   then, when enabled: q/k/v biases, o bias, gate/up/down biases,
//   q_norm and k_norm weights [head_dim], rope freqs [rope_dims / 2].
// Returns {out [1, L, hidden], keys, values}: the caches with positions
// offset..offset+L written. Throws std::invalid_argument on any mismatch,
// and on a non-CPU stream (GPUs use MLX's ops).
std::vector<mlx::core::array> decoder_layer(
    const std::vector<mlx::core::array>& inputs,
    const DecoderLayerSpec& spec,
    mlx::core::StreamOrDevice s = {});

// How many inputs `decoder_layer` expects for `spec`.
int decoder_layer_input_count(const DecoderLayerSpec& spec);

}  // namespace mlxcel::kernels
