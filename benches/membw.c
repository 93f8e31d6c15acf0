// Read bandwidth of this machine's caches and memory: THREADS threads sum
// disjoint parts of one MIB-MiB buffer with 64-byte AVX-512 (or AVX2) loads,
// enough passes for about 4 GiB in all, after one warm-up pass set.
//
//   cc -O2 -march=native -pthread benches/membw.c -o /tmp/membw
//   for m in 32 64 96 128 150 400; do /tmp/membw $m 2; done
//   /tmp/membw 96 2 huge    # the buffer on 2 MiB transparent huge pages
//
// Decode streams every weight once a token, so a model's decode working set
// against this curve says which limit it runs into (docs/performance.md).
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

typedef struct {
  const char* data;
  size_t bytes;
  int passes;
  long long sum;
} Part;

static void* read_part(void* arg) {
  Part* p = arg;
#ifdef __AVX512F__
  __m512i acc = _mm512_setzero_si512();
  for (int pass = 0; pass < p->passes; ++pass)
    for (size_t i = 0; i < p->bytes; i += 256)
      for (int k = 0; k < 256; k += 64) acc = _mm512_add_epi32(acc, _mm512_load_si512(p->data + i + k));
  p->sum = _mm512_reduce_add_epi32(acc);
#else
  __m256i acc = _mm256_setzero_si256();
  for (int pass = 0; pass < p->passes; ++pass)
    for (size_t i = 0; i < p->bytes; i += 256)
      for (int k = 0; k < 256; k += 32) acc = _mm256_add_epi32(acc, _mm256_load_si256((const __m256i*)(p->data + i + k)));
  int lanes[8];
  _mm256_storeu_si256((__m256i*)lanes, acc);
  p->sum = lanes[0];
#endif
  return NULL;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const int huge = argc == 4 && strcmp(argv[3], "huge") == 0;
  if ((argc != 3 && !huge) || atoi(argv[1]) <= 0 || atoi(argv[2]) <= 0 || atoi(argv[2]) > 64) {
    fprintf(stderr, "usage: membw MIB THREADS [huge]\n");
    return 2;
  }
  const size_t mib = (size_t)atoi(argv[1]);
  const int threads = atoi(argv[2]);
  const size_t bytes = mib << 20, part = bytes / threads / 256 * 256;
  // 2 MiB aligned, so that huge pages can back it whole.
  char* data = aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  if (!data) return 1;
#ifdef MADV_HUGEPAGE
  if (huge && madvise(data, bytes, MADV_HUGEPAGE) != 0) perror("madvise(MADV_HUGEPAGE)");
#endif
  memset(data, 1, bytes);
  const int passes = (int)(4096 / mib) + 1;
  pthread_t ids[64];
  Part parts[64];
  double elapsed = 0;
  for (int round = 0; round < 2; ++round) {
    const double start = seconds();
    for (int t = 0; t < threads; ++t) {
      parts[t] = (Part){data + t * part, part, passes, 0};
      pthread_create(&ids[t], NULL, read_part, &parts[t]);
    }
    for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
    elapsed = seconds() - start;
  }
  printf("%zu MiB, %d threads%s: %.1f GB/s\n", mib, threads, huge ? ", huge pages" : "", (double)part * threads * passes / elapsed / 1e9);
  free(data);
  return 0;
}
