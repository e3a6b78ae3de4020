//! [`Gpu`]: one device and its primary context, and the runtime checks on what engines hand in.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use parking_lot::Mutex;

use super::{CudaError, DevicePtr, DriverResult, StreamRef};

/// One CUDA device and its primary context (the one PyTorch and most engines use).
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    capability: (i32, i32),
    sms: u32,
}

impl Gpu {
    /// Opens device `ordinal` (once per process: later calls return the same handle, which keeps the primary
    /// context and the loaded kernels alive). Returns a clear error when there is no driver or no such device.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        static OPEN: std::sync::OnceLock<Mutex<Vec<Option<Arc<Gpu>>>>> = std::sync::OnceLock::new();
        let mut open = OPEN.get_or_init(Default::default).lock();
        if let Some(Some(gpu)) = open.get(ordinal) {
            return Ok(gpu.clone());
        }
        let gpu = Gpu::open_uncached(ordinal)?;
        if open.len() <= ordinal {
            open.resize(ordinal + 1, None);
        }
        open[ordinal] = Some(gpu.clone());
        Ok(gpu)
    }

    fn open_uncached(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        result::init().call("cuInit")?;
        let count = result::device::get_count().call("cuDeviceGetCount")? as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).call("cuDevicePrimaryCtxRetain")?;
        // cudarc's event tracking adds cross-stream dependencies that break stream capture; ringscope orders its
        // own work.
        // SAFETY: no cudarc-managed allocations or streams of this context are used by ringscope.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().call("cuDeviceGetName")?;
        let capability = ctx.compute_capability().call("cuDeviceGetAttribute")?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .call("cuDeviceGetAttribute")? as u32;
        Ok(Arc::new(Gpu { ctx, ordinal, name, capability, sms }))
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().call("cuCtxSetCurrent")
    }

    /// Waits until every piece of work issued to this device's context, on any stream, has completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        result::ctx::synchronize().call("cuCtxSynchronize")
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Number of streaming multiprocessors.
    pub fn sms(&self) -> u32 {
        self.sms
    }

    /// The NVRTC architecture name, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.capability.0, self.capability.1)
    }

    /// Checks that `stream` belongs to this device's context (the null stream always does).
    pub fn check_stream(&self, stream: &StreamRef) -> Result<(), CudaError> {
        let stream = stream.raw();
        if stream.is_null() {
            return Ok(());
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; the handle is live per `StreamRef`'s contract, and an invalid one
        // makes the driver return an error.
        unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }
            .result()
            .map_err(|error| CudaError::Invalid(format!("stream {stream:p} is not a valid CUDA stream ({error})")))?;
        if ctx != self.cu_ctx() {
            return Err(CudaError::Invalid(format!(
                "stream {stream:p} belongs to another CUDA context (another device, or a non-primary context); \
                 ringscope's session lives on device {} (primary context)",
                self.ordinal
            )));
        }
        Ok(())
    }

    /// Whether `stream` is capturing into a CUDA graph now.
    pub fn is_capturing(&self, stream: &StreamRef) -> Result<bool, CudaError> {
        let stream = stream.raw();
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-pointer; the handle is live per `StreamRef`'s contract.
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) }.result().call("cuStreamIsCapturing")?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Checks that `[ptr, ptr + len)` is device memory of this device, inside one allocation, aligned to `align`.
    /// What it cannot check — that the memory stays allocated until the kernels using it have run — is the promise
    /// of [`DevicePtr::from_raw`].
    pub fn check_device_range(&self, what: &str, ptr: DevicePtr, len: usize, align: usize) -> Result<(), CudaError> {
        let ptr = ptr.addr();
        if ptr == 0 {
            return Err(CudaError::Invalid(format!("{what}: null device pointer")));
        }
        if !ptr.is_multiple_of(align as u64) {
            return Err(CudaError::Invalid(format!(
                "{what}: device pointer {ptr:#x} is not aligned to {align} bytes (the element size)"
            )));
        }
        let attr = |a: sys::CUpointer_attribute, out: *mut c_void| {
            // SAFETY: `out` points to storage of the size the attribute returns (checked per call site below); the
            // driver answers for any address, device memory or not.
            unsafe { sys::cuPointerGetAttribute(out, a, ptr) }.result()
        };
        let mut ordinal: i32 = -1;
        attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (&mut ordinal as *mut i32).cast())
            .map_err(|e| CudaError::Invalid(format!("{what}: {ptr:#x} is not CUDA device memory ({e})")))?;
        if ordinal as usize != self.ordinal {
            return Err(CudaError::Invalid(format!(
                "{what}: {ptr:#x} is memory of device {ordinal}, the session is on device {}",
                self.ordinal
            )));
        }
        let mut start: u64 = 0;
        let mut size: usize = 0;
        attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, (&mut start as *mut u64).cast())
            .call("cuPointerGetAttribute")?;
        attr(sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE, (&mut size as *mut usize).cast())
            .call("cuPointerGetAttribute")?;
        if ptr + len as u64 > start + size as u64 {
            return Err(CudaError::Invalid(format!(
                "{what}: {len} bytes from {ptr:#x} run past the end of its allocation ({size} bytes from {start:#x})"
            )));
        }
        Ok(())
    }

    /// Makes this thread's CUDA calls invisible to other threads' stream captures ("relaxed" capture mode), so a
    /// background thread (the drain) never invalidates an engine's graph capture.
    pub fn relax_capture_mode_on_this_thread(&self) -> Result<(), CudaError> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result().call("cuThreadExchangeStreamCaptureMode")
    }

    /// The context handle, for the driver layer's own checks.
    fn cu_ctx(&self) -> sys::CUcontext {
        self.ctx.cu_ctx()
    }
}

/// Whether `libcuda.so` can be loaded (cudarc panics on the first call into a missing library).
pub(super) fn driver_present() -> bool {
    // SAFETY: only probes whether the library can be loaded.
    unsafe { sys::is_culib_present() }
}
