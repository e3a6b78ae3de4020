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
