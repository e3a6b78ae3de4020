//! # ringscope-ring
//!
//! The heart of ringscope: the self-describing [`record`] format and the single-producer byte ring that carries
//! records from the capture side (HookPoints) to the drain side (the exporter).
//!
//! * [`record`] — the 64-byte header, per-row metadata, payload layout; encode/decode with checks that never panic.
//! * [`host`] — the ring protocol over host memory: reserve → write → publish on the producer,
//!   peek → advance → release on the consumer. The CUDA backend implements the same protocol on device memory.
//!
//! This crate moves bytes and decides nothing: whether to wait for space or drop a record is the policy's call.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod dtype;
pub mod error;
pub mod host;
pub mod record;
mod sync;

pub use dtype::DType;
pub use error::{DecodeError, ReserveError, RingError};
pub use host::{channel, Consumer, Producer, Reservation};
pub use record::{RecordHeader, RecordKind, RecordMeta, RecordView, RowMeta};
