//! Evaluation, devices and streams.

use crate::array::{array_list, Array};
use crate::error::Result;
use crate::ffi;

/// Computes every array in `arrays` and waits for the results.
pub fn eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    Ok(ffi::eval(&array_list(arrays))?)
}

/// Schedules the computation of `arrays` and returns at once; reading them
/// (or calling [`eval`]) waits for the results.
pub fn async_eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    Ok(ffi::async_eval(&array_list(arrays))?)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Device {
    fn is_gpu(self) -> bool {
        self == Device::Gpu
    }

    /// Whether this build of MLX has the device (Metal or CUDA for `Gpu`).
    pub fn is_available(self) -> Result<bool> {
        match self {
            Device::Cpu => Ok(true),
            Device::Gpu => Ok(ffi::is_gpu_available()?),
        }
    }

    /// The default device of new operations.
    pub fn default_device() -> Device {
        if ffi::default_device_is_gpu() { Device::Gpu } else { Device::Cpu }
    }

    pub fn set_default(self) -> Result<()> {
        Ok(ffi::set_default_device(self.is_gpu())?)
    }
}

/// A queue of work on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    id: ffi::StreamId,
}

impl Stream {
    /// The current thread's default stream on `device`.
    pub fn default_for(device: Device) -> Result<Stream> {
        Ok(Stream { id: ffi::default_stream(device.is_gpu())? })
    }

    pub fn new(device: Device) -> Result<Stream> {
        Ok(Stream { id: ffi::new_stream(device.is_gpu())? })
    }

    pub fn device(&self) -> Device {
        if self.id.gpu { Device::Gpu } else { Device::Cpu }
    }

    /// Makes this stream the current thread's default for its device.
    pub fn set_default(&self) -> Result<()> {
        Ok(ffi::set_default_stream(self.id)?)
    }

    /// Waits until all work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        Ok(ffi::synchronize(self.id)?)
    }
}
