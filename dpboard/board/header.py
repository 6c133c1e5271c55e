"""The board header: what it holds, how it is packed, and the checks an attacher makes."""

from __future__ import annotations

import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Any

from dpboard.board.errors import BoardLayoutError
from dpboard.board.liveness import process_alive, process_exited, process_start_ticks
from dpboard.board.names import MAX_SLOTS
from dpboard.snapshot import HEADER_LAYOUT, HEADER_SIZE, LAYOUT_VERSION, MAGIC, SLOT_SIZE, segment_size

# The header's fields, little-endian, at the offsets HEADER_DTYPE gives them (packed in one call).
HEADER_STRUCT: struct.Struct = HEADER_LAYOUT.struct
NO_MAGIC = b"\x00" * 8


@dataclass(frozen=True)
class BoardHeader:
    name: str
    layout_version: int
    header_size: int
    n_slots: int
    slot_size: int
    creator_pid: int
    creation_time_ns: int
    generation: int
    node_id: int
    creator_start_ticks: int

    @classmethod
    def new(cls, name: str, n_slots: int, node_id: int) -> BoardHeader:
        """The header of a board this process creates now: this dpboard's layout, this process as its
        creator, a random odd generation."""
        pid = os.getpid()
        return cls(name=name, layout_version=LAYOUT_VERSION, header_size=HEADER_SIZE, n_slots=n_slots,
                   slot_size=SLOT_SIZE, creator_pid=pid, creation_time_ns=time.time_ns(),
                   generation=secrets.randbits(63) | 1, node_id=node_id, creator_start_ticks=process_start_ticks(pid))

    @property
    def creator_alive(self) -> bool:
        """Its creator runs with the recorded start time and has not exited (a zombie, killed and
        not yet reaped, holds nothing)."""
        return process_alive(self.creator_pid, self.creator_start_ticks) and not process_exited(self.creator_pid)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "creator_alive": self.creator_alive}


def pack_header(buf: Any, header: BoardHeader, magic: bytes = MAGIC) -> None:
    HEADER_STRUCT.pack_into(
        buf, 0, magic, header.layout_version, header.header_size, header.n_slots, header.slot_size,
        header.creator_pid, header.creation_time_ns, header.generation, header.name.encode(), header.node_id,
        header.creator_start_ticks,
    )


def unpack_header(buf: Any) -> tuple[bytes, BoardHeader]:
    """(magic, header) from the first bytes of a segment (``buf`` holds at least HEADER_STRUCT.size)."""
    (magic, version, header_size, n_slots, slot_size, creator_pid, created, generation, raw_name,
     node_id, start_ticks) = HEADER_STRUCT.unpack_from(buf, 0)
    header = BoardHeader(name=raw_name.rstrip(b"\x00").decode("utf-8", "replace"), layout_version=version,
                         header_size=header_size, n_slots=n_slots, slot_size=slot_size, creator_pid=creator_pid,
                         creation_time_ns=created, generation=generation, node_id=node_id,
                         creator_start_ticks=start_ticks)
    return magic, header


def check_layout(name: str, header: BoardHeader, size: int, expected_slots: int | None) -> None:
    """Raise BoardLayoutError, naming both sides, when the board is not what this dpboard reads."""
    if header.layout_version != LAYOUT_VERSION:
        raise BoardLayoutError(
            f"board {name!r} has layout version {header.layout_version}, but this dpboard reads layout "
            f"version {LAYOUT_VERSION}: run the same dpboard version on both sides, or recreate the board"
        )
    if header.slot_size != SLOT_SIZE or header.header_size != HEADER_SIZE:
        raise BoardLayoutError(
            f"board {name!r} has {header.slot_size}-byte slots after a {header.header_size}-byte header, "
            f"this dpboard expects {SLOT_SIZE}-byte slots after a {HEADER_SIZE}-byte header"
        )
    if not 1 <= header.n_slots <= MAX_SLOTS:
        raise BoardLayoutError(
            f"board {name!r} claims {header.n_slots} slots, outside 1..{MAX_SLOTS}: the segment is damaged "
            f"or not a board; remove it with `dpboard clean {name} --force`")
    if expected_slots is not None and header.n_slots != expected_slots:
        raise BoardLayoutError(
            f"board {name!r} has {header.n_slots} slots, but {expected_slots} were expected: "
            f"use n_slots={header.n_slots}, or remove the board (`dpboard clean {name} --force`) and recreate it"
        )
    if size < segment_size(header.n_slots):
        raise BoardLayoutError(
            f"board {name!r} is {size} bytes, too small for its {header.n_slots} slots "
            f"({segment_size(header.n_slots)} bytes): the segment is damaged; remove it with `dpboard clean`"
        )
