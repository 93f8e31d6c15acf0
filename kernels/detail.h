// Internals the kernels share (implemented in quantized_matmul.cc): the
// quantized matvec loops on raw pointers, the thread pool, scalar loads, the
// portable dot product.
// Not part of the public kernel API.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "mlx/mlx.h"
#include "quantized_matmul.h"

namespace mlxcel::kernels::detail {

enum class Scalar : int { F32 = 0, F16 = 1, BF16 = 2 };

// float32, float16 or bfloat16.
bool is_float(mlx::core::Dtype dtype);

// `a` itself when it is known to be row-contiguous (evaluated and dense), else
// a contiguous copy on `stream`: the kernels read their weights as dense rows.
mlx::core::array row_contiguous(const mlx::core::array& a, mlx::core::Stream stream);

// Throws std::invalid_argument naming `what` for a dtype other than f32/f16/bf16.
Scalar scalar_of(mlx::core::Dtype dtype, const char* what);
float load_f32(const void* p, Scalar type, size_t i);
// n elements of a vector of `type` from element `at` on, `stride` elements
// apart, as f32 into dst (vectorized where stride is 1).
void load_row_f32(const void* p, Scalar type, size_t at, int64_t stride, int n, float* dst);

// An affine-quantized [n, k] weight in MLX's layout, read in place.
struct QuantizedView {
  const uint8_t* weight = nullptr;  // [n, k * bits / 32] uint32, row-contiguous
  const void* scales = nullptr;     // [n, k / group]
  const void* biases = nullptr;     // [n, k / group]
  Scalar scale_type = Scalar::F32;
  int n = 0, k = 0, group = 0, bits = 0;
  // The same weight's full blocks of 16 rows in the VNNI matvec's own order
  // (VnniRows::data), or null: rows are then read in place.
  const uint8_t* vnni_rows = nullptr;
};

// A copy of a quantized weight for the VNNI matvec (bits 4 and 8), made once
// at load. Per full block of 16 rows: their scales [groups][16] and biases
// [groups][16] in the weight's scale dtype, then their words
// [k * bits / 32][16] (row l of the block in lane l). The loop reads it as one
// forward stream with no transposes; the rows past the last full block stay
// in the original. Immutable once made, so any thread may read it.
class VnniRows {
 public:
  VnniRows(const QuantizedView& w);
  ~VnniRows();
  VnniRows(const VnniRows&) = delete;
  VnniRows& operator=(const VnniRows&) = delete;
  const uint8_t* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  uint8_t* data_ = nullptr;  // in the weight arena (weight_arena.h)
  std::shared_ptr<void> owner_;
  size_t bytes_ = 0;
};

// Bytes per block of 16 rows in a VnniRows of `w`.
size_t vnni_block_bytes(const QuantizedView& w);

// A VnniRows of `w` where this process's matvecs run a loop that reads it
// (Path::Auto resolves to Avx512Vnni, bits 4 or 8 with a group it takes, or
// to Avx2Int8 with bits 4 or 8; at least 16 rows) and MLXCEL_REPACK is not "0";
// null otherwise.
std::shared_ptr<const VnniRows> make_vnni_rows(const QuantizedView& w);

// Bytes held by every live VnniRows.
size_t vnni_rows_bytes();

// y[m, n] = x[m, :] . dequantize(w)[n, :] for contiguous f32 rows of x,
// split across the pool (same loops and results as quantized_matmul).
void quantized_matmul_f32(const QuantizedView& w, const float* x, int m, float* y, Path path = Path::Auto);

// Several products of the same x at once (q, k, v; gate, up): the
// activations are laid out once and all rows run as one pool job. Falls back
// to one call each when the layouts differ or count > 4.
void quantized_matmul_f32_many(const QuantizedView* ws, int count, const float* x, int m, float* const* ys,
                               Path path = Path::Auto);

// y[m, n] = x[m, :] . dequantize(w)[n, :] on the GEMM's packed panels
// (quantized_gemm.h): exact f32 on the AVX-512, AVX2 and portable loops,
// AMX's split-bf16 products where `path` resolves to it. Each row's result
// does not depend on m. Throws std::invalid_argument for a layout
// gemm_supports (quantized_gemm.h) refuses.
void quantized_gemm_f32(const QuantizedView& w, const float* x, int m, float* y, Path path = Path::Auto);

// Several quantized_gemm_f32 of the same x (same K) as one pool job (q, k,
// v; gate, up): one wait for the pool instead of one per weight. The same
// results as one call each.
void quantized_gemm_f32_many(const QuantizedView* ws, int count, const float* x, int m, float* const* ys,
                             Path path = Path::Auto);

// sum a[i] * b[i] in eight interleaved partial sums, added pairwise at the
// end: the portable loops' dot product, in a form compilers vectorize
// without -ffast-math (NEON, SSE2).
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int w = 4; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// A sliding window (DecoderLayerSpec::kv_window, kv_keep): a query at
// position T - 1 sees [0, min(keep, T)) and [first_recent(T), T). Without a
// window (window 0) it sees [0, T): first_recent is 0.
struct KvWindowRule {
  int window = 0, keep = 0;
  int first_recent(int T) const {
    if (window <= 0) return 0;
    const int kept = keep < T ? keep : T;
    return T - window > kept ? T - window : kept;
  }
  // Whether block i (`block` positions) holds no position that a query at
  // T - 1 or later sees: a table may hold -1 for it.
  bool hides_block(int64_t i, int block, int T) const {
    return window > 0 && i * block >= keep && (i + 1) * block <= first_recent(T);
  }
};

// RoPE's inverse frequency i as MLX's fast::rope computes it: 1 / freqs[i]
// with explicit frequencies, else exp(-i * log_base_per_dim), where
// log_base_per_dim = log(base) / (dims / 2). The fused block and the
// op-by-op graph's rope (norm_rope.cc) share it.
inline float rope_inverse_frequency(int i, float log_base_per_dim, const float* freqs) {
  return freqs ? 1.0f / freqs[i] : std::exp(-(float)i * log_base_per_dim);
}

// Runs fn(ctx, t) for t in [0, tasks) on the pool, the caller included.
void parallel_for(int tasks, void (*fn)(void* ctx, int task), void* ctx);

// Memory that the next parallel_for will read.
struct PrefetchRegion {
  const void* data = nullptr;
  size_t bytes = 0;
};

// Regions one hint holds; prefetch_for_workers ignores any past these.
constexpr int kPrefetchRegions = 4;

// Tells the pool's idle workers what the next job reads (kPrefetchRegions at most):
// while the caller runs serial work, each worker pulls its likely share of
// every region (the caller takes the first of T equal parts, worker i part
// i + 2) into its L2, and stops when a job arrives. A hint only: results
// never depend on it.
void prefetch_for_workers(const PrefetchRegion* regions, int count);

}  // namespace mlxcel::kernels::detail
