//! Full-mode step admission: before a step begun on the host may run, the ring must have room for everything the
//! step can capture, so that no capture kernel ever finds the ring full (kernels never wait: a spinning kernel
//! deadlocks against the drain's copies).
//!
//! The bound is a worst case ([`step_bound`]; [`graph_step_bound`] for a step begun inside a graph, whose batch
//! the host does not see): every enabled, sampled hookpoint once, plus one wrap. Room is judged against what the
//! host knows without a device read: bytes published (host block), bytes the drain handed back, and the bounds of
//! earlier admitted steps whose captures may not have run yet (`pending`). Those reservations retire when the GPU
//! reports that the next step of the same kind began (host-begun steps: `progress`, written by the begin kernel;
//! graph-begun steps: `graph_begun`, written by the step's first kernel; everything issued before it is done), or
//! — when the host is waiting anyway — when an event recorded on the engine's stream completes.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ringscope_ring::cuda::{DeviceRing, Event, Gpu, StreamRef};
use ringscope_ring::record::{align_up, HEADER_LEN, ROW_META_LEN};
use ringscope_ring::space;

use super::controls::{HostMirror, RowMode};
use super::DeviceCaptureError;
use crate::batch::StepBatch;

/// Ring bytes of a record of `rows` rows of `row_bytes` bytes (header, row metadata, rows), as the kernels and the
/// host encoder lay it out.
pub(super) fn footprint(rows: u64, row_bytes: u64) -> u64 {
    align_up(HEADER_LEN + align_up(rows as usize * ROW_META_LEN) + (rows * row_bytes) as usize) as u64
}

/// Worst-case ring bytes the step's captures can take: every enabled, sampled hookpoint once, plus one wrap.
pub(super) fn step_bound(mirrors: &[HostMirror], batch: &StepBatch) -> u64 {
    let n = batch.len() as u64;
    let n_last = batch.last_per_request().len() as u64;
    let (mut sum, mut max) = (0u64, 0u64);
    for m in mirrors {
        let c = &m.control;
        if c.enabled == 0 || !batch.step().is_multiple_of(c.every_n.max(1) as u64) {
            continue;
        }
        let rows = match c.mode {
            RowMode::All => n,
            RowMode::List => (c.list_len as u64).min(n),
            RowMode::LastPerRequest => n_last,
        };
        let f = footprint(rows, m.row_bytes as u64);
        sum += f;
        max = max.max(f);
    }
    sum + max
}

/// Worst-case ring bytes of a step begun inside a graph of `rows` batch rows and `requests` requests (batch rows
/// of the graph's `[batch, seq]` shape): every enabled hookpoint once — sampled or not, since the device numbers
/// graph steps — plus one wrap.
pub(super) fn graph_step_bound(mirrors: &[HostMirror], rows: u64, requests: u64) -> u64 {
    let (mut sum, mut max) = (0u64, 0u64);
    for m in mirrors {
        let c = &m.control;
        if c.enabled == 0 {
            continue;
        }
        let rows = match c.mode {
            RowMode::All => rows,
            RowMode::List => (c.list_len as u64).min(rows),
            RowMode::LastPerRequest => requests.min(rows),
        };
        let f = footprint(rows, m.row_bytes as u64);
        sum += f;
        max = max.max(f);
    }
    sum + max
}

/// Which begin counter tells that an admitted step has started on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StepKind {
    /// Begun on the host (`begin_step`): its begin kernel writes `progress`.
    Host,
    /// Begun inside a graph: its first kernel writes `graph_begun`.
    Graph,
}

/// Reservations of admitted steps whose captures may not have run yet, per kind in begin order, and their sum: each
/// admission retires and sums in constant time (amortised), however far the host runs ahead.
#[derive(Debug, Default)]
struct Pending {
    /// (begin index, worst-case bytes) of host-begun steps.
    host: VecDeque<(u64, u64)>,
    /// The same of graph-begun steps.
    graph: VecDeque<(u64, u64)>,
    /// Their bytes in all.
    bytes: u64,
}

impl Pending {
    fn push(&mut self, kind: StepKind, index: u64, bound: u64) {
        match kind {
            StepKind::Host => self.host.push_back((index, bound)),
            StepKind::Graph => self.graph.push_back((index, bound)),
        }
        self.bytes += bound;
    }

    /// Retires the reservations of steps whose next step of the same kind began on the device (`progress` host-begun
    /// steps, `graph_begun` graph-begun steps have begun).
    fn retire(&mut self, progress: u64, graph_begun: u64) {
        for (queue, begun) in [(&mut self.host, progress), (&mut self.graph, graph_begun)] {
            while let Some(&(index, bound)) = queue.front() {
                if index + 1 >= begun {
                    break;
                }
                queue.pop_front();
                self.bytes -= bound;
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.host.is_empty() && self.graph.is_empty()
    }

    fn clear(&mut self) {
        self.host.clear();
        self.graph.clear();
        self.bytes = 0;
    }
}

/// What admission decided for a step.
#[derive(Debug)]
pub(super) enum Admitted {
    /// There is room for the whole step (or the session is best-effort).
    Room,
    /// The drain did not free room before the deadline: the step is begun with its captures dropped and counted as
    /// `deadline` on the device, and this error goes back to the engine.
    Late(DeviceCaptureError),
}

/// Full-mode admission state: the deadline, the reservations of admitted steps that may not have run yet, and the
/// marker event that tells when they all have.
pub(super) struct Admission {
    deadline: Option<Duration>,
    /// (kind, begin index among steps of that kind, worst-case bytes) of admitted steps whose captures may not have
    /// run yet.
    pending: Pending,
    /// Recorded on the engine's stream when a step must wait, to learn when every earlier step's captures have run
    /// (their reservations can then be retired).
    marker: Event,
    /// How long the last `admit` waited (zero when there was room at once).
    pub(super) last_wait: Duration,
    /// The begin index the last admitted step took: the one asked for, or — for a graph-begun step admitted after
    /// waiting for the marker — the device's count of graph-begun steps, which is exact then (everything issued
    /// before has run), so a host count that drifted from the device's is set right.
    pub(super) last_index: u64,
    /// The last admission found room only counting what the drain handed back, more than the device's tail
    /// snapshot says: the caller must refresh the snapshot on the stream before the step's captures.
    pub(super) refresh_snapshot: bool,
}

impl Admission {
    /// `deadline`: `Some` in full mode (how long a step may wait for room), `None` in best-effort.
    pub(super) fn new(gpu: &Arc<Gpu>, deadline: Option<Duration>) -> Result<Admission, DeviceCaptureError> {
        Ok(Admission {
            deadline,
            pending: Pending::default(),
            marker: Event::new(gpu, false)?,
            last_wait: Duration::ZERO,
            last_index: 0,
            refresh_snapshot: false,
        })
    }

    /// Full mode: changes the deadline of the next admissions.
    pub(super) fn set_deadline(&mut self, deadline: Duration) {
        if self.deadline.is_some() {
            self.deadline = Some(deadline);
        }
    }

    /// Whether this is full mode (admission can wait).
    pub(super) fn full_mode(&self) -> bool {
        self.deadline.is_some()
    }

    /// Full mode: waits, up to the deadline, until the ring has room for `bound` more bytes on top of what earlier
    /// steps may still write, and reserves it for the step of `kind` with begin index `index` (`step` names the step
    /// in errors; called only for one). Best-effort admits at once.
    ///
    /// `stale_snapshot`: the step's captures decide on a tail snapshot no begin kernel of the step refreshes (graph-
    /// begun steps with deferred captures). Room is then judged against the snapshot the kernels last mirrored, and
    /// where only the drain's newer position gives room, [`refresh_snapshot`](Self::refresh_snapshot) tells the
    /// caller to refresh it on the stream first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn admit(
        &mut self,
        ring: &DeviceRing,
        step: impl Fn() -> String,
        bound: u64,
        kind: StepKind,
        mut index: u64,
        stale_snapshot: bool,
        stream: &StreamRef,
    ) -> Result<Admitted, DeviceCaptureError> {
        self.last_index = index;
        self.refresh_snapshot = false;
        let Some(deadline) = self.deadline else { return Ok(Admitted::Room) };
        let cap = ring.capacity() as u64;
        if bound > cap {
            return Err(DeviceCaptureError::Usage(format!(
                "full mode: {} can capture up to {bound} bytes, more than the ring's {cap}; raise \
                 ring.capacity or select fewer rows",
                step()
            )));
        }
        let started = Instant::now();
        let until = started + deadline;
        let mut marker_recorded = false;
        self.last_wait = Duration::ZERO;
        loop {
            // A step's reservation retires once the next step of its kind began on the device.
            self.pending.retire(ring.progress(), ring.graph_begun());
            if marker_recorded && !self.pending.is_empty() && self.marker.query()? {
                // Everything issued before this begin_step has run: no earlier step can still write, and the
                // device's count of graph-begun steps is final for them.
                self.pending.clear();
                if kind == StepKind::Graph {
                    index = ring.graph_begun();
                }
            }
            let in_flight = self.pending.bytes;
            let worst_head = ring.published() + in_flight;
            let released = ring.released();
            if space::fits(worst_head, released, bound, cap) {
                self.refresh_snapshot = stale_snapshot && !space::fits(worst_head, ring.tail_snap(), bound, cap);
                if marker_recorded {
                    // It had to wait (the marker is recorded on the first miss).
                    self.last_wait = started.elapsed();
                }
                break;
            }
            if !marker_recorded {
                self.marker.record(stream)?;
                marker_recorded = true;
            }
            if Instant::now() >= until {
                self.last_wait = started.elapsed();
                self.last_index = index;
                return Ok(Admitted::Late(DeviceCaptureError::Deadline {
                    step: step(),
                    needed: bound,
                    waited_ms: started.elapsed().as_millis() as u64,
                }));
            }
            let wait = Instant::now() + Duration::from_micros(200);
            ring.wait_released(worst_head + bound - cap, wait.min(until))?;
        }
        self.pending.push(kind, index, bound);
        self.last_index = index;
        Ok(Admitted::Room)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_retire_per_kind_once_the_next_step_of_that_kind_began() {
        let mut p = Pending::default();
        p.push(StepKind::Host, 0, 100);
        p.push(StepKind::Graph, 0, 10);
        p.push(StepKind::Graph, 1, 20);
        p.push(StepKind::Host, 1, 200);
        assert_eq!(p.bytes, 330);
        // Host step 0's begin kernel ran (progress 1): step 0 may still be capturing.
        p.retire(1, 0);
        assert_eq!(p.bytes, 330);
        // Host step 1 began: step 0 is done. Graph step 1 began: graph step 0 is done.
        p.retire(2, 2);
        assert_eq!((p.bytes, p.host.len(), p.graph.len()), (220, 1, 1));
        p.retire(u64::MAX, u64::MAX);
        assert!(p.is_empty() && p.bytes == 0);
        p.push(StepKind::Graph, 7, 5);
        p.clear();
        assert!(p.is_empty() && p.bytes == 0);
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
}
