"""dpboard: load telemetry board and dispatcher for data-parallel LLM inference engines.

Every name here is imported on first use: ``import dpboard`` (which ``dpboard ls`` pays) loads
neither NumPy, the board's C extension nor Numba; ``from dpboard import Board`` loads the board
(NumPy and a small C extension), ``compute_loads`` the kernels.
"""

from __future__ import annotations

from dpboard.errors import DpboardError
from dpboard.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _LAZY, globals())
