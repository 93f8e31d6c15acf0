use std::fmt;

use cxx::UniquePtr;
use half::{bf16, f16};

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::ffi;

/// A handle to an MLX array: a lazily computed, reference-counted tensor.
///
/// Cloning is cheap (it shares the underlying buffer and graph node).
///
/// Thread safety: an `Array` may move to and be read from any thread. MLX
/// arrays are immutable once evaluated; evaluating one graph from two threads
/// at the same time is not supported, so share only evaluated arrays (model
/// weights are evaluated when they are loaded).
pub struct Array {
    pub(crate) raw: UniquePtr<ffi::MlxArray>,
}

// SAFETY: `mlx::core::array` is a shared_ptr handle; see the type's docs for
// the evaluation rule that makes shared use sound.
unsafe impl Send for Array {}
unsafe impl Sync for Array {}

impl Clone for Array {
    fn clone(&self) -> Self {
        Array { raw: ffi::array_clone(&self.raw) }
    }
}

/// Rust element types that map onto an MLX dtype.
pub trait Element: Copy + Default + 'static {
    const DTYPE: Dtype;
    fn as_bytes(data: &[Self]) -> &[u8];
    fn vec_from_bytes(bytes: &[u8]) -> Vec<Self>;
}

macro_rules! pod_element {
    ($t:ty, $dtype:expr) => {
        impl Element for $t {
            const DTYPE: Dtype = $dtype;
            fn as_bytes(data: &[Self]) -> &[u8] {
                bytemuck::cast_slice(data)
            }
            fn vec_from_bytes(bytes: &[u8]) -> Vec<Self> {
                bytemuck::pod_collect_to_vec(bytes)
            }
        }
    };
}
pod_element!(f32, Dtype::Float32);
pod_element!(f16, Dtype::Float16);
pod_element!(bf16, Dtype::Bfloat16);
pod_element!(i32, Dtype::Int32);
pod_element!(u32, Dtype::Uint32);
pod_element!(i64, Dtype::Int64);
pod_element!(u8, Dtype::Uint8);
pod_element!(i8, Dtype::Int8);

impl Element for bool {
    const DTYPE: Dtype = Dtype::Bool;
    fn as_bytes(data: &[Self]) -> &[u8] {
        // SAFETY: bool is one byte holding 0 or 1.
        unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), data.len()) }
    }
    fn vec_from_bytes(bytes: &[u8]) -> Vec<Self> {
        bytes.iter().map(|&b| b != 0).collect()
    }
}

impl Array {
    pub(crate) fn wrap(raw: UniquePtr<ffi::MlxArray>) -> Array {
        Array { raw }
    }

    pub(crate) fn from_ffi(result: std::result::Result<UniquePtr<ffi::MlxArray>, cxx::Exception>) -> Result<Array> {
        Ok(Array::wrap(result?))
    }

    /// Copies `data` into a new array of the given shape.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        Self::from_bytes(T::as_bytes(data), shape, T::DTYPE)
    }

    /// Copies raw little-endian bytes of `dtype` elements into a new array.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::from_ffi(ffi::array_from_bytes(bytes, shape, dtype as u8))
    }

    /// A zero-dimensional array holding `value` converted to `dtype`.
    pub fn scalar(value: f64, dtype: Dtype) -> Result<Array> {
        Self::from_ffi(ffi::array_from_f64(value, dtype as u8))
    }

    pub fn scalar_f32(value: f32) -> Array {
        Self::scalar(value as f64, Dtype::Float32).expect("a float32 scalar is always valid")
    }

    pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::from_ffi(ffi::zeros(shape, dtype as u8))
    }

    pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::from_ffi(ffi::ones(shape, dtype as u8))
    }

    pub fn full(shape: &[i32], value: f64, dtype: Dtype) -> Result<Array> {
        Self::from_ffi(ffi::full(shape, value, dtype as u8))
    }

    /// `[start, stop)` in steps of `step`.
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        Self::from_ffi(ffi::arange(start, stop, step, dtype as u8))
    }

    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(ffi::array_dtype(&self.raw))
    }

    pub fn shape(&self) -> Vec<i32> {
        ffi::array_shape(&self.raw)
    }

    /// Strides in elements. Meaningful once the array is evaluated.
    pub fn strides(&self) -> Vec<i64> {
        ffi::array_strides(&self.raw)
    }

    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// Size of dimension `axis`; negative axes count from the end.
    pub fn dim(&self, axis: i32) -> i32 {
        let shape = self.shape();
        let index = if axis < 0 { shape.len() as i32 + axis } else { axis };
        shape[index as usize]
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        ffi::array_size(&self.raw)
    }

    pub fn nbytes(&self) -> usize {
        ffi::array_nbytes(&self.raw)
    }

    /// Whether the array has been computed (its data can be read without
    /// waiting), and with it everything it depends on.
    pub fn is_available(&self) -> bool {
        ffi::array_is_available(&self.raw)
    }

    /// Evaluates the array.
    pub fn eval(&self) -> Result<()> {
        Ok(ffi::eval_one(&self.raw)?)
    }

    /// Evaluates and copies the elements out in row-major order.
    /// `T` must match the array's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype() != T::DTYPE {
            return Err(Error::new(format!(
                "to_vec::<{}>() called on an array of dtype {}",
                T::DTYPE,
                self.dtype()
            )));
        }
        Ok(T::vec_from_bytes(&self.to_bytes()?))
    }

    /// Evaluates and copies the raw bytes out in row-major order.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(ffi::array_to_bytes(&self.raw)?)
    }

    /// The single element of a one-element array.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::new(format!("item() on an array of shape {:?}", self.shape())));
        }
        Ok(self.to_vec::<T>()?[0])
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array(shape={:?}, dtype={})", self.shape(), self.dtype())
    }
}

impl fmt::Display for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match ffi::array_to_string(&self.raw) {
            Ok(s) => f.write_str(&s),
            Err(e) => write!(f, "<array that failed to evaluate: {}>", e.what()),
        }
    }
}

/// An owned C++ list of arrays for calls that take several.
pub(crate) fn array_list<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> UniquePtr<ffi::ArrayList> {
    let mut list = ffi::array_list_new();
    for a in arrays {
        ffi::array_list_push(list.pin_mut(), &a.raw);
    }
    list
}

pub(crate) fn from_array_list(list: &ffi::ArrayList) -> Result<Vec<Array>> {
    (0..ffi::array_list_len(list)).map(|i| Array::from_ffi(ffi::array_list_get(list, i))).collect()
}
