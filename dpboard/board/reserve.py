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


def reserve_pages(fd: int, size: int, what: str) -> None:
    """Allocate ``size`` bytes of ``fd`` now, or raise a BoardError naming ``what`` (e.g. "board 'x'")
    and, when /dev/shm is full, its size and free room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise BoardError(f"cannot reserve the {size} bytes of {what} in {SHM_DIR}: {e.strerror}") from None
        try:
            fs = os.statvfs(SHM_DIR)
            room = (f"{SHM_DIR} is {fs.f_blocks * fs.f_frsize / 2**20:.1f} MiB with "
                    f"{fs.f_bavail * fs.f_frsize / 2**20:.1f} MiB free")
        except OSError:
            room = f"{SHM_DIR} is full"
        raise BoardError(
            f"no room for {what} ({size} bytes) in {SHM_DIR}: {room}; remove unused boards "
            f"(`dpboard clean`) or give {SHM_DIR} more room (a container's default is 64 MiB: "
            f"docker run --shm-size)") from None
