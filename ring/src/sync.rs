//! The synchronisation primitives the ring protocol uses, swapped for `loom`'s under `cfg(loom)` so that the index
//! protocol and the full-mode wait/wake path are model-checked
//! (`RUSTFLAGS="--cfg loom" cargo test -p ringscope-ring --release --test loom`).
//!
//! The ring's bytes are plain memory reached through a raw pointer, which loom cannot see. [`Shadow`] gives loom one
//! tracked cell per 64-byte slot: the producer "writes" the cells of every slot it fills and the consumer "reads" the
//! cells of every slot it decodes, so loom reports any interleaving in which a byte access is not ordered by the
//! head/tail protocol. Outside loom it compiles to nothing.
//!
//! Loom has no clock. Under loom, [`now`] stands still and [`WaitQueue::wait_until`] ignores its deadline, so in the
//! model a producer waiting for space is only ever ended by a wake-up (a lost one shows as a deadlock), and a
//! deadline is only reached if it had passed before the model started. Outside loom every item here is the plain
//! std / parking_lot / crossbeam one, or an inlined forward to it.

use std::time::Instant;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

/// Spin-then-yield before sleeping.
#[cfg(not(loom))]
pub(crate) use crossbeam_utils::Backoff;

/// Under loom the waiting producer goes to sleep at once: spinning first only saves a sleep, and every spin would
/// multiply the interleavings loom explores without exercising anything the sleep path does not.
#[cfg(loom)]
pub(crate) struct Backoff;

#[cfg(loom)]
impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff
    }

    pub(crate) fn is_completed(&self) -> bool {
        true
    }

    pub(crate) fn snooze(&self) {}
}

/// The clock deadlines are measured with.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn now() -> Instant {
    Instant::now()
}

/// Under loom the clock stands still at its first reading, so every interleaving sees the same time: a deadline set
/// before the model runs and far enough ahead is never reached.
#[cfg(loom)]
pub(crate) fn now() -> Instant {
    static FROZEN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *FROZEN.get_or_init(Instant::now)
}

/// A lock and a condition variable to sleep on with the lock released: parking_lot's outside loom, loom's under it.
pub(crate) struct WaitQueue {
    #[cfg(not(loom))]
    lock: parking_lot::Mutex<()>,
    #[cfg(not(loom))]
    cond: parking_lot::Condvar,
    #[cfg(loom)]
    lock: loom::sync::Mutex<()>,
    #[cfg(loom)]
    cond: loom::sync::Condvar,
}

#[cfg(not(loom))]
pub(crate) type WaitGuard<'a> = parking_lot::MutexGuard<'a, ()>;
#[cfg(loom)]
pub(crate) type WaitGuard<'a> = loom::sync::MutexGuard<'a, ()>;

impl WaitQueue {
    pub(crate) fn new() -> Self {
        WaitQueue { lock: Default::default(), cond: Default::default() }
    }

    #[inline]
    pub(crate) fn lock(&self) -> WaitGuard<'_> {
        #[cfg(not(loom))]
        return self.lock.lock();
        #[cfg(loom)]
        return self.lock.lock().unwrap();
    }

    /// Releases the lock held by `guard`, sleeps until notified (or, outside loom, until `deadline`; spurious
    /// wake-ups are possible) and takes the lock again.
    #[inline]
    pub(crate) fn wait_until<'a>(&self, guard: WaitGuard<'a>, _deadline: Instant) -> WaitGuard<'a> {
        #[cfg(not(loom))]
        {
            let mut guard = guard;
            self.cond.wait_until(&mut guard, _deadline);
            guard
        }
        #[cfg(loom)]
        self.cond.wait(guard).unwrap()
    }

    /// Wakes every thread sleeping in [`wait_until`](Self::wait_until).
    #[inline]
    pub(crate) fn notify_all(&self) {
        self.cond.notify_all();
    }
}

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
