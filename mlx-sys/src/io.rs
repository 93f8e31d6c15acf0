//! Reading and writing tensor files with MLX's own loaders.

use std::collections::BTreeMap;
use std::path::Path;

use crate::array::Array;
use crate::error::{Error, Result};
use crate::ffi;

/// Named arrays plus the file's string metadata.
#[derive(Debug, Default, Clone)]
pub struct TensorMap {
    pub arrays: BTreeMap<String, Array>,
    pub metadata: BTreeMap<String, String>,
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str().ok_or_else(|| Error::new(format!("path is not valid UTF-8: {}", path.display())))
}

fn collect(file: &ffi::TensorFile) -> Result<TensorMap> {
    let mut map = TensorMap::default();
    for i in 0..ffi::tensor_file_len(file) {
        map.arrays.insert(ffi::tensor_file_name(file, i)?, Array::from_ffi(ffi::tensor_file_array(file, i))?);
    }
    for i in 0..ffi::tensor_file_meta_len(file) {
        map.metadata.insert(ffi::tensor_file_meta_key(file, i)?, ffi::tensor_file_meta_value(file, i)?);
    }
    Ok(map)
}

/// Loads every tensor of a `.safetensors` file (lazily: data is read on eval).
pub fn load_safetensors(path: &Path) -> Result<TensorMap> {
    collect(&*ffi::load_safetensors(path_str(path)?)?)
}

pub fn save_safetensors(path: &Path, arrays: &BTreeMap<String, Array>, metadata: &BTreeMap<String, String>) -> Result<()> {
    let mut file = ffi::tensor_file_new();
    for (name, array) in arrays {
        ffi::tensor_file_insert(file.pin_mut(), name, &array.raw);
    }
    for (key, value) in metadata {
        ffi::tensor_file_insert_meta(file.pin_mut(), key, value);
    }
    Ok(ffi::save_safetensors(path_str(path)?, &file)?)
}

/// Loads a GGUF file with MLX's loader. Q4_0, Q4_1 and Q8_0 tensors come back
/// as `name.weight`/`name.scales`/`name.biases` triplets; other quantized types
/// are rejected by MLX. Array-valued metadata is given in MLX's text form.
pub fn load_gguf(path: &Path) -> Result<TensorMap> {
    collect(&*ffi::load_gguf(path_str(path)?)?)
}
