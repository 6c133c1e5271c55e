"""`GET /metrics` of `dpboard serve`: the page itself, its names against Prometheus's own linter, and
a real Prometheus scraping it and answering queries per rank."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dpboard import Board, LoadSnapshot
from dpboard.board.dispatch_record import WAVE_REASONS
from tests.controller.test_process_wave import HOLD, two_waves
from tests.support import mixed_board as mixed
from tests.support.names import ROOT, new_board_name
from tests.support.procutil import stop
from tests.support.prometheus import prometheus_binary, running_prometheus
from tests.support.serving import get, samples, start_server

pytestmark = pytest.mark.timeout(180)

WITH_DATA = (*mixed.LIVE_RANKS, mixed.STALE_RANK)  # ranks that have a snapshot (the stale one keeps its last)
# Per-rank gauge -> the snapshot field it shows.
GAUGE_FIELDS = {
    "dpboard_running_requests": "num_running_reqs",
    "dpboard_waiting_requests": "num_waiting_reqs",
    "dpboard_used_tokens": "num_used_tokens",
    "dpboard_total_tokens": "num_total_tokens",
    "dpboard_active_tokens": "num_active_tokens",
    "dpboard_capacity_tokens": "max_total_num_tokens",
    "dpboard_received_requests_total": "num_received_reqs",
    "sglang:num_running_reqs": "num_running_reqs",
    "sglang:num_queue_reqs": "num_waiting_reqs",
}
GATEWAY_SERIES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")


def usage_of(rank: int) -> float:
    return mixed.load_of(rank)["num_used_tokens"] / mixed.CAPACITY


@pytest.fixture(scope="module")
def served():
    with mixed.mixed_board(new_board_name()) as board:
        proc, url = start_server(board.name, "--stale-after", str(mixed.STALE_AFTER))
        try:
            yield board, url
        finally:
            stop(proc)


def test_metrics_page(served):
    board, url = served
    status, ctype, body = get(f"{url}/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    m = samples(body)
    b = ("board", board.name)
    assert m[("dpboard_up", (b,))] == 1.0
    assert m[("dpboard_imbalance_ratio", (b,))] == pytest.approx(mixed.expected_imbalance())
    assert {s: m[("dpboard_slots", (b, ("status", s)))] for s in ("live", "stale", "torn", "empty")} == {
        "live": len(mixed.LIVE_RANKS), "stale": 1, "torn": 1, "empty": len(mixed.EMPTY_RANKS)}
    for r in range(8):
        state = {s: m[("dpboard_slot_status", (b, ("dp_rank", str(r)), ("status", s)))]
                 for s in ("live", "stale", "torn", "empty")}
        expected = ("live" if r in mixed.LIVE_RANKS else "stale" if r == mixed.STALE_RANK
                    else "torn" if r == mixed.TORN_RANK else "empty")
        assert state == {s: float(s == expected) for s in state}, r
    for r in WITH_DATA:
        labels = (b, ("dp_rank", str(r)))
        for name, field in GAUGE_FIELDS.items():
            assert m[(name, labels)] == mixed.load_of(r)[field], (name, r)
        assert m[("dpboard_token_usage_ratio", labels)] == pytest.approx(usage_of(r))
        assert m[("sglang:token_usage", labels)] == pytest.approx(usage_of(r))
        assert m[("dpboard_publishes_total", labels)] >= 1
        assert m[("dpboard_snapshot_age_seconds", labels)] >= 0
    for r in (mixed.TORN_RANK, *mixed.EMPTY_RANKS):  # no snapshot: no per-rank samples but the slot's status
        assert not [key for key in m if dict(key[1]).get("dp_rank") == str(r) and key[0] != "dpboard_slot_status"]
    # The old names (before the Prometheus naming rules) are gone.
    assert not re.search(r"^dpboard_(num_|max_total|token_usage |imbalance )", body, re.M)


def test_gateway_fallback_reads_the_board(served):
    """SGLang's model gateway, when /v1/loads fails, reads /metrics as smg's monitor.rs does: one
    synthetic worker whose running and waiting requests are the sums of every `sglang:` sample and
    whose token usage is their mean."""
    _, url = served
    by_name: dict[str, list[float]] = {}
    for (name, _labels), value in samples(get(f"{url}/metrics")[2]).items():
        by_name.setdefault(name, []).append(value)
    assert all(by_name.get(name) for name in GATEWAY_SERIES)
    assert sum(by_name["sglang:num_running_reqs"]) == sum(mixed.load_of(r)["num_running_reqs"] for r in WITH_DATA)
    assert sum(by_name["sglang:num_queue_reqs"]) == sum(mixed.load_of(r)["num_waiting_reqs"] for r in WITH_DATA)
    usage = by_name["sglang:token_usage"]
    assert sum(usage) / len(usage) == pytest.approx(sum(usage_of(r) for r in WITH_DATA) / len(WITH_DATA))


def test_ratio_needs_a_capacity(board_name):
    """A rank that publishes no capacity has no usage ratio (0 would read as an idle rank)."""
    with Board.create(board_name, n_slots=2) as board:
        board.writer(0).publish(LoadSnapshot(dp_rank=0, num_running_reqs=3, num_used_tokens=50))
        board.writer(1).publish(LoadSnapshot(dp_rank=1, num_used_tokens=50, max_total_num_tokens=200))
        proc, url = start_server(board_name, "--stale-after", "60")
        try:
            m = samples(get(f"{url}/metrics")[2])
        finally:
            stop(proc)
    b = ("board", board_name)
    assert m[("dpboard_running_requests", (b, ("dp_rank", "0")))] == 3
    assert ("dpboard_token_usage_ratio", (b, ("dp_rank", "0"))) not in m
    assert ("sglang:token_usage", (b, ("dp_rank", "0"))) not in m
    assert m[("dpboard_token_usage_ratio", (b, ("dp_rank", "1")))] == 0.25


def _promtool() -> str:
    binary = prometheus_binary()
    promtool = Path(binary).with_name("promtool") if binary else None
    if promtool is None or not promtool.exists():
        pytest.skip("promtool (Debian's prometheus package) is not installed: "
                    "`apt-get install prometheus` (.ci/run installs it)")
    return str(promtool)


def test_names_pass_prometheus_lint(served):
    """`promtool check metrics` (Prometheus's own linter of names, units, suffixes and help) finds
    nothing but the colon of the gateway's three series, which is the name the gateway reads."""
    _, url = served
    body = get(f"{url}/metrics")[2]
    lint = subprocess.run([_promtool(), "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
    findings = sorted(line for line in (lint.stdout + lint.stderr).splitlines() if line.strip())
    assert findings == sorted(f"{name} metric names should not contain ':'" for name in GATEWAY_SERIES), findings


def test_the_wave_of_a_real_controller_is_on_the_page(board_name, tmp_path):
    """An inflight_wave controller's hold was in no view: nothing showed an operator the hold's bound.
    `dpboard serve` reads it from the controller's row of the board's dispatch record, as doctor
    does, while the controller runs; the names pass Prometheus's linter."""
    with two_waves(board_name, tmp_path):
        proc, url = start_server(board_name, "--stale-after", "60")
        try:
            status, _, body = get(f"{url}/metrics")
        finally:
            stop(proc)
    assert status == 200, body
    m = samples(body)
    row = (("board", board_name), ("row", "0"))
    assert m[("dpboard_wave_held_requests_total", row)] == 5
    assert m[("dpboard_wave_holding_requests", row)] == 0
    assert m[("dpboard_waves_total", row)] == 2
    released = {reason: m[("dpboard_wave_released_requests_total", tuple(sorted((*row, ("reason", reason)))))]
                for reason in WAVE_REASONS}
    assert released == {"full": 4, "bytes": 0, "busy": 0, "bound": 1, "shutdown": 0, "order": 0}
    hold_max = m[("dpboard_wave_hold_max_seconds", row)]
    assert HOLD - 0.05 <= hold_max < HOLD + 1.0 and m[("dpboard_wave_hold_bound_seconds", row)] == HOLD
    assert m[("dpboard_wave_hold_seconds_count", row)] == 5
    assert m[("dpboard_wave_hold_seconds_sum", row)] >= hold_max + 0.45  # the first request's half second too
    assert m[("dpboard_wave_held_max_bytes", row)] > 0 and m[("dpboard_wave_held_bytes", row)] == 0
    binary = prometheus_binary()
    promtool = Path(binary).with_name("promtool") if binary else None
    if promtool is not None and promtool.exists():
        lint = subprocess.run([str(promtool), "check", "metrics"], input=body, capture_output=True, text=True,
                              timeout=60)
        findings = [line for line in (lint.stdout + lint.stderr).splitlines() if line.strip()]
        assert all(line.startswith("sglang:") for line in findings), findings


def documented_queries() -> list[str]:
    """The PromQL block of docs/TOOLS.md's Grafana section, one query a line."""
    text = (ROOT / "docs" / "TOOLS.md").read_text()
    block = re.search(r"### Grafana\n.*?```promql\n(.*?)```", text, re.S)
    assert block, "docs/TOOLS.md has no ```promql block under ### Grafana"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_prometheus_scrapes_the_board(served, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("the prometheus binary is not installed: `apt-get install prometheus` "
                    "(Debian's package; .ci/run installs it)")
    board, url = served
    target = url.removeprefix("http://")
    with running_prometheus(tmp_path, [target], binary) as prom:
        sel = f'board="{board.name}"'
        prom.wait_for(f"dpboard_up{{{sel}}}", timeout=30)
        assert prom.value('up{job="dpboard"}') == 1.0
        (health,) = prom.api("/api/v1/targets")["activeTargets"]
        assert health["health"] == "up" and health["lastError"] == "", health
        for r in WITH_DATA:
            rank = f'{sel},dp_rank="{r}"'
            for name, field in GAUGE_FIELDS.items():
                assert prom.value(f"{{__name__=\"{name}\",{rank}}}") == mixed.load_of(r)[field], (name, r)
            assert prom.value(f"dpboard_token_usage_ratio{{{rank}}}") == pytest.approx(usage_of(r))
            assert prom.value(f"sglang:token_usage{{{rank}}}") == pytest.approx(usage_of(r))
        assert prom.value(f"count(dpboard_total_tokens{{{sel}}})") == len(WITH_DATA)
        assert prom.value(f'dpboard_slot_status{{{sel},dp_rank="{mixed.TORN_RANK}",status="torn"}}') == 1.0
        assert prom.value(f"dpboard_imbalance_ratio{{{sel}}}") == pytest.approx(mixed.expected_imbalance())
        # Counters behave as counters once two scrapes are in: live writers publish, the stale one does not.
        rates = prom.wait_for(f"rate(dpboard_publishes_total{{{sel}}}[5s])", timeout=30)
        by_rank = {int(s["metric"]["dp_rank"]): float(s["value"][1]) for s in rates}
        assert all(by_rank[r] > 0 for r in mixed.LIVE_RANKS) and by_rank[mixed.STALE_RANK] == 0, by_rank
        total = prom.value(f'sum by (board) (dpboard_total_tokens{{{sel}}})')
        print(f"\nPrometheus: sum by (board) (dpboard_total_tokens{{{sel}}}) = {total:g}")
        assert total == sum(mixed.load_of(r)["num_total_tokens"] for r in WITH_DATA)
        for query in documented_queries():
            expr = query.replace("$board", board.name)
            assert prom.wait_for(expr, timeout=30), query
