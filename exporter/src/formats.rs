//! The two file formats: Parquet (zstd-compressed, for storage and analytics) and Arrow IPC (uncompressed, for
//! fast local reading and memory-mapping).

use std::fs::File;
use std::io::BufWriter;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::FileWriter;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterVersion};
use parquet::schema::types::ColumnPath;

use crate::files::{CommittedFiles, FileFormat, FileSink};
use crate::sink::SinkError;
use crate::DatasetOptions;

/// Parquet files with zstd.
#[derive(Debug, Clone)]
pub struct Parquet {
    properties: WriterProperties,
}

impl Parquet {
    /// Parquet with zstd at `level` (1 is the fast default; higher compresses a little more, much slower).
    ///
    /// Settings that matter for speed (measured, see `docs/benchmarks.md`): the activation column is one
    /// fixed-size binary value per row, PLAIN-encoded, with no dictionary and no statistics; writer version 1
    /// (version 2 switches fixed-length columns to DELTA_BYTE_ARRAY, which is slower and no smaller here). The small
    /// columns keep dictionaries and statistics, so readers can prune by step or request.
    pub fn with_zstd_level(level: i32) -> Result<Self, String> {
        let level = ZstdLevel::try_new(level).map_err(|e| format!("zstd level {level}: {e}"))?;
        let activation = ColumnPath::new(vec!["activation".to_owned()]);
        let properties = WriterProperties::builder()
            .set_writer_version(WriterVersion::PARQUET_1_0)
            .set_compression(Compression::ZSTD(level))
            .set_column_dictionary_enabled(activation.clone(), false)
            .set_column_statistics_enabled(activation, EnabledStatistics::None)
            .set_max_row_group_bytes(Some(128 << 20))
            .build();
        Ok(Parquet { properties })
    }
}

impl Parquet {
    /// Parquet with writer properties of your own (compression, page and row group sizes, ...). Keep the activation
    /// column's dictionary off: every row is distinct.
    pub fn with_properties(properties: WriterProperties) -> Self {
        Parquet { properties }
    }
}

impl FileFormat for Parquet {
    type Writer = ArrowWriter<BufWriter<File>>;
    const EXT: &'static str = "parquet";
    const NAME: &'static str = "parquet";
    const SUBDIR: &'static str = "";

    fn create(&self, out: BufWriter<File>, schema: &SchemaRef) -> Result<Self::Writer, String> {
        ArrowWriter::try_new(out, schema.clone(), Some(self.properties.clone())).map_err(|e| e.to_string())
    }

    fn write(&self, writer: &mut Self::Writer, batch: &RecordBatch) -> Result<(), String> {
        writer.write(batch).map_err(|e| e.to_string())
    }

    fn finish(&self, mut writer: Self::Writer, metadata: Vec<(String, String)>) -> Result<File, String> {
        for (k, v) in metadata {
            writer.append_key_value_metadata(KeyValue::new(k, v));
        }
        let out = writer.into_inner().map_err(|e| e.to_string())?;
        out.into_inner().map_err(|e| e.error().to_string())
    }
}

/// Arrow IPC files (the random-access "file" format), uncompressed so readers can memory-map them.
#[derive(Debug, Clone, Default)]
pub struct ArrowIpc;

impl FileFormat for ArrowIpc {
    type Writer = FileWriter<BufWriter<File>>;
    const EXT: &'static str = "arrow";
    const NAME: &'static str = "arrow_ipc";
    const SUBDIR: &'static str = "_arrow_ipc";

    fn create(&self, out: BufWriter<File>, schema: &SchemaRef) -> Result<Self::Writer, String> {
        FileWriter::try_new(out, schema).map_err(|e| e.to_string())
    }

    fn write(&self, writer: &mut Self::Writer, batch: &RecordBatch) -> Result<(), String> {
        writer.write(batch).map_err(|e| e.to_string())
    }

    fn finish(&self, mut writer: Self::Writer, metadata: Vec<(String, String)>) -> Result<File, String> {
        for (k, v) in metadata {
            writer.write_metadata(k, v);
        }
        writer.finish().map_err(|e| e.to_string())?;
        let out = writer.into_inner().map_err(|e| e.to_string())?;
        out.into_inner().map_err(|e| e.error().to_string())
    }
}

/// A Parquet dataset sink.
pub type ParquetSink = FileSink<Parquet>;
/// An Arrow IPC dataset sink.
pub type ArrowIpcSink = FileSink<ArrowIpc>;

/// A Parquet sink under `options.run_dir()` with zstd at `zstd_level`.
pub fn parquet_sink(options: DatasetOptions, zstd_level: i32) -> Result<(ParquetSink, CommittedFiles), SinkError> {
    let format =
        Parquet::with_zstd_level(zstd_level).map_err(|message| SinkError { sink: "parquet".into(), message })?;
    FileSink::create(format, options)
}

/// An Arrow IPC sink under `options.run_dir()`.
pub fn arrow_ipc_sink(options: DatasetOptions) -> Result<(ArrowIpcSink, CommittedFiles), SinkError> {
    FileSink::create(ArrowIpc, options)
}
