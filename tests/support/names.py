"""Board names for tests: every board a test makes carries this run's prefix, so that the session's
leak check (conftest.py) sees exactly the segments this run created, even when other runs share
the machine."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

SESSION_PREFIX = f"t{os.getpid()}-"
ROOT = Path(__file__).resolve().parents[2]  # the repository
_counter = itertools.count()


def new_board_name() -> str:
    """A fresh board name that the leak check covers."""
    return f"{SESSION_PREFIX}{next(_counter)}"


def session_segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"dpboard.{SESSION_PREFIX}*"))
