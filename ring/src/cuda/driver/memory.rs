//! Device memory ([`DeviceBuffer`]), page-locked host memory ([`PinnedBuffer`]), the copies between them, and
//! [`DevicePtr`], the checked form in which an engine's device addresses enter ringscope.

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use cudarc::driver::{result, sys};

use super::{CudaError, DriverResult, Gpu, StreamRef};

/// A device address handed to ringscope: the start of a tensor that a capture kernel reads (or a test kernel
/// writes), a scalar it reads at replay time, an engine's batch tensor.
///
/// Made from a raw address only through [`DevicePtr::from_raw`] (or from ringscope's own [`DeviceBuffer`]); every
/// call that takes one still checks it at run time ([`Gpu::check_device_range`]: not null, device memory of the
/// session's device, aligned, inside one allocation). Deliberately without arithmetic: an offset could step into
/// another allocation the caller made no promise about ([`DeviceBuffer::ptr_at`] offsets inside a buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DevicePtr(u64);

impl DevicePtr {
    /// The null address: rejected by every call that reads through it; where a call documents it, it means "none".
    pub const NULL: DevicePtr = DevicePtr(0);

    /// Wraps a raw device address, e.g. PyTorch's `tensor.data_ptr()`.
    ///
    /// # Safety
    /// `addr` is 0, or an address that is not device memory of the session's device (both are rejected at run time
    /// before anything is launched), or an address in a device allocation such that:
    /// * ringscope may read — and where the call says so (`fill_pattern`), write — the range the call is given,
    ///   without racing the engine's own writes to it (the engine orders them on the capture's stream);
    /// * the allocation stays allocated until every kernel that ringscope launches with it has run, including
    ///   every replay of a CUDA graph the launch was recorded into, and, for deferred captures, until the step's
    ///   end (`end_step`) has run.
    pub const unsafe fn from_raw(addr: u64) -> DevicePtr {
        DevicePtr(addr)
    }

    /// The address, as the driver and kernels take it.
    pub const fn addr(self) -> u64 {
        self.0
    }

    /// True for [`DevicePtr::NULL`].
    pub const fn is_null(self) -> bool {
        self.0 == 0
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
    /// Allocates `len` bytes (at least 1) of device memory, zeroed by the time this returns.
    ///
    /// The zeroing runs on a private stream that this call waits for. Not `cuMemsetD8`: on device memory it is
    /// asynchronous to the host and ordered on the legacy default stream, which non-blocking streams (ringscope's,
    /// PyTorch's side streams, a graph's recording stream) do not wait for — a copy into the buffer issued on one of
    /// them right after could run first and then be zeroed (issue 28: fused probes' weights uploaded that way were
    /// zeroed under a busy engine, and their scores were wrong on every replay).
    pub fn zeroed(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer, CudaError> {
        let buf = DeviceBuffer::allocate(gpu, len)?;
        let stream = super::Stream::new(gpu)?;
        // SAFETY: a fresh allocation of at least `len.max(1)` bytes that nothing else knows of yet; the stream is
        // ours and live.
        unsafe { result::memset_d8_async(buf.ptr, 0, len.max(1), stream.stream_ref().raw()) }
            .call("cuMemsetD8Async")?;
        stream.synchronize()?;
        Ok(buf)
    }

    /// `len` bytes (at least 1) of uninitialised device memory, freed when dropped.
    fn allocate(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer, CudaError> {
        gpu.bind()?;
        // SAFETY: plain allocation; freed in Drop.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.call("cuMemAlloc")?;
        Ok(DeviceBuffer { gpu: gpu.clone(), ptr, len })
    }

    /// Allocates a buffer holding `bytes` (a copy), on the device by the time this returns (a private stream, waited
    /// for): work issued afterwards on any stream reads these bytes.
    pub fn from_host(gpu: &Arc<Gpu>, bytes: &[u8]) -> Result<DeviceBuffer, CudaError> {
        let buf = DeviceBuffer::allocate(gpu, bytes.len())?;
        if bytes.is_empty() {
            return Ok(buf);
        }
        let stream = super::Stream::new(gpu)?;
        buf.copy_from_host_async(0, bytes, stream.handle())?;
        // The copy reads pageable memory (staged by the driver); waiting for the stream is what makes the bytes
        // visible to work on other streams.
        stream.synchronize()?;
        Ok(buf)
    }

    /// The device address. Freeing the buffer (dropping it) waits for work already issued on the device
    /// (`cuMemFree` synchronises), but a CUDA graph recorded with this address must not be replayed after the
    /// buffer is gone.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr(self.ptr)
    }

    /// The device address `offset` bytes into the buffer (`offset` at most its length).
    ///
    /// # Panics
    /// When `offset` is past the end of the buffer.
    pub fn ptr_at(&self, offset: usize) -> DevicePtr {
        assert!(offset <= self.len, "offset {offset} is past the end of a {}-byte device buffer", self.len);
        DevicePtr(self.ptr + offset as u64)
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check_range(&self, what: &str, offset: usize, len: usize) -> Result<(), CudaError> {
        check_range("device", self.len, what, offset, len)
    }

    /// Copies `src` into the buffer at `offset`, stream-ordered on `stream`. The source is pageable host memory
    /// that the driver stages before returning, so it may be reused at once.
    pub fn copy_from_host_async(&self, offset: usize, src: &[u8], stream: StreamRef) -> Result<(), CudaError> {
        if offset.checked_add(src.len()).is_none_or(|end| end > self.len) {
            return Err(CudaError::Invalid(format!(
                "copy of {} bytes at offset {offset} into a {}-byte device buffer",
                src.len(),
                self.len
            )));
        }
        // SAFETY: the range lies in our allocation (checked above); the stream is live per `StreamRef`'s contract.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, src, stream.raw()) }.call("cuMemcpyHtoDAsync")
    }

    /// Copies `len` bytes from `src` (pinned memory, from `src_offset`) into the buffer at `offset`, stream-ordered
    /// on `stream`.
    ///
    /// # Safety
    /// The copy reads `src` when the stream reaches it, not now: nobody may write `[src_offset, src_offset + len)`
    /// of `src` until the copy has completed (an event recorded after it, or a stream synchronisation, says when),
    /// and `src` must outlive it.
    pub unsafe fn copy_from_pinned_async(
        &self,
        offset: usize,
        src: &PinnedBuffer,
        src_offset: usize,
        len: usize,
        stream: &StreamRef,
    ) -> Result<(), CudaError> {
        self.check_range("copy from pinned memory", offset, len)?;
        src.check_range("copy to device memory", src_offset, len)?;
        // SAFETY: both ranges are checked to lie in their allocations; the caller keeps the source unchanged and
        // alive until the copy has run.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.ptr + offset as u64, src.ptr.add(src_offset).cast(), len, stream.raw())
        }
        .result()
        .call("cuMemcpyHtoDAsync")
    }

    /// Copies the first `len` bytes of `src` to the start of this buffer, stream-ordered on `stream`.
    pub fn copy_from_device_async(&self, src: &DeviceBuffer, len: usize, stream: &StreamRef) -> Result<(), CudaError> {
        self.check_range("device-to-device copy", 0, len)?;
        src.check_range("device-to-device copy", 0, len)?;
        // SAFETY: both ranges are device allocations of at least `len` bytes (checked above).
        unsafe { result::memcpy_dtod_async(self.ptr, src.ptr, len, stream.raw()) }.call("cuMemcpyDtoDAsync")
    }

    /// Writes the `u64` at byte `offset` with a stream memory operation (`cuStreamWriteValue64`), stream-ordered on
    /// `stream`: no copy engine round trip. Fails where the driver or device does not support stream memory
    /// operations; callers fall back to [`copy_from_pinned_async`](Self::copy_from_pinned_async).
    pub fn write_u64_async(&self, offset: usize, value: u64, stream: &StreamRef) -> Result<(), CudaError> {
        self.check_range("stream write of a u64", offset, 8)?;
        if !offset.is_multiple_of(8) {
            return Err(CudaError::Invalid(format!("stream write of a u64 at unaligned offset {offset}")));
        }
        // SAFETY: an aligned word of our allocation (checked above); the operation is stream-ordered.
        unsafe { sys::cuStreamWriteValue64_v2(stream.raw(), self.ptr + offset as u64, value, 0) }
            .result()
            .call("cuStreamWriteValue64")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by `cuMemAlloc` in `zeroed`; `cuMemFree` waits for work already issued to use it.
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

    /// Device address of a mapped buffer, in the form kernels launched by ringscope take it (`None` when the buffer
    /// is not mapped). Like [`DeviceBuffer::ptr`]: a CUDA graph recorded with it must not be replayed after the
    /// buffer is gone.
    pub fn mapped_ptr(&self) -> Option<DevicePtr> {
        self.device_ptr.map(DevicePtr)
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check_range(&self, what: &str, offset: usize, len: usize) -> Result<(), CudaError> {
        check_range("pinned", self.len, what, offset, len)
    }

    /// The bytes `[offset, offset + len)`.
    ///
    /// # Safety
    /// No copy or kernel writes the range while the slice lives (the drain's protocol, or an event, says when a
    /// copy into it has completed).
    ///
    /// # Panics
    /// When the range is not inside the buffer.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "range out of a pinned buffer");
        // SAFETY: in bounds (checked above), alive as long as `self`; no concurrent writer per the caller.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }

    /// The bytes `[offset, offset + len)`, writable.
    ///
    /// # Safety
    /// Nothing else reads or writes the range while the slice lives: no other slice of it, no copy or kernel (the
    /// device reading a mapped buffer counts).
    ///
    /// # Panics
    /// When the range is not inside the buffer.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "range out of a pinned buffer");
        // SAFETY: in bounds (checked above), alive as long as `self`; exclusive per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) }
    }

    /// Copies `len` bytes from `src` (from `src_offset`) into this buffer at `offset`, stream-ordered on `stream`.
    ///
    /// # Safety
    /// The copy writes this buffer when the stream reaches it, not now: nobody may read or write
    /// `[offset, offset + len)` until the copy has completed (an event recorded after it, or a stream
    /// synchronisation, says when), and the buffer must outlive the copy.
    pub unsafe fn copy_from_device_async(
        &self,
        offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
        stream: &StreamRef,
    ) -> Result<(), CudaError> {
        self.check_range("copy from device memory", offset, len)?;
        src.check_range("copy to pinned memory", src_offset, len)?;
        // SAFETY: both ranges lie in their allocations (checked above); the caller keeps the destination untouched
        // and alive until the copy has run.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.ptr.add(offset).cast(), src.ptr + src_offset as u64, len, stream.raw())
        }
        .result()
        .call("cuMemcpyDtoHAsync")
    }

    /// The `u64` at byte `offset`, as an atomic (the device writes it; the host loads it).
    pub fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.len,
            "u64 slot {offset} out of a {}-byte buffer",
            self.len
        );
        // SAFETY: in bounds, 8-aligned (the allocation is page-aligned), and lives as long as `self`.
        unsafe { AtomicU64::from_ptr(self.ptr.add(offset).cast()) }
    }

    /// The whole buffer as `u64` words (`len / 8` of them), as atomics: for tables that a kernel writes through the
    /// mapping while host threads read and write them (e.g. per-request flags).
    pub fn u64_words(&self) -> &[AtomicU64] {
        // SAFETY: the allocation is page-aligned and holds `len` bytes, so `len / 8` aligned words, alive as long as
        // `self`; `AtomicU64` has the size and alignment of `u64`, and every host access goes through the atomics.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<AtomicU64>(), self.len / 8) }
    }

    /// The `u32` at byte `offset`, as an atomic.
    pub fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "u32 slot {offset} out of a {}-byte buffer",
            self.len
        );
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

/// Checks that `[offset, offset + len)` lies in a `kind` buffer of `size` bytes.
fn check_range(kind: &str, size: usize, what: &str, offset: usize, len: usize) -> Result<(), CudaError> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(CudaError::Invalid(format!(
            "{what} of {len} bytes at offset {offset} of a {size}-byte {kind} buffer"
        )));
    }
    Ok(())
}
