"""A vLLM API server's side of the stat-logger contract, in a process of its own.

``python -m tests.support.vllm_host CONFIG_JSON`` installs the contract stand-in
(tests/support/vllm_contract.py) as vLLM's modules, finds the stat-logger plugins through
``importlib.metadata`` as vLLM's loader does, builds each the way StatLoggerManager does, on a
running event loop (vLLM builds AsyncLLM on the API server's loop), calls
``log_engine_initialized()``, and prints one JSON line: ``{"ready": ...}`` or ``{"error": ...}``.

Then it reads one JSON command a line from stdin and answers each with one JSON line, calling the
plugins as vLLM's output handler does (v1/engine/async_llm.py:929-935, loggers.py:1421-1436):

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
import os
import sys
from typing import Any

from tests.support import vllm_contract as vllm


def config_from(spec: dict[str, Any]) -> vllm.VllmConfig:
    return vllm.VllmConfig(
        model_config=vllm.ModelConfig(served_model_name=spec.get("served_model_name")),
        cache_config=vllm.CacheConfig(block_size=spec.get("block_size", 16),
                                      num_gpu_blocks=spec.get("num_gpu_blocks"),
                                      kv_cache_size_tokens=spec.get("kv_cache_size_tokens")),
        parallel_config=vllm.ParallelConfig(data_parallel_size=spec["dp"],
                                            _api_process_count=spec.get("api_process_count", 1)),
        scheduler_config=vllm.SchedulerConfig(max_num_seqs=spec.get("max_num_seqs", 128)),
    )


def say(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def scheduler_stats(fields: dict[str, Any] | None) -> vllm.SchedulerStats | None:
    if fields is None:
        return None
    fields = dict(fields)
    prefix = vllm.PrefixCacheStats(**fields.pop("prefix", {}))
    return vllm.SchedulerStats(prefix_cache_stats=prefix, **fields)


async def serve(spec: dict[str, Any]) -> int:
    engines = list(spec["engines"])
    try:
        factories = vllm.load_stat_logger_plugin_factories()
        loggers = [vllm.build_stat_logger(factory, config_from(spec), engines) for _, factory in factories]
        for stat_logger in loggers:
            stat_logger.log_engine_initialized()
    except Exception as e:
        say({"error": type(e).__name__, "message": str(e), "load_failures": vllm.LOAD_FAILURES})
        return 3
    say({"ready": True, "pid": os.getpid(), "plugins": [name for name, _ in factories],
         "classes": [f"{f.__module__}:{f.__qualname__}" for _, f in factories],
         "load_failures": vllm.LOAD_FAILURES})
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
                    generated = command.get("generated")
                    iteration = None if generated is None else vllm.IterationStats(generated)
                    stat_logger.record(scheduler_stats(command.get("scheduler")), iteration,
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
    vllm.install()
    return asyncio.run(serve(json.loads(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())
