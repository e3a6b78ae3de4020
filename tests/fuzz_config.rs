//! Fuzzing the TOML session configuration with proptest: `Config::from_toml`, then `Session::new` and one step.
//!
//! Documents come from a grammar close to the real schema — the known sections and keys, unknown and misspelt ones,
//! values of the right and of the wrong type, numbers at the edges (negative, past `i64`, hex), odd strings (NUL,
//! unicode, control characters), byte sizes with and without units ("1 PiB", "-3 MiB", "0x10"), deep nesting — and
//! from raw text. Whatever the document, nothing panics, and a refusal is an [`Error`] whose message says what is
//! wrong. Sessions are opened only for the host backend, with rings larger than [`MAX_RING`] (the default's 64 MiB
//! included) cut to 64 KiB, so that the run allocates little; file sinks write under a temporary directory. The default run is `PROPTEST_CASES` (256) cases
//! per property; docs/testing.md ("Fuzzing") says how to run longer.

use proptest::prelude::*;
use ringscope::config::Backend;
use ringscope::{Config, Error, Session};

/// Largest ring a fuzzed configuration may open; larger ones are cut to 64 KiB.
const MAX_RING: u64 = 4 << 20;

/// A TOML value, rendered by [`render`].
#[derive(Debug, Clone)]
enum Value {
    /// Written as is: integers (also malformed ones), floats, booleans.
    Raw(String),
    /// A basic string, escaped.
    Str(String),
    Array(Vec<Value>),
    Table(Vec<(String, Value)>),
}

fn render(v: &Value) -> String {
    match v {
        Value::Raw(s) => s.clone(),
        Value::Str(s) => quote(s),
        Value::Array(items) => format!("[{}]", items.iter().map(render).collect::<Vec<_>>().join(", ")),
        Value::Table(kv) => {
            format!(
                "{{ {} }}",
                kv.iter().map(|(k, v)| format!("{} = {}", key(k), render(v))).collect::<Vec<_>>().join(", ")
            )
        }
    }
}

/// A TOML basic string: `"` and `\` escaped, control characters (NUL included) as `\uXXXX`.
fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn key(k: &str) -> String {
    if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        k.to_owned()
    } else {
        quote(k)
    }
}

const RING_KEYS: &[&str] =
    &["capacity", "backend", "device", "max_batch_rows", "drain_chunk", "drain_in_flight", "defer_captures"];
const POLICY_KEYS: &[&str] = &["mode", "full_deadline_ms"];
const EXPORT_KEYS: &[&str] = &[
    "backlog",
    "parquet",
    "arrow_ipc",
    "dir",
    "run_id",
    "rank",
    "max_file_size",
    "compression",
    "zstd_level",
    "threads",
    "direct_io",
];
const METRICS_KEYS: &[&str] = &["listen", "allow_remote"];
const HOOKPOINT_KEYS: &[&str] = &["name", "site", "layer", "dtype", "row_width", "rows", "every_n_steps", "enabled"];
const UNKNOWN_KEYS: &[&str] = &["capacty", "colour", "Mode", "ring", "hookpoints", "", " ", "ключ", "a.b", "\u{0}"];

/// Integers as TOML text: the edges of every integer type the schema uses, past `i64` (a TOML error), hex, octal,
/// binary, underscores, signs.
fn int_text() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "64",
            "1024",
            "4096",
            "65536",
            "1048576",
            "2147483647",
            "2147483648",
            "4294967295",
            "4294967296",
            "-2147483649",
            "9223372036854775807",
            "-9223372036854775808",
            "18446744073709551615",
            "99999999999999999999999",
            "0x10",
            "0o777",
            "0b1010",
            "1_000",
            "+5",
            "007",
        ])
        .prop_map(str::to_owned),
        any::<i64>().prop_map(|n| n.to_string()),
        (0i64..5_000_000).prop_map(|n| n.to_string()),
    ]
}

/// Strings: sizes with and without units, the schema's names, and odd text.
fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "64 MiB",
            "1 MiB",
            "256KiB",
            "1GiB",
            "1 PiB",
            "-3 MiB",
            "0x10",
            "1.5 MiB",
            "1e6",
            "",
            " ",
            "18446744073709551615 GiB",
            "4294967296",
            "64 furlongs",
            "MiB",
            "1 mib",
            "2 k",
            "3M",
            "4 KB",
            "host",
            "cuda",
            "full",
            "best_effort",
            "sometimes",
            "zstd",
            "lz4",
            "none",
            "auto",
            "on",
            "off",
            "all",
            "last_per_request",
            "some",
            "bf16",
            "bfloat16",
            "f32",
            "float16",
            "complex128",
            "residual",
            "attention_output",
            "mlp_output",
            "logits",
            "elsewhere",
            "layers.0.resid",
            "a/b",
            "..",
            ".hidden",
            "run-1",
            "nul\u{0}inside",
            "tab\tand\nnewline",
            "ünïcödé 🦀",
            "\u{202e}rtl",
            "\u{fffd}",
        ])
        .prop_map(str::to_owned),
        "\\PC{0,24}",
        any::<String>().prop_map(|s| s.chars().take(32).collect()),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => int_text().prop_map(Value::Raw),
        4 => string().prop_map(Value::Str),
        2 => any::<bool>().prop_map(|b| Value::Raw(b.to_string())),
        1 => prop::sample::select(vec!["1.5", "-0.0", "1e300", "nan", "inf", "-inf", "1979-05-27T07:32:00Z"])
            .prop_map(|s| Value::Raw(s.to_owned())),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(HOOKPOINT_KEYS.to_vec()).prop_map(str::to_owned), inner), 0..4)
                .prop_map(Value::Table),
        ]
    })
}

/// A value for `key`: mostly one that fits (some of the right type but unusable: a capacity that is not a multiple
/// of 128 bytes, `every_n_steps = 0`, ...); in a `wild` document, sometimes anything at all.
fn value_for(key: &'static str, wild: bool) -> BoxedStrategy<Value> {
    let s = |v: Vec<&'static str>| prop::sample::select(v).prop_map(|s| Value::Str(s.to_owned())).boxed();
    let raw = |v: Vec<&'static str>| prop::sample::select(v).prop_map(|s| Value::Raw(s.to_owned())).boxed();
    let fits: BoxedStrategy<Value> = match key {
        "capacity" | "backlog" => prop_oneof![
            6 => raw(vec!["\"64 KiB\"", "\"256 KiB\"", "\"1 MiB\"", "65536", "\"4 MiB\"", "\"1m\""]),
            1 => raw(vec!["1000", "0", "\"1 PiB\"", "\"-3 MiB\"", "\"0x10\"", "-1", "\"64 GiB\"", "\"18446744073709551615 GiB\""]),
            1 => string().prop_map(Value::Str),
        ]
        .boxed(),
        "drain_chunk" | "max_file_size" => prop_oneof![
            4 => raw(vec!["\"4 MiB\"", "4096", "\"1 KiB\""]),
            1 => raw(vec!["10", "0", "\"1 PiB\""]),
        ]
        .boxed(),
        "backend" => prop_oneof![8 => s(vec!["host"]), 1 => s(vec!["cuda", "tpu", "HOST"])].boxed(),
        "mode" => prop_oneof![4 => s(vec!["full", "best_effort"]), 1 => s(vec!["sometimes", ""])].boxed(),
        "full_deadline_ms" => {
            raw(vec!["5000", "1", "2", "0", "18446744073709551615", "9223372036854775807", "-5", "1000000000000"])
        }
        "compression" => s(vec!["zstd", "lz4", "none", "gzip"]),
        "direct_io" => s(vec!["auto", "off", "on", "maybe"]),
        "zstd_level" => raw(vec!["1", "3", "-7", "22", "23", "2147483647", "-2147483648"]),
        "threads" => raw(vec!["1", "2", "0", "257", "4294967295"]),
        "rank" | "device" | "layer" => raw(vec!["0", "1", "4294967295", "-1", "4294967296"]),
        "max_batch_rows" | "drain_in_flight" => raw(vec!["1", "8", "0", "1025", "4294967295"]),
        "dtype" => prop_oneof![6 => s(vec!["bf16", "f32", "u8", "float64", "f8e4m3"]), 1 => s(vec!["bf17", "", "F32"])].boxed(),
        "site" => prop_oneof![
            4 => s(vec!["residual", "logits", "mlp_output", "attention_output"]),
            1 => s(vec!["elsewhere", ""]),
            1 => string().prop_map(|s| Value::Table(vec![("custom".into(), Value::Str(s))])),
        ]
        .boxed(),
        "rows" => prop_oneof![
            s(vec!["all", "last_per_request", "some"]),
            prop::collection::vec((0u32..4).prop_map(|n| Value::Raw(n.to_string())), 0..4).prop_map(Value::Array),
            raw(vec!["[4294967295]", "[-1]"]),
        ]
        .boxed(),
        "row_width" => raw(vec!["1", "4", "16", "100", "0", "4294967295", "536870912", "1048576"]),
        "every_n_steps" => raw(vec!["1", "2", "0", "4294967295"]),
        "name" => prop_oneof![8 => s(vec!["h0", "h1", "h2", "layers.0.resid"]), 1 => string().prop_map(Value::Str)].boxed(),
        "dir" => s(vec!["ringscope-out", "", "\u{0}"]),
        "run_id" => prop_oneof![4 => s(vec!["run-1", "r"]), 1 => s(vec!["", "..", "a/b", ".hidden", "nul\u{0}"]), 1 => string().prop_map(Value::Str)].boxed(),
        "parquet" | "arrow_ipc" => prop_oneof![4 => raw(vec!["false"]), 1 => raw(vec!["true"])].boxed(),
        // Port 0 (any free port) or addresses that cannot be bound here (TEST-NET-1, port 1 needs privileges or is
        // taken), and addresses that are not addresses.
        "listen" => prop_oneof![
            3 => s(vec!["127.0.0.1:0", "[::1]:0"]),
            1 => s(vec!["192.0.2.1:0", "localhost:9464", "127.0.0.1", "127.0.0.1:99999", ""]),
            1 => string().prop_map(Value::Str),
        ]
        .boxed(),
        _ => any::<bool>().prop_map(|b| Value::Raw(b.to_string())).boxed(),
    };
    if wild {
        prop_oneof![8 => fits, 1 => value()].boxed()
    } else {
        fits
    }
}

/// The entries of one table: some of its known keys (always the `required` ones), and in a `wild` document
/// sometimes a key of another section or an unknown one.
fn entries(
    keys: &'static [&'static str],
    required: &'static [&'static str],
    wild: bool,
) -> impl Strategy<Value = Vec<(String, Value)>> {
    let known = prop::sample::subsequence(keys.to_vec(), 0..=keys.len()).prop_flat_map(move |mut ks| {
        ks.retain(|k| !required.contains(k));
        ks.splice(0..0, required.iter().copied());
        ks.into_iter().map(|k| value_for(k, wild).prop_map(move |v| (k.to_owned(), v))).collect::<Vec<_>>()
    });
    let stray = prop::option::weighted(
        0.15,
        (
            prop_oneof![
                prop::sample::select(UNKNOWN_KEYS.to_vec()),
                prop::sample::select(RING_KEYS.to_vec()),
                prop::sample::select(EXPORT_KEYS.to_vec()),
            ],
            value(),
        ),
    );
    (known, stray).prop_map(move |(mut kv, stray)| {
        kv.extend(stray.filter(|_| wild).map(|(k, v)| (k.to_owned(), v)));
        kv
    })
}

fn table(header: &str, kv: &[(String, Value)]) -> String {
    let mut out = format!("{header}\n");
    for (k, v) in kv {
        out.push_str(&format!("{} = {}\n", key(k), render(v)));
    }
    out
}

/// A whole document from the schema's grammar. Every section is optional; hookpoints have their required keys
/// unless the document is `wild`, which also brings unknown keys and sections, a section twice, and values of any
/// type nested far deeper than any key allows.
fn document() -> impl Strategy<Value = String> {
    any::<bool>()
        .prop_flat_map(|wild| {
            let required: &'static [&'static str] = if wild { &[] } else { &["name", "site", "dtype", "row_width"] };
            (
                prop::option::weighted(0.9, entries(RING_KEYS, &[], wild)),
                prop::option::weighted(0.7, entries(POLICY_KEYS, &[], wild)),
                prop::option::weighted(0.5, entries(EXPORT_KEYS, &[], wild)),
                prop::collection::vec(entries(HOOKPOINT_KEYS, required, wild), 0..4),
                prop::option::weighted(0.2, entries(METRICS_KEYS, &[], wild)),
                prop::option::weighted(
                    0.2,
                    (
                        prop::sample::select(vec![
                            "[rings]",
                            "[ring.extra]",
                            "[[ring]]",
                            "[policy]",
                            "[export.parquet]",
                        ]),
                        entries(POLICY_KEYS, &[], wild),
                    ),
                ),
                prop::option::weighted(0.1, (0usize..300, prop::sample::select(RING_KEYS.to_vec()))),
                Just(wild),
            )
        })
        .prop_map(|(ring, policy, export, hookpoints, metrics, odd, deep, wild)| {
            let (odd, deep) = if wild { (odd, deep) } else { (None, None) };
            let mut doc = String::new();
            if let Some(kv) = ring {
                doc += &table("[ring]", &kv);
            }
            if let Some(kv) = policy {
                doc += &table("[policy]", &kv);
            }
            if let Some(kv) = export {
                doc += &table("[export]", &kv);
            }
            for kv in hookpoints {
                doc += &table("[[hookpoints]]", &kv);
            }
            if let Some(kv) = metrics {
                doc += &table("[metrics]", &kv);
            }
            if let Some((header, kv)) = odd {
                doc += &table(header, &kv);
            }
            if let Some((depth, k)) = deep {
                doc += &format!("[ring]\n{k} = {}1{}\n", "[".repeat(depth), "]".repeat(depth));
            }
            doc
        })
}

/// Parses `text`, and where it describes a small host session, opens it, runs one step through every hookpoint,
/// and shuts it down. Checks that every refusal is an `Error` with a message, and that the accounting balances.
fn exercise(text: &str, dir: &std::path::Path) -> Result<(), TestCaseError> {
    let config = match Config::from_toml(text) {
        Ok(c) => c,
        Err(e) => {
            prop_assert!(matches!(e, Error::Config(_)), "from_toml returned {e:?}");
            prop_assert!(e.to_string().len() > "invalid config: ".len(), "an empty message: {e}");
            return Ok(());
        }
    };
    if config.ring.backend != Backend::Host {
        return Ok(());
    }
    let mut config = config;
    if config.ring.capacity.0 > MAX_RING {
        // The default (64 MiB) and larger rings: `Session::new` allocates and touches every page.
        config.ring.capacity.0 = 64 << 10;
    }
    config.export.dir = dir.to_string_lossy().into_owned();
    let session = match Session::new(config.clone()) {
        Ok(s) => s,
        Err(e) => {
            let msg = e.to_string();
            prop_assert!(!msg.is_empty());
            return Ok(());
        }
    };
    let rows = [(1u64, 0u32), (2, 5)];
    session.begin_step(0, rows).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for hp in session.hookpoints() {
        let data = vec![7u8; rows.len() * hp.spec().row_bytes() as usize];
        // Refusals (a row selection past the batch, a record larger than the ring, ...) are errors, not panics.
        let _ = session.capture(hp.id(), &data);
    }
    session.end_step().map_err(|e| TestCaseError::fail(e.to_string()))?;
    match session.shutdown() {
        Ok(report) => prop_assert!(report.accounting.check().is_ok()),
        Err(Error::Unbalanced { error, .. }) => prop_assert!(false, "unbalanced accounting: {error}"),
        // A file sink that could not write (a run id that is not a directory name, ...) is an error with a message.
        Err(e) => prop_assert!(!e.to_string().is_empty()),
    }
    Ok(())
}

/// 128 cases unless `PROPTEST_CASES` says otherwise.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
}

fn scratch_dir() -> tempdir::Scratch {
    tempdir::Scratch::new("fuzz-config")
}

/// A directory under the system's temporary directory, removed when dropped.
mod tempdir {
    pub struct Scratch(pub std::path::PathBuf);

    impl Scratch {
        /// A directory of its own for each call: the tests run on several threads at once, and one removing a
        /// directory another is creating or using made either fail ("File exists", files gone mid-run).
        pub fn new(label: &str) -> Scratch {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("ringscope-{label}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create a scratch directory");
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Documents from the schema's grammar: parsed, and opened and run where they describe a small host session.
    #[test]
    fn schema_shaped_documents_never_panic(doc in document()) {
        let dir = scratch_dir();
        exercise(&doc, &dir.0)?;
    }

    /// Raw text, and a valid document with random bytes spliced in.
    #[test]
    fn raw_text_never_panics(text in "\\PC{0,200}", splice in prop::collection::vec(any::<u8>(), 0..16), at in any::<usize>()) {
        let dir = scratch_dir();
        exercise(&text, &dir.0)?;
        let mut doc = b"[ring]\ncapacity = \"1 MiB\"\n[policy]\nmode = \"best_effort\"\n".to_vec();
        let at = at % (doc.len() + 1);
        doc.splice(at..at, splice);
        exercise(&String::from_utf8_lossy(&doc), &dir.0)?;
    }

    /// A valid document with one known key given a value of the wrong type: refused, and the message names the key.
    #[test]
    fn a_wrong_type_is_refused_and_the_key_named(
        section in 0usize..4, pick in any::<prop::sample::Index>(),
        wrong in prop::sample::select(vec!["{ oops = 1 }", "[true]", "1979-05-27T07:32:00Z", "[[1], [\"a\"]]"]),
    ) {
        let (header, keys) = [("[ring]", RING_KEYS), ("[policy]", POLICY_KEYS), ("[export]", EXPORT_KEYS), ("[[hookpoints]]", HOOKPOINT_KEYS)][section];
        let k = keys[pick.index(keys.len())];
        let mut kv: Vec<(String, Value)> = Vec::new();
        if section == 3 {
            for (name, v) in [("name", "\"h\""), ("site", "\"residual\""), ("dtype", "\"bf16\""), ("row_width", "4")] {
                if name != k {
                    kv.push((name.to_owned(), Value::Raw(v.to_owned())));
                }
            }
        }
        kv.push((k.to_owned(), Value::Raw(wrong.to_owned())));
        let doc = table(header, &kv);
        let err = Config::from_toml(&doc).expect_err(&doc).to_string();
        prop_assert!(err.contains(k), "the error for {doc:?} does not name `{k}`: {err}");
    }
}

/// Values of the right type that no session can use: `Session::new` refuses each, naming the key.
#[test]
fn unusable_values_are_refused_naming_the_key() {
    let cases = [
        ("[ring]\ncapacity = 1000", "ring.capacity"),
        ("[ring]\ncapacity = 0", "ring.capacity"),
        ("[ring]\nmax_batch_rows = 0", "ring.max_batch_rows"),
        ("[ring]\ndrain_chunk = 10", "ring.drain_chunk"),
        ("[ring]\ndrain_in_flight = 0", "ring.drain_in_flight"),
        ("[policy]\nfull_deadline_ms = 0", "policy.full_deadline_ms"),
        ("[export]\nthreads = 0", "export.threads"),
        ("[[hookpoints]]\nname = \"h\"\nsite = \"residual\"\ndtype = \"f32\"\nrow_width = 0", "row_width"),
    ];
    for (text, needle) in cases {
        let text =
            if text.starts_with("[ring]") { text.to_owned() } else { format!("[ring]\ncapacity = \"64 KiB\"\n{text}") };
        let err = Config::from_toml(&text).and_then(Session::new).err().unwrap_or_else(|| panic!("{text:?} opened"));
        assert!(err.to_string().contains(needle), "{text:?}: {err}");
    }
}

/// A full-mode deadline too far away to add to a clock reading (`full_deadline_ms` = `i64::MAX`, the largest TOML integer): captures, the
/// drain and shutdown work as with a long deadline.
#[test]
fn a_deadline_past_the_end_of_time_is_a_long_deadline() {
    let text = "[ring]\ncapacity = \"64 KiB\"\n[policy]\nmode = \"full\"\nfull_deadline_ms = 9223372036854775807\n\
                [[hookpoints]]\nname = \"h\"\nsite = \"residual\"\ndtype = \"u8\"\nrow_width = 64\n";
    let session = Session::new(Config::from_toml(text).unwrap()).unwrap();
    let sub = session.subscribe("probe", ringscope::Filter::all()).unwrap();
    for step in 0..200 {
        session.begin_step(step, [(1, step as u32)]).unwrap();
        session.capture(0, &[step as u8; 64]).unwrap();
        session.end_step().unwrap();
    }
    drop(sub);
    let report = session.shutdown().unwrap();
    assert!(report.accounting.check().is_ok());
}
