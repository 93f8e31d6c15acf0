//! Reading the tensors of a checkpoint directory: `model.safetensors`, or the
//! shards listed in `model.safetensors.index.json`.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use mlx_sys::{Array, Dtype};
use safetensors::SafeTensors;

use crate::error::{Error, Result};
use crate::quantization::{QuantParams, QuantizationConfig};

struct Entry {
    array: Array,
    file: Arc<PathBuf>,
}

/// Every tensor of a checkpoint, by name, with the file it came from, and
/// which of them the model has read (a tensor no layer reads is an error,
/// [`Weights::unread`], unless its architecture skips it on purpose).
pub struct Weights {
    /// Behind a lock so that quantizing at load can swap a dense weight for
    /// its packed form (freeing the dense copy as it goes).
    tensors: Mutex<HashMap<String, Entry>>,
    /// What a missing tensor is reported against: the index or the one file.
    origin: PathBuf,
    read: Mutex<HashSet<String>>,
    skipped: Mutex<HashSet<String>>,
}

/// The safetensors files of a checkpoint directory.
pub fn safetensors_files(dir: &Path) -> Result<(PathBuf, Vec<PathBuf>)> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| Error::Json { path: index.clone(), source })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::invalid_file(&index, "no `weight_map` object"))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        return Ok((index.clone(), files.into_iter().map(|f| dir.join(f)).collect()));
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok((single.clone(), vec![single]));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    match files.first() {
        Some(first) => Ok((first.clone(), files)),
        None => Err(Error::invalid_file(dir, "no model.safetensors (or *.safetensors shards) in the checkpoint")),
    }
}

/// On the CPU, weights live in the kernels' huge-page arena
/// (`mlx_sys::kernels::weight_array`), which decode streams faster than
/// MLX's own buffers; a GPU reads its own allocator's.
fn weights_in_arena() -> bool {
    mlx_sys::Device::default_device() == mlx_sys::Device::Cpu
}

/// `array` evaluated, and moved into the weight arena where weights live there.
fn in_weight_arena(array: Array) -> mlx_sys::Result<Array> {
    array.eval()?;
    if !weights_in_arena() {
        return Ok(array);
    }
    mlx_sys::kernels::weight_array(&array.to_bytes()?, &array.shape(), array.dtype())
}

fn to_dtype(dtype: safetensors::Dtype, path: &Path, name: &str) -> Result<Dtype> {
    use safetensors::Dtype as S;
    Ok(match dtype {
        S::BOOL => Dtype::Bool,
        S::U8 => Dtype::Uint8,
        S::I8 => Dtype::Int8,
        S::U16 => Dtype::Uint16,
        S::I16 => Dtype::Int16,
        S::U32 => Dtype::Uint32,
        S::I32 => Dtype::Int32,
        S::U64 => Dtype::Uint64,
        S::I64 => Dtype::Int64,
        S::F16 => Dtype::Float16,
        S::BF16 => Dtype::Bfloat16,
        S::F32 => Dtype::Float32,
        S::F64 => Dtype::Float64,
        other => {
            return Err(Error::Unsupported { path: path.into(), message: format!("tensor `{name}` has dtype {other:?}") })
        }
    })
}

impl Weights {
    /// Reads and validates every file (a truncated or corrupt file is an
    /// error naming it) and copies the tensors into MLX arrays.
    pub fn load(dir: &Path) -> Result<Weights> {
        Self::load_placing(dir, true)
    }

    /// Like [`load`](Self::load), for a checkpoint quantized as it loads:
    /// floating-point tensors stay in MLX's memory, since most are replaced
    /// by their quantized form (which goes to the weight arena), and freeing
    /// them there hands their memory back whole.
    pub fn load_for_quantizing(dir: &Path) -> Result<Weights> {
        Self::load_placing(dir, false)
    }

    fn load_placing(dir: &Path, floats_in_arena: bool) -> Result<Weights> {
        let (origin, files) = safetensors_files(dir)?;
        let arena = weights_in_arena();
        let mut tensors = HashMap::new();
        for path in files {
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: the map is read-only and dropped before this function returns.
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let st = SafeTensors::deserialize(&mmap)
                .map_err(|e| Error::invalid_file(&path, format!("not a valid safetensors file: {e}")))?;
            let shared = Arc::new(path.clone());
            for (name, view) in st.tensors() {
                let dtype = to_dtype(view.dtype(), &path, &name)?;
                let shape: Vec<i32> = view.shape().iter().map(|&d| d as i32).collect();
                let array = if arena && (floats_in_arena || !dtype.is_floating()) {
                    mlx_sys::kernels::weight_array(view.data(), &shape, dtype)
                } else {
                    Array::from_bytes(view.data(), &shape, dtype)
                }
                .map_err(|e| Error::invalid_file(&path, format!("tensor `{name}`: {e}")))?;
                // The copy is made: drop the file's pages from this process,
                // so that loading holds about one copy of the weights, not two.
                #[cfg(unix)]
                // SAFETY: a read-only file mapping; a page touched again is re-read from the file.
                unsafe {
                    let offset = view.data().as_ptr() as usize - mmap.as_ptr() as usize;
                    let _ = mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, view.data().len());
                }
                tensors.insert(name, Entry { array, file: shared.clone() });
            }
        }
        Ok(Weights { tensors: Mutex::new(tensors), origin, read: Mutex::new(HashSet::new()), skipped: Mutex::new(HashSet::new()) })
    }

    fn tensors(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn mark_read(&self, name: &str) {
        self.read.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string());
    }

    /// Drops every tensor whose name contains `part` from the checkpoint as
    /// the model sees it (not read, not counted): tensors that an architecture
    /// leaves out on purpose, as mlx-lm's `sanitize` does, stated where it
    /// calls this.
    pub fn skip(&self, part: &str) {
        let mut skipped = self.skipped.lock().unwrap_or_else(|e| e.into_inner());
        skipped.extend(self.tensors().keys().filter(|n| n.contains(part)).cloned());
    }

    /// Puts `prefix` before every name that lacks it (but names starting
    /// with one of `except`): checkpoints saved from a base model without its
    /// task wrapper (Qwen3-Embedding's `layers.0...` for `model.layers.0...`).
    pub fn prefix_missing(&mut self, prefix: &str, except: &[&str]) {
        let tensors = self.tensors.get_mut().unwrap_or_else(|e| e.into_inner());
        let names: Vec<String> =
            tensors.keys().filter(|n| !n.starts_with(prefix) && !except.iter().any(|e| n.starts_with(e))).cloned().collect();
        for name in names {
            if let Some(entry) = tensors.remove(&name) {
                tensors.insert(format!("{prefix}{name}"), entry);
            }
        }
    }

    /// An error naming the tensors neither read nor skipped by the
    /// `model_type` just built from these weights, if any.
    pub fn check_all_read(&self, model_type: &str) -> Result<()> {
        let unread = self.unread();
        if unread.is_empty() {
            return Ok(());
        }
        Err(Error::UnusedTensors { path: self.origin.clone(), model_type: model_type.into(), tensors: unread })
    }

    /// Whether any tensor's name ends with `suffix`.
    pub fn any_name_ends_with(&self, suffix: &str) -> bool {
        self.tensors().keys().any(|name| name.ends_with(suffix))
    }

    /// The tensors neither read nor skipped, sorted: after a model is built,
    /// weights it would otherwise silently ignore.
    pub fn unread(&self) -> Vec<String> {
        let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let skipped = self.skipped.lock().unwrap_or_else(|e| e.into_inner());
        let mut names: Vec<String> =
            self.tensors().keys().filter(|n| !read.contains(*n) && !skipped.contains(*n)).cloned().collect();
        names.sort();
        names
    }

    /// What errors about this checkpoint's tensors name.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors().contains_key(name)
    }

    /// Every tensor but the skipped ones.
    pub fn all(&self) -> Vec<(String, Array)> {
        let skipped = self.skipped.lock().unwrap_or_else(|e| e.into_inner()).clone();
        self.tensors().iter().filter(|(k, _)| !skipped.contains(*k)).map(|(k, e)| (k.clone(), e.array.clone())).collect()
    }

    /// Replaces the dense `{module}.weight` with its quantized form
    /// (`weight`, `scales`, `biases`), all counted as read.
    fn store_quantized(&self, module: &str, q: [Array; 3]) {
        let names = ["weight", "scales", "biases"].map(|part| format!("{module}.{part}"));
        {
            let mut tensors = self.tensors();
            let file = tensors[&names[0]].file.clone();
            for (name, array) in names.iter().zip(q) {
                tensors.insert(name.clone(), Entry { array, file: file.clone() });
            }
        }
        names.iter().for_each(|name| self.mark_read(name));
    }

    /// The tensor `name`, or an error naming the checkpoint file and tensor.
    pub fn get(&self, name: &str) -> Result<Array> {
        let array = self
            .tensors()
            .get(name)
            .map(|entry| entry.array.clone())
            .ok_or_else(|| Error::MissingTensor { path: self.origin.clone(), tensor: name.into() })?;
        self.mark_read(name);
        Ok(array)
    }

    /// [`get`](Self::get), checking the shape.
    pub fn get_shaped(&self, name: &str, shape: &[i32]) -> Result<Array> {
        let array = self.get(name)?;
        if array.shape() != shape {
            return Err(Error::ShapeMismatch {
                path: self.tensors()[name].file.as_ref().clone(),
                tensor: name.into(),
                expected: shape.iter().map(|&d| d as i64).collect(),
                actual: array.shape().iter().map(|&d| d as i64).collect(),
            });
        }
        Ok(array)
    }
}

/// A view of [`Weights`] under a name prefix (`model.layers.3.`), which
/// builds layers and converts them to the compute dtype.
#[derive(Clone)]
pub struct Scope<'a> {
    pub weights: &'a Weights,
    pub quantization: &'a QuantizationConfig,
    pub dtype: Dtype,
    prefix: String,
    at_load: Option<QuantizeAtLoad>,
}

/// Quantizing a dense checkpoint while it loads, as `mlx_lm.convert -q`
/// would have: every floating tensor first rounded to `convert_dtype`
/// (config.json's `torch_dtype`, as convert casts), then each module that
/// loads as a [`Linear`](crate::nn::Linear) or
/// [`Embedding`](crate::nn::Embedding) quantized with MLX's `quantize` when
/// its weight's last dimension is a multiple of the group size
/// (mlx-lm's `quantize_model` predicate); the others stay dense.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeAtLoad {
    pub params: QuantParams,
    pub convert_dtype: Option<Dtype>,
}

impl<'a> Scope<'a> {
    pub fn root(weights: &'a Weights, quantization: &'a QuantizationConfig, dtype: Dtype) -> Self {
        Scope { weights, quantization, dtype, prefix: String::new(), at_load: None }
    }

    /// This scope, quantizing dense modules as they load (see [`QuantizeAtLoad`]).
    pub fn quantizing(self, at_load: Option<QuantizeAtLoad>) -> Self {
        Scope { at_load, ..self }
    }

    /// A floating tensor as convert would have saved it.
    fn as_converted(&self, array: Array) -> Result<Array> {
        Ok(match self.at_load.and_then(|q| q.convert_dtype) {
            Some(dtype) if array.dtype().is_floating() && array.dtype() != dtype => array.astype(dtype)?,
            _ => array,
        })
    }

    /// The scope one level down: `pp("layers").pp(3)`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Scope<'a> {
        let prefix = if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) };
        Scope { prefix, ..self.clone() }
    }

    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() { name.to_string() } else { format!("{}.{name}", self.prefix) }
    }

    pub fn module_path(&self) -> &str {
        &self.prefix
    }

    pub fn contains(&self, name: &str) -> bool {
        self.weights.contains(&self.path(name))
    }

    /// A floating-point tensor of the given shape, in the compute dtype.
    pub fn get(&self, name: &str, shape: &[i32]) -> Result<Array> {
        let array = self.as_converted(self.weights.get_shaped(&self.path(name), shape)?)?;
        let array = if array.dtype().is_floating() { array.astype(self.dtype)? } else { array };
        // Models hold only evaluated arrays, so threads never share graph nodes.
        array.eval()?;
        Ok(array)
    }

    /// [`get`](Self::get) in the checkpoint's own dtype: for quantization
    /// scales and biases, which the kernels read in f16/bf16 directly (a
    /// float32 copy would add a third to a 4-bit model's bytes per token).
    pub fn get_stored(&self, name: &str, shape: &[i32]) -> Result<Array> {
        let array = self.weights.get_shaped(&self.path(name), shape)?;
        array.eval()?;
        Ok(array)
    }

    /// Quantization of this module: present exactly when `scales` exists,
    /// or once [`QuantizeAtLoad`] has made it.
    pub fn quant_params(&self, in_features: i32) -> Result<Option<QuantParams>> {
        if !self.contains("scales") {
            return self.quantize_at_load();
        }
        let module = self.module_path();
        let params = self.quantization.for_module(module).or_else(|| self.infer_params(in_features));
        params.map(Some).ok_or_else(|| Error::Unsupported {
            path: self.weights.origin.clone(),
            message: format!("`{module}.scales` exists but config.json gives no quantization for `{module}`"),
        })
    }

    /// Quantizes this module's dense `weight` in place when loading with
    /// [`QuantizeAtLoad`] and its last dimension takes whole groups.
    fn quantize_at_load(&self) -> Result<Option<QuantParams>> {
        let Some(QuantizeAtLoad { params, .. }) = self.at_load else { return Ok(None) };
        let name = self.path("weight");
        let Ok(dense) = self.weights.get(&name) else { return Ok(None) };
        if dense.shape().last().is_none_or(|&k| k % params.group_size != 0) || !dense.dtype().is_floating() {
            return Ok(None);
        }
        let dense = self.as_converted(dense)?;
        let (w, scales, biases) = mlx_sys::quantize(&dense, params.group_size, params.bits)
            .map_err(|e| Error::invalid_file(self.weights.origin(), format!("quantizing `{name}`: {e}")))?;
        let [w, scales, biases] = [w, scales, biases].map(|a| in_weight_arena(a).map_err(|e| Error::invalid_file(self.weights.origin(), format!("quantizing `{name}`: {e}"))));
        self.weights.store_quantized(self.module_path(), [w?, scales?, biases?]);
        Ok(Some(params))
    }

    /// Bits and group size from the tensor shapes, when config.json is silent.
    fn infer_params(&self, in_features: i32) -> Option<QuantParams> {
        let packed = self.weights.get(&self.path("weight")).ok()?.shape();
        let groups = self.weights.get(&self.path("scales")).ok()?.shape();
        let (packed, groups) = (*packed.last()?, *groups.last()?);
        (packed > 0 && groups > 0 && in_features % groups == 0)
            .then(|| QuantParams { bits: packed * 32 / in_features, group_size: in_features / groups })
    }
}
