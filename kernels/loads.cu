// dpboard CUDA kernels: load counters from a scheduler's request and KV page tables, and the
// GPU-direct publish of the finished snapshot into a board slot (docs/KERNELS.md).
//
// Compiled at run time by CuPy (NVRTC, RawModule with name_expressions) and, in the test suite, by
// nvcc with -DDPBOARD_INSTANTIATE for sm_90. The one header is dpboard_layout.h beside this file,
// generated from dpboard/snapshot.py (slot layout, state codes, raw counter and status indices):
// only #define lines, since NVRTC has no standard library.
//
// One pass: every thread walks both tables with a grid-stride loop, keeps nine counters in
// registers, the block reduces them (warp shuffles, then one warp over the warp sums), and one
// thread per block adds them to the global accumulators with one atomicAdd per counter. The last
// block to finish (threadfence + ticket counter) reads the totals, resets the accumulators and the
// ticket for the next launch (so no memset is needed between launches) and writes the result.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#include "dpboard_layout.h"

#define DPB_MAX_WARPS 32     // up to 1024 threads per block

// The counting rules for one request row and one KV page. __host__ as well as __device__: the test
// suite runs them on the host (nvcc, no GPU needed) against the NumPy reference.
template <typename S, typename L>
__host__ __device__ __forceinline__ void dpb_count_request(S state, L seqlen, i64 acc[DPB_NUM_RAW]) {
    const i64 s = (i64)state;
    const i64 len = (i64)seqlen;
    // WAITING..RETRACTED are the queued states: one range of codes (snapshot.py asserts it).
    const bool waiting = s >= DPB_REQ_WAITING && s <= DPB_REQ_RETRACTED;
    // A seqlen outside [0, DPB_MAX_SEQLEN] marks the table bad (nothing is published). With the number
    // of rows bounded too (checked on the host before the launch), no sum below can overflow.
    const bool bad_len = (len < 0 || len > DPB_MAX_SEQLEN) && s != DPB_REQ_FREE;
    const i64 counted = bad_len ? 0 : len;
    acc[DPB_RAW_RUNNING] += s == DPB_REQ_RUNNING;
    acc[DPB_RAW_WAITING] += waiting;
    acc[DPB_RAW_SEQLEN_WITHOUT_KV] += (waiting && s != DPB_REQ_TRANSFER) ? counted : 0;
    acc[DPB_RAW_SEQLEN_AWAITING_TRANSFER] += (s == DPB_REQ_PREALLOC || s == DPB_REQ_TRANSFER) ? counted : 0;
    acc[DPB_RAW_BAD_REQ_STATES] += s < 0 || s >= DPB_NUM_REQ_STATES;
    acc[DPB_RAW_BAD_SEQLENS] += bad_len;
}

template <typename P>
__host__ __device__ __forceinline__ void dpb_count_page(P page, i64 acc[DPB_NUM_RAW]) {
    const i64 p = (i64)page;
    acc[DPB_RAW_FREE_PAGES] += p == DPB_PAGE_FREE;
    acc[DPB_RAW_EVICTABLE_PAGES] += p == DPB_PAGE_EVICTABLE;
    acc[DPB_RAW_BAD_PAGE_STATES] += p < 0 || p >= DPB_NUM_PAGE_STATES;
}

// Rows and pages first, first + stride, ... into acc (zeroed here): a thread's grid-stride share on
// the device, the whole tables with (0, 1) on the host.
template <typename S, typename L, typename P>
__host__ __device__ __forceinline__ void dpb_count_range(const S *__restrict__ state, const L *__restrict__ seqlen,
                                                         i64 num_requests, const P *__restrict__ pages,
                                                         i64 num_pages, i64 first, i64 stride,
                                                         i64 acc[DPB_NUM_RAW]) {
    for (int k = 0; k < DPB_NUM_RAW; k++) acc[k] = 0;
    const i64 n = num_requests > num_pages ? num_requests : num_pages;
    for (i64 i = first; i < n; i += stride) {
        if (i < num_requests) dpb_count_request(state[i], seqlen[i], acc);
        if (i < num_pages) dpb_count_page(pages[i], acc);
    }
}

template <typename S, typename L, typename P>
__device__ __forceinline__ void dpb_accumulate(const S *__restrict__ state, const L *__restrict__ seqlen,
                                               i64 num_requests, const P *__restrict__ pages, i64 num_pages,
                                               i64 acc[DPB_NUM_RAW]) {
    dpb_count_range(state, seqlen, num_requests, pages, num_pages, (i64)blockIdx.x * blockDim.x + threadIdx.x,
                    (i64)gridDim.x * blockDim.x, acc);
}

// Sums acc over the block into the global accumulators; returns true in the one thread (thread 0
// of the last block to finish) that then holds the grand totals in acc. Every thread must call it.
__device__ __forceinline__ bool dpb_reduce(i64 acc[DPB_NUM_RAW], u64 *accum, u32 *ticket) {
    __shared__ i64 warp_sums[DPB_NUM_RAW][DPB_MAX_WARPS];
    __shared__ bool is_last;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned num_warps = (blockDim.x + 31u) >> 5;
    for (int k = 0; k < DPB_NUM_RAW; k++) {
        i64 v = acc[k];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
        if (lane == 0) warp_sums[k][warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        for (int k = 0; k < DPB_NUM_RAW; k++) {
            i64 v = lane < num_warps ? warp_sums[k][lane] : 0;
            for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
            acc[k] = v;
        }
        if (lane == 0) {
            // Two's complement: an unsigned add is a signed add.
            for (int k = 0; k < DPB_NUM_RAW; k++) atomicAdd(&accum[k], (u64)acc[k]);
            __threadfence();  // our adds are visible device-wide before our ticket is
            is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        }
    }
    __syncthreads();
    if (!is_last || threadIdx.x != 0) return false;
    __threadfence();
    for (int k = 0; k < DPB_NUM_RAW; k++) {
        // atomicExch reads the total and resets the accumulator for the next launch in one step.
        acc[k] = (i64)atomicExch(&accum[k], 0ull);
    }
    atomicExch(ticket, 0u);
    return true;
}

// raw[DPB_NUM_RAW] (device memory) <- the raw counters of the tables.
template <typename S, typename L, typename P>
__global__ void dpb_raw_counts(const S *state, const L *seqlen, i64 num_requests, const P *pages,
                               i64 num_pages, u64 *accum, u32 *ticket, i64 *raw) {
    i64 acc[DPB_NUM_RAW];
    dpb_accumulate(state, seqlen, num_requests, pages, num_pages, acc);
    if (dpb_reduce(acc, accum, ticket)) {
        for (int k = 0; k < DPB_NUM_RAW; k++) raw[k] = acc[k];
    }
}

// GPU-direct publish. `slot` is the device address of a board slot (mapped host memory, registered
// with cudaHostRegister): u64 sequence word, then the int64 LoadSnapshot fields. The kernel is
// the slot's only writer. Host-only facts arrive as arguments: the clocks are the launch time.
// `status` (mapped host memory, DPB_DIRECT_STATUS_WORDS words) tells the host what happened, without a sync.
template <typename S, typename L, typename P>
__global__ void dpb_publish(const S *state, const L *seqlen, i64 num_requests, const P *pages, i64 num_pages,
                            i64 page_size, u64 *accum, u32 *ticket, u64 *slot, i64 dp_rank,
                            i64 num_received_reqs, i64 timestamp_ns, i64 monotonic_ns, i64 writer_pid,
                            i64 node_id, i64 *status, i64 launch_id) {
    i64 acc[DPB_NUM_RAW];
    dpb_accumulate(state, seqlen, num_requests, pages, num_pages, acc);
    if (!dpb_reduce(acc, accum, ticket)) return;

    volatile i64 *st = (volatile i64 *)status;
    st[DPB_DIRECT_BAD_REQ_STATES] = acc[DPB_RAW_BAD_REQ_STATES];
    st[DPB_DIRECT_BAD_PAGE_STATES] = acc[DPB_RAW_BAD_PAGE_STATES];
    st[DPB_DIRECT_BAD_SEQLENS] = acc[DPB_RAW_BAD_SEQLENS];
    const bool bad = acc[DPB_RAW_BAD_REQ_STATES] || acc[DPB_RAW_BAD_PAGE_STATES] || acc[DPB_RAW_BAD_SEQLENS];
    if (bad) {  // never publish numbers made from a broken table
        st[DPB_DIRECT_PUBLISHED] = 0;
        __threadfence_system();
        st[DPB_DIRECT_LAUNCH_ID] = launch_id;
        return;
    }

    // The formulas of docs/KERNELS.md, int64.
    const i64 used = (num_pages - acc[DPB_RAW_FREE_PAGES] - acc[DPB_RAW_EVICTABLE_PAGES]) * page_size;
    const i64 total = used + acc[DPB_RAW_SEQLEN_WITHOUT_KV];
    const i64 active_raw = total - acc[DPB_RAW_SEQLEN_AWAITING_TRANSFER];

    volatile u64 *seq = slot + DPB_SEQ_OFFSET / 8;
    volatile i64 *fields = (volatile i64 *)(slot + DPB_FIELDS_OFFSET / 8);
    u64 s = *seq;
    if (s & 1ull) s += 1ull;  // left odd by a writer that died mid-write: step past it
    i64 publish_seq = fields[DPB_F_PUBLISH_SEQ];
    publish_seq = (publish_seq < 0 ? 0 : publish_seq) + 1;

    *seq = s + 1ull;          // odd: a write is in progress
    __threadfence_system();   // the odd store is visible to the host before any field store
    fields[DPB_F_DP_RANK] = dp_rank;
    fields[DPB_F_NUM_RUNNING_REQS] = acc[DPB_RAW_RUNNING];
    fields[DPB_F_NUM_WAITING_REQS] = acc[DPB_RAW_WAITING];
    fields[DPB_F_NUM_USED_TOKENS] = used;
    fields[DPB_F_NUM_TOTAL_TOKENS] = total;
    fields[DPB_F_NUM_ACTIVE_TOKENS] = active_raw > 0 ? active_raw : 0;
    fields[DPB_F_MAX_TOTAL_NUM_TOKENS] = num_pages * page_size;
    fields[DPB_F_NUM_RECEIVED_REQS] = num_received_reqs;
    fields[DPB_F_TIMESTAMP_NS] = timestamp_ns;
    fields[DPB_F_MONOTONIC_NS] = monotonic_ns;
    fields[DPB_F_PUBLISH_SEQ] = publish_seq;
    fields[DPB_F_WRITER_PID] = writer_pid;
    fields[DPB_F_NODE_ID] = node_id;
    ((volatile u64 *)slot)[DPB_DETAIL_OFFSET / 8] = 0ull;  // the detail flags: a kernel publishes no detail
    __threadfence_system();   // every field store is visible before the even store
    *seq = s + 2ull;          // even: the snapshot is whole

    st[DPB_DIRECT_PUBLISH_SEQ] = publish_seq;
    st[DPB_DIRECT_PUBLISHED] = 1;
    __threadfence_system();
    st[DPB_DIRECT_LAUNCH_ID] = launch_id;
}

#ifdef DPBOARD_INSTANTIATE
// For the nvcc check of the test suite: the dtype combinations the CuPy loader asks for most.
template __global__ void dpb_raw_counts<signed char, int, signed char>(const signed char *, const int *, i64,
                                                                        const signed char *, i64, u64 *, u32 *,
                                                                        i64 *);
template __global__ void dpb_raw_counts<int, i64, int>(const int *, const i64 *, i64, const int *, i64, u64 *,
                                                        u32 *, i64 *);
template __global__ void dpb_publish<signed char, int, signed char>(const signed char *, const int *, i64,
                                                                     const signed char *, i64, i64, u64 *,
                                                                     u32 *, u64 *, i64, i64, i64, i64, i64,
                                                                     i64, i64 *, i64);
template __global__ void dpb_publish<int, i64, int>(const int *, const i64 *, i64, const int *, i64, i64, u64 *,
                                                     u32 *, u64 *, i64, i64, i64, i64, i64, i64, i64 *, i64);
#endif
