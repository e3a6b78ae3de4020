//! File sinks end to end: Parquet and Arrow IPC datasets written through a session, read back with the parquet and
//! arrow readers (IPC through a memory map), rows compared bit for bit with the generator; rotation, commit by
//! rename, and what happens when the output directory is unusable or breaks mid-run.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, FixedSizeBinaryArray, RecordBatch, UInt32Array, UInt64Array};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use ringscope::synthetic::{activation_row, fill_layer, EngineConfig, SyntheticEngine};
use ringscope::{Config, DropReason, Error, Session};
use ringscope_exporter::FileError;

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(dir: &Path, layers: u32, hidden: u32, extra: &str) -> Config {
    let mut text = format!(
        "[ring]\ncapacity = \"4 MiB\"\n[export]\nparquet = true\ndir = {:?}\nrun_id = \"r\"\n{extra}\n",
        dir.display().to_string()
    );
    text += &ringscope::synthetic::residual_hookpoints_toml(layers, hidden);
    Config::from_toml(&text).unwrap()
}

fn run(session: &Session, cfg: EngineConfig, mut between_steps: impl FnMut(u64)) -> u64 {
    let mut buf = Vec::new();
    let mut rows = 0;
    for step in SyntheticEngine::new(cfg) {
        between_steps(step.step);
        session.begin_step(step.step, step.rows.iter().copied()).unwrap();
        for layer in 0..cfg.layers {
            fill_layer(cfg.seed, layer, cfg.hidden, &step.rows, &mut buf);
            session.capture(layer, &buf).unwrap();
            rows += step.rows.len() as u64;
        }
        session.end_step().unwrap();
    }
    rows
}

/// Checks every row of `batch` against the generator; returns the number of rows.
fn verify(batch: &RecordBatch, cfg: &EngineConfig, layer: u32) -> u64 {
    let req = batch.column_by_name("request_id").unwrap().as_any().downcast_ref::<UInt64Array>().unwrap();
    let pos = batch.column_by_name("position").unwrap().as_any().downcast_ref::<UInt32Array>().unwrap();
    let act = batch.column_by_name("activation").unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
    let mut want = vec![0u16; cfg.hidden as usize];
    for i in 0..batch.num_rows() {
        activation_row(cfg.seed, layer, req.value(i), pos.value(i), &mut want);
        let bytes: Vec<u8> = want.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(act.value(i), &bytes[..], "layer {layer} request {} position {}", req.value(i), pos.value(i));
    }
    batch.num_rows() as u64
}

/// The data files of extension `ext` under `dir`.
fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.ends_with("_ringscope_events") {
                continue; // the events table: not data
            } else if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == ext) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn layer_of(path: &Path) -> u32 {
    let part = path.parent().unwrap().parent().unwrap().file_name().unwrap().to_string_lossy().into_owned();
    if part == "moved" {
        return 0;
    }
    part.trim_start_matches("hookpoint=layers.").trim_end_matches(".resid").parse().unwrap()
}

#[test]
fn parquet_and_arrow_ipc_round_trip_with_rotation() {
    let dir = tempdir("roundtrip");
    let cfg = EngineConfig { layers: 3, hidden: 128, requests: 24, ..EngineConfig::default() };
    // 64 KiB files: every partition rotates several times.
    let conf = config(&dir, cfg.layers, cfg.hidden, "arrow_ipc = true\nmax_file_size = \"64 KiB\"");
    let session = Session::new(conf).unwrap();
    let rows = run(&session, cfg, |_| {});
    let report = session.shutdown().unwrap();
    let run_dir = dir.join("r");
    assert_eq!(report.run_dir.as_deref(), Some(run_dir.as_path()));

    let parquet = files_with_ext(&run_dir, "parquet");
    assert!(parquet.len() > 3 * 2, "expected rotation, got {} files", parquet.len());
    let mut per_layer: HashMap<u32, u64> = HashMap::new();
    for f in &parquet {
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(f).unwrap()).unwrap();
        let kv: HashMap<_, _> = reader
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .unwrap()
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone().unwrap_or_default()))
            .collect();
        assert_eq!(kv["ringscope.dtype"], "bf16");
        let layer = layer_of(f);
        let mut n = 0;
        for batch in reader.build().unwrap() {
            n += verify(&batch.unwrap(), &cfg, layer);
        }
        assert_eq!(kv["ringscope.file_rows"], n.to_string());
        *per_layer.entry(layer).or_default() += n;
    }
    assert_eq!(per_layer.values().sum::<u64>(), rows);

    // Arrow IPC: memory-mapped, the same rows.
    let mut ipc_rows = 0;
    for f in files_with_ext(&run_dir, "arrow") {
        let file = File::open(&f).unwrap();
        // SAFETY: the file is complete (committed by rename) and nothing writes it while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&map[..]), None).unwrap();
        assert_eq!(reader.custom_metadata()["ringscope.hookpoint"], format!("layers.{}.resid", layer_of(&f)));
        for batch in reader {
            ipc_rows += verify(&batch.unwrap(), &cfg, layer_of(&f));
        }
    }
    assert_eq!(ipc_rows, rows);
    assert_eq!(report.files.len(), parquet.len() + files_with_ext(&run_dir, "arrow").len());
    assert!(files_with_ext(&run_dir, "inprogress").is_empty());
    assert!(run_dir.join(ringscope::manifest::MANIFEST).exists());

    // A run directory is never reused.
    let again = Session::new(config(&dir, 1, 8, "")).err().unwrap().to_string();
    assert!(again.contains("already holds a dump"), "{again}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unusable_output_directory_is_a_clear_error() {
    let dir = tempdir("unusable");
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    std::fs::write(&dir, b"a file, not a directory").unwrap();
    let err = Session::new(config(&dir, 1, 8, "")).err().unwrap();
    assert!(matches!(err, Error::Setting { key: "export.parquet", .. }), "{err:?}");
    assert!(err.to_string().contains("cannot create directory") && err.to_string().contains("unusable"), "{err}");
    // The error behind it is kept, typed: the sink's, naming the directory, and the OS's below that.
    let sink = std::error::Error::source(&err).and_then(|e| e.downcast_ref::<ringscope::SinkError>());
    let Some(ringscope::SinkError::File { source: FileError::CreateDir { dir: failed, source }, .. }) = sink else {
        panic!("{err:?}")
    };
    assert!(failed.starts_with(&dir) && source.kind() != std::io::ErrorKind::Other, "{failed:?} {source:?}");
    std::fs::remove_file(&dir).unwrap();
}

#[test]
fn a_partition_breaking_mid_run_is_counted_and_finished_files_stay_readable() {
    let dir = tempdir("midrun");
    let cfg = EngineConfig { layers: 2, hidden: 128, requests: 24, ..EngineConfig::default() };
    // Best-effort: the engine goes on past the failure (full mode would refuse the next capture; see
    // `full_mode_refuses_captures_once_a_sink_failed_and_a_failed_manifest_leaves_no_debris`).
    let extra = "max_file_size = \"32 KiB\"\n[policy]\nmode = \"best_effort\"";
    let session = Session::new(config(&dir, cfg.layers, cfg.hidden, extra)).unwrap();
    let broken = dir.join("r").join("hookpoint=layers.0.resid");
    let rows = run(&session, cfg, |step| {
        if step == 40 {
            // Wait until layer 0 has committed a file, then replace its partition with a plain file.
            let first = broken.join("rank=0").join("part-00000.parquet");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while !first.exists() {
                assert!(std::time::Instant::now() < deadline, "layer 0 never committed a file");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            // Move its committed files aside (they stay readable there) and block the partition's path.
            std::fs::rename(&broken, dir.join("moved")).unwrap();
            std::fs::write(&broken, b"not a directory").unwrap();
        }
    });
    let report = session.shutdown().unwrap();
    let acc: HashMap<_, _> = report.accounting.hookpoints.iter().cloned().collect();
    let l0 = acc["layers.0.resid"];
    assert!(l0.dropped_for(DropReason::SinkError).rows > 0, "{l0:?}");
    assert!(report.drain.errors.iter().any(|e| e.contains("parquet")), "{:?}", report.drain.errors);
    // The sink stopped at its first error; layer 1's files written before that stay readable and exact.
    let mut readable = 0;
    let mut files = files_with_ext(&dir.join("r"), "parquet");
    files.extend(files_with_ext(&dir.join("moved"), "parquet"));
    for f in files {
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&f).unwrap()).unwrap().build().unwrap();
        for b in reader {
            readable += verify(&b.unwrap(), &cfg, layer_of(&f));
        }
    }
    let total = report.accounting.total();
    assert_eq!(total.exported.rows, readable);
    assert_eq!(total.exported.rows + total.dropped_total().rows, rows);
    // The events table says which steps were lost, and why: from the failure on, every record (the sink stopped).
    let lost: Vec<_> = ringscope::read_events(&dir.join("r")).unwrap();
    assert!(lost.iter().all(|e| e.reason == "sink_error"), "{lost:?}");
    for (hp, c) in &acc {
        let rows: u64 = lost.iter().filter(|e| &e.hookpoint == hp).map(|e| e.rows_lost).sum();
        assert_eq!(rows, c.dropped_for(DropReason::SinkError).rows, "{hp}: {lost:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The Parquet sink's activation pages: small records gathered into pages, records of 64 KiB and more compressed in
/// place (one bigger than a page split over two), in stream order, through zstd (ringscope's own page writer) and
/// without compression (the generic column writer), each written through the page cache and with `O_DIRECT` (where
/// the file system has it; `DirectIo::Auto` falls back otherwise). Every row reads back bit for bit with the right
/// request id, and the zstd file has one offset-index entry per page. A record whose rows have the wrong size is a
/// clear error and counted drops.
#[test]
fn parquet_pages_and_ipc_batches_keep_every_row_in_order_whatever_the_record_sizes() {
    use parquet::file::properties::{EnabledStatistics, WriterProperties};
    use ringscope_exporter::{CatalogEntry, DatasetOptions, DirectIo, FileSink, Parquet, Record, Sink};
    use ringscope_hookpoint::{HookPointSpec, Registry, SiteKind};
    use ringscope_ring::record::{encode_record, RecordMeta, RowMeta};
    use ringscope_ring::{DType, RecordView};

    const WIDTH: u32 = 2048; // bf16: 4 KiB rows, 256 per 1 MiB page
    let registry = Registry::new();
    let hp = registry
        .register(HookPointSpec {
            name: "pages".into(),
            site: SiteKind::Residual,
            layer: Some(0),
            dtype: DType::BF16,
            row_width: WIDTH,
        })
        .unwrap();
    // The export side sees the hookpoint through its catalog entry (same counters).
    let hp = Arc::new(CatalogEntry::new(hp.id(), hp.spec().clone(), hp.counters().clone(), hp.events().clone()));
    let row = |id: u64| -> Vec<u8> {
        if (4..20).contains(&id) {
            // The 64 KiB record: constant rows, a page that compresses to a few bytes (its header gets shorter than
            // the slot sized for zstd's worst case).
            return vec![id as u8; WIDTH as usize * 2];
        }
        let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..WIDTH as usize * 2)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 16) as u8 // 4 bits of entropy per byte: compressible
            })
            .collect()
    };
    // Rows per record: gathered (1, 3, 2, 5), in place (16 = 64 KiB, 40), in place and split (300 > 256).
    let sizes = [1u32, 3, 16, 2, 300, 5, 40, 1];
    let mut next_id = 0u64;
    let records: Vec<Record> = sizes
        .iter()
        .enumerate()
        .map(|(step, &rows)| {
            let ids: Vec<u64> = (next_id..next_id + rows as u64).collect();
            next_id += rows as u64;
            let data: Vec<u8> = ids.iter().flat_map(|&id| row(id)).collect();
            let meta = RecordMeta {
                step: step as u64,
                hookpoint: hp.id(),
                rows,
                row_bytes: WIDTH * 2,
                dtype: DType::BF16,
                flags: 0,
            };
            let metas: Vec<RowMeta> = ids
                .iter()
                .enumerate()
                .map(|(i, &id)| RowMeta { request_id: id, position: 7, batch_row: i as u32 })
                .collect();
            let bytes = encode_record(step as u64, &meta, &metas, &data);
            Record::copy_from(&RecordView::decode(&bytes).unwrap().0, hp.clone()).unwrap()
        })
        .collect();
    let dir = tempdir("pages");
    let uncompressed = WriterProperties::builder()
        .set_compression(parquet::basic::Compression::UNCOMPRESSED)
        .set_column_dictionary_enabled(parquet::schema::types::ColumnPath::new(vec!["activation".into()]), false)
        .set_column_statistics_enabled(
            parquet::schema::types::ColumnPath::new(vec!["activation".into()]),
            EnabledStatistics::None,
        )
        .build();
    let formats = [
        ("zstd", Parquet::with_zstd_level(1).unwrap()),
        ("zstd9", Parquet::with_zstd_level(9).unwrap()),
        ("plain", Parquet::with_properties(uncompressed)),
        ("lz4", Parquet::with_codec(ringscope_exporter::Codec::Lz4).unwrap()),
        ("none", Parquet::with_codec(ringscope_exporter::Codec::Uncompressed).unwrap()),
    ];
    let direct_ios = [("page-cache", DirectIo::Off), ("auto", DirectIo::Auto)];
    for ((format_name, format), (io_name, direct_io)) in
        formats.iter().flat_map(|f| direct_ios.iter().map(move |d| (f.clone(), *d)))
    {
        let name = format!("{format_name}-{io_name}");
        let name = name.as_str();
        let mut options = DatasetOptions::new(&dir);
        options.run_id = name.into();
        options.direct_io = direct_io;
        options.batch_bytes = 512 << 10; // two row groups
        let (mut sink, files) = FileSink::create(format, options).unwrap();
        for r in &records {
            sink.write(r).unwrap();
        }
        sink.close().unwrap();
        let path = files.lock()[0].path.clone();
        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&path).unwrap()).unwrap();
        let meta = reader.metadata().clone();
        let mut seen = 0u64;
        for batch in reader.build().unwrap() {
            expect_rows_in_order(&batch.unwrap(), &mut seen, &row, name);
        }
        assert_eq!(seen, next_id, "{name}");
        assert!(meta.num_row_groups() >= 2, "{name}: {} row groups", meta.num_row_groups());
        let activation = meta.row_group(0).columns().last().unwrap();
        if name.starts_with("zstd") {
            assert!(matches!(activation.compression(), parquet::basic::Compression::ZSTD(_)), "{name}");
            assert!(activation.compressed_size() < activation.uncompressed_size(), "{name}: nothing compressed");
            // Offset index: one page location per page, rows adding up to the row group's.
            let with_index = ParquetRecordBatchReaderBuilder::try_new_with_options(
                File::open(&path).unwrap(),
                parquet::arrow::arrow_reader::ArrowReaderOptions::new()
                    .with_page_index_policy(parquet::file::metadata::PageIndexPolicy::Required),
            )
            .unwrap();
            let index = with_index.metadata().page_index_for_row_group(0);
            let pages = &index.offset_index(11).expect("an offset index").page_locations;
            assert!(pages.len() >= 3, "{name}: {} pages", pages.len());
        }
    }
    // Arrow IPC, the same records: the large one (300 rows, 1.2 MiB) is a batch of its own written from the
    // record's memory, the small ones around it share batches; every row once, in order, every batch's CRC-32 right.
    for (io_name, direct_io) in direct_ios {
        let mut options = DatasetOptions::new(&dir);
        options.run_id = format!("ipc-{io_name}");
        options.direct_io = direct_io;
        let (mut sink, files) = FileSink::create(ringscope_exporter::ArrowIpc, options).unwrap();
        for r in &records {
            sink.write(r).unwrap();
        }
        sink.close().unwrap();
        let path = files.lock()[0].path.clone();
        let bytes = std::fs::read(&path).unwrap();
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(&bytes[..]), None).unwrap();
        let crcs: Vec<(usize, u32)> = serde_json::from_str(&reader.custom_metadata()["ringscope.batch_crc32"]).unwrap();
        assert_eq!(crcs.len(), reader.num_batches(), "{io_name}");
        assert!(reader.num_batches() >= 3, "{io_name}: small, large, small records: {} batches", reader.num_batches());
        let mut start = 0;
        for &(end, crc) in &crcs {
            assert_eq!(crc32fast::hash(&bytes[start..end]), crc, "{io_name}: batch ending at {end}");
            start = end;
        }
        let mut seen = 0u64;
        for batch in reader {
            expect_rows_in_order(&batch.unwrap(), &mut seen, &row, io_name);
        }
        assert_eq!(seen, next_id, "{io_name}");
    }
    // A record whose rows are not the size the file's schema says: a clear error naming it, and its rows counted
    // as dropped (`sink_error`), for both activation writers.
    for (name, format) in [
        ("zstd-bad", Parquet::with_zstd_level(1).unwrap()),
        (
            "plain-bad",
            Parquet::with_properties(
                WriterProperties::builder().set_compression(parquet::basic::Compression::UNCOMPRESSED).build(),
            ),
        ),
    ] {
        let short = WIDTH * 2 - 2;
        let meta = RecordMeta { step: 0, hookpoint: hp.id(), rows: 1, row_bytes: short, dtype: DType::BF16, flags: 0 };
        let bytes =
            encode_record(0, &meta, &[RowMeta { request_id: 1, position: 0, batch_row: 0 }], &vec![0; short as usize]);
        let record = Record::copy_from(&RecordView::decode(&bytes).unwrap().0, hp.clone()).unwrap();
        let before = hp.accounting().dropped_for(DropReason::SinkError).rows;
        let mut options = DatasetOptions::new(&dir);
        options.run_id = name.into();
        let (mut sink, _) = FileSink::create(format, options).unwrap();
        sink.write(&record).unwrap();
        drop(record);
        let err = sink.close().unwrap_err().to_string();
        assert!(err.contains("rows of 4094 bytes") && err.contains("its schema 4096"), "{name}: {err}");
        drop(sink);
        assert_eq!(hp.accounting().dropped_for(DropReason::SinkError).rows, before + 1, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Checks that `batch` holds the rows numbered `*seen`, `*seen + 1`, … (request id = row number) with the bytes
/// `row` makes of each, and advances `*seen` past them.
fn expect_rows_in_order(batch: &RecordBatch, seen: &mut u64, row: &dyn Fn(u64) -> Vec<u8>, name: &str) {
    let req = batch.column_by_name("request_id").unwrap().as_any().downcast_ref::<UInt64Array>().unwrap();
    let act = batch.column_by_name("activation").unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
    for i in 0..batch.num_rows() {
        assert_eq!(req.value(i), *seen, "{name}: rows out of order");
        assert_eq!(act.value(i), &row(*seen)[..], "{name}: row {seen}");
        *seen += 1;
    }
}

/// The metadata columns that are constant in a partition (run id, hookpoint, site, layer, rank, dtype, shape) are
/// written by ringscope in constant time; their column chunks must be byte for byte what parquet's generic column
/// writer makes of the same rows with the same properties, with the same statistics — for a layer and for none (a
/// null column), and for one row group of a few rows as for several of many.
#[test]
fn constant_metadata_columns_match_the_generic_writer_byte_for_byte() {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use ringscope_exporter::{CatalogEntry, DatasetOptions, FileSink, Parquet, Record, Sink};
    use ringscope_hookpoint::{HookPointSpec, Registry, SiteKind};
    use ringscope_ring::record::{encode_record, RecordMeta, RowMeta};
    use ringscope_ring::{DType, RecordView};

    let dir = tempdir("constants");
    let registry = Registry::new();
    for (layer, records, rows) in [(Some(3), 1, 1u32), (None, 5, 7), (Some(0), 40, 100)] {
        let hp = registry
            .register(HookPointSpec {
                name: format!("constants.{layer:?}.{records}"),
                site: SiteKind::Custom("probe_in".into()),
                layer,
                dtype: DType::F16,
                row_width: 64,
            })
            .unwrap();
        // The export side sees the hookpoint through its catalog entry (same counters).
        let hp = Arc::new(CatalogEntry::new(hp.id(), hp.spec().clone(), hp.counters().clone(), hp.events().clone()));
        let recs: Vec<Record> = (0..records)
            .map(|r| {
                let meta =
                    RecordMeta { step: r, hookpoint: hp.id(), rows, row_bytes: 128, dtype: DType::F16, flags: 0 };
                let metas: Vec<RowMeta> = (0..rows)
                    .map(|i| RowMeta { request_id: r * 1000 + i as u64, position: i * 3, batch_row: i })
                    .collect();
                let data: Vec<u8> = (0..rows as usize * 128).map(|i| (i * 31 + r as usize) as u8).collect();
                let bytes = encode_record(r, &meta, &metas, &data);
                Record::copy_from(&RecordView::decode(&bytes).unwrap().0, hp.clone()).unwrap()
            })
            .collect();
        let ours = Parquet::with_zstd_level(1).unwrap();
        let generic = Parquet::with_properties(ours.properties().clone());
        let mut files = Vec::new();
        for (name, format) in [("ours", ours), ("generic", generic)] {
            let mut options = DatasetOptions::new(dir.join(name));
            options.run_id = format!("run-{layer:?}-{records}"); // the same in both files
            options.rank = 2;
            options.batch_bytes = 64 << 10; // several row groups for the bigger cases
            let (mut sink, committed) = FileSink::create(format, options).unwrap();
            for r in &recs {
                sink.write(r).unwrap();
            }
            sink.close().unwrap();
            let path = committed.lock()[0].path.clone();
            files.push((std::fs::read(&path).unwrap(), SerializedFileReader::new(File::open(&path).unwrap()).unwrap()));
        }
        let (ours, generic) = (&files[0], &files[1]);
        let case = format!("layer {layer:?}, {records} records of {rows} rows");
        assert_eq!(ours.1.metadata().num_row_groups(), generic.1.metadata().num_row_groups(), "{case}");
        for g in 0..ours.1.metadata().num_row_groups() {
            let (a, b) = (ours.1.metadata().row_group(g), generic.1.metadata().row_group(g));
            for c in [0, 1, 2, 3, 8, 9, 10] {
                let (x, y) = (a.column(c), b.column(c));
                let what = format!("{case}: row group {g}, column {}", x.column_path());
                let bytes = |file: &[u8], m: &parquet::file::metadata::ColumnChunkMetaData| {
                    let start = m.dictionary_page_offset().unwrap_or(m.data_page_offset()) as usize;
                    file[start..start + m.compressed_size() as usize].to_vec()
                };
                assert_eq!(bytes(&ours.0, x), bytes(&generic.0, y), "{what}: pages");
                assert_eq!(x.num_values(), y.num_values(), "{what}");
                assert_eq!(x.compression(), y.compression(), "{what}");
                assert_eq!(x.encodings().collect::<Vec<_>>(), y.encodings().collect::<Vec<_>>(), "{what}");
                assert_eq!(x.page_encoding_stats(), y.page_encoding_stats(), "{what}");
                let (s, t) = (x.statistics().expect("statistics"), y.statistics().expect("statistics"));
                assert_eq!(s, t, "{what}: statistics");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Full mode and a sink that fails mid-run (its partition directory cannot be created, as on a full disk): the next
/// step is refused with `Error::SinkFailed` naming the sink, `sink_failures` says which, why and when, every record
/// is still accounted; a manifest that cannot be written is `Error::Manifest` naming its path, carrying the report,
/// and leaves no hidden temporary file.
#[test]
fn full_mode_refuses_captures_once_a_sink_failed_and_a_failed_manifest_leaves_no_debris() {
    let dir = tempdir("sinkfail-full");
    let cfg = EngineConfig { layers: 1, hidden: 64, requests: 4, ..EngineConfig::default() };
    let session = Session::new(config(&dir, cfg.layers, cfg.hidden, "[policy]\nmode = \"full\"")).unwrap();
    let run_dir = dir.join("r");
    std::fs::write(run_dir.join("hookpoint=layers.0.resid"), b"in the way").unwrap();
    std::fs::create_dir(run_dir.join("_ringscope_run.json")).unwrap();
    assert!(session.sink_failures().is_empty());

    let before = std::time::SystemTime::now();
    session.begin_step(0, [(1, 0)]).unwrap();
    session.capture(0, &vec![0u8; 2 * cfg.hidden as usize]).unwrap();
    session.end_step().unwrap();
    assert!(session.wait_drained(std::time::Duration::from_secs(10)));
    let failures = session.sink_failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].sink, "parquet");
    assert!(failures[0].message.contains("hookpoint=layers.0.resid"), "{failures:?}");
    assert!(failures[0].at >= before);

    match session.begin_step(1, [(1, 1)]) {
        Err(Error::SinkFailed { sink, message, .. }) => assert!(sink == "parquet" && message.contains("parquet")),
        other => panic!("expected SinkFailed, got {other:?}"),
    }
    match session.capture(0, &vec![0u8; 2 * cfg.hidden as usize]) {
        Err(e @ Error::SinkFailed { .. }) => assert!(e.to_string().contains("best_effort"), "{e}"),
        other => panic!("expected SinkFailed, got {other:?}"),
    }

    let Err(Error::Manifest { path, report, .. }) = session.shutdown() else {
        panic!("the manifest cannot be written")
    };
    assert_eq!(path, run_dir.join("_ringscope_run.json"));
    report.accounting.check().unwrap();
    let total = report.accounting.total();
    assert_eq!((total.produced.records, total.dropped_for(DropReason::SinkError).records), (1, 1));
    assert_eq!(report.sink_failures, failures);
    let hidden: Vec<_> = std::fs::read_dir(&run_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "{hidden:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Full mode with `policy.on_sink_failure = "continue"`: once the sink has failed, capture goes on (no error) and
/// the failed sink's records are counted as `sink_error`; the failure is still listed.
#[test]
fn full_mode_configured_to_continue_past_a_failed_sink_captures_on_and_counts_the_losses() {
    let dir = tempdir("sinkfail-continue");
    let cfg = EngineConfig { layers: 1, hidden: 64, requests: 4, ..EngineConfig::default() };
    let extra = "[policy]\nmode = \"full\"\non_sink_failure = \"continue\"";
    let session = Session::new(config(&dir, cfg.layers, cfg.hidden, extra)).unwrap();
    std::fs::write(dir.join("r").join("hookpoint=layers.0.resid"), b"in the way").unwrap();
    for step in 0..5u64 {
        session.begin_step(step, [(1, step as u32)]).unwrap();
        session.capture(0, &vec![0u8; 2 * cfg.hidden as usize]).unwrap();
        session.end_step().unwrap();
        assert!(session.wait_drained(std::time::Duration::from_secs(10)));
    }
    assert_eq!(session.sink_failures().len(), 1);
    let report = session.shutdown().unwrap();
    let total = report.accounting.total();
    assert_eq!((total.produced.records, total.dropped_for(DropReason::SinkError).records), (5, 5));
    let err = Config::from_toml("[policy]\non_sink_failure = \"retry\"\n").unwrap_err().to_string();
    assert!(err.contains("on_sink_failure") && err.contains("retry"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `export.threads = 3` with one hookpoint: the three sink threads take its records from one queue, each record going
/// to whichever thread is free (so a single hookpoint can keep them all busy; how many each takes depends on timing,
/// see the drain's pool tests); each writes its own files (`part-NNNNN-sK`), and together they hold every row exactly
/// once, bit for bit.
#[test]
fn several_sink_threads_share_one_hookpoint_record_by_record() {
    let dir = tempdir("shards");
    let cfg = EngineConfig { layers: 1, hidden: 128, requests: 24, ..EngineConfig::default() };
    let extra = "threads = 3\narrow_ipc = true\nmax_file_size = \"64 KiB\"";
    let session = Session::new(config(&dir, cfg.layers, cfg.hidden, extra)).unwrap();
    let rows = run(&session, cfg, |_| {});
    let report = session.shutdown().unwrap();
    assert_eq!(report.accounting.total().exported.rows, rows);
    for ext in ["parquet", "arrow"] {
        let files = files_with_ext(&dir.join("r"), ext);
        let mut per_shard = [0u64; 3];
        let mut seen = std::collections::HashSet::new();
        for f in &files {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            let shard: usize = name.rsplit_once("-s").unwrap().1.split('.').next().unwrap().parse().unwrap();
            for b in read_batches(f) {
                per_shard[shard] += verify(&b, &cfg, 0);
                let req = b.column_by_name("request_id").unwrap().as_any().downcast_ref::<UInt64Array>().unwrap();
                let pos = b.column_by_name("position").unwrap().as_any().downcast_ref::<UInt32Array>().unwrap();
                for i in 0..b.num_rows() {
                    assert!(seen.insert((req.value(i), pos.value(i))), "row written twice");
                }
            }
        }
        assert_eq!(per_shard.iter().sum::<u64>(), rows, "{ext}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Full mode with many sink threads and many hookpoints: a sink that took a record of another sink's hookpoint holds
/// it for a batch that grows slowly, and ring space comes back in ring order only — so that one record held the ring
/// behind it until the engine waited past its deadline (found by `benches/full_mode_decode.py`). Records held for
/// batches now leave the ring (for host memory) once they are old or the sink is idle: ~64 laps go through a 4 MiB
/// ring with nothing lost, every row written once.
#[test]
fn full_mode_with_many_sink_threads_never_holds_the_ring_for_slow_batches() {
    let dir = tempdir("held-for-batches");
    let cfg = EngineConfig { layers: 16, hidden: 1024, requests: 160, ..EngineConfig::default() };
    let extra = "threads = 8\n[policy]\nmode = \"full\"\nfull_deadline_ms = 20000";
    let session = Session::new(config(&dir, cfg.layers, cfg.hidden, extra)).unwrap();
    let rows = run(&session, cfg, |_| {});
    assert!(rows * cfg.hidden as u64 * 2 >= 48 * (4 << 20), "at least 48 laps of the ring");
    let report = session.shutdown().unwrap();
    let total = report.accounting.total();
    assert_eq!((total.exported.rows, total.dropped_total().rows), (rows, 0));
    let files = files_with_ext(&dir.join("r"), "parquet");
    let written: u64 = files.iter().flat_map(|f| read_batches(f)).map(|b| b.num_rows() as u64).sum();
    assert_eq!(written, rows);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The record batches of a Parquet or an Arrow IPC file (by its extension).
fn read_batches(f: &Path) -> Vec<RecordBatch> {
    if f.extension().is_some_and(|x| x == "parquet") {
        ParquetRecordBatchReaderBuilder::try_new(File::open(f).unwrap())
            .unwrap()
            .build()
            .unwrap()
            .map(|b| b.unwrap())
            .collect()
    } else {
        arrow::ipc::reader::FileReader::try_new(File::open(f).unwrap(), None).unwrap().map(|b| b.unwrap()).collect()
    }
}

/// Every row of `files` (Parquet or Arrow IPC), checked against the generator.
fn rows_in(files: &[PathBuf], cfg: &EngineConfig) -> u64 {
    files.iter().map(|f| read_batches(f).iter().map(|b| verify(b, cfg, layer_of(f))).sum::<u64>()).sum()
}

/// A flush with file sinks (two formats, two sink threads each) returns once everything captured so far is in
/// committed files — readable before the session closes, bit for bit, no file left in progress — and capture goes on
/// into new files; shutdown then has nothing left to commit.
#[test]
fn flush_commits_the_files_sinks_hold_and_capture_goes_on_into_new_files() {
    let dir = tempdir("flush-commits");
    let cfg = EngineConfig { layers: 2, hidden: 64, requests: 12, ..EngineConfig::default() };
    let session = Session::new(config(&dir, cfg.layers, cfg.hidden, "threads = 2\narrow_ipc = true")).unwrap();
    let run_dir = dir.join("r");
    let in_progress = || files_with_ext(&run_dir, "inprogress"); // `.part-00000.parquet.inprogress`
    let mut before: Vec<PathBuf> = Vec::new();
    let mut total_rows = 0;
    for half in 0..2u64 {
        // Each half its own generator seed (the same request ids and positions, other values): a row of one half
        // does not verify against the other's.
        let cfg = EngineConfig { seed: cfg.seed + half, ..cfg };
        let rows = run(&session, cfg, |_| {});
        total_rows += rows;
        assert!(session.wait_drained(std::time::Duration::from_secs(30)), "flush {half} timed out");
        let total = session.accounting().total();
        assert_eq!((total.exported.rows, total.produced.rows), (total_rows, total_rows), "flush {half}");
        assert!(in_progress().is_empty(), "{:?}", in_progress());
        for ext in ["parquet", "arrow"] {
            let new: Vec<PathBuf> = files_with_ext(&run_dir, ext).into_iter().filter(|f| !before.contains(f)).collect();
            assert!(!new.is_empty(), "flush {half}: no new {ext} file");
            assert_eq!(rows_in(&new, &cfg), rows, "flush {half}: {ext} rows");
            before.extend(new);
        }
    }
    let report = session.shutdown().unwrap();
    report.accounting.check().unwrap();
    assert_eq!(report.accounting.total().exported.rows, total_rows);
    let after: Vec<PathBuf> = ["parquet", "arrow"].iter().flat_map(|ext| files_with_ext(&run_dir, ext)).collect();
    assert_eq!(after.len(), before.len(), "shutdown committed files the flush had not");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `Session::set_metadata` entries land in the manifest's `metadata` object, the last value of a key wins, and bad
/// keys, oversized values, too many keys and a closed session are errors naming what was wrong.
#[test]
fn metadata_entries_are_written_into_the_manifest_and_bad_ones_refused() {
    let dir = tempdir("metadata");
    let session = Session::new(config(&dir, 1, 8, "")).unwrap();
    session.set_metadata("attention", serde_json::json!({"layers": [1]})).unwrap();
    session.set_metadata("attention", serde_json::json!({"layers": [{"layer": 0, "scale": 0.125}]})).unwrap();
    session.set_metadata("model.name-v2", serde_json::json!("tiny")).unwrap();
    for bad in ["", "a b", "ключ", &"k".repeat(65), "a/b"] {
        let e = session.set_metadata(bad, serde_json::json!(1)).unwrap_err().to_string();
        assert!(e.contains("set_metadata: key") && e.contains("A-Z a-z 0-9 _ . -"), "{bad:?}: {e}");
    }
    let big = serde_json::Value::String("x".repeat(ringscope::METADATA_VALUE_MAX));
    let e = session.set_metadata("big", big).unwrap_err().to_string();
    assert!(e.contains("value of `big`") && e.contains("at most"), "{e}");
    for i in 2..ringscope::METADATA_ENTRIES_MAX {
        session.set_metadata(&format!("k{i}"), serde_json::json!(i)).unwrap();
    }
    let e = session.set_metadata("one_more", serde_json::json!(0)).unwrap_err().to_string();
    assert!(e.contains("`one_more` would be entry 65"), "{e}");
    session.set_metadata("k2", serde_json::json!("replaced")).unwrap(); // an existing key is not a new entry
    session.shutdown().unwrap();
    assert!(matches!(session.set_metadata("late", serde_json::json!(0)), Err(Error::Closed)));

    let text = std::fs::read_to_string(dir.join("r").join(ringscope::manifest::MANIFEST)).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let md = &manifest["metadata"];
    assert_eq!(md["attention"], serde_json::json!({"layers": [{"layer": 0, "scale": 0.125}]}));
    assert_eq!(md["model.name-v2"], "tiny");
    assert_eq!(md["k2"], "replaced");
    assert_eq!(md.as_object().unwrap().len(), ringscope::METADATA_ENTRIES_MAX);
    std::fs::remove_dir_all(&dir).unwrap();
}
