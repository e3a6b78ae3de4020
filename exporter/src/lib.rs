//! # ringscope-exporter
//!
//! Where records leave. A [`Drain`] thread reads published records from the ring, hands each one to every
//! [`Sink`], counts it as exported (or dropped, with the reason), and releases its ring space in batches so the
//! producer's view of free space trails by at most [`DrainOptions::release_every`] records.
//!
//! Sinks here: [`SummarySink`] (per-hookpoint tallies, used by the main example) and [`CallbackSink`] (a closure per
//! record, for online consumers). File sinks (Parquet, Arrow IPC) build on the same trait.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod drain;
mod sink;

pub use drain::{Drain, DrainOptions, DrainReport};
pub use sink::{CallbackSink, HookPointSummary, Sink, SinkError, Summary, SummarySink};

/// Errors of the exporter.
#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    /// The drain thread could not be started.
    #[error("could not start the drain thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The drain thread panicked (a bug, or a sink that panicked); its records after the panic are not exported.
    #[error("the drain thread panicked: {0}")]
    Panicked(String),
}
