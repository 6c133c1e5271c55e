"""The relay frame: how a relay carries a batch of snapshots from its node to node0's collector.

One ZMQ message per relay tick, fixed binary, little-endian, versioned (docs/MULTINODE.md shows it
byte by byte)::

    offset size  field
         0    4  magic          b"DPRL"
         4    2  version        u16, WIRE_VERSION
         6    2  header_size    u16, 104
         8    2  record_size    u16, 104 (the fields) or 456 (the fields, then the detail)
        10    2  reserved       u16, 0
        12    4  count          u32, number of records that follow
        16    8  node_id        i64, the sending node (every record's node_id must equal it)
        24    8  frame_seq      u64, the relay's frame counter (gaps = frames dropped on the way)
        32    8  sent_ns        i64, the relay's CLOCK_REALTIME when it packed the frame
        40   64  board          the board name the frame is meant for, UTF-8, NUL-padded
       104  record_size * count records: the 13 int64 fields of a LoadSnapshot, in slot order, each
                                followed in a 456-byte record by the slot's detail (DETAIL_DTYPE)

A relay sends 456-byte records when a slot it sends holds a detail (an engine's whole snapshot:
SGLang's sections), so that node0's readers see a remote rank as its own node does; boards without
detail (dpboard's kernels) keep the 104-byte records.

``unpack_frame`` validates everything a frame carries that does not depend on the receiving board;
``validate_records`` does the rest (rank range, node id, negative loads, a detail readers can decode). Neither ever raises on
arbitrary bytes other than with ``FrameError``, whose ``reason`` names the collector counter.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import numpy as np

from dpboard.errors import InvalidInputError
from dpboard.snapshot import (
    DETAIL_DTYPE,
    DETAIL_SIZE,
    DETAILED_DTYPE,
    FIELD_NAMES,
    LOAD_FIELDS,
    NUM_FIELDS,
    SNAPSHOT_DTYPE,
    detail_problem,
)

WIRE_MAGIC = b"DPRL"
WIRE_VERSION = 3
BOARD_NAME_SIZE = 64
# The most records one frame may hold: a board has at most 65536 slots (dpboard.board.MAX_SLOTS).
MAX_RECORDS = 65536

HEADER_STRUCT = struct.Struct(f"<4sHHHHIqQq{BOARD_NAME_SIZE}s")
HEADER_SIZE = HEADER_STRUCT.size
RECORD_DTYPE = np.dtype([(name, "<i8") for name in FIELD_NAMES])
RECORD_SIZE = RECORD_DTYPE.itemsize
DETAILED_RECORD_DTYPE = np.dtype([("load", RECORD_DTYPE), ("detail", DETAIL_DTYPE)])
DETAILED_RECORD_SIZE = DETAILED_RECORD_DTYPE.itemsize
MAX_FRAME_SIZE = HEADER_SIZE + MAX_RECORDS * DETAILED_RECORD_SIZE

assert HEADER_SIZE == 104 and RECORD_SIZE == 8 * NUM_FIELDS == 104
assert DETAILED_RECORD_SIZE == RECORD_SIZE + DETAIL_SIZE == 456

# Why a frame was refused; each is a counter of the collector (dpboard.snapshot.COLLECTOR_STATS_FIELDS).
BAD_MAGIC = "bad_magic"
BAD_VERSION = "bad_version"
BAD_LENGTH = "bad_length"
BAD_RANK = "bad_rank"
BAD_IDENTITY = "bad_identity"
BAD_NODE = "bad_node"
BAD_LOAD = "bad_load"
BAD_OWNER = "bad_owner"
BAD_REASONS = (BAD_MAGIC, BAD_VERSION, BAD_LENGTH, BAD_RANK, BAD_IDENTITY, BAD_NODE, BAD_LOAD, BAD_OWNER)

_LOAD_COLUMNS = list(LOAD_FIELDS)


class FrameError(InvalidInputError):
    """A frame that must be dropped. ``reason`` is one of BAD_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Frame:
    node_id: int
    frame_seq: int
    sent_ns: int
    board: str
    records: np.ndarray  # RECORD_DTYPE, read-only view into the received bytes
    details: np.ndarray | None = None  # DETAIL_DTYPE beside each record, when the frame carries them


def _encode_board(board: str) -> bytes:
    raw = board.encode("utf-8")
    if not raw or len(raw) > BOARD_NAME_SIZE or b"\x00" in raw:
        raise InvalidInputError(
            f"board name {board!r} cannot go into a relay frame: it must be 1-{BOARD_NAME_SIZE} bytes of "
            f"UTF-8 without NUL (board names are at most 64 characters from [A-Za-z0-9_.-])"
        )
    return raw


def _frame(body: np.ndarray, *, node_id: int, board: str, frame_seq: int, sent_ns: int | None) -> bytes:
    """The header, then ``body`` (count x record_size bytes, uint8)."""
    count, record_size = body.shape
    if count > MAX_RECORDS:
        raise InvalidInputError(f"a frame holds at most {MAX_RECORDS} records, got {count}: split the batch")
    if node_id < 0:
        raise InvalidInputError(f"node_id must be >= 0, got {node_id}")
    header = HEADER_STRUCT.pack(
        WIRE_MAGIC, WIRE_VERSION, HEADER_SIZE, record_size, 0, count, node_id, frame_seq,
        time.time_ns() if sent_ns is None else sent_ns, _encode_board(board),
    )
    return header + body.tobytes()


def pack_frame(
    records: np.ndarray,
    *,
    node_id: int,
    board: str,
    frame_seq: int,
    sent_ns: int | None = None,
    details: np.ndarray | None = None,
) -> bytes:
    """One frame holding ``records`` (any array with the snapshot fields, e.g. rows of read_array())
    and, when ``details`` (DETAIL_DTYPE, one per record) is given, each record's detail."""
    count = len(records)
    if details is None:
        body = np.empty(count, RECORD_DTYPE)
        fields = body
    else:
        if details.dtype != DETAIL_DTYPE or len(details) != count:
            raise InvalidInputError(
                f"details must be {count} DETAIL_DTYPE records, one per record (e.g. the 'detail' column "
                f"of read_detailed_array()), got {len(details)} of {details.dtype}"
            )
        body = np.empty(count, DETAILED_RECORD_DTYPE)
        body["detail"] = details
        fields = body["load"]
    # read_array's records carry a status byte and padding: keep the 13 fields, in order.
    for name in FIELD_NAMES:
        fields[name] = records[name]
    return _frame(body.view(np.uint8).reshape(count, body.dtype.itemsize), node_id=node_id, board=board,
                  frame_seq=frame_seq, sent_ns=sent_ns)


# A read_detailed_array() row starts with the 13 fields in wire order and holds the detail at
# _ROW_DETAIL: a relay copies both out as bytes, no field at a time.
_ROW_SIZE = DETAILED_DTYPE.itemsize
_ROW_DETAIL = DETAILED_DTYPE.fields["detail"][1]
assert all(SNAPSHOT_DTYPE.fields[name][1] == 8 * i for i, name in enumerate(FIELD_NAMES))
assert all(SNAPSHOT_DTYPE.fields[name][0] == np.dtype("<i8") for name in FIELD_NAMES)


def pack_board_rows(
    rows: np.ndarray,
    picked: np.ndarray,
    *,
    with_detail: bool,
    node_id: int,
    board: str,
    frame_seq: int,
    sent_ns: int | None = None,
) -> bytes:
    """The frame of ``rows[picked]``, ``rows`` being a read_detailed_array() result (DETAILED_DTYPE,
    C-contiguous), with each row's detail when ``with_detail``: what ``pack_frame`` makes of the same
    rows, at a fraction of its cost."""
    if rows.dtype != DETAILED_DTYPE or not rows.flags.c_contiguous:
        raise InvalidInputError("pack_board_rows needs a C-contiguous DETAILED_DTYPE array (read_detailed_array())")
    raw = rows.view(np.uint8).reshape(len(rows), _ROW_SIZE)[picked]
    if with_detail:
        body = np.empty((len(raw), DETAILED_RECORD_SIZE), np.uint8)
        body[:, :RECORD_SIZE] = raw[:, :RECORD_SIZE]
        body[:, RECORD_SIZE:] = raw[:, _ROW_DETAIL : _ROW_DETAIL + DETAIL_SIZE]
    else:
        body = raw[:, :RECORD_SIZE]
    return _frame(body, node_id=node_id, board=board, frame_seq=frame_seq, sent_ns=sent_ns)


def detail_buffers(data: bytes | memoryview, frame: Frame) -> list[memoryview]:
    """Each record's detail in a frame that carries them, as the DETAIL_SIZE-byte buffers
    ``BoardWriter.publish_relayed`` takes (views into ``data``, no copy)."""
    view = memoryview(data)
    first = HEADER_SIZE + RECORD_SIZE
    return [view[at : at + DETAIL_SIZE]
            for at in range(first, first + len(frame.records) * DETAILED_RECORD_SIZE, DETAILED_RECORD_SIZE)]


def unpack_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Parse and check a frame's envelope; raises FrameError (never anything else) when it is bad."""
    size = len(data)
    if size < len(WIRE_MAGIC) or bytes(data[: len(WIRE_MAGIC)]) != WIRE_MAGIC:
        raise FrameError(BAD_MAGIC, f"not a dpboard relay frame: it does not start with {WIRE_MAGIC!r}")
    if size < 6:
        raise FrameError(BAD_LENGTH, f"frame of {size} bytes is truncated before its version")
    version = int.from_bytes(bytes(data[4:6]), "little")
    if version != WIRE_VERSION:
        raise FrameError(
            BAD_VERSION,
            f"frame version {version}, this collector reads version {WIRE_VERSION}: run the same dpboard "
            f"version on the relay and the collector",
        )
    if size > MAX_FRAME_SIZE:
        raise FrameError(BAD_LENGTH, f"frame of {size} bytes is larger than the {MAX_FRAME_SIZE}-byte maximum")
    if size < HEADER_SIZE:
        raise FrameError(BAD_LENGTH, f"frame of {size} bytes is shorter than its {HEADER_SIZE}-byte header")
    (_, _, header_size, record_size, _, count, node_id, frame_seq, sent_ns, raw_board) = (
        HEADER_STRUCT.unpack_from(data, 0)
    )
    if header_size != HEADER_SIZE or record_size not in (RECORD_SIZE, DETAILED_RECORD_SIZE):
        raise FrameError(
            BAD_LENGTH,
            f"frame declares a {header_size}-byte header and {record_size}-byte records; version "
            f"{WIRE_VERSION} has {HEADER_SIZE} and {RECORD_SIZE} or {DETAILED_RECORD_SIZE}",
        )
    if count > MAX_RECORDS or size != HEADER_SIZE + count * record_size:
        raise FrameError(
            BAD_LENGTH,
            f"frame declares {count} records ({HEADER_SIZE + count * record_size} bytes) but is {size} bytes",
        )
    board_bytes = raw_board.rstrip(b"\x00")
    try:
        board = board_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(BAD_IDENTITY, f"frame's board name {board_bytes!r} is not UTF-8") from None
    if node_id < 0:
        raise FrameError(BAD_NODE, f"frame's node id {node_id} is negative")
    details = None
    if record_size == RECORD_SIZE:
        records = np.frombuffer(data, dtype=RECORD_DTYPE, count=count, offset=HEADER_SIZE)
    else:
        body = np.frombuffer(data, dtype=DETAILED_RECORD_DTYPE, count=count, offset=HEADER_SIZE)
        records, details = body["load"], body["detail"]
    return Frame(node_id=node_id, frame_seq=frame_seq, sent_ns=sent_ns, board=board, records=records,
                 details=details)


def validate_records(frame: Frame, *, n_slots: int) -> None:
    """Check each record against the receiving board: rank in range, node id that of the frame, loads
    not negative. Raises FrameError; one bad record condemns the whole frame."""
    rec = frame.records
    if len(rec) == 0:
        return
    if len(rec) > n_slots:
        raise FrameError(
            BAD_LENGTH, f"frame from node {frame.node_id} carries {len(rec)} records, more than this board's "
            f"{n_slots} slots",
        )
    ranks = rec["dp_rank"]
    if int(ranks.min()) < 0 or int(ranks.max()) >= n_slots:
        bad = int(ranks[(ranks < 0) | (ranks >= n_slots)][0])
        raise FrameError(
            BAD_RANK,
            f"frame from node {frame.node_id} carries rank {bad}, outside this board's ranks 0..{n_slots - 1}: "
            f"every node's board must have the cluster's shape",
        )
    nodes = rec["node_id"]
    if not bool((nodes == frame.node_id).all()):
        bad = int(nodes[nodes != frame.node_id][0])
        raise FrameError(
            BAD_NODE, f"frame from node {frame.node_id} carries a snapshot written on node {bad}"
        )
    for name in _LOAD_COLUMNS:
        if int(rec[name].min()) < 0:
            raise FrameError(BAD_LOAD, f"frame from node {frame.node_id} carries a negative {name}")
    if frame.details is not None:
        problem = detail_problem(frame.details)
        if problem is not None:
            raise FrameError(BAD_LOAD, f"frame from node {frame.node_id} carries a detail that {problem}")
