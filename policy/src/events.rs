//! The event log: every rung change and every span of dropped records, as it happens, so that a reader of a dump
//! learns which rows are missing and why without the manifest (the dataset writes the log out as its
//! `_ringscope_events` table).
//!
//! Drops arrive one record at a time, and in storms (millions a second in best-effort mode), so consecutive drops of
//! one hookpoint for one reason coalesce into one open *span* — a step range with the records and rows lost in it —
//! which costs one short lock and no allocation per drop. A span is closed when a drop leaves a gap after it, when
//! the hookpoint's rung changes, or when the log is taken (a span that goes on after a take is a new event).
//!
//! The log only ever holds what the counters count: every drop logged here is also counted as dropped, so over a
//! whole run the events' `rows_lost` per (hookpoint, reason) sum to the counters' dropped rows.

use std::collections::HashMap;
use std::time::SystemTime;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::DropReason;

/// What an [`Event`] records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Records were dropped (a span of steps; `reason` is the [`DropReason`]'s name).
    Drop,
    /// A hookpoint moved along the degradation ladder (`rung` is where it is now).
    Rung,
    /// Capture waited (full mode) for the drain.
    Stall,
    /// Rows of a request the engine did not compute because its prefix cache held them (`rows_lost` rows at
    /// positions from the event's `detail`): no hookpoint or probe ever saw them. Not a drop: no record was lost.
    Cached,
}

impl EventKind {
    /// Stable snake_case name, as written in the events table.
    pub const fn name(self) -> &'static str {
        match self {
            EventKind::Drop => "drop",
            EventKind::Rung => "rung",
            EventKind::Stall => "stall",
            EventKind::Cached => "cached",
        }
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One row of the events table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// When it was logged (a drop span: when its first drop was), in nanoseconds since the Unix epoch.
    pub unix_ns: u64,
    /// The hookpoint; empty for a session-wide event.
    pub hookpoint: String,
    /// First step concerned.
    pub first_step: u64,
    /// Last step concerned (inclusive).
    pub last_step: u64,
    /// What happened.
    pub kind: EventKind,
    /// The rung in force for this hookpoint after the event (empty when unknown).
    pub rung: String,
    /// A drop: the [`DropReason`]'s name (`ring_full`, `sink_error`, ...); a rung change: what moved it
    /// (`drain_rate`, `gpu_ring`, `host_backlog`, `recovered`, ...); a stall: `full_mode_wait`.
    pub reason: String,
    /// Records lost (drops).
    pub records_lost: u64,
    /// Token rows lost (drops).
    pub rows_lost: u64,
    /// Free text, e.g. `every_4 -> last_row: drain 21.3 GB/s over cap 20 GB/s`.
    pub detail: String,
    /// The request the event is about (a prefix-cache hit: `kind = cached`); `None` where it is about no one request.
    #[serde(default)]
    pub request_id: Option<u64>,
    /// The first position of the request the event concerns (with `request_id`).
    #[serde(default)]
    pub first_position: Option<u64>,
    /// One past the last position of the request the event concerns (with `request_id`).
    #[serde(default)]
    pub end_position: Option<u64>,
}

/// Nanoseconds since the Unix epoch, now.
pub fn unix_ns_now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// The log of a session's events. Shared (in an `Arc`) by everything that drops records or changes rungs, and taken
/// by whoever writes it out. See the module docs.
#[derive(Debug, Default)]
pub struct EventLog {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Events no longer open: closed spans and pushed events, in the order they were closed or pushed.
    done: Vec<Event>,
    /// The open drop span of each (hookpoint, reason): by hookpoint name, then indexed like [`DropReason::ALL`].
    /// Keys stay after their spans close, so a hookpoint's next span allocates nothing for its key.
    open: HashMap<String, [Option<Span>; DropReason::ALL.len()]>,
    /// Spans open in `open`.
    open_spans: usize,
    /// Each hookpoint's rung, as its last rung event said: a drop span opened later carries it.
    rungs: HashMap<String, String>,
}

/// Drops of one hookpoint for one reason, not yet written out.
#[derive(Debug)]
struct Span {
    unix_ns: u64,
    first_step: u64,
    last_step: u64,
    records: u64,
    rows: u64,
    rung: String,
}

impl Span {
    fn into_event(self, hookpoint: &str, reason: DropReason) -> Event {
        Event {
            unix_ns: self.unix_ns,
            hookpoint: hookpoint.to_owned(),
            first_step: self.first_step,
            last_step: self.last_step,
            kind: EventKind::Drop,
            rung: self.rung,
            reason: reason.name().to_owned(),
            records_lost: self.records,
            rows_lost: self.rows,
            detail: String::new(),
            request_id: None,
            first_position: None,
            end_position: None,
        }
    }
}

impl EventLog {
    /// An empty log.
    pub fn new() -> Self {
        EventLog::default()
    }

    /// A drop of `records` records (`rows` token rows) of `hookpoint` at `step`, for `reason`: coalesces with the
    /// open span of the same (hookpoint, reason) when `step` is at most one past its last step (a step before the
    /// span's first widens it: spans only grow), else closes that span and opens a new one.
    pub fn dropped(&self, hookpoint: &str, reason: DropReason, step: u64, records: u64, rows: u64) {
        self.dropped_steps(hookpoint, reason, step, step, records, rows);
    }

    /// Like [`dropped`](Self::dropped), for drops somewhere in `first_step..=last_step` (counts made elsewhere and
    /// folded in later, such as the GPU's: the host knows only the steps run since the last fold).
    pub fn dropped_steps(
        &self,
        hookpoint: &str,
        reason: DropReason,
        first_step: u64,
        last_step: u64,
        records: u64,
        rows: u64,
    ) {
        let (first_step, last_step) = (first_step.min(last_step), first_step.max(last_step));
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if !inner.open.contains_key(hookpoint) {
            inner.open.insert(hookpoint.to_owned(), Default::default());
        }
        let slot = &mut inner.open.get_mut(hookpoint).expect("inserted above")[reason.index()];
        if let Some(span) = slot {
            if first_step <= span.last_step.saturating_add(1) {
                span.first_step = span.first_step.min(first_step);
                span.last_step = span.last_step.max(last_step);
                span.records += records;
                span.rows += rows;
                return;
            }
            let closed = slot.take().expect("matched above");
            inner.done.push(closed.into_event(hookpoint, reason));
            inner.open_spans -= 1;
        }
        let rung = inner.rungs.get(hookpoint).cloned().unwrap_or_default();
        *slot = Some(Span { unix_ns: unix_ns_now(), first_step, last_step, records, rows, rung });
        inner.open_spans += 1;
    }

    /// Any other event (a rung change, a stall), appended as it is. A rung change of a hookpoint closes its open drop
    /// spans, and the drop spans opened after it carry its new rung.
    pub fn push(&self, event: Event) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if event.kind == EventKind::Rung && !event.hookpoint.is_empty() {
            if let Some(spans) = inner.open.get_mut(&event.hookpoint) {
                for (i, slot) in spans.iter_mut().enumerate() {
                    if let Some(span) = slot.take() {
                        inner.done.push(span.into_event(&event.hookpoint, DropReason::ALL[i]));
                        inner.open_spans -= 1;
                    }
                }
            }
            inner.rungs.insert(event.hookpoint.clone(), event.rung.clone());
        }
        inner.done.push(event);
    }

    /// Takes everything logged so far, open spans included (a span that goes on after this becomes a new event), in
    /// the order the events were logged (`unix_ns`).
    pub fn take(&self) -> Vec<Event> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut events = std::mem::take(&mut inner.done);
        if inner.open_spans > 0 {
            for (hookpoint, spans) in inner.open.iter_mut() {
                for (i, slot) in spans.iter_mut().enumerate() {
                    if let Some(span) = slot.take() {
                        events.push(span.into_event(hookpoint, DropReason::ALL[i]));
                    }
                }
            }
            inner.open_spans = 0;
        }
        drop(guard);
        events.sort_by_key(|e| e.unix_ns);
        events
    }

    /// Whether nothing was logged since the last [`take`](Self::take).
    pub fn is_empty(&self) -> bool {
        let inner = self.inner.lock();
        inner.done.is_empty() && inner.open_spans == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rung(hookpoint: &str, rung: &str) -> Event {
        Event {
            unix_ns: unix_ns_now(),
            hookpoint: hookpoint.into(),
            first_step: 7,
            last_step: 7,
            kind: EventKind::Rung,
            rung: rung.into(),
            reason: "drain_rate".into(),
            records_lost: 0,
            rows_lost: 0,
            detail: "full -> every_4".into(),
            request_id: None,
            first_position: None,
            end_position: None,
        }
    }

    fn spans(events: &[Event]) -> Vec<(&str, &str, u64, u64, u64, u64)> {
        events
            .iter()
            .filter(|e| e.kind == EventKind::Drop)
            .map(|e| (e.hookpoint.as_str(), e.reason.as_str(), e.first_step, e.last_step, e.records_lost, e.rows_lost))
            .collect()
    }

    #[test]
    fn consecutive_drops_coalesce_and_a_gap_opens_a_new_span() {
        let log = EventLog::new();
        assert!(log.is_empty());
        for step in 10..20 {
            log.dropped("a", DropReason::RingFull, step, 1, 4);
        }
        log.dropped("a", DropReason::RingFull, 15, 1, 4); // within: counted, range unchanged
        log.dropped("a", DropReason::RingFull, 8, 1, 4); // before: the span grows back
        log.dropped("a", DropReason::SinkError, 12, 1, 4); // another reason: its own span
        log.dropped("b", DropReason::RingFull, 12, 1, 2); // another hookpoint: its own span
        log.dropped("a", DropReason::RingFull, 21, 1, 4); // a gap after 19: a new span
        assert!(!log.is_empty());
        let events = log.take();
        let mut got = spans(&events);
        got.sort();
        assert_eq!(
            got,
            vec![
                ("a", "ring_full", 8, 19, 12, 48),
                ("a", "ring_full", 21, 21, 1, 4),
                ("a", "sink_error", 12, 12, 1, 4),
                ("b", "ring_full", 12, 12, 1, 2),
            ]
        );
        assert!(log.is_empty() && log.take().is_empty());
    }

    #[test]
    fn a_span_going_on_after_a_take_is_a_new_event_and_nothing_is_counted_twice() {
        let log = EventLog::new();
        log.dropped("a", DropReason::SinkBackpressure, 1, 1, 3);
        let first = log.take();
        log.dropped("a", DropReason::SinkBackpressure, 2, 1, 3);
        log.dropped_steps("a", DropReason::SinkBackpressure, 3, 9, 5, 15);
        let second = log.take();
        assert_eq!(spans(&first), vec![("a", "sink_backpressure", 1, 1, 1, 3)]);
        assert_eq!(spans(&second), vec![("a", "sink_backpressure", 2, 9, 6, 18)]);
    }

    #[test]
    fn a_rung_change_closes_the_hookpoints_spans_and_later_spans_carry_the_new_rung() {
        let log = EventLog::new();
        log.dropped("a", DropReason::RingFull, 5, 1, 1);
        log.dropped("b", DropReason::RingFull, 5, 1, 1);
        log.push(rung("a", "every_4"));
        log.dropped("a", DropReason::RingFull, 6, 1, 1);
        log.dropped("b", DropReason::RingFull, 6, 1, 1);
        let events = log.take();
        let a: Vec<(EventKind, &str, u64, u64)> = events
            .iter()
            .filter(|e| e.hookpoint == "a")
            .map(|e| (e.kind, e.rung.as_str(), e.first_step, e.last_step))
            .collect();
        assert_eq!(
            a,
            vec![(EventKind::Drop, "", 5, 5), (EventKind::Rung, "every_4", 7, 7), (EventKind::Drop, "every_4", 6, 6)]
        );
        // b's span was not closed by a's rung change.
        assert_eq!(spans(&events).iter().filter(|s| s.0 == "b").count(), 1);
        assert!(events.windows(2).all(|w| w[0].unix_ns <= w[1].unix_ns), "in logging order");
    }

    #[test]
    fn concurrent_drops_sum_exactly() {
        let log = std::sync::Arc::new(EventLog::new());
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for step in 0..10_000u64 {
                        log.dropped(if t % 2 == 0 { "a" } else { "b" }, DropReason::RingFull, step, 1, 2);
                    }
                })
            })
            .collect();
        let mut taken = Vec::new();
        while threads.iter().any(|t| !t.is_finished()) {
            taken.extend(log.take());
        }
        threads.into_iter().for_each(|t| t.join().unwrap());
        taken.extend(log.take());
        let rows: u64 = taken.iter().map(|e| e.rows_lost).sum();
        let records: u64 = taken.iter().map(|e| e.records_lost).sum();
        assert_eq!((records, rows), (40_000, 80_000));
    }

    #[test]
    fn names_are_stable() {
        assert_eq!(
            [EventKind::Drop, EventKind::Rung, EventKind::Stall].map(EventKind::name),
            ["drop", "rung", "stall"]
        );
        let json = serde_json::to_string(&EventKind::Stall);
        assert_eq!(json.unwrap(), "\"stall\"");
    }
}
