"""`dpboard bench relay` measures what a reader of node0's board sees, not only what travels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_the_relay_bench_samples_node0s_copy_beside_the_local_board(tmp_path):
    path = tmp_path / "relay.json"
    out = subprocess.run([sys.executable, "-m", "dpboard.cli", "bench", "relay", "--quick", "--no-baseline",
                          "--duration", "1", "--warmup", "0.3", "--tick-ms", "5", "--detail", "--json", str(path)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "node0's copy p50" in out.stdout and "local board p50" in out.stdout
    figures = json.loads(path.read_text())
    sampled = figures["relay"]["sampled"]
    assert sampled["instants"] > 50
    # At one instant node0 holds the rank's snapshot or an older one, never a newer one.
    assert sampled["node0"]["p50"] >= sampled["local"]["p50"]
    assert sampled["node0"]["p99"] >= sampled["local"]["p50"]
    # --detail: the same run again with every slot carrying an SGLang snapshot's detail
    assert "every slot with a detail (456-byte records)" in out.stdout
    detailed = figures["detailed"]
    assert detailed["samples"] > 0 and detailed["bad"] == 0
    assert detailed["sampled"]["instants"] > 50
