//! # ringscope-exporter
//!
//! Where records leave. Four modules, each using only the ones before it:
//!
//! * [`routing`] — a [`Drain`] thread copies each published record out of the ring (releasing its space at once)
//!   and offers it to every sink and consumer whose [`Filter`] matches, through one bounded queue each. Sinks run on
//!   their own threads; consumers read a [`Subscription`]. A [`Record`] is counted — exported, or dropped with the
//!   reason — when its last holder lets go of it and of its [`Receipt`]. Hookpoint ids resolve through the
//!   [`Catalog`] the session hands over: this crate does not know the capture side.
//! * [`storage`] — object storage (S3 and compatibles, GCS, Azure) through the `object_store` crate: puts, listings,
//!   and multipart [`Upload`]s that make an object only when completed.
//! * [`dataset`] — what a dump is on disk (or in a bucket, with the same layout): Hive-partitioned directories, the
//!   Arrow schema, batches, and the [`FileSink`] that writes, rotates and commits files (a rename, or a completed
//!   upload). It meets routing at the [`Sink`] trait. Next to the data, the [`EventRecorder`] writes the session's
//!   event log (what was lost, when and why) as the run's events table.
//! * [`writing`] — how one file's bytes are laid out and reach the disk or the store: [`Parquet`] (our own zstd
//!   pages) and [`ArrowIpc`], files written with `O_DIRECT` where possible, uploads streamed part by part. It meets
//!   the dataset at the [`FileFormat`] trait.
//!
//! Other sinks: [`SummarySink`] (per-hookpoint tallies) and [`CallbackSink`] (a closure per record).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod dataset;
pub mod routing;
pub mod storage;
#[cfg(test)]
mod testing;
pub mod writing;

pub use dataset::{
    read_events, CommittedFile, CommittedFiles, DatasetOptions, DirectIo, EventRecorder, EventsFile, EventsReport,
    EventsTable, FileError, FileFormat, FileSink, FormatError, OptionsError, RunLock, TableFormat, EVENTS_DIR,
};
pub use routing::{
    BoxError, CallbackSink, Catalog, CatalogEntry, Commits, DestinationKind, DestinationStats, Drain, DrainMonitor,
    DrainOptions, DrainReport, DrainStats, Filter, HookPointSummary, Receipt, Record, Sink, SinkError, SinkFailure,
    SinkHealth, SinkReport, Subscription, Summary, SummarySink,
};
pub use storage::{is_object_url, redact_url, ObjectStorage, StorageError, StorageOptions, Upload};
pub use writing::{
    arrow_ipc_sink, check_ipc_footer, event_recorder, parquet_sink, ArrowIpc, ArrowIpcSink, Codec, Parquet,
    ParquetSink, ParquetTable, ParquetWriter,
};

/// Errors of the drain's life cycle (a sink's errors are [`SinkError`]s, in the [`DrainReport`]).
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
    /// A pool of sinks was given no sink ([`Drain::spawn_pools`]).
    #[error("a sink pool needs at least one sink")]
    EmptyPool,
}
