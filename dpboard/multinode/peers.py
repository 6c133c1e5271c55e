"""``PeerGuard``: a bound on the connections a bound ZMQ socket holds (the collector's fan-in, the
controller's ``--input``).

libzmq accepts every connection that reaches a bound port and keeps it until its handshake times
out. Peers that connect and never speak could therefore take every fd of the process; libzmq's
listener then fails ``accept`` with EMFILE at once, again and again (a whole core), and a real peer
connecting meanwhile is not let in until fds come free. CURVE does not help: all of this happens
before the handshake.

The guard applies ``dpboard.guard.ConnectionGuard``'s rules (a cap under the fd limit, shedding by
what a peer has proved, a back-off when fds run out) to the socket. A thread follows the socket's
monitor events: an accepted connection's event carries its fd, a closed one's too. The socket's
owner tells the guard what each connection proved (``prove``: the fd a message came from is
``zmq.SRCFD`` on the message) and learns which connections closed (``take_closed``). A connection
is closed with ``shutdown()`` on libzmq's fd, which libzmq then sees as a peer that went away and
cleans up itself; the guard never closes an fd it does not own, and checks the peer address first
in case libzmq reused the number.

With nothing to shed when fds run out (they went elsewhere), the guard has libzmq stop accepting for
a back-off: ``service()``, called from the thread that owns the socket (ZMQ sockets are not
thread-safe), detaches libzmq's listener and later gives it the same listening socket again
(``zmq.USE_FD``). The port is never given up: the guard holds a descriptor of the listening socket
from the start (one fd), so that the kernel keeps it bound and listening while libzmq does not
look (connections made meanwhile wait in its backlog), and no other process can take the port.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import struct
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from dpboard.guard import ConnectionGuard, Proof, fd_budget

__all__ = ["DEFAULT_MAX_PEERS", "FD_RESERVE", "HANDSHAKE_TIMEOUT_MS", "MIN_PEERS", "PeerGuard", "Proof",
           "hold_listener", "peer_address", "peer_budget", "set_deadlines"]

DEFAULT_MAX_PEERS = 1024
FD_RESERVE = 64  # fds left for everything else (boards, libzmq's own, accepts not yet seen)
MIN_PEERS = 4
_TCP_INFO_LEN = 256
_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info's tcpi_bytes_received (Linux >= 4.1)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
BACKOFF = (0.1, 2.0)  # seconds not accepting: the first pause, and the longest
OUT_OF_FDS_HOLD = 0.05  # seconds between two sheds for EMFILE
RESTORE_AFTER = 30.0  # seconds without EMFILE before a lowered cap is restored
_MAX_CLOSED = 65536  # closed connections waiting for the owner to look (it drains them every poll)
# A connection that has not finished its ZMTP (and CURVE) handshake by then is closed: libzmq's own
# default is 30 s, long enough for silent peers to pile up. A real peer's handshake takes a few round trips.
HANDSHAKE_TIMEOUT_MS = 5000
# The bound socket pings its peers too: one that completed a handshake and then never answers goes.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000

log = logging.getLogger("dpboard.peers")
# What PeerGuard.stats reports, in this order (all zero where a socket has no guard).
PEER_STATS = ("peers", "max_peers", "shed", "accept_failures", "pauses")


def peer_budget(requested: int | None) -> int:
    """The cap: ``requested`` (default DEFAULT_MAX_PEERS), but never more than the fds this process
    has left under its RLIMIT_NOFILE, less a reserve."""
    return fd_budget(DEFAULT_MAX_PEERS if requested is None else requested, FD_RESERVE, MIN_PEERS)


def set_deadlines(sock: zmq.Socket) -> None:
    """The handshake deadline and the heartbeats of a bound socket that strangers may reach (set
    before it binds)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def _wrap(fd: int) -> socket.socket:
    """A socket object on libzmq's fd that must be detached, never closed, by the caller."""
    return socket.socket(fileno=fd)


def peer_address(fd: int) -> object:
    s = _wrap(fd)
    try:
        return s.getpeername()
    finally:
        s.detach()


def _has_sent(fd: int) -> bool:
    """Whether the peer on ``fd`` has sent a byte (TCP_INFO; False where there is none, e.g. ipc)."""
    try:
        s = _wrap(fd)
    except OSError:
        return False
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return False
    finally:
        s.detach()
    if len(info) < _BYTES_RECEIVED_OFFSET + 8:
        return False
    return struct.unpack_from("Q", info, _BYTES_RECEIVED_OFFSET)[0] > 0


def _same_address(endpoint: str, family: int, name: object) -> bool:
    """Whether a listening socket's ``getsockname()`` is the bound ``endpoint`` (its LAST_ENDPOINT)."""
    transport, _, rest = endpoint.partition("://")
    if transport == "ipc":
        if isinstance(name, bytes):  # an abstract name: libzmq writes its leading NUL as @
            name = "@" + name[1:].decode(errors="replace")
        return family == socket.AF_UNIX and name == rest
    if transport != "tcp" or family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(name, tuple):
        return False
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    try:
        return int(port) == name[1] and socket.inet_pton(family, host) == socket.inet_pton(family, name[0])
    except (ValueError, OSError):
        return False


def hold_listener(endpoint: str) -> int | None:
    """A descriptor of its own on the listening socket that libzmq bound for ``endpoint`` (None:
    not found). Held, it keeps the port bound whatever libzmq does with its own descriptor."""
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        try:
            s = _wrap(fd)
        except OSError:
            continue  # not a socket (or closed meanwhile)
        try:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and _same_address(endpoint, s.family,
                                                                                        s.getsockname()):
                return os.dup(fd)
        except OSError:
            continue
        finally:
            s.detach()
    return None


class PeerGuard:
    """Caps the connections of the bound socket ``sock`` at ``max_peers`` (see the module)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, max_peers: int | None = None, *,
                 report_closed: bool = True) -> None:
        self.endpoint = endpoint
        self._report_closed = report_closed
        self.rules = ConnectionGuard(peer_budget(max_peers), minimum=MIN_PEERS, hold=OUT_OF_FDS_HOLD,
                                     backoff=BACKOFF, restore_after=RESTORE_AFTER, spoke=_has_sent)
        self._peers: dict[int, object] = {}  # fd -> peer address
        # (fd, address) of connections that closed, for the owner (take_closed); bounded: the owner
        # drains it every poll, and a flood's closes beyond that are only counted
        self._closed: collections.deque[tuple[int, object]] = collections.deque(maxlen=_MAX_CLOSED)
        self._pause_wanted = threading.Event()
        self._paused_for = 0.0
        self._paused_until: float | None = None
        self._last_warning = 0.0
        self._stop = threading.Event()
        self._listener = hold_listener(endpoint)
        if self._listener is None:
            log.warning("%s: cannot find the listening socket to hold: when fds run out with no peer to close, "
                        "libzmq keeps trying to accept", endpoint)
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._thread = threading.Thread(target=self._run, name="dpboard-peer-guard", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """``PEER_STATS`` now: open connections, the cap, and what the guard did."""
        r = self.rules
        return dict(zip(PEER_STATS, (r.open_count, r.cap, r.shed, r.accept_failures, r.pauses), strict=True))

    # -- what the owner tells and asks ------------------------------------------------------------

    def prove(self, fd: int, proof: Proof) -> None:
        """The connection on ``fd`` (a message's ``zmq.SRCFD``) has shown ``proof``."""
        self.rules.prove(fd, proof)

    def proof_of(self, fd: int) -> Proof | None:
        return self.rules.proof_of(fd)

    def take_closed(self) -> list[tuple[int, object]]:
        """The ``(fd, peer address)`` of each connection that closed since the last call."""
        out = []
        while self._closed:
            out.append(self._closed.popleft())
        return out

    # -- the guard's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        mon = self._monitor
        while not self._stop.is_set():
            try:
                if not mon.poll(100):
                    continue
                for _ in range(4096):  # a bounded batch, then look at the stop flag again
                    try:
                        frames = mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_event(parse_monitor_message(frames))
            except zmq.ZMQError:
                return  # the monitor is being closed

    def _on_event(self, event: dict) -> None:
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            if value in self._peers:  # libzmq reused the number before its close reached us
                self._forget(value)
            try:
                self._peers[value] = peer_address(value)
            except OSError:
                return  # already gone
            victims, _ = self.rules.opened(value)
            self._close(victims)
        elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            if value in self._peers:
                self._forget(value)
        elif kind == zmq.EVENT_ACCEPT_FAILED and value in _OUT_OF_FDS:
            self._out_of_fds(errno.errorcode.get(value, str(value)))

    def _forget(self, fd: int) -> None:
        addr = self._peers.pop(fd)
        if self._report_closed:
            self._closed.append((fd, addr))
        self.rules.closed(fd)

    def _out_of_fds(self, what: str) -> None:
        """libzmq's listener spins on this error until an fd frees: free some, once per hold time
        (libzmq needs a moment to close what was shut down; every failure meanwhile is the same one)."""
        decision = self.rules.out_of_fds()
        self._close(decision.victims)
        if decision.pause:
            self._paused_for = decision.pause
            self._pause_wanted.set()
        now = time.monotonic()
        if now - self._last_warning >= 5.0:
            self._last_warning = now
            log.warning("%s: out of fds (%s) with %d peers connected: closing those that proved the least, "
                        "cap now %d (raise `ulimit -n` if this is no flood)", self.endpoint, what,
                        self.rules.open_count, self.rules.cap)

    def _close(self, fds: list) -> None:
        for fd in fds:
            addr = self._peers.get(fd)
            try:
                if addr is None or peer_address(fd) != addr:  # libzmq closed it and reused the number
                    continue
                s = _wrap(fd)
            except OSError:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)  # libzmq reads EOF and closes the fd itself
            except OSError:
                pass
            finally:
                s.detach()

    # -- the owner's thread -----------------------------------------------------------------------

    def service(self, sock: zmq.Socket) -> None:
        """Stop accepting for a back-off when the guard asked for one, accept again when it is over
        (the port stays bound throughout: see the module). Cheap: call it from the owner's loop, in
        the thread that uses ``sock``."""
        if self._paused_until is None:
            if not self._pause_wanted.is_set():
                return
            self._pause_wanted.clear()
            if self._listener is None:
                return  # nothing holds the port while libzmq lets go of it: never give it up
            try:
                sock.unbind(self.endpoint)  # libzmq closes its descriptor; ours keeps the socket listening
            except zmq.ZMQError:
                return
            self._paused_until = time.monotonic() + self._paused_for
            log.warning("%s: out of fds with no peer to close: not accepting for %.1f s (the port stays bound)",
                        self.endpoint, self._paused_for)
            return
        if time.monotonic() < self._paused_until:
            return
        try:
            fd = os.dup(self._listener)  # libzmq's own, which it closes when it lets go
        except OSError as e:
            self._paused_until = time.monotonic() + self._paused_for
            log.warning("%s: still out of fds (%s): not accepting for another %.1f s (the port stays bound)",
                        self.endpoint, e.strerror, self._paused_for)
            return
        try:
            sock.setsockopt(zmq.USE_FD, fd)
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            os.close(fd)
            self._paused_until = time.monotonic() + self.rules.backoff_max
            log.warning("%s: cannot accept again yet (%s): next try in %.1f s (the port stays bound)",
                        self.endpoint, e.strerror, self.rules.backoff_max)
            return
        finally:
            try:
                sock.setsockopt(zmq.USE_FD, -1)  # any later bind of this socket makes its own
            except zmq.ZMQError:
                pass
        self._paused_until = None
        self._pause_wanted.clear()  # asked for before the pause: nothing was accepted since

    def close(self, sock: zmq.Socket) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        if self._listener is not None:
            os.close(self._listener)  # the port is free once libzmq's own descriptor closes too
            self._listener = None
