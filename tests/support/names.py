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


# a board's segment and the records beside it (vLLM's sent record, the dispatchers' record)
SESSION_FILES = ("dpboard.", "dpboard-sent.", "dpboard-dispatch.")


def session_segments() -> list[str]:
    return sorted(p.name for kind in SESSION_FILES for p in Path("/dev/shm").glob(f"{kind}{SESSION_PREFIX}*"))
