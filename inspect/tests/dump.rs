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

/// Where single-byte flips go in a file: for Parquet, the middle of the first row group's activation chunk (its
/// zstd pages) and the last byte of its `step` chunk (a metadata column's data page, PLAIN/RLE, uncompressed); for
/// Arrow IPC, inside the first record batch's body (its activation buffer, just before the batch's end).
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
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None).unwrap();
        let crcs: Vec<(u64, u32)> = serde_json::from_str(&reader.custom_metadata()["ringscope.batch_crc32"]).unwrap();
        vec![("record batch body", crcs[0].0 as usize - 100)]
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
                    _ => assert!(problem.contains("record batch 0"), "{what}: {problem}"),
                }
            }
        }
        std::fs::write(&victim, &good).unwrap();
        assert_eq!(verify().0, Some(0));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
