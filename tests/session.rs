//! Cross-crate behaviour of a whole session: synthetic engine → hookpoints → ring → drain → sinks, with every
//! exported row checked bit for bit against the generator and against its request id and position.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ringscope::synthetic::{activation_row, fill_layer, EngineConfig, SyntheticEngine};
use ringscope::{CaptureOutcome, Config, DropReason, Error, Mode, RowSelection, Session};
use ringscope_exporter::CallbackSink;
use ringscope_exporter::Record;

fn config(layers: u32, hidden: u32, capacity: &str, mode: &str) -> Config {
    let mut text =
        format!("[ring]\ncapacity = \"{capacity}\"\n[policy]\nmode = \"{mode}\"\nfull_deadline_ms = 10000\n");
    text += &ringscope::synthetic::residual_hookpoints_toml(layers, hidden);
    Config::from_toml(&text).unwrap()
}

/// A sink that regenerates every row from its (layer, request, position) and compares bytes.
fn verifying_sink(seed: u64, hidden: u32, checked: Arc<AtomicU64>) -> impl ringscope_exporter::Sink {
    let mut expect = vec![0u16; hidden as usize];
    CallbackSink::new("verify", move |record: &Record| {
        let hp = record.hookpoint();
        let rec = record.view();
        let layer = hp.spec().layer.expect("residual hookpoints have a layer");
        for (i, m) in rec.row_metas().enumerate() {
            activation_row(seed, layer, m.request_id, m.position, &mut expect);
            let want: Vec<u8> = expect.iter().flat_map(|v| v.to_le_bytes()).collect();
            if rec.row(i) != &want[..] {
                return Err(format!(
                    "step {} {} row {i} (request {}, position {}) differs from the generator",
                    record.step(),
                    hp.spec().name,
                    m.request_id,
                    m.position
                )
                .into());
            }
        }
        checked.fetch_add(rec.rows() as u64, Ordering::Relaxed);
        Ok(())
    })
}

fn run_engine(session: &Session, cfg: EngineConfig) -> Result<(u64, Vec<CaptureOutcome>), Error> {
    let mut buf = Vec::new();
    let mut rows = 0;
    let mut outcomes = Vec::new();
    for step in SyntheticEngine::new(cfg) {
        session.begin_step(step.step, step.rows.iter().copied())?;
        for layer in 0..cfg.layers {
            fill_layer(cfg.seed, layer, cfg.hidden, &step.rows, &mut buf);
            outcomes.push(session.capture(layer, &buf)?);
            rows += step.rows.len() as u64;
        }
        session.end_step()?;
    }
    Ok((rows, outcomes))
}

#[test]
fn full_mode_exports_every_row_bit_exact_with_its_request_and_position() {
    let cfg = EngineConfig { layers: 4, hidden: 256, requests: 40, ..EngineConfig::default() };
    let checked = Arc::new(AtomicU64::new(0));
    // A small ring (256 KiB) so that full mode really waits for the drain.
    let session = Session::builder(config(cfg.layers, cfg.hidden, "256 KiB", "full"))
        .sink(verifying_sink(cfg.seed, cfg.hidden, checked.clone()))
        .start()
        .unwrap();
    let (rows, outcomes) = run_engine(&session, cfg).unwrap();
    assert!(outcomes.iter().all(|o| matches!(o, CaptureOutcome::Published { .. })));
    let report = session.shutdown().unwrap();
    assert!(report.drain.errors.is_empty(), "{:?}", report.drain.errors);
    assert_eq!(checked.load(Ordering::Relaxed), rows);
    let total = report.accounting.total();
    assert_eq!((total.exported.rows, total.dropped_total().rows), (rows, 0));
}

#[test]
fn best_effort_with_a_stalled_sink_drops_counts_and_never_corrupts() {
    let cfg = EngineConfig { layers: 2, hidden: 512, requests: 30, ..EngineConfig::default() };
    let checked = Arc::new(AtomicU64::new(0));
    let mut verify = verifying_sink(cfg.seed, cfg.hidden, checked.clone());
    // The sink stalls until the engine has finished: the ring must fill, and best-effort must drop, not wait.
    let gate = Arc::new(parking_lot::Mutex::new(()));
    let g = gate.clone();
    let stalled = CallbackSink::new("stalled", move |rec: &Record| {
        drop(g.lock());
        ringscope::Sink::write(&mut verify, rec).map_err(Into::into)
    });
    let mut conf = config(cfg.layers, cfg.hidden, "256 KiB", "best_effort");
    conf.export.backlog = ringscope::config::ByteSize(64 << 10);
    let session = Session::builder(conf).sink(stalled).start().unwrap();
    // Locked after the session exists, so that a failing assertion unlocks it before the session shuts down.
    let held = gate.lock();
    let (rows, outcomes) = run_engine(&session, cfg).unwrap();
    drop(held);
    let report = session.shutdown().unwrap();
    let total = report.accounting.total();
    // The stalled sink's 64 KiB backlog fills and the drain drops for it instead of waiting; whatever the ring
    // could not take at capture time was dropped there. Both are counted, with their reasons.
    let backpressure = total.dropped_for(DropReason::SinkBackpressure);
    let ring_full = total.dropped_for(DropReason::RingFull);
    assert!(backpressure.records > 0, "a stalled sink behind a 64 KiB backlog must force drops");
    assert!(total.exported.records > 0);
    let dropped_at_capture = outcomes.iter().filter(|o| matches!(o, CaptureOutcome::Dropped(_))).count();
    assert_eq!(ring_full.records as usize, dropped_at_capture);
    assert_eq!(total.exported.rows + backpressure.rows + ring_full.rows, rows);
    assert_eq!(checked.load(Ordering::Relaxed), total.exported.rows, "every exported row was verified");
    assert_eq!(report.drain.errors.len(), 1, "{:?}", report.drain.errors);
    assert!(report.drain.errors[0].contains("`stalled` fell behind"), "{:?}", report.drain.errors);
}

/// A full-mode session (one 1024-wide hookpoint, a 64 KiB ring) whose only sink blocks while the returned gate is
/// locked; a small backlog, so the stalled sink holds the drain and the ring fills.
fn session_with_a_gated_sink(full_deadline_ms: u64) -> (Session, Arc<parking_lot::Mutex<()>>) {
    let gate = Arc::new(parking_lot::Mutex::new(()));
    let g = gate.clone();
    let blocked = CallbackSink::new("blocked", move |_: &Record| {
        drop(g.lock());
        Ok(())
    });
    let mut cfg = config(1, 1024, "64 KiB", "full");
    cfg.policy.full_deadline_ms = full_deadline_ms;
    cfg.export.backlog = ringscope::config::ByteSize(16 << 10);
    (Session::builder(cfg).sink(blocked).start().unwrap(), gate)
}

#[test]
fn full_mode_times_out_with_a_clear_error_and_counts_the_drop() {
    let (session, gate) = session_with_a_gated_sink(50);
    let held = gate.lock();
    session.begin_step(0, (0..4).map(|r| (r, 0))).unwrap();
    let data = vec![0u8; 4 * 2048];
    let mut err = None;
    for _ in 0..20 {
        if let Err(e) = session.capture(0, &data) {
            err = Some(e);
            break;
        }
    }
    let err = err.expect("the ring must fill while the sink is blocked").to_string();
    assert!(err.contains("layers.0.resid") && err.contains("after waiting"), "{err}");
    drop(held);
    session.end_step().unwrap();
    let report = session.shutdown().unwrap();
    assert_eq!(report.accounting.total().dropped_for(DropReason::Deadline).records, 1);
}

/// A monitoring call (`accounting`, what `rs_stats` reads) never waits behind an engine thread that is waiting for
/// ring space in full mode.
#[test]
fn accounting_does_not_wait_for_a_full_mode_capture() {
    let (session, gate) = session_with_a_gated_sink(60_000); // the engine would wait a minute for the stalled sink
    let session = Arc::new(session);
    let held = gate.lock();
    let engine = {
        let session = session.clone();
        std::thread::spawn(move || {
            session.begin_step(0, (0..4).map(|r| (r, 0))).unwrap();
            let data = vec![0u8; 4 * 2048];
            for _ in 0..20 {
                session.capture(0, &data).unwrap();
            }
            session.end_step().unwrap();
        })
    };
    // Wait until the engine is stuck: the ring is full and nothing more is produced (an engine thread not yet
    // scheduled has produced nothing: that is not stuck).
    let hp = session.hookpoint("layers.0.resid").unwrap();
    let mut last = u64::MAX;
    loop {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let produced = hp.counters().snapshot().produced.records;
        if produced == last && (1..20).contains(&produced) {
            break;
        }
        last = produced;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let monitor = {
        let session = session.clone();
        std::thread::spawn(move || tx.send(session.accounting()).unwrap())
    };
    // A hang guard, not a speed check: without the fix this waits out the engine's minute.
    let snapshot = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("accounting waited for the engine");
    assert!(!engine.is_finished(), "the engine must still be waiting for ring space");
    assert_eq!(snapshot.total().produced.records, last);
    drop(held);
    engine.join().unwrap();
    monitor.join().unwrap();
    let report = session.shutdown().unwrap();
    assert_eq!(report.accounting.total().exported.records, 20);
}

#[test]
fn controls_change_between_steps() {
    let session = Session::new(config(1, 8, "1 MiB", "full")).unwrap();
    let hp = session.hookpoint("layers.0.resid").unwrap();
    let data = vec![1u8; 3 * 16];
    let mut published = vec![];
    for step in 0..12u64 {
        match step {
            4 => hp.control().set_every_n_steps(2).unwrap(),
            8 => hp.control().set_enabled(false),
            10 => {
                hp.control().set_enabled(true);
                hp.control().set_selection(RowSelection::LastPerRequest).unwrap();
            }
            _ => {}
        }
        session.begin_step(step, [(1, step as u32), (2, 0), (2, 1)]).unwrap();
        if let CaptureOutcome::Published { rows, .. } = session.capture(0, &data).unwrap() {
            published.push((step, rows));
        }
        session.end_step().unwrap();
    }
    assert_eq!(published, vec![(0, 3), (1, 3), (2, 3), (3, 3), (4, 3), (6, 3), (10, 2)]);
    let report = session.shutdown().unwrap();
    let c = report.accounting.hookpoints[0].1;
    assert_eq!((c.produced.records, c.sampled_out.records, c.exported.records), (12, 5, 7));
}

#[test]
fn bad_input_gets_clear_errors() {
    let session = Session::new(config(1, 8, "4 KiB", "best_effort")).unwrap();
    // Capture outside a step.
    assert!(matches!(session.capture(0, &[0; 16]), Err(Error::NoStep)));
    // Zero rows.
    let err = session.begin_step(0, std::iter::empty()).unwrap_err().to_string();
    assert!(err.contains("no rows"), "{err}");
    session.begin_step(0, [(1, 0)]).unwrap();
    assert!(matches!(session.begin_step(1, [(1, 1)]), Err(Error::StepOpen { open: 0, new: 1 })));
    // Unknown hookpoint, by id and by name.
    assert!(session.capture(9, &[0; 16]).unwrap_err().to_string().contains("unknown hookpoint id 9"));
    assert!(session.hookpoint_by_id(9).unwrap_err().to_string().contains("unknown hookpoint id 9"));
    assert_eq!(session.hookpoint_by_id(0).unwrap().spec().name, session.hookpoints()[0].spec().name);
    assert!(session.capture_by_name("layers.9.resid", &[0; 16]).unwrap_err().to_string().contains("layers.0.resid"));
    // Wrong size.
    let err = session.capture(0, &[0; 15]).unwrap_err().to_string();
    assert!(err.contains("got 15 bytes, expected 16"), "{err}");
    // Oversized: a row larger than the ring can hold.
    let big = session
        .register(ringscope::HookPointSpec {
            name: "logits".into(),
            site: ringscope::SiteKind::Logits,
            layer: None,
            dtype: ringscope::DType::F32,
            row_width: 4096,
        })
        .unwrap();
    let err = session.capture(big, &vec![0; 4 * 4096]).unwrap_err().to_string();
    assert!(err.contains("raise ring.capacity"), "{err}");
    // Zero-width rows are refused at registration.
    let err = session
        .register(ringscope::HookPointSpec {
            name: "empty".into(),
            site: ringscope::SiteKind::Custom("x".into()),
            layer: None,
            dtype: ringscope::DType::F32,
            row_width: 0,
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("row_width is 0"), "{err}");
    session.end_step().unwrap();
    let report = session.shutdown().unwrap();
    assert_eq!(report.accounting.total().dropped_for(DropReason::TooLarge).records, 1);
    // After shutdown.
    assert!(matches!(session.begin_step(1, [(1, 0)]), Err(Error::Closed)));
    assert!(matches!(session.capture(0, &[0; 16]), Err(Error::Closed)));
    assert!(matches!(session.shutdown(), Err(Error::Closed)));
}

#[test]
fn invalid_configs_are_refused() {
    let mut c = config(1, 8, "1000 B", "full");
    assert!(Session::new(c.clone()).err().unwrap().to_string().contains("ring.capacity"));
    c.ring.capacity = ringscope::config::ByteSize(1 << 20);
    c.policy.full_deadline_ms = 0;
    assert!(Session::new(c.clone()).err().unwrap().to_string().contains("full_deadline_ms"));
    c.policy.mode = Mode::BestEffort;
    let mut bad = c.clone();
    bad.export.threads = 0;
    assert!(Session::new(bad.clone()).err().unwrap().to_string().contains("export.threads"));
    bad.export.threads = 1;
    for (key, edit) in [
        ("ring.max_batch_rows", &(|c: &mut Config| c.ring.max_batch_rows = 0) as &dyn Fn(&mut Config)),
        ("ring.drain_chunk", &|c: &mut Config| c.ring.drain_chunk = ringscope::config::ByteSize(100)),
        ("ring.drain_in_flight", &|c: &mut Config| c.ring.drain_in_flight = 0),
    ] {
        let mut b = bad.clone();
        edit(&mut b);
        let err = Session::new(b).err().unwrap().to_string();
        assert!(err.contains(key), "{err}");
    }
    let err = Config::from_toml("[export]\ncompression = \"gzip\"\n").unwrap_err().to_string();
    assert!(err.contains("compression") && err.contains("gzip"), "{err}");
    let lz4 = Config::from_toml("[export]\ncompression = \"lz4\"\n").unwrap();
    assert_eq!(lz4.export.codec(), ringscope_exporter::Codec::Lz4);
    let none = Config::from_toml("[export]\ncompression = \"none\"\nzstd_level = 5\n").unwrap();
    assert_eq!(none.export.codec(), ringscope_exporter::Codec::Uncompressed);
    assert_eq!(Config::new().export.codec(), ringscope_exporter::Codec::Zstd { level: 1 });
    let err = Config::from_toml("[ring]\nbackend = \"tpu\"\n").unwrap_err().to_string();
    assert!(err.contains("backend") || err.contains("tpu"), "{err}");
    let err = Config::from_toml("[ring]\ndefer_captures = \"yes\"\n").unwrap_err().to_string();
    assert!(err.contains("defer_captures") || err.contains("boolean"), "{err}");
    assert!(Config::from_toml("[ring]\ndefer_captures = true\n").unwrap().ring.defer_captures);
    bad.export.parquet = true;
    bad.export.zstd_level = 99;
    bad.export.dir = std::env::temp_dir().join(format!("ringscope-zstd-{}", std::process::id())).display().to_string();
    let err = Session::new(bad.clone()).err().unwrap().to_string();
    assert!(err.contains("export.parquet") && err.contains("zstd level 99"), "{err}");
    let _ = std::fs::remove_dir_all(&bad.export.dir);
    c.hookpoints.push(c.hookpoints[0].clone());
    assert!(Session::new(c).err().unwrap().to_string().contains("already registered"));
    // Issue 28: accepted silently before.
    let e = Session::new(Config::from_toml("[policy]\nmode = \"best_effort\"\ndrain_rate = \"1 B/s\"\n").unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("drain_rate") && e.contains("1 MB/s"), "{e}");
    assert!(Session::new(Config::from_toml("[policy]\ndrain_rate = \"1 MB/s\"\n").unwrap()).is_ok());
    let e = Session::new(Config::from_toml("[policy]\nmode = \"best_effort\"\nmax_step_overhead = 0.01\n").unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("max_step_overhead") && e.contains("best-effort mode never waits"), "{e}");
    let e =
        Session::new(Config::from_toml("[export]\nparquet = true\ndir = \"\"\n").unwrap()).err().unwrap().to_string();
    assert!(e.contains("export.dir is empty"), "{e}");
    let e = Session::new(Config::from_toml("[export]\nparquet = true\nrun_id = \"a\\nb\"\n").unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("run id \"a\\nb\"") && e.contains("control characters"), "{e}");
}

/// Issue 28: two sessions of one run and rank, both open before either commits, wrote the same file names — the
/// second's `part-00000.parquet` and manifest replaced the first's. The second is refused while the first holds the
/// run; once a rank of a run is written, a new session of it is refused too; another rank of the run may write.
#[test]
fn a_second_writer_of_a_run_and_rank_is_refused() {
    let dir = std::env::temp_dir().join(format!("ringscope-second-writer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let text = |rank: u32| {
        format!(
            "[export]\nparquet = true\ndir = \"{}\"\nrun_id = \"shared\"\nrank = {rank}\n[[hookpoints]]\nname = \"h\"\n\
             site = \"residual\"\nlayer = 0\ndtype = \"bf16\"\nrow_width = 8\n",
            dir.display()
        )
    };
    let first = Session::new(Config::from_toml(&text(0)).unwrap()).unwrap();
    let e = Session::new(Config::from_toml(&text(0)).unwrap()).err().expect("a second writer").to_string();
    assert!(e.contains("export.run_id") && e.contains("another session"), "{e}");
    let other_rank = Session::new(Config::from_toml(&text(1)).unwrap()).unwrap();
    first.begin_step(0, [(1, 0)]).unwrap();
    first.capture(0, &[7u8; 16]).unwrap();
    first.end_step().unwrap();
    let report = first.shutdown().unwrap();
    assert_eq!(report.accounting.total().exported.rows, 1);
    drop(first);
    // Written: a later session of the same run and rank would overwrite it.
    let e = Session::new(Config::from_toml(&text(0)).unwrap()).err().expect("the rank is written").to_string();
    assert!(e.contains("already holds a dump"), "{e}");
    other_rank.shutdown().unwrap();
    let part = dir.join("shared/hookpoint=h/rank=0/part-00000.parquet");
    assert!(part.exists(), "the first writer's file is intact");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dropping_a_session_still_drains_its_records() {
    let exported = Arc::new(AtomicU64::new(0));
    let e = exported.clone();
    let sink = CallbackSink::new("count", move |r: &Record| {
        e.fetch_add(r.rows() as u64, Ordering::Relaxed);
        Ok(())
    });
    let session = Session::builder(config(1, 8, "1 MiB", "full")).sink(sink).start().unwrap();
    for step in 0..100 {
        session.begin_step(step, [(1, step as u32)]).unwrap();
        session.capture(0, &[0; 16]).unwrap();
        session.end_step().unwrap();
    }
    drop(session);
    assert_eq!(exported.load(Ordering::Relaxed), 100);
}

#[test]
fn a_subscriber_that_never_polls_holds_full_mode_for_about_one_deadline_not_one_per_capture() {
    // The case: 1 MiB ring, 64 KiB backlog, 500 ms deadline, a few hundred captures, a subscriber that never
    // polls. Before, every capture past its full backlog made the drain wait two deadlines: closing took minutes.
    let deadline = std::time::Duration::from_millis(500);
    let text = format!(
        "[ring]\ncapacity = \"1 MiB\"\n[policy]\nmode = \"full\"\nfull_deadline_ms = 500\n[export]\nbacklog = \"64 KiB\"\n{}",
        ringscope::synthetic::residual_hookpoints_toml(4, 512)
    );
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let idle = session.subscribe("idle", ringscope::Filter::all()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let started = std::time::Instant::now();
    let row = vec![0u8; 1024];
    for step in 0..100u64 {
        session.begin_step(step, [(1, step as u32)]).unwrap();
        for layer in 0..4 {
            assert!(matches!(session.capture(layer, &row).unwrap(), CaptureOutcome::Published { .. }));
        }
        session.end_step().unwrap();
    }
    let report = session.shutdown().expect("the accounting balances");
    let took = started.elapsed();
    assert!(took < 20 * deadline, "400 captures and close took {took:?} with a stalled subscriber");
    let total = report.accounting.total();
    let queued = idle.iter().count() as u64;
    assert!(queued > 0 && queued < 400, "{queued}");
    assert_eq!(total.produced.records, 400);
    assert_eq!(total.exported.records, queued, "what reached its queue is exported");
    assert_eq!(total.dropped_for(DropReason::SinkBackpressure).records, 400 - queued, "the rest is counted");
    assert!(report.drain.errors.iter().any(|e| e.contains("declared stalled")), "{:?}", report.drain.errors);
}
