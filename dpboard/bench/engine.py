"""``dpboard bench engine``: what the engine side adds to each vLLM engine step, by queue length.

vLLM 0.33.0's own ``Scheduler`` on the CPU (vllm_engine.py: vLLM's ``KVCacheManager``, a real
``KVCacheConfig``, the model a stand-in that samples one token) runs ``max_num_seqs`` decoding
requests with 0, 1,000 or 10,000 more waiting that it cannot admit. Per step, timed apart: the engine
step's own Python (``schedule()``, the model's made-up output, ``update_from_output()``); dpboard's
publish after it (``EnginePublisher.publish_from`` into a real board, the waiting prefill kept as the
queues change, waiting.py); and the walk of every waiting request that each publish made before
(``waiting.walk``, a heap copy under ``priority``), the baseline. The publish is also timed alone,
back to back, where a step's garbage and caches do not fall on it.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from dpboard.bench.stats import fmt_ns, machine_line, markdown_table, pct, topic_parser, write_json
from dpboard.options import count

QUEUES = (0, 1_000, 10_000)
RUNNING = 64  # max_num_seqs: the requests decoding at every step


def parser() -> argparse.ArgumentParser:
    p = topic_parser("engine", __doc__, "a short run (fewer steps)")
    p.add_argument("--waiting", type=count(0, 1_000_000), nargs="+", default=list(QUEUES),
                   help="waiting requests to measure at (default 0 1000 10000)")
    return p


def measure(policy: str, n_waiting: int, steps: int) -> dict[str, np.ndarray]:
    """``steps`` engine steps of vLLM's scheduler with ``n_waiting`` requests it cannot admit."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    from dpboard.bench.vllm_engine import (
        ModelExecutor,
        block_hasher,
        engine_config,
        kv_cache_config,
        make_scheduler,
    )
    from dpboard.board import Board
    from dpboard.integrations.vllm import waiting
    from dpboard.integrations.vllm.engine_core import EnginePublisher, capacity_tokens

    config = engine_config(policy=policy, max_num_seqs=RUNNING, max_num_batched_tokens=2048)
    scheduler = make_scheduler(config, kv_cache_config(RUNNING * 24 + 1))
    hasher = block_hasher(config)
    model = ModelExecutor(scheduler)

    def request(i: int, max_tokens: int) -> Any:
        core = EngineCoreRequest(request_id=f"q{i}", prompt_token_ids=list(range(i * 64, i * 64 + 64)),
                                 mm_features=None, sampling_params=SamplingParams(max_tokens=max_tokens),
                                 pooling_params=None, arrival_time=float(i), lora_request=None, cache_salt=None,
                                 data_parallel_rank=None, priority=i % 4)
        return Request.from_engine_core_request(core, hasher)

    def engine_step() -> None:
        output = scheduler.schedule()
        scheduler.update_from_output(output, model.model_output(output))

    for i in range(RUNNING):  # these run, each decoding past the whole measurement
        scheduler.add_request(request(i, 4 * steps + 64))
    engine_step()
    engine_step()
    for i in range(RUNNING, RUNNING + n_waiting):  # these wait: max_num_seqs are running
        scheduler.add_request(request(i, 16))
    name = f"bench-engine-{os.getpid()}-{policy}-{n_waiting}"
    board = Board.create(name, 1)
    try:
        publisher = EnginePublisher(board, board.writer(0), capacity_tokens=capacity_tokens(config, scheduler),
                                    max_running_requests=RUNNING)
        publisher.publish_from(scheduler)  # the queues counted from here on
        t = time.perf_counter_ns
        out = {k: np.empty(steps) for k in ("step", "publish", "walk")}
        for s in range(steps):
            a = t()
            engine_step()
            b = t()
            publisher.publish_from(scheduler)
            c = t()
            walked = waiting.walk(scheduler)
            d = t()
            out["step"][s], out["publish"][s], out["walk"][s] = b - a, c - b, d - c
        # the publish alone, back to back over the same scheduler: what the queue's length can change
        out["publish alone"] = np.empty(steps * 10)
        for s in range(steps * 10):
            a = t()
            publisher.publish_from(scheduler)
            out["publish alone"][s] = t() - a
        running, queued = scheduler.get_request_counts()
        if (running, queued) != (RUNNING, n_waiting) or walked != waiting.queued_tokens(scheduler):
            raise AssertionError(f"the scheduler holds {running} running, {queued} waiting; the bench set "
                                 f"{RUNNING}, {n_waiting}")
        publisher.writer.close()
        return out
    finally:
        board.close()
        board.unlink()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from dpboard.bench.vllm_standins import vllm_importable

    steps = 30 if args.quick else 300
    print(f"## vLLM engine step and dpboard's publish ({machine_line()}{', quick' if args.quick else ''})\n")
    with vllm_importable() as missing:
        if missing:
            print(f"no rows: {missing}")
            write_json(args.json, {"machine": machine_line(), "quick": args.quick, "engine": [], "missing": missing})
            return 0
        rows, figures = [], []
        for policy in ("fcfs", "priority"):
            for n in args.waiting:
                got = measure(policy, n, steps)
                q = {k: {p: pct(v, p) for p in (50, 99)} for k, v in got.items()}
                figures.append({"policy": policy, "waiting": n, "running": RUNNING, "steps": steps,
                                **{f"{k.replace(' ', '_')}_ns": v for k, v in q.items()}})
                rows.append([policy, f"{n:,}", fmt_ns(q["step"][50]), fmt_ns(q["step"][99]),
                             fmt_ns(q["publish"][50]), fmt_ns(q["publish"][99]),
                             fmt_ns(q["publish alone"][50]), fmt_ns(q["publish alone"][99]),
                             fmt_ns(q["walk"][50]), fmt_ns(q["walk"][99]),
                             f"{100 * q['publish'][50] / q['step'][50]:.1f}%"])
    print(f"Per engine step, {RUNNING} requests decoding, vLLM's own Scheduler; engine step = schedule() + "
          "the model stand-in's output + update_from_output(); publish = EnginePublisher.publish_from into a "
          "real board (now), after each step; publish alone = the same, 10 per step back to back; the walk = every "
          "waiting request's tokens summed, what each publish did before.\n")
    print(markdown_table(["policy", "waiting", "engine step p50", "p99", "publish p50", "p99",
                          "publish alone p50", "p99",
                          "walk (before) p50", "p99", "publish / step p50"], rows))
    write_json(args.json, {"machine": machine_line(), "quick": args.quick, "engine": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
