//! Per-hookpoint counters on the device: the kernels count every capture (produced, sampled out, published, dropped
//! and why) with atomics in a table of [`COUNTER_WORDS`] `u64`s per hookpoint; the host folds what changed into the
//! hookpoints' own counters, reading the table on a private stream so that the engine's streams are never
//! synchronised.

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
    /// counters. Exact once the engine's work has completed.
    pub(super) fn fold(&mut self, registry: &Registry, n: usize) -> Result<(), CudaError> {
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
                }
            }
            self.folded[i] = now;
        }
        Ok(())
    }
}
