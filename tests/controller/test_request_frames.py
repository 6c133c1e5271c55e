"""The controller's C request reader against msgpack itself: it must accept exactly the frames the
schedulers' ``msgpack.unpackb`` (its defaults: raw=False, strict_map_key=True, timestamp=0) accepts,
and read the five keys as msgpack's dict holds them.

A frame the reader accepted but msgpack refused once reached every demo scheduler in turn, each
exiting on it; a frame msgpack accepts but the reader refused (a uint64 >= 2**63 anywhere, a
repeated key whose first value was unusable) was dropped. The differential fuzz is seeded and
bounded: a few thousand frames, structured and mutated, in a few seconds."""

from __future__ import annotations

import random
import struct
from typing import Any

import msgpack
import pytest

from dpboard.controller import _prefix
from dpboard.controller.prefix_index import block_hashes_py

MISSING = object()
INT64 = (-(2**63), 2**63)


class Raw:
    """Bytes placed as they are in a packed frame (a value msgpack.packb would never write)."""

    def __init__(self, data: bytes):
        self.data = data


class Pairs(list):
    """A map as its entries, in order, repeats and raw keys allowed."""


def pack(obj: Any) -> bytes:
    if isinstance(obj, Raw):
        return obj.data
    if isinstance(obj, Pairs):
        n = len(obj)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
        return head + b"".join(pack(k) + pack(v) for k, v in obj)
    if isinstance(obj, list):
        n = len(obj)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
        return head + b"".join(pack(v) for v in obj)
    return msgpack.packb(obj)


def expected(frame: bytes, block_size: int) -> tuple | None:
    """What read_request must return for ``frame``, from msgpack's own decode; None: refused."""
    try:
        m = msgpack.unpackb(frame)
    except Exception:  # whatever msgpack raises, a scheduler could not read the frame
        return None
    if type(m) is not dict:
        return None
    rid = m.get("rid", MISSING)
    if not (type(rid) is str or type(rid) is int):
        return None
    ids = m.get("input_ids")
    hashes = None
    if ids is None:
        n_ids = -1
    elif type(ids) is list and all(type(t) is int and INT64[0] <= t < INT64[1] for t in ids):
        n_ids = len(ids)
        if block_size > 0:
            hashes = struct.pack(f"={len(ids) // block_size}Q", *block_hashes_py(ids, block_size))
    else:
        return None
    num_tokens = m.get("num_tokens")
    if type(num_tokens) is not int:
        num_tokens = None
    out = [rid, n_ids, num_tokens]
    for key in ("routed_dp_rank", "bootstrap_room"):
        v = m.get(key)
        if v is not None and type(v) is not int:
            return None
        out.append(v)
    return (*out, hashes)


def c_read(frame: bytes, block_size: int) -> tuple | None:
    try:
        return _prefix.read_request(frame, block_size)
    except ValueError:
        return None


def typed(result: tuple | None) -> tuple | None:
    """True == 1 in Python: compare types too."""
    return None if result is None else tuple((type(v), v) for v in result)


def check(frame: bytes, block_size: int = 4) -> bool:
    """Assert the C reader and msgpack agree on ``frame``; returns whether it was accepted."""
    want, got = expected(frame, block_size), c_read(frame, block_size)
    assert typed(got) == typed(want), f"frame {frame[:200]!r}...: C read {got!r}, msgpack says {want!r}"
    return want is not None


# -- the cases found, one by one -------------------------------------------------------------------

BAD_UTF8 = [b"\xff\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80", b"abc\xf5"]


def _ext(code: int, data: bytes) -> Raw:
    return Raw(b"\xc7" + bytes([len(data), code & 0xFF]) + data)


def _deep(levels: int) -> Raw:
    return Raw(b"\x91" * levels + b"\x00")


REFUSED_BY_MSGPACK = {
    "invalid UTF-8 in a skipped str": Pairs([("rid", "a"), ("num_tokens", 3), ("note", Raw(b"\xa2\xff\xfe"))]),
    "a surrogate in a nested str": Pairs([("rid", "a"), ("num_tokens", 3), ("x", [Raw(b"\xa3\xed\xa0\x80")])]),
    "invalid UTF-8 in a key": Pairs([("rid", "a"), ("num_tokens", 3), (Raw(b"\xa2\xc0\x80"), 1)]),
    "an ext code of -2": Pairs([("rid", "a"), ("num_tokens", 3), ("x", _ext(-2, b"ab"))]),
    "an ext code of -128": Pairs([("rid", "a"), ("num_tokens", 3), ("x", Raw(b"\xd4\x80\x00"))]),
    "a 3-byte timestamp": Pairs([("rid", "a"), ("num_tokens", 3), ("x", _ext(-1, b"abc"))]),
    "a 16-byte timestamp": Pairs([("rid", "a"), ("num_tokens", 3), ("x", Raw(b"\xd8\xff" + bytes(16)))]),
    "a timestamp of 10**9 ns": Pairs([("rid", "a"), ("num_tokens", 3),
                                      ("x", Raw(b"\xd7\xff" + struct.pack(">Q", 10**9 << 34)))]),
    "a timestamp96 of 10**9 ns": Pairs([("rid", "a"), ("num_tokens", 3),
                                        ("x", _ext(-1, struct.pack(">Iq", 10**9, 0)))]),
    "a list as a map key": Pairs([("rid", "a"), ("num_tokens", 3), (Raw(b"\x91\x00"), 1)]),
    "a map as a nested map key": Pairs([("rid", "a"), ("num_tokens", 3), ("x", Pairs([(Raw(b"\x80"), 1)]))]),
    "an int as a nested map key": Pairs([("rid", "a"), ("num_tokens", 3), ("x", Pairs([(7, 1)]))]),
    "nil as a map key": Pairs([("rid", "a"), ("num_tokens", 3), (None, 1)]),
    "1025 nested containers": Pairs([("rid", "a"), ("num_tokens", 3), ("x", _deep(1024))]),
    "1025 nested, the last empty": Pairs([("rid", "a"), ("num_tokens", 3), ("x", Raw(b"\x91" * 1023 + b"\x80"))]),
    "0xc1": Pairs([("rid", "a"), ("num_tokens", 3), ("x", Raw(b"\xc1"))]),
}

ACCEPTED_BY_MSGPACK = {
    "a seed of 2**63": Pairs([("rid", "a"), ("num_tokens", 3), ("sampling_params", {"seed": 2**63})]),
    "uint64 max and int64 min": Pairs([("rid", "a"), ("input_ids", [1]), ("x", [2**64 - 1, -(2**63)])]),
    "rid nil, then rid 'b'": Pairs([("rid", None), ("num_tokens", 3), ("rid", "b")]),
    "input_ids 'abc', then a list": Pairs([("rid", 1), ("input_ids", "abc"), ("input_ids", [4, 5, 6, 7, 8])]),
    "routed 'two', then 2": Pairs([("rid", 1), ("num_tokens", 3), ("routed_dp_rank", "two"), ("routed_dp_rank", 2)]),
    "a room list, then nil": Pairs([("rid", 1), ("num_tokens", 3), ("bootstrap_room", [1]), ("bootstrap_room", None)]),
    "a uint64 rid": Pairs([("rid", 2**64 - 1), ("num_tokens", 3)]),
    "ext codes 0 and 127": Pairs([("rid", "a"), ("num_tokens", 3), ("x", [_ext(0, b""), Raw(b"\xd4\x7f\x00")])]),
    "timestamps of 4, 8 and 12 bytes": Pairs([("rid", "a"), ("num_tokens", 3), (
        "x", [Raw(b"\xd6\xff\x00\x00\x00\x01"), Raw(b"\xd7\xff" + struct.pack(">Q", 999_999_999 << 34)),
              _ext(-1, struct.pack(">Iq", 999_999_999, -5))])]),
    "1024 nested containers": Pairs([("rid", "a"), ("num_tokens", 3), ("x", _deep(1023))]),
    "a bytes key": Pairs([("rid", "a"), ("num_tokens", 3), (b"rid", 5), (b"\xff", {b"\xfe": 1})]),
    "every UTF-8 width": Pairs([("rid", "é€𝄞"), ("num_tokens", 3), ("k\U0010ffff", "\ud7ff\ue000")]),
    "str8 and str16 keys": Pairs([(Raw(b"\xd9\x03rid"), "a"), (Raw(b"\xda\x00\x09input_ids"), [1, 2])]),
    "wide encodings of small ints": Pairs([("rid", Raw(b"\xd3" + struct.pack(">q", 5))),
                                           ("input_ids", [Raw(b"\xcf" + struct.pack(">Q", 9)), Raw(b"\xd0\xff")])]),
}


def c_error(frame: bytes) -> tuple[str, ...]:
    """The reader's ValueError args: (message,), or (message, rid) when the rid was read first."""
    with pytest.raises(ValueError) as e:
        _prefix.read_request(frame, 0)
    return e.value.args


@pytest.mark.parametrize("case", REFUSED_BY_MSGPACK)
def test_a_frame_msgpack_refuses_is_refused(case):
    frame = pack(REFUSED_BY_MSGPACK[case])
    with pytest.raises(ValueError):
        msgpack.unpackb(frame)
    message, rid = c_error(frame)
    assert message.startswith("not msgpack (") and rid == "a"  # read before the fault: the sender can be answered
    assert not check(frame)


@pytest.mark.parametrize("case", ACCEPTED_BY_MSGPACK)
def test_a_frame_msgpack_accepts_is_read_as_msgpack_reads_it(case):
    frame = pack(ACCEPTED_BY_MSGPACK[case])
    msgpack.unpackb(frame)
    assert check(frame, 4) and check(frame, 0)


def test_a_refused_frame_says_why():
    def why(case: str) -> str:
        return c_error(pack(REFUSED_BY_MSGPACK[case]))[0]

    assert why("invalid UTF-8 in a skipped str") == "not msgpack (a string that is not valid UTF-8)"
    assert why("a list as a map key") == "not msgpack (a map key that is not a string or bytes)"
    assert why("a 3-byte timestamp") == "not msgpack (a timestamp ext (type -1) that is not 4, 8 or 12 bytes long)"
    assert why("a timestamp of 10**9 ns") == "not msgpack (a timestamp ext with nanoseconds above 999999999)"
    assert why("an ext code of -2") == "not msgpack (an ext type code outside 0..127 (other than -1, the timestamp))"
    assert why("1025 nested containers") == "not msgpack (nested too deeply: more than 1024 levels)"
    # a repeated key: the last value is the one that must be usable
    assert c_error(pack(Pairs([("rid", "b"), ("num_tokens", 3), ("rid", None)]))) == (
        "rid must be a string or int, got NoneType",)
    assert c_error(pack(Pairs([("rid", "b"), ("input_ids", [1, 2.5])]))) == (
        "input_ids[1] is not an integer that fits 64 bits", "b")
    # a fault before the rid: nobody to answer
    assert c_error(b"\x82\xa1x\xa1\xff\xa3rid\xa1b") == ("not msgpack (a string that is not valid UTF-8)",)


# -- the differential fuzz ---------------------------------------------------------------------------

ODD_VALUES = [
    *(Raw(bytes([0xA0 | len(b)]) + b) for b in BAD_UTF8),
    _ext(-1, b"abc"), _ext(-1, b""), _ext(-1, bytes(12)), _ext(-1, bytes(8)), _ext(-2, b"x"), _ext(-128, b""),
    _ext(127, b"x"), Raw(b"\xd7\xff" + struct.pack(">Q", (2**30 - 1) << 34)), Raw(b"\xd4\xff\x00"),
    Raw(b"\x81\x91\x00\x00"), Raw(b"\x81\x80\x00"), Raw(b"\x81\x00\x00"), Raw(b"\x81\xc3\x00"), Raw(b"\x81\xc4\x00\x00"),
    Raw(b"\xc1"), Raw(b"\xcf" + b"\xff" * 8), Raw(b"\xcf\x80" + bytes(7)), Raw(b"\xd3\x80" + bytes(7)),
    _deep(1022), _deep(1023), _deep(1024), Raw(b"\xca\x7f\xc0\x00\x00"), Raw(b"\xc6\x00\x00\x00\x01x"),
]


def rand_int(rng: random.Random) -> int:
    return rng.choice([0, 1, -1, 127, 128, -32, -33, 255, 2**16, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, 2**64 - 1,
                       -(2**63), rng.randrange(-(2**63), 2**64)])


def rand_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.08:
        return rng.choice(ODD_VALUES)
    if depth < 3 and r < 0.25:
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3 and r < 0.35:
        return Pairs((rng.choice(["a", "rid", "é", b"k"]), rand_value(rng, depth + 1)) for _ in range(rng.randrange(3)))
    return rng.choice([
        rand_int(rng), None, True, False, 1.5, float("nan"), "", "x" * rng.randrange(40), "日本", b"\x00\xff",
        msgpack.ExtType(rng.randrange(128), b"ab"), msgpack.Timestamp(rng.randrange(2**34), rng.randrange(10**9)),
    ])


def rand_ids(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.1:
        return None
    if r < 0.2:
        return rand_value(rng)
    ids: list[Any] = [rng.randrange(-(2**63), 2**63) if rng.random() < 0.1 else rng.randrange(50_000)
                      for _ in range(rng.randrange(20))]
    if ids and rng.random() < 0.15:
        ids[rng.randrange(len(ids))] = rand_value(rng)
    return ids


def rand_frame(rng: random.Random) -> bytes:
    entries: list[tuple[Any, Any]] = []
    if rng.random() < 0.95:
        entries.append(("rid", rng.choice([f"r{rng.randrange(1000)}", rng.randrange(-5, 2**64)])
                        if rng.random() < 0.85 else rand_value(rng)))
    if rng.random() < 0.7:
        entries.append(("input_ids", rand_ids(rng)))
    if rng.random() < 0.5:
        entries.append(("num_tokens", rng.randrange(10_000) if rng.random() < 0.8 else rand_value(rng)))
    for key in ("routed_dp_rank", "bootstrap_room"):
        if rng.random() < 0.4:
            entries.append((key, rng.choice([None, rng.randrange(8), 2**64 - 1]) if rng.random() < 0.8
                            else rand_value(rng)))
    for _ in range(rng.randrange(4)):
        entries.append((rng.choice(["note", "sampling_params", "stream", b"bin", Raw(b"\xd9\x04note")]),
                        rand_value(rng)))
    if entries and rng.random() < 0.2:  # a repeated key: the last value counts
        key = rng.choice(["rid", "input_ids", "num_tokens", "routed_dp_rank", "bootstrap_room"])
        entries.insert(rng.randrange(len(entries) + 1), (key, rand_value(rng)))
    rng.shuffle(entries)
    return pack(Pairs(entries))


INTERESTING = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0xA0, 0xBF, 0xC0, 0xC1, 0xC4, 0xC7, 0xCF, 0xD3, 0xD4, 0xD7, 0xD8, 0xD9,
               0xDC, 0xDE, 0xDF, 0xE0, 0xED, 0xF4, 0xFE, 0xFF]


def mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and i < len(b):
            b[i] = rng.choice(INTERESTING) if rng.random() < 0.5 else rng.randrange(256)
        elif op == 1:
            b.insert(i, rng.choice(INTERESTING))
        elif op == 2 and i < len(b):
            del b[i]
        elif op == 3:
            del b[i:]
        else:
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[min(i, j):max(i, j)][:16]
    return bytes(b)


@pytest.mark.timeout(120)
def test_the_reader_accepts_exactly_what_msgpack_accepts():
    """4,000 structured frames (the odd cases above mixed into valid requests) and 4,000 mutations
    of them, seeded: every one is accepted by both or refused by both, and read the same."""
    rng = random.Random(20261201)
    accepted = refused = 0
    for i in range(8000):
        frame = rand_frame(rng)
        if i % 2:
            frame = mutate(rng, frame)
        for block_size in (0, 3):
            if check(frame, block_size):
                accepted += 1
            else:
                refused += 1
    # both outcomes are well represented, so the comparison is not vacuous
    assert accepted > 3000 and refused > 3000, (accepted, refused)


def test_decode_request_forwards_what_a_scheduler_can_decode():
    """The codec on top: every frame it turns into a Request is one the scheduler's unpackb reads."""
    from dpboard.controller.codec import MalformedFrame, RequestRefused, decode_request

    rng = random.Random(7)
    for _ in range(2000):
        frame = mutate(rng, rand_frame(rng))
        try:
            req = decode_request(frame, 4)
        except (MalformedFrame, RequestRefused):
            continue
        msgpack.unpackb(req.raw)
