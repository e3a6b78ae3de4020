//! The policy manager at work in a session: at step boundaries (at most every [`TICK`]) it samples what the session
//! measures, turns the differences into rates ([`Measurements`]), asks the [`Planner`] for rung changes, applies them
//! to the hookpoints' controls (the CUDA backend uploads changed controls before the next step's captures, so
//! recorded graphs follow them without re-recording) and writes each change into the events table.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ringscope_hookpoint::{HookPoint, Registry};
use ringscope_policy::{Budget, HookPointLoad, Measurements, Planner, PlannerSettings, RungChange};

/// Least time between two decisions.
pub(crate) const TICK: Duration = Duration::from_millis(10);
/// Time constant of the smoothed loads and step rate: a window of one or two steps is noisy (a step more or less
/// in 10 ms doubles the rate), so estimates follow the measurements over about this long.
const SMOOTHING: Duration = Duration::from_millis(100);

/// What the session measured at one moment: cumulative counts and current fills.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    /// Steps begun so far, and the rows and requests (last rows) of their batches.
    pub steps: u64,
    pub rows: u64,
    pub requests: u64,
    /// Bytes the drain handed on so far.
    pub drained_bytes: u64,
    /// Bytes each destination took so far, by name (failed destinations left out).
    pub delivered: Vec<(String, u64)>,
    /// Memory budgets' use, as fractions.
    pub occupancy: Vec<(Budget, f64)>,
}

/// One hookpoint's smoothed load.
#[derive(Debug, Clone, Copy)]
struct Smoothed {
    produced_rows: u64,
    /// `None` until a whole window was seen.
    rows_per_step: Option<f64>,
}

/// The previous sample, and the smoothed loads.
struct State {
    planner: Planner,
    at: Instant,
    sample: Sample,
    loads: Vec<Option<Smoothed>>,
    last_row_fraction: f64,
    /// Smoothed steps per second (`None` before the first window).
    steps_per_s: Option<f64>,
    /// Smoothed delivered bytes per second (a sink writing one large record takes longer than a window).
    delivered_per_s: Option<f64>,
    /// Rows produced by all hookpoints at the last decision.
    produced_rows: u64,
}

/// The session's policy manager.
pub(crate) struct Governor {
    state: Mutex<State>,
    started: Instant,
    priorities: Vec<(String, i32)>,
    /// Whether the downcast rung is offered (to hookpoints whose dtype can be downcast).
    downcast: bool,
}

impl Governor {
    /// A governor with every hookpoint on the full rung. `priorities` by hookpoint name (others: 0).
    pub(crate) fn new(settings: PlannerSettings, priorities: Vec<(String, i32)>, downcast: bool) -> Governor {
        let now = Instant::now();
        Governor {
            state: Mutex::new(State {
                planner: Planner::new(settings),
                at: now,
                sample: Sample::default(),
                loads: Vec::new(),
                last_row_fraction: 1.0,
                steps_per_s: None,
                delivered_per_s: None,
                produced_rows: 0,
            }),
            started: now,
            priorities,
            downcast,
        }
    }

    /// Decides, if a tick has passed since the last decision: `sample` is what the session measures now. Returns
    /// the changes made (already applied to the controls), with the hookpoint each concerns.
    pub(crate) fn tick(
        &self,
        registry: &Registry,
        sample: impl FnOnce() -> Sample,
    ) -> Vec<(std::sync::Arc<HookPoint>, RungChange)> {
        let Some(mut st) = self.state.try_lock() else { return Vec::new() };
        let now = Instant::now();
        let elapsed = now.duration_since(st.at);
        if elapsed < TICK {
            return Vec::new();
        }
        let sample = sample();
        let mut steps = sample.steps.saturating_sub(st.sample.steps);
        if steps == 0 {
            // No step counted, yet captures may have run: steps begun inside a CUDA graph are numbered on the device
            // only. Then the window is taken as one step (loads per window, the step rate one per window: their
            // product, the byte rate the planner weighs, is the same). Idle, there is nothing to decide.
            let produced: u64 = registry.all().iter().map(|h| h.counters().snapshot().produced.rows).sum();
            if produced == st.produced_rows {
                return Vec::new();
            }
            steps = 1;
        }
        let secs = elapsed.as_secs_f64();
        // The newest window's weight: its share of the time constant.
        let alpha = 1.0 - (-secs / SMOOTHING.as_secs_f64()).exp();
        let smooth = |old: f64, new: f64| old + alpha * (new - old);
        let rows = sample.rows.saturating_sub(st.sample.rows);
        let requests = sample.requests.saturating_sub(st.sample.requests);
        if rows > 0 {
            let f = (requests as f64 / rows as f64).clamp(0.0, 1.0);
            st.last_row_fraction = smooth(st.last_row_fraction, f);
        }
        let rate = steps as f64 / secs;
        let steps_per_s = st.steps_per_s.map_or(rate, |old| smooth(old, rate));
        st.steps_per_s = Some(steps_per_s);
        let ladder = st.planner.settings().ladder.clone();
        let hookpoints = registry.all();
        if st.loads.len() < hookpoints.len() {
            st.loads.resize(hookpoints.len(), None);
        }
        let mut loads = Vec::with_capacity(hookpoints.len());
        for hp in &hookpoints {
            let produced = hp.counters().snapshot().produced.rows;
            let keep = hp.control().keep();
            // Produced rows are counted after the row selection: undo the rung's own narrowing to get the rows the
            // hookpoint makes on the full rung.
            let narrowed = keep.last_row && *hp.control().selection() == ringscope_hookpoint::RowSelection::All;
            let lrf = st.last_row_fraction.max(1e-6);
            let slot = &mut st.loads[hp.id() as usize];
            let Some(seen) = *slot else {
                // First sight: the window starts now.
                *slot = Some(Smoothed { produced_rows: produced, rows_per_step: None });
                continue;
            };
            let delta = produced.saturating_sub(seen.produced_rows);
            let per_step = delta as f64 / steps as f64 / if narrowed { lrf } else { 1.0 };
            let rows_per_step = seen.rows_per_step.map_or(per_step, |old| smooth(old, per_step));
            *slot = Some(Smoothed { produced_rows: produced, rows_per_step: Some(rows_per_step) });
            if rows_per_step == 0.0 {
                // Not captured lately: nothing to plan for.
                continue;
            }
            let spec = hp.spec();
            let row_bytes = spec.row_bytes() as f64;
            let downcast_ratio = (self.downcast)
                .then(|| spec.dtype.downcast())
                .flatten()
                .map(|d| d.row_bytes(spec.row_width as u64) as f64 / row_bytes);
            loads.push(HookPointLoad {
                id: hp.id(),
                priority: self.priorities.iter().find(|(n, _)| *n == spec.name).map_or(0, |p| p.1),
                bytes_per_step: rows_per_step * row_bytes,
                rows_per_step,
                last_row_fraction: st.last_row_fraction,
                downcast_ratio,
            });
        }
        // What the path delivered: the slowest destination present in both samples (a new subscription has no
        // rate yet), or the drain itself when there is none.
        let slowest = sample
            .delivered
            .iter()
            .filter_map(|(name, now)| {
                let before = st.sample.delivered.iter().find(|(n, _)| n == name)?.1;
                Some(now.saturating_sub(before))
            })
            .min();
        let delivered = slowest.unwrap_or(sample.drained_bytes.saturating_sub(st.sample.drained_bytes));
        let delivered = delivered as f64 / secs;
        let delivered_per_s = st.delivered_per_s.map_or(delivered, |old| smooth(old, delivered));
        st.delivered_per_s = Some(delivered_per_s);
        let m = Measurements {
            now: now.duration_since(self.started),
            steps_per_s,
            delivered_bytes_per_s: delivered_per_s,
            occupancy: sample.occupancy.clone(),
            hookpoints: loads,
        };
        st.at = now;
        st.sample = sample;
        st.produced_rows = hookpoints.iter().map(|h| h.counters().snapshot().produced.rows).sum();
        let changes = st.planner.plan(&m);
        drop(st);
        changes
            .into_iter()
            .filter_map(|c| {
                let hp = hookpoints.iter().find(|h| h.id() == c.hookpoint)?.clone();
                hp.control().set_keep(ladder.keep(c.to));
                Some((hp, c))
            })
            .collect()
    }
}
