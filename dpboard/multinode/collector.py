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
import resource
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
from dpboard.multinode.owners import (
    DEFAULT_RELEASE_AFTER,
    GONE,
    Owners,
    Speaker,
    key_nodes_from_name,
    read_key_nodes,
)
from dpboard.multinode.peers import (
    DEFAULT_MAX_PEERS,
    FD_RESERVE,
    HANDSHAKE_TIMEOUT_MS,
    MIN_PEERS,
    PEER_STATS,
    PeerGuard,
    Proof,
    peer_address,
    set_deadlines,
)
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

__all__ = ["HANDSHAKE_TIMEOUT_MS", "LOCK_DIR", "LOCK_PREFIX", "Collector", "CollectorBusyError", "board_lock_path",
           "endpoint_lock_path"]

log = logging.getLogger("dpboard.collector")

MAX_RCVHWM = 10000  # frames; a full queue makes relays drop (and count), never block
# What the queue of frames not yet drained may hold: the receive high-water mark is this over the
# board's largest frame (at most MAX_RCVHWM frames, at least 16).
RECEIVE_BUFFER_BYTES = 16 * 2**20
EXPIRE_EVERY = 1.0  # seconds between two sweeps of silent claims (a frame checks silence on its own)
REFUSED_LOG_EVERY = 10.0  # seconds between two lines about ranks refused for want of fds


def fd_shares(remote_slots: int, max_peers: int | None) -> tuple[int, int]:
    """How the fds this process has left under RLIMIT_NOFILE (less FD_RESERVE) are shared between
    the relayed ranks written at once (one fd each: the slot writer's lock) and the connections:
    ``(ranks, peers)``. Both as asked when they fit; else the ranks get at least half, the
    connections the rest (at least MIN_PEERS)."""
    peers = DEFAULT_MAX_PEERS if max_peers is None else max_peers
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return remote_slots, peers
    left = soft - len(os.listdir("/proc/self/fd")) - FD_RESERVE
    if remote_slots + peers <= left:
        return remote_slots, peers
    ranks = max(1, min(remote_slots, max(left // 2, left - peers)))
    return ranks, max(MIN_PEERS, left - ranks)


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


def _key_nodes(authorized: Any, mapping: Any) -> dict[str, frozenset[int]]:
    """Each authorized key (Z85) -> the node ids it speaks for: a ``--curve-key-nodes`` line, else its
    file's name (``node<N>.key``). A key configured for none is said once: it is held to what it
    relays first, as a plain connection is."""
    if authorized is None:
        return {}
    check_authorized_keys(authorized)
    keys = {path.stem: load_certificate(path, "authorized relay key")[0].decode("ascii")
            for path in sorted(Path(authorized).glob("*.key"))}
    listed = read_key_nodes(mapping, keys) if mapping is not None else {}
    out: dict[str, frozenset[int]] = {}
    unconfigured = []
    for name, public in keys.items():
        nodes = listed.get(name) or key_nodes_from_name(name)
        if nodes is None:
            unconfigured.append(f"{name}.key")
        else:
            out[public] = out.get(public, frozenset()) | nodes
    if unconfigured:
        log.warning("authorized relay keys %s speak for no configured node id: each is held, as a plain connection "
                    "is, to the nodes it relays first, and loses their ranks to an authenticated node; name a key "
                    "node<N>.key or list it in --curve-key-nodes", ", ".join(unconfigured))
    return out


def _ranges(values: Iterable[int]) -> str:
    """1-3, 7: a short text for a set of ranks or nodes."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


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
        curve_key_nodes: str | os.PathLike[str] | None = None,
        release_after: float = DEFAULT_RELEASE_AFTER,
    ):
        check_endpoint(bind, "the collector's bind endpoint", bind=True)
        # node0's own ranks: never written from a frame, even before node0's schedulers claim them.
        self.local_ranks = frozenset(int(r) for r in local_ranks)
        if curve_authorized_keys is not None and curve_secret_key is None:
            raise InvalidInputError("curve_authorized_keys needs curve_secret_key (the collector's own certificate)")
        if curve_key_nodes is not None and curve_authorized_keys is None:
            raise InvalidInputError("curve_key_nodes names keys of the authorized keys directory: give "
                                    "curve_authorized_keys (--curve-authorized-keys DIR) too")
        if not 0 < release_after <= 1e6:
            raise InvalidInputError(f"release_after must be in (0, 1e6] seconds, got {release_after!r}")
        self._owners = Owners(_key_nodes(curve_authorized_keys, curve_key_nodes), release_after=release_after)
        self._next_expire = 0.0
        self._locks: list[OwnerLock] = []
        self._socket: zmq.Socket | None = None
        self._guard: PeerGuard | None = None
        self._auth: Any = None
        self._stats_view: np.ndarray | None = None
        self._own_board = False  # created here: unlinked on close
        self._opened_board = False  # attached or created here (not passed in): closed on close
        self._writers: dict[int, BoardWriter] = {}  # rank -> its writer, while a node holds the rank
        self.rank_budget = MAX_SLOTS  # writers held at once (set from the fd limit below)
        self.ranks_refused = 0  # relayed ranks not written: the budget was spent
        self._refused_since_log: dict[int, set[int]] = {}  # node -> ranks refused since the last line
        self._next_refused_log = 0.0
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
            # Each relayed rank written costs an fd (its writer's lock) for as long as a node holds
            # it: the ranks and the connections share what the fd limit leaves.
            remote = self.n_slots - sum(1 for r in self.local_ranks if r < self.n_slots)
            self.rank_budget, peers = fd_shares(remote, max_peers)
            if self.rank_budget < remote:
                log.warning("%s: writes at most %d relayed ranks at once of the board's %d (one fd each; `ulimit -n` "
                            "%d, %d connections): a frame's ranks beyond that are not written; raise `ulimit -n` to "
                            "write them all", bind, self.rank_budget, remote,
                            resource.getrlimit(resource.RLIMIT_NOFILE)[0], peers)
            # On ipc too: the guard reports each closed connection, which lets go of its claims.
            self._guard = PeerGuard(self._socket, self.endpoint, peers)
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
            set_deadlines(sock)
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

    def handle_frame(self, data: bytes | memoryview, speaker: Speaker | None = None) -> int:
        """Validate one frame and publish its snapshots. Returns how many it wrote (0 for a dropped
        frame, which is counted). Never raises on the frame's content. ``speaker`` is where it came
        from (``dpboard.multinode.owners``); None for a frame the embedding process hands over."""
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
            ranks = [row[0] for row in rows]
            for rank in ranks:
                if rank in self.local_ranks:
                    raise FrameError(BAD_RANK, f"frame from node {node} names rank {rank}, which node0 writes itself")
            details = None if frame.details is None else detail_buffers(data, frame)
            room = self.rank_budget - len(self._writers)
            new = [i for i, rank in enumerate(ranks) if rank not in self._writers]
            if len(new) > room:
                rows, ranks, details = self._within_budget(node, rows, ranks, details, new[max(0, room):])
            taken = self._owners.check(speaker, node, ranks)
            writers = [self._writers.get(rank) or self._writer_for(rank) for rank in ranks]
        except FrameError as e:
            stats[e.reason] += 1
            stats["frames_bad"] += 1
            return 0
        if details is None:
            for writer, row in zip(writers, rows, strict=True):
                writer.publish_relayed(row)
        else:
            for writer, row, detail in zip(writers, rows, details, strict=True):
                writer.publish_relayed(row, detail)
        self._owners.accept(speaker, node, ranks, taken)
        if taken:
            log.info("node %d now relays ranks %s%s", node, _ranges(taken),
                     " (authenticated)" if self._owners.authenticated(speaker) else "")
        now = time.monotonic_ns()
        if self._record_latency and rows:
            self.latencies_ns.append(time.time_ns() - frame.records["timestamp_ns"])
        stats["frames_ok"] += 1
        stats["snapshots_ok"] += len(rows)
        stats["last_frame_monotonic_ns"] = now
        return len(rows)

    def _within_budget(self, node: int, rows: list, ranks: list[int], details: list | None,
                       refused: list[int]) -> tuple[list, list[int], list | None]:
        """The frame's rows less those at the indices ``refused`` (new ranks beyond the budget of
        writers): counted, and said at most once per REFUSED_LOG_EVERY."""
        out = set(refused)
        self.ranks_refused += len(out)
        self._refused_since_log.setdefault(node, set()).update(ranks[i] for i in out)
        self._say_refused()
        keep = [i for i in range(len(ranks)) if i not in out]
        return ([rows[i] for i in keep], [ranks[i] for i in keep],
                None if details is None else [details[i] for i in keep])

    def _say_refused(self) -> None:
        now = time.monotonic()
        if not self._refused_since_log or now < self._next_refused_log:
            return
        self._next_refused_log = now + REFUSED_LOG_EVERY
        said = "; ".join(f"node {node}: ranks {_ranges(ranks)}" for node, ranks in sorted(self._refused_since_log.items()))
        self._refused_since_log = {}
        log.warning("relayed ranks not written: the collector writes at most %d at once (one fd each, under `ulimit -n` "
                    "%d; %d held now) and frees one when its node lets go of it: %s (%d refused so far); raise "
                    "`ulimit -n` to write them", self.rank_budget, resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                    len(self._writers), said, self.ranks_refused)

    def _release_writers(self) -> None:
        """Close the writers of the ranks no node holds any more (their connection closed, their claim
        went silent, a frame read after its connection closed wrote them): their fds are free again."""
        gone = [rank for rank in self._writers if self._owners.owner_of(rank) is None]
        for rank in gone:
            self._writers.pop(rank).close()

    def _writer_for(self, rank: int) -> BoardWriter:
        try:
            # Not takeover: a slot that a live local scheduler writes is node0's own rank, and a
            # relay claiming it is misconfigured. A dead holder (e.g. a previous collector) is fine.
            writer = self.board.writer(rank)
        except BoardError as e:
            raise FrameError(BAD_RANK, f"rank {rank} is written locally on node0: {e}") from None
        self._writers[rank] = writer
        return writer

    def _follow_board(self) -> None:
        """Write into whichever board has the name now: a recreated board gets new writers and the
        collector's statistics (and the log says so)."""
        if self._follower is None or not self._follower.poll():
            return
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self._owners.clear()
        self.board = self._follower.board
        self.n_slots = self.board.n_slots
        if self._socket is not None:  # the bound for the connections made from now on
            self._socket.setsockopt(zmq.MAXMSGSIZE, frame_bound(self.n_slots))
        self._init_stats()

    def drain(self, max_frames: int = 4096) -> int:
        """Handle every frame already queued (at most ``max_frames``) without waiting; returns the count."""
        self._follow_board()
        sock = self.socket
        self._service()
        handled = 0
        while handled < max_frames:
            try:
                msg = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            handled += 1
            fd = msg.get(zmq.SRCFD)
            speaker = self._speaker(msg, fd)
            written = self.handle_frame(msg.buffer, speaker)
            if self._guard is not None:
                self._guard.prove(fd, Proof.VALID if written else
                                  Proof.KEY if self._owners.authenticated(speaker) else Proof.SPOKE)
        return handled

    def _speaker(self, msg: zmq.Frame, fd: int) -> Speaker:
        """Where ``msg`` came from: its connection (fd and peer address, checked now: libzmq reuses
        numbers) and, under CURVE with known keys, its key; ``GONE`` when the connection is gone."""
        try:
            connection = (fd, peer_address(fd))
        except OSError:
            return GONE
        key = None
        if self._owners.key_nodes:
            try:
                key = msg.get("User-Id")
            except zmq.ZMQError:
                key = None
        return Speaker(connection, key)

    def _service(self) -> None:
        """The guard's back-off, the claims of connections that closed, silent claims let go."""
        released = False
        if self._guard is not None:
            self._guard.service(self.socket)
            for connection in self._guard.take_closed():
                nodes = self._owners.connection_closed(connection)
                released = True
                if nodes:
                    log.info("the connection that spoke for node %s closed: its ranks are free", _ranges(nodes))
        now = time.monotonic()
        if now >= self._next_expire:
            self._next_expire = now + EXPIRE_EVERY
            self._owners.expire()
            released = True
        if released:
            self._release_writers()
        self._say_refused()

    def poll(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for frames, then drain them."""
        if self.socket.poll(timeout_ms, zmq.POLLIN):
            return self.drain()
        self._service()
        return 0

    @property
    def peer_stats(self) -> dict[str, int]:
        """The TCP peer bound: open connections, the cap, and what the guard did (zeros without one);
        the relayed ranks written now, the most written at once, and those refused beyond it."""
        g = self._guard
        ranks = {"ranks_written": len(self._writers), "rank_budget": self.rank_budget,
                 "ranks_refused": self.ranks_refused}
        return {**(dict.fromkeys(PEER_STATS, 0) if g is None else g.stats()), **ranks}

    def serve(self, stop: threading.Event | None = None, *, duration: float | None = None,
              poll_ms: int = 100) -> None:
        """Receive until ``stop`` is set or ``duration`` seconds have passed."""
        flag = StopFlag(duration, event=stop)
        while not flag.is_set():
            self.poll(int(1000 * flag.remaining(cap=poll_ms / 1000)))

    def owner_of(self, rank: int) -> int | None:
        """The node that relays ``rank`` now (None: no live claim)."""
        return self._owners.owner_of(rank)

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
    p.add_argument("--curve-key-nodes", metavar="FILE", default=None,
                   help="which node ids each authorized key speaks for, one line per key: `NAME NODE [NODE ...]` "
                        "(NAME: the key file's name without .key); without a line, a key named node<N>.key "
                        "speaks for node N; a key speaks for no other node")
    p.add_argument("--local-ranks", type=count(0, MAX_SLOTS - 1), nargs="+", default=[], metavar="RANK",
                   help="ranks node0's own schedulers write: never written from a relayed frame")
    p.add_argument("--release-after", type=seconds(), default=DEFAULT_RELEASE_AFTER, metavar="SECONDS",
                   help=f"a node id or a rank claimed by a peer that has sent nothing for it this long is let go "
                        f"(default {DEFAULT_RELEASE_AFTER:g}); a closed connection lets go of its claims at once")
    p.add_argument("--max-peers", type=count(1, 2**20), default=None,
                   help=f"connections held at once (default {DEFAULT_MAX_PEERS}, and never more than the fds "
                        f"`ulimit -n` leaves less 64, shared with the relayed ranks written, one fd each); beyond "
                        f"it those that proved the least are closed first, an established relay last")
    p.add_argument("--duration", type=seconds(), default=None, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true", help="no periodic status line")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    with StopFlag(args.duration) as stop, Collector(
        args.board, args.bind, n_slots=args.n_slots, curve_secret_key=args.curve_secret_key,
        curve_authorized_keys=args.curve_authorized_keys, local_ranks=args.local_ranks,
        max_peers=args.max_peers, curve_key_nodes=args.curve_key_nodes, release_after=args.release_after,
    ) as collector:
        print(f"dpboard collect: pid {os.getpid()} owns {collector.endpoint} for board {args.board!r} "
              f"({collector.n_slots} slots)", flush=True)
        next_report = time.monotonic() + 5.0
        while not stop.is_set():
            collector.poll(int(1000 * stop.remaining(cap=0.1)))
            if not args.quiet and time.monotonic() >= next_report:
                s, p = collector.stats(), collector.peer_stats
                print(f"frames {s['frames_ok']} ok, {s['frames_bad']} bad; snapshots {s['snapshots_ok']}; "
                      f"peers {p['peers']}/{p['max_peers']}, {p['shed']} closed; relayed ranks "
                      f"{p['ranks_written']}/{p['rank_budget']}, {p['ranks_refused']} refused", flush=True)
                next_report += 5.0
    return 0
