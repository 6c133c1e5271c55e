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



_SENDER = """
import os, sys, time
from dpboard.board.sent import SentRecord
record = SentRecord.open(sys.argv[1], 1, 2, generation=int(sys.argv[2]))
record.row(0).add(1, 5)
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""

_DISPATCHER = """
import os, sys, time
from dpboard.board.dispatch_record import DispatchRecord
record = DispatchRecord.open(sys.argv[1], 1, 2)
record.row(0, method="total_tokens").publish(1, 4, 0, 0, 0, 0, [2, 2])
print("ready", os.getpid(), flush=True)
time.sleep(60)
"""


def test_a_sent_row_held_from_another_time_namespace_counts(board_name):
    from dpboard.board.sent import SentRecord

    with Board.create(board_name, 2) as board:
        proc, pid = start_in_time_namespace(_SENDER, board_name, str(board.generation))
        record = SentRecord.open(board_name, 1, 2, generation=board.generation)
        try:
            ((holder, ticks, alive),) = record.holders()
            assert holder == pid and alive
            _ticks_differ(pid, ticks)
            assert record.totals().tolist() == [[0, 0], [1, 5]]
            with pytest.raises(BoardError, match=f"row 0 of the sent record of board {board_name!r} is held by live "
                                                 f"process {pid}"):
                record.row(0)
        finally:
            kill_in_time_namespace(proc, pid)
        record.close()  # the last one out: removes it


def test_a_dispatcher_in_another_time_namespace_reads_as_running(board_name):
    from dpboard.board.dispatch_record import read_dispatch_record, remove_if_abandoned

    proc, pid = start_in_time_namespace(_DISPATCHER, board_name)
    try:
        (row,) = read_dispatch_record(board_name)
        assert (row.pid, row.alive, row.per_rank) == (pid, True, [2, 2])
        assert not remove_if_abandoned(board_name)  # held: not taken for a dead dispatcher's
    finally:
        kill_in_time_namespace(proc, pid)
    assert remove_if_abandoned(board_name)
