// Runs mlxcel's CPU kernels (kernels/*.cc) on random data with awkward shapes
// and checks them against MLX's own ops and an f64 host reference. Built for
// aarch64 by scripts/check-aarch64 (linked with the kernels' objects and the
// aarch64 wheel's libmlx, nothing of the cxx bridge) and run under qemu-user,
// so the portable loops the kernels compile to NEON, and quantized_matmul's
// NEON integer loop (Path::NeonInt8, aarch64's Auto for bits 2, 4, 8), really
// run and are checked. It also builds natively (`g++ -std=c++20 -I.
// -I<mlx>/include ... kernels/*.cc -lmlx`); off aarch64 it caps the kernels
// at their portable loops (MLXCEL_KERNELS=portable; NeonInt8 falls back to
// the portable loop there).
//
// Every case prints its largest error and its largest error / tolerance
// (a case passes when that ratio is <= 1); any failure, exception, shape or
// dtype mismatch, non-finite value or fallback to MLX's op where the kernel
// should have run makes the exit status 1. The last line is a summary.
//
// Tolerances, mirroring mlx-sys/tests/kernels.rs and prefill_kernels.rs:
// - Quantized and dense matmuls (quantized_matmul, quantized_gemm,
//   dense_matmul): every implementation computes the same real number
//   y = Σ_k x_k (s_g q_k + b_g) and differs only in rounding and summation
//   order. f32 accumulation of K terms errs by ~sqrt(K)·eps·Σ|terms| in
//   practice (K·eps at worst), so errors are measured against the exact f64
//   y and mag = Σ_k |x_k · w_k|, not |y| (which can cancel to ~0). The bar is
//   |ours - exact| <= 1e-5·mag: ~80 f32 ulps of mag, 10-20x what the exact
//   loops produce for K <= 600, and ~1000x below a real bug (a wrong nibble,
//   scale or row moves y by ~1e-2·mag). f16/bf16 outputs add their final
//   rounding, half an ulp of |y|: 2^-11·|y| and 2^-8·|y|. MLX's own op is
//   held to the same bar for f32 inputs, which checks the reference itself;
//   with f16/bf16 activations MLX's CPU op accumulates in the half type and
//   is not a usable reference, so the exact f64 sum is.
// - quantized_matmul's integer loops (NEON here; AVX2/VNNI on x86) quantize
//   each group of activations to 16 bits: each x_k moves by at most
//   max|x_g| / 65024, so, as reference_quantized_x in mlx-sys/tests/kernels.rs
//   does, mag grows by 1.01·Σ_g max|x_g| / 65024 · Σ_{k in g} |s_g q_k| / 1e-5
//   (the bias term uses exact sums of x). Two paths that run the same loop
//   must agree bit for bit, and an integer loop must differ from the exact
//   one (f32 outputs): that is how each case shows which loop ran.
// - The fused SwiGLU: silu(g)·u with g, u as above; the error of g moves the
//   result by at most 1.1·|u| times it (|silu'| <= 1.1), the error of u by
//   |silu(g)| times it, plus a few ulps for the exponential.
// - Causal attention: outputs are convex combinations of value rows, so
//   errors must stay below 1e-5·max|v| (scores carry ~D·eps relative error
//   into the probabilities); MLX's scaled_dot_product_attention must meet
//   the same bar against the f64 reference.
// - Quantized embedding: dequantized rows are a single f32 FMA each, equal
//   to MLX's dequantize within 1e-6·max(|e|, 1); bf16 outputs 2^-8 of that.
// - The fused decoder layer against the block composed of MLX's ops
//   (quantized_matmul, fast::rms_norm, fast::rope, scaled_dot_product_
//   attention, sigmoid): max|ours - ref| <= tol·max|ref| over each tensor
//   with tol = 1e-5 + end·max(rope_scale, 1)·2^-23 (the RoPE angle of the
//   last position `end` rounds to f32 differently in two implementations),
//   as in mlx-sys/tests/decoder_layer.rs; 5e-4 instead of 1e-5 where the
//   projections run an integer loop (aarch64's default for bits 2, 4, 8).
//   Cache rows below the offset must come back bit for bit.
#include <sys/utsname.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/causal_attention.h"
#include "kernels/cpu_features.h"
#include "kernels/decoder_layer.h"
#include "kernels/norm_rope.h"
#include "kernels/quantized_embedding.h"
#include "kernels/quantized_gemm.h"
#include "kernels/quantized_matmul.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace kn = mlxcel::kernels;

namespace {

std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// ---------------------------------------------------------------------------
// Bookkeeping: one line per case, totals per kernel.

struct KernelTotals {
  std::string name;
  int cases = 0;
  int failures = 0;
  double worst_ratio = 0;       // max over cases of max err / tol
  double worst_ratio_half = -1;  // the same over cases with f16/bf16 outputs (-1: none)
  double seconds = 0;
};
std::vector<KernelTotals> totals;

KernelTotals& kernel_totals(const std::string& name) {
  for (auto& t : totals) {
    if (t.name == name) return t;
  }
  totals.push_back({name});
  return totals.back();
}

// The comparison of one case, element by element.
struct Check {
  double max_err = 0;
  double max_ratio = 0;
  long bad = 0;
  std::string first_bad;
  std::vector<std::string> problems;  // shape, dtype, fallback, ...

  void add(size_t i, double got, double want, double tol) {
    double err = std::fabs(got - want);
    if (!(err <= tol)) {  // NaN fails too
      if (bad++ == 0) {
        first_bad = format("element %zu: got %.9g, want %.9g, |err| %.3e > tol %.3e", i, got, want, err, tol);
      }
    }
    if (!std::isfinite(err)) {
      max_err = max_ratio = INFINITY;
    } else {
      max_err = std::max(max_err, err);
      max_ratio = std::max(max_ratio, err / tol);
    }
  }
  void expect(bool ok, const std::string& what) {
    if (!ok) problems.push_back(what);
  }
  bool ok() const { return bad == 0 && problems.empty(); }
};

// `half_out`: the case's output is f16/bf16, whose final rounding alone
// takes up to ~all of the tolerance (summarized apart).
void report(const std::string& kernel, const std::string& label, const Check& c, const char* tol_desc,
            bool half_out = false) {
  KernelTotals& t = kernel_totals(kernel);
  ++t.cases;
  (half_out ? t.worst_ratio_half : t.worst_ratio) = std::max(half_out ? t.worst_ratio_half : t.worst_ratio, c.max_ratio);
  std::printf("%s %s %s: max|err| %.2e, max err/tol %.3f (tol %s)\n", c.ok() ? "[ok]  " : "[FAIL]", kernel.c_str(),
              label.c_str(), c.max_err, c.max_ratio, tol_desc);
  if (!c.ok()) {
    ++t.failures;
    for (auto& p : c.problems) std::printf("         %s\n", p.c_str());
    if (c.bad) std::printf("         %ld elements over tol; first: %s\n", c.bad, c.first_bad.c_str());
  }
  std::fflush(stdout);
}

// Runs one case; an exception is a failure of that case.
void run_case(const std::string& kernel, const std::string& label, const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    KernelTotals& t = kernel_totals(kernel);
    ++t.cases;
    ++t.failures;
    t.worst_ratio = INFINITY;
    std::printf("[FAIL] %s %s: exception: %s\n", kernel.c_str(), label.c_str(), e.what());
    std::fflush(stdout);
  }
}

// ---------------------------------------------------------------------------
// Arrays.

template <typename T>
std::vector<T> values_as(const mx::array& a, mx::Dtype dtype) {
  mx::array c = mx::contiguous(mx::astype(a, dtype));
  c.eval();
  if (!c.flags().row_contiguous) throw std::runtime_error("values_as: not row-contiguous");
  const T* p = c.data<T>();
  return std::vector<T>(p, p + c.size());
}

std::vector<float> f32(const mx::array& a) { return values_as<float>(a, mx::float32); }

std::string shape_str(const mx::Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

const char* dtype_str(mx::Dtype d) {
  if (d == mx::float32) return "f32";
  if (d == mx::float16) return "f16";
  if (d == mx::bfloat16) return "bf16";
  return "other";
}

// Half an ulp of an f16/bf16 result, relative to |y|.
double out_rounding(mx::Dtype d) {
  if (d == mx::float16) return std::ldexp(1.0, -11);
  if (d == mx::bfloat16) return std::ldexp(1.0, -8);
  return 0.0;
}

bool is_kernel_node(const mx::array& a) {
  return a.has_primitive() && std::string(a.primitive().name()).rfind("Mlxcel", 0) == 0;
}

// A kernel node, or a view (one input) of one: causal_attention returns a
// transposed view of its [B, L, H, D] buffer.
bool from_kernel_node(const mx::array& a) {
  return is_kernel_node(a) || (a.has_primitive() && a.inputs().size() == 1 && is_kernel_node(a.inputs()[0]));
}

mx::array normal(uint64_t seed, const mx::Shape& shape, float std = 1.0f) {
  mx::array a = mx::random::normal(shape, mx::float32, 0.0f, std, mx::random::key(seed));
  a.eval();
  return a;
}

mx::array x_of(uint64_t seed, const mx::Shape& shape, mx::Dtype dtype) {
  mx::array x = mx::astype(normal(seed ^ 0x5eed, shape), dtype);
  x.eval();
  return x;
}

struct Quantized {
  mx::array w, scales, biases;
  int n, k, group, bits;
};

// A random [n, k] weight, quantized by MLX; a row-dependent spread makes
// the scales differ a lot between rows.
Quantized make_weights(uint64_t seed, int n, int k, int group, int bits, mx::Dtype sdtype, float std = 1.0f) {
  auto [k1, k2] = mx::random::split(mx::random::key(seed));
  mx::array wf = mx::random::normal({n, k}, mx::float32, 0.0f, std, k1);
  mx::array spread = mx::random::uniform(0.01f, 2.0f, {n, 1}, mx::float32, k2);
  wf = mx::add(mx::multiply(wf, spread), mx::array(0.1f * std));
  std::vector<mx::array> q = mx::quantize(wf, group, bits);
  Quantized out{q[0], mx::astype(q[1], sdtype), mx::astype(q[2], sdtype), n, k, group, bits};
  mx::eval({out.w, out.scales, out.biases});
  return out;
}

// Whether MLX quantizes (group, bits) at all.
bool mlx_quantizes(int group, int bits) {
  try {
    auto q = mx::quantize(normal(1, {2, 256}), group, bits);
    mx::eval(q);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Exact y = x @ dequantize(w).T and mag = Σ|x·w| in f64, from MLX's packing
// read bit by bit: element j of a row sits at bit j·bits of its
// little-endian words (3, 5 and 6 bits straddle words).
struct Exact {
  std::vector<double> y, mag;
};

std::vector<double> dequantized_rows(const Quantized& q) {
  std::vector<uint32_t> words = values_as<uint32_t>(q.w, mx::uint32);
  std::vector<float> s = f32(q.scales), b = f32(q.biases);
  const int groups = q.k / q.group, row_words = q.k * q.bits / 32;
  const uint64_t mask = (uint64_t(1) << q.bits) - 1;
  std::vector<double> deq(size_t(q.n) * q.k);
  for (int o = 0; o < q.n; ++o) {
    const uint32_t* row = &words[size_t(o) * row_words];
    for (int j = 0; j < q.k; ++j) {
      int bit = j * q.bits;
      uint64_t pair = row[bit / 32] | (bit / 32 + 1 < row_words ? uint64_t(row[bit / 32 + 1]) << 32 : 0);
      uint64_t v = (pair >> (bit % 32)) & mask;
      int g = o * groups + j / q.group;
      deq[size_t(o) * q.k + j] = double(s[g]) * double(v) + double(b[g]);
    }
  }
  return deq;
}

// y and mag for rows xs [m, k] against w [n, k] (row-major f64).
Exact exact_matmul(const std::vector<float>& xs, const std::vector<double>& w, int n, int k) {
  const size_t m = k ? xs.size() / k : 0;
  Exact e{std::vector<double>(m * n), std::vector<double>(m * n)};
  for (size_t r = 0; r < m; ++r) {
    for (int o = 0; o < n; ++o) {
      double acc = 0, mag = 0;
      for (int j = 0; j < k; ++j) {
        double p = double(xs[r * k + j]) * w[size_t(o) * k + j];
        acc += p;
        mag += std::fabs(p);
      }
      e.y[r * n + o] = acc;
      e.mag[r * n + o] = mag;
    }
  }
  return e;
}

// |got - exact| <= rel·mag + (half an ulp of the output)·|exact|.
void check_matmul(Check& c, const mx::array& got, const mx::Shape& want_shape, mx::Dtype want_dtype,
                  const Exact& e, double rel) {
  c.expect(got.shape() == want_shape, "shape " + shape_str(got.shape()) + ", want " + shape_str(want_shape));
  c.expect(got.dtype() == want_dtype, std::string("dtype ") + dtype_str(got.dtype()) + ", want " + dtype_str(want_dtype));
  std::vector<float> v = f32(got);
  if (v.size() != e.y.size()) {
    c.expect(false, format("%zu values, want %zu", v.size(), e.y.size()));
    return;
  }
  const double round = out_rounding(got.dtype());
  for (size_t i = 0; i < v.size(); ++i) c.add(i, v[i], e.y[i], rel * e.mag[i] + round * std::fabs(e.y[i]) + 1e-30);
}

// Auto and Portable, less those that `name` (the loop a path runs) shows to
// be the same loop: on aarch64 both run the portable loop, so one.
std::vector<kn::Path> distinct(const std::function<std::string(kn::Path)>& name) {
  std::vector<kn::Path> out;
  std::vector<std::string> seen;
  for (kn::Path p : {kn::Path::Auto, kn::Path::Portable}) {
    std::string n = name(p);
    if (std::find(seen.begin(), seen.end(), n) == seen.end()) {
      seen.push_back(n);
      out.push_back(p);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// quantized_matmul (decode: a few rows).

constexpr double kRel = 1e-5;
const char* const kMatTol = "1e-5*sum|x*w| + out ulp/2";
const char* const kQuantTol = "1e-5*sum|x*w| + 1.01*sum amax_g/65024*|s*q| + out ulp/2";

// The loop quantized_matmul runs for `path` and a layout, as its Job picks
// it: NeonInt8 takes bits 2, 4 and 8 when a group spans a power of two below
// 8 words or a multiple of 8 words (lanes_for), anything else the portable
// loop. (Off aarch64 main() caps every path at the portable loop.)
std::string matvec_loop(kn::Path path, int bits, int group) {
  const std::string name = kn::path_name(kn::resolve_path(path));
  if (name != "neon-int8") return name;
  if (bits != 2 && bits != 4 && bits != 8) return "portable";
  const int wpg = group * bits / 32;
  return (wpg < 8 && (wpg & (wpg - 1)) == 0) || wpg % 8 == 0 ? name : "portable";
}

// Whether a loop quantizes the activations (the integer loops).
bool integer_loop(const std::string& loop) {
  return loop == "neon-int8" || loop == "avx2-int8" || loop == "avx512-vnni";
}

// `e` with mag widened by the integer loops' activation-quantization bound,
// exactly as reference_quantized_x in mlx-sys/tests/kernels.rs: for row r of
// x and output o, mag += 1.01 · Σ_k max|x_r of k's group| / 65024 ·
// |s[o, group of k] · q[o, k]| / 1e-5. Bits 2, 4, 8 (values within a word).
Exact with_quantized_x(Exact e, const std::vector<float>& xs, const Quantized& q) {
  std::vector<uint32_t> words = values_as<uint32_t>(q.w, mx::uint32);
  std::vector<float> s = f32(q.scales);
  const int k = q.k, n = q.n, groups = k / q.group, row_words = k * q.bits / 32;
  const uint32_t mask = (1u << q.bits) - 1;
  const size_t m = k ? xs.size() / k : 0;
  std::vector<double> amax(groups);
  for (size_t r = 0; r < m; ++r) {
    for (int g = 0; g < groups; ++g) {
      amax[g] = 0;
      for (int j = g * q.group; j < (g + 1) * q.group; ++j) amax[g] = std::max(amax[g], std::fabs(double(xs[r * k + j])));
    }
    for (int o = 0; o < n; ++o) {
      double bound = 0;
      for (int j = 0; j < k; ++j) {
        const uint32_t v = (words[size_t(o) * row_words + size_t(j) * q.bits / 32] >> (j * q.bits % 32)) & mask;
        bound += amax[j / q.group] / 65024.0 * std::fabs(double(s[size_t(o) * groups + j / q.group]) * double(v));
      }
      e.mag[r * n + o] += bound * 1.01 / kRel;
    }
  }
  return e;
}

// Checks Portable, Auto and NeonInt8 (each label names the path asked for
// and the loop it runs: "auto->neon-int8"). Paths that run the same loop
// must give the same bits, and an integer loop's f32 result must differ
// from the exact loop's: the loop named is the one that ran.
void qmm_case(uint64_t seed, int bits, int group, int k, int n, const mx::Shape& rows, mx::Dtype xdt, mx::Dtype sdt) {
  mx::Shape shape = rows;
  shape.push_back(k);
  std::string label =
      format("bits=%d group=%d K=%d N=%d x=%s %s/%s", bits, group, k, n, shape_str(shape).c_str(), dtype_str(xdt), dtype_str(sdt));
  run_case("quantized_matmul", label, [&] {
    Quantized q = make_weights(seed, n, k, group, bits, sdt);
    mx::array x = x_of(seed, shape, xdt);
    std::vector<float> xs = f32(x);
    Exact e = exact_matmul(xs, dequantized_rows(q), n, k);
    std::optional<Exact> eq;  // e widened for the integer loops
    mx::array mlx = mx::quantized_matmul(x, q.w, q.scales, q.biases, true, group, bits);
    std::vector<std::pair<std::string, std::vector<float>>> ran;  // (loop, result) of the paths so far
    for (kn::Path path : {kn::Path::Portable, kn::Path::Auto, kn::Path::NeonInt8}) {
      const std::string loop = matvec_loop(path, bits, group);
      const bool quantized_x = integer_loop(loop);
      if (quantized_x && !eq) eq = with_quantized_x(e, xs, q);
      Check c;
      mx::array ours = kn::quantized_matmul(x, q.w, q.scales, q.biases, group, bits, path);
      c.expect(is_kernel_node(ours), "fell back to MLX's op");
      check_matmul(c, ours, mlx.shape(), mlx.dtype(), quantized_x ? *eq : e, kRel);
      std::vector<float> v = f32(ours);
      for (const auto& [other, values] : ran) {
        if (other == loop) {
          c.expect(v == values, "not bit for bit the result of another path on the " + loop + " loop");
        } else if (ours.dtype() == mx::float32 && quantized_x != integer_loop(other)) {
          c.expect(v != values, "bit for bit the " + other + " loop's result: the " + loop + " loop did not run");
        }
      }
      ran.emplace_back(loop, std::move(v));
      report(quantized_x ? "quantized_matmul " + loop : std::string("quantized_matmul"),
             label + " " + kn::path_name(path) + "->" + loop, c, quantized_x ? kQuantTol : kMatTol,
             ours.dtype() != mx::float32);
    }
    if (xdt == mx::float32 && sdt == mx::float32) {
      Check c;
      check_matmul(c, mlx, mlx.shape(), mx::float32, e, kRel);
      report("mlx::quantized_matmul (the bar)", label, c, kMatTol);
    }
  });
}

void quantized_matmul_tests() {
  uint64_t seed = 100;
  // Every width and group size MLX quantizes, K three groups long, odd N,
  // M = 1, 2, 3, 5, 17 (a batch axis) and 64 rows: every row tile of the
  // NEON loop (4 output rows for M = 1, 2 x 2 for M = 2, else 1 output row
  // x 4, 3, 2, 1 activation rows) and chunks that end inside a row.
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (int group : {32, 64, 128}) {
      if (!kn::supports(group, bits) || !mlx_quantizes(group, bits)) {
        std::printf("[skip]  quantized_matmul bits=%d group=%d: not quantized by MLX or not supported\n", bits, group);
        continue;
      }
      const int k = 3 * group, n = group == 64 ? 67 : 37;
      for (const mx::Shape& rows :
           {mx::Shape{1}, mx::Shape{2}, mx::Shape{1, 3}, mx::Shape{5}, mx::Shape{1, 17}, mx::Shape{64}}) {
        qmm_case(++seed, bits, group, k, n, rows, mx::float32, mx::float32);
      }
    }
  }
  // M from 1 to 17 covers every row-tile remainder.
  for (int m = 4; m <= 16; ++m) qmm_case(++seed, 4, 64, 192, 37, {m}, mx::float32, mx::float32);
  // Model shapes (SmolLM2-135M's projections) and a large odd row count.
  qmm_case(++seed, 4, 32, 576, 1536, {1, 1}, mx::float32, mx::float32);
  qmm_case(++seed, 8, 64, 1536, 577, {3}, mx::float32, mx::float32);
  qmm_case(++seed, 6, 64, 576, 193, {2}, mx::float32, mx::float16);
  qmm_case(++seed, 4, 32, 576, 4099, {1}, mx::float32, mx::bfloat16);
  // Half-precision activations and scales.
  const std::pair<mx::Dtype, mx::Dtype> halves[] = {
      {mx::float16, mx::float16}, {mx::bfloat16, mx::bfloat16}, {mx::float32, mx::bfloat16}, {mx::bfloat16, mx::float32}};
  for (auto [xdt, sdt] : halves) {
    for (int bits : {3, 4, 8}) {
      for (const mx::Shape& rows : {mx::Shape{1}, mx::Shape{2, 3}}) {
        qmm_case(++seed, bits, 32, 160, 45, rows, xdt, sdt);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// quantized_gemm, quantized_gemm_swiglu, dense_matmul (prefill: many rows).

void gemm_case(uint64_t seed, int bits, int group, int k, int n, const mx::Shape& shape, mx::Dtype xdt, mx::Dtype sdt) {
  std::string label =
      format("bits=%d group=%d K=%d N=%d x=%s %s/%s", bits, group, k, n, shape_str(shape).c_str(), dtype_str(xdt), dtype_str(sdt));
  run_case("quantized_gemm", label, [&] {
    Quantized q = make_weights(seed, n, k, group, bits, sdt);
    mx::array x = x_of(seed, shape, xdt);
    Exact e = exact_matmul(f32(x), dequantized_rows(q), n, k);
    mx::array mlx = mx::quantized_matmul(x, q.w, q.scales, q.biases, true, group, bits);
    for (kn::Path path : distinct([&](kn::Path p) { return std::string(kn::gemm_loop_name(p, bits)); })) {
      Check c;
      mx::array ours = kn::quantized_gemm(x, q.w, q.scales, q.biases, group, bits, path);
      if (kn::gemm_supports(group, bits) && xdt == mx::float32 && ours.dtype() == mx::float32) {
        c.expect(is_kernel_node(ours), "fell back to another op");
      }
      // x86's AMX loop splits operands into bf16 halves (5e-5); aarch64 runs exact loops.
      double rel = kn::gemm_uses_amx(path) ? 5e-5 : kRel;
      check_matmul(c, ours, mlx.shape(), mlx.dtype(), e, rel);
      report("quantized_gemm", label + " " + kn::gemm_loop_name(path, bits), c, kMatTol, ours.dtype() != mx::float32);
    }
    if (xdt == mx::float32 && sdt == mx::float32) {
      Check c;
      check_matmul(c, mlx, mlx.shape(), mx::float32, e, kRel);
      report("mlx::quantized_matmul (the bar)", label, c, kMatTol);
    }
  });
}

void swiglu_case(uint64_t seed, int bits, int group, int k, int n, const mx::Shape& shape) {
  std::string label = format("bits=%d group=%d K=%d N=%d x=%s", bits, group, k, n, shape_str(shape).c_str());
  run_case("quantized_gemm_swiglu", label, [&] {
    Quantized g = make_weights(seed, n, k, group, bits, mx::float32);
    Quantized u = make_weights(seed + 1, n, k, group, bits, mx::float32);
    mx::array x = x_of(seed, shape, mx::float32);
    std::vector<float> xs = f32(x);
    Exact eg = exact_matmul(xs, dequantized_rows(g), n, k), eu = exact_matmul(xs, dequantized_rows(u), n, k);
    mx::array ours = kn::quantized_gemm_swiglu(x, g.w, g.scales, g.biases, u.w, u.scales, u.biases, group, bits);
    Check c;
    if (kn::gemm_supports(group, bits)) c.expect(is_kernel_node(ours), "fell back to MLX's ops");
    mx::Shape want = shape;
    want.back() = n;
    c.expect(ours.shape() == want, "shape " + shape_str(ours.shape()));
    c.expect(ours.dtype() == mx::float32, "dtype");
    std::vector<float> v = f32(ours);
    c.expect(v.size() == eg.y.size(), "size");
    const double rel = kn::gemm_uses_amx() ? 5e-5 : kRel;
    for (size_t i = 0; i < std::min(v.size(), eg.y.size()); ++i) {
      double gv = eg.y[i], uv = eu.y[i], sig = 1.0 / (1.0 + std::exp(-gv)), exact = gv * sig * uv;
      double tol = rel * (1.1 * std::fabs(uv) * eg.mag[i] + std::fabs(gv * sig) * eu.mag[i]) + 1e-6 * std::fabs(exact) + 1e-30;
      c.add(i, v[i], exact, tol);
    }
    report("quantized_gemm_swiglu", label + " " + kn::gemm_loop_name(kn::Path::Auto, bits), c,
           "1e-5*(1.1|u| mag_g + |silu g| mag_u) + 1e-6|y|");
  });
}

void dense_case(uint64_t seed, const mx::Shape& shape, int n, mx::Dtype xdt, mx::Dtype wdt) {
  const int k = shape.back();
  std::string label = format("x=%s %s w=[%d,%d] %s", shape_str(shape).c_str(), dtype_str(xdt), n, k, dtype_str(wdt));
  run_case("dense_matmul", label, [&] {
    mx::array x = x_of(seed, shape, xdt);
    mx::array w = mx::astype(normal(seed + 7, {n, k}), wdt);
    w.eval();
    std::vector<float> wf = f32(w);
    Exact e = exact_matmul(f32(x), std::vector<double>(wf.begin(), wf.end()), n, k);
    mx::array mlx = mx::matmul(x, mx::transpose(w));
    for (kn::Path path : distinct([](kn::Path p) { return std::string(kn::gemm_loop_name(p, 0)); })) {
      Check c;
      mx::array ours = kn::dense_matmul(x, w, path);
      if (ours.dtype() == mx::float32) c.expect(is_kernel_node(ours), "fell back to MLX's matmul");
      check_matmul(c, ours, mlx.shape(), mlx.dtype(), e, kRel);
      report("dense_matmul", label + " " + kn::gemm_loop_name(path, 0), c, kMatTol, ours.dtype() != mx::float32);
    }
  });
}

void gemm_tests() {
  uint64_t seed = 1000;
  // Every width; K of 3 to 5 groups; N below, across and off the 16/32-wide
  // tiles; M of 16 (the prefill threshold), 17 and 33 rows.
  const int ns[] = {1, 31, 33, 67};
  int ni = 0;
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    for (auto [group, k] : {std::pair{32, 96}, std::pair{64, 192}, std::pair{128, 256}}) {
      if (!kn::gemm_supports(group, bits) || !mlx_quantizes(group, bits)) continue;
      for (int m : {16, 33}) {
        int n = ns[ni++ % 4];
        gemm_case(++seed, bits, group, k, n, m == 33 ? mx::Shape{1, m, k} : mx::Shape{m, k}, mx::float32, mx::float32);
      }
    }
    gemm_case(++seed, bits, 32, 160, 45, {17, 160}, mx::float32, mx::float32);
  }
  // More rows than one task takes, model shapes, half-precision inputs and scales.
  gemm_case(++seed, 4, 32, 96, 100, {200, 96}, mx::float32, mx::float32);
  gemm_case(++seed, 4, 32, 576, 1536, {2, 37, 576}, mx::float32, mx::float16);
  gemm_case(++seed, 8, 64, 1536, 577, {40, 1536}, mx::float32, mx::float32);
  gemm_case(++seed, 4, 32, 160, 45, {3, 19, 160}, mx::float16, mx::float16);
  gemm_case(++seed, 8, 64, 192, 45, {19, 192}, mx::bfloat16, mx::bfloat16);
  gemm_case(++seed, 4, 32, 160, 45, {19, 160}, mx::float32, mx::bfloat16);

  for (int bits : {2, 4, 8}) {
    for (int n : {17, 70}) swiglu_case(seed += 2, bits, 32, 96, n, {1, n == 17 ? 16 : 37, 96});
  }

  // Dense: M across the 16-row switch (few-row loop below, GEMM above),
  // K and N off every tile width.
  for (int m : {1, 2, 3, 17, 40}) {
    for (auto [k, n] : {std::pair{7, 3}, std::pair{64, 67}, std::pair{577, 33}}) {
      dense_case(++seed, {m, k}, n, mx::float32, mx::float32);
    }
  }
  dense_case(++seed, {2, 37, 576}, 1536, mx::float32, mx::float32);
  dense_case(++seed, {3, 19, 160}, 45, mx::float32, mx::float16);
  dense_case(++seed, {19, 160}, 45, mx::bfloat16, mx::bfloat16);
  dense_case(++seed, {2, 160}, 45, mx::float16, mx::float32);
}

// ---------------------------------------------------------------------------
// causal_attention.

// f64 causal attention: q [B, H, L, D], k/v [B, Hkv, S, D] as row-major values.
std::vector<double> attention_reference(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, int b, int h, int hkv, int l, int s, int d,
                                        float scale) {
  std::vector<double> out(size_t(b) * h * l * d, 0.0);
  std::vector<double> e(s);
  for (int bi = 0; bi < b; ++bi) {
    for (int hi = 0; hi < h; ++hi) {
      const int kh = hi / (h / hkv);
      for (int i = 0; i < l; ++i) {
        const int lim = s - l + i;
        const float* qr = &q[((size_t(bi) * h + hi) * l + i) * d];
        double mx_ = -INFINITY;
        for (int j = 0; j <= lim; ++j) {
          const float* kr = &k[((size_t(bi) * hkv + kh) * s + j) * d];
          double dot = 0;
          for (int t = 0; t < d; ++t) dot += double(qr[t]) * double(kr[t]);
          e[j] = dot * scale;
          mx_ = std::max(mx_, e[j]);
        }
        double z = 0;
        for (int j = 0; j <= lim; ++j) z += (e[j] = std::exp(e[j] - mx_));
        double* o = &out[((size_t(bi) * h + hi) * l + i) * d];
        for (int j = 0; j <= lim; ++j) {
          const float* vr = &v[((size_t(bi) * hkv + kh) * s + j) * d];
          for (int t = 0; t < d; ++t) o[t] += e[j] / z * double(vr[t]);
        }
      }
    }
  }
  return out;
}

// `spread` scales q and k: 30 gives scores of several hundred, which the
// softmax must survive by subtracting the row maximum (scores ~1e3 carry
// ~1e3·eps absolute error into the exponent: 1e-3·max|v| then).
void attention_case(uint64_t seed, int b, int h, int hkv, int l, int s, int d, float spread = 1.0f) {
  std::string label = format("B=%d H=%d Hkv=%d L=%d S=%d D=%d q,k*%g", b, h, hkv, l, s, d, spread);
  run_case("causal_attention", label, [&] {
    const float scale = 1.0f / std::sqrt(float(d));
    // q as the transposed view a model produces, k and v as slices of a
    // larger cache buffer.
    mx::array q = mx::transpose(mx::multiply(normal(seed, {b, l, h, d}), mx::array(2.0f * spread)), {0, 2, 1, 3});
    const int cap = s + 7;
    mx::array kv = mx::slice(normal(seed + 1, {b, hkv, cap, d}, spread), {0, 0, 0, 0}, {b, hkv, s, d});
    mx::array vv = mx::slice(normal(seed + 2, {b, hkv, cap, d}), {0, 0, 0, 0}, {b, hkv, s, d});
    mx::eval({q, kv, vv});
    std::vector<float> qs = f32(q), ks = f32(kv), vs = f32(vv);
    std::vector<double> exact = attention_reference(qs, ks, vs, b, h, hkv, l, s, d, scale);
    double vmax = 0;
    for (float x : vs) vmax = std::max(vmax, double(std::fabs(x)));
    const double tol = (spread > 1.0f ? 1e-3 : 1e-5) * vmax;
    mx::array ours = kn::causal_attention(q, kv, vv, scale);
    mx::array mlx = mx::fast::scaled_dot_product_attention(q, kv, vv, scale, "causal");
    for (auto [name, got] : {std::pair<const char*, mx::array*>{"causal_attention", &ours},
                             std::pair<const char*, mx::array*>{"mlx::fast::sdpa (the bar)", &mlx}}) {
      Check c;
      if (got == &ours) {
        c.expect(kn::causal_attention_supports(q, kv, vv), "not supported");
        c.expect(from_kernel_node(ours), "fell back to MLX's op");
        // The layout promise: back to [B, L, H, D], the buffer is row-contiguous.
        mx::array merged = mx::transpose(ours, {0, 2, 1, 3});
        c.expect(merged.strides() == mx::Strides({int64_t(l) * h * d, int64_t(h) * d, d, 1}),
                 "not a view of a row-contiguous [B, L, H, D] buffer");
      }
      c.expect(got->shape() == mx::Shape({b, h, l, d}), "shape " + shape_str(got->shape()));
      std::vector<float> g = f32(*got);
      c.expect(g.size() == exact.size(), "size");
      for (size_t i = 0; i < std::min(g.size(), exact.size()); ++i) c.add(i, g[i], exact[i], tol);
      report(name, label, c, spread > 1.0f ? "1e-3*max|v|" : "1e-5*max|v|");
    }
  });
}

void attention_tests() {
  uint64_t seed = 7000;
  for (auto [h, hkv] : {std::pair{4, 2}, std::pair{3, 3}, std::pair{4, 1}}) {
    for (int d : {16, 64}) {
      for (auto [l, offset] : {std::pair{1, 0}, std::pair{5, 3}, std::pair{17, 0}, std::pair{33, 20}}) {
        attention_case(seed += 3, 1, h, hkv, l, l + offset, d);
      }
    }
  }
  attention_case(seed += 3, 2, 6, 2, 40, 45, 80);
  attention_case(seed += 3, 1, 9, 3, 100, 400, 64);
  attention_case(seed += 3, 1, 2, 2, 20, 20, 32, 30.0f);
}

// ---------------------------------------------------------------------------
// quantized_embedding.

void embedding_tests() {
  const int vocab = 37, k = 256;
  const std::vector<int32_t> id_values = {0, 36, 7, -1, 12, 37};  // -1 and 37 lie outside the table
  mx::array ids(id_values.begin(), {2, 3}, mx::int32);
  uint64_t seed = 1300;
  for (auto [bits, group] : {std::pair{2, 32}, std::pair{3, 32}, std::pair{4, 64}, std::pair{5, 32}, std::pair{6, 64},
                             std::pair{8, 128}}) {
    for (mx::Dtype sdt : {mx::float32, mx::bfloat16}) {
      for (mx::Dtype out : {mx::float32, mx::bfloat16}) {
        std::string label = format("bits=%d group=%d V=%d K=%d scales=%s out=%s ids=[2,3]", bits, group, vocab, k,
                                   dtype_str(sdt), dtype_str(out));
        run_case("quantized_embedding", label, [&] {
          Quantized q = make_weights(++seed, vocab, k, group, bits, sdt);
          // MLX's dequantize of the whole table in f32 (the kernel rounds
          // once, to `out`), then the rows by id.
          std::vector<float> table =
              f32(mx::dequantize(q.w, mx::astype(q.scales, mx::float32), mx::astype(q.biases, mx::float32), group, bits));
          mx::array got = kn::quantized_embedding(ids, q.w, q.scales, q.biases, group, bits, out);
          Check c;
          c.expect(is_kernel_node(got), "fell back to MLX's ops");
          c.expect(got.shape() == mx::Shape({2, 3, k}), "shape " + shape_str(got.shape()));
          c.expect(got.dtype() == out, "dtype");
          std::vector<float> g = f32(got);
          c.expect(g.size() == id_values.size() * k, "size");
          // bf16: half an ulp, plus the f32 rounding of scale * q + bias before it.
          const double rel = out == mx::bfloat16 ? std::ldexp(1.0, -8) + 1e-6 : 1e-6;
          for (size_t r = 0; r < id_values.size() && g.size() == id_values.size() * k; ++r) {
            const int id = id_values[r];
            for (int j = 0; j < k; ++j) {
              double want = (id >= 0 && id < vocab) ? table[size_t(id) * k + j] : 0.0;
              c.add(r * k + j, g[r * k + j], want, rel * std::max(std::fabs(want), 1.0));
            }
          }
          report("quantized_embedding", label, c, out == mx::bfloat16 ? "(2^-8+1e-6)*max(|e|,1)" : "1e-6*max(|e|,1)",
                 out == mx::bfloat16);
        });
      }
    }
  }
}

// ---------------------------------------------------------------------------
// decoder_layer against the block composed of MLX's ops.

struct Proj {
  Quantized q;
  std::optional<mx::array> bias;

  kn::QuantizedProjection projection() const { return {q.w, q.scales, q.biases, bias}; }

  mx::array apply(const mx::array& x) const {
    mx::array y = mx::astype(mx::quantized_matmul(x, q.w, q.scales, q.biases, true, q.group, q.bits), mx::float32);
    return bias ? mx::add(y, *bias) : y;
  }
};

struct LayerConfig {
  const char* name;
  int hidden, heads, kv_heads, head_dim, intermediate, group, bits;
  mx::Dtype sdtype;
  int rope_dims;  // 0: head_dim
  float rope_scale;
  bool rope_traditional, rope_freqs, qkv_bias, o_bias, mlp_bias, qk_norm;
};

struct Layer {
  kn::DecoderLayerSpec spec;
  mx::array input_norm, post_norm;
  Proj q, k, v, o, gate, up, down;
  std::optional<mx::array> q_norm, k_norm, freqs;
};

Layer make_layer(uint64_t seed, const LayerConfig& c) {
  const int h = c.hidden, d = c.head_dim, qn = c.heads * d, kvn = c.kv_heads * d;
  const int rope_dims = c.rope_dims ? c.rope_dims : d;
  const float base = 10000.0f;
  auto proj = [&](uint64_t i, int rows, int cols, bool biased) {
    Proj p{make_weights(seed * 100 + i, rows, cols, c.group, c.bits, c.sdtype, 1.0f / std::sqrt(float(cols))),
           std::nullopt};
    if (biased) p.bias = normal(seed * 100 + i + 10, {rows}, 0.3f);
    return p;
  };
  auto norm = [&](uint64_t i, int size) {
    mx::array a = mx::add(normal(seed * 100 + i, {size}, 0.2f), mx::array(1.0f));
    a.eval();
    return a;
  };
  std::optional<mx::array> freqs;
  if (c.rope_freqs) {
    // Periods as llama3 scaling produces them: base^(2i/dims), the
    // low-frequency half stretched by 8.
    std::vector<float> f;
    for (int j = 0; j < rope_dims / 2; ++j) {
      float p = std::pow(base, 2.0f * j / rope_dims);
      f.push_back(j >= rope_dims / 4 ? 8.0f * p : p);
    }
    freqs = mx::array(f.begin(), {rope_dims / 2}, mx::float32);
    freqs->eval();
  }
  kn::DecoderLayerSpec spec;
  spec.hidden = h;
  spec.heads = c.heads;
  spec.kv_heads = c.kv_heads;
  spec.head_dim = d;
  spec.intermediate = c.intermediate;
  spec.norm_eps = 1e-5f;
  spec.rope_dims = rope_dims;
  spec.rope_base = base;
  spec.rope_scale = c.rope_scale;
  spec.rope_traditional = c.rope_traditional;
  spec.attn_scale = 1.0f / std::sqrt(float(d));
  Layer layer{spec,
              norm(1, h),
              norm(2, h),
              proj(3, qn, h, c.qkv_bias),
              proj(4, kvn, h, c.qkv_bias),
              proj(5, kvn, h, c.qkv_bias),
              proj(6, h, qn, c.o_bias),
              proj(7, c.intermediate, h, c.mlp_bias),
              proj(8, c.intermediate, h, c.mlp_bias),
              proj(9, h, c.intermediate, c.mlp_bias),
              std::nullopt,
              std::nullopt,
              freqs};
  if (c.qk_norm) {
    layer.q_norm = norm(27, d);
    layer.k_norm = norm(28, d);
  }
  return layer;
}

// The block from MLX's ops: {out, keys, values}, the caches with positions
// offset..offset+L replaced.
std::vector<mx::array> layer_reference(const Layer& ly, const mx::array& x, const mx::array& keys,
                                       const mx::array& values, int offset) {
  const kn::DecoderLayerSpec& s = ly.spec;
  const int l = x.shape(1), d = s.head_dim, end = offset + l;
  mx::array n1 = mx::fast::rms_norm(x, ly.input_norm, s.norm_eps);
  auto heads = [&](mx::array y, int n, const std::optional<mx::array>& norm) {
    y = mx::reshape(y, {1, l, n, d});
    if (norm) y = mx::fast::rms_norm(y, *norm, s.norm_eps);
    return mx::transpose(y, {0, 2, 1, 3});
  };
  auto rope = [&](const mx::array& t) {
    std::optional<float> base = ly.freqs ? std::nullopt : std::optional<float>(s.rope_base);
    return mx::fast::rope(t, s.rope_dims, s.rope_traditional, base, s.rope_scale, offset, ly.freqs);
  };
  mx::array q = rope(heads(ly.q.apply(n1), s.heads, ly.q_norm));
  mx::array k = rope(heads(ly.k.apply(n1), s.kv_heads, ly.k_norm));
  mx::array v = heads(ly.v.apply(n1), s.kv_heads, std::nullopt);
  mx::array new_keys = mx::slice_update(keys, k, mx::Shape{0, 0, offset, 0}, mx::Shape{1, s.kv_heads, end, d});
  mx::array new_values = mx::slice_update(values, v, mx::Shape{0, 0, offset, 0}, mx::Shape{1, s.kv_heads, end, d});
  mx::array att = mx::fast::scaled_dot_product_attention(q, mx::slice(new_keys, {0, 0, 0, 0}, {1, s.kv_heads, end, d}),
                                                         mx::slice(new_values, {0, 0, 0, 0}, {1, s.kv_heads, end, d}),
                                                         s.attn_scale, l > 1 ? "causal" : "");
  att = mx::reshape(mx::transpose(att, {0, 2, 1, 3}), {1, l, s.heads * d});
  mx::array hres = mx::add(x, ly.o.apply(att));
  mx::array n2 = mx::fast::rms_norm(hres, ly.post_norm, s.norm_eps);
  mx::array g = ly.gate.apply(n2), u = ly.up.apply(n2);
  mx::array out = mx::add(hres, ly.down.apply(mx::multiply(mx::multiply(g, mx::sigmoid(g)), u)));
  mx::eval({out, new_keys, new_values});
  return {out, new_keys, new_values};
}

// max|got - want| <= tol·max|want| over the whole tensor.
void compare_scaled(Check& c, const char* what, const mx::array& got, const mx::array& want, double tol) {
  c.expect(got.shape() == want.shape(), std::string(what) + ": shape " + shape_str(got.shape()));
  c.expect(got.dtype() == mx::float32, std::string(what) + ": dtype");
  std::vector<float> g = f32(got), w = f32(want);
  double scale = 0;
  for (float x : w) scale = std::max(scale, double(std::fabs(x)));
  for (size_t i = 0; i < std::min(g.size(), w.size()); ++i) c.add(i, g[i], w[i], tol * scale + 1e-30);
}

void layer_case(uint64_t seed, const LayerConfig& cfg, int offset, int l) {
  // The projections' loop (the block runs Auto's): 5e-4 for an integer one.
  const std::string loop = matvec_loop(kn::Path::Auto, cfg.bits, cfg.group);
  std::string label = format("%s bits=%d group=%d hidden=%d heads=%d/%d head_dim=%d offset=%d L=%d %s", cfg.name,
                             cfg.bits, cfg.group, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, offset, l,
                             loop.c_str());
  run_case("decoder_layer", label, [&] {
    Layer ly = make_layer(seed, cfg);
    const int capacity = offset + l + 3, end = offset + l, kvh = cfg.kv_heads, d = cfg.head_dim;
    mx::array x = normal(seed ^ 0x5eed, {1, l, cfg.hidden});
    mx::array keys = normal(seed ^ 0xe1, {1, kvh, capacity, d});
    mx::array values = normal(seed ^ 0xe2, {1, kvh, capacity, d});
    kn::DecoderLayerSpec spec = ly.spec;
    spec.offset = offset;
    kn::DecoderLayerInputs in{x,
                              ly.input_norm,
                              ly.q.projection(),
                              ly.k.projection(),
                              ly.v.projection(),
                              ly.o.projection(),
                              ly.post_norm,
                              ly.gate.projection(),
                              ly.up.projection(),
                              ly.down.projection(),
                              keys,
                              values,
                              ly.q_norm,
                              ly.k_norm,
                              ly.freqs};
    std::vector<mx::array> got = kn::decoder_layer(in, spec);
    Check c;
    c.expect(got.size() == 3, "want 3 outputs");
    c.expect(is_kernel_node(got[0]), "not a kernel node");
    mx::eval(got);
    std::vector<mx::array> want = layer_reference(ly, x, keys, values, offset);
    const double tol = (integer_loop(loop) ? 5e-4 : 1e-5) + end * std::max(cfg.rope_scale, 1.0f) * std::ldexp(1.0, -23);
    compare_scaled(c, "out", got[0], want[0], tol);
    for (int i : {1, 2}) {
      const char* what = i == 1 ? "keys" : "values";
      const mx::array& old = i == 1 ? keys : values;
      c.expect(got[i].shape() == old.shape(), std::string(what) + ": cache shape");
      if (offset > 0) {
        auto rows = [&](const mx::array& a) { return f32(mx::slice(a, {0, 0, 0, 0}, {1, kvh, offset, d})); };
        c.expect(rows(got[i]) == rows(old), std::string(what) + ": cached rows below the offset changed");
      }
      auto fresh = [&](const mx::array& a) { return mx::slice(a, {0, 0, offset, 0}, {1, kvh, end, d}); };
      compare_scaled(c, what, fresh(got[i]), fresh(want[i]), tol);
    }
    report("decoder_layer", label, c, format("%.2e*max|ref|", tol).c_str());
  });
}

void decoder_layer_tests() {
  //                  name      hid hd kv  hd inter grp bits sdtype       rdims rscale trad  freqs qkvb  ob    mlpb  qkn
  const LayerConfig llama{"llama", 64, 4, 2, 16, 96, 32, 4, mx::float32, 0, 1.0f, false, false, false, false, false, false};
  const LayerConfig qwen3{"qwen3", 64, 4, 2, 16, 128, 64, 8, mx::bfloat16, 0, 1.0f, false, false, true, false, false, true};
  const LayerConfig odd{"llama3-partial-rope", 64, 6, 3, 16, 96, 32, 6, mx::float16, 8, 0.5f, true, true, true, true, true, false};
  const LayerConfig wide{"3-bit", 128, 2, 1, 64, 160, 32, 3, mx::float32, 0, 2.0f, false, false, false, false, false, false};
  uint64_t seed = 40;
  layer_case(++seed, llama, 0, 1);
  layer_case(++seed, llama, 7, 1);
  layer_case(++seed, llama, 3, 5);
  layer_case(++seed, qwen3, 4, 3);
  layer_case(++seed, odd, 10, 2);
  layer_case(++seed, wide, 30, 8);
  layer_case(++seed, {"5-bit", 64, 4, 4, 16, 96, 32, 5, mx::float32, 0, 1.0f, false, false, false, false, false, false}, 2, 1);
  const LayerConfig smollm{"smollm2-135m", 576, 9, 3, 64, 1536, 64, 4, mx::bfloat16, 0, 1.0f, false, false, false, false, false, false};
  layer_case(++seed, smollm, 100, 1);
  layer_case(++seed, smollm, 1500, 8);
  layer_case(++seed, {"2-bit", 64, 4, 1, 16, 96, 32, 2, mx::float32, 0, 1.0f, false, false, false, false, false, false}, 0, 4);
}

}  // namespace

// ---------------------------------------------------------------------------
// rms_norm and rope (norm_rope.h) against MLX's fast ops.

void norm_rope_tests() {
  uint64_t seed = 9000;
  for (const mx::Shape& shape : {mx::Shape{7}, mx::Shape{3, 37}, mx::Shape{2, 5, 64}, mx::Shape{300, 576}}) {
    for (mx::Dtype wdt : {mx::float32, mx::bfloat16}) {
      run_case("rms_norm", format("x=%s weight=%s", shape_str(shape).c_str(), dtype_str(wdt)), [&] {
        mx::array x = normal(++seed, shape, 2.0f);
        mx::array w = mx::astype(normal(++seed, {shape.back()}), wdt);
        mx::array got = kn::rms_norm(x, w, 1e-5f);
        mx::array want = mx::fast::rms_norm(x, w, 1e-5f);
        Check c;
        c.expect(is_kernel_node(got), "not a kernel node");
        std::vector<float> g = f32(got), r = f32(want);
        for (size_t i = 0; i < g.size(); ++i) c.add(i, g[i], r[i], 1e-5 * std::fabs(r[i]) + 1e-30);
        report("rms_norm", format("x=%s weight=%s", shape_str(shape).c_str(), dtype_str(wdt)), c, "1e-5 relative");
      });
    }
  }
  struct RopeCase {
    mx::Shape shape;
    int dims;
    bool traditional, freqs, transposed;
    int offset;
  };
  for (const RopeCase& rc : {RopeCase{{1, 2, 3, 8}, 8, false, false, false, 0}, RopeCase{{1, 2, 3, 8}, 8, true, false, false, 4},
                             RopeCase{{2, 9, 37, 64}, 32, false, false, true, 17},
                             RopeCase{{1, 4, 100, 64}, 64, false, true, false, 3}}) {
    const std::string label = format("x=%s dims=%d traditional=%d freqs=%d transposed=%d offset=%d",
                                     shape_str(rc.shape).c_str(), rc.dims, int(rc.traditional), int(rc.freqs),
                                     int(rc.transposed), rc.offset);
    run_case("rope", label, [&] {
      mx::array x = normal(++seed, rc.shape);
      if (rc.transposed) {
        mx::Shape stored = rc.shape;
        std::swap(stored[1], stored[2]);
        x = mx::transpose(normal(++seed, stored), {0, 2, 1, 3});
      }
      std::optional<mx::array> freqs;
      if (rc.freqs) freqs = mx::add(mx::arange(1.0, 1.0 + rc.dims / 2, mx::float32), mx::array(0.5f));
      std::optional<float> base = rc.freqs ? std::nullopt : std::optional<float>(10000.0f);
      mx::array got = kn::rope(x, rc.dims, rc.traditional, base, 1.0f, rc.offset, freqs);
      mx::array want = mx::fast::rope(x, rc.dims, rc.traditional, base, 1.0f, rc.offset, freqs);
      Check c;
      c.expect(is_kernel_node(got), "not a kernel node");
      std::vector<float> g = f32(got), r = f32(want), xs = f32(x);
      const size_t L = (size_t)rc.shape[rc.shape.size() - 2], D = (size_t)rc.shape.back();
      for (size_t i = 0; i < g.size(); ++i) {
        // f32 angles: a few ulp of (offset + l) radians at most.
        const double position = (double)((i / D) % L + (size_t)rc.offset);
        c.add(i, g[i], r[i], 4.0 * (1e-6 + 4e-7 * position) * (std::fabs(xs[i]) + 1.0));
      }
      report("rope", label, c, "(1e-6 + 4e-7 * position) * (|x| + 1) * 4");
    });
  }
}

int main() {
#if !defined(__aarch64__)
  // The exact portable loops are what aarch64 runs; x86's integer and AMX
  // loops need wider bounds (see mlx-sys/tests). Read once, so set first.
  setenv("MLXCEL_KERNELS", "portable", 1);
#endif
  auto start = std::chrono::steady_clock::now();
  utsname u{};
  uname(&u);
  const auto& f = kn::cpu::features();
  std::printf("aarch64 kernels test: machine %s, neon %d (avx2 %d, avx512 %d), %d kernel threads\n", u.machine,
              int(f.neon), int(f.avx2), int(f.avx512), kn::num_threads());
  std::printf("quantized_matmul path: %s; quantized_gemm loops: bits 2/3/4/5/6/8 %s/%s/%s/%s/%s/%s, dense %s; amx %d\n",
              kn::path_name(kn::auto_path()), kn::gemm_loop_name(kn::Path::Auto, 2), kn::gemm_loop_name(kn::Path::Auto, 3),
              kn::gemm_loop_name(kn::Path::Auto, 4), kn::gemm_loop_name(kn::Path::Auto, 5),
              kn::gemm_loop_name(kn::Path::Auto, 6), kn::gemm_loop_name(kn::Path::Auto, 8),
              kn::gemm_loop_name(kn::Path::Auto, 0), int(kn::gemm_uses_amx()));
  std::fflush(stdout);

  const std::pair<const char*, void (*)()> sections[] = {{"quantized_matmul", quantized_matmul_tests},
                                                         {"quantized_gemm", gemm_tests},
                                                         {"causal_attention", attention_tests},
                                                         {"quantized_embedding", embedding_tests},
                                                         {"decoder_layer", decoder_layer_tests},
                                                         {"norm_rope", norm_rope_tests}};
  for (auto [name, fn] : sections) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    std::printf("-- %s tests: %.1f s\n", name, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  int cases = 0, failures = 0;
  std::string worst;
  for (const auto& t : totals) {
    cases += t.cases;
    failures += t.failures;
    worst += format("%s%s %.3f", worst.empty() ? "" : ", ", t.name.c_str(), t.worst_ratio);
    if (t.worst_ratio_half >= 0) worst += format(" (f16/bf16 out %.3f)", t.worst_ratio_half);
    if (t.failures) worst += format(" (%d FAILED)", t.failures);
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("aarch64 kernels test: %s: %d cases, %d failed, %.1f s (%s path, gemm loop %s); max err/tol: %s\n",
              failures || cases == 0 ? "FAILED" : "passed", cases, failures, secs, kn::path_name(kn::auto_path()),
              kn::gemm_loop_name(kn::Path::Auto, 4), worst.c_str());
  return failures || cases == 0 ? 1 : 0;
}
