"""Shared fixtures. Every board a test makes is named with this test run's prefix, so that the
leak check below sees exactly the segments this run created (other runs may share the machine)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

# tests/cudasim runs only under Numba's CUDA simulator, in its own interpreter (tests/test_kernels.py
# starts it with NUMBA_ENABLE_CUDASIM=1, which must be set before numba is imported).
collect_ignore_glob = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["cudasim/*"]

SESSION_PREFIX = f"t{os.getpid()}-"
_counter = itertools.count()


def _session_segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"dpboard.{SESSION_PREFIX}*"))


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments():
    """The suite must leave no /dev/shm/dpboard.* of its own behind."""
    yield
    leaked = _session_segments()
    for name in leaked:  # remove them so one failure does not poison the machine
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not leaked, f"the test suite leaked shared-memory segments: {leaked}"


@pytest.fixture
def board_name() -> str:
    """A fresh board name that the leak check covers."""
    return f"{SESSION_PREFIX}{next(_counter)}"


def new_board_name() -> str:
    """The same, for tests that need several names."""
    return f"{SESSION_PREFIX}{next(_counter)}"
