//! The session's statistics in the Prometheus text exposition format (version 0.0.4), and the optional HTTP endpoint
//! that serves them (`[metrics] listen`, off by default).
//!
//! Every metric is named `ringscope_…`; counters end in `_total`; per-hookpoint series carry `hookpoint="…"`,
//! drops also `reason="…"`, per-destination series `destination="…"` and `kind="sink|consumer"`. The numbers are
//! those of [`SessionStats`] (its docs say what each means, per backend).
//!
//! The endpoint is one thread with a non-blocking `std::net` listener: it polls for a connection every few
//! milliseconds, so it stops within that time when the session shuts down (shutdown never waits for a client). Each
//! connection is served on a short-lived thread of its own, at most [`MAX_CONNECTIONS`] at once (past that a new
//! connection gets `503` at once), each cut off [`CONNECTION_DEADLINE`] after it was accepted however slowly it sends
//! or reads: idle or slow clients cost their own connection, never another scrape's or the session's time. No HTTP
//! crate is needed for `GET /metrics`.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ringscope_policy::{DropReason, Tally};

use crate::stats::{Observer, SessionStats};
use crate::Error;

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Writes metric families: `# HELP`, `# TYPE`, then the samples, one family at a time.
struct Exposition {
    out: String,
}

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: Kind, help: &str) {
        debug_assert!(matches!(kind, Kind::Gauge) || name.ends_with("_total"), "{name}");
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        // HELP text escapes only backslash and newline.
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP ringscope_{name} {help}\n# TYPE ringscope_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.out.push_str("ringscope_");
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(k);
                self.out.push_str("=\"");
                escape_label_value(&mut self.out, v);
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// One family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: Kind, help: &str, value: impl std::fmt::Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }
}

/// A label value as the format wants it: backslash, double quote and newline escaped.
fn escape_label_value(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Seconds, for the text (Rust's float formatting never uses an exponent, and these are finite).
fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// `stats` in the Prometheus text exposition format 0.0.4.
pub fn exposition(stats: &SessionStats) -> String {
    let mut e = Exposition { out: String::with_capacity(1024 + 2048 * stats.hookpoints.len()) };
    e.family("session_info", Kind::Gauge, "The session's loss policy mode and ring backend (always 1).");
    e.sample("session_info", &[("mode", &stats.mode.to_string()), ("backend", stats.backend)], 1);
    e.single("uptime_seconds", Kind::Gauge, "Seconds since the session started.", seconds(stats.uptime));
    e.single("steps_total", Kind::Counter, "Steps begun through begin_step / begin_step_on.", stats.steps);
    e.single("stalls_total", Kind::Counter, "Full mode: times a producer waited for room in the ring.", stats.stalls);
    e.single(
        "stall_seconds_total",
        Kind::Counter,
        "Full mode: seconds producers waited for room in the ring, all waits together.",
        seconds(stats.stall_time),
    );
    if let Some(t) = stats.step_time {
        e.single(
            "step_duration_seconds",
            Kind::Gauge,
            "Mean time from begin_step to end_step over the last steps, as the engine reported them.",
            seconds(t),
        );
    }
    if let Some(t) = stats.step_interval {
        e.single(
            "step_interval_seconds",
            Kind::Gauge,
            "Mean time from one begin_step to the next over the last steps.",
            seconds(t),
        );
    }

    let r = &stats.ring;
    e.single("ring_capacity_bytes", Kind::Gauge, "Bytes of the ring.", r.capacity_bytes);
    e.single("ring_used_bytes", Kind::Gauge, "Ring bytes published and not yet reclaimed.", r.used_bytes);
    e.single("ring_held_bytes", Kind::Gauge, "Ring (CUDA: staging) bytes lent to sinks and consumers.", r.held_bytes);

    let d = &stats.drain;
    e.single("drain_records_total", Kind::Counter, "Records the drain handed on from the ring.", d.records);
    e.single("drain_rows_total", Kind::Counter, "Token rows in those records.", d.rows);
    e.single("drain_bytes_total", Kind::Counter, "Ring bytes of those records.", d.bytes);
    e.single("drain_data_bytes_total", Kind::Counter, "Activation bytes of those records.", d.data_bytes);

    type Field = fn(&crate::DestinationStats) -> u64;
    let destination_metrics: [(&str, Kind, &str, Field); 6] = [
        ("destination_delivered_records_total", Kind::Counter, "Records a sink wrote or a consumer received.", |d| {
            d.delivered_records
        }),
        ("destination_delivered_bytes_total", Kind::Counter, "Bytes of the records delivered.", |d| d.delivered_bytes),
        ("destination_queued_records", Kind::Gauge, "Records queued for the destination: its lag.", |d| {
            d.queued_records
        }),
        ("destination_queued_bytes", Kind::Gauge, "Bytes queued for the destination.", |d| d.queued_bytes),
        (
            "destination_dropped_records_total",
            Kind::Counter,
            "Records dropped for the destination because its backlog was full.",
            |d| d.dropped_records,
        ),
        ("destination_failed", Kind::Gauge, "1 once the sink has failed.", |d| d.failed as u64),
    ];
    if !stats.destinations.is_empty() {
        for (name, kind, help, field) in destination_metrics {
            e.family(name, kind, help);
            for d in &stats.destinations {
                e.sample(name, &[("destination", &d.name), ("kind", d.kind.name())], field(d));
            }
        }
    }

    type Unit = fn(Tally) -> u64;
    const UNITS: [(&str, Unit); 2] = [("records", |t| t.records), ("rows", |t| t.rows)];
    type Count = fn(&crate::HookPointStats) -> Tally;
    let counts: [(&str, &str, Count); 5] = [
        ("produced", "captures offered (before sampling and drops)", |h| h.counters.produced),
        ("sampled_out", "captures skipped by sampling or because the hookpoint was disabled", |h| {
            h.counters.sampled_out
        }),
        ("published", "records that entered the ring", |h| h.counters.published),
        ("exported", "records that reached every destination", |h| h.counters.exported),
        ("downcast", "exported records that were downcast to fp8 on capture (a part of exported)", |h| {
            h.counters.downcast
        }),
    ];
    if !stats.hookpoints.is_empty() {
        for (what, help, count) in counts {
            for (unit, pick) in UNITS {
                let name = format!("hookpoint_{what}_{unit}_total");
                e.family(&name, Kind::Counter, &format!("Per hookpoint, {unit} of {help}."));
                for h in &stats.hookpoints {
                    e.sample(&name, &[("hookpoint", &h.name)], pick(count(h)));
                }
            }
        }
        for (unit, pick) in UNITS {
            let name = format!("hookpoint_dropped_{unit}_total");
            e.family(&name, Kind::Counter, &format!("Per hookpoint and reason, {unit} dropped."));
            for h in &stats.hookpoints {
                for reason in DropReason::ALL {
                    let labels = [("hookpoint", h.name.as_str()), ("reason", reason.name())];
                    e.sample(&name, &labels, pick(h.counters.dropped_for(reason)));
                }
            }
        }
        type Bytes = fn(&crate::HookPointStats) -> u64;
        let bytes: [(&str, &str, Bytes); 3] = [
            ("produced", "offered for capture", |h| h.produced_bytes),
            ("published", "that entered the ring", |h| h.published_bytes),
            ("exported", "that reached every destination", |h| h.exported_bytes),
        ];
        for (what, help, field) in bytes {
            let name = format!("hookpoint_{what}_bytes_total");
            e.family(&name, Kind::Counter, &format!("Per hookpoint, activation bytes {help}."));
            for h in &stats.hookpoints {
                e.sample(&name, &[("hookpoint", &h.name)], field(h));
            }
        }
        e.family("hookpoint_rung", Kind::Gauge, "The capture level a hookpoint's controls select (the rung label; 1).");
        for h in &stats.hookpoints {
            e.sample("hookpoint_rung", &[("hookpoint", &h.name), ("rung", &h.rung)], 1);
        }
    }
    e.out
}

/// The endpoint's thread; stopped (and joined) by [`MetricsServer::stop`] or when dropped.
pub(crate) struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// How often the listener looks for a connection: the longest a shutdown waits for the thread to notice.
const POLL: Duration = Duration::from_millis(10);
/// How long one connection may take, from accept to the last byte of the answer (reading the request included).
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(2);
/// Connections served at once (each on a thread with a small stack, idle until its client sends or its deadline
/// passes); more get `503 Service Unavailable` without waiting.
pub const MAX_CONNECTIONS: usize = 512;

/// Binds `addr` (at session start, so that a port in use is an error then), non-blocking.
pub(crate) fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    let setting = |e: std::io::Error| Error::Setting {
        key: "metrics.listen",
        source: format!("could not listen on {addr}: {e} (choose another port, or port 0 for any free one)").into(),
    };
    let listener = TcpListener::bind(addr).map_err(setting)?;
    listener.set_nonblocking(true).map_err(setting)?;
    Ok(listener)
}

impl MetricsServer {
    /// Serves `observer`'s statistics on `listener` from a thread of its own.
    pub(crate) fn start(listener: TcpListener, observer: Arc<Observer>) -> Result<MetricsServer, Error> {
        let addr = listener.local_addr().map_err(|e| Error::Setting { key: "metrics.listen", source: e.into() })?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("ringscope-metrics".into())
                .spawn(move || serve(listener, &observer, &stop))
                .map_err(|e| Error::Setting { key: "metrics.listen", source: e.into() })?
        };
        Ok(MetricsServer { addr, stop, thread: Some(thread) })
    }

    /// The address it listens on (the port the system chose, for port 0).
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops the listener and waits for it (at most one poll interval; connections being served finish on their own
    /// threads within their deadline).
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve(listener: TcpListener, observer: &Arc<Observer>, stop: &AtomicBool) {
    let active = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                let deadline = Instant::now() + CONNECTION_DEADLINE;
                if active.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                    let _ = refuse(stream, deadline);
                    continue;
                }
                active.fetch_add(1, Ordering::AcqRel);
                let (observer, done) = (observer.clone(), Active(active.clone()));
                // Detached: bounded by its deadline, it never holds up the listener or the session's shutdown.
                let spawned = std::thread::Builder::new()
                    .name("ringscope-metrics-conn".into())
                    .stack_size(256 << 10)
                    .spawn(move || {
                        let _done = done;
                        let _ = respond(stream, &observer, deadline);
                    });
                // No thread to be had (a resource limit): that connection is dropped, and `Active` was dropped with
                // the closure.
                let _ = spawned;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            // Out of file descriptors and the like: try again later rather than spin.
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// One connection being served (decrements the count when it ends, however it ends).
struct Active(Arc<AtomicUsize>);

impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers `503` to a connection over [`MAX_CONNECTIONS`], without reading its request.
fn refuse(mut stream: TcpStream, deadline: Instant) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    let body = "too many connections to the metrics endpoint; retry\n";
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\
         Retry-After: 1\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    write_until(&mut stream, response.as_bytes(), deadline.min(Instant::now() + Duration::from_millis(100)))?;
    // What the client sent so far is read (and dropped) before the close, so that the answer is not cut off by a
    // reset; nothing is waited for.
    stream.set_nonblocking(true)?;
    let mut sink = [0u8; 4096];
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
    stream.shutdown(std::net::Shutdown::Write)
}

/// Writes `bytes`, giving up at `deadline` (a client that reads slowly is cut off, not waited for).
fn write_until(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "metrics client too slow"));
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(bytes) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one request and answers it: `GET /metrics` → 200 with the exposition, another path → 404, another method →
/// 405. The connection is closed after the answer.
fn respond(mut stream: TcpStream, observer: &Observer, deadline: Instant) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    // The request line is all we need; read until the end of the head (or 8 KiB, or the deadline).
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf)? {
            0 => break,
            n => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = head.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = target.split('?').next().unwrap_or_default();
    let (status, content_type, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", CONTENT_TYPE, exposition(&observer.stats())),
        ("GET", _) => ("404 Not Found", "text/plain; charset=utf-8", "not found: the metrics are at /metrics\n".into()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "only GET /metrics is served\n".into()),
    };
    let allow = if status.starts_with("405") { "Allow: GET\r\n" } else { "" };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        body.len()
    );
    write_until(&mut stream, response.as_bytes(), deadline)?;
    write_until(&mut stream, body.as_bytes(), deadline)
}
