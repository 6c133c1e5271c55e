"""From the raw counters every backend produces to the load figures, and the message for bad tables.

Every backend reduces the tables to the same raw counters (``dpboard.snapshot.RAW_FIELDS``) and
``finish_raw`` turns them into a ``KVLoads`` with the formulas of docs/KERNELS.md, so the backends cannot disagree
about the formulas. They are written once, in ``formula.load_figures``, which the GPU-direct kernels run as
well (numba-cuda compiles it, ``kernels/dpboard_loads.h`` is its CUDA C)::

    max_total_num_tokens = num_pages * page_size
    num_used_tokens      = (num_pages - #FREE pages - #EVICTABLE pages) * page_size
    num_running_reqs     = #RUNNING
    num_waiting_reqs     = #WAITING + #BOOTSTRAP + #PREALLOC + #TRANSFER + #RETRACTED
    num_total_tokens     = num_used_tokens + sum(seqlen over WAITING, BOOTSTRAP, PREALLOC, RETRACTED)
    num_active_tokens    = max(0, num_total_tokens - sum(seqlen over PREALLOC, TRANSFER))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dpboard.loads.formula import (  # noqa: F401  (the raw counters' indices, as this module always named them)
    BAD_PAGE_STATES,
    BAD_REQ_STATES,
    BAD_SEQLENS,
    EVICTABLE_PAGES,
    FREE_PAGES,
    RUNNING,
    SEQLEN_AWAITING_TRANSFER,
    SEQLEN_WITHOUT_KV,
    WAITING,
    has_errors,
    load_figures,
)
from dpboard.snapshot import MAX_SEQLEN, PageState, ReqState

_STATE_NAMES = ", ".join(f"{s.value}={s.name}" for s in ReqState)
_PAGE_NAMES = ", ".join(f"{s.value}={s.name}" for s in PageState)


class KVLoads(NamedTuple):
    """The load figures of one rank, as ``compute_loads`` returns them (names as in LoadSnapshot)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_total_tokens: int
    num_active_tokens: int
    max_total_num_tokens: int


def finish_raw(raw: Any, num_pages: int, page_size: int) -> KVLoads:
    """The formulas of docs/KERNELS.md (``formula.load_figures``) on the raw counters, as Python
    ints: no overflow."""
    counters = raw.tolist() if isinstance(raw, np.ndarray) else [int(x) for x in raw]
    return KVLoads._make(load_figures(counters, int(num_pages), int(page_size)))


def raw_has_errors(raw: Any) -> bool:
    return bool(has_errors(raw))


def _first_bad(values: np.ndarray, bad: np.ndarray, name: str) -> str:
    """``name[i] = v`` for the first entry the ``bad`` mask marks (``?`` if none does)."""
    where = np.flatnonzero(bad)
    return f"{name}[{int(where[0])}] = {int(values[where[0]])}" if where.size else f"{name}[?]"


def describe_bad(raw: Any, req_state: Any, req_seqlen: Any, page_state: Any) -> str:
    """The error message for raw counters that report bad entries (host arrays; the slow path)."""
    state = np.asarray(req_state).astype(np.int64)
    problems = []
    if raw[BAD_REQ_STATES]:
        first = _first_bad(state, (state < 0) | (state >= len(ReqState)), "req_state")
        problems.append(
            f"req_state has {int(raw[BAD_REQ_STATES])} code(s) outside ReqState ({_STATE_NAMES}); the first is {first}"
        )
    if raw[BAD_PAGE_STATES]:
        pages = np.asarray(page_state).astype(np.int64)
        first = _first_bad(pages, (pages < 0) | (pages >= len(PageState)), "page_state")
        problems.append(
            f"page_state has {int(raw[BAD_PAGE_STATES])} code(s) outside PageState ({_PAGE_NAMES}); the first is {first}"
        )
    if raw[BAD_SEQLENS]:
        seqlen = np.asarray(req_seqlen).astype(np.int64)
        first = _first_bad(seqlen, ((seqlen < 0) | (seqlen > MAX_SEQLEN)) & (state != int(ReqState.FREE)),
                           "req_seqlen")
        problems.append(
            f"req_seqlen has {int(raw[BAD_SEQLENS])} value(s) outside [0, {MAX_SEQLEN}] (2**32 tokens) in rows "
            f"that are not FREE; the first is {first}"
        )
    return "; ".join(problems) + ": fix the scheduler's tables (nothing was published)"
