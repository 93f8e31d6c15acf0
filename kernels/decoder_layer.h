// One pre-norm decoder block (llama / mistral / qwen2 / qwen3 layout) for a
// few new tokens, as a single MLX graph node on the CPU:
//
//   h   = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1), cache))
//   out = h + down_proj(silu(gate_proj(n2)) * up_proj(n2)),
//   n1  = rms_norm(x, input_norm), n2 = rms_norm(h, post_attention_norm),
//
// and Gemma's variant: GELU (tanh) for SiLU, and the attention and MLP
// outputs normed before their residual adds (DecoderLayerInputs::attn_out_norm).
//
// MLX builds the same block out of ~25 nodes per layer; at decode time their
// dispatch costs more than the arithmetic. Here the whole block is one node:
// the seven projections run on the quantized matvec loops of
// quantized_matmul.cc (from 16 new tokens per sequence, on most loops, on the
// GEMM's packed panels of quantized_gemm.cc instead: see
// projections_use_gemm), and the new keys and values are written into the KV
// cache buffers in place. The caches are inputs and outputs of the node: an
// output takes over its input's buffer when the caller owns it
// (`cache_in_place`), and is a copy otherwise, so the graph stays functional
// for other callers.
//
// Numerics follow MLX's own CPU ops (fast::rms_norm, fast::rope,
// scaled_dot_product_attention): f32 throughout, the same formulas and
// operation order, exact f32 dequantization.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
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
  // Unused when the inputs carry rope_freqs.
  float rope_base = 0.0f;
  float rope_scale = 1.0f;
  bool rope_traditional = false;
  // YaRN's attention factor: q and k are multiplied by it before the
  // rotation, as mlx-lm's YarnRoPE does (1: none).
  float rope_mscale = 1.0f;
  // Softmax scale, usually head_dim^-0.5.
  float attn_scale = 0.0f;
  // A sliding window: the token at position p sees positions [0, kv_keep)
  // and [p + 1 - kv_window, p] (mlx-lm's RotatingKVCache with max_size
  // kv_keep + kv_window and keep kv_keep; Gemma 3's sliding layers have
  // kv_keep 0). 0 sees every position. Blocks of a paged pool that no new
  // token sees may be -1 in the tables.
  int kv_window = 0;
  int kv_keep = 0;
  // The layer's index in an 8-bit paged pool (kv_pool_buffer_q8), which
  // holds every layer; unused otherwise.
  int kv_layer = 0;
  // The MLP gate's activation: 0 SiLU (llama, qwen), 1 GELU's tanh
  // approximation as MLX's nn.gelu_approx computes it (Gemma).
  int activation = 0;
  // A mixture of experts in place of the MLP when `experts` > 0: `router`
  // [experts, hidden] scores them; gate_proj and up_proj hold the experts
  // stacked as [experts * intermediate, hidden], down_proj as
  // [experts * hidden, intermediate]; each row runs its top_k experts,
  // weighted by (routing 0) a softmax over their k logits (Mixtral), or by
  // their softmax probabilities over all experts (1), renormalized to sum to
  // 1 (2; Qwen3-MoE's norm_topk_prob). SiLU only, no output norms or biases.
  int experts = 0;
  int top_k = 0;
  int routing = 0;
  // The caller owns the cache buffers: nothing reads them at positions
  // >= offset except nodes evaluated after this one, so the new rows can be
  // written into the input buffers even while other references exist (the
  // previous step, still queued, holds them).
  bool cache_in_place = false;
};

// An MLX affine-quantized [out, in] projection (weight uint32
// [out, in * bits / 32], scales and biases [out, in / group] of one float
// dtype; bits and group size follow from the shapes), plus an optional
// float bias [out] added to its output.
struct QuantizedProjection {
  mlx::core::array weight;
  mlx::core::array scales;
  mlx::core::array biases;
  std::optional<mlx::core::array> bias;
};

// The arrays of one block, by name. Float vectors may be f32, f16 or bf16.
struct DecoderLayerInputs {
  mlx::core::array x;  // float32 [1, L, hidden]
  mlx::core::array input_norm;  // input_layernorm weight [hidden]
  QuantizedProjection q_proj, k_proj, v_proj, o_proj;
  mlx::core::array post_attention_norm;  // [hidden]
  QuantizedProjection gate_proj, up_proj, down_proj;
  // float32 [1, kv_heads, capacity, head_dim] with capacity >= offset + L;
  // positions below `offset` hold the cache.
  mlx::core::array keys, values;
  // Qwen3's per-head RMSNorm of q and k (eps `norm_eps`): both or neither.
  std::optional<mlx::core::array> q_norm, k_norm;  // [head_dim]
  // Per-frequency periods (llama3 scaling) in place of rope_base.
  std::optional<mlx::core::array> rope_freqs;  // [rope_dims / 2]
  // Gemma's norms of the attention and MLP outputs before their residual
  // adds (both or neither): h = x + rms_norm(o_proj(..), attn_out_norm),
  // out = h + rms_norm(down_proj(..), mlp_out_norm); post_attention_norm is
  // then the MLP's input norm.
  std::optional<mlx::core::array> attn_out_norm, mlp_out_norm;  // [hidden]
  // The router of a mixture of experts (spec.experts > 0).
  std::optional<QuantizedProjection> router;
};

// Returns {out [1, L, hidden], keys, values}: the caches with positions
// offset..offset+L written. Throws std::invalid_argument naming the input
// on any mismatch, and on a non-CPU stream (GPUs use MLX's ops).
std::vector<mlx::core::array> decoder_layer(
    const DecoderLayerInputs& inputs,
    const DecoderLayerSpec& spec,
    mlx::core::StreamOrDevice s = {});

// A block's weights, checked, laid out and evaluated once: the node that
// `decoder_layer(prepared, ...)` builds has x and the caches as its only graph
// inputs, where the node above has ~25. Decode builds one node per layer and
// step, and MLX's graph work grows with the inputs (building, traversal,
// scheduling on the evaluating thread), so decode keeps its blocks prepared.
// Immutable after construction: share it between threads and nodes.
struct PreparedDecoderLayer;

// Checks the weights of `inputs` (x, keys and values are not read) against
// `spec`'s dimensions and evaluates them. Throws like `decoder_layer`.
std::shared_ptr<const PreparedDecoderLayer> prepare_decoder_layer(
    const DecoderLayerInputs& inputs,
    const DecoderLayerSpec& spec,
    mlx::core::StreamOrDevice s = {});

// The same block as `decoder_layer(inputs, spec)` on prepared weights.
// `spec` may differ from the prepared one in offset, rope and attention
// options and cache_in_place, not in dimensions.
std::vector<mlx::core::array> decoder_layer(
    const std::shared_ptr<const PreparedDecoderLayer>& weights,
    const mlx::core::array& x,
    const mlx::core::array& keys,
    const mlx::core::array& values,
    const DecoderLayerSpec& spec,
    mlx::core::StreamOrDevice s = {});

// B sequences of L new tokens each in one node, every sequence over its own
// cache: x float32 [B, L, hidden]; keys[b] and values[b] as above with
// capacity >= offsets[b] + L (spec.offset is not read). The projections read
// each weight once for all B * L rows, and every row is computed exactly as
// it would be alone (the same operations in the same order), so a
// sequence's result does not depend on the others. Returns
// {out [B, L, hidden], keys[0..B), values[0..B)}.
std::vector<mlx::core::array> decoder_layer_batch(
    const std::shared_ptr<const PreparedDecoderLayer>& weights,
    const mlx::core::array& x,
    const std::vector<mlx::core::array>& keys,
    const std::vector<mlx::core::array>& values,
    const std::vector<int>& offsets,
    const DecoderLayerSpec& spec,
    mlx::core::StreamOrDevice s = {});

// decoder_layer_batch over a paged KV pool: the keys and values of every
// sequence live in one pool pair, float32 [kv_heads, blocks, block, head_dim]
// (block a power of two >= 8 positions), and sequence b's position t is at
// block tables[b][t / block], row t % block. Each table covers at least
// offsets[b] + L positions, and no two sequences write the same block. The
// pools are written in place (spec.cache_in_place) or copied whole, and
// attention reads the blocks where they lie. Every row is computed exactly
// as with a contiguous cache. Returns {out [B, L, hidden], keys, values}.
//
// An 8-bit pool (kv_pool_buffer_q8, passed as both pool_keys and
// pool_values, written in place only) holds the layer spec.kv_layer: each
// new key and value row is quantized as mx::quantize does (group 64, 8 bits,
// f32 scales and biases), and attention reads the quantized rows as mlx-lm's
// quantized attention does, q . k = sum over groups of scale * (q . k_q) +
// bias * sum(q), and likewise for the values.
std::vector<mlx::core::array> decoder_layer_paged(
    const std::shared_ptr<const PreparedDecoderLayer>& weights,
    const mlx::core::array& x,
    const mlx::core::array& pool_keys,
    const mlx::core::array& pool_values,
    const std::vector<std::vector<int32_t>>& tables,
    const std::vector<int>& offsets,
    const DecoderLayerSpec& spec,
    mlx::core::StreamOrDevice s = {});

// Consecutive decoder_layer_paged blocks as one node: layers[i] with
// specs[i] over pool_keys[i] / pool_values[i], the output of each the input
// of the next, every sequence over the same tables and offsets. Decode
// builds one such node per step instead of one per layer, which keeps MLX's
// per-node work (graph building, traversal, a task per node, the caller's
// wait once ~10 tasks are queued) out of the step. Each layer computes
// exactly what its own decoder_layer_paged node computes. Returns
// {out [B, L, hidden], keys[0..n), values[0..n)}.
std::vector<mlx::core::array> decoder_stack_paged(
    const std::vector<std::shared_ptr<const PreparedDecoderLayer>>& layers,
    const mlx::core::array& x,
    const std::vector<mlx::core::array>& pool_keys,
    const std::vector<mlx::core::array>& pool_values,
    const std::vector<std::vector<int32_t>>& tables,
    const std::vector<int>& offsets,
    const std::vector<DecoderLayerSpec>& specs,
    mlx::core::StreamOrDevice s = {});

// How many decoder_stack_paged nodes this process has built.
uint64_t decoder_stack_nodes();

}  // namespace mlxcel::kernels
