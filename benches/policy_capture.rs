//! The policy manager under pressure, through the public API: all-layer capture of a 1B-shape model's residual
//! stream (16 hookpoints × 2,048 bf16) in prefill and in decode, (a) with a drain cap below the production rate,
//! (b) with a deliberately slow sink, (c) with a small GPU ring — each in full mode and in best-effort mode — next
//! to the same engine without capture, in the same process.
//!
//! ```text
//! cargo bench --bench policy_capture -- --backend cuda     # an NVIDIA GPU
//! cargo bench --bench policy_capture                       # host backend (any machine; smaller shapes)
//! ```
//!
//! The engine is synthetic: a step is device-to-device copies sized to take about the step time of the real model
//! (memory-bound work, as decode is, which competes with the capture kernels and the drain's copies for memory
//! bandwidth), with one capture after each layer's share, then a stream synchronisation (as `generate` does when it
//! reads the next token). Step time is measured per step on the host (wall time of the synchronised step, so
//! full-mode admission waits are in it). Each configuration runs in a child process: first `--warmup` + `--steps`
//! steps without capture (the baseline), then the same steps with capture.
//!
//! Printed per configuration: median and p99 step time and their overhead against the baseline, stall time (full
//! mode's waits for room), rows produced / exported / sampled out / dropped, the kept fraction, the rungs the
//! hookpoints ended on, rows exported as fp8 (downcast) and their error against the bf16 source.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use ringscope::config::{Backend, ByteRate, ByteSize, HookPointConfig, OnDeadline, RowsConfig};
use ringscope::cuda::{DeviceBuffer, Gpu, Stream};
use ringscope::{Config, Mode, Session};
use ringscope_exporter::{CallbackSink, Record};
use ringscope_ring::{rowscaled, DType};

mod common;
use common::{activations, bf16, percentile};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// `host` or `cuda`.
    #[arg(long, default_value = "host")]
    backend: String,
    /// Steps measured per configuration (with capture; as many again without).
    #[arg(long, default_value_t = 0)]
    steps: u64,
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

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Prefill,
    Decode,
}

#[derive(Clone, Debug)]
struct Setup {
    name: String,
    backend: Backend,
    phase: Phase,
    mode: Mode,
    hookpoints: u32,
    width: u32,
    /// Rows per step, and requests among them.
    rows: u32,
    requests: u32,
    ring: u64,
    drain_rate: Option<u64>,
    /// A sink that takes this many bytes per second (sleeps for the rest), or none.
    sink_rate: Option<u64>,
    /// The engine's step time without capture (its work is calibrated to it).
    step_time: Duration,
    steps: u64,
}

impl Setup {
    fn step_bytes(&self) -> u64 {
        self.hookpoints as u64 * self.rows as u64 * self.width as u64 * 2
    }

    fn config(&self) -> Config {
        let mut c = Config::new();
        c.ring.capacity = ByteSize(self.ring);
        c.ring.backend = self.backend;
        c.ring.max_batch_rows = self.rows;
        c.policy.mode = self.mode;
        c.policy.full_deadline_ms = 2_000;
        c.policy.on_deadline = OnDeadline::Degrade;
        c.policy.drain_rate = self.drain_rate.map(ByteRate);
        if self.mode == Mode::BestEffort {
            // The budgets turn the policy manager on: the ring is the GPU budget.
            c.policy.gpu_memory = Some(ByteSize(self.ring));
            c.policy.dwell_ms = 200;
        }
        c.hookpoints = (0..self.hookpoints)
            .map(|l| HookPointConfig {
                name: format!("layers.{l}.resid"),
                site: ringscope::SiteKind::Residual,
                layer: Some(l),
                dtype: "bf16".into(),
                row_width: self.width,
                rows: RowsConfig::default(),
                every_n_steps: 1,
                enabled: true,
                // Later layers matter more to most probes: the early ones give way first.
                priority: l as i32,
            })
            .collect();
        c
    }
}

/// bf16 values of a standard normal distribution, little-endian.
/// The downcast error seen by a checking sink: max relative error of elements at least 1/64 of their row's largest
/// magnitude, and the largest row-wise relative RMS error.
#[derive(Default)]
struct DowncastError {
    rows: AtomicU64,
    max_rel_bits: AtomicU64,
    max_row_rms_bits: AtomicU64,
}

fn fetch_max(a: &AtomicU64, v: f64) {
    a.fetch_max(v.to_bits(), Ordering::Relaxed); // non-negative floats order like their bits
}

/// A sink that takes `rate` bytes per second (when set) and checks downcast rows against the sources.
fn checking_sink(
    rate: Option<u64>,
    sources: Arc<Vec<Vec<u8>>>,
    width: usize,
    err: Arc<DowncastError>,
) -> impl ringscope_exporter::Sink {
    CallbackSink::new("bench-sink", move |r: &Record| {
        let started = Instant::now();
        let view = r.view();
        if view.header.meta.dtype == DType::F8E4M3RowScaled {
            let src = &sources[r.hookpoint().id() as usize];
            let mut out = vec![0f32; width];
            for (i, m) in view.row_metas().enumerate() {
                rowscaled::decode_row(view.row(i), &mut out);
                let x = &src[m.batch_row as usize * width * 2..(m.batch_row as usize + 1) * width * 2];
                let xs: Vec<f32> = x.chunks_exact(2).map(|c| bf16([c[0], c[1]])).collect();
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                let (mut max_rel, mut se, mut sx) = (0f64, 0f64, 0f64);
                for (&a, &b) in xs.iter().zip(&out) {
                    let d = (a - b) as f64;
                    se += d * d;
                    sx += (a as f64) * (a as f64);
                    if a.abs() >= amax / 64.0 && a != 0.0 {
                        max_rel = max_rel.max((d / a as f64).abs());
                    }
                }
                fetch_max(&err.max_rel_bits, max_rel);
                fetch_max(&err.max_row_rms_bits, (se / sx.max(f64::MIN_POSITIVE)).sqrt());
                err.rows.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(rate) = rate {
            let due = Duration::from_secs_f64(r.size_bytes() as f64 / rate as f64);
            if let Some(rest) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        Ok(())
    })
}

fn run_child(setup: &Setup) -> Res<()> {
    let per_hp = setup.rows as usize * setup.width as usize;
    let sources: Arc<Vec<Vec<u8>>> =
        Arc::new((0..setup.hookpoints).map(|l| activations(per_hp, l as u64 + 1)).collect());
    let err = Arc::new(DowncastError::default());
    let mut builder = Session::builder(setup.config());
    builder = builder.sink(checking_sink(setup.sink_rate, sources.clone(), setup.width as usize, err.clone()));
    let rows = setup.rows;
    let per_request = rows / setup.requests.max(1);
    let phase = setup.phase;
    // Prefill: new requests every step, positions 0.. within each; decode: the same requests, one token each.
    let batch = move |step: u64| {
        (0..rows).map(move |i| match phase {
            Phase::Prefill => (step * 1000 + (i / per_request) as u64, i % per_request),
            Phase::Decode => (i as u64, step as u32),
        })
    };
    // The engine's work per layer: copies of a scratch buffer, repeated to make up the step time.
    const SCRATCH: usize = 64 << 20;
    let mut base = Vec::new();
    let mut with = Vec::new();
    let captured;
    let session;
    match setup.backend {
        Backend::Cuda => {
            let gpu = Gpu::open(0)?;
            let stream = Stream::new(&gpu)?;
            let devs: Vec<DeviceBuffer> = sources
                .iter()
                .map(|s| -> Res<DeviceBuffer> {
                    let b = DeviceBuffer::zeroed(&gpu, s.len())?;
                    b.copy_from_host_async(0, s, stream.handle())?;
                    Ok(b)
                })
                .collect::<Res<_>>()?;
            let (a, b) = (DeviceBuffer::zeroed(&gpu, SCRATCH)?, DeviceBuffer::zeroed(&gpu, SCRATCH)?);
            stream.synchronize()?;
            let sref = stream.stream_ref();
            let t = Instant::now();
            for _ in 0..20 {
                a.copy_from_device_async(&b, SCRATCH, sref)?;
            }
            stream.synchronize()?;
            let per_copy = t.elapsed().as_secs_f64() / 20.0;
            let reps = ((setup.step_time.as_secs_f64() / setup.hookpoints as f64 / per_copy).round() as usize).max(1);
            let layer = |sref: &ringscope::cuda::StreamRef| -> Res<()> {
                for _ in 0..reps {
                    a.copy_from_device_async(&b, SCRATCH, sref)?;
                }
                Ok(())
            };
            let step_without = || -> Res<f64> {
                let t = Instant::now();
                for _ in 0..setup.hookpoints {
                    layer(sref)?;
                }
                stream.synchronize()?;
                Ok(t.elapsed().as_secs_f64())
            };
            for _ in 0..setup.steps / 4 {
                step_without()?;
            }
            for _ in 0..setup.steps {
                base.push(step_without()?);
            }
            session = builder.start()?;
            let ids: Vec<u32> = session.hookpoints().iter().map(|h| h.id()).collect();
            let started = Instant::now();
            for step in 0..setup.steps {
                let t = Instant::now();
                session.begin_step_on(step, batch(step), stream.handle())?;
                for (id, src) in ids.iter().zip(&devs) {
                    layer(sref)?;
                    session.capture_device(*id, src.ptr(), rows, stream.handle())?;
                }
                session.end_step()?;
                stream.synchronize()?;
                with.push(t.elapsed().as_secs_f64());
            }
            captured = started.elapsed();
        }
        Backend::Host => {
            // The host engine's work: copies between two buffers, repeated to make up the step time.
            let (mut a, b) = (vec![0u8; SCRATCH / 8], vec![1u8; SCRATCH / 8]);
            let t = Instant::now();
            for _ in 0..20 {
                a.copy_from_slice(&b);
                std::hint::black_box(&a);
            }
            let per_copy = t.elapsed().as_secs_f64() / 20.0;
            let reps = ((setup.step_time.as_secs_f64() / setup.hookpoints as f64 / per_copy).round() as usize).max(1);
            let layer = move |a: &mut Vec<u8>| {
                for _ in 0..reps {
                    a.copy_from_slice(&b);
                    std::hint::black_box(&a);
                }
            };
            let step_without = |a: &mut Vec<u8>| {
                let t = Instant::now();
                for _ in 0..setup.hookpoints {
                    layer(a);
                }
                t.elapsed().as_secs_f64()
            };
            for _ in 0..setup.steps {
                base.push(step_without(&mut a));
            }
            session = builder.start()?;
            let ids: Vec<u32> = session.hookpoints().iter().map(|h| h.id()).collect();
            let started = Instant::now();
            for step in 0..setup.steps {
                let t = Instant::now();
                session.begin_step(step, batch(step))?;
                for (id, src) in ids.iter().zip(sources.iter()) {
                    layer(&mut a);
                    session.capture(*id, src)?;
                }
                session.end_step()?;
                with.push(t.elapsed().as_secs_f64());
            }
            captured = started.elapsed();
        }
    }
    let stats = session.stats();
    // The rungs the hookpoints ended on, in layer order, each with how many hookpoints and the rows they exported.
    let mut rungs: Vec<(String, u32, u64)> = Vec::new();
    for h in &stats.hookpoints {
        match rungs.last_mut() {
            Some((r, n, rows)) if *r == h.rung => {
                *n += 1;
                *rows += h.counters.exported.rows;
            }
            _ => rungs.push((h.rung.clone(), 1, h.counters.exported.rows)),
        }
    }
    let rungs: Vec<String> = rungs.iter().map(|(r, n, rows)| format!("{r} ×{n} ({rows} rows)")).collect();
    let stall = (stats.stalls, stats.stall_time);
    let report = session.shutdown()?;
    let total = report.accounting.total();
    base.sort_by(f64::total_cmp);
    with.sort_by(f64::total_cmp);
    let (b50, b99, w50, w99) =
        (percentile(&base, 0.5), percentile(&base, 0.99), percentile(&with, 0.5), percentile(&with, 0.99));
    let produced = total.produced.rows.max(1) as f64;
    // What the sink took per second of capture (read when the capture ended), against the budget: the drain cap or
    // the sink's speed.
    let delivered: u64 = stats.destinations.iter().map(|d| d.delivered_bytes).sum();
    let moved = delivered as f64 / captured.as_secs_f64().max(1e-9);
    let budget = match (setup.drain_rate, setup.sink_rate) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let used = budget.map_or("—".into(), |b| format!("{:.2} of {:.2} GB/s", moved / 1e9, b as f64 / 1e9));
    let downcast_rows = err.rows.load(Ordering::Relaxed);
    let dc = if downcast_rows > 0 {
        format!(
            "{} rows; max rel {:.3}, row RMS {:.3}",
            downcast_rows,
            f64::from_bits(err.max_rel_bits.load(Ordering::Relaxed)),
            f64::from_bits(err.max_row_rms_bits.load(Ordering::Relaxed))
        )
    } else {
        "—".into()
    };
    println!(
        "RESULT\t{}\t{:.2} / {:.2}\t{:.2} / {:.2}\t{:+.1}% / {:+.1}%\t{:.2} s ({} waits)\t{:.2}\t{}\t{}\t{}\t{}\t{:.1}%\t{}\t{}\t{}",
        setup.name,
        b50 * 1e3,
        b99 * 1e3,
        w50 * 1e3,
        w99 * 1e3,
        (w50 / b50 - 1.0) * 100.0,
        (w99 / b99 - 1.0) * 100.0,
        stall.1.as_secs_f64(),
        stall.0,
        setup.step_bytes() as f64 / b50 / 1e9,
        total.produced.rows,
        total.exported.rows,
        total.sampled_out.rows,
        total.dropped_total().rows,
        total.exported.rows as f64 / produced * 100.0,
        used,
        rungs.join(", "),
        dc,
    );
    for e in report.drain.errors.iter().take(3) {
        eprintln!("{}: {e}", setup.name);
    }
    Ok(())
}

fn setups(args: &Args) -> Vec<Setup> {
    let cuda = args.backend == "cuda";
    let mut out = Vec::new();
    for phase in [Phase::Prefill, Phase::Decode] {
        // CUDA: a 1B-shape model. Prefill: 8 requests × 2,048 tokens = 1 GiB of residuals a step, a step of about
        // 100 ms (the model's 11 GB/s measured in docs/gpu-benchmarks.md); decode: 64 requests, 4 MiB a step, a
        // step of about 5 ms. Host: a 16th of the rows.
        let ms = Duration::from_millis;
        let (rows, requests, step_time, steps, ring) = match (phase, cuda) {
            (Phase::Prefill, true) => (16384, 8, ms(100), 40, 8u64 << 30),
            (Phase::Decode, true) => (64, 64, ms(5), 300, 256 << 20),
            (Phase::Prefill, false) => (1024, 8, ms(40), 40, 512 << 20),
            (Phase::Decode, false) => (64, 64, ms(2), 400, 64 << 20),
        };
        let step_bytes = 16 * rows as u64 * 2048 * 2;
        let base = Setup {
            name: String::new(),
            backend: if cuda { Backend::Cuda } else { Backend::Host },
            phase,
            mode: Mode::Full,
            hookpoints: 16,
            width: 2048,
            rows,
            requests,
            ring,
            drain_rate: None,
            sink_rate: None,
            step_time,
            steps: if args.steps > 0 { args.steps } else { steps },
        };
        let p = if phase == Phase::Prefill { "prefill" } else { "decode" };
        out.push(Setup { name: format!("{p}: full, no limit"), ..base.clone() });
        // Caps well under the production rate (about a fifth in prefill, a tenth in decode on the GPU).
        let (cap, slow) = match phase {
            Phase::Prefill => (step_bytes * 2, step_bytes * 3),
            Phase::Decode => (step_bytes * 20, step_bytes * 30),
        };
        for (mode, m) in [(Mode::Full, "full"), (Mode::BestEffort, "best-effort")] {
            out.push(Setup { name: format!("{p}: {m}, (a) drain cap"), mode, drain_rate: Some(cap), ..base.clone() });
            out.push(Setup { name: format!("{p}: {m}, (b) slow sink"), mode, sink_rate: Some(slow), ..base.clone() });
            out.push(Setup {
                name: format!("{p}: {m}, (c) small ring + cap"),
                mode,
                ring: step_bytes * 3 / 2,
                drain_rate: Some(cap),
                ..base.clone()
            });
        }
    }
    if let Some(only) = &args.only {
        out.retain(|s| s.name.contains(only.as_str()));
    }
    out
}

fn main() -> Res<()> {
    let args = Args::parse();
    let all = setups(&args);
    if let Some(name) = &args.child {
        let setup = all.iter().find(|s| &s.name == name).ok_or("unknown configuration")?;
        return run_child(setup);
    }
    if args.backend == "cuda" && Gpu::open(0).is_err() {
        println!("skipped: no CUDA device");
        return Ok(());
    }
    println!("## The policy manager under pressure ({} backend)\n", args.backend);
    println!(
        "| configuration | step ms without capture (median / p99) | with capture | overhead | full-mode stall \
         | GB/s produced at full rate | rows produced | exported | sampled out | dropped | kept \
         | drained per second of capture, of the budget | rungs at the end, early → late layers (hookpoints, rows they \
         exported) | downcast rows and error |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let exe = std::env::current_exe()?;
    for s in &all {
        let mut cmd = Command::new(&exe);
        cmd.args(["--child", &s.name, "--backend", &args.backend]);
        if args.steps > 0 {
            cmd.args(["--steps", &args.steps.to_string()]);
        }
        let out = cmd.output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        match stdout.lines().find_map(|l| l.strip_prefix("RESULT\t")) {
            Some(line) => println!("| {} |", line.split('\t').collect::<Vec<_>>().join(" | ")),
            None => {
                println!("| {} | failed: {} |", s.name, String::from_utf8_lossy(&out.stderr).trim().replace('\n', " "))
            }
        }
        for line in String::from_utf8_lossy(&out.stderr).lines().filter(|l| !l.trim().is_empty()).take(3) {
            eprintln!("  {line}");
        }
    }
    Ok(())
}
