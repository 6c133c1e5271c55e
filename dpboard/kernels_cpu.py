"""The Numba CPU backend of ``compute_loads``: one pass over each table, compiled with ``@njit``.

Each pass is branch-free, so LLVM vectorises it. Page tables stored one byte per page (int8 or
uint8, the recommended layout) are counted eight pages per 64-bit word (SWAR: a zero-byte test per
code), which reads a million pages in tens of microseconds. Large tables are split over threads
with ``prange`` reductions; small ones stay serial, where starting the thread pool costs more than
it saves (the thresholds below were measured on a 2-core machine; see docs/KERNELS.md).
Compiled code is cached on disk (``cache=True``): only the first run on a machine pays the compile.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dpboard.loads import NUM_RAW

# Below these sizes a pass runs on one thread. Threads pay off from about 256k pages on an idle
# machine (1M pages: 62 -> 39 µs on 2 cores), but a scheduler shares its cores with the model
# runner and other ranks, and a parallel region then waits for a descheduled worker thread
# (milliseconds, measured). So the defaults keep every realistic table serial; raise the tables'
# size class deliberately (``raw_counts(..., page_parallel_min=...)``) on hosts with idle cores.
REQ_PARALLEL_MIN = 1 << 22
PAGE_PARALLEL_MIN = 1 << 24

# SWAR constants for pages stored one byte each: eight codes per 64-bit word.
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_ONES = np.uint64(0x0101010101010101)
_TWOS = np.uint64(0x0202020202020202)
_U7 = np.uint64(7)
_U56 = np.uint64(56)


@njit(cache=True, nogil=True, inline="always")
def _zero_bytes(x):
    """How many of the eight bytes of x are zero (exact: no carries cross bytes)."""
    high = ~(((x & _LOW7) + _LOW7) | x | _LOW7)  # bit 7 of each zero byte, nothing else
    return ((high >> _U7) * _ONES) >> _U56  # sum of the eight 0/1 bytes, in the top byte


@njit(cache=True, nogil=True, inline="always")
def _req_terms(code, length):
    """One request row: (running, waiting, seqlen without KV, seqlen awaiting transfer, bad code,
    bad seqlen), branch-free so that the loop vectorises."""
    s = np.int64(code)
    n = np.int64(length)
    waiting = (s >= 2) & (s <= 6)
    return (
        np.int64(s == 1),
        np.int64(waiting),
        n * np.int64(waiting & (s != 5)),
        n * np.int64((s == 4) | (s == 5)),
        np.int64((s < 0) | (s > 6)),
        np.int64((n < 0) & (s != 0)),
    )


@njit(cache=True, nogil=True)
def _req_pass_serial(state, seqlen, out):
    running = waiting = without_kv = awaiting = bad = bad_seqlen = np.int64(0)
    for i in range(state.shape[0]):
        r, w, nk, aw, b, bs = _req_terms(state[i], seqlen[i])
        running += r
        waiting += w
        without_kv += nk
        awaiting += aw
        bad += b
        bad_seqlen += bs
    out[0] = running
    out[1] = waiting
    out[2] = without_kv
    out[3] = awaiting
    out[6] = bad
    out[8] = bad_seqlen


@njit(cache=True, nogil=True, parallel=True)
def _req_pass_parallel(state, seqlen, out):
    running = waiting = without_kv = awaiting = bad = bad_seqlen = np.int64(0)
    for i in prange(state.shape[0]):
        r, w, nk, aw, b, bs = _req_terms(state[i], seqlen[i])
        running += r
        waiting += w
        without_kv += nk
        awaiting += aw
        bad += b
        bad_seqlen += bs
    out[0] = running
    out[1] = waiting
    out[2] = without_kv
    out[3] = awaiting
    out[6] = bad
    out[8] = bad_seqlen


@njit(cache=True, nogil=True)
def _page_tail(pages, start, out, free, used, evictable):
    """Finish the byte-wise pass: the last n % 8 pages one by one, then the counters."""
    n = pages.shape[0]
    f = np.int64(free)
    u = np.int64(used)
    e = np.int64(evictable)
    for i in range(start, n):
        p = np.int64(pages[i])
        f += np.int64(p == 0)
        u += np.int64(p == 1)
        e += np.int64(p == 2)
    out[4] = f
    out[5] = e
    out[7] = n - f - u - e  # every byte that is not 0, 1 or 2 (negative int8 included)


@njit(cache=True, nogil=True)
def _page_pass_bytes_serial(pages, out):
    num_words = pages.shape[0] // 8
    words = pages[: num_words * 8].view(np.uint64)
    free = used = evictable = np.uint64(0)
    for i in range(num_words):
        x = words[i]
        free += _zero_bytes(x)
        used += _zero_bytes(x ^ _ONES)
        evictable += _zero_bytes(x ^ _TWOS)
    _page_tail(pages, num_words * 8, out, free, used, evictable)


@njit(cache=True, nogil=True, parallel=True)
def _page_pass_bytes_parallel(pages, out):
    num_words = pages.shape[0] // 8
    words = pages[: num_words * 8].view(np.uint64)
    free = used = evictable = np.uint64(0)
    for i in prange(num_words):
        x = words[i]
        free += _zero_bytes(x)
        used += _zero_bytes(x ^ _ONES)
        evictable += _zero_bytes(x ^ _TWOS)
    _page_tail(pages, num_words * 8, out, free, used, evictable)


@njit(cache=True, nogil=True)
def _page_pass_serial(pages, out):
    free = evictable = bad = np.int64(0)
    for i in range(pages.shape[0]):
        p = np.int64(pages[i])
        free += np.int64(p == 0)
        evictable += np.int64(p == 2)
        bad += np.int64((p < 0) | (p > 2))
    out[4] = free
    out[5] = evictable
    out[7] = bad


@njit(cache=True, nogil=True, parallel=True)
def _page_pass_parallel(pages, out):
    free = evictable = bad = np.int64(0)
    for i in prange(pages.shape[0]):
        p = np.int64(pages[i])
        free += np.int64(p == 0)
        evictable += np.int64(p == 2)
        bad += np.int64((p < 0) | (p > 2))
    out[4] = free
    out[5] = evictable
    out[7] = bad


@njit(cache=True, nogil=True)
def _raw_counts_byte_pages(state, seqlen, pages, out, req_parallel_min, page_parallel_min):
    if state.shape[0] >= req_parallel_min:
        _req_pass_parallel(state, seqlen, out)
    else:
        _req_pass_serial(state, seqlen, out)
    if pages.shape[0] >= page_parallel_min:
        _page_pass_bytes_parallel(pages, out)
    else:
        _page_pass_bytes_serial(pages, out)


@njit(cache=True, nogil=True)
def _raw_counts_wide_pages(state, seqlen, pages, out, req_parallel_min, page_parallel_min):
    if state.shape[0] >= req_parallel_min:
        _req_pass_parallel(state, seqlen, out)
    else:
        _req_pass_serial(state, seqlen, out)
    if pages.shape[0] >= page_parallel_min:
        _page_pass_parallel(pages, out)
    else:
        _page_pass_serial(pages, out)


def kernel_for(page_state: np.ndarray):
    """The compiled entry point for this page table: eight pages per word when they are bytes."""
    if page_state.dtype.itemsize == 1 and page_state.flags.c_contiguous:
        return _raw_counts_byte_pages
    return _raw_counts_wide_pages


def raw_counts(
    req_state: np.ndarray,
    req_seqlen: np.ndarray,
    page_state: np.ndarray,
    out: np.ndarray | None = None,
    *,
    req_parallel_min: int = REQ_PARALLEL_MIN,
    page_parallel_min: int = PAGE_PARALLEL_MIN,
) -> np.ndarray:
    """The raw counters (``dpboard.loads.RAW_FIELDS``) into ``out`` (int64[NUM_RAW], reused) or a new array.

    The tables must already be checked (``dpboard.loads.check_tables``); no copy is made of them.
    """
    if out is None:
        out = np.zeros(NUM_RAW, dtype=np.int64)
    kernel_for(page_state)(req_state, req_seqlen, page_state, out, req_parallel_min, page_parallel_min)
    return out


def warm_up(*dtypes: tuple[np.dtype, np.dtype, np.dtype]) -> None:
    """Compile (or load from the cache) the kernels for these (state, seqlen, page) dtypes now,
    serial and parallel, so that the first scheduler step does not pay for it."""
    for state_dt, seqlen_dt, page_dt in dtypes or ((np.int8, np.int32, np.int8),):
        state = np.zeros(1, dtype=state_dt)
        seqlen = np.zeros(1, dtype=seqlen_dt)
        pages = np.zeros(1, dtype=page_dt)
        raw_counts(state, seqlen, pages, req_parallel_min=0, page_parallel_min=0)
        raw_counts(state, seqlen, pages)
