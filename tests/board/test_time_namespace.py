"""Liveness that does not rest on start ticks alone: a process in a time namespace of its own
(``unshare --time --boottime``) shows another start time in /proc/PID/stat to everyone else, so its
owner word reads as a dead process's from here. The lock it holds (an OFD lock on its slot, its
board's header, its record's row) is the second proof: its slot is not granted to a second writer,
and ``dpboard clean NAME`` leaves its board alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpboard.board import Board, BoardError
from dpboard.board.liveness import process_start_ticks
from dpboard.snapshot import LoadSnapshot
from tests.support.names import ROOT
from tests.support.time_namespace import kill_in_time_namespace, start_in_time_namespace

pytestmark = pytest.mark.timeout(120)

_WRITER = """
import os, sys, time
from dpboard.board import Board
from dpboard.snapshot import LoadSnapshot
board = Board.attach(sys.argv[1])
writer = board.writer(0)
writer.publish(LoadSnapshot(0, num_running_reqs=1))
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""

_CREATOR = """
import os, sys, time
from dpboard.board import Board
board = Board.create(sys.argv[1], 2)
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""


def _ticks_differ(pid: int, word_ticks: int) -> None:
    """The condition under test: from here, the process's start ticks are not the ones it wrote."""
    assert word_ticks and process_start_ticks(pid) != word_ticks


def test_a_slot_held_from_another_time_namespace_is_not_granted_to_a_second_writer(board_name):
    with Board.create(board_name, 2) as board:
        proc, pid = start_in_time_namespace(_WRITER, board_name)
        try:
            holder, ticks = board.owner(0)
            assert holder == pid
            _ticks_differ(pid, ticks)
            with pytest.raises(BoardError, match=f"slot 0 of board {board_name!r} is held by the writer in live "
                                                 f"process {pid}"):
                board.writer(0)
            assert board.owner(0) == (pid, ticks)  # the owner word untouched
            board.writer(1).publish(LoadSnapshot(1))  # the other slot is free as ever
        finally:
            kill_in_time_namespace(proc, pid)
        # its lock died with it: the slot is taken over now
        board.writer(0).publish(LoadSnapshot(0))


def _clean(name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", "clean", name], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_clean_leaves_the_live_board_of_a_creator_in_another_time_namespace(board_name):
    proc, pid = start_in_time_namespace(_CREATOR, board_name)
    path = Path(f"/dev/shm/dpboard.{board_name}")
    try:
        board = Board.attach(board_name)
        assert board.header.creator_pid == pid
        _ticks_differ(pid, board.header.creator_start_ticks)
        board.close()
        res = _clean(board_name)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "is in use: a live process holds its lock" in res.stderr
        assert path.exists()
    finally:
        kill_in_time_namespace(proc, pid)
    res = _clean(board_name)  # its creator is gone, and its lock with it
    assert res.returncode == 0, res.stderr
    assert not path.exists()

