//! The CUDA backend: capture kernels on the engine's stream copy device tensors into a ring in device memory; the
//! drain copies it out through pinned memory.

use std::collections::HashMap;
use std::sync::Arc;

use ringscope_hookpoint::cuda::{
    DeviceCapture, DeviceCaptureError, DeviceCaptureOptions, DeviceFlags, DeviceProbe, GraphBatch,
};
use ringscope_hookpoint::{HookPoint, Registry, StepBatch};
use ringscope_policy::{LossPolicy, Mode};
use ringscope_probe::{Action, Aggregation, Flags, Probe};
use ringscope_ring::cuda::{DeviceConsumer, DevicePtr, DeviceRing, DrainTuning, Gpu, StreamRef};

use super::{Backend, Rows, Started};
use crate::config::RingConfig;
use crate::Error;

/// The capture side of a device ring, and its open step ([`crate::GRAPH_STEP`] for one begun inside a graph).
pub(crate) struct CudaBackend {
    capture: DeviceCapture,
    ring: Arc<DeviceRing>,
    open: Option<u64>,
    /// Fused probes' device tables, by probe index.
    probes: HashMap<usize, DeviceProbe>,
    /// The stop-flag table (pinned, mapped into the device), once probes asked for it.
    flags: Option<Arc<DeviceFlags>>,
    max_batch_rows: u32,
}

impl CudaBackend {
    fn check_no_step(&self, new: u64) -> Result<(), Error> {
        match self.open {
            Some(open) => Err(Error::StepOpen { open, new }),
            None => Ok(()),
        }
    }
}

impl CudaBackend {
    /// Opens the device, allocates a ring of `capacity` bytes and its drain end, and loads the capture kernels.
    pub(crate) fn start(config: &RingConfig, capacity: usize, policy: &LossPolicy) -> Result<Started, Error> {
        let gpu = Gpu::open(config.device)?;
        let ring =
            DeviceRing::new(&gpu, capacity).map_err(|e| Error::Setting { key: "ring.capacity", source: e.into() })?;
        let tuning = DrainTuning {
            chunk_bytes: usize::try_from(config.drain_chunk.0).unwrap_or(usize::MAX),
            max_in_flight: config.drain_in_flight as usize,
        };
        let consumer = DeviceConsumer::new(&ring, tuning)
            .map_err(|e| Error::Setting { key: "ring.drain_chunk / ring.drain_in_flight", source: e.into() })?;
        let options = DeviceCaptureOptions {
            max_batch_rows: config.max_batch_rows,
            max_hookpoints: 1024,
            full_mode_deadline: (policy.mode == Mode::Full).then_some(policy.full_deadline),
            defer: config.defer_captures,
        };
        let capture = DeviceCapture::new(&ring, options)?;
        let backend = CudaBackend {
            capture,
            ring,
            open: None,
            probes: HashMap::new(),
            flags: None,
            max_batch_rows: config.max_batch_rows,
        };
        Ok(Started { backend: Box::new(backend), source: Box::new(consumer) })
    }
}

impl Backend for CudaBackend {
    fn max_record_payload(&self) -> usize {
        self.ring.max_payload_len()
    }

    fn begin_step_on(&mut self, registry: &Registry, batch: &StepBatch, stream: StreamRef) -> Result<(), Error> {
        self.check_no_step(batch.step())?;
        match self.capture.begin_step(registry, batch, stream) {
            Ok(()) => {
                self.open = Some(batch.step());
                Ok(())
            }
            // The step is begun: its captures are dropped on the device and counted as `deadline`.
            Err(e @ DeviceCaptureError::Deadline { .. }) => {
                self.open = Some(batch.step());
                Err(e.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn steps_begun_on_device(&self) -> Option<u64> {
        Some(self.ring.progress() + self.ring.graph_begun())
    }

    fn set_step_deadline(&mut self, deadline: std::time::Duration) {
        self.capture.set_full_mode_deadline(deadline);
    }

    fn begin_step_graph(&mut self, registry: &Registry, batch: &GraphBatch, stream: StreamRef) -> Result<(), Error> {
        self.check_no_step(crate::GRAPH_STEP)?;
        match self.capture.begin_step_graph(registry, batch, stream) {
            // Full mode, eager: the step is begun; its captures are dropped on the device and counted as `deadline`.
            r @ (Ok(()) | Err(DeviceCaptureError::Deadline { .. })) => {
                self.open = Some(crate::GRAPH_STEP);
                Ok(r?)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn admit_graph_step(&mut self, registry: &Registry, rows: Option<u32>, stream: StreamRef) -> Result<(), Error> {
        Ok(self.capture.admit_graph_step(registry, rows, stream)?)
    }

    fn apply_controls(&mut self, registry: &Registry, stream: StreamRef) -> Result<(), Error> {
        Ok(self.capture.apply_controls(registry, stream)?)
    }

    fn submit_captures(&mut self) -> Result<(), Error> {
        self.open.ok_or(Error::NoStep)?;
        Ok(self.capture.submit()?)
    }

    fn end_step(&mut self) -> Result<(), Error> {
        self.open.take().ok_or(Error::NoStep)?;
        Ok(self.capture.end_step()?)
    }

    fn hold_step(&mut self, slot: u32) -> Result<(), Error> {
        if self.open != Some(crate::GRAPH_STEP) {
            self.open.ok_or(Error::NoStep)?;
        }
        self.capture.hold_step(slot)?;
        self.open = None;
        Ok(())
    }

    fn launch_held(&mut self, slot: u32, stream: StreamRef) -> Result<(), Error> {
        if let Some(open) = self.open {
            return Err(Error::InvalidArgument(format!(
                "launch_held while a step is open (step {}): launch a held copy between steps, after the replay",
                crate::step_name(open)
            )));
        }
        Ok(self.capture.launch_held(slot, stream)?)
    }

    fn join_held(&mut self, stream: StreamRef) -> Result<(), Error> {
        Ok(self.capture.join_held(stream)?)
    }

    fn capture_device(
        &mut self,
        hp: &HookPoint,
        ptr: DevicePtr,
        rows: u32,
        source: Rows,
        stream: StreamRef,
    ) -> Result<(), Error> {
        self.open.ok_or(Error::NoStep)?;
        match source {
            Rows::Batch => self.capture.capture(hp, ptr, rows, stream)?,
            Rows::LastPerRequest => self.capture.capture_last_rows(hp, ptr, rows, stream)?,
        }
        Ok(())
    }

    fn set_valid_rows_device(&mut self, id: u32, ptr: Option<DevicePtr>) -> Result<(), Error> {
        Ok(self.capture.set_valid_rows_ptr(id, ptr)?)
    }

    fn probe_flags(&mut self, slots: usize) -> Result<Option<Arc<Flags>>, Error> {
        let slots =
            u32::try_from(slots).map_err(|_| Error::Config(format!("alerts.flag_slots {slots} is too large")))?;
        let table = DeviceFlags::new(self.ring.gpu(), slots)?;
        let words = table.words();
        let (ptr, len) = (words.as_ptr().cast_mut().cast::<u64>(), words.len());
        self.flags = Some(table.clone());
        // SAFETY: `words` are `len` aligned, zero-initialised atomics in pinned memory that `table` owns and keeps
        // mapped while it lives; the `Flags` holds `table` as its owner, and only atomics (and the device) touch them.
        Ok(Some(Arc::new(unsafe { Flags::from_raw(ptr, len, table) })))
    }

    fn add_fused_probe(
        &mut self,
        index: usize,
        probe: &Probe,
        _source: &HookPoint,
        _scores: &HookPoint,
        _flags: &Flags,
    ) -> Result<(), Error> {
        // A per-token probe that stops requests raises their flags in the score kernel itself: the engine can see
        // the flag right after the step, with no host in between. Other aggregations are decided on the host (the
        // consumer raises the same table's flags).
        let on_device = probe.aggregation() == Aggregation::PerToken && probe.action() == Action::Stop;
        let thresholds = on_device.then(|| probe.thresholds());
        let weights = probe.weights();
        let mut table = DeviceProbe::new(
            self.ring.gpu(),
            weights.values(),
            probe.bias(),
            weights.outputs() as u32,
            weights.width() as u32,
            thresholds,
            self.max_batch_rows,
        )?;
        if on_device {
            let flags = self.flags.clone().ok_or(Error::Backend("the flag table is made before fused probes"))?;
            table = table.with_flags(flags)?;
        }
        self.probes.insert(index, table);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn capture_fused_device(
        &mut self,
        index: usize,
        source: &HookPoint,
        scores: &HookPoint,
        ptr: DevicePtr,
        rows: u32,
        rows_of: Rows,
        stream: StreamRef,
    ) -> Result<(), Error> {
        let probe = self.probes.get(&index).ok_or(Error::Backend("a fused probe without its device tables"))?;
        let dtype = source.spec().dtype;
        match rows_of {
            Rows::Batch => self.capture.capture_probe(probe, scores, ptr, dtype, rows, stream)?,
            Rows::LastPerRequest => self.capture.capture_probe_last_rows(probe, scores, ptr, dtype, rows, stream)?,
        }
        Ok(())
    }

    fn fold_counters(&mut self, registry: &Registry) {
        // A failed read leaves the counters folded last time; shutdown reports a failure that persists.
        let _ = self.capture.fold_counters(registry);
    }

    fn close(&mut self, registry: &Registry) -> Vec<String> {
        let mut problems = Vec::new();
        // Deferred captures of a step left open are copied, not forgotten.
        if let Err(e) = self.capture.end_step() {
            problems.push(format!("CUDA backend: copying the open step's deferred captures failed: {e}"));
        }
        // Let every capture already issued run, then count it; the drain stops once it has copied the rest.
        if let Err(e) = self.ring.gpu().synchronize() {
            problems.push(format!("CUDA backend at shutdown: {e}"));
        }
        if let Err(e) = self.capture.fold_counters(registry) {
            problems.push(format!("CUDA backend: reading the device counters failed: {e}"));
        }
        let bits = self.ring.error_bits();
        if bits != 0 {
            problems.push(format!("CUDA backend: {}", ringscope_ring::cuda::errors::describe(bits)));
        }
        self.ring.close_producer();
        problems
    }
}
