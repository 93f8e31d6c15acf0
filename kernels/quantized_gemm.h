// mlxcel's CPU kernel for MLX's affine-quantized matmul with many rows of
// activations (prefill): `x @ dequantize(w).T`.
//
// quantized_matmul.h serves a few rows (decode): it streams the packed
// weight once per call and is bound by memory bandwidth. With hundreds of
// rows the same weight is reused by every row and the work is compute-bound,
// so this kernel is a GEMM: each task dequantizes a panel of the weight
// (up to 128 output features by all K, a few hundred KiB, which stays in L2)
// into a thread-local buffer and runs blocks of rows of x against it, with
// one of two inner loops:
//  - AMX (the default where the CPU has AMX-BF16 and Linux grants the tile
//    state; see gemm_uses_amx): activations and dequantized weights are split
//    into two bf16 halves each, v ~ hi + lo, and 32x32 output blocks sum
//    three tile products (hi.hi, hi.lo, lo.hi) in f32. Each product term is
//    off by at most ~3 * 2^-16 of |x w| (far less on average): the same
//    class of precision as the matvec kernel's 16-bit VNNI path.
//  - exact f32 (AVX-512, or MLXCEL_KERNELS=avx512, or MLXCEL_AMX=0): an
//    8x32 register-blocked FMA microkernel over f32 panels. Exact f32
//    dequantization (scale * q + bias, as MLX's dequantize) and f32 dot
//    products: the result differs from `x @ dequantize(w).T` only in
//    summation order.
//
// It returns an MLX graph node (evaluated on the CPU through MLX's command
// encoder, threads from the kernels' shared pool). On a GPU stream, or where
// this GEMM does not apply (no AVX-512, bits other than 2/4/8, a group size
// that is not a multiple of 32 / bits... see `gemm_supports`), it returns
// `quantized_matmul` from quantized_matmul.h (our matvec kernel or MLX's op).
#pragma once

#include "mlx/mlx.h"
#include "quantized_matmul.h"

namespace mlxcel::kernels {

// Whether `quantized_gemm` runs the GEMM itself for (group_size, bits) on
// this CPU (AVX-512 present; bits 2, 4 or 8; group_size a multiple of
// 32 / bits).
bool gemm_supports(int group_size, int bits);

// Whether calls on `path` run the AMX loop: Auto (unless MLXCEL_KERNELS
// caps it below avx512-vnni) and Avx512Vnni, where the CPU has AMX-BF16 and
// the OS grants the tile state (and MLXCEL_AMX is not 0). It splits both
// operands into two bf16 halves (v ~ hi + lo) and sums three bf16 tile
// products in f32: at most ~3 * 2^-16 (4.6e-5) relative error per product
// term, far less on average; the same class as the matvec's 16-bit VNNI path. `Avx512` runs
// the exact f32 loop.
bool gemm_uses_amx(Path path = Path::Auto);

// Same contract as `quantized_matmul` (shape, dtype, errors): `x` is [..., K]
// in f32, f16 or bf16; `w` uint32 [N, K * bits / 32]; `scales` and `biases`
// [N, K / group_size] in f32, f16 or bf16. `path` Portable or Avx2 hand the
// call to `quantized_matmul` with that path (for comparisons).
mlx::core::array quantized_gemm(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits,
    Path path = Path::Auto,
    mlx::core::StreamOrDevice s = {});

// The gated MLP's first half in one node: silu(x @ gate.T) * (x @ up.T),
// silu(g) = g * sigmoid(g) = g / (1 + e^-g) as MLX computes it (the
// exponential is a vectorized polynomial within ~2 ulp). Each task packs the
// same panel of both weights and combines the two tiles as they are stored,
// so neither product is materialized. Gate and up must agree in shape and
// dtypes; anything the GEMM does not handle is computed as
// quantized_gemm(gate) and quantized_gemm(up) joined by MLX's ops.
mlx::core::array quantized_gemm_swiglu(
    const mlx::core::array& x,
    const mlx::core::array& gate_w,
    const mlx::core::array& gate_scales,
    const mlx::core::array& gate_biases,
    const mlx::core::array& up_w,
    const mlx::core::array& up_scales,
    const mlx::core::array& up_biases,
    int group_size,
    int bits,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlxcel::kernels
