"""`dpboard bench kernels`: its errors are one line, its host-overhead mode runs here, and its GPU
story runs end to end against the CuPy stand-in (figures from a stand-in mean nothing; the
code path is what is checked before a GPU machine runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.fake_cupy import fake_cupy


def bench(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "dpboard.cli", "bench", "kernels", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize(("args", "words"), [
    (["--backends", "cupy"], "CuPy with a GPU is not available here"),
    (["--backends", "numba-cuda"], "no CUDA GPU for numba-cuda here"),
    (["--backends", "bogus"], "'bogus' is not a backend"),
])
def test_what_cannot_run_is_a_one_line_error(args, words):
    from dpboard.bench.kernels import available_backends

    if args[1] in available_backends():
        pytest.skip(f"{args[1]} runs here")
    out = bench(*args)
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_script_form_says_the_same_in_one_line():
    out = subprocess.run([sys.executable, "tools/bench_kernels.py", "--backends", "bogus"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "'bogus' is not a backend" in out.stderr and "Traceback" not in out.stderr


def test_host_overhead_mode_measures_the_cupy_step_without_a_gpu(tmp_path):
    target = tmp_path / "k.json"
    out = bench("--host-overhead", "--quick", "--json", str(target))
    assert out.returncode == 0, out.stderr
    rows = {r["what"]: r for r in json.loads(target.read_text())["host_overhead"]}
    step = rows["LoadPublisher.step(), cupy, no-op launch/copy/sync"]
    assert step["n"] > 0 and step["median_us"] > 0 and step["p99_us"] >= step["median_us"]
    assert "board publish alone (writer.publish_values)" in rows
    assert "LoadPublisher.step(), cupy GPU-direct, no-op launch" in rows
    assert "| LoadPublisher.step(), cupy, no-op launch/copy/sync |" in out.stdout


@pytest.mark.parametrize("version", ["13.6.0", "14.2.0"])
def test_the_gpu_story_runs_end_to_end_on_the_stand_in(version, monkeypatch):
    from dpboard.bench import kernels
    from dpboard.loads import compute as loads_compute
    from dpboard.loads import cuda as loads_cuda

    cupy, gpu = fake_cupy(version)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(loads_cuda, "_runners", {})
    monkeypatch.setattr(loads_compute, "_last_call", type(loads_compute._last_call)())
    monkeypatch.setattr(kernels, "torch_available", lambda: False)
    rows = kernels.gpu_story(True, size=(64, 4096), iterations=(5, 1, 3))
    names = [r["what"] for r in rows]
    assert names[0].startswith("floor") and names[1].startswith("launch alone")
    assert any(n.startswith("dpb_raw_counts device time") for n in names)
    assert "GPU-direct step() host time, cupy" in names and "GPU-direct launch to visible in the board, cupy" in names
    assert rows[0]["vs_floor"] == 1.0
    assert "| floor: trivial kernel" in kernels.gpu_markdown(rows)
    assert not gpu.registered and not gpu.events
