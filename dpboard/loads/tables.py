"""The scheduler's tables as the load kernels take them: what is accepted, checked once per binding.

Shapes, dtypes, byte order and ``page_size`` are checked here; the values (codes outside the enums,
seqlens outside [0, MAX_SEQLEN]) are counted by the kernels as they go, so validation costs no extra pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.snapshot import MAX_INT64, MAX_SEQLEN


def array_info(x: Any, what: str) -> tuple[np.dtype, tuple[int, ...], bool]:
    """(dtype, shape, is_device) of a host array or of anything with ``__cuda_array_interface__``."""
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return np.dtype(cai["typestr"]), tuple(cai["shape"]), True
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is None or shape is None:
        raise InvalidInputError(
            f"{what} must be a NumPy array or a device array (CuPy, PyTorch, Numba), got "
            f"{type(x).__name__}: pass np.asarray({what}, dtype=np.int32)"
        )
    return np.dtype(dtype), tuple(shape), False


def _check_dtype(dtype: np.dtype, what: str, *, seqlen: bool = False) -> None:
    hint = "int32 or int64" if seqlen else "int8, uint8 or int32"
    if dtype.kind not in "iu" or dtype == np.uint64:
        raise InvalidInputError(
            f"{what} has dtype {dtype}, but it must hold signed integers or unsigned ones of up to 32 bits: "
            f"store it as {hint}"
        )
    if not dtype.isnative:
        raise InvalidInputError(
            f"{what} has dtype {dtype.str}, which is not this machine's byte order: every backend reads "
            f"native integers; pass {what}.astype({dtype.newbyteorder('=').name})"
        )


def check_tables(req_state: Any, req_seqlen: Any, page_state: Any, page_size: Any) -> tuple[int, int, bool]:
    """Check shapes, dtypes and page_size (not the values, which the kernels count).

    Returns (num_requests, num_pages, on_device). Raises InvalidInputError (a ValueError) naming the problem.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise InvalidInputError(f"page_size must be a positive integer (tokens per KV page), got {page_size!r}")
    if page_size <= 0:
        raise InvalidInputError(f"page_size must be a positive integer (tokens per KV page), got {page_size}")
    infos = {}
    for what, x in (("req_state", req_state), ("req_seqlen", req_seqlen), ("page_state", page_state)):
        dtype, shape, on_device = array_info(x, what)
        _check_dtype(dtype, what, seqlen=what == "req_seqlen")
        if len(shape) != 1:
            raise InvalidInputError(f"{what} must be one-dimensional, got shape {shape}: pass {what}.reshape(-1)")
        infos[what] = (shape[0], on_device)
    num_requests, num_seqlens, num_pages = (infos[w][0] for w in ("req_state", "req_seqlen", "page_state"))
    if num_requests != num_seqlens:
        raise InvalidInputError(
            f"req_state has {num_requests} rows but req_seqlen has {num_seqlens}: both describe the same "
            f"request table and must have one entry per row"
        )
    devices = {on_device for _, on_device in infos.values()}
    if len(devices) != 1:
        where = ", ".join(f"{w} on {'device' if d else 'host'}" for w, (_, d) in infos.items())
        raise InvalidInputError(f"the tables must all be host arrays or all device arrays, got {where}")
    if num_pages * int(page_size) > MAX_INT64:
        raise InvalidInputError(
            f"{num_pages} pages of {page_size} tokens overflow int64: page_size is probably wrong"
        )
    # The bound that keeps every kernel sum exact: each row adds at most MAX_SEQLEN (a larger seqlen is
    # a bad table), so the sums and num_total_tokens fit int64 while this holds.
    if num_requests * MAX_SEQLEN + num_pages * int(page_size) > MAX_INT64:
        raise InvalidInputError(
            f"{num_requests} request rows of up to {MAX_SEQLEN} tokens and {num_pages} pages of {page_size} tokens "
            f"could overflow int64 sums: the request table is far larger than any scheduler's"
        )
    return num_requests, num_pages, devices.pop()
