"""Shared fixtures. Helpers that tests import live in tests/support/."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.support.names import new_board_name, session_segments
from tests.support.wheels import MARKERS_VARIABLE, run_own_session

# The engines' wheels (SGLang's, ...) sit beside the venv's site-packages, where pip does not see
# them (the Makefile's ENGINE_WHEELS): on sys.path here, and on PYTHONPATH for the processes tests start.
ENGINE_DIR = Path(sys.prefix) / "engines"
if ENGINE_DIR.is_dir() and str(ENGINE_DIR) not in sys.path:
    sys.path.append(str(ENGINE_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ENGINE_DIR)) if p)

# The processes tests start get Ctrl-C and hang-ups as from a terminal. A suite started in the
# background (`make test &` ignores SIGINT) or under nohup (SIGHUP) would hand those ignored
# dispositions down: a stopped-by-Ctrl-C test would then wait on a process that, rightly, ignores it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# tests/loads/cudasim runs only under Numba's CUDA simulator, in its own interpreter
# (tests/loads/test_cuda_sources.py starts it with NUMBA_ENABLE_CUDASIM=1, which must be set before
# numba is imported).
collect_ignore_glob = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["loads/cudasim/*"]


def pytest_configure(config: pytest.Config) -> None:
    """The engines' sessions of their own (tests/support/wheels.py) select the markers this one does:
    `make test`'s -m "not slow and not serving" leaves their slow tests out too. A pytest-xdist
    worker is started with COLUMNS=80 and LINES=24: the processes a test starts in a terminal of its
    own (tmux at 150 columns) would take those over the terminal's size."""
    os.environ[MARKERS_VARIABLE] = config.getoption("markexpr") or ""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The engines' sessions of their own (a pytest run each, minutes on a small machine) first: with
    `make test`'s workers each taking whole files, the rest of the suite then runs beside them
    instead of after them. The order of everything else stays."""
    def own_session(item: pytest.Item) -> bool:
        module = getattr(item, "module", None)
        return getattr(module, "run_own_session", None) is run_own_session

    items.sort(key=lambda item: not own_session(item))


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments():
    """The suite must leave no /dev/shm/dpboard.* (nor a sent or dispatch record) of its own behind."""
    yield
    leaked = session_segments()
    for name in leaked:  # remove them so one failure does not poison the machine
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert not leaked, f"the test suite leaked shared-memory segments: {leaked}"


@pytest.fixture
def board_name() -> str:
    """A fresh board name that the leak check covers."""
    return new_board_name()
