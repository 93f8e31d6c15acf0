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

/// [`clear_cache`], then hands the C heap's free pages back to the system
/// (glibc's `malloc_trim`; MLX's CPU buffers come from malloc, and freed
/// ones below the top of the heap would otherwise stay resident).
pub fn release_free_memory() -> crate::Result<()> {
    clear_cache()?;
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim only returns free memory to the system.
        unsafe { malloc_trim(0) };
    }
    Ok(())
}
