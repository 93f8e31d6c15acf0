// See norm_rope.h.

#include "norm_rope.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "detail.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/primitives.h"
#include "quantized_matmul.h"

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

// Where each row (every index but the last axis) of an evaluated array
// starts, in elements from its data pointer; the last axis' stride apart.
struct Rows {
  std::vector<int64_t> shape, strides;  // the leading axes
  int64_t count = 1, width = 0, step = 1;

  explicit Rows(const mx::array& a) {
    const int nd = (int)a.ndim();
    width = a.shape(nd - 1);
    step = a.strides()[nd - 1];
    for (int i = 0; i < nd - 1; ++i) {
      shape.push_back(a.shape(i));
      strides.push_back(a.strides()[i]);
      count *= a.shape(i);
    }
  }

  // Row r of the array at `base` as `width` contiguous floats: in place, or
  // gathered into `scratch` when the last axis' stride is not 1; its index
  // along axis -2 into `along_second_last` when given.
  const float* row(const float* base, int64_t r, std::vector<float>& scratch,
                   int64_t* along_second_last = nullptr) const {
    const float* v = base + offset(r, along_second_last);
    if (step == 1) return v;
    scratch.resize((size_t)width);
    for (int64_t i = 0; i < width; ++i) scratch[(size_t)i] = v[i * step];
    return scratch.data();
  }

  // Element offset of row r, and its index along axis -2 (0 for 2-D arrays
  // and below).
  int64_t offset(int64_t r, int64_t* along_second_last = nullptr) const {
    int64_t off = 0;
    for (int i = (int)shape.size() - 1; i >= 0; --i) {
      const int64_t idx = r % shape[i];
      r /= shape[i];
      off += idx * strides[i];
      if (along_second_last && i == (int)shape.size() - 1) *along_second_last = idx;
    }
    return off;
  }
};

// Tasks for `rows` rows of `width` floats: about 16 Ki elements each, at
// most one per thread.
int row_tasks(int64_t rows, int64_t width) {
  const int64_t by_size = std::max<int64_t>(1, rows * width / 16384);
  return (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)num_threads(), rows, by_size}));
}

// Runs `job`'s rows as row_tasks chunks over the pool, Run(job, r0, r1) each
// (job.rows: a Rows; job.tasks: set here).
template <typename Job, void (*Run)(const Job&, int64_t, int64_t)>
void in_row_chunks(Job& job) {
  job.tasks = row_tasks(job.rows.count, job.rows.width);
  detail::parallel_for(job.tasks, [](void* ctx, int t) {
    const Job& j = *static_cast<const Job*>(ctx);
    const int64_t per = (j.rows.count + j.tasks - 1) / j.tasks;
    Run(j, t * per, std::min(j.rows.count, (t + 1) * per));
  }, &job);
}

// ---------------------------------------------------------------------------
// RMSNorm

struct NormJob {
  const float* x;
  float* y;
  const float* w;  // null: no weight
  Rows rows;
  float eps;
  int tasks;
};

void norm_rows(const NormJob& j, int64_t r0, int64_t r1) {
  const int64_t D = j.rows.width;
  std::vector<float> gathered;
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = j.rows.row(j.x, r, gathered);
    float* y = j.y + r * D;
    const float r_inv = 1.0f / std::sqrt(detail::dot(x, x, (int)D) / (float)D + j.eps);
    if (j.w) {
      for (int64_t i = 0; i < D; ++i) y[i] = (x[i] * r_inv) * j.w[i];
    } else {
      for (int64_t i = 0; i < D; ++i) y[i] = x[i] * r_inv;
    }
  }
}

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps, bool weighted) : mx::UnaryPrimitive(stream), eps_(eps), weighted_(weighted) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    if (weighted_) enc.set_input_array(inputs[1]);
    enc.set_output_array(out);
    NormJob job{x.data<float>(), out.data<float>(), nullptr, Rows(x), eps_, 1};
    // Inputs are read in the dispatched task, once the tasks before it have
    // written them.
    std::optional<mx::array> w;
    if (weighted_) w = inputs[1];
    enc.dispatch([job, w = std::move(w)]() mutable {
      std::vector<float> weight;
      if (w) {
        const detail::Scalar type = detail::scalar_of(w->dtype(), "the norm weight");
        const int64_t step = w->strides()[0];
        weight.resize((size_t)w->size());
        for (size_t i = 0; i < weight.size(); ++i) {
          weight[i] = detail::load_f32(w->data<uint8_t>(), type, (size_t)((int64_t)i * step));
        }
        job.w = weight.data();
      }
      in_row_chunks<NormJob, norm_rows>(job);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxcel::kernels::RmsNorm] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelRmsNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const RmsNorm*>(&other);
    return o && o->eps_ == eps_ && o->weighted_ == weighted_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  float eps_;
  bool weighted_;
};

// ---------------------------------------------------------------------------
// RoPE

// cos and sin of every (position, frequency) of one call, [L][half]; kept
// for the next calls with the same parameters (the q and k of every layer).
struct RopeTable {
  int64_t L = -1;
  int offset = 0, half = 0;
  float scale = 0, log_base = 0;
  std::vector<float> freqs, cs, sn;

  bool same(int64_t l, int off, int h, float sc, float lb, const float* f) const {
    if (l != L || off != offset || h != half || sc != scale || lb != log_base) return false;
    if ((f != nullptr) != !freqs.empty()) return false;
    for (size_t i = 0; f && i < freqs.size(); ++i) {
      if (freqs[i] != f[i]) return false;
    }
    return true;
  }

  // Angles as the fused decoder block computes them (decoder_layer.cc) and
  // MLX's fast::rope: position (offset + l) * scale, times exp(-i *
  // log(base) / half) or 1 / freqs[i].
  void fill(int64_t l_count, int off, int h, float sc, float lb, const float* f) {
    L = l_count;
    offset = off;
    half = h;
    scale = sc;
    log_base = lb;
    if (f) freqs.assign(f, f + h);
    else freqs.clear();
    cs.resize((size_t)(L * h));
    sn.resize((size_t)(L * h));
    std::vector<float> inv((size_t)h);
    for (int i = 0; i < h; ++i) inv[(size_t)i] = detail::rope_inverse_frequency(i, lb, f);
    for (int64_t l = 0; l < L; ++l) {
      const float position = ((float)l + (float)off) * sc;
      for (int i = 0; i < h; ++i) {
        const float theta = position * inv[(size_t)i];
        cs[(size_t)(l * h + i)] = std::cos(theta);
        sn[(size_t)(l * h + i)] = std::sin(theta);
      }
    }
  }
};

// The tables of the last few distinct angle sets on this thread: models
// that alternate RoPE bases between layers (Gemma 3's local and global
// layers) keep one table per base.
struct RopeTables {
  static constexpr int kKept = 4;
  RopeTable tables[kKept];
  int next = 0;  // the slot the next new table replaces

  const RopeTable& get(int64_t l, int off, int h, float sc, float lb, const float* f) {
    for (const RopeTable& t : tables) {
      if (t.same(l, off, h, sc, lb, f)) return t;
    }
    RopeTable& t = tables[next];
    next = (next + 1) % kKept;
    t.fill(l, off, h, sc, lb, f);
    return t;
  }
};

thread_local RopeTables tl_rope_tables;

struct RopeJob {
  const float* x;
  float* y;
  const float* cs;
  const float* sn;
  Rows rows;
  int dims, tasks;
  bool traditional;
};

void rope_rows(const RopeJob& j, int64_t r0, int64_t r1) {
  const int64_t D = j.rows.width;
  const int half = j.dims / 2;
  std::vector<float> gathered;
  for (int64_t r = r0; r < r1; ++r) {
    int64_t l = 0;
    const float* v = j.rows.row(j.x, r, gathered, &l);
    float* o = j.y + r * D;
    const float* c = j.cs + l * half;
    const float* s = j.sn + l * half;
    if (j.traditional) {
      for (int i = 0; i < half; ++i) {
        const float x1 = v[2 * i], x2 = v[2 * i + 1];
        o[2 * i] = x1 * c[i] - x2 * s[i];
        o[2 * i + 1] = x1 * s[i] + x2 * c[i];
      }
    } else {
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        o[i] = x1 * c[i] - x2 * s[i];
        o[i + half] = x1 * s[i] + x2 * c[i];
      }
    }
    for (int64_t i = j.dims; i < D; ++i) o[i] = v[i];
  }
}

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, int offset, bool explicit_freqs)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale),
        offset_(offset),
        explicit_freqs_(explicit_freqs) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_input_array(x);
    if (explicit_freqs_) enc.set_input_array(inputs[1]);
    enc.set_output_array(out);
    RopeJob job{x.data<float>(), out.data<float>(), nullptr, nullptr, Rows(x), dims_, 1, traditional_};
    std::optional<mx::array> f_in;
    if (explicit_freqs_) f_in = inputs[1];
    const int64_t L = x.shape(-2);
    const int half = dims_ / 2;
    const float log_base = explicit_freqs_ ? 0.0f : std::log(base_) / (float)half;
    // Inputs are read in the dispatched task, once the tasks before it have
    // written them.
    enc.dispatch([job, f_in = std::move(f_in), L, half, log_base, scale = scale_, offset = offset_]() mutable {
      std::vector<float> freqs;
      if (f_in) {
        freqs.resize((size_t)f_in->size());
        for (size_t i = 0; i < freqs.size(); ++i) freqs[i] = f_in->data<float>()[(int64_t)i * f_in->strides()[0]];
      }
      const float* f = freqs.empty() ? nullptr : freqs.data();
      const RopeTable& table = tl_rope_tables.get(L, offset, half, scale, log_base, f);
      job.cs = table.cs.data();
      job.sn = table.sn.data();
      in_row_chunks<RopeJob, rope_rows>(job);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxcel::kernels::Rope] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const Rope*>(&other);
    return o && o->dims_ == dims_ && o->traditional_ == traditional_ && o->base_ == base_ && o->scale_ == scale_ &&
           o->offset_ == offset_ && o->explicit_freqs_ == explicit_freqs_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int offset_;
  bool explicit_freqs_;
};

bool float_dtype(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

}  // namespace

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  const bool ours = stream.device == mx::Device::cpu && x.dtype() == mx::float32 && x.ndim() >= 1 && x.size() > 0 &&
                    (!weight || (weight->ndim() == 1 && float_dtype(weight->dtype()) &&
                                 weight->shape(0) == x.shape(-1)));
  if (!ours) return mx::fast::rms_norm(x, weight, eps, stream);
  std::vector<mx::array> inputs{x};
  if (weight) inputs.push_back(*weight);
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(stream, eps, weight.has_value()),
                   std::move(inputs));
}

mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale, int offset,
               const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  const bool ours = stream.device == mx::Device::cpu && x.dtype() == mx::float32 && x.ndim() >= 3 && x.size() > 0 &&
                    dims > 0 && dims % 2 == 0 && dims <= x.shape(-1) &&
                    (freqs ? freqs->dtype() == mx::float32 && freqs->ndim() == 1 && freqs->shape(0) == dims / 2
                           : base.has_value() && *base > 0.0f);
  if (!ours) return mx::fast::rope(x, dims, traditional, base, scale, offset, freqs, stream);
  std::vector<mx::array> inputs{x};
  if (freqs) inputs.push_back(*freqs);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(stream, dims, traditional, base.value_or(0.0f), scale, offset,
                                          freqs.has_value()),
                   std::move(inputs));
}

}  // namespace mlxcel::kernels
