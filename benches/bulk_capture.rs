//! Bulk capture through the public API: what a user gets from a `Session`, first capture to `shutdown()` returned,
//! next to the physical ceilings measured in the same run.
//!
//! ```text
//! cargo bench --bench bulk_capture                                  # host backend (any machine)
//! cargo bench --bench bulk_capture -- --backend cuda --dir /data    # CUDA backend (an NVIDIA GPU), files on /data
//! ```
//!
//! Every configuration runs in a child process of this binary, so that its peak RSS (`VmHWM`) is its own. The
//! producer is a synthetic engine: each step captures every hookpoint's rows (bf16 values drawn from a normal
//! distribution, so that compression sees realistic activations) — on the CUDA backend from device buffers with
//! `capture_device` on one stream, as an engine's prefill would; on the host backend from host memory with
//! `capture`. The stream is several times longer than the ring, in full mode, so back-pressure is part of the
//! measurement. The first configuration runs once before the table, not counted (memory a freshly started machine
//! uses for the first time makes the first run slower; `--no-warmup` skips it). Printed: a Markdown table, one row
//! per configuration, and the ceilings:
//!
//! * `pinned D2H`: back-to-back device → pinned copies of the drain's chunk size (CUDA);
//! * `memcpy`: one thread copying the same records into a reused buffer (host);
//! * per configuration, the CPU seconds each thread (by name) spent per GB of activations: a thread that runs alone
//!   (the drain) caps the rate at 1 / its s/GB, and the sinks' s/GB against zstd alone shows what they add;
//! * `disk write`: the same bytes written sequentially to a file in `--dir` (8 MiB writes, `O_DIRECT` where the file
//!   system takes it, else through the page cache, then `fsync`) — what a file sink could reach there;
//! * `zstd(1) alone` on 1, 2, 4 and 8 threads (and on 8 reading pinned memory, CUDA): what the Parquet sink's
//!   compression could reach.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use ringscope::config::{Backend, Compression, HookPointConfig, RowsConfig};
use ringscope::cuda::{DeviceBuffer, Gpu, Stream};
use ringscope::{Config, DirectIo, Mode, Session};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// `host`, `cuda` or `all`.
    #[arg(long, default_value = "host")]
    backend: String,
    /// Directory for the file-sink configurations (a real disk, to compare with its write rate).
    #[arg(long, default_value = "target/bulk_capture")]
    dir: String,
    /// Memory-backed directory for the in-memory file configurations.
    #[arg(long, default_value = "/dev/shm")]
    shm: String,
    /// Ring capacity of the host configurations, MiB.
    #[arg(long, default_value_t = 256)]
    host_ring_mib: u64,
    /// Ring capacity of the CUDA configurations, GiB (the pinned staging is as large).
    #[arg(long, default_value_t = 4)]
    cuda_ring_gib: u64,
    /// Stream length as a multiple of the ring's capacity.
    #[arg(long, default_value_t = 4)]
    laps: usize,
    /// Rounds over all configurations (and the zstd ceiling), interleaved; with more than one, the medians follow
    /// the table, with the thread-scaling ratios of the Parquet zstd rows (a shared machine's one-thread rates
    /// move by ±30% between runs: a ratio of two single runs carries that).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Skip the warm-up run (the first configuration once, not counted, before the table).
    #[arg(long)]
    no_warmup: bool,
    /// `export.backlog` of every configuration, MiB (default: the library's default).
    #[arg(long)]
    backlog_mib: Option<u64>,
    /// Run only configurations whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Internal: run one configuration and print its result line.
    #[arg(long)]
    child: Option<String>,
    /// Ignored (cargo bench passes it).
    #[arg(long)]
    bench: bool,
}

/// One measured configuration.
#[derive(Clone)]
struct Setup {
    name: String,
    backend: Backend,
    /// Ring capacity, bytes.
    ring: u64,
    hookpoints: u32,
    rows: u32,
    row_width: u32,
    /// `(parquet, arrow_ipc, dir)`, or `None` for no sink.
    files: Option<(bool, bool, String)>,
    threads: u32,
    zstd_level: i32,
    compression: Compression,
    /// `export.direct_io`.
    direct_io: DirectIo,
    /// `export.backlog`, bytes (`None`: the default).
    backlog: Option<u64>,
}

impl Setup {
    fn step_bytes(&self) -> u64 {
        self.hookpoints as u64 * self.rows as u64 * self.row_width as u64 * 2
    }

    /// The run directory's name (the parent removes the run before and after the child).
    fn run_id(&self) -> String {
        format!("bulk_capture-{}", self.name.replace(|c: char| !c.is_ascii_alphanumeric(), "_"))
    }

    fn config(&self) -> Config {
        let mut c = Config::new();
        c.ring.capacity = ringscope::config::ByteSize(self.ring);
        c.ring.backend = self.backend;
        c.ring.max_batch_rows = self.rows;
        c.policy.mode = Mode::Full;
        c.policy.full_deadline_ms = 60_000;
        if let Some((parquet, ipc, dir)) = &self.files {
            c.export.parquet = *parquet;
            c.export.arrow_ipc = *ipc;
            c.export.dir = dir.clone();
            c.export.run_id = Some(self.run_id());
            c.export.threads = self.threads;
            c.export.zstd_level = self.zstd_level;
            c.export.direct_io = self.direct_io;
            c.export.compression = self.compression;
            c.export.max_file_size = ringscope::config::ByteSize(1 << 30);
        }
        if let Some(b) = self.backlog {
            c.export.backlog = ringscope::config::ByteSize(b);
        }
        c.hookpoints = (0..self.hookpoints)
            .map(|l| HookPointConfig {
                name: format!("layers.{l}.resid"),
                site: ringscope::SiteKind::Residual,
                layer: Some(l),
                dtype: "bf16".into(),
                row_width: self.row_width,
                rows: RowsConfig::default(),
                every_n_steps: 1,
                enabled: true,
                priority: 0,
            })
            .collect();
        c
    }
}

/// bf16 values of a standard normal distribution (Box–Muller over a xorshift generator), as little-endian bytes.
fn activations(bytes: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        let (u, v) = (next().max(1e-300), next());
        let z = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
        out.extend_from_slice(&(((z as f32).to_bits() >> 16) as u16).to_le_bytes());
    }
    out.truncate(bytes);
    out
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    kib / 1024.0
}

/// CPU time of this process's threads by name, sampled from `/proc/self/task` from the first capture on (Linux;
/// elsewhere empty): which threads the bytes cost CPU in. What threads spent before [`ThreadCpu::start`] (the
/// session's start, the engine preparing its activations) does not count. A thread's last sample before it exits
/// counts (at most one sampling period of its time is missed). Threads numbered alike (the sink threads `rs-parquet-0`, `rs-parquet-1`,
/// ...) are one group, `rs-parquet-*`, given with the least and most of one thread; the engine's thread is this
/// process's main thread.
struct ThreadCpu {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sampler: std::thread::JoinHandle<std::collections::HashMap<u64, (String, f64, f64)>>,
}

impl ThreadCpu {
    const SAMPLER: &'static str = "cpu-sampler";

    fn start() -> Res<ThreadCpu> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let mut before = std::collections::HashMap::new();
        Self::sample(&mut before);
        let sampler = std::thread::Builder::new().name(Self::SAMPLER.into()).spawn(move || {
            let mut seen = std::collections::HashMap::new();
            loop {
                let last = flag.load(std::sync::atomic::Ordering::Relaxed);
                Self::sample(&mut seen);
                if last {
                    for (tid, (_, secs, system)) in seen.iter_mut() {
                        let b = before.get(tid).map_or((0.0, 0.0), |b: &(String, f64, f64)| (b.1, b.2));
                        *secs -= b.0;
                        *system -= b.1;
                    }
                    return seen;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })?;
        Ok(ThreadCpu { stop, sampler })
    }

    /// Records each live thread's name, CPU seconds (user + system) and system seconds so far.
    fn sample(seen: &mut std::collections::HashMap<u64, (String, f64, f64)>) {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let main = std::process::id() as u64;
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
        for task in tasks.flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u64>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
            // `tid (name) state ppid ...`: the name may hold spaces and parentheses; fields after the last ')'.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
            let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            let (Some(user), Some(system)) = (fields.get(11), fields.get(12)) else { continue };
            let system = system.parse::<f64>().unwrap_or(0.0) / ticks;
            let secs = user.parse::<f64>().unwrap_or(0.0) / ticks + system;
            let name = if tid == main { "engine (main)".to_string() } else { stat[open + 1..close].to_string() };
            seen.insert(tid, (name, secs, system));
        }
    }

    /// CPU seconds per GB of `bytes`, by thread name, largest first: `name s/GB (threads)`.
    fn finish(self, bytes: u64) -> String {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let Ok(seen) = self.sampler.join() else { return "sampler failed".into() };
        // name → (seconds, threads, least of one thread, most of one thread, system seconds)
        let mut by_name: std::collections::BTreeMap<String, (f64, usize, f64, f64, f64)> = Default::default();
        for (name, secs, system) in seen.into_values().filter(|(n, _, _)| n != Self::SAMPLER) {
            let numbered = name.trim_end_matches(|c: char| c.is_ascii_digit());
            let group = match numbered.strip_suffix('-') {
                Some(stem) if numbered.len() < name.len() => format!("{stem}-*"),
                _ => name,
            };
            let e = by_name.entry(group).or_insert((0.0, 0, f64::INFINITY, 0.0, 0.0));
            *e = (e.0 + secs, e.1 + 1, e.2.min(secs), e.3.max(secs), e.4 + system);
        }
        let mut rows: Vec<_> = by_name.into_iter().filter(|(_, e)| e.0 > 0.0).collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let gb = bytes as f64 / 1e9;
        let parts: Vec<String> = rows
            .iter()
            .map(|&(ref n, (s, k, least, most, system))| {
                // The kernel's share where it is noticeable (page faults, copies into the page cache, locks).
                let sys = if system >= 0.1 * s && s / gb >= 0.01 {
                    format!(", {:.0}% system", 100.0 * system / s)
                } else {
                    String::new()
                };
                match k {
                    1 if sys.is_empty() => format!("{n} {:.2}", s / gb),
                    1 => format!("{n} {:.2} ({})", s / gb, &sys[2..]),
                    _ => format!("{n} {:.2} ({k} threads, {:.2}–{:.2} each{sys})", s / gb, least / gb, most / gb),
                }
            })
            .collect();
        if parts.is_empty() {
            "—".into()
        } else {
            parts.join(", ")
        }
    }
}

/// Waits until every record is exported (file sinks: written and their files committed) and returns when.
fn flush(session: &Session) -> Res<Instant> {
    if !session.wait_drained(Duration::from_secs(600)) {
        return Err("not drained within 10 minutes".into());
    }
    Ok(Instant::now())
}

/// Each hookpoint's activations (`bytes` of them), generated on a thread each: 1 GiB of normal-distributed bf16 took
/// one thread ~15 s on the GPU host, most of a short configuration's run.
fn sources(ids: &[u32], bytes: usize) -> Vec<Vec<u8>> {
    std::thread::scope(|scope| {
        let threads: Vec<_> = ids.iter().map(|&id| scope.spawn(move || activations(bytes, id as u64 + 1))).collect();
        threads.into_iter().map(|t| t.join().expect("activations thread")).collect()
    })
}

/// Runs `setup` for `laps` ring capacities of activations and prints one `RESULT` line.
fn run_child(setup: &Setup, laps: usize) -> Res<()> {
    let steps = ((setup.ring as usize * laps) as u64).div_ceil(setup.step_bytes()).max(2);
    let session = Session::new(setup.config())?;
    let ids: Vec<u32> = session.hookpoints().iter().map(|h| h.id()).collect();
    let per_hp = setup.rows as usize * setup.row_width as usize * 2;
    let rows = setup.rows;
    let batch = |step: u64| (0..rows).map(move |i| (step * 8 + (i / 2048) as u64, i % 2048));
    let (cpu, started, flushed);
    match setup.backend {
        Backend::Cuda => {
            let gpu = Gpu::open(0)?;
            let stream = Stream::new(&gpu)?;
            let sources: Vec<DeviceBuffer> = sources(&ids, per_hp)
                .iter()
                .map(|host| -> Res<DeviceBuffer> {
                    let b = DeviceBuffer::zeroed(&gpu, per_hp)?;
                    b.copy_from_host_async(0, host, stream.handle())?;
                    Ok(b)
                })
                .collect::<Res<_>>()?;
            stream.synchronize()?;
            cpu = ThreadCpu::start()?;
            started = Instant::now();
            for step in 0..steps {
                session.begin_step_on(step, batch(step), stream.handle())?;
                for (id, src) in ids.iter().zip(&sources) {
                    session.capture_device(*id, src.ptr(), rows, stream.handle())?;
                }
                session.end_step()?;
            }
            stream.synchronize()?;
            flushed = flush(&session)?;
        }
        Backend::Host => {
            let sources = sources(&ids, per_hp);
            cpu = ThreadCpu::start()?;
            started = Instant::now();
            for step in 0..steps {
                session.begin_step(step, batch(step))?;
                for (id, src) in ids.iter().zip(&sources) {
                    session.capture(*id, src)?;
                }
                session.end_step()?;
            }
            flushed = flush(&session)?;
        }
    }
    let report = session.shutdown()?;
    let closed = Instant::now();
    let total = report.accounting.total();
    let bytes = steps * setup.step_bytes();
    let secs = (closed - started).as_secs_f64();
    let file_bytes: u64 = report.files.iter().map(|f| f.bytes).sum();
    let cpu = cpu.finish(bytes);
    println!(
        "RESULT\t{}\t{:.2}\t{:.1}\t{:.0}\t{:.1}\t{:.0}\t{}\t{}\t{}\t{:.3}\t{}\t{}",
        setup.name,
        bytes as f64 / secs / 1e9,
        bytes as f64 / (flushed - started).as_secs_f64() / 1e9,
        (steps * rows as u64) as f64 / secs,
        (closed - flushed).as_secs_f64() * 1e3,
        peak_rss_mib(),
        total.exported.rows,
        total.produced.rows - total.exported.rows,
        report.drain.evacuated_records,
        if file_bytes > 0 { file_bytes as f64 / bytes as f64 } else { f64::NAN },
        report.drain.errors.len(),
        cpu,
    );
    for e in report.drain.errors.iter().take(3) {
        eprintln!("{}: {e}", setup.name);
    }
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn list(values: &[f64]) -> String {
    values.iter().map(|v| format!("{v:.2}")).collect::<Vec<_>>().join(" / ")
}

/// After `repeat` rounds: each configuration's median GB/s, and for configurations that differ only in their
/// thread count, each one's median against the one-thread configuration's (the `0.8 × N` of issue 13).
fn print_medians(all: &[Setup], rates: &std::collections::BTreeMap<&str, Vec<f64>>, repeat: usize) {
    println!("\n### Medians over {repeat} interleaved rounds\n");
    for s in all {
        let Some(r) = rates.get(s.name.as_str()) else { continue };
        let one = all
            .iter()
            .find(|o| o.threads == 1 && o.name == s.name.replace(&format!("{} threads", s.threads), "1 threads"))
            .and_then(|o| rates.get(o.name.as_str()))
            .map(|o| median(o));
        let scaling = match one {
            Some(one) if s.threads > 1 => format!(
                "; {:.2} × the 1-thread median = {:.2} × N",
                median(r) / one,
                median(r) / one / s.threads as f64
            ),
            _ => String::new(),
        };
        println!("- {}: {:.2} GB/s (runs: {}){scaling}", s.name, median(r), list(r));
    }
}

/// The machine's CPUs: logical CPUs this process may use, and physical cores (distinct `physical id`/`core id` pairs
/// of `/proc/cpuinfo`, Linux): threads sharing a core (SMT) share its compression throughput.
fn cpu_summary() -> String {
    let logical = std::thread::available_parallelism().map_or(0, |n| n.get());
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mut cores = std::collections::HashSet::new();
    let mut package = "";
    for line in info.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        match key.trim() {
            "physical id" => package = value.trim(),
            "core id" => {
                cores.insert((package.to_owned(), value.trim().to_owned()));
            }
            _ => {}
        }
    }
    let model = info.lines().find_map(|l| l.strip_prefix("model name")).and_then(|l| l.split_once(':'));
    let model = model.map_or("unknown CPU", |(_, m)| m.trim());
    match cores.len() {
        0 => format!("CPUs: {logical} logical ({model})"),
        n => format!("CPUs: {logical} logical, {n} physical cores ({model})"),
    }
}

/// Device → pinned copies of `chunk` bytes back to back, `total` bytes in all, GB/s (best of three).
fn pinned_ceiling(chunk: usize, total: usize) -> Res<f64> {
    use ringscope_ring::cuda::PinnedBuffer;
    let gpu = Gpu::open(0)?;
    let src = DeviceBuffer::zeroed(&gpu, total)?;
    let dst = PinnedBuffer::zeroed(&gpu, total, false)?;
    let stream = Stream::new(&gpu)?;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        for off in (0..total).step_by(chunk) {
            // SAFETY: both buffers hold `total` bytes; `dst` is not read and outlives the copies (synchronised below).
            unsafe { dst.copy_from_device_async(off, &src, off, chunk.min(total - off), stream.stream_ref()) }?;
        }
        stream.synchronize()?;
        best = best.max(total as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

/// One thread copying records of `record` bytes into a reused `ring`-byte buffer, `total` bytes, GB/s (best of 3).
fn memcpy_ceiling(record: usize, ring: usize, total: usize) -> f64 {
    let src = activations(record, 7);
    let mut dst = vec![0u8; ring];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let (mut off, mut done) = (0, 0);
        while done < total {
            if off + record > ring {
                off = 0;
            }
            dst[off..off + record].copy_from_slice(&src);
            std::hint::black_box(&dst[off]);
            off += record;
            done += record;
        }
        best = best.max(total as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// zstd(1) alone on this machine with `threads` threads at once, each compressing its own activations in 1 MiB
/// pieces (the Parquet sink's page size; frame checksums on as there, unless `checksums` is false) with a reused
/// context into a reused buffer, `per_thread` bytes each: what
/// the Parquet sink's compression could reach with that many threads here. Returns GB/s of input, all together.
fn zstd_ceiling(threads: usize, per_thread: usize, checksums: bool) -> Res<f64> {
    let data: Vec<Vec<u8>> = (0..threads).map(|t| activations(ZSTD_DATA, 10 + t as u64)).collect();
    zstd_over(&data.iter().map(Vec::as_slice).collect::<Vec<_>>(), per_thread, checksums)
}

/// Activations each thread of [`zstd_ceiling`] cycles through.
const ZSTD_DATA: usize = 64 << 20;

/// As [`zstd_ceiling`] with checksums, each thread's activations in pinned host memory allocated as the CUDA ring's
/// staging is (`cuMemHostAlloc`, not write-combined): whether the memory the Parquet sink reads records from
/// compresses slower than heap memory.
fn zstd_pinned_ceiling(threads: usize, per_thread: usize) -> Res<f64> {
    use ringscope_ring::cuda::PinnedBuffer;
    let gpu = Gpu::open(0)?;
    let pinned = PinnedBuffer::zeroed(&gpu, threads * ZSTD_DATA, false)?;
    let data: Vec<&[u8]> = (0..threads)
        .map(|t| {
            // SAFETY: one writer for each thread's range, no device copy into the buffer; the mutable slices end
            // before the shared ones below are made.
            unsafe { pinned.slice_mut(t * ZSTD_DATA, ZSTD_DATA) }
                .copy_from_slice(&activations(ZSTD_DATA, 10 + t as u64));
            // SAFETY: in bounds; nothing writes the buffer from here on.
            unsafe { pinned.slice(t * ZSTD_DATA, ZSTD_DATA) }
        })
        .collect();
    zstd_over(&data, per_thread, true)
}

/// One thread per slice of `data`, each compressing `per_thread` bytes of it, cycled, in 1 MiB pieces: GB/s of input.
fn zstd_over(data: &[&[u8]], per_thread: usize, checksums: bool) -> Res<f64> {
    const PIECE: usize = 1 << 20;
    let threads = data.len();
    let t = Instant::now();
    let results: Vec<std::io::Result<()>> = std::thread::scope(|scope| {
        let workers: Vec<_> = data
            .iter()
            .map(|d| {
                scope.spawn(move || {
                    let mut zstd = zstd::bulk::Compressor::new(1)?;
                    // As the sink's pages: each frame ends with a checksum of its content.
                    zstd.set_parameter(zstd::zstd_safe::CParameter::ChecksumFlag(checksums))?;
                    let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(PIECE));
                    for piece in d.chunks(PIECE).cycle().take(per_thread / PIECE) {
                        out.clear();
                        zstd.compress_to_buffer(piece, &mut out)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("zstd thread")).collect()
    });
    let elapsed = t.elapsed().as_secs_f64();
    for r in results {
        r?;
    }
    Ok((threads * (per_thread / PIECE) * PIECE) as f64 / elapsed / 1e9)
}

/// Sequential write rate of `dir`: `total` bytes in 8 MiB writes (`O_DIRECT` if the file system takes it, else the
/// page cache), then `fsync`, by `writers` threads at once, each writing `total / writers` bytes to a file of its
/// own. Returns the GB/s of all of them together (from the first write to the last `fsync`) and how they wrote.
fn disk_write_rate(dir: &str, total: usize, writers: usize) -> Res<(f64, &'static str)> {
    std::fs::create_dir_all(dir)?;
    let t = Instant::now();
    let results: Vec<Result<(usize, &'static str), String>> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..writers)
            .map(|w| scope.spawn(move || write_one(dir, w, total / writers).map_err(|e| e.to_string())))
            .collect();
        threads.into_iter().map(|t| t.join().expect("writer thread")).collect()
    });
    let elapsed = t.elapsed().as_secs_f64();
    let mut written = 0;
    let mut how = "O_DIRECT";
    for r in results {
        let (n, h) = r?;
        written += n;
        if h != "O_DIRECT" {
            how = h;
        }
    }
    Ok((written as f64 / elapsed / 1e9, how))
}

/// One writer of [`disk_write_rate`]: bytes written and how.
fn write_one(dir: &str, writer: usize, total: usize) -> Res<(usize, &'static str)> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = std::path::Path::new(dir).join(format!(".write-rate-{}-{writer}", std::process::id()));
    const CHUNK: usize = 8 << 20;
    // 4 KiB-aligned buffer for O_DIRECT.
    let mut raw = vec![0u8; CHUNK + 4096];
    let off = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[off..off + CHUNK];
    buf.copy_from_slice(&activations(CHUNK, 3));
    let open = |direct: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&path)
    };
    let (mut file, mut how) = match open(true) {
        Ok(f) => (f, "O_DIRECT"),
        Err(_) => (open(false)?, "page cache + fsync"),
    };
    let mut written = 0;
    while written < total {
        match file.write_all(buf) {
            Ok(()) => written += CHUNK,
            Err(_) if how == "O_DIRECT" && written == 0 => {
                (file, how) = (open(false)?, "page cache + fsync");
            }
            Err(e) => return Err(e.into()),
        }
    }
    file.sync_all()?;
    drop(file);
    std::fs::remove_file(&path)?;
    Ok((written, how))
}

fn setups(args: &Args) -> Vec<Setup> {
    let mut out = Vec::new();
    let want = |b: &str| args.backend == "all" || args.backend == b;
    if want("host") {
        // 4 hookpoints × 1,024 rows × 2,048 bf16 = 16 MiB a step; a 256 MiB ring (unless `--host-ring-mib` says
        // otherwise).
        let host = Setup {
            name: "host: no sink".into(),
            backend: Backend::Host,
            ring: args.host_ring_mib << 20,
            hookpoints: 4,
            rows: 1024,
            row_width: 2048,
            files: None,
            threads: 1,
            zstd_level: 1,
            compression: Compression::Zstd,
            direct_io: DirectIo::Auto,
            backlog: args.backlog_mib.map(|m| m << 20),
        };
        out.push(host.clone());
        out.push(Setup {
            name: "host: Arrow IPC (memory)".into(),
            files: Some((false, true, args.shm.clone())),
            ..host.clone()
        });
        // With O_DIRECT, tmpfs still copies, from our buffers: every record copied into them first (what `auto` did
        // on tmpfs before it chose the page cache there).
        out.push(Setup {
            name: "host: Arrow IPC (memory), direct_io on".into(),
            files: Some((false, true, args.shm.clone())),
            direct_io: DirectIo::On,
            ..host.clone()
        });
        // One large hookpoint (4,096 rows a step): with several sink threads, they share its records (a pool).
        for threads in [1, 2] {
            out.push(Setup {
                name: format!("host: Parquet zstd(1) (memory), 1 hookpoint, {threads} threads"),
                hookpoints: 1,
                rows: 4096,
                files: Some((true, false, args.shm.clone())),
                threads,
                ..host.clone()
            });
        }
        out.push(Setup {
            name: "host: Parquet zstd(1) (memory), 1 hookpoint, 1 threads, direct_io on".into(),
            hookpoints: 1,
            rows: 4096,
            files: Some((true, false, args.shm.clone())),
            direct_io: DirectIo::On,
            ..host.clone()
        });
    }
    if want("cuda") {
        // A 1B-shape Llama's prefill: 16 layers × 16,384 tokens × 2,048 bf16 = 1 GiB a step; a 4 GiB ring (unless
        // `--cuda-ring-gib` says otherwise).
        let cuda = Setup {
            name: "cuda: no sink".into(),
            backend: Backend::Cuda,
            ring: args.cuda_ring_gib << 30,
            hookpoints: 16,
            rows: 16384,
            row_width: 2048,
            files: None,
            threads: 8,
            zstd_level: 1,
            compression: Compression::Zstd,
            direct_io: DirectIo::Auto,
            backlog: args.backlog_mib.map(|m| m << 20),
        };
        out.push(cuda.clone());
        for (name, dir) in [("disk", &args.dir), ("memory", &args.shm)] {
            out.push(Setup {
                name: format!("cuda: Arrow IPC ({name}), 8 threads"),
                files: Some((false, true, dir.clone())),
                ..cuda.clone()
            });
        }
        out.push(Setup {
            name: "cuda: Arrow IPC (memory), 8 threads, direct_io on".into(),
            files: Some((false, true, args.shm.clone())),
            direct_io: DirectIo::On,
            ..cuda.clone()
        });
        // More sink threads than the default eight: a file per thread at once, in memory.
        for threads in [12, 16] {
            out.push(Setup {
                name: format!("cuda: Arrow IPC (memory), {threads} threads"),
                files: Some((false, true, args.shm.clone())),
                threads,
                ..cuda.clone()
            });
        }
        for (codec, compression) in [("lz4", Compression::Lz4), ("none", Compression::None)] {
            out.push(Setup {
                name: format!("cuda: Parquet {codec} (memory), 8 threads"),
                files: Some((true, false, args.shm.clone())),
                compression,
                ..cuda.clone()
            });
        }
        for threads in [1, 2, 4, 8] {
            out.push(Setup {
                name: format!("cuda: Parquet zstd(1) (memory), {threads} threads"),
                files: Some((true, false, args.shm.clone())),
                threads,
                ..cuda.clone()
            });
        }
    }
    if let Some(only) = &args.only {
        out.retain(|s| s.name.contains(only.as_str()));
    }
    out
}

/// Runs configuration `s` in a child process (its files removed before and after): the fields of its result line, if
/// it printed one, and its standard error.
fn run_one(exe: &std::path::Path, args: &Args, s: &Setup) -> Res<(Option<Vec<String>>, String)> {
    let run_dir = s.files.as_ref().map(|(_, _, dir)| std::path::Path::new(dir).join(s.run_id()));
    if let Some(d) = &run_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    let out = Command::new(exe)
        .args(["--child", &s.name, "--backend", &args.backend, "--dir", &args.dir, "--shm", &args.shm])
        .args(["--laps", &args.laps.to_string(), "--cuda-ring-gib", &args.cuda_ring_gib.to_string()])
        .args(["--host-ring-mib", &args.host_ring_mib.to_string()])
        .args(args.backlog_mib.iter().flat_map(|m| ["--backlog-mib".to_string(), m.to_string()]))
        .output()?;
    if let Some(d) = &run_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let fields =
        stdout.lines().find_map(|l| l.strip_prefix("RESULT\t")).map(|l| l.split('\t').map(str::to_owned).collect());
    Ok((fields, String::from_utf8_lossy(&out.stderr).into_owned()))
}

fn main() -> Res<()> {
    let args = Args::parse();
    let all = setups(&args);
    if let Some(name) = &args.child {
        let setup = all.iter().find(|s| &s.name == name).ok_or("unknown configuration")?;
        return run_child(setup, args.laps);
    }
    if all.iter().any(|s| s.backend == Backend::Cuda) && Gpu::open(0).is_err() {
        println!("skipped: no CUDA device");
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    // The first run on a freshly started machine pays for the first use of its memory (the kernel's copies into tmpfs
    // cost 2–3× the CPU: docs/gpu-benchmarks.md, session 16); a run of the first configuration, not counted, first.
    if !args.no_warmup {
        if let Some(first) = all.first() {
            let (result, _) = run_one(&exe, &args, first)?;
            let rate = result.as_ref().and_then(|f| f.get(1).cloned()).unwrap_or_else(|| "failed".into());
            println!("Warm-up run, not counted: {} at {rate} GB/s.\n", first.name);
        }
    }
    println!("## Bulk capture through a Session (full mode, {} ring capacities per configuration)\n", args.laps);
    println!(
        "| configuration | GB/s (first capture → shutdown returned) | drain GB/s (first capture → flushed) | tokens/s \
         | close after flush (ms) | peak RSS (MiB) \
         | rows exported | rows not exported | moved out of the ring | file bytes ÷ activation bytes | errors \
         | CPU s per GB by thread (threads) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let repeat = args.repeat.max(1);
    let mut rates: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    for s in (0..repeat).flat_map(|_| all.iter()) {
        let (result, stderr) = run_one(&exe, &args, s)?;
        match result {
            Some(fields) => {
                if let Some(rate) = fields.get(1).and_then(|r| r.parse::<f64>().ok()) {
                    rates.entry(s.name.as_str()).or_default().push(rate);
                }
                println!("| {} |", fields.join(" | "))
            }
            None => println!("| {} | failed: {} |", s.name, stderr.trim().replace('\n', " ")),
        }
        for line in stderr.lines().filter(|l| !l.trim().is_empty()).take(3) {
            eprintln!("  {line}");
        }
        std::io::stdout().flush()?;
    }
    if repeat > 1 {
        print_medians(&all, &rates, repeat);
    }
    println!("\n### Ceilings, same run\n");
    println!("- {}", cpu_summary());
    if all.iter().any(|s| s.backend == Backend::Host) {
        println!(
            "- memcpy, one thread, 4 MiB records into a reused 256 MiB buffer: {:.2} GB/s",
            memcpy_ceiling(4 << 20, 256 << 20, 4 << 30)
        );
    }
    if all.iter().any(|s| s.backend == Backend::Cuda) {
        let chunk = Config::new().ring.drain_chunk.0 as usize;
        println!("- pinned D2H, {} MiB chunks back to back: {:.1} GB/s", chunk >> 20, pinned_ceiling(chunk, 4 << 30)?);
    }
    if all.iter().any(|s| s.files.as_ref().is_some_and(|f| f.0) && s.compression == Compression::Zstd) {
        println!(
            "- zstd(1) alone, 1 thread, 1 MiB pieces, without frame checksums: {:.2} GB/s",
            zstd_ceiling(1, 1 << 30, false)?
        );
        // Rounds interleaved over the thread counts, so that drift of the machine falls on all alike; medians.
        let counts = [1, 2, 4, 8];
        let mut runs = vec![Vec::new(); counts.len()];
        for _ in 0..repeat {
            for (i, &threads) in counts.iter().enumerate() {
                runs[i].push(zstd_ceiling(threads, 1 << 30, true)?);
            }
        }
        let one = median(&runs[0]);
        for (i, threads) in counts.iter().enumerate() {
            let rate = median(&runs[i]);
            let spread = match repeat {
                1 => String::new(),
                _ => format!(", median of {repeat}: {}", list(&runs[i])),
            };
            println!(
                "- zstd(1) alone, {threads} thread(s) at once, 1 MiB pieces: {rate:.2} GB/s ({:.2} × {threads} × one \
                 thread{spread})",
                rate / one / *threads as f64
            );
        }
        if all.iter().any(|s| s.backend == Backend::Cuda) {
            let (heap, pinned) = (zstd_ceiling(8, 1 << 30, true)?, zstd_pinned_ceiling(8, 1 << 30)?);
            println!(
                "- zstd(1) alone, 8 threads at once, reading pinned host memory (as the staging): {pinned:.2} GB/s \
                 ({:.2} × the same from heap memory, {heap:.2} GB/s, measured just before)",
                pinned / heap
            );
        }
    }
    let mut dirs = vec![("memory", args.shm.as_str())];
    if all.iter().any(|s| s.files.as_ref().is_some_and(|f| f.2 == args.dir)) {
        dirs.push(("disk", args.dir.as_str()));
    }
    // One writer (what one sink thread's file could reach), eight and sixteen at once, each to a file of its own (what
    // the default eight sink threads of the CUDA configurations, or their most, sixteen, could reach together).
    for (name, dir) in dirs {
        for writers in [1, 8, 16] {
            match disk_write_rate(dir, 4 << 30, writers) {
                Ok((rate, how)) => println!(
                    "- sequential write, {name} ({dir}), 4 GiB in 8 MiB writes, {how}, {writers} writer(s) at once: \
                     {rate:.2} GB/s"
                ),
                Err(e) => println!("- sequential write, {name} ({dir}), {writers} writer(s): failed: {e}"),
            }
        }
    }
    Ok(())
}
