//! A whole CUDA session: the synthetic decoder's layers live in device memory, the captures are recorded once into a
//! CUDA graph (padded to the largest batch) and replayed every step, the drain copies the device ring to pinned
//! memory, and Parquet files come out. Every exported row is checked bit for bit against the generator and against
//! its request id and position.
//!
//! The GPU tests need an NVIDIA GPU, its driver and NVRTC, so they are `#[ignore]`d: a machine without a GPU reports
//! them as ignored, not passed (on a GPU machine: `cargo test --release --test cuda_session -- --include-ignored`).
//! Everywhere, one test checks that the CUDA backend opens where there is a GPU and is a clear error where there is
//! none.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow::array::{Array, FixedSizeBinaryArray, UInt32Array, UInt64Array};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use ringscope::synthetic::{activation_row, fill_layer, pregenerate, EngineConfig};
use ringscope::{Config, Error, Session};
use ringscope_exporter::{CallbackSink, Record};
use ringscope_ring::cuda::{DeviceBuffer, Gpu, Graph, Stream};
use ringscope_ring::RowMeta;

/// Held by each test for its whole life: the tests record CUDA graphs in global capture mode (as PyTorch does), which
/// another thread's CUDA call during the capture invalidates, and the harness runs tests on several threads at once.
fn alone() -> parking_lot::MutexGuard<'static, ()> {
    static ALONE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());
    ALONE.lock()
}

fn config(dir: &std::path::Path, layers: u32, hidden: u32, mode: &str) -> Config {
    let text = format!(
        "[ring]\nbackend = \"cuda\"\ncapacity = \"64 MiB\"\n[policy]\nmode = \"{mode}\"\nfull_deadline_ms = 20000\n\
         [export]\nparquet = true\ndir = \"{}\"\nrun_id = \"gpu\"\n{}",
        dir.display(),
        ringscope::synthetic::residual_hookpoints_toml(layers, hidden)
    );
    Config::from_toml(&text).unwrap()
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-cuda-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A decode step's batch read from device tensors: `batch` rows of one token each, request ids `i64[batch]` in
/// `ids`, positions `i64[batch]` in `positions`.
fn decode_batch(batch: u32, ids: &DeviceBuffer, positions: &DeviceBuffer) -> ringscope::cuda::GraphBatch {
    ringscope::cuda::GraphBatch {
        batch,
        seq: 1,
        request_ids: ids.ptr(),
        positions: positions.ptr(),
        positions_batch_stride: 1,
        ended: None,
        kept: None,
    }
}

/// Records one step begun inside a CUDA graph on `stream`: hookpoint `l` captures `batch.batch` rows of `sources[l]`.
/// The controls reach the device first (and, later, between replays).
fn record_graph_step(
    session: &Session,
    stream: &Stream,
    batch: &ringscope::cuda::GraphBatch,
    sources: &[DeviceBuffer],
) -> Graph {
    session.apply_controls(stream.handle()).unwrap();
    stream.synchronize().unwrap();
    Graph::capture(stream, || -> Result<(), Error> {
        session.begin_step_graph(batch, stream.handle())?;
        for (l, buf) in sources.iter().enumerate() {
            session.capture_device(l as u32, buf.ptr(), batch.batch, stream.handle())?;
        }
        session.end_step()
    })
    .unwrap()
}

/// The GPU of a GPU test (they are `#[ignore]`d: asked to run without a GPU, they fail, saying why).
fn gpu() -> Arc<Gpu> {
    Gpu::open(0).unwrap_or_else(|e| {
        panic!("this test needs an NVIDIA GPU, its driver and NVRTC (it is ignored without --include-ignored): {e}")
    })
}

#[test]
fn the_cuda_backend_opens_with_a_gpu_and_is_a_clear_error_without_one() {
    let _alone = alone();
    let dir = tempdir("nogpu");
    match Gpu::open(0) {
        Ok(_) => {
            let s = Session::new(config(&dir, 2, 64, "full")).expect("the CUDA backend opens on a GPU");
            s.shutdown().unwrap();
        }
        Err(e) => {
            let err = Session::new(config(&dir, 2, 64, "full")).err().expect("no GPU here");
            assert!(matches!(err, Error::Cuda(_)), "{err}");
            eprintln!("no GPU ({e}): the CUDA backend said: {err}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn cuda_session_replays_a_graph_into_parquet_bit_exact() {
    let _alone = alone();
    let gpu = gpu();
    let cfg = EngineConfig { layers: 4, hidden: 2048, requests: 24, max_concurrent: 8, seed: 11, ..Default::default() };
    let steps = pregenerate(cfg);
    let max_rows = steps.iter().map(|(s, _)| s.rows.len()).max().unwrap() as u32;
    let row_bytes = cfg.hidden as usize * 2;
    let dir = tempdir("graph");

    let checked = Arc::new(AtomicU64::new(0));
    let c2 = checked.clone();
    let mut expect = vec![0u16; cfg.hidden as usize];
    let verify = CallbackSink::new("verify", move |record: &Record| {
        let layer = record.hookpoint().spec().layer.unwrap();
        let view = record.view();
        for (i, m) in view.row_metas().enumerate() {
            activation_row(cfg.seed, layer, m.request_id, m.position, &mut expect);
            let want: Vec<u8> = expect.iter().flat_map(|v| v.to_le_bytes()).collect();
            if view.row(i) != &want[..] {
                return Err(format!("layer {layer} request {} position {} differs", m.request_id, m.position).into());
            }
            c2.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    let session = Session::builder(config(&dir, cfg.layers, cfg.hidden, "full")).sink(verify).start().unwrap();
    let stream = Stream::new(&gpu).unwrap();
    let layers: Vec<DeviceBuffer> =
        (0..cfg.layers).map(|_| DeviceBuffer::zeroed(&gpu, max_rows as usize * row_bytes).unwrap()).collect();

    // Record the captures once, at the padded batch size.
    let (first, _) = &steps[0];
    session.begin_step_on(first.step, first.rows.iter().copied(), stream.handle()).unwrap();
    let graph = Graph::capture(&stream, || -> Result<(), Error> {
        for (l, buf) in layers.iter().enumerate() {
            session.capture_device(l as u32, buf.ptr(), max_rows, stream.handle())?;
        }
        Ok(())
    })
    .unwrap();
    session.end_step().unwrap();

    let mut buf = Vec::new();
    let mut rows = 0u64;
    for (step, _) in &steps {
        for (l, dev) in layers.iter().enumerate() {
            fill_layer(cfg.seed, l as u32, cfg.hidden, &step.rows, &mut buf);
            dev.copy_from_host_async(0, &buf, stream.handle()).unwrap();
        }
        session.begin_step_on(step.step, step.rows.iter().copied(), stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        session.end_step().unwrap();
        rows += step.rows.len() as u64 * cfg.layers as u64;
    }
    stream.synchronize().unwrap();
    let report = session.shutdown().unwrap();
    assert!(report.drain.errors.is_empty(), "{:?}", report.drain.errors);
    assert_eq!(checked.load(Ordering::Relaxed), rows, "every row reached the verifying sink");
    let total = report.accounting.total();
    assert_eq!((total.exported.rows, total.dropped_total().rows), (rows, 0));

    // And the Parquet files hold the same rows.
    let mut in_files = 0u64;
    for f in &report.files {
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&f.path).unwrap()).unwrap().build().unwrap();
        let layer: u32 =
            f.path.to_string_lossy().split("layers.").nth(1).unwrap().split('.').next().unwrap().parse().unwrap();
        for batch in reader {
            let batch = batch.unwrap();
            let req = batch.column_by_name("request_id").unwrap().as_any().downcast_ref::<UInt64Array>().unwrap();
            let pos = batch.column_by_name("position").unwrap().as_any().downcast_ref::<UInt32Array>().unwrap();
            let act =
                batch.column_by_name("activation").unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
            let mut want = vec![0u16; cfg.hidden as usize];
            for i in 0..batch.num_rows() {
                activation_row(cfg.seed, layer, req.value(i), pos.value(i), &mut want);
                let bytes: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(act.value(i), &bytes[..]);
            }
            in_files += batch.num_rows() as u64;
        }
    }
    assert_eq!(in_files, rows);
}

#[test]
fn device_calls_on_a_host_session_are_clear_errors() {
    let _alone = alone();
    let s = Session::new(Config::from_toml(&ringscope::synthetic::residual_hookpoints_toml(1, 8)).unwrap()).unwrap();
    let stream = ringscope::cuda::StreamRef::legacy_default();
    let e = s.begin_step_on(0, [(1, 0)], stream.clone()).unwrap_err().to_string();
    assert!(e.contains("host backend"), "{e}");
    s.begin_step(0, [(1, 0)]).unwrap();
    // SAFETY: never dereferenced: a host session refuses device captures before looking at the address.
    let ptr = unsafe { ringscope::cuda::DevicePtr::from_raw(0x1000) };
    let e = s.capture_device(0, ptr, 1, stream).unwrap_err().to_string();
    assert!(e.contains("host backend"), "{e}");
    s.end_step().unwrap();
    // apply_controls returns at once when nothing changed since its last upload; a host session never uploaded, so
    // every call is the same clear error.
    for _ in 0..2 {
        let e = s.apply_controls(ringscope::cuda::StreamRef::legacy_default()).unwrap_err().to_string();
        assert!(e.contains("host backend"), "{e}");
    }
    s.shutdown().unwrap();
}

/// Between replays of a graph-begun step, `apply_controls` uploads exactly what changed — and, when nothing did,
/// returns without a lock or a CUDA call: every change still reaches the very next replay, and a closed session is
/// still an error.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn apply_controls_brings_every_change_to_the_next_replay_and_skips_when_nothing_changed() {
    let _alone = alone();
    let gpu = gpu();
    let text = format!(
        "[ring]\nbackend = \"cuda\"\ncapacity = \"16 MiB\"\n[policy]\nmode = \"best_effort\"\n{}",
        ringscope::synthetic::residual_hookpoints_toml(2, 64)
    );
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let sub = session.subscribe("check", ringscope::Filter::all()).unwrap();
    let stream = Stream::new(&gpu).unwrap();
    let bytes = |v: Vec<i64>| v.into_iter().flat_map(i64::to_le_bytes).collect::<Vec<u8>>();
    let ids = DeviceBuffer::from_host(&gpu, &bytes(vec![5, 6])).unwrap();
    let positions = DeviceBuffer::from_host(&gpu, &bytes(vec![0, 0])).unwrap();
    let layers: Vec<DeviceBuffer> = (0..2).map(|_| DeviceBuffer::zeroed(&gpu, 2 * 128).unwrap()).collect();
    let graph = record_graph_step(&session, &stream, &decode_batch(2, &ids, &positions), &layers);
    let layer1 = session.hookpoint("layers.1.resid").unwrap();
    // (what changes before the replay, the hookpoints the replay captures)
    let plan: [(Option<bool>, &[&str]); 6] = [
        (None, &["layers.0.resid", "layers.1.resid"]),
        (None, &["layers.0.resid", "layers.1.resid"]),
        (Some(false), &["layers.0.resid"]),
        (None, &["layers.0.resid"]),
        (None, &["layers.0.resid"]),
        (Some(true), &["layers.0.resid", "layers.1.resid"]),
    ];
    for (change, _) in &plan {
        if let Some(on) = change {
            layer1.control().set_enabled(*on);
        }
        session.apply_controls(stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        stream.synchronize().unwrap();
    }
    // Nothing changed since the last upload: the call does nothing at all — not even the check that refuses it while
    // the stream records a graph (which a call with a change to upload still makes).
    let idle = Graph::capture(&stream, || session.apply_controls(stream.handle()));
    assert!(idle.is_ok(), "in sync, apply_controls returns at once: {:?}", idle.err());
    layer1.control().set_every_n_steps(1).unwrap();
    match Graph::capture(&stream, || session.apply_controls(stream.handle())) {
        Err(e) => assert!(e.to_string().contains("capturing"), "{e}"),
        Ok(_) => panic!("a change to upload is still checked: refused while the stream records a graph"),
    }
    stream.synchronize().unwrap();
    session.shutdown().unwrap();
    let e = session.apply_controls(stream.handle()).unwrap_err();
    assert!(matches!(e, Error::Closed), "{e}");
    let mut by_step: std::collections::BTreeMap<u64, Vec<String>> = Default::default();
    while let Some(r) = sub.recv() {
        by_step.entry(r.step()).or_default().push(r.hookpoint().name().to_owned());
    }
    let got: Vec<Vec<String>> = by_step
        .into_values()
        .map(|mut v| {
            v.sort();
            v
        })
        .collect();
    let want: Vec<Vec<String>> = plan.iter().map(|(_, w)| w.iter().map(|s| s.to_string()).collect()).collect();
    assert_eq!(got, want, "the hookpoints each replay captured");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn the_policy_manager_reaches_graph_begun_steps_between_replays() {
    let _alone = alone();
    let gpu = gpu();
    // 4 hookpoints × 8 rows × 4 KiB = 128 KiB a step, replayed as fast as the GPU goes: far over a 20 MB/s cap.
    let mut text = String::from(
        "[ring]\nbackend = \"cuda\"\ncapacity = \"64 MiB\"\nmax_batch_rows = 64\n[policy]\nmode = \"best_effort\"\n\
         drain_rate = \"20 MB/s\"\ndwell_ms = 50\n",
    );
    text += &ringscope::synthetic::residual_hookpoints_toml(4, 2048);
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let stream = Stream::new(&gpu).unwrap();
    let ids = DeviceBuffer::zeroed(&gpu, 8 * 8).unwrap();
    let positions = DeviceBuffer::zeroed(&gpu, 8 * 8).unwrap();
    let bytes = |v: Vec<i64>| v.into_iter().flat_map(i64::to_le_bytes).collect::<Vec<u8>>();
    ids.copy_from_host_async(0, &bytes((0..8).collect()), stream.handle()).unwrap();
    positions.copy_from_host_async(0, &bytes(vec![0; 8]), stream.handle()).unwrap();
    let layers: Vec<DeviceBuffer> = (0..4).map(|_| DeviceBuffer::zeroed(&gpu, 8 * 4096).unwrap()).collect();
    let batch = decode_batch(8, &ids, &positions);
    let graph = record_graph_step(&session, &stream, &batch, &layers);
    let started = std::time::Instant::now();
    let mut replays = 0;
    while started.elapsed() < std::time::Duration::from_millis(1500) {
        // Between replays: no host call inside the graph; the policy manager decides here.
        session.apply_controls(stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        replays += 1;
        if replays % 16 == 0 {
            stream.synchronize().unwrap();
        }
    }
    stream.synchronize().unwrap();
    let rungs: Vec<String> = session.stats().hookpoints.iter().map(|h| h.rung.clone()).collect();
    let events = session.events().take();
    let report = session.shutdown().unwrap();
    report.accounting.check().unwrap();
    let total = report.accounting.total();
    assert_eq!(total.produced.rows, replays * 4 * 8, "every replay's captures are counted");
    assert!(total.sampled_out.rows > 0 && rungs.iter().any(|r| r != "full"), "never degraded: {rungs:?}");
    assert!(events.iter().any(|e| e.kind == ringscope::EventKind::Rung), "{events:?}");
    eprintln!("{replays} replays; rungs {rungs:?}; {:?}", total);
}

/// Fused probes through a CUDA session, recorded into a CUDA graph and replayed: the scores the kernel wrote equal the
/// consumer probe's on the raw rows of the same steps (within 1e-3 relative), and a per-token stop probe raises the
/// planted request's flag in the device-mapped flag table, read on the host with no synchronisation.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn fused_probes_in_a_replayed_graph_match_the_consumer_and_raise_the_stop_flag() {
    let _alone = alone();
    let gpu = gpu();
    let (d, rows) = (256usize, 8usize);
    let dir = tempdir("probes");
    std::fs::create_dir_all(&dir).unwrap();
    // Weights [2, d]: output 0 reads e_0, output 1 a mixed direction.
    let mut w = vec![0.0f32; 2 * d];
    w[0] = 1.0;
    for j in 0..d {
        w[d + j] = ((j * 31 % 17) as f32 - 8.0) / 64.0;
    }
    let npy = dir.join("w.npy");
    ringscope::probe::save_npy(&npy, &[2, d], &w).unwrap();
    let probe = |name: &str, mode: &str, aggregate: &str, action: &str| {
        format!(
            "[[probes]]\nname = \"{name}\"\nhookpoint = \"h\"\nweights = \"{}\"\nthresholds = [50.0, 1000.0]\n\
             aggregate = \"{aggregate}\"\naction = \"{action}\"\nmode = \"{mode}\"\n",
            npy.display()
        )
    };
    let text = format!(
        "[ring]\nbackend = \"cuda\"\ncapacity = \"16 MiB\"\n[policy]\nmode = \"best_effort\"\n\
         [[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"bf16\"\nrow_width = {d}\n{}{}{}",
        probe("fused", "fused", "mean", "alert"),
        probe("consumer", "consumer", "mean", "alert"),
        probe("stop", "fused", "per_token", "stop"),
    );
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let flags = session.probe_flags().unwrap();
    let stream = Stream::new(&gpu).unwrap();
    let src = DeviceBuffer::zeroed(&gpu, rows * d * 2).unwrap();
    let id = session.hookpoint("h").unwrap().id();
    // Record once (rows of requests 100 + r at position = step), replay with new values.
    session.begin_step_on(0, (0..rows as u64).map(|r| (100 + r, 0)), stream.handle()).unwrap();
    let graph =
        Graph::capture(&stream, || session.capture_device(id, src.ptr(), rows as u32, stream.handle())).unwrap();
    session.end_step().unwrap();
    let values = |step: u64| -> Vec<u8> {
        (0..rows * d)
            .map(|i| {
                let (r, j) = (i / d, i % d);
                // Row 3 of step 5 carries 64 on e_0: its per-token score crosses 50.
                let v = if step == 5 && r == 3 && j == 0 {
                    64.0
                } else {
                    ((i as u64 * 7 + step * 13) % 23) as f32 / 8.0 - 1.4
                };
                (v.to_bits() >> 16) as u16 // bf16 by truncation: the probes read the same bytes
            })
            .flat_map(|h| h.to_le_bytes())
            .collect()
    };
    for step in 1..10u64 {
        src.copy_from_host_async(0, &values(step), stream.handle()).unwrap();
        session.begin_step_on(step, (0..rows as u64).map(|r| (100 + r, step as u32)), stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        session.end_step().unwrap();
        stream.synchronize().unwrap();
        assert_eq!(flags.is_raised(103), step >= 5, "step {step}: the device raised request 103's flag, and only then");
    }
    for r in 0..rows as u64 {
        assert_eq!(flags.is_raised(100 + r), r == 3, "request {}", 100 + r);
    }
    assert!(session.wait_probes(std::time::Duration::from_secs(30)));
    for r in 0..rows as u64 {
        let f = session.probe_request("fused", 100 + r).unwrap().unwrap();
        let c = session.probe_request("consumer", 100 + r).unwrap().unwrap();
        assert_eq!(f.coverage.scored, c.coverage.scored);
        for (a, b) in f.scores.iter().zip(&c.scores) {
            assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "request {}: fused {a} vs consumer {b}", 100 + r);
        }
    }
    let report = session.shutdown().unwrap();
    let counters = |name: &str| report.accounting.hookpoints.iter().find(|(n, _)| n == name).unwrap().1;
    assert_eq!(counters("probes.fused").exported.rows, counters("h").exported.rows);
}

/// Issue 28: a step recorded as a CUDA graph keeps its fixed batch, so the rows of sequences that ended are marked
/// with request id `NO_REQUEST` (-1 in the engine's int64 tensor) instead. Such a row crossing a stop probe's threshold
/// must not touch the flag table (it used to store `NO_REQUEST + 1` = 0 into slot `2^64-1 % flag_slots`, clearing the
/// flag of the request that owns that slot), and the probes leave it unscored (counted as `no_request_rows`).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn rows_of_no_request_in_a_graph_step_raise_no_flag_and_are_not_scored() {
    let _alone = alone();
    let gpu = gpu();
    let (d, slots) = (128usize, 64u64);
    let dir = tempdir("no-request");
    std::fs::create_dir_all(&dir).unwrap();
    let mut w = vec![0.0f32; d];
    w[0] = 1.0;
    let npy = dir.join("w.npy");
    ringscope::probe::save_npy(&npy, &[1, d], &w).unwrap();
    let text = format!(
        "[ring]\nbackend = \"cuda\"\ncapacity = \"16 MiB\"\n[policy]\nmode = \"best_effort\"\n\
         [alerts]\nflag_slots = {slots}\n\
         [[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"f32\"\nrow_width = {d}\n\
         [[probes]]\nname = \"stop\"\nhookpoint = \"h\"\nweights = \"{}\"\nthresholds = [50.0]\n\
         aggregate = \"per_token\"\naction = \"stop\"\nmode = \"fused\"\n",
        npy.display()
    );
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let flags = session.probe_flags().unwrap();
    let stream = Stream::new(&gpu).unwrap();
    // Row 0: request slots - 1 (the slot NO_REQUEST maps to); row 1: an ended sequence.
    let owner = slots - 1;
    assert_eq!(RowMeta::NO_REQUEST % slots, owner);
    let ids: Vec<u8> = [owner as i64, -1i64].iter().flat_map(|v| v.to_le_bytes()).collect();
    let ids = DeviceBuffer::from_host(&gpu, &ids).unwrap();
    let positions = DeviceBuffer::zeroed(&gpu, 16).unwrap();
    let src = DeviceBuffer::zeroed(&gpu, 2 * d * 4).unwrap();
    let batch = decode_batch(2, &ids, &positions);
    let graph = record_graph_step(&session, &stream, &batch, std::slice::from_ref(&src));
    // Replay 1: only the owner's row crosses the threshold; replay 2: only the ended row does.
    for (replay, hot_row) in [(1u32, 0usize), (2, 1)] {
        let mut rows = vec![0.0f32; 2 * d];
        rows[hot_row * d] = 64.0;
        let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
        src.copy_from_host_async(0, &bytes, stream.handle()).unwrap();
        graph.launch(stream.handle()).unwrap();
        stream.synchronize().unwrap();
        assert!(flags.is_raised(owner), "replay {replay}: request {owner}'s flag is up (an ended row cleared it?)");
    }
    assert!(session.wait_probes(std::time::Duration::from_secs(30)));
    let stats = session.probe_stats();
    assert_eq!((stats[0].rows, stats[0].no_request_rows), (2, 2), "{stats:?}");
    assert!(session.probe_request("stop", RowMeta::NO_REQUEST).unwrap().is_none());
    let alerts: Vec<_> = session.alerts().unwrap().try_iter().collect();
    assert!(alerts.iter().all(|a| a.request_id == owner), "{alerts:?}");
    let report = session.shutdown().unwrap();
    let h = report.accounting.hookpoints.iter().find(|(n, _)| n == "h").unwrap().1;
    assert_eq!(h.exported.rows, 4, "the ended rows are exported (marked), not dropped");
}

/// An engine that replays graphs recorded at a padded batch size bounds each pass's rows with a device scalar
/// (`set_valid_rows_device`, the plugins' padding): rows past it are neither captured nor scored by the hookpoint's
/// fused probes (whose scores hookpoint takes the same bound), with captures copied at once and deferred; removing
/// the bound brings every row back at the next replay.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn a_device_row_bound_limits_the_rows_captured_and_scored_at_each_replay() {
    let _alone = alone();
    let gpu = gpu();
    let d = 128usize;
    let dir = tempdir("valid-rows");
    std::fs::create_dir_all(&dir).unwrap();
    let npy = dir.join("w.npy");
    ringscope::probe::save_npy(&npy, &[1, d], &vec![1.0f32 / d as f32; d]).unwrap();
    for defer in [false, true] {
        let text = format!(
            "[ring]\nbackend = \"cuda\"\ncapacity = \"16 MiB\"\ndefer_captures = {defer}\n\
             [policy]\nmode = \"best_effort\"\n\
             [[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"f32\"\nrow_width = {d}\n\
             [[probes]]\nname = \"p\"\nhookpoint = \"h\"\nweights = \"{}\"\nthresholds = [1e30]\n\
             aggregate = \"per_token\"\naction = \"alert\"\nmode = \"fused\"\n",
            npy.display()
        );
        let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
        let stream = Stream::new(&gpu).unwrap();
        let h = session.hookpoint("h").unwrap().id();
        let ids: Vec<u8> = [10i64, 11, 12, 13].iter().flat_map(|v| v.to_le_bytes()).collect();
        let ids = DeviceBuffer::from_host(&gpu, &ids).unwrap();
        let positions: Vec<u8> = [5i64, 6, 7, 8].iter().flat_map(|v| v.to_le_bytes()).collect();
        let positions = DeviceBuffer::from_host(&gpu, &positions).unwrap();
        let src = DeviceBuffer::zeroed(&gpu, 4 * d * 4).unwrap();
        // The bound as the plugins keep it: the low word of an int64 on the device.
        let valid = DeviceBuffer::zeroed(&gpu, 8).unwrap();
        session.set_valid_rows_device(h, Some(valid.ptr())).unwrap();
        let graph =
            record_graph_step(&session, &stream, &decode_batch(4, &ids, &positions), std::slice::from_ref(&src));
        let mut want = 0u64;
        for bound in [Some(4u64), Some(2), Some(3), Some(0), None] {
            match bound {
                Some(n) => valid.copy_from_host_async(0, &n.to_le_bytes(), stream.handle()).unwrap(),
                None => {
                    session.set_valid_rows_device(h, None).unwrap();
                    session.apply_controls(stream.handle()).unwrap();
                }
            }
            graph.launch(stream.handle()).unwrap();
            stream.synchronize().unwrap();
            want += bound.unwrap_or(4);
        }
        assert!(session.wait_probes(std::time::Duration::from_secs(30)));
        let stats = session.probe_stats();
        assert_eq!(stats[0].rows + stats[0].no_request_rows, want, "defer {defer}: rows scored {stats:?}");
        // Request 13's row (row 3) was within the bound at replays 0 and 4 only.
        let r13 = session.probe_request("p", 13).unwrap().unwrap();
        assert_eq!(r13.coverage.scored, 2, "defer {defer}: {r13:?}");
        let report = session.shutdown().unwrap();
        let counters = |name: &str| report.accounting.hookpoints.iter().find(|(n, _)| n == name).unwrap().1;
        for name in ["h", "probes.p"] {
            let c = counters(name);
            assert_eq!((c.produced.rows, c.exported.rows), (want, want), "defer {defer}, {name}: {c:?}");
        }
    }
}

/// An engine that serves requests it does not capture (opted out, or not opted in) tells each pass which rows to keep
/// (`GraphBatch::kept`, read at every replay): the other rows leave nothing — no row of no request, no probe score, no
/// stop flag —, the kept rows come out with their own requests, positions and values, a device row bound still
/// applies, and `KEEP_ALL` brings every row back; with captures copied at once and deferred.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn a_graph_step_keeps_only_the_rows_the_engine_names_at_each_replay() {
    let _alone = alone();
    let gpu = gpu();
    let (d, slots) = (64usize, 64u64);
    let dir = tempdir("kept-rows");
    std::fs::create_dir_all(&dir).unwrap();
    let mut w = vec![0.0f32; d];
    w[0] = 1.0;
    let npy = dir.join("w.npy");
    ringscope::probe::save_npy(&npy, &[1, d], &w).unwrap();
    for defer in [false, true] {
        let got = Arc::new(parking_lot::Mutex::new(Vec::<(u64, u64, u32, f32)>::new()));
        let g2 = got.clone();
        let sink = CallbackSink::new("rows", move |record: &Record| {
            let name = &record.hookpoint().spec().name;
            let view = record.view();
            for (i, m) in view.row_metas().enumerate() {
                let v = f32::from_le_bytes(view.row(i)[..4].try_into().unwrap());
                g2.lock().push((if name == "h" { 0 } else { 1 }, m.request_id, m.position, v));
            }
            Ok(())
        });
        let text = format!(
            "[ring]\nbackend = \"cuda\"\ncapacity = \"16 MiB\"\ndefer_captures = {defer}\n\
             [policy]\nmode = \"best_effort\"\n[alerts]\nflag_slots = {slots}\n\
             [[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"f32\"\nrow_width = {d}\n\
             [[probes]]\nname = \"stop\"\nhookpoint = \"h\"\nweights = \"{}\"\nthresholds = [50.0]\n\
             aggregate = \"per_token\"\naction = \"stop\"\nmode = \"fused\"\n",
            npy.display()
        );
        let session = Session::builder(Config::from_toml(&text).unwrap()).sink(sink).start().unwrap();
        let flags = session.probe_flags().unwrap();
        let stream = Stream::new(&gpu).unwrap();
        let h = session.hookpoint("h").unwrap().id();
        let i64s = |v: &[i64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let ids = DeviceBuffer::from_host(&gpu, &i64s(&[10, 11, 12, 13])).unwrap();
        let positions = DeviceBuffer::from_host(&gpu, &i64s(&[5, 6, 7, 8])).unwrap();
        // Row r holds r + 1 in element 0; request 11's row (row 1) 64, past the stop probe's threshold.
        let mut rows = vec![0.0f32; 4 * d];
        for r in 0..4 {
            rows[r * d] = if r == 1 { 64.0 } else { r as f32 + 1.0 };
        }
        let src =
            DeviceBuffer::from_host(&gpu, &rows.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let kept = DeviceBuffer::zeroed(&gpu, 5 * 4).unwrap();
        let valid = DeviceBuffer::zeroed(&gpu, 4).unwrap();
        session.set_valid_rows_device(h, Some(valid.ptr())).unwrap();
        let batch = ringscope::cuda::GraphBatch { kept: Some(kept.ptr()), ..decode_batch(4, &ids, &positions) };
        let graph = record_graph_step(&session, &stream, &batch, std::slice::from_ref(&src));
        const ALL: u32 = ringscope::cuda::KEEP_ALL;
        // (kept rows, valid rows, the (request, position) pairs the replay exports)
        type Replay = (&'static [u32], u32, &'static [(u64, u32)]);
        let replays: [Replay; 5] = [
            (&[2, 0, 2], 4, &[(10, 5), (12, 7)]),
            (&[3, 0, 2, 3], 3, &[(10, 5), (12, 7)]),
            (&[0], 4, &[]),
            (&[1, 3], 4, &[(13, 8)]),
            (&[ALL], 4, &[(10, 5), (11, 6), (12, 7), (13, 8)]),
        ];
        let mut want = Vec::new();
        for (k, (list, bound, rows)) in replays.iter().enumerate() {
            let words: Vec<u8> = list.iter().flat_map(|x| x.to_le_bytes()).collect();
            kept.copy_from_host_async(0, &words, stream.handle()).unwrap();
            valid.copy_from_host_async(0, &bound.to_le_bytes(), stream.handle()).unwrap();
            graph.launch(stream.handle()).unwrap();
            stream.synchronize().unwrap();
            assert_eq!(flags.is_raised(11), k == 4, "defer {defer}, replay {k}: request 11's flag");
            for &(req, pos) in rows.iter() {
                let v = if req == 11 { 64.0 } else { (req - 10) as f32 + 1.0 };
                want.push((0, req, pos, v));
                want.push((1, req, pos, v)); // the probe's score: w . x = x[0]
            }
        }
        assert!(session.wait_probes(std::time::Duration::from_secs(30)));
        let stats = session.probe_stats();
        assert_eq!((stats[0].rows, stats[0].no_request_rows), (want.len() as u64 / 2, 0), "defer {defer}: {stats:?}");
        let report = session.shutdown().unwrap();
        let mut got = got.lock().clone();
        got.sort_by(|a, b| a.partial_cmp(b).unwrap());
        want.sort_by(|a, b| a.partial_cmp(b).unwrap());
        assert_eq!(got, want, "defer {defer}: the exported rows (0: h, 1: the probe's scores)");
        let total = report.accounting.total();
        assert_eq!((total.exported.rows, total.dropped_total().rows), (want.len() as u64, 0), "defer {defer}");
    }
}

/// Issue 28: a site the model computed for each request's last token only (Hugging Face's logits at a `generate`
/// prefill) is captured from its compact source — row `k` is the step's `k`-th last row per request — as those rows:
/// their requests and positions, bit for bit, with and without deferred captures and row downcasting, and a fused
/// probe on it scores each row into its own request (f64 reference here). A hookpoint selecting a row list and a
/// step begun inside a graph refuse such a capture.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn last_rows_sources_are_captured_and_scored_as_the_last_row_of_each_request() {
    let _alone = alone();
    let gpu = gpu();
    let d = 64usize;
    let dir = tempdir("last-rows");
    std::fs::create_dir_all(&dir).unwrap();
    let w: Vec<f32> = (0..2 * d).map(|i| ((i * 37 % 29) as f32 - 14.0) / 16.0).collect();
    let npy = dir.join("w.npy");
    ringscope::probe::save_npy(&npy, &[2, d], &w).unwrap();
    // A prefill step: request 7 (4 tokens), request 9 (2 tokens), request 3 (3 tokens), interleaved as an engine may.
    let rows: Vec<(u64, u32)> = vec![(7, 0), (7, 1), (9, 0), (7, 2), (9, 1), (3, 0), (3, 1), (7, 3), (3, 2)];
    // The last row of each request, in batch order (request 9's ends at batch row 4, 7's at 7, 3's at 8).
    let last = [(9u64, 1u32), (7, 3), (3, 2)];
    for (defer, downcast) in [(false, false), (true, false), (false, true), (true, true)] {
        let text = format!(
            "[ring]\nbackend = \"cuda\"\ncapacity = \"16 MiB\"\ndefer_captures = {defer}\n\
             [policy]\nmode = \"best_effort\"\n\
             [[hookpoints]]\nname = \"logits\"\nsite = \"logits\"\ndtype = \"f32\"\nrow_width = {d}\n\
             [[hookpoints]]\nname = \"listed\"\nsite = \"residual\"\nlayer = 0\ndtype = \"f32\"\n\
             row_width = {d}\nrows = [0, 2]\n\
             [[probes]]\nname = \"p\"\nhookpoint = \"logits\"\nweights = \"{}\"\nbias = [0.5, -1.0]\n\
             thresholds = [1e30, 1e30]\nmode = \"fused\"\n",
            npy.display()
        );
        let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
        let sub = session.subscribe("check", ringscope::Filter::all()).unwrap();
        let stream = Stream::new(&gpu).unwrap();
        let x: Vec<f32> = (0..last.len() * d).map(|i| ((i * 13 % 31) as f32 - 15.0) / 4.0).collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let src = DeviceBuffer::from_host(&gpu, &bytes).unwrap();
        let (logits, listed) = (session.hookpoint("logits").unwrap().id(), session.hookpoint("listed").unwrap().id());
        // Rows downcast to fp8 (what the policy manager's downcast rung does), read from the last-rows source too.
        session.hookpoint("logits").unwrap().control().set_downcast(downcast).unwrap();
        session.begin_step_on(0, rows.iter().copied(), stream.handle()).unwrap();
        session.capture_device_last_rows(logits, src.ptr(), last.len() as u32, stream.handle()).unwrap();
        let refused = session.capture_device_last_rows(listed, src.ptr(), last.len() as u32, stream.handle());
        assert!(refused.unwrap_err().to_string().contains("list of batch rows"));
        session.end_step().unwrap();
        stream.synchronize().unwrap();
        // A step begun inside a graph: refused while recording (nothing is recorded).
        let ids = DeviceBuffer::from_host(&gpu, &[0u8; 16]).unwrap();
        let positions = DeviceBuffer::zeroed(&gpu, 16).unwrap();
        let batch = decode_batch(2, &ids, &positions);
        session.apply_controls(stream.handle()).unwrap();
        let in_graph = Graph::capture(&stream, || -> Result<(), Error> {
            session.begin_step_graph(&batch, stream.handle())?;
            let e = session.capture_device_last_rows(logits, src.ptr(), 2, stream.handle()).unwrap_err();
            assert!(e.to_string().contains("inside a CUDA graph"), "{e}");
            session.end_step()
        });
        drop(in_graph);
        stream.synchronize().unwrap();
        session.shutdown().unwrap();
        let mut seen = 0;
        while let Some(r) = sub.recv() {
            let name = r.hookpoint().name();
            if r.step() != 0 || (name != "logits" && name != "probes.p") {
                continue;
            }
            let v = r.view();
            assert_eq!(v.rows(), last.len(), "{name}");
            for (k, &(req, pos)) in last.iter().enumerate() {
                let m = v.row_meta(k);
                assert_eq!((m.request_id, m.position), (req, pos), "{name} row {k} (defer {defer})");
                let xk = &x[k * d..(k + 1) * d];
                if name == "logits" && !downcast {
                    assert_eq!(v.row(k), &bytes[k * d * 4..(k + 1) * d * 4], "row {k} bit for bit");
                } else if name == "logits" {
                    // fp8 with a per-row scale: within the format's precision of the row's own values.
                    let mut got = vec![0f32; d];
                    ringscope_ring::rowscaled::decode_row(v.row(k), &mut got);
                    let amax = xk.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (g, want) in got.iter().zip(xk) {
                        assert!((g - want).abs() <= amax / 8.0 + 1e-6, "row {k}: {g} vs {want}");
                    }
                } else if name == "probes.p" {
                    for j in 0..2 {
                        let want: f64 =
                            [0.5f64, -1.0][j] + (0..d).map(|i| w[j * d + i] as f64 * xk[i] as f64).sum::<f64>();
                        let got = f32::from_le_bytes(v.row(k)[j * 4..j * 4 + 4].try_into().unwrap()) as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "score {j} of {req}: {got} vs {want}"
                        );
                    }
                }
            }
            seen += 1;
        }
        assert_eq!(seen, 2, "the logits and the probe's scores, once each (defer {defer}, downcast {downcast})");
    }
}

/// Issue 28: many fused probes (one or two per layer, K from 1 to 64, weights and biases of their own) recorded into
/// a CUDA graph with every layer's capture, over several sessions in a row, on two model shapes (28 × 1536 and
/// 16 × 2048), with and without deferred captures — every score of every replay checked against `W · x + b`
/// computed here in f64 from the rows the test wrote (not through ringscope's scorer). Each session opens while the
/// legacy default stream is busy, as an engine's default stream is when a server starts a session: the probes'
/// tables used to be zeroed by a `cuMemsetD8` ordered on that stream *after* their upload on a non-blocking stream,
/// and those probes scored the bias only, on every replay.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn many_fused_probes_in_graphs_agree_with_an_f64_reference_over_sessions() {
    let _alone = alone();
    let gpu = gpu();
    const BATCH: usize = 8;
    const REPLAYS: u32 = 4;
    let ks = [1usize, 3, 8, 16, 17, 33, 64];
    // Work for the legacy default stream while each session opens: device-to-device copies of 1 GiB (~0.5 ms each).
    let busy = (DeviceBuffer::zeroed(&gpu, 1 << 30).unwrap(), DeviceBuffer::zeroed(&gpu, 1 << 30).unwrap());
    let legacy = ringscope::cuda::StreamRef::legacy_default();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0 // uniform in [-1, 1)
    };
    let mut summary = Vec::new();
    let mut session_no = 0u64;
    for (layers, d) in [(28usize, 1536usize), (16, 2048)] {
        for defer in [false, true] {
            for round in 0..3usize {
                session_no += 1;
                let dir = tempdir(&format!("many-probes-{session_no}"));
                std::fs::create_dir_all(&dir).unwrap();
                // One probe per layer, plus a second on every other layer (28 layers: 42 probes) or on every layer
                // (16 layers: 32 probes).
                struct P {
                    name: String,
                    layer: usize,
                    k: usize,
                    w: Vec<f32>,
                    b: Vec<f32>,
                }
                let mut probes = Vec::new();
                for l in 0..layers {
                    for extra in 0..(1 + usize::from(l % 2 == 0 || layers < 28)) {
                        let k = ks[(l + extra * 3 + round) % ks.len()];
                        let w: Vec<f32> = (0..k * d).map(|_| (next() / (d as f64).sqrt()) as f32).collect();
                        let b: Vec<f32> = (0..k).map(|_| next() as f32).collect();
                        probes.push(P { name: format!("p{l}_{extra}"), layer: l, k, w, b });
                    }
                }
                let mut text = format!(
                    "[ring]\nbackend = \"cuda\"\ncapacity = \"64 MiB\"\nmax_batch_rows = 64\ndefer_captures = {defer}\n\
                     [policy]\nmode = \"best_effort\"\n"
                );
                for l in 0..layers {
                    // The raw rows go to the ring in some sessions only: the probes must not depend on it.
                    text += &format!(
                        "[[hookpoints]]\nname = \"layers.{l}\"\nsite = \"residual\"\nlayer = {l}\ndtype = \"bf16\"\n\
                         row_width = {d}\nenabled = {}\n",
                        round != 1
                    );
                }
                for p in &probes {
                    let npy = dir.join(format!("{}.npy", p.name));
                    ringscope::probe::save_npy(&npy, &[p.k, d], &p.w).unwrap();
                    let bias: Vec<String> = p.b.iter().map(|v| format!("{v:?}")).collect();
                    text += &format!(
                        "[[probes]]\nname = \"{}\"\nhookpoint = \"layers.{}\"\nweights = \"{}\"\nbias = [{}]\n\
                         threshold = 1e30\naggregate = \"mean\"\nmode = \"fused\"\n",
                        p.name,
                        p.layer,
                        npy.display(),
                        bias.join(", ")
                    );
                }
                // Every score row the session exports: (probe, request, position) → scores.
                type Scores = std::collections::HashMap<(String, u64, u32), Vec<f32>>;
                let got: Arc<parking_lot::Mutex<Scores>> = Arc::default();
                let g2 = got.clone();
                let collect = CallbackSink::new("collect", move |record: &Record| {
                    let name = record.hookpoint().spec().name.clone();
                    let Some(probe) = name.strip_prefix("probes.") else { return Ok(()) };
                    let view = record.view();
                    for (i, m) in view.row_metas().enumerate() {
                        let s: Vec<f32> =
                            view.row(i).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
                        if g2.lock().insert((probe.to_owned(), m.request_id, m.position), s).is_some() {
                            return Err(
                                format!("{probe}: request {} position {} twice", m.request_id, m.position).into()
                            );
                        }
                    }
                    Ok(())
                });
                for _ in 0..64 {
                    busy.1.copy_from_device_async(&busy.0, 1 << 30, &legacy).unwrap();
                }
                let session = Session::builder(Config::from_toml(&text).unwrap()).sink(collect).start().unwrap();
                let stream = Stream::new(&gpu).unwrap();
                let sources: Vec<DeviceBuffer> =
                    (0..layers).map(|_| DeviceBuffer::zeroed(&gpu, BATCH * d * 2).unwrap()).collect();
                let ids = DeviceBuffer::zeroed(&gpu, BATCH * 8).unwrap();
                let positions = DeviceBuffer::zeroed(&gpu, BATCH * 8).unwrap();
                let request = |b: usize| 1000 * session_no + b as u64;
                let id_bytes: Vec<u8> = (0..BATCH).flat_map(|b| (request(b) as i64).to_le_bytes()).collect();
                ids.copy_from_host_async(0, &id_bytes, stream.handle()).unwrap();
                let batch = decode_batch(BATCH as u32, &ids, &positions);
                let graph = record_graph_step(&session, &stream, &batch, &sources);
                // Replay r: every row at position r; the rows (bf16) kept here for the reference.
                let mut rows: Vec<Vec<Vec<f32>>> = Vec::new(); // [replay][layer] → BATCH × d values
                for r in 0..REPLAYS {
                    let mut per_layer = Vec::new();
                    for buf in &sources {
                        let values: Vec<u16> =
                            (0..BATCH * d).map(|_| ((next() as f32 * 3.0).to_bits() >> 16) as u16).collect();
                        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                        buf.copy_from_host_async(0, &bytes, stream.handle()).unwrap();
                        per_layer.push(values.iter().map(|&h| f32::from_bits((h as u32) << 16)).collect());
                    }
                    let pos: Vec<u8> = (0..BATCH).flat_map(|_| (r as i64).to_le_bytes()).collect();
                    positions.copy_from_host_async(0, &pos, stream.handle()).unwrap();
                    graph.launch(stream.handle()).unwrap();
                    stream.synchronize().unwrap();
                    rows.push(per_layer);
                }
                let report = session.shutdown().unwrap();
                drop(graph);
                assert!(report.drain.errors.is_empty(), "{:?}", report.drain.errors);
                report.accounting.check().unwrap();
                let got = got.lock();
                let (mut wrong, mut worst) = (Vec::new(), 0f64);
                for p in &probes {
                    let mut bad = 0;
                    for (r, per_layer) in rows.iter().enumerate() {
                        for b in 0..BATCH {
                            let x = &per_layer[p.layer][b * d..(b + 1) * d];
                            let key = (p.name.clone(), request(b), r as u32);
                            let s = got.get(&key).unwrap_or_else(|| {
                                panic!("session {session_no}: no scores for {key:?} ({} rows exported)", got.len())
                            });
                            assert_eq!(s.len(), p.k);
                            for ((&got, w), &bias) in s.iter().zip(p.w.chunks_exact(d)).zip(&p.b) {
                                let dot: f64 = w.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum();
                                let want = dot + bias as f64;
                                // f32 accumulation of d products (and the bias): error within (d + 1)·2⁻²⁴ of
                                // the sum of their magnitudes.
                                let mag: f64 = w.iter().zip(x).map(|(&w, &x)| (w as f64 * x as f64).abs()).sum();
                                let err = (got as f64 - want).abs() / (mag + (bias as f64).abs());
                                worst = worst.max(err);
                                if err > (d + 1) as f64 * f64::powi(2.0, -24) {
                                    bad += 1;
                                }
                            }
                        }
                    }
                    if bad > 0 {
                        wrong.push(format!("{} (K = {}, {bad} scores)", p.name, p.k));
                    }
                }
                assert!(
                    wrong.is_empty(),
                    "session {session_no} ({layers} × {d}, defer {defer}): {} of {} probes wrong: {}",
                    wrong.len(),
                    probes.len(),
                    wrong.join(", ")
                );
                summary.push(format!(
                    "{layers}x{d} defer={defer}: {} probes, {} scores, worst error / magnitude {worst:.1e}",
                    probes.len(),
                    probes.iter().map(|p| p.k).sum::<usize>() * BATCH * REPLAYS as usize
                ));
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    eprintln!("{} sessions, every score within (d + 1)·2⁻²⁴ of its magnitude:\n{}", summary.len(), summary.join("\n"));
}

/// Held copies (`Session::hold_step`): a step recorded into a CUDA graph leaves its copy out of the graph; the engine
/// launches it after each replay (`launch_held`, on a side stream) and makes its stream wait for it (`join_held`)
/// before it overwrites what the copy reads. Two graphs (2 and 4 rows, a slot each), replayed in turn with new rows,
/// ids and positions written right after each join: every replay's rows come out bit for bit with its own request
/// ids and positions, in best-effort and full mode (each replay admitted first). A replay whose held copy is not
/// launched exports nothing (the graph holds no copy of its own). Misuse is a clear error: holding outside a
/// recording, launching an unknown slot or while recording.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on one"]
fn held_copies_run_after_each_replay_and_export_every_replays_rows() {
    let _alone = alone();
    let gpu = gpu();
    let d = 256usize;
    for mode in ["best_effort", "full"] {
        let got = Arc::new(parking_lot::Mutex::new(Vec::<(u64, u32, Vec<u8>)>::new()));
        let g2 = got.clone();
        let sink = CallbackSink::new("rows", move |record: &Record| {
            let view = record.view();
            for (i, m) in view.row_metas().enumerate() {
                g2.lock().push((m.request_id, m.position, view.row(i).to_vec()));
            }
            Ok(())
        });
        let text = format!(
            "[ring]\nbackend = \"cuda\"\ncapacity = \"1 MiB\"\ndefer_captures = true\n\
             [policy]\nmode = \"{mode}\"\nfull_deadline_ms = 20000\n\
             [[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"bf16\"\nrow_width = {d}\n"
        );
        let session = Session::builder(Config::from_toml(&text).unwrap()).sink(sink).start().unwrap();
        let stream = Stream::new(&gpu).unwrap();
        let h = session.hookpoint("h").unwrap().id();
        let ids = DeviceBuffer::zeroed(&gpu, 4 * 8).unwrap();
        let positions = DeviceBuffer::zeroed(&gpu, 4 * 8).unwrap();
        let src = DeviceBuffer::zeroed(&gpu, 4 * d * 2).unwrap();
        // Holding outside a recording is refused; so is launching a slot nothing was held in.
        session.apply_controls(stream.handle()).unwrap();
        session.begin_step_graph(&decode_batch(2, &ids, &positions), stream.handle()).unwrap();
        let e = session.hold_step(0).unwrap_err().to_string();
        assert!(e.contains("outside graph recording"), "{e}");
        session.end_step().unwrap(); // it captured nothing
        let mut want = Vec::new();
        let e = session.launch_held(7, stream.handle()).unwrap_err().to_string();
        assert!(e.contains("no held copy in slot 7"), "{e}");

        let mut graphs = Vec::new();
        for (slot, rows) in [(2u32, 2u32), (4, 4)] {
            let batch = decode_batch(rows, &ids, &positions);
            stream.synchronize().unwrap();
            let graph = Graph::capture(&stream, || -> Result<(), Error> {
                session.begin_step_graph(&batch, stream.handle())?;
                session.capture_device(h, src.ptr(), rows, stream.handle())?;
                let e = session.launch_held(slot, stream.handle()).unwrap_err().to_string();
                assert!(e.contains("a step is open") || e.contains("records a CUDA graph"), "{e}");
                session.hold_step(slot)
            })
            .unwrap();
            graphs.push((slot, rows, graph));
        }
        let i64s = |v: &[i64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        for k in 0..40u64 {
            let (slot, rows, graph) = &graphs[(k % 2) as usize];
            let req: Vec<i64> = (0..*rows as i64).map(|r| 100 * k as i64 + r).collect();
            let pos: Vec<i64> = (0..*rows as i64).map(|r| (k * 3) as i64 + r).collect();
            let data: Vec<u8> = (0..*rows as usize * d * 2).map(|i| ((i as u64 * 7 + k * 13) % 251) as u8).collect();
            // Written on the engine's stream after the previous held copy was joined: the copy must have read the
            // previous replay's bytes before these land.
            ids.copy_from_host_async(0, &i64s(&req), stream.handle()).unwrap();
            positions.copy_from_host_async(0, &i64s(&pos), stream.handle()).unwrap();
            src.copy_from_host_async(0, &data, stream.handle()).unwrap();
            session.admit_graph_step(Some(*rows), stream.handle()).unwrap();
            graph.launch(stream.handle()).unwrap();
            if k == 5 {
                // No held copy launched: the graph alone exports nothing.
                continue;
            }
            session.launch_held(*slot, stream.handle()).unwrap();
            session.join_held(stream.handle()).unwrap();
            for r in 0..*rows as usize {
                want.push((req[r] as u64, pos[r] as u32, data[r * d * 2..(r + 1) * d * 2].to_vec()));
            }
        }
        stream.synchronize().unwrap();
        let report = session.shutdown().unwrap();
        let mut got = got.lock().clone();
        got.sort();
        want.sort();
        assert_eq!(got.len(), want.len(), "{mode}: rows exported");
        assert!(got == want, "{mode}: every replay's rows, bit for bit, with their request ids and positions");
        let total = report.accounting.total();
        assert_eq!((total.exported.rows, total.dropped_total().rows), (want.len() as u64, 0), "{mode}");
    }
}
