"""The peers' routers as policies of ``dpboard sim``: what users run today beside dpboard.

Each one is written from its source (cited below and in docs/DISPATCH-RESULTS.md, "The loop, the board and the peers") and sees only what it
sees in its own system, never the simulator's truth:

- ``vllm``: vLLM 0.33's internal DP load balancer as ``vllm serve`` deploys it, one API server per
  rank (vLLM 0.33.0: ``DPLBAsyncMPClient`` in ``vllm/v1/engine/core_client.py``, the coordinator of
  ``vllm/v1/engine/coordinator.py``, ``api_server_count`` in ``vllm/entrypoints/cli/serve.py``):
  each server sees the engines' ``[waiting, running, kv_cache_usage]`` as the coordinator last
  published them, plus its own requests in flight to each engine.
- ``cache_aware``: SGLang's model gateway ``cache_aware`` policy (now the Shepherd Model Gateway,
  lightseekorg/smg ``model_gateway/src/policies/cache_aware.rs`` at 73da68ca9, HTTP string-tree
  path, command-line defaults): its own approximate tree of the prompts it sent where, and its own
  count of requests in flight and routed per worker.
- ``dynamo_kv``: NVIDIA Dynamo's KV router (``lib/kv-router/src/scheduling/selector/default.rs`` at
  07a6c9ce, the defaults of ``config.rs`` at 0243c51b, ``potential_decode_blocks`` of
  ``lib/kv-router/src/sequences/prompt_registry.rs``): which ranks hold which prompt blocks, from
  the ranks' KV events, and its own tracking of the prefill tokens and blocks it has sent each
  rank, in blocks of the engine's page size.

The ranks' caches and the gateway's tree work in the trace's 512-token blocks
(``dpboard.sim.prefix_cache``; the gateway matches characters, finer); Dynamo counts 16-token pages
within them. With no block ids, no request shares anything with another, for them as for the ranks.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankModel, SimRequest
from dpboard.sim.policy import Policy
from dpboard.sim.prefix_cache import (
    BLOCK_TOKENS,
    REMOVED,
    STORED,
    BlockOwners,
    RoutedPrefixTree,
    prefix_tokens,
)

VLLM = "vllm"
CACHE_AWARE = "cache_aware"
DYNAMO_KV = "dynamo_kv"


class VllmPolicy(Policy):
    """vLLM 0.33's DP load balancer as ``vllm serve`` runs it: ``api_servers`` API-server processes,
    each its own balancer (``DPLBAsyncMPClient``) with ``client_count = api_servers``.

    ``vllm serve --data-parallel-size N`` with internal load balancing starts one API server per DP
    rank by default (``vllm/entrypoints/cli/serve.py``: ``api_server_count = data_parallel_size``),
    so ``api_servers`` defaults to the number of ranks; ``api_servers=1`` is the single-server
    deployment. The servers share one listening socket and the kernel hands each connection to one
    of them: here each request goes to a server drawn at random (seeded).

    Each server holds, per engine, ``[waiting, running, kv_cache_usage]`` as the coordinator last
    published them and its own count of the requests *it* sent that engine and has not seen finish.
    It picks the lowest ``max(client_count * inflight, waiting + running) + waiting * 6 *
    max(0, kv - 0.5)`` (the penalty only when waiting), scanning from its start index
    (``engines * client_index // client_count``), which moves on by one after every pick (ties go
    to the first scanned), and adds ``client_count`` to the chosen engine's local waiting count
    until the next publication replaces the counts wholesale.

    The engines report ``[waiting, running, kv_cache_usage]`` to the coordinator around every step
    when running or waiting changed; the coordinator publishes all engines' counts to every server
    at most every ``stats_interval_s`` (100 ms), and only when something changed; the servers see
    them ``delay_s`` later. In-flight counts drop when a request finishes (vLLM learns it with the
    engine's next output, up to a step later).
    """

    wants_rank_steps = True
    wants_request_events = True

    def __init__(
        self,
        n_ranks: int,
        clock: Callable[[], float],
        *,
        stats_interval_s: float = 0.1,
        delay_s: float = 0.0,
        api_servers: int | None = None,
        seed: int = 0,
        kv_threshold: float = 0.5,
        kv_weight: float = 6.0,
        name: str = VLLM,
    ):
        if stats_interval_s <= 0:
            raise InvalidInputError(f"vllm stats_interval must be > 0 seconds, got {stats_interval_s}")
        servers = n_ranks if api_servers is None else api_servers
        if servers < 1:
            raise InvalidInputError(f"vllm api_servers must be >= 1 (vllm serve starts one per DP rank), got {servers}")
        self.name, self.n_ranks, self.tick_period_s = name, n_ranks, stats_interval_s
        self._clock, self._delay_s, self.client_count = clock, delay_s, servers
        self.kv_threshold, self.kv_weight = kv_threshold, kv_weight
        self._rng = random.Random(seed)
        self.start = [(n_ranks * i) // servers for i in range(servers)]
        # each server's view of the engines, and its own requests in flight to each
        self.counts: list[list[list[float]]] = [[[0, 0, 0.0] for _ in range(n_ranks)] for _ in range(servers)]
        self.inflight = [[0] * n_ranks for _ in range(servers)]
        self._server_of: dict[int, int] = {}  # rid -> the server that sent it
        self._engine_sent: list[tuple[int, int] | None] = [None] * n_ranks  # (running, waiting) last reported
        self._coordinator: list[list[float]] = [[0, 0, 0.0] for _ in range(n_ranks)]
        self._changed = False
        self._pending: deque[tuple[float, list[list[float]]]] = deque()

    def on_rank_step(self, rank: RankModel, now_s: float) -> None:
        counts = (rank.num_running, rank.num_waiting)
        if counts != self._engine_sent[rank.rank]:
            self._engine_sent[rank.rank] = counts
            self._coordinator[rank.rank] = [counts[1], counts[0], rank.kv_usage]
            self._changed = True

    def on_tick(self, now_s: float, ranks: Sequence[RankModel]) -> None:
        if self._changed:
            self._changed = False
            self._pending.append((now_s + self._delay_s, [list(c) for c in self._coordinator]))

    def on_finish(self, req: SimRequest) -> None:
        self.inflight[self._server_of.pop(req.rid)][req.rank] -= 1

    def _catch_up(self) -> None:
        pending = self._pending
        if pending:
            now = self._clock()
            while pending and pending[0][0] <= now:
                published = pending.popleft()[1]
                # every server receives the publication and replaces its counts with it
                self.counts = [[list(c) for c in published] for _ in range(self.client_count)]

    def dispatch(self, req: SimRequest) -> int:
        server = self._rng.randrange(self.client_count) if self.client_count > 1 else 0
        self._server_of[req.rid] = server
        inflight = self.inflight[server]
        if req.routed_dp_rank is not None:
            rank = int(req.routed_dp_rank)
            inflight[rank] += 1
            return rank
        self._catch_up()
        counts = self.counts[server]
        n = self.n_ranks
        start = self.start[server]
        best = 0
        best_score = float("inf")
        for i in range(n):
            idx = (start + i) % n
            waiting, running, kv = counts[idx]
            score = max(self.client_count * inflight[idx], waiting + running)
            if waiting:
                score += waiting * self.kv_weight * max(0.0, kv - self.kv_threshold)
            if score < best_score:
                best_score = score
                best = idx
        counts[best][0] += self.client_count
        self.start[server] = (start + 1) % n
        inflight[best] += 1
        return best


class GatewayCacheAwarePolicy(Policy):
    """SGLang's model gateway ``cache_aware`` policy, with its command-line defaults.

    Load is the gateway's own count of requests in flight per worker (+1 when sent, -1 when the
    response ends). When the loads are imbalanced, ``max - min > balance_abs_threshold`` and
    ``max > min * balance_rel_threshold``, it sends the request to the least loaded worker.
    Otherwise it matches the prompt against its approximate tree of what it sent where: above
    ``cache_threshold`` of the prompt matched, the matched node's tenant (the worker whose prompt
    created the node); else the least loaded. The least loaded is the lowest
    ``(load, processed requests, index)``: ``processed`` counts every request the gateway routed
    to the worker. Either way the prompt is added to the tree under the chosen worker. Every ``eviction_interval_s`` each worker's share of the tree is trimmed to
    ``max_tree_size`` characters (LRU), counted here as ``chars_per_token`` per token.
    """

    wants_request_events = True

    def __init__(
        self,
        n_ranks: int,
        *,
        # the gateway's command-line defaults
        cache_threshold: float = 0.3, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0, max_tree_size: int = 2**26, chars_per_token: float = 4.0,
        name: str = CACHE_AWARE,
    ):
        if eviction_interval_s <= 0 or max_tree_size < 1 or chars_per_token <= 0:
            raise InvalidInputError("cache_aware needs eviction_interval > 0, max_tree_size >= 1, chars_per_token > 0")
        self.name, self.n_ranks, self.cache_threshold = name, n_ranks, cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.tick_period_s = eviction_interval_s
        self.max_tree_tokens = int(max_tree_size / chars_per_token)
        self.load = [0] * n_ranks
        self.processed = [0] * n_ranks
        self.tree = RoutedPrefixTree(n_ranks)
        self.cache_routed = 0  # picks made by the tree (for the report)

    def on_finish(self, req: SimRequest) -> None:
        self.load[req.rank] -= 1

    def on_tick(self, now_s: float, ranks: Sequence[RankModel]) -> None:
        self.tree.evict_to(self.max_tree_tokens)

    def dispatch(self, req: SimRequest) -> int:
        if req.routed_dp_rank is not None:
            rank = int(req.routed_dp_rank)
        else:
            rank = self._select(req)
        ids = req.block_ids
        if ids:
            n = len(ids)
            sizes = [BLOCK_TOKENS] * n
            sizes[-1] = req.prompt_len - BLOCK_TOKENS * (n - 1)
            self.tree.insert(ids, sizes, rank)
        self.load[rank] += 1
        self.processed[rank] += 1
        return rank

    def _least_loaded(self) -> int:
        load, processed = self.load, self.processed
        return min(range(self.n_ranks), key=lambda i: (load[i], processed[i], i))

    def _select(self, req: SimRequest) -> int:
        load = self.load
        lo, hi = min(load), max(load)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self._least_loaded()
        ids = req.block_ids
        depth, tenant = self.tree.longest_match(ids) if ids else (0, -1)
        rate = prefix_tokens(req.prompt_len, len(ids), depth) / req.prompt_len
        if rate > self.cache_threshold and tenant >= 0:
            self.cache_routed += 1
            return tenant
        return self._least_loaded()


class DynamoKvPolicy(Policy):
    """NVIDIA Dynamo's KV router with its defaults (temperature 0: the argmin, ties at random).

    Dynamo counts in blocks of the engine's page size (``block_size``, 16 tokens by default; the
    router's block size must equal the engine's for its KV events to match). For each rank the
    cost, in such blocks, is ``prefill_load_scale * max(0, (active_prefill_tokens + ISL) /
    block_size - overlap_score_credit * overlap) + decode_blocks``, where ``overlap`` is how many of
    the prompt's leading full blocks the rank holds according to the KV events it has published,
    ``active_prefill_tokens`` the uncached prompt tokens the router sent the rank that have not
    produced a first token yet, and ``decode_blocks`` the distinct full blocks of the router's
    requests in flight on the rank plus the new full blocks this prompt would add
    (``potential_decode_blocks``). The router drops a request's prefill tokens at its first token
    and its blocks when it finishes.

    The ranks' caches work in the trace's 512-token blocks: a 512-token block the rank holds is
    ``512 / block_size`` of Dynamo's blocks, and a prompt's last, partial trace block holds its
    full pages only.
    """

    wants_request_events = True
    wants_kv_events = True

    def __init__(
        self,
        n_ranks: int,
        *,
        seed: int = 0,
        # Dynamo's KV router defaults
        overlap_score_credit: float = 1.0, prefill_load_scale: float = 1.0, router_temperature: float = 0.0,
        block_size: int = 16,
        name: str = DYNAMO_KV,
    ):
        if router_temperature != 0:
            raise InvalidInputError(
                "dynamo_kv models router_temperature 0 (Dynamo's default: the lowest cost, ties at random) only"
            )
        if block_size < 1 or BLOCK_TOKENS % block_size:
            raise InvalidInputError(
                f"dynamo_kv block_size must divide the trace's {BLOCK_TOKENS}-token blocks (an engine page "
                f"size such as 16), got {block_size}"
            )
        if not 0 <= overlap_score_credit <= 1 or prefill_load_scale < 0:
            raise InvalidInputError("dynamo_kv needs 0 <= overlap_score_credit <= 1 and prefill_load_scale >= 0")
        self.name = name
        self.n_ranks = n_ranks
        self.credit = overlap_score_credit
        self.scale = prefill_load_scale
        self.block_size = block_size
        self._per_trace_block = BLOCK_TOKENS // block_size
        self.indexer = BlockOwners(n_ranks)
        self._rng = random.Random(seed)
        self.active_tokens = [0] * n_ranks
        # per rank: key of a trace block (its id; (id, pages) for a prompt's partial last block) ->
        # requests in flight using it, and the distinct Dynamo blocks those keys hold
        self._unique: list[dict[object, int]] = [{} for _ in range(n_ranks)]
        self.active_blocks = [0] * n_ranks
        self._prefill: dict[int, int] = {}  # rid -> prefill tokens still counted

    def on_kv_event(self, rank: int, kind: int, ids: list[int]) -> None:
        if kind == STORED:
            self.indexer.stored(rank, ids)
        elif kind == REMOVED:
            self.indexer.removed(rank, ids)

    def on_first_token(self, req: SimRequest) -> None:
        tokens = self._prefill.pop(req.rid, None)
        if tokens is not None:
            self.active_tokens[req.rank] -= tokens

    def _keys(self, req: SimRequest) -> list[tuple[object, int]]:
        """The prompt's full Dynamo blocks, grouped by trace block: (key, blocks)."""
        isl = req.prompt_len
        per = self._per_trace_block
        if not req.block_ids:
            full = isl // self.block_size
            return [((-1 - req.rid, 0), full)] if full else []  # shared with nobody
        keys: list[tuple[object, int]] = []
        for i, block_id in enumerate(req.block_ids):
            pages = min(per, (isl - i * BLOCK_TOKENS) // self.block_size)
            if pages <= 0:
                break
            keys.append((block_id if pages == per else (block_id, pages), pages))
        return keys

    def on_finish(self, req: SimRequest) -> None:
        self.on_first_token(req)
        unique = self._unique[req.rank]
        for key, pages in self._keys(req):
            left = unique[key] - 1
            if left:
                unique[key] = left
            else:
                del unique[key]
                self.active_blocks[req.rank] -= pages

    def dispatch(self, req: SimRequest) -> int:
        isl = req.prompt_len
        ids = req.block_ids
        full = isl // self.block_size  # Dynamo hashes full blocks only
        if ids:
            n = len(ids)
            overlaps = [
                min(prefix_tokens(isl, n, held) // self.block_size, full) for held in self.indexer.overlap(ids)
            ]
        else:
            overlaps = [0] * self.n_ranks
        keys = self._keys(req)
        if req.routed_dp_rank is not None:
            best = int(req.routed_dp_rank)
        else:
            best = self._select(isl, keys, overlaps)
        new_tokens = max(0, isl - overlaps[best] * self.block_size)
        self._prefill[req.rid] = new_tokens
        self.active_tokens[best] += new_tokens
        unique = self._unique[best]
        for key, pages in keys:
            count = unique.get(key, 0)
            if not count:
                self.active_blocks[best] += pages
            unique[key] = count + 1
        return best

    def _select(self, isl: int, keys: list[tuple[object, int]], overlaps: list[int]) -> int:
        best = 0
        best_cost = float("inf")
        ties = 0
        block = self.block_size
        for w in range(self.n_ranks):
            unique = self._unique[w]
            new_blocks = sum(pages for key, pages in keys if key not in unique)
            decode_blocks = self.active_blocks[w] + new_blocks
            prefill_blocks = (self.active_tokens[w] + isl) / block - self.credit * overlaps[w]
            cost = self.scale * max(0.0, prefill_blocks) + decode_blocks
            if cost < best_cost:
                best, best_cost, ties = w, cost, 1
            elif cost == best_cost:
                ties += 1
                if self._rng.randrange(ties) == 0:  # uniform among the tied, as Dynamo's reservoir pick
                    best = w
        return best


# name -> {option: type}
PEERS: dict[str, dict[str, type]] = {
    VLLM: {
        "stats_interval": float,
        "api_servers": int,
        "kv_threshold": float,
        "kv_weight": float,
    },
    CACHE_AWARE: {
        "cache_threshold": float,
        "balance_abs_threshold": int,
        "balance_rel_threshold": float,
        "eviction_interval": float,
        "max_tree_size": int,
        "chars_per_token": float,
    },
    DYNAMO_KV: {
        "overlap_score_credit": float,
        "prefill_load_scale": float,
        "router_temperature": float,
        "block_size": int,
    },
}

# Option names that differ from the constructor's (they name seconds).
_RENAMED = {"stats_interval": "stats_interval_s", "eviction_interval": "eviction_interval_s"}


def make_peer(
    name: str,
    options: dict[str, Any],
    *,
    n_ranks: int,
    clock: Callable[[], float],
    delay_s: float,
    seed: int,
    label: str,
) -> Policy:
    """The peer policy ``name`` with ``options`` (from a method spec) over its defaults."""
    accepted = PEERS[name]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InvalidInputError(f"{name} takes the options {', '.join(accepted)}, not {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        kind = accepted[key]
        try:
            converted = kind(value)
        except (TypeError, ValueError):
            raise InvalidInputError(f"{name} option {key}={value!r} is not a {kind.__name__}") from None
        kwargs[_RENAMED.get(key, key)] = converted
    if name == VLLM:
        return VllmPolicy(n_ranks, clock, delay_s=delay_s, seed=seed, name=label, **kwargs)
    if name == CACHE_AWARE:
        return GatewayCacheAwarePolicy(n_ranks, name=label, **kwargs)
    return DynamoKvPolicy(n_ranks, seed=seed, name=label, **kwargs)
