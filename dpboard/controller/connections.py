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
  buffer has room, which means libzmq has written what it had time to (what was sent less than
  ``ROOM_GRACE`` before still counts). The pipe keeps each frame's item (a request's rid) until the
  frame is shown to have left the process: ``unsent`` names those a stop would drop.
- ``BoundedLog``: malformed frames and refused requests are logged with at most ``TEXT_MAX``
  characters of their rid and reason, and at most ``LOG_BURST`` lines per ``LOG_WINDOW`` seconds;
  the rest is counted and summed up in one line.
- ``Connections``: the controller's input, its schedulers' pipes and its error channel, opened
  together (the endpoints checked first, the input's single-owner lock taken) and closed together.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from dpboard.errors import UnavailableError
from dpboard.multinode.peers import PeerGuard, Proof, peer_address, set_deadlines
from dpboard.ownership import OwnerBusyError, OwnerLock, check_endpoint, take_endpoint

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
# Over a Unix socket a frame handed to ZMQ this long ago counts as written once the kernel's buffer
# has room: libzmq's I/O thread takes microseconds to write what a send queued; a loaded machine
# may take milliseconds.
ROOM_GRACE = 0.01
LOOK_EVERY = 256  # sends on a pipe between two looks at its kernel queue, at most
# ZMQ reconnects a broken pipe after this long, more than the loop's longest poll: the controller
# always sees a disconnect before the same rank can take requests again (docs/DISPATCH.md, Delivery).
RECONNECT_IVL_MS = 250

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


def framed_size(nbytes: int) -> int:
    """A frame's bytes on the wire: its ZMTP header is 2 bytes, 9 beyond 255."""
    return nbytes + (2 if nbytes < 256 else 9)


def _outq(fd: int) -> int:
    """Bytes the kernel still holds in the socket's send queue (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))[0]


class SendQueue:
    """What this process still holds of the bytes sent on one connection (``fd``, libzmq's).

    ``sent`` counts every frame handed to ZMQ with its ZMTP header (2 bytes, 9 beyond 255) from the
    moment the connection's handshake completed. ``look()`` asks the kernel what it has taken: over
    TCP exactly (the peer's acknowledgements plus the kernel's send queue); over a Unix socket, whose
    kernel counts nothing cumulative, a frame counts as taken once the kernel's buffer has room and
    the frame was handed over at least ``ROOM_GRACE`` before (libzmq's I/O thread writes a frame some
    time after the send: a look right after a burst sees an empty buffer and nothing written yet)."""

    def __init__(self, fd: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.peer = peer_address(fd)
        s = socket.socket(fileno=fd)
        try:
            self.tcp = s.family in (socket.AF_INET, socket.AF_INET6)
            self._sndbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        finally:
            s.detach()
        self._clock = clock
        self.sent = 0
        self._taken = 0
        self._since_look = 0
        self.queued = 0  # as of the last look
        self.gone = False  # the connection closed under the last look: libzmq dropped what it held
        # Unix sockets: (when, sent by then), at most one a quarter of ROOM_GRACE apart; the oldest
        # kept is the latest at least ROOM_GRACE old
        self._marks: deque[tuple[float, int]] = deque()
        self._mark_opened = float("-inf")
        self._base = self._written() if self.tcp else 0

    def carry(self, nbytes: int) -> None:
        """``nbytes`` (framed) queued before this connection came: they leave first, on it."""
        self.sent = nbytes
        self._mark()

    def add(self, nbytes: int) -> None:
        framed = framed_size(nbytes)
        self.sent += framed
        self._since_look += framed
        if not self.tcp:
            self._mark()

    def _mark(self) -> None:
        now = self._clock()
        marks = self._marks
        if now - self._mark_opened < ROOM_GRACE / 4:
            marks[-1] = (now, self.sent)  # later, so never older than what it covers
        else:
            marks.append((now, self.sent))
            self._mark_opened = now
        cutoff = now - ROOM_GRACE
        while len(marks) > 1 and marks[1][0] <= cutoff:
            marks.popleft()

    def _aged(self) -> int:
        """Bytes handed to ZMQ at least ``ROOM_GRACE`` ago."""
        cutoff = self._clock() - ROOM_GRACE
        marks = self._marks
        while len(marks) > 1 and marks[1][0] <= cutoff:
            marks.popleft()
        return marks[0][1] if marks and marks[0][0] <= cutoff else 0

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
                # the kernel has room: what libzmq had time to write, it wrote
                self._taken = max(self._taken, self._aged())
        except OSError:
            self.gone = True
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
        # What was handed to ZMQ and not yet shown to have left this process, oldest first: (where
        # the frame ends in ``_total``, the caller's item), so that a stop can say which they were.
        self._pending: deque[tuple[int, Any]] = deque()
        self._total = 0  # framed bytes ever handed to ZMQ on this pipe
        self._unlooked = 0  # sends since the kernel was last asked
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
                    self.queue.carry(self._unconnected)  # it leaves first, on this connection
                    self._unconnected = 0
                out.append(kind)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected = False
                if not self.immediate and self.queue is not None:
                    self._unconnected = self.queue.look()  # kept for the next connection
                else:
                    self._pending.clear()  # with IMMEDIATE, libzmq drops what the pipe held
                self.backlogged = self._unconnected >= self.max_queued_bytes
                self.queue = None
                out.append(kind)
        return out

    def _queue(self) -> SendQueue | None:
        if self._fd is None:
            return None
        try:
            return SendQueue(self._fd)
        except OSError:
            return None  # gone already: its disconnect follows

    def send(self, data: bytes, item: Any = None) -> bool:
        """True when ZMQ took ``data``; False when the pipe is backlogged or its queue is full.
        ``item`` (a request, a rid) is kept until the frame has left this process (``unsent``)."""
        if self.backlogged:
            return False
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._total += framed_size(len(data))
        self._pending.append((self._total, item))
        q = self.queue
        if q is None:
            self._unconnected += framed_size(len(data))
            if self._unconnected >= self.max_queued_bytes:
                self.backlogged = True
                log.warning("%s (%s) holds %.1f MiB with no connection to take it, the bound (--max-queued-mib): "
                            "nothing more goes there until it connects", self.what, self.endpoint,
                            self._unconnected / 2**20)
        else:
            q.add(len(data))
            self._unlooked += 1
            # a look every LOOK_EVERY sends lets go of what has left: small frames stay few
            if ((q.estimate >= self.max_queued_bytes or self._unlooked >= LOOK_EVERY)
                    and self._look() >= self.max_queued_bytes):
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
        if q is None or self._look() < self.max_queued_bytes // 2:
            self.backlogged = False
            log.info("%s (%s) takes requests again", self.what, self.endpoint)
            return True
        return False

    def _look(self) -> int:
        """What this process holds for the pipe now (asking the kernel); what has left is let go."""
        q = self.queue
        self._unlooked = 0
        held = self._unconnected if q is None else q.look()
        if q is not None and q.gone:
            return held  # closed under it: what was pending went with the connection, not out of it
        left = self._total - held
        pending = self._pending
        while pending and pending[0][0] <= left:
            pending.popleft()
        return held

    def leaving(self) -> bool:
        """Whether frames not yet shown to have left this process may still leave (asking the kernel
        now): some are pending, and the connection they wait on is not gone."""
        self._look()
        q = self.queue
        return bool(self._pending) and not (q is not None and q.gone) and (q is not None or not self.immediate)

    def unsent(self) -> list[Any]:
        """The items of the frames not shown to have left this process (asking the kernel now):
        what ZMQ still holds, or dropped with a connection that closed under it."""
        self._look()
        return [item for _, item in self._pending]

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


# -- all of them ----------------------------------------------------------------------------------------


class ControllerBusyError(OwnerBusyError):
    """Another process already binds the controller's input endpoint, or already controls its board."""


class Connections:
    """The controller's sockets, opened together and closed together (``close``): the input it binds
    (``input``; one process per endpoint, a lock under /dev/shm: a second controller fails at start
    naming the first), a ``Pipe`` to each worker slot's scheduler (``workers``; None for a reserved
    slot, ``ranks`` are the others) and, with an error endpoint, the error channel (``errors``).
    The bounds: ``max_peers`` connections on the input and ``max_input_bytes`` received and not yet
    read per connection; ``send_hwm`` requests and ``max_queued_bytes`` queued per scheduler, the
    same bytes for the answers. Every endpoint is checked before anything opens; what a failure
    leaves open is closed at once. ``context``: the caller's (None: one of its own, terminated
    at the close)."""

    def __init__(self, context: zmq.Context | None, worker_endpoints: Sequence[str | None], input_endpoint: str,
                 error_endpoint: str | None, *, send_hwm: int, max_queued_bytes: int, max_input_bytes: int,
                 max_peers: int | None) -> None:
        check_endpoint(input_endpoint, "the input endpoint", bind=True)
        for rank, endpoint in enumerate(worker_endpoints):
            if endpoint is not None:
                check_endpoint(endpoint, f"the endpoint of worker {rank}", bind=False)
        if error_endpoint is not None:
            check_endpoint(error_endpoint, "the error endpoint", bind=False)
        self.worker_endpoints = list(worker_endpoints)
        self.error_endpoint = error_endpoint
        self.ranks = [r for r, e in enumerate(self.worker_endpoints) if e is not None]
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.input: RequestInput | None = None
        self.workers: list[Pipe | None] = [None] * len(self.worker_endpoints)
        self.errors: Pipe | None = None
        self._lock: OwnerLock | None = None
        try:
            self._lock = take_endpoint(input_endpoint, busy=ControllerBusyError)
            self.input = RequestInput(self.context, input_endpoint, max_peers=max_peers,
                                      max_input_bytes=max_input_bytes)
            for rank in self.ranks:
                self.workers[rank] = Pipe(self.context, self.worker_endpoints[rank], f"worker {rank}",
                                          send_hwm=send_hwm, max_queued_bytes=max_queued_bytes, immediate=True,
                                          reconnect_ivl_ms=RECONNECT_IVL_MS)
            if error_endpoint is not None:
                self.errors = Pipe(self.context, error_endpoint, "the error channel", send_hwm=None,
                                   max_queued_bytes=max_queued_bytes, immediate=False)
        except BaseException:
            self.close(linger=0)
            raise
        for pipe in self.pipes():  # a clean close gives queued requests and answers a second to leave
            pipe.set_linger(1000)

    def pipes(self) -> list[Pipe]:
        """The open pipes: the workers', then the error channel."""
        return [p for p in [*self.workers, self.errors] if p is not None]

    def close(self, linger: int | None = None) -> None:
        """Everything opened so far (the pipes with their linger; ``linger=0``, an error path, waits
        for nothing), the context where it is this object's, then the input's lock."""
        for pipe in self.pipes():
            pipe.close(linger)
        self.workers[:] = [None] * len(self.workers)
        self.errors = None
        if self.input is not None:
            self.input.close()
            self.input = None
        if self._own_context and not self.context.closed:
            self.context.term()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
