"""Load tables whose figures are known by construction, for the CUDA tests."""

from __future__ import annotations

import numpy as np

from dpboard.snapshot import PageState, ReqState


def step_tables(k: int, n_rows: int = 64, n_pages: int = 4096) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Publish k: k RUNNING and k WAITING rows of 1000 tokens, k USED pages, the rest FREE."""
    state = np.zeros(n_rows, np.int8)
    state[:k] = ReqState.RUNNING
    state[k : 2 * k] = ReqState.WAITING
    pages = np.full(n_pages, PageState.FREE, np.int8)
    pages[:k] = PageState.USED
    return state, np.full(n_rows, 1000, np.int32), pages
