// How many integer multiply-adds one core retires per second in the
// instructions the kernels' integer loops are built from, with no memory
// traffic: 12 independent accumulators, each fed one multiply instruction and
// (where the instruction does not accumulate) one add per step. It tells
// whether a loop runs at its instructions' rate, and how two instruction
// choices compare on this CPU (AMD Zen 4 retires one 256-bit vpmaddwd a
// cycle, where Zen 5 retires two).
//
//   cc -O2 benches/int_dot_rate.c -o /tmp/int_dot_rate && /tmp/int_dot_rate
//
// Products per instruction: vpmaddwd 16 (int16 x int16, pairs summed into
// int32: the AVX2 integer loops), vpmaddubsw 32 (uint8 x int8, pairs summed
// into saturating int16: llama.cpp's AVX2 Q8 dot products), vpdpwssd 16 or
// 32 (ymm or zmm; the AVX-512 int16 loops), vpdpbusd 32 or 64 (the VNNI
// matvec).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define STEPS 100000000L
#define ACCS 12

static double cpu_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void report(const char* name, double seconds, int products, int sink) {
  const double instructions = (double)STEPS * ACCS;
  printf("%-22s %6.2f G instructions/s  %6.1f G products/s  (%d)\n", name, instructions / seconds / 1e9,
         instructions * products / seconds / 1e9, sink);
}

__attribute__((target("avx2"))) static void avx2_rates(void) {
  __m256i acc[ACCS], a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  for (int i = 0; i < ACCS; i++) acc[i] = _mm256_set1_epi32(i);
  double t = cpu_seconds();
  for (long n = 0; n < STEPS; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(a, b));
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  t = cpu_seconds() - t;
  __m256i s = acc[0];
  for (int i = 1; i < ACCS; i++) s = _mm256_add_epi32(s, acc[i]);
  report("vpmaddwd + vpaddd", t, 16, _mm256_extract_epi32(s, 0));

  for (int i = 0; i < ACCS; i++) acc[i] = _mm256_set1_epi32(i);
  a = _mm256_set1_epi8(3);
  b = _mm256_set1_epi8(5);
  t = cpu_seconds();
  for (long n = 0; n < STEPS; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; i++) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(a, b));
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  t = cpu_seconds() - t;
  s = acc[0];
  for (int i = 1; i < ACCS; i++) s = _mm256_add_epi32(s, acc[i]);
  report("vpmaddubsw + vpaddw", t, 32, _mm256_extract_epi32(s, 0));
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void vnni_rates(void) {
  __m256i acc[ACCS], a = _mm256_set1_epi16(3), b = _mm256_set1_epi16(5);
  for (int i = 0; i < ACCS; i++) acc[i] = _mm256_set1_epi32(i);
  double t = cpu_seconds();
  for (long n = 0; n < STEPS; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; i++) acc[i] = _mm256_dpwssd_epi32(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  t = cpu_seconds() - t;
  __m256i s = acc[0];
  for (int i = 1; i < ACCS; i++) s = _mm256_add_epi32(s, acc[i]);
  report("vpdpwssd ymm", t, 16, _mm256_extract_epi32(s, 0));

  __m512i wide[ACCS], c = _mm512_set1_epi16(3), d = _mm512_set1_epi16(5);
  for (int i = 0; i < ACCS; i++) wide[i] = _mm512_set1_epi32(i);
  t = cpu_seconds();
  for (long n = 0; n < STEPS; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; i++) wide[i] = _mm512_dpwssd_epi32(wide[i], c, d);
    __asm__ volatile("" : "+v"(c), "+v"(d));
  }
  t = cpu_seconds() - t;
  __m512i w = wide[0];
  for (int i = 1; i < ACCS; i++) w = _mm512_add_epi32(w, wide[i]);
  report("vpdpwssd zmm", t, 32, _mm512_reduce_add_epi32(w));

  for (int i = 0; i < ACCS; i++) wide[i] = _mm512_set1_epi32(i);
  c = _mm512_set1_epi8(3);
  d = _mm512_set1_epi8(5);
  t = cpu_seconds();
  for (long n = 0; n < STEPS; n++) {
#pragma GCC unroll 12
    for (int i = 0; i < ACCS; i++) wide[i] = _mm512_dpbusd_epi32(wide[i], c, d);
    __asm__ volatile("" : "+v"(c), "+v"(d));
  }
  t = cpu_seconds() - t;
  w = wide[0];
  for (int i = 1; i < ACCS; i++) w = _mm512_add_epi32(w, wide[i]);
  report("vpdpbusd zmm", t, 64, _mm512_reduce_add_epi32(w));
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
