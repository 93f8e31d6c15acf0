// GELU with the exact normal CDF, `0.5 * x * (1 + erf(x / sqrt(2)))` (MLX's
// `nn.gelu`, BERT's `gelu`), as one multithreaded CPU node: MLX's CPU erf is
// scalar and single-threaded, the largest cost of an encoder's MLP after
// its matmuls.
#pragma once

#include "mlx/mlx.h"
#include "quantized_matmul.h"

namespace mlxcel::kernels {

// Element-wise GELU of a float32 `x` (any shape; other dtypes: MLX's ops).
// erf runs as Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7) with a
// vectorized exp on AVX-512 and AVX2, std::erf on the portable path: the
// result is within 2e-7 * |x| of the exact GELU. `path` forces a loop
// (Portable, Avx2, Avx512) for tests; Auto picks the best this CPU runs. On
// a GPU stream it returns MLX's ops.
mlx::core::array gelu_erf(const mlx::core::array& x, Path path = Path::Auto, mlx::core::StreamOrDevice s = {});

}  // namespace mlxcel::kernels
