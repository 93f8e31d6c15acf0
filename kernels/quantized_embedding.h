// Rows of an affine-quantized embedding table, dequantized: the token
// embedding lookup of a quantized checkpoint as one CPU graph node (MLX
// builds it from three gathers and a dequantize).
#pragma once

#include "mlx/mlx.h"

namespace mlxcel::kernels {

// `dequantize(w, scales, biases)[ids]`: ids of any integer dtype and shape,
// w uint32 [V, K * bits / 32], scales and biases [V, K / group_size] in
// f32/f16/bf16. Returns [...ids.shape, K] in `dtype` (f32, f16 or bf16).
// An id outside [0, V) gives a row of zeros (ids are often lazy, so they
// cannot be checked when the node is built). Bits 2, 3, 4, 5, 6 and 8. On a
// GPU stream it returns MLX's gathers and dequantize.
mlx::core::array quantized_embedding(
    const mlx::core::array& ids,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits,
    mlx::core::Dtype dtype,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlxcel::kernels
