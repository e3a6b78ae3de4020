//! The ring protocol, CUDA backend: the ring lives in device memory, capture kernels publish into it, and a drain
//! moves it to the host through pinned memory.
//!
//! Always compiled; the CUDA driver is loaded at run time. Without a driver or a device, [`Gpu::open`] returns
//! [`CudaError::NoDriver`] / [`CudaError::NoDevice`] — never a panic.
//!
//! # Who owns what
//!
//! * **Device state block** (device memory, [`state`] offsets): `head` (bytes written by capture kernels) and `seq`
//!   (next sequence number), stored only by capture kernels in stream order; `tail` (bytes the drain has copied
//!   out), stored only by the drain's stream; `tail_snap`, a copy of `tail` refreshed at stream-ordered points (the
//!   begin-step kernel and each publishing capture) so that every block of one capture kernel sees the same value.
//! * **Host block** (pinned memory mapped into the device, [`host`] offsets): `head` (published bytes: written by
//!   the last block of a capture kernel after a system-scope fence), `progress` (begin-step kernels that ran), and
//!   error bits. The host polls it with plain loads: no CUDA call and no device-memory read per step.
//! * The drain copies `[tail, head)` to a pinned (not write-combined) staging buffer with the same layout as the
//!   ring, in chunks on its own stream; after each chunk it writes the new `tail` to the device on that stream
//!   (stream-ordered after the copy), so ring space goes back to the kernels without the host waiting.
//!
//! Records never wrap (pad records, as on the host), so a record is contiguous in the ring and in staging.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, DriverError};
use parking_lot::{Condvar, Mutex};

use crate::error::{DecodeError, SourceError};
use crate::host::{CAPACITY_ALIGN, MIN_CAPACITY};
use crate::record::{RecordHeader, RecordKind, RecordView, HEADER_LEN};
use crate::RecordSource;

/// Byte offsets in the device state block. `hookpoint/kernels/capture.cu` uses the same numbers.
pub mod state {
    /// `u64`: bytes written by capture kernels (published or about to be, within one kernel).
    pub const HEAD: usize = 0;
    /// `u64`: sequence number of the next data record.
    pub const SEQ: usize = 8;
    /// `u64`: bytes copied out by the drain (written by the drain's stream).
    pub const TAIL: usize = 64;
    /// `u64`: the copy of `TAIL` that capture kernels decide on.
    pub const TAIL_SNAP: usize = 128;
    /// `u32`: blocks of the running capture kernel that finished.
    pub const DONE_BLOCKS: usize = 136;
    /// `u32`: blocks of the running begin-step kernel that finished.
    pub const BEGIN_DONE: usize = 140;
    /// `u32`: 1 while a capture kernel runs (set by its block 0, cleared by its publishing block).
    pub const BUSY: usize = 144;
    /// `u64`: the step number a step begun inside a graph takes (one past the last step begun).
    pub const NEXT_STEP: usize = 152;
    /// Size of the block.
    pub const BYTES: usize = 256;
}

/// Byte offsets in the host (mapped) block. `hookpoint/kernels/capture.cu` uses the same numbers.
pub mod host {
    /// `u64`: bytes published (every record below it is complete and visible).
    pub const HEAD: usize = 0;
    /// `u64`: number of begin-step kernels that ran (all work issued before them is done).
    pub const PROGRESS: usize = 64;
    /// `u32`: error bits ([`super::errors`]).
    pub const ERRORS: usize = 128;
    /// Size of the block.
    pub const BYTES: usize = 256;
}

/// Error bits a kernel sets in the host block.
pub mod errors {
    /// Two capture kernels of one ring ran concurrently (captures were issued on more than one stream).
    pub const CONCURRENT_PRODUCERS: u32 = 1;
    /// Full mode: a capture found the ring full although `begin_step` had reserved space (a hookpoint was
    /// captured more than once in a step, or captures ran without a `begin_step`). The record was dropped, counted.
    pub const FULL_MODE_OVERRUN: u32 = 2;

    /// Describes a set of error bits.
    pub fn describe(bits: u32) -> String {
        let mut out = Vec::new();
        if bits & CONCURRENT_PRODUCERS != 0 {
            out.push("capture kernels of one ring ran concurrently: issue every capture of a session on one stream");
        }
        if bits & FULL_MODE_OVERRUN != 0 {
            out.push("full mode: a capture found the ring full despite begin_step's reservation (capture each hookpoint at most once per step, after begin_step)");
        }
        out.join("; ")
    }
}

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
pub trait DriverResult<T> {
    /// Names the call.
    fn call(self, call: &'static str) -> Result<T, CudaError>;
}

impl<T> DriverResult<T> for Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T, CudaError> {
        self.map_err(|error| CudaError::Driver { call, error })
    }
}

/// A raw CUDA stream handle (`CUstream`) owned by the engine, e.g. PyTorch's
/// `torch.cuda.current_stream().cuda_stream`. `StreamHandle(0)` is the legacy default stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct StreamHandle(pub u64);

impl StreamHandle {
    /// The handle as the driver API takes it.
    pub fn raw(self) -> sys::CUstream {
        self.0 as usize as sys::CUstream
    }
}

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
        // SAFETY: only probes whether the library can be loaded.
        if !unsafe { sys::is_culib_present() } {
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

    /// The raw context handle.
    pub fn cu_ctx(&self) -> sys::CUcontext {
        self.ctx.cu_ctx()
    }

    /// Checks that `stream` belongs to this device's context (the null stream always does).
    pub fn check_stream(&self, stream: StreamHandle) -> Result<(), CudaError> {
        let stream = stream.raw();
        if stream.is_null() {
            return Ok(());
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; an invalid stream handle makes the driver return an error.
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
    pub fn is_capturing(&self, stream: StreamHandle) -> Result<bool, CudaError> {
        let stream = stream.raw();
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `status` is a valid out-pointer.
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) }.result().call("cuStreamIsCapturing")?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Checks that `[ptr, ptr + len)` is device memory of this device, aligned to `align`.
    pub fn check_device_range(&self, what: &str, ptr: u64, len: usize, align: usize) -> Result<(), CudaError> {
        if ptr == 0 {
            return Err(CudaError::Invalid(format!("{what}: null device pointer")));
        }
        if ptr % align as u64 != 0 {
            return Err(CudaError::Invalid(format!(
                "{what}: device pointer {ptr:#x} is not aligned to {align} bytes (the element size)"
            )));
        }
        let attr = |a: sys::CUpointer_attribute, out: *mut c_void| {
            // SAFETY: `out` points to storage of the size the attribute returns (checked per call site below).
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

    /// Waits for all work issued on this device's context.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        result::ctx::synchronize().call("cuCtxSynchronize")
    }

    /// Makes this thread's CUDA calls invisible to other threads' stream captures ("relaxed" capture mode), so a
    /// background thread (the drain) never invalidates an engine's graph capture.
    pub fn relax_capture_mode_on_this_thread(&self) -> Result<(), CudaError> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid in/out pointer.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result().call("cuThreadExchangeStreamCaptureMode")
    }
}

/// Device memory from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1) of zeroed device memory.
    pub fn zeroed(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer, CudaError> {
        gpu.bind()?;
        // SAFETY: plain allocation; freed in Drop.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.call("cuMemAlloc")?;
        let buf = DeviceBuffer { gpu: gpu.clone(), ptr, len };
        // SAFETY: `ptr` is a fresh allocation of `len` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, len.max(1)) }.call("cuMemsetD8")?;
        Ok(buf)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` into the buffer at `offset`, stream-ordered on `stream`. The source is pageable host memory
    /// that the driver stages before returning, so it may be reused at once.
    pub fn copy_from_host_async(&self, offset: usize, src: &[u8], stream: StreamHandle) -> Result<(), CudaError> {
        if offset.checked_add(src.len()).is_none_or(|end| end > self.len) {
            return Err(CudaError::Invalid(format!(
                "copy of {} bytes at offset {offset} into a {}-byte device buffer",
                src.len(),
                self.len
            )));
        }
        // SAFETY: the range lies in our allocation (checked above).
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, src, stream.raw()) }.call("cuMemcpyHtoDAsync")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by `cuMemAlloc` in `zeroed`; the owner synchronised any work using it.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop. Never write-combined (the host reads it).
#[derive(Debug)]
pub struct PinnedBuffer {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
    device_ptr: Option<u64>,
}

// SAFETY: the buffer is plain memory owned by this value; access is synchronised by its users.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above; shared access goes through atomics or the drain's protocol.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` zeroed bytes; `mapped` also maps them into the device's address space.
    pub fn zeroed(gpu: &Arc<Gpu>, len: usize, mapped: bool) -> Result<PinnedBuffer, CudaError> {
        gpu.bind()?;
        let flags = if mapped { sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE } else { 0 };
        // SAFETY: plain allocation; freed in Drop.
        let ptr = unsafe { result::malloc_host(len.max(1), flags) }.call("cuMemHostAlloc")?.cast::<u8>();
        // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        let mut buf = PinnedBuffer { gpu: gpu.clone(), ptr, len, device_ptr: None };
        if mapped {
            let mut dptr: sys::CUdeviceptr = 0;
            // SAFETY: `ptr` was allocated with DEVICEMAP.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0) }
                .result()
                .call("cuMemHostGetDevicePointer")?;
            buf.device_ptr = Some(dptr);
        }
        Ok(buf)
    }

    /// Host address.
    pub fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Device address of a mapped buffer.
    pub fn device_ptr(&self) -> Option<u64> {
        self.device_ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `u64` at byte `offset`, as an atomic (the device writes it; the host loads it).
    pub fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(offset % 8 == 0 && offset + 8 <= self.len, "u64 slot {offset} out of a {}-byte buffer", self.len);
        // SAFETY: in bounds, 8-aligned (the allocation is page-aligned), and lives as long as `self`.
        unsafe { AtomicU64::from_ptr(self.ptr.add(offset).cast()) }
    }

    /// The `u32` at byte `offset`, as an atomic.
    pub fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(offset % 4 == 0 && offset + 4 <= self.len, "u32 slot {offset} out of a {}-byte buffer", self.len);
        // SAFETY: in bounds, 4-aligned, and lives as long as `self`.
        unsafe { AtomicU32::from_ptr(self.ptr.add(offset).cast()) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc`; the owner synchronised any copy into or out of it.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// The addresses a capture kernel needs, fixed for the ring's lifetime (so they can be baked into CUDA graphs).
#[derive(Debug, Clone, Copy)]
pub struct RingAddrs {
    /// Ring bytes (device).
    pub buf: u64,
    /// Ring capacity in bytes.
    pub capacity: u64,
    /// Device state block.
    pub state: u64,
    /// Host block, as a device address.
    pub host: u64,
}

/// A ring in device memory plus its state blocks. Shared by the capture side and the drain.
#[derive(Debug)]
pub struct DeviceRing {
    gpu: Arc<Gpu>,
    capacity: usize,
    buf: DeviceBuffer,
    state: DeviceBuffer,
    host: PinnedBuffer,
    /// Bytes copied out by the drain and handed back to the device (the device's `tail` is at least this).
    released: AtomicU64,
    producer_closed: AtomicBool,
    consumer_alive: AtomicBool,
    space_lock: Mutex<()>,
    space: Condvar,
}

impl DeviceRing {
    /// Allocates a ring of `capacity` bytes on `gpu` (a multiple of 128, at least 256).
    pub fn new(gpu: &Arc<Gpu>, capacity: usize) -> Result<Arc<DeviceRing>, CudaError> {
        if capacity < MIN_CAPACITY || capacity % CAPACITY_ALIGN != 0 {
            return Err(CudaError::Invalid(format!(
                "ring capacity {capacity} bytes is invalid: it must be a multiple of {CAPACITY_ALIGN} and at least \
                 {MIN_CAPACITY} bytes"
            )));
        }
        Ok(Arc::new(DeviceRing {
            gpu: gpu.clone(),
            capacity,
            buf: DeviceBuffer::zeroed(gpu, capacity)?,
            state: DeviceBuffer::zeroed(gpu, state::BYTES)?,
            host: PinnedBuffer::zeroed(gpu, host::BYTES, true)?,
            released: AtomicU64::new(0),
            producer_closed: AtomicBool::new(false),
            consumer_alive: AtomicBool::new(true),
            space_lock: Mutex::new(()),
            space: Condvar::new(),
        }))
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Largest record payload this ring takes (half the capacity minus the header), as on the host backend.
    pub fn max_payload_len(&self) -> usize {
        self.capacity / 2 - HEADER_LEN
    }

    /// Addresses for the kernels.
    pub fn addrs(&self) -> RingAddrs {
        RingAddrs {
            buf: self.buf.ptr(),
            capacity: self.capacity as u64,
            state: self.state.ptr(),
            host: self.host.device_ptr().expect("the host block is mapped"),
        }
    }

    /// Bytes published by capture kernels (a plain load of host memory).
    pub fn published(&self) -> u64 {
        self.host.u64_at(host::HEAD).load(Ordering::Acquire)
    }

    /// Begin-step kernels that ran.
    pub fn progress(&self) -> u64 {
        self.host.u64_at(host::PROGRESS).load(Ordering::Acquire)
    }

    /// Error bits set by kernels ([`errors`]).
    pub fn error_bits(&self) -> u32 {
        self.host.u32_at(host::ERRORS).load(Ordering::Acquire)
    }

    /// Bytes handed back to the device by the drain.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Acquire)
    }

    /// Waits until the drain has handed back at least `position` bytes, or `deadline`. Returns whether it did, and
    /// fails when the drain is gone.
    pub fn wait_released(&self, position: u64, deadline: Instant) -> Result<bool, CudaError> {
        let mut guard = self.space_lock.lock();
        loop {
            if self.released() >= position {
                return Ok(true);
            }
            if !self.consumer_alive.load(Ordering::Acquire) {
                return Err(CudaError::Invalid("the ring's drain is gone: nothing will free space again".into()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            // The timeout is a backstop; the drain notifies after each completed chunk.
            self.space.wait_until(&mut guard, deadline.min(now + Duration::from_millis(2)));
        }
    }

    /// Tells the drain that no capture will be issued any more (after the engine's work has completed): it stops
    /// once everything published is drained.
    pub fn close_producer(&self) {
        self.producer_closed.store(true, Ordering::Release);
    }

    /// Whether the drain side is still there.
    pub fn consumer_alive(&self) -> bool {
        self.consumer_alive.load(Ordering::Acquire)
    }

    fn set_released(&self, position: u64) {
        self.released.store(position, Ordering::Release);
        let _guard = self.space_lock.lock();
        self.space.notify_all();
    }
}

/// How the drain moves bytes.
#[derive(Debug, Clone, Copy)]
pub struct DrainTuning {
    /// Largest single D2H copy. Smaller chunks let an engine's own copies slip in between (the copy engine serves
    /// streams in turn); larger ones need fewer calls.
    pub chunk_bytes: usize,
    /// Copies in flight at once.
    pub max_in_flight: usize,
}

impl Default for DrainTuning {
    fn default() -> Self {
        DrainTuning { chunk_bytes: 4 << 20, max_in_flight: 8 }
    }
}

struct InFlight {
    end: u64,
    event: sys::CUevent,
}

/// What a device drain did so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceDrainStats {
    /// Bytes copied device → host.
    pub bytes_copied: u64,
    /// Whether ring space is handed back with stream memory operations (else with 8-byte copies).
    pub stream_write_value: bool,
    /// D2H copies issued.
    pub copies: u64,
}

/// The drain end of a [`DeviceRing`]: copies published bytes to pinned staging and hands records out in order.
/// Use it from one thread (the exporter's drain thread).
pub struct DeviceConsumer {
    ring: Arc<DeviceRing>,
    tuning: DrainTuning,
    stream: sys::CUstream,
    staging: PinnedBuffer,
    /// One 64-byte slot per event: the `tail` value its HtoD copy reads.
    tail_slots: PinnedBuffer,
    events: Vec<sys::CUevent>,
    free_events: Vec<usize>,
    in_flight: VecDeque<(usize, InFlight)>,
    submitted: u64,
    completed: u64,
    parsed: u64,
    pending: Option<usize>,
    expected_seq: u64,
    thread_ready: bool,
    /// Whether `cuStreamWriteValue64` works here (`None`: not tried yet).
    write_value: Option<bool>,
    stats: DeviceDrainStats,
}

// SAFETY: the raw stream and event handles are owned by this value and used from one thread at a time (`&mut`).
unsafe impl Send for DeviceConsumer {}

impl DeviceConsumer {
    /// Creates the drain end: its own stream, a pinned staging buffer as large as the ring, and events.
    pub fn new(ring: &Arc<DeviceRing>, tuning: DrainTuning) -> Result<DeviceConsumer, CudaError> {
        if tuning.chunk_bytes < 64 || tuning.chunk_bytes % 64 != 0 || tuning.max_in_flight == 0 {
            return Err(CudaError::Invalid(format!(
                "drain tuning {tuning:?}: chunk_bytes must be a positive multiple of 64, max_in_flight at least 1"
            )));
        }
        let gpu = ring.gpu();
        gpu.bind()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking).call("cuStreamCreate")?;
        let mut events = Vec::with_capacity(tuning.max_in_flight);
        for _ in 0..tuning.max_in_flight {
            events.push(result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).call("cuEventCreate")?);
        }
        Ok(DeviceConsumer {
            ring: ring.clone(),
            tuning,
            stream,
            staging: PinnedBuffer::zeroed(gpu, ring.capacity(), false)?,
            tail_slots: PinnedBuffer::zeroed(gpu, 64 * tuning.max_in_flight, false)?,
            free_events: (0..tuning.max_in_flight).rev().collect(),
            events,
            in_flight: VecDeque::new(),
            submitted: 0,
            completed: 0,
            parsed: 0,
            pending: None,
            expected_seq: 0,
            thread_ready: false,
            write_value: None,
            stats: DeviceDrainStats::default(),
        })
    }

    /// The drain's own stream.
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    /// Totals so far.
    pub fn stats(&self) -> DeviceDrainStats {
        DeviceDrainStats { stream_write_value: self.write_value == Some(true), ..self.stats }
    }

    /// Sequence number the next record must carry.
    pub fn expected_seq(&self) -> u64 {
        self.expected_seq
    }

    /// Collects finished copies (handing their ring space back) and issues new ones. Never waits on the device.
    pub fn pump(&mut self) -> Result<(), CudaError> {
        if !self.thread_ready {
            self.ring.gpu().bind()?;
            self.ring.gpu().relax_capture_mode_on_this_thread()?;
            self.thread_ready = true;
        }
        while let Some((slot, f)) = self.in_flight.front() {
            // SAFETY: the event was created by us and recorded on our stream.
            match unsafe { result::event::query(f.event) } {
                Ok(()) => {
                    self.completed = f.end;
                    self.free_events.push(*slot);
                    self.in_flight.pop_front();
                    self.ring.set_released(self.completed);
                }
                Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => break,
                Err(e) => return Err(CudaError::Driver { call: "cuEventQuery", error: e }),
            }
        }
        let cap = self.ring.capacity() as u64;
        let head = self.ring.published();
        let addrs = self.ring.addrs();
        while self.submitted < head && self.submitted < self.parsed + cap {
            let Some(slot) = self.free_events.pop() else { break };
            let offset = self.submitted % cap;
            let len = (head - self.submitted)
                .min(self.tuning.chunk_bytes as u64)
                .min(cap - offset)
                .min(self.parsed + cap - self.submitted);
            // SAFETY: `[offset, offset + len)` lies in both the ring and the staging buffer (same size); the staging
            // range is not being read (it is at or past `parsed + cap - cap`), and the ring range is published.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    self.staging.host_ptr().add(offset as usize).cast(),
                    addrs.buf + offset,
                    len as usize,
                    self.stream,
                )
            }
            .result()
            .call("cuMemcpyDtoHAsync")?;
            self.submitted += len;
            // Hand the space back to the device once the copy has run: stream-ordered, no host wait.
            self.write_tail(slot, addrs.state + state::TAIL as u64)?;
            let event = self.events[slot];
            // SAFETY: our event, our stream.
            unsafe { result::event::record(event, self.stream) }.call("cuEventRecord")?;
            self.in_flight.push_back((slot, InFlight { end: self.submitted, event }));
            self.stats.bytes_copied += len;
            self.stats.copies += 1;
        }
        Ok(())
    }

    /// Writes `submitted` to the device `tail` on our stream, after the copies before it. A stream memory operation
    /// when the driver has them (no copy-engine round trip between chunks), else an 8-byte copy from pinned memory.
    fn write_tail(&mut self, slot: usize, tail_addr: u64) -> Result<(), CudaError> {
        if self.write_value != Some(false) {
            // SAFETY: `tail_addr` is the device `tail` word of our ring; the operation is stream-ordered.
            let r = unsafe { sys::cuStreamWriteValue64_v2(self.stream, tail_addr, self.submitted, 0) }.result();
            match (r, self.write_value) {
                (Ok(()), _) => {
                    self.write_value = Some(true);
                    return Ok(());
                }
                (Err(_), None) => self.write_value = Some(false),
                (Err(error), _) => return Err(CudaError::Driver { call: "cuStreamWriteValue64", error }),
            }
        }
        self.tail_slots.u64_at(slot * 64).store(self.submitted, Ordering::Relaxed);
        // SAFETY: the slot is ours until its event completes; the destination is the device `tail` word.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(tail_addr, self.tail_slots.host_ptr().add(slot * 64).cast(), 8, self.stream)
        }
        .result()
        .call("cuMemcpyHtoDAsync")
    }

    /// Bytes published and not yet handed out as records.
    pub fn backlog(&self) -> u64 {
        self.ring.published() - self.parsed
    }

    /// Returns the next complete record in staging, without consuming it; `None` when none is complete yet.
    pub fn peek_record(&mut self) -> Result<Option<RecordView<'_>>, SourceError> {
        if self.pending.is_none() {
            self.pump().map_err(|e| SourceError::Device(e.to_string()))?;
        }
        let cap = self.ring.capacity() as u64;
        loop {
            let available = self.completed - self.parsed;
            if available < HEADER_LEN as u64 {
                return Ok(None);
            }
            let offset = (self.parsed % cap) as usize;
            let contiguous = (available as usize).min(cap as usize - offset);
            // SAFETY: `[parsed, completed)` has been copied into staging and no copy writes it until `parsed` moves
            // past it (submissions stay below `parsed + cap`); the slice borrows `self`.
            let bytes = unsafe { std::slice::from_raw_parts(self.staging.host_ptr().add(offset), contiguous) };
            let header = RecordHeader::decode(bytes)?;
            let footprint = header.footprint();
            if footprint > contiguous {
                if offset + footprint > cap as usize {
                    return Err(DecodeError::Inconsistent(format!(
                        "record at ring offset {offset} with footprint {footprint} runs past the end of the ring"
                    ))
                    .into());
                }
                return Ok(None); // the rest of the record is still being copied
            }
            if header.kind == RecordKind::Pad {
                self.parsed += footprint as u64;
                continue;
            }
            if header.seq != self.expected_seq {
                return Err(DecodeError::SequenceGap { expected: self.expected_seq, found: header.seq }.into());
            }
            let (view, _) = RecordView::decode(&bytes[..footprint])?;
            self.pending = Some(footprint);
            return Ok(Some(view));
        }
    }

    /// Moves past the record returned by the last peek.
    pub fn advance_record(&mut self) {
        if let Some(footprint) = self.pending.take() {
            self.parsed += footprint as u64;
            self.expected_seq += 1;
        }
    }

    /// True when the producer is closed and every published byte has been handed out.
    pub fn finished(&self) -> bool {
        self.ring.producer_closed.load(Ordering::Acquire)
            && self.in_flight.is_empty()
            && self.parsed == self.ring.published()
    }
}

impl RecordSource for DeviceConsumer {
    fn peek(&mut self) -> Result<Option<RecordView<'_>>, SourceError> {
        self.peek_record()
    }

    fn advance(&mut self) {
        self.advance_record();
    }

    fn is_finished(&mut self) -> bool {
        if self.pump().is_err() {
            return true;
        }
        self.finished()
    }
}

impl Drop for DeviceConsumer {
    fn drop(&mut self) {
        self.ring.consumer_alive.store(false, Ordering::Release);
        {
            let _guard = self.ring.space_lock.lock();
            self.ring.space.notify_all();
        }
        if self.ring.gpu().bind().is_ok() {
            // Copies in flight write into `staging`: wait for them before it is freed.
            // SAFETY: our stream and events; nothing uses them after this.
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                for e in &self.events {
                    let _ = result::event::destroy(*e);
                }
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

/// A CUDA stream owned by ringscope (engines pass their own raw handles instead).
#[derive(Debug)]
pub struct Stream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread of its context.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises operations on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream on `gpu`.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Stream, CudaError> {
        gpu.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).call("cuStreamCreate")?;
        Ok(Stream { gpu: gpu.clone(), raw })
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The handle, as engines pass streams to ringscope.
    pub fn handle(&self) -> StreamHandle {
        StreamHandle(self.raw as usize as u64)
    }

    /// Waits for everything issued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: our stream.
        unsafe { result::stream::synchronize(self.raw) }.call("cuStreamSynchronize")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: our stream; pending work completes first.
            unsafe {
                let _ = result::stream::synchronize(self.raw);
                let _ = result::stream::destroy(self.raw);
            }
        }
    }
}

/// An instantiated CUDA graph recorded from a stream.
#[derive(Debug)]
pub struct Graph {
    gpu: Arc<Gpu>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles may be used from any thread of their context.
unsafe impl Send for Graph {}

impl Graph {
    /// Records everything `record` issues on `stream` (global capture mode, as PyTorch uses) into a graph.
    pub fn capture<E: From<CudaError>>(stream: &Stream, record: impl FnOnce() -> Result<(), E>) -> Result<Graph, E> {
        stream.gpu.bind()?;
        // SAFETY: our stream.
        unsafe { result::stream::begin_capture(stream.raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }
            .call("cuStreamBeginCapture")?;
        let recorded = record();
        // SAFETY: the capture begun above; ending it is required even when recording failed.
        let graph = unsafe { result::stream::end_capture(stream.raw) }.call("cuStreamEndCapture");
        recorded?;
        let graph = graph?;
        // SAFETY: a complete graph from the capture above.
        let exec = match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => exec,
            Err(error) => {
                // SAFETY: ours, unused.
                let _ = unsafe { result::graph::destroy(graph) };
                return Err(CudaError::Driver { call: "cuGraphInstantiate", error }.into());
            }
        };
        Ok(Graph { gpu: stream.gpu.clone(), graph, exec })
    }

    /// Launches the graph on `stream`.
    pub fn launch(&self, stream: StreamHandle) -> Result<(), CudaError> {
        // SAFETY: our instantiated graph; the caller's stream handle is checked by the driver.
        unsafe { result::graph::launch(self.exec, stream.raw()) }.call("cuGraphLaunch")
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: ours; launches already issued keep their own reference in the driver.
            unsafe {
                let _ = result::graph::exec_destroy(self.exec);
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}
