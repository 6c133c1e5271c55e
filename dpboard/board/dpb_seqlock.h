/*
 * dpb_seqlock.h: dpboard's one seqlock. A row is a 64-bit sequence word, then the words it guards;
 * one writer per row, any number of readers in any process that maps it. A board slot
 * (slot_writer.c's SlotWriter, board_reader.c's BoardView) and every row of a side record (the sent
 * record, the dispatch record, a side file's claim: side_rows.c's SeqRow and read_rows) are written
 * and read with these.
 *
 * Writer (never waits; never reads what a reader writes):
 *     seq.store(odd, relaxed)          -- [W0] dpb_seq_open: a write is in progress
 *     fence(release)                   -- [W1]
 *     data stores                      -- [WD] relaxed atomics here; a side record's NumPy stores
 *     seq.store(odd + 1, release)      -- [W2] dpb_seq_close: the write is whole
 * Reader (bounded: max_retries attempts, then the row is torn):
 *     s1 = seq.load(acquire)           -- [R1] dpb_seq_read_begin; odd: retry
 *     data loads (relaxed)             -- [RD]
 *     fence(acquire)                   -- [R2] dpb_seq_read_end
 *     s2 = seq.load(relaxed)           -- [R3] s1 == s2: the copy is one whole write, else retry
 *
 * Why a reader never accepts a mix of two writes:
 *   - [W2] is a release store, [R1] an acquire load: a reader that reads s1 = odd + 1 sees every
 *     data store made before [W2], i.e. the whole write that ended there (or a later one).
 *   - A data load that returned a store of the *next* write (which opens with odd + 2): that store
 *     follows that write's release fence [W1], the load precedes the acquire fence [R2], so
 *     (C11 7.17.4, fence-to-fence) the odd store happens before the load of s2: s2 != s1, retry.
 *   - A torn word (a store racing a load) is in a copy that the same argument rejects.
 * The data stores of a side record are made by NumPy between two calls (SeqRow.begin/end): plain
 * stores, but [W1] and [W2] are in separate, opaque calls, so no compiler moves a store across
 * them, and the CPU orders them by the fence and the release store, as it does relaxed atomics.
 * What it costs: x86-64 (TSO) keeps stores with stores and loads with loads: the release and
 * acquire are plain MOVs and the fences compiler barriers. aarch64 (Grace) does not: [W1] is
 * `dmb ish`, [W2] `stlr`, [R1] `ldar`, [R2] `dmb ishld`; without them a reader may see the new
 * sequence before the data it guards.
 * Each access above is made on a line of this file that carries its mark in a comment, and a writer
 * or reader makes its data accesses with dpb_store_word(s) [WD] and dpb_load_words [RD]. So
 * tests/board/test_seqlock_aarch64.py, which compiles the module for aarch64 with line information,
 * finds every function that makes a marked access (in no list) and checks, on every path through it,
 * that each barrier lies between the right two accesses: [W1] after [W0] and before every [WD];
 * every [WD] before [W2], whose store releases; [R1] acquiring before every [RD]; [R2] after every
 * [RD] and before [R3]. A stronger barrier (seq_cst, `dmb sy`) passes.
 * A writer killed between [W0] and [W2] leaves the row odd: readers report it torn, and the next
 * writer keeps it odd (dpb_seq_begin) and closes it even, which makes the row whole again.
 */
#ifndef DPB_SEQLOCK_H
#define DPB_SEQLOCK_H

#include <stddef.h>
#include <stdint.h>

static inline void dpb_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* The writer's odd store and [W1]. */
static inline void dpb_seq_open(uint64_t *seq, uint64_t odd) {
    __atomic_store_n(seq, odd, __ATOMIC_RELAXED); /* [W0] */
    __atomic_thread_fence(__ATOMIC_RELEASE);      /* [W1] */
}

/* [W2]: the write that opened with `odd` is whole. */
static inline void dpb_seq_close(uint64_t *seq, uint64_t odd) {
    __atomic_store_n(seq, odd + 1, __ATOMIC_RELEASE); /* [W2] */
}

/* Open a write on a row whose writer keeps no count of its own: the row's sequence is read (only
   this writer stores it) and made odd, or kept odd when a dead writer left it so. Returns the odd
   value, for dpb_seq_close. */
static inline uint64_t dpb_seq_begin(uint64_t *seq) {
    uint64_t odd = __atomic_load_n(seq, __ATOMIC_RELAXED) | 1;
    dpb_seq_open(seq, odd);
    return odd;
}

/* The first read of a row: [R1]. */
static inline uint64_t dpb_seq_read_begin(const uint64_t *seq) {
    return __atomic_load_n(seq, __ATOMIC_ACQUIRE); /* [R1] */
}

/* [R2], then the second read: whether the data loaded since dpb_seq_read_begin returned s1 are one
   whole write. */
static inline int dpb_seq_read_end(const uint64_t *seq, uint64_t s1) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);              /* [R2] */
    return __atomic_load_n(seq, __ATOMIC_RELAXED) == s1; /* [R3] */
}

/* The data accesses between them: every writer stores and every reader loads a guarded word here. */
static inline void dpb_store_word(uint64_t *dst, uint64_t v) {
    __atomic_store_n(dst, v, __ATOMIC_RELAXED); /* [WD] */
}

static inline void dpb_store_words(uint64_t *dst, const uint64_t *src, size_t n) {
    for (size_t k = 0; k < n; k++) dpb_store_word(&dst[k], src[k]);
}

static inline void dpb_load_words(uint64_t *dst, const uint64_t *src, size_t n) {
    for (size_t k = 0; k < n; k++) dst[k] = __atomic_load_n(&src[k], __ATOMIC_RELAXED); /* [RD] */
}

/* Copy the `words` words of the row at `row` (its sequence first) into `out`, from one whole
   write: 1, or 0 when every one of `max_retries` attempts met a write (odd, or changed under the
   copy; `out` then holds the last attempt's words, or is untouched). */
static inline int dpb_read_row(const uint64_t *row, uint64_t *out, size_t words, int max_retries) {
    for (int attempt = 0; attempt < max_retries; attempt++) {
        uint64_t s1 = dpb_seq_read_begin(row);
        if (!(s1 & 1)) {
            dpb_load_words(out, row, words);
            if (dpb_seq_read_end(row, s1)) return 1;
        }
        dpb_cpu_relax();
    }
    return 0;
}

#endif /* DPB_SEQLOCK_H */
