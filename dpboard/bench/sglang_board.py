"""The board benchmark's baseline: SGLang's own shared-memory load snapshots.

When SGLang is installed, the baseline is its real code: ``ShmLoadSnapshotWriter`` and
``ShmLoadSnapshotReader`` from ``sglang.srt.managers.load_snapshot`` (msgpack in 16 KiB slots under a
whole-file ``flock``), publishing SGLang's real ``LoadSnapshot``. SGLang's package ``__init__``
imports torch; where torch is absent (SGLang's wheel installed alone, as ``make test`` does) the
module is loaded from the wheel without running that ``__init__``: nothing of SGLang's load path
needs torch.

Without SGLang, ``FlockBoard`` below stands in: a board written from the description of SGLang
0.5.23's format (a u32 length and a msgpack dict per 16 KiB slot, an exclusive flock around each
write, a shared one across each ``read_all``), labelled as such in the report.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import importlib.util
import mmap
import os
import struct
import sys
import time
import types
from typing import Any

import msgpack

from dpboard.snapshot import FIELD_NAMES, LoadSnapshot

SLOT_BYTES = 16 * 1024
_LEN = struct.Struct("<I")


@functools.cache
def load_sglang() -> tuple[Any | None, str]:
    """(SGLang's ``load_snapshot`` module, what it is) or (None, why it cannot be had)."""
    if "sglang" not in sys.modules and importlib.util.find_spec("sglang") is None:
        return None, "SGLang is not installed"
    version = importlib.metadata.version("sglang")
    if "sglang" not in sys.modules and importlib.util.find_spec("torch") is None:
        root = os.path.dirname(importlib.util.find_spec("sglang").origin)
        for name, path in (("sglang", root), ("sglang.srt.utils", os.path.join(root, "srt", "utils"))):
            shell = types.ModuleType(name)
            shell.__path__ = [path]
            sys.modules[name] = shell
    try:
        import sglang.srt.managers.load_snapshot as module
    except ImportError as e:
        return None, f"SGLang {version} is installed but its load_snapshot module does not import ({e})"
    return module, f"SGLang {version}'s own ShmLoadSnapshotWriter / ShmLoadSnapshotReader"


def sglang_snapshot(module: Any, rank: int, k: int) -> Any:
    """A snapshot as an SGLang scheduler publishes one: every scalar, the decode moments, the memory
    and queue sections (what a plain deployment carries)."""
    return module.LoadSnapshot(
        timestamp=time.time(), dp_rank=rank, num_running_reqs=k % 50, num_waiting_reqs=k % 7,
        num_waiting_uncached_tokens=k % 300, num_used_tokens=1000 + k % 4096, num_total_tokens=2000 + k % 4096,
        num_active_tokens=1900 + k % 4096, num_prealloc_ready_tokens=0, max_total_num_tokens=1 << 20,
        max_running_requests=256, token_usage=0.25, gen_throughput=1500.0, cache_hit_rate=0.4, utilization=0.8,
        total_prefill_uncached_tokens=10**9 + k, total_prefill_busy_us=10**8 + k,
        decode_moments=[float(k), 2.0 * k, 3.0 * k, 4.0 * k, 5.0 * k, 6.0 * k],
        memory=module.MemoryMetrics(14.2, 60.1, 1.3, 1 << 20),
        queues=module.QueueMetrics(k % 7, 0, 0, 0, 0),
    )


class FlockBoard:
    """Stand-in for SGLang's file when SGLang is not installed (see the module docstring)."""

    def __init__(self, path: str, n_slots: int, *, create: bool):
        self.path = path
        self.n_slots = n_slots
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, n_slots * SLOT_BYTES)
        self.mm = mmap.mmap(self.fd, n_slots * SLOT_BYTES)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class FlockWriter:
    def __init__(self, board: FlockBoard, rank: int):
        self.board = board
        self.rank = rank
        self.offset = rank * SLOT_BYTES
        self.publish_seq = 0
        self.pid = os.getpid()

    def publish(self, snap: LoadSnapshot) -> None:
        self.publish_seq += 1
        record = snap._asdict()
        record.update(timestamp_ns=time.time_ns(), monotonic_ns=time.monotonic_ns(),
                      publish_seq=self.publish_seq, writer_pid=self.pid)
        payload = msgpack.packb(record)
        fd, mm, off = self.board.fd, self.board.mm, self.offset
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            _LEN.pack_into(mm, off, len(payload))
            mm[off + 4 : off + 4 + len(payload)] = payload
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class FlockReader:
    def __init__(self, board: FlockBoard):
        self.board = board

    def read_all(self) -> list[LoadSnapshot | None]:
        fd, mm = self.board.fd, self.board.mm
        out: list[LoadSnapshot | None] = []
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            for rank in range(self.board.n_slots):
                off = rank * SLOT_BYTES
                (length,) = _LEN.unpack_from(mm, off)
                if length == 0:
                    out.append(None)
                    continue
                record = msgpack.unpackb(mm[off + 4 : off + 4 + length])
                out.append(LoadSnapshot(**{k: record[k] for k in FIELD_NAMES}))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return out
