//! Fuzzing the C ABI as a state machine: proptest generates sequences of calls — open (valid and invalid configs),
//! register, begin/capture/end step, subscribe, poll, flush, stats, close, double close, stale and made-up handles —
//! runs them through the `extern "C"` functions, and checks each status against a model of what the call must do.
//!
//! What is fuzzed are the *values* C passes (handles, lengths, row counts, timeouts, null pointers where the ABI
//! checks for them); every pointer passed is valid for the length announced with it, as the C contract requires.
//! Every case is fast (64 KiB rings, timeouts of at most a few milliseconds). The default run is 64 cases
//! (`PROPTEST_CASES` overrides it); docs/testing.md ("Fuzzing") says how to run longer.
#![allow(clippy::undocumented_unsafe_blocks)]

use proptest::prelude::*;

use super::*;

/// Configurations a case opens sessions with; `true` when the session must open.
const CONFIGS: [(&str, bool); 7] = [
    ("[ring]\ncapacity = \"64 KiB\"\n[policy]\nmode = \"best_effort\"\n", true),
    ("[ring]\ncapacity = \"64 KiB\"\n[policy]\nmode = \"full\"\nfull_deadline_ms = 5\n", true),
    // A configured hookpoint (id 0, 16-byte rows) keeping batch rows 0 and 3.
    (
        "[ring]\ncapacity = \"64 KiB\"\n[policy]\nmode = \"best_effort\"\n[[hookpoints]]\nname = \"pre\"\n\
         site = \"residual\"\ndtype = \"u8\"\nrow_width = 16\nrows = [0, 3]\n",
        true,
    ),
    ("[ring]\ncapacity = \"lots\"\n", false),
    ("[ring]\ncapacity = 1000\n", false),
    ("[ring]\ncolour = 1\n", false),
    ("[policy]\nmode = \"full\"\nfull_deadline_ms = 0\n[ring]\ncapacity = \"64 KiB\"\n", false),
];

/// Which handle a call gets: one the case opened (by index, wrapping), or a made-up one.
#[derive(Debug, Clone, Copy)]
enum Handle {
    Session(usize),
    Subscription(usize),
    Zero,
    Garbage(u64),
}

#[derive(Debug, Clone, Copy)]
enum Len {
    /// Batch rows × row bytes of the hookpoint.
    Right,
    /// Off by `delta` bytes.
    Wrong(i8),
    Zero,
    /// A huge length with a null pointer (the ABI checks null).
    HugeNull,
}

#[derive(Debug, Clone)]
enum Call {
    Open(usize),
    Register { session: Handle, name: u8, width: u32, dtype: u8 },
    BeginStep { session: Handle, step: u64, rows: usize, null_ids: bool },
    Capture { session: Handle, hookpoint: u32, len: Len },
    EndStep(Handle),
    Subscribe { session: Handle, layer: Option<u32> },
    Poll { subscription: Handle, timeout_ms: u32, buf: usize },
    Flush { session: Handle, timeout_ms: u32 },
    Stats { session: Handle, hookpoint: u32 },
    CloseSubscription(Handle),
    Close(Handle),
}

fn handle(session: bool) -> impl Strategy<Value = Handle> {
    let own = if session {
        (0usize..4).prop_map(Handle::Session).boxed()
    } else {
        (0usize..4).prop_map(Handle::Subscription).boxed()
    };
    let other = if session {
        (0usize..4).prop_map(Handle::Subscription).boxed()
    } else {
        (0usize..4).prop_map(Handle::Session).boxed()
    };
    prop_oneof![12 => own, 1 => other, 1 => Just(Handle::Zero), 1 => any::<u64>().prop_map(Handle::Garbage)]
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        2 => (0..CONFIGS.len()).prop_map(Call::Open),
        3 => (handle(true), 0u8..4, prop_oneof![1u32..64, Just(0), Just(u32::MAX)], 0u8..4)
            .prop_map(|(session, name, width, dtype)| Call::Register { session, name, width, dtype }),
        4 => (handle(true), 0u64..8, prop_oneof![1usize..6, Just(0)], prop::bool::weighted(0.1))
            .prop_map(|(session, step, rows, null_ids)| Call::BeginStep { session, step, rows, null_ids }),
        8 => (
            handle(true),
            prop_oneof![4 => 0u32..4, 1 => any::<u32>()],
            prop_oneof![8 => Just(Len::Right), 1 => any::<i8>().prop_map(Len::Wrong), 1 => Just(Len::Zero), 1 => Just(Len::HugeNull)],
        )
            .prop_map(|(session, hookpoint, len)| Call::Capture { session, hookpoint, len }),
        4 => handle(true).prop_map(Call::EndStep),
        2 => (handle(true), prop::option::of(0u32..2)).prop_map(|(session, layer)| Call::Subscribe { session, layer }),
        4 => (handle(false), 0u32..=5, prop_oneof![Just(0usize), Just(8), 64usize..512, Just(1 << 16)])
            .prop_map(|(subscription, timeout_ms, buf)| Call::Poll { subscription, timeout_ms, buf }),
        1 => (handle(true), 0u32..=2).prop_map(|(session, timeout_ms)| Call::Flush { session, timeout_ms }),
        2 => (handle(true), prop_oneof![0u32..4, any::<u32>()]).prop_map(|(session, hookpoint)| Call::Stats { session, hookpoint }),
        1 => handle(false).prop_map(Call::CloseSubscription),
        1 => handle(true).prop_map(Call::Close),
    ]
}

/// A hookpoint as the model knows it.
#[derive(Debug, Clone)]
struct ModelHookPoint {
    row_bytes: usize,
    /// The explicit row selection, if any (the configured `pre` hookpoint's).
    selection: Option<Vec<u32>>,
}

#[derive(Debug)]
struct ModelSession {
    handle: u64,
    open: bool,
    full_mode: bool,
    hookpoints: Vec<ModelHookPoint>,
    names: Vec<String>,
    /// Rows of the open step.
    step: Option<usize>,
    /// What the first close returned (every later close returns the same).
    closed_with: Option<RsCounts>,
}

#[derive(Debug)]
struct ModelSubscription {
    handle: u64,
    open: bool,
}

#[derive(Default)]
struct Model {
    sessions: Vec<ModelSession>,
    subscriptions: Vec<ModelSubscription>,
}

/// What a handle resolves to for a session call.
enum Target<'a> {
    Session(&'a mut ModelSession),
    /// Not a session handle: the status the call must return.
    Refused(RsStatus),
}

impl Model {
    fn raw(&self, h: Handle) -> u64 {
        match h {
            Handle::Session(i) if !self.sessions.is_empty() => self.sessions[i % self.sessions.len()].handle,
            Handle::Subscription(i) if !self.subscriptions.is_empty() => {
                self.subscriptions[i % self.subscriptions.len()].handle
            }
            Handle::Session(_) | Handle::Subscription(_) | Handle::Zero => 0,
            Handle::Garbage(g) => {
                let known = self.sessions.iter().map(|s| s.handle).chain(self.subscriptions.iter().map(|s| s.handle));
                if known.clone().any(|k| k == g) {
                    0
                } else {
                    g
                }
            }
        }
    }

    fn session(&mut self, raw: u64) -> Target<'_> {
        match self.sessions.iter_mut().find(|s| s.handle == raw) {
            Some(s) if s.open => Target::Session(s),
            Some(_) => Target::Refused(RsStatus::RsErrClosed),
            None => Target::Refused(RsStatus::RsErrInvalidHandle),
        }
    }
}

fn balanced(c: &RsCounts) -> bool {
    c.produced_records == c.exported_records + c.dropped_records + c.sampled_out_records
        && c.produced_rows == c.exported_rows + c.dropped_rows + c.sampled_out_rows
}

fn run(calls: &[Call]) -> Result<(), TestCaseError> {
    let mut m = Model::default();
    for (n, call) in calls.iter().enumerate() {
        let ctx = || format!("call {n} {call:?}: {}", last_error());
        match *call {
            Call::Open(i) => {
                let (text, opens) = CONFIGS[i];
                let text = CString::new(text).unwrap();
                let mut h = 0u64;
                let st = unsafe { rs_session_open(text.as_ptr(), &mut h) };
                if opens {
                    prop_assert_eq!(st, RsStatus::RsOk, "{}", ctx());
                    let configured = i == 2;
                    m.sessions.push(ModelSession {
                        handle: h,
                        open: true,
                        full_mode: i == 1,
                        hookpoints: if configured {
                            vec![ModelHookPoint { row_bytes: 16, selection: Some(vec![0, 3]) }]
                        } else {
                            vec![]
                        },
                        names: if configured { vec!["pre".into()] } else { vec![] },
                        step: None,
                        closed_with: None,
                    });
                } else {
                    prop_assert_eq!(st, RsStatus::RsErrConfig, "{}", ctx());
                    prop_assert!(!last_error().is_empty());
                }
            }
            Call::Register { session, name, width, dtype } => {
                let raw = m.raw(session);
                let name = format!("h{name}");
                let (dt, size, dtype_ok) =
                    [("u8", 1, true), ("bf16", 2, true), ("f32", 4, true), ("bf17", 0, false)][dtype as usize % 4];
                let (cn, site, cdt) = (CString::new(name.clone()).unwrap(), c"residual", CString::new(dt).unwrap());
                let mut id = u32::MAX;
                let st =
                    unsafe { rs_register_hookpoint(raw, cn.as_ptr(), site.as_ptr(), 0, cdt.as_ptr(), width, &mut id) };
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(s) => {
                        let fits = dtype_ok && (1..64).contains(&width) && !s.names.contains(&name);
                        if fits {
                            prop_assert_eq!(st, RsStatus::RsOk, "{}", ctx());
                            prop_assert_eq!(id as usize, s.hookpoints.len());
                            s.hookpoints.push(ModelHookPoint { row_bytes: width as usize * size, selection: None });
                            s.names.push(name);
                        } else {
                            prop_assert!(
                                matches!(st, RsStatus::RsErrInvalidArgument | RsStatus::RsErrCapture),
                                "{st:?} {}",
                                ctx()
                            );
                        }
                    }
                }
            }
            Call::BeginStep { session, step, rows, null_ids } => {
                let raw = m.raw(session);
                let ids: Vec<u64> = (0..rows as u64).map(|r| r / 2).collect();
                let pos: Vec<u32> = (0..rows as u32).collect();
                let ids_ptr = if null_ids { std::ptr::null() } else { ids.as_ptr() };
                let st = unsafe { rs_begin_step(raw, step, ids_ptr, pos.as_ptr(), rows) };
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(s) => {
                        let expected = if null_ids && rows > 0 {
                            RsStatus::RsErrInvalidArgument
                        } else if rows == 0 {
                            RsStatus::RsErrCapture
                        } else if s.step.is_some() {
                            RsStatus::RsErrStep
                        } else {
                            s.step = Some(rows);
                            RsStatus::RsOk
                        };
                        prop_assert_eq!(st, expected, "{}", ctx());
                    }
                }
            }
            Call::Capture { session, hookpoint, len } => {
                let raw = m.raw(session);
                let (rows, hp) = match m.session(raw) {
                    Target::Session(s) => (s.step.unwrap_or(1), s.hookpoints.get(hookpoint as usize).cloned()),
                    Target::Refused(_) => (1, None),
                };
                let right = rows * hp.as_ref().map_or(8, |h| h.row_bytes);
                let n = match len {
                    Len::Right => right,
                    Len::Wrong(d) => right.saturating_add_signed(d as isize),
                    Len::Zero | Len::HugeNull => 0,
                };
                let data = vec![0x5Au8; n];
                let (ptr, n): (*const c_void, usize) = match len {
                    Len::HugeNull => (std::ptr::null(), usize::MAX / 2),
                    Len::Zero => (std::ptr::null(), 0),
                    _ => (data.as_ptr().cast(), n),
                };
                let mut outcome = -1;
                let st = unsafe { rs_capture_host(raw, hookpoint, ptr, n, &mut outcome) };
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(s) => {
                        let step_rows = s.step;
                        let accepted_len = |h: &ModelHookPoint, rows: usize| {
                            n == rows * h.row_bytes
                                || h.selection.as_ref().is_some_and(|sel| n == sel.len() * h.row_bytes)
                        };
                        if st == RsStatus::RsOk {
                            prop_assert!(step_rows.is_some(), "a capture outside a step succeeded: {}", ctx());
                            let h = hp.as_ref().expect("a capture of an unknown hookpoint succeeded");
                            prop_assert!(accepted_len(h, rows), "a capture of {n} bytes succeeded: {}", ctx());
                            prop_assert!(
                                [RS_CAPTURE_PUBLISHED, RS_CAPTURE_SAMPLED_OUT, RS_CAPTURE_DROPPED].contains(&outcome)
                            );
                        } else {
                            prop_assert!(
                                matches!(
                                    st,
                                    RsStatus::RsErrInvalidArgument | RsStatus::RsErrCapture | RsStatus::RsErrStep
                                ),
                                "{st:?} {}",
                                ctx()
                            );
                            // A well-formed capture in a step is refused only by a full ring past the deadline
                            // (full mode) or by a selection past the batch.
                            if let (Some(rows), Some(h)) = (step_rows, &hp) {
                                let selectable =
                                    h.selection.as_ref().is_none_or(|sel| sel.iter().all(|&r| (r as usize) < rows));
                                if matches!(len, Len::Right) && selectable && !s.full_mode {
                                    prop_assert!(false, "a well-formed capture was refused: {st:?} {}", ctx());
                                }
                            }
                        }
                    }
                }
            }
            Call::EndStep(session) => {
                let raw = m.raw(session);
                let st = rs_end_step(raw);
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(s) => {
                        let expected = if s.step.take().is_some() { RsStatus::RsOk } else { RsStatus::RsErrStep };
                        prop_assert_eq!(st, expected, "{}", ctx());
                    }
                }
            }
            Call::Subscribe { session, layer } => {
                let raw = m.raw(session);
                let layers: Vec<u32> = layer.into_iter().collect();
                let mut sub = 0u64;
                let st = unsafe { rs_subscribe(raw, c"probe".as_ptr(), layers.as_ptr(), layers.len(), &mut sub) };
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(_) => {
                        prop_assert_eq!(st, RsStatus::RsOk, "{}", ctx());
                        m.subscriptions.push(ModelSubscription { handle: sub, open: true });
                    }
                }
            }
            Call::Poll { subscription, timeout_ms, buf } => {
                let raw = m.raw(subscription);
                let mut info = RsRecordInfo::default();
                let mut bytes = vec![0u8; buf];
                let ptr: *mut c_void = if buf == 0 { std::ptr::null_mut() } else { bytes.as_mut_ptr().cast() };
                let st = unsafe { rs_poll(raw, timeout_ms, &mut info, ptr, buf) };
                match m.subscriptions.iter().find(|s| s.handle == raw) {
                    None => prop_assert_eq!(st, RsStatus::RsErrInvalidHandle, "{}", ctx()),
                    Some(s) if !s.open => prop_assert_eq!(st, RsStatus::RsErrClosed, "{}", ctx()),
                    Some(_) => {
                        prop_assert!(
                            matches!(
                                st,
                                RsStatus::RsOk
                                    | RsStatus::RsErrTimeout
                                    | RsStatus::RsErrBufferTooSmall
                                    | RsStatus::RsErrEnded
                            ),
                            "{st:?} {}",
                            ctx()
                        );
                        if matches!(st, RsStatus::RsOk | RsStatus::RsErrBufferTooSmall) {
                            let needed = info.rows as u64 * (16 + info.row_bytes as u64);
                            prop_assert_eq!(info.needed, needed);
                            prop_assert_eq!(st == RsStatus::RsOk, needed <= buf as u64, "{}", ctx());
                        }
                        if st == RsStatus::RsOk {
                            // The rows are the captured bytes.
                            let data = &bytes[16 * info.rows as usize..info.needed as usize];
                            prop_assert!(data.iter().all(|&b| b == 0x5A));
                        }
                    }
                }
            }
            Call::Flush { session, timeout_ms } => {
                let raw = m.raw(session);
                let st = rs_flush(raw, timeout_ms);
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(_) => {
                        prop_assert!(matches!(st, RsStatus::RsOk | RsStatus::RsErrTimeout), "{st:?} {}", ctx())
                    }
                }
            }
            Call::Stats { session, hookpoint } => {
                let raw = m.raw(session);
                let mut counts = RsCounts::default();
                let st = unsafe { rs_stats(raw, hookpoint, &mut counts) };
                match m.session(raw) {
                    Target::Refused(expected) => prop_assert_eq!(st, expected, "{}", ctx()),
                    Target::Session(s) if (hookpoint as usize) < s.hookpoints.len() => {
                        prop_assert_eq!(st, RsStatus::RsOk, "{}", ctx());
                        let settled = counts.exported_records + counts.dropped_records + counts.sampled_out_records;
                        prop_assert!(settled <= counts.produced_records, "{counts:?}");
                        prop_assert_eq!(counts.dropped_records, counts.dropped_by_reason.iter().sum::<u64>());
                    }
                    Target::Session(_) => prop_assert_eq!(st, RsStatus::RsErrCapture, "{}", ctx()),
                }
            }
            Call::CloseSubscription(subscription) => {
                let raw = m.raw(subscription);
                let st = rs_subscription_close(raw);
                match m.subscriptions.iter_mut().find(|s| s.handle == raw) {
                    None => prop_assert_eq!(st, RsStatus::RsErrInvalidHandle, "{}", ctx()),
                    Some(s) => {
                        prop_assert_eq!(st, RsStatus::RsOk, "{}", ctx());
                        s.open = false;
                    }
                }
            }
            Call::Close(session) => {
                let raw = m.raw(session);
                close(&mut m, raw)?
            }
        }
    }
    // Whatever the sequence, every session closes with balanced accounting, and a second close is harmless.
    let handles: Vec<u64> = m.sessions.iter().map(|s| s.handle).collect();
    for h in handles {
        close(&mut m, h)?;
        close(&mut m, h)?;
    }
    for s in &m.subscriptions {
        prop_assert_eq!(rs_subscription_close(s.handle), RsStatus::RsOk);
    }
    Ok(())
}

fn close(m: &mut Model, raw: u64) -> Result<(), TestCaseError> {
    let mut totals = RsCounts { produced_records: u64::MAX, ..RsCounts::default() };
    let st = unsafe { rs_session_close(raw, &mut totals) };
    match m.sessions.iter_mut().find(|s| s.handle == raw) {
        None => prop_assert_eq!(st, RsStatus::RsErrInvalidHandle, "{}", last_error()),
        Some(s) if !s.open => {
            prop_assert_eq!(st, RsStatus::RsOk, "a second close: {}", last_error());
            prop_assert_eq!(Some(totals), s.closed_with, "a second close returns the first one's totals");
        }
        Some(s) => {
            prop_assert_eq!(st, RsStatus::RsOk, "{}", last_error());
            prop_assert!(balanced(&totals), "unbalanced totals at close: {totals:?}");
            s.open = false;
            s.closed_with = Some(totals);
        }
    }
    Ok(())
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(rs_last_error()) }.to_string_lossy().into_owned()
}

/// 64 cases unless `PROPTEST_CASES` says otherwise.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Sequences of up to 60 calls, starting with an open session.
    #[test]
    fn call_sequences_follow_the_model(calls in prop::collection::vec(call(), 1..60)) {
        let mut calls = calls;
        calls.insert(0, Call::Open(0));
        run(&calls)?;
    }
}
