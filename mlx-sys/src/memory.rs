//! MLX's allocator counters and limits (bytes).

use crate::ffi;

/// Bytes held by live arrays.
pub fn active_memory() -> usize {
    ffi::get_active_memory()
}

/// The high-water mark of [`active_memory`] since the last reset.
pub fn peak_memory() -> usize {
    ffi::get_peak_memory()
}

pub fn reset_peak_memory() {
    ffi::reset_peak_memory()
}

/// Bytes held in the allocator's cache of freed buffers.
pub fn cache_memory() -> usize {
    ffi::get_cache_memory()
}

/// Sets the buffer-cache limit and returns the previous one.
pub fn set_cache_limit(limit: usize) -> crate::Result<usize> {
    Ok(ffi::set_cache_limit(limit)?)
}

/// Sets the memory limit and returns the previous one.
pub fn set_memory_limit(limit: usize) -> crate::Result<usize> {
    Ok(ffi::set_memory_limit(limit)?)
}

pub fn clear_cache() -> crate::Result<()> {
    Ok(ffi::clear_cache()?)
}
