//! Fan-out from the drain to sinks and consumers: one bounded channel per destination, with a backlog bounded in
//! bytes, and the policy's answer when it is full.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

    /// Whether records of `hp` pass the hookpoint and layer sets.
    pub fn matches(&self, hp: &CatalogEntry) -> bool {
        (self.hookpoints.is_empty() || self.hookpoints.contains(hp.name()))
            && (self.layers.is_empty() || hp.spec().layer.is_some_and(|l| self.layers.contains(&l)))
    }
}

/// Bytes queued for one destination and not yet taken by it — and, for monitoring ([`DrainMonitor`]), the running
/// totals of what it received. Shared by the drain (which queues), the destination (which takes) and the monitor.
///
/// [`DrainMonitor`]: crate::routing::monitor::DrainMonitor
#[derive(Debug)]
pub(crate) struct Backlog {
    bytes: AtomicUsize,
    /// Records queued and not yet taken (moves with `bytes`).
    records: AtomicU64,
    max: usize,
    /// Records the destination has taken so far: its progress, which tells a slow consumer from a stalled one.
    progress: AtomicU64,
    /// Records the destination received (a sink wrote it, a consumer received its copy), and their bytes.
    delivered_records: AtomicU64,
    delivered_bytes: AtomicU64,
    /// Records dropped for this destination because its backlog was full.
    dropped: AtomicU64,
    /// The sink failed (nothing more is written to it).
    failed: AtomicBool,
    lock: Mutex<()>,
    taken: Condvar,
}

impl Backlog {
    pub(crate) fn new(max: usize) -> Arc<Backlog> {
        Arc::new(Backlog {
            bytes: AtomicUsize::new(0),
            records: AtomicU64::new(0),
            max,
            progress: AtomicU64::new(0),
            delivered_records: AtomicU64::new(0),
            delivered_bytes: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            lock: Mutex::new(()),
            taken: Condvar::new(),
        })
    }

    /// The destination took a record of `size` bytes.
    pub(crate) fn taken(&self, size: usize) {
        self.bytes.fetch_sub(size, Ordering::AcqRel);
        self.records.fetch_sub(1, Ordering::Relaxed);
        self.progress.fetch_add(1, Ordering::AcqRel);
        self.wake();
    }

    /// The destination received a record of `size` bytes (a sink wrote it, a consumer got its copy).
    pub(crate) fn delivered(&self, size: usize) {
        self.delivered_records.fetch_add(1, Ordering::Relaxed);
        self.delivered_bytes.fetch_add(size as u64, Ordering::Relaxed);
    }

    /// The sink failed: it is not written to again.
    pub(crate) fn set_failed(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }

    /// Its numbers now, for a monitor.
    pub(crate) fn read(&self) -> BacklogReading {
        BacklogReading {
            delivered_records: self.delivered_records.load(Ordering::Relaxed),
            delivered_bytes: self.delivered_bytes.load(Ordering::Relaxed),
            queued_records: self.records.load(Ordering::Relaxed),
            queued_bytes: self.queued() as u64,
            backlog_bytes: self.max as u64,
            dropped_records: self.dropped.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }

    /// Wakes the drain if it waits for room (something was taken, or the destination left).
    fn wake(&self) {
        // Under the lock: the drain checks for room and the destination's departure while holding it, then sleeps;
        // a notify taken under it cannot fall between the check and the sleep.
        let _guard = self.lock.lock();
        self.taken.notify_all();
    }

    fn progress(&self) -> u64 {
        self.progress.load(Ordering::Acquire)
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

/// One destination's numbers at one moment ([`Backlog::read`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BacklogReading {
    pub(crate) delivered_records: u64,
    pub(crate) delivered_bytes: u64,
    pub(crate) queued_records: u64,
    pub(crate) queued_bytes: u64,
    pub(crate) backlog_bytes: u64,
    pub(crate) dropped_records: u64,
    pub(crate) failed: bool,
}

/// Capacity of a port's queue in records. The byte budget is the real bound; this only caps bookkeeping.
pub(crate) const PORT_RECORDS: usize = 1 << 16;

/// One destination's queue: records in stream order, taken from the front by the destination, added at the back by
/// the drain, and — under ring pressure — moved out of the ring *in place* by the drain ([`Queue::evacuate`]), which
/// a channel could not do without taking records out and putting them back (a receiver taking one meanwhile would
/// see them out of order).
pub(crate) struct Queue {
    items: Mutex<Items>,
    ready: Condvar,
}

struct Items {
    /// Each queued record with when it arrived: a pool's sinks take any hookpoint's record once the oldest has
    /// waited long enough ([`Queue::take`]).
    records: VecDeque<(Record, Instant)>,
    /// The drain is gone: once empty, nothing more will come.
    ended: bool,
    /// The destination closed it (a subscription's `close`): receivers see the end at once.
    closed: bool,
    /// The latest commit asked of a pool's sinks ([`Queue::request_commit`]); 0: none yet.
    commit: u64,
}

/// What a receiver got from a [`Queue`].
pub(crate) enum Received {
    Record(Record),
    /// Nothing within the time given.
    Timeout,
    /// The stream ended (drain gone, queue empty) or the queue was closed.
    End,
    /// A pool's sink is asked to commit what it holds ([`Queue::request_commit`]): commit number `n`.
    Commit(u64),
}

impl Queue {
    fn new() -> Arc<Queue> {
        Arc::new(Queue {
            items: Mutex::new(Items { records: VecDeque::new(), ended: false, closed: false, commit: 0 }),
            ready: Condvar::new(),
        })
    }

    fn len(&self) -> usize {
        self.items.lock().records.len()
    }

    fn push(&self, record: Record) {
        self.items.lock().records.push_back((record, Instant::now()));
        // Every receiver: a pool's sinks each wait for records of their own hookpoints (see `take`).
        self.ready.notify_all();
    }

    /// The next record for sink `worker` of a pool of `workers` sharing this queue. Each sink has hookpoints of its
    /// own (id modulo `workers`), so that a hookpoint's records stay in one sink's files while the sinks keep up: it
    /// takes the first of its own among the oldest few queued, else the oldest record of any hookpoint once the
    /// others are behind — as many records queued as sinks, or the oldest waiting for `steal_after` — or the stream
    /// has ended. Records of one hookpoint are taken in stream order, whoever takes them.
    ///
    /// A sink that has carried out commit number `committed` gets [`Received::Commit`] once a later one is asked
    /// for and no record is queued: every record queued before the request has been taken by then (by this sink or
    /// another of the pool, each of which commits in turn once it comes back for more).
    ///
    /// `idle_after`: when nothing is taken within it, returns [`Received::Timeout`] (the sink lets go of what it
    /// holds in the ring while idle); `None` waits for as long as it takes.
    pub(crate) fn take(
        &self,
        worker: usize,
        workers: usize,
        steal_after: Duration,
        committed: u64,
        idle_after: Option<Duration>,
    ) -> Received {
        let workers = workers.max(1);
        let window = workers.saturating_mul(4);
        let idle_at = idle_after.map(|d| Instant::now() + d);
        let mut items = self.items.lock();
        loop {
            if items.closed {
                return Received::End;
            }
            if items.commit > committed && items.records.is_empty() {
                return Received::Commit(items.commit);
            }
            let own =
                items.records.iter().take(window).position(|(r, _)| r.hookpoint().id() as usize % workers == worker);
            let oldest = items.records.front().map(|&(_, at)| at);
            let take = match (own, oldest) {
                (Some(i), _) => Some(i),
                (None, Some(at)) if items.ended || items.records.len() >= workers || at.elapsed() >= steal_after => {
                    Some(0)
                }
                _ => None,
            };
            if let Some(i) = take {
                return Received::Record(items.records.remove(i).expect("a queued record").0);
            }
            if idle_at.is_some_and(|t| Instant::now() >= t) && !(oldest.is_none() && items.ended) {
                return Received::Timeout;
            }
            let steal_at = oldest.map(|at| at + steal_after);
            match (oldest, steal_at.into_iter().chain(idle_at).min()) {
                (None, _) if items.ended => return Received::End,
                (_, None) => self.ready.wait(&mut items),
                (_, Some(until)) => {
                    self.ready.wait_until(&mut items, until);
                }
            }
        }
    }

    /// Asks the pool's sinks to commit what they hold once the records queued now are taken (see [`take`]); returns
    /// the commit's number.
    ///
    /// [`take`]: Queue::take
    pub(crate) fn request_commit(&self) -> u64 {
        let mut items = self.items.lock();
        items.commit += 1;
        self.ready.notify_all();
        items.commit
    }

    /// The next record: waits up to `timeout` (`None`: until one comes or the stream ends).
    pub(crate) fn pop(&self, timeout: Option<Duration>) -> Received {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut items = self.items.lock();
        loop {
            if items.closed {
                return Received::End;
            }
            if let Some((r, _)) = items.records.pop_front() {
                return Received::Record(r);
            }
            if items.ended {
                return Received::End;
            }
            match deadline {
                None => self.ready.wait(&mut items),
                Some(d) => {
                    if self.ready.wait_until(&mut items, d).timed_out() && items.records.is_empty() {
                        return if items.closed || items.ended { Received::End } else { Received::Timeout };
                    }
                }
            }
        }
    }

    /// Takes every queued record out (a departed or closed destination's leftovers).
    fn take_all(&self) -> Vec<Record> {
        self.items.lock().records.drain(..).map(|(r, _)| r).collect()
    }

    /// The drain is gone: receivers get what is queued, then the end.
    pub(crate) fn end(&self) {
        self.items.lock().ended = true;
        self.ready.notify_all();
    }

    /// The destination is closed: every receiver, waiting or not, sees the end.
    fn close(&self) {
        self.items.lock().closed = true;
        self.ready.notify_all();
    }

    /// Moves every queued record that is still lent by the ring into host memory of its own, in place (order and
    /// byte counts unchanged). Returns how many were moved and how many could not be (memory refused: they stay).
    fn evacuate(&self) -> (u64, u64) {
        let (mut moved, mut refused) = (0, 0);
        for (r, _) in self.items.lock().records.iter_mut().filter(|(r, _)| r.is_leased()) {
            match r.detach() {
                Ok(copy) => {
                    *r = copy;
                    moved += 1;
                }
                Err(_) => refused += 1,
            }
        }
        (moved, refused)
    }
}

/// A new port and the queue its destination receives from.
pub(crate) fn port(
    name: String,
    filter: Filter,
    max_backlog_bytes: usize,
    consumer: bool,
) -> (Port, Arc<Queue>, Arc<Backlog>, Arc<AtomicBool>) {
    let queue = Queue::new();
    let backlog = Backlog::new(max_backlog_bytes);
    let gone = Arc::new(AtomicBool::new(false));
    let port = Port {
        name,
        filter,
        queue: queue.clone(),
        backlog: backlog.clone(),
        gone: gone.clone(),
        closed: false,
        dropped: 0,
        consumer,
        stalled_at: None,
        stalls: 0,
    };
    (port, queue, backlog, gone)
}

/// One destination of the drain: a sink's worker thread or a consumer's subscription.
pub(crate) struct Port {
    pub(crate) name: String,
    pub(crate) filter: Filter,
    pub(crate) queue: Arc<Queue>,
    pub(crate) backlog: Arc<Backlog>,
    /// Set by a consumer's subscription when it is dropped.
    pub(crate) gone: Arc<AtomicBool>,
    /// No more records are offered.
    pub(crate) closed: bool,
    /// Records dropped for this destination because its backlog was full.
    pub(crate) dropped: u64,
    /// An online consumer (a subscription), as opposed to a sink: delivery into its queue is its export.
    pub(crate) consumer: bool,
    /// A consumer declared stalled (full mode: no record taken for a whole deadline while its backlog was full):
    /// its progress count then. Until the count moves, records that find its backlog full are dropped for it at
    /// once instead of making the drain wait.
    pub(crate) stalled_at: Option<u64>,
    /// Times this consumer was declared stalled.
    pub(crate) stalls: u64,
}

impl Drop for Port {
    fn drop(&mut self) {
        // The drain is done with this destination: its receiver gets what is queued, then the end.
        self.queue.end();
    }
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
        if !self.has_room(size) {
            let admitted = match policy.on_backlog_full() {
                OnFull::Drop => false,
                OnFull::Wait(limit) => self.wait_for_room(size, limit, policy.full_deadline),
            };
            if !admitted {
                self.dropped += 1;
                self.backlog.dropped.fetch_add(1, Ordering::Relaxed);
                record.receipt().fail(DropReason::SinkBackpressure);
                return Offer::Dropped(DropReason::SinkBackpressure);
            }
        }
        self.backlog.bytes.fetch_add(size, Ordering::AcqRel);
        self.backlog.records.fetch_add(1, Ordering::Relaxed);
        let queued = if self.consumer { record.detached() } else { record.clone() };
        // `has_room` saw a free slot in the queue too, and the drain is its only producer.
        self.queue.push(queued);
        Offer::Queued
    }

    /// The consumer is gone: nothing more is offered, and what it left queued is released.
    pub(crate) fn close_departed(&mut self) {
        self.closed = true;
        for r in self.queue.take_all() {
            self.backlog.taken(r.size_bytes());
        }
    }

    /// Moves the records waiting in this destination's queue out of the ring into host memory of their own, in
    /// place and in order, so that they no longer hold ring space. Returns how many were moved and how many could
    /// not be (memory refused: those stay lent).
    pub(crate) fn evacuate(&mut self) -> (u64, u64) {
        if self.closed {
            return (0, 0);
        }
        self.queue.evacuate()
    }

    /// At shutdown: a departed consumer's leftovers are released; a live one keeps its queue to receive.
    pub(crate) fn finish(&mut self) {
        if self.gone.load(Ordering::Acquire) {
            self.close_departed();
        }
    }

    /// Whether a record of `size` bytes can be queued now: within the byte budget, and a free slot in the channel
    /// (whose record-count bound only matters for tiny records under a large byte budget).
    fn has_room(&self, size: usize) -> bool {
        self.backlog.fits(size) && self.queue.len() < PORT_RECORDS
    }

    /// Full mode: waits until a record of `size` bytes fits, for at most `limit`. Returns whether it fits.
    ///
    /// A consumer that takes records (however slowly) is waited for, up to `limit`: it back-pressures. One that
    /// takes nothing for `stall_after` (the policy's deadline) is declared stalled, and later records that find its
    /// backlog full are dropped for it without waiting until it takes a record again — so a consumer that stopped
    /// reading holds the drain, and through it the engine, for at most one deadline, and shutdown does not wait on
    /// it at all once it is stalled. A departed consumer is never waited for.
    fn wait_for_room(&mut self, size: usize, limit: Duration, stall_after: Duration) -> bool {
        let backlog = self.backlog.clone();
        let started = Instant::now();
        let deadline = started + limit;
        let mut progress = backlog.progress();
        if let Some(at) = self.stalled_at {
            if progress == at {
                return false;
            }
            self.stalled_at = None; // it reads again: back to back-pressure
        }
        let mut last_progress = started;
        let mut guard = backlog.lock.lock();
        while !self.has_room(size) {
            if self.gone.load(Ordering::Acquire) {
                return false;
            }
            let now = Instant::now();
            let p = backlog.progress();
            if p != progress {
                (progress, last_progress) = (p, now);
            }
            let stall_at = last_progress + stall_after;
            if self.consumer && now >= stall_at {
                self.stalled_at = Some(progress);
                self.stalls += 1;
                return false;
            }
            if now >= deadline {
                return false;
            }
            // Timeout as a backstop: `Backlog::taken` and the subscription's `close` notify under the same lock.
            let wake =
                deadline.min(if self.consumer { stall_at } else { deadline }).min(now + Duration::from_millis(10));
            backlog.taken.wait_until(&mut guard, wake);
        }
        true
    }
}

/// A consumer's end of the stream: records of the hookpoints it subscribed to, in stream order.
///
/// Records wait in the queue where the drain put them (in the ring); each one received is the consumer's own copy,
/// made on the receiving thread, which it may keep as long as it likes.
///
/// A record is exported once it is in the subscription's queue, whose size is bounded by `export.backlog` bytes.
/// When the queue is full:
///
/// * best-effort mode drops the record for this subscription (counted as `sink_backpressure`);
/// * full mode makes the drain wait while the subscription makes progress — a consumer that is merely slow
///   back-pressures the drain (up to twice the deadline per record), and through the ring the engine;
/// * but a subscription that takes **no** record for one whole deadline (`policy.full_deadline_ms`) while its queue
///   is full is declared *stalled*: from then on a record that finds its queue full is dropped for it at once and
///   counted (`sink_backpressure`), without waiting, until it takes a record again. A consumer that stopped reading
///   therefore holds the engine for at most one deadline, and shutting the session down waits on it at most that
///   long (once stalled, not at all).
///
/// [`close`](Self::close) (or dropping the subscription) unsubscribes: any thread blocked in [`recv`](Self::recv)
/// or [`recv_timeout`](Self::recv_timeout) on it wakes at once and sees the end of the stream, and no record is
/// returned after `close` has returned.
pub struct Subscription {
    queue: Arc<Queue>,
    backlog: Arc<Backlog>,
    /// Set by `close`: the drain stops offering records, receivers see the end.
    gone: Arc<AtomicBool>,
    /// Records taken from the queue by receivers (counted before the queue's bytes go down).
    received: AtomicU64,
}

impl Subscription {
    pub(crate) fn new(queue: Arc<Queue>, backlog: Arc<Backlog>, gone: Arc<AtomicBool>) -> Self {
        Subscription { queue, backlog, gone, received: AtomicU64::new(0) }
    }

    /// Records receivers have taken from the queue so far. Counted before [`backlog_bytes`](Self::backlog_bytes)
    /// goes down: a consumer that counts the records it has finished with knows it is idle when the backlog is
    /// empty and its count equals this one (read the backlog first).
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::SeqCst)
    }

    /// Accounts for a record taken from the queue and gives the consumer its own copy, so that what it keeps never
    /// holds ring space; `None` if the subscription was closed meanwhile (so a receiver racing with `close` never
    /// hands out a record after `close` returned).
    fn took(&self, r: Record) -> Option<Record> {
        self.received.fetch_add(1, Ordering::SeqCst);
        // The copy is made here, on the consumer's thread, not the drain's. Memory refused: the record stays in the
        // ring (correct, only holding ring space while kept).
        let r = r.detach().unwrap_or(r);
        self.backlog.taken(r.size_bytes());
        let open = !self.is_closed();
        if open {
            self.backlog.delivered(r.size_bytes());
        }
        open.then_some(r)
    }

    /// Waits for the next record; `None` once the session has shut down and everything was received, or once the
    /// subscription is closed (from any thread).
    pub fn recv(&self) -> Option<Record> {
        match self.queue.pop(None) {
            Received::Record(r) => self.took(r),
            Received::Timeout | Received::End | Received::Commit(_) => None, // a subscription is never asked to commit
        }
    }

    /// Waits up to `timeout` for the next record. `Ok(None)` on timeout; `Err(())` once the stream has ended or the
    /// subscription is closed ([`is_closed`](Self::is_closed) tells which).
    #[allow(clippy::result_unit_err)]
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Record>, ()> {
        match self.queue.pop(Some(timeout)) {
            Received::Record(r) => self.took(r).map(Some).ok_or(()),
            Received::Timeout | Received::Commit(_) => Ok(None),
            Received::End => Err(()),
        }
    }

    /// The next record if one is queued.
    pub fn try_recv(&self) -> Option<Record> {
        match self.queue.pop(Some(Duration::ZERO)) {
            Received::Record(r) => self.took(r),
            Received::Timeout | Received::End | Received::Commit(_) => None,
        }
    }

    /// Unsubscribes, from any thread: the drain offers nothing more (and stops waiting for room, if it was), what
    /// is queued is released, and every thread blocked receiving on this subscription wakes and sees the end of the
    /// stream. Records already queued were counted as exported when they were queued. Closing twice is harmless.
    pub fn close(&self) {
        self.gone.store(true, Ordering::Release);
        self.queue.close();
        for r in self.queue.take_all() {
            self.backlog.taken(r.size_bytes());
        }
        self.backlog.wake();
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.gone.load(Ordering::Acquire)
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
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestCatalog;
    use ringscope_ring::channel;

    /// Records of hookpoints `hps`, in this order, copied out of a host ring.
    fn records(hps: &[u32]) -> Vec<Record> {
        let reg = TestCatalog::layers(4, 8);
        let (mut p, mut c) = channel(1 << 16).unwrap();
        let mut out = Vec::new();
        for (step, &hp) in hps.iter().enumerate() {
            reg.capture(&mut p, hp, step as u64, &[(1, 0)], &[0; 16]);
            let view = c.peek().unwrap().unwrap();
            out.push(Record::copy_from(&view, reg.catalog().entry(hp).unwrap()).unwrap());
            c.advance();
        }
        out
    }

    fn take_hp(q: &Queue, worker: usize, workers: usize, steal_after: Duration) -> Option<(u32, u64)> {
        match q.take(worker, workers, steal_after, 0, None) {
            Received::Record(r) => Some((r.hookpoint().id(), r.header().seq)),
            _ => None,
        }
    }

    #[test]
    fn a_pools_sink_takes_its_own_hookpoints_first_and_others_only_when_they_are_behind() {
        let long = Duration::from_secs(600); // never reached: every take below is decided without waiting
        let q = Queue::new();
        for r in records(&[0, 1, 2, 3]) {
            q.push(r);
        }
        // Two sinks: hookpoints 0 and 2 are sink 0's, 1 and 3 sink 1's; each takes its own, in stream order, even
        // when another's is older.
        assert_eq!(take_hp(&q, 1, 2, long), Some((1, 1)));
        assert_eq!(take_hp(&q, 1, 2, long), Some((3, 3)));
        // Sink 1 has none left and two records are queued (as many as sinks): the others are behind, it takes the
        // oldest.
        assert_eq!(take_hp(&q, 1, 2, long), Some((0, 0)));
        assert_eq!(take_hp(&q, 0, 2, long), Some((2, 2)));
        assert_eq!(q.len(), 0);

        // One record of sink 0's queued, fewer than sinks: sink 1 waits for it to age `steal_after`, then takes it.
        q.push(records(&[2]).pop().unwrap());
        let started = Instant::now();
        assert_eq!(take_hp(&q, 1, 2, Duration::from_millis(30)), Some((2, 0)));
        assert!(started.elapsed() >= Duration::from_millis(30));

        // Once the stream has ended, any sink takes whatever is left, then sees the end.
        for r in records(&[0, 2]) {
            q.push(r);
        }
        q.end();
        assert_eq!(take_hp(&q, 1, 2, long), Some((0, 0)));
        assert_eq!(take_hp(&q, 1, 2, long), Some((2, 1)));
        assert_eq!(take_hp(&q, 1, 2, long), None);
    }

    #[test]
    fn a_commit_comes_after_the_records_queued_before_it_once_for_each_sink() {
        let long = Duration::from_secs(600);
        let q = Queue::new();
        for r in records(&[0, 1]) {
            q.push(r);
        }
        assert_eq!(q.request_commit(), 1);
        // The pool's sinks take the queued records first, then each gets the commit once.
        assert_eq!(take_hp(&q, 0, 2, long), Some((0, 0)));
        assert_eq!(take_hp(&q, 1, 2, long), Some((1, 1)));
        assert!(matches!(q.take(0, 2, long, 0, None), Received::Commit(1)));
        assert!(matches!(q.take(1, 2, long, 0, None), Received::Commit(1)));
        // Carried out: a sink that has done commit 1 waits for records again; a record queued later is taken.
        q.push(records(&[1]).pop().unwrap());
        assert_eq!(take_hp(&q, 1, 2, long), Some((1, 0)));
        q.end();
        assert!(matches!(q.take(0, 2, long, 1, None), Received::End));
        // A one-sink pool the same.
        let q = Queue::new();
        q.push(records(&[3]).pop().unwrap());
        assert_eq!(q.request_commit(), 1);
        assert_eq!(q.request_commit(), 2);
        assert_eq!(take_hp(&q, 0, 1, long), Some((3, 0)));
        assert!(matches!(q.take(0, 1, long, 0, None), Received::Commit(2)));
    }

    #[test]
    fn a_sink_waiting_with_an_idle_time_is_told_when_nothing_came() {
        let long = Duration::from_secs(600);
        let q = Queue::new();
        // Nothing queued: told after the idle time, not after the steal time.
        let t = Instant::now();
        assert!(matches!(q.take(0, 2, long, 0, Some(Duration::from_millis(20))), Received::Timeout));
        assert!(t.elapsed() >= Duration::from_millis(20) && t.elapsed() < Duration::from_secs(60));
        // A record of another sink's hookpoint, before the steal time: idle all the same.
        q.push(records(&[1]).pop().unwrap());
        assert!(matches!(q.take(0, 2, long, 0, Some(Duration::from_millis(5))), Received::Timeout));
        // Its own record is taken at once; the end of the stream is the end, never idle.
        assert_eq!(take_hp(&q, 1, 2, long), Some((1, 0)));
        q.end();
        assert!(matches!(q.take(0, 2, long, 0, Some(Duration::ZERO)), Received::End));
    }
}
