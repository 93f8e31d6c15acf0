//! KV caches. Models borrow them for a forward pass; the engine owns them.

use mlx_sys::{Array, Result};

/// The protocol every KV cache variant follows (standard, rotating,
/// quantized, paged).
pub trait KvCache: Send {
    /// Appends `keys`/`values` ([B, H, L, D]) and returns all cached keys and
    /// values so far, including the new ones.
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)>;
    /// Number of positions cached.
    fn offset(&self) -> usize;
    /// Drops the last `n` positions; returns how many were dropped.
    fn trim(&mut self, n: usize) -> usize;
    /// The cached keys and values, for evaluation between prefill chunks.
    fn state(&self) -> Vec<Array>;
    /// Bytes held by the cache buffers.
    fn nbytes(&self) -> usize;
}

/// A growable cache: buffers grow in steps of `STEP` positions and new
/// entries are written in place with `slice_update`.
#[derive(Default)]
pub struct StandardKvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: usize,
}

impl StandardKvCache {
    const STEP: i32 = 256;

    pub fn new() -> Self {
        Self::default()
    }
}

fn grow(buffer: Option<&Array>, template: &Array, needed: i32) -> Result<Array> {
    let shape = template.shape();
    let (b, h, d) = (shape[0], shape[1], shape[3]);
    let extra = (needed + StandardKvCache::STEP - 1) / StandardKvCache::STEP * StandardKvCache::STEP;
    let zeros = Array::zeros(&[b, h, extra, d], template.dtype())?;
    match buffer {
        Some(existing) => mlx_sys::concatenate(&[existing.clone(), zeros], 2),
        None => Ok(zeros),
    }
}

impl KvCache for StandardKvCache {
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let previous = self.offset as i32;
        let length = keys.dim(2);
        let capacity = self.keys.as_ref().map_or(0, |k| k.dim(2));
        if previous + length > capacity {
            // Drop the unused tail before growing so the buffer stays dense.
            let trim = |a: &Option<Array>| -> Result<Option<Array>> {
                a.as_ref().map(|a| a.slice_axis(2, 0, previous)).transpose()
            };
            let (k, v) = (trim(&self.keys)?, trim(&self.values)?);
            self.keys = Some(grow(k.as_ref(), keys, length)?);
            self.values = Some(grow(v.as_ref(), values, length)?);
        }
        let end = previous + length;
        let write = |buffer: &Array, update: &Array| -> Result<Array> {
            let s = buffer.shape();
            buffer.slice_update(update, &[0, 0, previous, 0], &[s[0], s[1], end, s[3]], &[1, 1, 1, 1])
        };
        let k = write(self.keys.as_ref().unwrap(), keys)?;
        let v = write(self.values.as_ref().unwrap(), values)?;
        self.offset = end as usize;
        let fetched = (k.slice_axis(2, 0, end)?, v.slice_axis(2, 0, end)?);
        self.keys = Some(k);
        self.values = Some(v);
        Ok(fetched)
    }

    fn offset(&self) -> usize {
        self.offset
    }

    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    fn state(&self) -> Vec<Array> {
        self.keys.iter().chain(self.values.iter()).cloned().collect()
    }

    fn nbytes(&self) -> usize {
        self.state().iter().map(Array::nbytes).sum()
    }
}
