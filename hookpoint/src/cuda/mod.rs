//! HookPoints on the GPU: graph-capturable capture kernels that copy a device tensor's rows into a
//! [`DeviceRing`](ringscope_ring::cuda::DeviceRing).
//!
//! * [`DeviceCapture::begin_step`] runs once per engine step, **outside** any graph, on the engine's stream: it
//!   writes the step's batch descriptor (request id and position of every row) into a pinned slot and launches a
//!   one-block-per-4-KiB kernel that installs it at a fixed device address. In full mode it first waits, with a
//!   deadline, until the drain has freed room for everything the step can capture.
//! * [`DeviceCapture::capture`] launches one capture kernel on the caller's stream (e.g. PyTorch's current stream).
//!   It may be recorded into a CUDA graph: its arguments are fixed addresses; which rows, whether it samples this
//!   step, and where the record goes are read from device memory when the kernel runs.
//! * [`DeviceCapture::begin_step_graph`] instead records the step itself into the graph (best-effort): its batch is
//!   read from the engine's device tensors at every replay and its number comes from the device, so a replay needs
//!   no host call; [`DeviceCapture::apply_controls`] uploads control changes between replays.
//! * With [`DeviceCaptureOptions::defer`], `capture` only notes the tensor and [`DeviceCapture::end_step`] (or
//!   earlier, on a side stream, [`DeviceCapture::submit`]) copies all of the step's captures with one kernel.
//! * [`DeviceCapture::capture_probe`] (a fused linear probe) first scores the rows with a [`DeviceProbe`] — `K` f32
//!   per row instead of the row — and captures the scores like any tensor; with thresholds it raises per-request
//!   [`DeviceFlags`] an engine can read without a synchronisation.
//!
//! Kernels come from `kernels/capture.cu` and `kernels/probe.cu`, compiled with NVRTC once per process for the
//! device's architecture.
//!
//! # Where each concern lives
//! | module | owns |
//! |---|---|
//! | [`kernels`] | the kernel source and its generated prelude / layout checks, NVRTC, module loading, one typed launch per kernel |
//! | `controls` | the per-hookpoint `DeviceControl` table, row-selection modes, host mirrors, upload |
//! | `counters` | the device counter table and folding it into the hookpoints' counters |
//! | `admission` | full-mode step admission: the step's worst-case bound, waiting for ring space, reservations |
//! | `slots` | the pinned step-descriptor slots and the descriptor layout |
//! | `deferred` | deferred captures: note, flush, submit on a side stream, join |
//! | `probe` | fused linear probes: [`DeviceProbe`] (weights, bias, thresholds, scores buffer), [`DeviceFlags`], their checks |
//! | `device_capture` | [`DeviceCapture`], which checks the engine's calls and composes the above |
//!
//! None of them calls the CUDA driver: everything goes through `ringscope_ring::cuda::driver`.

mod admission;
mod controls;
mod counters;
mod deferred;
mod device_capture;
pub mod kernels;
mod probe;
mod slots;

pub use device_capture::{DeviceCapture, DeviceCaptureError, DeviceCaptureOptions};
pub use kernels::{
    compile_ptx, pattern_word, EndedRows, GraphBatch, KEEP_ALL, KERNEL_SOURCE, MAX_ENDED_TOKENS, PROBE_SOURCE,
};
pub use probe::{DeviceFlags, DeviceProbe, MAX_PROBE_OUTPUTS, MAX_PROBE_WIDTH};
