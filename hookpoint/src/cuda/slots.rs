//! Step descriptors: the batch of a step begun on the host (request id and position of every row, the last row of
//! every request), written into one of [`SLOTS`] pinned, device-mapped slots and copied by the begin-step kernel to
//! the descriptor's fixed device home, where the step's captures read it.
//!
//! The host writes a slot only after the GPU has consumed its previous use: the begin-step kernel that read it
//! reports its `begin_index` through the ring's host block (`progress`, published after a system-scope fence once
//! its loads completed). So `begin_step` may run up to [`SLOTS`] steps ahead of the GPU without waiting.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ringscope_ring::cuda::{DeviceBuffer, DeviceRing, Gpu, PinnedBuffer};
use ringscope_ring::record::{align_up, ROW_META_LEN};

use super::DeviceCaptureError;
use crate::batch::StepBatch;

/// Pinned descriptor slots: `begin_step` may run this many steps ahead of the GPU before it waits.
pub(super) const SLOTS: usize = 64;

/// Layout of a step descriptor: a header, then `RowMeta[n_rows]` (16 bytes each), then `u32 last_row[n_last]` (batch
/// row of each request's last token, ascending). `DESC_*` in the kernels.
pub(super) mod desc {
    /// Size of the header.
    pub const HEADER_BYTES: usize = 64;
    /// `u64`: the step.
    pub const STEP: usize = 0;
    /// `u32`: rows in the batch.
    pub const N_ROWS: usize = 8;
    /// `u32`: requests in the batch (entries of `last_row`).
    pub const N_LAST: usize = 12;
    /// `u64`: which `begin_step` wrote it.
    pub const BEGIN_INDEX: usize = 16;
    /// `u32`: flags ([`DEADLINE`]).
    pub const FLAGS: usize = 24;
    /// Flag: the step's captures are dropped and counted as `deadline` (full mode, no room in time).
    pub const DEADLINE: u32 = 1;
    /// Flag: the step keeps some of its rows only (a graph batch's kept rows, [`GraphBatch::kept`]); `last_row` holds
    /// them, and captures of all rows take those.
    ///
    /// [`GraphBatch::kept`]: super::super::kernels::GraphBatch::kept
    pub const KEPT: u32 = 2;
}

/// The pinned slots, the descriptor's device home, and which `begin_step` last used each slot.
pub(super) struct DescriptorSlots {
    slots: PinnedBuffer,
    slot_bytes: usize,
    used_by: [u64; SLOTS],
    /// The descriptor's fixed device home (its address is baked into recorded captures).
    home: DeviceBuffer,
    /// Number of `begin_step`s so far; the next one's index.
    next_index: u64,
}

impl DescriptorSlots {
    /// Slots for batches of up to `max_batch_rows` rows.
    pub(super) fn new(gpu: &Arc<Gpu>, max_batch_rows: u32) -> Result<DescriptorSlots, DeviceCaptureError> {
        let n = max_batch_rows as usize;
        let slot_bytes = align_up(desc::HEADER_BYTES + n * ROW_META_LEN + n * 4 + 16);
        Ok(DescriptorSlots {
            home: DeviceBuffer::zeroed(gpu, slot_bytes)?,
            slots: PinnedBuffer::zeroed(gpu, slot_bytes * SLOTS, true)?,
            slot_bytes,
            used_by: [u64::MAX; SLOTS],
            next_index: 0,
        })
    }

    /// Device address of the descriptor's home.
    pub(super) fn home_addr(&self) -> u64 {
        self.home.ptr().addr()
    }

    /// The index the next `begin_step` takes.
    pub(super) fn next_index(&self) -> u64 {
        self.next_index
    }

    /// Writes `batch`'s descriptor into the next slot, first waiting (rarely) until the GPU has consumed the slot's
    /// previous use. Returns the slot's device address and the descriptor's size (a multiple of 16); call
    /// [`mark_launched`](Self::mark_launched) once the begin-step kernel reading it is launched.
    pub(super) fn write(
        &mut self,
        ring: &DeviceRing,
        batch: &StepBatch,
        flags: u32,
    ) -> Result<(u64, usize), DeviceCaptureError> {
        let slot = (self.next_index % SLOTS as u64) as usize;
        let previous = self.used_by[slot];
        if previous != u64::MAX && ring.progress() <= previous {
            // The host is SLOTS steps ahead of the GPU: wait for it (bounded; the GPU makes progress on its own).
            let until = Instant::now() + Duration::from_secs(60);
            while ring.progress() <= previous {
                if Instant::now() >= until {
                    return Err(DeviceCaptureError::Usage(format!(
                        "the GPU has not run the begin-step kernel of {} steps ago within 60 s: is the stream stuck?",
                        SLOTS
                    )));
                }
                std::thread::yield_now();
            }
        }
        let n = batch.len();
        let last = batch.last_per_request();
        let size = align_up(desc::HEADER_BYTES + n * ROW_META_LEN + last.len() * 4).max(desc::HEADER_BYTES);
        let size = size.div_ceil(16) * 16;
        // SAFETY: the slot is `slot_bytes` ≥ `size` bytes of pinned memory that no kernel reads now (checked above:
        // the begin-step kernel of its previous use has run), and no other slice of it exists.
        let out = unsafe { self.slots.slice_mut(slot * self.slot_bytes, self.slot_bytes) };
        out[desc::STEP..desc::STEP + 8].copy_from_slice(&batch.step().to_le_bytes());
        out[desc::N_ROWS..desc::N_ROWS + 4].copy_from_slice(&(n as u32).to_le_bytes());
        out[desc::N_LAST..desc::N_LAST + 4].copy_from_slice(&(last.len() as u32).to_le_bytes());
        out[desc::BEGIN_INDEX..desc::BEGIN_INDEX + 8].copy_from_slice(&self.next_index.to_le_bytes());
        out[desc::FLAGS..desc::FLAGS + 4].copy_from_slice(&flags.to_le_bytes());
        for (i, m) in batch.rows().iter().enumerate() {
            let o = desc::HEADER_BYTES + i * ROW_META_LEN;
            m.write_to((&mut out[o..o + ROW_META_LEN]).try_into().expect("16 bytes"));
        }
        let base = desc::HEADER_BYTES + n * ROW_META_LEN;
        for (i, m) in last.iter().enumerate() {
            out[base + i * 4..base + i * 4 + 4].copy_from_slice(&m.batch_row.to_le_bytes());
        }
        let src = self.slots.device_ptr().expect("mapped") + (slot * self.slot_bytes) as u64;
        Ok((src, size))
    }

    /// Records that the begin-step kernel reading the slot last written was launched: the slot is in use until the
    /// GPU reports it ran, and the next `begin_step` takes the next index.
    pub(super) fn mark_launched(&mut self) {
        let slot = (self.next_index % SLOTS as u64) as usize;
        self.used_by[slot] = self.next_index;
        self.next_index += 1;
    }
}
