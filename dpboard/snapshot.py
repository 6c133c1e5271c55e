"""The snapshot: one rank's load at one moment, and its fixed binary layout.

Everything about bytes lives here: the slot layout that writers and readers share, the board header,
and the NumPy record that ``BoardReader.read_array`` fills. docs/FORMAT.md describes the same layout
byte by byte; the two must change together (and ``LAYOUT_VERSION`` with them).

This module imports only the standard library and NumPy, so read-only tools start fast.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

LAYOUT_VERSION = 1
MAGIC = b"DPBOARD\x00"

HEADER_SIZE = 512
SLOT_SIZE = 128  # two 64-byte cache lines, one 128-byte line on CPUs that have those
SEQ_OFFSET = 0  # the seqlock sequence, first word of each slot
FIELDS_OFFSET = 8  # the snapshot's fields follow it, 8 bytes each, in LoadSnapshot's order
OWNER_PID_OFFSET = 112  # pid of the process holding the slot's writer (outside the seqlock)
OWNER_START_TICKS_OFFSET = 120  # that process's start time, so that a recycled pid is not taken for it

MAX_INT64 = 2**63 - 1


class LoadSnapshot(NamedTuple):
    """The load of one DP rank, as published into its board slot.

    The first eight fields are the scheduler's; the writer stamps the last five itself
    (``timestamp_ns``, ``monotonic_ns``, ``publish_seq``, ``writer_pid``, ``node_id``), so a caller
    leaves them at 0. The field order is the slot's byte order.
    """

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    num_active_tokens: int = 0
    max_total_num_tokens: int = 0
    num_received_reqs: int = 0
    timestamp_ns: int = 0
    monotonic_ns: int = 0
    publish_seq: int = 0
    writer_pid: int = 0
    node_id: int = 0

    @property
    def token_usage(self) -> float:
        """Share of the KV capacity in use (0.0 when the capacity is unknown)."""
        if self.max_total_num_tokens <= 0:
            return 0.0
        return self.num_used_tokens / self.max_total_num_tokens

    @property
    def num_total_requests(self) -> int:
        return self.num_running_reqs + self.num_waiting_reqs


FIELD_NAMES: tuple[str, ...] = LoadSnapshot._fields
NUM_FIELDS = len(FIELD_NAMES)
LOAD_FIELDS: tuple[str, ...] = FIELD_NAMES[1:8]  # what a scheduler supplies besides its rank
STAMPED_FIELDS: tuple[str, ...] = FIELD_NAMES[8:]  # what the writer supplies

assert FIELDS_OFFSET + 8 * NUM_FIELDS <= OWNER_PID_OFFSET


class SlotStatus(enum.IntEnum):
    """What a reader found in a slot. The integer values are the ``status`` column of read_array."""

    EMPTY = 0  # never written
    LIVE = 1  # a whole snapshot, published within the stale threshold
    STALE = 2  # a whole snapshot, but older than the stale threshold
    TORN = 3  # the sequence stayed odd through every retry: a writer died or stalls mid-write

    @property
    def label(self) -> str:
        return self.name.lower()

    def __str__(self) -> str:  # print(reader.status(r)) says "live", not "1"
        return self.label


# One record per slot: every snapshot field plus the reader's verdict. 112 bytes, fields at the
# same offsets as in a slot minus the sequence word, so the C reader copies them in one run.
SNAPSHOT_DTYPE = np.dtype(
    {
        "names": [*FIELD_NAMES, "status"],
        "formats": ["<i8"] * NUM_FIELDS + ["u1"],
        "offsets": [8 * i for i in range(NUM_FIELDS)] + [8 * NUM_FIELDS],
        "itemsize": 112,
    }
)

# The board header, at offset 0 of the segment.
HEADER_DTYPE = np.dtype(
    {
        "names": [
            "magic",
            "layout_version",
            "header_size",
            "n_slots",
            "slot_size",
            "creator_pid",
            "creation_time_ns",
            "generation",
            "name",
            "node_id",
            "creator_start_ticks",
        ],
        "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<i8", "<i8", "<u8", "S64", "<i8", "<u8"],
        "offsets": [0, 8, 12, 16, 20, 24, 32, 40, 48, 112, 120],
        "itemsize": 128,
    }
)
# Bytes 128..255 of the header belong to the collector that writes relayed snapshots into this
# board (dpboard.collector): its pid and frame counters, written only by it, read by `dpboard info`.
# Bytes 256..511 are reserved and zero.
COLLECTOR_STATS_OFFSET = 128
COLLECTOR_STATS_FIELDS: tuple[str, ...] = (
    "collector_pid",  # 0: no collector has run on this board
    "collector_start_ticks",  # the collector's process start time, to tell a recycled pid
    "frames_ok",
    "snapshots_ok",
    "frames_bad",  # sum of the bad_* counters below
    "bad_magic",
    "bad_version",
    "bad_length",
    "bad_rank",
    "bad_identity",  # a frame for another board (name) than this one
    "bad_node",
    "last_frame_monotonic_ns",
    "bad_load",  # a negative load field (appended: the fields above keep their offsets)
)
COLLECTOR_STATS_DTYPE = np.dtype([(f, "<u8") for f in COLLECTOR_STATS_FIELDS])
assert COLLECTOR_STATS_DTYPE.itemsize <= 128


def segment_size(n_slots: int) -> int:
    return HEADER_SIZE + n_slots * SLOT_SIZE


def slot_offset(rank: int) -> int:
    return HEADER_SIZE + rank * SLOT_SIZE
