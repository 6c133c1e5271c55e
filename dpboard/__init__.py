"""dpboard: load telemetry board and dispatcher for data-parallel LLM inference engines.

The board and snapshot API is imported eagerly (NumPy and a small C extension only). The kernel
API (``compute_loads`` and friends) is imported on first use, so that read-only tools never load
Numba.
"""

from __future__ import annotations

from typing import Any

from dpboard.board import Board, BoardError, BoardLayoutError, BoardReader, BoardWriter
from dpboard.errors import DpboardError
from dpboard.snapshot import SNAPSHOT_DTYPE, LoadSnapshot, SlotStatus

__version__ = "0.1.0"

_LAZY = {
    "compute_loads": "dpboard.loads",
    "KVLoads": "dpboard.loads",
    "ReqState": "dpboard.loads",
    "PageState": "dpboard.loads",
    "LoadPublisher": "dpboard.publish.publisher",
}

__all__ = [
    "Board",
    "BoardError",
    "BoardLayoutError",
    "BoardReader",
    "BoardWriter",
    "DpboardError",
    "LoadSnapshot",
    "SNAPSHOT_DTYPE",
    "SlotStatus",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dpboard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
