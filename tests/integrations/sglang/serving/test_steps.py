"""The step recorder inside a real SGLang server (a server of its own): ``DPBOARD_STEP_LOG=DIR`` on
``sglang.launch_server --dp-size 2`` with the plugin dispatching.

Requests of several prompt lengths, a few at once, then SIGTERM to the server's process group: each
rank's scheduler has left a closed log in DIR whose header holds the server's settings as SGLang
logged them; its steps are extend and decode steps whose counts add up to what was asked (every
prompt token prefilled once, every output token but the first decoded once); `dpboard steps` and
`dpboard calibrate` read the logs as an operator would, and the fitted profile runs in `dpboard
sim`; nothing of the board is left in /dev/shm."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dpboard.board import SHM_DIR
from dpboard.steplog import format as fmt
from dpboard.steplog.reader import read_step_log, step_log_paths
from tests.integrations.sglang.serving.conftest import serving
from tests.support.names import ROOT
from tests.support.procutil import wait_until

pytestmark = [pytest.mark.serving, pytest.mark.timeout(900)]
DP = 2
OUTPUT = 24  # tokens per request
ROUNDS = 6
PER_ROUND = 8  # requests sent at once: decode batches of several sizes


def prompt(i: int) -> list[int]:
    """A prompt of 20 to 400 token ids whose first is its own (no prefix hit between two prompts)."""
    return [3 + i] + np.random.default_rng(i).integers(3, 1000, size=19 + (i * 37) % 380).tolist()


def decoded(directory) -> int:
    return sum(int(read_step_log(p).records["decode_tokens"].sum()) for p in step_log_paths(directory))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("steps")
    with serving("inflight_ttft", {"DPBOARD_STEP_LOG": str(directory)}) as srv:
        sent = []
        with ThreadPoolExecutor(PER_ROUND) as pool:
            for r in range(ROUNDS):
                ids = [r * PER_ROUND + k for k in range(PER_ROUND)]
                answers = list(pool.map(lambda i: srv.post("/generate", {
                    "input_ids": prompt(i),
                    "sampling_params": {"max_new_tokens": OUTPUT, "ignore_eos": True, "temperature": 0.0}}), ids))
                for status, answer in answers:
                    assert status == 200, answer
                    assert answer["meta_info"]["completion_tokens"] == OUTPUT
                sent += ids
        # the writer flushes every 0.1 s: the last steps are on disk within that (a log ended by SIGTERM
        # without its exit handler loses what came after its last flush, docs/INTEGRATIONS.md)
        assert wait_until(lambda: decoded(directory) == len(sent) * (OUTPUT - 1), timeout=30), decoded(directory)
        log = srv.log()
        srv.stop()
        board = srv.board
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{board}")), timeout=60), \
        sorted(SHM_DIR.glob(f"dpboard*{board}"))
    return directory, sent, log


def test_each_rank_left_a_closed_log_with_the_servers_settings(recorded):
    directory, _, log = recorded
    logs = [read_step_log(p) for p in step_log_paths(directory)]
    assert sorted(x.header["rank"] for x in logs) == list(range(DP))
    chunk = int(re.search(r"'chunked_prefill_size': (\d+)", log)[1])
    for x in logs:
        # SGLang ends its schedulers without their exit handlers: a log is closed, or ended with its
        # process after its last flush (every step of the finished requests in it, as below)
        assert x.counts["dropped_cap"] == 0 and x.counts["dropped_ring"] == 0 and x.counts["faults"] == 0
        s = x.settings
        assert s["max_running_requests"] == 16 and s["chunked_prefill_size"] == chunk
        assert s["dp_attention"] is False and s["method"] == "inflight_ttft"
        assert 0 < s["max_total_tokens"] <= 8192


def test_the_steps_add_up_to_what_was_asked(recorded):
    directory, sent, _ = recorded
    rec = np.concatenate([read_step_log(p).records for p in step_log_paths(directory)])
    modes = {fmt.MODES[m] for m in np.unique(rec["mode"])}
    assert {"extend", "decode"} <= modes
    # beside the prompts: SGLang's /health, which the start polls, generates from a 1-token prompt
    extra = int(rec["prefill_tokens"].sum()) - sum(len(prompt(i)) for i in sent)
    assert 0 <= extra <= 10, extra
    # SGLang's first token comes with the prefill; each of the others is a decode step's token
    assert int(rec["decode_tokens"].sum()) == len(sent) * (OUTPUT - 1)
    decode = rec[rec["mode"] == fmt.DECODE]
    assert len(np.unique(decode["decode_reqs"])) >= 3  # batches of several sizes
    assert (rec["duration_ns"] > 0).all()
    # run_batch's return is timed inside each step (on this CPU it is the step's forward)
    assert ((rec["launch_ns"] > 0) & (rec["launch_ns"] <= rec["duration_ns"])).all()


def test_steps_and_calibrate_read_the_logs_and_sim_runs_the_profile(recorded, tmp_path):
    directory, _, _ = recorded
    summary = subprocess.run([sys.executable, "-m", "dpboard", "steps", str(directory)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    assert "extend" in summary.stdout and "decode" in summary.stdout
    profile = tmp_path / "cpu.profile"
    fit = subprocess.run([sys.executable, "-m", "dpboard", "calibrate", str(directory), "-o", str(profile),
                          "--min-steps", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0, fit.stderr
    assert "fit error per decode step" in fit.stdout
    sim = subprocess.run([sys.executable, "-m", "dpboard", "sim", "--profile-file", str(profile), "--ranks", "2",
                          "--quick", "--methods", "inflight_ttft"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert sim.returncode == 0, (sim.stderr, fit.stdout, profile.read_text())
