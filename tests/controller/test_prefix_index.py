"""The prefix index and the block hashes it is keyed by."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpboard.controller import _prefix
from dpboard.controller.prefix_index import (
    PrefixIndex,
    block_hashes,
    block_hashes_py,
    frame_block_hashes,
    request_block_hashes,
)

token_ids = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300)


@settings(max_examples=200, deadline=None)
@given(ids=token_ids, block_size=st.integers(1, 40))
def test_the_c_hashes_equal_the_python_oracle(ids, block_size):
    expected = block_hashes_py(ids, block_size)
    assert block_hashes(ids, block_size) == expected
    assert len(expected) == len(ids) // block_size
    frame = msgpack.packb({"rid": 1, "input_ids": ids}, use_bin_type=True)
    assert frame_block_hashes(frame, block_size) == (len(ids), expected)


def test_hashes_are_chained_over_the_prefix():
    a = list(range(100))
    b = a[:60] + [999] + a[61:]
    ha, hb = block_hashes(a, 10), block_hashes(b, 10)
    assert ha[:6] == hb[:6] and all(x != y for x, y in zip(ha[6:], hb[6:], strict=True))
    c = [5] + a[1:]  # the first token differs: no block hash is shared, however equal the rest is
    assert not set(block_hashes(c, 10)) & set(ha)
    assert block_hashes(a[:30] + [7] * 9, 10) == ha[:3]  # a partial last block has no hash


def test_frames_with_other_keys_of_every_kind():
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    frame = msgpack.packb({
        "rid": "r-1", "routed_dp_rank": None, "bootstrap_room": 2**40, "flag": True, "temp": 0.7,
        "stop": ["\n", "x" * 40], "nested": {"a": [1, {"b": b"\x00" * 300}], "c": -1.5}, "input_ids": ids,
        "after": "ignored",
    }, use_bin_type=True)
    assert frame_block_hashes(frame, 4) == (8, block_hashes_py(ids, 4))
    assert frame_block_hashes(msgpack.packb({"rid": 1, "num_tokens": 9}), 4) is None
    assert frame_block_hashes(msgpack.packb({"rid": 1, "input_ids": None}), 4) is None


def nested(depth: int) -> list:
    value: list = [0]
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(("frame", "words"), [
    (msgpack.packb([1, 2, 3]), "not a map but list"),
    (msgpack.packb({"input_ids": "abc"}), "input_ids must be a list, got str"),
    (msgpack.packb({"input_ids": [1, 2.5]}), r"input_ids\[1\] is not an integer"),
    (msgpack.packb({"input_ids": [1, 2**64 - 1]}), r"input_ids\[1\] is not an integer that fits 64 bits"),
    (msgpack.packb({"rid": 1, "input_ids": list(range(50))})[:-10], "claims more elements than the frame holds"),
    (msgpack.packb({"rid": 1, "input_ids": list(range(200, 300))})[:-10], r"not msgpack \(truncated"),
    (msgpack.packb({"rid": "x" * 40, "input_ids": [1]})[:20], r"not msgpack \(truncated string\)"),
    (b"\x82\xa3rid\x01\xa4deep" + b"\x91" * 1024 + b"\x00", "nested too deeply: more than 1024 levels"),
])
def test_a_malformed_frame_is_a_clear_error(frame, words):
    with pytest.raises(ValueError, match=words):
        _prefix.hash_frame_blocks(frame, 4)


def test_bad_token_lists_and_block_sizes():
    with pytest.raises(ValueError, match=r"input_ids\[1\] is not a 64-bit integer token id"):
        block_hashes([1, "2"], 1)
    with pytest.raises(ValueError, match=r"input_ids\[0\]"):
        block_hashes([2**70], 1)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_hashes([1, 2], 0)


# -- the index ----------------------------------------------------------------------------------------


def prompt(tag: int, blocks: int, block_size: int = 4) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * block_size)]


def test_match_counts_the_leading_blocks_each_rank_holds():
    idx = PrefixIndex(4, block_size=4)
    conversation = prompt(1, 6)
    idx.record(1, block_hashes(conversation[:16], 4))  # the first 4 blocks went to rank 1
    idx.record(3, block_hashes(conversation[:8], 4))  # the first 2 to rank 3
    idx.record(2, block_hashes(prompt(2, 6), 4))  # another conversation
    assert idx.match(block_hashes(conversation, 4)).tolist() == [0, 16, 0, 8]
    assert idx.match(block_hashes(prompt(3, 6), 4)).tolist() == [0, 0, 0, 0]
    assert idx.match([]).tolist() == [0, 0, 0, 0]
    # a prompt that branches after block 1 still gets its shared first two blocks
    branch = conversation[:8] + prompt(9, 2)
    assert idx.match(block_hashes(branch, 4)).tolist() == [0, 8, 0, 8]
    out = np.full(4, 7, np.int64)
    assert idx.match(block_hashes(conversation, 4), out) is out and out.tolist() == [0, 16, 0, 8]


def test_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_suffix():
    idx = PrefixIndex(2, block_size=4, capacity_blocks=3)
    a, b = block_hashes(prompt(1, 4), 4), block_hashes(prompt(2, 2), 4)
    idx.record(0, a)  # 4 blocks into 3: the deepest is dropped, never the leading ones
    assert idx.match(a).tolist() == [12, 0] and idx.held(0) == 3
    idx.record(0, b)  # b is newer: a's least recently used blocks (its deeper ones) go first
    assert idx.match(b).tolist() == [8, 0]
    assert idx.match(a).tolist() == [4, 0] and idx.held(0) == 3
    idx.record(0, a[:1])  # touching a's first block keeps it over b's older blocks
    idx.record(0, block_hashes(prompt(3, 1), 4))
    assert idx.match(a).tolist() == [4, 0] and idx.match(b).tolist() == [4, 0]


def test_capacity_from_the_board_and_forgetting_a_rank():
    idx = PrefixIndex(2, block_size=4, capacity_blocks=100)
    a = block_hashes(prompt(1, 10), 4)
    idx.record(0, a)
    idx.record(1, a)
    idx.set_capacity_tokens([20, 0])  # rank 0 holds 20 tokens = 5 blocks; rank 1 reports nothing
    assert idx.capacity(0) == 5 and idx.capacity(1) == 100
    assert idx.match(a).tolist() == [20, 40]
    idx.forget(1)
    assert idx.match(a).tolist() == [20, 0] and idx.held(1) == 0
    # the index is bounded by the capacities: nothing is left over for blocks no rank holds
    assert len(idx._holders) == 5


def test_request_block_hashes_prefers_the_requests_own_hashes():
    class Req:
        input_ids = list(range(20))

    class Traced:
        block_hashes = (11, 22, 33)
        input_ids = [0] * 100

    class Sized:
        num_tokens = 100

    assert request_block_hashes(Req(), 5) == block_hashes(list(range(20)), 5)
    assert request_block_hashes(Traced(), 5) == [11, 22, 33]
    assert request_block_hashes(Sized(), 5) == []


def test_bad_index_arguments():
    with pytest.raises(ValueError, match="num_ranks must be an int >= 1"):
        PrefixIndex(0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        PrefixIndex(2, block_size=0)
    with pytest.raises(ValueError, match="capacity of rank 1 must be an int >= 0"):
        PrefixIndex(2).set_capacity(1, -1)


def test_the_controller_reads_block_hashes_from_the_frame():
    from dpboard.controller.codec import MalformedFrame, decode_request, encode_request

    ids = list(range(1000, 1100))
    req = decode_request(encode_request("r1", input_ids=ids), block_size=8)
    assert req.num_tokens == 100 and req.block_hashes == block_hashes(ids, 8)
    assert decode_request(encode_request("r2", num_tokens=50), block_size=8).block_hashes is None
    assert decode_request(encode_request("r3", input_ids=ids)).block_hashes is None  # no index: no hashing
    with pytest.raises(MalformedFrame, match=r"input_ids\[1\] is not an integer"):
        decode_request(encode_request("r4", input_ids=[1, "x"]), block_size=8)


def test_a_rank_with_no_history_is_taken_to_hold_what_every_other_rank_holds():
    idx = PrefixIndex(4, block_size=4)
    system = prompt(0, 2)  # a shared system prompt of two blocks
    a, b = block_hashes(system + prompt(1, 3), 4), block_hashes(system + prompt(2, 3), 4)
    idx.record(0, a)
    # one rank's blocks say nothing of what is common: the fresh ranks hold nothing
    assert idx.match(a).tolist() == [20, 0, 0, 0]
    idx.record(1, b)
    # two ranks agree on the system prompt: ranks 2 and 3 (no history) are taken to hold it too
    assert idx.match(a).tolist() == [20, 8, 8, 8]
    assert idx.match(block_hashes(system + prompt(3, 1), 4)).tolist() == [8, 8, 8, 8]
    assert idx.match(block_hashes(prompt(4, 3), 4)).tolist() == [0, 0, 0, 0]
    # once a rank has a history of its own, its own blocks count, as for any rank
    idx.record(2, block_hashes(prompt(5, 2), 4))
    assert idx.match(a).tolist() == [20, 8, 0, 0]  # rank 2 lacks the system prompt; rank 3 follows the minimum
    idx.forget(0)
    assert idx.match(a).tolist() == [0, 8, 0, 0]


def test_a_board_reported_capacity_cannot_grow_the_index_without_bound(board_name):
    """A rank's slot reporting max_total_num_tokens = 2**62 once let the index keep every block it
    was sent, growing linearly with the traffic. A real board and dispatcher: the index holds at most
    MAX_CAPACITY_BLOCKS per rank, whatever the board says."""
    from types import SimpleNamespace

    from dpboard import Board, LoadSnapshot
    from dpboard.controller import Dispatcher
    from dpboard.controller.prefix_index import MAX_CAPACITY_BLOCKS

    with Board.create(board_name, n_slots=1) as board:
        board.writer(0).publish(LoadSnapshot(0, max_total_num_tokens=2**62))
        dispatcher = Dispatcher("inflight_cache", 1, reader=board.reader(stale_after=60))
        step = 10_000
        for start in range(0, MAX_CAPACITY_BLOCKS + 3 * step, step):
            req = SimpleNamespace(rid=start, input_ids=None, num_tokens=512 * step, routed_dp_rank=None,
                                  bootstrap_room=None, block_hashes=list(range(start, start + step)))
            assert dispatcher.dispatch(req) == 0
        index = dispatcher.prefix
        assert index.capacity(0) == MAX_CAPACITY_BLOCKS
        assert index.held(0) == MAX_CAPACITY_BLOCKS


def test_the_controller_reads_a_frame_as_msgpack_reads_it():
    """The frame scanner (hashes) and msgpack (the rest) once disagreed: the scanner took the first
    of two input_ids keys and msgpack the last, the scanner missed a str16 key, and it refused
    nesting over 32 in unrelated keys that msgpack read. One parse now, agreeing with msgpack."""
    from dpboard.controller.codec import decode_request
    from dpboard.controller.prefix_index import block_hashes_py

    first, last = list(range(8)), list(range(100, 116))
    duplicate = b"\x83\xa3rid\xa1a\xa9input_ids" + msgpack.packb(first) + b"\xa9input_ids" + msgpack.packb(last)
    str16 = b"\x82\xa3rid\xa1b\xda\x00\x09input_ids" + msgpack.packb(last)
    deep = msgpack.packb({"rid": "c", "input_ids": last, "extra": nested(40)})
    for frame in (duplicate, str16, deep):
        as_msgpack = msgpack.unpackb(frame, raw=False)
        req = decode_request(frame, block_size=4)
        assert req.rid == as_msgpack["rid"] and req.num_tokens == len(as_msgpack["input_ids"]) == 16
        assert req.block_hashes == block_hashes_py(as_msgpack["input_ids"], 4)
