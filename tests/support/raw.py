"""Raw access to a board's bytes, for tests that damage a board on purpose (the library offers none)."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

from dpboard.board import segment_path


@contextlib.contextmanager
def raw_segment(name: str) -> Iterator[mmap.mmap]:
    """The board's whole segment, mapped read-write."""
    fd = os.open(segment_path(name), os.O_RDWR)
    try:
        with mmap.mmap(fd, os.fstat(fd).st_size) as mm:
            yield mm
    finally:
        os.close(fd)


def plant_board(name: str, n_slots: int, *, size: int | None = None, creator_pid: int = 2**22 - 1) -> None:
    """What any local user can leave in /dev/shm: ``dpboard.<name>`` with a whole, valid-looking header
    claiming ``n_slots`` slots over a sparse file of ``size`` bytes (default: what that many slots
    take). Its creator pid names no process."""
    from dpboard.board.header import BoardHeader, pack_header
    from dpboard.snapshot import HEADER_SIZE, LAYOUT_VERSION, SLOT_SIZE, segment_size

    header = BoardHeader(name=name, layout_version=LAYOUT_VERSION, header_size=HEADER_SIZE, n_slots=n_slots,
                         slot_size=SLOT_SIZE, creator_pid=creator_pid, creation_time_ns=1, generation=3,
                         node_id=0, creator_start_ticks=1)
    fd = os.open(segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, segment_size(n_slots) if size is None else size)  # sparse: no page is touched
        with mmap.mmap(fd, HEADER_SIZE) as mm:
            pack_header(mm, header)
    finally:
        os.close(fd)
