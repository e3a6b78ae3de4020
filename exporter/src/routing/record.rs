//! Records after they leave the ring, and the receipts that account for them.
//!
//! The drain copies each record's payload out of the ring (so ring space is released at once) into a [`Record`]: an
//! owned, cheaply cloned handle shared by every sink and consumer that takes it. The header was decoded and checked
//! once, in the ring; the record keeps it decoded, so nothing downstream decodes it again. Each record carries one
//! [`Receipt`]; when the last clone of the record *and* of its receipt is gone, the record is counted — as
//! exported, or as dropped for the first reason any holder reported with [`Receipt::fail`]. A sink that buffers
//! data (a Parquet file being written) keeps only the small receipt until its data is durable, so a file that fails
//! to commit turns into counted drops instead of silently lost rows.

use std::collections::TryReserveError;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use ringscope_policy::DropReason;
use ringscope_ring::{RecordHeader, RecordView, RowMeta};

use crate::routing::catalog::CatalogEntry;

/// A record copied out of the ring. Clones share the bytes.
#[derive(Clone)]
pub struct Record(Arc<Inner>);

struct Inner {
    /// The payload (row metadata, then rows). An `Arc<Vec<u8>>`, not an `Arc<[u8]>`: turning the filled `Vec` into
    /// an `Arc<[u8]>` would copy the record again.
    payload: Arc<Vec<u8>>,
    header: RecordHeader,
    hookpoint: Arc<CatalogEntry>,
    receipt: Receipt,
}

impl Record {
    /// Copies `view`'s payload out of the ring; `hookpoint` is the catalog entry of the id in its header.
    ///
    /// The payload's size comes from the producer (up to half the ring): when the allocator refuses it, this returns
    /// the error instead of aborting, and nothing is counted — the caller counts the record as dropped.
    pub fn copy_from(view: &RecordView<'_>, hookpoint: Arc<CatalogEntry>) -> Result<Record, TryReserveError> {
        let mut payload = Vec::new();
        payload.try_reserve_exact(view.payload().len())?;
        payload.extend_from_slice(view.payload());
        let receipt = Receipt::new(hookpoint.clone(), view.rows() as u64);
        Ok(Record(Arc::new(Inner { payload: Arc::new(payload), header: view.header, hookpoint, receipt })))
    }

    /// The same record without accounting responsibility: what a consumer's queue holds. Handing a record to an
    /// online consumer is its export; what the consumer does with it afterwards is the consumer's business.
    pub(crate) fn detached(&self) -> Record {
        let i = &self.0;
        Record(Arc::new(Inner {
            payload: i.payload.clone(),
            header: i.header,
            hookpoint: i.hookpoint.clone(),
            receipt: Receipt(None),
        }))
    }

    /// A view of the record (header, row metadata, rows). Cheap: the header is not decoded again.
    pub fn view(&self) -> RecordView<'_> {
        RecordView::from_parts(self.0.header, &self.0.payload).expect("the payload was copied with its header's length")
    }

    /// The header.
    pub fn header(&self) -> &RecordHeader {
        &self.0.header
    }

    /// The catalog entry of the hookpoint that produced it.
    pub fn hookpoint(&self) -> &Arc<CatalogEntry> {
        &self.0.hookpoint
    }

    /// The engine step.
    pub fn step(&self) -> u64 {
        self.0.header.meta.step
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.0.header.meta.rows as usize
    }

    /// Row `i`'s request id, position and batch index.
    pub fn row_meta(&self, i: usize) -> RowMeta {
        self.view().row_meta(i)
    }

    /// Row `i`'s bytes.
    pub fn row(&self, i: usize) -> &[u8] {
        let rb = self.0.header.meta.row_bytes as usize;
        &self.data()[i * rb..(i + 1) * rb]
    }

    /// All rows, back to back.
    pub fn data(&self) -> &[u8] {
        let start = self.0.header.meta.data_offset();
        &self.0.payload[start..start + self.rows() * self.0.header.meta.row_bytes as usize]
    }

    /// Bytes this record occupies in memory (what sink backlogs are budgeted in): its header and payload.
    pub fn size_bytes(&self) -> usize {
        ringscope_ring::record::HEADER_LEN + self.0.payload.len()
    }

    /// The record's receipt: hold it while the record's data is not yet durable, [`Receipt::fail`] it if the data
    /// is lost.
    pub fn receipt(&self) -> Receipt {
        self.0.receipt.clone()
    }
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Record")
            .field("hookpoint", &self.0.hookpoint.name())
            .field("seq", &self.0.header.seq)
            .field("step", &self.step())
            .field("rows", &self.rows())
            .finish()
    }
}

/// Accounts for one record when its last holder lets go. See the module docs.
#[derive(Clone)]
pub struct Receipt(Option<Arc<ReceiptState>>);

struct ReceiptState {
    hookpoint: Arc<CatalogEntry>,
    rows: u64,
    /// 0 = no failure; otherwise 1 + the index of the first reason reported.
    failure: AtomicU8,
}

impl Receipt {
    fn new(hookpoint: Arc<CatalogEntry>, rows: u64) -> Receipt {
        Receipt(Some(Arc::new(ReceiptState { hookpoint, rows, failure: AtomicU8::new(0) })))
    }

    /// Marks the record as lost for `reason`. The first reason reported wins; the record is counted as dropped
    /// once every holder has let go.
    pub fn fail(&self, reason: DropReason) {
        let code = DropReason::ALL.iter().position(|r| *r == reason).expect("every reason is in ALL") as u8 + 1;
        if let Some(state) = &self.0 {
            let _ = state.failure.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

impl Drop for ReceiptState {
    fn drop(&mut self) {
        let counters = self.hookpoint.counters();
        match *self.failure.get_mut() {
            0 => counters.exported(self.rows),
            code => counters.dropped(DropReason::ALL[code as usize - 1], self.rows),
        }
    }
}
