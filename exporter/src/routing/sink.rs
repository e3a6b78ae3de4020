//! The sink trait — the seam between routing and everything that writes records somewhere — and the in-memory
//! sinks.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::dataset::FileError;
use crate::routing::record::Record;

/// Any error, boxed: what a user's callback may return.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A sink failed to take a record (or to close). Every variant names the sink and keeps the error behind it.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// A file sink could not write, finish or commit a file (or set up its directory).
    #[error("sink `{sink}`: {source}")]
    File {
        /// Name of the sink.
        sink: String,
        /// What failed, naming the file.
        #[source]
        source: FileError,
    },
    /// Several partitions of a file sink failed when it closed.
    #[error("sink `{sink}`: {}", .errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Files {
        /// Name of the sink.
        sink: String,
        /// One error per failed partition.
        errors: Vec<FileError>,
    },
    /// A user's sink or callback returned an error.
    #[error("sink `{sink}`: {source}")]
    Callback {
        /// Name of the sink.
        sink: String,
        /// The callback's error.
        #[source]
        source: BoxError,
    },
    /// The sink panicked (a bug in it); it is not called again.
    #[error("sink `{sink}` panicked{}: {message}", if *.on_close { " on close" } else { "" })]
    Panicked {
        /// Name of the sink.
        sink: String,
        /// The panic's message.
        message: String,
        /// Whether it panicked in `close`.
        on_close: bool,
    },
}

impl SinkError {
    /// The name of the sink that failed.
    pub fn sink(&self) -> &str {
        match self {
            SinkError::File { sink, .. }
            | SinkError::Files { sink, .. }
            | SinkError::Callback { sink, .. }
            | SinkError::Panicked { sink, .. } => sink,
        }
    }
}

/// A destination for records. Each sink runs on its own thread and sees the records it subscribed to in stream
/// order, one at a time.
///
/// A record counts as exported once every sink has returned from `write` and dropped its clones and receipts. A
/// sink that buffers data keeps [`Record::receipt`]s until the data is durable and fails them if it is lost. A
/// `write` that returns an error has the record counted as dropped
/// ([`ringscope_policy::DropReason::SinkError`]); the sink is not called again and every later record for it is
/// counted the same way.
pub trait Sink: Send {
    /// Name used in reports and errors.
    fn name(&self) -> &str;
    /// Takes one record.
    fn write(&mut self, record: &Record) -> Result<(), SinkError>;
    /// Makes what it was given so far durable and readable, and goes on taking records: a file sink commits its open
    /// files (the next record opens new ones). Called when a session is flushed, after the sink took every record
    /// captured before the flush. An error fails the sink as a failed `write` does. Default: nothing to do.
    fn commit(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    /// Called once at shutdown, after the last record: flush and close files.
    fn close(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    /// No record came for a while: let go of ring memory held for later (records kept for a batch are lent by the
    /// ring, which gets space back in ring order only). Nothing to do for sinks that keep nothing.
    fn idle(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}

/// What a [`SummarySink`] saw of one hookpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HookPointSummary {
    /// Records received.
    pub records: u64,
    /// Token rows received.
    pub rows: u64,
    /// Activation bytes received (rows only, no metadata).
    pub bytes: u64,
    /// First and last step seen.
    pub steps: Option<(u64, u64)>,
    /// Distinct request ids seen.
    pub requests: u64,
    /// CRC-32 over every row's request id, position and bytes, in stream order: two runs with the same digest saw
    /// the same stream.
    pub digest: u32,
}

/// Per-hookpoint summaries, by hookpoint name.
pub type Summary = BTreeMap<String, HookPointSummary>;

/// Tallies records, rows, bytes, steps and requests per hookpoint. Read the result through the shared handle
/// returned by [`SummarySink::new`].
pub struct SummarySink {
    out: Arc<Mutex<Summary>>,
    requests: BTreeMap<String, HashSet<u64>>,
}

impl SummarySink {
    /// A new sink and the handle its summary is written to.
    pub fn new() -> (SummarySink, Arc<Mutex<Summary>>) {
        let out = Arc::new(Mutex::new(Summary::new()));
        (SummarySink { out: out.clone(), requests: BTreeMap::new() }, out)
    }
}

impl Sink for SummarySink {
    fn name(&self) -> &str {
        "summary"
    }

    fn write(&mut self, record: &Record) -> Result<(), SinkError> {
        let hp = record.hookpoint();
        let view = record.view();
        let mut out = self.out.lock();
        let s = out.entry(hp.name().to_owned()).or_default();
        let step = record.step();
        s.records += 1;
        s.rows += record.rows() as u64;
        s.bytes += view.data().len() as u64;
        s.steps = Some(s.steps.map_or((step, step), |(a, b)| (a.min(step), b.max(step))));
        let seen = self.requests.entry(hp.name().to_owned()).or_default();
        let mut digest = crc32fast::Hasher::new_with_initial(s.digest);
        for (i, m) in view.row_metas().enumerate() {
            seen.insert(m.request_id);
            digest.update(&m.request_id.to_le_bytes());
            digest.update(&m.position.to_le_bytes());
            digest.update(view.row(i));
        }
        s.digest = digest.finalize();
        s.requests = seen.len() as u64;
        Ok(())
    }
}

/// Calls a closure for every record: the simplest online consumer.
pub struct CallbackSink<F> {
    name: String,
    f: F,
}

impl<F> CallbackSink<F>
where
    F: FnMut(&Record) -> Result<(), BoxError> + Send,
{
    /// A sink named `name` that calls `f` per record; an `Err` from `f` fails the sink.
    pub fn new(name: impl Into<String>, f: F) -> Self {
        CallbackSink { name: name.into(), f }
    }
}

impl<F> Sink for CallbackSink<F>
where
    F: FnMut(&Record) -> Result<(), BoxError> + Send,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn write(&mut self, record: &Record) -> Result<(), SinkError> {
        (self.f)(record).map_err(|source| SinkError::Callback { sink: self.name.clone(), source })
    }
}
