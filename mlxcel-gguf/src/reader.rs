//! GGUF (v2, v3) reader: header, metadata, tensor infos and memory-mapped tensor data.
//!
//! Every read is bounds-checked: a truncated or corrupt file gives an
//! [`Error::InvalidFile`] naming the file, never a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::ggml_type::GgmlType;
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer (or bool) that fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            Value::Bool(v) => Some(v.into()),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Any number, as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Byte length of the data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Row-major shape (outermost first), as safetensors / MLX write it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// `(rows, cols)` with all outer dimensions folded into rows.
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = self.dims.first().copied().unwrap_or(1) as usize;
        let rows = self.dims.iter().skip(1).product::<u64>() as usize;
        (rows, cols)
    }
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Absolute byte offset of the tensor data section.
    pub data_offset: u64,
    mmap: Mmap,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; like every mmap-based model loader we
        // assume the file is not truncated by another process while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut cursor = Cursor {
            bytes: &mmap,
            pos: 0,
            path,
        };

        let magic = cursor.take(4, "magic")?;
        if magic != MAGIC {
            return Err(Error::invalid_file(
                path,
                format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"),
            ));
        }
        let version = cursor.u32("version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(unsupported(
                    path,
                    "GGUF version 1 (re-convert with a newer llama.cpp)",
                ))
            }
            v if matches!(v.swap_bytes(), 2 | 3) => {
                return Err(unsupported(path, "big-endian GGUF files"))
            }
            v => {
                return Err(Error::invalid_file(
                    path,
                    format!("unknown GGUF version {v}"),
                ))
            }
        }
        let tensor_count = cursor.u64("tensor count")?;
        let kv_count = cursor.u64("metadata count")?;

        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = cursor.string("metadata key")?;
            let ty = cursor.u32("metadata type")?;
            let value = cursor.value(ty, &key, 0)?;
            metadata.insert(key, value);
        }

        let mut tensors = Vec::with_capacity(cursor.capacity_hint(tensor_count, 24));
        for _ in 0..tensor_count {
            tensors.push(cursor.tensor_info()?);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(Error::invalid_file(
                        path,
                        format!("invalid general.alignment {v:?}"),
                    ))
                }
            },
        };
        let data_offset = (cursor.pos as u64).div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        for t in &tensors {
            if t.offset % alignment != 0 {
                return Err(Error::invalid_file(
                    path,
                    format!(
                        "tensor `{}`: offset {} is not aligned to {alignment}",
                        t.name, t.offset
                    ),
                ));
            }
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|end| end > file_len) {
                return Err(Error::invalid_file(
                    path,
                    format!(
                        "tensor `{}`: data ({} bytes at offset {}) runs past the end of the file \
                         ({file_len} bytes); the file is truncated or corrupt",
                        t.name, t.n_bytes, t.offset
                    ),
                ));
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            data_offset,
            mmap,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(Value::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Option<&[Value]> {
        self.get(key).and_then(Value::as_array)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (bounds were checked by [`GgufFile::open`]).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.mmap[start..start + info.n_bytes as usize]
    }
}

fn unsupported(path: &Path, what: &str) -> Error {
    Error::Unsupported {
        path: path.to_path_buf(),
        message: what.to_string(),
    }
}

/// Maximum nesting of metadata arrays (the format allows arrays of arrays).
const MAX_DEPTH: usize = 8;
/// Maximum tensor rank (GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn truncated(&self, what: &str, need: u64) -> Error {
        Error::invalid_file(
            self.path,
            format!(
                "truncated GGUF header: reading {what} needs {need} bytes at offset {}, file has {}",
                self.pos,
                self.bytes.len()
            ),
        )
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(self.truncated(what, n));
        }
        let slice = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("take returns N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        // Some vocabularies hold invalid UTF-8 pieces; keep them readable rather than fail.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    /// A capacity that a corrupt count cannot blow up: at most what the rest of the file can hold.
    fn capacity_hint(&self, count: u64, min_item_bytes: u64) -> usize {
        let remaining = (self.bytes.len() - self.pos) as u64;
        count.min(remaining / min_item_bytes.max(1)) as usize
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = key;
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(Error::invalid_file(
                        self.path,
                        format!("metadata `{key}`: invalid bool byte {b}"),
                    ))
                }
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(Error::invalid_file(
                        self.path,
                        format!("metadata `{key}`: arrays nested too deeply"),
                    ));
                }
                let item_ty = self.u32(what)?;
                let len = self.u64(what)?;
                let mut items = Vec::with_capacity(self.capacity_hint(len, 1));
                for _ in 0..len {
                    items.push(self.value(item_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            t => {
                return Err(Error::invalid_file(
                    self.path,
                    format!("metadata `{key}`: unknown value type {t}"),
                ))
            }
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo> {
        let name = self.string("tensor name")?;
        let n_dims = self.u32("tensor rank")?;
        if n_dims > MAX_DIMS {
            return Err(Error::invalid_file(
                self.path,
                format!("tensor `{name}`: rank {n_dims} > {MAX_DIMS}"),
            ));
        }
        let dims = (0..n_dims)
            .map(|_| self.u64("tensor dims"))
            .collect::<Result<Vec<_>>>()?;
        let type_id = self.u32("tensor type")?;
        let offset = self.u64("tensor offset")?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
            Error::invalid_file(
                self.path,
                format!("tensor `{name}`: unknown GGML type {type_id}"),
            )
        })?;
        let n_bytes = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| {
                // Rows must hold whole blocks.
                let row_ok = dims
                    .first()
                    .is_none_or(|&d0| d0.is_multiple_of(ggml_type.block_size() as u64));
                row_ok.then(|| ggml_type.bytes_for(n)).flatten()
            })
            .ok_or_else(|| {
                Error::invalid_file(
                    self.path,
                    format!("tensor `{name}`: invalid shape {dims:?} for type {ggml_type}"),
                )
            })?;
        Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
        })
    }
}
