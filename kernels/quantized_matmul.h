// mlxcel's CPU kernels for MLX's affine-quantized matmul, `x @ dequantize(w).T`.
//
// MLX 0.32's CPU `quantized_matmul` is scalar and single-threaded; for decode
// (a handful of activation rows against a large quantized weight) it is the
// whole cost of a forward pass. `quantized_matmul` below builds an MLX graph
// node whose CPU evaluation is ours: f32-exact math (weights unpacked to f32,
// f32 FMAs, f32 accumulation), split over output rows across a small
// persistent thread pool, with an AVX-512, AVX2, NEON integer or portable
// inner loop chosen at run time. On any other device, or for a layout the
// kernel does not handle, it returns MLX's own `quantized_matmul` node
// unchanged.
#pragma once

#include <optional>
#include <string>

#include "mlx/mlx.h"

namespace mlxcel::kernels {

// Which inner loop evaluates the kernel. `Auto` takes the best the CPU runs
// (x86-64: AVX-512 VNNI, else AVX-512, else AVX2 integer, else portable;
// aarch64: NEON integer), unless the environment variable MLXCEL_KERNELS
// (read once) names one of `portable`, `avx2`, `avx2-int8`, `avx512`,
// `avx512-vnni`, `neon-int8`; a path the CPU cannot run falls back to the
// best one below it (`avx512` and `avx2` to exact loops; the x86 paths on
// aarch64 and `neon-int8` elsewhere to portable).
//
// Portable, Avx2 and Avx512 are exact f32 (weights unpacked to f32, f32
// FMAs). The integer paths quantize each group of activations to 16 bits and
// run integer dot products: Avx512Vnni (bits 4 and 8, groups a multiple of
// 16 up to 256; others take Avx512) as two int8 halves
// x ~ s * (a + b / 256) with s = max|x| / 127 (vpdpbusd), Avx2Int8 (bits 2,
// 4, 8) as int16 x ~ s * x16 with s = max|x| / 32512 (vpmaddwd), and
// NeonInt8 (aarch64, baseline ARMv8-A Advanced SIMD; bits 2, 4, 8, other
// widths take Portable) with the same int16 activations (vmlal_s16). Either
// way the error per activation is at most max|x of its group| / 65024, far
// below the f16 rounding GPUs apply to activations. The bias term uses exact
// f32 sums.
enum class Path : int { Auto = -1, Portable = 0, Avx2 = 1, Avx512 = 2, Avx512Vnni = 3, Avx2Int8 = 4, NeonInt8 = 5 };

// The path `Auto` resolves to in this process.
Path auto_path();
// The path that actually runs when `requested` is asked for.
Path resolve_path(Path requested);
const char* path_name(Path path);

// The loop that reads a weight's interleaved copy (detail::VnniRows) on
// `path` for `bits` (groups a multiple of 16, up to 256): "avx512-vnni",
// "avx512-int16" (bits 4 and 8 on AMD CPUs), "avx2-int16" (Avx2Int8, bits 4
// and 8), or
// "" where no copy is read. The two int16 loops give the same bits.
const char* copy_loop_name(Path path, int bits);

// Threads the kernels use (the evaluating thread included): MLXCEL_NUM_THREADS
// when set, else std::thread::hardware_concurrency().
int num_threads();

// Whether `quantized_matmul` computes a layout itself (true) or hands it to
// MLX: bits 2, 3, 4, 5, 6 or 8 (3, 5 and 6 on the portable loop only),
// group_size a positive multiple of the values per 32-bit word, a 2-D weight.
bool supports(int group_size, int bits);

// `x @ dequantize(w, scales, biases).T` over the last axis of `x`, the same
// result (shape, dtype, errors) as
// `mlx::core::quantized_matmul(x, w, scales, biases, /*transpose=*/true,
// group_size, bits, "affine", s)`.
mlx::core::array quantized_matmul(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits,
    Path path = Path::Auto,
    mlx::core::StreamOrDevice s = {},
    const std::optional<mlx::core::array>& vnni_rows = std::nullopt);

// A copy of the weight in the order the AVX-512 VNNI matvec (and the AVX2
// integer matvec for bits 4 and 8) streams it (full blocks of 16 rows,
// output-interleaved; see detail::VnniRows), as a 1-D uint8 array to pass to
// `quantized_matmul` with the same weight. Made only where this process's
// matvec runs such a loop on the layout (VNNI: bits 4 or 8, groups a multiple
// of 16 up to 256; AVX2: bits 4 or 8; at least 16 rows) and MLXCEL_REPACK is not
// "0"; nullopt otherwise. Evaluates w, scales and
// biases. The copy costs as much memory as the weight; with it the matvec
// reads one forward stream and transposes nothing.
std::optional<mlx::core::array> vnni_rows(
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits);

}  // namespace mlxcel::kernels
