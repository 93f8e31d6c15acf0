// See causal_attention.h.
//
// Evaluation, per call:
//  1. Pack each (batch, KV head): K transposed in tiles of 32 keys (16
//     without AVX-512), each tile's [D][32] contiguous, up to S_pad = S
//     rounded up to 32 (zero-filled), and V to vp[S][D], in parallel over the
//     KV heads.
//  2. Tasks of 8 query rows of one head, largest (latest) blocks first. A
//     task copies its rows of q times `scale`, computes scores against keys
//     0 .. nk-1 (nk = the last row's limit + 1) in 8x32 tiles, sets the
//     masked ones to -inf, runs the softmax per row, then accumulates
//     probabilities times values in 8x32 tiles and writes out[b, i, h, :].
//     Without AVX-512 the same task runs with 4x16 tiles
//     (attention_generic.inc: AVX2 + FMA, or portable vector code).

#include "causal_attention.h"

#include "cpu_features.h"
#include "detail.h"
#include "kv_q8.h"

#ifdef MLXCEL_X86
#include "simd_math.h"
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
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

constexpr int QR = 8;   // query rows per task
constexpr int KC = 32;  // keys (or value features) per tile

enum class Isa : int { Portable = 0, Avx2 = 1, Avx512 = 2 };

struct AlignedFloats {
  float* p = nullptr;
  size_t cap = 0;
  float* get(size_t n) {
    if (n > cap) {
      std::free(p);
      cap = (n + 15) & ~size_t(15);
      p = static_cast<float*>(std::aligned_alloc(64, cap * sizeof(float)));
      if (!p) {
        cap = 0;
        throw std::bad_alloc();
      }
    }
    return p;
  }
  ~AlignedFloats() { std::free(p); }
};

// Element strides of a rank-4 array.
struct Strides4 {
  int64_t s[4];
};

struct AttnJob {
  int B = 0, H = 0, Hkv = 0, L = 0, S = 0, D = 0, S_pad = 0;
  float scale = 1.0f;
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  Strides4 qs{}, ks{}, vs{};
  // K transposed in tiles of key_tile(isa) keys: [B * Hkv][S_pad / tile][D][tile].
  float* kt = nullptr;
  float* vp = nullptr;  // [B * Hkv][S][D]
  float* out = nullptr; // [B, L, H, D]
  int qblocks = 0;
  Isa isa = Isa::Portable;
  // False: every query sees every key (an encoder, cross-attention).
  bool causal = true;
  // A paged k and v: pools [Hkv, blocks, block, D], position s of the
  // sequence at block table[s / block], row s % block (B is 1).
  const int32_t* table = nullptr;
  int block = 0, blocks = 0;
  // A sliding window (paged only): query p sees [0, keep) and
  // [p + 1 - window, p]. The keys are packed without the run [split,
  // split + gap) that no query of the call sees (gap a multiple of KC, so a
  // key keeps its lane and a row's sums their order however the prompt is
  // chunked), and positions [hidden_lo, hidden_hi) are packed as zeros
  // (hidden from every query; their blocks may be gone).
  int window = 0, keep = 0, split = 0, gap = 0, hidden_lo = 0, hidden_hi = 0;
  // An 8-bit pool (kv_q8.h; k and v then unused): layer `layer` of it.
  const uint8_t* q8 = nullptr;
  detail::KvQ8Layout q8_layout;
  int layer = 0;
};

// Hides from each of the QR rows of the task at i0 (rows past `rows` repeat
// the last) the packed keys [keep, lo) below its window.
void hide_below_window(const AttnJob& j, int i0, int rows, float* sc) {
  if (j.window <= 0) return;
  for (int r = 0; r < QR; ++r) {
    const int position = j.S + j.gap - j.L + i0 + std::min(r, rows - 1);
    const int lo = detail::KvWindowRule{j.window, j.keep}.first_recent(position + 1);
    const int packed_lo = lo >= j.split + j.gap ? lo - j.gap : std::min(lo, j.split);
    float* row = sc + (size_t)r * j.S_pad;
    for (int k = j.keep; k < packed_lo; ++k) row[k] = -std::numeric_limits<float>::infinity();
  }
}

struct TaskScratch {
  AlignedFloats q, sc;
};
thread_local TaskScratch tl_attn;

// Keys per tile of the packed K: the width of the score tiles of each ISA's
// attend (8x32 with AVX-512, 4x16 otherwise).
int key_tile(Isa isa) { return isa == Isa::Avx512 ? KC : 16; }

// Key row `s` (packed position) of KV head `h` as D contiguous floats: in
// place when the source has unit stride, else staged into `stage_k`; value
// row `s` written to `v_out`. Positions hidden from every query read as zeros.
const float* kv_row(const AttnJob& j, int b, int h, int s, const float* zeros, float* stage_k, float* v_out) {
  const int D = j.D;
  const int position = s >= j.split ? s + j.gap : s;
  if (position >= j.hidden_lo && position < j.hidden_hi) {
    std::memset(v_out, 0, sizeof(float) * D);
    return zeros;
  }
  if (j.q8) {
    const uint8_t* block = j.q8 + (size_t)j.table[position / j.block] * j.q8_layout.block_bytes();
    const int row = position % j.block;
    using detail::kv_q8_row;
    detail::kv_q8_dequantize(kv_q8_row(block + j.q8_layout.section(j.layer, 0, h), j.q8_layout, row), D, stage_k);
    detail::kv_q8_dequantize(kv_q8_row(block + j.q8_layout.section(j.layer, 1, h), j.q8_layout, row), D, v_out);
    return stage_k;
  }
  const float *kr, *vr;
  int64_t kd = j.ks.s[3], vd = j.vs.s[3];
  if (j.table) {
    const size_t at = (((size_t)h * j.blocks + j.table[position / j.block]) * j.block + position % j.block) * D;
    kr = j.k + at;
    vr = j.v + at;
    kd = vd = 1;
  } else {
    kr = j.k + b * j.ks.s[0] + h * j.ks.s[1] + s * j.ks.s[2];
    vr = j.v + b * j.vs.s[0] + h * j.vs.s[1] + s * j.vs.s[2];
  }
  if (vd == 1) {
    std::memcpy(v_out, vr, sizeof(float) * D);
  } else {
    for (int d = 0; d < D; ++d) v_out[d] = vr[d * vd];
  }
  if (kd == 1) return kr;
  for (int d = 0; d < D; ++d) stage_k[d] = kr[d * kd];
  return stage_k;
}

// kt[d * ldk + r] = rows[r][d] for 8 rows and d < D (D a multiple of 8).
void transpose_rows_portable(const float* const (&rows)[8], int D, float* kt, size_t ldk) {
  for (int d = 0; d < D; ++d) {
    for (int r = 0; r < 8; ++r) kt[(size_t)d * ldk + r] = rows[r][d];
  }
}

#ifdef MLXCEL_X86
__attribute__((target("avx2"))) void transpose_rows_avx2(const float* const (&rows)[8], int D, float* kt, size_t ldk) {
  for (int d0 = 0; d0 < D; d0 += 8) {
    __m256i v[8];
    for (int r = 0; r < 8; ++r) v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + d0));
    simd::transpose8x8(v);
    for (int t = 0; t < 8; ++t) _mm256_storeu_si256(reinterpret_cast<__m256i*>(kt + (size_t)(d0 + t) * ldk), v[t]);
  }
}
#endif

// Packs KV head t: keys transposed into tiles of key_tile(isa) keys (8 keys
// at a time; keys past S zero), values to vp[S][D].
void pack_kv(void* ctx, int t) {
  const AttnJob& j = *static_cast<const AttnJob*>(ctx);
  const int b = t / j.Hkv, h = t % j.Hkv, D = j.D, T = key_tile(j.isa);
  float* kt = j.kt + (size_t)t * D * j.S_pad;
  float* vp = j.vp + (size_t)t * j.S * D;
  // 8 staged key rows, then one row of zeros.
  static thread_local AlignedFloats stage;
  float* stage_k = stage.get((size_t)9 * D);
  float* zeros = stage_k + (size_t)8 * D;
  std::memset(zeros, 0, sizeof(float) * D);
  for (int s0 = 0; s0 < j.S; s0 += 8) {
    const float* rows[8];
    for (int r = 0; r < 8; ++r) {
      const int s = s0 + r;
      rows[r] = s < j.S ? kv_row(j, b, h, s, zeros, stage_k + (size_t)r * D, vp + (size_t)s * D) : zeros;
    }
    float* tile = kt + (size_t)(s0 / T) * D * T + s0 % T;
#ifdef MLXCEL_X86
    if (j.isa != Isa::Portable) {
      transpose_rows_avx2(rows, D, tile, T);
      continue;
    }
#endif
    transpose_rows_portable(rows, D, tile, T);
  }
  const int packed = (j.S + 7) / 8 * 8;
  for (int d = 0; d < D; ++d) {
    for (int s = packed; s < j.S_pad; ++s) kt[((size_t)(s / T) * D + d) * T + s % T] = 0.0f;
  }
}

#ifdef MLXCEL_X86
#define MLXCEL_ATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// out[r][0:32] (row stride ldo; the second half only when `two`) =
// sum_key p[r][key] * v[key][0:32] for the first `rows` of 8 rows (p row
// stride ldp, v row stride ldv). Explicit registers: 16 accumulators.
MLXCEL_ATTN_TARGET void pv_tile(const float* p, size_t ldp, const float* v, int ldv, int nk, float* out, size_t ldo,
                                int rows, bool two) {
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(), c10 = _mm512_setzero_ps(), c11 = _mm512_setzero_ps();
  __m512 c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps(), c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps();
  __m512 c40 = _mm512_setzero_ps(), c41 = _mm512_setzero_ps(), c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
  __m512 c60 = _mm512_setzero_ps(), c61 = _mm512_setzero_ps(), c70 = _mm512_setzero_ps(), c71 = _mm512_setzero_ps();
  const float *p0 = p, *p1 = p + ldp, *p2 = p + 2 * ldp, *p3 = p + 3 * ldp;
  const float *p4 = p + 4 * ldp, *p5 = p + 5 * ldp, *p6 = p + 6 * ldp, *p7 = p + 7 * ldp;
  const __mmask16 m1 = two ? (__mmask16)0xffff : (__mmask16)0;
#pragma GCC unroll 4
  for (int key = 0; key < nk; ++key) {
    const float* vr = v + (size_t)key * ldv;
    const __m512 v0 = _mm512_loadu_ps(vr);
    const __m512 v1 = _mm512_maskz_loadu_ps(m1, vr + 16);
    __m512 x;
    x = _mm512_set1_ps(p0[key]); c00 = _mm512_fmadd_ps(x, v0, c00); c01 = _mm512_fmadd_ps(x, v1, c01);
    x = _mm512_set1_ps(p1[key]); c10 = _mm512_fmadd_ps(x, v0, c10); c11 = _mm512_fmadd_ps(x, v1, c11);
    x = _mm512_set1_ps(p2[key]); c20 = _mm512_fmadd_ps(x, v0, c20); c21 = _mm512_fmadd_ps(x, v1, c21);
    x = _mm512_set1_ps(p3[key]); c30 = _mm512_fmadd_ps(x, v0, c30); c31 = _mm512_fmadd_ps(x, v1, c31);
    x = _mm512_set1_ps(p4[key]); c40 = _mm512_fmadd_ps(x, v0, c40); c41 = _mm512_fmadd_ps(x, v1, c41);
    x = _mm512_set1_ps(p5[key]); c50 = _mm512_fmadd_ps(x, v0, c50); c51 = _mm512_fmadd_ps(x, v1, c51);
    x = _mm512_set1_ps(p6[key]); c60 = _mm512_fmadd_ps(x, v0, c60); c61 = _mm512_fmadd_ps(x, v1, c61);
    x = _mm512_set1_ps(p7[key]); c70 = _mm512_fmadd_ps(x, v0, c70); c71 = _mm512_fmadd_ps(x, v1, c71);
  }
  const __m512 acc[QR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},
                             {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
  for (int r = 0; r < rows; ++r) {
    _mm512_storeu_ps(out + (size_t)r * ldo, acc[r][0]);
    _mm512_mask_storeu_ps(out + (size_t)r * ldo + 16, m1, acc[r][1]);
  }
}

// acc[r][0:32] = sum_d q[r][d] * kt[d][0:32] for 8 rows (q row stride D,
// kt row stride ldk), then keys past each row's limit set to -inf, stored
// into sc (row stride lds). Explicit registers: 16 accumulators.
MLXCEL_ATTN_TARGET void score_tile(const float* q, int D, const float* kt, size_t ldk, int key0, const int* lim,
                                   float* sc, size_t lds) {
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(), c10 = _mm512_setzero_ps(), c11 = _mm512_setzero_ps();
  __m512 c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps(), c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps();
  __m512 c40 = _mm512_setzero_ps(), c41 = _mm512_setzero_ps(), c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps();
  __m512 c60 = _mm512_setzero_ps(), c61 = _mm512_setzero_ps(), c70 = _mm512_setzero_ps(), c71 = _mm512_setzero_ps();
  const float *q0 = q, *q1 = q + D, *q2 = q + 2 * D, *q3 = q + 3 * D;
  const float *q4 = q + 4 * D, *q5 = q + 5 * D, *q6 = q + 6 * D, *q7 = q + 7 * D;
#pragma GCC unroll 4
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_load_ps(kt + (size_t)d * ldk);
    const __m512 k1 = _mm512_load_ps(kt + (size_t)d * ldk + 16);
    __m512 x;
    x = _mm512_set1_ps(q0[d]); c00 = _mm512_fmadd_ps(x, k0, c00); c01 = _mm512_fmadd_ps(x, k1, c01);
    x = _mm512_set1_ps(q1[d]); c10 = _mm512_fmadd_ps(x, k0, c10); c11 = _mm512_fmadd_ps(x, k1, c11);
    x = _mm512_set1_ps(q2[d]); c20 = _mm512_fmadd_ps(x, k0, c20); c21 = _mm512_fmadd_ps(x, k1, c21);
    x = _mm512_set1_ps(q3[d]); c30 = _mm512_fmadd_ps(x, k0, c30); c31 = _mm512_fmadd_ps(x, k1, c31);
    x = _mm512_set1_ps(q4[d]); c40 = _mm512_fmadd_ps(x, k0, c40); c41 = _mm512_fmadd_ps(x, k1, c41);
    x = _mm512_set1_ps(q5[d]); c50 = _mm512_fmadd_ps(x, k0, c50); c51 = _mm512_fmadd_ps(x, k1, c51);
    x = _mm512_set1_ps(q6[d]); c60 = _mm512_fmadd_ps(x, k0, c60); c61 = _mm512_fmadd_ps(x, k1, c61);
    x = _mm512_set1_ps(q7[d]); c70 = _mm512_fmadd_ps(x, k0, c70); c71 = _mm512_fmadd_ps(x, k1, c71);
  }
  const __m512 acc[QR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},
                             {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i kv0 = _mm512_add_epi32(lane, _mm512_set1_epi32(key0));
  const __m512i kv1 = _mm512_add_epi32(kv0, _mm512_set1_epi32(16));
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < QR; ++r) {
    const __m512i l = _mm512_set1_epi32(lim[r]);
    _mm512_store_ps(sc + (size_t)r * lds, _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(kv0, l), neg_inf, acc[r][0]));
    _mm512_store_ps(sc + (size_t)r * lds + 16, _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(kv1, l), neg_inf, acc[r][1]));
  }
}

MLXCEL_ATTN_TARGET void attend(const AttnJob& j, int t) {
  const int bh = t % (j.B * j.H);
  const int qb = j.qblocks - 1 - t / (j.B * j.H);
  const int b = bh / j.H, h = bh % j.H;
  const int kvh = h / (j.H / j.Hkv);
  const int D = j.D, S_pad = j.S_pad;
  const int i0 = qb * QR;
  const int rows = std::min(QR, j.L - i0);
  const int lim0 = j.causal ? j.S - j.L + i0 : j.S - 1;  // last key row 0 may see
  const int nk = j.causal ? lim0 + rows : j.S;             // keys any row of the block sees
  const int nk_pad = (nk + KC - 1) / KC * KC;
  const float* kt = j.kt + (size_t)(b * j.Hkv + kvh) * D * S_pad;
  const float* vp = j.vp + (size_t)(b * j.Hkv + kvh) * j.S * D;

  TaskScratch& ts = tl_attn;
  float* qs = ts.q.get((size_t)QR * D);
  float* sc = ts.sc.get((size_t)QR * S_pad);
  // Rows past the end repeat the last row (computed, never stored).
  for (int r = 0; r < QR; ++r) {
    const int i = i0 + std::min(r, rows - 1);
    const float* qr = j.q + b * j.qs.s[0] + h * j.qs.s[1] + i * j.qs.s[2];
    for (int d = 0; d < D; ++d) qs[r * D + d] = qr[d * j.qs.s[3]] * j.scale;
  }

  // Scores.
  int lim[QR];
  for (int r = 0; r < QR; ++r) lim[r] = j.causal ? lim0 + std::min(r, rows - 1) : lim0;
  for (int j0 = 0; j0 < nk_pad; j0 += KC) score_tile(qs, D, kt + (size_t)j0 * D, KC, j0, lim, sc + j0, S_pad);
  hide_below_window(j, i0, rows, sc);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  // Softmax per row: max, exp(x - max), sum, times 1 / sum.
  for (int r = 0; r < QR; ++r) {
    float* s = sc + (size_t)r * S_pad;
    __m512 mx = neg_inf;
    for (int c = 0; c < nk_pad; c += 16) mx = _mm512_max_ps(mx, _mm512_load_ps(s + c));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < nk_pad; c += 16) {
      const __m512 e = simd::exp512(_mm512_sub_ps(_mm512_load_ps(s + c), m));
      _mm512_store_ps(s + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int c = 0; c < nk_pad; c += 16) _mm512_store_ps(s + c, _mm512_mul_ps(_mm512_load_ps(s + c), inv));
  }

  // Probabilities times values, 32 (or a last 16) features at a time.
  for (int dc = 0; dc < D; dc += KC) {
    float* o = j.out + (((size_t)b * j.L + i0) * j.H + h) * D + dc;
    pv_tile(sc, S_pad, vp + dc, D, nk, o, (size_t)j.H * D, rows, dc + 16 < D);
  }
}

#endif  // MLXCEL_X86

#ifdef MLXCEL_X86
namespace avx2 {
#define MLXCEL_VEC8_AVX2
#include "attention_generic.inc"
#undef MLXCEL_VEC8_AVX2
}  // namespace avx2
#endif

namespace portable {
#include "attention_generic.inc"
}  // namespace portable

void attend_task(void* ctx, int t) {
  const AttnJob& j = *static_cast<const AttnJob*>(ctx);
  switch (j.isa) {
#ifdef MLXCEL_X86
    case Isa::Avx512: attend(j, t); return;
    case Isa::Avx2: avx2::attend(j, t); return;
#endif
    default: portable::attend(j, t); return;
  }
}

// The loops this process runs: the best the CPU has, capped by MLXCEL_KERNELS.
Isa attention_isa() {
  const Path p = resolve_path(Path::Auto);
  const auto& cpu = cpu::features();
  if ((p == Path::Avx512 || p == Path::Avx512Vnni) && cpu.avx512) return Isa::Avx512;
  if (p != Path::Portable && cpu.avx2) return Isa::Avx2;
  return Isa::Portable;
}

void attend_few_task(void* ctx, int t) {
  const AttnJob& j = *static_cast<const AttnJob*>(ctx);
#ifdef MLXCEL_X86
  if (j.isa != Isa::Portable) {
    avx2::attend_few(j, t);
    return;
  }
#endif
  portable::attend_few(j, t);
}

// Runs the attention tasks of `j` (its pointers set) in the evaluating
// thread's scratch buffers.
void run_attention(AttnJob& j) {
  // A few unmasked rows (decoding against an encoder): read k and v in place.
  if (!j.causal && j.L <= 4 && !j.table && !j.q8 && j.window == 0 && j.ks.s[3] == 1 && j.vs.s[3] == 1) {
    detail::parallel_for(j.B * j.H, attend_few_task, &j);
    return;
  }
  // The packed K and V live in the evaluating thread's buffers, reused
  // across calls (one evaluation at a time per thread).
  static thread_local AlignedFloats kt, vv;
  j.kt = kt.get((size_t)j.B * j.Hkv * j.D * j.S_pad);
  j.vp = vv.get((size_t)j.B * j.Hkv * j.S * j.D);
  detail::parallel_for(j.B * j.Hkv, pack_kv, &j);
  detail::parallel_for(j.B * j.H * j.qblocks, attend_task, &j);
}

class CausalAttention : public mx::UnaryPrimitive {
 public:
  CausalAttention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& q = inputs[0];
    const mx::array& k = inputs[1];
    const mx::array& v = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    AttnJob j;
    j.B = q.shape(0);
    j.H = q.shape(1);
    j.L = q.shape(2);
    j.D = q.shape(3);
    j.Hkv = k.shape(1);
    j.S = k.shape(2);
    j.S_pad = (j.S + KC - 1) / KC * KC;
    j.scale = scale_;
    j.causal = causal_;
    j.qblocks = (j.L + QR - 1) / QR;
    j.isa = attention_isa();
    for (int d = 0; d < 4; ++d) {
      j.qs.s[d] = q.strides()[d];
      j.ks.s[d] = k.strides()[d];
      j.vs.s[d] = v.strides()[d];
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(q);
    enc.set_input_array(k);
    enc.set_input_array(v);
    enc.set_output_array(out);
    enc.dispatch([j, qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(),
                  op = out.data<float>()]() mutable {
      if (out_empty(j)) return;
      j.q = qp;
      j.k = kp;
      j.v = vp;
      j.out = op;
      run_attention(j);
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    throw std::runtime_error("[mlxcel::kernels::CausalAttention] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelCausalAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CausalAttention*>(&other);
    return o && o->scale_ == scale_ && o->causal_ == causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& q = inputs[0];
    return {mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}};
  }

 private:
  static bool out_empty(const AttnJob& j) { return j.B == 0 || j.H == 0 || j.L == 0 || j.D == 0; }

  float scale_;
  bool causal_;
};

// Inputs q [1, H, L, D], k and v [1, Hkv, L, D] (the new positions), the key
// and value pools; outputs out [1, L, H, D] and the pools with the new
// positions written (in place when the pool inputs are dense).
class PagedCausalAttention : public mx::Primitive {
 public:
  PagedCausalAttention(mx::Stream stream, float scale, std::vector<int32_t> table, int offset, int window, int keep,
                       int layer)
      : mx::Primitive(stream),
        scale_(scale),
        table_(std::move(table)),
        offset_(offset),
        window_(window),
        keep_(keep),
        layer_(layer) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const bool q8 = inputs[3].dtype() == mx::uint8;
    bool copy[2];
    for (int c = 0; c < 2; ++c) {
      const mx::array& in = inputs[3 + c];
      // An 8-bit pool is dense (kv_pool_buffer_q8) and written in place only.
      copy[c] = !q8 && !(in.flags().row_contiguous && in.data_size() == in.size());
      if (copy[c]) {
        outputs[1 + c].set_data(mx::allocator::malloc(outputs[1 + c].nbytes()));
      } else {
        outputs[1 + c].copy_shared_buffer(in);
      }
    }
    const mx::array& pool = inputs[3];
    AttnJob j;
    j.B = 1;
    j.H = q.shape(1);
    j.L = q.shape(2);
    j.D = q.shape(3);
    j.Hkv = q8 ? pool.shape(3) : pool.shape(0);
    j.S = offset_ + j.L;
    if (window_ > 0) {
      // Every query of the call sees at least [0, keep) and [lo, S).
      j.window = window_;
      j.keep = std::min(keep_, j.S);
      const int lo = detail::KvWindowRule{window_, keep_}.first_recent(offset_ + 1);
      j.hidden_lo = j.keep;
      j.hidden_hi = lo;
      const int split = (j.keep + KC - 1) / KC * KC, resume = lo / KC * KC;
      if (resume > split) {
        j.split = split;
        j.gap = resume - split;
        j.S -= j.gap;
      }
    }
    j.S_pad = (j.S + KC - 1) / KC * KC;
    j.scale = scale_;
    j.qblocks = (j.L + QR - 1) / QR;
    j.isa = attention_isa();
    j.block = pool.shape(2);
    j.blocks = pool.shape(1);
    if (q8) {
      j.q8_layout = detail::KvQ8Layout{pool.shape(1), pool.shape(3), 0, j.D};
      j.q8_layout.block = (int)(pool.shape(4) / j.q8_layout.row_bytes());
      j.block = j.q8_layout.block;
      j.blocks = pool.shape(0);
      j.layer = layer_;
    }
    for (int d = 0; d < 4; ++d) j.qs.s[d] = q.strides()[d];
    Strides4 ks, vs, pks, pvs;
    for (int d = 0; d < 4; ++d) {
      ks.s[d] = k.strides()[d];
      vs.s[d] = v.strides()[d];
      pks.s[d] = q8 ? 0 : inputs[3].strides()[d];
      pvs.s[d] = q8 ? 0 : inputs[4].strides()[d];
    }
    const int pool_shape[4] = {pool.shape(0), pool.shape(1), pool.shape(2), pool.shape(3)};
    uint8_t* pool8 = q8 ? outputs[1].data<uint8_t>() : nullptr;
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    for (auto& a : outputs) enc.set_output_array(a);
    enc.dispatch([j, table = table_, offset = offset_, ks, vs, pks, pvs, copy_keys = copy[0], copy_values = copy[1],
                  pool_shape, qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(),
                  pk_in = inputs[3].data<float>(), pv_in = inputs[4].data<float>(), op = out.data<float>(),
                  pk = outputs[1].data<float>(), pv = outputs[2].data<float>(), pool8]() mutable {
      if (copy_keys) copy_strided(pk_in, pks, pk, pool_shape);
      if (copy_values) copy_strided(pv_in, pvs, pv, pool_shape);
      // The new positions into their blocks.
      if (pool8) {
        std::vector<float> row(j.D);
        for (int h = 0; h < j.Hkv; ++h) {
          for (int l = 0; l < j.L; ++l) {
            const int t = offset + l;
            uint8_t* block = pool8 + (size_t)table[t / j.block] * j.q8_layout.block_bytes();
            for (int c = 0; c < 2; ++c) {
              const float* src = c == 0 ? kp + h * ks.s[1] + l * ks.s[2] : vp + h * vs.s[1] + l * vs.s[2];
              const int64_t step = c == 0 ? ks.s[3] : vs.s[3];
              for (int d = 0; d < j.D; ++d) row[d] = src[d * step];
              detail::kv_q8_quantize(row.data(), j.D,
                                     detail::kv_q8_row(block + j.q8_layout.section(j.layer, c, h), j.q8_layout, t % j.block));
            }
          }
        }
        j.q8 = pool8;
      }
      for (int h = 0; h < (pool8 ? 0 : j.Hkv); ++h) {
        for (int l = 0; l < j.L; ++l) {
          const int t = offset + l;
          const size_t at = (((size_t)h * j.blocks + table[t / j.block]) * j.block + t % j.block) * j.D;
          for (int d = 0; d < j.D; ++d) {
            pk[at + d] = kp[h * ks.s[1] + l * ks.s[2] + d * ks.s[3]];
            pv[at + d] = vp[h * vs.s[1] + l * vs.s[2] + d * vs.s[3]];
          }
        }
      }
      j.q = qp;
      j.k = pk;
      j.v = pv;
      j.table = table.data();
      j.out = op;
      run_attention(j);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[mlxcel::kernels::PagedCausalAttention] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelPagedCausalAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const PagedCausalAttention*>(&other);
    return o && o->scale_ == scale_ && o->table_ == table_ && o->offset_ == offset_ && o->window_ == window_ &&
           o->keep_ == keep_ && o->layer_ == layer_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& q = inputs[0];
    return {mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}, inputs[3].shape(), inputs[4].shape()};
  }

 private:
  static void copy_strided(const float* src, const Strides4& st, float* dst, const int (&shape)[4]) {
    for (int a = 0; a < shape[0]; ++a)
      for (int b = 0; b < shape[1]; ++b)
        for (int c = 0; c < shape[2]; ++c)
          for (int d = 0; d < shape[3]; ++d) *dst++ = src[a * st.s[0] + b * st.s[1] + c * st.s[2] + d * st.s[3]];
  }

  float scale_;
  std::vector<int32_t> table_;
  int offset_, window_, keep_, layer_;
};

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("[mlxcel::kernels::paged_causal_attention] " + message);
}

}  // namespace

namespace {
// Shapes and dtypes the kernel takes, whatever the mask.
bool kernel_takes(const mx::array& q, const mx::array& k, const mx::array& v) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) return false;
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) return false;
  const int D = q.shape(3);
  if (D <= 0 || D % 16 != 0 || k.shape(3) != D || v.shape(3) != D) return false;
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2)) {
    return false;
  }
  const int H = q.shape(1), Hkv = k.shape(1);
  return Hkv > 0 && H % Hkv == 0 && q.shape(2) > 0 && k.shape(2) > 0;
}
}  // namespace

bool causal_attention_supports(const mx::array& q, const mx::array& k, const mx::array& v) {
  return kernel_takes(q, k, v) && k.shape(2) >= q.shape(2);
}

bool attention_supports(const mx::array& q, const mx::array& k, const mx::array& v, bool causal) {
  return causal ? causal_attention_supports(q, k, v) : kernel_takes(q, k, v);
}

mx::array causal_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                           mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || !causal_attention_supports(q, k, v)) {
    return mx::fast::scaled_dot_product_attention(q, k, v, scale, "causal", {}, {}, false, stream);
  }
  mx::array out(mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}, mx::float32,
                std::make_shared<CausalAttention>(stream, scale, true), {q, k, v});
  return mx::transpose(out, {0, 2, 1, 3}, stream);
}

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                    mx::StreamOrDevice s) {
  if (causal) return causal_attention(q, k, v, scale, s);
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || !attention_supports(q, k, v, false)) {
    return mx::fast::scaled_dot_product_attention(q, k, v, scale, "", {}, {}, false, stream);
  }
  mx::array out(mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}, mx::float32,
                std::make_shared<CausalAttention>(stream, scale, false), {q, k, v});
  return mx::transpose(out, {0, 2, 1, 3}, stream);
}

std::vector<mx::array> paged_causal_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                              const mx::array& pool_keys, const mx::array& pool_values,
                                              const std::vector<int32_t>& table, int offset, float scale,
                                              int window, int keep, int layer, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) fail("runs on the CPU only");
  auto shape = [](const mx::array& a) {
    std::string out = "[";
    for (int i = 0; i < (int)a.ndim(); ++i) out += (i ? ", " : "") + std::to_string(a.shape(i));
    return out + "]";
  };
  const bool q8 = pool_keys.dtype() == mx::uint8;
  for (const auto* a : {&q, &k, &v, &pool_keys, &pool_values}) {
    if (q8 && (a == &pool_keys || a == &pool_values)) continue;
    if (a->dtype() != mx::float32 || a->ndim() != 4) fail("q, k, v and the pools must be float32 of rank 4");
  }
  const int H = q.shape(1), L = q.shape(2), D = q.shape(3);
  if (q.shape(0) != 1 || L < 1 || D % 16 != 0) fail("q must be [1, H, L >= 1, D % 16 == 0], got " + shape(q));
  int Hkv = 0, block = 0, blocks = 0;
  if (q8) {
    if (pool_keys.id() != pool_values.id()) fail("an 8-bit pool must be passed as both the keys and the values pool");
    if (D % detail::kKvQ8Group != 0) fail("an 8-bit KV pool needs head_dim a multiple of 64; got " + std::to_string(D));
    const detail::KvQ8Layout layout{0, 0, 0, D};
    if (pool_keys.ndim() != 5 || pool_keys.shape(2) != 2 || pool_keys.shape(4) % (int64_t)layout.row_bytes() != 0) {
      fail("an 8-bit pool must be uint8 [blocks, layers, 2, kv_heads, block * " + std::to_string(layout.row_bytes()) +
           "], got " + shape(pool_keys));
    }
    Hkv = pool_keys.shape(3);
    block = (int)(pool_keys.shape(4) / (int64_t)layout.row_bytes());
    blocks = pool_keys.shape(0);
    if (layer < 0 || layer >= pool_keys.shape(1)) {
      fail("layer " + std::to_string(layer) + " is outside the 8-bit pool's " + std::to_string(pool_keys.shape(1)) +
           " layers");
    }
  } else {
    Hkv = pool_keys.shape(0);
    block = pool_keys.shape(2);
    blocks = pool_keys.shape(1);
  }
  if (block < 8 || (block & (block - 1)) != 0 || Hkv < 1 || H % Hkv != 0 ||
      (!q8 && (pool_keys.shape() != pool_values.shape() || pool_keys.shape(3) != D))) {
    fail("pools must both be [kv_heads dividing " + std::to_string(H) + ", blocks, block (a power of two >= 8), " +
         std::to_string(D) + "], got " + shape(pool_keys) + " and " + shape(pool_values));
  }
  for (const auto* a : {&k, &v}) {
    if (a->shape() != mx::Shape{1, Hkv, L, D}) fail("k and v must be [1, " + std::to_string(Hkv) + ", " + std::to_string(L) + ", " + std::to_string(D) + "], got " + shape(*a));
  }
  if (offset < 0 || (int64_t)table.size() * block < (int64_t)offset + L) {
    fail("the block table holds " + std::to_string(table.size() * block) + " positions, " +
         std::to_string(offset + L) + " needed");
  }
  if (window < 0 || keep < 0) fail("window and keep must be non-negative");
  // Blocks that no new token sees (below the window) may be -1.
  const detail::KvWindowRule rule{window, keep};
  for (size_t i = 0; i < table.size(); ++i) {
    if ((table[i] < 0 && !(table[i] == -1 && rule.hides_block((int64_t)i, block, offset + 1))) ||
        table[i] >= blocks) {
      fail("block id " + std::to_string(table[i]) + " at table index " + std::to_string(i) + " is outside the pool");
    }
  }
  auto outs = mx::array::make_arrays({mx::Shape{1, L, H, D}, pool_keys.shape(), pool_values.shape()},
                                     {mx::float32, pool_keys.dtype(), pool_values.dtype()},
                                     std::make_shared<PagedCausalAttention>(stream, scale, table, offset, window, keep,
                                                                            layer),
                                     {q, k, v, pool_keys, pool_values});
  return {mx::transpose(outs[0], {0, 2, 1, 3}, stream), outs[1], outs[2]};
}

}  // namespace mlxcel::kernels
