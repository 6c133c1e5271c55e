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

The sockets and their bounds (the input's connections, the bytes queued per scheduler, the log of
malformed frames) live in ``dpboard.controller.connections``; the Dispatcher, its dispatch-record
row and its counts in a ``dpboard.controller.session.DispatchSession``; this module is the loop
that uses them.

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
from typing import Any

import msgpack
import zmq

from dpboard.controller.codec import MalformedFrame, Request, RequestRefused, decode_request
from dpboard.controller.connections import (
    DEFAULT_MAX_INPUT_MIB,
    DEFAULT_MAX_QUEUED_MIB,
    MAX_INPUT_MIB,
    MAX_QUEUED_MIB,
    MIN_INPUT_MIB,
    BoundedLog,
    Pipe,
    RequestInput,
    shown,
)
from dpboard.controller.delivery import DeliveryLedger, RankAvailability
from dpboard.controller.dispatcher import Dispatcher
from dpboard.controller.session import DispatchSession
from dpboard.errors import DpboardError, InvalidInputError
from dpboard.multinode.peers import Proof
from dpboard.ownership import OwnerBusyError, OwnerLock, check_endpoint, take_endpoint
from dpboard.snapshot import SlotStatus
from dpboard.stopping import StopFlag

log = logging.getLogger("dpboard.controller")

RESERVED = "-"  # a worker endpoint placeholder for a reserved (elastic EP) slot with no scheduler yet
DEFAULT_SEND_HWM = 100_000
MAX_SEND_HWM = 100_000_000
DEFAULT_MAX_BATCH = 1024
CONNECT_WAIT = 2.0  # seconds the controller gives its schedulers to connect before it serves
# ZMQ reconnects a broken pipe after this long, more than the loop's longest poll: the controller
# always sees a disconnect before the same rank can take requests again (docs/DISPATCH.md, Delivery).
RECONNECT_IVL_MS = 250
MAX_POLL_INTERVAL = 0.1
ACK_INTERVAL = 0.01  # seconds between two reads of the board's received counts
# How many times a request whose receiver's connection broke before it acknowledged the request is
# sent again. A request that keeps killing its receivers (one a scheduler cannot survive) would
# otherwise take every rank down in turn; one redelivery covers a receiver that died of something
# else. Beyond it the request is answered on the error channel.
DEFAULT_MAX_REDELIVERIES = 1
MAX_REDELIVERIES = 100
_LIVE, _STALE, _TORN = int(SlotStatus.LIVE), int(SlotStatus.STALE), int(SlotStatus.TORN)


class ControllerBusyError(OwnerBusyError):
    """Another process already binds the controller's input endpoint, or already controls its board."""


def new_counts(n: int) -> dict[str, Any]:
    """The controller's counts for ``n`` worker slots, all zero (``DataParallelController.stats``)."""
    return {
        "received": 0,
        "dispatched": 0,  # taken by ZMQ for a connected scheduler (a redelivered request counts again)
        "delivered": 0,  # acknowledged by the scheduler's num_received_reqs (with a board)
        "redelivered": 0,  # sent again after their rank's connection broke before acknowledging them
        # lost by max_redeliveries + 1 ranks: answered with an error instead of being sent again
        "redelivery_exhausted": 0,
        "malformed": 0,  # dropped (and answered, when their rid could be read)
        "rejected": 0,  # answered with an error (invalid routed rank, no rank takes it, too large, ...)
        "send_dropped": 0,  # a send refused (no connection, a full queue): tried elsewhere or answered
        "errors_unsent": 0,  # an error answer that could not be sent (no error channel, or full)
        "retracted": 0,  # picks taken back out of a rank's load because their send failed
        "disconnects": 0,
        "backlogged": 0,  # times a scheduler held max_queued_mib not yet taken (then unavailable)
        "unacknowledged": 0,  # sent, not yet acknowledged (with a board), when the stats were taken
        "untracked": 0,  # sent, then let go unacknowledged: the ledger's bounds, or a rank that counts nothing
        # inflight_wave: requests held for a wave, and those of them placed when the controller stopped
        # (sent, or answered with an error where no rank took them)
        "held": 0,
        "released_at_stop": 0,
        "per_rank": [0] * n,
    }


def _int_option(name: str, value: Any, low: int, high: int | None, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidInputError(f"{name} must be an int in {span} ({what}), got {value!r}")


class DataParallelController:
    """Receives tokenized requests, picks a rank with the Dispatcher, forwards each frame.

    ``worker_endpoints[k]`` is where scheduler rank k's PULL socket is bound (``None`` for a reserved
    slot); the controller connects a PUSH to each. ``input_endpoint`` is bound (PULL), and only one
    process may bind it (a lock under /dev/shm; a second controller fails at start naming the
    first). ``error_endpoint``, when given, is where the tokenizer side's PULL is bound: the
    controller connects a PUSH there for ``{rid, error}`` answers. The connections' bounds
    (``dpboard.controller.connections``): ``max_peers`` connections on the input at most, and
    ``max_input_mib`` MiB of frames received and not yet read per connection (the sender waits
    beyond it); ``send_hwm`` requests and ``max_queued_mib`` MiB queued per scheduler (a scheduler
    over the latter counts as unavailable until it takes all but half of it), the same bytes for the
    answers.

    ``acks``, when given, reads the schedulers' board (``read_array()``: SNAPSHOT_DTYPE records, one
    per worker slot, e.g. a ``dpboard.board.FollowingReader``): its ``num_received_reqs`` acknowledge
    deliveries and its staleness marks ranks that stopped taking requests (docs/DISPATCH.md,
    "Delivery"). ``redeliver_after`` is how long a rank whose connection broke has to count what it
    received before the rest is sent elsewhere (default: the reader's ``stale_after``, else 1 s).
    ``max_redeliveries`` bounds how many times one request is sent elsewhere so: a request lost by
    ``max_redeliveries + 1`` ranks is answered on the error channel instead (counted in
    ``stats["redelivery_exhausted"]``).

    ``session``, when given, is the ``dpboard.controller.session.DispatchSession`` holding
    ``dispatcher`` (with ``count_every_pick``) and this controller's row of the board's dispatch
    record, for ``dpboard doctor``: each request handed to a rank, each pick whose rank refused it
    (a fallback in the record) and each rejection is counted there, and the loop publishes the row
    at most every 0.1 s. Without one the controller holds a session of its own, with no record.

    ``collector``, when given, is a ``dpboard.multinode.collector.Collector`` (anything with ``socket`` and
    ``drain()``) whose socket this loop polls beside the input; its owner creates and closes it.

    ``auto``, when given, is the ``dpboard.controller.auto.AutoMethod`` whose ``dispatcher`` this
    controller starts with: the loop asks it to look at the board again (it reads it at most every
    ``AUTO_CHECK_INTERVAL``), and dispatches with the new Dispatcher it builds when ``auto`` changes,
    between two batches (the ranks' availability carried over; the record's method stamped again).
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        worker_endpoints: Sequence[str | None],
        input_endpoint: str,
        error_endpoint: str | None = None,
        *,
        context: zmq.Context | None = None,
        send_hwm: int = DEFAULT_SEND_HWM,
        max_queued_mib: int = DEFAULT_MAX_QUEUED_MIB,
        max_input_mib: int = DEFAULT_MAX_INPUT_MIB,
        max_peers: int | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        poll_interval: float = 0.05,
        log_every: float = 10.0,
        collector: Any = None,
        acks: Any = None,
        redeliver_after: float | None = None,
        max_redeliveries: int = DEFAULT_MAX_REDELIVERIES,
        session: DispatchSession | None = None,
        auto: Any = None,
    ):
        n = dispatcher.num_workers
        self._check_endpoints(dispatcher, worker_endpoints, input_endpoint, error_endpoint)
        _int_option("send_hwm", send_hwm, 1, MAX_SEND_HWM, "requests queued per scheduler")
        _int_option("max_queued_mib", max_queued_mib, 1, MAX_QUEUED_MIB, "MiB queued per scheduler")
        _int_option("max_input_mib", max_input_mib, MIN_INPUT_MIB, MAX_INPUT_MIB,
                    "MiB received and not yet read per input connection, at least one largest frame")
        _int_option("max_batch", max_batch, 1, None, "requests taken per batch")
        _int_option("max_redeliveries", max_redeliveries, 0, MAX_REDELIVERIES,
                    "times a request lost by a dead receiver is sent again")
        if max_peers is not None:
            _int_option("max_peers", max_peers, 1, 2**20, "connections on the input")
        if not 0 < poll_interval <= MAX_POLL_INTERVAL:
            raise InvalidInputError(f"poll_interval must be in (0, {MAX_POLL_INTERVAL}] seconds, got {poll_interval!r}")
        if acks is not None and redeliver_after is None:
            redeliver_after = getattr(acks, "stale_after", 1.0)
        if session is None:
            session = DispatchSession(logger=log, count_every_pick=True)
        if session.dispatcher is not dispatcher:
            session.use(dispatcher)
        self.session = session
        self.worker_endpoints = list(worker_endpoints)
        self.input_endpoint = input_endpoint
        self.error_endpoint = error_endpoint
        self.collector = collector
        self.auto = auto
        self.acks = acks
        self.redeliver_after = float(redeliver_after or 1.0)
        self.max_redeliveries = max_redeliveries
        self.ledger = DeliveryLedger(n) if acks is not None else None
        self._said_uncounted = False
        self.max_batch = max_batch
        self.poll_ms = max(1, int(poll_interval * 1000))
        self._held_before = 0  # requests held by the dispatchers auto has replaced
        self.log_every = log_every
        self._frame_log = BoundedLog(log)
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._stop = threading.Event()
        self._ranks = [r for r, e in enumerate(self.worker_endpoints) if e is not None]
        self.availability = RankAvailability(n)
        self._next_ack = 0.0
        self.stats = new_counts(n)
        self.input: RequestInput | None = None
        self.workers: list[Pipe | None] = [None] * n
        self.errors: Pipe | None = None
        self._lock: OwnerLock | None = None
        try:
            self._lock = take_endpoint(input_endpoint, busy=ControllerBusyError)
            self.input = RequestInput(self.context, input_endpoint, max_peers=max_peers,
                                      max_input_bytes=max_input_mib * 2**20)
            queued = max_queued_mib * 2**20
            for rank in self._ranks:
                self.workers[rank] = Pipe(self.context, self.worker_endpoints[rank], f"worker {rank}",
                                          send_hwm=send_hwm, max_queued_bytes=queued, immediate=True,
                                          reconnect_ivl_ms=RECONNECT_IVL_MS)
            if error_endpoint is not None:
                self.errors = Pipe(self.context, error_endpoint, "the error channel", send_hwm=None,
                                   max_queued_bytes=queued, immediate=False)
        except BaseException:
            self._close(linger=0)
            raise
        for pipe in self._pipes():  # a clean close gives queued requests and answers a second to leave
            pipe.set_linger(1000)
        for rank in self._ranks:
            self._update_status(rank)

    @staticmethod
    def _check_endpoints(dispatcher: Dispatcher, workers: Sequence[str | None], input_endpoint: str,
                         error_endpoint: str | None) -> None:
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
        check_endpoint(input_endpoint, "the input endpoint", bind=True)
        for rank, endpoint in enumerate(workers):
            if endpoint is not None:
                check_endpoint(endpoint, f"the endpoint of worker {rank}", bind=False)
        if error_endpoint is not None:
            check_endpoint(error_endpoint, "the error endpoint", bind=False)

    def _pipes(self) -> list[Pipe]:
        return [p for p in [*self.workers, self.errors] if p is not None]

    @property
    def _connected(self) -> list[bool]:
        return [w is not None and w.connected for w in self.workers]

    # -- availability: connections, staleness, full queues ------------------------------------------

    def _update_status(self, rank: int) -> None:
        self.availability.update(rank, self.workers[rank], self.dispatcher)

    def _on_monitor(self, rank: int, now: float) -> None:
        pipe = self.workers[rank]
        for event in pipe.events():
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                log.info("worker %d (%s) connected", rank, pipe.endpoint)
            elif event == zmq.EVENT_DISCONNECTED:
                self.stats["disconnects"] += 1
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
        for rank in self._ranks:
            pipe = self.workers[rank]
            if pipe.backlogged and pipe.recheck():
                self._update_status(rank)
        if self.errors is not None:
            self.errors.events()  # its connection, for its byte bound
            self.errors.recheck()

    def _wait_connected(self, stop: StopFlag) -> None:
        """Give the schedulers up to CONNECT_WAIT seconds to connect before serving (bounded)."""
        deadline = time.monotonic() + CONNECT_WAIT
        poller = zmq.Poller()
        monitors = {self.workers[rank].monitor: rank for rank in self._ranks}
        for mon in monitors:
            poller.register(mon, zmq.POLLIN)
        while not all(self.workers[r].connected for r in self._ranks) and not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in self._ranks if not self.workers[r].connected]
                log.warning("workers %s are not connected after %.0f s: requests go to the others until they "
                            "are", missing, CONNECT_WAIT)
                return
            for sock, _ in poller.poll(int(1000 * min(left, 0.05))):
                self._on_monitor(monitors[sock], time.monotonic())

    # -- acknowledgements (with a board) ---------------------------------------------------------------

    def _start_epochs(self) -> None:
        records = self.acks.read_array()
        for rank in self._ranks:
            st = int(records["status"][rank])
            self.ledger.start(rank, int(records["num_received_reqs"][rank]) if st in (_LIVE, _STALE) else 0)

    def _read_acks(self, now: float) -> None:
        records = self.acks.read_array()
        status, received = records["status"], records["num_received_reqs"]
        ledger = self.ledger
        for rank in self._ranks:
            st = int(status[rank])
            if st == _LIVE or st == _STALE:
                if ledger.pending[rank] or ledger.uncounted[rank]:
                    ledger.observe(rank, int(received[rank]))
            stale = st == _STALE or st == _TORN
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
        self.stats["delivered"] = ledger.delivered

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
            if req.lost > self.max_redeliveries:
                self.stats["redelivery_exhausted"] += 1
                who = "a scheduler whose connection" if req.lost == 1 else f"{req.lost} schedulers whose connections"
                self._reject(req.rid, f"the request was lost by {who} broke before acknowledging it; it is not sent "
                                      f"again (max_redeliveries {self.max_redeliveries})")
                continue
            self.stats["redelivered"] += 1
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
        log.info("controller: method %s, %d worker slots (active %s), input %s, errors %s, acknowledgements %s",
                 self.dispatcher.described, self.dispatcher.num_workers, list(self.dispatcher.active),
                 self.input.endpoint, self.error_endpoint, "from the board" if self.acks is not None else "none")
        poller = zmq.Poller()
        poller.register(self.input.socket, zmq.POLLIN)
        monitor_rank = {}
        for rank in self._ranks:
            poller.register(self.workers[rank].monitor, zmq.POLLIN)
            monitor_rank[self.workers[rank].monitor] = rank
        loads = None
        if self.collector is not None:
            loads = self.collector.socket
            poller.register(loads, zmq.POLLIN)
            log.info("controller: owns the load fan-in PULL %s", getattr(self.collector, "endpoint", loads))
        next_log = time.monotonic() + self.log_every
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
                        self.input.service()
                    if self.input.socket in ready:
                        self._serve_ready()
                    if self.dispatcher.held:
                        self._place(self.dispatcher.due())
                    if self.session.due(now):
                        self.session.publish()
                    if now >= next_log:
                        next_log = now + self.log_every
                        self._log_counts()
        finally:
            self._release_held()
            if self.ledger is not None:
                self._read_acks(time.monotonic())
                self.stats["unacknowledged"] = self.ledger.unacknowledged()
                self.stats["untracked"] = self.ledger.untracked
            self._log_counts()
            self._frame_log.flush()
            self.stats["input"] = self.input.peer_stats
            self.stats["log_held_back"] = self._frame_log.held_back_total
            self.session.publish()
            if self.collector is not None and hasattr(self.collector, "stats"):
                self.stats["collector"] = self.collector.stats()
        return self.stats

    @property
    def dispatcher(self) -> Dispatcher:
        return self.session.dispatcher

    def _poll_ms(self) -> int:
        """The poll's timeout: the loop's interval, or less when a held wave is due sooner."""
        due = self.dispatcher.next_due_at()
        if due is None:
            return self.poll_ms
        return max(0, min(self.poll_ms, int(math.ceil((due - self.dispatcher.clock()) * 1000))))

    def _release_held(self) -> None:
        """The requests a wave still holds go out now (or are answered, when no rank takes them):
        the controller is stopping, and nothing it holds is lost."""
        held = self.dispatcher.release_all()
        self.stats["released_at_stop"] += len(held)
        self._count_held()
        self._place(held)

    def _count_held(self) -> None:
        wave = self.dispatcher.wave
        if wave is not None:
            self.stats["held"] = self._held_before + wave.held_total

    def _use_dispatcher(self, new: Dispatcher) -> None:
        """Dispatch with ``new`` from the next batch on: ``auto`` changed. The session hands it the
        ranks' availability and stamps the record; what was sent stays in the delivery ledger,
        which is the controller's. What the old one held goes out with the new one's picks."""
        held = self.dispatcher.release_all()
        self._count_held()
        if self.dispatcher.wave is not None:
            self._held_before += self.dispatcher.wave.held_total
        self.session.use(new)
        self.availability.forget_told()
        for rank in self._ranks:
            self._update_status(rank)
        self._place(held)

    def _serve_ready(self) -> None:
        reqs: list[Request] = []
        for frame, fd in self.input.receive(self.max_batch):
            self.stats["received"] += 1
            try:
                if frame is None:
                    raise MalformedFrame("a message of several frames, expected 1")
                reqs.append(decode_request(frame, self._block_size))
                self.input.prove(fd, Proof.VALID)
            except RequestRefused as e:
                self.input.prove(fd, Proof.VALID)  # well-formed: a real client, with a request too large
                self._reject(e.rid, str(e))
            except MalformedFrame as e:
                self.input.prove(fd, Proof.SPOKE)
                self.stats["malformed"] += 1
                self.session.rejected()
                if e.rid is None:
                    self._frame_log.warning("dropped a malformed request frame: %s", str(e))
                else:
                    self._frame_log.warning("dropped a malformed request frame (rid %s, answered): %s", shown(e.rid),
                                            str(e))
                    self._send_error(e.rid, f"malformed request frame: {e}")
        if not reqs:
            return
        self._place(self.dispatcher.offer(reqs))
        self._count_held()

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
        for _ in range(len(self._ranks) + 1):
            try:
                rank = self.dispatcher.dispatch(req)
            except DpboardError as e:
                self._reject(req.rid, str(e))
                return
            if rank in tried:  # pinned to a rank that does not take it now
                self.dispatcher.retract(rank, req)
                why = self.availability.why_not(rank, self.workers[rank])
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
        pipe = self.workers[rank]
        if pipe is None or not pipe.connected or rank in self.availability.draining:
            return False
        if not pipe.send(req.raw):
            return False
        if pipe.backlogged:  # this send took it to its bound: no more until it takes its backlog
            self.stats["backlogged"] += 1
            self._update_status(rank)
        self.stats["dispatched"] += 1
        self.stats["per_rank"][rank] += 1
        self.session.picked(rank, routed=req.routed_dp_rank is not None, with_room=req.bootstrap_room is not None)
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
        self.stats["retracted"] += n
        self.stats["send_dropped"] += n
        self.session.count_fallbacks(n)
        pipe = self.workers[rank]
        if pipe is not None and pipe.connected and not pipe.backlogged and rank not in self.availability.draining:
            self.availability.full.add(rank)
        self._update_status(rank)

    def _reject(self, rid: Any, error: str) -> None:
        self.stats["rejected"] += 1
        self.session.rejected()
        self._frame_log.warning("request %s rejected: %s", shown(rid), error)
        self._send_error(rid, error)

    def _send_error(self, rid: Any, error: str) -> None:
        if self.errors is None:
            self.stats["errors_unsent"] += 1
            return
        if not self.errors.send(msgpack.packb({"rid": rid, "error": error}, use_bin_type=True)):
            self.stats["errors_unsent"] += 1

    def _log_counts(self) -> None:
        s = self.stats
        log.info("controller: received %d, dispatched %d, delivered %d, redelivered %d (%d lost too often), "
                 "malformed %d, rejected %d, retracted %d, per rank %s", s["received"], s["dispatched"],
                 s["delivered"], s["redelivered"], s["redelivery_exhausted"], s["malformed"], s["rejected"],
                 s["retracted"], s["per_rank"])
        if self.dispatcher.wave is not None:
            log.info("controller: held %d for waves, %d holding now, %d placed at stop", s["held"],
                     self.dispatcher.held, s["released_at_stop"])
        if self.collector is not None and hasattr(self.collector, "stats"):
            c = self.collector.stats()
            log.info("controller: load fan-in frames %d ok, %d bad; snapshots %d",
                     c["frames_ok"], c["frames_bad"], c["snapshots_ok"])

    def close(self) -> None:
        """Close every socket (queued requests get at most a second to leave) and release the input."""
        self._close(linger=None)

    def _close(self, linger: int | None) -> None:
        """Everything opened so far; ``linger=0`` (an error path) waits for nothing."""
        for pipe in self._pipes():
            pipe.close(linger)
        self.workers = [None] * len(self.workers)
        self.errors = None
        if self.input is not None:
            self.input.close()
            self.input = None
        if self._own_context and not self.context.closed:
            self.context.term()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> DataParallelController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
