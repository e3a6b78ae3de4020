//! `inspect`: summarises a ringscope dump and checks it.
//!
//! ```text
//! cargo run --release -p ringscope-inspect -- ringscope-out/<run id> [--verify]
//! cargo run --release -p ringscope-inspect -- s3://bucket/prefix/<run id> [--verify] [--storage-option KEY=VALUE]
//! ```
//!
//! A run on object storage is copied, one object at a time, into a private temporary directory (removed when inspect
//! ends, unless it is killed) and checked as a local run, each file named by its URL.
//!
//! Prints, per format and hookpoint: files, layer, step range, distinct requests, rows (and of them, rows downcast to
//! `f8e4m3_rowscaled`, from the `_f8e4m3_rowscaled/` file series), activation bytes, and the run's accounting
//! (produced / exported / dropped / sampled out / downcast) from the run manifest (`_ringscope_run.json`); then the
//! events table (`_ringscope_events/`): drop spans and rows lost per hookpoint and reason, and rung changes.
//!
//! What is compared with what: the rows of each format's files on disk against what the manifest says *that sink*
//! committed (`sinks[].committed`); the accounting's `exported` counts a record only once every sink has it, so with
//! two sinks a record one of them lost is `dropped` (`sink_error`) even though the other's file holds it.
//!
//! Exit status (also in `--help`):
//! * 0 — every file readable, the files hold what the manifest says was committed, the accounting adds up, and no
//!   sink failed;
//! * 1 — a problem: a file unreadable, a file's rows disagree with its metadata, the files on disk are not what the
//!   manifest says was committed, or the accounting does not add up (for a URL also: an object could not be copied);
//! * 2 — the path is not a run directory (no manifest and no data files); for a URL also: the object store could not
//!   be opened or listed (credentials, endpoint, bucket), or the URL names no run;
//! * 3 — the run was interrupted: no manifest (the process was killed, or could not write it); the committed files are
//!   summarised (each is complete: files are committed by rename after they are synced), but nothing says what was
//!   lost;
//! * 4 — a sink failed during the run (a full disk, say): the files are consistent, but records were lost
//!   (`sink_error`); the manifest's `sinks` and `errors` say which sink and why.
//!
//! `--verify` also reads every page of every Parquet column and checks its CRC (and zstd's frame checksum), and checks
//! each Arrow IPC record batch against its CRC-32 in the file's metadata (`ringscope.batch_crc32`), naming the file
//! and the page or batch (exit status 1); and, when the manifest lists the events table, that the events' rows lost
//! per (hookpoint, reason) are the manifest's dropped rows (exit status 1 if not).
//!
//! `inspect retention RUN_DIR --weights W --hookpoint H --group-a IDS --group-b IDS [--reference REF_RUN_DIR]
//! [--min T] [--last-token] [--json]` reports a probe's calibration retention (ProbeX) per output over the run's rows,
//! flagging outputs below `--min` (exit status 3); see `retention.rs` and docs/probes.md.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use arrow::array::{Array, AsArray, FixedSizeBinaryArray, RecordBatch, UInt64Array};
use arrow::datatypes::UInt64Type;
use clap::Parser;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;
use ringscope_ring::DType;
use serde_json::Value;

mod retention;

/// File name of the run manifest (`ringscope::manifest::MANIFEST`; inspect does not depend on the library).
const MANIFEST: &str = "_ringscope_run.json";
/// The events table's directory (`ringscope_exporter::EVENTS_DIR`).
const EVENTS_DIR: &str = "_ringscope_events";

const EXIT_PROBLEM: u8 = 1;
const EXIT_NOT_A_RUN: u8 = 2;
const EXIT_INTERRUPTED: u8 = 3;
const EXIT_SINK_FAILED: u8 = 4;

#[derive(Parser)]
#[command(
    about = "Summarise and check a ringscope dump (a run directory); `inspect retention` reports probes' calibration \
             retention over a dump",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    after_help = "Exit status: 0 ok; 1 a problem (unreadable file, rows that disagree with the metadata or the \
                  manifest, accounting that does not add up; for a URL, an object that could not be copied); 2 not a \
                  run directory (for a URL also: the store could not be opened or listed); 3 interrupted run (no \
                  manifest: the committed files are summarised); 4 a sink failed during the run (records lost to \
                  sink_error; the files are consistent). `inspect retention --help` lists its own exit statuses."
)]
struct Args {
    /// The run directory (e.g. ringscope-out/run-20261130T012345Z-4242). A run directory named like a subcommand
    /// (`retention`) is given as `./retention`.
    #[arg(required = true)]
    run_dir: Option<PathBuf>,
    /// Also decode every value and check every checksum (slower; proves every byte is as written).
    #[arg(long)]
    verify: bool,
    /// A run on object storage (`s3://bucket/prefix/<run id>`, `gs://…`, `az://…`): a builder option of the store,
    /// as `export.storage_options` takes them (`aws_endpoint=http://…`, `aws_allow_http=true`, …), after the
    /// environment's (`AWS_*`, `GOOGLE_*`, `AZURE_*`). Repeat for several.
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Subcommand)]
enum Command {
    Retention(retention::RetentionArgs),
}

#[derive(Default)]
struct Partition {
    files: usize,
    layer: Option<i64>,
    rows: u64,
    /// Of `rows`, rows downcast on capture (files of dtype `f8e4m3_rowscaled`).
    downcast_rows: u64,
    bytes: u64,
    steps: Option<(u64, u64)>,
    requests: HashSet<u64>,
}

/// The sink that wrote `path`: as the manifest lists it, else by extension (the built-in sinks' names).
fn sink_of(path: &Path, run_dir: &Path, listed: &HashMap<String, String>) -> String {
    let rel = path.strip_prefix(run_dir).unwrap_or(path).to_string_lossy().into_owned();
    if let Some(sink) = listed.get(&rel) {
        return sink.clone();
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some("arrow") => "arrow_ipc".into(),
        Some(ext) => ext.to_owned(),
        None => String::new(),
    }
}

fn rows_of(v: &Value) -> u64 {
    v["rows"].as_u64().unwrap_or(0)
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Retention(r)) = args.command {
        return retention::run(r);
    }
    let run_dir = args.run_dir.expect("clap requires the run directory without a subcommand");
    let url = run_dir.to_string_lossy().into_owned();
    if ringscope_exporter::is_object_url(&url) {
        return summarise_remote(&url, &args.storage_options, args.verify);
    }
    if !args.storage_options.is_empty() {
        eprintln!("inspect: --storage-option is for a run on object storage (s3://…, gs://…, az://…), not {url}");
        return ExitCode::from(EXIT_NOT_A_RUN);
    }
    summarise(&run_dir, args.verify)
}

/// Where a run on object storage was copied to, and its URL: paths under the copy are shown as the URL's objects
/// ([`shown`]). Set once, by [`summarise_remote`].
static REMOTE: std::sync::OnceLock<(PathBuf, String)> = std::sync::OnceLock::new();

/// `path` as the user knows it: under a run copied from object storage, the object's URL; else the path.
fn shown(path: &Path) -> String {
    if let Some((local, url)) = REMOTE.get() {
        if let Ok(rel) = path.strip_prefix(local) {
            let rel = rel.to_string_lossy();
            return if rel.is_empty() { url.clone() } else { format!("{url}/{rel}") };
        }
    }
    path.display().to_string()
}

/// A run on object storage: its objects are copied into a temporary directory (removed afterwards; it needs as much
/// local disk as the run holds), which is then summarised and checked as a local run, every path shown as its URL.
fn summarise_remote(url: &str, options: &[String], verify: bool) -> ExitCode {
    let shown_url = ringscope_exporter::redact_url(url).trim_end_matches('/').to_owned();
    let mut opts = ringscope_exporter::StorageOptions::default();
    for o in options {
        // The value may be a secret: never shown.
        let Some((k, v)) = o.split_once('=').filter(|(k, _)| !k.is_empty()) else {
            eprintln!("inspect: a --storage-option is not KEY=VALUE (its text is not shown: it may hold a secret)");
            return ExitCode::from(EXIT_NOT_A_RUN);
        };
        opts.options.insert(k.to_owned(), v.to_owned());
    }
    let storage = match ringscope_exporter::ObjectStorage::open(url, opts) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("inspect: {}", e.to_string().replacen("export.url", "the run URL", 1));
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
    };
    let root = storage.root();
    // A partition, file series or events table of a run: the run is the URL above them.
    let mut run_url = shown_url.as_str();
    while let Some((parent, last)) = run_url.rsplit_once('/').filter(|(p, _)| p.contains("://") && !p.ends_with(':')) {
        if !is_inside_run(last) {
            break;
        }
        run_url = parent;
    }
    if run_url != shown_url {
        eprintln!("inspect: {shown_url} is inside the run {run_url}: give the run, e.g. `inspect {run_url}`");
        return ExitCode::from(EXIT_NOT_A_RUN);
    }
    // Not a run (an export directory of runs, say): said before anything is copied.
    let run_like = |names: &[String]| names.iter().any(|n| is_run_entry(n));
    match storage.list_names(&root) {
        Ok(names) if names.is_empty() => {
            eprintln!("inspect: {shown_url} does not exist (no object under it): not a run");
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
        Ok(names) if !run_like(&names) => {
            // Runs one level below (the first 64 names looked at: each is a listing).
            let mut runs: Vec<&str> = names
                .iter()
                .take(64)
                .filter(|n| storage.list_names(&root.join(n)).is_ok_and(|inner| run_like(&inner)))
                .map(String::as_str)
                .collect();
            runs.sort();
            eprintln!(
                "inspect: {shown_url} is not a run (no manifest, no hookpoint=… partition){}",
                runs.first().map_or(String::new(), |r| format!(
                    " but holds runs ({}): give one, e.g. `inspect {shown_url}/{r}`",
                    runs_listed(&runs)
                ))
            );
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
        Ok(_) => {}
        Err(e) => {
            eprintln!("inspect: cannot list {shown_url}: {e}");
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
    }
    let objects = match storage.list(&root) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("inspect: cannot list {shown_url}: {e}");
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
    };
    // Private (0700), made exclusively, removed when dropped.
    let tmp = match tempfile::Builder::new().prefix("ringscope-inspect-").tempdir() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("inspect: cannot make a temporary directory for the copy of {shown_url}: {e}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    };
    for object in &objects {
        let Ok(rel) = object.strip_prefix(&root) else { continue };
        let local = tmp.path().join(rel);
        // Streamed to disk chunk by chunk: memory holds one chunk, not the object.
        let copied = std::fs::create_dir_all(local.parent().unwrap_or(tmp.path()))
            .and_then(|()| storage.download(object, &local));
        if let Err(e) = copied {
            eprintln!("inspect: cannot copy {shown_url}/{} into a temporary directory: {e}", rel.display());
            return ExitCode::from(EXIT_PROBLEM);
        }
    }
    let _ = REMOTE.set((tmp.path().to_path_buf(), shown_url));
    summarise(tmp.path(), verify)
}

/// Whether `name` is a manifest of a run: rank 0's [`MANIFEST`], or another rank's `_ringscope_run.rank=<r>.json`
/// (the ranks of one run — tensor-parallel workers, each with its own session — share the run directory).
fn is_manifest(name: &str) -> bool {
    name == MANIFEST
        || name
            .strip_prefix("_ringscope_run.rank=")
            .and_then(|r| r.strip_suffix(".json"))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
}

/// Every manifest of the run, merged into one (`None`: the run has none — it did not shut down). One rank's manifest
/// is returned as it is; several are merged: their files, events and errors listed together, each hookpoint's
/// accounting and each sink's committed rows summed over the ranks (a hookpoint's rows of every rank are in its
/// `hookpoint=<name>` directory, one `rank=<r>` partition each), a sink failed if it failed on any rank.
fn read_manifests(run_dir: &Path) -> Result<Option<Value>, String> {
    let entries = std::fs::read_dir(run_dir).map_err(|e| format!("{}: unreadable: {e}", shown(run_dir)))?;
    let mut paths: Vec<PathBuf> = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: unreadable: {e}", shown(run_dir)))?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(is_manifest) {
            paths.push(path);
        }
    }
    paths.sort();
    let mut manifests = Vec::with_capacity(paths.len());
    for path in &paths {
        let bytes = std::fs::read(path).map_err(|e| format!("{} unreadable: {e}", shown(path)))?;
        manifests.push(
            serde_json::from_slice::<Value>(&bytes).map_err(|e| format!("{} is not valid JSON: {e}", shown(path)))?,
        );
    }
    let mut merged = manifests.pop();
    if let Some(out) = merged.as_mut() {
        for m in manifests {
            merge_manifest(out, m);
        }
    }
    Ok(merged)
}

fn merge_manifest(out: &mut Value, m: Value) {
    for list in ["files", "events", "errors"] {
        if let (Some(a), Some(b)) = (out[list].as_array_mut(), m[list].as_array()) {
            a.extend(b.iter().cloned());
        }
    }
    // Each rank's attention metadata describes its own heads: the entries of every rank, listed together.
    if let Some(theirs) = m["metadata"]["attention"]["layers"].as_array() {
        if let Some(ours) = out["metadata"]["attention"]["layers"].as_array_mut() {
            ours.extend(theirs.iter().cloned());
        } else if out.is_object() {
            out["metadata"]["attention"] = m["metadata"]["attention"].clone();
        }
    }
    for (list, key) in [("hookpoints", "accounting"), ("sinks", "committed")] {
        let Some(theirs) = m[list].as_array() else { continue };
        let Some(ours) = out[list].as_array_mut() else {
            out[list] = Value::Array(theirs.clone());
            continue;
        };
        for t in theirs {
            match ours.iter_mut().find(|o| o["name"] == t["name"]) {
                Some(o) => {
                    add_numbers(&mut o[key], &t[key]);
                    if list == "sinks" {
                        o["failed"] =
                            Value::Bool(o["failed"].as_bool() == Some(true) || t["failed"].as_bool() == Some(true));
                        if let (Some(a), Some(b)) = (o["errors"].as_array_mut(), t["errors"].as_array()) {
                            a.extend(b.iter().cloned());
                        }
                    }
                }
                None => ours.push(t.clone()),
            }
        }
    }
}

/// One line on the run's attention metadata (the `attn_q` / `attn_k` / `attn_v` sites): which layers can be rebuilt
/// with `ringscope.attention_pattern`, their heads, and windows / soft-caps; `None` without any.
fn attention_summary(manifest: &Value) -> Option<String> {
    let attention = &manifest["metadata"]["attention"];
    let entries = attention["layers"].as_array()?;
    let mut layers: BTreeSet<u64> = BTreeSet::new();
    let (mut heads, mut kv) = (BTreeSet::new(), BTreeSet::new());
    let mut notes: BTreeSet<String> = BTreeSet::new();
    for e in entries {
        layers.insert(e["layer"].as_u64()?);
        heads.insert(e["total_num_heads"].as_u64().or(e["num_heads"].as_u64())?);
        kv.insert(e["total_num_kv_heads"].as_u64().or(e["num_kv_heads"].as_u64())?);
        if let Some(w) = e["sliding_window"].as_u64() {
            notes.insert(format!("window {w}"));
        }
        if let Some(c) = e["softcap"].as_f64() {
            notes.insert(format!("softcap {c}"));
        }
    }
    let list = |s: &BTreeSet<u64>| s.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    Some(format!(
        "attention: layers [{}] from {} ({} query / {} KV heads{}): ringscope.attention_pattern rebuilds them",
        list(&layers),
        attention["source"].as_str().unwrap_or("?"),
        list(&heads),
        list(&kv),
        if notes.is_empty() {
            String::new()
        } else {
            format!("; {}", notes.into_iter().collect::<Vec<_>>().join(", "))
        },
    ))
}

/// Adds the numbers of `b` into `a`, key by key (objects) — counts of records, rows and bytes.
fn add_numbers(a: &mut Value, b: &Value) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in y {
                match x.get_mut(k) {
                    Some(ax) => add_numbers(ax, v),
                    None => {
                        x.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (a @ Value::Number(_), Value::Number(n)) => {
            if let (Some(x), Some(y)) = (a.as_u64(), n.as_u64()) {
                *a = Value::from(x.saturating_add(y));
            }
        }
        (a @ Value::Null, b) => *a = b.clone(),
        _ => {}
    }
}

/// Whether `dir` looks like a run directory: a manifest, or a partition of one of the file sinks.
fn looks_like_run(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.flatten().any(|e| is_run_entry(&e.file_name().to_string_lossy()))
}

/// Whether a run holds an entry named `name` directly: a manifest, or a partition of one of the file sinks.
fn is_run_entry(name: &str) -> bool {
    is_manifest(name) || name.starts_with("hookpoint=") || name == "_arrow_ipc"
}

/// Whether `name` is something that lives inside a run: `hookpoint=…`, `rank=…`, `_arrow_ipc`, a downcast series,
/// the events table.
fn is_inside_run(name: &str) -> bool {
    name.starts_with("hookpoint=")
        || name.starts_with("rank=")
        || name == "_arrow_ipc"
        || name == EVENTS_DIR
        || name.starts_with("_f8e4m3")
}

/// The runs an export directory holds, for a hint: up to eight names, and how many there are beyond.
fn runs_listed(runs: &[&str]) -> String {
    if runs.len() > 8 {
        format!("{}, ... ({} runs)", runs[..8].join(", "), runs.len())
    } else {
        runs.join(", ")
    }
}

/// When `dir` is no run directory but next to one — a partition (or file series) inside a run, or the export
/// directory that holds runs —, what to give instead.
fn not_a_run_hint(dir: &Path) -> Option<String> {
    let abs = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let inside = |p: &Path| p.file_name().is_some_and(|n| is_inside_run(&n.to_string_lossy()));
    if !inside(&abs) && looks_like_run(dir) {
        return None;
    }
    if let Some(run) = abs.ancestors().skip(1).take(5).find(|a| !inside(a) && looks_like_run(a)) {
        return Some(format!(
            "{} is inside the run {}: give the run directory, e.g. `inspect {}`",
            shown(dir),
            shown(run),
            shown(run)
        ));
    }
    // The export directory: runs below it.
    let mut runs: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.path().is_dir() && looks_like_run(&e.path()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    runs.sort();
    let first = runs.first()?;
    let listed = runs_listed(&runs.iter().map(String::as_str).collect::<Vec<_>>());
    Some(format!(
        "{} is not a run directory but holds runs ({listed}): give one, e.g. `inspect {}`",
        shown(dir),
        shown(&dir.join(first))
    ))
}

fn summarise(run_dir: &Path, verify: bool) -> ExitCode {
    if !run_dir.is_dir() {
        eprintln!("inspect: {} is not a directory", shown(run_dir));
        return ExitCode::from(EXIT_NOT_A_RUN);
    }
    // An export directory or a partition would otherwise read as an interrupted run (its files, no manifest).
    if let Some(hint) = not_a_run_hint(run_dir) {
        eprintln!("inspect: {hint}");
        return ExitCode::from(EXIT_NOT_A_RUN);
    }
    let manifest: Option<Value> = match read_manifests(run_dir) {
        Ok(m) => m,
        Err(problem) => {
            println!("PROBLEM: {problem}");
            return ExitCode::from(EXIT_PROBLEM);
        }
    };
    let files = match data_files(run_dir) {
        Ok(f) if f.is_empty() && manifest.is_none() => {
            eprintln!(
                "inspect: no {MANIFEST} and no part-*.parquet or part-*.arrow files under {}: not a run directory, \
                 or a run that committed nothing",
                shown(run_dir)
            );
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
        Ok(f) => f,
        Err(e) => {
            eprintln!("inspect: cannot list {}: {e}", shown(run_dir));
            return ExitCode::from(EXIT_NOT_A_RUN);
        }
    };
    let listed: HashMap<String, String> = manifest
        .as_ref()
        .and_then(|m| m["files"].as_array())
        .map(|fs| {
            fs.iter().filter_map(|f| Some((f["path"].as_str()?.to_owned(), f["sink"].as_str()?.to_owned()))).collect()
        })
        .unwrap_or_default();
    let mut problems: Vec<String> = Vec::new();
    // Keyed by (sink, hookpoint): each file sink writes its own copy of the stream.
    let mut parts: BTreeMap<(String, String), Partition> = BTreeMap::new();
    for path in &files {
        let sink = sink_of(path, run_dir, &listed);
        match read_file(path, verify) {
            Ok(summary) => {
                let p = parts.entry((sink, summary.hookpoint.clone())).or_default();
                p.files += 1;
                p.layer = p.layer.or(summary.layer);
                p.rows += summary.rows;
                if summary.dtype == DType::F8E4M3RowScaled {
                    p.downcast_rows += summary.rows;
                }
                p.bytes += summary.bytes;
                if let Some((a, b)) = summary.steps {
                    p.steps = Some(p.steps.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
                }
                p.requests.extend(summary.requests);
                if summary.rows != summary.file_rows {
                    problems.push(format!(
                        "{}: {} rows, but its metadata says {}",
                        shown(path),
                        summary.rows,
                        summary.file_rows
                    ));
                }
            }
            Err(e) => problems.push(format!("{}: unreadable: {e}", shown(path))),
        }
    }

    let events = match read_events(run_dir, verify) {
        Ok(events) => events,
        Err(e) => {
            problems.push(e);
            Events::default()
        }
    };

    println!("run {}: {} files", shown(run_dir), files.len());
    let Some(manifest) = manifest else {
        events.print();
        return interrupted(&parts, &problems);
    };

    let accounting: BTreeMap<String, Value> = manifest["hookpoints"]
        .as_array()
        .map(|hs| hs.iter().filter_map(|h| Some((h["name"].as_str()?.to_owned(), h["accounting"].clone()))).collect())
        .unwrap_or_default();
    // What each sink says it committed, per hookpoint; absent in manifests older than the `sinks` section.
    let sinks: Option<Vec<Value>> = manifest["sinks"].as_array().cloned();
    let committed = |sink: &str, hookpoint: &str| -> Option<u64> {
        let s = sinks.as_ref()?.iter().find(|s| s["name"] == sink)?;
        Some(s["committed"][hookpoint]["rows"].as_u64().unwrap_or(0))
    };
    // Every (sink, hookpoint) the manifest says holds rows, even if no file of it is on disk any more.
    for s in sinks.iter().flatten() {
        let name = s["name"].as_str().unwrap_or_default();
        for (hp, c) in s["committed"].as_object().into_iter().flatten() {
            if rows_of(c) > 0 {
                parts.entry((name.to_owned(), hp.clone())).or_default();
            }
        }
    }

    println!(
        "{:<10} {:<22} {:>5} {:>6} {:>13} {:>9} {:>10} {:>8} {:>10} | {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "sink",
        "hookpoint",
        "layer",
        "files",
        "steps",
        "requests",
        "rows",
        "f8 rows",
        "MiB",
        "committed",
        "produced",
        "exported",
        "dropped",
        "sampled",
        "downcast"
    );
    for ((sink, hookpoint), p) in &parts {
        let acc = accounting.get(hookpoint).cloned().unwrap_or(Value::Null);
        let produced = rows_of(&acc["produced"]);
        let exported = rows_of(&acc["exported"]);
        let sampled = rows_of(&acc["sampled_out"]);
        let dropped: u64 = acc["dropped"].as_object().map_or(0, |m| m.values().map(rows_of).sum());
        let downcast = rows_of(&acc["downcast"]);
        let steps = p.steps.map_or("-".into(), |(a, b)| format!("{a}..{b}"));
        let layer = p.layer.map_or("-".into(), |l| l.to_string());
        let sink_committed = committed(sink, hookpoint);
        println!(
            "{sink:<10} {hookpoint:<22} {layer:>5} {:>6} {steps:>13} {:>9} {:>10} {:>8} {:>10.1} | {:>10} {produced:>10} {exported:>10} {dropped:>8} {sampled:>8} {downcast:>8}",
            p.files,
            p.requests.len(),
            p.rows,
            p.downcast_rows,
            p.bytes as f64 / 1048576.0,
            sink_committed.map_or("-".into(), |c| c.to_string()),
        );
        if acc.is_null() {
            problems.push(format!("{sink} {hookpoint}: the manifest has no accounting for this hookpoint"));
            continue;
        }
        match sink_committed {
            // Like with like: this sink's files against what this sink committed.
            Some(c) if c != p.rows => problems.push(format!(
                "{sink} {hookpoint}: {} rows on disk but the manifest says the sink committed {c}",
                p.rows
            )),
            Some(_) => {}
            // An older manifest: no per-sink numbers; each sink then holds every exported row.
            None if p.rows != exported => {
                problems.push(format!("{sink} {hookpoint}: {} rows on disk but {exported} exported", p.rows))
            }
            None => {}
        }
    }
    for (hookpoint, acc) in &accounting {
        let produced = rows_of(&acc["produced"]);
        let exported = rows_of(&acc["exported"]);
        let sampled = rows_of(&acc["sampled_out"]);
        let dropped: u64 = acc["dropped"].as_object().map_or(0, |m| m.values().map(rows_of).sum());
        if produced != exported + dropped + sampled {
            problems.push(format!(
                "{hookpoint}: produced {produced} rows but exported {exported} + dropped {dropped} + sampled out {sampled}"
            ));
        }
        // Downcast rows are a part of the exported ones, never more.
        let downcast = rows_of(&acc["downcast"]);
        if downcast > exported {
            problems.push(format!("{hookpoint}: {downcast} rows downcast but only {exported} exported"));
        }
    }

    events.print();
    if let Some(line) = attention_summary(&manifest) {
        println!("{line}");
    }
    if let Some(listed) = manifest["events"].as_array() {
        // The manifest lists the events table (it predates it otherwise): its files are the ones on disk, and, checked
        // with --verify, they account for every drop the manifest counts.
        let listed: BTreeSet<PathBuf> = listed.iter().filter_map(|f| Some(run_dir.join(f["path"].as_str()?))).collect();
        let on_disk: BTreeSet<PathBuf> = events.files.iter().cloned().collect();
        for missing in listed.difference(&on_disk) {
            problems.push(format!("{}: listed in the manifest's events but not on disk", shown(missing)));
        }
        for extra in on_disk.difference(&listed) {
            problems.push(format!("{}: an events file the manifest does not list", shown(extra)));
        }
        if verify {
            problems.extend(events.check_against(&accounting));
        }
    }

    // Records lost because a sink failed: not an inconsistency of the dump, but a run that did not do its job.
    let mut failures: Vec<String> = Vec::new();
    for s in sinks.iter().flatten().filter(|s| s["failed"].as_bool() == Some(true)) {
        let errors: Vec<&str> = s["errors"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        failures.push(format!(
            "sink `{}` failed{}: {}",
            s["name"].as_str().unwrap_or("?"),
            s["failed_at_unix_ms"].as_u64().map_or(String::new(), |ms| format!(" at {ms} ms since the Unix epoch")),
            if errors.is_empty() { "(no message)".into() } else { errors.join("; ") }
        ));
    }
    let lost: (u64, u64) = accounting.values().fold((0, 0), |(r, w), a| {
        let e = &a["dropped"]["sink_error"];
        (r + e["records"].as_u64().unwrap_or(0), w + rows_of(e))
    });
    if lost.0 > 0 {
        failures.push(format!(
            "{} records ({} rows) lost to sink errors (sink_error): each is missing from at least one sink's files",
            lost.0, lost.1
        ));
    }

    if !problems.is_empty() {
        for p in &problems {
            println!("PROBLEM: {p}");
        }
        for f in &failures {
            println!("SINK FAILED: {f}");
        }
        return ExitCode::from(EXIT_PROBLEM);
    }
    if !failures.is_empty() {
        for f in &failures {
            println!("SINK FAILED: {f}");
        }
        println!("files consistent with the manifest, but the run lost records: see above");
        return ExitCode::from(EXIT_SINK_FAILED);
    }
    println!(
        "ok: every file readable and as committed, accounting adds up (produced = exported + dropped + sampled out)"
    );
    ExitCode::SUCCESS
}

/// A run directory without a manifest: the run did not shut down. Its committed files are complete, so they are
/// summarised; what was produced and lost is unknown.
fn interrupted(parts: &BTreeMap<(String, String), Partition>, problems: &[String]) -> ExitCode {
    println!("interrupted: no manifest ({MANIFEST}): the run did not shut down (killed, or crashed); the committed files hold:");
    println!(
        "{:<10} {:<22} {:>5} {:>6} {:>13} {:>9} {:>10} {:>10}",
        "sink", "hookpoint", "layer", "files", "steps", "requests", "rows", "MiB"
    );
    for ((sink, hookpoint), p) in parts {
        let steps = p.steps.map_or("-".into(), |(a, b)| format!("{a}..{b}"));
        let layer = p.layer.map_or("-".into(), |l| l.to_string());
        println!(
            "{sink:<10} {hookpoint:<22} {layer:>5} {:>6} {steps:>13} {:>9} {:>10} {:>10.1}",
            p.files,
            p.requests.len(),
            p.rows,
            p.bytes as f64 / 1048576.0
        );
    }
    if !problems.is_empty() {
        for p in problems {
            println!("PROBLEM: {p}");
        }
        return ExitCode::from(EXIT_PROBLEM);
    }
    println!("records captured but not committed before the interruption are not in any file and not counted anywhere");
    ExitCode::from(EXIT_INTERRUPTED)
}

fn data_files(run: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![run.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
            // Skip in-progress files, the manifests and the events table; descend into `_arrow_ipc/`.
            if name.starts_with('.') || (name.starts_with('_') && !path.is_dir()) || name == EVENTS_DIR {
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
    dtype: DType,
    layer: Option<i64>,
    rows: u64,
    file_rows: u64,
    bytes: u64,
    steps: Option<(u64, u64)>,
    requests: HashSet<u64>,
}

/// A committed data file's footer metadata (`ringscope.*` keys) and its record batches. Of a Parquet file only the
/// columns `wanted` accepts are decoded; an Arrow IPC file (memory-mapped) is read whole.
fn open_file(
    path: &Path,
    wanted: impl Fn(&str) -> bool,
) -> Result<(BTreeMap<String, String>, Vec<RecordBatch>), String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    if path.extension().is_some_and(|e| e == "parquet") {
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| e.to_string())?;
        let kv = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .map(|m| m.iter().map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default())).collect())
            .unwrap_or_default();
        let schema = builder.parquet_schema();
        let wanted: Vec<usize> =
            (0..schema.num_columns()).filter(|&i| wanted(&schema.column(i).path().parts()[0])).collect();
        let mask = ProjectionMask::leaves(schema, wanted);
        let reader = builder.with_projection(mask).build().map_err(|e| e.to_string())?;
        let batches = reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
        Ok((kv, batches))
    } else {
        // SAFETY: a committed dump file is not modified while it is read; a concurrent writer would only make
        // the decode below fail, which is reported as unreadable.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| e.to_string())?;
        let reader =
            arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&map[..]), None).map_err(|e| e.to_string())?;
        let kv = reader.custom_metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let batches = reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
        Ok((kv, batches))
    }
}

fn read_file(path: &Path, verify: bool) -> Result<FileSummary, String> {
    if verify {
        verify_checksums(path)?;
    }
    let (kv, batches) =
        open_file(path, |name| name == "step" || name == "request_id" || (verify && name == "activation"))?;
    let get = |k: &str| kv.get(k).cloned().ok_or_else(|| format!("metadata key {k} missing"));
    let dtype = get("ringscope.dtype")?.parse::<DType>().map_err(|e| e.to_string())?;
    let row_bytes: u64 = {
        let shape: Vec<u64> = serde_json::from_str(&get("ringscope.shape")?).map_err(|e| e.to_string())?;
        dtype.row_bytes(shape.iter().product::<u64>())
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
            if dtype == DType::F8E4M3RowScaled {
                // Every downcast row must be readable back as floats: a positive, finite scale.
                let act = act
                    .as_any()
                    .downcast_ref::<FixedSizeBinaryArray>()
                    .filter(|a| a.value_length() as u64 == row_bytes)
                    .ok_or_else(|| format!("activation is not fixed-size binary of {row_bytes} bytes"))?;
                for i in 0..act.len() {
                    let scale = ringscope_ring::rowscaled::scale_of(act.value(i));
                    if !(scale > 0.0 && scale.is_finite()) {
                        return Err(format!("downcast row {i} of a batch has scale {scale}: not dequantizable"));
                    }
                }
            }
        }
    }
    Ok(FileSummary {
        hookpoint: get("ringscope.hookpoint")?,
        dtype,
        layer: kv.get("ringscope.layer").and_then(|l| l.parse().ok()),
        rows,
        file_rows: get("ringscope.file_rows")?.parse().map_err(|e: std::num::ParseIntError| e.to_string())?,
        bytes: rows * row_bytes,
        steps,
        requests,
    })
}

/// Checks every checksum of a file: for Parquet, reads every page of every column chunk (the page reader checks the
/// CRC in each page header, and zstd the checksum of each frame); for Arrow IPC, the CRC-32 of each record batch's
/// stretch of the file against the list in its metadata, and of the rest (the footer) against its own.
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
    // The rest: end-of-stream marker, footer, length, magic.
    ringscope_exporter::check_ipc_footer(&map, start)
}

/// Drop spans of one (hookpoint, reason) in the events table.
#[derive(Default)]
struct Lost {
    spans: u64,
    records: u64,
    rows: u64,
    steps: Option<(u64, u64)>,
}

/// The events table of a run, summed up.
#[derive(Default)]
struct Events {
    files: Vec<PathBuf>,
    /// Drops, by (hookpoint, reason).
    lost: BTreeMap<(String, String), Lost>,
    /// Other events (rung changes, stalls), by (hookpoint, kind): how many, and the last one's rung.
    other: BTreeMap<(String, String), (u64, String)>,
}

impl Events {
    fn print(&self) {
        if self.files.is_empty() {
            println!("events: none (no {EVENTS_DIR}/)");
            return;
        }
        let spans: u64 = self.lost.values().map(|l| l.spans).sum();
        println!("events: {} files, {spans} drop spans", self.files.len());
        if !self.lost.is_empty() {
            println!(
                "{:<22} {:<18} {:>6} {:>10} {:>10} {:>17}",
                "hookpoint", "reason", "spans", "records", "rows", "steps"
            );
        }
        for ((hookpoint, reason), l) in &self.lost {
            let steps = l.steps.map_or("-".into(), |(a, b)| {
                format!("{a}..{}", if b == u64::MAX { "?".into() } else { b.to_string() })
            });
            println!("{hookpoint:<22} {reason:<18} {:>6} {:>10} {:>10} {steps:>17}", l.spans, l.records, l.rows);
        }
        for ((hookpoint, kind), (n, rung)) in &self.other {
            let hookpoint = if hookpoint.is_empty() { "(session)" } else { hookpoint };
            let rung = if rung.is_empty() { String::new() } else { format!(", last rung {rung}") };
            println!("{hookpoint:<22} {kind:<18} {n:>6} events{rung}");
        }
    }

    /// Problems where the events' rows lost per (hookpoint, reason) are not the manifest's dropped rows.
    fn check_against(&self, accounting: &BTreeMap<String, Value>) -> Vec<String> {
        let mut problems = Vec::new();
        for (hookpoint, acc) in accounting {
            for (reason, tally) in acc["dropped"].as_object().into_iter().flatten() {
                let counted = rows_of(tally);
                let logged = self.lost.get(&(hookpoint.clone(), reason.clone())).map_or(0, |l| l.rows);
                if counted != logged {
                    problems.push(format!(
                        "{hookpoint}: the manifest counts {counted} rows dropped for {reason}, the events table {logged}"
                    ));
                }
            }
        }
        for ((hookpoint, reason), l) in &self.lost {
            if accounting.get(hookpoint).is_none_or(|a| a["dropped"].get(reason).is_none()) {
                problems.push(format!(
                    "{hookpoint}: the events table has {} rows dropped for {reason}, which the manifest does not count",
                    l.rows
                ));
            }
        }
        problems
    }
}

/// Reads the events table of `run_dir` (no directory: no events), checking each file's page CRCs with `verify`.
fn read_events(run_dir: &Path, verify: bool) -> Result<Events, String> {
    let dir = run_dir.join(EVENTS_DIR);
    let mut events = Events::default();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(events),
        Err(e) => return Err(format!("{}: unreadable: {e}", shown(&dir))),
    };
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: unreadable: {e}", shown(&dir)))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("part-") && name.ends_with(".parquet") {
            events.files.push(path);
        }
    }
    events.files.sort();
    for path in events.files.clone() {
        read_events_file(&path, verify, &mut events).map_err(|e| format!("{}: unreadable: {e}", shown(&path)))?;
    }
    Ok(events)
}

fn read_events_file(path: &Path, verify: bool, events: &mut Events) -> Result<(), String> {
    if verify {
        verify_checksums(path)?;
    }
    let file = File::open(path).map_err(|e| e.to_string())?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file).and_then(|b| b.build()).map_err(|e| e.to_string())?;
    for batch in reader {
        let b = batch.map_err(|e| e.to_string())?;
        let text = |name: &str| {
            b.column_by_name(name)
                .and_then(|c| c.as_string_opt::<i32>())
                .cloned()
                .ok_or(format!("column {name} missing or not utf8"))
        };
        let number = |name: &str| {
            b.column_by_name(name)
                .and_then(|c| c.as_primitive_opt::<UInt64Type>())
                .cloned()
                .ok_or(format!("column {name} missing or not uint64"))
        };
        let (hookpoint, kind, reason, rung) = (text("hookpoint")?, text("kind")?, text("reason")?, text("rung")?);
        let (first, last) = (number("first_step")?, number("last_step")?);
        let (records, rows) = (number("records_lost")?, number("rows_lost")?);
        for i in 0..b.num_rows() {
            let hp = hookpoint.value(i).to_owned();
            if kind.value(i) == "drop" {
                let l = events.lost.entry((hp, reason.value(i).to_owned())).or_default();
                l.spans += 1;
                l.records += records.value(i);
                l.rows += rows.value(i);
                let (a, z) = (first.value(i), last.value(i));
                l.steps = Some(l.steps.map_or((a, z), |(x, y)| (x.min(a), y.max(z))));
            } else {
                let o = events.other.entry((hp, kind.value(i).to_owned())).or_default();
                o.0 += 1;
                o.1 = rung.value(i).to_owned();
            }
        }
    }
    Ok(())
}
