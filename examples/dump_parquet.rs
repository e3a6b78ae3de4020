//! The main example: a built-in synthetic engine — decoder-shaped, deterministic, with continuous batching
//! (requests join and leave, prefill and decode steps) — captured through the whole pipeline into a Parquet
//! dataset under `./ringscope-out/<run id>/`, then a summary: records, rows, bytes, GB/s, drops, files.
//!
//! ```text
//! cargo run --release --example dump_parquet
//! cargo run --release --example dump_parquet -- --layers 4 --hidden 256 --run-id demo --arrow-ipc
//! ```
//!
//! Read the output back with pyarrow, DuckDB or Polars (docs/reading-a-dump.md).
//!
//! While it runs, a progress line on stderr about once a second — rows exported, drain GB/s, drops, the
//! destinations' backlog, ring use — read from `Session::stats`: when stderr is a terminal, or with `--progress`;
//! `--no-progress` turns it off.
//!
//! Exits with status 1, saying why on stderr, when anything went wrong — including a run that completed but lost
//! records to a failed sink (a full disk, say): `sink_error` drops or sink errors in the report. In full mode a
//! failed sink stops the capture loop (the session refuses captures); the session is still shut down, so the files
//! committed before the failure and the manifest are there to inspect.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use ringscope::synthetic::{pregenerate, residual_hookpoints_toml, EngineConfig};
use ringscope::{CaptureOutcome, Config, DropReason, Session};

#[derive(Parser)]
#[command(about = "Dump a synthetic decoder's residual stream to Parquet through ringscope")]
struct Args {
    /// Output root; the run is written to OUT/RUN_ID.
    #[arg(long, default_value = "ringscope-out")]
    out: String,
    /// Run id (directory name); default run-<UTC time>-<pid>.
    #[arg(long)]
    run_id: Option<String>,
    /// Decoder layers (one residual hookpoint each).
    #[arg(long, default_value_t = 16)]
    layers: u32,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    hidden: u32,
    /// Requests to serve.
    #[arg(long, default_value_t = 128)]
    requests: u32,
    /// Most concurrent requests.
    #[arg(long, default_value_t = 32)]
    concurrent: u32,
    /// Seed of the schedule and the activations.
    #[arg(long, default_value_t = 0x5EED)]
    seed: u64,
    /// `full` or `best_effort`.
    #[arg(long, default_value = "full")]
    mode: String,
    /// Ring capacity.
    #[arg(long, default_value = "64 MiB")]
    ring: String,
    /// Parquet zstd level.
    #[arg(long, default_value_t = 1)]
    zstd_level: i32,
    /// Also write an Arrow IPC dataset.
    #[arg(long)]
    arrow_ipc: bool,
    /// Sink threads (hookpoints are split over them).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// `auto`, `on` or `off`: write files with O_DIRECT (past the page cache).
    #[arg(long, default_value = "auto")]
    direct_io: String,
    /// Print a progress line on stderr about once a second (the default when stderr is a terminal).
    #[arg(long, conflicts_with = "no_progress")]
    progress: bool,
    /// No progress line.
    #[arg(long)]
    no_progress: bool,
}

/// One progress line from the session's statistics: what was exported, how fast the drain moves activations since
/// the last line, what was dropped, what waits for the destinations, how full the ring is.
fn progress_line(session: &Session, last: &mut (Instant, u64)) -> String {
    let st = session.stats();
    let rows: u64 = st.hookpoints.iter().map(|h| h.counters.exported.rows).sum();
    let drops: u64 = st.hookpoints.iter().map(|h| h.counters.dropped_total().records).sum();
    let backlog: u64 = st.destinations.iter().map(|d| d.queued_bytes).sum();
    let now = Instant::now();
    let gb_s = (st.drain.data_bytes - last.1) as f64 / now.duration_since(last.0).as_secs_f64().max(1e-9) / 1e9;
    *last = (now, st.drain.data_bytes);
    let ring = st.ring.used_bytes as f64 / st.ring.capacity_bytes.max(1) as f64 * 100.0;
    format!(
        "ringscope progress: {:.1} s, step {}, {rows} rows exported, {gb_s:.2} GB/s, {drops} records dropped, backlog \
         {:.1} MiB, ring {ring:.0}% used",
        st.uptime.as_secs_f64(),
        st.last_step.map_or("-".into(), |s| s.to_string()),
        backlog as f64 / 1048576.0
    )
}

/// Prints [`progress_line`] every second until `done`, and once more at the end. On a terminal each line replaces the
/// last one.
fn report_progress(session: &Session, done: &AtomicBool) {
    let terminal = std::io::stderr().is_terminal();
    let mut last = (Instant::now(), 0);
    let mut next = Instant::now() + Duration::from_secs(1);
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        if Instant::now() >= next {
            let line = progress_line(session, &mut last);
            if terminal {
                eprint!("\r\x1b[2K{line}");
            } else {
                eprintln!("{line}");
            }
            next += Duration::from_secs(1);
        }
    }
    let line = progress_line(session, &mut last);
    if terminal {
        eprintln!("\r\x1b[2K{line}");
    } else {
        eprintln!("{line}");
    }
}

fn main() -> std::process::ExitCode {
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dump_parquet: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let engine = EngineConfig {
        layers: args.layers,
        hidden: args.hidden,
        requests: args.requests,
        max_concurrent: args.concurrent,
        seed: args.seed,
        ..EngineConfig::default()
    };
    let mut toml = format!(
        "[ring]\ncapacity = \"{}\"\n[policy]\nmode = \"{}\"\n[export]\nparquet = true\narrow_ipc = {}\ndir = {:?}\nzstd_level = {}\nthreads = {}\ndirect_io = {:?}\n",
        args.ring, args.mode, args.arrow_ipc, args.out, args.zstd_level, args.threads, args.direct_io
    );
    if let Some(id) = &args.run_id {
        toml += &format!("run_id = {id:?}\n");
    }
    toml += &residual_hookpoints_toml(engine.layers, engine.hidden);
    let config = Config::from_toml(&toml)?;
    let session = Session::new(config.clone())?;

    let steps = pregenerate(engine);
    let show_progress = !args.no_progress && (args.progress || std::io::stderr().is_terminal());
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if show_progress {
            scope.spawn(|| report_progress(&session, &done));
        }
        let result = dump(&session, &config, &steps, &engine);
        done.store(true, Ordering::Relaxed);
        result
    })
}

/// Runs the engine's steps through `session`, shuts it down and prints the summary.
fn dump(
    session: &Session,
    config: &Config,
    steps: &[(ringscope::synthetic::EngineStep, Vec<Vec<u8>>)],
    engine: &EngineConfig,
) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let mut dropped_at_capture = 0u64;
    let mut capture = || -> Result<(), ringscope::Error> {
        for (s, layers) in steps {
            session.begin_step(s.step, s.rows.iter().copied())?;
            for (l, data) in layers.iter().enumerate() {
                if let CaptureOutcome::Dropped(_) = session.capture(l as u32, data)? {
                    dropped_at_capture += 1;
                }
            }
            session.end_step()?;
        }
        Ok(())
    };
    // A failed capture (full mode refuses them once a sink failed) ends the loop, not the run: the session is shut
    // down below so that what was committed and the manifest exist, and the error is returned at the end.
    let stopped = capture().err();
    let capture_s = started.elapsed().as_secs_f64();
    let report = session.shutdown()?;
    let total_s = started.elapsed().as_secs_f64();
    let run_dir = report.run_dir.clone().expect("a Parquet sink is configured");

    // What the Python test needs to regenerate every row: the engine's parameters (next to the run's files, on object
    // storage too).
    let parameters = format!(
        "{{\"layers\": {}, \"hidden\": {}, \"requests\": {}, \"seed\": {}, \"steps\": {}}}\n",
        engine.layers,
        engine.hidden,
        engine.requests,
        engine.seed,
        steps.len()
    );
    match config.export.open_storage()? {
        Some(storage) => storage.put(&run_dir.join("_synthetic_engine.json"), parameters.into()).map(drop)?,
        None => std::fs::write(run_dir.join("_synthetic_engine.json"), parameters)?,
    }

    let t = report.accounting.total();
    let data_bytes = report.drain.data_bytes as f64;
    let on_disk: u64 = report.files.iter().map(|f| f.bytes).sum();
    println!("ringscope dump_parquet → {}", run_dir.display());
    println!(
        "engine: {} steps, {} requests, {} layers × hidden {} (bf16), mode {}",
        steps.len(),
        engine.requests,
        engine.layers,
        engine.hidden,
        session.policy().mode
    );
    println!(
        "records: {} produced, {} exported, {} dropped ({} at capture), {} sampled out",
        t.produced.records,
        t.exported.records,
        t.dropped_total().records,
        dropped_at_capture,
        t.sampled_out.records
    );
    println!("rows: {} exported, {} dropped", t.exported.rows, t.dropped_total().rows);
    println!(
        "bytes: {:.1} MiB of activations → {:.1} MiB on disk ({} files, {} with O_DIRECT; ratio {:.3})",
        data_bytes / 1048576.0,
        on_disk as f64 / 1048576.0,
        report.files.len(),
        report.files.iter().filter(|f| f.direct_io).count(),
        on_disk as f64 / data_bytes.max(1.0)
    );
    println!(
        "time: capture loop {:.3} s ({:.2} GB/s); capture → files closed {:.3} s ({:.2} GB/s)",
        capture_s,
        data_bytes / capture_s / 1e9,
        total_s,
        data_bytes / total_s / 1e9
    );
    for f in report.files.iter().take(4) {
        println!("  {} ({} rows, {:.1} MiB)", f.path.display(), f.rows, f.bytes as f64 / 1048576.0);
    }
    if report.files.len() > 4 {
        println!(
            "  ... and {} more (manifest: {})",
            report.files.len() - 4,
            run_dir.join(ringscope::manifest::MANIFEST).display()
        );
    }
    for e in &report.drain.errors {
        println!("error: {e}");
    }
    if let Some(e) = stopped {
        return Err(format!("capture stopped: {e}").into());
    }
    // A run that lost records to a failed sink did not do its job, however cleanly it ended.
    let sink_losses = t.dropped_for(DropReason::SinkError).records;
    if sink_losses > 0 || !report.sink_failures.is_empty() {
        let failed: Vec<String> = report.sink_failures.iter().map(|f| f.message.clone()).collect();
        return Err(format!(
            "{sink_losses} records lost to sink errors (sink_error); failed sinks: {}",
            if failed.is_empty() { "none reported".into() } else { failed.join("; ") }
        )
        .into());
    }
    Ok(())
}
