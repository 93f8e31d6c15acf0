#include <dlfcn.h>
#include "mlx-sys/cpp/shim.h"

#include <optional>
#include <sstream>
#include <stdexcept>

#include "mlx-sys/src/ffi.rs.h"
#include "mlx/primitives.h"
#include "decoder_layer.h"
#include "gelu.h"
#include "norm_rope.h"
#include "quantized_embedding.h"
#include "quantized_matmul.h"
#include "quantized_gemm.h"
#include "causal_attention.h"
#include "kv_pool.h"
#include "weight_arena.h"
#include "detail.h"

namespace mx = mlx::core;

namespace mlxcel {
namespace {

// Dtype codes are the positions in mx::Dtype::Val; mlx-sys's `Dtype` mirrors them.
mx::Dtype to_dtype(uint8_t code) {
  static const mx::Dtype table[] = {
      mx::bool_, mx::uint8, mx::uint16, mx::uint32, mx::uint64,
      mx::int8,  mx::int16, mx::int32,  mx::int64,  mx::float16,
      mx::float32, mx::float64, mx::bfloat16, mx::complex64};
  if (code >= sizeof(table) / sizeof(table[0])) {
    throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  }
  return table[code];
}

uint8_t from_dtype(mx::Dtype dtype) {
  return static_cast<uint8_t>(dtype.val());
}

mx::Shape to_shape(rust::Slice<const int32_t> s) {
  return mx::Shape(s.begin(), s.end());
}

std::vector<int> to_ints(rust::Slice<const int32_t> s) {
  return std::vector<int>(s.begin(), s.end());
}

ArrayPtr wrap(array a) {
  return std::make_unique<array>(std::move(a));
}

std::optional<array> opt(const array* a) {
  return a ? std::optional<array>(*a) : std::nullopt;
}

mx::Device device(bool gpu) {
  return gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu);
}

StreamId to_id(const mx::Stream& s) {
  return StreamId{s.index, s.device.type == mx::Device::gpu};
}

template <typename T>
array typed_from_bytes(rust::Slice<const uint8_t> data, mx::Shape shape, mx::Dtype dtype) {
  return array(reinterpret_cast<const T*>(data.data()), std::move(shape), dtype);
}

}  // namespace

rust::String mlx_version() {
  return rust::String(mx::version());
}

ArrayPtr array_from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t code) {
  auto dtype = to_dtype(code);
  auto s = to_shape(shape);
  size_t count = 1;
  for (auto d : s) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    count *= static_cast<size_t>(d);
  }
  if (count * dtype.size() != data.size()) {
    throw std::invalid_argument(
        "byte length " + std::to_string(data.size()) + " does not match shape with " +
        std::to_string(count) + " elements of " + std::to_string(dtype.size()) + " bytes");
  }
  switch (dtype.val()) {
    case mx::Dtype::Val::bool_: return wrap(typed_from_bytes<bool>(data, s, dtype));
    case mx::Dtype::Val::uint8: return wrap(typed_from_bytes<uint8_t>(data, s, dtype));
    case mx::Dtype::Val::uint16: return wrap(typed_from_bytes<uint16_t>(data, s, dtype));
    case mx::Dtype::Val::uint32: return wrap(typed_from_bytes<uint32_t>(data, s, dtype));
    case mx::Dtype::Val::uint64: return wrap(typed_from_bytes<uint64_t>(data, s, dtype));
    case mx::Dtype::Val::int8: return wrap(typed_from_bytes<int8_t>(data, s, dtype));
    case mx::Dtype::Val::int16: return wrap(typed_from_bytes<int16_t>(data, s, dtype));
    case mx::Dtype::Val::int32: return wrap(typed_from_bytes<int32_t>(data, s, dtype));
    case mx::Dtype::Val::int64: return wrap(typed_from_bytes<int64_t>(data, s, dtype));
    case mx::Dtype::Val::float16: return wrap(typed_from_bytes<mx::float16_t>(data, s, dtype));
    case mx::Dtype::Val::float32: return wrap(typed_from_bytes<float>(data, s, dtype));
    case mx::Dtype::Val::float64: return wrap(typed_from_bytes<double>(data, s, dtype));
    case mx::Dtype::Val::bfloat16: return wrap(typed_from_bytes<mx::bfloat16_t>(data, s, dtype));
    case mx::Dtype::Val::complex64: return wrap(typed_from_bytes<mx::complex64_t>(data, s, dtype));
  }
  throw std::invalid_argument("unsupported dtype");
}

ArrayPtr array_from_f64(double value, uint8_t dtype) { return wrap(array(value, to_dtype(dtype))); }
ArrayPtr array_clone(const array& a) { return wrap(a); }
ArrayPtr zeros(rust::Slice<const int32_t> shape, uint8_t dtype) { return wrap(mx::zeros(to_shape(shape), to_dtype(dtype))); }
ArrayPtr ones(rust::Slice<const int32_t> shape, uint8_t dtype) { return wrap(mx::ones(to_shape(shape), to_dtype(dtype))); }
ArrayPtr full(rust::Slice<const int32_t> shape, double value, uint8_t dtype) {
  return wrap(mx::full(to_shape(shape), array(value, to_dtype(dtype)), to_dtype(dtype)));
}
ArrayPtr arange(double start, double stop, double step, uint8_t dtype) {
  return wrap(mx::arange(start, stop, step, to_dtype(dtype)));
}
uint8_t array_dtype(const array& a) { return from_dtype(a.dtype()); }
rust::Vec<int32_t> array_shape(const array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.shape()) out.push_back(d);
  return out;
}
rust::Vec<int64_t> array_strides(const array& a) {
  rust::Vec<int64_t> out;
  for (auto s : a.strides()) out.push_back(static_cast<int64_t>(s));
  return out;
}
size_t array_size(const array& a) { return a.size(); }
size_t array_nbytes(const array& a) { return a.nbytes(); }
bool array_is_available(const array& a) { return a.is_available(); }

// Reads `a` back in row-major order. A row-contiguous array is read in place
// as soon as its own computation is done: wrapping it in a new node would
// queue the read behind everything submitted since (a decode step queued
// ahead of reading the previous token, for one).
rust::Vec<uint8_t> array_to_bytes(const array& a) {
  array c = a;
  c.eval();
  if (!c.flags().row_contiguous) {
    c = mx::contiguous(c);
    c.eval();
  }
  rust::Vec<uint8_t> out;
  size_t n = c.nbytes();
  out.reserve(n);
  const uint8_t* p = c.data<uint8_t>();
  for (size_t i = 0; i < n; ++i) out.push_back(p[i]);
  return out;
}

rust::String array_to_string(const array& a) {
  std::ostringstream os;
  array c = a;
  c.eval();
  os << c;
  return rust::String(os.str());
}

#define MLXCEL_BINARY(name, op) \
  ArrayPtr name(const array& a, const array& b) { return wrap(mx::op(a, b)); }
MLXCEL_BINARY(add, add)
MLXCEL_BINARY(subtract, subtract)
MLXCEL_BINARY(multiply, multiply)
MLXCEL_BINARY(divide, divide)
MLXCEL_BINARY(maximum, maximum)
MLXCEL_BINARY(minimum, minimum)
MLXCEL_BINARY(power, power)
MLXCEL_BINARY(equal, equal)
MLXCEL_BINARY(not_equal, not_equal)
MLXCEL_BINARY(less, less)
MLXCEL_BINARY(less_equal, less_equal)
MLXCEL_BINARY(greater, greater)
MLXCEL_BINARY(greater_equal, greater_equal)
MLXCEL_BINARY(logical_and, logical_and)
MLXCEL_BINARY(logical_or, logical_or)
MLXCEL_BINARY(matmul, matmul)
#undef MLXCEL_BINARY

#define MLXCEL_UNARY(name, op) \
  ArrayPtr name(const array& a) { return wrap(mx::op(a)); }
MLXCEL_UNARY(exp, exp)
MLXCEL_UNARY(log, log)
MLXCEL_UNARY(sqrt, sqrt)
MLXCEL_UNARY(rsqrt, rsqrt)
MLXCEL_UNARY(sigmoid, sigmoid)
MLXCEL_UNARY(tanh, tanh)
MLXCEL_UNARY(erf, erf)
MLXCEL_UNARY(negative, negative)
MLXCEL_UNARY(abs, abs)
MLXCEL_UNARY(square, square)
MLXCEL_UNARY(logical_not, logical_not)
MLXCEL_UNARY(contiguous, contiguous)
#undef MLXCEL_UNARY

ArrayPtr where_(const array& c, const array& x, const array& y) { return wrap(mx::where(c, x, y)); }
ArrayPtr astype(const array& a, uint8_t dtype) { return wrap(mx::astype(a, to_dtype(dtype))); }
ArrayPtr reshape(const array& a, rust::Slice<const int32_t> shape) { return wrap(mx::reshape(a, to_shape(shape))); }
ArrayPtr transpose(const array& a, rust::Slice<const int32_t> axes) { return wrap(mx::transpose(a, to_ints(axes))); }
ArrayPtr swapaxes(const array& a, int32_t a1, int32_t a2) { return wrap(mx::swapaxes(a, a1, a2)); }
ArrayPtr expand_dims(const array& a, int32_t axis) { return wrap(mx::expand_dims(a, axis)); }
ArrayPtr squeeze(const array& a, int32_t axis) { return wrap(mx::squeeze(a, axis)); }
ArrayPtr broadcast_to(const array& a, rust::Slice<const int32_t> shape) { return wrap(mx::broadcast_to(a, to_shape(shape))); }
ArrayPtr flatten(const array& a, int32_t start, int32_t end) { return wrap(mx::flatten(a, start, end)); }
ArrayPtr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return wrap(mx::slice(a, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrayPtr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return wrap(mx::slice_update(src, update, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrayPtr concatenate(const ArrayList& arrays, int32_t axis) { return wrap(mx::concatenate(arrays.items, axis)); }
ArrayPtr stack(const ArrayList& arrays, int32_t axis) { return wrap(mx::stack(arrays.items, axis)); }
ArrayPtr tril(const array& a, int32_t k) { return wrap(mx::tril(a, k)); }
ArrayPtr triu(const array& a, int32_t k) { return wrap(mx::triu(a, k)); }

ArrayPtr take(const array& a, const array& indices, int32_t axis) { return wrap(mx::take(a, indices, axis)); }
ArrayPtr take_along_axis(const array& a, const array& indices, int32_t axis) { return wrap(mx::take_along_axis(a, indices, axis)); }
ArrayPtr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis) {
  return wrap(mx::put_along_axis(a, indices, values, axis));
}
ArrayPtr gather(const array& a, const ArrayList& indices, rust::Slice<const int32_t> axes, rust::Slice<const int32_t> slice_sizes) {
  return wrap(mx::gather(a, indices.items, to_ints(axes), to_shape(slice_sizes)));
}

ArrayPtr sum(const array& a, rust::Slice<const int32_t> axes, bool keepdims) { return wrap(mx::sum(a, to_ints(axes), keepdims)); }
ArrayPtr mean(const array& a, rust::Slice<const int32_t> axes, bool keepdims) { return wrap(mx::mean(a, to_ints(axes), keepdims)); }
ArrayPtr max(const array& a, rust::Slice<const int32_t> axes, bool keepdims) { return wrap(mx::max(a, to_ints(axes), keepdims)); }
ArrayPtr min(const array& a, rust::Slice<const int32_t> axes, bool keepdims) { return wrap(mx::min(a, to_ints(axes), keepdims)); }
ArrayPtr logsumexp(const array& a, rust::Slice<const int32_t> axes, bool keepdims) { return wrap(mx::logsumexp(a, to_ints(axes), keepdims)); }
ArrayPtr argmax(const array& a, int32_t axis, bool keepdims) { return wrap(mx::argmax(a, axis, keepdims)); }
ArrayPtr argmin(const array& a, int32_t axis, bool keepdims) { return wrap(mx::argmin(a, axis, keepdims)); }
ArrayPtr softmax(const array& a, rust::Slice<const int32_t> axes, bool precise) { return wrap(mx::softmax(a, to_ints(axes), precise)); }
ArrayPtr sort(const array& a, int32_t axis) { return wrap(mx::sort(a, axis)); }
ArrayPtr argsort(const array& a, int32_t axis) { return wrap(mx::argsort(a, axis)); }
ArrayPtr argpartition(const array& a, int32_t kth, int32_t axis) { return wrap(mx::argpartition(a, kth, axis)); }
ArrayPtr topk(const array& a, int32_t k, int32_t axis) { return wrap(mx::topk(a, k, axis)); }
ArrayPtr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive) { return wrap(mx::cumsum(a, axis, reverse, inclusive)); }

std::unique_ptr<ArrayList> quantize(const array& w, int32_t group_size, int32_t bits) {
  auto list = std::make_unique<ArrayList>();
  list->items = mx::quantize(w, group_size, bits, "affine");
  return list;
}
ArrayPtr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits) {
  return wrap(mx::dequantize(w, scales, biases, group_size, bits, "affine"));
}
ArrayPtr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases, bool transpose, int32_t group_size, int32_t bits) {
  return wrap(mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits, "affine"));
}

ArrayPtr rms_norm(const array& x, const array* weight, float eps) { return wrap(mx::fast::rms_norm(x, opt(weight), eps)); }
ArrayPtr layer_norm(const array& x, const array* weight, const array* bias, float eps) {
  return wrap(mx::fast::layer_norm(x, opt(weight), opt(bias), eps));
}
ArrayPtr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset, const array* freqs) {
  std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
  return wrap(mx::fast::rope(x, dims, traditional, b, scale, offset, opt(freqs)));
}
ArrayPtr rope_dynamic(const array& x, int32_t dims, bool traditional, float base, float scale, const array& offset, const array* freqs) {
  std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
  return wrap(mx::fast::rope(x, dims, traditional, b, scale, offset, opt(freqs)));
}
ArrayPtr scaled_dot_product_attention(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode, const array* mask) {
  std::optional<array> m = opt(mask);
  return wrap(mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode), m));
}

ArrayPtr random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }
ArrayPtr random_split(const array& key, int32_t num) { return wrap(mx::random::split(key, num)); }
ArrayPtr random_uniform(const array& low, const array& high, rust::Slice<const int32_t> shape, uint8_t dtype, const array& key) {
  return wrap(mx::random::uniform(low, high, to_shape(shape), to_dtype(dtype), key));
}
ArrayPtr random_normal(rust::Slice<const int32_t> shape, uint8_t dtype, float loc, float scale, const array& key) {
  return wrap(mx::random::normal(to_shape(shape), to_dtype(dtype), loc, scale, key));
}
ArrayPtr random_categorical(const array& logits, int32_t axis, const array& key) {
  return wrap(mx::random::categorical(logits, axis, key));
}
ArrayPtr random_gumbel(rust::Slice<const int32_t> shape, uint8_t dtype, const array& key) {
  return wrap(mx::random::gumbel(to_shape(shape), to_dtype(dtype), key));
}

void eval(const ArrayList& arrays) { mx::eval(arrays.items); }
void async_eval(const ArrayList& arrays) { mx::async_eval(arrays.items); }
void eval_one(const array& a) { mx::eval({a}); }
bool is_gpu_available() { return mx::is_available(mx::Device(mx::Device::gpu)); }
bool default_device_is_gpu() { return mx::default_device().type == mx::Device::gpu; }
void set_default_device(bool gpu) { mx::set_default_device(device(gpu)); }
StreamId default_stream(bool gpu) { return to_id(mx::default_stream(device(gpu))); }
StreamId new_stream(bool gpu) { return to_id(mx::new_stream(device(gpu))); }
void set_default_stream(StreamId id) { mx::set_default_stream(mx::Stream(id.index, device(id.gpu))); }
void synchronize(StreamId id) { mx::synchronize(mx::Stream(id.index, device(id.gpu))); }

size_t get_active_memory() { return mx::get_active_memory(); }
size_t get_peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t get_cache_memory() { return mx::get_cache_memory(); }
size_t set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }
size_t set_memory_limit(size_t limit) { return mx::set_memory_limit(limit); }
void clear_cache() { mx::clear_cache(); }

std::unique_ptr<ArrayList> array_list_new() { return std::make_unique<ArrayList>(); }
void array_list_push(ArrayList& list, const array& a) { list.items.push_back(a); }
size_t array_list_len(const ArrayList& list) { return list.items.size(); }
ArrayPtr array_list_get(const ArrayList& list, size_t index) { return wrap(list.items.at(index)); }

std::unique_ptr<TensorFile> load_safetensors(rust::Str path) {
  auto [arrays, meta] = mx::load_safetensors(std::string(path));
  auto file = std::make_unique<TensorFile>();
  for (auto& [name, a] : arrays) {
    file->names.push_back(name);
    file->arrays.push_back(a);
  }
  for (auto& [k, v] : meta) {
    file->meta_keys.push_back(k);
    file->meta_values.push_back(v);
  }
  return file;
}

void save_safetensors(rust::Str path, const TensorFile& file) {
  std::unordered_map<std::string, array> arrays;
  for (size_t i = 0; i < file.names.size(); ++i) arrays.insert({file.names[i], file.arrays[i]});
  std::unordered_map<std::string, std::string> meta;
  for (size_t i = 0; i < file.meta_keys.size(); ++i) meta[file.meta_keys[i]] = file.meta_values[i];
  mx::save_safetensors(std::string(path), std::move(arrays), std::move(meta));
}

std::unique_ptr<TensorFile> load_gguf(rust::Str path) {
  auto [arrays, meta] = mx::load_gguf(std::string(path));
  auto file = std::make_unique<TensorFile>();
  for (auto& [name, a] : arrays) {
    file->names.push_back(name);
    file->arrays.push_back(a);
  }
  for (auto& [k, v] : meta) {
    std::string text;
    if (auto* s = std::get_if<std::string>(&v)) {
      text = *s;
    } else if (auto* list = std::get_if<std::vector<std::string>>(&v)) {
      for (size_t i = 0; i < list->size(); ++i) text += (i ? "\n" : "") + (*list)[i];
    } else if (auto* a = std::get_if<array>(&v)) {
      std::ostringstream os;
      array c = *a;
      c.eval();
      os << c;
      text = os.str();
    }
    file->meta_keys.push_back(k);
    file->meta_values.push_back(std::move(text));
  }
  return file;
}

std::unique_ptr<TensorFile> tensor_file_new() { return std::make_unique<TensorFile>(); }
void tensor_file_insert(TensorFile& f, rust::Str name, const array& a) {
  f.names.emplace_back(name);
  f.arrays.push_back(a);
}
void tensor_file_insert_meta(TensorFile& f, rust::Str key, rust::Str value) {
  f.meta_keys.emplace_back(key);
  f.meta_values.emplace_back(value);
}
size_t tensor_file_len(const TensorFile& f) { return f.names.size(); }
rust::String tensor_file_name(const TensorFile& f, size_t i) { return rust::String(f.names.at(i)); }
ArrayPtr tensor_file_array(const TensorFile& f, size_t i) { return wrap(f.arrays.at(i)); }
size_t tensor_file_meta_len(const TensorFile& f) { return f.meta_keys.size(); }
rust::String tensor_file_meta_key(const TensorFile& f, size_t i) { return rust::String(f.meta_keys.at(i)); }
rust::String tensor_file_meta_value(const TensorFile& f, size_t i) { return rust::String(f.meta_values.at(i)); }

}  // namespace mlxcel

#ifdef MLXCEL_OPENBLAS
extern "C" int openblas_get_num_threads(void);
extern "C" void openblas_set_num_threads(int);

// A load-time reference to OpenBLAS that --gc-sections cannot drop, so that
// --as-needed keeps libopenblas in DT_NEEDED, ahead of libmlx: MLX's cblas
// calls then resolve to OpenBLAS instead of the wheel's reference BLAS.
__attribute__((constructor, used)) static void mlxcel_keep_openblas() {
  (void)openblas_get_num_threads();
}
#endif

namespace mlxcel {
int32_t blas_threads() {
#ifdef MLXCEL_OPENBLAS
  return openblas_get_num_threads();
#else
  return 0;
#endif
}
void set_blas_threads(int32_t threads) {
#ifdef MLXCEL_OPENBLAS
  openblas_set_num_threads(threads);
#else
  (void)threads;
#endif
}
rust::String blas_library() {
  // The definition MLX's own cblas_sgemm calls bind to: the first in the
  // process's lookup order (an LD_PRELOAD, a library linked ahead of libmlx,
  // else the wheel's bundled reference BLAS).
  void* sym = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  Dl_info info{};
  if (sym == nullptr || dladdr(sym, &info) == 0 || info.dli_fname == nullptr) return rust::String();
  return rust::String(info.dli_fname);
}
}  // namespace mlxcel

namespace mlxcel {
namespace {
kernels::Path to_path(int32_t path) {
  switch (path) {
    case -1: return kernels::Path::Auto;
    case 0: return kernels::Path::Portable;
    case 1: return kernels::Path::Avx2;
    case 2: return kernels::Path::Avx512;
    case 3: return kernels::Path::Avx512Vnni;
    case 4: return kernels::Path::Avx2Int8;
    case 5: return kernels::Path::NeonInt8;
  }
  throw std::invalid_argument("unknown kernel path " + std::to_string(path));
}
}  // namespace

ArrayPtr kernels_quantized_matmul(const array& x, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, int32_t path) {
  return wrap(kernels::quantized_matmul(x, w, scales, biases, group_size, bits, to_path(path)));
}
ArrayPtr kernels_quantized_matmul_vnni_rows(const array& x, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, int32_t path, const array& vnni_rows) {
  return wrap(kernels::quantized_matmul(x, w, scales, biases, group_size, bits, to_path(path), {}, vnni_rows));
}
ArrayPtr kernels_vnni_rows(const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits) {
  std::optional<array> rows = kernels::vnni_rows(w, scales, biases, group_size, bits);
  return rows ? wrap(std::move(*rows)) : nullptr;
}
rust::String kernels_path_name(int32_t path) {
  return rust::String(kernels::path_name(kernels::resolve_path(to_path(path))));
}
rust::String kernels_copy_loop_name(int32_t path, int32_t bits) {
  return rust::String(kernels::copy_loop_name(to_path(path), bits));
}
int32_t kernels_num_threads() { return kernels::num_threads(); }
bool kernels_supports(int32_t group_size, int32_t bits) { return kernels::supports(group_size, bits); }
ArrayPtr kernels_quantized_gemm(const array& x, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, int32_t path) {
  return wrap(kernels::quantized_gemm(x, w, scales, biases, group_size, bits, to_path(path)));
}
bool kernels_gemm_supports(int32_t group_size, int32_t bits) { return kernels::gemm_supports(group_size, bits); }
bool kernels_gemm_uses_amx(int32_t path) { return kernels::gemm_uses_amx(to_path(path)); }
rust::String kernels_gemm_loop_name(int32_t path, int32_t bits) {
  return rust::String(kernels::gemm_loop_name(to_path(path), bits));
}
ArrayPtr kernels_gelu_erf(const array& x, int32_t path) {
  return wrap(kernels::gelu_erf(x, to_path(path)));
}
ArrayPtr kernels_rms_norm(const array& x, const array* weight, float eps) {
  return wrap(kernels::rms_norm(x, opt(weight), eps));
}
ArrayPtr kernels_rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset,
                      const array* freqs) {
  std::optional<float> b = freqs ? std::nullopt : std::optional<float>(base);
  return wrap(kernels::rope(x, dims, traditional, b, scale, offset, opt(freqs)));
}
ArrayPtr kernels_dense_matmul(const array& x, const array& w, int32_t path) {
  return wrap(kernels::dense_matmul(x, w, to_path(path)));
}
ArrayPtr kernels_quantized_gemm_swiglu(const array& x, const array& gate_w, const array& gate_scales, const array& gate_biases, const array& up_w, const array& up_scales, const array& up_biases, int32_t group_size, int32_t bits) {
  return wrap(kernels::quantized_gemm_swiglu(x, gate_w, gate_scales, gate_biases, up_w, up_scales, up_biases, group_size, bits));
}
ArrayPtr kernels_causal_attention(const array& q, const array& k, const array& v, float scale) {
  return wrap(kernels::causal_attention(q, k, v, scale));
}
bool kernels_causal_attention_supports(const array& q, const array& k, const array& v) {
  return kernels::causal_attention_supports(q, k, v);
}
ArrayPtr kernels_attention(const array& q, const array& k, const array& v, float scale, bool causal) {
  return wrap(kernels::attention(q, k, v, scale, causal));
}
bool kernels_attention_supports(const array& q, const array& k, const array& v, bool causal) {
  return kernels::attention_supports(q, k, v, causal);
}

namespace {
kernels::DecoderLayerSpec to_kernel_spec(const DecoderLayerSpec& s) {
  kernels::DecoderLayerSpec k;
  k.hidden = s.hidden;
  k.heads = s.heads;
  k.kv_heads = s.kv_heads;
  k.head_dim = s.head_dim;
  k.intermediate = s.intermediate;
  k.offset = s.offset;
  k.norm_eps = s.norm_eps;
  k.rope_dims = s.rope_dims;
  k.rope_base = s.rope_base;
  k.rope_scale = s.rope_scale;
  k.rope_traditional = s.rope_traditional;
  k.rope_mscale = s.rope_mscale;
  k.attn_scale = s.attn_scale;
  k.kv_window = s.kv_window;
  k.kv_keep = s.kv_keep;
  k.kv_layer = s.kv_layer;
  k.activation = s.activation;
  k.experts = s.experts;
  k.top_k = s.top_k;
  k.routing = s.routing;
  k.cache_in_place = s.cache_in_place;
  return k;
}

std::optional<array> optional_array(const array* a) {
  return a ? std::optional<array>(*a) : std::nullopt;
}

kernels::QuantizedProjection to_kernel_projection(const DecoderProjection& p) {
  return {.weight = p.weight, .scales = p.scales, .biases = p.biases, .bias = optional_array(p.bias)};
}

kernels::DecoderLayerInputs to_kernel_inputs(const DecoderLayerArrays& a) {
  return kernels::DecoderLayerInputs{
      .x = a.x,
      .input_norm = a.input_norm,
      .q_proj = to_kernel_projection(a.q_proj),
      .k_proj = to_kernel_projection(a.k_proj),
      .v_proj = to_kernel_projection(a.v_proj),
      .o_proj = to_kernel_projection(a.o_proj),
      .post_attention_norm = a.post_attention_norm,
      .gate_proj = to_kernel_projection(a.gate_proj),
      .up_proj = to_kernel_projection(a.up_proj),
      .down_proj = to_kernel_projection(a.down_proj),
      .keys = a.keys,
      .values = a.values,
      .q_norm = optional_array(a.q_norm),
      .k_norm = optional_array(a.k_norm),
      .rope_freqs = optional_array(a.rope_freqs),
      .attn_out_norm = optional_array(a.attn_out_norm),
      .mlp_out_norm = optional_array(a.mlp_out_norm),
      .router = a.router_weight ? std::optional<kernels::QuantizedProjection>(kernels::QuantizedProjection{
                                      .weight = *a.router_weight, .scales = *a.router_scales, .biases = *a.router_biases, .bias = std::nullopt})
                                : std::nullopt,
  };
}
}  // namespace

std::unique_ptr<ArrayList> kernels_decoder_layer(const DecoderLayerArrays& a, const DecoderLayerSpec& spec) {
  auto list = std::make_unique<ArrayList>();
  list->items = kernels::decoder_layer(to_kernel_inputs(a), to_kernel_spec(spec));
  return list;
}

std::unique_ptr<PreparedLayer> kernels_prepare_decoder_layer(const DecoderLayerArrays& a, const DecoderLayerSpec& spec) {
  auto prepared = std::make_unique<PreparedLayer>();
  prepared->weights = kernels::prepare_decoder_layer(to_kernel_inputs(a), to_kernel_spec(spec));
  return prepared;
}

std::unique_ptr<ArrayList> kernels_decoder_layer_prepared(const PreparedLayer& weights, const array& x, const array& keys, const array& values, const DecoderLayerSpec& spec) {
  auto list = std::make_unique<ArrayList>();
  list->items = kernels::decoder_layer(weights.weights, x, keys, values, to_kernel_spec(spec));
  return list;
}
std::unique_ptr<ArrayList> kernels_decoder_layer_batch(const PreparedLayer& weights, const array& x, const ArrayList& keys, const ArrayList& values, rust::Slice<const int32_t> offsets, const DecoderLayerSpec& spec) {
  auto list = std::make_unique<ArrayList>();
  list->items = kernels::decoder_layer_batch(weights.weights, x, keys.items, values.items,
                                             std::vector<int>(offsets.begin(), offsets.end()), to_kernel_spec(spec));
  return list;
}
namespace {
// tables[b] is table_lens[b] ids of the flat list.
std::vector<std::vector<int32_t>> split_tables(rust::Slice<const int32_t> tables, rust::Slice<const int32_t> table_lens, const char* caller) {
  std::vector<std::vector<int32_t>> split;
  size_t at = 0;
  for (int32_t n : table_lens) {
    if (n < 0 || at + (size_t)n > tables.size()) throw std::invalid_argument(std::string("[") + caller + "] table lengths exceed the ids given");
    split.emplace_back(tables.begin() + at, tables.begin() + at + n);
    at += n;
  }
  return split;
}
}  // namespace

std::unique_ptr<ArrayList> kernels_decoder_layer_paged(const PreparedLayer& weights, const array& x, const array& pool_keys, const array& pool_values, rust::Slice<const int32_t> tables, rust::Slice<const int32_t> table_lens, rust::Slice<const int32_t> offsets, const DecoderLayerSpec& spec) {
  auto list = std::make_unique<ArrayList>();
  list->items = kernels::decoder_layer_paged(weights.weights, x, pool_keys, pool_values, split_tables(tables, table_lens, "kernels_decoder_layer_paged"),
                                             std::vector<int>(offsets.begin(), offsets.end()), to_kernel_spec(spec));
  return list;
}
std::unique_ptr<PreparedStack> kernels_prepared_stack_new() { return std::make_unique<PreparedStack>(); }
void kernels_prepared_stack_push(PreparedStack& stack, const PreparedLayer& layer) { stack.layers.push_back(layer.weights); }
uint64_t kernels_decoder_stack_nodes() { return kernels::decoder_stack_nodes(); }
std::unique_ptr<ArrayList> kernels_decoder_stack_paged(const PreparedStack& stack, const array& x, const ArrayList& pool_keys, const ArrayList& pool_values, rust::Slice<const int32_t> tables, rust::Slice<const int32_t> table_lens, rust::Slice<const int32_t> offsets, rust::Slice<const DecoderLayerSpec> specs) {
  std::vector<kernels::DecoderLayerSpec> kernel_specs;
  kernel_specs.reserve(specs.size());
  for (const DecoderLayerSpec& spec : specs) kernel_specs.push_back(to_kernel_spec(spec));
  auto list = std::make_unique<ArrayList>();
  list->items = kernels::decoder_stack_paged(stack.layers, x, pool_keys.items, pool_values.items, split_tables(tables, table_lens, "kernels_decoder_stack_paged"),
                                             std::vector<int>(offsets.begin(), offsets.end()), kernel_specs);
  return list;
}
std::unique_ptr<ArrayList> kernels_paged_causal_attention(const array& q, const array& k, const array& v, const array& pool_keys, const array& pool_values, rust::Slice<const int32_t> table, int32_t offset, float scale, int32_t window, int32_t keep, int32_t layer) {
  auto list = std::make_unique<ArrayList>();
  list->items = kernels::paged_causal_attention(q, k, v, pool_keys, pool_values, std::vector<int32_t>(table.begin(), table.end()), offset, scale, window, keep, layer);
  return list;
}
ArrayPtr kernels_kv_pool_buffer(int32_t blocks, int32_t kv_heads, int32_t block, int32_t head_dim) {
  return wrap(kernels::kv_pool_buffer(blocks, kv_heads, block, head_dim));
}
ArrayPtr kernels_kv_pool_buffer_q8(int32_t blocks, int32_t layers, int32_t kv_heads, int32_t block, int32_t head_dim) {
  return wrap(kernels::kv_pool_buffer_q8(blocks, layers, kv_heads, block, head_dim));
}
void kernels_kv_pool_release(const array& pool, rust::Slice<const int32_t> ids) {
  kernels::kv_pool_release(pool, std::vector<int32_t>(ids.begin(), ids.end()));
}
size_t kernels_resident_bytes(const array& a) { return kernels::resident_bytes(a); }
size_t kernels_vnni_rows_bytes() { return kernels::detail::vnni_rows_bytes(); }
ArrayPtr kernels_weight_array(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t dtype) {
  return wrap(kernels::weight_array(data.data(), data.size(), to_shape(shape), to_dtype(dtype)));
}
size_t kernels_weight_arena_bytes() { return kernels::weight_arena_bytes(); }
bool kernels_weight_arena_huge_pages() { return kernels::weight_arena_huge_pages(); }
rust::Vec<size_t> kernels_weight_arena_pages() {
  const kernels::ArenaPages pages = kernels::weight_arena_pages();
  rust::Vec<size_t> out;
  out.push_back(pages.eligible);
  out.push_back(pages.huge);
  out.push_back(pages.resident);
  return out;
}
ArrayPtr kernels_quantized_embedding(const array& ids, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, uint8_t dtype) {
  return wrap(kernels::quantized_embedding(ids, w, scales, biases, group_size, bits, to_dtype(dtype)));
}
rust::String array_primitive_name(const array& a) {
  return rust::String(a.has_primitive() ? a.primitive().name() : "");
}
size_t array_input_count(const array& a) { return a.inputs().size(); }
}  // namespace mlxcel
