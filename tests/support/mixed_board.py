"""Boards in every slot state, for the top and serve tests (no tests of its own).

``mixed_board(name)`` creates an 8-slot board and fills it with real writers:
ranks 0-3 LIVE (a publisher process, 100 Hz), rank 4 STALE (published once, then left past
``stale_after``), rank 5 TORN (a writer SIGKILLed in the middle of a publish), ranks 6-7 EMPTY.
Run as a script, this file is those writer processes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.support.names import ROOT
from tests.support.procutil import kill, read_line

PYTHON = sys.executable
LIVE_RANKS = (0, 1, 2, 3)
STALE_RANK = 4
TORN_RANK = 5
EMPTY_RANKS = (6, 7)
N_SLOTS = 8
STALE_AFTER = 0.5
CAPACITY = 10_000


def load_of(rank: int) -> dict[str, int]:
    """The fixed load each writer publishes: every field tells the rank apart."""
    used = 1000 * (rank + 1)
    return dict(
        dp_rank=rank, num_running_reqs=rank + 1, num_waiting_reqs=2 * rank, num_used_tokens=used,
        num_total_tokens=used + 500, num_active_tokens=used + 250, max_total_num_tokens=CAPACITY,
        num_received_reqs=10 * rank + 7,
    )


def expected_imbalance() -> float:
    totals = [load_of(r)["num_total_tokens"] for r in LIVE_RANKS]
    return max(totals) / (sum(totals) / len(totals))


@dataclass
class MixedBoard:
    name: str
    publisher_pid: int


@contextlib.contextmanager
def mixed_board(name: str) -> Iterator[MixedBoard]:
    from dpboard import Board, LoadSnapshot, SlotStatus

    board = Board.create(name, n_slots=N_SLOTS)
    procs: list[subprocess.Popen] = []
    try:
        stale_writer = board.writer(STALE_RANK)
        stale_writer.publish(LoadSnapshot(**load_of(STALE_RANK)))
        stale_since = time.monotonic()
        for role, args in (("live", [",".join(map(str, LIVE_RANKS))]), ("torn", [str(TORN_RANK)])):
            procs.append(subprocess.Popen([PYTHON, "-m", "tests.support.mixed_board", role, name, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                          text=True))
        live, torn = procs
        assert read_line(live, 30).startswith("ready")
        assert read_line(torn, 30).startswith("ready")
        reader = board.reader(stale_after=STALE_AFTER)
        deadline = time.monotonic() + 10
        while reader.status(TORN_RANK) != SlotStatus.TORN:  # the pause has begun: kill it mid-write
            assert time.monotonic() < deadline, "the paused writer never made its slot odd"
            time.sleep(0.01)
        kill(torn)
        time.sleep(max(0.0, stale_since + STALE_AFTER + 0.2 - time.monotonic()))
        assert reader.status(STALE_RANK) == SlotStatus.STALE
        assert all(reader.status(r) == SlotStatus.LIVE for r in LIVE_RANKS)
        yield MixedBoard(name, live.pid)
    finally:
        for proc in procs:
            kill(proc)
        board.close()
        board.unlink()


def _live(name: str, ranks: str) -> None:
    from dpboard import Board, LoadSnapshot

    board = Board.attach(name)
    writers = [(board.writer(int(r)), LoadSnapshot(**load_of(int(r)))) for r in ranks.split(",")]
    for w, snap in writers:
        w.publish(snap)
    print("ready", os.getpid(), flush=True)
    deadline = time.monotonic() + 300  # a bound, in case the test that started it is killed
    while time.monotonic() < deadline:
        for w, snap in writers:
            w.publish(snap)
        time.sleep(0.01)


def _torn(name: str, rank: str) -> None:
    from dpboard import Board, LoadSnapshot

    board = Board.attach(name)
    w = board.writer(int(rank))
    snap = LoadSnapshot(**load_of(int(rank)))
    w.publish(snap)
    print("ready", os.getpid(), flush=True)
    w._publish_paused(snap, 60.0)


if __name__ == "__main__":
    role, board_name, arg = sys.argv[1:4]
    {"live": _live, "torn": _torn}[role](board_name, arg)
