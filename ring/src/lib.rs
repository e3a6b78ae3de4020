//! # ringscope-ring
//!
//! The heart of ringscope: the self-describing [`record`] format and the single-producer byte ring that carries
//! records from the capture side (HookPoints) to the drain side (the exporter).
//!
//! * [`record`] — the 64-byte header, per-row metadata, payload layout; encode/decode with checks that never panic.
//! * [`rowscaled`] — the row-scaled FP8 E4M3 encoding of downcast rows (one `f32` scale per row).
//! * [`spec`] — what a record's hookpoint id stands for (name, site, layer, dtype, row width).
//! * [`host`] — the ring protocol over host memory: reserve → write → publish on the producer,
//!   peek → advance → release on the consumer.
//! * [`cuda`] — the same protocol on device memory: capture kernels publish, a drain copies through pinned memory.
//!   [`cuda::driver`] is the one CUDA driver layer of ringscope (raw calls, errors, RAII owners); the driver is
//!   loaded at run time, and without one opening a device is an error, never a panic.
//! * [`lease`] — record payloads lent to the exporter without a copy; ring space comes back when the lease does.
//! * [`space`] — the ring-space arithmetic (wrap padding, "does it fit") both backends decide with.
//!
//! This crate moves bytes and decides nothing: whether to wait for space or drop a record is the policy's call.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod cuda;
pub mod dtype;
pub mod error;
pub mod host;
pub mod lease;
pub mod record;
pub mod rowscaled;
pub mod space;
pub mod spec;
mod sync;

pub use dtype::DType;
pub use error::{DecodeError, ReserveError, RingError, SourceError, SpecError};
pub use host::{channel, Consumer, HostGauge, Producer, Reservation};
pub use lease::Lease;
pub use record::{RecordHeader, RecordKind, RecordMeta, RecordView, RowMeta};
pub use spec::{HookPointSpec, SiteKind};

/// How full a ring is at one moment, as [`OccupancyGauge::read`] sees it. What `used` and `held` count depends on
/// the backend (each gauge's docs say); both are at most `capacity`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Occupancy {
    /// Bytes of ring memory.
    pub capacity: u64,
    /// Ring bytes published by the producer and not yet given back to it.
    pub used: u64,
    /// Bytes whose records are lent to the exporter (sinks, consumers' queues) and not yet returned.
    pub held: u64,
}

/// Reads a ring's occupancy from any thread while producer and drain run, without touching either end: plain
/// atomic loads, no lock, no device call. For monitoring; nothing decides on it. A gauge keeps the ring's memory
/// allocated while it lives, so its holder drops it once the drain has finished.
pub trait OccupancyGauge: Send + Sync {
    /// The occupancy now (each number a moment's value; the two need not be from the same instant).
    fn read(&self) -> Occupancy;
}

/// The drain end of a ring, whatever its backend: hands out checked records in stream order.
pub trait RecordSource: Send {
    /// The next complete record, without consuming it; `None` when none is available yet.
    fn peek(&mut self) -> Result<Option<RecordView<'_>>, SourceError>;
    /// Moves past the record returned by the last `peek` and gives its space back to the producer.
    fn advance(&mut self);
    /// Moves past the record returned by the last `peek` and lends its payload (no copy): its space goes back to the
    /// producer once the lease, and every older one, is dropped. `None` if no record is pending.
    fn lease(&mut self) -> Option<Lease>;
    /// Ring bytes handed out but not reusable yet because a lease on them, or on a record before them, is still out.
    fn held_bytes(&mut self) -> u64;
    /// Bytes of the memory records are lent from (the ring, or the CUDA backend's staging).
    fn capacity(&self) -> usize;
    /// Bytes published by the producer and not yet handed out as records: when not zero while `peek` finds nothing,
    /// a record is on its way (the CUDA backend's copy to the host) and the drain should look again soon.
    fn arriving_bytes(&mut self) -> u64 {
        0
    }
    /// True when the producer is gone and every record it published has been handed out.
    fn is_finished(&mut self) -> bool;
    /// A gauge of this ring's occupancy that other threads may read while the drain runs.
    fn gauge(&self) -> std::sync::Arc<dyn OccupancyGauge>;
}

impl<S: RecordSource + ?Sized> RecordSource for Box<S> {
    fn peek(&mut self) -> Result<Option<RecordView<'_>>, SourceError> {
        (**self).peek()
    }

    fn advance(&mut self) {
        (**self).advance()
    }

    fn lease(&mut self) -> Option<Lease> {
        (**self).lease()
    }

    fn held_bytes(&mut self) -> u64 {
        (**self).held_bytes()
    }

    fn capacity(&self) -> usize {
        (**self).capacity()
    }

    fn arriving_bytes(&mut self) -> u64 {
        (**self).arriving_bytes()
    }

    fn is_finished(&mut self) -> bool {
        (**self).is_finished()
    }

    fn gauge(&self) -> std::sync::Arc<dyn OccupancyGauge> {
        (**self).gauge()
    }
}

impl RecordSource for Consumer {
    fn peek(&mut self) -> Result<Option<RecordView<'_>>, SourceError> {
        // Space of leases returned since the last look goes back to the producer (a no-op when none came back).
        self.release();
        Ok(Consumer::peek(self)?)
    }

    fn advance(&mut self) {
        Consumer::advance(self);
        self.release();
    }

    fn lease(&mut self) -> Option<Lease> {
        let lease = Consumer::lease(self);
        self.release();
        lease
    }

    fn held_bytes(&mut self) -> u64 {
        self.release();
        Consumer::held_bytes(self)
    }

    fn capacity(&self) -> usize {
        Consumer::capacity(self)
    }

    fn is_finished(&mut self) -> bool {
        Consumer::is_finished(self)
    }

    fn gauge(&self) -> std::sync::Arc<dyn OccupancyGauge> {
        std::sync::Arc::new(Consumer::gauge(self))
    }
}
