"""``dpboard bench``'s one shape: a topic list when no topic is named, ``--quick`` and ``--json FILE``
on every topic with the path checked before the run, and ``bench all`` with its own help and one
JSON document."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpboard.bench.cli import TOPICS


def dpboard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_without_a_topic_lists_the_topics():
    out = dpboard("bench")
    assert out.returncode == 2
    for topic in [*TOPICS, "all"]:
        assert f"\n  {topic} " in out.stdout
    assert "required" not in out.stderr


def test_bench_all_help_is_its_own():
    out = dpboard("bench", "all", "--help")
    assert out.returncode == 0
    assert out.stdout.startswith("usage: dpboard bench all") and "--json FILE" in out.stdout
    assert "bench board" not in out.stdout


@pytest.mark.parametrize("topic", [*TOPICS, "all"])
def test_every_topic_takes_quick_and_json_file(topic):
    out = dpboard("bench", topic, "--help")
    assert out.returncode == 0 and "--quick" in out.stdout and "--json FILE" in out.stdout
    assert "``" not in out.stdout


@pytest.mark.parametrize("topic", [*TOPICS, "all"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(topic, tmp_path):
    out = dpboard("bench", topic, "--quick", "--json", str(tmp_path / "missing" / "x.json"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --json:" in out.stderr and "does not exist" in out.stderr
    assert out.stdout == ""  # refused before a single figure was measured
    out = dpboard("bench", topic, "--json", str(tmp_path))  # a folder, not a file
    assert out.returncode == 2 and "is a directory" in out.stderr and out.stdout == ""


def test_bench_dispatch_json_file_holds_the_figures_it_printed(tmp_path):
    path = tmp_path / "dispatch.json"
    out = dpboard("bench", "dispatch", "--quick", "--ranks", "8", "--batch", "64", "--json", str(path), timeout=240)
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text())
    assert doc["quick"] is True and {row["ranks"] for row in doc["dispatch"]} == {8}
    for row in doc["dispatch"]:
        assert row["method"] in out.stdout and row["dpboard_ns"]["50"] > 0 and row["baseline_ns"]["50"] > 0


def test_bench_startup_times_each_read_only_command_beside_a_bare_interpreter(tmp_path):
    path = tmp_path / "startup.json"
    out = dpboard("bench", "startup", "--quick", "--json", str(path), timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text())
    rows = doc["commands"]
    assert doc["quick"] is True and doc["rounds"] == 3
    assert [label.split()[0:2] for label in rows] == [["python", "-c"], ["python", "-c"], ["dpboard", "ls"],
                                                      ["dpboard", "info"], ["dpboard", "clean"], ["dpboard", "doctor"]]
    assert rows["python -c pass"]["vs_python"] == 1.0
    for label, row in rows.items():
        assert 0 < row["median_ms"] <= row["p90_ms"] and label in out.stdout


def test_bench_sglang_loads_times_sglangs_own_get_loads_beside_the_board_write(tmp_path):
    """SGLang's get_loads, compiled from its wheel, over 0 to 10,000 waiting requests: one row each,
    printed and in the JSON, each row the snapshot SGLang's code built from that queue."""
    path = tmp_path / "sglang_loads.json"
    out = dpboard("bench", "sglang_loads", "--quick", "--json", str(path), timeout=240)
    assert out.returncode == 0, out.stderr
    assert "SGLang 0.5.23" in out.stdout and "BoardWriter.publish p50" in out.stdout
    doc = json.loads(path.read_text())
    assert [row["waiting"] for row in doc["rows"]] == [0, 100, 1_000, 10_000]
    for row in doc["rows"]:
        assert f"\n| {row['waiting']:,} | " in out.stdout
        assert row["num_waiting_reqs"] == row["waiting"]  # SGLang's own count of the queue it walked
        # KV in use (300,000 tokens, the allocator's number) plus every waiting request's seqlen
        assert (row["num_total_tokens"] > 300_000) == (row["waiting"] > 0)
        for key in ("get_loads_ns", "board_publish_ns", "plugin_write_ns"):
            assert 0 < row[key]["50"] <= row[key]["99"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_all_json_file_holds_every_topic(tmp_path):
    path = tmp_path / "all.json"
    out = dpboard("bench", "all", "--quick", "--json", str(path), timeout=850)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert set(doc) == set(TOPICS)
    assert doc["board"]["dpboard"] and doc["dispatch"]["dispatch"] and doc["relay"]["relay"]["samples"] > 0
    assert doc["kernels"]  # one row per backend and size
    assert [row["waiting"] for row in doc["sglang_loads"]["rows"]] == [0, 100, 1_000, 10_000]
