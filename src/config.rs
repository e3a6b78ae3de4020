//! Session configuration: one TOML document (or the same structure built in code).
//!
//! ```toml
//! [ring]
//! capacity = "64 MiB"        # or a plain number of bytes
//!
//! [policy]
//! mode = "full"              # or "best_effort"
//! full_deadline_ms = 5000
//! # Budgets (all optional). In best-effort mode, any of them turns on the policy manager: it moves hookpoints
//! # down a ladder (every-N steps → last row per request → fp8 downcast → off), lowest priority first, so that
//! # what capture produces fits, and back up when there is room again.
//! drain_rate = "20 GB/s"     # the drain's byte-rate cap (the PCIe share for observability)
//! gpu_memory = "2 GiB"       # device ring (ring.capacity must fit in it, and hold one step's worst case)
//! pinned_memory = "2 GiB"    # pinned staging of the CUDA drain (as large as the ring)
//! host_memory = "8 GiB"      # records queued for all sinks and consumers together
//! high_watermark = 0.75      # a memory budget this full means the path is saturated
//! low_watermark = 0.25       # every budget this empty means there is room to recover
//! dwell_ms = 500             # least time between changes of the plan
//! max_every_n = 8            # the ladder's sampling rungs: every 2, 3, …, 8 steps
//! on_deadline = "error"      # full mode, a step that found no room by the deadline: "error" or "degrade"
//! max_step_overhead = 0.01   # full mode with on_deadline = "degrade": a step waits at most 1% of the step time
//!
//! [[hookpoints]]
//! name = "layers.0.resid"
//! site = "residual"          # residual | attention_output | mlp_output | logits | { custom = "label" }
//! layer = 0
//! dtype = "bf16"
//! row_width = 2048
//! rows = "all"               # all | last_per_request | [0, 5, 7]
//! every_n_steps = 1
//! enabled = true
//! priority = 0               # the policy manager degrades lower priorities first
//!
//! [[probes]]                 # a linear probe on a configured hookpoint (docs/probes.md)
//! name = "deception"
//! hookpoint = "layers.0.resid" # or layer = 0 and site = "residual"
//! weights = "deception.safetensors" # [K, d] (+ bias [K]) or a .npy; relative to the config file
//! aggregate = "mean"         # per_token | mean | max | ema (ema_alpha) | window (window)
//! threshold = 1.5            # or thresholds = [one per output]
//! min_tokens = 8             # no alert before 8 scored tokens of a request
//! action = "alert"           # alert | stop (raises the request's stop flag)
//! mode = "consumer"          # consumer (a session thread scores delivered rows) | fused (scores in the capture path)
//!
//! [alerts]                   # what the probes share
//! flag_slots = 4096          # the stop-flag table: request R flagged when slot[R % 4096] == R + 1
//! max_requests = 65536       # requests each probe tracks at once
//! queue = 65536              # alerts queued for the application
//!
//! [metrics]                  # optional; absent: no HTTP endpoint
//! listen = "127.0.0.1:9464"  # serve GET /metrics (Prometheus text) here; port 0: any free port
//! allow_remote = false       # true: allow a non-loopback address (the endpoint has no authentication)
//! ```
//!
//! Unknown keys are errors (a typo must not silently fall back to a default).
//!
//! `[metrics]`: the session's statistics ([`Session::stats`](crate::Session::stats)) in the Prometheus text
//! format, on a local HTTP endpoint served by one thread of the session. Off unless `listen` is set. `listen` is an
//! IP address and port (`"127.0.0.1:9464"`, `"[::1]:9464"`; no host names); a non-loopback address is refused
//! unless `allow_remote = true`. An engine that serves its own `/metrics` calls
//! [`Session::metrics_text`](crate::Session::metrics_text) instead.

use std::time::Duration;

use ringscope_hookpoint::{HookPointSpec, RowSelection, SiteKind};
use ringscope_policy::{Ladder, LossPolicy, Mode, PlannerSettings};
use ringscope_ring::record::{align_up, HEADER_LEN, ROW_META_LEN};
use ringscope_ring::DType;
use serde::Deserialize;

use crate::Error;

/// A whole session configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The ring.
    #[serde(default)]
    pub ring: RingConfig,
    /// Loss policy.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Export: sinks and consumers.
    #[serde(default)]
    pub export: ExportConfig,
    /// Hookpoints registered at start (more can be registered later).
    #[serde(default)]
    pub hookpoints: Vec<HookPointConfig>,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Online probes (`[[probes]]`).
    #[serde(default)]
    pub probes: Vec<ProbeConfig>,
    /// What probes share: alerts queue, stop flags, requests tracked (`[alerts]`).
    #[serde(default)]
    pub alerts: AlertsConfig,
}

/// One `[[probes]]` entry: a linear probe on one hookpoint (see [`crate::probe`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeConfig {
    /// Unique name; a fused probe's scores are the hookpoint `probes.<name>`.
    pub name: String,
    /// The hookpoint it reads (or give `layer` and `site`).
    #[serde(default)]
    pub hookpoint: Option<String>,
    /// The layer of the hookpoint it reads (with `site`).
    #[serde(default)]
    pub layer: Option<u32>,
    /// The site of the hookpoint it reads (with `layer`).
    #[serde(default)]
    pub site: Option<SiteKind>,
    /// Weights: a `.safetensors` file (tensor `weight`, or `tensor`; a `bias` tensor is used when present) or a
    /// `.npy` file, `[K, d]` or `[d]`. A relative path is relative to the config file's directory
    /// ([`Config::from_file`]) or to the working directory.
    pub weights: String,
    /// The weights' tensor name in a safetensors file.
    #[serde(default)]
    pub tensor: Option<String>,
    /// Biases: `[b0, b1, ...]` or a `.npy` file (default: the safetensors `bias` tensor, else zeros).
    #[serde(default)]
    pub bias: Option<BiasConfig>,
    /// `per_token`, `mean` (default), `max`, `ema` (with `ema_alpha`) or `window` (with `window`).
    #[serde(default = "mean")]
    pub aggregate: String,
    /// The newest token's weight for `aggregate = "ema"`, in (0, 1].
    #[serde(default)]
    pub ema_alpha: Option<f64>,
    /// Tokens per window for `aggregate = "window"`.
    #[serde(default)]
    pub window: Option<u32>,
    /// One threshold for every output (a float32 number: read as f64 and refused outside float32's finite range,
    /// never rounded to infinity).
    #[serde(default)]
    pub threshold: Option<f64>,
    /// One threshold per output.
    #[serde(default)]
    pub thresholds: Option<Vec<f64>>,
    /// `alert` (default) or `stop` (also raises the request's stop flag).
    #[serde(default = "alert")]
    pub action: String,
    /// Names of the outputs.
    #[serde(default)]
    pub labels: Vec<String>,
    /// No alert before a request has this many scored tokens (default 1).
    #[serde(default = "one")]
    pub min_tokens: u32,
    /// `consumer` (default: scores the rows the drain delivers, on a thread of the session) or `fused` (scores in
    /// the capture path — a kernel on the CUDA backend, the engine's thread on the host backend — and puts only the
    /// K scores per row into the ring, as hookpoint `probes.<name>`, which file sinks write as its own table).
    #[serde(default)]
    pub mode: ProbeMode,
}

fn mean() -> String {
    "mean".into()
}

fn alert() -> String {
    "alert".into()
}

/// A probe's biases: inline numbers or a `.npy` file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum BiasConfig {
    /// `[b0, b1, ...]` (float32 numbers, checked as thresholds are).
    Values(Vec<f64>),
    /// A `.npy` file.
    File(String),
}

/// Where a probe scores (`probes[].mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeMode {
    /// On a consumer thread, from the records the drain delivers.
    #[default]
    Consumer,
    /// In the capture path; only the scores enter the ring.
    Fused,
}

/// `[alerts]`: what the session's probes share.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsConfig {
    /// Slots of the stop-flag table (request `R` is flagged when `slot[R % flag_slots] == R + 1`).
    pub flag_slots: u32,
    /// Requests each probe tracks at once (the least recently scored are forgotten past it, and counted).
    pub max_requests: u32,
    /// Alerts queued for the application; past it, alerts are counted as dropped (the requests' reports still say
    /// they alerted).
    pub queue: u32,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig { flag_slots: 4096, max_requests: 65536, queue: 65536 }
    }
}

impl ProbeConfig {
    /// Reads the weights (and bias file) and checks everything that does not depend on the hookpoint.
    pub fn definition(&self) -> Result<ringscope_probe::ProbeDef, Error> {
        use ringscope_probe::{Aggregation, ProbeDef, Target};
        let name = &self.name;
        let bad = |m: String| Error::Config(format!("probes `{name}`: {m}"));
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(Error::Config(format!("probes: name `{name}` must be non-empty, without spaces")));
        }
        let target = match (&self.hookpoint, self.layer, &self.site) {
            (Some(h), None, None) => Target::HookPoint(h.clone()),
            (None, Some(layer), Some(site)) => Target::Layer { layer, site: site.name().to_owned() },
            _ => return Err(bad("give either hookpoint, or layer and site".into())),
        };
        // Scores, thresholds and biases are float32: a number TOML holds as f64 outside float32's finite range would
        // become ±infinity (a threshold no score reaches), or NaN — refused, naming the key.
        let f32_of = |key: &str, v: f64| -> Result<f32, Error> {
            if v.is_finite() && v.abs() <= f32::MAX as f64 {
                Ok(v as f32)
            } else {
                Err(bad(format!(
                    "{key} = {v:e} is not a finite float32 number (|x| ≤ 3.4028235e38): probe scores are float32"
                )))
            }
        };
        let ema_alpha = self.ema_alpha.map(|a| f32_of("ema_alpha", a)).transpose()?;
        let aggregation = Aggregation::from_name(&self.aggregate, ema_alpha, self.window).map_err(bad)?;
        let thresholds = match (self.threshold, &self.thresholds) {
            (Some(t), None) => vec![f32_of("threshold", t)?],
            (None, Some(t)) => {
                t.iter().enumerate().map(|(i, &v)| f32_of(&format!("thresholds[{i}]"), v)).collect::<Result<_, _>>()?
            }
            _ => return Err(bad("give threshold (one for every output) or thresholds (one per output)".into())),
        };
        let action = self.action.parse().map_err(bad)?;
        if self.weights.trim().is_empty() {
            return Err(bad("weights = \"\" names no file: give the path of a .safetensors or .npy file".into()));
        }
        let (weights, file_bias) =
            ringscope_probe::load_weights(name, std::path::Path::new(&self.weights), self.tensor.as_deref())
                .map_err(|e| Error::Config(format!("probes: {e} (probes `{name}`: weights = {:?})", self.weights)))?;
        let bias = match &self.bias {
            Some(BiasConfig::Values(v)) => {
                v.iter().enumerate().map(|(i, &b)| f32_of(&format!("bias[{i}]"), b)).collect::<Result<_, _>>()?
            }
            Some(BiasConfig::File(f)) if f.trim().is_empty() => {
                return Err(bad("bias = \"\" names no file: give a .npy file or the numbers, bias = [..]".into()))
            }
            Some(BiasConfig::File(f)) => ringscope_probe::load_bias(name, std::path::Path::new(f))
                .map_err(|e| Error::Config(format!("probes: {e}")))?,
            None => file_bias.unwrap_or_default(),
        };
        Ok(ProbeDef {
            name: name.clone(),
            target,
            weights,
            bias,
            aggregation,
            thresholds,
            action,
            labels: self.labels.clone(),
            min_tokens: self.min_tokens,
        })
    }

    /// Makes relative file paths relative to `dir`.
    fn resolve_paths(&mut self, dir: &std::path::Path) {
        let abs = |p: &mut String| {
            // An empty path stays empty (and is refused by name), rather than becoming the config file's directory.
            if !p.is_empty() && std::path::Path::new(p.as_str()).is_relative() {
                *p = dir.join(&*p).display().to_string();
            }
        };
        abs(&mut self.weights);
        if let Some(BiasConfig::File(f)) = &mut self.bias {
            abs(f);
        }
    }
}

/// `[metrics]`: the optional Prometheus endpoint (module docs).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Where to serve `GET /metrics`: an IP address and port. `None` (the default): no endpoint.
    #[serde(default)]
    pub listen: Option<String>,
    /// Allow `listen` to be an address other hosts can reach (the endpoint has no authentication).
    #[serde(default)]
    pub allow_remote: bool,
}

impl MetricsConfig {
    /// The address to listen on, checked: `None` when no endpoint is configured.
    pub fn listen_addr(&self) -> Result<Option<std::net::SocketAddr>, Error> {
        let Some(text) = &self.listen else { return Ok(None) };
        let addr: std::net::SocketAddr = text.trim().parse().map_err(|_| {
            Error::Config(format!(
                "metrics.listen = {text:?} is not an IP address and port; write e.g. \"127.0.0.1:9464\" (host names \
                 are not resolved)"
            ))
        })?;
        if !addr.ip().is_loopback() && !self.allow_remote {
            return Err(Error::Config(format!(
                "metrics.listen = {text:?} is not a loopback address, so other hosts could read the metrics (the \
                 endpoint has no authentication); use 127.0.0.1 or [::1], or set metrics.allow_remote = true"
            )));
        }
        Ok(Some(addr))
    }
}

/// `[ring]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RingConfig {
    /// Ring size in bytes: a number, or a string with a unit (`"64 MiB"`, `"1GiB"`, `"512KiB"`).
    #[serde(default = "default_capacity")]
    pub capacity: ByteSize,
    /// Where the ring lives: `"host"` (captures from host memory) or `"cuda"` (captures from device memory on a
    /// CUDA stream, graph-capturable; needs the NVIDIA driver and NVRTC at run time).
    #[serde(default)]
    pub backend: Backend,
    /// CUDA device ordinal (`backend = "cuda"`).
    #[serde(default)]
    pub device: usize,
    /// Most rows in one step's batch (`backend = "cuda"`: sizes the device-side batch descriptor).
    #[serde(default = "default_max_batch_rows")]
    pub max_batch_rows: u32,
    /// Largest single device-to-host copy of the drain (`backend = "cuda"`). Smaller chunks let an engine's own
    /// copies in sooner; larger ones reach a higher bandwidth (docs/gpu-benchmarks.md).
    #[serde(default = "default_drain_chunk")]
    pub drain_chunk: ByteSize,
    /// Device-to-host copies the drain keeps in flight (`backend = "cuda"`).
    #[serde(default = "default_drain_in_flight")]
    pub drain_in_flight: u32,
    /// Deferred captures (`backend = "cuda"`): a capture call only notes the tensor, and `end_step` copies every
    /// capture of the step with one kernel — one graph node per step instead of one per hookpoint. The engine must
    /// leave each captured tensor unchanged until the step ends: true of out-of-place models (Hugging Face;
    /// `ringscope.torch.attach` keeps them alive), not of engines that update the residual stream in place.
    #[serde(default)]
    pub defer_captures: bool,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            capacity: default_capacity(),
            backend: Backend::default(),
            device: 0,
            max_batch_rows: default_max_batch_rows(),
            drain_chunk: default_drain_chunk(),
            drain_in_flight: default_drain_in_flight(),
            defer_captures: false,
        }
    }
}

impl RingConfig {
    /// Checks the CUDA backend's keys whatever the backend, so a config that is wrong says so before it is moved to
    /// a GPU machine.
    pub fn validate_cuda_keys(&self) -> Result<(), Error> {
        if self.max_batch_rows == 0 {
            return Err(Error::Config("ring.max_batch_rows must be at least 1".into()));
        }
        if self.drain_chunk.0 < 64 || !self.drain_chunk.0.is_multiple_of(64) {
            return Err(Error::Config(format!(
                "ring.drain_chunk = {} bytes: use a positive multiple of 64 bytes (e.g. \"4 MiB\")",
                self.drain_chunk.0
            )));
        }
        if self.drain_in_flight == 0 || self.drain_in_flight > 1024 {
            return Err(Error::Config(format!("ring.drain_in_flight = {}: use 1 to 1024", self.drain_in_flight)));
        }
        Ok(())
    }
}

/// Where a session's ring lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Host memory; captures copy from host pointers.
    #[default]
    Host,
    /// GPU memory; capture kernels copy from device pointers on the engine's stream.
    Cuda,
}

fn default_max_batch_rows() -> u32 {
    8192
}

fn default_drain_chunk() -> ByteSize {
    ByteSize(4 << 20)
}

fn default_drain_in_flight() -> u32 {
    8
}

/// The lowest `policy.drain_rate` (1 MB/s): below it, closing a session could take hours.
pub const MIN_DRAIN_RATE: u64 = 1_000_000;

fn default_capacity() -> ByteSize {
    ByteSize(64 << 20)
}

/// `[export]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    /// Most bytes of records queued for one sink or consumer before the policy steps in.
    #[serde(default = "default_backlog")]
    pub backlog: ByteSize,
    /// Write a Parquet dataset.
    #[serde(default)]
    pub parquet: bool,
    /// Write an Arrow IPC dataset.
    #[serde(default)]
    pub arrow_ipc: bool,
    /// Root directory of dumps; each run writes `dir/run_id/`. An object storage URL (`s3://bucket/prefix`) here is
    /// taken as `url`.
    #[serde(default = "default_dir")]
    pub dir: String,
    /// Run id (a directory name); default `run-<UTC time>-<pid>`.
    #[serde(default)]
    pub run_id: Option<String>,
    /// This process's rank among the engine's workers.
    #[serde(default)]
    pub rank: u32,
    /// Rotate files after this many activation bytes.
    #[serde(default = "default_max_file_size")]
    pub max_file_size: ByteSize,
    /// How Parquet compresses activations: `"zstd"` (default, at `zstd_level`), `"lz4"` or `"none"`.
    #[serde(default)]
    pub compression: Compression,
    /// Parquet zstd level (with `compression = "zstd"`).
    #[serde(default = "one_i32")]
    pub zstd_level: i32,
    /// Threads per file format: this many sink threads take the format's records from one queue, each record going
    /// to whichever is free first, each writing files of its own (`part-NNNNN-sK`), so one large hookpoint can use
    /// them all and a thread slowed down (a busy core) takes fewer records instead of holding the others back.
    #[serde(default = "one_u32")]
    pub threads: u32,
    /// `"auto"` (default): write files with `O_DIRECT`, past the page cache, where the file system supports it and
    /// is not memory-backed (on tmpfs through the page cache, where Arrow IPC files take large records from the
    /// ring's memory without a copy); `"on"`: always (an error where unsupported); `"off"`: through the page cache.
    #[serde(default)]
    pub direct_io: ringscope_exporter::DirectIo,
    /// Object storage the dump goes to instead of `dir`: `s3://bucket/prefix` (S3 and S3-compatible stores),
    /// `gs://bucket/prefix`, `az://container/prefix`; `file:///path` is the local directory `/path`. The run is
    /// written there with the layout it has on disk, each file streamed as a multipart upload.
    #[serde(default)]
    pub url: Option<String>,
    /// Settings of the object store, after the environment's (`AWS_*`, `GOOGLE_*`, `AZURE_*`): the `object_store`
    /// builders' keys, such as `aws_endpoint`, `aws_region`, `aws_allow_http`, `aws_virtual_hosted_style_request`.
    /// Values are never printed.
    #[serde(default)]
    pub storage_options: StorageSettings,
    /// Size of each uploaded part but a file's last (at least 5 MiB, S3's smallest).
    #[serde(default = "default_upload_part_size")]
    pub upload_part_size: ByteSize,
    /// Parts of one file uploaded at once. Memory per open file on object storage: its buffers (as on disk) plus
    /// `upload_part_size * (upload_concurrency + 1)`.
    #[serde(default = "default_upload_concurrency")]
    pub upload_concurrency: u32,
    /// Retries of a failed request to the object store (exponential backoff from 100 ms).
    #[serde(default = "default_upload_retries")]
    pub upload_retries: u32,
    /// No retry of a request starts later than this many seconds after its first attempt; a request that still
    /// fails fails its file (its records counted as `sink_error` drops).
    #[serde(default = "default_upload_retry_timeout_s")]
    pub upload_retry_timeout_s: f64,
}

/// `export.storage_options`: key-value settings whose values may be secrets (`Debug` shows the keys only).
#[derive(Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(transparent)]
pub struct StorageSettings(pub std::collections::BTreeMap<String, String>);

impl std::fmt::Debug for StorageSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

fn default_upload_part_size() -> ByteSize {
    ByteSize(8 << 20)
}

fn default_upload_concurrency() -> u32 {
    2
}

fn default_upload_retries() -> u32 {
    5
}

fn default_upload_retry_timeout_s() -> f64 {
    30.0
}

impl Default for ExportConfig {
    fn default() -> Self {
        ExportConfig {
            backlog: default_backlog(),
            parquet: false,
            arrow_ipc: false,
            dir: default_dir(),
            run_id: None,
            rank: 0,
            max_file_size: default_max_file_size(),
            compression: Compression::Zstd,
            zstd_level: 1,
            threads: 1,
            direct_io: ringscope_exporter::DirectIo::Auto,
            url: None,
            storage_options: StorageSettings::default(),
            upload_part_size: default_upload_part_size(),
            upload_concurrency: default_upload_concurrency(),
            upload_retries: default_upload_retries(),
            upload_retry_timeout_s: default_upload_retry_timeout_s(),
        }
    }
}

fn default_backlog() -> ByteSize {
    ByteSize(256 << 20)
}

fn default_dir() -> String {
    "ringscope-out".into()
}

fn default_max_file_size() -> ByteSize {
    ByteSize(256 << 20)
}

fn one_i32() -> i32 {
    1
}

fn one_u32() -> u32 {
    1
}

/// `export.compression`: how Parquet compresses the activation column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// zstd at `export.zstd_level` (about 0.8 of the size for bf16 activations).
    #[default]
    Zstd,
    /// LZ4: several times faster, compresses less.
    Lz4,
    /// Uncompressed: the write only.
    None,
}

impl ExportConfig {
    /// The Parquet codec these settings describe.
    pub fn codec(&self) -> ringscope_exporter::Codec {
        match self.compression {
            Compression::Zstd => ringscope_exporter::Codec::Zstd { level: self.zstd_level },
            Compression::Lz4 => ringscope_exporter::Codec::Lz4,
            Compression::None => ringscope_exporter::Codec::Uncompressed,
        }
    }

    /// The dataset options these settings describe (for the file sinks).
    pub fn dataset_options(&self) -> ringscope_exporter::DatasetOptions {
        // `file://localhost/x` and `file:///x` both name `/x`.
        fn local(u: &str) -> Option<&str> {
            u.strip_prefix("file://").map(|p| p.strip_prefix("localhost").unwrap_or(p))
        }
        let dir = match self.url.as_deref().and_then(local) {
            Some(path) => path,
            None => &self.dir,
        };
        let mut o = ringscope_exporter::DatasetOptions::new(dir);
        if let Some(id) = &self.run_id {
            o.run_id = id.clone();
        }
        o.rank = self.rank;
        o.max_file_bytes = self.max_file_size.0;
        o.direct_io = self.direct_io;
        o
    }

    /// The object storage `url` names (`None` for a local directory, `file://` included), opened and checked: a
    /// missing bucket or refused credentials is an error here, naming the URL and never a secret.
    pub fn open_storage(&self) -> Result<Option<ringscope_exporter::ObjectStorage>, Error> {
        let setting = |source: Box<dyn std::error::Error + Send + Sync>| Error::Setting { key: "export.url", source };
        // `export.dir` may name object storage too (`dir = "s3://bucket/prefix"`): a program that takes a directory
        // takes a bucket as well.
        let url = match self.url.as_deref() {
            Some(url) => url,
            None if ringscope_exporter::is_object_url(&self.dir) => &self.dir,
            None => return Ok(None),
        };
        if self.url.is_some() && self.dir != default_dir() {
            let shown = ringscope_exporter::redact_url(url);
            return Err(setting(
                format!("both export.dir ({:?}) and export.url ({shown}) are set: give one", self.dir).into(),
            ));
        }
        if url.starts_with("file://") {
            return Ok(None);
        }
        // S3 takes at most 10,000 parts per object: a file must fit in them.
        let part = self.upload_part_size.0.max(1);
        if self.max_file_size.0 / part >= 9_000 || part > 5 << 30 {
            return Err(setting(
                format!(
                    "export.max_file_size ({} bytes) in parts of export.upload_part_size ({part} bytes): S3 takes at \
                     most 10,000 parts of at most 5 GiB per object; raise upload_part_size or lower max_file_size",
                    self.max_file_size.0
                )
                .into(),
            ));
        }
        let timeout = self.upload_retry_timeout_s;
        if !(timeout.is_finite() && (0.0..=3600.0).contains(&timeout)) {
            return Err(Error::Config(format!("export.upload_retry_timeout_s = {timeout}: use 0 to 3600 seconds")));
        }
        let options = ringscope_exporter::StorageOptions {
            options: self.storage_options.0.clone(),
            part_bytes: usize::try_from(self.upload_part_size.0).unwrap_or(usize::MAX),
            concurrency: self.upload_concurrency as usize,
            max_retries: self.upload_retries as usize,
            retry_timeout: Duration::from_secs_f64(timeout),
        };
        ringscope_exporter::ObjectStorage::open(url, options).map(Some).map_err(|e| setting(e.into()))
    }
}

/// `[policy]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// `full` (lossless, may wait) or `best_effort` (never waits, drops and counts).
    #[serde(default = "default_mode")]
    pub mode: Mode,
    /// Full mode: how long a capture may wait for ring space before failing.
    #[serde(default = "default_deadline_ms")]
    pub full_deadline_ms: u64,
    /// Full mode: what happens once a sink has failed (a full disk, say) — `"error"`: captures and `begin_step`
    /// return an error naming the sink (nothing more is captured that would be lost); `"continue"`: capture goes on
    /// and the failed sink's records are counted as dropped (`sink_error`), as in best-effort mode.
    #[serde(default)]
    pub on_sink_failure: OnSinkFailure,
    /// The drain's byte-rate cap, bytes per second (`"20 GB/s"`).
    #[serde(default)]
    pub drain_rate: Option<ByteRate>,
    /// Most device memory for the ring.
    #[serde(default)]
    pub gpu_memory: Option<ByteSize>,
    /// Most pinned host memory for the CUDA drain's staging.
    #[serde(default)]
    pub pinned_memory: Option<ByteSize>,
    /// Most host memory for records queued for all sinks and consumers together.
    #[serde(default)]
    pub host_memory: Option<ByteSize>,
    /// A memory budget filled past this fraction means the path is saturated.
    #[serde(default = "default_high_watermark")]
    pub high_watermark: f64,
    /// Every memory budget below this fraction means there is room to recover.
    #[serde(default = "default_low_watermark")]
    pub low_watermark: f64,
    /// Least time between changes of the policy manager's plan.
    #[serde(default = "default_dwell_ms")]
    pub dwell_ms: u64,
    /// The ladder's sampling rungs go up to one step in this many.
    #[serde(default = "default_max_every_n")]
    pub max_every_n: u32,
    /// Full mode: what a step that found no room by the deadline does.
    #[serde(default)]
    pub on_deadline: OnDeadline,
    /// The most a step may wait for room, as a fraction of the engine's step time (`0.01`: 1%). Full mode with
    /// `on_deadline = "degrade"` only: each step's wait is bounded by this share of the recent step time (without
    /// waits) and by `full_deadline_ms`. Best-effort mode never waits.
    #[serde(default)]
    pub max_step_overhead: Option<f64>,
}

/// `policy.on_deadline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnDeadline {
    /// The step's captures are dropped (counted as `deadline`) and the engine gets an error.
    #[default]
    Error,
    /// The step goes on and the engine gets no error; the stall and the loss are in the statistics and the events
    /// table. Host backend: the step's remaining captures do not wait (what fits is captured, the rest dropped and
    /// counted). CUDA backend: admission is per step, so the step's captures are dropped on the device and counted as
    /// `deadline`.
    Degrade,
}

fn default_high_watermark() -> f64 {
    0.75
}

fn default_low_watermark() -> f64 {
    0.25
}

fn default_dwell_ms() -> u64 {
    500
}

fn default_max_every_n() -> u32 {
    8
}

/// `policy.on_sink_failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnSinkFailure {
    /// Refuse further captures with an error naming the failed sink.
    #[default]
    Error,
    /// Go on capturing; the failed sink's records are counted as `sink_error`.
    Continue,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            mode: default_mode(),
            full_deadline_ms: default_deadline_ms(),
            on_sink_failure: OnSinkFailure::default(),
            drain_rate: None,
            gpu_memory: None,
            pinned_memory: None,
            host_memory: None,
            high_watermark: default_high_watermark(),
            low_watermark: default_low_watermark(),
            dwell_ms: default_dwell_ms(),
            max_every_n: default_max_every_n(),
            on_deadline: OnDeadline::default(),
            max_step_overhead: None,
        }
    }
}

fn default_mode() -> Mode {
    Mode::Full
}

fn default_deadline_ms() -> u64 {
    5000
}

impl PolicyConfig {
    /// The policy these settings describe.
    pub fn loss_policy(&self) -> LossPolicy {
        LossPolicy { mode: self.mode, full_deadline: Duration::from_millis(self.full_deadline_ms) }
    }

    /// Whether the policy manager moves hookpoints along the ladder: best-effort mode with a budget set (full mode is
    /// lossless: it waits instead, and its budgets are only checked and measured).
    pub fn adaptive(&self) -> bool {
        self.mode == Mode::BestEffort
            && (self.drain_rate.is_some() || self.host_memory.is_some() || self.gpu_memory.is_some())
    }

    /// The planner's settings.
    pub fn planner_settings(&self) -> PlannerSettings {
        PlannerSettings {
            drain_bytes_per_s: self.drain_rate.map(|r| r.0 as f64),
            high_watermark: self.high_watermark,
            low_watermark: self.low_watermark,
            dwell: Duration::from_millis(self.dwell_ms),
            ladder: Ladder::new(self.max_every_n),
        }
    }

    /// Checks the policy's own numbers; every error names its key.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |key: &str, why: String| Err(Error::Config(format!("policy.{key}: {why}")));
        for (key, v) in [("high_watermark", self.high_watermark), ("low_watermark", self.low_watermark)] {
            if !(v > 0.0 && v < 1.0) {
                return bad(key, format!("{v} is not a fraction between 0 and 1 (exclusive)"));
            }
        }
        if self.low_watermark >= self.high_watermark {
            return bad(
                "low_watermark",
                format!(
                    "{} is not below policy.high_watermark {}: recovery needs a lower mark than degradation, or the \
                     plan would flap",
                    self.low_watermark, self.high_watermark
                ),
            );
        }
        if self.max_every_n == 0 || self.max_every_n > 1 << 16 {
            return bad(
                "max_every_n",
                format!("{} is out of range: use 1 (no sampling rungs) to 65536", self.max_every_n),
            );
        }
        if self.dwell_ms > 3_600_000 {
            return bad("dwell_ms", format!("{} ms is more than an hour", self.dwell_ms));
        }
        for (key, v) in
            [("gpu_memory", self.gpu_memory), ("pinned_memory", self.pinned_memory), ("host_memory", self.host_memory)]
        {
            if v.is_some_and(|v| v.0 == 0) {
                return bad(key, "0 bytes cannot hold anything; leave the key out for no budget".into());
            }
        }
        if let Some(o) = self.max_step_overhead {
            if !(o > 0.0 && o < 1.0) {
                return bad(
                    "max_step_overhead",
                    format!("{o} is not a fraction of the step time between 0 and 1 (0.01 = 1%)"),
                );
            }
            // One rule: a step-time cap on waits needs a mode that waits and a way to stop waiting — full mode with
            // on_deadline = "degrade". Anywhere else the key would do nothing, so it is refused.
            if self.mode == Mode::BestEffort {
                return bad(
                    "max_step_overhead",
                    "best-effort mode never waits, so there is no wait to cap: remove policy.max_step_overhead, or \
                     use mode = \"full\" with on_deadline = \"degrade\""
                        .into(),
                );
            }
            if self.mode == Mode::Full && self.on_deadline == OnDeadline::Error {
                return bad(
                    "max_step_overhead",
                    "full mode with on_deadline = \"error\" waits for room up to policy.full_deadline_ms and cannot \
                     honour a step-time cap: set policy.on_deadline = \"degrade\" (a step that would wait longer goes \
                     on as in best-effort, its losses counted and logged) or use mode = \"best_effort\""
                        .into(),
                );
            }
        }
        if let Some(r) = self.drain_rate.filter(|r| r.0 < MIN_DRAIN_RATE) {
            return bad(
                "drain_rate",
                format!(
                    "{} B/s is below the minimum of 1 MB/s: everything captured leaves at this rate, shutdown \
                     included (a 64 MiB ring at 1 B/s would take two years to close); leave the key out for no cap",
                    r.0
                ),
            );
        }
        Ok(())
    }
}

impl From<ByteSize> for u64 {
    fn from(b: ByteSize) -> u64 {
        b.0
    }
}

impl From<ByteRate> for u64 {
    fn from(r: ByteRate) -> u64 {
        r.0
    }
}

/// A byte rate: a [`ByteSize`] per second, written `"20 GB/s"`, `"512 MiB/s"` or a plain number of bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRate(pub u64);

impl<'de> Deserialize<'de> for ByteRate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        number_or_text::<D, ByteRate>(d).map(ByteRate)
    }
}

impl std::str::FromStr for ByteRate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let size = t
            .strip_suffix("/s")
            .ok_or_else(|| format!("`{s}` is not a rate; write e.g. \"20 GB/s\" or \"512 MiB/s\""))?;
        size.parse::<ByteSize>().map(|b| ByteRate(b.0))
    }
}

/// One `[[hookpoints]]` entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookPointConfig {
    /// Unique name.
    pub name: String,
    /// Site kind.
    pub site: SiteKind,
    /// Decoder layer, if any.
    #[serde(default)]
    pub layer: Option<u32>,
    /// Element type name (`bf16`, `f16`, `f32`, ... or torch names such as `bfloat16`).
    pub dtype: String,
    /// Elements per row.
    pub row_width: u32,
    /// Row selection.
    #[serde(default)]
    pub rows: RowsConfig,
    /// Sample every N-th step.
    #[serde(default = "one")]
    pub every_n_steps: u32,
    /// Capture at all.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The policy manager degrades lower priorities first (any integer; default 0).
    #[serde(default)]
    pub priority: i32,
}

fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

/// `rows = "all" | "last_per_request" | [i, j, ...]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(untagged)]
pub enum RowsConfig {
    /// `"all"` or `"last_per_request"`.
    Named(String),
    /// An explicit list of batch rows.
    List(Vec<u32>),
    /// Not given: all rows.
    #[default]
    #[serde(skip)]
    Default,
}

impl RowsConfig {
    fn selection(&self, hookpoint: &str) -> Result<RowSelection, Error> {
        match self {
            RowsConfig::Default => Ok(RowSelection::All),
            RowsConfig::Named(s) if s == "all" => Ok(RowSelection::All),
            RowsConfig::Named(s) if s == "last_per_request" => Ok(RowSelection::LastPerRequest),
            RowsConfig::Named(s) => Err(Error::Config(format!(
                "hookpoints `{hookpoint}`: rows = \"{s}\" is not a selection; use \"all\", \"last_per_request\" or a list of batch rows"
            ))),
            RowsConfig::List(rows) if rows.is_empty() => {
                Err(Error::Config(format!("hookpoints `{hookpoint}`: rows = [] selects nothing")))
            }
            RowsConfig::List(rows) => Ok(RowSelection::Rows(rows.clone())),
        }
    }
}

impl HookPointConfig {
    /// The spec and initial controls this entry describes.
    pub fn resolve(&self) -> Result<(HookPointSpec, RowSelection), Error> {
        let dtype: DType = self.dtype.parse().map_err(|e| Error::Config(format!("hookpoints `{}`: {e}", self.name)))?;
        if self.every_n_steps == 0 {
            return Err(Error::Config(format!("hookpoints `{}`: every_n_steps must be at least 1", self.name)));
        }
        let spec = HookPointSpec {
            name: self.name.clone(),
            site: self.site.clone(),
            layer: self.layer,
            dtype,
            row_width: self.row_width,
        };
        Ok((spec, self.rows.selection(&self.name)?))
    }
}

/// A byte count, from a number or a string with a binary or decimal unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        number_or_text::<D, ByteSize>(d).map(ByteSize)
    }
}

/// A byte count written as a plain number, or as text that `T` parses (`"64 MiB"`, `"20 GB/s"`).
fn number_or_text<'de, D, T>(d: D) -> Result<u64, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = String> + Into<u64>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        N(u64),
        S(String),
    }
    match Raw::deserialize(d)? {
        Raw::N(n) => Ok(n),
        Raw::S(s) => s.parse::<T>().map(Into::into).map_err(serde::de::Error::custom),
    }
}

impl std::str::FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 =
            num.parse().map_err(|_| format!("`{s}` is not a size; write e.g. 67108864, \"64 MiB\" or \"1GiB\""))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kib" | "k" => 1 << 10,
            "mib" | "m" => 1 << 20,
            "gib" | "g" => 1 << 30,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            other => return Err(format!("unknown size unit `{other}` in `{s}`; use B, KiB, MiB or GiB")),
        };
        n.checked_mul(mult).map(ByteSize).ok_or_else(|| format!("size `{s}` overflows"))
    }
}

impl Config {
    /// Checks the `[policy]` budgets against the rest of the configuration: the ring must fit the GPU (or host)
    /// memory budget and hold one step's worst case (every configured hookpoint, `ring.max_batch_rows` rows, once),
    /// and the CUDA drain's staging (as large as the ring) the pinned budget. Errors name the keys and the
    /// hookpoints that do not fit.
    pub fn validate_budgets(&self) -> Result<(), Error> {
        self.policy.validate()?;
        let p = &self.policy;
        let capacity = self.ring.capacity.0;
        if let Some(gpu) = p.gpu_memory {
            if capacity > gpu.0 {
                return Err(Error::Config(format!(
                    "ring.capacity {capacity} bytes is over policy.gpu_memory {} bytes: lower ring.capacity or raise \
                     the budget",
                    gpu.0
                )));
            }
            // One step's worst case: every hookpoint, every row of the largest batch.
            let rows = self.ring.max_batch_rows as u64;
            let mut total = 0u64;
            let mut over = Vec::new();
            for hc in self.hookpoints.iter().filter(|h| h.enabled) {
                let (spec, _) = hc.resolve()?;
                let record = align_up(HEADER_LEN + align_up(rows as usize * ROW_META_LEN)) as u64
                    + rows * spec.row_bytes() as u64;
                total = total.saturating_add(record);
                if total > capacity {
                    over.push(format!("`{}` ({record} bytes)", spec.name));
                }
            }
            if !over.is_empty() {
                return Err(Error::Config(format!(
                    "policy.gpu_memory: the ring (ring.capacity {capacity} bytes) cannot hold one step's worst case \
                     of {total} bytes ({rows} rows, ring.max_batch_rows, of every hookpoint); these do not fit: {} — \
                     raise ring.capacity within the budget, lower ring.max_batch_rows, or capture fewer hookpoints",
                    over.join(", ")
                )));
            }
        }
        if let (Some(pinned), Backend::Cuda) = (p.pinned_memory, self.ring.backend) {
            if capacity > pinned.0 {
                return Err(Error::Config(format!(
                    "policy.pinned_memory {} bytes is under ring.capacity {capacity} bytes: the CUDA drain's pinned \
                     staging is as large as the ring; lower ring.capacity or raise the budget",
                    pinned.0
                )));
            }
        }
        if let Some(host) = p.host_memory {
            if self.export.backlog.0 > host.0 {
                return Err(Error::Config(format!(
                    "export.backlog {} bytes (per sink or consumer) is over policy.host_memory {} bytes (all of them \
                     together): lower export.backlog or raise the budget",
                    self.export.backlog.0, host.0
                )));
            }
        }
        Ok(())
    }

    /// Parses a TOML document. Errors name the offending key and line.
    pub fn from_toml(text: &str) -> Result<Config, Error> {
        toml::from_str(text).map_err(|e| Error::Config(e.to_string()))
    }

    /// Reads and parses a TOML file.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Config, Error> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Config(format!("cannot read config file {}: {e}", path.display())))?;
        let mut config = Config::from_toml(&text).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{}: {m}", path.display())),
            other => other,
        })?;
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        for p in &mut config.probes {
            p.resolve_paths(dir);
        }
        Ok(config)
    }

    /// A configuration with no hookpoints and default ring and policy.
    pub fn new() -> Config {
        Config {
            ring: RingConfig::default(),
            policy: PolicyConfig::default(),
            export: ExportConfig::default(),
            hookpoints: Vec::new(),
            metrics: MetricsConfig::default(),
            probes: Vec::new(),
            alerts: AlertsConfig::default(),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_document_parses() {
        let c = Config::from_toml(
            r#"
            [ring]
            capacity = "8 MiB"
            [policy]
            mode = "best_effort"
            [export]
            direct_io = "off"
            [[hookpoints]]
            name = "layers.0.resid"
            site = "residual"
            layer = 0
            dtype = "bfloat16"
            row_width = 2048
            rows = "last_per_request"
            [[hookpoints]]
            name = "probe.in"
            site = { custom = "probe_input" }
            dtype = "f32"
            row_width = 16
            rows = [0, 3]
            every_n_steps = 4
            "#,
        )
        .unwrap();
        assert_eq!(c.ring.capacity, ByteSize(8 << 20));
        assert_eq!(c.policy.mode, Mode::BestEffort);
        assert_eq!(c.export.dataset_options().direct_io, ringscope_exporter::DirectIo::Off);
        assert_eq!(Config::from_toml("").unwrap().export.direct_io, ringscope_exporter::DirectIo::Auto);
        let (spec, sel) = c.hookpoints[0].resolve().unwrap();
        assert_eq!((spec.dtype, sel), (DType::BF16, RowSelection::LastPerRequest));
        let (spec, sel) = c.hookpoints[1].resolve().unwrap();
        assert_eq!(spec.site, SiteKind::Custom("probe_input".into()));
        assert_eq!(sel, RowSelection::Rows(vec![0, 3]));
    }

    #[test]
    fn bad_documents_say_what_is_wrong() {
        let cases = [
            ("[ring]\ncapacity = \"64 furlongs\"", "unknown size unit"),
            ("[ring]\ncapacty = 5", "capacty"),
            ("[policy]\nmode = \"sometimes\"", "sometimes"),
            ("[export]\ndirect_io = \"maybe\"", "maybe"),
            ("[[hookpoints]]\nname = \"a\"\nsite = \"residual\"\ndtype = \"bf17\"\nrow_width = 4", "bf17"),
            (
                "[[hookpoints]]\nname = \"a\"\nsite = \"residual\"\ndtype = \"f32\"\nrow_width = 4\nrows = \"some\"",
                "\"some\"",
            ),
            (
                "[[hookpoints]]\nname = \"a\"\nsite = \"residual\"\ndtype = \"f32\"\nrow_width = 4\nevery_n_steps = 0",
                "every_n_steps",
            ),
            ("[[hookpoints]]\nname = \"a\"\nsite = \"elsewhere\"\ndtype = \"f32\"\nrow_width = 4", "elsewhere"),
            ("this is not toml", "expected"),
        ];
        for (text, needle) in cases {
            let err = Config::from_toml(text).and_then(|c| {
                c.hookpoints.iter().try_for_each(|h| h.resolve().map(|_| ()))?;
                Ok(c)
            });
            let msg = err.expect_err(text).to_string();
            assert!(msg.contains(needle), "config {text:?}: error {msg:?} does not mention {needle:?}");
        }
    }

    #[test]
    fn metrics_listen_is_checked_and_names_its_key() {
        let addr = |text: &str| Config::from_toml(text).and_then(|c| c.metrics.listen_addr());
        assert_eq!(addr("").unwrap(), None);
        assert_eq!(addr("[metrics]\nlisten = \"127.0.0.1:9464\"").unwrap(), Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(addr("[metrics]\nlisten = \"[::1]:0\"").unwrap(), Some("[::1]:0".parse().unwrap()));
        let remote = "[metrics]\nlisten = \"0.0.0.0:9464\"";
        let err = addr(remote).unwrap_err().to_string();
        assert!(err.contains("metrics.listen") && err.contains("metrics.allow_remote"), "{err}");
        assert!(addr(&format!("{remote}\nallow_remote = true")).unwrap().is_some());
        for bad in ["localhost:9464", "127.0.0.1", "127.0.0.1:99999", ""] {
            let err = addr(&format!("[metrics]\nlisten = \"{bad}\"")).unwrap_err().to_string();
            assert!(err.contains("metrics.listen") && err.contains("not an IP address and port"), "{bad}: {err}");
        }
        let err = addr("[metrics]\nport = 9464").unwrap_err().to_string();
        assert!(err.contains("port"), "{err}");
    }

    #[test]
    fn missing_file_is_named() {
        let err = Config::from_file("/nonexistent/ringscope.toml").unwrap_err().to_string();
        assert!(err.contains("/nonexistent/ringscope.toml"), "{err}");
    }

    #[test]
    fn object_storage_urls_are_checked_before_any_request_and_never_show_secrets() {
        let export = |text: &str| Config::from_toml(&format!("[export]\nparquet = true\n{text}")).unwrap().export;
        // A local directory, also as a file:// URL: no object storage.
        assert!(export("").open_storage().unwrap().is_none());
        let local = export("url = \"file:///data/dumps\"");
        assert!(local.open_storage().unwrap().is_none());
        assert_eq!(local.dataset_options().root, std::path::PathBuf::from("/data/dumps"));
        let host = export("url = \"file://localhost/data/dumps\"");
        assert_eq!(host.dataset_options().root, std::path::PathBuf::from("/data/dumps"));
        let e = export("dir = \"/x\"\nurl = \"file:///y\"").open_storage().unwrap_err().to_string();
        assert!(e.contains("both export.dir"), "{e}");
        let e = export("url = \"s3://b/p\"\nmax_file_size = \"100 GiB\"").open_storage().unwrap_err().to_string();
        assert!(e.contains("10,000 parts"), "{e}");
        // Both a directory and a URL: which one is meant?
        let e = export("dir = \"/data\"\nurl = \"s3://b/p\"").open_storage().unwrap_err().to_string();
        assert!(e.contains("export.dir") && e.contains("s3://b/p"), "{e}");
        // A bucket given as the directory is taken as the URL; settings S3 cannot take are refused by name, before
        // anything is sent.
        let e = export("dir = \"s3://b/p\"\nupload_part_size = \"1 MiB\"").open_storage().unwrap_err().to_string();
        assert!(e.contains("s3://b/p") && e.contains("5 MiB"), "{e}");
        let e = export("url = \"s3://b/p\"\nupload_retry_timeout_s = -1").open_storage().unwrap_err().to_string();
        assert!(e.contains("upload_retry_timeout_s"), "{e}");
        let e = export("url = \"s3://b/p\"\nstorage_options = { aws_colour = \"x\" }").open_storage().unwrap_err();
        assert!(e.to_string().contains("aws_colour"), "{e}");
        let e = export("url = \"ftp://host/p\"").open_storage().unwrap_err().to_string();
        assert!(e.contains("ftp://host/p") && e.contains("scheme"), "{e}");
        // A secret in the config is never printed.
        let c = export("url = \"s3://b/p\"\nstorage_options = { aws_secret_access_key = \"hunter2\" }");
        assert!(!format!("{c:?}").contains("hunter2"), "{c:?}");
        assert!(format!("{c:?}").contains("aws_secret_access_key"));
    }
}
