// See quantized_gemm.h. Layout (MLX affine quantization, transpose=true):
//   w [N, K*bits/32] uint32: element k of row n at bit (k % (32/bits))*bits
//   of word k / (32/bits); scales, biases [N, K/group].
//
// Work split: the output is cut into blocks of MC rows of x by NC outputs;
// each block is one task on the kernels' pool, panel-major. A task
// dequantizes its NC rows of w into a thread-local panel, unless the same
// thread packed that panel for its previous block, then runs its rows of x
// against it:
//  - exact f32 loop (AVX-512): panel [NC/NR][K][NR] f32, an 8x32 microkernel
//    (16 zmm accumulators, two 16-float panel loads and 8 broadcasts of x
//    per k); rows of x are read in place through a table of row pointers
//    (any strides, broadcast rows included).
//  - AMX loop: x is first split into bf16 halves for all rows ([Mp][Kp]),
//    panels hold the bf16 halves of the dequantized weights in tile layout,
//    and 32x32 output blocks accumulate three tile products (see below).
// The SwiGLU variant packs the same panel of two weights (gate, up) and
// combines the two output tiles as they are stored.

#include "quantized_gemm.h"

#include "cpu_features.h"
#include "detail.h"

#ifdef MLXCEL_X86
#include "simd_math.h"
// GCC 12 reports the `_mm512_undefined_*` idiom inside its own AVX-512
// intrinsics as -Wmaybe-uninitialized; the warnings are false positives.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

using detail::Scalar;

constexpr int MR = 8;   // rows of x per microkernel call
constexpr int NR = 32;  // outputs per microkernel call (two zmm)

// The integer loops for 4- and 8-bit weights (gemm_int16.inc, x86-64 only).
constexpr int kInt16MaxGroup = 256;  // the exact int32 group sum's limit
constexpr int kInt16Rows512 = 6;     // rows of x per AVX-512 microkernel call (32 outputs)
constexpr int kInt16Rows256 = 3;     // rows of x per AVX2 microkernel call (16 outputs)

// A 64-byte aligned, growable buffer of 4-byte elements (the microkernels'
// aligned loads; AMX tile rows).
template <class T>
struct Aligned {
  static_assert(sizeof(T) == 4);
  T* p = nullptr;
  size_t cap = 0;
  T* get(size_t n) {
    if (n > cap) {
      std::free(p);
      cap = (n + 15) & ~size_t(15);
      p = static_cast<T*>(std::aligned_alloc(64, cap * sizeof(T)));
      if (!p) {
        cap = 0;
        throw std::bad_alloc();
      }
    }
    return p;
  }
  ~Aligned() { std::free(p); }
};
using AlignedFloats = Aligned<float>;

// From this many rows of x on, dense weights are packed into panels (the
// packing pays for itself); fewer rows dot rows of w in place.
constexpr int kDensePanelMinRows = 16;

// Which loops evaluate a GEMM.
enum class Isa : int { Portable = 0, Avx2 = 1, Avx512 = 2, Amx = 3, Avx512Int16 = 4, Avx2Int16 = 5 };

struct XInt16;  // x quantized for the integer loops (gemm_int16.inc)

struct GemmJob {
  int M = 0, N = 0, K = 0;
  int bits = 0, group = 0, G = 0, wpr = 0;
  const uint32_t* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  Scalar sty = Scalar::F32;
  // SwiGLU: a second weight (up) of the same shape; the output is
  // silu(x @ w.T) * (x @ w2.T).
  const uint32_t* w2 = nullptr;
  const void* scales2 = nullptr;
  const void* biases2 = nullptr;
  // Dense weight: [N, K] f32 rows (then w is null); `dense_dot` runs the
  // unpacked dot-product loop (few rows of x) instead of packed panels.
  const float* wd = nullptr;
  // A float16 dense weight [N, K] (few rows of x only: `dense_dot`).
  const uint16_t* wd16 = nullptr;
  bool dense_dot = false;
  const float* const* rows = nullptr;  // [M] row pointers of x (f32, unit stride)
  float* y = nullptr;                  // [M, N] f32
  int mc = 0, nc = 0;                  // block sizes (multiples of MR and NR, 32 for AMX)
  int mblocks = 0, npanels = 0;
  uint64_t id = 0;                     // distinguishes calls for panel reuse
  // AMX: x as bf16 halves, x ~ hi + lo, [Mp][Kp] (rows padded to 32 and
  // columns to Kp = K rounded up to 32, with zeros).
  Isa isa = Isa::Portable;
  int Kp = 0;
  const uint16_t* xh = nullptr;
  const uint16_t* xl = nullptr;
  // Integer loops: x as int16 [M][K], per row and group its scale and sum
  // [M][G], in buffers the job holds.
  const int16_t* xq = nullptr;
  const float* xq_scale = nullptr;
  const float* xq_sum = nullptr;
  std::shared_ptr<XInt16> xint16;
};

// Per-thread scratch: the packed panel(s) and the panel's scales and biases.
struct PanelScratch {
  AlignedFloats bp, bp2, sb, sb2, tmp;
  Aligned<uint32_t> bh, bl, bh2, bl2;
  uint64_t job = 0;
  int panel = -1;
};
thread_local PanelScratch tl_panel;

std::atomic<uint64_t> next_job_id{1};

#ifdef MLXCEL_X86
#define MLXCEL_GEMM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// The scales and biases of rows [n0, n0 + rows) transposed into sb: scales
// then biases, [G][nc_pad] each, zero beyond `rows`.
MLXCEL_GEMM_TARGET void load_panel_scales(const GemmJob& j, const void* scales, const void* biases, int n0, int rows,
                                          int nc_pad, float* sb) {
  const int G = j.G;
  float* st = sb;
  float* bt = sb + (size_t)G * nc_pad;
  if (j.sty == Scalar::F32) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(G));
    for (int r0 = 0; r0 < nc_pad; r0 += 16) {
      const int valid = std::clamp(rows - r0, 0, 16);
      const __mmask16 mask = (__mmask16)((1u << valid) - 1);
      const float* sbase = static_cast<const float*>(scales) + (size_t)(n0 + r0) * G;
      const float* bbase = static_cast<const float*>(biases) + (size_t)(n0 + r0) * G;
      for (int g = 0; g < G; ++g) {
        const __m512 z = _mm512_setzero_ps();
        _mm512_store_ps(st + (size_t)g * nc_pad + r0,
                        valid ? _mm512_mask_i32gather_ps(z, mask, idx, sbase + g, 4) : z);
        _mm512_store_ps(bt + (size_t)g * nc_pad + r0,
                        valid ? _mm512_mask_i32gather_ps(z, mask, idx, bbase + g, 4) : z);
      }
    }
    return;
  }
  // f16 / bf16: each row's groups converted 16 at a time, then transposed.
  alignas(64) float srow[16], brow[16];
  for (int r = 0; r < nc_pad; ++r) {
    if (r >= rows) {
      for (int g = 0; g < G; ++g) st[(size_t)g * nc_pad + r] = bt[(size_t)g * nc_pad + r] = 0.0f;
      continue;
    }
    const size_t base = (size_t)(n0 + r) * G;
    for (int g0 = 0; g0 < G; g0 += 16) {
      const int n = std::min(16, G - g0);
      const __mmask16 km = (__mmask16)((1u << n) - 1);
      const __m256i sh = _mm256_maskz_loadu_epi16(km, static_cast<const uint16_t*>(scales) + base + g0);
      const __m256i bh = _mm256_maskz_loadu_epi16(km, static_cast<const uint16_t*>(biases) + base + g0);
      if (j.sty == Scalar::F16) {
        _mm512_store_ps(srow, _mm512_cvtph_ps(sh));
        _mm512_store_ps(brow, _mm512_cvtph_ps(bh));
      } else {
        _mm512_store_ps(srow, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sh), 16)));
        _mm512_store_ps(brow, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bh), 16)));
      }
      for (int g = 0; g < n; ++g) {
        st[(size_t)(g0 + g) * nc_pad + r] = srow[g];
        bt[(size_t)(g0 + g) * nc_pad + r] = brow[g];
      }
    }
  }
}

// Dequantizes rows [n0, n0 + rows) of w into bp ([nc_pad/NR][K][NR], zero
// beyond `rows`). sb holds the panel's scales then biases, [G][nc_pad] each.
template <int BITS>
MLXCEL_GEMM_TARGET void pack_panel(const GemmJob& j, const uint32_t* w, const void* scales, const void* biases, int n0,
                                   int rows, int nc_pad, float* bp, float* sb) {
  constexpr int EPW = 32 / BITS;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const int G = j.G, K = j.K, wpr = j.wpr;
  load_panel_scales(j, scales, biases, n0, rows, nc_pad, sb);
  const float* st = sb;
  const float* bt = sb + (size_t)G * nc_pad;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(wpr));
  const __m512i qm = _mm512_set1_epi32((int)QM);
  const int wpg = j.group / EPW;  // words per group
  for (int h = 0; h < nc_pad / 16; ++h) {
    const int r0 = h * 16;
    const int valid = std::clamp(rows - r0, 0, 16);
    float* dst = bp + (size_t)(h / 2) * K * NR + (h % 2) * 16;
    if (valid == 0) {
      for (int k = 0; k < K; ++k) _mm512_store_ps(dst + (size_t)k * NR, _mm512_setzero_ps());
      continue;
    }
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const uint32_t* base = w + (size_t)(n0 + r0) * wpr;
    // The gathers read 16 rows at once, a pattern the hardware prefetcher
    // does not follow: fetch the next 16 rows ahead while these unpack.
    const int next = std::clamp(rows - r0 - 16, 0, 16);
    for (int r = 0; r < next; ++r) {
      const char* row = reinterpret_cast<const char*>(base + (size_t)(16 + r) * wpr);
      for (size_t off = 0; off < (size_t)wpr * 4; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sv = _mm512_load_ps(st + (size_t)g * nc_pad + r0);
      const __m512 bv = _mm512_load_ps(bt + (size_t)g * nc_pad + r0);
      for (int wi = g * wpg; wi < (g + 1) * wpg; ++wi) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx, base + wi, 4);
        float* d = dst + (size_t)wi * EPW * NR;
#pragma GCC unroll 16
        for (int s = 0; s < EPW; ++s) {
          const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, BITS * s), qm);
          _mm512_store_ps(d + (size_t)s * NR, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sv, bv));
        }
      }
    }
  }
}

// silu(g) * u, with MLX's sigmoid formula 1 / (1 + e^-g).
MLXCEL_GEMM_TARGET inline __m512 swiglu(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
}

// acc[r, 0:32] = sum_k a[r][k] * b[k, 0:32] for r < MR; stores rows < `rows`
// and columns under the masks: acc itself, or with GATED, silu(c) * acc
// where c holds the gate values for the same tile.
template <bool GATED>
MLXCEL_GEMM_TARGET void micro_8x32(const float* const* a, const float* b, int K, float* c, size_t ldc, int rows,
                                   __mmask16 m0, __mmask16 m1) {
  const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5], *a6 = a[6], *a7 = a[7];
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(), c10 = _mm512_setzero_ps(), c11 = _mm512_setzero_ps();
  __m512 c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps(), c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps();
  __m512 c40 = _mm512_setzero_ps(), c41 = _mm512_setzero_ps(), c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
  __m512 c60 = _mm512_setzero_ps(), c61 = _mm512_setzero_ps(), c70 = _mm512_setzero_ps(), c71 = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int k = 0; k < K; ++k) {
    const __m512 b0 = _mm512_load_ps(b + (size_t)k * NR);
    const __m512 b1 = _mm512_load_ps(b + (size_t)k * NR + 16);
    __m512 x;
    x = _mm512_set1_ps(a0[k]); c00 = _mm512_fmadd_ps(x, b0, c00); c01 = _mm512_fmadd_ps(x, b1, c01);
    x = _mm512_set1_ps(a1[k]); c10 = _mm512_fmadd_ps(x, b0, c10); c11 = _mm512_fmadd_ps(x, b1, c11);
    x = _mm512_set1_ps(a2[k]); c20 = _mm512_fmadd_ps(x, b0, c20); c21 = _mm512_fmadd_ps(x, b1, c21);
    x = _mm512_set1_ps(a3[k]); c30 = _mm512_fmadd_ps(x, b0, c30); c31 = _mm512_fmadd_ps(x, b1, c31);
    x = _mm512_set1_ps(a4[k]); c40 = _mm512_fmadd_ps(x, b0, c40); c41 = _mm512_fmadd_ps(x, b1, c41);
    x = _mm512_set1_ps(a5[k]); c50 = _mm512_fmadd_ps(x, b0, c50); c51 = _mm512_fmadd_ps(x, b1, c51);
    x = _mm512_set1_ps(a6[k]); c60 = _mm512_fmadd_ps(x, b0, c60); c61 = _mm512_fmadd_ps(x, b1, c61);
    x = _mm512_set1_ps(a7[k]); c70 = _mm512_fmadd_ps(x, b0, c70); c71 = _mm512_fmadd_ps(x, b1, c71);
  }
  const __m512 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},
                             {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
  for (int r = 0; r < rows; ++r) {
    float* cr = c + (size_t)r * ldc;
    if constexpr (GATED) {
      _mm512_mask_storeu_ps(cr, m0, swiglu(_mm512_maskz_loadu_ps(m0, cr), acc[r][0]));
      _mm512_mask_storeu_ps(cr + 16, m1, swiglu(_mm512_maskz_loadu_ps(m1, cr + 16), acc[r][1]));
    } else {
      _mm512_mask_storeu_ps(cr, m0, acc[r][0]);
      _mm512_mask_storeu_ps(cr + 16, m1, acc[r][1]);
    }
  }
}

// ---------------------------------------------------------------------------
// AMX path. Each operand is split into two bf16 halves, v ~ hi + lo with
// hi = bf16(v) and lo = bf16(v - hi) (round to nearest even), so that
// x . w ~ xh . wh + xh . wl + xl . wh: three bf16 tile products with f32
// accumulation. The products of bf16 values are exact in f32; what is lost
// is the representation error of each half (at most 2^-16 |v|) and the
// dropped xl . wl (at most 2^-16 |x w|), i.e. ~3 * 2^-16 relative per term
// in the worst case, far less on average.
//
// Layout of a packed panel half: [nc_pad/16 slabs][Kp/2 pairs][16 outputs]
// dwords, each dword the bf16 pair (k = 2p, k = 2p + 1) of one output: rows
// of a B tile ("VNNI" layout), 16 pairs (32 k) per tile.

#define MLXCEL_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// bf16(f) (nearest even) as f32 bit patterns, low 16 bits cleared.
MLXCEL_GEMM_TARGET inline __m512i bf16_bits(__m512 f) {
  const __m512i b = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

MLXCEL_GEMM_TARGET inline void bf16_split(__m512 f, __m512i& hi, __m512i& lo) {
  hi = bf16_bits(f);
  lo = bf16_bits(_mm512_sub_ps(f, _mm512_castsi512_ps(hi)));
}

// Dwords holding the bf16 pairs (even k from `a`, odd k from `b`).
MLXCEL_GEMM_TARGET inline __m512i bf16_pairs(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_srli_epi32(a, 16), b);
}

// Dequantizes rows [n0, n0 + rows) of w into the hi and lo halves of an AMX
// panel (zero beyond `rows` and beyond K). sb as in pack_panel.
template <int BITS>
MLXCEL_GEMM_TARGET void pack_panel_amx(const GemmJob& j, const uint32_t* w, const void* scales, const void* biases,
                                       int n0, int rows, int nc_pad, uint32_t* bh, uint32_t* bl, float* sb) {
  constexpr int EPW = 32 / BITS;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const int G = j.G, wpr = j.wpr, P = j.Kp / 2, Pk = j.K / 2;
  load_panel_scales(j, scales, biases, n0, rows, nc_pad, sb);
  const float* st = sb;
  const float* bt = sb + (size_t)G * nc_pad;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(wpr));
  const __m512i qm = _mm512_set1_epi32((int)QM);
  const int wpg = j.group / EPW;
  for (int h = 0; h < nc_pad / 16; ++h) {
    const int r0 = h * 16;
    const int valid = std::clamp(rows - r0, 0, 16);
    uint32_t* dh = bh + (size_t)h * P * 16;
    uint32_t* dl = bl + (size_t)h * P * 16;
    if (valid == 0) {
      std::memset(dh, 0, (size_t)P * 64);
      std::memset(dl, 0, (size_t)P * 64);
      continue;
    }
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const uint32_t* base = w + (size_t)(n0 + r0) * wpr;
    // The gathers read 16 rows at once, a pattern the hardware prefetcher
    // does not follow: fetch the next 16 rows ahead while these unpack.
    const int next = std::clamp(rows - r0 - 16, 0, 16);
    for (int r = 0; r < next; ++r) {
      const char* row = reinterpret_cast<const char*>(base + (size_t)(16 + r) * wpr);
      for (size_t off = 0; off < (size_t)wpr * 4; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sv = _mm512_load_ps(st + (size_t)g * nc_pad + r0);
      const __m512 bv = _mm512_load_ps(bt + (size_t)g * nc_pad + r0);
      for (int wi = g * wpg; wi < (g + 1) * wpg; ++wi) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, idx, base + wi, 4);
#pragma GCC unroll 8
        for (int s = 0; s < EPW; s += 2) {
          const __m512i q0 = _mm512_and_si512(_mm512_srli_epi32(v, BITS * s), qm);
          const __m512i q1 = _mm512_and_si512(_mm512_srli_epi32(v, BITS * (s + 1)), qm);
          __m512i h0, l0, h1, l1;
          bf16_split(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), sv, bv), h0, l0);
          bf16_split(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), sv, bv), h1, l1);
          const size_t p = ((size_t)wi * EPW + s) / 2;
          _mm512_store_si512(dh + p * 16, bf16_pairs(h0, h1));
          _mm512_store_si512(dl + p * 16, bf16_pairs(l0, l1));
        }
      }
    }
    for (int p = Pk; p < P; ++p) {
      _mm512_store_si512(dh + (size_t)p * 16, _mm512_setzero_si512());
      _mm512_store_si512(dl + (size_t)p * 16, _mm512_setzero_si512());
    }
  }
}

// Rows [r0, r1) of x as bf16 halves into xh/xl ([Mp][Kp], zero padded).
struct XSplit {
  const GemmJob* j;
  uint16_t* xh;
  uint16_t* xl;
};

MLXCEL_GEMM_TARGET void split_rows(void* ctx, int t) {
  const XSplit& xs = *static_cast<const XSplit*>(ctx);
  const GemmJob& j = *xs.j;
  for (int m = t * 32; m < t * 32 + 32; ++m) {
    uint16_t* dh = xs.xh + (size_t)m * j.Kp;
    uint16_t* dl = xs.xl + (size_t)m * j.Kp;
    if (m >= j.M) {
      std::memset(dh, 0, (size_t)j.Kp * 2);
      std::memset(dl, 0, (size_t)j.Kp * 2);
      continue;
    }
    const float* src = j.rows[m];
    for (int k = 0; k < j.Kp; k += 16) {
      const __mmask16 km = j.K - k >= 16 ? (__mmask16)0xffff : j.K - k <= 0 ? (__mmask16)0 : (__mmask16)((1u << (j.K - k)) - 1);
      __m512i h, l;
      bf16_split(_mm512_maskz_loadu_ps(km, src + k), h, l);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dh + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dl + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(l, 16)));
    }
  }
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& tile_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return cfg;
}

// dst[32][32] (row stride ldd floats) = x rows (32 from xh/xl, stride ldx
// elements) . panel columns (two slabs from bh/bl, `slab` dwords apart), over
// `chunks` chunks of 32 k.
MLXCEL_AMX_TARGET void amx_32x32(const uint16_t* xh, const uint16_t* xl, size_t ldx, const uint32_t* bh,
                                 const uint32_t* bl, size_t slab, int chunks, float* dst, size_t ldd) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // Per chunk of 32 k: xh.wh, xh.wl (reusing the x tiles), xl.wh (the wh
  // tiles come back from L1): 10 tile loads for 12 products.
  const long sx = (long)ldx * 2;
  for (int c = 0; c < chunks; ++c) {
    const size_t bo = (size_t)c * 256;
    _tile_loadd(4, xh + c * 32, sx);
    _tile_loadd(5, xh + 16 * ldx + c * 32, sx);
    _tile_loadd(6, bh + bo, 64);
    _tile_loadd(7, bh + slab + bo, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(6, bl + bo, 64);
    _tile_loadd(7, bl + slab + bo, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(4, xl + c * 32, sx);
    _tile_loadd(5, xl + 16 * ldx + c * 32, sx);
    _tile_loadd(6, bh + bo, 64);
    _tile_loadd(7, bh + slab + bo, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const long sd = (long)ldd * 4;
  _tile_stored(0, dst, sd);
  _tile_stored(1, dst + 16, sd);
  _tile_stored(2, dst + 16 * ldd, sd);
  _tile_stored(3, dst + 16 * ldd + 16, sd);
}

MLXCEL_AMX_TARGET void run_block_amx(const GemmJob& j, int task) {
  const int panel = task / j.mblocks, mb = task % j.mblocks;
  const int n0 = panel * j.nc, ncols = std::min(j.nc, j.N - n0);
  const int nc_pad = (ncols + 31) / 32 * 32;
  const size_t P = (size_t)j.Kp / 2;
  PanelScratch& ps = tl_panel;
  const bool gated = j.w2 != nullptr;
  uint32_t* bh = ps.bh.get((size_t)nc_pad * P);
  uint32_t* bl = ps.bl.get((size_t)nc_pad * P);
  uint32_t* bh2 = gated ? ps.bh2.get((size_t)nc_pad * P) : nullptr;
  uint32_t* bl2 = gated ? ps.bl2.get((size_t)nc_pad * P) : nullptr;
  float* tmp = ps.tmp.get(2 * 32 * 32);
  if (ps.job != j.id || ps.panel != panel) {
    float* sb = ps.sb.get((size_t)2 * j.G * nc_pad);
    auto pack = [&](const uint32_t* w, const void* s, const void* b, uint32_t* dh, uint32_t* dl) {
      switch (j.bits) {
        case 2: pack_panel_amx<2>(j, w, s, b, n0, ncols, nc_pad, dh, dl, sb); break;
        case 4: pack_panel_amx<4>(j, w, s, b, n0, ncols, nc_pad, dh, dl, sb); break;
        default: pack_panel_amx<8>(j, w, s, b, n0, ncols, nc_pad, dh, dl, sb); break;
      }
    };
    ps.job = 0;
    pack(j.w, j.scales, j.biases, bh, bl);
    if (gated) pack(j.w2, j.scales2, j.biases2, bh2, bl2);
    ps.job = j.id;
    ps.panel = panel;
  }
  const int m0 = mb * j.mc, m1 = std::min(j.M, m0 + j.mc);
  const int chunks = j.Kp / 32;
  _tile_loadconfig(&tile_config());
  for (int i = m0; i < m1; i += 32) {
    const int rows = std::min(32, m1 - i);
    const uint16_t* xh = j.xh + (size_t)i * j.Kp;
    const uint16_t* xl = j.xl + (size_t)i * j.Kp;
    for (int jb = 0; jb < nc_pad; jb += 32) {
      const int cols = std::min(32, ncols - jb);
      const size_t off = (size_t)(jb / 16) * P * 16;
      if (!gated && rows == 32 && cols == 32) {  // straight into y
        amx_32x32(xh, xl, j.Kp, bh + off, bl + off, P * 16, chunks, j.y + (size_t)i * j.N + n0 + jb, j.N);
        continue;
      }
      amx_32x32(xh, xl, j.Kp, bh + off, bl + off, P * 16, chunks, tmp, 32);
      if (gated) amx_32x32(xh, xl, j.Kp, bh2 + off, bl2 + off, P * 16, chunks, tmp + 1024, 32);
      const __mmask16 k0 = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
      const __mmask16 k1 = cols >= 32 ? (__mmask16)0xffff : cols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (cols - 16)) - 1);
      for (int r = 0; r < rows; ++r) {
        float* yr = j.y + (size_t)(i + r) * j.N + n0 + jb;
        __m512 c0 = _mm512_load_ps(tmp + r * 32), c1 = _mm512_load_ps(tmp + r * 32 + 16);
        if (gated) {
          c0 = swiglu(c0, _mm512_load_ps(tmp + 1024 + r * 32));
          c1 = swiglu(c1, _mm512_load_ps(tmp + 1024 + r * 32 + 16));
        }
        _mm512_mask_storeu_ps(yr, k0, c0);
        _mm512_mask_storeu_ps(yr + 16, k1, c1);
      }
    }
  }
  _tile_release();
}

MLXCEL_GEMM_TARGET void run_block(const GemmJob& j, int task) {
  const int panel = task / j.mblocks, mb = task % j.mblocks;
  const int n0 = panel * j.nc, ncols = std::min(j.nc, j.N - n0);
  const int nc_pad = (ncols + NR - 1) / NR * NR;
  PanelScratch& ps = tl_panel;
  const bool gated = j.w2 != nullptr;
  float* bp = ps.bp.get((size_t)nc_pad * j.K);
  float* bp2 = gated ? ps.bp2.get((size_t)nc_pad * j.K) : nullptr;
  if (ps.job != j.id || ps.panel != panel) {
    float* sb = ps.sb.get((size_t)2 * j.G * nc_pad);
    auto pack = [&](const uint32_t* w, const void* s, const void* b, float* dst) {
      switch (j.bits) {
        case 2: pack_panel<2>(j, w, s, b, n0, ncols, nc_pad, dst, sb); break;
        case 4: pack_panel<4>(j, w, s, b, n0, ncols, nc_pad, dst, sb); break;
        default: pack_panel<8>(j, w, s, b, n0, ncols, nc_pad, dst, sb); break;
      }
    };
    ps.job = 0;  // stays invalid if packing throws
    pack(j.w, j.scales, j.biases, bp);
    if (gated) pack(j.w2, j.scales2, j.biases2, bp2);
    ps.job = j.id;
    ps.panel = panel;
  }
  const int m0 = mb * j.mc, m1 = std::min(j.M, m0 + j.mc);
  const float* a[MR];
  for (int i = m0; i < m1; i += MR) {
    const int rows = std::min(MR, m1 - i);
    for (int r = 0; r < MR; ++r) a[r] = j.rows[i + std::min(r, rows - 1)];
    for (int jp = 0; jp < nc_pad / NR; ++jp) {
      const int cols = std::min(NR, ncols - jp * NR);
      const __mmask16 k0 = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
      const __mmask16 k1 = cols >= 32 ? (__mmask16)0xffff : cols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (cols - 16)) - 1);
      float* c = j.y + (size_t)i * j.N + n0 + jp * NR;
      micro_8x32<false>(a, bp + (size_t)jp * j.K * NR, j.K, c, j.N, rows, k0, k1);
      if (gated) micro_8x32<true>(a, bp2 + (size_t)jp * j.K * NR, j.K, c, j.N, rows, k0, k1);
    }
  }
}

#endif  // MLXCEL_X86

// The generic loops, once per instruction set.
#ifdef MLXCEL_X86
namespace avx2 {
#define MLXCEL_VEC8_AVX2
#include "gemm_generic.inc"
#undef MLXCEL_VEC8_AVX2
}  // namespace avx2

#include "gemm_int16.inc"  // (after avx2: it reads scales with avx2::load_groups8)
#endif

namespace portable {
#include "gemm_generic.inc"
}  // namespace portable

void task_fn(void* ctx, int task) {
  const GemmJob& j = *static_cast<const GemmJob*>(ctx);
  switch (j.isa) {
#ifdef MLXCEL_X86
    case Isa::Amx: run_block_amx(j, task); return;
    case Isa::Avx512: run_block(j, task); return;
    case Isa::Avx2: j.dense_dot ? avx2::run_dense_block(j, task) : avx2::run_block(j, task); return;
    case Isa::Avx512Int16:
    case Isa::Avx2Int16: run_block_int16(j, task); return;
#endif
    default: j.dense_dot ? portable::run_dense_block(j, task) : portable::run_block(j, task); return;
  }
}

// Picks the blocking of a GEMM whose operands are set (rows, weights, y, M,
// N, K and the layout fields); splits x into bf16 halves for AMX.
void plan_gemm(GemmJob& j) {
  j.id = next_job_id.fetch_add(1, std::memory_order_relaxed);
  const int threads = num_threads();
  j.dense_dot = (j.wd || j.wd16) && j.M < kDensePanelMinRows;
  if (j.wd16 && !j.dense_dot) {
    throw std::logic_error("[mlxcel::kernels::dense_matmul] a float16 weight with " + std::to_string(j.M) + " rows");
  }
  if (j.dense_dot) {
    // Few rows: tasks are blocks of outputs, rows of w read in place.
    j.mblocks = 1;
    j.nc = 48;
    while (j.nc > 6 && (long)(j.N + j.nc - 1) / j.nc < 4L * threads) j.nc /= 2;
    j.npanels = (j.N + j.nc - 1) / j.nc;
  } else {
    const bool amx = j.isa == Isa::Amx;
    // Blocks: rows in multiples of the microkernel's (32 for AMX; at most
    // 128), outputs in panels of 64, or 32 when that leaves too few tasks.
    const int step_rows = amx                           ? 32
                          : j.isa == Isa::Avx512        ? 8
                          : j.isa == Isa::Avx512Int16   ? kInt16Rows512
                          : j.isa == Isa::Avx2Int16     ? kInt16Rows256
                                                        : 6;
    // AMX: packing a panel (dequantize, split) costs as much as a few
    // hundred rows of tile products, so a task takes up to 512 rows.
    const int max_rows = amx ? 512 : 128;
    j.mc = std::min(max_rows / step_rows, (j.M + step_rows - 1) / step_rows) * step_rows;
#ifdef MLXCEL_X86
    // AMX: x as bf16 halves, in the evaluating thread's buffers (reused).
    static thread_local Aligned<uint32_t> xh_buf, xl_buf;
    if (amx) {
      const int Mp = (j.M + 31) / 32 * 32;
      auto* xh = reinterpret_cast<uint16_t*>(xh_buf.get((size_t)Mp * j.Kp / 2));
      auto* xl = reinterpret_cast<uint16_t*>(xl_buf.get((size_t)Mp * j.Kp / 2));
      XSplit xs{&j, xh, xl};
      detail::parallel_for(Mp / 32, split_rows, &xs);
      j.xh = xh;
      j.xl = xl;
    }
    if (j.isa == Isa::Avx512Int16 || j.isa == Isa::Avx2Int16) quantize_x_for(j);
#endif
    j.mblocks = (j.M + j.mc - 1) / j.mc;
    j.nc = amx ? 128 : 64;
    while (j.nc > 32 && (long)j.mblocks * ((j.N + j.nc - 1) / j.nc) < 4L * threads) j.nc /= 2;
    j.npanels = (j.N + j.nc - 1) / j.nc;
  }
}

// Splits a planned GEMM's tasks across the pool.
void dispatch_gemm(const GemmJob& j) {
  const long tasks = (long)j.mblocks * j.npanels;
  if (tasks > 0xffff) {  // the pool's limit: run in slices of panels
    const int panels_per = std::max(1, 0xffff / j.mblocks);
    for (int p0 = 0; p0 < j.npanels; p0 += panels_per) {
      struct Slice {
        const GemmJob* j;
        int first;
      } sl{&j, p0 * j.mblocks};
      const int count = std::min(panels_per, j.npanels - p0) * j.mblocks;
      detail::parallel_for(
          count, [](void* c, int t) {
            auto* s = static_cast<Slice*>(c);
            task_fn(const_cast<GemmJob*>(s->j), s->first + t);
          },
          &sl);
    }
  } else {
    detail::parallel_for((int)tasks, task_fn, const_cast<GemmJob*>(&j));
  }
}

void run_gemm(GemmJob& j) {
  plan_gemm(j);
  dispatch_gemm(j);
}

// The MLX primitive: x (f32, any strides) @ dequantize(w).T -> f32; with
// 7 inputs (x, gate triple, up triple) silu(x @ gate.T) * (x @ up.T); with
// 2 inputs (x, w dense f32 [N, K]) x @ w.T.
class QuantizedGemm : public mx::UnaryPrimitive {
 public:
  enum class Kind : int { Affine = 0, AffineSwiglu = 1, Dense = 2 };

  QuantizedGemm(mx::Stream stream, int group_size, int bits, Kind kind, Isa isa)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), kind_(kind), isa_(isa) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));

    GemmJob j;
    j.K = x.shape(-1);
    j.N = out.shape(-1);
    j.M = j.N == 0 ? 0 : (int)(out.size() / j.N);
    j.isa = isa_;
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);

    const void *sp = nullptr, *bp = nullptr, *s2p = nullptr, *b2p = nullptr;
    const uint32_t *wp = nullptr, *w2p = nullptr;
    const float* wdp = nullptr;
    const uint16_t* wd16p = nullptr;
    if (kind_ == Kind::Dense) {
      if (w.dtype() == mx::float16) {
        wd16p = w.data<uint16_t>();
      } else {
        wdp = w.data<float>();
      }
    } else {
      const mx::array& scales = inputs[2];
      const mx::array& biases = inputs[3];
      j.bits = bits_;
      j.group = group_size_;
      j.G = j.K / group_size_;
      j.wpr = j.K * bits_ / 32;
      j.sty = detail::scalar_of(scales.dtype(), "scales");
      if (biases.dtype() != scales.dtype()) {
        throw std::invalid_argument("[mlxcel::kernels::quantized_gemm] scales and biases differ in dtype");
      }
      wp = w.data<uint32_t>();
      sp = scales.data<void>();
      bp = biases.data<void>();
      if (kind_ == Kind::AffineSwiglu) {
        if (inputs[5].dtype() != scales.dtype() || inputs[6].dtype() != scales.dtype()) {
          throw std::invalid_argument("[mlxcel::kernels::quantized_gemm_swiglu] gate and up scales differ in dtype");
        }
        w2p = inputs[4].data<uint32_t>();
        s2p = inputs[5].data<void>();
        b2p = inputs[6].data<void>();
      }
    }

    // Element offsets of x's rows (all axes but the last).
    std::vector<int64_t> offsets(j.M);
    const auto& shape = x.shape();
    const auto& strides = x.strides();
    const int nd = (int)x.ndim();
    for (int m = 0; m < j.M; ++m) {
      int64_t rem = m, off = 0;
      for (int d = nd - 2; d >= 0; --d) {
        off += (rem % shape[d]) * strides[d];
        rem /= shape[d];
      }
      offsets[m] = off;
    }
    const int64_t step = nd > 0 ? strides[nd - 1] : 1;
    j.Kp = (j.K + 31) / 32 * 32;
    enc.dispatch([j, xp = x.data<float>(), offsets = std::move(offsets), step, wp, sp, bp, w2p, s2p, b2p, wdp, wd16p,
                  op = out.data<float>()]() mutable {
      if (j.M == 0 || j.N == 0) return;
      // Rows of x in place when their elements are adjacent, else copied.
      std::vector<const float*> rows(j.M);
      std::vector<float> copy;
      if (step == 1) {
        for (int m = 0; m < j.M; ++m) rows[m] = xp + offsets[m];
      } else {
        copy.resize((size_t)j.M * j.K);
        for (int m = 0; m < j.M; ++m) {
          float* d = copy.data() + (size_t)m * j.K;
          for (int k = 0; k < j.K; ++k) d[k] = xp[offsets[m] + k * step];
          rows[m] = d;
        }
      }
      j.rows = rows.data();
      j.w = wp;
      j.scales = sp;
      j.biases = bp;
      j.w2 = w2p;
      j.scales2 = s2p;
      j.biases2 = b2p;
      j.wd = wdp;
      j.wd16 = wd16p;
      j.y = op;
      run_gemm(j);
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    throw std::runtime_error("[mlxcel::kernels::QuantizedGemm] has no GPU evaluation");
  }

  const char* name() const override {
    switch (kind_) {
      case Kind::AffineSwiglu: return "MlxcelQuantizedGemmSwiglu";
      case Kind::Dense: return "MlxcelDenseGemm";
      default: return "MlxcelQuantizedGemm";
    }
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedGemm*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->kind_ == kind_ && o->isa_ == isa_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = inputs[1].shape(-2);
    return {s};
  }

 private:
  int group_size_;
  int bits_;
  Kind kind_;
  Isa isa_;
};

// The loops a call on `path` runs for `bits` (0: dense weights) and groups
// of `group`. The AVX-512 and AMX loops unpack whole words (bits 2, 4, 8);
// the generic loops take every width MLX quantizes to, and dense weights.
// The integer loops (groups up to kInt16MaxGroup) take 4- and 8-bit weights
// on Avx512Vnni without AMX, and 8-bit weights on Avx2Int8: an f32 GEMM
// spends a multiply per weight and activation on values that are small
// integers times a group's scale, and vpdpwssd makes two products per lane
// (4-bit 512-token prompts 1.38x on Zen 4). On AVX2, 4-bit weights stay on
// the f32 loop: Zen 4 retires one vpmaddwd per cycle, 16 products like its
// two 8-lane FMAs, and 4-bit prompts measured 0.95x there on the int16 loop.
Isa isa_for(Path path, int bits, int group = 32) {
#ifdef MLXCEL_X86
  const Path p = resolve_path(path);
  const auto& cpu = cpu::features();
  const bool int16_group = group <= kInt16MaxGroup;
  if (bits == 2 || bits == 4 || bits == 8) {
    if (p == Path::Avx512Vnni && cpu.amx_bf16) return Isa::Amx;
    if (int16_group && (bits == 4 || bits == 8) && p == Path::Avx512Vnni && cpu.avx512_vnni) return Isa::Avx512Int16;
    if ((p == Path::Avx512Vnni || p == Path::Avx512) && cpu.avx512) return Isa::Avx512;
  }
  if (int16_group && bits == 8 && p == Path::Avx2Int8 && cpu.avx2) return Isa::Avx2Int16;
  if (p != Path::Portable && cpu.avx2) return Isa::Avx2;
#else
  (void)path;
  (void)bits;
  (void)group;
#endif
  return Isa::Portable;
}

bool valid_layout(int group_size, int bits) {
  if (group_size <= 0) return false;
  switch (bits) {
    case 2: case 4: case 8: return group_size % (32 / bits) == 0;
    case 3: case 5: case 6: return group_size % 32 == 0;  // whole words per group
    default: return false;
  }
}

}  // namespace

bool gemm_uses_amx(Path path) { return isa_for(path, 4) == Isa::Amx; }

bool gemm_supports(int group_size, int bits) { return valid_layout(group_size, bits); }

const char* gemm_loop_name(Path path, int bits) {
  switch (isa_for(path, bits)) {
    case Isa::Amx: return "amx";
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512Int16: return "avx512-int16";
    case Isa::Avx2Int16: return "avx2-int16";
    default: return "portable";
  }
}

mx::array quantized_gemm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    Path path,
    mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  // MLX's node validates the arguments and fixes the output shape and dtype.
  mx::array ref = mx::quantized_matmul(x, w, scales, biases, true, group_size, bits, "affine", stream);
  if (stream.device != mx::Device::cpu || !gemm_supports(group_size, bits) || w.ndim() != 2 || scales.ndim() != 2 ||
      x.ndim() < 1 || !detail::is_float(x.dtype()) || !detail::is_float(scales.dtype()) || scales.dtype() != biases.dtype() ||
      !detail::is_float(ref.dtype()) || ref.size() == 0) {
    return quantized_matmul(x, w, scales, biases, group_size, bits, path, stream);
  }
  auto rc = [&](const mx::array& a) { return detail::row_contiguous(a, stream); };
  mx::array xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, stream);
  mx::array y = mx::array(
      ref.shape(), mx::float32,
      std::make_shared<QuantizedGemm>(stream, group_size, bits, QuantizedGemm::Kind::Affine,
                                                      isa_for(path, bits, group_size)),
      {xf, rc(w), rc(scales), rc(biases)});
  return y.dtype() == ref.dtype() ? y : mx::astype(y, ref.dtype(), stream);
}

mx::array quantized_gemm_swiglu(
    const mx::array& x,
    const mx::array& gate_w,
    const mx::array& gate_scales,
    const mx::array& gate_biases,
    const mx::array& up_w,
    const mx::array& up_scales,
    const mx::array& up_biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  // MLX's nodes validate both projections and fix the output shape and dtype.
  mx::array g_ref = mx::quantized_matmul(x, gate_w, gate_scales, gate_biases, true, group_size, bits, "affine", stream);
  mx::array u_ref = mx::quantized_matmul(x, up_w, up_scales, up_biases, true, group_size, bits, "affine", stream);
  const bool same = gate_w.shape() == up_w.shape() && gate_scales.shape() == up_scales.shape() &&
                    gate_scales.dtype() == up_scales.dtype() && gate_biases.dtype() == up_biases.dtype() &&
                    gate_scales.dtype() == gate_biases.dtype() && g_ref.dtype() == u_ref.dtype();
  if (stream.device != mx::Device::cpu || !same || !gemm_supports(group_size, bits) || gate_w.ndim() != 2 ||
      gate_scales.ndim() != 2 || x.ndim() < 1 || !detail::is_float(x.dtype()) || !detail::is_float(gate_scales.dtype()) ||
      !detail::is_float(g_ref.dtype()) || g_ref.size() == 0) {
    mx::array g = quantized_gemm(x, gate_w, gate_scales, gate_biases, group_size, bits, Path::Auto, stream);
    mx::array u = quantized_gemm(x, up_w, up_scales, up_biases, group_size, bits, Path::Auto, stream);
    return mx::multiply(mx::multiply(g, mx::sigmoid(g, stream), stream), u, stream);
  }
  auto rc = [&](const mx::array& a) { return detail::row_contiguous(a, stream); };
  mx::array xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, stream);
  mx::array y = mx::array(g_ref.shape(), mx::float32,
                          std::make_shared<QuantizedGemm>(stream, group_size, bits, QuantizedGemm::Kind::AffineSwiglu,
                                                          isa_for(Path::Auto, bits, group_size)),
                          {xf, rc(gate_w), rc(gate_scales), rc(gate_biases), rc(up_w), rc(up_scales), rc(up_biases)});
  return y.dtype() == g_ref.dtype() ? y : mx::astype(y, g_ref.dtype(), stream);
}

mx::array dense_matmul(const mx::array& x, const mx::array& w, Path path, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || w.ndim() != 2 || x.ndim() < 1 || !detail::is_float(x.dtype()) ||
      !detail::is_float(w.dtype())) {
    return mx::matmul(x, mx::transpose(w, {1, 0}, stream), stream);
  }
  if (x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("[mlxcel::kernels::dense_matmul] x has " + std::to_string(x.shape(-1)) +
                                " features but w is [" + std::to_string(w.shape(0)) + ", " +
                                std::to_string(w.shape(1)) + "]");
  }
  const mx::Dtype out_dtype = mx::promote_types(x.dtype(), w.dtype());
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  size_t count = 1;
  for (int d : shape) count *= (size_t)d;
  if (count == 0) {
    return mx::zeros(shape, out_dtype, stream);
  }
  mx::array xf = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, stream);
  // Few rows (decode) read a float16 weight in place, widening as they go:
  // half the bytes per step, the same products.
  const size_t rows = count / (size_t)w.shape(0);
  const bool keep_f16 = w.dtype() == mx::float16 && rows < (size_t)kDensePanelMinRows;
  mx::array wf = w.dtype() == mx::float32 || keep_f16 ? w : mx::astype(w, mx::float32, stream);
  mx::array y = mx::array(shape, mx::float32,
                          std::make_shared<QuantizedGemm>(stream, 0, 0, QuantizedGemm::Kind::Dense, isa_for(path, 0)),
                          {xf, detail::row_contiguous(wf, stream)});
  return y.dtype() == out_dtype ? y : mx::astype(y, out_dtype, stream);
}

namespace detail {

namespace {

GemmJob job_of(const QuantizedView& w, const float* const* rows, int m, float* y, Path path) {
  if (!valid_layout(w.group, w.bits)) {
    throw std::invalid_argument("[mlxcel::kernels::quantized_gemm] bits " + std::to_string(w.bits) + ", group " +
                                std::to_string(w.group) + " is not a GEMM layout");
  }
  GemmJob j;
  j.M = m;
  j.N = w.n;
  j.K = w.k;
  j.Kp = (j.K + 31) / 32 * 32;
  j.bits = w.bits;
  j.group = w.group;
  j.G = w.k / w.group;
  j.wpr = w.k * w.bits / 32;
  j.sty = w.scale_type;
  j.w = reinterpret_cast<const uint32_t*>(w.weight);
  j.scales = w.scales;
  j.biases = w.biases;
  j.isa = isa_for(path, w.bits, w.group);
  j.rows = rows;
  j.y = y;
  return j;
}

std::vector<const float*> row_pointers(const float* x, int m, int k) {
  std::vector<const float*> rows(m);
  for (int r = 0; r < m; ++r) rows[r] = x + (size_t)r * k;
  return rows;
}

}  // namespace

void quantized_gemm_f32(const QuantizedView& w, const float* x, int m, float* y, Path path) {
  if (m == 0 || w.n == 0) return;
  const std::vector<const float*> rows = row_pointers(x, m, w.k);
  GemmJob j = job_of(w, rows.data(), m, y, path);
  run_gemm(j);
}

void quantized_gemm_f32_many(const QuantizedView* ws, int count, const float* x, int m, float* const* ys, Path path) {
  if (m == 0 || count <= 0) return;
  const std::vector<const float*> rows = row_pointers(x, m, ws[0].k);
  struct Many {
    std::vector<GemmJob> jobs;
    std::vector<long> first;  // each job's first task in the joint numbering
  } many;
  long tasks = 0;
  for (int i = 0; i < count; ++i) {
    if (ws[i].k != ws[0].k) throw std::invalid_argument("[mlxcel::kernels::quantized_gemm] weights differ in K");
    if (ws[i].n == 0) continue;
    GemmJob j = job_of(ws[i], rows.data(), m, ys[i], path);
    if (j.isa == Isa::Amx) {  // AMX splits x per call
      run_gemm(j);
      continue;
    }
    plan_gemm(j);
    many.first.push_back(tasks);
    many.jobs.push_back(j);
    tasks += (long)j.mblocks * j.npanels;
  }
  if (many.jobs.empty()) return;
  if (tasks > 0xffff) {
    for (const GemmJob& j : many.jobs) dispatch_gemm(j);
    return;
  }
  detail::parallel_for(
      (int)tasks,
      [](void* c, int t) {
        auto* mj = static_cast<Many*>(c);
        const int i = (int)(std::upper_bound(mj->first.begin(), mj->first.end(), t) - mj->first.begin()) - 1;
        task_fn(&mj->jobs[i], (int)(t - mj->first[i]));
      },
      &many);
}

}  // namespace detail

}  // namespace mlxcel::kernels
