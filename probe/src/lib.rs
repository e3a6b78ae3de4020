//! Online probes: linear probes scored over the rows a session captures.
//!
//! A [`Probe`] is `K` linear read-outs of one hookpoint's rows, `s_k = w_k · x + b_k`, loaded from a safetensors or
//! `.npy` file and checked against the hookpoint's row width. A [`Monitor`] scores each row it is given (f32
//! accumulation over bf16 / f16 / f32 / fp8-row-scaled rows), aggregates the scores per request ([`Aggregation`]:
//! per token, mean, max, EMA, max of a window mean), raises an [`Alert`] when an aggregated score reaches its
//! threshold (once per request and output: never an alert storm), and keeps each request's **coverage**: the rows
//! the engine ran for it that the probe never saw (sampled out, dropped, a best-effort rung), so that "not
//! observed" is never mistaken for "safe". [`Flags`] is the table an engine reads to stop flagged requests.
//! [`retention`] is ProbeX's calibration retention: does a frozen probe direction still separate two calibration
//! groups in this run as it did in a reference run.
//!
//! The crate knows rows, not rings: the facade feeds it from a subscription (host probes) or from the scores a
//! fused GPU probe wrote into the ring.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

mod flags;
mod load;
mod monitor;
pub mod retention;
mod score;
mod spec;

pub use flags::Flags;
pub use load::{load_bias, load_weights, save_npy, Weights};
pub use monitor::{Alert, Coverage, Monitor, RequestReport, TokenScore};
pub use score::{row_to_f32, Scorer};
pub use spec::{Action, Aggregation, Probe, ProbeDef, Target, MAX_OUTPUTS};

/// What can go wrong with a probe: each message names the probe and what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The probe's definition is invalid (shape, thresholds, aggregation, ...).
    #[error("probe `{probe}`: {message}")]
    Invalid {
        /// The probe's name.
        probe: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A weights or bias file could not be read or parsed.
    #[error("probe `{probe}`: {path}: {message}")]
    File {
        /// The probe's name.
        probe: String,
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// Rows of a dtype a probe cannot score.
    #[error(
        "probe `{probe}`: cannot score rows of dtype {dtype} (probes read f32, f16, bf16 and f8e4m3_rowscaled rows)"
    )]
    DType {
        /// The probe's name.
        probe: String,
        /// The dtype's name.
        dtype: &'static str,
    },
}

impl ProbeError {
    pub(crate) fn invalid(probe: &str, message: impl Into<String>) -> ProbeError {
        ProbeError::Invalid { probe: probe.into(), message: message.into() }
    }
}
