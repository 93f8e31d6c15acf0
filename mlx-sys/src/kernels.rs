//! mlxcel's own CPU compute kernels (the C++ in `kernels/` at the workspace
//! root), run as MLX graph nodes so they compose with every other op.
//!
//! [`quantized_matmul`] is a drop-in for
//! `mlx_sys::quantized_matmul(x, w, scales, biases, true, group_size, bits)`:
//! the same shape, dtype and errors, much faster on CPU for a few rows of `x`
//! (decode). It unpacks weights to f32 and accumulates in f32 (no activation
//! quantization), splits output rows across a persistent thread pool, and
//! picks an AVX-512, AVX2 or portable inner loop at run time. On a GPU
//! stream, or for a layout it does not handle, it returns MLX's own op.
//!
//! Environment (read once per process):
//! - `MLXCEL_KERNELS=portable|avx2|avx512` caps the inner loop that
//!   [`KernelPath::Auto`] picks (default: the best the CPU runs). An explicit
//!   path ignores it.
//! - `MLXCEL_NUM_THREADS=n` sets the thread count (default: the hardware's).

use crate::array::Array;
use crate::error::Result;
use crate::ffi;

/// Which inner loop evaluates a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// The best the CPU runs, unless `MLXCEL_KERNELS` says otherwise.
    Auto = -1,
    /// Plain C++, any CPU; every supported bit width.
    Portable = 0,
    /// 8-lane AVX2 + FMA (bits 2, 4, 8).
    Avx2 = 1,
    /// 16-lane AVX-512 (bits 2, 4, 8).
    Avx512 = 2,
}

/// `x @ dequantize(w, scales, biases).T` over the last axis of `x` (MLX's
/// affine quantization, `transpose = true`), with MLX's semantics.
///
/// `w` is `uint32 [N, K * bits / 32]`, `scales` and `biases` are
/// `[N, K / group_size]` in f32, f16 or bf16; `x` is `[..., K]` in f32, f16 or
/// bf16 and the result `[..., N]` in MLX's output dtype for those inputs.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    quantized_matmul_with_path(x, w, scales, biases, group_size, bits, KernelPath::Auto)
}

/// [`quantized_matmul`] on a chosen inner loop (tests and benchmarks). A path
/// the CPU cannot run falls back to the best one below it.
pub fn quantized_matmul_with_path(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
    path: KernelPath,
) -> Result<Array> {
    Array::from_ffi(ffi::kernels_quantized_matmul(
        &x.raw,
        &w.raw,
        &scales.raw,
        &biases.raw,
        group_size,
        bits,
        path as i32,
    ))
}

/// The loop `path` resolves to on this CPU: `"avx512"`, `"avx2"` or `"portable"`.
pub fn path_name(path: KernelPath) -> String {
    ffi::kernels_path_name(path as i32).unwrap_or_else(|_| "unknown".into())
}

/// Threads the kernels use, the evaluating thread included.
pub fn num_threads() -> usize {
    ffi::kernels_num_threads().max(1) as usize
}

/// Whether the kernel computes this `(group_size, bits)` itself; otherwise
/// [`quantized_matmul`] returns MLX's op (still correct, just MLX's speed).
pub fn supports(group_size: i32, bits: i32) -> bool {
    ffi::kernels_supports(group_size, bits)
}

/// Whether `a` is still an unevaluated node of one of these kernels (and not,
/// say, MLX's op that [`quantized_matmul`] falls back to). For tests.
pub fn is_kernel_node(a: &Array) -> bool {
    ffi::array_primitive_name(&a.raw).starts_with("Mlxcel")
}
