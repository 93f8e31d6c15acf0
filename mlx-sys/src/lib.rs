//! A safe Rust API over MLX's C++ API, bridged with `cxx` and pinned to the
//! MLX version in `mlx-pin.txt`.
//!
//! Every operation that MLX can reject (a shape mismatch, a bad dtype, a
//! missing file) returns [`Result`] carrying MLX's own message; no MLX
//! exception ever aborts the process.
//!
//! Operations are lazy: they build a graph that [`eval`] or [`async_eval`]
//! computes. Reading values (`to_vec`, `item`) evaluates as needed.

mod array;
mod dtype;
mod error;
mod ffi;
pub mod fast;
pub mod io;
pub mod kernels;
pub mod memory;
mod ops;
pub mod random;
pub mod stream;

pub use array::{Array, Element};
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use ops::*;
pub use stream::{async_eval, eval, Device, Stream};

/// The MLX version this crate was built against, as MLX reports it.
pub fn mlx_version() -> String {
    ffi::mlx_version()
}

/// The MLX version pinned in `mlx-pin.txt`.
pub const MLX_PIN: &str = env!("MLXCEL_MLX_PIN");

/// Which BLAS MLX's CPU matmuls use in this build: `openblas`, `bundled`
/// (the wheel's reference BLAS) or `platform` (Accelerate on macOS).
pub const BLAS_BACKEND: &str = env!("MLXCEL_BLAS_BACKEND");

/// The folder libmlx was linked from (and is found in at run time).
pub const MLX_LIB_DIR: &str = env!("MLXCEL_MLX_LIB_DIR");

/// OpenBLAS's thread count (0 when another BLAS is in use).
pub fn blas_threads() -> i32 {
    ffi::blas_threads()
}

/// The file of the library whose `cblas_sgemm` MLX's CPU matmuls call in
/// this process (resolved at run time, so an `LD_PRELOAD`ed BLAS shows up),
/// or an empty string when none can be found. Model paths never reach it:
/// quantized and dense matmuls and attention run on our kernels.
pub fn blas_library() -> String {
    ffi::blas_library()
}

/// Sets OpenBLAS's thread count (no effect with another BLAS).
pub fn set_blas_threads(threads: i32) {
    ffi::set_blas_threads(threads)
}
