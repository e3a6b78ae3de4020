//! Writing: how the bytes of one file are laid out and reach the disk. The two [`FileFormat`]s — Parquet
//! (zstd-compressed, for storage and analytics) and Arrow IPC (uncompressed, for fast local reading and
//! memory-mapping) — and what they stand on: Parquet pages written by us ([`pages`], [`constants`]) and files
//! written through our own buffers, with `O_DIRECT` where possible ([`output`]).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::ipc::writer::FileWriter;
use bytes::Bytes;
use parquet::arrow::arrow_writer::{compute_leaves, ArrowRowGroupWriterFactory, ArrowWriterOptions};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::column::writer::{ColumnCloseResult, ColumnWriterImpl};
use parquet::data_type::{ByteArray, FixedLenByteArray, FixedLenByteArrayType};
use parquet::errors::ParquetError;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterPropertiesPtr, WriterVersion};
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::ColumnDescPtr;
use parquet::schema::types::ColumnPath;

pub(crate) mod checksums;
pub(crate) mod constants;
pub mod output;
pub(crate) mod pages;

use crate::dataset::keys;
use crate::dataset::{
    Batch, CommittedFiles, DatasetOptions, Destination, EventRecorder, EventsTable, FileFormat, FileSink, FinishedFile,
    FormatError, OptionsError, TableFormat,
};
use crate::routing::record::Record;
use crate::routing::sink::SinkError;
use crate::storage::ObjectStorage;
pub use checksums::{check_ipc_footer, FOOTER_CRC_PLACEHOLDER};
use checksums::{BatchCrcs, ChunkPageWriter, PageBlobs};
use constants::constant_chunk;
use output::{Buffer, Output, ALIGN};
use pages::{ActivationPages, Placeholder, SpliceWriter};

/// Opens the output of a new file: its buffers hold a whole batch, so the Parquet sink can compress a row group's
/// activation column into one.
fn open(to: Destination<'_>, options: &DatasetOptions) -> std::io::Result<Output> {
    let buffer_bytes = options.batch_bytes + options.batch_bytes / 8 + (64 << 10);
    match to {
        Destination::File(path) => Output::create(path, options.direct_io, buffer_bytes),
        Destination::Object(storage, path) => Output::upload(storage.upload(path)?, path, buffer_bytes),
    }
}

/// Finishes `out` and says whether every byte went out with `O_DIRECT` (read after the last write: with `auto`, a
/// file system that rejects a direct write sends the rest through the page cache).
fn finish(out: Output) -> Result<FinishedFile, FormatError> {
    let direct = out.direct_writes();
    let file = out.finish()?;
    Ok(FinishedFile { file, direct_io: direct.load(Ordering::Relaxed) })
}

/// How a Parquet sink compresses the activation column (the metadata columns are small and never compressed).
///
/// bf16 activations compress only to about 0.8 of their size with zstd, at roughly half a GB/s per core at level 1;
/// `Lz4` is several times faster and compresses less, `Uncompressed` costs only the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// zstd at a level (1 is the fast default; higher compresses a little more, much slower).
    Zstd {
        /// The zstd level.
        level: i32,
    },
    /// LZ4 (Parquet's `LZ4_RAW`).
    Lz4,
    /// No compression.
    Uncompressed,
}

/// Parquet files: activations compressed with a [`Codec`] (zstd by default).
#[derive(Debug, Clone)]
pub struct Parquet {
    properties: WriterProperties,
    /// The properties are ours ([`Parquet::with_zstd_level`]): the constant metadata columns are written in constant
    /// time ([`constants`]), as their properties say (uncompressed, dictionary, statistics).
    defaults: bool,
}

impl Parquet {
    /// Parquet with zstd at `level` (1 is the fast default; higher compresses a little more, much slower).
    ///
    /// Settings that matter for speed (measured, see `docs/benchmarks.md`): the activation column is one
    /// fixed-size binary value per row, PLAIN-encoded, with no dictionary and no statistics; writer version 1
    /// (version 2 switches fixed-length columns to DELTA_BYTE_ARRAY, which is slower and no smaller here). The small
    /// columns keep dictionaries and statistics, so readers can prune by step or request, and are not compressed.
    pub fn with_zstd_level(level: i32) -> Result<Self, OptionsError> {
        Parquet::with_codec(Codec::Zstd { level })
    }

    /// Parquet with the activation column compressed by `codec`, and otherwise the settings of
    /// [`with_zstd_level`](Self::with_zstd_level).
    pub fn with_codec(codec: Codec) -> Result<Self, OptionsError> {
        let compression = match codec {
            Codec::Zstd { level } => Compression::ZSTD(
                ZstdLevel::try_new(level).map_err(|e| OptionsError::ZstdLevel { level, why: e.to_string() })?,
            ),
            Codec::Lz4 => Compression::LZ4_RAW,
            Codec::Uncompressed => Compression::UNCOMPRESSED,
        };
        let activation = activation_path();
        // The metadata columns are dictionary- and run-length encoded, a few bytes per row; zstd would shrink them
        // little and cost each column writer of each row group two zstd contexts (measured: a few percent).
        let properties = WriterProperties::builder()
            .set_writer_version(WriterVersion::PARQUET_1_0)
            .set_compression(Compression::UNCOMPRESSED)
            .set_column_compression(activation.clone(), compression)
            .set_column_dictionary_enabled(activation.clone(), false)
            .set_column_statistics_enabled(activation, EnabledStatistics::None)
            .build();
        Ok(Parquet { properties, defaults: true })
    }
}

impl Parquet {
    /// The writer properties.
    pub fn properties(&self) -> &WriterProperties {
        &self.properties
    }

    /// Parquet with writer properties of your own (compression, page size, statistics, ...). Keep the activation
    /// column's dictionary off: every row is distinct. Row groups are the sink's batches
    /// ([`DatasetOptions::batch_bytes`](crate::dataset::DatasetOptions::batch_bytes)); the row group limits in `properties`
    /// do not apply.
    pub fn with_properties(properties: WriterProperties) -> Self {
        Parquet { properties, defaults: false }
    }
}

/// An open Parquet file: the file writer and the factory of its row groups' column writers.
pub struct ParquetWriter {
    file: SerializedFileWriter<SpliceWriter>,
    columns: ArrowRowGroupWriterFactory,
    row_groups: usize,
    page_bytes: usize,
    properties: WriterPropertiesPtr,
    /// The pages the Arrow column writers encode, given their CRCs before they go to the file.
    blobs: PageBlobs,
    /// The activation column's own page writer, when it is zstd-compressed (other codecs use the generic writer).
    pages: Option<ActivationPages>,
    /// See [`Parquet::defaults`].
    constants: bool,
}

impl std::fmt::Debug for ParquetWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetWriter").field("row_groups", &self.row_groups).finish_non_exhaustive()
    }
}

impl FileFormat for Parquet {
    type Writer = ParquetWriter;
    const EXT: &'static str = "parquet";
    const NAME: &'static str = "parquet";
    const SUBDIR: &'static str = "";

    fn create(
        &self,
        to: Destination<'_>,
        options: &DatasetOptions,
        schema: &SchemaRef,
    ) -> Result<Self::Writer, FormatError> {
        let out = open(to, options)?;
        // The Arrow writer sets up the file exactly as it would (Parquet schema from the Arrow one, the Arrow schema
        // in the footer for readers); its lower-level halves then let each batch be written column after column.
        let blobs = PageBlobs::default();
        let options = ArrowWriterOptions::new()
            .with_properties(self.properties.clone())
            .with_page_store_factory(Arc::new(blobs.clone()));
        let (file, columns) = ArrowWriter::try_new_with_options(SpliceWriter::new(out), schema.clone(), options)
            .and_then(ArrowWriter::into_serialized_writer)?;
        let page_bytes = self.properties.column_data_page_size_limit(&activation_path());
        let pages = match self.properties.compression(&activation_path()) {
            Compression::ZSTD(level) => Some(ActivationPages::new(level, page_bytes)?),
            _ => None,
        };
        let properties = Arc::new(self.properties.clone());
        Ok(ParquetWriter {
            file,
            columns,
            row_groups: 0,
            page_bytes,
            properties,
            blobs,
            pages,
            constants: self.defaults,
        })
    }

    fn write(&self, writer: &mut Self::Writer, batch: &Batch<'_>) -> Result<(), FormatError> {
        let row_bytes = batch.row_bytes()?;
        Ok(write_row_group(writer, batch, row_bytes)?)
    }

    fn finish(&self, mut writer: Self::Writer, metadata: Vec<(String, String)>) -> Result<FinishedFile, FormatError> {
        for (k, v) in metadata {
            writer.file.append_key_value_metadata(KeyValue::new(k, v));
        }
        let out = writer.file.into_inner()?;
        finish(out.into_inner())
    }
}

/// Writes `batch` as one row group. The metadata columns go through Arrow's column writers (a few bytes per row);
/// the activation column, last in the schema and nearly all of the bytes, is written straight from the records: by
/// [`ActivationPages`] when it is zstd-compressed (the default), else by the generic column writer, still without
/// copying the rows into an Arrow array first. Every page carries its CRC ([`checksums`]).
fn write_row_group(writer: &mut ParquetWriter, batch: &Batch<'_>, row_bytes: usize) -> parquet::errors::Result<()> {
    let mut column_writers = writer.columns.create_column_writers(writer.row_groups)?;
    writer.row_groups += 1;
    column_writers.pop(); // the activation's: written below
    let mut chunks: Vec<(Bytes, ColumnCloseResult)> = Vec::with_capacity(column_writers.len());
    // With our defaults the constant columns are written in constant time, the others through Arrow's column
    // writers; with properties of the user's own, every column through Arrow's.
    let mut arrays: Box<dyn Iterator<Item = arrow::array::ArrayRef>> = match writer.constants {
        true => Box::new(batch.varying_columns().into_iter()),
        false => Box::new(batch.metadata_columns().into_iter()),
    };
    let rows = batch.rows();
    for ((i, mut column), field) in column_writers.into_iter().enumerate().zip(batch.schema.fields()) {
        match batch.constant(i).filter(|_| writer.constants) {
            Some(value) => chunks.push(constant_chunk(writer.file.schema_descr().column(i), value, rows)?),
            None => {
                let array = arrays.next().expect("an array for every column not written as a constant");
                for leaf in compute_leaves(field, &array)? {
                    column.write(&leaf)?;
                }
                let close = column.close()?.close().clone(); // its pages are in `blobs`
                chunks.push(writer.blobs.take_chunk(i, close)?);
            }
        }
    }
    // The activation chunk is encoded first, into a buffer of the output, and handed to the file for its byte range,
    // right after the metadata columns' chunks (see `SpliceWriter`).
    let activation = writer.file.schema_descr().column(chunks.len());
    let start = writer.file.bytes_written() as u64 + chunks.iter().map(|(b, _)| b.len() as u64).sum::<u64>();
    let lead = (start % ALIGN as u64) as usize;
    let mut chunk = writer.file.inner_mut().output().take_buffer()?;
    let close = match writer.pages.as_mut() {
        Some(pages) => pages.encode(activation, batch.records, row_bytes, &mut chunk, lead)?,
        None => {
            let properties = writer.properties.clone();
            encode_activations(activation, properties, batch, row_bytes, writer.page_bytes, &mut chunk, lead)?
        }
    };
    let len = close.metadata.compressed_size() as u64;
    writer.file.inner_mut().splice(start, chunk, lead)?;
    let mut row_group = writer.file.next_row_group()?;
    for (bytes, close) in chunks {
        row_group.append_column(&bytes, close)?;
    }
    row_group.append_column(&Placeholder(len), close)?;
    let meta = row_group.close()?;
    writer.file.flush()?; // the writer's own buffer may still hold the placeholder's last bytes
    writer.file.inner_mut().end_splice()?;
    let placed = meta.columns().last().map(|c| {
        let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
        (start as u64, c.compressed_size() as u64)
    });
    if placed != Some((start, len)) {
        return Err(ParquetError::General(format!(
            "the Parquet writer placed the activation chunk at {placed:?}, not at ({start}, {len}) where it was spliced"
        )));
    }
    Ok(())
}

/// The activation column chunk through parquet's generic column writer (codecs other than zstd, or the user's
/// properties), its pages written into `chunk` after `lead` bytes by a [`ChunkPageWriter`].
fn encode_activations(
    column: ColumnDescPtr,
    properties: WriterPropertiesPtr,
    batch: &Batch<'_>,
    row_bytes: usize,
    page_bytes: usize,
    chunk: &mut Buffer,
    lead: usize,
) -> parquet::errors::Result<ColumnCloseResult> {
    chunk.clear();
    chunk.extend(&[0; ALIGN][..lead])?;
    let pages = Box::new(ChunkPageWriter { chunk, lead });
    let mut column = ColumnWriterImpl::<FixedLenByteArrayType>::new(column, properties, pages);
    write_activations(&mut column, batch, row_bytes, page_bytes)?;
    column.close()
}

/// The rows of `batch` as fixed-length values that share the records' memory, handed to the column writer about
/// one data page at a time (it decides page boundaries after each call).
fn write_activations(
    column: &mut ColumnWriterImpl<'_, FixedLenByteArrayType>,
    batch: &Batch<'_>,
    row_bytes: usize,
    page_bytes: usize,
) -> parquet::errors::Result<()> {
    let per_call = (page_bytes / row_bytes.max(1)).max(1);
    let mut values = Vec::with_capacity(per_call);
    for record in batch.records {
        let data = record.data_bytes();
        for i in 0..record.rows() {
            values.push(FixedLenByteArray::from(ByteArray::from(data.slice(i * row_bytes..(i + 1) * row_bytes))));
            if values.len() == per_call {
                column.write_batch(&values, None, None)?;
                values.clear();
            }
        }
    }
    if !values.is_empty() {
        column.write_batch(&values, None, None)?;
    }
    Ok(())
}

fn activation_path() -> ColumnPath {
    ColumnPath::new(vec!["activation".to_owned()])
}

/// Records of at least this many bytes of rows are written to Arrow IPC files as batches of their own, without a
/// copy (copying them into a fresh batch faulted in new pages for every large record: the IPC sink's main cost).
const OWN_IPC_BATCH_BYTES: usize = 1 << 20;

/// Arrow IPC files (the random-access "file" format), uncompressed so readers can memory-map them.
#[derive(Debug, Clone, Default)]
pub struct ArrowIpc;

impl FileFormat for ArrowIpc {
    type Writer = FileWriter<BatchCrcs<Output>>;
    const EXT: &'static str = "arrow";
    const NAME: &'static str = "arrow_ipc";
    const SUBDIR: &'static str = "_arrow_ipc";

    fn create(
        &self,
        to: Destination<'_>,
        options: &DatasetOptions,
        schema: &SchemaRef,
    ) -> Result<Self::Writer, FormatError> {
        Ok(FileWriter::try_new(BatchCrcs::new(open(to, options)?), schema)?)
    }

    /// A record of at least [`OWN_IPC_BATCH_BYTES`] is an IPC batch of its own, its activation column the record's
    /// memory; runs of smaller records share one batch, their rows copied once, back to back. arrow's writer streams
    /// uncompressed buffers without copying them, and a file written through the page cache takes the activation
    /// column as it lies ([`Output::lend`]): the record's rows reach the file without a copy of ours.
    fn write(&self, writer: &mut Self::Writer, batch: &Batch<'_>) -> Result<(), FormatError> {
        batch.row_bytes()?;
        let small = |r: &Record| r.data().len() < OWN_IPC_BATCH_BYTES;
        for records in batch.records.chunk_by(|a, b| small(a) && small(b)) {
            let record_batch = Batch { records, ..*batch }.record_batch();
            let activations =
                record_batch.column_by_name("activation").and_then(|c| c.to_data().buffers().first().cloned());
            writer.get_mut().inner_mut().lend(activations.map(Bytes::from_owner));
            let written = writer.write(&record_batch);
            writer.get_mut().inner_mut().lend(None);
            written?;
            writer.get_mut().end_batch();
        }
        Ok(())
    }

    fn finish(&self, mut writer: Self::Writer, metadata: Vec<(String, String)>) -> Result<FinishedFile, FormatError> {
        for (k, v) in metadata {
            writer.write_metadata(k, v);
        }
        let crcs = writer.get_ref().metadata();
        writer.write_metadata(keys::BATCH_CRC32, crcs);
        writer.write_metadata(keys::FOOTER_CRC32, checksums::FOOTER_CRC_PLACEHOLDER);
        writer.get_mut().hold_footer();
        writer.finish()?;
        let mut crcs = writer.into_inner()?;
        crcs.write_footer()?;
        finish(crcs.into_inner())
    }
}

/// Small tables in one Parquet row group (the events table): every column through Arrow's column writers,
/// uncompressed, each page with its CRC ([`checksums`]) like the dump's own files.
#[derive(Debug, Clone, Default)]
pub struct ParquetTable;

impl TableFormat for ParquetTable {
    const EXT: &'static str = "parquet";

    fn write<W: std::io::Write + Send>(
        &self,
        file: W,
        batch: &RecordBatch,
        metadata: Vec<(String, String)>,
    ) -> Result<W, FormatError> {
        let blobs = PageBlobs::default();
        let options = ArrowWriterOptions::new()
            .with_properties(WriterProperties::builder().set_compression(Compression::UNCOMPRESSED).build())
            .with_page_store_factory(Arc::new(blobs.clone()));
        let (mut file, columns) =
            ArrowWriter::try_new_with_options(std::io::BufWriter::new(file), batch.schema(), options)
                .and_then(ArrowWriter::into_serialized_writer)?;
        let mut chunks = Vec::with_capacity(batch.num_columns());
        for (i, (mut column, field)) in
            columns.create_column_writers(0)?.into_iter().zip(batch.schema().fields()).enumerate()
        {
            for leaf in compute_leaves(field, batch.column(i))? {
                column.write(&leaf)?;
            }
            let close = column.close()?.close().clone(); // its pages are in `blobs`
            chunks.push(blobs.take_chunk(i, close)?);
        }
        let mut row_group = file.next_row_group()?;
        for (bytes, close) in chunks {
            row_group.append_column(&bytes, close)?;
        }
        row_group.close()?;
        for (k, v) in metadata {
            file.append_key_value_metadata(KeyValue::new(k, v));
        }
        let out = file.into_inner()?;
        Ok(out.into_inner().map_err(|e| e.into_error())?)
    }
}

/// The thread that writes `log` into the events table of `run_dir` as it happens (see [`EventRecorder`]), as rank
/// `rank`'s files; on `storage` when the run is on object storage.
pub fn event_recorder(
    run_dir: &Path,
    rank: u32,
    storage: Option<ObjectStorage>,
    log: Arc<ringscope_policy::EventLog>,
) -> Result<EventRecorder, crate::ExporterError> {
    let table = EventsTable::with_rank(ParquetTable, run_dir, rank).on_storage(storage);
    EventRecorder::spawn(log, table, EventRecorder::EVERY)
}

/// A Parquet dataset sink.
pub type ParquetSink = FileSink<Parquet>;
/// An Arrow IPC dataset sink.
pub type ArrowIpcSink = FileSink<ArrowIpc>;

/// A Parquet sink under `options.run_dir()`, its activations compressed with `codec`.
pub fn parquet_sink(options: DatasetOptions, codec: Codec) -> Result<(ParquetSink, CommittedFiles), SinkError> {
    let format =
        Parquet::with_codec(codec).map_err(|e| SinkError::File { sink: Parquet::NAME.into(), source: e.into() })?;
    FileSink::create(format, options)
}

/// An Arrow IPC sink under `options.run_dir()`.
pub fn arrow_ipc_sink(options: DatasetOptions) -> Result<(ArrowIpcSink, CommittedFiles), SinkError> {
    FileSink::create(ArrowIpc, options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::{schema, DirectIo};
    use crate::testing::TestCatalog;
    use crate::Sink;
    use arrow::array::{Array, FixedSizeBinaryArray};
    use ringscope_policy::DropReason;
    use ringscope_ring::record::{encode_record, RecordMeta, RecordView, RowMeta};

    #[test]
    fn ipc_batches_reach_a_page_cache_file_from_the_records_memory() {
        let catalog = TestCatalog::layers(1, 1024);
        let entry = catalog.entry(0);
        let row_bytes = entry.spec().row_bytes();
        let record = |rows: u32, first: u32| {
            let meta = RecordMeta { step: 3, hookpoint: 0, rows, row_bytes, dtype: entry.spec().dtype, flags: 0 };
            let metas: Vec<RowMeta> = (first..first + rows)
                .map(|i| RowMeta { request_id: u64::from(i), position: i, batch_row: i - first })
                .collect();
            let data: Vec<u8> = (0..rows * row_bytes).map(|i| ((i + first * row_bytes) % 251) as u8).collect();
            let bytes = encode_record(0, &meta, &metas, &data);
            Record::copy_from(&RecordView::decode(&bytes).unwrap().0, entry.clone()).unwrap()
        };
        // A record of 2 MiB of rows (a batch of its own: its memory), then four of 128 KiB (one batch, gathered).
        let records = vec![record(1024, 0), record(64, 1024), record(64, 1088), record(64, 1152), record(64, 1216)];
        let all_rows: Vec<&[u8]> = records.iter().flat_map(|r| (0..r.rows()).map(|i| r.row(i))).collect();
        let bytes: usize = records.iter().map(|r| r.data().len()).sum();
        let dir = std::env::temp_dir().join(format!("ringscope-ipc-lent-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let schema = schema(&entry);
        for direct_io in [DirectIo::Off, DirectIo::Auto] {
            let path = dir.join("part.arrow");
            let mut options = DatasetOptions::new(&dir);
            options.direct_io = direct_io;
            let mut writer = ArrowIpc.create(Destination::File(&path), &options, &schema).unwrap();
            let batch = Batch { schema: &schema, hookpoint: &entry, run_id: "r", rank: 0, records: &records };
            ArrowIpc.write(&mut writer, &batch).unwrap();
            let out = writer.get_ref().inner();
            if out.is_direct() {
                assert_eq!(out.lent_written(), 0, "{direct_io:?}: direct writes copy");
            } else {
                // All but the partial blocks at the two ends of each batch's activations.
                let lent = out.lent_written() as usize;
                assert!(lent + 4 * ALIGN >= bytes, "{direct_io:?}: {lent} of {bytes} bytes written as they lie");
            }
            ArrowIpc.finish(writer, Vec::new()).unwrap();
            let reader = arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&path).unwrap(), None).unwrap();
            let batches: Vec<_> = reader.map(Result::unwrap).collect();
            assert_eq!(batches.len(), 2, "{direct_io:?}: the large record, then the small ones together");
            let read: Vec<&[u8]> = batches
                .iter()
                .flat_map(|b| {
                    let act = b.column_by_name("activation").unwrap();
                    let act = act.as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
                    (0..act.len()).map(|i| act.value(i)).collect::<Vec<_>>()
                })
                .collect();
            assert!(read == all_rows, "{direct_io:?}: every row, in order, as captured");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Records of hookpoint `hp` of `catalog`, each `rows` rows of a pattern that names the record (`first`).
    fn records_of(catalog: &TestCatalog, hp: u32, count: u32, rows: u32) -> Vec<Record> {
        let entry = catalog.entry(hp);
        let row_bytes = entry.spec().row_bytes();
        (0..count)
            .map(|k| {
                let first = k * rows;
                let meta = RecordMeta {
                    step: u64::from(k),
                    hookpoint: hp,
                    rows,
                    row_bytes,
                    dtype: entry.spec().dtype,
                    flags: 0,
                };
                let metas: Vec<RowMeta> = (first..first + rows)
                    .map(|i| RowMeta { request_id: u64::from(i), position: i, batch_row: i - first })
                    .collect();
                let data: Vec<u8> = (0..rows * row_bytes).map(|i| ((i / 2 + first * 7 + hp) % 251) as u8).collect();
                let bytes = encode_record(0, &meta, &metas, &data);
                Record::copy_from(&RecordView::decode(&bytes).unwrap().0, entry.clone()).unwrap()
            })
            .collect()
    }

    /// The activation rows of a Parquet or Arrow IPC file's bytes.
    fn rows_of(bytes: Bytes, ext: &str) -> Vec<Vec<u8>> {
        let batches: Vec<RecordBatch> = match ext {
            "parquet" => parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes)
                .unwrap()
                .build()
                .unwrap()
                .map(Result::unwrap)
                .collect(),
            _ => arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None)
                .unwrap()
                .map(Result::unwrap)
                .collect(),
        };
        batches
            .iter()
            .flat_map(|b| {
                let act =
                    b.column_by_name("activation").unwrap().as_any().downcast_ref::<FixedSizeBinaryArray>().unwrap();
                (0..act.len()).map(|i| act.value(i).to_vec()).collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn a_dump_on_object_storage_is_streamed_in_parts_and_reads_back_bit_for_bit() {
        let catalog = TestCatalog::layers(2, 4096); // f16: 8 KiB rows
        let records: Vec<Record> =
            records_of(&catalog, 0, 12, 128).into_iter().chain(records_of(&catalog, 1, 3, 64)).collect();
        let storage = crate::testing::memory_storage();
        for ext in ["parquet", "arrow"] {
            let mut options = DatasetOptions::on_storage(storage.clone());
            options.run_id = format!("run-{ext}");
            options.batch_bytes = 2 << 20;
            options.max_file_bytes = 7 << 20; // rotates: files of 8 MiB of rows, more than a part (5 MiB)
            let (mut sink, committed): (Box<dyn Sink>, _) = match ext {
                "parquet" => {
                    let (s, c) = parquet_sink(options.clone(), Codec::Uncompressed).unwrap();
                    (Box::new(s), c)
                }
                _ => {
                    let (s, c) = arrow_ipc_sink(options.clone()).unwrap();
                    (Box::new(s), c)
                }
            };
            for r in &records {
                sink.write(r).unwrap();
            }
            sink.close().unwrap();
            let files = committed.lock().clone();
            let run = storage.root().join(&options.run_id);
            let sub = if ext == "arrow" { "_arrow_ipc/" } else { "" };
            let listed = storage.list(&run).unwrap();
            assert_eq!(listed.len(), files.len(), "{ext}: every object listed is a committed file: {listed:?}");
            for hp in 0..2u32 {
                let mine: Vec<_> = files.iter().filter(|f| f.hookpoint == format!("layers.{hp}.resid")).collect();
                let mut rows = Vec::new();
                for (i, f) in mine.iter().enumerate() {
                    let want = run.join(format!("{sub}hookpoint=layers.{hp}.resid/rank=0/part-{i:05}.{ext}"));
                    assert_eq!(f.path, want, "{ext}: the layout on disk, under the storage's URL");
                    assert!(f.path.display().to_string().starts_with("memory://bucket/dumps/"), "{}", f.path.display());
                    let bytes = storage.get(&f.path).unwrap();
                    assert_eq!(bytes.len() as u64, f.bytes);
                    rows.extend(rows_of(bytes, ext));
                }
                let want: Vec<Vec<u8>> = records
                    .iter()
                    .filter(|r| r.header().meta.hookpoint == hp)
                    .flat_map(|r| (0..r.rows()).map(|i| r.row(i).to_vec()))
                    .collect();
                assert_eq!(rows.len(), want.len(), "{ext}: layer {hp}");
                assert!(rows == want, "{ext}: layer {hp}: every row, in order, bit for bit");
            }
            assert!(files.iter().filter(|f| f.hookpoint == "layers.0.resid").count() >= 2, "{ext}: rotated");
        }
        // A second sink of the same run and rank is refused: its files are there.
        let mut options = DatasetOptions::on_storage(storage.clone());
        options.run_id = "run-parquet".into();
        let e = parquet_sink(options, Codec::Uncompressed).err().unwrap().to_string();
        assert!(e.contains("already holds a dump") && e.contains("memory://bucket/dumps/run-parquet"), "{e}");
    }

    #[test]
    fn a_store_that_goes_away_fails_its_files_records_as_sink_errors_and_leaves_only_whole_objects() {
        let catalog = TestCatalog::layers(1, 4096);
        let entry = catalog.entry(0);
        let flaky = Arc::new(crate::testing::FlakyStore::default());
        let failing = flaky.failing.clone();
        let options =
            crate::storage::StorageOptions { part_bytes: crate::storage::MIN_PART_BYTES, ..Default::default() };
        let storage = crate::storage::ObjectStorage::with_store(flaky, "memory://flaky", "", options);
        let mut options = DatasetOptions::on_storage(storage.clone());
        options.run_id = "r".into();
        options.batch_bytes = 1 << 20;
        options.max_file_bytes = 6 << 20;
        let (mut sink, committed) = parquet_sink(options, Codec::Uncompressed).unwrap();
        let records = records_of(&catalog, 0, 30, 128); // 1 MiB each
        let mut errors = 0;
        for (k, r) in records.iter().enumerate() {
            // The server is away for records 8..16: the open file (its first parts uploaded) fails, and so do
            // the files started while it is away.
            failing.store((8..16).contains(&k), std::sync::atomic::Ordering::SeqCst);
            if let Err(e) = sink.write(r) {
                let e = e.to_string();
                assert!(e.contains("memory://flaky/r/hookpoint=layers.0.resid/rank=0/part-"), "{e}");
                assert!(e.contains("connection refused"), "{e}");
                errors += 1;
            }
        }
        drop(records);
        failing.store(false, std::sync::atomic::Ordering::SeqCst);
        sink.close().unwrap();
        drop(sink);
        assert!(errors >= 1, "the failure was reported while it happened");
        let files = committed.lock().clone();
        let acc = entry.accounting();
        let lost = acc.dropped_for(DropReason::SinkError);
        let kept: u64 = files.iter().map(|f| f.rows).sum();
        assert!(lost.rows >= 8 * 128, "{lost:?}");
        assert_eq!(kept + lost.rows, 30 * 128, "every row exported or counted as a sink error");
        assert_eq!(acc.exported.rows, kept);
        // Only whole objects: each listed object is a committed file, and reads as Parquet.
        let listed = storage.list(&storage.root().join("r")).unwrap();
        assert_eq!(listed.len(), files.len(), "{listed:?}");
        for f in &files {
            assert_eq!(rows_of(storage.get(&f.path).unwrap(), "parquet").len() as u64, f.rows);
        }
    }
}
