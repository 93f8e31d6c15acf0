//! The raw cxx bridge. Use the safe API in the crate root instead.

#[cxx::bridge(namespace = "mlxcel")]
mod bridge {
    /// A stream: an index plus its device (CPU or GPU).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct StreamId {
        index: i32,
        gpu: bool,
    }

    /// Shape and options of one fused decoder block (`kernels/decoder_layer.h`).
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct DecoderLayerSpec {
        hidden: i32,
        heads: i32,
        kv_heads: i32,
        head_dim: i32,
        intermediate: i32,
        offset: i32,
        norm_eps: f32,
        rope_dims: i32,
        rope_base: f32,
        rope_scale: f32,
        rope_traditional: bool,
        /// YaRN's attention factor, multiplying q and k before the rotation (1: none).
        rope_mscale: f32,
        attn_scale: f32,
        cache_in_place: bool,
        kv_window: i32,
        kv_keep: i32,
        kv_layer: i32,
        /// The MLP gate's activation: 0 SiLU, 1 GELU (tanh approximation).
        activation: i32,
        /// A mixture of experts in place of the MLP when > 0 (`kernels/decoder_layer.h`):
        /// experts, experts per token, routing (0 softmax of the top k, 1 top k of the
        /// softmax, 2 the same renormalized).
        experts: i32,
        top_k: i32,
        routing: i32,
    }

    /// One quantized projection of a fused decoder block; `bias` may be null.
    struct DecoderProjection<'a> {
        weight: &'a MlxArray,
        scales: &'a MlxArray,
        biases: &'a MlxArray,
        bias: *const MlxArray,
    }

    /// The arrays of one fused decoder block by name (`DecoderLayerInputs`
    /// in `kernels/decoder_layer.h`); null pointers are absent options.
    struct DecoderLayerArrays<'a> {
        x: &'a MlxArray,
        input_norm: &'a MlxArray,
        q_proj: DecoderProjection<'a>,
        k_proj: DecoderProjection<'a>,
        v_proj: DecoderProjection<'a>,
        o_proj: DecoderProjection<'a>,
        post_attention_norm: &'a MlxArray,
        gate_proj: DecoderProjection<'a>,
        up_proj: DecoderProjection<'a>,
        down_proj: DecoderProjection<'a>,
        keys: &'a MlxArray,
        values: &'a MlxArray,
        q_norm: *const MlxArray,
        k_norm: *const MlxArray,
        rope_freqs: *const MlxArray,
        attn_out_norm: *const MlxArray,
        mlp_out_norm: *const MlxArray,
        /// The router of a mixture of experts (all three or none).
        router_weight: *const MlxArray,
        router_scales: *const MlxArray,
        router_biases: *const MlxArray,
    }

    #[namespace = "mlx::core"]
    unsafe extern "C++" {
        include!("mlx-sys/cpp/shim.h");
        #[cxx_name = "array"]
        type MlxArray;
    }

    unsafe extern "C++" {
        include!("mlx-sys/cpp/shim.h");
        type ArrayList;
        type TensorFile;
        type PreparedLayer;
        type PreparedStack;

        fn mlx_version() -> String;
        fn blas_threads() -> i32;
        fn set_blas_threads(threads: i32);
        fn blas_library() -> String;
        fn array_from_bytes(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn array_from_f64(value: f64, dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn array_clone(a: &MlxArray) -> UniquePtr<MlxArray>;
        fn array_dtype(a: &MlxArray) -> u8;
        fn array_shape(a: &MlxArray) -> Vec<i32>;
        fn array_strides(a: &MlxArray) -> Vec<i64>;
        fn array_to_bytes(a: &MlxArray) -> Result<Vec<u8>>;
        fn zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn ones(shape: &[i32], dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn full(shape: &[i32], value: f64, dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn array_size(a: &MlxArray) -> usize;
        fn array_nbytes(a: &MlxArray) -> usize;
        fn array_is_available(a: &MlxArray) -> bool;
        fn array_to_string(a: &MlxArray) -> Result<String>;
        fn add(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn subtract(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn multiply(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn divide(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn maximum(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn minimum(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn power(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn equal(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn not_equal(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn less(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn less_equal(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn greater(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn greater_equal(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn logical_and(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn logical_or(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn where_(condition: &MlxArray, x: &MlxArray, y: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn exp(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn log(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn sqrt(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn rsqrt(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn sigmoid(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn tanh(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn erf(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn negative(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn abs(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn square(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn logical_not(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn astype(a: &MlxArray, dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn reshape(a: &MlxArray, shape: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn transpose(a: &MlxArray, axes: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn swapaxes(a: &MlxArray, axis1: i32, axis2: i32) -> Result<UniquePtr<MlxArray>>;
        fn expand_dims(a: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn squeeze(a: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn broadcast_to(a: &MlxArray, shape: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn flatten(a: &MlxArray, start_axis: i32, end_axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn contiguous(a: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn slice(a: &MlxArray, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn slice_update(src: &MlxArray, update: &MlxArray, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn concatenate(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn stack(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn tril(a: &MlxArray, k: i32) -> Result<UniquePtr<MlxArray>>;
        fn triu(a: &MlxArray, k: i32) -> Result<UniquePtr<MlxArray>>;
        fn take(a: &MlxArray, indices: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn take_along_axis(a: &MlxArray, indices: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn put_along_axis(a: &MlxArray, indices: &MlxArray, values: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn gather(a: &MlxArray, indices: &ArrayList, axes: &[i32], slice_sizes: &[i32]) -> Result<UniquePtr<MlxArray>>;
        fn sum(a: &MlxArray, axes: &[i32], keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn mean(a: &MlxArray, axes: &[i32], keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn max(a: &MlxArray, axes: &[i32], keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn min(a: &MlxArray, axes: &[i32], keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn logsumexp(a: &MlxArray, axes: &[i32], keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn argmax(a: &MlxArray, axis: i32, keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn argmin(a: &MlxArray, axis: i32, keepdims: bool) -> Result<UniquePtr<MlxArray>>;
        fn softmax(a: &MlxArray, axes: &[i32], precise: bool) -> Result<UniquePtr<MlxArray>>;
        fn sort(a: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn argsort(a: &MlxArray, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn argpartition(a: &MlxArray, kth: i32, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn topk(a: &MlxArray, k: i32, axis: i32) -> Result<UniquePtr<MlxArray>>;
        fn cumsum(a: &MlxArray, axis: i32, reverse: bool, inclusive: bool) -> Result<UniquePtr<MlxArray>>;
        fn matmul(a: &MlxArray, b: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn quantize(w: &MlxArray, group_size: i32, bits: i32) -> Result<UniquePtr<ArrayList>>;
        fn dequantize(w: &MlxArray, scales: &MlxArray, biases: &MlxArray, group_size: i32, bits: i32) -> Result<UniquePtr<MlxArray>>;
        fn quantized_matmul(x: &MlxArray, w: &MlxArray, scales: &MlxArray, biases: &MlxArray, transpose: bool, group_size: i32, bits: i32) -> Result<UniquePtr<MlxArray>>;
        unsafe fn rms_norm(x: &MlxArray, weight: *const MlxArray, eps: f32) -> Result<UniquePtr<MlxArray>>;
        unsafe fn layer_norm(x: &MlxArray, weight: *const MlxArray, bias: *const MlxArray, eps: f32) -> Result<UniquePtr<MlxArray>>;
        unsafe fn rope(x: &MlxArray, dims: i32, traditional: bool, base: f32, scale: f32, offset: i32, freqs: *const MlxArray) -> Result<UniquePtr<MlxArray>>;
        unsafe fn rope_dynamic(x: &MlxArray, dims: i32, traditional: bool, base: f32, scale: f32, offset: &MlxArray, freqs: *const MlxArray) -> Result<UniquePtr<MlxArray>>;
        unsafe fn scaled_dot_product_attention(q: &MlxArray, k: &MlxArray, v: &MlxArray, scale: f32, mask_mode: &str, mask: *const MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn random_key(seed: u64) -> Result<UniquePtr<MlxArray>>;
        fn random_split(key: &MlxArray, num: i32) -> Result<UniquePtr<MlxArray>>;
        fn random_uniform(low: &MlxArray, high: &MlxArray, shape: &[i32], dtype: u8, key: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn random_normal(shape: &[i32], dtype: u8, loc: f32, scale: f32, key: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn random_categorical(logits: &MlxArray, axis: i32, key: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn random_gumbel(shape: &[i32], dtype: u8, key: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn eval(arrays: &ArrayList) -> Result<()>;
        fn async_eval(arrays: &ArrayList) -> Result<()>;
        fn eval_one(a: &MlxArray) -> Result<()>;
        fn is_gpu_available() -> Result<bool>;
        fn default_device_is_gpu() -> bool;
        fn set_default_device(gpu: bool) -> Result<()>;
        fn default_stream(gpu: bool) -> Result<StreamId>;
        fn new_stream(gpu: bool) -> Result<StreamId>;
        fn set_default_stream(stream: StreamId) -> Result<()>;
        fn synchronize(stream: StreamId) -> Result<()>;
        fn get_active_memory() -> usize;
        fn get_peak_memory() -> usize;
        fn reset_peak_memory();
        fn get_cache_memory() -> usize;
        fn set_cache_limit(limit: usize) -> Result<usize>;
        fn set_memory_limit(limit: usize) -> Result<usize>;
        fn clear_cache() -> Result<()>;
        fn array_list_new() -> UniquePtr<ArrayList>;
        fn array_list_push(list: Pin<&mut ArrayList>, a: &MlxArray);
        fn array_list_len(list: &ArrayList) -> usize;
        fn array_list_get(list: &ArrayList, index: usize) -> Result<UniquePtr<MlxArray>>;
        fn load_safetensors(path: &str) -> Result<UniquePtr<TensorFile>>;
        fn save_safetensors(path: &str, file: &TensorFile) -> Result<()>;
        fn load_gguf(path: &str) -> Result<UniquePtr<TensorFile>>;
        fn tensor_file_new() -> UniquePtr<TensorFile>;
        fn tensor_file_insert(file: Pin<&mut TensorFile>, name: &str, a: &MlxArray);
        fn tensor_file_insert_meta(file: Pin<&mut TensorFile>, key: &str, value: &str);
        fn tensor_file_len(file: &TensorFile) -> usize;
        fn tensor_file_name(file: &TensorFile, index: usize) -> Result<String>;
        fn tensor_file_array(file: &TensorFile, index: usize) -> Result<UniquePtr<MlxArray>>;
        fn tensor_file_meta_len(file: &TensorFile) -> usize;
        fn tensor_file_meta_key(file: &TensorFile, index: usize) -> Result<String>;
        fn tensor_file_meta_value(file: &TensorFile, index: usize) -> Result<String>;
        fn kernels_quantized_matmul(x: &MlxArray, w: &MlxArray, scales: &MlxArray, biases: &MlxArray, group_size: i32, bits: i32, path: i32) -> Result<UniquePtr<MlxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn kernels_quantized_matmul_vnni_rows(x: &MlxArray, w: &MlxArray, scales: &MlxArray, biases: &MlxArray, group_size: i32, bits: i32, path: i32, vnni_rows: &MlxArray) -> Result<UniquePtr<MlxArray>>;
        fn kernels_vnni_rows(w: &MlxArray, scales: &MlxArray, biases: &MlxArray, group_size: i32, bits: i32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_path_name(path: i32) -> Result<String>;
        fn kernels_copy_loop_name(path: i32, bits: i32) -> Result<String>;
        fn kernels_num_threads() -> i32;
        fn kernels_supports(group_size: i32, bits: i32) -> bool;
        fn kernels_quantized_gemm(x: &MlxArray, w: &MlxArray, scales: &MlxArray, biases: &MlxArray, group_size: i32, bits: i32, path: i32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_gemm_supports(group_size: i32, bits: i32) -> bool;
        fn kernels_gemm_uses_amx(path: i32) -> Result<bool>;
        fn kernels_gemm_loop_name(path: i32, bits: i32) -> Result<String>;
        fn kernels_dense_matmul(x: &MlxArray, w: &MlxArray, path: i32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_gelu_erf(x: &MlxArray, path: i32) -> Result<UniquePtr<MlxArray>>;
        unsafe fn kernels_rms_norm(x: &MlxArray, weight: *const MlxArray, eps: f32) -> Result<UniquePtr<MlxArray>>;
        #[allow(clippy::too_many_arguments)]
        unsafe fn kernels_rope(x: &MlxArray, dims: i32, traditional: bool, base: f32, scale: f32, offset: i32, freqs: *const MlxArray) -> Result<UniquePtr<MlxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn kernels_quantized_gemm_swiglu(x: &MlxArray, gate_w: &MlxArray, gate_scales: &MlxArray, gate_biases: &MlxArray, up_w: &MlxArray, up_scales: &MlxArray, up_biases: &MlxArray, group_size: i32, bits: i32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_causal_attention(q: &MlxArray, k: &MlxArray, v: &MlxArray, scale: f32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_causal_attention_supports(q: &MlxArray, k: &MlxArray, v: &MlxArray) -> bool;
        fn kernels_attention(q: &MlxArray, k: &MlxArray, v: &MlxArray, scale: f32, causal: bool) -> Result<UniquePtr<MlxArray>>;
        fn kernels_attention_supports(q: &MlxArray, k: &MlxArray, v: &MlxArray, causal: bool) -> bool;
        fn kernels_decoder_layer(arrays: &DecoderLayerArrays, spec: &DecoderLayerSpec) -> Result<UniquePtr<ArrayList>>;
        fn kernels_prepare_decoder_layer(arrays: &DecoderLayerArrays, spec: &DecoderLayerSpec) -> Result<UniquePtr<PreparedLayer>>;
        fn kernels_decoder_layer_prepared(weights: &PreparedLayer, x: &MlxArray, keys: &MlxArray, values: &MlxArray, spec: &DecoderLayerSpec) -> Result<UniquePtr<ArrayList>>;
        fn kernels_decoder_layer_batch(weights: &PreparedLayer, x: &MlxArray, keys: &ArrayList, values: &ArrayList, offsets: &[i32], spec: &DecoderLayerSpec) -> Result<UniquePtr<ArrayList>>;
        #[allow(clippy::too_many_arguments)]
        fn kernels_decoder_layer_paged(weights: &PreparedLayer, x: &MlxArray, pool_keys: &MlxArray, pool_values: &MlxArray, tables: &[i32], table_lens: &[i32], offsets: &[i32], spec: &DecoderLayerSpec) -> Result<UniquePtr<ArrayList>>;
        fn kernels_prepared_stack_new() -> UniquePtr<PreparedStack>;
        fn kernels_prepared_stack_push(stack: Pin<&mut PreparedStack>, layer: &PreparedLayer);
        fn kernels_decoder_stack_nodes() -> u64;
        fn kernels_decoder_stack_paged(stack: &PreparedStack, x: &MlxArray, pool_keys: &ArrayList, pool_values: &ArrayList, tables: &[i32], table_lens: &[i32], offsets: &[i32], specs: &[DecoderLayerSpec]) -> Result<UniquePtr<ArrayList>>;
        #[allow(clippy::too_many_arguments)]
        fn kernels_paged_causal_attention(q: &MlxArray, k: &MlxArray, v: &MlxArray, pool_keys: &MlxArray, pool_values: &MlxArray, table: &[i32], offset: i32, scale: f32, window: i32, keep: i32, layer: i32) -> Result<UniquePtr<ArrayList>>;
        fn kernels_kv_pool_buffer(blocks: i32, kv_heads: i32, block: i32, head_dim: i32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_kv_pool_buffer_q8(blocks: i32, layers: i32, kv_heads: i32, block: i32, head_dim: i32) -> Result<UniquePtr<MlxArray>>;
        fn kernels_kv_pool_release(pool: &MlxArray, ids: &[i32]) -> Result<()>;
        fn kernels_resident_bytes(a: &MlxArray) -> Result<usize>;
        fn kernels_vnni_rows_bytes() -> usize;
        fn kernels_weight_array(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn kernels_weight_arena_bytes() -> usize;
        fn kernels_weight_arena_huge_pages() -> bool;
        fn kernels_weight_arena_pages() -> Vec<usize>;
        #[allow(clippy::too_many_arguments)]
        fn kernels_quantized_embedding(ids: &MlxArray, w: &MlxArray, scales: &MlxArray, biases: &MlxArray, group_size: i32, bits: i32, dtype: u8) -> Result<UniquePtr<MlxArray>>;
        fn array_primitive_name(a: &MlxArray) -> String;
        fn array_input_count(a: &MlxArray) -> usize;
    }
}
pub(crate) use bridge::*;
pub use bridge::DecoderLayerSpec;
