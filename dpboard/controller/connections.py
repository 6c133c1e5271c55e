"""The controller's connections and their bounds: the request input it binds, the schedulers' pipes
and the error channel it connects (docs/SECURITY.md, "The controller's connections").

- ``RequestInput``, the bound PULL: at most ``max_peers`` connections (never more than ``ulimit -n``
  leaves), a 5 s handshake deadline, heartbeats, shedding by what a peer has proved (a request
  that decoded, then one that did not, then nothing), a back-off when fds run out
  (``dpboard.multinode.peers.PeerGuard``, as on the collector's fan-in), and frames of at most
  ``MAX_FRAME_BYTES``. ZMQ bounds what waits to be read in messages only: its receive high-water
  mark is ``max_input_bytes`` over the largest frame, so a connection's frames not yet read stay
  within ``max_input_bytes`` (and the one frame ZMQ is reading); a sender faster than the controller
  then waits (TCP's flow control), nothing is dropped. One read takes at most ``MAX_BATCH_BYTES``.
- ``Pipe``, one connected PUSH (a scheduler's, or the error channel): ZMQ bounds its queue in
  messages (``--send-hwm``), this bounds it in bytes. ``SendQueue`` measures what the process
  still holds of what was sent on the pipe's connection; a pipe holding ``max_queued_bytes`` or
  more is *backlogged*: a scheduler then counts as unavailable (its requests go elsewhere, as for a
  broken connection) until it has taken all but half of that, and an error answer is dropped
  (counted). What the kernel tells: for TCP the bytes the socket has taken from libzmq (the peer's
  acknowledgements plus the kernel's own send queue), exact; for a Unix socket whether its kernel
  buffer has room, which means libzmq holds nothing (what was sent since room was last seen counts).
- ``BoundedLog``: malformed frames and refused requests are logged with at most ``TEXT_MAX``
  characters of their rid and reason, and at most ``LOG_BURST`` lines per ``LOG_WINDOW`` seconds;
  the rest is counted and summed up in one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dpboard.errors import UnavailableError
from dpboard.multinode.peers import PeerGuard, Proof, peer_address, set_deadlines

# The largest request frame taken in: a prompt of 4M tokens at their widest msgpack size (5 bytes),
# with room for the other keys. A frame is read without an object per token, so this bounds memory,
# not the time a hostile frame costs.
MAX_FRAME_BYTES = 32 * 2**20
# What the frames ZMQ has received and the controller not yet read may hold, per connection: 8 frames
# of the largest size. ZMQ counts messages, not bytes; a smaller high-water mark costs a wake-up of
# ZMQ's I/O thread every few requests (measured, small requests at full rate: 8 frames about 10 us of
# the controller's CPU per request, 2 frames about 21, 1 000 frames about 8).
DEFAULT_MAX_INPUT_MIB = 256
MIN_INPUT_MIB = MAX_FRAME_BYTES // 2**20  # one frame
MAX_INPUT_MIB = 2**20
# What one read of the input takes at most before it is dispatched (it stops after the frame that
# reaches it): a batch of 1 024 frames of 32 MiB would otherwise be 32 GiB. Batching pays for
# small requests; 16 MiB is a thousand requests of 4k tokens.
MAX_BATCH_BYTES = 16 * 2**20
# What one pipe may hold before it is backlogged: 64 MiB per scheduler is 4 GiB for a 64-rank node
# (plus at most one frame each beyond it), and about 2,000 prompts of 8k tokens per rank.
DEFAULT_MAX_QUEUED_MIB = 64
MAX_QUEUED_MIB = 2**20
TEXT_MAX = 200  # characters of a rid or a reason in one log line
LOG_BURST = 10  # lines per window about frames, before the rest is only counted
LOG_WINDOW = 10.0  # seconds
_TCP_INFO_LEN = 256
_BYTES_ACKED_OFFSET = 120  # struct tcp_info's tcpi_bytes_acked (Linux >= 4.1)

log = logging.getLogger("dpboard.controller")


def connect_or_bind(sock: zmq.Socket, endpoint: str, how: str, what: str) -> None:
    try:
        sock.bind(endpoint) if how == "bind" else sock.connect(endpoint)
    except zmq.ZMQError as e:
        raise UnavailableError(f"cannot {how} {what} on {endpoint}: {e.strerror}") from None


# -- what a log line may carry ------------------------------------------------------------------------


class Shown(str):
    """A value as a log line shows it, already cut (``shown``)."""


def shown(value: Any, limit: int = TEXT_MAX) -> Shown:
    """``repr(value)`` of at most ``limit`` characters of it, saying how long it was: a rid a peer
    sent may be megabytes."""
    if isinstance(value, (str, bytes, bytearray)) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return Shown(f"{value[:limit]!r}... ({len(value)} {unit})")
    return Shown(_cut(repr(value), limit))


def _cut(text: str, limit: int = TEXT_MAX) -> str:
    if isinstance(text, Shown) or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class BoundedLog:
    """Warnings about frames a peer controls: at most ``burst`` per ``window`` seconds, each text
    argument cut to ``TEXT_MAX`` characters (pass a rid through ``shown``); what is held back is
    counted and said in one line when the window ends."""

    def __init__(self, logger: logging.Logger, *, burst: int = LOG_BURST, window: float = LOG_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self.burst, self.window, self._clock = logger, burst, window, clock
        self._window_end = float("-inf")
        self._said = 0
        self.held_back = 0  # in the current window
        self.held_back_total = 0

    def warning(self, fmt: str, *args: Any) -> bool:
        now = self._clock()
        if now >= self._window_end:
            self._end_window()
            self._window_end = now + self.window
        if self._said >= self.burst:
            self.held_back += 1
            self.held_back_total += 1
            return False
        self._said += 1
        self._log.warning(fmt, *(_cut(a) if isinstance(a, str) else a for a in args))
        return True

    def _end_window(self) -> None:
        if self.held_back:
            self._log.warning("... and %d more such lines in the last %.0f s, not logged", self.held_back,
                              self.window)
        self._said = 0
        self.held_back = 0

    def flush(self) -> None:
        self._end_window()


# -- the input ----------------------------------------------------------------------------------------


def input_hwm(max_input_bytes: int) -> int:
    """The receive high-water mark (frames per connection) that keeps a connection's frames not yet
    read within ``max_input_bytes``: that many frames of ``MAX_FRAME_BYTES``, at least one."""
    return max(1, max_input_bytes // MAX_FRAME_BYTES)


class RequestInput:
    """The bound PULL that requests come in on, and its bounds on connections and bytes (see the module)."""

    def __init__(self, context: zmq.Context, endpoint: str, *, max_peers: int | None = None,
                 max_input_bytes: int = DEFAULT_MAX_INPUT_MIB * 2**20) -> None:
        self.socket = context.socket(zmq.PULL)
        self.guard: PeerGuard | None = None
        self.hwm = input_hwm(max_input_bytes)
        self.largest_read = 0  # bytes, the most one receive() took
        try:
            self.socket.setsockopt(zmq.LINGER, 0)
            # ZMQ drops a larger frame (and the peer's connection) before any of it is buffered here.
            self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            # Set before the bind: a connection's pipe takes the mark it finds when it is made.
            self.socket.setsockopt(zmq.RCVHWM, self.hwm)
            set_deadlines(self.socket)
            connect_or_bind(self.socket, endpoint, "bind", "the input")
            self.endpoint: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
            self.guard = PeerGuard(self.socket, self.endpoint, max_peers, report_closed=False)
        except BaseException:
            self.close()
            raise

    def receive(self, max_frames: int, max_bytes: int = MAX_BATCH_BYTES) -> Iterator[tuple[bytes | None, int]]:
        """Up to ``max_frames`` messages already queued, without waiting, until they hold ``max_bytes``
        (the message that reaches it is the last): ``(frame, fd)``, ``frame`` None for a message of
        more than one part; ``fd`` is its connection's (``prove`` it)."""
        sock = self.socket
        taken = 0
        try:
            for _ in range(max_frames):
                if taken >= max_bytes:
                    return
                try:
                    part = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                taken += len(part)
                fd = part.get(zmq.SRCFD)
                if not part.more:
                    yield part.bytes, fd
                    continue
                while part.more:  # every part of the message is read, however many
                    part = sock.recv(copy=False)
                    taken += len(part)
                yield None, fd
        finally:
            self.largest_read = max(self.largest_read, taken)

    def prove(self, fd: int, proof: Proof) -> None:
        if self.guard is not None:
            self.guard.prove(fd, proof)

    def service(self) -> None:
        if self.guard is not None:
            self.guard.service(self.socket)

    @property
    def peer_stats(self) -> dict[str, int]:
        """The guard's counts, the high-water mark in frames and the most bytes one read took."""
        stats = self.guard.stats() if self.guard is not None else {}
        return {**stats, "hwm_frames": self.hwm, "largest_read_bytes": self.largest_read}

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close(self.socket)
            self.guard = None
        if not self.socket.closed:
            self.socket.close(linger=0)


# -- the pipes out ------------------------------------------------------------------------------------


def _outq(fd: int) -> int:
    """Bytes the kernel still holds in the socket's send queue (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))[0]


class SendQueue:
    """What this process still holds of the bytes sent on one connection (``fd``, libzmq's).

    ``sent`` counts every frame handed to ZMQ with its ZMTP header (2 bytes, 9 beyond 255) from the
    moment the connection's handshake completed. ``look()`` asks the kernel what it has taken."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.peer = peer_address(fd)
        s = socket.socket(fileno=fd)
        try:
            self.tcp = s.family in (socket.AF_INET, socket.AF_INET6)
            self._sndbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        finally:
            s.detach()
        self.sent = 0
        self._taken = 0
        self._since_look = 0
        self.queued = 0  # as of the last look
        self._base = self._written() if self.tcp else 0

    def add(self, nbytes: int) -> None:
        framed = nbytes + (2 if nbytes < 256 else 9)
        self.sent += framed
        self._since_look += framed

    @property
    def estimate(self) -> int:
        """An upper bound on what is queued now, without asking the kernel."""
        return self.queued + self._since_look

    def _written(self) -> int:
        s = socket.socket(fileno=self.fd)
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        finally:
            s.detach()
        return struct.unpack_from("Q", info, _BYTES_ACKED_OFFSET)[0] + _outq(self.fd)

    def look(self) -> int:
        """What is queued in this process now (0 once the connection is gone: libzmq dropped it)."""
        self._since_look = 0
        try:
            if peer_address(self.fd) != self.peer:  # closed, and the number reused
                raise OSError
            if self.tcp:
                self._taken = self._written() - self._base
            elif _outq(self.fd) < self._sndbuf // 2:
                self._taken = self.sent  # the kernel has room: libzmq would have written what it held
        except OSError:
            self._taken = self.sent
        self.queued = max(0, self.sent - self._taken)
        return self.queued


class Pipe:
    """One connected PUSH with its monitor and its byte bound (a scheduler's, or the error channel's)."""

    def __init__(self, context: zmq.Context, endpoint: str, what: str, *, send_hwm: int | None,
                 max_queued_bytes: int, immediate: bool, reconnect_ivl_ms: int | None = None) -> None:
        self.endpoint, self.what = endpoint, what
        self.max_queued_bytes, self.immediate = max_queued_bytes, immediate
        self.connected = self.backlogged = False
        self.queue: SendQueue | None = None
        self._fd: int | None = None
        # What was queued while no connection was there (a pipe without IMMEDIATE queues from the
        # start): all of it is this process's until a connection takes it.
        self._unconnected = 0
        self.socket = context.socket(zmq.PUSH)
        self.monitor: zmq.Socket | None = None
        try:
            self.socket.setsockopt(zmq.LINGER, 0)  # until set up: an error path never waits for anything
            if send_hwm is not None:
                self.socket.setsockopt(zmq.SNDHWM, send_hwm)
            if immediate:
                # Queue only for a connected peer: a send with no connection fails at once and the
                # request goes elsewhere, instead of waiting (and being lost) in a pipe nobody reads.
                self.socket.setsockopt(zmq.IMMEDIATE, 1)
            if reconnect_ivl_ms is not None:
                self.socket.setsockopt(zmq.RECONNECT_IVL, reconnect_ivl_ms)
            self.monitor = self.socket.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            connect_or_bind(self.socket, endpoint, "connect", what)
        except BaseException:
            self.close(linger=0)
            raise

    def events(self) -> list[int]:
        """The connection events since the last call (``zmq.EVENT_HANDSHAKE_SUCCEEDED``: connected,
        ``zmq.EVENT_DISCONNECTED``); ``connected`` follows them."""
        out = []
        while self.monitor is not None:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self._fd = int(event["value"])
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self.backlogged = False
                self.queue = self._queue()
                if self.queue is not None:
                    self.queue.sent = self._unconnected  # it leaves first, on this connection
                self._unconnected = 0
                out.append(kind)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected = False
                if not self.immediate and self.queue is not None:
                    self._unconnected = self.queue.look()  # kept for the next connection
                self.backlogged = self._unconnected >= self.max_queued_bytes
                self.queue = None  # with IMMEDIATE, libzmq drops what the pipe held
                out.append(kind)
        return out

    def _queue(self) -> SendQueue | None:
        if self._fd is None:
            return None
        try:
            return SendQueue(self._fd)
        except OSError:
            return None  # gone already: its disconnect follows

    def send(self, data: bytes) -> bool:
        """True when ZMQ took ``data``; False when the pipe is backlogged or its queue is full."""
        if self.backlogged:
            return False
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        q = self.queue
        if q is None:
            self._unconnected += len(data)
            if self._unconnected >= self.max_queued_bytes:
                self.backlogged = True
                log.warning("%s (%s) holds %.1f MiB with no connection to take it, the bound (--max-queued-mib): "
                            "nothing more goes there until it connects", self.what, self.endpoint,
                            self._unconnected / 2**20)
        else:
            q.add(len(data))
            if q.estimate >= self.max_queued_bytes and q.look() >= self.max_queued_bytes:
                self.backlogged = True
                log.warning("%s (%s) holds %.1f MiB not yet taken, the bound (--max-queued-mib): nothing more "
                            "goes there until it takes all but half of it", self.what, self.endpoint,
                            q.queued / 2**20)
        return True

    def recheck(self) -> bool:
        """For a backlogged pipe: True when it has taken all but half its bound (no longer backlogged)."""
        if not self.backlogged:
            return False
        q = self.queue
        if q is None and not self.connected:
            return False  # nothing takes what waits until a connection does
        if q is None or q.look() < self.max_queued_bytes // 2:
            self.backlogged = False
            log.info("%s (%s) takes requests again", self.what, self.endpoint)
            return True
        return False

    def set_linger(self, ms: int) -> None:
        if not self.socket.closed:
            self.socket.setsockopt(zmq.LINGER, ms)

    def close(self, linger: int | None = None) -> None:
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            if not self.socket.closed:
                with contextlib.suppress(zmq.ZMQError):  # a monitor the context already stopped
                    self.socket.disable_monitor()
            monitor.close(linger=0)
        if not self.socket.closed:
            self.socket.close(linger)
