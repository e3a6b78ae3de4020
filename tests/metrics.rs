//! The observer observed: `Session::stats`, the Prometheus text (`Session::metrics_text`) parsed back strictly, and
//! the optional HTTP endpoint fetched with a raw socket.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::TcpStream;

use ringscope::{Config, DestinationKind, DropReason, Filter, Mode, RowSelection, Session, SummarySink};

/// Two hookpoints of 4 f32s: `layers.0.resid`, and one whose name needs escaping in a label value.
const ODD: &str = "odd \"name\" \\ here";

fn config(extra: &str) -> Config {
    Config::from_toml(&format!(
        r#"
        [ring]
        capacity = "1 MiB"
        [policy]
        mode = "best_effort"
        [[hookpoints]]
        name = "layers.0.resid"
        site = "residual"
        layer = 0
        dtype = "f32"
        row_width = 4
        [[hookpoints]]
        name = '{ODD}'
        site = "residual"
        layer = 1
        dtype = "f32"
        row_width = 4
        rows = "last_per_request"
        every_n_steps = 2
        {extra}
        "#
    ))
    .unwrap()
}

/// Three steps of two rows (requests 7 and 8), both hookpoints captured each step.
fn run_steps(session: &Session) {
    for step in 0..3u64 {
        session.begin_step(step, [(7, step as u32), (8, step as u32)]).unwrap();
        for hp in session.hookpoints() {
            session.capture(hp.id(), &[0u8; 2 * 16]).unwrap();
        }
        session.end_step().unwrap();
    }
}

#[test]
fn stats_count_steps_production_rungs_and_destinations() {
    let (summary, _) = SummarySink::new();
    let session = Session::builder(config("")).sink(summary).start().unwrap();
    let probe = session.subscribe("probe", Filter::all()).unwrap();
    let before = session.stats();
    assert_eq!((before.steps, before.last_step, before.step_time, before.step_interval), (0, None, None, None));
    assert_eq!((before.mode, before.backend), (Mode::BestEffort, "host"));
    assert_eq!(before.ring.capacity_bytes, 1 << 20);
    run_steps(&session);
    assert!(session.wait_drained(std::time::Duration::from_secs(60)));

    let s = session.stats();
    assert_eq!((s.steps, s.last_step), (3, Some(2)));
    assert!(s.step_time.is_some() && s.step_interval.is_some());
    assert!(s.unix_ns >= before.unix_ns && s.uptime >= before.uptime);
    // Steps 0 and 2 of the sampled hookpoint, one row per request: 2 records of 2 rows; all 3 steps of the other.
    let records = 3 + 2;
    assert_eq!(s.drain.records, records);
    assert_eq!(s.drain.data_bytes, (3 * 2 + 2 * 2) * 16);
    let [resid, odd] = &s.hookpoints[..] else { panic!("{:?}", s.hookpoints) };
    assert_eq!((resid.name.as_str(), resid.row_bytes, resid.rung.as_str()), ("layers.0.resid", 16, "full"));
    assert_eq!((odd.name.as_str(), odd.rung.as_str()), (ODD, "every_2+last_row"));
    assert_eq!((resid.counters.produced.rows, resid.produced_bytes, resid.exported_bytes), (6, 96, 96));
    assert_eq!((odd.counters.produced.records, odd.counters.sampled_out.records), (3, 1));
    assert_eq!(odd.published_bytes, 4 * 16);
    // The sink wrote every record; the probe's queue holds them all until it reads.
    let [sink, consumer] = &s.destinations[..] else { panic!("{:?}", s.destinations) };
    assert_eq!(
        (sink.kind, sink.delivered_records, sink.queued_records, sink.failed),
        (DestinationKind::Sink, records, 0, false)
    );
    assert_eq!((consumer.name.as_str(), consumer.kind), ("probe", DestinationKind::Consumer));
    assert_eq!((consumer.delivered_records, consumer.queued_records), (0, records));
    assert_eq!(consumer.queued_bytes, sink.delivered_bytes);
    // Until the probe reads them, its queued records hold ring space.
    assert!(s.ring.used_bytes > 0 && s.ring.held_bytes > 0, "{:?}", s.ring);
    assert_eq!(probe.iter().take(records as usize).count(), records as usize);
    let after = session.stats();
    assert_eq!((after.destinations[1].delivered_records, after.destinations[1].queued_records), (records, 0));
    // The ring sees the leases returned at the drain's next look (it looks at least every millisecond).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let empty = ringscope::RingStats { capacity_bytes: 1 << 20, used_bytes: 0, held_bytes: 0 };
    while session.stats().ring != empty {
        assert!(std::time::Instant::now() < deadline, "{:?}", session.stats().ring);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    session.hookpoint("layers.0.resid").unwrap().control().set_selection(RowSelection::Rows(vec![1])).unwrap();
    assert_eq!(session.stats().hookpoints[0].rung, "rows");
    session.shutdown().unwrap();
    assert_eq!(session.stats().drain.records, records, "the final numbers stay readable");
}

/// One sample of the exposition: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the text exposition format 0.0.4 strictly: every line is `# HELP`, `# TYPE` or a sample; each family
/// has one HELP and one TYPE before its samples and its samples are contiguous; counters end in `_total`; label
/// values use only the three escapes; no series appears twice.
fn parse(text: &str) -> (HashMap<String, String>, Vec<Sample>) {
    fn name_ok(n: &str) -> bool {
        let mut c = n.chars();
        c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }
    assert!(text.ends_with('\n'), "the text ends with a newline");
    let mut types = HashMap::new();
    let mut helps = HashMap::new();
    let mut samples: Vec<Sample> = Vec::new();
    let mut finished_families: Vec<String> = Vec::new();
    let mut current = String::new();
    let mut series = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP has a text");
            assert!(name_ok(name) && !help.is_empty(), "{line}");
            assert!(helps.insert(name.to_owned(), help.to_owned()).is_none(), "HELP twice: {line}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE has a type");
            assert!(helps.contains_key(name), "TYPE before HELP: {line}");
            assert!(kind == "counter" || kind == "gauge", "{line}");
            assert!(kind != "counter" || name.ends_with("_total"), "a counter without _total: {line}");
            assert!(types.insert(name.to_owned(), kind.to_owned()).is_none(), "TYPE twice: {line}");
            if !current.is_empty() {
                finished_families.push(std::mem::take(&mut current));
            }
            current = name.to_owned();
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "unexpected line {line:?}");
        let name_end = line.find(['{', ' ']).expect("a sample has a value");
        let name = &line[..name_end];
        assert!(name_ok(name) && name.starts_with("ringscope_"), "{line}");
        assert_eq!(name, current, "a sample outside its family's block: {line}");
        assert!(!finished_families.contains(&name.to_owned()));
        let (labels, rest) = parse_labels(&line[name_end..], line);
        let value = rest.strip_prefix(' ').expect("one space before the value");
        assert!(!value.contains(' '), "no timestamps: {line}");
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
        assert!(series.insert((name.to_owned(), labels.clone())), "a series twice: {line}");
        samples.push(Sample { name: name.to_owned(), labels, value });
    }
    for s in &samples {
        assert!(types.contains_key(&s.name), "no TYPE for {}", s.name);
    }
    (types, samples)
}

/// Parses `{k="v",...}` at the start of `text` (if any); returns the labels and the rest of the line.
fn parse_labels<'a>(text: &'a str, line: &str) -> (BTreeMap<String, String>, &'a str) {
    let mut labels = BTreeMap::new();
    let Some(mut r) = text.strip_prefix('{') else { return (labels, text) };
    loop {
        if let Some(rest) = r.strip_prefix('}') {
            return (labels, rest);
        }
        let (key, after) = r.split_once("=\"").unwrap_or_else(|| panic!("label=\"value\" in {line}"));
        assert!(
            !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "label name {key:?} in {line}"
        );
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            let (i, c) = chars.next().unwrap_or_else(|| panic!("an unterminated label value in {line}"));
            match c {
                '"' => break i,
                '\\' => match chars.next().map(|(_, c)| c) {
                    Some('\\') => value.push('\\'),
                    Some('"') => value.push('"'),
                    Some('n') => value.push('\n'),
                    other => panic!("bad escape {other:?} in {line}"),
                },
                '\n' => panic!("a raw newline in a label value: {line}"),
                c => value.push(c),
            }
        };
        assert!(labels.insert(key.to_owned(), value).is_none(), "label twice: {line}");
        r = &after[end + 1..];
        if let Some(rest) = r.strip_prefix(',') {
            r = rest;
        } else {
            assert!(r.starts_with('}'), "`,` or `}}` after a label value: {line}");
        }
    }
}

/// The value of the one sample of `name` whose labels include `labels`.
fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .collect();
    assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}");
    found[0].value
}

fn check_exposition(text: &str, records: f64) {
    let (types, samples) = parse(text);
    assert_eq!(types["ringscope_drain_records_total"], "counter");
    assert_eq!(types["ringscope_ring_used_bytes"], "gauge");
    assert_eq!(value(&samples, "ringscope_steps_total", &[]), 3.0);
    assert_eq!(value(&samples, "ringscope_drain_records_total", &[]), records);
    assert_eq!(value(&samples, "ringscope_ring_capacity_bytes", &[]), (1 << 20) as f64);
    assert!(value(&samples, "ringscope_step_duration_seconds", &[]) >= 0.0);
    assert_eq!(value(&samples, "ringscope_session_info", &[("mode", "best_effort"), ("backend", "host")]), 1.0);
    let resid = [("hookpoint", "layers.0.resid")];
    assert_eq!(value(&samples, "ringscope_hookpoint_produced_rows_total", &resid), 6.0);
    assert_eq!(value(&samples, "ringscope_hookpoint_produced_bytes_total", &resid), 96.0);
    assert_eq!(value(&samples, "ringscope_hookpoint_exported_records_total", &resid), 3.0);
    assert_eq!(value(&samples, "ringscope_hookpoint_sampled_out_records_total", &[("hookpoint", ODD)]), 1.0);
    assert_eq!(value(&samples, "ringscope_hookpoint_rung", &[("hookpoint", ODD), ("rung", "every_2+last_row")]), 1.0);
    assert_eq!(value(&samples, "ringscope_hookpoint_rung", &[("hookpoint", "layers.0.resid"), ("rung", "full")]), 1.0);
    for reason in DropReason::ALL {
        let labels = [("hookpoint", ODD), ("reason", reason.name())];
        assert_eq!(value(&samples, "ringscope_hookpoint_dropped_records_total", &labels), 0.0);
    }
    let probe = [("destination", "probe\n\"2\""), ("kind", "consumer")];
    assert_eq!(value(&samples, "ringscope_destination_queued_records", &probe), records);
    assert_eq!(value(&samples, "ringscope_destination_delivered_records_total", &probe), 0.0);
    assert_eq!(value(&samples, "ringscope_destination_failed", &probe), 0.0);
}

#[test]
fn the_prometheus_text_parses_back_with_every_family_and_escaped_labels() {
    let session = Session::new(config("")).unwrap();
    // A consumer whose name needs every escape the format has.
    let _probe = session.subscribe("probe\n\"2\"", Filter::all()).unwrap();
    run_steps(&session);
    assert!(session.wait_drained(std::time::Duration::from_secs(60)));
    let text = session.metrics_text();
    check_exposition(&text, 5.0);
    assert!(text.contains(r#"hookpoint="odd \"name\" \\ here""#), "{text}");
    assert_eq!(session.metrics_addr(), None, "no endpoint unless configured");
    session.shutdown().unwrap();
}

/// Sends `request` and returns the status line, the headers (lower-cased names) and the body.
fn fetch(addr: std::net::SocketAddr, request: &str) -> (String, HashMap<String, String>, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().to_owned();
    let headers = lines
        .map(|l| l.split_once(": ").expect("a header"))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_owned()))
        .collect::<HashMap<_, _>>();
    assert_eq!(headers["content-length"].parse::<usize>().unwrap(), body.len());
    (status, headers, body.to_owned())
}

#[test]
fn the_endpoint_serves_get_metrics_and_stops_at_shutdown() {
    let session = Session::new(config("[metrics]\nlisten = \"127.0.0.1:0\"")).unwrap();
    let addr = session.metrics_addr().expect("listening");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    let _probe = session.subscribe("probe\n\"2\"", Filter::all()).unwrap();
    run_steps(&session);
    assert!(session.wait_drained(std::time::Duration::from_secs(60)));

    let (status, headers, body) = fetch(addr, "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(headers["content-type"].starts_with("text/plain; version=0.0.4"), "{headers:?}");
    check_exposition(&body, 5.0);
    let (status, _, _) = fetch(addr, "GET /metrics?x=1 HTTP/1.0\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let (status, _, body) = fetch(addr, "GET / HTTP/1.1\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    assert!(body.contains("/metrics"));
    let (status, headers, _) = fetch(addr, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!((status.as_str(), headers["allow"].as_str()), ("HTTP/1.1 405 Method Not Allowed", "GET"));
    // A client that connects and sends nothing does not keep the next one waiting for ever.
    let idle = TcpStream::connect(addr).unwrap();
    let (status, _, _) = fetch(addr, "GET /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK");
    drop(idle);

    session.shutdown().unwrap();
    assert!(TcpStream::connect(addr).is_err(), "the endpoint stops with the session");
}

#[test]
fn a_port_in_use_is_an_error_at_start_naming_the_key_and_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let err = Session::new(config(&format!("[metrics]\nlisten = \"{addr}\""))).err().expect("the port is taken");
    let msg = err.to_string();
    assert!(msg.contains("metrics.listen") && msg.contains(&addr.to_string()), "{msg}");
    let err = Session::new(config("[metrics]\nlisten = \"10.1.2.3:9464\"")).err().expect("not loopback");
    assert!(err.to_string().contains("metrics.allow_remote"), "{err}");
}
