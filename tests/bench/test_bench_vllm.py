"""The vLLM rows of ``dpboard bench``, run as a user runs them, with vLLM 0.33.0's wheel on the path
(tests/conftest.py puts .venv/engines on PYTHONPATH): vLLM's pick beside the pick through dpboard in
``bench dispatch``, and vLLM's own scheduler stepping beside dpboard's publish in ``bench engine``.
Without the wheel these skip and say how to get it; in CI (CI=true) that is a failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from dpboard.bench.vllm_standins import wheel_missing


@pytest.fixture(autouse=True)
def vllm_wheel() -> None:
    missing = wheel_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run these tests: {missing}")
        pytest.skip(missing)


def dpboard(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_dispatch_shows_vllms_own_pick_beside_the_pick_through_dpboard():
    out = dpboard("bench", "dispatch", "--quick", "--ranks", "8", "--batch", "64", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("### vLLM's pick"):]
    assert "No module named" not in table and "no vLLM rows" not in table
    rows = re.findall(r"^\| (\d+) \| ([\d.]+ [µn]s) \|.* \| ([\d.]+ [µnm]s) \| [\d.]+ [µnm]s \| [\d.]+ [µnm]s \| ([\d.]+)x \|$",
                      table, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [16, 64, 256], table


def test_bench_engine_steps_vllms_scheduler_at_each_queue_length(tmp_path):
    path = tmp_path / "engine.json"
    out = dpboard("bench", "engine", "--quick", "--waiting", "0", "300", "--json", str(path), timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(path.read_text())
    got = {(row["policy"], row["waiting"]) for row in doc["engine"]}
    assert got == {("fcfs", 0), ("fcfs", 300), ("priority", 0), ("priority", 300)}
    for row in doc["engine"]:
        assert row["step_ns"]["50"] > 0 and row["publish_ns"]["50"] > 0 and row["walk_ns"]["50"] > 0
        assert f"| {row['policy']} | {row['waiting']:,} |" in out.stdout
