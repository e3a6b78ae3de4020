//! The capture kernels' host side: the source NVRTC compiles (`kernels/capture.cu` and `kernels/probe.cu` between a
//! prelude and layout checks generated from the Rust constants), the per-device module cache, and one typed launch
//! function per kernel — the only place that knows each kernel's parameter list.
//!
//! # One source of truth
//! Every number the kernels share with Rust — ring state offsets, host block offsets, error bits, counter words,
//! descriptor fields, record header constants, row-selection modes, `MAX_MANY`, the probe's limits — is written once, in Rust, and
//! reaches the kernels as a `#define` of [`prelude`]. The structs passed by value or read from device memory
//! (`Control`, `GraphBatch`, `Entry`, `Many`) are declared in `capture.cu`; [`layout_checks`] appends
//! `static_assert`s of their sizes and field offsets against the Rust encoders, so NVRTC refuses to compile kernels
//! that disagree with the host (the `kernels_compile_with_nvrtc` test runs it without a GPU).

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt::Write as _;
use std::mem::offset_of;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use ringscope_ring::cuda::{errors, host, state, CudaError, DevicePtr, Function, Gpu, Module, RingAddrs, StreamRef};
use ringscope_ring::record::{
    self, HEADER_CHECK_MUL, HEADER_CHECK_SEED, HEADER_CHECK_SHIFT, HEADER_LEN, RECORD_ALIGN, ROW_META_LEN,
};
use ringscope_ring::{rowscaled, DType, RecordKind, RowMeta};

use super::controls::{DeviceControl, RowMode, CONTROL_BYTES};
use super::counters::{counter, COUNTER_WORDS};
use super::probe::{MAX_PROBE_OUTPUTS, PROBE_CHUNK, PROBE_UNROLL};
use super::slots::desc;

/// The capture kernels' source as written (without the generated prelude and layout checks: see [`kernel_source`]).
pub const KERNEL_SOURCE: &str = include_str!("../../kernels/capture.cu");

/// The fused probe kernel's source as written; compiled in the same module, after [`KERNEL_SOURCE`] (whose
/// `Control`, `GraphBatch` and element loads it uses).
pub const PROBE_SOURCE: &str = include_str!("../../kernels/probe.cu");

/// Threads per block of every kernel (`__launch_bounds__(THREADS)`).
pub(super) const THREADS: u32 = 256;

/// Deferred captures one `ringscope_capture_many` kernel takes.
pub(super) const MAX_MANY: usize = 48;

/// End-of-sequence (and padding) token ids a graph-begun step's batch can name ([`EndedRows`]).
pub const MAX_ENDED_TOKENS: usize = 8;

/// Deferred fused probes one `ringscope_probe_scores_many` kernel takes.
pub(super) const MAX_PROBE_MANY: usize = 32;

/// Layout of one deferred probe (`struct ProbeEntry`).
mod probe_entry {
    pub const SRC: usize = 0;
    pub const WEIGHTS: usize = 8;
    pub const BIAS: usize = 16;
    pub const SCORES: usize = 24;
    pub const THRESHOLDS: usize = 32;
    pub const FLAGS: usize = 40;
    pub const SRC_ROWS: usize = 48;
    pub const DTYPE: usize = 52;
    pub const WIDTH: usize = 56;
    pub const OUTPUTS: usize = 60;
    pub const HOOKPOINT: usize = 64;
    pub const FLAG_SLOTS: usize = 68;
    pub const BYTES: usize = 72;
}

/// Layout of the `ringscope_probe_scores_many` parameter (`struct ProbeMany`): a `GraphBatch`, a `u32` count (and
/// 4 bytes of padding), `MAX_PROBE_MANY` entries.
mod probe_many {
    use super::{graph_batch, probe_entry, MAX_PROBE_MANY};
    pub const GRAPH_BATCH: usize = 0;
    pub const N: usize = graph_batch::BYTES;
    pub const ENTRIES: usize = N + 8;
    pub const BYTES: usize = ENTRIES + MAX_PROBE_MANY * probe_entry::BYTES;
}

/// Layout of the kernels' `GraphBatch` parameter (byte offsets; see [`GraphBatch::param`]).
mod graph_batch {
    use super::MAX_ENDED_TOKENS;
    pub const REQUEST_IDS: usize = 0;
    pub const POSITIONS: usize = 8;
    pub const BATCH: usize = 16;
    pub const SEQ: usize = 20;
    pub const POS_STRIDE: usize = 24;
    pub const ROLE: usize = 28;
    pub const TOKENS: usize = 32;
    pub const TOKENS_STRIDE: usize = 40;
    pub const N_ENDED: usize = 44;
    pub const ENDED: usize = 48;
    pub const KEPT: usize = ENDED + 8 * MAX_ENDED_TOKENS;
    pub const BYTES: usize = KEPT + 8;
}

/// Layout of one deferred capture (`struct Entry`).
mod entry {
    pub const SRC: usize = 0;
    pub const HOOKPOINT: usize = 8;
    pub const DTYPE: usize = 12;
    pub const ROW_BYTES: usize = 16;
    pub const SRC_ROWS: usize = 20;
    pub const BYTES: usize = 24;
}

/// Layout of the `ringscope_capture_many` parameter (`struct Many`): a `GraphBatch`, two `u32`, `MAX_MANY` entries.
mod many {
    use super::{entry, graph_batch, MAX_MANY};
    pub const GRAPH_BATCH: usize = 0;
    pub const N: usize = graph_batch::BYTES;
    pub const FULL_MODE: usize = N + 4;
    pub const ENTRIES: usize = FULL_MODE + 4;
    pub const BYTES: usize = ENTRIES + MAX_MANY * entry::BYTES;
}

/// How a kernel uses its `GraphBatch` parameter (`GB_*` in the kernels).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GraphRole {
    /// The step's batch is the installed descriptor's (a step begun on the host).
    Off = 0,
    /// The batch comes from the parameter, and this kernel is the step's first: it numbers the step.
    First = 1,
    /// The batch comes from the parameter, in a step an earlier kernel numbered (a step's captures in two parts).
    Later = 2,
}

/// A C type for a shared constant, so that the kernels' arithmetic keeps its width.
#[derive(Debug, Clone, Copy)]
enum CType {
    Int,
    U32,
    U64,
}

/// Every constant the kernels share with Rust: name in the kernels, value, C type.
fn shared_constants() -> Vec<(&'static str, u64, CType)> {
    use CType::{Int, U32, U64};
    let n = |v: usize| v as u64;
    let mut c = vec![
        // The ring's device state block and host block (ringscope_ring::cuda::{state, host}).
        ("ST_HEAD", n(state::HEAD), Int),
        ("ST_SEQ", n(state::SEQ), Int),
        ("ST_TAIL", n(state::TAIL), Int),
        ("ST_TAIL_SNAP", n(state::TAIL_SNAP), Int),
        ("ST_DONE_BLOCKS", n(state::DONE_BLOCKS), Int),
        ("ST_BEGIN_DONE", n(state::BEGIN_DONE), Int),
        ("ST_BUSY", n(state::BUSY), Int),
        ("ST_NEXT_STEP", n(state::NEXT_STEP), Int),
        ("ST_GRAPH_BEGUN", n(state::GRAPH_BEGUN), Int),
        ("ST_GRAPH_FLAGS", n(state::GRAPH_FLAGS), Int),
        ("HS_HEAD", n(host::HEAD), Int),
        ("HS_PROGRESS", n(host::PROGRESS), Int),
        ("HS_ERRORS", n(host::ERRORS), Int),
        ("HS_GRAPH_BEGUN", n(host::GRAPH_BEGUN), Int),
        ("HS_TAIL_SNAP", n(host::TAIL_SNAP), Int),
        ("ERR_CONCURRENT_PRODUCERS", errors::CONCURRENT_PRODUCERS as u64, U32),
        ("ERR_FULL_MODE_OVERRUN", errors::FULL_MODE_OVERRUN as u64, U32),
        // The record format (ringscope_ring::record).
        ("RECORD_ALIGN_MASK", n(RECORD_ALIGN - 1), U64),
        ("HEADER_BYTES", n(HEADER_LEN), U64),
        ("META_BYTES", n(ROW_META_LEN), U64),
        (
            "MAGIC_VERSION_LEN",
            record::MAGIC as u64 | (record::FORMAT_VERSION as u64) << 32 | (HEADER_LEN as u64) << 48,
            U64,
        ),
        ("KIND_DATA", RecordKind::Data as u64, U64),
        // Pad records carry dtype u8, as the host encoder writes them.
        ("DTYPE_PAD", DType::U8.code() as u64, U64),
        ("FLAG_ROW_SELECTION", record::flags::ROW_SELECTION as u64, U64),
        // Downcast rows (ringscope_ring::rowscaled): the source dtypes, the record's dtype, the scale's bytes.
        ("DTYPE_F32", DType::F32.code() as u64, U32),
        ("DTYPE_F16", DType::F16.code() as u64, U32),
        ("DTYPE_BF16", DType::BF16.code() as u64, U32),
        ("DTYPE_ROWSCALED", DType::F8E4M3RowScaled.code() as u64, U32),
        ("SCALE_BYTES", rowscaled::SCALE_BYTES as u64, U32),
        ("HEADER_CHECK_SEED", HEADER_CHECK_SEED, U64),
        ("HEADER_CHECK_MUL", HEADER_CHECK_MUL, U64),
        ("HEADER_CHECK_SHIFT", HEADER_CHECK_SHIFT as u64, Int),
        // The step descriptor (super::slots::desc).
        ("DESC_HEADER_BYTES", n(desc::HEADER_BYTES), U64),
        ("DESC_STEP", n(desc::STEP), Int),
        ("DESC_N_ROWS", n(desc::N_ROWS), Int),
        ("DESC_N_LAST", n(desc::N_LAST), Int),
        ("DESC_BEGIN_INDEX", n(desc::BEGIN_INDEX), Int),
        ("DESC_FLAGS", n(desc::FLAGS), Int),
        ("DESC_DEADLINE", desc::DEADLINE as u64, U32),
        ("DESC_KEPT", desc::KEPT as u64, U32),
        ("KEEP_ALL", KEEP_ALL as u64, U32),
        // Per-hookpoint controls (super::controls) and counters (super::counters).
        ("CONTROL_BYTES", n(CONTROL_BYTES), Int),
        ("ROW_ALL", RowMode::All as u64, Int),
        ("ROW_LIST", RowMode::List as u64, Int),
        ("ROW_LAST_PER_REQUEST", RowMode::LastPerRequest as u64, Int),
        ("NO_REQUEST", RowMeta::NO_REQUEST, U64),
        ("SRC_LAST_ROWS", SRC_LAST_ROWS as u64, U32),
        ("COUNTER_WORDS", n(COUNTER_WORDS), U64),
    ];
    for (name, word) in [
        ("PRODUCED", counter::PRODUCED),
        ("SAMPLED", counter::SAMPLED),
        ("PUBLISHED", counter::PUBLISHED),
        ("FULL", counter::FULL),
        ("TOO_LARGE", counter::TOO_LARGE),
        ("DEADLINE", counter::DEADLINE),
    ] {
        // Each reason is a pair of words: records, then rows.
        let rec: &'static str = Box::leak(format!("C_{name}_REC").into_boxed_str());
        let rows: &'static str = Box::leak(format!("C_{name}_ROWS").into_boxed_str());
        c.push((rec, n(word), Int));
        c.push((rows, n(word + 1), Int));
    }
    c.extend([
        // Kernel parameters (this module).
        ("THREADS", THREADS as u64, Int),
        ("MAX_MANY", n(MAX_MANY), Int),
        ("GRAPH_BATCH_BYTES", n(graph_batch::BYTES), Int),
        ("MAX_ENDED_TOKENS", n(MAX_ENDED_TOKENS), Int),
        ("ENTRY_BYTES", n(entry::BYTES), Int),
        ("MANY_BYTES", n(many::BYTES), Int),
        ("MAX_PROBE_MANY", n(MAX_PROBE_MANY), Int),
        ("GB_OFF", GraphRole::Off as u64, Int),
        ("GB_FIRST", GraphRole::First as u64, Int),
        ("GB_LATER", GraphRole::Later as u64, Int),
        // The test pattern (pattern_word).
        ("PATTERN_GOLDEN", PATTERN_GOLDEN, U64),
        ("PATTERN_MIX", PATTERN_MIX, U64),
        // Fused probes (super::probe): most outputs, outputs accumulated per pass over a row.
        ("PROBE_MAX_K", MAX_PROBE_OUTPUTS as u64, Int),
        ("PROBE_CHUNK", PROBE_CHUNK as u64, Int),
        ("PROBE_UNROLL", PROBE_UNROLL as u64, Int),
    ]);
    c
}

/// The `#define`s the kernel source starts with, generated from the Rust constants.
pub fn prelude() -> String {
    static PRELUDE: OnceLock<String> = OnceLock::new();
    PRELUDE
        .get_or_init(|| {
            let mut out = String::from(
                "// Generated by ringscope_hookpoint::cuda::kernels::prelude from the Rust constants: do not copy these\n\
                 // numbers into capture.cu or probe.cu.\n",
            );
            for (name, value, ty) in shared_constants() {
                let suffix = match ty {
                    CType::Int => "",
                    CType::U32 => "u",
                    CType::U64 => "ull",
                };
                let _ = writeln!(out, "#define {name} {value:#x}{suffix}");
            }
            out
        })
        .clone()
}

/// The `static_assert`s appended to the kernel source: the kernels' structs have the sizes and field offsets the
/// Rust encoders write.
pub fn layout_checks() -> String {
    // NVRTC has no <cstddef> (so no `offsetof`, and no `__builtin_offsetof`); its front end's `__INTADDR__` makes
    // the classic null-pointer expression a constant.
    let mut out = String::from(
        "\n// Generated by ringscope_hookpoint::cuda::kernels::layout_checks.\n\
         #define RINGSCOPE_OFFSETOF(T, f) ((unsigned long long)__INTADDR__(&(((T*)0)->f)))\n",
    );
    let mut check = |ty: &str, field: Option<&str>, value: usize| {
        let (what, expr) = match field {
            Some(f) => (format!("{ty}::{f} offset"), format!("RINGSCOPE_OFFSETOF({ty}, {f})")),
            None => (format!("sizeof({ty})"), format!("sizeof({ty})")),
        };
        let _ = writeln!(out, "static_assert({expr} == {value}, \"{what} differs from the Rust encoder ({value})\");");
    };
    check("Control", None, CONTROL_BYTES);
    check("Control", None, size_of::<DeviceControl>());
    check("Control", Some("enabled"), offset_of!(DeviceControl, enabled));
    check("Control", Some("every_n"), offset_of!(DeviceControl, every_n));
    check("Control", Some("mode"), offset_of!(DeviceControl, mode));
    check("Control", Some("list_len"), offset_of!(DeviceControl, list_len));
    check("Control", Some("list_ptr"), offset_of!(DeviceControl, list_ptr));
    check("Control", Some("valid_rows_ptr"), offset_of!(DeviceControl, valid_rows_ptr));
    check("Control", Some("downcast"), offset_of!(DeviceControl, downcast));
    check("GraphBatch", None, graph_batch::BYTES);
    check("GraphBatch", Some("request_ids"), graph_batch::REQUEST_IDS);
    check("GraphBatch", Some("positions"), graph_batch::POSITIONS);
    check("GraphBatch", Some("batch"), graph_batch::BATCH);
    check("GraphBatch", Some("seq"), graph_batch::SEQ);
    check("GraphBatch", Some("pos_stride"), graph_batch::POS_STRIDE);
    check("GraphBatch", Some("on"), graph_batch::ROLE);
    check("GraphBatch", Some("tokens"), graph_batch::TOKENS);
    check("GraphBatch", Some("tokens_stride"), graph_batch::TOKENS_STRIDE);
    check("GraphBatch", Some("n_ended"), graph_batch::N_ENDED);
    check("GraphBatch", Some("ended"), graph_batch::ENDED);
    check("GraphBatch", Some("kept"), graph_batch::KEPT);
    check("Entry", None, entry::BYTES);
    check("Entry", Some("src"), entry::SRC);
    check("Entry", Some("hookpoint"), entry::HOOKPOINT);
    check("Entry", Some("dtype"), entry::DTYPE);
    check("Entry", Some("row_bytes"), entry::ROW_BYTES);
    check("Entry", Some("src_rows"), entry::SRC_ROWS);
    check("Many", None, many::BYTES);
    check("Many", Some("g"), many::GRAPH_BATCH);
    check("Many", Some("n"), many::N);
    check("Many", Some("full_mode"), many::FULL_MODE);
    check("Many", Some("e"), many::ENTRIES);
    check("ProbeEntry", None, probe_entry::BYTES);
    check("ProbeEntry", Some("src"), probe_entry::SRC);
    check("ProbeEntry", Some("w"), probe_entry::WEIGHTS);
    check("ProbeEntry", Some("bias"), probe_entry::BIAS);
    check("ProbeEntry", Some("out"), probe_entry::SCORES);
    check("ProbeEntry", Some("thresholds"), probe_entry::THRESHOLDS);
    check("ProbeEntry", Some("flags"), probe_entry::FLAGS);
    check("ProbeEntry", Some("src_rows"), probe_entry::SRC_ROWS);
    check("ProbeEntry", Some("dtype"), probe_entry::DTYPE);
    check("ProbeEntry", Some("d"), probe_entry::WIDTH);
    check("ProbeEntry", Some("k"), probe_entry::OUTPUTS);
    check("ProbeEntry", Some("hookpoint"), probe_entry::HOOKPOINT);
    check("ProbeEntry", Some("flag_slots"), probe_entry::FLAG_SLOTS);
    check("ProbeMany", None, probe_many::BYTES);
    check("ProbeMany", Some("g"), probe_many::GRAPH_BATCH);
    check("ProbeMany", Some("n"), probe_many::N);
    check("ProbeMany", Some("e"), probe_many::ENTRIES);
    out
}

/// The source NVRTC compiles: [`prelude`], `kernels/capture.cu`, `kernels/probe.cu`, [`layout_checks`].
pub fn kernel_source() -> String {
    format!("{}\n{KERNEL_SOURCE}\n{PROBE_SOURCE}{}", prelude(), layout_checks())
}

/// Compiles the kernels to PTX for `arch` (e.g. `sm_90`) with NVRTC. Needs only NVRTC, not a GPU.
pub fn compile_ptx(arch: &str) -> Result<String, CudaError> {
    ringscope_ring::cuda::compile_ptx(&kernel_source(), arch, &["--std=c++17"])
}

/// [`pattern_word`]'s odd multiplier.
const PATTERN_GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// [`pattern_word`]'s mixing multiplier.
const PATTERN_MIX: u64 = 0xBF58_476D_1CE4_E5B9;

/// The word `i` of a pattern filled by [`DeviceCapture::fill_pattern`](super::DeviceCapture::fill_pattern) with
/// `seed` (for tests and benchmarks).
pub fn pattern_word(seed: u64, i: u64) -> u32 {
    let mut x = seed ^ i.wrapping_mul(PATTERN_GOLDEN);
    x ^= x >> 31;
    x = x.wrapping_mul(PATTERN_MIX);
    x ^= x >> 27;
    x as u32
}

/// A step's batch as device tensors of the engine, for steps begun inside a CUDA graph
/// ([`DeviceCapture::begin_step_graph`](super::DeviceCapture::begin_step_graph)): the addresses are fixed when the
/// graph is recorded, the values are read at every replay. Each batch row is one request; row `b * seq + s` of a
/// captured tensor is batch row `b`'s token `s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphBatch {
    /// Batch rows (requests).
    pub batch: u32,
    /// Tokens per batch row (1 for a decode step).
    pub seq: u32,
    /// Device `i64[batch]`: the request id of each batch row.
    pub request_ids: DevicePtr,
    /// Device `i64`: the position of token `s` of batch row `b` is element `b * positions_batch_stride + s`.
    pub positions: DevicePtr,
    /// Elements between batch rows in `positions`: `seq` for a contiguous `[batch, seq]` tensor (`position_ids`),
    /// 0 when every row shares one `[seq]` vector (`cache_position`).
    pub positions_batch_stride: u32,
    /// Rows of sequences that ended: a batch row fed one of these tokens is no request's at that replay (its rows are
    /// attributed to [`RowMeta::NO_REQUEST`]), decided on the device from the engine's token tensor — what an engine
    /// that keeps finished sequences in a fixed-shape batch (Hugging Face `generate`) needs, without kernels of its own.
    pub ended: Option<EndedRows>,
    /// The rows the step keeps, read at every replay (one token per batch row: `seq` 1): device `u32[1 + batch]`,
    /// element 0 the number of rows kept — or [`KEEP_ALL`] for every row — then the kept batch rows, ascending. The
    /// other rows are neither captured nor scored by fused probes: what an engine that serves requests it does not
    /// capture (opted out, or not opted in) writes before each pass, as it writes the request ids. Every capture of
    /// the step takes the kept rows for "all rows" and for "each request's last row"; an explicit row list is taken as
    /// given. `None`: every row.
    pub kept: Option<DevicePtr>,
}

/// [`GraphBatch::kept`]'s element 0 for a step that keeps every row.
pub const KEEP_ALL: u32 = u32::MAX;

/// The rows of a graph-begun step that belong to no request because their sequence ended: batch row `b` whose token
/// (`tokens[b * batch_stride]`, device `i64`, read at every replay) is one of up to [`MAX_ENDED_TOKENS`] ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndedRows {
    tokens: DevicePtr,
    batch_stride: u32,
    ids: [i64; MAX_ENDED_TOKENS],
    len: u32,
}

impl EndedRows {
    /// `tokens`: device `i64`, the token batch row `b` is fed at element `b * batch_stride`; `ids`: 1 to
    /// [`MAX_ENDED_TOKENS`] token ids that mark an ended sequence (end-of-sequence and padding tokens).
    pub fn new(tokens: DevicePtr, batch_stride: u32, ids: &[i64]) -> Result<EndedRows, String> {
        if ids.is_empty() || ids.len() > MAX_ENDED_TOKENS {
            return Err(format!(
                "{} ended-sequence token ids: give 1 to {MAX_ENDED_TOKENS} (end-of-sequence and padding tokens)",
                ids.len()
            ));
        }
        if tokens.addr() == 0 {
            return Err("ended-sequence tokens: null device pointer".into());
        }
        let mut all = [0i64; MAX_ENDED_TOKENS];
        all[..ids.len()].copy_from_slice(ids);
        Ok(EndedRows { tokens, batch_stride, ids: all, len: ids.len() as u32 })
    }

    /// Device `i64`: the token of batch row `b` is element `b * batch_stride`.
    pub fn tokens(&self) -> DevicePtr {
        self.tokens
    }

    /// Elements between batch rows in [`tokens`](Self::tokens).
    pub fn batch_stride(&self) -> u32 {
        self.batch_stride
    }

    /// The token ids that mark an ended sequence.
    pub fn ids(&self) -> &[i64] {
        &self.ids[..self.len as usize]
    }
}

/// The kernels' `GraphBatch` parameter, as its bytes.
pub(super) type GraphBatchParam = [u8; graph_batch::BYTES];

impl GraphBatch {
    /// The kernels' `GraphBatch` parameter; `None` gives one that is off ([`GraphRole::Off`]).
    pub(super) fn param(batch: Option<&GraphBatch>, role: GraphRole) -> GraphBatchParam {
        use graph_batch::*;
        let mut p = [0u8; BYTES];
        if let Some(g) = batch {
            p[REQUEST_IDS..REQUEST_IDS + 8].copy_from_slice(&g.request_ids.addr().to_le_bytes());
            p[POSITIONS..POSITIONS + 8].copy_from_slice(&g.positions.addr().to_le_bytes());
            p[BATCH..BATCH + 4].copy_from_slice(&g.batch.to_le_bytes());
            p[SEQ..SEQ + 4].copy_from_slice(&g.seq.to_le_bytes());
            p[POS_STRIDE..POS_STRIDE + 4].copy_from_slice(&g.positions_batch_stride.to_le_bytes());
            p[ROLE..ROLE + 4].copy_from_slice(&(role as u32).to_le_bytes());
            if let Some(k) = g.kept {
                p[KEPT..KEPT + 8].copy_from_slice(&k.addr().to_le_bytes());
            }
            if let Some(e) = &g.ended {
                p[TOKENS..TOKENS + 8].copy_from_slice(&e.tokens.addr().to_le_bytes());
                p[TOKENS_STRIDE..TOKENS_STRIDE + 4].copy_from_slice(&e.batch_stride.to_le_bytes());
                p[N_ENDED..N_ENDED + 4].copy_from_slice(&e.len.to_le_bytes());
                for (k, id) in e.ids().iter().enumerate() {
                    p[ENDED + 8 * k..ENDED + 8 * k + 8].copy_from_slice(&id.to_le_bytes());
                }
            }
        }
        p
    }
}

/// The bit of a kernel's `src_rows` argument that marks a *last-rows* source: its row `k` is the step's `k`-th last
/// row per request (a site the model computed for each request's last token only, such as the logits of a prefill),
/// not batch row `k`. The kernels then capture (and score) the last rows per request whatever the hookpoint's row
/// selection. The row count itself stays below this bit (`max_batch_rows` is far smaller).
pub const SRC_LAST_ROWS: u32 = 1 << 31;

/// `rows` as a kernel's `src_rows` argument (with [`SRC_LAST_ROWS`] for a last-rows source).
fn src_rows_arg(rows: u32, last_rows: bool) -> u32 {
    debug_assert!(rows < SRC_LAST_ROWS, "{rows} source rows");
    if last_rows {
        rows | SRC_LAST_ROWS
    } else {
        rows
    }
}

/// One capture of `ringscope_capture_many` (`struct Entry`).
#[derive(Debug, Clone, Copy)]
pub(super) struct CaptureEntry {
    pub src: u64,
    pub hookpoint: u32,
    pub dtype: u32,
    pub row_bytes: u32,
    pub src_rows: u32,
    /// The source holds the step's last row per request, in order ([`SRC_LAST_ROWS`]).
    pub last_rows: bool,
}

/// The `ringscope_capture_many` parameter (`struct Many`), as its bytes.
pub(super) struct ManyParam([u8; many::BYTES]);

impl ManyParam {
    /// The parameter for `entries` (at most [`MAX_MANY`]).
    pub(super) fn new(graph_batch: GraphBatchParam, entries: &[CaptureEntry], full_mode: bool) -> ManyParam {
        assert!(entries.len() <= MAX_MANY, "{} deferred captures, at most {MAX_MANY} per kernel", entries.len());
        let mut p = [0u8; many::BYTES];
        p[many::GRAPH_BATCH..many::GRAPH_BATCH + graph_batch::BYTES].copy_from_slice(&graph_batch);
        p[many::N..many::N + 4].copy_from_slice(&(entries.len() as u32).to_le_bytes());
        p[many::FULL_MODE..many::FULL_MODE + 4].copy_from_slice(&(full_mode as u32).to_le_bytes());
        for (i, e) in entries.iter().enumerate() {
            let o = many::ENTRIES + i * entry::BYTES;
            p[o + entry::SRC..o + entry::SRC + 8].copy_from_slice(&e.src.to_le_bytes());
            p[o + entry::HOOKPOINT..o + entry::HOOKPOINT + 4].copy_from_slice(&e.hookpoint.to_le_bytes());
            p[o + entry::DTYPE..o + entry::DTYPE + 4].copy_from_slice(&e.dtype.to_le_bytes());
            p[o + entry::ROW_BYTES..o + entry::ROW_BYTES + 4].copy_from_slice(&e.row_bytes.to_le_bytes());
            let rows = src_rows_arg(e.src_rows, e.last_rows);
            p[o + entry::SRC_ROWS..o + entry::SRC_ROWS + 4].copy_from_slice(&rows.to_le_bytes());
        }
        ManyParam(p)
    }
}

/// The `ringscope_probe_scores_many` parameter (`struct ProbeMany`), as its bytes.
pub(super) struct ProbeManyParam([u8; probe_many::BYTES]);

impl ProbeManyParam {
    /// The parameter for `probes` (at most [`MAX_PROBE_MANY`], sharing one control table and descriptor).
    pub(super) fn new(graph_batch: GraphBatchParam, probes: &[ProbeArgs]) -> ProbeManyParam {
        assert!(
            probes.len() <= MAX_PROBE_MANY,
            "{} deferred probes, at most {MAX_PROBE_MANY} per kernel",
            probes.len()
        );
        let mut p = [0u8; probe_many::BYTES];
        p[probe_many::GRAPH_BATCH..probe_many::GRAPH_BATCH + graph_batch::BYTES].copy_from_slice(&graph_batch);
        p[probe_many::N..probe_many::N + 4].copy_from_slice(&(probes.len() as u32).to_le_bytes());
        for (i, a) in probes.iter().enumerate() {
            let o = probe_many::ENTRIES + i * probe_entry::BYTES;
            let mut put = |at: usize, bytes: &[u8]| p[o + at..o + at + bytes.len()].copy_from_slice(bytes);
            put(probe_entry::SRC, &a.src.to_le_bytes());
            put(probe_entry::WEIGHTS, &a.weights.to_le_bytes());
            put(probe_entry::BIAS, &a.bias.to_le_bytes());
            put(probe_entry::SCORES, &a.scores.to_le_bytes());
            put(probe_entry::THRESHOLDS, &a.thresholds.to_le_bytes());
            put(probe_entry::FLAGS, &a.flags.to_le_bytes());
            put(probe_entry::SRC_ROWS, &src_rows_arg(a.src_rows, a.last_rows).to_le_bytes());
            put(probe_entry::DTYPE, &a.dtype.to_le_bytes());
            put(probe_entry::WIDTH, &a.width.to_le_bytes());
            put(probe_entry::OUTPUTS, &a.outputs.to_le_bytes());
            put(probe_entry::HOOKPOINT, &a.hookpoint.to_le_bytes());
            put(probe_entry::FLAG_SLOTS, &a.flag_slots.to_le_bytes());
        }
        ProbeManyParam(p)
    }
}

/// The arguments both capture kernels start with: ring, capacity, state block, host block, control table,
/// counters, descriptor.
#[derive(Debug, Clone, Copy)]
pub(super) struct CaptureTables {
    pub ring: RingAddrs,
    pub controls: u64,
    pub counters: u64,
    pub desc: u64,
}

impl CaptureTables {
    fn args(&self) -> [u64; 7] {
        let a = self.ring;
        [a.buf, a.capacity, a.state, a.host, self.controls, self.counters, self.desc]
    }
}

/// One capture of `ringscope_capture`: hookpoint, dtype code, row bytes, source address, source rows.
#[derive(Debug, Clone, Copy)]
pub(super) struct CaptureArgs {
    pub hookpoint: u32,
    pub dtype: u32,
    pub row_bytes: u32,
    pub src: u64,
    pub src_rows: u32,
    /// The source holds the step's last row per request, in order ([`SRC_LAST_ROWS`]).
    pub last_rows: bool,
    pub full_mode: bool,
}

/// One launch of `ringscope_probe_scores`: the source rows, the probe's tables, and what tells the kernel the
/// step's rows and their requests (the scores hookpoint's controls, the descriptor or the graph batch).
#[derive(Debug, Clone, Copy)]
pub(super) struct ProbeArgs {
    pub src: u64,
    pub src_rows: u32,
    /// The source holds the step's last row per request, in order ([`SRC_LAST_ROWS`]): so do the scores.
    pub last_rows: bool,
    pub dtype: u32,
    /// Elements per source row.
    pub width: u32,
    /// Device `f32[outputs × width]`, row-major.
    pub weights: u64,
    /// Device `f32[outputs]`.
    pub bias: u64,
    pub outputs: u32,
    /// Device `f32[max_rows × outputs]`.
    pub scores: u64,
    /// The control table and the scores hookpoint's id (its valid-rows scalar bounds the rows, as for its capture).
    pub controls: u64,
    pub hookpoint: u32,
    pub desc: u64,
    pub graph_batch: GraphBatchParam,
    /// Device `f32[outputs]`, or 0.
    pub thresholds: u64,
    /// Mapped `u64[flag_slots]`, or 0.
    pub flags: u64,
    pub flag_slots: u32,
}

/// The compiled kernels, loaded into one device's context.
pub(super) struct Kernels {
    capture: Function,
    begin: Function,
    begin_graph: Function,
    refresh_tail: Function,
    capture_many: Function,
    probe: Function,
    probe_many: Function,
    fill: Function,
    #[cfg_attr(not(feature = "bench-internals"), allow(dead_code))]
    discard: Function,
}

impl Kernels {
    /// The kernels on `gpu`: compiled once per process per architecture, loaded once per device.
    pub(super) fn get(gpu: &Arc<Gpu>) -> Result<Arc<Kernels>, CudaError> {
        static PTX: OnceLock<Mutex<HashMap<String, Arc<String>>>> = OnceLock::new();
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        let mut loaded = LOADED.get_or_init(Default::default).lock();
        if let Some(k) = loaded.get(&gpu.ordinal()) {
            return Ok(k.clone());
        }
        let arch = gpu.arch();
        let ptx = {
            let mut cache = PTX.get_or_init(Default::default).lock();
            match cache.get(&arch) {
                Some(p) => p.clone(),
                None => {
                    let p = Arc::new(compile_ptx(&arch)?);
                    cache.insert(arch, p.clone());
                    p
                }
            }
        };
        // The kernels live for the process: the cache keeps the module loaded.
        let module = Module::load_ptx(gpu, &ptx)?;
        let k = Arc::new(Kernels {
            capture: module.function("ringscope_capture")?,
            begin: module.function("ringscope_begin_step")?,
            begin_graph: module.function("ringscope_begin_step_graph")?,
            refresh_tail: module.function("ringscope_refresh_tail_snap")?,
            capture_many: module.function("ringscope_capture_many")?,
            probe: module.function("ringscope_probe_scores")?,
            probe_many: module.function("ringscope_probe_scores_many")?,
            fill: module.function("ringscope_fill_pattern")?,
            discard: module.function("ringscope_discard_all")?,
        });
        loaded.insert(gpu.ordinal(), k.clone());
        Ok(k)
    }

    /// Launches `ringscope_capture(ring, capacity, state, host, controls, counters, desc, hookpoint, dtype,
    /// row_bytes, src, src_rows, full_mode)` with `grid` blocks.
    ///
    /// # Safety
    /// Every address in `tables` and `args.src` stays valid until the kernel — and every replay of a graph it is
    /// recorded into — has run; `args.src` holds `src_rows × row_bytes` readable bytes.
    pub(super) unsafe fn capture(
        &self,
        stream: &StreamRef,
        grid: u32,
        tables: &CaptureTables,
        args: CaptureArgs,
    ) -> Result<(), CudaError> {
        let mut common = tables.args();
        let CaptureArgs { mut hookpoint, mut dtype, mut row_bytes, mut src, src_rows, last_rows, full_mode } = args;
        let mut src_rows = src_rows_arg(src_rows, last_rows);
        let mut full = full_mode as u32;
        let mut params: Vec<*mut c_void> = common.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        params.extend([
            (&mut hookpoint as *mut u32).cast(),
            (&mut dtype as *mut u32).cast(),
            (&mut row_bytes as *mut u32).cast(),
            (&mut src as *mut u64).cast(),
            (&mut src_rows as *mut u32).cast(),
            (&mut full as *mut u32).cast(),
        ]);
        // SAFETY: the parameter list matches `ringscope_capture` in number, order and size; the addresses are valid
        // per the caller.
        unsafe { self.capture.launch(grid, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_capture_many(ring, capacity, state, host, controls, counters, desc, Many)` with `grid`
    /// blocks.
    ///
    /// # Safety
    /// Every address in `tables` and every entry's source stays valid until the kernel — and every replay of a graph
    /// it is recorded into — has run; each source holds `src_rows × row_bytes` readable bytes; a graph batch in the
    /// parameter points at valid device tensors for the same time.
    pub(super) unsafe fn capture_many(
        &self,
        stream: &StreamRef,
        grid: u32,
        tables: &CaptureTables,
        many: &mut ManyParam,
    ) -> Result<(), CudaError> {
        let mut common = tables.args();
        let mut params: Vec<*mut c_void> = common.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // The `Many` struct is passed by value as its bytes, laid out as in `capture.cu` (checked by
        // `layout_checks`).
        params.push(many.0.as_mut_ptr().cast());
        // SAFETY: the parameter list matches `ringscope_capture_many`; the addresses are valid per the caller.
        unsafe { self.capture_many.launch(grid, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_probe_scores(src, src_rows, dtype, d, w, bias, k, out, controls, hookpoint, desc,
    /// GraphBatch, thresholds, flags, flag_slots)` with `grid` blocks.
    ///
    /// # Safety
    /// Every address in `args` stays valid until the kernel — and every replay of a graph it is recorded into — has
    /// run: `src` holds `src_rows × width` readable elements of `dtype`; `weights`, `bias` and (unless 0)
    /// `thresholds` hold the probe's `f32`s; `scores` holds `src_rows × outputs` writable `f32`s that nothing else
    /// uses meanwhile; `flags` (unless 0) holds `flag_slots` writable `u64`s; `controls`, `desc` and a graph batch
    /// in the parameter are the capture side's tables and the engine's checked tensors.
    pub(super) unsafe fn probe_scores(&self, stream: &StreamRef, grid: u32, args: ProbeArgs) -> Result<(), CudaError> {
        let ProbeArgs {
            mut src,
            src_rows,
            last_rows,
            mut dtype,
            mut width,
            mut weights,
            mut bias,
            mut outputs,
            mut scores,
            mut controls,
            mut hookpoint,
            mut desc,
            mut graph_batch,
            mut thresholds,
            mut flags,
            mut flag_slots,
        } = args;
        let mut src_rows = src_rows_arg(src_rows, last_rows);
        let mut params: [*mut c_void; 15] = [
            (&mut src as *mut u64).cast(),
            (&mut src_rows as *mut u32).cast(),
            (&mut dtype as *mut u32).cast(),
            (&mut width as *mut u32).cast(),
            (&mut weights as *mut u64).cast(),
            (&mut bias as *mut u64).cast(),
            (&mut outputs as *mut u32).cast(),
            (&mut scores as *mut u64).cast(),
            (&mut controls as *mut u64).cast(),
            (&mut hookpoint as *mut u32).cast(),
            (&mut desc as *mut u64).cast(),
            graph_batch.as_mut_ptr().cast(),
            (&mut thresholds as *mut u64).cast(),
            (&mut flags as *mut u64).cast(),
            (&mut flag_slots as *mut u32).cast(),
        ];
        // SAFETY: the parameter list matches `ringscope_probe_scores` in number, order and size (the `GraphBatch`
        // struct as its bytes, checked by `layout_checks`); the addresses are valid per the caller.
        unsafe { self.probe.launch(grid, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_probe_scores_many(controls, desc, ProbeMany)` with `grid` blocks (a multiple of the
    /// number of probes: block `b` scores rows of probe `b % n`).
    ///
    /// # Safety
    /// As for [`probe_scores`](Self::probe_scores), for every probe in `many`; `controls` and `desc` are the capture
    /// side's control table and descriptor home.
    pub(super) unsafe fn probe_scores_many(
        &self,
        stream: &StreamRef,
        grid: u32,
        controls: u64,
        desc: u64,
        many: &mut ProbeManyParam,
    ) -> Result<(), CudaError> {
        let (mut controls, mut desc) = (controls, desc);
        let mut params: [*mut c_void; 3] =
            [(&mut controls as *mut u64).cast(), (&mut desc as *mut u64).cast(), many.0.as_mut_ptr().cast()];
        // SAFETY: the parameter list matches `ringscope_probe_scores_many` (the `ProbeMany` struct as its bytes,
        // laid out as in `probe.cu`, checked by `layout_checks`); the addresses are valid per the caller.
        unsafe { self.probe_many.launch(grid, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_begin_step(state, host, desc, slot, desc_bytes, begin_index)` with `grid` blocks.
    ///
    /// # Safety
    /// `state`, `host` and `desc` are the ring's state block, its mapped host block and the descriptor's device
    /// home; `slot` holds `desc_bytes` readable bytes (a multiple of 16) that nobody writes until the kernel has run.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn begin_step(
        &self,
        stream: &StreamRef,
        grid: u32,
        mut state: u64,
        mut host: u64,
        mut desc: u64,
        mut slot: u64,
        mut desc_bytes: u32,
        mut begin_index: u64,
    ) -> Result<(), CudaError> {
        let mut params: [*mut c_void; 6] = [
            (&mut state as *mut u64).cast(),
            (&mut host as *mut u64).cast(),
            (&mut desc as *mut u64).cast(),
            (&mut slot as *mut u64).cast(),
            (&mut desc_bytes as *mut u32).cast(),
            (&mut begin_index as *mut u64).cast(),
        ];
        // SAFETY: the parameter list matches `ringscope_begin_step`; the addresses are valid per the caller.
        unsafe { self.begin.launch(grid, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_begin_step_graph(state, host, desc, GraphBatch)` with one block.
    ///
    /// # Safety
    /// `state`, `host` and `desc` are the ring's state block, its mapped host block and the descriptor's device
    /// home; the batch's tensors stay valid until the kernel — and every replay of a graph it is recorded into — has
    /// run.
    pub(super) unsafe fn begin_step_graph(
        &self,
        stream: &StreamRef,
        mut state: u64,
        mut host: u64,
        mut desc: u64,
        mut batch: GraphBatchParam,
    ) -> Result<(), CudaError> {
        let mut params: [*mut c_void; 4] = [
            (&mut state as *mut u64).cast(),
            (&mut host as *mut u64).cast(),
            (&mut desc as *mut u64).cast(),
            batch.as_mut_ptr().cast(),
        ];
        // SAFETY: the parameter list matches `ringscope_begin_step_graph` (the struct as its bytes); the
        // addresses are valid per the caller.
        unsafe { self.begin_graph.launch(1, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_refresh_tail_snap(state, host)` with one thread.
    ///
    /// # Safety
    /// `state` and `host` are a ring's state block and its mapped host block, alive until the kernel has run; no
    /// capture kernel of the ring runs concurrently (captures and this launch share one stream).
    pub(super) unsafe fn refresh_tail_snap(
        &self,
        stream: &StreamRef,
        mut state: u64,
        mut host: u64,
    ) -> Result<(), CudaError> {
        let mut params: [*mut c_void; 2] = [(&mut state as *mut u64).cast(), (&mut host as *mut u64).cast()];
        // SAFETY: the parameter list matches `ringscope_refresh_tail_snap`; the addresses are valid per the caller.
        unsafe { self.refresh_tail.launch(1, 1, stream, &mut params) }
    }

    /// Launches `ringscope_fill_pattern(u32* dst, u64 words, u64 seed)` with `grid` blocks.
    ///
    /// # Safety
    /// `dst` holds `words` writable `u32`s that nothing else uses until the kernel has run.
    pub(super) unsafe fn fill_pattern(
        &self,
        stream: &StreamRef,
        grid: u32,
        mut dst: u64,
        mut words: u64,
        mut seed: u64,
    ) -> Result<(), CudaError> {
        let mut params: [*mut c_void; 3] =
            [(&mut dst as *mut u64).cast(), (&mut words as *mut u64).cast(), (&mut seed as *mut u64).cast()];
        // SAFETY: the parameter list matches `ringscope_fill_pattern`; `dst` is valid per the caller.
        unsafe { self.fill.launch(grid, THREADS, stream, &mut params) }
    }

    /// Launches `ringscope_discard_all(u8* state)` with one block.
    ///
    /// # Safety
    /// `state` is a ring's device state block, alive until the kernel has run.
    #[cfg(feature = "bench-internals")]
    pub(super) unsafe fn discard_all(&self, stream: &StreamRef, mut state: u64) -> Result<(), CudaError> {
        let mut params: [*mut c_void; 1] = [(&mut state as *mut u64).cast()];
        // SAFETY: the parameter list matches `ringscope_discard_all`; `state` is valid per the caller.
        unsafe { self.discard.launch(1, THREADS, stream, &mut params) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defines(text: &str) -> HashMap<String, String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("#define "))
            .filter_map(|l| l.split_once(' '))
            .map(|(name, value)| (name.to_string(), value.trim().to_string()))
            .collect()
    }

    /// The generated prelude names every shared constant with its Rust value (and the C type the kernels'
    /// arithmetic was written for).
    #[test]
    fn the_prelude_defines_every_shared_constant_with_the_rust_value() {
        let d = defines(&prelude());
        let expect = |name: &str, value: u64, suffix: &str| {
            let got = d.get(name).unwrap_or_else(|| panic!("{name} is missing from the prelude"));
            assert_eq!(got, &format!("{value:#x}{suffix}"), "{name}");
        };
        expect("ST_HEAD", state::HEAD as u64, "");
        expect("ST_SEQ", state::SEQ as u64, "");
        expect("ST_TAIL", state::TAIL as u64, "");
        expect("ST_TAIL_SNAP", state::TAIL_SNAP as u64, "");
        expect("ST_DONE_BLOCKS", state::DONE_BLOCKS as u64, "");
        expect("ST_BEGIN_DONE", state::BEGIN_DONE as u64, "");
        expect("ST_BUSY", state::BUSY as u64, "");
        expect("ST_NEXT_STEP", state::NEXT_STEP as u64, "");
        expect("ST_GRAPH_BEGUN", state::GRAPH_BEGUN as u64, "");
        expect("ST_GRAPH_FLAGS", state::GRAPH_FLAGS as u64, "");
        expect("HS_HEAD", host::HEAD as u64, "");
        expect("HS_PROGRESS", host::PROGRESS as u64, "");
        expect("HS_ERRORS", host::ERRORS as u64, "");
        expect("HS_GRAPH_BEGUN", host::GRAPH_BEGUN as u64, "");
        expect("HS_TAIL_SNAP", host::TAIL_SNAP as u64, "");
        expect("ERR_CONCURRENT_PRODUCERS", errors::CONCURRENT_PRODUCERS as u64, "u");
        expect("ERR_FULL_MODE_OVERRUN", errors::FULL_MODE_OVERRUN as u64, "u");
        expect("RECORD_ALIGN_MASK", RECORD_ALIGN as u64 - 1, "ull");
        expect("HEADER_BYTES", HEADER_LEN as u64, "ull");
        expect("META_BYTES", ROW_META_LEN as u64, "ull");
        // "RSR1", version 1, header length 64: the first word of every header the host encoder writes.
        let first_word = {
            let h = ringscope_ring::RecordHeader::pad(64).encode();
            u64::from_le_bytes(h[0..8].try_into().unwrap())
        };
        expect("MAGIC_VERSION_LEN", first_word, "ull");
        expect("KIND_DATA", RecordKind::Data as u64, "ull");
        expect("DTYPE_PAD", DType::U8.code() as u64, "ull");
        expect("FLAG_ROW_SELECTION", record::flags::ROW_SELECTION as u64, "ull");
        expect("DTYPE_F32", DType::F32.code() as u64, "u");
        expect("DTYPE_F16", DType::F16.code() as u64, "u");
        expect("DTYPE_BF16", DType::BF16.code() as u64, "u");
        expect("DTYPE_ROWSCALED", DType::F8E4M3RowScaled.code() as u64, "u");
        expect("SCALE_BYTES", rowscaled::SCALE_BYTES as u64, "u");
        expect("HEADER_CHECK_SEED", HEADER_CHECK_SEED, "ull");
        expect("HEADER_CHECK_MUL", HEADER_CHECK_MUL, "ull");
        expect("HEADER_CHECK_SHIFT", HEADER_CHECK_SHIFT as u64, "");
        expect("DESC_HEADER_BYTES", desc::HEADER_BYTES as u64, "ull");
        expect("DESC_STEP", desc::STEP as u64, "");
        expect("DESC_N_ROWS", desc::N_ROWS as u64, "");
        expect("DESC_N_LAST", desc::N_LAST as u64, "");
        expect("DESC_BEGIN_INDEX", desc::BEGIN_INDEX as u64, "");
        expect("DESC_FLAGS", desc::FLAGS as u64, "");
        expect("DESC_DEADLINE", desc::DEADLINE as u64, "u");
        expect("DESC_KEPT", desc::KEPT as u64, "u");
        expect("KEEP_ALL", KEEP_ALL as u64, "u");
        expect("CONTROL_BYTES", CONTROL_BYTES as u64, "");
        expect("ROW_ALL", RowMode::All as u64, "");
        expect("ROW_LIST", RowMode::List as u64, "");
        expect("ROW_LAST_PER_REQUEST", RowMode::LastPerRequest as u64, "");
        expect("NO_REQUEST", RowMeta::NO_REQUEST, "ull");
        expect("SRC_LAST_ROWS", SRC_LAST_ROWS as u64, "u");
        expect("COUNTER_WORDS", COUNTER_WORDS as u64, "ull");
        for (name, w) in [
            ("PRODUCED", counter::PRODUCED),
            ("SAMPLED", counter::SAMPLED),
            ("PUBLISHED", counter::PUBLISHED),
            ("FULL", counter::FULL),
            ("TOO_LARGE", counter::TOO_LARGE),
            ("DEADLINE", counter::DEADLINE),
        ] {
            expect(&format!("C_{name}_REC"), w as u64, "");
            expect(&format!("C_{name}_ROWS"), w as u64 + 1, "");
        }
        expect("THREADS", THREADS as u64, "");
        expect("MAX_MANY", MAX_MANY as u64, "");
        expect("GRAPH_BATCH_BYTES", graph_batch::BYTES as u64, "");
        expect("ENTRY_BYTES", entry::BYTES as u64, "");
        expect("MANY_BYTES", many::BYTES as u64, "");
        expect("GB_OFF", GraphRole::Off as u64, "");
        expect("GB_FIRST", GraphRole::First as u64, "");
        expect("GB_LATER", GraphRole::Later as u64, "");
        expect("PATTERN_GOLDEN", PATTERN_GOLDEN, "ull");
        expect("PATTERN_MIX", PATTERN_MIX, "ull");
        expect("PROBE_MAX_K", MAX_PROBE_OUTPUTS as u64, "");
        expect("PROBE_CHUNK", PROBE_CHUNK as u64, "");
        assert_eq!(d.len(), shared_constants().len(), "every generated constant is checked above");
    }

    /// `capture.cu` takes every shared number from the prelude: it defines none of them itself, and its only own
    /// macro is a loop-unrolling factor.
    #[test]
    fn capture_cu_defines_none_of_the_shared_constants() {
        let own = defines(KERNEL_SOURCE);
        for (name, _, _) in shared_constants() {
            assert!(!own.contains_key(name), "capture.cu defines {name} itself: take it from the generated prelude");
        }
        let names: Vec<_> = own.keys().collect();
        assert_eq!(names, ["UNROLL"], "capture.cu's own #defines");
        // Bare numbers the prelude now owns must not creep back in either.
        for literal in ["63ull", "0x9E3779B97F4A7C15ull", "0x5253523168656164ull", "16ull * hookpoint"] {
            assert!(!KERNEL_SOURCE.contains(literal), "capture.cu spells out {literal}");
        }
    }

    /// `probe.cu` takes its limits and every layout number from the prelude too: it defines no macro of its own.
    #[test]
    fn probe_cu_defines_nothing_itself() {
        let own = defines(PROBE_SOURCE);
        assert!(own.is_empty(), "probe.cu's own #defines: {:?}", own.keys().collect::<Vec<_>>());
        assert!(PROBE_SOURCE.contains("PROBE_CHUNK") && PROBE_SOURCE.contains("DESC_HEADER_BYTES"));
        let source = kernel_source();
        let (capture_at, probe_at) = (source.find(KERNEL_SOURCE).unwrap(), source.find(PROBE_SOURCE).unwrap());
        assert!(capture_at < probe_at, "probe.cu uses capture.cu's structs: it must come after it");
    }

    /// The layout checks cover every struct the host encodes for the kernels.
    #[test]
    fn layout_checks_name_every_shared_struct() {
        let checks = layout_checks();
        for s in ["sizeof(Control)", "sizeof(GraphBatch)", "sizeof(Entry)", "sizeof(Many)"] {
            assert!(checks.contains(&format!("static_assert({s} == ")), "{s}");
        }
        assert_eq!(size_of::<DeviceControl>(), CONTROL_BYTES);
        assert!(kernel_source().starts_with(&prelude()));
        assert!(kernel_source().ends_with(&checks));
    }

    /// Compiles the kernels wherever NVRTC is installed (CI installs it from PyPI); no GPU needed. The generated
    /// layout checks make this fail when the kernels' structs and the Rust encoders disagree.
    #[test]
    fn kernels_compile_with_nvrtc() {
        match compile_ptx("sm_90") {
            Ok(ptx) => {
                for f in [
                    "ringscope_capture",
                    "ringscope_begin_step",
                    "ringscope_begin_step_graph",
                    "ringscope_capture_many",
                    "ringscope_probe_scores",
                    "ringscope_fill_pattern",
                    "ringscope_discard_all",
                ] {
                    assert!(ptx.contains(&format!(".entry {f}")), "{f} missing from the PTX");
                }
            }
            Err(CudaError::NoNvrtc) if std::env::var_os("RINGSCOPE_REQUIRE_NVRTC").is_none() => {
                eprintln!("skipped: NVRTC is not installed (set RINGSCOPE_REQUIRE_NVRTC=1 to make this a failure)")
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// A kernel source whose struct disagrees with the Rust encoder does not compile.
    #[test]
    fn a_layout_mismatch_fails_to_compile() {
        let broken = format!(
            "{}\n{}{}",
            prelude(),
            KERNEL_SOURCE.replacen("u32 list_len;", "u64 list_len;", 1),
            layout_checks()
        );
        match ringscope_ring::cuda::compile_ptx(&broken, "sm_90", &["--std=c++17"]) {
            Ok(_) => panic!("a Control with a u64 list_len compiled"),
            Err(CudaError::NoNvrtc) if std::env::var_os("RINGSCOPE_REQUIRE_NVRTC").is_none() => {
                eprintln!("skipped: NVRTC is not installed")
            }
            Err(CudaError::Compile(msg)) => assert!(msg.contains("differs from the Rust encoder"), "{msg}"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn pattern_is_deterministic_and_seeded() {
        assert_eq!(pattern_word(1, 2), pattern_word(1, 2));
        assert_ne!(pattern_word(1, 2), pattern_word(2, 2));
        assert_ne!(pattern_word(1, 2), pattern_word(1, 3));
    }

    #[test]
    fn many_param_places_entries_as_the_kernel_reads_them() {
        let e = CaptureEntry {
            src: 0x1122_3344_5566_7788,
            hookpoint: 7,
            dtype: 3,
            row_bytes: 4096,
            src_rows: 9,
            last_rows: false,
        };
        let last = CaptureEntry { last_rows: true, ..e };
        let p = ManyParam::new(GraphBatch::param(None, GraphRole::Off), &[e, last], true);
        assert_eq!(&p.0[120..128], &[2, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(&p.0[128..136], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&p.0[136..140], &7u32.to_le_bytes());
        let at = |i: usize| many::ENTRIES + i * entry::BYTES + entry::SRC_ROWS;
        let rows = |i: usize| &p.0[at(i)..at(i) + 4];
        assert_eq!(rows(0), &9u32.to_le_bytes());
        assert_eq!(rows(1), &(9 | SRC_LAST_ROWS).to_le_bytes(), "a last-rows source is marked in its row count");
        assert_eq!(p.0.len(), 128 + 48 * 24);
    }

    #[test]
    fn graph_batch_param_carries_the_ended_rows_as_the_kernels_read_them() {
        // SAFETY: never dereferenced (only encoded).
        let (req, pos, tok) =
            unsafe { (DevicePtr::from_raw(0x1000), DevicePtr::from_raw(0x2000), DevicePtr::from_raw(0x3000)) };
        let plain = GraphBatch {
            batch: 3,
            seq: 1,
            request_ids: req,
            positions: pos,
            positions_batch_stride: 1,
            ended: None,
            kept: None,
        };
        let p = GraphBatch::param(Some(&plain), GraphRole::First);
        assert_eq!(&p[0..8], &0x1000u64.to_le_bytes());
        assert_eq!(&p[8..16], &0x2000u64.to_le_bytes());
        assert_eq!(&p[16..32], &[3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]);
        assert!(p[32..].iter().all(|&b| b == 0), "no ended rows: no token tensor, no ids");
        let ended = EndedRows::new(tok, 2, &[2, -7, 128_009]).unwrap();
        assert_eq!(ended.ids(), &[2, -7, 128_009]);
        let p = GraphBatch::param(Some(&GraphBatch { ended: Some(ended), ..plain }), GraphRole::Later);
        assert_eq!(&p[28..32], &2u32.to_le_bytes());
        assert_eq!(&p[32..40], &0x3000u64.to_le_bytes());
        assert_eq!(&p[40..44], &2u32.to_le_bytes());
        assert_eq!(&p[44..48], &3u32.to_le_bytes());
        assert_eq!(&p[48..56], &2i64.to_le_bytes());
        assert_eq!(&p[56..64], &(-7i64).to_le_bytes());
        assert_eq!(&p[64..72], &128_009i64.to_le_bytes());
        assert!(p[72..].iter().all(|&b| b == 0));
        assert_eq!(p.len(), 120);
        // SAFETY: never dereferenced.
        let kept = unsafe { DevicePtr::from_raw(0x4000) };
        let p = GraphBatch::param(Some(&GraphBatch { kept: Some(kept), ..plain }), GraphRole::First);
        assert_eq!(&p[112..120], &0x4000u64.to_le_bytes(), "the kept rows' address, where the kernels read it");
        assert!(p[32..112].iter().all(|&b| b == 0));
        assert!(GraphBatch::param(None, GraphRole::Off).iter().all(|&b| b == 0));
    }

    #[test]
    fn ended_rows_take_one_to_eight_ids_and_a_device_pointer() {
        // SAFETY: never dereferenced.
        let tok = unsafe { DevicePtr::from_raw(0x3000) };
        assert!(EndedRows::new(tok, 1, &[]).unwrap_err().contains("0 ended-sequence token ids"));
        assert!(EndedRows::new(tok, 1, &[1; 9]).unwrap_err().contains("9 ended-sequence token ids: give 1 to 8"));
        assert!(EndedRows::new(DevicePtr::NULL, 1, &[1]).unwrap_err().contains("null device pointer"));
        assert_eq!(EndedRows::new(tok, 1, &[5; 8]).unwrap().ids().len(), 8);
    }
}
