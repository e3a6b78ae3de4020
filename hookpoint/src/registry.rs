//! The registry of a session's hookpoints, and the runtime controls of each.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};
use ringscope_policy::{AccountingSnapshot, Counters, DropReason, EventLog, Keep, StallMeter};

use crate::error::HookPointError;
use ringscope_ring::{DType, HookPointSpec};

/// Which rows of a step's batch a capture keeps.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RowSelection {
    /// Every row of the batch, in batch order.
    #[default]
    All,
    /// These batch rows, in this order. Every index must be below the batch size.
    Rows(Vec<u32>),
    /// The last row of each request in the batch (the row a next-token probe reads), in batch order.
    LastPerRequest,
}

/// The runtime controls of a hookpoint. Changes take effect at the next capture; engines change them between
/// steps (the GPU backend mirrors them into device memory read by the kernel at replay time).
///
/// Two layers: the user's settings (`set_enabled`, `set_every_n_steps`, `set_selection`) and, over them, the policy
/// manager's rung ([`Control::set_keep`]): sampling multiplies, "last row" narrows a whole-batch selection, "off"
/// disables. Captures follow the combination (`effective_*`); the user's settings read back as the user set them.
#[derive(Debug)]
pub struct Control {
    enabled: AtomicBool,
    every_n_steps: AtomicU32,
    downcast: AtomicBool,
    selection: RwLock<RowSelection>,
    /// The policy manager's layer, packed ([`pack_keep`]); 0 = keep everything.
    keep: AtomicU64,
    /// The hookpoint's name and dtype: `set_downcast` refuses dtypes that are not downcast, naming both.
    name: String,
    dtype: DType,
    /// Bumped by every change, so the GPU backend re-uploads controls only when they changed.
    generation: AtomicU64,
    /// The registry's change counter (bumped with `generation`).
    registry_changes: Arc<AtomicU64>,
}

impl Control {
    fn new(spec: &HookPointSpec, registry_changes: Arc<AtomicU64>) -> Self {
        Control {
            enabled: AtomicBool::new(true),
            every_n_steps: AtomicU32::new(1),
            downcast: AtomicBool::new(false),
            selection: RwLock::default(),
            keep: AtomicU64::new(0),
            name: spec.name.clone(),
            dtype: spec.dtype,
            generation: AtomicU64::new(0),
            registry_changes,
        }
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::Release);
        self.registry_changes.fetch_add(1, Ordering::Release);
    }

    /// Whether captures are taken at all.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns captures on or off.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
        self.changed();
    }

    /// A number that changes whenever a control changes.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Captures are taken at steps that are a multiple of this (1 = every step).
    pub fn every_n_steps(&self) -> u32 {
        self.every_n_steps.load(Ordering::Relaxed)
    }

    /// Samples every `n`-th step (`n ≥ 1`).
    pub fn set_every_n_steps(&self, n: u32) -> Result<(), HookPointError> {
        if n == 0 {
            return Err(HookPointError::InvalidControl("every_n_steps must be at least 1 (1 = every step)".into()));
        }
        self.every_n_steps.store(n, Ordering::Relaxed);
        self.changed();
        Ok(())
    }

    /// Whether a capture at `step` is taken (enabled and on a sampled step, the policy manager's rung included).
    pub fn samples(&self, step: u64) -> bool {
        self.effective_enabled() && step.is_multiple_of(self.effective_every_n() as u64)
    }

    /// The policy manager's layer over the user's settings.
    pub fn keep(&self) -> Keep {
        unpack_keep(self.keep.load(Ordering::Relaxed))
    }

    /// Sets the policy manager's layer (the rung a hookpoint stands on). Bumps the generation only on a change.
    pub fn set_keep(&self, keep: Keep) {
        if self.keep.swap(pack_keep(keep), Ordering::Relaxed) != pack_keep(keep) {
            self.changed();
        }
    }

    /// Enabled by the user and not switched off by the policy manager.
    pub fn effective_enabled(&self) -> bool {
        self.enabled() && !self.keep().off
    }

    /// The user's sampling times the policy manager's.
    pub fn effective_every_n(&self) -> u32 {
        self.every_n_steps().saturating_mul(self.keep().every_n.max(1))
    }

    /// The rows captures keep: the user's selection, narrowed to each request's last row when the policy manager's
    /// rung says so and the user's selection is the whole batch.
    pub fn effective_selection(&self) -> EffectiveSelection<'_> {
        let user = self.selection.read();
        if self.keep().last_row && *user == RowSelection::All {
            EffectiveSelection::LastRow
        } else {
            EffectiveSelection::User(user)
        }
    }

    /// Whether captured rows are downcast to row-scaled FP8 E4M3 ([`DType::F8E4M3RowScaled`]) on capture: the
    /// records then carry that dtype and rows of `row_width + 4` bytes (the scale, then one byte per element).
    pub fn downcast(&self) -> bool {
        self.downcast.load(Ordering::Relaxed)
    }

    /// Downcast by the user or by the policy manager's rung (only hookpoints whose dtype can be downcast).
    pub fn effective_downcast(&self) -> bool {
        (self.downcast() || self.keep().downcast) && self.dtype.downcast().is_some()
    }

    /// Turns the downcast on capture on or off (the policy's rung between "last row per request" and "drop"). Only
    /// hookpoints of dtype bf16, f16 or f32 can be downcast; others are an error naming the hookpoint and dtype.
    pub fn set_downcast(&self, on: bool) -> Result<(), HookPointError> {
        if on && self.dtype.downcast().is_none() {
            return Err(HookPointError::InvalidControl(format!(
                "hookpoint `{}` has dtype {}: only bf16, f16 and f32 rows can be downcast to {}",
                self.name,
                self.dtype,
                DType::F8E4M3RowScaled
            )));
        }
        self.downcast.store(on, Ordering::Relaxed);
        self.changed();
        Ok(())
    }

    /// The dtype and row size of the records a capture writes now: the hookpoint's own, or the downcast ones.
    pub fn record_format(&self, spec: &HookPointSpec) -> (DType, u32) {
        match spec.dtype.downcast() {
            Some(d) if self.effective_downcast() => (d, d.row_bytes(spec.row_width as u64) as u32),
            _ => (spec.dtype, spec.row_bytes()),
        }
    }

    /// The current row selection.
    pub fn selection(&self) -> parking_lot::RwLockReadGuard<'_, RowSelection> {
        self.selection.read()
    }

    /// Replaces the row selection. An explicit list must be non-empty (indices are checked against each batch).
    pub fn set_selection(&self, selection: RowSelection) -> Result<(), HookPointError> {
        if matches!(&selection, RowSelection::Rows(r) if r.is_empty()) {
            return Err(HookPointError::InvalidControl("an explicit row selection needs at least one row".into()));
        }
        *self.selection.write() = selection;
        self.changed();
        Ok(())
    }
}

/// The row selection captures follow now ([`Control::effective_selection`]).
pub enum EffectiveSelection<'a> {
    /// The user's selection.
    User(RwLockReadGuard<'a, RowSelection>),
    /// The policy manager narrowed a whole-batch selection to each request's last row.
    LastRow,
}

impl std::ops::Deref for EffectiveSelection<'_> {
    type Target = RowSelection;
    fn deref(&self) -> &RowSelection {
        match self {
            EffectiveSelection::User(g) => g,
            EffectiveSelection::LastRow => &RowSelection::LastPerRequest,
        }
    }
}

const KEEP_LAST_ROW: u64 = 1 << 32;
const KEEP_DOWNCAST: u64 = 1 << 33;
const KEEP_OFF: u64 = 1 << 34;

/// One word for [`Keep`], so that captures read the policy manager's layer with one atomic load.
fn pack_keep(k: Keep) -> u64 {
    let n = if k.every_n <= 1 { 0 } else { k.every_n as u64 };
    n | if k.last_row { KEEP_LAST_ROW } else { 0 }
        | if k.downcast { KEEP_DOWNCAST } else { 0 }
        | if k.off { KEEP_OFF } else { 0 }
}

fn unpack_keep(w: u64) -> Keep {
    Keep {
        every_n: (w as u32).max(1),
        last_row: w & KEEP_LAST_ROW != 0,
        downcast: w & KEEP_DOWNCAST != 0,
        off: w & KEEP_OFF != 0,
    }
}

/// A registered hookpoint: its id (as written in records), spec, controls and loss counters.
#[derive(Debug)]
pub struct HookPoint {
    id: u32,
    spec: HookPointSpec,
    control: Control,
    /// Shared with the exporter's catalog entry: the capture side counts what it produced and dropped, the export
    /// side what it exported or lost, and the two meet only in these counters.
    counters: Arc<Counters>,
    /// The session's full-mode wait tally (shared by every hookpoint of a registry).
    stall: Arc<StallMeter>,
    /// The session's event log, where every drop counted here is logged with its step.
    events: Arc<EventLog>,
}

impl HookPoint {
    /// The session's full-mode wait tally.
    pub fn stall(&self) -> &StallMeter {
        &self.stall
    }

    /// Id written into every record of this hookpoint; its index in the registry.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// What it captures.
    pub fn spec(&self) -> &HookPointSpec {
        &self.spec
    }

    /// Runtime controls.
    pub fn control(&self) -> &Control {
        &self.control
    }

    /// Loss accounting.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// The session's event log (shared by every hookpoint of the registry).
    pub fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    /// A record of `rows` rows captured at `step` was dropped for `reason`: counts it and logs it.
    pub fn dropped(&self, reason: DropReason, step: u64, rows: u64) {
        self.counters.dropped(reason, rows);
        self.events.dropped(&self.spec.name, reason, step, 1, rows);
    }
}

/// All hookpoints of a session. Append-only: ids are never reused, so a record's hookpoint id always resolves.
#[derive(Debug, Default)]
pub struct Registry {
    inner: RwLock<Inner>,
    /// Bumped by every registration and every control change.
    changes: Arc<AtomicU64>,
    /// Full-mode waits of every producer of the session.
    stall: Arc<StallMeter>,
    /// Where the hookpoints log their drops.
    events: Arc<EventLog>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: Vec<Arc<HookPoint>>,
    by_name: HashMap<String, u32>,
}

impl Registry {
    /// An empty registry with an event log of its own.
    pub fn new() -> Self {
        Registry::default()
    }

    /// An empty registry whose hookpoints log their drops into `events` (the session's log).
    pub fn with_events(events: Arc<EventLog>) -> Self {
        Registry { events, ..Registry::default() }
    }

    /// The event log the hookpoints log their drops into.
    pub fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    /// Registers a hookpoint and returns it. Fails on an invalid spec or a name already taken.
    pub fn register(&self, spec: HookPointSpec) -> Result<Arc<HookPoint>, HookPointError> {
        spec.validate()?;
        let mut inner = self.inner.write();
        if inner.by_name.contains_key(&spec.name) {
            return Err(HookPointError::DuplicateName(spec.name));
        }
        let id = u32::try_from(inner.by_id.len()).map_err(|_| HookPointError::TooMany)?;
        inner.by_name.insert(spec.name.clone(), id);
        let control = Control::new(&spec, self.changes.clone());
        let hp = Arc::new(HookPoint {
            id,
            spec,
            control,
            counters: Arc::default(),
            stall: self.stall.clone(),
            events: self.events.clone(),
        });
        inner.by_id.push(hp.clone());
        self.changes.fetch_add(1, Ordering::Release);
        Ok(hp)
    }

    /// The hookpoint with this id.
    pub fn get(&self, id: u32) -> Result<Arc<HookPoint>, HookPointError> {
        self.inner.read().by_id.get(id as usize).cloned().ok_or(HookPointError::UnknownId(id))
    }

    /// The hookpoint with this name.
    pub fn by_name(&self, name: &str) -> Result<Arc<HookPoint>, HookPointError> {
        let inner = self.inner.read();
        let id = *inner.by_name.get(name).ok_or_else(|| HookPointError::UnknownName {
            name: name.to_owned(),
            known: inner.by_id.iter().map(|h| h.spec().name.clone()).take(8).collect::<Vec<_>>().join(", "),
        })?;
        Ok(inner.by_id[id as usize].clone())
    }

    /// Time producers waited for room in full mode: capture on the host path, step admission on the CUDA path.
    pub fn stall(&self) -> &StallMeter {
        &self.stall
    }

    /// A number that changes whenever a hookpoint is registered or any control changes (one atomic load: the GPU
    /// backend checks it every step).
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Every hookpoint, in id order.
    pub fn all(&self) -> Vec<Arc<HookPoint>> {
        self.inner.read().by_id.clone()
    }

    /// Number of hookpoints.
    pub fn len(&self) -> usize {
        self.inner.read().by_id.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The loss counters of every hookpoint, by name.
    pub fn accounting(&self) -> AccountingSnapshot {
        AccountingSnapshot {
            hookpoints: self
                .inner
                .read()
                .by_id
                .iter()
                .map(|h| (h.spec().name.clone(), h.counters().snapshot()))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringscope_ring::SiteKind;

    fn spec(name: &str) -> HookPointSpec {
        HookPointSpec { name: name.into(), site: SiteKind::Residual, layer: Some(1), dtype: DType::F32, row_width: 4 }
    }

    #[test]
    fn register_and_look_up() {
        let r = Registry::new();
        let a = r.register(spec("a")).unwrap();
        let b = r.register(spec("b")).unwrap();
        assert_eq!((a.id(), b.id()), (0, 1));
        assert_eq!(r.by_name("b").unwrap().id, 1);
        assert_eq!(r.get(0).unwrap().spec().name, "a");
        assert!(matches!(r.register(spec("a")), Err(HookPointError::DuplicateName(n)) if n == "a"));
        let err = r.by_name("c").unwrap_err().to_string();
        assert!(err.contains("`c`") && err.contains("a, b"), "{err}");
        assert!(matches!(r.get(9), Err(HookPointError::UnknownId(9))));
        assert_eq!(r.accounting().hookpoints.len(), 2);
    }

    #[test]
    fn controls_change_at_runtime() {
        let r = Registry::new();
        let h = r.register(spec("a")).unwrap();
        assert!(h.control().samples(3));
        h.control().set_every_n_steps(4).unwrap();
        assert!(h.control().samples(8) && !h.control().samples(9));
        h.control().set_enabled(false);
        assert!(!h.control().samples(8));
        assert!(h.control().set_every_n_steps(0).is_err());
        assert!(h.control().set_selection(RowSelection::Rows(vec![])).is_err());
        h.control().set_selection(RowSelection::LastPerRequest).unwrap();
        assert_eq!(*h.control().selection(), RowSelection::LastPerRequest);
    }

    #[test]
    fn the_policy_layer_combines_with_the_user_settings() {
        let r = Registry::new();
        let h = r.register(spec("a")).unwrap();
        let c = h.control();
        c.set_every_n_steps(2).unwrap();
        let g = c.generation();
        c.set_keep(Keep { every_n: 3, last_row: true, downcast: false, off: false });
        assert!(c.generation() > g);
        let g = c.generation();
        c.set_keep(Keep { every_n: 3, last_row: true, downcast: false, off: false });
        assert_eq!(c.generation(), g, "no change, no re-upload");
        assert_eq!((c.every_n_steps(), c.effective_every_n()), (2, 6));
        assert!(c.samples(12) && !c.samples(4));
        assert_eq!(*c.selection(), RowSelection::All);
        assert_eq!(*c.effective_selection(), RowSelection::LastPerRequest);
        // An explicit list is the user's choice: the rung does not replace it.
        c.set_selection(RowSelection::Rows(vec![1])).unwrap();
        assert_eq!(*c.effective_selection(), RowSelection::Rows(vec![1]));
        c.set_keep(Keep { every_n: 1, off: true, ..Keep::default() });
        assert!(c.enabled() && !c.effective_enabled() && !c.samples(0));
        c.set_keep(Keep::default());
        assert!(c.samples(0) && c.keep() == Keep { every_n: 1, ..Keep::default() });
        // The rung's downcast applies to hookpoints whose dtype can be downcast (this one is f32), not to others.
        c.set_keep(Keep { every_n: 1, downcast: true, ..Keep::default() });
        assert!(!c.downcast() && c.effective_downcast());
        let ids = r.register(HookPointSpec { dtype: DType::I32, ..spec("ids") }).unwrap();
        ids.control().set_keep(Keep { every_n: 1, downcast: true, ..Keep::default() });
        assert!(!ids.control().effective_downcast());
    }

    #[test]
    fn downcast_is_a_control_of_float_hookpoints() {
        let r = Registry::new();
        let h = r.register(HookPointSpec { dtype: DType::BF16, row_width: 8, ..spec("a") }).unwrap();
        let (gen, changes) = (h.control().generation(), r.changes());
        assert!(!h.control().downcast());
        assert_eq!(h.control().record_format(h.spec()), (DType::BF16, 16));
        h.control().set_downcast(true).unwrap();
        assert!(h.control().downcast());
        assert_eq!(h.control().record_format(h.spec()), (DType::F8E4M3RowScaled, 12));
        assert!(h.control().generation() > gen && r.changes() > changes, "a change the GPU backend uploads");
        let i = r.register(HookPointSpec { dtype: DType::I32, ..spec("ids") }).unwrap();
        let err = i.control().set_downcast(true).unwrap_err().to_string();
        assert!(err.contains("`ids`") && err.contains("i32"), "{err}");
        assert!(!i.control().downcast());
        i.control().set_downcast(false).unwrap();
    }
}
