//! Runs the built-in synthetic engine (decoder-shaped, continuous batching) through a whole ringscope session —
//! hookpoints → ring → drain → sink — and prints what was captured: records, rows, bytes, throughput, drops.
//!
//! ```text
//! cargo run --release --example capture_summary -- --layers 16 --hidden 2048 --requests 256 --mode best_effort
//! ```

use std::time::Instant;

use clap::Parser;
use ringscope::synthetic::{pregenerate, residual_hookpoints_toml, EngineConfig};
use ringscope::SummarySink;
use ringscope::{CaptureOutcome, Config, Session};

#[derive(Parser)]
#[command(about = "Capture a synthetic decoder's residual stream through ringscope and summarise it")]
struct Args {
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
    /// `full` or `best_effort`.
    #[arg(long, default_value = "full")]
    mode: String,
    /// Ring capacity (e.g. "64 MiB").
    #[arg(long, default_value = "64 MiB")]
    ring: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let engine = EngineConfig {
        layers: args.layers,
        hidden: args.hidden,
        requests: args.requests,
        max_concurrent: args.concurrent,
        ..EngineConfig::default()
    };
    let mut toml = format!("[ring]\ncapacity = \"{}\"\n[policy]\nmode = \"{}\"\n", args.ring, args.mode);
    toml += &residual_hookpoints_toml(engine.layers, engine.hidden);
    let (sink, summary) = SummarySink::new();
    let session = Session::builder(Config::from_toml(&toml)?).sink(sink).start()?;

    let steps = pregenerate(engine);

    let started = Instant::now();
    let (mut published, mut dropped) = (0u64, 0u64);
    for (s, layers) in &steps {
        session.begin_step(s.step, s.rows.iter().copied())?;
        for (l, data) in layers.iter().enumerate() {
            match session.capture(l as u32, data)? {
                CaptureOutcome::Published { .. } => published += 1,
                CaptureOutcome::Dropped(_) => dropped += 1,
                CaptureOutcome::SampledOut => {}
            }
        }
        session.end_step()?;
    }
    let capture_time = started.elapsed();
    let report = session.shutdown()?;
    let total_time = started.elapsed();

    let total = report.accounting.total();
    let bytes: u64 = summary.lock().values().map(|s| s.bytes).sum();
    println!(
        "ringscope capture_summary: {} steps, {} layers × hidden {} (bf16), mode {}",
        steps.len(),
        engine.layers,
        engine.hidden,
        args.mode
    );
    println!(
        "{:<18} {:>8} {:>9} {:>12} {:>11} {:>9}  digest",
        "hookpoint", "records", "rows", "bytes", "steps", "requests"
    );
    for (name, s) in summary.lock().iter() {
        let (a, b) = s.steps.unwrap_or((0, 0));
        println!(
            "{name:<18} {:>8} {:>9} {:>12} {:>5}..{:<5} {:>9}  {:08x}",
            s.records, s.rows, s.bytes, a, b, s.requests, s.digest
        );
    }
    println!(
        "records: {} produced, {} exported, {} dropped, {} sampled out  (published {published}, dropped {dropped} at capture)",
        total.produced.records,
        total.exported.records,
        total.dropped_total().records,
        total.sampled_out.records
    );
    println!("rows: {} exported; activation bytes: {:.1} MiB", total.exported.rows, bytes as f64 / (1 << 20) as f64);
    println!(
        "capture loop {:.3} s ({:.2} GB/s of activations); capture→drained {:.3} s ({:.2} GB/s)",
        capture_time.as_secs_f64(),
        bytes as f64 / capture_time.as_secs_f64() / 1e9,
        total_time.as_secs_f64(),
        bytes as f64 / total_time.as_secs_f64() / 1e9
    );
    for e in &report.drain.errors {
        println!("sink error: {e}");
    }
    println!("accounting: produced = exported + dropped + sampled_out holds for every hookpoint");
    Ok(())
}
