"""``compute_loads``: the load figures of one rank from its tables, with the backend chosen for them.

Backends: "numpy" (the reference), "numba" (CPU), "numba-cuda" and "cupy" (GPU). Only NumPy is
imported here; the Numba and CUDA backends are imported on first use, so that the read-only tools
never load Numba.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.loads.counters import KVLoads, describe_bad, finish_raw, raw_has_errors
from dpboard.loads.reference import raw_counts_numpy
from dpboard.loads.tables import check_tables

BACKENDS: tuple[str, ...] = ("auto", "numpy", "numba", "numba-cuda", "cupy")
CUDA_BACKENDS: tuple[str, ...] = ("numba-cuda", "cupy")


def check_raw(raw: Any, req_state: Any, req_seqlen: Any, page_state: Any, *, on_device: bool) -> None:
    """Raise the InvalidInputError naming the first bad entry when the kernel counted any.

    Device tables are copied to the host for the message, and only then: the good path costs nothing.
    """
    if not raw_has_errors(raw):
        return
    if on_device:
        from dpboard.loads import cuda

        req_state, req_seqlen, page_state = (cuda.to_host(x) for x in (req_state, req_seqlen, page_state))
    raise InvalidInputError(describe_bad(raw, req_state, req_seqlen, page_state))


def resolve_backend(backend: str, on_device: bool) -> str:
    """The backend ``compute_loads`` uses for ``backend`` and tables on host or device."""
    if backend not in BACKENDS:
        raise InvalidInputError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "auto":
        if not on_device:
            return "numba"
        from dpboard.loads import cuda

        return "cupy" if cuda.cupy_available() else "numba-cuda"
    if on_device and backend in ("numpy", "numba"):
        raise InvalidInputError(
            f"backend {backend!r} runs on the CPU but the tables are device arrays: use backend='auto', "
            f"'cupy' or 'numba-cuda', or copy the tables to the host"
        )
    return backend


def raw_counts(req_state: Any, req_seqlen: Any, page_state: Any, backend: str) -> np.ndarray:
    """The raw counters from a concrete backend (validation of shapes and dtypes already done)."""
    if backend == "numpy":
        return raw_counts_numpy(req_state, req_seqlen, page_state)
    if backend == "numba":
        from dpboard.loads import cpu

        return cpu.raw_counts(req_state, req_seqlen, page_state)
    from dpboard.loads import cuda

    return cuda.runner(backend).raw_counts(req_state, req_seqlen, page_state)


# compute_loads' last device tables, per thread: called again with the same table objects, it
# skips the checks and the binding (no __cuda_array_interface__ read) and only launches.
_last_call = threading.local()


def compute_loads(
    req_state: Any,
    req_seqlen: Any,
    page_state: Any,
    *,
    page_size: int,
    backend: str = "auto",
) -> KVLoads:
    """The load figures of one rank from its request table and KV page table (docs/KERNELS.md, "Inputs and formulas").

    ``req_state`` holds ``ReqState`` codes and ``req_seqlen`` sequence lengths, one entry per request
    row; ``page_state`` holds one ``PageState`` code per KV page; ``page_size`` is tokens per page.
    Host (NumPy) or device arrays (``__cuda_array_interface__``), any native integer dtype but uint64.
    ``backend``: "auto" (a CUDA backend for device arrays, "numba" otherwise), "numpy" (the
    reference), "numba", "numba-cuda" or "cupy". Bad shapes, dtypes, codes, seqlens outside [0, 2**32] and
    ``page_size <= 0`` raise ValueError (InvalidInputError) naming the problem.
    """
    last = getattr(_last_call, "v", None)
    if (last is not None and req_state is last[0] and req_seqlen is last[1] and page_state is last[2]
            and page_size == last[3] and backend == last[4]):
        raw = last[5].raw_counts().tolist()
        if raw_has_errors(raw):
            check_raw(raw, req_state, req_seqlen, page_state, on_device=True)
        return finish_raw(raw, last[6], int(page_size))
    # Lists and other array-likes become NumPy arrays (no copy for arrays of any kind).
    req_state, req_seqlen, page_state = (
        x if hasattr(x, "__cuda_array_interface__") or hasattr(x, "dtype") else np.asarray(x)
        for x in (req_state, req_seqlen, page_state)
    )
    _, num_pages, on_device = check_tables(req_state, req_seqlen, page_state, page_size)
    chosen = resolve_backend(backend, on_device)
    if on_device and chosen in CUDA_BACKENDS:
        from dpboard.loads import cuda

        binding = cuda.runner(chosen).bound(req_state, req_seqlen, page_state)
        _last_call.v = (req_state, req_seqlen, page_state, page_size, backend, binding, num_pages)
        raw = binding.raw_counts().copy()
    else:
        raw = raw_counts(req_state, req_seqlen, page_state, chosen)
    check_raw(raw, req_state, req_seqlen, page_state, on_device=on_device)
    return finish_raw(raw, num_pages, int(page_size))
