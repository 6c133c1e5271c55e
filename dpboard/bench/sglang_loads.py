"""SGLang's own load report beside the board write: where a publish's time goes inside SGLang.

Inside SGLang the plugin publishes the engine's own counts: each publish is SGLang 0.5.23's
``SchedulerLoadInquirer.get_loads`` (``managers/scheduler_components/load_inquirer.py``), whose
result the plugin writes to the board (``BoardLoadWriter.write``). KV use is already a number in
SGLang's allocator; what ``get_loads`` adds is a host-side walk of the waiting queue (each
request's ``seqlen``, twice). This topic times that method, compiled from the installed wheel's
own source, over a stand-in scheduler holding 0, 100, 1,000 and 10,000 waiting requests, beside
the board write of the same run: ``BoardWriter.publish`` of the dispatch fields, and the plugin's
whole write (SGLang's snapshot packed with its detail, then published).

SGLang's ``Req`` cannot be built without torch (``schedule_batch`` imports it), so the requests are
stand-ins whose ``seqlen`` is SGLang's own property (``len(origin_input_ids) + len(output_ids)``,
compiled from the wheel); the queue is a Python list, as SGLang's ``waiting_queue``. The rest of
the scheduler (statistics, memory, the pool's stats, the parallel and LoRA contexts) is a stand-in
holding the values a plain deployment reports, without disaggregation, speculation or LoRA, and
with SGLang's default of no waiting-queue prefix matching. ``PoolStats`` and
``DisaggregationMode`` are compiled from the wheel too. As ``timeit``, the timed calls run with
the garbage collector off.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import gc
import logging
import os
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np

from dpboard.bench import stats
from dpboard.bench.sglang_board import load_sglang
from dpboard.board import Board
from dpboard.snapshot import LoadSnapshot

WAITING = (0, 100, 1_000, 10_000)
RUNNING = 64  # the running batch: get_loads takes only its length
INQUIRER = "srt/managers/scheduler_components/load_inquirer.py"


class SGLangMissing(RuntimeError):
    """SGLang's wheel (or one of the definitions this topic compiles from it) is not there."""


def _compile(root: Path, relpath: str, names: tuple[str, ...], namespace: dict[str, Any],
             *, cls: str | None = None) -> None:
    """The top-level definitions ``names`` (or ``cls``'s members of those names) of the wheel's
    ``sglang/<relpath>``, compiled from its source into ``namespace``: SGLang's code, run as is."""
    path = root / relpath
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    picked = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    missing = set(names) - {n.name for n in picked}
    if missing:
        raise SGLangMissing(f"sglang/{relpath} defines no {sorted(missing)}: this topic reads SGLang 0.5.23")
    # `from __future__ import annotations`, as the file has: annotations naming torch types stay text
    code = compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec",
                   flags=annotations_flag(), dont_inherit=True)
    exec(code, namespace)  # noqa: S102 - SGLang's own source, from the installed wheel


def annotations_flag() -> int:
    import __future__

    return __future__.annotations.compiler_flag


@functools.cache
def sglang_parts() -> tuple[Any, Any, type, type, Any, str]:
    """(SchedulerLoadInquirer, load_snapshot module, DisaggregationMode, Req stand-in, PoolStats,
    what SGLang this is), compiled from the wheel; SGLangMissing when it is not installed."""
    module, what = load_sglang()
    if module is None:
        raise SGLangMissing(f"{what}: this topic times SGLang's own get_loads (make bench puts .venv/engines "
                            f"on PYTHONPATH)")
    root = Path(module.__file__).parents[2]
    ns: dict[str, Any] = {"Enum": enum.Enum, "dataclasses": dataclasses}  # annotations stay text
    _compile(root, "srt/disaggregation/utils.py", ("DisaggregationMode",), ns)
    _compile(root, "srt/managers/scheduler_components/pool_stats_observer.py", ("PoolStats",), ns)
    req_ns: dict[str, Any] = {}
    _compile(root, "srt/managers/schedule_batch.py", ("seqlen",), req_ns, cls="Req")

    class Req:
        """A waiting request as ``get_loads`` reads one; ``seqlen`` is SGLang's own property."""

        __slots__ = ("origin_input_ids", "output_ids", "prefix_len", "num_matched_prefix_tokens",
                     "cache_request_handle")
        seqlen = req_ns["seqlen"]  # compiled with its @property

        def __init__(self, origin_input_ids: list[int], output_ids: list[int]) -> None:
            self.origin_input_ids = origin_input_ids
            self.output_ids = output_ids
            self.prefix_len = 0
            self.num_matched_prefix_tokens = 0
            self.cache_request_handle = None

    inquirer_ns: dict[str, Any] = {
        "dataclass": dataclasses.dataclass, "time": time, "logging": logging, "logger": logging.getLogger("sglang"),
        "Callable": typing.Callable, "TYPE_CHECKING": False, "DisaggregationMode": ns["DisaggregationMode"],
        "get_parallel": lambda: types.SimpleNamespace(dp_rank=0),
        "get_lora": lambda: types.SimpleNamespace(enable_lora=False),
        **{name: getattr(module, name) for name in ("DisaggregationMetrics", "LoadSnapshot", "LoRAMetrics",
                                                     "MemoryMetrics", "QueueMetrics", "SpeculativeMetrics")},
    }
    _compile(root, INQUIRER, ("SchedulerLoadInquirer",), inquirer_ns)
    return (inquirer_ns["SchedulerLoadInquirer"], module, ns["DisaggregationMode"], Req, ns["PoolStats"], what)


def make_inquirer(n_waiting: int, capacity: int = 1 << 20) -> Any:
    """SGLang's SchedulerLoadInquirer over a stand-in scheduler with ``n_waiting`` waiting requests."""
    inquirer_cls, _, mode, req_cls, pool_stats, _ = sglang_parts()
    rng = np.random.default_rng(n_waiting)
    prompts = [list(range(n)) for n in (64, 256, 512, 1024, 2048, 4096)]  # shared: len() is what is read
    waiting = [req_cls(prompts[int(i)], []) for i in rng.integers(0, len(prompts), n_waiting)]
    running = types.SimpleNamespace(reqs=[req_cls(prompts[1], list(range(100))) for _ in range(RUNNING)])
    used = 300_000
    pool = pool_stats(full_num_used=used, full_token_usage=used / capacity, full_available_size=capacity - used,
                      full_evictable_size=0, full_capacity=capacity)
    scheduler_stats = types.SimpleNamespace(
        gen_throughput=1500.0, cache_hit_rate=0.4, utilization=0.8, spec_accept_rate=0.0, lora_pool_slots_used=0,
        lora_pool_slots_total=0, lora_pool_utilization=0.0, kv_transfer_speed_gb_s=0.0, kv_transfer_latency_ms=0.0,
        num_grammar_queue_reqs=0, num_paused_reqs=0, num_retracted_reqs=0)
    tp_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(weight_load_mem_usage=14.2),
                                      graph_memory_usage={"decode": 1.3})
    allocator = types.SimpleNamespace(get_kvcache=lambda: types.SimpleNamespace(mem_usage=60.1))

    def no_queue() -> Any:
        raise AssertionError("a plain (non-disaggregated) scheduler has no disaggregation queue")

    return inquirer_cls(
        disaggregation_mode=mode.NULL, server_args=None, max_total_num_tokens=capacity, max_running_requests=256,
        pool_stats_observer=types.SimpleNamespace(get_pool_stats=lambda: pool), tp_worker=tp_worker,
        token_to_kv_pool_allocator=allocator, spec_algorithm=types.SimpleNamespace(is_none=lambda: True),
        get_running_batch=lambda: running, get_waiting_queue=lambda: waiting,
        waiting_queue_prefix_matched=lambda: False, get_recent_cache_hit_rate=lambda: 0.4,
        get_stats=lambda: scheduler_stats, get_chunked_req=lambda: None,
        get_disagg_prefill_bootstrap_queue=no_queue, get_disagg_prefill_inflight_queue=no_queue,
        get_disagg_decode_prealloc_queue=no_queue, get_disagg_decode_transfer_queue=no_queue,
        get_spec_total_num_accept_tokens=lambda: 0, get_spec_total_num_forward_ct=lambda: 0,
        get_total_prefill_uncached_tokens=lambda: 10**9, get_total_prefill_busy_us=lambda: 10**8,
        get_decode_moment_totals=lambda: [120.0, 240.0, 360.0, 480.0, 600.0, 720.0],
    )


def _summary(samples: np.ndarray) -> dict[str, float]:
    return {"50": stats.pct(samples, 50), "99": stats.pct(samples, 99), "n": int(len(samples))}


def measure(quick: bool = False, waiting: tuple[int, ...] = WAITING) -> dict[str, Any]:
    """Per-call figures (ns) of get_loads at each waiting count, and of the board writes."""
    from dpboard.integrations.sglang.transport import BoardLoadWriter

    _, module, _, _, _, what = sglang_parts()
    calls = 200 if quick else 5_000
    rows = []
    board = Board.create(f"bench-sglang-loads-{os.getpid()}", n_slots=2)
    try:
        writer = board.writer(1)  # slot 0 is the plugin's: SGLang's snapshots say dp_rank 0
        plugin = BoardLoadWriter(board, dp_size=2, dp_rank=0)
        fields = LoadSnapshot(dp_rank=1, num_running_reqs=RUNNING, num_used_tokens=300_000,
                              num_total_tokens=400_000, max_total_num_tokens=1 << 20)
        for n in waiting:
            inquirer = make_inquirer(n)
            snap = inquirer.get_loads()
            assert snap.num_waiting_reqs == n and snap.num_used_tokens == 300_000
            k = max(20, calls // (1 + n // 1_000)) if n else calls  # fewer calls where each is long
            for _ in range(min(k, 50)):
                inquirer.get_loads()  # warm
            # as timeit: no garbage collection inside the timed calls (a full collection walks every
            # object of the process, a pause that belongs to no one call)
            gc.collect()
            gc.disable()
            try:
                loads_ns = stats.per_call_ns(inquirer.get_loads, k)
                publish_ns = stats.per_call_ns(lambda: writer.publish(fields), calls)
                plugin_ns = stats.per_call_ns(lambda snap=snap: plugin.write(snap), calls)
            finally:
                gc.enable()
            rows.append({"waiting": n, "calls": k, "num_waiting_reqs": snap.num_waiting_reqs,
                         "num_total_tokens": snap.num_total_tokens, "get_loads_ns": _summary(loads_ns),
                         "board_publish_ns": _summary(publish_ns), "plugin_write_ns": _summary(plugin_ns)})
        plugin.close()
    finally:
        board.close()
        board.unlink()
    return {"quick": quick, "sglang": what, "machine": stats.machine_line(),
            "timer_overhead_ns": stats.timer_overhead_ns(), "load_average": os.getloadavg()[0], "rows": rows}


def table(doc: dict[str, Any]) -> str:
    headers = ["waiting", "get_loads p50", "p99", "BoardWriter.publish p50", "p99", "plugin write p50", "p99",
               "get_loads / publish p50"]
    rows = []
    for r in doc["rows"]:
        g, b, w = r["get_loads_ns"], r["board_publish_ns"], r["plugin_write_ns"]
        cells = [stats.fmt_ns(summary[q]) for summary in (g, b, w) for q in ("50", "99")]
        rows.append([f"{r['waiting']:,}", *cells, f"{g['50'] / b['50']:.0f}x"])
    return stats.markdown_table(headers, rows)


def _parser() -> argparse.ArgumentParser:
    return stats.topic_parser("sglang_loads", __doc__, "a smoke run: 200 calls at each size (figures not to quote)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        doc = measure(args.quick)
    except SGLangMissing as e:
        # nothing to time without the engine: said, not failed (`dpboard bench all` goes on)
        print(f"dpboard bench sglang_loads: skipped: {e}")
        stats.write_json(args.json, {"quick": args.quick, "skipped": str(e)})
        return 0
    print(f"SGLang's own get_loads ({doc['sglang'].split(chr(39))[0]}, compiled from its wheel) beside the board "
          f"write, per call; {doc['machine']}; load average {doc['load_average']:.1f}; "
          f"timer pair {doc['timer_overhead_ns']:.0f} ns")
    print(table(doc))
    stats.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
