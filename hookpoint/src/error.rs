//! Errors of the hookpoint crate.

use ringscope_ring::ReserveError;

/// Everything that can go wrong registering, controlling or capturing a hookpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HookPointError {
    /// The spec is not usable.
    #[error(transparent)]
    InvalidSpec(#[from] ringscope_ring::SpecError),
    /// Another hookpoint already has this name.
    #[error("a hookpoint named `{0}` is already registered; hookpoint names must be unique within a session")]
    DuplicateName(String),
    /// More hookpoints than record ids can name.
    #[error("too many hookpoints (ids are 32-bit)")]
    TooMany,
    /// No hookpoint has this id.
    #[error("unknown hookpoint id {0}")]
    UnknownId(u32),
    /// No hookpoint has this name.
    #[error("unknown hookpoint `{name}` (registered: {known})")]
    UnknownName {
        /// The name asked for.
        name: String,
        /// Some registered names, to spot a typo.
        known: String,
    },
    /// A control value is out of range.
    #[error("invalid hookpoint control: {0}")]
    InvalidControl(String),
    /// A step's batch descriptor is not usable.
    #[error("invalid batch for step {step}: {why}")]
    InvalidBatch {
        /// The step.
        step: u64,
        /// What is wrong.
        why: String,
    },
    /// The memory for a step's batch descriptor (sized by its row count) was refused.
    #[error("begin_step({step}): the allocation of {bytes} bytes for {what} was refused; pass fewer rows per step or free memory")]
    BatchAllocation {
        /// The step.
        step: u64,
        /// What was being allocated.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// An explicit row selection could not be copied: the allocation was refused.
    #[error("row selection of `{hookpoint}`: the allocation of {bytes} bytes for {rows} rows was refused; select fewer rows")]
    SelectionAllocation {
        /// Hookpoint name.
        hookpoint: String,
        /// Rows selected.
        rows: usize,
        /// Bytes asked for.
        bytes: usize,
    },
    /// The tensor handed to a capture does not have the hookpoint's shape for this batch.
    #[error(
        "capture of `{hookpoint}` got {got} bytes, expected {expected} ({rows} batch rows × {row_bytes} bytes per row)"
    )]
    DataLength {
        /// Hookpoint name.
        hookpoint: String,
        /// Bytes expected.
        expected: usize,
        /// Bytes given.
        got: usize,
        /// Rows in the step's batch.
        rows: usize,
        /// Bytes per row of the hookpoint.
        row_bytes: u32,
    },
    /// An explicit row selection names a row that is not in the batch.
    #[error("row selection of `{hookpoint}` names batch row {index}, but the batch has {batch_rows} rows")]
    RowIndex {
        /// Hookpoint name.
        hookpoint: String,
        /// Offending index.
        index: u32,
        /// Rows in the batch.
        batch_rows: usize,
    },
    /// The record can never fit in the ring (counted as dropped, reason `too_large`).
    #[error("one record of hookpoint `{hookpoint}` needs {payload_len} bytes but the ring takes at most {max_payload_len} per record (half its capacity); raise ring.capacity or select fewer rows")]
    TooLarge {
        /// Hookpoint name.
        hookpoint: String,
        /// Payload bytes of the record.
        payload_len: usize,
        /// Largest payload the ring accepts.
        max_payload_len: usize,
    },
    /// Full mode: the ring stayed full past the deadline (counted as dropped, reason `deadline`).
    #[error("capture of `{hookpoint}` at step {step} failed: {source}")]
    Deadline {
        /// Hookpoint name.
        hookpoint: String,
        /// Step of the capture.
        step: u64,
        /// The ring's report.
        source: ReserveError,
    },
    /// The drain is gone (counted as dropped, reason `disconnected`).
    #[error("capture of `{hookpoint}` failed: the exporter's drain has stopped, so nothing can be exported")]
    Disconnected {
        /// Hookpoint name.
        hookpoint: String,
    },
}
