//! Per-request aggregation of one probe's token scores: alerts and coverage.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use ringscope_ring::RowMeta;

use crate::spec::{Action, Aggregation, Probe};

/// An aggregated score reached its threshold. Raised once per request, probe and output.
#[derive(Debug, Clone, PartialEq)]
pub struct Alert {
    /// The probe.
    pub probe: Arc<str>,
    /// The output (row of the weight matrix).
    pub output: u32,
    /// The output's label (its index when the probe names none).
    pub label: Arc<str>,
    /// The request.
    pub request_id: u64,
    /// The step of the token that made the aggregate reach the threshold.
    pub step: u64,
    /// That token's position in its request.
    pub position: u32,
    /// The aggregated score that reached the threshold.
    pub score: f32,
    /// That token's own score.
    pub token_score: f32,
    /// The threshold.
    pub threshold: f32,
    /// What the probe does about it.
    pub action: Action,
}

/// One scored token: what a probe's scores table holds per row.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenScore {
    /// The step.
    pub step: u64,
    /// The request.
    pub request_id: u64,
    /// The token's position in its request.
    pub position: u32,
    /// The token's `K` scores.
    pub scores: Vec<f32>,
}

/// What a probe saw of a request, and what it did not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Coverage {
    /// Rows of the request the probe scored.
    pub scored: u64,
    /// Of those, rows with a NaN score (reported, never aggregated or alerted on).
    pub nan: u64,
    /// Rows the engine ran for the request, as its step batches said (for steps begun inside a CUDA graph: as the
    /// engine noted them from the host); 0 when no batch was reported: then the span of the positions scored stands
    /// in.
    pub expected: u64,
    /// Rows of the request the probe did not see: sampled out, dropped, cut by a policy rung, not selected.
    pub unobserved: u64,
    /// Rows of the request the engine did not compute because its prefix cache held them (a prompt prefix shared
    /// with an earlier request): never seen by any probe — not "safe", unobserved, and not in `expected`.
    pub cached: u64,
}

/// A request as one probe saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestReport {
    /// The probe.
    pub probe: Arc<str>,
    /// The request.
    pub request_id: u64,
    /// The aggregated score per output (NaN while no row was scored).
    pub scores: Vec<f32>,
    /// Whether each output has alerted.
    pub alerted: Vec<bool>,
    /// What was and was not observed.
    pub coverage: Coverage,
    /// The last step a row of the request was scored at.
    pub last_step: Option<u64>,
}

#[derive(Debug)]
struct RequestState {
    rows: u64,
    nan: u64,
    expected: u64,
    cached: u64,
    positions: Option<(u32, u32)>,
    last_step: Option<u64>,
    /// Per output: scores aggregated (non-NaN tokens only).
    count: Vec<u64>,
    value: Vec<f32>,
    sum: Vec<f64>,
    window: Vec<VecDeque<f32>>,
    alerted: u64,
    touched: u64,
}

impl RequestState {
    fn new(k: usize) -> RequestState {
        RequestState {
            rows: 0,
            nan: 0,
            expected: 0,
            cached: 0,
            positions: None,
            last_step: None,
            count: vec![0; k],
            value: vec![f32::NAN; k],
            sum: vec![0.0; k],
            window: Vec::new(),
            alerted: 0,
            touched: 0,
        }
    }

    fn coverage(&self) -> Coverage {
        let span = self.positions.map_or(0, |(lo, hi)| (hi - lo) as u64 + 1);
        let expected = if self.expected > 0 { self.expected } else { span };
        Coverage {
            scored: self.rows,
            nan: self.nan,
            expected: self.expected,
            unobserved: expected.saturating_sub(self.rows),
            cached: self.cached,
        }
    }
}

/// One probe's per-request state: aggregates token scores, raises alerts, keeps coverage.
///
/// Memory is bounded: past `max_requests` live requests, the least recently scored are forgotten (counted in
/// [`Monitor::evicted`]); an engine that reports finished requests ([`Monitor::finish`]) never needs that.
#[derive(Debug)]
pub struct Monitor {
    probe: Arc<str>,
    labels: Vec<Arc<str>>,
    aggregation: Aggregation,
    thresholds: Vec<f32>,
    outputs: usize,
    min_tokens: u64,
    action: Action,
    requests: HashMap<u64, RequestState>,
    max_requests: usize,
    tick: u64,
    evicted: u64,
    rows: u64,
    nan_rows: u64,
    no_request_rows: u64,
    alerts: u64,
}

impl Monitor {
    /// A monitor for `probe`, keeping at most `max_requests` (≥ 1) requests.
    pub fn new(probe: &Probe, max_requests: usize) -> Monitor {
        Monitor {
            probe: probe.name().into(),
            labels: (0..probe.outputs()).map(|k| probe.label(k).into()).collect(),
            aggregation: probe.aggregation(),
            thresholds: probe.thresholds().to_vec(),
            outputs: probe.outputs(),
            min_tokens: probe.min_tokens() as u64,
            action: probe.action(),
            requests: HashMap::new(),
            max_requests: max_requests.max(1),
            tick: 0,
            evicted: 0,
            rows: 0,
            nan_rows: 0,
            no_request_rows: 0,
            alerts: 0,
        }
    }

    /// The probe's name.
    pub fn probe(&self) -> &Arc<str> {
        &self.probe
    }

    fn state(&mut self, request: u64) -> &mut RequestState {
        self.tick += 1;
        if !self.requests.contains_key(&request) && self.requests.len() >= self.max_requests {
            self.evict();
        }
        let k = self.outputs;
        let s = self.requests.entry(request).or_insert_with(|| RequestState::new(k));
        s.touched = self.tick;
        s
    }

    /// Forgets the least recently touched eighth of the requests (at least one).
    fn evict(&mut self) {
        let mut ticks: Vec<u64> = self.requests.values().map(|s| s.touched).collect();
        let n = (ticks.len() / 8).max(1);
        let (_, cut, _) = ticks.select_nth_unstable(n - 1);
        let cut = *cut;
        let before = self.requests.len();
        self.requests.retain(|_, s| s.touched > cut);
        self.evicted += (before - self.requests.len()) as u64;
    }

    /// The engine ran `rows` rows of `request` in a step (its batch descriptor): the coverage denominator.
    pub fn expect(&mut self, request: u64, rows: u64) {
        if request == RowMeta::NO_REQUEST {
            return; // rows of no request (ended sequences in a graph step): nobody's coverage
        }
        self.state(request).expected += rows;
    }

    /// The engine took `rows` rows of `request` from its prefix cache instead of computing them: counted in the
    /// request's [`Coverage::cached`] (rows of no request are ignored).
    pub fn cached(&mut self, request: u64, rows: u64) {
        if request == RowMeta::NO_REQUEST {
            return;
        }
        self.state(request).cached += rows;
    }

    /// One scored row: aggregates its `K` scores into its request and pushes the alerts it raises onto `alerts`.
    ///
    /// A row of [`RowMeta::NO_REQUEST`] (a sequence that ended, in a graph step) is counted in
    /// [`no_request_rows`](Self::no_request_rows) and scored into no request: it raises no alert.
    pub fn observe(&mut self, step: u64, meta: RowMeta, scores: &[f32], alerts: &mut Vec<Alert>) {
        if meta.is_no_request() {
            self.no_request_rows += 1;
            return;
        }
        let aggregation = self.aggregation;
        let (k, min_tokens) = (self.outputs, self.min_tokens);
        debug_assert_eq!(scores.len(), k);
        self.rows += 1;
        let probe = self.probe.clone();
        let (action, thresholds, labels) =
            (self.action, std::mem::take(&mut self.thresholds), std::mem::take(&mut self.labels));
        let s = self.state(meta.request_id);
        s.rows += 1;
        s.last_step = Some(step);
        s.positions = Some(match s.positions {
            None => (meta.position, meta.position),
            Some((lo, hi)) => (lo.min(meta.position), hi.max(meta.position)),
        });
        let mut nan = false;
        if let Aggregation::Window { .. } = aggregation {
            if s.window.is_empty() {
                s.window = vec![VecDeque::new(); k];
            }
        }
        let mut raised = 0u64;
        for (j, &x) in scores.iter().enumerate() {
            if x.is_nan() {
                nan = true;
                continue;
            }
            s.count[j] += 1;
            let n = s.count[j];
            let v = match aggregation {
                Aggregation::PerToken => x,
                Aggregation::Mean => {
                    s.sum[j] += x as f64;
                    (s.sum[j] / n as f64) as f32
                }
                Aggregation::Max => {
                    if n == 1 {
                        x
                    } else {
                        s.value[j].max(x)
                    }
                }
                Aggregation::Ema { alpha } => {
                    if n == 1 {
                        x
                    } else {
                        alpha * x + (1.0 - alpha) * s.value[j]
                    }
                }
                Aggregation::Window { window } => {
                    let w = &mut s.window[j];
                    w.push_back(x);
                    s.sum[j] += x as f64;
                    if w.len() > window as usize {
                        s.sum[j] -= w.pop_front().unwrap_or(0.0) as f64;
                    }
                    let mean = (s.sum[j] / w.len() as f64) as f32;
                    if n == 1 {
                        mean
                    } else {
                        s.value[j].max(mean)
                    }
                }
            };
            s.value[j] = v;
            if v >= thresholds[j] && n >= min_tokens && s.alerted & (1 << j) == 0 {
                s.alerted |= 1 << j;
                raised |= 1 << j;
                alerts.push(Alert {
                    probe: probe.clone(),
                    output: j as u32,
                    label: labels[j].clone(),
                    request_id: meta.request_id,
                    step,
                    position: meta.position,
                    score: v,
                    token_score: x,
                    threshold: thresholds[j],
                    action,
                });
            }
        }
        if nan {
            s.nan += 1;
            self.nan_rows += 1;
        }
        self.alerts += raised.count_ones() as u64;
        self.thresholds = thresholds;
        self.labels = labels;
    }

    fn report(&self, request: u64, s: &RequestState) -> RequestReport {
        let k = self.outputs;
        RequestReport {
            probe: self.probe.clone(),
            request_id: request,
            scores: s.value.clone(),
            alerted: (0..k).map(|j| s.alerted & (1 << j) != 0).collect(),
            coverage: s.coverage(),
            last_step: s.last_step,
        }
    }

    /// The request's report so far.
    pub fn request(&self, request: u64) -> Option<RequestReport> {
        self.requests.get(&request).map(|s| self.report(request, s))
    }

    /// Every live request's report, by request id.
    pub fn requests(&self) -> Vec<RequestReport> {
        let mut ids: Vec<u64> = self.requests.keys().copied().collect();
        ids.sort_unstable();
        ids.into_iter().map(|id| self.report(id, &self.requests[&id])).collect()
    }

    /// The request has finished: its final report, and the monitor forgets it.
    pub fn finish(&mut self, request: u64) -> Option<RequestReport> {
        let s = self.requests.remove(&request)?;
        Some(self.report(request, &s))
    }

    /// Requests forgotten to keep within `max_requests`.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Rows of no request ([`RowMeta::NO_REQUEST`]) seen and left unscored (not in [`totals`](Self::totals)).
    pub fn no_request_rows(&self) -> u64 {
        self.no_request_rows
    }

    /// Rows scored, rows with a NaN score, alerts raised.
    pub fn totals(&self) -> (u64, u64, u64) {
        (self.rows, self.nan_rows, self.alerts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ProbeDef, Target, Weights};

    fn monitor(aggregation: Aggregation, threshold: f32) -> Monitor {
        let def = ProbeDef {
            name: "p".into(),
            target: Target::HookPoint("h".into()),
            weights: Weights::new(1, 1, vec![1.0]).unwrap(),
            bias: vec![],
            aggregation,
            thresholds: vec![threshold],
            action: Action::Stop,
            labels: vec!["danger".into()],
            min_tokens: 1,
        };
        Monitor::new(&Probe::new(def, 1).unwrap(), 1000)
    }

    fn feed(m: &mut Monitor, request: u64, scores: &[f32]) -> Vec<Alert> {
        let mut alerts = Vec::new();
        for (i, &s) in scores.iter().enumerate() {
            m.observe(i as u64, RowMeta { request_id: request, position: i as u32, batch_row: 0 }, &[s], &mut alerts);
        }
        alerts
    }

    #[test]
    fn each_aggregation_alerts_once_when_it_reaches_the_threshold() {
        let scores = [0.0, 2.0, 0.0, 0.0, 3.0, 3.0];
        // (aggregation, threshold, the step of the alert, its aggregated score)
        let cases = [
            (Aggregation::PerToken, 2.0, 1, 2.0),
            (Aggregation::Mean, 1.3, 5, 8.0 / 6.0),
            (Aggregation::Max, 2.0, 1, 2.0),
            // 0, 1, 0.5, 0.25, 1.625, 2.3125
            (Aggregation::Ema { alpha: 0.5 }, 2.3, 5, 2.3125),
            // window means 0, 1, 1, 0, 1.5
            (Aggregation::Window { window: 2 }, 1.5, 4, 1.5),
            // window means 0, 1, 2/3, 2/3, 1, 2
            (Aggregation::Window { window: 3 }, 2.0, 5, 2.0),
        ];
        for (agg, threshold, step, score) in cases {
            let mut m = monitor(agg, threshold);
            let alerts = feed(&mut m, 7, &scores);
            let got: Vec<(u64, f32)> = alerts.iter().map(|a| (a.step, a.score)).collect();
            assert_eq!(got.len(), 1, "{agg:?}: {got:?}");
            assert_eq!(got[0].0, step, "{agg:?}: {got:?}");
            assert!((got[0].1 as f64 - score).abs() < 1e-6, "{agg:?}: {got:?} vs {score}");
            assert_eq!(&*alerts[0].label, "danger");
            assert_eq!(alerts[0].action, Action::Stop);
        }
    }

    #[test]
    fn nan_scores_are_counted_and_never_alert() {
        let mut m = monitor(Aggregation::Mean, 0.5);
        let alerts = feed(&mut m, 1, &[f32::NAN; 100]);
        assert!(alerts.is_empty());
        let r = m.request(1).unwrap();
        assert_eq!((r.coverage.scored, r.coverage.nan), (100, 100));
        assert!(r.scores[0].is_nan());
        // A NaN among real scores leaves the mean of the real ones.
        let alerts = feed(&mut m, 2, &[1.0, f32::NAN, 1.0]);
        assert_eq!(alerts.len(), 1);
        assert_eq!(m.request(2).unwrap().scores, vec![1.0]);
    }

    #[test]
    fn coverage_counts_what_the_probe_did_not_see() {
        let mut m = monitor(Aggregation::Max, 10.0);
        m.expect(3, 10);
        let mut alerts = Vec::new();
        for pos in [0u32, 1, 5] {
            m.observe(0, RowMeta { request_id: 3, position: pos, batch_row: 0 }, &[0.0], &mut alerts);
        }
        let c = m.request(3).unwrap().coverage;
        assert_eq!((c.scored, c.expected, c.unobserved), (3, 10, 7));
        // Without batches, the span of the positions seen stands in: 0..=5 is 6 rows, 3 scored.
        for pos in [0u32, 1, 5] {
            m.observe(0, RowMeta { request_id: 4, position: pos, batch_row: 0 }, &[0.0], &mut alerts);
        }
        let c = m.finish(4).unwrap().coverage;
        assert_eq!((c.scored, c.expected, c.unobserved), (3, 0, 3));
        assert!(m.request(4).is_none());
    }

    #[test]
    fn rows_taken_from_the_prefix_cache_are_counted_apart_from_what_the_engine_ran() {
        let mut m = monitor(Aggregation::Max, 10.0);
        m.cached(5, 96);
        m.expect(5, 6);
        let mut alerts = Vec::new();
        for pos in 96..102u32 {
            m.observe(0, RowMeta { request_id: 5, position: pos, batch_row: 0 }, &[0.0], &mut alerts);
        }
        let c = m.request(5).unwrap().coverage;
        assert_eq!((c.scored, c.expected, c.unobserved, c.cached), (6, 6, 0, 96));
        m.cached(RowMeta::NO_REQUEST, 3);
        assert!(m.request(RowMeta::NO_REQUEST).is_none());
    }

    #[test]
    fn rows_of_no_request_are_counted_and_never_scored_or_alerted() {
        let mut m = monitor(Aggregation::Max, 0.5);
        m.expect(RowMeta::NO_REQUEST, 4);
        let mut alerts = Vec::new();
        for pos in 0..4u32 {
            let meta = RowMeta { request_id: RowMeta::NO_REQUEST, position: pos, batch_row: pos };
            m.observe(0, meta, &[9.0], &mut alerts);
        }
        assert!(alerts.is_empty(), "{alerts:?}");
        assert_eq!(m.no_request_rows(), 4);
        assert_eq!(m.totals(), (0, 0, 0));
        assert!(m.request(RowMeta::NO_REQUEST).is_none() && m.requests().is_empty());
    }

    #[test]
    fn memory_is_bounded_by_max_requests() {
        let mut m = monitor(Aggregation::Mean, 10.0);
        m.max_requests = 64;
        let mut alerts = Vec::new();
        for r in 0..1000u64 {
            m.observe(r, RowMeta { request_id: r, position: 0, batch_row: 0 }, &[0.0], &mut alerts);
        }
        assert!(m.requests.len() <= 64);
        assert_eq!(m.evicted() + m.requests.len() as u64, 1000);
        assert!(m.request(999).is_some(), "the newest request is kept");
    }
}
