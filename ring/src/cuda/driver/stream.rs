//! Streams ([`Stream`] owned by ringscope, [`StreamRef`] for any stream including an engine's), [`Event`]s, and
//! [`Graph`]s recorded from a stream.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::gpu::driver_present;
use super::{CudaError, DriverResult, Gpu};

/// A CUDA stream ringscope may issue work on: an engine's (e.g. PyTorch's
/// `torch.cuda.current_stream().cuda_stream`, through [`StreamRef::from_raw`]), or one of ringscope's own
/// ([`Stream::handle`], which keeps that stream alive as long as any `StreamRef` to it exists).
///
/// Equality compares the handle.
#[derive(Clone)]
pub struct StreamRef {
    raw: u64,
    /// Keeps a stream ringscope owns alive while a reference to it exists (`None` for an engine's stream, whose
    /// lifetime is the caller's promise).
    _keep: Option<Arc<dyn Any + Send + Sync>>,
}

impl StreamRef {
    /// The legacy default stream (handle 0), valid in every context.
    pub const fn legacy_default() -> StreamRef {
        StreamRef { raw: 0, _keep: None }
    }

    /// Wraps a raw `CUstream` handle owned by someone else (the engine).
    ///
    /// # Safety
    /// `raw` is 0 (the legacy default stream) or a `CUstream` handle that was created and is not destroyed for as
    /// long as ringscope may use it: during every call it is passed to, and — for the stream a step is begun on —
    /// until that step has ended (`end_step`) and the session (or `DeviceCapture`) that began it is dropped or
    /// shut down, since ringscope issues the step's deferred work and later control uploads on it. A handle of
    /// another context or device is rejected at run time ([`Gpu::check_stream`]).
    pub const unsafe fn from_raw(raw: u64) -> StreamRef {
        StreamRef { raw, _keep: None }
    }

    /// The handle as a number (for messages and logs).
    pub fn as_raw(&self) -> u64 {
        self.raw
    }

    /// True for the legacy default stream.
    pub fn is_legacy_default(&self) -> bool {
        self.raw == 0
    }

    /// The handle as the driver takes it.
    pub(super) fn raw(&self) -> sys::CUstream {
        self.raw as usize as sys::CUstream
    }

    /// Waits for everything issued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: a live stream per this type's contract.
        unsafe { result::stream::synchronize(self.raw()) }.call("cuStreamSynchronize")
    }

    /// Makes work issued on this stream from now on wait (in stream order, no host wait) until `event` — as last
    /// recorded — has completed. While the stream records a graph, this adds the dependency to the graph.
    pub fn wait_event(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: a live stream per this type's contract; the event is owned by `event`.
        unsafe { result::stream::wait_event(self.raw(), event.raw, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .call("cuStreamWaitEvent")
    }
}

impl PartialEq for StreamRef {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}

impl Eq for StreamRef {}

impl std::hash::Hash for StreamRef {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.raw.hash(state)
    }
}

impl std::fmt::Debug for StreamRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamRef({:#x})", self.raw)
    }
}

/// A non-blocking CUDA stream owned by ringscope, destroyed (after the work issued on it) when the stream and every
/// [`StreamRef`] to it are gone.
#[derive(Debug)]
pub struct Stream {
    gpu: Arc<Gpu>,
    stream: StreamRef,
}

#[derive(Debug)]
struct OwnedStream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread of its context.
unsafe impl Send for OwnedStream {}
// SAFETY: as above; the driver serialises operations on one stream.
unsafe impl Sync for OwnedStream {}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: our stream, and no `StreamRef` to it is left; pending work completes first.
            unsafe {
                let _ = result::stream::synchronize(self.raw);
                let _ = result::stream::destroy(self.raw);
            }
        }
    }
}

impl Stream {
    /// A new non-blocking stream on `gpu`.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Stream, CudaError> {
        gpu.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).call("cuStreamCreate")?;
        let owner = Arc::new(OwnedStream { gpu: gpu.clone(), raw });
        Ok(Stream { gpu: gpu.clone(), stream: StreamRef { raw: raw as usize as u64, _keep: Some(owner) } })
    }

    /// The stream, as engines pass streams to ringscope (it keeps this stream alive).
    pub fn handle(&self) -> StreamRef {
        self.stream.clone()
    }

    /// The stream, borrowed.
    pub fn stream_ref(&self) -> &StreamRef {
        &self.stream
    }

    /// Waits for everything issued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()
    }
}

/// A CUDA event (`cuEventCreate`), destroyed on drop.
#[derive(Debug)]
pub struct Event {
    gpu: Arc<Gpu>,
    raw: sys::CUevent,
}

// SAFETY: an event handle may be used from any thread of its context; `&mut`/`&` access follows the driver's rules
// (recording and querying are thread-safe driver calls).
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event; `timing`: it records timestamps ([`elapsed_ms`](Self::elapsed_ms)), which costs a little.
    pub fn new(gpu: &Arc<Gpu>, timing: bool) -> Result<Event, CudaError> {
        gpu.bind()?;
        let flags =
            if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        let raw = result::event::create(flags).call("cuEventCreate")?;
        Ok(Event { gpu: gpu.clone(), raw })
    }

    /// Records the event at the current end of `stream` (inside a graph recording: as a node of the graph).
    pub fn record(&self, stream: &StreamRef) -> Result<(), CudaError> {
        // SAFETY: our event; a live stream per `StreamRef`'s contract.
        unsafe { result::event::record(self.raw, stream.raw()) }.call("cuEventRecord")
    }

    /// Whether the work before the last `record` has completed (true also when never recorded). Never waits.
    pub fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: our event.
        match unsafe { result::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(error) => Err(CudaError::Driver { call: "cuEventQuery", error }),
        }
    }

    /// Waits until the work before the last `record` has completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: our event.
        unsafe { result::event::synchronize(self.raw) }.call("cuEventSynchronize")
    }

    /// Milliseconds between `start` and this event (both timing events, both recorded and completed).
    pub fn elapsed_ms(&self, start: &Event) -> Result<f32, CudaError> {
        // SAFETY: both events are ours; the driver reports events not recorded or not completed as errors.
        unsafe { result::event::elapsed(start.raw, self.raw) }.call("cuEventElapsedTime")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: ours; a recorded event still pending is released by the driver once it completes.
            let _ = unsafe { result::event::destroy(self.raw) };
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
    ///
    /// A replay reads and writes the device addresses that were recorded: buffers the graph uses must outlive its
    /// last replay (the promise [`DevicePtr::from_raw`](super::DevicePtr::from_raw) asks for).
    pub fn capture<E: From<CudaError>>(stream: &Stream, record: impl FnOnce() -> Result<(), E>) -> Result<Graph, E> {
        let gpu = stream.gpu.clone();
        gpu.bind()?;
        let raw = stream.stream.raw();
        // SAFETY: our stream.
        unsafe { result::stream::begin_capture(raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }
            .call("cuStreamBeginCapture")?;
        let recorded = record();
        // SAFETY: the capture begun above; ending it is required even when recording failed.
        let graph = unsafe { result::stream::end_capture(raw) }.call("cuStreamEndCapture");
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
        Ok(Graph { gpu, graph, exec })
    }

    /// Launches the graph on `stream`.
    pub fn launch(&self, stream: StreamRef) -> Result<(), CudaError> {
        // SAFETY: our instantiated graph; a live stream per `StreamRef`'s contract.
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

/// A stream of a non-primary context on a device: what an engine that does not use the primary context would
/// pass. ringscope refuses such streams ([`Gpu::check_stream`]); this type exists to test that refusal.
pub struct ForeignStream {
    stream: StreamRef,
}

struct ForeignOwner {
    // Field order: the stream is destroyed before its context.
    _stream: Arc<CudaStream>,
    _ctx: Arc<CudaContext>,
}

impl ForeignStream {
    /// Creates a non-primary context on device `ordinal` and a stream in it. Leaves the new context current on the
    /// calling thread (bind the session's [`Gpu`] again afterwards).
    pub fn new(ordinal: usize) -> Result<ForeignStream, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new_non_primary(ordinal, 0).call("cuCtxCreate")?;
        let stream = ctx.new_stream().call("cuStreamCreate")?;
        let raw = stream.cu_stream() as usize as u64;
        let owner = Arc::new(ForeignOwner { _stream: stream, _ctx: ctx });
        Ok(ForeignStream { stream: StreamRef { raw, _keep: Some(owner) } })
    }

    /// The stream (it keeps the stream and its context alive).
    pub fn handle(&self) -> StreamRef {
        self.stream.clone()
    }
}

impl std::fmt::Debug for ForeignStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ForeignStream({:?})", self.stream)
    }
}
