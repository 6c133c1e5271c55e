"""The Numba CPU backend of ``compute_loads``: one pass over each table, compiled with ``@njit``.

Each pass is branch-free, so LLVM vectorises it. Page tables stored one byte per page (int8 or
uint8, the recommended layout) are counted eight pages per 64-bit word (SWAR: per-byte tests for
FREE and EVICTABLE summed in byte lanes, and a flag for codes above 2), which reads a million pages
in under 40 µs on one core. Large tables are split over threads
with ``prange`` reductions; small ones stay serial, where starting the thread pool costs more than
it saves (the thresholds below were measured on a 2-core machine; see docs/KERNELS.md).
Compiled code is cached on disk (``cache=True``): only the first run on a machine pays the compile.
"""

from __future__ import annotations

import types

import numpy as np
from numba import njit, prange

from dpboard.loads.counters import (
    BAD_PAGE_STATES,
    BAD_REQ_STATES,
    BAD_SEQLENS,
    EVICTABLE_PAGES,
    FREE_PAGES,
    RUNNING,
    SEQLEN_AWAITING_TRANSFER,
    SEQLEN_WITHOUT_KV,
    WAITING,
)
from dpboard.snapshot import MAX_SEQLEN, NUM_RAW, PageState, ReqState

# The codes as plain ints (Numba freezes module globals into the compiled code).
_R_FREE, _R_RUNNING, _R_PREALLOC, _R_TRANSFER = (int(s) for s in (ReqState.FREE, ReqState.RUNNING,
                                                                 ReqState.PREALLOC, ReqState.TRANSFER))
_R_FIRST_QUEUED, _R_LAST_QUEUED = int(ReqState.WAITING), int(ReqState.RETRACTED)
_R_MAX = int(max(ReqState))
_P_FREE, _P_EVICTABLE, _P_MAX = int(PageState.FREE), int(PageState.EVICTABLE), int(max(PageState))
_MAX_SEQLEN = MAX_SEQLEN
# The branch-free request pass counts WAITING..RETRACTED as one range of codes, and the SWAR page
# pass tests bytes for zero (FREE) and for codes above 2: both rest on these code values.
assert [int(s) for s in ReqState] == list(range(_R_MAX + 1)) and _R_LAST_QUEUED == _R_MAX
assert (_P_FREE, _P_EVICTABLE, _P_MAX) == (0, 2, 2)

# Below these sizes a pass runs on one thread. Threads pay off from about 256k pages on an idle
# machine (1M pages: 62 -> 39 µs on 2 cores), but a scheduler shares its cores with the model
# runner and other ranks, and a parallel region then waits for a descheduled worker thread
# (milliseconds, measured). So the defaults keep every realistic table serial; raise the tables'
# size class deliberately (``raw_counts(..., page_parallel_min=...)``) on hosts with idle cores.
REQ_PARALLEL_MIN = 1 << 22
PAGE_PARALLEL_MIN = 1 << 24

# SWAR constants for pages stored one byte each: eight codes per 64-bit word, counted in byte lanes
# over blocks of 255 words (a lane holds at most 255) and summed once per block.
_BLOCK_WORDS = 255
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGHS = np.uint64(0x8080808080808080)
_TWOS = np.uint64(0x0202020202020202)
_GT2 = np.uint64(0x7D7D7D7D7D7D7D7D)  # (v & 0x7F) + 0x7D carries into bit 7 iff v & 0x7F > 2
_EVEN_BYTES = np.uint64(0x00FF00FF00FF00FF)
_SUM16 = np.uint64(0x0001000100010001)
_U7 = np.uint64(7)
_U8 = np.uint64(8)
_U48 = np.uint64(48)


def _serial_and_parallel(pass_):
    """A pass written once (its loop a ``prange``) compiled twice: serial, where ``prange`` runs as
    ``range``, and over threads. Each build compiles a copy of the function under its own name,
    because Numba's disk cache tells functions apart by name and bytecode, not by compile options."""
    builds = []
    for parallel in (False, True):
        name = f"{pass_.__name__}_{'parallel' if parallel else 'serial'}"
        copy = types.FunctionType(pass_.__code__, pass_.__globals__, name)
        copy.__qualname__ = name
        builds.append(njit(cache=True, nogil=True, parallel=parallel)(copy))
    return tuple(builds)


@njit(cache=True, nogil=True, inline="always")
def _req_terms(code, length):
    """One request row: (running, waiting, seqlen without KV, seqlen awaiting transfer, bad code,
    bad seqlen), branch-free so that the loop vectorises. A seqlen outside [0, MAX_SEQLEN] is bad
    and adds nothing to the sums, which therefore cannot overflow (the rows are bounded too)."""
    s = np.int64(code)
    n = np.int64(length)
    in_range = (n >= 0) & (n <= _MAX_SEQLEN)
    n = n * np.int64(in_range)
    waiting = (s >= _R_FIRST_QUEUED) & (s <= _R_LAST_QUEUED)
    return (
        np.int64(s == _R_RUNNING),
        np.int64(waiting),
        n * np.int64(waiting & (s != _R_TRANSFER)),
        n * np.int64((s == _R_PREALLOC) | (s == _R_TRANSFER)),
        np.int64((s < 0) | (s > _R_MAX)),
        np.int64((~in_range) & (s != _R_FREE)),
    )


def _req_pass(state, seqlen, out):
    running = waiting = without_kv = awaiting = bad = bad_seqlen = np.int64(0)
    for i in prange(state.shape[0]):
        r, w, nk, aw, b, bs = _req_terms(state[i], seqlen[i])
        running += r
        waiting += w
        without_kv += nk
        awaiting += aw
        bad += b
        bad_seqlen += bs
    out[RUNNING] = running
    out[WAITING] = waiting
    out[SEQLEN_WITHOUT_KV] = without_kv
    out[SEQLEN_AWAITING_TRANSFER] = awaiting
    out[BAD_REQ_STATES] = bad
    out[BAD_SEQLENS] = bad_seqlen


_req_pass_serial, _req_pass_parallel = _serial_and_parallel(_req_pass)


@njit(cache=True, nogil=True, inline="always")
def _byte_sum(lanes):
    """Sum of the eight byte lanes of a uint64 (each lane <= 255)."""
    pairs = (lanes & _EVEN_BYTES) + ((lanes >> _U8) & _EVEN_BYTES)
    return (pairs * _SUM16) >> _U48


@njit(cache=True, nogil=True, inline="always")
def _word_counts(x, free, evictable, out_of_range):
    """One 64-bit word of eight byte codes: +1 in the byte lane of each FREE (0) and EVICTABLE (2)
    byte, and bit 7 of a lane in out_of_range once its code was > 2 (negative int8 included)."""
    low = x & _LOW7
    free += ((~((low + _LOW7) | x)) & _HIGHS) >> _U7
    y = x ^ _TWOS
    evictable += ((~(((y & _LOW7) + _LOW7) | y)) & _HIGHS) >> _U7
    out_of_range |= (low + _GT2) | x
    return free, evictable, out_of_range


@njit(cache=True, nogil=True, inline="always")
def _block_counts(blocks, b):
    """FREE and EVICTABLE bytes of 255 words (byte lanes cannot overflow), and their bad-code bits.
    The fixed trip count is what lets LLVM vectorise the loop."""
    free = evictable = out_of_range = np.uint64(0)
    for j in range(_BLOCK_WORDS):
        free, evictable, out_of_range = _word_counts(blocks[b, j], free, evictable, out_of_range)
    return _byte_sum(free), _byte_sum(evictable), out_of_range & _HIGHS


@njit(cache=True, nogil=True)
def _page_tail(pages, start, out, free, evictable, any_out_of_range):
    """Finish the byte-wise pass: the pages after the whole blocks, then the counters.

    The block loop counts FREE and EVICTABLE and only notes whether some code was outside 0..2; the
    exact number of bad codes (for the error message) costs a second pass, and only in that case."""
    n = pages.shape[0]
    f = np.int64(free)
    e = np.int64(evictable)
    bad = np.int64(0)
    for i in range(start, n):
        p = np.int64(pages[i])
        f += np.int64(p == _P_FREE)
        e += np.int64(p == _P_EVICTABLE)
        bad += np.int64((p < 0) | (p > _P_MAX))
    if any_out_of_range:
        for i in range(start):
            p = np.int64(pages[i])
            bad += np.int64((p < 0) | (p > _P_MAX))
    out[FREE_PAGES] = f
    out[EVICTABLE_PAGES] = e
    out[BAD_PAGE_STATES] = bad


def _page_pass_bytes(pages, out):
    num_blocks = pages.shape[0] // (8 * _BLOCK_WORDS)
    blocks = pages[: num_blocks * 8 * _BLOCK_WORDS].view(np.uint64).reshape(num_blocks, _BLOCK_WORDS)
    free = evictable = bad_blocks = np.uint64(0)  # bad blocks counted: prange reduces sums, not ORs
    for b in prange(num_blocks):
        f, e, bits = _block_counts(blocks, b)
        free += f
        evictable += e
        bad_blocks += np.uint64(bits != 0)
    _page_tail(pages, num_blocks * 8 * _BLOCK_WORDS, out, free, evictable, bad_blocks != 0)


def _page_pass(pages, out):
    free = evictable = bad = np.int64(0)
    for i in prange(pages.shape[0]):
        p = np.int64(pages[i])
        free += np.int64(p == _P_FREE)
        evictable += np.int64(p == _P_EVICTABLE)
        bad += np.int64((p < 0) | (p > _P_MAX))
    out[FREE_PAGES] = free
    out[EVICTABLE_PAGES] = evictable
    out[BAD_PAGE_STATES] = bad


_page_pass_bytes_serial, _page_pass_bytes_parallel = _serial_and_parallel(_page_pass_bytes)
_page_pass_serial, _page_pass_parallel = _serial_and_parallel(_page_pass)


@njit(cache=True, nogil=True, inline="always")
def _req_counts(state, seqlen, out, parallel_min):
    """The request pass, over threads from ``parallel_min`` rows."""
    if state.shape[0] >= parallel_min:
        _req_pass_parallel(state, seqlen, out)
    else:
        _req_pass_serial(state, seqlen, out)


@njit(cache=True, nogil=True)
def _raw_counts_byte_pages(state, seqlen, pages, out, req_parallel_min, page_parallel_min):
    _req_counts(state, seqlen, out, req_parallel_min)
    if pages.shape[0] >= page_parallel_min:
        _page_pass_bytes_parallel(pages, out)
    else:
        _page_pass_bytes_serial(pages, out)


@njit(cache=True, nogil=True)
def _raw_counts_wide_pages(state, seqlen, pages, out, req_parallel_min, page_parallel_min):
    _req_counts(state, seqlen, out, req_parallel_min)
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
    """The raw counters (``dpboard.snapshot.RAW_FIELDS``) into ``out`` (int64[NUM_RAW], reused) or a new array.

    The tables must already be checked (``dpboard.loads.tables.check_tables``); no copy is made of them.
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
