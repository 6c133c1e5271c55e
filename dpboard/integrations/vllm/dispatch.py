"""The API-server side, opt-in with ``DPBOARD_METHOD``: vLLM's load-balancing client picks its engine
through dpboard's ``Dispatcher`` reading the board.

``vllm.v1.engine.core_client.DPLBAsyncMPClient`` (vLLM 0.33.0; one per API-server process under
internal or hybrid load balancing) picks an engine in ``get_core_engine_for_request``. With
``DPBOARD_METHOD`` set, ``patch()`` wraps two of its methods:

- ``__init__`` (after): a ``ClientDispatch`` for the client: a ``Dispatcher`` with that method over
  the engines the client manages (``core_engines``, in rank order; an engine's identity is its global
  DP rank, 2 bytes little-endian), reading the board through ``GlobalInflightReader``, and this API
  server's row of the board's sent record (row ``client_index``, of ``client_count`` rows).
- ``get_core_engine_for_request``: vLLM's rules, in vLLM's order (core_client.py:1751-1802), with only
  the load-balancing loop replaced by the dispatcher's pick (vLLM's loop again while no engine of
  the client's is LIVE on the board: none has published yet, or the engine-side plugin is off):
  a resumable request opens or keeps a streaming-input session (``streaming_reqs``); a request id
  already in flight goes back to its engine (streaming-input affinity); an explicit
  ``data_parallel_rank``, else vLLM's late-interaction engine index, is taken as it is (and charged
  to the dispatcher); the chosen engine is recorded in ``reqs_in_flight`` and ``engine_inflight``,
  which vLLM's abort routing and ``process_engine_outputs`` keep using unchanged. Every request
  handed to an engine, affinity ones included, is counted in this server's row of the sent record:
  each is one ``ADD`` the engine core counts at its intake.

Without ``DPBOARD_METHOD`` nothing is patched: vLLM's pick runs as shipped. On vLLM 0.32, whose
client keeps no streaming-input sessions, the ``streaming_reqs`` step is left out, as vLLM's own pick
leaves it out there (versions.py).

dpboard never fails a request: an exception inside its pick or its accounting sends that request
through vLLM's own pick (``get_core_engine_for_request`` as shipped, vLLM's bookkeeping and all),
counted (``DispatchSession.faults``, and a fallback in the dispatch record ``dpboard doctor`` reads)
and logged at the 1st, 10th, 100th... time, the first with its traceback. ``shutdown`` (after
vLLM's) closes the server's rows; the last process of the deployment out removes the board and its
records (leaving.py).

An engine that leaves says so on the board (its slot reads STALE at once: engine_core.py); one
killed outright loses its slot's writer lock with its life, and ``GlobalInflightReader`` looks at
the slots' locks at its refreshes (``SlotLocks``: every ``LOCK_CHECK_INTERVAL``, 50 ms, at most; no
system call per pick) and reads a LIVE slot without a writer as STALE, so the dispatcher leaves
that engine at once rather than after the stale threshold.

The in-flight count that every server sees is global: ``GlobalInflightReader`` adds to each
engine's waiting requests ``sum over the sent record's rows - the engine's num_received_reqs``
(never below 0), and to its queued tokens that many times the mean tokens of the requests sent to
it. The dispatcher's own in-flight ledger is therefore off (``inflight_accounting=False``): between
two reads of the board its picks are charged speculatively, and each read replaces them with the
exact global count.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpboard.board import Board, BoardReader
from dpboard.board.segment import SlotLocks
from dpboard.board.sent import SentRecord, SentWriter
from dpboard.controller import Dispatcher, LoadBalanceMethod, resolve_load_balance_method
from dpboard.controller.dispatcher import DEFAULT_REFRESH_INTERVAL
from dpboard.controller.session import DispatchSession
from dpboard.errors import DpboardError, InvalidInputError, UnavailableError
from dpboard.integrations.vllm import versions
from dpboard.integrations.vllm.leaving import remove_if_gone
from dpboard.integrations.vllm.settings import (
    DEFAULT_STALE_AFTER,
    ENV_METHOD,
    board_name,
    dispatch_method,
    stale_after,
)
from dpboard.integrations.vllm.versions import SUPPORTED, Support
from dpboard.snapshot import SNAPSHOT_DTYPE, SlotStatus

log = logging.getLogger("dpboard.vllm")

_LIVE = int(SlotStatus.LIVE)
_STALE = int(SlotStatus.STALE)
STATE = "_dpboard_dispatch"  # the client's attribute holding its ClientDispatch
# seconds after a pick for the trailing turn: past the dispatch record's publish interval (0.1 s),
# so the row is due then whatever was published before the pick
TRAIL_S = 0.11
_open_here: Counter[str] = Counter()  # this process's open ClientDispatch objects, per board
CORE_CLIENT = "vllm.v1.engine.core_client"


class GlobalInflightReader:
    """The board's records of the engines ``ranks`` (in the client's order), each with the requests
    in flight to it from every sender added to its waiting requests and its queued tokens."""

    def __init__(self, reader: BoardReader, sent: SentRecord, ranks: Sequence[int],
                 row: SentWriter | None = None, locks: SlotLocks | None = None) -> None:
        self._reader = reader
        # the slots' writer locks, looked at every LOCK_CHECK_INTERVAL at most: an engine killed
        # outright is left at the next refresh, not after the stale threshold
        self._locks = locks
        self._sent = sent
        self._row = row  # where this server shares its base with servers that start later
        self._ranks = np.asarray(ranks, np.intp)
        self._positions = {int(rank): i for i, rank in enumerate(self._ranks)}
        n = len(self._ranks)
        # the client manages every slot, in order (one API server over all engines): read straight in
        self._whole_board = n == reader.n_slots and bool((self._ranks == np.arange(n)).all())
        self._board = np.zeros(reader.n_slots, SNAPSHOT_DTYPE)
        self._totals = np.zeros((sent.slots, 2), np.int64)
        self._records = np.zeros(n, SNAPSHOT_DTYPE)
        self._fields = _fields(self._records)
        self._base = np.zeros(n, np.int64)  # sent, never to be received (before an engine restart), less
        # what engines received from rows that no longer count
        self._last_received = np.zeros(n, np.int64)
        self._peer = np.zeros(sent.slots, np.int64)
        self._first = True
        self._shared = False  # the base shared with later servers at least once (again at each change)
        # the refresh's own arrays, so that a read allocates nothing: the engines' sent counts, scratch
        self._sent_rows = np.zeros((n, 2), np.int64)
        self._sent_reqs, self._sent_tokens = self._sent_rows[:, 0], self._sent_rows[:, 1]
        self._diff = np.zeros(n, np.int64)
        self._flags = np.zeros(n, bool)
        self._whole = np.zeros(n, bool)
        self._mean = np.zeros(n)
        self._queued = np.zeros(n)
        self._queued_tokens = np.zeros(n, np.int64)
        self.in_flight = np.zeros(n, np.int64)
        self.any_live = False  # at the last read: whether any of the engines' slots was LIVE

    def read_array(self, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out, recs, fields = self._records, self._records, self._fields
        else:
            recs = out[: len(self._ranks)]
            fields = _fields(recs)
        status, received, waiting_reqs, total_tokens, publish_seq = fields
        if self._whole_board:
            self._reader.read_array(recs)
        else:
            self._reader.read_array(self._board)
            np.take(self._board, self._ranks, out=recs)
        locks = self._locks
        if locks is not None and locks.refresh():
            locks.demote(status, recs["monotonic_ns"], self._positions)
        np.take(self._sent.totals(self._totals), self._ranks, axis=0, out=self._sent_rows)
        sent, tokens, base, diff, flags = self._sent_reqs, self._sent_tokens, self._base, self._diff, self._flags
        # a TORN or EMPTY slot reads as zeros: its received count says nothing (no restart, no base)
        whole = self._whole
        self.any_live = bool(np.equal(status, _LIVE, out=whole).any())
        whole |= np.equal(status, _STALE, out=flags)
        changed = False
        if self._first:  # a server that starts beside running ones takes up what they have seen
            self._first = False
            if self._sent.peer_base(self._peer):
                base[:] = self._peer[self._ranks]
                changed = True
        np.less(received, self._last_received, out=flags)
        flags &= whole
        if flags.any():  # its counter began again at 0
            base[flags] = sent[flags] - received[flags]
            changed = True
        np.subtract(sent, received, out=diff)
        np.less(diff, base, out=flags)
        flags &= whole
        if not self._sent.torn and flags.any():
            # live rows sent fewer than the engine received: it received requests of rows that no
            # longer count (a dead API server's that arrived); they stay out (docs/INTEGRATIONS.md)
            np.minimum(base, diff, out=base, where=flags)
            changed = True
        np.copyto(self._last_received, received, where=whole)
        if self._row is not None and (changed or not self._shared):
            self._row.share(self._ranks, base)
            self._shared = True
        np.subtract(diff, base, out=diff)
        np.maximum(diff, 0, out=self.in_flight)
        self._mean.fill(0.0)
        np.divide(tokens, sent, out=self._mean, where=np.greater(sent, 0, out=flags))
        np.add(waiting_reqs, self.in_flight, out=waiting_reqs)
        np.multiply(self.in_flight, self._mean, out=self._queued)
        np.copyto(self._queued_tokens, self._queued, casting="unsafe")  # truncated, as astype(int64)
        np.add(total_tokens, self._queued_tokens, out=total_tokens)
        # a send by any server changes the record, so the dispatcher takes it up at its next read
        np.add(publish_seq, sent, out=publish_seq)
        return out


def _fields(recs: np.ndarray) -> tuple[np.ndarray, ...]:
    """The columns of SNAPSHOT_DTYPE records that GlobalInflightReader reads or adds to (views)."""
    return (recs["status"], recs["num_received_reqs"], recs["num_waiting_reqs"], recs["num_total_tokens"],
            recs["publish_seq"])


class ClientDispatch:
    """What one DPLBAsyncMPClient decides with: its ``DispatchSession`` (the dispatcher, its row of
    the dispatch record, its counts of fallbacks and faults), and this server's sent row."""

    def __init__(self, method: Any, board: Board, sent: SentRecord, row: SentWriter, ranks: Sequence[int],
                 stale_after: float = DEFAULT_STALE_AFTER, session: DispatchSession | None = None,
                 lockstep: int | None = None) -> None:
        self.board = board
        self.sent = sent
        self.row = row
        self.ranks = tuple(int(r) for r in ranks)
        outside = [r for r in self.ranks if not 0 <= r < board.n_slots]
        if outside:
            raise InvalidInputError(f"vLLM engines of DP ranks {outside} have no slot on board {board.name!r} "
                                    f"({board.n_slots} slots)")
        self.session = session or DispatchSession(logger=log, own_path="vLLM's own pick", slot_of=self.ranks)
        self.reader = GlobalInflightReader(board.reader(stale_after=stale_after), sent, self.ranks, row,
                                           board.slot_locks())
        # a MoE model's engines step together (DPEngineCoreProc): auto picks inflight_lockstep, whose
        # chunk is the engines' step budget (the reader carries no detail)
        self.dispatcher = Dispatcher(method, len(self.ranks), reader=self.session.reader(self.reader),
                                     inflight_accounting=False, lockstep=lockstep is not None,
                                     lockstep_chunk=lockstep)
        self.session.use(self.dispatcher)
        self.request = _Request()
        self.closed = False
        self._trailing = False  # a trailing turn is on the event loop's timer
        _open_here[board.name] += 1

    def pick(self, request: Any) -> int:
        """The engine index (into the client's core_engines) for a request vLLM leaves to balancing."""
        holder = self.request
        holder.input_ids = request.prompt_token_ids or ()
        index = self.dispatcher.dispatch(holder)
        if not self.reader.any_live:
            # no engine publishes (none yet, or their plugin is off): the board knows nothing of load
            self.dispatcher.retract(index, holder)
            raise UnavailableError(f"no engine of {list(self.ranks)} is live on board {self.board.name!r}")
        return index

    def charge(self, index: int, request: Any) -> None:
        """A request vLLM placed itself: an explicit rank (routed) or a late-interaction index."""
        tokens = len(request.prompt_token_ids or ())
        if request.data_parallel_rank is not None:
            self.session.routed(index, tokens)
        else:
            self.session.pinned(index, tokens)

    def sent_to(self, index: int, request: Any) -> None:
        self.row.add(self.ranks[index], len(request.prompt_token_ids or ()))

    def trail(self) -> None:
        """After a pick: one turn of the session on the API server's event loop once the record's row
        is due, so that an idle server's last picks reach the record (vLLM calls dpboard only as
        requests come). One timer at a time, whatever the request rate; outside a running loop
        (a synchronous caller) nothing is scheduled."""
        if self._trailing or self.closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._trailing = True
        loop.call_later(TRAIL_S, self._turn)

    def _turn(self) -> None:
        self._trailing = False
        if not self.closed:
            self.session.turn()

    def close(self) -> None:
        """Give up this server's rows; the last process of the deployment to leave removes the board
        and its records (leaving.py). Once; never raises."""
        if self.closed:
            return
        self.closed = True
        self.session.close()
        try:
            self.sent.close()
        except Exception:
            log.exception("dpboard: the sent record of board %r was not closed cleanly", self.board.name)
        name = self.board.name
        if self.reader._locks is not None:
            self.reader._locks.close()
        self.board.close()
        _open_here[name] -= 1
        if not _open_here[name]:
            # every process gives up its rows and slots before it looks: of those leaving together, the
            # last to look finds nothing held, and removes the board and both records (leaving.py)
            try:
                remove_if_gone(name, leaving=True)
            except Exception:
                log.exception("dpboard: board %r was not cleaned up", name)


class _Request:
    """The one request object the dispatcher reads (its tokens); reused for every pick."""

    __slots__ = ("input_ids", "routed_dp_rank")

    def __init__(self) -> None:
        self.input_ids: Sequence[int] = ()
        self.routed_dp_rank = None


def _trail(state: ClientDispatch) -> None:
    try:
        state.trail()
    except Exception as e:  # the record only: the request is placed
        state.session.fault(e, "a trailing publish", placed=False)


def opened_dispatch(client: Any) -> ClientDispatch | None:
    """``client_dispatch`` for a client vLLM just built. A bad setting stops the server with its message
    (as at ``register``); any other failure to open the board's records is logged and leaves vLLM's own
    pick: an API server never fails to start for dpboard's sake."""
    try:
        state = client_dispatch(client)
    except InvalidInputError:
        raise
    except DpboardError as e:
        log.error("dpboard: %s; this API server picks with vLLM's own pick", e)
        return None
    except Exception:
        log.exception("dpboard: the board's dispatch could not be opened; this API server picks with vLLM's own pick")
        return None
    if state is not None:
        atexit.register(state.close)  # an API server that exits without vLLM's shutdown
    return state
def moe_step_budget(config: Any) -> int | None:
    """A MoE model under data parallelism (its engines step in lockstep): the engines' step budget
    in tokens (``max_num_batched_tokens``); None for a dense model or one engine."""
    if int(config.parallel_config.data_parallel_size) <= 1 or not getattr(config.model_config, "is_moe", False):
        return None
    budget = getattr(config.scheduler_config, "max_num_batched_tokens", None)
    return budget if isinstance(budget, int) and budget > 0 else 8192


def client_dispatch(client: Any, environ: Mapping[str, str] = os.environ) -> ClientDispatch | None:
    """The ClientDispatch of a just-built DPLBAsyncMPClient, or None when DPBOARD_METHOD is unset."""
    method = dispatch_method(environ)
    if method is None:
        return None
    if method is LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM:
        raise InvalidInputError(f"{ENV_METHOD}=follow_bootstrap_room follows SGLang's PD bootstrap rooms, which vLLM's "
                                f"requests do not carry: pick another method (docs/INTEGRATIONS.md, vLLM)")
    config = client.vllm_config
    step_budget = moe_step_budget(config)
    method = resolve_load_balance_method(method, lockstep=step_budget is not None)  # auto for MoE DP: inflight_lockstep
    if method.spec.holds:
        raise InvalidInputError(f"{ENV_METHOD}={method.value} holds requests for waves, which needs a loop that "
                                f"looks again on a timer, and vLLM's API server picks only as requests come: use "
                                f"inflight_lockstep here (docs/DISPATCH.md, inflight_wave)")
    name = board_name(environ, getattr(config.model_config, "served_model_name", None))
    if name is None:
        raise InvalidInputError(f"{ENV_METHOD}={method.value} dispatches from a board: name it with "
                                f"DPBOARD_VLLM_BOARD=NAME (or DPBOARD_VLLM=1), in the engines' environment too")
    stale = stale_after(environ)
    n_slots = int(config.parallel_config.data_parallel_size)
    ranks = [int.from_bytes(identity, "little") for identity in client.core_engines]
    board = Board.create(name, n_slots, exist_ok=True)
    try:
        sent = SentRecord.open(name, int(client.client_count), n_slots, generation=board.generation)
        try:
            row = sent.row(int(client.client_index))
            # the requests per engine in the record: what this server's sent row counts
            session = DispatchSession.with_record(
                name, n_slots, method=method.value, refresh_interval=DEFAULT_REFRESH_INTERVAL,
                rows=int(client.client_count), index=int(client.client_index), logger=log,
                own_path="vLLM's own pick", slot_of=ranks, requests=lambda: [row.sent(s)[0] for s in range(n_slots)])
            try:
                state = ClientDispatch(method, board, sent, row, ranks, stale, session, lockstep=step_budget)
            except BaseException:
                session.close()
                raise
        except BaseException:
            sent.close()
            raise
    except BaseException:
        board.close()
        raise
    log.info("dpboard: API server %d picks engines %s by %s over board %r", client.client_index, ranks,
             state.dispatcher.method.value, name)
    return state


def patch(cls: type, late_interaction_index: Any, support: Support = SUPPORTED["0.33"],
          version: str = "0.33") -> None:
    """Wrap ``DPLBAsyncMPClient`` (``cls``): see the module's docstring. Once per class. ``support``:
    the names of the running vLLM release (versions.py), ``version`` that release as vLLM says it."""
    if getattr(cls, "_dpboard_patched", False):
        return
    original_init = cls.__init__
    original_pick = cls.get_core_engine_for_request
    original_shutdown = cls.shutdown

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        setattr(self, STATE, None)
        lacking = versions.missing(self, support.client_state, "DPLBAsyncMPClient")
        if lacking:
            versions.step_aside(version, f"lacks {', '.join(lacking)}")
            return
        setattr(self, STATE, opened_dispatch(self))

    def choose(self: Any, state: ClientDispatch, request: Any) -> tuple[Any, int, bool] | None:
        """vLLM's rules in vLLM's order, the balancing loop replaced by dpboard's pick: (engine, its
        index, whether it is a new request to record), or None for vLLM's own pick (no live engine)."""
        if support.streaming_sessions:  # done again by vLLM's pick if this falls back: a set's add/discard
            if request.resumable:
                self.streaming_reqs.add(request.request_id)
            else:
                self.streaming_reqs.discard(request.request_id)  # its session's final request, if any
        engine = self.reqs_in_flight.get(request.request_id)
        if engine is not None:  # streaming-input affinity
            return engine, self.core_engines.index(engine), False
        index = request.data_parallel_rank
        if index is None:
            index = late_interaction_index(request.pooling_params, len(self.core_engines))
        if index is None:
            try:
                index = state.pick(request)
            except UnavailableError as e:
                # no engine is live on the board (all stale or never published): vLLM's own pick,
                # so that the request still goes somewhere vLLM will answer it from
                state.session.fallback(e, request.request_id)
                return None
        else:
            state.charge(index, request)
        return self.core_engines[index], index, True

    def get_core_engine_for_request(self: Any, request: Any) -> Any:
        state: ClientDispatch | None = getattr(self, STATE, None)
        if state is None:
            return original_pick(self, request)
        try:
            choice = choose(self, state, request)
            if choice is not None:
                state.sent_to(choice[1], request)
        except Exception as e:  # dpboard's failure, never the user's: vLLM's own pick places it
            state.session.fault(e, getattr(request, "request_id", "?"))
            choice = None
        if choice is None:
            engine = original_pick(self, request)  # vLLM records it in reqs_in_flight itself
            try:
                state.sent_to(self.core_engines.index(engine), request)
            except Exception as e:
                state.session.fault(e, getattr(request, "request_id", "?"), placed=False)
            _trail(state)
            return engine
        _trail(state)
        engine, _, new = choice
        if new:  # as vLLM records its own picks: abort routing and finish bookkeeping stay vLLM's
            self.reqs_in_flight[request.request_id] = engine
            self.engine_inflight[engine] += 1
        return engine

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original_shutdown(self, *args, **kwargs)
        finally:
            state: ClientDispatch | None = getattr(self, STATE, None)
            setattr(self, STATE, None)
            if state is not None:
                state.close()

    cls.__init__ = __init__
    cls.get_core_engine_for_request = get_core_engine_for_request
    cls.shutdown = shutdown
    cls._dpboard_original_pick = original_pick
    cls._dpboard_patched = True
