"""Dispatch policies for ``dpboard sim``: dpboard's real ``Dispatcher``, and the peers' routers.

A policy picks a rank for each request at the simulated moment it reaches the controller. dpboard's
load-aware methods read loads from a ``SimBoard``, which gives the real ``Dispatcher`` exactly what a
``BoardReader`` would: ``read_all()`` returning one ``LoadSnapshot | None`` per rank, as published
by the simulated ranks and made visible after the configured delay. The peers' policies
(``dpboard.sim.peers``) see what their own systems see instead: their routing history, the engine
stats or the KV events they subscribe to, through the hooks of ``Policy``.

Methods are named by a spec string ``NAME[:key=value,...]``: ``NAME`` is a peer (``vllm``,
``cache_aware``, ``dynamo_kv``) or any ``dpboard.controller.LoadBalanceMethod`` (the real
``Dispatcher`` runs it); the ``key=value`` options are passed to the ``Dispatcher`` as keyword
arguments (``refresh_interval=0`` for instance), or to the peer's policy (its own parameters).
``dpboard.sim`` takes ``cadence`` and ``publish_every`` out first: they set that method's run's
publish cadence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpboard.controller.budget import snapshots_to_array
from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankModel, SimRequest
from dpboard.snapshot import DETAIL_FLAG, DETAIL_PRESENT, SNAPSHOT_DTYPE, LoadSnapshot


class Policy:
    """What the simulator asks of a dispatch policy. The hooks are how a router learns about the
    cluster; each ``wants_*`` flag says which hooks this policy needs (the others are not called)."""

    name: str = ""
    tick_period_s: float = 0.0  # > 0: call on_tick that often (simulated seconds); 0: never
    wants_rank_steps = False  # on_rank_step after every step a rank starts
    wants_request_events = False  # on_first_token and on_finish
    wants_kv_events = False  # on_kv_event for every block a rank's prefix cache stores or drops
    holds = False  # the policy may hold arrivals back: offer and due instead of dispatch

    def dispatch(self, req: SimRequest) -> int:
        raise NotImplementedError

    def offer(self, req: SimRequest) -> list[tuple[SimRequest, int]]:
        """The requests placed now, with their ranks: this one, or none (held), or a whole wave."""
        return [(req, self.dispatch(req))]

    def due(self) -> list[tuple[SimRequest, int]]:
        """Held requests placed now (a policy that holds nothing has none)."""
        return []

    def next_due_at(self) -> float | None:
        """When ``due`` may place some, on the simulated clock (None: nothing held)."""
        return None

    def on_tick(self, now_s: float, ranks: Sequence[RankModel]) -> None:
        """Called every ``tick_period_s`` simulated seconds."""

    def on_rank_step(self, rank: RankModel, now_s: float) -> None:
        """Called when ``rank`` has chosen its next step (its queues as an engine would report them)."""

    def on_first_token(self, req: SimRequest) -> None:
        """Called when ``req``'s first token is out (its prefill is done)."""

    def on_finish(self, req: SimRequest) -> None:
        """Called when ``req`` has finished (its response is complete)."""

    def on_kv_event(self, rank: int, kind: int, ids: list[int]) -> None:
        """Called when ``rank``'s prefix cache stores (``STORED``) or drops (``REMOVED``) blocks."""


class SimBoard:
    """What the controller can see of the ranks' published snapshots, on the simulated clock.

    ``publish`` queues a snapshot that becomes visible ``delay_s`` later; ``read_all`` returns, per
    rank, the newest snapshot visible now (None before the first). The delay is the same for every
    publish, so one FIFO keeps visibility order. A rank also reports its queued prefill work (SGLang's
    ``num_waiting_uncached_tokens``), which a real board carries in the slot's detail:
    ``read_detailed_array`` gives both, as ``BoardReader.read_detailed_array`` does, with the
    lockstep section of a DP-attention group (its size and the ranks' chunk) when given one, and the
    disaggregation mode of a PD pool.
    """

    def __init__(
        self,
        n_ranks: int,
        clock: Callable[[], float],
        delay_s: float = 0.0,
        lockstep: tuple[int, int] | None = None,
        mode: str | None = None,
    ):
        if delay_s < 0:
            raise InvalidInputError(f"snapshot visibility delay must be >= 0 seconds, got {delay_s}")
        # (group size, chunk tokens): the lockstep section every rank of a DP-attention group
        # publishes in its detail, as the SGLang plugin does
        self.lockstep = lockstep
        # PD: the pool's disaggregation mode, which SGLang's servers report in the detail
        self.mode = mode
        self._visible: list[LoadSnapshot | None] = [None] * n_ranks
        self._queued = np.full(n_ranks, -1, np.int64)  # the visible snapshots' queued prefill (-1: none)
        self._throughput = np.zeros(n_ranks, np.float64)  # ... and their decode throughput (gen_throughput)
        self._pending: deque[tuple[float, int, LoadSnapshot, int, float]] = deque()
        self._clock = clock
        self.delay_s = delay_s
        self.publishes = 0
        self.reads = 0
        self._records = np.zeros(n_ranks, SNAPSHOT_DTYPE)

    def publish(self, rank: int, snapshot: LoadSnapshot, now_s: float, queued_prefill: int = -1,
                gen_throughput: float = 0.0) -> None:
        self.publishes += 1
        if self.delay_s == 0.0:
            self._visible[rank] = snapshot
            self._queued[rank] = queued_prefill
            self._throughput[rank] = gen_throughput
        else:
            self._pending.append((now_s + self.delay_s, rank, snapshot, queued_prefill, gen_throughput))

    def _catch_up(self) -> None:
        pending = self._pending
        if pending:
            now = self._clock()
            while pending and pending[0][0] <= now:
                _, rank, snap, queued, throughput = pending.popleft()
                self._visible[rank] = snap
                self._queued[rank] = queued
                self._throughput[rank] = throughput

    def read_all(self) -> list[LoadSnapshot | None]:
        self.reads += 1
        self._catch_up()
        return list(self._visible)

    def read_detailed_array(self, out: np.ndarray) -> np.ndarray:
        """The visible snapshots as DETAILED_DTYPE records; a detail holds the queued prefill and the
        decode throughput only."""
        self.reads += 1
        self._catch_up()
        snapshots_to_array(self._visible, len(self._visible), self._records)
        out["load"] = self._records
        detail = out["detail"]
        published = self._queued >= 0
        flags = np.where(published, DETAIL_PRESENT, 0).astype(np.uint64)
        if self.lockstep is not None:
            flags[published] |= np.uint64(DETAIL_FLAG["lockstep"])
            detail["lockstep_group_size"] = self.lockstep[0]
            detail["lockstep_chunk_tokens"] = self.lockstep[1]
        if self.mode is not None:
            flags[published] |= np.uint64(DETAIL_FLAG["disaggregation"])
            detail["disaggregation_mode"] = self.mode.encode()
        detail["flags"] = flags
        detail["num_waiting_uncached_tokens"] = np.maximum(self._queued, 0)
        detail["gen_throughput"] = np.where(published, self._throughput, 0.0)
        return out


class DispatcherPolicy(Policy):
    """dpboard's real ``Dispatcher`` (the code users run), fed by a ``SimBoard`` and the simulated clock."""

    def __init__(self, name: str, dispatcher: Any):
        self.name = name
        self.dispatcher = dispatcher
        self.holds = dispatcher.holds

    def dispatch(self, req: SimRequest) -> int:
        return self.dispatcher.dispatch(req)

    def offer(self, req: SimRequest) -> list[tuple[SimRequest, int]]:
        return self._place(self.dispatcher.offer((req,)))

    def due(self) -> list[tuple[SimRequest, int]]:
        return self._place(self.dispatcher.due())

    def next_due_at(self) -> float | None:
        return self.dispatcher.next_due_at()

    def _place(self, reqs: list[SimRequest]) -> list[tuple[SimRequest, int]]:
        return list(zip(reqs, self.dispatcher.dispatch_batch(reqs), strict=True)) if reqs else []


class AutoPolicy(Policy):
    """``auto`` as the controller runs it: ``dpboard.controller.auto.AutoMethod`` looks at the board
    when due and the pick is its Dispatcher's (a new one when ``auto`` changes)."""

    def __init__(self, name: str, auto: Any):
        self.name = name
        self.auto = auto

    @property
    def dispatcher(self) -> Any:
        return self.auto.dispatcher

    def dispatch(self, req: SimRequest) -> int:
        self.auto.check()
        return self.auto.dispatcher.dispatch(req)
