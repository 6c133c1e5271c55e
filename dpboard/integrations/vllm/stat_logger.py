"""``DpboardStatLogger``: the class vLLM loads from the entry-point group ``vllm.stat_logger_plugins``.

The one module of dpboard that imports vLLM; vLLM's loader is what imports it. Interface as of
vLLM 0.33.0 (commit 4ba787ec9; paths in its wheel):

- vllm/plugins/__init__.py:24-26, 36-74: the group; every entry point in it is loaded (or those
  that ``VLLM_PLUGINS`` lists), in the API-server process only.
- vllm/v1/metrics/loggers.py:84-98: the entry point must name a class that subclasses
  ``StatLoggerBase`` (anything else is a TypeError that stops vLLM).
- loggers.py:101-109 and 1397-1405: a subclass of ``AggregateStatLoggerBase`` is built once, as
  ``cls(vllm_config=..., engine_indexes=[...])``, after the engines' handshake (KV sizes known).
- loggers.py:65-72, 1421-1436 and v1/engine/async_llm.py:929-935: ``record(scheduler_stats,
  iteration_stats, mm_cache_stats=..., engine_idx=...)`` once per outputs message of an engine,
  on the API server's event loop; either stats may be None.
- async_llm.py:214: ``log_engine_initialized()`` right after construction.
- async_llm.py:1204, 1211, 1217 and loggers.py:1335-1352: ``record_sleep_state(1, level)`` when
  vLLM sleeps or releases its KV cache, ``record_sleep_state(0, 0)`` when it wakes.
- v1/metrics/stats.py:222-255: ``SchedulerStats`` (num_running_reqs, num_waiting_reqs,
  num_skipped_waiting_reqs, kv_cache_usage, prefix_cache_stats with requests, queries, hits and
  reset); stats.py:474-483: ``IterationStats.num_generation_tokens``.

One aggregate instance rather than one per engine: it is given every managed engine index, which
one engine's share of the summed ``num_gpu_blocks`` needs, and it holds one board for them all.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from dpboard.integrations.vllm.engines import EngineBoard
from dpboard.integrations.vllm.settings import settings_from_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

log = logging.getLogger(__name__)


class DpboardStatLogger(AggregateStatLoggerBase):
    """Publishes each DP engine's scheduler stats into its board slot (off unless the environment
    names a board: ``DPBOARD_VLLM_BOARD=NAME`` or ``DPBOARD_VLLM=1``)."""

    def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int]) -> None:
        settings = settings_from_config(vllm_config, engine_indexes)
        self.engines: EngineBoard | None = None if settings is None else EngineBoard(settings)
        self._timer: asyncio.TimerHandle | None = None
        self._unknown_engines: set[int] = set()
        if settings is not None:
            log.info("dpboard: engines %s publish into board %r (%d slots)", list(settings.engine_indexes),
                     settings.board, settings.n_slots)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        engines = self.engines
        if engines is None:
            return
        if engine_idx not in engines.engine_indexes:
            if engine_idx not in self._unknown_engines:
                self._unknown_engines.add(engine_idx)
                log.warning("dpboard: stats of engine %d, which this API server does not manage %s, are dropped",
                            engine_idx, list(engines.engine_indexes))
            return
        if iteration_stats is not None:
            engines.add_generated_tokens(engine_idx, iteration_stats.num_generation_tokens)
        if scheduler_stats is not None:
            prefix = scheduler_stats.prefix_cache_stats
            engines.record(
                engine_idx,
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                kv_cache_usage=scheduler_stats.kv_cache_usage,
                prefix_requests=prefix.requests, prefix_queries=prefix.queries, prefix_hits=prefix.hits,
                prefix_reset=prefix.reset,
            )
        self._keep_ticking()

    def log_engine_initialized(self) -> None:
        if self.engines is not None:
            self.engines.publish_all()
            self._keep_ticking()

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        # vLLM passes 1 when it goes to sleep (the base class names the argument is_awake).
        if self.engines is not None:
            self.engines.set_asleep(sleep == 1)

    def _keep_ticking(self) -> None:
        """Heartbeats run on vLLM's event loop, where record() runs too: one thread writes the slots."""
        if self._timer is not None or self.engines is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on an event loop (yet): the next record() starts the timer
        self._timer = loop.call_later(self.engines.heartbeat_interval, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.engines is not None:
            self.engines.heartbeat()
            self._keep_ticking()
