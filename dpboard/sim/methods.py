"""Which policy a method spec names: ``NAME[:key=value,...]`` -> dpboard's ``Dispatcher`` with those
options (policy.py) or one of the peers' routers (peers.py). What the simulator knows of dpboard's
methods is their rows in ``dpboard.methods.METHODS``: which it offers, which are SGLang's
seed methods and which dpboard's own, and ``auto``'s pair for PD."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from dpboard.errors import InvalidInputError
from dpboard.methods import AUTO, AUTO_PICKS, METHODS, Delivery, Deployment, LoadBalanceMethod
from dpboard.sim.peers import PEERS, make_peer
from dpboard.sim.policy import AutoPolicy, DispatcherPolicy, Policy, SimBoard


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
    """Names of the methods dpboard's controller offers, in the table's order."""
    return [m.value for m in METHODS]


def method_row(name: str) -> Any:
    """The ``METHODS`` row of the controller's method ``name`` (a spec's name part), or None for a
    peer, ``auto`` or any other name."""
    try:
        return METHODS[LoadBalanceMethod(name.strip().lower())]
    except ValueError:
        return None


def seed_and_improved() -> tuple[list[str], list[str]]:
    """SGLang's seed methods that compare load across ranks or rotate (round robin, total_requests,
    total_tokens: not the room, a PD method), and dpboard's own methods, in the table's order."""
    seeds = [m.value for m, row in METHODS.items() if not row.is_improved and row.delivery is not Delivery.ROOM]
    return seeds, [m.value for m, row in METHODS.items() if row.is_improved]


def pd_auto() -> tuple[str, str]:
    """``auto``'s (prefill, decode) pair: the rows that list PD prefill and PD decode."""
    return AUTO_PICKS[Deployment.PD_PREFILL].value, AUTO_PICKS[Deployment.PD_DECODE].value


def maps_rooms(name: str) -> bool:
    """The method places a request by its ``bootstrap_room`` (PD prefill's stable mapping)."""
    row = method_row(name)
    return row is not None and row.delivery is Delivery.ROOM


# vLLM's default deployment (one API server per rank) dispatching through the board: every API
# server picks with dpboard's Dispatcher, reading the engines' exact loads and the exact in-flight
# count over all servers. With every figure exact and read at each pick, all servers see the same
# state, so they pick as one Dispatcher that refreshes before every pick.
VLLM_BOARD = "vllm_board"
VLLM_BOARD_METHOD = "inflight_ttft"


def make_policy(
    spec: str,
    *,
    n_ranks: int,
    board: SimBoard,
    clock: Callable[[], float],
    refresh_interval_s: float = 0.02,
    seed: int = 0,
    label: str | None = None,
    prefill_delayer: bool = False,
) -> Policy:
    """Build the policy that ``spec`` names, for ``n_ranks`` ranks reading ``board`` on ``clock``.

    ``seed`` feeds a policy that breaks ties at random; ``label`` names it in results (default: ``spec``);
    ``prefill_delayer``: the ranks run SGLang's prefill delayer, so ``inflight_lockstep`` takes the
    horizon the SGLang plugin gives it there (unless ``spec`` names one)."""
    name, options = parse_method_spec(spec)
    label = spec if label is None else label
    if name == VLLM_BOARD:
        name = str(options.pop("method", VLLM_BOARD_METHOD))
        options.setdefault("refresh_interval", 0.0)
    if name in PEERS:
        return make_peer(name, options, n_ranks=n_ranks, clock=clock, delay_s=board.delay_s, seed=seed, label=label)
    try:
        from dpboard.controller import Dispatcher, resolve_load_balance_method
        from dpboard.controller.dispatcher import default_lockstep_horizon
    except ImportError as e:
        raise RuntimeError(
            f"method {name!r} needs dpboard.controller, which cannot be imported ({e}); "
            f"only the peers' policies ({', '.join(PEERS)}) run without it"
        ) from e
    try:
        method = resolve_load_balance_method(name)
    except ValueError:
        # one list of what this function accepts (the resolver's own message lists only its own names)
        known = ", ".join([AUTO, *controller_methods(), *PEERS, VLLM_BOARD])
        raise InvalidInputError(f"unknown dispatch method {name!r}; use one of {known}") from None
    kwargs: dict[str, Any] = {"refresh_interval": refresh_interval_s,
                              "lockstep_horizon": default_lockstep_horizon(prefill_delayer)}
    kwargs.update(options)
    accepted = inspect.signature(Dispatcher).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = [k for k in kwargs if k not in accepted and not takes_any]
    if unknown:
        allowed = sorted(
            k for k in accepted if k not in ("method", "num_workers", "reader", "active", "clock")
        )
        raise InvalidInputError(f"Dispatcher has no option {unknown[0]!r} (in {spec!r}); its options are {allowed}")
    def build(method: Any) -> Any:
        return Dispatcher(method, num_workers=n_ranks, reader=board, active=range(n_ranks), clock=clock, **kwargs)

    if name.strip().lower() == AUTO:
        # the controller's auto: decided from the board as it is (its lockstep sections under
        # --dp-attention), by the same rule and at the same cadence, on the simulated clock
        from dpboard.controller.auto import AutoMethod

        return AutoPolicy(label, AutoMethod(build, board, n_ranks, clock=clock))
    return DispatcherPolicy(label, build(method))
