//! `inspect` on a dump written by a session: a good run summarised with its accounting, a truncated file named and
//! failed (exit status 1), a directory that is no run refused (exit status 2), an interrupted run (no manifest)
//! summarised (exit status 3), a run whose Arrow IPC sink failed while Parquet committed everything (exit status 4,
//! the sink named; each sink's files compared with what that sink committed).

use std::path::{Path, PathBuf};

use ringscope::synthetic::{fill_layer, EngineConfig, SyntheticEngine};
use ringscope::{Config, Session};

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The data files of extension `ext` under `dir`.
fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.ends_with("_ringscope_events") {
                continue; // the events table: not data
            } else if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == ext) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn dump(dir: &Path, cfg: EngineConfig) {
    dump_with(dir, cfg, "full", |_| {});
}

/// Dumps the synthetic engine's run to Parquet and Arrow IPC under `dir/r`; `started` runs once the session has
/// started, before the first capture.
fn dump_with(dir: &Path, cfg: EngineConfig, mode: &str, started: impl FnOnce(&Path)) -> ringscope::Report {
    let mut text = format!(
        "[ring]\ncapacity = \"4 MiB\"\n[policy]\nmode = {mode:?}\n[export]\nparquet = true\narrow_ipc = true\ndir = {:?}\nrun_id = \"r\"\n",
        dir.display().to_string()
    );
    text += &ringscope::synthetic::residual_hookpoints_toml(cfg.layers, cfg.hidden);
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    started(&dir.join("r"));
    drive(&session, cfg);
    session.shutdown().unwrap()
}

/// Runs the synthetic engine through `session`, every layer captured at every step.
fn drive(session: &Session, cfg: EngineConfig) {
    let mut buf = Vec::new();
    for step in SyntheticEngine::new(cfg) {
        session.begin_step(step.step, step.rows.iter().copied()).unwrap();
        for layer in 0..cfg.layers {
            fill_layer(cfg.seed, layer, cfg.hidden, &step.rows, &mut buf);
            session.capture(layer, &buf).unwrap();
        }
        session.end_step().unwrap();
    }
}

fn inspect(path: &Path) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inspect")).arg(path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

#[test]
fn an_interrupted_run_is_summarised_and_exits_3_not_an_accounting_problem() {
    let dir = tempdir("inspect-interrupted");
    let cfg = EngineConfig { layers: 2, hidden: 64, requests: 12, ..EngineConfig::default() };
    dump(&dir, cfg);
    let run_dir = dir.join("r");
    // What a kill -9 leaves: the committed files, no manifest.
    std::fs::remove_file(run_dir.join("_ringscope_run.json")).unwrap();
    let (code, stdout) = inspect(&run_dir);
    assert_eq!(code, Some(3), "{stdout}");
    assert!(stdout.contains("interrupted: no manifest"), "{stdout}");
    assert!(!stdout.contains("PROBLEM"), "{stdout}");
    // Rows per hookpoint and sink, as the files hold them.
    let rows = |sink: &str, hp: &str| {
        let line = stdout.lines().find(|l| l.starts_with(sink) && l.contains(hp)).unwrap_or_else(|| panic!("{stdout}"));
        line.split_whitespace().nth(6).unwrap().parse::<u64>().unwrap()
    };
    assert!(rows("parquet", "layers.1.resid") > 0);
    assert_eq!(rows("parquet", "layers.1.resid"), rows("arrow_ipc", "layers.1.resid"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_sink_is_named_and_exits_4_while_each_sinks_files_match_what_it_committed() {
    let dir = tempdir("inspect-sinkfail");
    let cfg = EngineConfig { layers: 2, hidden: 64, requests: 12, ..EngineConfig::default() };
    // The Arrow IPC sink cannot create its partition directories (files are in the way, as a full disk would stop
    // it); the Parquet sink writes everything. Best-effort, so the engine runs to the end.
    let report = dump_with(&dir, cfg, "best_effort", |run| {
        std::fs::create_dir_all(run.join("_arrow_ipc")).unwrap();
        for l in 0..cfg.layers {
            std::fs::write(run.join(format!("_arrow_ipc/hookpoint=layers.{l}.resid")), b"in the way").unwrap();
        }
    });
    let run_dir = dir.join("r");
    assert_eq!(report.sink_failures.len(), 1, "{:?}", report.sink_failures);
    assert_eq!(report.sink_failures[0].sink, "arrow_ipc");

    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("_ringscope_run.json")).unwrap()).unwrap();
    let sink = |name: &str| manifest["sinks"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap().clone();
    let (parquet, arrow) = (sink("parquet"), sink("arrow_ipc"));
    assert_eq!((parquet["failed"].as_bool(), arrow["failed"].as_bool()), (Some(false), Some(true)));
    assert!(arrow["failed_at_unix_ms"].as_u64().unwrap() > 0);
    assert!(arrow["errors"][0].as_str().unwrap().contains("hookpoint=layers."), "{arrow}");
    for h in manifest["hookpoints"].as_array().unwrap() {
        let name = h["name"].as_str().unwrap();
        let acc = &h["accounting"];
        // Exported means every sink has it: none, since Arrow IPC lost everything.
        assert_eq!(acc["exported"]["rows"], 0, "{acc}");
        assert_eq!(acc["dropped"]["sink_error"]["rows"], acc["produced"]["rows"], "{acc}");
        // Yet the Parquet sink committed every row, and the manifest says so.
        assert_eq!(parquet["committed"][name]["rows"], acc["produced"]["rows"], "{parquet}");
        assert!(arrow["committed"].get(name).is_none(), "{arrow}");
    }
    // Each Parquet file's own metadata does not claim more than the manifest: its rows are not "exported".
    for f in files_with_ext(&run_dir, "parquet") {
        let reader = parquet::file::reader::SerializedFileReader::new(std::fs::File::open(&f).unwrap()).unwrap();
        let kv = parquet::file::reader::FileReader::metadata(&reader).file_metadata().key_value_metadata().cloned();
        let acc = kv.unwrap().into_iter().find(|k| k.key == "ringscope.accounting").unwrap().value.unwrap();
        let acc: serde_json::Value = serde_json::from_str(&acc).unwrap();
        assert_eq!(acc["exported"]["rows"], 0, "{}: {acc}", f.display());
    }

    let (code, stdout) = inspect(&run_dir);
    assert_eq!(code, Some(4), "{stdout}");
    assert!(stdout.contains("SINK FAILED: sink `arrow_ipc` failed"), "{stdout}");
    assert!(stdout.contains("lost to sink errors"), "{stdout}");
    assert!(!stdout.contains("PROBLEM") && !stdout.contains("ok:"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inspect_summarises_a_good_dump_and_fails_on_a_bad_one() {
    let dir = tempdir("inspect");
    let cfg = EngineConfig { layers: 2, hidden: 64, requests: 12, ..EngineConfig::default() };
    dump(&dir, cfg);
    let run_dir = dir.join("r");
    let inspect = |path: &Path| std::process::Command::new(env!("CARGO_BIN_EXE_inspect")).arg(path).output().unwrap();

    let ok = inspect(&run_dir);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{stdout}");
    assert!(stdout.contains("layers.1.resid") && stdout.contains("accounting adds up"), "{stdout}");

    // A truncated file: unreadable, exit status 1, named in the output.
    let victim = files_with_ext(&run_dir, "parquet").remove(0);
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let bad = inspect(&run_dir);
    let stdout = String::from_utf8_lossy(&bad.stdout);
    assert_eq!(bad.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("unreadable") && stdout.contains(&*victim.file_name().unwrap().to_string_lossy()),
        "{stdout}"
    );

    // Not a run directory at all.
    assert_eq!(inspect(&dir.join("nope")).status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Where single-byte flips go in a file: for Parquet, the middle of the first row group's activation chunk (its
/// zstd pages) and the last byte of its `step` chunk (a metadata column's data page, PLAIN/RLE, uncompressed); for
/// Arrow IPC, inside the first record batch's body (its activation buffer, just before the batch's end), and in the
/// footer (300 bytes before the end: its metadata).
fn flip_positions(path: &Path) -> Vec<(&'static str, usize)> {
    if path.extension().is_some_and(|e| e == "parquet") {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let reader = SerializedFileReader::new(std::fs::File::open(path).unwrap()).unwrap();
        let row_group = reader.metadata().row_group(0);
        let chunk = |name: &str| {
            let c =
                (0..row_group.num_columns()).map(|i| row_group.column(i)).find(|c| c.column_path().string() == name);
            let c = c.unwrap();
            let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset()) as usize;
            (start, c.compressed_size() as usize)
        };
        let (a, a_len) = chunk("activation");
        let (s, s_len) = chunk("step");
        vec![("activation page", a + a_len / 2), ("step page", s + s_len - 1)]
    } else {
        let bytes = std::fs::read(path).unwrap();
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&bytes), None).unwrap();
        let crcs: Vec<(u64, u32)> = serde_json::from_str(&reader.custom_metadata()["ringscope.batch_crc32"]).unwrap();
        let footer = crcs.last().unwrap().0 as usize;
        assert!(bytes.len() - 300 >= footer, "a footer of {} bytes", bytes.len() - footer);
        vec![("record batch body", crcs[0].0 as usize - 100), ("footer", bytes.len() - 300)]
    }
}

#[test]
fn verify_names_a_file_with_any_flipped_byte_in_its_data() {
    let dir = tempdir("verify-flips");
    let cfg = EngineConfig { layers: 1, hidden: 256, requests: 12, ..EngineConfig::default() };
    dump(&dir, cfg);
    let run_dir = dir.join("r");
    let verify = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_inspect")).arg(&run_dir).arg("--verify").output();
        let out = out.unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, stdout) = verify();
    assert_eq!(code, Some(0), "{stdout}");
    for ext in ["parquet", "arrow"] {
        let victim = files_with_ext(&run_dir, ext).remove(0);
        let good = std::fs::read(&victim).unwrap();
        for (what, at) in flip_positions(&victim) {
            for bit in [0x01, 0x80] {
                let mut bad = good.clone();
                bad[at] ^= bit;
                std::fs::write(&victim, &bad).unwrap();
                let (code, stdout) = verify();
                let name = victim.file_name().unwrap().to_string_lossy();
                assert_eq!(code, Some(1), "{what} byte {at} ^ {bit:#x} went unnoticed: {stdout}");
                let problem = stdout.lines().find(|l| l.contains(&*name)).unwrap_or_default();
                assert!(problem.contains("PROBLEM") && problem.contains(&*name), "{what}: {stdout}");
                match ext {
                    "parquet" => assert!(problem.contains("row group 0, column "), "{what}: {problem}"),
                    _ if what == "footer" => assert!(problem.contains("footer"), "{what}: {problem}"),
                    _ => assert!(problem.contains("record batch 0"), "{what}: {problem}"),
                }
            }
        }
        std::fs::write(&victim, &good).unwrap();
        assert_eq!(verify().0, Some(0));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_events_table_is_summarised_and_verify_checks_it_against_the_manifest() {
    let dir = tempdir("inspect-events");
    let cfg = EngineConfig { layers: 2, hidden: 64, requests: 12, ..EngineConfig::default() };
    // As above: the Arrow IPC sink fails, so every record is dropped (`sink_error`) and logged.
    dump_with(&dir, cfg, "best_effort", |run| {
        std::fs::create_dir_all(run.join("_arrow_ipc")).unwrap();
        for l in 0..cfg.layers {
            std::fs::write(run.join(format!("_arrow_ipc/hookpoint=layers.{l}.resid")), b"in the way").unwrap();
        }
    });
    let run_dir = dir.join("r");
    let events_dir = run_dir.join("_ringscope_events");
    let run = |verify: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_inspect"));
        command.arg(&run_dir);
        if verify {
            command.arg("--verify");
        }
        let out = command.output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    // Consistent (exit 4 only for the failed sink): the events are summarised, the events files are not data.
    let (code, stdout) = run(true);
    assert_eq!(code, Some(4), "{stdout}");
    assert!(!stdout.contains("PROBLEM"), "{stdout}");
    let line = stdout.lines().find(|l| l.starts_with("layers.0.resid") && l.contains("sink_error"));
    assert!(line.is_some(), "{stdout}");

    // An events file gone from disk: the manifest still lists it.
    let mut files: Vec<_> = std::fs::read_dir(&events_dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let last = files.pop().unwrap();
    let saved = std::fs::read(&last).unwrap();
    std::fs::remove_file(&last).unwrap();
    let (code, stdout) = run(false);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("listed in the manifest's events but not on disk"), "{stdout}");

    // Gone from the manifest too: the files agree with it, but --verify finds drops the table does not account for.
    let manifest_path = run_dir.join("_ringscope_run.json");
    let mut manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let listed = manifest["events"].as_array_mut().unwrap();
    let lost_rows = listed.pop().unwrap()["rows_lost"].as_u64().unwrap();
    assert!(lost_rows > 0);
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    assert_eq!(run(false).0, Some(4), "without --verify the sums are not compared");
    let (code, stdout) = run(true);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("rows dropped for sink_error, the events table"), "{stdout}");

    // A flipped byte in an events file's page: --verify names it.
    std::fs::write(&last, &saved).unwrap();
    let listed = manifest["events"].as_array_mut().unwrap();
    listed.push(
        serde_json::json!({ "path": format!("_ringscope_events/{}", last.file_name().unwrap().to_string_lossy()) }),
    );
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    assert_eq!(run(true).0, Some(4), "restored");
    let mut bad = saved.clone();
    bad[20] ^= 0x01; // inside the first column's first data page (after the 4-byte magic and its page header)
    std::fs::write(&last, &bad).unwrap();
    let (code, stdout) = run(true);
    assert_eq!(code, Some(1), "{stdout}");
    let name = last.file_name().unwrap().to_string_lossy();
    assert!(stdout.lines().any(|l| l.contains("PROBLEM") && l.contains(&*name)), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The child of [`a_run_killed_with_sigkill_is_reported_interrupted_and_its_committed_files_verify`]: dumps an endless
/// synthetic run (small files, so they commit as it goes) into the directory given in the environment until killed.
#[test]
fn killed_child() {
    let Ok(dir) = std::env::var("RINGSCOPE_KILLED_CHILD_DIR") else { return };
    let cfg = EngineConfig { layers: 2, hidden: 64, requests: 1 << 20, ..EngineConfig::default() };
    let mut text = format!(
        "[ring]\ncapacity = \"4 MiB\"\n[policy]\nmode = \"full\"\n[export]\nparquet = true\narrow_ipc = true\n\
         max_file_size = \"16 KiB\"\ndir = {dir:?}\nrun_id = \"r\"\n"
    );
    text += &ringscope::synthetic::residual_hookpoints_toml(cfg.layers, cfg.hidden);
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    drive(&session, cfg);
    unreachable!("killed long before a million requests are done");
}

#[test]
fn a_run_killed_with_sigkill_is_reported_interrupted_and_its_committed_files_verify() {
    /// Kills the child when dropped: a failed assertion must not leave it writing files forever.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let dir = tempdir("inspect-sigkill");
    let mut child = KillOnDrop(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "killed_child", "--nocapture", "--test-threads=1"])
            .env("RINGSCOPE_KILLED_CHILD_DIR", &dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let run_dir = dir.join("r");
    let started = std::time::Instant::now();
    // Killed mid-run, once both sinks committed a few files (and are writing more).
    while files_with_ext_if_any(&run_dir, "parquet") < 4 || files_with_ext_if_any(&run_dir, "arrow") < 4 {
        assert!(started.elapsed().as_secs() < 60, "the child committed no files");
        assert!(child.0.try_wait().unwrap().is_none(), "the child ended before it was killed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.0.kill().unwrap(); // SIGKILL
    child.0.wait().unwrap();
    assert!(!run_dir.join("_ringscope_run.json").exists());
    let (code, stdout) = inspect(&run_dir);
    assert_eq!(code, Some(3), "{stdout}");
    assert!(stdout.contains("interrupted: no manifest") && !stdout.contains("PROBLEM"), "{stdout}");
    // Every committed file is whole: its checksums hold (in-progress files are hidden and not read).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inspect")).arg(&run_dir).arg("--verify").output().unwrap();
    let verify = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{verify}");
    assert!(!verify.contains("corrupt") && !verify.contains("PROBLEM"), "{verify}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// How many committed files of extension `ext` are under `dir` (none while it does not exist yet).
fn files_with_ext_if_any(dir: &Path, ext: &str) -> usize {
    if dir.exists() {
        files_with_ext(dir, ext).len()
    } else {
        0
    }
}

/// Issue 28: pointed at the export directory (which holds runs) or at a partition inside a run, `inspect` said
/// "interrupted" (exit 3). It now says what it was given and which directory to give instead (exit 2).
#[test]
fn an_export_directory_or_a_partition_is_not_a_run_and_the_run_is_named() {
    let dir = tempdir("not-a-run");
    dump(&dir, EngineConfig { layers: 1, hidden: 64, requests: 4, max_concurrent: 2, seed: 3, ..Default::default() });
    let (code, out) = inspect(&dir);
    assert_eq!(code, Some(2), "{out}");
    assert!(out.contains("holds runs (r)") && out.contains("give one"), "{out}");
    for inner in ["r/hookpoint=layers.0.resid", "r/hookpoint=layers.0.resid/rank=0", "r/_arrow_ipc"] {
        let (code, out) = inspect(&dir.join(inner));
        assert_eq!(code, Some(2), "{inner}: {out}");
        assert!(out.contains("is inside the run") && out.contains("/r"), "{inner}: {out}");
    }
    let (code, out) = inspect(&dir.join("r"));
    assert_eq!(code, Some(0), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}
