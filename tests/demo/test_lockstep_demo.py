"""The demo's DP-attention stepping with a real ZMQ controller: real demo schedulers step together
(each waits for the group on the board), publish their lockstep section, the controller's ``auto``
reads it and picks ``inflight_lockstep``, and its picks pack a burst of short prompts onto the rank
whose prefill stalls the fewest running decodes, where ``inflight_ttft`` sends the same burst to
the rank with the fewest KV tokens."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from dpboard import Board
from dpboard.demo.scheduler import SchedulerModel
from dpboard.snapshot import DETAILED_DTYPE, LockstepDetail, SlotStatus, unpack_detail
from tests.support.procutil import kill, wait_for, wait_until

pytestmark = pytest.mark.timeout(240)
RANKS = 3
CHUNK = 8192 // RANKS  # the schedulers' default under --dp-attention: SGLang's rule
# decodes each rank holds before the burst, (requests, prompt tokens each): rank 1 runs the fewest,
# with long contexts (the most KV tokens); rank 2 the fewest tokens
HELD = {0: (40, 64), 1: (4, 6000), 2: (24, 64)}


class Cluster:
    """A board, RANKS lockstep demo schedulers and a controller, in a work folder."""

    def __init__(self, board_name: str, workdir: Path, method: str) -> None:
        self.board = Board.create(board_name, n_slots=RANKS)
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        results = f"ipc://{workdir}/results"
        self.results.bind(results)
        self.procs: list[subprocess.Popen] = []
        ranks = [f"ipc://{workdir}/rank{r}" for r in range(RANKS)]
        for r in range(RANKS):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dpboard.demo.scheduler", "--board", board_name, "--rank", str(r),
                 "--requests", ranks[r], "--results", results, "--dp-attention", "--step-ms", "10"],
                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        self.reader = self.board.reader()
        wait_for(lambda: (self.reader.read_array()["status"] == int(SlotStatus.LIVE)).all(), 120,
                 "every lockstep scheduler's first publish")
        self.input = f"ipc://{workdir}/in"
        self.controller = subprocess.Popen(
            [sys.executable, "-m", "dpboard.cli", "controller", "--input", self.input, "--workers", *ranks,
             "--method", method, "--board", board_name, "--duration", "200", "--log-every", "3600"],
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.procs.append(self.controller)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(self.input)

    def method_line(self) -> str:
        """The controller's start-up line that names its method."""
        lines: list[str] = []

        def seen() -> bool:
            line = self.controller.stderr.readline()
            lines.append(line)
            return "controller: method" in line or self.controller.poll() is not None

        wait_for(seen, 60, "the controller's method line")
        return lines[-1]

    def received(self) -> np.ndarray:
        return self.reader.read_array()["num_received_reqs"].copy()

    def running(self) -> np.ndarray:
        return self.reader.read_array()["num_running_reqs"].copy()

    def send(self, rid: str, prompt: int, output: int, rank: int | None = None) -> None:
        frame = {"rid": rid, "num_tokens": prompt, "output_len": output, "sent_ns": time.time_ns()}
        if rank is not None:
            frame["routed_dp_rank"] = rank
        self.push.send(msgpack.packb(frame))

    def close(self) -> None:
        for proc in self.procs:
            kill(proc)
        self.push.close(0)
        self.results.close(0)
        self.ctx.term()
        self.board.__exit__(None, None, None)  # the creator unlinks the board (and the controller's record)


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="dpboard-lockstep-") as d:
        yield Path(d)


def burst_of_short_prompts(cluster: Cluster) -> np.ndarray:
    """Pin HELD long decodes to each rank, wait until they run, then send eight 100-token prompts
    at once; returns how many of the eight each rank received."""
    for rank, (n, prompt) in HELD.items():
        for i in range(n):
            cluster.send(f"held-{rank}-{i}", prompt, 100_000, rank=rank)
    wait_for(lambda: (cluster.running() == [HELD[r][0] for r in range(RANKS)]).all(), 60,
             f"the held decodes running ({HELD})")
    time.sleep(0.05)  # past the controller's 20 ms refresh: its budget has seen them running
    before = cluster.received()
    for i in range(8):
        cluster.send(f"short-{i}", 100, 4)
    wait_for(lambda: cluster.received().sum() - before.sum() == 8, 60, "the burst's eight requests received")
    return cluster.received() - before


def test_lockstep_schedulers_step_together_and_auto_packs_a_burst_where_it_stalls_fewest(board_name, workdir):
    cluster = Cluster(board_name, workdir, "auto")
    try:
        # the board says they step in lockstep: auto resolves to inflight_lockstep
        assert "method inflight_lockstep" in cluster.method_line()
        detailed = cluster.reader.read_detailed_array(np.zeros(RANKS, DETAILED_DTYPE))
        for rank in range(RANKS):
            assert unpack_detail(detailed["detail"][rank]).lockstep == LockstepDetail(group_size=RANKS, chunk_tokens=CHUNK)
        # stepping together: a rank that came up first (its Numba code loaded sooner) waited for the
        # others, at most a bounded while; once they have caught up, no rank is ever more than one
        # step ahead of another
        def spread() -> int:
            seqs = cluster.reader.read_array()["publish_seq"]
            return int(seqs.max() - seqs.min())

        wait_for(lambda: spread() <= 1, 60, "the lockstep group to catch up")
        spreads = []
        for _ in range(200):
            spreads.append(spread())
            time.sleep(0.002)
        assert max(spreads) <= 1, spreads
        # all eight 100-token prompts fit one chunk on rank 1, which stalls 4 decodes; anywhere else a
        # prefill step would stall 24 or 40 (rank 1 holds the most KV tokens: inflight_ttft avoids it)
        assert burst_of_short_prompts(cluster).tolist() == [0, 8, 0]
    finally:
        cluster.close()


def test_inflight_ttft_sends_the_same_burst_to_the_fewest_tokens(board_name, workdir):
    cluster = Cluster(board_name, workdir, "inflight_ttft")
    try:
        assert "method inflight_ttft" in cluster.method_line()
        got = burst_of_short_prompts(cluster)
        # equal queues go to the fewest KV tokens, rank 2, whatever the decodes a prefill stalls there
        assert got.sum() == 8 and got[2] > 0 and got[1] < 8, got
    finally:
        cluster.close()


def test_a_lockstep_rank_prefills_or_decodes_never_both():
    model = SchedulerModel(num_pages=1024, page_size=16, dp_attention=True, chunk=256)
    model.receive({"rid": "a", "num_tokens": 64, "output_len": 5}, 0.0)
    assert model.step(0.0) == [] and model.num_running == 1  # a's prefill step
    model.step(0.0)
    assert int(model.req_seqlen[model.rid.index("a")]) == 65  # a's first decode
    # a 600-token prompt takes ceil(600 / 256) = 3 steps, in which a gets no token
    model.receive({"rid": "b", "num_tokens": 600, "output_len": 5}, 0.0)
    for _ in range(3):
        model.step(0.0)
        assert int(model.req_seqlen[model.rid.index("a")]) == 65
    model.step(0.0)
    assert int(model.req_seqlen[model.rid.index("a")]) == 66
    # without DP attention the same rank admits and decodes in one step
    plain = SchedulerModel(num_pages=1024, page_size=16)
    plain.receive({"rid": "a", "num_tokens": 64, "output_len": 5}, 0.0)
    plain.step(0.0)
    assert int(plain.req_seqlen[plain.rid.index("a")]) == 65


def test_the_group_barrier_waits_for_every_rank(board_name):
    from dpboard.demo.scheduler import GroupBarrier
    from dpboard.snapshot import LoadSnapshot

    with Board.create(board_name, n_slots=2) as board:
        w0, w1 = board.writer(0), board.writer(1)
        w0.publish(LoadSnapshot(dp_rank=0))
        w1.publish(LoadSnapshot(dp_rank=1))
        barrier = GroupBarrier(board, 0, 2, timeout=0.2)
        assert barrier.wait(lambda: True)  # both published once
        w0.publish(LoadSnapshot(dp_rank=0))  # rank 0 ran a step, rank 1 did not
        t0 = time.monotonic()
        assert not barrier.wait(lambda: True) and time.monotonic() - t0 >= 0.2 and barrier.late == 1
        assert not barrier.wait(lambda: False)  # told to stop: at once
        w1.publish(LoadSnapshot(dp_rank=1))
        assert wait_until(lambda: barrier.wait(lambda: True), 5)


def test_dpboard_demo_with_dp_attention_runs_the_lockstep_method_and_cleans_up(board_name):
    proc = subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "demo", "--dp-attention", "--method", "auto", "--duration", "3",
         "--ranks", "3", "--board", board_name, "--print-every", "1"],
        capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "method auto (inflight_lockstep)" in proc.stdout
    served = int(proc.stdout.split("served ", 1)[1].split()[0])
    assert served > 0 and "Traceback" not in proc.stderr
    assert not Path(f"/dev/shm/dpboard.{board_name}").exists()
