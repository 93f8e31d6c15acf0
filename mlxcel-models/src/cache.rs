//! KV caches. Models borrow them for a forward pass; the engine owns them.

use mlx_sys::kernels::KvWindow;
use mlx_sys::{Array, Dtype, Result};

/// The layout a fused kernel writes into: `[1, kv_heads, capacity, head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    pub kv_heads: i32,
    pub head_dim: i32,
    pub dtype: Dtype,
}

/// Writes `length` new positions into the key and value buffers at `offset`
/// and returns the buffers with them written (see [`KvCache::append_with`]).
pub type AppendWriter<'a> = dyn FnMut(&Array, &Array, usize) -> Result<(Array, Array)> + 'a;

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
    /// Appends `length` positions through `write`, for fused kernels that
    /// write the cache in place: `write` gets the key and value buffers
    /// (`layout`, capacity at least `offset + length`) and the offset, and
    /// returns the buffers with the new positions written. The buffers are
    /// the cache's own: nothing else reads them at positions `>= offset`, so
    /// the kernel may write them in place. Returns false,
    /// without calling `write`, when this cache cannot hand out its buffers;
    /// on an error the cache is unchanged.
    fn append_with(&mut self, length: usize, layout: CacheLayout, write: &mut AppendWriter<'_>) -> Result<bool> {
        let Some((keys, values, offset)) = self.append_buffers(length, layout)? else { return Ok(false) };
        let (keys, values) = write(&keys, &values, offset)?;
        self.commit_append(keys, values, length);
        Ok(true)
    }
    /// The two halves of [`append_with`](Self::append_with), for a kernel that
    /// writes several caches in one node: the key and value buffers
    /// (`layout`, capacity at least `offset + length`) and the offset, or
    /// None when this cache cannot hand out its buffers. The cache is
    /// unchanged until [`commit_append`](Self::commit_append).
    fn append_buffers(&mut self, _length: usize, _layout: CacheLayout) -> Result<Option<(Array, Array, usize)>> {
        Ok(None)
    }
    /// Takes back the buffers from [`append_buffers`](Self::append_buffers)
    /// with `length` new positions written at its offset.
    fn commit_append(&mut self, _keys: Array, _values: Array, _length: usize) {}
    /// Appends `k`/`v` ([1, kv_heads, L, D]) and returns causal attention of
    /// `q` ([1, heads, L, D]) over every cached position the layer's `window`
    /// shows (`KvWindow::ALL`: all of them), for caches that attend
    /// themselves (paged ones, whose kernels read the blocks in place); None,
    /// with the cache unchanged, for the others.
    fn attend(&mut self, _q: &Array, _k: &Array, _v: &Array, _scale: f32, _window: KvWindow) -> Result<Option<Array>> {
        Ok(None)
    }
    /// This cache as a paged one, for the kernels that serve several rows
    /// of one pool in a node.
    fn as_paged(&mut self) -> Option<&mut crate::paged::PagedKvCache> {
        None
    }
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

    /// A cache whose first positions are those of `keys` and `values` in
    /// order (each [1, kv_heads, n_i, head_dim]), copied once into buffers
    /// with room to grow (capacity n + 1 rounded up to the growth step).
    pub fn with_prefix_parts(keys: &[Array], values: &[Array]) -> Result<Self> {
        let n: i32 = keys.iter().map(|a| a.dim(2)).sum();
        let room = (n + Self::STEP) / Self::STEP * Self::STEP - n;
        let grown = |parts: &[Array]| -> Result<Array> {
            let s = parts[0].shape();
            let mut all = parts.to_vec();
            all.push(Array::zeros(&[s[0], s[1], room, s[3]], parts[0].dtype())?);
            mlx_sys::concatenate(&all, 2)
        };
        Ok(StandardKvCache { keys: Some(grown(keys)?), values: Some(grown(values)?), offset: n as usize })
    }
}

fn grow(buffer: Option<&Array>, template: &Array, needed: i32) -> Result<Array> {
    let shape = template.shape();
    grow_to(buffer, [shape[0], shape[1], shape[3]], template.dtype(), needed)
}

/// `buffer` followed by room for at least `needed` more positions of `[b, h, _, d]`.
fn grow_to(buffer: Option<&Array>, [b, h, d]: [i32; 3], dtype: Dtype, needed: i32) -> Result<Array> {
    let extra = (needed + StandardKvCache::STEP - 1) / StandardKvCache::STEP * StandardKvCache::STEP;
    let zeros = Array::zeros(&[b, h, extra, d], dtype)?;
    match buffer {
        Some(existing) => mlx_sys::concatenate(&[existing.clone(), zeros], 2),
        None => Ok(zeros),
    }
}

impl KvCache for StandardKvCache {
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let previous = self.offset as i32;
        let length = keys.dim(2);
        if previous + length > self.capacity() {
            let (k, v) = self.used()?;
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

    fn append_buffers(&mut self, length: usize, layout: CacheLayout) -> Result<Option<(Array, Array, usize)>> {
        let fits = |a: &Array| {
            a.ndim() == 4 && a.dim(0) == 1 && a.dim(1) == layout.kv_heads && a.dim(3) == layout.head_dim
                && a.dtype() == layout.dtype
        };
        if !self.keys.iter().chain(self.values.iter()).all(fits) {
            return Ok(None);
        }
        let length = length as i32;
        let (keys, values) = match (&self.keys, &self.values) {
            (Some(k), Some(v)) if self.offset as i32 + length <= self.capacity() => (k.clone(), v.clone()),
            _ => {
                let (k, v) = self.used()?;
                let dims = [1, layout.kv_heads, layout.head_dim];
                (grow_to(k.as_ref(), dims, layout.dtype, length)?, grow_to(v.as_ref(), dims, layout.dtype, length)?)
            }
        };
        Ok(Some((keys, values, self.offset)))
    }

    fn commit_append(&mut self, keys: Array, values: Array, length: usize) {
        // The old buffers are now referenced only by the kernel's node, so it
        // can write them in place.
        self.keys = Some(keys);
        self.values = Some(values);
        self.offset += length;
    }
}

impl StandardKvCache {
    fn capacity(&self) -> i32 {
        self.keys.as_ref().map_or(0, |k| k.dim(2))
    }

    /// The buffers cut to the cached positions (dropping the unused tail
    /// before growing keeps them dense).
    fn used(&self) -> Result<(Option<Array>, Option<Array>)> {
        let previous = self.offset as i32;
        let trim = |a: &Option<Array>| -> Result<Option<Array>> { a.as_ref().map(|a| a.slice_axis(2, 0, previous)).transpose() };
        Ok((trim(&self.keys)?, trim(&self.values)?))
    }
}
