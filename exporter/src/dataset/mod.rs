//! The on-disk dataset: directory layout, the Arrow schema of a dump, turning records into Arrow batches, and the
//! [`FileSink`] that writes them as committed files. How the bytes of one file are encoded is the business of a
//! [`FileFormat`] (the `writing` module implements Parquet and Arrow IPC).
//!
//! ```text
//! <root>/<run_id>/hookpoint=<name>/rank=<rank>/part-00000.parquet
//! <root>/<run_id>/_arrow_ipc/hookpoint=<name>/rank=<rank>/part-00000.arrow   (when Arrow IPC is on)
//! <root>/<run_id>/_ringscope_events/part-00000.parquet                      (once something was lost)
//! ```
//!
//! The Arrow IPC copy lives under `_arrow_ipc/`: dataset readers skip `_`-prefixed paths, so pointing pyarrow at
//! the run directory reads the Parquet files only. The [`events`] table (what was dropped, when and why; rung
//! changes) is Parquet for both formats.
//!
//! One table row per captured token row. The activation is one fixed-size binary value per row holding the raw
//! little-endian elements; its dtype and shape are in the `dtype` and `shape` columns and in the field and file
//! metadata (`ringscope.dtype`, `ringscope.shape`), so bf16 — which neither Arrow nor Parquet has — is read back
//! with no guessing. `hookpoint` (string) and `rank` (int32) are stored in the files *and* named in the
//! directories, with the types that pyarrow, DuckDB and Polars infer for Hive partitions, so all three read a whole
//! run as one table.
//!
//! **Downcast rows** (records of dtype `f8e4m3_rowscaled`, written when the policy turned a hookpoint's downcast on)
//! have another row size, and a file holds one fixed-size activation column: they go to a file series of their own,
//! in a subdirectory of the partition named after the dtype,
//!
//! ```text
//! <root>/<run_id>/hookpoint=<name>/rank=<rank>/_f8e4m3_rowscaled/part-00000.parquet
//! ```
//!
//! with the same columns (the activation is `row_width + 4` bytes: the row's `f32` scale, then the E4M3 bytes;
//! `dtype` says `f8e4m3_rowscaled`, `ringscope.layout` describes the bytes). The leading `_` keeps the series out of
//! a plain dataset read of the run (pyarrow, DuckDB and Polars skip `_`-prefixed paths), so such a read still finds
//! one schema per hookpoint — and only the full-precision rows. `inspect`, `ringscope.read_dump` and
//! `ringscope.stream.iter_batches` read both series and dequantize the downcast rows.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    ArrayRef, FixedSizeBinaryArray, Int32Array, Int64Array, ListArray, RecordBatch, StringArray, UInt32Array,
    UInt64Array,
};
use arrow::buffer::{Buffer, OffsetBuffer};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use ringscope_ring::DType;
use serde::de::IntoDeserializer;
use serde::Deserialize;

use crate::routing::catalog::CatalogEntry;
use crate::routing::record::Record;
use crate::storage::ObjectStorage;

mod error;
pub mod events;
mod files;
mod lock;

pub use error::{FileError, FormatError, OptionsError};
pub use events::{read_events, EventRecorder, EventsFile, EventsReport, EventsTable, TableFormat, EVENTS_DIR};
pub use files::{CommittedFile, CommittedFiles, Destination, FileFormat, FileSink, FinishedFile, Stored};
pub use lock::{lock_file_name, RunLock};

/// How a file sink writes its files (`export.direct_io` in a session config: `"auto"`, `"on"` or `"off"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirectIo {
    /// `O_DIRECT` where the file system accepts it (Linux) and keeps files on a device; through the page cache on
    /// a file system that keeps them in memory (tmpfs, where a direct write is a copy into the file's pages too,
    /// and the page cache lets an Arrow IPC file take records from the ring as they lie) and where `O_DIRECT` is
    /// refused.
    #[default]
    Auto,
    /// Always `O_DIRECT`; a file system (or platform) without it is an error when the file is created.
    On,
    /// Through the page cache.
    Off,
}

impl std::str::FromStr for DirectIo {
    type Err = OptionsError;

    /// The names a config file uses (serde's, so the two cannot disagree).
    fn from_str(s: &str) -> Result<Self, OptionsError> {
        let de: serde::de::value::StrDeserializer<'_, serde::de::value::Error> = s.into_deserializer();
        DirectIo::deserialize(de).map_err(|_| OptionsError::DirectIo(s.to_owned()))
    }
}

/// Where a dump goes and how its rows are labelled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetOptions {
    /// Output root; the run's directory is `root/run_id`.
    pub root: PathBuf,
    /// Names the run (a directory). Defaults to a UTC timestamp.
    pub run_id: String,
    /// Rank of this process among the engine's workers (tensor/pipeline parallel), a partition key.
    pub rank: u32,
    /// Start a new file in a partition once this many activation bytes were written to the current one.
    pub max_file_bytes: u64,
    /// Records are held per hookpoint and written in batches of about this many activation bytes; each batch is one
    /// Parquet row group (and one Arrow IPC record batch).
    pub batch_bytes: usize,
    /// Most activation bytes held for batches across all of a sink's hookpoints: past it, the hookpoint holding the
    /// most is written at once (a smaller row group). Held records keep their ring space, so this must stay well
    /// below the ring's capacity (the session sets it to at most a quarter of it).
    pub max_pending_bytes: usize,
    /// This sink is shard `k` of several sinks writing the same partitions (`export.threads` > 1, each record going to
    /// whichever sink is free): its files are named `part-NNNNN-sK.<ext>` so that they never collide with another shard's. A
    /// hookpoint's rows are then spread over the shards' files (each in stream order; sort by `step` across files).
    pub file_shard: Option<u32>,
    /// Whether files are written with `O_DIRECT` (past the page cache): `Auto` where the file system supports it
    /// and is not memory-backed. Each open file has a writer thread and up to three buffers of about `batch_bytes`
    /// (or, through the page cache, records lent to it: Arrow IPC batches written from the ring's memory).
    pub direct_io: DirectIo,
    /// Object storage the run is written to instead of a local directory ([`DatasetOptions::on_storage`]): `root`
    /// is then the storage's URL as a path, and every file a multipart upload to its final name.
    pub storage: Option<ObjectStorage>,
}

impl DatasetOptions {
    /// Options for a run under `root` with defaults: run id from the clock, rank 0, 256 MiB files, 4 MiB batches.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        DatasetOptions {
            root: root.into(),
            run_id: default_run_id(),
            rank: 0,
            max_file_bytes: 256 << 20,
            batch_bytes: 4 << 20,
            max_pending_bytes: 64 << 20,
            file_shard: None,
            direct_io: DirectIo::Auto,
            storage: None,
        }
    }

    /// Options for a run on object storage (`root` is its URL, `s3://bucket/prefix`), otherwise the defaults of
    /// [`new`](Self::new).
    pub fn on_storage(storage: ObjectStorage) -> Self {
        DatasetOptions { storage: Some(storage.clone()), ..DatasetOptions::new(storage.root()) }
    }

    /// The run's directory.
    pub fn run_dir(&self) -> PathBuf {
        self.root.join(&self.run_id)
    }

    /// A hookpoint's partition directory under `run_dir/subdir` (`subdir` is empty for Parquet).
    pub fn partition_dir(&self, subdir: &str, hookpoint: &str) -> PathBuf {
        self.run_dir().join(subdir).join(format!("hookpoint={hookpoint}")).join(format!("rank={}", self.rank))
    }

    /// Checks the options before anything is written.
    pub fn validate(&self) -> Result<(), OptionsError> {
        // A directory name every tool can show and every shell can type: no separators, no control characters
        // (a newline in a run id splits log lines and file listings), at most 255 bytes.
        if self.run_id.is_empty()
            || self.run_id.len() > 255
            || self.run_id.contains(['/', '\\'])
            || self.run_id.starts_with('.')
            || self.run_id.chars().any(char::is_control)
        {
            return Err(OptionsError::RunId(self.run_id.clone()));
        }
        if self.root.as_os_str().is_empty() {
            return Err(OptionsError::EmptyRoot);
        }
        if self.max_file_bytes == 0 || self.batch_bytes == 0 || self.max_pending_bytes == 0 {
            return Err(OptionsError::ZeroSize);
        }
        Ok(())
    }
}

/// `run-YYYYMMDDTHHMMSSZ-<pid>`, from the system clock.
pub fn default_run_id() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("run-{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z-{}", rem / 3600, rem % 3600 / 60, rem % 60, std::process::id())
}

/// Metadata keys written by ringscope (field metadata on `activation`, and file metadata).
pub mod keys {
    /// Element type name of the activation (`bf16`, `f16`, ...).
    pub const DTYPE: &str = "ringscope.dtype";
    /// Shape of one row, as a JSON list (`[2048]`).
    pub const SHAPE: &str = "ringscope.shape";
    /// Record format version.
    pub const FORMAT_VERSION: &str = "ringscope.format_version";
    /// Run id.
    pub const RUN_ID: &str = "ringscope.run_id";
    /// Hookpoint name, site and layer.
    pub const HOOKPOINT: &str = "ringscope.hookpoint";
    /// Site kind.
    pub const SITE: &str = "ringscope.site";
    /// Layer (absent when the hookpoint has none).
    pub const LAYER: &str = "ringscope.layer";
    /// Token rows and records in this file.
    pub const FILE_ROWS: &str = "ringscope.file_rows";
    /// Records in this file.
    pub const FILE_RECORDS: &str = "ringscope.file_records";
    /// The hookpoint's accounting (JSON) as of this file's close: produced, exported, dropped by reason, sampled out
    /// and in flight (not yet exported or dropped, this file's records included) at that moment. The final numbers
    /// are in the run manifest.
    pub const ACCOUNTING: &str = "ringscope.accounting";
    /// How the bytes of an activation are laid out, for dtypes where the element type does not say it all
    /// (`f8e4m3_rowscaled`: [`ROWSCALED_LAYOUT`]). Absent for plain element arrays.
    pub const LAYOUT: &str = "ringscope.layout";
    /// Arrow IPC files only: per record batch, in file order, `[end, crc]` (a JSON list of them): the offset in the
    /// file where the batch's message ends, and the CRC-32 of the file's bytes from the previous batch's end (0 for
    /// the first) to that end. (Parquet pages carry their CRCs in their headers.)
    pub const BATCH_CRC32: &str = "ringscope.batch_crc32";
    /// Arrow IPC files only: the CRC-32 (8 lowercase hex digits) of the file's bytes after the last record batch's
    /// end — end-of-stream marker, footer, footer length, magic — taken with this value written as `00000000`
    /// ([`check_ipc_footer`](crate::writing::check_ipc_footer)). With [`BATCH_CRC32`], every byte of the
    /// file is covered.
    pub const FOOTER_CRC32: &str = "ringscope.footer_crc32";
}

/// The value of [`keys::LAYOUT`] for `f8e4m3_rowscaled` activations.
pub const ROWSCALED_LAYOUT: &str = "f32le scale, then row_width float8_e4m3fn bytes; value = e4m3 * scale";

/// Subdirectory of a hookpoint's partition holding its rows of `dtype` when that is not the hookpoint's own dtype
/// (downcast rows: `_f8e4m3_rowscaled`).
pub fn dtype_subdir(dtype: DType) -> String {
    format!("_{}", dtype.name())
}

/// The schema of one hookpoint's files (of its own dtype).
pub fn schema(hp: &CatalogEntry) -> SchemaRef {
    schema_for(hp, hp.spec().dtype)
}

/// The schema of one hookpoint's files of records of `dtype` (its own, or the dtype its rows are downcast to).
pub fn schema_for(hp: &CatalogEntry, dtype: DType) -> SchemaRef {
    let spec = hp.spec();
    let mut activation_meta = HashMap::from([
        (keys::DTYPE.to_owned(), dtype.name().to_owned()),
        (keys::SHAPE.to_owned(), format!("[{}]", spec.row_width)),
    ]);
    if dtype == DType::F8E4M3RowScaled {
        activation_meta.insert(keys::LAYOUT.to_owned(), ROWSCALED_LAYOUT.to_owned());
    }
    let row_bytes = dtype.row_bytes(spec.row_width as u64) as i32;
    Arc::new(Schema::new(vec![
        Field::new("run_id", DataType::Utf8, false),
        Field::new("hookpoint", DataType::Utf8, false),
        Field::new("site", DataType::Utf8, false),
        Field::new("layer", DataType::Int32, true),
        Field::new("step", DataType::UInt64, false),
        Field::new("request_id", DataType::UInt64, false),
        Field::new("position", DataType::UInt32, false),
        Field::new("batch_row", DataType::UInt32, false),
        Field::new("rank", DataType::Int32, false),
        Field::new("dtype", DataType::Utf8, false),
        Field::new("shape", DataType::List(Arc::new(Field::new("item", DataType::Int64, false))), false),
        Field::new("activation", DataType::FixedSizeBinary(row_bytes), false).with_metadata(activation_meta),
    ]))
}

/// Columns of the schema before the activation.
pub(crate) const METADATA_COLUMNS: usize = 11;

/// A metadata column's value in every row of a batch (see [`Batch::constant`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Constant<'a> {
    /// A string column.
    Str(&'a str),
    /// An `Int32` column, null when `None`.
    Int32(Option<i32>),
    /// A `List<Int64>` column of one element.
    Int64List(i64),
}

/// One hookpoint's records that a file sink writes together: one Arrow batch, one Parquet row group.
pub struct Batch<'a> {
    /// The hookpoint's file schema ([`schema`]).
    pub schema: &'a SchemaRef,
    /// The hookpoint.
    pub hookpoint: &'a CatalogEntry,
    /// Run id and rank, written into every row.
    pub run_id: &'a str,
    /// See `run_id`.
    pub rank: u32,
    /// The records, in stream order.
    pub records: &'a [Record],
}

impl Batch<'_> {
    /// Token rows in the batch.
    pub fn rows(&self) -> usize {
        self.records.iter().map(Record::rows).sum()
    }

    /// The dtype of the batch's rows: the schema's (`ringscope.dtype` on the activation field), which is the
    /// hookpoint's own or, for a downcast file series, the dtype its rows were downcast to.
    pub fn dtype(&self) -> DType {
        self.schema
            .field(METADATA_COLUMNS)
            .metadata()
            .get(keys::DTYPE)
            .and_then(|name| name.parse().ok())
            .unwrap_or(self.hookpoint.spec().dtype)
    }

    /// The size of a row in bytes, after checking that every record's rows have the size the schema says (and its
    /// dtype: a file never mixes downcast and full-precision rows).
    pub fn row_bytes(&self) -> Result<usize, FormatError> {
        let dtype = self.dtype();
        let want = dtype.row_bytes(self.hookpoint.spec().row_width as u64) as u32;
        match self.records.iter().find(|r| r.header().meta.row_bytes != want || r.header().meta.dtype != dtype) {
            Some(r) => Err(FormatError::RowSize {
                seq: r.header().seq,
                hookpoint: self.hookpoint.name().to_owned(),
                found: r.header().meta.row_bytes,
                schema: want,
            }),
            None => Ok(want as usize),
        }
    }

    /// Every column of the schema except the last, the activation: what is known per row besides its data.
    pub fn metadata_columns(&self) -> Vec<ArrayRef> {
        let n = self.rows();
        let mut varying = self.varying_columns().into_iter();
        let constant = |value: Constant| -> ArrayRef {
            match value {
                Constant::Str(s) => Arc::new(StringArray::from_iter_values(std::iter::repeat_n(s, n))),
                Constant::Int32(v) => Arc::new(Int32Array::from(vec![v; n])),
                Constant::Int64List(v) => Arc::new(ListArray::new(
                    Arc::new(Field::new("item", DataType::Int64, false)),
                    OffsetBuffer::from_lengths(std::iter::repeat_n(1, n)),
                    Arc::new(Int64Array::from(vec![v; n])),
                    None,
                )),
            }
        };
        (0..METADATA_COLUMNS)
            .map(|i| match self.constant(i) {
                Some(value) => constant(value),
                None => varying.next().expect("four varying columns"),
            })
            .collect()
    }

    /// The value of metadata column `index` when it is the same in every row of the batch (of the hookpoint's
    /// partition, in fact): run id, hookpoint, site, layer, rank, dtype, shape.
    pub(crate) fn constant(&self, index: usize) -> Option<Constant<'_>> {
        let spec = self.hookpoint.spec();
        Some(match index {
            0 => Constant::Str(self.run_id),
            1 => Constant::Str(&spec.name),
            2 => Constant::Str(spec.site.name()),
            3 => Constant::Int32(spec.layer.map(|l| l as i32)),
            8 => Constant::Int32(Some(self.rank as i32)),
            9 => Constant::Str(self.dtype().name()),
            10 => Constant::Int64List(spec.row_width as i64),
            _ => return None,
        })
    }

    /// The metadata columns that vary from row to row, in schema order: step, request id, position, batch row.
    pub(crate) fn varying_columns(&self) -> [ArrayRef; 4] {
        let n = self.rows();
        let (mut steps, mut request_ids) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut positions, mut batch_rows) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for record in self.records {
            let step = record.step();
            for m in record.view().row_metas() {
                steps.push(step);
                request_ids.push(m.request_id);
                positions.push(m.position);
                batch_rows.push(m.batch_row);
            }
        }
        [
            Arc::new(UInt64Array::from(steps)),
            Arc::new(UInt64Array::from(request_ids)),
            Arc::new(UInt32Array::from(positions)),
            Arc::new(UInt32Array::from(batch_rows)),
        ]
    }

    /// The whole batch as Arrow columns. The activations of a batch of one record share the record's memory (no
    /// copy); those of several records are copied once, back to back.
    pub fn record_batch(&self) -> RecordBatch {
        let activations = match self.records {
            [one] => Buffer::from(one.data_bytes()),
            records => {
                let bytes: usize = records.iter().map(|r| r.data().len()).sum();
                let mut activations = Vec::with_capacity(bytes);
                for record in records {
                    activations.extend_from_slice(record.data());
                }
                Buffer::from_vec(activations)
            }
        };
        let mut columns = self.metadata_columns();
        let row_bytes = self.dtype().row_bytes(self.hookpoint.spec().row_width as u64) as i32;
        columns.push(Arc::new(FixedSizeBinaryArray::new(row_bytes, activations, None)));
        RecordBatch::try_new(self.schema.clone(), columns).expect("columns are built to match the schema")
    }
}

/// File metadata describing a finished file of records of `dtype`.
pub(crate) fn file_metadata(
    hp: &CatalogEntry,
    dtype: DType,
    run_id: &str,
    records: u64,
    rows: u64,
) -> Vec<(String, String)> {
    let spec = hp.spec();
    let snapshot = hp.accounting();
    // A snapshot taken while the run goes on: records not yet exported or dropped are `in_flight` (this file's among
    // them, until it is committed), so that the numbers add up and never claim more than the final manifest. This
    // file's records are *not* counted as exported here: a record is exported only once every sink has it, which
    // this sink cannot know (another sink may yet lose it); what this file holds is `ringscope.file_rows`.
    let outcomes = snapshot.exported + snapshot.dropped_total() + snapshot.sampled_out;
    let in_flight = serde_json::json!({
        "records": snapshot.produced.records.saturating_sub(outcomes.records),
        "rows": snapshot.produced.rows.saturating_sub(outcomes.rows),
    });
    let accounting = serde_json::json!({
        "produced": snapshot.produced,
        "exported": snapshot.exported,
        "in_flight": in_flight,
        "sampled_out": snapshot.sampled_out,
        "dropped": ringscope_policy::DropReason::ALL
            .iter()
            .map(|r| (r.name().to_owned(), serde_json::to_value(snapshot.dropped_for(*r)).expect("plain numbers")))
            .collect::<serde_json::Map<_, _>>(),
    });
    let mut kv = vec![
        (keys::FORMAT_VERSION.to_owned(), ringscope_ring::record::FORMAT_VERSION.to_string()),
        (keys::RUN_ID.to_owned(), run_id.to_owned()),
        (keys::HOOKPOINT.to_owned(), spec.name.clone()),
        (keys::SITE.to_owned(), spec.site.name().to_owned()),
        (keys::DTYPE.to_owned(), dtype.name().to_owned()),
        (keys::SHAPE.to_owned(), format!("[{}]", spec.row_width)),
        (keys::FILE_ROWS.to_owned(), rows.to_string()),
        (keys::FILE_RECORDS.to_owned(), records.to_string()),
        (keys::ACCOUNTING.to_owned(), accounting.to_string()),
    ];
    if let Some(layer) = spec.layer {
        kv.push((keys::LAYER.to_owned(), layer.to_string()));
    }
    if dtype == DType::F8E4M3RowScaled {
        kv.push((keys::LAYOUT.to_owned(), ROWSCALED_LAYOUT.to_owned()));
    }
    kv
}

/// `part-00042.<ext>`: the committed name of a partition's 42nd file; `part-00042-s3.<ext>` for a sink that is shard
/// 3 of several writing the same partitions ([`DatasetOptions::file_shard`]).
pub(crate) fn part_name(index: u32, shard: Option<u32>, ext: &str) -> String {
    match shard {
        None => format!("part-{index:05}.{ext}"),
        Some(s) => format!("part-{index:05}-s{s}.{ext}"),
    }
}

/// The in-progress name of a file: hidden (leading `.`), so pyarrow ignores it and `*.parquet` globs miss it.
pub(crate) fn in_progress_path(dir: &Path, index: u32, shard: Option<u32>, ext: &str) -> PathBuf {
    dir.join(format!(".{}.inprogress", part_name(index, shard, ext)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_directory_names() {
        let id = default_run_id();
        assert!(id.starts_with("run-20") && id.len() > 20, "{id}");
        let mut o = DatasetOptions::new("/tmp/x");
        assert!(o.validate().is_ok());
        o.run_id = "a/b".into();
        assert!(o.validate().unwrap_err().to_string().contains("a/b"));
        o.run_id = "r1".into();
        o.rank = 3;
        assert_eq!(o.partition_dir("", "layers.0.resid"), PathBuf::from("/tmp/x/r1/hookpoint=layers.0.resid/rank=3"));
        // Issue 28: control characters were accepted (a newline in a run id splits every listing).
        for bad in ["a\nb", "tab\there", "nul\0", "\u{7f}", ".hidden", ""] {
            o.run_id = bad.into();
            let e = o.validate().unwrap_err().to_string();
            assert!(e.contains("control characters"), "{bad:?}: {e}");
        }
        o.run_id = "x".repeat(256);
        assert!(o.validate().is_err());
        o.run_id = "ünïcode-run 1".into();
        assert!(o.validate().is_ok());
        // An empty output root wrote into the working directory.
        let empty = DatasetOptions { root: PathBuf::new(), ..DatasetOptions::new("") };
        assert!(empty.validate().unwrap_err().to_string().contains("export.dir is empty"));
    }
}
