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
    DETAILED_RECORD_SIZE,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAX_FRAME_SIZE,
    RECORD_DTYPE,
    RECORD_SIZE,
    WIRE_VERSION,
    FrameError,
    pack_board_rows,
    pack_frame,
    unpack_frame,
    validate_records,
)
from dpboard.snapshot import DETAIL_DTYPE, DETAIL_FLAG, DETAILED_DTYPE, pack_detail, unpack_detail
from tests.support.board_procs import consistent_detail


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
        (_with_header(GOOD, version=1), "bad_version"),  # the version before the detail
        (_with_header(GOOD, version=2), "bad_version"),  # the version before the lockstep section
        (_with_header(GOOD, version=4), "bad_version"),
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


# -- frames that carry each slot's detail ---------------------------------------------------------


def details(ks: list[int]) -> np.ndarray:
    out = np.zeros(len(ks), DETAIL_DTYPE)
    for i, k in enumerate(ks):
        pack_detail(consistent_detail(k), out[i : i + 1])
    return out


GOOD_DETAILED = pack_frame(records([0, 1, 2]), node_id=1, board="b", frame_seq=0, details=details([1, 2, 5]))


def test_a_detailed_frame_round_trips_every_detail():
    data = GOOD_DETAILED
    assert len(data) == HEADER_SIZE + 3 * DETAILED_RECORD_SIZE
    assert struct.unpack_from("<H", data, 8)[0] == DETAILED_RECORD_SIZE == 456
    frame = unpack_frame(data)
    validate_records(frame, n_slots=8)
    assert frame.records.tolist() == records([0, 1, 2]).tolist()
    assert [unpack_detail(d) for d in frame.details] == [consistent_detail(k) for k in (1, 2, 5)]
    assert consistent_detail(5) is None  # a slot without detail rides in a detailed frame as flags 0
    # the second record starts with its dp_rank right after the first record's detail
    assert struct.unpack_from("<q", data, HEADER_SIZE + DETAILED_RECORD_SIZE)[0] == 1


def test_packs_rows_of_a_detailed_board_read(board_name):
    with Board.create(board_name, n_slots=4, node_id=1) as board:
        board.writer(2).publish_detailed(LoadSnapshot(dp_rank=2, num_running_reqs=5), consistent_detail(4))
        both = board.reader().read_detailed_array(np.zeros(4, DETAILED_DTYPE))
        frame = unpack_frame(pack_frame(both["load"][[2]], node_id=1, board=board_name, frame_seq=0,
                                        details=both["detail"][[2]]))
        assert LoadSnapshot(*frame.records.tolist()[0]) == board.reader().read(2)
        assert unpack_detail(frame.details[0]) == consistent_detail(4)


def _detailed_with(mutate) -> bytes:
    d = details([1, 2])
    mutate(d)
    return pack_frame(records([0, 1]), node_id=1, board="b", frame_seq=0, details=d)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (GOOD_DETAILED[:-1], "bad_length"),
        (_with_header(GOOD_DETAILED, record_size=RECORD_SIZE), "bad_length"),  # the body is 456-byte records
        (_with_header(GOOD, record_size=DETAILED_RECORD_SIZE), "bad_length"),
        (_detailed_with(lambda d: d["flags"].__setitem__(0, d["flags"][0] | np.uint64(1 << 40))), "bad_load"),
        (_detailed_with(lambda d: d["flags"].__setitem__(1, DETAIL_FLAG["memory"])), "bad_load"),
        (_detailed_with(lambda d: d["decode_moments_count"].__setitem__(0, 9)), "bad_load"),
        (_detailed_with(lambda d: d["decode_moments_count"].__setitem__(0, -1)), "bad_load"),
        (_detailed_with(lambda d: d["disaggregation_mode"].__setitem__(0, b"\xff\xfe")), "bad_load"),
    ],
    ids=["truncated", "says-104", "says-456", "unknown-flag", "no-present-bit", "moments-9", "moments-neg",
         "mode-not-utf8"],
)
def test_bad_detailed_frames_are_refused_with_their_reason(data, reason):
    assert reason_of(data) == reason


def test_pack_refuses_details_that_do_not_match_the_records():
    with pytest.raises(ValueError, match="details must be 2 DETAIL_DTYPE records"):
        pack_frame(records([0, 1]), node_id=1, board="b", frame_seq=0, details=details([1]))


@settings(max_examples=400, deadline=None)
@given(st.integers(0, len(GOOD_DETAILED) - 1), st.integers(0, 255))
def test_a_detailed_frame_that_passes_always_reads_back(pos, value):
    """Whatever byte a network or a bad relay changes, a frame is refused or every detail in it is one
    that node0's readers can unpack."""
    mutated = bytearray(GOOD_DETAILED)
    mutated[pos] = value
    try:
        frame = unpack_frame(bytes(mutated))
        validate_records(frame, n_slots=8)
    except FrameError as e:
        assert e.reason in BAD_REASONS
        return
    for d in frame.details:
        unpack_detail(d)


def test_a_relays_byte_copy_of_board_rows_is_the_frame_pack_frame_makes(board_name):
    with Board.create(board_name, n_slots=6, node_id=1) as board:
        for rank in (0, 2, 3, 5):
            board.writer(rank).publish_detailed(LoadSnapshot(dp_rank=rank, num_running_reqs=rank + 1,
                                                             num_total_tokens=10 * rank), consistent_detail(rank + 1))
        rows = board.reader().read_detailed_array(np.zeros(6, DETAILED_DTYPE))
        picked = np.array([0, 3, 5])
        for with_detail in (False, True):
            fast = pack_board_rows(rows, picked, with_detail=with_detail, node_id=1, board="b", frame_seq=4,
                                   sent_ns=77)
            slow = pack_frame(rows["load"][picked], node_id=1, board="b", frame_seq=4, sent_ns=77,
                              details=rows["detail"][picked] if with_detail else None)
            assert fast == slow
        with pytest.raises(ValueError, match="DETAILED_DTYPE"):
            pack_board_rows(rows["load"], picked, with_detail=False, node_id=1, board="b", frame_seq=0)
