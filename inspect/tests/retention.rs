//! `inspect retention` on constructed dumps where the expected calibration retention is known.
//!
//! Every run captures, at a bf16 hookpoint of width 32, rows `x = base + noise + sign · S · v` for requests 0..100:
//! `sign = +1` for group a (requests 0..50), `−1` for group b (50..100), `S = 4`, `base` a fixed offset shared by both
//! groups, `noise` uniform in [−0.5, 0.5) per element (independent per run), `v` the run's concept direction (unit).
//! So `μ_a − μ_b = 2S · v + (noise difference)`. The probe has two outputs, `w0 = e0` and `w1 = (e0 + e2)/√2`.
//!
//! * the reference run: `v = e0` — alignments cos(w0, e0) = 1 and cos(w1, e0) = 1/√2;
//! * the "quantized" run: the concept rotated by θ = 60° toward e1, `v = cos θ · e0 + sin θ · e1` — alignments 0.5
//!   and 0.5/√2, so both outputs' retention is cos θ = 0.5;
//! * the "broken" run: the concept moved to e3, orthogonal to both outputs — retention 0, flagged (exit status 3);
//! * the reference's activations downcast on capture to `f8e4m3_rowscaled` — retention 1 within E4M3's error.
//!
//! Two checks per number. **Exact**: the CLI's alignment equals the test's own f64 computation over the bf16 rows it
//! captured (to 1e-9: only the order of the f64 sums differs), so inspect read exactly these rows. **Known value**:
//! the retention is within 0.02 of its expected value. Why 0.02: each group mean holds ≥ 149 rows, so each coordinate
//! of the noise difference has σ = (1/√12)·√(2/149) ≈ 0.033 against a signal of 2S = 8 — 0.0042 of it; the retention
//! (a ratio of two alignments) then has σ ≲ √2 · 0.0042 ≈ 0.006, and 0.02 is over 3σ even for the worst output (the
//! 45° one, where both numerator and denominator carry noise); bf16 rounding (spacing ≤ 2⁻⁵ here) averages out to
//! ~1e-3. The noise is a fixed hash, so the numbers are deterministic; the tolerance says why they are not a lucky
//! seed. With `--last-token` (50 rows a group) σ grows by √3, and the tolerance is 0.04.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ringscope::{Config, Session};
use serde_json::Value;

const D: usize = 32;
const HP: &str = "layers.12.residual";
const OTHER: &str = "layers.3.residual";
const REQUESTS: u64 = 100;
const S: f32 = 4.0;
const GROUP_A: &str = "0-49";
const GROUP_B: &str = "50-99";

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Request `r`'s length in tokens: 2, 3 or 4, so that "its last token" differs between requests.
fn len(r: u64) -> u32 {
    2 + (r % 3) as u32
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in [−0.5, 0.5), a hash of (seed, request, position, element).
fn noise(seed: u64, r: u64, p: u32, j: usize) -> f32 {
    let h = mix64(mix64(mix64(seed) ^ r) ^ ((p as u64) << 32 | j as u64));
    (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16 // round to nearest even (no NaN here)
}

fn from_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

fn unit(v: &[f32]) -> Vec<f32> {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / n).collect()
}

fn axis(i: usize) -> Vec<f32> {
    (0..D).map(|j| if j == i { 1.0 } else { 0.0 }).collect()
}

/// The probe: `w0 = e0`, `w1 = (e0 + e2)/√2`.
fn probe_weights() -> Vec<Vec<f32>> {
    vec![axis(0), unit(&(0..D).map(|j| if j == 0 || j == 2 { 1.0 } else { 0.0 }).collect::<Vec<_>>())]
}

/// The bf16 rows a run captured at `HP`, by (request, position).
type Rows = BTreeMap<(u64, u32), Vec<u16>>;

/// Dumps a run `root/run_id` (Parquet and Arrow IPC) whose `HP` rows carry `concept`; with `downcast`, they are
/// downcast on capture. `OTHER` (width 16) is captured too, so the run has two hookpoints.
fn write_run(root: &Path, run_id: &str, seed: u64, concept: &[f32], downcast: bool) -> Rows {
    write_run_with_nan(root, run_id, seed, concept, downcast, &[])
}

/// [`write_run`], with element 5 of the rows of `nan` (request, position) NaN.
fn write_run_with_nan(
    root: &Path,
    run_id: &str,
    seed: u64,
    concept: &[f32],
    downcast: bool,
    nan: &[(u64, u32)],
) -> Rows {
    let text = format!(
        "[ring]\ncapacity = \"4 MiB\"\n[policy]\nmode = \"full\"\n[export]\nparquet = true\narrow_ipc = true\n\
         dir = {:?}\nrun_id = {run_id:?}\n\
         [[hookpoints]]\nname = \"{HP}\"\nsite = \"residual\"\nlayer = 12\ndtype = \"bf16\"\nrow_width = {D}\n\
         [[hookpoints]]\nname = \"{OTHER}\"\nsite = \"residual\"\nlayer = 3\ndtype = \"bf16\"\nrow_width = 16\n",
        root.display().to_string()
    );
    let session = Session::new(Config::from_toml(&text).unwrap()).unwrap();
    session.hookpoint(HP).unwrap().control().set_downcast(downcast).unwrap();
    let mut rows = Rows::new();
    for p in 0..4u32 {
        let batch: Vec<(u64, u32)> = (0..REQUESTS).filter(|&r| p < len(r)).map(|r| (r, p)).collect();
        session.begin_step(p as u64, batch.iter().copied()).unwrap();
        let mut bytes = Vec::new();
        for &(r, p) in &batch {
            let sign = if r < 50 { 1.0 } else { -1.0 };
            let mut row: Vec<u16> = (0..D)
                .map(|j| bf16_bits(1.0 + 0.05 * j as f32 + noise(seed, r, p, j) + sign * S * concept[j]))
                .collect();
            if nan.contains(&(r, p)) {
                row[5] = 0x7FC0; // a bf16 NaN
            }
            bytes.extend(row.iter().flat_map(|b| b.to_le_bytes()));
            rows.insert((r, p), row);
        }
        session.capture_by_name(HP, &bytes).unwrap();
        session.capture_by_name(OTHER, &vec![0x3f; batch.len() * 16 * 2]).unwrap();
        session.end_step().unwrap();
    }
    let report = session.shutdown().unwrap();
    assert!(report.sink_failures.is_empty());
    rows
}

/// cos(w, μ_a − μ_b) over `rows` (all, or each request's last), in f64: the test's own computation.
fn alignment(rows: &Rows, w: &[f32], last_token: bool) -> f64 {
    let mut sum = [[0.0f64; D]; 2];
    let mut n = [0usize; 2];
    for (&(r, p), row) in rows {
        if last_token && p + 1 != len(r) || row.iter().any(|&b| !from_bf16(b).is_finite()) {
            continue; // not the last token; a row with a NaN (skipped, as inspect does)
        }
        let g = usize::from(r >= 50);
        n[g] += 1;
        for j in 0..D {
            sum[g][j] += from_bf16(row[j]) as f64;
        }
    }
    let diff: Vec<f64> = (0..D).map(|j| sum[0][j] / n[0] as f64 - sum[1][j] / n[1] as f64).collect();
    let dot: f64 = (0..D).map(|j| w[j] as f64 * diff[j]).sum();
    let ww: f64 = w.iter().map(|&x| (x as f64) * (x as f64)).sum();
    let dd: f64 = diff.iter().map(|x| x * x).sum();
    dot / (ww.sqrt() * dd.sqrt())
}

/// A safetensors file holding `weight` (K × d, f32) and a `bias` (K).
fn write_safetensors(path: &Path, w: &[Vec<f32>]) {
    let (k, d) = (w.len(), w[0].len());
    let wbytes = k * d * 4;
    let mut header = format!(
        "{{\"weight\":{{\"dtype\":\"F32\",\"shape\":[{k},{d}],\"data_offsets\":[0,{wbytes}]}},\
         \"bias\":{{\"dtype\":\"F32\",\"shape\":[{k}],\"data_offsets\":[{wbytes},{}]}}}}",
        wbytes + k * 4
    );
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(w.iter().flatten().flat_map(|x| x.to_le_bytes()));
    out.extend((0..k).flat_map(|i| (i as f32 * 0.5).to_le_bytes()));
    std::fs::write(path, out).unwrap();
}

/// A `.npy` file (format 1.0, little-endian f32, C order) holding `w`.
fn write_npy(path: &Path, w: &[Vec<f32>]) {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}", w.len(), w[0].len());
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(w.iter().flatten().flat_map(|x| x.to_le_bytes()));
    std::fs::write(path, out).unwrap();
}

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("{e}: {}\n{}", self.stdout, self.stderr))
    }
}

fn inspect(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Out {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_inspect"))
        .arg("retention")
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap();
    Out {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `inspect retention RUN --weights W --hookpoint HP --group-a 0-49 --group-b 50-99 [more]`.
fn retention(run: &Path, weights: &Path, more: &[&str]) -> Out {
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
        vec![&run, &"--weights", &weights, &"--hookpoint", &HP, &"--group-a", &GROUP_A, &"--group-b", &GROUP_B];
    args.extend(more.iter().map(|m| m as &dyn AsRef<std::ffi::OsStr>));
    inspect(&args)
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn close(got: f64, want: f64, tol: f64, what: &str) {
    assert!((got - want).abs() <= tol, "{what}: {got} is not {want} ± {tol}");
}

struct Fixture {
    dir: PathBuf,
    rows: BTreeMap<&'static str, Rows>,
    weights: PathBuf,
}

impl Fixture {
    fn new(name: &str) -> Fixture {
        let dir = tempdir(name);
        let theta = 60f32.to_radians();
        let rotated: Vec<f32> = (0..D).map(|j| [theta.cos(), theta.sin()].get(j).copied().unwrap_or(0.0)).collect();
        let mut rows = BTreeMap::new();
        rows.insert("ref", write_run(&dir, "ref", 1, &axis(0), false));
        rows.insert("rot", write_run(&dir, "rot", 2, &rotated, false));
        rows.insert("gone", write_run(&dir, "gone", 3, &axis(3), false));
        // The reference's own activations, downcast on capture.
        rows.insert("fp8", write_run(&dir, "fp8", 1, &axis(0), true));
        let weights = dir.join("probe.safetensors");
        write_safetensors(&weights, &probe_weights());
        Fixture { dir, rows, weights }
    }

    fn run(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn retention_is_the_cosine_of_the_rotation_and_collapses_when_the_concept_is_gone() {
    let f = Fixture::new("retention");
    let w = probe_weights();
    let reference = f.run("ref");
    let r = reference.to_str().unwrap();
    // Rows per group: requests of length 2, 3, 4 in turn.
    let rows_in = |lo: u64, hi: u64| (lo..hi).map(|r| len(r) as u64).sum::<u64>();
    let (rows_a, rows_b) = (rows_in(0, 50), rows_in(50, 100));
    assert_eq!((rows_a, rows_b), (149, 150));

    // The reference against itself: alignments cos(w0, e0) = 1 and cos(w1, e0) = 1/√2; retention exactly 1.
    let out = retention(&reference, &f.weights, &["--reference", r, "--min", "0.9", "--json"]);
    assert_eq!(out.code, Some(0), "{}{}", out.stdout, out.stderr);
    let j = out.json();
    assert_eq!(j["outputs_k"], 2);
    assert_eq!(j["width"], D);
    assert_eq!(j["run"]["sink"], "parquet");
    assert_eq!((j["run"]["requests_a"].as_u64(), j["run"]["requests_b"].as_u64()), (Some(50), Some(50)));
    assert_eq!(j["run"]["produced_rows"], rows_a + rows_b);
    for (k, want) in [(0, 1.0), (1, std::f64::consts::FRAC_1_SQRT_2)] {
        let o = &j["outputs"][k];
        assert_eq!((o["rows_a"].as_u64(), o["rows_b"].as_u64()), (Some(rows_a), Some(rows_b)), "{o}");
        assert_eq!((o["reference_rows_a"].as_u64(), o["reference_rows_b"].as_u64()), (Some(rows_a), Some(rows_b)));
        close(num(&o["alignment"]), alignment(&f.rows["ref"], &w[k], false), 1e-9, "exact reference alignment");
        close(num(&o["alignment"]), want, 0.01, "reference alignment");
        close(num(&o["retention"]), 1.0, 1e-12, "a run against itself");
        assert_eq!(o["flagged"], false);
    }

    // Rotated by 60°: retention cos 60° = 0.5 for both outputs.
    let out = retention(&f.run("rot"), &f.weights, &["--reference", r, "--min", "0.9", "--json"]);
    assert_eq!(out.code, Some(3), "{}{}", out.stdout, out.stderr);
    let j = out.json();
    assert_eq!(j["flagged"], 2);
    for (k, want) in [(0, 0.5), (1, 0.5 * std::f64::consts::FRAC_1_SQRT_2)] {
        let o = &j["outputs"][k];
        let exact_run = alignment(&f.rows["rot"], &w[k], false);
        let exact_ref = alignment(&f.rows["ref"], &w[k], false);
        close(num(&o["alignment"]), exact_run, 1e-9, "exact alignment");
        close(num(&o["reference_alignment"]), exact_ref, 1e-9, "exact reference alignment");
        close(num(&o["retention"]), exact_run / exact_ref, 1e-9, "exact retention");
        close(num(&o["alignment"]), want, 0.02, "rotated alignment");
        close(num(&o["retention"]), 0.5, 0.02, "retention at 60°");
        assert_eq!(o["flagged"], true);
    }
    // A lower threshold passes it.
    assert_eq!(retention(&f.run("rot"), &f.weights, &["--reference", r, "--min", "0.4"]).code, Some(0));

    // The concept gone (moved to an orthogonal direction): retention ≈ 0, flagged, exit status 3; the table says so.
    let out = retention(&f.run("gone"), &f.weights, &["--reference", r, "--min", "0.5"]);
    assert_eq!(out.code, Some(3), "{}{}", out.stdout, out.stderr);
    assert_eq!(out.stdout.matches("FLAG\n").count(), 2, "{}", out.stdout);
    assert!(out.stdout.contains("FLAGGED: 2 of 2 outputs with retention below 0.5"), "{}", out.stdout);
    let j = retention(&f.run("gone"), &f.weights, &["--reference", r, "--min", "0.5", "--json"]).json();
    for k in 0..2 {
        let o = &j["outputs"][k];
        close(num(&o["retention"]), 0.0, 0.02, "retention with the concept gone");
        let exact = alignment(&f.rows["gone"], &w[k], false) / alignment(&f.rows["ref"], &w[k], false);
        close(num(&o["retention"]), exact, 1e-9, "exact retention");
        assert_eq!(o["flagged"], true);
    }

    // The reference's activations downcast on capture to f8e4m3_rowscaled: every HP row is in that series (and
    // dequantized by inspect); retention 1 within E4M3's error (≤ 1/16 relative per element, unbiased, averaged).
    let fp8 = f.run("fp8");
    let hp_dir = fp8.join(format!("hookpoint={HP}/rank=0"));
    assert!(std::fs::read_dir(hp_dir.join("_f8e4m3_rowscaled")).unwrap().count() > 0);
    assert!(!std::fs::read_dir(&hp_dir).unwrap().any(|e| e
        .unwrap()
        .path()
        .extension()
        .is_some_and(|x| x == "parquet")));
    let j = retention(&fp8, &f.weights, &["--reference", r, "--min", "0.9", "--json"]).json();
    for k in 0..2 {
        let o = &j["outputs"][k];
        assert_eq!((o["rows_a"].as_u64(), o["rows_b"].as_u64()), (Some(rows_a), Some(rows_b)), "{o}");
        close(num(&o["retention"]), 1.0, 0.02, "retention of the downcast run");
        assert!(num(&o["retention"]) != 1.0, "the downcast rows were read, not the reference's");
    }

    // --last-token: each request's highest position only (50 rows a group).
    let out = retention(&f.run("rot"), &f.weights, &["--reference", r, "--last-token", "--json"]);
    assert_eq!(out.code, Some(0), "no --min: nothing flagged; {}", out.stderr);
    let j = out.json();
    assert_eq!(j["last_token"], true);
    for k in 0..2 {
        let o = &j["outputs"][k];
        assert_eq!((o["rows_a"].as_u64(), o["rows_b"].as_u64()), (Some(50), Some(50)), "{o}");
        let exact_run = alignment(&f.rows["rot"], &w[k], true);
        let exact_ref = alignment(&f.rows["ref"], &w[k], true);
        close(num(&o["alignment"]), exact_run, 1e-9, "exact last-token alignment");
        close(num(&o["retention"]), exact_run / exact_ref, 1e-9, "exact last-token retention");
        close(num(&o["retention"]), 0.5, 0.04, "last-token retention at 60°");
        assert_eq!(o["flagged"], false);
    }

    // The Arrow IPC copy gives the same numbers; .npy weights give the same numbers as safetensors.
    let parquet = retention(&f.run("rot"), &f.weights, &["--reference", r, "--json"]).json();
    let arrow = retention(&f.run("rot"), &f.weights, &["--reference", r, "--sink", "arrow_ipc", "--json"]).json();
    assert_eq!(arrow["run"]["sink"], "arrow_ipc");
    assert_eq!(parquet["outputs"], arrow["outputs"]);
    let npy = f.dir.join("probe.npy");
    write_npy(&npy, &w);
    assert_eq!(retention(&f.run("rot"), &npy, &["--reference", r, "--json"]).json()["outputs"], parquet["outputs"]);

    // Without a reference: alignments only, and --min applies to them.
    let out = retention(&f.run("rot"), &f.weights, &["--min", "0.45", "--json"]);
    assert_eq!(out.code, Some(3), "output 1's alignment is 0.35: {}", out.stdout);
    let j = out.json();
    assert!(j["reference"].is_null());
    assert_eq!(j["outputs"][0]["retention"], Value::Null);
    assert_eq!(j["outputs"][0]["reference_alignment"], Value::Null);
    assert_eq!((j["outputs"][0]["flagged"].as_bool(), j["outputs"][1]["flagged"].as_bool()), (Some(false), Some(true)));

    // Groups from files (@FILE, one id or range a line) read the same rows.
    let (ga, gb) = (f.dir.join("a.txt"), f.dir.join("b.txt"));
    std::fs::write(&ga, "# concept present\n0-24\n25\n26-49\n").unwrap();
    std::fs::write(&gb, (50..100).map(|r| format!("{r}\n")).collect::<String>()).unwrap();
    let (ga, gb) = (format!("@{}", ga.display()), format!("@{}", gb.display()));
    let rot = f.run("rot");
    let out = inspect(&[
        &rot,
        &"--weights",
        &f.weights,
        &"--hookpoint",
        &HP,
        &"--group-a",
        &ga,
        &"--group-b",
        &gb,
        &"--reference",
        &r,
        &"--json",
    ]);
    assert_eq!(out.json()["outputs"], parquet["outputs"]);

    // The table, for people.
    let out = retention(&f.run("rot"), &f.weights, &["--reference", r, "--min", "0.4"]);
    assert!(out.stdout.contains("calibration retention of") && out.stdout.contains("ok: every output's retention"));
    assert!(out.stdout.contains("0.5"), "{}", out.stdout);
}

#[test]
fn bad_input_is_refused_with_exit_status_2_naming_what_is_wrong() {
    let dir = tempdir("retention-bad");
    let rows = write_run(&dir, "run", 1, &axis(0), false);
    assert!(!rows.is_empty());
    let run = dir.join("run");
    let weights = dir.join("probe.safetensors");
    write_safetensors(&weights, &probe_weights());
    let run_s = run.to_str().unwrap();
    let refused = |out: Out, wanted: &[&str]| {
        assert_eq!(out.code, Some(2), "{}{}", out.stdout, out.stderr);
        for w in wanted {
            assert!(out.stderr.contains(w), "{w:?} not in: {}", out.stderr);
        }
    };
    let base = |hp: &str, a: &str, b: &str, w: &Path| -> Vec<String> {
        [run_s, "--weights", w.to_str().unwrap(), "--hookpoint", hp, "--group-a", a, "--group-b", b]
            .map(String::from)
            .to_vec()
    };
    let go = |args: Vec<String>| {
        let args: Vec<&dyn AsRef<std::ffi::OsStr>> = args.iter().map(|a| a as &dyn AsRef<std::ffi::OsStr>).collect();
        inspect(&args)
    };

    // An unknown hookpoint: the ones the run has are named.
    refused(go(base("layers.99.residual", "0-49", "50-99", &weights)), &["layers.99.residual", HP, OTHER]);
    // Weights of width 32 on a hookpoint of width 16.
    refused(go(base(OTHER, "0-49", "50-99", &weights)), &["2 × 32", "16 elements"]);
    // A group with no rows at the hookpoint: which one, in which run.
    refused(go(base(HP, "0-49", "500-599", &weights)), &["group b", "500-599", "none of its 100 request ids"]);
    let mut args = base(HP, "0-49", "50-99", &weights);
    args.extend(["--reference".into(), dir.join("run").display().to_string()]);
    args[6] = "1000-1009".into();
    refused(go(args), &["group a", "1000-1009"]);
    // Overlapping groups.
    refused(go(base(HP, "0-50", "50-99", &weights)), &["request 50 is in both"]);
    // Malformed ids (clap's usage error, naming the argument).
    refused(go(base(HP, "0-x", "50-99", &weights)), &["--group-a", "`x` is not a request id"]);
    refused(go(base(HP, "9-1", "50-99", &weights)), &["--group-a", "9-1 is empty"]);
    refused(go(base(HP, "@/nonexistent/ids", "50-99", &weights)), &["--group-a", "cannot read"]);
    // Weights: missing file, unknown tensor, unknown format.
    refused(go(base(HP, "0-49", "50-99", &dir.join("nope.safetensors"))), &["--weights", "nope.safetensors"]);
    let mut args = base(HP, "0-49", "50-99", &weights);
    args.extend(["--tensor".into(), "probe.w".into()]);
    refused(go(args), &["no tensor `probe.w`", "bias, weight"]);
    std::fs::write(dir.join("probe.txt"), "1 2 3").unwrap();
    refused(go(base(HP, "0-49", "50-99", &dir.join("probe.txt"))), &["unknown file type"]);
    // A threshold that is not a number.
    let mut args = base(HP, "0-49", "50-99", &weights);
    args.extend(["--min".into(), "nan".into()]);
    refused(go(args), &["--min", "not a finite number"]);
    // Not a run directory; a reference that is not one.
    let mut args = base(HP, "0-49", "50-99", &weights);
    args[0] = dir.display().to_string();
    refused(go(args), &["is not a run directory but holds runs (run)"]);
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let mut args = base(HP, "0-49", "50-99", &weights);
    args[0] = empty.display().to_string();
    refused(go(args), &["holds no committed data files"]);
    let mut args = base(HP, "0-49", "50-99", &weights);
    args.extend(["--reference".into(), dir.join("nope").display().to_string()]);
    refused(go(args), &["the reference run", "is not a directory"]);
    // A sink or rank the run does not have.
    let mut args = base(HP, "0-49", "50-99", &weights);
    args.extend(["--rank".into(), "3".into()]);
    refused(go(args), &["no files of rank 3", "ranks: 0"]);

    // Weights that are not finite.
    let nan = dir.join("nan.npy");
    let mut w = probe_weights();
    w[1][3] = f32::NAN;
    write_npy(&nan, &w);
    refused(go(base(HP, "0-49", "50-99", &nan)), &["weight [1, 3] is NaN"]);

    // A truncated data file: unreadable, exit status 1, named.
    let part = run.join(format!("hookpoint={HP}/rank=0/part-00000.parquet"));
    let bytes = std::fs::read(&part).unwrap();
    std::fs::write(&part, &bytes[..bytes.len() / 2]).unwrap();
    let out = go(base(HP, "0-49", "50-99", &weights));
    assert_eq!(out.code, Some(1), "{}{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("part-00000.parquet") && out.stderr.contains("unreadable"), "{}", out.stderr);
    // The Arrow IPC copy is intact and still reads.
    let mut args = base(HP, "0-49", "50-99", &weights);
    args.extend(["--sink".into(), "arrow_ipc".into()]);
    assert_eq!(go(args).code, Some(0));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn rows_with_a_nan_are_skipped_and_counted_and_a_group_of_only_nan_rows_is_flagged() {
    let dir = tempdir("retention-nan");
    // Two rows of group a and one of group b hold a NaN; request 99's every row (both) too.
    let nan = [(7, 1), (8, 0), (62, 1), (99, 0), (99, 1)];
    let rows = write_run_with_nan(&dir, "run", 1, &axis(0), false, &nan);
    let weights = dir.join("probe.safetensors");
    write_safetensors(&weights, &probe_weights());
    let run = dir.join("run");
    let j = retention(&run, &weights, &["--json"]).json();
    assert_eq!((j["run"]["skipped_rows_a"].as_u64(), j["run"]["skipped_rows_b"].as_u64()), (Some(2), Some(3)));
    assert_eq!((j["outputs"][0]["rows_a"].as_u64(), j["outputs"][0]["rows_b"].as_u64()), (Some(147), Some(147)));
    for k in 0..2 {
        let exact = alignment(&rows, &probe_weights()[k], false);
        close(num(&j["outputs"][k]["alignment"]), exact, 1e-9, "alignment without the NaN rows");
    }
    let out = retention(&run, &weights, &[]);
    assert!(
        out.stdout.contains("rows with a NaN or infinite element skipped: 2 in group a, 3 in group b"),
        "{}",
        out.stdout
    );
    // --last-token: request 99's last row is NaN, so group b has 49 rows.
    let j = retention(&run, &weights, &["--last-token", "--json"]).json();
    assert_eq!((j["outputs"][0]["rows_a"].as_u64(), j["outputs"][0]["rows_b"].as_u64()), (Some(50), Some(49)));
    assert_eq!(j["run"]["skipped_rows_b"], 1);
    // A group whose rows are all NaN: captured (not bad input), but no mean — alignment NaN (null), flagged.
    let args: Vec<String> = [
        run.to_str().unwrap(),
        "--weights",
        weights.to_str().unwrap(),
        "--hookpoint",
        HP,
        "--group-a",
        "0-49",
        "--group-b",
        "99",
        "--min",
        "0.1",
        "--json",
    ]
    .map(String::from)
    .to_vec();
    let out = inspect(&args.iter().map(|a| a as &dyn AsRef<std::ffi::OsStr>).collect::<Vec<_>>());
    assert_eq!(out.code, Some(3), "{}{}", out.stdout, out.stderr);
    let j = out.json();
    assert_eq!(j["outputs"][0]["rows_b"], 0);
    assert!(j["outputs"][0]["alignment"].is_null() && j["outputs"][0]["flagged"] == true);
    std::fs::remove_dir_all(&dir).unwrap();
}
