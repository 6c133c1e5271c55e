"""The step recorder in vLLM's engine core (``DPBOARD_STEP_LOG``): vLLM's own ``EngineCore.step`` and
``step_with_batch_queue`` over its own ``Scheduler`` (chunked prefill, prefix-cache hits, preemption),
each step's row checked against the ``SchedulerOutput`` vLLM made for it; the plugin through vLLM's
own loader in a fresh process, its log read back by ``dpboard steps``; a bad directory refused."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from concurrent.futures import Future

import pytest
from vllm.v1.engine.core import EngineCoreProc

from dpboard.integrations.vllm import steps
from dpboard.steplog import format as fmt
from dpboard.steplog.reader import read_step_log
from tests.support.names import ROOT
from tests.support.vllm_engine import ModelExecutor, engine_request, real_engine, take_in

pytestmark = pytest.mark.timeout(180)
FIELDS = ("mode", "prefill_tokens", "prefill_reqs", "prefix_tokens", "decode_reqs", "decode_tokens",
          "decode_ctx_tokens", "batch_size")


@pytest.fixture
def recording(monkeypatch, tmp_path):
    """``steps.patch`` on vLLM's EngineCoreProc, as the plugin applies it with DPBOARD_STEP_LOG set (the
    session loaded the plugins without it); the class as it was after the test."""
    for name in ("_process_engine_step", "shutdown"):
        monkeypatch.setattr(EngineCoreProc, name, EngineCoreProc.__dict__[name])
    monkeypatch.setattr(EngineCoreProc, "_dpboard_steps_patched", False, raising=False)
    for name in ("DPBOARD_VLLM_BOARD", "DPBOARD_VLLM", "DPBOARD_METHOD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DPBOARD_STEP_LOG", str(tmp_path))
    steps.patch(EngineCoreProc)
    return tmp_path


def run(engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not (engine.scheduler.has_requests() or engine.batch_queue):
            return
        engine._process_engine_step()  # vLLM's own: step_fn, then its outputs into the output queue
    pytest.fail(f"vLLM's scheduler did not finish its requests in {limit} steps")


def closed_log(engine):
    recorder = engine.__dict__[steps.STATE]
    steps.close_for_engine(engine)
    return read_step_log(recorder.log.path)


def rows(records) -> list[tuple]:
    return [tuple(int(r[k]) for k in FIELDS) for r in records]


def test_each_step_is_recorded_as_vllms_scheduler_output_says(recording):
    # 64 tokens a step: r0's prompt in one step with r1's first 4 tokens, r1's rest beside r0's decode
    engine = real_engine(1, 0, num_blocks=65, max_num_batched_tokens=64)
    take_in(engine, engine_request("r0", 60, max_tokens=3, first_token=1000))
    take_in(engine, engine_request("r1", 60, max_tokens=3, first_token=2000))
    run(engine)
    take_in(engine, engine_request("again", 70, max_tokens=2, first_token=1000))  # r0's prompt and more: 3 blocks hit
    run(engine)
    log = closed_log(engine)
    records = [r for r in log.records if r["mode"] != fmt.IDLE]  # vLLM's own empty steps, while finished ones leave
    # (mode, prefill, prefill reqs, prefix, decode reqs, decode tokens, decode context, batch size)
    assert rows(records) == [
        (fmt.EXTEND, 64, 2, 0, 0, 0, 0, 2),  # r0's 60, r1's first 4
        (fmt.MIXED, 56, 1, 4, 1, 1, 61, 2),  # r1's 56 after its 4; r0 decodes on 60 + 1
        (fmt.DECODE, 0, 0, 0, 2, 2, 62 + 61, 2),
        (fmt.DECODE, 0, 0, 0, 1, 1, 62, 1),  # r0 is done (3 tokens)
        (fmt.EXTEND, 22, 1, 48, 0, 0, 0, 1),  # 48 tokens from vLLM's prefix cache
        (fmt.DECODE, 0, 0, 0, 1, 1, 71, 1),
    ]
    assert log.closed and not any(log.counts[k] for k in ("dropped_cap", "dropped_ring", "faults", "unmatched"))
    assert (log.records["step"] == range(len(log.records))).all() and (log.records["duration_ns"] > 0).all()
    assert not (log.records["flags"] & fmt.OVERLAPPED).any()  # EngineCore.step: one step at a time
    assert log.header["engine"] == "vllm" and log.header["rank"] == 0
    assert {k: log.settings[k] for k in fmt.SETTINGS_KEYS} == {
        "chunked_prefill_size": 64, "max_running_requests": 64,
        "max_total_tokens": engine.vllm_config.cache_config.kv_cache_size_tokens, "overlap": False,
        "dp_attention": False, "method": "vllm"}
    out = subprocess.run([sys.executable, "-m", "dpboard", "steps", str(log.path), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["modes"]["decode"]["steps"] == 3 and doc["modes"]["extend"]["steps"] == 2
    assert doc["per_prefill_token_us"]["units"] == 64 + 22 and doc["prefix_tokens"] == 4 + 48


def test_preempted_requests_recompute_as_prefill_and_every_token_is_counted_once(recording):
    """vLLM's scheduler preempts and resumes with 16 blocks for four 80-token requests: each step's row
    against an explicit walk of the SchedulerOutput vLLM made for it."""
    engine = real_engine(1, 0, num_blocks=17, max_num_batched_tokens=64)
    outputs = []
    steps.open_for_engine(engine)  # what the first _process_engine_step does first
    recorded = engine.scheduler.schedule  # the recorder's wrapper, on the instance

    def keep(*args, **kwargs):
        out = recorded(*args, **kwargs)
        outputs.append(out)
        return out

    engine.scheduler.schedule = keep
    for i in range(4):
        take_in(engine, engine_request(f"r{i}", 60, max_tokens=20, first_token=1000 * i))
    run(engine)
    engine.scheduler.schedule = recorded
    log = closed_log(engine)
    got = rows(log.records)
    expected, resumed_steps, seen = [], 0, set()
    for out in outputs:
        n = out.num_scheduled_tokens
        prefill = prefill_reqs = prefix = decode_reqs = decode_tokens = ctx = 0
        # a preempted request comes back among the new ones (vLLM's v2 model runner) or as resumed
        cached = out.scheduled_cached_reqs
        resumed_steps += bool(cached.resumed_req_ids) or any(new.req_id in seen for new in out.scheduled_new_reqs)
        seen.update(n)
        for new in out.scheduled_new_reqs:
            prefill, prefill_reqs, prefix = prefill + n[new.req_id], prefill_reqs + 1, prefix + new.num_computed_tokens
        for req_id, computed, made in zip(cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens,
                                          strict=True):
            if made == 0 or req_id in cached.resumed_req_ids:
                prefill, prefill_reqs, prefix = prefill + n[req_id], prefill_reqs + 1, prefix + computed
            else:
                decode_reqs, decode_tokens, ctx = decode_reqs + 1, decode_tokens + n[req_id], ctx + computed + n[req_id]
        assert prefill + decode_tokens == out.total_num_scheduled_tokens
        mode = (fmt.MIXED if prefill and decode_reqs else fmt.EXTEND if prefill else fmt.DECODE if decode_reqs
                else fmt.IDLE)
        expected.append((mode, prefill, prefill_reqs, prefix, decode_reqs, decode_tokens, ctx, len(n)))
    assert got == expected
    assert resumed_steps, "vLLM's scheduler preempted nothing: the test's KV cache is too large"
    modes = {m for m, *_ in got}
    assert {fmt.EXTEND, fmt.DECODE, fmt.MIXED} <= modes


class QueuedExecutor(ModelExecutor):
    """The model stand-in answering as vLLM's executor does under the batch queue: ``execute_model``
    returns a future of nothing for a batch that samples, ``sample_tokens`` the future of its output."""

    def execute_model(self, scheduler_output, non_block=False):
        self.pending = scheduler_output
        done = Future()
        done.set_result(self.model_output(scheduler_output) if not scheduler_output.total_num_scheduled_tokens else None)
        return done

    def sample_tokens(self, grammar_output, non_block=False):
        done = Future()
        done.set_result(self.model_output(self.pending))
        return done


def test_with_vllms_batch_queue_steps_overlap_and_are_flagged(recording):
    engine = real_engine(1, 0, num_blocks=65, max_num_batched_tokens=64)
    engine.model_executor = QueuedExecutor(engine.scheduler)
    engine.batch_queue_size = 2  # what EngineCore.__init__ sets with a batch queue (async scheduling, PP)
    engine.batch_queue = collections.deque(maxlen=2)
    engine.step_fn = engine.step_with_batch_queue
    engine.is_mm_encoder_only = engine.is_pooling_model = False
    take_in(engine, engine_request("r0", 200, max_tokens=3, first_token=1000))
    take_in(engine, engine_request("r1", 30, max_tokens=3, first_token=2000))
    run(engine)
    log = closed_log(engine)
    work = log.records[log.records["mode"] != fmt.IDLE]
    assert [(int(r["mode"]), int(r["prefill_tokens"]), int(r["prefix_tokens"])) for r in work[:4]] == [
        (fmt.EXTEND, 64, 0), (fmt.EXTEND, 64, 64), (fmt.EXTEND, 64, 128), (fmt.EXTEND, 8 + 30, 192)]
    assert int(work["prefill_tokens"].sum()) == 230 and int(work["decode_reqs"].sum()) == 4
    overlapped = (log.records["flags"] & fmt.OVERLAPPED) != 0
    assert overlapped[:-1].all() and not overlapped[-1]  # each launched before the previous result: all but the last
    assert log.counts["unmatched"] == 0


LOADER = """
import json, sys
from tests.support import vllm as sv
sv.install()
import vllm.v1.engine.core  # loaded before the plugins, as in an engine core
import vllm.plugins
try:
    vllm.plugins.load_general_plugins()
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(3)
from tests.support.vllm_engine import engine_request, real_engine, take_in
engine = real_engine(2, 1, num_blocks=65, max_num_batched_tokens=64)
for i in range(3):
    take_in(engine, engine_request(f"r{i}", 40, max_tokens=4, first_token=1000 * i))
while engine.scheduler.has_requests():
    engine._process_engine_step()
path = str(engine.__dict__["_dpboard_steps"].log.path)
try:
    engine.shutdown()  # dpboard's wrapper closes the log first; vLLM's own teardown needs what no test has
except Exception:
    pass
print(json.dumps({"path": path}))
"""


def load_in_process_of_its_own(directory: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPBOARD_")}
    result = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**env, "VLLM_PLUGINS": "dpboard", "DPBOARD_STEP_LOG": directory})
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr[-3000:]
    return {"status": result.returncode, "stderr": result.stderr, **json.loads(lines[-1])}


def test_through_vllms_own_loader_an_engine_core_writes_its_log(tmp_path):
    out = load_in_process_of_its_own(str(tmp_path))
    assert out["status"] == 0, out["stderr"][-3000:]
    log = read_step_log(out["path"])
    assert os.path.basename(out["path"]).startswith("steps-vllm-") and out["path"].endswith("-rank1.bin")
    assert log.closed and log.header["rank"] == 1 and log.settings["dp_size"] == 2
    work = log.records[log.records["mode"] != fmt.IDLE]
    assert int(work["prefill_tokens"].sum()) == 120 and int(work["decode_reqs"].sum()) == 3 * 3
    text = subprocess.run([sys.executable, "-m", "dpboard", "steps", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert text.returncode == 0 and "(vllm " in text.stdout and "time per decode request" in text.stdout


@pytest.mark.parametrize("bad", ["missing", "file"])
def test_a_bad_directory_stops_vllm_when_it_loads_the_plugin(tmp_path, bad):
    target = tmp_path / "nope"
    if bad == "file":
        target.write_text("")
    out = load_in_process_of_its_own(str(target))
    assert out["status"] == 3
    assert out["error"].startswith("InvalidInputError: DPBOARD_STEP_LOG=")
    assert "unset DPBOARD_STEP_LOG to record no steps" in out["error"]


def test_without_the_variable_the_engine_core_is_not_patched_for_steps():
    assert not getattr(EngineCoreProc, "_dpboard_steps_patched", False)
