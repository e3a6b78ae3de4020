//! `Session`: one ring, its hookpoints, its drain and its policy, wired from one [`Config`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ringscope_exporter::{
    arrow_ipc_sink, event_recorder, parquet_sink, Catalog, CatalogEntry, CommittedFile, CommittedFiles, Drain,
    DrainOptions, DrainReport, EventRecorder, EventsFile, Filter, Sink, SinkFailure, SinkHealth, Subscription,
};
use ringscope_hookpoint::cuda::{DeviceCaptureError, GraphBatch};
use ringscope_hookpoint::{CaptureOutcome, HookPoint, HookPointError, HookPointSpec, Registry, StepBatch};
use ringscope_policy::events::unix_ns_now;
use ringscope_policy::{
    AccountingSnapshot, Budget, DropReason, Event, EventKind, EventLog, LossPolicy, Mode, RungChange,
};
use ringscope_ring::cuda::{DevicePtr, StreamRef};
use ringscope_ring::RowMeta;

use crate::backend::cuda::CudaBackend;
use crate::backend::host::HostBackend;
use crate::backend::{Backend, Rows, Started};
use crate::config::{self, Config};
use crate::governor::{self, Governor};
use crate::metrics::MetricsServer;
use crate::stats::{Observer, SessionStats, StepClock};
use crate::step_policy::StepPolicy;
use crate::Error;

/// [`Session`]'s `controls_applied` when no upload is known to be current.
const NOT_APPLIED: u64 = u64::MAX;

/// What a finished session did: the drain's report, the files written and the final, checked accounting.
#[derive(Debug, Clone)]
pub struct Report {
    /// Per-hookpoint counters at shutdown.
    pub accounting: AccountingSnapshot,
    /// The drain's totals and sink errors.
    pub drain: DrainReport,
    /// Files committed by the file sinks, in commit order.
    pub files: Vec<CommittedFile>,
    /// The run directory, when a file sink was configured.
    pub run_dir: Option<std::path::PathBuf>,
    /// Sinks that failed during the run (their records from then on are counted as `sink_error`).
    pub sink_failures: Vec<SinkFailure>,
    /// The events table's files (`<run dir>/_ringscope_events/`), in commit order; empty without a file sink or
    /// when nothing was lost.
    pub events: Vec<EventsFile>,
}

impl Report {
    /// Activation throughput of the drain in GB/s (ring bytes over the drain's lifetime).
    pub fn drain_gb_per_s(&self) -> f64 {
        self.drain.bytes as f64 / self.drain.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// The place records are born. `None` in the session once shut down.
struct Capture {
    backend: Box<dyn Backend>,
}

/// The exporter's view of the registry: hookpoint ids resolve to the spec and the counters the capture side
/// shares. The exporter knows no more of the capture side than this.
struct RegistryCatalog(Arc<Registry>);

impl Catalog for RegistryCatalog {
    fn entry(&self, id: u32) -> Option<Arc<CatalogEntry>> {
        let hp = self.0.get(id).ok()?;
        Some(Arc::new(CatalogEntry::new(hp.id(), hp.spec().clone(), hp.counters().clone(), hp.events().clone())))
    }
}

/// A running ringscope session.
///
/// Host backend — typical engine loop: [`begin_step`](Self::begin_step) with the step's batch descriptor, one
/// [`capture`](Self::capture) per hookpoint, [`end_step`](Self::end_step); at the end [`shutdown`](Self::shutdown).
///
/// CUDA backend (`ring.backend = "cuda"`): [`begin_step_on`](Self::begin_step_on) the engine's stream before each
/// step (outside any CUDA graph), [`capture_device`](Self::capture_device) per hookpoint — these launches may be
/// recorded into a CUDA graph and replayed —, [`end_step`](Self::end_step). All captures of a session must run in
/// order on one stream.
///
/// All methods take `&self`; captures are serialised internally (the ring has one producer), so one engine thread
/// should drive them.
///
/// A sink that fails (a full disk, a file it cannot create) is known at once: [`sink_failures`](Self::sink_failures)
/// lists it, with its error and time. In full mode `begin_step*` and captures then return [`Error::SinkFailed`]
/// (full mode promises not to lose records, and the failed sink's would be lost) — unless
/// `policy.on_sink_failure = "continue"`; in best-effort mode they go on and the failed sink's records are counted as
/// dropped (`sink_error`).
pub struct Session {
    registry: Arc<Registry>,
    policy: LossPolicy,
    /// Full mode's answer to a failed sink (`policy.on_sink_failure`).
    on_sink_failure: config::OnSinkFailure,
    /// `None` once shut down.
    capture: Mutex<Option<Capture>>,
    drain: Mutex<Option<Drain>>,
    files: Vec<CommittedFiles>,
    run_dir: Option<std::path::PathBuf>,
    /// This session's hold on its rank of the run directory (with a file sink), released once shutdown has written
    /// the manifest (which then keeps later sessions of the run and rank from writing over it).
    run_lock: Mutex<Option<ringscope_exporter::RunLock>>,
    /// Object storage the run is written to (`export.url`), `None` for a local directory.
    storage: Option<ringscope_exporter::ObjectStorage>,
    /// `export.rank`: names this session's manifest and events files in a run directory several ranks share.
    rank: u32,
    /// The drain's sink failures, updated by the sink workers as they happen; outlives the drain.
    health: SinkHealth,
    /// Asks the sinks to commit what they hold ([`Session::wait_drained`]).
    commits: ringscope_exporter::Commits,
    /// The policy manager (best-effort mode with budgets), deciding at step boundaries.
    governor: Option<Governor>,
    /// Full mode's wait budgets per step and what a step out of time does (`policy.on_deadline`).
    step_policy: StepPolicy,
    /// Steps begun, and their batches' rows and requests (the policy manager's production measure).
    steps: StepTally,
    /// `policy.host_memory` (without it, the live destinations' backlogs together are the host budget).
    host_memory: Option<u64>,
    /// The registry's change count ([`Registry::changes`]) as of the last [`apply_controls`](Self::apply_controls)
    /// that uploaded, `NOT_APPLIED` when none did or something the count does not track changed since (a valid-rows
    /// pointer, the session's close): with it unchanged and no policy manager, `apply_controls` has nothing to do.
    controls_applied: AtomicU64,
    /// What `stats` reads (shared with the metrics endpoint's thread); outlives the drain.
    observer: Arc<Observer>,
    /// The Prometheus endpoint (`[metrics] listen`), stopped at shutdown.
    metrics: Mutex<Option<MetricsServer>>,
    metrics_addr: Option<SocketAddr>,
    /// What was lost, when and why, and rung changes: every drop counted anywhere is logged here.
    events: Arc<EventLog>,
    /// Token rows the engine took from its prefix cache (note_cached).
    cached_rows: AtomicU64,
    /// Writes `events` into the run directory's events table as it happens (with a file sink); `None` once shut
    /// down.
    recorder: Mutex<Option<EventRecorder>>,
    /// The probes (`[[probes]]`), when any.
    probes: Option<crate::probes::Probes>,
    /// Entries of the manifest's `metadata` object ([`set_metadata`](Session::set_metadata)); `None` once shutdown
    /// has taken them for the manifest (later entries could not be written: `Error::Closed`).
    metadata: Mutex<Option<std::collections::BTreeMap<String, serde_json::Value>>>,
}

/// Steps begun and what their batches held.
#[derive(Debug, Default)]
struct StepTally {
    steps: AtomicU64,
    rows: AtomicU64,
    requests: AtomicU64,
    last: AtomicU64,
}

impl StepTally {
    fn begun(&self, batch: &StepBatch) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(batch.len() as u64, Ordering::Relaxed);
        self.requests.fetch_add(batch.last_per_request().len() as u64, Ordering::Relaxed);
        self.last.store(batch.step(), Ordering::Relaxed);
    }
}

/// The longest key of the manifest's `metadata` object ([`Session::set_metadata`]).
pub const METADATA_KEY_MAX: usize = 64;
/// The most bytes of JSON one `metadata` value may take ([`Session::set_metadata`]).
pub const METADATA_VALUE_MAX: usize = 4 << 20;
/// The most entries the manifest's `metadata` object may hold ([`Session::set_metadata`]).
pub const METADATA_ENTRIES_MAX: usize = 64;

fn check_metadata_key(key: &str) -> Result<(), Error> {
    let ok = (1..=METADATA_KEY_MAX).contains(&key.chars().count())
        && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "set_metadata: key {key:?} is not 1 to {METADATA_KEY_MAX} characters of A-Z a-z 0-9 _ . -"
    )))
}

/// Builds a [`Session`]: the config plus the sinks its drain writes to.
pub struct SessionBuilder {
    config: Config,
    sinks: Vec<(Box<dyn Sink>, Filter)>,
    probes: Vec<(ringscope_probe::ProbeDef, config::ProbeMode)>,
    storage: Option<ringscope_exporter::ObjectStorage>,
}

impl SessionBuilder {
    /// Writes the run's files to `storage` (any `object_store` store, set up as the caller likes) instead of what
    /// `export.url` or `export.dir` say.
    pub fn storage(mut self, storage: ringscope_exporter::ObjectStorage) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Adds a sink that receives every record.
    pub fn sink(self, sink: impl Sink + 'static) -> Self {
        self.sink_filtered(sink, Filter::all())
    }

    /// Adds a sink that receives the records passing `filter`.
    pub fn sink_filtered(mut self, sink: impl Sink + 'static, filter: Filter) -> Self {
        self.sinks.push((Box::new(sink), filter));
        self
    }

    /// Adds a boxed sink that receives every record.
    pub fn boxed_sink(mut self, sink: Box<dyn Sink>) -> Self {
        self.sinks.push((sink, Filter::all()));
        self
    }

    /// Adds a probe given in code (weights in memory), after the configuration's `[[probes]]`; checked at
    /// [`start`](Self::start) like those.
    pub fn probe(mut self, def: ringscope_probe::ProbeDef, mode: config::ProbeMode) -> Self {
        self.probes.push((def, mode));
        self
    }

    /// Validates the config, allocates the ring, registers the configured hookpoints and starts the drain.
    pub fn start(self) -> Result<Session, Error> {
        let config = self.config;
        let started = Instant::now();
        let policy = config.policy.loss_policy();
        policy.validate()?;
        config.validate_budgets()?;
        // Bound first: a port in use is an error before any memory is allocated.
        let listener = config.metrics.listen_addr()?.map(crate::metrics::bind).transpose()?;
        let capacity = usize::try_from(config.ring.capacity.0)
            .map_err(|_| Error::Config(format!("ring.capacity {} does not fit in memory", config.ring.capacity.0)))?;
        config.ring.validate_cuda_keys()?;

        let events = Arc::new(EventLog::new());
        let registry = Arc::new(Registry::with_events(events.clone()));
        for hc in &config.hookpoints {
            let (spec, selection) = hc.resolve()?;
            let hp = registry.register(spec)?;
            hp.control().set_selection(selection)?;
            hp.control().set_every_n_steps(hc.every_n_steps)?;
            hp.control().set_enabled(hc.enabled);
        }
        // Probes are loaded and checked against the hookpoints before anything is allocated or started.
        let mut probes = crate::probes::Probes::load(&config, self.probes, &registry)?;
        if let Some(p) = &mut probes {
            p.register(&registry)?;
        }
        let options = DrainOptions {
            backlog_bytes: usize::try_from(config.export.backlog.0).unwrap_or(usize::MAX),
            policy,
            max_bytes_per_s: config.policy.drain_rate.map(|r| r.0 as f64),
            ..DrainOptions::default()
        };
        let mut pools: Vec<_> = self.sinks.into_iter().map(|(sink, filter)| (vec![sink], filter)).collect();
        let mut files = Vec::new();
        let mut dataset = config.export.dataset_options();
        // On object storage (`export.url`): opened and checked now, before anything is allocated or started.
        let storage = match (self.storage, config.export.parquet || config.export.arrow_ipc) {
            (_, false) => None,
            (Some(storage), true) => Some(storage),
            (None, true) => config.export.open_storage()?,
        };
        if let Some(storage) = &storage {
            dataset.root = storage.root();
            dataset.storage = Some(storage.clone());
        }
        // Records a file sink holds for its batches hold ring space (they are lent, not copied): all file sinks
        // together hold at most a quarter of the ring, so the drain always has room to move.
        let file_sinks =
            config.export.threads as usize * (config.export.parquet as usize + config.export.arrow_ipc as usize);
        dataset.max_pending_bytes = dataset.max_pending_bytes.min(capacity / 4 / file_sinks.max(1)).max(1);
        let run_dir = (config.export.parquet || config.export.arrow_ipc).then(|| dataset.run_dir());
        let threads = config.export.threads;
        if threads == 0 || threads > 256 {
            return Err(Error::Config(format!("export.threads = {threads}: use 1 to 256")));
        }
        // `export.threads` sinks per format, one pool each: a record goes to whichever sink of its format is free
        // first; each writes files of its own (`file_shard`), so every file has one writer.
        let mut parquet: Vec<Box<dyn Sink>> = Vec::new();
        let mut arrow: Vec<Box<dyn Sink>> = Vec::new();
        for shard in 0..threads {
            let mut dataset = dataset.clone();
            dataset.file_shard = (threads > 1).then_some(shard);
            if config.export.parquet {
                let (sink, committed) = parquet_sink(dataset.clone(), config.export.codec())
                    .map_err(|e| Error::Setting { key: "export.parquet", source: e.into() })?;
                parquet.push(Box::new(sink));
                files.push(committed);
            }
            if config.export.arrow_ipc {
                let (sink, committed) = arrow_ipc_sink(dataset.clone())
                    .map_err(|e| Error::Setting { key: "export.arrow_ipc", source: e.into() })?;
                arrow.push(Box::new(sink));
                files.push(committed);
            }
        }
        // One writer per run and rank, until shutdown: a second session of the same run and rank is refused here,
        // before anything could write a file over the first's (the sinks above only checked their options and made
        // the run's directory).
        let run_lock = match &run_dir {
            Some(dir) => {
                let manifest = crate::manifest::file_name(config.export.rank);
                let lock = match &storage {
                    Some(storage) => {
                        ringscope_exporter::RunLock::acquire_object(storage, dir, config.export.rank, &manifest)
                    }
                    None => ringscope_exporter::RunLock::acquire(dir, config.export.rank, &manifest),
                };
                Some(lock.map_err(|e| Error::Setting { key: "export.run_id", source: e.into() })?)
            }
            None => None,
        };
        pools.extend([parquet, arrow].into_iter().filter(|p| !p.is_empty()).map(|p| (p, Filter::all())));
        let Started { backend, source } = match config.ring.backend {
            config::Backend::Host => HostBackend::start(capacity)?,
            config::Backend::Cuda => CudaBackend::start(&config.ring, capacity, &policy)?,
        };
        let catalog: Arc<dyn Catalog> = Arc::new(RegistryCatalog(registry.clone()));
        let drain = Drain::spawn_pools(source, catalog, pools, options)?;
        let health = drain.health();
        let commits = drain.commits();
        let mut backend = backend;
        let probes = match probes {
            Some(p) => {
                let flags = match backend.probe_flags(p.flag_slots())? {
                    Some(flags) => flags,
                    None => Arc::new(ringscope_probe::Flags::new(p.flag_slots())),
                };
                for (index, (probe, source, scores)) in p.probes().enumerate() {
                    if let Some(scores) = scores {
                        backend.add_fused_probe(index, probe, source, scores, &flags)?;
                    }
                }
                Some(p.start(flags, |filter| Ok(drain.subscribe("probes", filter)?))?)
            }
            None => None,
        };
        let rank = config.export.rank;
        let recorder =
            run_dir.as_deref().map(|dir| event_recorder(dir, rank, storage.clone(), events.clone())).transpose()?;
        let capture = Capture { backend };
        let observer = Arc::new(Observer {
            registry: registry.clone(),
            monitor: drain.monitor(),
            steps: StepClock::default(),
            started,
            mode: policy.mode,
            backend: match config.ring.backend {
                config::Backend::Host => "host",
                config::Backend::Cuda => "cuda",
            },
        });
        let metrics = match listener {
            Some(l) => Some(MetricsServer::start(l, observer.clone())?),
            None => None,
        };
        let metrics_addr = metrics.as_ref().map(MetricsServer::addr);
        Ok(Session {
            registry,
            policy,
            on_sink_failure: config.policy.on_sink_failure,
            capture: Mutex::new(Some(capture)),
            drain: Mutex::new(Some(drain)),
            files,
            run_dir,
            storage,
            run_lock: Mutex::new(run_lock),
            rank,
            health,
            commits,
            governor: config.policy.adaptive().then(|| {
                // Fused probes' scores are a few floats per row: the last thing to degrade.
                let scores =
                    probes.iter().flat_map(|p| p.fused.values().flatten().map(|f| f.scores.spec().name.clone()));
                let priorities = config
                    .hookpoints
                    .iter()
                    .map(|h| (h.name.clone(), h.priority))
                    .chain(scores.map(|n| (n, i32::MAX)))
                    .collect();
                Governor::new(config.policy.planner_settings(), priorities, true)
            }),
            step_policy: StepPolicy::new(
                policy.full_deadline,
                config.policy.max_step_overhead.filter(|_| config.policy.mode == Mode::Full),
                config.policy.on_deadline,
            ),
            steps: StepTally::default(),
            host_memory: config.policy.host_memory.map(|b| b.0),
            controls_applied: AtomicU64::new(NOT_APPLIED),
            observer,
            metrics: Mutex::new(metrics),
            metrics_addr,
            events,
            cached_rows: AtomicU64::new(0),
            recorder: Mutex::new(recorder),
            probes,
            metadata: Mutex::new(Some(Default::default())),
        })
    }
}

impl Session {
    /// Starts building a session from `config`.
    pub fn builder(config: Config) -> SessionBuilder {
        SessionBuilder { config, sinks: Vec::new(), probes: Vec::new(), storage: None }
    }

    /// A session with no sinks (records are drained and counted, nothing is written).
    pub fn new(config: Config) -> Result<Session, Error> {
        Session::builder(config).start()
    }

    /// Registers another hookpoint; returns its id.
    pub fn register(&self, spec: HookPointSpec) -> Result<u32, Error> {
        self.check_open()?;
        Ok(self.registry.register(spec)?.id())
    }

    /// The hookpoint named `name` (for its controls: enable, sampling, row selection).
    pub fn hookpoint(&self, name: &str) -> Result<Arc<HookPoint>, Error> {
        Ok(self.registry.by_name(name)?)
    }

    /// The hookpoint with id `id`.
    pub fn hookpoint_by_id(&self, id: u32) -> Result<Arc<HookPoint>, Error> {
        Ok(self.registry.get(id)?)
    }

    /// The session's hookpoints, in id order.
    pub fn hookpoints(&self) -> Vec<Arc<HookPoint>> {
        self.registry.all()
    }

    /// The loss policy in force.
    pub fn policy(&self) -> LossPolicy {
        self.policy
    }

    /// The session's event log. Every drop is logged in it as it is counted (a span per hookpoint and reason); push
    /// rung changes and stalls into it. With a file sink the session writes it into the run's events table (taking
    /// it every half second and at shutdown): do not [`take`](EventLog::take) it then, or what you take is not
    /// written. Without one, nothing takes it but you.
    pub fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    /// Largest record payload the ring accepts, in bytes.
    pub fn max_record_payload(&self) -> Result<usize, Error> {
        Ok(self.capture.lock().as_ref().ok_or(Error::Closed)?.backend.max_record_payload())
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.capture.lock().is_none() {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// The sinks that have failed so far: which, why and when (empty while all are healthy). Answered while the
    /// session runs and after it is shut down; cheap enough to poll every step.
    pub fn sink_failures(&self) -> Vec<SinkFailure> {
        self.health.failures()
    }

    /// Full mode: refuses to capture once a sink has failed, because what it captured would be lost — the engine
    /// learns it at the next capture, not at shutdown. Best-effort: goes on (losses are counted as `sink_error`).
    /// One atomic load while every sink is healthy.
    fn check_sinks(&self) -> Result<(), Error> {
        if self.policy.mode != Mode::Full
            || self.on_sink_failure == config::OnSinkFailure::Continue
            || !self.health.any_failed()
        {
            return Ok(());
        }
        let f = self.health.first().expect("a failure is listed before the flag is set");
        Err(Error::SinkFailed { sink: f.sink, message: f.message, at: f.at })
    }

    /// Runs `f` on the open session's capture side.
    fn with_capture<T>(&self, f: impl FnOnce(&mut Capture) -> Result<T, Error>) -> Result<T, Error> {
        f(self.capture.lock().as_mut().ok_or(Error::Closed)?)
    }

    /// Starts step `step`: `rows` gives `(request_id, token_position)` for each batch row, in batch order.
    /// Host backend; a CUDA session uses [`begin_step_on`](Self::begin_step_on).
    pub fn begin_step(&self, step: u64, rows: impl IntoIterator<Item = (u64, u32)>) -> Result<(), Error> {
        self.check_sinks()?;
        let batch = StepBatch::new(step, rows)?;
        self.step_boundary(&batch);
        if let Some(p) = &self.probes {
            p.step_begun(&batch);
        }
        self.with_capture(|c| c.backend.begin_step(&self.registry, batch))?;
        self.observer.steps.begun(Some(step));
        Ok(())
    }

    /// CUDA backend: starts step `step` on the engine's `stream` (before the step's kernels or graph replay, outside
    /// any graph capture). `rows` gives `(request_id, token_position)` per batch row, in batch order; the
    /// descriptor is installed on the device, stream-ordered, for the step's captures to read.
    ///
    /// In full mode this first waits (up to `policy.full_deadline_ms`) until the drain has room for everything the
    /// step can capture. When the deadline passes it returns an error, but the step *is* begun: its captures are
    /// then dropped on the device and counted as `deadline`, so the engine may go on (or stop).
    pub fn begin_step_on(
        &self,
        step: u64,
        rows: impl IntoIterator<Item = (u64, u32)>,
        stream: StreamRef,
    ) -> Result<(), Error> {
        self.check_sinks()?;
        let batch = StepBatch::new(step, rows)?;
        self.step_boundary(&batch);
        if let Some(p) = &self.probes {
            p.step_begun(&batch);
        }
        let begun = self.with_capture(|c| c.backend.begin_step_on(&self.registry, &batch, stream));
        // Past full mode's deadline the step is begun all the same (its captures are dropped and counted).
        if matches!(begun, Ok(()) | Err(Error::DeviceCapture(DeviceCaptureError::Deadline { .. }))) {
            self.observer.steps.begun(Some(step));
        }
        // With `on_deadline = "degrade"` the engine goes on without an error.
        self.step_policy.admitted(begun, || self.log_degraded_step(step, ""))
    }

    /// At each step's start: tallies the batch, sets the step's wait budget, and lets the policy manager decide (at
    /// most every few milliseconds); its rung changes reach the controls before this step's captures.
    fn step_boundary(&self, batch: &StepBatch) {
        // Decide first, from the steps whose captures are done (counting this one would rate a step that has not
        // produced yet).
        self.govern();
        self.steps.begun(batch);
        self.set_wait_budget();
    }

    /// A step begins: with `policy.max_step_overhead`, its wait budget (the step policy's) goes to the backend.
    fn set_wait_budget(&self) {
        if let Some(budget) = self.step_policy.step_begins(Instant::now(), self.waited()) {
            let _ = self.with_capture(|c| {
                c.backend.set_step_deadline(budget);
                Ok(())
            });
        }
    }

    /// What the session's full-mode waits took, in all so far.
    fn waited(&self) -> Duration {
        self.registry.stall().total().1
    }

    /// One decision of the policy manager, if it runs and a tick has passed.
    fn govern(&self) {
        let Some(g) = &self.governor else { return };
        let changes = g.tick(&self.registry, || self.sample());
        for (hp, c) in changes {
            self.log_rung_change(&hp, &c);
        }
    }

    /// What the policy manager measures now.
    fn sample(&self) -> governor::Sample {
        // The CUDA backend counts production on the device: fold it in (one small copy; skipped if busy). It also
        // counts the steps that began there — those begun inside a graph included, which the host never sees.
        self.fold_device_counters();
        let device_steps = self
            .capture
            .try_lock_for(Duration::from_millis(5))
            .and_then(|c| c.as_ref().and_then(|c| c.backend.steps_begun_on_device()));
        let stats = self.stats();
        let mut occupancy = Vec::new();
        let ring = stats.ring;
        if ring.capacity_bytes > 0 {
            occupancy.push((Budget::GpuRing, ring.used_bytes as f64 / ring.capacity_bytes as f64));
            if stats.backend == "cuda" {
                // Staging is as large as the ring; what it holds is lent to destinations.
                occupancy.push((Budget::PinnedStaging, ring.held_bytes as f64 / ring.capacity_bytes as f64));
            }
        }
        let live: Vec<_> = stats.destinations.iter().filter(|d| !d.failed).collect();
        let queued: u64 = live.iter().map(|d| d.queued_bytes).sum();
        let host_budget = match self.host_memory {
            Some(b) => b,
            None => live.iter().fold(0u64, |sum, d| sum.saturating_add(d.backlog_bytes)),
        };
        if host_budget > 0 {
            occupancy.push((Budget::HostBacklog, queued as f64 / host_budget as f64));
        }
        governor::Sample {
            steps: device_steps.unwrap_or_else(|| self.steps.steps.load(Ordering::Relaxed)),
            rows: self.steps.rows.load(Ordering::Relaxed),
            requests: self.steps.requests.load(Ordering::Relaxed),
            drained_bytes: stats.drain.bytes,
            delivered: live.iter().map(|d| (d.name.clone(), d.delivered_bytes)).collect(),
            occupancy,
        }
    }

    /// Writes a rung change into the events table (as it happens, like every drop).
    fn log_rung_change(&self, hp: &HookPoint, change: &RungChange) {
        let step = self.steps.last.load(Ordering::Relaxed);
        self.events.push(Event {
            unix_ns: unix_ns_now(),
            hookpoint: hp.spec().name.clone(),
            first_step: step,
            last_step: step,
            kind: EventKind::Rung,
            rung: change.to.name(),
            reason: change.budget.map_or("recovered", |b| b.name()).to_owned(),
            records_lost: 0,
            rows_lost: 0,
            detail: format!("{} -> {}: {}", change.from, change.to, change.detail),
            request_id: None,
            first_position: None,
            end_position: None,
        });
    }

    /// The engine did not compute `rows` token rows of request `request` — positions `first_position ..
    /// first_position + rows` — because its prefix cache held them (a prompt prefix shared with an earlier request),
    /// at step `step` (the step of the request's first computed rows). No hookpoint or probe sees such rows, so they
    /// are made visible instead: one `cached` row in the events table (`rows_lost` = `rows`, `detail` names the
    /// request and positions) and every probe's coverage of the request ([`Coverage::cached`]) — never read as
    /// "safe". Also counted in [`cached_rows`](Self::cached_rows).
    ///
    /// [`Coverage::cached`]: crate::probe::Coverage::cached
    pub fn note_cached(&self, step: u64, request: u64, first_position: u32, rows: u64) -> Result<(), Error> {
        if self.capture.lock().is_none() {
            return Err(Error::Closed);
        }
        if request == RowMeta::NO_REQUEST {
            return Err(Error::InvalidArgument(format!(
                "note_cached: request id {request} is NO_REQUEST (rows of no request), not a request"
            )));
        }
        let end = first_position as u64 + rows;
        if rows == 0 || end > u32::MAX as u64 + 1 {
            return Err(Error::InvalidArgument(format!(
                "note_cached: {rows} rows from position {first_position}: give 1 or more rows, ending at position 2^32 \
                 at most"
            )));
        }
        self.cached_rows.fetch_add(rows, Ordering::Relaxed);
        if let Some(p) = &self.probes {
            p.cached(request, rows);
        }
        self.events.push(Event {
            unix_ns: unix_ns_now(),
            hookpoint: String::new(),
            first_step: step,
            last_step: step,
            kind: EventKind::Cached,
            rung: String::new(),
            reason: "prefix_cache".into(),
            records_lost: 0,
            rows_lost: rows,
            detail: format!("request={request} positions={first_position}..{end}"),
            request_id: Some(request),
            first_position: Some(first_position as u64),
            end_position: Some(end),
        });
        Ok(())
    }

    /// Sets entry `key` of the run manifest's `metadata` object to `value` (replacing an earlier value of the key):
    /// what a reader of the run needs that the rows do not say — `attach` and the engine plugins write the
    /// `attention` entry (per layer: heads, head size, softmax scale, window, ...) that rebuilding attention patterns
    /// from `attn_q`/`attn_k` rows needs. Keys are 1 to [`METADATA_KEY_MAX`] characters of `A-Z a-z 0-9 _ . -`; a
    /// value's JSON text is at most [`METADATA_VALUE_MAX`] bytes. Written with the manifest when the session shuts
    /// down (`Error::Closed` after that).
    pub fn set_metadata(&self, key: &str, value: serde_json::Value) -> Result<(), Error> {
        check_metadata_key(key)?;
        let size = serde_json::to_string(&value).map_or(usize::MAX, |t| t.len());
        if size > METADATA_VALUE_MAX {
            return Err(Error::InvalidArgument(format!(
                "set_metadata: the value of `{key}` is {size} bytes of JSON; at most {METADATA_VALUE_MAX}"
            )));
        }
        // Checked under the map's own lock: shutdown takes the map (for the manifest) under it, so an entry is either
        // in the manifest or refused, never accepted and lost.
        let mut guard = self.metadata.lock();
        let entries = guard.as_mut().ok_or(Error::Closed)?;
        if !entries.contains_key(key) && entries.len() >= METADATA_ENTRIES_MAX {
            return Err(Error::InvalidArgument(format!(
                "set_metadata: `{key}` would be entry {} of the manifest's metadata; at most {METADATA_ENTRIES_MAX}",
                entries.len() + 1
            )));
        }
        entries.insert(key.to_owned(), value);
        Ok(())
    }

    /// The manifest's `metadata` entries set so far ([`set_metadata`](Self::set_metadata)).
    pub fn metadata(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        self.metadata.lock().clone().unwrap_or_default()
    }

    /// Token rows the engine took from its prefix cache, over the session ([`note_cached`](Self::note_cached)).
    pub fn cached_rows(&self) -> u64 {
        self.cached_rows.load(Ordering::Relaxed)
    }

    /// Full mode with `on_deadline = "degrade"`: a step went on without room; said in the events table.
    fn log_degraded_step(&self, step: u64, hookpoint: &str) {
        self.events.push(Event {
            unix_ns: unix_ns_now(),
            hookpoint: hookpoint.to_owned(),
            first_step: step,
            last_step: step,
            kind: EventKind::Stall,
            rung: String::new(),
            reason: "full_mode_deadline".into(),
            records_lost: 0,
            rows_lost: 0,
            detail: format!(
                "no room within the step's wait budget ({:.3} ms: policy.full_deadline_ms, or policy.max_step_overhead \
                 of the step time): the step went on as in best-effort (policy.on_deadline = \"degrade\")",
                self.step_policy.budget().as_secs_f64() * 1e3
            ),
            request_id: None,
            first_position: None,
            end_position: None,
        });
    }

    /// CUDA backend: starts a step from inside a CUDA graph being recorded on `stream` (or eagerly). The recorded
    /// kernel builds the step's batch descriptor at every replay from the engine's own device tensors (`batch`:
    /// request id per batch row, token position per row), numbers the step one past the previous step, and picks up
    /// control changes — so a best-effort replay needs no host call. Record the step's captures and
    /// [`end_step`](Self::end_step) in the same graph. Full mode: call [`admit_graph_step`](Self::admit_graph_step)
    /// before every replay; called eagerly, this admits the step itself, or takes the admission made since the last
    /// eager step (replays are not seen: admit once per graph-begun step, replayed or eager); past the deadline the
    /// step is begun with its captures dropped and counted, and the error returned, as
    /// [`begin_step_on`](Self::begin_step_on) does.
    pub fn begin_step_graph(&self, batch: &GraphBatch, stream: StreamRef) -> Result<(), Error> {
        let begun = self.with_capture(|c| c.backend.begin_step_graph(&self.registry, batch, stream));
        if matches!(begun, Ok(()) | Err(Error::DeviceCapture(DeviceCaptureError::Deadline { .. }))) {
            self.observer.steps.begun(None);
        }
        self.step_policy.admitted(begun, || self.log_degraded_step(crate::GRAPH_STEP, ""))
    }

    /// The request of each token row of a step begun on the device ([`begin_step_graph`](Self::begin_step_graph)),
    /// in batch order ([`RowMeta::NO_REQUEST`] for padding and rows of no request): what a host-begun step's batch
    /// gives the probes, which a step begun inside a CUDA graph cannot — their coverage denominator
    /// ([`Coverage::expected`]: rows the engine ran for each request, so that rows lost at a request's start or end
    /// count as unobserved). An engine that knows each pass's rows on the host calls it once per pass (replay or
    /// eager), before or after the pass. Nothing to do without probes; [`Error::Closed`] once the session is shut
    /// down. Rows of no request are nobody's coverage.
    ///
    /// [`Coverage::expected`]: crate::probe::Coverage::expected
    pub fn note_step_rows(&self, request_ids: &[u64]) -> Result<(), Error> {
        if self.capture.lock().is_none() {
            return Err(Error::Closed);
        }
        if let Some(p) = &self.probes {
            p.rows_ran(request_ids);
        }
        Ok(())
    }

    /// CUDA backend, full mode: admits the next replay of a CUDA graph whose step is begun inside it
    /// ([`begin_step_graph`](Self::begin_step_graph)). A replay cannot wait for ring space by itself, so full mode asks
    /// the host to, before every replay, on the engine's `stream` and outside graph recording: this waits (up to the
    /// step's wait budget: `policy.full_deadline_ms`, or `policy.max_step_overhead` of the step time) until the drain
    /// has room for everything such a step can capture, and reserves it. When there is room at once it is a host-side
    /// check of two counters — no CUDA call beyond a capture-status query — so a lossless replay costs what a
    /// best-effort one does. It also uploads control changes (as [`apply_controls`](Self::apply_controls)) and lets the
    /// policy manager decide.
    ///
    /// `rows` bounds the replayed step's batch rows; `None` takes the largest graph-begun step recorded in this session
    /// (right for an engine that records one graph per batch size). A replay that was not admitted may find the ring
    /// full: its records are dropped, counted as `ring_full`, and reported as a full-mode overrun.
    ///
    /// Past the budget it returns [`DeviceCaptureError::Deadline`] (with `policy.on_deadline = "degrade"`: logs the
    /// event and returns `Ok`); the replay's captures are then dropped on the device and counted as `deadline`, so the
    /// engine may replay all the same. Best-effort sessions: returns at once (graph replays need no host call there).
    pub fn admit_graph_step(&self, rows: Option<u32>, stream: StreamRef) -> Result<(), Error> {
        if self.policy.mode != Mode::Full {
            return self.with_capture(|_| Ok(()));
        }
        self.check_sinks()?;
        self.govern();
        self.set_wait_budget();
        let admitted = self.with_capture(|c| c.backend.admit_graph_step(&self.registry, rows, stream));
        self.step_policy.admitted(admitted, || self.log_degraded_step(crate::GRAPH_STEP, ""))
    }

    /// CUDA backend: uploads control changes (enable, every-N, rows) on the engine's `stream`, in stream order, so
    /// that graph replays whose steps were begun inside the graph ([`begin_step_graph`](Self::begin_step_graph);
    /// they make no host call) use them from the next replay on. Call it between replays, outside graph recording.
    /// Steps begun with [`begin_step_on`](Self::begin_step_on) pick changes up by themselves.
    ///
    /// With the policy manager on, this is also where it decides for graph-begun steps (counting them by the device's
    /// begin-step counter): call it between replays for its rung changes to reach the graph.
    ///
    /// Called before every replay by engines, so when no control changed since the last call that uploaded (and no
    /// policy manager decides) it returns at once: no capture lock, no CUDA call — the stream is then not checked
    /// either, nor is a call during graph recording refused (it has nothing to record).
    pub fn apply_controls(&self, stream: StreamRef) -> Result<(), Error> {
        let changes = self.registry.changes();
        if self.governor.is_none() && self.controls_applied.load(Ordering::Acquire) == changes {
            return Ok(());
        }
        self.govern();
        self.with_capture(|c| {
            c.backend.apply_controls(&self.registry, stream)?;
            // `changes` was read before the upload: a change made meanwhile makes the next call upload again. Stored
            // under the capture lock, so that a close (which takes the capture, then resets this) is never undone.
            self.controls_applied.store(changes, Ordering::Release);
            Ok(())
        })
    }

    /// CUDA backend with `ring.defer_captures`: starts copying the step's captures noted so far now, with one kernel
    /// on a side stream forked from the step's stream, so that the copy overlaps the engine's remaining work of the
    /// step (the LM head after the last layer, say); `end_step` makes the step's stream wait for it. Inside a graph
    /// recording the fork and the join are recorded too. Nothing to do otherwise (host backend, immediate captures).
    pub fn submit_captures(&self) -> Result<(), Error> {
        self.with_capture(|c| c.backend.submit_captures())
    }

    /// Ends the current step. CUDA backend with `ring.defer_captures`: launches the one kernel that copies the step's
    /// captures, on the step's stream; inside a graph recording, call it before the recording ends.
    pub fn end_step(&self) -> Result<(), Error> {
        self.with_capture(|c| c.backend.end_step())?;
        self.observer.steps.ended();
        Ok(())
    }

    /// CUDA backend with `ring.defer_captures`: ends the step begun inside a CUDA graph being recorded
    /// ([`begin_step_graph`](Self::begin_step_graph)) without putting its copy into the graph: the copy is held as
    /// `slot` (any number the engine picks per recorded graph; recording again replaces it), and the engine launches it
    /// after each replay of that graph with [`launch_held`](Self::launch_held). The graph then runs none of
    /// ringscope's kernels, and the copy runs beside the engine's work after the graph (an LM head, say). The captured
    /// tensors must keep their values from the end of each replay until the held copy has run: the engine makes its
    /// stream wait for it ([`join_held`](Self::join_held)) before it reuses them.
    pub fn hold_step(&self, slot: u32) -> Result<(), Error> {
        self.with_capture(|c| c.backend.hold_step(slot))?;
        self.observer.steps.ended();
        Ok(())
    }

    /// CUDA backend: launches held copy `slot` ([`hold_step`](Self::hold_step)) on a side stream after everything
    /// `stream` was given so far — call it right after each replay of the graph that held it, on the stream that
    /// replayed it, outside graph recording and between steps. Full mode: admit each replay first
    /// ([`admit_graph_step`](Self::admit_graph_step)), as for graphs that copy inside themselves.
    pub fn launch_held(&self, slot: u32, stream: StreamRef) -> Result<(), Error> {
        self.with_capture(|c| c.backend.launch_held(slot, stream))
    }

    /// CUDA backend: `stream` waits (in stream order) for the held copies launched so far — before the engine reuses
    /// the memory they read. The next step, control upload or admission waits for them too. Nothing to do when
    /// none is pending.
    pub fn join_held(&self, stream: StreamRef) -> Result<(), Error> {
        self.with_capture(|c| c.backend.join_held(stream))
    }

    /// Captures hookpoint `id`'s tensor for the current step: `batch rows × row bytes` contiguous bytes.
    pub fn capture(&self, id: u32, data: &[u8]) -> Result<CaptureOutcome, Error> {
        let hp = self.registry.get(id)?;
        self.capture_hookpoint(&hp, data)
    }

    /// Like [`capture`](Self::capture), by hookpoint name.
    pub fn capture_by_name(&self, name: &str, data: &[u8]) -> Result<CaptureOutcome, Error> {
        let hp = self.registry.by_name(name)?;
        self.capture_hookpoint(&hp, data)
    }

    fn capture_hookpoint(&self, hp: &HookPoint, data: &[u8]) -> Result<CaptureOutcome, Error> {
        let outcome = self.capture_rows(hp, data)?;
        if let Some(fused) = self.probes.as_ref().and_then(|p| p.fused.get(&hp.id())) {
            for f in fused {
                self.capture_fused(f, hp, data)?;
            }
        }
        Ok(outcome)
    }

    /// Host backend: a fused probe scores the rows on the engine's thread and captures only the scores (through
    /// buffers reused from capture to capture).
    fn capture_fused(&self, f: &crate::probes::Fused, hp: &HookPoint, data: &[u8]) -> Result<(), Error> {
        use crate::probes::HostScoring;
        let rows = data.len() / (hp.spec().row_bytes() as usize).max(1);
        let mut host = f.host.lock();
        let HostScoring { scorer, scores, bytes } = &mut *host;
        // Sized by the capture: memory the machine refuses is an error naming it, never an abort.
        let n = rows.saturating_mul(scorer.outputs());
        let refused = || {
            Error::Config(format!(
                "{}: the allocation of {} bytes for the scores of {rows} rows was refused; capture fewer rows at a \
                 time or free memory",
                f.scores.spec().name,
                n.saturating_mul(4)
            ))
        };
        scores.clear();
        scores.try_reserve_exact(n).map_err(|_| refused())?;
        scores.resize(n, 0.0);
        scorer.score_rows(hp.spec().dtype, data, scores).map_err(|e| Error::Config(e.to_string()))?;
        bytes.clear();
        bytes.try_reserve_exact(n.saturating_mul(4)).map_err(|_| refused())?;
        bytes.extend(scores.iter().flat_map(|s| s.to_le_bytes()));
        if scores.capacity() * 4 > HostScoring::KEEP_BYTES {
            *scores = Vec::new();
        }
        // Captured without the lock held (a full-mode capture may wait for ring space), then kept for the next one.
        let out = std::mem::take(bytes);
        drop(host);
        let captured = self.capture_rows(&f.scores, &out);
        if out.capacity() <= HostScoring::KEEP_BYTES {
            f.host.lock().bytes = out;
        }
        captured.map(|_| ())
    }

    fn capture_rows(&self, hp: &HookPoint, data: &[u8]) -> Result<CaptureOutcome, Error> {
        self.check_sinks()?;
        let step = self.steps.last.load(Ordering::Relaxed);
        if self.policy.mode == Mode::Full && self.step_policy.degrades() {
            // A step whose deadline passed (or whose wait budget is spent) goes on as in best-effort: nothing more of
            // it waits.
            let remaining = self.step_policy.remaining(self.waited());
            if remaining.is_zero() && self.step_policy.latch(step) {
                self.log_degraded_step(step, &hp.spec().name);
            }
            if self.step_policy.latched(step) {
                let best_effort = LossPolicy { mode: Mode::BestEffort, ..self.policy };
                return self.with_capture(|c| c.backend.capture(&best_effort, hp, data));
            }
            let policy = LossPolicy { full_deadline: remaining, ..self.policy };
            return match self.with_capture(|c| c.backend.capture(&policy, hp, data)) {
                Err(Error::HookPoint(HookPointError::Deadline { .. })) => {
                    if self.step_policy.latch(step) {
                        self.log_degraded_step(step, &hp.spec().name);
                    }
                    Ok(CaptureOutcome::Dropped(DropReason::Deadline))
                }
                other => other,
            };
        }
        self.with_capture(|c| c.backend.capture(&self.policy, hp, data))
    }

    /// CUDA backend: launches the capture of hookpoint `id` from `rows` contiguous rows at device address `ptr` on
    /// `stream`. The launch may be recorded into a CUDA graph: at each replay the kernel reads the step's batch
    /// descriptor and the hookpoint's controls from device memory, copies the selected rows into the ring, or drops
    /// and counts the record (best-effort, ring full). It never waits and never calls back into the host.
    ///
    /// `rows` may exceed the step's batch (padded graph batches): only the batch's rows are copied. `ptr` must be
    /// device memory of the session's device, aligned to the element size. Errors (null or misaligned pointer,
    /// memory of another device, a stream of another context, a tensor larger than a ring record can be) are
    /// returned before anything is launched. What cannot be checked — that the memory stays allocated until the
    /// captures reading it have run — is the promise of [`DevicePtr::from_raw`].
    pub fn capture_device(&self, id: u32, ptr: DevicePtr, rows: u32, stream: StreamRef) -> Result<(), Error> {
        self.capture_device_rows(id, ptr, rows, Rows::Batch, stream)
    }

    /// CUDA backend: like [`capture_device`](Self::capture_device), from a source that holds one row per request —
    /// the step's *last* row of each request, in batch order: what a model computes for each request's last token
    /// only (the logits of a prefill that keeps only the last token's). Row `k` is captured (and scored by fused
    /// probes) as the step's `k`-th last row per request, with that row's request and position. Refused for a
    /// hookpoint that selects a list of batch rows, and in steps begun inside a CUDA graph.
    pub fn capture_device_last_rows(&self, id: u32, ptr: DevicePtr, rows: u32, stream: StreamRef) -> Result<(), Error> {
        self.capture_device_rows(id, ptr, rows, Rows::LastPerRequest, stream)
    }

    fn capture_device_rows(
        &self,
        id: u32,
        ptr: DevicePtr,
        rows: u32,
        source: Rows,
        stream: StreamRef,
    ) -> Result<(), Error> {
        let hp = self.registry.get(id)?;
        self.check_sinks()?;
        let fused = self.probes.as_ref().and_then(|p| p.fused.get(&id));
        self.with_capture(|c| {
            c.backend.capture_device(&hp, ptr, rows, source, stream.clone())?;
            // Fused probes: a score kernel on the same rows, then the capture of the scores (both recordable).
            for f in fused.into_iter().flatten() {
                c.backend.capture_fused_device(f.index, &hp, &f.scores, ptr, rows, source, stream.clone())?;
            }
            Ok(())
        })
    }

    /// CUDA backend: rows of hookpoint `id` at or past the `u32` stored at device address `ptr` are padding (read at
    /// replay time, for graphs captured at a padded batch size): neither captured nor scored — the scores of the
    /// hookpoint's fused probes take the same bound. `None` removes it. Takes effect at the next step.
    pub fn set_valid_rows_device(&self, id: u32, ptr: Option<DevicePtr>) -> Result<(), Error> {
        self.registry.get(id)?;
        let fused = self.probes.as_ref().and_then(|p| p.fused.get(&id));
        self.with_capture(|c| {
            c.backend.set_valid_rows_device(id, ptr)?;
            // A fused probe's kernel bounds the rows it scores by its scores hookpoint's controls.
            for f in fused.into_iter().flatten() {
                c.backend.set_valid_rows_device(f.scores.id(), ptr)?;
            }
            // Not counted by the registry: the next apply_controls uploads it.
            self.controls_applied.store(NOT_APPLIED, Ordering::Release);
            Ok(())
        })
    }

    /// Folds the device-side counters into the registry (CUDA backend; nothing to do on the host backend), unless
    /// the engine's capture path stays busy for more than a few milliseconds: a full-mode `capture` or `begin_step`
    /// may be waiting there for ring space, and a monitoring call must not wait behind it. Then the counters folded
    /// last time stand.
    fn fold_device_counters(&self) {
        if let Some(mut guard) = self.capture.try_lock_for(std::time::Duration::from_millis(5)) {
            if let Some(c) = guard.as_mut() {
                c.backend.fold_counters(&self.registry);
            }
        }
    }

    /// Subscribes an online consumer (a probe, a monitor) to the records that pass `filter`: every record captured
    /// after this returns, in stream order. See [`Subscription`] for what happens when it falls behind.
    pub fn subscribe(&self, name: &str, filter: Filter) -> Result<Subscription, Error> {
        let guard = self.drain.lock();
        let drain = guard.as_ref().ok_or(Error::Closed)?;
        Ok(drain.subscribe(name, filter)?)
    }

    /// Per-hookpoint counters now (records in flight are neither exported nor dropped yet). On the CUDA backend
    /// this reads the device counters first (one small copy on a private stream; the engine is not synchronised),
    /// unless the engine's thread stays inside a capture call (for instance waiting for ring space in full mode):
    /// it waits at most 5 ms for the engine, and the device counts are then those read last time.
    pub fn accounting(&self) -> AccountingSnapshot {
        self.fold_device_counters();
        self.registry.accounting()
    }

    /// The session's numbers now: steps and step time, ring occupancy, what the drain moved, each sink's and
    /// consumer's progress and lag, each hookpoint's counters, production and rung ([`SessionStats`] says what each
    /// means, per backend). Counters are cumulative: difference two snapshots for rates.
    ///
    /// Cheap enough to call every step from any thread: atomic loads and short locks that the engine's capture path
    /// does not wait on; it allocates per hookpoint and per destination, never per record; no device call (so on
    /// the CUDA backend the device-counted hookpoint counters are those of the last [`accounting`](Self::accounting)
    /// call). Answers after shutdown too, with the final numbers.
    pub fn stats(&self) -> SessionStats {
        self.observer.stats()
    }

    /// [`stats`](Self::stats) in the Prometheus text exposition format (0.0.4), for an engine that serves its own
    /// `/metrics`; the names and labels are in [`crate::metrics`]. The same text the `[metrics] listen` endpoint
    /// serves.
    pub fn metrics_text(&self) -> String {
        crate::metrics::exposition(&self.stats())
    }

    /// The address the metrics endpoint listens on (`[metrics] listen`; with port 0, the port the system chose),
    /// `None` when none is configured. The endpoint stops at shutdown.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Stops capturing, drains every record still in the ring, closes the sinks, and checks that every record
    /// produced was exported, dropped or sampled out. Later calls (and captures) return [`Error::Closed`].
    pub fn shutdown(&self) -> Result<Report, Error> {
        let mut capture = self.capture.lock().take().ok_or(Error::Closed)?;
        // apply_controls takes its slow path from here, which finds the session closed.
        self.controls_applied.store(NOT_APPLIED, Ordering::Release);
        // From here `set_metadata` is refused (Closed): what it accepted before is in the manifest.
        let metadata = self.metadata.lock().take().unwrap_or_default();
        if let Some(mut server) = self.metrics.lock().take() {
            server.stop();
        }
        let device_errors = capture.backend.close(&self.registry);
        // The capture side goes first (its work has completed; the host backend's producer leaving is what ends the
        // drain): its memory is freed now, before the drain frees the ring's in the background.
        drop(capture);
        let drain = self.drain.lock().take().ok_or(Error::Closed)?;
        let mut drain = drain.join()?;
        drain.errors.extend(device_errors);
        // The drain has ended the probes' stream: their consumer scores what is left and stops.
        if let Some(p) = &self.probes {
            p.join();
            drain.errors.extend(p.errors().into_iter().map(|e| format!("probes: {e}")));
        }
        // Last: the drain and every sink have let go of their records, so every drop is counted and logged, and the
        // table's rows lost add up to the accounting's.
        let mut events = Vec::new();
        if let Some(recorder) = self.recorder.lock().take() {
            let written = recorder.finish()?;
            drain.errors.extend(written.errors);
            events = written.files;
        }
        let files = self.files.iter().flat_map(|f| f.lock().clone()).collect();
        let report = Report {
            accounting: self.registry.accounting(),
            drain,
            files,
            run_dir: self.run_dir.clone(),
            sink_failures: self.health.failures(),
            events,
        };
        if let Some(dir) = &report.run_dir {
            let written =
                crate::manifest::write(dir, self.rank, self.storage.as_ref(), &self.registry, &report, &metadata);
            // The run's files are final: another session may now look (and will find this rank written).
            self.run_lock.lock().take();
            if let Err(source) = written {
                let path = dir.join(crate::manifest::file_name(self.rank));
                return Err(Error::Manifest { path, source, report: Box::new(report) });
            }
        }
        if let Err(e) = report.accounting.check() {
            return Err(Error::Unbalanced { error: e, report: Box::new(report) });
        }
        Ok(report)
    }

    fn probes(&self) -> Result<&crate::probes::Probes, Error> {
        self.probes.as_ref().ok_or_else(|| Error::Config("no probes: configure them with [[probes]]".into()))
    }

    /// The probes' alerts, as they are raised (an alert is raised once per request, probe and output). Every
    /// receiver takes from the same queue (`alerts.queue` long; alerts that find it full are counted in
    /// [`alerts_dropped`](Self::alerts_dropped), and the requests' reports still say they alerted). An error when
    /// the session has no probes.
    pub fn alerts(&self) -> Result<crate::probe::AlertReceiver, Error> {
        Ok(self.probes()?.alerts())
    }

    /// Alerts that found the alerts queue full.
    pub fn alerts_dropped(&self) -> u64 {
        self.probes.as_ref().map_or(0, |p| p.alerts_dropped())
    }

    /// What probe `probe` has seen of `request` so far: aggregated scores, alerts, coverage. `None` when it has not
    /// seen the request (or forgot it: `alerts.max_requests`).
    pub fn probe_request(&self, probe: &str, request: u64) -> Result<Option<crate::probe::RequestReport>, Error> {
        self.probes()?.request(probe, request)
    }

    /// Every request probe `probe` tracks, by request id.
    pub fn probe_requests(&self, probe: &str) -> Result<Vec<crate::probe::RequestReport>, Error> {
        self.probes()?.requests(probe)
    }

    /// The engine has finished `request`: each probe's final report on it (then forgotten), and its stop flag is
    /// lowered. Call it once the request's last step has been drained (see [`wait_probes`](Self::wait_probes)) to
    /// count every row.
    pub fn finish_request(&self, request: u64) -> Vec<crate::probe::RequestReport> {
        self.probes.as_ref().map_or_else(Vec::new, |p| p.finish(request))
    }

    /// Whether a probe with `action = "stop"` has flagged `request`.
    pub fn is_flagged(&self, request: u64) -> bool {
        self.probes.as_ref().is_some_and(|p| p.flags().is_raised(request))
    }

    /// The stop-flag table an engine reads without asking the session (on the CUDA backend, pinned memory mapped
    /// into the device). `None` without probes.
    pub fn probe_flags(&self) -> Option<Arc<crate::probe::Flags>> {
        self.probes.as_ref().map(|p| p.flags().clone())
    }

    /// Each probe's counts, in configuration order.
    pub fn probe_stats(&self) -> Vec<crate::probe::ProbeStats> {
        self.probes.as_ref().map_or_else(Vec::new, |p| p.stats())
    }

    /// Waits until every record captured so far has left the ring (offered to every destination) and the probes
    /// have scored every one delivered to them, or `timeout` passes. Returns whether that happened in time. (File
    /// sinks may still hold records for their batches: this does not wait for files to be committed.)
    pub fn wait_probes(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            // Published records (device counters folded first on the CUDA backend) against what the drain has
            // offered; then the probes' own queue and work.
            let published: u64 = self.accounting().hookpoints.iter().map(|(_, c)| c.published.records).sum();
            let offered = self.observer.monitor.drain().records;
            if offered >= published && self.probes.as_ref().is_none_or(|p| p.idle()) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Waits until every record captured so far is exported or dropped, or `timeout` passes. Returns whether that
    /// happened in time. File sinks export a record when its file is committed: once every record captured so far has
    /// left the ring, they are asked to commit their open files (after writing every record queued for them), so
    /// that everything captured so far is in committed, readable files; the next records go to new files. Meant for
    /// a pause in capture (between batches of work, before reading a dump): while captures go on, new records are
    /// always in flight and this waits until `timeout`.
    pub fn wait_drained(&self, timeout: Duration) -> bool {
        // Under continuous capture every commit would start new files: at most one commit per this interval.
        const COMMIT_EVERY: Duration = Duration::from_millis(50);
        let deadline = std::time::Instant::now() + timeout;
        let mut next_commit = std::time::Instant::now();
        loop {
            let acc = self.accounting();
            if acc.hookpoints.iter().all(|(_, c)| c.in_flight() == 0) {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            // Every record published so far offered to the destinations (device counters folded first on the CUDA
            // backend): the sinks can commit everything captured before this call.
            let published: u64 = acc.hookpoints.iter().map(|(_, c)| c.published.records).sum();
            if now >= next_commit && self.observer.monitor.drain().records >= published {
                if !self.commits.commit(deadline) {
                    return false;
                }
                next_commit = std::time::Instant::now() + COMMIT_EVERY;
                continue;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Without an explicit shutdown, still drain and close the sinks so that nothing already captured is lost.
        if self.capture.lock().is_some() {
            let _ = self.shutdown();
        }
    }
}
