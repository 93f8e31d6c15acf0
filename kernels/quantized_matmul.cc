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

#include "cpu_features.h"
#include "detail.h"
#include "simd_math.h"
#include "weight_arena.h"

#ifdef MLXCEL_X86
// GCC 12 reports the `_mm512_undefined_*` idiom inside its own AVX-512
// intrinsics as -Wmaybe-uninitialized; the warnings are false positives.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
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

#ifdef MLXCEL_X86
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
#endif  // MLXCEL_X86

// n elements of p from element `at` on, `step` apart, as f32 into dst, with
// the row converter of `path`'s instruction set where step is 1.
void convert_row_for(Path path, const void* p, Ty ty, size_t at, int64_t step, int n, float* dst) {
  if (step != 1) {
    for (int i = 0; i < n; ++i) dst[i] = load_as_f32(p, ty, at + (size_t)i * step);
    return;
  }
#ifdef MLXCEL_X86
  if (path == Path::Avx512 || path == Path::Avx512Vnni) return convert_row_avx512(p, ty, at, n, dst);
  if (path == Path::Avx2 || path == Path::Avx2Int8) return convert_row_avx2(p, ty, at, n, dst);
#endif
  convert_row_portable(p, ty, at, n, dst);
}

// ---------------------------------------------------------------------------
// CPU features and path selection.

// The best path at or below `want` that this CPU runs: NeonInt8 (asked for)
// or Portable on aarch64, Portable on any CPU but x86-64 and aarch64.
Path best_supported(Path want) {
  const cpu::Features& f = cpu::features();
  switch (want) {
    case Path::NeonInt8:
      return f.neon ? Path::NeonInt8 : Path::Portable;
    case Path::Avx512Vnni:
      if (f.avx512_vnni) return Path::Avx512Vnni;
      if (f.avx512) return Path::Avx512;
      return f.avx2 ? Path::Avx2Int8 : Path::Portable;
    case Path::Avx512:
      if (f.avx512) return Path::Avx512;
      return f.avx2 ? Path::Avx2 : Path::Portable;
    case Path::Avx2Int8:
      return f.avx2 ? Path::Avx2Int8 : Path::Portable;
    case Path::Avx2:
      return f.avx2 ? Path::Avx2 : Path::Portable;
    default:
      return Path::Portable;
  }
}

Path env_path();
Path resolve_path_impl(Path requested) { return requested == Path::Auto ? env_path() : best_supported(requested); }

Path env_path() {
  static const Path path = [] {
    const char* env = std::getenv("MLXCEL_KERNELS");
    std::string v = env ? env : "";
    if (v == "portable") return Path::Portable;
    if (v == "avx2") return best_supported(Path::Avx2);
    if (v == "avx2-int8") return best_supported(Path::Avx2Int8);
    if (v == "avx512") return best_supported(Path::Avx512);
    if (v == "neon-int8") return best_supported(Path::NeonInt8);
    return cpu::features().neon ? best_supported(Path::NeonInt8) : best_supported(Path::Avx512Vnni);
  }();
  return path;
}

// A hint to the core that this thread is spinning.
inline void cpu_relax() {
#ifdef MLXCEL_X86
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
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
      std::thread([this, i] { worker(i - 1); }).detach();
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
      if (spins < 4096) cpu_relax();
      else std::this_thread::yield();
    }
  }

  // Sets the regions that idle workers pull into their caches
  // (detail::prefetch_for_workers).
  void set_hint(const detail::PrefetchRegion* regions, int count) {
    if (threads_ == 1) return;
    count = std::min(count, detail::kPrefetchRegions);
    for (int i = 0; i < count; ++i) {
      hint_regions_[i].data.store(regions[i].data, std::memory_order_relaxed);
      hint_regions_[i].bytes.store(regions[i].bytes, std::memory_order_relaxed);
    }
    hint_count_.store(count, std::memory_order_relaxed);
    hint_seq_.fetch_add(1, std::memory_order_release);
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

  // Pulls worker `index`'s likely share of the hinted regions (the caller
  // takes the first task, worker i the (i+2)-th share) toward its L2, until
  // a job is published. Prefetches never fault, so a hint rewritten while it
  // is read, or memory freed since, costs at most some wasted lines.
  void prefetch_hint(int index, uint64_t seen_gen, uint64_t seq) {
    const int count = hint_count_.load(std::memory_order_relaxed);
    size_t budget = kHintBytes;
    for (int r = 0; r < count && budget > 0; ++r) {
      const auto* base = static_cast<const char*>(hint_regions_[r].data.load(std::memory_order_relaxed));
      const size_t bytes = hint_regions_[r].bytes.load(std::memory_order_relaxed);
      if (hint_seq_.load(std::memory_order_acquire) != seq) return;  // rewritten meanwhile
      const size_t share = bytes / threads_;
      const char* p = base + share * (size_t)(index + 1);
      const char* end = p + std::min(share, budget);
      budget -= (size_t)(end - p);
      while (p < end) {
        const char* chunk_end = std::min(end, p + 4096);
        for (; p < chunk_end; p += 64) __builtin_prefetch(p, 0, 2);
        if (gen_.load(std::memory_order_acquire) != seen_gen) return;
      }
    }
  }

  void worker(int index) {
    uint64_t seen = 0, hint_seen = 0;
    while (true) {
      uint64_t gen = gen_.load(std::memory_order_acquire);
      if (gen == seen) {
        auto start = std::chrono::steady_clock::now();
        int spins = 0;
        while ((gen = gen_.load(std::memory_order_acquire)) == seen) {
          const uint64_t seq = hint_seq_.load(std::memory_order_acquire);
          if (seq != hint_seen) {
            hint_seen = seq;
            prefetch_hint(index, seen, seq);
            continue;
          }
          cpu_relax();
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
  // Each atomic on its own cache line: the claims and completions of a job
  // must not invalidate the line the idle workers spin on.
  alignas(64) std::atomic<uint64_t> gen_{0};
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  // Bytes a worker pulls per hint: the first part of its share, well within
  // an L2 (1 MiB on Zen 4 and 5, 2 MiB on Sapphire Rapids), which also holds
  // what the job itself streams.
  static constexpr size_t kHintBytes = 256 * 1024;
  struct HintRegion {
    std::atomic<const void*> data{nullptr};
    std::atomic<size_t> bytes{0};
  };
  alignas(64) std::atomic<uint64_t> hint_seq_{0};
  std::atomic<int> hint_count_{0};
  HintRegion hint_regions_[detail::kPrefetchRegions];
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
  // Avx512Vnni: per row of x, `planes` int8 planes of chunks*16 dwords each
  // (bits 8: a, b; bits 4: a of even values, a of odd, b even, b odd), and
  // the per-group scales s of x ~ s * (a + b / 256).
  const int8_t* xq = nullptr;
  size_t xq_stride = 0;  // bytes per row of x
  const float* xscale = nullptr;  // [M, G]
  // Avx512Vnni, and Avx2Int8 for bits 4 and 8: the full blocks of 16 rows as
  // detail::VnniRows lays them out (null: every block is read from w).
  const uint8_t* vnni_rows = nullptr;
  float* y = nullptr;           // [M, N] f32 results
  int rows_per_task = 0;
  // Rows ahead whose weights the SIMD loops prefetch: about 12 KiB, so the
  // next rows arrive from L3 while these compute (prefetching never faults,
  // so running past the last row is harmless).
  int prefetch_rows = 0;
  // Prefetch into L2 (T1) instead of L1 (T0): AMD Zen (cpu::Features::amd).
  bool prefetch_l2 = false;
  // Avx512Vnni, bits 4 and 8, with a copy, on AMD: the 16-row blocks run
  // rows_zmm_int16_blocks on Avx2Int8's int16 activations (xq) instead of
  // the VNNI loop.
  bool int16_blocks = false;
  Path path = Path::Portable;
};

// The loops that read the interleaved copies (detail::VnniRows): VNNI, and
// the AVX2 integer block loop for bits 4 and 8.
bool reads_vnni_rows(Path path, int bits) {
  return path == Path::Avx512Vnni || (path == Path::Avx2Int8 && (bits == 4 || bits == 8));
}

// Whether j (its copy set) runs rows_zmm_int16_blocks: 4- and 8-bit weights
// with a copy on the VNNI path of an AMD CPU (measured on Zen 5; Intel keeps
// the VNNI loop, unmeasured there).
bool runs_int16_blocks(const Job& j) {
  return j.vnni_rows && j.path == Path::Avx512Vnni && (j.bits == 4 || j.bits == 8) && cpu::features().amd;
}

#ifdef MLXCEL_X86
// Rows n .. n+15 of j's interleaved copy, as detail::VnniRows lays a block
// out: [G][16] scales and [G][16] biases (elements of j.sty), then [wpr][16]
// words. All null where j has no copy or the rows are not one full block.
struct CopyBlock {
  const uint8_t* scales = nullptr;
  const uint8_t* biases = nullptr;
  const uint32_t* words = nullptr;
};

CopyBlock copy_block(const Job& j, int n) {
  if (!j.vnni_rows || n % 16 != 0 || n + 16 > j.N) return {};
  const size_t group_block = 16 * (size_t)j.G * (j.sty == Ty::F32 ? 4 : 2);
  const uint8_t* block = j.vnni_rows + (size_t)(n / 16) * (2 * group_block + (size_t)j.wpr * 64);
  return {block, block + group_block, reinterpret_cast<const uint32_t*>(block + 2 * group_block)};
}

// Requests the weight line at `p`, j.prefetch_rows rows ahead of the loop.
__attribute__((always_inline)) inline void prefetch_weights(const Job& j, const void* p) {
  if (j.prefetch_l2) {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  } else {
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  }
}
#endif

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
// Portable loop: any bits, one output row at a time. Plain C++ written for
// the compiler's vectorizer (NEON on aarch64, SSE2 on x86-64): each row is
// unpacked to f32 once (bits 2, 4, 8: constant shifts per word), then every
// activation row is dotted with it group by group (detail::dot).

template <int BITS>
void unpack_row_pow2(const uint32_t* words, int n_words, float* q) {
  constexpr int EPW = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  for (int w = 0; w < n_words; ++w) {
    const uint32_t v = words[w];
    for (int s = 0; s < EPW; ++s) q[w * EPW + s] = (float)(int)((v >> (BITS * s)) & MASK);
  }
}

// Bits 3, 5, 6: value k sits at bit k * bits of the row's little-endian stream.
void unpack_row_any(const uint8_t* row, size_t row_bytes, int bits, int k, float* q) {
  const uint32_t mask = (1u << bits) - 1;
  for (int i = 0; i < k; ++i) {
    const size_t bit = (size_t)i * bits;
    uint32_t v = 0;
    std::memcpy(&v, row + bit / 8, std::min<size_t>(4, row_bytes - bit / 8));
    q[i] = (float)(int)((v >> (bit % 8)) & mask);
  }
}

void rows_portable(const Job& j, int n0, int n1) {
  RowScratch& sc = tl_scratch;
  sc.ensure(j.G, 16);
  thread_local std::vector<float> q;
  q.resize(j.K);
  for (int n = n0; n < n1; ++n) {
    convert_row_portable(j.scales, j.sty, (size_t)n * j.G, j.G, sc.s.data());
    convert_row_portable(j.biases, j.sty, (size_t)n * j.G, j.G, sc.b.data());
    const uint8_t* row = j.w + (size_t)n * j.row_bytes;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(row);
    switch (j.bits) {
      case 2: unpack_row_pow2<2>(words, j.K / 16, q.data()); break;
      case 4: unpack_row_pow2<4>(words, j.K / 8, q.data()); break;
      case 8: unpack_row_pow2<8>(words, j.K / 4, q.data()); break;
      default: unpack_row_any(row, j.row_bytes, j.bits, j.K, q.data()); break;
    }
    for (int m = 0; m < j.M; ++m) {
      const float* x = j.xf + (size_t)m * j.K;
      const float* xs = j.xsum + (size_t)m * j.G;
      float acc = 0.0f;
      for (int g = 0; g < j.G; ++g) {
        const size_t k0 = (size_t)g * j.group;
        acc += sc.s[g] * detail::dot(x + k0, q.data() + k0, j.group) + sc.b[g] * xs[g];
      }
      j.y[(size_t)m * j.N + n] = acc;
    }
  }
}

#ifdef MLXCEL_X86
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

// The end of an AVX-512 tile: the bias term, sum_g bias[g] * xsum[m, g],
// joins each vector sum, which is reduced and stored.
template <int MT, int NR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"), always_inline)) inline void
finish_tile_avx512(const Job& j, __m512 (&y)[NR][MT], const float* bf, size_t gs, int m0, int n) {
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
    for (int r = 0; r < NR; ++r) {
      prefetch_weights(j, wr + (r + j.prefetch_rows) * rw + c * 16);
      v[r] = _mm512_maskz_loadu_epi32(km, wr + r * rw + c * 16);
    }
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
  finish_tile_avx512<MT, NR>(j, y, bf, gs, m0, n);
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

// The end of an AVX2 tile: the bias term, sum_g bias[g] * xsum[m, g], joins
// each vector sum, which is reduced and stored.
template <int MT, int NR>
__attribute__((target("avx2,fma"), always_inline)) inline void
finish_tile_avx2(const Job& j, __m256 (&y)[NR][MT], const float* bf, size_t gs, int m0, int n) {
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
      j.y[(size_t)(m0 + m) * j.N + n + r] = simd::hsum256(y[r][m]) + b;
    }
  }
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
  finish_tile_avx2<MT, NR>(j, y, bf, gs, m0, n);
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
// AVX2 integer loops (bits 2, 4, 8): the AVX2 counterpart of the VNNI loop,
// with vpmaddwd (16-bit products summed in pairs into 32 bits). Each group of
// activations is quantized to int16, x ~ s * x16 with s = max|x| / 32512,
// so the error per activation is at most max|x| / 65024, as on VNNI. A
// word's low 16 bits hold its values 0 .. EPW/2-1 and its high 16 bits the
// rest, so for p < EPW/2, (v >> BITS*p) & (QM | QM << 16) puts value p in
// the low half and value EPW/2 + p in the high half of each dword, and
// vpmaddwd against activation plane p, which holds the matching pair
// (x[p], x[EPW/2 + p]) per word, adds both products into one dword.
//
// Read in place, groups smaller than a chunk (tile_avx2_int8: 4-bit groups of
// 32, 2-bit of 32 and 64): a chunk is 8 words of a row (lane l holds word
// c*8 + l). Per chunk the int32 sum is exact (at most EPW * QM * 32512:
// 3.9e6 for bits 4, below 2^24, so its f32 conversion is exact too).
// Groups of whole chunks read in place (row_avx2_int8_groups) sum each group
// in int32 first, below.
//
// Bits 4 and 8 with the interleaved copy (tile_avx2_int8_blocks): as on VNNI,
// output rows in blocks of 16, one row per 32-bit lane (two vectors of 8
// rows), from the copy (detail::VnniRows: word k of the 16 rows together),
// and a last block of fewer rows transposed into the same layout from the
// rows. On one Zen 5 core it streams an 8-bit copy 1.0-2.6x as fast as the
// chunk loop reads the rows (4-bit: whole-model decode 1.3-1.4x); read in
// place, the transposition costs more than it saves (up to 2x slower), so a
// weight without a copy keeps the chunk loop. Each lane sums a group in
// int32, exactly (at most 64 words at a time: 64 * 4 * 255 * 32512 < 2^31
// for bits 8, 64 * 8 * 15 * 32512 for bits 4), and
// the float epilogue runs once per group and row: y += f32(sum) * s_w * s_x
// + bias * sum(x) (the chunk loop's epilogue runs per row and chunk). A
// row's result depends on its own lane alone: the same whatever M is,
// wherever the row falls in a block. The two loops round differently
// (within the same bound), so a weight's copy changes its last bits.

// `count` (1..8) scales or biases of dtype `ty` from element `at` on, as
// f32 lanes 0..count-1 (zero above). The tiles read the checkpoint's f16 or
// bf16 rows in place instead of converting them into a scratch row first.
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load_groups_avx2(const void* p, Ty ty, size_t at,
                                                                                      int count) {
  if (ty == Ty::F32) {
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    return _mm256_maskload_ps(static_cast<const float*>(p) + at, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
  }
  const uint16_t* src = static_cast<const uint16_t*>(p) + at;
  __m128i h;
  switch (count) {
    case 8: h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src)); break;
    case 4: {
      int64_t v;
      std::memcpy(&v, src, sizeof v);
      h = _mm_cvtsi64_si128(v);
      break;
    }
    case 2: {
      int32_t v;
      std::memcpy(&v, src, sizeof v);
      h = _mm_cvtsi32_si128(v);
      break;
    }
    case 1: h = _mm_cvtsi32_si128(src[0]); break;
    default: {
      uint16_t buf[8] = {};
      std::memcpy(buf, src, (size_t)count * sizeof(uint16_t));
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(buf));
    }
  }
  return ty == Ty::F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Activation rows m0 .. m0+MT-1 against halves h0 .. h0+NH-1 (8 rows each)
// of one block of 16 output rows n .. (`valid` of them stored): `words`
// [wpr][16], `scales` and `biases` [G][16] elements of j.sty, as
// detail::VnniRows lays a block out. `ahead`: bytes ahead of `words` to
// prefetch (0: none).
template <int BITS, int MT, int NH>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void tile_avx2_int8_blocks(
    const Job& j, const uint32_t* words, const uint8_t* scales, const uint8_t* biases, int m0, int n, int h0,
    int valid, size_t ahead) {
  constexpr int EPW = 32 / BITS, PLANES = EPW / 2;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const __m256i mask = _mm256_set1_epi32((int)(QM | (QM << 16)));
  const int wpr = j.wpr, wpg = j.wpg, G = j.G;
  // Words summed in int32 before the epilogue: the group, or at most 64.
  const int span = wpg <= 64 ? wpg : std::gcd(wpg, 64);
  const int32_t* xq[MT];
  const float *xs[MT], *xsum[MT];
  for (int m = 0; m < MT; ++m) {
    xq[m] = reinterpret_cast<const int32_t*>(j.xq + (size_t)(m0 + m) * j.xq_stride);
    xs[m] = j.xscale + (size_t)(m0 + m) * G;
    xsum[m] = j.xsum + (size_t)(m0 + m) * G;
  }
  __m256 y[MT][NH];
  __m256i acc[MT][NH];
  for (int m = 0; m < MT; ++m) {
    for (int h = 0; h < NH; ++h) {
      y[m][h] = _mm256_setzero_ps();
      acc[m][h] = _mm256_setzero_si256();
    }
  }
  int g = 0, in_group = 0, in_span = 0;
  for (int k = 0; k < wpr; ++k) {
    const uint32_t* at = words + (size_t)k * 16 + 8 * h0;
    if (ahead) prefetch_weights(j, reinterpret_cast<const char*>(at) + ahead);
    __m256i v[NH];
    for (int h = 0; h < NH; ++h) v[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 8 * h));
    // Word k's pair in plane p: int32 (k / 8 * PLANES + p) * 8 + k % 8.
    const size_t pair = (size_t)(k / 8) * PLANES * 8 + k % 8;
#pragma GCC unroll 8
    for (int p = 0; p < PLANES; ++p) {
      __m256i q[NH];
      for (int h = 0; h < NH; ++h) {
        if constexpr (BITS == 8) {
          q[h] = p == 0 ? _mm256_and_si256(v[h], mask) : _mm256_srli_epi16(v[h], 8);
        } else {
          q[h] = _mm256_and_si256(p == 0 ? v[h] : _mm256_srli_epi32(v[h], BITS * p), mask);
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_set1_epi32(xq[m][pair + (size_t)p * 8]);
        for (int h = 0; h < NH; ++h) acc[m][h] = _mm256_add_epi32(acc[m][h], _mm256_madd_epi16(q[h], xv));
      }
    }
    if (++in_span == span) {
      in_span = 0;
      const bool group_end = (in_group += span) == wpg;
      for (int h = 0; h < NH; ++h) {
        const size_t at_group = (size_t)g * 16 + 8 * (h0 + h);
        const __m256 ws = load_groups_avx2(scales, j.sty, at_group, 8);
        const __m256 bs = group_end ? load_groups_avx2(biases, j.sty, at_group, 8) : _mm256_setzero_ps();
        for (int m = 0; m < MT; ++m) {
          y[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][h]), _mm256_mul_ps(ws, _mm256_set1_ps(xs[m][g])), y[m][h]);
          if (group_end) y[m][h] = _mm256_fmadd_ps(bs, _mm256_set1_ps(xsum[m][g]), y[m][h]);
          acc[m][h] = _mm256_setzero_si256();
        }
      }
      if (group_end) {
        in_group = 0;
        ++g;
      }
    }
  }
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int m = 0; m < MT; ++m) {
    float* out = j.y + (size_t)(m0 + m) * j.N + n;
    for (int h = 0; h < NH; ++h) {
      const int half = h0 + h, count = std::min(8, valid - 8 * half);
      if (count == 8) {
        _mm256_storeu_ps(out + 8 * half, y[m][h]);
      } else if (count > 0) {
        _mm256_maskstore_ps(out + 8 * half, _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane), y[m][h]);
      }
    }
  }
}

// Row l's G scales and biases (elements of `element` bytes from `at` on)
// into lane l of a block's [G][16] scales and, group_block bytes on, biases.
inline void gather_groups(const void* scales, const void* biases, size_t element, size_t at, int G, int l,
                          uint8_t* out, size_t group_block) {
  auto gather = [&](auto type_tag) {
    using T = decltype(type_tag);
    const T* s = static_cast<const T*>(scales) + at;
    const T* b = static_cast<const T*>(biases) + at;
    T* os = reinterpret_cast<T*>(out) + l;
    T* ob = reinterpret_cast<T*>(out + group_block) + l;
    for (int g = 0; g < G; ++g) {
      os[(size_t)g * 16] = s[g];
      ob[(size_t)g * 16] = b[g];
    }
  };
  if (element == 4) gather(uint32_t{});
  else gather(uint16_t{});
}

// A block of `valid` (< 16, or a block without a copy) rows from n read in
// place, transposed into the copy's layout (detail::VnniRows) in this
// thread's buffers; a short block repeats its last row in the unused lanes.
// Returns the words and sets *groups to the block's scales (biases follow
// 16 * G elements on).
__attribute__((target("avx2,fma,f16c"))) const uint32_t* block_in_place(const Job& j, int n, int valid,
                                                                      const uint8_t** groups_out) {
  const int G = j.G, wpr = j.wpr;
  const size_t element = j.sty == Ty::F32 ? 4 : 2;
  const size_t group_block = 16 * (size_t)G * element;
  thread_local std::vector<uint32_t> words;
  thread_local std::vector<uint8_t> groups;
  words.resize((size_t)wpr * 16);
  groups.resize(2 * group_block);
  const uint32_t* rows[16];
  for (int l = 0; l < 16; ++l) {
    const size_t row = (size_t)n + std::min(l, valid - 1);
    rows[l] = reinterpret_cast<const uint32_t*>(j.w + row * j.row_bytes);
    gather_groups(j.scales, j.biases, element, row * G, G, l, groups.data(), group_block);
  }
  for (int w0 = 0; w0 < wpr; w0 += 8) {
    const int count = std::min(8, wpr - w0);
    if (w0 % 16 == 0) {
      // The rows are read once, in order: fetch ahead of the hardware prefetcher.
      for (int l = 0; l < 16; ++l) prefetch_weights(j, rows[l] + (size_t)j.prefetch_rows * wpr + w0);
    }
    for (int h = 0; h < 2; ++h) {
      __m256i t[8];
      simd::transpose8_words(rows + 8 * h, (size_t)w0, count, t);
      for (int k = 0; k < count; ++k) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(words.data() + (size_t)(w0 + k) * 16 + 8 * h), t[k]);
      }
    }
  }
  *groups_out = groups.data();
  return words.data();
}

// The block of 16 rows from n: from the copy (with the distance its words
// are fetched ahead at, whose scales and biases are fetched here), or read in
// place.
struct BlockSource {
  const uint32_t* words;
  const uint8_t* scales;
  size_t ahead;
};

// The distance ahead the tiles fetch a copy's words at (as far as the row
// loops fetch, in one stream); fetches the scales and biases of the block
// that far ahead, which a block reads first (else they stall its start).
size_t fetch_block_header_ahead(const Job& j, const CopyBlock& block) {
  const size_t ahead = (size_t)j.prefetch_rows * j.row_bytes;
  const size_t header = (size_t)(reinterpret_cast<const uint8_t*>(block.words) - block.scales);
  for (size_t b = 0; b < header; b += 64) prefetch_weights(j, block.scales + ahead + b);
  return ahead;
}

BlockSource block_source(const Job& j, int n, int valid) {
  if (const CopyBlock block = copy_block(j, n); block.words) {
    return {block.words, block.scales, fetch_block_header_ahead(j, block)};
  }
  const uint8_t* groups = nullptr;
  const uint32_t* words = block_in_place(j, n, valid, &groups);
  return {words, groups, 0};
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2_int8_blocks(const Job& j, int n0, int n1) {
  const size_t group_block = 16 * (size_t)j.G * (j.sty == Ty::F32 ? 4 : 2);
  for (int n = n0; n < n1; n += 16) {
    const int valid = std::min(16, n1 - n);
    const BlockSource src = block_source(j, n, valid);
    const uint32_t* w = src.words;
    const uint8_t* sb = src.scales;
    const size_t ahead = src.ahead;
    const uint8_t* bb = sb + group_block;
    if (j.M <= 2) {
      // Both halves at once: two independent sums per row.
      if (j.M == 2) tile_avx2_int8_blocks<BITS, 2, 2>(j, w, sb, bb, 0, n, 0, valid, ahead);
      else tile_avx2_int8_blocks<BITS, 1, 2>(j, w, sb, bb, 0, n, 0, valid, ahead);
      continue;
    }
    // 4 activation rows per weight vector, a half at a time (8 sums and 8
    // results in the 16 registers).
    for (int h = 0; h < 2 && 8 * h < valid; ++h) {
      int m = 0;
      for (; m + 4 <= j.M; m += 4) tile_avx2_int8_blocks<BITS, 4, 1>(j, w, sb, bb, m, n, h, valid, m == 0 ? ahead : 0);
      switch (j.M - m) {
        case 3: tile_avx2_int8_blocks<BITS, 3, 1>(j, w, sb, bb, m, n, h, valid, 0); break;
        case 2: tile_avx2_int8_blocks<BITS, 2, 1>(j, w, sb, bb, m, n, h, valid, 0); break;
        case 1: tile_avx2_int8_blocks<BITS, 1, 1>(j, w, sb, bb, m, n, h, valid, 0); break;
        default: break;
      }
    }
  }
}

// The chunk lambda below needs the target too (GCC gives lambdas none of
// their enclosing function's target attributes).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// GPC: the groups a chunk of 8 words spans (8 / words per group: 2, 4 or 8).
template <int BITS, int GPC, int MT, int NR>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void tile_avx2_int8(const Job& j, int m0, int n) {
  constexpr int EPW = 32 / BITS;
  constexpr int PLANES = EPW / 2;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const int chunks = j.chunks, G = j.G;
  const int tail_words = j.wpr - (chunks - 1) * 8;
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail_words), lane);
  const int wpg = j.wpg;
  const size_t rw = j.wpr;
  // Lane l's group within the chunk.
  const __m256i gidx = _mm256_srli_epi32(lane, __builtin_ctz(wpg));
  const __m256i mask = _mm256_set1_epi32((int)(QM | (QM << 16)));
  const uint32_t* wr = reinterpret_cast<const uint32_t*>(j.w + (size_t)n * j.row_bytes);

  const int16_t* xq[MT];
  const float* xs[MT];
  for (int m = 0; m < MT; ++m) {
    xq[m] = reinterpret_cast<const int16_t*>(j.xq + (size_t)(m0 + m) * j.xq_stride);
    xs[m] = j.xscale + (size_t)(m0 + m) * G;
  }
  __m256 y[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) y[r][m] = _mm256_setzero_ps();

  // One chunk; `last` (the final chunk) masks its words and reads only the
  // groups left in the row.
  auto chunk = [&](int c, bool last) __attribute__((always_inline)) {
    const int g0 = c * GPC;
    __m256 xscale[MT];
    for (int m = 0; m < MT; ++m) {
      xscale[m] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xs[m] + g0), gidx);
    }
    for (int r = 0; r < NR; ++r) {
      const uint32_t* p = wr + r * rw + c * 8;
      prefetch_weights(j, p + j.prefetch_rows * rw);
      const __m256i v = last ? _mm256_maskload_epi32(reinterpret_cast<const int*>(p), tail)
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const size_t at = (size_t)(n + r) * G + g0;
      const __m256 ws = last ? load_groups_avx2(j.scales, j.sty, at, std::min(GPC, G - g0))
                             : load_groups_avx2(j.scales, j.sty, at, GPC);
      const __m256 wscale = _mm256_permutevar8x32_ps(ws, gidx);
      __m256i acc[MT];
#pragma GCC unroll 8
      for (int s = 0; s < PLANES; ++s) {
        const __m256i q = _mm256_and_si256(s == 0 ? v : _mm256_srli_epi32(v, BITS * s), mask);
        for (int m = 0; m < MT; ++m) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + ((size_t)c * PLANES + s) * 16));
          const __m256i d = _mm256_madd_epi16(q, xv);
          acc[m] = s == 0 ? d : _mm256_add_epi32(acc[m], d);
        }
      }
      for (int m = 0; m < MT; ++m) {
        y[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_mul_ps(wscale, xscale[m]), y[r][m]);
      }
    }
  };
  for (int c = 0; c + 1 < chunks; ++c) chunk(c, false);
  chunk(chunks - 1, true);

  // The bias term, sum_g bias[g] * xsum[m, g] (xsum is zero-padded past its
  // last row, so the vector read of a row's last groups stays finite).
  for (int r = 0; r < NR; ++r) {
    for (int g = 0; g < G; g += 8) {
      const __m256 bv = load_groups_avx2(j.biases, j.sty, (size_t)(n + r) * G + g, std::min(8, G - g));
      for (int m = 0; m < MT; ++m) {
        y[r][m] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(j.xsum + (size_t)(m0 + m) * G + g), y[r][m]);
      }
    }
    for (int m = 0; m < MT; ++m) j.y[(size_t)(m0 + m) * j.N + n + r] = simd::hsum256(y[r][m]);
  }
}

template <int BITS, int GPC>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2_int8(const Job& j, int n0, int n1) {
  int n = n0;
  if (j.M == 1) {
    for (; n + 4 <= n1; n += 4) tile_avx2_int8<BITS, GPC, 1, 4>(j, 0, n);
  } else {
    // 2 x 4 tiles (8 accumulators of the 16 ymm registers): each weight
    // vector serves 2 activation rows and each activation vector 4 outputs.
    for (; n + 4 <= n1; n += 4) {
      int m = 0;
      for (; m + 2 <= j.M; m += 2) tile_avx2_int8<BITS, GPC, 2, 4>(j, m, n);
      if (m < j.M) tile_avx2_int8<BITS, GPC, 1, 4>(j, m, n);
    }
  }
  for (; n < n1; ++n) {
    int m = 0;
    for (; m + 4 <= j.M; m += 4) tile_avx2_int8<BITS, GPC, 4, 1>(j, m, n);
    switch (j.M - m) {
      case 3: tile_avx2_int8<BITS, GPC, 3, 1>(j, m, n); break;
      case 2: tile_avx2_int8<BITS, GPC, 2, 1>(j, m, n); break;
      case 1: tile_avx2_int8<BITS, GPC, 1, 1>(j, m, n); break;
      default: break;
    }
  }
}

// Read in place when a group spans whole chunks (words per group a multiple
// of 8: bits 8 with groups of 32 and up, bits 4 of 64 and up; the tied
// embeddings' logits), one output row and one activation row at a time. Each
// lane sums its words of a group over the group's chunks in int32; 4 groups'
// vectors are then summed across lanes into one vector with a lane per group
// (vphaddd), exact in int32 (at most group * QM * 32512: 2.12e9 < 2^31 for
// bits 8 and the group of 256 that make_job allows) and rounded once to f32.
// The float epilogue runs once per 4 groups instead of once per chunk.

// The int32 sums of group g's products, one per lane (CPG: chunks per group,
// 0 when only known at run time).
template <int BITS, int CPG>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256i group_dot_avx2(const __m256i* words,
                                                                                     const __m256i* xq, int g,
                                                                                     int chunks_per_group) {
  constexpr int PLANES = 16 / BITS;
  constexpr uint32_t QM = (1u << BITS) - 1;
  const __m256i mask = _mm256_set1_epi32((int)(QM | (QM << 16)));
  const int cpg = CPG ? CPG : chunks_per_group;
  __m256i acc = _mm256_setzero_si256();
  for (int c = g * cpg; c < (g + 1) * cpg; ++c) {
    const __m256i v = _mm256_loadu_si256(words + c);
#pragma GCC unroll 8
    for (int s = 0; s < PLANES; ++s) {
      const __m256i q = _mm256_and_si256(s == 0 ? v : _mm256_srli_epi32(v, BITS * s), mask);
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(q, _mm256_loadu_si256(xq + (size_t)c * PLANES + s)));
    }
  }
  return acc;
}

template <int BITS, int CPG>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void row_avx2_int8_groups(const Job& j, int m, int n) {
  const int G = j.G, cpg = j.wpg / 8;
  const __m256i* words = reinterpret_cast<const __m256i*>(j.w + (size_t)n * j.row_bytes);
  const __m256i* xq = reinterpret_cast<const __m256i*>(j.xq + (size_t)m * j.xq_stride);
  const float* xs = j.xscale + (size_t)m * G;
  const float* xsum = j.xsum + (size_t)m * G;
  const size_t at = (size_t)n * G;
  __m128 y = _mm_setzero_ps();
  for (int g0 = 0; g0 < G; g0 += 4) {
    const int count = std::min(4, G - g0);
    __m256i acc[4];
    if (count == 4) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[i] = group_dot_avx2<BITS, CPG>(words, xq, g0 + i, cpg);
    } else {
      for (int i = 0; i < 4; ++i) acc[i] = i < count ? group_dot_avx2<BITS, CPG>(words, xq, g0 + i, cpg) : _mm256_setzero_si256();
    }
    const __m256i u = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
    const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    const __m128 ws = _mm256_castps256_ps128(load_groups_avx2(j.scales, j.sty, at + g0, count));
    // The lanes past `count` have zero weight scales; xscale is zero-padded
    // past its last row, so they read finite values.
    y = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(ws, _mm_loadu_ps(xs + g0)), y);
  }
  // The bias term, sum_g bias[g] * xsum[m, g], as tile_avx2_int8 adds it.
  __m256 by = _mm256_setzero_ps();
  for (int g = 0; g < G; g += 8) {
    by = _mm256_fmadd_ps(load_groups_avx2(j.biases, j.sty, at + g, std::min(8, G - g)), _mm256_loadu_ps(xsum + g), by);
  }
  j.y[(size_t)m * j.N + n] = simd::hsum256(_mm256_add_ps(_mm256_castps128_ps256(y), by));
}

template <int BITS, int CPG>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2_int8_groups(const Job& j, int n0, int n1) {
  // No software prefetch: the rows stream in order, and fetching ahead made
  // the logits' weight slower (2.3 -> 2.4 ms per 8-bit call, one Zen 4 core).
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < j.M; ++m) row_avx2_int8_groups<BITS, CPG>(j, m, n);
  }
}

#pragma GCC pop_options

template <int BITS>
void rows_avx2_int8(const Job& j, int n0, int n1) {
  switch (j.wpg) {
    case 1: return rows_avx2_int8<BITS, 8>(j, n0, n1);
    case 2: return rows_avx2_int8<BITS, 4>(j, n0, n1);
    case 4: return rows_avx2_int8<BITS, 2>(j, n0, n1);
    case 8: return rows_avx2_int8_groups<BITS, 1>(j, n0, n1);
    default: return rows_avx2_int8_groups<BITS, 0>(j, n0, n1);  // a multiple of 8 (lanes_for)
  }
}

// ---------------------------------------------------------------------------
// AVX-512 VNNI loop (bits 4 and 8): integer dot products against activations
// quantized per group to two int8 halves, x ~ s * (a + b / 256). A block is
// 16 output rows, one per 32-bit lane: 8 words of the 16 rows at a time are
// transposed into 8 vectors (word k of every row in vector k), dotted with
// the matching 4 activation bytes broadcast to all lanes, so that each lane
// sums a whole group in int32. The float epilogue then runs once per group
// and row, and the lanes are the outputs (no horizontal sums). For bits 8 a
// word is 4 unsigned bytes in order, dotted with 4 bytes of a (and of b) by
// vpdpbusd. For bits 4 the low nibbles of the word's bytes are its values
// 0, 2, 4, 6 and the high nibbles 1, 3, 5, 7; the activation planes hold the
// matching even and odd values. Per group, (dot_a << 8) + dot_b is exact in
// int32 (|a| <= 127, |b| <= 128): at most group * 255 * (127 * 256 + 128)
// for bits 8, 2.131e9 < 2^31 up to the group of 256 that make_job allows. It
// converts to f32 once and is scaled by the row's weight scale times the
// activation scale / 256. A row's result depends on its own lane alone, the
// same whatever M is or wherever the row falls in a block.

// `count` (0..16) values of dtype `ty` from element `at` on, as f32 lanes
// 0..count-1 (zero above).
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) inline __m512
load16_as_f32(const void* p, Ty ty, size_t at, int count) {
  const __mmask16 k = (__mmask16)((1u << count) - 1);
  if (ty == Ty::F32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + at);
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + at);
  return ty == Ty::F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The scales or biases of a block's rows (row l's first at element at[l]) as
// f32, group-major: out[g * 16 + l]. 16 groups at a time are loaded (16 rows
// x 16 groups) and transposed.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c"), always_inline)) inline void
groups_by_lane(const void* p, Ty ty, const size_t (&at)[16], int G, float* out) {
  for (int g0 = 0; g0 < G; g0 += 16) {
    const int count = std::min(16, G - g0);
    __m512 r[16], t[16], u[16];
    for (int l = 0; l < 16; ++l) r[l] = load16_as_f32(p, ty, at[l] + g0, count);
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // u[4i + j], 128-bit lane L: rows 4i .. 4i+3 of group 4L + j.
    for (int i = 0; i < 16; i += 4) {
      u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
      u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
      u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xee);
      const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
      const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xee);
      const __m512 col[4] = {_mm512_shuffle_f32x4(v0, v2, 0x88), _mm512_shuffle_f32x4(v0, v2, 0xdd),
                             _mm512_shuffle_f32x4(v1, v3, 0x88), _mm512_shuffle_f32x4(v1, v3, 0xdd)};
      for (int L = 0; L < 4; ++L) {
        if (4 * L + j < count) _mm512_storeu_ps(out + (size_t)(g0 + 4 * L + j) * 16, col[L]);
      }
    }
  }
}

// The 4 bytes at p in every lane.
__attribute__((target("avx512f"), always_inline)) inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// Where a VNNI tile takes its weight vectors from: transposed from the rows
// (and kept for the block's next tiles), or as an earlier tile kept them.
enum class WeightSource { Transpose, TransposeAndKeep, Kept, Interleaved };

// Activation rows m0 .. m0+MT-1 against the block of 16 rows `rows` (output
// rows n ..; lanes outside `store` are not written), or with Interleaved
// against `interleaved` ([wpr][16] as detail::VnniRows stores them). st, bt: the block's f32
// scales and biases, 16 per group (lane l: row l). kept: the block's weight
// vectors as tile_vnni dots them (bits 4: low and high nibbles), 2 (bits 4)
// or 1 (bits 8) per word.
template <int BITS, int MT, WeightSource SRC>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma"), always_inline)) inline void
tile_vnni(const Job& j, const uint32_t* const (&rows)[16], const float* st, const float* bt, __m512i* kept, int m0,
          int n, __mmask16 store, const uint32_t* interleaved = nullptr) {
  constexpr int V = BITS == 4 ? 2 : 1;
  // Independent int32 sums per activation half and row, enough chains to
  // hide vpdpbusd's latency when MT is small (integer sums: the split does
  // not change the result).
  constexpr int NA = MT == 1 ? 4 : MT <= 3 ? 2 : 1;
  const int wpg = j.wpg, wpr = j.wpr;
  const size_t plane = (size_t)j.chunks * 64;  // bytes per activation plane
  const size_t rw = j.wpr;
  const __m512i nib = _mm512_set1_epi8(0x0f);

  const int8_t* xq[MT];
  const float* xs[MT];
  const float* xsum[MT];
  for (int m = 0; m < MT; ++m) {
    xq[m] = j.xq + (size_t)(m0 + m) * j.xq_stride;
    xs[m] = j.xscale + (size_t)(m0 + m) * j.G;
    xsum[m] = j.xsum + (size_t)(m0 + m) * j.G;
  }
  __m512i acc_a[MT][NA], acc_b[MT][NA];
  __m512 y[MT];
  for (int m = 0; m < MT; ++m) {
    y[m] = _mm512_setzero_ps();
    for (int i = 0; i < NA; ++i) acc_a[m][i] = acc_b[m][i] = _mm512_setzero_si512();
  }

  int g = 0, left = wpg;  // the current group, its words still to come
  for (int w0 = 0; w0 < wpr; w0 += 8) {
    const int words = std::min(8, wpr - w0);
    __m512i t[8];
    if constexpr (SRC == WeightSource::Interleaved) {
      const uint32_t* at = interleaved + (size_t)w0 * 16;
      if (w0 % 16 == 0) {
        // The same distance ahead as the row loop fetches, in one stream.
        const char* ahead = reinterpret_cast<const char*>(at) + (size_t)j.prefetch_rows * j.row_bytes;
        if (j.prefetch_l2) {
          for (int l = 0; l < 16; ++l) _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
        } else {
          for (int l = 0; l < 16; ++l) _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
        }
      }
      // Masked loads: the words past the row's end are never read.
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) t[k] = _mm512_maskz_loadu_epi32(k < words ? 0xffff : 0, at + k * 16);
    } else if constexpr (SRC != WeightSource::Kept) {
      if (w0 % 16 == 0) {
        // The rows are read once, in order: fetch ahead of the hardware
        // prefetcher, which alone leaves decode waiting on L3.
        for (int l = 0; l < 16; ++l) prefetch_weights(j, rows[l] + j.prefetch_rows * rw + w0);
      }
      simd::transpose16_words(rows, (size_t)w0, (__mmask8)((1u << words) - 1), t);
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      if (k == words) break;
      const size_t at = (size_t)(w0 + k) * 4;  // the word's activation bytes in each plane
      __m512i wv[V];
      __m512i* keep = kept + (size_t)(w0 + k) * V;
      if constexpr (SRC == WeightSource::Kept) {
        for (int v = 0; v < V; ++v) wv[v] = _mm512_load_si512(keep + v);
      } else {
        if constexpr (BITS == 4) {
          wv[0] = _mm512_and_si512(t[k], nib);
          wv[1] = _mm512_and_si512(_mm512_srli_epi32(t[k], 4), nib);
        } else {
          wv[0] = t[k];
        }
        if constexpr (SRC == WeightSource::TransposeAndKeep) {
          for (int v = 0; v < V; ++v) _mm512_store_si512(keep + v, wv[v]);
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int8_t* q = xq[m] + at;
        if constexpr (BITS == 4) {
          const int i = (2 * k) % NA, i1 = (2 * k + 1) % NA;
          acc_a[m][i] = _mm512_dpbusd_epi32(acc_a[m][i], wv[0], bcast4(q));
          acc_a[m][i1] = _mm512_dpbusd_epi32(acc_a[m][i1], wv[1], bcast4(q + plane));
          acc_b[m][i] = _mm512_dpbusd_epi32(acc_b[m][i], wv[0], bcast4(q + 2 * plane));
          acc_b[m][i1] = _mm512_dpbusd_epi32(acc_b[m][i1], wv[1], bcast4(q + 3 * plane));
        } else {
          const int i = k % NA;
          acc_a[m][i] = _mm512_dpbusd_epi32(acc_a[m][i], wv[0], bcast4(q));
          acc_b[m][i] = _mm512_dpbusd_epi32(acc_b[m][i], wv[0], bcast4(q + plane));
        }
      }
      if (--left == 0) {
        const __m512 ws = _mm512_loadu_ps(st + (size_t)g * 16), bs = _mm512_loadu_ps(bt + (size_t)g * 16);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          __m512i a = acc_a[m][0], b = acc_b[m][0];
          for (int i = 1; i < NA; ++i) {
            a = _mm512_add_epi32(a, acc_a[m][i]);
            b = _mm512_add_epi32(b, acc_b[m][i]);
          }
          const __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a, 8), b));
          y[m] = _mm512_fmadd_ps(d, _mm512_mul_ps(ws, _mm512_set1_ps(xs[m][g])), y[m]);
          y[m] = _mm512_fmadd_ps(bs, _mm512_set1_ps(xsum[m][g]), y[m]);
          for (int i = 0; i < NA; ++i) acc_a[m][i] = acc_b[m][i] = _mm512_setzero_si512();
        }
        ++g;
        left = wpg;
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(j.y + (size_t)(m0 + m) * j.N + n, store, y[m]);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))) void rows_vnni(const Job& j, int n0,
                                                                                                 int n1) {
  const int G = j.G;
  const size_t gs = (size_t)G;
  const size_t group_bytes = j.sty == Ty::F32 ? 4 : 2;
  // The block's scales and biases, group-major.
  thread_local std::vector<float> st, bt;
  st.resize(16 * gs);
  bt.resize(16 * gs);
  // The block's weight vectors, kept by its first pass when M > 4 (64-byte
  // aligned within the buffer).
  thread_local std::vector<int32_t> kept_words;
  if (j.M > 4) kept_words.resize((size_t)j.wpr * (BITS == 4 ? 2 : 1) * 16 + 16);
  __m512i* const kept =
      reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(kept_words.data()) + 63) & ~(uintptr_t)63);
  for (int n = n0; n < n1; n += 16) {
    if (const CopyBlock block = copy_block(j, n); block.words) {
      // A full block of the interleaved copy.
      fetch_block_header_ahead(j, block);
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(st.data() + (size_t)g * 16, load16_as_f32(block.scales, j.sty, (size_t)g * 16, 16));
        _mm512_storeu_ps(bt.data() + (size_t)g * 16, load16_as_f32(block.biases, j.sty, (size_t)g * 16, 16));
      }
      const uint32_t* words = block.words;
      const uint32_t* rows[16] = {};
      constexpr auto I = WeightSource::Interleaved;
      const float *s = st.data(), *b = bt.data();
      int m = 0;
      for (; m + 4 <= j.M; m += 4) tile_vnni<BITS, 4, I>(j, rows, s, b, kept, m, n, 0xffff, words);
      switch (j.M - m) {
        case 3: tile_vnni<BITS, 3, I>(j, rows, s, b, kept, m, n, 0xffff, words); break;
        case 2: tile_vnni<BITS, 2, I>(j, rows, s, b, kept, m, n, 0xffff, words); break;
        case 1: tile_vnni<BITS, 1, I>(j, rows, s, b, kept, m, n, 0xffff, words); break;
        default: break;
      }
      continue;
    }
    // A short last block repeats its last row in the unused lanes.
    const int valid = std::min(16, n1 - n);
    const uint32_t* rows[16];
    size_t group_at[16];
    for (int l = 0; l < 16; ++l) {
      const size_t row = (size_t)n + std::min(l, valid - 1);
      rows[l] = reinterpret_cast<const uint32_t*>(j.w + row * j.row_bytes);
      group_at[l] = row * gs;
    }
    // The scales and biases of the rows whose weights the tiles fetch ahead.
    const size_t ahead = (size_t)(n + j.prefetch_rows) * gs * group_bytes;
    for (size_t b = 0; b < 16 * gs * group_bytes; b += 64) {
      prefetch_weights(j, static_cast<const char*>(j.scales) + ahead + b);
      prefetch_weights(j, static_cast<const char*>(j.biases) + ahead + b);
    }
    groups_by_lane(j.scales, j.sty, group_at, G, st.data());
    groups_by_lane(j.biases, j.sty, group_at, G, bt.data());
    const __mmask16 store = (__mmask16)((1u << valid) - 1);
    // Up to 4 activation rows per pass share each weight vector (8 would
    // spill); past 4 rows the first pass keeps the transposed vectors for the
    // others.
    constexpr auto T = WeightSource::Transpose, TK = WeightSource::TransposeAndKeep, K = WeightSource::Kept;
    const float *s = st.data(), *b = bt.data();
    __m512i* const w = kept;
    if (j.M <= 4) {
      switch (j.M) {
        case 4: tile_vnni<BITS, 4, T>(j, rows, s, b, w, 0, n, store); break;
        case 3: tile_vnni<BITS, 3, T>(j, rows, s, b, w, 0, n, store); break;
        case 2: tile_vnni<BITS, 2, T>(j, rows, s, b, w, 0, n, store); break;
        case 1: tile_vnni<BITS, 1, T>(j, rows, s, b, w, 0, n, store); break;
        default: break;
      }
      continue;
    }
    tile_vnni<BITS, 4, TK>(j, rows, s, b, w, 0, n, store);
    int m = 4;
    for (; m + 4 <= j.M; m += 4) tile_vnni<BITS, 4, K>(j, rows, s, b, w, m, n, store);
    switch (j.M - m) {
      case 3: tile_vnni<BITS, 3, K>(j, rows, s, b, w, m, n, store); break;
      case 2: tile_vnni<BITS, 2, K>(j, rows, s, b, w, m, n, store); break;
      case 1: tile_vnni<BITS, 1, K>(j, rows, s, b, w, m, n, store); break;
      default: break;
    }
  }
}

// Bits 4 and 8 on the interleaved copy with 16-bit activations, all 16 rows
// of a block in one vector: the AVX2 block loop's arithmetic
// (tile_avx2_int8_blocks: per row a group's sum exact in int32, then y +=
// f32(sum) * (s_w * s_x) and, at the group's end, y += b_w * sum(x)) with
// vpdpwssd, so the results are the same bit for bit. On one Zen 5 core the
// AVX2 block loop streamed an 8-bit copy 1.3-1.6x as fast as the VNNI loop
// (which splits x into two int8 planes), and this loop took 4-bit decode
// from about 230 to 300-320 tok/s on one thread, so AMD CPUs run it for
// weights with copies.
template <int BITS, int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"), always_inline)) inline void
tile_zmm_int16_blocks(const Job& j, const uint32_t* words, const uint8_t* scales, const uint8_t* biases, int m0, int n,
                      int valid, size_t ahead) {
  constexpr int PLANES = 16 / BITS;  // int16 planes per word
  constexpr uint32_t QM = (1u << BITS) - 1;
  const __m512i mask = _mm512_set1_epi32((int)(QM | (QM << 16)));
  const int wpr = j.wpr, wpg = j.wpg;
  // Words summed in int32 before the epilogue: the group, or at most 64.
  const int span = wpg <= 64 ? wpg : std::gcd(wpg, 64);
  const int32_t* xq[MT];
  const float *xs[MT], *xsum[MT];
  for (int m = 0; m < MT; ++m) {
    xq[m] = reinterpret_cast<const int32_t*>(j.xq + (size_t)(m0 + m) * j.xq_stride);
    xs[m] = j.xscale + (size_t)(m0 + m) * j.G;
    xsum[m] = j.xsum + (size_t)(m0 + m) * j.G;
  }
  // Two independent chains of sums per row (planes alternate).
  __m512 y[MT];
  __m512i acc[MT][2];
  for (int m = 0; m < MT; ++m) {
    y[m] = _mm512_setzero_ps();
    acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  }
  int g = 0, in_group = 0, in_span = 0;
  for (int k = 0; k < wpr; ++k) {
    const uint32_t* at = words + (size_t)k * 16;
    if (ahead) prefetch_weights(j, reinterpret_cast<const char*>(at) + ahead);
    const __m512i v = _mm512_loadu_si512(at);
    __m512i q[PLANES];
    for (int p = 0; p < PLANES; ++p) {
      q[p] = BITS == 8 && p == 1 ? _mm512_srli_epi16(v, 8)
                                 : _mm512_and_si512(p == 0 ? v : _mm512_srli_epi32(v, BITS * p), mask);
    }
    // Word k's pair in plane p: int32 (k / 8 * PLANES + p) * 8 + k % 8.
    const size_t pair = (size_t)(k / 8) * PLANES * 8 + k % 8;
    for (int m = 0; m < MT; ++m) {
      for (int p = 0; p < PLANES; ++p) {
        acc[m][p % 2] = _mm512_dpwssd_epi32(acc[m][p % 2], q[p], _mm512_set1_epi32(xq[m][pair + (size_t)p * 8]));
      }
    }
    if (++in_span == span) {
      in_span = 0;
      const bool group_end = (in_group += span) == wpg;
      const __m512 ws = load16_as_f32(scales, j.sty, (size_t)g * 16, 16);
      const __m512 bs = group_end ? load16_as_f32(biases, j.sty, (size_t)g * 16, 16) : _mm512_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        const __m512i sum = _mm512_add_epi32(acc[m][0], acc[m][1]);
        y[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ws, _mm512_set1_ps(xs[m][g])), y[m]);
        if (group_end) y[m] = _mm512_fmadd_ps(bs, _mm512_set1_ps(xsum[m][g]), y[m]);
        acc[m][0] = acc[m][1] = _mm512_setzero_si512();
      }
      if (group_end) {
        in_group = 0;
        ++g;
      }
    }
  }
  const __mmask16 store = (__mmask16)((1u << valid) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(j.y + (size_t)(m0 + m) * j.N + n, store, y[m]);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"))) void rows_zmm_int16_blocks(
    const Job& j, int n0, int n1) {
  const size_t group_block = 16 * (size_t)j.G * (j.sty == Ty::F32 ? 4 : 2);
  for (int n = n0; n < n1; n += 16) {
    const int valid = std::min(16, n1 - n);
    const BlockSource src = block_source(j, n, valid);
    const uint32_t* w = src.words;
    const uint8_t* sb = src.scales;
    const uint8_t* bb = sb + group_block;
    int m = 0;
    for (; m + 8 <= j.M; m += 8) tile_zmm_int16_blocks<BITS, 8>(j, w, sb, bb, m, n, valid, m == 0 ? src.ahead : 0);
    const size_t ahead = m == 0 ? src.ahead : 0;
    switch (j.M - m) {
      case 7: tile_zmm_int16_blocks<BITS, 7>(j, w, sb, bb, m, n, valid, ahead); break;
      case 6: tile_zmm_int16_blocks<BITS, 6>(j, w, sb, bb, m, n, valid, ahead); break;
      case 5: tile_zmm_int16_blocks<BITS, 5>(j, w, sb, bb, m, n, valid, ahead); break;
      case 4: tile_zmm_int16_blocks<BITS, 4>(j, w, sb, bb, m, n, valid, ahead); break;
      case 3: tile_zmm_int16_blocks<BITS, 3>(j, w, sb, bb, m, n, valid, ahead); break;
      case 2: tile_zmm_int16_blocks<BITS, 2>(j, w, sb, bb, m, n, valid, ahead); break;
      case 1: tile_zmm_int16_blocks<BITS, 1>(j, w, sb, bb, m, n, valid, ahead); break;
      default: break;
    }
  }
}

// Splits f32 activations into the int8 planes tile_vnni reads: per group,
// s = max|x| / 127, a = round(x / s), b = round((x / s - a) * 256), both
// rounding to nearest even. |x / s| <= 127 keeps a in [-127, 127] and b in
// [-128, 128]; b = 128 becomes a + 1, b = -128 (then x > 0, so a + 1 <= 127).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void vnni_row(const Job& j, const float* x, int8_t* q,
                                                                            float* xscale) {
  const int G = j.G, group = j.group;
  const size_t plane = (size_t)j.chunks * 64;
  const int planes = j.bits == 4 ? 4 : 2;
  // Each plane's bytes past the row's values stay zero.
  const size_t written = j.bits == 8 ? (size_t)j.K : (size_t)j.K / 2;
  for (int i = 0; i < planes; ++i) std::memset(q + i * plane + written, 0, plane - written);
  // Within 16 bytes of values k..k+15 (two 4-bit words): even values first.
  const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m512i v128 = _mm512_set1_epi32(128), v256 = _mm512_set1_epi32(256), one = _mm512_set1_epi32(1);
  for (int g = 0; g < G; ++g) {
    const float* xg = x + (size_t)g * group;
    __m512 amax_v = _mm512_setzero_ps();
    for (int k = 0; k < group; k += 16) amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
    const float amax = _mm512_reduce_max_ps(amax_v);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    xscale[g] = amax / 127.0f / 256.0f;
    const __m512 inv_v = _mm512_set1_ps(inv);
    for (int k = 0; k < group; k += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xg + k), inv_v);
      __m512i a = _mm512_cvtps_epi32(v);  // round to nearest even (MXCSR default)
      __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, _mm512_cvtepi32_ps(a)), _mm512_set1_ps(256.0f)));
      const __mmask16 carry = _mm512_cmpeq_epi32_mask(b, v128);
      a = _mm512_mask_add_epi32(a, carry, a, one);
      b = _mm512_mask_sub_epi32(b, carry, b, v256);
      const __m128i a8 = _mm512_cvtepi32_epi8(a), b8 = _mm512_cvtepi32_epi8(b);
      const int kk = g * group + k;
      if (j.bits == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + kk), a8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + plane + kk), b8);
      } else {
        // Values kk..kk+15 are words kk/8 and kk/8+1: bytes (kk/8)*4.. of
        // the even and odd planes.
        const __m128i as = _mm_shuffle_epi8(a8, even_odd), bs = _mm_shuffle_epi8(b8, even_odd);
        const size_t at = (size_t)(kk / 8) * 4;
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + at), as);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + plane + at), _mm_unpackhi_epi64(as, as));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 2 * plane + at), bs);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + 3 * plane + at), _mm_unpackhi_epi64(bs, bs));
      }
    }
  }
}
#endif  // MLXCEL_X86

// round(x[k] * inv) for k < n, to nearest even, into int16 (|x * inv| <= 32512).
void quantize_int16_portable(const float* x, int n, float inv, int16_t* out) {
  for (int k = 0; k < n; ++k) out[k] = (int16_t)std::nearbyint(x[k] * inv);
}

float amax_portable(const float* x, int n) {
  float amax = 0.0f;
  for (int k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

#ifdef MLXCEL_X86
// The same for n a multiple of 8 (cvtps rounds to nearest even under the
// default MXCSR, as nearbyint does: bit-identical results).
__attribute__((target("avx2,fma"))) void quantize_int16_avx2(const float* x, int n, float inv, int16_t* out) {
  const __m256 iv = _mm256_set1_ps(inv);
  for (int k = 0; k < n; k += 8) {
    const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
  }
}

__attribute__((target("avx2,fma"))) float amax_avx2(const float* x, int n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int k = 0; k < n; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
  return simd::hmax256(m);
}
#endif

// Moves int16 activations from natural order into the planes: per chunk of
// 8 words, plane p holds (x[w*EPW + p], x[w*EPW + EPW/2 + p]) for each word w.
template <int EPW>
void int16_planes(const int16_t* x16, int words, int16_t* q) {
  constexpr int PLANES = EPW / 2, L = 8;
  for (int w = 0; w < words; ++w) {
    const int16_t* src = x16 + (size_t)w * EPW;
    int16_t* dst = q + ((size_t)(w / L) * PLANES * L + w % L) * 2;
    for (int p = 0; p < PLANES; ++p) {
      dst[p * L * 2] = src[p];
      dst[p * L * 2 + 1] = src[PLANES + p];
    }
  }
}

#ifdef MLXCEL_X86
// int16_planes over the whole chunks of `words` words with AVX2 shuffles, for
// 4 and 8 values per word (the same int16s in the same places); returns the
// words laid out (0 for other widths).
__attribute__((target("avx2"))) int int16_planes_avx2(const int16_t* x16, int words, int epw, int16_t* q) {
  const int chunks = words / 8;
  if (epw == 4) {
    // Per word (a0 a1 a2 a3): the pairs (a0, a2), (a1, a3) as two dwords.
    const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2, 3, 6, 7,
                                           8, 9, 12, 13, 10, 11, 14, 15);
    for (int c = 0; c < chunks; ++c) {
      const int16_t* src = x16 + (size_t)c * 32;
      const __m256 a = _mm256_castsi256_ps(
          _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), pairs));
      const __m256 b = _mm256_castsi256_ps(
          _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16)), pairs));
      // Even dwords (plane 0) and odd ones (plane 1), words back in order.
      const __m256i p0 = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                                                  _MM_SHUFFLE(3, 1, 2, 0));
      const __m256i p1 = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
                                                  _MM_SHUFFLE(3, 1, 2, 0));
      int16_t* dst = q + (size_t)c * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), p0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), p1);
    }
    return chunks * 8;
  }
  if (epw == 8) {
    // Per word (a0 .. a7): the pairs (a0, a4) .. (a3, a7) as four dwords.
    const __m256i pairs = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10, 11,
                                           4, 5, 12, 13, 6, 7, 14, 15);
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int c = 0; c < chunks; ++c) {
      const int16_t* src = x16 + (size_t)c * 64;
      __m256i v[4];
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * i)), pairs);
      }
      // A 4 x 4 dword transpose per 128-bit lane: plane p's dwords, words
      // in the order 0 2 4 6 1 3 5 7, then put back in order.
      const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
      const __m256i planes[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                                 _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
      int16_t* dst = q + (size_t)c * 64;
      for (int p = 0; p < 4; ++p) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * p), _mm256_permutevar8x32_epi32(planes[p], in_order));
      }
    }
    return chunks * 8;
  }
  return 0;
}
#endif

// Lays out one row of the int16 activation planes tile_avx2_int8 reads: per
// group, s = max|x| / 32512 and x16 = round(x / s) (to nearest even,
// |x16| <= 32512), arranged by int16_planes into q, the scales into xscale.
void int16_row(const Job& j, const float* x, int16_t* q, float* xscale) {
  const int K = j.K, G = j.G, group = j.group, planes = j.epw / 2;
  constexpr int L = 8;
  // A last chunk of fewer than 8 words keeps zeros past them.
  if (j.wpr % L) {
    const size_t last = (size_t)(j.wpr / L) * planes * L * 2;
    std::fill(q + last, q + last + (size_t)planes * L * 2, int16_t{0});
  }
  thread_local std::vector<int16_t> x16;
  x16.resize((size_t)K);
  auto quantize = quantize_int16_portable;
  auto amax_of = amax_portable;
#ifdef MLXCEL_X86
  if ((j.path == Path::Avx2Int8 || j.path == Path::Avx512Vnni) && group % 8 == 0) {
    quantize = quantize_int16_avx2;
    amax_of = amax_avx2;
  }
#endif
  for (int g = 0; g < G; ++g) {
    const float* xg = x + (size_t)g * group;
    const float amax = amax_of(xg, group);
    const float inv = amax > 0.0f ? 32512.0f / amax : 0.0f;
    xscale[g] = amax / 32512.0f;
    quantize(xg, group, inv, x16.data() + (size_t)g * group);
  }
  // Whole chunks by shuffles where the CPU has AVX2, the rest word by word.
  int done = 0;
#ifdef MLXCEL_X86
  if (j.path == Path::Avx2Int8 || j.path == Path::Avx512Vnni) done = int16_planes_avx2(x16.data(), j.wpr, j.epw, q);
#endif
  const int16_t* rest = x16.data() + (size_t)done * j.epw;
  int16_t* rest_q = q + (size_t)done * j.epw;  // whole chunks: (done / 8) * planes * 8 * 2 int16s
  switch (j.epw) {
    case 4: int16_planes<4>(rest, j.wpr - done, rest_q); break;
    case 8: int16_planes<8>(rest, j.wpr - done, rest_q); break;
    default: int16_planes<16>(rest, j.wpr - done, rest_q); break;
  }
}

#if defined(__aarch64__)
// ---------------------------------------------------------------------------
// NEON integer loop (bits 2, 4, 8) on int16_row's planes.
#include "matvec_neon.inc"
#endif

// ---------------------------------------------------------------------------
// Driver.

void run_rows(const Job& j, int n0, int n1) {
#ifdef MLXCEL_X86
  switch (j.path) {
    case Path::Avx512Vnni:
      switch (j.bits) {
        case 4: return j.int16_blocks ? rows_zmm_int16_blocks<4>(j, n0, n1) : rows_vnni<4>(j, n0, n1);
        case 8: return j.int16_blocks ? rows_zmm_int16_blocks<8>(j, n0, n1) : rows_vnni<8>(j, n0, n1);
      }
      break;
    case Path::Avx512:
      switch (j.bits) {
        case 2: return rows_avx512<2>(j, n0, n1);
        case 4: return rows_avx512<4>(j, n0, n1);
        case 8: return rows_avx512<8>(j, n0, n1);
      }
      break;
    case Path::Avx2Int8:
      switch (j.bits) {
        case 2: return rows_avx2_int8<2>(j, n0, n1);
        case 4: return j.vnni_rows ? rows_avx2_int8_blocks<4>(j, n0, n1) : rows_avx2_int8<4>(j, n0, n1);
        case 8: return j.vnni_rows ? rows_avx2_int8_blocks<8>(j, n0, n1) : rows_avx2_int8<8>(j, n0, n1);
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
#endif
#if defined(__aarch64__)
  if (j.path == Path::NeonInt8) {
    switch (j.bits) {
      case 2: return rows_neon_int8<2>(j, n0, n1);
      case 4: return rows_neon_int8<4>(j, n0, n1);
      case 8: return rows_neon_int8<8>(j, n0, n1);
    }
  }
#endif
  rows_portable(j, n0, n1);
}

void task_fn(void* ctx, int t) {
  const Job& j = *static_cast<const Job*>(ctx);
  int n0 = t * j.rows_per_task;
  int n1 = std::min(j.N, n0 + j.rows_per_task);
  run_rows(j, n0, n1);
}

// Several products of the same activations, run as one pool job.
struct MultiJob {
  static constexpr int kMax = 4;
  Job jobs[kMax];
  int first_task[kMax + 1] = {0};
  int count = 0;
};

void multi_task_fn(void* ctx, int t) {
  const MultiJob& mj = *static_cast<const MultiJob*>(ctx);
  int i = 0;
  while (t >= mj.first_task[i + 1]) ++i;
  task_fn(const_cast<Job*>(&mj.jobs[i]), t - mj.first_task[i]);
}

// Per-thread buffers of the evaluating thread, reused across calls.
struct CallScratch {
  std::vector<float> xf, xp, xsum, y, xscale;
  std::vector<int8_t> xq;
};
thread_local CallScratch tl_call;

// Rows of x from which prepare lays them out on the pool's threads (below,
// the synchronisation costs about what the split saves).
constexpr int kParallelPrepareRows = 8;

// One call's activations being laid out: x as the call passes it, and the
// evaluating thread's scratch, each row of which one task writes.
struct PrepareRows {
  const Job* j;
  const void* x;
  Ty xty;
  const int64_t* x_offsets;
  int64_t x_step;
  float *xf, *xsum, *xscale, *xp;
  int8_t* xq;
  int rows_per_task;
};

// The sum of a group of n values in eight interleaved partial sums (the
// vectorizer's order, written out, so every path and build adds them alike):
// one dependent add per 8 values instead of one per value.
float group_sum(const float* p, int n) {
  float part[8] = {};
  int k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int i = 0; i < 8; ++i) part[i] += p[k + i];
  }
  float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; k < n; ++k) s += p[k];
  return s;
}

// Row m of x: in f32, its group sums, and the layout j's loop reads.
void prepare_row(const PrepareRows& r, int m) {
  const Job& j = *r.j;
  const int K = j.K, G = j.G;
  float* xf = r.xf + (size_t)m * K;
  convert_row_for(j.path, r.x, r.xty, (size_t)r.x_offsets[m], r.x_step, K, xf);
  for (int g = 0; g < G; ++g) r.xsum[(size_t)m * G + g] = group_sum(xf + (size_t)g * j.group, j.group);
  int8_t* q = r.xq + (size_t)m * j.xq_stride;
#ifdef MLXCEL_X86
  if (j.path == Path::Avx512Vnni && !j.int16_blocks) {
    vnni_row(j, xf, q, r.xscale + (size_t)m * G);
    return;
  }
#endif
  if (j.path == Path::Avx2Int8 || j.path == Path::NeonInt8 || j.int16_blocks) {
    int16_row(j, xf, reinterpret_cast<int16_t*>(q), r.xscale + (size_t)m * G);
  } else if (j.lanes > 0) {
    const int L = j.lanes, EPW = j.epw;
    float* dst = r.xp + (size_t)m * j.xp_stride;
    if (j.wpr % L) std::fill(dst, dst + j.xp_stride, 0.0f);  // the last chunk's padding
    for (int s = 0; s < EPW; ++s) {
      int e = s < EPW - 1 ? s : s - 1;
      float f = std::ldexp(1.0f, -j.bits * e);
      for (int word = 0; word < j.wpr; ++word) {
        int c = word / L, l = word % L;
        dst[((size_t)c * EPW + s) * L + l] = xf[(size_t)word * EPW + s] * f;
      }
    }
  }
}

void prepare_task(void* ctx, int t) {
  const PrepareRows& r = *static_cast<const PrepareRows*>(ctx);
  const int m0 = t * r.rows_per_task, m1 = std::min(r.j->M, m0 + r.rows_per_task);
  for (int m = m0; m < m1; ++m) prepare_row(r, m);
}

// Evaluates one call. x rows are read through `x_offsets` (element offsets of
// each row's first element) with `x_step` between consecutive elements.
// Lays out the activations for j's loop (in this thread's scratch, valid
// until the next call on this thread) and sets j's activation pointers. From
// kParallelPrepareRows rows on, the pool's threads share the rows (each
// row's layout is the same whichever thread writes it).
void prepare(Job& j, const void* x, Ty xty, const std::vector<int64_t>& x_offsets, int64_t x_step) {
  CallScratch& cs = tl_call;
  const int M = j.M, K = j.K, G = j.G;
  cs.xf.resize((size_t)M * K);
  // Zero-padded past the last row for the tiles' vector reads.
  cs.xsum.resize((size_t)M * G + 8);
  std::fill(cs.xsum.end() - 8, cs.xsum.end(), 0.0f);
  PrepareRows r{&j, x, xty, x_offsets.data(), x_step, cs.xf.data(), cs.xsum.data(), nullptr, nullptr, nullptr, 0};
  constexpr int L = 8;
#ifdef MLXCEL_X86
  if (j.path == Path::Avx512Vnni && !j.int16_blocks) {
    // Per row of x, int8 planes of chunks * 64 bytes (vnni_row).
    j.xq_stride = (size_t)j.chunks * 64 * (j.bits == 4 ? 4 : 2);
    cs.xq.resize((size_t)M * j.xq_stride);
    cs.xscale.resize((size_t)M * G);
  } else
#endif
  if (j.path == Path::Avx2Int8 || j.path == Path::NeonInt8 || j.int16_blocks) {
    // Per row of x, int16 planes in chunks of 8 words (the VNNI path's
    // j.chunks count 16).
    const int chunks = j.path == Path::Avx512Vnni ? (j.wpr + L - 1) / L : j.chunks;
    j.xq_stride = (size_t)chunks * (j.epw / 2) * L * 2 * sizeof(int16_t);
    cs.xq.resize((size_t)M * j.xq_stride);
    // The tile reads 8 scales from a chunk's first group: the zero padding
    // keeps the lanes past the last group finite and normal (a denormal there
    // costs a microcode assist per multiply).
    cs.xscale.resize((size_t)M * G + 16);
    std::fill(cs.xscale.end() - 16, cs.xscale.end(), 0.0f);
  } else if (j.lanes > 0) {
    j.xp_stride = (size_t)j.chunks * j.epw * j.lanes;
    cs.xp.resize((size_t)M * j.xp_stride);
    r.xp = cs.xp.data();
    j.xp = r.xp;
  }
  r.xq = cs.xq.data();
  r.xscale = cs.xscale.data();
  Pool& p = pool();
  const int tasks = M >= kParallelPrepareRows ? std::min(M, p.threads()) : 1;
  r.rows_per_task = (M + tasks - 1) / tasks;
  p.run(tasks, prepare_task, &r);
  j.xf = cs.xf.data();
  j.xsum = cs.xsum.data();
  j.xq = cs.xq.data();
  j.xscale = cs.xscale.data();
}

// Splits j's output rows into tasks, never below ~32K weights per task: one
// per thread for the small products of a decode step (each claim moves a
// cache line between cores, about as costly as 10K weights of work), four per
// thread from 4M weights on, for balance on a loaded machine. Returns the
// count.
int plan_tasks(Job& j, int threads) {
  const double work = (double)j.N * j.K * std::max(1, j.M);
  int tasks = 1;
  if (threads > 1 && work >= 64.0 * 1024) {
    const int per_thread = work >= 4.0 * 1024 * 1024 ? 4 : 1;
    tasks = std::min<int>(threads * per_thread, (int)std::max(1.0, work / (32.0 * 1024)));
    tasks = std::max(1, std::min(tasks, j.N));
  }
  j.rows_per_task = (j.N + tasks - 1) / tasks;
  // The loops that read the copies take output rows in blocks of 16.
  if (reads_vnni_rows(j.path, j.bits)) j.rows_per_task = (j.rows_per_task + 15) / 16 * 16;
  return (j.N + j.rows_per_task - 1) / j.rows_per_task;
}

void compute(Job j, const void* x, Ty xty, const std::vector<int64_t>& x_offsets, int64_t x_step, void* out,
             Ty oty) {
  CallScratch& cs = tl_call;
  const int M = j.M;
  prepare(j, x, xty, x_offsets, x_step);

  float* y32;
  if (oty == Ty::F32) {
    y32 = static_cast<float*>(out);
  } else {
    cs.y.resize((size_t)M * j.N);
    y32 = cs.y.data();
  }
  j.y = y32;

  Pool& p = pool();
  p.run(plan_tasks(j, p.threads()), task_fn, &j);

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
  int L = path == Path::Avx512 || path == Path::Avx512Vnni ? 16 : path == Path::Avx2 || path == Path::Avx2Int8 ? 8 : 0;
  if (path == Path::NeonInt8) L = 8;
  if (L == 0) return 0;
  bool pow2 = (wpg & (wpg - 1)) == 0;
  if ((wpg < L && pow2) || wpg % L == 0) return L;
  return 0;
}

// The job of an [M, K] x [N, K]^T product, pointers unset.
Job make_job(int M, int N, int K, int group_size, int bits, size_t row_bytes, Ty sty, Path requested) {
  Job j;
  j.M = M;
  j.N = N;
  j.K = K;
  j.bits = bits;
  j.group = group_size;
  j.G = K / group_size;
  j.row_bytes = row_bytes;
  j.prefetch_rows = (int)std::clamp<size_t>(12288 / std::max<size_t>(row_bytes, 1), 4, 64);
  j.prefetch_l2 = cpu::features().amd;
  j.path = resolve_path_impl(requested);
  // (Group sums stay exact in int32 up to 256 values; see tile_vnni.)
  if (j.path == Path::Avx512Vnni && ((bits != 4 && bits != 8) || group_size % 16 != 0 || group_size > 256)) {
    j.path = Path::Avx512;
  }
  j.lanes = lanes_for(j.path, bits, group_size);
  if (j.lanes == 0) j.path = Path::Portable;
  if (bits == 2 || bits == 4 || bits == 8) {
    j.epw = 32 / bits;
    j.wpr = K / j.epw;
    j.wpg = group_size / j.epw;
    if (j.lanes) j.chunks = (j.wpr + j.lanes - 1) / j.lanes;
  }
  j.sty = sty;
  return j;
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

    Job j = make_job(out.shape(-1) == 0 ? 0 : (int)(out.size() / out.shape(-1)), out.shape(-1), x.shape(-1),
                     group_size_, bits_, (size_t)w.shape(-1) * 4, ty_of(scales.dtype()), path_);
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
    const uint8_t* vnni_rows = nullptr;
    if (inputs.size() == 5) {
      detail::QuantizedView view;
      view.scale_type = static_cast<detail::Scalar>(j.sty);
      view.n = j.N;
      view.k = j.K;
      view.group = j.group;
      view.bits = j.bits;
      // A copy of another layout (or none for this path) is not read.
      if (reads_vnni_rows(j.path, j.bits) && (size_t)inputs[4].nbytes() == (size_t)(j.N / 16) * detail::vnni_block_bytes(view)) {
        vnni_rows = inputs[4].data<uint8_t>();
      }
      enc.set_input_array(inputs[4]);
    }
    enc.set_output_array(out);
    // MLX's cpu::eval keeps the inputs' buffers alive until this task has run.
    enc.dispatch([j, xp = x.data<void>(), xty = ty_of(x.dtype()), offsets = std::move(offsets), step,
                  wp = w.data<uint8_t>(), sp = scales.data<void>(), bp = biases.data<void>(), vnni_rows,
                  op = out.data<void>(), oty = ty_of(out.dtype())]() mutable {
      if (j.M == 0 || j.N == 0) return;
      j.w = wp;
      j.scales = sp;
      j.biases = bp;
      j.vnni_rows = vnni_rows;
      j.int16_blocks = runs_int16_blocks(j);
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


}  // namespace

namespace detail {

bool is_float(mx::Dtype d) { return d == mx::float32 || d == mx::float16 || d == mx::bfloat16; }

mx::array row_contiguous(const mx::array& a, mx::Stream stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
}

Scalar scalar_of(mx::Dtype dtype, const char* what) {
  if (dtype == mx::float32) return Scalar::F32;
  if (dtype == mx::float16) return Scalar::F16;
  if (dtype == mx::bfloat16) return Scalar::BF16;
  throw std::invalid_argument(std::string("[mlxcel::kernels] ") + what + " must be float32, float16 or bfloat16");
}

float load_f32(const void* p, Scalar type, size_t i) { return load_as_f32(p, static_cast<Ty>(type), i); }

void load_row_f32(const void* p, Scalar type, size_t at, int64_t stride, int n, float* dst) {
  convert_row_for(resolve_path_impl(Path::Auto), p, static_cast<Ty>(type), at, stride, n, dst);
}

namespace {

// Reads the interleaved copy of `w`, when it has one, where j runs a loop that reads it.
void use_vnni_rows(Job& j, const QuantizedView& w) {
  if (w.vnni_rows && reads_vnni_rows(j.path, j.bits) && j.bits == w.bits && j.group == w.group) j.vnni_rows = w.vnni_rows;
  j.int16_blocks = runs_int16_blocks(j);
}

std::atomic<size_t> g_vnni_rows_bytes{0};

}  // namespace

size_t vnni_block_bytes(const QuantizedView& w) {
  const size_t scale_bytes = w.scale_type == Scalar::F32 ? 4 : 2;
  return 2 * 16 * (size_t)(w.k / w.group) * scale_bytes + 16 * ((size_t)w.k * w.bits / 8);
}

VnniRows::VnniRows(const QuantizedView& w) {
  const int blocks = w.n / 16;
  const size_t block_bytes = vnni_block_bytes(w);
  bytes_ = (size_t)blocks * block_bytes;
  if (bytes_ == 0) return;
  ArenaSlice slice = arena_allocate(bytes_);
  data_ = slice.data;
  owner_ = std::move(slice.owner);
  const size_t scale_bytes = w.scale_type == Scalar::F32 ? 4 : 2;
  const size_t groups = (size_t)(w.k / w.group), words = (size_t)w.k * w.bits / 32;
  const size_t group_block = 16 * groups * scale_bytes;
  const auto* scales = static_cast<const uint8_t*>(w.scales);
  const auto* biases = static_cast<const uint8_t*>(w.biases);
  const auto* weight = reinterpret_cast<const uint32_t*>(w.weight);
  for (int b = 0; b < blocks; ++b) {
    uint8_t* block = data_ + (size_t)b * block_bytes;
    auto* block_words = reinterpret_cast<uint32_t*>(block + 2 * group_block);
    for (int l = 0; l < 16; ++l) {
      const size_t row = (size_t)b * 16 + l;
      for (size_t g = 0; g < groups; ++g) {
        std::memcpy(block + (g * 16 + l) * scale_bytes, scales + (row * groups + g) * scale_bytes, scale_bytes);
        std::memcpy(block + group_block + (g * 16 + l) * scale_bytes, biases + (row * groups + g) * scale_bytes,
                    scale_bytes);
      }
      for (size_t k = 0; k < words; ++k) block_words[k * 16 + l] = weight[row * words + k];
    }
  }
  g_vnni_rows_bytes.fetch_add(bytes_, std::memory_order_relaxed);
}

VnniRows::~VnniRows() {
  if (data_) g_vnni_rows_bytes.fetch_sub(bytes_, std::memory_order_relaxed);
}

std::shared_ptr<const VnniRows> make_vnni_rows(const QuantizedView& w) {
  static const bool wanted = [] {
    const char* env = std::getenv("MLXCEL_REPACK");
    return !(env && std::string(env) == "0");
  }();
  if (!wanted || w.n < 16 || w.weight == nullptr) return nullptr;
  const Job j = make_job(1, w.n, w.k, w.group, w.bits, (size_t)w.k * w.bits / 8, static_cast<Ty>(w.scale_type),
                         Path::Auto);
  if (!reads_vnni_rows(j.path, j.bits)) return nullptr;
  return std::make_shared<const VnniRows>(w);
}

size_t vnni_rows_bytes() { return g_vnni_rows_bytes.load(std::memory_order_relaxed); }

void quantized_matmul_f32(const QuantizedView& w, const float* x, int m, float* y, Path path) {
  if (m == 0 || w.n == 0) return;
  Job j = make_job(m, w.n, w.k, w.group, w.bits, (size_t)w.k * w.bits / 8, static_cast<Ty>(w.scale_type), path);
  j.w = w.weight;
  j.scales = w.scales;
  j.biases = w.biases;
  use_vnni_rows(j, w);
  std::vector<int64_t> offsets(m);
  for (int r = 0; r < m; ++r) offsets[r] = (int64_t)r * w.k;
  compute(j, x, Ty::F32, offsets, 1, y, Ty::F32);
}

void quantized_matmul_f32_many(const QuantizedView* ws, int count, const float* x, int m, float* const* ys,
                               Path path) {
  if (m == 0 || count <= 0) return;
  auto job_for = [&](const QuantizedView& w) {
    Job j = make_job(m, w.n, w.k, w.group, w.bits, (size_t)w.k * w.bits / 8, static_cast<Ty>(w.scale_type), path);
    j.w = w.weight;
    j.scales = w.scales;
    j.biases = w.biases;
    use_vnni_rows(j, w);
    return j;
  };
  MultiJob mj;
  mj.count = count;
  mj.jobs[0] = job_for(ws[0]);
  bool shared = count <= MultiJob::kMax;
  for (int i = 1; shared && i < count; ++i) {
    mj.jobs[i] = job_for(ws[i]);
    const Job &a = mj.jobs[0], &b = mj.jobs[i];
    shared = b.K == a.K && b.bits == a.bits && b.group == a.group && b.path == a.path && b.lanes == a.lanes &&
             b.int16_blocks == a.int16_blocks;
  }
  if (!shared) {
    for (int i = 0; i < count; ++i) quantized_matmul_f32(ws[i], x, m, ys[i], path);
    return;
  }
  std::vector<int64_t> offsets(m);
  for (int r = 0; r < m; ++r) offsets[r] = (int64_t)r * ws[0].k;
  prepare(mj.jobs[0], x, Ty::F32, offsets, 1);
  Pool& p = pool();
  for (int i = 0; i < count; ++i) {
    Job& j = mj.jobs[i];
    if (i > 0) {
      const Job& a = mj.jobs[0];
      j.xf = a.xf;
      j.xp = a.xp;
      j.xp_stride = a.xp_stride;
      j.xsum = a.xsum;
      j.xq = a.xq;
      j.xq_stride = a.xq_stride;
      j.xscale = a.xscale;
    }
    j.y = ys[i];
    mj.first_task[i + 1] = mj.first_task[i] + (j.N == 0 ? 0 : plan_tasks(j, p.threads()));
  }
  p.run(mj.first_task[count], multi_task_fn, &mj);
}

void parallel_for(int tasks, void (*fn)(void* ctx, int task), void* ctx) { pool().run(tasks, fn, ctx); }

void prefetch_for_workers(const PrefetchRegion* regions, int count) { pool().set_hint(regions, count); }

}  // namespace detail

const char* copy_loop_name(Path path, int bits) {
  Job j;
  j.path = resolve_path(path);
  j.bits = bits;
  if (!reads_vnni_rows(j.path, bits) || (j.path == Path::Avx512Vnni && bits != 4 && bits != 8)) return "";
  static const uint8_t any_copy = 0;
  j.vnni_rows = &any_copy;
  if (runs_int16_blocks(j)) return "avx512-int16";
  return j.path == Path::Avx512Vnni ? "avx512-vnni" : "avx2-int16";
}

Path auto_path() { return env_path(); }

Path resolve_path(Path requested) {
  if (requested == Path::Auto) return env_path();
  return best_supported(requested);
}

const char* path_name(Path path) {
  switch (path) {
    case Path::Avx512Vnni: return "avx512-vnni";
    case Path::Avx512: return "avx512";
    case Path::Avx2Int8: return "avx2-int8";
    case Path::Avx2: return "avx2";
    case Path::NeonInt8: return "neon-int8";
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
    mx::StreamOrDevice s,
    const std::optional<mx::array>& vnni_rows) {
  mx::Stream stream = mx::to_stream(s);
  // MLX's node validates the arguments and fixes the output shape and dtype.
  mx::array ref = mx::quantized_matmul(x, w, scales, biases, true, group_size, bits, "affine", stream);
  if (stream.device != mx::Device::cpu || !supports(group_size, bits) || w.ndim() != 2 || scales.ndim() != 2 ||
      x.ndim() < 1 || !detail::is_float(x.dtype()) || !detail::is_float(scales.dtype()) || scales.dtype() != biases.dtype() ||
      !detail::is_float(ref.dtype()) || ref.size() == 0) {
    return ref;
  }
  std::vector<mx::array> inputs = {x, detail::row_contiguous(w, stream), detail::row_contiguous(scales, stream),
                                   detail::row_contiguous(biases, stream)};
  if (vnni_rows) {
    if (vnni_rows->dtype() != mx::uint8 || vnni_rows->ndim() != 1) {
      throw std::invalid_argument("[mlxcel::kernels::quantized_matmul] vnni_rows must be the uint8 array vnni_rows made");
    }
    inputs.push_back(*vnni_rows);
  }
  return mx::array(ref.shape(), ref.dtype(), std::make_shared<QuantizedMatvec>(stream, group_size, bits, path),
                   std::move(inputs));
}

std::optional<mx::array> vnni_rows(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size,
                                   int bits) {
  if (w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape() || scales.dtype() != biases.dtype() ||
      !detail::is_float(scales.dtype()) || !supports(group_size, bits) || w.dtype() != mx::uint32) {
    return std::nullopt;
  }
  const int64_t n = w.shape(0), k = (int64_t)w.shape(1) * 32 / bits;
  if (k % group_size != 0 || scales.shape(0) != n || scales.shape(1) != k / group_size || n > INT32_MAX || k > INT32_MAX) {
    return std::nullopt;
  }
  mx::Stream stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> dense = {detail::row_contiguous(w, stream), detail::row_contiguous(scales, stream),
                                  detail::row_contiguous(biases, stream)};
  mx::eval(dense);
  detail::QuantizedView view;
  view.weight = dense[0].data<uint8_t>();
  view.scales = dense[1].data<void>();
  view.biases = dense[2].data<void>();
  view.scale_type = detail::scalar_of(dense[1].dtype(), "scales");
  view.n = (int)n;
  view.k = (int)k;
  view.group = group_size;
  view.bits = bits;
  std::shared_ptr<const detail::VnniRows> rows = detail::make_vnni_rows(view);
  if (!rows || rows->bytes() == 0) return std::nullopt;
  // The array borrows the copy's buffer and keeps it alive.
  return mx::array(const_cast<uint8_t*>(rows->data()), mx::Shape{(int)rows->bytes()}, mx::uint8, [rows](void*) {});
}

}  // namespace mlxcel::kernels
