//! The ring protocol, host-memory backend.
//!
//! One producer, one consumer, one byte buffer. Two monotonically increasing byte positions describe it:
//!
//! * `head` — bytes *published* by the producer. Only the producer stores it (Release); the consumer loads it
//!   (Acquire), which makes every byte written before the store visible to the consumer.
//! * `tail` — bytes *released* by the consumer. Only the consumer stores it (Release); the producer loads it
//!   (Acquire) before reusing the space, so the consumer's reads happen before the producer's overwrites.
//!
//! `head - tail` bytes are in flight; the rest is free and belongs to the producer. Each side caches the other's
//! position and reloads it only when the cached value says "empty" or "full" (as rtrb does), so an uncontended
//! record costs one Release store on each side.
//!
//! A record never wraps: when it does not fit between the write position and the end of the buffer, the producer
//! fills the rest with a pad record and writes the record at offset 0, publishing both with one store. Any record
//! whose footprint is at most half the capacity therefore fits once the ring drains, whatever the write position;
//! larger ones are refused up front with [`ReserveError::TooLarge`] instead of waiting forever.
//!
//! The GPU backend implements the same protocol with device-side counters; the record bytes are identical.

use std::cell::UnsafeCell;
use std::time::Instant;

use crossbeam_utils::CachePadded;

use crate::error::{DecodeError, ReserveError, RingError};
use crate::lease::{Lease, LeaseBook};
use crate::record::{
    align_up, flags, write_payload, RecordHeader, RecordKind, RecordMeta, RecordView, RowMeta, HEADER_LEN, RECORD_ALIGN,
};
use crate::space;
use crate::sync::{self, fence, Arc, AtomicBool, AtomicU64, AtomicUsize, Backoff, Ordering, Shadow, WaitQueue};

/// Smallest ring capacity accepted, in bytes.
pub const MIN_CAPACITY: usize = 4 * RECORD_ALIGN;
/// Capacities must be a multiple of this (so that half of the capacity is record-aligned).
pub const CAPACITY_ALIGN: usize = 2 * RECORD_ALIGN;

#[repr(C, align(64))]
struct Slot([u8; RECORD_ALIGN]);

struct Shared {
    /// The ring bytes. Producer and consumer touch disjoint byte ranges, ordered by `head`/`tail` (module docs).
    buf: Box<[UnsafeCell<Slot>]>,
    capacity: usize,
    head: CachePadded<AtomicU64>,
    tail: CachePadded<AtomicU64>,
    producer_alive: AtomicBool,
    consumer_alive: AtomicBool,
    shadow: Shadow,
    space: SpaceSignal,
}

// SAFETY: the only non-Sync field is `buf`. The producer writes only free bytes (`[head, tail + capacity)`) and the
// consumer reads only published bytes (`[tail, head)`); the Release/Acquire pairs on `head` and `tail` order every
// write before the matching read and every read before the matching overwrite.
unsafe impl Sync for Shared {}
// SAFETY: `Shared` owns its buffer; nothing in it is tied to a thread.
unsafe impl Send for Shared {}

impl Shared {
    fn base(&self) -> *mut u8 {
        // `UnsafeCell<Slot>` is `repr(transparent)` over a 64-byte `Slot`: the slice is one contiguous byte buffer.
        UnsafeCell::raw_get(self.buf.as_ptr()).cast::<u8>()
    }

    /// # Safety
    /// `[offset, offset + len)` lies in the buffer and is owned by the caller's side of the protocol for the
    /// lifetime of the returned slice, and no other live slice overlaps it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset + len <= self.capacity);
        self.shadow.write(offset, len);
        // SAFETY: in bounds and exclusively owned, per the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.base().add(offset), len) }
    }

    /// # Safety
    /// `[offset, offset + len)` lies in the buffer and holds published bytes that the producer will not overwrite
    /// while the returned slice lives.
    unsafe fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(offset + len <= self.capacity);
        self.shadow.read(offset, len);
        // SAFETY: in bounds, published and not yet released, per the caller's promise.
        unsafe { std::slice::from_raw_parts(self.base().add(offset), len) }
    }
}

/// Wakes a producer waiting for space (full mode) when the consumer releases some. Costs the consumer one SeqCst
/// fence and load per release when nobody waits.
struct SpaceSignal {
    waiters: AtomicUsize,
    queue: WaitQueue,
}

impl SpaceSignal {
    fn notify(&self) {
        // Dekker-style with `reserve_until`: we store `tail` (in `release`), fence, load `waiters`; the producer
        // increments `waiters`, fences, loads `tail`. The two SeqCst fences forbid both loads missing both stores, so
        // either it sees our new tail, or we see its waiter count and take the lock it holds until it sleeps: the
        // wake-up cannot be lost.
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _guard = self.queue.lock();
            self.queue.notify_all();
        }
    }
}

/// Creates a host-memory ring of `capacity` bytes and returns its two ends.
///
/// `capacity` must be a multiple of [`CAPACITY_ALIGN`] and at least [`MIN_CAPACITY`]. The largest payload it takes
/// is [`Producer::max_payload_len`] (half the capacity, minus the header).
pub fn channel(capacity: usize) -> Result<(Producer, Consumer), RingError> {
    if capacity < MIN_CAPACITY || !capacity.is_multiple_of(CAPACITY_ALIGN) {
        return Err(RingError::InvalidCapacity { capacity, align: CAPACITY_ALIGN, min: MIN_CAPACITY });
    }
    // The capacity comes from configuration: an allocation the machine refuses is an error for the caller to
    // report, never an abort of the engine the library is linked into.
    let slots = capacity / RECORD_ALIGN;
    let mut buf: Vec<UnsafeCell<Slot>> = Vec::new();
    buf.try_reserve_exact(slots).map_err(|source| RingError::AllocationRefused { capacity, source })?;
    buf.extend((0..slots).map(|_| UnsafeCell::new(Slot([0; RECORD_ALIGN]))));
    let buf = buf.into_boxed_slice();
    prefault(&buf);
    let shared = Arc::new(Shared {
        buf,
        capacity,
        head: CachePadded::new(AtomicU64::new(0)),
        tail: CachePadded::new(AtomicU64::new(0)),
        producer_alive: AtomicBool::new(true),
        consumer_alive: AtomicBool::new(true),
        shadow: Shadow::new(capacity),
        space: SpaceSignal { waiters: AtomicUsize::new(0), queue: WaitQueue::new() },
    });
    let producer = Producer { shared: shared.clone(), head: 0, head_offset: 0, cached_tail: 0, next_seq: 0 };
    let book = LeaseBook::new(std::sync::Arc::new(shared.clone()));
    let consumer =
        Consumer { shared, read: 0, read_offset: 0, cached_head: 0, pending: None, expected_seq: 0, book, released: 0 };
    Ok((producer, consumer))
}

/// Touches every page of a fresh ring so that the first laps of capture do not pay page faults on the engine's
/// path (the allocator may hand out untouched zero pages; a 64 MiB ring is 16k faults).
fn prefault(buf: &[UnsafeCell<Slot>]) {
    const PAGE: usize = 4096;
    for slot in buf.iter().step_by(PAGE / RECORD_ALIGN) {
        // SAFETY: the buffer was just allocated and is not shared yet; a volatile write of a zero byte to memory we
        // own keeps the compiler from eliding the touch.
        unsafe { std::ptr::write_volatile(slot.get().cast::<u8>(), 0) };
    }
}

/// The writing end of a ring. There is exactly one; it is `Send` but not `Clone`.
pub struct Producer {
    shared: Arc<Shared>,
    /// Our own published position (the authoritative copy of `shared.head`).
    head: u64,
    /// `head % capacity`, kept alongside so the hot path never divides.
    head_offset: usize,
    cached_tail: u64,
    next_seq: u64,
}

impl Producer {
    /// Ring capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// The largest payload a record may have in this ring.
    pub fn max_payload_len(&self) -> usize {
        self.shared.capacity / 2 - HEADER_LEN
    }

    /// Sequence number the next published record will get (= records published so far).
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Bytes free as of the last time this producer looked at the consumer's position.
    pub fn free_bytes(&mut self) -> usize {
        self.cached_tail = self.shared.tail.load(Ordering::Acquire);
        self.shared.capacity - (self.head - self.cached_tail) as usize
    }

    /// Checks `meta` and whether its record fits now; returns the wrap padding it needs.
    fn check_space(&mut self, meta: &RecordMeta) -> Result<usize, ReserveError> {
        meta.validate().map_err(ReserveError::InvalidRecord)?;
        let payload_len = meta.payload_len();
        if payload_len > self.max_payload_len() {
            return Err(ReserveError::TooLarge { payload_len, max_payload_len: self.max_payload_len() });
        }
        if !self.shared.consumer_alive.load(Ordering::Relaxed) {
            return Err(ReserveError::Disconnected);
        }
        let cap = self.shared.capacity;
        let footprint = align_up(HEADER_LEN + payload_len);
        let offset = self.head_offset;
        let pad = space::wrap_pad(offset as u64, footprint as u64, cap as u64) as usize;
        let needed = pad + footprint;
        if !space::fits(self.head, self.cached_tail, needed as u64, cap as u64) {
            self.cached_tail = self.shared.tail.load(Ordering::Acquire);
            if !space::fits(self.head, self.cached_tail, needed as u64, cap as u64) {
                let free = cap - (self.head - self.cached_tail) as usize;
                return Err(ReserveError::Full { needed, free });
            }
        }
        Ok(pad)
    }

    /// Reserves space for a data record described by `meta`, without waiting.
    ///
    /// Fails with [`ReserveError::Full`] when the drain has not released enough space yet (best-effort callers drop
    /// and count), [`ReserveError::TooLarge`] when the record can never fit, and [`ReserveError::InvalidRecord`] when
    /// `meta` is malformed (zero rows, zero-byte rows, ...).
    pub fn try_reserve(&mut self, meta: RecordMeta) -> Result<Reservation<'_>, ReserveError> {
        let pad = self.check_space(&meta)?;
        Ok(Reservation { producer: self, pad, meta })
    }

    /// Reserves space for a data record, waiting for the drain to release space until `deadline` (full mode).
    ///
    /// Fails like [`try_reserve`](Self::try_reserve), except that a full ring is waited on: with
    /// [`ReserveError::DeadlineExceeded`] when `deadline` passes first, and with [`ReserveError::Disconnected`] as soon
    /// as the consumer is dropped.
    pub fn reserve_until(&mut self, meta: RecordMeta, deadline: Instant) -> Result<Reservation<'_>, ReserveError> {
        let started = sync::now();
        let backoff = Backoff::new();
        let pad = loop {
            match self.check_space(&meta) {
                Err(ReserveError::Full { needed, free }) => {
                    let now = sync::now();
                    if now >= deadline {
                        let waited_ms = now.duration_since(started).as_millis() as u64;
                        return Err(ReserveError::DeadlineExceeded { waited_ms, needed, free });
                    }
                    if !backoff.is_completed() {
                        backoff.snooze();
                        continue;
                    }
                    let signal = &self.shared.space;
                    let mut guard = signal.queue.lock();
                    signal.waiters.fetch_add(1, Ordering::SeqCst);
                    // The mirror of the fence in `SpaceSignal::notify`. C++20's rules already order a SeqCst RMW and
                    // load against that fence, but loom models SeqCst accesses as AcqRel and checks only fences; next
                    // to a sleep, the fence costs nothing.
                    fence(Ordering::SeqCst);
                    let tail = self.shared.tail.load(Ordering::SeqCst);
                    let still_full = !space::fits(self.head, tail, needed as u64, self.shared.capacity as u64);
                    // `Consumer::drop` stores `false` before taking the lock we hold: we see it, or it notifies us.
                    if still_full && self.shared.consumer_alive.load(Ordering::SeqCst) {
                        // The timeout is a backstop only; `SpaceSignal::notify` wakes us when space is released (the
                        // loom model waits without it, so a lost wake-up there fails the model).
                        let wake = deadline.min(now + std::time::Duration::from_millis(10));
                        guard = signal.queue.wait_until(guard, wake);
                    }
                    signal.waiters.fetch_sub(1, Ordering::SeqCst);
                    drop(guard);
                }
                other => break other?,
            }
        };
        Ok(Reservation { producer: self, pad, meta })
    }

    /// Convenience: reserves (without waiting), writes the payload from `row_metas` and contiguous `rows`, publishes.
    /// Returns the record's sequence number.
    pub fn try_push(&mut self, meta: RecordMeta, row_metas: &[RowMeta], rows: &[u8]) -> Result<u64, ReserveError> {
        check_rows(&meta, row_metas, rows)?;
        let mut r = self.try_reserve(meta)?;
        r.write_rows(row_metas, rows);
        Ok(r.publish())
    }
}

fn check_rows(meta: &RecordMeta, row_metas: &[RowMeta], rows: &[u8]) -> Result<(), ReserveError> {
    let expect = meta.rows as usize * meta.row_bytes as usize;
    if row_metas.len() != meta.rows as usize || rows.len() != expect {
        return Err(ReserveError::InvalidRecord(DecodeError::Inconsistent(format!(
            "{} row metadata entries and {} data bytes given for {} rows of {} bytes",
            row_metas.len(),
            rows.len(),
            meta.rows,
            meta.row_bytes
        ))));
    }
    Ok(())
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.shared.producer_alive.store(false, Ordering::Release);
    }
}

/// Space reserved for one record. Write the payload, then [`publish`](Self::publish); dropping it unpublished
/// abandons the space (nothing becomes visible to the consumer, no sequence number is used).
pub struct Reservation<'a> {
    producer: &'a mut Producer,
    pad: usize,
    meta: RecordMeta,
}

impl Reservation<'_> {
    fn record_offset(&self) -> usize {
        // A pad always runs to the end of the buffer, so a padded record starts at offset 0.
        if self.pad > 0 {
            0
        } else {
            self.producer.head_offset
        }
    }

    /// The record's metadata.
    pub fn meta(&self) -> &RecordMeta {
        &self.meta
    }

    /// The payload bytes to fill: `meta.payload_len()` bytes, in the layout of [`crate::record`].
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let offset = self.record_offset() + HEADER_LEN;
        // SAFETY: `check_space` proved `[head, head + pad + footprint)` free, so this range (inside it, and not
        // crossing the end of the buffer since records never wrap) belongs to the producer until `publish`; the
        // `&mut self` borrow makes the slice unique.
        unsafe { self.producer.shared.bytes_mut(offset, self.meta.payload_len()) }
    }

    /// Fills the payload from per-row metadata and `rows × row_bytes` contiguous bytes.
    ///
    /// # Panics
    /// If the lengths do not match the record's metadata (use [`Producer::try_push`] for a checked version).
    pub fn write_rows(&mut self, row_metas: &[RowMeta], rows: &[u8]) {
        let meta = self.meta;
        let rb = meta.row_bytes as usize;
        assert_eq!(rows.len(), meta.rows as usize * rb, "row bytes do not match the record metadata");
        assert_eq!(row_metas.len(), meta.rows as usize, "row metadata count does not match the record metadata");
        write_payload(self.payload_mut(), &meta, row_metas, |i, dst| dst.copy_from_slice(&rows[i * rb..(i + 1) * rb]));
    }

    /// Fills the payload by calling `row(i, dst)` for each row `i` after writing the row metadata.
    pub fn write_rows_with(&mut self, row_metas: &[RowMeta], row: impl FnMut(usize, &mut [u8])) {
        let meta = self.meta;
        assert_eq!(row_metas.len(), meta.rows as usize, "row metadata count does not match the record metadata");
        write_payload(self.payload_mut(), &meta, row_metas, row);
    }

    /// Publishes the record: writes its header (sequence number, checksums) and makes it visible to the consumer.
    /// Returns the sequence number.
    pub fn publish(mut self) -> u64 {
        let head_offset = self.producer.head_offset;
        if self.pad > 0 {
            // SAFETY: `[head, head + pad)` is free (checked at reserve) and runs exactly to the end of the buffer.
            let pad_bytes = unsafe { self.producer.shared.bytes_mut(head_offset, HEADER_LEN) };
            pad_bytes.copy_from_slice(&RecordHeader::pad(self.pad).encode());
        }
        let payload_crc =
            if self.meta.flags & flags::PAYLOAD_CRC != 0 { crc32fast::hash(self.payload_mut()) } else { 0 };
        let seq = self.producer.next_seq;
        let header = RecordHeader {
            kind: RecordKind::Data,
            seq,
            meta: self.meta,
            payload_len: self.meta.payload_len() as u64,
            payload_crc,
        };
        let offset = self.record_offset();
        // SAFETY: the record's header slot lies in the reserved, still unpublished range.
        let header_bytes = unsafe { self.producer.shared.bytes_mut(offset, HEADER_LEN) };
        header_bytes.copy_from_slice(&header.encode());

        let producer = &mut *self.producer;
        producer.head += (self.pad + header.footprint()) as u64;
        producer.head_offset = offset + header.footprint();
        if producer.head_offset == producer.shared.capacity {
            producer.head_offset = 0;
        }
        producer.next_seq += 1;
        // Release: the consumer's Acquire load of `head` sees every byte written above.
        producer.shared.head.store(producer.head, Ordering::Release);
        seq
    }
}

/// The reading end of a ring. There is exactly one; it is `Send` but not `Clone`.
///
/// Reading is split from releasing so a drain can look at several records and hand their space back with one
/// store: [`peek`](Self::peek) the next record, [`advance`](Self::advance) past it (or [`lease`](Self::lease) its
/// payload, which moves past it without copying), and [`release`](Self::release) everything advanced past so far,
/// up to the oldest lease still out.
pub struct Consumer {
    shared: Arc<Shared>,
    /// Read position: everything before it has been advanced past (released or about to be).
    read: u64,
    /// `read % capacity`.
    read_offset: usize,
    cached_head: u64,
    /// Footprint and payload length of the record returned by the last `peek`, not yet advanced past.
    pending: Option<(usize, usize)>,
    expected_seq: u64,
    /// Payloads lent out and not yet seen returned.
    book: LeaseBook,
    /// The tail last stored.
    released: u64,
}

impl Consumer {
    /// Ring capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity
    }

    /// Sequence number the next record must carry (= records read so far).
    pub fn expected_seq(&self) -> u64 {
        self.expected_seq
    }

    /// Returns the next published data record without consuming it, or `None` when nothing is published.
    ///
    /// Pads are skipped. A record that fails to decode, or whose sequence number is not the next one, is an error:
    /// on the host backend it means memory corruption, and the consumer stays at that record.
    pub fn peek(&mut self) -> Result<Option<RecordView<'_>>, DecodeError> {
        let cap = self.shared.capacity;
        loop {
            if self.read == self.cached_head {
                // Acquire: pairs with the producer's Release store in `publish`.
                self.cached_head = self.shared.head.load(Ordering::Acquire);
                if self.read == self.cached_head {
                    return Ok(None);
                }
            }
            let offset = self.read_offset;
            let available = ((self.cached_head - self.read) as usize).min(cap - offset);
            // SAFETY: `[read, cached_head)` is published and not released; the producer will not write it until we
            // store a tail past it, which needs `&mut self` while the returned view borrows `self`.
            let bytes = unsafe { self.shared.bytes(offset, available) };
            let (view, footprint) = RecordView::decode(bytes)?;
            if view.header.kind == RecordKind::Pad {
                // Pads run to the end of the buffer.
                self.read += footprint as u64;
                self.read_offset = 0;
                continue;
            }
            if view.header.seq != self.expected_seq {
                return Err(DecodeError::SequenceGap { expected: self.expected_seq, found: view.header.seq });
            }
            self.pending = Some((footprint, view.payload().len()));
            return Ok(Some(view));
        }
    }

    /// Moves past the record returned by the last [`peek`](Self::peek). Its space is returned to the producer at
    /// the next [`release`](Self::release). Does nothing if no record is pending.
    pub fn advance(&mut self) {
        if let Some((footprint, _)) = self.pending.take() {
            self.read += footprint as u64;
            self.read_offset += footprint;
            if self.read_offset == self.shared.capacity {
                self.read_offset = 0;
            }
            self.expected_seq += 1;
        }
    }

    /// Moves past the record returned by the last [`peek`](Self::peek) and lends its payload instead of copying it:
    /// the producer gets its space back only after the lease is dropped (and every older lease too). `None` if no
    /// record is pending.
    pub fn lease(&mut self) -> Option<Lease> {
        let (footprint, payload_len) = self.pending?;
        let start = self.read;
        let offset = self.read_offset + HEADER_LEN;
        // SAFETY: `base` is the start of the buffer and `offset + payload_len` lies within it (the record was
        // decoded there, and records never wrap).
        let ptr = unsafe { std::ptr::NonNull::new_unchecked(self.shared.base().add(offset)) };
        // SAFETY: the payload is published; we store a tail past `start` only once `reclaim` says the lease came
        // back, so the producer does not write it while the lease lives. `lease` is called in ring order.
        let lease = unsafe { self.book.lend(ptr, payload_len, start, footprint as u64) };
        self.advance();
        Some(lease)
    }

    /// Hands the space of every record advanced past back to the producer, up to the oldest lease still out.
    pub fn release(&mut self) {
        let tail = self.book.reclaim(self.read);
        if tail == self.released {
            return;
        }
        self.released = tail;
        // Release: our reads of those bytes (and, through `reclaim`'s Acquire, every lease holder's) happen before
        // the producer's Acquire load lets it overwrite them.
        self.shared.tail.store(tail, Ordering::Release);
        self.shared.space.notify();
    }

    /// Ring bytes read but not yet reusable because a lease on them, or on a record before them, is still out (as
    /// of the last [`release`](Self::release)).
    pub fn held_bytes(&self) -> u64 {
        self.read - self.released
    }

    /// Reads the next record with `f`, then advances and releases it. `Ok(None)` when nothing is published.
    pub fn pop_with<R>(&mut self, f: impl FnOnce(RecordView<'_>) -> R) -> Result<Option<R>, DecodeError> {
        let out = match self.peek()? {
            Some(view) => f(view),
            None => return Ok(None),
        };
        self.advance();
        self.release();
        Ok(Some(out))
    }

    /// True when the producer is gone and every record it published has been read.
    pub fn is_finished(&mut self) -> bool {
        !self.shared.producer_alive.load(Ordering::Acquire) && {
            self.cached_head = self.shared.head.load(Ordering::Acquire);
            self.read == self.cached_head
        }
    }

    /// Bytes published and not yet released.
    pub fn used_bytes(&self) -> usize {
        (self.shared.head.load(Ordering::Acquire) - self.shared.tail.load(Ordering::Acquire)) as usize
    }

    /// A gauge of this ring's occupancy for other threads ([`HostGauge`]).
    pub fn gauge(&self) -> HostGauge {
        HostGauge { shared: self.shared.clone(), lent: self.book.lent_gauge() }
    }
}

/// The occupancy of a host ring, read from any thread ([`crate::OccupancyGauge`]):
///
/// * `used` — bytes between the consumer's released position and the producer's published one: records not yet
///   read, records read and lent (a lease holds its space and everything after it until it comes back), and pads.
///   This is what the producer cannot write into.
/// * `held` — the footprints of the records lent out and not yet seen returned (part of `used`).
///
/// It keeps the ring's memory allocated while it lives.
pub struct HostGauge {
    shared: Arc<Shared>,
    /// The lease book's count (std atomics: the lease book is outside the loom model).
    lent: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl crate::OccupancyGauge for HostGauge {
    fn read(&self) -> crate::Occupancy {
        // `tail` first: `head` only grows and never falls behind `tail`, so a later `head` is at least this `tail`.
        let tail = self.shared.tail.load(Ordering::Acquire);
        let head = self.shared.head.load(Ordering::Acquire);
        let capacity = self.shared.capacity as u64;
        let used = head.saturating_sub(tail).min(capacity);
        crate::Occupancy { capacity, used, held: self.lent.load(std::sync::atomic::Ordering::Relaxed).min(used) }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.shared.consumer_alive.store(false, Ordering::Release);
        // Under the lock: a producer between its `consumer_alive` check and its sleep holds it, so this notify comes
        // after it sleeps.
        let _guard = self.shared.space.queue.lock();
        self.shared.space.queue.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use std::time::Duration;

    fn meta(rows: u32, row_bytes: u32, step: u64) -> RecordMeta {
        RecordMeta { step, hookpoint: 0, rows, row_bytes, dtype: DType::U8, flags: 0 }
    }

    fn metas(n: u32) -> Vec<RowMeta> {
        (0..n).map(|i| RowMeta { request_id: i as u64, position: i, batch_row: i }).collect()
    }

    #[test]
    fn capacity_is_checked() {
        assert!(matches!(channel(0), Err(RingError::InvalidCapacity { .. })));
        assert!(matches!(channel(1000), Err(RingError::InvalidCapacity { .. })));
        assert!(channel(1024).is_ok());
    }

    #[test]
    fn a_refused_allocation_is_an_error_not_an_abort() {
        // Larger than any address space: the allocator refuses it whatever the overcommit setting (the root crate's
        // `tests/allocation.rs` has the allocator refuse a plausible size, under an address-space limit).
        let capacity = (isize::MAX as usize / CAPACITY_ALIGN) * CAPACITY_ALIGN + CAPACITY_ALIGN;
        let err = channel(capacity).err().expect("a ring larger than the address space cannot be allocated");
        assert!(matches!(err, RingError::AllocationRefused { capacity: c, .. } if c == capacity), "{err}");
        assert!(err.to_string().contains("lower the ring capacity"), "{err}");
    }

    #[test]
    fn too_large_is_an_error_even_when_empty() {
        let (mut p, _c) = channel(1024).unwrap();
        // max payload = 512 - 64 = 448: a 1-row record has 64 bytes of metadata, so 384 data bytes fit.
        assert_eq!(p.max_payload_len(), 448);
        assert!(p.try_push(meta(1, 384, 0), &metas(1), &[7; 384]).is_ok());
        let err = p.try_reserve(meta(1, 385, 0)).err().unwrap();
        assert!(matches!(err, ReserveError::TooLarge { payload_len: 449, max_payload_len: 448 }), "{err}");
        assert!(err.to_string().contains("raise the ring capacity"));
    }

    #[test]
    fn invalid_meta_is_an_error() {
        let (mut p, _c) = channel(1024).unwrap();
        assert!(matches!(p.try_reserve(meta(0, 8, 0)), Err(ReserveError::InvalidRecord(_))));
        assert!(matches!(p.try_reserve(meta(1, 0, 0)), Err(ReserveError::InvalidRecord(_))));
        let bad_len = p.try_push(meta(2, 8, 0), &metas(2), &[0; 15]);
        assert!(matches!(bad_len, Err(ReserveError::InvalidRecord(_))));
    }

    #[test]
    fn full_then_released_then_wraps() {
        let (mut p, mut c) = channel(1024).unwrap();
        // Footprint of a 1-row, 64-byte record: 64 header + 64 meta + 64 data = 192.
        for i in 0..5 {
            p.try_push(meta(1, 64, i), &metas(1), &[i as u8; 64]).unwrap();
        }
        // 64 bytes left before the end: the record needs a 64-byte pad plus its 192 bytes.
        assert!(matches!(p.try_reserve(meta(1, 64, 5)), Err(ReserveError::Full { needed: 256, free: 64 })));
        for i in 0..3 {
            let step = c.pop_with(|r| r.header.meta.step).unwrap().unwrap();
            assert_eq!(step, i);
        }
        // Head at 960: 64 bytes to the end, so the next record pads and wraps to offset 0.
        p.try_push(meta(1, 64, 5), &metas(1), &[5; 64]).unwrap();
        let mut seen = vec![];
        while let Some((step, seq, byte)) = c.pop_with(|r| (r.header.meta.step, r.header.seq, r.row(0)[0])).unwrap() {
            seen.push((step, seq, byte));
        }
        assert_eq!(seen, vec![(3, 3, 3), (4, 4, 4), (5, 5, 5)]);
        assert_eq!(c.used_bytes(), 0);
    }

    /// Leases hold their ring space, on another thread too, until dropped — oldest first — and the producer writes
    /// around them. Run under Miri as well (CI), whose race detector checks the Release/Acquire pairs that order the
    /// holder's reads before the producer's overwrite.
    #[test]
    fn a_leased_record_keeps_its_space_until_dropped_even_on_another_thread() {
        let (mut p, mut c) = channel(1024).unwrap();
        // Footprint of a 1-row, 64-byte record: 64 header + 64 meta + 64 data = 192.
        for i in 0..2 {
            p.try_push(meta(1, 64, i), &metas(1), &[i as u8 + 1; 64]).unwrap();
        }
        fn lease(c: &mut Consumer) -> Lease {
            c.peek().unwrap().unwrap();
            let lease = c.lease().unwrap();
            c.release();
            lease
        }
        let (first, second) = (lease(&mut c), lease(&mut c));
        assert_eq!(c.held_bytes(), 384);
        // The reader on another thread checks the first record's row while the producer fills the rest of the ring.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let reader = std::thread::spawn(move || {
            wait.recv().unwrap();
            let row = &first[64..128]; // after the row metadata, padded to 64 bytes
            assert!(row.iter().all(|&b| b == 1), "the leased row was overwritten");
            drop(first);
        });
        for i in 2..5 {
            p.try_push(meta(1, 64, i), &metas(1), &[0xEE; 64]).unwrap();
        }
        for _ in 2..5 {
            drop(lease(&mut c)); // read and returned at once, but behind the two leases still out
        }
        assert!(matches!(p.try_reserve(meta(1, 64, 5)), Err(ReserveError::Full { .. })), "the leases hold the ring");
        drop(second);
        c.release();
        assert!(matches!(p.try_reserve(meta(1, 64, 5)), Err(ReserveError::Full { .. })), "the oldest lease is out");
        go.send(()).unwrap();
        reader.join().unwrap();
        c.release();
        assert_eq!(c.held_bytes(), 0);
        p.try_push(meta(1, 64, 5), &metas(1), &[5; 64]).unwrap();
        c.peek().unwrap().unwrap();
        assert_eq!(c.lease().unwrap()[64..128], [5; 64]);
    }

    #[test]
    fn the_gauge_sees_published_lent_and_released_bytes_from_another_thread() {
        use crate::OccupancyGauge;
        let (mut p, mut c) = channel(1024).unwrap();
        let gauge = c.gauge();
        let read = move || std::thread::scope(|s| s.spawn(|| gauge.read()).join().unwrap());
        assert_eq!(read(), crate::Occupancy { capacity: 1024, used: 0, held: 0 });
        // Footprint of a 1-row, 64-byte record: 192 bytes.
        for i in 0..2 {
            p.try_push(meta(1, 64, i), &metas(1), &[0; 64]).unwrap();
        }
        assert_eq!(read(), crate::Occupancy { capacity: 1024, used: 384, held: 0 });
        c.peek().unwrap().unwrap();
        let lease = c.lease().unwrap();
        c.release();
        assert_eq!(read(), crate::Occupancy { capacity: 1024, used: 384, held: 192 }, "a lease holds its space");
        c.pop_with(|_| ()).unwrap().unwrap();
        assert_eq!(read().used, 384, "space behind a lease stays used");
        drop(lease);
        c.release();
        assert_eq!(read(), crate::Occupancy { capacity: 1024, used: 0, held: 0 });
    }

    #[test]
    fn abandoned_reservation_publishes_nothing() {
        let (mut p, mut c) = channel(1024).unwrap();
        {
            let mut r = p.try_reserve(meta(1, 8, 0)).unwrap();
            r.payload_mut().fill(0xAB);
        }
        assert!(c.peek().unwrap().is_none());
        assert_eq!(p.try_push(meta(1, 8, 1), &metas(1), &[1; 8]).unwrap(), 0);
        assert_eq!(c.pop_with(|r| r.header.meta.step).unwrap(), Some(1));
    }

    #[test]
    // The wait parks in parking_lot, whose futex call (a variadic `syscall` given `&AtomicI32`) Miri rejects; the
    // wait/wake protocol is model-checked with loom instead (ring/tests/loom.rs).
    #[cfg_attr(miri, ignore = "parking_lot's futex call is rejected by Miri; loom checks this path")]
    fn reserve_until_waits_for_the_drain_and_times_out_without_one() {
        let (mut p, mut c) = channel(1024).unwrap();
        for i in 0..5 {
            p.try_push(meta(1, 64, i), &metas(1), &[0; 64]).unwrap();
        }
        let started = Instant::now();
        let err = p.reserve_until(meta(1, 64, 9), Instant::now() + Duration::from_millis(30)).err().unwrap();
        assert!(matches!(err, ReserveError::DeadlineExceeded { .. }), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(30));

        let drain = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            for _ in 0..5 {
                c.pop_with(|_| ()).unwrap().unwrap();
            }
            c
        });
        let mut r = p.reserve_until(meta(1, 64, 9), Instant::now() + Duration::from_secs(30)).unwrap();
        r.write_rows(&metas(1), &[9; 64]);
        assert_eq!(r.publish(), 5);
        let mut c = drain.join().unwrap();
        assert_eq!(c.pop_with(|r| r.row(0)[0]).unwrap(), Some(9));
    }

    #[test]
    // The wait parks in parking_lot, whose futex call (a variadic `syscall` given `&AtomicI32`) Miri rejects; the
    // wait/wake protocol is model-checked with loom instead (ring/tests/loom.rs).
    #[cfg_attr(miri, ignore = "parking_lot's futex call is rejected by Miri; loom checks this path")]
    fn dropped_consumer_unblocks_a_waiting_producer() {
        let (mut p, c) = channel(1024).unwrap();
        for i in 0..5 {
            p.try_push(meta(1, 64, i), &metas(1), &[0; 64]).unwrap();
        }
        let dropper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(c);
        });
        let err = p.reserve_until(meta(1, 64, 9), Instant::now() + Duration::from_secs(60)).err().unwrap();
        assert_eq!(err, ReserveError::Disconnected);
        dropper.join().unwrap();
    }

    #[test]
    fn finished_after_producer_drop() {
        let (mut p, mut c) = channel(1024).unwrap();
        p.try_push(meta(1, 8, 0), &metas(1), &[1; 8]).unwrap();
        drop(p);
        assert!(!c.is_finished());
        c.pop_with(|_| ()).unwrap().unwrap();
        assert!(c.is_finished());
    }

    #[test]
    fn payload_crc_is_written_and_checked() {
        let (mut p, mut c) = channel(1024).unwrap();
        let m = RecordMeta { flags: flags::PAYLOAD_CRC, ..meta(2, 8, 0) };
        p.try_push(m, &metas(2), &[3; 16]).unwrap();
        let crc = c.pop_with(|r| r.header.payload_crc).unwrap().unwrap();
        assert_ne!(crc, 0);
    }
}
