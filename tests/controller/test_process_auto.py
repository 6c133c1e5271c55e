"""``dpboard controller --method auto`` follows the board as it is: a real controller process started
before any scheduler publishes, then real board writers publishing (and withdrawing) lockstep
sections, real PULL sockets taking what it sends."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from dpboard import Board, LoadSnapshot
from dpboard.board.dispatch_record import read_dispatch_record
from dpboard.controller.codec import encode_request
from dpboard.snapshot import LoadDetail, LockstepDetail
from tests.support.names import ROOT
from tests.support.procutil import kill, stop, wait_for
from tests.support.sockets import bound_pull, connected_push

N = 2
QUEUED = [100_000, 0]  # prompt tokens queued on each rank: rank 0's first token is ~196 group steps away


class Lines:
    """The controller's stderr, line by line, read by a thread (the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(line)

    def count(self, words: str) -> int:
        return sum(words in line for line in list(self.lines))

    def text(self) -> str:
        return "".join(self.lines)


class Schedulers:
    """Two ranks' board writers, publishing every 20 ms with their lockstep section while
    ``lockstep`` is set, and the PULL sockets the controller sends to (what each took, counted
    into its slot's num_received_reqs)."""

    def __init__(self, board: Board, ctx: zmq.Context, endpoints: list[str], queued: list[int] = QUEUED) -> None:
        self.queued = queued
        self.writers = [board.writer(r) for r in range(N)]
        self.pulls = [bound_pull(ctx, ep) for ep in endpoints]
        self.got: list[list[str]] = [[] for _ in range(N)]
        self.lockstep = True
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._publish, daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for rank, writer in enumerate(self.writers):
                    lockstep = LockstepDetail(group_size=N, chunk_tokens=512) if self.lockstep else None
                    writer.publish_detailed(
                        LoadSnapshot(rank, num_running_reqs=4, num_total_tokens=1000, num_used_tokens=1000,
                                     max_total_num_tokens=10**6, num_received_reqs=len(self.got[rank])),
                        LoadDetail(num_waiting_uncached_tokens=self.queued[rank], lockstep=lockstep))
            time.sleep(0.02)

    def _collect(self) -> list[tuple[str, int]]:
        """(rid, rank) of every request waiting at the PULL sockets now, counted as taken."""
        got = []
        for rank, pull in enumerate(self.pulls):
            while pull.poll(0):
                rid = msgpack.unpackb(pull.recv(), raw=False)["rid"]
                with self._lock:
                    self.got[rank].append(rid)
                got.append((rid, rank))
        return got

    def drain(self, seconds: float) -> list[int]:
        """The ranks of what the schedulers take within ``seconds`` (possibly nothing)."""
        ranks = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ranks += [rank for _, rank in self._collect()]
            time.sleep(0.005)
        return ranks

    def take(self, count: int, timeout: float = 20) -> list[int]:
        """The ranks of the next ``count`` requests the schedulers take, in rid order."""
        picks: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while len(picks) < count and time.monotonic() < deadline:
            picks.update(self._collect())
            time.sleep(0.005)
        assert len(picks) == count, f"the schedulers took {len(picks)} of {count} requests"
        return [picks[rid] for rid in sorted(picks)]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def start_controller(board_name: str, endpoints: list[str], in_ep: str, *options: str
                     ) -> tuple[subprocess.Popen, Lines]:
    """A real ``dpboard controller`` over the board, once it has said its method (killed if it never does)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpboard.cli", "controller", "--input", in_ep, "--workers", *endpoints,
         "--board", board_name, "--stale-after", "60", "--log-every", "60", *options],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # stdout: --stats-json
    lines = Lines(proc)
    try:
        wait_for(lambda: lines.count("controller: method") or proc.poll() is not None, 60, "the controller's start")
        assert proc.poll() is None, lines.text()
    except BaseException:
        kill(proc)
        raise
    return proc, lines


@pytest.mark.timeout(120)
def test_auto_follows_the_lockstep_sections_as_they_appear_and_go(board_name, tmp_path):
    endpoints = [f"ipc://{tmp_path}/w{r}" for r in range(N)]
    in_ep = f"ipc://{tmp_path}/in"
    ctx = zmq.Context()
    with Board.create(board_name, n_slots=N) as board:
        schedulers = Schedulers(board, ctx, endpoints)
        proc = None
        try:
            # the usual order: the controller first, over a board nobody has published to yet
            proc, lines = start_controller(board_name, endpoints, in_ep, "--method", "auto")
            assert lines.count("controller: method round_robin") == 1, lines.text()
            push = connected_push(ctx, in_ep)

            schedulers.start()  # the schedulers publish, with their lockstep sections
            wait_for(lambda: lines.count("auto: method inflight_lockstep"), 15,
                     "the controller to name auto's change to inflight_lockstep")
            for i in range(6):
                push.send(encode_request(f"a{i}", num_tokens=100))
            # inflight_lockstep: rank 0's first token is far beyond the horizon, rank 1's within it
            assert schedulers.take(6) == [1] * 6
            (row,) = read_dispatch_record(board_name)
            assert row.method == "inflight_lockstep"  # what dpboard doctor reads

            schedulers.lockstep = False  # the sections go (the ranks restarted without DP attention)
            wait_for(lambda: lines.count("auto: method round_robin, was inflight_lockstep"), 15,
                     "the controller to name auto's change back to round_robin")
            for i in range(4):
                push.send(encode_request(f"b{i}", num_tokens=100))
            assert sorted(schedulers.take(4)) == [0, 0, 1, 1]  # round robin, whatever the loads
            (row,) = read_dispatch_record(board_name)
            assert row.method == "round_robin"

            stop(proc)
            assert proc.returncode == 0, lines.text()
            # each change logged once
            assert lines.count("auto: method inflight_lockstep") == 1, lines.text()
            assert lines.count("auto: method round_robin, was") == 1, lines.text()
        finally:
            if proc is not None:
                kill(proc)
            schedulers.close()
            ctx.destroy(linger=0)
