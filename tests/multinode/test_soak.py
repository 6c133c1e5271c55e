"""A soak: the whole multi-node deployment from the CLI for about two minutes, checked throughout.

node0 has two demo schedulers (ranks 0-1) behind `dpboard controller`, fed by the demo's load
generator, a `dpboard collect` and `dpboard serve`. Nodes 1 and 2 each have a local board, written
by writer processes (ranks 2-3 and 4-5), and a `dpboard relay` to node0. `dpboard relay` once quit
after 5 s, which no shorter test saw; this one runs every long-running command far past its
internal timeouts (the relay's 5 s inner run, the collector's 5 s status line, the controller's
2 s connect wait and its count logs, serve's poll interval).

Checked all along: every process stays alive; every rank, node0's and the relayed ones, reads LIVE
on node0 at every sample (every 0.5 s); serve answers. At the end: every request the generator sent
was received by a scheduler and counted by the controller; no process's RSS or fd count grew beyond
the bounds below between an early sample and the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from dpboard import Board, SlotStatus
from dpboard.demo.load import LoadGenerator, LoadShape
from tests.support.names import ROOT, new_board_name
from tests.support.procutil import stop, wait_for

CLI = [sys.executable, "-m", "dpboard.cli"]
SOAK_SECONDS = 100.0  # the checked window, after every process is up
EARLY_SAMPLE = 10.0  # seconds into the window: the baseline for growth (imports and warm-up are done)
SAMPLE_EVERY = 0.5
NODE0_RANKS = (0, 1)
REMOTE_RANKS = {1: (2, 3), 2: (4, 5)}  # node id -> the ranks its writers publish
N_SLOTS = 6
RATE = 20.0  # requests per second between the generator's bursts
# Growth allowed between the early sample and the end, per process: a leak of one fd per request,
# per frame or per HTTP request, or of a few hundred bytes per frame, goes far past these.
RSS_GROWTH_BYTES = 8 * 2**20
RSS_GROWTH_SHARE = 0.10
FD_GROWTH = 4
STALE_AFTER = 2.0  # the samples' threshold: a loaded 2-core machine may pause a writer for a second
ALL_RANKS = (*NODE0_RANKS, *(r for ranks in REMOTE_RANKS.values() for r in ranks))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Deployment:
    """The processes, each logging to its own files under ``logs``; all stopped by ``close()``."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.logs / f"{name}.out", "w")  # noqa: SIM115 - the child keeps it
        err = open(self.logs / f"{name}.err", "w")  # noqa: SIM115
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT,
                                    env={**os.environ, "NUMBA_NUM_THREADS": "1"})
        finally:
            out.close()
            err.close()
        self.procs[name] = proc
        return proc

    def output(self, name: str, stream: str = "out") -> str:
        return (self.logs / f"{name}.{stream}").read_text()

    def wait_output(self, name: str, pattern: str, timeout: float, stream: str = "out") -> re.Match:
        found: list[re.Match] = []

        def seen() -> bool:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}): {self.output(name, 'err')[-2000:]}")
            m = re.search(pattern, self.output(name, stream))
            if m:
                found.append(m)
            return bool(m)

        wait_for(seen, timeout, f"{name} to print {pattern!r}")
        return found[0]

    def dead(self) -> dict[str, int]:
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)


def sample_resources(procs: dict[str, subprocess.Popen]) -> dict[str, tuple[int, int]]:
    return {name: (rss_bytes(p.pid), fd_count(p.pid)) for name, p in procs.items()}


def statuses(reader) -> dict[int, SlotStatus]:
    """What node0 reads of every rank, its own and the relayed ones."""
    return {r: reader.status(r) for r in ALL_RANKS}


def start_node0(d: Deployment, name0: str, tmp_path: Path, results_ep: str) -> tuple[str, list[str]]:
    """The collector, then the demo schedulers: (the collector's endpoint, the schedulers')."""
    d.start("collect", [*CLI, "collect", "--board", name0, "--bind", "tcp://127.0.0.1:*",
                        "--local-ranks", *map(str, NODE0_RANKS)])
    endpoint = d.wait_output("collect", r" owns (tcp://\S+)", 60).group(1)
    sched_eps = [f"ipc://{tmp_path}/sched-{r}" for r in NODE0_RANKS]
    for r, ep in zip(NODE0_RANKS, sched_eps, strict=True):
        d.start(f"scheduler-{r}", [sys.executable, "-m", "dpboard.demo.scheduler", "--board", name0,
                                   "--rank", str(r), "--requests", ep, "--results", results_ep])
    return endpoint, sched_eps


def start_other_nodes(d: Deployment, names: dict[int, str], endpoint: str, name0: str) -> None:
    """Writers into each other node's own board, and a relay each to node0."""
    writer_seconds = SOAK_SECONDS + 120  # they outlast the soak, and end by themselves if it is killed
    for k, ranks in REMOTE_RANKS.items():
        for r in ranks:
            d.start(f"writer-{r}", [sys.executable, "tests/support/board_procs.py", "paced_writer", names[k],
                                    str(r), "0.02", str(writer_seconds)])
        d.start(f"relay-{k}", [*CLI, "relay", "--board", names[k], "--to", endpoint, "--node-id", str(k),
                               "--remote-board", name0, "--tick-ms", "5"])


def start_controller_and_serve(d: Deployment, name0: str, sched_eps: list[str], in_ep: str) -> str:
    """The controller on ``in_ep`` in front of the schedulers, and serve: serve's URL."""
    d.start("controller", [*CLI, "controller", "--input", in_ep, "--workers", *sched_eps,
                           *["-"] * (N_SLOTS - len(NODE0_RANKS)), "--method", "inflight_tokens",
                           "--board", name0, "--stats-json", "--log-every", "5",
                           "--duration", str(SOAK_SECONDS + 120)])
    d.wait_output("controller", r"controller: method", 60, stream="err")
    d.start("serve", [*CLI, "serve", name0, "--port", "0", "--stale-after", str(STALE_AFTER)])
    return d.wait_output("serve", r" on (http://\S+)", 60).group(1)


@dataclass
class SoakRun:
    """What the checked window saw: resources early and at the end, and how often each check ran."""

    early: dict[str, tuple[int, int]]
    late: dict[str, tuple[int, int]]
    samples: int
    served: int
    completions: int


def soak(d: Deployment, reader, url: str, results: zmq.Socket) -> SoakRun:
    """SOAK_SECONDS of samples: every process alive and every rank LIVE at each, serve answering
    every 5 s, the schedulers' completions drained."""
    started = time.monotonic()
    early: dict[str, tuple[int, int]] | None = None
    samples = served = completions = 0
    next_http = started
    while (now := time.monotonic()) - started < SOAK_SECONDS:
        assert not d.dead(), f"{d.dead()} exited {now - started:.1f} s into the soak"
        st = statuses(reader)
        assert set(st.values()) == {SlotStatus.LIVE}, f"{now - started:.1f} s in, node0 reads {st}"
        samples += 1
        if now >= next_http:
            next_http = now + 5.0
            with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:
                assert resp.status == 200
            with urllib.request.urlopen(f"{url}/v1/loads", timeout=10) as resp:
                loads = json.loads(resp.read())
            assert resp.status == 200 and loads
            served += 1
        if early is None and now - started >= EARLY_SAMPLE:
            early = sample_resources(d.procs)
        while True:  # the schedulers' completions: drained, as the demo does
            try:
                results.recv(zmq.NOBLOCK)
                completions += 1
            except zmq.Again:
                break
        time.sleep(SAMPLE_EVERY)
    assert early is not None
    return SoakRun(early, sample_resources(d.procs), samples, served, completions)


def check_every_request_counted(d: Deployment, generator: LoadGenerator, reader) -> int:
    """Every request the generator sent was received by a scheduler, and dispatched by the controller,
    which then exits cleanly; the number sent."""
    # The generator closes its socket without lingering, so it is made quiet first: nothing it sent
    # is still queued when it closes.
    generator.shape = LoadShape(rate=1e-9)
    time.sleep(1.0)
    generator.stop()
    generator.join(10)
    sent = generator.sent
    assert sent >= RATE * SOAK_SECONDS * 0.5, sent

    def received() -> int:
        return sum(reader.read(r).num_received_reqs for r in NODE0_RANKS)

    wait_for(lambda: received() >= sent, 30, f"the schedulers to receive all {sent} requests")
    assert received() == sent
    stop(d.procs["controller"])
    assert d.procs["controller"].returncode == 0, d.output("controller", "err")[-2000:]
    stats = json.loads(d.output("controller").strip().splitlines()[-1])
    assert stats["received"] == stats["dispatched"] == sent, stats
    assert stats["malformed"] == stats["rejected"] == 0, stats
    return sent


def check_nothing_grew(run: SoakRun) -> None:
    grew = {}
    for name, (rss0, fds0) in run.early.items():
        rss1, fds1 = run.late[name]
        if rss1 - rss0 > RSS_GROWTH_BYTES + RSS_GROWTH_SHARE * rss0 or fds1 - fds0 > FD_GROWTH:
            grew[name] = {"rss_mib": (round(rss0 / 2**20, 1), round(rss1 / 2**20, 1)), "fds": (fds0, fds1)}
    assert not grew, f"grew between {EARLY_SAMPLE:g} s and {SOAK_SECONDS:g} s: {grew}"


def check_clean_exits(d: Deployment) -> None:
    """The collector, serve and the relays exit cleanly, their status lines having kept coming."""
    for name in ("collect", "serve", "relay-1", "relay-2"):
        proc = d.procs[name]
        stop(proc)
        assert proc.returncode == 0, (name, d.output(name, "err")[-2000:])
        assert "Traceback" not in d.output(name, "err")
    # their status lines (every 5 s) kept coming: the loops ran the whole time, not just the processes
    periods = int(SOAK_SECONDS / 5.0 * 0.8)
    assert d.output("collect").count(" ok, ") >= periods, d.output("collect")[-2000:]
    for k in REMOTE_RANKS:
        assert d.output(f"relay-{k}").count(" dropped; snapshots ") >= periods, d.output(f"relay-{k}")[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_deployment_holds_for_minutes(tmp_path):
    name0 = new_board_name()
    names = {k: new_board_name() for k in REMOTE_RANKS}
    board0 = Board.create(name0, n_slots=N_SLOTS)
    boards = {k: Board.create(names[k], n_slots=N_SLOTS, node_id=k) for k in REMOTE_RANKS}
    d = Deployment(tmp_path)
    ctx = zmq.Context()
    generator: LoadGenerator | None = None
    try:
        results = ctx.socket(zmq.PULL)
        results.setsockopt(zmq.LINGER, 0)
        results_ep = f"ipc://{tmp_path}/results"
        results.bind(results_ep)
        endpoint, sched_eps = start_node0(d, name0, tmp_path, results_ep)
        start_other_nodes(d, names, endpoint, name0)
        reader = board0.reader(stale_after=STALE_AFTER)

        def all_live() -> bool:
            assert not d.dead(), f"{d.dead()} exited while the deployment started"
            return set(statuses(reader).values()) == {SlotStatus.LIVE}

        # demo schedulers compile or load their kernels first: a minute on a cold, loaded machine
        wait_for(all_live, 120, "every rank LIVE on node0")
        in_ep = f"ipc://{tmp_path}/in"
        url = start_controller_and_serve(d, name0, sched_eps, in_ep)
        generator = LoadGenerator(in_ep, LoadShape(rate=RATE, burst_every=10.0), seed=7, context=ctx)
        generator.start()

        run = soak(d, reader, url, results)
        assert run.samples >= SOAK_SECONDS / SAMPLE_EVERY * 0.5, run.samples  # sampled throughout
        assert run.served >= SOAK_SECONDS / 5.0 * 0.5 and run.completions > 0
        sent = check_every_request_counted(d, generator, reader)
        check_nothing_grew(run)
        early, late = run.early, run.late
        print(json.dumps({"sent": sent, "samples": run.samples, "served": run.served,
                          "completions": run.completions,
                          "rss_mib_fds": {n: [round(early[n][0] / 2**20, 1), round(late[n][0] / 2**20, 1),
                                              early[n][1], late[n][1]] for n in early}}))
        check_clean_exits(d)
    finally:
        if generator is not None:
            generator.stop()
            generator.join(10)
        d.close()
        ctx.destroy(linger=0)
        for board in (board0, *boards.values()):
            board.close()
            board.unlink()
