// See gelu.h.

#include "gelu.h"

#include <cmath>
#include <stdexcept>

#include "detail.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "simd_math.h"

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752f;
// Abramowitz & Stegun 7.1.26: erf(z) = 1 - t (a1 + t (a2 + ...)) e^{-z^2},
// t = 1 / (1 + p z), z >= 0.
constexpr float kP = 0.3275911f;
constexpr float kA1 = 0.254829592f, kA2 = -0.284496736f, kA3 = 1.421413741f, kA4 = -1.453152027f,
                kA5 = 1.061405429f;

void gelu_portable(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
}

#ifdef MLXCEL_X86
__attribute__((target("avx2,fma"))) inline __m256 gelu256(__m256 x) {
  const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(kInvSqrt2));
  const __m256 sign = _mm256_and_ps(z, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(a, _mm256_set1_ps(kP), _mm256_set1_ps(1.0f)));
  __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(kA5), t, _mm256_set1_ps(kA4));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kA3));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kA2));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(kA1));
  poly = _mm256_mul_ps(poly, t);
  const __m256 e = simd::exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(a, a)));
  const __m256 erf_abs = _mm256_fnmadd_ps(poly, e, _mm256_set1_ps(1.0f));
  const __m256 erf = _mm256_or_ps(erf_abs, sign);
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), erf));
}

__attribute__((target("avx2,fma"))) void gelu_avx2(const float* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, gelu256(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float in[8] = {0}, out[8];
    for (size_t j = i; j < n; ++j) in[j - i] = x[j];
    _mm256_storeu_ps(out, gelu256(_mm256_loadu_ps(in)));
    for (size_t j = i; j < n; ++j) y[j] = out[j - i];
  }
}

__attribute__((target("avx512f"))) inline __m512 gelu512(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(kInvSqrt2));
  const __m512 a = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(a, _mm512_set1_ps(kP), _mm512_set1_ps(1.0f)));
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(kA5), t, _mm512_set1_ps(kA4));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kA3));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kA2));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(kA1));
  poly = _mm512_mul_ps(poly, t);
  const __m512 e = simd::exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(a, a)));
  const __m512 erf_abs = _mm512_fnmadd_ps(poly, e, _mm512_set1_ps(1.0f));
  // Copy z's sign onto |erf| (erf is odd).
  const __mmask16 negative = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 erf = _mm512_mask_sub_ps(erf_abs, negative, _mm512_setzero_ps(), erf_abs);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), erf));
}

__attribute__((target("avx512f"))) void gelu_avx512(const float* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, gelu512(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, tail, gelu512(_mm512_maskz_loadu_ps(tail, x + i)));
  }
}
#endif

using Loop = void (*)(const float*, float*, size_t);

// The vector width of the matvec path `path` resolves to (MLXCEL_KERNELS included).
Loop loop_for(Path path) {
#ifdef MLXCEL_X86
  switch (resolve_path(path)) {
    case Path::Avx512:
    case Path::Avx512Vnni: return gelu_avx512;
    case Path::Avx2:
    case Path::Avx2Int8: return gelu_avx2;
    default: break;
  }
#endif
  (void)path;
  return gelu_portable;
}

struct Job {
  const float* x;
  float* y;
  size_t n, chunk;
  Loop loop;
};

class GeluErf : public mx::UnaryPrimitive {
 public:
  GeluErf(mx::Stream stream, Path path) : mx::UnaryPrimitive(stream), path_(path) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    enc.set_output_array(out);
    Job job{x.data<float>(), out.data<float>(), x.size(), 0, loop_for(path_)};
    enc.dispatch([job]() mutable {
      // Chunks of at least 16 Ki elements, a multiple of 16.
      const int tasks = (int)std::max<size_t>(1, std::min<size_t>((size_t)num_threads(), job.n / 16384));
      job.chunk = (job.n / tasks + 15) / 16 * 16;
      detail::parallel_for(tasks, [](void* ctx, int task) {
        const Job& j = *static_cast<const Job*>(ctx);
        const size_t begin = (size_t)task * j.chunk;
        if (begin >= j.n) return;
        j.loop(j.x + begin, j.y + begin, std::min(j.chunk, j.n - begin));
      }, &job);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxcel::kernels::GeluErf] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelGeluErf"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const GeluErf*>(&other);
    return o && o->path_ == path_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  Path path_;
};

}  // namespace

mx::array gelu_erf(const mx::array& x, Path path, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu || x.dtype() != mx::float32) {
    const mx::array half = mx::array(0.5f, x.dtype());
    const mx::array cdf = mx::multiply(half, mx::add(mx::array(1.0f, x.dtype()), mx::erf(mx::multiply(x, mx::array(kInvSqrt2, x.dtype()), stream), stream), stream), stream);
    return mx::multiply(x, cdf, stream);
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<GeluErf>(stream, path), {detail::row_contiguous(x, stream)});
}

}  // namespace mlxcel::kernels
