"""The boards on this machine: ``list_boards`` (``dpboard ls``) and ``clean_boards`` (``dpboard clean``)."""

from __future__ import annotations

from dataclasses import dataclass

import posix_ipc

from dpboard.board.errors import BoardError
from dpboard.board.header import HEADER_STRUCT, BoardHeader, unpack_header
from dpboard.board.names import SEGMENT_PREFIX, SHM_DIR, validate_name
from dpboard.board.segment import unlink_if_generation
from dpboard.errors import AccessDeniedError, NotFoundError
from dpboard.snapshot import HEADER_SIZE, MAGIC


@dataclass(frozen=True)
class BoardListing:
    name: str
    size: int
    header: BoardHeader | None
    error: str | None = None

    @property
    def creator_alive(self) -> bool | None:
        return None if self.header is None else self.header.creator_alive


def list_boards() -> list[BoardListing]:
    """Every ``/dev/shm/dpboard.*`` segment with its header (or why it could not be read)."""
    listings = []
    for path in sorted(SHM_DIR.glob(SEGMENT_PREFIX + "*")):
        name = path.name[len(SEGMENT_PREFIX) :]
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_SIZE)
            size = path.stat().st_size
        except OSError as e:
            listings.append(BoardListing(name, 0, None, f"cannot read: {e.strerror}"))
            continue
        if len(raw) < HEADER_STRUCT.size or raw[:8] != MAGIC:
            listings.append(BoardListing(name, size, None, "no dpboard header"))
            continue
        _, header = unpack_header(raw)
        listings.append(BoardListing(name, size, header))
    return listings


def clean_boards(name: str | None = None, *, force: bool = False) -> list[str]:
    """Unlink boards whose creator is dead (all of them, or just ``name``); ``force`` also removes a
    board whose creator is alive. A segment without a board header is removed only when named or
    with ``force``. Returns the names removed. A live board without ``force``, or a missing ``name``,
    is an error."""
    listings = list_boards()
    if name is not None:
        validate_name(name)
        listings = [entry for entry in listings if entry.name == name]
        if not listings:
            raise NotFoundError(f"board {name!r} does not exist: `dpboard ls` lists the boards here")
    removed = []
    for entry in listings:
        if entry.header is None:
            # Not a readable board (another user's, or no header: being created, or not ours at all).
            if force or name is not None:
                try:
                    posix_ipc.unlink_shared_memory("/" + SEGMENT_PREFIX + entry.name)
                except posix_ipc.ExistentialError:
                    continue
                except posix_ipc.PermissionsError:
                    raise AccessDeniedError(
                        f"cannot remove /dev/shm/{SEGMENT_PREFIX}{entry.name}: it belongs to another user"
                    ) from None
                removed.append(entry.name)
            continue
        if entry.creator_alive and not force:
            if name is not None:
                raise BoardError(
                    f"board {name!r} is in use: its creator (pid {entry.header.creator_pid}) is alive; "
                    f"stop it first, or pass --force"
                )
            continue
        # Only the incarnation that was listed: a board re-created since then under that name stays.
        if unlink_if_generation("/" + SEGMENT_PREFIX + entry.name, entry.header.generation):
            removed.append(entry.name)
    return removed
