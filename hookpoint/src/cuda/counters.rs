//! Per-hookpoint counters on the device: the kernels count every capture (produced, sampled out, published, dropped
//! and why) with atomics in a table of [`COUNTER_WORDS`] `u64`s per hookpoint; the host folds what changed into the
//! hookpoints' own counters, reading the table on a private stream so that the engine's streams are never
//! synchronised. The drops a fold finds go into the session's event log too, with the steps they can have come from
//! ([`StepWindow`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use ringscope_policy::{Count, DropReason, Tally};
use ringscope_ring::cuda::{CudaError, DeviceBuffer, Gpu, PinnedBuffer, Stream};

use crate::registry::Registry;

/// Size of one hookpoint's counter block in device memory, in `u64` words.
pub(super) const COUNTER_WORDS: usize = 16;

/// The first word of each (records, rows) pair the kernels count into (`C_*_REC`, `C_*_ROWS` in the kernels).
pub(super) mod counter {
    pub const PRODUCED: usize = 0;
    pub const SAMPLED: usize = 2;
    pub const PUBLISHED: usize = 4;
    pub const FULL: usize = 6;
    pub const TOO_LARGE: usize = 8;
    pub const DEADLINE: usize = 10;
}

/// The steps whose captures a fold can find counted: from the last step begun on the host before the previous fold
/// (its captures may have run after that fold read the table) to the last one begun since. Steps begun inside a
/// graph are numbered on the device, so after one the host knows no end: the range then ends at `u64::MAX`.
#[derive(Debug, Default)]
pub(super) struct StepWindow {
    from: Option<u64>,
    last: Option<u64>,
    in_graph: bool,
}

impl StepWindow {
    /// A step was begun on the host.
    pub(super) fn begun(&mut self, step: u64) {
        self.from.get_or_insert(step);
        self.last = Some(step);
        self.in_graph = false;
    }

    /// A step was begun inside a graph (replays number theirs on the device, one past the previous step).
    pub(super) fn begun_in_graph(&mut self) {
        self.in_graph = true;
    }

    /// The steps the drops found by a fold now can have come from.
    fn range(&self) -> (u64, u64) {
        let from = self.from.unwrap_or(0);
        (from, if self.in_graph { u64::MAX } else { self.last.unwrap_or(from) })
    }

    /// A fold has read the table.
    fn folded(&mut self) {
        self.from = self.last;
    }
}

/// The device counter table, its pinned copy, and the totals already folded into the registry.
pub(super) struct Counters {
    /// Private stream for the copies (declared first: dropped, after its work, before the buffers it copies).
    stream: Stream,
    table: DeviceBuffer,
    host: PinnedBuffer,
    gpu: Arc<Gpu>,
    folded: Vec<[u64; COUNTER_WORDS]>,
}

impl Counters {
    /// A zeroed table for `max_hookpoints` hookpoints.
    pub(super) fn new(gpu: &Arc<Gpu>, max_hookpoints: u32) -> Result<Counters, CudaError> {
        let bytes = max_hookpoints as usize * COUNTER_WORDS * 8;
        Ok(Counters {
            gpu: gpu.clone(),
            table: DeviceBuffer::zeroed(gpu, bytes)?,
            host: PinnedBuffer::zeroed(gpu, bytes, false)?,
            stream: Stream::new(gpu)?,
            folded: Vec::new(),
        })
    }

    /// Device address of the table.
    pub(super) fn table_addr(&self) -> u64 {
        self.table.ptr().addr()
    }

    /// Reads the counters of the first `n` hookpoints and adds what changed since the last call to their host
    /// counters, logging the drops with the steps of `steps`. Exact once the engine's work has completed.
    pub(super) fn fold(&mut self, registry: &Registry, n: usize, steps: &mut StepWindow) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let bytes = n * COUNTER_WORDS * 8;
        // SAFETY: both buffers hold at least `bytes` (n ≤ max_hookpoints); the pinned copy is read only after the
        // stream synchronisation below.
        unsafe { self.host.copy_from_device_async(0, &self.table, 0, bytes, self.stream.stream_ref()) }?;
        self.stream.synchronize()?;
        self.folded.resize(n, [0; COUNTER_WORDS]);
        let (first_step, last_step) = steps.range();
        for hp in registry.all().iter().take(n) {
            let i = hp.id() as usize;
            let now: [u64; COUNTER_WORDS] =
                std::array::from_fn(|w| self.host.u64_at((i * COUNTER_WORDS + w) * 8).load(Ordering::Relaxed));
            let before = self.folded[i];
            let delta = |w: usize| Tally { records: now[w] - before[w], rows: now[w + 1] - before[w + 1] };
            let c = &hp.counters();
            for (w, count) in [
                (counter::PRODUCED, Count::Produced),
                (counter::SAMPLED, Count::SampledOut),
                (counter::PUBLISHED, Count::Published),
                (counter::FULL, Count::Dropped(DropReason::RingFull)),
                (counter::TOO_LARGE, Count::Dropped(DropReason::TooLarge)),
                (counter::DEADLINE, Count::Dropped(DropReason::Deadline)),
            ] {
                let d = delta(w);
                if d.records > 0 || d.rows > 0 {
                    c.add(count, d);
                    if let Count::Dropped(reason) = count {
                        let name = &hp.spec().name;
                        hp.events().dropped_steps(name, reason, first_step, last_step, d.records, d.rows);
                    }
                }
            }
            self.folded[i] = now;
        }
        steps.folded();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::StepWindow;

    #[test]
    fn a_fold_covers_the_steps_since_the_step_open_at_the_last_fold() {
        let mut w = StepWindow::default();
        w.begun(10);
        w.begun(11);
        w.begun(12);
        assert_eq!(w.range(), (10, 12));
        w.folded();
        // Step 12's captures may run after the fold read the table: the next fold's range starts there.
        assert_eq!(w.range(), (12, 12));
        w.begun(13);
        assert_eq!(w.range(), (12, 13));
        w.folded();
        w.begun_in_graph();
        assert_eq!(w.range(), (13, u64::MAX), "graph replays number their steps on the device");
        w.folded();
        w.begun(40);
        assert_eq!(w.range(), (13, 40));
    }
}
