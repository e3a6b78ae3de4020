//! Test fixtures of the exporter's unit tests: a catalog of hookpoints and a stand-in for the capture side that
//! publishes records into a host ring and counts them as the capture side would (the exporter does not depend on
//! the hookpoint crate, so its tests do not either).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ringscope_policy::{AccountingSnapshot, Counters, EventLog, LossPolicy, Mode};
use ringscope_ring::{DType, HookPointSpec, Producer, RecordMeta, RowMeta, SiteKind};

use crate::routing::catalog::{Catalog, CatalogEntry};

/// Full mode with a deadline no test reaches.
pub(crate) const FULL: LossPolicy = LossPolicy { mode: Mode::Full, full_deadline: Duration::from_secs(10) };

/// Hookpoints `0..n`, each with its own counters, logging into one event log.
pub(crate) struct TestCatalog(Vec<Arc<CatalogEntry>>, Arc<EventLog>);

impl TestCatalog {
    /// `n` residual hookpoints `layers.{l}.resid` of `row_width` f16 elements, hookpoint `l` on layer `l`.
    pub(crate) fn layers(n: u32, row_width: u32) -> Self {
        let events = Arc::new(EventLog::new());
        let entries = (0..n)
            .map(|l| {
                let spec = HookPointSpec {
                    name: format!("layers.{l}.resid"),
                    site: SiteKind::Residual,
                    layer: Some(l),
                    dtype: DType::F16,
                    row_width,
                };
                Arc::new(CatalogEntry::new(l, spec, Arc::new(Counters::default()), events.clone()))
            })
            .collect();
        TestCatalog(entries, events)
    }

    /// Hookpoint `hp`'s catalog entry.
    pub(crate) fn entry(&self, hp: u32) -> Arc<CatalogEntry> {
        self.0[hp as usize].clone()
    }

    /// The event log every hookpoint logs its drops into.
    pub(crate) fn events(&self) -> &Arc<EventLog> {
        &self.1
    }

    /// The catalog, as the drain takes it.
    pub(crate) fn catalog(&self) -> Arc<dyn Catalog> {
        Arc::new(self.0.clone())
    }

    /// Publishes one record of hookpoint `hp` at `step` with `(request id, position)` per row and `data` (all
    /// rows), counted as produced and published; waits for ring space (the drain frees it).
    pub(crate) fn capture(&self, p: &mut Producer, hp: u32, step: u64, rows: &[(u64, u32)], data: &[u8]) {
        let entry = &self.0[hp as usize];
        let n = rows.len() as u32;
        let meta = RecordMeta {
            step,
            hookpoint: hp,
            rows: n,
            row_bytes: entry.spec().row_bytes(),
            dtype: entry.spec().dtype,
            flags: 0,
        };
        let metas: Vec<RowMeta> = rows
            .iter()
            .enumerate()
            .map(|(i, &(request_id, position))| RowMeta { request_id, position, batch_row: i as u32 })
            .collect();
        entry.counters().produced(n as u64);
        let mut reservation = p.reserve_until(meta, Instant::now() + FULL.full_deadline).expect("ring space");
        reservation.write_rows(&metas, data);
        reservation.publish();
        entry.counters().published(n as u64);
    }

    /// Every hookpoint's counters.
    pub(crate) fn accounting(&self) -> AccountingSnapshot {
        AccountingSnapshot { hookpoints: self.0.iter().map(|e| (e.name().to_owned(), e.accounting())).collect() }
    }
}

/// Object storage in memory, rooted at `memory://bucket/dumps`, with parts of the smallest size S3 takes.
pub(crate) fn memory_storage() -> crate::storage::ObjectStorage {
    let store = Arc::new(object_store::memory::InMemory::new());
    let options = crate::storage::StorageOptions { part_bytes: crate::storage::MIN_PART_BYTES, ..Default::default() };
    crate::storage::ObjectStorage::with_store(store, "memory://bucket/dumps", "dumps", options)
}

/// An in-memory store that fails every write while `failing` is set, as a server that went away would (after the
/// client's retries): puts, new uploads, parts and completions return an error; reads and listings work.
#[derive(Debug, Default)]
pub(crate) struct FlakyStore {
    inner: object_store::memory::InMemory,
    pub(crate) failing: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Display for FlakyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FlakyStore")
    }
}

fn gone() -> object_store::Error {
    object_store::Error::Generic { store: "flaky", source: "connection refused (the test's server is down)".into() }
}

impl FlakyStore {
    fn check(failing: &std::sync::atomic::AtomicBool) -> object_store::Result<()> {
        match failing.load(std::sync::atomic::Ordering::SeqCst) {
            true => Err(gone()),
            false => Ok(()),
        }
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for FlakyStore {
    async fn put_opts(
        &self,
        location: &object_store::path::Path,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        Self::check(&self.failing)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        Self::check(&self.failing)?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(FlakyUpload { inner, failing: self.failing.clone() }))
    }

    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[derive(Debug)]
struct FlakyUpload {
    inner: Box<dyn object_store::MultipartUpload>,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl object_store::MultipartUpload for FlakyUpload {
    fn put_part(&mut self, data: object_store::PutPayload) -> object_store::UploadPart {
        match FlakyStore::check(&self.failing) {
            Ok(()) => self.inner.put_part(data),
            Err(e) => Box::pin(async move { Err(e) }),
        }
    }

    async fn complete(&mut self) -> object_store::Result<object_store::PutResult> {
        FlakyStore::check(&self.failing)?;
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.inner.abort().await
    }
}
