//! CTranslate2's `model.bin` (binary version 6, what CTranslate2 3.x and 4.x
//! write): a header naming the model spec and its revision, the variables
//! (name, shape, data type, bytes), then aliases (a name for another
//! variable's data, e.g. Whisper's `decoder/projection/weight`). Integers
//! are little-endian; strings are a u16 length (counting a trailing NUL) and
//! the bytes. The file is memory-mapped; nothing is copied until asked.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;

use crate::error::{Error, Result};

/// The binary version this reader understands.
pub const BINARY_VERSION: u32 = 6;

/// A variable's element type, numbered as CTranslate2's `DataType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    F32,
    I8,
    I16,
    I32,
    F16,
    BF16,
}

impl DataType {
    fn from_id(id: u8) -> Option<DataType> {
        Some(match id {
            0 => DataType::F32,
            1 => DataType::I8,
            2 => DataType::I16,
            3 => DataType::I32,
            4 => DataType::F16,
            5 => DataType::BF16,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            DataType::I8 => 1,
            DataType::I16 | DataType::F16 | DataType::BF16 => 2,
            DataType::F32 | DataType::I32 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "float32",
            DataType::I8 => "int8",
            DataType::I16 => "int16",
            DataType::I32 => "int32",
            DataType::F16 => "float16",
            DataType::BF16 => "bfloat16",
        }
    }
}

/// One variable of the file: where its bytes are.
#[derive(Debug, Clone)]
pub struct Variable {
    pub shape: Vec<usize>,
    pub dtype: DataType,
    offset: usize,
    len: usize,
}

impl Variable {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A memory-mapped `model.bin`.
pub struct Ct2File {
    path: PathBuf,
    map: Mmap,
    /// The model spec's name, e.g. `WhisperSpec`.
    pub spec: String,
    pub revision: u32,
    variables: BTreeMap<String, Variable>,
    aliases: BTreeMap<String, String>,
}

struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or_else(|| {
            Error::invalid(self.path, format!("truncated: {what} needs {n} bytes at offset {} of {}", self.at, self.bytes.len()))
        })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u16(what)? as usize;
        let path = self.path;
        let raw = self.take(n, what)?;
        let text = raw.strip_suffix(&[0]).ok_or_else(|| Error::invalid(path, format!("{what} is not NUL-terminated")))?;
        String::from_utf8(text.to_vec()).map_err(|_| Error::invalid(path, format!("{what} is not UTF-8")))
    }
}

impl Ct2File {
    /// Opens `path`: a `model.bin`, or a directory holding one.
    pub fn open(path: &Path) -> Result<Ct2File> {
        let path = if path.is_dir() { path.join("model.bin") } else { path.to_path_buf() };
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: read-only map; the file is not modified while mapped (a
        // concurrent writer could change the bytes, never memory safety of
        // the slices we hand out beyond their values).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let mut c = Cursor { path: &path, bytes: &map, at: 0 };
        if map.is_empty() {
            return Err(Error::invalid(&path, "empty file (not a CTranslate2 model.bin)"));
        }
        let version = c.u32("the binary version")?;
        if version != BINARY_VERSION {
            return Err(Error::unsupported(
                &path,
                format!("binary version {version}: mlxcel reads CTranslate2 model.bin version {BINARY_VERSION} (CTranslate2 3.x and 4.x); is this a CTranslate2 model?"),
            ));
        }
        let spec = c.string("the spec name")?;
        let revision = c.u32("the spec revision")?;
        let count = c.u32("the variable count")? as usize;
        let mut variables = BTreeMap::new();
        for i in 0..count {
            let what = format!("variable {i}");
            let name = c.string(&what)?;
            let rank = c.u8(&name)? as usize;
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                shape.push(c.u32(&name)? as usize);
            }
            let type_id = c.u8(&name)?;
            let dtype = DataType::from_id(type_id)
                .ok_or_else(|| Error::invalid(&path, format!("variable `{name}` has unknown data type {type_id}")))?;
            let len = c.u32(&name)? as usize;
            let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
            if elements.and_then(|n| n.checked_mul(dtype.size())) != Some(len) {
                return Err(Error::invalid(
                    &path,
                    format!("variable `{name}`: {len} bytes for shape {shape:?} of {}", dtype.name()),
                ));
            }
            let offset = c.at;
            c.take(len, &format!("the data of `{name}`"))?;
            variables.insert(name, Variable { shape, dtype, offset, len });
        }
        let alias_count = c.u32("the alias count")? as usize;
        let mut aliases = BTreeMap::new();
        for i in 0..alias_count {
            let alias = c.string(&format!("alias {i}"))?;
            let target = c.string(&format!("the target of alias `{alias}`"))?;
            if !variables.contains_key(&target) {
                return Err(Error::invalid(&path, format!("alias `{alias}` names `{target}`, which is not a variable")));
            }
            aliases.insert(alias, target);
        }
        if c.at != map.len() {
            return Err(Error::invalid(&path, format!("{} unexpected bytes after the aliases", map.len() - c.at)));
        }
        Ok(Ct2File { path, map, spec, revision, variables, aliases })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Variable names, sorted (aliases not included).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.variables.keys().map(String::as_str)
    }

    pub fn aliases(&self) -> impl Iterator<Item = (&str, &str)> {
        self.aliases.iter().map(|(a, t)| (a.as_str(), t.as_str()))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.variables.contains_key(name) || self.aliases.contains_key(name)
    }

    /// The variable `name` (or the one an alias `name` points to).
    pub fn get(&self, name: &str) -> Result<&Variable> {
        let name = self.aliases.get(name).map(String::as_str).unwrap_or(name);
        self.variables
            .get(name)
            .ok_or_else(|| Error::MissingVariable { path: self.path.clone(), variable: name.to_string() })
    }

    /// The raw little-endian bytes of `name`.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let v = self.get(name)?;
        Ok(&self.map[v.offset..v.offset + v.len])
    }

    /// `name` as float32 values (from float32, float16 or bfloat16).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>> {
        let v = self.get(name)?;
        let bytes = self.bytes(name)?;
        Ok(match v.dtype {
            DataType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
            DataType::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            DataType::BF16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(Error::unsupported(
                    &self.path,
                    format!("variable `{name}` is {}, not a float (quantized CTranslate2 models are not supported; use the float16 model)", other.name()),
                ))
            }
        })
    }

    /// A scalar integer variable (CTranslate2 stores flags and head counts so).
    pub fn scalar(&self, name: &str) -> Result<i64> {
        let v = self.get(name)?;
        let b = self.bytes(name)?;
        if v.elements() != 1 {
            return Err(Error::invalid(&self.path, format!("variable `{name}` has shape {:?}, expected a scalar", v.shape)));
        }
        Ok(match v.dtype {
            DataType::I8 => b[0] as i8 as i64,
            DataType::I16 => i16::from_le_bytes([b[0], b[1]]) as i64,
            DataType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as i64,
            other => {
                return Err(Error::invalid(&self.path, format!("variable `{name}` is {}, expected an integer scalar", other.name())))
            }
        })
    }
}
