//! # ringscope-policy
//!
//! Decides what happens when capture outruns export, and keeps the books that prove every record was either
//! exported or counted.
//!
//! * [`Mode`] — *full* (lossless: the producer waits for ring space up to a deadline, then fails loudly) or
//!   *best-effort* (the producer never waits: a record that finds the ring full is dropped and counted).
//! * [`Counters`] / [`Accounting`] — per-hookpoint tallies with the invariant
//!   `produced = exported + dropped + sampled_out`, checked at shutdown by [`AccountingSnapshot::check`].
//! * [`EventLog`] — what happened when: spans of dropped records (step range, hookpoint, reason, rows lost) and
//!   rung changes, written into every dataset as its `_ringscope_events` table.
//!
//! * [`Planner`] — the policy manager's decisions: which [`Rung`] of the degradation ladder (full → every-N-steps →
//!   last row per request → fp8 downcast → off) each hookpoint stands on, so that what capture produces fits the
//!   drain's byte-rate cap and the memory budgets; [`simulate`] holds it to its promises without a GPU.
//!
//! This crate decides from numbers and knows no memory: it never touches a ring or a record.
#![warn(missing_docs)]

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod events;
pub use events::{Event, EventKind, EventLog};

pub mod plan;
pub mod simulate;

pub use plan::{
    Budget, HookPointLoad, Keep, Ladder, Measurements, Planner, PlannerSettings, Projection, Rung, RungChange,
};

/// How the producer behaves when the ring (or, later, a sink) has no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Lossless: the producer waits for space until the deadline, then the capture fails with an error (and the
    /// record is counted as dropped with [`DropReason::Deadline`]). Inference may wait, never deadlock.
    Full,
    /// Inference never waits: a record that finds no space is dropped and counted ([`DropReason::RingFull`]).
    BestEffort,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Full => "full",
            Mode::BestEffort => "best_effort",
        })
    }
}

/// What to do about a record that found no space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFull {
    /// Wait for space for at most this long, then drop and report an error.
    Wait(Duration),
    /// Drop the record now and count it.
    Drop,
}

/// The loss policy of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossPolicy {
    /// Full or best-effort.
    pub mode: Mode,
    /// In full mode, how long a producer may wait for space before failing.
    pub full_deadline: Duration,
}

impl LossPolicy {
    /// Checks the policy's numbers.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.mode == Mode::Full && self.full_deadline.is_zero() {
            return Err(PolicyError::ZeroDeadline);
        }
        Ok(())
    }

    /// The decision for the drain when a sink's or consumer's backlog is full.
    ///
    /// In full mode the drain waits *twice* the producer's deadline: while it waits, the ring fills and the
    /// engine's capture times out first, so the engine hears of a stuck sink from its own call, loudly, before the
    /// drain gives up on that sink and drops for it (counted as `sink_backpressure`). The wait is bounded so that
    /// a sink stuck forever can never hang the drain or shutdown.
    ///
    /// The drain waits this long only for a destination that makes progress: a consumer (subscription) that takes
    /// nothing for one whole `full_deadline` is declared stalled and dropped for without waiting until it reads again
    /// (the exporter's `Subscription` docs), so it holds the engine for at most one deadline.
    pub fn on_backlog_full(&self) -> OnFull {
        match self.mode {
            Mode::Full => OnFull::Wait(self.full_deadline.saturating_mul(2)),
            Mode::BestEffort => OnFull::Drop,
        }
    }

    /// The decision for a record that found the ring full.
    pub fn on_ring_full(&self) -> OnFull {
        match self.mode {
            Mode::Full => OnFull::Wait(self.full_deadline),
            Mode::BestEffort => OnFull::Drop,
        }
    }
}

impl Default for LossPolicy {
    fn default() -> Self {
        LossPolicy { mode: Mode::Full, full_deadline: Duration::from_secs(5) }
    }
}

/// Errors of the policy crate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Full mode with a zero deadline would fail every capture that finds the ring momentarily full.
    #[error("policy.full_deadline_ms is 0: full mode needs a positive deadline (for example 5000), or use mode = \"best_effort\"")]
    ZeroDeadline,
    /// The accounting invariant does not hold for these hookpoints.
    #[error("accounting does not add up: {}", .0.iter().map(|(name, e)| format!("hookpoint `{name}`: {e}")).collect::<Vec<_>>().join("; "))]
    Unbalanced(Vec<(String, Imbalance)>),
}

/// One hookpoint's counters do not add up: `produced ≠ exported + dropped + sampled_out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "produced {} records / {} rows, but exported {} + dropped {} + sampled out {} = {} records / {} rows",
    .produced.records, .produced.rows, .exported.records, .dropped.records, .sampled_out.records,
    .outcomes.records, .outcomes.rows
)]
pub struct Imbalance {
    /// Captures accepted.
    pub produced: Tally,
    /// Records exported.
    pub exported: Tally,
    /// Records dropped, all reasons.
    pub dropped: Tally,
    /// Captures sampled out.
    pub sampled_out: Tally,
    /// `exported + dropped + sampled_out`.
    pub outcomes: Tally,
}

/// Why a record was not exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// Best-effort: the ring had no room when the record was captured.
    RingFull,
    /// Full mode: the ring stayed full past the deadline.
    Deadline,
    /// The record is larger than the ring can ever hold.
    TooLarge,
    /// The drain side was gone (shut down or crashed) when the record was captured.
    Disconnected,
    /// The exporter could not take the record for a sink or consumer: its backlog was full (best-effort; or, in full
    /// mode, a consumer that stopped reading for a whole deadline), or the memory for the record's copy out of the
    /// ring was refused.
    SinkBackpressure,
    /// A sink failed to write the record.
    SinkError,
    /// The drain found the record corrupted and skipped it.
    Corrupt,
}

impl DropReason {
    /// Every reason, in a fixed order (the order of [`AccountingSnapshot::dropped`]).
    pub const ALL: [DropReason; 7] = [
        DropReason::RingFull,
        DropReason::Deadline,
        DropReason::TooLarge,
        DropReason::Disconnected,
        DropReason::SinkBackpressure,
        DropReason::SinkError,
        DropReason::Corrupt,
    ];

    /// Stable snake_case name, as used in reports and exported metadata.
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::RingFull => "ring_full",
            DropReason::Deadline => "deadline",
            DropReason::TooLarge => "too_large",
            DropReason::Disconnected => "disconnected",
            DropReason::SinkBackpressure => "sink_backpressure",
            DropReason::SinkError => "sink_error",
            DropReason::Corrupt => "corrupt",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A count of records and of the token rows inside them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    /// Records.
    pub records: u64,
    /// Token rows in those records.
    pub rows: u64,
}

impl std::ops::Add for Tally {
    type Output = Tally;
    fn add(self, o: Tally) -> Tally {
        Tally { records: self.records + o.records, rows: self.rows + o.rows }
    }
}

#[derive(Debug, Default)]
struct AtomicTally {
    records: AtomicU64,
    rows: AtomicU64,
}

impl AtomicTally {
    fn add(&self, rows: u64) {
        self.records.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows, Ordering::Relaxed);
    }

    fn add_tally(&self, t: Tally) {
        self.records.fetch_add(t.records, Ordering::Relaxed);
        self.rows.fetch_add(t.rows, Ordering::Relaxed);
    }

    fn load(&self) -> Tally {
        Tally { records: self.records.load(Ordering::Relaxed), rows: self.rows.load(Ordering::Relaxed) }
    }
}

/// Which counter [`Counters::add`] adds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Captures accepted.
    Produced,
    /// Captures skipped by sampling or because the hookpoint was disabled.
    SampledOut,
    /// Records that entered the ring.
    Published,
    /// Records dropped, for this reason.
    Dropped(DropReason),
    /// Records exported in downcast form (a subset of the exported ones, not an outcome of its own).
    Downcast,
}

/// Time producers spent waiting for room in full mode (a session-wide tally: captures on the host path, step
/// admission on the CUDA path).
#[derive(Debug, Default)]
pub struct StallMeter {
    waits: AtomicU64,
    nanos: AtomicU64,
}

impl StallMeter {
    /// A producer waited `waited` (counted only when it is not zero).
    pub fn waited(&self, waited: Duration) {
        if !waited.is_zero() {
            self.waits.fetch_add(1, Ordering::Relaxed);
            self.nanos.fetch_add(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
    }

    /// How many waits, and how long all of them together.
    pub fn total(&self) -> (u64, Duration) {
        (self.waits.load(Ordering::Relaxed), Duration::from_nanos(self.nanos.load(Ordering::Relaxed)))
    }
}

/// Live counters of one hookpoint. Producer and drain update them concurrently (relaxed atomics: they are
/// tallies, read consistently only after the drain has stopped).
#[derive(Debug, Default)]
pub struct Counters {
    produced: AtomicTally,
    sampled_out: AtomicTally,
    published: AtomicTally,
    exported: AtomicTally,
    downcast: AtomicTally,
    dropped: [AtomicTally; DropReason::ALL.len()],
}

impl Counters {
    /// A capture was accepted (validated) for this hookpoint; it must end in exactly one of the outcomes below.
    pub fn produced(&self, rows: u64) {
        self.produced.add(rows);
    }
    /// The capture was skipped by sampling (every-Nth-step) or because the hookpoint is disabled.
    pub fn sampled_out(&self, rows: u64) {
        self.sampled_out.add(rows);
    }
    /// The record entered the ring (an intermediate state, not an outcome).
    pub fn published(&self, rows: u64) {
        self.published.add(rows);
    }
    /// The record reached the sinks.
    pub fn exported(&self, rows: u64) {
        self.exported.add(rows);
    }
    /// The record reached the sinks in downcast form (rows converted on capture to a smaller dtype). Counted next
    /// to [`exported`](Self::exported), never instead of it.
    pub fn downcast(&self, rows: u64) {
        self.downcast.add(rows);
    }
    /// The record was dropped, for `reason`.
    pub fn dropped(&self, reason: DropReason, rows: u64) {
        self.dropped[reason.index()].add(rows);
    }

    /// Adds counts made elsewhere (the GPU backend counts on the device and folds the totals in here).
    pub fn add(&self, count: Count, tally: Tally) {
        match count {
            Count::Produced => self.produced.add_tally(tally),
            Count::SampledOut => self.sampled_out.add_tally(tally),
            Count::Published => self.published.add_tally(tally),
            Count::Dropped(reason) => self.dropped[reason.index()].add_tally(tally),
            Count::Downcast => self.downcast.add_tally(tally),
        }
    }

    /// A consistent-enough copy of the counters (exact once producer and drain have stopped).
    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            produced: self.produced.load(),
            sampled_out: self.sampled_out.load(),
            published: self.published.load(),
            exported: self.exported.load(),
            downcast: self.downcast.load(),
            dropped: DropReason::ALL.map(|r| self.dropped[r.index()].load()),
        }
    }
}

/// The counters of one hookpoint at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSnapshot {
    /// Captures accepted.
    pub produced: Tally,
    /// Captures skipped by sampling or because the hookpoint was disabled.
    pub sampled_out: Tally,
    /// Records that entered the ring.
    pub published: Tally,
    /// Records that reached the sinks.
    pub exported: Tally,
    /// Of the exported records, those whose rows were downcast on capture (issue 14's downcast rung). Not an outcome:
    /// it is outside `produced = exported + dropped + sampled_out`, and at most `exported`.
    #[serde(default)]
    pub downcast: Tally,
    /// Records dropped, indexed like [`DropReason::ALL`].
    pub dropped: [Tally; DropReason::ALL.len()],
}

impl CounterSnapshot {
    /// Records dropped for `reason`.
    pub fn dropped_for(&self, reason: DropReason) -> Tally {
        self.dropped[reason.index()]
    }

    /// All drops, whatever the reason.
    pub fn dropped_total(&self) -> Tally {
        self.dropped.iter().fold(Tally::default(), |a, &b| a + b)
    }

    /// Records produced that have no outcome yet (in the ring or in the drain). Zero after a clean shutdown.
    pub fn in_flight(&self) -> i128 {
        self.produced.records as i128
            - (self.exported.records + self.dropped_total().records + self.sampled_out.records) as i128
    }

    /// Checks `produced = exported + dropped + sampled_out`, for records and for rows.
    pub fn check(&self) -> Result<(), Imbalance> {
        let outcomes = self.exported + self.dropped_total() + self.sampled_out;
        if outcomes != self.produced {
            return Err(Imbalance {
                produced: self.produced,
                exported: self.exported,
                dropped: self.dropped_total(),
                sampled_out: self.sampled_out,
                outcomes,
            });
        }
        Ok(())
    }
}

/// Snapshot of every hookpoint's counters, by hookpoint name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccountingSnapshot {
    /// `(hookpoint name, counters)` in registry order.
    pub hookpoints: Vec<(String, CounterSnapshot)>,
}

impl AccountingSnapshot {
    /// Checks the invariant for every hookpoint; the error names each hookpoint that does not add up.
    pub fn check(&self) -> Result<(), PolicyError> {
        let problems: Vec<(String, Imbalance)> =
            self.hookpoints.iter().filter_map(|(name, c)| c.check().err().map(|e| (name.clone(), e))).collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(PolicyError::Unbalanced(problems))
        }
    }

    /// Sum over all hookpoints.
    pub fn total(&self) -> CounterSnapshot {
        let mut t = CounterSnapshot::default();
        for (_, c) in &self.hookpoints {
            t.produced = t.produced + c.produced;
            t.sampled_out = t.sampled_out + c.sampled_out;
            t.published = t.published + c.published;
            t.exported = t.exported + c.exported;
            t.downcast = t.downcast + c.downcast;
            for (a, b) in t.dropped.iter_mut().zip(c.dropped) {
                *a = *a + b;
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_decisions() {
        let full = LossPolicy { mode: Mode::Full, full_deadline: Duration::from_millis(250) };
        assert_eq!(full.on_ring_full(), OnFull::Wait(Duration::from_millis(250)));
        let best = LossPolicy { mode: Mode::BestEffort, full_deadline: Duration::ZERO };
        assert_eq!(best.on_ring_full(), OnFull::Drop);
        assert_eq!(best.on_backlog_full(), OnFull::Drop);
        assert_eq!(full.on_backlog_full(), OnFull::Wait(Duration::from_millis(500)));
        assert!(best.validate().is_ok());
        let bad = LossPolicy { mode: Mode::Full, full_deadline: Duration::ZERO };
        assert!(bad.validate().unwrap_err().to_string().contains("full_deadline_ms"));
    }

    #[test]
    fn invariant_holds_and_breaks() {
        let c = Counters::default();
        for _ in 0..3 {
            c.produced(4);
        }
        c.published(4);
        c.exported(4);
        c.dropped(DropReason::RingFull, 4);
        c.sampled_out(4);
        let snap = AccountingSnapshot { hookpoints: vec![("a".into(), c.snapshot())] };
        snap.check().unwrap();
        assert_eq!(snap.total().dropped_for(DropReason::RingFull), Tally { records: 1, rows: 4 });
        assert_eq!(snap.hookpoints[0].1.in_flight(), 0);

        c.produced(2);
        let snap = AccountingSnapshot { hookpoints: vec![("layers.0.resid".into(), c.snapshot())] };
        let err = snap.check().unwrap_err().to_string();
        assert!(err.contains("layers.0.resid") && err.contains("produced 4 records"), "{err}");
    }

    #[test]
    fn rows_must_balance_too() {
        let c = Counters::default();
        c.produced(4);
        c.exported(3);
        assert!(c.snapshot().check().is_err());
    }

    #[test]
    fn downcast_is_a_subset_of_exported_and_not_an_outcome() {
        let c = Counters::default();
        c.produced(4);
        c.exported(4);
        c.downcast(4);
        c.add(Count::Downcast, Tally { records: 2, rows: 6 });
        let s = c.snapshot();
        assert_eq!(s.downcast, Tally { records: 3, rows: 10 });
        // Counting downcast rows does not count them twice: the invariant still holds.
        assert!(s.check().is_ok());
        let total = AccountingSnapshot { hookpoints: vec![("a".into(), s), ("b".into(), s)] }.total();
        assert_eq!(total.downcast, Tally { records: 6, rows: 20 });
    }
}
