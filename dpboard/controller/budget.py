"""The load budget of load-aware dispatch: per-rank NumPy arrays, refreshed vectorised from the board.

``DPBudget`` holds, per rank, the load the controller believes the rank has (``total_requests``,
``total_tokens``, and ``backlog``: prompt tokens queued for prefill), which ranks the argmin may pick (``candidate``) and which a routed request may
target (``routable``), and a ledger of what it sent (``sent_reqs``, ``sent_tokens``, and a ring of
cumulative sent tokens for exact in-flight accounting). A pick and its speculative charge are done
by ``dpboard.controller._dispatch.ArgminCore`` in place on these arrays; ``PyArgminCore`` below is the same
rules in plain Python (the tests run both and compare).

Refresh rules (docs/DISPATCH.md, rule 6 and "What dpboard adds, and why"):
- seed (SGLang) behaviour: a rank whose snapshot changed (``publish_seq`` or ``timestamp_ns``) since the
  last refresh gets ``total_requests = running + waiting`` and ``total_tokens = num_total_tokens``,
  and ``backlog = num_total_tokens - num_used_tokens`` (the seqlens still waiting for KV), which
  overwrites the speculative charges on it; an unchanged or missing snapshot leaves the rank as
  it is, so a rank with no snapshot counts as zero plus what was charged to it.
- in-flight accounting: the budget is always *snapshot + what is in flight*: ``in_flight = sent -
  received`` requests, and their tokens come from the ring (the cumulative tokens after each send),
  so a refresh never erases requests still on their way, and never counts one twice.
- with a key that reads KV room (``ArgminKey.HEADROOM``, ``LOCKSTEP``) the backlog also keeps the prompts of ours that a rank
  admitted since its previous snapshot: the batch it is prefilling, which its queued figure leaves
  out (``_count_prefilling``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.methods import METHODS, ArgminKey, LoadBalanceMethod
from dpboard.snapshot import SNAPSHOT_DTYPE, LoadSnapshot, SlotStatus

DEFAULT_LEDGER_CAPACITY = 4096  # in-flight requests per rank tracked exactly (32 KiB per rank)
# The largest request, in tokens: far beyond any context length, and small enough that no budget sum
# of real requests comes near int64 (the sums saturate anyway; docs/DISPATCH.md, "Bounds").
MAX_REQUEST_TOKENS = 2**32
INT64_MAX = 2**63 - 1

try:
    from dpboard.controller import _dispatch
    from dpboard.controller._dispatch import ArgminCore
except ImportError:  # a source tree without the built extension: the Python twin does the same work
    ArgminCore = None
else:
    # the facts the C core and this module share, compared as the board's layout is (board/seqlock.py):
    # an extension built from another source is an ImportError naming both, never a wrong key
    _compiled = {name: getattr(_dispatch, name) for name in dir(_dispatch) if name.startswith("KEY_")}
    _compiled["MAX_REQUEST_TOKENS"] = _dispatch.MAX_REQUEST_TOKENS
    _expected = {f"KEY_{k.name}": k.value for k in ArgminKey} | {"MAX_REQUEST_TOKENS": MAX_REQUEST_TOKENS}
    if _compiled != _expected:
        raise ImportError(f"dpboard.controller._dispatch ({_dispatch.__file__}) was built from another source: it "
                          f"has {_compiled}, methods.py and budget.py say {_expected}: rebuild it (pip install -e .)")

_LIVE = int(SlotStatus.LIVE)
_STALE = int(SlotStatus.STALE)
_TORN = int(SlotStatus.TORN)


def request_tokens(req: Any) -> int:
    """A request's token estimate: ``len(input_ids)``, else ``num_tokens`` (docs/DISPATCH.md, rule 7)."""
    ids = getattr(req, "input_ids", None)
    if ids is not None:
        try:
            n = len(ids)
        except TypeError:
            raise InvalidInputError(f"request input_ids must be a sequence of token ids, got {type(ids)!r}") from None
        if n > MAX_REQUEST_TOKENS:
            raise InvalidInputError(f"request of {n} tokens is larger than the {MAX_REQUEST_TOKENS} tokens a "
                                    f"request may have")
        return n
    nt = getattr(req, "num_tokens", None)
    if nt is None:
        raise InvalidInputError(
            "request has neither input_ids nor num_tokens: give it one of them (the token estimate)"
        )
    if not isinstance(nt, int) or isinstance(nt, bool) or not 0 <= nt <= MAX_REQUEST_TOKENS:
        raise InvalidInputError(f"request num_tokens must be an int in [0, {MAX_REQUEST_TOKENS}], got {nt!r}")
    return nt


def _sat(value: int) -> int:
    """A sum of non-negative loads, at most INT64_MAX (what the C core's saturating adds give)."""
    return value if value <= INT64_MAX else INT64_MAX


def saturating_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b for non-negative int64 arrays, at most INT64_MAX instead of wrapping negative."""
    total = a + b
    np.putmask(total, total < 0, INT64_MAX)  # two non-negative int64 can only wrap below zero
    return total


def check_routed_rank(rank: Any, routable: np.ndarray) -> int:
    """``routed_dp_rank`` as docs/DISPATCH.md's rule 2 accepts it: an int naming a routable (active) slot."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise InvalidInputError(f"routed_dp_rank must be an int or None, got {rank!r}")
    if rank < 0 or rank >= len(routable) or not routable[rank]:
        raise InvalidInputError(f"DP rank {rank} is not active.")
    return rank


# What each key reads beyond the tokens and requests every core has, and the error when it is missing:
# _dispatch.c's KEYS (the twin tests compare the two cores' errors).
_KEY_NEEDS: dict[ArgminKey, tuple[tuple[str, ...], str]] = {
    ArgminKey.BACKLOG: (("backlog",), "key BACKLOG needs the backlog array (queued prefill tokens per rank)"),
    ArgminKey.HEADROOM: (("backlog", "capacity"), "key HEADROOM needs the backlog and capacity arrays (queued "
                         "prefill and KV capacity per rank)"),
    ArgminKey.LOCKSTEP: (("backlog", "capacity", "running", "chunk"), "key LOCKSTEP needs the backlog, capacity, "
                         "running and chunk arrays (queued prefill, KV capacity, running requests and prefill "
                         "chunk per rank)"),
}


class PyArgminCore:
    """``dpboard.controller._dispatch.ArgminCore`` in Python: same arguments, same picks, same errors.

    ``arrays`` is a ``DPBudget`` (or any object with its array attributes: ``total_tokens``,
    ``total_requests``, ``candidate``, ``routable``, ``sent_reqs``, ``sent_tokens``, and where the key
    reads them ``ring``, ``backlog``, ``capacity``, ``running``, ``chunk``); ``key`` an ``ArgminKey``.
    ``clock`` and ``interval``: the refresh throttle of ``pick_fresh`` and ``refresh_due`` (no clock:
    never due)."""

    def __init__(self, arrays: Any, key: int = ArgminKey.TOKENS, rotate: bool = False, horizon: int = 0,
                 clock: Callable[[], float] | None = None, interval: float = 0.0):
        if horizon < 0:
            raise InvalidInputError("horizon must be >= 0 group steps")
        if clock is not None and not callable(clock):
            raise InvalidInputError("clock must be a callable returning seconds, or None")
        self.tokens, self.requests = arrays.total_tokens, arrays.total_requests
        self.candidate, self.routable = arrays.candidate, arrays.routable
        self.sent_reqs, self.sent_tokens = arrays.sent_reqs, arrays.sent_tokens
        self.ring, self.backlog, self.capacity, self.running, self.chunk = (
            getattr(arrays, name, None) for name in ("ring", "backlog", "capacity", "running", "chunk"))
        self.n = len(self.tokens)
        self.key = key
        self.rotate, self.horizon = bool(rotate), int(horizon)
        self.next_start = 0
        self.clock, self.interval, self.last_refresh = clock, float(interval), float("-inf")

    @property
    def key(self) -> ArgminKey:
        return self._key

    @key.setter
    def key(self, value: int) -> None:
        if not isinstance(value, int) or value not in ArgminKey._value2member_map_:
            raise InvalidInputError(f"key must be one of the KEY_* constants (0..{len(ArgminKey) - 1}), got {value}")
        key = ArgminKey(value)
        names, missing = _KEY_NEEDS.get(key, ((), ""))
        if any(getattr(self, name) is None for name in names):
            raise InvalidInputError(missing)
        self._key = key

    def _routed(self, req: Any) -> int | None:
        r = getattr(req, "routed_dp_rank", None)
        return None if r is None else check_routed_rank(r, self.routable)

    def _scan(self, tokens: int, savings: np.ndarray | None) -> Iterator[tuple[int, int, int]]:
        """(rank, uncached tokens, KV tokens) of each candidate, in the C core's scan order."""
        n = self.n
        start = self.next_start if self.rotate else 0
        for k in range(n):
            i = (start + k) % n
            if self.candidate[i]:
                yield i, tokens if savings is None else max(0, tokens - int(savings[i])), int(self.tokens[i])

    def _argmin_saving(self, tokens: int, savings: np.ndarray | None) -> tuple[int, int]:
        """(rank, uncached tokens) with the lowest ``backlog + uncached``, ties to fewer KV tokens;
        with the HEADROOM key, the ranks whose KV cannot hold the uncached prompt (``tokens + uncached >
        capacity``) come after the others, keyed ``tokens + uncached``. ``_dispatch.c``'s
        argmin_saving."""
        cap = self.capacity if self._key is ArgminKey.HEADROOM else None
        best, best_key, best_uncached = -1, None, 0
        for i, uncached, held in self._scan(tokens, savings):
            cost = _sat(int(self.backlog[i]) + uncached)
            full = 0
            if cap is not None and cap[i] > 0 and _sat(held + uncached) > cap[i]:
                full, cost = 1, _sat(held + uncached)
            key = (full, cost, held)
            if best < 0 or key < best_key:
                best, best_key, best_uncached = i, key, uncached
        return self._settle_pick(best), best_uncached

    def _argmin_lockstep(self, tokens: int, savings: np.ndarray | None) -> tuple[int, int]:
        """(rank, uncached tokens) of the inflight_lockstep pick: ``_dispatch.c``'s argmin_lockstep."""
        cap = self.capacity
        rows = []  # (i, uncached, first-token step, backlog, chunk) of the ranks with room, in scan order
        full_best, full_key, full_uncached = -1, None, 0
        for i, uncached, held in self._scan(tokens, savings):
            need = _sat(held + uncached)
            if cap[i] > 0 and need > cap[i]:
                if full_best < 0 or (need, held) < full_key:
                    full_best, full_key, full_uncached = i, (need, held), uncached
                continue
            chunk = max(1, int(self.chunk[i]))
            backlog = max(0, int(self.backlog[i]))
            rows.append((i, uncached, -(-_sat(backlog + uncached) // chunk), backlog, chunk))
        if not rows:
            return self._settle_pick(full_best), full_uncached
        limit = max(min(row[2] for row in rows), self.horizon)
        best, best_key, best_uncached = -1, None, 0
        for i, uncached, step, backlog, chunk in rows:
            if step > limit:
                continue
            stalled = _sat(max(0, int(self.running[i])) * (step - -(-backlog // chunk)))
            key = (stalled, step, int(self.tokens[i]))
            if best < 0 or key < best_key:
                best, best_key, best_uncached = i, key, uncached
        return self._settle_pick(best), best_uncached

    # the keys the C core's argmin compares (the others scan the ranks twice or read the request's size)
    _PLAIN_KEYS: dict[ArgminKey, Callable[[PyArgminCore, int], Any]] = {
        ArgminKey.REQUESTS: lambda core, i: int(core.requests[i]),
        ArgminKey.TOKENS: lambda core, i: (int(core.tokens[i]), int(core.requests[i])),
        ArgminKey.BACKLOG: lambda core, i: (int(core.backlog[i]), int(core.tokens[i])),
    }

    def _argmin(self) -> int:
        n = self.n
        start = self.next_start if self.rotate else 0
        key_of = self._PLAIN_KEYS[self._key]
        best, best_key = -1, None
        for k in range(n):
            i = (start + k) % n
            if not self.candidate[i]:
                continue
            key = key_of(self, i)
            if best < 0 or key < best_key:
                best, best_key = i, key
        return self._settle_pick(best)

    def _settle_pick(self, best: int) -> int:
        """The end of every scan, as the C core's settle_pick: no candidate is an error; with rotating
        ties, the next scan starts after this pick."""
        if best < 0:
            raise UnavailableError(
                "no DP rank can take the request: every active rank is unavailable or unhealthy "
                "(see set_active/set_status, and `dpboard dump` for stale slots)"
            )
        if self.rotate:
            self.next_start = (best + 1) % self.n
        return best

    def charge(self, rank: int, tokens: int) -> None:
        self._check_rank_tokens("charge", rank, tokens)
        self._charge(rank, tokens)

    def _check_rank_tokens(self, name: str, rank: int, tokens: int) -> None:
        if not 0 <= rank < self.n or not 0 <= tokens <= MAX_REQUEST_TOKENS:
            raise InvalidInputError(
                f"{name}(rank, tokens) needs 0 <= rank < {self.n} and 0 <= tokens <= {MAX_REQUEST_TOKENS}")

    def _charge(self, rank: int, tokens: int) -> None:
        self.tokens[rank] = _sat(int(self.tokens[rank]) + tokens)
        self.requests[rank] = _sat(int(self.requests[rank]) + 1)
        if self.backlog is not None:
            self.backlog[rank] = _sat(int(self.backlog[rank]) + tokens)
        self.sent_reqs[rank] = _sat(int(self.sent_reqs[rank]) + 1)
        self.sent_tokens[rank] = _sat(int(self.sent_tokens[rank]) + tokens)
        if self.ring is not None:
            self.ring[rank, int(self.sent_reqs[rank]) % self.ring.shape[1]] = self.sent_tokens[rank]

    def _uncharge(self, rank: int, tokens: int) -> None:
        self.tokens[rank] -= tokens
        self.requests[rank] -= 1
        if self.backlog is not None:
            self.backlog[rank] -= tokens
        self.sent_reqs[rank] -= 1
        self.sent_tokens[rank] -= tokens

    def retract(self, rank: int, tokens: int) -> None:
        self._check_rank_tokens("retract", rank, tokens)
        if self.sent_reqs[rank] < 1 or self.sent_tokens[rank] < tokens:
            raise InvalidInputError(
                f"retract({rank}, {tokens}): rank {rank} has no such send in its ledger "
                f"({int(self.sent_reqs[rank])} sends, {int(self.sent_tokens[rank])} tokens); "
                "retract only a pick that was charged"
            )
        self._uncharge(rank, tokens)

    def _pick(self, req: Any) -> tuple[int, int]:
        routed = self._routed(req)
        tokens = request_tokens(req)
        if routed is not None:
            rank = routed
        else:
            rank = self._argmin_tokens(tokens)
        self._charge(rank, tokens)
        return rank, tokens

    def _argmin_tokens(self, tokens: int) -> int:
        """The rank for a request of ``tokens`` tokens with no saving anywhere."""
        if self._key is ArgminKey.LOCKSTEP:
            return self._argmin_lockstep(tokens, None)[0]
        if self._key is ArgminKey.HEADROOM:
            return self._argmin_saving(tokens, None)[0]
        return self._argmin()

    def pick(self, req: Any) -> int:
        return self._pick(req)[0]

    def refresh_due(self) -> bool:
        """True when ``interval`` has passed on the clock since the last refresh (now the last one)."""
        if self.clock is None:
            return False
        now = float(self.clock())
        if not now - self.last_refresh >= self.interval:
            return False
        self.last_refresh = now
        return True

    def pick_fresh(self, req: Any) -> int | None:
        """None when a refresh is due first (the caller refreshes, then picks), else ``pick(req)``."""
        return None if self.refresh_due() else self._pick(req)[0]

    def pick_batch(self, reqs: Sequence[Any]) -> list[int]:
        saved_start = self.next_start
        done: list[tuple[int, int]] = []
        try:
            for req in reqs:
                done.append(self._pick(req))
        except BaseException:
            for rank, tokens in reversed(done):
                self._uncharge(rank, tokens)
            self.next_start = saved_start
            raise
        return [rank for rank, _ in done]

    def pick_saving(self, req: Any, savings: np.ndarray) -> tuple[int, int]:
        """The ``inflight_cache`` pick: (rank, charged uncached tokens); see ``_dispatch.c``."""
        if self.backlog is None:
            raise InvalidInputError("pick_saving needs the backlog array (queued prefill tokens per rank)")
        routed = self._routed(req)
        tokens = request_tokens(req)
        if routed is not None:
            uncached = max(0, tokens - int(savings[routed]))
            self.charge(routed, uncached)
            return routed, uncached
        pick = self._argmin_lockstep if self._key is ArgminKey.LOCKSTEP else self._argmin_saving
        best, best_uncached = pick(tokens, savings)
        self.charge(best, best_uncached)
        return best, best_uncached

    def pick_tokens(self, tokens: int) -> int:
        if not 0 <= tokens <= MAX_REQUEST_TOKENS:
            raise InvalidInputError(f"estimated tokens must be in [0, {MAX_REQUEST_TOKENS}], got {tokens}")
        rank = self._argmin_tokens(tokens)
        self._charge(rank, tokens)
        return rank


class DPBudget:
    """Per-rank load budget for load-aware dispatch (SGLang's ``DPBudget``, on NumPy arrays).

    ``DPBudget(num_workers)`` then ``update_budget(snapshots)`` / ``update_from_array(records)`` to
    refresh, and ``dispatch(method, estimated_tokens)`` to pick the argmin rank and charge it, as in
    SGLang. The arrays are public and live (a pick changes them in place): read, do not rebind.
    ``key``: how the argmin compares ranks (the method's row in ``METHODS``); ``clock`` and
    ``refresh_interval``: the refresh throttle its core keeps (``core.pick_fresh``, ``core.refresh_due``).
    """

    def __init__(
        self,
        num_workers: int,
        *,
        key: ArgminKey = ArgminKey.TOKENS,
        clock: Callable[[], float] | None = None,
        refresh_interval: float = 0.0,
        lockstep_horizon: int = 0,
        lockstep_chunk: int = 1,
        rotate_ties: bool = False,
        inflight_accounting: bool = False,
        ledger_capacity: int = DEFAULT_LEDGER_CAPACITY,
        use_extension: bool = True,
    ):
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise InvalidInputError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not isinstance(ledger_capacity, int) or ledger_capacity < 2:
            raise InvalidInputError(f"ledger_capacity must be an int >= 2, got {ledger_capacity!r}")
        for name, value, low in (("lockstep_horizon", lockstep_horizon, 0), ("lockstep_chunk", lockstep_chunk, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_REQUEST_TOKENS:
                raise InvalidInputError(f"{name} must be an int in [{low}, {MAX_REQUEST_TOKENS}], got {value!r}")
        n = num_workers
        self.num_workers = n
        self.inflight_accounting = bool(inflight_accounting)
        self.total_requests = np.zeros(n, np.int64)
        self.total_tokens = np.zeros(n, np.int64)
        self.backlog = np.zeros(n, np.int64)  # prompt tokens queued for prefill (in flight included)
        self.capacity = np.zeros(n, np.int64)  # KV tokens each rank holds at most (0: not published)
        # inflight_lockstep: each rank's running requests (its last snapshot's) and prefill chunk (its
        # lockstep detail's, else lockstep_chunk)
        self.running = np.zeros(n, np.int64)
        self.lockstep_chunk = lockstep_chunk
        self.chunk = np.full(n, lockstep_chunk, np.int64)
        self.candidate = np.ones(n, np.uint8)
        self.routable = np.ones(n, np.uint8)
        self.sent_reqs = np.zeros(n, np.int64)
        self.sent_tokens = np.zeros(n, np.int64)
        self.ring = np.zeros((n, ledger_capacity), np.int64) if self.inflight_accounting else None
        # the last snapshot taken from each rank
        self.last_seq = np.zeros(n, np.int64)
        self.last_timestamp_ns = np.zeros(n, np.int64)
        self.snap_requests = np.zeros(n, np.int64)
        self.snap_tokens = np.zeros(n, np.int64)
        self.snap_backlog = np.zeros(n, np.int64)
        self.snap_received = np.zeros(n, np.int64)
        # received = received_base + (requests of ours the rank has acknowledged)
        self.received_base = np.zeros(n, np.int64)
        self.acked = np.zeros(n, np.int64)
        # inflight_ttft: the prompts of ours each rank took out of its waiting queue since its
        # previous snapshot, i.e. the batch it is prefilling now, which the engine's queued-prefill
        # figure leaves out until their first tokens (see _count_prefilling)
        self.count_prefilling = ArgminKey(key).reads_room and self.inflight_accounting
        self.snap_waiting = np.zeros(n, np.int64)
        self.admitted = np.zeros(n, np.int64)
        self.prefilling = np.zeros(n, np.int64)
        self.follows = np.zeros(n, bool)  # the last snapshot read was the one after the snapshot read before
        self.status = np.zeros(n, np.uint8)  # the SlotStatus seen at the last refresh
        self._ranks = np.arange(n)
        core_type = ArgminCore if (use_extension and ArgminCore is not None) else PyArgminCore
        self.core = core_type(self, key=int(key), rotate=rotate_ties, horizon=lockstep_horizon, clock=clock,
                              interval=float(refresh_interval))

    # -- refresh ------------------------------------------------------------------------------------

    def update_budget(self, loads: Sequence[LoadSnapshot | None]) -> None:
        """Refresh from snapshots (SGLang's signature); each goes to the rank its ``dp_rank`` names."""
        self.update_from_array(snapshots_to_array(loads, self.num_workers))

    def update_from_array(
        self,
        records: np.ndarray,
        queued_prefill: np.ndarray | None = None,
        chunk: np.ndarray | None = None,
        pd_role: np.ndarray | None = None,
    ) -> None:
        """Refresh from ``SNAPSHOT_DTYPE`` records, one per rank (``BoardReader.read_array()``).

        ``queued_prefill``, when given, is the prefill work each rank's engine reports queued (-1:
        not reported); the backlog takes it over ``num_total_tokens - num_used_tokens``, which counts
        cached prefixes as work and misses the rest of a prompt whose chunked prefill is under way.
        ``chunk``, when given, is each rank's prefill chunk from its lockstep detail (0: not
        reported, then ``lockstep_chunk``). ``pd_role``, when given, marks the ranks that serve one
        side of PD disaggregation: a prefill server runs no decodes and a decode server no prefill,
        so no prefill of theirs stalls a decode, and ``inflight_lockstep`` keys them as
        ``inflight_ttft`` does (their running requests count as none, their chunk as one token: the
        earliest first token is the smallest queue, exactly)."""
        n = self.num_workers
        if records.dtype != SNAPSHOT_DTYPE or len(records) < n:
            raise InvalidInputError(
                f"update_from_array needs at least {n} SNAPSHOT_DTYPE records (BoardReader.read_array()), "
                f"got {len(records)} of dtype {records.dtype}"
            )
        records = records[:n]
        status = records["status"]
        self.status[:] = status
        seq = records["publish_seq"]
        ts = records["timestamp_ns"]
        whole = (status == _LIVE) | (status == _STALE)
        changed = whole & ((seq != self.last_seq) | (ts != self.last_timestamp_ns))
        if changed.any():
            idx = np.flatnonzero(changed)
            sel = records[idx]
            # the snapshot follows the one read before it: what the rank admitted in between is its
            # current batch (_count_prefilling)
            self.follows[idx] = sel["publish_seq"] == self.last_seq[idx] + 1
            self.last_seq[idx] = sel["publish_seq"]
            self.last_timestamp_ns[idx] = sel["timestamp_ns"]
            self.snap_requests[idx] = saturating_add(sel["num_running_reqs"], sel["num_waiting_reqs"])
            self.snap_tokens[idx] = sel["num_total_tokens"]
            # seqlens of requests not yet holding KV: the prefill work still ahead on the rank
            self.snap_backlog[idx] = np.maximum(sel["num_total_tokens"] - sel["num_used_tokens"], 0)
            if queued_prefill is not None:
                reported = queued_prefill[idx]
                known = reported >= 0
                self.snap_backlog[idx[known]] = reported[known]
            self.snap_received[idx] = sel["num_received_reqs"]
            self.snap_waiting[idx] = sel["num_waiting_reqs"]
            self.capacity[idx] = sel["max_total_num_tokens"]
            self.running[idx] = sel["num_running_reqs"]
            if chunk is not None:
                reported = chunk[idx]
                self.chunk[idx] = np.where(reported > 0, reported, self.lockstep_chunk)
            if pd_role is not None:
                pd = idx[pd_role[idx]]
                self.running[pd] = 0
                self.chunk[pd] = 1
            if not self.inflight_accounting:
                # SGLang: a new snapshot overwrites the speculative charges of its rank
                self.total_requests[idx] = self.snap_requests[idx]
                self.total_tokens[idx] = self.snap_tokens[idx]
                self.backlog[idx] = self.snap_backlog[idx]
        if self.inflight_accounting:
            self._recompute_with_in_flight()
            if self.count_prefilling and changed.any():
                self._count_prefilling(np.flatnonzero(changed))
            if self.count_prefilling:
                self.backlog[:] = saturating_add(self.backlog, self.prefilling)

    def _count_prefilling(self, idx: np.ndarray) -> None:
        """The prompt tokens of ours that each rank in ``idx`` admitted since its previous snapshot.

        A rank publishes as it starts a step, after forming its batch: the requests it admitted
        since its previous snapshot are the batch it is prefilling now, no longer in its waiting
        queue nor in its queued-prefill figure, yet still ahead of a new request's first token.
        Waiting requests are the last ones received (first come, first served), so the rank has
        admitted ``acked - waiting`` of ours; the ring gives their cumulative tokens. A decode step
        admits nothing, so its snapshot clears the figure. Only a snapshot that follows the one read
        before it (``publish_seq`` one more) tells the batch of this step: after a gap in the reads
        (no dispatch for a while) what was admitted in between was prefilled in steps since gone, and
        counts as nothing. When the ring no longer remembers the earlier count (about
        ``ledger_capacity`` requests queued), the batch counts as nothing too."""
        acked = self.acked[idx]
        now = np.clip(acked - self.snap_waiting[idx], 0, acked)
        before = self.admitted[idx]
        cap = self.ring.shape[1]
        ranks = self._ranks[idx]
        known = (now > before) & (self.sent_reqs[idx] - before < cap) & self.follows[idx]
        tokens = self.ring[ranks, now % cap] - self.ring[ranks, before % cap]
        self.prefilling[idx] = np.where(known, np.maximum(tokens, 0), 0)
        self.admitted[idx] = now

    def _recompute_with_in_flight(self) -> None:
        acked = self.snap_received - self.received_base
        # More acknowledged than sent (the rank counted requests of an earlier controller), or fewer
        # than before (the scheduler restarted and its counter with it): rebase, so that what the rank
        # has is taken as acknowledged from here on.
        rebase = (acked > self.sent_reqs) | (acked < self.acked)
        if rebase.any():
            self.received_base[rebase] = self.snap_received[rebase] - self.sent_reqs[rebase]
            acked[rebase] = self.sent_reqs[rebase]
        self.acked[:] = acked
        in_flight = self.sent_reqs - acked
        cap = self.ring.shape[1]
        in_flight_tokens = self.sent_tokens - self.ring[self._ranks, acked % cap]
        overflow = in_flight >= cap
        if overflow.any():
            # more in flight than the ring remembers: estimate from the mean of the last cap-1 sends
            oldest = self.ring[self._ranks, (self.sent_reqs + 1) % cap]
            mean = (self.sent_tokens - oldest) / (cap - 1)
            in_flight_tokens[overflow] = (in_flight[overflow] * mean[overflow]).astype(np.int64)
        self.total_requests[:] = saturating_add(self.snap_requests, in_flight)
        self.total_tokens[:] = saturating_add(self.snap_tokens, in_flight_tokens)
        self.backlog[:] = saturating_add(self.snap_backlog, in_flight_tokens)

    def in_flight(self) -> np.ndarray:
        """Requests sent to each rank that its last snapshot had not yet counted as received."""
        return self.sent_reqs - self.acked

    def forget_in_flight(self, rank: int) -> None:
        """Take what ``rank`` last reported as all it will ever get of what was sent to it (its
        connection broke: the rest was lost, and went elsewhere). Applied at the next refresh."""
        self.received_base[rank] = self.snap_received[rank] - self.sent_reqs[rank]

    # -- picks --------------------------------------------------------------------------------------

    def dispatch(self, method: LoadBalanceMethod | str | None = None, estimated_tokens: int = 0) -> int:
        """Argmin rank for ``method`` (default: the budget's key), charged +1 and +estimated_tokens.
        A method given sets the budget's key to its own (its row's) for this pick and the next ones."""
        if method is not None:
            spec = METHODS[LoadBalanceMethod(method)]
            if spec.key is None:
                raise InvalidInputError(f"DPBudget.dispatch needs a load-aware method, got {spec.method.value}")
            self.core.key = spec.key
        return self.core.pick_tokens(int(estimated_tokens))

    def charge(self, rank: int, tokens: int) -> None:
        """Count one request of ``tokens`` tokens sent to ``rank`` (what a pick does after choosing)."""
        self.core.charge(rank, tokens)

    def retract(self, rank: int, tokens: int) -> None:
        """Undo the latest charge of ``tokens`` to ``rank``: the request never reached it (its send
        failed), so neither the budget nor the in-flight ledger may keep it.

        Call it before the next refresh, for the rank's latest charges only (latest first), as the
        controller does for a send that fails. The ring slot of the undone send keeps its value
        until the next charge overwrites it; that slot is the one of the oldest send the ring
        remembers, so the in-flight tokens stay exact unless the rank has about
        ``ledger_capacity`` requests in flight, where they are estimated anyway.
        """
        self.core.retract(int(rank), int(tokens))

    def set_candidates(self, mask: Sequence[bool] | np.ndarray) -> None:
        self.candidate[:] = np.asarray(mask, dtype=bool)

    def set_routable(self, mask: Sequence[bool] | np.ndarray) -> None:
        self.routable[:] = np.asarray(mask, dtype=bool)

    def __repr__(self) -> str:
        return (
            f"DPBudget(num_workers={self.num_workers}, total_requests={self.total_requests.tolist()}, "
            f"total_tokens={self.total_tokens.tolist()})"
        )


def snapshots_to_array(loads: Sequence[LoadSnapshot | None], n: int, out: np.ndarray | None = None) -> np.ndarray:
    """``read_all()``-style snapshots -> ``SNAPSHOT_DTYPE`` records indexed by ``dp_rank``.

    A snapshot is LIVE (a list has no staleness); a rank without one is EMPTY.
    """
    if out is None:
        out = np.zeros(n, SNAPSHOT_DTYPE)
    else:
        out[:] = 0
    out["dp_rank"] = np.arange(n)
    for snap in loads:
        if snap is None:
            continue
        rank = snap[0]
        if not 0 <= rank < n:
            raise InvalidInputError(f"a snapshot names dp_rank {rank}, outside the {n} worker slots (0..{n - 1})")
        out[rank] = (*snap, _LIVE)
    return out
