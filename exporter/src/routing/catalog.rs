//! The catalog: what the hookpoint id carried by a record stands for.
//!
//! Records name their hookpoint by a 32-bit id. The capture side (the `ringscope-hookpoint` crate) assigns the ids;
//! the export side must not depend on it, so the session hands the drain a [`Catalog`] that resolves an id to a
//! [`CatalogEntry`]: the hookpoint's spec (for file schemas and filters), its loss counters (shared with the
//! capture side, which counts what it produced; the export side counts what it exported or lost) and the session's
//! event log (where the export side logs each record it lost, with its step).

use std::sync::Arc;

use ringscope_policy::{CounterSnapshot, Counters, DropReason, EventLog};
use ringscope_ring::HookPointSpec;

/// One hookpoint as the export side sees it.
#[derive(Debug)]
pub struct CatalogEntry {
    id: u32,
    spec: HookPointSpec,
    counters: Arc<Counters>,
    events: Arc<EventLog>,
}

impl CatalogEntry {
    /// The entry for hookpoint `id`, described by `spec`, counting into `counters` (the capture side's counters
    /// of the same hookpoint: accounting adds up only if both sides count into one set) and logging what it loses
    /// into `events` (the session's log, so that its events table accounts for every drop).
    pub fn new(id: u32, spec: HookPointSpec, counters: Arc<Counters>, events: Arc<EventLog>) -> Self {
        CatalogEntry { id, spec, counters, events }
    }

    /// The id records carry.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// What the hookpoint captures.
    pub fn spec(&self) -> &HookPointSpec {
        &self.spec
    }

    /// The hookpoint's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The hookpoint's loss counters now.
    pub fn accounting(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A record of `rows` rows of step `step` was lost for `reason`: counts it and logs it.
    pub(crate) fn dropped(&self, reason: DropReason, step: u64, rows: u64) {
        self.counters.dropped(reason, rows);
        self.events.dropped(&self.spec.name, reason, step, 1, rows);
    }
}

/// Resolves the hookpoint ids in records. Ids are never reused: once an id resolves, it resolves to the same entry
/// for the catalog's lifetime (the drain caches entries and asks again only for ids it has not seen).
pub trait Catalog: Send + Sync {
    /// The entry of hookpoint `id`, or `None` when no hookpoint has that id.
    fn entry(&self, id: u32) -> Option<Arc<CatalogEntry>>;
}

/// A fixed list of entries, entry `i` having id `i`: for tests, tools and sessions whose hookpoints are all known
/// when the drain starts.
impl Catalog for Vec<Arc<CatalogEntry>> {
    fn entry(&self, id: u32) -> Option<Arc<CatalogEntry>> {
        self.get(id as usize).filter(|e| e.id == id).cloned()
    }
}
