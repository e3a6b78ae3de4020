//! `inspect` on a dump written by a session: a good run summarised with its accounting, a truncated file named and
//! failed (exit status 1), a directory that is no run refused (exit status 2).

use std::path::{Path, PathBuf};

use ringscope::synthetic::{fill_layer, EngineConfig, SyntheticEngine};
use ringscope::{Config, Session};

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
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
    let mut text = format!(
        "[ring]\ncapacity = \"4 MiB\"\n[export]\nparquet = true\narrow_ipc = true\ndir = {:?}\nrun_id = \"r\"\n",
        dir.display().to_string()
    );
    text += &ringscope::synthetic::residual_hookpoints_toml(cfg.layers, cfg.hidden);
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let mut buf = Vec::new();
    for step in SyntheticEngine::new(cfg) {
        session.begin_step(step.step, step.rows.iter().copied()).unwrap();
        for layer in 0..cfg.layers {
            fill_layer(cfg.seed, layer, cfg.hidden, &step.rows, &mut buf);
            session.capture(layer, &buf).unwrap();
        }
        session.end_step().unwrap();
    }
    session.shutdown().unwrap();
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
