//! The stop flags an engine reads: one 64-bit slot per `request_id % slots`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A table of stop flags. A raised request `R` has `slot[R % slots] == R + 1` (wrapping; 0 is an empty slot), so an
/// engine checks its request without asking ringscope: on the host through [`Flags::is_raised`] or the slots'
/// address, on a GPU (CUDA sessions keep the table in pinned memory mapped into the device) with one load in its own
/// kernel, no host synchronisation. Two raised requests that share a slot keep only the later one in the table (the
/// alerts still name both): size the table above the engine's live requests, or use batch-slot indices as request
/// ids. Request `u64::MAX` cannot be flagged (its alerts still fire).
pub struct Flags {
    slots: Store,
}

enum Store {
    Owned(Box<[AtomicU64]>),
    /// Memory owned by `_owner` (pinned host memory mapped into a device).
    Borrowed {
        ptr: *const AtomicU64,
        len: usize,
        _owner: Arc<dyn Send + Sync>,
    },
}

// SAFETY: the borrowed slots are atomics in memory `_owner` keeps alive (see `from_raw`'s contract); atomics are
// shared between threads by design.
unsafe impl Send for Flags {}
// SAFETY: as above.
unsafe impl Sync for Flags {}

impl std::fmt::Debug for Flags {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flags").field("slots", &self.slots().len()).finish()
    }
}

impl Flags {
    /// A table of `slots` (≥ 1) empty flags in host memory.
    pub fn new(slots: usize) -> Flags {
        Flags { slots: Store::Owned((0..slots.max(1)).map(|_| AtomicU64::new(0)).collect()) }
    }

    /// A table over `len` (≥ 1) slots at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr` must point to `len` 8-byte-aligned, initialised `u64`s that stay valid while `owner` lives and that
    /// nothing but atomic operations (or a device's loads and stores) touch.
    pub unsafe fn from_raw(ptr: *mut u64, len: usize, owner: Arc<dyn Send + Sync>) -> Flags {
        assert!(len > 0 && !ptr.is_null(), "a flag table needs at least one slot");
        Flags { slots: Store::Borrowed { ptr: ptr.cast(), len, _owner: owner } }
    }

    fn slots(&self) -> &[AtomicU64] {
        match &self.slots {
            Store::Owned(s) => s,
            // SAFETY: `from_raw`'s contract: `len` valid atomics that live as long as `_owner`, which `self` holds.
            Store::Borrowed { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }

    /// Slots in the table.
    pub fn len(&self) -> usize {
        self.slots().len()
    }

    /// Never: a table has at least one slot.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The slot of `request`.
    pub fn slot(&self, request: u64) -> usize {
        (request % self.len() as u64) as usize
    }

    /// Raises `request`'s flag.
    pub fn raise(&self, request: u64) {
        self.slots()[self.slot(request)].store(request.wrapping_add(1), Ordering::Release);
    }

    /// Whether `request`'s flag is raised.
    pub fn is_raised(&self, request: u64) -> bool {
        let v = self.slots()[self.slot(request)].load(Ordering::Acquire);
        v != 0 && v == request.wrapping_add(1)
    }

    /// Lowers `request`'s flag (when it is the one in its slot), e.g. when the request has ended.
    pub fn clear(&self, request: u64) {
        let _ = self.slots()[self.slot(request)].compare_exchange(
            request.wrapping_add(1),
            0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// The slots' host address (`len()` little-endian u64s), for an engine that reads them itself.
    pub fn as_ptr(&self) -> *const u64 {
        self.slots().as_ptr().cast()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raised_request_reads_raised_until_cleared_and_neighbours_do_not() {
        let f = Flags::new(8);
        f.raise(3);
        assert!(f.is_raised(3));
        assert!(!f.is_raised(11), "same slot, another request");
        assert!(!f.is_raised(4));
        f.clear(11);
        assert!(f.is_raised(3), "clearing another request leaves the slot");
        f.clear(3);
        assert!(!f.is_raised(3));
        // u64::MAX + 1 wraps to the empty slot: that one request id cannot be flagged (its alerts still fire).
        f.raise(u64::MAX);
        assert!(!f.is_raised(u64::MAX));
        assert!(!Flags::new(4).is_raised(u64::MAX), "an empty slot is not request u64::MAX");
    }
}
