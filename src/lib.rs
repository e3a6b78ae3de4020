//! # ringscope
//!
//! Ring² observability for LLM serving: HookPoints copy activations into a ring, a drain thread exports them, and
//! a policy decides — under budgets — whether capture may wait (full, lossless) or must drop and count
//! (best-effort). Every record is exported or counted.
//!
//! This facade wires the member crates into a [`Session`] configured from one [`Config`]:
//!
//! | crate | role |
//! |---|---|
//! | [`ring`] | record format and ring protocol (host backend) |
//! | [`hookpoint`] | hookpoint specs, registry, controls, capture |
//! | [`exporter`] | drain thread, sinks, consumers |
//! | [`policy`] | full vs best-effort, loss accounting |
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

pub mod config;
pub mod manifest;
mod session;
pub mod synthetic;

pub use config::Config;

/// Stands for "a step begun inside a graph" (numbered on the device) in [`Error::StepOpen`].
pub const GRAPH_STEP: u64 = u64::MAX;

fn step_name(step: u64) -> String {
    if step == GRAPH_STEP {
        "(begun in a graph)".into()
    } else {
        step.to_string()
    }
}
pub use session::{Report, Session, SessionBuilder};

pub use ringscope_exporter as exporter;
pub use ringscope_hookpoint as hookpoint;
pub use ringscope_policy as policy;
pub use ringscope_ring as ring;

pub use ringscope_hookpoint::{CaptureOutcome, HookPointSpec, RowSelection, SiteKind};
pub use ringscope_policy::{DropReason, Mode};
pub use ringscope_ring::DType;

/// Errors of a session.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid; the message names the key.
    #[error("invalid config: {0}")]
    Config(String),
    /// The policy's numbers are invalid.
    #[error(transparent)]
    Policy(#[from] ringscope_policy::PolicyError),
    /// A hookpoint operation failed (unknown hookpoint, bad shape, ring full past the deadline, ...).
    #[error(transparent)]
    HookPoint(#[from] ringscope_hookpoint::HookPointError),
    /// The exporter failed.
    #[error(transparent)]
    Exporter(#[from] ringscope_exporter::ExporterError),
    /// Writing the run's files failed.
    #[error("{0}")]
    Io(String),
    /// The CUDA backend failed, or a device call was given bad input (the message says which).
    #[error("CUDA backend: {0}")]
    Cuda(String),
    /// A call of the other backend (a host capture on a CUDA session, or the reverse).
    #[error("{0}")]
    Backend(&'static str),
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

impl From<ringscope_ring::cuda::CudaError> for Error {
    fn from(e: ringscope_ring::cuda::CudaError) -> Self {
        Error::Cuda(e.to_string())
    }
}

/// The README's Rust snippets, compiled and run as doc tests so that the front door stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
