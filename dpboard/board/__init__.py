"""The board: a POSIX shared-memory segment with a header and one seqlocked slot per DP rank.

``Board`` (segment.py) creates, attaches and removes boards; ``BoardWriter`` and ``BoardReader``
(seqlock.py) are the two sides of the seqlock in the ``_seqlock`` extension; header.py packs and checks the
header; listing.py finds the boards on this machine; liveness.py tells whether a recorded process
still runs; follow.py re-attaches a board that was replaced under a long-running process.

The names below are imported from their module on first use, so that a command that lists or
removes boards (``dpboard ls``, ``clean``) loads neither NumPy nor the C extension.
"""

from __future__ import annotations

from dpboard.lazy import lazy_exports

_MODULES = {
    "dpboard.board.errors": ("BoardError", "BoardLayoutError"),
    "dpboard.board.follow": ("BoardFollower", "FollowingReader"),
    "dpboard.board.header": ("BoardHeader",),
    "dpboard.board.listing": ("BoardListing", "clean_boards", "list_boards", "read_listing"),
    "dpboard.board.liveness": ("process_alive", "process_start_ticks"),
    "dpboard.board.names": ("MAX_SLOTS", "SEGMENT_PREFIX", "SHM_DIR", "segment_path", "validate_name"),
    "dpboard.board.segment": ("DEFAULT_MAX_RETRIES", "DEFAULT_STALE_AFTER", "Board"),
    "dpboard.board.seqlock": ("BoardReader", "BoardWriter"),
    "dpboard.board.stale": ("MAX_STALE_AFTER", "MIN_STALE_AFTER", "check_stale_after"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_WHERE)
__getattr__ = lazy_exports(__name__, _WHERE, globals())
