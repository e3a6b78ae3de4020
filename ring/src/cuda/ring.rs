//! The ring protocol, CUDA backend: the ring lives in device memory, capture kernels publish into it, and a drain
//! moves it to the host through pinned memory.
//!
//! It uses only the driver layer ([`super::driver`]): no raw handle or driver call appears here.
//!
//! # Who owns what
//!
//! * **Device state block** (device memory, [`state`] offsets): `head` (bytes written by capture kernels) and `seq`
//!   (next sequence number), stored only by capture kernels in stream order; `tail` (bytes the drain has copied
//!   out), stored only by the drain's stream; `tail_snap`, a copy of `tail` refreshed at stream-ordered points (the
//!   begin-step kernel and each publishing capture) so that every block of one capture kernel sees the same value.
//! * **Host block** (pinned memory mapped into the device, [`host`] offsets): `head` (published bytes: written by
//!   the last block of a capture kernel after a system-scope fence), `progress` (begin-step kernels that ran), and
//!   error bits. The host polls it with plain loads: no CUDA call and no device-memory read per step.
//! * The drain copies `[tail, head)` to a pinned (not write-combined) staging buffer with the same layout as the
//!   ring, in chunks on its own stream; after each chunk it writes the new `tail` to the device on that stream
//!   (stream-ordered after the copy), so ring space goes back to the kernels without the host waiting.
//! * Records in staging are lent to the exporter ([`crate::lease`]), not copied: a staging range is copied into
//!   again only once every lease on it and before it has been dropped. Ring space goes back to the kernels as soon
//!   as its bytes are in staging; staging space goes back when the exporter is done with the records.
//!
//! Records never wrap (pad records, as on the host), so a record is contiguous in the ring and in staging.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::driver::{CudaError, DeviceBuffer, Event, Gpu, PinnedBuffer, Stream, StreamRef};
use crate::error::{DecodeError, SourceError};
use crate::host::{CAPACITY_ALIGN, MIN_CAPACITY};
use crate::lease::{Lease, LeaseBook};
use crate::record::{RecordHeader, RecordKind, RecordView, HEADER_LEN};
use crate::RecordSource;

/// Byte offsets in the device state block. The capture kernels get them as `ST_*` from a prelude generated from
/// these constants (`ringscope_hookpoint::cuda::kernels`).
pub mod state {
    /// `u64`: bytes written by capture kernels (published or about to be, within one kernel).
    pub const HEAD: usize = 0;
    /// `u64`: sequence number of the next data record.
    pub const SEQ: usize = 8;
    /// `u64`: bytes copied out by the drain (written by the drain's stream).
    pub const TAIL: usize = 64;
    /// `u64`: the copy of `TAIL` that capture kernels decide on.
    pub const TAIL_SNAP: usize = 128;
    /// `u32`: blocks of the running capture kernel that finished.
    pub const DONE_BLOCKS: usize = 136;
    /// `u32`: blocks of the running begin-step kernel that finished.
    pub const BEGIN_DONE: usize = 140;
    /// `u32`: 1 while a capture kernel runs (set by its block 0, cleared by its publishing block).
    pub const BUSY: usize = 144;
    /// `u64`: the step number a step begun inside a graph takes (one past the last step begun).
    pub const NEXT_STEP: usize = 152;
    /// `u64`: steps begun inside a graph that have started on the device (mirrored to the host block's
    /// [`GRAPH_BEGUN`](super::host::GRAPH_BEGUN)).
    pub const GRAPH_BEGUN: usize = 160;
    /// `u64`: step flags of the next graph-begun steps (the descriptor's flags, e.g. `DEADLINE` when full mode's
    /// admission found no room in time), written on the engine's stream between replays
    /// ([`DeviceRing::set_graph_flags`](super::DeviceRing::set_graph_flags)).
    pub const GRAPH_FLAGS: usize = 168;
    /// Size of the block.
    pub const BYTES: usize = 256;
}

/// Byte offsets in the host (mapped) block. The capture kernels get them as `HS_*` from the generated prelude.
pub mod host {
    /// `u64`: bytes published (every record below it is complete and visible).
    pub const HEAD: usize = 0;
    /// `u64`: number of begin-step kernels that ran (all work issued before them is done).
    pub const PROGRESS: usize = 64;
    /// `u32`: error bits ([`super::errors`]).
    pub const ERRORS: usize = 128;
    /// `u64`: steps begun inside a graph that have started on the device (every capture issued before the latest
    /// of them has run).
    pub const GRAPH_BEGUN: usize = 192;
    /// `u64`: a lower bound of the device's tail snapshot ([`state::TAIL_SNAP`], the drain position the next capture
    /// kernel decides on), mirrored by kernels that refresh it.
    pub const TAIL_SNAP: usize = 200;
    /// Size of the block.
    pub const BYTES: usize = 256;
}

/// Error bits a kernel sets in the host block (`ERR_*` in the kernels' generated prelude).
pub mod errors {
    /// Two capture kernels of one ring ran concurrently (captures were issued on more than one stream).
    pub const CONCURRENT_PRODUCERS: u32 = 1;
    /// Full mode: a capture found the ring full although `begin_step` (or `admit_graph_step`) had reserved space (a
    /// hookpoint was captured more than once in a step, captures ran without a `begin_step`, or a graph-begun step
    /// was replayed without `admit_graph_step`). The record was dropped, counted.
    pub const FULL_MODE_OVERRUN: u32 = 2;

    /// Describes a set of error bits.
    pub fn describe(bits: u32) -> String {
        let mut out = Vec::new();
        if bits & CONCURRENT_PRODUCERS != 0 {
            out.push("capture kernels of one ring ran concurrently: issue every capture of a session on one stream");
        }
        if bits & FULL_MODE_OVERRUN != 0 {
            out.push("full mode: a capture found the ring full despite the step's reservation (capture each hookpoint at most once per step, after begin_step; call admit_graph_step before every replay of a graph that begins its step)");
        }
        out.join("; ")
    }
}

/// Graph step flags [`DeviceRing::set_graph_flags`] can set: `0..GRAPH_FLAG_VALUES`.
pub const GRAPH_FLAG_VALUES: u64 = 8;

/// The addresses a capture kernel needs, fixed for the ring's lifetime (so they can be baked into CUDA graphs).
#[derive(Debug, Clone, Copy)]
pub struct RingAddrs {
    /// Ring bytes (device).
    pub buf: u64,
    /// Ring capacity in bytes.
    pub capacity: u64,
    /// Device state block.
    pub state: u64,
    /// Host block, as a device address.
    pub host: u64,
}

/// A ring in device memory plus its state blocks. Shared by the capture side and the drain.
#[derive(Debug)]
pub struct DeviceRing {
    gpu: Arc<Gpu>,
    capacity: usize,
    buf: DeviceBuffer,
    state: DeviceBuffer,
    host: PinnedBuffer,
    /// The values 0..GRAPH_FLAG_VALUES as `u64`s, never written again: the source of [`set_graph_flags`]'s copy where
    /// the driver has no stream memory operations.
    ///
    /// [`set_graph_flags`]: DeviceRing::set_graph_flags
    flag_values: PinnedBuffer,
    /// Bytes copied out by the drain and handed back to the device (the device's `tail` is at least this).
    released: AtomicU64,
    producer_closed: AtomicBool,
    consumer_alive: AtomicBool,
    space_lock: Mutex<()>,
    space: Condvar,
}

impl DeviceRing {
    /// Allocates a ring of `capacity` bytes on `gpu` (a multiple of 128, at least 256).
    pub fn new(gpu: &Arc<Gpu>, capacity: usize) -> Result<Arc<DeviceRing>, CudaError> {
        if capacity < MIN_CAPACITY || !capacity.is_multiple_of(CAPACITY_ALIGN) {
            return Err(CudaError::Invalid(format!(
                "ring capacity {capacity} bytes is invalid: it must be a multiple of {CAPACITY_ALIGN} and at least \
                 {MIN_CAPACITY} bytes"
            )));
        }
        Ok(Arc::new(DeviceRing {
            gpu: gpu.clone(),
            capacity,
            buf: DeviceBuffer::zeroed(gpu, capacity)?,
            state: DeviceBuffer::zeroed(gpu, state::BYTES)?,
            host: PinnedBuffer::zeroed(gpu, host::BYTES, true)?,
            flag_values: {
                let values = PinnedBuffer::zeroed(gpu, GRAPH_FLAG_VALUES as usize * 8, false)?;
                for v in 0..GRAPH_FLAG_VALUES {
                    values.u64_at(v as usize * 8).store(v, Ordering::Relaxed);
                }
                values
            },
            released: AtomicU64::new(0),
            producer_closed: AtomicBool::new(false),
            consumer_alive: AtomicBool::new(true),
            space_lock: Mutex::new(()),
            space: Condvar::new(),
        }))
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Largest record payload this ring takes (half the capacity minus the header), as on the host backend.
    pub fn max_payload_len(&self) -> usize {
        self.capacity / 2 - HEADER_LEN
    }

    /// Addresses for the kernels.
    pub fn addrs(&self) -> RingAddrs {
        RingAddrs {
            buf: self.buf.ptr().addr(),
            capacity: self.capacity as u64,
            state: self.state.ptr().addr(),
            host: self.host.device_ptr().expect("the host block is mapped"),
        }
    }

    /// Bytes published by capture kernels (a plain load of host memory).
    pub fn published(&self) -> u64 {
        self.host.u64_at(host::HEAD).load(Ordering::Acquire)
    }

    /// Begin-step kernels that ran.
    pub fn progress(&self) -> u64 {
        self.host.u64_at(host::PROGRESS).load(Ordering::Acquire)
    }

    /// Steps begun inside a graph that have started on the device.
    pub fn graph_begun(&self) -> u64 {
        self.host.u64_at(host::GRAPH_BEGUN).load(Ordering::Acquire)
    }

    /// A lower bound of the drain position the next capture kernel decides on (kernels mirror the tail snapshot
    /// they refresh here; later refreshes only raise it).
    pub fn tail_snap(&self) -> u64 {
        self.host.u64_at(host::TAIL_SNAP).load(Ordering::Acquire)
    }

    /// Sets the flags that the graph-begun steps issued on `stream` after this call take (the device state block's
    /// [`state::GRAPH_FLAGS`]), stream-ordered: a stream memory operation where the driver has them, else an
    /// 8-byte copy from a constant pinned word. `flags` is below [`GRAPH_FLAG_VALUES`].
    pub fn set_graph_flags(&self, flags: u64, stream: &StreamRef) -> Result<(), CudaError> {
        if flags >= GRAPH_FLAG_VALUES {
            return Err(CudaError::Invalid(format!("graph step flags {flags:#x} are past {GRAPH_FLAG_VALUES}")));
        }
        if self.state.write_u64_async(state::GRAPH_FLAGS, flags, stream).is_ok() {
            return Ok(());
        }
        // SAFETY: the source word is never written after `new` and lives as long as the ring (and so as long as
        // any copy issued from it can be pending); the destination is the state block's flags word.
        unsafe {
            self.state.copy_from_pinned_async(state::GRAPH_FLAGS, &self.flag_values, flags as usize * 8, 8, stream)
        }
    }

    /// Error bits set by kernels ([`errors`]).
    pub fn error_bits(&self) -> u32 {
        self.host.u32_at(host::ERRORS).load(Ordering::Acquire)
    }

    /// Bytes handed back to the device by the drain.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Acquire)
    }

    /// Waits until the drain has handed back at least `position` bytes, or `deadline`. Returns whether it did, and
    /// fails when the drain is gone.
    pub fn wait_released(&self, position: u64, deadline: Instant) -> Result<bool, CudaError> {
        let mut guard = self.space_lock.lock();
        loop {
            if self.released() >= position {
                return Ok(true);
            }
            if !self.consumer_alive.load(Ordering::Acquire) {
                return Err(CudaError::Invalid("the ring's drain is gone: nothing will free space again".into()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            // The timeout is a backstop; the drain notifies after each completed chunk.
            self.space.wait_until(&mut guard, deadline.min(now + Duration::from_millis(2)));
        }
    }

    /// Tells the drain that no capture will be issued any more (after the engine's work has completed): it stops
    /// once everything published is drained.
    pub fn close_producer(&self) {
        self.producer_closed.store(true, Ordering::Release);
    }

    /// Whether the drain side is still there.
    pub fn consumer_alive(&self) -> bool {
        self.consumer_alive.load(Ordering::Acquire)
    }

    fn set_released(&self, position: u64) {
        self.released.store(position, Ordering::Release);
        let _guard = self.space_lock.lock();
        self.space.notify_all();
    }
}

/// How the drain moves bytes.
#[derive(Debug, Clone, Copy)]
pub struct DrainTuning {
    /// Largest single D2H copy. Smaller chunks let an engine's own copies slip in between (the copy engine serves
    /// streams in turn); larger ones need fewer calls.
    pub chunk_bytes: usize,
    /// Copies in flight at once.
    pub max_in_flight: usize,
}

impl Default for DrainTuning {
    fn default() -> Self {
        DrainTuning { chunk_bytes: 4 << 20, max_in_flight: 8 }
    }
}

struct InFlight {
    /// Ring position the copy (and everything before it) reaches.
    end: u64,
    /// Index into `DeviceConsumer::events`, recorded after the copy and its `tail` write.
    slot: usize,
}

/// What a device drain did so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceDrainStats {
    /// Bytes copied device → host.
    pub bytes_copied: u64,
    /// Whether ring space is handed back with stream memory operations (else with 8-byte copies).
    pub stream_write_value: bool,
    /// D2H copies issued.
    pub copies: u64,
}

/// The drain end of a [`DeviceRing`]: copies published bytes to pinned staging and hands records out in order.
/// Use it from one thread (the exporter's drain thread).
pub struct DeviceConsumer {
    ring: Arc<DeviceRing>,
    tuning: DrainTuning,
    stream: Stream,
    /// Shared with the leases on it, which keep it allocated.
    staging: Arc<PinnedBuffer>,
    /// One 64-byte slot per event: the `tail` value its HtoD copy reads.
    tail_slots: PinnedBuffer,
    events: Vec<Event>,
    free_events: Vec<usize>,
    in_flight: VecDeque<InFlight>,
    submitted: u64,
    completed: u64,
    parsed: u64,
    /// Staging before this position may be copied into again: every lease on it came back.
    reusable: u64,
    book: LeaseBook,
    /// Footprint and payload length of the record returned by the last peek.
    pending: Option<(usize, usize)>,
    expected_seq: u64,
    thread_ready: bool,
    /// Whether `cuStreamWriteValue64` works here (`None`: not tried yet).
    write_value: Option<bool>,
    stats: DeviceDrainStats,
}

impl DeviceConsumer {
    /// Creates the drain end: its own stream, a pinned staging buffer as large as the ring, and events.
    pub fn new(ring: &Arc<DeviceRing>, tuning: DrainTuning) -> Result<DeviceConsumer, CudaError> {
        if tuning.chunk_bytes < 64 || !tuning.chunk_bytes.is_multiple_of(64) || tuning.max_in_flight == 0 {
            return Err(CudaError::Invalid(format!(
                "drain tuning {tuning:?}: chunk_bytes must be a positive multiple of 64, max_in_flight at least 1"
            )));
        }
        let gpu = ring.gpu();
        gpu.bind()?;
        let stream = Stream::new(gpu)?;
        let events = (0..tuning.max_in_flight).map(|_| Event::new(gpu, false)).collect::<Result<Vec<_>, _>>()?;
        let staging = Arc::new(PinnedBuffer::zeroed(gpu, ring.capacity(), false)?);
        Ok(DeviceConsumer {
            ring: ring.clone(),
            tuning,
            stream,
            book: LeaseBook::new(staging.clone()),
            staging,
            tail_slots: PinnedBuffer::zeroed(gpu, 64 * tuning.max_in_flight, false)?,
            free_events: (0..tuning.max_in_flight).rev().collect(),
            events,
            in_flight: VecDeque::new(),
            submitted: 0,
            completed: 0,
            parsed: 0,
            reusable: 0,
            pending: None,
            expected_seq: 0,
            thread_ready: false,
            write_value: None,
            stats: DeviceDrainStats::default(),
        })
    }

    /// The drain's own stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Totals so far.
    pub fn stats(&self) -> DeviceDrainStats {
        DeviceDrainStats { stream_write_value: self.write_value == Some(true), ..self.stats }
    }

    /// Sequence number the next record must carry.
    pub fn expected_seq(&self) -> u64 {
        self.expected_seq
    }

    /// Collects finished copies (handing their ring space back) and issues new ones. Never waits on the device.
    pub fn pump(&mut self) -> Result<(), CudaError> {
        if !self.thread_ready {
            self.ring.gpu().bind()?;
            self.ring.gpu().relax_capture_mode_on_this_thread()?;
            self.thread_ready = true;
        }
        while let Some(f) = self.in_flight.front() {
            if !self.events[f.slot].query()? {
                break;
            }
            self.completed = f.end;
            self.free_events.push(f.slot);
            self.in_flight.pop_front();
            self.ring.set_released(self.completed);
        }
        let cap = self.ring.capacity() as u64;
        let head = self.ring.published();
        self.reusable = self.book.reclaim(self.parsed);
        while self.submitted < head && self.submitted < self.reusable + cap {
            let Some(slot) = self.free_events.pop() else { break };
            let offset = self.submitted % cap;
            let len = (head - self.submitted)
                .min(self.tuning.chunk_bytes as u64)
                .min(cap - offset)
                .min(self.reusable + cap - self.submitted);
            // SAFETY: `[offset, offset + len)` lies in both the ring and the staging buffer (same size); the staging
            // range is neither being read by us nor lent out (it is at or past `reusable + cap - cap`: every lease
            // on it came back, per `reclaim`'s Acquire), nor read until the copy's event has completed (`completed`
            // moves only then), and the ring range is published.
            unsafe {
                self.staging.copy_from_device_async(
                    offset as usize,
                    &self.ring.buf,
                    offset as usize,
                    len as usize,
                    self.stream.stream_ref(),
                )
            }?;
            self.submitted += len;
            // Hand the space back to the device once the copy has run: stream-ordered, no host wait.
            self.write_tail(slot)?;
            self.events[slot].record(self.stream.stream_ref())?;
            self.in_flight.push_back(InFlight { end: self.submitted, slot });
            self.stats.bytes_copied += len;
            self.stats.copies += 1;
        }
        Ok(())
    }

    /// Writes `submitted` to the device `tail` on our stream, after the copies before it. A stream memory operation
    /// when the driver has them (no copy-engine round trip between chunks), else an 8-byte copy from pinned memory.
    fn write_tail(&mut self, slot: usize) -> Result<(), CudaError> {
        let stream = self.stream.stream_ref();
        if self.write_value != Some(false) {
            // The device `tail` word of our ring; the operation is stream-ordered after the copy.
            let r = self.ring.state.write_u64_async(state::TAIL, self.submitted, stream);
            match (r, self.write_value) {
                (Ok(()), _) => {
                    self.write_value = Some(true);
                    return Ok(());
                }
                (Err(_), None) => self.write_value = Some(false),
                (Err(e), _) => return Err(e),
            }
        }
        self.tail_slots.u64_at(slot * 64).store(self.submitted, Ordering::Relaxed);
        // SAFETY: the slot is ours until its event (recorded after this copy) completes: `pump` reuses a slot only
        // once its event has; the destination is the device `tail` word.
        unsafe { self.ring.state.copy_from_pinned_async(state::TAIL, &self.tail_slots, slot * 64, 8, stream) }
    }

    /// Bytes published and not yet handed out as records.
    pub fn backlog(&self) -> u64 {
        self.ring.published() - self.parsed
    }

    /// Returns the next complete record in staging, without consuming it; `None` when none is complete yet.
    pub fn peek_record(&mut self) -> Result<Option<RecordView<'_>>, SourceError> {
        if self.pending.is_none() {
            self.pump().map_err(|e| SourceError::Device(e.to_string()))?;
        }
        let cap = self.ring.capacity() as u64;
        loop {
            let available = self.completed - self.parsed;
            if available < HEADER_LEN as u64 {
                return Ok(None);
            }
            let offset = (self.parsed % cap) as usize;
            let contiguous = (available as usize).min(cap as usize - offset);
            // SAFETY: `[parsed, completed)` has been copied into staging and no copy writes it until `parsed` moves
            // past it (submissions stay below `parsed + cap`); the slice borrows `self`.
            let bytes = unsafe { self.staging.slice(offset, contiguous) };
            let header = RecordHeader::decode(bytes)?;
            let footprint = header.footprint();
            if footprint > contiguous {
                if offset + footprint > cap as usize {
                    return Err(DecodeError::Inconsistent(format!(
                        "record at ring offset {offset} with footprint {footprint} runs past the end of the ring"
                    ))
                    .into());
                }
                return Ok(None); // the rest of the record is still being copied
            }
            if header.kind == RecordKind::Pad {
                self.parsed += footprint as u64;
                continue;
            }
            if header.seq != self.expected_seq {
                return Err(DecodeError::SequenceGap { expected: self.expected_seq, found: header.seq }.into());
            }
            let (view, _) = RecordView::decode(&bytes[..footprint])?;
            self.pending = Some((footprint, view.payload().len()));
            return Ok(Some(view));
        }
    }

    /// Moves past the record returned by the last peek.
    pub fn advance_record(&mut self) {
        if let Some((footprint, _)) = self.pending.take() {
            self.parsed += footprint as u64;
            self.expected_seq += 1;
        }
    }

    /// Moves past the record returned by the last peek and lends its payload where it lies in staging: that staging
    /// range is copied into again only after the lease (and every older one) is dropped. `None` if no record is
    /// pending.
    pub fn lease_record(&mut self) -> Option<Lease> {
        let (footprint, payload_len) = self.pending?;
        let start = self.parsed;
        let offset = (start % self.ring.capacity() as u64) as usize + HEADER_LEN;
        // SAFETY: the record was just decoded from `[parsed, parsed + footprint)` of staging, which has been copied
        // and is not copied into while `parsed` has not moved past it.
        let payload = unsafe { self.staging.slice(offset, payload_len) };
        let ptr = std::ptr::NonNull::from(payload).cast::<u8>();
        // SAFETY: the range is the record's payload in staging; `pump` copies into staging only below
        // `reusable + cap`, and `reusable` (from `reclaim`) stays at or before `start` until this lease comes back.
        // Records are lent in ring order.
        let lease = unsafe { self.book.lend(ptr, payload_len, start, footprint as u64) };
        self.advance_record();
        Some(lease)
    }

    /// Staging bytes handed out as records but not reusable yet because a lease on them, or on a record before
    /// them, is still out.
    pub fn held_bytes(&mut self) -> u64 {
        self.reusable = self.book.reclaim(self.parsed);
        self.parsed - self.reusable
    }

    /// True when the producer is closed and every published byte has been handed out.
    pub fn finished(&self) -> bool {
        self.ring.producer_closed.load(Ordering::Acquire)
            && self.in_flight.is_empty()
            && self.parsed == self.ring.published()
    }
}

impl RecordSource for DeviceConsumer {
    fn peek(&mut self) -> Result<Option<RecordView<'_>>, SourceError> {
        self.peek_record()
    }

    fn advance(&mut self) {
        self.advance_record();
    }

    fn lease(&mut self) -> Option<Lease> {
        self.lease_record()
    }

    fn held_bytes(&mut self) -> u64 {
        DeviceConsumer::held_bytes(self)
    }

    fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    fn arriving_bytes(&mut self) -> u64 {
        self.backlog()
    }

    fn is_finished(&mut self) -> bool {
        if self.pump().is_err() {
            return true;
        }
        self.finished()
    }

    fn gauge(&self) -> Arc<dyn crate::OccupancyGauge> {
        Arc::new(DeviceGauge { ring: self.ring.clone(), lent: self.book.lent_gauge() })
    }
}

/// The occupancy of a device ring, read from any thread with what the host already knows — no device call:
///
/// * `used` — device ring bytes published by capture kernels (the host block's `head`) and not yet handed back
///   by the drain (its copies out of them have not completed). Bytes a capture kernel is writing but has not
///   published yet are not counted.
/// * `held` — bytes of the drain's pinned staging (as large as the ring) whose records are lent to the exporter
///   and not yet returned. Staging is separate memory: the device ring's space goes back as soon as its bytes are
///   copied out, so `held` is not part of `used` here.
///
/// It keeps the ring (device memory and all) allocated while it lives.
struct DeviceGauge {
    ring: Arc<DeviceRing>,
    lent: Arc<AtomicU64>,
}

impl crate::OccupancyGauge for DeviceGauge {
    fn read(&self) -> crate::Occupancy {
        // `released` first: it never passes `published`, which only grows.
        let released = self.ring.released();
        let published = self.ring.published();
        let capacity = self.ring.capacity() as u64;
        let used = published.saturating_sub(released).min(capacity);
        crate::Occupancy { capacity, used, held: self.lent.load(Ordering::Relaxed).min(capacity) }
    }
}

impl Drop for DeviceConsumer {
    fn drop(&mut self) {
        self.ring.consumer_alive.store(false, Ordering::Release);
        {
            let _guard = self.ring.space_lock.lock();
            self.ring.space.notify_all();
        }
        if self.ring.gpu().bind().is_ok() {
            // Copies in flight write into `staging`: wait for them before it may be freed (the fields drop after
            // this; leases still out keep it allocated).
            let _ = self.stream.synchronize();
        }
        // Unpinning a large staging buffer takes seconds (about 0.2 s per GiB): hand it to a thread of its own so
        // that closing a session does not wait for it. The buffer keeps its context alive until it is freed.
    }
}
