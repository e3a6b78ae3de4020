//! GPU benchmarks of the CUDA backend (needs an NVIDIA GPU, its driver and NVRTC; prints "skipped" elsewhere).
//!
//! ```text
//! cargo bench --bench gpu_hookpoints            # or run the built binary; results go to stdout as Markdown
//! ```
//!
//! (a) Cost of a HookPoint inside a CUDA graph: a graph with K captures minus the same graph without them, per
//!     hookpoint, next to K plain `cuMemcpyDtoDAsync` nodes of the same bytes, measured in the same run. The ring is
//!     handed back by a discard node after each capture (in every variant), so the capture kernels are timed alone.
//! (b) Drain bandwidth: a producer replays a capture graph in full mode while the drain copies the ring to pinned
//!     memory; bytes drained per second against plain pinned D2H copies of the same chunk size (the ceiling).
//! (c) Interference: p50/p99 wall time of a small engine D2H copy (64 KiB, own stream) while the drain runs at full
//!     speed, against the same copy with the drain idle, for several drain chunk sizes.
//! (d) Host time on the engine's per-step path: `begin_step` and the graph launch, best-effort and full mode.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ringscope_hookpoint::cuda::{DeviceCapture, DeviceCaptureError, DeviceCaptureOptions};
use ringscope_hookpoint::{HookPoint, HookPointSpec, Registry, SiteKind, StepBatch};
use ringscope_ring::cuda::{
    DeviceBuffer, DeviceConsumer, DeviceRing, DrainTuning, Event, Gpu, Graph, PinnedBuffer, Stream,
};
use ringscope_ring::DType;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Milliseconds from `start` to `end`, both timing events recorded on one stream, once `end` has completed.
fn ms_between(start: &Event, end: &Event) -> Res<f64> {
    end.synchronize()?;
    Ok(end.elapsed_ms(start)? as f64)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Mean time of one replay of `graph` in ms: `reps` replays between two events, median of 5 such runs.
fn time_graph(gpu: &Arc<Gpu>, graph: &Graph, stream: &Stream, reps: usize) -> Res<f64> {
    for _ in 0..3 {
        graph.launch(stream.handle())?;
    }
    stream.synchronize()?;
    let (a, b) = (Event::new(gpu, true)?, Event::new(gpu, true)?);
    let mut runs = Vec::new();
    for _ in 0..5 {
        a.record(stream.stream_ref())?;
        for _ in 0..reps {
            graph.launch(stream.handle())?;
        }
        b.record(stream.stream_ref())?;
        runs.push(ms_between(&a, &b)? / reps as f64);
    }
    Ok(median(&mut runs))
}

fn register(reg: &Registry, name: &str, row_bytes: u32) -> Arc<HookPoint> {
    reg.register(HookPointSpec {
        name: name.into(),
        site: SiteKind::Residual,
        layer: Some(0),
        dtype: DType::BF16,
        row_width: row_bytes / 2,
    })
    .unwrap()
}

/// (a) per-hookpoint cost in a graph.
fn hookpoint_cost(gpu: &Arc<Gpu>) -> Res<()> {
    const K: usize = 16;
    println!("\n### (a) Cost per HookPoint inside a CUDA graph (K = {K} per graph)\n");
    println!("| captured bytes | rows × row bytes | graph without (µs) | + K captures: per hookpoint (µs) | + K memcpy nodes: per node (µs) | capture / memcpy | capture GB/s | idle (disabled) hookpoint (µs) |");
    println!("|---|---|---|---|---|---|---|---|");
    for &(rows, row_bytes) in &[(1u32, 4096u32), (16, 4096), (256, 4096), (2048, 8192), (8192, 8192)] {
        let bytes = rows as usize * row_bytes as usize;
        let ring = DeviceRing::new(gpu, (2 * bytes + (1 << 20)).next_multiple_of(128))?;
        let mut cap = DeviceCapture::new(&ring, DeviceCaptureOptions::default())?;
        let reg = Registry::new();
        let stream = Stream::new(gpu)?;
        let hps: Vec<_> = (0..K).map(|i| register(&reg, &format!("l{i}"), row_bytes)).collect();
        let srcs: Vec<_> = (0..K).map(|_| DeviceBuffer::zeroed(gpu, bytes)).collect::<Result<_, _>>()?;
        let dsts: Vec<_> = (0..K).map(|_| DeviceBuffer::zeroed(gpu, bytes)).collect::<Result<_, _>>()?;
        let small = DeviceBuffer::zeroed(gpu, 4096)?;
        let batch = StepBatch::new(0, (0..rows).map(|i| (i as u64, 0)))?;
        cap.begin_step(&reg, &batch, stream.handle())?;
        let base = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
            cap.fill_pattern(small.ptr(), 4096, 1, stream.handle())?;
            for _ in 0..K {
                cap.discard_all_for_benchmarks(stream.handle())?;
            }
            Ok(())
        })?;
        let with_hooks = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
            cap.fill_pattern(small.ptr(), 4096, 1, stream.handle())?;
            for (hp, src) in hps.iter().zip(&srcs) {
                cap.capture(hp, src.ptr(), rows, stream.handle())?;
                cap.discard_all_for_benchmarks(stream.handle())?;
            }
            Ok(())
        })?;
        let with_memcpy = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
            cap.fill_pattern(small.ptr(), 4096, 1, stream.handle())?;
            for (src, dst) in srcs.iter().zip(&dsts) {
                dst.copy_from_device_async(src, bytes, stream.stream_ref())?;
                cap.discard_all_for_benchmarks(stream.handle())?;
            }
            Ok(())
        })?;
        let reps = (200_000_000 / (bytes * K).max(1)).clamp(10, 2000);
        // Interleave the variants and take medians, so drift affects all of them alike.
        let (mut tb, mut th, mut tm) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            tb.push(time_graph(gpu, &base, &stream, reps)?);
            th.push(time_graph(gpu, &with_hooks, &stream, reps)?);
            tm.push(time_graph(gpu, &with_memcpy, &stream, reps)?);
        }
        let (tb, th, tm) = (median(&mut tb), median(&mut th), median(&mut tm));
        // Idle hookpoints: the same capture graph with every hookpoint disabled (read from device memory).
        for hp in &hps {
            hp.control().set_enabled(false);
        }
        cap.begin_step(&reg, &batch, stream.handle())?;
        let td = time_graph(gpu, &with_hooks, &stream, reps)?;
        for hp in &hps {
            hp.control().set_enabled(true);
        }
        cap.begin_step(&reg, &batch, stream.handle())?;
        stream.synchronize()?;
        let per_hook = (th - tb) * 1e3 / K as f64;
        let per_copy = (tm - tb) * 1e3 / K as f64;
        let idle = (td - tb) * 1e3 / K as f64;
        println!(
            "| {} | {rows} × {row_bytes} | {:.1} | {per_hook:.2} | {per_copy:.2} | {:.2} | {:.0} | {idle:.2} |",
            human(bytes),
            tb * 1e3,
            per_hook / per_copy,
            bytes as f64 / (per_hook * 1e-6) / 1e9,
        );
        if ring.error_bits() != 0 {
            println!("ring error bits {}", ring.error_bits());
        }
    }
    Ok(())
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// Pinned D2H ceiling: back-to-back copies of `chunk` bytes, `total` bytes in all, GB/s.
fn d2h_ceiling(gpu: &Arc<Gpu>, chunk: usize, total: usize) -> Res<f64> {
    let src = DeviceBuffer::zeroed(gpu, total)?;
    let dst = PinnedBuffer::zeroed(gpu, total, false)?;
    let stream = Stream::new(gpu)?;
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        for off in (0..total).step_by(chunk) {
            // SAFETY: both buffers hold `total` bytes; `dst` is not read, and outlives the copies (synchronised below).
            unsafe { dst.copy_from_device_async(off, &src, off, chunk, stream.stream_ref()) }?;
        }
        stream.synchronize()?;
        best = best.max(total as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}

/// A producer thread: replays a one-capture graph of `rows × row_bytes` in full mode until `stop`.
struct Producer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Res2<u64>>,
}
type Res2<T> = Result<T, String>;

fn start_producer(gpu: &Arc<Gpu>, ring: &Arc<DeviceRing>, rows: u32, row_bytes: u32) -> Res<Producer> {
    let stop = Arc::new(AtomicBool::new(false));
    let (gpu, ring, stop2) = (gpu.clone(), ring.clone(), stop.clone());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || -> Res2<u64> {
        let run = || -> Res<u64> {
            let options =
                DeviceCaptureOptions { full_mode_deadline: Some(Duration::from_secs(10)), ..Default::default() };
            let mut cap = DeviceCapture::new(&ring, options)?;
            let reg = Registry::new();
            let stream = Stream::new(&gpu)?;
            let hp = register(&reg, "bulk", row_bytes);
            let src = DeviceBuffer::zeroed(&gpu, rows as usize * row_bytes as usize)?;
            let batch = StepBatch::new(0, (0..rows).map(|i| (i as u64, 0)))?;
            cap.begin_step(&reg, &batch, stream.handle())?;
            let graph = Graph::capture(&stream, || cap.capture(&hp, src.ptr(), rows, stream.handle()))?;
            let _ = ready_tx.send(());
            let mut steps = 0u64;
            while !stop2.load(Ordering::Relaxed) {
                let batch = StepBatch::new(steps, (0..rows).map(|i| (i as u64, 0)))?;
                cap.begin_step(&reg, &batch, stream.handle())?;
                graph.launch(stream.handle())?;
                steps += 1;
            }
            stream.synchronize()?;
            Ok(steps)
        };
        run().map_err(|e| e.to_string())
    });
    ready_rx.recv_timeout(Duration::from_secs(60)).map_err(|_| "producer did not start")?;
    Ok(Producer { stop, thread })
}

/// Runs a drain on `ring` for `secs`, returning bytes handed out as records.
fn run_drain(consumer: &mut DeviceConsumer, secs: f64) -> Res<(u64, f64)> {
    let t = Instant::now();
    let mut bytes = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        match consumer.peek_record()? {
            Some(v) => {
                bytes += v.header.footprint() as u64;
                consumer.advance_record();
            }
            None => std::hint::spin_loop(),
        }
    }
    Ok((bytes, t.elapsed().as_secs_f64()))
}

/// (b) drain bandwidth with a concurrent producer.
fn drain_bandwidth(gpu: &Arc<Gpu>) -> Res<()> {
    println!("\n### (b) Drain bandwidth, device ring → pinned staging, with a concurrent producer\n");
    println!("Producer: one 16 MiB capture (2048 rows × 8 KiB) per step, replayed as a CUDA graph in full mode; ring 1 GiB.\n");
    println!(
        "| drain chunk × in flight | drained GB/s | pinned D2H ceiling, same chunk (GB/s) | ratio | ratio to 55 GB/s |"
    );
    println!("|---|---|---|---|---|");
    for &(chunk, in_flight) in
        &[(1usize << 20, 16usize), (2 << 20, 8), (2 << 20, 16), (4 << 20, 4), (4 << 20, 8), (16 << 20, 4)]
    {
        let ring = DeviceRing::new(gpu, 1 << 30)?;
        let mut consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: chunk, max_in_flight: in_flight })?;
        let producer = start_producer(gpu, &ring, 2048, 8192)?;
        run_drain(&mut consumer, 0.5)?; // warm up
        let (bytes, secs) = run_drain(&mut consumer, 2.0)?;
        producer.stop.store(true, Ordering::Relaxed);
        // Keep draining so the producer's last begin_step can finish.
        let stopper = std::thread::spawn(move || producer.thread.join());
        let t = Instant::now();
        while !stopper.is_finished() && t.elapsed() < Duration::from_secs(30) {
            run_drain(&mut consumer, 0.01)?;
        }
        stopper.join().map_err(|_| "producer panicked")?.map_err(|_| "producer panicked")??;
        let gbs = bytes as f64 / secs / 1e9;
        let ceiling = d2h_ceiling(gpu, chunk, 1 << 30)?;
        println!(
            "| {} × {in_flight} | {gbs:.1} | {ceiling:.1} | {:.2} | {:.2} |",
            human(chunk),
            gbs / ceiling,
            gbs / 55.0
        );
    }
    Ok(())
}

/// Wall time of one 64 KiB D2H copy on the engine's own stream, `n` samples, in µs.
fn small_copy_latencies(gpu: &Arc<Gpu>, n: usize) -> Res<Vec<f64>> {
    let stream = Stream::new(gpu)?;
    let src = DeviceBuffer::zeroed(gpu, 64 << 10)?;
    let dst = PinnedBuffer::zeroed(gpu, 64 << 10, false)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        // SAFETY: both buffers hold 64 KiB; `dst` is not read, and the copy is synchronised below.
        unsafe { dst.copy_from_device_async(0, &src, 0, 64 << 10, stream.stream_ref()) }?;
        stream.synchronize()?;
        out.push(t.elapsed().as_secs_f64() * 1e6);
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(out)
}

/// (c) engine copy latency while the drain runs.
fn interference(gpu: &Arc<Gpu>) -> Res<()> {
    println!("\n### (c) A 64 KiB engine D2H copy while the drain runs at full speed\n");
    let mut idle = small_copy_latencies(gpu, 2000)?;
    println!("Drain idle: p50 {:.1} µs, p99 {:.1} µs.\n", percentile(&mut idle, 0.5), percentile(&mut idle, 0.99));
    println!("| drain chunk × in flight | drained GB/s meanwhile | engine copy p50 (µs) | p99 (µs) | max (µs) |");
    println!("|---|---|---|---|---|");
    for &(chunk, in_flight) in
        &[(1usize << 20, 16usize), (2 << 20, 8), (2 << 20, 16), (4 << 20, 4), (4 << 20, 8), (16 << 20, 4)]
    {
        let ring = DeviceRing::new(gpu, 1 << 30)?;
        let mut consumer = DeviceConsumer::new(&ring, DrainTuning { chunk_bytes: chunk, max_in_flight: in_flight })?;
        let producer = start_producer(gpu, &ring, 2048, 8192)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let gpu2 = gpu.clone();
        let sampler = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let r = small_copy_latencies(&gpu2, 2000).map_err(|e| e.to_string());
            stop2.store(true, Ordering::Relaxed);
            r
        });
        let t = Instant::now();
        let mut bytes = 0u64;
        while !stop.load(Ordering::Relaxed) {
            bytes += run_drain(&mut consumer, 0.05)?.0;
        }
        let gbs = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
        let mut lat = sampler.join().map_err(|_| "sampler panicked")??;
        producer.stop.store(true, Ordering::Relaxed);
        let stopper = std::thread::spawn(move || producer.thread.join());
        while !stopper.is_finished() {
            run_drain(&mut consumer, 0.01)?;
        }
        stopper.join().map_err(|_| "producer panicked")?.map_err(|_| "producer panicked")??;
        let max = lat.iter().cloned().fold(0f64, f64::max);
        println!(
            "| {} × {in_flight} | {gbs:.1} | {:.1} | {:.1} | {max:.0} |",
            human(chunk),
            percentile(&mut lat, 0.5),
            percentile(&mut lat, 0.99)
        );
    }
    Ok(())
}

/// (d) host time on the engine's per-step path: `begin_step` (batch descriptor + launch) and the graph launch.
fn host_cost(gpu: &Arc<Gpu>) -> Res<()> {
    const K: usize = 16;
    const ROWS: u32 = 64;
    println!("\n### (d) Host time per step on the engine's thread ({K} hookpoints, {ROWS}-row batch, 4 KiB rows)\n");
    println!("| mode | begin_step p50 (µs) | p99 (µs) | graph launch p50 (µs) | p99 (µs) |");
    println!("|---|---|---|---|---|");
    for full in [false, true] {
        let ring = DeviceRing::new(gpu, 256 << 20)?;
        let mut consumer = DeviceConsumer::new(&ring, DrainTuning::default())?;
        let options =
            DeviceCaptureOptions { full_mode_deadline: full.then_some(Duration::from_secs(10)), ..Default::default() };
        let mut cap = DeviceCapture::new(&ring, options)?;
        let reg = Registry::new();
        let stream = Stream::new(gpu)?;
        let hps: Vec<_> = (0..K).map(|i| register(&reg, &format!("l{i}"), 4096)).collect();
        let srcs: Vec<_> = (0..K).map(|_| DeviceBuffer::zeroed(gpu, ROWS as usize * 4096)).collect::<Result<_, _>>()?;
        let rows = |step: u64| (0..ROWS).map(move |i| (step * 100 + i as u64, i));
        cap.begin_step(&reg, &StepBatch::new(0, rows(0))?, stream.handle())?;
        let graph = Graph::capture(&stream, || -> Result<(), DeviceCaptureError> {
            for (hp, src) in hps.iter().zip(&srcs) {
                cap.capture(hp, src.ptr(), ROWS, stream.handle())?;
            }
            Ok(())
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let drain = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                let _ = run_drain(&mut consumer, 0.01);
            }
            let _ = run_drain(&mut consumer, 0.2);
        });
        let (mut begin, mut launch) = (Vec::new(), Vec::new());
        for step in 0..3000u64 {
            let t = Instant::now();
            let batch = StepBatch::new(step, rows(step))?;
            cap.begin_step(&reg, &batch, stream.handle())?;
            let t1 = Instant::now();
            graph.launch(stream.handle())?;
            let t2 = Instant::now();
            if step >= 100 {
                begin.push((t1 - t).as_secs_f64() * 1e6);
                launch.push((t2 - t1).as_secs_f64() * 1e6);
            }
            if step % 8 == 7 {
                stream.synchronize()?; // keep the GPU in step, as an engine reading its logits would
            }
        }
        stream.synchronize()?;
        stop.store(true, Ordering::Relaxed);
        drain.join().map_err(|_| "drain panicked")?;
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} |",
            if full { "full" } else { "best-effort" },
            percentile(&mut begin, 0.5),
            percentile(&mut begin, 0.99),
            percentile(&mut launch, 0.5),
            percentile(&mut launch, 0.99)
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            println!("gpu_hookpoints: skipped: {e}");
            return Ok(());
        }
    };
    // `cargo bench --bench gpu_hookpoints -- b` runs one part (cargo adds its own `--bench` flag).
    let only = std::env::args().skip(1).find(|a| ["a", "b", "c", "d"].contains(&a.as_str()));
    println!(
        "## GPU benchmarks on {} (sm_{}{}, {} SMs)",
        gpu.name(),
        gpu.capability().0,
        gpu.capability().1,
        gpu.sms()
    );
    if only.as_deref().is_none_or(|o| o == "a") {
        hookpoint_cost(&gpu)?;
    }
    if only.as_deref().is_none_or(|o| o == "b") {
        drain_bandwidth(&gpu)?;
    }
    if only.as_deref().is_none_or(|o| o == "c") {
        interference(&gpu)?;
    }
    if only.as_deref().is_none_or(|o| o == "d") {
        host_cost(&gpu)?;
    }
    Ok(())
}
