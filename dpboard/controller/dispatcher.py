"""The pure dispatcher: which DP rank gets a request (docs/DISPATCH.md, "The rules"). No sockets, no processes.

``Dispatcher(method, num_workers, reader=None, active=None, clock=time.monotonic,
refresh_interval=0.02)``, then ``dispatch(req) -> int`` and ``dispatch_batch(reqs) -> list[int]``.
``set_active`` / ``set_status`` follow elastic EP and failures; ``retract(rank, req)`` takes back a
pick whose send failed. ``dpboard sim`` and the ZMQ controller (``dpboard.controller.process``) both
drive this class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType, MethodType
from typing import Any

import numpy as np

from dpboard.controller.budget import (
    DEFAULT_LEDGER_CAPACITY,
    DPBudget,
    check_routed_rank,
    request_tokens,
    snapshots_to_array,
)
from dpboard.controller.prefix_index import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CAPACITY_BLOCKS,
    PrefixIndex,
    request_block_hashes,
)
from dpboard.controller.wave import DEFAULT_WAVE_HOLD, DEFAULT_WAVE_PER_RANK, WaveHold
from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.methods import (
    METHODS,
    ArgminKey,
    Delivery,
    LoadBalanceMethod,
    resolve_load_balance_method,
)
from dpboard.snapshot import DETAIL_FLAG, DETAIL_PRESENT, DETAILED_DTYPE, SNAPSHOT_DTYPE, SlotStatus

DEFAULT_REFRESH_INTERVAL = 0.02  # SGLang's throttle: refresh the budget at most once per 20 ms
# inflight_lockstep: a rank whose first token comes within this many group steps is as good as the
# earliest one (docs/DISPATCH.md, "inflight_lockstep": measured on the DP-attention cells)
DEFAULT_LOCKSTEP_HORIZON = 6
# ... and beside SGLang's prefill delayer (--enable-prefill-delayer), which already holds prefill
# back until the ranks prefill together: a wider horizon there adds its picks' extra steps to the
# delayer's hold (docs/DISPATCH.md, "inflight_lockstep with SGLang's prefill delayer")
DELAYER_LOCKSTEP_HORIZON = 2
# SGLang's --chunked-prefill-size default on an 80 GB H100; under DP attention it divides it by the
# DP size: each rank's chunk when its board says nothing of it
SGLANG_CHUNKED_PREFILL_SIZE = 8192


def default_lockstep_horizon(prefill_delayer: bool) -> int:
    """``inflight_lockstep``'s horizon for a lockstep group with or without SGLang's prefill delayer."""
    return DELAYER_LOCKSTEP_HORIZON if prefill_delayer else DEFAULT_LOCKSTEP_HORIZON


def default_lockstep_chunk(num_workers: int) -> int:
    """The per-rank chunk SGLang runs ``num_workers`` DP-attention ranks with by default."""
    return max(1, SGLANG_CHUNKED_PREFILL_SIZE // max(1, num_workers))


_LIVE = int(SlotStatus.LIVE)
_STALE = int(SlotStatus.STALE)
_TORN = int(SlotStatus.TORN)
# health_aware: how long after a rank's last LIVE read a TORN read still leaves it a candidate. A live
# writer descheduled between its two sequence stores (an oversubscribed host) resumes within a time
# slice or a host stall; one that died there stays odd, and its rank is left after this
DEFAULT_TORN_GRACE = 0.5


class TornReads:
    """Which ranks a TORN read leaves, by ``health_aware``'s rule: a TORN read within ``grace`` seconds
    of the rank's last LIVE read is a live writer caught mid-write (the rank keeps its last whole
    snapshot and its place); later than that, or after a STALE read, the rank is left until it reads
    LIVE again. The dispatcher judges its budget's reads by it, the ZMQ controller its ack reads."""

    def __init__(self, num_workers: int) -> None:
        self.live_read_at = np.full(num_workers, -np.inf)  # the clock at each rank's last LIVE read
        self.left = np.zeros(num_workers, bool)  # the ranks the last judged read leaves for being torn

    def judge(self, status: np.ndarray, now: float, grace: float) -> np.ndarray:
        """``left`` after a read whose status column is ``status``, taken at ``now``."""
        self.live_read_at[status == _LIVE] = now
        self.live_read_at[status == _STALE] = -np.inf
        np.greater(now - self.live_read_at, grace, out=self.left)
        self.left &= status == _TORN
        return self.left


# while requests are held, the caller looks again at least this often (a refresh interval of 0
# would otherwise ask it to look again at once, for ever)
WAVE_LOOK_MIN = 0.001


class Dispatcher:
    """Picks a DP rank per request, with SGLang's rules by default (docs/DISPATCH.md, "The rules").

    Keyword options (docs/DISPATCH.md, "What dpboard adds, and why"; on by default only for the ``inflight_*`` methods):

    - ``inflight_accounting``: the budget is the snapshot plus the requests sent but not yet counted
      in the rank's ``num_received_reqs``, so a refresh from a lagging snapshot loses nothing.
    - ``health_aware``: never pick a rank whose slot is STALE, or TORN later than ``torn_grace``
      seconds after its last LIVE read (a TORN read sooner is a live writer caught mid-write: its
      last whole snapshot stands); besides inactive and unavailable ranks, which no load-aware
      method picks.
    - ``rotate_ties``: among equal loads, start from the rank after the last pick instead of rank 0.

    ``inflight_cache`` keeps a ``PrefixIndex`` of the prompt blocks sent to each rank
    (``prefix_block_size`` tokens per block; each rank's capacity from its ``max_total_num_tokens``,
    ``prefix_capacity_blocks`` until the board reports one). A request's blocks are its
    ``block_hashes`` when it carries them, else hashes of its ``input_ids``.

    ``inflight_lockstep`` reads each rank's prefill chunk from its slot's lockstep detail
    (``lockstep_chunk`` where a rank publishes none; default SGLang's rule, 8192 / ``num_workers``)
    and takes any rank whose first token comes within ``lockstep_horizon`` group steps.
    ``lockstep``: the ranks step in lockstep, so ``auto`` resolves to ``inflight_lockstep``.

    ``inflight_wave`` holds arrivals (``offer``) while the group decodes and places them with
    ``inflight_lockstep``'s pick when a wave is due (``due``, by ``next_due_at``; ``release_all`` at
    shutdown): at most ``wave_max_hold`` seconds less one group step, ``wave_per_rank`` requests per
    candidate rank a wave, and, with ``wave_max_bytes`` (or ``bound_held_bytes``), frames (a
    request's ``raw``) of fewer bytes than that, the one that reaches it leaving with them;
    ``dpboard.controller.wave`` has the rule. Every other method
    holds nothing: ``offer`` returns what it is given.
    """

    def __init__(
        self,
        method: LoadBalanceMethod | str,
        num_workers: int,
        reader: Any = None,
        active: Iterable[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_interval: float = DEFAULT_REFRESH_INTERVAL,
        *,
        disaggregation_mode: str | None = None,
        inflight_accounting: bool | None = None,
        health_aware: bool | None = None,
        rotate_ties: bool | None = None,
        ledger_capacity: int = DEFAULT_LEDGER_CAPACITY,
        use_extension: bool = True,
        prefix_block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
        lockstep: bool = False,
        lockstep_horizon: int = DEFAULT_LOCKSTEP_HORIZON,
        lockstep_chunk: int | None = None,
        wave_max_hold: float = DEFAULT_WAVE_HOLD,
        wave_per_rank: int = DEFAULT_WAVE_PER_RANK,
        wave_idle: bool = True,
        wave_max_bytes: int | None = None,
        torn_grace: float = DEFAULT_TORN_GRACE,
    ):
        self.method = resolve_load_balance_method(method, disaggregation_mode, lockstep=lockstep)
        self.spec = spec = METHODS[self.method]
        # how a request is placed, chosen once: dispatch and dispatch_batch are the delivery's pair
        one, batch = _PLACEMENTS[spec.delivery]
        self.dispatch = MethodType(one, self)
        self.dispatch_batch = MethodType(batch, self)
        self.wave = WaveHold(wave_max_hold, wave_per_rank, wave_idle, wave_max_bytes) if spec.holds else None
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise InvalidInputError(f"num_workers must be an int >= 1 (the worker slots, reserved ones included), "
                             f"got {num_workers!r}")
        if not callable(clock):
            raise InvalidInputError(f"clock must be a callable returning seconds, got {clock!r}")
        if not isinstance(refresh_interval, (int, float)) or not refresh_interval >= 0:
            raise InvalidInputError(f"refresh_interval must be a number of seconds >= 0, got {refresh_interval!r}")
        self.num_workers = num_workers
        self._refresh_interval = float(refresh_interval)
        self._clock = clock
        self.inflight_accounting = spec.inflight_accounting if inflight_accounting is None else bool(inflight_accounting)
        self.health_aware = spec.health_aware if health_aware is None else bool(health_aware)
        if not isinstance(torn_grace, (int, float)) or isinstance(torn_grace, bool) or not torn_grace >= 0:
            raise InvalidInputError(f"torn_grace must be a number of seconds >= 0, got {torn_grace!r}")
        self.torn_grace = float(torn_grace)
        self._torn = TornReads(num_workers)  # health_aware: the ranks a TORN read leaves
        self.rotate_ties = spec.rotate_ties if rotate_ties is None else bool(rotate_ties)
        self.refresh_count = 0
        self._rr_counter = 0
        self._active_mask = np.zeros(num_workers, bool)
        self._available_mask = np.ones(num_workers, bool)
        self._available_list = [True] * num_workers  # the same, for round robin (a list indexes faster)
        self._active: tuple[int, ...] = ()
        self.reader = reader
        self.budget: DPBudget | None = None
        self.prefix: PrefixIndex | None = None
        self.lockstep_horizon = lockstep_horizon
        self.lockstep_chunk = default_lockstep_chunk(num_workers) if lockstep_chunk is None else lockstep_chunk
        if spec.is_load_aware:
            self._setup_load_aware(reader, ledger_capacity, use_extension)
        if spec.uses_prefix_index:
            self.prefix = PrefixIndex(num_workers, prefix_block_size, prefix_capacity_blocks)
            self._savings = np.zeros(num_workers, np.int64)
            self._capacities = np.zeros(num_workers, np.int64)  # the KV capacities last given to the index
            self._charged: list[list[int]] = [[] for _ in range(num_workers)]  # this call's charges, to retract
            self._charged_any = False
            # request types whose instances cannot carry block_hashes (see _none_carry_hashes)
            self._hashless: dict[type, bool] = {}
        self.set_active(range(num_workers) if active is None else active)

    def _setup_load_aware(self, reader: Any, ledger_capacity: int, use_extension: bool) -> None:
        n = self.num_workers
        if reader is None:
            raise InvalidInputError(
                f"load balance method {self.method.value} reads loads and needs a reader: pass "
                "reader=board.reader() (or any object with read_all())"
            )
        self.budget = DPBudget(
            n,
            key=self.spec.key,
            clock=self._clock,  # the throttle lives in the core: the plain argmin is one call
            refresh_interval=self._refresh_interval,
            lockstep_horizon=self.lockstep_horizon,
            lockstep_chunk=self.lockstep_chunk,
            rotate_ties=self.rotate_ties,
            inflight_accounting=self.inflight_accounting,
            ledger_capacity=ledger_capacity,
            use_extension=use_extension,
        )
        self._pick = self.budget.core.pick
        self._pick_fresh = self.budget.core.pick_fresh
        self._pick_batch = self.budget.core.pick_batch
        if hasattr(reader, "read_array"):
            first = reader.read_array()
            if getattr(first, "dtype", None) != SNAPSHOT_DTYPE or len(first) < n:
                raise InvalidInputError(
                    f"reader.read_array() must return at least {n} SNAPSHOT_DTYPE records (one per worker "
                    f"slot), got {len(first)} records of dtype {getattr(first, 'dtype', type(first))}"
                )
            from dpboard.board import BoardReader

            if isinstance(reader, BoardReader):
                # our own buffer: the reader's default array may be shared with other users of it
                records = np.zeros(len(first), SNAPSHOT_DTYPE)
                read = reader.read_array
                self._read_records = lambda: read(records)
            else:
                self._read_records = reader.read_array
        elif hasattr(reader, "read_all"):
            records = np.zeros(n, SNAPSHOT_DTYPE)
            read_all = reader.read_all
            self._read_records = lambda: snapshots_to_array(read_all(), n, records)
        else:
            raise InvalidInputError(
                f"reader must be a BoardReader or have read_all() (or read_array()), got {type(reader).__name__}"
            )
        self._read_queued = None
        self._throughput = np.zeros(n, np.float64)
        if self.spec.key.reads_backlog and hasattr(reader, "read_detailed_array"):
            self._read_queued = self._queued_prefill_reader(reader)

    def _queued_prefill_reader(self, reader: Any) -> Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """For the backlog methods: the records and, per rank, the prefill work the engine itself
        reports queued (``num_waiting_uncached_tokens`` of the slot's detail: the waiting prompts
        less what its prefix cache holds of them, plus the rest of a prompt whose chunked prefill is
        under way), -1 where the engine reports no detail, the prefill chunk of its lockstep
        detail (0 where it has none), and whether it serves one side of PD disaggregation (its
        detail's disaggregation mode: prefill or decode). Read from one write per slot."""
        n = self.num_workers
        detailed = np.zeros(n, DETAILED_DTYPE)
        queued = np.full(n, -1, np.int64)
        chunk = np.zeros(n, np.int64)
        pd_role = np.zeros(n, bool)
        lockstep_bit = np.uint64(DETAIL_FLAG["lockstep"])
        disagg_bit = np.uint64(DETAIL_FLAG["disaggregation"])
        throughput = self._throughput = np.zeros(n, np.float64)  # gen_throughput: the wave's group step

        def read() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            arr = reader.read_detailed_array(detailed)
            detail = arr["detail"][:n]
            flags = detail["flags"]
            present = (flags & DETAIL_PRESENT) != 0
            queued[:] = -1
            queued[present] = detail["num_waiting_uncached_tokens"][present]
            np.copyto(chunk, detail["lockstep_chunk_tokens"])
            chunk[(flags & lockstep_bit) == 0] = 0
            mode = detail["disaggregation_mode"]
            np.copyto(pd_role, ((flags & disagg_bit) != 0) & ((mode == b"prefill") | (mode == b"decode")))
            np.copyto(throughput, detail["gen_throughput"])
            throughput[~present] = 0.0
            return arr["load"], queued, chunk, pd_role

        return read

    # -- the active set and availability ------------------------------------------------------------

    @property
    def refresh_interval(self) -> float:
        """Seconds between two refreshes of the budget from the board, at least (the throttle)."""
        return self._refresh_interval

    @refresh_interval.setter
    def refresh_interval(self, seconds: float) -> None:
        self._refresh_interval = float(seconds)
        if self.budget is not None:
            self.budget.core.interval = self._refresh_interval

    @property
    def active(self) -> tuple[int, ...]:
        return self._active

    @property
    def available(self) -> tuple[bool, ...]:
        return tuple(bool(x) for x in self._available_mask)

    def _worker_rank(self, value: Any, what: str) -> int:
        """``value`` as a worker slot index, or an error naming ``what`` and the valid range."""
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise InvalidInputError(f"{what} must be an int, got {value!r}")
        rank = int(value)
        if not 0 <= rank < self.num_workers:
            raise InvalidInputError(
                f"{what} {rank} is outside the {self.num_workers} worker slots (0..{self.num_workers - 1})"
            )
        return rank

    def set_active(self, ranks: Iterable[int]) -> None:
        """The ranks that have a worker now (elastic EP); the others are reserved slots."""
        seen = {self._worker_rank(r, "active rank") for r in ranks}
        self._active = tuple(sorted(seen))
        self._active_mask[:] = False
        self._active_mask[list(self._active)] = True
        self._update_candidates()

    def set_status(self, rank: int, available: bool) -> None:
        """Mark a rank available or not (a failed or draining worker); every slot starts available."""
        rank = self._worker_rank(rank, "rank")
        self._available_mask[rank] = bool(available)
        self._available_list[rank] = bool(available)
        self._update_candidates()

    def _update_candidates(self) -> None:
        if self.budget is None:
            return
        mask = self._active_mask & self._available_mask
        if self.health_aware:
            mask &= (self.budget.status != _STALE) & ~self._torn.left
        self.budget.candidate[:] = mask
        self.budget.routable[:] = self._active_mask

    # -- refresh --------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the board into the budget now (dispatch does this itself, at most once per interval)."""
        if self.budget is None:
            return
        self.budget.core.last_refresh = self._clock()
        self._refresh()

    def _refresh(self) -> None:
        if self._read_queued is not None:
            records, queued, chunk, pd_role = self._read_queued()
            self.budget.update_from_array(records, queued, chunk, pd_role)
        else:
            records = self._read_records()
            self.budget.update_from_array(records)
        if self.health_aware:
            self._torn.judge(self.budget.status, self._clock(), self.torn_grace)
            self._update_candidates()
        if self.wave is not None:
            self.wave.read_step(self.budget.running, self._throughput, self.budget.candidate)
        if self.prefix is not None:
            capacities = records["max_total_num_tokens"][: self.num_workers]
            if not np.array_equal(capacities, self._capacities):
                self.prefix.set_capacity_tokens(capacities.tolist())
                self._capacities[:] = capacities
        self.refresh_count += 1

    # -- dispatch -------------------------------------------------------------------------------------
    #
    # How a request is placed is the row's delivery, chosen once: __init__ binds ``dispatch`` and
    # ``dispatch_batch`` to the delivery's pair in _PLACEMENTS (below the class), so that a call runs
    # its placement with no switch on the way (on the plain argmin each Python step is ~5-15 ns of a
    # ~150 ns decision, docs/BENCHMARKS.md). The two methods here say what every placement does.

    def dispatch(self, req: Any) -> int:
        """The rank for ``req``, as the method's row (``self.spec``) says: ``routed_dp_rank`` first
        (every delivery takes it), then its delivery, and for an argmin its key, which the C core
        compares (``DPBudget.core``). Each dispatcher's own ``dispatch`` is its delivery's placement
        (``_PLACEMENTS``); called on the class, this runs that one."""
        return self.dispatch(req)

    def dispatch_batch(self, reqs: Sequence[Any]) -> list[int]:
        """Ranks for a batch: one (throttled) refresh, then consecutive speculative charges. All or
        nothing: when a request fails (an invalid routed rank, ...), no pick of the batch is kept.
        The same deliveries as ``dispatch``, per batch, bound the same way."""
        return self.dispatch_batch(reqs)

    # the placements, one request and a batch per delivery (the pairs of _PLACEMENTS)

    def _one_argmin(self, req: Any) -> int:
        rank = self._pick_fresh(req)  # the C core: the 20 ms throttle, then the argmin of the key
        if rank is None:  # the budget is due a refresh first
            self._refresh()
            rank = self._pick(req)
        return rank

    def _batch_argmin(self, reqs: Sequence[Any]) -> list[int]:
        self._refresh_if_due()
        return self._pick_batch(reqs)

    def _one_carried(self, req: Any) -> int:
        # the prefix index only for a request that carries its prompt's block hashes (the ZMQ
        # controller reads them from the frame in C, the simulator from the trace); any other saves
        # nothing anywhere: the plain argmin below applies the same cost with no saving and skips
        # the index (hashing a Python list of input_ids would cost more than the whole decision)
        kind = self._hashless.get(type(req))  # as in _none_carry_hashes, for one request
        if kind is None:
            kind = self._hashless[type(req)] = _never_has_block_hashes(req)
        if not kind and getattr(req, "block_hashes", None) is not None:
            return self._one_cached(req, True)
        if self._charged_any:
            self._forget_charges()
        rank = self._pick_fresh(req)  # _one_argmin, written out: a call costs a good part of it
        if rank is None:
            self._refresh()
            rank = self._pick(req)
        return rank

    def _batch_carried(self, reqs: Sequence[Any]) -> list[int]:
        if not self._none_carry_hashes(reqs):
            return self._cached_batch(reqs, True)
        self._forget_charges()
        return self._batch_argmin(reqs)

    def _one_prefix(self, req: Any) -> int:
        return self._one_cached(req, False)

    def _batch_prefix(self, reqs: Sequence[Any]) -> list[int]:
        return self._cached_batch(reqs, False)

    def _one_round_robin(self, req: Any) -> int:
        # the request's attributes read directly, an absent one None: ~25 ns less than getattr's default
        try:
            routed = req.routed_dp_rank
        except AttributeError:
            routed = None
        if routed is not None:
            return check_routed_rank(routed, self._active_mask)
        active = self._active
        n = len(active)
        if n == 0:
            raise UnavailableError("no active DP rank: the active set is empty (call set_active with the live ranks)")
        available = self._available_list
        for _ in range(n):
            slot = active[self._rr_counter % n]
            self._rr_counter = (self._rr_counter + 1) % n
            if available[slot]:
                return slot
        raise UnavailableError(
            f"all {n} active DP ranks are unavailable (set_status(rank, True) when a worker recovers)"
        )

    def _batch_round_robin(self, reqs: Sequence[Any]) -> list[int]:
        saved = self._rr_counter
        try:
            return [self._one_round_robin(req) for req in reqs]
        except BaseException:
            self._rr_counter = saved
            raise

    def _one_room(self, req: Any) -> int:
        try:  # as in _one_round_robin
            routed = req.routed_dp_rank
        except AttributeError:
            routed = None
        if routed is not None:
            return check_routed_rank(routed, self._active_mask)
        try:
            room = req.bootstrap_room
        except AttributeError:
            room = None
        if room is None:
            raise InvalidInputError(
                "request has no bootstrap_room: follow_bootstrap_room needs one; send PD requests "
                "through the router, which sets it, not straight to the prefill server"
            )
        if type(room) is not int and (not isinstance(room, int) or isinstance(room, bool)):
            raise InvalidInputError(f"bootstrap_room must be an int, got {room!r}")
        # len(workers) counts reserved slots too, and status is not checked (as in SGLang): the room
        # mapping must stay stable while ranks come and go
        return room % self.num_workers

    def _batch_room(self, reqs: Sequence[Any]) -> list[int]:
        return [self._one_room(req) for req in reqs]

    # -- holding (inflight_wave) ----------------------------------------------------------------------

    @property
    def clock(self) -> Callable[[], float]:
        """The clock this dispatcher reads (``next_due_at`` is in its time)."""
        return self._clock

    @property
    def holds(self) -> bool:
        """The method holds requests back: call ``offer``, then ``due`` by ``next_due_at``."""
        return self.wave is not None

    def offer(self, reqs: Sequence[Any]) -> list[Any]:
        """The requests to place now (with ``dispatch_batch``), of these and of those held before.

        A method that holds nothing returns ``reqs`` as given. ``inflight_wave`` places a request
        with ``routed_dp_rank`` at once, and holds the others while the group can wait (some rank
        decodes; ``WaveHold.can_wait``); a wave leaves whole (``dpboard.controller.wave``)."""
        wave = self.wave
        if wave is None:
            return list(reqs)
        self._refresh_if_due()
        now = self._clock()
        routed: list[Any] = []
        free: list[Any] = []
        for req in reqs:
            (free if getattr(req, "routed_dp_rank", None) is None else routed).append(req)
        if not self._group_can_wait():
            return routed + wave.take(now, "busy") + free
        out = routed
        for req in free:
            wave.hold(req, now, _frame_bytes(req))
            if wave.over_bytes():  # within one offer too: what is held stays within the bound and a frame
                out += wave.take(now, "bytes")
        reason = wave.reason(now, True, self._candidates())
        return out + wave.take(now, reason) if reason else out

    def due(self) -> list[Any]:
        """The held requests whose wave leaves now (all of them, oldest first), or nothing."""
        wave = self.wave
        if wave is None or not len(wave):
            return []
        self._refresh_if_due()
        now = self._clock()
        reason = wave.reason(now, self._group_can_wait(), self._candidates())
        return wave.take(now, reason) if reason else []

    def next_due_at(self) -> float | None:
        """When ``due`` may have a wave for the caller (the clock's time), None while nothing is held."""
        wave = self.wave
        if wave is None or not len(wave):
            return None
        core = self.budget.core
        return wave.next_due_at(max(core.last_refresh + self._refresh_interval, self._clock() + WAVE_LOOK_MIN))

    def bound_held_bytes(self, max_bytes: int | None) -> None:
        """``inflight_wave``: a wave leaves once its requests' frames (their ``raw``) reach
        ``max_bytes`` (the ZMQ controller's --max-queued-mib); None: by count alone. Nothing for a
        method that holds nothing."""
        if self.wave is not None:
            self.wave.bound_bytes(max_bytes)

    def release_all(self, reason: str = "shutdown") -> list[Any]:
        """Every held request, to place now or refuse: the caller is stopping (nothing stays held),
        or, with ``reason`` "order", a control message must not overtake them."""
        return [] if self.wave is None else self.wave.take(self._clock(), reason)

    @property
    def held(self) -> int:
        """Requests held now."""
        return 0 if self.wave is None else len(self.wave)

    def _group_can_wait(self) -> bool:
        budget = self.budget
        return self.wave.can_wait(budget.running, budget.backlog, budget.candidate)

    def _candidates(self) -> int:
        return int(np.count_nonzero(self.budget.candidate))

    def retract(self, rank: int, req: Any) -> None:
        """Take back the pick of ``req`` on ``rank``: its send failed, so the rank never got it.

        Load-aware methods undo the request's speculative +1 / +tokens and its in-flight ledger
        entry (``DPBudget.retract``); retract a rank's latest picks only, latest first, before the
        next dispatch. Round robin and room methods keep no load, and their order goes on as it was:
        nothing to undo.
        """
        if self.budget is None:
            return
        rank = self._worker_rank(rank, "rank")
        if self.prefix is not None and self._charged[rank]:
            self.budget.retract(rank, self._charged[rank].pop())  # what the pick charged: its uncached part
            return
        self.budget.retract(rank, request_tokens(req))

    def forget_in_flight(self, rank: int) -> None:
        """What ``rank`` has reported is all it will get of what was sent to it: its connection broke
        and the rest went elsewhere (the controller's delivery rule). In-flight accounting stops
        counting the lost requests as load on it from the next refresh."""
        rank = self._worker_rank(rank, "rank")
        if self.budget is not None and self.inflight_accounting:
            self.budget.forget_in_flight(rank)

    def _refresh_if_due(self) -> None:
        """The 20 ms throttle (docs/DISPATCH.md, rule 6): read the board only when ``refresh_interval`` has passed."""
        if self.budget is not None and self.budget.core.refresh_due():
            self._refresh()

    def _pick_cached(self, req: Any, carried: bool) -> int:
        """One inflight_cache pick: the prompt's cached tokens on every rank from the prefix index,
        the pick charged its uncached part, and the prompt recorded on the rank that got it. The
        prompt's blocks: the hashes the request carries (``carried``, if any), else hashes of its
        ``input_ids``."""
        assert self.prefix is not None
        if carried:
            hashes_in = getattr(req, "block_hashes", None)
            hashes = [] if hashes_in is None else list(hashes_in)
        else:
            hashes = request_block_hashes(req, self.prefix.block_size)
        self.prefix.match(hashes, self._savings)
        rank, charged = self.budget.core.pick_saving(req, self._savings)
        self._charged[rank].append(charged)
        self._charged_any = True
        self.prefix.record(rank, hashes)
        return rank

    def _none_carry_hashes(self, reqs: Sequence[Any]) -> bool:
        """No request of the batch carries block hashes. Per type, whether it can at all is looked
        up once (most batches hold one type): a missing slot costs an exception per getattr, a
        good part of a whole decision."""
        hashless = self._hashless
        last, kind = None, True
        for req in reqs:
            t = type(req)
            if t is not last:
                last, kind = t, hashless.get(t)
                if kind is None:
                    kind = hashless[t] = _never_has_block_hashes(req)
            if not kind and getattr(req, "block_hashes", None) is not None:
                return False
        return True

    def _forget_charges(self) -> None:
        """A new dispatch call: what earlier calls charged can no longer be retracted."""
        if self._charged_any:
            for stack in self._charged:
                stack.clear()
            self._charged_any = False

    def _one_cached(self, req: Any, carried: bool) -> int:
        self._forget_charges()
        self._refresh_if_due()
        return self._pick_cached(req, carried)

    def _cached_batch(self, reqs: Sequence[Any], carried: bool) -> list[int]:
        # One refresh, then one pick per request in order, each seeing the prompts recorded before it.
        # All or nothing for the budget; the index keeps what failed batches recorded (it is an estimate).
        self._forget_charges()
        self._refresh_if_due()
        core = self.budget.core
        saved_start = core.next_start
        picks: list[int] = []
        try:
            for req in reqs:
                picks.append(self._pick_cached(req, carried))
        except BaseException:
            for rank in reversed(picks):
                core.retract(rank, self._charged[rank].pop())
            core.next_start = saved_start
            raise
        return picks

    @property
    def described(self) -> str:
        """The method as start-up lines name it, with the lockstep horizon where it has one."""
        if self.spec.key is ArgminKey.LOCKSTEP:
            return f"{self.method.value} (horizon {self.lockstep_horizon} group steps)"
        return self.method.value

    def __repr__(self) -> str:
        return (
            f"Dispatcher(method={self.method.value}, num_workers={self.num_workers}, active={list(self._active)}, "
            f"inflight_accounting={self.inflight_accounting}, health_aware={self.health_aware}, "
            f"rotate_ties={self.rotate_ties})"
        )


# How each delivery places one request and a batch (``Delivery`` says what each does): the
# Dispatcher's one switch on it, taken once per dispatcher (``__init__`` binds the pair as its
# ``dispatch`` and ``dispatch_batch``). A held wave leaves as a batch, placed as ARGMIN_CARRIED places
# one; holding it is ``offer`` and ``due``.
_PLACEMENTS: Mapping[Delivery, tuple[Callable[[Dispatcher, Any], int],
                                     Callable[[Dispatcher, Sequence[Any]], list[int]]]] = MappingProxyType({
    Delivery.ROUND_ROBIN: (Dispatcher._one_round_robin, Dispatcher._batch_round_robin),
    Delivery.ROOM: (Dispatcher._one_room, Dispatcher._batch_room),
    Delivery.ARGMIN: (Dispatcher._one_argmin, Dispatcher._batch_argmin),
    Delivery.ARGMIN_PREFIX: (Dispatcher._one_prefix, Dispatcher._batch_prefix),
    Delivery.ARGMIN_CARRIED: (Dispatcher._one_carried, Dispatcher._batch_carried),
    Delivery.WAVE: (Dispatcher._one_carried, Dispatcher._batch_carried),
})
if set(_PLACEMENTS) != set(Delivery):
    raise AssertionError(f"_PLACEMENTS: one pair per Delivery, missing {set(Delivery) - set(_PLACEMENTS)}")


def _frame_bytes(req: Any) -> int:
    """The size of the frame a request came in (the ZMQ controller's ``Request.raw``), 0 without one."""
    raw = getattr(req, "raw", None)
    return 0 if raw is None else len(raw)


def _never_has_block_hashes(req: Any) -> bool:
    """True when no instance of ``req``'s type can have a ``block_hashes`` attribute: no instance
    dict and no such slot, property or class attribute."""
    return not hasattr(req, "__dict__") and not hasattr(type(req), "block_hashes")
