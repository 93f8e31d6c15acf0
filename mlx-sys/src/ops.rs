//! Array operations. Each returns a new lazy array or MLX's error.

use crate::array::{array_list, from_array_list, Array};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::ffi;

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        impl Array {
            $($(#[$doc])* pub fn $name(&self, other: &Array) -> Result<Array> {
                Array::from_ffi(ffi::$name(&self.raw, &other.raw))
            })*
        }
    };
}

macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        impl Array {
            $($(#[$doc])* pub fn $name(&self) -> Result<Array> {
                Array::from_ffi(ffi::$name(&self.raw))
            })*
        }
    };
}

macro_rules! axes_reductions {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        impl Array {
            $($(#[$doc])* pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
                Array::from_ffi(ffi::$name(&self.raw, axes, keepdims))
            })*
        }
    };
}

binary_ops! {
    /// Element-wise sum, with broadcasting.
    add, subtract, multiply, divide, maximum, minimum, power,
    equal, not_equal, less, less_equal, greater, greater_equal,
    logical_and, logical_or,
    /// Matrix product over the last two axes, batched over the rest.
    matmul,
}

unary_ops! {
    exp, log, sqrt, rsqrt, sigmoid, tanh, erf, negative, abs, square, logical_not,
    /// A row-contiguous copy when the array is not row-contiguous already.
    contiguous,
}

axes_reductions! { sum, mean, max, min, logsumexp }

impl Array {
    /// `x * scalar`, with the scalar in `x`'s dtype.
    pub fn mul_scalar(&self, value: f64) -> Result<Array> {
        self.multiply(&Array::scalar(value, self.dtype())?)
    }

    /// `x + scalar`, with the scalar in `x`'s dtype.
    pub fn add_scalar(&self, value: f64) -> Result<Array> {
        self.add(&Array::scalar(value, self.dtype())?)
    }

    /// `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Array> {
        self.multiply(&self.sigmoid()?)
    }

    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        Array::from_ffi(ffi::astype(&self.raw, dtype as u8))
    }

    /// Reshape; one dimension may be -1.
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        Array::from_ffi(ffi::reshape(&self.raw, shape))
    }

    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        Array::from_ffi(ffi::transpose(&self.raw, axes))
    }

    pub fn swapaxes(&self, axis1: i32, axis2: i32) -> Result<Array> {
        Array::from_ffi(ffi::swapaxes(&self.raw, axis1, axis2))
    }

    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::expand_dims(&self.raw, axis))
    }

    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::squeeze(&self.raw, axis))
    }

    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        Array::from_ffi(ffi::broadcast_to(&self.raw, shape))
    }

    pub fn flatten(&self, start_axis: i32, end_axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::flatten(&self.raw, start_axis, end_axis))
    }

    /// `self[start:stop:strides]` over every axis.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        Array::from_ffi(ffi::slice(&self.raw, start, stop, strides))
    }

    /// `self[.., start:stop]` along one axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let axis = if axis < 0 { axis + shape.len() as i32 } else { axis } as usize;
        let mut begin = vec![0; shape.len()];
        let mut end = shape.clone();
        begin[axis] = start;
        end[axis] = stop;
        self.slice(&begin, &end, &vec![1; shape.len()])
    }

    /// A copy of `self` with `self[start:stop:strides] = update`.
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        Array::from_ffi(ffi::slice_update(&self.raw, &update.raw, start, stop, strides))
    }

    pub fn tril(&self, k: i32) -> Result<Array> {
        Array::from_ffi(ffi::tril(&self.raw, k))
    }

    pub fn triu(&self, k: i32) -> Result<Array> {
        Array::from_ffi(ffi::triu(&self.raw, k))
    }

    /// Slices at `indices` along `axis`.
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::take(&self.raw, &indices.raw, axis))
    }

    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::take_along_axis(&self.raw, &indices.raw, axis))
    }

    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::put_along_axis(&self.raw, &indices.raw, &values.raw, axis))
    }

    /// MLX's general gather: one index array per axis in `axes`.
    pub fn gather(&self, indices: &[Array], axes: &[i32], slice_sizes: &[i32]) -> Result<Array> {
        Array::from_ffi(ffi::gather(&self.raw, &array_list(indices), axes, slice_sizes))
    }

    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Array::from_ffi(ffi::argmax(&self.raw, axis, keepdims))
    }

    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Array::from_ffi(ffi::argmin(&self.raw, axis, keepdims))
    }

    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        Array::from_ffi(ffi::softmax(&self.raw, axes, precise))
    }

    pub fn sort(&self, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::sort(&self.raw, axis))
    }

    pub fn argsort(&self, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::argsort(&self.raw, axis))
    }

    /// Indices that put the `kth` element in sorted position along `axis`.
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::argpartition(&self.raw, kth, axis))
    }

    /// The `k` largest values along `axis` (unordered).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        Array::from_ffi(ffi::topk(&self.raw, k, axis))
    }

    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        Array::from_ffi(ffi::cumsum(&self.raw, axis, reverse, inclusive))
    }
}

/// `condition ? x : y`, element-wise with broadcasting.
pub fn where_(condition: &Array, x: &Array, y: &Array) -> Result<Array> {
    Array::from_ffi(ffi::where_(&condition.raw, &x.raw, &y.raw))
}

pub fn concatenate(arrays: &[Array], axis: i32) -> Result<Array> {
    Array::from_ffi(ffi::concatenate(&array_list(arrays), axis))
}

pub fn stack(arrays: &[Array], axis: i32) -> Result<Array> {
    Array::from_ffi(ffi::stack(&array_list(arrays), axis))
}

/// Affine quantization along the last axis: `(weight, scales, biases)`.
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<(Array, Array, Array)> {
    let list = ffi::quantize(&w.raw, group_size, bits)?;
    let mut parts = from_array_list(&list)?.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(w), Some(s), Some(b)) => Ok((w, s, b)),
        _ => Err(crate::Error::new("quantize returned fewer than three arrays")),
    }
}

pub fn dequantize(w: &Array, scales: &Array, biases: &Array, group_size: i32, bits: i32) -> Result<Array> {
    Array::from_ffi(ffi::dequantize(&w.raw, &scales.raw, &biases.raw, group_size, bits))
}

/// `x @ dequantize(w).T` (or without the transpose) without materializing `w`.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    transpose: bool,
    group_size: i32,
    bits: i32,
) -> Result<Array> {
    Array::from_ffi(ffi::quantized_matmul(&x.raw, &w.raw, &scales.raw, &biases.raw, transpose, group_size, bits))
}
