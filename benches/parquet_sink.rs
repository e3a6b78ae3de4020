//! Parquet sink throughput against raw zstd of the same bytes, measured in the same run, on one core.
//!
//! `cargo bench --bench parquet_sink` — results in docs/benchmarks.md. After criterion's runs, the same variants
//! run again in interleaved rounds (each round runs every variant once, in a rotating order), so that a noisy
//! machine's slow and fast spells hit all of them alike; it prints each variant's median wall time and CPU time (of
//! the whole process: with `O_DIRECT` the sink's files are written by an I/O thread, whose time counts too), and
//! the sink's throughput as a fraction of each variant's, by both (the ratios the docs quote; "per core" is the CPU
//! one). `RINGSCOPE_BENCH_ROUNDS` sets the rounds (default 25). Files go to `$TMPDIR`.
//!
//! Data: 8192 token rows of a synthetic 2048-wide bf16 residual stream (32 MiB), in records of 32 rows (a decode
//! step at batch 32), finite values like real activations. Compared, per iteration, on the same bytes:
//! - `zstd1_bulk`: `zstd::bulk::compress` of the whole 32 MiB at level 1 (the ceiling: no framing, one call);
//! - `zstd1_pages`: the same in 1 MiB chunks (Parquet compresses page by page);
//! - `zstd1_records`: each record's 128 KiB of rows compressed on its own (how the sink pages records this big);
//! - `zstd1_pages_to_file`: 1 MiB pages written to a file, synced and renamed (the least any file sink does);
//! - `zstd1_records_to_file`: the same with each record's rows as one frame, as the sink pages them;
//! - `parquet_sink`: ringscope's Parquet sink taking the 256 records and closing the file (encode, compress,
//!   write, fsync, rename), with its default `direct_io = auto` (`O_DIRECT` where the file system has it);
//! - `parquet_sink_page_cache`: the same with `direct_io = off`;
//! - `arrow_writer_generic`: the same batches through parquet's generic `ArrowWriter` with the properties the sink
//!   used then (the sink's previous path);
//! - `parquet_sink_uncompressed`: the same sink with compression off;
//! - `parquet_sink_object_memory`: the sink writing to object storage (`export.url`) held in memory
//!   (`object_store`'s `InMemory`): the upload path — parts, multipart uploads completed at commit — without a
//!   server's costs (docs/object-storage.md; `benches/object_storage.py` times a real server).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use ringscope::synthetic::fill_layer;
use ringscope_exporter::dataset::Batch;
use ringscope_exporter::{
    CatalogEntry, DatasetOptions, DirectIo, FileSink, ObjectStorage, Parquet, Record, Sink, StorageOptions,
};
use ringscope_hookpoint::{HookPointSpec, Registry, SiteKind};
use ringscope_ring::record::{encode_record, RecordMeta, RowMeta};
use ringscope_ring::{DType, RecordView};

const ROWS: usize = 8192;
const WIDTH: u32 = 2048;
const PER_RECORD: usize = 32;
/// Records per batch (row group) at the sink's default 4 MiB batches.
const PER_BATCH: usize = (4 << 20) / (PER_RECORD * WIDTH as usize * 2);

/// The writer properties of the sink's previous path (session 4's `Parquet::with_zstd_level(1)`): zstd(1) on every
/// column, metadata columns included, and row groups of up to 128 MiB. Today's sink leaves the metadata columns
/// uncompressed.
fn previous_properties() -> parquet::file::properties::WriterProperties {
    let activation = parquet::schema::types::ColumnPath::new(vec!["activation".into()]);
    parquet::file::properties::WriterProperties::builder()
        .set_writer_version(parquet::file::properties::WriterVersion::PARQUET_1_0)
        .set_compression(parquet::basic::Compression::ZSTD(parquet::basic::ZstdLevel::try_new(1).unwrap()))
        .set_column_dictionary_enabled(activation.clone(), false)
        .set_column_statistics_enabled(activation, parquet::file::properties::EnabledStatistics::None)
        .set_max_row_group_bytes(Some(128 << 20))
        .build()
}

fn records(registry: &Registry) -> (Vec<Record>, Vec<u8>) {
    let hp = registry
        .register(HookPointSpec {
            name: "layers.7.resid".into(),
            site: SiteKind::Residual,
            layer: Some(7),
            dtype: DType::BF16,
            row_width: WIDTH,
        })
        .unwrap();
    // The export side sees the hookpoint through its catalog entry (same counters).
    let hp = Arc::new(CatalogEntry::new(hp.id(), hp.spec().clone(), hp.counters().clone(), hp.events().clone()));
    let mut all = Vec::new();
    let mut records = Vec::new();
    let mut buf = Vec::new();
    for r in 0..ROWS / PER_RECORD {
        let rows: Vec<(u64, u32)> = (0..PER_RECORD).map(|i| (i as u64, r as u32)).collect();
        fill_layer(7, 7, WIDTH, &rows, &mut buf);
        all.extend_from_slice(&buf);
        let meta = RecordMeta {
            step: r as u64,
            hookpoint: hp.id(),
            rows: PER_RECORD as u32,
            row_bytes: WIDTH * 2,
            dtype: DType::BF16,
            flags: 0,
        };
        let metas: Vec<RowMeta> = rows
            .iter()
            .enumerate()
            .map(|(i, &(q, p))| RowMeta { request_id: q, position: p, batch_row: i as u32 })
            .collect();
        let bytes = encode_record(r as u64, &meta, &metas, &buf);
        let (view, _) = RecordView::decode(&bytes).unwrap();
        records.push(Record::copy_from(&view, Arc::clone(&hp)).unwrap());
    }
    (records, all)
}

/// zstd(1) into a reused output buffer.
struct Zstd1 {
    compressor: zstd::bulk::Compressor<'static>,
    out: Vec<u8>,
}

impl Zstd1 {
    fn new(max_input: usize) -> Self {
        let out = Vec::with_capacity(zstd::zstd_safe::compress_bound(max_input));
        Zstd1 { compressor: zstd::bulk::Compressor::new(1).unwrap(), out }
    }

    fn compress(&mut self, data: &[u8]) -> &[u8] {
        self.out.clear();
        self.compressor.compress_to_buffer(data, &mut self.out).unwrap();
        &self.out
    }
}

/// zstd(1) of `chunks`, one frame each, written to a file that is then synced and renamed into place.
fn zstd_to_file<'a>(dir: &Path, n: usize, chunks: impl Iterator<Item = &'a [u8]>) -> usize {
    let tmp = dir.join(format!(".raw-{n}"));
    let mut out = std::io::BufWriter::with_capacity(64 << 10, std::fs::File::create(&tmp).unwrap());
    let mut c = Zstd1::new(1 << 20);
    let mut size = 0;
    for chunk in chunks {
        let z = c.compress(chunk);
        size += z.len();
        std::io::Write::write_all(&mut out, z).unwrap();
    }
    let file = out.into_inner().unwrap();
    file.sync_all().unwrap();
    std::fs::rename(&tmp, dir.join(format!("raw-{n}"))).unwrap();
    size
}

/// The Parquet sink writing all `records` into one closed file under `dir`; returns the file's size.
fn sink_run<F: ringscope_exporter::FileFormat>(
    format: F,
    direct_io: DirectIo,
    dir: &Path,
    n: usize,
    records: &[Record],
) -> usize {
    let mut options = DatasetOptions::new(dir);
    options.run_id = format!("bench-{n}");
    options.direct_io = direct_io;
    let (mut sink, files) = FileSink::create(format, options).unwrap();
    for r in records {
        sink.write(r).unwrap();
    }
    sink.close().unwrap();
    let size = files.lock()[0].bytes as usize;
    size
}

/// [`sink_run`] to object storage in memory (a store of its own per run); returns the object's size.
fn object_sink_run(n: usize, records: &[Record]) -> usize {
    let store = Arc::new(object_store::memory::InMemory::new());
    let storage = ObjectStorage::with_store(store, "memory://bench", "", StorageOptions::default());
    let mut options = DatasetOptions::on_storage(storage);
    options.run_id = format!("bench-{n}");
    let (mut sink, files) = FileSink::create(Parquet::with_zstd_level(1).unwrap(), options).unwrap();
    for r in records {
        sink.write(r).unwrap();
    }
    sink.close().unwrap();
    let size = files.lock()[0].bytes as usize;
    size
}

type Variant<'a> = (&'static str, Box<dyn FnMut(usize) -> usize + 'a>);

/// Every variant compared, on the same bytes; each call does the whole 32 MiB once (`n` numbers its files).
fn variants<'a>(records: &'a [Record], bytes: &'a [u8], dir: &'a Path) -> Vec<Variant<'a>> {
    let hp = records[0].hookpoint().clone();
    let schema = ringscope_exporter::dataset::schema(&hp);
    // The zstd baselines compress into one reused output buffer: zstd at its fastest, no allocation per call.
    let mut bulk = Zstd1::new(bytes.len());
    let mut pages = Zstd1::new(1 << 20);
    let mut per_record = Zstd1::new(records[0].data().len());
    let uncompressed = {
        let activation = parquet::schema::types::ColumnPath::new(vec!["activation".into()]);
        parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::UNCOMPRESSED)
            .set_column_dictionary_enabled(activation.clone(), false)
            .set_column_statistics_enabled(activation, parquet::file::properties::EnabledStatistics::None)
            .build()
    };
    vec![
        ("zstd1_bulk", Box::new(move |_| bulk.compress(bytes).len())),
        ("zstd1_pages", Box::new(move |_| bytes.chunks(1 << 20).map(|c| pages.compress(c).len()).sum())),
        ("zstd1_records", Box::new(move |_| records.iter().map(|r| per_record.compress(r.data()).len()).sum())),
        ("zstd1_pages_to_file", Box::new(move |n| zstd_to_file(dir, n, bytes.chunks(1 << 20)))),
        (
            "zstd1_records_to_file",
            Box::new(move |n| zstd_to_file(dir, n + (1 << 30), records.iter().map(Record::data))),
        ),
        (
            "parquet_sink",
            Box::new(move |n| sink_run(Parquet::with_zstd_level(1).unwrap(), DirectIo::Auto, dir, n, records)),
        ),
        (
            "parquet_sink_page_cache",
            Box::new(move |n| {
                sink_run(Parquet::with_zstd_level(1).unwrap(), DirectIo::Off, dir, n + (1 << 29), records)
            }),
        ),
        // The generic path, for comparison (what the sink did before it wrote the activation column itself): the
        // same 4 MiB batches as Arrow record batches (rows copied back to back) through `ArrowWriter` with the
        // properties the sink had then, closed, synced and renamed.
        (
            "arrow_writer_generic",
            Box::new(move |n| {
                let tmp = dir.join(format!(".generic-{n}"));
                let out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp).unwrap());
                let mut w =
                    parquet::arrow::ArrowWriter::try_new(out, schema.clone(), Some(previous_properties())).unwrap();
                for records in records.chunks(PER_BATCH) {
                    let batch = Batch { schema: &schema, hookpoint: &hp, run_id: "bench", rank: 0, records };
                    w.write(&batch.record_batch()).unwrap();
                }
                let file = w.into_inner().unwrap().into_inner().unwrap();
                file.sync_all().unwrap();
                let size = file.metadata().unwrap().len() as usize;
                std::fs::rename(&tmp, dir.join(format!("generic-{n}"))).unwrap();
                size
            }),
        ),
        // The sink with compression off (the generic column writer then writes the activation column too).
        (
            "parquet_sink_uncompressed",
            Box::new(move |n| {
                sink_run(Parquet::with_properties(uncompressed.clone()), DirectIo::Auto, dir, n + (1 << 30), records)
            }),
        ),
        ("parquet_sink_object_memory", Box::new(move |n| object_sink_run(n, records))),
    ]
}

fn main() {
    let registry = Registry::new();
    let (records, bytes) = records(&registry);
    let dir: PathBuf = std::env::temp_dir().join(format!("ringscope-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut n = 0;
    let mut criterion = Criterion::default().configure_from_args();
    {
        let mut group = criterion.benchmark_group("parquet_sink");
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        group.sample_size(10).measurement_time(Duration::from_secs(8));
        for (name, mut f) in variants(&records, &bytes, &dir) {
            group.bench_function(name, |b| {
                b.iter(|| {
                    n += 1;
                    f(n)
                })
            });
            clean(&dir);
        }
        group.finish();
    }
    criterion.final_summary();

    // Interleaved rounds.
    let rounds: usize = std::env::var("RINGSCOPE_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(25);
    if rounds == 0 || std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let mut vs = variants(&records, &bytes, &dir);
    // `RINGSCOPE_BENCH_ONLY=parquet_sink` (a comma-separated list) keeps only those variants, e.g. under a profiler.
    if let Ok(only) = std::env::var("RINGSCOPE_BENCH_ONLY") {
        vs.retain(|(name, _)| only.split(',').any(|o| o == *name));
    }
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); vs.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); vs.len()];
    let mut sizes = vec![0; vs.len()];
    for round in 0..rounds + 1 {
        for k in 0..vs.len() {
            let i = (k + round) % vs.len();
            n += 1;
            let (t, c) = (Instant::now(), process_cpu_seconds());
            sizes[i] = (vs[i].1)(n);
            if round > 0 {
                // Round 0 warms up.
                wall[i].push(t.elapsed().as_secs_f64());
                cpu[i].push(process_cpu_seconds() - c);
            }
        }
        clean(&dir);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let wall: Vec<f64> = wall.iter_mut().map(median).collect();
    let cpu: Vec<f64> = cpu.iter_mut().map(median).collect();
    let sink = vs.iter().position(|(name, _)| *name == "parquet_sink");
    let (sink_wall, sink_cpu) = sink.map_or((f64::NAN, f64::NAN), |i| (wall[i], cpu[i]));
    let mib = bytes.len() as f64 / (1 << 20) as f64;
    println!(
        "\ninterleaved: {rounds} rounds, medians of wall and process CPU time; sink ÷ variant = the sink's throughput \
         as a fraction of the variant's"
    );
    println!(
        "{:<28} {:>8} {:>8} {:>9} {:>11} {:>11} {:>7}",
        "variant", "wall ms", "CPU ms", "MiB/s", "sink÷ wall", "sink÷ CPU", "size"
    );
    for (i, (name, _)) in vs.iter().enumerate() {
        println!(
            "{name:<28} {:>8.1} {:>8.1} {:>9.0} {:>11.2} {:>11.2} {:>7.3}",
            wall[i] * 1e3,
            cpu[i] * 1e3,
            mib / wall[i],
            wall[i] / sink_wall,
            cpu[i] / sink_cpu,
            sizes[i] as f64 / bytes.len() as f64
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// CPU time of the whole process (every thread, those that have exited included), in seconds.
fn process_cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec for the call's duration; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Removes the files a round wrote (tmpfs fills up otherwise).
fn clean(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
}
