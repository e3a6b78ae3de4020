//! `inspect`: summarises a ringscope dump and checks it.
//!
//! ```text
//! cargo run --release -p ringscope-inspect -- ringscope-out/<run id> [--verify]
//! ```
//!
//! Prints, per hookpoint: files, layer, step range, distinct requests, rows, activation bytes, and the accounting
//! (produced / exported / dropped / sampled out). Exits with status 1 if any file is unreadable, a file's row
//! count disagrees with its metadata, the accounting does not add up, or the rows on disk are not what the
//! accounting says was exported; with status 2 if the path is not a run directory. `--verify` also reads every page
//! of every Parquet column and checks its CRC (and zstd's frame checksum), and checks each Arrow IPC record batch
//! against its CRC-32 in the file's metadata (`ringscope.batch_crc32`), naming the file and the page or batch.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use arrow::array::{Array, RecordBatch, UInt64Array};
use clap::Parser;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;
use serde_json::Value;

#[derive(Parser)]
#[command(about = "Summarise and check a ringscope dump (a run directory)")]
struct Args {
    /// The run directory (e.g. ringscope-out/run-20261130T012345Z-4242).
    run_dir: PathBuf,
    /// Also decode every value and check every checksum (slower; proves every byte is as written).
    #[arg(long)]
    verify: bool,
}

#[derive(Default)]
struct Partition {
    files: usize,
    layer: Option<i64>,
    rows: u64,
    bytes: u64,
    steps: Option<(u64, u64)>,
    requests: HashSet<u64>,
    /// (part index, accounting JSON) of the newest file.
    accounting: Option<(String, Value)>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.run_dir.is_dir() {
        eprintln!("inspect: {} is not a directory", args.run_dir.display());
        return ExitCode::from(2);
    }
    let files = match data_files(&args.run_dir) {
        Ok(f) if !f.is_empty() => f,
        Ok(_) => {
            eprintln!("inspect: no part-*.parquet or part-*.arrow files under {}", args.run_dir.display());
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("inspect: cannot list {}: {e}", args.run_dir.display());
            return ExitCode::from(2);
        }
    };
    let mut problems: Vec<String> = Vec::new();
    // Keyed by (format, hookpoint): each file sink writes a complete copy of the stream.
    let mut parts: BTreeMap<(String, String), Partition> = BTreeMap::new();
    for path in &files {
        let format = path.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
        match read_file(path, args.verify) {
            Ok(summary) => {
                let p = parts.entry((format, summary.hookpoint.clone())).or_default();
                p.files += 1;
                p.layer = p.layer.or(summary.layer);
                p.rows += summary.rows;
                p.bytes += summary.bytes;
                if let Some((a, b)) = summary.steps {
                    p.steps = Some(p.steps.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
                }
                p.requests.extend(summary.requests);
                if summary.rows != summary.file_rows {
                    problems.push(format!(
                        "{}: {} rows, but its metadata says {}",
                        path.display(),
                        summary.rows,
                        summary.file_rows
                    ));
                }
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                if p.accounting.as_ref().is_none_or(|(n, _)| *n < name) {
                    p.accounting = Some((name, summary.accounting));
                }
            }
            Err(e) => problems.push(format!("{}: unreadable: {e}", path.display())),
        }
    }

    println!("run {}: {} files", args.run_dir.display(), files.len());
    println!(
        "{:<8} {:<22} {:>5} {:>6} {:>13} {:>9} {:>10} {:>10} | {:>10} {:>10} {:>8} {:>8}",
        "format",
        "hookpoint",
        "layer",
        "files",
        "steps",
        "requests",
        "rows",
        "MiB",
        "produced",
        "exported",
        "dropped",
        "sampled"
    );
    for ((format, hookpoint), p) in &parts {
        let acc = p.accounting.as_ref().map(|(_, v)| v.clone()).unwrap_or(Value::Null);
        let rows_of = |v: &Value| v["rows"].as_u64().unwrap_or(0);
        let produced = rows_of(&acc["produced"]);
        let exported = rows_of(&acc["exported"]);
        let sampled = rows_of(&acc["sampled_out"]);
        let dropped: u64 = acc["dropped"].as_object().map_or(0, |m| m.values().map(rows_of).sum());
        let steps = p.steps.map_or("-".into(), |(a, b)| format!("{a}..{b}"));
        let layer = p.layer.map_or("-".into(), |l| l.to_string());
        println!(
            "{format:<8} {hookpoint:<22} {layer:>5} {:>6} {steps:>13} {:>9} {:>10} {:>10.1} | {produced:>10} {exported:>10} {dropped:>8} {sampled:>8}",
            p.files,
            p.requests.len(),
            p.rows,
            p.bytes as f64 / 1048576.0
        );
        if acc.is_null() {
            problems.push(format!("{format} {hookpoint}: no accounting in the file metadata"));
            continue;
        }
        if produced != exported + dropped + sampled {
            problems.push(format!(
                "{format} {hookpoint}: produced {produced} rows but exported {exported} + dropped {dropped} + sampled out {sampled}"
            ));
        }
        if p.rows != exported {
            problems.push(format!("{format} {hookpoint}: {} rows on disk but {exported} exported", p.rows));
        }
    }
    if problems.is_empty() {
        println!("ok: every file readable, accounting adds up (produced = exported + dropped + sampled out)");
        ExitCode::SUCCESS
    } else {
        for p in &problems {
            println!("PROBLEM: {p}");
        }
        ExitCode::from(1)
    }
}

fn data_files(run: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![run.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
            // Skip in-progress files and the manifests; descend into `_arrow_ipc/`.
            if name.starts_with('.') || (name.starts_with('_') && !path.is_dir()) {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if name.starts_with("part-") && (name.ends_with(".parquet") || name.ends_with(".arrow")) {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

struct FileSummary {
    hookpoint: String,
    layer: Option<i64>,
    rows: u64,
    file_rows: u64,
    bytes: u64,
    steps: Option<(u64, u64)>,
    requests: HashSet<u64>,
    accounting: Value,
}

fn read_file(path: &Path, verify: bool) -> Result<FileSummary, String> {
    if verify {
        verify_checksums(path)?;
    }
    let file = File::open(path).map_err(|e| e.to_string())?;
    let (kv, batches): (BTreeMap<String, String>, Vec<RecordBatch>) =
        if path.extension().is_some_and(|e| e == "parquet") {
            let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| e.to_string())?;
            let kv = builder
                .metadata()
                .file_metadata()
                .key_value_metadata()
                .map(|m| m.iter().map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default())).collect())
                .unwrap_or_default();
            let schema = builder.parquet_schema();
            let wanted: Vec<usize> = (0..schema.num_columns())
                .filter(|&i| {
                    let name = schema.column(i).path().parts()[0].clone();
                    name == "step" || name == "request_id" || (verify && name == "activation")
                })
                .collect();
            let mask = ProjectionMask::leaves(schema, wanted);
            let reader = builder.with_projection(mask).build().map_err(|e| e.to_string())?;
            let batches = reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
            (kv, batches)
        } else {
            // SAFETY: a committed dump file is not modified while it is read; a concurrent writer would only make
            // the decode below fail, which is reported as unreadable.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
            let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&map[..]), None)
                .map_err(|e| e.to_string())?;
            let kv = reader.custom_metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let batches = reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
            (kv, batches)
        };
    let get = |k: &str| kv.get(k).cloned().ok_or_else(|| format!("metadata key {k} missing"));
    let row_bytes: u64 = {
        let shape: Vec<u64> = serde_json::from_str(&get("ringscope.shape")?).map_err(|e| e.to_string())?;
        let dtype = get("ringscope.dtype")?.parse::<ringscope_ring::DType>().map_err(|e| e.to_string())?;
        shape.iter().product::<u64>() * dtype.size() as u64
    };
    let mut rows = 0;
    let mut steps: Option<(u64, u64)> = None;
    let mut requests = HashSet::new();
    for b in &batches {
        rows += b.num_rows() as u64;
        let col = |name: &str| {
            b.column_by_name(name)
                .and_then(|c| c.as_any().downcast_ref::<UInt64Array>().cloned())
                .ok_or_else(|| format!("column {name} missing or not uint64"))
        };
        let step = col("step")?;
        if let (Some(lo), Some(hi)) = (arrow::compute::min(&step), arrow::compute::max(&step)) {
            steps = Some(steps.map_or((lo, hi), |(a, z)| (a.min(lo), z.max(hi))));
        }
        requests.extend(col("request_id")?.values().iter().copied());
        if verify {
            let act = b.column_by_name("activation").ok_or("column activation missing")?;
            if act.len() != b.num_rows() || act.null_count() != 0 {
                return Err("activation column is incomplete".into());
            }
        }
    }
    Ok(FileSummary {
        hookpoint: get("ringscope.hookpoint")?,
        layer: kv.get("ringscope.layer").and_then(|l| l.parse().ok()),
        rows,
        file_rows: get("ringscope.file_rows")?.parse().map_err(|e: std::num::ParseIntError| e.to_string())?,
        bytes: rows * row_bytes,
        steps,
        requests,
        accounting: serde_json::from_str(&get("ringscope.accounting")?).map_err(|e| e.to_string())?,
    })
}

/// Checks every checksum of a file: for Parquet, reads every page of every column chunk (the page reader checks the
/// CRC in each page header, and zstd the checksum of each frame); for Arrow IPC, the CRC-32 of each record batch's
/// stretch of the file against the list in its metadata.
fn verify_checksums(path: &Path) -> Result<(), String> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = File::open(path).map_err(|e| e.to_string())?;
    if path.extension().is_some_and(|e| e == "parquet") {
        let reader = SerializedFileReader::new(file).map_err(|e| e.to_string())?;
        for g in 0..reader.num_row_groups() {
            let row_group = reader.get_row_group(g).map_err(|e| e.to_string())?;
            for c in 0..row_group.num_columns() {
                let name = row_group.metadata().column(c).column_path().string();
                let pages = row_group.get_column_page_reader(c).map_err(|e| e.to_string())?;
                for (i, page) in pages.enumerate() {
                    page.map_err(|e| format!("row group {g}, column {name}, page {i}: {e}"))?;
                }
            }
        }
        return Ok(());
    }
    // SAFETY: as in `read_file`: a committed dump file is not modified while it is read.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
    let reader =
        arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&map[..]), None).map_err(|e| e.to_string())?;
    let Some(list) = reader.custom_metadata().get("ringscope.batch_crc32") else {
        return Err("no record batch checksums (metadata key ringscope.batch_crc32)".into());
    };
    let crcs: Vec<(u64, u32)> =
        serde_json::from_str(list).map_err(|e| format!("ringscope.batch_crc32 is not a list of [end, crc]: {e}"))?;
    if crcs.len() != reader.num_batches() {
        return Err(format!("{} record batches, but {} checksums", reader.num_batches(), crcs.len()));
    }
    let mut start = 0u64;
    for (i, &(end, want)) in crcs.iter().enumerate() {
        let bytes = map.get(start as usize..end as usize).ok_or_else(|| {
            format!("record batch {i}: its checksum covers bytes {start}..{end}, past the file's {}", map.len())
        })?;
        let got = crc32fast::hash(bytes);
        if got != want {
            return Err(format!(
                "record batch {i} (bytes {start}..{end}): CRC-32 {got:08x}, but the file's metadata says {want:08x}"
            ));
        }
        start = end;
    }
    Ok(())
}
