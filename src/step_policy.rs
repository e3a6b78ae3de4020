//! Full mode's step policy, apart from the session that applies it: how long the open step may wait for room in the
//! ring (`policy.full_deadline_ms`, or `policy.max_step_overhead` of the engine's step time without waits), and what a
//! step whose time ran out does (`policy.on_deadline`: the deadline error, or — `"degrade"` — the step goes on as in
//! best-effort, latched until the next step). Bookkeeping on the times the caller passes in (when a step began, the
//! session's wait total then), so it is tested here alone; the session measures, applies and logs.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ringscope_hookpoint::cuda::DeviceCaptureError;

use crate::config::OnDeadline;
use crate::Error;

/// One session's step policy (full mode; a best-effort session has one too, but never waits).
#[derive(Debug)]
pub(crate) struct StepPolicy {
    /// `policy.full_deadline_ms`: the most one step may wait.
    full_deadline: Duration,
    /// `policy.max_step_overhead` (full mode only): each step waits at most this share of the step time.
    max_step_overhead: Option<f64>,
    on_deadline: OnDeadline,
    watch: Mutex<StepWatch>,
    /// The step whose time ran out with `on_deadline = "degrade"`: its remaining captures do not wait.
    degraded: Mutex<Option<u64>>,
}

/// With `policy.max_step_overhead`: the engine's step time without waits (smoothed), and when the open step began.
#[derive(Debug, Default)]
struct StepWatch {
    /// When the open step began, and the session's wait total then.
    begun: Option<(Instant, Duration)>,
    /// Mean step time without waits (an exponential moving average, weight 0.2 for the newest step).
    work: Option<Duration>,
    /// The open step's wait budget.
    budget: Duration,
}

impl StepPolicy {
    pub(crate) fn new(full_deadline: Duration, max_step_overhead: Option<f64>, on_deadline: OnDeadline) -> Self {
        StepPolicy {
            full_deadline,
            max_step_overhead,
            on_deadline,
            watch: Mutex::new(StepWatch::default()),
            degraded: Mutex::new(None),
        }
    }

    /// A step begins at `now`, the session having waited `waited` in all so far. With `policy.max_step_overhead`,
    /// returns the new step's wait budget: that share of the recent step time without waits (the previous step's
    /// time less what it waited, smoothed), at most the full deadline — the whole deadline until a step time is known.
    /// `None` without it (every step may wait the full deadline).
    pub(crate) fn step_begins(&self, now: Instant, waited: Duration) -> Option<Duration> {
        let share = self.max_step_overhead?;
        let mut w = self.watch.lock();
        if let Some((at, waited_then)) = w.begun {
            let work = now.saturating_duration_since(at).saturating_sub(waited.saturating_sub(waited_then));
            w.work = Some(match w.work {
                Some(m) => m.mul_f64(0.8) + work.mul_f64(0.2),
                None => work,
            });
        }
        w.begun = Some((now, waited));
        w.budget = w.work.map_or(self.full_deadline, |m| m.mul_f64(share).min(self.full_deadline));
        Some(w.budget)
    }

    /// The open step's wait budget.
    pub(crate) fn budget(&self) -> Duration {
        match self.max_step_overhead {
            Some(_) => self.watch.lock().budget,
            None => self.full_deadline,
        }
    }

    /// What is left of the open step's budget, the session having waited `waited` in all so far (the full deadline
    /// without `policy.max_step_overhead`: each wait may take it).
    pub(crate) fn remaining(&self, waited: Duration) -> Duration {
        if self.max_step_overhead.is_none() {
            return self.full_deadline;
        }
        let w = self.watch.lock();
        let waited_then = w.begun.map_or(Duration::ZERO, |b| b.1);
        w.budget.saturating_sub(waited.saturating_sub(waited_then))
    }

    /// Whether a step whose time ran out goes on (`policy.on_deadline = "degrade"`).
    pub(crate) fn degrades(&self) -> bool {
        self.on_deadline == OnDeadline::Degrade
    }

    /// Step `step` ran out of time and goes on as in best-effort from now on; true the first time for that step (the
    /// caller then says so in the events table).
    pub(crate) fn latch(&self, step: u64) -> bool {
        self.degraded.lock().replace(step) != Some(step)
    }

    /// Whether step `step` ran out of time (its remaining captures do not wait).
    pub(crate) fn latched(&self, step: u64) -> bool {
        *self.degraded.lock() == Some(step)
    }

    /// What a device step's admission that ran out of time returns to the engine: with `"degrade"`, `Ok` (the step's
    /// captures are dropped on the device and counted as `deadline`; `degraded` is called to log it); otherwise the
    /// error. Every other result passes through.
    pub(crate) fn admitted(&self, result: Result<(), Error>, degraded: impl FnOnce()) -> Result<(), Error> {
        match result {
            Err(Error::DeviceCapture(DeviceCaptureError::Deadline { .. })) if self.degrades() => {
                degraded();
                Ok(())
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn deadline_error() -> Result<(), Error> {
        Err(Error::DeviceCapture(DeviceCaptureError::Deadline { step: "step 3".into(), needed: 4096, waited_ms: 5 }))
    }

    #[test]
    fn without_a_step_overhead_every_wait_may_take_the_full_deadline() {
        let p = StepPolicy::new(50 * MS, None, OnDeadline::Error);
        let t = Instant::now();
        assert_eq!(p.step_begins(t, Duration::ZERO), None);
        assert_eq!(p.step_begins(t + 10 * MS, 3 * MS), None);
        assert_eq!(p.budget(), 50 * MS);
        assert_eq!(p.remaining(40 * MS), 50 * MS);
    }

    #[test]
    fn the_budget_is_a_share_of_the_step_time_without_its_waits() {
        let p = StepPolicy::new(50 * MS, Some(0.1), OnDeadline::Error);
        let t = Instant::now();
        // No step time known yet: the whole deadline.
        assert_eq!(p.step_begins(t, Duration::ZERO), Some(50 * MS));
        // The first step took 10 ms, 4 of them waiting: 6 ms of work, a budget of 0.6 ms.
        assert_eq!(p.step_begins(t + 10 * MS, 4 * MS), Some(Duration::from_micros(600)));
        // The next took 16 ms without waiting: work 0.8 × 6 + 0.2 × 16 = 8 ms, budget 0.8 ms.
        let b = p.step_begins(t + 26 * MS, 4 * MS).unwrap();
        assert!((b.as_secs_f64() - 0.0008).abs() < 1e-9, "{b:?}");
        assert_eq!(p.budget(), b);
    }

    #[test]
    fn the_budget_never_exceeds_the_full_deadline() {
        let p = StepPolicy::new(5 * MS, Some(2.0), OnDeadline::Error);
        let t = Instant::now();
        p.step_begins(t, Duration::ZERO);
        assert_eq!(p.step_begins(t + 100 * MS, Duration::ZERO), Some(5 * MS));
    }

    #[test]
    fn what_remains_is_the_budget_less_this_steps_waits() {
        let p = StepPolicy::new(50 * MS, Some(0.5), OnDeadline::Degrade);
        let t = Instant::now();
        p.step_begins(t, 7 * MS);
        assert_eq!(p.step_begins(t + 20 * MS, 7 * MS), Some(10 * MS)); // the step began with 7 ms waited before it
        assert_eq!(p.remaining(7 * MS), 10 * MS);
        assert_eq!(p.remaining(10 * MS), 7 * MS);
        assert_eq!(p.remaining(30 * MS), Duration::ZERO); // spent (never negative)
    }

    #[test]
    fn the_degrade_latch_holds_for_its_step_only() {
        let p = StepPolicy::new(50 * MS, None, OnDeadline::Degrade);
        assert!(!p.latched(5));
        assert!(p.latch(5), "the first time is said");
        assert!(!p.latch(5), "once per step");
        assert!(p.latched(5) && !p.latched(6));
        assert!(p.latch(6));
        assert!(p.latched(6) && !p.latched(5));
    }

    #[test]
    fn a_late_admission_is_ok_only_when_degrading() {
        let degrade = StepPolicy::new(50 * MS, None, OnDeadline::Degrade);
        let mut said = 0;
        assert!(degrade.admitted(deadline_error(), || said += 1).is_ok());
        assert_eq!(said, 1);
        assert!(degrade.admitted(Ok(()), || said += 1).is_ok());
        let closed = degrade.admitted(Err(Error::Closed), || said += 1);
        assert!(matches!(closed, Err(Error::Closed)));
        assert_eq!(said, 1, "only a deadline is absorbed");

        let error = StepPolicy::new(50 * MS, None, OnDeadline::Error);
        let r = error.admitted(deadline_error(), || said += 1);
        assert!(matches!(r, Err(Error::DeviceCapture(DeviceCaptureError::Deadline { .. }))));
        assert_eq!(said, 1);
        assert!(!error.degrades() && degrade.degrades());
    }
}
