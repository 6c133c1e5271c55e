"""`dpboard serve`: real HTTP requests to a real server process on a free loopback port."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from datetime import datetime, timezone

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dpboard
from dpboard import Board, LoadSnapshot
from tests.support.mixed_board import (
    EMPTY_RANKS,
    LIVE_RANKS,
    PYTHON,
    STALE_AFTER,
    STALE_RANK,
    TORN_RANK,
    expected_imbalance,
    load_of,
    mixed_board,
)
from tests.support.names import new_board_name
from tests.support.procutil import kill, read_line, stop

pytestmark = pytest.mark.timeout(120)


def start_server(name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [PYTHON, "-m", "dpboard.cli", "serve", name, "--port", "0", "--stale-after", str(STALE_AFTER), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = read_line(proc, 30)
    except AssertionError:
        kill(proc)
        raise
    url = line.split(" on ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:")
    return proc, url


def get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; error statuses are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, by name and labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def served():
    with mixed_board(new_board_name()) as board:
        proc, url = start_server(board.name)
        try:
            yield board, url
        finally:
            stop(proc)


def test_loads_json(served):
    board, url = served
    status, ctype, body = get(f"{url}/v1/loads")
    assert status == 200 and ctype.startswith("application/json")
    doc = json.loads(body)
    assert doc["version"] == dpboard.__version__
    stamp = datetime.fromisoformat(doc["timestamp"].replace("Z", "+00:00"))
    assert stamp.tzinfo is not None and stamp.utcoffset().total_seconds() == 0
    assert abs((datetime.now(timezone.utc) - stamp).total_seconds()) < 60
    assert [load["dp_rank"] for load in doc["loads"]] == list(range(8))
    assert doc["imbalance"] == pytest.approx(expected_imbalance())
    for r in LIVE_RANKS:
        load = doc["loads"][r]
        assert load["status"] == "live"
        for field, value in load_of(r).items():
            assert load[field] == value, field
        assert load["writer_pid"] == board.publisher_pid
        assert load["token_usage"] == pytest.approx(load_of(r)["num_used_tokens"] / load_of(r)["max_total_num_tokens"])
        assert datetime.fromisoformat(load["timestamp"].replace("Z", "+00:00")).tzinfo is not None
    assert doc["loads"][STALE_RANK]["status"] == "stale"
    assert doc["loads"][TORN_RANK]["status"] == "torn"
    assert doc["loads"][TORN_RANK]["timestamp"] is None
    assert all(doc["loads"][r]["status"] == "empty" for r in EMPTY_RANKS)


def test_loads_one_rank(served):
    _, url = served
    status, _, body = get(f"{url}/v1/loads?dp_rank=3")
    assert status == 200
    loads = json.loads(body)["loads"]
    assert len(loads) == 1 and loads[0]["dp_rank"] == 3
    assert loads[0]["num_total_tokens"] == load_of(3)["num_total_tokens"]


def test_loads_prometheus(served):
    # /metrics has tests/views/test_metrics.py
    board, url = served
    status, ctype, body = get(url + "/v1/loads?format=prometheus")
    assert status == 200 and ctype.startswith("text/plain")
    m = metrics(body)
    b = ("board", board.name)
    assert m[("dpboard_up", (b,))] == 1.0
    for r in LIVE_RANKS:
        labels = (b, ("dp_rank", str(r)))
        assert m[("dpboard_total_tokens", labels)] == load_of(r)["num_total_tokens"]
        assert m[("dpboard_waiting_requests", labels)] == load_of(r)["num_waiting_reqs"]
    _, _, body = get(f"{url}/v1/loads?format=prometheus&dp_rank=2")
    ranks = {dict(labels).get("dp_rank") for (name, labels) in metrics(body) if name == "dpboard_total_tokens"}
    assert ranks == {"2"}


@pytest.mark.parametrize(("query", "words"), [
    ("/v1/loads?dp_rank=abc", ["dp_rank='abc'", "not an integer"]),
    ("/v1/loads?dp_rank=8", ["out of range", "0..7"]),
    ("/v1/loads?dp_rank=-1", ["out of range"]),
    ("/v1/loads?format=xml", ["format='xml'", "prometheus"]),
    ("/v1/loads?rank=1", ["unknown query parameter 'rank'", "dp_rank"]),
    ("/v1/loads?dp_rank=1&dp_rank=2", ["given 2 times"]),
    ("/metrics?dp_rank=1", ["/metrics takes no query parameters"]),
])
def test_bad_queries_get_400(served, query, words):
    _, url = served
    status, ctype, body = get(url + query)
    assert status == 400 and ctype.startswith("application/json")
    message = json.loads(body)["error"]
    for word in words:
        assert word in message


def test_unknown_path_is_404(served):
    _, url = served
    status, _, body = get(f"{url}/v2/nothing")
    assert status == 404 and "/v1/loads" in json.loads(body)["error"]


def test_healthz_follows_the_board(board_name):
    board = Board.create(board_name, n_slots=2)
    proc, url = start_server(board_name)
    try:
        board.writer(1).publish(LoadSnapshot(dp_rank=1, num_total_tokens=5))
        status, _, body = get(f"{url}/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok"
        board.close()
        board.unlink()
        status, _, body = get(f"{url}/healthz")
        assert status == 503 and "is gone" in json.loads(body)["error"]
        status, _, body = get(f"{url}/v1/loads")
        assert status == 503
        assert metrics(get(f"{url}/metrics")[2])[("dpboard_up", (("board", board_name),))] == 0.0
        with Board.create(board_name, n_slots=2) as again:
            again.writer(0).publish(LoadSnapshot(dp_rank=0, num_total_tokens=9))
            status, _, body = get(f"{url}/v1/loads")
            assert status == 200
            assert json.loads(body)["loads"][0]["num_total_tokens"] == 9
            assert json.loads(body)["generation"] == again.generation
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        assert proc.returncode == 0
    finally:
        kill(proc)
        board.close()
        board.unlink()


def test_missing_board_and_busy_port_are_clear_errors(board_name):
    proc = subprocess.run([PYTHON, "-m", "dpboard.cli", "serve", new_board_name(), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    with Board.create(board_name, n_slots=1):
        first, url = start_server(board_name)
        try:
            port = url.rsplit(":", 1)[1]
            second = subprocess.run([PYTHON, "-m", "dpboard.cli", "serve", board_name, "--port", port],
                                    capture_output=True, text=True, timeout=60)
            assert second.returncode == 2 and "cannot listen" in second.stderr and "--port" in second.stderr
        finally:
            stop(first)
