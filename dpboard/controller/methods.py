"""Dispatch methods, the ``auto`` rules (docs/DISPATCH.md, rule 1), and who owns node0's load PULL socket
(docs/MULTINODE.md, "One owner")."""

from __future__ import annotations

import enum
import warnings

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
    the running decodes its prefill would stall (docs/DISPATCH.md says when to use which).
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

    @property
    def is_load_aware(self) -> bool:
        """True when the method reads the board (and so needs a reader)."""
        return self not in (LoadBalanceMethod.ROUND_ROBIN, LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM)

    @property
    def by_tokens(self) -> bool:
        """True when the argmin key is (tokens, requests); False when it is requests alone."""
        return self in (LoadBalanceMethod.TOTAL_TOKENS, LoadBalanceMethod.INFLIGHT_TOKENS)

    @property
    def by_backlog(self) -> bool:
        """True when the argmin key is (queued prefill tokens, tokens): the ``inflight_backlog`` key.

        A new request's first token comes after the prompts queued ahead of it on the rank (prefill
        runs before decode), so the rank with the least queued prefill work answers first; among
        equal queues (most often empty ones) the lighter decode batch (fewer KV tokens) wins, as its
        steps are shorter and its cache has more room to admit the prompt.
        """
        return self in (
            LoadBalanceMethod.INFLIGHT_BACKLOG,
            LoadBalanceMethod.INFLIGHT_CACHE,
            LoadBalanceMethod.INFLIGHT_TTFT,
            LoadBalanceMethod.INFLIGHT_LOCKSTEP,
        )

    @property
    def uses_prefix_index(self) -> bool:
        """True when the controller keeps a prefix index to estimate each rank's cached prompt tokens.

        The request's first token comes after the prefill work queued at the rank and after its own
        prompt's prefill, less what the rank's prefix cache already holds of it: the key is
        ``backlog + max(0, prompt - cached)``, ties to the lighter KV.
        """
        return self in (
            LoadBalanceMethod.INFLIGHT_CACHE,
            LoadBalanceMethod.INFLIGHT_TTFT,
            LoadBalanceMethod.INFLIGHT_LOCKSTEP,
        )

    @property
    def by_headroom(self) -> bool:
        """True when the key also reads the rank's KV room: ``inflight_ttft``.

        A rank whose KV can hold the request's uncached prompt on top of what it holds and queues
        (``tokens + uncached <= capacity``) starts the prompt after its queued prefill: key
        ``backlog + uncached``. A rank that cannot makes the prompt wait for its running requests
        to free KV: it comes after every rank that can, and among such ranks the one with the
        fewest ``tokens + uncached`` frees room first. While any rank has room the method is
        ``inflight_cache`` over those ranks (``inflight_backlog`` for a request without prompt
        blocks). Its backlog also keeps the batch a rank is prefilling (the requests of ours the
        rank took out of its waiting queue since its previous snapshot), which the engine's queued
        figure leaves out though it is still ahead of a new request's first token."""
        return self in (LoadBalanceMethod.INFLIGHT_TTFT, LoadBalanceMethod.INFLIGHT_LOCKSTEP)

    @property
    def by_lockstep(self) -> bool:
        """True for ``inflight_lockstep``: ``inflight_ttft``'s figures, chosen for ranks in lockstep.

        With DP attention every rank's step ends together, a prompt's first token on rank r comes
        ``s_r = ceil((backlog_r + uncached) / chunk_r)`` group steps from now, and each step in
        which r prefills gives none of r's running requests a token (SGLang runs a rank's prefill
        batch on its own). Among the ranks whose KV has room, those with ``s_r`` at most
        ``max(min s, horizon)`` are as good for the first token; among them the pick is the one
        whose prefill stalls the fewest decodes: ``running_r * (s_r - ceil(backlog_r / chunk_r))``
        (running requests times the prefill steps the prompt adds there; 0 where it fills a chunk
        already under way), then the earlier ``s_r``, then fewer KV tokens. No rank with room: as
        ``inflight_ttft``. docs/DISPATCH.md, "inflight_lockstep", says why."""
        return self is LoadBalanceMethod.INFLIGHT_LOCKSTEP

    @property
    def is_improved(self) -> bool:
        """True for dpboard's own methods (in-flight accounting, health-aware, rotating ties on)."""
        return self in (
            LoadBalanceMethod.INFLIGHT_REQUESTS,
            LoadBalanceMethod.INFLIGHT_TOKENS,
            LoadBalanceMethod.INFLIGHT_BACKLOG,
            LoadBalanceMethod.INFLIGHT_CACHE,
            LoadBalanceMethod.INFLIGHT_TTFT,
            LoadBalanceMethod.INFLIGHT_LOCKSTEP,
        )

    def __str__(self) -> str:
        return self.value


AUTO = "auto"
METHOD_CHOICES: tuple[str, ...] = (AUTO, *(m.value for m in LoadBalanceMethod))
DISAGGREGATION_MODES: tuple[str, ...] = ("null", "prefill", "decode")


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

    ``auto``: no PD -> round_robin, or inflight_lockstep where the ranks step in lockstep
    (``lockstep``: DP attention, vLLM's MoE DP); PD prefill -> follow_bootstrap_room; PD decode ->
    round_robin. ``round_robin`` in PD prefill warns and becomes follow_bootstrap_room: decode finds
    the prefill rank by ``bootstrap_room``, so prefill must map rooms to ranks stably.
    """
    mode = parse_disaggregation_mode(disaggregation_mode)
    parsed = parse_load_balance_method(method)
    if parsed == AUTO:
        if mode == "prefill":
            return LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM
        if mode == "null" and lockstep:
            return LoadBalanceMethod.INFLIGHT_LOCKSTEP
        return LoadBalanceMethod.ROUND_ROBIN
    assert isinstance(parsed, LoadBalanceMethod)
    if mode == "prefill" and parsed is LoadBalanceMethod.ROUND_ROBIN:
        warnings.warn(
            "load balance method round_robin does not map bootstrap_room stably in PD prefill; "
            "using follow_bootstrap_room instead",
            UserWarning,
            stacklevel=2,
        )
        return LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM
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
