// mlxcel's CPU GEMM kernels for many rows of activations (prefill):
// `x @ dequantize(w).T` for MLX's affine-quantized weights, and `x @ w.T` for
// dense ones.
//
// quantized_matmul.h serves a few rows (decode): it streams the packed
// weight once per call and is bound by memory bandwidth. With hundreds of
// rows the same weight is reused by every row and the work is compute-bound,
// so this kernel is a GEMM: each task dequantizes a panel of the weight
// (up to 64 output features by all K, a few hundred KiB, which stays in L2)
// into a thread-local f32 buffer and runs blocks of rows of x against it,
// with the best inner loop the CPU runs:
//  - AMX (the default where the CPU has AMX-BF16 and Linux grants the tile
//    state; see gemm_uses_amx): activations and dequantized weights are split
//    into two bf16 halves each, v ~ hi + lo, and 32x32 output blocks sum
//    three tile products (hi.hi, hi.lo, lo.hi) in f32. Each product term is
//    off by at most ~3 * 2^-16 of |x w| (far less on average): the same
//    class of precision as the matvec kernel's 16-bit VNNI path.
//  - integer loops for 4- and 8-bit weights on AVX-512 VNNI without AMX
//    (e.g. AMD EPYC Zen 4/5: vpdpwssd, 6x32) and for 8-bit weights on the
//    AVX2 integer path (MLXCEL_KERNELS=avx2-int8 and AVX2-only CPUs:
//    vpmaddwd + vpaddd, 3x16): x is quantized
//    per row and group to 16 bits as the decode matvec quantizes it (at most
//    max|x| / 65024 off per activation), panels hold the weights' codes as
//    int16 pairs, and each group's products are summed exactly in int32
//    before one f32 epilogue per group (gemm_int16.inc). 1.3-1.5x the exact
//    loops' speed on Zen 5 (8-bit) and Zen 4 (4-bit); groups up to 256.
//  - exact f32 AVX-512 (or MLXCEL_KERNELS=avx512, or MLXCEL_AMX=0): an 8x32
//    register-blocked FMA microkernel.
//  - exact f32 AVX2 + FMA (x86-64 without AVX-512, or MLXCEL_KERNELS=avx2):
//    a 6x16 microkernel over the same panels.
//  - exact f32 portable loops (every other CPU, aarch64 included, or
//    MLXCEL_KERNELS=portable), written with vector extensions the compiler
//    maps onto NEON or SSE.
// The exact loops dequantize as MLX does (scale * q + bias in f32) and
// accumulate in f32: the result differs from `x @ dequantize(w).T` only in
// summation order. Bits 2, 4 and 8 run on every loop; 3, 5 and 6 on the AVX2
// and portable ones.
//
// It returns an MLX graph node (evaluated on the CPU through MLX's command
// encoder, threads from the kernels' shared pool), so quantized models never
// reach MLX's matmul and its BLAS. On a GPU stream, or where this GEMM does
// not apply (see `gemm_supports`), it returns `quantized_matmul` from
// quantized_matmul.h (our matvec kernel or MLX's op).
#pragma once

#include "mlx/mlx.h"
#include "quantized_matmul.h"

namespace mlxcel::kernels {

// Whether `quantized_gemm` runs the GEMM itself for (group_size, bits): bits
// 2, 4 or 8 with group_size a multiple of 32 / bits, or bits 3, 5 or 6 with
// group_size a multiple of 32. Every CPU runs it (see the loops above).
bool gemm_supports(int group_size, int bits);

// The loop a `quantized_gemm` call on `path` runs for `bits` (0: dense
// weights) with groups of up to 256: "amx", "avx512-int16", "avx512",
// "avx2-int16", "avx2" or "portable".
const char* gemm_loop_name(Path path, int bits);

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
// [N, K / group_size] in f32, f16 or bf16. `path` caps the loop as for
// `quantized_matmul` (Portable, Avx2, Avx512, Avx512Vnni = AMX where usable).
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

// `x @ w.T` for a dense weight `w` [N, K] (f32, f16 or bf16; converted to
// f32 once per evaluation when not f32) and `x` [..., K]: the result of
// `mlx::core::matmul(x, transpose(w))` in the promoted dtype, without BLAS.
// From 16 rows of x on it runs the quantized GEMM's panels and microkernels
// (w transposed into L2-sized panels instead of dequantized); fewer rows read
// w in place, 4 rows of x by 3 rows of w at a time, f32 dot products along K
// (so decode, a single row, streams w once). On a GPU stream it returns MLX's
// matmul.
mlx::core::array dense_matmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    Path path = Path::Auto,
    mlx::core::StreamOrDevice s = {});

}  // namespace mlxcel::kernels
