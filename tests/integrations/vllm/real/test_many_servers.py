"""16 API-server processes and 16 engines on one board: every server sees the same, exact, global
in-flight count of every engine (sum of the sent record's rows - the engine's received count).

Sixteen interpreters importing vLLM's modules at once take minutes of CPU on a small machine: the
test is ``slow`` (`make test-all`), and it waits for the servers' start-up as a whole, not per
server, with a bound that a loaded 2-core machine meets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from dpboard.board import Board
from dpboard.board.sent import SentRecord
from dpboard.snapshot import LoadSnapshot
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, wait_for

SERVERS = ENGINES = 16
START_TIMEOUT = 420  # seconds for all sixteen to be ready
pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT + 120)]


def ask(proc, command):
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()
    return json.loads(read_line(proc, timeout=60))


def test_sixteen_api_servers_see_one_global_in_flight_count(board_name):
    board = Board.create(board_name, ENGINES)
    writers = [board.writer(r) for r in range(ENGINES)]
    for r, w in enumerate(writers):
        w.publish(LoadSnapshot(dp_rank=r, max_total_num_tokens=10_000))
    received = [0] * ENGINES
    stop = threading.Event()

    def engines_publish() -> None:  # the engines' steps and idle heartbeats
        while not stop.is_set():
            for r, w in enumerate(writers):
                w.publish(LoadSnapshot(dp_rank=r, max_total_num_tokens=10_000, num_received_reqs=received[r]))
            stop.wait(0.1)

    engines = threading.Thread(target=engines_publish, daemon=True)
    engines.start()
    env = {**os.environ, "VLLM_PLUGINS": "dpboard", "DPBOARD_METHOD": "inflight_requests",
           "DPBOARD_VLLM_BOARD": board_name}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.vllm_api_server", str(i), str(SERVERS), str(ENGINES)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              cwd=ROOT, env=env)
             for i in range(SERVERS)]
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for proc in procs:
            assert json.loads(read_line(proc, timeout=max(deadline - time.monotonic(), 1.0))) == {"ready": True}
        sent = [0] * ENGINES
        for round_ in range(3):
            for i, proc in enumerate(procs):
                for rank in ask(proc, {"op": "send", "n": 1 + (i + round_) % 3})["ranks"]:
                    sent[rank] += 1
        # the engines take some of them in
        received[:] = [n // 2 for n in sent]
        reader = board.reader(stale_after=60)
        wait_for(lambda: [s.num_received_reqs for s in reader.read_all()] == received, 60,
                 "the engines' publish of their received counts")
        expected = [s - r for s, r in zip(sent, received, strict=True)]
        views = [ask(proc, {"op": "in_flight"})["in_flight"] for proc in procs]
        assert all(view == expected for view in views), (expected, views)
        assert sum(expected) > 0
        record = SentRecord.open(board_name, SERVERS, ENGINES, generation=board.generation)
        assert record.totals()[:, 0].tolist() == sent
        record.close()
        # the board balances the servers' picks between them: no engine got more than its share + 1
        # of what its peers sent while the others sat idle (each server reads the others' sends)
        assert max(sent) - min(sent) <= 2 * SERVERS // ENGINES + 1, sent
    finally:
        stop.set()
        engines.join()
        for proc in procs:
            kill(proc)
        for w in writers:
            w.close()
        board.close()
        board.unlink()
