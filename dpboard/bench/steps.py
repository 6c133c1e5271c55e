"""``dpboard bench steps``: what the step recorder (``DPBOARD_STEP_LOG``) adds to each scheduler step.

vLLM: vLLM 0.33.0's own ``Scheduler`` on the CPU (vllm_engine.py: its ``KVCacheManager``, a real
``KVCacheConfig``, the model a stand-in that samples one token), per step timed apart: the engine
step's own Python (``schedule()``, the model's made-up output, ``update_from_output()``), the
baseline; and the recorder's two hooks on it (``VllmSteps.scheduled`` after ``schedule()``, the
step's end after ``update_from_output()``), writing into a real step log. Two workloads: 64
requests decoding, and a stream of 300-token prompts chunked into a 512-token budget beside them
(mixed steps, the recorder's slower path).

SGLang: SGLang 0.5.23's own ``ScheduleBatch``, ``ForwardMode`` and ``SpeculativeAlgorithm``, compiled
from the installed wheel (its scheduler cannot run without torch and a GPU), as a decode batch of 64,
an extend batch of 8 and a mixed batch; per step, the recorder's hooks (``record_launch`` around
``run_batch``, ``record_result`` after ``process_batch_result``), called as SGLang's ``HookRegistry``
wraps them, around a ``run_batch`` that does what SGLang's does to the batch the hooks read
(``forward_ct``, ``forward_iter``); the baseline is the same path with pass-through hooks: what any
hook pair costs.

The writer thread's share is timed too: a flush of 1,000 rows into the file. No figure is asserted
anywhere; ``--quick`` is a smoke run.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import sys
import tempfile
import time
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np

from dpboard.bench.stats import fmt_ns, machine_line, markdown_table, pct, topic_parser, write_json

RUNNING = 64  # the decode batch
SGLANG_NS = "dpboard_bench_sglang_batch"  # the module SGLang's compiled classes live in (dataclasses looks it up)


class SGLangMissing(RuntimeError):
    """SGLang's wheel (or a definition compiled from it) is not there."""


def parser() -> Any:
    return topic_parser("steps", __doc__, "a short run (fewer steps)")


# -- SGLang's batch classes, from its wheel -----------------------------------------------------------------


@functools.cache
def sglang_batch_classes() -> types.SimpleNamespace:
    """SGLang's own ``ScheduleBatch``, ``ForwardMode``, ``CaptureHiddenMode`` and ``SpeculativeAlgorithm``,
    compiled from the installed wheel's source (their modules import torch; these classes need none)."""
    from dpboard.bench.sglang_board import load_sglang
    from dpboard.bench.sglang_loads import _compile

    module, what = load_sglang()
    if module is None:
        raise SGLangMissing(what)
    root = Path(module.__file__).parents[2]
    holder = types.ModuleType(SGLANG_NS)
    sys.modules[SGLANG_NS] = holder
    ns = holder.__dict__
    ns.update({name: getattr(typing, name) for name in typing.__all__})
    ns.update(dataclasses=dataclasses, IntEnum=enum.IntEnum, Enum=enum.Enum, auto=enum.auto,
              total_ordering=functools.total_ordering)
    for relpath, names in (("srt/model_executor/forward_batch_info.py", ("ForwardMode", "CaptureHiddenMode")),
                           ("srt/speculative/spec_registry.py", ("CustomSpecAlgo",)),
                           ("srt/speculative/spec_info.py", ("SpeculativeAlgorithm",)),
                           ("srt/disaggregation/decode_schedule_batch_mixin.py",
                            ("ScheduleBatchDisaggregationDecodeMixin",)),
                           ("srt/managers/schedule_batch.py", ("ScheduleBatch",))):
        try:
            _compile(root, relpath, names, ns)
        except Exception as e:  # a release that moved them: said, not failed
            raise SGLangMissing(f"{what}: {e}") from None
    return types.SimpleNamespace(ScheduleBatch=ns["ScheduleBatch"], ForwardMode=ns["ForwardMode"],
                                 SpeculativeAlgorithm=ns["SpeculativeAlgorithm"],
                                 CaptureHiddenMode=ns["CaptureHiddenMode"], version=what.split("'")[0])


def sglang_batches(classes: types.SimpleNamespace) -> dict[str, Any]:
    """A decode batch of RUNNING requests, an extend batch of 8, a mixed batch (2 prefilling, 30
    decoding), with the fields SGLang's scheduler has set on each by ``run_batch``."""
    sb, fm, none = classes.ScheduleBatch, classes.ForwardMode, classes.SpeculativeAlgorithm.NONE
    reqs = [object() for _ in range(RUNNING)]
    decode = sb(reqs=reqs, forward_mode=fm.DECODE, spec_algorithm=none, seq_lens_sum=RUNNING * 700)
    extend = sb(reqs=reqs[:8], forward_mode=fm.EXTEND, spec_algorithm=none, prefix_lens=[128 * i for i in range(8)],
                extend_lens=[256] * 8, extend_num_tokens=8 * 256)
    mixed = sb(reqs=reqs[:32], forward_mode=fm.MIXED, spec_algorithm=none, decoding_reqs=reqs[2:32],
               prefix_lens=[0, 512] + [700 + i for i in range(30)], extend_lens=[1024, 512] + [1] * 30,
               extend_num_tokens=1536 + 30)
    return {"decode 64": decode, "extend 8": extend, "mixed 2+30": mixed}


def measure_sglang(steps: int, directory: str) -> list[dict[str, Any]]:
    """Per batch kind: the hook pair's cost with the recorder on, and with pass-through hooks."""
    from dpboard.integrations.sglang import steps as sglang_steps
    from dpboard.steplog.writer import StepLog

    classes = sglang_batch_classes()
    rows = []

    class Scheduler:
        forward_ct = 0

        def run_batch(self, batch: Any) -> None:  # what SGLang's run_batch does to what the hooks read
            self.forward_ct += 1
            batch.forward_iter = self.forward_ct

        def process_batch_result(self, batch: Any, result: Any) -> None:
            return None

    def around(original: Any, *args: Any, **kwargs: Any) -> Any:  # HookRegistry's AROUND, pass-through
        return original(*args, **kwargs)

    def after(result: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def wrapped(around_hook: Any, after_hook: Any) -> tuple[Any, Any]:
        """run_batch and process_batch_result as SGLang's HookRegistry wraps them (its _wrap_fn)."""
        def run(scheduler: Any, batch: Any) -> Any:
            return around_hook(Scheduler.run_batch, scheduler, batch)

        def process(scheduler: Any, batch: Any, result: Any) -> None:
            out = Scheduler.process_batch_result(scheduler, batch, result)
            modified = after_hook(out, scheduler, batch, result)
            return modified if modified is not None else out

        return run, process

    t = time.perf_counter_ns
    for name, batch in sglang_batches(classes).items():
        step_log = StepLog(directory, engine="bench-sglang", rank=0, header={"settings": {}}, max_bytes=1 << 30,
                           at_exit=False)
        scheduler = Scheduler()
        scheduler.__dict__[sglang_steps.STATE] = sglang_steps.SGLangSteps(step_log, dp_attention=False)
        bare = Scheduler()
        bare.__dict__[sglang_steps.STATE] = None
        out = {}
        for label, (run, process), target in (
                ("baseline", wrapped(around, after), bare),
                ("recorder", wrapped(sglang_steps.record_launch, sglang_steps.record_result), scheduler)):
            samples = np.empty(steps)
            gc.disable()
            try:
                for i in range(steps):
                    a = t()
                    run(target, batch)
                    process(target, batch, None)
                    samples[i] = t() - a
            finally:
                gc.enable()
            out[label] = samples
        step_log.close()
        if step_log.faults or step_log.written != steps:
            raise AssertionError(f"the recorder wrote {step_log.written} of {steps} steps, {step_log.faults} faults")
        rows.append({"batch": name, "steps": steps,
                     **{f"{k}_ns": {"50": pct(v, 50), "99": pct(v, 99)} for k, v in out.items()}})
    return rows


# -- vLLM's scheduler ----------------------------------------------------------------------------------------


def measure_vllm(workload: str, steps: int, directory: str) -> dict[str, Any]:
    """``steps`` engine steps of vLLM's scheduler, the recorder's hooks timed apart from the step."""
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
    from dpboard.integrations.vllm.steps import VllmSteps
    from dpboard.steplog.writer import StepLog

    budget = 512 if workload == "chunked" else 2048
    config = engine_config(max_num_seqs=RUNNING + 8, max_num_batched_tokens=budget)
    scheduler = make_scheduler(config, kv_cache_config(RUNNING * 48 + 1))
    hasher = block_hasher(config)
    model = ModelExecutor(scheduler)
    made = [0]

    def add(prompt: int, max_tokens: int) -> None:
        i = made[0]
        made[0] += 1
        core = EngineCoreRequest(request_id=f"q{i}", prompt_token_ids=[(i * 7 + k) % 30000 + 1 for k in range(prompt)],
                                 mm_features=None, sampling_params=SamplingParams(max_tokens=max_tokens),
                                 pooling_params=None, arrival_time=float(i), lora_request=None, cache_salt=None,
                                 data_parallel_rank=None)
        scheduler.add_request(Request.from_engine_core_request(core, hasher))

    for _ in range(RUNNING):  # these decode past the whole measurement
        add(64, 4 * steps + 64)
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update_from_output(output, model.model_output(output))
    step_log = StepLog(directory, engine="bench-vllm", rank=0, header={"settings": {}}, max_bytes=1 << 30,
                       at_exit=False)
    steps_rec = VllmSteps(step_log, scheduler)
    t = time.perf_counter_ns
    out = {k: np.empty(steps) for k in ("step", "hooks")}
    modes = {}
    gc.disable()
    try:
        for s in range(steps):
            if workload == "chunked" and s % 4 == 0:
                add(300, 2)  # a prompt every 4 steps: chunked into the budget beside the decodes
            a = t()
            output = scheduler.schedule()
            b = t()
            steps_rec.scheduled(output, a)
            c = t()
            scheduler.update_from_output(output, model.model_output(output))
            d = t()
            step_log.end(steps_rec._pending.pop(id(output)), d)
            e = t()
            out["step"][s], out["hooks"][s] = (b - a) + (d - c), (c - b) + (e - d)
    finally:
        gc.enable()
    step_log.close()
    from dpboard.steplog.format import MODES
    from dpboard.steplog.reader import read_step_log

    records = read_step_log(step_log.path).records
    for code, name in MODES.items():
        n = int((records["mode"] == code).sum())
        if n:
            modes[name] = n
    return {"workload": workload, "steps": steps, "modes": modes,
            **{f"{k}_ns": {"50": pct(v, 50), "99": pct(v, 99)} for k, v in out.items()}}


def measure_flush(directory: str, rows: int = 1000, rounds: int = 50) -> dict[str, float]:
    """The writer thread's share: one flush of ``rows`` finished rows into the file."""
    from dpboard.steplog.format import EXTEND
    from dpboard.steplog.writer import StepLog

    step_log = StepLog(directory, engine="bench-flush", rank=0, header={"settings": {}}, max_bytes=1 << 30,
                       ring_rows=rows, flush_interval=3600, at_exit=False)
    samples = np.empty(rounds)
    step = 0
    for r in range(rounds):
        for _ in range(rows):
            step_log.record(step, 1000, step, 0, 0, 128, 1, 0, 0, 1, EXTEND)
            step += 1
        a = time.perf_counter_ns()
        step_log.flush()
        samples[r] = time.perf_counter_ns() - a
    step_log.close()
    return {"rows": rows, "50": pct(samples, 50), "99": pct(samples, 99)}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from dpboard.bench.vllm_standins import vllm_importable

    steps = 200 if args.quick else 3000
    doc: dict[str, Any] = {"machine": machine_line(), "quick": args.quick}
    print(f"## The step recorder's cost per scheduler step ({machine_line()}{', quick' if args.quick else ''})\n")
    with tempfile.TemporaryDirectory(prefix="dpboard-bench-steps-") as directory:
        with vllm_importable() as missing:
            if missing:
                print(f"vLLM: no rows: {missing}\n")
                doc["vllm"], doc["vllm_missing"] = [], missing
            else:
                doc["vllm"] = [measure_vllm(w, steps, directory) for w in ("decode", "chunked")]
                rows = [[r["workload"], ", ".join(f"{n} {k}" for k, n in r["modes"].items()),
                         fmt_ns(r["step_ns"]["50"]), fmt_ns(r["step_ns"]["99"]), fmt_ns(r["hooks_ns"]["50"]),
                         fmt_ns(r["hooks_ns"]["99"]), f"{100 * r['hooks_ns']['50'] / r['step_ns']['50']:.1f}%"]
                        for r in doc["vllm"]]
                print(f"vLLM's own Scheduler on the CPU, {RUNNING} requests decoding; engine step = schedule() + the "
                      "model stand-in's output + update_from_output() (no model: a GPU step is 10-100x longer); "
                      "hooks = the recorder's two, into a real step log.\n")
                print(markdown_table(["workload", "steps by mode", "engine step p50", "p99", "hooks p50", "p99",
                                      "hooks / step p50"], rows))
                print()
        try:
            doc["sglang"] = measure_sglang(steps, directory)
        except SGLangMissing as e:
            print(f"SGLang: no rows: {e}\n")
            doc["sglang"], doc["sglang_missing"] = [], str(e)
        else:
            rows = [[r["batch"], fmt_ns(r["baseline_ns"]["50"]), fmt_ns(r["baseline_ns"]["99"]),
                     fmt_ns(r["recorder_ns"]["50"]), fmt_ns(r["recorder_ns"]["99"]),
                     fmt_ns(r["recorder_ns"]["50"] - r["baseline_ns"]["50"])] for r in doc["sglang"]]
            print(f"SGLang's ScheduleBatch ({sglang_batch_classes().version}, compiled from its wheel); per step, "
                  "run_batch and process_batch_result as HookRegistry wraps them: with pass-through hooks (the "
                  "baseline), and with the recorder's.\n")
            print(markdown_table(["batch", "pass-through p50", "p99", "recorder p50", "p99", "recorder - baseline p50"],
                                 rows))
            print()
        doc["flush"] = measure_flush(directory)
        print(f"The writer thread: one flush of {doc['flush']['rows']:,} rows, p50 {fmt_ns(doc['flush']['50'])}, "
              f"p99 {fmt_ns(doc['flush']['99'])} (off the scheduler's thread).")
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
