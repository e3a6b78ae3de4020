//! The events table: what was lost and why, written into the run directory as it happens.
//!
//! ```text
//! <root>/<run_id>/_ringscope_events/part-00000.parquet            (export.rank = 0)
//! <root>/<run_id>/_ringscope_events/part-00000-rank1.parquet      (rank 1: the ranks of one run share the table)
//! ```
//!
//! One row per [`Event`] of the session's [`EventLog`]: spans of dropped records (step range, hookpoint, reason,
//! records and rows lost) and rung changes. An [`EventRecorder`] thread takes the log every
//! [`EventRecorder::EVERY`] when something was logged, and writes one small file per take, committed like the data
//! files (an in-progress hidden name, synced, renamed); [`EventRecorder::finish`] writes the rest at shutdown, once
//! nothing more can be dropped. So a reader of the files knows which rows are missing without the manifest, and over
//! a whole run `rows_lost` per (hookpoint, reason) sums to the accounting's dropped rows. A run that never lost
//! anything has no events directory: no directory means no events.
//!
//! The table is Parquet whatever the dataset's formats (Arrow IPC datasets included). Its directory starts with `_`,
//! so dataset readers pointed at the run directory (pyarrow, DuckDB and Polars globs on `hookpoint=*`) skip it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt64Type};
use crossbeam::channel::{RecvTimeoutError, Sender};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use ringscope_policy::{Event, EventKind, EventLog};

use crate::dataset::{keys, FileError, FormatError};
use crate::storage::ObjectStorage;
use crate::ExporterError;

/// The events table's directory in a run directory.
pub const EVENTS_DIR: &str = "_ringscope_events";

/// The name of events file `index` of rank `rank` (rank 0's names are those of runs with one rank).
fn events_file_name(index: u32, rank: u32, ext: &str) -> String {
    if rank == 0 {
        format!("part-{index:05}.{ext}")
    } else {
        format!("part-{index:05}-rank{rank}.{ext}")
    }
}

/// The events table's columns, in this order.
pub fn events_schema() -> SchemaRef {
    let text = |name| Field::new(name, DataType::Utf8, false);
    let number = |name| Field::new(name, DataType::UInt64, false);
    Arc::new(Schema::new(vec![
        number("unix_ns"),
        text("hookpoint"),
        number("first_step"),
        number("last_step"),
        text("kind"),
        text("rung"),
        text("reason"),
        number("records_lost"),
        number("rows_lost"),
        text("detail"),
        // Typed where an event is about one request's positions (a prefix-cache hit), null elsewhere.
        Field::new("request_id", DataType::UInt64, true),
        Field::new("first_position", DataType::UInt64, true),
        Field::new("end_position", DataType::UInt64, true),
    ]))
}

/// `events` as one batch of [`events_schema`].
pub fn events_batch(events: &[Event]) -> RecordBatch {
    let number = |f: fn(&Event) -> u64| -> ArrayRef { Arc::new(UInt64Array::from_iter_values(events.iter().map(f))) };
    let text = |f: fn(&Event) -> &str| -> ArrayRef { Arc::new(StringArray::from_iter_values(events.iter().map(f))) };
    let nullable =
        |f: fn(&Event) -> Option<u64>| -> ArrayRef { Arc::new(UInt64Array::from_iter(events.iter().map(f))) };
    let columns = vec![
        number(|e| e.unix_ns),
        text(|e| &e.hookpoint),
        number(|e| e.first_step),
        number(|e| e.last_step),
        text(|e| e.kind.name()),
        text(|e| &e.rung),
        text(|e| &e.reason),
        number(|e| e.records_lost),
        number(|e| e.rows_lost),
        text(|e| &e.detail),
        nullable(|e| e.request_id),
        nullable(|e| e.first_position),
        nullable(|e| e.end_position),
    ];
    RecordBatch::try_new(events_schema(), columns).expect("columns are built to match the schema")
}

/// Reads the events table of `run_dir`, file by file in commit order: every event, in the order it was logged
/// within each file. A run directory without an events directory had no events: that reads as none.
pub fn read_events(run_dir: &Path) -> Result<Vec<Event>, FileError> {
    let dir = run_dir.join(EVENTS_DIR);
    if crate::storage::is_object_url(&run_dir.to_string_lossy()) {
        // Not a local directory: "no events" would be a wrong answer, not an empty one.
        let why = "a run on object storage: read its events with ringscope.read_events (Python) or download the run";
        return Err(FileError::Read { path: dir, source: FormatError::Io(std::io::Error::other(why)) });
    }
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(FileError::Read { path: dir, source: FormatError::Io(source) }),
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(|source| FileError::Read { path: dir.clone(), source: source.into() })?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        // Committed files only (in-progress ones are hidden).
        if name.starts_with("part-") && name.ends_with(".parquet") {
            files.push(path);
        }
    }
    files.sort();
    let mut events = Vec::new();
    for path in files {
        read_events_file(&path, &mut events).map_err(|source| FileError::Read { path, source })?;
    }
    Ok(events)
}

fn read_events_file(path: &Path, out: &mut Vec<Event>) -> Result<(), FormatError> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(path)?)?.build()?;
    for batch in reader {
        let batch = batch?;
        let number = |name: &str| -> Result<UInt64Array, FormatError> {
            let column = batch.column_by_name(name).and_then(|c| c.as_primitive_opt::<UInt64Type>());
            column.cloned().ok_or_else(|| not(name, "a uint64 column"))
        };
        let text = |name: &str| -> Result<StringArray, FormatError> {
            let column = batch.column_by_name(name).and_then(|c| c.as_string_opt::<i32>());
            column.cloned().ok_or_else(|| not(name, "a utf8 column"))
        };
        let (unix_ns, first_step, last_step) = (number("unix_ns")?, number("first_step")?, number("last_step")?);
        let (records_lost, rows_lost) = (number("records_lost")?, number("rows_lost")?);
        let (hookpoint, kind, rung) = (text("hookpoint")?, text("kind")?, text("rung")?);
        let (reason, detail) = (text("reason")?, text("detail")?);
        // Files written before these columns existed read as events about no one request.
        let optional = |name: &str| -> Result<Option<UInt64Array>, FormatError> {
            match batch.column_by_name(name) {
                None => Ok(None),
                Some(c) => {
                    c.as_primitive_opt::<UInt64Type>().cloned().map(Some).ok_or_else(|| not(name, "a uint64 column"))
                }
            }
        };
        let (request_id, first_position, end_position) =
            (optional("request_id")?, optional("first_position")?, optional("end_position")?);
        let at =
            |column: &Option<UInt64Array>, i: usize| column.as_ref().and_then(|c| c.is_valid(i).then(|| c.value(i)));
        for i in 0..batch.num_rows() {
            let kind = match kind.value(i) {
                "drop" => EventKind::Drop,
                "rung" => EventKind::Rung,
                "stall" => EventKind::Stall,
                "cached" => EventKind::Cached,
                other => return Err(not("kind", &format!("drop, rung, stall or cached (found `{other}`)"))),
            };
            out.push(Event {
                unix_ns: unix_ns.value(i),
                hookpoint: hookpoint.value(i).to_owned(),
                first_step: first_step.value(i),
                last_step: last_step.value(i),
                kind,
                rung: rung.value(i).to_owned(),
                reason: reason.value(i).to_owned(),
                records_lost: records_lost.value(i),
                rows_lost: rows_lost.value(i),
                detail: detail.value(i).to_owned(),
                request_id: at(&request_id, i),
                first_position: at(&first_position, i),
                end_position: at(&end_position, i),
            });
        }
    }
    Ok(())
}

/// Column `name` is missing or not what the events table's schema says.
fn not(name: &str, what: &str) -> FormatError {
    let message = format!("events table column `{name}` is missing or not {what}: not a ringscope events file");
    FormatError::Arrow(arrow::error::ArrowError::SchemaError(message))
}

/// How a small table's file is encoded (the `writing` module's Parquet).
pub trait TableFormat: Send + 'static {
    /// File name extension.
    const EXT: &'static str;
    /// Writes `batch` and `metadata` into `out` (a file created new and empty, or memory) and returns it, flushed.
    fn write<W: std::io::Write + Send>(
        &self,
        out: W,
        batch: &RecordBatch,
        metadata: Vec<(String, String)>,
    ) -> Result<W, FormatError>;
}

/// An events file that was committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsFile {
    /// Final path.
    pub path: PathBuf,
    /// Events (rows) in it.
    pub events: u64,
    /// The sum of its `rows_lost`.
    pub rows_lost: u64,
    /// Size on disk.
    pub bytes: u64,
}

/// The events table of one run directory: writes and commits its files.
pub struct EventsTable<F: TableFormat> {
    format: F,
    run_id: String,
    dir: PathBuf,
    /// `export.rank`: part of the file names, so that ranks writing the same run directory never collide.
    rank: u32,
    /// The next file's number; found on the first write (a reused run directory keeps its files).
    next_index: Option<u32>,
    /// Object storage the run is on (`dir` is then under its root): each file is one `PUT`.
    storage: Option<ObjectStorage>,
}

impl<F: TableFormat> EventsTable<F> {
    /// The table of `run_dir`. Nothing is created until the first [`write`](Self::write).
    pub fn new(format: F, run_dir: &Path) -> Self {
        Self::with_rank(format, run_dir, 0)
    }

    /// The table of `run_dir` as rank `rank` writes it (its own file names).
    pub fn with_rank(format: F, run_dir: &Path, rank: u32) -> Self {
        let run_id = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        EventsTable { format, run_id, dir: run_dir.join(EVENTS_DIR), rank, next_index: None, storage: None }
    }

    /// The table of a run on object storage (`run_dir` under the storage's root).
    pub fn on_storage(mut self, storage: Option<ObjectStorage>) -> Self {
        self.storage = storage;
        self
    }

    /// The table's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `events` as one file, committed under its final name when this returns `Ok`. On an error nothing is
    /// left behind, and the next write takes the same file number.
    pub fn write(&mut self, events: &[Event]) -> Result<EventsFile, FileError> {
        let dir = &self.dir;
        let rank = self.rank;
        let index = match (self.next_index, &self.storage) {
            (Some(index), _) => index,
            (None, Some(storage)) => {
                let names =
                    storage.list_names(dir).map_err(|source| FileError::CreateDir { dir: dir.clone(), source })?;
                (0u32..).find(|&i| !names.contains(&events_file_name(i, rank, F::EXT))).unwrap_or(u32::MAX)
            }
            (None, None) => {
                std::fs::create_dir_all(dir).map_err(|source| FileError::CreateDir { dir: dir.clone(), source })?;
                (0u32..).find(|&i| !dir.join(events_file_name(i, rank, F::EXT)).exists()).unwrap_or(u32::MAX)
            }
        };
        self.next_index = Some(index);
        let name = events_file_name(index, rank, F::EXT);
        if let Some(storage) = &self.storage {
            let path = dir.join(name);
            let written = self.write_object(storage, &path, events);
            if written.is_ok() {
                self.next_index = Some(index + 1);
            }
            return written;
        }
        // Hidden while in progress (leading `.`), like the data files: globs on `part-*.parquet` miss it.
        let tmp = dir.join(format!(".{name}.inprogress"));
        let path = dir.join(name);
        let committed = self.write_file(&tmp, &path, events);
        if committed.is_err() {
            let _ = std::fs::remove_file(&tmp);
        } else {
            self.next_index = Some(index + 1);
        }
        committed
    }

    /// The file's metadata.
    fn metadata(&self, events: &[Event]) -> Vec<(String, String)> {
        vec![
            (keys::FORMAT_VERSION.to_owned(), ringscope_ring::record::FORMAT_VERSION.to_string()),
            (keys::RUN_ID.to_owned(), self.run_id.clone()),
            (keys::FILE_ROWS.to_owned(), events.len().to_string()),
        ]
    }

    /// One `PUT` of the whole file: the object is there, whole, or not at all.
    fn write_object(&self, storage: &ObjectStorage, path: &Path, events: &[Event]) -> Result<EventsFile, FileError> {
        let rows_lost = events.iter().map(|e| e.rows_lost).sum();
        let bytes = self
            .format
            .write(Vec::new(), &events_batch(events), self.metadata(events))
            .map_err(|source| FileError::Write { path: path.to_owned(), source })?;
        let bytes =
            storage.put(path, bytes.into()).map_err(|source| FileError::Commit { path: path.to_owned(), source })?;
        Ok(EventsFile { path: path.to_owned(), events: events.len() as u64, rows_lost, bytes })
    }

    fn write_file(&self, tmp: &Path, path: &Path, events: &[Event]) -> Result<EventsFile, FileError> {
        let file = File::create_new(tmp)
            .map_err(|source| FileError::Create { path: tmp.to_owned(), source: FormatError::Io(source) })?;
        let rows_lost = events.iter().map(|e| e.rows_lost).sum();
        let file = self
            .format
            .write(file, &events_batch(events), self.metadata(events))
            .map_err(|source| FileError::Write { path: tmp.to_owned(), source })?;
        let bytes = file
            .sync_all()
            .and_then(|()| file.metadata().map(|m| m.len()))
            .and_then(|len| std::fs::rename(tmp, path).map(|()| len))
            .map_err(|source| FileError::Commit { path: path.to_owned(), source })?;
        Ok(EventsFile { path: path.to_owned(), events: events.len() as u64, rows_lost, bytes })
    }
}

/// What an [`EventRecorder`] wrote.
#[derive(Debug, Clone, Default)]
pub struct EventsReport {
    /// Files committed, in order.
    pub files: Vec<EventsFile>,
    /// Writes that failed (the events of a failed write are written with the next one; those of a failed last
    /// write are lost to the table, though not to the accounting).
    pub errors: Vec<String>,
}

/// A thread writing a session's [`EventLog`] into its run's events table as it happens. See the module docs.
pub struct EventRecorder {
    log: Arc<EventLog>,
    stop: Sender<()>,
    thread: JoinHandle<Recorded>,
}

/// An [`EventsTable::write`], its format left behind.
type WriteEvents = Box<dyn FnMut(&[Event]) -> Result<EventsFile, FileError> + Send>;

/// The recorder thread's state, handed back when it stops.
struct Recorded {
    write: WriteEvents,
    /// Taken from the log but not written yet (a write failed).
    unwritten: Vec<Event>,
    report: EventsReport,
}

impl Recorded {
    fn write(&mut self) {
        if self.unwritten.is_empty() {
            return;
        }
        match (self.write)(&self.unwritten) {
            Ok(file) => {
                self.report.files.push(file);
                self.unwritten.clear();
            }
            Err(e) => {
                let message = format!("events table: {e}");
                // A disk that stays full fails every write the same way: say it once.
                if self.report.errors.last() != Some(&message) {
                    self.report.errors.push(message);
                }
            }
        }
    }
}

impl EventRecorder {
    /// How often the log is taken and written while the session runs (when something was logged).
    pub const EVERY: Duration = Duration::from_millis(500);

    /// Starts the thread that writes `log` into `table` every `every` while something was logged.
    pub fn spawn<F: TableFormat>(
        log: Arc<EventLog>,
        mut table: EventsTable<F>,
        every: Duration,
    ) -> Result<EventRecorder, ExporterError> {
        let (stop, stopped) = crossbeam::channel::bounded::<()>(0);
        let mut recorded = Recorded {
            write: Box::new(move |events| table.write(events)),
            unwritten: Vec::new(),
            report: EventsReport::default(),
        };
        let thread_log = log.clone();
        let thread = std::thread::Builder::new()
            .name("ringscope-events".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    if !thread_log.is_empty() {
                        recorded.unwritten.extend(thread_log.take());
                    }
                    recorded.write();
                }
                recorded
            })
            .map_err(ExporterError::Spawn)?;
        Ok(EventRecorder { log, stop, thread })
    }

    /// Stops the thread, then takes what is left in the log and writes it. Call it once nothing can be dropped any
    /// more (the drain and every sink have finished), so that the table holds every drop counted.
    pub fn finish(self) -> Result<EventsReport, ExporterError> {
        drop(self.stop);
        let mut recorded =
            self.thread.join().map_err(|_| ExporterError::Panicked("the events table's writer panicked".into()))?;
        recorded.unwritten.extend(self.log.take());
        recorded.write();
        if !recorded.unwritten.is_empty() {
            recorded.report.errors.push(format!(
                "events table: {} events could not be written (the accounting still counts their drops)",
                recorded.unwritten.len()
            ));
        }
        Ok(recorded.report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writing::ParquetTable;
    use ringscope_policy::DropReason;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ringscope-events-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn rung_change(step: u64) -> Event {
        Event {
            unix_ns: ringscope_policy::events::unix_ns_now(),
            hookpoint: "layers.1.resid".into(),
            first_step: step,
            last_step: step,
            kind: EventKind::Rung,
            rung: "every_4".into(),
            reason: "drain_rate".into(),
            records_lost: 0,
            rows_lost: 0,
            detail: "full -> every_4: drain 21.3 GB/s over cap 20 GB/s".into(),
            request_id: None,
            first_position: None,
            end_position: None,
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn each_write_commits_one_file_and_every_event_reads_back_as_it_was() {
        let run = tempdir("table");
        assert!(read_events(&run).unwrap().is_empty(), "no directory: no events");
        let log = EventLog::new();
        log.dropped("layers.0.resid", DropReason::RingFull, 3, 1, 8);
        log.dropped("layers.0.resid", DropReason::RingFull, 4, 1, 8);
        log.push(rung_change(5));
        let first = log.take();
        log.dropped("layers.0.resid", DropReason::SinkError, 9, 2, 16);
        let second = log.take();
        let mut table = EventsTable::new(ParquetTable, &run);
        let a = table.write(&first).unwrap();
        let b = table.write(&second).unwrap();
        assert_eq!((a.events, a.rows_lost, b.events, b.rows_lost), (2, 16, 1, 16));
        assert_eq!(names(table.dir()), ["part-00000.parquet", "part-00001.parquet"], "committed, nothing in progress");
        let read = read_events(&run).unwrap();
        assert_eq!(read, [first, second].concat());
        std::fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn ranks_sharing_a_run_directory_write_their_own_files() {
        let run = tempdir("ranks");
        let log = EventLog::new();
        log.dropped("layers.0.resid", DropReason::RingFull, 3, 1, 8);
        let rank0 = log.take();
        log.dropped("layers.0.resid", DropReason::SinkError, 4, 2, 16);
        let rank1 = log.take();
        let mut t0 = EventsTable::new(ParquetTable, &run);
        let mut t1 = EventsTable::with_rank(ParquetTable, &run, 1);
        t1.write(&rank1).unwrap();
        t0.write(&rank0).unwrap();
        assert_eq!(names(t0.dir()), ["part-00000-rank1.parquet", "part-00000.parquet"]);
        let read = read_events(&run).unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read.iter().map(|e| e.rows_lost).sum::<u64>(), 24, "both ranks' events read back");
        std::fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_nothing_and_its_number_is_taken_by_the_next() {
        let run = tempdir("failed");
        std::fs::create_dir_all(&run).unwrap();
        // The table's directory cannot be created: a plain file has its name.
        std::fs::write(run.join(EVENTS_DIR), b"in the way").unwrap();
        let mut table = EventsTable::new(ParquetTable, &run);
        let events = vec![rung_change(1)];
        let err = table.write(&events).unwrap_err().to_string();
        assert!(err.contains(EVENTS_DIR), "{err}");
        std::fs::remove_file(run.join(EVENTS_DIR)).unwrap();
        assert_eq!(table.write(&events).unwrap().path, run.join(EVENTS_DIR).join("part-00000.parquet"));
        // A run directory reused: numbering goes on after the files there.
        let mut again = EventsTable::new(ParquetTable, &run);
        assert!(again.write(&events).unwrap().path.ends_with("part-00001.parquet"));
        assert_eq!(read_events(&run).unwrap().len(), 2);
        std::fs::remove_dir_all(&run).unwrap();
    }

    #[test]
    fn the_recorder_writes_as_it_happens_and_the_rest_at_finish_and_nothing_without_events() {
        let run = tempdir("recorder");
        let log = Arc::new(EventLog::new());
        let quiet =
            EventRecorder::spawn(log.clone(), EventsTable::new(ParquetTable, &run), Duration::from_millis(5)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let report = quiet.finish().unwrap();
        assert!(report.files.is_empty() && report.errors.is_empty(), "{report:?}");
        assert!(!run.join(EVENTS_DIR).exists(), "no events: no table");

        let recorder =
            EventRecorder::spawn(log.clone(), EventsTable::new(ParquetTable, &run), Duration::from_millis(5)).unwrap();
        for step in 0..100 {
            log.dropped("layers.0.resid", DropReason::RingFull, step, 1, 2);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !run.join(EVENTS_DIR).join("part-00000.parquet").exists() {
            assert!(std::time::Instant::now() < deadline, "nothing was written while the session ran");
            std::thread::sleep(Duration::from_millis(1));
        }
        for step in 100..150 {
            log.dropped("layers.0.resid", DropReason::RingFull, step, 1, 2);
        }
        let report = recorder.finish().unwrap();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert!(report.files.len() >= 2, "{report:?}");
        let read = read_events(&run).unwrap();
        assert_eq!(read.iter().map(|e| e.rows_lost).sum::<u64>(), 300);
        assert_eq!(report.files.iter().map(|f| f.rows_lost).sum::<u64>(), 300);
        assert_eq!((read.first().unwrap().first_step, read.last().unwrap().last_step), (0, 149));
        std::fs::remove_dir_all(&run).unwrap();
    }
}
