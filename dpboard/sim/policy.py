"""Dispatch policies for ``dpboard sim``: dpboard's real ``Dispatcher``, and vLLM's score as a baseline.

A policy picks a rank for each request at the simulated moment it reaches the controller. The
load-aware ones read loads from a ``SimBoard``, which gives the real ``Dispatcher`` exactly what a
``BoardReader`` would: ``read_all()`` returning one ``LoadSnapshot | None`` per rank, as published
by the simulated ranks and made visible after the configured delay.

Methods are named by a spec string ``NAME[:key=value,...]``: ``NAME`` is ``vllm`` (the baseline
below) or any ``dpboard.controller.LoadBalanceMethod`` (the real ``Dispatcher`` runs it); the
``key=value`` options are passed to the ``Dispatcher`` as keyword arguments (``refresh_interval=0``
for instance), or to the vLLM policy (``stats_interval``). ``dpboard.sim`` takes ``cadence`` and
``publish_every`` out first: they set that method's run's publish cadence.
"""

from __future__ import annotations

import inspect
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankModel, SimRequest
from dpboard.snapshot import LoadSnapshot

VLLM = "vllm"


class Policy(Protocol):
    name: str
    tick_period_s: float  # > 0: call on_tick that often (simulated seconds); 0: never

    def dispatch(self, req: SimRequest) -> int: ...

    def on_tick(self, now_s: float, ranks: Sequence[RankModel]) -> None: ...


class SimBoard:
    """What the controller can see of the ranks' published snapshots, on the simulated clock.

    ``publish`` queues a snapshot that becomes visible ``delay_s`` later; ``read_all`` returns, per
    rank, the newest snapshot visible now (None before the first). The delay is the same for every
    publish, so one FIFO keeps visibility order.
    """

    def __init__(self, n_ranks: int, clock: Callable[[], float], delay_s: float = 0.0):
        if delay_s < 0:
            raise InvalidInputError(f"snapshot visibility delay must be >= 0 seconds, got {delay_s}")
        self._visible: list[LoadSnapshot | None] = [None] * n_ranks
        self._pending: deque[tuple[float, int, LoadSnapshot]] = deque()
        self._clock = clock
        self.delay_s = delay_s
        self.publishes = 0
        self.reads = 0

    def publish(self, rank: int, snapshot: LoadSnapshot, now_s: float) -> None:
        self.publishes += 1
        if self.delay_s == 0.0:
            self._visible[rank] = snapshot
        else:
            self._pending.append((now_s + self.delay_s, rank, snapshot))

    def read_all(self) -> list[LoadSnapshot | None]:
        self.reads += 1
        pending = self._pending
        if pending:
            now = self._clock()
            while pending and pending[0][0] <= now:
                _, rank, snap = pending.popleft()
                self._visible[rank] = snap
        return list(self._visible)


class VllmScorePolicy:
    """vLLM's internal DP load balancer (``DPLBAsyncMPClient``), as a baseline.

    Per engine it keeps ``[waiting, running]`` and picks the lowest ``4 * waiting + running``,
    scanning from ``start_index`` (the client's index; ties go to the first scanned). After each
    pick it adds 1 to the chosen engine's local waiting count. The counts are replaced wholesale
    whenever the coordinator publishes new ones: it does so at most every ``stats_interval_s``
    (100 ms in vLLM) and only when they changed, from the engines' per-step reports; those reach the
    client ``delay_s`` later.
    """

    def __init__(
        self,
        n_ranks: int,
        clock: Callable[[], float],
        *,
        stats_interval_s: float = 0.1,
        delay_s: float = 0.0,
        start_index: int = 0,
        name: str = VLLM,
    ):
        if stats_interval_s <= 0:
            raise InvalidInputError(f"vllm stats_interval must be > 0 seconds, got {stats_interval_s}")
        self.name = name
        self.n_ranks = n_ranks
        self.tick_period_s = stats_interval_s
        self._clock = clock
        self._delay_s = delay_s
        self._start = start_index % n_ranks
        self.counts: list[list[int]] = [[0, 0] for _ in range(n_ranks)]
        self._published: list[tuple[int, int]] | None = None
        self._pending: deque[tuple[float, list[tuple[int, int]]]] = deque()

    def on_tick(self, now_s: float, ranks: Sequence[RankModel]) -> None:
        current = [(r.num_waiting, r.num_running) for r in ranks]
        if current != self._published:
            self._published = current
            self._pending.append((now_s + self._delay_s, current))

    def dispatch(self, req: SimRequest) -> int:
        if req.routed_dp_rank is not None:
            return int(req.routed_dp_rank)
        pending = self._pending
        if pending:
            now = self._clock()
            while pending and pending[0][0] <= now:
                _, current = pending.popleft()
                self.counts = [[w, r] for w, r in current]
        best = 0
        best_score = sys.maxsize
        for i in range(self.n_ranks):
            idx = (self._start + i) % self.n_ranks
            waiting, running = self.counts[idx]
            score = waiting * 4 + running
            if score < best_score:
                best_score = score
                best = idx
        self.counts[best][0] += 1
        return best


class DispatcherPolicy:
    """dpboard's real ``Dispatcher`` (the code users run), fed by a ``SimBoard`` and the simulated clock."""

    tick_period_s = 0.0

    def __init__(self, name: str, dispatcher: Any):
        self.name = name
        self.dispatcher = dispatcher

    def dispatch(self, req: SimRequest) -> int:
        return self.dispatcher.dispatch(req)

    def on_tick(self, now_s: float, ranks: Sequence[RankModel]) -> None:  # pragma: no cover - never ticked
        pass


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "on", "yes"):
        return True
    if low in ("false", "off", "no"):
        return False
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"total_tokens:refresh_interval=0,foo=bar"`` -> ``("total_tokens", {...})``."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise InvalidInputError(f"empty method name in {spec!r}: write NAME or NAME:key=value,...")
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise InvalidInputError(f"method option {part!r} in {spec!r} is not key=value (e.g. refresh_interval=0)")
        options[key.strip()] = _parse_value(value.strip())
    return name, options


def controller_methods() -> list[str]:
    """Names of the methods dpboard's controller offers (empty when it cannot be imported)."""
    try:
        from dpboard.controller import LoadBalanceMethod
    except ImportError:
        return []
    return [m.value if isinstance(m.value, str) else m.name.lower() for m in LoadBalanceMethod]


def make_policy(
    spec: str,
    *,
    n_ranks: int,
    board: SimBoard,
    clock: Callable[[], float],
    refresh_interval_s: float = 0.02,
    label: str | None = None,
) -> Policy:
    """Build the policy that ``spec`` names, for ``n_ranks`` ranks reading ``board`` on ``clock``.

    ``label`` names it in results (default: ``spec``)."""
    name, options = parse_method_spec(spec)
    label = spec if label is None else label
    if name == VLLM:
        unknown = set(options) - {"stats_interval", "start_index"}
        if unknown:
            raise InvalidInputError(f"vllm takes the options stats_interval and start_index, not {sorted(unknown)}")
        return VllmScorePolicy(
            n_ranks,
            clock,
            stats_interval_s=float(options.get("stats_interval", 0.1)),
            delay_s=board.delay_s,
            start_index=int(options.get("start_index", 0)),
            name=label,
        )
    try:
        from dpboard.controller import Dispatcher, resolve_load_balance_method
    except ImportError as e:
        raise RuntimeError(
            f"method {name!r} needs dpboard.controller, which cannot be imported ({e}); "
            f"only {VLLM!r} runs without it"
        ) from e
    try:
        method = resolve_load_balance_method(name)
    except ValueError as e:
        known = ", ".join([*controller_methods(), VLLM])
        raise InvalidInputError(f"unknown dispatch method {name!r} ({e}); use one of {known}") from None
    kwargs: dict[str, Any] = {"refresh_interval": refresh_interval_s}
    kwargs.update(options)
    accepted = inspect.signature(Dispatcher).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = [k for k in kwargs if k not in accepted and not takes_any]
    if unknown:
        allowed = sorted(
            k for k in accepted if k not in ("method", "num_workers", "reader", "active", "clock")
        )
        raise InvalidInputError(f"Dispatcher has no option {unknown[0]!r} (in {spec!r}); its options are {allowed}")
    dispatcher = Dispatcher(
        method, num_workers=n_ranks, reader=board, active=range(n_ranks), clock=clock, **kwargs
    )
    return DispatcherPolicy(label, dispatcher)
