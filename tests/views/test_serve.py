"""`dpboard serve`: real HTTP requests to a real server process on a free loopback port."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import datetime, timezone

import numpy as np
import pytest

import dpboard
from dpboard import Board, LoadSnapshot
from tests.support import mixed_board as mixed
from tests.support import serving
from tests.support.names import new_board_name
from tests.support.procutil import kill, stop
from tests.support.serving import get, samples

pytestmark = pytest.mark.timeout(120)


def start_server(name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    return serving.start_server(name, "--stale-after", str(mixed.STALE_AFTER), *extra)


@pytest.fixture(scope="module")
def served():
    with mixed.mixed_board(new_board_name()) as board:
        proc, url = start_server(board.name)
        try:
            yield board, url
        finally:
            stop(proc)


SGLANG_CORE_KEYS = [
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
    "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
    "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
    "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
]


def test_loads_json_is_sglangs_document(served):
    """A board of dpboard's own publishers (no detail) as SGLang's /v1/loads shows ranks: the live
    ones only, core keys from the dispatch fields, token usage derived, the rest 0 and no section.
    (tests/integrations/sglang compares a board with details against SGLang's own code.)"""
    board, url = served
    status, ctype, body = get(f"{url}/v1/loads")
    assert status == 200 and ctype.startswith("application/json")
    doc = json.loads(body)
    assert list(doc)[:5] == ["timestamp", "version", "accelerator", "num_accelerators", "loads"]
    assert doc["version"] == dpboard.__version__ and doc["accelerator"] is None and doc["num_accelerators"] == 1
    stamp = datetime.fromisoformat(doc["timestamp"])  # SGLang's form: isoformat(), +00:00
    assert doc["timestamp"].endswith("+00:00")
    assert abs((datetime.now(timezone.utc) - stamp).total_seconds()) < 60
    assert [load["dp_rank"] for load in doc["loads"]] == list(mixed.LIVE_RANKS)
    assert doc["imbalance"] == pytest.approx(mixed.expected_imbalance())
    for load in doc["loads"]:
        r = load["dp_rank"]
        assert list(load)[: len(SGLANG_CORE_KEYS)] == SGLANG_CORE_KEYS
        for field in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
                      "num_active_tokens", "max_total_num_tokens"):
            assert load[field] == mixed.load_of(r)[field], field
        expected = mixed.load_of(r)
        assert load["token_usage"] == expected["num_used_tokens"] / expected["max_total_num_tokens"]
        assert abs(load["timestamp"] - datetime.now(timezone.utc).timestamp()) < 60
        assert load["decode_moments"] is None and load["max_running_requests"] == 0
        assert isinstance(load["gen_throughput"], float) and load["gen_throughput"] == 0.0
        assert not {"memory", "speculative", "lora", "disaggregation", "queues"} & set(load)
        # dpboard's own keys, beside SGLang's
        assert load["status"] == "live" and load["writer_pid"] == board.publisher_pid
        assert load["num_received_reqs"] == mixed.load_of(r)["num_received_reqs"] and load["publish_seq"] >= 1
        assert 0 <= load["age_s"] < 10 and load["timestamp_ns"] > 0
    # Stale, torn and empty ranks are left out, as SGLang leaves out a rank that never published
    assert doc["omitted_ranks"] == [
        {"dp_rank": mixed.STALE_RANK, "status": "stale", "age_s": doc["omitted_ranks"][0]["age_s"]},
        {"dp_rank": mixed.TORN_RANK, "status": "torn", "age_s": None},
        *({"dp_rank": r, "status": "empty", "age_s": None} for r in mixed.EMPTY_RANKS),
    ]
    assert doc["omitted_ranks"][0]["age_s"] > mixed.STALE_AFTER


def test_loads_one_rank(served):
    _, url = served
    loads = json.loads(get(f"{url}/v1/loads?dp_rank=3")[2])["loads"]
    assert len(loads) == 1 and loads[0]["dp_rank"] == 3
    assert loads[0]["num_total_tokens"] == mixed.load_of(3)["num_total_tokens"]
    # SGLang's answers for a rank it has no load of, or one out of range: 200, no load
    for rank in (mixed.STALE_RANK, mixed.TORN_RANK, 8, -1):
        status, _, body = get(f"{url}/v1/loads?dp_rank={rank}")
        assert status == 200 and json.loads(body)["loads"] == [], rank
    assert json.loads(get(f"{url}/v1/loads?dp_rank=%2B2")[2])["loads"][0]["dp_rank"] == 2  # "+2", as int() reads it
    stale = json.loads(get(f"{url}/v1/loads?dp_rank={mixed.STALE_RANK}")[2])
    assert [o["dp_rank"] for o in stale["omitted_ranks"]] == [mixed.STALE_RANK]


def test_loads_include_keeps_the_core_keys(served):
    _, url = served
    for include in ("core", "memory,spec", "all", ""):
        loads = json.loads(get(f"{url}/v1/loads?include={include}")[2])["loads"]
        assert [list(load)[: len(SGLANG_CORE_KEYS)] for load in loads] == [SGLANG_CORE_KEYS] * len(mixed.LIVE_RANKS)


def test_loads_prometheus_is_sglangs_text(served):
    _, url = served
    status, ctype, body = get(f"{url}/v1/loads?format=prometheus")
    assert status == 200 and ctype == "text/plain; version=0.0.4; charset=utf-8"
    lines = body.splitlines()
    assert lines[0] == "# TYPE sglang_timestamp gauge"
    m = samples(body)
    for r in mixed.LIVE_RANKS:
        labels = (("dp_rank", str(r)),)
        assert m[("sglang_num_total_tokens", labels)] == mixed.load_of(r)["num_total_tokens"]
        assert m[("sglang_num_waiting_reqs", labels)] == mixed.load_of(r)["num_waiting_reqs"]
        assert m[("sglang_token_usage", labels)] == pytest.approx(
            mixed.load_of(r)["num_used_tokens"] / mixed.CAPACITY)
    second = mixed.LIVE_RANKS[1]
    assert f'sglang_num_total_tokens{{dp_rank="{second}"}} {mixed.load_of(second)["num_total_tokens"]}' in lines
    ranks = {dict(labels)["dp_rank"] for (_, labels) in m}
    assert ranks == {str(r) for r in mixed.LIVE_RANKS}  # no sample of a stale, torn or empty rank
    assert not any("decode_moments" in line for line in lines)
    _, _, body = get(f"{url}/v1/loads?format=prometheus&dp_rank=2")
    assert {dict(labels)["dp_rank"] for (_, labels) in samples(body)} == {"2"}


def test_metrics(served):
    board, url = served
    status, ctype, body = get(url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    m = samples(body)
    b = ("board", board.name)
    assert m[("dpboard_up", (b,))] == 1.0
    for r in mixed.LIVE_RANKS:
        labels = (b, ("dp_rank", str(r)))
        assert m[("dpboard_total_tokens", labels)] == mixed.load_of(r)["num_total_tokens"]
        assert m[("dpboard_waiting_requests", labels)] == mixed.load_of(r)["num_waiting_reqs"]
        assert m[("dpboard_received_requests_total", labels)] == mixed.load_of(r)["num_received_reqs"]
        assert m[("dpboard_publishes_total", labels)] >= 1
    assert m[("dpboard_slots", (b, ("status", "torn")))] == 1.0
    assert m[("dpboard_slots", (b, ("status", "live")))] == 4.0
    assert m[("dpboard_slot_status", (b, ("dp_rank", str(mixed.STALE_RANK)), ("status", "stale")))] == 1.0
    assert ("dpboard_total_tokens", (b, ("dp_rank", str(mixed.TORN_RANK)))) not in m  # no data, no sample
    assert m[("dpboard_imbalance_ratio", (b,))] == pytest.approx(mixed.expected_imbalance())


@pytest.mark.parametrize(("query", "status", "words"), [
    ("/v1/loads?dp_rank=abc", 422, ["dp_rank='abc'", "not an integer"]),
    ("/v1/loads?format=xml", 400, ["format='xml'", "prometheus"]),
    ("/v1/loads?rank=1", 400, ["unknown query parameter 'rank'", "dp_rank", "include"]),
    ("/v1/loads?dp_rank=1&dp_rank=2", 400, ["given 2 times"]),
    ("/v1/loads?include=bogus", 400, ["Invalid include sections: {'bogus'}. Valid options: ['all', 'core',"]),
    ("/metrics?dp_rank=1", 400, ["/metrics takes no query parameters"]),
])
def test_bad_queries(served, query, status, words):
    _, url = served
    got, ctype, body = get(url + query)
    assert got == status and ctype.startswith("application/json")
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
        assert samples(get(f"{url}/metrics")[2])[("dpboard_up", (("board", board_name),))] == 0.0
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
    proc = subprocess.run([sys.executable, "-m", "dpboard.cli", "serve", new_board_name(), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    with Board.create(board_name, n_slots=1):
        first, url = start_server(board_name)
        try:
            port = url.rsplit(":", 1)[1]
            second = subprocess.run([sys.executable, "-m", "dpboard.cli", "serve", board_name, "--port", port],
                                    capture_output=True, text=True, timeout=60)
            assert second.returncode == 2 and "cannot listen" in second.stderr and "--port" in second.stderr
        finally:
            stop(first)


def test_one_rank_keeps_the_boards_imbalance(served):
    """Over one rank an imbalance is always 1: ?dp_rank=N still reports the board's."""
    _, url = served
    doc = json.loads(get(f"{url}/v1/loads?dp_rank={mixed.LIVE_RANKS[0]}")[2])
    assert len(doc["loads"]) == 1 and doc["imbalance"] == pytest.approx(mixed.expected_imbalance())
    assert mixed.expected_imbalance() != pytest.approx(1.0)


def test_the_root_is_the_live_page(served):
    _, url = served
    status, ctype, body = get(f"{url}/")
    assert status == 200 and ctype == "text/html; charset=utf-8" and "/v1/board" in body and "/v1/doctor" in body
    assert get(f"{url}/?x=1")[0] == 400


# -- hostile requests and values ------------------------------------------------------------------


def test_a_dp_rank_of_thousands_of_digits_is_a_422(served):
    """5,000 digits once closed the connection with a traceback (int() refuses past 4,300)."""
    _, url = served
    for digits in ("9" * 5000, "1" * 20, "-" + "9" * 4400):
        status, _, body = get(f"{url}/v1/loads?dp_rank={digits}")
        doc = json.loads(body)
        assert status == 422 and doc["detail"][0]["type"] == "int_parsing_size", body[:200]
        assert "no rank is that large" in doc["error"]
    assert json.loads(get(f"{url}/v1/loads?dp_rank={'0' * 30}3")[2])["loads"][0]["dp_rank"] == 3


def test_non_finite_detail_floats_are_standard_json_nulls(board_name):
    """NaN or infinity in a detail float (a local writer's, or one relayed from another node) was
    written as NaN/Infinity: not JSON, and strict clients fail on the whole document."""
    from dpboard.multinode.collector import Collector
    from dpboard.multinode.wire import pack_board_rows
    from dpboard.snapshot import DETAILED_DTYPE, LoadDetail

    other = new_board_name()
    with Board.create(board_name, n_slots=2) as board, Board.create(other, n_slots=2, node_id=1) as node1:
        nan = LoadDetail(token_usage=float("nan"), gen_throughput=float("inf"), decode_moments=(float("-inf"), 1.5))
        board.writer(0).publish_detailed(LoadSnapshot(0, num_running_reqs=1), nan)
        node1.writer(1).publish_detailed(LoadSnapshot(1, num_running_reqs=2, node_id=1), nan)
        with Collector(board, "tcp://127.0.0.1:*") as collector:
            rows = node1.reader().read_detailed_array(np.zeros(2, DETAILED_DTYPE))
            frame = pack_board_rows(rows, np.array([1]), with_detail=True, node_id=1, board=board_name,
                                    frame_seq=0)
            assert collector.handle_frame(frame) == 1
            proc, url = start_server(board_name, "--stale-after", "60")
            try:
                status, _, body = get(f"{url}/v1/loads?include=all")
            finally:
                stop(proc)
    doc = json.loads(body, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert status == 200 and [load["dp_rank"] for load in doc["loads"]] == [0, 1]
    for load in doc["loads"]:
        assert load["token_usage"] is None and load["gen_throughput"] is None
        assert load["decode_moments"][:2] == [None, 1.5]


def test_an_idle_connection_is_closed_after_the_idle_timeout(board_name):
    """Each connection holds a thread while open; idle ones once held theirs forever."""
    import socket
    import threading

    from dpboard.views.serve import LoadsServer

    with Board.create(board_name, n_slots=1):
        server = LoadsServer(board_name, port=0, idle_timeout=0.5)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        try:
            host, port = server.server_address[:2]
            idle = [socket.create_connection((host, port), timeout=10) for _ in range(20)]
            half = socket.create_connection((host, port), timeout=10)
            half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # a request never finished
            for sock in [*idle, half]:
                assert sock.recv(1024) == b"", "the server kept an idle connection open"  # closed by it
                sock.close()
            assert serving.get(f"{server.url}/healthz")[0] in (200, 503)  # and it still serves
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


@pytest.mark.parametrize(("host", "words"), [
    ("999.1.1.1", "--host '999.1.1.1' is neither an IP address nor a name this machine resolves"),
    ("192.0.2.1", "--host '192.0.2.1' is not an address of this machine"),  # TEST-NET-1: never local
])
def test_a_host_that_cannot_be_listened_on_is_blamed_not_the_port(board_name, host, words):
    import sys

    with Board.create(board_name, n_slots=1):
        proc = subprocess.run([sys.executable, "-m", "dpboard.cli", "serve", board_name, "--host", host,
                               "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "--port" not in proc.stderr, proc.stderr


def test_a_mode_that_is_not_utf8_leaves_every_rank_served(board_name):
    """One slot whose disaggregation mode is not UTF-8 (a writer that wrote raw bytes) took
    /v1/loads down for every rank: UnicodeDecodeError, the connection closed, a traceback per poll.
    Every rank is served; the bad mode shows as replacement characters."""
    from dpboard.snapshot import DisaggregationDetail, LoadDetail, pack_detail

    with Board.create(board_name, n_slots=3) as board:
        writers = [board.writer(rank) for rank in range(3)]
        for rank, writer in enumerate(writers):
            writer.publish_detailed(LoadSnapshot(rank, num_running_reqs=rank + 1),
                                    LoadDetail(disaggregation=DisaggregationDetail(mode="decode")))
        bad = pack_detail(LoadDetail(disaggregation=DisaggregationDetail(mode="decode", decode_transfer_queue_reqs=4)))
        bad["disaggregation_mode"] = b"\xff\xfe\xc3("  # bytes no UTF-8 decoder takes
        writers[1].publish(LoadSnapshot(1, num_running_reqs=2), bad)
        proc, url = start_server(board_name, "--stale-after", "60")
        try:
            polls = [get(f"{url}/v1/loads?include=all") for _ in range(3)]
            prometheus = get(f"{url}/v1/loads?format=prometheus")
            doctor = get(f"{url}/v1/doctor")
        finally:
            stop(proc)
        stderr = proc.stderr.read()
    for status, _, body in polls:
        doc = json.loads(body)
        assert status == 200 and [load["dp_rank"] for load in doc["loads"]] == [0, 1, 2], body[:300]
        modes = [load["disaggregation"]["mode"] for load in doc["loads"]]
        assert modes[0] == modes[2] == "decode"
        assert "\ufffd" in modes[1] and "decode" not in modes[1], modes
        assert doc["loads"][1]["disaggregation"]["decode_transfer_queue_reqs"] == 4
    assert prometheus[0] == 200 and 'sglang_num_running_reqs{dp_rank="1"} 2' in prometheus[2]
    assert doctor[0] == 200, doctor[2][:300]
    assert "Traceback" not in stderr and "UnicodeDecodeError" not in stderr, stderr[-2000:]
