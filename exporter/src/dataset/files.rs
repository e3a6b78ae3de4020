//! File sinks: one writer per hookpoint partition, size-based rotation, and commit by rename.
//!
//! A file is written under a hidden in-progress name and renamed to `part-NNNNN.<ext>` only after its footer is
//! written and its bytes are synced, so a reader never sees a half-written file under a final name. On object
//! storage a file is a multipart upload to its final name, completed after its footer is written (an upload not
//! completed is never listed). The receipts of
//! a file's records are held until that rename: a file that fails to commit turns its records into counted drops
//! (`sink_error`) and leaves every file already committed untouched and readable.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use parking_lot::Mutex;
use ringscope_policy::DropReason;

use ringscope_ring::DType;

use crate::dataset::{
    dtype_subdir, file_metadata, in_progress_path, part_name, schema_for, Batch, DatasetOptions, FileError, FormatError,
};
use crate::routing::catalog::CatalogEntry;
use crate::routing::record::{Receipt, Record};
use crate::routing::sink::{Sink, SinkError};
use crate::storage::ObjectStorage;

/// A file format a [`FileSink`] can write: how the bytes of one file are laid out. The sink decides which records go
/// into which file, names and commits files, and accounts for their records.
pub trait FileFormat: Send + 'static {
    /// Writer of one open file.
    type Writer: Send;
    /// File name extension (`parquet`, `arrow`).
    const EXT: &'static str;
    /// Sink name in reports.
    const NAME: &'static str;
    /// Subdirectory of the run directory holding this format's partitions (empty: the run directory itself).
    const SUBDIR: &'static str;
    /// Starts a file at `to` (created new), with `options.direct_io`, for batches of about `options.batch_bytes`.
    fn create(
        &self,
        to: Destination<'_>,
        options: &DatasetOptions,
        schema: &SchemaRef,
    ) -> Result<Self::Writer, FormatError>;
    /// Appends a batch of one hookpoint's records (the Parquet format writes each batch as one row group).
    fn write(&self, writer: &mut Self::Writer, batch: &Batch<'_>) -> Result<(), FormatError>;
    /// Writes the footer with `metadata` and returns the file, flushed.
    fn finish(&self, writer: Self::Writer, metadata: Vec<(String, String)>) -> Result<FinishedFile, FormatError>;
}

/// Where a new file of the dataset is written.
#[derive(Debug, Clone, Copy)]
pub enum Destination<'a> {
    /// A local file, created at this (in-progress) path.
    File(&'a Path),
    /// An object of this storage, uploaded to this (final) path.
    Object(&'a ObjectStorage, &'a Path),
}

impl Destination<'_> {
    /// The path written to (in progress, for a local file).
    pub fn path(&self) -> &Path {
        match self {
            Destination::File(path) | Destination::Object(_, path) => path,
        }
    }
}

/// Where a finished file's bytes are.
#[derive(Debug)]
pub enum Stored {
    /// In a local file, not yet synced or renamed.
    File(File),
    /// In an object whose upload was completed: the object is there, whole, under its final name.
    Object {
        /// Its size.
        bytes: u64,
    },
}

/// A file whose footer is written (a local file not yet synced or renamed).
#[derive(Debug)]
pub struct FinishedFile {
    /// The file.
    pub file: Stored,
    /// Whether every byte of it was written with `O_DIRECT`.
    pub direct_io: bool,
}

/// A file the sink committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedFile {
    /// The sink that wrote it (its format's name: `parquet`, `arrow_ipc`).
    pub sink: String,
    /// Final path.
    pub path: PathBuf,
    /// Hookpoint of its rows.
    pub hookpoint: String,
    /// Dtype of its rows: the hookpoint's, or `f8e4m3_rowscaled` for a file of downcast rows.
    pub dtype: DType,
    /// Token rows in it.
    pub rows: u64,
    /// Size on disk.
    pub bytes: u64,
    /// Whether it was written with `O_DIRECT` to the end (see [`DatasetOptions::direct_io`]; with `auto`, a file
    /// system that rejects a direct write makes the rest of the file go through the page cache).
    pub direct_io: bool,
}

/// Shared list of the files a sink committed, readable while it runs and after.
pub type CommittedFiles = Arc<Mutex<Vec<CommittedFile>>>;

struct OpenFile<W> {
    writer: W,
    tmp: PathBuf,
    index: u32,
    activation_bytes: u64,
    records: u64,
    rows: u64,
    receipts: Vec<Receipt>,
}

/// A partition's file series: a hookpoint's records of one dtype (its own, or the dtype it was downcast to).
type SeriesKey = (u32, DType);

struct Partition<W> {
    hp: Arc<CatalogEntry>,
    dtype: DType,
    dir: PathBuf,
    schema: SchemaRef,
    next_index: u32,
    /// Records waiting for the next batch, and their activation bytes.
    pending: Vec<Record>,
    pending_bytes: usize,
    /// The sink's `received` count when the oldest pending record that may still be lent by the ring came.
    lent_since: Option<u64>,
    open: Option<OpenFile<W>>,
}

/// Writes records as a Hive-partitioned dataset of files of format `F` (see [`crate::dataset`]).
pub struct FileSink<F: FileFormat> {
    format: F,
    options: DatasetOptions,
    partitions: HashMap<SeriesKey, Partition<F::Writer>>,
    /// Activation bytes pending over all partitions.
    pending_bytes: usize,
    /// Activation bytes of every record written to this sink so far (its clock for how long records are held).
    received: u64,
    committed: CommittedFiles,
}

impl<F: FileFormat> FileSink<F> {
    /// A sink writing under `options.run_dir()`. Checks the options and that the directory can be created.
    pub fn create(format: F, options: DatasetOptions) -> Result<(Self, CommittedFiles), SinkError> {
        Self::setup(&options).map_err(Self::error)?;
        let committed = CommittedFiles::default();
        let sink = FileSink {
            format,
            options,
            partitions: HashMap::new(),
            pending_bytes: 0,
            received: 0,
            committed: committed.clone(),
        };
        Ok((sink, committed))
    }

    fn setup(options: &DatasetOptions) -> Result<(), FileError> {
        options.validate()?;
        let run = options.run_dir().join(F::SUBDIR);
        if let Some(storage) = &options.storage {
            // No directories on object storage; the run lock (`RunLock::acquire_object`) checks the rank's files too.
            let written = super::lock::object_rank_written(storage, &options.run_dir(), options.rank)
                .map_err(|source| FileError::CreateDir { dir: run.clone(), source })?;
            return if written { Err(FileError::RunDirInUse(run)) } else { Ok(()) };
        }
        // A run directory belongs to one run: never mix two runs' files (or overwrite one) by reusing it. The ranks
        // of one run share it (each writes its own `rank=<r>` partitions): what must not exist yet is this rank's.
        if super::lock::partitions_hold_rank(&run, options.rank) {
            return Err(FileError::RunDirInUse(run));
        }
        std::fs::create_dir_all(&run).map_err(|source| FileError::CreateDir { dir: run, source })
    }

    fn error(source: FileError) -> SinkError {
        SinkError::File { sink: F::NAME.into(), source }
    }

    fn partition(&mut self, hp: &Arc<CatalogEntry>, dtype: DType) -> Result<&mut Partition<F::Writer>, SinkError> {
        let key = (hp.id(), dtype);
        if !self.partitions.contains_key(&key) {
            let mut dir = self.options.partition_dir(F::SUBDIR, hp.name());
            if dtype != hp.spec().dtype {
                // Downcast rows: a series of their own, so that no file mixes row sizes (see the module docs).
                dir = dir.join(dtype_subdir(dtype));
            }
            // Continue numbering after files already there (a run directory reused), never overwrite one.
            let shard = self.options.file_shard;
            let next_index = match &self.options.storage {
                Some(storage) => {
                    let names = match storage.list_names(&dir) {
                        Ok(names) => names,
                        Err(source) => return Err(Self::error(FileError::CreateDir { dir, source })),
                    };
                    (0u32..).find(|&i| !names.contains(&part_name(i, shard, F::EXT))).unwrap_or(u32::MAX)
                }
                None => {
                    if let Err(source) = std::fs::create_dir_all(&dir) {
                        return Err(Self::error(FileError::CreateDir { dir, source }));
                    }
                    (0u32..).find(|&i| !dir.join(part_name(i, shard, F::EXT)).exists()).unwrap_or(u32::MAX)
                }
            };
            self.partitions.insert(
                key,
                Partition {
                    hp: hp.clone(),
                    dtype,
                    dir,
                    schema: schema_for(hp, dtype),
                    next_index,
                    pending: Vec::new(),
                    pending_bytes: 0,
                    lent_since: None,
                    open: None,
                },
            );
        }
        Ok(self.partitions.get_mut(&key).expect("inserted above"))
    }

    /// Moves pending records out of the ring into host memory (their batches stay whole): those of every partition
    /// (`all`), or of partitions whose oldest lent record has waited while more than `max_pending_bytes` of other
    /// records came to this sink. Ring space comes back in ring order, so a record held for a batch that grows slowly
    /// — a hookpoint this sink sees rarely, such as one it took from another sink of its pool — would hold all of the
    /// ring written after it; in full mode that stops the engine until the batch is written, which may be never.
    /// The host memory this takes is within `max_pending_bytes` (what pending batches may hold in all). When the
    /// memory for a copy is refused, the partition's batch is written as it is instead.
    fn release_lent(&mut self, all: bool) -> Result<(), FileError> {
        let limit = self.options.max_pending_bytes as u64;
        let received = self.received;
        let old: Vec<SeriesKey> = self
            .partitions
            .iter()
            .filter(|(_, p)| p.lent_since.is_some_and(|since| all || received - since > limit))
            .map(|(&k, _)| k)
            .collect();
        for key in old {
            let part = self.partitions.get_mut(&key).expect("listed above");
            let copied: Result<Vec<Record>, _> = part.pending.iter().map(Record::detach).collect();
            match copied {
                Ok(copied) => {
                    part.pending = copied;
                    part.lent_since = None;
                }
                Err(_) => self.flush(key, false)?,
            }
        }
        Ok(())
    }

    /// Writes the partition's buffered rows into its open file (opening one if needed); commits the file once it
    /// reaches the rotation size, or when `commit` is set.
    fn flush(&mut self, key: SeriesKey, commit: bool) -> Result<(), FileError> {
        let (format, options, committed) = (&self.format, &self.options, &self.committed);
        let part = self.partitions.get_mut(&key).expect("partition exists");
        // Written or failed: either way the partition holds nothing pending afterwards.
        self.pending_bytes -= part.pending_bytes;
        part.lent_since = None;
        let result = flush_partition(format, options, committed, part, commit);
        if result.is_err() {
            // Everything of this partition not yet committed is lost: count it, and remove the partial file.
            for r in part.pending.drain(..) {
                r.receipt().fail(DropReason::SinkError);
            }
            part.pending_bytes = 0;
            if let Some(open) = part.open.take() {
                for r in &open.receipts {
                    r.fail(DropReason::SinkError);
                }
                discard(&self.options, &open.tmp);
            }
        }
        result
    }
}

/// Removes what a failed file left: its in-progress local file (a failed upload leaves nothing: it is aborted).
fn discard(options: &DatasetOptions, tmp: &Path) {
    if options.storage.is_none() {
        let _ = std::fs::remove_file(tmp);
    }
}

fn flush_partition<F: FileFormat>(
    format: &F,
    options: &DatasetOptions,
    committed: &CommittedFiles,
    part: &mut Partition<F::Writer>,
    commit: bool,
) -> Result<(), FileError> {
    if !part.pending.is_empty() {
        if part.open.is_none() {
            let index = part.next_index;
            part.next_index += 1;
            let to = match &options.storage {
                Some(_) => part.dir.join(part_name(index, options.file_shard, F::EXT)),
                None => in_progress_path(&part.dir, index, options.file_shard, F::EXT),
            };
            let destination = match &options.storage {
                Some(storage) => Destination::Object(storage, &to),
                None => Destination::File(&to),
            };
            let tmp = to.clone();
            let writer = match format.create(destination, options, &part.schema) {
                Ok(w) => w,
                Err(source) => return Err(FileError::Create { path: tmp, source }),
            };
            let receipts = Vec::new();
            part.open = Some(OpenFile { writer, tmp, index, activation_bytes: 0, records: 0, rows: 0, receipts });
        }
        let open = part.open.as_mut().expect("opened above");
        let batch = Batch {
            schema: &part.schema,
            hookpoint: &part.hp,
            run_id: &options.run_id,
            rank: options.rank,
            records: &part.pending,
        };
        let rows = batch.rows() as u64;
        if let Err(source) = format.write(&mut open.writer, &batch) {
            return Err(FileError::Write { path: open.tmp.clone(), source });
        }
        open.activation_bytes += part.pending_bytes as u64;
        open.rows += rows;
        open.records += part.pending.len() as u64;
        // The file holds the data now; keep only the receipts until it is committed.
        open.receipts.extend(part.pending.drain(..).map(|r| r.receipt()));
        part.pending_bytes = 0;
    }
    let due = part.open.as_ref().is_some_and(|o| commit || o.activation_bytes >= options.max_file_bytes);
    if due {
        let open = part.open.take().expect("checked above");
        let metadata = file_metadata(&part.hp, part.dtype, &options.run_id, open.records, open.rows);
        let tmp = open.tmp.clone();
        let finished = match format.finish(open.writer, metadata) {
            Ok(f) => f,
            Err(source) => {
                // The caller's cleanup fails the partition's records; fail this file's here.
                part.open = None;
                open.receipts.iter().for_each(|r| r.fail(DropReason::SinkError));
                discard(options, &tmp);
                return Err(FileError::Finish { path: tmp, source });
            }
        };
        let path = part.dir.join(part_name(open.index, options.file_shard, F::EXT));
        let renamed = match finished.file {
            Stored::File(file) => file
                .sync_all()
                .and_then(|()| file.metadata().map(|m| m.len()))
                .and_then(|len| std::fs::rename(&tmp, &path).map(|()| len)),
            Stored::Object { bytes } => Ok(bytes), // the upload completed: the object is there, whole
        };
        match renamed {
            Ok(len) => {
                committed.lock().push(CommittedFile {
                    sink: F::NAME.to_owned(),
                    path,
                    hookpoint: part.hp.name().to_owned(),
                    dtype: part.dtype,
                    rows: open.rows,
                    bytes: len,
                    direct_io: finished.direct_io,
                });
                // Dropping the receipts counts the file's records as exported.
                drop(open.receipts);
            }
            Err(source) => {
                open.receipts.iter().for_each(|r| r.fail(DropReason::SinkError));
                discard(options, &tmp);
                return Err(FileError::Commit { path, source });
            }
        }
    }
    Ok(())
}

impl<F: FileFormat> Sink for FileSink<F> {
    fn name(&self) -> &str {
        F::NAME
    }

    fn write(&mut self, record: &Record) -> Result<(), SinkError> {
        let key = (record.hookpoint().id(), record.header().meta.dtype);
        // A batch never outgrows the file size target, so small files still rotate.
        let batch_bytes =
            self.options.batch_bytes.min(usize::try_from(self.options.max_file_bytes).unwrap_or(usize::MAX));
        let received = self.received;
        let part = self.partition(record.hookpoint(), key.1)?;
        part.pending.push(record.clone());
        part.pending_bytes += record.data().len();
        if record.is_leased() && part.lent_since.is_none() {
            part.lent_since = Some(received);
        }
        let full = part.pending_bytes >= batch_bytes;
        self.pending_bytes += record.data().len();
        self.received += record.data().len() as u64;
        if full {
            self.flush(key, false).map_err(Self::error)?;
        }
        self.release_lent(false).map_err(Self::error)?;
        // Records held for batches hold their ring space: across many hookpoints, write the largest early rather
        // than let them hold the ring.
        while self.pending_bytes > self.options.max_pending_bytes {
            let largest = self.partitions.iter().max_by_key(|(_, p)| p.pending_bytes).map(|(&key, _)| key);
            let Some(largest) = largest else { break };
            self.flush(largest, false).map_err(Self::error)?;
        }
        Ok(())
    }

    fn commit(&mut self) -> Result<(), SinkError> {
        let mut keys: Vec<SeriesKey> = self.partitions.keys().copied().collect();
        keys.sort_unstable_by_key(|&(id, dtype)| (id, dtype.code()));
        let mut errors: Vec<FileError> = keys.into_iter().filter_map(|key| self.flush(key, true).err()).collect();
        match errors.len() {
            0 => Ok(()),
            1 => Err(Self::error(errors.remove(0))),
            _ => Err(SinkError::Files { sink: F::NAME.into(), errors }),
        }
    }

    fn close(&mut self) -> Result<(), SinkError> {
        self.commit()
    }

    fn idle(&mut self) -> Result<(), SinkError> {
        self.release_lent(true).map_err(Self::error)
    }
}
