//! A simulator of the path a record takes — producer (the engine's steps), device ring, drain (with its byte-rate
//! cap), host backlog, sink — driven by the [`Planner`], so that what the policy manager promises can be tested
//! without a GPU: full mode never loses and stalls at most the deadline; best-effort never stalls, never exceeds a
//! budget, keeps close to the most the budget allows, and does not oscillate under a steady load.
//!
//! Time moves in steps of the engine. At each step's start the step's records are admitted to the ring (full mode:
//! the engine waits for room up to the deadline; best-effort: what does not fit is dropped); during the step the
//! drain moves bytes from the ring to the backlog at most at its cap (in full mode only as far as the backlog has
//! room), and the sink writes from the backlog at its speed.
//!
//! Rows are counted as the planner counts them: a downcast row weighs its byte ratio (about half a bf16 row), the
//! rest of it is tallied with the rows sampled out.

use std::time::Duration;

use crate::plan::{Budget, HookPointLoad, Measurements, Planner, PlannerSettings, RungChange};
use crate::Mode;

/// What happens at the full-mode deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtDeadline {
    /// The step's records are dropped (`deadline`) and the engine hears an error.
    Error,
    /// The step runs as in best-effort: what fits goes in, the rest is dropped (`deadline`).
    Degrade,
}

/// One simulated run.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Full or best-effort.
    pub mode: Mode,
    /// What each hookpoint produces per step at full rung.
    pub hookpoints: Vec<HookPointLoad>,
    /// Step time of the engine without any wait.
    pub step_time: Duration,
    /// Device ring bytes.
    pub ring_bytes: f64,
    /// Host backlog budget (bytes queued for the sink).
    pub backlog_bytes: f64,
    /// Bytes per second the sink writes.
    pub sink_bytes_per_s: f64,
    /// Full mode: the longest a step waits for room.
    pub deadline: Duration,
    /// Full mode: what happens then.
    pub at_deadline: AtDeadline,
    /// Steps to run.
    pub steps: u64,
    /// The planner's settings (its drain cap is also the drain's cap).
    pub settings: PlannerSettings,
    /// Whether the planner runs (best-effort) — off, the rungs stay full.
    pub planner: bool,
    /// The planner decides every this many steps.
    pub plan_every: u64,
    /// From this step on, production is multiplied by the factor (a load change).
    pub load_change: Option<(u64, f64)>,
    /// Relative noise (±) on the loads the planner is told, deterministic.
    pub noise: f64,
}

/// What a simulated run did.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Rows produced (all rungs' rows counted at full: what the engine computed).
    pub produced_rows: f64,
    /// Rows the rungs in force sampled out (or thinned).
    pub sampled_out_rows: f64,
    /// Rows written by the sink.
    pub exported_rows: f64,
    /// Rows dropped because the ring was full (best-effort).
    pub ring_full_rows: f64,
    /// Rows dropped at the full-mode deadline.
    pub deadline_rows: f64,
    /// Rows dropped because the backlog was full.
    pub backlog_rows: f64,
    /// Rows still in the ring or backlog at the end.
    pub in_flight_rows: f64,
    /// Longest wait of one step.
    pub max_stall: Duration,
    /// All waits together.
    pub total_stall: Duration,
    /// Highest ring fill, bytes.
    pub max_ring: f64,
    /// Highest backlog, bytes.
    pub max_backlog: f64,
    /// Every rung change, with the step it took effect at.
    pub changes: Vec<(u64, RungChange)>,
    /// Per step from `window_start`: rows produced and rows exported-or-in-flight (kept).
    pub window_produced_rows: f64,
    /// Rows kept (not sampled out, not dropped) by steps at or after the window start.
    pub window_kept_rows: f64,
    /// Rows dropped (any reason) by steps at or after the window start.
    pub window_dropped_rows: f64,
}

impl Outcome {
    /// Rows kept by steps in the window, as a fraction of the rows they produced.
    pub fn window_kept_fraction(&self) -> f64 {
        if self.window_produced_rows > 0.0 {
            self.window_kept_rows / self.window_produced_rows
        } else {
            1.0
        }
    }

    /// Rung changes at or after `step`.
    pub fn changes_from(&self, step: u64) -> usize {
        self.changes.iter().filter(|(s, _)| *s >= step).count()
    }
}

/// Bytes and rows of one record in the simulated ring or backlog (rows per byte is constant per record).
#[derive(Debug, Clone, Copy)]
struct Chunk {
    bytes: f64,
    rows: f64,
}

/// A FIFO of chunks that can be drained partially (a record half-copied is still in flight).
#[derive(Debug, Default)]
struct Fifo {
    chunks: std::collections::VecDeque<Chunk>,
    bytes: f64,
}

impl Fifo {
    fn push(&mut self, c: Chunk) {
        self.bytes += c.bytes;
        self.chunks.push_back(c);
    }

    /// Takes up to `bytes` from the front; returns the chunks (or parts) taken.
    fn take(&mut self, mut bytes: f64) -> Vec<Chunk> {
        let mut out = Vec::new();
        while bytes > 0.0 {
            let Some(front) = self.chunks.front_mut() else { break };
            if front.bytes <= bytes {
                bytes -= front.bytes;
                self.bytes -= front.bytes;
                out.push(*front);
                self.chunks.pop_front();
            } else {
                let part = Chunk { bytes, rows: front.rows * bytes / front.bytes };
                front.bytes -= bytes;
                front.rows -= part.rows;
                self.bytes -= bytes;
                out.push(part);
                bytes = 0.0;
            }
        }
        if self.chunks.is_empty() {
            self.bytes = 0.0;
        }
        out
    }

    fn rows(&self) -> f64 {
        self.chunks.iter().map(|c| c.rows).sum()
    }
}

/// A deterministic pseudo-random number in [-1, 1] for (a, b) (the load noise).
fn jitter(a: u64, b: u64) -> f64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// Runs `s`; rows produced by steps at or after `window_start` are also tallied on their own.
pub fn run(s: &Scenario, window_start: u64) -> Outcome {
    let mut planner = Planner::new(s.settings.clone());
    let ladder = s.settings.ladder.clone();
    let cap = s.settings.drain_bytes_per_s.unwrap_or(f64::INFINITY);
    let mut ring = Fifo::default();
    let mut backlog = Fifo::default();
    let mut out = Outcome::default();
    let mut now = Duration::ZERO;
    // The planner's window: steps, time, bytes delivered by the sink.
    let (mut win_steps, mut win_time, mut win_written) = (0u64, Duration::ZERO, 0.0);
    let dt_sub = s.step_time / 4;

    // Moves bytes for `dt`: sink first (frees backlog), then the drain.
    let flow =
        |dt: Duration, ring: &mut Fifo, backlog: &mut Fifo, out: &mut Outcome, written: &mut f64, window: bool| {
            let secs = dt.as_secs_f64();
            for c in backlog.take(s.sink_bytes_per_s * secs) {
                out.exported_rows += c.rows;
                *written += c.bytes;
            }
            let mut room = cap * secs;
            if s.mode == Mode::Full {
                room = room.min((s.backlog_bytes - backlog.bytes).max(0.0));
            }
            for c in ring.take(room) {
                if s.mode == Mode::BestEffort && backlog.bytes + c.bytes > s.backlog_bytes {
                    out.backlog_rows += c.rows;
                    if window {
                        // Kept when it entered the ring; lost now.
                        out.window_kept_rows -= c.rows;
                        out.window_dropped_rows += c.rows;
                    }
                    continue;
                }
                backlog.push(c);
            }
        };

    for step in 0..s.steps {
        let factor = match s.load_change {
            Some((from, f)) if step >= from => f,
            _ => 1.0,
        };
        let loads: Vec<HookPointLoad> = s
            .hookpoints
            .iter()
            .map(|h| HookPointLoad {
                bytes_per_step: h.bytes_per_step * factor,
                rows_per_step: h.rows_per_step * factor,
                ..*h
            })
            .collect();

        if s.planner && s.mode == Mode::BestEffort && step % s.plan_every.max(1) == 0 && win_steps > 0 {
            let secs = win_time.as_secs_f64().max(1e-9);
            let told: Vec<HookPointLoad> = loads
                .iter()
                .map(|h| {
                    let n = 1.0 + s.noise * jitter(step, h.id as u64);
                    HookPointLoad { bytes_per_step: h.bytes_per_step * n, rows_per_step: h.rows_per_step * n, ..*h }
                })
                .collect();
            let m = Measurements {
                now,
                steps_per_s: win_steps as f64 / secs,
                delivered_bytes_per_s: win_written / secs,
                occupancy: vec![
                    (Budget::GpuRing, ring.bytes / s.ring_bytes),
                    (Budget::HostBacklog, backlog.bytes / s.backlog_bytes),
                ],
                hookpoints: told,
            };
            for c in planner.plan(&m) {
                out.changes.push((step, c));
            }
            (win_steps, win_time, win_written) = (0, Duration::ZERO, 0.0);
        }

        // This step's records.
        let mut records = Vec::new();
        for h in &loads {
            let rung = planner.rung(h.id);
            let k = ladder.keep(rung);
            out.produced_rows += h.rows_per_step;
            if step >= window_start {
                out.window_produced_rows += h.rows_per_step;
            }
            let sampled = !k.off && step % k.every_n as u64 == 0;
            // Row-equivalents: a downcast row counts its byte ratio (the rest of it goes to `sampled_out`), as the
            // planner's yardstick counts it.
            let dc = if k.downcast { h.downcast_ratio.unwrap_or(1.0) } else { 1.0 };
            let rows =
                if sampled { h.rows_per_step * if k.last_row { h.last_row_fraction } else { 1.0 } * dc } else { 0.0 };
            out.sampled_out_rows += h.rows_per_step - rows;
            if rows > 0.0 {
                let bytes = h.bytes_per_step * rows / h.rows_per_step;
                records.push(Chunk { bytes, rows });
            }
        }
        let step_bytes: f64 = records.iter().map(|c| c.bytes).sum();

        // Admission.
        let mut stall = Duration::ZERO;
        let mut best_effort_step = s.mode == Mode::BestEffort;
        if s.mode == Mode::Full {
            while ring.bytes + step_bytes > s.ring_bytes && stall < s.deadline {
                let dt = dt_sub.min(s.deadline - stall);
                flow(dt, &mut ring, &mut backlog, &mut out, &mut win_written, step >= window_start);
                stall += dt;
            }
            if ring.bytes + step_bytes > s.ring_bytes {
                match s.at_deadline {
                    AtDeadline::Error => {
                        let rows: f64 = records.iter().map(|c| c.rows).sum();
                        out.deadline_rows += rows;
                        if step >= window_start {
                            out.window_dropped_rows += rows;
                        }
                        records.clear();
                    }
                    AtDeadline::Degrade => best_effort_step = true,
                }
            }
        }
        for c in records {
            if ring.bytes + c.bytes <= s.ring_bytes {
                ring.push(c);
                if step >= window_start {
                    out.window_kept_rows += c.rows;
                }
            } else {
                debug_assert!(best_effort_step);
                if s.mode == Mode::Full {
                    out.deadline_rows += c.rows;
                } else {
                    out.ring_full_rows += c.rows;
                }
                if step >= window_start {
                    out.window_dropped_rows += c.rows;
                }
            }
        }
        out.max_ring = out.max_ring.max(ring.bytes);
        out.max_stall = out.max_stall.max(stall);
        out.total_stall += stall;

        flow(s.step_time, &mut ring, &mut backlog, &mut out, &mut win_written, step >= window_start);
        out.max_backlog = out.max_backlog.max(backlog.bytes);
        now += stall + s.step_time;
        win_time += stall + s.step_time;
        win_steps += 1;
    }
    out.in_flight_rows = ring.rows() + backlog.rows();
    out
}

/// Rung names of a planner's hookpoints (for messages).
pub fn describe(changes: &[(u64, RungChange)]) -> String {
    changes
        .iter()
        .map(|(step, c)| format!("step {step}: hookpoint {} {} -> {}", c.hookpoint, c.from, c.to))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `true` when no rung change in `changes` reverses an earlier one of the same hookpoint (no flapping).
pub fn monotone(changes: &[(u64, RungChange)]) -> bool {
    let mut seen: Vec<(u32, bool)> = Vec::new();
    for (_, c) in changes {
        let down = c.to > c.from;
        match seen.iter_mut().find(|(h, _)| *h == c.hookpoint) {
            Some((_, d)) if *d != down => return false,
            Some(_) => {}
            None => seen.push((c.hookpoint, down)),
        }
    }
    true
}
