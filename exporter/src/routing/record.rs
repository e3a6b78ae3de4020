//! Records after they leave the ring, and the receipts that account for them.
//!
//! The drain does not copy records: each [`Record`] holds its payload as a [`Lease`] on the ring's memory (the
//! host ring, or the CUDA backend's pinned staging), shared by every sink and consumer that takes it; the ring
//! reuses that space once the last holder lets go. A record waiting in a slow destination's queue is moved out of
//! the ring into host memory when the ring runs short ([`Record::detach`]); a consumer gets its own copy when it
//! receives a record, so what it keeps never holds the ring.
//!
//! The header was decoded and checked once, in the ring; the record keeps it decoded, so nothing downstream decodes
//! it again. Each record carries one [`Receipt`]; when the last clone of the record *and* of its receipt is gone,
//! the record is counted — as exported, or as dropped for the first reason any holder reported with
//! [`Receipt::fail`]. A sink that buffers data (a Parquet file being written) keeps only the small receipt until
//! its data is durable, so a file that fails to commit turns into counted drops instead of silently lost rows.

use std::collections::TryReserveError;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use ringscope_policy::DropReason;
use ringscope_ring::{Lease, RecordHeader, RecordView, RowMeta};

use crate::routing::catalog::CatalogEntry;

/// A record out of the ring. Clones share the bytes.
#[derive(Clone)]
pub struct Record(Arc<Inner>);

/// One handle on a record: the shared bytes and the accounting responsibility it carries.
struct Inner {
    data: Arc<Data>,
    receipt: Receipt,
}

struct Data {
    payload: Payload,
    header: RecordHeader,
    hookpoint: Arc<CatalogEntry>,
}

/// Where a record's payload (row metadata, then rows) lives.
enum Payload {
    /// In the ring, lent: no copy was made.
    Leased(Lease),
    /// In host memory of its own.
    Owned(Vec<u8>),
}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::Leased(lease) => lease,
            Payload::Owned(bytes) => bytes,
        }
    }
}

fn copy_payload(bytes: &[u8]) -> Result<Vec<u8>, TryReserveError> {
    let mut payload = Vec::new();
    payload.try_reserve_exact(bytes.len())?;
    payload.extend_from_slice(bytes);
    Ok(payload)
}

impl Record {
    /// The record whose header is `header` and whose payload the ring lent as `payload`; `hookpoint` is the catalog
    /// entry of the id in its header. Nothing is copied.
    ///
    /// # Panics
    /// If `payload` is not the payload `header` describes (a ring hands out both from the same decoded record).
    pub fn leased(header: RecordHeader, payload: Lease, hookpoint: Arc<CatalogEntry>) -> Record {
        assert!(RecordView::from_parts(header, &payload).is_ok(), "the lease holds the payload its header describes");
        Record::from_data(Data { payload: Payload::Leased(payload), header, hookpoint })
    }

    /// Copies `view`'s payload out of the ring; `hookpoint` is the catalog entry of the id in its header.
    ///
    /// The payload's size comes from the producer (up to half the ring): when the allocator refuses it, this returns
    /// the error instead of aborting, and nothing is counted.
    pub fn copy_from(view: &RecordView<'_>, hookpoint: Arc<CatalogEntry>) -> Result<Record, TryReserveError> {
        let payload = Payload::Owned(copy_payload(view.payload())?);
        Ok(Record::from_data(Data { payload, header: view.header, hookpoint }))
    }

    fn from_data(data: Data) -> Record {
        let meta = &data.header.meta;
        // A record whose dtype is not its hookpoint's was downcast on capture: counted as such when exported.
        let downcast = meta.dtype != data.hookpoint.spec().dtype;
        let receipt = Receipt::new(data.hookpoint.clone(), meta.step, meta.rows as u64, downcast);
        Record(Arc::new(Inner { data: Arc::new(data), receipt }))
    }

    /// The same record without accounting responsibility: what a consumer's queue holds. Handing a record to an
    /// online consumer is its export; what the consumer does with it afterwards is the consumer's business.
    pub(crate) fn detached(&self) -> Record {
        Record(Arc::new(Inner { data: self.0.data.clone(), receipt: Receipt(None) }))
    }

    /// Whether the payload is still lent by the ring (not copied out).
    pub fn is_leased(&self) -> bool {
        matches!(self.0.data.payload, Payload::Leased(_))
    }

    /// This record with its payload in host memory of its own, so holding it no longer holds ring space (the
    /// receipt goes with it). A record already in its own memory is returned as it is. Fails only when the memory
    /// for the copy is refused.
    pub fn detach(&self) -> Result<Record, TryReserveError> {
        if !self.is_leased() {
            return Ok(self.clone());
        }
        let d = &self.0.data;
        let payload = Payload::Owned(copy_payload(d.payload.bytes())?);
        let data = Data { payload, header: d.header, hookpoint: d.hookpoint.clone() };
        Ok(Record(Arc::new(Inner { data: Arc::new(data), receipt: self.0.receipt.clone() })))
    }

    /// A view of the record (header, row metadata, rows). Cheap: the header is not decoded again.
    pub fn view(&self) -> RecordView<'_> {
        RecordView::from_parts(self.0.data.header, self.payload()).expect("the payload matches its header")
    }

    fn payload(&self) -> &[u8] {
        self.0.data.payload.bytes()
    }

    /// The header.
    pub fn header(&self) -> &RecordHeader {
        &self.0.data.header
    }

    /// The catalog entry of the hookpoint that produced it.
    pub fn hookpoint(&self) -> &Arc<CatalogEntry> {
        &self.0.data.hookpoint
    }

    /// The engine step.
    pub fn step(&self) -> u64 {
        self.0.data.header.meta.step
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.0.data.header.meta.rows as usize
    }

    /// Row `i`'s request id, position and batch index.
    pub fn row_meta(&self, i: usize) -> RowMeta {
        self.view().row_meta(i)
    }

    /// Row `i`'s bytes.
    pub fn row(&self, i: usize) -> &[u8] {
        let rb = self.0.data.header.meta.row_bytes as usize;
        &self.data()[i * rb..(i + 1) * rb]
    }

    /// All rows, back to back.
    pub fn data(&self) -> &[u8] {
        let meta = &self.0.data.header.meta;
        let start = meta.data_offset();
        &self.payload()[start..start + self.rows() * meta.row_bytes as usize]
    }

    /// [`data`](Self::data) as [`Bytes`] that share the record's memory (no copy): they keep the record — and so
    /// its ring space, when it is leased — alive while any clone of them lives.
    pub fn data_bytes(&self) -> Bytes {
        Bytes::from_owner(RecordData(self.clone()))
    }

    /// Bytes this record occupies in memory (what sink backlogs are budgeted in): its header and payload.
    pub fn size_bytes(&self) -> usize {
        ringscope_ring::record::HEADER_LEN + self.payload().len()
    }

    /// The record's receipt: hold it while the record's data is not yet durable, [`Receipt::fail`] it if the data
    /// is lost.
    pub fn receipt(&self) -> Receipt {
        self.0.receipt.clone()
    }
}

/// A record's rows as the owner of a [`Bytes`].
struct RecordData(Record);

impl AsRef<[u8]> for RecordData {
    fn as_ref(&self) -> &[u8] {
        self.0.data()
    }
}

impl std::fmt::Debug for Record {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Record")
            .field("hookpoint", &self.hookpoint().name())
            .field("seq", &self.header().seq)
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
    /// The record's step, for the event log when it is lost.
    step: u64,
    rows: u64,
    /// The rows were downcast on capture ([`Counters::downcast`](ringscope_policy::Counters::downcast)).
    downcast: bool,
    /// 0 = no failure; otherwise 1 + the index of the first reason reported.
    failure: AtomicU8,
}

impl Receipt {
    fn new(hookpoint: Arc<CatalogEntry>, step: u64, rows: u64, downcast: bool) -> Receipt {
        Receipt(Some(Arc::new(ReceiptState { hookpoint, step, rows, downcast, failure: AtomicU8::new(0) })))
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
        match *self.failure.get_mut() {
            0 => {
                let counters = self.hookpoint.counters();
                counters.exported(self.rows);
                if self.downcast {
                    counters.downcast(self.rows);
                }
            }
            code => self.hookpoint.dropped(DropReason::ALL[code as usize - 1], self.step, self.rows),
        }
    }
}
