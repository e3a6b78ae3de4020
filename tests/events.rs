//! The events table of a run (`_ringscope_events/`): every drop is in it, as it happens, and at shutdown its rows
//! lost per (hookpoint, reason) are exactly the accounting's dropped rows. Read back with the parquet crate, not
//! ringscope's own reader.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::UInt64Type;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use ringscope::synthetic::{fill_layer, EngineConfig, SyntheticEngine};
use ringscope::{CallbackSink, Config, DropReason, Event, EventKind, Record, Session};

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every committed file of the events table, read with the parquet crate: (file, rows of
/// `hookpoint, kind, reason, first_step, last_step, records_lost, rows_lost`).
type Row = (String, String, String, u64, u64, u64, u64);

fn read_table(run_dir: &Path) -> Vec<(PathBuf, Vec<Row>)> {
    let dir = run_dir.join("_ringscope_events");
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut paths: Vec<PathBuf> = entries.map(|e| e.unwrap().path()).collect();
    paths.sort();
    let mut out = Vec::new();
    for path in paths {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("part-") && name.ends_with(".parquet"), "only committed files remain: {name}");
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap().build().unwrap();
        let batches: Vec<RecordBatch> = reader.map(Result::unwrap).collect();
        let mut rows = Vec::new();
        for b in &batches {
            let text = |c: &str| b.column_by_name(c).unwrap().as_string::<i32>().clone();
            let number = |c: &str| b.column_by_name(c).unwrap().as_primitive::<UInt64Type>().clone();
            let (hp, kind, reason) = (text("hookpoint"), text("kind"), text("reason"));
            let (first, last, records, lost) =
                (number("first_step"), number("last_step"), number("records_lost"), number("rows_lost"));
            for i in 0..b.num_rows() {
                rows.push((
                    hp.value(i).to_owned(),
                    kind.value(i).to_owned(),
                    reason.value(i).to_owned(),
                    first.value(i),
                    last.value(i),
                    records.value(i),
                    lost.value(i),
                ));
            }
        }
        out.push((path, rows));
    }
    out
}

#[test]
fn every_drop_is_in_the_events_table_as_it_happens_and_its_rows_lost_equal_the_accounting() {
    let dir = tempdir("events");
    let cfg = EngineConfig { layers: 2, hidden: 512, requests: 40, ..EngineConfig::default() };
    // Best-effort, a 256 KiB ring and a 64 KiB backlog; Parquet and Arrow IPC datasets; a sink that stalls while the
    // gate is held (the record it holds holds the ring, which fills: `ring_full`; its backlog fills:
    // `sink_backpressure`) and one that fails at its second record (`sink_error` from then on).
    let mut text = format!(
        "[ring]\ncapacity = \"256 KiB\"\n[policy]\nmode = \"best_effort\"\n[export]\nparquet = true\narrow_ipc = \
         true\ndir = {:?}\nrun_id = \"r\"\nbacklog = \"64 KiB\"\n",
        dir.display().to_string()
    );
    text += &ringscope::synthetic::residual_hookpoints_toml(cfg.layers, cfg.hidden);
    let gate = Arc::new(parking_lot::Mutex::new(()));
    let g = gate.clone();
    let entered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let e = entered.clone();
    let stalled = CallbackSink::new("stalled", move |_: &Record| {
        e.store(true, Ordering::Release);
        drop(g.lock());
        Ok(())
    });
    let written = AtomicU64::new(0);
    let failing = CallbackSink::new("failing", move |_: &Record| match written.fetch_add(1, Ordering::Relaxed) {
        0 => Ok(()),
        _ => Err("the disk is full".into()),
    });
    let session = Session::builder(Config::from_toml(&text).unwrap()).sink(stalled).sink(failing).start().unwrap();
    let run_dir = dir.join("r");
    let events_dir = run_dir.join("_ringscope_events");
    let steps: Vec<_> = SyntheticEngine::new(cfg).collect();
    let half = steps.len() / 2;
    let mut buf = Vec::new();
    let held = gate.lock();
    for (i, step) in steps.iter().enumerate() {
        if i == half {
            // Written as it happens: the first half's drops reach the table while the session runs.
            let deadline = Instant::now() + Duration::from_secs(20);
            while !events_dir.join("part-00000.parquet").exists() {
                assert!(Instant::now() < deadline, "no events file while the session ran");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        session.begin_step(step.step, step.rows.iter().copied()).unwrap();
        for layer in 0..cfg.layers {
            fill_layer(cfg.seed, layer, cfg.hidden, &step.rows, &mut buf);
            session.capture(layer, &buf).unwrap();
        }
        session.end_step().unwrap();
        if i == 0 {
            // The stalled sink holds its first record, lent by the ring, before the ring is under pressure (a record
            // still queued then would be moved to host memory, and hold nothing).
            let deadline = Instant::now() + Duration::from_secs(20);
            while !entered.load(Ordering::Acquire) {
                assert!(Instant::now() < deadline, "the stalled sink never took a record");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    drop(held);
    let report = session.shutdown().unwrap();

    // What the counters say was dropped, per (hookpoint, reason), from the session and from its report.
    let accounting = session.accounting();
    assert_eq!(accounting, report.accounting);
    let mut counted: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for (hp, c) in &accounting.hookpoints {
        for reason in DropReason::ALL {
            let t = c.dropped_for(reason);
            if t.records > 0 {
                counted.insert((hp.clone(), reason.name().to_owned()), (t.records, t.rows));
            }
        }
    }
    for reason in [DropReason::RingFull, DropReason::SinkBackpressure, DropReason::SinkError] {
        assert!(counted.keys().any(|(_, r)| r == reason.name()), "the run must drop for {reason}: {counted:?}");
    }

    // What the table says, summed the same way.
    let table = read_table(&run_dir);
    assert!(table.len() >= 2, "one file while running and the rest at shutdown: {table:?}");
    let mut logged: BTreeMap<(String, String), (u64, u64)> = BTreeMap::new();
    for (_, rows) in &table {
        for (hp, kind, reason, first, last, records, lost) in rows {
            assert_eq!(kind, "drop");
            assert!(first <= last && *last < steps.len() as u64, "steps {first}..{last}");
            let sum = logged.entry((hp.clone(), reason.clone())).or_default();
            (sum.0, sum.1) = (sum.0 + records, sum.1 + lost);
        }
    }
    assert_eq!(logged, counted, "rows lost per (hookpoint, reason): the events table against the accounting");

    // The report and the manifest list exactly the table's files, with their rows lost.
    let on_disk: Vec<PathBuf> = table.iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(report.events.iter().map(|f| f.path.clone()).collect::<Vec<_>>(), on_disk);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("_ringscope_run.json")).unwrap()).unwrap();
    let listed = manifest["events"].as_array().unwrap();
    assert_eq!(listed.len(), table.len());
    for (entry, (path, rows)) in listed.iter().zip(&table) {
        assert_eq!(run_dir.join(entry["path"].as_str().unwrap()), *path);
        assert_eq!(entry["rows_lost"].as_u64().unwrap(), rows.iter().map(|r| r.6).sum::<u64>());
    }
    // The library's own reader agrees.
    let events: Vec<Event> = ringscope::read_events(&run_dir).unwrap();
    assert!(events.iter().all(|e| e.kind == EventKind::Drop));
    assert_eq!(events.len(), table.iter().map(|(_, r)| r.len()).sum::<usize>());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_that_lost_nothing_has_no_events_table_and_rung_changes_are_written() {
    let dir = tempdir("events-none");
    let text = format!(
        "[ring]\ncapacity = \"1 MiB\"\n[export]\narrow_ipc = true\ndir = {:?}\nrun_id = \"r\"\n{}",
        dir.display().to_string(),
        ringscope::synthetic::residual_hookpoints_toml(1, 8)
    );
    let quiet = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    quiet.begin_step(0, [(1, 0)]).unwrap();
    quiet.capture(0, &[0; 16]).unwrap();
    quiet.end_step().unwrap();
    let report = quiet.shutdown().unwrap();
    assert!(report.events.is_empty() && !dir.join("r/_ringscope_events").exists());
    std::fs::remove_dir_all(&dir).unwrap();

    // An Arrow IPC dataset gets the table too (in Parquet); a rung change pushed by the planner is in it as it was.
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let rung = Event {
        unix_ns: 1,
        hookpoint: "layers.0.resid".into(),
        first_step: 0,
        last_step: 0,
        kind: EventKind::Rung,
        rung: "every_4".into(),
        reason: "drain_rate".into(),
        records_lost: 0,
        rows_lost: 0,
        detail: "full -> every_4: drain 21.3 GB/s over cap 20 GB/s".into(),
        request_id: None,
        first_position: None,
        end_position: None,
    };
    // An event about one request's positions keeps them in its typed columns.
    let cached = Event {
        hookpoint: String::new(),
        kind: EventKind::Cached,
        rung: String::new(),
        reason: "prefix_cache".into(),
        rows_lost: 32,
        detail: "request=7 positions=0..32".into(),
        request_id: Some(7),
        first_position: Some(0),
        end_position: Some(32),
        ..rung.clone()
    };
    session.events().push(rung.clone());
    session.events().push(cached.clone());
    let report = session.shutdown().unwrap();
    assert_eq!(report.events.len(), 1);
    assert_eq!(ringscope::read_events(&dir.join("r")).unwrap(), vec![rung, cached]);
    std::fs::remove_dir_all(&dir).unwrap();
}
