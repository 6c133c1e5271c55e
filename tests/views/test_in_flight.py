"""The in-flight count (requests sent less received, per engine, over every API server) in ``dpboard
top``, ``dpboard doctor`` and ``/v1/board``: a real board whose slots publish received counts, a real
sent record with known counts in two rows (two API servers), each view a real process. Without a
sent record the views show no count and create none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dpboard import Board, LoadSnapshot
from dpboard.board.sent import SentRecord, sent_path
from tests.support.names import ROOT
from tests.support.procutil import stop
from tests.support.serving import get, start_server

pytestmark = pytest.mark.timeout(120)

SENT = {0: [6, 4], 1: [3, 2], 2: [0, 0]}  # per engine, what each of the two API servers sent
RECEIVED = [7, 5, 0]
BASE = [1, 0, 0]  # what the servers take out for good (sent before an engine restart), shared by one
IN_FLIGHT = [10 - 7 - 1, 5 - 5 - 0, 0]


def dpboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def publish(board: Board) -> None:
    for rank, received in enumerate(RECEIVED):
        board.writer(rank).publish(LoadSnapshot(rank, num_running_reqs=1, num_total_tokens=100, num_used_tokens=100,
                                                max_total_num_tokens=10_000, num_received_reqs=received))


def views(name: str) -> tuple[dict, str, dict, dict]:
    """``top --json``, ``top --once``, ``doctor --json`` and ``/v1/board`` of board ``name``."""
    top_json = dpboard("top", name, "--json", "--stale-after", "60")
    top_text = dpboard("top", name, "--once", "--stale-after", "60")
    doctor = dpboard("doctor", name, "--window", "1.5", "--json", "--stale-after", "60")
    assert top_json.returncode == 0 and top_text.returncode == 0, top_json.stderr + top_text.stderr
    assert doctor.returncode in (0, 1), doctor.stderr
    proc, url = start_server(name, "--stale-after", "60")
    try:
        status, _, body = get(f"{url}/v1/board")
    finally:
        stop(proc)
    assert status == 200, body
    return json.loads(top_json.stdout), top_text.stdout, json.loads(doctor.stdout), json.loads(body)


def test_each_view_shows_sent_less_received_per_engine(board_name):
    with Board.create(board_name, n_slots=3) as board:
        publish(board)
        record = SentRecord.open(board_name, 2, 3, generation=board.generation)
        try:
            rows = [record.row(0), record.row(1)]
            for rank, counts in SENT.items():
                for row, n in zip(rows, counts, strict=True):
                    for _ in range(n):
                        row.add(rank, 100)
            rows[0].share(np.arange(3), np.array(BASE))
            top, text, doctor, served = views(board_name)
        finally:
            record.close()
    assert [r["in_flight"] for r in top["ranks"]] == IN_FLIGHT and top["totals"]["in_flight"] == 2
    assert [r["in_flight"] for r in served["ranks"]] == IN_FLIGHT and served["totals"]["in_flight"] == 2
    lines = text.splitlines()
    heading = next(line for line in lines if "INFLIGHT" in line)
    assert "in flight 2" in text
    column = heading.index("INFLIGHT") + len("INFLIGHT")  # right-aligned under its title
    cells = [line[:column].split()[-1] for line in lines[lines.index(heading) + 1:]
             if line.strip() and not line.strip().startswith("─")][:3]
    assert cells == [str(n) for n in IN_FLIGHT], text
    assert doctor["in_flight"] == IN_FLIGHT
    # rank 0's two requests stay in flight while its received count does not move: they never arrive
    stuck = {f["id"]: f for f in doctor["findings"]}["inflight_stuck"]
    assert "rank 0 2" in stuck["evidence"] and "rank 1" not in stuck["evidence"], stuck


def test_without_a_sent_record_nothing_is_shown_and_none_is_created(board_name):
    with Board.create(board_name, n_slots=3) as board:
        publish(board)
        top, text, doctor, served = views(board_name)
        assert not os.path.lexists(sent_path(board_name))
    assert all("in_flight" not in r for r in top["ranks"] + served["ranks"])
    assert "in_flight" not in top["totals"] and "in_flight" not in served["totals"]
    assert "INFLIGHT" not in text and "in flight" not in text
    assert "in_flight" not in doctor and "inflight_stuck" not in {f["id"] for f in doctor["findings"]}


CHILD = """
import os, signal, sys
from dpboard import Board
from dpboard.board.sent import SentRecord
board = Board.attach(sys.argv[1])
record = SentRecord.open(sys.argv[1], 2, 3, generation=board.generation)
row = record.row(1)
for _ in range(5):
    row.add(0, 10)
print("sent", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_dead_senders_row_and_an_earlier_boards_record_do_not_count(board_name):
    """What a dead API server sent leaves the count (its row no longer held), as the live servers
    count it; a record of an earlier board of that name is not read at all."""
    from dpboard.views.rows import in_flight

    with Board.create(board_name, n_slots=3) as board:
        publish(board)
        record = SentRecord.open(board_name, 2, 3, generation=board.generation)
        try:
            for _ in range(9):
                record.row(0).add(0, 100)
            child = subprocess.Popen([sys.executable, "-c", CHILD, board_name], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            try:
                assert child.stdout.readline().strip() == "sent"
                assert in_flight(board_name, board.generation, RECEIVED) == [9 + 5 - 7, 0, 0]
                child.stdin.write("\n")
                child.stdin.flush()
                assert child.wait(20) == -9
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            assert in_flight(board_name, board.generation, RECEIVED) == [9 - 7, 0, 0]
            assert in_flight(board_name, board.generation + 1, RECEIVED) is None
        finally:
            record.close()
    assert not os.path.lexists(sent_path(board_name))
