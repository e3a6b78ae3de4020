//! The run manifest: `_ringscope_run.json` in a run directory, written at shutdown after every file is committed.
//!
//! It names the hookpoints, the files, the final per-hookpoint accounting, and per sink what it committed. The leading
//! `_` keeps dataset readers (pyarrow, DuckDB and Polars globs on `*.parquet`) from mistaking it for data.
//!
//! Two views, which answer different questions and so may differ without contradicting each other:
//! * `hookpoints[].accounting.exported` counts a record as exported only once *every* destination has it (all
//!   sinks and consumers): with Parquet and Arrow IPC both configured, a record the Parquet sink committed but the
//!   Arrow IPC sink lost is `dropped.sink_error`, not exported.
//! * `sinks[]` says per sink (`parquet`, `arrow_ipc`, or a sink of the user's) what it *holds*: records it took,
//!   rows committed per hookpoint, and whether and when it failed. A committed file's rows are in its sink's
//!   `committed` — the numbers a reader of that format's files finds on disk.
//!
//! `events` lists the files of the events table (`_ringscope_events/`: what was lost, when and why), each with its
//! events and rows lost; over all of them, rows lost per (hookpoint, reason) equal the accounting's dropped rows.
//!
//! `metadata` holds what the session was told to keep for readers ([`Session::set_metadata`](crate::Session::set_metadata)):
//! `attach` and the engine plugins put the per-layer attention parameters there as `attention`.
//!
//! A manifest that cannot be written leaves nothing behind (its temporary file is removed). On object storage it is
//! one `PUT`, after every data and events object of the rank is complete: a reader that finds the manifest finds a
//! whole run (rank).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::SystemTime;

use ringscope_hookpoint::Registry;
use ringscope_policy::DropReason;
use serde_json::{json, Value};

use crate::Report;

/// File name of the manifest inside a run directory (rank 0's; see [`file_name`]).
pub const MANIFEST: &str = "_ringscope_run.json";

/// The manifest's file name for `export.rank = rank`: [`MANIFEST`] for rank 0, `_ringscope_run.rank=<rank>.json`
/// for the others, so that the ranks of one run (tensor-parallel workers, each with its own session) writing the same
/// run directory do not overwrite each other's manifests. Readers merge every `_ringscope_run*.json` of a run.
pub fn file_name(rank: u32) -> String {
    if rank == 0 {
        MANIFEST.to_owned()
    } else {
        format!("_ringscope_run.rank={rank}.json")
    }
}

fn tally(t: ringscope_policy::Tally) -> Value {
    json!({ "records": t.records, "rows": t.rows })
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Per sink: records it took, its errors, when it failed, and what it committed per hookpoint. A sink split over
/// `export.threads` workers appears once, with its workers' numbers summed.
fn sinks(report: &Report) -> Vec<Value> {
    let mut names: Vec<&str> = Vec::new();
    for s in &report.drain.sinks {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    names
        .into_iter()
        .map(|name| {
            let workers = report.drain.sinks.iter().filter(|s| s.name == name);
            let records: u64 = workers.clone().map(|s| s.records).sum();
            let errors: Vec<&String> = workers.flat_map(|s| &s.errors).collect();
            let first_failure = report.sink_failures.iter().find(|f| f.sink == name);
            let mut committed: BTreeMap<&str, (u64, u64, u64)> = BTreeMap::new();
            for f in report.files.iter().filter(|f| f.sink == name) {
                let c = committed.entry(&f.hookpoint).or_default();
                (c.0, c.1, c.2) = (c.0 + 1, c.1 + f.rows, c.2 + f.bytes);
            }
            json!({
                "name": name,
                "records_taken": records,
                "failed": first_failure.is_some() || !errors.is_empty(),
                "failed_at_unix_ms": first_failure.map(|f| unix_ms(f.at)),
                "errors": errors,
                "committed": committed
                    .into_iter()
                    .map(|(hp, (files, rows, bytes))| (hp.to_owned(), json!({ "files": files, "rows": rows, "bytes": bytes })))
                    .collect::<serde_json::Map<_, _>>(),
            })
        })
        .collect()
}

/// Writes the manifest of `report` into `run_dir` atomically: a temporary file, synced, renamed into place. On
/// failure the temporary file is removed, so a run whose manifest could not be written leaves no hidden debris.
pub(crate) fn write(
    run_dir: &Path,
    rank: u32,
    storage: Option<&ringscope_exporter::ObjectStorage>,
    registry: &Registry,
    report: &Report,
    metadata: &BTreeMap<String, Value>,
) -> std::io::Result<()> {
    let hookpoints: Vec<Value> = registry
        .all()
        .iter()
        .map(|h| {
            let c = h.counters().snapshot();
            json!({
                "name": h.spec().name,
                "site": h.spec().site.name(),
                "layer": h.spec().layer,
                "dtype": h.spec().dtype.name(),
                "row_width": h.spec().row_width,
                "accounting": {
                    "produced": tally(c.produced),
                    "exported": tally(c.exported),
                    "sampled_out": tally(c.sampled_out),
                    // Of `exported`, the records whose rows were downcast on capture (not an outcome of its own).
                    "downcast": tally(c.downcast),
                    "dropped": DropReason::ALL.iter().map(|r| (r.name().to_owned(), tally(c.dropped_for(*r)))).collect::<serde_json::Map<_, _>>(),
                },
            })
        })
        .collect();
    let files: Vec<Value> = report
        .files
        .iter()
        .map(|f| {
            let rel = f.path.strip_prefix(run_dir).unwrap_or(&f.path);
            json!({
                "path": rel.to_string_lossy(),
                "sink": f.sink,
                "hookpoint": f.hookpoint,
                "dtype": f.dtype.name(),
                "rows": f.rows,
                "bytes": f.bytes,
                "direct_io": f.direct_io,
            })
        })
        .collect();
    let events: Vec<Value> = report
        .events
        .iter()
        .map(|f| {
            let rel = f.path.strip_prefix(run_dir).unwrap_or(&f.path);
            json!({ "path": rel.to_string_lossy(), "events": f.events, "rows_lost": f.rows_lost, "bytes": f.bytes })
        })
        .collect();
    let manifest = json!({
        "format_version": ringscope_ring::record::FORMAT_VERSION,
        "run_id": run_dir.file_name().map(|n| n.to_string_lossy().into_owned()),
        "rank": rank,
        "hookpoints": hookpoints,
        "files": files,
        "events": events,
        "sinks": sinks(report),
        "drain": {
            "records": report.drain.records,
            "rows": report.drain.rows,
            "data_bytes": report.drain.data_bytes,
            "seconds": report.drain.elapsed.as_secs_f64(),
        },
        "errors": report.drain.errors,
        // What readers need that the rows do not say (Session::set_metadata), e.g. `attention`.
        "metadata": metadata,
    });
    let name = file_name(rank);
    let text = serde_json::to_string_pretty(&manifest).expect("plain JSON values");
    if let Some(storage) = storage {
        // One PUT: the object is there, whole, or not at all; written after every data and events object.
        return storage.put(&run_dir.join(&name), text.into()).map(drop);
    }
    let tmp = run_dir.join(format!(".{name}.inprogress"));
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, run_dir.join(&name)));
    if written.is_err() {
        // A truncated hidden file would only mislead (and hold space on a full disk).
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
