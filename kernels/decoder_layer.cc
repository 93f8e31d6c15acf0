// See decoder_layer.h.

#include "decoder_layer.h"

#include "cpu_features.h"

#ifdef MLXCEL_X86
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>

#include "detail.h"
#include "kv_q8.h"
#include "quantized_gemm.h"
#include "simd_math.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

using detail::QuantizedView;
using detail::Scalar;

// Where each named input sits in the primitive's input list (-1: absent).
// `pack` below is the one place that lays the names out as that list.
struct ProjectionSlots {
  int weight = -1, scales = -1, biases = -1, bias = -1;
  bool operator==(const ProjectionSlots&) const = default;
};

struct Slots {
  int x = -1, input_norm = -1, post_norm = -1, keys = -1, values = -1;
  int q_norm = -1, k_norm = -1, freqs = -1, attn_out_norm = -1, mlp_out_norm = -1;
  ProjectionSlots q, k, v, o, gate, up, down, router;
  bool operator==(const Slots&) const = default;
};

struct Pointers;

}  // namespace

struct PreparedDecoderLayer {
  DecoderLayerSpec spec;  // the dimensions the weights were checked against
  std::vector<mx::array> arrays;  // the weights as `pack` lays them out, evaluated
  Slots slots;  // where each weight sits in `arrays`
  // By slot of `arrays`: the dense projections' copies for the VNNI matvec
  // (detail::make_vnni_rows), null where there is none.
  std::vector<std::shared_ptr<const detail::VnniRows>> vnni_rows;
  // The weights' pointers as every node binds them (bind_weights), made once.
  std::shared_ptr<const Pointers> bound;
};

namespace {

// The primitive's inputs; the projections as dense rows. Without
// `activations`, only the weights (for a PreparedDecoderLayer).
std::vector<mx::array> pack(const DecoderLayerInputs& in, mx::Stream stream, Slots& slots, bool activations = true) {
  std::vector<mx::array> list;
  auto put = [&](const mx::array& a, int& slot) {
    slot = (int)list.size();
    list.push_back(a);
  };
  auto put_optional = [&](const std::optional<mx::array>& a, int& slot) {
    if (a) put(*a, slot);
  };
  auto put_projection = [&](const QuantizedProjection& p, ProjectionSlots& at) {
    put(detail::row_contiguous(p.weight, stream), at.weight);
    put(detail::row_contiguous(p.scales, stream), at.scales);
    put(detail::row_contiguous(p.biases, stream), at.biases);
    put_optional(p.bias, at.bias);
  };
  if (activations) put(in.x, slots.x);
  put(in.input_norm, slots.input_norm);
  put_projection(in.q_proj, slots.q);
  put_projection(in.k_proj, slots.k);
  put_projection(in.v_proj, slots.v);
  put_projection(in.o_proj, slots.o);
  put(in.post_attention_norm, slots.post_norm);
  put_projection(in.gate_proj, slots.gate);
  put_projection(in.up_proj, slots.up);
  put_projection(in.down_proj, slots.down);
  if (activations) {
    put(in.keys, slots.keys);
    put(in.values, slots.values);
  }
  put_optional(in.q_norm, slots.q_norm);
  put_optional(in.k_norm, slots.k_norm);
  put_optional(in.rope_freqs, slots.freqs);
  put_optional(in.attn_out_norm, slots.attn_out_norm);
  put_optional(in.mlp_out_norm, slots.mlp_out_norm);
  if (in.router) put_projection(*in.router, slots.router);
  return list;
}

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("[mlxcel::kernels::decoder_layer] " + message);
}

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
  os << ")";
  return os.str();
}

void check_vector(const mx::array& a, int size, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != size || !detail::is_float(a.dtype())) {
    fail(std::string(name) + " must be a float vector of " + std::to_string(size) + ", got shape " + shape_str(a));
  }
}

// Bits and group size of a quantized [n, k] projection, from its shapes.
struct QuantLayout {
  int bits = 0, group = 0;
};

QuantLayout check_projection(const QuantizedProjection& p, int n, int k, const std::string& name) {
  const mx::array &w = p.weight, &s = p.scales, &b = p.biases;
  auto where = [&] { return name + ": "; };
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(0) != n) {
    fail(where() + "weight must be uint32 [" + std::to_string(n) + ", k*bits/32], got shape " + shape_str(w));
  }
  if (s.ndim() != 2 || s.shape(0) != n || b.shape() != s.shape() || !detail::is_float(s.dtype()) || s.dtype() != b.dtype()) {
    fail(where() + "scales and biases must be float [" + std::to_string(n) + ", groups] of one dtype, got " +
         shape_str(s) + " and " + shape_str(b));
  }
  int cols = w.shape(1), groups = s.shape(1);
  if (groups <= 0 || k % groups != 0 || ((int64_t)cols * 32) % k != 0) {
    fail(where() + "shapes " + shape_str(w) + " and " + shape_str(s) + " do not fit " + std::to_string(k) +
         " input features");
  }
  QuantLayout q{(int)((int64_t)cols * 32 / k), k / groups};
  if (!supports(q.group, q.bits)) {
    fail(where() + std::to_string(q.bits) + "-bit weights in groups of " + std::to_string(q.group) +
         " are not supported");
  }
  if (p.bias) check_vector(*p.bias, n, (name + " bias").c_str());
  return q;
}

// ---------------------------------------------------------------------------
// Small vector helpers for attention and the MLP: AVX-512 or AVX2 + FMA
// when the kernels' path allows (MLXCEL_KERNELS), else portable.

inline void axpy_portable(float alpha, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// g = silu(g) * u with MLX's sigmoid 1 / (1 + e^-g).
void swiglu_row_portable(float* g, const float* u, int n) {
  for (int i = 0; i < n; ++i) {
    const float a = g[i];
    g[i] = a * (1.0f / (1.0f + std::exp(-a))) * u[i];
  }
}

#ifdef MLXCEL_X86
__attribute__((target("avx512f,avx512dq"))) float dot_avx512(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f"))) void axpy_avx512(float alpha, const float* x, float* y, int n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

// The portable loops (detail::dot, axpy_portable) compiled for AVX2: GCC
// inlines and vectorizes them 8 floats wide, with the same summation order.
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int n) {
  return detail::dot(a, b, n);
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float alpha, const float* x, float* y, int n) {
  axpy_portable(alpha, x, y, n);
}

// 8-wide loops for AVX2 (and the AVX-512 paths): vec8.inc's exp8, the same
// polynomial as simd::exp512, and swiglu_row.
namespace avx2v {
#define MLXCEL_VEC8_AVX2
#include "vec8.inc"

// g = silu(g) * u over n floats with vec8.inc's swiglu8 (the GEMM's gated
// store). The last n % 8 go through a zero-padded vector, so every element
// takes the same arithmetic wherever it sits.
MLXCEL_TGT void swiglu_row(float* g, const float* u, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) store8(g + i, swiglu8(load8(g + i), load8(u + i)));
  if (i < n) {
    alignas(32) float ga[8] = {}, ua[8] = {};
    std::memcpy(ga, g + i, (size_t)(n - i) * sizeof(float));
    std::memcpy(ua, u + i, (size_t)(n - i) * sizeof(float));
    store8(ga, swiglu8(load8(ga), load8(ua)));
    std::memcpy(g + i, ga, (size_t)(n - i) * sizeof(float));
  }
}
#undef MLXCEL_VEC8_AVX2
}  // namespace avx2v

#endif  // MLXCEL_X86

struct VectorOps {
  float (*dot)(const float*, const float*, int);
  void (*axpy)(float, const float*, float*, int);
  void (*swiglu)(float* g, const float* u, int n);  // one row, in place
};

VectorOps vector_ops() {
  static const VectorOps ops = [] {
#ifdef MLXCEL_X86
    const Path path = resolve_path(Path::Auto);
    if (path == Path::Avx512 || path == Path::Avx512Vnni) return VectorOps{dot_avx512, axpy_avx512, avx2v::swiglu_row};
    if (path == Path::Avx2 || path == Path::Avx2Int8) return VectorOps{dot_avx2, axpy_avx2, avx2v::swiglu_row};
#endif
    return VectorOps{detail::dot, axpy_portable, swiglu_row_portable};
  }();
  return ops;
}

// ---------------------------------------------------------------------------
// The computation, on raw pointers.

// A float vector input read through its stride.
struct VectorRef {
  const void* data = nullptr;
  Scalar type = Scalar::F32;
  int64_t stride = 1;
  float operator[](size_t i) const { return detail::load_f32(data, type, i * stride); }
  explicit operator bool() const { return data != nullptr; }
};

struct Projection {
  QuantizedView view;
  VectorRef bias;
};

// One sequence's KV cache: its inputs (for the copy when they are not
// written in place), its outputs and the position of its first new token.
// A contiguous cache is [1, kv_heads, capacity, D]; a paged one is a pool
// [kv_heads, blocks, block, D] read through the sequence's block table (a
// head's consecutive blocks are adjacent, so a row's blocks, taken lowest
// first, read like one stream).
struct CacheRef {
  int capacity = 0, offset = 0;
  int kv_heads = 0, dim = 0;
  // Positions per block: `capacity` for a contiguous cache (one block), a
  // power of two (1 << block_shift) for a paged one.
  int block = 0, block_shift = 0, blocks = 1;
  // Block ids by position / block; empty for a contiguous cache.
  std::vector<int32_t> table;
  const float* keys_in = nullptr;
  const float* values_in = nullptr;
  int64_t keys_in_strides[4] = {0, 0, 0, 0};
  int64_t values_in_strides[4] = {0, 0, 0, 0};
  bool copy_keys = false, copy_values = false;
  float* keys = nullptr;
  float* values = nullptr;
  // The sliding window (DecoderLayerSpec::kv_window, kv_keep); 0 = none.
  int window = 0, keep = 0;
  // An 8-bit paged pool (keys and values then unused): every layer's
  // blocks, this one's at `layer` (kv_q8.h).
  uint8_t* q8 = nullptr;
  detail::KvQ8Layout q8_layout;
  int layer = 0;

  // Row t of head g's keys (kind 0) or values (1) in an 8-bit pool.
  detail::KvQ8Row q8_row(int kind, int g, int t) const {
    uint8_t* section = q8 + (size_t)table[t >> block_shift] * q8_layout.block_bytes() + q8_layout.section(layer, kind, g);
    return detail::kv_q8_row(section, q8_layout, t & (block - 1));
  }

  // The positions a query at position T - 1 sees: [0, keep) and [lo, T).
  struct Seen {
    int keep, lo;
  };
  Seen seen(int T) const {
    if (window <= 0) return {0, 0};
    return {std::min(keep, T), detail::KvWindowRule{window, keep}.first_recent(T)};
  }

  // Offset in floats of position t of KV head g.
  size_t at(int g, int t) const {
    if (table.empty()) return ((size_t)g * capacity + t) * dim;
    return (((size_t)g * blocks + table[t >> block_shift]) * block + (t & (block - 1))) * dim;
  }
  // Positions from t on that are contiguous in memory (to T): through every
  // following block whose id is the next one.
  int run(int t, int T) const {
    if (table.empty()) return T - t;
    int i = t >> block_shift, end = (i + 1) << block_shift;
    while (end < T && table[i + 1] == table[i] + 1) {
      ++i;
      end += block;
    }
    return std::min(end, T) - t;
  }
};

struct Pointers {
  DecoderLayerSpec spec;
  // B sequences of L new tokens each: row b * L + l of x is token l of
  // sequence b, over caches[b].
  int B = 1, L = 0;
  const float* x = nullptr;
  int64_t x_strides[3] = {0, 0, 0};
  VectorRef input_norm, post_norm, q_norm, k_norm, freqs, attn_out_norm, mlp_out_norm;
  Projection q, k, v, o, gate, up, down, router;
  std::vector<CacheRef> caches;
  // A paged layer's pool, when it is copied rather than written in place
  // (the first cache holds the input pointers).
  std::optional<CacheRef> pool_copy;
  int pool_shape[4] = {0, 0, 0, 0};
  float* out = nullptr;
};

// Copies positions [0, upto) of a [1, H, capacity, D] cache into a dense one.
void copy_cache_prefix(const float* src, const int64_t* st, float* dst, int heads, int capacity, int dim, int upto) {
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < upto; ++t) {
      const float* s = src + h * st[1] + t * st[2];
      float* d = dst + ((size_t)h * capacity + t) * dim;
      if (st[3] == 1) {
        std::memcpy(d, s, dim * sizeof(float));
      } else {
        for (int i = 0; i < dim; ++i) d[i] = s[i * st[3]];
      }
    }
  }
}

// Copies a whole [kv_heads, blocks, block, D] pool into a dense one.
void copy_pool(const float* src, const int64_t* st, float* dst, const int (&shape)[4]) {
  for (int b = 0; b < shape[0]; ++b)
    for (int h = 0; h < shape[1]; ++h)
      for (int t = 0; t < shape[2]; ++t)
        for (int i = 0; i < shape[3]; ++i) *dst++ = src[b * st[0] + h * st[1] + t * st[2] + i * st[3]];
}

// MLX's fast::rms_norm fallback: x * rsqrt(mean(x^2) + eps), then * w.
void rms_norm(const float* x, const VectorRef& w, float eps, int n, float* y) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / (float)n + eps);
  for (int i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

// rms_norm over rows r0 .. r1 of n (x and y in rows of n), the weight
// converted to f32 once and the sum of squares vectorized.
void rms_norm_rows(const float* x, const VectorRef& w, float eps, int n, float* y, int r0, int r1) {
  thread_local std::vector<float> wf;
  wf.resize((size_t)n);
  detail::load_row_f32(w.data, w.type, 0, w.stride, n, wf.data());
  const VectorOps ops = vector_ops();
  for (int r = r0; r < r1; ++r) {
    const float* xr = x + (size_t)r * n;
    float* yr = y + (size_t)r * n;
    const float scale = 1.0f / std::sqrt(ops.dot(xr, xr, n) / (float)n + eps);
    for (int i = 0; i < n; ++i) yr[i] = (xr[i] * scale) * wf[i];
  }
}

// Rows r0 .. r1 (of n) of out = residual + o, o normed first where the
// block has that norm (Gemma 3's norms after attention and the MLP), into
// `scratch`.
void add_residual_rows(const VectorRef& norm, float eps, int n, const float* o, float* scratch, const float* residual,
                       float* out, int r0, int r1) {
  const size_t i0 = (size_t)r0 * n, i1 = (size_t)r1 * n;
  if (norm) {
    rms_norm_rows(o, norm, eps, n, scratch, r0, r1);
    o = scratch;
  }
  for (size_t i = i0; i < i1; ++i) out[i] = residual[i] + o[i];
}

// Rows of a block from which its row-wise steps (norms, RoPE and the KV
// write, residual adds, the activation) run on the pool's threads: on one
// thread they were about a tenth of a 16-token prompt.
constexpr int kParallelRowsMin = 8;

// fn(r0, r1) over rows [0, rows): one range per pool thread from
// kParallelRowsMin rows on, else all on this thread. Each row's arithmetic
// is the same either way.
template <class Fn>
void for_rows(int rows, const Fn& fn) {
  const int threads = num_threads();
  if (rows < kParallelRowsMin || threads < 2) return fn(0, rows);
  struct Ctx {
    const Fn* fn;
    int rows, tasks;
  } ctx{&fn, rows, std::min(rows, threads)};
  detail::parallel_for(
      ctx.tasks,
      [](void* c, int t) {
        const Ctx& x = *static_cast<const Ctx*>(c);
        (*x.fn)(x.rows * t / x.tasks, x.rows * (t + 1) / x.tasks);
      },
      &ctx);
}

void add_bias(const Projection& p, int rows, float* y) {
  if (p.bias) {
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < p.view.n; ++i) y[(size_t)r * p.view.n + i] += p.bias[i];
  }
}

// Whether a block of `rows_per_sequence` new tokens runs its projections on
// the GEMM's packed panels (quantized_gemm.h) rather than the matvec loops.
// From 16 rows on the panels win on the AVX2 integer, exact AVX2, exact
// AVX-512 and portable loops (16-token prompts on a Xeon, AVX2 integer loop
// before it read copies: 4-bit 1.1-1.2x; exact AVX-512 1.6x); the VNNI loop stays ahead of the AMX
// panels (494 against 359 tok/s), and the NEON loop was not measured against
// them. Below 16 rows (decode, a speculative draft's verification) every
// path keeps its matvec loop, and the choice depends on a sequence's own row
// count only, never on its batch. `on_panels` makes the choice per weight.
bool projections_use_gemm(int rows_per_sequence) {
  constexpr int kGemmMinRows = 16;
  if (rows_per_sequence < kGemmMinRows) return false;
  const Path path = resolve_path(Path::Auto);
  return path != Path::Avx512Vnni && path != Path::NeonInt8;
}

// Whether a weight of a block that uses the GEMM (projections_use_gemm) runs
// on its panels. Weights with a copy on the AVX2 integer path (4- and 8-bit)
// keep the matvec's block loop over the copy: up to the fused block's 32
// rows it needs no packing, and 16- and 32-token prompts ran 1.15-1.4x
// faster on it than on the panels (Zen 5, `MLXCEL_KERNELS=avx2-int8`; for
// 8-bit weights packing the int16 panels took more time than the products).
bool on_panels(const QuantizedView& view) {
  if (!gemm_supports(view.group, view.bits)) return false;
  return !(view.vnni_rows && resolve_path(Path::Auto) == Path::Avx2Int8);
}

// Which loops a projection of `rows` rows runs: the GEMM's panels when
// `gemm`, else the matvec loops.
void project(const Projection& p, const float* x, int rows, float* y, bool gemm = false) {
  if (gemm && on_panels(p.view)) {
    detail::quantized_gemm_f32(p.view, x, rows, y);
  } else {
    detail::quantized_matmul_f32(p.view, x, rows, y);
  }
  add_bias(p, rows, y);
}

// Several projections of the same x as one pool job (q, k, v; gate, up), on
// the GEMM's panels when `gemm` and `on_panels` takes every weight, on the
// matvec loops when it takes none.
template <int N>
void project_many(const Projection* const (&ps)[N], const float* x, int rows, float* const (&ys)[N], bool gemm = false) {
  QuantizedView views[N];
  int panels = 0;
  for (int i = 0; i < N; ++i) {
    views[i] = ps[i]->view;
    panels += gemm && on_panels(views[i]);
  }
  if (panels == N) {
    detail::quantized_gemm_f32_many(views, N, x, rows, ys);
  } else if (panels > 0) {
    for (int i = 0; i < N; ++i) project(*ps[i], x, rows, ys[i], true);
    return;
  } else {
    detail::quantized_matmul_f32_many(views, N, x, rows, ys);
  }
  for (int i = 0; i < N; ++i) add_bias(*ps[i], rows, ys[i]);
}

// Rotates `heads` heads of one row in place with precomputed cos/sin.
void rope_row(float* row, int heads, int head_dim, int dims, bool traditional, const float* cs, const float* sn) {
  const int half = dims / 2;
  for (int h = 0; h < heads; ++h) {
    float* v = row + (size_t)h * head_dim;
    for (int i = 0; i < half; ++i) {
      const int a = traditional ? 2 * i : i;
      const int b = traditional ? 2 * i + 1 : i + half;
      const float x1 = v[a], x2 = v[b];
      v[a] = x1 * cs[i] - x2 * sn[i];
      v[b] = x1 * sn[i] + x2 * cs[i];
    }
  }
}

struct AttentionJob {
  const Pointers* p;
  const float* q;  // [B * L, heads * D], already scaled
  float* out;      // [B * L, heads * D]
  int heads_per_task, tasks_per_sequence;
};

#ifdef MLXCEL_X86
// One head and row of attention, head_dim = W * NV for W-float vectors: q
// and the output stay in registers across the cache positions (the generic
// loop below makes two calls per position). Scores are reduced 8 positions
// at a time (one horizontal-add tree for 8 dot products instead of one
// reduction each), and the softmax exponentials run 8 or 16 wide.

// Asks for the cache lines of n floats at p (no fault if p is past a block:
// prefetches never fault).
__attribute__((always_inline)) inline void prefetch_floats(const float* p, int n) {
  for (int i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// The 8 sums of a[0..7] (each 8 floats) in one vector, lane p = sum of a[p].
__attribute__((target("avx2,fma"), always_inline)) inline __m256 sum8x8(const __m256 (&a)[8]) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  // Lanes of h0123: (0 1 2 3 | 0 1 2 3) halves of positions 0-3; likewise 4-7.
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// Softmax weights in place: scores[t] = exp(scores[t] - m) / sum, m the max.
__attribute__((always_inline)) inline void softmax_finish(float* scores, int T, int t, float m, float sum) {
  for (; t < T; ++t) {
    scores[t] = std::exp(scores[t] - m);
    sum += scores[t];
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < T; ++i) scores[i] *= inv;
}

__attribute__((target("avx512f,avx512dq"), always_inline)) inline void softmax_avx512(float* scores, int T, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int t = 0;
  for (; t + 16 <= T; t += 16) {
    const __m512 e = simd::exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + t), mv));
    _mm512_storeu_ps(scores + t, e);
    acc = _mm512_add_ps(acc, e);
  }
  softmax_finish(scores, T, t, m, _mm512_reduce_add_ps(acc));
}

__attribute__((target("avx2,fma,f16c"), always_inline)) inline void softmax_avx2(float* scores, int T, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= T; t += 8) {
    const __m256 e = (__m256)avx2v::exp8((avx2v::vf8)_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
    _mm256_storeu_ps(scores + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  softmax_finish(scores, T, t, m, simd::hsum256(acc));
}

// q . k as 8 partial sums (the halves of the 16-lane products added).
template <int NV>
__attribute__((target("avx512f,avx512dq,avx2,fma"), always_inline)) inline __m256 qk_avx512(const __m512 (&qv)[NV],
                                                                                           const float* k) {
  __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
  for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), acc);
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
}

// q . k as 8 partial sums.
template <int NV>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 qk_avx2(const __m256 (&qv)[NV], const float* k) {
  __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
  for (int i = 1; i < NV; ++i) acc = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(k + 8 * i), acc);
  return acc;
}

// Keys are read 8 positions at a time from a multiple of 8: a paged cache's
// blocks are multiples of 8 positions, so the 8 never straddle two blocks.
// Scores are stored densely over the positions seen ([0, keep) then
// [lo, T)); without a window that is [0, T), as before.
template <int NV>
__attribute__((target("avx512f,avx512dq,avx2,fma"))) void attend_avx512(const float* q, const CacheRef& c, int g,
                                                                          int T, float* scores, float* out) {
  constexpr int D = 16 * NV;
  __m512 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const CacheRef::Seen w = c.seen(T);
  const int segments[2][2] = {{0, w.keep}, {w.lo, T}};
  __m256 mv = _mm256_set1_ps(-INFINITY);
  float m = -INFINITY;
  int n = 0;
  for (const auto& segment : segments) {
    const int end_all = segment[1];
    float* sc = scores + n - segment[0];  // sc[t]: the score of position t
    int t = segment[0];
    for (; t < end_all && (t & 7); ++t) {
      sc[t] = simd::hsum256(qk_avx512<NV>(qv, c.keys + c.at(g, t)));
      m = std::max(m, sc[t]);
    }
    // Whole groups of 8 positions, a contiguous run (one block) at a time.
    while (t + 8 <= end_all) {
      const float* keys = c.keys + c.at(g, t);
      // A paged cache's next block lies elsewhere: fetch it while this one is read.
      const int run_end = t + c.run(t, end_all), end = t + ((run_end - t) & ~7);
      const float* next = run_end >= end_all ? nullptr : c.keys + c.at(g, run_end) - (size_t)t * D;
      for (; t < end; t += 8, keys += (size_t)8 * D) {
        if (next) prefetch_floats(next + (size_t)t * D, 8 * D);
        __m256 a[8];
        for (int p = 0; p < 8; ++p) a[p] = qk_avx512<NV>(qv, keys + (size_t)p * D);
        const __m256 s8 = sum8x8(a);
        _mm256_storeu_ps(sc + t, s8);
        mv = _mm256_max_ps(mv, s8);
      }
    }
    for (; t < end_all; ++t) {
      sc[t] = simd::hsum256(qk_avx512<NV>(qv, c.keys + c.at(g, t)));
      m = std::max(m, sc[t]);
    }
    n += end_all - segment[0];
  }
  m = std::max(m, simd::hmax256(mv));
  softmax_avx512(scores, n, m);
  __m512 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm512_setzero_ps();
  n = 0;
  for (const auto& segment : segments) {
    const int end_all = segment[1];
    const float* sc = scores + n - segment[0];
    for (int t = segment[0]; t < end_all;) {
      const float* values = c.values + c.at(g, t);
      const int end = t + c.run(t, end_all);
      const float* next = end >= end_all ? nullptr : c.values + c.at(g, end) - (size_t)t * D;
      for (; t < end; ++t, values += D) {
        if (next) prefetch_floats(next + (size_t)t * D, D);
        const __m512 pt = _mm512_set1_ps(sc[t]);
        for (int i = 0; i < NV; ++i) o[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(values + 16 * i), o[i]);
      }
    }
    n += end_all - segment[0];
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, o[i]);
}

template <int NV>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const float* q, const CacheRef& c, int g, int T,
                                                     float* scores, float* out) {
  constexpr int D = 8 * NV;
  __m256 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  const CacheRef::Seen w = c.seen(T);
  const int segments[2][2] = {{0, w.keep}, {w.lo, T}};
  __m256 mv = _mm256_set1_ps(-INFINITY);
  float m = -INFINITY;
  int n = 0;
  for (const auto& segment : segments) {
    const int end_all = segment[1];
    float* sc = scores + n - segment[0];  // sc[t]: the score of position t
    int t = segment[0];
    for (; t < end_all && (t & 7); ++t) {
      sc[t] = simd::hsum256(qk_avx2<NV>(qv, c.keys + c.at(g, t)));
      m = std::max(m, sc[t]);
    }
    // Whole groups of 8 positions, a contiguous run (one block) at a time.
    while (t + 8 <= end_all) {
      const float* keys = c.keys + c.at(g, t);
      // A paged cache's next block lies elsewhere: fetch it while this one is read.
      const int run_end = t + c.run(t, end_all), end = t + ((run_end - t) & ~7);
      const float* next = run_end >= end_all ? nullptr : c.keys + c.at(g, run_end) - (size_t)t * D;
      for (; t < end; t += 8, keys += (size_t)8 * D) {
        if (next) prefetch_floats(next + (size_t)t * D, 8 * D);
        __m256 a[8];
        for (int p = 0; p < 8; ++p) a[p] = qk_avx2<NV>(qv, keys + (size_t)p * D);
        const __m256 s8 = sum8x8(a);
        _mm256_storeu_ps(sc + t, s8);
        mv = _mm256_max_ps(mv, s8);
      }
    }
    for (; t < end_all; ++t) {
      sc[t] = simd::hsum256(qk_avx2<NV>(qv, c.keys + c.at(g, t)));
      m = std::max(m, sc[t]);
    }
    n += end_all - segment[0];
  }
  m = std::max(m, simd::hmax256(mv));
  softmax_avx2(scores, n, m);
  __m256 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm256_setzero_ps();
  n = 0;
  for (const auto& segment : segments) {
    const int end_all = segment[1];
    const float* sc = scores + n - segment[0];
    for (int t = segment[0]; t < end_all;) {
      const float* values = c.values + c.at(g, t);
      const int end = t + c.run(t, end_all);
      const float* next = end >= end_all ? nullptr : c.values + c.at(g, end) - (size_t)t * D;
      for (; t < end; ++t, values += D) {
        if (next) prefetch_floats(next + (size_t)t * D, D);
        const __m256 pt = _mm256_set1_ps(sc[t]);
        for (int i = 0; i < NV; ++i) o[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(values + 8 * i), o[i]);
      }
    }
    n += end_all - segment[0];
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, o[i]);
}

#endif  // MLXCEL_X86

using AttendFn = void (*)(const float*, const CacheRef&, int, int, float*, float*);

// The register-resident loop for this head_dim, when the CPU runs it.
AttendFn attend_for(int head_dim) {
#ifdef MLXCEL_X86
  if (vector_ops().dot == dot_avx512) {
    switch (head_dim) {
      case 64: return attend_avx512<4>;
      case 128: return attend_avx512<8>;
      case 256: return attend_avx512<16>;
      default: return nullptr;
    }
  }
  if (vector_ops().dot == dot_avx2) {
    switch (head_dim) {
      case 64: return attend_avx2<8>;
      case 128: return attend_avx2<16>;
      default: return nullptr;  // 256 would not fit the 16 ymm registers
    }
  }
  return nullptr;
#else
  (void)head_dim;
  return nullptr;
#endif
}

// ---------------------------------------------------------------------------
// Attention over an 8-bit pool, as mlx-lm's quantized attention computes it:
// q . k = sum over groups of scale * (q . k_q) + bias * sum(q), and
// out = sum_t p_t * (scale * v_q + bias), the bias terms summed apart.

inline float dot_u8(const float* a, const uint8_t* b, int n) {
  float acc[8] = {};
  for (int i = 0; i < n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * (float)b[i + l];
  }
  for (int w = 4; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

constexpr int kMaxQ8Groups = 16;  // head_dim <= 1024 (check_paged)

void attend_q8_portable(const float* q, const CacheRef& c, int g, int T, float* scores, float* out) {
  const int D = c.dim, G = D / detail::kKvQ8Group;
  float qsum[kMaxQ8Groups], bsum[kMaxQ8Groups];
  for (int gi = 0; gi < G; ++gi) {
    qsum[gi] = 0.0f;
    for (int d = gi * detail::kKvQ8Group; d < (gi + 1) * detail::kKvQ8Group; ++d) qsum[gi] += q[d];
    bsum[gi] = 0.0f;
  }
  const CacheRef::Seen w = c.seen(T);
  const int seen = w.keep + (T - w.lo);
  auto position = [&](int i) { return i < w.keep ? i : w.lo + (i - w.keep); };
  float m = -INFINITY;
  for (int i = 0; i < seen; ++i) {
    const detail::KvQ8Row r = c.q8_row(0, g, position(i));
    float s = 0.0f;
    for (int gi = 0; gi < G; ++gi) {
      const int d0 = gi * detail::kKvQ8Group;
      s += r.scales[gi] * dot_u8(q + d0, r.q + d0, detail::kKvQ8Group) + r.biases[gi] * qsum[gi];
    }
    scores[i] = s;
    m = std::max(m, s);
  }
  float sum = 0.0f;
  for (int i = 0; i < seen; ++i) {
    scores[i] = std::exp(scores[i] - m);
    sum += scores[i];
  }
  const float inv = 1.0f / sum;
  std::fill(out, out + D, 0.0f);
  for (int i = 0; i < seen; ++i) {
    const float p = scores[i] * inv;
    const detail::KvQ8Row r = c.q8_row(1, g, position(i));
    for (int gi = 0; gi < G; ++gi) {
      const float ws = p * r.scales[gi];
      bsum[gi] += p * r.biases[gi];
      for (int d = gi * detail::kKvQ8Group; d < (gi + 1) * detail::kKvQ8Group; ++d) out[d] += ws * (float)r.q[d];
    }
  }
  for (int gi = 0; gi < G; ++gi) {
    for (int d = gi * detail::kKvQ8Group; d < (gi + 1) * detail::kKvQ8Group; ++d) out[d] += bsum[gi];
  }
}

#ifdef MLXCEL_X86
#define MLXCEL_Q8_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")))
#define MLXCEL_Q8_AVX2 __attribute__((target("avx2,fma,f16c")))

MLXCEL_Q8_AVX512 inline __m512 u8x16_avx512(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
MLXCEL_Q8_AVX2 inline __m256 u8x8_avx2(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Asks for a section's cache lines (a block's rows of one head lie apart
// from the next block's).
inline void prefetch_bytes(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

template <int NG>
inline float q8_bias_term(const float (&qsum)[NG], const detail::KvQ8Row& r) {
  float b = 0.0f;
  for (int gi = 0; gi < NG; ++gi) b += r.biases[gi] * qsum[gi];
  return b;
}

// The scaled q . k_q of one row as 8 partial sums.
template <int NG>
MLXCEL_Q8_AVX512 inline __m256 qk_q8_avx512(const __m512 (&qv)[4 * NG], const detail::KvQ8Row& r) {
  __m512 acc = _mm512_setzero_ps();
  for (int gi = 0; gi < NG; ++gi) {
    const uint8_t* k = r.q + gi * detail::kKvQ8Group;
    __m512 a = _mm512_mul_ps(qv[4 * gi], u8x16_avx512(k));
    for (int i = 1; i < 4; ++i) a = _mm512_fmadd_ps(qv[4 * gi + i], u8x16_avx512(k + 16 * i), a);
    acc = _mm512_fmadd_ps(a, _mm512_set1_ps(r.scales[gi]), acc);
  }
  return _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
}

template <int NG>
MLXCEL_Q8_AVX2 inline __m256 qk_q8_avx2(const __m256 (&qv)[8 * NG], const detail::KvQ8Row& r) {
  __m256 acc = _mm256_setzero_ps();
  for (int gi = 0; gi < NG; ++gi) {
    const uint8_t* k = r.q + gi * detail::kKvQ8Group;
    __m256 a = _mm256_mul_ps(qv[8 * gi], u8x8_avx2(k));
    for (int i = 1; i < 8; ++i) a = _mm256_fmadd_ps(qv[8 * gi + i], u8x8_avx2(k + 8 * i), a);
    acc = _mm256_fmadd_ps(a, _mm256_set1_ps(r.scales[gi]), acc);
  }
  return acc;
}

// The scores of the positions seen, densely ([0, keep) then [lo, T)), 8
// positions at a time from multiples of 8 (never across a block); returns
// their count and sets m to their max. One definition per instruction set.
#define MLXCEL_Q8_SCORES(NAME, TARGET, VEC, VECS_PER_GROUP, QK)                                                 \
  template <int NG>                                                                                             \
  TARGET int NAME(const CacheRef& c, int g, int T, const VEC (&qv)[VECS_PER_GROUP * NG], const float (&qsum)[NG], \
                  float* scores, float& m) {                                                                    \
    const CacheRef::Seen w = c.seen(T);                                                                         \
    const int segments[2][2] = {{0, w.keep}, {w.lo, T}};                                                        \
    m = -INFINITY;                                                                                              \
    int n = 0;                                                                                                  \
    const size_t section = c.q8_layout.section_bytes();                                                         \
    for (const auto& segment : segments) {                                                                      \
      const int end_all = segment[1];                                                                           \
      float* sc = scores + n - segment[0]; /* sc[t]: the score of position t */                                 \
      for (int t = segment[0]; t < end_all;) {                                                                  \
        const int rows = !(t & 7) && t + 8 <= end_all ? 8 : 1;                                                  \
        if (rows == 8 && !(t & (c.block - 1)) && t + c.block < end_all) {                                       \
          prefetch_bytes(c.q8_row(0, g, t + c.block).q, section);                                               \
        }                                                                                                       \
        for (int p = 0; p < rows; ++p, ++t) {                                                                   \
          const detail::KvQ8Row r = c.q8_row(0, g, t);                                                          \
          sc[t] = simd::hsum256(QK<NG>(qv, r)) + q8_bias_term<NG>(qsum, r);                                     \
          m = std::max(m, sc[t]);                                                                               \
        }                                                                                                       \
      }                                                                                                         \
      n += end_all - segment[0];                                                                                \
    }                                                                                                           \
    return n;                                                                                                   \
  }
MLXCEL_Q8_SCORES(q8_scores_avx512, MLXCEL_Q8_AVX512, __m512, 4, qk_q8_avx512)
MLXCEL_Q8_SCORES(q8_scores_avx2, MLXCEL_Q8_AVX2, __m256, 8, qk_q8_avx2)
#undef MLXCEL_Q8_SCORES

template <int NG>
MLXCEL_Q8_AVX512 void attend_q8_avx512(const float* q, const CacheRef& c, int g, int T, float* scores, float* out) {
  constexpr int NV = 4 * NG;
  __m512 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  float qsum[NG], bsum[NG];
  for (int gi = 0; gi < NG; ++gi) {
    qsum[gi] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(qv[4 * gi], qv[4 * gi + 1]), _mm512_add_ps(qv[4 * gi + 2], qv[4 * gi + 3])));
    bsum[gi] = 0.0f;
  }
  float m;
  const int n = q8_scores_avx512<NG>(c, g, T, qv, qsum, scores, m);
  softmax_avx512(scores, n, m);
  __m512 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm512_setzero_ps();
  const CacheRef::Seen w = c.seen(T);
  for (int i = 0; i < n; ++i) {
    const int t = i < w.keep ? i : w.lo + (i - w.keep);
    const float p = scores[i];
    const detail::KvQ8Row r = c.q8_row(1, g, t);
    for (int gi = 0; gi < NG; ++gi) {
      const __m512 ws = _mm512_set1_ps(p * r.scales[gi]);
      bsum[gi] += p * r.biases[gi];
      const uint8_t* v = r.q + gi * detail::kKvQ8Group;
      for (int k = 0; k < 4; ++k) o[4 * gi + k] = _mm512_fmadd_ps(ws, u8x16_avx512(v + 16 * k), o[4 * gi + k]);
    }
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_add_ps(o[i], _mm512_set1_ps(bsum[i / 4])));
}

template <int NG>
MLXCEL_Q8_AVX2 void attend_q8_avx2(const float* q, const CacheRef& c, int g, int T, float* scores, float* out) {
  constexpr int NV = 8 * NG;
  __m256 qv[NV];
  for (int i = 0; i < NV; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
  float qsum[NG], bsum[NG];
  for (int gi = 0; gi < NG; ++gi) {
    __m256 s = qv[8 * gi];
    for (int i = 1; i < 8; ++i) s = _mm256_add_ps(s, qv[8 * gi + i]);
    qsum[gi] = simd::hsum256(s);
    bsum[gi] = 0.0f;
  }
  float m;
  const int n = q8_scores_avx2<NG>(c, g, T, qv, qsum, scores, m);
  softmax_avx2(scores, n, m);
  __m256 o[NV];
  for (int i = 0; i < NV; ++i) o[i] = _mm256_setzero_ps();
  const CacheRef::Seen w = c.seen(T);
  for (int i = 0; i < n; ++i) {
    const int t = i < w.keep ? i : w.lo + (i - w.keep);
    const float p = scores[i];
    const detail::KvQ8Row r = c.q8_row(1, g, t);
    for (int gi = 0; gi < NG; ++gi) {
      const __m256 ws = _mm256_set1_ps(p * r.scales[gi]);
      bsum[gi] += p * r.biases[gi];
      const uint8_t* v = r.q + gi * detail::kKvQ8Group;
      for (int k = 0; k < 8; ++k) o[8 * gi + k] = _mm256_fmadd_ps(ws, u8x8_avx2(v + 8 * k), o[8 * gi + k]);
    }
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(o[i], _mm256_set1_ps(bsum[i / 8])));
}
#endif  // MLXCEL_X86

// The 8-bit pool's loop for this head_dim on this CPU (always one).
AttendFn attend_q8_for(int head_dim) {
#ifdef MLXCEL_X86
  if (vector_ops().dot == dot_avx512) {
    switch (head_dim) {
      case 64: return attend_q8_avx512<1>;
      case 128: return attend_q8_avx512<2>;
      case 256: return attend_q8_avx512<4>;
      default: break;
    }
  }
  if (vector_ops().dot == dot_avx2) {
    switch (head_dim) {
      case 64: return attend_q8_avx2<1>;
      case 128: return attend_q8_avx2<2>;
      default: break;
    }
  }
#endif
  (void)head_dim;
  return attend_q8_portable;
}

// Softmax(q k^T) v for the heads of one task of one sequence, every new
// row, causal.
void attention_task(void* ctx, int task) {
  const AttentionJob& job = *static_cast<const AttentionJob*>(ctx);
  const Pointers& p = *job.p;
  const DecoderLayerSpec& s = p.spec;
  const VectorOps ops = vector_ops();
  const int D = s.head_dim, group = s.heads / s.kv_heads;
  const int b = task / job.tasks_per_sequence;
  const int h0 = (task % job.tasks_per_sequence) * job.heads_per_task;
  const int h1 = std::min(s.heads, h0 + job.heads_per_task);
  const CacheRef& c = p.caches[b];
  thread_local std::vector<float> scores;
  scores.resize((size_t)c.offset + p.L);
  const AttendFn attend = c.q8 ? attend_q8_for(D) : attend_for(D);
  for (int h = h0; h < h1; ++h) {
    const int g = h / group;
    for (int l = 0; l < p.L; ++l) {
      const size_t row = (size_t)b * p.L + l;
      const float* q = job.q + (row * s.heads + h) * D;
      const int T = c.offset + l + 1;
      if (attend) {
        attend(q, c, g, T, scores.data(), job.out + (row * s.heads + h) * D);
        continue;
      }
      // The positions seen, [0, keep) then [lo, T), scored densely.
      const CacheRef::Seen w = c.seen(T);
      const int seen = w.keep + (T - w.lo);
      auto position = [&](int i) { return i < w.keep ? i : w.lo + (i - w.keep); };
      float m = -INFINITY;
      for (int i = 0; i < seen; ++i) {
        scores[i] = ops.dot(q, c.keys + c.at(g, position(i)), D);
        m = std::max(m, scores[i]);
      }
      float sum = 0.0f;
      for (int i = 0; i < seen; ++i) {
        scores[i] = std::exp(scores[i] - m);
        sum += scores[i];
      }
      const float inv = 1.0f / sum;
      float* o = job.out + (row * s.heads + h) * D;
      std::fill(o, o + D, 0.0f);
      for (int i = 0; i < seen; ++i) ops.axpy(scores[i] * inv, c.values + c.at(g, position(i)), o, D);
    }
  }
}

// RoPE's cosines and sines for one position, kept while consecutive layers
// (and rows) ask for the same position and frequencies: every block of a
// decode step rotates the same position.
struct RopeAngles {
  std::vector<float> cs, sn, freqs;  // freqs: the explicit frequencies used, if any
  float position = NAN, log_base_per_dim = NAN;

  void compute(float at, float log_base, int half, const VectorRef& explicit_inv) {
    const size_t explicit_count = explicit_inv ? (size_t)half : 0;
    bool same = at == position && log_base == log_base_per_dim && (int)cs.size() == half &&
                freqs.size() == explicit_count;
    for (size_t i = 0; same && i < explicit_count; ++i) same = freqs[i] == explicit_inv[i];
    if (same) return;
    position = at;
    log_base_per_dim = log_base;
    freqs.resize(explicit_count);
    cs.resize((size_t)half);
    sn.resize((size_t)half);
    for (int i = 0; i < half; ++i) {
      if (explicit_inv) freqs[i] = explicit_inv[i];
      const float inv_freq = detail::rope_inverse_frequency(i, log_base, explicit_inv ? freqs.data() : nullptr);
      const float theta = at * inv_freq;
      cs[i] = std::cos(theta);
      sn[i] = std::sin(theta);
    }
  }
};

struct Scratch {
  std::vector<float> x, n, q, k, v, att, o, h, g, u;
  // Mixture of experts: router logits, each (row, slot)'s weighted expert
  // output, one expert's gathered rows and their down projections.
  std::vector<float> logits, slots, rows, y;
};

// SwiGLU in place over `rows` rows of n: g = silu(g) * u.
void swiglu_rows(float* g, const float* u, int rows, int n) {
  const VectorOps ops = vector_ops();
  for (int r = 0; r < rows; ++r) ops.swiglu(g + (size_t)r * n, u + (size_t)r * n, n);
}

// Expert e's rows [e * n, (e + 1) * n) of a stacked projection.
Projection expert_rows(const Projection& stacked, int e, int n) {
  Projection p = stacked;
  const QuantizedView& v = stacked.view;
  const size_t row_bytes = (size_t)v.k * v.bits / 8;
  const size_t scale_bytes = v.scale_type == Scalar::F32 ? 4 : 2;
  const size_t groups = (size_t)(v.k / v.group);
  p.view.weight = v.weight + (size_t)e * n * row_bytes;
  p.view.scales = (const uint8_t*)v.scales + (size_t)e * n * groups * scale_bytes;
  p.view.biases = (const uint8_t*)v.biases + (size_t)e * n * groups * scale_bytes;
  p.view.n = n;
  p.view.vnni_rows = nullptr;  // the copy's blocks follow the stacked rows
  return p;
}

// The k (expert, weight) pairs of one row of router logits, as mlx-lm's
// Mixtral (softmax over the top k logits) or Qwen3-MoE (top k of the
// softmax, optionally renormalized) choose them (moe.rs's Routing::route).
void route(const float* logits, int E, int k, int routing, int* chosen, float* weights) {
  std::vector<int> order(E);
  for (int e = 0; e < E; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  auto softmax = [](const float* v, int n, float* out) {
    float m = -INFINITY, sum = 0.0f;
    for (int i = 0; i < n; ++i) m = std::max(m, v[i]);
    for (int i = 0; i < n; ++i) sum += (out[i] = std::exp(v[i] - m));
    for (int i = 0; i < n; ++i) out[i] /= sum;
  };
  for (int j = 0; j < k; ++j) chosen[j] = order[j];
  if (routing == 0) {
    std::vector<float> top(k);
    for (int j = 0; j < k; ++j) top[j] = logits[chosen[j]];
    softmax(top.data(), k, weights);
    return;
  }
  std::vector<float> probs(E);
  softmax(logits, E, probs.data());
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += probs[chosen[j]];
  for (int j = 0; j < k; ++j) weights[j] = routing == 2 ? probs[chosen[j]] / sum : probs[chosen[j]];
}

// The mixture of experts of L normed rows `n` into `out`: the router, then
// each chosen expert once over the rows that chose it (its slice of the
// stacked weights; unchosen experts are not read), each (row, slot) output
// scaled by its weight and the k slots summed in order.
void run_experts(const Pointers& p, int L, const float* n, float* out) {
  const DecoderLayerSpec& s = p.spec;
  const int H = s.hidden, I = s.intermediate, E = s.experts, k = s.top_k;
  thread_local Scratch moe;
  moe.logits.resize((size_t)L * E);
  moe.slots.resize((size_t)L * k * H);
  moe.rows.resize((size_t)L * H);
  moe.g.resize((size_t)L * I);
  moe.u.resize((size_t)L * I);
  moe.y.resize((size_t)L * H);
  project(p.router, n, L, moe.logits.data());
  std::vector<int> chosen((size_t)L * k);
  std::vector<float> weights((size_t)L * k);
  for (int l = 0; l < L; ++l) route(&moe.logits[(size_t)l * E], E, k, s.routing, &chosen[(size_t)l * k], &weights[(size_t)l * k]);
  std::vector<int> picks;  // (row * k + slot) of the current expert
  for (int e = 0; e < E; ++e) {
    picks.clear();
    for (int i = 0; i < L * k; ++i) {
      if (chosen[i] == e) picks.push_back(i);
    }
    if (picks.empty()) continue;
    const int m = (int)picks.size();
    for (int r = 0; r < m; ++r) std::memcpy(&moe.rows[(size_t)r * H], n + (size_t)(picks[r] / k) * H, H * sizeof(float));
    const Projection gate = expert_rows(p.gate, e, I), up = expert_rows(p.up, e, I), down = expert_rows(p.down, e, H);
    project_many<2>({&gate, &up}, moe.rows.data(), m, {moe.g.data(), moe.u.data()});
    swiglu_rows(moe.g.data(), moe.u.data(), m, I);
    project(down, moe.g.data(), m, moe.y.data());
    for (int r = 0; r < m; ++r) {
      const float w = weights[picks[r]];
      float* slot = &moe.slots[(size_t)picks[r] * H];
      for (int i = 0; i < H; ++i) slot[i] = moe.y[(size_t)r * H + i] * w;
    }
  }
  for (int l = 0; l < L; ++l) {
    float* o = out + (size_t)l * H;
    std::memcpy(o, &moe.slots[(size_t)l * k * H], H * sizeof(float));
    for (int j = 1; j < k; ++j) {
      const float* slot = &moe.slots[((size_t)l * k + j) * H];
      for (int i = 0; i < H; ++i) o[i] += slot[i];
    }
  }
}

// Rows up to which a layer hints its next weights to the pool's workers:
// decode steps, whose products stream the weights from memory.
constexpr int kPrefetchMaxRows = 4;

// Hands the pool's idle workers the weights of the next projections of a
// step of `rows` rows (decode: at most kPrefetchMaxRows), to pull into their
// caches while this thread runs the serial steps before them (norms, RoPE,
// the KV write, attention's uneven split, residual adds).
void prefetch_next(int rows, std::initializer_list<const Projection*> next) {
  if (rows > kPrefetchMaxRows) return;
  detail::PrefetchRegion regions[detail::kPrefetchRegions];
  int count = 0;
  for (const Projection* pr : next) {
    const QuantizedView& v = pr->view;
    if (count == detail::kPrefetchRegions || !v.weight) continue;
    if (v.vnni_rows) {
      regions[count++] = {v.vnni_rows, (size_t)(v.n / 16) * detail::vnni_block_bytes(v)};
    } else {
      regions[count++] = {v.weight, (size_t)v.n * v.k * v.bits / 8};
    }
  }
  detail::prefetch_for_workers(regions, count);
}

void run_layer(const Pointers& p) {
  const DecoderLayerSpec& s = p.spec;
  // Every step below but attention treats the B * L rows alike, row by row.
  const int L = p.B * p.L, H = s.hidden, D = s.head_dim, I = s.intermediate;
  const int qn = s.heads * D, kvn = s.kv_heads * D;
  // This thread's scratch, named by a reference so that the row tasks on
  // other threads (for_rows) use it too.
  thread_local Scratch scratch;
  Scratch& sc = scratch;
  sc.x.resize((size_t)L * H);
  sc.n.resize((size_t)L * std::max(H, qn));
  sc.q.resize((size_t)L * qn);
  sc.k.resize((size_t)L * kvn);
  sc.v.resize((size_t)L * kvn);
  sc.att.resize((size_t)L * qn);
  sc.o.resize((size_t)L * H);
  sc.h.resize((size_t)L * H);
  sc.g.resize((size_t)L * I);
  sc.u.resize((size_t)L * I);

  if (p.pool_copy) {  // never for an 8-bit pool (written in place only)
    copy_pool(p.pool_copy->keys_in, p.pool_copy->keys_in_strides, p.pool_copy->keys, p.pool_shape);
    copy_pool(p.pool_copy->values_in, p.pool_copy->values_in_strides, p.pool_copy->values, p.pool_shape);
  } else {
    for (const CacheRef& c : p.caches) {
      if (c.copy_keys) copy_cache_prefix(c.keys_in, c.keys_in_strides, c.keys, s.kv_heads, c.capacity, D, c.offset);
      if (c.copy_values) {
        copy_cache_prefix(c.values_in, c.values_in_strides, c.values, s.kv_heads, c.capacity, D, c.offset);
      }
    }
  }

  // Attention.
  prefetch_next(L, {&p.q, &p.k, &p.v});
  for_rows(L, [&](int r0, int r1) {
    for (int r = r0; r < r1; ++r) {
      const float* xr = p.x + (r / p.L) * p.x_strides[0] + (r % p.L) * p.x_strides[1];
      float* dst = &sc.x[(size_t)r * H];
      for (int i = 0; i < H; ++i) dst[i] = xr[i * p.x_strides[2]];
    }
    rms_norm_rows(sc.x.data(), p.input_norm, s.norm_eps, H, sc.n.data(), r0, r1);
  });
  const bool gemm = projections_use_gemm(p.L);
  project_many<3>({&p.q, &p.k, &p.v}, sc.n.data(), L, {sc.q.data(), sc.k.data(), sc.v.data()}, gemm);
  prefetch_next(L, {&p.o});
  // Per row: q and k norms, RoPE as MLX's fast::rope computes it (positions
  // (offset + l) * scale, inverse frequencies exp(-i * log(base) / half) or
  // 1 / freqs[i]), the new keys and values into the sequence's cache, and q
  // scaled before the product as MLX's attention does.
  const int half = s.rope_dims / 2;
  const float log_base_per_dim = std::log(s.rope_base) / (float)half;
  for_rows(L, [&](int r0, int r1) {
    thread_local RopeAngles rope;
    thread_local std::vector<float> tmp;
    for (int l = r0; l < r1; ++l) {
      float* q = &sc.q[(size_t)l * qn];
      float* k = &sc.k[(size_t)l * kvn];
      const float* v = &sc.v[(size_t)l * kvn];
      if (p.q_norm) {
        tmp.resize((size_t)D);
        for (int h = 0; h < s.heads; ++h) {
          rms_norm(q + (size_t)h * D, p.q_norm, s.norm_eps, D, tmp.data());
          std::copy(tmp.begin(), tmp.end(), q + (size_t)h * D);
        }
        for (int h = 0; h < s.kv_heads; ++h) {
          rms_norm(k + (size_t)h * D, p.k_norm, s.norm_eps, D, tmp.data());
          std::copy(tmp.begin(), tmp.end(), k + (size_t)h * D);
        }
      }
      const CacheRef& c = p.caches[l / p.L];
      const int t = c.offset + l % p.L;
      rope.compute((float)t * s.rope_scale, log_base_per_dim, half, p.freqs);
      if (s.rope_mscale != 1.0f) {
        for (int h = 0; h < s.heads; ++h) {
          for (int i = 0; i < s.rope_dims; ++i) q[(size_t)h * D + i] *= s.rope_mscale;
        }
        for (int h = 0; h < s.kv_heads; ++h) {
          for (int i = 0; i < s.rope_dims; ++i) k[(size_t)h * D + i] *= s.rope_mscale;
        }
      }
      rope_row(q, s.heads, D, s.rope_dims, s.rope_traditional, rope.cs.data(), rope.sn.data());
      rope_row(k, s.kv_heads, D, s.rope_dims, s.rope_traditional, rope.cs.data(), rope.sn.data());
      for (int g = 0; g < s.kv_heads; ++g) {
        const float *kg = k + (size_t)g * D, *vg = v + (size_t)g * D;
        if (c.q8) {
          detail::kv_q8_quantize(kg, D, c.q8_row(0, g, t));
          detail::kv_q8_quantize(vg, D, c.q8_row(1, g, t));
        } else {
          const size_t at = c.at(g, t);
          std::memcpy(c.keys + at, kg, D * sizeof(float));
          std::memcpy(c.values + at, vg, D * sizeof(float));
        }
      }
      for (int i = 0; i < qn; ++i) q[i] *= s.attn_scale;
    }
  });
  // When there is enough work, one task per sequence and KV head (its query
  // heads read its keys and values once from memory), or per query head
  // where that is too few tasks; else one task per sequence. Each row's
  // arithmetic is the same either way.
  double work = 0.0;
  for (const CacheRef& c : p.caches) work += (double)s.heads * p.L * (c.offset + p.L) * D;
  AttentionJob job{&p, sc.q.data(), sc.att.data(), s.heads, 1};
  if (work < 16.0 * 1024) {
    for (int b = 0; b < p.B; ++b) attention_task(&job, b);
  } else {
    const bool by_kv_head = p.B * s.kv_heads >= 2;
    job.heads_per_task = by_kv_head ? s.heads / s.kv_heads : 1;
    job.tasks_per_sequence = by_kv_head ? s.kv_heads : s.heads;
    detail::parallel_for(p.B * job.tasks_per_sequence, attention_task, &job);
  }
  project(p.o, sc.att.data(), L, sc.o.data(), gemm);
  if (s.experts == 0) prefetch_next(L, {&p.gate, &p.up});
  for_rows(L, [&](int r0, int r1) {
    add_residual_rows(p.attn_out_norm, s.norm_eps, H, sc.o.data(), sc.n.data(), sc.x.data(), sc.h.data(), r0, r1);
    // The MLP's input.
    rms_norm_rows(sc.h.data(), p.post_norm, s.norm_eps, H, sc.n.data(), r0, r1);
  });

  // MLP.
  if (s.experts > 0) {
    run_experts(p, L, sc.n.data(), sc.o.data());
    for (size_t i = 0; i < (size_t)L * H; ++i) p.out[i] = sc.h[i] + sc.o[i];
    return;
  }
  project_many<2>({&p.gate, &p.up}, sc.n.data(), L, {sc.g.data(), sc.u.data()}, gemm);
  prefetch_next(L, {&p.down});
  for_rows(L, [&](int r0, int r1) {
    if (s.activation == 1) {
      // MLX's gelu_approx: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))).
      const float c = std::sqrt(2.0f / 3.14159265358979323846f);
      for (size_t i = (size_t)r0 * I; i < (size_t)r1 * I; ++i) {
        const float a = sc.g[i];
        sc.g[i] = 0.5f * a * (1.0f + std::tanh(c * (a + 0.044715f * (a * a * a)))) * sc.u[i];
      }
    } else {
      swiglu_rows(sc.g.data() + (size_t)r0 * I, sc.u.data() + (size_t)r0 * I, r1 - r0, I);
    }
  });
  project(p.down, sc.g.data(), L, sc.o.data(), gemm);
  for_rows(L, [&](int r0, int r1) {
    add_residual_rows(p.mlp_out_norm, s.norm_eps, H, sc.o.data(), sc.n.data(), sc.h.data(), p.out, r0, r1);
  });
}

// Points p's weight fields at `arrays` (laid out by `pack`, evaluated).
void bind_weights(Pointers& p, const std::vector<mx::array>& arrays, const Slots& at, const DecoderLayerSpec& spec,
                  const PreparedDecoderLayer* prepared = nullptr) {
  auto vec = [&](int slot) {
    VectorRef r;
    if (slot < 0) return r;
    const mx::array& a = arrays[slot];
    r.data = a.data<void>();
    r.type = detail::scalar_of(a.dtype(), "a norm weight or bias");
    r.stride = a.strides()[0];
    return r;
  };
  p.input_norm = vec(at.input_norm);
  p.post_norm = vec(at.post_norm);
  p.q_norm = vec(at.q_norm);
  p.k_norm = vec(at.k_norm);
  p.freqs = vec(at.freqs);
  p.attn_out_norm = vec(at.attn_out_norm);
  p.mlp_out_norm = vec(at.mlp_out_norm);
  const int H = spec.hidden, D = spec.head_dim;
  auto proj = [&](const ProjectionSlots& ps, int n, int k) {
    Projection pr;
    const mx::array &w = arrays[ps.weight], &sc = arrays[ps.scales];
    pr.view.weight = w.data<uint8_t>();
    pr.view.scales = sc.data<void>();
    pr.view.biases = arrays[ps.biases].data<void>();
    pr.view.scale_type = detail::scalar_of(sc.dtype(), "scales");
    pr.view.n = n;
    pr.view.k = k;
    pr.view.group = k / sc.shape(1);
    pr.view.bits = (int)((int64_t)w.shape(1) * 32 / k);
    if (prepared && !prepared->vnni_rows.empty() && prepared->vnni_rows[ps.weight]) {
      pr.view.vnni_rows = prepared->vnni_rows[ps.weight]->data();
    }
    pr.bias = vec(ps.bias);
    return pr;
  };
  p.q = proj(at.q, spec.heads * D, H);
  p.k = proj(at.k, spec.kv_heads * D, H);
  p.v = proj(at.v, spec.kv_heads * D, H);
  p.o = proj(at.o, H, spec.heads * D);
  const int E = std::max(spec.experts, 1);
  p.gate = proj(at.gate, E * spec.intermediate, H);
  p.up = proj(at.up, E * spec.intermediate, H);
  p.down = proj(at.down, E * H, spec.intermediate);
  if (spec.experts > 0) p.router = proj(at.router, spec.experts, H);
}

// One block's pointers for a node: the caches (inputs at `at`, outputs from
// out_keys and out_values on, one per buffer) and the weights; x and out
// are the caller's. Allocates or shares the cache outputs.
Pointers bind_node(const DecoderLayerSpec& spec, const Slots& at, const std::vector<int>& offsets,
                   const std::vector<std::vector<int32_t>>& tables, const PreparedDecoderLayer* prepared,
                   const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, int out_keys, int out_values) {
  const int B = (int)offsets.size();
  const bool paged = !tables.empty();
  Pointers p = prepared ? *prepared->bound : Pointers{};
  p.spec = spec;
  p.B = B;
  p.L = inputs[at.x].shape(1);
  p.caches.resize(B);
  // The caches: write the input buffer in place when the caller owns it
  // (spec.cache_in_place), else copy it. (MLX's donation check cannot help
  // here: each output holds its own copy of the inputs.) A paged layer has
  // one pool for every sequence.
  const bool q8 = paged && inputs[at.keys].dtype() == mx::uint8;
  const int buffers = paged ? 1 : B;
  if (q8) {
    // One 8-bit pool for keys and values, always written in place (check_paged).
    outputs[out_keys].copy_shared_buffer(inputs[at.keys]);
    outputs[out_values].copy_shared_buffer(inputs[at.values]);
    const mx::array& pool = inputs[at.keys];
    detail::KvQ8Layout layout{pool.shape(1), pool.shape(3), 0, spec.head_dim};
    layout.block = (int)(pool.shape(4) / layout.row_bytes());
    for (int b = 0; b < B; ++b) {
      CacheRef& cache = p.caches[b];
      cache.q8 = outputs[out_keys].data<uint8_t>();
      cache.q8_layout = layout;
      cache.layer = spec.kv_layer;
      cache.block = layout.block;
      cache.block_shift = __builtin_ctz((unsigned)cache.block);
      cache.blocks = pool.shape(0);
      cache.table = tables[b];
      cache.capacity = (int)cache.table.size() * cache.block;
    }
  }
  for (int b = 0; b < (q8 ? 0 : buffers); ++b) {
    CacheRef& cache = p.caches[b];
    for (int c = 0; c < 2; ++c) {
      const mx::array& in = inputs[(c == 0 ? at.keys : at.values) + b];
      mx::array& o = outputs[(c == 0 ? out_keys : out_values) + b];
      const bool dense = in.flags().row_contiguous && in.data_size() == in.size();
      const bool reuse = dense && spec.cache_in_place;
      if (reuse) {
        o.copy_shared_buffer(in);
      } else {
        o.set_data(mx::allocator::malloc(o.nbytes()));
      }
      (c == 0 ? cache.copy_keys : cache.copy_values) = !reuse;
      int64_t* st = c == 0 ? cache.keys_in_strides : cache.values_in_strides;
      for (int d = 0; d < 4; ++d) st[d] = in.strides()[d];
      (c == 0 ? cache.keys_in : cache.values_in) = in.data<float>();
      (c == 0 ? cache.keys : cache.values) = o.data<float>();
    }
  }
  if (paged && !q8) {
    const mx::array& pool = inputs[at.keys];
    for (int d = 0; d < 4; ++d) p.pool_shape[d] = pool.shape(d);
    if (p.caches[0].copy_keys || p.caches[0].copy_values) p.pool_copy = p.caches[0];
    for (int b = 0; b < B; ++b) {
      CacheRef& cache = p.caches[b];
      cache = p.caches[0];
      cache.copy_keys = cache.copy_values = false;
      cache.block = pool.shape(2);
      cache.block_shift = __builtin_ctz((unsigned)cache.block);
      cache.blocks = pool.shape(1);
      cache.table = tables[b];
      cache.capacity = (int)cache.table.size() * cache.block;
    }
  } else if (!paged) {
    for (int b = 0; b < B; ++b) p.caches[b].capacity = p.caches[b].block = inputs[at.keys + b].shape(2);
  }
  for (int b = 0; b < B; ++b) {
    p.caches[b].offset = offsets[b];
    p.caches[b].window = spec.kv_window;
    p.caches[b].keep = spec.kv_keep;
    p.caches[b].kv_heads = spec.kv_heads;
    p.caches[b].dim = spec.head_dim;
  }
  if (!prepared) bind_weights(p, inputs, at, spec);
  return p;
}

// ---------------------------------------------------------------------------
// The MLX primitive.

// Inputs: x, the weights (unless prepared), keys[0..B) from slots.keys on and
// values[0..B) from slots.values on. Outputs: out, keys[0..B), values[0..B).
class DecoderLayer : public mx::Primitive {
 public:
  DecoderLayer(mx::Stream stream, DecoderLayerSpec spec, Slots slots, std::vector<int> offsets,
               std::shared_ptr<const PreparedDecoderLayer> prepared = nullptr,
               std::vector<std::vector<int32_t>> tables = {})
      : mx::Primitive(stream),
        spec_(spec),
        slots_(slots),
        offsets_(std::move(offsets)),
        tables_(std::move(tables)),
        prepared_(std::move(prepared)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const int buffers = tables_.empty() ? (int)offsets_.size() : 1;
    Pointers p = bind_node(spec_, slots_, offsets_, tables_, prepared_.get(), inputs, outputs, 1, 1 + buffers);
    const mx::array& x = inputs[slots_.x];
    p.x = x.data<float>();
    for (int d = 0; d < 3; ++d) p.x_strides[d] = x.strides()[d];
    p.out = out.data<float>();
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    for (auto& a : outputs) enc.set_output_array(a);
    // MLX's cpu::eval keeps the inputs' buffers alive until this task has
    // run; the task holds the prepared weights.
    enc.dispatch([p, keep = prepared_]() { run_layer(p); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxcel::kernels::DecoderLayer] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelDecoderLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const DecoderLayer*>(&other);
    if (!o) return false;
    const DecoderLayerSpec &a = spec_, &b = o->spec_;
    return a.hidden == b.hidden && a.heads == b.heads && a.kv_heads == b.kv_heads && a.head_dim == b.head_dim &&
           a.intermediate == b.intermediate && a.offset == b.offset && a.norm_eps == b.norm_eps &&
           a.rope_dims == b.rope_dims && a.rope_base == b.rope_base && a.rope_scale == b.rope_scale &&
           a.rope_traditional == b.rope_traditional && a.attn_scale == b.attn_scale &&
           a.cache_in_place == b.cache_in_place && a.kv_window == b.kv_window && a.kv_keep == b.kv_keep && a.kv_layer == b.kv_layer &&
           a.experts == b.experts && a.top_k == b.top_k && a.routing == b.routing &&
           slots_ == o->slots_ && offsets_ == o->offsets_ && tables_ == o->tables_ && prepared_ == o->prepared_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes{inputs[slots_.x].shape()};
    const size_t buffers = tables_.empty() ? offsets_.size() : 1;
    for (int c = 0; c < 2; ++c) {
      for (size_t b = 0; b < buffers; ++b) shapes.push_back(inputs[(c == 0 ? slots_.keys : slots_.values) + b].shape());
    }
    return shapes;
  }

 private:
  DecoderLayerSpec spec_;
  Slots slots_;
  // Per sequence: the position of its first new token (spec_.offset is unused).
  std::vector<int> offsets_;
  // Per sequence, for a paged layer: its block table into the one pool.
  std::vector<std::vector<int32_t>> tables_;
  // The weights, when they are not graph inputs (the inputs are then x,
  // keys and values only).
  std::shared_ptr<const PreparedDecoderLayer> prepared_;
};

// Consecutive paged blocks as one node: layer i's output is layer i + 1's
// input inside the node, so a decode step costs MLX one node for the whole
// stack instead of one per layer (on the evaluating thread: graph building,
// traversal, a task per node, and the throttle that makes the caller wait
// for tasks to finish once about ten are queued). Each layer runs exactly
// as its own DecoderLayer node would.
// Inputs: x, keys[0..n), values[0..n). Outputs: out, keys[0..n), values[0..n).
class DecoderStack : public mx::Primitive {
 public:
  DecoderStack(mx::Stream stream, std::vector<std::shared_ptr<const PreparedDecoderLayer>> layers,
               std::vector<DecoderLayerSpec> specs, std::vector<int> offsets, std::vector<std::vector<int32_t>> tables)
      : mx::Primitive(stream),
        layers_(std::move(layers)),
        specs_(std::move(specs)),
        offsets_(std::move(offsets)),
        tables_(std::move(tables)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int n = (int)layers_.size();
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    Slots at;
    at.x = 0;
    at.keys = 1;
    at.values = 2;
    const mx::array& x = inputs[0];
    std::vector<Pointers> blocks;
    blocks.reserve(n);
    for (int i = 0; i < n; ++i) {
      const std::vector<mx::array> layer_inputs{x, inputs[1 + i], inputs[1 + n + i]};
      std::vector<mx::array> layer_outputs{out, outputs[1 + i], outputs[1 + n + i]};
      Pointers& p = blocks.emplace_back(
          bind_node(specs_[i], at, offsets_, tables_, layers_[i].get(), layer_inputs, layer_outputs, 1, 2));
      // Layer 0 reads x through its strides; every later one reads the
      // output before it, dense, from `out` (run_layer copies its x before
      // writing its output).
      if (i == 0) {
        p.x = x.data<float>();
        for (int d = 0; d < 3; ++d) p.x_strides[d] = x.strides()[d];
      } else {
        p.x = out.data<float>();
        p.x_strides[0] = (int64_t)x.shape(1) * x.shape(2);
        p.x_strides[1] = x.shape(2);
        p.x_strides[2] = 1;
      }
      p.out = out.data<float>();
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    for (auto& a : outputs) enc.set_output_array(a);
    enc.dispatch([blocks = std::move(blocks), keep = layers_]() {
      for (const Pointers& p : blocks) run_layer(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxcel::kernels::DecoderStack] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelDecoderStack"; }

  bool is_equivalent(const mx::Primitive& other) const override { return this == &other; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes{inputs[0].shape()};
    for (size_t i = 1; i < inputs.size(); ++i) shapes.push_back(inputs[i].shape());
    return shapes;
  }

 private:
  std::vector<std::shared_ptr<const PreparedDecoderLayer>> layers_;
  std::vector<DecoderLayerSpec> specs_;
  std::vector<int> offsets_;
  std::vector<std::vector<int32_t>> tables_;
};

}  // namespace

namespace {

void check_spec(const DecoderLayerSpec& spec, bool has_rope_freqs) {
  const int H = spec.hidden, D = spec.head_dim, I = spec.intermediate;
  if (H <= 0 || D <= 0 || I <= 0 || spec.heads <= 0 || spec.kv_heads <= 0 || spec.heads % spec.kv_heads != 0) {
    fail("invalid dimensions");
  }
  if (spec.offset < 0) fail("offset must be non-negative");
  if (spec.rope_dims <= 0 || spec.rope_dims % 2 != 0 || spec.rope_dims > D) {
    fail("rope dims must be even and at most head_dim, got " + std::to_string(spec.rope_dims));
  }
  if (!has_rope_freqs && !(spec.rope_base > 0.0f)) fail("rope base must be positive");
  if (spec.kv_window < 0 || spec.kv_keep < 0) fail("kv_window and kv_keep must be non-negative");
}

void check_weights(const DecoderLayerInputs& in, const DecoderLayerSpec& spec) {
  const int H = spec.hidden, D = spec.head_dim, I = spec.intermediate;
  check_vector(in.input_norm, H, "input_layernorm weight");
  check_vector(in.post_attention_norm, H, "post_attention_layernorm weight");
  check_projection(in.q_proj, spec.heads * D, H, "q_proj");
  check_projection(in.k_proj, spec.kv_heads * D, H, "k_proj");
  check_projection(in.v_proj, spec.kv_heads * D, H, "v_proj");
  check_projection(in.o_proj, H, spec.heads * D, "o_proj");
  const int E = std::max(spec.experts, 1);
  check_projection(in.gate_proj, E * I, H, "gate_proj");
  check_projection(in.up_proj, E * I, H, "up_proj");
  check_projection(in.down_proj, E * H, I, "down_proj");
  if (spec.experts > 0) {
    if (!in.router) fail("a mixture of experts needs its router");
    check_projection(*in.router, spec.experts, H, "router");
    if (spec.top_k < 1 || spec.top_k > spec.experts || spec.routing < 0 || spec.routing > 2) {
      fail("top_k must be 1..experts and routing 0, 1 or 2");
    }
    if (spec.activation != 0 || in.attn_out_norm || in.gate_proj.bias || in.up_proj.bias || in.down_proj.bias) {
      fail("experts take SiLU, no output norms and no biases");
    }
  } else if (in.router) {
    fail("a router without experts");
  }
  if (in.q_norm.has_value() != in.k_norm.has_value()) fail("q_norm and k_norm weights come together");
  if (in.q_norm) {
    check_vector(*in.q_norm, D, "q_norm weight");
    check_vector(*in.k_norm, D, "k_norm weight");
  }
  if (in.rope_freqs) check_vector(*in.rope_freqs, spec.rope_dims / 2, "rope freqs");
  if (in.attn_out_norm.has_value() != in.mlp_out_norm.has_value()) fail("attn_out_norm and mlp_out_norm weights come together");
  if (in.attn_out_norm) {
    check_vector(*in.attn_out_norm, H, "attn_out_norm weight");
    check_vector(*in.mlp_out_norm, H, "mlp_out_norm weight");
  }
}

void check_activations(const mx::array& x, const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                       const std::vector<int>& offsets, const DecoderLayerSpec& spec) {
  const int H = spec.hidden, D = spec.head_dim;
  const int B = (int)offsets.size();
  if (B < 1 || (int)keys.size() != B || (int)values.size() != B) {
    fail("one keys and one values cache per offset, got " + std::to_string(keys.size()) + " and " +
         std::to_string(values.size()) + " for " + std::to_string(B) + " offsets");
  }
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(0) != B || x.shape(1) < 1 || x.shape(2) != H) {
    fail("x must be float32 [" + std::to_string(B) + ", L, " + std::to_string(H) + "], got shape " + shape_str(x));
  }
  const int L = x.shape(1);
  for (int b = 0; b < B; ++b) {
    if (offsets[b] < 0) fail("offset must be non-negative");
    const std::string which = B > 1 ? " " + std::to_string(b) : "";
    for (const auto& [a, name] : {std::pair{&keys[b], "keys"}, std::pair{&values[b], "values"}}) {
      if (a->dtype() != mx::float32 || a->ndim() != 4 || a->shape(0) != 1 || a->shape(1) != spec.kv_heads ||
          a->shape(3) != D || a->shape(2) < offsets[b] + L) {
        fail(std::string(name) + " cache" + which + " must be float32 [1, " + std::to_string(spec.kv_heads) +
             ", >= " + std::to_string(offsets[b] + L) + ", " + std::to_string(D) + "], got shape " + shape_str(*a));
      }
    }
  }
}

void check_prepared_spec(const PreparedDecoderLayer& weights, const DecoderLayerSpec& spec) {
  const DecoderLayerSpec& w = weights.spec;
  if (spec.hidden != w.hidden || spec.heads != w.heads || spec.kv_heads != w.kv_heads || spec.head_dim != w.head_dim ||
      spec.intermediate != w.intermediate || spec.rope_dims != w.rope_dims || spec.experts != w.experts ||
      spec.top_k != w.top_k || spec.routing != w.routing) {
    fail("the spec's dimensions differ from those the weights were prepared for");
  }
  check_spec(spec, weights.slots.freqs >= 0);
}

mx::Stream cpu_stream(mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only; GPUs use MLX's ops");
  return stream;
}

}  // namespace

std::vector<mx::array> decoder_layer(const DecoderLayerInputs& in, const DecoderLayerSpec& spec,
                                     mx::StreamOrDevice s) {
  mx::Stream stream = cpu_stream(s);
  check_spec(spec, in.rope_freqs.has_value());
  check_activations(in.x, {in.keys}, {in.values}, {spec.offset}, spec);
  check_weights(in, spec);
  Slots slots;
  std::vector<mx::array> args = pack(in, stream, slots);
  return mx::array::make_arrays({in.x.shape(), in.keys.shape(), in.values.shape()},
                                {mx::float32, mx::float32, mx::float32},
                                std::make_shared<DecoderLayer>(stream, spec, slots, std::vector<int>{spec.offset}), args);
}

std::shared_ptr<const PreparedDecoderLayer> prepare_decoder_layer(const DecoderLayerInputs& in,
                                                                  const DecoderLayerSpec& spec,
                                                                  mx::StreamOrDevice s) {
  mx::Stream stream = cpu_stream(s);
  check_spec(spec, in.rope_freqs.has_value());
  check_weights(in, spec);
  auto prepared = std::make_shared<PreparedDecoderLayer>();
  prepared->spec = spec;
  prepared->arrays = pack(in, stream, prepared->slots, /*activations=*/false);
  mx::eval(prepared->arrays);
  for (mx::array& a : prepared->arrays) a.detach();
  // Decode streams every dense projection once per token: give the VNNI
  // matvec its interleaved copies.
  if (spec.experts == 0) {
    Pointers p;
    bind_weights(p, prepared->arrays, prepared->slots, spec);
    prepared->vnni_rows.resize(prepared->arrays.size());
    const std::pair<const Projection*, int> dense[] = {
        {&p.q, prepared->slots.q.weight},       {&p.k, prepared->slots.k.weight},   {&p.v, prepared->slots.v.weight},
        {&p.o, prepared->slots.o.weight},       {&p.gate, prepared->slots.gate.weight},
        {&p.up, prepared->slots.up.weight},     {&p.down, prepared->slots.down.weight}};
    for (const auto& [projection, slot] : dense) {
      if (slot >= 0) prepared->vnni_rows[slot] = detail::make_vnni_rows(projection->view);
    }
  }
  auto bound = std::make_shared<Pointers>();
  bind_weights(*bound, prepared->arrays, prepared->slots, spec, prepared.get());
  prepared->bound = std::move(bound);
  return prepared;
}

std::vector<mx::array> decoder_layer(const std::shared_ptr<const PreparedDecoderLayer>& weights, const mx::array& x,
                                     const mx::array& keys, const mx::array& values, const DecoderLayerSpec& spec,
                                     mx::StreamOrDevice s) {
  return decoder_layer_batch(weights, x, {keys}, {values}, {spec.offset}, spec, s);
}

std::vector<mx::array> decoder_layer_batch(const std::shared_ptr<const PreparedDecoderLayer>& weights,
                                           const mx::array& x, const std::vector<mx::array>& keys,
                                           const std::vector<mx::array>& values, const std::vector<int>& offsets,
                                           const DecoderLayerSpec& spec, mx::StreamOrDevice s) {
  if (!weights) fail("no prepared weights");
  mx::Stream stream = cpu_stream(s);
  check_prepared_spec(*weights, spec);
  check_activations(x, keys, values, offsets, spec);
  const int B = (int)offsets.size();
  Slots slots;
  slots.x = 0;
  slots.keys = 1;
  slots.values = 1 + B;
  std::vector<mx::array> inputs{x};
  std::vector<mx::Shape> shapes{x.shape()};
  for (const auto* list : {&keys, &values}) {
    for (const mx::array& a : *list) {
      inputs.push_back(a);
      shapes.push_back(a.shape());
    }
  }
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<DecoderLayer>(stream, spec, slots, offsets, weights), std::move(inputs));
}

namespace {

void check_paged(const mx::array& x, const mx::array& pool_keys, const mx::array& pool_values,
                 const std::vector<std::vector<int32_t>>& tables, const std::vector<int>& offsets,
                 const DecoderLayerSpec& spec) {
  const int B = (int)offsets.size();
  if (B < 1 || (int)tables.size() != B) {
    fail("one block table per offset, got " + std::to_string(tables.size()) + " for " + std::to_string(B) + " offsets");
  }
  if (x.dtype() != mx::float32 || x.ndim() != 3 || x.shape(0) != B || x.shape(1) < 1 || x.shape(2) != spec.hidden) {
    fail("x must be float32 [" + std::to_string(B) + ", L, " + std::to_string(spec.hidden) + "], got shape " +
         shape_str(x));
  }
  const bool q8 = pool_keys.dtype() == mx::uint8;
  int blocks = 0, block = 0;
  if (q8) {
    const detail::KvQ8Layout layout{pool_keys.ndim() == 5 ? pool_keys.shape(1) : 0, spec.kv_heads, 16, spec.head_dim};
    if (pool_keys.id() != pool_values.id()) fail("an 8-bit pool must be passed as both the keys and the values pool");
    if (spec.head_dim % detail::kKvQ8Group != 0 || spec.head_dim > 1024) {
      fail("an 8-bit KV pool needs head_dim a multiple of 64, at most 1024; got " + std::to_string(spec.head_dim));
    }
    const int64_t section = pool_keys.ndim() == 5 ? pool_keys.shape(4) : 0;
    block = (int)(section / (int64_t)layout.row_bytes());
    if (pool_keys.ndim() != 5 || pool_keys.shape(2) != 2 || pool_keys.shape(3) != spec.kv_heads ||
        section % (int64_t)layout.row_bytes() != 0 || block < 8 || (block & (block - 1)) != 0) {
      fail("an 8-bit pool must be uint8 [blocks, layers, 2, " + std::to_string(spec.kv_heads) +
           ", block (a power of two >= 8) * " + std::to_string(layout.row_bytes()) + "], got shape " +
           shape_str(pool_keys));
    }
    if (spec.kv_layer < 0 || spec.kv_layer >= pool_keys.shape(1)) {
      fail("kv_layer " + std::to_string(spec.kv_layer) + " is outside the 8-bit pool's " +
           std::to_string(pool_keys.shape(1)) + " layers");
    }
    if (!spec.cache_in_place) fail("an 8-bit pool is written in place only (cache_in_place)");
    blocks = pool_keys.shape(0);
  }
  for (const auto& [a, name] : {std::pair{&pool_keys, "keys"}, std::pair{&pool_values, "values"}}) {
    if (q8) break;
    if (a->dtype() != mx::float32 || a->ndim() != 4 || a->shape(0) != spec.kv_heads || a->shape(3) != spec.head_dim ||
        a->shape(2) < 8 || (a->shape(2) & (a->shape(2) - 1)) != 0 || a->shape() != pool_keys.shape()) {
      fail(std::string(name) + " pool must be float32 [" + std::to_string(spec.kv_heads) +
           ", blocks, block (a power of two >= 8), " + std::to_string(spec.head_dim) + "] like the keys pool, got shape " +
           shape_str(*a));
    }
  }
  if (!q8) {
    blocks = pool_keys.shape(1);
    block = pool_keys.shape(2);
  }
  const int L = x.shape(1);
  // Blocks written by this node, each by one sequence only.
  std::vector<int32_t> written;
  for (int b = 0; b < B; ++b) {
    const std::string which = B > 1 ? " of sequence " + std::to_string(b) : "";
    if (offsets[b] < 0) fail("offset must be non-negative");
    if ((int64_t)tables[b].size() * block < (int64_t)offsets[b] + L) {
      fail("the block table" + which + " holds " + std::to_string(tables[b].size() * block) + " positions, " +
           std::to_string(offsets[b] + L) + " needed");
    }
    // Blocks that no new token sees (below the window) may be -1.
    const detail::KvWindowRule rule{spec.kv_window, spec.kv_keep};
    for (size_t i = 0; i < tables[b].size(); ++i) {
      const int32_t id = tables[b][i];
      if ((id < 0 && !(id == -1 && rule.hides_block((int64_t)i, block, offsets[b] + 1))) || id >= blocks) {
        fail("block id " + std::to_string(id) + which + " at table index " + std::to_string(i) +
             " is outside the pool of " + std::to_string(blocks));
      }
    }
    for (int i = offsets[b] / block; i <= (offsets[b] + L - 1) / block; ++i) written.push_back(tables[b][i]);
  }
  std::sort(written.begin(), written.end());
  if (std::adjacent_find(written.begin(), written.end()) != written.end()) {
    fail("two sequences write the same block");
  }
}

}  // namespace

std::vector<mx::array> decoder_layer_paged(const std::shared_ptr<const PreparedDecoderLayer>& weights,
                                           const mx::array& x, const mx::array& pool_keys,
                                           const mx::array& pool_values,
                                           const std::vector<std::vector<int32_t>>& tables,
                                           const std::vector<int>& offsets, const DecoderLayerSpec& spec,
                                           mx::StreamOrDevice s) {
  if (!weights) fail("no prepared weights");
  mx::Stream stream = cpu_stream(s);
  check_prepared_spec(*weights, spec);
  check_paged(x, pool_keys, pool_values, tables, offsets, spec);
  Slots slots;
  slots.x = 0;
  slots.keys = 1;
  slots.values = 2;
  return mx::array::make_arrays({x.shape(), pool_keys.shape(), pool_values.shape()},
                                {mx::float32, pool_keys.dtype(), pool_values.dtype()},
                                std::make_shared<DecoderLayer>(stream, spec, slots, offsets, weights, tables),
                                {x, pool_keys, pool_values});
}

namespace {
std::atomic<uint64_t> stack_nodes{0};
}  // namespace

std::vector<mx::array> decoder_stack_paged(const std::vector<std::shared_ptr<const PreparedDecoderLayer>>& layers,
                                           const mx::array& x, const std::vector<mx::array>& pool_keys,
                                           const std::vector<mx::array>& pool_values,
                                           const std::vector<std::vector<int32_t>>& tables,
                                           const std::vector<int>& offsets, const std::vector<DecoderLayerSpec>& specs,
                                           mx::StreamOrDevice s) {
  const size_t n = layers.size();
  if (n == 0) fail("a stack needs at least one layer");
  if (specs.size() != n || pool_keys.size() != n || pool_values.size() != n) {
    fail("a stack of " + std::to_string(n) + " layers got " + std::to_string(specs.size()) + " specs, " +
         std::to_string(pool_keys.size()) + " key pools and " + std::to_string(pool_values.size()) + " value pools");
  }
  mx::Stream stream = cpu_stream(s);
  std::vector<mx::Shape> shapes{x.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32};
  std::vector<mx::array> inputs{x};
  for (size_t i = 0; i < n; ++i) {
    if (!layers[i]) fail("no prepared weights for layer " + std::to_string(i));
    try {
      check_prepared_spec(*layers[i], specs[i]);
      check_paged(x, pool_keys[i], pool_values[i], tables, offsets, specs[i]);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("[mlxcel::kernels::decoder_stack_paged] layer " + std::to_string(i) + ": " + e.what());
    }
  }
  for (const auto* pools : {&pool_keys, &pool_values}) {
    for (const mx::array& pool : *pools) {
      shapes.push_back(pool.shape());
      dtypes.push_back(pool.dtype());
      inputs.push_back(pool);
    }
  }
  stack_nodes.fetch_add(1, std::memory_order_relaxed);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                std::make_shared<DecoderStack>(stream, layers, specs, offsets, tables), std::move(inputs));
}

uint64_t decoder_stack_nodes() { return stack_nodes.load(std::memory_order_relaxed); }

}  // namespace mlxcel::kernels
