"""The step-log file: a fixed prelude, one JSON header line, then one fixed 72-byte record per step.

A step log is one scheduler's record of its steps (``DPBOARD_STEP_LOG=DIR``: one file per rank and
process, ``steps-<engine>-<pid>-rank<r>.bin``). Everything is little-endian:

- **prelude** (``PRELUDE``, 128 bytes at offset 0): ``MAGIC``, the format's ``VERSION``, the record
  size, the header's length, the flags (``CLOSED``: the writer closed the log; a log without it
  ended with its process, its last ``FLUSH_INTERVAL`` of steps possibly missing), then the counts
  the writer keeps up to date at every flush (``COUNTERS``): records written, steps dropped at the
  size cap, steps dropped because the in-memory ring was full, faults (steps whose recording
  raised), unmatched (a step begun whose result processing never came, or the reverse), the
  wall-clock time of the last flush, and steps dropped after a write failed (a full disk).
- **header**: one line of UTF-8 JSON (the engine, its version, the rank, the pid, the clock, the
  server's settings a simulator needs; ``settings`` below), padded with spaces to a multiple of 64
  bytes, ``\\n`` last. Its length is the prelude's ``header_len``.
- **records** from offset ``PRELUDE.size + header_len`` to the end: ``RECORD`` each (fields in
  ``RECORD_FIELDS``). A log is never longer than its size cap; steps past it are counted, not written.

Version 2 added ``launch_ns`` (``FIELD_VERSIONS``): version 1's records are the same fields without
it, 64 bytes. ``record_struct(version)`` and ``record_dtype(version)`` give either layout, both
derived from ``RECORD_FIELDS``; the reader reads both.

The clock of ``t_start_ns`` is the process's ``time.monotonic_ns()`` (CLOCK_MONOTONIC); the header's
``started_monotonic_ns`` and ``started_unix_ns`` were read together, to place steps in wall-clock time.

This module imports no NumPy (the writer's hot path packs with ``struct``); ``record_dtype()`` builds
the records' NumPy dtype for readers when asked.
"""

from __future__ import annotations

import struct
from typing import Any

MAGIC = b"DPBSTEPS"
VERSION = 2
FORMAT_NAME = "dpboard-steplog"

# magic, version, record size, header length, flags, then 8 counters; reserved to 128 bytes
PRELUDE = struct.Struct("<8sHHII4x8q40x")
COUNTERS = ("written", "dropped_cap", "dropped_ring", "faults", "unmatched", "flush_unix_ns", "dropped_io",
            "reserved")
CLOSED = 1  # prelude flag: the writer closed the log (its counts are final)

# (name, struct code, what it holds): one step of one scheduler
RECORD_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("t_start_ns", "q", "monotonic time the step started (SGLang: run_batch entered; vLLM: schedule() called)"),
    ("duration_ns", "q", "until the step's result was processed (SGLang: process_batch_result returned; "
                         "vLLM: update_from_output returned)"),
    ("launch_ns", "q", "time from t_start_ns until the batch was launched (SGLang: run_batch returned; on a device "
                       "that computes in the scheduler's thread, such as a CPU, that is the whole forward); 0 where "
                       "not recorded (vLLM)"),
    ("step", "q", "the engine's own step number (SGLang's forward_ct; vLLM: the recorder's count of schedule())"),
    ("prefix_tokens", "q", "tokens already in KV for the prefill requests (prefix-cache hits and earlier chunks)"),
    ("decode_ctx_tokens", "q", "context tokens of the decode requests, the token of this step included"),
    ("prefill_tokens", "i", "new prompt tokens computed this step"),
    ("prefill_reqs", "i", "requests prefilling this step"),
    ("decode_reqs", "i", "requests decoding this step"),
    ("decode_tokens", "i", "tokens computed for the decode requests (more than decode_reqs with speculation)"),
    ("batch_size", "i", "requests in the step's batch"),
    ("mode", "B", "MODES: extend, decode, mixed, idle, other"),
    ("flags", "B", "FLAGS: group_extend, decode_as_extend, overlapped"),
    ("raw_mode", "B", "the engine's own forward mode (SGLang's ForwardMode value; 0 for vLLM)"),
)
# the format version a field first appeared in; a field not named here is in every version
FIELD_VERSIONS = {"launch_ns": 2}
RECORD_ALIGN = 8  # records padded to a multiple of 8 bytes: their int64 fields stay aligned in an array


def record_fields(version: int = VERSION) -> tuple[tuple[str, str, str], ...]:
    """``RECORD_FIELDS`` as a log of format ``version`` has them, in their order."""
    return tuple(f for f in RECORD_FIELDS if FIELD_VERSIONS.get(f[0], 1) <= version)


def record_struct(version: int = VERSION) -> struct.Struct:
    """A record of format ``version``: its fields packed in order, then padding to ``RECORD_ALIGN``."""
    codes = "<" + "".join(code for _, code, _ in record_fields(version))
    return struct.Struct(codes + "x" * (-struct.calcsize(codes) % RECORD_ALIGN))


def record_offsets(version: int = VERSION) -> dict[str, int]:
    """Each field's byte offset in a record of format ``version``."""
    offsets, codes = {}, "<"
    for name, code, _ in record_fields(version):
        offsets[name] = struct.calcsize(codes)
        codes += code
    return offsets


RECORD = record_struct()
RECORD_SIZE = RECORD.size
RECORD_SIZES = {version: record_struct(version).size for version in range(1, VERSION + 1)}  # what a reader reads

# the mode of a step: what the rank computed in it
EXTEND, DECODE, MIXED, IDLE, OTHER = 1, 2, 3, 4, 5
MODES = {EXTEND: "extend", DECODE: "decode", MIXED: "mixed", IDLE: "idle", OTHER: "other"}
# flags of a step
GROUP_EXTEND = 1  # DP attention: the group's step was an extend step (SGLang's is_extend_in_batch)
DECODE_AS_EXTEND = 2  # SGLang ran this rank's decode batch as an extend, for its group's extend step
OVERLAPPED = 4  # the next step began before this one's result was processed (overlap scheduler, batch queue)
FLAGS = {GROUP_EXTEND: "group_extend", DECODE_AS_EXTEND: "decode_as_extend", OVERLAPPED: "overlapped"}

HEADER_ALIGN = 64
FILE_PREFIX = "steps-"
FILE_SUFFIX = ".bin"

# what the header's "settings" holds at least, for the simulator (max_total_tokens: the KV pool, in tokens)
SETTINGS_KEYS = ("chunked_prefill_size", "max_running_requests", "max_total_tokens", "overlap",
                 "dp_attention", "method")

assert PRELUDE.size == 128 and RECORD_SIZE == 72 and RECORD_SIZES == {1: 64, 2: 72}


def file_name(engine: str, pid: int, rank: int, attempt: int = 0) -> str:
    """``steps-<engine>-<pid>-rank<r>.bin`` (``-<n>`` before the suffix for the n-th try of a name taken)."""
    more = f"-{attempt}" if attempt else ""
    return f"{FILE_PREFIX}{engine}-{pid}-rank{rank}{more}{FILE_SUFFIX}"


def pack_prelude(header_len: int, flags: int, counters: dict[str, int]) -> bytes:
    return PRELUDE.pack(MAGIC, VERSION, RECORD_SIZE, header_len, flags, *(int(counters.get(k, 0)) for k in COUNTERS))


def unpack_prelude(raw: bytes) -> dict[str, Any]:
    magic, version, record_size, header_len, flags, *values = PRELUDE.unpack(raw)
    return {"magic": magic, "version": version, "record_size": record_size, "header_len": header_len,
            "flags": flags, **dict(zip(COUNTERS, values, strict=True))}


def pad_header(text: str) -> bytes:
    """The header line: JSON text, spaces up to a multiple of ``HEADER_ALIGN`` bytes, ``\\n`` last."""
    raw = text.encode()
    size = -(-(len(raw) + 1) // HEADER_ALIGN) * HEADER_ALIGN
    return raw + b" " * (size - len(raw) - 1) + b"\n"


def record_dtype(version: int = VERSION) -> Any:
    """The records of format ``version`` as a NumPy structured dtype (the same bytes as ``record_struct``)."""
    import numpy as np

    fields = record_fields(version)
    offsets = record_offsets(version)
    return np.dtype({"names": [name for name, _, _ in fields],
                     "formats": ["<" + {"q": "i8", "i": "i4", "B": "u1"}[code] for _, code, _ in fields],
                     "offsets": [offsets[name] for name, _, _ in fields],
                     "itemsize": record_struct(version).size})
