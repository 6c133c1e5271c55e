"""docs/REPLAY.md's result sections are what tools/replay_study.py renders from docs/replay/*.json, and
its report says what the study's bar is: the simulator's figure within 15 % of the real median or
inside the real spread, pairs of methods whose repeats overlap named as inseparable. The tool runs
as a user runs it, in a subprocess (its report), or is imported for its pure parts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support.names import ROOT

TOOL = ROOT / "tools" / "replay_study.py"


def _tool():
    spec = importlib.util.spec_from_file_location("replay_study", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("replay_study", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("setup", ["independent", "dp-attention", "mooncake", "vllm"])
def test_the_page_holds_what_the_results_render(setup):
    done = subprocess.run([sys.executable, str(TOOL), "--setup", setup, "report", "--check"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr + done.stdout


def _cell(arm: str, load: str, repeat: int, ttft: float) -> dict:
    figures = {"ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 3, "tpot_p50_ms": 3.0, "tpot_p99_ms": 6.0,
               "output_tokens_per_s": 800.0, "requests_per_s": 13.0, "rank0_share": 0.5}
    return {"arm": arm, "load": load, "repeat": repeat, "figures": figures}


def test_the_report_marks_a_miss_and_names_the_pairs_the_noise_cannot_order():
    tool = _tool()
    setup = tool.SETUPS["independent"]
    cells = {}
    for repeat, (a, b, c) in enumerate([(20, 21, 40), (22, 25, 41), (24, 23, 43)]):
        for arm, ttft in (("round_robin", a), ("total_requests", b), ("total_tokens", c)):
            cells[f"{arm}|light|{repeat}"] = _cell(arm, "light", repeat, ttft)
    sim = {"round_robin|light": {"ttft_p50_ms": 23.5},  # inside the spread 20-24, 6.8 % off the median 22
           "total_requests|light": {"ttft_p50_ms": 10.0},  # -57 %: a miss
           "total_tokens|light": {"ttft_p50_ms": 47.0}}  # +15 % of 41 is 47.15: within the bar
    for arm, values in sim.items():
        sim[arm] = {**_cell("", "", 0, values["ttft_p50_ms"])["figures"], **values}
    doc = {"capacity": {"requests_per_s": 47.0, "when": "today"}, "cells": cells, "sim": sim}
    rows = {(r["arm"], r["key"]): r for r in tool.compare(setup, doc)}
    assert rows[("round_robin", "ttft_p50_ms")]["within"] is True
    assert rows[("total_requests", "ttft_p50_ms")]["within"] is False
    assert rows[("total_tokens", "ttft_p50_ms")]["within"] is True
    assert rows[("round_robin", "ttft_p50_ms")]["median"] == 22 and rows[("round_robin", "ttft_p50_ms")]["min"] == 20
    assert tool.inseparable(setup, doc, "light", "ttft_p50_ms") == [("round_robin", "total_requests")]
    text = tool.render(setup, doc)
    assert "sim 10.0 (-57%) ✗" in text and "sim 23.5 (+7%) |" in text
    assert "Ranking by TTFT p50, real: round_robin < total_requests < total_tokens (the noise cannot separate 1 of 3 pairs)" in text
    assert "simulated: total_requests < round_robin < total_tokens" in text


def test_arrival_times_keep_the_traces_shape_at_the_rate_asked():
    tool = _tool()
    reqs = [{"offset_s": t} for t in (0.0, 1.0, 3.0, 9.0)]
    times = tool.arrival_times(reqs, 1.5)
    assert times[-1] == pytest.approx(3 / 1.5) and times[2] / times[-1] == pytest.approx(3 / 9)


def test_requests_that_found_the_server_idle_are_told_apart():
    import numpy as np

    tool = _tool()
    # A runs 0-1 s; B arrives at 0.5 (A still running), ends at 2; C arrives at 3 (all ended): idle,
    # as A (the first) is
    split = tool.idle_split(np.array([0.0, 0.5, 3.0]), np.array([1.0, 2.0, 3.5]), np.array([0.2, 0.4, 0.3]))
    assert split == {"idle": 2, "idle_ttft_p50_ms": pytest.approx(250.0), "busy_ttft_p50_ms": pytest.approx(400.0)}
    # a request that arrives as another ends is not waiting on it: idle
    assert tool.idle_split(np.array([0.0, 1.0]), np.array([1.0, 2.0]), np.array([0.1, 0.1]))["idle"] == 2
    records = [{"arrival": a, "late_ms": 0.0, "e2e": e - a, "ttft": t}
               for a, e, t in ((0.0, 1.0, 0.2), (0.5, 2.0, 0.4), (3.0, 3.5, 0.3))]
    assert tool.record_idle_split(records) == split


def test_cells_run_again_keep_the_earlier_figures_and_the_heading_says_so(tmp_path):
    tool = _tool()
    setup = tool.Setup("t", False, (tool.Arm("round_robin", "sglang", "round_robin"),), {"light": 0.275},
                       tmp_path / "t.json", tmp_path / "t.profile", tmp_path / "t.png")
    doc = {"capacity": {"requests_per_s": 47.0, "when": "today"}, "cells": {}}
    for repeat, ttft in enumerate((30.0, 32.0)):
        cell = _cell("round_robin", "light", repeat, ttft)
        doc["cells"][f"round_robin|light|{repeat}"] = {**cell, "when": f"2026-12-04 23:0{repeat}", "loadavg": [4.0, 4.1],
                                                       "records": [{"i": 0}]}
    tool.set_aside(setup, doc, list(setup.arms), ["light"], 3)
    assert doc["cells"] == {}
    assert [run["figures"]["ttft_p50_ms"] for run in doc["earlier"]["round_robin|light|0"]] == [30.0]
    assert "records" not in doc["earlier"]["round_robin|light|1"][0]  # figures kept, records dropped
    assert tool.load_results(setup.results)["earlier"] == doc["earlier"]  # written at once
    for repeat, ttft in enumerate((20.0, 22.0)):
        doc["cells"][f"round_robin|light|{repeat}"] = {**_cell("round_robin", "light", repeat, ttft),
                                                       "when": f"2026-12-05 06:0{repeat}"}
    heading = tool.when_run(doc, "light")
    assert heading == (", run 2026-12-05 06:00 to 06:01; 2 earlier runs of these cells (2026-12-04 23:00 to "
                       "2026-12-04 23:01, kept under `earlier` in the results file) gave a TTFT p50 of 31.0 ms, "
                       "median of the cells, against 21.0 ms now")
