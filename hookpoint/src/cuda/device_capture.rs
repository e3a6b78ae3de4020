//! [`DeviceCapture`]: the capture side of a CUDA session. It checks what the engine hands in (streams, device
//! tensors, call order) and composes the parts that do the work: controls, counters, admission, descriptor slots,
//! deferred captures and the kernels.

use std::sync::Arc;
use std::time::Duration;

use ringscope_ring::cuda::{CudaError, DevicePtr, DeviceRing, Gpu, StreamRef};
use ringscope_ring::record::HEADER_LEN;
use ringscope_ring::DType;

use super::admission::{footprint, graph_step_bound, step_bound, Admission, Admitted, StepKind};
use super::controls::Controls;
use super::counters::{Counters, StepWindow};
use super::deferred::{Deferred, FlushContext};
use super::kernels::{CaptureArgs, CaptureEntry, CaptureTables, GraphBatch, GraphRole, Kernels, ProbeArgs, THREADS};
use super::probe::{DeviceFlags, DeviceProbe};
use super::slots::{desc, DescriptorSlots};
use crate::batch::StepBatch;
use crate::registry::{HookPoint, Registry};
use crate::RowSelection;

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
    #[error("full mode: the drain did not free {needed} bytes for {step} within {waited_ms} ms; this step's captures are dropped and counted as `deadline` (raise the deadline or ring capacity, or use best-effort)")]
    Deadline {
        /// The step: `step N`, or which graph-begun step (the device numbers those).
        step: String,
        /// Bytes the step needed.
        needed: u64,
        /// Time waited.
        waited_ms: u64,
    },
}

/// The capture side of a CUDA session: kernels, device tables, descriptor slots. Drive it from one thread.
pub struct DeviceCapture {
    // Field order is drop order: the side stream (deferred) and the counter stream finish their work before the
    // tables they read are freed.
    deferred: Deferred,
    counters: Counters,
    admission: Admission,
    controls: Controls,
    slots: DescriptorSlots,
    kernels: Arc<Kernels>,
    ring: Arc<DeviceRing>,
    gpu: Arc<Gpu>,
    options: DeviceCaptureOptions,
    step_begun: bool,
    /// The last stream that passed `check_stream` (a handle keeps its context for its lifetime).
    checked_stream: Option<StreamRef>,
    /// The open step's batch when it was begun inside a graph (deferred captures read it at the step's end).
    graph_batch: Option<GraphBatch>,
    /// The stream of the open step (deferred captures are copied on it when the step ends).
    step_stream: Option<StreamRef>,
    /// The steps begun since the counters were last folded (the step range of the drops a fold finds).
    steps: StepWindow,
    /// Scores buffers of the probes used in the open step (deferred captures: each may be used once per step).
    probes_in_step: Vec<u64>,
    /// Full mode's admission of steps begun inside graphs.
    graph: GraphAdmission,
}

/// Full mode, steps begun inside graphs: how many were admitted, the largest batch recorded, and the flags the
/// device's graph steps take now.
#[derive(Debug, Default)]
struct GraphAdmission {
    /// Graph-begun steps admitted so far (the device counts those that began: `DeviceRing::graph_begun`).
    admitted: u64,
    /// The most rows and the most requests of the graph-begun steps recorded so far.
    largest: Option<(u32, u32)>,
    /// The device's graph step flags are `DEADLINE` (the last admission found no room in time).
    late: bool,
    /// `admit_graph_step` admitted a step that an eager `begin_step_graph` has not taken yet (a replay takes it
    /// without telling the host; the next admission replaces it).
    admitted_ahead: bool,
}

impl DeviceCapture {
    /// Full mode: how long the next steps' admission may wait for room (a session lowers it per step to honour a
    /// step-time budget). Nothing to do in best-effort mode.
    pub fn set_full_mode_deadline(&mut self, deadline: Duration) {
        if self.options.full_mode_deadline.is_some() {
            self.admission.set_deadline(deadline);
        }
    }

    /// Compiles (once per process) and loads the kernels, and allocates the device tables for `ring`.
    pub fn new(ring: &Arc<DeviceRing>, options: DeviceCaptureOptions) -> Result<DeviceCapture, DeviceCaptureError> {
        if options.max_batch_rows == 0 || options.max_hookpoints == 0 {
            return Err(DeviceCaptureError::Usage(format!(
                "{options:?}: max_batch_rows and max_hookpoints must be at least 1"
            )));
        }
        let gpu = ring.gpu().clone();
        let kernels = Kernels::get(&gpu)?;
        gpu.bind()?;
        Ok(DeviceCapture {
            controls: Controls::new(&gpu, options.max_batch_rows, options.max_hookpoints)?,
            counters: Counters::new(&gpu, options.max_hookpoints)?,
            slots: DescriptorSlots::new(&gpu, options.max_batch_rows)?,
            admission: Admission::new(&gpu, options.full_mode_deadline)?,
            deferred: Deferred::new(&gpu)?,
            gpu,
            ring: ring.clone(),
            kernels,
            options,
            step_begun: false,
            checked_stream: None,
            graph_batch: None,
            step_stream: None,
            steps: StepWindow::default(),
            probes_in_step: Vec::new(),
            graph: GraphAdmission::default(),
        })
    }

    /// The ring this side writes into.
    pub fn ring(&self) -> &Arc<DeviceRing> {
        &self.ring
    }

    /// Makes rows at or past the value of the device `u32` at `ptr` padding for hookpoint `id` (padded graph
    /// batches): the kernel reads the value at replay time. `None` removes it. Takes effect at the next
    /// `begin_step`.
    pub fn set_valid_rows_ptr(&mut self, id: u32, ptr: Option<DevicePtr>) -> Result<(), DeviceCaptureError> {
        self.controls.set_valid_rows(id, ptr)
    }

    fn check_stream(&mut self, stream: &StreamRef) -> Result<(), CudaError> {
        if self.checked_stream.as_ref() != Some(stream) {
            self.gpu.check_stream(stream)?;
            self.checked_stream = Some(stream.clone());
        }
        Ok(())
    }

    /// The addresses both capture kernels start with.
    fn tables(&self) -> CaptureTables {
        CaptureTables {
            ring: self.ring.addrs(),
            controls: self.controls.table_addr(),
            counters: self.counters.table_addr(),
            desc: self.slots.home_addr(),
        }
    }

    /// What a flush of deferred captures needs, next to the deferred state it changes.
    fn deferred_parts(&mut self) -> (FlushContext<'_>, &mut Deferred) {
        let tables = self.tables();
        let cx = FlushContext {
            gpu: &self.gpu,
            kernels: &self.kernels,
            tables,
            graph_batch: self.graph_batch.as_ref(),
            full_mode: self.options.full_mode_deadline.is_some(),
        };
        (cx, &mut self.deferred)
    }

    /// Launches one `ringscope_capture_many` on `stream` for the deferred captures noted so far.
    fn flush_deferred(&mut self, stream: &StreamRef) -> Result<(), DeviceCaptureError> {
        let (cx, deferred) = self.deferred_parts();
        deferred.flush(&cx, stream)
    }

    /// The step's stream waits (in stream order) for what [`submit`](Self::submit) launched.
    fn join(&mut self) -> Result<(), DeviceCaptureError> {
        match &self.step_stream {
            Some(stream) => self.deferred.join(&self.gpu, stream),
            None => Ok(()),
        }
    }

    /// Uploads control changes (enable, every-N, rows, valid-rows pointers) on `stream`, in stream order, for steps
    /// begun inside a graph ([`begin_step_graph`](Self::begin_step_graph)), whose replays make no host call: call it
    /// between replays, outside graph recording. Steps begun with [`begin_step`](Self::begin_step) do it themselves.
    pub fn apply_controls(&mut self, registry: &Registry, stream: StreamRef) -> Result<(), DeviceCaptureError> {
        self.gpu.bind()?;
        self.check_stream(&stream)?;
        if self.gpu.is_capturing(&stream)? {
            return Err(DeviceCaptureError::Usage(
                "apply_controls was called while the stream is capturing a CUDA graph: call it between replays".into(),
            ));
        }
        self.deferred.join_held(&self.gpu, &stream)?;
        self.controls.sync(registry, &stream)
    }

    /// Ends the open step. With deferred captures, one kernel on the step's stream copies all of them (inside a
    /// graph recording: call it before the recording ends, so that every replay copies them).
    pub fn end_step(&mut self) -> Result<(), DeviceCaptureError> {
        let result = self.join().and_then(|_| match self.step_stream.clone() {
            Some(stream) => self.flush_deferred(&stream),
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
        let Some(stream) = self.step_stream.clone() else { return Ok(()) };
        let (cx, deferred) = self.deferred_parts();
        deferred.submit(&cx, &stream)
    }

    /// Ends the open step — begun inside a CUDA graph being recorded ([`begin_step_graph`](Self::begin_step_graph)),
    /// with deferred captures — without copying its captures: they are kept as held copy `slot` (replacing one kept
    /// there), which [`launch_held`](Self::launch_held) launches after each replay of the graph, outside it. The
    /// graph then holds none of ringscope's kernels. The captured tensors must keep their values from the end of
    /// each replay until its held copy has run ([`join_held`](Self::join_held) makes the engine's stream wait for it).
    pub fn hold_step(&mut self, slot: u32) -> Result<(), DeviceCaptureError> {
        if !self.options.defer {
            return Err(DeviceCaptureError::Usage(
                "hold_step needs deferred captures (ring.defer_captures): immediate captures are launched at their \
                 sites"
                    .into(),
            ));
        }
        let (Some(batch), Some(stream)) = (self.graph_batch, self.step_stream.clone()) else {
            return Err(DeviceCaptureError::Usage(
                "hold_step: no step begun inside a graph is open (begin_step_graph, while the stream records a \
                 graph)"
                    .into(),
            ));
        };
        self.gpu.bind()?;
        if !self.gpu.is_capturing(&stream)? {
            return Err(DeviceCaptureError::Usage(
                "hold_step outside graph recording: a held copy is for a step recorded into a CUDA graph (end an \
                 eager step with end_step)"
                    .into(),
            ));
        }
        // A copy submitted earlier in the step is joined inside the graph; what is noted after it is held.
        self.join()?;
        self.deferred.hold(slot, batch);
        self.graph_batch = None;
        self.step_stream = None;
        Ok(())
    }

    /// Launches held copy `slot` ([`hold_step`](Self::hold_step)) on a side stream, after everything `stream` has been
    /// given so far: call it right after each replay of the graph that held it, on the stream that replayed it, and
    /// outside graph recording. The copy runs beside the engine's next work; [`join_held`](Self::join_held) makes the
    /// engine's stream wait for it before the engine reuses the memory it reads (before its next replay at the
    /// latest). Full mode: admit the replay first ([`admit_graph_step`](Self::admit_graph_step)), as for a graph
    /// that copies inside itself.
    pub fn launch_held(&mut self, slot: u32, stream: StreamRef) -> Result<(), DeviceCaptureError> {
        if self.graph_batch.is_some() {
            return Err(DeviceCaptureError::Usage(
                "launch_held while a step is open: launch a held copy between steps, after the replay".into(),
            ));
        }
        self.gpu.bind()?;
        self.check_stream(&stream)?;
        if self.gpu.is_capturing(&stream)? {
            return Err(DeviceCaptureError::Usage(
                "launch_held while the stream records a CUDA graph: launch a held copy after a replay".into(),
            ));
        }
        let (cx, deferred) = self.deferred_parts();
        deferred.launch_held(&cx, slot, &stream)
    }

    /// `stream` waits (in stream order) for the held copies launched so far; nothing to do when none is pending.
    /// The next step, control upload or admission on any stream waits for them too, so that the ring's kernels run in
    /// order.
    pub fn join_held(&mut self, stream: StreamRef) -> Result<(), DeviceCaptureError> {
        self.gpu.bind()?;
        self.check_stream(&stream)?;
        if self.deferred.held_pending() && self.gpu.is_capturing(&stream)? {
            return Err(DeviceCaptureError::Usage(
                "join_held while the stream records a CUDA graph: join a held copy before recording".into(),
            ));
        }
        self.deferred.join_held(&self.gpu, &stream)
    }

    /// Starts a step from inside a CUDA graph (or eagerly) on `stream`: the batch descriptor is built on the device
    /// from the engine's tensors (`batch`) at every replay, and the step is numbered one past the previous one (a
    /// step begun with [`begin_step`](Self::begin_step) sets where numbering continues) — so replays need no host
    /// call in best-effort mode. With deferred captures nothing is launched here: the step's one kernel reads `batch`
    /// when the step ends. Control changes reach graph steps through [`apply_controls`](Self::apply_controls).
    ///
    /// Full mode: the host must make sure of ring space before each step, which a replay cannot do by itself: call
    /// [`admit_graph_step`](Self::admit_graph_step) before every replay (a host-side check, no device work unless
    /// it has to wait). Called eagerly (not recording), this admits the step itself — unless `admit_graph_step` was
    /// called since the last eager step: that admission is taken as this step's (replays are not seen here, so a
    /// caller admits once per graph-begun step, replayed or eager); past the deadline the step is begun all the same,
    /// with its captures dropped and counted as `deadline`, and the error is returned.
    pub fn begin_step_graph(
        &mut self,
        registry: &Registry,
        batch: &GraphBatch,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
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
        self.check_stream(&stream)?;
        self.gpu.check_device_range(
            "request ids (i64 per batch row)",
            batch.request_ids,
            batch.batch as usize * 8,
            8,
        )?;
        let pos_elems = (batch.batch as usize - 1) * batch.positions_batch_stride as usize + batch.seq as usize;
        self.gpu.check_device_range("positions (i64)", batch.positions, pos_elems * 8, 8)?;
        if let Some(ended) = &batch.ended {
            let bytes = (batch.batch as usize - 1)
                .checked_mul(ended.batch_stride() as usize)
                .and_then(|e| e.checked_add(1))
                .and_then(|e| e.checked_mul(8))
                .ok_or_else(|| {
                    DeviceCaptureError::Usage(format!(
                        "ended-sequence tokens: {} rows {} elements apart do not fit in memory",
                        batch.batch,
                        ended.batch_stride()
                    ))
                })?;
            self.gpu.check_device_range("ended-sequence tokens (i64 per batch row)", ended.tokens(), bytes, 8)?;
        }
        if let Some(kept) = batch.kept {
            if batch.seq != 1 {
                return Err(DeviceCaptureError::Usage(format!(
                    "kept rows with {} tokens per batch row: a batch that keeps some rows only has one token per row \
                     (seq 1)",
                    batch.seq
                )));
            }
            self.gpu.check_device_range(
                "kept rows (u32 count, then u32 per batch row)",
                kept,
                (rows as usize + 1) * 4,
                4,
            )?;
        }
        if !self.controls.in_sync(registry) {
            if self.gpu.is_capturing(&stream)? {
                return Err(DeviceCaptureError::Usage(
                    "hookpoint controls changed (or hookpoints were registered) since they last reached the device: \
                     call apply_controls before recording the graph"
                        .into(),
                ));
            }
            self.controls.sync(registry, &stream)?;
        }
        self.join_held(stream.clone())?;
        self.end_step()?;
        let mut late = None;
        if self.admission.full_mode() {
            if self.gpu.is_capturing(&stream)? {
                // Recorded: every replay is admitted by `admit_graph_step`, which bounds it by the largest recorded.
                // Rows and requests each at their largest (one graph may have more rows, another more requests).
                let (r, q) = self.graph.largest.unwrap_or((0, 0));
                self.graph.largest = Some((r.max(batch.batch * batch.seq), q.max(batch.batch)));
            } else if !std::mem::take(&mut self.graph.admitted_ahead) {
                // Eager, and not admitted by `admit_graph_step` (which already returned its deadline, if any): its
                // own admission.
                late = self.admit_graph(rows, batch.batch as u64, registry, &stream)?;
            }
        }
        if !self.options.defer {
            let param = GraphBatch::param(Some(batch), GraphRole::First);
            let addrs = self.ring.addrs();
            // SAFETY: the state block, host block and descriptor live as long as `self`; the engine's tensors were
            // checked above and are covered by their `DevicePtr::from_raw` promise for every replay.
            unsafe { self.kernels.begin_step_graph(&stream, addrs.state, addrs.host, self.slots.home_addr(), param) }?;
        }
        self.graph_batch = Some(*batch);
        self.deferred.begin_step();
        self.probes_in_step.clear();
        self.step_begun = true;
        self.step_stream = Some(stream);
        self.steps.begun_in_graph();
        match late {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Full mode: admits the next replay of a graph whose step is begun inside it — waits (up to the deadline) until
    /// the ring has room for everything such a step can capture, and reserves it. Call it on the engine's `stream`
    /// before every replay, outside graph recording; replays that were not admitted may find the ring full (their
    /// records are then dropped, counted as `ring_full`, and reported as a full-mode overrun). `rows` bounds the
    /// replayed step's batch rows; `None` takes the largest graph-begun step recorded so far. Also uploads control
    /// changes, as [`apply_controls`](Self::apply_controls) does. Best-effort: nothing to do.
    ///
    /// Past the deadline it returns [`DeviceCaptureError::Deadline`]: the replay's captures are then dropped on the
    /// device and counted as `deadline` (the engine may replay all the same, or stop).
    pub fn admit_graph_step(
        &mut self,
        registry: &Registry,
        rows: Option<u32>,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        if !self.admission.full_mode() {
            return Ok(());
        }
        let (rows, requests) = match rows {
            Some(0) => {
                return Err(DeviceCaptureError::Usage(
                    "admit_graph_step: rows must be at least 1 (or none, for the largest recorded graph step)".into(),
                ))
            }
            Some(r) if r > self.options.max_batch_rows => {
                return Err(DeviceCaptureError::Usage(format!(
                    "admit_graph_step: {r} rows is more than max_batch_rows ({})",
                    self.options.max_batch_rows
                )))
            }
            Some(r) => (r, r),
            None => self.graph.largest.ok_or_else(|| {
                DeviceCaptureError::Usage(
                    "admit_graph_step: no step begun inside a graph has been recorded in this session yet (record \
                     the graph first, or give the replay's batch rows)"
                        .into(),
                )
            })?,
        };
        self.gpu.bind()?;
        self.check_stream(&stream)?;
        if self.gpu.is_capturing(&stream)? {
            return Err(DeviceCaptureError::Usage(
                "admit_graph_step was called while the stream is capturing a CUDA graph: call it before each replay, \
                 outside the graph"
                    .into(),
            ));
        }
        self.deferred.join_held(&self.gpu, &stream)?;
        self.controls.sync(registry, &stream)?;
        let late = self.admit_graph(rows as u64, requests as u64, registry, &stream)?;
        // For an eager `begin_step_graph` that may follow (a replay takes it without a host call).
        self.graph.admitted_ahead = true;
        match late {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Full mode: admits one graph-begun step of `rows` rows and `requests` requests issued next on `stream`, and
    /// sets the device's graph step flags to match (`DEADLINE` when no room came in time). Returns the deadline
    /// error, if any, for the caller to return once the step is in place.
    fn admit_graph(
        &mut self,
        rows: u64,
        requests: u64,
        registry: &Registry,
        stream: &StreamRef,
    ) -> Result<Option<DeviceCaptureError>, DeviceCaptureError> {
        let bound = graph_step_bound(self.controls.mirrors(), rows, requests);
        let n = self.graph.admitted + 1;
        let step = || format!("graph-begun step {n} (of {rows} rows)");
        let index = self.graph.admitted;
        let stale = self.options.defer;
        let admitted = self.admission.admit(&self.ring, step, bound, StepKind::Graph, index, stale, stream)?;
        registry.stall().waited(self.admission.last_wait);
        if self.admission.refresh_snapshot {
            let addrs = self.ring.addrs();
            // SAFETY: the state and host blocks live as long as `self`; every capture of this ring runs on `stream`
            // (checked by the caller), in order with this launch.
            unsafe { self.kernels.refresh_tail_snap(stream, addrs.state, addrs.host) }?;
        }
        let late = match admitted {
            Admitted::Room => None,
            Admitted::Late(e) => Some(e),
        };
        if late.is_some() != self.graph.late {
            let flags = if late.is_some() { desc::DEADLINE as u64 } else { 0 };
            self.ring.set_graph_flags(flags, stream)?;
            self.graph.late = late.is_some();
        }
        self.graph.admitted = self.admission.last_index + 1;
        Ok(late)
    }

    /// Starts a step on `stream` (the engine's stream; not while it is capturing a graph): installs the batch
    /// descriptor for the captures that follow, uploads changed controls, and in full mode first waits until the
    /// drain has room for the whole step.
    pub fn begin_step(
        &mut self,
        registry: &Registry,
        batch: &StepBatch,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        self.gpu.bind()?;
        self.check_stream(&stream)?;
        if self.gpu.is_capturing(&stream)? {
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
        self.join_held(stream.clone())?;
        self.end_step()?;
        self.controls.sync(registry, &stream)?;
        let mut flags = 0u32;
        let mut deadline_error = None;
        if self.options.full_mode_deadline.is_some() {
            let bound = step_bound(self.controls.mirrors(), batch);
            let index = self.slots.next_index();
            let step = || format!("step {}", batch.step());
            let admitted = self.admission.admit(&self.ring, step, bound, StepKind::Host, index, false, &stream)?;
            registry.stall().waited(self.admission.last_wait);
            if let Admitted::Late(e) = admitted {
                flags |= desc::DEADLINE;
                deadline_error = Some(e);
            }
        }
        let (slot, desc_bytes) = self.slots.write(&self.ring, batch, flags)?;
        let addrs = self.ring.addrs();
        let grid = (desc_bytes.div_ceil(4096) as u32).clamp(1, 64);
        // SAFETY: the state block, host block and descriptor home live as long as `self`; the slot holds
        // `desc_bytes` bytes that `slots` does not rewrite until the GPU reports this kernel ran.
        unsafe {
            self.kernels.begin_step(
                &stream,
                grid,
                addrs.state,
                addrs.host,
                self.slots.home_addr(),
                slot,
                desc_bytes as u32,
                self.slots.next_index(),
            )
        }?;
        self.slots.mark_launched();
        self.deferred.begin_step();
        self.probes_in_step.clear();
        self.step_begun = true;
        self.step_stream = Some(stream);
        self.steps.begun(batch.step());
        match deadline_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
        src: DevicePtr,
        src_rows: u32,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        let checked = self.check_capture(hp, src, src_rows, &stream)?;
        self.issue_capture(checked, stream)
    }

    /// Like [`capture`](Self::capture), from a *last-rows* source: row `k` of `src` is the `k`-th of the step's last
    /// rows per request (in batch order) — a site the model computed for each request's last token only, such as the
    /// logits of a prefill that keeps only the last token's. Those rows are captured as the rows they are (their
    /// requests and positions), whatever the hookpoint's `all` / `last_per_request` selection; a row-list selection
    /// is refused (the list names batch rows the source does not hold). Steps begun inside a graph are refused too
    /// (their last rows are not known on the host); an eager step's captures may be recorded into a graph.
    pub fn capture_last_rows(
        &mut self,
        hp: &HookPoint,
        src: DevicePtr,
        src_rows: u32,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        self.check_last_rows(hp)?;
        let checked = self.check_capture(hp, src, src_rows, &stream)?;
        self.issue_capture(CaptureEntry { last_rows: true, ..checked }, stream)
    }

    /// Refuses a last-rows capture of `hp` that cannot be attributed.
    fn check_last_rows(&self, hp: &HookPoint) -> Result<(), DeviceCaptureError> {
        let name = &hp.spec().name;
        if self.graph_batch.is_some() {
            return Err(DeviceCaptureError::Usage(format!(
                "last-rows capture of `{name}` in a step begun inside a CUDA graph: its last rows per request are not \
                 known to the host; capture a full source (one row per batch row)"
            )));
        }
        if matches!(*hp.control().selection(), RowSelection::Rows(_)) {
            return Err(DeviceCaptureError::Usage(format!(
                "last-rows capture of `{name}`: the hookpoint selects a list of batch rows, which a source holding \
                 one row per request does not have; use rows = \"all\" or \"last_per_request\""
            )));
        }
        Ok(())
    }

    /// Everything [`capture`](Self::capture) checks before it launches (or notes) anything.
    fn check_capture(
        &mut self,
        hp: &HookPoint,
        src: DevicePtr,
        src_rows: u32,
        stream: &StreamRef,
    ) -> Result<CaptureEntry, DeviceCaptureError> {
        let name = &hp.spec().name;
        if !self.step_begun {
            return Err(DeviceCaptureError::Usage(format!(
                "capture of `{name}` before the first begin_step: the session must be given a step's batch first"
            )));
        }
        if !self.controls.uploaded(hp.id()) {
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
        // The kernel reads the downcast control at run time (a graph replays either way): check the larger row.
        let downcast_bytes = hp.spec().dtype.downcast().map_or(0, |d| d.row_bytes(hp.spec().row_width as u64));
        let record_row_bytes = (row_bytes as u64).max(downcast_bytes);
        let payload = footprint(src_rows as u64, record_row_bytes) as usize - HEADER_LEN;
        if payload > self.ring.max_payload_len() {
            return Err(DeviceCaptureError::Usage(format!(
                "{what}: {src_rows} rows × {record_row_bytes} bytes need a {payload}-byte record, but the ring takes at \
                 most {} per record (half its capacity); raise ring.capacity",
                self.ring.max_payload_len()
            )));
        }
        if self.options.defer && self.step_stream.as_ref() != Some(stream) {
            return Err(DeviceCaptureError::Usage(format!(
                "{what}: deferred captures must be issued on the stream their step began on"
            )));
        }
        let dtype = hp.spec().dtype.code() as u32;
        Ok(CaptureEntry { src: src.addr(), hookpoint: hp.id(), dtype, row_bytes, src_rows, last_rows: false })
    }

    /// Launches (or, deferred, notes) a capture that passed [`check_capture`](Self::check_capture).
    fn issue_capture(&mut self, entry: CaptureEntry, stream: StreamRef) -> Result<(), DeviceCaptureError> {
        if self.options.defer {
            if self.deferred.is_full() {
                self.join()?;
                self.flush_deferred(&stream)?;
            }
            self.deferred.note(entry);
            return Ok(());
        }
        let bytes = entry.src_rows as usize * entry.row_bytes as usize;
        // 16 KiB per block (256 threads × 4 × 16 B) up to two blocks per SM; larger captures loop.
        let grid = (bytes.div_ceil(16 << 10) as u32).clamp(1, self.gpu.sms() * 2);
        let args = CaptureArgs {
            hookpoint: entry.hookpoint,
            dtype: entry.dtype,
            row_bytes: entry.row_bytes,
            src: entry.src,
            src_rows: entry.src_rows,
            last_rows: entry.last_rows,
            full_mode: self.options.full_mode_deadline.is_some(),
        };
        self.join()?;
        // SAFETY: the ring and tables live as long as `self` (the session synchronises the device before dropping
        // them); `src` was checked to be device memory holding the rows and is covered by its
        // `DevicePtr::from_raw` promise.
        unsafe { self.kernels.capture(&stream, grid, &self.tables(), args) }?;
        Ok(())
    }

    /// Uploads a linear probe to this session's device ([`DeviceProbe::new`]).
    pub fn new_probe(
        &self,
        weights: &[f32],
        bias: &[f32],
        outputs: u32,
        width: u32,
        thresholds: Option<&[f32]>,
        max_rows: u32,
    ) -> Result<DeviceProbe, DeviceCaptureError> {
        DeviceProbe::new(&self.gpu, weights, bias, outputs, width, thresholds, max_rows)
    }

    /// A per-request flag table of `slots` slots mapped into this session's device ([`DeviceFlags::new`]).
    pub fn new_flags(&self, slots: u32) -> Result<Arc<DeviceFlags>, DeviceCaptureError> {
        DeviceFlags::new(&self.gpu, slots)
    }

    /// Fused probe: scores `src_rows` rows of `src_dtype` at `src` (each `probe.width()` elements, contiguous) with
    /// `probe` on `stream` — `s_k = W_k · x + b_k`, f32 accumulation — and captures the scores as a record of the f32
    /// hookpoint `scores_hp` (row width `probe.outputs()`), exactly as [`capture`](Self::capture) would capture them
    /// from device memory: row selection, sampling, counters, deferral and graph replays are the same. Rows past
    /// the step's batch (or the scores hookpoint's valid-rows scalar) are not scored. With thresholds and flags, the
    /// kernel raises the flag of each request one of whose rows reaches a threshold (at every step, whatever the
    /// hookpoint's sampling).
    ///
    /// Recordable into a CUDA graph like a capture: no host synchronisation, no allocation; every replay scores the
    /// rows `src` holds then. With deferred captures a probe may be used once per step (its one scores buffer is
    /// copied when the step ends).
    pub fn capture_probe(
        &mut self,
        probe: &DeviceProbe,
        scores_hp: &HookPoint,
        src: DevicePtr,
        src_dtype: DType,
        src_rows: u32,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        self.probe_rows(probe, scores_hp, src, src_dtype, src_rows, false, stream)
    }

    /// [`capture_probe`](Self::capture_probe) from a last-rows source (see
    /// [`capture_last_rows`](Self::capture_last_rows)): row `k` is scored as the step's `k`-th last row per request,
    /// and its scores are captured as that row's.
    pub fn capture_probe_last_rows(
        &mut self,
        probe: &DeviceProbe,
        scores_hp: &HookPoint,
        src: DevicePtr,
        src_dtype: DType,
        src_rows: u32,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        self.check_last_rows(scores_hp)?;
        self.probe_rows(probe, scores_hp, src, src_dtype, src_rows, true, stream)
    }

    #[allow(clippy::too_many_arguments)]
    fn probe_rows(
        &mut self,
        probe: &DeviceProbe,
        scores_hp: &HookPoint,
        src: DevicePtr,
        src_dtype: DType,
        src_rows: u32,
        last_rows: bool,
        stream: StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        let name = &scores_hp.spec().name;
        if probe.gpu_ordinal() != self.gpu.ordinal() {
            return Err(DeviceCaptureError::Usage(format!(
                "probe into `{name}` lives on device {}, the session on device {}",
                probe.gpu_ordinal(),
                self.gpu.ordinal()
            )));
        }
        probe.check_use(scores_hp.spec(), src_dtype, src_rows, self.options.max_batch_rows)?;
        let entry = CaptureEntry { last_rows, ..self.check_capture(scores_hp, probe.scores_ptr(), src_rows, &stream)? };
        let src_bytes = src_rows as usize * src_dtype.row_bytes(probe.width() as u64) as usize;
        self.gpu.check_device_range(&format!("probe source of `{name}`"), src, src_bytes, src_dtype.size())?;
        let scores = probe.scores_ptr().addr();
        if self.options.defer {
            if self.probes_in_step.contains(&scores) {
                return Err(DeviceCaptureError::Usage(format!(
                    "probe into `{name}` used twice in one step: with deferred captures its scores are copied when the \
                     step ends, so the second use would overwrite the first; use one probe per capture in a step"
                )));
            }
            self.probes_in_step.push(scores);
        }
        let (thresholds, flags, flag_slots) = probe.flag_args();
        let args = ProbeArgs {
            src: src.addr(),
            src_rows,
            last_rows,
            dtype: src_dtype.code() as u32,
            width: probe.width(),
            weights: probe.weights_addr(),
            bias: probe.bias_addr(),
            outputs: probe.outputs(),
            scores,
            controls: self.controls.table_addr(),
            hookpoint: scores_hp.id(),
            desc: self.slots.home_addr(),
            // In a step begun inside a graph the rows' requests come from the engine's tensors (with deferred
            // captures the descriptor is never built); the probe kernel numbers no step.
            graph_batch: GraphBatch::param(self.graph_batch.as_ref(), GraphRole::Later),
            thresholds,
            flags,
            flag_slots,
        };
        if self.options.defer {
            // Scored with the step's other probes by one kernel when the deferred captures are copied (the engine
            // keeps the rows unchanged until then, as for every deferred capture), right before its scores are.
            if self.deferred.is_full() {
                self.join()?;
                self.flush_deferred(&stream)?;
            }
            self.deferred.note_probe(args);
            return self.issue_capture(entry, stream);
        }
        // One block per row, up to eight blocks per SM (a block loops over further rows).
        let grid = src_rows.clamp(1, self.gpu.sms() * 8);
        // SAFETY: the probe's tables and scores buffer live as long as `probe` (and a graph recorded with them must
        // not outlive it: `DeviceProbe`'s contract), its flag table as long as the probe holds it; the control
        // table and descriptor live as long as `self`; `src` was checked to be device memory holding the rows and
        // is covered by its `DevicePtr::from_raw` promise; `src_rows` is at most the probe's `max_rows`, so the
        // scores fit; a graph batch was checked when the step began.
        unsafe { self.kernels.probe_scores(&stream, grid, args) }?;
        self.issue_capture(entry, stream)
    }

    /// Fills `bytes` (a multiple of 4) at device address `dst` with the pattern of
    /// [`pattern_word`](super::pattern_word) for `seed`, on `stream`. For tests and benchmarks.
    pub fn fill_pattern(&self, dst: DevicePtr, bytes: usize, seed: u64, stream: StreamRef) -> Result<(), CudaError> {
        if !bytes.is_multiple_of(4) {
            return Err(CudaError::Invalid(format!("fill_pattern: {bytes} bytes is not a multiple of 4")));
        }
        self.gpu.check_device_range("fill_pattern", dst, bytes, 4)?;
        let words = (bytes / 4) as u64;
        let grid = (words.div_ceil(THREADS as u64) as u32).clamp(1, self.gpu.sms() * 8);
        // SAFETY: `dst` was checked to be device memory of `bytes` bytes, and the caller's `DevicePtr::from_raw`
        // promise lets ringscope write it.
        unsafe { self.kernels.fill_pattern(&stream, grid, dst.addr(), words, seed) }
    }

    /// Benchmarks only: marks everything written so far as drained (the device `tail` jumps to `head`) on
    /// `stream`, so that capture kernels can be timed without a drain. Records skipped this way are never exported:
    /// never use it in a session. Only with the `bench-internals` feature.
    #[cfg(feature = "bench-internals")]
    pub fn discard_all_for_benchmarks(&self, stream: StreamRef) -> Result<(), CudaError> {
        // SAFETY: the state block lives as long as the ring, which `self` holds.
        unsafe { self.kernels.discard_all(&stream, self.ring.addrs().state) }
    }

    /// Reads the device counters (on a private stream: the engine's streams are not synchronised) and adds what
    /// changed since the last call to the hookpoints' host counters, logging the drops in the registry's event log
    /// with the steps begun since the last call. Exact once the engine's work has completed.
    pub fn fold_counters(&mut self, registry: &Registry) -> Result<(), CudaError> {
        let n = self.controls.mirrors().len();
        self.counters.fold(registry, n, &mut self.steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
