// How many integer multiply-adds one core retires per second in the
// instructions the kernels' integer loops are built from, with no memory
// traffic: 8 independent accumulators (few enough to stay in registers),
// each fed one multiply instruction and (where the instruction does not
// accumulate) one add per step. A multiply that does not accumulate reads
// its own accumulator as an operand, so that the compiler cannot compute it
// once for all eight (the values wrap; only the rate matters). It tells
// whether a loop runs at its instructions' rate, and how two instruction
// choices compare on this CPU (AMD Zen 4: about 1.4 256-bit vpmaddwd + vpaddd
// a cycle, 1.8 multiplies a cycle in llama.cpp's vpmaddubsw + vpmaddwd step).
//
//   cc -O2 benches/int_dot_rate.c -o /tmp/int_dot_rate && /tmp/int_dot_rate
//
// Products per instruction: vpmaddwd 16 (int16 x int16, pairs summed into
// int32: the AVX2 integer loops), vpmaddubsw 32 (uint8 x int8, pairs summed
// into saturating int16: llama.cpp's AVX2 Q8 dot products, which then sum
// the int16 pairs into int32 with a vpmaddwd by ones), vpdpwssd 16 or
// 32 (ymm or zmm; the AVX-512 int16 loops), vpdpbusd 32 or 64 (the VNNI
// matvec).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define STEPS 100000000L
#define ACCS 8

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char* name, double seconds, int products, int sink) {
  const double instructions = (double)STEPS * ACCS;  // multiply steps
  printf("%-32s %6.2f G steps/s  %6.1f G products/s  (%d)\n", name, instructions / seconds / 1e9,
         instructions * products / seconds / 1e9, sink);
}

// Runs STEPS steps of `step` (an expression of acc[i], a and b) on the ACCS
// accumulators acc, first set to `init` (an expression of i), and reports
// the rate; `sink` reads the sums afterwards so that the loop stays. The
// empty asm keeps the compiler from treating a and b as constants; every
// step reads acc[i], so nothing in the loop can be computed once.
#define RATE(name, products, acc, init, a, b, step, sink)                      \
  do {                                                                         \
    for (int i = 0; i < ACCS; i++) acc[i] = (init);                            \
    __asm__ volatile("" : "+x"(a), "+x"(b));                                   \
    double t = cpu_seconds();                                                  \
    for (long n = 0; n < STEPS; n++) {                                         \
      _Pragma("GCC unroll 8") for (int i = 0; i < ACCS; i++) acc[i] = (step); \
    }                                                                          \
    t = cpu_seconds() - t;                                                     \
    report(name, t, products, (sink));                                         \
  } while (0)

__attribute__((target("avx2"))) static int sum256(const __m256i* acc) {
  __m256i s = acc[0];
  for (int i = 1; i < ACCS; i++) s = _mm256_add_epi32(s, acc[i]);
  return _mm256_extract_epi32(s, 0);
}

__attribute__((target("avx512f"))) static int sum512(const __m512i* acc) {
  __m512i s = acc[0];
  for (int i = 1; i < ACCS; i++) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

__attribute__((target("avx2"))) static void avx2_rates(void) {
  __m256i acc[ACCS], a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  RATE("vpmaddwd + vpaddd", 16, acc, _mm256_set1_epi32(i), a, b,
       _mm256_add_epi32(acc[i], _mm256_madd_epi16(acc[i], b)), sum256(acc));
  a = _mm256_set1_epi16(1);
  b = _mm256_set1_epi8(5);
  RATE("vpmaddubsw + vpaddw", 32, acc, _mm256_set1_epi32(i), a, b,
       _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(acc[i], b)), sum256(acc));
  // llama.cpp's whole AVX2 Q8 step: pairs into int16, then into int32 (a: ones).
  RATE("vpmaddubsw + vpmaddwd + vpaddd", 32, acc, _mm256_set1_epi32(i), a, b,
       _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(acc[i], b), a)), sum256(acc));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void vnni_rates(void) {
  __m256i acc[ACCS], a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  RATE("vpdpwssd ymm", 16, acc, _mm256_set1_epi32(i), a, b, _mm256_dpwssd_epi32(acc[i], a, b), sum256(acc));
  __m512i wide[ACCS], c = _mm512_set1_epi16(3), d = _mm512_set1_epi16(5);
  RATE("vpdpwssd zmm", 32, wide, _mm512_set1_epi32(i), c, d, _mm512_dpwssd_epi32(wide[i], c, d), sum512(wide));
  c = _mm512_set1_epi8(3);
  d = _mm512_set1_epi8(5);
  RATE("vpdpbusd zmm", 64, wide, _mm512_set1_epi32(i), c, d, _mm512_dpbusd_epi32(wide[i], c, d), sum512(wide));
}

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2")) {
    puts("this CPU has no AVX2");
    return 1;
  }
  avx2_rates();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) vnni_rates();
  return 0;
}
