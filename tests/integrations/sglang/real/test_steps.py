"""The step recorder in SGLang's scheduler (``DPBOARD_STEP_LOG``), as a scheduler process runs it.

Each run is a process of its own (``python -m tests.integrations.sglang.real.test_steps child ...``):
SGLang's plugin loader loads dpboard with ``DPBOARD_STEP_LOG`` set, SGLang's ``HookRegistry`` applies
the recorder's hooks to the scheduler class, the class is made (the ``__init__`` hook opens the
rank's log), and **SGLang's own event loops** run, ``event_loop_normal`` and ``event_loop_overlap``
with ``is_disable_overlap_for_batch``, compiled from the wheel's ``managers/scheduler.py``, over
batches that are **SGLang's own ``ScheduleBatch``** (compiled from ``managers/schedule_batch.py``,
with its ``ForwardMode`` and ``SpeculativeAlgorithm``; the overlap loop's ``batch.copy()`` is
SGLang's, and a decode batch run as an extend is made by SGLang's ``convert_decode_to_extend``). The
log it leaves is then read back here and by ``dpboard steps`` (a process too).

Stand-ins, and why: the scheduler module imports torch, so the class is the fixture's stand-in
``Scheduler`` (tests/support/sglang.py) with the loops above; what the loops call besides is the
model's and the queues' (``ingest_requests``, ``get_next_batch_to_run`` handing out the test's
batches, ``run_batch``, ``process_batch_result``, ``on_idle``, ...). ``run_batch`` does, of what
SGLang's does, only what the recorder reads (``forward_ct``, ``forward_iter``: the source test below
checks those lines in the wheel) and sleeps as a model's forward would; a mixed batch is built with
the fields ``mix_with_running`` leaves (it concatenates torch tensors; the source test checks its
lines too); an idle batch with those of ``prepare_for_idle``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpboard.steplog import format as fmt
from dpboard.steplog.reader import read_step_log, step_times
from tests.support.names import ROOT
from tests.support.sglang import session_version

pytestmark = pytest.mark.timeout(180)
SCHEDULER = "sglang.srt.managers.scheduler"
MODEL_S = 0.002  # a forward
RESULT_S = 0.0005  # a result's processing


# -- the scheduler process --------------------------------------------------------------------------------


def batch_of(classes, spec: dict, reqs_made: list):
    """SGLang's ScheduleBatch as the scheduler hands it to run_batch, from a spec of the test's."""
    import numpy as np

    sb, fm = classes.ScheduleBatch, classes.ForwardMode
    none = classes.SpeculativeAlgorithm.NONE
    Req = sys.modules["sglang.srt.managers.schedule_batch"].Req  # the fixture's stand-in (an attribute holder)

    def reqs(n: int) -> list:
        made = [Req(refresh_fill_ids=lambda: None) for _ in range(n)]
        reqs_made.extend(made)
        return made

    group = spec.get("group_extend", False)
    kind = spec["kind"]
    if kind == "extend":
        prefix, extend = spec["prefix"], spec["extend"]
        return sb(reqs=reqs(len(prefix)), forward_mode=fm.EXTEND, spec_algorithm=none, prefix_lens=list(prefix),
                  extend_lens=list(extend), extend_num_tokens=sum(extend), is_extend_in_batch=True)
    if kind in ("decode", "decode_as_extend"):
        seq = spec["seq"]
        batch = sb(reqs=reqs(len(seq)), forward_mode=fm.DECODE, spec_algorithm=none,
                   seq_lens_cpu=np.array(seq, dtype=np.int64), seq_lens_sum=sum(seq) if spec.get("summed") else None,
                   is_extend_in_batch=group)
        if kind == "decode_as_extend":
            batch.convert_decode_to_extend()  # SGLang's own: its group extends, so this rank's decode runs as one
        return batch
    if kind == "mixed":  # the fields mix_with_running leaves (schedule_batch.py: prefix_lens, extend_lens, ...)
        new_prefix, new_extend, running = spec["prefix"], spec["extend"], spec["running_seq"]
        running_reqs = reqs(len(running))
        return sb(reqs=reqs(len(new_prefix)) + running_reqs, forward_mode=fm.MIXED, spec_algorithm=none,
                  prefix_lens=list(new_prefix) + [s - 1 for s in running], extend_lens=list(new_extend) + [1] * len(running),
                  extend_num_tokens=sum(new_extend) + len(running), decoding_reqs=running_reqs,
                  is_extend_in_batch=True)
    if kind == "idle":  # what prepare_for_idle leaves (it makes empty torch tensors too)
        return sb(reqs=[], forward_mode=fm.IDLE, spec_algorithm=none, seq_lens_sum=0, extend_num_tokens=0,
                  is_extend_in_batch=group)
    if kind == "broken":  # a batch the recorder cannot read: its fault, never the loop's
        return sb(reqs=reqs(1), forward_mode=None, spec_algorithm=none, is_extend_in_batch=False)
    raise ValueError(kind)


def scheduler_class(classes, trace: list):
    """The fixture's stand-in Scheduler with SGLang's own two event loops and the loop's parts."""
    import collections
    import typing

    from sglang.srt.environ import envs

    from tests.support import sglang as sgl

    base = sys.modules[SCHEDULER].Scheduler
    namespace = {"DynamicGradMode": lambda: (lambda fn: fn),  # torch's inference mode around the loop
                 "envs": envs, "deque": collections.deque, "ScheduleBatch": classes.ScheduleBatch,
                 "GenerationBatchResult": object, "EmbeddingBatchResult": object,
                 **{name: getattr(typing, name) for name in ("Deque", "Tuple", "Union", "Optional", "List")}}
    loops = sgl.real_defs("srt/managers/scheduler.py",
                          ["event_loop_normal", "event_loop_overlap", "is_disable_overlap_for_batch"], namespace,
                          cls="Scheduler")

    class Plan:
        def __init__(self, running_batch, batch_to_run):
            self.running_batch, self.batch_to_run = running_batch, batch_to_run

    class StepScheduler(base):
        def __init__(self, server_args, port_args):  # SGLang's signature; what its __init__ sets that is read
            super().__init__()
            self.server_args = server_args
            self.forward_ct = 0
            self.chunked_prefill_size = 8192
            self.max_running_requests = 128
            self.max_total_num_tokens = 50_000
            self.max_prefill_tokens = 16384
            self.enable_overlap = server_args.overlap
            self.require_mlp_sync = server_args.dp_attention
            self.is_mixed_chunk = True
            self.page_size = 1
            self.schedule_policy = "fcfs"
            self.is_generation = True
            self.enable_unified_memory = False
            self.gracefully_exit = False
            self._engine_paused = False
            self.running_batch = None
            self.last_batch = None
            self._sched_idled = False
            self.script = []
            self.after_script = 0

        def ingest_requests(self):
            return []

        def get_next_batch_to_run(self, running_batch, last_batch):
            if self.script:
                return Plan(running_batch, self.script.pop(0))
            self.after_script += 1
            if self.after_script >= 3:  # the overlap loop processes the last result a turn later
                self.gracefully_exit = True
            return Plan(running_batch, None)

        def run_batch(self, batch, pp_proxy_tensors=None):
            self.forward_ct += 1  # SGLang's run_batch, its first lines (the source test checks them)
            batch.forward_iter = self.forward_ct
            trace.append(("run", batch.forward_iter))
            time.sleep(MODEL_S)
            return {"forward_iter": batch.forward_iter}

        def process_batch_result(self, batch, result):
            time.sleep(RESULT_S)
            trace.append(("process", batch.forward_iter))

        def on_idle(self):
            pass

        def launch_batch_sample_if_needed(self, batch_result, batch):
            pass

        def _apply_war_barrier(self):
            pass

    for name, fn in loops.items():
        setattr(StepScheduler, name, fn)
    return StepScheduler


def child(config: dict) -> None:
    """One scheduler process: the plugin through SGLang's loader, the class, SGLang's loop, a report."""
    import types

    from tests.support import sglang as sgl

    sgl.install()
    from sglang.srt import runtime_context as rc

    from dpboard.bench.steps import sglang_batch_classes

    classes = sglang_batch_classes()
    trace: list = []
    sys.modules[SCHEDULER].Scheduler = scheduler_class(classes, trace)  # as loaded when the plugins run
    os.environ["SGLANG_PLUGINS"] = "dpboard"
    import sglang.srt.plugins as plugins

    plugins.load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry

    sgl.set_context(dp_size=2, attn_dp_enabled=config["dp_attention"], role="scheduler")
    rc.get_parallel()._stamp.update(dp_rank=config["rank"], pp_rank=0, attn_tp_rank=config.get("attn_tp_rank", 0),
                                    attn_cp_rank=0, tp_rank=config["rank"])
    server_args = types.SimpleNamespace(overlap=config["loop"] == "overlap", dp_attention=config["dp_attention"],
                                        chunked_prefill_size=16384, load_balance_method="total_tokens")
    try:
        scheduler = sys.modules[SCHEDULER].Scheduler(server_args, sgl.PortArgs(instance_id="steps"))
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(3)
    made: list = []
    scheduler.script = [batch_of(classes, spec, made) for spec in config["script"]]
    getattr(scheduler, f"event_loop_{config['loop']}")()
    steps = scheduler.__dict__.get("_dpboard_steps")
    print(json.dumps({"trace": trace, "patched": sorted(t for t in HookRegistry._patched if ".Scheduler." in t),
                      "path": str(steps.log.path) if steps else None}), flush=True)


def run_child(directory: Path, config: dict, **env: str) -> dict:
    environ = {**os.environ, "DPBOARD_STEP_LOG": str(directory), **env}
    environ.pop("DPBOARD_METHOD", None)
    out = subprocess.run([sys.executable, "-m", "tests.integrations.sglang.real.test_steps", "child", json.dumps(config)],
                         cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"status {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    report = json.loads(lines[-1])
    report["status"], report["stderr"] = out.returncode, out.stderr
    return report


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child(json.loads(sys.argv[2]))
    sys.exit(0)


# -- the tests -----------------------------------------------------------------------------------------------

NORMAL = [  # normal loop, no DP attention
    {"kind": "extend", "prefix": [0, 32], "extend": [100, 60]},
    {"kind": "decode", "seq": [101, 93]},
    {"kind": "mixed", "prefix": [0], "extend": [50], "running_seq": [102, 94]},
    {"kind": "decode", "seq": [51, 103, 95], "summed": True},
    {"kind": "broken"},
    {"kind": "decode", "seq": [52, 104, 96]},
]
# (mode, prefill tokens, prefill requests, prefix tokens, decode requests, decode context tokens, batch size)
NORMAL_ROWS = [(fmt.EXTEND, 160, 2, 32, 0, 0, 2), (fmt.DECODE, 0, 0, 0, 2, 194, 2),
               (fmt.MIXED, 50, 1, 0, 2, 196, 3), (fmt.DECODE, 0, 0, 0, 3, 249, 3), (fmt.DECODE, 0, 0, 0, 3, 252, 3)]
OVERLAP = [  # overlap loop under DP attention: the group's steps
    {"kind": "extend", "prefix": [16], "extend": [200]},
    {"kind": "decode_as_extend", "seq": [217], "group_extend": True},
    {"kind": "idle", "group_extend": True},
    {"kind": "decode", "seq": [218]},
    {"kind": "decode", "seq": [219]},
]
OVERLAP_ROWS = [(fmt.EXTEND, 200, 1, 16, 0, 0, 1), (fmt.DECODE, 0, 0, 0, 1, 217, 1), (fmt.IDLE, 0, 0, 0, 0, 0, 0),
                (fmt.DECODE, 0, 0, 0, 1, 218, 1), (fmt.DECODE, 0, 0, 0, 1, 219, 1)]
OVERLAP_FLAGS = [fmt.GROUP_EXTEND, fmt.GROUP_EXTEND | fmt.DECODE_AS_EXTEND, fmt.GROUP_EXTEND, 0, 0]


def rows(records) -> list[tuple]:
    return [tuple(int(r[k]) for k in ("mode", "prefill_tokens", "prefill_reqs", "prefix_tokens", "decode_reqs",
                                      "decode_ctx_tokens", "batch_size")) for r in records]


def _without_launches(records):
    out = records.copy()
    out["launch_ns"] = 0
    return out


def overlapped_in(trace: list) -> dict[int, bool]:
    """From the loop's own order of calls: whether a later batch ran before each one's result was processed."""
    out = {}
    for i, (what, step) in enumerate(trace):
        if what == "process":
            out[step] = any(w == "run" and s > step for w, s in trace[:i])
    return out


def test_sglangs_own_loops_write_each_step_and_dpboard_steps_reads_them(tmp_path):
    normal = run_child(tmp_path, {"loop": "normal", "dp_attention": False, "rank": 1, "script": NORMAL})
    overlap = run_child(tmp_path, {"loop": "overlap", "dp_attention": True, "rank": 0, "script": OVERLAP})
    for report in (normal, overlap):
        assert report["status"] == 0, report["stderr"][-3000:]
        assert report["patched"] == [f"{SCHEDULER}.Scheduler.{m}" for m in
                                     ("__init__", "handle_embedding_request", "handle_generate_request",
                                      "process_batch_result", "run_batch")]

    log = read_step_log(normal["path"])
    assert Path(normal["path"]).name.startswith("steps-sglang-") and Path(normal["path"]).name.endswith("-rank1.bin")
    assert log.closed and log.header["engine"] == "sglang" and log.header["rank"] == 1
    assert log.settings == {"chunked_prefill_size": 8192, "max_running_requests": 128, "max_total_tokens": 50_000,
                            "overlap": False, "dp_attention": False, "method": "total_tokens", "dispatch": "sglang",
                            "dp_size": 2, "tp_size": 2, "max_prefill_tokens": 16384,
                            "server_chunked_prefill_size": 16384, "mixed_chunk": True, "page_size": 1,
                            "schedule_policy": "fcfs"}
    assert rows(log.records) == NORMAL_ROWS
    # the broken batch: SGLang's loop went on; its step is a fault, and its end found nothing to end
    assert (log.counts["faults"], log.counts["unmatched"]) == (1, 1)
    assert [int(s) for s in log.records["step"]] == [1, 2, 3, 4, 6]  # SGLang's forward_ct
    assert [s for w, s in normal["trace"] if w == "process"] == [1, 2, 3, 4, 5, 6]
    assert not (log.records["flags"] & fmt.OVERLAPPED).any()
    durations = log.records["duration_ns"] / 1e9
    assert (durations >= MODEL_S + RESULT_S).all() and (durations < 1.0).all()
    # run_batch's return, timed: here it computes in the scheduler's thread, as on a CPU (its sleep)
    launches = log.records["launch_ns"]
    assert (launches >= MODEL_S * 1e9).all() and (launches <= log.records["duration_ns"]).all()
    assert (log.records["t_start_ns"][1:] > log.records["t_start_ns"][:-1]).all()
    assert "in the step recorder (SGLang's Scheduler.run_batch)" in normal["stderr"]  # logged, with its traceback
    assert normal["stderr"].count("step-log fault #") == 1 and "Traceback" in normal["stderr"]

    log = read_step_log(overlap["path"])
    assert log.settings["overlap"] is True and log.settings["dp_attention"] is True
    assert rows(log.records) == OVERLAP_ROWS
    expected = overlapped_in(overlap["trace"])
    assert [bool(f & fmt.OVERLAPPED) for f in log.records["flags"]] == [expected[s] for s in range(1, 6)]
    assert any(expected.values()) and not all(expected.values())  # SGLang's loop overlapped some, not all
    assert [int(f) & ~fmt.OVERLAPPED for f in log.records["flags"]] == OVERLAP_FLAGS
    launches = log.records["launch_ns"]
    assert (launches >= MODEL_S * 1e9).all() and (launches <= log.records["duration_ns"]).all()
    # an overlapped step's duration holds the next batch's forward; with each launch moved to its own
    # step, every step's time holds its own forward, and the steps' sum is the windows' sum
    times = step_times(log.records)
    windows = step_times(_without_launches(log.records))
    assert (times >= MODEL_S * 1e9).all() and times.sum() == windows.sum()

    out = subprocess.run([sys.executable, "-m", "dpboard", "steps", str(tmp_path), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(f["rank"] for f in doc["files"]) == [0, 1]
    assert {m: v["steps"] for m, v in doc["modes"].items()} == {"extend": 2, "decode": 6, "mixed": 1, "idle": 1}
    assert doc["per_prefill_token_us"]["units"] == 160 + 200 and doc["per_decode_request_us"]["units"] == 2 + 3 + 3 + 1 + 1 + 1
    assert doc["flags"] == {"group_extend": 3, "decode_as_extend": 1, "overlapped": sum(expected.values())}
    text = subprocess.run([sys.executable, "-m", "dpboard", "steps", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout
    assert f"10 steps in 2 step logs (sglang {session_version()})" in text and "1 faults, 1 unmatched" in text


def test_a_scheduler_that_is_not_rank_zero_of_its_group_records_nothing(tmp_path):
    report = run_child(tmp_path, {"loop": "normal", "dp_attention": True, "rank": 0, "attn_tp_rank": 1,
                                  "script": NORMAL[:2]})
    assert report["status"] == 0 and report["path"] is None
    assert [s for w, s in report["trace"] if w == "process"] == [1, 2]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["missing", "file"])
def test_a_bad_directory_stops_the_scheduler_at_its_start_naming_the_variable(tmp_path, bad):
    target = tmp_path / "nope"
    if bad == "file":
        target.write_text("")
    report = run_child(target, {"loop": "normal", "dp_attention": False, "rank": 0, "script": NORMAL[:1]})
    assert report["status"] == 3
    message = report["error"]
    assert message.startswith("InvalidInputError: DPBOARD_STEP_LOG=")
    assert ("no such directory; create it (mkdir -p" in message) if bad == "missing" else ("is not a directory" in message)
    assert "unset DPBOARD_STEP_LOG to record no steps" in message


def test_without_the_variable_no_step_hook_is_registered(loaded_plugins):
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert not any(t.endswith(("Scheduler.run_batch", "Scheduler.process_batch_result", "Scheduler.__init__"))
                   for t in HookRegistry._hooks)


def test_the_wheel_has_what_the_recorder_reads_where_it_reads_it():
    """SGLang 0.5.23's own source: the methods hooked, the step number, the batch's fields, the modes."""
    from tests.support import sglang as sgl

    root = sgl.sglang_root()
    tree = ast.parse((root / "srt/managers/scheduler.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert [a.arg for a in methods["run_batch"].args.args[:2]] == ["self", "batch"]
    assert [a.arg for a in methods["process_batch_result"].args.args] == ["self", "batch", "result"]
    assert [a.arg for a in methods["__init__"].args.args] == ["self", "server_args", "port_args"]
    run_batch = ast.get_source_segment((root / "srt/managers/scheduler.py").read_text(), methods["run_batch"])
    assert "self.forward_ct += 1\n        batch.forward_iter = self.forward_ct" in run_batch
    scheduler_src = (root / "srt/managers/scheduler.py").read_text()
    for attribute in ("self.max_total_num_tokens", "self.max_running_requests", "self.chunked_prefill_size =",
                      "self.enable_overlap =", "self.is_mixed_chunk ="):
        assert attribute in scheduler_src, attribute
    batch_src = (root / "srt/managers/schedule_batch.py").read_text()
    for line in ("self.prefix_lens = self.prefix_lens + running_prefix_lens",
                 "self.extend_num_tokens = self.extend_num_tokens + running_bs",
                 "running_prefix_lens = [s - 1 for s in running_batch.seq_lens_cpu.tolist()]",
                 "self.forward_mode = ForwardMode.MIXED", "self.forward_mode = ForwardMode.IDLE",
                 "self.seq_lens_sum = 0", "forward_iter=self.forward_iter,", "self.decoding_reqs = self.reqs"):
        assert line in batch_src, line
    assert "new_batch.decoding_reqs = running_batch.reqs" in scheduler_src  # after mix_with_running
    forward_src = (root / "srt/model_executor/forward_batch_info.py").read_text()
    assert "batch.seq_lens_sum = int(seq_lens_cpu.sum())" in forward_src  # the backfill the recorder falls back on
