"""Load numbers from a scheduler's request and KV page tables (SPEC section 4).

A scheduler keeps one row per request slot (``req_state``, ``req_seqlen``) and one entry per KV page
(``page_state``). ``compute_loads`` turns them into the token and queue figures of a snapshot:

    max_total_num_tokens = num_pages * page_size
    num_used_tokens      = (num_pages - #FREE pages - #EVICTABLE pages) * page_size
    num_running_reqs     = #RUNNING
    num_waiting_reqs     = #WAITING + #BOOTSTRAP + #PREALLOC + #TRANSFER + #RETRACTED
    num_total_tokens     = num_used_tokens + sum(seqlen over WAITING, BOOTSTRAP, PREALLOC, RETRACTED)
    num_active_tokens    = max(0, num_total_tokens - sum(seqlen over PREALLOC, TRANSFER))

All sums are int64. The seqlen of a FREE row is ignored (a scheduler may leave anything there); a
negative seqlen in any other row is an error.

Every backend reduces the tables to the same nine raw counters (``RAW_FIELDS``) and ``finish_raw``
turns those into a ``KVLoads``, so the backends cannot disagree about the formulas. The kernels
count out-of-range codes and negative seqlens as they go, and the error (naming the first bad
entry) is raised afterwards: validation costs no extra pass over the tables.

This module imports NumPy only; the Numba and CUDA backends are imported on first use.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np

from dpboard.snapshot import MAX_INT64

BACKENDS: tuple[str, ...] = ("auto", "numpy", "numba", "numba-cuda", "cupy")
CUDA_BACKENDS: tuple[str, ...] = ("numba-cuda", "cupy")


class ReqState(enum.IntEnum):
    """State of one row of the request table (``req_state``)."""

    FREE = 0  # empty row: not a request
    RUNNING = 1  # in the running batch; holds its KV
    WAITING = 2  # waiting queue; no KV yet
    BOOTSTRAP = 3  # PD prefill bootstrap queue; no KV yet
    PREALLOC = 4  # PD decode prealloc queue; no KV yet, and waits for a transfer
    TRANSFER = 5  # PD decode transfer queue; holds its KV, waits for the transfer to finish
    RETRACTED = 6  # retracted from the running batch; its KV was freed


class PageState(enum.IntEnum):
    """State of one KV page (``page_state``)."""

    FREE = 0
    USED = 1  # held by a request or a locked prefix
    EVICTABLE = 2  # cached prefix nobody references


class KVLoads(NamedTuple):
    """The load figures of one rank, as ``compute_loads`` returns them (names as in LoadSnapshot)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    num_total_tokens: int
    num_active_tokens: int
    max_total_num_tokens: int


# The raw counters every backend produces, in this order (kernels/loads.cu uses the same indices).
RAW_FIELDS: tuple[str, ...] = (
    "running",  # #RUNNING
    "waiting",  # #WAITING + #BOOTSTRAP + #PREALLOC + #TRANSFER + #RETRACTED
    "seqlen_without_kv",  # sum of seqlen over WAITING, BOOTSTRAP, PREALLOC, RETRACTED
    "seqlen_awaiting_transfer",  # sum of seqlen over PREALLOC, TRANSFER
    "free_pages",
    "evictable_pages",
    "bad_req_states",  # codes outside ReqState
    "bad_page_states",  # codes outside PageState
    "bad_seqlens",  # negative seqlens in rows that are not FREE
)
NUM_RAW = len(RAW_FIELDS)
NUM_REQ_STATES = len(ReqState)
NUM_PAGE_STATES = len(PageState)
_BAD_REQ, _BAD_PAGE, _BAD_SEQLEN = 6, 7, 8

_STATE_NAMES = ", ".join(f"{s.value}={s.name}" for s in ReqState)
_PAGE_NAMES = ", ".join(f"{s.value}={s.name}" for s in PageState)


# -- inputs --------------------------------------------------------------------------------------


def array_info(x: Any, what: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    """(dtype, shape, is_device) of a host array or of anything with ``__cuda_array_interface__``."""
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return np.dtype(cai["typestr"]), tuple(cai["shape"]), True
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is None or shape is None:
        raise ValueError(
            f"{what} must be a NumPy array or a device array (CuPy, PyTorch, Numba), got "
            f"{type(x).__name__}: pass np.asarray({what}, dtype=np.int32)"
        )
    return np.dtype(dtype), tuple(shape), False


def _check_dtype(dtype: np.dtype, what: str, *, seqlen: bool = False) -> None:
    if dtype.kind not in "iu" or dtype == np.uint64:
        hint = "int32 or int64" if seqlen else "int8, uint8 or int32"
        raise ValueError(
            f"{what} has dtype {dtype}, but it must hold signed integers or unsigned ones of up to 32 bits: "
            f"store it as {hint}"
        )


def check_tables(req_state: Any, req_seqlen: Any, page_state: Any, page_size: Any) -> tuple[int, int, bool]:
    """Check shapes, dtypes and page_size (not the values, which the kernels count).

    Returns (num_requests, num_pages, on_device). Raises ValueError naming the problem.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise ValueError(f"page_size must be a positive integer (tokens per KV page), got {page_size!r}")
    if page_size <= 0:
        raise ValueError(f"page_size must be a positive integer (tokens per KV page), got {page_size}")
    infos = {}
    for what, x in (("req_state", req_state), ("req_seqlen", req_seqlen), ("page_state", page_state)):
        dtype, shape, on_device = array_info(x, what)
        _check_dtype(dtype, what, seqlen=what == "req_seqlen")
        if len(shape) != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {shape}: pass {what}.reshape(-1)")
        infos[what] = (shape[0], on_device)
    num_requests, num_seqlens, num_pages = (infos[w][0] for w in ("req_state", "req_seqlen", "page_state"))
    if num_requests != num_seqlens:
        raise ValueError(
            f"req_state has {num_requests} rows but req_seqlen has {num_seqlens}: both describe the same "
            f"request table and must have one entry per row"
        )
    devices = {on_device for _, on_device in infos.values()}
    if len(devices) != 1:
        where = ", ".join(f"{w} on {'device' if d else 'host'}" for w, (_, d) in infos.items())
        raise ValueError(f"the tables must all be host arrays or all device arrays, got {where}")
    if num_pages * int(page_size) > MAX_INT64:
        raise ValueError(
            f"{num_pages} pages of {page_size} tokens overflow int64: page_size is probably wrong"
        )
    return num_requests, num_pages, devices.pop()


# -- the result ----------------------------------------------------------------------------------


def _first_bad(values: np.ndarray, bad: np.ndarray, name: str) -> str:
    """``name[i] = v`` for the first entry the ``bad`` mask marks (``?`` if none does)."""
    where = np.flatnonzero(bad)
    return f"{name}[{int(where[0])}] = {int(values[where[0]])}" if where.size else f"{name}[?]"


def describe_bad(raw: Any, req_state: Any, req_seqlen: Any, page_state: Any) -> str:
    """The error message for raw counters that report bad entries (host arrays; the slow path)."""
    state = np.asarray(req_state).astype(np.int64)
    problems = []
    if raw[_BAD_REQ]:
        first = _first_bad(state, (state < 0) | (state >= NUM_REQ_STATES), "req_state")
        problems.append(
            f"req_state has {int(raw[_BAD_REQ])} code(s) outside ReqState ({_STATE_NAMES}); the first is {first}"
        )
    if raw[_BAD_PAGE]:
        pages = np.asarray(page_state).astype(np.int64)
        first = _first_bad(pages, (pages < 0) | (pages >= NUM_PAGE_STATES), "page_state")
        problems.append(
            f"page_state has {int(raw[_BAD_PAGE])} code(s) outside PageState ({_PAGE_NAMES}); the first is {first}"
        )
    if raw[_BAD_SEQLEN]:
        seqlen = np.asarray(req_seqlen).astype(np.int64)
        first = _first_bad(seqlen, (seqlen < 0) & (state != int(ReqState.FREE)), "req_seqlen")
        problems.append(
            f"req_seqlen has {int(raw[_BAD_SEQLEN])} negative value(s) in rows that are not FREE; the first "
            f"is {first}"
        )
    return "; ".join(problems) + ": fix the scheduler's tables (nothing was published)"


def finish_raw(raw: Any, num_pages: int, page_size: int) -> KVLoads:
    """The SPEC formulas on the raw counters (Python ints: no overflow)."""
    used = (num_pages - int(raw[4]) - int(raw[5])) * page_size
    total = used + int(raw[2])
    return KVLoads(
        num_running_reqs=int(raw[0]),
        num_waiting_reqs=int(raw[1]),
        num_used_tokens=used,
        num_total_tokens=total,
        num_active_tokens=max(0, total - int(raw[3])),
        max_total_num_tokens=num_pages * page_size,
    )


def raw_has_errors(raw: Any) -> bool:
    return bool(raw[_BAD_REQ] or raw[_BAD_PAGE] or raw[_BAD_SEQLEN])


def check_raw(raw: Any, req_state: Any, req_seqlen: Any, page_state: Any, *, on_device: bool) -> None:
    """Raise the ValueError naming the first bad entry when the kernel counted any.

    Device tables are copied to the host for the message, and only then: the good path costs nothing.
    """
    if not raw_has_errors(raw):
        return
    if on_device:
        from dpboard import kernels_cuda

        req_state, req_seqlen, page_state = (kernels_cuda.to_host(x) for x in (req_state, req_seqlen, page_state))
    raise ValueError(describe_bad(raw, req_state, req_seqlen, page_state))


# -- the NumPy reference -------------------------------------------------------------------------


def raw_counts_numpy(req_state: np.ndarray, req_seqlen: np.ndarray, page_state: np.ndarray) -> np.ndarray:
    """The raw counters, written for clarity: count each code, sum seqlens under a mask per state."""
    S = ReqState
    state = np.asarray(req_state)
    seqlen = np.asarray(req_seqlen).astype(np.int64)  # int64 sums: no overflow
    pages = np.asarray(page_state)
    # int(code): NumPy would compare an array with an IntEnum member element by element in Python.
    per_state = {s: np.count_nonzero(state == int(s)) for s in S}
    seqlen_of = {s: int(seqlen[state == int(s)].sum()) for s in S if s not in (S.FREE, S.RUNNING)}
    per_page = {p: np.count_nonzero(pages == int(p)) for p in PageState}

    raw = np.zeros(NUM_RAW, dtype=np.int64)
    raw[0] = per_state[S.RUNNING]
    raw[1] = sum(per_state[s] for s in (S.WAITING, S.BOOTSTRAP, S.PREALLOC, S.TRANSFER, S.RETRACTED))
    raw[2] = sum(seqlen_of[s] for s in (S.WAITING, S.BOOTSTRAP, S.PREALLOC, S.RETRACTED))
    raw[3] = seqlen_of[S.PREALLOC] + seqlen_of[S.TRANSFER]
    raw[4] = per_page[PageState.FREE]
    raw[5] = per_page[PageState.EVICTABLE]
    raw[6] = state.size - sum(per_state.values())  # codes that are no ReqState
    raw[7] = pages.size - sum(per_page.values())
    raw[8] = np.count_nonzero((seqlen < 0) & (state != int(S.FREE)))
    return raw


# -- the entry point -----------------------------------------------------------------------------


def resolve_backend(backend: str, on_device: bool) -> str:
    """The backend ``compute_loads`` uses for ``backend`` and tables on host or device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "auto":
        if not on_device:
            return "numba"
        from dpboard import kernels_cuda

        return "cupy" if kernels_cuda.cupy_available() else "numba-cuda"
    if on_device and backend in ("numpy", "numba"):
        raise ValueError(
            f"backend {backend!r} runs on the CPU but the tables are device arrays: use backend='auto', "
            f"'cupy' or 'numba-cuda', or copy the tables to the host"
        )
    return backend


def raw_counts(req_state: Any, req_seqlen: Any, page_state: Any, backend: str) -> np.ndarray:
    """The raw counters from a concrete backend (validation of shapes and dtypes already done)."""
    if backend == "numpy":
        return raw_counts_numpy(req_state, req_seqlen, page_state)
    if backend == "numba":
        from dpboard import kernels_cpu

        return kernels_cpu.raw_counts(req_state, req_seqlen, page_state)
    from dpboard import kernels_cuda

    return kernels_cuda.raw_counts(req_state, req_seqlen, page_state, backend=backend)


def compute_loads(
    req_state: Any,
    req_seqlen: Any,
    page_state: Any,
    *,
    page_size: int,
    backend: str = "auto",
) -> KVLoads:
    """The load figures of one rank from its request table and KV page table (SPEC section 4).

    ``req_state`` holds ``ReqState`` codes and ``req_seqlen`` sequence lengths, one entry per request
    row; ``page_state`` holds one ``PageState`` code per KV page; ``page_size`` is tokens per page.
    Host (NumPy) or device arrays (``__cuda_array_interface__``), any integer dtype but uint64.
    ``backend``: "auto" (a CUDA backend for device arrays, "numba" otherwise), "numpy" (the
    reference), "numba", "numba-cuda" or "cupy". Bad shapes, dtypes, codes, negative seqlens and
    ``page_size <= 0`` raise ValueError naming the problem.
    """
    # Lists and other array-likes become NumPy arrays (no copy for arrays of any kind).
    req_state, req_seqlen, page_state = (
        x if hasattr(x, "__cuda_array_interface__") or hasattr(x, "dtype") else np.asarray(x)
        for x in (req_state, req_seqlen, page_state)
    )
    _, num_pages, on_device = check_tables(req_state, req_seqlen, page_state, page_size)
    chosen = resolve_backend(backend, on_device)
    raw = raw_counts(req_state, req_seqlen, page_state, chosen)
    check_raw(raw, req_state, req_seqlen, page_state, on_device=on_device)
    return finish_raw(raw, num_pages, int(page_size))
