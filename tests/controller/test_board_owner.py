"""One controller per board: two controllers started on one board with the same workers both used to
start, silently, and then each counted the other's sends as its own deliveries. The second now
refuses to start, naming the first; a killed first one never blocks its restart."""

from __future__ import annotations

import signal
import subprocess
import sys

import msgpack
import pytest
import zmq

from dpboard import Board
from dpboard.controller.codec import encode_request
from dpboard.controller.command import board_lock_path
from dpboard.ownership import endpoint_lock_path
from tests.support.procutil import kill, stop, wait_for
from tests.support.sockets import bound_pull, connected_push

CLI = [sys.executable, "-m", "dpboard.cli", "controller"]


@pytest.mark.timeout(90)
def test_a_second_controller_on_the_same_board_is_refused_naming_the_first(board_name, tmp_path):
    eps = [f"ipc://{tmp_path}/w0", f"ipc://{tmp_path}/w1"]
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []

    def controller(name: str, *extra: str) -> list[str]:
        return CLI + ["--input", f"ipc://{tmp_path}/{name}", "--workers", *eps, "--method", "round_robin",
                      "--board", board_name, "--stale-after", "60", "--log-every", "60", *extra]

    with Board.create(board_name, n_slots=2) as board:
        try:
            for r in range(2):
                board.writer(r).publish_values(0, 0, 0, 0, 0, 100, 0)
            workers = [bound_pull(ctx, ep) for ep in eps]
            first = subprocess.Popen(controller("in-a"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(first)
            wait_for(lambda: board_lock_path(board_name).exists() or first.poll() is not None, 30,
                     "the first controller to take the board")
            second = subprocess.run(controller("in-b", "--duration", "5"), capture_output=True, text=True, timeout=30)
            assert second.returncode == 2, second.stderr
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
            assert f"board '{board_name}' already has a controller: pid {first.pid}" in lines[0]
            assert "give each its own board" in lines[0]

            push = connected_push(ctx, f"ipc://{tmp_path}/in-a")  # the first one still serves
            push.send(encode_request("still-served", num_tokens=3))
            wait_for(lambda: any(w.poll(0) for w in workers), 20, "the first controller to dispatch")
            got = [msgpack.unpackb(w.recv()) for w in workers if w.poll(0)]
            assert [m["rid"] for m in got] == ["still-served"]

            kill(first)  # SIGKILL: the kernel drops its lock with it
            third = subprocess.Popen(controller("in-c"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(third)
            push = connected_push(ctx, f"ipc://{tmp_path}/in-c")
            push.send(encode_request("after-restart", num_tokens=3))
            wait_for(lambda: any(w.poll(0) for w in workers) or third.poll() is not None, 30,
                     "the restarted controller to dispatch")
            assert third.poll() is None, third.communicate()[1]
            stop(third, signal.SIGTERM)
            assert third.returncode == 0 and not board_lock_path(board_name).exists()  # a clean exit frees it
        finally:
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)
            lock = endpoint_lock_path(f"ipc://{tmp_path}/in-a")  # the killed first one's input lock
            if lock is not None:
                lock.unlink(missing_ok=True)
