"""``DispatchSession``: one ``Dispatcher`` at work inside an engine, with its record and its counts.

Three places dispatch with a ``Dispatcher``: the ZMQ controller (``process.py``), SGLang's
DataParallelController and vLLM's API servers (``dpboard.integrations``). Each holds one session,
which keeps what they would otherwise each rebuild:

- the ``Dispatcher`` itself; ``use`` puts in another one (``auto`` changed its mind): the ranks'
  active set and availability carry over, the record's method is stamped again;
- its row of the board's dispatch record (a ``DispatchTally``, optional: a record that cannot be
  used is logged and done without, as it is for diagnosis only), and the board reader the
  Dispatcher reads through (``reader``: slots whose writer's lock is gone read as STALE, EMPTY
  records for reserved slots the board lacks, and a ``TickingReader`` where there is a row, so that
  the row is published from the refreshes, never per request on a load-aware path, and from
  ``turn``, which a loop of the engine's calls as it turns: an idle dispatcher's last counts);
- the counts of what did not go through the Dispatcher's pick, each in one place: requests the
  engine placed itself (``routed``, ``pinned``), picks where the budget does not count them itself
  (``picked``), fallbacks (``fallback``, ``count_fallbacks``), faults (``fault``: an exception in
  dpboard) and rejections. Fallbacks and faults are logged at the 1st, 10th, 100th... time, a
  fault's first with its traceback: a stuck board or a bug shows without flooding the engine's log.
  An engine that counts every request itself (the ZMQ controller) says so once (``count_from``):
  the row then reads its counts, and nothing is counted twice;
- the counters of the Dispatcher's ``inflight_wave`` hold (``wave_counts``, those of the
  Dispatchers it replaced included), which the row carries for ``dpboard top`` and ``/metrics``.

It is pure: no sockets, no engine import; an engine's names come in as strings, for the log's
wording only. docs/ARCHITECTURE.md ("The engine contract") says what an engine calls and when.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpboard.board.dispatch_record import DispatchTally, RowCounts, TickingReader, WaveCounts, open_tally
from dpboard.controller.dispatcher import Dispatcher
from dpboard.snapshot import SNAPSHOT_DTYPE


def logged_now(count: int) -> bool:
    """Whether the ``count``-th time of a repeated event is logged: the 1st, 10th, 100th..."""
    return count > 0 and math.log10(count).is_integer()


class LockCheckedReader:
    """A board reader with every slot whose writer's lock is gone read as STALE at once: a
    scheduler that died (SIGKILL, a crash) gets no new request while its last publish is still
    within the stale threshold (``SlotLocks`` looks at the locks every 50 ms at most)."""

    def __init__(self, reader: Any, locks: Any) -> None:
        self._reader = reader
        self._locks = locks
        self.n_slots = reader.n_slots
        self.stale_after = getattr(reader, "stale_after", None)
        if hasattr(reader, "read_detailed_array"):  # the backlog methods read the detail instead
            self.read_detailed_array = self._read_detailed_array

    def read_array(self, out: np.ndarray | None = None) -> np.ndarray:
        out = self._reader.read_array(out)
        if self._locks.refresh():
            self._locks.demote(out["status"], out["monotonic_ns"])
        return out

    def _read_detailed_array(self, out: np.ndarray) -> np.ndarray:
        out = self._reader.read_detailed_array(out)
        if self._locks.refresh():
            load = out["load"]
            self._locks.demote(load["status"], load["monotonic_ns"])
        return out


class PaddedReader:
    """A board reader for more worker slots than the board has (reserved elastic-EP slots, which
    publish nothing): the board's records, then EMPTY ones."""

    def __init__(self, reader: Any, n: int) -> None:
        self._reader = reader
        self._records = np.zeros(n, SNAPSHOT_DTYPE)
        self._records["dp_rank"] = np.arange(n)
        self._board_slots = reader.n_slots
        self.n_slots = n
        self.stale_after = getattr(reader, "stale_after", None)

    def read_array(self, out: np.ndarray | None = None) -> np.ndarray:
        out = self._records if out is None else out
        self._reader.read_array(out[: self._board_slots])
        return out


class DispatchSession:
    """A Dispatcher, its dispatch-record row and the counts around its picks (module docstring).

    ``logger`` is the engine's dpboard logger; ``own_path`` names what places a request dpboard
    could not ("SGLang's own dispatch", "vLLM's own pick"), ``fallback_path`` what places one the
    Dispatcher had no rank for (default ``own_path``). ``tally``: the row, or None. ``slot_of``:
    the board slot of each of the Dispatcher's ranks (vLLM's API server dispatches over its own
    engines; default: rank k is slot k). ``requests``: the requests per slot so far, when something
    else counts them (vLLM's sent row); otherwise the row takes them from the Dispatcher's budget
    where it has one, else from ``picked``; or everything from ``count_from``'s counts.

    Nothing here raises into the engine's request path: ``fault`` and the record's counts never raise.
    """

    def __init__(self, *, logger: logging.Logger, own_path: str = "the engine's own dispatch",
                 fallback_path: str | None = None, tally: DispatchTally | None = None,
                 slot_of: Sequence[int] | None = None, requests: Callable[[], Any] | None = None) -> None:
        self.logger = logger
        self.own_path = own_path
        self.fallback_path = fallback_path or own_path
        self.tally = tally
        self._slot_of = None if slot_of is None else tuple(int(s) for s in slot_of)
        self._requests = requests
        self._counted: Callable[[], RowCounts] | None = None  # ``count_from``
        self._counts_picks = False  # the row's requests per rank come from ``picked``
        self._wave_before: WaveCounts | None = None  # the holds of the Dispatchers ``use`` replaced
        if tally is not None:
            tally.wave = self.wave_counts
        self._locks: list[Any] = []
        self.dispatcher: Dispatcher | None = None
        self.fallbacks = 0  # requests placed by a fallback: no rank from the Dispatcher, or a fault
        self.faults = 0  # exceptions in dpboard's pick or accounting
        self.closed = False

    @classmethod
    def with_record(cls, board: str, slots: int, *, method: str, mode: str = "null", refresh_interval: float = 0.0,
                    rows: int = 1, index: int = 0, trust_uids: tuple[int, ...] = (), logger: logging.Logger,
                    **kwargs: Any) -> DispatchSession:
        """A session with row ``index`` of ``board``'s dispatch record (``rows`` dispatchers, ``slots``
        ranks), stamped with the method, mode and refresh interval; without one where the record
        cannot be used (logged: it never keeps a dispatcher from serving)."""
        tally = open_tally(board, rows, index, slots, method=method, mode=mode, refresh_interval=refresh_interval,
                           logger=logger, trust_uids=trust_uids)
        return cls(logger=logger, tally=tally, **kwargs)

    # -- set-up -----------------------------------------------------------------------------------

    def reader(self, reader: Any, *, locks: Any = None, num_workers: int | None = None) -> Any:
        """The reader the Dispatcher reads: ``reader`` with the slots whose writer is gone read as
        STALE (``locks``: a ``SlotLocks``, closed with the session), padded with EMPTY records to
        ``num_workers``, its reads ticking the record's row where there is one."""
        if locks is not None:
            self._locks.append(locks)
            reader = LockCheckedReader(reader, locks)
        if num_workers is not None and num_workers > reader.n_slots:
            reader = PaddedReader(reader, num_workers)
        return reader if self.tally is None else TickingReader(reader, self.tally)

    def count_from(self, counts: Callable[[], RowCounts]) -> None:
        """The engine counts every request itself (the ZMQ controller: each one handed to a rank, a
        redelivered one again; fallbacks; rejections): the row reads them all from ``counts()`` when
        it is published, only the refreshes are counted here, and the engine calls none of
        ``picked``, ``rejected`` and ``count_fallbacks``."""
        self._counted = counts
        self._counts_picks = False
        if self.tally is not None:
            self.tally.counted, self.tally.source = counts, None

    def use(self, dispatcher: Dispatcher) -> None:
        """Dispatch with ``dispatcher`` from now on. A second one (``auto`` changed) takes the first's
        active set and availability; the record's row is stamped with its method and keeps counting.
        What the first one's wave held was placed by the caller (``release_all``); its counters go on
        in ``wave_counts``."""
        old, self.dispatcher = self.dispatcher, dispatcher
        if old is not None:
            dispatcher.set_active(old.active)
            for rank, available in enumerate(old.available[: dispatcher.num_workers]):
                dispatcher.set_status(rank, available)
            if old.wave is not None:
                self._wave_before = old.wave.counts().after(self._wave_before)
        tally = self.tally
        if tally is None:
            return
        tally.row.set_method(dispatcher.method.value)
        if self._counted is not None:
            return  # the engine's counts: nothing changes with the Dispatcher
        if self._requests is not None:
            tally.source = self._requests
        elif dispatcher.budget is not None and old is None:
            tally.source = dispatcher.budget.sent_reqs.copy  # the budget's own count of each rank's requests
        else:
            if tally.source is not None:  # from now on counted here, from what the old budget counted
                tally.per_rank = [int(n) for n in tally.source()]
            tally.source = None
        self._counts_picks = tally.source is None

    def _slot(self, index: int) -> int:
        return index if self._slot_of is None else self._slot_of[index]

    # -- what the engine tells the session ---------------------------------------------------------

    def routed(self, index: int, tokens: int) -> None:
        """A request the engine sent to ``index`` itself, by its ``routed_dp_rank``: charged to the
        Dispatcher's load (its in-flight count stays exact) and counted as routed in the record."""
        self._placed_by_engine(index, tokens, routed=True)

    def pinned(self, index: int, tokens: int) -> None:
        """A request the engine sent to ``index`` by a rule of its own that is not a routed rank
        (vLLM's late-interaction index): charged as load, counted as a request."""
        self._placed_by_engine(index, tokens, routed=False)

    def _placed_by_engine(self, index: int, tokens: int, routed: bool) -> None:
        budget = self.dispatcher.budget
        if budget is not None:
            budget.charge(index, tokens)
        tally = self.tally
        if tally is None:
            return
        slot = self._slot(index)
        if routed:
            tally.routed += 1
            tally.routed_per_rank[slot] += 1
        if self._counts_picks:
            tally.per_rank[slot] += 1
        self._tick(tally)  # these requests refresh nothing: they tick the record themselves

    def picked(self, index: int, *, routed: bool = False, with_room: bool = False) -> None:
        """A request sent to ``index`` by the Dispatcher's pick (``routed``: by its routed rank),
        counted in the record where nothing else counts it; nothing to do on a load-aware path."""
        if not self._counts_picks:
            return
        tally = self.tally
        slot = self._slot(index)
        tally.per_rank[slot] += 1
        if routed:
            tally.routed += 1
            tally.routed_per_rank[slot] += 1
        if with_room:
            tally.with_room += 1
        self._tick(tally)

    def wave_counts(self) -> WaveCounts | None:
        """What the Dispatchers' ``inflight_wave`` holds did (this one's and those ``use`` replaced),
        None while none has held anything; read by the row at each publish, and by the ZMQ
        controller's stats."""
        wave = None if self.dispatcher is None else self.dispatcher.wave
        if wave is None:
            return self._wave_before
        return wave.counts().after(self._wave_before)

    def rejected(self, n: int = 1) -> None:
        """``n`` requests answered with an error instead of dispatched."""
        if self.tally is not None:
            self.tally.rejected += n

    def count_fallbacks(self, n: int = 1) -> int:
        """``n`` requests placed by a fallback, not logged (the ZMQ controller: picks whose rank
        refused the send, dispatched again); the count so far."""
        self.fallbacks += n
        tally = self.tally
        if tally is not None:
            try:
                tally.fallbacks += n
                self._tick(tally)  # a fallback refreshes nothing: tick the record here
            except Exception:  # noqa: BLE001 - the record is for diagnosis; the count above stands
                pass
        return self.fallbacks

    def fallback(self, why: object, request_id: object) -> int:
        """The Dispatcher had no rank for request ``request_id`` (``why``): it goes by the fallback
        path; counted and logged at the 1st, 10th, 100th... time. The count so far."""
        count = self.count_fallbacks()
        if logged_now(count):
            self.logger.warning("dpboard: %s; request %s placed by %s (fallback #%d)", why, request_id,
                                self.fallback_path, count)
        return count

    def fault(self, error: BaseException, request_id: object, placed: bool = True) -> None:
        """An exception in dpboard's pick or accounting, never the engine's: counted (with ``placed``,
        the request went by the engine's own path: a fallback too) and logged at the 1st, 10th,
        100th... time, the first with its traceback."""
        self.faults += 1
        if placed:
            self.count_fallbacks()
        if logged_now(self.faults):
            where = f"{self.own_path} placed it" if placed else "only dpboard's count of it is lost"
            self.logger.warning("dpboard: %s: %s in dpboard's dispatch of request %s; %s (dpboard fault #%d)",
                                type(error).__name__, error, request_id, where, self.faults,
                                exc_info=error if self.faults == 1 else None)

    @staticmethod
    def _tick(tally: DispatchTally) -> None:
        tally.countdown -= 1
        if tally.countdown <= 0:
            tally.tick()

    # -- the record ------------------------------------------------------------------------------

    def turn(self, now: float | None = None) -> None:
        """A turn of a loop of the engine's that runs anyway (the ZMQ controller's poll, SGLang's DP
        controller's receive, an API server's event loop; ``now``: ``time.monotonic()``): the counts
        that changed since the row's last publish go into it once it is due, so that an idle
        dispatcher's last counts are there within 0.1 s (``DispatchTally.trail``). Never raises."""
        tally = self.tally
        if tally is None:
            return
        try:
            tally.trail(time.monotonic() if now is None else now)
        except Exception:  # noqa: BLE001 - the record is for diagnosis; the engine's loop goes on
            pass

    def beat(self, now: float | None = None) -> None:
        """A turn of the ZMQ controller's own loop: the row is written whenever it is due, changed or
        not, so that its age tells ``dpboard doctor`` the controller lives. Never raises."""
        tally = self.tally
        if tally is None:
            return
        try:
            if tally.row.due(time.monotonic() if now is None else now):
                tally.publish()
        except Exception:  # noqa: BLE001 - the record is for diagnosis; the controller's loop goes on
            pass

    def publish(self) -> None:
        """The counts into the row now (the ZMQ controller's last, when it stops)."""
        if self.tally is not None:
            self.tally.publish()

    def close(self) -> None:
        """Give up the row (the last dispatcher out removes the record) and the slots' locks. Once;
        never raises."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.tally is not None:
                self.tally.close()
        except Exception:
            self.logger.exception("dpboard: the dispatch record was not closed cleanly")
        for locks in self._locks:
            locks.close()
        self._locks.clear()
