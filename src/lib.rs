//! # ringscope
//!
//! Ring² observability for LLM serving: HookPoints copy activations into a ring, a drain thread exports them, and
//! a policy decides — under budgets — whether capture may wait (full, lossless) or must drop and count
//! (best-effort). Every record is exported or counted.
//!
//! This facade wires the member crates into a [`Session`] configured from one [`Config`], and re-exports the types
//! a user of a session needs — not the crates (docs/architecture.md says which crate owns what):
//!
//! | crate | role |
//! |---|---|
//! | `ringscope-ring` | record format, ring protocol (host memory; device memory through the CUDA driver layer) |
//! | `ringscope-hookpoint` | hookpoint registry and controls; capture (host, and CUDA kernels) |
//! | `ringscope-exporter` | drain, fan-out to sinks and consumers, the dataset, Parquet / Arrow IPC writing |
//! | `ringscope-policy` | full vs best-effort, loss accounting |
//!
//! ```
//! use ringscope::{Config, Session};
//!
//! let config = Config::from_toml(r#"
//!     [ring]
//!     capacity = "1 MiB"
//!     [[hookpoints]]
//!     name = "layers.0.resid"
//!     site = "residual"
//!     layer = 0
//!     dtype = "f32"
//!     row_width = 4
//! "#)?;
//! let session = Session::new(config)?;
//! // Step 0: two batch rows, both of request 7 (prompt positions 0 and 1).
//! session.begin_step(0, [(7, 0), (7, 1)])?;
//! let hidden: Vec<f32> = vec![0.5; 2 * 4];
//! let bytes: Vec<u8> = hidden.iter().flat_map(|x| x.to_le_bytes()).collect();
//! session.capture_by_name("layers.0.resid", &bytes)?;
//! session.end_step()?;
//! let report = session.shutdown()?;
//! assert_eq!(report.accounting.total().exported.rows, 2);
//! # Ok::<(), ringscope::Error>(())
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod backend;
pub mod config;
mod governor;
pub mod manifest;
pub mod metrics;
mod probes;
mod session;
pub mod stats;
mod step_policy;
#[cfg(feature = "synthetic")]
pub mod synthetic;

pub use config::Config;

/// Stands for "a step begun inside a graph" (numbered on the device) in [`Error::StepOpen`].
pub const GRAPH_STEP: u64 = u64::MAX;

/// `at` as seconds since the Unix epoch (UTC), for messages.
fn unix_seconds(at: std::time::SystemTime) -> String {
    match at.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => format!("{:.3} s since the Unix epoch", d.as_secs_f64()),
        Err(_) => "an unknown time".into(),
    }
}

fn step_name(step: u64) -> String {
    if step == GRAPH_STEP {
        "(begun in a graph)".into()
    } else {
        step.to_string()
    }
}
pub use session::{Report, Session, SessionBuilder, METADATA_ENTRIES_MAX, METADATA_KEY_MAX, METADATA_VALUE_MAX};
pub use stats::{
    rung_label, DestinationKind, DestinationStats, DrainStats, HookPointStats, RingStats, SessionStats, STEP_WINDOW,
};

// What a session's user holds: hookpoints and their controls, the outcome of a capture, the accounting.
pub use ringscope_hookpoint::{CaptureOutcome, Control, HookPoint, RowSelection};
pub use ringscope_policy::{
    AccountingSnapshot, CounterSnapshot, DropReason, Event, EventKind, EventLog, LossPolicy, Mode, Tally,
};
pub use ringscope_ring::record::FORMAT_VERSION;
pub use ringscope_ring::{DType, HookPointSpec, RecordHeader, RecordView, RowMeta, SiteKind};

// What a reader of a run's events table uses (`_ringscope_events/`: what was lost, when and why).
pub use ringscope_exporter::read_events;

// Object storage a run is written to (`export.url`, or `SessionBuilder::storage` with a store set up in code).
pub use ringscope_exporter::{ObjectStorage, StorageError, StorageOptions};

// What a consumer or a sink of their own sees: records, filters, subscriptions, the sink seam and the built-in sinks.
pub use ringscope_exporter::{
    arrow_ipc_sink, parquet_sink, ArrowIpc, BoxError, CallbackSink, CatalogEntry, CommittedFile, DatasetOptions,
    DirectIo, DrainReport, EventsFile, FileSink, Filter, HookPointSummary, Parquet, Receipt, Record, Sink, SinkError,
    SinkFailure, SinkReport, Subscription, Summary, SummarySink,
};

/// Online probes (`[[probes]]` in the config): what a session's probes report, and the pieces to use them on
/// their own (loading weights, scoring rows, calibration retention over a dump).
pub mod probe {
    pub use crate::probes::{scores_hookpoint, ProbeStats};
    pub use ringscope_probe::retention;
    pub use ringscope_probe::{
        load_bias, load_weights, row_to_f32, save_npy, Action, Aggregation, Alert, Coverage, Flags, Monitor, Probe,
        ProbeDef, ProbeError, RequestReport, Scorer, Target, TokenScore, Weights, MAX_OUTPUTS,
    };

    /// Where [`Session::alerts`](crate::Session::alerts) delivers (a crossbeam channel's receiving end).
    pub type AlertReceiver = crossbeam::channel::Receiver<Alert>;
}

/// The CUDA backend's types an engine passes in: streams, device memory, steps recorded inside graphs.
pub mod cuda {
    pub use ringscope_hookpoint::cuda::{EndedRows, GraphBatch, KEEP_ALL, MAX_ENDED_TOKENS};
    pub use ringscope_ring::cuda::{CudaError, DeviceBuffer, DevicePtr, Gpu, Graph, Stream, StreamRef};
}

/// Errors of a session. Each variant keeps the error behind it ([`std::error::Error::source`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid; the message names the key.
    #[error("invalid config: {0}")]
    Config(String),
    /// A configured value could not be used (a ring of that capacity, a file sink in that directory, ...).
    #[error("invalid config: {key}: {source}")]
    Setting {
        /// The configuration key.
        key: &'static str,
        /// Why the value could not be used.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The policy's numbers are invalid.
    #[error(transparent)]
    Policy(#[from] ringscope_policy::PolicyError),
    /// A hookpoint operation failed (unknown hookpoint, bad shape, ring full past the deadline, ...).
    #[error(transparent)]
    HookPoint(#[from] ringscope_hookpoint::HookPointError),
    /// The exporter failed.
    #[error(transparent)]
    Exporter(#[from] ringscope_exporter::ExporterError),
    /// The run manifest could not be written (nothing of it is left behind: no partial or hidden file). The files
    /// already committed stay readable; the run's final accounting is in `report` only.
    #[error(
        "could not write the run manifest {}: {source}; the committed data files are intact, but the run's final \
         accounting is only in this report (free space in the run directory, or check its permissions; on object \
         storage, that the store is reachable and the credentials allow writing)",
        .path.display()
    )]
    Manifest {
        /// The manifest's path.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
        /// The full report (accounting, files, sink errors).
        report: Box<Report>,
    },
    /// Full mode: a sink has failed, so the records it should write would be lost; captures and new steps are
    /// refused from then on instead of losing records silently. (Best-effort mode keeps capturing and counts the
    /// losses as `sink_error`.)
    #[error(
        "{message} (failed at {}); full mode refuses captures once a sink has failed, since its records would be \
         lost: close the session (its report and manifest count what was lost), fix the cause and start a new one, \
         or set policy.mode = \"best_effort\" to keep capturing and count the losses as sink_error",
        unix_seconds(*.at)
    )]
    SinkFailed {
        /// The failed sink's name.
        sink: String,
        /// Its error, naming the sink and the cause.
        message: String,
        /// When it failed.
        at: std::time::SystemTime,
    },
    /// The CUDA driver failed, or a device call was given bad input (the message says which).
    #[error("CUDA backend: {0}")]
    Cuda(#[from] ringscope_ring::cuda::CudaError),
    /// A device capture call failed (CUDA, a rule of the API, or full mode's deadline).
    #[error("CUDA backend: {0}")]
    DeviceCapture(#[from] ringscope_hookpoint::cuda::DeviceCaptureError),
    /// A call of the other backend (a host capture on a CUDA session, or the reverse).
    #[error("{0}")]
    Backend(&'static str),
    /// An argument of a call is out of its range (the message names it).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The session was shut down.
    #[error("the session is shut down; create a new session to capture again")]
    Closed,
    /// A capture or `end_step` came outside a step.
    #[error("no step is open: call begin_step (with the step's batch descriptor) before capturing")]
    NoStep,
    /// `begin_step` while another step is open.
    #[error("step {} is still open: call end_step before begin_step({})", step_name(*open), step_name(*new))]
    StepOpen {
        /// The open step ([`GRAPH_STEP`] for a step begun inside a graph).
        open: u64,
        /// The step asked for ([`GRAPH_STEP`] for a step begun inside a graph).
        new: u64,
    },
    /// Shutdown found records neither exported nor counted.
    #[error("{error}")]
    Unbalanced {
        /// Which hookpoints do not add up.
        error: ringscope_policy::PolicyError,
        /// The full report.
        report: Box<Report>,
    },
}

/// The README's Rust snippets, compiled and run as doc tests so that the front door stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The CUDA backend guide's Rust snippet (docs/cuda-backend.md), compiled as a doc test.
#[doc = include_str!("../docs/cuda-backend.md")]
#[cfg(doctest)]
pub struct CudaBackendDoctests;

/// The probes guide's Rust snippet (docs/probes.md), compiled and run as a doc test.
#[doc = include_str!("../docs/probes.md")]
#[cfg(doctest)]
pub struct ProbesDoctests;
