// See quantized_embedding.h.

#include "quantized_embedding.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "detail.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxcel::kernels {
namespace {

using detail::Scalar;

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("[mlxcel::kernels::quantized_embedding] " + message);
}

// Reads id i of an integer array in its own dtype (row-contiguous).
int64_t load_id(const void* p, mx::Dtype dtype, size_t i) {
  switch (dtype) {
    case mx::uint8: return static_cast<const uint8_t*>(p)[i];
    case mx::uint16: return static_cast<const uint16_t*>(p)[i];
    case mx::uint32: return static_cast<const uint32_t*>(p)[i];
    case mx::uint64: return (int64_t) static_cast<const uint64_t*>(p)[i];
    case mx::int8: return static_cast<const int8_t*>(p)[i];
    case mx::int16: return static_cast<const int16_t*>(p)[i];
    case mx::int32: return static_cast<const int32_t*>(p)[i];
    default: return static_cast<const int64_t*>(p)[i];
  }
}

void store(void* out, Scalar type, size_t i, float v) {
  switch (type) {
    case Scalar::F32: static_cast<float*>(out)[i] = v; return;
    case Scalar::F16: static_cast<mx::float16_t*>(out)[i] = mx::float16_t(v); return;
    default: static_cast<mx::bfloat16_t*>(out)[i] = mx::bfloat16_t(v); return;
  }
}

struct Gather {
  const void* ids = nullptr;
  mx::Dtype id_type = mx::int32;
  size_t count = 0;
  const uint8_t* w = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
  Scalar scale_type = Scalar::F32;
  int64_t vocab = 0;
  int k = 0, group = 0, bits = 0;
  size_t row_bytes = 0;
  void* out = nullptr;
  Scalar out_type = Scalar::F32;
};

void run(const Gather& g) {
  const int groups = g.k / g.group;
  const uint32_t mask = (1u << g.bits) - 1;
  for (size_t i = 0; i < g.count; ++i) {
    const int64_t id = load_id(g.ids, g.id_type, i);
    const size_t base = i * (size_t)g.k;
    if (id < 0 || id >= g.vocab) {
      for (int j = 0; j < g.k; ++j) store(g.out, g.out_type, base + j, 0.0f);
      continue;
    }
    const uint8_t* row = g.w + (size_t)id * g.row_bytes;
    for (int grp = 0; grp < groups; ++grp) {
      const float s = detail::load_f32(g.scales, g.scale_type, (size_t)id * groups + grp);
      const float b = detail::load_f32(g.biases, g.scale_type, (size_t)id * groups + grp);
      for (int j = grp * g.group; j < (grp + 1) * g.group; ++j) {
        // Element j sits at bit j * bits of the row's little-endian stream.
        const size_t bit = (size_t)j * g.bits;
        uint32_t word = 0;
        std::memcpy(&word, row + bit / 8, std::min<size_t>(4, g.row_bytes - bit / 8));
        const uint32_t q = (word >> (bit % 8)) & mask;
        // MLX's dequantize: scale * q + bias.
        store(g.out, g.out_type, base + j, s * (float)q + b);
      }
    }
  }
}

class QuantizedEmbedding : public mx::UnaryPrimitive {
 public:
  QuantizedEmbedding(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &ids = inputs[0], &w = inputs[1], &scales = inputs[2], &biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    Gather g;
    g.ids = ids.data<void>();
    g.id_type = ids.dtype();
    g.count = ids.size();
    g.w = w.data<uint8_t>();
    g.scales = scales.data<void>();
    g.biases = biases.data<void>();
    g.scale_type = detail::scalar_of(scales.dtype(), "scales");
    g.vocab = w.shape(0);
    g.k = out.shape(-1);
    g.group = group_size_;
    g.bits = bits_;
    g.row_bytes = (size_t)w.shape(1) * 4;
    g.out = out.data<void>();
    g.out_type = detail::scalar_of(out.dtype(), "the output");
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([g]() { run(g); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[mlxcel::kernels::QuantizedEmbedding] has no GPU evaluation");
  }

  const char* name() const override { return "MlxcelQuantizedEmbedding"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedEmbedding*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape s = inputs[0].shape();
    s.push_back(inputs[2].shape(1) * group_size_);
    return {s};
  }

 private:
  int group_size_, bits_;
};

}  // namespace

mx::array quantized_embedding(const mx::array& ids, const mx::array& w, const mx::array& scales,
                              const mx::array& biases, int group_size, int bits, mx::Dtype dtype,
                              mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (!mx::issubdtype(ids.dtype(), mx::integer)) fail("ids must be integers");
  if (!detail::is_float(dtype)) fail("the output dtype must be float32, float16 or bfloat16");
  if (stream.device != mx::Device::cpu) {
    auto rows = [&](const mx::array& a) { return mx::take(a, ids, 0, stream); };
    return mx::dequantize(rows(w), rows(scales), rows(biases), group_size, bits, "affine", std::nullopt, dtype, stream);
  }
  if (!supports(group_size, bits)) {
    fail(std::to_string(bits) + "-bit weights in groups of " + std::to_string(group_size) + " are not supported");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || scales.ndim() != 2 || scales.shape(0) != w.shape(0) ||
      biases.shape() != scales.shape() || !detail::is_float(scales.dtype()) || biases.dtype() != scales.dtype()) {
    fail("expected uint32 weights [V, K*bits/32] with float scales and biases [V, K/group] of one dtype");
  }
  const int64_t k = (int64_t)scales.shape(1) * group_size;
  if ((int64_t)w.shape(1) * 32 != k * bits) {
    fail("weights of " + std::to_string(w.shape(1)) + " words per row do not hold " + std::to_string(k) + " " +
         std::to_string(bits) + "-bit values");
  }
  auto rc = [&](const mx::array& a) { return detail::row_contiguous(a, stream); };
  mx::Shape shape = ids.shape();
  shape.push_back((int)k);
  return mx::array(shape, dtype, std::make_shared<QuantizedEmbedding>(stream, group_size, bits),
                   {rc(ids), rc(w), rc(scales), rc(biases)});
}

}  // namespace mlxcel::kernels
