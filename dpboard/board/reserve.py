"""``reserve_pages``: every page of a new file in /dev/shm allocated when it is made.

``ftruncate`` alone (what ``posix_ipc.SharedMemory(size=...)`` does) makes a sparse file: with
/dev/shm full, the first touch of a page — the header, or a writer's row much later — kills the
process with SIGBUS instead of failing at creation with a message. Boards, sent records and
dispatch records all reserve their pages here first.
"""

from __future__ import annotations

import errno
import os

from dpboard.board.errors import BoardError
from dpboard.board.names import SHM_DIR
from dpboard.ownership import full_advice


def reserve_pages(fd: int, size: int, what: str) -> None:
    """Allocate ``size`` bytes of ``fd`` now, or raise a BoardError naming ``what`` (e.g. "board 'x'")
    and, when /dev/shm is full, its size and free room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise BoardError(f"cannot reserve the {size} bytes of {what} in {SHM_DIR}: {e.strerror}") from None
        raise BoardError(f"no room for {what} ({size} bytes) in {SHM_DIR}: {full_advice(SHM_DIR)}") from None
