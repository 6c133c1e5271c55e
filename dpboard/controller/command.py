"""``dpboard controller``: the command line of the ZMQ controller (``DataParallelController``).

``add_arguments`` and ``run`` are what ``dpboard.cli`` calls. ``run`` checks everything that needs
no socket first, takes the board (one controller per board), then attaches it (a
``dpboard.board.BoardFollower``: the board is followed when it is recreated), hosts the collector
with ``--collect-bind``, builds the Dispatcher (``auto`` following the board where it may) inside a
``DispatchSession`` with the board's dispatch record, and serves until a signal or ``--duration``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

from dpboard.board.stale import stale_after
from dpboard.controller.auto import AUTO_CHECK_INTERVAL, AutoMethod
from dpboard.controller.connections import (
    DEFAULT_MAX_INPUT_MIB,
    DEFAULT_MAX_QUEUED_MIB,
    MAX_INPUT_MIB,
    MAX_QUEUED_MIB,
    MIN_INPUT_MIB,
)
from dpboard.controller.dispatcher import (
    DEFAULT_LOCKSTEP_HORIZON,
    DEFAULT_REFRESH_INTERVAL,
    DELAYER_LOCKSTEP_HORIZON,
    Dispatcher,
    default_lockstep_horizon,
)
from dpboard.controller.process import (
    DEFAULT_MAX_REDELIVERIES,
    DEFAULT_SEND_HWM,
    MAX_REDELIVERIES,
    MAX_SEND_HWM,
    RESERVED,
    ControllerBusyError,
    ControllerSettings,
    DataParallelController,
)
from dpboard.controller.session import DispatchSession
from dpboard.controller.wave import DEFAULT_WAVE_HOLD, DEFAULT_WAVE_PER_RANK, MAX_WAVE_HOLD, MAX_WAVE_PER_RANK
from dpboard.errors import InvalidInputError
from dpboard.methods import (
    AUTO,
    DISAGGREGATION_MODES,
    METHOD_CHOICES,
    ReaderOwner,
    parse_load_balance_method,
    resolve_load_balance_method,
    zmq_reader_owner,
)
from dpboard.multinode.peers import DEFAULT_MAX_PEERS
from dpboard.options import count, seconds
from dpboard.ownership import OwnerLock, check_endpoint, lock_path
from dpboard.stopping import StopFlag

log = logging.getLogger("dpboard.controller")


def board_lock_path(board_name: str) -> Path:
    """The lock a controller holds on its board: one controller per board (and so per set of
    schedulers), since two would each count the other's sends as their own deliveries."""
    return lock_path("controller.board", board_name)


def take_board(board_name: str) -> OwnerLock:
    """This process is ``board_name``'s one controller; ``ControllerBusyError`` names the other."""
    return OwnerLock(board_lock_path(board_name), f"board {board_name!r}", busy=ControllerBusyError,
                     role="a controller",
                     hint="two controllers sending to the same schedulers disagree about what each received "
                          "(their ledgers and acknowledgements): stop that one, or give each its own board")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, metavar="ENDPOINT",
                   help="ZMQ endpoint to bind the request PULL socket on, e.g. ipc:///tmp/dp-in")
    p.add_argument("--workers", nargs="+", required=True, metavar="ENDPOINT",
                   help=f"one endpoint per worker slot, in rank order, where that scheduler's PULL is bound "
                        f"({RESERVED!r} for a reserved slot)")
    p.add_argument("--errors", metavar="ENDPOINT",
                   help="ZMQ endpoint where the tokenizer side's PULL for {rid, error} answers is bound")
    p.add_argument("--method", "--load-balance-method", dest="method", default="auto", choices=METHOD_CHOICES,
                   help="dispatch method (default auto). Which for which deployment (docs/DISPATCH.md, "
                        "'When to use which'): independent ranks, TTFT first: inflight_cache "
                        "(inflight_backlog without prefix reuse); PD prefill: inflight_cache through "
                        "SGLang's bootstrap registration rather than auto's follow_bootstrap_room; PD "
                        "decode: auto (round_robin) or inflight_cache, equal there; DP attention with "
                        "prefill and decode on the same ranks (ranks in lockstep): inflight_lockstep, "
                        "what auto picks there")
    p.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=None,
                   help="the ranks step in lockstep (SGLang's DP attention, vLLM's MoE DP): auto picks "
                        "inflight_lockstep (default: as the --board's slots say, looked at again every "
                        f"{AUTO_CHECK_INTERVAL:g} s: auto changes when their lockstep sections appear or go)")
    p.add_argument("--prefill-delayer", action="store_true",
                   help="the engines run SGLang's --enable-prefill-delayer: inflight_lockstep's horizon "
                        f"defaults to {DELAYER_LOCKSTEP_HORIZON} group steps")
    p.add_argument("--lockstep-horizon", type=count(0, 10_000), default=None, metavar="STEPS",
                   help="inflight_lockstep: group steps to the first token within which any rank is as good as "
                        f"the earliest (default {DEFAULT_LOCKSTEP_HORIZON}, {DELAYER_LOCKSTEP_HORIZON} with "
                        "--prefill-delayer)")
    p.add_argument("--wave-max-hold", type=seconds(MAX_WAVE_HOLD, zero=True), default=DEFAULT_WAVE_HOLD, metavar="SECONDS",
                   help="inflight_wave: the longest a request is held for its wave, less one group step "
                        f"(default {DEFAULT_WAVE_HOLD:g}: 0.4 of a 5 s TTFT objective)")
    p.add_argument("--wave-per-rank", type=count(1, MAX_WAVE_PER_RANK), default=DEFAULT_WAVE_PER_RANK, metavar="N",
                   help=f"inflight_wave: a wave is full with N held requests per rank (default {DEFAULT_WAVE_PER_RANK})")
    p.add_argument("--disaggregation-mode", default="null", choices=DISAGGREGATION_MODES,
                   help="PD role of this server (null: no PD)")
    p.add_argument("--board", help="the schedulers' board: loads for load-aware methods, and with any method "
                                   "the received counts that acknowledge deliveries (docs/DISPATCH.md, Delivery)")
    p.add_argument("--trust-uid", type=count(0, 2**32 - 2), action="append", default=[], metavar="UID",
                   help="also attach a --board that this user created (e.g. 0 for root); repeatable")
    p.add_argument("--stale-after", type=stale_after, default=1.0,
                   help="seconds before a slot is stale (default 1)")
    p.add_argument("--refresh-interval", type=seconds(zero=True), default=DEFAULT_REFRESH_INTERVAL,
                   help="seconds between budget refreshes from the board (default 0.02; 0: every dispatch)")
    p.add_argument("--inflight-accounting", action=argparse.BooleanOptionalAction, default=None,
                   help="add requests sent but not yet received to each rank's load (default: on for inflight_*)")
    p.add_argument("--health-aware", action=argparse.BooleanOptionalAction, default=None,
                   help="never pick a stale or torn slot (default: on for inflight_*)")
    p.add_argument("--rotate-ties", action=argparse.BooleanOptionalAction, default=None,
                   help="equal loads rotate instead of favouring rank 0 (default: on for inflight_*)")
    p.add_argument("--max-redeliveries", type=count(0, MAX_REDELIVERIES), default=DEFAULT_MAX_REDELIVERIES,
                   help=f"times a request lost by a scheduler whose connection broke is sent to another rank; "
                        f"then it is answered on --errors (default {DEFAULT_MAX_REDELIVERIES}; with --board)")
    p.add_argument("--send-hwm", type=count(1, MAX_SEND_HWM), default=DEFAULT_SEND_HWM,
                   help=f"requests queued per scheduler before a send fails and the request goes elsewhere "
                        f"(default {DEFAULT_SEND_HWM})")
    p.add_argument("--max-queued-mib", type=count(1, MAX_QUEUED_MIB), default=DEFAULT_MAX_QUEUED_MIB, metavar="MIB",
                   help=f"MiB of requests queued in this process for one scheduler that it has not taken; a "
                        f"scheduler at this bound counts as unavailable (its requests go elsewhere) until it "
                        f"takes all but half (default {DEFAULT_MAX_QUEUED_MIB}: 4 GiB for a 64-rank node); the "
                        f"same bound holds --errors answers")
    p.add_argument("--max-input-mib", default=DEFAULT_MAX_INPUT_MIB, metavar="MIB",
                   type=count(MIN_INPUT_MIB, MAX_INPUT_MIB,
                              hint=f"room for one frame of the largest size ({MIN_INPUT_MIB} MiB) at least"),
                   help=f"MiB of requests received on one --input connection and not yet read: ZMQ's receive "
                        f"high-water mark is this over the largest frame ({MIN_INPUT_MIB} MiB; default "
                        f"{DEFAULT_MAX_INPUT_MIB}: {DEFAULT_MAX_INPUT_MIB // MIN_INPUT_MIB} frames); a sender "
                        f"beyond it waits")
    p.add_argument("--max-peers", type=count(1, 2**20), default=None, metavar="N",
                   help=f"connections held at once on --input (default {DEFAULT_MAX_PEERS}, never more than the "
                        f"fds `ulimit -n` leaves less 64); beyond it those that sent no valid request go first")
    p.add_argument("--collect-bind", metavar="ENDPOINT",
                   help="own node0's load fan-in PULL here (load-aware methods): relays' snapshots go into "
                        "--board, as `dpboard collect` would do; e.g. tcp://10.0.0.1:5757")
    p.add_argument("--collect-curve-secret-key", metavar="FILE",
                   help="with --collect-bind: this node's CURVE certificate (.key_secret), as `dpboard collect "
                        "--curve-secret-key`")
    p.add_argument("--collect-curve-authorized-keys", metavar="DIR",
                   help="with --collect-bind: directory of the relays' public certificates allowed in")
    p.add_argument("--collect-curve-key-nodes", metavar="FILE",
                   help="with --collect-curve-authorized-keys: which node ids each key speaks for, as `dpboard "
                        "collect --curve-key-nodes` (default: node<N>.key speaks for node N)")
    p.add_argument("--duration", type=seconds(), help="exit after this many seconds (default: until SIGTERM)")
    p.add_argument("--log-every", type=seconds(), default=10.0, help="seconds between count logs (default 10)")
    p.add_argument("--stats-json", action="store_true", help="print the final counts as one JSON line on stdout")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    method = resolve_load_balance_method(args.method, args.disaggregation_mode)
    endpoints = [None if e == RESERVED else e for e in args.workers]
    owner = zmq_reader_owner(method, args.disaggregation_mode, dp_size=len(endpoints))
    if args.collect_bind is None and (args.collect_curve_secret_key or args.collect_curve_authorized_keys
                                      or args.collect_curve_key_nodes):
        raise InvalidInputError("--collect-curve-* options configure the load fan-in: give --collect-bind ENDPOINT too")
    if args.collect_bind is not None and owner is not ReaderOwner.CONTROLLER:
        why = (f"method {method.value} does not read loads" if not method.is_load_aware
               else "a controller of a single rank reads no loads")
        raise InvalidInputError(
            f"--collect-bind: {why}, so this controller does not own the load fan-in PULL socket; run "
            f"`dpboard collect --board NAME --bind {args.collect_bind}` instead (or let the tokenizer-side "
            f"process own it)"
        )
    if method.is_load_aware and not args.board:
        raise InvalidInputError(f"--method {method.value} reads loads: give --board NAME (the board the "
                                "schedulers publish to)")
    # Every check that needs no socket, before any is opened.
    check_endpoint(args.input, "--input", bind=True)
    for rank, endpoint in enumerate(endpoints):
        if endpoint is not None:
            check_endpoint(endpoint, f"--workers (rank {rank})", bind=False)
    if args.errors is not None:
        check_endpoint(args.errors, "--errors", bind=False)
    # One controller per board, before anything is attached or bound: a second one stops here.
    board_lock = take_board(args.board) if args.board else None
    # Signals count from here: one that comes while the sockets and the record are being set up ends
    # the loop as soon as it starts, and everything is closed and removed as after any stop.
    try:
        with StopFlag() as starting:
            return _attach_and_serve(args, method, endpoints, owner, starting.event)
    finally:
        if board_lock is not None:
            board_lock.release()


def _attach_and_serve(args: argparse.Namespace, method: Any, endpoints: list[str | None], owner: ReaderOwner,
                      stop: threading.Event) -> int:
    follower = None
    reader = None
    collector = None
    if args.board:
        from dpboard.board import BoardFollower, FollowingReader

        follower = BoardFollower(args.board, min_slots=len(endpoints), trust_uids=args.trust_uid, logger=log)
        if follower.board.n_slots < len(endpoints):
            n_slots = follower.board.n_slots
            follower.close()
            raise InvalidInputError(f"board {args.board!r} has {n_slots} slots, fewer than the {len(endpoints)} "
                                    f"--workers: give one board slot per worker slot")
        reader = FollowingReader(follower, stale_after=args.stale_after, n_slots=len(endpoints))
        if args.collect_bind is not None:
            from dpboard.multinode.collector import Collector

            try:
                collector = Collector(follower.board, args.collect_bind,
                                      curve_secret_key=args.collect_curve_secret_key,
                                      curve_authorized_keys=args.collect_curve_authorized_keys,
                                      curve_key_nodes=args.collect_curve_key_nodes)
            except BaseException:
                follower.close()
                raise
        elif owner is ReaderOwner.CONTROLLER:
            log.info("load-aware method: the load fan-in PULL on node0 belongs to this controller "
                     "(give --collect-bind ENDPOINT to receive other nodes' relays)")
    try:
        return _serve(args, method, endpoints, reader, collector, stop)
    finally:
        if collector is not None:
            collector.close()  # removes its lock files
        if follower is not None:
            follower.close()


def _serve(args: argparse.Namespace, method: Any, endpoints: list[str | None], reader: Any, collector: Any,
           stop: threading.Event) -> int:
    # The board's dispatch record, for dpboard doctor, top and /metrics: the controller counts every
    # request it hands to a rank (a redelivered one again), whatever its budget counts, and the row
    # reads its counts (DataParallelController.counts).
    if args.board:
        session = DispatchSession.with_record(
            args.board, len(endpoints), method=method.value, mode=args.disaggregation_mode,
            refresh_interval=args.refresh_interval, trust_uids=tuple(args.trust_uid), logger=log)
    else:
        session = DispatchSession(logger=log)
    try:
        ticking = None if reader is None else session.reader(reader)

        def build(method: Any) -> Dispatcher:
            return Dispatcher(
                method,
                len(endpoints),
                reader=ticking if method.is_load_aware else None,
                active=[r for r, e in enumerate(endpoints) if e is not None],
                refresh_interval=args.refresh_interval,
                inflight_accounting=args.inflight_accounting,
                health_aware=args.health_aware,
                rotate_ties=args.rotate_ties,
                lockstep_horizon=(default_lockstep_horizon(args.prefill_delayer) if args.lockstep_horizon is None
                                  else args.lockstep_horizon),
                wave_max_hold=args.wave_max_hold,
                wave_per_rank=args.wave_per_rank,
            )

        auto = None
        if parse_load_balance_method(args.method) == AUTO:
            # auto for ranks in lockstep (--lockstep, or the board's lockstep sections as they are):
            # inflight_lockstep; the schedulers usually publish after the controller starts
            auto = AutoMethod(build, reader, len(endpoints), args.disaggregation_mode, lockstep=args.lockstep,
                              logger=log)
            dispatcher = auto.dispatcher
            if auto.follows_board:
                log.info("auto: method %s for now; the board's lockstep sections are looked at again every %g s",
                         dispatcher.described, AUTO_CHECK_INTERVAL)
            else:
                auto = None
        else:
            dispatcher = build(method)
        session.use(dispatcher)
        settings = ControllerSettings(
            send_hwm=args.send_hwm, max_queued_mib=args.max_queued_mib, max_input_mib=args.max_input_mib,
            max_peers=args.max_peers, log_every=args.log_every, max_redeliveries=args.max_redeliveries)
        controller = DataParallelController(dispatcher, endpoints, args.input, args.errors, settings=settings,
                                            acks=reader, collector=collector, session=session, auto=auto)
        try:
            stats = controller.run(duration=args.duration, stop=stop)
        finally:
            controller.close()
    finally:
        session.close()
    if args.stats_json:
        print(json.dumps(stats), flush=True)
    return 0


add_controller_arguments = add_arguments
run_controller = run
