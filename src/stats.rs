//! What a running session is doing, as numbers: [`Session::stats`](crate::Session::stats) — cheap enough to read
//! every step (atomic loads and short locks; allocations only per hookpoint and per destination, never per record).
//!
//! Counters are cumulative since the session started; a reader that wants rates differences two snapshots (their
//! `unix_ns` / `uptime` say how far apart they are). Gauges (ring occupancy, queued bytes) are the value at the
//! moment of the read. The same numbers in the Prometheus text format: [`crate::metrics`].

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use ringscope_exporter::DrainMonitor;
use ringscope_hookpoint::{Control, Registry, RowSelection};
use ringscope_policy::{CounterSnapshot, Mode};

pub use ringscope_exporter::{DestinationKind, DestinationStats, DrainStats};

/// A session's numbers at one moment ([`Session::stats`](crate::Session::stats)).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionStats {
    /// When this snapshot was taken, in nanoseconds since the Unix epoch.
    pub unix_ns: u64,
    /// Time since the session started (monotonic: difference two snapshots' `uptime` for rates).
    pub uptime: Duration,
    /// The loss policy's mode.
    pub mode: Mode,
    /// The ring's backend: `"host"` or `"cuda"`.
    pub backend: &'static str,
    /// Steps begun so far through `begin_step` / `begin_step_on` (a step whose full-mode admission ran past the
    /// deadline is begun, and counted). Steps begun inside a CUDA graph (`begin_step_graph`, and every replay of
    /// it) are numbered on the device and not counted here.
    pub steps: u64,
    /// The number of the last step counted in `steps`.
    pub last_step: Option<u64>,
    /// Mean wall time from `begin_step` (or `begin_step_on`) to `end_step`, over the last
    /// [`STEP_WINDOW`] steps that ended — the engine's own report of a step. On the CUDA backend this is the time
    /// the engine's thread took to issue the step (kernels run asynchronously), which is the step's time only when
    /// the engine waits for its GPU work within the step. `None` until a step has ended, and for steps begun
    /// inside a graph (their replays make no host call).
    pub step_time: Option<Duration>,
    /// Mean wall time from one `begin_step` to the next, over the last [`STEP_WINDOW`] steps: the engine's step
    /// period, including whatever it did between steps (an idle engine shows a long period). `None` before the
    /// second step.
    pub step_interval: Option<Duration>,
    /// How full the ring is.
    pub ring: RingStats,
    /// Full mode: how many times producers waited for room (captures on the host backend, step admission on the
    /// CUDA backend).
    pub stalls: u64,
    /// How long those waits took together.
    pub stall_time: Duration,
    /// What the drain has moved out of the ring.
    pub drain: DrainStats,
    /// Each sink's and consumer's progress and lag, sinks first, then subscriptions in the order they were made.
    pub destinations: Vec<DestinationStats>,
    /// Each hookpoint's counters and production, in id order.
    pub hookpoints: Vec<HookPointStats>,
}

/// How full the ring is, read without touching the engine's or the drain's path (no lock they take, no device call).
///
/// * Host backend: `used_bytes` is ring memory published by captures and not yet given back to the producer —
///   records waiting for the drain and records lent to destinations (a lent record holds its space, and the space
///   after it, until it is returned). `held_bytes` is the part lent to sinks and consumers' queues. A capture waits
///   (full mode) or drops (best-effort) when `used_bytes` leaves no room.
/// * CUDA backend: `used_bytes` is device ring memory published by capture kernels and not yet copied out by the
///   drain (the host knows both positions: kernels publish their head to mapped host memory, the drain records
///   what its copies handed back). Bytes a kernel is writing and has not published are not included.
///   `held_bytes` is the drain's pinned staging (as large as the ring) lent to sinks and consumers' queues: it is
///   separate memory, not part of `used_bytes`, and when it is all held the drain cannot copy more out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Bytes of the ring.
    pub capacity_bytes: u64,
    /// Bytes published and not yet reclaimed (see the type's docs per backend).
    pub used_bytes: u64,
    /// Bytes lent to sinks and consumers.
    pub held_bytes: u64,
}

/// One hookpoint's numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookPointStats {
    /// Its id (as written in records).
    pub id: u32,
    /// Its name.
    pub name: String,
    /// Bytes of one row (row width × element size).
    pub row_bytes: u64,
    /// Its loss counters. On the CUDA backend the device-counted ones (produced, sampled out, published, ring
    /// full, deadline, too large) are those folded into the host by the last [`Session::accounting`] call, since
    /// folding reads device memory: call that when fresh device counts are needed (it waits for one small copy on
    /// a private stream, never for the engine).
    ///
    /// [`Session::accounting`]: crate::Session::accounting
    pub counters: CounterSnapshot,
    /// Activation bytes offered for capture so far: `counters.produced.rows × row_bytes` (before sampling and
    /// drops). Difference two snapshots and divide by the steps between them for bytes per step.
    pub produced_bytes: u64,
    /// Activation bytes that entered the ring (`counters.published.rows × row_bytes`).
    pub published_bytes: u64,
    /// Activation bytes that reached every destination (`counters.exported.rows × row_bytes`).
    pub exported_bytes: u64,
    /// The capture level its controls select now ([`rung_label`]).
    pub rung: String,
}

/// Steps the means of [`SessionStats::step_time`] and [`SessionStats::step_interval`] are taken over.
pub const STEP_WINDOW: usize = 16;

/// The capture level a hookpoint's controls select, as a short label: `"off"` (disabled), `"full"` (every row of
/// every step), `"last_row"` (the last row of each request), `"rows"` (an explicit list of batch rows),
/// `"every_N"` (every N-th step), or a sampling and a row selection joined with `+` (`"every_4+last_row"`).
///
/// The one place the label is made: a new control adds its part here.
pub fn rung_label(control: &Control) -> String {
    // What captures follow: the user's settings with the policy manager's rung over them.
    if !control.effective_enabled() {
        return "off".into();
    }
    let mut parts: Vec<String> = Vec::new();
    let n = control.effective_every_n();
    if n > 1 {
        parts.push(format!("every_{n}"));
    }
    match &*control.effective_selection() {
        RowSelection::All => {}
        RowSelection::LastPerRequest => parts.push("last_row".into()),
        RowSelection::Rows(_) => parts.push("rows".into()),
    }
    if control.effective_downcast() {
        parts.push("downcast".into());
    }
    if parts.is_empty() {
        "full".into()
    } else {
        parts.join("+")
    }
}

/// The engine's step reports: begun steps, and the recent durations and periods.
#[derive(Debug, Default)]
pub(crate) struct StepClock(Mutex<StepTimes>);

#[derive(Debug, Default)]
struct StepTimes {
    steps: u64,
    last_step: Option<u64>,
    /// When the open step began, if it was begun on the host.
    open: Option<Instant>,
    last_begin: Option<Instant>,
    durations: Window,
    intervals: Window,
}

/// The last [`STEP_WINDOW`] samples.
#[derive(Debug, Default)]
struct Window {
    samples: [Duration; STEP_WINDOW],
    len: usize,
    next: usize,
}

impl Window {
    fn push(&mut self, d: Duration) {
        self.samples[self.next] = d;
        self.next = (self.next + 1) % STEP_WINDOW;
        self.len = (self.len + 1).min(STEP_WINDOW);
    }

    fn mean(&self) -> Option<Duration> {
        (self.len > 0).then(|| self.samples[..self.len].iter().sum::<Duration>() / self.len as u32)
    }
}

impl StepClock {
    /// Step `step` was begun on the host (`None`: a step begun inside a graph, which is not timed).
    pub(crate) fn begun(&self, step: Option<u64>) {
        let now = Instant::now();
        let mut t = self.0.lock();
        let Some(step) = step else {
            (t.open, t.last_begin) = (None, None);
            return;
        };
        if let Some(prev) = t.last_begin {
            t.intervals.push(now - prev);
        }
        t.last_begin = Some(now);
        t.open = Some(now);
        t.steps += 1;
        t.last_step = Some(step);
    }

    /// The open step ended.
    pub(crate) fn ended(&self) {
        let now = Instant::now();
        let mut t = self.0.lock();
        if let Some(began) = t.open.take() {
            t.durations.push(now - began);
        }
    }
}

/// What [`Session::stats`](crate::Session::stats) reads, shared with the metrics endpoint's thread.
pub(crate) struct Observer {
    pub(crate) registry: Arc<Registry>,
    pub(crate) monitor: DrainMonitor,
    pub(crate) steps: StepClock,
    pub(crate) started: Instant,
    pub(crate) mode: Mode,
    pub(crate) backend: &'static str,
}

impl Observer {
    pub(crate) fn stats(&self) -> SessionStats {
        let unix_ns = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let (steps, last_step, step_time, step_interval) = {
            let t = self.steps.0.lock();
            (t.steps, t.last_step, t.durations.mean(), t.intervals.mean())
        };
        let ring = self.monitor.ring();
        let (stalls, stall_time) = self.registry.stall().total();
        let hookpoints = self
            .registry
            .all()
            .iter()
            .map(|hp| {
                let counters = hp.counters().snapshot();
                let row_bytes = hp.spec().row_bytes() as u64;
                HookPointStats {
                    id: hp.id(),
                    name: hp.spec().name.clone(),
                    row_bytes,
                    produced_bytes: counters.produced.rows * row_bytes,
                    published_bytes: counters.published.rows * row_bytes,
                    exported_bytes: counters.exported.rows * row_bytes,
                    counters,
                    rung: rung_label(hp.control()),
                }
            })
            .collect();
        SessionStats {
            unix_ns,
            uptime: self.started.elapsed(),
            mode: self.mode,
            backend: self.backend,
            steps,
            last_step,
            step_time,
            step_interval,
            ring: RingStats { capacity_bytes: ring.capacity, used_bytes: ring.used, held_bytes: ring.held },
            stalls,
            stall_time,
            drain: self.monitor.drain(),
            destinations: self.monitor.destinations(),
            hookpoints,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringscope_ring::{DType, HookPointSpec, SiteKind};

    #[test]
    fn rung_labels_follow_the_controls() {
        let registry = Registry::new();
        let spec = HookPointSpec {
            name: "h".into(),
            site: SiteKind::Residual,
            layer: Some(0),
            dtype: DType::F32,
            row_width: 4,
        };
        let c = registry.register(spec).unwrap();
        let c = c.control();
        assert_eq!(rung_label(c), "full");
        c.set_selection(RowSelection::LastPerRequest).unwrap();
        assert_eq!(rung_label(c), "last_row");
        c.set_every_n_steps(4).unwrap();
        assert_eq!(rung_label(c), "every_4+last_row");
        c.set_selection(RowSelection::All).unwrap();
        assert_eq!(rung_label(c), "every_4");
        c.set_selection(RowSelection::Rows(vec![0, 2])).unwrap();
        assert_eq!(rung_label(c), "every_4+rows");
        c.set_enabled(false);
        assert_eq!(rung_label(c), "off");
        // The policy manager's layer shows too.
        c.set_enabled(true);
        c.set_selection(RowSelection::All).unwrap();
        c.set_keep(ringscope_policy::Keep { every_n: 2, last_row: true, ..Default::default() });
        assert_eq!(rung_label(c), "every_8+last_row");
        c.set_keep(ringscope_policy::Keep { every_n: 2, last_row: true, downcast: true, off: false });
        assert_eq!(rung_label(c), "every_8+last_row+downcast");
    }

    #[test]
    fn the_step_window_keeps_the_last_samples() {
        let mut w = Window::default();
        assert_eq!(w.mean(), None);
        w.push(Duration::from_millis(4));
        w.push(Duration::from_millis(2));
        assert_eq!(w.mean(), Some(Duration::from_millis(3)));
        for _ in 0..STEP_WINDOW {
            w.push(Duration::from_millis(10));
        }
        assert_eq!(w.mean(), Some(Duration::from_millis(10)), "older samples leave the window");
    }

    #[test]
    fn graph_steps_are_not_counted_or_timed() {
        let clock = StepClock::default();
        clock.begun(Some(7));
        clock.ended();
        clock.begun(None);
        clock.ended();
        let t = clock.0.lock();
        assert_eq!((t.steps, t.last_step, t.durations.len, t.intervals.len), (1, Some(7), 1, 0));
    }
}
