//! The drain: ring → records → one bounded queue per sink or consumer.
//!
//! The drain thread takes each published record from the ring *without copying it* — the ring lends the payload
//! ([`ringscope_ring::Lease`]) and gets the space back when the last holder drops the record — and offers it to every
//! destination whose filter matches. Each sink runs on its own worker thread behind a queue whose backlog is bounded
//! in bytes (the sinks of a pool — a file format's `export.threads` — share one queue, see [`Drain::spawn_pools`]);
//! consumers read their queue from their own threads (and get their own copy when they receive). When a
//! backlog is full the policy decides: full mode waits (up to the deadline — the ring then fills and back-pressure
//! reaches the producer), best-effort drops the record for that destination and counts it.
//!
//! Ring space comes back in ring order, so one record held long would hold everything after it. When more than half
//! of the ring is held, the drain moves the records waiting in destinations' queues out of the ring into host memory
//! (bounded by the backlogs); what sinks hold while writing is bounded by their batches. A slow destination thus
//! costs host memory up to its backlog, never the ring — and in best-effort mode never stalls capture or the other
//! destinations.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crossbeam::channel::{Receiver, Sender};
use parking_lot::Mutex;
use ringscope_policy::{DropReason, LossPolicy, Mode};
use ringscope_ring::RecordSource;

use crate::routing::catalog::{Catalog, CatalogEntry};
use crate::routing::fanout::{port, Backlog, Filter, Offer, Port, Queue, Received, Subscription};
use crate::routing::monitor::{DestinationKind, DrainMonitor, DrainStats};
use crate::routing::record::Record;
use crate::routing::sink::{Sink, SinkError};
use crate::ExporterError;

/// Tuning of a drain.
#[derive(Debug, Clone, Copy)]
pub struct DrainOptions {
    /// Longest sleep when the ring is empty: bounds how stale an idle drain can be.
    pub max_idle_sleep: Duration,
    /// Most bytes of records queued for one sink or consumer and not yet taken by it.
    pub backlog_bytes: usize,
    /// What to do when a backlog is full (full mode waits up to its deadline, best-effort drops).
    pub policy: LossPolicy,
    /// Most bytes per second taken from the ring (`policy.drain_rate`: the PCIe share for observability); `None`
    /// for no cap. Paced per record with a burst of a few milliseconds' worth.
    pub max_bytes_per_s: Option<f64>,
}

impl Default for DrainOptions {
    fn default() -> Self {
        DrainOptions {
            max_idle_sleep: Duration::from_millis(1),
            backlog_bytes: 256 << 20,
            policy: LossPolicy::default(),
            max_bytes_per_s: None,
        }
    }
}

/// What one sink did.
#[derive(Debug, Clone, Default)]
pub struct SinkReport {
    /// The sink's name.
    pub name: String,
    /// Records it wrote.
    pub records: u64,
    /// Its errors (after the first failed write it is not called again).
    pub errors: Vec<String>,
}

/// A sink that failed: which one, why, and when. A sink fails at its first failed write or close; it is not called
/// again, and every later record for it is counted as dropped (`sink_error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkFailure {
    /// The sink's name.
    pub sink: String,
    /// The error, naming the sink and the file or cause.
    pub message: String,
    /// When it failed.
    pub at: SystemTime,
}

/// The failures of a drain's sinks, shared between the sink workers that report them and whoever watches the run
/// (the session, to refuse captures in full mode; monitoring). Cheap to poll: [`SinkHealth::any_failed`] is one
/// atomic load, so a capture can check it every time.
#[derive(Debug, Clone, Default)]
pub struct SinkHealth(Arc<HealthInner>);

#[derive(Debug, Default)]
struct HealthInner {
    failed: AtomicBool,
    failures: Mutex<Vec<SinkFailure>>,
}

impl SinkHealth {
    /// Whether any sink has failed so far.
    pub fn any_failed(&self) -> bool {
        self.0.failed.load(Ordering::Acquire)
    }

    /// Every failure so far, in the order they happened (one per failed sink worker).
    pub fn failures(&self) -> Vec<SinkFailure> {
        self.0.failures.lock().clone()
    }

    /// The first failure, if any.
    pub fn first(&self) -> Option<SinkFailure> {
        self.0.failures.lock().first().cloned()
    }

    fn report(&self, sink: &str, message: String) {
        self.0.failures.lock().push(SinkFailure { sink: sink.to_owned(), message, at: SystemTime::now() });
        // After the push: whoever sees the flag finds the failure in the list.
        self.0.failed.store(true, Ordering::Release);
    }
}

/// What a drain did, returned when it finishes.
#[derive(Debug, Clone, Default)]
pub struct DrainReport {
    /// Records read from the ring.
    pub records: u64,
    /// Token rows read.
    pub rows: u64,
    /// Ring bytes read (headers, metadata and rows).
    pub bytes: u64,
    /// Activation bytes read (rows only).
    pub data_bytes: u64,
    /// From the drain's start to its end (all sinks closed).
    pub elapsed: Duration,
    /// Per sink.
    pub sinks: Vec<SinkReport>,
    /// Records dropped for a destination because its backlog was full.
    pub backpressure_drops: u64,
    /// Times queued records were moved out of the ring because more than half of it was held.
    pub evacuations: u64,
    /// Records moved out of the ring into host memory by those evacuations.
    pub evacuated_records: u64,
    /// Records that could not be moved out of the ring because the memory for the copy was refused (they stayed in
    /// the ring, holding it until their destination took them).
    pub evacuation_refused: u64,
    /// Ring errors (a corrupted record stops the drain), and every sink's errors.
    pub errors: Vec<String>,
}

/// A running drain: its thread, its sink workers, and the door for new subscriptions. It stops by itself once the
/// producer is gone and the ring is empty; [`Drain::join`] waits for that and for every sink to close.
pub struct Drain {
    thread: JoinHandle<DrainReport>,
    workers: Vec<JoinHandle<SinkReport>>,
    subscribe: Sender<Port>,
    backlog_bytes: usize,
    health: SinkHealth,
    monitor: DrainMonitor,
    commits: Commits,
}

impl Drain {
    /// Starts the drain thread on `consumer` (a ring's drain end: host or CUDA), resolving hookpoint ids in
    /// `catalog`, and one worker thread per sink (each with the filter of the records it takes).
    pub fn spawn(
        consumer: impl RecordSource + 'static,
        catalog: Arc<dyn Catalog>,
        sinks: Vec<(Box<dyn Sink>, Filter)>,
        options: DrainOptions,
    ) -> Result<Drain, ExporterError> {
        let pools = sinks.into_iter().map(|(sink, filter)| (vec![sink], filter)).collect();
        Drain::spawn_pools(consumer, catalog, pools, options)
    }

    /// Like [`spawn`](Self::spawn), with pools of sinks: the sinks of one pool (the same format, each writing files
    /// of its own) share one queue and one backlog of `backlog_bytes` × their number, and each record goes to
    /// whichever of them takes it first — a sink thread slowed by a busy core takes fewer records instead of holding
    /// the others back. A pool is one destination (one name in the monitor, one drop count). When a pool's sink
    /// fails it stops taking records while another of the pool still writes; the last one to fail takes and fails
    /// the rest (`sink_error`). An empty pool is an error.
    pub fn spawn_pools(
        consumer: impl RecordSource + 'static,
        catalog: Arc<dyn Catalog>,
        pools: Vec<(Vec<Box<dyn Sink>>, Filter)>,
        options: DrainOptions,
    ) -> Result<Drain, ExporterError> {
        let mut ports = Vec::new();
        let mut workers = Vec::new();
        let health = SinkHealth::default();
        let monitor = DrainMonitor::new(consumer.gauge());
        let mut commits = Commits::default();
        for (pool, filter) in pools {
            let Some(name) = pool.first().map(|s| s.name().to_owned()) else {
                return Err(ExporterError::EmptyPool);
            };
            let backlog_bytes = options.backlog_bytes.saturating_mul(pool.len());
            let (p, queue, backlog, _gone) = port(name.clone(), filter, backlog_bytes, false);
            monitor.add_destination(&name, DestinationKind::Sink, backlog.clone());
            ports.push(p);
            let writing = Arc::new(AtomicUsize::new(pool.len()));
            let size = pool.len();
            let committed: Vec<Arc<AtomicU64>> = (0..size).map(|_| Arc::new(AtomicU64::new(0))).collect();
            commits.pools.push((queue.clone(), committed.clone()));
            for ((worker, sink), committed) in pool.into_iter().enumerate().zip(committed) {
                let seat = Seat { queue: queue.clone(), worker, workers: size, committed };
                let (backlog, health, writing) = (backlog.clone(), health.clone(), writing.clone());
                let thread = std::thread::Builder::new()
                    // `rs-parquet-3`: Linux keeps 15 bytes of a thread's name, enough to tell the sink threads apart.
                    .name(format!("rs-{}-{}", sink.name(), workers.len()))
                    .spawn(move || run_sink(sink, seat, backlog, health, writing))
                    .map_err(ExporterError::Spawn)?;
                workers.push(thread);
            }
        }
        let (subscribe, new_ports) = crossbeam::channel::unbounded();
        let drain_monitor = monitor.clone();
        let thread = std::thread::Builder::new()
            .name("ringscope-drain".into())
            .spawn(move || run_drain(Box::new(consumer), &*catalog, ports, new_ports, options, &drain_monitor))
            .map_err(ExporterError::Spawn)?;
        Ok(Drain { thread, workers, subscribe, backlog_bytes: options.backlog_bytes, health, monitor, commits })
    }

    /// A handle that asks the sinks to commit what they hold (see [`Commits::commit`]), for any thread.
    pub fn commits(&self) -> Commits {
        self.commits.clone()
    }

    /// The drain's numbers — records and bytes moved, ring occupancy, each destination's progress and lag — for
    /// any thread, while it runs and after [`Drain::join`].
    pub fn monitor(&self) -> DrainMonitor {
        self.monitor.clone()
    }

    /// The sinks' health: which have failed, why and when — updated by the sink workers as it happens, and still
    /// readable after [`Drain::join`].
    pub fn health(&self) -> SinkHealth {
        self.health.clone()
    }

    /// Subscribes a consumer to the records that pass `filter`: every record published after this returns.
    pub fn subscribe(&self, name: &str, filter: Filter) -> Result<Subscription, ExporterError> {
        let (p, queue, backlog, gone) = port(name.to_owned(), filter, self.backlog_bytes, true);
        self.subscribe.send(p).map_err(|_| ExporterError::Stopped)?;
        self.monitor.add_destination(name, DestinationKind::Consumer, backlog.clone());
        Ok(Subscription::new(queue, backlog, gone))
    }

    /// Waits for the drain to finish (drop the producer first, or this waits forever), then for every sink to
    /// close, and returns the report.
    pub fn join(self) -> Result<DrainReport, ExporterError> {
        drop(self.subscribe);
        let mut report = self.thread.join().map_err(|p| ExporterError::Panicked(panic_message(&*p)))?;
        for w in self.workers {
            let sink = w.join().map_err(|p| ExporterError::Panicked(panic_message(&*p)))?;
            report.errors.extend(sink.errors.iter().cloned());
            report.sinks.push(sink);
        }
        Ok(report)
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

fn run_drain(
    mut consumer: Box<dyn RecordSource>,
    catalog: &dyn Catalog,
    mut ports: Vec<Port>,
    new_ports: Receiver<Port>,
    options: DrainOptions,
    monitor: &DrainMonitor,
) -> DrainReport {
    let started = Instant::now();
    let mut report = DrainReport::default();
    // Entries seen so far, by id: the catalog is asked only for an id not seen before, never per record.
    let mut hookpoints: Vec<Option<Arc<CatalogEntry>>> = Vec::new();
    let mut idle = Duration::from_micros(20);
    let mut pressure = Pressure::new(consumer.capacity() as u64, &options.policy);
    let mut pace = options.max_bytes_per_s.map(Pace::new);

    'drain: loop {
        let mut drained_any = false;
        loop {
            let record = match consumer.peek() {
                Ok(Some(view)) => {
                    let id = view.header.meta.hookpoint;
                    let i = id as usize;
                    if hookpoints.get(i).is_none_or(Option::is_none) {
                        if hookpoints.len() <= i {
                            hookpoints.resize(i + 1, None);
                        }
                        hookpoints[i] = catalog.entry(id);
                    }
                    let Some(hp) = &hookpoints[i] else {
                        // Cannot happen with a catalog whose ids are registered before their records are produced;
                        // nothing to attribute the record to.
                        report.errors.push(format!("record {} names unknown hookpoint id {id}", view.header.seq));
                        consumer.advance();
                        continue;
                    };
                    let header = view.header;
                    let hp = hp.clone();
                    let lease = consumer.lease().expect("a record was just peeked");
                    Record::leased(header, lease, hp)
                }
                Ok(None) => break,
                Err(e) => {
                    // Corruption: the position of the next record is unknown, so nothing after this can be read.
                    // Records still in the ring stay unaccounted and the shutdown check reports them.
                    report.errors.push(format!("ring: {e}; the drain stopped"));
                    break 'drain;
                }
            };
            // Subscriptions are picked up *after* the record was seen: a consumer subscribed before a record was
            // published (its port sent before the capture, which our Acquire in `peek` synchronises with) is
            // always offered that record.
            while let Ok(p) = new_ports.try_recv() {
                ports.push(p);
            }
            drained_any = true;
            report.records += 1;
            report.rows += record.rows() as u64;
            report.bytes += record.header().footprint() as u64;
            report.data_bytes += record.data().len() as u64;
            for p in ports.iter_mut() {
                if p.offer(&record, &options.policy) == Offer::Dropped(DropReason::SinkBackpressure) {
                    report.backpressure_drops += 1;
                }
            }
            // After the offers: a reader that sees this count knows every destination was offered these records.
            monitor.set_drained(DrainStats {
                records: report.records,
                rows: report.rows,
                bytes: report.bytes,
                data_bytes: report.data_bytes,
            });
            let footprint = record.header().footprint() as u64;
            drop(record);
            pressure.check(&mut *consumer, &mut ports, &mut report);
            if let Some(pace) = pace.as_mut() {
                pace.take(footprint);
            }
        }
        if !drained_any {
            // Holders may have let go of records while we found nothing new: check once more, so that a queue
            // that holds the ring is moved out even when nothing more is published.
            pressure.check(&mut *consumer, &mut ports, &mut report);
        }
        if drained_any {
            idle = Duration::from_micros(20);
        } else if consumer.is_finished() {
            break;
        } else if consumer.arriving_bytes() > 0 {
            // A record is being copied to us (a large one takes several copies): look again soon, or the copies
            // would wait for our sleep instead of the link.
            std::thread::sleep(Duration::from_micros(20));
        } else {
            std::thread::sleep(idle);
            idle = (idle * 2).min(options.max_idle_sleep);
        }
    }
    while let Ok(p) = new_ports.try_recv() {
        ports.push(p);
    }
    if report.evacuation_refused > 0 {
        report.errors.push(format!(
            "{} queued records could not be moved out of the ring (the memory for the copy was refused): they held \
             ring space until taken; free memory or lower export.backlog",
            report.evacuation_refused
        ));
    }
    for p in ports.iter_mut() {
        p.finish();
        if p.dropped > 0 {
            let stalled = match p.stalls {
                0 => String::new(),
                n => format!("; it took nothing for a whole deadline and was declared stalled {n} times"),
            };
            report.errors.push(format!(
                "`{}` fell behind: {} records dropped for it (backlog over {} bytes){stalled}",
                p.name, p.dropped, options.backlog_bytes
            ));
        }
    }
    drop(ports);
    monitor.finish_ring();
    // The ring's memory goes back on a thread of its own: unpinning the CUDA backend's staging takes about a tenth
    // of a second per GiB (and the driver serialises other memory calls behind it), which closing a session must
    // not wait for. If no thread can be started, the closure — and the ring with it — is dropped here.
    let _ = std::thread::Builder::new().name("ringscope-free".into()).spawn(move || drop(consumer));
    report.elapsed = started.elapsed();
    report
}

/// The drain's byte-rate cap: a token bucket of a few milliseconds' worth of bytes. Taking a record spends its
/// footprint; a debt is paid by sleeping, so the drain (and, on the CUDA backend, the device-to-host copies it
/// triggers) averages at most the rate — the ring absorbs what the producer makes beyond it, and the policy
/// manager degrades before it overflows.
struct Pace {
    bytes_per_s: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Pace {
    fn new(bytes_per_s: f64) -> Pace {
        let burst = (bytes_per_s * 0.005).max(1.0);
        Pace { bytes_per_s, burst, tokens: burst, at: Instant::now() }
    }

    fn take(&mut self, bytes: u64) {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * self.bytes_per_s).min(self.burst);
        self.at = now;
        self.tokens -= bytes as f64;
        if self.tokens < 0.0 {
            std::thread::sleep(Duration::from_secs_f64(-self.tokens / self.bytes_per_s));
        }
    }
}

/// When to move queued records out of the ring: when more than half of it is held, and again only once the held
/// part has grown by another eighth (what sinks hold while writing cannot be moved, and must not make every record
/// rescan the queues).
///
/// Which queues: in best-effort mode every destination's (a slow destination must not stall capture or the others;
/// it costs host memory up to its backlog, then drops). In full mode only consumers' (a consumer is user code that
/// may stop reading: it costs host memory up to its backlog, then full mode's stall rule applies); a sink, which
/// makes progress however slowly, holds the ring and so back-pressures the producer — full mode's contract.
struct Pressure {
    capacity: u64,
    next: u64,
    only_consumers: bool,
}

impl Pressure {
    fn new(capacity: u64, policy: &LossPolicy) -> Pressure {
        Pressure { capacity, next: capacity / 2, only_consumers: policy.mode == Mode::Full }
    }

    fn check(&mut self, source: &mut dyn RecordSource, ports: &mut [Port], report: &mut DrainReport) {
        let held = source.held_bytes();
        if held <= self.capacity / 2 {
            self.next = self.capacity / 2;
            return;
        }
        if held <= self.next {
            return;
        }
        let (mut moved, mut refused) = (0, 0);
        for p in ports.iter_mut().filter(|p| !self.only_consumers || p.consumer) {
            let (m, r) = p.evacuate();
            (moved, refused) = (moved + m, refused + r);
        }
        if moved + refused > 0 {
            report.evacuations += 1;
            report.evacuated_records += moved;
            report.evacuation_refused += refused;
        }
        self.next = source.held_bytes().max(self.capacity / 2) + self.capacity / 8;
    }
}

/// A sink's place in its pool: the queue it shares, its index and the pool's size (see [`Queue::take`]), and where
/// it says which commit it carried out last.
struct Seat {
    queue: Arc<Queue>,
    worker: usize,
    workers: usize,
    committed: Arc<AtomicU64>,
}

/// The sink pools' queues and what each sink committed last: asks them to commit what they hold and waits for them
/// ([`Commits::commit`]). A handle of the drain's, usable from any thread while the drain runs.
#[derive(Clone, Default)]
pub struct Commits {
    pools: Vec<(Arc<Queue>, Vec<Arc<AtomicU64>>)>,
}

impl Commits {
    /// Asks every sink to commit what it holds (file sinks: their open files, see [`Sink::commit`]) once it has taken
    /// every record queued for its pool now, and waits until each has, or until `deadline`. Returns whether all did.
    /// A sink that stopped (failed, or the stream ended) counts as done. Records the drain has not queued yet are
    /// not covered: wait until the drain has offered what you need first.
    pub fn commit(&self, deadline: Instant) -> bool {
        let asked: Vec<u64> = self.pools.iter().map(|(queue, _)| queue.request_commit()).collect();
        loop {
            let done = self
                .pools
                .iter()
                .zip(&asked)
                .all(|((_, sinks), &n)| sinks.iter().all(|c| c.load(Ordering::Acquire) >= n));
            if done {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// How long a sink of a pool waits for a record of its own hookpoints before it takes any (see [`Queue::take`]).
const STEAL_AFTER: Duration = Duration::from_millis(2);

/// How long a sink waits for a record before it lets go of the ring memory it holds for batches ([`Sink::idle`]):
/// ring space comes back in ring order, so a record held for a batch that grows slowly would otherwise hold the ring
/// behind it for as long as the sink waits.
const IDLE_AFTER: Duration = Duration::from_millis(10);

/// A sink's worker: writes what it takes from its pool's queue until the queue ends. `writing` counts the pool's
/// sinks that have not failed: one that fails leaves the queue to those still writing, and the last to fail fails
/// what is left.
fn run_sink(
    sink: Box<dyn Sink>,
    seat: Seat,
    backlog: Arc<Backlog>,
    health: SinkHealth,
    writing: Arc<AtomicUsize>,
) -> SinkReport {
    let mut report = SinkReport { name: sink.name().to_owned(), ..SinkReport::default() };
    // `None` once it failed: it is closed and dropped at once, so that records it held (lent by the ring) go back
    // instead of holding the ring until shutdown.
    let mut live = Some(sink);
    let mut committed = 0;
    // Whether the sink wrote since it was last told it is idle.
    let mut busy = false;
    loop {
        let idle_after = busy.then_some(IDLE_AFTER);
        let record = match seat.queue.take(seat.worker, seat.workers, STEAL_AFTER, committed, idle_after) {
            Received::Record(record) => {
                busy = true;
                record
            }
            Received::Timeout => {
                busy = false;
                if call_between_records(&mut live, &mut report, &writing, &backlog, &health, |s| s.idle()) {
                    break;
                }
                continue;
            }
            Received::Commit(n) => {
                committed = n;
                if call_between_records(&mut live, &mut report, &writing, &backlog, &health, |s| s.commit()) {
                    break;
                }
                seat.committed.store(n, Ordering::Release);
                continue;
            }
            Received::End => break,
        };
        let size = record.size_bytes();
        match live.as_mut() {
            None => record.receipt().fail(DropReason::SinkError),
            Some(sink) => {
                match guarded(&report.name, || sink.write(&record)) {
                    Ok(()) => {
                        report.records += 1;
                        backlog.delivered(size);
                    }
                    Err(e) => {
                        // Reported before the record is counted as dropped, so that a caller who sees the drop sees
                        // the failure.
                        let others_write = failed(&e, &mut report, &writing, &backlog, &health);
                        record.receipt().fail(DropReason::SinkError);
                        close_sink(live.take().expect("live"), &mut report);
                        drop(record);
                        backlog.taken(size);
                        if others_write {
                            break; // the queue is theirs now
                        }
                        continue;
                    }
                }
            }
        }
        drop(record);
        backlog.taken(size);
    }
    // Gone: a commit asked for from now on does not wait for this sink.
    seat.committed.store(u64::MAX, Ordering::Release);
    if let Some(sink) = live {
        close_sink(sink, &mut report);
        // A sink that wrote everything but failed to commit it at close failed too (its last files' records are
        // counted as `sink_error`).
        if let Some(e) = report.errors.first() {
            backlog.set_failed();
            health.report(&report.name, e.clone());
        }
    }
    report
}

/// Runs `call` (a sink's `commit` or `idle`) on the live sink between records. When it fails, the sink fails as on a
/// failed write, with no record of its own to fail (what it held failed its records' receipts), and is closed.
/// Returns whether the worker should leave: others of its pool still write, and the queue is theirs.
fn call_between_records(
    live: &mut Option<Box<dyn Sink>>,
    report: &mut SinkReport,
    writing: &AtomicUsize,
    backlog: &Backlog,
    health: &SinkHealth,
    call: impl FnOnce(&mut dyn Sink) -> Result<(), SinkError>,
) -> bool {
    let Some(sink) = live.as_mut() else { return false };
    let Err(e) = guarded(&report.name, || call(sink.as_mut())) else { return false };
    let others_write = failed(&e, report, writing, backlog, health);
    close_sink(live.take().expect("live"), report);
    others_write
}

/// Runs `call` (a sink's `write`, `commit` or `idle`), turning a panic into an error of the sink `name`.
fn guarded(name: &str, call: impl FnOnce() -> Result<(), SinkError>) -> Result<(), SinkError> {
    catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|p| {
        Err(SinkError::Panicked { sink: name.to_owned(), message: panic_message(&*p), on_close: false })
    })
}

/// The sink failed with `e` (in `write` or `commit`): reported the moment it happens, so that the engine learns while
/// it runs (full mode refuses captures from now on); the destination fails with the last sink of its pool that still
/// wrote. Returns whether others of its pool still write (the queue is theirs then).
fn failed(
    e: &SinkError,
    report: &mut SinkReport,
    writing: &AtomicUsize,
    backlog: &Backlog,
    health: &SinkHealth,
) -> bool {
    let others_write = writing.fetch_sub(1, Ordering::AcqRel) > 1;
    if !others_write {
        backlog.set_failed();
    }
    health.report(&report.name, e.to_string());
    report.errors.push(e.to_string());
    others_write
}

/// Closes `sink` and drops it, turning a panic in either into an error of the report.
fn close_sink(mut sink: Box<dyn Sink>, report: &mut SinkReport) {
    let closed = catch_unwind(AssertUnwindSafe(|| sink.close())).unwrap_or_else(|p| {
        Err(SinkError::Panicked { sink: report.name.clone(), message: panic_message(&*p), on_close: true })
    });
    if let Err(e) = closed {
        report.errors.push(e.to_string());
    }
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| drop(sink))) {
        report.errors.push(format!("sink `{}` panicked when dropped: {}", report.name, panic_message(&*p)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::sink::{BoxError, CallbackSink, SummarySink};
    use crate::testing::TestCatalog;
    use ringscope_policy::Mode;
    use ringscope_ring::channel;

    fn setup() -> (ringscope_ring::Producer, ringscope_ring::Consumer, TestCatalog) {
        let (p, c) = channel(1 << 16).unwrap();
        (p, c, TestCatalog::layers(2, 8))
    }

    fn boxed(s: impl Sink + 'static) -> (Box<dyn Sink>, Filter) {
        (Box::new(s), Filter::all())
    }

    #[test]
    fn drains_everything_and_accounts_for_it() {
        let (mut p, c, reg) = setup();
        let (summary, handle) = SummarySink::new();
        let drain = Drain::spawn(c, reg.catalog(), vec![boxed(summary)], DrainOptions::default()).unwrap();
        for step in 0..500u64 {
            for hp in 0..2 {
                reg.capture(&mut p, hp, step, &[(1, step as u32), (2, step as u32)], &[step as u8; 32]);
            }
        }
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!((report.records, report.rows), (1000, 2000));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        reg.accounting().check().unwrap();
        let s = handle.lock();
        assert_eq!(s["layers.1.resid"].steps, Some((0, 499)));
        assert_eq!(s["layers.0.resid"].requests, 2);
    }

    /// A record whose hookpoint id the catalog does not resolve is reported and skipped; the drain goes on.
    #[test]
    fn a_record_of_an_id_the_catalog_does_not_know_is_reported_not_fatal() {
        let (mut p, c, reg) = setup();
        let (summary, handle) = SummarySink::new();
        let drain = Drain::spawn(c, reg.catalog(), vec![boxed(summary)], DrainOptions::default()).unwrap();
        reg.capture(&mut p, 0, 0, &[(1, 0)], &[0; 16]);
        let meta = ringscope_ring::RecordMeta {
            step: 1,
            hookpoint: 7,
            rows: 1,
            row_bytes: 16,
            dtype: ringscope_ring::DType::F16,
            flags: 0,
        };
        let row = [ringscope_ring::RowMeta { request_id: 1, position: 1, batch_row: 0 }];
        p.try_push(meta, &row, &[0; 16]).unwrap();
        reg.capture(&mut p, 1, 2, &[(1, 2)], &[0; 16]);
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!(report.errors, vec!["record 1 names unknown hookpoint id 7".to_string()]);
        assert_eq!(report.records, 2);
        assert_eq!(handle.lock().len(), 2);
        reg.accounting().check().unwrap();
    }

    #[test]
    fn a_list_catalog_resolves_only_entries_whose_id_is_their_index() {
        let reg = TestCatalog::layers(2, 8);
        let catalog = reg.catalog();
        assert_eq!(catalog.entry(1).map(|e| e.id()), Some(1));
        assert!(catalog.entry(2).is_none());
        let misplaced: Vec<Arc<CatalogEntry>> = vec![catalog.entry(1).unwrap()];
        assert!(misplaced.entry(0).is_none() && misplaced.entry(1).is_none());
    }

    #[test]
    fn failing_and_panicking_sinks_are_counted_not_fatal() {
        let (mut p, c, reg) = setup();
        let mut n = 0;
        let flaky = CallbackSink::new("flaky", move |_: &Record| {
            n += 1;
            if n == 3 {
                Err("disk full".into())
            } else {
                Ok(())
            }
        });
        let panicky = CallbackSink::new("panicky", |r: &Record| {
            if r.header().seq == 5 {
                panic!("consumer bug");
            }
            Ok(())
        });
        let drain =
            Drain::spawn(c, reg.catalog(), vec![boxed(flaky), boxed(panicky)], DrainOptions::default()).unwrap();
        for step in 0..10u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
        assert!(report.errors[0].contains("disk full") && report.errors[1].contains("consumer bug"));
        let acc = reg.accounting();
        acc.check().unwrap();
        let c = acc.hookpoints[0].1;
        // Records 0 and 1 reached both sinks; from record 2 (flaky) on, every record failed somewhere.
        assert_eq!((c.exported.records, c.dropped_for(DropReason::SinkError).records), (2, 8));
    }

    #[test]
    fn a_failed_sink_is_reported_while_the_drain_runs_with_its_name_error_and_time() {
        let (mut p, c, reg) = setup();
        let mut n = 0;
        let flaky = CallbackSink::new("flaky", move |_: &Record| {
            n += 1;
            if n == 3 {
                Err("disk full".into())
            } else {
                Ok(())
            }
        });
        let (summary, _) = SummarySink::new();
        let drain =
            Drain::spawn(c, reg.catalog(), vec![boxed(flaky), boxed(summary)], DrainOptions::default()).unwrap();
        let health = drain.health();
        let before = SystemTime::now();
        for step in 0..2u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        settle(&reg, 2);
        assert!(!health.any_failed() && health.failures().is_empty());
        reg.capture(&mut p, 0, 2, &[(1, 0)], &[0; 16]);
        settle(&reg, 3);
        // Known before shutdown: the producer is still alive.
        assert!(health.any_failed());
        let failures = health.failures();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].sink, "flaky");
        assert!(failures[0].message.contains("disk full"), "{failures:?}");
        assert!(failures[0].at >= before && failures[0].at <= SystemTime::now());
        drop(p);
        drain.join().unwrap();
        assert_eq!(health.failures(), failures, "one failure per sink, kept after join");
    }

    /// Records of the sinks of one pool, by sink: the sequence numbers each wrote.
    type Written = Arc<Mutex<Vec<Vec<u64>>>>;

    fn pool_sink(
        name: &str,
        index: usize,
        written: &Written,
        mut before_write: impl FnMut(u64) -> Result<(), BoxError> + Send + 'static,
    ) -> Box<dyn Sink> {
        let written = written.clone();
        Box::new(CallbackSink::new(name, move |r: &Record| {
            before_write(r.header().seq)?;
            written.lock()[index].push(r.header().seq);
            Ok(())
        }))
    }

    #[test]
    fn a_pool_gives_each_record_to_whichever_sink_is_free_so_a_stuck_one_holds_back_only_itself() {
        let (mut p, c, reg) = setup();
        let written: Written = Arc::new(Mutex::new(vec![Vec::new(); 2]));
        let (release, gate) = crossbeam::channel::bounded::<()>(1);
        let stuck = pool_sink("files", 0, &written, move |_| {
            let _ = gate.recv(); // the first write waits until the test releases it (later ones find it closed)
            Ok(())
        });
        let free = pool_sink("files", 1, &written, |_| Ok(()));
        let pools = vec![(vec![stuck, free], Filter::all())];
        let drain = Drain::spawn_pools(c, reg.catalog(), pools, DrainOptions::default()).unwrap();
        let monitor = drain.monitor();
        for step in 0..200u64 {
            reg.capture(&mut p, (step % 2) as u32, step, &[(1, 0)], &[step as u8; 16]);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while written.lock()[1].len() < 199 {
            assert!(Instant::now() < deadline, "the free sink wrote only {}", written.lock()[1].len());
            std::thread::sleep(Duration::from_millis(1));
        }
        // At most one record waits in the stuck sink; the others went to the free one, none is left queued.
        let d = monitor.destinations();
        assert_eq!(d.len(), 1, "a pool is one destination");
        assert_eq!(d[0].backlog_bytes, 2 * DrainOptions::default().backlog_bytes as u64, "a backlog per sink");
        drop(release);
        drop(p);
        let report = drain.join().unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let w = written.lock();
        // The stuck sink holds at most the one record it is stuck on (none when the free sink, on a busy machine,
        // took every record before the stuck one asked for any).
        assert!(w[0].len() <= 1 && w[0].len() + w[1].len() == 200, "{} + {}", w[0].len(), w[1].len());
        let mut all: Vec<u64> = w.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..200).collect::<Vec<u64>>(), "every record written once");
        assert_eq!(report.sinks.iter().map(|s| s.records).sum::<u64>(), 200);
        let acc = reg.accounting();
        acc.check().unwrap();
        assert_eq!(acc.total().exported.records, 200);
    }

    #[test]
    fn a_failed_sink_of_a_pool_leaves_the_records_to_the_others_and_the_last_to_fail_fails_the_rest() {
        // One of two fails at its first write: the other writes everything else.
        let (mut p, c, reg) = setup();
        let written: Written = Arc::new(Mutex::new(vec![Vec::new(); 2]));
        let (failed, failure) = crossbeam::channel::bounded::<()>(1);
        let flaky = pool_sink("files", 0, &written, move |_| {
            let _ = failed.send(());
            Err("disk full".into())
        });
        let mut first = true;
        let good = pool_sink("files", 1, &written, move |_| {
            if std::mem::take(&mut first) {
                let _ = failure.recv(); // so that the flaky sink surely takes (and fails) a record
            }
            Ok(())
        });
        let drain =
            Drain::spawn_pools(c, reg.catalog(), vec![(vec![flaky, good], Filter::all())], DrainOptions::default())
                .unwrap();
        let (health, monitor) = (drain.health(), drain.monitor());
        for step in 0..50u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        drop(p);
        let report = drain.join().unwrap();
        assert!(!monitor.destinations()[0].failed, "the pool still wrote");
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        let failures = health.failures();
        assert!(failures.len() == 1 && failures[0].message.contains("disk full"), "{failures:?}");
        assert_eq!(written.lock()[1].len(), 49);
        let acc = reg.accounting();
        acc.check().unwrap();
        let c = acc.hookpoints[0].1;
        assert_eq!((c.exported.records, c.dropped_for(DropReason::SinkError).records), (49, 1));

        // Both fail: every record is failed and counted, and the drain ends.
        let (mut p, c, reg) = setup();
        let written: Written = Arc::new(Mutex::new(vec![Vec::new(); 2]));
        let pool = (0..2).map(|i| pool_sink("files", i, &written, |_| Err("read-only file system".into()))).collect();
        let drain = Drain::spawn_pools(c, reg.catalog(), vec![(pool, Filter::all())], DrainOptions::default()).unwrap();
        let monitor = drain.monitor();
        for step in 0..50u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        drop(p);
        let report = drain.join().unwrap();
        assert!(monitor.destinations()[0].failed);
        assert!(!report.errors.is_empty() && report.errors.len() <= 2, "{:?}", report.errors);
        let acc = reg.accounting();
        acc.check().unwrap();
        let c = acc.hookpoints[0].1;
        assert_eq!((c.exported.records, c.dropped_for(DropReason::SinkError).records), (0, 50));
    }

    #[test]
    fn an_empty_pool_is_refused() {
        let (_p, c, reg) = setup();
        let err = Drain::spawn_pools(c, reg.catalog(), vec![(vec![], Filter::all())], DrainOptions::default());
        assert!(matches!(err, Err(ExporterError::EmptyPool)));
    }

    #[test]
    fn a_sink_that_fails_only_at_close_is_reported_as_failed() {
        struct FailsOnClose;
        impl Sink for FailsOnClose {
            fn name(&self) -> &str {
                "closer"
            }
            fn write(&mut self, _: &Record) -> Result<(), SinkError> {
                Ok(())
            }
            fn close(&mut self) -> Result<(), SinkError> {
                Err(SinkError::Callback { sink: "closer".into(), source: "no space left on device".into() })
            }
        }
        let (mut p, c, reg) = setup();
        let drain = Drain::spawn(c, reg.catalog(), vec![boxed(FailsOnClose)], DrainOptions::default()).unwrap();
        let health = drain.health();
        reg.capture(&mut p, 0, 0, &[(1, 0)], &[0; 16]);
        drop(p);
        drain.join().unwrap();
        let failures = health.failures();
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].sink == "closer" && failures[0].message.contains("no space left"), "{failures:?}");
    }

    #[test]
    fn a_sink_that_fails_to_commit_fails_like_a_failed_write_and_the_commit_does_not_wait_for_it() {
        /// Holds every record until a commit, which fails for sink `fails` (a pool of two: the other commits).
        struct Holder {
            held: Vec<Record>,
            fails: bool,
            committed: Arc<AtomicUsize>,
        }
        impl Sink for Holder {
            fn name(&self) -> &str {
                "files"
            }
            fn write(&mut self, r: &Record) -> Result<(), SinkError> {
                self.held.push(r.clone());
                Ok(())
            }
            fn commit(&mut self) -> Result<(), SinkError> {
                if self.fails {
                    for r in self.held.drain(..) {
                        r.receipt().fail(DropReason::SinkError); // the file it could not commit
                    }
                    return Err(SinkError::Callback { sink: "files".into(), source: "rename: no space left".into() });
                }
                self.committed.fetch_add(self.held.len(), Ordering::Relaxed);
                self.held.clear();
                Ok(())
            }
        }
        for (pool, failing) in [(1usize, 1usize), (2, 1)] {
            let (mut p, c, reg) = setup();
            let committed = Arc::new(AtomicUsize::new(0));
            let sinks = (0..pool)
                .map(|i| {
                    Box::new(Holder { held: Vec::new(), fails: i < failing, committed: committed.clone() })
                        as Box<dyn Sink>
                })
                .collect();
            let drain =
                Drain::spawn_pools(c, reg.catalog(), vec![(sinks, Filter::all())], DrainOptions::default()).unwrap();
            let (health, monitor, commits) = (drain.health(), drain.monitor(), drain.commits());
            for step in 0..8u64 {
                reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
            }
            while monitor.drain().records < 8 {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(commits.commit(Instant::now() + Duration::from_secs(10)), "pool of {pool}");
            let failures = health.failures();
            assert!(failures.len() == 1 && failures[0].message.contains("no space left"), "{failures:?}");
            // A second commit does not wait for the failed sink either.
            assert!(commits.commit(Instant::now() + Duration::from_secs(10)), "pool of {pool}");
            reg.capture(&mut p, 0, 8, &[(1, 0)], &[0; 16]);
            drop(p);
            let report = drain.join().unwrap();
            assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
            assert_eq!(monitor.destinations()[0].failed, pool == failing, "pool of {pool}");
            let acc = reg.accounting();
            acc.check().unwrap();
            let c = acc.hookpoints[0].1;
            // Every record counted: the failed sink's as `sink_error` (with one sink, the later record too); the
            // other's exported — those it committed, and the later record, which it took and held until the end.
            assert_eq!(c.exported.records + c.dropped_for(DropReason::SinkError).records, 9, "pool of {pool}");
            let exported = committed.load(Ordering::Relaxed) + (pool - failing);
            assert_eq!(c.exported.records as usize, exported, "pool of {pool}");
        }
    }

    #[test]
    fn subscriptions_filter_and_departed_consumers_are_counted() {
        let (mut p, c, reg) = setup();
        let drain = Drain::spawn(c, reg.catalog(), vec![], DrainOptions::default()).unwrap();
        let layer1 = drain.subscribe("layer1", Filter::layers([1])).unwrap();
        let quitter = drain.subscribe("quitter", Filter::all()).unwrap();
        // Let the drain pick up both subscriptions before anything is published.
        std::thread::sleep(Duration::from_millis(50));
        for step in 0..20u64 {
            for hp in 0..2 {
                reg.capture(&mut p, hp, step, &[(7, step as u32)], &[1; 16]);
            }
        }
        let first = quitter.recv().unwrap();
        assert_eq!((first.step(), first.hookpoint().id()), (0, 0));
        // Wait until the drain has queued all 39 others for the quitter before it quits.
        let deadline = Instant::now() + Duration::from_secs(10);
        while quitter.backlog_bytes() < 39 * first.size_bytes() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(first);
        drop(quitter);
        drop(p);
        let received: Vec<_> = layer1.iter().map(|r| (r.step(), r.hookpoint().spec().layer, r.row_meta(0))).collect();
        assert_eq!(received.len(), 20);
        assert!(received
            .iter()
            .enumerate()
            .all(|(i, (s, l, m))| *s == i as u64 && *l == Some(1) && m.position == i as u32));
        drain.join().unwrap();
        let acc = reg.accounting();
        acc.check().unwrap();
        // Delivery into a consumer's queue is its export: all 40 records reached the quitter's queue before it
        // quit, whether or not it read them.
        assert_eq!(acc.total().exported.records, 40);
    }

    #[test]
    fn best_effort_backlog_drops_for_a_slow_consumer_and_counts() {
        let (mut p, c, reg) = setup();
        let options = DrainOptions {
            backlog_bytes: 1024,
            policy: LossPolicy { mode: Mode::BestEffort, full_deadline: Duration::ZERO },
            ..DrainOptions::default()
        };
        let drain = Drain::spawn(c, reg.catalog(), vec![], options).unwrap();
        let slow = drain.subscribe("slow", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for step in 0..100u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        drop(p);
        // Nobody reads `slow` until the drain is done: its 1 KiB budget holds a handful of 192-byte records.
        std::thread::sleep(Duration::from_millis(200));
        let got = slow.iter().count();
        assert!((1..=8).contains(&got), "{got}");
        let report = drain.join().unwrap();
        assert_eq!(report.backpressure_drops, 100 - got as u64);
        let c = reg.accounting().hookpoints[0].1;
        assert_eq!(c.dropped_for(DropReason::SinkBackpressure).records, 100 - got as u64);
        reg.accounting().check().unwrap();
    }

    #[test]
    fn a_consumer_queue_full_in_records_drops_and_counts_them() {
        let (mut p, c, reg) = setup();
        // A byte budget far above what 70,000 small records need: the channel's record bound is what fills.
        let options = DrainOptions {
            backlog_bytes: 1 << 30,
            policy: LossPolicy { mode: Mode::BestEffort, full_deadline: Duration::ZERO },
            ..DrainOptions::default()
        };
        let drain = Drain::spawn(c, reg.catalog(), vec![], options).unwrap();
        let idle = drain.subscribe("idle", Filter::all()).unwrap();
        let total = crate::routing::fanout::PORT_RECORDS as u64 + 1000;
        for step in 0..total {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!(report.backpressure_drops, 1000);
        let acc = reg.accounting();
        acc.check().unwrap();
        assert_eq!(acc.hookpoints[0].1.dropped_for(DropReason::SinkBackpressure).records, 1000);
        assert_eq!(idle.iter().count(), crate::routing::fanout::PORT_RECORDS);
        // The drops are logged as they happen: consecutive steps, one span.
        let spans: Vec<_> = reg
            .events()
            .take()
            .into_iter()
            .map(|e| (e.hookpoint, e.reason, e.first_step, e.last_step, e.records_lost, e.rows_lost))
            .collect();
        let first = crate::routing::fanout::PORT_RECORDS as u64;
        assert_eq!(spans, vec![("layers.0.resid".into(), "sink_backpressure".into(), first, total - 1, 1000, 1000)]);
    }

    fn full(deadline_ms: u64, backlog_bytes: usize) -> DrainOptions {
        DrainOptions {
            backlog_bytes,
            policy: LossPolicy { mode: Mode::Full, full_deadline: Duration::from_millis(deadline_ms) },
            ..DrainOptions::default()
        }
    }

    /// Waits until the drain has read `records` records (each exported or dropped by then, for a consumer).
    fn settle(reg: &TestCatalog, records: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while reg.accounting().total().in_flight() > 0 || reg.accounting().total().produced.records < records {
            assert!(Instant::now() < deadline, "the drain did not catch up: {:?}", reg.accounting().total());
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_consumer_that_stops_reading_holds_the_drain_one_deadline_then_is_dropped_for_until_it_reads() {
        let (mut p, c, reg) = setup();
        let deadline = Duration::from_millis(200);
        let drain = Drain::spawn(c, reg.catalog(), vec![], full(200, 1024)).unwrap();
        let idle = drain.subscribe("idle", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        // A few hundred captures while nobody reads: once its 1 KiB backlog is full, the drain waits one deadline
        // for it, declares it stalled, and drops the rest for it without waiting (before: up to two deadlines each,
        // about two minutes here).
        for step in 0..300u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        settle(&reg, 300);
        let stalled_after = started.elapsed();
        assert!(stalled_after < 25 * deadline, "a stalled consumer held the drain for {stalled_after:?}");
        let first: Vec<_> = std::iter::from_fn(|| idle.try_recv()).collect();
        assert!((2..=16).contains(&first.len()), "{}", first.len());
        assert_eq!(first.last().unwrap().step(), first.len() as u64 - 1, "the queue kept the oldest records");

        // It reads again: back to full mode's rules — a full backlog is waited for, one deadline, then it is
        // declared stalled once more.
        for step in 300..400u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        settle(&reg, 400);
        let second: Vec<_> = std::iter::from_fn(|| idle.try_recv()).collect();
        assert_eq!(second.first().unwrap().step(), 300, "records were queued again once it read");
        drop(p);
        let report = drain.join().unwrap();
        assert!(started.elapsed() < 50 * deadline, "shutdown waited on the stalled consumer");
        let received = (first.len() + second.len()) as u64;
        assert_eq!(report.backpressure_drops, 400 - received);
        assert!(report.errors[0].contains("declared stalled 2 times"), "{:?}", report.errors);
        let acc = reg.accounting();
        acc.check().unwrap();
        let c = acc.hookpoints[0].1;
        assert_eq!(
            (c.exported.records, c.dropped_for(DropReason::SinkBackpressure).records),
            (received, 400 - received)
        );
    }

    #[test]
    fn a_slow_consumer_that_makes_progress_back_pressures_and_loses_nothing() {
        let (mut p, c, reg) = setup();
        // Its backlog holds a handful of records; it takes one every 20 ms, well within the 200 ms deadline.
        let drain = Drain::spawn(c, reg.catalog(), vec![], full(200, 1024)).unwrap();
        let slow = drain.subscribe("slow", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let reader = std::thread::spawn(move || {
            let mut n = 0;
            while slow.recv().is_some() {
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            n
        });
        for step in 0..60u64 {
            reg.capture(&mut p, 0, step, &[(1, 0)], &[0; 16]);
        }
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!(reader.join().unwrap(), 60);
        assert_eq!(report.backpressure_drops, 0, "{:?}", report.errors);
        reg.accounting().check().unwrap();
        assert_eq!(reg.accounting().total().exported.records, 60);
    }

    /// The pattern of record `step`'s rows in the lease tests: every byte says which record it belongs to.
    fn pattern(step: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (step as usize * 31 + i) as u8).collect()
    }

    #[test]
    fn records_are_lent_not_copied_and_a_record_a_sink_holds_is_never_overwritten() {
        // A 64 KiB ring and records of 2 KiB: 2,000 of them are 60 laps. The sink keeps the last 6 records it got
        // (a fifth of the ring, as a file sink holds records for a batch) and re-checks every byte of all of them
        // each time, while the producer waits for space and writes behind them.
        let (p, c) = channel(1 << 16).unwrap();
        let reg = TestCatalog::layers(1, 1024);
        let mut p = p;
        let (tx, checked) = crossbeam::channel::unbounded();
        let mut window: std::collections::VecDeque<Record> = Default::default();
        let holder = CallbackSink::new("holder", move |r: &Record| {
            window.push_back(r.clone());
            if window.len() > 6 {
                window.pop_front();
            }
            for held in &window {
                if held.data() != pattern(held.step(), held.data().len()).as_slice() {
                    return Err(format!("record of step {} was overwritten while held", held.step()).into());
                }
            }
            // Full mode, a sink that makes progress: it holds the ring (back-pressure), nothing is moved out.
            tx.send(r.is_leased()).unwrap();
            Ok(())
        });
        let drain = Drain::spawn(c, reg.catalog(), vec![boxed(holder)], full(10_000, 1 << 20)).unwrap();
        for step in 0..2000u64 {
            reg.capture(&mut p, 0, step, &[(1, step as u32)], &pattern(step, 2048));
        }
        drop(p);
        let report = drain.join().unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let leased: Vec<bool> = checked.try_iter().collect();
        assert_eq!(leased.len(), 2000);
        assert!(leased.iter().all(|&l| l), "records are lent, not copied");
        assert_eq!(report.evacuations, 0);
        let acc = reg.accounting();
        acc.check().unwrap();
        assert_eq!(acc.total().exported.records, 2000);
    }

    #[test]
    fn a_stalled_consumer_costs_its_backlog_in_host_memory_never_the_ring_and_drops_are_counted_exactly() {
        // Best-effort. A consumer that never reads, with a backlog (1 MiB) far larger than the ring (64 KiB): its
        // queue would hold the whole ring if it stayed there, and every capture would then wait forever (the test
        // fixture panics after 10 s). The drain moves it out of the ring instead; the fast sink gets everything.
        let (p, c) = channel(1 << 16).unwrap();
        let reg = TestCatalog::layers(1, 1024);
        let mut p = p;
        let (summary, handle) = SummarySink::new();
        let options = DrainOptions {
            backlog_bytes: 1 << 20,
            policy: LossPolicy { mode: Mode::BestEffort, full_deadline: Duration::ZERO },
            ..DrainOptions::default()
        };
        let drain = Drain::spawn(c, reg.catalog(), vec![boxed(summary)], options).unwrap();
        let stalled = drain.subscribe("stalled", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let total = 3000u64;
        for step in 0..total {
            reg.capture(&mut p, 0, step, &[(1, step as u32)], &pattern(step, 2048));
        }
        drop(p);
        std::thread::sleep(Duration::from_millis(100));
        let queued: Vec<Record> = std::iter::from_fn(|| stalled.try_recv()).collect();
        let report = drain.join().unwrap();
        // What the stalled consumer's queue kept: the oldest records, each intact, as much as 1 MiB holds.
        let size = queued[0].size_bytes();
        assert_eq!(queued.len(), (1 << 20) / size, "a full backlog, no more");
        assert!(queued.iter().enumerate().all(|(i, r)| r.step() == i as u64 && r.data() == pattern(i as u64, 2048)));
        assert!(queued.iter().all(|r| !r.is_leased()), "a received record is the consumer's own copy");
        assert!(report.evacuations > 0 && report.evacuated_records > 0, "{report:?}");
        // The fast destination keeps up unless the machine starves its thread (its backlog is 1 MiB too): whatever
        // either destination lost is counted, exactly.
        let fast = handle.lock()["layers.0.resid"].records;
        assert_eq!(report.backpressure_drops, (total - queued.len() as u64) + (total - fast));
        let acc = reg.accounting();
        acc.check().unwrap();
        let c = acc.hookpoints[0].1;
        assert_eq!(c.dropped_for(DropReason::RingFull).records, 0);
        if fast == total {
            // A record is exported when every destination has it (the stalled consumer's queue counts as having it).
            assert_eq!(c.exported.records, queued.len() as u64);
            assert_eq!(c.dropped_for(DropReason::SinkBackpressure).records, total - queued.len() as u64);
        }
    }

    #[test]
    fn records_moved_out_of_the_ring_while_a_consumer_receives_keep_their_order() {
        // Best-effort, a consumer that reads slowly: its queue is moved out of the ring again and again while it
        // receives. Moving happens in place, so it must see every record it gets in stream order.
        let (p, c) = channel(1 << 16).unwrap();
        let reg = TestCatalog::layers(1, 1024);
        let mut p = p;
        let options = DrainOptions {
            backlog_bytes: 1 << 20,
            policy: LossPolicy { mode: Mode::BestEffort, full_deadline: Duration::ZERO },
            ..DrainOptions::default()
        };
        let drain = Drain::spawn(c, reg.catalog(), vec![], options).unwrap();
        let slow = drain.subscribe("slow", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let reader = std::thread::spawn(move || {
            let mut steps = Vec::new();
            while let Some(r) = slow.recv() {
                assert_eq!(r.data(), pattern(r.step(), 2048).as_slice(), "record of step {} changed", r.step());
                steps.push(r.step());
                std::thread::sleep(Duration::from_micros(200));
            }
            steps
        });
        for step in 0..3000u64 {
            reg.capture(&mut p, 0, step, &[(1, step as u32)], &pattern(step, 2048));
        }
        drop(p);
        let report = drain.join().unwrap();
        let steps = reader.join().unwrap();
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "out of order");
        assert!(report.evacuations > 1 && report.evacuated_records > 0, "{report:?}");
        assert_eq!(report.backpressure_drops, 3000 - steps.len() as u64);
        reg.accounting().check().unwrap();
    }

    #[test]
    fn full_mode_a_consumer_that_never_reads_cannot_hold_the_ring_and_is_declared_stalled_at_its_backlog() {
        // Its backlog (256 KiB) is four rings: left in the ring, its queue would hold all of it long before the
        // backlog filled, and every capture would wait forever (the fixture panics after 10 s).
        let (p, c) = channel(1 << 16).unwrap();
        let reg = TestCatalog::layers(1, 1024);
        let mut p = p;
        let drain = Drain::spawn(c, reg.catalog(), vec![], full(200, 256 << 10)).unwrap();
        let idle = drain.subscribe("idle", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for step in 0..400u64 {
            reg.capture(&mut p, 0, step, &[(1, step as u32)], &pattern(step, 2048));
        }
        drop(p);
        let report = drain.join().unwrap();
        let kept: Vec<u64> = std::iter::from_fn(|| idle.try_recv()).map(|r| r.step()).collect();
        assert_eq!(kept, (0..kept.len() as u64).collect::<Vec<_>>());
        assert!(report.evacuated_records > 0 && kept.len() >= 100, "{report:?}");
        assert_eq!(report.backpressure_drops, 400 - kept.len() as u64);
        assert!(report.errors[0].contains("declared stalled 1 times"), "{:?}", report.errors);
        reg.accounting().check().unwrap();
    }

    #[test]
    fn the_monitor_shows_the_ring_each_destinations_lag_and_delivery_while_the_drain_runs() {
        let (p, c) = channel(1 << 16).unwrap();
        let reg = TestCatalog::layers(1, 1024);
        let mut p = p;
        // A sink that takes one record, then waits for the test before writing it; a sink that fails at once.
        let (gate, opened) = crossbeam::channel::unbounded::<()>();
        let gated = CallbackSink::new("gated", move |_: &Record| {
            opened.recv().unwrap();
            Ok(())
        });
        let broken = CallbackSink::new("broken", |_: &Record| Err("disk full".into()));
        let drain = Drain::spawn(c, reg.catalog(), vec![boxed(gated), boxed(broken)], full(10_000, 1 << 20)).unwrap();
        let monitor = drain.monitor();
        let probe = drain.subscribe("probe \"one\"", Filter::all()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for step in 0..5u64 {
            reg.capture(&mut p, 0, step, &[(1, step as u32)], &pattern(step, 2048));
        }
        let size = (ringscope_ring::record::HEADER_LEN + 64 + 2048) as u64;
        let deadline = Instant::now() + Duration::from_secs(60);
        while monitor.drain().records < 5 || monitor.destinations()[1].queued_records > 0 {
            assert!(Instant::now() < deadline, "{monitor:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
        let drained = monitor.drain();
        assert_eq!((drained.records, drained.rows, drained.data_bytes), (5, 5, 5 * 2048));
        let d = monitor.destinations();
        let names: Vec<_> = d.iter().map(|d| (d.name.as_str(), d.kind)).collect();
        assert_eq!(
            names,
            [
                ("gated", DestinationKind::Sink),
                ("broken", DestinationKind::Sink),
                ("probe \"one\"", DestinationKind::Consumer)
            ]
        );
        // The gated sink is writing one record (it counts as queued until written) and has four waiting; the broken
        // one took them all and failed.
        assert_eq!((d[0].delivered_records, d[0].queued_records, d[0].queued_bytes), (0, 5, 5 * size));
        assert_eq!((d[1].delivered_records, d[1].queued_records, d[1].failed), (0, 0, true));
        assert!(!d[0].failed && !d[2].failed);
        assert_eq!((d[2].queued_records, d[2].delivered_records), (5, 0));
        // Every record is still lent (the gated sink and the probe's queue hold them): the ring is used and held.
        let ring = monitor.ring();
        assert_eq!(ring.capacity, 1 << 16);
        assert!(ring.held > 0 && ring.used >= ring.held, "{ring:?}");
        assert_eq!(probe.recv().unwrap().step(), 0);
        let d = monitor.destinations();
        assert_eq!((d[2].queued_records, d[2].delivered_records, d[2].delivered_bytes), (4, 1, size));
        for _ in 0..5 {
            gate.send(()).unwrap();
        }
        drop(p);
        let report = drain.join().unwrap();
        let d = monitor.destinations();
        assert_eq!((d[0].delivered_records, d[0].delivered_bytes, d[0].queued_records), (5, 5 * size, 0));
        assert_eq!(report.records, monitor.drain().records);
        // After the drain: the last reading stands (the subscription still holds its four records).
        assert_eq!(monitor.ring().capacity, 1 << 16);
        assert_eq!(probe.iter().count(), 4);
        assert_eq!(monitor.destinations()[2].delivered_records, 5);
    }

    #[test]
    fn closing_a_subscription_wakes_every_thread_blocked_receiving_on_it() {
        let (mut p, c, reg) = setup();
        let drain = Drain::spawn(c, reg.catalog(), vec![], full(200, 1 << 20)).unwrap();
        let sub = Arc::new(drain.subscribe("probe", Filter::all()).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        let (done, woke) = crossbeam::channel::unbounded();
        let blocked = {
            let (sub, done) = (sub.clone(), done.clone());
            std::thread::spawn(move || done.send(format!("recv: {:?}", sub.recv().map(|r| r.step()))).unwrap())
        };
        let timed = {
            let sub = sub.clone();
            std::thread::spawn(move || {
                let got = sub.recv_timeout(Duration::from_secs(60)).map(|r| r.map(|r| r.step()));
                done.send(format!("recv_timeout: {got:?}")).unwrap()
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        sub.close();
        let mut seen = [woke.recv_timeout(Duration::from_secs(5)), woke.recv_timeout(Duration::from_secs(5))]
            .map(|r| r.expect("close woke the receiver"));
        seen.sort();
        assert_eq!(seen, ["recv: None".to_owned(), "recv_timeout: Err(())".to_owned()]);
        assert!(sub.is_closed());
        // Closed: records captured afterwards are neither offered nor returned.
        reg.capture(&mut p, 0, 0, &[(1, 0)], &[0; 16]);
        settle(&reg, 1);
        assert!(sub.try_recv().is_none() && sub.recv().is_none());
        drop(p);
        drain.join().unwrap();
        blocked.join().unwrap();
        timed.join().unwrap();
        reg.accounting().check().unwrap();
    }
}
