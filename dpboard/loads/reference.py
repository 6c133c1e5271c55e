"""The NumPy reference backend: the raw counters written for clarity, not speed.

Every other backend is tested against it.
"""

from __future__ import annotations

import numpy as np

from dpboard.loads import counters as c
from dpboard.snapshot import MAX_SEQLEN, NUM_RAW, PageState, ReqState


def raw_counts_numpy(req_state: np.ndarray, req_seqlen: np.ndarray, page_state: np.ndarray) -> np.ndarray:
    """The raw counters: count each code, sum seqlens under a mask per state."""
    S = ReqState
    state = np.asarray(req_state)
    seqlen = np.asarray(req_seqlen).astype(np.int64)
    pages = np.asarray(page_state)
    # A seqlen outside [0, MAX_SEQLEN] makes the table bad and adds nothing to the sums, which then
    # fit int64 (the number of rows is bounded by check_tables).
    in_range = (seqlen >= 0) & (seqlen <= MAX_SEQLEN)
    bad_seqlen = ~in_range & (state != int(S.FREE))
    seqlen = np.where(in_range, seqlen, 0)
    # int(code): NumPy would compare an array with an IntEnum member element by element in Python.
    per_state = {s: np.count_nonzero(state == int(s)) for s in S}
    seqlen_of = {s: int(seqlen[state == int(s)].sum()) for s in S if s not in (S.FREE, S.RUNNING)}
    per_page = {p: np.count_nonzero(pages == int(p)) for p in PageState}

    raw = np.zeros(NUM_RAW, dtype=np.int64)
    raw[c.RUNNING] = per_state[S.RUNNING]
    raw[c.WAITING] = sum(per_state[s] for s in (S.WAITING, S.BOOTSTRAP, S.PREALLOC, S.TRANSFER, S.RETRACTED))
    raw[c.SEQLEN_WITHOUT_KV] = sum(seqlen_of[s] for s in (S.WAITING, S.BOOTSTRAP, S.PREALLOC, S.RETRACTED))
    raw[c.SEQLEN_AWAITING_TRANSFER] = seqlen_of[S.PREALLOC] + seqlen_of[S.TRANSFER]
    raw[c.FREE_PAGES] = per_page[PageState.FREE]
    raw[c.EVICTABLE_PAGES] = per_page[PageState.EVICTABLE]
    raw[c.BAD_REQ_STATES] = state.size - sum(per_state.values())  # codes that are no ReqState
    raw[c.BAD_PAGE_STATES] = pages.size - sum(per_page.values())
    raw[c.BAD_SEQLENS] = np.count_nonzero(bad_seqlen)
    return raw
