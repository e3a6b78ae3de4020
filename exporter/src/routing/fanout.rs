//! Fan-out from the drain to sinks and consumers: one bounded channel per destination, with a backlog bounded in
//! bytes, and the policy's answer when it is full.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::{Condvar, Mutex};
use ringscope_policy::{DropReason, LossPolicy, OnFull};

use crate::routing::catalog::CatalogEntry;
use crate::routing::record::Record;

/// Which records a sink or consumer receives. Empty sets mean "all".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Hookpoint names to receive (empty: every hookpoint).
    pub hookpoints: HashSet<String>,
    /// Layers to receive (empty: every layer, and hookpoints without a layer).
    pub layers: HashSet<u32>,
    /// `(count, index)`: only hookpoints whose id is `index` modulo `count` — splits one sink's work over
    /// several sink threads, each owning whole hookpoints (so each file still has one writer).
    pub shard: Option<(u32, u32)>,
}

impl Filter {
    /// Every record.
    pub fn all() -> Self {
        Filter::default()
    }

    /// Only these hookpoints.
    pub fn hookpoints<I: IntoIterator<Item = S>, S: Into<String>>(names: I) -> Self {
        Filter { hookpoints: names.into_iter().map(Into::into).collect(), ..Filter::default() }
    }

    /// Only these layers.
    pub fn layers(layers: impl IntoIterator<Item = u32>) -> Self {
        Filter { layers: layers.into_iter().collect(), ..Filter::default() }
    }

    /// Shard `index` of `count` (see the `shard` field).
    pub fn shard(count: u32, index: u32) -> Self {
        Filter { shard: Some((count.max(1), index)), ..Filter::default() }
    }

    /// Whether records of `hp` pass.
    pub fn matches(&self, hp: &CatalogEntry) -> bool {
        self.shard.is_none_or(|(n, i)| hp.id() % n == i)
            && (self.hookpoints.is_empty() || self.hookpoints.contains(hp.name()))
            && (self.layers.is_empty() || hp.spec().layer.is_some_and(|l| self.layers.contains(&l)))
    }
}

/// Bytes queued for one destination and not yet taken by it.
#[derive(Debug)]
pub(crate) struct Backlog {
    bytes: AtomicUsize,
    max: usize,
    lock: Mutex<()>,
    taken: Condvar,
}

impl Backlog {
    pub(crate) fn new(max: usize) -> Arc<Backlog> {
        Arc::new(Backlog { bytes: AtomicUsize::new(0), max, lock: Mutex::new(()), taken: Condvar::new() })
    }

    /// The destination took a record of `size` bytes.
    pub(crate) fn taken(&self, size: usize) {
        self.bytes.fetch_sub(size, Ordering::AcqRel);
        let _guard = self.lock.lock();
        self.taken.notify_all();
    }

    pub(crate) fn queued(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Whether `size` more bytes fit. A record is always admitted into an empty backlog, whatever its size, so a
    /// budget smaller than one record slows a destination down but never blocks it forever.
    fn fits(&self, size: usize) -> bool {
        let q = self.queued();
        q == 0 || q + size <= self.max
    }
}

/// Capacity of a port's channel in records. The byte budget is the real bound; this only caps bookkeeping.
pub(crate) const PORT_RECORDS: usize = 1 << 16;

/// A new port and the receiving end for its destination.
pub(crate) fn port(
    name: String,
    filter: Filter,
    max_backlog_bytes: usize,
    consumer: bool,
) -> (Port, Receiver<Record>, Arc<Backlog>, Arc<AtomicBool>) {
    let (tx, rx) = crossbeam::channel::bounded(PORT_RECORDS);
    let backlog = Backlog::new(max_backlog_bytes);
    let gone = Arc::new(AtomicBool::new(false));
    let port = Port {
        name,
        filter,
        tx,
        rx_back: rx.clone(),
        backlog: backlog.clone(),
        gone: gone.clone(),
        closed: false,
        dropped: 0,
        consumer,
    };
    (port, rx, backlog, gone)
}

/// One destination of the drain: a sink's worker thread or a consumer's subscription.
pub(crate) struct Port {
    pub(crate) name: String,
    pub(crate) filter: Filter,
    pub(crate) tx: Sender<Record>,
    /// A second receiving end, used only to take back what a departed consumer left queued.
    pub(crate) rx_back: Receiver<Record>,
    pub(crate) backlog: Arc<Backlog>,
    /// Set by a consumer's subscription when it is dropped.
    pub(crate) gone: Arc<AtomicBool>,
    /// No more records are offered.
    pub(crate) closed: bool,
    /// Records dropped for this destination because its backlog was full.
    pub(crate) dropped: u64,
    /// An online consumer (a subscription), as opposed to a sink: delivery into its queue is its export.
    pub(crate) consumer: bool,
}

/// What happened when the drain offered a record to a port.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Offer {
    Queued,
    Filtered,
    Dropped(DropReason),
    Closed,
}

impl Port {
    /// Offers `record`: queues it, or — when the backlog is full — waits (full mode, up to the deadline) or drops it
    /// for this port (best-effort), failing its receipt with the reason.
    pub(crate) fn offer(&mut self, record: &Record, policy: &LossPolicy) -> Offer {
        if self.closed {
            return Offer::Closed;
        }
        if self.gone.load(Ordering::Acquire) {
            self.close_departed();
            return Offer::Closed;
        }
        if !self.filter.matches(record.hookpoint()) {
            return Offer::Filtered;
        }
        let size = record.size_bytes();
        if !self.backlog.fits(size) {
            let admitted = match policy.on_backlog_full() {
                OnFull::Drop => false,
                OnFull::Wait(deadline) => self.wait_for_room(size, Instant::now() + deadline),
            };
            if !admitted {
                self.dropped += 1;
                record.receipt().fail(DropReason::SinkBackpressure);
                return Offer::Dropped(DropReason::SinkBackpressure);
            }
        }
        self.backlog.bytes.fetch_add(size, Ordering::AcqRel);
        let queued = if self.consumer { record.detached() } else { record.clone() };
        // The channel's record-count bound only matters for tiny records under a large byte budget; the policy
        // applies to it as to the byte budget. (The channel cannot disconnect: the port holds a receiver too.)
        let sent = match policy.on_backlog_full() {
            OnFull::Drop => self.tx.try_send(queued).is_ok(),
            OnFull::Wait(deadline) => self.tx.send_timeout(queued, deadline).is_ok(),
        };
        if sent {
            return Offer::Queued;
        }
        self.backlog.bytes.fetch_sub(size, Ordering::AcqRel);
        self.dropped += 1;
        // The original record: a consumer's queued copy is detached and carries no receipt.
        record.receipt().fail(DropReason::SinkBackpressure);
        Offer::Dropped(DropReason::SinkBackpressure)
    }

    /// The consumer is gone: nothing more is offered, and what it left queued is released.
    pub(crate) fn close_departed(&mut self) {
        self.closed = true;
        while let Ok(r) = self.rx_back.try_recv() {
            self.backlog.taken(r.size_bytes());
        }
    }

    /// At shutdown: a departed consumer's leftovers are released; a live one keeps its queue to receive.
    pub(crate) fn finish(&mut self) {
        if self.gone.load(Ordering::Acquire) {
            self.close_departed();
        }
    }

    fn wait_for_room(&self, size: usize, deadline: Instant) -> bool {
        if self.gone.load(Ordering::Acquire) {
            return false;
        }
        let mut guard = self.backlog.lock.lock();
        while !self.backlog.fits(size) {
            if Instant::now() >= deadline {
                return false;
            }
            // Timeout as a backstop: `Backlog::taken` notifies under the same lock.
            let wake = deadline.min(Instant::now() + Duration::from_millis(10));
            self.backlog.taken.wait_until(&mut guard, wake);
        }
        true
    }
}

/// A consumer's end of the stream: records of the hookpoints it subscribed to, in stream order.
///
/// A record is exported once it is in the subscription's queue. Receive promptly: a subscription that falls behind
/// its byte budget makes the drain wait (full mode, up to twice the deadline) or drops records for it
/// (best-effort, counted as `sink_backpressure`). Dropping the subscription unsubscribes.
pub struct Subscription {
    rx: Receiver<Record>,
    backlog: Arc<Backlog>,
    gone: Arc<AtomicBool>,
}

impl Subscription {
    pub(crate) fn new(rx: Receiver<Record>, backlog: Arc<Backlog>, gone: Arc<AtomicBool>) -> Self {
        Subscription { rx, backlog, gone }
    }

    fn took(&self, r: Record) -> Record {
        self.backlog.taken(r.size_bytes());
        r
    }

    /// Waits for the next record; `None` once the session has shut down and everything was received.
    pub fn recv(&self) -> Option<Record> {
        self.rx.recv().ok().map(|r| self.took(r))
    }

    /// Waits up to `timeout` for the next record. `Ok(None)` on timeout; `Err(())` once the stream has ended.
    #[allow(clippy::result_unit_err)]
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Record>, ()> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => Ok(Some(self.took(r))),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(()),
        }
    }

    /// The next record if one is queued.
    pub fn try_recv(&self) -> Option<Record> {
        match self.rx.try_recv() {
            Ok(r) => Some(self.took(r)),
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => None,
        }
    }

    /// Bytes queued for this subscription and not yet received.
    pub fn backlog_bytes(&self) -> usize {
        self.backlog.queued()
    }

    /// Iterates until the stream ends.
    pub fn iter(&self) -> impl Iterator<Item = Record> + '_ {
        std::iter::from_fn(|| self.recv())
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.gone.store(true, Ordering::Release);
        while let Ok(r) = self.rx.try_recv() {
            self.backlog.taken(r.size_bytes());
        }
    }
}
