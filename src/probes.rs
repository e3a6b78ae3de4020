//! The session's probes: resolved against its hookpoints at start, scored on a consumer thread (or in the capture
//! path, for fused probes), aggregated per request, alerting through a channel and the stop flags.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{self, Receiver, Sender};
use parking_lot::Mutex;
use ringscope_exporter::{Filter, Record, Subscription};
use ringscope_hookpoint::{HookPoint, HookPointSpec, Registry, SiteKind, StepBatch};
use ringscope_probe::{Alert, Flags, Monitor, Probe, ProbeDef, RequestReport, Scorer, Target};
use ringscope_ring::DType;

use crate::config::{Config, ProbeMode};
use crate::Error;

/// What a probe did so far (see [`crate::Session::probe_stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeStats {
    /// The probe.
    pub name: String,
    /// The hookpoint it reads.
    pub hookpoint: String,
    /// `consumer` or `fused`.
    pub mode: &'static str,
    /// Rows scored.
    pub rows: u64,
    /// Rows with a NaN score.
    pub nan_rows: u64,
    /// Alerts raised.
    pub alerts: u64,
    /// Requests forgotten to stay within `alerts.max_requests`.
    pub evicted_requests: u64,
    /// Rows of no request ([`RowMeta::NO_REQUEST`](ringscope_ring::RowMeta::NO_REQUEST): sequences that ended, in
    /// steps recorded as CUDA graphs) seen and left unscored.
    pub no_request_rows: u64,
}

/// The largest `[alerts]` `flag_slots`, `max_requests` and `queue` (16 Mi: a flag table of 128 MiB).
pub const MAX_ALERTS_SETTING: u32 = 1 << 24;

/// The hookpoint a fused probe's scores are captured as.
pub fn scores_hookpoint(probe: &str) -> String {
    format!("probes.{probe}")
}

/// A fused probe, as the capture path sees it.
pub(crate) struct Fused {
    /// The probe's index in the session's probes.
    pub index: usize,
    /// The hookpoint of its scores (f32 × K).
    pub scores: Arc<HookPoint>,
    /// Host backend: scores on the engine's thread.
    pub host: Mutex<HostScoring>,
}

/// A fused probe's scoring on the host backend: the scorer and the buffers each capture's scores go through, kept
/// from capture to capture so that a steady stream of captures allocates nothing.
pub(crate) struct HostScoring {
    pub scorer: Scorer,
    /// The last capture's scores.
    pub scores: Vec<f32>,
    /// The last capture's scores as little-endian bytes (the scores hookpoint's rows).
    pub bytes: Vec<u8>,
}

impl HostScoring {
    /// Buffers larger than this are not kept after the capture that needed them (a one-off huge capture does not
    /// hold its memory for the session's life).
    pub const KEEP_BYTES: usize = 16 << 20;
}

/// How the consumer thread treats one hookpoint's records.
enum Route {
    /// Raw rows: score them.
    Score { index: usize, scorer: Scorer },
    /// A fused probe's scores: aggregate them as they are.
    Scores { index: usize },
}

struct Shared {
    monitors: Vec<Mutex<Monitor>>,
    names: Vec<(String, String, &'static str)>,
    flags: Arc<Flags>,
    alerts_dropped: AtomicU64,
    /// Records the consumer has finished with (for `idle`).
    processed: AtomicU64,
    /// Step batches the consumer has counted into every monitor (for `idle`: taken off the channel is not enough).
    batches_applied: AtomicU64,
    errors: Mutex<Vec<String>>,
}

/// The session's probes.
pub(crate) struct Probes {
    shared: Arc<Shared>,
    alerts: Receiver<Alert>,
    batches: Sender<Vec<(u64, u64)>>,
    /// Step batches sent to the consumer (for `idle`).
    batches_sent: AtomicU64,
    subscription: Option<Arc<Subscription>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Fused probes by the id of the hookpoint they read.
    pub fused: HashMap<u32, Vec<Arc<Fused>>>,
    by_name: HashMap<String, usize>,
}

fn find_target(registry: &Registry, probe: &str, target: &Target) -> Result<Arc<HookPoint>, Error> {
    let found = match target {
        Target::HookPoint(name) => registry.by_name(name).ok(),
        Target::Layer { layer, site } => {
            registry.all().into_iter().find(|h| h.spec().layer == Some(*layer) && h.spec().site.name() == site.as_str())
        }
    };
    found.ok_or_else(|| {
        let names: Vec<String> = registry.all().iter().map(|h| h.spec().name.clone()).collect();
        Error::Config(format!(
            "probes `{probe}`: no {target} among the configured hookpoints ({}): probes read hookpoints of \
             [[hookpoints]]",
            if names.is_empty() { "none".to_owned() } else { names.join(", ") }
        ))
    })
}

impl Probes {
    /// Loads and checks every probe of `config` against the registered hookpoints and registers the fused probes'
    /// scores hookpoints. Nothing runs yet.
    /// `extra`: probes given in code ([`crate::SessionBuilder::probe`]), after the configuration's.
    pub fn load(
        config: &Config,
        extra: Vec<(ProbeDef, ProbeMode)>,
        registry: &Registry,
    ) -> Result<Option<Prepared>, Error> {
        if config.probes.is_empty() && extra.is_empty() {
            return Ok(None);
        }
        let a = &config.alerts;
        for (key, value) in [("flag_slots", a.flag_slots), ("max_requests", a.max_requests), ("queue", a.queue)] {
            if value == 0 || value > MAX_ALERTS_SETTING {
                return Err(Error::Config(format!(
                    "alerts.{key} = {value}: use 1 to {MAX_ALERTS_SETTING} (flag_slots: 8 bytes each, allocated when \
                     the session opens; max_requests and queue: entries of up to ~100 bytes each, held while in use)"
                )));
            }
        }
        let mut loaded = Vec::new();
        let mut by_name = HashMap::new();
        let defs = config.probes.iter().map(|pc| Ok::<_, Error>((pc.definition()?, pc.mode)));
        for (i, def) in defs.chain(extra.into_iter().map(Ok)).enumerate() {
            let (def, mode): (ProbeDef, ProbeMode) = def?;
            let name = def.name.clone();
            if by_name.insert(name.clone(), i).is_some() {
                return Err(Error::Config(format!("probes: two probes are named `{name}`")));
            }
            let source = find_target(registry, &name, &def.target)?;
            let spec = source.spec();
            if !matches!(spec.dtype, DType::F32 | DType::F16 | DType::BF16) {
                return Err(Error::Config(format!(
                    "probes `{name}`: hookpoint `{}` holds {} rows; probes read f32, f16 or bf16 hookpoints",
                    spec.name,
                    spec.dtype.name()
                )));
            }
            let probe = Probe::new(def, spec.row_width).map_err(|e| Error::Config(format!("probes: {e}")))?;
            loaded.push((mode, source, probe));
        }
        Ok(Some(Prepared { loaded, by_name, alerts: config.alerts.clone(), registered: Vec::new() }))
    }
}

/// Probes loaded and checked; fused probes' hookpoints registered by [`Prepared::register`].
pub(crate) struct Prepared {
    loaded: Vec<(ProbeMode, Arc<HookPoint>, Probe)>,
    by_name: HashMap<String, usize>,
    alerts: crate::config::AlertsConfig,
    registered: Vec<Option<Arc<HookPoint>>>,
}

impl Prepared {
    /// Registers each fused probe's scores hookpoint (f32 × K, the source's layer).
    pub fn register(&mut self, registry: &Registry) -> Result<(), Error> {
        for (mode, source, probe) in &self.loaded {
            let hp = match mode {
                ProbeMode::Fused => {
                    let spec = HookPointSpec {
                        name: scores_hookpoint(probe.name()),
                        site: SiteKind::Custom("probe".into()),
                        layer: source.spec().layer,
                        dtype: DType::F32,
                        row_width: probe.outputs() as u32,
                    };
                    Some(registry.register(spec).map_err(|e| {
                        Error::Config(format!("probes `{}`: cannot register its scores hookpoint: {e}", probe.name()))
                    })?)
                }
                ProbeMode::Consumer => None,
            };
            self.registered.push(hp);
        }
        Ok(())
    }

    /// The loaded probes with the hookpoints they read, in configuration order.
    pub fn probes(&self) -> impl Iterator<Item = (&Probe, &Arc<HookPoint>, Option<&Arc<HookPoint>>)> + '_ {
        self.loaded.iter().zip(&self.registered).map(|((_, source, probe), scores)| (probe, source, scores.as_ref()))
    }

    /// Slots of the stop-flag table (`alerts.flag_slots`).
    pub fn flag_slots(&self) -> usize {
        self.alerts.flag_slots as usize
    }

    /// Subscribes the consumer thread to what it scores and starts it; `flags` is the stop-flag table.
    pub fn start(
        self,
        flags: Arc<Flags>,
        subscribe: impl FnOnce(Filter) -> Result<Subscription, Error>,
    ) -> Result<Probes, Error> {
        let max_requests = self.alerts.max_requests as usize;
        let mut routes: HashMap<u32, Vec<Route>> = HashMap::new();
        let mut fused: HashMap<u32, Vec<Arc<Fused>>> = HashMap::new();
        let mut monitors = Vec::new();
        let mut names = Vec::new();
        let mut hookpoints = Vec::new();
        for (index, ((mode, source, probe), scores)) in self.loaded.into_iter().zip(self.registered).enumerate() {
            monitors.push(Mutex::new(Monitor::new(&probe, max_requests)));
            let m = match mode {
                ProbeMode::Consumer => "consumer",
                ProbeMode::Fused => "fused",
            };
            names.push((probe.name().to_owned(), source.spec().name.clone(), m));
            match (mode, scores) {
                (ProbeMode::Fused, Some(scores)) => {
                    routes.entry(scores.id()).or_default().push(Route::Scores { index });
                    hookpoints.push(scores.spec().name.clone());
                    let host = HostScoring { scorer: Scorer::new(&probe), scores: Vec::new(), bytes: Vec::new() };
                    let f = Fused { index, scores, host: Mutex::new(host) };
                    fused.entry(source.id()).or_default().push(Arc::new(f));
                }
                _ => {
                    routes.entry(source.id()).or_default().push(Route::Score { index, scorer: Scorer::new(&probe) });
                    hookpoints.push(source.spec().name.clone());
                }
            }
        }
        let shared = Arc::new(Shared {
            monitors,
            names,
            flags,
            alerts_dropped: AtomicU64::new(0),
            processed: AtomicU64::new(0),
            batches_applied: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
        });
        // Unbounded, with `alerts.queue` enforced by the one sender (`consume`): a bounded channel would allocate
        // every slot up front (~80 bytes each) and keep them as long as any receiver lives — a closed session's
        // included.
        let (alert_tx, alerts) = channel::unbounded();
        let queue = self.alerts.queue as usize;
        let (batches, batch_rx) = channel::unbounded();
        let subscription = Arc::new(subscribe(Filter::hookpoints(hookpoints))?);
        let thread = {
            let (shared, subscription) = (shared.clone(), subscription.clone());
            std::thread::Builder::new()
                .name("ringscope-probes".into())
                .spawn(move || consume(&shared, &subscription, routes, &batch_rx, &alert_tx, queue))
                .map_err(|e| Error::Setting { key: "probes", source: e.into() })?
        };
        Ok(Probes {
            shared,
            alerts,
            batches,
            batches_sent: AtomicU64::new(0),
            subscription: Some(subscription),
            thread: Mutex::new(Some(thread)),
            fused,
            by_name: self.by_name,
        })
    }
}

/// The consumer thread: scores what it receives until the subscription closes (at the session's shutdown).
fn consume(
    shared: &Shared,
    subscription: &Subscription,
    mut routes: HashMap<u32, Vec<Route>>,
    batches: &Receiver<Vec<(u64, u64)>>,
    alerts: &Sender<Alert>,
    queue: usize,
) {
    let mut raised = Vec::new();
    let mut scores = Vec::new();
    loop {
        for batch in batches.try_iter() {
            for m in &shared.monitors {
                let mut m = m.lock();
                for &(request, rows) in &batch {
                    m.expect(request, rows);
                }
            }
            shared.batches_applied.fetch_add(1, Ordering::SeqCst);
        }
        let record = match subscription.recv_timeout(Duration::from_millis(5)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            // The stream ended: the drain has delivered everything (shutdown).
            Err(()) => return,
        };
        if let Some(routes) = routes.get_mut(&record.header().meta.hookpoint) {
            for route in routes {
                if let Err(e) = score_record(shared, route, &record, &mut scores, &mut raised) {
                    let mut errors = shared.errors.lock();
                    if errors.len() < 16 {
                        errors.push(e);
                    }
                }
            }
        }
        for alert in raised.drain(..) {
            if alert.action == ringscope_probe::Action::Stop {
                // Raised before the alert is sent: whoever reads the alert finds the flag up.
                shared.flags.raise(alert.request_id);
            }
            // This thread is the only sender: the queue cannot grow between the check and the send.
            if alerts.len() >= queue || alerts.try_send(alert).is_err() {
                shared.alerts_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        shared.processed.fetch_add(1, Ordering::SeqCst);
    }
}

fn score_record(
    shared: &Shared,
    route: &mut Route,
    record: &Record,
    scores: &mut Vec<f32>,
    raised: &mut Vec<ringscope_probe::Alert>,
) -> Result<(), String> {
    let view = record.view();
    let step = record.step();
    let dtype = view.header.meta.dtype;
    match route {
        Route::Score { index, scorer } => {
            let k = scorer.outputs();
            scores.resize(view.rows() * k, 0.0);
            scorer.score_rows(dtype, view.data(), scores).map_err(|e| e.to_string())?;
            let mut monitor = shared.monitors[*index].lock();
            for (i, s) in scores.chunks_exact(k).enumerate() {
                monitor.observe(step, view.row_meta(i), s, raised);
            }
        }
        Route::Scores { index } => {
            let mut monitor = shared.monitors[*index].lock();
            let k = view.header.meta.row_bytes as usize / 4;
            scores.resize(k, 0.0);
            for i in 0..view.rows() {
                if !ringscope_probe::row_to_f32(dtype, view.row(i), scores) {
                    return Err(format!("fused probe scores of dtype {} are not f32 × {k}", dtype.name()));
                }
                monitor.observe(step, view.row_meta(i), scores, raised);
            }
        }
    }
    Ok(())
}

/// `(request, rows)` of each request among the rows' request ids, in order of first appearance.
fn rows_per_request(requests: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut index: HashMap<u64, usize> = HashMap::new();
    for request in requests {
        match out.last_mut() {
            Some((req, n)) if *req == request => *n += 1,
            _ => match index.get(&request) {
                Some(&i) => out[i].1 += 1,
                None => {
                    index.insert(request, out.len());
                    out.push((request, 1));
                }
            },
        }
    }
    out
}

impl Probes {
    /// A step's batch: the rows each request ran (the probes' coverage denominator).
    pub fn step_begun(&self, batch: &StepBatch) {
        self.send_batch(rows_per_request(batch.rows().iter().map(|r| r.request_id)));
    }

    /// The request of each row a step begun on the device ran (the engine's own account of it, from the host): the
    /// same denominator as [`step_begun`](Self::step_begun)'s.
    pub fn rows_ran(&self, requests: &[u64]) {
        if !requests.is_empty() {
            self.send_batch(rows_per_request(requests.iter().copied()));
        }
    }

    fn send_batch(&self, batch: Vec<(u64, u64)>) {
        // Counted before it is sent: `idle` must never see it applied and not yet sent.
        self.batches_sent.fetch_add(1, Ordering::SeqCst);
        if self.batches.send(batch).is_err() {
            self.batches_sent.fetch_sub(1, Ordering::SeqCst); // the consumer has ended: nothing will apply it
        }
    }

    /// The engine took `rows` rows of `request` from its prefix cache: every probe's coverage of it counts them.
    pub fn cached(&self, request: u64, rows: u64) {
        for m in &self.shared.monitors {
            m.lock().cached(request, rows);
        }
    }

    /// The alerts channel.
    pub fn alerts(&self) -> Receiver<Alert> {
        self.alerts.clone()
    }

    /// The stop flags.
    pub fn flags(&self) -> &Arc<Flags> {
        &self.shared.flags
    }

    fn index(&self, probe: &str) -> Result<usize, Error> {
        self.by_name.get(probe).copied().ok_or_else(|| {
            let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
            names.sort_unstable();
            Error::Config(format!("no probe `{probe}` (this session has {})", names.join(", ")))
        })
    }

    /// One request's report from one probe.
    pub fn request(&self, probe: &str, request: u64) -> Result<Option<RequestReport>, Error> {
        Ok(self.shared.monitors[self.index(probe)?].lock().request(request))
    }

    /// Every live request's report from one probe.
    pub fn requests(&self, probe: &str) -> Result<Vec<RequestReport>, Error> {
        Ok(self.shared.monitors[self.index(probe)?].lock().requests())
    }

    /// The request has ended: every probe's final report, and its stop flag is lowered.
    pub fn finish(&self, request: u64) -> Vec<RequestReport> {
        let reports = self.shared.monitors.iter().filter_map(|m| m.lock().finish(request)).collect();
        self.shared.flags.clear(request);
        reports
    }

    /// Every probe's counts.
    pub fn stats(&self) -> Vec<ProbeStats> {
        self.shared
            .monitors
            .iter()
            .zip(&self.shared.names)
            .map(|(m, (name, hookpoint, mode))| {
                let m = m.lock();
                let (rows, nan_rows, alerts) = m.totals();
                ProbeStats {
                    name: name.clone(),
                    hookpoint: hookpoint.clone(),
                    mode,
                    rows,
                    nan_rows,
                    alerts,
                    evicted_requests: m.evicted(),
                    no_request_rows: m.no_request_rows(),
                }
            })
            .collect()
    }

    /// Alerts that did not fit in the queue.
    pub fn alerts_dropped(&self) -> u64 {
        self.shared.alerts_dropped.load(Ordering::Relaxed)
    }

    /// Errors the consumer met (rows it could not score), at most 16.
    pub fn errors(&self) -> Vec<String> {
        self.shared.errors.lock().clone()
    }

    /// Whether the consumer has scored everything delivered to it (and taken in every step's batch).
    pub fn idle(&self) -> bool {
        let Some(s) = &self.subscription else { return true };
        // Backlog first: a record taken after this read was counted as received before the backlog went down.
        s.backlog_bytes() == 0
            && s.received() == self.shared.processed.load(Ordering::SeqCst)
            && self.batches_sent.load(Ordering::SeqCst) == self.shared.batches_applied.load(Ordering::SeqCst)
    }

    /// Waits for the consumer to score everything the drain delivered; call after the drain has ended (its stream's
    /// end is what stops the consumer).
    pub fn join(&self) {
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}
