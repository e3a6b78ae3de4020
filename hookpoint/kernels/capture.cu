// ringscope HookPoint kernels. Compiled once per process with NVRTC for the device's architecture
// (hookpoint/src/cuda.rs). The record bytes follow docs/format.md exactly; the state offsets mirror
// ring/src/cuda.rs (modules `state` and `host`).
//
// Rules these kernels live by (see docs/gpu.md):
// * Everything that can change between graph replays is read from device memory at run time: the step
//   descriptor, the per-hookpoint controls, the number of valid rows. Kernel arguments are fixed addresses.
// * No kernel ever waits: a capture that finds the ring full drops its record and counts it.
// * All captures of one ring run in order on one stream; a record is published by the last block of its kernel
//   to finish, after a system-scope fence, so the host never sees a torn record.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

// Device state block (ring/src/cuda.rs `state`).
#define ST_HEAD 0
#define ST_SEQ 8
#define ST_TAIL 64
#define ST_TAIL_SNAP 128
#define ST_DONE 136
#define ST_BEGIN_DONE 140
#define ST_BUSY 144
// Host (mapped) block (ring/src/cuda.rs `host`).
#define HS_HEAD 0
#define HS_PROGRESS 64
#define HS_ERRORS 128
// Error bits (ring/src/cuda.rs `errors`).
#define ERR_CONCURRENT 1u
#define ERR_FULL_MODE_OVERRUN 2u

// Per-hookpoint control, 64 bytes (hookpoint/src/cuda.rs `DeviceControl`).
struct Control {
    u32 enabled;
    u32 every_n;
    u32 mode;  // 0 all rows, 1 explicit list, 2 last row per request
    u32 list_len;
    u64 list_ptr;        // device u32[list_len] for mode 1
    u64 valid_rows_ptr;  // device u32 scalar: rows past it are padding (0 = none)
    u64 reserved[4];
};

// Per-hookpoint counters, 16 x u64 (hookpoint/src/cuda.rs `counter`).
#define C_PRODUCED_REC 0
#define C_PRODUCED_ROWS 1
#define C_SAMPLED_REC 2
#define C_SAMPLED_ROWS 3
#define C_PUBLISHED_REC 4
#define C_PUBLISHED_ROWS 5
#define C_FULL_REC 6
#define C_FULL_ROWS 7
#define C_TOO_LARGE_REC 8
#define C_TOO_LARGE_ROWS 9
#define C_DEADLINE_REC 10
#define C_DEADLINE_ROWS 11

// Step descriptor: 64-byte header {u64 step; u32 n_rows; u32 n_last; u64 begin_index; u32 flags}, then RowMeta[n_rows]
// (16 bytes each), then u32 last_row[n_last] (batch row of each request's last token, ascending).

#define HEADER_BYTES 64ull
#define META_BYTES 16ull
#define MAGIC_VERSION_LEN 0x0040000131525352ull  // "RSR1", version 1, header_len 64
#define KIND_DATA 1ull
#define DTYPE_PAD 6ull  // pads carry dtype u8, as the host encoder writes them
#define FLAG_ROW_SELECTION 2ull
#define UNROLL 4
#define DESC_DEADLINE 1u  // full mode: begin_step found no room in time; drop and count this step's captures

__device__ __forceinline__ u64 ld64(const u8* p) { return *(const volatile u64*)p; }
__device__ __forceinline__ void st64(u8* p, u64 v) { *(volatile u64*)p = v; }

__device__ void write_header(u8* at, u64 w1, u64 w2, u64 w3, u64 w4, u64 w5) {
    u64 w[8] = {MAGIC_VERSION_LEN, w1, w2, w3, w4, w5, 0ull, 0ull};
    u64 acc = 0x5253523168656164ull;  // "RSR1head"
#pragma unroll
    for (int i = 0; i < 7; i++) {
        acc ^= w[i];
        acc *= 0x9E3779B97F4A7C15ull;
        acc ^= acc >> 29;
    }
    w[7] = acc;
    ulonglong2* dst = (ulonglong2*)at;
#pragma unroll
    for (int i = 0; i < 4; i++) dst[i] = make_ulonglong2(w[2 * i], w[2 * i + 1]);
}

__device__ __forceinline__ void set_error(u8* host, u32 bit) {
    volatile u32* e = (volatile u32*)(host + HS_ERRORS);
    *e = *e | bit;
}

extern "C" __global__ void __launch_bounds__(256) ringscope_capture(
    u8* ring, u64 capacity, u8* state, u8* host, const Control* controls, u64* counters, const u8* desc,
    u32 hookpoint, u32 dtype, u32 row_bytes, const u8* __restrict__ src, u32 src_rows, u32 full_mode) {
    __shared__ u32 s_rows;
    // Independent loads first, so their latencies overlap.
    const Control c = controls[hookpoint];
    const u64 step = *(const u64*)desc;
    const u32 n_rows = *(const u32*)(desc + 8);
    const u32 n_last = *(const u32*)(desc + 12);
    const u32 desc_flags = *(const u32*)(desc + 24);
    const u64 head = ld64(state + ST_HEAD);
    const u64 seq = ld64(state + ST_SEQ);
    const u64 tail = ld64(state + ST_TAIL_SNAP);
    const u64 tail_now = ld64(state + ST_TAIL);
    const bool lead = blockIdx.x == 0 && threadIdx.x == 0;
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
    u32 bound = min(src_rows, n_rows);
    if (c.valid_rows_ptr) bound = min(bound, *(const u32*)c.valid_rows_ptr);
    const u32* idx = 0;
    u32 rows = bound;
    if (c.mode != 0) {
        idx = c.mode == 1 ? (const u32*)c.list_ptr : (const u32*)(desc + HEADER_BYTES + META_BYTES * n_rows);
        const u32 len = c.mode == 1 ? c.list_len : n_last;
        // Rows are taken in list order up to the first index at or past `bound` (padding).
        if (threadIdx.x == 0) s_rows = len;
        __syncthreads();
        for (u32 i = threadIdx.x; i < len; i += blockDim.x)
            if (idx[i] >= bound) atomicMin(&s_rows, i);
        __syncthreads();
        rows = s_rows;
    }
    if (lead && was_busy) set_error(host, ERR_CONCURRENT);

    u64* cnt = counters + 16ull * hookpoint;
    const bool sampled = c.enabled && (step % (u64)(c.every_n ? c.every_n : 1)) == 0;
    const u64 meta_bytes = (META_BYTES * rows + 63ull) & ~63ull;
    const u64 payload_len = meta_bytes + (u64)rows * row_bytes;
    const u64 footprint = (HEADER_BYTES + payload_len + 63ull) & ~63ull;
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
        const u64 flags = (c.mode != 0 || rows != n_rows) ? FLAG_ROW_SELECTION : 0;
        write_header(rec, seq, step, (u64)hookpoint | ((u64)rows << 32),
                     (u64)row_bytes | (KIND_DATA << 32) | ((u64)dtype << 40) | (flags << 48), payload_len);
    }
    // Zeros between the row metadata and the first row.
    if (blockIdx.x == 0) {
        const u64 i = META_BYTES * rows + 16ull * threadIdx.x;
        if (i < meta_bytes) *(uint4*)(rec + HEADER_BYTES + i) = make_uint4(0, 0, 0, 0);
    }

    // Row metadata of the kept rows, then zeros up to the 64-byte boundary.
    const u64 gtid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 gsize = (u64)gridDim.x * blockDim.x;
    const uint4* metas = (const uint4*)(desc + HEADER_BYTES);
    uint4* meta_dst = (uint4*)(rec + HEADER_BYTES);
    for (u64 i = gtid; i < meta_bytes / 16; i += gsize)
        meta_dst[i] = i < rows ? metas[idx ? idx[i] : i] : make_uint4(0, 0, 0, 0);

    u8* __restrict__ dst = rec + HEADER_BYTES + meta_bytes;
    if (vec) {
        // Flattened over 16-byte units; (row, column) advance by the grid size without a division per unit.
        const u64 total = (u64)rows * vpr;
        const u32 q = (u32)(gsize / vpr), rem = (u32)(gsize % vpr);
        u32 r = (u32)(gtid / vpr), col = (u32)(gtid % vpr);
        uint4* d = (uint4*)dst;
        u64 u = gtid;
        if (pre_n > 0 && idx == 0) {
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
                    const u64 srow = idx ? idx[rr] : rr;
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
            const u64 srow = idx ? idx[r] : r;
            dst[b] = src[srow * row_bytes + col];
        }
    }

    // The last block to finish publishes.
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (gridDim.x > 1) {
        __threadfence();
        if (atomicAdd((u32*)(state + ST_DONE), 1u) != gridDim.x - 1) return;
        *(volatile u32*)(state + ST_DONE) = 0;
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
extern "C" __global__ void __launch_bounds__(256) ringscope_begin_step(
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
    // The slot has been read (the loads completed before the stores above): the host may reuse it.
    __threadfence_system();
    st64(host + HS_PROGRESS, begin_index + 1);
}

// Test and benchmark helper: fills `rows x row_bytes` bytes with a pattern the host can recompute
// (`ringscope_hookpoint::cuda::pattern_word`).
extern "C" __global__ void ringscope_fill_pattern(u32* dst, u64 words, u64 seed) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        u64 x = seed ^ (i * 0x9E3779B97F4A7C15ull);
        x ^= x >> 31;
        x *= 0xBF58476D1CE4E5B9ull;
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
