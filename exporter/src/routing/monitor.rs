//! Monitoring the drain while it runs: what it moved out of the ring, how full the ring is, and each destination's
//! progress and lag — read from any thread, cheaply enough to poll every step.
//!
//! The drain thread and the destinations keep the numbers in atomics as they go (one relaxed store or add per
//! record); a [`DrainMonitor`] reads them. Nothing here decides anything: the policy and the session's user do.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use ringscope_ring::{Occupancy, OccupancyGauge};

use crate::routing::fanout::Backlog;

/// What a destination is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DestinationKind {
    /// A sink, written by a worker thread of the drain (a Parquet or Arrow IPC file sink, a callback, ...).
    Sink,
    /// An online consumer reading a [`Subscription`](crate::Subscription).
    Consumer,
}

impl DestinationKind {
    /// `"sink"` or `"consumer"`.
    pub const fn name(self) -> &'static str {
        match self {
            DestinationKind::Sink => "sink",
            DestinationKind::Consumer => "consumer",
        }
    }
}

/// One destination's progress and lag at one moment. Counters are cumulative since the drain started; bytes are
/// record bytes as the backlogs count them (header and payload: [`Record::size_bytes`](crate::Record::size_bytes)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationStats {
    /// The sink's or subscription's name.
    pub name: String,
    /// Sink or consumer.
    pub kind: DestinationKind,
    /// Records it received: a sink wrote them (a file sink's records are durable only once their file is
    /// committed), a consumer received its copy.
    pub delivered_records: u64,
    /// Bytes of those records.
    pub delivered_bytes: u64,
    /// Records queued for it and not yet done with: its lag (a sink's record counts until it is written).
    pub queued_records: u64,
    /// Bytes of those records (bounded by `backlog_bytes`).
    pub queued_bytes: u64,
    /// Most bytes that may be queued for it: `export.backlog`, times its sink threads for a pool of sinks
    /// (`export.threads`).
    pub backlog_bytes: u64,
    /// Records dropped for it because its backlog was full (counted as `sink_backpressure`).
    pub dropped_records: u64,
    /// A sink that failed (its error is in the session's sink failures); never set for a consumer.
    pub failed: bool,
}

/// What the drain has moved out of the ring so far (cumulative since it started).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainStats {
    /// Records handed on from the ring to the destinations.
    pub records: u64,
    /// Token rows in them.
    pub rows: u64,
    /// Ring bytes of them (headers, row metadata and rows).
    pub bytes: u64,
    /// Activation bytes of them (rows only).
    pub data_bytes: u64,
}

/// Reads a drain's numbers from any thread, while it runs and after it has finished (then its final numbers).
/// Cloning it is cheap; every clone reads the same drain.
///
/// Cost of a read: relaxed atomic loads, one short lock for the ring gauge and one for the destination list, and
/// one `String` per destination (its name) — nothing proportional to the data moved.
#[derive(Clone)]
pub struct DrainMonitor(Arc<Inner>);

struct Inner {
    records: AtomicU64,
    rows: AtomicU64,
    bytes: AtomicU64,
    data_bytes: AtomicU64,
    ring: Mutex<Ring>,
    /// Append-only, in the order destinations were added (sinks first, then subscriptions): an index names the
    /// same destination for the drain's whole life.
    destinations: Mutex<Vec<(String, DestinationKind, Arc<Backlog>)>>,
}

/// The ring's gauge while the drain runs; its last reading once the drain has finished (the gauge keeps the ring's
/// memory, which must go back then).
enum Ring {
    Live(Arc<dyn OccupancyGauge>),
    Finished(Occupancy),
}

impl std::fmt::Debug for DrainMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainMonitor").field("drain", &self.drain()).field("ring", &self.ring()).finish()
    }
}

impl DrainMonitor {
    pub(crate) fn new(gauge: Arc<dyn OccupancyGauge>) -> DrainMonitor {
        DrainMonitor(Arc::new(Inner {
            records: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            data_bytes: AtomicU64::new(0),
            ring: Mutex::new(Ring::Live(gauge)),
            destinations: Mutex::new(Vec::new()),
        }))
    }

    /// The drain thread's running totals (it is their only writer: plain stores).
    pub(crate) fn set_drained(&self, totals: DrainStats) {
        let i = &self.0;
        i.records.store(totals.records, Ordering::Relaxed);
        i.rows.store(totals.rows, Ordering::Relaxed);
        i.bytes.store(totals.bytes, Ordering::Relaxed);
        i.data_bytes.store(totals.data_bytes, Ordering::Relaxed);
    }

    pub(crate) fn add_destination(&self, name: &str, kind: DestinationKind, backlog: Arc<Backlog>) {
        self.0.destinations.lock().push((name.to_owned(), kind, backlog));
    }

    /// The drain has finished: keeps the gauge's last reading and lets the ring's memory go.
    pub(crate) fn finish_ring(&self) {
        let mut ring = self.0.ring.lock();
        if let Ring::Live(gauge) = &*ring {
            let last = gauge.read();
            *ring = Ring::Finished(last);
        }
    }

    /// What the drain has moved out of the ring so far.
    pub fn drain(&self) -> DrainStats {
        let i = &self.0;
        DrainStats {
            records: i.records.load(Ordering::Relaxed),
            rows: i.rows.load(Ordering::Relaxed),
            bytes: i.bytes.load(Ordering::Relaxed),
            data_bytes: i.data_bytes.load(Ordering::Relaxed),
        }
    }

    /// How full the ring is (its gauge's last reading once the drain has finished).
    pub fn ring(&self) -> Occupancy {
        match &*self.0.ring.lock() {
            Ring::Live(gauge) => gauge.read(),
            Ring::Finished(last) => *last,
        }
    }

    /// Every destination's progress and lag, in the order they were added (sinks, then subscriptions; a closed
    /// subscription stays listed with its totals).
    pub fn destinations(&self) -> Vec<DestinationStats> {
        self.0
            .destinations
            .lock()
            .iter()
            .map(|(name, kind, backlog)| {
                let r = backlog.read();
                DestinationStats {
                    name: name.clone(),
                    kind: *kind,
                    delivered_records: r.delivered_records,
                    delivered_bytes: r.delivered_bytes,
                    queued_records: r.queued_records,
                    queued_bytes: r.queued_bytes,
                    backlog_bytes: r.backlog_bytes,
                    dropped_records: r.dropped_records,
                    failed: r.failed,
                }
            })
            .collect()
    }
}
