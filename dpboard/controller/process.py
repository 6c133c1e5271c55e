"""``DataParallelController``: the ZMQ shell around the Dispatcher, and ``dpboard controller``.

Tokenizer side --PUSH--> [PULL, bound here] controller --PUSH (connected)--> scheduler rank k [PULL, bound]

A request is one msgpack frame: a map with ``rid`` and ``input_ids`` (a list) or ``num_tokens``, and
optionally ``routed_dp_rank`` and ``bootstrap_room``; other keys pass through untouched, because the
controller forwards the frame's original bytes. Replies never pass through the controller. A frame
that is not such a map is logged, counted and dropped; a request that cannot be dispatched (an
invalid routed rank, no available rank, a full scheduler pipe) is answered ``{"rid", "error"}`` on
the error channel if there is one: a PUSH the controller connects to the tokenizer side's bound PULL
(connected, so that answers queue from the start instead of being lost before a peer appears).
Neither ever stops the loop. A request whose send fails is taken back out of the rank's load
(``Dispatcher.retract``): the rank never got it.

With a load-aware method the controller is node0's single owner of the relays' load PULL socket
(SPEC 6): ``--collect-bind`` hosts a ``dpboard.multinode.collector.Collector`` in this process, polled in the
same loop as the requests.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from dpboard.controller.codec import MalformedFrame, Request, decode_request
from dpboard.controller.dispatcher import DEFAULT_REFRESH_INTERVAL, Dispatcher
from dpboard.controller.methods import (
    DISAGGREGATION_MODES,
    METHOD_CHOICES,
    ReaderOwner,
    resolve_load_balance_method,
    zmq_reader_owner,
)
from dpboard.errors import DpboardError, InvalidInputError, UnavailableError
from dpboard.stopping import StopFlag

log = logging.getLogger("dpboard.controller")

RESERVED = "-"  # a worker endpoint placeholder for a reserved (elastic EP) slot with no scheduler yet
DEFAULT_SEND_HWM = 100_000
DEFAULT_MAX_BATCH = 1024


class DataParallelController:
    """Receives tokenized requests, picks a rank with the Dispatcher, forwards each frame.

    ``worker_endpoints[k]`` is where scheduler rank k's PULL socket is bound (``None`` for a reserved
    slot); the controller connects a PUSH to each. ``input_endpoint`` is bound (PULL);
    ``error_endpoint``, when given, is where the tokenizer side's PULL is bound: the controller
    connects a PUSH there for ``{rid, error}`` answers.

    ``collector``, when given, is a ``dpboard.multinode.collector.Collector`` (anything with ``socket`` and
    ``drain()``) whose socket this loop polls beside the input; its owner creates and closes it.
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
        max_batch: int = DEFAULT_MAX_BATCH,
        poll_interval: float = 0.05,
        log_every: float = 10.0,
        collector: Any = None,
    ):
        if len(worker_endpoints) != dispatcher.num_workers:
            raise InvalidInputError(
                f"{len(worker_endpoints)} worker endpoints for a dispatcher of {dispatcher.num_workers} "
                f"worker slots: give one endpoint per slot ({RESERVED!r} for a reserved slot)"
            )
        absent = [r for r in dispatcher.active if worker_endpoints[r] is None]
        if absent:
            raise InvalidInputError(f"active ranks {absent} have no worker endpoint: give them one or leave them "
                             "out of the active set")
        if max_batch < 1:
            raise InvalidInputError(f"max_batch must be >= 1, got {max_batch}")
        self.dispatcher = dispatcher
        self.worker_endpoints = list(worker_endpoints)
        self.input_endpoint = input_endpoint
        self.error_endpoint = error_endpoint
        self.collector = collector
        self.max_batch = max_batch
        self.poll_ms = max(1, int(poll_interval * 1000))
        self.log_every = log_every
        self._own_context = context is None
        self.context = context or zmq.Context()
        self._stop = threading.Event()
        self.stats: dict[str, Any] = {
            "received": 0,
            "dispatched": 0,
            "malformed": 0,
            "rejected": 0,  # answered with an error (invalid routed rank, no available rank, ...)
            "send_dropped": 0,  # a scheduler's pipe was full: answered with an error
            "errors_unsent": 0,  # an error answer that could not be sent (no error channel, or full)
            "retracted": 0,  # picks taken back out of a rank's load because their send failed
            "per_rank": [0] * dispatcher.num_workers,
        }
        self.input = self.context.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.workers: list[zmq.Socket | None] = []
        self.errors: zmq.Socket | None = None
        try:
            self.input.bind(input_endpoint)
            for endpoint in self.worker_endpoints:
                if endpoint is None:
                    self.workers.append(None)
                    continue
                sock = self.context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, send_hwm)
                sock.setsockopt(zmq.LINGER, 1000)  # give queued requests a second to leave on close
                sock.connect(endpoint)
                self.workers.append(sock)
            if error_endpoint is not None:
                self.errors = self.context.socket(zmq.PUSH)
                self.errors.setsockopt(zmq.LINGER, 1000)
                self.errors.connect(error_endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise UnavailableError(f"controller sockets: {e} (input {input_endpoint}, errors {error_endpoint})") from e

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

    def run(self, duration: float | None = None) -> dict[str, Any]:
        """Serve until ``stop()``, SIGTERM/SIGINT (in the main thread) or ``duration`` seconds."""
        stop = StopFlag(duration, event=self._stop)
        log.info("controller: method %s, %d worker slots (active %s), input %s, errors %s",
                 self.dispatcher.method.value, self.dispatcher.num_workers, list(self.dispatcher.active),
                 self.input_endpoint, self.error_endpoint)
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        loads = None
        if self.collector is not None:
            loads = self.collector.socket
            poller.register(loads, zmq.POLLIN)
            log.info("controller: owns the load fan-in PULL %s", getattr(self.collector, "endpoint", loads))
        next_log = time.monotonic() + self.log_every
        try:
            with stop:
                while not stop.is_set():
                    ready = dict(poller.poll(self.poll_ms))
                    # loads first: a request batch then sees the freshest relayed snapshots
                    if loads is not None and loads in ready:
                        self.collector.drain()
                    if self.input in ready:
                        self._serve_ready()
                    if time.monotonic() >= next_log:
                        next_log = time.monotonic() + self.log_every
                        self._log_counts()
        finally:
            self._log_counts()
            if self.collector is not None and hasattr(self.collector, "stats"):
                self.stats["collector"] = self.collector.stats()
        return self.stats

    def _serve_ready(self) -> None:
        reqs: list[Request] = []
        for _ in range(self.max_batch):
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self.stats["received"] += 1
            try:
                if len(frames) != 1:
                    raise MalformedFrame(f"{len(frames)} frames in one message, expected 1")
                reqs.append(decode_request(frames[0], self._block_size))
            except MalformedFrame as e:
                self.stats["malformed"] += 1
                log.warning("dropped a malformed request frame: %s", e)
        if not reqs:
            return
        try:
            ranks = self.dispatcher.dispatch_batch(reqs)
        except DpboardError:
            # the batch is all or nothing: take it one by one to answer only the requests that fail
            for req in reqs:
                try:
                    rank = self.dispatcher.dispatch(req)
                except DpboardError as e:
                    self._reject(req.rid, str(e))
                    continue
                if not self._send(rank, req):
                    self.dispatcher.retract(rank, req)  # the latest pick of that rank: exact
                    self.stats["retracted"] += 1
            return
        self._send_batch(ranks, reqs)

    def _send_batch(self, ranks: list[int], reqs: list[Request]) -> None:
        """Send each request to its rank; take the ones that could not leave back out of the load.

        Once a rank refuses a send (full queue, or no worker) the rest of the batch is not offered
        to it either: it would refuse them too, and this way the refused picks are always that
        rank's latest ones, which ``Dispatcher.retract`` undoes exactly (latest first)."""
        refused: dict[int, list[Request]] = {}
        for rank, req in zip(ranks, reqs, strict=True):
            later = refused.get(rank)
            if later is not None:
                later.append(req)
                self._reject_unsent(rank, req)
            elif not self._send(rank, req):
                refused[rank] = [req]
        for rank, failed in refused.items():
            for req in reversed(failed):
                self.dispatcher.retract(rank, req)
            self.stats["retracted"] += len(failed)

    def _send(self, rank: int, req: Request) -> bool:
        """True when the frame is on its way to ``rank``; False when it was answered with an error."""
        sock = self.workers[rank]
        if sock is not None:
            try:
                sock.send(req.raw, zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                self.stats["dispatched"] += 1
                self.stats["per_rank"][rank] += 1
                return True
        self._reject_unsent(rank, req)
        return False

    def _reject_unsent(self, rank: int, req: Request) -> None:
        """Answer a request that ``rank`` cannot take: it has no worker, or its queue is full."""
        if self.workers[rank] is None:  # follow_bootstrap_room can map a room onto a reserved slot
            self._reject(req.rid, f"DP rank {rank} has no worker (a reserved slot)")
            return
        self.stats["send_dropped"] += 1
        self._reject(req.rid, f"DP rank {rank} is not taking requests (its queue is full)")

    def _reject(self, rid: Any, error: str) -> None:
        self.stats["rejected"] += 1
        log.warning("request %r rejected: %s", rid, error)
        if self.errors is None:
            self.stats["errors_unsent"] += 1
            return
        try:
            self.errors.send(msgpack.packb({"rid": rid, "error": error}, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            self.stats["errors_unsent"] += 1

    def _log_counts(self) -> None:
        s = self.stats
        log.info("controller: received %d, dispatched %d, malformed %d, rejected %d, retracted %d, per rank %s",
                 s["received"], s["dispatched"], s["malformed"], s["rejected"], s["retracted"], s["per_rank"])
        if self.collector is not None and hasattr(self.collector, "stats"):
            c = self.collector.stats()
            log.info("controller: load fan-in frames %d ok, %d bad; snapshots %d",
                     c["frames_ok"], c["frames_bad"], c["snapshots_ok"])

    def close(self) -> None:
        for sock in [self.input, self.errors, *self.workers]:
            if sock is not None and not sock.closed:
                sock.close()
        if self._own_context:
            self.context.term()

    def __enter__(self) -> DataParallelController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, metavar="ENDPOINT",
                   help="ZMQ endpoint to bind the request PULL socket on, e.g. ipc:///tmp/dp-in")
    p.add_argument("--workers", nargs="+", required=True, metavar="ENDPOINT",
                   help=f"one endpoint per worker slot, in rank order, where that scheduler's PULL is bound "
                        f"({RESERVED!r} for a reserved slot)")
    p.add_argument("--errors", metavar="ENDPOINT",
                   help="ZMQ endpoint where the tokenizer side's PULL for {rid, error} answers is bound")
    p.add_argument("--method", "--load-balance-method", dest="method", default="auto", choices=METHOD_CHOICES,
                   help="dispatch method (default auto); see docs/DISPATCH.md")
    p.add_argument("--disaggregation-mode", default="null", choices=DISAGGREGATION_MODES,
                   help="PD role of this server (null: no PD)")
    p.add_argument("--board", help="board to read loads from (load-aware methods)")
    p.add_argument("--stale-after", type=float, default=1.0, help="seconds before a slot is stale (default 1)")
    p.add_argument("--refresh-interval", type=float, default=DEFAULT_REFRESH_INTERVAL,
                   help="seconds between budget refreshes from the board (default 0.02)")
    p.add_argument("--inflight-accounting", action=argparse.BooleanOptionalAction, default=None,
                   help="add requests sent but not yet received to each rank's load (default: on for inflight_*)")
    p.add_argument("--health-aware", action=argparse.BooleanOptionalAction, default=None,
                   help="never pick a stale or torn slot (default: on for inflight_*)")
    p.add_argument("--rotate-ties", action=argparse.BooleanOptionalAction, default=None,
                   help="equal loads rotate instead of favouring rank 0 (default: on for inflight_*)")
    p.add_argument("--send-hwm", type=int, default=DEFAULT_SEND_HWM,
                   help=f"requests queued per scheduler before a send fails and is answered with an error "
                        f"(default {DEFAULT_SEND_HWM})")
    p.add_argument("--collect-bind", metavar="ENDPOINT",
                   help="own node0's load fan-in PULL here (load-aware methods): relays' snapshots go into "
                        "--board, as `dpboard collect` would do; e.g. tcp://10.0.0.1:5757")
    p.add_argument("--collect-curve-secret-key", metavar="FILE",
                   help="with --collect-bind: this node's CURVE certificate (.key_secret), as `dpboard collect "
                        "--curve-secret-key`")
    p.add_argument("--collect-curve-authorized-keys", metavar="DIR",
                   help="with --collect-bind: directory of the relays' public certificates allowed in")
    p.add_argument("--duration", type=float, help="exit after this many seconds (default: until SIGTERM)")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between count logs (default 10)")
    p.add_argument("--stats-json", action="store_true", help="print the final counts as one JSON line on stdout")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    method = resolve_load_balance_method(args.method, args.disaggregation_mode)
    endpoints = [None if e == RESERVED else e for e in args.workers]
    owner = zmq_reader_owner(method, args.disaggregation_mode, dp_size=len(endpoints))
    if args.collect_bind is None and (args.collect_curve_secret_key or args.collect_curve_authorized_keys):
        raise InvalidInputError("--collect-curve-* options configure the load fan-in: give --collect-bind ENDPOINT too")
    if args.collect_bind is not None and owner is not ReaderOwner.CONTROLLER:
        why = (f"method {method.value} does not read loads" if not method.is_load_aware
               else "a controller of a single rank reads no loads")
        raise InvalidInputError(
            f"--collect-bind: {why}, so this controller does not own the load fan-in PULL socket; run "
            f"`dpboard collect --board NAME --bind {args.collect_bind}` instead (or let the tokenizer-side "
            f"process own it)"
        )
    reader = None
    board = None
    collector = None
    if method.is_load_aware:
        if not args.board:
            raise InvalidInputError(f"--method {method.value} reads loads: give --board NAME (the board the "
                             "schedulers publish to)")
        from dpboard.board import Board

        board = Board.attach(args.board)
        reader = board.reader(stale_after=args.stale_after)
        if args.collect_bind is not None:
            from dpboard.multinode.collector import Collector

            try:
                collector = Collector(board, args.collect_bind, curve_secret_key=args.collect_curve_secret_key,
                                      curve_authorized_keys=args.collect_curve_authorized_keys)
            except BaseException:
                board.close()
                raise
        elif owner is ReaderOwner.CONTROLLER:
            log.info("load-aware method: the load fan-in PULL on node0 belongs to this controller "
                     "(give --collect-bind ENDPOINT to receive other nodes' relays)")
    try:
        return _serve(args, method, endpoints, reader, collector)
    finally:
        if collector is not None:
            collector.close()  # removes its lock files
        if board is not None:
            board.close()


def _serve(args: argparse.Namespace, method: Any, endpoints: list[str | None], reader: Any, collector: Any) -> int:
    dispatcher = Dispatcher(
        method,
        len(endpoints),
        reader=reader,
        active=[r for r, e in enumerate(endpoints) if e is not None],
        refresh_interval=args.refresh_interval,
        inflight_accounting=args.inflight_accounting,
        health_aware=args.health_aware,
        rotate_ties=args.rotate_ties,
    )
    controller = DataParallelController(dispatcher, endpoints, args.input, args.errors, send_hwm=args.send_hwm,
                                        log_every=args.log_every, collector=collector)
    try:
        stats = controller.run(duration=args.duration)
    finally:
        controller.close()
    if args.stats_json:
        print(json.dumps(stats), flush=True)
    return 0


add_controller_arguments = add_arguments
run_controller = run
