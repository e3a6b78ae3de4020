//! Allocations the machine refuses, for real. Each case runs in a child process (this test binary run again, with
//! the case in an environment variable) under an address-space limit (`RLIMIT_AS`), where the allocator returns
//! failure for a request above the limit instead of handing out lazily backed memory. Before, each case aborted the
//! process ("memory allocation of ... bytes failed"); a library linked into an engine must never do that.

use std::process::Command;

use ringscope::{Config, Error, Session};

const CASE: &str = "RINGSCOPE_ALLOCATION_CASE";

/// Runs `case` in a child process and asserts that it reached its end.
fn run_case(case: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CASE, case)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stdout.contains(&format!("case {case} passed")),
        "case {case}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
}

/// Limits this process's address space to what it maps now plus `extra` bytes (the soft limit only).
fn limit_address_space(extra: u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) }, 0);
    limit.rlim_cur = (kib * 1024 + extra).min(limit.rlim_max);
    // SAFETY: `limit` is a valid rlimit; lowering the soft limit needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
}

fn config(capacity: &str, extra: &str) -> Config {
    Config::from_toml(&format!(
        "[ring]\ncapacity = \"{capacity}\"\n[policy]\nmode = \"best_effort\"\n{extra}\n[[hookpoints]]\n\
         name = \"h\"\nsite = \"residual\"\ndtype = \"u8\"\nrow_width = 16\n"
    ))
    .unwrap()
}

/// The cases, run only in a child process.
#[test]
fn child() {
    let Ok(case) = std::env::var(CASE) else { return };
    const GIB: u64 = 1 << 30;
    match case.as_str() {
        "ring" => {
            limit_address_space(GIB);
            for capacity in ["8 GiB", "1024 GiB"] {
                let err = Session::new(config(capacity, "")).err().expect("a ring over the limit is refused");
                assert!(matches!(err, Error::Setting { key: "ring.capacity", .. }), "{err}");
                let msg = err.to_string();
                assert!(msg.contains(capacity) && msg.contains("refused"), "{msg}");
            }
            // What fits still opens.
            Session::new(config("64 MiB", "")).unwrap().shutdown().unwrap();
        }
        "batch" => {
            let session = Session::new(config("1 MiB", "")).unwrap();
            limit_address_space(GIB);
            // 2^28 rows: 4 GiB of row metadata.
            let err = session.begin_step(0, (0..1u64 << 28).map(|i| (i, 0))).unwrap_err();
            assert!(err.to_string().contains("begin_step(0)") && err.to_string().contains("refused"), "{err}");
            // The session goes on.
            session.begin_step(0, [(1, 0)]).unwrap();
            session.capture(0, &[7; 16]).unwrap();
            session.end_step().unwrap();
            let report = session.shutdown().unwrap();
            assert_eq!(report.accounting.total().exported.records, 1);
        }
        "copy" => {
            // One 96 MiB record with 48 MiB of address space left: the drain lends the record to the sinks where it
            // lies in the ring instead of copying it (before: the copy was refused and the record counted as
            // dropped), so it is exported.
            let text = "[ring]\ncapacity = \"256 MiB\"\n[policy]\nmode = \"best_effort\"\n[[hookpoints]]\n\
                        name = \"big\"\nsite = \"residual\"\ndtype = \"u8\"\nrow_width = 100663296\n";
            let session = Session::new(Config::from_toml(text).unwrap()).unwrap();
            let row = vec![1u8; 96 << 20];
            limit_address_space(48 << 20);
            session.begin_step(0, [(1, 0)]).unwrap();
            session.capture(0, &row).unwrap();
            session.end_step().unwrap();
            let report = session.shutdown().unwrap();
            let total = report.accounting.total();
            assert_eq!((total.produced.records, total.exported.records), (1, 1));
            assert!(report.drain.errors.is_empty(), "{:?}", report.drain.errors);
        }
        "fused" => {
            // A fused probe of 64 outputs on rows of one bf16 element: its scores take 128× the bytes of the rows
            // (1 GiB for 4 Mi rows), over what is left; the capture is an error naming the scores, not an abort.
            use ringscope::config::ProbeMode;
            use ringscope::probe::{Action, Aggregation, ProbeDef, Target, Weights};
            let text = "[ring]\ncapacity = \"256 MiB\"\n[policy]\nmode = \"best_effort\"\n[[hookpoints]]\n\
                        name = \"narrow\"\nsite = \"residual\"\nlayer = 0\ndtype = \"bf16\"\nrow_width = 1\n";
            let def = ProbeDef {
                name: "wide".into(),
                target: Target::HookPoint("narrow".into()),
                weights: Weights::new(64, 1, vec![1.0; 64]).unwrap(),
                bias: vec![0.0; 64],
                aggregation: Aggregation::Mean,
                thresholds: vec![1e9; 64],
                action: Action::Alert,
                labels: vec![],
                min_tokens: 1,
            };
            let session =
                Session::builder(Config::from_toml(text).unwrap()).probe(def, ProbeMode::Fused).start().unwrap();
            let rows = 4u64 << 20;
            let data = vec![0u8; rows as usize * 2];
            session.begin_step(0, (0..rows).map(|i| (1, i as u32))).unwrap(); // one request: a small id set
            limit_address_space(GIB / 2);
            let err = session.capture(0, &data).unwrap_err().to_string();
            assert!(err.contains("probes.wide") && err.contains("refused"), "{err}");
            session.end_step().unwrap();
            // The session goes on.
            session.begin_step(1, [(1, 0)]).unwrap();
            session.capture(0, &[0, 0]).unwrap();
            session.end_step().unwrap();
            session.shutdown().unwrap();
        }
        other => panic!("unknown case {other}"),
    }
    println!("case {case} passed");
}

#[test]
fn a_ring_over_the_address_space_limit_is_a_config_error() {
    run_case("ring");
}

#[test]
fn a_step_of_2_to_the_28_rows_over_the_address_space_limit_is_an_error() {
    run_case("batch");
}

#[test]
fn the_drain_copies_nothing_so_a_record_larger_than_the_memory_left_is_exported() {
    run_case("copy");
}

#[test]
fn fused_probe_scores_over_the_address_space_limit_are_an_error() {
    run_case("fused");
}
