"""A vLLM API server's side of the stat-logger plugin, in a process of its own, on vLLM's real modules.

``python -m tests.support.vllm_host CONFIG_JSON`` imports vLLM 0.33.0 (behind tests/support/vllm.py's
stand-ins), finds the stat-logger plugins with vLLM's own ``load_stat_logger_plugin_factories``
(v1/metrics/loggers.py:84-98), builds each as ``StatLoggerManager.__init__`` builds an aggregate one
(loggers.py:1397-1405; the manager itself also builds vLLM's Prometheus logger, which needs a
model's config), on a running event loop (vLLM builds AsyncLLM on the API server's loop), calls
``log_engine_initialized()``, and prints one JSON line: ``{"ready": ...}`` or ``{"error": ...}``.

Then it reads one JSON command a line from stdin and answers each with one JSON line, calling the
plugins as vLLM's output handler does (v1/engine/async_llm.py:929-935, loggers.py:1421-1436), with
vLLM's own ``SchedulerStats``, ``PrefixCacheStats`` and ``IterationStats``:

- ``{"op": "record", "engine": I, "scheduler": {SchedulerStats fields, "prefix": {...}} | null,
  "generated": N | null}``
- ``{"op": "sleep", "args": [sleep, level]}`` (async_llm.py:1204, 1211, 1217)
- ``{"op": "log"}``, ``{"op": "admission", "reason": R}``
- ``{"op": "wait", "seconds": S}``: the event loop runs meanwhile (the plugin's timers fire).

At EOF on stdin it exits 0, as an API server shutting down.

CONFIG_JSON: ``dp``, ``engines``, and optionally ``num_gpu_blocks``, ``block_size``,
``kv_cache_size_tokens``, ``max_num_seqs``, ``served_model_name``, ``api_process_count``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any

from tests.support import vllm as sv


class LoadFailures(logging.Handler):
    """What vLLM's plugin loader only logs (an entry point that fails to load is skipped)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.failures.append(record.getMessage())


def say(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


async def serve(spec: dict[str, Any]) -> int:
    from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase, load_stat_logger_plugin_factories
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    from tests.support.vllm_engine import vllm_config

    failures = LoadFailures()
    logging.getLogger("vllm.plugins").addHandler(failures)
    engines = list(spec["engines"])
    config = vllm_config(spec["dp"], api_servers=spec.get("api_process_count", 1),
                         served_model_name=spec.get("served_model_name"), max_num_seqs=spec.get("max_num_seqs", 128),
                         block_size=spec.get("block_size", 16), num_gpu_blocks=spec.get("num_gpu_blocks"),
                         kv_cache_size_tokens=spec.get("kv_cache_size_tokens"))
    try:
        names = list(load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP))
        factories = load_stat_logger_plugin_factories()
        if not all(issubclass(f, AggregateStatLoggerBase) for f in factories):
            raise AssertionError(f"{factories} are not all aggregate loggers; dpboard's is one")
        loggers = [factory(vllm_config=config, engine_indexes=engines) for factory in factories]
        for stat_logger in loggers:
            stat_logger.log_engine_initialized()
    except Exception as e:
        say({"error": type(e).__name__, "message": str(e), "load_failures": failures.failures})
        return 3
    say({"ready": True, "pid": os.getpid(), "plugins": names,
         "classes": [f"{f.__module__}:{f.__qualname__}" for f in factories], "load_failures": failures.failures})

    def scheduler_stats(fields: dict[str, Any] | None) -> SchedulerStats | None:
        if fields is None:
            return None
        fields = dict(fields)
        prefix = PrefixCacheStats(**fields.pop("prefix", {}))
        return SchedulerStats(prefix_cache_stats=prefix, **fields)

    def iteration(generated: int | None) -> IterationStats | None:
        if generated is None:
            return None
        stats = IterationStats()
        stats.num_generation_tokens = generated
        return stats

    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return 0
        command = json.loads(line)
        op = command["op"]
        try:
            for stat_logger in loggers:
                if op == "record":
                    stat_logger.record(scheduler_stats(command.get("scheduler")), iteration(command.get("generated")),
                                       mm_cache_stats=None, engine_idx=command["engine"])
                elif op == "sleep":
                    stat_logger.record_sleep_state(*command["args"])
                elif op == "log":
                    stat_logger.log()
                elif op == "admission":
                    stat_logger.record_admission_rejection(command["reason"])
            if op == "wait":
                await asyncio.sleep(command["seconds"])
        except Exception as e:  # vLLM's output handler would die of it
            say({"error": type(e).__name__, "message": str(e)})
            return 3
        say({"ok": op})


def main() -> int:
    sv.install()
    return asyncio.run(serve(json.loads(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())
