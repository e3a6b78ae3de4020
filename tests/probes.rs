//! Online probes through a `Session` (host backend): planted-direction data, scores against an f64 reference,
//! alerts exactly for the planted requests, stop flags, fused scores as their own hookpoint, coverage under
//! sampling, and every bad definition refused at start with a message naming it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ringscope::probe::{Action, Alert};
use ringscope::{Config, Error, RowMeta, Session};

const D: usize = 64;

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-probes-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A `.npy` file of f32 with `shape` (C order).
fn write_npy(path: &Path, shape: &[usize], values: &[f32]) {
    ringscope::probe::save_npy(path, shape, values).unwrap();
}

/// A safetensors file with f32 tensors `(name, shape, values)`.
fn write_safetensors(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    let mut header = Vec::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.push(format!(
            "\"{name}\":{{\"dtype\":\"F32\",\"shape\":{shape:?},\"data_offsets\":[{start},{}]}}",
            data.len()
        ));
    }
    let header = format!("{{{}}}", header.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// Deterministic normal samples (xorshift + Box–Muller).
struct Normal(u64);
impl Normal {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// The planted concept: a unit vector.
fn planted() -> Vec<f32> {
    let mut n = Normal(7);
    let v: Vec<f32> = (0..D).map(|_| n.sample()).collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / norm).collect()
}

/// Weights: output 0 reads the planted direction, output 1 a random one (never alerts: threshold 100).
fn weights(dir: &Path) -> PathBuf {
    let mut n = Normal(99);
    let mut w = planted();
    w.extend((0..D).map(|_| n.sample() * 0.1));
    let path = dir.join("probe.safetensors");
    write_safetensors(&path, &[("weight", vec![2, D], w), ("bias", vec![2], vec![-0.25, 0.5])]);
    path
}

const REQUESTS: u64 = 40;
const PROMPT: u32 = 8;
const DECODE: u64 = 8;

fn is_planted(request: u64) -> bool {
    request % 4 == 1
}

/// A request's token: noise, plus 3 × the planted direction for planted requests.
fn token(request: u64, position: u32) -> Vec<f32> {
    let mut n = Normal(request * 1_000_003 + position as u64 * 7919 + 1);
    let dir = planted();
    let s = if is_planted(request) { 3.0 } else { 0.0 };
    (0..D).map(|j| n.sample() + s * dir[j]).collect()
}

fn config(dir: &Path, weights: &Path, extra: &str) -> Config {
    let _ = dir;
    Config::from_toml(&format!(
        r#"
        [ring]
        capacity = "4 MiB"
        [policy]
        mode = "full"
        [[hookpoints]]
        name = "layers.3.residual"
        site = "residual"
        layer = 3
        dtype = "f32"
        row_width = {D}
        [[probes]]
        name = "deception"
        hookpoint = "layers.3.residual"
        weights = "{w}"
        aggregate = "mean"
        thresholds = [1.25, 100.0]
        action = "stop"
        labels = ["deceptive", "noise"]
        min_tokens = {PROMPT}
        {extra}
        "#,
        w = weights.display()
    ))
    .unwrap()
}

/// Prefill (all prompts in one step), then `DECODE` decode steps of every request.
fn run(session: &Session) {
    let hp = session.hookpoint("layers.3.residual").unwrap().id();
    let prefill: Vec<(u64, u32)> = (0..REQUESTS).flat_map(|r| (0..PROMPT).map(move |p| (r, p))).collect();
    let mut steps = vec![prefill];
    for t in 0..DECODE {
        steps.push((0..REQUESTS).map(|r| (r, PROMPT + t as u32)).collect());
    }
    for (step, rows) in steps.into_iter().enumerate() {
        session.begin_step(step as u64, rows.iter().copied()).unwrap();
        let bytes: Vec<u8> = rows.iter().flat_map(|&(r, p)| token(r, p)).flat_map(|x| x.to_le_bytes()).collect();
        session.capture(hp, &bytes).unwrap();
        session.end_step().unwrap();
    }
    assert!(session.wait_probes(Duration::from_secs(30)), "the probes finish scoring");
}

/// The f64 reference of a request's mean score on output 0.
fn reference_mean(request: u64) -> f64 {
    let w = planted();
    let tokens = PROMPT as u64 + DECODE;
    (0..tokens as u32)
        .map(|p| token(request, p).iter().zip(&w).map(|(x, w)| *x as f64 * *w as f64).sum::<f64>() - 0.25)
        .sum::<f64>()
        / tokens as f64
}

/// The area under the ROC curve of `scores` for `positive` (ties count half).
fn auroc(scores: &[(f64, bool)]) -> f64 {
    let pos: Vec<f64> = scores.iter().filter(|s| s.1).map(|s| s.0).collect();
    let neg: Vec<f64> = scores.iter().filter(|s| !s.1).map(|s| s.0).collect();
    let mut wins = 0.0;
    for p in &pos {
        for n in &neg {
            wins += if p > n {
                1.0
            } else if p == n {
                0.5
            } else {
                0.0
            };
        }
    }
    wins / (pos.len() * neg.len()) as f64
}

#[test]
fn a_probe_finds_the_planted_requests_and_stops_exactly_those() {
    let dir = tempdir("planted");
    let session = Session::new(config(&dir, &weights(&dir), "")).unwrap();
    let alerts = session.alerts().unwrap();
    run(&session);
    let raised: Vec<Alert> = alerts.try_iter().collect();
    let alerted: BTreeSet<u64> = raised.iter().map(|a| a.request_id).collect();
    let planted: BTreeSet<u64> = (0..REQUESTS).filter(|r| is_planted(*r)).collect();
    assert_eq!(alerted, planted, "alerts fire exactly for the planted requests");
    assert_eq!(raised.len(), planted.len(), "once per request: {raised:?}");
    for a in &raised {
        assert_eq!((&*a.probe, a.output, &*a.label, a.action), ("deception", 0, "deceptive", Action::Stop));
        assert!(a.score >= 1.25 && a.threshold == 1.25, "{a:?}");
    }
    for r in 0..REQUESTS {
        assert_eq!(session.is_flagged(r), is_planted(r), "request {r}'s stop flag");
    }
    let mut scored = Vec::new();
    for r in 0..REQUESTS {
        let report = session.probe_request("deception", r).unwrap().expect("every request was scored");
        let want = reference_mean(r);
        let got = report.scores[0] as f64;
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "request {r}: {got} vs the f64 reference {want}");
        assert_eq!(report.alerted, vec![is_planted(r), false]);
        let c = report.coverage;
        let tokens = PROMPT as u64 + DECODE;
        assert_eq!((c.scored, c.nan, c.expected, c.unobserved), (tokens, 0, tokens, 0), "request {r}: {c:?}");
        scored.push((got, is_planted(r)));
    }
    let auc = auroc(&scored);
    assert!(auc >= 0.99, "AUROC {auc}");
    let stats = session.probe_stats();
    assert_eq!(stats[0].rows, REQUESTS * (PROMPT as u64 + DECODE));
    assert_eq!(stats[0].alerts, planted.len() as u64);
    // Finishing a request hands over its final report and lowers its flag.
    let finished = session.finish_request(1);
    assert_eq!(finished.len(), 1);
    assert!(!session.is_flagged(1));
    assert!(session.probe_request("deception", 1).unwrap().is_none());
    session.shutdown().unwrap();
}

#[test]
fn a_fused_probe_captures_only_its_scores_and_they_equal_the_consumers() {
    let dir = tempdir("fused");
    let w = weights(&dir);
    let extra = format!(
        r#"
        [[probes]]
        name = "fused"
        hookpoint = "layers.3.residual"
        weights = "{}"
        aggregate = "mean"
        thresholds = [1.25, 100.0]
        min_tokens = {PROMPT}
        mode = "fused"
        "#,
        w.display(),
    );
    let session = Session::new(config(&dir, &w, &extra)).unwrap();
    let scores_hp = session.hookpoint("probes.fused").unwrap();
    assert_eq!(scores_hp.spec().row_width, 2);
    assert_eq!(scores_hp.spec().layer, Some(3));
    run(&session);
    for r in 0..REQUESTS {
        let consumer = session.probe_request("deception", r).unwrap().unwrap();
        let fused = session.probe_request("fused", r).unwrap().unwrap();
        assert_eq!(consumer.scores, fused.scores, "request {r}: the same scores, whether fused or consumed");
        assert_eq!(consumer.coverage, fused.coverage);
    }
    let report = session.shutdown().unwrap();
    let counters = |name: &str| report.accounting.hookpoints.iter().find(|(n, _)| n == name).unwrap().1;
    let (fused, raw) = (counters("probes.fused"), counters("layers.3.residual"));
    assert_eq!(fused.exported.rows, raw.exported.rows, "one score row per captured row");
    assert_eq!(fused.exported.records, raw.exported.records);
}

#[test]
fn rows_the_probe_did_not_see_are_counted_per_request() {
    let dir = tempdir("coverage");
    let mut config = config(&dir, &weights(&dir), "");
    // Every other step is sampled out: the prefill (step 0) is kept, odd decode steps are not.
    config.hookpoints[0].every_n_steps = 2;
    let session = Session::new(config).unwrap();
    run(&session);
    for r in 0..REQUESTS {
        let c = session.probe_request("deception", r).unwrap().unwrap().coverage;
        let (seen, unseen) = (PROMPT as u64 + DECODE / 2, DECODE / 2);
        assert_eq!((c.scored, c.expected, c.unobserved), (seen, seen + unseen, unseen), "request {r}: {c:?}");
    }
    session.shutdown().unwrap();
}

/// Steps begun inside a CUDA graph give the probes no batch: the engine reports each pass's rows from the host
/// (`note_step_rows`), and the coverage's denominator counts them as a host-begun step's batch does.
#[test]
fn rows_noted_for_a_device_begun_step_are_the_coverage_denominator() {
    let dir = tempdir("noted");
    let session = Session::new(config(&dir, &weights(&dir), "")).unwrap();
    let hp = session.hookpoint("layers.3.residual").unwrap().id();
    // Request 5 runs 4 rows; the probe scores only the first 2 (a step begun on the host, standing in for the rows
    // that reached the ring); the other 2 were lost on the way (dropped on the device, say).
    session.begin_step(0, [(5, 0), (5, 1)]).unwrap();
    let bytes: Vec<u8> = (0..2).flat_map(|p| token(5, p)).flat_map(|x| x.to_le_bytes()).collect();
    session.capture(hp, &bytes).unwrap();
    session.end_step().unwrap();
    // The engine's own account of two more rows of request 5, one of request 6 and a padding row (nobody's).
    session.note_step_rows(&[5, RowMeta::NO_REQUEST, 6, 5]).unwrap();
    session.note_step_rows(&[]).unwrap();
    assert!(session.wait_probes(Duration::from_secs(30)), "the probes take the noted rows in");
    let c = session.probe_request("deception", 5).unwrap().unwrap().coverage;
    assert_eq!((c.scored, c.expected, c.unobserved), (2, 4, 2), "{c:?}");
    let c = session.probe_request("deception", 6).unwrap().unwrap().coverage;
    assert_eq!((c.scored, c.expected, c.unobserved), (0, 1, 1), "{c:?}");
    session.shutdown().unwrap();
    assert!(matches!(session.note_step_rows(&[5]), Err(Error::Closed)));
}

#[test]
fn a_nan_activation_gives_a_nan_score_that_is_reported_never_an_alert() {
    let dir = tempdir("nan");
    let session = Session::new(config(&dir, &weights(&dir), "")).unwrap();
    let alerts = session.alerts().unwrap();
    let hp = session.hookpoint("layers.3.residual").unwrap().id();
    for step in 0..50u64 {
        session.begin_step(step, [(5, step as u32)]).unwrap();
        let bytes: Vec<u8> = (0..D).map(|_| f32::NAN).flat_map(|x| x.to_le_bytes()).collect();
        session.capture(hp, &bytes).unwrap();
        session.end_step().unwrap();
    }
    assert!(session.wait_probes(Duration::from_secs(30)));
    assert_eq!(alerts.try_iter().count(), 0, "no alert storm");
    let report = session.probe_request("deception", 5).unwrap().unwrap();
    assert_eq!((report.coverage.scored, report.coverage.nan), (50, 50));
    assert!(report.scores[0].is_nan(), "the NaN is reported as it is");
    assert_eq!(session.probe_stats()[0].nan_rows, 50);
    session.shutdown().unwrap();
}

/// A probe definition that cannot work is refused at start, naming the probe and what is wrong.
#[test]
fn bad_probe_definitions_are_refused_at_start() {
    let dir = tempdir("bad");
    let good = weights(&dir);
    let narrow = dir.join("narrow.npy");
    write_npy(&narrow, &[2, D - 1], &vec![0.5; 2 * (D - 1)]);
    let nan = dir.join("nan.npy");
    let mut w = vec![0.5f32; D];
    w[7] = f32::NAN;
    write_npy(&nan, &[D], &w);
    let one = dir.join("one.npy");
    write_npy(&one, &[D], &vec![0.5; D]);
    let g = good.display();
    let cases: Vec<(String, &str)> = vec![
        (format!("weights = \"{}\"\nthreshold = 1.0", narrow.display()), "must equal the hookpoint's row_width"),
        (format!("weights = \"{}\"\nthreshold = 1.0", nan.display()), "weight [0, 7] is NaN"),
        (format!("weights = \"{g}\"\nthreshold = 1.0\naggregate = \"median\""), "unknown aggregate `median`"),
        (format!("weights = \"{g}\"\nthreshold = 1.0\naggregate = \"ema\""), "needs ema_alpha"),
        (format!("weights = \"{g}\"\nthreshold = 1.0\naggregate = \"ema\"\nema_alpha = 1.5"), "ema_alpha 1.5"),
        (format!("weights = \"{g}\"\nthresholds = [1.0, 2.0, 3.0]"), "3 thresholds for 2 outputs"),
        (format!("weights = \"{g}\""), "give threshold"),
        (format!("weights = \"{g}\"\nthreshold = 1.0\naction = \"explode\""), "unknown action `explode`"),
        (format!("weights = \"{}\"\nthreshold = 1.0", dir.join("missing.npy").display()), "missing.npy"),
        (format!("weights = \"{}\"\nthreshold = 1.0\nbias = [1.0, 2.0]", one.display()), "2 biases for 1 outputs"),
        (format!("weights = \"{g}\"\nthreshold = 1.0\ntensor = \"w\""), "no tensor `w`"),
        // Issue 28: outside float32's range a threshold became +inf (a probe that never alerts), silently.
        (format!("weights = \"{g}\"\nthreshold = 1e39"), "threshold = 1e39 is not a finite float32"),
        (format!("weights = \"{g}\"\nthresholds = [1.0, -1e39]"), "thresholds[1] = "),
        (format!("weights = \"{g}\"\nthreshold = 1.0\nbias = [1e39, 0.0]"), "bias[0] = "),
        (format!("weights = \"{g}\"\nthreshold = inf"), "threshold = inf is not a finite float32"),
        (
            format!("weights = \"{g}\"\nthreshold = 1.0\naggregate = \"ema\"\nema_alpha = 1e39"),
            "ema_alpha = 1e39 is not a finite float32",
        ),
        // An empty weights path named neither the key nor the path.
        ("weights = \"\"\nthreshold = 1.0".to_owned(), "weights = \"\" names no file"),
        (format!("weights = \"{g}\"\nthreshold = 1.0\nbias = \"\""), "bias = \"\" names no file"),
    ];
    for (body, want) in cases {
        let text = format!(
            "[[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"bf16\"\nrow_width = {D}\n\
             [[probes]]\nname = \"p\"\nhookpoint = \"h\"\n{body}\n"
        );
        let e = Session::new(Config::from_toml(&text).unwrap()).err().expect(want).to_string();
        assert!(e.contains(want) && e.contains("`p`"), "{body}: {e}");
    }
    // A probe on a hookpoint that does not exist, or of a dtype probes cannot read; two probes of one name.
    let base = |hp: &str, dtype: &str| {
        format!(
            "[[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"{dtype}\"\nrow_width = {D}\n\
             [[probes]]\nname = \"p\"\n{hp}\nweights = \"{g}\"\nthreshold = 1.0\n"
        )
    };
    let e = Session::new(Config::from_toml(&base("hookpoint = \"nope\"", "f32")).unwrap()).err().unwrap().to_string();
    assert!(e.contains("no hookpoint `nope`") && e.contains("(h)"), "{e}");
    let e = Session::new(Config::from_toml(&base("layer = 9\nsite = \"residual\"", "f32")).unwrap()).err().unwrap();
    assert!(e.to_string().contains("no layer 9, site `residual`"), "{e}");
    let e = Session::new(Config::from_toml(&base("hookpoint = \"h\"", "i32")).unwrap()).err().unwrap().to_string();
    assert!(e.contains("holds i32 rows"), "{e}");
    let twice = format!(
        "{}[[probes]]\nname = \"p\"\nhookpoint = \"h\"\nweights = \"{g}\"\nthreshold = 1.0\n",
        base("hookpoint = \"h\"", "f32")
    );
    let e = Session::new(Config::from_toml(&twice).unwrap()).err().unwrap().to_string();
    assert!(e.contains("two probes are named `p`"), "{e}");
    // Shared settings of the probes: a zero is refused, naming the keys.
    let zero = format!("{}[alerts]\nflag_slots = 0\n", base("hookpoint = \"h\"", "f32"));
    let e = Session::new(Config::from_toml(&zero).unwrap()).err().unwrap().to_string();
    assert!(e.contains("alerts.flag_slots = 0"), "{e}");
    // Issue 28: 4294967295 slots or queue entries aborted the process (34 GB and 343 GB allocations).
    for key in ["flag_slots", "queue", "max_requests"] {
        let huge = format!("{}[alerts]\n{key} = 4294967295\n", base("hookpoint = \"h\"", "f32"));
        let e = Session::new(Config::from_toml(&huge).unwrap()).err().unwrap().to_string();
        assert!(e.contains(&format!("alerts.{key} = 4294967295")) && e.contains("1 to 16777216"), "{e}");
    }
    // Without probes, asking for alerts is an error that says how to get them.
    let e = Session::new(Config::new()).unwrap().alerts().err().unwrap().to_string();
    assert!(e.contains("[[probes]]"), "{e}");
}

/// A probe given in code, with its weights in memory, works like one from the configuration.
#[test]
fn a_probe_built_in_code_scores_like_a_configured_one() {
    use ringscope::config::ProbeMode;
    use ringscope::probe::{Aggregation, ProbeDef, Target, Weights};
    let dir = tempdir("builder");
    let def = ProbeDef {
        name: "in_code".into(),
        target: Target::Layer { layer: 3, site: "residual".into() },
        weights: Weights::new(1, D, planted()).unwrap(),
        bias: vec![-0.25],
        aggregation: Aggregation::Mean,
        thresholds: vec![1.25],
        action: Action::Alert,
        labels: vec![],
        min_tokens: PROMPT,
    };
    let session = Session::builder(config(&dir, &weights(&dir), "")).probe(def, ProbeMode::Consumer).start().unwrap();
    run(&session);
    for r in 0..REQUESTS {
        let a = session.probe_request("in_code", r).unwrap().unwrap();
        let b = session.probe_request("deception", r).unwrap().unwrap();
        assert_eq!(a.scores[0], b.scores[0], "request {r}: the same weights, the same score");
        assert_eq!(a.alerted[0], is_planted(r));
    }
    session.shutdown().unwrap();
}

/// With a Parquet dump on (whose files commit only when they are full or closed), waiting for the probes waits for
/// the probes, not for the files: every row is scored when it returns.
#[test]
fn waiting_for_the_probes_does_not_wait_for_file_commits() {
    let dir = tempdir("parquet");
    let extra = format!("[export]\nparquet = true\ndir = \"{}\"\nrun_id = \"r\"\n", dir.join("out").display());
    let session = Session::new(config(&dir, &weights(&dir), &extra)).unwrap();
    run(&session);
    let rows: u64 = session.probe_stats().iter().map(|p| p.rows).sum();
    assert_eq!(rows, REQUESTS * (PROMPT as u64 + DECODE), "every row scored before the files were committed");
    let report = session.shutdown().unwrap();
    assert!(!report.files.is_empty(), "the dump was written");
}
