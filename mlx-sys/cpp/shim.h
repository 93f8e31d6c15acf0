// C++ side of the mlx-sys bridge: thin, exception-transparent wrappers over
// MLX's C++ API. Every function that can throw is declared `-> Result` on the
// Rust side, so cxx turns MLX's exceptions into `Err` values.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace mlxcel::kernels {
struct PreparedDecoderLayer;
}

namespace mlxcel {

using mlx::core::array;
using ArrayPtr = std::unique_ptr<array>;

struct StreamId;
struct DecoderLayerSpec;
struct DecoderLayerArrays;

// A fused decoder block's prepared weights (kernels/decoder_layer.h).
struct PreparedLayer {
  std::shared_ptr<const kernels::PreparedDecoderLayer> weights;
};

// Prepared blocks in model order, for kernels::decoder_stack_paged.
struct PreparedStack {
  std::vector<std::shared_ptr<const kernels::PreparedDecoderLayer>> layers;
};

// An owned list of arrays, for the calls that take or return several.
struct ArrayList {
  std::vector<array> items;
};

// A name -> array map plus string metadata, as safetensors and GGUF files hold.
struct TensorFile {
  std::vector<std::string> names;
  std::vector<array> arrays;
  std::vector<std::string> meta_keys;
  std::vector<std::string> meta_values;
};

rust::String mlx_version();

// Creation and inspection.
ArrayPtr array_from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t dtype);
ArrayPtr array_from_f64(double value, uint8_t dtype);
ArrayPtr array_clone(const array& a);
ArrayPtr zeros(rust::Slice<const int32_t> shape, uint8_t dtype);
ArrayPtr ones(rust::Slice<const int32_t> shape, uint8_t dtype);
ArrayPtr full(rust::Slice<const int32_t> shape, double value, uint8_t dtype);
ArrayPtr arange(double start, double stop, double step, uint8_t dtype);
uint8_t array_dtype(const array& a);
rust::Vec<int32_t> array_shape(const array& a);
rust::Vec<int64_t> array_strides(const array& a);
size_t array_size(const array& a);
size_t array_nbytes(const array& a);
bool array_is_available(const array& a);
rust::Vec<uint8_t> array_to_bytes(const array& a);
rust::String array_to_string(const array& a);

// Element-wise.
ArrayPtr add(const array& a, const array& b);
ArrayPtr subtract(const array& a, const array& b);
ArrayPtr multiply(const array& a, const array& b);
ArrayPtr divide(const array& a, const array& b);
ArrayPtr maximum(const array& a, const array& b);
ArrayPtr minimum(const array& a, const array& b);
ArrayPtr power(const array& a, const array& b);
ArrayPtr equal(const array& a, const array& b);
ArrayPtr not_equal(const array& a, const array& b);
ArrayPtr less(const array& a, const array& b);
ArrayPtr less_equal(const array& a, const array& b);
ArrayPtr greater(const array& a, const array& b);
ArrayPtr greater_equal(const array& a, const array& b);
ArrayPtr logical_and(const array& a, const array& b);
ArrayPtr logical_or(const array& a, const array& b);
ArrayPtr where_(const array& condition, const array& x, const array& y);
ArrayPtr exp(const array& a);
ArrayPtr log(const array& a);
ArrayPtr sqrt(const array& a);
ArrayPtr rsqrt(const array& a);
ArrayPtr sigmoid(const array& a);
ArrayPtr tanh(const array& a);
ArrayPtr erf(const array& a);
ArrayPtr negative(const array& a);
ArrayPtr abs(const array& a);
ArrayPtr square(const array& a);
ArrayPtr logical_not(const array& a);

// Shape and type.
ArrayPtr astype(const array& a, uint8_t dtype);
ArrayPtr reshape(const array& a, rust::Slice<const int32_t> shape);
ArrayPtr transpose(const array& a, rust::Slice<const int32_t> axes);
ArrayPtr swapaxes(const array& a, int32_t axis1, int32_t axis2);
ArrayPtr expand_dims(const array& a, int32_t axis);
ArrayPtr squeeze(const array& a, int32_t axis);
ArrayPtr broadcast_to(const array& a, rust::Slice<const int32_t> shape);
ArrayPtr flatten(const array& a, int32_t start_axis, int32_t end_axis);
ArrayPtr contiguous(const array& a);
ArrayPtr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
ArrayPtr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
ArrayPtr concatenate(const ArrayList& arrays, int32_t axis);
ArrayPtr stack(const ArrayList& arrays, int32_t axis);
ArrayPtr tril(const array& a, int32_t k);
ArrayPtr triu(const array& a, int32_t k);

// Indexing.
ArrayPtr take(const array& a, const array& indices, int32_t axis);
ArrayPtr take_along_axis(const array& a, const array& indices, int32_t axis);
ArrayPtr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis);
ArrayPtr gather(const array& a, const ArrayList& indices, rust::Slice<const int32_t> axes, rust::Slice<const int32_t> slice_sizes);

// Reductions, sorting, scans.
ArrayPtr sum(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
ArrayPtr mean(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
ArrayPtr max(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
ArrayPtr min(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
ArrayPtr logsumexp(const array& a, rust::Slice<const int32_t> axes, bool keepdims);
ArrayPtr argmax(const array& a, int32_t axis, bool keepdims);
ArrayPtr argmin(const array& a, int32_t axis, bool keepdims);
ArrayPtr softmax(const array& a, rust::Slice<const int32_t> axes, bool precise);
ArrayPtr sort(const array& a, int32_t axis);
ArrayPtr argsort(const array& a, int32_t axis);
ArrayPtr argpartition(const array& a, int32_t kth, int32_t axis);
ArrayPtr topk(const array& a, int32_t k, int32_t axis);
ArrayPtr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive);

// Linear algebra and quantization.
ArrayPtr matmul(const array& a, const array& b);
std::unique_ptr<ArrayList> quantize(const array& w, int32_t group_size, int32_t bits);
ArrayPtr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits);
ArrayPtr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases, bool transpose, int32_t group_size, int32_t bits);

// mlx::core::fast.
ArrayPtr rms_norm(const array& x, const array* weight, float eps);
ArrayPtr layer_norm(const array& x, const array* weight, const array* bias, float eps);
ArrayPtr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset, const array* freqs);
ArrayPtr rope_dynamic(const array& x, int32_t dims, bool traditional, float base, float scale, const array& offset, const array* freqs);
ArrayPtr scaled_dot_product_attention(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode, const array* mask);

// Random numbers with explicit keys.
ArrayPtr random_key(uint64_t seed);
ArrayPtr random_split(const array& key, int32_t num);
ArrayPtr random_uniform(const array& low, const array& high, rust::Slice<const int32_t> shape, uint8_t dtype, const array& key);
ArrayPtr random_normal(rust::Slice<const int32_t> shape, uint8_t dtype, float loc, float scale, const array& key);
ArrayPtr random_categorical(const array& logits, int32_t axis, const array& key);
ArrayPtr random_gumbel(rust::Slice<const int32_t> shape, uint8_t dtype, const array& key);

// Evaluation, devices and streams.
void eval(const ArrayList& arrays);
void async_eval(const ArrayList& arrays);
void eval_one(const array& a);
bool is_gpu_available();
bool default_device_is_gpu();
void set_default_device(bool gpu);
StreamId default_stream(bool gpu);
StreamId new_stream(bool gpu);
void set_default_stream(StreamId stream);
void synchronize(StreamId stream);

// Memory counters and limits.
size_t get_active_memory();
size_t get_peak_memory();
void reset_peak_memory();
size_t get_cache_memory();
size_t set_cache_limit(size_t limit);
size_t set_memory_limit(size_t limit);
void clear_cache();

// Array lists.
std::unique_ptr<ArrayList> array_list_new();
void array_list_push(ArrayList& list, const array& a);
size_t array_list_len(const ArrayList& list);
ArrayPtr array_list_get(const ArrayList& list, size_t index);

// Files.
std::unique_ptr<TensorFile> load_safetensors(rust::Str path);
void save_safetensors(rust::Str path, const TensorFile& file);
std::unique_ptr<TensorFile> load_gguf(rust::Str path);
std::unique_ptr<TensorFile> tensor_file_new();
void tensor_file_insert(TensorFile& file, rust::Str name, const array& a);
void tensor_file_insert_meta(TensorFile& file, rust::Str key, rust::Str value);
size_t tensor_file_len(const TensorFile& file);
rust::String tensor_file_name(const TensorFile& file, size_t index);
ArrayPtr tensor_file_array(const TensorFile& file, size_t index);
size_t tensor_file_meta_len(const TensorFile& file);
rust::String tensor_file_meta_key(const TensorFile& file, size_t index);
rust::String tensor_file_meta_value(const TensorFile& file, size_t index);

}  // namespace mlxcel

namespace mlxcel {
// OpenBLAS threads (0 when MLX uses another BLAS).
int32_t blas_threads();
void set_blas_threads(int32_t threads);
rust::String blas_library();
}  // namespace mlxcel

namespace mlxcel {
// mlxcel's own CPU kernels (../kernels). `path`: -1 auto, 0 portable, 1 avx2, 2 avx512.
ArrayPtr kernels_quantized_matmul(const array& x, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, int32_t path);
ArrayPtr kernels_quantized_matmul_vnni_rows(const array& x, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, int32_t path, const array& vnni_rows);
// The VNNI matvec's copy of a weight (kernels::vnni_rows), or null where there is none.
ArrayPtr kernels_vnni_rows(const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits);
rust::String kernels_path_name(int32_t path);
rust::String kernels_copy_loop_name(int32_t path, int32_t bits);
int32_t kernels_num_threads();
bool kernels_supports(int32_t group_size, int32_t bits);
// The many-row (prefill) quantized GEMM (kernels/quantized_gemm.h).
ArrayPtr kernels_quantized_gemm(const array& x, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, int32_t path);
bool kernels_gemm_supports(int32_t group_size, int32_t bits);
bool kernels_gemm_uses_amx(int32_t path);
rust::String kernels_gemm_loop_name(int32_t path, int32_t bits);
ArrayPtr kernels_dense_matmul(const array& x, const array& w, int32_t path);
ArrayPtr kernels_gelu_erf(const array& x, int32_t path);
ArrayPtr kernels_rms_norm(const array& x, const array* weight, float eps);
ArrayPtr kernels_rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset,
                      const array* freqs);
ArrayPtr kernels_quantized_gemm_swiglu(const array& x, const array& gate_w, const array& gate_scales, const array& gate_biases, const array& up_w, const array& up_scales, const array& up_biases, int32_t group_size, int32_t bits);
// Causal attention for many new tokens (kernels/causal_attention.h).
ArrayPtr kernels_causal_attention(const array& q, const array& k, const array& v, float scale);
bool kernels_causal_attention_supports(const array& q, const array& k, const array& v);
ArrayPtr kernels_attention(const array& q, const array& k, const array& v, float scale, bool causal);
bool kernels_attention_supports(const array& q, const array& k, const array& v, bool causal);
// One fused decoder block on the CPU (kernels/decoder_layer.h): {out, keys, values}.
std::unique_ptr<ArrayList> kernels_decoder_layer(const DecoderLayerArrays& arrays, const DecoderLayerSpec& spec);
// The block's weights prepared once (x, keys and values of `arrays` are not read),
// and a block on them: {out, keys, values}.
std::unique_ptr<PreparedLayer> kernels_prepare_decoder_layer(const DecoderLayerArrays& arrays, const DecoderLayerSpec& spec);
std::unique_ptr<ArrayList> kernels_decoder_layer_prepared(const PreparedLayer& weights, const array& x, const array& keys, const array& values, const DecoderLayerSpec& spec);
// B sequences in one node: {out, keys[0..B), values[0..B)}.
std::unique_ptr<ArrayList> kernels_decoder_layer_batch(const PreparedLayer& weights, const array& x, const ArrayList& keys, const ArrayList& values, rust::Slice<const int32_t> offsets, const DecoderLayerSpec& spec);
// decoder_layer_batch over a paged pool; tables[b] is table_lens[b] ids of the flat list.
std::unique_ptr<ArrayList> kernels_decoder_layer_paged(const PreparedLayer& weights, const array& x, const array& pool_keys, const array& pool_values, rust::Slice<const int32_t> tables, rust::Slice<const int32_t> table_lens, rust::Slice<const int32_t> offsets, const DecoderLayerSpec& spec);
// Consecutive paged blocks as one node: {out, keys[0..n), values[0..n)}.
std::unique_ptr<PreparedStack> kernels_prepared_stack_new();
void kernels_prepared_stack_push(PreparedStack& stack, const PreparedLayer& layer);
uint64_t kernels_decoder_stack_nodes();
std::unique_ptr<ArrayList> kernels_decoder_stack_paged(const PreparedStack& stack, const array& x, const ArrayList& pool_keys, const ArrayList& pool_values, rust::Slice<const int32_t> tables, rust::Slice<const int32_t> table_lens, rust::Slice<const int32_t> offsets, rust::Slice<const DecoderLayerSpec> specs);
// Causal attention over a paged pool (kernels/causal_attention.h): {out, keys pool, values pool}.
std::unique_ptr<ArrayList> kernels_paged_causal_attention(const array& q, const array& k, const array& v, const array& pool_keys, const array& pool_values, rust::Slice<const int32_t> table, int32_t offset, float scale, int32_t window, int32_t keep, int32_t layer);
// KV pool memory (kernels/kv_pool.h).
ArrayPtr kernels_kv_pool_buffer(int32_t blocks, int32_t kv_heads, int32_t block, int32_t head_dim);
ArrayPtr kernels_kv_pool_buffer_q8(int32_t blocks, int32_t layers, int32_t kv_heads, int32_t block, int32_t head_dim);
void kernels_kv_pool_release(const array& pool, rust::Slice<const int32_t> ids);
size_t kernels_resident_bytes(const array& a);
// Bytes of the weight copies the VNNI matvec reads (kernels/detail.h, VnniRows).
size_t kernels_vnni_rows_bytes();
// Weights in huge-page memory (kernels/weight_arena.h).
ArrayPtr kernels_weight_array(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t dtype);
size_t kernels_weight_arena_bytes();
bool kernels_weight_arena_huge_pages();
// {eligible, huge, resident} bytes of the arena's mappings (kernels::weight_arena_pages).
rust::Vec<size_t> kernels_weight_arena_pages();
// Dequantized rows of a quantized embedding table (kernels/quantized_embedding.h).
ArrayPtr kernels_quantized_embedding(const array& ids, const array& w, const array& scales, const array& biases, int32_t group_size, int32_t bits, uint8_t dtype);
// The name of the op that computes an unevaluated array ("" for a leaf).
rust::String array_primitive_name(const array& a);
// The number of graph inputs of an unevaluated array (0 for a leaf).
size_t array_input_count(const array& a);
}  // namespace mlxcel
