//! The `dump_parquet` example exits non-zero, saying why, when it lost data: run with the file size limited
//! (`RLIMIT_FSIZE`, with `SIGXFSZ` ignored, so that a write past the limit fails with `EFBIG` as a full disk fails
//! with `ENOSPC`), its Parquet sink fails mid-run; it used to report "0 exported, N dropped" and exit 0.

use std::path::PathBuf;
use std::process::Command;

/// The example's binary, (re)built here: test runners build examples only sometimes (nextest never), and a stale
/// binary would test old code. Built as `cargo test --workspace` builds its targets (the `test` profile, or `release`
/// under `--release`; every workspace test target, so that dependencies resolve to the same features): after that
/// command this is a no-op, where building the example alone compiled a second copy of the dependency tree (~400 s
/// of every CI run).
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap().to_path_buf();
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let mut cargo = Command::new(env!("CARGO"));
    cargo.args(["build", "--quiet", "--workspace", "--tests", "--examples", "--profile"]);
    cargo.arg(if release { "release" } else { "test" }).current_dir(env!("CARGO_MANIFEST_DIR"));
    assert!(cargo.status().unwrap().success(), "building the dump_parquet example failed");
    profile_dir.join("examples").join("dump_parquet")
}

#[test]
fn dump_parquet_exits_non_zero_when_a_sink_fails() {
    let out = std::env::temp_dir().join(format!("ringscope-test-dump-fsize-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let bin = example();
    // Files of at most 16 KiB (32 blocks of 512 bytes): the manifest fits, a Parquet file of this run does not.
    let script = "trap '' XFSZ; ulimit -f 32; exec \"$0\" \"$@\"";
    let run = Command::new("sh")
        .args(["-c", script])
        .arg(&bin)
        .args(["--out", out.to_str().unwrap(), "--run-id", "r", "--layers", "2", "--hidden", "512"])
        .args(["--requests", "16", "--concurrent", "8", "--direct-io", "off"])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert_eq!(run.status.code(), Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stderr.contains("dump_parquet:") && stderr.contains("sink `parquet`"), "stderr: {stderr}");
    // The session was still shut down: its manifest records the failure.
    let manifest = std::fs::read_to_string(out.join("r").join("_ringscope_run.json")).unwrap();
    assert!(manifest.contains("\"failed\": true"), "{manifest}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn dump_parquet_prints_progress_from_the_session_stats_when_asked() {
    let out = std::env::temp_dir().join(format!("ringscope-test-dump-progress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let bin = example();
    let args = ["--out", out.to_str().unwrap(), "--run-id", "r", "--layers", "2", "--hidden", "256", "--requests", "8"];
    let run = Command::new(&bin).args(args).arg("--progress").output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stderr: {stderr}");
    // The last line is read after shutdown: everything exported, nothing dropped, nothing waiting.
    let last = stderr.lines().rfind(|l| l.starts_with("ringscope progress:")).expect("a progress line");
    assert!(last.contains(" 0 records dropped, backlog 0.0 MiB"), "{last}");
    let rows: u64 = last.split(", ").find_map(|p| p.strip_suffix(" rows exported")?.parse().ok()).expect("rows");
    assert!(rows > 0, "{last}");
    // Not a terminal and not asked: no progress line.
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new(&bin).args(args).output().unwrap();
    assert!(run.status.success() && !String::from_utf8_lossy(&run.stderr).contains("ringscope progress"));
    std::fs::remove_dir_all(&out).unwrap();
}
