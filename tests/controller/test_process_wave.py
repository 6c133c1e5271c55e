"""``dpboard controller --method inflight_wave``: a real controller process holds arrivals while the
ranks on its board decode, sends a full wave at once, sends the oldest at its bound, and sends what
it holds when it is stopped. Real board writers, real PULL sockets."""

from __future__ import annotations

import time

import pytest
import zmq

from dpboard import Board
from dpboard.controller.codec import encode_request
from tests.controller.test_process_auto import N, Schedulers, start_controller
from tests.support.procutil import kill, stop
from tests.support.sockets import connected_push

HOLD = 1.5  # --wave-max-hold: the board reports no decode throughput, so the bound is all of it


@pytest.mark.timeout(120)
def test_a_real_controller_holds_waves_and_sends_what_it_holds_when_stopped(board_name, tmp_path):
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
                                           "--wave-max-hold", str(HOLD), "--wave-per-rank", "2")
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

            push.send(encode_request("c0", num_tokens=100))
            time.sleep(0.3)  # received and held, far from its bound
            stop(proc)
            assert proc.returncode == 0, lines.text()
            assert len(schedulers.drain(1.0)) == 1, "the request held at stop was not sent"
            assert lines.count("controller: held 6 for waves, 0 holding now, 1 placed at stop") == 1, lines.text()
        finally:
            if proc is not None:
                kill(proc)
            schedulers.close()
            ctx.destroy(linger=0)
