//! Deferred captures ([`DeviceCaptureOptions::defer`](super::DeviceCaptureOptions::defer)): a capture only notes the
//! tensor, and one `ringscope_capture_many` kernel copies all of a step's captures — at the step's end on the step's
//! stream, or earlier ([`Deferred::submit`]) on a side stream forked from it, so that the copy overlaps the engine's
//! remaining work. One kernel node per step instead of one per hookpoint (a node between an engine's kernels costs
//! ~2–4 µs however little it does).
//!
//! Ordering: all kernels of one ring must run in order (module docs of `ringscope_ring::cuda::ring`), so the step's
//! stream waits for the side stream's kernel ([`Deferred::join`]) before anything else of ringscope's runs on it —
//! and the engine reuses captured memory only after it was copied.
//!
//! Held copies ([`Deferred::hold`]): a step recorded into a CUDA graph can leave its copy out of the graph. Its
//! kernel's arguments are kept under a slot number, and the engine launches them after each replay of that graph
//! ([`Deferred::launch_held`], on the side stream, beside the engine's work after the graph — an LM head, say), then
//! makes its stream wait for them ([`Deferred::join_held`]) before it reuses the memory the copy reads.

use std::collections::HashMap;
use std::sync::Arc;

use ringscope_ring::cuda::{Event, Gpu, Stream, StreamRef};

use super::kernels::{
    CaptureEntry, CaptureTables, GraphBatch, GraphRole, Kernels, ManyParam, ProbeArgs, ProbeManyParam, MAX_MANY,
    MAX_PROBE_MANY,
};
use super::DeviceCaptureError;

/// What a flush needs from the rest of the capture side.
pub(super) struct FlushContext<'a> {
    pub gpu: &'a Gpu,
    pub kernels: &'a Kernels,
    pub tables: CaptureTables,
    /// The open step's batch when it was begun inside a graph (the kernel reads it instead of the descriptor).
    pub graph_batch: Option<&'a GraphBatch>,
    pub full_mode: bool,
}

/// The open step's deferred captures, and the side stream with the events that fork it from the step's stream and
/// join it back.
pub(super) struct Deferred {
    entries: Vec<CaptureEntry>,
    /// Fused probes noted this step: scored by one kernel right before the captures of their scores are copied.
    probes: Vec<ProbeArgs>,
    /// Capture kernels the step has launched for its deferred captures (the first numbers a graph-begun step).
    step_flushes: u32,
    side: Stream,
    fork_event: Event,
    join_event: Event,
    /// Whether the step's stream still owes a wait for the side stream.
    join_pending: bool,
    /// Held copies by slot: what a step recorded into a graph left out of it.
    held: HashMap<u32, Held>,
    /// Marks the end of the last held copy launched, until an engine stream waited for it.
    held_event: Event,
    held_pending: bool,
}

/// A held copy: the captures and probes of a step recorded into a graph, its batch, and whether it numbers its step
/// (it does unless part of the step was copied inside the graph: more captures than one kernel takes).
#[derive(Debug, Clone)]
struct Held {
    entries: Vec<CaptureEntry>,
    probes: Vec<ProbeArgs>,
    batch: GraphBatch,
    role: GraphRole,
}

impl Deferred {
    /// No captures noted; a side stream and its events on `gpu`.
    pub(super) fn new(gpu: &Arc<Gpu>) -> Result<Deferred, DeviceCaptureError> {
        Ok(Deferred {
            entries: Vec::new(),
            probes: Vec::new(),
            step_flushes: 0,
            side: Stream::new(gpu)?,
            fork_event: Event::new(gpu, false)?,
            join_event: Event::new(gpu, false)?,
            join_pending: false,
            held: HashMap::new(),
            held_event: Event::new(gpu, false)?,
            held_pending: false,
        })
    }

    /// A step begins: its first flush numbers it.
    pub(super) fn begin_step(&mut self) {
        self.step_flushes = 0;
    }

    /// Whether one kernel's worth of captures is noted (flush before noting another).
    pub(super) fn is_full(&self) -> bool {
        self.entries.len() == MAX_MANY || self.probes.len() == MAX_PROBE_MANY
    }

    /// Notes a fused probe (its scores' capture is noted next); the caller flushes first when
    /// [`is_full`](Self::is_full).
    pub(super) fn note_probe(&mut self, probe: ProbeArgs) {
        debug_assert!(!self.is_full());
        self.probes.push(probe);
    }

    /// Notes a capture; the caller checked it and flushes first when [`is_full`](Self::is_full).
    pub(super) fn note(&mut self, entry: CaptureEntry) {
        debug_assert!(!self.is_full());
        self.entries.push(entry);
    }

    /// Forgets captures not flushed (the step ended with an error).
    pub(super) fn clear(&mut self) {
        self.entries.clear();
        self.probes.clear();
    }

    /// Launches one `ringscope_capture_many` on `stream` for the captures noted so far.
    pub(super) fn flush(&mut self, cx: &FlushContext<'_>, stream: &StreamRef) -> Result<(), DeviceCaptureError> {
        let probes = std::mem::take(&mut self.probes);
        let entries = std::mem::take(&mut self.entries);
        if entries.is_empty() && probes.is_empty() {
            return Ok(());
        }
        let role = if self.step_flushes == 0 { GraphRole::First } else { GraphRole::Later };
        if !entries.is_empty() {
            self.step_flushes += 1;
        }
        launch(cx, cx.graph_batch, &probes, &entries, role, stream)
    }

    /// Starts copying the captures noted so far now, on the side stream forked from `step_stream`; a later
    /// [`join`](Self::join) makes the step's stream wait for it. Inside a graph recording the fork and the join are
    /// recorded too.
    pub(super) fn submit(&mut self, cx: &FlushContext<'_>, step_stream: &StreamRef) -> Result<(), DeviceCaptureError> {
        if self.entries.is_empty() && self.probes.is_empty() {
            return Ok(());
        }
        cx.gpu.bind()?;
        // While the step's stream records a graph, this forks the side stream into the same graph.
        self.fork_event.record(step_stream)?;
        self.side.stream_ref().wait_event(&self.fork_event)?;
        let side = self.side.handle();
        self.flush(cx, &side)?;
        self.join_event.record(&side)?;
        self.join_pending = true;
        Ok(())
    }

    /// The step's stream waits (in stream order) for what [`submit`](Self::submit) launched, so that no two
    /// kernels write the ring at once and the engine reuses captured memory only after it was copied.
    pub(super) fn join(&mut self, gpu: &Gpu, step_stream: &StreamRef) -> Result<(), DeviceCaptureError> {
        wait_if_pending(&mut self.join_pending, &self.join_event, gpu, step_stream)
    }

    /// Keeps the captures and probes noted so far as held copy `slot` (replacing one kept there) instead of copying
    /// them: the step, begun inside a graph with `batch`, ends without its copy, which
    /// [`launch_held`](Self::launch_held) launches after each replay.
    pub(super) fn hold(&mut self, slot: u32, batch: GraphBatch) {
        let role = if self.step_flushes == 0 { GraphRole::First } else { GraphRole::Later };
        let held =
            Held { entries: std::mem::take(&mut self.entries), probes: std::mem::take(&mut self.probes), batch, role };
        self.held.insert(slot, held);
    }

    /// Launches held copy `slot` on the side stream, after what `stream` has been given so far (outside graph
    /// recording); [`join_held`](Self::join_held) makes an engine stream wait for it. Held copies run in the order
    /// they are launched (one side stream).
    pub(super) fn launch_held(
        &mut self,
        cx: &FlushContext<'_>,
        slot: u32,
        stream: &StreamRef,
    ) -> Result<(), DeviceCaptureError> {
        let Some(held) = self.held.get(&slot) else {
            let mut slots: Vec<u32> = self.held.keys().copied().collect();
            slots.sort_unstable();
            return Err(DeviceCaptureError::Usage(format!(
                "launch_held: no held copy in slot {slot} (held: {slots:?}); a step recorded into a graph is held with \
                 hold_step"
            )));
        };
        cx.gpu.bind()?;
        self.fork_event.record(stream)?;
        self.side.stream_ref().wait_event(&self.fork_event)?;
        let side = self.side.handle();
        launch(cx, Some(&held.batch), &held.probes, &held.entries, held.role, &side)?;
        self.held_event.record(&side)?;
        self.held_pending = true;
        Ok(())
    }

    /// Whether a held copy was launched that no engine stream has waited for yet.
    pub(super) fn held_pending(&self) -> bool {
        self.held_pending
    }

    /// `stream` waits (in stream order) for the held copies launched so far. Nothing to do when none is pending.
    pub(super) fn join_held(&mut self, gpu: &Gpu, stream: &StreamRef) -> Result<(), DeviceCaptureError> {
        wait_if_pending(&mut self.held_pending, &self.held_event, gpu, stream)
    }
}

/// `stream` waits for `event` if `pending` (which it clears).
fn wait_if_pending(pending: &mut bool, event: &Event, gpu: &Gpu, stream: &StreamRef) -> Result<(), DeviceCaptureError> {
    if !*pending {
        return Ok(());
    }
    gpu.bind()?;
    stream.wait_event(event)?;
    *pending = false;
    Ok(())
}

/// Launches one probe kernel for `probes` (if any) and one `ringscope_capture_many` for `entries` (if any) on
/// `stream`, reading the step's rows from `graph_batch` (or the descriptor).
fn launch(
    cx: &FlushContext<'_>,
    graph_batch: Option<&GraphBatch>,
    probes: &[ProbeArgs],
    entries: &[CaptureEntry],
    role: GraphRole,
    stream: &StreamRef,
) -> Result<(), DeviceCaptureError> {
    if !probes.is_empty() {
        // The probes read the step's rows from the descriptor or the graph batch; they number no step.
        let mut param = ProbeManyParam::new(GraphBatch::param(graph_batch, GraphRole::Later), probes);
        let n = probes.len() as u32;
        let rows = probes.iter().map(|p| p.src_rows).max().unwrap_or(1);
        // Blocks per probe: one per row, up to eight blocks per SM in all (each loops over further rows).
        let per_probe = rows.clamp(1, (cx.gpu.sms() * 8 / n).max(1));
        cx.gpu.bind()?;
        // SAFETY: every probe's tables and scores buffer were checked when it was noted and live as long as the
        // probe (whose contract covers graphs recorded with it); sources are covered by their `DevicePtr::from_raw`
        // promise until the step ends (a held copy's: until it has run after each replay); the control table and
        // descriptor live as long as the capture side; a graph batch was checked when the step began.
        unsafe { cx.kernels.probe_scores_many(stream, n * per_probe, cx.tables.controls, cx.tables.desc, &mut param) }?;
    }
    if entries.is_empty() {
        return Ok(());
    }
    let bytes: u64 = entries.iter().map(|e| e.src_rows as u64 * e.row_bytes as u64).sum();
    let mut param = ManyParam::new(GraphBatch::param(graph_batch, role), entries, cx.full_mode);
    // A block per 4 KiB: with few bytes more blocks finish the copy sooner than their last-block handshake costs
    // (16 x 2048 bf16 rows: 6.9 us per kernel on an H100 with 16 blocks, 8.1 us with 4). Chosen for batch 1; a block
    // per 8 KiB was 0.2-0.3 us faster at 16 x 8 rows and 0.3-0.5 us slower at batch 1, and at 16 x 64 rows this
    // rule is 0.2 us slower than 16 KiB (docs/gpu-benchmarks.md, session 40).
    let grid = (bytes.div_ceil(4 << 10) as u32).clamp(1, cx.gpu.sms() * 2);
    cx.gpu.bind()?;
    // SAFETY: the tables live as long as the capture side (the session synchronises the device before dropping
    // them); every source was checked to be device memory when it was noted and is covered by its
    // `DevicePtr::from_raw` promise until the step ends (a held copy's: until it has run after each replay); a graph
    // batch was checked when the step began.
    unsafe { cx.kernels.capture_many(stream, grid, &cx.tables, &mut param) }?;
    Ok(())
}
