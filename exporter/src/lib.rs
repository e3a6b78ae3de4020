//! # ringscope-exporter
//!
//! Where records leave. A [`Drain`] thread copies each published record out of the ring (releasing its space at
//! once) and offers it to every sink and consumer whose [`Filter`] matches, through one bounded queue each. Sinks
//! run on their own threads; consumers read a [`Subscription`]. A [`Record`] is counted — exported, or dropped with
//! the reason — when its last holder lets go of it and of its [`Receipt`].
//!
//! Sinks here: [`ParquetSink`] and [`ArrowIpcSink`] (Hive-partitioned datasets, see [`dataset`]),
//! [`SummarySink`] (per-hookpoint tallies) and [`CallbackSink`] (a closure per record).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod constants;
pub mod dataset;
mod drain;
mod fanout;
mod files;
mod formats;
mod output;
mod pages;
mod record;
mod sink;

pub use dataset::DatasetOptions;
pub use drain::{Drain, DrainOptions, DrainReport, SinkReport};
pub use fanout::{Filter, Subscription};
pub use files::{CommittedFile, CommittedFiles, FileFormat, FileSink};
pub use formats::{arrow_ipc_sink, parquet_sink, ArrowIpc, ArrowIpcSink, Parquet, ParquetSink, ParquetWriter};
pub use output::{DirectIo, Output};
pub use record::{Receipt, Record};
pub use sink::{CallbackSink, HookPointSummary, Sink, SinkError, Summary, SummarySink};

/// Errors of the exporter.
#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    /// The drain thread could not be started.
    #[error("could not start the drain thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The drain thread panicked (a bug); its records after the panic are not exported.
    #[error("the drain thread panicked: {0}")]
    Panicked(String),
    /// The drain has stopped: nothing more can be subscribed.
    #[error("the drain has stopped (the session is shut down)")]
    Stopped,
}
