//! The policy manager in a session (host backend): budgets validated at start, the drain's byte-rate cap met by
//! moving hookpoints down the ladder instead of dropping, and full mode's deadline ending well either way.

use std::time::Duration;

use ringscope::{CaptureOutcome, Config, DropReason, Error, EventKind, Session};
use ringscope_exporter::CallbackSink;

fn toml(policy: &str, hookpoints: u32, width: u32) -> String {
    let mut t = format!("[ring]\ncapacity = \"8 MiB\"\nmax_batch_rows = 64\n[policy]\n{policy}\n");
    for l in 0..hookpoints {
        t += &format!(
            "[[hookpoints]]\nname = \"layers.{l}.resid\"\nsite = \"residual\"\nlayer = {l}\ndtype = \"f32\"\n\
             row_width = {width}\npriority = {}\n",
            if l == 0 { 10 } else { 0 }
        );
    }
    t
}

fn config_error(policy: &str, hookpoints: u32, width: u32) -> String {
    match Config::from_toml(&toml(policy, hookpoints, width)).map(Session::new) {
        Err(e) | Ok(Err(e)) => e.to_string(),
        Ok(Ok(_)) => panic!("accepted: {policy}"),
    }
}

#[test]
fn budgets_are_checked_at_start_and_errors_name_the_key() {
    for (policy, want) in [
        ("high_watermark = 1.5", "policy.high_watermark"),
        ("low_watermark = 0.8\nhigh_watermark = 0.7", "policy.low_watermark"),
        ("drain_rate = \"20 GB\"", "not a rate"),
        ("drain_rate = \"20 parsecs/s\"", "unknown size unit"),
        ("drain_rate = 0", "policy.drain_rate"),
        ("max_every_n = 0", "policy.max_every_n"),
        ("host_memory = 0", "policy.host_memory"),
        ("gpu_memory = \"4 MiB\"", "policy.gpu_memory"),
        ("on_deadline = \"shrug\"", "on_deadline"),
    ] {
        let err = config_error(policy, 2, 64);
        assert!(err.contains(want), "{policy}: {err}");
    }
    // One step's worst case does not fit the ring: the hookpoints that do not fit are named.
    let err = config_error("mode = \"best_effort\"\ngpu_memory = \"8 MiB\"", 8, 8192);
    assert!(
        err.contains("worst case") && err.contains("`layers.7.resid`") && !err.contains("`layers.0.resid`"),
        "{err}"
    );
}

#[test]
fn a_drain_cap_is_met_by_sampling_not_by_dropping() {
    // 4 hookpoints × 64 rows × 4 KiB = 1 MiB a step, about 100 MB/s at a step every 10 ms; the drain may take 10 MB/s.
    let policy = "mode = \"best_effort\"\ndrain_rate = \"10 MB/s\"\ndwell_ms = 50";
    let session = Session::new(Config::from_toml(&toml(policy, 4, 1024)).unwrap()).unwrap();
    let data = vec![0u8; 64 * 1024 * 4];
    for step in 0..150u64 {
        session.begin_step(step, (0..64).map(|i| (i as u64, step as u32))).unwrap();
        for hp in 0..4 {
            session.capture(hp, &data).unwrap();
        }
        session.end_step().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    let rungs: Vec<_> = session.hookpoints().iter().map(|h| h.control().keep()).collect();
    // Every rung change is an event (no file sink here: nothing else takes the log).
    let events = session.events().take();
    let rung_events: Vec<_> = events.iter().filter(|e| e.kind == EventKind::Rung).collect();
    assert!(rung_events.iter().any(|e| e.reason == "drain_rate"), "{events:?}");
    assert!(rung_events.iter().all(|e| ["drain_rate", "recovered"].contains(&e.reason.as_str())), "{events:?}");
    assert!(rung_events.iter().any(|e| e.rung.starts_with("every_")), "{rung_events:?}");
    let report = session.shutdown().unwrap();
    let total = report.accounting.total();
    assert!(total.sampled_out.rows > 0, "the policy manager never degraded: {rungs:?}");
    // The highest priority (layers.0) is the last to give way.
    assert!(rungs[1..].iter().all(|k| k.every_n >= rungs[0].every_n || k.off || k.last_row), "{rungs:?}");
    // The ring (8 MiB, 8 steps) absorbs the first moments; after that the ladder keeps the production under the cap.
    let dropped = total.dropped_total().rows;
    assert!(dropped * 10 < total.produced.rows, "dropped {dropped} of {} rows", total.produced.rows);
    report.accounting.check().unwrap();
}

#[test]
fn full_mode_deadline_degrades_the_step_when_asked_and_never_hangs() {
    for on_deadline in ["error", "degrade"] {
        let policy = format!("mode = \"full\"\nfull_deadline_ms = 20\non_deadline = \"{on_deadline}\"");
        let config = Config::from_toml(&toml(&policy, 2, 8192)).unwrap();
        // A sink that takes 50 ms per record: the 8 MiB ring (2 MiB records) fills at once.
        let slow = CallbackSink::new("slow", |_r: &ringscope_exporter::Record| {
            std::thread::sleep(Duration::from_millis(50));
            Ok(())
        });
        let session = Session::builder(config).sink(slow).start().unwrap();
        let data = vec![0u8; 64 * 8192 * 4];
        let (mut errors, mut degraded) = (0, 0);
        for step in 0..6u64 {
            session.begin_step(step, (0..64).map(|i| (i as u64, step as u32))).unwrap();
            for hp in 0..2 {
                match session.capture(hp, &data) {
                    Ok(CaptureOutcome::Dropped(DropReason::Deadline)) => degraded += 1,
                    Ok(_) => {}
                    Err(Error::HookPoint(e)) if e.to_string().contains("after waiting") => errors += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            session.end_step().unwrap();
        }
        let report = session.shutdown().unwrap();
        report.accounting.check().unwrap();
        let deadline = report.accounting.total().dropped_for(DropReason::Deadline).records;
        match on_deadline {
            "error" => assert!(errors > 0 && degraded == 0 && deadline == errors, "{errors} {degraded} {deadline}"),
            _ => assert!(errors == 0 && degraded > 0, "{errors} {degraded}"),
        }
    }
}

#[test]
fn a_step_time_cap_bounds_full_mode_waits_and_contradictions_are_refused() {
    let err = config_error("mode = \"full\"\nmax_step_overhead = 0.01", 2, 64);
    assert!(err.contains("policy.max_step_overhead") && err.contains("on_deadline"), "{err}");
    let err = config_error("mode = \"full\"\non_deadline = \"degrade\"\nmax_step_overhead = 2", 2, 64);
    assert!(err.contains("policy.max_step_overhead"), "{err}");

    // A 5 s deadline, but each step may wait at most 5% of its ~10 ms: a stuck sink costs drops, not seconds.
    let policy = "mode = \"full\"\nfull_deadline_ms = 5000\non_deadline = \"degrade\"\nmax_step_overhead = 0.05";
    let config = Config::from_toml(&toml(policy, 2, 8192)).unwrap();
    let stuck = CallbackSink::new("stuck", |_r: &ringscope_exporter::Record| {
        std::thread::sleep(Duration::from_millis(400));
        Ok(())
    });
    let session = Session::builder(config).sink(stuck).start().unwrap();
    let data = vec![0u8; 64 * 8192 * 4];
    let steps = 12u64;
    for step in 0..steps {
        session.begin_step(step, (0..64).map(|i| (i as u64, step as u32))).unwrap();
        for hp in 0..2 {
            session.capture(hp, &data).unwrap();
        }
        session.end_step().unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    let stats = session.stats();
    let report = session.shutdown().unwrap();
    report.accounting.check().unwrap();
    let total = report.accounting.total();
    assert!(total.dropped_total().records > 0, "the stuck sink filled the ring: some records went");
    // Without the cap the first wait alone would be the 5 s deadline.
    assert!(stats.stall_time < Duration::from_secs(2), "waited {:?} in all", stats.stall_time);
}
