//! The host backend: captures copy rows from host memory into a ring in host memory.

use ringscope_hookpoint::{capture_host, CaptureOutcome, HookPoint, Registry, StepBatch};
use ringscope_policy::LossPolicy;
use ringscope_ring::Producer;

use super::{Backend, Started};
use crate::Error;

/// The producer end of a host ring (`None` once closed) and the open step's batch.
pub(crate) struct HostBackend {
    producer: Option<Producer>,
    max_payload: usize,
    batch: Option<StepBatch>,
}

impl HostBackend {
    /// A ring of `capacity` bytes in host memory.
    pub(crate) fn start(capacity: usize) -> Result<Started, Error> {
        let (producer, consumer) =
            ringscope_ring::channel(capacity).map_err(|e| Error::Setting { key: "ring.capacity", source: e.into() })?;
        let max_payload = producer.max_payload_len();
        let backend = HostBackend { producer: Some(producer), max_payload, batch: None };
        Ok(Started { backend: Box::new(backend), source: Box::new(consumer) })
    }
}

impl Backend for HostBackend {
    fn max_record_payload(&self) -> usize {
        self.max_payload
    }

    fn begin_step(&mut self, _registry: &Registry, batch: StepBatch) -> Result<(), Error> {
        if let Some(open) = &self.batch {
            return Err(Error::StepOpen { open: open.step(), new: batch.step() });
        }
        self.batch = Some(batch);
        Ok(())
    }

    fn end_step(&mut self) -> Result<(), Error> {
        self.batch.take().map(drop).ok_or(Error::NoStep)
    }

    fn capture(&mut self, policy: &LossPolicy, hp: &HookPoint, data: &[u8]) -> Result<CaptureOutcome, Error> {
        let batch = self.batch.as_ref().ok_or(Error::NoStep)?;
        let producer = self.producer.as_mut().ok_or(Error::Closed)?;
        Ok(capture_host(producer, policy, hp, batch, data)?)
    }

    fn close(&mut self, _registry: &Registry) -> Vec<String> {
        // Dropping the producer tells the drain that nothing more will come; it stops once the ring is empty.
        self.producer = None;
        Vec::new()
    }
}
