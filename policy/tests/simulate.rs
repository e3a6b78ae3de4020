//! The policy manager's promises, held against a simulator of producer, ring, drain, backlog and sink
//! (`ringscope_policy::simulate`): full mode never loses and stalls at most the deadline; best-effort never stalls,
//! never exceeds a budget, keeps within 10% of the most any choice of rungs could keep under the budget, and does
//! not oscillate under a steady load.

use std::time::Duration;

use ringscope_policy::plan::best_kept_fraction;
use ringscope_policy::simulate::{describe, monotone, run, AtDeadline, Outcome, Scenario};
use ringscope_policy::{HookPointLoad, Ladder, Mode, PlannerSettings};

const STEP: Duration = Duration::from_millis(10);
const STEPS: u64 = 3000;
/// Steps before the window the kept fraction is judged on (the planner has settled by then).
const WARMUP: u64 = 1000;

/// A 1B-shape model's residual stream: `layers` hookpoints of bf16 rows of width 2048, `rows` rows per step of which
/// `requests` are last rows.
fn model(layers: u32, rows: f64, requests: f64) -> Vec<HookPointLoad> {
    (0..layers)
        .map(|id| HookPointLoad {
            id,
            priority: 0,
            bytes_per_step: rows * 4096.0,
            rows_per_step: rows,
            last_row_fraction: requests / rows,
            downcast_ratio: Some((2048.0 + 4.0) / 4096.0),
        })
        .collect()
}

fn production(s: &Scenario) -> f64 {
    s.hookpoints.iter().map(|h| h.bytes_per_step).sum::<f64>() / STEP.as_secs_f64()
}

fn scenario(mode: Mode, hookpoints: Vec<HookPointLoad>) -> Scenario {
    Scenario {
        mode,
        hookpoints,
        step_time: STEP,
        ring_bytes: 2e9,
        backlog_bytes: 4e9,
        sink_bytes_per_s: f64::INFINITY,
        deadline: Duration::from_millis(50),
        at_deadline: AtDeadline::Error,
        steps: STEPS,
        settings: PlannerSettings { dwell: Duration::from_millis(200), ..Default::default() },
        planner: true,
        plan_every: 1,
        load_change: None,
        noise: 0.0,
    }
}

/// The best kept fraction of rows under `bytes_per_s` (the yardstick).
fn best(s: &Scenario, bytes_per_s: f64) -> f64 {
    best_kept_fraction(&s.settings.ladder, &s.hookpoints, bytes_per_s * STEP.as_secs_f64(), 4000)
}

/// Best-effort's promises after warm-up: no drop, no stall, within 10% of the best, no change after settling.
fn assert_best_effort_settles(s: &Scenario, o: &Outcome, sustainable: f64) {
    let best = best(s, sustainable);
    assert_eq!(o.total_stall, Duration::ZERO);
    assert!(o.max_ring <= s.ring_bytes && o.max_backlog <= s.backlog_bytes);
    assert_eq!(o.window_dropped_rows, 0.0, "drops after warm-up; changes:\n{}", describe(&o.changes));
    let kept = o.window_kept_fraction();
    assert!(kept >= 0.9 * best, "kept {kept:.4} of rows, best under the budget {best:.4}\n{}", describe(&o.changes));
    // (Rows still queued at the end count as kept: a backlog that grew in the window can lift this a little.)
    assert!(kept <= best * 1.01 + 1e-9, "kept {kept} more than the best {best}: the yardstick is wrong");
    assert_eq!(o.changes_from(WARMUP), 0, "rungs still moving after warm-up:\n{}", describe(&o.changes));
    assert!(monotone(&o.changes), "a hookpoint went down and back up under a steady load:\n{}", describe(&o.changes));
}

#[test]
fn best_effort_under_a_drain_cap_keeps_close_to_the_best() {
    for (layers, rows, requests, share) in
        [(16, 64.0, 64.0, 0.3), (16, 4096.0, 2.0, 0.5), (32, 8.0, 8.0, 0.05), (1, 512.0, 4.0, 0.7), (3, 64.0, 8.0, 0.2)]
    {
        let mut s = scenario(Mode::BestEffort, model(layers, rows, requests));
        let cap = production(&s) * share;
        s.settings.drain_bytes_per_s = Some(cap);
        let o = run(&s, WARMUP);
        assert_best_effort_settles(&s, &o, cap);
    }
}

#[test]
fn best_effort_with_a_slow_sink_finds_its_speed_and_probes_ever_more_rarely() {
    // A sink that keeps up is partly idle, so its speed is only seen while it is saturated: the planner learns the
    // limit from what was delivered then, and probes upwards now and then in case the sink got faster. Each probe
    // that overshoots doubles the wait before the next one, so under a steady load the rungs settle (they move
    // at exponentially spaced times, not back and forth every few steps).
    let mut s = scenario(Mode::BestEffort, model(16, 256.0, 16.0));
    s.sink_bytes_per_s = production(&s) * 0.4;
    s.backlog_bytes = 1e9;
    s.steps = 60_000; // ten simulated minutes
    let o = run(&s, WARMUP);
    assert!(o.changes.iter().any(|(_, c)| c.budget.is_some()), "never degraded");
    assert_eq!(o.total_stall, Duration::ZERO);
    assert!(o.max_backlog <= s.backlog_bytes);
    assert_eq!(o.window_dropped_rows, 0.0, "drops after warm-up:\n{}", describe(&o.changes));
    let best = best(&s, s.sink_bytes_per_s);
    let kept = o.window_kept_fraction();
    assert!(kept >= 0.9 * best, "kept {kept:.4}, best {best:.4}");
    let mut probes: Vec<u64> = o.changes.iter().filter(|(_, c)| c.budget.is_none()).map(|(step, _)| *step).collect();
    probes.dedup_by(|a, b| *a - *b < 100); // one probe moves several hookpoints over a few ticks
    assert!((2..=10).contains(&probes.len()), "{} probes in ten minutes: {probes:?}", probes.len());
    let gaps: Vec<u64> = probes.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.last().unwrap() >= &(4 * gaps[0]), "probes not backing off: {probes:?}");
}

#[test]
fn best_effort_with_a_small_ring_never_exceeds_it() {
    let mut s = scenario(Mode::BestEffort, model(16, 2048.0, 8.0));
    s.ring_bytes = production(&s) * STEP.as_secs_f64() * 1.5; // one and a half steps
    let cap = production(&s) * 0.25;
    s.settings.drain_bytes_per_s = Some(cap);
    let o = run(&s, WARMUP);
    assert_best_effort_settles(&s, &o, cap);
}

#[test]
fn best_effort_does_not_flap_on_noisy_measurements() {
    let mut s = scenario(Mode::BestEffort, model(16, 128.0, 16.0));
    s.settings.drain_bytes_per_s = Some(production(&s) * 0.35);
    s.noise = 0.05;
    let o = run(&s, WARMUP);
    assert_best_effort_settles(&s, &o, production(&s) * 0.35);
}

#[test]
fn best_effort_recovers_when_the_load_falls() {
    let mut s = scenario(Mode::BestEffort, model(16, 128.0, 16.0));
    let cap = production(&s) * 0.3;
    s.settings.drain_bytes_per_s = Some(cap);
    s.load_change = Some((1000, 0.25)); // production falls below the cap
    let o = run(&s, 2000);
    assert!(o.changes.iter().any(|(step, c)| *step >= 1000 && c.budget.is_none()), "no recovery");
    assert_eq!(o.window_kept_fraction(), 1.0, "all rows kept again:\n{}", describe(&o.changes));
    assert_eq!(o.window_dropped_rows, 0.0);
}

#[test]
fn best_effort_recovers_when_a_slow_sink_speeds_up_again() {
    // The limit learnt from a saturated sink grows back while the budgets have room.
    let mut s = scenario(Mode::BestEffort, model(16, 128.0, 16.0));
    s.sink_bytes_per_s = production(&s) * 0.5;
    s.backlog_bytes = 0.5e9;
    let slow = run(&s, WARMUP);
    assert!(slow.window_kept_fraction() < 0.6);
    s.sink_bytes_per_s = f64::INFINITY;
    s.load_change = Some((0, 1.0));
    // No budget pressure from the start: rungs never leave full.
    let fast = run(&s, 0);
    assert!(fast.changes.is_empty());
    assert_eq!(fast.window_kept_fraction(), 1.0);
}

#[test]
fn full_mode_never_loses_and_stalls_at_most_the_deadline() {
    for share in [0.5, 0.9, 1.5] {
        let mut s = scenario(Mode::Full, model(16, 256.0, 16.0));
        s.ring_bytes = production(&s) * STEP.as_secs_f64() * 4.0;
        s.settings.drain_bytes_per_s = Some(production(&s) * share);
        s.deadline = Duration::from_secs(1);
        let o = run(&s, 0);
        assert_eq!(o.deadline_rows + o.ring_full_rows + o.backlog_rows, 0.0, "share {share}");
        assert_eq!(o.sampled_out_rows, 0.0);
        assert!(o.max_stall <= s.deadline);
        assert!((o.exported_rows + o.in_flight_rows - o.produced_rows).abs() < 1e-6 * o.produced_rows);
        assert!(o.changes.is_empty(), "full mode is lossless: no rung changes");
        if share < 1.0 {
            // The engine slows to the drain: each step waits about (1/share − 1) of a step.
            let per_step = o.total_stall.as_secs_f64() / STEPS as f64;
            let want = STEP.as_secs_f64() * (1.0 / share - 1.0);
            assert!((per_step - want).abs() < 0.1 * want, "stall {per_step} s/step, expected about {want}");
        } else {
            assert_eq!(o.total_stall, Duration::ZERO);
        }
    }
}

#[test]
fn full_mode_with_a_stuck_sink_ends_well_either_way() {
    for at in [AtDeadline::Error, AtDeadline::Degrade] {
        let mut s = scenario(Mode::Full, model(4, 64.0, 4.0));
        s.sink_bytes_per_s = 0.0;
        s.backlog_bytes = 1e6;
        s.ring_bytes = 5e6;
        s.steps = 200;
        s.at_deadline = at;
        let o = run(&s, 0);
        assert!(o.max_stall <= s.deadline);
        // Every row produced is exported, dropped at the deadline or still held: nothing unaccounted.
        let accounted = o.exported_rows + o.deadline_rows + o.in_flight_rows + o.sampled_out_rows;
        assert!((accounted - o.produced_rows).abs() < 1e-6 * o.produced_rows, "{o:?}");
        assert!(o.deadline_rows > 0.0);
        assert_eq!(o.ring_full_rows + o.backlog_rows, 0.0);
    }
}

#[test]
fn the_yardstick_is_the_best_choice_of_rungs() {
    // Two hookpoints, budget for exactly one at full: the best keeps half the rows.
    let s = scenario(Mode::BestEffort, model(2, 100.0, 100.0));
    let per_step = s.hookpoints[0].bytes_per_step;
    let b = best_kept_fraction(&Ladder::new(8), &s.hookpoints, per_step, 1000);
    assert!((0.499..=0.5).contains(&b), "{b}");
    // Budget for one and a half: full + every 2, or every 4 + ... — three quarters.
    let b = best_kept_fraction(&Ladder::new(8), &s.hookpoints, per_step * 1.5, 1000);
    assert!((0.74..=0.75).contains(&b), "{b}");
}
