//! File sinks: one writer per hookpoint partition, size-based rotation, and commit by rename.
//!
//! A file is written under a hidden in-progress name and renamed to `part-NNNNN.<ext>` only after its footer is
//! written and its bytes are synced, so a reader never sees a half-written file under a final name. The receipts of
//! a file's records are held until that rename: a file that fails to commit turns its records into counted drops
//! (`sink_error`) and leaves every file already committed untouched and readable.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use parking_lot::Mutex;
use ringscope_hookpoint::HookPoint;
use ringscope_policy::DropReason;

use crate::dataset::{file_metadata, in_progress_path, part_name, schema, Batch, DatasetOptions};
use crate::output::Output;
use crate::record::{Receipt, Record};
use crate::sink::{Sink, SinkError};

/// A file format a [`FileSink`] can write.
pub trait FileFormat: Send + 'static {
    /// Writer of one open file.
    type Writer: Send;
    /// File name extension (`parquet`, `arrow`).
    const EXT: &'static str;
    /// Sink name in reports.
    const NAME: &'static str;
    /// Subdirectory of the run directory holding this format's partitions (empty: the run directory itself).
    const SUBDIR: &'static str;
    /// Starts a file.
    fn create(&self, out: Output, schema: &SchemaRef) -> Result<Self::Writer, String>;
    /// Appends a batch of one hookpoint's records (the Parquet format writes each batch as one row group).
    fn write(&self, writer: &mut Self::Writer, batch: &Batch<'_>) -> Result<(), String>;
    /// Writes the footer with `metadata` and returns the file, flushed.
    fn finish(&self, writer: Self::Writer, metadata: Vec<(String, String)>) -> Result<File, String>;
}

/// A file the sink committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedFile {
    /// Final path.
    pub path: PathBuf,
    /// Hookpoint of its rows.
    pub hookpoint: String,
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
    direct_io: Arc<AtomicBool>,
    tmp: PathBuf,
    index: u32,
    activation_bytes: u64,
    records: u64,
    rows: u64,
    receipts: Vec<Receipt>,
}

struct Partition<W> {
    hp: Arc<HookPoint>,
    dir: PathBuf,
    schema: SchemaRef,
    next_index: u32,
    /// Records waiting for the next batch, and their activation bytes.
    pending: Vec<Record>,
    pending_bytes: usize,
    open: Option<OpenFile<W>>,
}

/// Writes records as a Hive-partitioned dataset of files of format `F` (see [`crate::dataset`]).
pub struct FileSink<F: FileFormat> {
    format: F,
    options: DatasetOptions,
    partitions: HashMap<u32, Partition<F::Writer>>,
    committed: CommittedFiles,
}

impl<F: FileFormat> FileSink<F> {
    /// A sink writing under `options.run_dir()`. Checks the options and that the directory can be created.
    pub fn create(format: F, options: DatasetOptions) -> Result<(Self, CommittedFiles), SinkError> {
        options.validate().map_err(|message| SinkError { sink: F::NAME.into(), message })?;
        let run = options.run_dir().join(F::SUBDIR);
        // A run directory belongs to one run: never mix two runs' files (or overwrite one) by reusing it.
        let holds_data = std::fs::read_dir(&run).is_ok_and(|mut entries| {
            entries.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("hookpoint=")))
        });
        if holds_data {
            return Err(SinkError {
                sink: F::NAME.into(),
                message: format!(
                    "run directory {} already holds a dump; choose another run id or remove it",
                    run.display()
                ),
            });
        }
        std::fs::create_dir_all(&run).map_err(|e| SinkError {
            sink: F::NAME.into(),
            message: format!("cannot create output directory {}: {e}", run.display()),
        })?;
        let committed = CommittedFiles::default();
        let sink = FileSink { format, options, partitions: HashMap::new(), committed: committed.clone() };
        Ok((sink, committed))
    }

    fn error(&self, message: String) -> SinkError {
        SinkError { sink: F::NAME.into(), message }
    }

    fn partition(&mut self, hp: &Arc<HookPoint>) -> Result<&mut Partition<F::Writer>, SinkError> {
        if !self.partitions.contains_key(&hp.id) {
            let dir = self.options.partition_dir(F::SUBDIR, &hp.spec.name);
            std::fs::create_dir_all(&dir)
                .map_err(|e| self.error(format!("cannot create directory {}: {e}", dir.display())))?;
            // Continue numbering after files already there (a run directory reused), never overwrite one.
            let next_index = (0u32..).find(|&i| !dir.join(part_name(i, F::EXT)).exists()).unwrap_or(u32::MAX);
            self.partitions.insert(
                hp.id,
                Partition {
                    hp: hp.clone(),
                    dir,
                    schema: schema(hp),
                    next_index,
                    pending: Vec::new(),
                    pending_bytes: 0,
                    open: None,
                },
            );
        }
        Ok(self.partitions.get_mut(&hp.id).expect("inserted above"))
    }

    /// Writes the partition's buffered rows into its open file (opening one if needed); commits the file once it
    /// reaches the rotation size, or when `commit` is set.
    fn flush(&mut self, id: u32, commit: bool) -> Result<(), SinkError> {
        let (format, options, committed) = (&self.format, &self.options, &self.committed);
        let part = self.partitions.get_mut(&id).expect("partition exists");
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
                let _ = std::fs::remove_file(&open.tmp);
            }
        }
        result.map_err(|m| self.error(m))
    }
}

fn flush_partition<F: FileFormat>(
    format: &F,
    options: &DatasetOptions,
    committed: &CommittedFiles,
    part: &mut Partition<F::Writer>,
    commit: bool,
) -> Result<(), String> {
    if !part.pending.is_empty() {
        if part.open.is_none() {
            let index = part.next_index;
            part.next_index += 1;
            let tmp = in_progress_path(&part.dir, index, F::EXT);
            // Buffers hold a whole batch, so the Parquet sink can compress a row group's activation column into one.
            let buffer_bytes = options.batch_bytes + options.batch_bytes / 8 + (64 << 10);
            let out = Output::create(&tmp, options.direct_io, buffer_bytes)
                .map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
            let direct_io = out.direct_writes();
            let writer = format.create(out, &part.schema)?;
            let receipts = Vec::new();
            part.open =
                Some(OpenFile { writer, direct_io, tmp, index, activation_bytes: 0, records: 0, rows: 0, receipts });
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
        format.write(&mut open.writer, &batch).map_err(|e| format!("writing {}: {e}", open.tmp.display()))?;
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
        let metadata = file_metadata(&part.hp, &options.run_id, open.records, open.rows);
        let tmp = open.tmp.clone();
        let finished = format.finish(open.writer, metadata).map_err(|e| format!("closing {}: {e}", tmp.display()));
        let file = match finished {
            Ok(f) => f,
            Err(e) => {
                // The caller's cleanup fails the partition's records; fail this file's here.
                part.open = None;
                open.receipts.iter().for_each(|r| r.fail(DropReason::SinkError));
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let synced = file.sync_all().and_then(|()| file.metadata().map(|m| m.len()));
        let path = part.dir.join(part_name(open.index, F::EXT));
        let renamed = synced.and_then(|len| std::fs::rename(&tmp, &path).map(|()| len));
        match renamed {
            Ok(len) => {
                committed.lock().push(CommittedFile {
                    path,
                    hookpoint: part.hp.spec.name.clone(),
                    rows: open.rows,
                    bytes: len,
                    direct_io: open.direct_io.load(Ordering::Relaxed), // final: the file is finished
                });
                // Dropping the receipts counts the file's records as exported.
                drop(open.receipts);
            }
            Err(e) => {
                open.receipts.iter().for_each(|r| r.fail(DropReason::SinkError));
                let _ = std::fs::remove_file(&tmp);
                return Err(format!("committing {}: {e}", path.display()));
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
        let id = record.hookpoint().id;
        // A batch never outgrows the file size target, so small files still rotate.
        let batch_bytes =
            self.options.batch_bytes.min(usize::try_from(self.options.max_file_bytes).unwrap_or(usize::MAX));
        let part = self.partition(record.hookpoint())?;
        part.pending.push(record.clone());
        part.pending_bytes += record.data().len();
        if part.pending_bytes >= batch_bytes {
            self.flush(id, false)?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<(), SinkError> {
        let mut ids: Vec<u32> = self.partitions.keys().copied().collect();
        ids.sort_unstable();
        let errors: Vec<String> =
            ids.into_iter().filter_map(|id| self.flush(id, true).err()).map(|e| e.message).collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(self.error(errors.join("; ")))
        }
    }
}
