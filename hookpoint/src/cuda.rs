//! HookPoints on the GPU: graph-capturable capture kernels that copy a device tensor's rows into a [`DeviceRing`].
//!
//! * [`DeviceCapture::begin_step`] runs once per engine step, **outside** any graph, on the engine's stream: it
//!   writes the step's batch descriptor (request id and position of every row) into a pinned slot and launches a
//!   one-block-per-4-KiB kernel that installs it at a fixed device address. In full mode it first waits, with a
//!   deadline, until the drain has freed room for everything the step can capture.
//! * [`DeviceCapture::capture`] launches one capture kernel on the caller's stream (e.g. PyTorch's current stream).
//!   It may be recorded into a CUDA graph: its arguments are fixed addresses; which rows, whether it samples this
//!   step, and where the record goes are read from device memory when the kernel runs.
//! * [`DeviceCapture::begin_step_graph`] instead records the step itself into the graph (best-effort): its batch is
//!   read from the engine's device tensors at every replay and its number comes from the device, so a replay needs
//!   no host call; [`DeviceCapture::apply_controls`] uploads control changes between replays.
//! * With [`DeviceCaptureOptions::defer`], `capture` only notes the tensor and [`DeviceCapture::end_step`] (or
//!   earlier, on a side stream, [`DeviceCapture::submit`]) copies all of the step's captures with one kernel.
//!
//! Kernels come from `kernels/capture.cu`, compiled with NVRTC once per process for the device's architecture.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use parking_lot::Mutex;
use ringscope_policy::{Count, DropReason, Tally};
use ringscope_ring::cuda::{CudaError, DeviceBuffer, DeviceRing, DriverResult, Gpu, PinnedBuffer, StreamHandle};
use ringscope_ring::record::{align_up, HEADER_LEN, ROW_META_LEN};

use crate::batch::StepBatch;
use crate::registry::{HookPoint, Registry, RowSelection};

/// The kernel source, compiled at run time.
pub const KERNEL_SOURCE: &str = include_str!("../kernels/capture.cu");

const THREADS: u32 = 256;
/// Pinned descriptor slots: `begin_step` may run this many steps ahead of the GPU before it waits.
const SLOTS: usize = 64;
/// Size of one hookpoint's control entry in device memory.
const CONTROL_BYTES: usize = 64;
/// Size of one hookpoint's counter block in device memory (16 × u64).
const COUNTER_WORDS: usize = 16;

/// Counter words written by the kernels (`C_*` in `capture.cu`).
mod counter {
    pub const PRODUCED: usize = 0;
    pub const SAMPLED: usize = 2;
    pub const PUBLISHED: usize = 4;
    pub const FULL: usize = 6;
    pub const TOO_LARGE: usize = 8;
    pub const DEADLINE: usize = 10;
}

/// Deferred captures one `ringscope_capture_many` kernel takes (`MAX_MANY` in `capture.cu`).
const MAX_MANY: usize = 48;
/// Bytes of the kernel's `Many` parameter: a 32-byte `GraphBatch`, two `u32`, `MAX_MANY` 24-byte entries.
const MANY_BYTES: usize = 40 + MAX_MANY * 24;

/// Descriptor header flag: the step's captures are dropped and counted as `deadline` (full mode, no room).
const DESC_DEADLINE: u32 = 1;

/// The compiled kernels, loaded into one context.
struct Kernels {
    capture: sys::CUfunction,
    begin: sys::CUfunction,
    begin_graph: sys::CUfunction,
    capture_many: sys::CUfunction,
    fill: sys::CUfunction,
    #[cfg_attr(not(feature = "bench-internals"), allow(dead_code))]
    discard: sys::CUfunction,
}

// SAFETY: function handles are plain identifiers valid in their context from any thread.
unsafe impl Send for Kernels {}
// SAFETY: as above.
unsafe impl Sync for Kernels {}

fn kernels(gpu: &Gpu) -> Result<Arc<Kernels>, CudaError> {
    static PTX: OnceLock<Mutex<HashMap<String, Arc<String>>>> = OnceLock::new();
    static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock();
    if let Some(k) = loaded.get(&gpu.ordinal()) {
        return Ok(k.clone());
    }
    let arch = gpu.arch();
    let ptx = {
        let mut cache = PTX.get_or_init(Default::default).lock();
        match cache.get(&arch) {
            Some(p) => p.clone(),
            None => {
                let p = Arc::new(compile_ptx(&arch)?);
                cache.insert(arch, p.clone());
                p
            }
        }
    };
    gpu.bind()?;
    let image = CString::new(ptx.as_str()).map_err(|e| CudaError::Compile(e.to_string()))?;
    // SAFETY: `image` is a NUL-terminated PTX string that outlives the call.
    let module = unsafe { result::module::load_data(image.as_ptr().cast()) }.call("cuModuleLoadData")?;
    let function = |name: &str| {
        // SAFETY: `module` was loaded above and is never unloaded (the kernels live for the process).
        unsafe { result::module::get_function(module, CString::new(name).expect("no NUL")) }.call("cuModuleGetFunction")
    };
    let k = Arc::new(Kernels {
        capture: function("ringscope_capture")?,
        begin: function("ringscope_begin_step")?,
        begin_graph: function("ringscope_begin_step_graph")?,
        capture_many: function("ringscope_capture_many")?,
        fill: function("ringscope_fill_pattern")?,
        discard: function("ringscope_discard_all")?,
    });
    loaded.insert(gpu.ordinal(), k.clone());
    Ok(k)
}

/// Compiles the kernels to PTX for `arch` (e.g. `sm_90`) with NVRTC. Needs only NVRTC, not a GPU.
pub fn compile_ptx(arch: &str) -> Result<String, CudaError> {
    // SAFETY: only probes whether the library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        // NVRTC wants a `&'static str`: one small string per architecture per process.
        arch: Some(Box::leak(arch.to_owned().into_boxed_str())),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts).map_err(|e| CudaError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

/// Launches `f` with `args` (each a pointer to the argument value).
///
/// # Safety
/// `args` must match the kernel's parameter list in number, order and size, and every device address among them
/// must stay valid until the kernel has run.
unsafe fn launch(
    f: sys::CUfunction,
    grid: u32,
    stream: sys::CUstream,
    args: &mut [*mut c_void],
    name: &'static str,
) -> Result<(), CudaError> {
    // SAFETY: per the caller's promise.
    unsafe { result::launch_kernel(f, (grid, 1, 1), (THREADS, 1, 1), 0, stream, args) }.call(name)
}

/// The word `i` of a pattern filled by [`DeviceCapture::fill_pattern`] with `seed` (for tests and benchmarks).
pub fn pattern_word(seed: u64, i: u64) -> u32 {
    let mut x = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x as u32
}

/// Options of the device capture side.
#[derive(Debug, Clone, Copy)]
pub struct DeviceCaptureOptions {
    /// Most rows in one step's batch (sizes the device descriptor).
    pub max_batch_rows: u32,
    /// Most hookpoints (sizes the device control and counter tables, which must not move once graphs use them).
    pub max_hookpoints: u32,
    /// `Some(deadline)`: full mode — `begin_step` waits up to `deadline` for room for the whole step.
    /// `None`: best-effort — kernels drop and count what does not fit.
    pub full_mode_deadline: Option<Duration>,
    /// Deferred captures: [`DeviceCapture::capture`] only checks and notes the tensor; [`DeviceCapture::end_step`]
    /// copies every capture of the step with one kernel. One kernel node per step instead of one per hookpoint (a
    /// node between an engine's kernels costs ~2–4 µs however little it does). The engine must leave every captured
    /// tensor unchanged until the step ends: true of out-of-place models such as Hugging Face's (whose hooks keep
    /// the tensors alive), not of engines that update the residual stream in place.
    pub defer: bool,
}

impl Default for DeviceCaptureOptions {
    fn default() -> Self {
        DeviceCaptureOptions { max_batch_rows: 8192, max_hookpoints: 1024, full_mode_deadline: None, defer: false }
    }
}

/// A step's batch as device tensors of the engine, for steps begun inside a CUDA graph
/// ([`DeviceCapture::begin_step_graph`]): the addresses are fixed when the graph is recorded, the values are read at
/// every replay. Each batch row is one request; row `b * seq + s` of a captured tensor is batch row `b`'s token `s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphBatch {
    /// Batch rows (requests).
    pub batch: u32,
    /// Tokens per batch row (1 for a decode step).
    pub seq: u32,
    /// Device `i64[batch]`: the request id of each batch row.
    pub request_ids: u64,
    /// Device `i64`: the position of token `s` of batch row `b` is element `b * positions_batch_stride + s`.
    pub positions: u64,
    /// Elements between batch rows in `positions`: `seq` for a contiguous `[batch, seq]` tensor (`position_ids`),
    /// 0 when every row shares one `[seq]` vector (`cache_position`).
    pub positions_batch_stride: u32,
}

impl GraphBatch {
    /// The kernels' `GraphBatch` parameter (32 bytes); `None` gives one that is off. `first`: this kernel is the
    /// first of its step, and numbers it (a later one of the same step reuses the number).
    fn param(batch: Option<&GraphBatch>, first: bool) -> [u8; 32] {
        let mut p = [0u8; 32];
        if let Some(g) = batch {
            p[0..8].copy_from_slice(&g.request_ids.to_le_bytes());
            p[8..16].copy_from_slice(&g.positions.to_le_bytes());
            p[16..20].copy_from_slice(&g.batch.to_le_bytes());
            p[20..24].copy_from_slice(&g.seq.to_le_bytes());
            p[24..28].copy_from_slice(&g.positions_batch_stride.to_le_bytes());
            p[28..32].copy_from_slice(&(if first { 1u32 } else { 2 }).to_le_bytes());
        }
        p
    }
}

/// One deferred capture (`struct Entry` in `capture.cu`).
#[derive(Debug, Clone, Copy)]
struct Deferred {
    src: u64,
    hookpoint: u32,
    dtype: u32,
    row_bytes: u32,
    src_rows: u32,
}

/// The device control entry of one hookpoint (`struct Control` in `capture.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct DeviceControl {
    enabled: u32,
    every_n: u32,
    mode: u32,
    list_len: u32,
    list_ptr: u64,
    valid_rows_ptr: u64,
    reserved: [u64; 4],
}

impl DeviceControl {
    fn to_bytes(self) -> [u8; CONTROL_BYTES] {
        let mut b = [0u8; CONTROL_BYTES];
        let words = [
            self.enabled as u64 | (self.every_n as u64) << 32,
            self.mode as u64 | (self.list_len as u64) << 32,
            self.list_ptr,
            self.valid_rows_ptr,
        ];
        for (k, w) in words.iter().enumerate() {
            b[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }
}

#[derive(Debug, Clone, Default)]
struct HostMirror {
    generation: u64,
    control: DeviceControl,
    row_bytes: u32,
    uploaded: bool,
}

/// The capture side of a CUDA session: kernels, device tables, descriptor slots. Drive it from one thread.
pub struct DeviceCapture {
    gpu: Arc<Gpu>,
    ring: Arc<DeviceRing>,
    kernels: Arc<Kernels>,
    options: DeviceCaptureOptions,
    controls: DeviceBuffer,
    counters: DeviceBuffer,
    desc: DeviceBuffer,
    lists: Vec<Option<DeviceBuffer>>,
    valid_rows: Vec<u64>,
    mirrors: Vec<HostMirror>,
    slots: PinnedBuffer,
    slot_bytes: usize,
    slot_used_by: [u64; SLOTS],
    begin_index: u64,
    /// Full mode: (begin index, worst-case bytes) of steps whose captures may not have run yet.
    pending: VecDeque<(u64, u64)>,
    step_begun: bool,
    /// `registry.changes()` when the controls were last uploaded (`None`: upload at the next step).
    synced_changes: Option<u64>,
    /// The last stream that passed `check_stream` (a handle keeps its context for its lifetime).
    checked_stream: Option<StreamHandle>,
    counter_stream: sys::CUstream,
    /// Full mode: recorded on the engine's stream when `begin_step` must wait, to learn when every earlier step's
    /// captures have run (their reservations can then be retired).
    marker: sys::CUevent,
    counters_host: PinnedBuffer,
    folded: Vec<[u64; COUNTER_WORDS]>,
    /// The open step's batch when it was begun inside a graph (deferred captures read it at the step's end).
    graph_batch: Option<GraphBatch>,
    /// The stream of the open step (deferred captures are copied on it when the step ends).
    step_stream: Option<StreamHandle>,
    /// Deferred captures of the open step, and how many capture kernels the step has launched for them.
    deferred: Vec<Deferred>,
    step_flushes: u32,
    /// [`submit`](DeviceCapture::submit): the side stream, the events that fork it from the step's stream and join
    /// it back, and whether a join is owed.
    side: sys::CUstream,
    fork_event: sys::CUevent,
    join_event: sys::CUevent,
    join_pending: bool,
}

// SAFETY: the raw stream handle is owned by this value; `&mut self` serialises its use.
unsafe impl Send for DeviceCapture {}

/// Why a device capture call failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceCaptureError {
    /// CUDA failed or an argument is unusable.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The call breaks a rule of the API.
    #[error("{0}")]
    Usage(String),
    /// Full mode: the drain did not free room for the step before the deadline. The step's captures are dropped
    /// and counted (reason `deadline`); the engine may go on.
    #[error("full mode: the drain did not free {needed} bytes for step {step} within {waited_ms} ms; this step's captures are dropped and counted as `deadline` (raise the deadline or ring capacity, or use best-effort)")]
    Deadline {
        /// The step.
        step: u64,
        /// Bytes the step needed.
        needed: u64,
        /// Time waited.
        waited_ms: u64,
    },
}

fn footprint(rows: u64, row_bytes: u64) -> u64 {
    align_up(HEADER_LEN + align_up(rows as usize * ROW_META_LEN) + (rows * row_bytes) as usize) as u64
}

impl DeviceCapture {
    /// Compiles (once per process) and loads the kernels, and allocates the device tables for `ring`.
    pub fn new(ring: &Arc<DeviceRing>, options: DeviceCaptureOptions) -> Result<DeviceCapture, DeviceCaptureError> {
        if options.max_batch_rows == 0 || options.max_hookpoints == 0 {
            return Err(DeviceCaptureError::Usage(format!(
                "{options:?}: max_batch_rows and max_hookpoints must be at least 1"
            )));
        }
        let gpu = ring.gpu().clone();
        let kernels = kernels(&gpu)?;
        let n = options.max_batch_rows as usize;
        let hps = options.max_hookpoints as usize;
        let slot_bytes = align_up(64 + n * ROW_META_LEN + n * 4 + 16);
        gpu.bind()?;
        let counter_stream = result::stream::create(result::stream::StreamKind::NonBlocking).call("cuStreamCreate")?;
        let marker = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).call("cuEventCreate")?;
        let side = result::stream::create(result::stream::StreamKind::NonBlocking).call("cuStreamCreate")?;
        let fork_event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).call("cuEventCreate")?;
        let join_event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).call("cuEventCreate")?;
        Ok(DeviceCapture {
            side,
            fork_event,
            join_event,
            join_pending: false,
            graph_batch: None,
            step_stream: None,
            deferred: Vec::new(),
            step_flushes: 0,
            controls: DeviceBuffer::zeroed(&gpu, hps * CONTROL_BYTES)?,
            counters: DeviceBuffer::zeroed(&gpu, hps * COUNTER_WORDS * 8)?,
            desc: DeviceBuffer::zeroed(&gpu, slot_bytes)?,
            slots: PinnedBuffer::zeroed(&gpu, slot_bytes * SLOTS, true)?,
            counters_host: PinnedBuffer::zeroed(&gpu, hps * COUNTER_WORDS * 8, false)?,
            gpu,
            ring: ring.clone(),
            kernels,
            options,
            lists: Vec::new(),
            valid_rows: Vec::new(),
            mirrors: Vec::new(),
            slot_bytes,
            slot_used_by: [u64::MAX; SLOTS],
            begin_index: 0,
            pending: VecDeque::new(),
            step_begun: false,
            synced_changes: None,
            checked_stream: None,
            counter_stream,
            marker,
            folded: Vec::new(),
        })
    }

    /// The ring this side writes into.
    pub fn ring(&self) -> &Arc<DeviceRing> {
        &self.ring
    }

    /// Makes rows at or past the value of the device `u32` at `ptr` padding for hookpoint `id` (padded graph
    /// batches): the kernel reads the value at replay time. `0` removes it. Takes effect at the next `begin_step`.
    pub fn set_valid_rows_ptr(&mut self, id: u32, ptr: u64) -> Result<(), DeviceCaptureError> {
        if ptr != 0 {
            self.gpu.check_device_range("valid-rows scalar", ptr, 4, 4)?;
        }
        let i = id as usize;
        if i >= self.options.max_hookpoints as usize {
            return Err(DeviceCaptureError::Usage(format!("hookpoint id {id} is past max_hookpoints")));
        }
        if self.valid_rows.len() <= i {
            self.valid_rows.resize(i + 1, 0);
        }
        self.valid_rows[i] = ptr;
        if let Some(m) = self.mirrors.get_mut(i) {
            m.uploaded = false;
        }
        self.synced_changes = None;
        Ok(())
    }

    fn check_stream(&mut self, stream: StreamHandle) -> Result<(), CudaError> {
        if self.checked_stream != Some(stream) {
            self.gpu.check_stream(stream)?;
            self.checked_stream = Some(stream);
        }
        Ok(())
    }

    /// The device control entry of `hp` now, and its row list (explicit selections).
    fn control_of(&self, hp: &HookPoint) -> Result<(DeviceControl, Option<Vec<u32>>), DeviceCaptureError> {
        let (mode, list): (u32, Option<Vec<u32>>) = match &*hp.control().selection() {
            RowSelection::All => (0, None),
            RowSelection::Rows(r) => (1, Some(r.clone())),
            RowSelection::LastPerRequest => (2, None),
        };
        if let Some(list) = &list {
            if list.len() > self.options.max_batch_rows as usize {
                return Err(DeviceCaptureError::Usage(format!(
                    "row selection of `{}` has {} rows, more than max_batch_rows {}",
                    hp.spec().name,
                    list.len(),
                    self.options.max_batch_rows
                )));
            }
        }
        let control = DeviceControl {
            enabled: hp.control().enabled() as u32,
            every_n: hp.control().every_n_steps(),
            mode,
            list_len: list.as_ref().map_or(0, |l| l.len() as u32),
            valid_rows_ptr: self.valid_rows.get(hp.id() as usize).copied().unwrap_or(0),
            ..DeviceControl::default()
        };
        Ok((control, list))
    }

    fn check_count(&self, registered: usize) -> Result<(), DeviceCaptureError> {
        if registered > self.options.max_hookpoints as usize {
            return Err(DeviceCaptureError::Usage(format!(
                "{registered} hookpoints registered, the CUDA session was created for at most {} (max_hookpoints)",
                self.options.max_hookpoints
            )));
        }
        Ok(())
    }

    /// Uploads changed controls on `stream` (stream-ordered before the step's captures).
    fn sync_controls(&mut self, registry: &Registry, stream: StreamHandle) -> Result<(), DeviceCaptureError> {
        let changes = registry.changes();
        if Some(changes) == self.synced_changes {
            return Ok(());
        }
        let all = registry.all();
        self.check_count(all.len())?;
        self.mirrors.resize(all.len(), HostMirror::default());
        self.lists.resize_with(all.len(), || None);
        for hp in &all {
            let i = hp.id() as usize;
            let generation = hp.control().generation();
            let m = &self.mirrors[i];
            if m.uploaded && m.generation == generation {
                continue;
            }
            let (mut control, list) = self.control_of(hp)?;
            if let Some(list) = list {
                if self.lists[i].is_none() {
                    self.lists[i] = Some(DeviceBuffer::zeroed(&self.gpu, self.options.max_batch_rows as usize * 4)?);
                }
                let dst = self.lists[i].as_ref().expect("allocated above").ptr();
                // Pageable source: the driver stages it before returning, so `list` may be dropped right after.
                // SAFETY: `dst` holds max_batch_rows u32s, at least `list.len()` (checked by `control_of`).
                unsafe { result::memcpy_htod_async(dst, &list, stream.raw()) }.call("cuMemcpyHtoDAsync")?;
                control.list_ptr = dst;
            }
            let bytes = control.to_bytes();
            let dst = self.controls.ptr() + (i * CONTROL_BYTES) as u64;
            // SAFETY: entry `i` of the control table (i < max_hookpoints); pageable source, staged by the driver.
            unsafe { result::memcpy_htod_async(dst, &bytes[..], stream.raw()) }.call("cuMemcpyHtoDAsync")?;
            self.mirrors[i] = HostMirror { generation, control, row_bytes: hp.spec().row_bytes(), uploaded: true };
        }
        self.synced_changes = Some(changes);
        Ok(())
    }

    /// Uploads control changes (enable, every-N, rows, valid-rows pointers) on `stream`, in stream order, for steps
    /// begun inside a graph ([`begin_step_graph`](Self::begin_step_graph)), whose replays make no host call: call it
    /// between replays, outside graph recording. Steps begun with [`begin_step`](Self::begin_step) do it themselves.
    pub fn apply_controls(&mut self, registry: &Registry, stream: StreamHandle) -> Result<(), DeviceCaptureError> {
        self.gpu.bind()?;
        self.check_stream(stream)?;
        if self.gpu.is_capturing(stream)? {
            return Err(DeviceCaptureError::Usage(
                "apply_controls was called while the stream is capturing a CUDA graph: call it between replays".into(),
            ));
        }
        self.sync_controls(registry, stream)
    }

    /// Ends the open step. With deferred captures, one kernel on the step's stream copies all of them (inside a
    /// graph recording: call it before the recording ends, so that every replay copies them).
    pub fn end_step(&mut self) -> Result<(), DeviceCaptureError> {
        let result = self.join().and_then(|_| match self.step_stream {
            Some(stream) => self.flush_deferred(stream.raw()),
            None => Ok(()),
        });
        self.graph_batch = None;
        self.deferred.clear();
        result
    }

    /// Deferred captures: starts copying the captures noted so far now, with one kernel on a side stream forked from
    /// the step's stream, so that the copy runs alongside the engine's remaining work of the step (e.g. the LM head
    /// after the last layer) instead of after it; [`end_step`](Self::end_step) makes the step's stream wait for it.
    /// The captured tensors must stay unchanged until the step ends, as for every deferred capture. Inside a graph
    /// recording the fork and the join are recorded too. Nothing to do without deferred captures.
    pub fn submit(&mut self) -> Result<(), DeviceCaptureError> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let Some(stream) = self.step_stream else { return Ok(()) };
        self.gpu.bind()?;
        // SAFETY: our events and side stream; the step's stream was checked when the step began. While it records a
        // graph, this forks the side stream into the same graph.
        unsafe {
            result::event::record(self.fork_event, stream.raw()).call("cuEventRecord")?;
            result::stream::wait_event(self.side, self.fork_event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .call("cuStreamWaitEvent")?;
        }
        self.flush_deferred(self.side)?;
        // SAFETY: as above.
        unsafe { result::event::record(self.join_event, self.side) }.call("cuEventRecord")?;
        self.join_pending = true;
        Ok(())
    }

    /// The step's stream waits (in stream order) for what [`submit`](Self::submit) launched, so that no two
    /// kernels write the ring at once and the engine reuses captured memory only after it was copied.
    fn join(&mut self) -> Result<(), DeviceCaptureError> {
        if !self.join_pending {
            return Ok(());
        }
        let Some(stream) = self.step_stream else { return Ok(()) };
        self.gpu.bind()?;
        // SAFETY: our event; the step's stream was checked when the step began.
        unsafe {
            result::stream::wait_event(stream.raw(), self.join_event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .call("cuStreamWaitEvent")?;
        self.join_pending = false;
        Ok(())
    }

    /// The arguments both capture kernels start with: ring, capacity, state block, host block, control table,
    /// counters, descriptor.
    fn common_args(&self) -> [u64; 7] {
        let a = self.ring.addrs();
        [a.buf, a.capacity, a.state, a.host, self.controls.ptr(), self.counters.ptr(), self.desc.ptr()]
    }

    /// Launches one `ringscope_capture_many` on `stream` for the deferred captures noted so far.
    fn flush_deferred(&mut self, stream: sys::CUstream) -> Result<(), DeviceCaptureError> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let entries = std::mem::take(&mut self.deferred);
        let bytes: u64 = entries.iter().map(|e| e.src_rows as u64 * e.row_bytes as u64).sum();
        let mut param = [0u8; MANY_BYTES];
        param[0..32].copy_from_slice(&GraphBatch::param(self.graph_batch.as_ref(), self.step_flushes == 0));
        self.step_flushes += 1;
        param[32..36].copy_from_slice(&(entries.len() as u32).to_le_bytes());
        param[36..40].copy_from_slice(&(self.options.full_mode_deadline.is_some() as u32).to_le_bytes());
        for (i, e) in entries.iter().enumerate() {
            let o = 40 + i * 24;
            param[o..o + 8].copy_from_slice(&e.src.to_le_bytes());
            param[o + 8..o + 12].copy_from_slice(&e.hookpoint.to_le_bytes());
            param[o + 12..o + 16].copy_from_slice(&e.dtype.to_le_bytes());
            param[o + 16..o + 20].copy_from_slice(&e.row_bytes.to_le_bytes());
            param[o + 20..o + 24].copy_from_slice(&e.src_rows.to_le_bytes());
        }
        let grid = (bytes.div_ceil(16 << 10) as u32).clamp(1, self.gpu.sms() * 2);
        let mut common = self.common_args();
        let mut args: Vec<*mut c_void> = common.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        args.push(param.as_mut_ptr().cast());
        self.gpu.bind()?;
        // SAFETY: the argument list matches `ringscope_capture_many` (the `Many` struct is passed by value as its
        // bytes, laid out as in `capture.cu`); the ring and tables live as long as `self`; every source was checked
        // to be device memory when it was noted, and the engine keeps it until the step ends.
        unsafe {
            launch(self.kernels.capture_many, grid, stream, &mut args, "cuLaunchKernel(ringscope_capture_many)")
        }?;
        Ok(())
    }

    /// Starts a step from inside a CUDA graph (or eagerly) on `stream`: the batch descriptor is built on the device
    /// from the engine's tensors (`batch`) at every replay, and the step is numbered one past the previous one (a
    /// step begun with [`begin_step`](Self::begin_step) sets where numbering continues) — so replays need no host
    /// call. With deferred captures nothing is launched here: the step's one kernel reads `batch` when the step
    /// ends. Best-effort only: full mode must wait on the host for ring space before each step. Control changes
    /// reach graph steps through [`apply_controls`](Self::apply_controls).
    pub fn begin_step_graph(
        &mut self,
        registry: &Registry,
        batch: &GraphBatch,
        stream: StreamHandle,
    ) -> Result<(), DeviceCaptureError> {
        if self.options.full_mode_deadline.is_some() {
            return Err(DeviceCaptureError::Usage(
                "a step begun inside a graph cannot wait for ring space, which full mode requires before every \
                 step: use policy.mode = \"best_effort\" for graph-begun steps, or begin_step before each replay"
                    .into(),
            ));
        }
        let rows = batch.batch as u64 * batch.seq as u64;
        if batch.batch == 0 || batch.seq == 0 || rows > self.options.max_batch_rows as u64 {
            return Err(DeviceCaptureError::Usage(format!(
                "graph step of {} × {} rows: use 1 to max_batch_rows ({}) rows in all",
                batch.batch, batch.seq, self.options.max_batch_rows
            )));
        }
        if batch.positions_batch_stride != 0 && batch.positions_batch_stride < batch.seq {
            return Err(DeviceCaptureError::Usage(format!(
                "positions batch stride {} is less than the {} tokens per row (use {} for a [batch, seq] tensor, 0 \
                 for one [seq] vector shared by all rows)",
                batch.positions_batch_stride, batch.seq, batch.seq
            )));
        }
        self.gpu.bind()?;
        self.check_stream(stream)?;
        self.gpu.check_device_range(
            "request ids (i64 per batch row)",
            batch.request_ids,
            batch.batch as usize * 8,
            8,
        )?;
        let pos_elems = (batch.batch as usize - 1) * batch.positions_batch_stride as usize + batch.seq as usize;
        self.gpu.check_device_range("positions (i64)", batch.positions, pos_elems * 8, 8)?;
        if Some(registry.changes()) != self.synced_changes {
            if self.gpu.is_capturing(stream)? {
                return Err(DeviceCaptureError::Usage(
                    "hookpoint controls changed (or hookpoints were registered) since they last reached the device: \
                     call apply_controls before recording the graph"
                        .into(),
                ));
            }
            self.sync_controls(registry, stream)?;
        }
        self.end_step()?;
        if !self.options.defer {
            let (mut state, mut desc) = (self.ring.addrs().state, self.desc.ptr());
            let mut g = GraphBatch::param(Some(batch), true);
            // SAFETY: the argument list matches `ringscope_begin_step_graph(u8*, u8*, GraphBatch)` (the struct as its
            // 32 bytes); the ring and descriptor live as long as `self`; the engine's tensors were checked above.
            unsafe {
                launch(
                    self.kernels.begin_graph,
                    1,
                    stream.raw(),
                    &mut [(&mut state as *mut u64).cast(), (&mut desc as *mut u64).cast(), g.as_mut_ptr().cast()],
                    "cuLaunchKernel(ringscope_begin_step_graph)",
                )?;
            }
        }
        self.graph_batch = Some(*batch);
        self.step_flushes = 0;
        self.step_begun = true;
        self.step_stream = Some(stream);
        Ok(())
    }

    /// Worst-case ring bytes the step's captures can take: every enabled, sampled hookpoint once, plus one wrap.
    fn step_bound(&self, batch: &StepBatch) -> u64 {
        let n = batch.len() as u64;
        let n_last = batch.last_per_request().len() as u64;
        let (mut sum, mut max) = (0u64, 0u64);
        for m in &self.mirrors {
            let c = &m.control;
            if c.enabled == 0 || batch.step() % c.every_n.max(1) as u64 != 0 {
                continue;
            }
            let rows = match c.mode {
                0 => n,
                1 => (c.list_len as u64).min(n),
                _ => n_last,
            };
            let f = footprint(rows, m.row_bytes as u64);
            sum += f;
            max = max.max(f);
        }
        sum + max
    }

    /// Starts a step on `stream` (the engine's stream; not while it is capturing a graph): installs the batch
    /// descriptor for the captures that follow, uploads changed controls, and in full mode first waits until the
    /// drain has room for the whole step.
    pub fn begin_step(
        &mut self,
        registry: &Registry,
        batch: &StepBatch,
        stream: StreamHandle,
    ) -> Result<(), DeviceCaptureError> {
        self.gpu.bind()?;
        self.check_stream(stream)?;
        if self.gpu.is_capturing(stream)? {
            return Err(DeviceCaptureError::Usage(
                "begin_step was called while the stream is capturing a CUDA graph: call it before each replay, \
                 outside the graph (only captures go into graphs)"
                    .into(),
            ));
        }
        if batch.len() > self.options.max_batch_rows as usize {
            return Err(DeviceCaptureError::Usage(format!(
                "step {} has {} rows, more than max_batch_rows {}",
                batch.step(),
                batch.len(),
                self.options.max_batch_rows
            )));
        }
        self.end_step()?;
        self.sync_controls(registry, stream)?;
        let mut flags = 0u32;
        let mut deadline_error = None;
        if let Some(deadline) = self.options.full_mode_deadline {
            let bound = self.step_bound(batch);
            let cap = self.ring.capacity() as u64;
            if bound > cap {
                return Err(DeviceCaptureError::Usage(format!(
                    "full mode: step {} can capture up to {bound} bytes, more than the ring's {cap}; raise \
                     ring.capacity or select fewer rows",
                    batch.step()
                )));
            }
            let started = Instant::now();
            let until = started + deadline;
            let mut marker_recorded = false;
            loop {
                let progress = self.ring.progress();
                while self.pending.front().is_some_and(|&(index, _)| index + 1 < progress) {
                    self.pending.pop_front();
                }
                if marker_recorded && !self.pending.is_empty() {
                    // SAFETY: our event.
                    match unsafe { result::event::query(self.marker) } {
                        // Everything issued before this begin_step has run: no earlier step can still write.
                        Ok(()) => self.pending.clear(),
                        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                        Err(e) => return Err(CudaError::Driver { call: "cuEventQuery", error: e }.into()),
                    }
                }
                let in_flight: u64 = self.pending.iter().map(|&(_, b)| b).sum();
                let worst_head = self.ring.published() + in_flight + bound;
                if worst_head <= self.ring.released() + cap {
                    break;
                }
                if !marker_recorded {
                    // SAFETY: our event, the caller's stream (checked above).
                    unsafe { result::event::record(self.marker, stream.raw()) }.call("cuEventRecord")?;
                    marker_recorded = true;
                }
                if Instant::now() >= until {
                    flags |= DESC_DEADLINE;
                    deadline_error = Some(DeviceCaptureError::Deadline {
                        step: batch.step(),
                        needed: bound,
                        waited_ms: started.elapsed().as_millis() as u64,
                    });
                    break;
                }
                let wait = Instant::now() + Duration::from_micros(200);
                self.ring.wait_released(worst_head - cap, wait.min(until))?;
            }
            if flags & DESC_DEADLINE == 0 {
                self.pending.push_back((self.begin_index, bound));
            }
        }
        let desc_bytes = self.write_slot(batch, flags)?;
        let slot = (self.begin_index % SLOTS as u64) as usize;
        let addrs = self.ring.addrs();
        let mut state = addrs.state;
        let mut host = addrs.host;
        let mut desc = self.desc.ptr();
        let mut src = self.slots.device_ptr().expect("mapped") + (slot * self.slot_bytes) as u64;
        let mut bytes = desc_bytes as u32;
        let mut index = self.begin_index;
        let grid = (desc_bytes.div_ceil(4096) as u32).clamp(1, 64);
        // SAFETY: the argument list matches `ringscope_begin_step`; every address lives as long as `self`.
        unsafe {
            launch(
                self.kernels.begin,
                grid,
                stream.raw(),
                &mut [
                    (&mut state as *mut u64).cast(),
                    (&mut host as *mut u64).cast(),
                    (&mut desc as *mut u64).cast(),
                    (&mut src as *mut u64).cast(),
                    (&mut bytes as *mut u32).cast(),
                    (&mut index as *mut u64).cast(),
                ],
                "cuLaunchKernel(ringscope_begin_step)",
            )?;
        }
        self.slot_used_by[slot] = self.begin_index;
        self.begin_index += 1;
        self.step_flushes = 0;
        self.step_begun = true;
        self.step_stream = Some(stream);
        match deadline_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Writes the descriptor into the next pinned slot, first waiting (rarely) until the GPU has consumed the slot's
    /// previous use. Returns the descriptor's size.
    fn write_slot(&mut self, batch: &StepBatch, flags: u32) -> Result<usize, DeviceCaptureError> {
        let slot = (self.begin_index % SLOTS as u64) as usize;
        let previous = self.slot_used_by[slot];
        if previous != u64::MAX && self.ring.progress() <= previous {
            // The host is SLOTS steps ahead of the GPU: wait for it (bounded; the GPU makes progress on its own).
            let until = Instant::now() + Duration::from_secs(60);
            while self.ring.progress() <= previous {
                if Instant::now() >= until {
                    return Err(DeviceCaptureError::Usage(format!(
                        "the GPU has not run the begin-step kernel of {} steps ago within 60 s: is the stream stuck?",
                        SLOTS
                    )));
                }
                std::thread::yield_now();
            }
        }
        let n = batch.len();
        let last = batch.last_per_request();
        let size = align_up(64 + n * ROW_META_LEN + last.len() * 4).max(64);
        let size = size.div_ceil(16) * 16;
        // SAFETY: the slot is `slot_bytes` ≥ `size` bytes of pinned memory that no kernel reads now (checked above).
        let out = unsafe {
            std::slice::from_raw_parts_mut(self.slots.host_ptr().add(slot * self.slot_bytes), self.slot_bytes)
        };
        out[0..8].copy_from_slice(&batch.step().to_le_bytes());
        out[8..12].copy_from_slice(&(n as u32).to_le_bytes());
        out[12..16].copy_from_slice(&(last.len() as u32).to_le_bytes());
        out[16..24].copy_from_slice(&self.begin_index.to_le_bytes());
        out[24..28].copy_from_slice(&flags.to_le_bytes());
        for (i, m) in batch.rows().iter().enumerate() {
            let o = 64 + i * ROW_META_LEN;
            m.write_to((&mut out[o..o + ROW_META_LEN]).try_into().expect("16 bytes"));
        }
        let base = 64 + n * ROW_META_LEN;
        for (i, m) in last.iter().enumerate() {
            out[base + i * 4..base + i * 4 + 4].copy_from_slice(&m.batch_row.to_le_bytes());
        }
        Ok(size)
    }

    /// Launches the capture of hookpoint `hp` from `src_rows` contiguous rows at device address `src`, on `stream`.
    ///
    /// May be called while `stream` is capturing a CUDA graph (the launch is then recorded, and every replay
    /// captures what the descriptor and controls say at that time). All captures of a session must run in order on
    /// one stream (or inside one graph on one stream). `src` must be device memory of this session's device,
    /// aligned to the element size; 16-byte alignment (with rows a multiple of 16 bytes) takes the fast path.
    pub fn capture(
        &mut self,
        hp: &HookPoint,
        src: u64,
        src_rows: u32,
        stream: StreamHandle,
    ) -> Result<(), DeviceCaptureError> {
        let name = &hp.spec().name;
        if !self.step_begun {
            return Err(DeviceCaptureError::Usage(format!(
                "capture of `{name}` before the first begin_step: the session must be given a step's batch first"
            )));
        }
        if !self.mirrors.get(hp.id() as usize).is_some_and(|m| m.uploaded) {
            return Err(DeviceCaptureError::Usage(format!(
                "hookpoint `{name}` was registered (or its valid-rows pointer set) after the last begin_step: its \
                 controls reach the device at the next begin_step"
            )));
        }
        if src_rows == 0 || src_rows > self.options.max_batch_rows {
            return Err(DeviceCaptureError::Usage(format!(
                "capture of `{name}`: {src_rows} rows; use 1 to max_batch_rows ({})",
                self.options.max_batch_rows
            )));
        }
        let row_bytes = hp.spec().row_bytes();
        let bytes = src_rows as usize * row_bytes as usize;
        let what = format!("capture of `{name}`");
        self.gpu.bind()?;
        self.gpu.check_device_range(&what, src, bytes, hp.spec().dtype.size())?;
        self.check_stream(stream)?;
        let payload = footprint(src_rows as u64, row_bytes as u64) as usize - HEADER_LEN;
        if payload > self.ring.max_payload_len() {
            return Err(DeviceCaptureError::Usage(format!(
                "{what}: {src_rows} rows × {row_bytes} bytes need a {payload}-byte record, but the ring takes at \
                 most {} per record (half its capacity); raise ring.capacity",
                self.ring.max_payload_len()
            )));
        }
        if self.options.defer {
            if self.step_stream != Some(stream) {
                return Err(DeviceCaptureError::Usage(format!(
                    "{what}: deferred captures must be issued on the stream their step began on"
                )));
            }
            if self.deferred.len() == MAX_MANY {
                self.join()?;
                self.flush_deferred(stream.raw())?;
            }
            let dtype = hp.spec().dtype.code() as u32;
            self.deferred.push(Deferred { src, hookpoint: hp.id(), dtype, row_bytes, src_rows });
            return Ok(());
        }
        // 16 KiB per block (256 threads × 4 × 16 B) up to two blocks per SM; larger captures loop.
        let grid = (bytes.div_ceil(16 << 10) as u32).clamp(1, self.gpu.sms() * 2);
        let (mut id, mut dtype, mut rb, mut s, mut rows) =
            (hp.id(), hp.spec().dtype.code() as u32, row_bytes, src, src_rows);
        let mut full = self.options.full_mode_deadline.is_some() as u32;
        self.join()?;
        let mut common = self.common_args();
        let mut args: Vec<*mut c_void> = common.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        args.extend([
            (&mut id as *mut u32).cast(),
            (&mut dtype as *mut u32).cast(),
            (&mut rb as *mut u32).cast(),
            (&mut s as *mut u64).cast(),
            (&mut rows as *mut u32).cast(),
            (&mut full as *mut u32).cast(),
        ]);
        // SAFETY: the argument list matches `ringscope_capture`; the ring and tables live as long as `self` (the
        // session synchronises the device before dropping them); `src` was checked to be device memory.
        unsafe { launch(self.kernels.capture, grid, stream.raw(), &mut args, "cuLaunchKernel(ringscope_capture)") }?;
        Ok(())
    }

    /// Fills `bytes` (a multiple of 4) at device address `dst` with the pattern of [`pattern_word`] for `seed`, on
    /// `stream`. For tests and benchmarks.
    pub fn fill_pattern(&self, dst: u64, bytes: usize, seed: u64, stream: StreamHandle) -> Result<(), CudaError> {
        if bytes % 4 != 0 {
            return Err(CudaError::Invalid(format!("fill_pattern: {bytes} bytes is not a multiple of 4")));
        }
        self.gpu.check_device_range("fill_pattern", dst, bytes, 4)?;
        let mut d = dst;
        let mut words = (bytes / 4) as u64;
        let mut seed = seed;
        let grid = (words.div_ceil(THREADS as u64) as u32).clamp(1, self.gpu.sms() * 8);
        // SAFETY: matches `ringscope_fill_pattern(u32*, u64, u64)`; `dst` was checked.
        unsafe {
            launch(
                self.kernels.fill,
                grid,
                stream.raw(),
                &mut [(&mut d as *mut u64).cast(), (&mut words as *mut u64).cast(), (&mut seed as *mut u64).cast()],
                "cuLaunchKernel(ringscope_fill_pattern)",
            )
        }
    }

    /// Benchmarks only: marks everything written so far as drained (the device `tail` jumps to `head`) on
    /// `stream`, so that capture kernels can be timed without a drain. Records skipped this way are never exported:
    /// never use it in a session. Only with the `bench-internals` feature.
    #[cfg(feature = "bench-internals")]
    pub fn discard_all_for_benchmarks(&self, stream: StreamHandle) -> Result<(), CudaError> {
        let mut state = self.ring.addrs().state;
        // SAFETY: matches `ringscope_discard_all(u8*)`; the state block lives as long as the ring.
        unsafe {
            launch(
                self.kernels.discard,
                1,
                stream.raw(),
                &mut [(&mut state as *mut u64).cast()],
                "cuLaunchKernel(ringscope_discard_all)",
            )
        }
    }

    /// Reads the device counters (on a private stream: the engine's streams are not synchronised) and adds what
    /// changed since the last call to the hookpoints' host counters. Exact once the engine's work has completed.
    pub fn fold_counters(&mut self, registry: &Registry) -> Result<(), CudaError> {
        let n = self.mirrors.len();
        if n == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let bytes = n * COUNTER_WORDS * 8;
        // SAFETY: both buffers hold at least `bytes`; we synchronise our stream before reading.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                self.counters_host.host_ptr().cast(),
                self.counters.ptr(),
                bytes,
                self.counter_stream,
            )
            .result()
            .call("cuMemcpyDtoHAsync")?;
            result::stream::synchronize(self.counter_stream).call("cuStreamSynchronize")?;
        }
        self.folded.resize(n, [0; COUNTER_WORDS]);
        for hp in registry.all().iter().take(n) {
            let i = hp.id() as usize;
            let now: [u64; COUNTER_WORDS] = std::array::from_fn(|w| {
                self.counters_host.u64_at((i * COUNTER_WORDS + w) * 8).load(std::sync::atomic::Ordering::Relaxed)
            });
            let before = self.folded[i];
            let delta = |w: usize| Tally { records: now[w] - before[w], rows: now[w + 1] - before[w + 1] };
            let c = &hp.counters();
            for (w, count) in [
                (counter::PRODUCED, Count::Produced),
                (counter::SAMPLED, Count::SampledOut),
                (counter::PUBLISHED, Count::Published),
                (counter::FULL, Count::Dropped(DropReason::RingFull)),
                (counter::TOO_LARGE, Count::Dropped(DropReason::TooLarge)),
                (counter::DEADLINE, Count::Dropped(DropReason::Deadline)),
            ] {
                let d = delta(w);
                if d.records > 0 || d.rows > 0 {
                    c.add(count, d);
                }
            }
            self.folded[i] = now;
        }
        Ok(())
    }
}

impl Drop for DeviceCapture {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: our stream; nothing uses it after this.
            unsafe {
                let _ = result::stream::synchronize(self.counter_stream);
                let _ = result::stream::destroy(self.counter_stream);
                let _ = result::event::destroy(self.marker);
                let _ = result::stream::synchronize(self.side);
                let _ = result::stream::destroy(self.side);
                let _ = result::event::destroy(self.fork_event);
                let _ = result::event::destroy(self.join_event);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles the kernels wherever NVRTC is installed (CI installs it from PyPI); no GPU needed.
    #[test]
    fn kernels_compile_with_nvrtc() {
        match compile_ptx("sm_90") {
            Ok(ptx) => {
                for f in [
                    "ringscope_capture",
                    "ringscope_begin_step",
                    "ringscope_begin_step_graph",
                    "ringscope_capture_many",
                    "ringscope_fill_pattern",
                    "ringscope_discard_all",
                ] {
                    assert!(ptx.contains(&format!(".entry {f}")), "{f} missing from the PTX");
                }
            }
            Err(CudaError::NoNvrtc) if std::env::var_os("RINGSCOPE_REQUIRE_NVRTC").is_none() => {
                eprintln!("skipped: NVRTC is not installed (set RINGSCOPE_REQUIRE_NVRTC=1 to make this a failure)")
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn opening_a_gpu_without_a_driver_is_an_error_not_a_panic() {
        match Gpu::open(0) {
            Ok(gpu) => eprintln!("a GPU is present: {}", gpu.name()),
            Err(e) => {
                assert!(matches!(e, CudaError::NoDriver | CudaError::NoDevice { .. } | CudaError::Driver { .. }), "{e}")
            }
        }
        assert!(matches!(
            Gpu::open(4096),
            Err(CudaError::NoDriver | CudaError::NoDevice { .. } | CudaError::Driver { .. })
        ));
    }

    #[test]
    fn footprints_match_the_host_encoder() {
        for (rows, rb) in [(1u64, 4096u64), (3, 14), (64, 8192), (5, 2)] {
            let meta = ringscope_ring::RecordMeta {
                step: 0,
                hookpoint: 0,
                rows: rows as u32,
                row_bytes: rb as u32,
                dtype: ringscope_ring::DType::U8,
                flags: 0,
            };
            assert_eq!(footprint(rows, rb) as usize, align_up(HEADER_LEN + meta.payload_len()));
        }
    }

    #[test]
    fn pattern_is_deterministic_and_seeded() {
        assert_eq!(pattern_word(1, 2), pattern_word(1, 2));
        assert_ne!(pattern_word(1, 2), pattern_word(2, 2));
        assert_ne!(pattern_word(1, 2), pattern_word(1, 3));
    }
}
