// ringscope HookPoint kernels. Compiled once per process with NVRTC for the device's architecture
// (hookpoint/src/cuda/kernels.rs). The record bytes follow docs/format.md exactly.
//
// Every number shared with Rust (ring state and host block offsets, error bits, counter words, descriptor fields,
// record header constants, row-selection modes, MAX_MANY, ...) comes from a prelude of #defines that
// hookpoint/src/cuda/kernels.rs generates from the Rust constants and puts before this file; static_asserts it
// appends after it hold the structs below to the Rust encoders' layout. Do not define those numbers here.
//
// Rules these kernels live by (docs/architecture.md, "The path of a record"):
// * Everything that can change between graph replays is read from device memory at run time: the step
//   descriptor, the per-hookpoint controls, the number of valid rows. Kernel arguments are fixed addresses.
// * No kernel ever waits: a capture that finds the ring full drops its record and counts it.
// * All captures of one ring run in order on one stream; a record is published by the last block of its kernel
//   to finish, after a system-scope fence, so the host never sees a torn record.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

// Per-hookpoint control, CONTROL_BYTES (hookpoint/src/cuda/controls.rs `DeviceControl`).
struct Control {
    u32 enabled;
    u32 every_n;
    u32 mode;  // ROW_ALL, ROW_LIST (explicit list) or ROW_LAST_PER_REQUEST
    u32 list_len;
    u64 list_ptr;        // device u32[list_len] for ROW_LIST
    u64 valid_rows_ptr;  // device u32 scalar: rows past it are padding (0 = none)
    u32 downcast;        // 1: write bf16 / f16 / f32 rows as row-scaled FP8 E4M3 (DTYPE_ROWSCALED)
    u32 reserved0;
    u64 reserved[3];
};

// Per-hookpoint counters: COUNTER_WORDS x u64, a (records, rows) pair per C_*_REC / C_*_ROWS
// (hookpoint/src/cuda/counters.rs).

// Step descriptor (hookpoint/src/cuda/slots.rs `desc`): a DESC_HEADER_BYTES header {u64 step; u32 n_rows;
// u32 n_last; u64 begin_index; u32 flags} at DESC_* offsets, then RowMeta[n_rows] (META_BYTES each), then
// u32 last_row[n_last] (batch row of each request's last token, ascending). Flag DESC_DEADLINE: full mode,
// begin_step found no room in time; drop and count this step's captures.
// Records: HEADER_BYTES header starting with MAGIC_VERSION_LEN ("RSR1", version, header length), RECORD_ALIGN
// alignment (RECORD_ALIGN_MASK = alignment - 1); pads carry dtype DTYPE_PAD (u8), as the host encoder writes them.

#define UNROLL 4

__device__ __forceinline__ u64 ld64(const u8* p) { return *(const volatile u64*)p; }
__device__ __forceinline__ void st64(u8* p, u64 v) { *(volatile u64*)p = v; }

__device__ void write_header(u8* at, u64 w1, u64 w2, u64 w3, u64 w4, u64 w5) {
    u64 w[8] = {MAGIC_VERSION_LEN, w1, w2, w3, w4, w5, 0ull, 0ull};
    u64 acc = HEADER_CHECK_SEED;  // "RSR1head"
#pragma unroll
    for (int i = 0; i < 7; i++) {
        acc ^= w[i];
        acc *= HEADER_CHECK_MUL;
        acc ^= acc >> HEADER_CHECK_SHIFT;
    }
    w[7] = acc;
    ulonglong2* dst = (ulonglong2*)at;
#pragma unroll
    for (int i = 0; i < 4; i++) dst[i] = make_ulonglong2(w[2 * i], w[2 * i + 1]);
}

// --- Downcast rows (ringscope_ring::rowscaled; docs/format.md, dtype f8e4m3_rowscaled) -----------------------------
// A row of w elements becomes SCALE_BYTES + w bytes: the f32 scale (amax over finite elements / 448, or 1 when that
// is not positive), then each element / scale (IEEE division) as OCP E4M3, round to nearest even, saturated to
// +-448, NaN -> 0x7F. The arithmetic is the host converter's step for step, so the bytes are identical. 448 (E4M3's
// largest finite value) and 512 (2^9, one over E4M3's smallest subnormal) are properties of E4M3, not ringscope
// constants.

// Whether a capture of `dtype` with these controls writes downcast rows.
__device__ __forceinline__ bool rs_downcasts(const Control& c, u32 dtype) {
    return c.downcast && (dtype == DTYPE_F32 || dtype == DTYPE_F16 || dtype == DTYPE_BF16);
}

__device__ __forceinline__ u32 rs_elem_bytes(u32 dtype) { return dtype == DTYPE_F32 ? 4u : 2u; }

// Bytes of one row as the record holds it.
__device__ __forceinline__ u32 rs_out_row_bytes(bool dc, u32 dtype, u32 row_bytes) {
    return dc ? row_bytes / rs_elem_bytes(dtype) + SCALE_BYTES : row_bytes;
}

// Element i of a source row, exactly as f32.
__device__ __forceinline__ float rs_load(const u8* row, u32 dtype, u32 i) {
    if (dtype == DTYPE_F32) return ((const float*)row)[i];
    const u32 h = ((const unsigned short*)row)[i];
    if (dtype == DTYPE_BF16) return __uint_as_float(h << 16);
    // f16 -> f32, exact (subnormals scaled by 2^-24, which is exact in f32).
    const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return __uint_as_float(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// f32 -> E4M3, round to nearest even, saturating; NaN -> 0x7F (ringscope_ring::rowscaled::f32_to_e4m3).
__device__ __forceinline__ u8 rs_e4m3(float x) {
    const u32 bits = __float_as_uint(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;
    const u8 sign = (u8)((bits >> 24) & 0x80u);
    const float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7E;
    if (a < 0.015625f) return sign | (u8)__float2int_rn(a * 512.0f);
    const u32 ab = bits & 0x7FFFFFFFu;
    const u32 mant = ab & 0x7FFFFFu;
    u32 code = ((((ab >> 23) - 127u) + 7u) << 3) | (mant >> 20);
    const u32 rest = mant & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u))) code++;
    return sign | (u8)code;
}

// One warp downcasts one row of w elements of `dtype` into `out` (SCALE_BYTES + w bytes). Every lane of the warp
// calls it with the same row (the amax is a warp reduction).
__device__ void rs_downcast_row(const u8* row, u32 dtype, u32 w, u8* out) {
    const u32 lane = threadIdx.x & 31u;
    float amax = 0.0f;
    for (u32 i = lane; i < w; i += 32) {
        const float v = fabsf(rs_load(row, dtype, i));
        if (v <= 3.402823466e38f) amax = fmaxf(amax, v);  // finite only (false for NaN and inf)
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    float scale = amax / 448.0f;
    if (!(scale > 0.0f && scale <= 3.402823466e38f)) scale = 1.0f;
    // Rows are row_width + 4 bytes apart, so the scale is not aligned: byte stores, little-endian.
    if (lane < SCALE_BYTES) out[lane] = (u8)(__float_as_uint(scale) >> (8 * lane));
    for (u32 i = lane; i < w; i += 32) out[SCALE_BYTES + i] = rs_e4m3(rs_load(row, dtype, i) / scale);
}

// Writes `rows` downcast rows: row k of the record from source row idx[k] (or k), one warp per row over the grid.
__device__ void rs_downcast_rows(u8* dst, const u8* src, const u32* idx, u32 rows, u32 dtype, u32 row_bytes) {
    const u32 w = row_bytes / rs_elem_bytes(dtype);
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 k = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; k < rows; k += warps)
        rs_downcast_row(src + (u64)(idx ? idx[k] : (u32)k) * row_bytes, dtype, w, dst + k * (w + SCALE_BYTES));
}

__device__ __forceinline__ void set_error(u8* host, u32 bit) {
    volatile u32* e = (volatile u32*)(host + HS_ERRORS);
    *e = *e | bit;
}

extern "C" __global__ void __launch_bounds__(THREADS) ringscope_capture(
    u8* ring, u64 capacity, u8* state, u8* host, const Control* controls, u64* counters, const u8* desc,
    u32 hookpoint, u32 dtype, u32 row_bytes, const u8* __restrict__ src, u32 src_rows, u32 full_mode) {
    __shared__ u32 s_rows;
    // Independent loads first, so their latencies overlap.
    const Control c = controls[hookpoint];
    const u64 step = *(const u64*)(desc + DESC_STEP);
    const u32 n_rows = *(const u32*)(desc + DESC_N_ROWS);
    const u32 n_last = *(const u32*)(desc + DESC_N_LAST);
    const u32 desc_flags = *(const u32*)(desc + DESC_FLAGS);
    const u64 head = ld64(state + ST_HEAD);
    const u64 seq = ld64(state + ST_SEQ);
    const u64 tail = ld64(state + ST_TAIL_SNAP);
    const u64 tail_now = ld64(state + ST_TAIL);
    const bool lead = blockIdx.x == 0 && threadIdx.x == 0;
    // A last-rows source (SRC_LAST_ROWS): its row k is the step's k-th last row per request, captured as that row
    // whatever the hookpoint's selection (the host refuses row lists for it).
    const bool last_rows = (src_rows & SRC_LAST_ROWS) != 0;
    src_rows &= ~SRC_LAST_ROWS;
    // The source is read before the decision, so the data loads overlap the control loads: for all-rows captures
    // (the common case) each thread's first units are the same whatever the number of valid rows turns out to be.
    // (Row selections discard them and read the selected rows.)
    const bool vec = ((((u64)src) | row_bytes) & 15) == 0;
    const u32 vpr = row_bytes / 16;
    uint4 pre[UNROLL];
    int pre_n = 0;
    if (vec) {
        const u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x, gs = (u64)gridDim.x * blockDim.x;
        const u64 avail = (u64)src_rows * vpr;
#pragma unroll
        for (int k = 0; k < UNROLL; k++)
            if (g + k * gs < avail) {
                pre[k] = ((const uint4*)src)[g + k * gs];
                pre_n = k + 1;
            }
    }
    // Concurrent-producer check: two captures of one ring running at once (issued on two streams) would write the
    // same bytes. Block 0 flags the ring busy for the kernel's lifetime; finding it busy is reported to the host.
    u32 was_busy = 0;
    if (lead) was_busy = atomicExch((u32*)(state + ST_BUSY), 1u);

    // Which rows: every block computes the same answer from memory nobody writes while this kernel runs.
    u32 bound = last_rows ? n_rows : min(src_rows, n_rows);
    if (c.valid_rows_ptr) bound = min(bound, *(const u32*)c.valid_rows_ptr);
    // A step that keeps some rows only (DESC_KEPT: its last-row list holds them): all rows are the kept rows.
    const bool kept = (desc_flags & DESC_KEPT) != 0;
    const u32 mode = last_rows || (kept && c.mode == ROW_ALL) ? (u32)ROW_LAST_PER_REQUEST : c.mode;
    const u32* idx = 0;
    u32 rows = bound;
    if (mode != ROW_ALL) {
        idx = mode == ROW_LIST ? (const u32*)c.list_ptr : (const u32*)(desc + DESC_HEADER_BYTES + META_BYTES * n_rows);
        const u32 len = mode == ROW_LIST ? c.list_len : last_rows ? min(n_last, src_rows) : n_last;
        // Rows are taken in list order up to the first index at or past `bound` (padding).
        if (threadIdx.x == 0) s_rows = len;
        __syncthreads();
        for (u32 i = threadIdx.x; i < len; i += blockDim.x)
            if (idx[i] >= bound) atomicMin(&s_rows, i);
        __syncthreads();
        rows = s_rows;
    }
    if (lead && was_busy) set_error(host, ERR_CONCURRENT_PRODUCERS);

    u64* cnt = counters + COUNTER_WORDS * hookpoint;
    const bool sampled = c.enabled && (step % (u64)(c.every_n ? c.every_n : 1)) == 0;
    // Downcast is read here, at run time, like every other control: graph replays follow its changes.
    const bool dc = rs_downcasts(c, dtype);
    const u32 out_rb = rs_out_row_bytes(dc, dtype, row_bytes);
    const u64 meta_bytes = (META_BYTES * rows + RECORD_ALIGN_MASK) & ~RECORD_ALIGN_MASK;
    const u64 payload_len = meta_bytes + (u64)rows * out_rb;
    const u64 footprint = (HEADER_BYTES + payload_len + RECORD_ALIGN_MASK) & ~RECORD_ALIGN_MASK;
    const u64 offset = head % capacity;
    const u64 pad = footprint <= capacity - offset ? 0 : capacity - offset;
    const bool too_large = HEADER_BYTES + payload_len > capacity / 2;
    const bool deadline = (desc_flags & DESC_DEADLINE) != 0;
    const bool full = pad + footprint > capacity - (head - tail);

    if (rows == 0 || !sampled || too_large || deadline || full) {
        // Nothing is written; one thread counts (reductions: no round trip). The tail snapshot is not refreshed
        // here: other blocks may still be reading it.
        if (lead) {
            if (rows > 0) {
                atomicAdd(cnt + C_PRODUCED_REC, 1ull);
                atomicAdd(cnt + C_PRODUCED_ROWS, (u64)rows);
                const int which = !sampled ? C_SAMPLED_REC : too_large ? C_TOO_LARGE_REC
                                  : deadline ? C_DEADLINE_REC : C_FULL_REC;
                atomicAdd(cnt + which, 1ull);
                atomicAdd(cnt + which + 1, (u64)rows);
                if (sampled && !too_large && !deadline && full_mode) set_error(host, ERR_FULL_MODE_OVERRUN);
            }
            *(volatile u32*)(state + ST_BUSY) = 0;
        }
        return;
    }

    const u64 start = pad ? 0 : offset;
    u8* rec = ring + start;
    if (lead) {
        if (pad) write_header(ring + offset, 0, 0, 0, DTYPE_PAD << 40, pad - HEADER_BYTES);
        const u64 flags = (mode != ROW_ALL || rows != n_rows) ? FLAG_ROW_SELECTION : 0;
        const u64 out_dtype = dc ? DTYPE_ROWSCALED : dtype;
        write_header(rec, seq, step, (u64)hookpoint | ((u64)rows << 32),
                     (u64)out_rb | (KIND_DATA << 32) | (out_dtype << 40) | (flags << 48), payload_len);
    }
    // Zeros between the row metadata and the first row.
    if (blockIdx.x == 0) {
        const u64 i = META_BYTES * rows + 16ull * threadIdx.x;
        if (i < meta_bytes) *(uint4*)(rec + HEADER_BYTES + i) = make_uint4(0, 0, 0, 0);
    }

    // Row metadata of the kept rows, then zeros up to the 64-byte boundary.
    const u64 gtid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 gsize = (u64)gridDim.x * blockDim.x;
    const uint4* metas = (const uint4*)(desc + DESC_HEADER_BYTES);
    uint4* meta_dst = (uint4*)(rec + HEADER_BYTES);
    for (u64 i = gtid; i < meta_bytes / 16; i += gsize)
        meta_dst[i] = i < rows ? metas[idx ? idx[i] : i] : make_uint4(0, 0, 0, 0);

    u8* __restrict__ dst = rec + HEADER_BYTES + meta_bytes;
    // The source row of record row k: idx[k] (a selection of batch rows), or k (all rows, or a last-rows source).
    const u32* sidx = last_rows ? 0 : idx;
    if (dc) {
        rs_downcast_rows(dst, src, sidx, rows, dtype, row_bytes);
    } else if (vec) {
        // Flattened over 16-byte units; (row, column) advance by the grid size without a division per unit.
        const u64 total = (u64)rows * vpr;
        const u32 q = (u32)(gsize / vpr), rem = (u32)(gsize % vpr);
        u32 r = (u32)(gtid / vpr), col = (u32)(gtid % vpr);
        uint4* d = (uint4*)dst;
        u64 u = gtid;
        if (pre_n > 0 && sidx == 0) {
            // The units loaded before the decision are exactly this thread's first units.
            for (int k = 0; k < UNROLL && k < pre_n; k++) {
                if (u + k * gsize < total) d[u + k * gsize] = pre[k];
            }
            u += UNROLL * gsize;
            for (int k = 0; k < UNROLL; k++) {
                r += q;
                col += rem;
                if (col >= vpr) { col -= vpr; r++; }
            }
        }
        for (; u < total; u += UNROLL * gsize) {
            uint4 v[UNROLL];
            u32 rr = r, cc = col;
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                if (u + k * gsize < total) {
                    const u64 srow = sidx ? sidx[rr] : rr;
                    v[k] = ((const uint4*)(src + srow * row_bytes))[cc];
                }
                rr += q;
                cc += rem;
                if (cc >= vpr) { cc -= vpr; rr++; }
            }
#pragma unroll
            for (int k = 0; k < UNROLL; k++)
                if (u + k * gsize < total) d[u + k * gsize] = v[k];
            r = rr;
            col = cc;
        }
    } else {
        const u64 total = (u64)rows * row_bytes;
        for (u64 b = gtid; b < total; b += gsize) {
            const u32 r = (u32)(b / row_bytes);
            const u32 col = (u32)(b - (u64)r * row_bytes);
            const u64 srow = sidx ? sidx[r] : r;
            dst[b] = src[srow * row_bytes + col];
        }
    }

    // The last block to finish publishes.
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (gridDim.x > 1) {
        __threadfence();
        if (atomicAdd((u32*)(state + ST_DONE_BLOCKS), 1u) != gridDim.x - 1) return;
        *(volatile u32*)(state + ST_DONE_BLOCKS) = 0;
    }
    const u64 new_head = head + pad + footprint;
    st64(state + ST_HEAD, new_head);
    st64(state + ST_SEQ, seq + 1);
    // Every block has finished reading the snapshot: refresh it for the next capture.
    st64(state + ST_TAIL_SNAP, tail_now);
    // Data, metadata and header reach memory before the host can see the new head.
    __threadfence_system();
    st64(host + HS_HEAD, new_head);
    atomicAdd(cnt + C_PRODUCED_REC, 1ull);
    atomicAdd(cnt + C_PRODUCED_ROWS, (u64)rows);
    atomicAdd(cnt + C_PUBLISHED_REC, 1ull);
    atomicAdd(cnt + C_PUBLISHED_ROWS, (u64)rows);
    *(volatile u32*)(state + ST_BUSY) = 0;
}

// Starts a step: copies the step descriptor from a pinned slot (written by the host before the launch) into its
// fixed device home, refreshes the tail snapshot, and reports progress to the host.
extern "C" __global__ void __launch_bounds__(THREADS) ringscope_begin_step(
    u8* state, u8* host, u8* desc, const u8* slot, u32 desc_bytes, u64 begin_index) {
    const u64 tail_now = ld64(state + ST_TAIL);
    const u32 units = desc_bytes / 16;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < units; i += gridDim.x * blockDim.x)
        ((uint4*)desc)[i] = ((const uint4*)slot)[i];
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (gridDim.x > 1) {
        __threadfence();
        if (atomicAdd((u32*)(state + ST_BEGIN_DONE), 1u) != gridDim.x - 1) return;
        *(volatile u32*)(state + ST_BEGIN_DONE) = 0;
    }
    st64(state + ST_TAIL_SNAP, tail_now);
    // Steps begun inside a graph (ringscope_begin_step_graph) continue from here.
    st64(state + ST_NEXT_STEP, ld64(desc + DESC_STEP) + 1);
    // The slot has been read (the loads completed before the stores above): the host may reuse it.
    __threadfence_system();
    st64(host + HS_PROGRESS, begin_index + 1);
}

// A step's batch from the engine's own device tensors (steps begun inside a graph): row r = b * seq + s is batch
// row b's token s; each batch row is one request, whose last token is its last row.
struct GraphBatch {
    const long long* request_ids;  // [batch]
    const long long* positions;    // token s of batch row b at b * pos_stride + s
    u32 batch;
    u32 seq;
    u32 pos_stride;
    u32 on;  // GB_OFF: the batch is the descriptor's; GB_FIRST: from here, and this kernel numbers the step (the
             // first of the step); GB_LATER: from here, in a step an earlier kernel numbered (a step's captures
             // copied in two parts)
    // Rows of ended sequences (n_ended > 0): batch row b fed one of the tokens ended[0..n_ended) — its token is
    // tokens[b * tokens_stride] — is no request's at this replay: its rows carry NO_REQUEST.
    const long long* tokens;
    u32 tokens_stride;
    u32 n_ended;
    long long ended[MAX_ENDED_TOKENS];
    // The rows the step keeps (null: every row): kept[0] is their number, or KEEP_ALL for every row, then the kept
    // rows ascending (seq 1: batch rows). The others — requests an engine does not capture — are neither captured
    // nor scored: an engine writes this before each replay, as it writes the request ids.
    const u32* kept;
};

// The number of rows a graph batch keeps (KEEP_ALL: every row).
__device__ __forceinline__ u32 graph_kept(const GraphBatch& g) { return g.kept ? g.kept[0] : KEEP_ALL; }

// The request of batch row b of a graph batch (NO_REQUEST for a row of a sequence that ended).
__device__ __forceinline__ u64 graph_request(const GraphBatch& g, u32 b) {
    const u64 req = (u64)g.request_ids[b];
    if (g.n_ended == 0) return req;
    const long long t = g.tokens[(u64)b * g.tokens_stride];
    bool ended = false;
#pragma unroll
    for (int k = 0; k < MAX_ENDED_TOKENS; k++) ended |= k < (int)g.n_ended && t == g.ended[k];
    return ended ? NO_REQUEST : req;
}

__device__ __forceinline__ uint4 graph_meta(const GraphBatch& g, u32 r) {
    const u32 b = r / g.seq, s = r - b * g.seq;
    const u64 req = graph_request(g, b);
    const u32 pos = (u32)g.positions[(u64)b * g.pos_stride + s];
    return make_uint4((u32)req, (u32)(req >> 32), pos, r);
}

// Counts a graph-begun step on the device; returns the new count, for the host (HS_GRAPH_BEGUN). One thread.
__device__ __forceinline__ u64 rs_count_graph_step(u8* state) {
    const u64 begun = ld64(state + ST_GRAPH_BEGUN) + 1;
    st64(state + ST_GRAPH_BEGUN, begun);
    return begun;
}

// A graph-begun step has started: counts it and tells the host (full mode's admission retires the reservations of
// the steps before it: every capture issued before this point has run). One thread, after the step's first work.
__device__ __forceinline__ void rs_graph_step_begun(u8* state, u8* host) {
    const u64 begun = rs_count_graph_step(state);
    __threadfence_system();
    st64(host + HS_GRAPH_BEGUN, begun);
}

// Starts a step from inside a CUDA graph (captures launched one by one): builds the batch descriptor from the
// engine's device tensors, numbers the step one past the previous one, takes the flags the host set for graph
// steps (ST_GRAPH_FLAGS, stream-ordered between replays). One block, no waiting.
extern "C" __global__ void __launch_bounds__(THREADS) ringscope_begin_step_graph(
    u8* state, u8* host, u8* desc, GraphBatch g) {
    const u64 tail_now = ld64(state + ST_TAIL);
    const u64 step = ld64(state + ST_NEXT_STEP);
    const u32 n = g.batch * g.seq;
    for (u32 r = threadIdx.x; r < n; r += blockDim.x) ((uint4*)(desc + DESC_HEADER_BYTES))[r] = graph_meta(g, r);
    // The last-row list: each request's last row — or, when the batch keeps some rows only (seq 1), the kept rows,
    // which then stand for every row of the step (DESC_KEPT).
    const u32 kept = graph_kept(g);
    const u32 n_last = kept == KEEP_ALL ? g.batch : min(kept, g.batch);
    u32* last = (u32*)(desc + DESC_HEADER_BYTES + META_BYTES * n);
    for (u32 b = threadIdx.x; b < n_last; b += blockDim.x)
        last[b] = kept == KEEP_ALL ? b * g.seq + g.seq - 1 : g.kept[1 + b];
    if (threadIdx.x == 0) {
        st64(desc + DESC_STEP, step);
        *(u32*)(desc + DESC_N_ROWS) = n;
        *(u32*)(desc + DESC_N_LAST) = n_last;
        st64(desc + DESC_BEGIN_INDEX, 0);
        *(u32*)(desc + DESC_FLAGS) = (u32)ld64(state + ST_GRAPH_FLAGS) | (kept == KEEP_ALL ? 0u : DESC_KEPT);
        st64(state + ST_NEXT_STEP, step + 1);
        st64(state + ST_TAIL_SNAP, tail_now);
        rs_graph_step_begun(state, host);
    }
}

// Full mode, steps begun inside a graph with deferred captures: the host found room counting what the drain handed
// back, but the tail snapshot the step's capture kernel will decide on is older. Launched on the engine's stream
// before the replay (stream-ordered with every capture), it brings the snapshot up to the drain's position.
extern "C" __global__ void ringscope_refresh_tail_snap(u8* state, u8* host) {
    const u64 tail_now = ld64(state + ST_TAIL);
    st64(state + ST_TAIL_SNAP, tail_now);
    st64(host + HS_TAIL_SNAP, tail_now);
}

// Deferred captures: every capture of a step, copied by one kernel when the step ends (the engine keeps the
// tensors unchanged until then). Same records, same order, same counters as one ringscope_capture per entry.
// At most MAX_MANY entries per kernel.
struct Entry {
    u64 src;
    u32 hookpoint;
    u32 dtype;
    u32 row_bytes;
    u32 src_rows;
};
struct Many {
    GraphBatch g;
    u32 n;
    u32 full_mode;
    Entry e[MAX_MANY];
};
struct Plan {
    u64 start;        // ring offset of the record
    u64 pad;          // bytes of padding before it (at pad_at), 0 if none
    u64 pad_at;
    u64 seq;
    u64 meta_bytes;
    u64 payload_len;
    u64 footprint;
    u64 unit0;        // first data unit (16 bytes, or 1 byte on the byte path) of this entry in the step's copy
    u64 meta0;        // first 16-byte metadata unit
    u32 rows;
    u32 vec;          // 16-byte path
    u32 dc;           // rows are downcast (rs_downcasts)
    u32 orb;          // bytes of a row in the record
    u32 last;         // a last-rows source (SRC_LAST_ROWS): record row k is source row k
    int status;       // -1 published, -2 no rows, else the counter index of the drop reason
};

__device__ __forceinline__ u32 many_row(const Control& c, const u8* desc, u32 n_rows, const GraphBatch& g, u32 k) {
    if (c.mode == ROW_ALL) return k;
    if (c.mode == ROW_LIST) return ((const u32*)c.list_ptr)[k];
    if (g.on) return k * g.seq + g.seq - 1;  // the batch from g: each batch row's last token
    return ((const u32*)(desc + DESC_HEADER_BYTES + META_BYTES * n_rows))[k];
}

// Inclusive sum over the lanes of a warp, in lane order (every lane of the warp calls it).
__device__ __forceinline__ u64 rs_warp_inclusive(u64 v) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(0xFFFFFFFFu, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

// The entry whose range [first[i], first[i + 1]) holds unit u (first[] ascending, first[n] = total).
__device__ __forceinline__ u32 find_entry(const u64* first, u32 n, u64 u) {
    u32 lo = 0, hi = n;  // first[lo] <= u < first[hi]
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (first[mid] <= u) lo = mid; else hi = mid;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(THREADS) ringscope_capture_many(
    u8* ring, u64 capacity, u8* state, u8* host, const Control* controls, u64* counters, const u8* desc, Many m) {
    __shared__ Plan plan[MAX_MANY];
    __shared__ Control ctl[MAX_MANY];
    __shared__ u64 s_unit[MAX_MANY + 1], s_meta[MAX_MANY + 1], s_drow[MAX_MANY + 1];
    __shared__ u32 s_min;
    __shared__ u64 s_head, s_seq;
    const bool lead = blockIdx.x == 0 && threadIdx.x == 0;
    const u32 n = m.n;
    // m.g.on: GB_OFF (0), or the batch comes from m.g.
    const u64 step = m.g.on == GB_FIRST ? ld64(state + ST_NEXT_STEP) : m.g.on ? ld64(state + ST_NEXT_STEP) - 1
                                                                              : *(const u64*)(desc + DESC_STEP);
    const u32 n_rows = m.g.on ? m.g.batch * m.g.seq : *(const u32*)(desc + DESC_N_ROWS);
    const u32 n_last = m.g.on ? m.g.batch : *(const u32*)(desc + DESC_N_LAST);
    const u32 desc_flags = m.g.on ? (u32)ld64(state + ST_GRAPH_FLAGS) : *(const u32*)(desc + DESC_FLAGS);
    const u64 head0 = ld64(state + ST_HEAD);
    const u64 seq0 = ld64(state + ST_SEQ);
    const u64 tail = ld64(state + ST_TAIL_SNAP);
    const u64 tail_now = ld64(state + ST_TAIL);
    // A batch that keeps some rows only: every entry that takes all rows (or each request's last, seq 1) takes them.
    const u32 kept = m.g.on ? graph_kept(m.g) : KEEP_ALL;
    u32 was_busy = 0;
    if (lead) was_busy = atomicExch((u32*)(state + ST_BUSY), 1u);

    // 1. Per entry, one thread each: controls, rows (unless a list has to be scanned), sampling, sizes. (The
    // placement below is one warp's prefix sums, or, when a record wraps or does not fit, one thread's loop.)
    __shared__ u32 s_scan;
    __shared__ u64 s_off0;
    if (threadIdx.x == 0) s_scan = 0;
    if (threadIdx.x == 64) s_off0 = head0 % capacity;
    __syncthreads();
    const bool deadline = (desc_flags & DESC_DEADLINE) != 0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const Entry e = m.e[i];
        // A last-rows source: its row k is the step's k-th last row per request, whatever the selection.
        const bool last_rows = (e.src_rows & SRC_LAST_ROWS) != 0;
        Control c = controls[e.hookpoint];
        if (last_rows) c.mode = ROW_LAST_PER_REQUEST;
        if (kept != KEEP_ALL && !last_rows && c.mode != ROW_LIST) {
            c.mode = ROW_LIST;
            c.list_ptr = (u64)(m.g.kept + 1);
            c.list_len = min(kept, n_rows);
        }
        ctl[i] = c;
        u32 bound = last_rows ? n_rows : min(e.src_rows, n_rows);
        if (c.valid_rows_ptr) bound = min(bound, *(const u32*)c.valid_rows_ptr);
        const bool scan = c.mode == ROW_LIST || (c.mode == ROW_LAST_PER_REQUEST && !m.g.on);
        Plan p;
        p.rows = c.mode == ROW_ALL ? bound : c.mode == ROW_LAST_PER_REQUEST && m.g.on ? bound / m.g.seq : 0;
        // A last-rows source holds src_rows rows, whatever the batch (the host refuses one in a graph-begun step;
        // this keeps the kernel within the source on its own).
        if (last_rows && m.g.on) p.rows = min(p.rows, e.src_rows & ~SRC_LAST_ROWS);
        p.pad = bound;  // kept for the list scan
        p.last = last_rows;
        p.vec = ((e.src | e.row_bytes) & 15) == 0;
        p.dc = rs_downcasts(c, e.dtype);
        p.orb = rs_out_row_bytes(p.dc, e.dtype, e.row_bytes);
        p.status = c.enabled && (c.every_n <= 1 || step % (u64)c.every_n == 0) ? -1 : C_SAMPLED_REC;
        plan[i] = p;
        if (scan) s_scan = 1;
    }
    __syncthreads();
    // 2. Entries with a row list: rows are the list up to the first index at or past the bound (block-wide).
    if (s_scan) {
        for (u32 i = 0; i < n; i++) {
            const Control c = ctl[i];
            if (c.mode == ROW_ALL || (c.mode == ROW_LAST_PER_REQUEST && m.g.on)) continue;
            const u32 len = c.mode == ROW_LIST ? c.list_len
                            : plan[i].last ? min(n_last, m.e[i].src_rows & ~SRC_LAST_ROWS) : n_last;
            const u32 bound = (u32)plan[i].pad;
            if (threadIdx.x == 0) s_min = len;
            __syncthreads();
            for (u32 k = threadIdx.x; k < len; k += blockDim.x)
                if (many_row(c, desc, n_rows, m.g, k) >= bound) atomicMin(&s_min, k);
            __syncthreads();
            if (threadIdx.x == 0) plan[i].rows = s_min;
            __syncthreads();
        }
    }
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        Plan& p = plan[i];
        const u32 rb = m.e[i].row_bytes;
        p.meta_bytes = (META_BYTES * p.rows + RECORD_ALIGN_MASK) & ~RECORD_ALIGN_MASK;
        p.payload_len = p.meta_bytes + (u64)p.rows * p.orb;
        p.footprint = (HEADER_BYTES + p.payload_len + RECORD_ALIGN_MASK) & ~RECORD_ALIGN_MASK;
        if (p.rows == 0) p.status = -2;
        else if (p.status == -1 && HEADER_BYTES + p.payload_len > capacity / 2) p.status = C_TOO_LARGE_REC;
        else if (p.status == -1 && deadline) p.status = C_DEADLINE_REC;
        // This entry's units (none for downcast rows: they have their own pass), for the prefix below.
        p.unit0 = p.dc ? 0 : p.vec ? (u64)p.rows * (rb / 16) : (u64)p.rows * rb;
    }
    __syncthreads();
    // 3. Placement, in order. Usually every record the step publishes fits after the head without wrapping: then
    // each starts where the ones before it end, and one warp places them all with prefix sums (two entries per
    // lane). Otherwise (a record needs padding to wrap, or does not fit while a later, smaller one may) one thread
    // places them one by one.
    static_assert(MAX_MANY <= 64, "the placement's prefix sums cover two entries per lane");
    if (threadIdx.x < 32) {
        const u32 lane = threadIdx.x;
        u64 x[2][5], before[2][5], total[5] = {0, 0, 0, 0, 0};  // footprint, units, metadata units, downcast rows, records
        // The second half only when there are more than 32 entries (a warp-uniform branch; its values are read only
        // for entries that exist): its shuffle chains are most of this phase's latency with few entries.
        const int halves = n > 32 ? 2 : 1;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (h >= halves) {
#pragma unroll
                for (int q = 0; q < 5; q++) x[h][q] = before[h][q] = 0;
                continue;
            }
            const u32 i = lane + 32u * h;
            const bool live = i < n && plan[i].status == -1;
            x[h][0] = live ? plan[i].footprint : 0;
            x[h][1] = live ? plan[i].unit0 : 0;
            x[h][2] = live ? plan[i].meta_bytes / 16 : 0;
            x[h][3] = live && plan[i].dc ? plan[i].rows : 0;
            x[h][4] = live ? 1 : 0;
#pragma unroll
            for (int q = 0; q < 5; q++) {
                const u64 incl = rs_warp_inclusive(x[h][q]);
                before[h][q] = total[q] + incl - x[h][q];
                total[q] += __shfl_sync(0xFFFFFFFFu, incl, 31);
            }
        }
        if (s_off0 + total[0] <= capacity && total[0] <= capacity - (head0 - tail)) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 i = lane + 32u * h;
                if (i >= n) continue;
                s_unit[i] = before[h][1];
                s_meta[i] = before[h][2];
                s_drow[i] = before[h][3];
                if (x[h][4]) {
                    Plan& p = plan[i];
                    p.pad = 0;
                    p.pad_at = p.start = s_off0 + before[h][0];
                    p.seq = seq0 + before[h][4];
                }
            }
            if (lane == 0) {
                s_unit[n] = total[1];
                s_meta[n] = total[2];
                s_drow[n] = total[3];
                s_head = head0 + total[0];
                s_seq = seq0 + total[4];
            }
        } else if (lane == 0) {
            u64 head = head0, seq = seq0, offset = s_off0, units = 0, metas = 0, drows = 0;
            for (u32 i = 0; i < n; i++) {
                Plan& p = plan[i];
                s_unit[i] = units;
                s_meta[i] = metas;
                s_drow[i] = drows;
                if (p.status != -1) continue;
                const u64 pad = p.footprint <= capacity - offset ? 0 : capacity - offset;
                if (pad + p.footprint > capacity - (head - tail)) {
                    p.status = C_FULL_REC;
                    continue;
                }
                p.pad = pad;
                p.pad_at = offset;
                p.start = pad ? 0 : offset;
                p.seq = seq++;
                head += pad + p.footprint;
                offset = p.start + p.footprint;
                if (offset == capacity) offset = 0;
                units += p.unit0;
                metas += p.meta_bytes / 16;
                if (p.dc) drows += p.rows;
            }
            s_unit[n] = units;
            s_meta[n] = metas;
            s_drow[n] = drows;
            s_head = head;
            s_seq = seq;
        }
    }
    __syncthreads();
    if (lead && was_busy) set_error(host, ERR_CONCURRENT_PRODUCERS);

    // 4. Headers (one thread per record), metadata and rows (all threads over all records at once).
    const u64 gtid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 gsize = (u64)gridDim.x * blockDim.x;
    for (u64 i = gtid; i < n; i += gsize) {
        const Plan& p = plan[i];
        if (p.status != -1) continue;
        const Entry& e = m.e[i];
        if (p.pad) write_header(ring + p.pad_at, 0, 0, 0, DTYPE_PAD << 40, p.pad - HEADER_BYTES);
        const u64 flags = (ctl[i].mode != ROW_ALL || p.rows != n_rows) ? FLAG_ROW_SELECTION : 0;
        const u64 out_dtype = p.dc ? DTYPE_ROWSCALED : e.dtype;
        write_header(ring + p.start, p.seq, step, (u64)e.hookpoint | ((u64)p.rows << 32),
                     (u64)p.orb | (KIND_DATA << 32) | (out_dtype << 40) | (flags << 48), p.payload_len);
    }
    for (u64 k = gtid; k < s_meta[n]; k += gsize) {
        const u32 i = find_entry(s_meta, n, k);
        const Plan& p = plan[i];
        const u64 j = k - s_meta[i];
        uint4 v = make_uint4(0, 0, 0, 0);
        if (j < p.rows) {
            const u32 r = many_row(ctl[i], desc, n_rows, m.g, (u32)j);
            v = m.g.on ? graph_meta(m.g, r) : ((const uint4*)(desc + DESC_HEADER_BYTES))[r];
        }
        ((uint4*)(ring + p.start + HEADER_BYTES))[j] = v;
    }
    const u64 total = s_unit[n];
    for (u64 u0 = gtid; u0 < total; u0 += UNROLL * gsize) {
        uint4 v[UNROLL];
        u8* dst[UNROLL];
        bool wide[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            const u64 u = u0 + k * gsize;
            dst[k] = 0;
            wide[k] = false;
            if (u >= total) continue;
            const u32 i = find_entry(s_unit, n, u);
            const Plan& p = plan[i];
            const u32 rb = m.e[i].row_bytes;
            const u32 j = (u32)(u - s_unit[i]);  // < 2^32: a record is at most half the ring, in 16-byte units
            const u32 upr = p.vec ? rb / 16 : rb;
            const u32 row = j / upr, col = j - row * upr;
            const u64 r = ctl[i].mode == ROW_ALL || p.last ? row : many_row(ctl[i], desc, n_rows, m.g, row);
            const u8* src = (const u8*)m.e[i].src + r * rb;
            u8* out = ring + p.start + HEADER_BYTES + p.meta_bytes;
            wide[k] = p.vec;
            if (p.vec) {
                v[k] = ((const uint4*)src)[col];
                dst[k] = out + (u64)j * 16;
            } else {
                v[k].x = src[col];
                dst[k] = out + j;
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            if (!dst[k]) continue;
            if (wide[k]) *(uint4*)dst[k] = v[k];
            else *dst[k] = (u8)v[k].x;
        }
    }

    // 4b. Downcast rows of all records, one warp per row (s_drow: the same prefix over downcast rows only).
    for (u64 k = gtid >> 5; k < s_drow[n]; k += gsize >> 5) {
        const u32 i = find_entry(s_drow, n, k);
        const Plan& p = plan[i];
        const Entry& e = m.e[i];
        const u32 j = (u32)(k - s_drow[i]);
        const u64 r = ctl[i].mode == ROW_ALL || p.last ? j : many_row(ctl[i], desc, n_rows, m.g, j);
        rs_downcast_row((const u8*)e.src + r * e.row_bytes, e.dtype, p.orb - SCALE_BYTES,
                        ring + p.start + HEADER_BYTES + p.meta_bytes + (u64)j * p.orb);
    }

    // 5. The last block to finish publishes everything at once (its first thread) and counts (its threads, one entry
    // each).
    __shared__ u32 s_last, s_overrun;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 last = 1;
        if (gridDim.x > 1) {
            __threadfence();
            last = atomicAdd((u32*)(state + ST_DONE_BLOCKS), 1u) == gridDim.x - 1;
            if (last) *(volatile u32*)(state + ST_DONE_BLOCKS) = 0;
        }
        s_last = last;
        s_overrun = 0;
    }
    __syncthreads();
    if (!s_last) return;
    if (threadIdx.x == 0) {
        const u64 new_head = s_head;
        st64(state + ST_HEAD, new_head);
        st64(state + ST_SEQ, s_seq);
        st64(state + ST_TAIL_SNAP, tail_now);
        if (m.g.on == GB_FIRST) st64(state + ST_NEXT_STEP, step + 1);
        // The step's first kernel counts the step as begun (rs_graph_step_begun's work, sharing the fence below).
        const bool begins = m.g.on == GB_FIRST;
        const u64 begun = begins ? rs_count_graph_step(state) : 0;
        // One system-scope fence before the host words below: the records (data, metadata, headers) reach memory
        // before the host can see the new head. The host words need no order among themselves (a second fence, as
        // rs_graph_step_begun has, cost 0.7-0.9 us per kernel on an H100, session 40): full mode's admission retires a graph
        // step's reservation when `graph_begun` says the *next* step began, and the retired step's head was
        // published by a kernel that ran before this one (stream order, or the side stream's fork and join events),
        // which this fence orders before `graph_begun` too; this step's own bytes stay reserved until the next step
        // begins, so seeing this `graph_begun` before this head counts them in neither place only if the host's
        // admissions fell behind the device's count of begun steps (a replay or an eager graph step that was not
        // admitted: full mode's contract is broken then anyway). The tail snapshot is a lower bound whenever read.
        if (new_head != head0 || begins) __threadfence_system();
        if (new_head != head0) st64(host + HS_HEAD, new_head);
        // A lower bound of the snapshot the next capture decides on: full mode's admission of graph-begun steps,
        // whose captures have no begin kernel of their own to refresh it, judges room against it.
        st64(host + HS_TAIL_SNAP, tail_now);
        if (begins) st64(host + HS_GRAPH_BEGUN, begun);
    }
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const Plan& p = plan[i];
        if (p.status == -2) continue;
        u64* cnt = counters + COUNTER_WORDS * m.e[i].hookpoint;
        atomicAdd(cnt + C_PRODUCED_REC, 1ull);
        atomicAdd(cnt + C_PRODUCED_ROWS, (u64)p.rows);
        const int which = p.status == -1 ? C_PUBLISHED_REC : p.status;
        atomicAdd(cnt + which, 1ull);
        atomicAdd(cnt + which + 1, (u64)p.rows);
        if (p.status == C_FULL_REC && m.full_mode) s_overrun = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_overrun) set_error(host, ERR_FULL_MODE_OVERRUN);
        *(volatile u32*)(state + ST_BUSY) = 0;
    }
}

// Test and benchmark helper: fills `rows x row_bytes` bytes with a pattern the host can recompute
// (`ringscope_hookpoint::cuda::pattern_word`).
extern "C" __global__ void ringscope_fill_pattern(u32* dst, u64 words, u64 seed) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        u64 x = seed ^ (i * PATTERN_GOLDEN);
        x ^= x >> 31;
        x *= PATTERN_MIX;
        x ^= x >> 27;
        dst[i] = (u32)x;
    }
}

// Benchmark helper: hands every written byte back as if drained (tail = head), so that a benchmark can time the
// capture kernels alone. Never used by a session.
extern "C" __global__ void ringscope_discard_all(u8* state) {
    const u64 head = ld64(state + ST_HEAD);
    st64(state + ST_TAIL, head);
    st64(state + ST_TAIL_SNAP, head);
}
