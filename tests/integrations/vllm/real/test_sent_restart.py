"""vLLM API servers killed with SIGKILL and started again, each in a process of its own (vLLM 0.33.0's
balancing client, as in test_many_servers.py): a dead server's row of the sent record stops counting,
its requests that never arrived leave the in-flight count, those that did stay out of it, and a
restart of the deployment (same or another --api-server-count) neither inherits its counts nor is
refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from dpboard.board import Board
from dpboard.snapshot import LoadSnapshot
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, wait_until

ENGINES = 4
pytestmark = pytest.mark.timeout(600)


def ask(proc, command):
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()
    return json.loads(read_line(proc, timeout=60))


def in_flight(proc):
    return ask(proc, {"op": "in_flight"})["in_flight"]


class Engines:
    """The engines' side of the board: every slot published every 50 ms with its received count."""

    def __init__(self, board_name: str) -> None:
        self.board = Board.create(board_name, ENGINES)
        self.writers = [self.board.writer(r) for r in range(ENGINES)]
        self.received = [0] * ENGINES
        self.seen = [0] * ENGINES  # the received counts of the last publish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._publish()
        self._thread.start()

    def _publish(self) -> None:
        received = list(self.received)
        for r, w in enumerate(self.writers):
            w.publish(LoadSnapshot(dp_rank=r, max_total_num_tokens=10_000, num_received_reqs=received[r]))
        self.seen = received

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._publish()

    def take_in(self, counts) -> None:
        """The engines receive ``counts`` more requests; returns once that is published."""
        self.received = [a + b for a, b in zip(self.received, counts, strict=True)]
        target = list(self.received)
        assert wait_until(lambda: self.seen == target, 10)

    def restart(self) -> None:
        """Fresh engine cores: their received counts begin again at 0."""
        self.take_in([-n for n in self.received])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for w in self.writers:
            w.close()
        self.board.close()
        self.board.unlink()


def server(board_name: str, index: int, count: int) -> subprocess.Popen:
    env = {**os.environ, "VLLM_PLUGINS": "dpboard", "DPBOARD_METHOD": "inflight_requests",
           "DPBOARD_VLLM_BOARD": board_name}
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_api_server", str(index), str(count),
                             str(ENGINES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    line = read_line(proc, timeout=240) if proc.poll() is None else ""
    if json.loads(line or "{}") != {"ready": True}:
        proc.kill()
        raise AssertionError(f"API server {index} of {count} did not start: {proc.stderr.read()[-2000:]}")
    return proc


def sends(proc, n):
    counts = [0] * ENGINES
    for rank in ask(proc, {"op": "send", "n": n})["ranks"]:
        counts[rank] += 1
    return counts


def until(proc, expected):
    """The in-flight count ``proc`` reads, once it is ``expected`` (a dead holder is seen within 0.25 s)."""
    assert wait_until(lambda: in_flight(proc) == expected, 15, interval=0.05), (expected, in_flight(proc))


def test_a_sigkilled_api_server_leaves_no_phantom_in_flight_and_restarts_with_any_count(board_name):
    """A server killed with SIGKILL left its row: a restart with the same shape inherited its counts
    (in-flight [0, 100, 0, 0] on fresh engines, picks skewed for good), and a restart with another
    --api-server-count refused to start."""
    engines = Engines(board_name)
    procs = []
    try:
        procs = [server(board_name, i, 2) for i in range(2)]
        s0, s1 = procs
        sent1 = sends(s1, 12)
        until(s0, sent1)  # server 0 sees server 1's sends in flight
        arrived = [n // 2 for n in sent1]
        engines.take_in(arrived)  # half of them reach their engines, the rest die with server 1
        lost = [a - b for a, b in zip(sent1, arrived, strict=True)]
        until(s0, lost)
        kill(s1)
        until(s0, [0] * ENGINES)  # the lost ones left with its row
        sent0 = sends(s0, 6)
        until(s0, sent0)  # exact again: what server 1's requests that arrived counted stays out
        procs[1] = s1 = server(board_name, 1, 2)  # server 1 alone again, beside the running ones
        assert in_flight(s1) == sent0  # server 0's, exactly: nothing inherited, nothing missed
        more = sends(s1, 4)
        both = [a + b for a, b in zip(sent0, more, strict=True)]
        until(s0, both)
        until(s1, both)
        engines.take_in(both)
        until(s0, [0] * ENGINES)
        until(s1, [0] * ENGINES)
        kill(s1)
        # vLLM stops a deployment whose API server died: everything again, fresh engines, same shape
        kill(s0)
        engines.restart()
        procs = [server(board_name, i, 2) for i in range(2)]
        for proc in procs:
            assert in_flight(proc) == [0] * ENGINES  # nothing inherited from the dead rows
        sent0, sent1 = sends(procs[0], 5), sends(procs[1], 3)
        both = [a + b for a, b in zip(sent0, sent1, strict=True)]
        for proc in procs:
            until(proc, both)  # one global count, seen alike by both servers
        engines.take_in(both)
        for proc in procs:
            until(proc, [0] * ENGINES)

        # killed with SIGKILL again, restarted with another --api-server-count
        sends(procs[0], 8)
        for proc in procs:
            kill(proc)
        engines.restart()
        procs = [server(board_name, i, 3) for i in range(3)]
        for proc in procs:
            assert in_flight(proc) == [0] * ENGINES
        counts = sends(procs[2], 9)
        for proc in procs:
            until(proc, counts)
        assert max(counts) - min(counts) <= 1, counts  # the picks spread: no phantom load skews them
    finally:
        for proc in procs:
            kill(proc)
        engines.close()


def test_a_sender_killed_mid_add_never_fails_a_request(board_name):
    """A sender SIGKILLed between the two seq increments of add() left its row odd: a running API
    server failed 50 of 200 requests over one second, and restarts failed with TornReadError."""
    from tests.board.test_sent_record import _SENDER

    engines = Engines(board_name)
    procs = []
    try:
        torn = subprocess.Popen([sys.executable, "-c", _SENDER, board_name, str(engines.board.generation), "2",
                                 str(ENGINES), "1", "2", "30", "tear-kill"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        procs.append(torn)
        assert read_line(torn, timeout=60).strip() == "sent"
        torn.wait(30)
        procs.append(server(board_name, 0, 2))
        sent = [0] * ENGINES
        for _ in range(20):
            sent = [a + b for a, b in zip(sent, sends(procs[-1], 10), strict=True)]
        assert sum(sent) == 200
        until(procs[-1], sent)  # its own 200 in flight; nothing of the dead, torn row
    finally:
        for proc in procs:
            kill(proc)
        engines.close()
