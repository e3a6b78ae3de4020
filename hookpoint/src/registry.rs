//! The registry of a session's hookpoints, and the runtime controls of each.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use ringscope_policy::{AccountingSnapshot, Counters};

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
#[derive(Debug)]
pub struct Control {
    enabled: AtomicBool,
    every_n_steps: AtomicU32,
    downcast: AtomicBool,
    selection: RwLock<RowSelection>,
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

    /// Whether a capture at `step` is taken (enabled and on a sampled step).
    pub fn samples(&self, step: u64) -> bool {
        self.enabled() && step % self.every_n_steps() as u64 == 0
    }

    /// Whether captured rows are downcast to row-scaled FP8 E4M3 ([`DType::F8E4M3RowScaled`]) on capture: the
    /// records then carry that dtype and rows of `row_width + 4` bytes (the scale, then one byte per element).
    pub fn downcast(&self) -> bool {
        self.downcast.load(Ordering::Relaxed)
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
            Some(d) if self.downcast() => (d, d.row_bytes(spec.row_width as u64) as u32),
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

/// A registered hookpoint: its id (as written in records), spec, controls and loss counters.
#[derive(Debug)]
pub struct HookPoint {
    id: u32,
    spec: HookPointSpec,
    control: Control,
    /// Shared with the exporter's catalog entry: the capture side counts what it produced and dropped, the export
    /// side what it exported or lost, and the two meet only in these counters.
    counters: Arc<Counters>,
}

impl HookPoint {
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
}

/// All hookpoints of a session. Append-only: ids are never reused, so a record's hookpoint id always resolves.
#[derive(Debug, Default)]
pub struct Registry {
    inner: RwLock<Inner>,
    /// Bumped by every registration and every control change.
    changes: Arc<AtomicU64>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: Vec<Arc<HookPoint>>,
    by_name: HashMap<String, u32>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Registry::default()
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
        let hp = Arc::new(HookPoint { id, spec, control, counters: Arc::default() });
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
