//! The C ABI called the way C calls it: statuses, messages, handles, and every bad-input case the header names.
//!
//! Every `unsafe` call here passes either valid pointers with matching lengths, or null / wrong values that the
//! ABI is documented to check (which is what these tests are about); the per-call comments say which.
#![allow(clippy::undocumented_unsafe_blocks)]

use super::*;

fn last_error() -> String {
    // SAFETY: `rs_last_error` returns a valid NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(rs_last_error()) }.to_string_lossy().into_owned()
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn open(extra: &str) -> u64 {
    let cfg = c(&format!("[ring]\ncapacity = \"1 MiB\"\n[policy]\nmode = \"full\"\n{extra}"));
    let mut h = 0u64;
    // SAFETY: valid string and out-pointer.
    assert_eq!(unsafe { rs_session_open(cfg.as_ptr(), &mut h) }, RsStatus::RsOk, "{}", last_error());
    h
}

fn register(s: u64, name: &str, width: u32) -> u32 {
    let mut id = u32::MAX;
    let (n, site, dt) = (c(name), c("residual"), c("bf16"));
    // SAFETY: valid strings and out-pointer.
    let st = unsafe { rs_register_hookpoint(s, n.as_ptr(), site.as_ptr(), 0, dt.as_ptr(), width, &mut id) };
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    id
}

/// Subscribes `name` to every record of session `s`, and gives the drain time to pick the subscription up.
fn subscribe_all(s: u64, name: &str) -> u64 {
    let mut sub = 0u64;
    let name = c(name);
    // SAFETY: valid pointers; no layer filter.
    assert_eq!(unsafe { rs_subscribe(s, name.as_ptr(), std::ptr::null(), 0, &mut sub) }, RsStatus::RsOk);
    std::thread::sleep(Duration::from_millis(20));
    sub
}

#[test]
fn a_session_through_the_c_abi_captures_subscribes_counts_and_closes() {
    let s = open("");
    let id = register(s, "layers.0.resid", 4);
    let sub = subscribe_all(s, "probe");
    let (ids, pos) = ([7u64, 9, 9], [17u32, 0, 1]);
    // SAFETY: arrays of 3.
    assert_eq!(unsafe { rs_begin_step(s, 0, ids.as_ptr(), pos.as_ptr(), 3) }, RsStatus::RsOk);
    let data: Vec<u8> = (0..3 * 8).map(|i| i as u8).collect();
    let mut outcome = -1;
    // SAFETY: `data` holds 24 bytes.
    let st = unsafe { rs_capture_host(s, id, data.as_ptr().cast(), data.len(), &mut outcome) };
    assert_eq!((st, outcome), (RsStatus::RsOk, RS_CAPTURE_PUBLISHED), "{}", last_error());
    assert_eq!(rs_end_step(s), RsStatus::RsOk);

    // Poll: first with a buffer that is too small, then with one that fits.
    let mut info = RsRecordInfo::default();
    // SAFETY: `info` writable; no buffer.
    let st = unsafe { rs_poll(sub, 5000, &mut info, std::ptr::null_mut(), 0) };
    assert_eq!(st, RsStatus::RsErrBufferTooSmall, "{}", last_error());
    assert_eq!((info.rows, info.row_bytes, info.needed), (3, 8, 3 * 16 + 24));
    let mut buf = vec![0u8; info.needed as usize];
    // SAFETY: `buf` holds `needed` bytes.
    let st = unsafe { rs_poll(sub, 5000, &mut info, buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!(u64::from_le_bytes(buf[16..24].try_into().unwrap()), 9, "row 1's request id");
    assert_eq!(u32::from_le_bytes(buf[24..28].try_into().unwrap()), 0, "row 1's position");
    assert_eq!(&buf[48..], &data[..]);

    assert_eq!(rs_flush(s, 5000), RsStatus::RsOk, "{}", last_error());
    let mut counts = RsCounts::default();
    // SAFETY: writable.
    assert_eq!(unsafe { rs_stats(s, id, &mut counts) }, RsStatus::RsOk);
    assert_eq!((counts.produced_rows, counts.exported_rows, counts.dropped_rows), (3, 3, 0));

    let mut totals = RsCounts::default();
    // SAFETY: writable.
    assert_eq!(unsafe { rs_session_close(s, &mut totals) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!((totals.produced_rows, totals.exported_rows), (3, 3));
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "closing twice is harmless");
    // SAFETY: `info` writable.
    assert_eq!(unsafe { rs_poll(sub, 1000, &mut info, std::ptr::null_mut(), 0) }, RsStatus::RsErrEnded);
    assert_eq!(rs_subscription_close(sub), RsStatus::RsOk);
    assert_eq!(rs_subscription_close(sub), RsStatus::RsOk, "closing twice is harmless");
}

#[test]
fn bad_input_gets_the_documented_status_and_a_message() {
    let mut h = 0u64;
    // Null and invalid config.
    // SAFETY: null is checked.
    assert_eq!(unsafe { rs_session_open(std::ptr::null(), &mut h) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("config_toml is a null pointer"), "{}", last_error());
    let bad = c("[ring]\ncapacity = \"lots\"\n");
    // SAFETY: valid string.
    assert_eq!(unsafe { rs_session_open(bad.as_ptr(), &mut h) }, RsStatus::RsErrConfig);
    assert!(last_error().contains("capacity"), "{}", last_error());
    let unknown = c("[ring]\ncolour = 1\n");
    // SAFETY: valid string.
    assert_eq!(unsafe { rs_session_open(unknown.as_ptr(), &mut h) }, RsStatus::RsErrConfig);
    let cuda = c("[ring]\nbackend = \"cuda\"\n");
    // SAFETY: valid string. Without a GPU this is a clear CUDA error; with one it opens.
    match unsafe { rs_session_open(cuda.as_ptr(), &mut h) } {
        // SAFETY: null totals are allowed.
        RsStatus::RsOk => assert_eq!(unsafe { rs_session_close(h, std::ptr::null_mut()) }, RsStatus::RsOk),
        st => assert_eq!(st, RsStatus::RsErrCuda, "{}", last_error()),
    }
    let missing = c("/nonexistent/ringscope.toml");
    // SAFETY: valid string.
    assert_eq!(unsafe { rs_session_open_file(missing.as_ptr(), &mut h) }, RsStatus::RsErrConfig);

    // Handles: zero, made up, of the wrong kind, closed.
    assert_eq!(rs_end_step(0), RsStatus::RsErrInvalidHandle);
    assert_eq!(rs_end_step(0xDEAD_BEEF), RsStatus::RsErrInvalidHandle);
    assert!(last_error().contains("not a ringscope session handle"), "{}", last_error());
    let s = open("");
    let id = register(s, "h", 4);
    let mut sub = 0;
    let n = c("x");
    // SAFETY: valid pointers.
    assert_eq!(unsafe { rs_subscribe(s, n.as_ptr(), std::ptr::null(), 0, &mut sub) }, RsStatus::RsOk);
    assert_eq!(rs_end_step(sub), RsStatus::RsErrInvalidHandle, "a subscription is not a session");
    let mut info = RsRecordInfo::default();
    // SAFETY: `info` writable.
    assert_eq!(unsafe { rs_poll(s, 0, &mut info, std::ptr::null_mut(), 0) }, RsStatus::RsErrInvalidHandle);

    // Steps and captures.
    let data = [0u8; 8];
    // SAFETY: valid pointers.
    assert_eq!(unsafe { rs_capture_host(s, id, data.as_ptr().cast(), 8, std::ptr::null_mut()) }, RsStatus::RsErrStep);
    assert_eq!(rs_end_step(s), RsStatus::RsErrStep);
    let (ids, pos) = ([1u64], [0u32]);
    // SAFETY: null with rows > 0 is checked.
    assert_eq!(unsafe { rs_begin_step(s, 0, std::ptr::null(), pos.as_ptr(), 1) }, RsStatus::RsErrInvalidArgument);
    // SAFETY: zero rows: an empty batch is refused by the session.
    assert_eq!(unsafe { rs_begin_step(s, 0, ids.as_ptr(), pos.as_ptr(), 0) }, RsStatus::RsErrCapture);
    // SAFETY: arrays of 1.
    assert_eq!(unsafe { rs_begin_step(s, 0, ids.as_ptr(), pos.as_ptr(), 1) }, RsStatus::RsOk);
    // SAFETY: arrays of 1.
    assert_eq!(unsafe { rs_begin_step(s, 1, ids.as_ptr(), pos.as_ptr(), 1) }, RsStatus::RsErrStep);
    // SAFETY: 7 of 8 bytes: wrong size for 1 row of 4 bf16.
    assert_eq!(
        unsafe { rs_capture_host(s, id, data.as_ptr().cast(), 7, std::ptr::null_mut()) },
        RsStatus::RsErrCapture
    );
    assert!(last_error().contains("expected 8"), "{}", last_error());
    // SAFETY: valid pointers; unknown hookpoint.
    assert_eq!(
        unsafe { rs_capture_host(s, 99, data.as_ptr().cast(), 8, std::ptr::null_mut()) },
        RsStatus::RsErrCapture
    );
    // SAFETY: a host session refuses device calls before touching the addresses; stream 0 is always valid.
    assert_eq!(unsafe { rs_capture_device(s, id, 0x1000, 1, 0) }, RsStatus::RsErrInvalidArgument, "host session");
    assert!(last_error().contains("host backend"), "{}", last_error());
    assert_eq!(
        // SAFETY: as above.
        unsafe { rs_begin_step_graph(s, 0x1000, 0x2000, 1, 1, 1, 0) },
        RsStatus::RsErrInvalidArgument,
        "host session"
    );
    assert!(last_error().contains("host backend"), "{}", last_error());
    assert_eq!(
        // SAFETY: as above.
        unsafe { rs_begin_step_graph_kept(s, 0x1000, 0x2000, 1, 1, 1, 0x3000, 0) },
        RsStatus::RsErrInvalidArgument,
        "host session"
    );
    assert!(last_error().contains("host backend"), "{}", last_error());
    assert_eq!(
        // SAFETY: a handle that is no session is refused before any address is touched.
        unsafe { rs_begin_step_graph_kept(0xDEAD_BEEF, 0x1000, 0x2000, 1, 1, 1, 0x3000, 0) },
        RsStatus::RsErrInvalidHandle
    );
    // Ended-sequence tokens: the ids are checked (count, null) before the backend is asked.
    let ended = [2i64, 128_009, -1, 4, 5, 6, 7, 8, 9];
    for (ptr, n, want) in [
        (std::ptr::null(), 1, "ended_tokens is a null pointer but 1 elements were announced"),
        (ended.as_ptr(), 0, "0 ended-sequence token ids: give 1 to 8"),
        (ended.as_ptr(), 9, "9 ended-sequence token ids: give 1 to 8"),
        (ended.as_ptr(), 2, "host backend"),
    ] {
        // SAFETY: `ptr` is null or valid for `n` reads; a host session touches no device address.
        let status = unsafe { rs_begin_step_graph_ended(s, 0x1000, 0x2000, 1, 1, 1, 0x3000, 1, ptr, n, 0) };
        assert_eq!(status, RsStatus::RsErrInvalidArgument, "{want}");
        assert!(last_error().contains(want), "{}", last_error());
    }
    // SAFETY: valid ids; a null token tensor is refused before the backend is asked.
    let status = unsafe { rs_begin_step_graph_ended(s, 0x1000, 0x2000, 1, 1, 1, 0, 1, ended.as_ptr(), 1, 0) };
    assert_eq!(status, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("ended-sequence tokens: null device pointer"), "{}", last_error());
    // SAFETY: stream 0 is always valid.
    assert_eq!(unsafe { rs_apply_controls(s, 0) }, RsStatus::RsErrInvalidArgument, "host session");
    assert!(last_error().contains("host backend"), "{}", last_error());
    assert_eq!(rs_submit_captures(s), RsStatus::RsOk, "nothing to submit on the host backend");
    // Held copies are the CUDA backend's: a host session refuses them, naming the backend.
    assert_eq!(rs_hold_step(s, 0), RsStatus::RsErrInvalidArgument, "host session");
    assert!(last_error().contains("host backend"), "{}", last_error());
    // SAFETY: stream 0 is always valid.
    assert_eq!(unsafe { rs_launch_held(s, 0, 0) }, RsStatus::RsErrInvalidArgument, "host session");
    assert!(last_error().contains("host backend"), "{}", last_error());
    // SAFETY: stream 0 is always valid.
    assert_eq!(unsafe { rs_join_held(s, 0) }, RsStatus::RsErrInvalidArgument, "host session");
    assert!(last_error().contains("host backend"), "{}", last_error());
    // Admitting graph replays: a host session in full mode has none (an error naming the backend); best-effort has
    // nothing to admit (engines may call it unconditionally).
    for (mode, want) in [("full", RsStatus::RsErrInvalidArgument), ("best_effort", RsStatus::RsOk)] {
        let cfg = c(&format!("[policy]\nmode = \"{mode}\"\n"));
        let mut h = 0u64;
        // SAFETY: valid string and out-pointer.
        assert_eq!(unsafe { rs_session_open(cfg.as_ptr(), &mut h) }, RsStatus::RsOk, "{}", last_error());
        // SAFETY: stream 0 is always valid.
        assert_eq!(unsafe { rs_admit_graph_step(h, 0, 0) }, want, "{mode}: {}", last_error());
        // SAFETY: as above.
        assert_eq!(unsafe { rs_admit_graph_step(h, 8, 0) }, want, "{mode}: {}", last_error());
        if want != RsStatus::RsOk {
            assert!(last_error().contains("host backend"), "{}", last_error());
        }
        // SAFETY: a null totals pointer is allowed.
        assert_eq!(unsafe { rs_session_close(h, std::ptr::null_mut()) }, RsStatus::RsOk);
        // SAFETY: stream 0 is always valid.
        assert_eq!(unsafe { rs_admit_graph_step(h, 0, 0) }, RsStatus::RsErrClosed, "{mode}: closed");
    }
    // SAFETY: stream 0 is always valid; the handle was never issued.
    assert_eq!(unsafe { rs_admit_graph_step(0xDEAD_BEEF, 0, 0) }, RsStatus::RsErrInvalidHandle);
    // Registration and controls.
    let (nm, site, bad_dt) = (c("h"), c("residual"), c("complex128"));
    let mut out = 0u32;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { rs_register_hookpoint(s, nm.as_ptr(), site.as_ptr(), 0, bad_dt.as_ptr(), 4, &mut out) },
        RsStatus::RsErrInvalidArgument
    );
    let dt = c("bf16");
    // SAFETY: valid pointers; duplicate name.
    assert_eq!(
        unsafe { rs_register_hookpoint(s, nm.as_ptr(), site.as_ptr(), 0, dt.as_ptr(), 4, &mut out) },
        RsStatus::RsErrCapture
    );
    // SAFETY: null out-pointer is checked.
    assert_eq!(
        unsafe { rs_register_hookpoint(s, nm.as_ptr(), site.as_ptr(), 0, dt.as_ptr(), 4, std::ptr::null_mut()) },
        RsStatus::RsErrInvalidArgument
    );
    assert_eq!(rs_set_every_n_steps(s, id, 0), RsStatus::RsErrInvalidArgument);
    // SAFETY: mode 9 is checked before the list is read.
    assert_eq!(unsafe { rs_set_rows(s, id, 9, std::ptr::null(), 0) }, RsStatus::RsErrInvalidArgument);
    // SAFETY: an empty explicit list is refused.
    assert_eq!(unsafe { rs_set_rows(s, id, RS_ROWS_LIST, std::ptr::null(), 0) }, RsStatus::RsErrInvalidArgument);
    assert_eq!(rs_end_step(s), RsStatus::RsOk);

    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!(rs_end_step(s), RsStatus::RsErrClosed, "a closed handle");
    assert_eq!(rs_subscription_close(s), RsStatus::RsErrInvalidHandle);
    assert!(last_error().contains("subscription"), "{}", last_error());
}

#[test]
fn a_ring_the_machine_cannot_allocate_is_a_config_error_not_an_abort() {
    // 1 TiB: refused by the allocator on any machine with less memory (the kernel's heuristic overcommit refuses a
    // single allocation larger than RAM and swap); before, the process aborted.
    let cfg = c("[ring]\ncapacity = \"1024 GiB\"\n");
    let mut h = 0u64;
    // SAFETY: valid string and out-pointer.
    let st = unsafe { rs_session_open(cfg.as_ptr(), &mut h) };
    assert_eq!(st, RsStatus::RsErrConfig, "{}", last_error());
    let msg = last_error();
    assert!(
        msg.contains("ring.capacity") && msg.contains("1024 GiB") && msg.contains("refused"),
        "the message names the key, the size and what happened: {msg}"
    );
}

#[test]
fn closing_a_subscription_wakes_a_thread_waiting_in_rs_poll_which_returns_closed_never_a_record() {
    let s = open("");
    let id = register(s, "layers.0.resid", 4);
    let sub = subscribe_all(s, "probe");
    let poller = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let mut info = RsRecordInfo::default();
        let mut buf = vec![0u8; 1 << 16];
        // SAFETY: `info` writable, `buf` holds `buf.len()` bytes.
        let st = unsafe { rs_poll(sub, 30_000, &mut info, buf.as_mut_ptr().cast(), buf.len()) };
        (st, last_error(), started.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(rs_subscription_close(sub), RsStatus::RsOk);
    // A record captured after the close must not reach the poller (before, it returned it with RS_OK).
    let (ids, pos, data) = ([1u64], [0u32], [0u8; 8]);
    // SAFETY: arrays of 1; `data` holds one row of 4 bf16.
    unsafe {
        assert_eq!(rs_begin_step(s, 0, ids.as_ptr(), pos.as_ptr(), 1), RsStatus::RsOk);
        assert_eq!(rs_capture_host(s, id, data.as_ptr().cast(), 8, std::ptr::null_mut()), RsStatus::RsOk);
    }
    assert_eq!(rs_end_step(s), RsStatus::RsOk);
    let (st, msg, waited) = poller.join().unwrap();
    assert_eq!(st, RsStatus::RsErrClosed, "{msg}");
    assert!(msg.contains("closed"), "{msg}");
    assert!(waited < Duration::from_secs(20), "rs_poll kept waiting after the close ({waited:?})");
    let mut info = RsRecordInfo::default();
    // SAFETY: `info` writable.
    assert_eq!(unsafe { rs_poll(sub, 0, &mut info, std::ptr::null_mut(), 0) }, RsStatus::RsErrClosed);
    let mut totals = RsCounts::default();
    // SAFETY: writable.
    assert_eq!(unsafe { rs_session_close(s, &mut totals) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!((totals.produced_records, totals.exported_records), (1, 1));
}

/// `[(name of the constant, its value, what it stands for), ...]`.
macro_rules! named {
    ($($constant:ident => $stands_for:expr),* $(,)?) => {
        [$((stringify!($constant), $constant, $stands_for)),*]
    };
}

#[test]
fn drop_reason_and_dtype_constants_are_the_library_numbering_and_names() {
    // `dropped_by_reason` is filled in `DropReason::ALL` order; `rs_record_info.dtype` carries `DType::code`. Each
    // C constant's name is its Rust variant's name, upper-cased behind the prefix (the Python package relies on it).
    let drops = named![
        RS_DROP_RING_FULL => DropReason::RingFull,
        RS_DROP_DEADLINE => DropReason::Deadline,
        RS_DROP_TOO_LARGE => DropReason::TooLarge,
        RS_DROP_DISCONNECTED => DropReason::Disconnected,
        RS_DROP_SINK_BACKPRESSURE => DropReason::SinkBackpressure,
        RS_DROP_SINK_ERROR => DropReason::SinkError,
        RS_DROP_CORRUPT => DropReason::Corrupt,
    ];
    assert_eq!(DropReason::ALL.len(), RS_DROP_REASON_COUNT);
    assert_eq!(drops.len(), RS_DROP_REASON_COUNT);
    for (constant, index, reason) in drops {
        assert_eq!(DropReason::ALL[index], reason, "{constant}");
        assert_eq!(constant, format!("RS_DROP_{}", reason.name().to_uppercase()));
    }

    use ringscope_api::DType;
    let dtypes = named![
        RS_DTYPE_F32 => DType::F32,
        RS_DTYPE_F16 => DType::F16,
        RS_DTYPE_BF16 => DType::BF16,
        RS_DTYPE_F64 => DType::F64,
        RS_DTYPE_I8 => DType::I8,
        RS_DTYPE_U8 => DType::U8,
        RS_DTYPE_I16 => DType::I16,
        RS_DTYPE_I32 => DType::I32,
        RS_DTYPE_I64 => DType::I64,
        RS_DTYPE_F8E4M3 => DType::F8E4M3,
        RS_DTYPE_F8E5M2 => DType::F8E5M2,
        RS_DTYPE_F8E4M3_ROWSCALED => DType::F8E4M3RowScaled,
    ];
    assert_eq!(dtypes.len(), DType::ALL.len());
    for (constant, code, dtype) in dtypes {
        assert_eq!(u32::from(dtype.code()), code, "{constant}");
        assert_eq!(constant, format!("RS_DTYPE_{}", dtype.name().to_uppercase()));
    }
}

#[test]
fn the_ended_token_limit_and_keep_all_are_the_kernels() {
    assert_eq!(RS_MAX_ENDED_TOKENS as usize, ringscope_api::cuda::MAX_ENDED_TOKENS);
    assert_eq!(RS_KEEP_ALL, ringscope_api::cuda::KEEP_ALL);
}

#[test]
fn the_committed_header_is_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen can read the crate")
        .write(&mut generated);
    let path = dir.join("include/ringscope.h");
    if std::env::var_os("RINGSCOPE_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "ffi/include/ringscope.h is stale: regenerate it with `RINGSCOPE_UPDATE_HEADER=1 cargo test -p ringscope-ffi \
         the_committed_header_is_current` and commit it"
    );
}

/// A file sink that fails mid-run (its partition directory cannot be created): the engine learns it at the next
/// capture (`RS_ERR_SINK`, naming the sink), `rs_sink_status` / `rs_sink_failure` say which sink failed, why and
/// when — before and after close —, and a manifest that cannot be written is `RS_ERR_IO` with the totals still
/// written and no hidden temporary file left behind.
#[test]
fn a_failed_sink_reaches_the_engine_while_it_runs_and_is_reported_after_close() {
    let dir = std::env::temp_dir().join(format!("ringscope-ffi-sinkfail-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let s = open(&format!("[export]\nparquet = true\ndir = {:?}\nrun_id = \"r\"\n", dir.display().to_string()));
    let id = register(s, "layers.0.resid", 4);
    let run = dir.join("r");
    // A file where the sink will create the hookpoint's partition directory: its first write fails (as on a full
    // disk), whoever runs the test (root ignores permissions).
    std::fs::write(run.join("hookpoint=layers.0.resid"), b"in the way").unwrap();
    // The manifest's place taken by a directory: the rename at close fails.
    std::fs::create_dir(run.join("_ringscope_run.json")).unwrap();

    let mut status = RsSinkHealth { failed_sinks: 9, first_failure_unix_ns: 9 };
    // SAFETY: writable.
    assert_eq!(unsafe { rs_sink_status(s, &mut status) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!(status, RsSinkHealth::default(), "healthy at start");

    let (ids, pos) = ([1u64], [0u32]);
    let data = [0u8; 8];
    let step = |n: u64| {
        // SAFETY: arrays of 1.
        let st = unsafe { rs_begin_step(s, n, ids.as_ptr(), pos.as_ptr(), 1) };
        if st != RsStatus::RsOk {
            return st;
        }
        // SAFETY: `data` holds 8 bytes.
        let st = unsafe { rs_capture_host(s, id, data.as_ptr().cast(), 8, std::ptr::null_mut()) };
        assert_eq!(rs_end_step(s), RsStatus::RsOk);
        st
    };
    let before = unix_ns(std::time::SystemTime::now());
    assert_eq!(step(0), RsStatus::RsOk, "the sink has not failed yet: {}", last_error());
    // The record reaches the sink, which fails on it; it is then counted (dropped), which is what flush waits for.
    assert_eq!(rs_flush(s, 10_000), RsStatus::RsOk, "{}", last_error());
    // SAFETY: writable.
    assert_eq!(unsafe { rs_sink_status(s, &mut status) }, RsStatus::RsOk);
    assert_eq!(status.failed_sinks, 1);
    assert!(status.first_failure_unix_ns >= before, "{status:?}");

    // Full mode: the next step is refused, naming the sink.
    assert_eq!(step(1), RsStatus::RsErrSink);
    assert!(last_error().contains("sink `parquet`") && last_error().contains("full mode"), "{}", last_error());

    let mut info = RsSinkFailureInfo::default();
    // SAFETY: `info` writable, no buffer: the needed size is reported.
    assert_eq!(unsafe { rs_sink_failure(s, 0, &mut info, std::ptr::null_mut(), 0) }, RsStatus::RsErrBufferTooSmall);
    assert_eq!(info.needed, info.sink_len as u64 + info.message_len as u64 + 2);
    let mut buf = vec![1 as c_char; info.needed as usize];
    // SAFETY: `buf` holds `needed` bytes.
    let st = unsafe { rs_sink_failure(s, 0, &mut info, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    // SAFETY: both strings are NUL-terminated inside `buf`.
    let (name, message) =
        unsafe { (CStr::from_ptr(buf.as_ptr()), CStr::from_ptr(buf.as_ptr().add(info.sink_len as usize + 1))) };
    assert_eq!(name.to_str().unwrap(), "parquet");
    assert!(message.to_str().unwrap().contains("hookpoint=layers.0.resid"), "{message:?}");
    assert_eq!(info.unix_ns, status.first_failure_unix_ns);
    // SAFETY: `info` writable.
    let st = unsafe { rs_sink_failure(s, 1, &mut info, buf.as_mut_ptr(), buf.len()) };
    assert_eq!(st, RsStatus::RsErrInvalidArgument, "only one failure");

    let mut totals = RsCounts::default();
    // SAFETY: writable.
    assert_eq!(unsafe { rs_session_close(s, &mut totals) }, RsStatus::RsErrIo);
    assert!(last_error().contains("_ringscope_run.json"), "the message names the manifest: {}", last_error());
    assert_eq!(
        (totals.produced_records, totals.exported_records, totals.dropped_by_reason[RS_DROP_SINK_ERROR]),
        (1, 0, 1),
        "totals are written even though the manifest was not"
    );
    let debris: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(debris.is_empty(), "hidden files left behind: {debris:?}");

    // The closed handle still answers for its sinks.
    let mut after = RsSinkHealth::default();
    // SAFETY: writable.
    assert_eq!(unsafe { rs_sink_status(s, &mut after) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!(after, status);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A snapshot struct with its `struct_size` set as a caller compiled against this header sets it.
fn sized<T: Default>(set: impl FnOnce(&mut T) -> &mut u32) -> T {
    let mut v = T::default();
    *set(&mut v) = std::mem::size_of::<T>() as u32;
    v
}

#[test]
fn session_hookpoint_and_destination_stats_and_the_metrics_text_through_the_c_abi() {
    assert_eq!(rs_abi_version(), RS_ABI_VERSION);
    let s = open("");
    let id = register(s, "layers.0.resid", 4);
    let sub = subscribe_all(s, "probe \"p\"");
    for step in 0..2u64 {
        let (ids, pos) = ([7u64, 9], [step as u32, step as u32]);
        // SAFETY: arrays of 2.
        assert_eq!(unsafe { rs_begin_step(s, step, ids.as_ptr(), pos.as_ptr(), 2) }, RsStatus::RsOk);
        let data = [1u8; 2 * 8];
        let mut outcome = -1;
        // SAFETY: `data` holds 16 bytes.
        let st = unsafe { rs_capture_host(s, id, data.as_ptr().cast(), data.len(), &mut outcome) };
        assert_eq!(st, RsStatus::RsOk, "{}", last_error());
        assert_eq!(rs_end_step(s), RsStatus::RsOk);
    }
    assert_eq!(rs_flush(s, 10_000), RsStatus::RsOk, "{}", last_error());

    let mut st: RsSessionSnapshot = sized(|v: &mut RsSessionSnapshot| &mut v.struct_size);
    // SAFETY: a whole struct with its size set.
    assert_eq!(unsafe { rs_session_stats(s, &mut st) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!(st.struct_size as usize, std::mem::size_of::<RsSessionSnapshot>());
    assert_eq!((st.mode, st.backend, st.hookpoints, st.destinations), (RS_MODE_FULL, RS_BACKEND_HOST, 1, 1));
    assert_eq!((st.steps, st.last_step, st.drain_records, st.drain_rows), (2, 1, 2, 4));
    assert_eq!(st.ring_capacity_bytes, 1 << 20);
    assert!(st.step_time_ns > 0 && st.step_interval_ns > 0 && st.unix_ns > 0);

    let mut hp: RsHookPointSnapshot = sized(|v: &mut RsHookPointSnapshot| &mut v.struct_size);
    let mut name = [0 as c_char; 64];
    // SAFETY: `name` holds 64 bytes.
    assert_eq!(
        unsafe { rs_hookpoint_stats(s, id, &mut hp, name.as_mut_ptr(), name.len()) },
        RsStatus::RsOk,
        "{}",
        last_error()
    );
    assert_eq!((hp.id, hp.row_bytes, hp.counts.produced_rows, hp.produced_bytes), (id, 8, 4, 32));
    assert_eq!((hp.dtype, hp.row_width), (RS_DTYPE_BF16, 4), "ABI 4: the hookpoint's dtype and width");
    // SAFETY: NUL-terminated by the call.
    assert_eq!(unsafe { CStr::from_ptr(name.as_ptr()) }.to_str().unwrap(), "layers.0.resid");
    // SAFETY: the rung is NUL-terminated.
    assert_eq!(unsafe { CStr::from_ptr(hp.rung.as_ptr()) }.to_str().unwrap(), "full");
    assert_eq!(rs_set_every_n_steps(s, id, 3), RsStatus::RsOk);
    // SAFETY: as above.
    assert_eq!(unsafe { rs_hookpoint_stats(s, id, &mut hp, name.as_mut_ptr(), name.len()) }, RsStatus::RsOk);
    // SAFETY: as above.
    assert_eq!(unsafe { CStr::from_ptr(hp.rung.as_ptr()) }.to_str().unwrap(), "every_3");

    let mut d: RsDestinationSnapshot = sized(|v: &mut RsDestinationSnapshot| &mut v.struct_size);
    // SAFETY: no name buffer: the size comes back with the numbers.
    let status = unsafe { rs_destination_stats(s, 0, &mut d, std::ptr::null_mut(), 0) };
    assert_eq!(status, RsStatus::RsErrBufferTooSmall, "{}", last_error());
    assert_eq!((d.kind, d.queued_records, d.delivered_records, d.name_len), (RS_DESTINATION_CONSUMER, 2, 0, 9));
    let mut name = vec![0 as c_char; d.name_len as usize + 1];
    // SAFETY: `name` holds `name_len + 1` bytes.
    assert_eq!(unsafe { rs_destination_stats(s, 0, &mut d, name.as_mut_ptr(), name.len()) }, RsStatus::RsOk);
    // SAFETY: NUL-terminated by the call.
    assert_eq!(unsafe { CStr::from_ptr(name.as_ptr()) }.to_str().unwrap(), "probe \"p\"");

    let mut needed = 0usize;
    // SAFETY: no buffer, `needed` writable.
    let status = unsafe { rs_metrics_text(s, std::ptr::null_mut(), 0, &mut needed) };
    assert_eq!(status, RsStatus::RsErrBufferTooSmall, "{}", last_error());
    let mut text = vec![0 as c_char; needed + 256];
    // SAFETY: `text` holds more than `needed` bytes.
    assert_eq!(unsafe { rs_metrics_text(s, text.as_mut_ptr(), text.len(), &mut needed) }, RsStatus::RsOk);
    // SAFETY: NUL-terminated by the call.
    let text = unsafe { CStr::from_ptr(text.as_ptr()) }.to_str().unwrap().to_owned();
    assert_eq!(text.len() + 1, needed);
    assert!(text.contains("ringscope_hookpoint_produced_rows_total{hookpoint=\"layers.0.resid\"} 4\n"), "{text}");
    assert!(text.contains(r#"ringscope_destination_queued_records{destination="probe \"p\"",kind="consumer"} 2"#));
    assert_eq!(rs_subscription_close(sub), RsStatus::RsOk);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "{}", last_error());
    // SAFETY: as above.
    assert_eq!(unsafe { rs_session_stats(s, &mut st) }, RsStatus::RsErrClosed);
}

#[test]
fn stats_calls_refuse_bad_input_and_name_it() {
    let s = open("");
    let id = register(s, "h", 4);
    // Null outputs.
    // SAFETY: null pointers, which the ABI checks.
    assert_eq!(unsafe { rs_session_stats(s, std::ptr::null_mut()) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("out"), "{}", last_error());
    // SAFETY: as above.
    assert_eq!(
        unsafe { rs_metrics_text(s, std::ptr::null_mut(), 0, std::ptr::null_mut()) },
        RsStatus::RsErrInvalidArgument
    );
    assert!(last_error().contains("needed"), "{}", last_error());
    // A struct_size the caller forgot (0) or from a smaller struct: refused, nothing written but the error.
    let mut st = RsSessionSnapshot { steps: 77, ..RsSessionSnapshot::default() };
    // SAFETY: a whole struct (announcing 0 bytes).
    assert_eq!(unsafe { rs_session_stats(s, &mut st) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("struct_size") && last_error().contains("rs_session_snapshot"), "{}", last_error());
    assert_eq!((st.struct_size, st.steps), (0, 77));
    st.struct_size = 8;
    // SAFETY: as above.
    assert_eq!(unsafe { rs_session_stats(s, &mut st) }, RsStatus::RsErrInvalidArgument);
    // A caller compiled against the ABI 2 header (the struct without `stalls`): gets the fields it knows, nothing past
    // them.
    #[repr(C)]
    struct V2 {
        known: [u8; std::mem::offset_of!(RsSessionSnapshot, stalls)],
        after: u64,
    }
    let mut v2 = V2 { known: [0; std::mem::offset_of!(RsSessionSnapshot, stalls)], after: 0x5EED };
    let v2_size = std::mem::offset_of!(RsSessionSnapshot, stalls) as u32;
    v2.known[..4].copy_from_slice(&v2_size.to_le_bytes());
    // SAFETY: `v2` holds the `struct_size` bytes it announces, aligned as the snapshot (it starts with the same
    // fields; `V2` is 8-aligned through `after`).
    let status = unsafe { rs_session_stats(s, (&mut v2 as *mut V2).cast::<RsSessionSnapshot>()) };
    assert_eq!(status, RsStatus::RsOk, "{}", last_error());
    assert_eq!((u32::from_le_bytes(v2.known[..4].try_into().unwrap()), v2.after), (v2_size, 0x5EED));
    // A caller compiled against a newer, larger struct: gets the fields this library knows, and their size.
    #[repr(C)]
    struct Newer {
        known: RsHookPointSnapshot,
        future: u64,
    }
    let mut newer = Newer { known: RsHookPointSnapshot::default(), future: 0xABCD };
    newer.known.struct_size = std::mem::size_of::<Newer>() as u32;
    let mut name = [0 as c_char; 8];
    // SAFETY: the struct holds `struct_size` bytes; `name` 8.
    let status = unsafe { rs_hookpoint_stats(s, id, &mut newer.known, name.as_mut_ptr(), name.len()) };
    assert_eq!(status, RsStatus::RsOk, "{}", last_error());
    assert_eq!(newer.known.struct_size as usize, std::mem::size_of::<RsHookPointSnapshot>());
    assert_eq!((newer.known.row_bytes, newer.future), (8, 0xABCD), "nothing past the known fields is written");
    // Unknown ids and indices, a too-small name buffer, a small text buffer.
    let mut hp: RsHookPointSnapshot = sized(|v: &mut RsHookPointSnapshot| &mut v.struct_size);
    // SAFETY: whole struct, no name buffer.
    assert_eq!(unsafe { rs_hookpoint_stats(s, 99, &mut hp, std::ptr::null_mut(), 0) }, RsStatus::RsErrCapture);
    // SAFETY: whole struct, no name buffer: the numbers and the name's length come back.
    let status = unsafe { rs_hookpoint_stats(s, id, &mut hp, std::ptr::null_mut(), 0) };
    assert_eq!((status, hp.name_len, hp.row_bytes), (RsStatus::RsErrBufferTooSmall, 1, 8));
    let mut d: RsDestinationSnapshot = sized(|v: &mut RsDestinationSnapshot| &mut v.struct_size);
    // SAFETY: whole struct, no name buffer.
    assert_eq!(unsafe { rs_destination_stats(s, 0, &mut d, std::ptr::null_mut(), 0) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("no destination 0"), "{}", last_error());
    let mut small = [0 as c_char; 16];
    let mut needed = 0usize;
    // SAFETY: `small` holds 16 bytes.
    let status = unsafe { rs_metrics_text(s, small.as_mut_ptr(), small.len(), &mut needed) };
    assert_eq!(status, RsStatus::RsErrBufferTooSmall);
    assert!(needed > 16 && small.iter().all(|&b| b == 0), "nothing written to a buffer too small");
    // Bad handles.
    // SAFETY: whole struct, no name buffer.
    assert_eq!(unsafe { rs_hookpoint_stats(0, id, &mut hp, std::ptr::null_mut(), 0) }, RsStatus::RsErrInvalidHandle);
    // SAFETY: as above.
    assert_eq!(unsafe { rs_metrics_text(12345, std::ptr::null_mut(), 0, &mut needed) }, RsStatus::RsErrInvalidHandle);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk);
}

// ---------------------------------------------------------------------------------------------------------------
// Probes (ABI 4).

const D: usize = 4;

/// A `.npy` file of f32 with `shape` (C order).
fn write_npy(path: &std::path::Path, shape: &[usize], values: &[f32]) {
    ringscope_api::probe::save_npy(path, shape, values).unwrap();
}

fn probe_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ringscope-ffi-probes-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Weights `[1, D]` reading element 0 of the row.
fn first_element_weights(dir: &std::path::Path) -> String {
    let path = dir.join("w.npy");
    let mut w = vec![0.0f32; D];
    w[0] = 1.0;
    write_npy(&path, &[1, D], &w);
    path.display().to_string()
}

/// An f32 hookpoint `h` of width `D`, a consumer probe `p` (mean of element 0 ≥ 0.5 stops the request) and a fused
/// probe `f` on the same rows (alerts only).
fn probe_config(weights: &str) -> String {
    format!(
        "[[hookpoints]]\nname = \"h\"\nsite = \"residual\"\nlayer = 0\ndtype = \"f32\"\nrow_width = {D}\n\
         [[probes]]\nname = \"p\"\nhookpoint = \"h\"\nweights = {weights:?}\nthreshold = 0.5\naction = \"stop\"\n\
         labels = [\"bad\"]\n\
         [[probes]]\nname = \"f\"\nhookpoint = \"h\"\nweights = {weights:?}\nthreshold = 0.5\nmode = \"fused\"\n\
         [alerts]\nflag_slots = 16\n"
    )
}

/// One step of `rows` `(request, position)`; a request's rows hold `hot[request]` in element 0, zeros elsewhere.
fn probe_step(s: u64, id: u32, step: u64, rows: &[(u64, u32)], hot: impl Fn(u64) -> f32) {
    let ids: Vec<u64> = rows.iter().map(|r| r.0).collect();
    let pos: Vec<u32> = rows.iter().map(|r| r.1).collect();
    // SAFETY: arrays of `rows.len()`.
    let st = unsafe { rs_begin_step(s, step, ids.as_ptr(), pos.as_ptr(), rows.len()) };
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    let data: Vec<u8> = rows
        .iter()
        .flat_map(|&(r, _)| {
            let v = hot(r);
            (0..D).map(move |j| if j == 0 { v } else { 0.0 })
        })
        .flat_map(|x| x.to_le_bytes())
        .collect();
    // SAFETY: `data` holds `rows × D` f32.
    let st = unsafe { rs_capture_host(s, id, data.as_ptr().cast(), data.len(), std::ptr::null_mut()) };
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!(rs_end_step(s), RsStatus::RsOk);
}

fn hookpoint_id(s: u64, name: &str) -> u32 {
    let mut id = u32::MAX;
    let n = c(name);
    // SAFETY: valid string and out-pointer.
    assert_eq!(unsafe { rs_hookpoint_id(s, n.as_ptr(), &mut id) }, RsStatus::RsOk, "{}", last_error());
    id
}

fn poll_alert(s: u64, timeout_ms: u32) -> (RsStatus, RsAlert) {
    let mut a: RsAlert = sized(|v: &mut RsAlert| &mut v.struct_size);
    // SAFETY: a whole struct with its size set.
    let st = unsafe { rs_alert_poll(s, timeout_ms, &mut a) };
    (st, a)
}

fn text(chars: &[c_char]) -> String {
    // SAFETY: NUL-terminated by the library (every test array has a NUL).
    unsafe { CStr::from_ptr(chars.as_ptr()) }.to_str().unwrap().to_owned()
}

fn report(s: u64, probe: &str, request: u64) -> (RsStatus, RsProbeReport) {
    let mut r: RsProbeReport = sized(|v: &mut RsProbeReport| &mut v.struct_size);
    let name = c(probe);
    // SAFETY: valid string; a whole struct with its size set.
    let st = unsafe { rs_probe_request(s, name.as_ptr(), request, &mut r) };
    (st, r)
}

fn flagged(s: u64, request: u64) -> bool {
    let mut f = false;
    // SAFETY: writable.
    assert_eq!(unsafe { rs_is_flagged(s, request, &mut f) }, RsStatus::RsOk, "{}", last_error());
    f
}

fn probe_snapshot(s: u64, index: u32) -> (RsStatus, RsProbeSnapshot, String) {
    let mut p: RsProbeSnapshot = sized(|v: &mut RsProbeSnapshot| &mut v.struct_size);
    let mut name = [0 as c_char; 32];
    // SAFETY: a whole struct; `name` holds 32 bytes.
    let st = unsafe { rs_probe_stats(s, index, &mut p, name.as_mut_ptr(), name.len()) };
    (st, p, text(&name))
}

#[test]
fn probes_through_the_c_abi_alert_report_flag_and_finish() {
    let dir = probe_dir("abi");
    let s = open(&probe_config(&first_element_weights(&dir)));
    let id = hookpoint_id(s, "h");
    // Requests 1 (cold, 0.0) and 2 (hot, 1.0): three steps of one row each.
    for step in 0..3u64 {
        probe_step(s, id, step, &[(1, step as u32), (2, step as u32)], |r| if r == 2 { 1.0 } else { 0.0 });
    }
    assert_eq!(rs_probes_wait(s, 30_000), RsStatus::RsOk, "{}", last_error());

    // One alert per probe, for request 2 at its first token; then none.
    let mut alerts = Vec::new();
    for _ in 0..2 {
        let (st, a) = poll_alert(s, 5_000);
        assert_eq!(st, RsStatus::RsOk, "{}", last_error());
        assert_eq!(a.struct_size as usize, size_of::<RsAlert>());
        alerts.push(a);
    }
    alerts.sort_by_key(|a| text(&a.probe));
    let (f, p) = (&alerts[0], &alerts[1]);
    assert_eq!((text(&p.probe), p.probe_len, text(&p.label), p.label_len), ("p".into(), 1, "bad".into(), 3));
    assert_eq!((p.action, p.output, p.request_id, p.step, p.position), (RS_PROBE_ACTION_STOP, 0, 2, 0, 0));
    assert_eq!((p.score, p.token_score, p.threshold), (1.0, 1.0, 0.5));
    assert_eq!(
        (text(&f.probe), text(&f.label), f.action, f.request_id),
        ("f".into(), "0".into(), RS_PROBE_ACTION_ALERT, 2)
    );
    let (st, _) = poll_alert(s, 0);
    assert_eq!(st, RsStatus::RsErrTimeout, "{}", last_error());
    assert!(last_error().contains("no alert"), "{}", last_error());

    // Flags: raised for request 2 only (the stop probe), through the call and the table alike.
    assert!(flagged(s, 2) && !flagged(s, 1) && !flagged(s, 18), "request 18 shares request 2's slot");
    let (mut slots, mut len) = (std::ptr::null::<u64>(), 0usize);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_probe_flags(s, &mut slots, &mut len) }, RsStatus::RsOk, "{}", last_error());
    assert_eq!(len, 16);
    // SAFETY: the table holds `len` slots while the session lives (and after: it is kept with the closed handle).
    let table = || unsafe { std::slice::from_raw_parts(slots, len) }.to_vec();
    assert_eq!(table()[2], 3, "request R reads slots[R % len] == R + 1");
    assert_eq!(table().iter().filter(|&&v| v != 0).count(), 1);

    // Reports: mean score, alert mask, coverage.
    let (st, r) = report(s, "p", 2);
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!((r.outputs, r.request_id, r.alerted, r.last_step), (1, 2, 1, 2));
    assert_eq!((r.scored, r.nan, r.expected, r.unobserved), (3, 0, 3, 0));
    assert_eq!(r.scores[0], 1.0);
    assert!(r.scores[1..].iter().all(|v| v.is_nan()), "scores past K are NaN");
    let (st, r) = report(s, "f", 1);
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!((r.outputs, r.alerted, r.scored, r.scores[0]), (1, 0, 3, 0.0));
    // Not seen: a status of its own, the report written with zero coverage.
    let (st, r) = report(s, "p", 99);
    assert_eq!(st, RsStatus::RsNotSeen, "{}", last_error());
    assert!(last_error().contains("no record of request 99"), "{}", last_error());
    assert_eq!((r.request_id, r.outputs, r.scored, r.expected, r.alerted), (99, 0, 0, 0, 0));
    assert!(r.scores[0].is_nan());

    // Totals per probe, in configuration order, with the hookpoints they read and write.
    let mut n = 0u32;
    // SAFETY: writable.
    assert_eq!(unsafe { rs_probe_count(s, &mut n) }, RsStatus::RsOk);
    assert_eq!(n, 2);
    let (st, p0, name) = probe_snapshot(s, 0);
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!(
        (name.as_str(), p0.mode, p0.hookpoint, p0.scores_hookpoint),
        ("p", RS_PROBE_MODE_CONSUMER, id, RS_NO_HOOKPOINT)
    );
    assert_eq!((p0.rows, p0.nan_rows, p0.alerts, p0.evicted_requests, p0.name_len), (6, 0, 1, 0, 1));
    let (_, p1, name) = probe_snapshot(s, 1);
    assert_eq!((name.as_str(), p1.mode, p1.hookpoint), ("f", RS_PROBE_MODE_FUSED, id));
    assert_eq!(p1.scores_hookpoint, hookpoint_id(s, "probes.f"));
    assert_eq!((p1.rows, p1.alerts), (6, 1));
    let mut dropped = 9u64;
    // SAFETY: writable.
    assert_eq!(unsafe { rs_alerts_dropped(s, &mut dropped) }, RsStatus::RsOk);
    assert_eq!(dropped, 0);

    // Finishing request 2 forgets it and lowers its flag.
    assert_eq!(rs_request_finish(s, 2), RsStatus::RsOk, "{}", last_error());
    assert!(!flagged(s, 2));
    assert_eq!(table()[2], 0);
    assert_eq!(report(s, "p", 2).0, RsStatus::RsNotSeen);
    assert_eq!(rs_request_finish(s, 12345), RsStatus::RsOk, "finishing an unknown request is harmless");

    // An alert raised while the session closes (request 7 is hot; nothing polled before the close) is still
    // delivered on the closed handle, then the queue has ended.
    probe_step(s, id, 3, &[(7, 0)], |_| 2.0);
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "{}", last_error());
    let mut after = Vec::new();
    loop {
        let (st, a) = poll_alert(s, 1_000);
        if st != RsStatus::RsOk {
            assert_eq!(st, RsStatus::RsErrEnded, "{}", last_error());
            assert!(last_error().contains("closed"), "{}", last_error());
            break;
        }
        after.push((text(&a.probe), a.request_id, a.step));
    }
    after.sort();
    assert_eq!(after, vec![("f".into(), 7, 3), ("p".into(), 7, 3)]);
    // The closed handle answers with the final totals; the flag table is still readable (no longer updated).
    let (st, p0, _) = probe_snapshot(s, 0);
    assert_eq!((st, p0.rows, p0.alerts), (RsStatus::RsOk, 7, 2));
    // SAFETY: writable.
    assert_eq!(unsafe { rs_probe_count(s, &mut n) }, RsStatus::RsOk);
    assert_eq!(n, 2);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_alerts_dropped(s, &mut dropped) }, RsStatus::RsOk);
    assert_eq!(table()[7], 8, "request 7 was flagged as the session closed");
    // Everything about live requests is refused on a closed session.
    assert_eq!(report(s, "p", 1).0, RsStatus::RsErrClosed);
    let mut f = false;
    // SAFETY: writable.
    assert_eq!(unsafe { rs_is_flagged(s, 1, &mut f) }, RsStatus::RsErrClosed);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_probe_flags(s, &mut slots, &mut len) }, RsStatus::RsErrClosed);
    assert_eq!(rs_probes_wait(s, 0), RsStatus::RsErrClosed);
    assert_eq!(rs_request_finish(s, 1), RsStatus::RsErrClosed);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `rs_note_step_rows`: the rows a device-begun step ran of each request, counted in the probes' coverage; bad input
/// named, nothing counted from it.
#[test]
fn noted_step_rows_are_the_probes_coverage_denominator_and_bad_input_is_named() {
    let dir = probe_dir("noted");
    let s = open(&probe_config(&first_element_weights(&dir)));
    let id = hookpoint_id(s, "h");
    probe_step(s, id, 0, &[(1, 0)], |_| 0.0);
    let rows = [1u64, 1, u64::MAX, 3];
    // SAFETY: an array of 4.
    assert_eq!(unsafe { rs_note_step_rows(s, rows.as_ptr(), rows.len()) }, RsStatus::RsOk, "{}", last_error());
    // SAFETY: null with 0 rows is nothing to note.
    assert_eq!(unsafe { rs_note_step_rows(s, std::ptr::null(), 0) }, RsStatus::RsOk, "{}", last_error());
    // SAFETY: an array of 4; a handle that is no session: checked by the library.
    assert_eq!(unsafe { rs_note_step_rows(0xDEAD_BEEF, rows.as_ptr(), rows.len()) }, RsStatus::RsErrInvalidHandle);
    // SAFETY: null with rows announced: checked by the library.
    assert_eq!(unsafe { rs_note_step_rows(s, std::ptr::null(), 2) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("request_ids is a null pointer but 2"), "{}", last_error());
    let words = [0u64; 3];
    // SAFETY: a misaligned pointer (one byte into an aligned u64 array): checked by the library before any read.
    let st = unsafe { rs_note_step_rows(s, words.as_ptr().cast::<u8>().wrapping_add(1).cast(), 1) };
    assert_eq!(st, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("not aligned"), "{}", last_error());
    assert_eq!(rs_probes_wait(s, 30_000), RsStatus::RsOk, "{}", last_error());
    let (st, r) = report(s, "p", 1);
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!((r.scored, r.expected, r.unobserved), (1, 3, 2));
    let (st, r) = report(s, "p", 3);
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!((r.scored, r.expected, r.unobserved), (0, 1, 1));
    // SAFETY: valid; the session is then closed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk);
    // SAFETY: an array of 4; the handle is no longer open.
    assert_eq!(unsafe { rs_note_step_rows(s, rows.as_ptr(), rows.len()) }, RsStatus::RsErrClosed);
}

#[test]
fn probe_calls_refuse_bad_input_and_name_it() {
    // A session without probes: the probe calls say so; the counters are zero.
    let s = open("");
    let (st, _) = poll_alert(s, 0);
    assert_eq!(st, RsStatus::RsErrConfig);
    assert!(last_error().contains("no probes") && last_error().contains("[[probes]]"), "{}", last_error());
    assert_eq!(report(s, "p", 1).0, RsStatus::RsErrConfig);
    assert!(last_error().contains("no probes"), "{}", last_error());
    let (mut slots, mut len) = (std::ptr::null::<u64>(), 0usize);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_probe_flags(s, &mut slots, &mut len) }, RsStatus::RsErrConfig);
    assert_eq!(rs_probes_wait(s, 0), RsStatus::RsErrConfig);
    assert!(!flagged(s, 1));
    assert_eq!(rs_request_finish(s, 1), RsStatus::RsOk);
    let (mut n, mut dropped) = (9u32, 9u64);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_probe_count(s, &mut n) }, RsStatus::RsOk);
    // SAFETY: writable.
    assert_eq!(unsafe { rs_alerts_dropped(s, &mut dropped) }, RsStatus::RsOk);
    assert_eq!((n, dropped), (0, 0));
    let (st, _, _) = probe_snapshot(s, 0);
    assert_eq!(st, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("no probe 0: the session has 0"), "{}", last_error());
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk);
    assert_eq!(poll_alert(s, 0).0, RsStatus::RsErrClosed);
    assert!(last_error().contains("closed"), "{}", last_error());

    // A session with probes: null pointers, sizes, names and indices.
    let dir = probe_dir("bad");
    let s = open(&probe_config(&first_element_weights(&dir)));
    let id = hookpoint_id(s, "h");
    probe_step(s, id, 0, &[(2, 0)], |_| 1.0);
    assert_eq!(rs_probes_wait(s, 30_000), RsStatus::RsOk, "{}", last_error());
    // SAFETY: null, which the ABI checks.
    assert_eq!(unsafe { rs_alert_poll(s, 0, std::ptr::null_mut()) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("out (output) is a null pointer"), "{}", last_error());
    let mut zero_size = RsAlert::default();
    // SAFETY: a whole struct announcing 0 bytes.
    assert_eq!(unsafe { rs_alert_poll(s, 0, &mut zero_size) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("struct_size") && last_error().contains("rs_alert"), "{}", last_error());
    // Neither bad call took an alert from the queue: both are still there.
    assert_eq!(poll_alert(s, 5_000).0, RsStatus::RsOk, "{}", last_error());
    assert_eq!(poll_alert(s, 5_000).0, RsStatus::RsOk, "{}", last_error());
    let mut r: RsProbeReport = sized(|v: &mut RsProbeReport| &mut v.struct_size);
    // SAFETY: null name, which the ABI checks.
    assert_eq!(unsafe { rs_probe_request(s, std::ptr::null(), 2, &mut r) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("probe_name is a null pointer"), "{}", last_error());
    let p = c("p");
    // SAFETY: null out, which the ABI checks.
    assert_eq!(unsafe { rs_probe_request(s, p.as_ptr(), 2, std::ptr::null_mut()) }, RsStatus::RsErrInvalidArgument);
    let (st, _) = report(s, "nope", 2);
    assert_eq!(st, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("probe_name: no probe `nope` (this session has f, p)"), "{}", last_error());
    let bad_utf8 = [0xFFu8 as c_char, 0];
    // SAFETY: a NUL-terminated string.
    assert_eq!(unsafe { rs_probe_request(s, bad_utf8.as_ptr(), 2, &mut r) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("UTF-8"), "{}", last_error());
    // SAFETY: null outputs, which the ABI checks.
    unsafe {
        assert_eq!(rs_is_flagged(s, 2, std::ptr::null_mut()), RsStatus::RsErrInvalidArgument);
        assert_eq!(rs_probe_flags(s, std::ptr::null_mut(), &mut len), RsStatus::RsErrInvalidArgument);
        assert!(last_error().contains("slots"), "{}", last_error());
        assert_eq!(rs_probe_flags(s, &mut slots, std::ptr::null_mut()), RsStatus::RsErrInvalidArgument);
        assert!(last_error().contains("len"), "{}", last_error());
        assert_eq!(rs_probe_count(s, std::ptr::null_mut()), RsStatus::RsErrInvalidArgument);
        assert_eq!(rs_alerts_dropped(s, std::ptr::null_mut()), RsStatus::RsErrInvalidArgument);
        let mut name = [0 as c_char; 8];
        assert_eq!(rs_probe_stats(s, 0, std::ptr::null_mut(), name.as_mut_ptr(), 8), RsStatus::RsErrInvalidArgument);
    }
    let (st, _, _) = probe_snapshot(s, 2);
    assert_eq!(st, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("no probe 2: the session has 2"), "{}", last_error());
    let mut ps: RsProbeSnapshot = sized(|v: &mut RsProbeSnapshot| &mut v.struct_size);
    // SAFETY: a whole struct, no name buffer: the numbers and the name's length come back.
    let st = unsafe { rs_probe_stats(s, 0, &mut ps, std::ptr::null_mut(), 0) };
    assert_eq!((st, ps.name_len, ps.rows), (RsStatus::RsErrBufferTooSmall, 1, 1));
    // Bad handles: zero, made up, a subscription.
    assert_eq!(poll_alert(0, 0).0, RsStatus::RsErrInvalidHandle);
    assert_eq!(report(0xDEAD_BEEF, "p", 1).0, RsStatus::RsErrInvalidHandle);
    let sub = subscribe_all(s, "x");
    assert_eq!(poll_alert(sub, 0).0, RsStatus::RsErrInvalidHandle);
    assert!(last_error().contains("subscription"), "{}", last_error());
    assert_eq!(rs_probes_wait(sub, 0), RsStatus::RsErrInvalidHandle);
    assert_eq!(rs_request_finish(0, 1), RsStatus::RsErrInvalidHandle);
    assert_eq!(rs_subscription_close(sub), RsStatus::RsOk);
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "{}", last_error());

    // Probes that cannot work are refused at open, naming the probe and the cause; nothing starts.
    let w = first_element_weights(&dir);
    let narrow = dir.join("narrow.npy");
    write_npy(&narrow, &[1, D - 1], &[1.0; D - 1]);
    let nan = dir.join("nan.npy");
    write_npy(&nan, &[D], &[0.0, f32::NAN, 0.0, 0.0]);
    let hp = format!("[[hookpoints]]\nname = \"h\"\nsite = \"residual\"\ndtype = \"f32\"\nrow_width = {D}\n");
    let cases = [
        (format!("hookpoint = \"nope\"\nweights = {w:?}\nthreshold = 1.0"), "no hookpoint `nope`"),
        (
            format!("hookpoint = \"h\"\nweights = {:?}\nthreshold = 1.0", narrow.display().to_string()),
            "must equal the hookpoint's row_width",
        ),
        (format!("hookpoint = \"h\"\nweights = {:?}\nthreshold = 1.0", nan.display().to_string()), "is NaN"),
        (format!("hookpoint = \"h\"\nweights = {w:?}\nthreshold = 1.0\naggregate = \"median\""), "unknown aggregate"),
    ];
    for (body, want) in cases {
        let cfg = c(&format!("{hp}[[probes]]\nname = \"q\"\n{body}\n"));
        let mut h = 0u64;
        // SAFETY: valid string and out-pointer.
        assert_eq!(unsafe { rs_session_open(cfg.as_ptr(), &mut h) }, RsStatus::RsErrConfig, "{body}");
        assert!(last_error().contains(want) && last_error().contains("`q`"), "{body}: {}", last_error());
        assert_eq!(h, 0, "no session was opened");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn probe_structs_have_no_padding_and_names_are_cut_at_a_character_boundary() {
    assert_eq!(RS_PROBE_MAX_OUTPUTS, ringscope_api::probe::MAX_OUTPUTS);
    // Every byte of the structs is a field (the library copies them whole; padding would be uninitialised bytes).
    assert_eq!(size_of::<RsAlert>(), 4 * 4 + 2 * 8 + 6 * 4 + 2 * RS_PROBE_NAME_LEN);
    assert_eq!(size_of::<RsProbeReport>(), 2 * 4 + 8 * 8 + 4 * RS_PROBE_MAX_OUTPUTS);
    assert_eq!(size_of::<RsProbeSnapshot>(), 6 * 4 + 5 * 8);
    let (short, len) = fixed_text::<8>("abc");
    assert_eq!((text(&short), len), ("abc".into(), 3));
    // 7 bytes fit with the NUL; "é" is 2 bytes, so 3 of them (6 bytes) are kept, never half of one.
    let (cut, len) = fixed_text::<8>("éééé");
    assert_eq!((text(&cut), len), ("ééé".into(), 8));
    let (nul, _) = fixed_text::<8>("a\0b");
    assert_eq!(text(&nul), "a b");

    // A caller built against the ABI 3 header (`rs_hookpoint_snapshot` without `dtype` and `row_width`) gets the
    // fields it knows and nothing past them.
    let s = open("");
    let id = register(s, "h", 4);
    #[repr(C)]
    struct V3 {
        known: [u8; std::mem::offset_of!(RsHookPointSnapshot, dtype)],
        after: u64,
    }
    let v3_size = std::mem::offset_of!(RsHookPointSnapshot, dtype) as u32;
    let mut v3 = V3 { known: [0; std::mem::offset_of!(RsHookPointSnapshot, dtype)], after: 0x5EED };
    v3.known[..4].copy_from_slice(&v3_size.to_le_bytes());
    let mut name = [0 as c_char; 8];
    // SAFETY: `v3` holds the `struct_size` bytes it announces, 8-aligned like the snapshot; `name` holds 8 bytes.
    let st = unsafe {
        rs_hookpoint_stats(s, id, (&mut v3 as *mut V3).cast::<RsHookPointSnapshot>(), name.as_mut_ptr(), name.len())
    };
    assert_eq!(st, RsStatus::RsOk, "{}", last_error());
    assert_eq!((u32::from_le_bytes(v3.known[..4].try_into().unwrap()), v3.after), (v3_size, 0x5EED));
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk);
}

/// `rs_probes_wait` returns as soon as the probes have scored what was captured (before, the consumer looked busy
/// while it waited for records, and a wait took up to seconds), and what it promises holds when it returns: every
/// row captured is counted.
#[test]
fn rs_probes_wait_returns_once_every_row_is_scored() {
    let dir = probe_dir("wait");
    let s = open(&probe_config(&first_element_weights(&dir)));
    let id = hookpoint_id(s, "h");
    let started = std::time::Instant::now();
    for step in 0..20u64 {
        probe_step(s, id, step, &[(1, step as u32), (2, step as u32)], |_| 0.0);
        assert_eq!(rs_probes_wait(s, 30_000), RsStatus::RsOk, "{}", last_error());
        for index in 0..2 {
            let (_, p, name) = probe_snapshot(s, index);
            assert_eq!(p.rows, 2 * (step + 1), "probe {name} after step {step}");
        }
        let (_, r) = report(s, "p", 1);
        assert_eq!((r.scored, r.expected), (step + 1, step + 1));
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "20 steps and waits took {took:?}");
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "{}", last_error());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 28: `rs_session_close` from two threads at once — the caller that lost the race got `RS_OK` with untouched
/// totals while the first close was still writing. Every caller now waits for the one close and gets its totals.
#[test]
fn concurrent_closes_wait_for_the_one_close_and_return_its_totals() {
    for round in 0..20 {
        let s = open("");
        let id = register(s, "h", 4);
        for step in 0..50u64 {
            let (ids, pos) = ([1u64, 2], [step as u32, step as u32]);
            // SAFETY: arrays of 2.
            assert_eq!(unsafe { rs_begin_step(s, step, ids.as_ptr(), pos.as_ptr(), 2) }, RsStatus::RsOk);
            let data = [3u8; 16];
            // SAFETY: 16 bytes: 2 rows of 4 bf16.
            let st = unsafe { rs_capture_host(s, id, data.as_ptr().cast(), data.len(), std::ptr::null_mut()) };
            assert_eq!(st, RsStatus::RsOk, "{}", last_error());
            assert_eq!(rs_end_step(s), RsStatus::RsOk);
        }
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let closers: Vec<_> = (0..4)
            .map(|_| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let mut totals = RsCounts::default();
                    barrier.wait();
                    // SAFETY: writable totals.
                    let st = unsafe { rs_session_close(s, &mut totals) };
                    (st, totals)
                })
            })
            .collect();
        let results: Vec<(RsStatus, RsCounts)> = closers.into_iter().map(|t| t.join().unwrap()).collect();
        for (st, totals) in &results {
            assert_eq!(*st, RsStatus::RsOk, "round {round}");
            assert_eq!((totals.produced_rows, totals.exported_rows), (100, 100), "round {round}: {totals:?}");
        }
        // A later close returns the same.
        let mut again = RsCounts::default();
        // SAFETY: writable totals.
        assert_eq!(unsafe { rs_session_close(s, &mut again) }, RsStatus::RsOk);
        assert_eq!(again, results[0].1);
    }
}

/// Issue 28: a closed session with probes kept its alerts queue (every slot allocated up front: ~5 MiB at the default
/// `alerts.queue`) and its flag table for the life of the process. Now the handle keeps only the alerts left and its
/// counts; the flag table only when `rs_probe_flags` handed its address out.
#[test]
fn a_closed_session_keeps_only_what_its_handle_answers() {
    let dir = probe_dir("closed-keeps");
    let w = first_element_weights(&dir);
    for hand_out in [false, true] {
        let s = open(&probe_config(&w));
        let id = hookpoint_id(s, "h");
        if hand_out {
            let (mut slots, mut len) = (std::ptr::null::<u64>(), 0usize);
            // SAFETY: writable out-pointers.
            assert_eq!(unsafe { rs_probe_flags(s, &mut slots, &mut len) }, RsStatus::RsOk);
        }
        probe_step(s, id, 0, &[(7, 0)], |_| 2.0);
        // SAFETY: null totals are allowed.
        assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk, "{}", last_error());
        let map = table();
        let Some(Entry::ClosedSession(closed)) = map.get(&s) else { panic!("a closed session") };
        let probes = closed.probes.as_ref().expect("it had probes");
        let AlertsLeft::Left(left) = &probes.alerts else { panic!("the alerts queue was not freed") };
        assert_eq!(left.lock().len(), 2, "the two alerts not polled stay with the handle");
        assert_eq!(probes._flags.is_some(), hand_out, "the flag table is kept only when its address is out");
        drop(map);
        assert_eq!(poll_alert(s, 0).0, RsStatus::RsOk);
        assert_eq!(poll_alert(s, 0).0, RsStatus::RsOk);
        assert_eq!(poll_alert(s, 0).0, RsStatus::RsErrEnded);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `rs_metrics_port`: the port of the endpoint (0 without one); a null out-pointer, an unknown handle and a closed
/// session are the documented errors, each with a message.
#[test]
fn rs_metrics_port_answers_and_refuses_bad_input() {
    let s = open("[metrics]\nlisten = \"127.0.0.1:0\"\n");
    let mut port = 0u16;
    // SAFETY: a writable u16.
    assert_eq!(unsafe { rs_metrics_port(s, &mut port) }, RsStatus::RsOk, "{}", last_error());
    assert_ne!(port, 0, "the port the system chose");
    // SAFETY: null is the bad input under test.
    assert_eq!(unsafe { rs_metrics_port(s, std::ptr::null_mut()) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("port"), "{}", last_error());
    // SAFETY: a writable u16.
    assert_eq!(unsafe { rs_metrics_port(0xdead, &mut port) }, RsStatus::RsErrInvalidHandle);
    assert!(!last_error().is_empty());
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk);
    // SAFETY: a writable u16.
    assert_eq!(unsafe { rs_metrics_port(s, &mut port) }, RsStatus::RsErrClosed);
    let plain = open("");
    // SAFETY: a writable u16.
    assert_eq!(unsafe { rs_metrics_port(plain, &mut port) }, RsStatus::RsOk);
    assert_eq!(port, 0, "no endpoint");
    // SAFETY: null totals are allowed.
    unsafe { rs_session_close(plain, std::ptr::null_mut()) };
}

/// `rs_session_set_metadata`: a JSON value lands in the manifest's `metadata`; null pointers, text that is not one
/// JSON value, bad keys, an unknown handle and a closed session are the documented errors, each with a message.
#[test]
fn rs_session_set_metadata_writes_the_manifest_and_refuses_bad_input() {
    let dir = std::env::temp_dir().join(format!("ringscope-ffi-metadata-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let s = open(&format!("[export]\nparquet = true\ndir = {:?}\nrun_id = \"r\"\n", dir.display().to_string()));
    let set = |h: u64, key: &CString, json: &CString| {
        // SAFETY: valid NUL-terminated strings.
        unsafe { rs_session_set_metadata(h, key.as_ptr(), json.as_ptr()) }
    };
    assert_eq!(set(s, &c("attention"), &c(r#"{"layers": [{"layer": 0, "scale": 0.5}]}"#)), RsStatus::RsOk);
    for (key, json, says) in [
        ("attention", "{\"layers\": [", "not one JSON value"),
        ("attention", "1 2", "not one JSON value"),
        ("", "1", "key \"\""),
        ("a b", "1", "A-Z a-z 0-9"),
    ] {
        assert_eq!(set(s, &c(key), &c(json)), RsStatus::RsErrInvalidArgument, "{key:?} {json:?}");
        assert!(last_error().contains(says), "{key:?} {json:?}: {}", last_error());
    }
    let k = c("k");
    // SAFETY: null is the bad input under test.
    assert_eq!(unsafe { rs_session_set_metadata(s, k.as_ptr(), std::ptr::null()) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("json is a null pointer"), "{}", last_error());
    // SAFETY: null is the bad input under test.
    assert_eq!(unsafe { rs_session_set_metadata(s, std::ptr::null(), k.as_ptr()) }, RsStatus::RsErrInvalidArgument);
    assert!(last_error().contains("key is a null pointer"), "{}", last_error());
    assert_eq!(set(0xdead, &c("k"), &c("1")), RsStatus::RsErrInvalidHandle);
    // SAFETY: null totals are allowed.
    assert_eq!(unsafe { rs_session_close(s, std::ptr::null_mut()) }, RsStatus::RsOk);
    assert_eq!(set(s, &c("k"), &c("1")), RsStatus::RsErrClosed);
    let text = std::fs::read_to_string(dir.join("r").join("_ringscope_run.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(manifest["metadata"], serde_json::json!({"attention": {"layers": [{"layer": 0, "scale": 0.5}]}}));
    std::fs::remove_dir_all(&dir).unwrap();
}
