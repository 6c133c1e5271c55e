"""A scheduler of a real SGLang server SIGKILLed with a request in flight (a server of its own).

What SGLang 0.5.23 does here: nothing. The schedulers are the DP controller's children, which it
neither watches nor reaps (the dead one stays a zombie); the server's subprocess watchdog watches
its own children only. The server keeps serving on the other rank; a request on the dead rank would
never end. What dpboard does: the plugin's dispatch skips the dead rank as soon as its writer's
lock is gone (the kernel drops it with the process), well before its last publish is older than
DPBOARD_STALE_AFTER (5 s), so every new request goes to the live rank even though the dead one
looked the least loaded; the dead rank then reads STALE on the board (the other stays LIVE); no
user's response carries anything of dpboard's; and the server stopped, nothing of the board is
left in /dev/shm."""

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
from tests.integrations.sglang.serving.conftest import serving
from tests.support.procutil import wait_until

pytestmark = [pytest.mark.serving, pytest.mark.timeout(900)]
STALE_AFTER = 1.0  # `dpboard top`'s default; the plugin dispatches with its own (5 s)
LIVE, STALE = int(SlotStatus.LIVE), int(SlotStatus.STALE)


@pytest.fixture(scope="module")
def server():
    with serving() as srv:
        yield srv


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


def writer_gone(server, rank: int) -> bool:
    with Board.attach(server.board) as board:
        return rank in board.slot_locks().refresh()


def running(server) -> list[int]:
    with Board.attach(server.board) as board:
        return board.reader(stale_after=STALE_AFTER).read_array()["num_running_reqs"].tolist()


def test_a_killed_scheduler_is_skipped_at_once_and_reads_stale(server):
    assert wait_until(lambda: statuses(server) == [LIVE, LIVE], timeout=120), statuses(server)
    stream = open_stream(server, 0)  # rank 0 busy: rank 1, idle, is the least loaded
    assert b"data:" in what_came(stream, 1)
    assert wait_until(lambda: running(server) == [1, 0], timeout=60), running(server)
    victim = server.schedulers(2)[1][0]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_until(lambda: writer_gone(server, 1), timeout=30), server.tail()
    answers = [server.generate(f"after the kill {i}", 4, timeout=60) for i in range(6)]
    sent_within = time.monotonic() - killed
    for status, answer in answers:
        assert status == 200, answer
        assert "dpboard" not in json.dumps(answer).lower(), answer
    assert Counter(a["meta_info"]["dp_rank"] for _, a in answers) == Counter({0: 6})
    assert wait_until(lambda: statuses(server) == [LIVE, STALE], timeout=60, interval=0.05), \
        (statuses(server), server.tail())
    print(f"6 requests answered by rank 0 within {sent_within:.2f} s of the kill; rank 1 read STALE "
          f"{time.monotonic() - killed:.2f} s after it")
    in_flight = what_came(stream)
    stream.close()
    assert b"dpboard" not in in_flight.lower(), in_flight[-2000:]
    assert server.proc.poll() is None  # SGLang serves on
    server.stop()  # SIGTERM to its process group
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{server.board}")), timeout=60), \
        (sorted(SHM_DIR.glob(f"dpboard*{server.board}")), server.tail())
