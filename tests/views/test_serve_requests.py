"""`dpboard serve` and what one request may cost the others: /healthz beside full reads of a
65,536-slot board, and request bodies (a body parsed as a second request poisons a proxy's
response queue). Real `dpboard serve` processes, real sockets."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from dpboard import Board, LoadSnapshot
from tests.support.names import new_board_name
from tests.support.procutil import stop
from tests.support.serving import get, start_server

pytestmark = pytest.mark.timeout(240)


def _healthz(host: str, port: int) -> tuple[int, dict, float]:
    conn = http.client.HTTPConnection(host, port, timeout=120)
    started = time.monotonic()
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        return resp.status, body, time.monotonic() - started
    finally:
        conn.close()


def test_healthz_does_not_wait_for_full_reads_of_a_large_board():
    """On a 65,536-slot board one /v1/board read takes seconds; /healthz used to take one full
    sample under the same lock (about 5 s alone, 24 s while 4 clients read /v1/board). It now reads
    the slots' status only, beside those reads: every probe is answered while they are still being
    served, and its counts are the board's."""
    name = new_board_name()
    with Board.create(name, n_slots=65536) as board:
        for rank in (3, 70, 65535):
            board.writer(rank).publish(LoadSnapshot(dp_rank=rank, num_running_reqs=1))
        proc, url = start_server(name, "--stale-after", "600")
        host, port = url.rsplit("/", 1)[1].split(":")
        try:
            status, body, alone = _healthz(host, int(port))
            assert status == 200 and body["n_slots"] == 65536
            assert body["slots"] == {"live": 3, "stale": 0, "empty": 65533, "torn": 0}, body
            done: list[float] = []

            def read_board() -> None:
                status, _, _ = get(f"{url}/v1/board", timeout=600)
                assert status == 200
                done.append(time.monotonic())

            readers = [threading.Thread(target=read_board, daemon=True) for _ in range(4)]
            for t in readers:
                t.start()
            time.sleep(0.5)  # the reads are under way (each takes seconds on this board)
            probes = []
            while not done and len(probes) < 5:
                status, body, took = _healthz(host, int(port))
                assert status == 200 and body["slots"]["live"] == 3
                probes.append((time.monotonic(), took))
            for t in readers:
                t.join(300)
            print(f"/healthz alone {alone:.3f} s; beside 4 /v1/board reads {[round(p[1], 3) for p in probes]} s; "
                  f"the first read done {done[0] - probes[0][0] + probes[0][1]:.1f} s after the first probe began")
            assert len(done) == 4
            # every probe came back while no full read had finished yet: none waited for one
            assert len(probes) == 5 and probes[-1][0] < min(done), (probes, done)
        finally:
            stop(proc)


def _exchange(port: int, raw: bytes, wait: float = 3.0) -> bytes:
    """Send ``raw`` on one connection and read what comes back until the server closes it or
    ``wait`` seconds pass without a byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        s.settimeout(wait)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        return got


@pytest.fixture(scope="module")
def server():
    name = new_board_name()
    with Board.create(name, n_slots=2) as board, board.writer(0) as w:
        w.publish(LoadSnapshot(dp_rank=0, num_running_reqs=1))
        proc, url = start_server(name, "--stale-after", "600")
        try:
            yield int(url.rsplit(":", 1)[1])
        finally:
            stop(proc)


SMUGGLED = b"GET /v1/board HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_body_on_a_get_is_read_never_taken_for_a_second_request(server):
    body = SMUGGLED
    got = _exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    print(f"{got.count(b'HTTP/1.1 ')} responses to one GET with a {len(body)}-byte body")
    assert got.count(b"HTTP/1.1 ") == 1 and got.startswith(b"HTTP/1.1 200")
    assert b'"status": "ok"' in got and b'"ranks"' not in got


@pytest.mark.parametrize(("headers", "status"), [
    (b"Content-Length: 37\r\nContent-Length: 37\r\n", b"400"),  # two lengths: which one a proxy used, nobody knows
    (b"Content-Length: 37, 37\r\n", b"400"),
    (b"Content-Length: -1\r\n", b"400"),
    (b"Transfer-Encoding: chunked\r\n", b"400"),
    (b"Content-Length: 99999999\r\n", b"413"),
])
def test_an_ambiguous_or_oversized_body_is_refused_and_the_connection_closed(server, headers, status):
    got = _exchange(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + SMUGGLED, wait=10)
    print(f"{headers!r}: {got.count(b'HTTP/1.1 ')} responses, {got[:12]!r}")
    assert got.count(b"HTTP/1.1 ") == 1 and got.startswith(b"HTTP/1.1 " + status), got[:300]
    assert b"Connection: close" in got and b'"ranks"' not in got
