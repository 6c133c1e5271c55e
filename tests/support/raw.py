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
