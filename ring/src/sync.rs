//! The synchronisation primitives the ring protocol uses, swapped for `loom`'s under `cfg(loom)` so that the index
//! protocol is model-checked (`RUSTFLAGS="--cfg loom" cargo test -p ringscope-ring --release --test loom`).
//!
//! The ring's bytes are plain memory reached through a raw pointer, which loom cannot see. [`Shadow`] gives loom one
//! tracked cell per 64-byte slot: the producer "writes" the cells of every slot it fills and the consumer "reads" the
//! cells of every slot it decodes, so loom reports any interleaving in which a byte access is not ordered by the
//! head/tail protocol. Outside loom it compiles to nothing.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

use crate::record::RECORD_ALIGN;

/// Per-slot access tracking for loom; zero-sized otherwise.
pub(crate) struct Shadow {
    #[cfg(loom)]
    cells: Vec<loom::cell::UnsafeCell<()>>,
}

impl Shadow {
    pub(crate) fn new(_capacity: usize) -> Self {
        Shadow {
            #[cfg(loom)]
            cells: (0.._capacity / RECORD_ALIGN).map(|_| loom::cell::UnsafeCell::new(())).collect(),
        }
    }

    /// Marks the slots of `[offset, offset + len)` as written by the producer.
    #[inline(always)]
    pub(crate) fn write(&self, _offset: usize, _len: usize) {
        #[cfg(loom)]
        for slot in _offset / RECORD_ALIGN..(_offset + _len).div_ceil(RECORD_ALIGN) {
            self.cells[slot].with_mut(|_| ());
        }
    }

    /// Marks the slots of `[offset, offset + len)` as read by the consumer.
    #[inline(always)]
    pub(crate) fn read(&self, _offset: usize, _len: usize) {
        #[cfg(loom)]
        for slot in _offset / RECORD_ALIGN..(_offset + _len).div_ceil(RECORD_ALIGN) {
            self.cells[slot].with(|_| ());
        }
    }
}

// Keeps the import used when loom is off.
const _: usize = RECORD_ALIGN;
