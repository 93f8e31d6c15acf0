// Vectorized math and word transposes shared by the kernels (internal). x86-64 only
// (MLXCEL_X86): elsewhere the kernels' portable loops use std::exp.
#pragma once

#include "cpu_features.h"

#ifdef MLXCEL_X86
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace mlxcel::kernels::simd {

// The sum of the 8 lanes.
__attribute__((target("avx2,fma"), always_inline)) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of the 8 lanes.
__attribute__((target("avx2,fma"), always_inline)) inline float hmax256(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// e^x for 16 floats, within ~2 ulp over the normal range (Cephes' expf
// polynomial on x - n ln 2, then 2^n by scalef). Inputs below -88 (and -inf)
// give exactly 0, inputs above 88.7 give +inf; NaN stays NaN.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp512(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.7228f);
  const __m512 lo = _mm512_set1_ps(-88.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
  __m512 e = _mm512_scalef_ps(y, n);
  // x > 88.7228 (including +inf) overflows; NaN inputs propagate through xc? No:
  // min/max drop NaN, so restore it explicitly.
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), _mm512_set1_ps(__builtin_inff()));
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
  return _mm512_maskz_mov_ps((__mmask16)~tiny, e);
}

// e^x for 8 floats, the polynomial of exp512; inputs are clamped to [-88, 88.7]
// (below -87.3 the result is 0 or tiny, not denormal; NaN is not preserved).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp256(__m256 x) {
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.7228f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  // 2^n: n + 127 in the exponent bits (n in [-127, 128] after the clamp).
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// An 8x8 block of 32-bit lanes transposed in registers: on return v[t]
// holds lane t of the inputs v[0..7] (24 shuffles).
__attribute__((target("avx2"), always_inline)) inline void transpose8x8(__m256i (&v)[8]) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_permute2x128_si256(b[k], b[k + 4], 0x20);
    v[k + 4] = _mm256_permute2x128_si256(b[k], b[k + 4], 0x31);
  }
}

// Words at .. at+7 of 8 rows (row l from rows[l]; words past `valid` read
// as zero) transposed: t[k] = word at+k of every row, row l in lane l.
__attribute__((target("avx2"), always_inline)) inline void transpose8_words(const uint32_t* const* rows, size_t at,
                                                                          int valid, __m256i (&t)[8]) {
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane);
  for (int l = 0; l < 8; ++l) {
    const auto* p = reinterpret_cast<const int*>(rows[l] + at);
    t[l] = valid == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskload_epi32(p, mask);
  }
  transpose8x8(t);
}

// Words at .. at+7 of 16 rows (row l from rows[l]; the words past `valid`
// read as zero) as t[k] = word at+k of every row, row l in lane l.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline)) inline void
transpose16_words(const uint32_t* const (&rows)[16], size_t at, __mmask8 valid, __m512i (&t)[8]) {
  // Rows i and i + 8 in the low and high 256 bits; then an 8 x 8 transpose
  // of 32-bit words within each half.
  __m512i r[8], u[8], s[8];
  __m256i w[16];
  for (int l = 0; l < 16; ++l) {
    w[l] = valid == 0xff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[l] + at))
                         : _mm256_maskz_loadu_epi32(valid, rows[l] + at);
  }
  for (int i = 0; i < 8; ++i) r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(w[i]), w[i + 8], 1);
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    u[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // s[k] (and s[k + 4], rows 4-7 and 12-15): word k of rows 0-3 | word k+4
  // of rows 0-3 | word k of rows 8-11 | word k+4 of rows 8-11.
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
    s[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
    s[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
    s[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
  }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_permutex2var_epi64(s[k], first, s[k + 4]);
    t[k + 4] = _mm512_permutex2var_epi64(s[k], second, s[k + 4]);
  }
}

}  // namespace mlxcel::kernels::simd

#endif  // MLXCEL_X86
