"""``PeerGuard``: a bound on the TCP connections a bound ZMQ socket holds.

libzmq accepts every connection that reaches a bound TCP port and keeps it until its handshake
times out. Peers that connect and never speak could therefore take every fd of the collector; libzmq's
listener then fails ``accept`` with EMFILE at once, again and again (a whole core), and a relay
connecting meanwhile is not let in until fds come free. CURVE does not help: all of this happens
before the handshake.

The guard bounds the count. A thread follows the socket's monitor events (an accepted connection's
event carries its fd, a closed one's too) and, when more than ``max_peers`` are open, closes
connections until 7/8 of the cap are left: first those whose peers have sent the fewest bytes
(``TCP_INFO``: a silent peer has sent none; a relay that is in has sent its greeting, its handshake
and its frames), the oldest among equals. A connection is closed with ``shutdown()`` on libzmq's fd,
which libzmq then sees as a peer that went away and cleans up itself; the guard never closes an fd
it does not own, and checks the peer address first in case libzmq reused the number.

An ``accept`` that fails for want of fds (EMFILE, ENFILE) sheds the same way, at most once per 50 ms,
so the listener's spin ends as soon as fds are free; the cap then comes down to what fits, and back
after 30 s without the error. When there is nothing to shed (the fds went elsewhere) the guard asks
its owner to unbind the endpoint for a back-off (0.1 s, doubling up to 2 s) and bind it again:
``service()``, called from the thread that owns the socket, since ZMQ sockets are not thread-safe.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import struct
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

DEFAULT_MAX_PEERS = 1024
FD_RESERVE = 64  # fds left for everything else (boards, libzmq's own, accepts not yet seen)
MIN_PEERS = 4
_TCP_INFO_LEN = 256
_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info's tcpi_bytes_received (Linux >= 4.1)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 2.0
OUT_OF_FDS_HOLD = 0.05  # seconds between two sheds for EMFILE
RESTORE_AFTER = 30.0  # seconds without EMFILE before a lowered cap is restored

log = logging.getLogger("dpboard.peers")


def peer_budget(requested: int | None) -> int:
    """The cap: ``requested`` (default DEFAULT_MAX_PEERS), but never more than the fds this process
    has left under its RLIMIT_NOFILE, less a reserve."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = DEFAULT_MAX_PEERS if requested is None else requested
    if soft != resource.RLIM_INFINITY:
        in_use = len(os.listdir("/proc/self/fd"))
        cap = min(cap, soft - in_use - FD_RESERVE)
    return max(MIN_PEERS, cap)


def _wrap(fd: int) -> socket.socket:
    """A socket object on libzmq's fd that must be detached, never closed, by the caller."""
    return socket.socket(fileno=fd)


def _peer(fd: int) -> object:
    s = _wrap(fd)
    try:
        return s.getpeername()
    finally:
        s.detach()


def _bytes_received(fd: int) -> int:
    s = _wrap(fd)
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    finally:
        s.detach()
    if len(info) < _BYTES_RECEIVED_OFFSET + 8:
        return 0  # an old kernel: age alone orders the candidates
    return struct.unpack_from("Q", info, _BYTES_RECEIVED_OFFSET)[0]


class PeerGuard:
    """Caps the connections of the bound socket ``sock`` at ``max_peers`` (see the module)."""

    def __init__(self, sock: zmq.Socket, endpoint: str, max_peers: int | None = None) -> None:
        self.endpoint = endpoint
        self._max_peers = peer_budget(max_peers)
        self.max_peers = self._max_peers  # lower while fds run out for other reasons
        self._hold_until = 0.0
        self._last_out_of_fds = 0.0
        self._resumed_at = 0.0
        self._keep = max(1, self.max_peers * 7 // 8)
        self._peers: dict[int, object] = {}  # fd -> peer address, oldest first
        self.shed = 0  # connections this guard closed
        self.accept_failures = 0  # accepts that failed for want of fds
        self.pauses = 0  # unbinds for a back-off
        self._pause_wanted = threading.Event()
        self._paused_until: float | None = None
        self._backoff = BACKOFF_FIRST
        self._last_warning = 0.0
        self._stop = threading.Event()
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._thread = threading.Thread(target=self._run, name="dpboard-peer-guard", daemon=True)
        self._thread.start()

    @property
    def open_peers(self) -> int:
        return len(self._peers)

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
            try:
                self._peers[value] = _peer(value)
            except OSError:
                return  # already gone
            if self.max_peers < self._max_peers and time.monotonic() - self._last_out_of_fds > RESTORE_AFTER:
                self.max_peers = self._max_peers  # fds have been plentiful for a while: the whole cap again
                self._keep = max(1, self.max_peers * 7 // 8)
            if len(self._peers) > self.max_peers:
                self._shed(len(self._peers) - self._keep)
        elif kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            self._peers.pop(value, None)
        elif kind == zmq.EVENT_ACCEPT_FAILED and value in _OUT_OF_FDS:
            self._out_of_fds(errno.errorcode.get(value, str(value)))

    def _out_of_fds(self, what: str) -> None:
        """libzmq's listener spins on this error until an fd frees: free some, once per hold time
        (libzmq needs a moment to close what was shut down; every failure meanwhile is the same one)."""
        self.accept_failures += 1
        now = time.monotonic()
        self._last_out_of_fds = now
        if now < self._hold_until:
            return
        self._hold_until = now + OUT_OF_FDS_HOLD
        if self._peers:
            # Fewer fds than the cap assumed (something else holds them): the cap comes down to what
            # fits, until fds have been plentiful again for a while.
            self.max_peers = max(MIN_PEERS, min(self.max_peers, len(self._peers) * 7 // 8))
            self._keep = max(1, self.max_peers * 7 // 8)
            self._shed(max(1, len(self._peers) - self._keep))
        else:
            self._pause_wanted.set()
        if now - self._last_warning >= 5.0:
            self._last_warning = now
            log.warning("%s: out of fds (%s) with %d peers connected: closing the quietest ones, cap now %d "
                        "(raise `ulimit -n` if this is no flood)", self.endpoint, what, len(self._peers),
                        self.max_peers)

    def _shed(self, n: int) -> None:
        """Close the ``n`` connections whose peers have sent the least, the oldest first."""
        ranked: list[tuple[int, int, int]] = []
        for age, (fd, addr) in enumerate(list(self._peers.items())):
            try:
                if _peer(fd) != addr:  # libzmq closed it and reused the number: a new peer
                    self._peers.pop(fd, None)
                    continue
                ranked.append((_bytes_received(fd), age, fd))
            except OSError:
                self._peers.pop(fd, None)
        ranked.sort()
        for _, _, fd in ranked[:n]:
            s = _wrap(fd)
            try:
                s.shutdown(socket.SHUT_RDWR)  # libzmq reads EOF and closes the fd itself
                self.shed += 1
            except OSError:
                pass
            finally:
                s.detach()
            self._peers.pop(fd, None)

    # -- the owner's thread -----------------------------------------------------------------------

    def service(self, sock: zmq.Socket) -> None:
        """Unbind for a back-off when the guard asked for one, bind again when it is over. Cheap:
        call it from the owner's loop, in the thread that uses ``sock``."""
        if self._paused_until is None:
            if not self._pause_wanted.is_set():
                return
            self._pause_wanted.clear()
            if time.monotonic() - self._resumed_at > RESTORE_AFTER:
                self._backoff = BACKOFF_FIRST  # not a pause right after the last one: start short again
            try:
                sock.unbind(self.endpoint)
            except zmq.ZMQError:
                return
            self.pauses += 1
            self._paused_until = time.monotonic() + self._backoff
            log.warning("%s: out of fds with no peer to close: not accepting for %.1f s", self.endpoint,
                        self._backoff)
            self._backoff = min(BACKOFF_MAX, self._backoff * 2)
            return
        if time.monotonic() < self._paused_until:
            return
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self._paused_until = time.monotonic() + self._backoff
            log.warning("%s: cannot bind again yet (%s): next try in %.1f s", self.endpoint, e.strerror,
                        self._backoff)
            self._backoff = min(BACKOFF_MAX, self._backoff * 2)
            return
        self._paused_until = None
        self._pause_wanted.clear()  # asked for before the pause: nothing listened since
        self._resumed_at = time.monotonic()

    def close(self, sock: zmq.Socket) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
