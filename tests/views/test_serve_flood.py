"""`dpboard serve` under slow clients (slowloris, issue 28 item 6): real floods on loopback.

One client opening connections and sending each a byte at a time used to take every descriptor of
the server (the idle timeout bounded each ``recv``, not a request), after which ``accept`` failed
with EMFILE in a loop at full CPU and /healthz was never answered. Each test starts a real
`dpboard serve` process with a lowered open-file limit (RLIMIT_NOFILE) and short deadlines, floods it
from this process with a bounded number of connections for a bounded time, and checks that a real
GET /healthz is answered meanwhile and that the server's CPU time (utime + stime from /proc) stays
far from one CPU second per second.
"""

from __future__ import annotations

import http.client
import os
import resource
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpboard import Board, LoadSnapshot
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, stop, wait_for

pytestmark = pytest.mark.timeout(180)

NOFILE = 64  # the server's open-file limit: a flood of a few hundred connections exhausts it
PREFIX = b"GET /healthz HTTP/1.1\r\nHost: flood\r\nX-Slow: "  # headers that never end
CLK_TCK = os.sysconf("SC_CLK_TCK")
# CPU seconds per wall second the server may use while flooded: generous (the spin was ~1.0);
# answering the slow clients' bytes and closing the oldest costs a few per cent.
CPU_SHARE_BOUND = 0.5


def start_serve(name: str, *extra: str, nofile: int = NOFILE) -> tuple[subprocess.Popen, tuple[str, int]]:
    def lower_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    proc = subprocess.Popen([sys.executable, "-m", "dpboard.cli", "serve", name, "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lower_limit)
    try:
        line = read_line(proc, 30)
    except AssertionError:
        kill(proc)
        raise
    host, port = line.split(" on http://")[1].split()[0].split(":")
    return proc, (host, int(port))


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, from /proc/PID/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def open_sockets(pid: int) -> int:
    """How many sockets the process holds open (its listening socket and its connections)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            continue  # closed meanwhile
    return count


def healthz(addr: tuple[str, int], timeout: float = 15.0) -> int:
    """The status of a real GET /healthz (an exception if it is not answered within ``timeout``)."""
    conn = http.client.HTTPConnection(*addr, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


class SlowClients:
    """Connections that each send a request's headers a byte at a time and never finish them; the
    ones the server closes are counted and, with ``top_up``, replaced, as an attacker would."""

    def __init__(self, addr: tuple[str, int]) -> None:
        self.addr = addr
        self.socks: list[socket.socket] = []
        self.opened = 0
        self.closed_by_server = 0

    def top_up(self, target: int, at_most: int) -> None:
        for _ in range(min(at_most, target - len(self.socks))):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(self.addr)
            if err not in (0, 115):  # 115: EINPROGRESS
                s.close()
                continue
            self.socks.append(s)
            self.opened += 1

    def trickle(self) -> None:
        """One more byte on every connection; drop (and count) those the server has closed."""
        if not self.socks:
            return
        _, writable, _ = select.select([], self.socks, [], 0)
        readable, _, _ = select.select(self.socks, [], [], 0)
        gone = set()
        for s in readable:  # the server closed it (or sent an error): end-of-file or a reset
            try:
                if not s.recv(4096):
                    gone.add(s)
            except OSError:
                gone.add(s)
        for s in writable:
            if s in gone:
                continue
            try:
                s.send(b"a")
            except OSError:
                gone.add(s)
        for s in gone:
            self.closed_by_server += 1
            s.close()
        self.socks = [s for s in self.socks if s not in gone]

    def start_headers(self) -> None:
        """Each connection's first bytes: a request line and a header left open."""
        _, writable, _ = select.select([], self.socks, [], 1.0)
        for s in writable:
            try:
                s.send(PREFIX)
            except OSError:
                pass

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


def flood(addr: tuple[str, int], pid: int, *, seconds: float, target: int, rate: int) -> dict:
    """``target`` slow connections opened at about ``rate`` a second and kept topped up for
    ``seconds``, a byte every 0.5 s on each; a real GET /healthz about once a second meanwhile.
    Returns the probes' statuses, the server's CPU share over the flood and the client counts."""
    clients = SlowClients(addr)
    statuses = []
    start_wall, start_cpu = time.monotonic(), cpu_seconds(pid)
    next_probe = start_wall + 1.0
    next_trickle = start_wall
    try:
        while (now := time.monotonic()) < start_wall + seconds:
            before = len(clients.socks)
            clients.top_up(target, max(1, rate // 10))
            if len(clients.socks) > before:
                clients.start_headers()
            if now >= next_trickle:
                clients.trickle()
                next_trickle = now + 0.5
            if now >= next_probe:
                statuses.append(healthz(addr))
                next_probe = time.monotonic() + 1.0
            time.sleep(0.1)
        wall, cpu = time.monotonic() - start_wall, cpu_seconds(pid) - start_cpu
    finally:
        clients.close()
    return {"statuses": statuses, "cpu_share": cpu / wall, "opened": clients.opened,
            "closed_by_server": clients.closed_by_server}


@pytest.fixture
def board(board_name):
    with Board.create(board_name, n_slots=2) as b:
        with b.writer(0) as w:
            w.publish(LoadSnapshot(dp_rank=0, num_running_reqs=1))
            yield b


def test_healthz_is_answered_while_slow_clients_flood_past_the_open_file_limit(board):
    """The connection cap follows the lowered limit (64 - 32 = 32): the flood's oldest connections
    are closed to make room, the header deadline ends the rest, and /healthz keeps being answered."""
    proc, addr = start_serve(board.name, "--header-timeout", "2")
    try:
        before = open_sockets(proc.pid)
        result = flood(addr, proc.pid, seconds=10, target=150, rate=60)
        assert result["statuses"] and set(result["statuses"]) == {200}, result
        assert result["opened"] > NOFILE  # the flood really went past what the server could hold
        assert result["closed_by_server"] > 0, result
        assert result["cpu_share"] < CPU_SHARE_BOUND, result
        assert proc.poll() is None
        # and after it, once the server has let go of the flood's connections (on a loaded machine
        # it may still hold them, and one it accepted but has not read yet may be the one it closes)
        wait_for(lambda: open_sockets(proc.pid) <= before + 1, 60, "the server to close the flood's connections")
        assert healthz(addr) == 200
    finally:
        stop(proc)


def test_accept_out_of_descriptors_backs_off_and_still_serves(board):
    """The open-file limit lowered under a running server (prlimit), below what its cap (256) was
    sized for: accept() fails with EMFILE. The server then lowers its cap, closes its longest idle
    connections and pauses instead of spinning, and /healthz is still answered."""
    proc, addr = start_serve(board.name, "--header-timeout", "5", nofile=1024)
    try:
        assert healthz(addr) == 200
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (NOFILE, hard))
        result = flood(addr, proc.pid, seconds=10, target=150, rate=60)
        assert result["statuses"] and set(result["statuses"]) == {200}, result
        assert result["cpu_share"] < CPU_SHARE_BOUND, result
        assert proc.poll() is None
    finally:
        stop(proc)


def test_headers_sent_a_byte_at_a_time_meet_the_header_deadline(board):
    """Each byte comes well within the idle timeout (30 s), so only a deadline for the whole headers
    ends this connection."""
    proc, addr = start_serve(board.name, "--header-timeout", "1")
    try:
        s = socket.create_connection(addr, timeout=10)
        try:
            s.sendall(PREFIX)
            closed = False
            deadline = time.monotonic() + 20
            sent = 0
            while not closed and time.monotonic() < deadline:
                if select.select([s], [], [], 0.2)[0]:
                    try:
                        closed = s.recv(4096) == b""
                    except OSError:
                        closed = True
                    break
                try:
                    s.send(b"a")
                    sent += 1
                except OSError:
                    closed = True
            assert closed, f"a connection sending its headers a byte at a time stayed open ({sent} bytes)"
        finally:
            s.close()
        assert healthz(addr) == 200  # a whole request is answered as before
    finally:
        stop(proc)


def _closed(s: socket.socket, wait: float) -> bool:
    if not select.select([s], [], [], wait)[0]:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_at_the_cap_the_longest_idle_connection_is_closed_first(board):
    proc, addr = start_serve(board.name, "--max-connections", "4")
    idle: list[socket.socket] = []
    try:
        for _ in range(4):
            idle.append(socket.create_connection(addr, timeout=10))
            time.sleep(0.2)  # accepted in this order
        assert healthz(addr) == 200  # a fifth connection: the first is closed to make room
        assert _closed(idle[0], 10)
        assert not any(_closed(s, 0.3) for s in idle[1:])
        idle.append(socket.create_connection(addr, timeout=10))  # four open again
        time.sleep(0.2)
        assert healthz(addr) == 200
        assert _closed(idle[1], 10)
        assert not any(_closed(s, 0.3) for s in idle[2:])
    finally:
        for s in idle:
            s.close()
        stop(proc)
