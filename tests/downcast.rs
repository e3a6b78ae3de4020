//! The downcast rung end to end on the host path: a bf16 hookpoint whose downcast is turned on and off mid-run, dumped
//! to Parquet and Arrow IPC, read back. Downcast rows sit in their own file series with the dtype and layout in the
//! metadata, hold exactly the host converter's bytes, dequantize within E4M3's error bound; full-precision rows stay
//! bit exact; the downcast counter, the manifest and the accounting agree.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use arrow::array::{Array, FixedSizeBinaryArray, RecordBatch, StringArray, UInt32Array, UInt64Array};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use ringscope::synthetic::{activation_row, fill_layer, EngineConfig, SyntheticEngine};
use ringscope::{Config, Session};
use ringscope_ring::{rowscaled, DType};

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

/// `(dtype of the file's activation, its batches)`.
fn read(path: &Path) -> (String, Vec<RecordBatch>) {
    let file = File::open(path).unwrap();
    let batches: Vec<RecordBatch> = if path.extension().is_some_and(|e| e == "parquet") {
        ParquetRecordBatchReaderBuilder::try_new(file).unwrap().build().unwrap().map(Result::unwrap).collect()
    } else {
        arrow::ipc::reader::FileReader::try_new(file, None).unwrap().map(Result::unwrap).collect()
    };
    let schema = batches[0].schema();
    let field = schema.field_with_name("activation").unwrap();
    (field.metadata()["ringscope.dtype"].clone(), batches)
}

/// Rows of each kind a dump holds: (step, request, position) → whether the row was downcast.
fn check_file(
    path: &Path,
    seed: u64,
    hidden: u32,
    downcast_steps: &std::ops::Range<u64>,
) -> BTreeMap<(u64, u64, u32), bool> {
    let (dtype, batches) = read(path);
    let in_series = path.parent().unwrap().file_name().unwrap() == "_f8e4m3_rowscaled";
    assert_eq!(dtype == "f8e4m3_rowscaled", in_series, "{}: dtype {dtype}", path.display());
    let mut seen = BTreeMap::new();
    let mut want = vec![0u16; hidden as usize];
    let mut back = vec![0f32; hidden as usize];
    for b in &batches {
        let col = |n: &str| b.column_by_name(n).unwrap().clone();
        let step = col("step");
        let step = step.as_any().downcast_ref::<UInt64Array>().unwrap();
        let req = col("request_id");
        let req = req.as_any().downcast_ref::<UInt64Array>().unwrap();
        let pos = col("position");
        let pos = pos.as_any().downcast_ref::<UInt32Array>().unwrap();
        let dt = col("dtype");
        let dt = dt.as_any().downcast_ref::<StringArray>().unwrap();
        let act = col("activation");
        let act = act.as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
        for i in 0..b.num_rows() {
            assert_eq!(dt.value(i), dtype);
            activation_row(seed, 0, req.value(i), pos.value(i), &mut want);
            let source: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
            let downcast = in_series;
            assert_eq!(
                downcast,
                downcast_steps.contains(&step.value(i)),
                "step {} in {}",
                step.value(i),
                path.display()
            );
            if downcast {
                let mut expect = vec![0u8; hidden as usize + 4];
                rowscaled::encode_row(DType::BF16, &source, &mut expect);
                assert_eq!(act.value(i), &expect[..], "the host converter's bytes");
                rowscaled::decode_row(act.value(i), &mut back);
                let max_rel = want
                    .iter()
                    .zip(&back)
                    .map(|(&bits, &y)| {
                        let x = f32::from_bits((bits as u32) << 16);
                        ((x - y) / x).abs()
                    })
                    .fold(0f32, f32::max);
                // Every synthetic value is at least 2^-7 and at most 2: all are E4M3 normals after scaling.
                assert!(max_rel <= 1.0 / 16.0 * (1.0 + 1e-6), "max relative error {max_rel}");
                assert!(max_rel > 0.0, "a downcast that changes nothing is not one");
            } else {
                assert_eq!(act.value(i), &source[..], "full-precision rows are bit exact");
            }
            assert!(seen.insert((step.value(i), req.value(i), pos.value(i)), downcast).is_none());
        }
    }
    seen
}

#[test]
fn downcast_toggled_mid_run_is_exported_in_its_own_series_and_counted() {
    let dir = tempdir("downcast");
    let cfg = EngineConfig { layers: 1, hidden: 256, requests: 16, ..EngineConfig::default() };
    let text = format!(
        "[ring]\ncapacity = \"4 MiB\"\n[export]\nparquet = true\narrow_ipc = true\ndir = {:?}\nrun_id = \"r\"\n{}",
        dir.display().to_string(),
        ringscope::synthetic::residual_hookpoints_toml(1, cfg.hidden)
    );
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    let hp = session.hookpoint("layers.0.resid").unwrap();
    let downcast_steps = 5..12;
    let mut buf = Vec::new();
    let (mut rows, mut downcast_rows, mut downcast_records) = (0u64, 0u64, 0u64);
    for step in SyntheticEngine::new(cfg) {
        // Between steps, as the policy manager does.
        hp.control().set_downcast(downcast_steps.contains(&step.step)).unwrap();
        session.begin_step(step.step, step.rows.iter().copied()).unwrap();
        fill_layer(cfg.seed, 0, cfg.hidden, &step.rows, &mut buf);
        session.capture(0, &buf).unwrap();
        session.end_step().unwrap();
        rows += step.rows.len() as u64;
        if downcast_steps.contains(&step.step) {
            downcast_rows += step.rows.len() as u64;
            downcast_records += 1;
        }
    }
    assert!(downcast_rows > 0 && downcast_rows < rows, "the run has rows of both kinds");
    let report = session.shutdown().unwrap();
    let run_dir = dir.join("r");

    // Counters: downcast rows are a part of the exported ones; the invariant is unchanged.
    let acc = &report.accounting.hookpoints[0].1;
    assert_eq!((acc.exported.rows, acc.downcast.rows, acc.downcast.records), (rows, downcast_rows, downcast_records));
    report.accounting.check().unwrap();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("_ringscope_run.json")).unwrap()).unwrap();
    assert_eq!(manifest["hookpoints"][0]["accounting"]["downcast"]["rows"], downcast_rows);
    let f8_files = manifest["files"].as_array().unwrap().iter().filter(|f| f["dtype"] == "f8e4m3_rowscaled").count();
    assert_eq!(f8_files, 2, "one downcast file per format");

    for ext in ["parquet", "arrow"] {
        let files = files_with_ext(&run_dir, ext);
        let mut all = BTreeMap::new();
        for f in &files {
            all.extend(check_file(f, cfg.seed, cfg.hidden, &downcast_steps));
        }
        assert_eq!(all.len() as u64, rows, "{ext}: every row once");
        assert_eq!(all.values().filter(|&&d| d).count() as u64, downcast_rows, "{ext}");
        // The series' directory: the partition's `_f8e4m3_rowscaled/`, where dataset readers do not look.
        let sub = if ext == "arrow" { "_arrow_ipc/" } else { "" };
        let series = run_dir.join(format!("{sub}hookpoint=layers.0.resid/rank=0/_f8e4m3_rowscaled"));
        assert_eq!(files.iter().filter(|f| f.starts_with(&series)).count(), 1, "{ext}: {files:?}");
    }
}
