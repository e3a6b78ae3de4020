//! Parquet sink throughput against raw zstd of the same bytes, measured in the same run, on one core.
//!
//! `cargo bench --bench parquet_sink` — results in docs/benchmarks.md.
//!
//! Data: 8192 token rows of a synthetic 2048-wide bf16 residual stream (32 MiB), in records of 32 rows (a decode
//! step at batch 32), finite values like real activations. Compared, per iteration, on the same bytes:
//! - `zstd1_bulk`: `zstd::bulk::compress` of the whole 32 MiB at level 1 (the ceiling: no framing, one call);
//! - `zstd1_pages`: the same in 1 MiB chunks (Parquet compresses page by page);
//! - `zstd1_records`: each record's 128 KiB of rows compressed on its own (how the sink pages records this big);
//! - `zstd1_pages_to_file`: those pages written to a file, synced and renamed (the least any file sink does);
//! - `parquet_sink`: ringscope's Parquet sink taking the 256 records and closing the file (encode, compress,
//!   write, fsync, rename);
//! - `arrow_writer_generic`: the same batches through parquet's generic `ArrowWriter` (the sink's previous path);
//! - `parquet_sink_uncompressed`: the same sink with compression off.
#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn.

use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ringscope::exporter::dataset::Batch;
use ringscope::exporter::{parquet_sink, DatasetOptions, FileSink, Parquet, Record, Sink};
use ringscope::hookpoint::{HookPointSpec, Registry, SiteKind};
use ringscope::ring::record::{encode_record, RecordMeta, RowMeta};
use ringscope::ring::{DType, RecordView};
use ringscope::synthetic::fill_layer;

const ROWS: usize = 8192;
const WIDTH: u32 = 2048;
const PER_RECORD: usize = 32;
/// Records per batch (row group) at the sink's default 4 MiB batches.
const PER_BATCH: usize = (4 << 20) / (PER_RECORD * WIDTH as usize * 2);

/// The sink's default writer properties at zstd(1) (see `Parquet::with_zstd_level`).
fn zstd_properties() -> parquet::file::properties::WriterProperties {
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
    let mut all = Vec::new();
    let mut records = Vec::new();
    let mut buf = Vec::new();
    for r in 0..ROWS / PER_RECORD {
        let rows: Vec<(u64, u32)> = (0..PER_RECORD).map(|i| (i as u64, r as u32)).collect();
        fill_layer(7, 7, WIDTH, &rows, &mut buf);
        all.extend_from_slice(&buf);
        let meta = RecordMeta {
            step: r as u64,
            hookpoint: hp.id,
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
        records.push(Record::copy_from(&view, Arc::clone(&hp)));
    }
    (records, all)
}

fn bench(c: &mut Criterion) {
    let registry = Registry::new();
    let (records, bytes) = records(&registry);
    let dir = std::env::temp_dir().join(format!("ringscope-bench-{}", std::process::id()));
    let mut group = c.benchmark_group("parquet_sink");
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.sample_size(10).measurement_time(Duration::from_secs(8));

    group.bench_function("zstd1_bulk", |b| b.iter(|| zstd::bulk::compress(&bytes, 1).unwrap().len()));
    group.bench_function("zstd1_pages", |b| {
        b.iter(|| bytes.chunks(1 << 20).map(|c| zstd::bulk::compress(c, 1).unwrap().len()).sum::<usize>())
    });
    // zstd of each record's rows on its own (the sink compresses records of at least 64 KiB in place, as pages).
    group.bench_function("zstd1_records", |b| {
        let mut c = zstd::bulk::Compressor::new(1).unwrap();
        b.iter(|| records.iter().map(|r| c.compress(r.data()).unwrap().len()).sum::<usize>())
    });
    // zstd in pages plus writing the compressed bytes to a file (fsync, rename): what any file sink must do at least.
    let mut n = 0;
    group.bench_function("zstd1_pages_to_file", |b| {
        std::fs::create_dir_all(&dir).unwrap();
        b.iter(|| {
            n += 1;
            let tmp = dir.join(format!(".raw-{n}"));
            let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp).unwrap());
            let mut c = zstd::bulk::Compressor::new(1).unwrap();
            for chunk in bytes.chunks(1 << 20) {
                std::io::Write::write_all(&mut out, &c.compress(chunk).unwrap()).unwrap();
            }
            let file = out.into_inner().unwrap();
            file.sync_all().unwrap();
            std::fs::rename(&tmp, dir.join(format!("raw-{n}"))).unwrap();
        })
    });
    let mut run = 0;
    group.bench_function("parquet_sink", |b| {
        b.iter(|| {
            run += 1;
            let mut options = DatasetOptions::new(&dir);
            options.run_id = format!("bench-{run}");
            let (mut sink, files) = parquet_sink(options, 1).unwrap();
            for r in &records {
                sink.write(r).unwrap();
            }
            sink.close().unwrap();
            let size = files.lock()[0].bytes;
            size
        })
    });
    // The generic path, for comparison (what the sink did before it wrote the activation column itself): the same
    // batches as Arrow record batches (rows copied back to back) through `ArrowWriter`, which holds each row group's
    // compressed column chunks in memory until it closes; same properties, closed, synced and renamed.
    let hp = records[0].hookpoint().clone();
    let schema = ringscope::exporter::dataset::schema(&hp);
    let batches: Vec<&[Record]> = records.chunks(PER_BATCH).collect();
    group.bench_function("arrow_writer_generic", |b| {
        std::fs::create_dir_all(&dir).unwrap();
        b.iter(|| {
            n += 1;
            let tmp = dir.join(format!(".generic-{n}"));
            let out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp).unwrap());
            let props = zstd_properties();
            let mut w = parquet::arrow::ArrowWriter::try_new(out, schema.clone(), Some(props)).unwrap();
            for records in &batches {
                let batch = Batch { schema: &schema, hookpoint: &hp, run_id: "bench", rank: 0, records };
                w.write(&batch.record_batch()).unwrap();
            }
            let file = w.into_inner().unwrap().into_inner().unwrap();
            file.sync_all().unwrap();
            std::fs::rename(&tmp, dir.join(format!("generic-{n}"))).unwrap();
        })
    });
    // The same sink with compression off: what the Parquet writer path costs besides zstd.
    group.bench_function("parquet_sink_uncompressed", |b| {
        b.iter(|| {
            run += 1;
            let mut options = DatasetOptions::new(&dir);
            options.run_id = format!("bench-{run}");
            let activation = parquet::schema::types::ColumnPath::new(vec!["activation".into()]);
            let props = parquet::file::properties::WriterProperties::builder()
                .set_compression(parquet::basic::Compression::UNCOMPRESSED)
                .set_column_dictionary_enabled(activation.clone(), false)
                .set_column_statistics_enabled(activation, parquet::file::properties::EnabledStatistics::None)
                .build();
            let (mut sink, files) = FileSink::create(Parquet::with_properties(props), options).unwrap();
            for r in &records {
                sink.write(r).unwrap();
            }
            sink.close().unwrap();
            let size = files.lock()[0].bytes;
            size
        })
    });
    group.finish();
    let _ = std::fs::remove_dir_all(&dir);
    let sink_size = {
        let mut options = DatasetOptions::new(&dir);
        options.run_id = "size".into();
        let (mut sink, files) = parquet_sink(options, 1).unwrap();
        records.iter().for_each(|r| sink.write(r).unwrap());
        sink.close().unwrap();
        let s = files.lock()[0].bytes;
        let _ = std::fs::remove_dir_all(&dir);
        s
    };
    println!(
        "size ratio: zstd1_bulk {:.3}, parquet file {:.3} (of {} MiB)",
        zstd::bulk::compress(&bytes, 1).unwrap().len() as f64 / bytes.len() as f64,
        sink_size as f64 / bytes.len() as f64,
        bytes.len() >> 20
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
