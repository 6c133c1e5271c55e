"""A scheduler of a real SGLang server SIGKILLed with a request in flight (a server of its own).

What SGLang 0.5.23 does here: nothing. The schedulers are the DP controller's children, which it
neither watches nor reaps (the dead one stays a zombie); the server's subprocess watchdog watches
its own children only. The server keeps serving on the other rank, and the request in flight on
the dead rank never ends. What dpboard does: the dead rank reads STALE on the board (the other stays
LIVE) once its last publish is older than the threshold; the plugin's dispatch then sends every new
request to the live rank, where SGLang's own budget keeps its last-known loads; no user's response
carries anything of dpboard's; and the server stopped, nothing of the board is left in /dev/shm."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections import Counter

import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.snapshot import SlotStatus
from tests.integrations.sglang.serving.conftest import plugin_env, start, stop
from tests.support.names import new_board_name
from tests.support.procutil import wait_until

pytestmark = [pytest.mark.serving, pytest.mark.timeout(900)]
STALE_AFTER = 1.0  # the plugin's threshold here (DPBOARD_STALE_AFTER), and `dpboard top`'s default
LIVE, STALE = int(SlotStatus.LIVE), int(SlotStatus.STALE)


@pytest.fixture(scope="module")
def server():
    board = new_board_name()
    srv = start({**plugin_env(board), "DPBOARD_STALE_AFTER": str(STALE_AFTER)},
                extra=("--load-balance-method", "total_tokens"))
    srv.board = board
    try:
        yield srv
    finally:
        stop(srv)


def statuses(server) -> list[int]:
    with Board.attach(server.board) as board:
        return board.reader(stale_after=STALE_AFTER).read_array()["status"].tolist()


def open_stream(server, rank: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/generate", json.dumps({
        "text": f"a story for rank {rank}", "stream": True, "routed_dp_rank": rank,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0.0},
    }), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return response


def what_came(response: http.client.HTTPResponse, chunks: int = 50) -> bytes:
    out = b""
    try:
        for _ in range(chunks):
            chunk = response.read1(65536)
            if not chunk:
                break
            out += chunk
    except (OSError, http.client.HTTPException):
        pass  # nothing more within the connection's timeout: the request hangs on the dead rank
    return out


def test_a_killed_scheduler_reads_stale_and_new_requests_go_to_the_live_rank(server):
    assert wait_until(lambda: statuses(server) == [LIVE, LIVE], timeout=120), statuses(server)
    stream = open_stream(server, 1)
    assert b"data:" in what_came(stream, 1)  # it runs on rank 1
    victim = server.schedulers(2)[1][0]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_until(lambda: statuses(server) == [LIVE, STALE], timeout=60, interval=0.05), \
        (statuses(server), server.tail())
    print(f"rank 1 read STALE {time.monotonic() - killed:.2f} s after its scheduler was killed")
    answers = [server.generate(f"after the kill {i}", 4, timeout=120) for i in range(6)]
    for status, answer in answers:
        assert status == 200, answer
        assert "dpboard" not in json.dumps(answer).lower(), answer
    assert Counter(a["meta_info"]["dp_rank"] for _, a in answers) == Counter({0: 6})
    in_flight = what_came(stream)
    stream.close()
    assert b"dpboard" not in in_flight.lower(), in_flight[-2000:]
    assert server.proc.poll() is None  # SGLang serves on
    assert statuses(server) == [LIVE, STALE]
    server.stop()  # SIGTERM to its process group
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{server.board}")), timeout=60), \
        (sorted(SHM_DIR.glob(f"dpboard*{server.board}")), server.tail())
