//! The backend seam: where a session's records are born. [`host::HostBackend`] captures from host memory into a
//! ring in host memory; [`cuda::CudaBackend`] launches capture kernels into a ring in device memory. The session
//! holds one `Box<dyn Backend>` and calls it; it never asks which backend it has. Each backend also hands the drain
//! its ring's consumer end at start ([`Started`]).
//!
//! A call a backend cannot serve (a host capture on a CUDA session, or the reverse) gets the default
//! implementation's [`Error::Backend`], naming the call to use instead.

pub(crate) mod cuda;
pub(crate) mod host;

use std::sync::Arc;
use std::time::Duration;

use ringscope_hookpoint::cuda::GraphBatch;
use ringscope_hookpoint::{CaptureOutcome, HookPoint, Registry, StepBatch};
use ringscope_policy::LossPolicy;
use ringscope_probe::{Flags, Probe};
use ringscope_ring::cuda::{DevicePtr, StreamRef};
use ringscope_ring::RecordSource;

use crate::Error;

const HOST_ONLY: &str = "this session uses the CUDA backend: use begin_step_on(step, rows, stream) and \
                         capture_device(id, device_ptr, rows, stream)";
const CUDA_ONLY: &str = "this session uses the host backend: set ring.backend = \"cuda\" for device captures";

/// A backend and the consumer end of its ring, for the drain.
pub(crate) struct Started {
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) source: Box<dyn RecordSource>,
}

/// Which rows of a step a device source holds (the session's `capture_device` and `capture_device_last_rows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    /// Row `k` is batch row `k` (a tensor over the step's token rows).
    Batch,
    /// Row `k` is the step's `k`-th last row per request (one row per request: a model's last-token outputs).
    LastPerRequest,
}

/// What a session asks of the place records are born. A backend keeps its own open step and checks the order of
/// calls ([`Error::StepOpen`], [`Error::NoStep`]); a call it cannot serve at all is [`Error::Backend`], before any
/// other check.
pub(crate) trait Backend: Send {
    /// Largest record payload the ring accepts, in bytes.
    fn max_record_payload(&self) -> usize;

    /// Host backend: opens a step with this batch.
    fn begin_step(&mut self, _registry: &Registry, _batch: StepBatch) -> Result<(), Error> {
        Err(Error::Backend(HOST_ONLY))
    }

    /// CUDA backend: opens a step on the engine's stream. In full mode an `Err` for the deadline leaves the step
    /// begun (its captures are dropped on the device and counted).
    fn begin_step_on(&mut self, _registry: &Registry, _batch: &StepBatch, _stream: StreamRef) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend: steps whose begin kernel has run on the device (host-begun and graph-begun alike; a load of host
    /// memory). `None` where the host sees every step itself.
    fn steps_begun_on_device(&self) -> Option<u64> {
        None
    }

    /// Full mode: the longest the next step's admission may wait for room (`policy.max_step_overhead` lowers it
    /// below `policy.full_deadline_ms`). Only the CUDA backend admits whole steps; host captures are given their
    /// deadline with each call.
    fn set_step_deadline(&mut self, _deadline: Duration) {}

    /// CUDA backend: opens a step recorded inside a graph.
    fn begin_step_graph(&mut self, _registry: &Registry, _batch: &GraphBatch, _stream: StreamRef) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend, full mode: admits the next replay of a graph that begins its step (`rows`: its batch rows, or
    /// the largest recorded). An `Err` for the deadline leaves the replay's captures dropped and counted.
    fn admit_graph_step(&mut self, _registry: &Registry, _rows: Option<u32>, _stream: StreamRef) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend: uploads control changes on `stream`.
    fn apply_controls(&mut self, _registry: &Registry, _stream: StreamRef) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend with deferred captures: starts copying the open step's captures on a side stream. Nothing to
    /// do elsewhere.
    fn submit_captures(&mut self) -> Result<(), Error> {
        Ok(())
    }

    /// Ends the open step.
    fn end_step(&mut self) -> Result<(), Error>;

    /// CUDA backend, deferred captures: ends the step recorded into a graph, holding its copy as `slot`.
    fn hold_step(&mut self, _slot: u32) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend: launches held copy `slot` after what `stream` has been given.
    fn launch_held(&mut self, _slot: u32, _stream: StreamRef) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend: `stream` waits for the held copies launched so far.
    fn join_held(&mut self, _stream: StreamRef) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// Host backend: captures `data` (batch rows × row bytes) for `hp` in the open step.
    fn capture(&mut self, _policy: &LossPolicy, _hp: &HookPoint, _data: &[u8]) -> Result<CaptureOutcome, Error> {
        Err(Error::Backend(HOST_ONLY))
    }

    /// CUDA backend: launches the capture of `hp` from `rows` rows at device address `ptr` on `stream`, whose rows
    /// are `source`'s.
    fn capture_device(
        &mut self,
        _hp: &HookPoint,
        _ptr: DevicePtr,
        _rows: u32,
        _source: Rows,
        _stream: StreamRef,
    ) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// CUDA backend: where the number of valid rows of hookpoint `id` lives on the device.
    fn set_valid_rows_device(&mut self, _id: u32, _ptr: Option<DevicePtr>) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// Adds counts made outside the registry (on a device) to the hookpoints' counters. Nothing to do elsewhere.
    fn fold_counters(&mut self, _registry: &Registry) {}

    /// The stop-flag table of `slots` slots where the engine can read it (CUDA: pinned memory mapped into the
    /// device); `None`: host memory will do.
    fn probe_flags(&mut self, _slots: usize) -> Result<Option<Arc<Flags>>, Error> {
        Ok(None)
    }

    /// Prepares fused probe `index` (reading `source`, writing its scores as `scores`). Nothing to prepare on the
    /// host backend, which scores on the engine's thread.
    fn add_fused_probe(
        &mut self,
        _index: usize,
        _probe: &Probe,
        _source: &HookPoint,
        _scores: &HookPoint,
        _flags: &Flags,
    ) -> Result<(), Error> {
        Ok(())
    }

    /// CUDA: scores `rows` rows of `source` at `ptr` with fused probe `index` and captures the scores as `scores`
    /// (`rows_of` as `source` for [`capture_device`](Self::capture_device)).
    #[allow(clippy::too_many_arguments)]
    fn capture_fused_device(
        &mut self,
        _index: usize,
        _source: &HookPoint,
        _scores: &HookPoint,
        _ptr: DevicePtr,
        _rows: u32,
        _rows_of: Rows,
        _stream: StreamRef,
    ) -> Result<(), Error> {
        Err(Error::Backend(CUDA_ONLY))
    }

    /// No capture will be issued any more: finish what was issued, count it, and tell the drain to stop once the
    /// ring is empty. Returns the problems found (each a sentence for the report). The session drops the backend
    /// after the drain has finished.
    fn close(&mut self, registry: &Registry) -> Vec<String>;
}
