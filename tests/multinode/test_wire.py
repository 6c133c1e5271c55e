"""The relay frame format: round trips, every kind of bad frame, and arbitrary bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpboard import Board, LoadSnapshot
from dpboard.multinode.wire import (
    BAD_REASONS,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAX_FRAME_SIZE,
    RECORD_DTYPE,
    RECORD_SIZE,
    WIRE_VERSION,
    FrameError,
    pack_frame,
    unpack_frame,
    validate_records,
)


def records(ranks: list[int], node_id: int = 1) -> np.ndarray:
    rec = np.zeros(len(ranks), dtype=RECORD_DTYPE)
    rec["dp_rank"] = ranks
    rec["num_running_reqs"] = [r * 3 for r in ranks]
    rec["max_total_num_tokens"] = 1000
    rec["timestamp_ns"] = 123456789
    rec["publish_seq"] = [r + 10 for r in ranks]
    rec["node_id"] = node_id
    return rec


def reason_of(data: bytes, n_slots: int = 8) -> str | None:
    try:
        validate_records(unpack_frame(data), n_slots=n_slots)
    except FrameError as e:
        return e.reason
    return None


def test_round_trip_keeps_every_field():
    rec = records([0, 3, 7], node_id=2)
    data = pack_frame(rec, node_id=2, board="cluster", frame_seq=41, sent_ns=99)
    assert len(data) == HEADER_SIZE + 3 * RECORD_SIZE
    frame = unpack_frame(data)
    assert (frame.node_id, frame.frame_seq, frame.sent_ns, frame.board) == (2, 41, 99, "cluster")
    assert frame.records.tobytes() == rec.tobytes()
    validate_records(frame, n_slots=8)


def test_packs_rows_of_a_board_read(board_name):
    with Board.create(board_name, n_slots=4, node_id=1) as board:
        board.writer(2).publish(LoadSnapshot(dp_rank=2, num_running_reqs=5, num_used_tokens=7))
        arr = board.reader().read_array()
        frame = unpack_frame(pack_frame(arr[[2]], node_id=1, board=board_name, frame_seq=0))
        got = LoadSnapshot(*frame.records.tolist()[0])
        assert got == board.reader().read(2)


def test_header_is_little_endian_at_documented_offsets():
    data = pack_frame(records([1]), node_id=1, board="b", frame_seq=7, sent_ns=5)
    assert data[0:4] == b"DPRL"
    assert struct.unpack_from("<HHH", data, 4) == (WIRE_VERSION, 104, 104)
    assert struct.unpack_from("<I", data, 12)[0] == 1
    assert struct.unpack_from("<qQq", data, 16) == (1, 7, 5)
    assert data[40:41] == b"b" and data[41:104] == b"\x00" * 63
    assert struct.unpack_from("<q", data, 104)[0] == 1  # first record's dp_rank


def test_empty_frame_is_valid():
    frame = unpack_frame(pack_frame(records([]), node_id=1, board="b", frame_seq=0))
    validate_records(frame, n_slots=8)
    assert len(frame.records) == 0


def _with_header(data: bytes, **changes: int | bytes) -> bytes:
    fields = dict(zip(
        ["magic", "version", "header_size", "record_size", "reserved", "count", "node_id", "frame_seq",
         "sent_ns", "board"], HEADER_STRUCT.unpack_from(data, 0), strict=True))
    fields.update(changes)
    return HEADER_STRUCT.pack(*fields.values()) + data[HEADER_SIZE:]


GOOD = pack_frame(records([0, 1, 2]), node_id=1, board="b", frame_seq=0)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "bad_magic"),
        (b"DPR", "bad_magic"),
        (b"XXXX" + GOOD[4:], "bad_magic"),
        (GOOD[:5], "bad_length"),
        (_with_header(GOOD, version=2), "bad_version"),
        (_with_header(GOOD, version=0), "bad_version"),
        (GOOD[:HEADER_SIZE - 1], "bad_length"),  # truncated header
        (GOOD[:-1], "bad_length"),  # truncated record
        (GOOD + b"\x00" * RECORD_SIZE, "bad_length"),  # more bytes than records declared
        (_with_header(GOOD, count=2**32 - 1), "bad_length"),
        (_with_header(GOOD, header_size=96), "bad_length"),
        (_with_header(GOOD, record_size=112), "bad_length"),
        (pack_frame(records(list(range(9))), node_id=1, board="b", frame_seq=0), "bad_length"),  # > n_slots
        (GOOD + b"\x00" * (MAX_FRAME_SIZE + 1 - len(GOOD)), "bad_length"),  # oversized
        (_with_header(GOOD, board=b"\xff\xfe"), "bad_identity"),
        (_with_header(GOOD, node_id=-1), "bad_node"),
        (pack_frame(records([0, 8]), node_id=1, board="b", frame_seq=0), "bad_rank"),
        (pack_frame(records([0], node_id=3), node_id=1, board="b", frame_seq=0), "bad_node"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_frames_are_refused_with_their_reason(data, reason):
    assert reason_of(data) == reason
    assert reason in BAD_REASONS


def test_negative_load_and_rank_are_refused():
    rec = records([0, 1])
    rec["num_waiting_reqs"][1] = -5
    assert reason_of(pack_frame(rec, node_id=1, board="b", frame_seq=0)) == "bad_load"
    rec = records([0, 1])
    rec["dp_rank"][0] = -1
    assert reason_of(pack_frame(rec, node_id=1, board="b", frame_seq=0)) == "bad_rank"


def test_pack_refuses_what_cannot_be_sent():
    with pytest.raises(ValueError, match="board name"):
        pack_frame(records([0]), node_id=1, board="x" * 65, frame_seq=0)
    with pytest.raises(ValueError, match="node_id"):
        pack_frame(records([0]), node_id=-2, board="b", frame_seq=0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_only_ever_raise_frame_error(data):
    reason = reason_of(data)
    assert reason is None or reason in BAD_REASONS


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(0, 255), st.integers(0, len(GOOD)))
def test_mutated_and_cut_frames_only_ever_raise_frame_error(pos, value, cut):
    mutated = bytearray(GOOD)
    mutated[pos] = value
    for data in (bytes(mutated), bytes(mutated[:cut])):
        reason = reason_of(data)
        assert reason is None or reason in BAD_REASONS
