"""``dpboard controller --method inflight_wave``: a real controller process holds arrivals while the
ranks on its board decode, sends a full wave at once, sends the oldest at its bound, and sends what
it holds when it is stopped. Real board writers, real PULL sockets."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import zmq

from dpboard import Board, LoadSnapshot
from dpboard.board.dispatch_record import read_wave_rows
from dpboard.controller.codec import encode_request
from dpboard.snapshot import LoadDetail, LockstepDetail
from tests.controller.test_process_auto import Lines, N, Schedulers, start_controller
from tests.support.flood import rss_mib
from tests.support.procutil import kill, stop, wait_for, wait_until
from tests.support.sockets import bound_pull, connected_push

HOLD = 1.5  # --wave-max-hold: the board reports no decode throughput, so the bound is all of it


@dataclass
class WavingController:
    proc: subprocess.Popen
    lines: Lines
    push: zmq.Socket
    schedulers: Schedulers


@contextlib.contextmanager
def two_waves(board_name: str, tmp_path: Path) -> Iterator[WavingController]:
    """A real ``dpboard controller --method inflight_wave`` (2 per rank, a hold of ``HOLD`` s) over a
    board whose two ranks decode, once it has released two waves: a full one (four requests, at
    once) and one request alone at its bound. It runs until the caller stops it; at the end it gets
    SIGTERM (a clean exit: its lock files go with it, as a killed controller's would not)."""
    endpoints = [f"ipc://{tmp_path}/w{r}" for r in range(N)]
    in_ep = f"ipc://{tmp_path}/in"
    ctx = zmq.Context()
    with Board.create(board_name, n_slots=N) as board:
        # both ranks decode 4 requests, nothing queued: every arrival can wait for its wave
        schedulers = Schedulers(board, ctx, endpoints, queued=[0] * N)
        schedulers.start()
        proc = None
        try:
            proc, lines = start_controller(board_name, endpoints, in_ep, "--method", "inflight_wave",
                                           "--wave-max-hold", str(HOLD), "--wave-per-rank", "2", "--stats-json")
            push = connected_push(ctx, in_ep)
            push.send(encode_request("a0", num_tokens=100))
            assert schedulers.drain(0.5) == [], "a request went out while every rank decodes"
            for i in range(1, 2 * N):
                push.send(encode_request(f"a{i}", num_tokens=100))
            # the fourth makes a full wave (2 per rank): all four leave together
            assert len(schedulers.take(2 * N, timeout=10)) == 2 * N

            sent = time.monotonic()
            push.send(encode_request("b0", num_tokens=100))
            assert schedulers.drain(0.5) == []
            schedulers.take(1, timeout=20)  # alone: it leaves at its bound
            assert time.monotonic() - sent >= HOLD - 0.05
            # the controller's row of the dispatch record has both within 0.1 s
            wait_for(lambda: [row.wave.waves for row in read_wave_rows(board_name)] == [2], 10,
                     "the dispatch record to count both waves")
            yield WavingController(proc, lines, push, schedulers)
        finally:
            if proc is not None:
                stop(proc)
            schedulers.close()
            ctx.destroy(linger=0)


@pytest.mark.timeout(120)
def test_a_real_controller_holds_waves_and_sends_what_it_holds_when_stopped(board_name, tmp_path):
    """The wave's counters were read only by tests: an operator could not check the hold bound. The
    controller's row of the dispatch record (what `dpboard top` and `/metrics` read), its count line
    and --stats-json now say them."""
    with two_waves(board_name, tmp_path) as run:
        (row,) = read_wave_rows(board_name)
        wave = row.wave
        assert row.method == "inflight_wave" and row.pid == run.proc.pid
        assert row.counts["requests"] == sum(row.per_rank) == 5  # counted once, by the controller
        assert (wave.held, wave.holding, wave.waves) == (5, 0, 2)
        assert wave.released == (4, 0, 0, 1, 0, 0)  # full, bytes, busy, bound, shutdown, order
        assert HOLD - 0.05 <= wave.hold_max_s < HOLD + 1.0 and wave.max_hold_s == HOLD
        assert wave.hold_sum_s >= wave.hold_max_s + 0.45  # b0's, and a0's half second before the others came

        run.push.send(encode_request("c0", num_tokens=100))
        time.sleep(0.3)  # received and held, far from its bound
        stop(run.proc)
        lines = run.lines
        assert run.proc.returncode == 0, lines.text()
        assert len(run.schedulers.drain(1.0)) == 1, "the request held at stop was not sent"
        words = ("controller: held 6 for waves, 0 holding now, 1 placed at stop; at most 0.0 MiB held at once (the "
                 "bound: --max-queued-mib 64); 3 waves (released: full 4, bytes 0, busy 0, bound 1, shutdown 1, "
                 "order 0); each held at most ")
        wait_for(lambda: lines.count(words), 10, "the stop's count line")
        (line,) = [line for line in list(lines.lines) if words in line]
        held_max = re.search(r"each held at most ([0-9.]+) s \(the bound: --wave-max-hold 1.5\), ([0-9.]+) s on "
                             r"average", line)
        assert held_max is not None, line
        assert float(held_max.group(1)) == pytest.approx(wave.hold_max_s, abs=0.001)
        stats = json.loads(run.proc.stdout.read().strip().splitlines()[-1])
        assert (stats["held"], stats["released_at_stop"], stats["waves"]) == (6, 1, 3), stats
        assert stats["wave_released"] == {"full": 4, "bytes": 0, "busy": 0, "bound": 1, "shutdown": 1, "order": 0}
        assert stats["wave_hold_max_s"] == pytest.approx(wave.hold_max_s, abs=0.001)
        assert stats["wave_hold_sum_s"] >= wave.hold_sum_s + 0.25  # c0's 0.3 s too
        assert stats["dispatched"] == sum(stats["per_rank"]) == 6


RANKS = 8  # decoding, in lockstep: every arrival can wait for its wave (4 per rank: 32 fill it)
FRAME = 2**20  # a request of 1 MiB; --max-queued-mib 4 holds four at most


@pytest.mark.timeout(180)
def test_what_a_wave_holds_counts_against_the_queued_byte_bound(board_name, tmp_path):
    """--max-queued-mib bounds the bytes queued for each scheduler; the wave held its requests by
    count alone: 31 requests of 31 MiB (one short of a full wave over 8 ranks) took a controller
    from 42 to 1,065 MiB, and none reached a scheduler before the hold's bound. Now a wave leaves
    once what it holds reaches the bound ("bytes"): here 31 requests of 1 MiB under a bound of 4 MiB
    leave in waves of four, and the controller says it never held more than the bound and one frame."""
    endpoints = [f"ipc://{tmp_path}/w{r}" for r in range(RANKS)]
    in_ep = f"ipc://{tmp_path}/in"
    ctx = zmq.Context()
    with Board.create(board_name, n_slots=RANKS) as board:
        writers = [board.writer(r) for r in range(RANKS)]
        for rank, writer in enumerate(writers):
            writer.publish_detailed(
                LoadSnapshot(rank, num_running_reqs=4, num_total_tokens=1000, num_used_tokens=1000,
                             max_total_num_tokens=10**6),
                LoadDetail(lockstep=LockstepDetail(group_size=RANKS, chunk_tokens=512)))
        pulls = [bound_pull(ctx, ep) for ep in endpoints]
        proc = None
        try:
            # a hold of 60 s: nothing leaves by its bound within the test
            proc, lines = start_controller(board_name, endpoints, in_ep, "--method", "inflight_wave",
                                           "--wave-max-hold", "60", "--max-queued-mib", "4", "--max-input-mib",
                                           "32", "--stats-json")
            base = rss_mib(proc.pid)
            push = connected_push(ctx, in_ep)
            pad = b"x" * FRAME
            for i in range(31):
                push.send(msgpack.packb({"rid": f"r{i:02d}", "num_tokens": 100, "pad": pad}))
            got: list[str] = []

            def taken(count: int) -> bool:
                for pull in pulls:
                    while pull.poll(0):
                        got.append(msgpack.unpackb(pull.recv(), raw=False)["rid"])
                return len(got) >= count

            # seven waves of four leave as they fill the bound; three stay held, under it
            arrived = wait_until(lambda: taken(28), timeout=60)
            peak = rss_mib(proc.pid, "VmHWM") - base
            print(f"{len(got)} of 31 reached a scheduler; peak RSS {peak:.0f} MiB over {base:.0f}")
            assert arrived, f"{len(got)} of 31 requests reached a scheduler; the rest held"
            stop(proc)
            assert proc.returncode == 0, lines.text()
            wait_until(lambda: taken(31), timeout=30)
            stats = json.loads(proc.stdout.read().strip().splitlines()[-1])
            assert sorted(got) == [f"r{i:02d}" for i in range(31)]
            frame = len(msgpack.packb({"rid": "r00", "num_tokens": 100, "pad": pad}))
            assert frame < stats["held_bytes_max"] <= 4 * 2**20 + frame, stats
            assert stats["wave_released"]["bytes"] == 28 and stats["released_at_stop"] == 3, stats
            assert stats["held_bytes"] == 0
        finally:
            if proc is not None:
                kill(proc)
            ctx.destroy(linger=0)
