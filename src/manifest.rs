//! The run manifest: `_ringscope_run.json` in a run directory, written at shutdown after every file is committed.
//!
//! It names the hookpoints, the files, and the final per-hookpoint accounting. The leading `_` keeps dataset
//! readers (pyarrow, DuckDB and Polars globs on `*.parquet`) from mistaking it for data.

use std::path::Path;

use ringscope_hookpoint::Registry;
use ringscope_policy::DropReason;
use serde_json::{json, Value};

use crate::{Error, Report};

/// File name of the manifest inside a run directory.
pub const MANIFEST: &str = "_ringscope_run.json";

fn tally(t: ringscope_policy::Tally) -> Value {
    json!({ "records": t.records, "rows": t.rows })
}

/// Writes the manifest of `report` into `run_dir` (atomically: a temporary file renamed into place).
pub(crate) fn write(run_dir: &Path, registry: &Registry, report: &Report) -> Result<(), Error> {
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
                "hookpoint": f.hookpoint,
                "rows": f.rows,
                "bytes": f.bytes,
                "direct_io": f.direct_io,
            })
        })
        .collect();
    let manifest = json!({
        "format_version": ringscope_ring::record::FORMAT_VERSION,
        "run_id": run_dir.file_name().map(|n| n.to_string_lossy().into_owned()),
        "hookpoints": hookpoints,
        "files": files,
        "drain": {
            "records": report.drain.records,
            "rows": report.drain.rows,
            "data_bytes": report.drain.data_bytes,
            "seconds": report.drain.elapsed.as_secs_f64(),
        },
        "errors": report.drain.errors,
    });
    let tmp = run_dir.join(format!(".{MANIFEST}.inprogress"));
    let text = serde_json::to_string_pretty(&manifest).expect("plain JSON values");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, run_dir.join(MANIFEST)))
        .map_err(|source| Error::Manifest { dir: run_dir.to_owned(), source })
}
