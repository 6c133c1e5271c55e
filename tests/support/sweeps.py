"""A machine-wide ``dpboard clean`` in one test file against a board another file keeps dead on purpose.

``make test`` runs files on several xdist workers at once. A sweep (``dpboard clean`` with no name)
removes every board whose creator is gone, including one that a test elsewhere has just left dead to
look at. The two take a lock file of this user's: a sweep holds it exclusively, a test holding a dead
board shares it for as long as it needs the board in /dev/shm. Both waits are bounded."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

LOCK = Path(tempfile.gettempdir(), f"dpboard-tests-{os.getuid()}.sweep")
WAIT_S = 120.0


@contextmanager
def _held(kind: int, what: str) -> Iterator[None]:
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what}: {LOCK} stayed locked by another test for {WAIT_S:.0f} s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the flock


def sweeping() -> AbstractContextManager[None]:
    """Held around a machine-wide ``dpboard clean``: no dead board kept on purpose is in its reach."""
    return _held(fcntl.LOCK_EX, "a machine-wide dpboard clean")


def keeping_a_dead_board() -> AbstractContextManager[None]:
    """Held while a test needs a board whose creator is gone to stay in /dev/shm."""
    return _held(fcntl.LOCK_SH, "a test keeping a dead board")
