//! Online probes through the public API: what alerts cost and how fast they come.
//!
//! ```text
//! cargo bench --bench probes                    # host backend (any machine)
//! cargo bench --bench probes -- --backend cuda  # an NVIDIA GPU: fused probes in the capture path
//! ```
//!
//! Host backend, in one process:
//! * **publish → alert latency**: a per-token probe (K = 16 outputs over d = 2048 bf16 rows) on one hookpoint; each
//!   step captures a batch of 8 rows of which one crosses the threshold; timed from the moment `capture` returns
//!   (the record is published) to the alert arriving on [`Session::alerts`] (p50 / p99 / max);
//! * **scoring throughput** of the consumer (rows/s and GB/s of rows scored) next to the same session draining the
//!   same rows with no probe, and the engine-thread cost of a **fused** probe (scores computed at capture, only
//!   the scores enter the ring) per captured row.
//!
//! CUDA backend (`--backend cuda`): a 1B-shape decode step's capture — 16 hookpoints (one per layer) × batch rows ×
//! 2,048 bf16 in device memory — with (a) nothing, (b) raw capture of the 16 layers, (c) 16 fused probes with K = 1
//! and (d) K = 16 (the raw hookpoints disabled: only scores enter the ring), at batch 1 / 8 / 64: time of the step's
//! ringscope calls and kernels (begin_step_on + 16 captures + end_step, stream synchronised; median and p99), ring
//! bytes per step (what crosses PCIe), and the agreement of the fused scores with the host probe scoring the raw
//! rows of the same steps (max relative difference). And the alert latency of a fused per-token probe with
//! `action = "stop"`: from the step's launch to the engine seeing the request's stop flag in the flag table
//! (device-written, host-mapped memory), and to the alert on the channel. (The model's own step time is not in
//! these numbers: `benches/probe_overhead.py` measures fused probes inside a real decode step.)

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use common::{activations, bf16, percentile};
use ringscope::probe::save_npy;
use ringscope::{Config, Session};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const D: usize = 2048;
const K: usize = 16;

#[derive(Parser, Debug)]
struct Args {
    /// `host` or `cuda`.
    #[arg(long, default_value = "host")]
    backend: String,
    /// Steps timed per measurement.
    #[arg(long, default_value_t = 2000)]
    steps: u64,
    /// Ignored (cargo bench passes it).
    #[arg(long)]
    bench: bool,
}

/// Weights `[k, D]`: output 0 is a unit direction `u` (the "planted" concept), the others small random ones.
fn weights(dir: &Path, k: usize) -> Res<(PathBuf, Vec<f32>)> {
    let raw = activations(k * D, 42);
    let mut w: Vec<f32> = raw.chunks_exact(2).map(|c| bf16([c[0], c[1]]) * 0.01).collect();
    let u = direction();
    w[..D].copy_from_slice(&u);
    let path = dir.join(format!("probe-k{k}.npy"));
    save_npy(&path, &[k, D], &w)?;
    Ok((path, w))
}

fn direction() -> Vec<f32> {
    let raw = activations(D, 7);
    let v: Vec<f32> = raw.chunks_exact(2).map(|c| bf16([c[0], c[1]])).collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / n).collect()
}

/// `rows` bf16 rows of noise; row `planted` (if any) gets `+20 u`, which a per-token threshold of 10 catches.
fn batch_rows(rows: usize, planted: Option<usize>, seed: u64) -> Vec<u8> {
    // Seeds past 1000: the weights and the direction use small ones.
    let mut bytes = activations(rows * D, seed + 1000);
    if let Some(r) = planted {
        let u = direction();
        for (j, c) in bytes[r * D * 2..(r + 1) * D * 2].chunks_exact_mut(2).enumerate() {
            let v = bf16([c[0], c[1]]) + 20.0 * u[j];
            c.copy_from_slice(&(((v.to_bits() + 0x8000) >> 16) as u16).to_le_bytes());
        }
    }
    bytes
}

fn config(backend: &str, hookpoints: &str, probes: &str) -> Res<Config> {
    Ok(Config::from_toml(&format!(
        "[ring]\nbackend = \"{backend}\"\ncapacity = \"256 MiB\"\nmax_batch_rows = 4096\n\
         [policy]\nmode = \"best_effort\"\n{hookpoints}\n{probes}"
    ))?)
}

fn hookpoint(name: &str, layer: usize, enabled: bool) -> String {
    format!(
        "[[hookpoints]]\nname = \"{name}\"\nsite = \"residual\"\nlayer = {layer}\ndtype = \"bf16\"\nrow_width = {D}\n\
         enabled = {enabled}\n"
    )
}

fn probe(name: &str, hookpoint: &str, weights: &Path, mode: &str, aggregate: &str, action: &str) -> String {
    format!(
        "[[probes]]\nname = \"{name}\"\nhookpoint = \"{hookpoint}\"\nweights = \"{}\"\nthreshold = 10.0\n\
         aggregate = \"{aggregate}\"\naction = \"{action}\"\nmode = \"{mode}\"\n",
        weights.display(),
    )
}

fn summary(label: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    println!(
        "{label:<58} p50 {:>9.1} µs   p99 {:>9.1} µs   max {:>9.1} µs   (n = {})",
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        v[v.len() - 1],
        v.len()
    );
}

fn host(args: &Args, dir: &Path) -> Res<()> {
    let (w, _) = weights(dir, K)?;
    println!("host backend: probe K = {K} over d = {D} bf16 rows\n");
    // Latency: one planted row in each step's batch of 8, new requests every step.
    let session =
        Session::new(config("host", &hookpoint("h", 0, true), &probe("p", "h", &w, "consumer", "per_token", "stop"))?)?;
    let alerts = session.alerts()?;
    let hp = session.hookpoint("h")?.id();
    let steps = args.steps;
    let rows: Vec<Vec<u8>> = (0..16).map(|s| batch_rows(8, Some(s % 8), s as u64 + 1)).collect();
    let mut lat = Vec::new();
    let mut missed = 0;
    for step in 0..steps {
        let batch: Vec<(u64, u32)> = (0..8).map(|r| (step * 8 + r, 0)).collect();
        session.begin_step(step, batch)?;
        session.capture(hp, &rows[step as usize % 16])?;
        let published = Instant::now();
        session.end_step()?;
        match alerts.recv_timeout(Duration::from_secs(1)) {
            Ok(a) => {
                lat.push(published.elapsed().as_secs_f64() * 1e6);
                assert_eq!(a.request_id, step * 8 + step % 8, "the planted row's request alerts");
                assert!(session.is_flagged(a.request_id));
            }
            Err(_) => missed += 1,
        }
    }
    summary("publish → alert (consumer probe, batch 8)", lat);
    println!("  alerts missed: {missed}, dropped: {}\n", session.alerts_dropped());
    session.shutdown()?;

    // Throughput: 64-row steps as fast as the engine can capture them, with and without a consumer probe; and the
    // engine-thread cost of a fused probe.
    let rows64 = batch_rows(64, None, 99);
    let bytes_per_step = rows64.len() as f64;
    for (label, probes) in [
        ("drain only, no probe", String::new()),
        ("consumer probe", probe("p", "h", &w, "consumer", "mean", "alert")),
        ("fused probe (scored on the engine thread)", probe("p", "h", &w, "fused", "mean", "alert")),
    ] {
        let session = Session::new(config("host", &hookpoint("h", 0, true), &probes)?)?;
        let hp = session.hookpoint("h")?.id();
        let n = (steps * 2).max(200);
        let t = Instant::now();
        let mut capture = Duration::ZERO;
        for step in 0..n {
            session.begin_step(step, (0..64u64).map(|r| (r, step as u32)))?;
            let c = Instant::now();
            session.capture(hp, &rows64)?;
            capture += c.elapsed();
            session.end_step()?;
        }
        assert!(session.wait_probes(Duration::from_secs(120)), "{label}: the probes keep up");
        let secs = t.elapsed().as_secs_f64();
        let scored: u64 = session.probe_stats().iter().map(|p| p.rows).sum();
        let report = session.shutdown()?;
        let exported = report.accounting.total().exported.rows;
        println!(
            "{label:<44} {:>8.2} M rows/s end to end ({:>5.2} GB/s of rows); capture call {:>6.2} µs/row; \
             rows scored {scored}, exported {exported}",
            (n * 64) as f64 / secs / 1e6,
            n as f64 * bytes_per_step / secs / 1e9,
            capture.as_secs_f64() * 1e6 / (n * 64) as f64,
        );
    }
    Ok(())
}

fn cuda(args: &Args, dir: &Path) -> Res<()> {
    use ringscope::cuda::{DeviceBuffer, Gpu, Stream};
    let gpu = Gpu::open(0)?;
    println!("CUDA backend on {}: 16 layers × batch × {D} bf16\n", gpu.name());
    let (w1, _) = weights(dir, 1)?;
    let (w16, _) = weights(dir, K)?;
    let stream = Stream::new(&gpu)?;
    let layers = 16;
    let steps = args.steps.min(2000);
    for batch in [1usize, 8, 64] {
        // Device activations: layer l's rows at l × batch × D × 2 bytes; request 0 of every batch is planted.
        let host_rows: Vec<Vec<u8>> = (0..layers).map(|l| batch_rows(batch, Some(0), l as u64 + 1)).collect();
        let dev = DeviceBuffer::zeroed(&gpu, layers * batch * D * 2)?;
        for (l, r) in host_rows.iter().enumerate() {
            dev.copy_from_host_async(l * batch * D * 2, r, stream.handle())?;
        }
        stream.synchronize()?;
        let hps: String = (0..layers).map(|l| hookpoint(&format!("l{l}"), l, true)).collect();
        let off: String = (0..layers).map(|l| hookpoint(&format!("l{l}"), l, false)).collect();
        let fused = |w: &Path| -> String {
            (0..layers).map(|l| probe(&format!("p{l}"), &format!("l{l}"), w, "fused", "mean", "alert")).collect()
        };
        let variants: Vec<(&str, String, String)> = vec![
            ("a: no capture", off.clone(), String::new()),
            ("b: raw capture, 16 layers", hps.clone(), String::new()),
            ("c: 16 fused probes, K = 1", off.clone(), fused(&w1)),
            ("d: 16 fused probes, K = 16", off.clone(), fused(&w16)),
        ];
        println!("batch {batch}:");
        for (label, hookpoints, probes) in variants {
            let session = Session::new(config("cuda", &hookpoints, &probes)?)?;
            let ids: Vec<u32> =
                (0..layers).map(|l| session.hookpoint(&format!("l{l}")).map(|h| h.id())).collect::<Result<_, _>>()?;
            let mut times = Vec::new();
            for step in 0..steps + 20 {
                let t = Instant::now();
                session.begin_step_on(step, (0..batch as u64).map(|r| (r, step as u32)), stream.handle())?;
                for (l, id) in ids.iter().enumerate() {
                    session.capture_device(*id, dev.ptr_at(l * batch * D * 2), batch as u32, stream.handle())?;
                }
                session.end_step()?;
                stream.synchronize()?;
                if step >= 20 {
                    times.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            assert!(session.wait_probes(Duration::from_secs(60)));
            let drained = session.stats().drain.bytes;
            let report = session.shutdown()?;
            times.sort_by(f64::total_cmp);
            println!(
                "  {label:<30} median {:>7.1} µs  p99 {:>7.1} µs   ring bytes/step {:>9.0}   dropped rows {}",
                percentile(&times, 0.5),
                percentile(&times, 0.99),
                drained as f64 / (steps + 20) as f64,
                report.accounting.total().dropped_total().rows,
            );
        }
        // Agreement: the fused probe and the consumer probe on the raw rows of the same steps.
        let both = format!(
            "{hps}{}{}",
            fused(&w16),
            (0..layers)
                .map(|l| probe(&format!("c{l}"), &format!("l{l}"), &w16, "consumer", "mean", "alert"))
                .collect::<String>()
        );
        let session = Session::new(config("cuda", &both, "")?)?;
        let ids: Vec<u32> =
            (0..layers).map(|l| session.hookpoint(&format!("l{l}")).map(|h| h.id())).collect::<Result<_, _>>()?;
        for step in 0..20u64 {
            session.begin_step_on(step, (0..batch as u64).map(|r| (r, step as u32)), stream.handle())?;
            for (l, id) in ids.iter().enumerate() {
                session.capture_device(*id, dev.ptr_at(l * batch * D * 2), batch as u32, stream.handle())?;
            }
            session.end_step()?;
        }
        stream.synchronize()?;
        assert!(session.wait_probes(Duration::from_secs(60)));
        let mut worst = 0.0f64;
        for l in 0..layers {
            for r in 0..batch as u64 {
                let f = session.probe_request(&format!("p{l}"), r)?.ok_or("fused probe saw the request")?;
                let c = session.probe_request(&format!("c{l}"), r)?.ok_or("consumer probe saw the request")?;
                for (a, b) in f.scores.iter().zip(&c.scores) {
                    worst = worst.max(((a - b).abs() / b.abs().max(1.0)) as f64);
                }
            }
        }
        session.shutdown()?;
        println!("  fused vs consumer probe, mean scores of {} requests × {K} outputs × 16 layers: max rel diff {worst:.2e}\n", batch);
    }
    // Alert latency of a fused per-token stop probe: step launch → flag seen by the engine; → alert on the channel.
    let dev = DeviceBuffer::zeroed(&gpu, 8 * D * 2)?;
    let session =
        Session::new(config("cuda", &hookpoint("h", 0, false), &probe("p", "h", &w16, "fused", "per_token", "stop"))?)?;
    let alerts = session.alerts()?;
    let flags = session.probe_flags().ok_or("flags")?;
    let id = session.hookpoint("h")?.id();
    let (mut to_flag, mut to_alert) = (Vec::new(), Vec::new());
    for step in 0..steps.min(500) {
        let planted = batch_rows(8, Some((step % 8) as usize), step + 1);
        dev.copy_from_host_async(0, &planted, stream.handle())?;
        stream.synchronize()?;
        let request = step * 8 + step % 8;
        let t = Instant::now();
        session.begin_step_on(step, (0..8u64).map(|r| (step * 8 + r, 0)), stream.handle())?;
        session.capture_device(id, dev.ptr(), 8, stream.handle())?;
        session.end_step()?;
        while !flags.is_raised(request) {
            if t.elapsed() > Duration::from_secs(1) {
                return Err(format!("step {step}: the flag of request {request} never came").into());
            }
            std::hint::spin_loop();
        }
        to_flag.push(t.elapsed().as_secs_f64() * 1e6);
        let a = alerts.recv_timeout(Duration::from_secs(1))?;
        to_alert.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(a.request_id, request);
        stream.synchronize()?;
    }
    summary("step launch → stop flag seen (fused per-token probe, device-set)", to_flag);
    summary("step launch → alert on the channel (same probe, via the drain)", to_alert);
    session.shutdown()?;
    Ok(())
}

fn main() -> Res<()> {
    let args = Args::parse();
    let dir = std::env::temp_dir().join(format!("ringscope-bench-probes-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = match args.backend.as_str() {
        "host" => host(&args, &dir),
        "cuda" => cuda(&args, &dir),
        other => Err(format!("--backend {other}: use host or cuda").into()),
    };
    let _ = std::fs::remove_dir_all(&dir);
    result
}
