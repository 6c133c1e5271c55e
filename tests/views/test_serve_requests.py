"""`dpboard serve` and what one request may cost the others: /healthz beside full reads of a
65,536-slot board, and request bodies (a body parsed as a second request poisons a proxy's
response queue). Real `dpboard serve` processes, real sockets."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
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
    """On a 65,536-slot board one /v1/board read is a full sample of every slot; /healthz used to
    take one such sample under the same lock (about 5 s alone, 24 s while 4 clients read /v1/board
    on a slow machine). It now reads the slots' status only, beside those reads: while 4 clients
    read the board back to back, a probe is answered in a fraction of what one of their reads
    takes (both measured in this run), and its counts are the board's."""
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
            reads: list[float] = []
            in_flight = threading.Semaphore(0)
            finished = threading.Event()

            def read_board() -> None:
                first = True
                while not finished.is_set():
                    started = time.monotonic()
                    if first:
                        in_flight.release()
                        first = False
                    status, _, _ = get(f"{url}/v1/board", timeout=600)
                    assert status == 200
                    reads.append(time.monotonic() - started)

            readers = [threading.Thread(target=read_board, daemon=True) for _ in range(4)]
            for t in readers:
                t.start()
            for _ in readers:
                assert in_flight.acquire(timeout=60)
            probes = []
            try:
                deadline = time.monotonic() + 120
                while (len(probes) < 5 or len(reads) < 8) and time.monotonic() < deadline:
                    status, body, took = _healthz(host, int(port))
                    assert status == 200 and body["slots"]["live"] == 3
                    probes.append(took)
            finally:
                finished.set()
                for t in readers:
                    t.join(300)
            probe, read = statistics.median(probes), statistics.median(reads)
            print(f"/healthz alone {alone:.3f} s; beside 4 clients reading /v1/board back to back: median "
                  f"{probe:.3f} s over {len(probes)} probes; their reads' median {read:.3f} s over {len(reads)}")
            assert len(reads) >= 8 and not any(t.is_alive() for t in readers)
            # A probe that took a full sample under the readers' lock would take about one read.
            assert probe < read / 3, (probes, reads)
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
