//! Routing: records leave the ring and reach every sink and consumer that asked for them, each behind a bounded
//! queue, with the policy deciding what happens when a queue is full.
//!
//! * [`drain`] — the drain thread: ring → [`Record`]s → one port per destination; sink worker threads.
//! * [`fanout`] — ports, byte-bounded backlogs, [`Filter`]s and consumers' [`Subscription`]s.
//! * [`record`] — a record after the ring, and the [`Receipt`] that accounts for it.
//! * [`sink`] — the [`Sink`] trait: the one seam between routing and everything that writes.
//! * [`catalog`] — what a record's hookpoint id stands for ([`Catalog`]).
//! * [`monitor`] — the drain's numbers for monitoring, read from any thread ([`DrainMonitor`]).

pub mod catalog;
pub mod drain;
pub mod fanout;
pub mod monitor;
pub mod record;
pub mod sink;

pub use catalog::{Catalog, CatalogEntry};
pub use drain::{Commits, Drain, DrainOptions, DrainReport, SinkFailure, SinkHealth, SinkReport};
pub use fanout::{Filter, Subscription};
pub use monitor::{DestinationKind, DestinationStats, DrainMonitor, DrainStats};
pub use record::{Receipt, Record};
pub use sink::{BoxError, CallbackSink, HookPointSummary, Sink, SinkError, Summary, SummarySink};
