// RMSNorm and RoPE for the op-by-op graph (prompts the fused decoder block
// does not take) as multithreaded CPU nodes. MLX's CPU evaluates its
// `fast::rms_norm` and `fast::rope` as their fallbacks: five to eight
// elementwise ops, each a single-threaded pass with its own allocation, and
// RoPE's sines and cosines recomputed for every call. These compute the same
// formulas in one pass over x, split over the kernels' pool, and keep the
// last few RoPE tables (q and k of every layer of a forward pass share one;
// models that alternate bases between layers keep one per base).
#pragma once

#include <optional>

#include "mlx/mlx.h"

namespace mlxcel::kernels {

// `mlx::core::fast::rms_norm(x, weight, eps)`: y = (x * rsqrt(mean(x^2) + eps))
// * weight over the last axis, for a float32 `x` and a float32, float16 or
// bfloat16 `weight` of the last axis' size (or none). The sum of squares runs
// in eight interleaved f32 partial sums, so results differ from MLX's in the
// last bits only. Anything else (other dtypes, a GPU stream) returns MLX's op.
mlx::core::array rms_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps,
                          mlx::core::StreamOrDevice s = {});

// `mlx::core::fast::rope(x, dims, traditional, base, scale, offset, freqs)`
// for a float32 `x` of at least 3 dimensions [..., L, D] (any strides with a
// unit last one): the first `dims` features of row l rotate by angles
// (offset + l) * scale * inv_freq[i], inv_freq[i] = exp(-i * log(base) /
// (dims / 2)) or 1 / freqs[i] (float32 `freqs`, dims / 2 of them), in pairs
// (i, i + dims / 2), or (2i, 2i + 1) when `traditional`; the other features
// are copied. The result is row-contiguous. Anything else returns MLX's op.
mlx::core::array rope(const mlx::core::array& x, int dims, bool traditional, std::optional<float> base, float scale,
                      int offset, const std::optional<mlx::core::array>& freqs = std::nullopt,
                      mlx::core::StreamOrDevice s = {});

}  // namespace mlxcel::kernels
