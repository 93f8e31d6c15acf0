//! `mlx::core::fast`: fused kernels for normalization, RoPE and attention.

use crate::array::Array;
use crate::error::Result;
use crate::ffi;

/// The FFI pointer of an optional array: null for `None`.
pub(crate) fn raw_ptr(a: Option<&Array>) -> *const ffi::MlxArray {
    a.and_then(|a| a.raw.as_ref()).map_or(std::ptr::null(), |r| r as *const _)
}

pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `weight` for the call.
    Array::from_ffi(unsafe { ffi::rms_norm(&x.raw, raw_ptr(weight), eps) })
}

pub fn layer_norm(x: &Array, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY: the pointers are null or borrow their arrays for the call.
    Array::from_ffi(unsafe { ffi::layer_norm(&x.raw, raw_ptr(weight), raw_ptr(bias), eps) })
}

/// Rotary embedding of the first `dims` features of `x` ([.., seq, head_dim]),
/// positions starting at `offset`. With `freqs`, `base` is ignored.
pub fn rope(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: i32,
    freqs: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `freqs` for the call.
    Array::from_ffi(unsafe { ffi::rope(&x.raw, dims, traditional, base, scale, offset, raw_ptr(freqs)) })
}

/// [`rope`] with the offset given as an array (one per batch row, or a scalar).
pub fn rope_with_offsets(
    x: &Array,
    dims: i32,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: &Array,
    freqs: Option<&Array>,
) -> Result<Array> {
    // SAFETY: the pointer is null or borrows `freqs` for the call.
    Array::from_ffi(unsafe {
        ffi::rope_dynamic(&x.raw, dims, traditional, base, scale, &offset.raw, raw_ptr(freqs))
    })
}

/// How attention is masked.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    None,
    /// Lower-triangular, aligned to the end of the keys.
    Causal,
    /// An additive float mask or a boolean mask, broadcastable to the scores.
    Array(&'a Array),
}

/// `softmax(q @ k.T * scale + mask) @ v` with grouped-query heads.
/// Shapes: q [B, Hq, L, D], k and v [B, Hkv, S, D].
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    let (mode, array) = match mask {
        AttentionMask::None => ("", None),
        AttentionMask::Causal => ("causal", None),
        AttentionMask::Array(a) => ("array", Some(a)),
    };
    // SAFETY: the pointer is null or borrows the mask for the call.
    Array::from_ffi(unsafe { ffi::scaled_dot_product_attention(&q.raw, &k.raw, &v.raw, scale, mode, raw_ptr(array)) })
}
