//! Leases: a record's bytes handed out by a ring's drain end without copying them.
//!
//! The drain end of a ring (the host ring itself, or the CUDA backend's pinned staging) lends each record's payload
//! to whoever takes it, as a [`Lease`]. The space under a lease is reused — released to the producer (host) or
//! overwritten by the next device-to-host copy (CUDA) — only once the lease is dropped. Leases may come back in any
//! order; space comes back in ring order, up to the oldest lease still out ([`LeaseBook::reclaim`]).
//!
//! Holding a lease therefore holds every byte of the ring after it: a holder that keeps records for long must copy
//! them (the exporter moves records waiting in slow destinations' queues out of the ring when more than half of it
//! is lent out).

use std::any::Any;
use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A record's payload, lent by the ring. Dereferences to the bytes; dropping it gives the space back.
pub struct Lease {
    ptr: NonNull<u8>,
    len: usize,
    ticket: Arc<Ticket>,
}

// SAFETY: the bytes under a lease are not written by anyone while it lives (the drain end reuses them only after
// `Ticket::returned` is set by `Drop`), and `Ticket::memory` keeps the allocation alive; so the lease is a shared,
// immutable byte slice that any thread may read or drop.
unsafe impl Send for Lease {}
// SAFETY: as above: only `&[u8]` is handed out.
unsafe impl Sync for Lease {}

impl Lease {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` was a live, published, immutable range when the lease was made (`LeaseBook::lend`'s
        // contract) and stays so until the lease is dropped; `ticket.memory` keeps it allocated.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Ring position of the record this lease belongs to.
    pub fn position(&self) -> u64 {
        self.ticket.start
    }
}

impl std::ops::Deref for Lease {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("position", &self.ticket.start).field("len", &self.len).finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Release: every read of the bytes through this lease happens before the drain end's Acquire load of the flag
        // lets it reuse them.
        self.ticket.returned.store(true, Ordering::Release);
    }
}

struct Ticket {
    /// Ring position of the record (its header): everything before the oldest outstanding ticket is free.
    start: u64,
    /// Footprint of the record in the ring.
    footprint: u64,
    returned: AtomicBool,
    /// Keeps the lent memory allocated while any lease on it lives (even after the drain end is gone).
    _memory: Arc<Memory>,
}

/// The memory a book lends from, freed on a thread of its own once the book and every lease are gone. Whoever drops
/// the last reference would otherwise free it on their own path: when a session closes, the last record a sink or
/// a file's I/O thread lets go of — and unpinning the CUDA backend's staging takes 0.1–0.2 s per GiB, which the
/// close then waits for (1.8 s for a 16 GiB ring, measured on an H200 host).
struct Memory(Option<Arc<dyn Any + Send + Sync>>);

impl Drop for Memory {
    fn drop(&mut self) {
        let Some(memory) = self.0.take() else { return };
        // A loom model's objects (the host ring's `loom` Arc) cannot be touched outside the model's own threads: there
        // it is freed here (when to free is a matter of latency, not of the protocol the model checks).
        #[cfg(loom)]
        drop(memory);
        // If no thread can be started, it is freed here.
        #[cfg(not(loom))]
        let _ = std::thread::Builder::new().name("ringscope-free".into()).spawn(move || drop(memory));
    }
}

/// The drain end's record of what it lent: one ticket per lease, in ring order.
pub struct LeaseBook {
    memory: Arc<Memory>,
    outstanding: VecDeque<Arc<Ticket>>,
    /// Footprints of the outstanding tickets, summed.
    lent: u64,
    /// A copy of `lent` that other threads may read (monitoring: [`crate::OccupancyGauge`]); only this book stores it.
    lent_shared: Arc<AtomicU64>,
}

impl LeaseBook {
    /// A book for leases on memory kept alive by `memory`. Once the book and all its leases are gone, `memory` is
    /// dropped on a thread of its own, not on the thread that let go of it last (unpinning a large staging buffer
    /// takes seconds).
    pub fn new(memory: Arc<dyn Any + Send + Sync>) -> LeaseBook {
        LeaseBook {
            memory: Arc::new(Memory(Some(memory))),
            outstanding: VecDeque::new(),
            lent: 0,
            lent_shared: Arc::default(),
        }
    }

    /// Lends `len` bytes at `ptr`: the payload of the record at ring position `start` whose footprint is `footprint`.
    ///
    /// # Safety
    /// `ptr..ptr + len` lies in the memory this book was made for, holds the record's published bytes, and the caller
    /// (the drain end) does not write or reuse that range until [`reclaim`](Self::reclaim) has returned a position
    /// past `start`. Records are lent in ring order (`start` increases).
    pub unsafe fn lend(&mut self, ptr: NonNull<u8>, len: usize, start: u64, footprint: u64) -> Lease {
        debug_assert!(self.outstanding.back().is_none_or(|t| t.start + t.footprint <= start));
        let ticket =
            Arc::new(Ticket { start, footprint, returned: AtomicBool::new(false), _memory: self.memory.clone() });
        self.outstanding.push_back(ticket.clone());
        self.lent += footprint;
        self.lent_shared.store(self.lent, Ordering::Relaxed);
        Lease { ptr, len, ticket }
    }

    /// Forgets tickets whose leases came back, oldest first, and returns the position up to which the ring's space
    /// may be reused: the start of the oldest lease still out, or `read` (everything handed out so far) if none is.
    pub fn reclaim(&mut self, read: u64) -> u64 {
        let lent = self.lent;
        let mut upto = read;
        while let Some(t) = self.outstanding.front() {
            // Acquire: pairs with the Release in `Lease::drop` (the holder's reads happen before our reuse).
            if !t.returned.load(Ordering::Acquire) {
                upto = t.start;
                break;
            }
            self.lent -= t.footprint;
            self.outstanding.pop_front();
        }
        if self.lent != lent {
            self.lent_shared.store(self.lent, Ordering::Relaxed);
        }
        upto
    }

    /// Ring bytes (footprints) of the leases not seen returned by the last [`reclaim`](Self::reclaim).
    pub fn lent_bytes(&self) -> u64 {
        self.lent
    }

    /// [`lent_bytes`](Self::lent_bytes), readable from any thread (kept current by this book; a reader sees a value
    /// at most one `lend` or `reclaim` old).
    pub fn lent_gauge(&self) -> Arc<AtomicU64> {
        self.lent_shared.clone()
    }

    /// Leases not seen returned by the last `reclaim`.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(bytes: &Arc<Vec<u8>>) -> LeaseBook {
        LeaseBook::new(bytes.clone() as Arc<dyn Any + Send + Sync>)
    }

    fn lend(book: &mut LeaseBook, bytes: &Arc<Vec<u8>>, start: u64, len: usize) -> Lease {
        let ptr = NonNull::new(bytes[start as usize..].as_ptr().cast_mut()).unwrap();
        // SAFETY: in bounds of `bytes`, which nobody writes.
        unsafe { book.lend(ptr, len, start, len as u64) }
    }

    #[test]
    fn space_comes_back_in_ring_order_up_to_the_oldest_lease_out() {
        let bytes = Arc::new((0..=255u8).collect::<Vec<_>>());
        let mut b = book(&bytes);
        let l0 = lend(&mut b, &bytes, 0, 64);
        let l1 = lend(&mut b, &bytes, 64, 64);
        let l2 = lend(&mut b, &bytes, 128, 64);
        assert_eq!((l1.bytes()[0], l2.len()), (64, 64));
        assert_eq!((b.reclaim(192), b.lent_bytes()), (0, 192));
        drop(l1);
        assert_eq!(b.reclaim(192), 0, "a later lease returned first frees nothing");
        drop(l0);
        assert_eq!((b.reclaim(192), b.lent_bytes(), b.outstanding()), (128, 64, 1));
        drop(l2);
        assert_eq!((b.reclaim(192), b.lent_bytes()), (192, 0));
        assert_eq!(b.reclaim(256), 256);
        let gauge = b.lent_gauge();
        let l3 = lend(&mut b, &bytes, 0, 128);
        assert_eq!(gauge.load(Ordering::Relaxed), 128, "the gauge follows a lend");
        drop(l3);
        b.reclaim(128);
        assert_eq!(gauge.load(Ordering::Relaxed), 0, "and a reclaim");
    }

    #[test]
    fn a_lease_keeps_its_memory_alive_after_the_book_is_gone() {
        let bytes = Arc::new(vec![7u8; 128]);
        let mut b = book(&bytes);
        let lease = lend(&mut b, &bytes, 64, 32);
        drop((b, bytes));
        let reader = std::thread::spawn(move || lease.iter().map(|&x| x as u32).sum::<u32>());
        assert_eq!(reader.join().unwrap(), 7 * 32);
    }

    /// Memory that reports the thread it is dropped on.
    struct Reporter(std::sync::mpsc::Sender<(std::thread::ThreadId, Option<String>)>);

    impl Drop for Reporter {
        fn drop(&mut self) {
            let me = std::thread::current();
            let _ = self.0.send((me.id(), me.name().map(str::to_owned)));
        }
    }

    #[test]
    fn the_memory_is_freed_on_a_thread_of_its_own_not_by_the_last_holder() {
        let (tx, rx) = std::sync::mpsc::channel();
        let memory = Arc::new(Reporter(tx));
        let bytes = [0u8; 64];
        let mut b = LeaseBook::new(memory);
        // SAFETY: in bounds of `bytes`, which nobody writes and which outlives the lease.
        let lease = unsafe { b.lend(NonNull::from(&bytes[0]), 64, 0, 64) };
        drop(b);
        assert!(rx.try_recv().is_err(), "a lease still out keeps the memory");
        // The last holder lets go (as a sink does with the last record when a session closes).
        let holder = std::thread::spawn(move || {
            drop(lease);
            std::thread::current().id()
        });
        let holder = holder.join().unwrap();
        let (freer, name) = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the memory is freed");
        assert_ne!(freer, holder, "not on the last holder's thread");
        assert_ne!(freer, std::thread::current().id());
        assert_eq!(name.as_deref(), Some("ringscope-free"));
        // With no lease out, dropping the book frees it the same way.
        let (tx, rx) = std::sync::mpsc::channel();
        drop(LeaseBook::new(Arc::new(Reporter(tx))));
        let (freer, name) = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("the memory is freed");
        assert_ne!(freer, std::thread::current().id());
        assert_eq!(name.as_deref(), Some("ringscope-free"));
    }
}
