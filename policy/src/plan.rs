//! The policy manager's decisions: which [`Rung`] of the degradation ladder each hookpoint stands on, so that what
//! capture produces fits what the drain, the sinks and the memory budgets can take.
//!
//! [`Planner::plan`] is a pure function of its inputs ([`Measurements`] and [`PlannerSettings`]) and of its own
//! state (the rungs in force, the rate it last judged sustainable, when it last changed anything): the same inputs
//! give the same plan, so it is tested with a simulator ([`crate::simulate`]) instead of a GPU.
//!
//! How it decides, every tick:
//! 1. **The sustainable rate.** The configured drain cap (PCIe share), or unlimited. When a memory budget (GPU ring,
//!    pinned staging, host backlog) fills past the high watermark, what the path actually delivered is the most it
//!    can take: the rate limit drops to that (less a margin), at most once per dwell time. When every budget stays
//!    below the low watermark for a dwell time, the limit grows again by a quarter (towards the cap): recovery.
//! 2. **The plan.** While the rungs in force produce more than the limit, hookpoints step down the ladder, lowest
//!    [priority](HookPointLoad::priority) first; within one priority the hookpoint that costs most steps down first,
//!    so equal hookpoints degrade evenly. A last pass steps hookpoints back up, highest priority first, wherever the
//!    budget still has room: the plan keeps close to the most the budget allows.
//! 3. **Hysteresis.** Degrading happens at once when the rungs in force exceed 95% of the limit; recovering waits a
//!    dwell time and needs a plan that fits 85% of it. Under a steady load the plan settles and stays.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How much of a hookpoint's stream is kept: one rung of the degradation ladder. Rungs are cumulative — each keeps
/// the reductions of the rungs above it — so each costs at most what the one above it costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rung {
    /// Every row of every step, as captured.
    Full,
    /// Every row of one step in `n` (`n ≥ 2`).
    Every(u32),
    /// The last row of each request, on one step in the ladder's largest `n`.
    LastRow,
    /// As [`Rung::LastRow`], converted on the device to fp8 (e4m3) with a per-row scale.
    Downcast,
    /// Nothing.
    Off,
}

impl Rung {
    /// Stable name, as written in events and metrics: `full`, `every_4`, `last_row`, `downcast`, `off`.
    pub fn name(self) -> String {
        match self {
            Rung::Full => "full".into(),
            Rung::Every(n) => format!("every_{n}"),
            Rung::LastRow => "last_row".into(),
            Rung::Downcast => "downcast".into(),
            Rung::Off => "off".into(),
        }
    }
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// What a rung means for the capture controls: sample one step in `every_n`, keep only each request's last row,
/// downcast, or nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Keep {
    /// Sample one step in this many (1 = every step).
    pub every_n: u32,
    /// Keep only the last row of each request.
    pub last_row: bool,
    /// Convert rows to fp8 with a per-row scale.
    pub downcast: bool,
    /// Keep nothing.
    pub off: bool,
}

/// The ordered rungs a hookpoint can stand on: full, every 2, 3, …, `max_every_n` steps, last row, downcast (for
/// hookpoints that can be downcast), off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ladder {
    max_every_n: u32,
}

impl Ladder {
    /// A ladder whose sampling rungs go up to one step in `max_every_n` (at least 1: 1 means no sampling rungs).
    pub fn new(max_every_n: u32) -> Ladder {
        Ladder { max_every_n: max_every_n.max(1) }
    }

    /// The rungs, from full to off; `downcast` says whether the hookpoint has a downcast rung.
    pub fn rungs(&self, downcast: bool) -> Vec<Rung> {
        let mut r = vec![Rung::Full];
        r.extend((2..=self.max_every_n).map(Rung::Every));
        r.push(Rung::LastRow);
        if downcast {
            r.push(Rung::Downcast);
        }
        r.push(Rung::Off);
        r
    }

    /// What `rung` asks of the capture controls.
    pub fn keep(&self, rung: Rung) -> Keep {
        match rung {
            Rung::Full => Keep { every_n: 1, ..Keep::default() },
            Rung::Every(n) => Keep { every_n: n.max(1), ..Keep::default() },
            Rung::LastRow => Keep { every_n: self.max_every_n, last_row: true, ..Keep::default() },
            Rung::Downcast => Keep { every_n: self.max_every_n, last_row: true, downcast: true, off: false },
            Rung::Off => Keep { every_n: 1, off: true, ..Keep::default() },
        }
    }
}

/// What one hookpoint produces, as measured recently (means over a window, not one step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HookPointLoad {
    /// Hookpoint id.
    pub id: u32,
    /// Higher is kept longer: lower priorities degrade first.
    pub priority: i32,
    /// Bytes per step at [`Rung::Full`].
    pub bytes_per_step: f64,
    /// Rows per step at [`Rung::Full`].
    pub rows_per_step: f64,
    /// Rows the last-row rungs keep, as a fraction of all rows (requests / rows in a step; 1 in pure decode).
    pub last_row_fraction: f64,
    /// Bytes of a downcast row over bytes of a captured row (for bf16 rows of width `w`: `(w + 4) / 2w`); `None`
    /// when the hookpoint's dtype cannot be downcast.
    pub downcast_ratio: Option<f64>,
}

impl HookPointLoad {
    /// Bytes per step on `rung` of `ladder`.
    pub fn bytes_on(&self, ladder: &Ladder, rung: Rung) -> f64 {
        self.bytes_per_step * self.fraction_on(ladder, rung)
    }

    /// Rows per step kept on `rung`, a downcast row weighing its byte ratio (a rung that trades precision for rows
    /// is not counted as free).
    pub fn rows_on(&self, ladder: &Ladder, rung: Rung) -> f64 {
        self.rows_per_step * self.fraction_on(ladder, rung)
    }

    fn fraction_on(&self, ladder: &Ladder, rung: Rung) -> f64 {
        let k = ladder.keep(rung);
        if k.off {
            return 0.0;
        }
        let mut f = 1.0 / k.every_n as f64;
        if k.last_row {
            f *= self.last_row_fraction.clamp(0.0, 1.0);
        }
        if k.downcast {
            f *= self.downcast_ratio.unwrap_or(1.0);
        }
        f
    }
}

/// Which budget a measurement is judged against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    /// The drain byte-rate cap (the PCIe share for observability).
    DrainRate,
    /// Device ring bytes.
    GpuRing,
    /// Pinned host staging bytes.
    PinnedStaging,
    /// Bytes queued for all sinks and consumers together.
    HostBacklog,
}

impl Budget {
    /// Stable name, as written in events: `drain_rate`, `gpu_ring`, `pinned_staging`, `host_backlog`.
    pub const fn name(self) -> &'static str {
        match self {
            Budget::DrainRate => "drain_rate",
            Budget::GpuRing => "gpu_ring",
            Budget::PinnedStaging => "pinned_staging",
            Budget::HostBacklog => "host_backlog",
        }
    }
}

/// The measurements one decision is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurements {
    /// Time since the session started (only differences matter).
    pub now: Duration,
    /// Steps per second, recently.
    pub steps_per_s: f64,
    /// Bytes per second the drain delivered to every destination, recently.
    pub delivered_bytes_per_s: f64,
    /// Each memory budget's use, as a fraction of the budget (budgets not set are left out).
    pub occupancy: Vec<(Budget, f64)>,
    /// Every hookpoint the planner manages.
    pub hookpoints: Vec<HookPointLoad>,
}

/// The operator's numbers the planner works with.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannerSettings {
    /// The drain's byte-rate cap in bytes per second (`None`: no cap).
    pub drain_bytes_per_s: Option<f64>,
    /// A memory budget above this fraction means the path is saturated (default 0.75).
    pub high_watermark: f64,
    /// Every memory budget below this fraction means there is room to recover (default 0.25).
    pub low_watermark: f64,
    /// The shortest time between two cuts of the rate limit, and between a change and a recovery.
    pub dwell: Duration,
    /// The ladder.
    pub ladder: Ladder,
}

impl Default for PlannerSettings {
    fn default() -> Self {
        PlannerSettings {
            drain_bytes_per_s: None,
            high_watermark: 0.75,
            low_watermark: 0.25,
            dwell: Duration::from_millis(500),
            ladder: Ladder::new(8),
        }
    }
}

/// One hookpoint moved to another rung.
#[derive(Debug, Clone, PartialEq)]
pub struct RungChange {
    /// Hookpoint id.
    pub hookpoint: u32,
    /// The rung it left.
    pub from: Rung,
    /// The rung it stands on now.
    pub to: Rung,
    /// What moved it: the budget that was exceeded, or `None` for a recovery.
    pub budget: Option<Budget>,
    /// The numbers behind it, for people ("drain 21.3 GB/s over the 20 GB/s cap").
    pub detail: String,
}

/// Projected use of `rate_limit`: what the plan costs and keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Projection {
    /// Bytes per second the rungs in force produce at the measured step rate.
    pub bytes_per_s: f64,
    /// Rows kept, as a fraction of the rows produced (a downcast row weighing its byte ratio).
    pub kept_fraction: f64,
}

/// Headroom below the rate limit for degrading, and for recovering (hysteresis).
const DEGRADE_AT: f64 = 0.97;
const RECOVER_TO: f64 = 0.85;
/// How much the rate limit grows per probe when every budget has room.
const RECOVERY_GROWTH: f64 = 1.25;
/// The rate limit is cut to what was delivered, less this.
const SATURATION_MARGIN: f64 = 0.95;
/// The longest wait between probes of a learnt rate limit.
const MAX_PROBE_WAIT: Duration = Duration::from_secs(600);

/// The first wait before probing a learnt limit upwards: eight dwell times.
fn settings_probe_wait(dwell: Duration) -> Duration {
    (dwell * 8).min(MAX_PROBE_WAIT)
}

/// The policy manager's decision maker. Owns the rung of every hookpoint it has seen.
#[derive(Debug, Clone)]
pub struct Planner {
    settings: PlannerSettings,
    rungs: Vec<(u32, Rung)>,
    /// Bytes per second judged sustainable (∞: no limit).
    rate_limit: f64,
    /// The budget that set `rate_limit` last.
    limiting: Budget,
    last_cut: Option<Duration>,
    last_change: Option<Duration>,
    calm_since: Option<Duration>,
    /// When the limit last grew while probing (cleared by a cut).
    grew_at: Option<Duration>,
    /// How long after a cut the limit is first probed upwards; doubles each time a probe overshoots.
    probe_wait: Duration,
}

impl Planner {
    /// A planner with every hookpoint at [`Rung::Full`].
    pub fn new(settings: PlannerSettings) -> Planner {
        let rate_limit = settings.drain_bytes_per_s.unwrap_or(f64::INFINITY);
        let dwell = settings.dwell;
        Planner {
            settings,
            rungs: Vec::new(),
            rate_limit,
            limiting: Budget::DrainRate,
            last_cut: None,
            last_change: None,
            calm_since: None,
            grew_at: None,
            probe_wait: settings_probe_wait(dwell),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &PlannerSettings {
        &self.settings
    }

    /// The rung of `hookpoint` (full when the planner has not seen it).
    pub fn rung(&self, hookpoint: u32) -> Rung {
        self.rungs.iter().find(|(id, _)| *id == hookpoint).map_or(Rung::Full, |&(_, r)| r)
    }

    /// The rate, in bytes per second, the planner judges sustainable now (∞ when nothing limits it).
    pub fn rate_limit(&self) -> f64 {
        self.rate_limit
    }

    /// What the rungs in force cost and keep under `m`'s loads.
    pub fn projection(&self, m: &Measurements) -> Projection {
        let current: Vec<Rung> = m.hookpoints.iter().map(|h| self.rung(h.id)).collect();
        project(&self.settings.ladder, &m.hookpoints, &current, m.steps_per_s)
    }

    /// Decides from `m`: returns the rung changes to apply (empty when nothing changes).
    pub fn plan(&mut self, m: &Measurements) -> Vec<RungChange> {
        self.update_rate_limit(m);
        let ladder = self.settings.ladder.clone();
        let loads = &m.hookpoints;
        let current: Vec<Rung> = loads.iter().map(|h| self.rung(h.id)).collect();
        let steps = m.steps_per_s.max(0.0);
        let now_bytes = project(&ladder, loads, &current, steps).bytes_per_s;

        let (target, budget) = if now_bytes > self.rate_limit * DEGRADE_AT {
            (assign(&ladder, loads, self.rate_limit * DEGRADE_AT / steps.max(f64::MIN_POSITIVE)), Some(self.limiting))
        } else if self.settled(m.now) {
            let candidate = assign(&ladder, loads, self.rate_limit * RECOVER_TO / steps.max(f64::MIN_POSITIVE));
            let better = project(&ladder, loads, &candidate, steps).kept_fraction
                > project(&ladder, loads, &current, steps).kept_fraction;
            (if better { candidate } else { current.clone() }, None)
        } else {
            (current.clone(), None)
        };

        let mut changes = Vec::new();
        for ((load, &from), &to) in loads.iter().zip(&current).zip(&target) {
            if from == to {
                continue;
            }
            let detail = match budget {
                Some(b) => format!(
                    "{} over {}: rungs in force {:.3} GB/s, limit {:.3} GB/s",
                    b.name(),
                    if b == Budget::DrainRate { "its cap" } else { "the high watermark" },
                    now_bytes / 1e9,
                    self.rate_limit / 1e9
                ),
                None => format!("room again: limit {:.3} GB/s", self.rate_limit / 1e9),
            };
            changes.push(RungChange { hookpoint: load.id, from, to, budget, detail });
            self.set_rung(load.id, to);
        }
        if !changes.is_empty() {
            self.last_change = Some(m.now);
        }
        changes
    }

    fn set_rung(&mut self, id: u32, rung: Rung) {
        match self.rungs.iter_mut().find(|(h, _)| *h == id) {
            Some(slot) => slot.1 = rung,
            None => self.rungs.push((id, rung)),
        }
    }

    /// No change for a dwell time, and every budget calm for one.
    fn settled(&self, now: Duration) -> bool {
        let dwell = self.settings.dwell;
        let quiet = self.last_change.is_none_or(|t| now.saturating_sub(t) >= dwell);
        let calm = self.calm_since.is_some_and(|t| now.saturating_sub(t) >= dwell);
        quiet && calm
    }

    fn update_rate_limit(&mut self, m: &Measurements) {
        let cap = self.settings.drain_bytes_per_s.unwrap_or(f64::INFINITY);
        let dwell = self.settings.dwell;
        let hottest = m.occupancy.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1));
        match hottest {
            Some((budget, fill)) if fill >= self.settings.high_watermark => {
                self.calm_since = None;
                if self.last_cut.is_none_or(|t| m.now.saturating_sub(t) >= dwell) {
                    // Saturated: what the path delivered is the most it takes now.
                    let delivered = m.delivered_bytes_per_s.max(0.0) * SATURATION_MARGIN;
                    if delivered < self.rate_limit {
                        self.rate_limit = delivered;
                        self.limiting = budget;
                    }
                    if self.grew_at.is_some() {
                        // The last probe upwards overshot: probe half as often (bounded).
                        self.probe_wait = (self.probe_wait * 2).min(MAX_PROBE_WAIT);
                        self.grew_at = None;
                    }
                    self.last_cut = Some(m.now);
                }
            }
            Some((_, fill)) if fill > self.settings.low_watermark => self.calm_since = None,
            _ => {
                // Every budget has room. A limit learnt from a saturated path cannot see that the path got faster
                // (a sink that keeps up is partly idle), so it is probed: a quarter more, first after `probe_wait`
                // since the cut, then every dwell time while the budgets stay calm.
                let since = *self.calm_since.get_or_insert(m.now);
                let calm_enough = m.now.saturating_sub(since) >= dwell;
                let waited = match (self.grew_at, self.last_cut) {
                    (Some(g), _) => m.now.saturating_sub(g) >= dwell,
                    (None, Some(c)) => m.now.saturating_sub(c) >= self.probe_wait,
                    (None, None) => true,
                };
                if self.rate_limit < cap && calm_enough && waited {
                    // From what is delivered now if that is more, and never from nothing (a limit cut to zero, every
                    // hookpoint off, would otherwise never grow): at least a hundredth of the full production.
                    let full: f64 = m.hookpoints.iter().map(|h| h.bytes_per_step).sum::<f64>() * m.steps_per_s;
                    let base = self.rate_limit.max(m.delivered_bytes_per_s).max(full / 100.0);
                    self.rate_limit = (base * RECOVERY_GROWTH).min(cap);
                    self.grew_at = Some(m.now);
                    if self.rate_limit >= cap {
                        self.limiting = Budget::DrainRate;
                        self.grew_at = None;
                    }
                }
            }
        }
        self.rate_limit = self.rate_limit.min(cap);
    }
}

/// Bytes per second and the kept fraction of rows of `rungs` (one per load) at `steps_per_s`.
pub fn project(ladder: &Ladder, loads: &[HookPointLoad], rungs: &[Rung], steps_per_s: f64) -> Projection {
    let (mut bytes, mut kept, mut rows) = (0.0, 0.0, 0.0);
    for (l, &r) in loads.iter().zip(rungs) {
        bytes += l.bytes_on(ladder, r);
        kept += l.rows_on(ladder, r);
        rows += l.rows_per_step;
    }
    Projection { bytes_per_s: bytes * steps_per_s, kept_fraction: if rows > 0.0 { kept / rows } else { 1.0 } }
}

/// The rungs that fit `bytes_per_step`: degrade lowest priority first (within a priority, the costliest first),
/// then step back up, highest priority first, wherever room is left.
pub fn assign(ladder: &Ladder, loads: &[HookPointLoad], bytes_per_step: f64) -> Vec<Rung> {
    let ladders: Vec<Vec<Rung>> = loads.iter().map(|l| ladder.rungs(l.downcast_ratio.is_some())).collect();
    let mut at = vec![0usize; loads.len()];
    let cost = |i: usize, k: usize| loads[i].bytes_on(ladder, ladders[i][k]);
    let mut total: f64 = (0..loads.len()).map(|i| cost(i, 0)).sum();

    // Priorities from lowest; ids break ties so the result never depends on input order.
    let mut priorities: Vec<i32> = loads.iter().map(|l| l.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    for &p in &priorities {
        while total > bytes_per_step {
            // The costliest hookpoint of this priority that can still step down to something cheaper.
            let pick = (0..loads.len())
                .filter(|&i| loads[i].priority == p && at[i] + 1 < ladders[i].len())
                .max_by(|&a, &b| cost(a, at[a]).total_cmp(&cost(b, at[b])).then(loads[b].id.cmp(&loads[a].id)));
            let Some(i) = pick else { break };
            // Skip rungs that save nothing (last row in pure decode): go to the next cheaper one.
            let here = cost(i, at[i]);
            let mut next = at[i] + 1;
            while next + 1 < ladders[i].len() && cost(i, next) >= here {
                next += 1;
            }
            total += cost(i, next) - here;
            at[i] = next;
        }
    }
    // Fill: step back up where the room left allows, highest priority first.
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by(|&a, &b| loads[b].priority.cmp(&loads[a].priority).then(loads[a].id.cmp(&loads[b].id)));
    loop {
        let mut moved = false;
        for &i in &order {
            while at[i] > 0 && total - cost(i, at[i]) + cost(i, at[i] - 1) <= bytes_per_step {
                total += cost(i, at[i] - 1) - cost(i, at[i]);
                at[i] -= 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    at.iter().zip(&ladders).map(|(&k, l)| l[k]).collect()
}

/// The most rows any choice of rungs keeps within `bytes_per_step`: the yardstick the simulator holds the planner's
/// plans to. A dynamic program over the rungs' costs in units of `1/resolution` of the budget, rounded down — so it
/// errs towards a higher yardstick (by at most one unit per hookpoint), never a lower one.
pub fn best_kept_fraction(ladder: &Ladder, loads: &[HookPointLoad], bytes_per_step: f64, resolution: usize) -> f64 {
    let total_rows: f64 = loads.iter().map(|l| l.rows_per_step).sum();
    if total_rows <= 0.0 {
        return 1.0;
    }
    if bytes_per_step <= 0.0 {
        return 0.0;
    }
    let unit = bytes_per_step / resolution as f64;
    // best[c] = most rows kept with total cost ≤ c units.
    let mut best = vec![0.0f64; resolution + 1];
    for l in loads {
        let mut next = vec![f64::NEG_INFINITY; resolution + 1];
        for rung in ladder.rungs(l.downcast_ratio.is_some()) {
            let units = (l.bytes_on(ladder, rung) / unit + 1e-9).floor();
            if units > resolution as f64 {
                continue;
            }
            let (units, rows) = (units as usize, l.rows_on(ladder, rung));
            for c in units..=resolution {
                next[c] = next[c].max(best[c - units] + rows);
            }
        }
        best = next;
    }
    best[resolution].max(0.0) / total_rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(id: u32, priority: i32, bytes: f64) -> HookPointLoad {
        HookPointLoad {
            id,
            priority,
            bytes_per_step: bytes,
            rows_per_step: bytes / 4096.0,
            last_row_fraction: 0.01,
            downcast_ratio: Some(0.5),
        }
    }

    #[test]
    fn rungs_are_ordered_and_each_costs_no_more_than_the_one_above() {
        let ladder = Ladder::new(8);
        let l = load(0, 0, 1e6);
        let rungs = ladder.rungs(true);
        assert_eq!(rungs.first(), Some(&Rung::Full));
        assert_eq!(rungs.last(), Some(&Rung::Off));
        assert_eq!(rungs.len(), 1 + 7 + 3);
        for w in rungs.windows(2) {
            assert!(l.bytes_on(&ladder, w[1]) <= l.bytes_on(&ladder, w[0]), "{:?}", w);
        }
        assert!(!ladder.rungs(false).contains(&Rung::Downcast));
        assert_eq!(Rung::Every(4).name(), "every_4");
        assert_eq!(ladder.keep(Rung::Downcast), Keep { every_n: 8, last_row: true, downcast: true, off: false });
    }

    #[test]
    fn lower_priority_degrades_first() {
        let ladder = Ladder::new(8);
        let loads = [load(0, 10, 1e6), load(1, 0, 1e6), load(2, 5, 1e6)];
        // Room for 2.5 of 3: only the lowest priority (id 1) gives way.
        let r = assign(&ladder, &loads, 2.5e6);
        assert_eq!(r[0], Rung::Full);
        assert_eq!(r[2], Rung::Full);
        assert_eq!(r[1], Rung::Every(2));
        // Room for 1.2: id 1 goes all the way down before id 2 gives anything; id 0 stays whole.
        let r = assign(&ladder, &loads, 1.2e6);
        assert_eq!(r[0], Rung::Full);
        assert!(r[2] > Rung::Full && r[1] >= r[2], "{r:?}");
    }

    #[test]
    fn equal_hookpoints_degrade_evenly_and_fill_the_budget() {
        let ladder = Ladder::new(8);
        let loads: Vec<_> = (0..16).map(|i| load(i, 0, 1e6)).collect();
        let budget = 16e6 * 0.3;
        let r = assign(&ladder, &loads, budget);
        let p = project(&ladder, &loads, &r, 1.0);
        assert!(p.bytes_per_s <= budget);
        assert!(p.bytes_per_s >= 0.9 * budget, "{r:?} {p:?}");
        let best = best_kept_fraction(&ladder, &loads, budget, 2000);
        assert!(p.kept_fraction >= 0.9 * best, "{} vs {best}", p.kept_fraction);
    }

    #[test]
    fn last_row_is_skipped_when_it_saves_nothing() {
        // Pure decode: one row per request, so "last row" keeps everything; the planner goes on to downcast.
        let ladder = Ladder::new(2);
        let mut l = load(0, 0, 1e6);
        l.last_row_fraction = 1.0;
        let r = assign(&ladder, &[l], 0.3e6);
        assert_eq!(r, vec![Rung::Downcast]);
    }

    fn measure(now_ms: u64, delivered: f64, fill: f64, loads: &[HookPointLoad]) -> Measurements {
        Measurements {
            now: Duration::from_millis(now_ms),
            steps_per_s: 100.0,
            delivered_bytes_per_s: delivered,
            occupancy: vec![(Budget::GpuRing, fill)],
            hookpoints: loads.to_vec(),
        }
    }

    #[test]
    fn a_drain_cap_degrades_at_once_and_then_holds_still() {
        let loads: Vec<_> = (0..4).map(|i| load(i, 0, 1e6)).collect(); // 400 MB/s at 100 steps/s
        let settings = PlannerSettings { drain_bytes_per_s: Some(100e6), ..Default::default() };
        let mut p = Planner::new(settings);
        let first = p.plan(&measure(0, 0.0, 0.0, &loads));
        assert!(!first.is_empty() && first.iter().all(|c| c.budget == Some(Budget::DrainRate)));
        let proj = p.projection(&measure(0, 0.0, 0.0, &loads));
        assert!(proj.bytes_per_s <= 100e6 * DEGRADE_AT, "{proj:?}");
        for t in 1..200 {
            assert!(p.plan(&measure(t * 10, proj.bytes_per_s, 0.1, &loads)).is_empty(), "changed at tick {t}");
        }
    }

    #[test]
    fn saturation_cuts_to_what_was_delivered_and_room_recovers() {
        let loads: Vec<_> = (0..4).map(|i| load(i, 0, 1e6)).collect();
        let mut p = Planner::new(PlannerSettings::default());
        assert!(p.plan(&measure(0, 400e6, 0.1, &loads)).is_empty());
        // A sink takes only 100 MB/s: the ring fills.
        let cut = p.plan(&measure(10, 100e6, 0.9, &loads));
        assert!(cut.iter().all(|c| c.budget == Some(Budget::GpuRing)) && !cut.is_empty());
        assert!(p.rate_limit() <= 100e6);
        // The sink speeds up; the ring empties; the limit grows back in steps and the rungs recover to full.
        let mut t = 20;
        while p.rungs.iter().any(|&(_, r)| r != Rung::Full) && t < 60_000 {
            p.plan(&measure(t, p.projection(&measure(t, 0.0, 0.0, &loads)).bytes_per_s, 0.0, &loads));
            t += 10;
        }
        assert!(p.rungs.iter().all(|&(_, r)| r == Rung::Full), "no recovery by {t} ms: {:?}", p.rungs);
    }

    #[test]
    fn a_limit_cut_to_nothing_still_recovers() {
        // A sink that delivered nothing while the budget was full (stuck on one large record): the limit falls to
        // zero and every hookpoint goes off; once there is room, probing starts from a hundredth of production.
        let loads: Vec<_> = (0..4).map(|i| load(i, 0, 1e6)).collect();
        let mut p = Planner::new(PlannerSettings::default());
        p.plan(&measure(0, 400e6, 0.1, &loads));
        p.plan(&measure(10, 0.0, 0.9, &loads));
        assert_eq!(p.rate_limit(), 0.0);
        assert!((0..4).all(|i| p.rung(i) == Rung::Off));
        let mut t = 20;
        while (0..4).any(|i| p.rung(i) != Rung::Full) && t < 600_000 {
            p.plan(&measure(t, p.projection(&measure(t, 0.0, 0.0, &loads)).bytes_per_s, 0.0, &loads));
            t += 10;
        }
        assert!((0..4).all(|i| p.rung(i) == Rung::Full), "stuck at {:?} after {t} ms", p.rungs);
    }
}
