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

import inspect
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankModel, SimRequest
from dpboard.snapshot import LoadSnapshot


class Policy:
    """What the simulator asks of a dispatch policy. The hooks are how a router learns about the
    cluster; each ``wants_*`` flag says which hooks this policy needs (the others are not called)."""

    name: str = ""
    tick_period_s: float = 0.0  # > 0: call on_tick that often (simulated seconds); 0: never
    wants_rank_steps = False  # on_rank_step after every step a rank starts
    wants_request_events = False  # on_first_token and on_finish
    wants_kv_events = False  # on_kv_event for every block a rank's prefix cache stores or drops

    def dispatch(self, req: SimRequest) -> int:
        raise NotImplementedError

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


class DispatcherPolicy(Policy):
    """dpboard's real ``Dispatcher`` (the code users run), fed by a ``SimBoard`` and the simulated clock."""

    def __init__(self, name: str, dispatcher: Any):
        self.name = name
        self.dispatcher = dispatcher

    def dispatch(self, req: SimRequest) -> int:
        return self.dispatcher.dispatch(req)


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
    seed: int = 0,
    label: str | None = None,
) -> Policy:
    """Build the policy that ``spec`` names, for ``n_ranks`` ranks reading ``board`` on ``clock``.

    ``seed`` feeds a policy that breaks ties at random; ``label`` names it in results (default: ``spec``)."""
    from dpboard.sim.peers import PEERS, make_peer

    name, options = parse_method_spec(spec)
    label = spec if label is None else label
    if name in PEERS:
        return make_peer(name, options, n_ranks=n_ranks, clock=clock, delay_s=board.delay_s, seed=seed, label=label)
    try:
        from dpboard.controller import Dispatcher, resolve_load_balance_method
    except ImportError as e:
        raise RuntimeError(
            f"method {name!r} needs dpboard.controller, which cannot be imported ({e}); "
            f"only the peers' policies ({', '.join(PEERS)}) run without it"
        ) from e
    try:
        method = resolve_load_balance_method(name)
    except ValueError as e:
        known = ", ".join([*controller_methods(), *PEERS])
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
