//! `Session`: one ring, its hookpoints, its drain and its policy, wired from one [`Config`].

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use ringscope_exporter::{
    arrow_ipc_sink, parquet_sink, CommittedFile, CommittedFiles, Drain, DrainOptions, DrainReport, Filter, Sink,
    Subscription,
};
use ringscope_hookpoint::{capture_host, CaptureOutcome, HookPoint, HookPointSpec, Registry, StepBatch};
use ringscope_policy::{AccountingSnapshot, LossPolicy};
use ringscope_ring::Producer;

use crate::config::Config;
use crate::Error;

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
}

impl Report {
    /// Activation throughput of the drain in GB/s (ring bytes over the drain's lifetime).
    pub fn drain_gb_per_s(&self) -> f64 {
        self.drain.bytes as f64 / self.drain.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

struct Capture {
    producer: Producer,
    batch: Option<StepBatch>,
}

/// A running ringscope session (host backend).
///
/// Typical engine loop: [`begin_step`](Self::begin_step) with the step's batch descriptor, one
/// [`capture`](Self::capture) per hookpoint, [`end_step`](Self::end_step); at the end [`shutdown`](Self::shutdown).
/// All methods take `&self`; captures are serialised internally (the ring has one producer), so one engine thread
/// should drive them.
pub struct Session {
    registry: Arc<Registry>,
    policy: LossPolicy,
    /// `None` once shut down.
    capture: Mutex<Option<Capture>>,
    drain: Mutex<Option<Drain>>,
    files: Vec<CommittedFiles>,
    run_dir: Option<std::path::PathBuf>,
}

/// Builds a [`Session`]: the config plus the sinks its drain writes to.
pub struct SessionBuilder {
    config: Config,
    sinks: Vec<(Box<dyn Sink>, Filter)>,
}

impl SessionBuilder {
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

    /// Validates the config, allocates the ring, registers the configured hookpoints and starts the drain.
    pub fn start(self) -> Result<Session, Error> {
        let config = self.config;
        let policy = config.policy.loss_policy();
        policy.validate()?;
        let capacity = usize::try_from(config.ring.capacity.0)
            .map_err(|_| Error::Config(format!("ring.capacity {} does not fit in memory", config.ring.capacity.0)))?;
        let (producer, consumer) =
            ringscope_ring::channel(capacity).map_err(|e| Error::Config(format!("ring.capacity: {e}")))?;

        let registry = Arc::new(Registry::new());
        for hc in &config.hookpoints {
            let (spec, selection) = hc.resolve()?;
            let hp = registry.register(spec)?;
            hp.control.set_selection(selection)?;
            hp.control.set_every_n_steps(hc.every_n_steps)?;
            hp.control.set_enabled(hc.enabled);
        }
        let options = DrainOptions {
            backlog_bytes: usize::try_from(config.export.backlog.0).unwrap_or(usize::MAX),
            policy,
            ..DrainOptions::default()
        };
        let mut sinks = self.sinks;
        let mut files = Vec::new();
        let dataset = config.export.dataset_options();
        let run_dir = (config.export.parquet || config.export.arrow_ipc).then(|| dataset.run_dir());
        let threads = config.export.threads;
        if threads == 0 || threads > 256 {
            return Err(Error::Config(format!("export.threads = {threads}: use 1 to 256")));
        }
        for shard in 0..threads {
            let filter = if threads == 1 { Filter::all() } else { Filter::shard(threads, shard) };
            if config.export.parquet {
                let (sink, committed) = parquet_sink(dataset.clone(), config.export.zstd_level)
                    .map_err(|e| Error::Config(format!("export.parquet: {}", e.message)))?;
                sinks.push((Box::new(sink), filter.clone()));
                files.push(committed);
            }
            if config.export.arrow_ipc {
                let (sink, committed) = arrow_ipc_sink(dataset.clone())
                    .map_err(|e| Error::Config(format!("export.arrow_ipc: {}", e.message)))?;
                sinks.push((Box::new(sink), filter));
                files.push(committed);
            }
        }
        let drain = Drain::spawn(consumer, registry.clone(), sinks, options)?;
        Ok(Session {
            registry,
            policy,
            capture: Mutex::new(Some(Capture { producer, batch: None })),
            drain: Mutex::new(Some(drain)),
            files,
            run_dir,
        })
    }
}

impl Session {
    /// Starts building a session from `config`.
    pub fn builder(config: Config) -> SessionBuilder {
        SessionBuilder { config, sinks: Vec::new() }
    }

    /// A session with no sinks (records are drained and counted, nothing is written).
    pub fn new(config: Config) -> Result<Session, Error> {
        Session::builder(config).start()
    }

    /// Registers another hookpoint; returns its id.
    pub fn register(&self, spec: HookPointSpec) -> Result<u32, Error> {
        self.check_open()?;
        Ok(self.registry.register(spec)?.id)
    }

    /// The hookpoint named `name` (for its controls: enable, sampling, row selection).
    pub fn hookpoint(&self, name: &str) -> Result<Arc<HookPoint>, Error> {
        Ok(self.registry.by_name(name)?)
    }

    /// The session's hookpoints.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The loss policy in force.
    pub fn policy(&self) -> LossPolicy {
        self.policy
    }

    /// Largest record payload the ring accepts, in bytes.
    pub fn max_record_payload(&self) -> Result<usize, Error> {
        let guard = self.capture.lock();
        Ok(guard.as_ref().ok_or(Error::Closed)?.producer.max_payload_len())
    }

    fn check_open(&self) -> Result<(), Error> {
        if self.capture.lock().is_none() {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Starts step `step`: `rows` gives `(request_id, token_position)` for each batch row, in batch order.
    pub fn begin_step(&self, step: u64, rows: impl IntoIterator<Item = (u64, u32)>) -> Result<(), Error> {
        let batch = StepBatch::new(step, rows)?;
        let mut guard = self.capture.lock();
        let capture = guard.as_mut().ok_or(Error::Closed)?;
        if let Some(open) = &capture.batch {
            return Err(Error::StepOpen { open: open.step(), new: step });
        }
        capture.batch = Some(batch);
        Ok(())
    }

    /// Ends the current step.
    pub fn end_step(&self) -> Result<(), Error> {
        let mut guard = self.capture.lock();
        let capture = guard.as_mut().ok_or(Error::Closed)?;
        capture.batch.take().ok_or(Error::NoStep)?;
        Ok(())
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
        let mut guard = self.capture.lock();
        let capture = guard.as_mut().ok_or(Error::Closed)?;
        let batch = capture.batch.as_ref().ok_or(Error::NoStep)?;
        Ok(capture_host(&mut capture.producer, &self.policy, hp, batch, data)?)
    }

    /// Subscribes an online consumer (a probe, a monitor) to the records that pass `filter`: every record captured
    /// after this returns, in stream order. See [`Subscription`] for what happens when it falls behind.
    pub fn subscribe(&self, name: &str, filter: Filter) -> Result<Subscription, Error> {
        let guard = self.drain.lock();
        let drain = guard.as_ref().ok_or(Error::Closed)?;
        Ok(drain.subscribe(name, filter)?)
    }

    /// Per-hookpoint counters now (records in flight are neither exported nor dropped yet).
    pub fn accounting(&self) -> AccountingSnapshot {
        self.registry.accounting()
    }

    /// Stops capturing, drains every record still in the ring, closes the sinks, and checks that every record
    /// produced was exported, dropped or sampled out. Later calls (and captures) return [`Error::Closed`].
    pub fn shutdown(&self) -> Result<Report, Error> {
        let capture = self.capture.lock().take().ok_or(Error::Closed)?;
        // Dropping the producer tells the drain that nothing more will come; it stops once the ring is empty.
        drop(capture);
        let drain = self.drain.lock().take().ok_or(Error::Closed)?;
        let drain = drain.join()?;
        let files = self.files.iter().flat_map(|f| f.lock().clone()).collect();
        let report = Report { accounting: self.registry.accounting(), drain, files, run_dir: self.run_dir.clone() };
        if let Some(dir) = &report.run_dir {
            crate::manifest::write(dir, &self.registry, &report)?;
        }
        if let Err(e) = report.accounting.check() {
            return Err(Error::Unbalanced { error: e, report: Box::new(report) });
        }
        Ok(report)
    }

    /// Waits until every record captured so far is exported or dropped (file sinks export a record when its file
    /// is committed), or `timeout` passes. Returns whether that happened in time.
    pub fn wait_drained(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let acc = self.registry.accounting();
            if acc.hookpoints.iter().all(|(_, c)| c.in_flight() == 0) {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
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
