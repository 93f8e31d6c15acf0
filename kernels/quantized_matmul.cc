// See quantized_matmul.h. Layout (MLX affine quantization, transpose=true):
//   w       uint32 [N, K*bits/32]: row n is a little-endian bit stream, element
//           k at bit k*bits (for bits 2/4/8: word k/(32/bits), bit
//           (k % (32/bits))*bits).
//   scales, biases [N, K/group_size].
//   y[m, n] = sum_g scale[n,g] * (sum_{k in g} x[m,k] q[n,k])
//           + bias[n,g] * (sum_{k in g} x[m,k]).
//
// The SIMD loops never shift a packed value down to its own bit position.
// With L 32-bit lanes (16 for AVX-512, 8 for AVX2), one vector holds L
// consecutive words; for the s-th value of every word, (v & (mask << bits*s))
// is q * 2^(bits*s) exactly, and converting it to f32 stays exact (at most
// 8 significant bits). The activations are laid out once per call in the
// matching order and pre-multiplied by 2^-(bits*s) (exact: a power of two),
// so each FMA computes the f32 product x*q exactly as a plain dequantize would.
// The last value of a word is shifted down by `bits` first so that the masked
// value stays below 2^31 (a signed int32 conversion).

#include "quantized_matmul.h"

// GCC 12 reports the `_mm512_undefined_*` idiom inside its own AVX-512
// intrinsics as -Wmaybe-uninitialized; the warnings are false positives.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

// ---------------------------------------------------------------------------
// Scalar conversions (bit exact, no dependence on the compiler's _Float16).

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return (uint16_t)(bits >> 16);
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00);  // NaN
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  // overflow (incl. inf) after rounding
  if (ax < 0x38800000u) {  // subnormal or zero in f16
    if (ax < 0x33000000u) return (uint16_t)sign;  // below half the smallest subnormal
    int e = (int)(ax >> 23);
    uint32_t man = (ax & 0x7fffff) | 0x800000;
    int shift = 126 - e;  // 14 + (113 - e) - ... : value = man * 2^(e-150); f16 unit 2^-24
    // result = round(man * 2^(e - 150 + 24)) = round(man >> (126 - e))
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return (uint16_t)(sign | q);
  }
  uint32_t r = ax + 0xfff + ((ax >> 13) & 1) - (112u << 23);  // rebias and round
  return (uint16_t)(sign | (r >> 13));
}

enum class Ty : int { F32 = 0, F16 = 1, BF16 = 2 };

Ty ty_of(mx::Dtype d) {
  if (d == mx::float32) return Ty::F32;
  if (d == mx::float16) return Ty::F16;
  if (d == mx::bfloat16) return Ty::BF16;
  throw std::invalid_argument("[mlxcel::kernels::quantized_matmul] unsupported dtype");
}

inline float load_as_f32(const void* p, Ty ty, size_t i) {
  switch (ty) {
    case Ty::F32: return static_cast<const float*>(p)[i];
    case Ty::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

// Converts n values starting at element `i` of `p` to f32.
void convert_row_portable(const void* p, Ty ty, size_t i, int n, float* dst) {
  switch (ty) {
    case Ty::F32: std::memcpy(dst, static_cast<const float*>(p) + i, n * sizeof(float)); return;
    case Ty::F16: {
      auto* s = static_cast<const uint16_t*>(p) + i;
      for (int j = 0; j < n; ++j) dst[j] = f16_to_f32(s[j]);
      return;
    }
    default: {
      auto* s = static_cast<const uint16_t*>(p) + i;
      for (int j = 0; j < n; ++j) dst[j] = bf16_to_f32(s[j]);
      return;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
void convert_row_avx512(const void* p, Ty ty, size_t i, int n, float* dst) {
  if (ty == Ty::F32) {
    std::memcpy(dst, static_cast<const float*>(p) + i, n * sizeof(float));
    return;
  }
  auto* s = static_cast<const uint16_t*>(p) + i;
  int j = 0;
  for (; j < n; j += 16) {
    __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
    __m256i h = _mm256_maskz_loadu_epi16(k, s + j);
    __m512 f = ty == Ty::F16 ? _mm512_cvtph_ps(h)
                             : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm512_mask_storeu_ps(dst + j, k, f);
  }
}

__attribute__((target("avx2,fma,f16c")))
void convert_row_avx2(const void* p, Ty ty, size_t i, int n, float* dst) {
  if (ty == Ty::F32) {
    std::memcpy(dst, static_cast<const float*>(p) + i, n * sizeof(float));
    return;
  }
  auto* s = static_cast<const uint16_t*>(p) + i;
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + j));
    __m256 f = ty == Ty::F16 ? _mm256_cvtph_ps(h)
                             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(dst + j, f);
  }
  for (; j < n; ++j) dst[j] = ty == Ty::F16 ? f16_to_f32(s[j]) : bf16_to_f32(s[j]);
}

// ---------------------------------------------------------------------------
// CPU features and path selection.

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

Path best_supported(Path want) {
  if (want == Path::Avx512 && cpu_has_avx512()) return Path::Avx512;
  if ((want == Path::Avx512 || want == Path::Avx2) && cpu_has_avx2()) return Path::Avx2;
  return Path::Portable;
}

Path env_path() {
  static const Path path = [] {
    const char* env = std::getenv("MLXCEL_KERNELS");
    std::string v = env ? env : "";
    if (v == "portable") return Path::Portable;
    if (v == "avx2") return best_supported(Path::Avx2);
    return best_supported(Path::Avx512);
  }();
  return path;
}

// ---------------------------------------------------------------------------
// A small persistent thread pool. The evaluating thread takes part; workers
// spin briefly after a job (decode issues many small matvecs back to back)
// and then sleep on a futex (std::atomic::wait).

class Pool {
 public:
  using Fn = void (*)(void* ctx, int task);

  explicit Pool(int threads) : threads_(std::max(1, threads)) {
    for (int i = 1; i < threads_; ++i) {
      std::thread([this] { worker(); }).detach();
    }
  }

  int threads() const { return threads_; }

  // Runs fn(ctx, t) for t in [0, tasks), on this thread and the workers.
  void run(int tasks, Fn fn, void* ctx) {
    if (tasks <= 0) return;
    std::unique_lock<std::mutex> lock(run_mu_, std::try_to_lock);
    if (threads_ == 1 || tasks == 1 || tasks > 0xffff || !lock.owns_lock()) {
      for (int t = 0; t < tasks; ++t) fn(ctx, t);
      return;
    }
    // No worker can claim a task of this job before gen_ is published, and
    // none still holds a task of the previous one (run waited for them all).
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    uint64_t gen = (gen_.load(std::memory_order_relaxed) + 1) & 0xffffffffu;
    // The claim word is generation | task count | next index, so a worker
    // that wakes late sees a stale generation and never claims a task, and
    // never reads a task count that is being rewritten.
    claim_.store((gen << 32) | ((uint64_t)tasks << 16), std::memory_order_seq_cst);
    gen_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) gen_.notify_all();
    work(gen);
    // A worker may hold a task while descheduled on a busy machine: spin a
    // little, then give the CPU away between checks.
    for (int spins = 0; done_.load(std::memory_order_acquire) < tasks; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  void work(uint64_t gen) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    while (true) {
      int tasks = (int)((c >> 16) & 0xffff), idx = (int)(c & 0xffff);
      if ((c >> 32) != gen || idx >= tasks) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      // A claimed task keeps the job (fn_, ctx_) alive until it is done.
      fn_(ctx_, idx);
      done_.fetch_add(1, std::memory_order_release);
      c = claim_.load(std::memory_order_acquire);
    }
  }

  void worker() {
    uint64_t seen = 0;
    while (true) {
      uint64_t gen = gen_.load(std::memory_order_acquire);
      if (gen == seen) {
        auto start = std::chrono::steady_clock::now();
        int spins = 0;
        while ((gen = gen_.load(std::memory_order_acquire)) == seen) {
          _mm_pause();
          if (++spins % 64 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(200)) {
            sleepers_.fetch_add(1, std::memory_order_seq_cst);
            gen_.wait(seen, std::memory_order_seq_cst);
            sleepers_.fetch_sub(1, std::memory_order_seq_cst);
            start = std::chrono::steady_clock::now();
          }
        }
      }
      seen = gen;
      work(gen);
    }
  }

  const int threads_;
  std::mutex run_mu_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
};

int configured_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("MLXCEL_NUM_THREADS")) {
      int v = std::atoi(env);
      if (v > 0) return std::min(v, 256);
    }
    unsigned hc = std::thread::hardware_concurrency();
    return hc == 0 ? 1 : (int)std::min(hc, 256u);
  }();
  return n;
}

Pool& pool() {
  // Leaked on purpose: workers outlive static destruction at exit.
  static Pool* p = new Pool(configured_threads());
  return *p;
}

// ---------------------------------------------------------------------------
// The job: everything one evaluation needs, in plain pointers.

struct Job {
  int M = 0, N = 0, K = 0;
  int bits = 0, group = 0;
  int G = 0;        // groups per row
  int epw = 0;      // values per 32-bit word (bits 2/4/8)
  int wpr = 0;      // words per row (bits 2/4/8)
  int wpg = 0;      // words per group (bits 2/4/8)
  int lanes = 0;    // SIMD lanes (words per chunk), 0 for the portable loop
  int chunks = 0;   // chunks per row
  size_t row_bytes = 0;  // bytes per row of w
  const uint8_t* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  Ty sty = Ty::F32;
  const float* xf = nullptr;    // [M, K] activations in f32
  const float* xp = nullptr;    // [M, chunks * epw * lanes] permuted, pre-scaled
  size_t xp_stride = 0;
  const float* xsum = nullptr;  // [M, G] per-group sums of x
  float* y = nullptr;           // [M, N] f32 results
  int rows_per_task = 0;
  Path path = Path::Portable;
};

// Scale and bias rows in f32, with `pad` zeros after them for vector reads.
struct RowScratch {
  std::vector<float> s, b;
  void ensure(int g, int pad) {
    if ((int)s.size() < g + pad) {
      s.assign(g + pad, 0.0f);
      b.assign(g + pad, 0.0f);
    }
  }
};

thread_local RowScratch tl_scratch;

// ---------------------------------------------------------------------------
// Portable loop: any bits (bit-stream extraction), one output row at a time.

void rows_portable(const Job& j, int n0, int n1) {
  RowScratch& sc = tl_scratch;
  sc.ensure(j.G, 16);
  const uint32_t mask = (1u << j.bits) - 1;
  const bool pow2 = (j.bits & (j.bits - 1)) == 0;
  std::vector<float> q(j.group);
  for (int n = n0; n < n1; ++n) {
    convert_row_portable(j.scales, j.sty, (size_t)n * j.G, j.G, sc.s.data());
    convert_row_portable(j.biases, j.sty, (size_t)n * j.G, j.G, sc.b.data());
    const uint8_t* row = j.w + (size_t)n * j.row_bytes;
    float acc[8] = {0};
    // Process x rows in blocks of up to 8 so each group's dequantized
    // values are reused.
    for (int m0 = 0; m0 < j.M; m0 += 8) {
      int mb = std::min(8, j.M - m0);
      for (int m = 0; m < mb; ++m) acc[m] = 0.0f;
      for (int g = 0; g < j.G; ++g) {
        int k0 = g * j.group;
        if (pow2) {
          const uint32_t* wr = reinterpret_cast<const uint32_t*>(row);
          int epw = 32 / j.bits;
          for (int k = 0; k < j.group; ++k) {
            int kk = k0 + k;
            q[k] = (float)((wr[kk / epw] >> ((kk % epw) * j.bits)) & mask);
          }
        } else {
          for (int k = 0; k < j.group; ++k) {
            size_t bit = (size_t)(k0 + k) * j.bits;
            uint32_t v = 0;
            std::memcpy(&v, row + bit / 8, std::min<size_t>(4, j.row_bytes - bit / 8));
            q[k] = (float)((v >> (bit % 8)) & mask);
          }
        }
        for (int m = 0; m < mb; ++m) {
          const float* x = j.xf + (size_t)(m0 + m) * j.K + k0;
          float d = 0.0f;
          for (int k = 0; k < j.group; ++k) d += x[k] * q[k];
          acc[m] += sc.s[g] * d + sc.b[g] * j.xsum[(size_t)(m0 + m) * j.G + g];
        }
      }
      for (int m = 0; m < mb; ++m) j.y[(size_t)(m0 + m) * j.N + n] = acc[m];
    }
  }
}

// ---------------------------------------------------------------------------
// AVX-512 loop: 16 words per chunk. One pass computes NR output rows for MT
// activation rows: each weight vector is unpacked once and used MT times,
// each activation vector is loaded once and used NR times, and the NR*MT
// independent FMA chains keep the FMA units busy.

// (GCC 12's _mm512_reduce_add_ps trips -Wmaybe-uninitialized.)
__attribute__((target("avx512f,avx512dq"), always_inline)) inline float hsum512(__m512 v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sf, bf: f32 scales and biases of the NR rows, `gs` floats apart, readable
// 16 floats past each row's last group.
template <int BITS, int MT, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) inline void
tile_avx512(const Job& j, const uint32_t* wr, const float* sf, const float* bf, size_t gs, int m0, int n) {
  constexpr int EPW = 32 / BITS;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const int chunks = j.chunks;
  const int tail_words = j.wpr - (chunks - 1) * 16;
  const __mmask16 tail = (__mmask16)((1u << tail_words) - 1);
  const int wpg = j.wpg;
  const size_t rw = j.wpr;  // words per row
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i gidx = wpg < 16 ? _mm512_srli_epi32(lane, __builtin_ctz(wpg)) : _mm512_setzero_si512();

  const float* xp[MT];
  for (int m = 0; m < MT; ++m) xp[m] = j.xp + (size_t)(m0 + m) * j.xp_stride;

  __m512 y[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) y[r][m] = _mm512_setzero_ps();

  for (int c = 0; c < chunks; ++c) {
    const __mmask16 km = c == chunks - 1 ? tail : (__mmask16)0xffff;
    __m512i v[NR];
    for (int r = 0; r < NR; ++r) v[r] = _mm512_maskz_loadu_epi32(km, wr + r * rw + c * 16);
    __m512 acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
    const size_t xo = (size_t)c * EPW * 16;
#pragma GCC unroll 16
    for (int s = 0; s < EPW; ++s) {
      __m512 xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(xp[m] + xo + s * 16);
      for (int r = 0; r < NR; ++r) {
        __m512i t;
        if (s < EPW - 1) {
          t = _mm512_and_si512(v[r], _mm512_set1_epi32((int)(QM << (BITS * s))));
        } else {
          t = _mm512_and_si512(_mm512_srli_epi32(v[r], BITS), _mm512_set1_epi32((int)(QM << (BITS * (s - 1)))));
        }
        const __m512 f = _mm512_cvtepi32_ps(t);
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_fmadd_ps(f, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float* srow = sf + r * gs;
      const __m512 scale = wpg < 16 ? _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(srow + (c * 16) / wpg))
                                    : _mm512_set1_ps(srow[(c * 16) / wpg]);
      for (int m = 0; m < MT; ++m) y[r][m] = _mm512_fmadd_ps(acc[r][m], scale, y[r][m]);
    }
  }
  // Bias term, sum_g bias[g] * xsum[m, g], joins the vector sum.
  const int G = j.G;
  for (int m = 0; m < MT; ++m) {
    const float* xs = j.xsum + (size_t)(m0 + m) * G;
    int g = 0;
    for (; g + 16 <= G; g += 16) {
      const __m512 xsv = _mm512_loadu_ps(xs + g);
      for (int r = 0; r < NR; ++r) y[r][m] = _mm512_fmadd_ps(_mm512_loadu_ps(bf + r * gs + g), xsv, y[r][m]);
    }
    if (g < G) {
      const __mmask16 k = (__mmask16)((1u << (G - g)) - 1);
      const __m512 xsv = _mm512_maskz_loadu_ps(k, xs + g);
      for (int r = 0; r < NR; ++r)
        y[r][m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, bf + r * gs + g), xsv, y[r][m]);
    }
    for (int r = 0; r < NR; ++r) j.y[(size_t)(m0 + m) * j.N + n + r] = hsum512(y[r][m]);
  }
}

// Runs every activation row against output rows [n, n + NR).
template <int BITS, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) inline void
rows_tile_avx512(const Job& j, const uint32_t* wr, const float* sf, const float* bf, size_t gs, int n) {
  int m = 0;
  if constexpr (NR == 4) {
    for (; m + 1 <= j.M; m += 1) tile_avx512<BITS, 1, 4>(j, wr, sf, bf, gs, m, n);
  } else if constexpr (NR == 2) {
    for (; m + 2 <= j.M; m += 2) tile_avx512<BITS, 2, 2>(j, wr, sf, bf, gs, m, n);
    if (m < j.M) tile_avx512<BITS, 1, 2>(j, wr, sf, bf, gs, m, n);
  } else {
    for (; m + 4 <= j.M; m += 4) tile_avx512<BITS, 4, 1>(j, wr, sf, bf, gs, m, n);
    switch (j.M - m) {
      case 3: tile_avx512<BITS, 3, 1>(j, wr, sf, bf, gs, m, n); break;
      case 2: tile_avx512<BITS, 2, 1>(j, wr, sf, bf, gs, m, n); break;
      case 1: tile_avx512<BITS, 1, 1>(j, wr, sf, bf, gs, m, n); break;
      default: break;
    }
  }
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))) void rows_avx512(const Job& j, int n0, int n1) {
  // Output rows per pass: 4 for one activation row, 2 for two, else 1 (the
  // activation rows then share each unpacked weight vector).
  const int nr = j.M == 1 ? 4 : j.M == 2 ? 2 : 1;
  const size_t gs = (size_t)j.G;
  RowScratch& sc = tl_scratch;
  sc.ensure(4 * j.G, 16);
  int n = n0;
  auto block = [&](int rows) __attribute__((always_inline)) {
    convert_row_avx512(j.scales, j.sty, (size_t)n * gs, rows * j.G, sc.s.data());
    convert_row_avx512(j.biases, j.sty, (size_t)n * gs, rows * j.G, sc.b.data());
    return reinterpret_cast<const uint32_t*>(j.w + (size_t)n * j.row_bytes);
  };
  if (nr == 4) {
    for (; n + 4 <= n1; n += 4) rows_tile_avx512<BITS, 4>(j, block(4), sc.s.data(), sc.b.data(), gs, n);
  } else if (nr == 2) {
    for (; n + 2 <= n1; n += 2) rows_tile_avx512<BITS, 2>(j, block(2), sc.s.data(), sc.b.data(), gs, n);
  }
  for (; n < n1; ++n) rows_tile_avx512<BITS, 1>(j, block(1), sc.s.data(), sc.b.data(), gs, n);
}

// ---------------------------------------------------------------------------
// AVX2 loop: the same scheme with 8 words per chunk.

__attribute__((target("avx2,fma"), always_inline)) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS, int MT, int NR>
__attribute__((target("avx2,fma"), always_inline)) inline void
tile_avx2(const Job& j, const uint32_t* wr, const float* sf, const float* bf, size_t gs, int m0, int n) {
  constexpr int EPW = 32 / BITS;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const int chunks = j.chunks;
  const int tail_words = j.wpr - (chunks - 1) * 8;
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail_words), lane);
  const int wpg = j.wpg;
  const size_t rw = j.wpr;
  const __m256i gidx = wpg < 8 ? _mm256_srli_epi32(lane, __builtin_ctz(wpg)) : _mm256_setzero_si256();

  const float* xp[MT];
  for (int m = 0; m < MT; ++m) xp[m] = j.xp + (size_t)(m0 + m) * j.xp_stride;
  __m256 y[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) y[r][m] = _mm256_setzero_ps();

  for (int c = 0; c < chunks; ++c) {
    __m256i v[NR];
    for (int r = 0; r < NR; ++r) {
      const uint32_t* p = wr + r * rw + c * 8;
      v[r] = c == chunks - 1 ? _mm256_maskload_epi32(reinterpret_cast<const int*>(p), tail)
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    }
    __m256 acc[NR][MT];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
    const size_t xo = (size_t)c * EPW * 8;
#pragma GCC unroll 16
    for (int s = 0; s < EPW; ++s) {
      __m256 xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(xp[m] + xo + s * 8);
      for (int r = 0; r < NR; ++r) {
        __m256i t;
        if (s < EPW - 1) {
          t = _mm256_and_si256(v[r], _mm256_set1_epi32((int)(QM << (BITS * s))));
        } else {
          t = _mm256_and_si256(_mm256_srli_epi32(v[r], BITS), _mm256_set1_epi32((int)(QM << (BITS * (s - 1)))));
        }
        const __m256 f = _mm256_cvtepi32_ps(t);
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(f, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float* srow = sf + r * gs;
      const __m256 scale = wpg < 8 ? _mm256_permutevar8x32_ps(_mm256_loadu_ps(srow + (c * 8) / wpg), gidx)
                                   : _mm256_set1_ps(srow[(c * 8) / wpg]);
      for (int m = 0; m < MT; ++m) y[r][m] = _mm256_fmadd_ps(acc[r][m], scale, y[r][m]);
    }
  }
  const int G = j.G;
  for (int m = 0; m < MT; ++m) {
    const float* xs = j.xsum + (size_t)(m0 + m) * G;
    int g = 0;
    for (; g + 8 <= G; g += 8) {
      const __m256 xsv = _mm256_loadu_ps(xs + g);
      for (int r = 0; r < NR; ++r) y[r][m] = _mm256_fmadd_ps(_mm256_loadu_ps(bf + r * gs + g), xsv, y[r][m]);
    }
    for (int r = 0; r < NR; ++r) {
      float b = 0.0f;
      for (int gg = g; gg < G; ++gg) b += bf[r * gs + gg] * xs[gg];
      j.y[(size_t)(m0 + m) * j.N + n + r] = hsum256(y[r][m]) + b;
    }
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Job& j, int n0, int n1) {
  const size_t gs = (size_t)j.G;
  RowScratch& sc = tl_scratch;
  sc.ensure(2 * j.G, 16);
  int n = n0;
  auto block = [&](int rows) __attribute__((always_inline)) {
    convert_row_avx2(j.scales, j.sty, (size_t)n * gs, rows * j.G, sc.s.data());
    convert_row_avx2(j.biases, j.sty, (size_t)n * gs, rows * j.G, sc.b.data());
    return reinterpret_cast<const uint32_t*>(j.w + (size_t)n * j.row_bytes);
  };
  if (j.M == 1) {
    for (; n + 2 <= n1; n += 2) {
      const uint32_t* wr = block(2);
      tile_avx2<BITS, 1, 2>(j, wr, sc.s.data(), sc.b.data(), gs, 0, n);
    }
  }
  for (; n < n1; ++n) {
    const uint32_t* wr = block(1);
    int m = 0;
    for (; m + 2 <= j.M; m += 2) tile_avx2<BITS, 2, 1>(j, wr, sc.s.data(), sc.b.data(), gs, m, n);
    if (m < j.M) tile_avx2<BITS, 1, 1>(j, wr, sc.s.data(), sc.b.data(), gs, m, n);
  }
}

// ---------------------------------------------------------------------------
// Driver.

void run_rows(const Job& j, int n0, int n1) {
  switch (j.path) {
    case Path::Avx512:
      switch (j.bits) {
        case 2: return rows_avx512<2>(j, n0, n1);
        case 4: return rows_avx512<4>(j, n0, n1);
        case 8: return rows_avx512<8>(j, n0, n1);
      }
      break;
    case Path::Avx2:
      switch (j.bits) {
        case 2: return rows_avx2<2>(j, n0, n1);
        case 4: return rows_avx2<4>(j, n0, n1);
        case 8: return rows_avx2<8>(j, n0, n1);
      }
      break;
    default: break;
  }
  rows_portable(j, n0, n1);
}

void task_fn(void* ctx, int t) {
  const Job& j = *static_cast<const Job*>(ctx);
  int n0 = t * j.rows_per_task;
  int n1 = std::min(j.N, n0 + j.rows_per_task);
  run_rows(j, n0, n1);
}

// Per-thread buffers of the evaluating thread, reused across calls.
struct CallScratch {
  std::vector<float> xf, xp, xsum, y;
};
thread_local CallScratch tl_call;

// Evaluates one call. x rows are read through `x_offsets` (element offsets of
// each row's first element) with `x_step` between consecutive elements.
void compute(Job j, const void* x, Ty xty, const std::vector<int64_t>& x_offsets, int64_t x_step, void* out,
             Ty oty) {
  CallScratch& cs = tl_call;
  const int M = j.M, K = j.K;
  cs.xf.resize((size_t)M * K);
  for (int m = 0; m < M; ++m) {
    float* dst = cs.xf.data() + (size_t)m * K;
    int64_t off = x_offsets[m];
    if (x_step == 1) {
      if (j.path == Path::Avx512) convert_row_avx512(x, xty, off, K, dst);
      else if (j.path == Path::Avx2) convert_row_avx2(x, xty, off, K, dst);
      else convert_row_portable(x, xty, off, K, dst);
    } else {
      for (int k = 0; k < K; ++k) dst[k] = load_as_f32(x, xty, off + k * x_step);
    }
  }
  cs.xsum.resize((size_t)M * j.G);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < j.G; ++g) {
      const float* p = cs.xf.data() + (size_t)m * K + (size_t)g * j.group;
      float s = 0.0f;
      for (int k = 0; k < j.group; ++k) s += p[k];
      cs.xsum[(size_t)m * j.G + g] = s;
    }
  }
  if (j.lanes > 0) {
    const int L = j.lanes, EPW = j.epw;
    j.xp_stride = (size_t)j.chunks * EPW * L;
    cs.xp.assign((size_t)M * j.xp_stride, 0.0f);
    for (int m = 0; m < M; ++m) {
      const float* src = cs.xf.data() + (size_t)m * K;
      float* dst = cs.xp.data() + (size_t)m * j.xp_stride;
      for (int s = 0; s < EPW; ++s) {
        int e = s < EPW - 1 ? s : s - 1;
        float f = std::ldexp(1.0f, -j.bits * e);
        for (int word = 0; word < j.wpr; ++word) {
          int c = word / L, l = word % L;
          dst[((size_t)c * EPW + s) * L + l] = src[(size_t)word * EPW + s] * f;
        }
      }
    }
    j.xp = cs.xp.data();
  }
  j.xf = cs.xf.data();
  j.xsum = cs.xsum.data();

  float* y32;
  if (oty == Ty::F32) {
    y32 = static_cast<float*>(out);
  } else {
    cs.y.resize((size_t)M * j.N);
    y32 = cs.y.data();
  }
  j.y = y32;

  // Split output rows across threads: a few tasks per thread for balance on
  // a loaded machine, but never below ~32K weights per task.
  Pool& p = pool();
  const double work = (double)j.N * K * std::max(1, M);
  int tasks = 1;
  if (p.threads() > 1 && work >= 64.0 * 1024) {
    tasks = std::min<int>(p.threads() * 4, (int)std::max(1.0, work / (32.0 * 1024)));
    tasks = std::max(1, std::min(tasks, j.N));
  }
  j.rows_per_task = (j.N + tasks - 1) / tasks;
  tasks = (j.N + j.rows_per_task - 1) / j.rows_per_task;
  p.run(tasks, task_fn, &j);

  if (oty == Ty::F16) {
    auto* o = static_cast<uint16_t*>(out);
    for (size_t i = 0; i < (size_t)M * j.N; ++i) o[i] = f32_to_f16(y32[i]);
  } else if (oty == Ty::BF16) {
    auto* o = static_cast<uint16_t*>(out);
    for (size_t i = 0; i < (size_t)M * j.N; ++i) o[i] = f32_to_bf16(y32[i]);
  }
}

int lanes_for(Path path, int bits, int group) {
  if (bits != 2 && bits != 4 && bits != 8) return 0;
  int epw = 32 / bits;
  int wpg = group / epw;
  int L = path == Path::Avx512 ? 16 : path == Path::Avx2 ? 8 : 0;
  if (L == 0) return 0;
  bool pow2 = (wpg & (wpg - 1)) == 0;
  if ((wpg < L && pow2) || wpg % L == 0) return L;
  return 0;
}

// ---------------------------------------------------------------------------
// The MLX primitive.

class QuantizedMatvec : public mx::UnaryPrimitive {
 public:
  QuantizedMatvec(mx::Stream stream, int group_size, int bits, Path path)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), path_(path) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    const mx::array& scales = inputs[2];
    const mx::array& biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));

    Job j;
    j.K = x.shape(-1);
    j.N = out.shape(-1);
    j.M = j.N == 0 ? 0 : (int)(out.size() / j.N);
    j.bits = bits_;
    j.group = group_size_;
    j.G = j.K / group_size_;
    j.row_bytes = (size_t)w.shape(-1) * 4;
    j.path = resolve_path(path_);
    j.lanes = lanes_for(j.path, bits_, group_size_);
    if (j.lanes == 0) j.path = Path::Portable;
    if (bits_ == 2 || bits_ == 4 || bits_ == 8) {
      j.epw = 32 / bits_;
      j.wpr = j.K / j.epw;
      j.wpg = group_size_ / j.epw;
      if (j.lanes) j.chunks = (j.wpr + j.lanes - 1) / j.lanes;
    }
    j.sty = ty_of(scales.dtype());
    if (biases.dtype() != scales.dtype()) {
      throw std::invalid_argument("[mlxcel::kernels::quantized_matmul] scales and biases differ in dtype");
    }

    // Row offsets of x (any strides; rows are all axes but the last).
    std::vector<int64_t> offsets(j.M);
    const auto& shape = x.shape();
    const auto& strides = x.strides();
    int nd = (int)x.ndim();
    for (int m = 0; m < j.M; ++m) {
      int64_t rem = m, off = 0;
      for (int d = nd - 2; d >= 0; --d) {
        off += (rem % shape[d]) * strides[d];
        rem /= shape[d];
      }
      offsets[m] = off;
    }
    int64_t step = nd > 0 ? strides[nd - 1] : 1;

    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_input_array(w);
    enc.set_input_array(scales);
    enc.set_input_array(biases);
    enc.set_output_array(out);
    // MLX's cpu::eval keeps the inputs' buffers alive until this task has run.
    enc.dispatch([j, xp = x.data<void>(), xty = ty_of(x.dtype()), offsets = std::move(offsets), step,
                  wp = w.data<uint8_t>(), sp = scales.data<void>(), bp = biases.data<void>(),
                  op = out.data<void>(), oty = ty_of(out.dtype())]() mutable {
      if (j.M == 0 || j.N == 0) return;
      j.w = wp;
      j.scales = sp;
      j.biases = bp;
      compute(j, xp, xty, offsets, step, op, oty);
    });
  }

  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    throw std::runtime_error("[mlxcel::kernels::QuantizedMatvec] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelQuantizedMatvec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedMatvec*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->path_ == path_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.back() = inputs[1].shape(-2);
    return {s};
  }

 private:
  int group_size_;
  int bits_;
  Path path_;
};

bool known_row_contiguous(const mx::array& a) {
  return a.is_available() && a.flags().row_contiguous;
}

}  // namespace

Path auto_path() { return env_path(); }

Path resolve_path(Path requested) {
  if (requested == Path::Auto) return env_path();
  return best_supported(requested);
}

const char* path_name(Path path) {
  switch (path) {
    case Path::Avx512: return "avx512";
    case Path::Avx2: return "avx2";
    case Path::Portable: return "portable";
    default: return "auto";
  }
}

int num_threads() { return configured_threads(); }

bool supports(int group_size, int bits) {
  if (group_size <= 0) return false;
  switch (bits) {
    case 2: case 4: case 8: return group_size % (32 / bits) == 0;
    case 3: case 5: case 6: return group_size % 8 == 0;  // whole bytes per group
    default: return false;
  }
}

mx::array quantized_matmul(
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
  auto floating = [](mx::Dtype d) { return d == mx::float32 || d == mx::float16 || d == mx::bfloat16; };
  if (stream.device != mx::Device::cpu || !supports(group_size, bits) || w.ndim() != 2 || scales.ndim() != 2 ||
      x.ndim() < 1 || !floating(x.dtype()) || !floating(scales.dtype()) || scales.dtype() != biases.dtype() ||
      !floating(ref.dtype()) || ref.size() == 0) {
    return ref;
  }
  auto rc = [&](const mx::array& a) { return known_row_contiguous(a) ? a : mx::contiguous(a, false, stream); };
  return mx::array(ref.shape(), ref.dtype(), std::make_shared<QuantizedMatvec>(stream, group_size, bits, path),
                   {x, rc(w), rc(scales), rc(biases)});
}

}  // namespace mlxcel::kernels
