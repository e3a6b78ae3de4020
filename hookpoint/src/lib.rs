//! # ringscope-hookpoint
//!
//! HookPoints are where records are born. A [`HookPointSpec`] says what a hookpoint reads (site, layer, dtype,
//! row width); the [`Registry`] gives it an id and runtime [`Control`]s (enable, every-Nth-step sampling, row
//! selection); [`capture_host`] copies the selected rows of a host tensor, with each row's request id and token
//! position from the step's [`StepBatch`], into the ring.
//!
//! [`cuda`] implements the same semantics on the device: graph-capturable capture kernels (`kernels/capture.cu`,
//! compiled with NVRTC at run time) whose controls and batch descriptor are read from device memory at replay time.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

pub mod batch;
pub mod capture;
pub mod cuda;
pub mod error;
pub mod registry;

pub use batch::StepBatch;
pub use capture::{capture_host, CaptureOutcome};
pub use error::HookPointError;
pub use registry::{Control, HookPoint, Registry, RowSelection};
pub use ringscope_ring::{HookPointSpec, SiteKind};
