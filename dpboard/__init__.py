"""dpboard: load telemetry board and dispatcher for data-parallel LLM inference engines.

Every name here is imported on first use: ``import dpboard`` (which ``dpboard ls`` pays) loads
neither NumPy, the board's C extension nor Numba; ``from dpboard import Board`` loads the board
(NumPy and a small C extension), ``compute_loads`` the kernels.
"""

from __future__ import annotations

from typing import Any

from dpboard.errors import DpboardError

__version__ = "0.1.0"

_LAZY = {
    "Board": "dpboard.board",
    "BoardError": "dpboard.board",
    "BoardLayoutError": "dpboard.board",
    "BoardReader": "dpboard.board",
    "BoardWriter": "dpboard.board",
    "SNAPSHOT_DTYPE": "dpboard.snapshot",
    "LoadSnapshot": "dpboard.snapshot",
    "SlotStatus": "dpboard.snapshot",
    "compute_loads": "dpboard.loads",
    "KVLoads": "dpboard.loads",
    "ReqState": "dpboard.loads",
    "PageState": "dpboard.loads",
    "LoadPublisher": "dpboard.publish.publisher",
}

__all__ = ["DpboardError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dpboard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
