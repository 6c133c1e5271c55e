"""The controller's request frame: one msgpack map per request, decoded just enough to dispatch.

A frame is a map with ``rid`` and ``input_ids`` (a list) or ``num_tokens``, and optionally
``routed_dp_rank`` and ``bootstrap_room``; other keys pass through untouched, because the controller
forwards the frame's original bytes (``Request.raw``). A request of more than ``MAX_REQUEST_TOKENS``
tokens is refused (``RequestRefused``, answered with an error): no budget sum may overflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from dpboard.controller._prefix import read_request
from dpboard.controller.budget import MAX_REQUEST_TOKENS
from dpboard.errors import InvalidInputError


@dataclass(slots=True, eq=False)  # eq=False: a request is itself, as the delivery ledger holds it
class Request:
    """What the Dispatcher reads of a decoded frame; ``raw`` is what is forwarded. ``lost`` counts the
    receivers whose connection broke before they acknowledged it (the controller's redelivery bound)."""

    rid: Any
    routed_dp_rank: int | None
    bootstrap_room: int | None
    num_tokens: int
    raw: bytes
    # the prompt's chained block hashes, read from ``raw`` by a controller whose method uses them
    block_hashes: list[int] | None = None
    lost: int = 0


class MalformedFrame(InvalidInputError):
    """A frame that is not a request map; the message says what is wrong with it. ``rid`` is the
    frame's rid when it could be read before the fault (the sender can then be answered), else None."""

    def __init__(self, message: str, rid: Any = None):
        super().__init__(message)
        self.rid = rid


class RequestRefused(InvalidInputError):
    """A well-formed request that is refused (answered with an error naming ``rid``)."""

    def __init__(self, rid: Any, message: str):
        super().__init__(message)
        self.rid = rid


def decode_request(raw: bytes, block_size: int | None = None) -> Request:
    """A frame -> Request, or ``MalformedFrame`` saying what is wrong with it. With ``block_size``,
    the request also gets its prompt's chained block hashes.

    One parse, in C (``_prefix.read_request``): the five keys the controller reads, the last of a
    repeated key counting (as msgpack's decoder reads a map), every other value checked and skipped
    without building an object. A frame the schedulers' ``msgpack.unpackb`` would refuse is
    malformed (invalid UTF-8, a key that is not a str or bytes, an ext code msgpack-python does not
    take, a bad timestamp, more than 1024 levels of nesting, bytes after the map: the reader accepts
    exactly what msgpack accepts), and so is one whose ``input_ids`` holds anything but ints within
    int64, whatever the method. Nothing is built per token, so a frame of millions of empty maps
    costs what reading its bytes costs."""
    try:
        rid, n_ids, num_tokens, routed, room, hashes = read_request(raw, block_size or 0)
    except ValueError as e:
        raise MalformedFrame(str(e.args[0]), e.args[1] if len(e.args) > 1 else None) from None
    if n_ids < 0:
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise MalformedFrame("needs input_ids (a list) or num_tokens (an int >= 0)", rid)
    else:
        num_tokens = n_ids
    if num_tokens > MAX_REQUEST_TOKENS:
        raise RequestRefused(rid, f"request of {num_tokens} tokens is larger than the {MAX_REQUEST_TOKENS} "
                                  f"tokens a request may have")
    block_hashes = None
    if block_size is not None and n_ids >= 0:
        block_hashes = memoryview(hashes).cast("Q").tolist()
    return Request(rid, routed, room, num_tokens, raw, block_hashes)


def encode_request(rid: Any, *, input_ids: Sequence[int] | None = None, num_tokens: int | None = None,
                   routed_dp_rank: int | None = None, bootstrap_room: int | None = None, **extra: Any) -> bytes:
    """The frame a tokenizer-side process sends to the controller."""
    msg: dict[str, Any] = {"rid": rid, "routed_dp_rank": routed_dp_rank, "bootstrap_room": bootstrap_room}
    if input_ids is not None:
        msg["input_ids"] = list(input_ids)
    if num_tokens is not None:
        msg["num_tokens"] = num_tokens
    msg.update(extra)
    return msgpack.packb(msg, use_bin_type=True)
