//! Host ring throughput: one producer thread pushing records of N bytes, one drain thread reading them, against a
//! plain `memcpy` of the same bytes into a buffer of the ring's size (the baseline, measured in the same run).
//!
//! `cargo bench --bench ring_throughput` — results and ratios in docs/benchmarks.md.

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ringscope_ring::{channel, DType, Producer, RecordMeta, ReserveError, RowMeta};

/// Ring sizes: 4 MiB stays in this machine's caches; 64 MiB (the default session ring) does not.
const RINGS: [(usize, &str); 2] = [(4 << 20, "4MiB"), (64 << 20, "64MiB")];
const SIZES: [usize; 6] = [256, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

/// A ring with a drain thread that lives for a whole benchmark, so that measurements see the steady state (the
/// ring's memory warm in the caches, as in a long-running session) rather than a fresh allocation per sample.
struct RingBench {
    producer: Producer,
    consumed: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    drain: Option<std::thread::JoinHandle<()>>,
    pushed: u64,
}

impl RingBench {
    fn new(ring: usize) -> Self {
        let (producer, mut consumer) = channel(ring).unwrap();
        let consumed = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, st) = (consumed.clone(), stop.clone());
        let drain = std::thread::spawn(move || {
            let mut sum = 0u64;
            while !st.load(Ordering::Relaxed) {
                let mut batch = 0;
                while let Some(view) = consumer.peek().unwrap() {
                    // Touch the data the way a sink would start reading it.
                    let d = view.data();
                    sum = sum.wrapping_add(d[0] as u64 + d[d.len() - 1] as u64);
                    consumer.advance();
                    batch += 1;
                    if batch == 32 {
                        consumer.release();
                        c.fetch_add(batch, Ordering::Release);
                        batch = 0;
                    }
                }
                consumer.release();
                c.fetch_add(batch, Ordering::Release);
                // Found the ring empty: back off briefly, as the exporter's drain does (it sleeps), instead of
                // re-reading `head` at once and pulling its cache line away from the producer on every publish.
                for _ in 0..32 {
                    std::hint::spin_loop();
                }
            }
            black_box(sum);
        });
        RingBench { producer, consumed, stop, drain: Some(drain), pushed: 0 }
    }

    /// Pushes `iters` records of `data` and waits until the drain has read them all; returns the wall time.
    fn run(&mut self, iters: u64, data: &[u8]) -> Duration {
        let meta =
            RecordMeta { step: 0, hookpoint: 0, rows: 1, row_bytes: data.len() as u32, dtype: DType::U8, flags: 0 };
        let row = [RowMeta { request_id: 1, position: 0, batch_row: 0 }];
        let started = Instant::now();
        for i in 0..iters {
            let meta = RecordMeta { step: i, ..meta };
            loop {
                match self.producer.try_reserve(meta) {
                    Ok(mut r) => {
                        r.write_rows(&row, data);
                        r.publish();
                        break;
                    }
                    Err(ReserveError::Full { .. }) => std::hint::spin_loop(),
                    Err(e) => panic!("{e}"),
                }
            }
        }
        self.pushed += iters;
        while self.consumed.load(Ordering::Acquire) < self.pushed {
            std::hint::spin_loop();
        }
        started.elapsed()
    }
}

impl Drop for RingBench {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.drain.take().unwrap().join().unwrap();
    }
}

/// Baseline: the same bytes memcpy'd into a buffer of the ring's size at advancing offsets, one thread.
fn memcpy_run(size: usize, iters: u64, data: &[u8], dst: &mut [u8]) -> Duration {
    let started = Instant::now();
    let mut off = 0;
    for _ in 0..iters {
        if off + size > dst.len() {
            off = 0;
        }
        dst[off..off + size].copy_from_slice(data);
        black_box(&dst[off]);
        off += size;
    }
    started.elapsed()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("host_ring");
    for (ring, ring_name) in RINGS {
        let mut dst = vec![1u8; ring];
        for size in SIZES {
            let data: Vec<u8> = (0..size).map(|i| i as u8).collect();
            group.throughput(Throughput::Bytes(size as u64));
            group.bench_with_input(BenchmarkId::new(format!("memcpy_{ring_name}"), size), &size, |b, &size| {
                b.iter_custom(|iters| memcpy_run(size, iters, &data, &mut dst))
            });
            let mut bench = RingBench::new(ring);
            group.bench_with_input(BenchmarkId::new(format!("ring_{ring_name}"), size), &size, |b, _| {
                b.iter_custom(|iters| bench.run(iters, &data))
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
