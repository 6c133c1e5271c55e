"""The board side of the vLLM plugin: one slot per DP engine, written from plain numbers.

What a slot holds for a vLLM engine, and why:

- ``num_running_reqs``: ``SchedulerStats.num_running_reqs``.
- ``num_waiting_reqs``: ``num_waiting_reqs + num_skipped_waiting_reqs``, every request queued on
  the engine, as vLLM's own ``vllm:num_requests_waiting`` counts them.
- ``num_used_tokens``: ``kv_cache_usage`` (the share of KV blocks held by requests; free and
  evictable cached blocks count as free) times the engine's capacity in tokens, rounded; so the
  board's ``token_usage`` is vLLM's ``kv_cache_usage``.
- ``num_total_tokens`` and ``num_active_tokens``: the used tokens. vLLM reports no token count of
  its waiting prompts, so the board cannot add them.
- ``max_total_num_tokens``: the engine's capacity (``settings.engine_capacity_tokens``).
- ``num_received_reqs``: 0. vLLM reports no count of the requests an engine received.

The detail (``LoadDetail``) carries what vLLM reports beyond that: ``token_usage`` (vLLM's
``kv_cache_usage`` as a float), ``max_running_requests`` (``max_num_seqs``), ``cache_hit_rate``
(prefix-cache hits over queried tokens of the most recent requests, vLLM's own definition) and
``gen_throughput`` (generated tokens per second over the last second or more).

An idle vLLM engine sends no stats (its step loop waits for work), so its slot would go stale while
it is the best place to send a request. ``heartbeat()`` publishes the last snapshot again for an
engine whose last stats showed it idle (nothing running, nothing waiting); a busy engine that
stops reporting still goes stale, and so does every engine while vLLM is asleep.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from dpboard.board import Board, BoardWriter
from dpboard.integrations.vllm.settings import VllmBoardSettings
from dpboard.snapshot import LoadDetail, LoadSnapshot

HEARTBEAT_INTERVAL = 0.25  # seconds; a quarter of the readers' default staleness threshold (1 s)
HIT_RATE_REQUESTS = 1000  # the recent requests the cache hit rate covers (as vLLM's own log line)
THROUGHPUT_WINDOW = 1.0  # seconds of generated tokens per throughput figure, at least


class RecentHitRate:
    """Prefix-cache hits over queried tokens, over the most recent ``max_requests`` requests.

    vLLM reports per step how many new requests looked up the prefix cache, how many tokens they
    queried and how many of those hit. The window drops whole steps, oldest first, while it holds
    more than ``max_requests`` requests, and always keeps the latest step."""

    def __init__(self, max_requests: int = HIT_RATE_REQUESTS) -> None:
        self.max_requests = max_requests
        self._steps: deque[tuple[int, int, int]] = deque()
        self._requests = self._queries = self._hits = 0

    def add(self, requests: int, queries: int, hits: int, reset: bool = False) -> None:
        if reset:  # vLLM's prefix cache was reset before this step: earlier hits no longer apply
            self._steps.clear()
            self._requests = self._queries = self._hits = 0
        if requests <= 0:
            return
        self._steps.append((requests, queries, hits))
        self._requests += requests
        self._queries += queries
        self._hits += hits
        while len(self._steps) > 1 and self._requests > self.max_requests:
            r, q, h = self._steps.popleft()
            self._requests -= r
            self._queries -= q
            self._hits -= h

    @property
    def rate(self) -> float:
        return self._hits / self._queries if self._queries > 0 else 0.0


class _Engine:
    """One engine's slot and what its next publish needs."""

    def __init__(self, writer: BoardWriter, capacity: int, started: float) -> None:
        self.writer = writer
        self.snapshot = LoadSnapshot(dp_rank=writer.rank, max_total_num_tokens=capacity)  # idle until stats come
        self.kv_cache_usage = 0.0
        self.hit_rate = RecentHitRate()
        self.window_start = started
        self.window_tokens = 0
        self.gen_throughput = 0.0
        self.published_at = -math.inf

    @property
    def idle(self) -> bool:
        return self.snapshot.num_running_reqs == 0 and self.snapshot.num_waiting_reqs == 0


class EngineBoard:
    """The slots of the DP engines one vLLM API server manages.

    Creates the board (``settings.n_slots`` slots, one per global DP rank) or attaches it when
    another API server of the deployment made it first, and takes the writer of each managed
    engine's slot: a slot held by another live process is an error naming that process. The
    creating process unlinks the board when it exits.
    """

    def __init__(self, settings: VllmBoardSettings, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 heartbeat_interval: float = HEARTBEAT_INTERVAL) -> None:
        self.settings = settings
        self.heartbeat_interval = heartbeat_interval
        self._clock = clock
        self._wall_clock = wall_clock
        self.asleep = False
        self.board = Board.create(settings.board, settings.n_slots, exist_ok=True, node_id=settings.node_id)
        now = clock()
        try:
            self._engines = {
                i: _Engine(self.board.writer(i, node_id=settings.node_id), settings.capacity_tokens, now)
                for i in settings.engine_indexes
            }
        except BaseException:
            self.board.close()
            raise

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        return self.settings.engine_indexes

    def publish_all(self) -> None:
        """Publish every engine's current snapshot (at start: idle, with its capacity)."""
        now = self._clock()
        for engine in self._engines.values():
            self._publish(engine, now)

    def record(self, engine_idx: int, *, running: int, waiting: int, kv_cache_usage: float,
               prefix_requests: int = 0, prefix_queries: int = 0, prefix_hits: int = 0,
               prefix_reset: bool = False) -> bool:
        """One step's scheduler stats of engine ``engine_idx``; False for an engine not managed here."""
        engine = self._engines.get(engine_idx)
        if engine is None:
            return False
        usage = min(1.0, max(0.0, float(kv_cache_usage))) if math.isfinite(kv_cache_usage) else 0.0
        capacity = self.settings.capacity_tokens
        used = round(usage * capacity)
        engine.kv_cache_usage = usage
        engine.snapshot = LoadSnapshot(
            dp_rank=engine_idx, num_running_reqs=max(0, int(running)), num_waiting_reqs=max(0, int(waiting)),
            num_used_tokens=used, num_total_tokens=used, num_active_tokens=used, max_total_num_tokens=capacity,
        )
        engine.hit_rate.add(prefix_requests, prefix_queries, prefix_hits, prefix_reset)
        self._publish(engine, self._clock())
        return True

    def add_generated_tokens(self, engine_idx: int, tokens: int) -> None:
        """Tokens the engine generated for this API server's requests (the throughput's numerator)."""
        engine = self._engines.get(engine_idx)
        if engine is not None and tokens > 0:
            engine.window_tokens += tokens

    def heartbeat(self) -> int:
        """Publish again, unchanged, each idle engine not published for ``heartbeat_interval``;
        nothing while asleep. Returns how many it published."""
        if self.asleep:
            return 0
        now = self._clock()
        due = [e for e in self._engines.values() if e.idle and now - e.published_at >= self.heartbeat_interval]
        for engine in due:
            self._publish(engine, now)
        return len(due)

    def set_asleep(self, asleep: bool) -> None:
        """vLLM put its engines to sleep (their slots go stale) or woke them (published again)."""
        self.asleep = asleep
        if not asleep:
            self.publish_all()

    def close(self) -> None:
        self._engines.clear()
        self.board.close()

    def _publish(self, engine: _Engine, now: float) -> None:
        elapsed = now - engine.window_start
        if elapsed >= THROUGHPUT_WINDOW:
            engine.gen_throughput = engine.window_tokens / elapsed
            engine.window_start, engine.window_tokens = now, 0
        detail = LoadDetail(
            timestamp=self._wall_clock(),
            max_running_requests=self.settings.max_running_requests,
            token_usage=engine.kv_cache_usage,
            gen_throughput=engine.gen_throughput,
            cache_hit_rate=engine.hit_rate.rate,
        )
        engine.writer.publish_detailed(engine.snapshot, detail)
        engine.published_at = now
