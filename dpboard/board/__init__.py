"""The board: a POSIX shared-memory segment with a header and one seqlocked slot per DP rank.

``Board`` (segment.py) creates, attaches and removes boards; ``BoardWriter`` and ``BoardReader``
(seqlock.py) are the two sides of the seqlock in ``_seqlock.c``; header.py packs and checks the
header; listing.py finds the boards on this machine; liveness.py tells whether a recorded process
still runs; follow.py re-attaches a board that was replaced under a long-running process.
"""

from dpboard.board.errors import BoardError, BoardLayoutError
from dpboard.board.follow import BoardFollower, FollowingReader
from dpboard.board.header import BoardHeader
from dpboard.board.listing import BoardListing, clean_boards, list_boards, read_listing
from dpboard.board.liveness import process_alive, process_start_ticks
from dpboard.board.names import MAX_SLOTS, SEGMENT_PREFIX, SHM_DIR, segment_path, validate_name
from dpboard.board.segment import DEFAULT_MAX_RETRIES, DEFAULT_STALE_AFTER, Board
from dpboard.board.seqlock import BoardReader, BoardWriter
from dpboard.board.stale import MAX_STALE_AFTER, MIN_STALE_AFTER, check_stale_after

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_STALE_AFTER",
    "MAX_SLOTS",
    "MAX_STALE_AFTER",
    "MIN_STALE_AFTER",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "Board",
    "BoardError",
    "BoardFollower",
    "FollowingReader",
    "BoardHeader",
    "BoardLayoutError",
    "BoardListing",
    "BoardReader",
    "BoardWriter",
    "check_stale_after",
    "clean_boards",
    "list_boards",
    "read_listing",
    "process_alive",
    "process_start_ticks",
    "segment_path",
    "validate_name",
]
