"""``dpboard collect``: node0's single owner of the relay PULL socket.

The collector receives the relays' frames (dpboard.multinode.wire), validates every one, and writes the
snapshots they carry (with their detail, when the frame has one) into node0's board with
``publish_relayed``: the snapshot keeps the writer's
wall-clock time, publish counter, pid and node id, and gets node0's own monotonic receive time, so
that staleness on node0 means "time since node0 last heard of this rank" whatever the other nodes'
clocks say.

Exactly one collector may own a board and an endpoint. ZMQ itself does not enforce that (a second
``ipc://`` bind silently steals the path from the first), so ownership is an exclusive ``flock`` on
one lock file per board and one per endpoint under /dev/shm; a second owner fails at start with an
error naming the first one's pid. Locks die with their process, so a killed collector never blocks
its own restart; a clean exit also removes the lock files.

Embedding (the controller owns the socket when its method is load-aware)::

    collector = Collector(board, "tcp://10.0.0.1:5757")
    poller.register(collector.socket, zmq.POLLIN)   # in the owner's own event loop
    ...
    collector.drain()                               # whenever the socket is readable
    collector.close()

or ``collector.serve(stop_event)`` in a thread or process of its own.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dpboard.board import MAX_SLOTS, Board, BoardError, BoardFollower, BoardWriter, process_start_ticks
from dpboard.errors import AccessDeniedError, InvalidInputError, NotFoundError
from dpboard.multinode.curve import check_authorized_keys, load_certificate
from dpboard.multinode.peers import DEFAULT_MAX_PEERS, PeerGuard
from dpboard.multinode.wire import (
    BAD_IDENTITY,
    BAD_NODE,
    BAD_RANK,
    BAD_REASONS,
    DETAILED_RECORD_SIZE,
    HEADER_SIZE,
    FrameError,
    detail_buffers,
    unpack_frame,
    validate_records,
)
from dpboard.options import count, seconds
from dpboard.ownership import (
    LOCK_DIR,
    LOCK_PREFIX,
    OwnerBusyError,
    OwnerLock,
    check_endpoint,
    endpoint_lock_path,
    lock_path,
    take_endpoint,
)
from dpboard.snapshot import COLLECTOR_STATS_FIELDS
from dpboard.stopping import StopFlag

__all__ = ["LOCK_DIR", "LOCK_PREFIX", "Collector", "CollectorBusyError", "board_lock_path", "endpoint_lock_path"]

log = logging.getLogger("dpboard.collector")

MAX_RCVHWM = 10000  # frames; a full queue makes relays drop (and count), never block
# What the queue of frames not yet drained may hold: the receive high-water mark is this over the
# board's largest frame (at most MAX_RCVHWM frames, at least 16).
RECEIVE_BUFFER_BYTES = 16 * 2**20
# A connection that has not finished its ZMTP (and CURVE) handshake by then is closed: libzmq's own
# default is 30 s, long enough for silent peers to pile up. A relay's handshake takes a few round trips.
HANDSHAKE_TIMEOUT_MS = 5000
# The collector pings its peers too: one that completed a handshake and then never answers goes.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


def frame_bound(n_slots: int) -> int:
    """The largest relay frame a board of ``n_slots`` slots can receive: every slot, with detail."""
    return HEADER_SIZE + n_slots * DETAILED_RECORD_SIZE


def receive_hwm(n_slots: int) -> int:
    return max(16, min(MAX_RCVHWM, RECEIVE_BUFFER_BYTES // frame_bound(n_slots)))


# -- ownership ------------------------------------------------------------------------------------


class CollectorBusyError(OwnerBusyError):
    """Another live collector (or controller) already owns the board or the endpoint."""


def board_lock_path(board_name: str) -> Path:
    return lock_path("collector.board", board_name)


# -- the collector ----------------------------------------------------------------------------------


class Collector:
    """The single owner of node0's relay PULL socket; writes relayed snapshots into ``board``.

    ``board`` is a Board or a board name (attached; created with ``n_slots`` slots when it does not
    exist and ``n_slots`` is given). ``bind`` is an explicit ZMQ endpoint, e.g. ``tcp://10.0.0.1:5757``
    (``tcp://127.0.0.1:*`` picks a free port; ``endpoint`` tells which).
    """

    def __init__(
        self,
        board: Board | str,
        bind: str,
        *,
        n_slots: int | None = None,
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_authorized_keys: str | os.PathLike[str] | None = None,
        rcvhwm: int | None = None,
        context: zmq.Context | None = None,
        record_latency: bool = False,
        local_ranks: Iterable[int] = (),
        max_peers: int | None = None,
    ):
        check_endpoint(bind, "the collector's bind endpoint", bind=True)
        # node0's own ranks: never written from a frame, even before node0's schedulers claim them.
        self.local_ranks = frozenset(int(r) for r in local_ranks)
        self._rank_nodes: dict[int, int] = {}  # rank -> the node that announced it first
        if curve_authorized_keys is not None and curve_secret_key is None:
            raise InvalidInputError("curve_authorized_keys needs curve_secret_key (the collector's own certificate)")
        self._locks: list[OwnerLock] = []
        self._socket: zmq.Socket | None = None
        self._guard: PeerGuard | None = None
        self._auth: Any = None
        self._stats_view: np.ndarray | None = None
        self._own_board = False  # created here: unlinked on close
        self._opened_board = False  # attached or created here (not passed in): closed on close
        self._writers: dict[int, BoardWriter] = {}
        self._follower: BoardFollower | None = None
        self._closed = False
        self.latencies_ns: list[np.ndarray] = []  # with record_latency: receive-side age of each snapshot
        self._record_latency = record_latency
        board_name = board.name if isinstance(board, Board) else board
        try:
            self._locks.append(OwnerLock(
                board_lock_path(board_name), f"board {board_name!r}", busy=CollectorBusyError, role="a collector",
                hint="only one process may own the relay PULL socket: stop that one, or embed its Collector "
                     "instead of starting another"))
            # A free TCP port is unique by construction; every other endpoint gets its lock.
            endpoint_lock = take_endpoint(bind, busy=CollectorBusyError)
            if endpoint_lock is not None:
                self._locks.append(endpoint_lock)
            if isinstance(board, Board):
                self.board = board
            else:
                self.board = self._open_board(board, n_slots)
                self._opened_board = True
            if self.board.read_only:
                raise AccessDeniedError(f"board {board_name!r} is another user's and read-only here: run the "
                                        f"collector as its owner")
            self._initial_board = self.board
            # node0's board may be recreated under the collector (its schedulers restarted): follow it
            self._follower = BoardFollower(self.board, logger=log)
            self.n_slots = self.board.n_slots
            # An authenticator binds inproc://zeromq.zap.01 on its context, once per context: a
            # collector that admits known relays only has a context of its own (closed with it),
            # so that another one, later in this process, never finds that name still taken.
            self._own_context = context is None and curve_authorized_keys is not None
            self._context = zmq.Context() if self._own_context else (context or zmq.Context.instance())
            self._socket = self._bind(bind, curve_secret_key, curve_authorized_keys, rcvhwm)
            self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.endpoint.startswith("tcp://"):  # what a network peer reaches; ipc is a file's mode
                self._guard = PeerGuard(self._socket, self.endpoint, max_peers)
            self._init_stats()
        except BaseException:
            self.close()
            raise

    def _open_board(self, name: str, n_slots: int | None) -> Board:
        try:
            return Board.attach(name, n_slots=n_slots)
        except FileNotFoundError:
            if n_slots is None:
                raise NotFoundError(
                    f"board {name!r} does not exist: start node0's schedulers (or the controller) first, "
                    f"or give the collector --n-slots to create it"
                ) from None
        board = Board.create(name, n_slots=n_slots, exist_ok=True)
        self._own_board = board.is_owner
        return board

    def _bind(self, bind: str, secret_key: Any, authorized: Any, rcvhwm: int | None) -> zmq.Socket:
        sock = self._context.socket(zmq.PULL)
        try:
            # No CONFLATE: it keeps one message for the whole socket, not one per peer, and would drop
            # other nodes' frames. The board itself keeps the latest record per rank.
            sock.setsockopt(zmq.RCVHWM, receive_hwm(self.n_slots) if rcvhwm is None else rcvhwm)
            sock.setsockopt(zmq.LINGER, 0)
            # Anything larger cannot be a frame for this board; ZMQ cuts such a peer off instead of
            # buffering it.
            sock.setsockopt(zmq.MAXMSGSIZE, frame_bound(self.n_slots))
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            if secret_key is not None:
                public, secret = load_certificate(secret_key, "collector certificate")
                if secret is None:
                    raise InvalidInputError(f"{secret_key} holds only a public key: give the .key_secret file")
                if authorized is not None:
                    from zmq.auth.thread import ThreadAuthenticator

                    check_authorized_keys(authorized)
                    self._auth = ThreadAuthenticator(self._context)
                    self._auth.start()
                    self._auth.configure_curve(domain="*", location=str(authorized))
                sock.curve_secretkey = secret
                sock.curve_publickey = public
                sock.curve_server = True
            try:
                sock.bind(bind)
            except zmq.ZMQError as e:
                if e.errno == errno.EADDRINUSE:
                    raise CollectorBusyError(
                        f"endpoint {bind} is in use by another process (not a dpboard collector on this "
                        f"machine's lock files): pick another port, or stop that process"
                    ) from None
                raise InvalidInputError(f"cannot bind {bind}: {e.strerror}") from None
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _init_stats(self) -> None:
        view = self.board.collector_stats_record()
        view[0] = 0
        pid = os.getpid()
        view["collector_start_ticks"] = process_start_ticks(pid)
        view["collector_pid"] = pid
        self._stats_view = view

    # -- the socket -------------------------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket:
        """The PULL socket, to register in an embedding process's poller."""
        if self._socket is None:
            raise InvalidInputError("the collector is closed")
        return self._socket

    @property
    def lock_paths(self) -> list[Path]:
        return [lock.path for lock in self._locks]

    def handle_frame(self, data: bytes | memoryview) -> int:
        """Validate one frame and publish its snapshots. Returns how many it wrote (0 for a dropped
        frame, which is counted). Never raises on the frame's content."""
        stats = self._stats_view
        assert stats is not None
        try:
            frame = unpack_frame(data)
            if frame.board != self.board.name:
                raise FrameError(
                    BAD_IDENTITY, f"frame for board {frame.board!r}, this collector writes {self.board.name!r}"
                )
            if frame.node_id == self.board.node_id:
                raise FrameError(BAD_NODE, f"frame claims node {frame.node_id}, which is this board's own node")
            validate_records(frame, n_slots=self.n_slots)
            rows = frame.records.tolist()
            node = frame.node_id
            for row in rows:
                if self._rank_nodes.get(row[0], node) != node or row[0] in self.local_ranks:
                    raise FrameError(BAD_RANK, self._foreign_rank(row[0], node))
            writers = [self._writers.get(row[0]) or self._writer_for(row[0], node) for row in rows]
        except FrameError as e:
            stats[e.reason] += 1
            stats["frames_bad"] += 1
            return 0
        if frame.details is None:
            for writer, row in zip(writers, rows, strict=True):
                writer.publish_relayed(row)
        else:
            for writer, row, detail in zip(writers, rows, detail_buffers(data, frame), strict=True):
                writer.publish_relayed(row, detail)
        now = time.monotonic_ns()
        if self._record_latency and rows:
            self.latencies_ns.append(time.time_ns() - frame.records["timestamp_ns"])
        stats["frames_ok"] += 1
        stats["snapshots_ok"] += len(rows)
        stats["last_frame_monotonic_ns"] = now
        return len(rows)

    def _foreign_rank(self, rank: int, node: int) -> str:
        if rank in self.local_ranks:
            return f"frame from node {node} names rank {rank}, which node0 writes itself"
        return f"frame from node {node} names rank {rank}, which node {self._rank_nodes[rank]} relays"

    def _writer_for(self, rank: int, node: int) -> BoardWriter:
        try:
            # Not takeover: a slot that a live local scheduler writes is node0's own rank, and a
            # relay claiming it is misconfigured. A dead holder (e.g. a previous collector) is fine.
            writer = self.board.writer(rank)
        except BoardError as e:
            raise FrameError(BAD_RANK, f"rank {rank} is written locally on node0: {e}") from None
        self._writers[rank] = writer
        self._rank_nodes[rank] = node  # announced: from now on only that node writes the rank
        return writer

    def _follow_board(self) -> None:
        """Write into whichever board has the name now: a recreated board gets new writers and the
        collector's statistics (and the log says so)."""
        if self._follower is None or not self._follower.poll():
            return
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._rank_nodes.clear()
        self.board = self._follower.board
        self.n_slots = self.board.n_slots
        if self._socket is not None:  # the bound for the connections made from now on
            self._socket.setsockopt(zmq.MAXMSGSIZE, frame_bound(self.n_slots))
        self._init_stats()

    def drain(self, max_frames: int = 4096) -> int:
        """Handle every frame already queued (at most ``max_frames``) without waiting; returns the count."""
        self._follow_board()
        sock = self.socket
        if self._guard is not None:
            self._guard.service(sock)
        handled = 0
        while handled < max_frames:
            try:
                data = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.handle_frame(data.buffer)
            handled += 1
        return handled

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for frames, then drain them."""
        if self.socket.poll(timeout_ms, zmq.POLLIN):
            return self.drain()
        if self._guard is not None:
            self._guard.service(self.socket)
        return 0

    @property
    def peer_stats(self) -> dict[str, int]:
        """The TCP peer bound: open connections, the cap, and what the guard did (zeros without one)."""
        g = self._guard
        if g is None:
            return {"peers": 0, "max_peers": 0, "shed": 0, "accept_failures": 0, "pauses": 0}
        return {"peers": g.open_peers, "max_peers": g.max_peers, "shed": g.shed,
                "accept_failures": g.accept_failures, "pauses": g.pauses}

    def serve(self, stop: threading.Event | None = None, *, duration: float | None = None,
              poll_ms: int = 100) -> None:
        """Receive until ``stop`` is set or ``duration`` seconds have passed."""
        flag = StopFlag(duration, event=stop)
        while not flag.is_set():
            self.poll(int(1000 * flag.remaining(cap=poll_ms / 1000)))

    def stats(self) -> dict[str, int]:
        if self._stats_view is None:
            return dict.fromkeys(COLLECTOR_STATS_FIELDS, 0)
        rec = self._stats_view[0]
        return {name: int(rec[name]) for name in COLLECTOR_STATS_FIELDS}

    # -- life cycle -------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.close(self._socket)
            self._guard = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if getattr(self, "_own_context", False):
            self._context.term()
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._stats_view = None
        board = getattr(self, "_initial_board", None)
        if board is not None:
            if self._opened_board:
                board.close()
            if self._own_board:
                board.unlink()  # that incarnation only: a board recreated since then stays
        if self._follower is not None:
            self._follower.close()  # boards it attached in place of a replaced one
        for lock in reversed(self._locks):
            lock.release()
        self._locks = []

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Collector(board={self.board.name!r}, endpoint={getattr(self, 'endpoint', None)!r})"


assert set(BAD_REASONS) <= set(COLLECTOR_STATS_FIELDS)


# -- the command --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--board", required=True, help="node0's board (the name every node's relay uses)")
    p.add_argument("--bind", required=True,
                   help="explicit endpoint to bind, e.g. tcp://10.0.0.1:5757 (no wildcard by default)")
    p.add_argument("--n-slots", type=count(1, MAX_SLOTS), default=None,
                   help="create the board with this many slots if it does not exist yet")
    p.add_argument("--curve-secret-key", metavar="FILE", default=None,
                   help="this collector's CURVE certificate (.key_secret): encrypt and authenticate relays")
    p.add_argument("--curve-authorized-keys", metavar="DIR", default=None,
                   help="directory of the relays' public certificates allowed in (default: any relay that "
                        "knows the server key)")
    p.add_argument("--local-ranks", type=count(0, MAX_SLOTS - 1), nargs="+", default=[], metavar="RANK",
                   help="ranks node0's own schedulers write: never written from a relayed frame")
    p.add_argument("--max-peers", type=count(1, 2**20), default=None,
                   help=f"TCP connections held at once (default {DEFAULT_MAX_PEERS}, and never more than the "
                        f"fds `ulimit -n` leaves); beyond it the quietest are closed")
    p.add_argument("--duration", type=seconds(), default=None, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true", help="no periodic status line")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    with StopFlag(args.duration) as stop, Collector(
        args.board, args.bind, n_slots=args.n_slots, curve_secret_key=args.curve_secret_key,
        curve_authorized_keys=args.curve_authorized_keys, local_ranks=args.local_ranks,
        max_peers=args.max_peers,
    ) as collector:
        print(f"dpboard collect: pid {os.getpid()} owns {collector.endpoint} for board {args.board!r} "
              f"({collector.n_slots} slots)", flush=True)
        next_report = time.monotonic() + 5.0
        while not stop.is_set():
            collector.poll(int(1000 * stop.remaining(cap=0.1)))
            if not args.quiet and time.monotonic() >= next_report:
                s, p = collector.stats(), collector.peer_stats
                print(f"frames {s['frames_ok']} ok, {s['frames_bad']} bad; snapshots {s['snapshots_ok']}; "
                      f"peers {p['peers']}/{p['max_peers']}, {p['shed']} closed", flush=True)
                next_report += 5.0
    return 0
