// ringscope fused linear probes. Compiled in the same NVRTC module as capture.cu, after it (it uses its Control,
// GraphBatch, graph_request and rs_load); the shared numbers (PROBE_MAX_K, PROBE_CHUNK, THREADS, DESC_*, ...) come from
// the generated prelude (hookpoint/src/cuda/kernels.rs).
//
// A probe turns each captured row x (d elements of bf16 / f16 / f32) into K scores s_k = W_k . x + b_k (f32
// accumulation) before the capture path sees it: ringscope_probe_scores writes the scores of a step's rows into the
// probe's own f32 buffer (row r at out + r * K), and an ordinary capture of an f32 hookpoint of width K copies that
// buffer into the ring. Like the capture kernels, its arguments are fixed addresses, so it can be recorded into a CUDA
// graph; the number of rows and the request of each row are read from device memory when it runs.
//
// Flags: with thresholds and a flag table, a row whose score s_k >= thresholds[k] for some k (NaN never) stores
// request_id + 1 into flags[request_id % flag_slots] (0 = empty), which an engine can test on the device, or the host
// in the mapped memory, without a synchronisation.

// The rows of the step this kernel scores: the same bound as the capture of the scores hookpoint (its valid-rows
// scalar included), so that padding rows raise no flags.
__device__ __forceinline__ u32 probe_bound(const Control& c, const u8* desc, const GraphBatch& g, u32 src_rows) {
    const u32 n_rows = g.on ? g.batch * g.seq : *(const u32*)(desc + DESC_N_ROWS);
    u32 bound = min(src_rows, n_rows);
    if (c.valid_rows_ptr) bound = min(bound, *(const u32*)c.valid_rows_ptr);
    return bound;
}

// The request of batch row r: from the engine's tensors in steps begun inside a graph, from the descriptor otherwise.
__device__ __forceinline__ u64 probe_request(const u8* desc, const GraphBatch& g, u32 r) {
    if (g.on) return graph_request(g, r / g.seq);
    return *(const u64*)(desc + DESC_HEADER_BYTES + META_BYTES * r);
}

// Scores rows first_row, first_row + row_stride, ... of one probe with this block (one block per row at a time). Each thread accumulates up to PROBE_CHUNK partial scores over its strided
// elements (coalesced loads of x and of each W row), a warp-shuffle then shared-memory reduction sums them, and the
// block moves on to the next chunk of outputs while K has more.
__device__ void rs_probe_rows(
    const u8* __restrict__ src, u32 src_rows, u32 dtype, u32 d, const float* __restrict__ w,
    const float* __restrict__ bias, u32 k, float* __restrict__ out, const Control* controls, u32 hookpoint,
    const u8* desc, const GraphBatch& g, const float* thresholds, u64* flags, u32 flag_slots, u32 first_row,
    u32 row_stride) {
    __shared__ float s_part[THREADS / 32][PROBE_CHUNK];
    __shared__ u32 s_hit;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // A last-rows source (SRC_LAST_ROWS, never in a graph-begun step): its row j is the step's j-th last row per
    // request; scored into scores row j (captured the same way), flagged as that row's request.
    const bool last_rows = (src_rows & SRC_LAST_ROWS) != 0;
    src_rows &= ~SRC_LAST_ROWS;
    const u32 bound = probe_bound(controls[hookpoint], desc, g, last_rows ? 0xFFFFFFFFu : src_rows);
    const u32* last = 0;
    u32 end = bound;
    if (last_rows) {
        const u32 n_rows = *(const u32*)(desc + DESC_N_ROWS);
        last = (const u32*)(desc + DESC_HEADER_BYTES + META_BYTES * n_rows);
        end = min(src_rows, *(const u32*)(desc + DESC_N_LAST));
    }
    // A step that keeps some rows only (a graph batch's kept rows: probes in graph-begun steps always get the batch)
    // scores those — unless the scores hookpoint selects a row list, which its capture takes as given: then every
    // row is scored, so that none it copies is stale.
    const u32* keep = 0;
    if (!last_rows && g.on && graph_kept(g) != KEEP_ALL && controls[hookpoint].mode != ROW_LIST) {
        keep = g.kept + 1;
        end = min(g.kept[0], g.batch * g.seq);
    }
    const u64 row_bytes = (u64)d * (dtype == DTYPE_F32 ? 4u : 2u);
    const bool flagging = thresholds != 0 && flags != 0 && flag_slots != 0;

    for (u32 j = first_row; j < end; j += row_stride) {
        // (The same j for the whole block: the skips are uniform, no thread misses a barrier.)
        const u32 r = keep ? keep[j] : j;
        if (keep && r >= bound) continue;        // a kept row past the valid rows
        if (last && last[r] >= bound) continue;  // a padding row
        const u8* x = src + (u64)r * row_bytes;
        if (threadIdx.x == 0) s_hit = 0;
        for (u32 k0 = 0; k0 < k; k0 += PROBE_CHUNK) {
            const u32 kc = min(k - k0, (u32)PROBE_CHUNK);
            float acc[PROBE_CHUNK];
#pragma unroll
            for (int j = 0; j < PROBE_CHUNK; j++) acc[j] = 0.0f;
            // PROBE_UNROLL elements per thread per pass, all loaded before any is used: the loads of a pass are in
            // flight together (a decode step evicts the weights from L2, so each pass waits on DRAM once, not
            // PROBE_UNROLL times).
            const float* wk = w + (u64)k0 * d;
            for (u32 i0 = threadIdx.x; i0 < d; i0 += blockDim.x * PROBE_UNROLL) {
                float v[PROBE_UNROLL];
#pragma unroll
                for (int u = 0; u < PROBE_UNROLL; u++) {
                    const u32 i = i0 + u * blockDim.x;
                    v[u] = i < d ? rs_load(x, dtype, i) : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < PROBE_CHUNK; j++) {
                    if ((u32)j < kc) {
#pragma unroll
                        for (int u = 0; u < PROBE_UNROLL; u++) {
                            const u32 i = i0 + u * blockDim.x;
                            if (i < d) acc[j] = fmaf(wk[(u64)j * d + i], v[u], acc[j]);
                        }
                    }
                }
            }
            // kc is the same for the whole block, so whole warps skip the unused outputs together.
#pragma unroll
            for (int j = 0; j < PROBE_CHUNK; j++) {
                if ((u32)j < kc) {
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xFFFFFFFFu, acc[j], o);
                    if (lane == 0) s_part[warp][j] = acc[j];
                }
            }
            __syncthreads();
            if (threadIdx.x < kc) {
                float s = bias[k0 + threadIdx.x];
                for (u32 q = 0; q < blockDim.x / 32; q++) s += s_part[q][threadIdx.x];
                out[(u64)r * k + k0 + threadIdx.x] = s;
                // `>=` is false for NaN: a NaN score never raises a flag.
                if (flagging && s >= thresholds[k0 + threadIdx.x]) s_hit = 1;
            }
            // s_part is rewritten by the next chunk (or row) only after every thread has read it.
            __syncthreads();
        }
        if (threadIdx.x == 0 && s_hit) {
            // One plain (volatile) word store: an engine polling the slot sees either the old value or this one. No
            // fence: nothing else is published with it. A row of no request (an ended sequence in a graph step) raises
            // no flag: NO_REQUEST + 1 would be 0, clearing another request's slot.
            const u64 req = probe_request(desc, g, last ? last[r] : r);
            if (req != NO_REQUEST) *(volatile u64*)(flags + req % flag_slots) = req + 1;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) ringscope_probe_scores(
    const u8* __restrict__ src, u32 src_rows, u32 dtype, u32 d, const float* __restrict__ w,
    const float* __restrict__ bias, u32 k, float* __restrict__ out, const Control* controls, u32 hookpoint,
    const u8* desc, GraphBatch g, const float* thresholds, u64* flags, u32 flag_slots) {
    rs_probe_rows(src, src_rows, dtype, d, w, bias, k, out, controls, hookpoint, desc, g, thresholds, flags,
                  flag_slots, blockIdx.x, gridDim.x);
}

// Deferred fused probes: every probe of a step scored by one kernel when the step's deferred captures are copied
// (before the capture that copies their scores, on the same stream). All probes run at once, each on its own blocks:
// a probe's dependent DRAM round trips (its weights were evicted by the step) overlap with the others' instead of
// adding up on the engine's stream. Block b scores rows b / n, b / n + gridDim.x / n, ... of probe b % n.
struct ProbeEntry {
    const u8* src;
    const float* w;
    const float* bias;
    float* out;
    const float* thresholds;
    u64* flags;
    u32 src_rows;
    u32 dtype;
    u32 d;
    u32 k;
    u32 hookpoint;
    u32 flag_slots;
};
struct ProbeMany {
    GraphBatch g;
    u32 n;
    u32 reserved;
    ProbeEntry e[MAX_PROBE_MANY];
};

extern "C" __global__ void __launch_bounds__(THREADS) ringscope_probe_scores_many(
    const Control* controls, const u8* desc, ProbeMany m) {
    const u32 n = m.n;
    if (n == 0) return;
    const ProbeEntry& p = m.e[blockIdx.x % n];
    rs_probe_rows(p.src, p.src_rows, p.dtype, p.d, p.w, p.bias, p.k, p.out, controls, p.hookpoint, desc, m.g,
                  p.thresholds, p.flags, p.flag_slots, blockIdx.x / n, gridDim.x / n);
}
