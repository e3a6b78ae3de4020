//! The drain thread: ring → sinks, with accounting.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ringscope_hookpoint::{HookPoint, Registry};
use ringscope_policy::DropReason;
use ringscope_ring::Consumer;

use crate::sink::{Sink, SinkError};
use crate::ExporterError;

/// Tuning of a drain.
#[derive(Debug, Clone, Copy)]
pub struct DrainOptions {
    /// Hand ring space back after this many records (and whenever the ring is empty). Smaller frees space sooner;
    /// larger costs the producer fewer cache misses.
    pub release_every: u32,
    /// Longest sleep when the ring is empty: bounds how stale an idle drain can be.
    pub max_idle_sleep: Duration,
}

impl Default for DrainOptions {
    fn default() -> Self {
        DrainOptions {
            release_every: 32,
            max_idle_sleep: Duration::from_millis(1),
        }
    }
}

/// What a drain did, returned when it finishes.
#[derive(Debug, Clone, Default)]
pub struct DrainReport {
    /// Records read from the ring.
    pub records: u64,
    /// Token rows read.
    pub rows: u64,
    /// Ring bytes read (headers, metadata and rows).
    pub bytes: u64,
    /// From the drain's start to its end.
    pub elapsed: Duration,
    /// The first error of each sink that failed, and of the ring if it delivered a corrupted record.
    pub errors: Vec<String>,
}

/// A running drain thread. It stops by itself once the producer is gone and the ring is empty; [`Drain::join`]
/// waits for that.
pub struct Drain {
    thread: JoinHandle<DrainReport>,
}

impl Drain {
    /// Starts a drain thread reading `consumer`, resolving hookpoint ids in `registry`, writing to `sinks`.
    pub fn spawn(
        consumer: Consumer,
        registry: Arc<Registry>,
        sinks: Vec<Box<dyn Sink>>,
        options: DrainOptions,
    ) -> Result<Drain, ExporterError> {
        let thread = std::thread::Builder::new()
            .name("ringscope-drain".into())
            .spawn(move || run(consumer, &registry, sinks, options))
            .map_err(ExporterError::Spawn)?;
        Ok(Drain { thread })
    }

    /// Waits for the drain to finish (drop the producer first, or this waits forever) and returns its report.
    pub fn join(self) -> Result<DrainReport, ExporterError> {
        self.thread
            .join()
            .map_err(|p| ExporterError::Panicked(panic_message(&p)))
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

struct SinkSlot {
    sink: Box<dyn Sink>,
    failed: bool,
}

fn run(
    mut consumer: Consumer,
    registry: &Registry,
    sinks: Vec<Box<dyn Sink>>,
    options: DrainOptions,
) -> DrainReport {
    let started = Instant::now();
    let mut report = DrainReport::default();
    let mut sinks: Vec<SinkSlot> = sinks
        .into_iter()
        .map(|sink| SinkSlot {
            sink,
            failed: false,
        })
        .collect();
    // Local copy of the registry, refreshed only when a record names an id we have not seen: no lock per record.
    let mut hookpoints: Vec<Arc<HookPoint>> = registry.all();
    let mut idle = Duration::from_micros(20);

    loop {
        let mut unreleased = 0u32;
        let mut drained_any = false;
        loop {
            let view = match consumer.peek() {
                Ok(Some(view)) => view,
                Ok(None) => break,
                Err(e) => {
                    // Corruption: the position of the next record is unknown, so nothing after this can be read.
                    // Records still in the ring stay unaccounted and the shutdown check reports them.
                    report.errors.push(format!("ring: {e}; the drain stopped"));
                    close_sinks(&mut sinks, &mut report);
                    report.elapsed = started.elapsed();
                    return report;
                }
            };
            drained_any = true;
            let id = view.header.meta.hookpoint as usize;
            if id >= hookpoints.len() {
                hookpoints = registry.all();
            }
            let rows = view.rows() as u64;
            report.records += 1;
            report.rows += rows;
            report.bytes += view.header.footprint() as u64;
            match hookpoints.get(id) {
                Some(hp) => {
                    let mut ok = true;
                    for slot in sinks.iter_mut().filter(|s| !s.failed) {
                        let result = catch_unwind(AssertUnwindSafe(|| slot.sink.write(&view, hp)))
                            .unwrap_or_else(|p| {
                                Err(SinkError {
                                    sink: slot.sink.name().into(),
                                    message: format!("panicked: {}", panic_message(&*p)),
                                })
                            });
                        if let Err(e) = result {
                            report.errors.push(e.to_string());
                            slot.failed = true;
                        }
                        ok &= !slot.failed;
                    }
                    // A failed sink keeps failing: every later record is counted as dropped for it.
                    if ok && sinks.iter().all(|s| !s.failed) {
                        hp.counters.exported(rows);
                    } else {
                        hp.counters.dropped(DropReason::SinkError, rows);
                    }
                }
                None => report.errors.push(format!(
                    "record {} names unknown hookpoint id {id}",
                    view.header.seq
                )),
            }
            consumer.advance();
            unreleased += 1;
            if unreleased >= options.release_every {
                consumer.release();
                unreleased = 0;
            }
        }
        consumer.release();
        if drained_any {
            idle = Duration::from_micros(20);
        } else if consumer.is_finished() {
            break;
        } else {
            std::thread::sleep(idle);
            idle = (idle * 2).min(options.max_idle_sleep);
        }
    }
    close_sinks(&mut sinks, &mut report);
    report.elapsed = started.elapsed();
    report
}

fn close_sinks(sinks: &mut [SinkSlot], report: &mut DrainReport) {
    for slot in sinks.iter_mut() {
        let result = catch_unwind(AssertUnwindSafe(|| slot.sink.close())).unwrap_or_else(|p| {
            Err(SinkError {
                sink: slot.sink.name().into(),
                message: format!("panicked on close: {}", panic_message(&*p)),
            })
        });
        if let Err(e) = result {
            report.errors.push(e.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::{CallbackSink, SummarySink};
    use ringscope_hookpoint::{capture_host, HookPointSpec, SiteKind, StepBatch};
    use ringscope_policy::{LossPolicy, Mode};
    use ringscope_ring::{channel, DType};

    fn setup() -> (ringscope_ring::Producer, Consumer, Arc<Registry>) {
        let (p, c) = channel(1 << 16).unwrap();
        let reg = Arc::new(Registry::new());
        for l in 0..2 {
            reg.register(HookPointSpec {
                name: format!("layers.{l}.resid"),
                site: SiteKind::Residual,
                layer: Some(l),
                dtype: DType::F16,
                row_width: 8,
            })
            .unwrap();
        }
        (p, c, reg)
    }

    const FULL: LossPolicy = LossPolicy {
        mode: Mode::Full,
        full_deadline: Duration::from_secs(10),
    };

    #[test]
    fn drains_everything_and_accounts_for_it() {
        let (mut p, c, reg) = setup();
        let (summary, handle) = SummarySink::new();
        let drain = Drain::spawn(
            c,
            reg.clone(),
            vec![Box::new(summary)],
            DrainOptions::default(),
        )
        .unwrap();
        for step in 0..500u64 {
            let batch = StepBatch::new(step, [(1, step as u32), (2, step as u32)]).unwrap();
            for hp in reg.all() {
                capture_host(&mut p, &FULL, &hp, &batch, &[step as u8; 32]).unwrap();
            }
        }
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!((report.records, report.rows), (1000, 2000));
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        reg.accounting().check().unwrap();
        let s = handle.lock();
        assert_eq!(s["layers.1.resid"].steps, Some((0, 499)));
        assert_eq!(s["layers.0.resid"].requests, 2);
    }

    #[test]
    fn failing_and_panicking_sinks_are_counted_not_fatal() {
        let (mut p, c, reg) = setup();
        let mut n = 0;
        let flaky = CallbackSink::new("flaky", move |_, _| {
            n += 1;
            if n == 3 {
                Err("disk full".to_string())
            } else {
                Ok(())
            }
        });
        let panicky = CallbackSink::new(
            "panicky",
            |r: &ringscope_ring::RecordView<'_>, _: &HookPoint| {
                if r.header.seq == 5 {
                    panic!("consumer bug");
                }
                Ok(())
            },
        );
        let drain = Drain::spawn(
            c,
            reg.clone(),
            vec![Box::new(flaky), Box::new(panicky)],
            DrainOptions::default(),
        )
        .unwrap();
        let hp = reg.get(0).unwrap();
        for step in 0..10u64 {
            let batch = StepBatch::new(step, [(1, 0)]).unwrap();
            capture_host(&mut p, &FULL, &hp, &batch, &[0; 16]).unwrap();
        }
        drop(p);
        let report = drain.join().unwrap();
        assert_eq!(report.errors.len(), 2, "{:?}", report.errors);
        assert!(
            report.errors[0].contains("disk full") && report.errors[1].contains("consumer bug")
        );
        let acc = reg.accounting();
        acc.check().unwrap();
        let c = acc.hookpoints[0].1;
        assert_eq!(
            (
                c.exported.records,
                c.dropped_for(DropReason::SinkError).records
            ),
            (2, 8)
        );
    }
}
