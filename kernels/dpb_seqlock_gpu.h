/*
 * dpb_seqlock_gpu.h: the writer half of dpboard's one seqlock (dpboard/board/dpb_seqlock.h) for a
 * GPU kernel that writes a board slot in mapped host memory, read by the host readers of
 * dpb_seqlock.h unchanged. The write itself (what goes into which word, in which order) is
 * dpb_write_slot of the generated dpboard_loads.h, from dpboard/loads/formula.py, which the
 * numba-cuda kernel runs as well with the same primitives written in Python (dpboard/loads/cuda.py).
 *
 *     dpb_seqlock.h (a CPU writer)            here (a GPU writer, system scope)
 *     [W0] seq.store(odd, relaxed)            [W0] volatile 8-byte store of odd      dpb_gpu_seq_open
 *     [W1] fence(release)                     [W1] __threadfence_system()
 *     [WD] data stores (relaxed atomics)      [WD] volatile 8-byte stores            dpb_write_slot
 *     [W2] seq.store(odd + 1, release)        [W2] __threadfence_system(), then      dpb_gpu_seq_close
 *                                                  volatile 8-byte store of odd + 1
 *
 * __threadfence_system() (membar.sys / fence.sc.sys) makes every write of the thread before it
 * observed by every observer, host CPUs included, before any write after it: over PCIe, where the
 * GPU's posted writes to mapped memory may otherwise arrive out of order, and over NVLink-C2C
 * alike. [W1] keeps the odd store ahead of the data, [W2] the data ahead of the even store, which
 * is what the release fence and the release store do on the CPU; the readers' argument in
 * dpb_seqlock.h then holds as it is. Each store is aligned and 8 bytes wide: one transaction, never
 * torn. (A GPU writer finding its slot odd steps past it, odd + 1 then odd + 2: see write_slot.)
 *
 * Host compilation (the test suite runs the generated functions on the host with nvcc or a C
 * compiler, no GPU needed): the fence is a sequentially consistent one and the rest is the same.
 * The includer defines i64 (long long) first. Only #define lines and functions: NVRTC has no
 * standard library.
 */
#ifndef DPB_SEQLOCK_GPU_H
#define DPB_SEQLOCK_GPU_H

#include "dpboard_layout.h"

#ifndef DPB_FN
#ifdef __CUDACC__
#define DPB_FN __host__ __device__ __forceinline__
#else
#define DPB_FN static inline
#endif
#endif

DPB_FN void dpb_gpu_fence_system(void) {
#ifdef __CUDA_ARCH__
    __threadfence_system();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* The odd store that opens a write, and [W1]. */
DPB_FN void dpb_gpu_seq_open(volatile i64 *slot, i64 odd) {
    slot[DPB_SEQ_OFFSET / 8] = odd; /* [W0] */
    dpb_gpu_fence_system();         /* [W1] */
}

/* [W2]: the write that opened with `odd` is whole (a fence and a store: a system-scope release). */
DPB_FN void dpb_gpu_seq_close(volatile i64 *slot, i64 odd) {
    dpb_gpu_fence_system();             /* [W2] its fence */
    slot[DPB_SEQ_OFFSET / 8] = odd + 1; /* [W2] its store */
}

#endif /* DPB_SEQLOCK_GPU_H */
