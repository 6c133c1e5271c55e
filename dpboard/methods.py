"""Dispatch methods, one row each in ``METHODS``; the ``auto`` rules (docs/DISPATCH.md, rule 1), read
from the rows; and who owns node0's load PULL socket (docs/MULTINODE.md, "One owner").

A leaf (it imports ``dpboard.errors`` only), so that every stage reads the one table: the controller
(the ``Dispatcher``, ``DPBudget``, ``auto``), ``dpboard doctor`` (which may not import the
controller), the engine integrations, the simulator and the command lines.

A method is its row: how a request is placed (``Delivery``), which argmin key the C core compares
ranks by (``ArgminKey``: ``_dispatch.c`` switches on its values and exports them, checked at import
by ``dpboard.controller.budget``), the defaults of dpboard's own rules, and where ``auto`` picks it.
The ``Dispatcher``, ``DPBudget``, ``auto``, the simulator and the command lines read the rows; the
trait properties of ``LoadBalanceMethod`` read them too (docs/ARCHITECTURE.md, "Adding a dispatch
method").
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dpboard.errors import InvalidInputError


class LoadBalanceMethod(str, enum.Enum):
    """How the controller picks a DP rank for a request without ``routed_dp_rank``.

    The first four are SGLang's and behave exactly like it by default. The ``inflight_*`` methods are
    dpboard's, with exact in-flight accounting, health-aware candidates and rotating ties switched on:
    ``inflight_requests`` and ``inflight_tokens`` keep SGLang's keys; ``inflight_backlog`` keys on the
    prefill work queued at the rank; ``inflight_cache`` on that work plus the part of the prompt the
    rank's prefix cache does not hold; ``inflight_ttft``, the one to leave on, on that plus the
    tokens that would not fit the rank's KV capacity; ``inflight_lockstep``, for ranks that step in
    lockstep (DP attention), among the ranks whose first token comes within a few group steps, on
    the running decodes its prefill would stall; ``inflight_wave``, ``inflight_lockstep``'s pick with
    arrivals held while the group decodes, released together so that the group prefills them in
    the same steps (docs/DISPATCH.md says when to use which). Each
    member's facts are its row in ``METHODS``; the properties below read it.
    """

    ROUND_ROBIN = "round_robin"
    FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"
    TOTAL_REQUESTS = "total_requests"
    TOTAL_TOKENS = "total_tokens"
    INFLIGHT_REQUESTS = "inflight_requests"
    INFLIGHT_TOKENS = "inflight_tokens"
    INFLIGHT_BACKLOG = "inflight_backlog"
    INFLIGHT_CACHE = "inflight_cache"
    INFLIGHT_TTFT = "inflight_ttft"
    INFLIGHT_LOCKSTEP = "inflight_lockstep"
    INFLIGHT_WAVE = "inflight_wave"

    @property
    def spec(self) -> MethodSpec:
        """This method's row of ``METHODS``."""
        return METHODS[self]

    @property
    def is_load_aware(self) -> bool:
        """True when the method reads the board (and so needs a reader)."""
        return METHODS[self].is_load_aware

    @property
    def by_tokens(self) -> bool:
        """True when the argmin key is (tokens, requests)."""
        return METHODS[self].key is ArgminKey.TOKENS

    @property
    def by_backlog(self) -> bool:
        """True when the key reads the prefill work queued at each rank (``ArgminKey.reads_backlog``)."""
        return getattr(METHODS[self].key, "reads_backlog", False)

    @property
    def uses_prefix_index(self) -> bool:
        """True when the controller keeps a prefix index to estimate each rank's cached prompt tokens."""
        return METHODS[self].uses_prefix_index

    @property
    def by_headroom(self) -> bool:
        """True when the key also reads each rank's KV room (``ArgminKey.reads_room``)."""
        return getattr(METHODS[self].key, "reads_room", False)

    @property
    def by_lockstep(self) -> bool:
        """True for the key of ranks in lockstep (``ArgminKey.LOCKSTEP``)."""
        return METHODS[self].key is ArgminKey.LOCKSTEP

    @property
    def is_improved(self) -> bool:
        """True for dpboard's own methods (in-flight accounting, health-aware, rotating ties on)."""
        return METHODS[self].is_improved

    def __str__(self) -> str:
        return self.value


class ArgminKey(enum.IntEnum):
    """What the argmin compares, per candidate rank; ties go to the scan order (from rank 0, or from
    the rank after the last pick with rotating ties). The values are the ids ``_dispatch.c`` switches
    on (it exports each as ``KEY_<NAME>``; ``dpboard.controller.budget`` compares them at import), and
    ``PyArgminCore`` keys its Python twin of each by the member."""

    # running + waiting (+ in flight)
    REQUESTS = 0
    # (tokens, requests)
    TOKENS = 1
    # (queued prefill tokens, tokens): a new request's first token comes after the prompts queued
    # ahead of it (prefill runs before decode); among equal queues the lighter decode batch wins. With
    # a prefix index: queued prefill + the part of the prompt the rank does not hold, ties to fewer tokens
    BACKLOG = 2
    # BACKLOG among the ranks whose KV holds the uncached prompt on top of what they hold (tokens +
    # uncached <= capacity) before any rank that cannot, and among those the fewest tokens + uncached
    # (its prompt waits for KV to free); the backlog keeps the batch a rank is prefilling
    HEADROOM = 3
    # ranks in lockstep (DP attention): among HEADROOM's ranks with room, those whose first token comes
    # within max(earliest, horizon) group steps, the fewest running decodes the prefill stalls
    # (running x prefill steps added), then the earlier step, then fewer tokens; no room: HEADROOM's
    # pick (docs/DISPATCH.md, "inflight_lockstep")
    LOCKSTEP = 4

    @property
    def reads_backlog(self) -> bool:
        """The key reads each rank's queued prefill (the budget's ``backlog``, the engine's own figure)."""
        return self in (ArgminKey.BACKLOG, ArgminKey.HEADROOM, ArgminKey.LOCKSTEP)

    @property
    def reads_room(self) -> bool:
        """The key reads each rank's KV capacity (and the budget counts the batch a rank prefills)."""
        return self in (ArgminKey.HEADROOM, ArgminKey.LOCKSTEP)


class Delivery(enum.Enum):
    """How the Dispatcher places a request once ``routed_dp_rank`` is not set."""

    ROUND_ROBIN = "round robin over the active, available ranks; load is never read"
    ROOM = "bootstrap_room modulo the worker slots (reserved ones included); status is not read"
    ARGMIN = "the C core's argmin of the key over the candidates, charged speculatively"
    # hashes of the prompt's input_ids, matched on every rank's prefix index before the argmin
    ARGMIN_PREFIX = "the argmin with each rank's cached share of the prompt from the prefix index"
    # hashing a Python list of input_ids costs more than the whole decision: only a request that
    # carries its block hashes (the ZMQ controller's frames, the simulator's trace) consults the index
    ARGMIN_CARRIED = "ARGMIN_PREFIX for a request that carries its block hashes, else ARGMIN"
    # ranks in lockstep: an arrival waits while the group decodes, and leaves with a wave
    # (dpboard.controller.wave); the caller offers requests and places what is due
    WAVE = "ARGMIN_CARRIED for each wave of requests held while the group decodes"


class Deployment(enum.Enum):
    """What ``auto`` decides from: PD disaggregation, and whether the ranks step in lockstep."""

    NO_PD = "no PD"
    LOCKSTEP = "no PD, ranks in lockstep (DP attention, vLLM's MoE DP)"
    PD_PREFILL = "PD prefill"
    PD_DECODE = "PD decode"


@dataclass(frozen=True)
class MethodSpec:
    """One dispatch method: everything the code asks of it (docs/ARCHITECTURE.md, "Adding a dispatch method").

    ``key`` is None exactly for the methods that read no load. ``inflight_accounting``,
    ``health_aware`` and ``rotate_ties`` are the Dispatcher's defaults for its options of those
    names. ``auto_for``: the deployments where ``auto`` is this method (each has exactly one)."""

    method: LoadBalanceMethod
    delivery: Delivery
    key: ArgminKey | None = None
    inflight_accounting: bool = False
    health_aware: bool = False
    rotate_ties: bool = False
    auto_for: frozenset[Deployment] = frozenset()

    def __post_init__(self) -> None:
        if (self.key is None) != (self.delivery in (Delivery.ROUND_ROBIN, Delivery.ROOM)):
            raise AssertionError(f"{self.method.value}: an argmin delivery needs a key, and only it has one")

    @property
    def is_load_aware(self) -> bool:
        return self.key is not None

    @property
    def uses_prefix_index(self) -> bool:
        return self.delivery in (Delivery.ARGMIN_PREFIX, Delivery.ARGMIN_CARRIED, Delivery.WAVE)

    @property
    def holds(self) -> bool:
        """The Dispatcher may hold requests back (``Dispatcher.offer``, ``due``, ``release_all``)."""
        return self.delivery is Delivery.WAVE

    @property
    def is_improved(self) -> bool:
        return self.inflight_accounting and self.health_aware and self.rotate_ties


def _row(method: LoadBalanceMethod, delivery: Delivery, key: ArgminKey | None = None, *, improved: bool = False,
         auto_for: tuple[Deployment, ...] = ()) -> tuple[LoadBalanceMethod, MethodSpec]:
    # dpboard's own methods switch all three of its rules on; SGLang's keep SGLang's behaviour
    return method, MethodSpec(method, delivery, key, improved, improved, improved, frozenset(auto_for))


_M, _D, _K, _P = LoadBalanceMethod, Delivery, ArgminKey, Deployment
METHODS: Mapping[LoadBalanceMethod, MethodSpec] = MappingProxyType(dict([
    _row(_M.ROUND_ROBIN, _D.ROUND_ROBIN, auto_for=(_P.NO_PD, _P.PD_DECODE)),
    _row(_M.FOLLOW_BOOTSTRAP_ROOM, _D.ROOM, auto_for=(_P.PD_PREFILL,)),
    _row(_M.TOTAL_REQUESTS, _D.ARGMIN, _K.REQUESTS),
    _row(_M.TOTAL_TOKENS, _D.ARGMIN, _K.TOKENS),
    _row(_M.INFLIGHT_REQUESTS, _D.ARGMIN, _K.REQUESTS, improved=True),
    _row(_M.INFLIGHT_TOKENS, _D.ARGMIN, _K.TOKENS, improved=True),
    _row(_M.INFLIGHT_BACKLOG, _D.ARGMIN, _K.BACKLOG, improved=True),
    _row(_M.INFLIGHT_CACHE, _D.ARGMIN_PREFIX, _K.BACKLOG, improved=True),
    _row(_M.INFLIGHT_TTFT, _D.ARGMIN_CARRIED, _K.HEADROOM, improved=True),
    _row(_M.INFLIGHT_LOCKSTEP, _D.ARGMIN_CARRIED, _K.LOCKSTEP, improved=True, auto_for=(_P.LOCKSTEP,)),
    _row(_M.INFLIGHT_WAVE, _D.WAVE, _K.LOCKSTEP, improved=True),
]))
AUTO_PICKS: Mapping[Deployment, LoadBalanceMethod] = MappingProxyType(
    {d: spec.method for spec in METHODS.values() for d in spec.auto_for})


def _check_table() -> None:
    # the rows in the enum's order (the command lines list them so), one per method, and every
    # deployment one auto pick
    picks = [d for spec in METHODS.values() for d in spec.auto_for]
    if list(METHODS) != list(LoadBalanceMethod) or sorted(picks, key=list(Deployment).index) != list(Deployment):
        raise AssertionError(f"METHODS: one row per method, in LoadBalanceMethod's order (rows: "
                             f"{[m.value for m in METHODS]}), and one auto pick per deployment "
                             f"(picks: {[d.name for d in picks]})")


_check_table()

AUTO = "auto"
METHOD_CHOICES: tuple[str, ...] = (AUTO, *(m.value for m in METHODS))
DISAGGREGATION_MODES: tuple[str, ...] = ("null", "prefill", "decode")


def deployment(disaggregation_mode: str | None = None, *, lockstep: bool = False) -> Deployment:
    """The deployment ``auto`` decides for: the PD side when there is one, else whether ranks step in lockstep."""
    mode = parse_disaggregation_mode(disaggregation_mode)
    if mode == "prefill":
        return Deployment.PD_PREFILL
    if mode == "decode":
        return Deployment.PD_DECODE
    return Deployment.LOCKSTEP if lockstep else Deployment.NO_PD


def auto_pick(disaggregation_mode: str | None = None, *, lockstep: bool = False) -> LoadBalanceMethod:
    """What ``auto`` is for a deployment: the method whose row lists it (``AUTO_PICKS``)."""
    return AUTO_PICKS[deployment(disaggregation_mode, lockstep=lockstep)]


def _normalise(text: str) -> str:
    return text.strip().lower().replace("-", "_")


def parse_disaggregation_mode(mode: str | None) -> str:
    """``None``/``"null"``/``"none"`` -> ``"null"``; ``"prefill"``; ``"decode"``; anything else raises."""
    if mode is None:
        return "null"
    if not isinstance(mode, str):
        raise InvalidInputError(f"disaggregation_mode must be a string or None, got {mode!r}")
    norm = _normalise(mode)
    if norm in ("null", "none", ""):
        return "null"
    if norm in DISAGGREGATION_MODES:
        return norm
    raise InvalidInputError(
        f"unknown disaggregation_mode {mode!r}: expected one of null (no PD), prefill, decode"
    )


def parse_load_balance_method(method: str | LoadBalanceMethod) -> LoadBalanceMethod | str:
    """A method name (case and ``-``/``_`` do not matter) -> the enum member, or ``"auto"``."""
    if isinstance(method, LoadBalanceMethod):
        return method
    if not isinstance(method, str):
        raise InvalidInputError(f"load balance method must be a string, got {method!r}")
    norm = _normalise(method)
    if norm == AUTO:
        return AUTO
    try:
        return LoadBalanceMethod(norm)
    except ValueError:
        raise InvalidInputError(
            f"unknown load balance method {method!r}: expected one of {', '.join(METHOD_CHOICES)}"
        ) from None


def resolve_load_balance_method(
    method: str | LoadBalanceMethod, disaggregation_mode: str | None = None, *, lockstep: bool = False
) -> LoadBalanceMethod:
    """Resolve ``auto`` and the PD prefill rule before a controller starts (docs/DISPATCH.md, rule 1).

    ``auto`` is the method whose row lists the deployment (``AUTO_PICKS``): no PD -> round_robin, or
    inflight_lockstep where the ranks step in lockstep (``lockstep``: DP attention, vLLM's MoE DP);
    PD prefill -> follow_bootstrap_room; PD decode -> round_robin. A round-robin method in PD prefill
    warns and becomes prefill's ``auto``: decode finds the prefill rank by ``bootstrap_room``, so
    prefill must map rooms to ranks stably.
    """
    where = deployment(disaggregation_mode, lockstep=lockstep)
    parsed = parse_load_balance_method(method)
    if parsed == AUTO:
        return AUTO_PICKS[where]  # auto_pick
    assert isinstance(parsed, LoadBalanceMethod)
    if where is Deployment.PD_PREFILL and METHODS[parsed].delivery is Delivery.ROUND_ROBIN:
        stable = AUTO_PICKS[Deployment.PD_PREFILL]
        warnings.warn(
            f"load balance method {parsed.value} does not map bootstrap_room stably in PD prefill; "
            f"using {stable.value} instead",
            UserWarning,
            stacklevel=2,
        )
        return stable
    return parsed


class ReaderOwner(str, enum.Enum):
    """The process on node0 that owns the load fan-in ZMQ PULL socket."""

    CONTROLLER = "controller"  # a load-aware controller reads the board on every refresh: it owns it
    TOKENIZER = "tokenizer"  # the tokenizer-side process (SGLang's TokenizerManager / router)
    COLLECTOR = "collector"  # a standalone `dpboard collect`

    def __str__(self) -> str:
        return self.value


def zmq_reader_owner(
    method: str | LoadBalanceMethod,
    disaggregation_mode: str | None = None,
    *,
    dp_size: int = 2,
    standalone_collector: bool = True,
) -> ReaderOwner:
    """Which process on node0 owns the single load PULL socket (docs/MULTINODE.md, "One owner").

    The controller when it exists (``dp_size > 1``) and the resolved method is load-aware: it is the
    process that needs the loads. Otherwise nobody in the dispatch path needs them, and the socket
    belongs to ``dpboard collect`` (``standalone_collector=True``) or, embedded in an engine, to the
    tokenizer-side process that serves ``/v1/loads``. Exactly one owner: the caller binds the socket
    only when this returns its own role.
    """
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise InvalidInputError(f"dp_size must be an int >= 1, got {dp_size!r}")
    with warnings.catch_warnings():  # the controller's own resolve warns about round_robin once
        warnings.simplefilter("ignore")
        resolved = resolve_load_balance_method(method, disaggregation_mode)
    if dp_size > 1 and resolved.is_load_aware:
        return ReaderOwner.CONTROLLER
    return ReaderOwner.COLLECTOR if standalone_collector else ReaderOwner.TOKENIZER
