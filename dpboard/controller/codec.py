"""The controller's request frame: one msgpack map per request, decoded just enough to dispatch.

A frame is a map with ``rid`` and ``input_ids`` (a list) or ``num_tokens``, and optionally
``routed_dp_rank`` and ``bootstrap_room``; other keys pass through untouched, because the controller
forwards the frame's original bytes (``Request.raw``). A request of more than ``MAX_REQUEST_TOKENS``
tokens is refused (``RequestRefused``, answered with an error): no budget sum may overflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from dpboard.controller.budget import MAX_REQUEST_TOKENS
from dpboard.controller.prefix_index import frame_block_hashes
from dpboard.errors import InvalidInputError


class Request:
    """What the Dispatcher reads of a decoded frame; ``raw`` is what is forwarded."""

    __slots__ = ("rid", "routed_dp_rank", "bootstrap_room", "num_tokens", "raw", "block_hashes")

    def __init__(self, rid: Any, routed_dp_rank: int | None, bootstrap_room: int | None, num_tokens: int,
                 raw: bytes, block_hashes: list[int] | None = None):
        self.rid = rid
        self.routed_dp_rank = routed_dp_rank
        self.bootstrap_room = bootstrap_room
        self.num_tokens = num_tokens
        self.raw = raw
        # the prompt's chained block hashes, read from ``raw`` by a controller whose method uses them
        self.block_hashes = block_hashes


class MalformedFrame(InvalidInputError):
    """A frame that is not a request map; the message says what is wrong with it."""


class RequestRefused(InvalidInputError):
    """A well-formed request that is refused (answered with an error naming ``rid``)."""

    def __init__(self, rid: Any, message: str):
        super().__init__(message)
        self.rid = rid


def _optional_int(msg: dict, key: str) -> int | None:
    value = msg.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise MalformedFrame(f"{key} must be an int or nil, got {type(value).__name__}")
    return value


def decode_request(raw: bytes, block_size: int | None = None) -> Request:
    """A frame -> Request, or ``MalformedFrame`` saying what is wrong with it. With ``block_size``,
    the request also gets its prompt's chained block hashes, read from the frame's bytes."""
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bad bytes
        raise MalformedFrame(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise MalformedFrame(f"not a map but {type(msg).__name__}")
    if "rid" not in msg:
        raise MalformedFrame("no rid")
    rid = msg["rid"]
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise MalformedFrame(f"rid must be a string or int, got {type(rid).__name__}")
    ids = msg.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list):
            raise MalformedFrame(f"input_ids must be a list, got {type(ids).__name__}")
        num_tokens = len(ids)
    else:
        num_tokens = msg.get("num_tokens")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise MalformedFrame("needs input_ids (a list) or num_tokens (an int >= 0)")
    routed = _optional_int(msg, "routed_dp_rank")
    room = _optional_int(msg, "bootstrap_room")
    if num_tokens > MAX_REQUEST_TOKENS:
        raise RequestRefused(rid, f"request of {num_tokens} tokens is larger than the {MAX_REQUEST_TOKENS} "
                                  f"tokens a request may have")
    hashes = None
    if block_size is not None and ids is not None:
        try:
            found = frame_block_hashes(raw, block_size)
        except ValueError as e:
            raise MalformedFrame(str(e)) from None
        hashes = [] if found is None else found[1]
    return Request(rid, routed, room, num_tokens, raw, hashes)


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
