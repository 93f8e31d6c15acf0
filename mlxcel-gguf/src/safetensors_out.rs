//! A streaming safetensors writer: the header is written from a plan of tensor sizes,
//! then each tensor's bytes in plan order, so only one tensor is in memory at a time.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Map};

use crate::error::{Error, Result};

/// One tensor of the file, before its data exists.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    /// safetensors dtype: `F32`, `F16`, `BF16`, `U32`.
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub n_bytes: u64,
}

pub struct SafetensorsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    specs: Vec<TensorSpec>,
    next: usize,
    bytes_written: u64,
}

impl SafetensorsWriter {
    /// Creates `path` and writes the header for `specs` (data must follow in the same order).
    pub fn create(path: &Path, specs: Vec<TensorSpec>) -> Result<Self> {
        let mut header = Map::new();
        header.insert("__metadata__".into(), json!({"format": "mlx"}));
        let mut offset = 0u64;
        for s in &specs {
            let end = offset + s.n_bytes;
            header.insert(
                s.name.clone(),
                json!({"dtype": s.dtype, "shape": s.shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut header = serde_json::to_vec(&header).expect("JSON of strings and numbers");
        header.resize(header.len().div_ceil(8) * 8, b' ');

        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let io = |e| Error::io(path, e);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        out.write_all(&header).map_err(io)?;
        Ok(SafetensorsWriter {
            path: path.to_path_buf(),
            out,
            specs,
            next: 0,
            bytes_written: 8 + header.len() as u64,
        })
    }

    /// Writes the data of the next tensor of the plan.
    pub fn write_next(&mut self, data: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::invalid_file(
                &self.path,
                "internal error: more tensors written than planned",
            )
        })?;
        if data.len() as u64 != spec.n_bytes {
            return Err(Error::invalid_file(
                &self.path,
                format!(
                    "internal error: tensor `{}` has {} bytes, planned {}",
                    spec.name,
                    data.len(),
                    spec.n_bytes
                ),
            ));
        }
        self.out
            .write_all(data)
            .map_err(|e| Error::io(&self.path, e))?;
        self.bytes_written += data.len() as u64;
        self.next += 1;
        Ok(())
    }

    /// Flushes and syncs; returns the file size.
    pub fn finish(mut self) -> Result<u64> {
        if self.next != self.specs.len() {
            return Err(Error::invalid_file(
                &self.path,
                "internal error: fewer tensors written than planned",
            ));
        }
        self.out.flush().map_err(|e| Error::io(&self.path, e))?;
        let file = self
            .out
            .into_inner()
            .map_err(|e| Error::io(&self.path, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&self.path, e))?;
        Ok(self.bytes_written)
    }
}
