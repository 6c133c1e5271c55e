"""`dpboard top --wait` on a board of another user says so once and exits at once (issue 28, item 14).

It used to print "cannot be read", wait out ``--wait-timeout``, then say the board "was not created
within 3 s", which it was, by someone else. Real processes: the board is made by a child running as
uid 65534, and `dpboard top` is the real command line, run as root (which does not trust uid 65534).
"""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import pytest

from dpboard import Board
from tests.support.names import ROOT
from tests.support.other_user import as_nobody, need_root
from tests.support.procutil import kill

pytestmark = pytest.mark.timeout(120)

OWNER = "belongs to uid 65534"


def create_as_nobody(name: str) -> None:
    """A real board (Board.create, mode 0600) of uid 65534, left behind when that child exits."""
    def make() -> int:
        board = Board.create(name, n_slots=2)
        return board.n_slots

    assert as_nobody(make) == 2


def top(name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dpboard.cli", "top", name, "--wait", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.mark.parametrize("mode", [["--once"], ["--json"], ["--iterations", "2"]])
def test_top_wait_on_a_board_of_another_user_says_so_once(board_name, mode):
    need_root()
    create_as_nobody(board_name)
    try:
        proc = top(board_name, "--wait-timeout", "30", *mode)
        try:
            out, err = proc.communicate(timeout=25)  # well inside --wait-timeout: it did not wait it out
        finally:
            kill(proc)
        assert proc.returncode == 2, (proc.returncode, out, err)
        assert err.count(OWNER) == 1, err
        assert "not created" not in err and "cannot be read" not in err
        assert len(err.strip().splitlines()) == 1, err
    finally:
        Path("/dev/shm", f"dpboard.{board_name}").unlink()


def test_top_waiting_for_a_board_another_user_then_creates_stops_at_once(board_name):
    need_root()
    proc = top(board_name, "--once", "--wait-timeout", "60")
    try:
        # Once top has said it waits, the board appears: another user's.
        assert select.select([proc.stderr], [], [], 30)[0], "top said nothing within 30 s"
        line = proc.stderr.readline()
        assert "does not exist" in line, line
        create_as_nobody(board_name)
        out, err = proc.communicate(timeout=40)  # inside the 60 s it would otherwise wait
        assert proc.returncode == 2, (proc.returncode, out, err)
        assert err.count(OWNER) == 1 and "not created" not in err, err
    finally:
        kill(proc)
        Path("/dev/shm", f"dpboard.{board_name}").unlink(missing_ok=True)
