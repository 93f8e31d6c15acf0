//! Random numbers from explicit keys (MLX's counter-based PRNG): the same key
//! always gives the same numbers, on every thread.

use crate::array::Array;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::ffi;

/// A PRNG key from a seed.
pub fn key(seed: u64) -> Result<Array> {
    Array::from_ffi(ffi::random_key(seed))
}

/// Splits `key` into `num` new keys, stacked along axis 0.
pub fn split(key: &Array, num: i32) -> Result<Vec<Array>> {
    let keys = Array::from_ffi(ffi::random_split(&key.raw, num))?;
    let index = |i: i32| keys.slice_axis(0, i, i + 1)?.squeeze(0);
    (0..num).map(index).collect()
}

pub fn uniform(low: f32, high: f32, shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    let (low, high) = (Array::scalar(low as f64, dtype)?, Array::scalar(high as f64, dtype)?);
    Array::from_ffi(ffi::random_uniform(&low.raw, &high.raw, shape, dtype as u8, &key.raw))
}

pub fn normal(shape: &[i32], dtype: Dtype, loc: f32, scale: f32, key: &Array) -> Result<Array> {
    Array::from_ffi(ffi::random_normal(shape, dtype as u8, loc, scale, &key.raw))
}

pub fn gumbel(shape: &[i32], dtype: Dtype, key: &Array) -> Result<Array> {
    Array::from_ffi(ffi::random_gumbel(shape, dtype as u8, &key.raw))
}

/// Samples indices from unnormalized log-probabilities along `axis`.
pub fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<Array> {
    Array::from_ffi(ffi::random_categorical(&logits.raw, axis, &key.raw))
}
