"""``dpboard relay``: forward a non-node0 node's board to node0's collector.

Every tick (default 2 ms) the relay reads the node's local board in one ``read_detailed_array()``
(fields and detail of each slot, one consistent read), picks the
slots this node writes (``node_id`` equal to ``--node-id``, optionally limited to ``--ranks``) whose
``publish_seq`` moved since the last frame that left, and sends them as one frame (dpboard.multinode.wire) on a
ZMQ PUSH socket; the frame carries the slots' detail when any of them holds one. Sending never blocks: with no connected collector or a full pipe the frame is
dropped and counted, and its slots stay "changed" so that the next tick carries them again.

ZMQ reconnects by itself when node0's collector restarts; the relay watches its socket's connect
events and then resends every slot that is live here, so a fresh collector has the whole node at
once instead of only the ranks that happen to change. Slots that are stale here are not resent:
their ranks must look stale on node0 too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from dpboard.board import DEFAULT_STALE_AFTER, MAX_SLOTS, Board, BoardFollower
from dpboard.board.stale import stale_after
from dpboard.errors import InvalidInputError
from dpboard.multinode.curve import generate_certificates, load_certificate
from dpboard.multinode.wire import pack_board_rows
from dpboard.options import count, milliseconds, seconds
from dpboard.ownership import check_endpoint
from dpboard.snapshot import DETAILED_DTYPE, SlotStatus
from dpboard.stopping import StopFlag

log = logging.getLogger("dpboard.relay")

# Chosen from `dpboard bench relay`'s sampled age of node0's copy (docs/MULTINODE.md, "Choosing the
# tick"): 2 ms keeps what the controller reads about 2 ms fresher at p99 than 5 ms, for 2.5x the frames.
DEFAULT_TICK_MS = 2.0
DEFAULT_SNDHWM = 16  # frames queued toward node0 before the relay drops; 32 ms at the default tick
MAX_SNDHWM = 1_000_000


def parse_ranks(text: str, n_slots: int = MAX_SLOTS) -> list[int]:
    """``"0-7"``, ``"3"``, ``"0-3,8-11"`` -> sorted rank list, every rank below ``n_slots``.

    The bounds are checked before any range is expanded: ``0-20000000`` is refused at once."""
    spans: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            part = part.strip()
            lo, sep, hi = part.partition("-")
            first, last = int(lo), int(hi) if sep else int(lo)
            if first > last:
                raise ValueError
            spans.append((first, last))
    except ValueError:
        raise InvalidInputError(f"--ranks {text!r} is not a rank list: use forms like 8-15 or 8-11,16-19") from None
    if min(first for first, _ in spans) < 0:
        raise InvalidInputError(f"--ranks {text!r} must name ranks >= 0")
    top = max(last for _, last in spans)
    if top >= n_slots:
        raise InvalidInputError(f"--ranks {text!r} names rank {top}, but the board has {n_slots} slots "
                                f"(ranks 0..{n_slots - 1})")
    ranks: set[int] = set()
    for first, last in spans:
        ranks.update(range(first, last + 1))
    return sorted(ranks)


class Relay:
    """Forwards this node's slots to node0's collector at ``to`` (``tcp://NODE0:PORT``).

    ``board`` is a Board or the name of the node's local board. ``remote_board`` is the name of
    node0's board that the frames are for (default: the same name). ``tick()`` does one round and
    can be driven by an embedding loop; ``run()`` ticks until stopped.
    """

    def __init__(
        self,
        board: Board | str,
        to: str,
        node_id: int,
        *,
        tick_ms: float = DEFAULT_TICK_MS,
        ranks: Iterable[int] | None = None,
        remote_board: str | None = None,
        stale_after: float = DEFAULT_STALE_AFTER,
        sndhwm: int = DEFAULT_SNDHWM,
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_server_key: str | os.PathLike[str] | None = None,
        context: zmq.Context | None = None,
    ):
        check_endpoint(to, "--to (node0's collector endpoint)", bind=False)
        if not isinstance(node_id, int) or node_id < 0:
            raise InvalidInputError(f"node_id must be an integer >= 0, got {node_id!r}")
        if not 0 < tick_ms <= 1e6:
            raise InvalidInputError(f"tick_ms must be in (0, 1e6], got {tick_ms!r}")
        if isinstance(sndhwm, bool) or not isinstance(sndhwm, int) or not 1 <= sndhwm <= MAX_SNDHWM:
            raise InvalidInputError(f"sndhwm must be an int in 1..{MAX_SNDHWM} (frames queued), got {sndhwm!r}")
        if curve_secret_key is not None and curve_server_key is None:
            raise InvalidInputError("a CURVE client key needs the collector's public key too (curve_server_key)")
        self._opened_board = not isinstance(board, Board)  # attached here: closed on close
        self.board = Board.attach(board) if self._opened_board else board
        self._initial_board = self.board
        # the node's board may be recreated under the relay (its schedulers restarted): follow it
        self._follower = BoardFollower(self.board, min_slots=1, logger=log)
        self._stale_after = stale_after
        self.node_id = node_id
        self.to = to
        self.tick_s = tick_ms / 1e3
        self.remote_board = remote_board or self.board.name
        n = self.board.n_slots
        self._reader = self.board.reader(stale_after=stale_after)
        self._new_rows(n)
        self._mask = np.ones(n, dtype=bool)
        if ranks is not None:
            ranks = list(ranks)
            bad = [r for r in ranks if not 0 <= r < n]
            if bad:
                raise InvalidInputError(f"ranks {bad} are outside board {self.board.name!r}'s ranks 0..{n - 1}")
            self._mask = np.zeros(n, dtype=bool)
            self._mask[ranks] = True
        self._last_sent = np.full(n, -1, dtype=np.int64)
        self._resync = True
        self.ticks = self.frames_sent = self.snapshots_sent = self.frames_dropped = self.connects = 0
        self._frame_seq = 0
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._monitor: zmq.Socket | None = None
        try:
            s = self._socket
            s.setsockopt(zmq.SNDHWM, sndhwm)
            s.setsockopt(zmq.LINGER, 0)
            # Queue only toward a collector that is really there: frames sent while node0 is down
            # would otherwise wait in ZMQ and arrive stale after it comes back.
            s.setsockopt(zmq.IMMEDIATE, 1)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            # Heartbeats find a node0 that vanished without closing the connection (host or link down).
            s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            if curve_server_key is not None:
                server_public, _ = load_certificate(curve_server_key, "collector public key")
                if curve_secret_key is not None:
                    public, secret = load_certificate(curve_secret_key, "relay certificate")
                    if secret is None:
                        raise InvalidInputError(f"{curve_secret_key} holds only a public key: give the .key_secret file")
                else:
                    public, secret = zmq.curve_keypair()  # anonymous client: enough when node0 allows any
                s.curve_secretkey = secret
                s.curve_publickey = public
                s.curve_serverkey = server_public
            self._monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED)
            s.connect(to)
        except BaseException:
            self.close()
            raise

    def _new_rows(self, n_slots: int) -> None:
        """The array each tick reads the board into, and a view of its detail flags."""
        self._detailed = np.zeros(n_slots, DETAILED_DTYPE)
        self._detail_flags = self._detailed["detail"]["flags"]

    def _check_connects(self) -> None:
        mon = self._monitor
        while mon is not None:
            try:
                event = recv_monitor_message(mon, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            # Handshake done means the pipe is attached: a new collector is there to fill.
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connects += 1
                self._resync = True

    def _follow_board(self) -> None:
        if not self._follower.poll():
            return
        board = self._follower.board
        n = board.n_slots
        if n != self.board.n_slots:
            mask = np.zeros(n, dtype=bool)
            mask[: min(n, len(self._mask))] = self._mask[:n]
            self._mask = mask
        self.board = board
        self._reader = board.reader(stale_after=self._stale_after)
        self._new_rows(n)
        self._last_sent = np.full(n, -1, dtype=np.int64)
        self._resync = True  # a new board: send every live slot of it

    def tick(self) -> int:
        """One round: send the changed slots in one frame. Returns the snapshots sent (0 when none
        changed or the frame was dropped)."""
        self.ticks += 1
        self._follow_board()
        self._check_connects()
        arr = self._reader.read_detailed_array(self._detailed)["load"]
        status = arr["status"]
        seq = arr["publish_seq"]
        ours = self._mask & (arr["node_id"] == self.node_id)
        if self._resync:
            self._resync = False
            # Stale here means stale on node0 too: mark such slots as sent so that only a new publish
            # brings them back, and send every live one.
            stale = ours & (status == SlotStatus.STALE)
            self._last_sent[stale] = seq[stale]
            pick = ours & (status == SlotStatus.LIVE)
        else:
            pick = ours & ((status == SlotStatus.LIVE) | (status == SlotStatus.STALE)) & (seq != self._last_sent)
        idx = np.flatnonzero(pick)
        if idx.size == 0:
            return 0
        frame = pack_board_rows(self._detailed, idx, with_detail=bool(self._detail_flags[idx].any()),
                                node_id=self.node_id, board=self.remote_board, frame_seq=self._frame_seq)
        try:
            self._socket.send(frame, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.frames_dropped += 1  # left "changed": the next tick carries these slots again
            return 0
        self._frame_seq += 1
        self._last_sent[idx] = seq[idx]
        self.frames_sent += 1
        self.snapshots_sent += int(idx.size)
        return int(idx.size)

    def run(self, stop: threading.Event | None = None, *, duration: float | None = None) -> None:
        """Tick every ``tick_ms`` until ``stop`` is set or ``duration`` seconds have passed. A tick
        that runs late is not made up for (no bursts)."""
        flag = StopFlag(duration, event=stop)
        next_tick = time.monotonic()
        while not flag.is_set():
            now = time.monotonic()
            if now < next_tick:
                flag.wait(next_tick - now)
                continue
            self.tick()
            next_tick += self.tick_s
            if next_tick < now:
                next_tick = now + self.tick_s

    def stats(self) -> dict[str, int]:
        return {
            "ticks": self.ticks,
            "frames_sent": self.frames_sent,
            "snapshots_sent": self.snapshots_sent,
            "frames_dropped": self.frames_dropped,
            "connects": self.connects,
        }

    def close(self) -> None:
        if self._monitor is not None:
            try:
                self._socket.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        if not self._socket.closed:
            self._socket.close(linger=0)
        if self._opened_board:
            self._initial_board.close()  # the reader keeps its own mapping
        self._follower.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the command --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--board", help="this node's local board")
    p.add_argument("--to", help="node0's collector, e.g. tcp://10.0.0.1:5757")
    p.add_argument("--node-id", type=count(1, 2**62, hint="node 0 is node0, whose board the collector writes"),
                   help="this node's id (>= 1; the slots whose node_id it is are sent)")
    p.add_argument("--tick-ms", type=milliseconds(), default=DEFAULT_TICK_MS,
                   help=f"batching period (default {DEFAULT_TICK_MS:g})")
    p.add_argument("--ranks", default=None, help="only these ranks, e.g. 8-15 (default: every slot of this node)")
    p.add_argument("--remote-board", default=None,
                   help="name of node0's board, when it differs from the local one (default: the same)")
    p.add_argument("--stale-after", type=stale_after, default=DEFAULT_STALE_AFTER,
                   help="seconds after which a local slot counts as stale and is not resent on reconnect "
                        f"(default {DEFAULT_STALE_AFTER:g})")
    p.add_argument("--sndhwm", type=count(1, MAX_SNDHWM), default=DEFAULT_SNDHWM,
                   help=f"frames queued before dropping (default {DEFAULT_SNDHWM})")
    p.add_argument("--curve-server-key", metavar="FILE", default=None,
                   help="the collector's public certificate (.key): encrypt the relay with CURVE")
    p.add_argument("--curve-secret-key", metavar="FILE", default=None,
                   help="this relay's certificate (.key_secret), when node0 admits only known relays")
    p.add_argument("--duration", type=seconds(), default=None, help="stop after this many seconds (default: run until stopped)")
    p.add_argument("--quiet", action="store_true", help="no periodic status line")
    p.add_argument("--keygen", metavar="DIR", default=None,
                   help="write a CURVE certificate pair NAME.key / NAME.key_secret into DIR and exit")
    p.add_argument("--key-name", default="relay", help="NAME for --keygen (default relay)")
    p.add_argument("--force", action="store_true", help="with --keygen: replace an existing pair of that name")


def run(args: argparse.Namespace) -> int:
    if args.keygen:
        public, secret = generate_certificates(args.keygen, args.key_name, force=args.force)
        print(f"public key  {public}  (give it to the other side)\nsecret key  {secret}  (keep it here, mode 0600)")
        return 0
    missing = [flag for flag, value in (("--board", args.board), ("--to", args.to), ("--node-id", args.node_id))
               if value is None]
    if missing:
        raise InvalidInputError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} needed "
                                f"(see dpboard relay --help)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    check_endpoint(args.to, "--to", bind=False)
    board = Board.attach(args.board)
    try:
        ranks = parse_ranks(args.ranks, board.n_slots) if args.ranks else None  # against the board, first
        relay = Relay(board, args.to, args.node_id, tick_ms=args.tick_ms, ranks=ranks,
                      remote_board=args.remote_board, stale_after=args.stale_after, sndhwm=args.sndhwm,
                      curve_secret_key=args.curve_secret_key, curve_server_key=args.curve_server_key)
    except BaseException:
        board.close()
        raise
    with StopFlag(args.duration) as stop, relay:
        if relay.board.node_id != args.node_id:
            print(f"dpboard relay: warning: board {relay.board.name!r} was created for node "
                  f"{relay.board.node_id}; only slots whose writers stamp node {args.node_id} are sent",
                  file=sys.stderr)
        print(f"dpboard relay: pid {os.getpid()} node {args.node_id}: board {relay.board.name!r} -> "
              f"{args.to} ({relay.remote_board!r}) every {args.tick_ms:g} ms", flush=True)
        while not stop.is_set():
            relay.run(stop.event, duration=stop.remaining(cap=5.0))
            if not args.quiet:
                s = relay.stats()
                print(f"frames {s['frames_sent']} sent, {s['frames_dropped']} dropped; snapshots "
                      f"{s['snapshots_sent']}; connects {s['connects']}", flush=True)
    board.close()
    return 0
