"""Reading step logs back: a file's header, its counts and its records as a NumPy array.

Imports NumPy and nothing of Numba or CuPy: ``dpboard steps`` runs anywhere the logs are copied to.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError, NotFoundError
from dpboard.steplog import format as fmt


@dataclass
class StepLogFile:
    """One step log as read: ``records`` holds its whole rows in this version's dtype (``format.record_dtype()``),
    whatever the version of the file (a field its version lacks is 0)."""

    path: Path
    header: dict[str, Any]
    counts: dict[str, int]  # the prelude's counters (format.COUNTERS)
    closed: bool  # the writer closed it: its counts are final
    records: np.ndarray
    partial_bytes: int = 0  # bytes after the last whole record (a write cut short)

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.header.get("settings") or {})


def read_step_log(path: str | os.PathLike[str]) -> StepLogFile:
    """The step log at ``path``; an InvalidInputError when it is not one this dpboard reads."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise NotFoundError(f"no step log {path}") from None
    except IsADirectoryError:
        raise InvalidInputError(f"{path} is a directory: read it with step_log_paths") from None
    if len(raw) < fmt.PRELUDE.size or raw[:len(fmt.MAGIC)] != fmt.MAGIC:
        raise InvalidInputError(f"{path} is not a dpboard step log (it does not start with {fmt.MAGIC.decode()})")
    prelude = fmt.unpack_prelude(raw[:fmt.PRELUDE.size])
    version, record_size = prelude["version"], prelude["record_size"]
    if fmt.RECORD_SIZES.get(version) != record_size:
        known = ", ".join(f"{size}-byte records in version {v}" for v, size in fmt.RECORD_SIZES.items())
        raise InvalidInputError(f"{path} is a step log of format version {version} with {record_size}-byte records; "
                                f"this dpboard reads versions 1 to {fmt.VERSION} ({known}): read it with the dpboard "
                                f"that wrote it")
    start = fmt.PRELUDE.size + prelude["header_len"]
    if len(raw) < start:
        raise InvalidInputError(f"{path}: a step log cut short inside its header ({len(raw)} of {start} bytes)")
    try:
        header = json.loads(raw[fmt.PRELUDE.size:start].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"{path}: the step log's header line is not JSON ({e})") from None
    body = len(raw) - start
    n = body // record_size
    # the file's size is what was written: the prelude's count may lag it by one flush
    records = _as_current(np.frombuffer(raw, dtype=fmt.record_dtype(version), count=n, offset=start), version)
    counts = {k: prelude[k] for k in fmt.COUNTERS if k != "reserved"}
    counts["written"] = n
    return StepLogFile(path=path, header=header, counts=counts, closed=bool(prelude["flags"] & fmt.CLOSED),
                       records=records, partial_bytes=body - n * record_size)


def _as_current(rows: np.ndarray, version: int) -> np.ndarray:
    """``rows`` of format ``version`` as a copy in this version's dtype; the fields a version lacks are 0
    (version 1's ``launch_ns``: not recorded, which ``step_times`` reads as no launch to move)."""
    if version == fmt.VERSION:
        return rows.copy()
    out = np.zeros(len(rows), dtype=fmt.record_dtype())
    for name in rows.dtype.names:
        out[name] = rows[name]
    return out


def step_log_paths(path: str | os.PathLike[str]) -> list[Path]:
    """``path`` itself, or every step log (``steps-*.bin``) in the directory ``path``, sorted."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir()
                       if p.name.startswith(fmt.FILE_PREFIX) and p.name.endswith(fmt.FILE_SUFFIX) and p.is_file())
        if not found:
            raise NotFoundError(f"no step log ({fmt.FILE_PREFIX}*{fmt.FILE_SUFFIX}) in {path}")
        return found
    if not path.exists():
        raise NotFoundError(f"no step log or directory {path}")
    return [path]


def step_times(records: np.ndarray) -> np.ndarray:
    """Each step's time, ns, in the records' order (the order their results were processed).

    First each step's window: from the later of its start and the previous step's end, to its own end.
    For a step that began after the previous one ended, its duration. Where steps overlap (SGLang's
    overlap scheduler, vLLM's batch queue: a step is launched before the previous one's result is
    processed, ``OVERLAPPED`` on the earlier one), durations overlap too; the windows count each
    stretch of time for one step only, the one whose result it was spent waiting for.

    Then each launch moves to its own step. On a device that computes in the scheduler's thread (a
    CPU), launching a batch is its whole forward, and the overlap scheduler launches step N+1 before
    it processes N's result: N's window holds N+1's forward, and N's own forward lies in N-1's. So
    for each step N flagged ``OVERLAPPED``, the part of N+1's launch (``t_start_ns`` to ``t_start_ns
    + launch_ns``) inside N's window is taken from N and given to N+1. On a GPU a launch is short and
    little moves. The times stay >= 0 and their sum is the windows' sum; with no launch recorded
    (``launch_ns`` 0: vLLM, version 1 logs) they are the windows."""
    start = records["t_start_ns"].astype(np.int64)
    end = start + records["duration_ns"]
    prev_end = np.empty_like(end)
    if len(end):
        prev_end[0] = start[0]
        prev_end[1:] = end[:-1]
    window_start = np.maximum(start, prev_end)
    times = np.maximum(end - window_start, 0)
    if len(end) < 2:
        return times
    launch_end = start[1:] + records["launch_ns"][1:]
    inside = np.minimum(launch_end, end[:-1]) - np.maximum(start[1:], window_start[:-1])
    moved = np.where((records["flags"][:-1] & fmt.OVERLAPPED) != 0, np.maximum(inside, 0), 0)
    times[:-1] -= moved
    times[1:] += moved
    return times
