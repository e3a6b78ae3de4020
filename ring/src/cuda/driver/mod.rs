//! The CUDA driver layer: the only code in ringscope that calls the CUDA driver or NVRTC (through cudarc's `sys` and
//! `result` modules), maps their errors, and owns raw handles. Everything above it — the device-ring protocol
//! ([`super::ring`]), the capture kernels' host side (`ringscope-hookpoint`), the facade — is safe Rust over the
//! types here; a test (`ring/tests/layering.rs`) fails if any other file names cudarc.
//!
//! The layering follows cudarc's own: raw calls, error mapping ([`CudaError`]) and RAII owners ([`Stream`],
//! [`Event`], [`DeviceBuffer`], [`PinnedBuffer`], [`Graph`], [`Module`]) live together, and unsafe does not leak
//! upward except through `unsafe fn`s with a `# Safety` section:
//!
//! * Handles and addresses that come from outside (an engine's `CUstream`, a tensor's `data_ptr()`) enter through
//!   [`StreamRef::from_raw`] and [`DevicePtr::from_raw`]. The runtime checks stay on top of those promises:
//!   [`Gpu::check_stream`] (the stream belongs to our context) and [`Gpu::check_device_range`] (device memory of
//!   our device, aligned, inside one allocation).
//! * Kernel launches ([`Function::launch`]) and asynchronous copies that touch host memory
//!   ([`PinnedBuffer::copy_from_device_async`], [`DeviceBuffer::copy_from_pinned_async`]) are `unsafe`: the driver
//!   cannot check a kernel's argument list, and the host must not touch pinned bytes a copy is still moving.
//!
//! Always compiled; the driver is loaded at run time. Without a driver or a device, [`Gpu::open`] returns
//! [`CudaError::NoDriver`] / [`CudaError::NoDevice`] — never a panic (cudarc panics on the first call into a
//! missing library, so every entry point probes first).

mod gpu;
mod memory;
mod module;
mod stream;

pub use gpu::Gpu;
pub use memory::{DeviceBuffer, DevicePtr, PinnedBuffer};
pub use module::{compile_ptx, Function, Module};
pub use stream::{Event, ForeignStream, Graph, Stream, StreamRef};

use cudarc::driver::DriverError;

/// A CUDA failure or a bad argument, naming the call or the argument.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded.
    #[error(
        "no CUDA driver: libcuda.so.1 could not be loaded (no NVIDIA driver on this machine?); use the host backend"
    )]
    NoDriver,
    /// NVRTC could not be loaded.
    #[error("NVRTC could not be loaded: libnvrtc.so (CUDA 13) must be on the library path; it ships with the CUDA toolkit (targets/x86_64-linux/lib) and in PyTorch's nvidia/cu13/lib")]
    NoNvrtc,
    /// The device ordinal does not exist.
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoDevice {
        /// Ordinal asked for.
        ordinal: usize,
        /// Devices visible.
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed: {error}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error.
        error: DriverError,
    },
    /// Kernel compilation failed.
    #[error("NVRTC could not compile ringscope's kernels: {0}")]
    Compile(String),
    /// An argument is unusable (null or misaligned pointer, wrong device, stream of another context, ...).
    #[error("{0}")]
    Invalid(String),
}

/// Adds the driver call's name to its error.
pub(crate) trait DriverResult<T> {
    /// Names the call.
    fn call(self, call: &'static str) -> Result<T, CudaError>;
}

impl<T> DriverResult<T> for Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T, CudaError> {
        self.map_err(|error| CudaError::Driver { call, error })
    }
}
