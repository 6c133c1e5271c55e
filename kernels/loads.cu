// dpboard CUDA kernels: load counters from a scheduler's request and KV page tables, and the
// GPU-direct publish of the finished snapshot into a board slot (docs/KERNELS.md).
//
// Compiled at run time by CuPy (NVRTC, RawModule with name_expressions) and, in the test suite, by
// nvcc with -DDPBOARD_INSTANTIATE for sm_90. The headers beside this file, none of which needs a
// standard library (NVRTC has none): dpboard_layout.h, generated from dpboard/snapshot.py (slot
// layout, state codes, raw counter and status indices: #define lines); dpboard_loads.h, generated
// from dpboard/loads/formula.py (the load formula and what the publish's last block writes: the
// slot under the seqlock and the status words, the same source the CPU and numba-cuda paths run);
// dpb_seqlock_gpu.h, the GPU writer's seqlock primitives, dpboard/board/dpb_seqlock.h's order with
// system-scope fences.
//
// One pass at memory speed: every thread walks both tables with a grid-stride loop over 16-byte
// chunks (one vector load each: sixteen int8 pages, four int32 seqlens), keeps seven 32-bit counts
// and two 64-bit sums in registers, the block reduces them (warp shuffles, then one warp over the
// warp sums), and one thread per block adds them to the global accumulators with one atomicAdd per
// counter. The host sizes the grid from the device's multiprocessor count, so a launch has a few
// hundred blocks, not thousands of atomics. The last block to finish (threadfence + ticket counter)
// reads the totals, resets the accumulators and the ticket for the next launch (so no memset is
// needed between launches) and writes the result.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#include "dpboard_layout.h"
#include "dpboard_loads.h"

#define DPB_MAX_WARPS 32     // up to 1024 threads per block
#define DPB_VEC_BYTES 16     // one 16-byte load (uint4) per table chunk

// What one thread counts. The seven counts are 32-bit: a thread visits each entry at most once and
// the host refuses tables of 2**32 entries or more, so they cannot wrap; 32-bit adds and shuffles
// are half the work of 64-bit ones. The two seqlen sums need 64 bits.
struct DpbAcc {
    u32 running, waiting, free_pages, evictable_pages, bad_req_states, bad_page_states, bad_seqlens;
    i64 seqlen_without_kv, seqlen_awaiting_transfer;
};

__host__ __device__ __forceinline__ void dpb_acc_zero(DpbAcc &a) {
    a.running = a.waiting = a.free_pages = a.evictable_pages = 0u;
    a.bad_req_states = a.bad_page_states = a.bad_seqlens = 0u;
    a.seqlen_without_kv = a.seqlen_awaiting_transfer = 0;
}

// The raw counters in their DPB_RAW_* order.
__host__ __device__ __forceinline__ void dpb_acc_raw(const DpbAcc &a, i64 raw[DPB_NUM_RAW]) {
    raw[DPB_RAW_RUNNING] = a.running;
    raw[DPB_RAW_WAITING] = a.waiting;
    raw[DPB_RAW_SEQLEN_WITHOUT_KV] = a.seqlen_without_kv;
    raw[DPB_RAW_SEQLEN_AWAITING_TRANSFER] = a.seqlen_awaiting_transfer;
    raw[DPB_RAW_FREE_PAGES] = a.free_pages;
    raw[DPB_RAW_EVICTABLE_PAGES] = a.evictable_pages;
    raw[DPB_RAW_BAD_REQ_STATES] = a.bad_req_states;
    raw[DPB_RAW_BAD_PAGE_STATES] = a.bad_page_states;
    raw[DPB_RAW_BAD_SEQLENS] = a.bad_seqlens;
}

// The counting rules for one request row and one KV page. __host__ as well as __device__: the test
// suite runs them on the host (nvcc, no GPU needed) against the NumPy reference.
template <typename S, typename L>
__host__ __device__ __forceinline__ void dpb_count_request(S state, L seqlen, DpbAcc &acc) {
    const i64 s = (i64)state;
    const i64 len = (i64)seqlen;
    // WAITING..RETRACTED are the queued states: one range of codes (snapshot.py asserts it).
    const bool waiting = s >= DPB_REQ_WAITING && s <= DPB_REQ_RETRACTED;
    // A seqlen outside [0, DPB_MAX_SEQLEN] marks the table bad (nothing is published). With the number
    // of rows bounded too (checked on the host before the launch), no sum below can overflow.
    const bool bad_len = (len < 0 || len > DPB_MAX_SEQLEN) && s != DPB_REQ_FREE;
    const i64 counted = bad_len ? 0 : len;
    acc.running += s == DPB_REQ_RUNNING;
    acc.waiting += waiting;
    acc.seqlen_without_kv += (waiting && s != DPB_REQ_TRANSFER) ? counted : 0;
    acc.seqlen_awaiting_transfer += (s == DPB_REQ_PREALLOC || s == DPB_REQ_TRANSFER) ? counted : 0;
    acc.bad_req_states += s < 0 || s >= DPB_NUM_REQ_STATES;
    acc.bad_seqlens += bad_len;
}

template <typename P>
__host__ __device__ __forceinline__ void dpb_count_page(P page, DpbAcc &acc) {
    const i64 p = (i64)page;
    acc.free_pages += p == DPB_PAGE_FREE;
    acc.evictable_pages += p == DPB_PAGE_EVICTABLE;
    acc.bad_page_states += p < 0 || p >= DPB_NUM_PAGE_STATES;
}

// N entries of T read as one aligned load of N * sizeof(T) bytes (1, 2, 4, 8 or 16).
template <int BYTES> struct DpbWord;
template <> struct DpbWord<1> { typedef unsigned char type; };
template <> struct DpbWord<2> { typedef unsigned short type; };
template <> struct DpbWord<4> { typedef unsigned int type; };
template <> struct DpbWord<8> { typedef unsigned long long type; };
template <> struct DpbWord<16> { typedef uint4 type; };

template <typename T, int N> struct DpbChunk {
    typedef typename DpbWord<N * sizeof(T)>::type word;
    union {
        word w;
        T v[N];
    };
};

template <typename T, int N>
__host__ __device__ __forceinline__ void dpb_load(DpbChunk<T, N> &chunk, const T *base, i64 c) {
    typedef typename DpbChunk<T, N>::word word;
#ifdef __CUDA_ARCH__
    chunk.w = __ldg(reinterpret_cast<const word *>(base) + c);  // one vector load through the read-only path
#else
    __builtin_memcpy(&chunk.w, base + c * N, sizeof(word));  // the host test: no aliasing games
#endif
}

__host__ __device__ __forceinline__ bool dpb_aligned(const void *p, unsigned bytes) {
    return ((unsigned long long)p & (bytes - 1u)) == 0ull;  // no size_t: NVRTC has no headers
}

// Rows and pages first, first + stride, ... of the tables' 16-byte chunks, then of the entries the
// chunks leave over, into acc (zeroed here): one thread's grid-stride share on the device, the whole
// tables with (0, 1) on the host. A table whose address is not aligned for its chunk is read entry
// by entry. Requests go in chunks of 16 / (the wider of S and L) rows: one load of each column.
template <typename S, typename L, typename P>
__host__ __device__ __forceinline__ void dpb_count_range(const S *__restrict__ state, const L *__restrict__ seqlen,
                                                         i64 num_requests, const P *__restrict__ pages,
                                                         i64 num_pages, i64 first, i64 stride, DpbAcc &acc) {
    dpb_acc_zero(acc);
    const int RE = DPB_VEC_BYTES / (sizeof(L) > sizeof(S) ? sizeof(L) : sizeof(S));  // rows per chunk
    const int PE = DPB_VEC_BYTES / sizeof(P);  // pages per chunk
    const bool req_vec = dpb_aligned(seqlen, RE * sizeof(L)) && dpb_aligned(state, RE * sizeof(S));
    const i64 req_chunks = req_vec ? num_requests / RE : 0;
    for (i64 c = first; c < req_chunks; c += stride) {
        DpbChunk<S, DPB_VEC_BYTES / (sizeof(L) > sizeof(S) ? sizeof(L) : sizeof(S))> s;
        DpbChunk<L, DPB_VEC_BYTES / (sizeof(L) > sizeof(S) ? sizeof(L) : sizeof(S))> l;
        dpb_load(s, state, c);
        dpb_load(l, seqlen, c);
#pragma unroll
        for (int k = 0; k < RE; k++) dpb_count_request(s.v[k], l.v[k], acc);
    }
    for (i64 i = req_chunks * RE + first; i < num_requests; i += stride) dpb_count_request(state[i], seqlen[i], acc);

    const i64 page_chunks = dpb_aligned(pages, DPB_VEC_BYTES) ? num_pages / PE : 0;
    for (i64 c = first; c < page_chunks; c += stride) {
        DpbChunk<P, DPB_VEC_BYTES / sizeof(P)> p;
        dpb_load(p, pages, c);
#pragma unroll
        for (int k = 0; k < PE; k++) dpb_count_page(p.v[k], acc);
    }
    for (i64 i = page_chunks * PE + first; i < num_pages; i += stride) dpb_count_page(pages[i], acc);
}

template <typename S, typename L, typename P>
__device__ __forceinline__ void dpb_accumulate(const S *__restrict__ state, const L *__restrict__ seqlen,
                                               i64 num_requests, const P *__restrict__ pages, i64 num_pages,
                                               DpbAcc &acc) {
    dpb_count_range(state, seqlen, num_requests, pages, num_pages, (i64)blockIdx.x * blockDim.x + threadIdx.x,
                    (i64)gridDim.x * blockDim.x, acc);
}

template <typename T> __device__ __forceinline__ T dpb_warp_sum(T v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ void dpb_warp_sum_acc(DpbAcc &a) {
    a.running = dpb_warp_sum(a.running);
    a.waiting = dpb_warp_sum(a.waiting);
    a.free_pages = dpb_warp_sum(a.free_pages);
    a.evictable_pages = dpb_warp_sum(a.evictable_pages);
    a.bad_req_states = dpb_warp_sum(a.bad_req_states);
    a.bad_page_states = dpb_warp_sum(a.bad_page_states);
    a.bad_seqlens = dpb_warp_sum(a.bad_seqlens);
    a.seqlen_without_kv = dpb_warp_sum(a.seqlen_without_kv);
    a.seqlen_awaiting_transfer = dpb_warp_sum(a.seqlen_awaiting_transfer);
}

// Sums acc over the block into the global accumulators (one atomicAdd per counter per block);
// returns true in the one thread (thread 0 of the last block to finish) that then holds the grand
// totals in raw. Every thread must call it. A block's 32-bit counts fit: at most 2**32 - 1 entries.
__device__ __forceinline__ bool dpb_reduce(DpbAcc &acc, u64 *accum, u32 *ticket, i64 raw[DPB_NUM_RAW]) {
    __shared__ DpbAcc warp_sums[DPB_MAX_WARPS];
    __shared__ bool is_last;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned num_warps = (blockDim.x + 31u) >> 5;
    dpb_warp_sum_acc(acc);
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        if (lane < num_warps) acc = warp_sums[lane]; else dpb_acc_zero(acc);
        dpb_warp_sum_acc(acc);
        if (lane == 0) {
            dpb_acc_raw(acc, raw);
            // Two's complement: an unsigned add is a signed add.
            for (int k = 0; k < DPB_NUM_RAW; k++) atomicAdd(&accum[k], (u64)raw[k]);
            __threadfence();  // our adds are visible device-wide before our ticket is
            is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        }
    }
    __syncthreads();
    if (!is_last || threadIdx.x != 0) return false;
    __threadfence();
    for (int k = 0; k < DPB_NUM_RAW; k++) {
        // atomicExch reads the total and resets the accumulator for the next launch in one step.
        raw[k] = (i64)atomicExch(&accum[k], 0ull);
    }
    atomicExch(ticket, 0u);
    return true;
}

// raw[DPB_NUM_RAW] (device memory) <- the raw counters of the tables.
template <typename S, typename L, typename P>
__global__ void dpb_raw_counts(const S *state, const L *seqlen, i64 num_requests, const P *pages,
                               i64 num_pages, u64 *accum, u32 *ticket, i64 *raw) {
    DpbAcc a;
    i64 acc[DPB_NUM_RAW];
    dpb_accumulate(state, seqlen, num_requests, pages, num_pages, a);
    if (dpb_reduce(a, accum, ticket, acc)) {
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
    DpbAcc a;
    i64 acc[DPB_NUM_RAW];
    dpb_accumulate(state, seqlen, num_requests, pages, num_pages, a);
    if (!dpb_reduce(a, accum, ticket, acc)) return;

    // The formula, the seqlocked slot write and the status words: dpb_publish_raw (dpboard_loads.h).
    dpb_publish_raw(acc, num_pages, page_size, (volatile i64 *)slot, (volatile i64 *)status, dp_rank,
                    num_received_reqs, timestamp_ns, monotonic_ns, writer_pid, node_id, launch_id);
}

#ifdef DPBOARD_INSTANTIATE
// For the nvcc check of the test suite: the dtype combinations the CuPy loader asks for most.
template __global__ void dpb_raw_counts<signed char, int, signed char>(const signed char *, const int *, i64,
                                                                        const signed char *, i64, u64 *, u32 *,
                                                                        i64 *);
template __global__ void dpb_raw_counts<int, i64, int>(const int *, const i64 *, i64, const int *, i64, u64 *,
                                                        u32 *, i64 *);
// a state column wider than the seqlens: the row chunk follows the wider column
template __global__ void dpb_raw_counts<i64, short, unsigned short>(const i64 *, const short *, i64,
                                                                    const unsigned short *, i64, u64 *, u32 *,
                                                                    i64 *);
template __global__ void dpb_publish<signed char, int, signed char>(const signed char *, const int *, i64,
                                                                     const signed char *, i64, i64, u64 *,
                                                                     u32 *, u64 *, i64, i64, i64, i64, i64,
                                                                     i64, i64 *, i64);
template __global__ void dpb_publish<int, i64, int>(const int *, const i64 *, i64, const int *, i64, i64, u64 *,
                                                     u32 *, u64 *, i64, i64, i64, i64, i64, i64, i64 *, i64);
#endif
