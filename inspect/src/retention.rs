//! `inspect retention`: ProbeX's calibration retention of a probe, computed over dumps.
//!
//! For each output `k` of a probe with weights `w_k`, and two calibration groups of requests `a` and `b` (e.g. prompts
//! with and without the concept), the **alignment** is `cos(w_k, μ_a − μ_b)`, the means taken over the rows the run
//! captured of those requests at the probe's hookpoint; the **retention** is the run's alignment divided by a
//! reference run's on the same requests (`ringscope_probe::retention`, which does the arithmetic: f64 means of the
//! f32-decoded rows, rows with a non-finite element skipped). The rows are read with `inspect`'s own reader
//! ([`super::open_file`]): Parquet or Arrow IPC, bf16 / f16 / f32 rows and the `f8e4m3_rowscaled` series of rows
//! downcast on capture (dequantized).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use arrow::array::{Array, FixedSizeBinaryArray, UInt32Array, UInt64Array};
use ringscope_probe::retention::{retention, Groups, Retention};
use ringscope_probe::{load_weights, row_to_f32, Weights};
use ringscope_ring::DType;
use serde_json::{json, Value};

use super::{data_files, open_file, read_manifests};

/// Exit status when at least one output is below `--min`.
const EXIT_FLAGGED: u8 = 3;
/// Exit status when a data file of a run cannot be read.
const EXIT_UNREADABLE: u8 = 1;
/// Exit status for bad input (also clap's for a malformed command line).
const EXIT_BAD_INPUT: u8 = 2;

const ABOUT: &str = "Calibration retention of a probe (ProbeX): cos(w, μ_a − μ_b) over two calibration groups of a \
                     run, normalised by a reference run";

const LONG_ABOUT: &str = "\
Calibration retention of a probe (ProbeX).

For each probe output k (weights w_k), the alignment is cos(w_k, μ_a − μ_b): μ_a and μ_b are the means of the \
activations the run captured at --hookpoint for the requests of --group-a and --group-b (e.g. calibration prompts \
with and without the concept the probe reads). The retention is the run's alignment divided by the alignment in \
--reference (e.g. the bf16 model's run on the same prompts, under the same request ids). A retention near 1: the \
probe's direction still separates the groups as it did; near 0 (or negative): the representation it reads is gone \
in this run (e.g. broken by quantization). No labels are needed at serving time.

Rows: by default every row of the groups' requests at the hookpoint (prompt and generated tokens); --last-token uses \
only each request's highest captured position, what a last-token probe reads. Rows with a NaN or infinite element \
are skipped (and counted). Rows downcast on capture (the _f8e4m3_rowscaled series) are dequantized and used. Rows \
the run dropped or sampled out are not in the dump: the means are over the rows captured (a note says so when the \
manifest counts any).";

const AFTER_HELP: &str = "\
Groups (--group-a, --group-b): request ids, comma-separated ids and inclusive ranges (`0-49,60,70-79`), or \
@FILE: a file with one id or range per line (blank lines and lines starting with # are ignored). The two groups \
must not share an id; the same ids select the groups in the reference run.

Threshold (--min): an output is flagged (FLAG) when its retention is below the threshold or not a number; without \
--reference its alignment is compared instead. Without --min nothing is flagged.

Sinks: a run with both Parquet and Arrow IPC files is read from its Parquet files unless --sink says otherwise \
(each sink holds a copy of the same rows). Every rank's files are read unless --rank picks one.

JSON (--json): one object; NaN (and a value without a reference) is null.

Exit status: 0 no output flagged; 1 a data file could not be read; 2 bad input (a malformed argument, not a run \
directory, an unknown hookpoint, weights whose width is not the hookpoint's row width, non-finite weights, rows the \
probe cannot read, a group with no rows at the hookpoint); 3 at least one output is below --min.";

/// `inspect retention`'s arguments.
#[derive(clap::Args)]
#[command(about = ABOUT, long_about = LONG_ABOUT, after_help = AFTER_HELP)]
pub struct RetentionArgs {
    /// The run directory to check (e.g. the quantized model's dump).
    run_dir: PathBuf,
    /// The probe's weights: a .safetensors file (the tensor --tensor names) or a .npy file, of shape [K, d] or [d];
    /// f32, f16, bf16 or f64. A bias is ignored (retention reads only the direction).
    #[arg(long, value_name = "FILE")]
    weights: PathBuf,
    /// The weights' tensor in a safetensors file.
    #[arg(long, value_name = "NAME", default_value = "weight")]
    tensor: String,
    /// The hookpoint the probe reads (e.g. layers.12.residual).
    #[arg(long)]
    hookpoint: String,
    /// Calibration group a: request ids (`0-49,60`) or @FILE.
    #[arg(long, value_name = "IDS", value_parser = parse_ids)]
    group_a: Ids,
    /// Calibration group b: request ids (`50-99`) or @FILE.
    #[arg(long, value_name = "IDS", value_parser = parse_ids)]
    group_b: Ids,
    /// The reference run directory (e.g. the bf16 model's dump of the same calibration requests).
    #[arg(long, value_name = "REF_RUN_DIR")]
    reference: Option<PathBuf>,
    /// Flag outputs whose retention (alignment without --reference) is below this, or not a number; exit status 3.
    #[arg(long, value_name = "THRESHOLD", value_parser = parse_threshold)]
    min: Option<f64>,
    /// Use only each request's highest captured position (what a last-token probe reads), not every row.
    #[arg(long)]
    last_token: bool,
    /// Read this sink's files (default: parquet when the run has Parquet files of the hookpoint, else arrow_ipc).
    #[arg(long, value_enum)]
    sink: Option<SinkKind>,
    /// Read only this rank's files (default: every rank's).
    #[arg(long)]
    rank: Option<u32>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Which file sink's copy of the rows to read.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, clap::ValueEnum)]
enum SinkKind {
    Parquet,
    #[value(name = "arrow_ipc", alias = "arrow-ipc")]
    ArrowIpc,
}

impl SinkKind {
    fn name(self) -> &'static str {
        match self {
            SinkKind::Parquet => "parquet",
            SinkKind::ArrowIpc => "arrow_ipc",
        }
    }
}

/// A set of request ids as sorted, disjoint, inclusive ranges (a range of a billion ids costs nothing).
#[derive(Clone, Debug, PartialEq)]
pub struct Ids {
    ranges: Vec<(u64, u64)>,
    /// As given, for messages.
    text: String,
}

impl Ids {
    fn contains(&self, id: u64) -> bool {
        let i = self.ranges.partition_point(|&(_, hi)| hi < id);
        self.ranges.get(i).is_some_and(|&(lo, _)| lo <= id)
    }

    /// How many ids (saturating).
    fn count(&self) -> u64 {
        self.ranges.iter().fold(0u64, |n, &(lo, hi)| n.saturating_add(hi - lo).saturating_add(1))
    }

    /// An id in both sets, if any.
    fn common(&self, other: &Ids) -> Option<u64> {
        let (mut i, mut j) = (0, 0);
        while let (Some(&(a0, a1)), Some(&(b0, b1))) = (self.ranges.get(i), other.ranges.get(j)) {
            if a0.max(b0) <= a1.min(b1) {
                return Some(a0.max(b0));
            }
            if a1 < b1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        None
    }
}

/// Request ids: `0-49,60,70-79`, or `@FILE` with one id or range (or a comma-separated list) per line.
fn parse_ids(text: &str) -> Result<Ids, String> {
    let body = match text.strip_prefix('@') {
        Some(file) => {
            let content = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
            content
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join(",")
        }
        None => text.to_owned(),
    };
    let id = |s: &str| -> Result<u64, String> {
        s.trim().parse::<u64>().map_err(|_| format!("`{}` is not a request id (an unsigned 64-bit integer)", s.trim()))
    };
    let mut ranges = Vec::new();
    for item in body.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(format!("an empty item in `{body}`: give ids and ranges like 0-49,60"));
        }
        let (lo, hi) = match item.split_once('-') {
            Some((lo, hi)) => (id(lo)?, id(hi)?),
            None => (id(item)?, id(item)?),
        };
        if lo > hi {
            return Err(format!("the range {item} is empty (its start is past its end)"));
        }
        ranges.push((lo, hi));
    }
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match merged.last_mut() {
            Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    Ok(Ids { ranges: merged, text: text.to_owned() })
}

fn parse_threshold(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("`{text}` is not a finite number")),
    }
}

/// Why retention could not be computed.
enum Failure {
    /// Bad input: exit status 2.
    BadInput(String),
    /// A data file could not be read: exit status 1.
    Unreadable(String),
}

/// One run's two groups at the hookpoint, and what was read.
struct Side {
    dir: PathBuf,
    sink: SinkKind,
    ranks: BTreeSet<u32>,
    files: usize,
    groups: Groups,
    requests: [usize; 2],
    /// Rows with a non-finite element, per group (not in the means).
    skipped: [u64; 2],
    /// (produced, exported) rows of the hookpoint, from the manifest; None without one.
    accounting: Option<(u64, u64)>,
    manifest: bool,
}

impl Side {
    fn rows(&self) -> [u64; 2] {
        [self.groups.a.rows(), self.groups.b.rows()]
    }

    fn json(&self, ids: [&Ids; 2]) -> Value {
        let [rows_a, rows_b] = self.rows();
        json!({
            "dir": self.dir.display().to_string(),
            "sink": self.sink.name(),
            "ranks": self.ranks,
            "files": self.files,
            "ids_a": ids[0].count(),
            "ids_b": ids[1].count(),
            "requests_a": self.requests[0],
            "requests_b": self.requests[1],
            "rows_a": rows_a,
            "rows_b": rows_b,
            "skipped_rows_a": self.skipped[0],
            "skipped_rows_b": self.skipped[1],
            "manifest": self.manifest,
            "produced_rows": self.accounting.map(|a| a.0),
            "exported_rows": self.accounting.map(|a| a.1),
        })
    }
}

/// Runs `inspect retention`.
pub fn run(args: RetentionArgs) -> ExitCode {
    match compute(&args) {
        Ok(code) => code,
        Err(Failure::BadInput(m)) => {
            eprintln!("inspect retention: {m}");
            ExitCode::from(EXIT_BAD_INPUT)
        }
        Err(Failure::Unreadable(m)) => {
            eprintln!("inspect retention: PROBLEM: {m}");
            ExitCode::from(EXIT_UNREADABLE)
        }
    }
}

fn compute(args: &RetentionArgs) -> Result<ExitCode, Failure> {
    if let Some(id) = args.group_a.common(&args.group_b) {
        return Err(Failure::BadInput(format!(
            "request {id} is in both --group-a ({}) and --group-b ({}): the groups must be disjoint",
            args.group_a.text, args.group_b.text
        )));
    }
    let probe = args.weights.file_stem().map_or("weights".into(), |s| s.to_string_lossy().into_owned());
    let (weights, _bias) = load_weights(&probe, &args.weights, Some(&args.tensor))
        .map_err(|e| Failure::BadInput(format!("--weights: {e}")))?;
    if let Some(i) = weights.values().iter().position(|w| !w.is_finite()) {
        return Err(Failure::BadInput(format!(
            "--weights {}: weight [{}, {}] is {} (weights must be finite)",
            args.weights.display(),
            i / weights.width(),
            i % weights.width(),
            weights.values()[i]
        )));
    }
    let ids = [&args.group_a, &args.group_b];
    let run = read_side(args, &args.run_dir, "", &weights)?;
    let reference =
        args.reference.as_deref().map(|r| read_side(args, r, "the reference run ", &weights)).transpose()?;
    let results = retention(&weights, &run.groups, reference.as_ref().map(|r| &r.groups));
    let flagged = |r: &Retention| args.min.is_some_and(|m| r.below(m));
    let n_flagged = results.iter().filter(|r| flagged(r)).count();
    let (run_rows, ref_rows) = (run.rows(), reference.as_ref().map(Side::rows));

    if args.json {
        let number = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
        let outputs: Vec<Value> = results
            .iter()
            .map(|r| {
                json!({
                    "output": r.output,
                    "rows_a": run_rows[0],
                    "rows_b": run_rows[1],
                    "alignment": number(r.alignment),
                    "reference_rows_a": ref_rows.map(|x| x[0]),
                    "reference_rows_b": ref_rows.map(|x| x[1]),
                    "reference_alignment": r.reference_alignment.map(number),
                    "retention": r.retention.map(number),
                    "flagged": flagged(r),
                })
            })
            .collect();
        let out = json!({
            "hookpoint": args.hookpoint,
            "weights": args.weights.display().to_string(),
            "tensor": args.tensor,
            "outputs_k": weights.outputs(),
            "width": weights.width(),
            "group_a": args.group_a.text,
            "group_b": args.group_b.text,
            "last_token": args.last_token,
            "min": args.min,
            "run": run.json(ids),
            "reference": reference.as_ref().map(|r| r.json(ids)),
            "outputs": outputs,
            "flagged": n_flagged,
        });
        println!("{}", serde_json::to_string_pretty(&out).expect("JSON of plain values"));
    } else {
        println!(
            "calibration retention of {} ({} × {}) at {}, {}",
            args.weights.display(),
            weights.outputs(),
            weights.width(),
            args.hookpoint,
            if args.last_token { "each request's last captured row" } else { "every captured row of each request" }
        );
        print_side("run", &run, ids);
        if let Some(r) = &reference {
            print_side("reference", r, ids);
        }
        println!(
            "{:>6} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10}  flag",
            "output", "rows_a", "rows_b", "alignment", "ref_rows_a", "ref_rows_b", "ref_align", "retention"
        );
        let opt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.4}"));
        for r in &results {
            println!(
                "{:>6} {:>9} {:>9} {:>10.4} {:>10} {:>10} {:>10} {:>10}  {}",
                r.output,
                run_rows[0],
                run_rows[1],
                r.alignment,
                ref_rows.map_or("-".into(), |x| x[0].to_string()),
                ref_rows.map_or("-".into(), |x| x[1].to_string()),
                opt(r.reference_alignment),
                opt(r.retention),
                match args.min {
                    None => "-",
                    Some(_) if flagged(r) => "FLAG",
                    Some(_) => "ok",
                }
            );
        }
        let what = if reference.is_some() { "retention" } else { "alignment (no --reference)" };
        match args.min {
            None => println!("no --min: nothing flagged"),
            Some(m) if n_flagged > 0 => {
                println!("FLAGGED: {n_flagged} of {} outputs with {what} below {m} (or not a number)", results.len())
            }
            Some(m) => println!("ok: every output's {what} is at least {m}"),
        }
    }
    Ok(if n_flagged > 0 { ExitCode::from(EXIT_FLAGGED) } else { ExitCode::SUCCESS })
}

fn print_side(label: &str, side: &Side, ids: [&Ids; 2]) {
    let [rows_a, rows_b] = side.rows();
    let ranks: Vec<String> = side.ranks.iter().map(u32::to_string).collect();
    println!(
        "{label} {}: {} file{} ({}, rank {}); group a: {} of {} requests, {rows_a} rows; group b: {} of {} \
         requests, {rows_b} rows",
        side.dir.display(),
        side.files,
        if side.files == 1 { "" } else { "s" },
        side.sink.name(),
        ranks.join(","),
        side.requests[0],
        ids[0].count(),
        side.requests[1],
        ids[1].count(),
    );
    if side.skipped != [0, 0] {
        println!(
            "  note: rows with a NaN or infinite element skipped: {} in group a, {} in group b",
            side.skipped[0], side.skipped[1]
        );
    }
    match side.accounting {
        Some((produced, exported)) if produced > exported => println!(
            "  note: the manifest counts {produced} rows produced at this hookpoint, {exported} exported: rows \
             dropped or sampled out are not in the means"
        ),
        Some(_) => {}
        None if !side.manifest => {
            println!("  note: no manifest (an interrupted run): the committed files are read, what was lost is unknown")
        }
        None => {}
    }
}

/// The parts of a data file's path inside the run: (sink, hookpoint, rank), from
/// `hookpoint=<name>/rank=<r>/...` (Parquet) or `_arrow_ipc/hookpoint=<name>/rank=<r>/...` (Arrow IPC).
fn partition_of(path: &Path, run_dir: &Path) -> Option<(SinkKind, String, u32)> {
    let rel = path.strip_prefix(run_dir).ok()?;
    let mut parts = rel.components().map(|c| c.as_os_str().to_str());
    let mut first = parts.next()??;
    let sink = if first == "_arrow_ipc" {
        first = parts.next()??;
        SinkKind::ArrowIpc
    } else {
        SinkKind::Parquet
    };
    let hookpoint = first.strip_prefix("hookpoint=")?.to_owned();
    let rank = parts.next()??.strip_prefix("rank=")?.parse().ok()?;
    let expected = if sink == SinkKind::ArrowIpc { "arrow" } else { "parquet" };
    path.extension().is_some_and(|e| e == expected).then_some((sink, hookpoint, rank))
}

/// Reads one run's calibration groups at the hookpoint. `which` prefixes messages ("the reference run ").
fn read_side(args: &RetentionArgs, dir: &Path, which: &str, weights: &Weights) -> Result<Side, Failure> {
    if !dir.is_dir() {
        return Err(Failure::BadInput(format!("{which}{} is not a directory: give a run directory", dir.display())));
    }
    let files = data_files(dir).map_err(|e| Failure::BadInput(format!("cannot list {}: {e}", dir.display())))?;
    let mut by_hookpoint: BTreeMap<String, Vec<(SinkKind, u32, PathBuf)>> = BTreeMap::new();
    for f in files {
        if let Some((sink, hookpoint, rank)) = partition_of(&f, dir) {
            by_hookpoint.entry(hookpoint).or_default().push((sink, rank, f));
        }
    }
    if by_hookpoint.is_empty() {
        let runs: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                std::fs::read_dir(p).into_iter().flatten().any(|e| {
                    e.is_ok_and(|e| {
                        let name = e.file_name();
                        let name = name.to_string_lossy();
                        name.starts_with("hookpoint=") || name == "_arrow_ipc"
                    })
                })
            })
            .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
            .collect();
        if !runs.is_empty() {
            return Err(Failure::BadInput(format!(
                "{which}{} is not a run directory but holds runs ({}): give one",
                dir.display(),
                runs.join(", ")
            )));
        }
        return Err(Failure::BadInput(format!(
            "{which}{} holds no committed data files (hookpoint=*/rank=*/part-*.parquet or .arrow): not a run \
             directory, or a run that committed nothing",
            dir.display()
        )));
    }
    let Some(all) = by_hookpoint.get(&args.hookpoint) else {
        let names: Vec<&str> = by_hookpoint.keys().map(String::as_str).collect();
        return Err(Failure::BadInput(format!(
            "hookpoint `{}` is not in {which}{}: it has {}",
            args.hookpoint,
            dir.display(),
            names.join(", ")
        )));
    };
    let sinks: BTreeSet<SinkKind> = all.iter().map(|(s, _, _)| *s).collect();
    let sink = match args.sink {
        Some(s) if !sinks.contains(&s) => {
            let have: Vec<&str> = sinks.iter().map(|s| s.name()).collect();
            return Err(Failure::BadInput(format!(
                "{which}{} has no {} files of hookpoint {} (it has {})",
                dir.display(),
                s.name(),
                args.hookpoint,
                have.join(", ")
            )));
        }
        Some(s) => s,
        None => *sinks.iter().next().expect("a hookpoint listed has files"),
    };
    let ranks: BTreeSet<u32> = all.iter().filter(|(s, _, _)| *s == sink).map(|(_, r, _)| *r).collect();
    if let Some(r) = args.rank.filter(|r| !ranks.contains(r)) {
        let have: Vec<String> = ranks.iter().map(u32::to_string).collect();
        return Err(Failure::BadInput(format!(
            "{which}{} has no files of rank {r} for hookpoint {} (ranks: {})",
            dir.display(),
            args.hookpoint,
            have.join(", ")
        )));
    }
    let chosen: Vec<&PathBuf> = all
        .iter()
        .filter(|(s, r, _)| *s == sink && args.rank.is_none_or(|want| want == *r))
        .map(|(_, _, p)| p)
        .collect();
    let groups_ids = [&args.group_a, &args.group_b];
    let width = weights.width();
    let mut groups = Groups::new(width);
    let mut seen: [HashSet<u64>; 2] = Default::default();
    // --last-token: each request's highest position so far, its group and its row.
    let mut last: HashMap<u64, (u32, usize, Vec<f32>)> = HashMap::new();
    let mut skipped = [0u64; 2];
    for path in &chosen {
        let unreadable = |e: String| Failure::Unreadable(format!("{}: unreadable: {e}", path.display()));
        let (kv, batches) =
            open_file(path, |name| matches!(name, "request_id" | "position" | "activation")).map_err(unreadable)?;
        let get = |k: &str| kv.get(k).cloned().ok_or_else(|| unreadable(format!("metadata key {k} missing")));
        let dtype = get("ringscope.dtype")?.parse::<DType>().map_err(|e| unreadable(e.to_string()))?;
        let shape: Vec<u64> = serde_json::from_str(&get("ringscope.shape")?).map_err(|e| unreadable(e.to_string()))?;
        let row_width = shape.iter().product::<u64>();
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F8E4M3RowScaled) {
            return Err(Failure::BadInput(format!(
                "hookpoint {} holds rows of dtype {}: retention reads f32, f16, bf16 and f8e4m3_rowscaled rows",
                args.hookpoint,
                dtype.name()
            )));
        }
        if row_width != width as u64 {
            return Err(Failure::BadInput(format!(
                "--weights {} is {} × {width} but rows of hookpoint {} in {which}{} have {row_width} elements: the \
                 probe does not read this hookpoint",
                args.weights.display(),
                weights.outputs(),
                args.hookpoint,
                dir.display()
            )));
        }
        let row_bytes = dtype.row_bytes(row_width) as usize;
        for b in &batches {
            let column =
                |name: &str| b.column_by_name(name).ok_or_else(|| unreadable(format!("column {name} missing")));
            let req = column("request_id")?;
            let req = req.as_any().downcast_ref::<UInt64Array>().ok_or_else(|| unreadable("request_id".into()))?;
            let pos = column("position")?;
            let pos = pos.as_any().downcast_ref::<UInt32Array>().ok_or_else(|| unreadable("position".into()))?;
            let act = column("activation")?;
            let act = act
                .as_any()
                .downcast_ref::<FixedSizeBinaryArray>()
                .filter(|a| a.value_length() as usize == row_bytes && a.null_count() == 0)
                .ok_or_else(|| unreadable(format!("activation is not fixed-size binary of {row_bytes} bytes")))?;
            for i in 0..b.num_rows() {
                let id = req.value(i);
                let g = match groups_ids.iter().position(|ids| ids.contains(id)) {
                    Some(g) => g,
                    None => continue,
                };
                seen[g].insert(id);
                let row = act.value(i);
                if args.last_token {
                    let p = pos.value(i);
                    if last.get(&id).is_none_or(|(q, _, _)| p > *q) {
                        let mut x = vec![0.0f32; width];
                        row_to_f32(dtype, row, &mut x);
                        last.insert(id, (p, g, x));
                    }
                } else {
                    let acc = if g == 0 { &mut groups.a } else { &mut groups.b };
                    let before = acc.skipped();
                    acc.add_bytes(dtype, row);
                    skipped[g] += acc.skipped() - before;
                }
            }
        }
    }
    if args.last_token {
        let mut rows: Vec<_> = last.into_iter().collect();
        rows.sort_unstable_by_key(|(id, _)| *id);
        for (_, (_, g, x)) in rows {
            let acc = if g == 0 { &mut groups.a } else { &mut groups.b };
            let before = acc.skipped();
            acc.add(&x);
            skipped[g] += acc.skipped() - before;
        }
    }
    for (g, name) in [(0, "a"), (1, "b")] {
        if seen[g].is_empty() {
            return Err(Failure::BadInput(format!(
                "group {name} (--group-{name} {}) has no rows at hookpoint {} in {which}{}: none of its {} request \
                 ids was captured there{}",
                groups_ids[g].text,
                args.hookpoint,
                dir.display(),
                groups_ids[g].count(),
                if args.rank.is_some() { " (in the --rank chosen)" } else { "" }
            )));
        }
    }
    // Every rank's manifest, merged (an unreadable one: no accounting to report).
    let manifest: Option<Value> = read_manifests(dir).ok().flatten();
    let accounting = manifest.as_ref().and_then(|m| {
        let h = m["hookpoints"].as_array()?.iter().find(|h| h["name"] == args.hookpoint.as_str())?;
        let acc = &h["accounting"];
        Some((acc["produced"]["rows"].as_u64()?, acc["exported"]["rows"].as_u64()?))
    });
    Ok(Side {
        dir: dir.to_path_buf(),
        sink,
        ranks: if let Some(r) = args.rank { BTreeSet::from([r]) } else { ranks },
        files: chosen.len(),
        groups,
        requests: [seen[0].len(), seen[1].len()],
        skipped,
        accounting,
        manifest: manifest.is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_merge_and_intersect() {
        let a = parse_ids("5, 0-3,4,10-12").unwrap();
        assert_eq!(a.ranges, vec![(0, 5), (10, 12)]);
        assert_eq!(a.count(), 9);
        assert!(a.contains(0) && a.contains(5) && a.contains(11) && !a.contains(6) && !a.contains(13));
        let b = parse_ids("6-9,13").unwrap();
        assert_eq!(a.common(&b), None);
        assert_eq!(a.common(&parse_ids("12-20").unwrap()), Some(12));
        assert_eq!(parse_ids("0-18446744073709551615").unwrap().count(), u64::MAX);
        for bad in ["", "1,,2", "x", "3-1", "-1", "1-", "18446744073709551616"] {
            assert!(parse_ids(bad).is_err(), "{bad:?}");
        }
        let file = std::env::temp_dir().join(format!("ringscope-ids-{}", std::process::id()));
        std::fs::write(&file, "# group a\n1\n\n2-3\n 7 \n").unwrap();
        let f = parse_ids(&format!("@{}", file.display())).unwrap();
        assert_eq!(f.ranges, vec![(1, 3), (7, 7)]);
        std::fs::remove_file(&file).unwrap();
        assert!(parse_ids("@/nonexistent/ids.txt").unwrap_err().contains("cannot read"));
    }
}
