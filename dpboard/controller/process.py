"""``DataParallelController``: the ZMQ shell around the Dispatcher (``dpboard controller`` is ``command.py``).

Tokenizer side --PUSH--> [PULL, bound here] controller --PUSH (connected)--> scheduler rank k [PULL, bound]

A request is one msgpack frame: a map with ``rid`` and ``input_ids`` (a list) or ``num_tokens``, and
optionally ``routed_dp_rank`` and ``bootstrap_room``; other keys pass through untouched, because the
controller forwards the frame's original bytes. Replies never pass through the controller. A frame
that is not such a map (or not msgpack as the schedulers decode it) is logged, counted and dropped,
and answered ``{"rid", "error"}`` when its rid could be read; a request that cannot be dispatched (an
invalid routed rank, no available rank, a full scheduler pipe), or that was lost by more schedulers
than ``max_redeliveries`` allows, is answered ``{"rid", "error"}`` on the error channel if there is one: a PUSH the controller connects to the tokenizer side's bound PULL
(connected, so that answers queue from the start instead of being lost before a peer appears).
Neither ever stops the loop. A request whose send fails is taken back out of the rank's load
(``Dispatcher.retract``): the rank never got it.

The controller's state is in a few named parts: its ``ControllerSettings`` (bounds and pace,
checked when made), its ``Connections`` (the sockets and their bounds: the input's connections, the
bytes queued per scheduler; ``dpboard.controller.connections``), its ``ControllerCounts`` (each
event counted once, there; the stats, the count lines and the dispatch record's row are read from
them), and the ``dpboard.controller.session.DispatchSession`` that holds the Dispatcher, its
dispatch-record row and its wave's counters. This module is the loop that uses them.

With a load-aware method the controller is node0's single owner of the relays' load PULL socket
(docs/MULTINODE.md, "One owner"): ``--collect-bind`` hosts a ``dpboard.multinode.collector.Collector`` in this process, polled in the
same loop as the requests.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import zmq

from dpboard.board.dispatch_record import WAVE_REASONS, RowCounts, WaveCounts
from dpboard.controller.codec import MalformedFrame, Request, RequestRefused, decode_request
from dpboard.controller.connections import (
    DEFAULT_MAX_INPUT_MIB,
    DEFAULT_MAX_QUEUED_MIB,
    MAX_INPUT_MIB,
    MAX_QUEUED_MIB,
    MIN_INPUT_MIB,
    BoundedLog,
    Connections,
    Pipe,
    shown,
)
from dpboard.controller.connections import ControllerBusyError as ControllerBusyError
from dpboard.controller.delivery import DeliveryLedger, RankAvailability
from dpboard.controller.dispatcher import Dispatcher, TornReads
from dpboard.controller.session import DispatchSession
from dpboard.errors import DpboardError, InvalidInputError
from dpboard.multinode.peers import Proof
from dpboard.snapshot import SlotStatus
from dpboard.stopping import StopFlag

if TYPE_CHECKING:
    import numpy as np

    from dpboard.controller.auto import AutoMethod

log = logging.getLogger("dpboard.controller")

RESERVED = "-"  # a worker endpoint placeholder for a reserved (elastic EP) slot with no scheduler yet
DEFAULT_SEND_HWM = 100_000
MAX_SEND_HWM = 100_000_000
DEFAULT_MAX_BATCH = 1024
CONNECT_WAIT = 2.0  # seconds the controller gives its schedulers to connect before it serves
MAX_POLL_INTERVAL = 0.1  # the loop's longest poll is shorter than RECONNECT_IVL_MS (connections.py)
ACK_INTERVAL = 0.01  # seconds between two reads of the board's received counts
# How many times a request whose receiver's connection broke before it acknowledged the request is
# sent again. A request that keeps killing its receivers (one a scheduler cannot survive) would
# otherwise take every rank down in turn; one redelivery covers a receiver that died of something
# else. Beyond it the request is answered on the error channel.
DEFAULT_MAX_REDELIVERIES = 1
MAX_REDELIVERIES = 100
# A stop gives what ZMQ holds for the schedulers this long to leave (the linger the close had), then
# as long to the answers it sends for what did not; the close then drops nothing unaccounted.
STOP_WAIT = 1.0
STOP_LOOK = 0.01  # seconds between two looks at the kernel's queues meanwhile
_LIVE, _STALE = int(SlotStatus.LIVE), int(SlotStatus.STALE)


def _int_option(name: str, value: Any, low: int, high: int | None, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidInputError(f"{name} must be an int in {span} ({what}), got {value!r}")


@dataclass(frozen=True)
class ControllerSettings:
    """The controller's bounds and pace (``dpboard controller``'s options), checked when made.

    The connections' bounds (``dpboard.controller.connections``): ``max_peers`` connections on the
    input at most, and ``max_input_mib`` MiB of frames received and not yet read per connection (the
    sender waits beyond it); ``send_hwm`` requests and ``max_queued_mib`` MiB queued per scheduler (a
    scheduler over the latter counts as unavailable until it takes all but half of it), the same
    bytes for the answers, and for what an ``inflight_wave`` hold keeps. ``max_batch`` requests at
    most are taken per read of the input; the loop polls at most ``poll_interval`` seconds and logs
    its counts every ``log_every``. With a board (``acks``): ``redeliver_after`` is how long a rank
    whose connection broke has to count what it received before the rest is sent elsewhere
    (default: the reader's ``stale_after``, else 1 s); ``max_redeliveries`` bounds how many times
    one request is sent elsewhere so: a request lost by ``max_redeliveries + 1`` ranks is answered
    on the error channel instead (counted in ``redelivery_exhausted``)."""

    send_hwm: int = DEFAULT_SEND_HWM
    max_queued_mib: int = DEFAULT_MAX_QUEUED_MIB
    max_input_mib: int = DEFAULT_MAX_INPUT_MIB
    max_peers: int | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    poll_interval: float = 0.05
    log_every: float = 10.0
    redeliver_after: float | None = None
    max_redeliveries: int = DEFAULT_MAX_REDELIVERIES

    def __post_init__(self) -> None:
        _int_option("send_hwm", self.send_hwm, 1, MAX_SEND_HWM, "requests queued per scheduler")
        _int_option("max_queued_mib", self.max_queued_mib, 1, MAX_QUEUED_MIB, "MiB queued per scheduler")
        _int_option("max_input_mib", self.max_input_mib, MIN_INPUT_MIB, MAX_INPUT_MIB,
                    "MiB received and not yet read per input connection, at least one largest frame")
        _int_option("max_batch", self.max_batch, 1, None, "requests taken per batch")
        _int_option("max_redeliveries", self.max_redeliveries, 0, MAX_REDELIVERIES,
                    "times a request lost by a dead receiver is sent again")
        if self.max_peers is not None:
            _int_option("max_peers", self.max_peers, 1, 2**20, "connections on the input")
        if not 0 < self.poll_interval <= MAX_POLL_INTERVAL:
            raise InvalidInputError(f"poll_interval must be in (0, {MAX_POLL_INTERVAL}] seconds, "
                                    f"got {self.poll_interval!r}")

    @property
    def queued_bytes(self) -> int:
        """One scheduler's share of what the process may hold: ``max_queued_mib`` in bytes."""
        return self.max_queued_mib * 2**20

    @property
    def poll_ms(self) -> int:
        return max(1, int(self.poll_interval * 1000))


@dataclass
class ControllerCounts:
    """What the controller counts, each event once, where it happens; ``DataParallelController.stats``
    (``--stats-json``, the count lines) and the dispatch record's row (``row``) are read from here.
    The ledger counts the deliveries, and the session the wave's holds."""

    per_rank: list[int]  # handed to ZMQ for each rank's connected scheduler (a redelivered request again)
    routed_per_rank: list[int]  # of them, with routed_dp_rank
    with_room: int = 0  # of them, with a bootstrap_room
    received: int = 0  # frames taken from the input
    malformed: int = 0  # dropped (and answered, when their rid could be read)
    rejected: int = 0  # answered with an error (invalid routed rank, no rank takes it, too large, ...)
    refused: int = 0  # sends refused (no connection, a full queue): retracted, then tried elsewhere or answered
    redelivered: int = 0  # sent again after their rank's connection broke before acknowledging them
    redelivery_exhausted: int = 0  # lost by max_redeliveries + 1 ranks: answered (and rejected) instead
    errors_unsent: int = 0  # error answers that could not be sent (no error channel, or full)
    disconnects: int = 0
    backlogged: int = 0  # times a scheduler held max_queued_mib not yet taken (then unavailable)
    # handed to ZMQ for a scheduler that had not taken them STOP_WAIT after the stop: dropped by the
    # close, answered on the error channel
    lost_at_stop: int = 0

    @classmethod
    def of(cls, n: int) -> ControllerCounts:
        """All zero, for ``n`` worker slots."""
        return cls(per_rank=[0] * n, routed_per_rank=[0] * n)

    def row(self) -> RowCounts:
        """The dispatch record's counts: the fallbacks are the refused sends (dispatched again), the
        rejections every request answered instead of dispatched (malformed frames and those lost at
        the stop included)."""
        return RowCounts(self.per_rank, self.routed_per_rank, sum(self.routed_per_rank), self.with_room,
                         self.refused, self.rejected + self.malformed + self.lost_at_stop)

    def stats(self, ledger: DeliveryLedger | None, wave: WaveCounts | None) -> dict[str, Any]:
        """``--stats-json``'s counts (the keys and their order of every earlier version), with the
        ledger's and the wave's."""
        return {
            "received": self.received,
            "dispatched": sum(self.per_rank),
            "delivered": 0 if ledger is None else ledger.delivered,  # acknowledged by num_received_reqs
            "redelivered": self.redelivered,
            "redelivery_exhausted": self.redelivery_exhausted,
            "malformed": self.malformed,
            "rejected": self.rejected,
            "send_dropped": self.refused,
            "errors_unsent": self.errors_unsent,
            "retracted": self.refused,  # the refused picks, taken back out of their rank's load
            "disconnects": self.disconnects,
            "backlogged": self.backlogged,
            # sent and not yet acknowledged (with a board); sent, then let go unacknowledged (the
            # ledger's bounds, or a rank that counts nothing)
            "unacknowledged": 0 if ledger is None else ledger.unacknowledged(),
            "untracked": 0 if ledger is None else ledger.untracked,
            **wave_stats(wave),
            "lost_at_stop": self.lost_at_stop,
            "per_rank": list(self.per_rank),
        }


def wave_stats(wave: WaveCounts | None) -> dict[str, Any]:
    """inflight_wave's counts in ``--stats-json``: requests held for waves, and those of them placed
    when the controller stopped (sent, or answered where no rank took them); bytes held now and the
    most held at once; releases by why their wave left (``WAVE_REASONS``); the waves; the longest
    any request was held, and the seconds held summed over the released requests."""
    w = wave or WaveCounts()
    return {"held": w.held, "released_at_stop": w.released_by("shutdown"), "held_bytes": w.held_bytes,
            "held_bytes_max": w.held_bytes_max,
            "wave_released": {} if wave is None else dict(zip(WAVE_REASONS, w.released, strict=True)),
            "waves": w.waves, "wave_hold_max_s": w.hold_max_s, "wave_hold_sum_s": w.hold_sum_s}


def wave_line(wave: WaveCounts) -> str:
    """The wave's counters in the controller's count line: the waves, the releases by reason, the
    longest hold against its budget and the mean."""
    released = sum(wave.released)
    mean = wave.hold_sum_s / released if released else 0.0
    reasons = ", ".join(f"{reason} {n}" for reason, n in zip(WAVE_REASONS, wave.released, strict=True))
    return (f"{wave.waves} waves (released: {reasons}); each held at most {wave.hold_max_s:.3f} s (the bound: "
            f"--wave-max-hold {wave.max_hold_s:g}), {mean:.3f} s on average")


def _check_ranks(dispatcher: Dispatcher, workers: Sequence[str | None]) -> None:
    n = dispatcher.num_workers
    if len(workers) != n:
        raise InvalidInputError(
            f"{len(workers)} worker endpoints for a dispatcher of {n} "
            f"worker slots: give one endpoint per slot ({RESERVED!r} for a reserved slot)"
        )
    absent = [r for r in dispatcher.active if workers[r] is None]
    if absent:
        raise InvalidInputError(f"active ranks {absent} have no worker endpoint: give them one or leave them "
                                "out of the active set")


class BoardCounts(Protocol):
    """What the controller reads of its schedulers' board (a ``dpboard.board.FollowingReader``): one
    SNAPSHOT_DTYPE record per worker slot; its ``stale_after``, where it has one, is the default
    ``ControllerSettings.redeliver_after``."""

    def read_array(self) -> np.ndarray: ...


class LoadFanIn(Protocol):
    """The load fan-in the loop polls beside the input (``dpboard.multinode.collector.Collector``);
    its ``endpoint`` and ``stats()``, where it has them, go into the log and the stats."""

    socket: zmq.Socket

    def drain(self) -> Any: ...


class DataParallelController:
    """Receives tokenized requests, picks a rank with the Dispatcher, forwards each frame.

    ``worker_endpoints[k]`` is where scheduler rank k's PULL socket is bound (``None`` for a reserved
    slot); the controller connects a PUSH to each. ``input_endpoint`` is bound (PULL), and only one
    process may bind it (a lock under /dev/shm; a second controller fails at start naming the
    first). ``error_endpoint``, when given, is where the tokenizer side's PULL is bound: the
    controller connects a PUSH there for ``{rid, error}`` answers. ``settings``: the bounds and the
    pace (``ControllerSettings``; default, its defaults); ``context``: a ZMQ context of the caller's.

    ``acks``, when given, reads the schedulers' board (``read_array()``: SNAPSHOT_DTYPE records, one
    per worker slot, e.g. a ``dpboard.board.FollowingReader``): its ``num_received_reqs`` acknowledge
    deliveries and its staleness marks ranks that stopped taking requests (docs/DISPATCH.md,
    "Delivery").

    ``session``, when given, is the ``dpboard.controller.session.DispatchSession`` holding
    ``dispatcher`` and this controller's row of the board's dispatch record, for ``dpboard doctor``,
    ``dpboard top`` and ``/metrics``: the row reads this controller's ``counts`` (``count_from``)
    and its wave's counters, and the loop publishes it within 0.1 s of a change. Without one the
    controller holds a session of its own, with no record.

    ``collector``, when given, is a ``dpboard.multinode.collector.Collector`` (anything with ``socket`` and
    ``drain()``) whose socket this loop polls beside the input; its owner creates and closes it.

    ``auto``, when given, is the ``dpboard.controller.auto.AutoMethod`` whose ``dispatcher`` this
    controller starts with: the loop asks it to look at the board again (it reads it at most every
    ``AUTO_CHECK_INTERVAL``), and dispatches with the new Dispatcher it builds when ``auto`` changes,
    between two batches (the ranks' availability carried over; the record's method stamped again).
    """

    def __init__(self, dispatcher: Dispatcher, worker_endpoints: Sequence[str | None], input_endpoint: str,
                 error_endpoint: str | None = None, *, settings: ControllerSettings | None = None,
                 context: zmq.Context | None = None, acks: BoardCounts | None = None,
                 collector: LoadFanIn | None = None, session: DispatchSession | None = None,
                 auto: AutoMethod | None = None) -> None:
        self.settings = settings = settings or ControllerSettings()
        _check_ranks(dispatcher, worker_endpoints)
        n = dispatcher.num_workers
        self.session = session or DispatchSession(logger=log)
        if self.session.dispatcher is not dispatcher:
            self.session.use(dispatcher)
        dispatcher.bound_held_bytes(settings.queued_bytes)  # what a wave holds counts against one scheduler's share
        self.counts = ControllerCounts.of(n)
        self.session.count_from(self.counts.row)
        self.acks, self.collector, self.auto = acks, collector, auto
        self.ledger = DeliveryLedger(n) if acks is not None else None
        after = settings.redeliver_after
        if after is None and acks is not None:
            after = getattr(acks, "stale_after", 1.0)
        self.redeliver_after = float(after or 1.0)
        self.availability = RankAvailability(n)
        self._torn = TornReads(n)  # a TORN ack read leaves its rank by the dispatcher's rule
        self._frame_log = BoundedLog(log)
        self._stop = threading.Event()
        self._said_uncounted = False
        self._next_ack = 0.0
        self._at_stop: dict[str, Any] = {}  # what the stats add once the loop has stopped
        self.connections = Connections(context, worker_endpoints, input_endpoint, error_endpoint,
                                       send_hwm=settings.send_hwm, max_queued_bytes=settings.queued_bytes,
                                       max_input_bytes=settings.max_input_mib * 2**20, max_peers=settings.max_peers)
        for rank in self.connections.ranks:
            self._update_status(rank)

    @property
    def stats(self) -> dict[str, Any]:
        """The counts (``ControllerCounts.stats``); once the loop has stopped, also its input's
        connections (``input``), the log lines held back and the collector's frames."""
        return {**self.counts.stats(self.ledger, self.session.wave_counts()), **self._at_stop}

    # -- availability: connections, staleness, full queues ------------------------------------------

    def _update_status(self, rank: int) -> None:
        self.availability.update(rank, self.connections.workers[rank], self.dispatcher)

    def _on_monitor(self, rank: int, now: float) -> None:
        pipe = self.connections.workers[rank]
        for event in pipe.events():
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                log.info("worker %d (%s) connected", rank, pipe.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self.counts.disconnects += 1
                if self.ledger is not None:
                    self.availability.draining[rank] = now + self.redeliver_after
                    log.warning("worker %d (%s) disconnected: no more requests go there; the %d it has not "
                                "acknowledged go elsewhere in %.2g s unless it counts them first", rank,
                                pipe.endpoint, self.ledger.unacknowledged(rank), self.redeliver_after)
                else:
                    log.warning("worker %d (%s) disconnected: no more requests go there (without a board the "
                                "controller cannot tell which requests it had received: give --board to have "
                                "deliveries acknowledged)", rank, pipe.endpoint)
        self._update_status(rank)

    def _recheck_backlogs(self) -> None:
        """A backlogged scheduler that has taken all but half its bound takes requests again."""
        conn = self.connections
        for rank in conn.ranks:
            pipe = conn.workers[rank]
            if pipe.backlogged and pipe.recheck():
                self._update_status(rank)
        if conn.errors is not None:
            conn.errors.events()  # its connection, for its byte bound
            conn.errors.recheck()

    def _wait_connected(self, stop: StopFlag) -> None:
        """Give the schedulers up to CONNECT_WAIT seconds to connect before serving (bounded)."""
        deadline = time.monotonic() + CONNECT_WAIT
        poller = zmq.Poller()
        ranks, workers = self.connections.ranks, self.connections.workers
        monitors = {workers[rank].monitor: rank for rank in ranks}
        for mon in monitors:
            poller.register(mon, zmq.POLLIN)
        while not all(workers[r].connected for r in ranks) and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in ranks if not workers[r].connected]
                log.warning("workers %s are not connected after %.0f s: requests go to the others until they "
                            "are", missing, CONNECT_WAIT)
                return
            for sock, _ in poller.poll(int(1000 * min(left, 0.05))):
                self._on_monitor(monitors[sock], time.monotonic())

    # -- acknowledgements (with a board) ---------------------------------------------------------------

    def _start_epochs(self) -> None:
        records = self.acks.read_array()
        for rank in self.connections.ranks:
            st = int(records["status"][rank])
            self.ledger.start(rank, int(records["num_received_reqs"][rank]) if st in (_LIVE, _STALE) else 0)

    def _read_acks(self, now: float) -> None:
        records = self.acks.read_array()
        status, received = records["status"], records["num_received_reqs"]
        torn_left = self._torn.judge(status, now, self.dispatcher.torn_grace)
        ledger = self.ledger
        for rank in self.connections.ranks:
            st = int(status[rank])
            if st == _LIVE or st == _STALE:
                if ledger.pending[rank] or ledger.uncounted[rank]:
                    ledger.observe(rank, int(received[rank]))
            stale = st == _STALE or bool(torn_left[rank])
            if stale != self.availability.stale[rank]:
                self.availability.stale[rank] = stale
                if stale:
                    log.warning("worker %d's board slot is %s: no more requests go there until it publishes",
                                rank, SlotStatus(st).label)
                else:
                    log.info("worker %d publishes again", rank)
                self._update_status(rank)
        for rank, when in list(self.availability.draining.items()):
            if now >= when:
                st = int(status[rank])
                self._close_epoch(rank, int(received[rank]) if st in (_LIVE, _STALE) else 0)

    def _close_epoch(self, rank: int, received_now: int) -> None:
        del self.availability.draining[rank]
        lost = self.ledger.close_epoch(rank, received_now)
        self.dispatcher.forget_in_flight(rank)  # nothing more of what was sent there will be counted
        self._update_status(rank)
        if lost:
            log.warning("worker %d never acknowledged %d requests before its connection broke: sending them "
                        "to other ranks", rank, len(lost))
        for req in lost:
            req.lost += 1
            if req.lost > self.settings.max_redeliveries:
                self.counts.redelivery_exhausted += 1
                who = "a scheduler whose connection" if req.lost == 1 else f"{req.lost} schedulers whose connections"
                self._reject(req.rid, f"the request was lost by {who} broke before acknowledging it; it is not sent "
                                      f"again (max_redeliveries {self.settings.max_redeliveries})")
                continue
            self.counts.redelivered += 1
            self._redeliver(req, tried={rank})

    # -- the loop ---------------------------------------------------------------------------------------

    @property
    def _block_size(self) -> int | None:
        """Tokens per prompt block when the method keeps a prefix index (then each request's block
        hashes are read from its frame), else None."""
        prefix = self.dispatcher.prefix
        return None if prefix is None else prefix.block_size

    def stop(self) -> None:
        """Ask the loop to end (from a signal handler or another thread)."""
        self._stop.set()

    def run(self, duration: float | None = None, *, stop: threading.Event | None = None) -> dict[str, Any]:
        """Serve until ``stop()``, SIGTERM/SIGINT (in the main thread) or ``duration`` seconds;
        ``stop``: an event of the caller's that ends the loop too (set before: it ends at once)."""
        if stop is not None:
            self._stop = stop
        stop = StopFlag(duration, event=self._stop)
        conn = self.connections
        log.info("controller: method %s, %d worker slots (active %s), input %s, errors %s, acknowledgements %s",
                 self.dispatcher.described, self.dispatcher.num_workers, list(self.dispatcher.active),
                 conn.input.endpoint, conn.error_endpoint, "from the board" if self.acks is not None else "none")
        poller = zmq.Poller()
        poller.register(conn.input.socket, zmq.POLLIN)
        monitor_rank = {}
        for rank in conn.ranks:
            poller.register(conn.workers[rank].monitor, zmq.POLLIN)
            monitor_rank[conn.workers[rank].monitor] = rank
        loads = None
        if self.collector is not None:
            loads = self.collector.socket
            poller.register(loads, zmq.POLLIN)
            log.info("controller: owns the load fan-in PULL %s", getattr(self.collector, "endpoint", loads))
        next_log = time.monotonic() + self.settings.log_every
        try:
            with stop:
                self._wait_connected(stop)
                if self.ledger is not None:
                    self._start_epochs()
                while not stop.is_set():
                    ready = dict(poller.poll(self._poll_ms()))
                    now = time.monotonic()
                    for sock in ready:
                        rank = monitor_rank.get(sock)
                        if rank is not None:
                            self._on_monitor(rank, now)
                    # loads first: a request batch then sees the freshest relayed snapshots
                    if loads is not None and loads in ready:
                        self.collector.drain()
                    if now >= self._next_ack:
                        self._next_ack = now + ACK_INTERVAL
                        if self.ledger is not None:
                            self._read_acks(now)
                        if self.auto is not None and self.auto.check():
                            self._use_dispatcher(self.auto.dispatcher)
                        self._recheck_backlogs()
                        conn.input.service()
                    if conn.input.socket in ready:
                        self._serve_ready()
                    if self.dispatcher.held:
                        self._place(self.dispatcher.due())
                    # the row at each publish interval, changed or not: its age is how doctor tells a
                    # live controller from a dead one (the plugins' rows change only with their counts)
                    self.session.beat(now)
                    if now >= next_log:
                        next_log = now + self.settings.log_every
                        self._log_counts()
        finally:
            self._release_held()
            self._stop_sending()
            if self.ledger is not None:
                self._read_acks(time.monotonic())
            self._log_counts(stopping=True)
            self._frame_log.flush()
            self._at_stop = {"input": conn.input.peer_stats, "log_held_back": self._frame_log.held_back_total}
            self.session.publish()
            if self.collector is not None and hasattr(self.collector, "stats"):
                self._at_stop["collector"] = self.collector.stats()
        return self.stats

    @property
    def dispatcher(self) -> Dispatcher:
        return self.session.dispatcher

    def _poll_ms(self) -> int:
        """The poll's timeout: the loop's interval, or less when a held wave is due sooner."""
        due = self.dispatcher.next_due_at()
        poll_ms = self.settings.poll_ms
        if due is None:
            return poll_ms
        return max(0, min(poll_ms, int(math.ceil((due - self.dispatcher.clock()) * 1000))))

    def _release_held(self) -> None:
        """The requests a wave still holds go out now (or are answered, when no rank takes them):
        the controller is stopping, and nothing it holds is lost (counted by the wave: released at
        shutdown)."""
        self._place(self.dispatcher.release_all())

    def _stop_sending(self) -> None:
        """Nothing the controller took goes silently at its close: what ZMQ still holds for the
        schedulers has ``STOP_WAIT`` to leave; the rest is counted lost at stop and answered on the
        error channel, whose answers then have as long (those left are counted unsent). The close
        then lingers for nothing: a frame counted lost never arrives after all."""
        errors = self.connections.errors
        workers = [(rank, pipe) for rank, pipe in enumerate(self.connections.workers) if pipe is not None]
        self._wait_out([pipe for _, pipe in workers])
        for rank, pipe in workers:
            lost = pipe.unsent()
            pipe.set_linger(0)
            if not lost:
                continue
            self.counts.lost_at_stop += len(lost)
            log.warning("controller: worker %d had not taken %d requests %g s after the stop: ZMQ still held "
                        "them in this process, and they are dropped with it; each is answered on the error "
                        "channel", rank, len(lost), STOP_WAIT)
            for rid in lost:
                self._send_error(rid, f"not delivered: the controller stopped before DP rank {rank}'s scheduler "
                                      "took the request")
        if errors is not None:
            self._wait_out([errors])
            self.counts.errors_unsent += len(errors.unsent())
            errors.set_linger(0)

    @staticmethod
    def _wait_out(pipes: list[Pipe]) -> None:
        """Until every frame of ``pipes`` has left this process, or ``STOP_WAIT`` has passed."""
        deadline = time.monotonic() + STOP_WAIT
        while any(pipe.leaving() for pipe in pipes) and time.monotonic() < deadline:
            time.sleep(STOP_LOOK)

    def _use_dispatcher(self, new: Dispatcher) -> None:
        """Dispatch with ``new`` from the next batch on: ``auto`` changed. The session hands it the
        ranks' availability and stamps the record; what was sent stays in the delivery ledger,
        which is the controller's. What the old one held goes out with the new one's picks (its
        counters go on in the session's ``wave_counts``)."""
        held = self.dispatcher.release_all()
        new.bound_held_bytes(self.settings.queued_bytes)
        self.session.use(new)
        self.availability.forget_told()
        for rank in self.connections.ranks:
            self._update_status(rank)
        self._place(held)

    def _serve_ready(self) -> None:
        reqs: list[Request] = []
        source = self.connections.input
        for frame, fd in source.receive(self.settings.max_batch):
            self.counts.received += 1
            try:
                if frame is None:
                    raise MalformedFrame("a message of several frames, expected 1")
                reqs.append(decode_request(frame, self._block_size))
                source.prove(fd, Proof.VALID)
            except RequestRefused as e:
                source.prove(fd, Proof.VALID)  # well-formed: a real client, with a request too large
                self._reject(e.rid, str(e))
            except MalformedFrame as e:
                source.prove(fd, Proof.SPOKE)
                self.counts.malformed += 1
                if e.rid is None:
                    self._frame_log.warning("dropped a malformed request frame: %s", str(e))
                else:
                    self._frame_log.warning("dropped a malformed request frame (rid %s, answered): %s", shown(e.rid),
                                            str(e))
                    self._send_error(e.rid, f"malformed request frame: {e}")
        if not reqs:
            return
        self._place(self.dispatcher.offer(reqs))

    def _place(self, reqs: list[Request]) -> None:
        """Pick a rank for each request and send it there (a method that holds gave them back)."""
        if not reqs:
            return
        try:
            ranks = self.dispatcher.dispatch_batch(reqs)
        except DpboardError:
            # the batch is all or nothing: take it one by one to answer only the requests that fail
            for req in reqs:
                self._redeliver(req, tried=set())
        else:
            self._send_batch(ranks, reqs)
        full, self.availability.full = self.availability.full, set()
        for rank in full:  # a full queue refuses for this batch only: the next one tries it again
            self._update_status(rank)

    def _send_batch(self, ranks: list[int], reqs: list[Request]) -> None:
        """Send each request to its rank; a request whose send fails goes to another rank, or is
        answered with an error.

        Once a rank refuses a send (no connection, full queue) the rest of the batch is not offered
        to it either: the refused picks are then always that rank's latest ones, which
        ``Dispatcher.retract`` undoes exactly (latest first), before they are dispatched again."""
        refused: dict[int, list[Request]] = {}
        for rank, req in zip(ranks, reqs, strict=True):
            later = refused.get(rank)
            if later is not None:
                later.append(req)
            elif not self._try_send(rank, req):
                refused[rank] = [req]
        for rank, failed in refused.items():
            for req in reversed(failed):
                self.dispatcher.retract(rank, req)
            self._refused(rank, len(failed))
        for rank, failed in refused.items():
            for req in failed:
                self._redeliver(req, tried={rank})

    def _redeliver(self, req: Request, tried: set[int]) -> None:
        """Dispatch ``req`` again and send it; a rank that refuses is left out (and retracted) and the
        next one is tried; a request pinned to a refusing rank (routed, or its room) is answered."""
        for _ in range(len(self.connections.ranks) + 1):
            try:
                rank = self.dispatcher.dispatch(req)
            except DpboardError as e:
                self._reject(req.rid, str(e))
                return
            if rank in tried:  # pinned to a rank that does not take it now
                self.dispatcher.retract(rank, req)
                why = self.availability.why_not(rank, self.connections.workers[rank])
                self._reject(req.rid, f"DP rank {rank} is not taking requests ({why})")
                return
            if self._try_send(rank, req):
                return
            self.dispatcher.retract(rank, req)
            self._refused(rank, 1)
            tried.add(rank)
        self._reject(req.rid, "no DP rank took the request: every rank refused it")

    def _try_send(self, rank: int, req: Request) -> bool:
        """True when ZMQ took the frame for ``rank``'s connected scheduler."""
        pipe = self.connections.workers[rank]
        if pipe is None or not pipe.connected or rank in self.availability.draining:
            return False
        if not pipe.send(req.raw, req.rid):
            return False
        counts = self.counts
        if pipe.backlogged:  # this send took it to its bound: no more until it takes its backlog
            counts.backlogged += 1
            self._update_status(rank)
        counts.per_rank[rank] += 1
        if req.routed_dp_rank is not None:
            counts.routed_per_rank[rank] += 1
        if req.bootstrap_room is not None:
            counts.with_room += 1
        if self.ledger is not None and self.ledger.sent(rank, req) and not self._said_uncounted:
            self._said_uncounted = True
            log.warning("worker %d took %d requests without counting one in num_received_reqs on its board "
                        "slot: delivery cannot be proven on this board (a vLLM board, or schedulers that pass "
                        "no count), so the controller keeps no copy of what it sends there and cannot send "
                        "elsewhere what a broken connection loses (said once)", rank, self.ledger.uncounted_after)
        return True

    def _refused(self, rank: int, n: int) -> None:
        """``rank`` refused ``n`` sends, retracted: counted (fallbacks in the record: they are
        dispatched again), and requests kept away from it (for this batch, when its queue is full)."""
        self.counts.refused += n
        pipe = self.connections.workers[rank]
        if pipe is not None and pipe.connected and not pipe.backlogged and rank not in self.availability.draining:
            self.availability.full.add(rank)
        self._update_status(rank)

    def _reject(self, rid: Any, error: str) -> None:
        self.counts.rejected += 1
        self._frame_log.warning("request %s rejected: %s", shown(rid), error)
        self._send_error(rid, error)

    def _send_error(self, rid: Any, error: str) -> None:
        errors = self.connections.errors
        if errors is None or not errors.send(msgpack.packb({"rid": rid, "error": error}, use_bin_type=True), rid):
            self.counts.errors_unsent += 1

    def _log_counts(self, stopping: bool = False) -> None:
        s = self.stats
        stop = f"; {s['lost_at_stop']} lost at stop, {s['errors_unsent']} answers unsent" if stopping else ""
        log.info("controller: received %d, dispatched %d, delivered %d, redelivered %d (%d lost too often), "
                 "malformed %d, rejected %d, retracted %d, per rank %s%s", s["received"], s["dispatched"],
                 s["delivered"], s["redelivered"], s["redelivery_exhausted"], s["malformed"], s["rejected"],
                 s["retracted"], s["per_rank"], stop)
        wave = self.session.wave_counts()
        if self.dispatcher.wave is not None and wave is not None:
            log.info("controller: held %d for waves, %d holding now, %d placed at stop; at most %.1f MiB held "
                     "at once (the bound: --max-queued-mib %d); %s", s["held"], wave.holding,
                     s["released_at_stop"], s["held_bytes_max"] / 2**20, self.settings.max_queued_mib,
                     wave_line(wave))
        if self.collector is not None and hasattr(self.collector, "stats"):
            c = self.collector.stats()
            log.info("controller: load fan-in frames %d ok, %d bad; snapshots %d",
                     c["frames_ok"], c["frames_bad"], c["snapshots_ok"])

    def close(self) -> None:
        """Close every socket (queued requests get at most a second to leave) and release the input."""
        self.connections.close()

    def __enter__(self) -> DataParallelController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
