"""A real ``vllm serve --data-parallel-size 2`` with dpboard's plugin (vLLM's CPU build, a tiny model with
random weights: tests/support/vllm_serving.py), real HTTP completions and chat completions, and the
board read in this process. The engines finish long before the HTTP answers come back, so every
check of the board waits for what it needs, bounded for a loaded 2-core machine. One server for the
session (conftest.py); the tests run in this file's order, the last one stops it with SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.board.sent import SentRecord
from dpboard.snapshot import SlotStatus
from tests.integrations.serving_faults import answered_while_dpboard_fails, counted, counted_by_then
from tests.support.names import ROOT, SESSION_FILES
from tests.support.procutil import wait_until

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1800)]
DP = 2
API_SERVERS = 2  # vllm serve's default with DP = 2: one API server per DP rank
SETTLE = 120.0  # seconds for the board to show what the HTTP answers already said
LONG = 30000  # tokens: a stream that holds its engine for a minute or more on this machine (20,000 ran out
# in 45 s while an API server busy streaming them answered one short request in 27 s)


def records(server) -> np.ndarray:
    with Board.attach(server.board) as board:
        return board.reader(stale_after=2.0).read_array().copy()


def sent(server) -> list[int]:
    with Board.attach(server.board) as board:
        record = SentRecord.open(server.board, API_SERVERS, DP, generation=board.generation)
    try:
        return record.totals()[:, 0].tolist()
    finally:
        record.close()


def settled(server) -> bool:
    """Every request sent is received, and nothing runs or waits."""
    r = records(server)
    return (r["num_received_reqs"].tolist() == sent(server) and not r["num_running_reqs"].any()
            and not r["num_waiting_reqs"].any())


def test_two_live_engine_slots_with_the_engine_cores_pids_and_vllms_kv_capacity(server):
    logged = server.kv_capacity()  # DP rank -> (engine core pid, "KV cache size: N tokens")
    assert sorted(logged) == [0, 1], server.tail()
    engine_pids = [server.titled(f"VLLM::EngineCore_DP{rank}") for rank in range(DP)]
    assert [len(p) for p in engine_pids] == [1, 1], engine_pids
    assert wait_until(lambda: (records(server)["status"] == int(SlotStatus.LIVE)).all(), timeout=60), records(server)
    r = records(server)
    assert r["writer_pid"].tolist() == [p[0] for p in engine_pids] == [logged[k][0] for k in range(DP)]
    assert r["max_total_num_tokens"].tolist() == [logged[k][1] for k in range(DP)]
    assert (r["max_total_num_tokens"] > 0).all()


def test_completions_and_chat_completions_are_answered_and_every_request_sent_is_received(server):
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    before = records(server)["num_received_reqs"].copy()
    with ThreadPoolExecutor(8) as pool:
        completions = list(pool.map(lambda i: server.completion(f"bada kime sora {i}", 8), range(24)))
        chats = list(pool.map(lambda i: server.chat(f"tell me about {i}", 8), range(8)))
    for status, answer in completions:
        assert status == 200, answer
        assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 8
    for status, answer in chats:
        assert status == 200, answer
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] == 8
    # the engines' own counts at intake, against what the two API servers' sent rows say
    assert wait_until(lambda: settled(server), timeout=SETTLE), (records(server), sent(server))
    after = records(server)["num_received_reqs"]
    assert int((after - before).sum()) == 32
    assert (after - before > 0).all(), (before, after)  # both engines served


def test_long_requests_held_on_one_engine_send_new_ones_to_the_other(server):
    """Two long streams pinned to engine 0 (vLLM's X-data-parallel-rank header: an explicit rank, which
    dpboard charges to engine 0), then short requests one after another: dpboard's pick
    (inflight_requests: running + waiting + in flight) sends every one to engine 1. The streams are
    read as they come (a client that stops reading slows its API server down), then closed. Each
    short one's engine is read off the board before the next is sent, beside the board as this
    process saw it just before sending, so that a miss says where and with what in view."""
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    before = records(server)["num_received_reqs"].copy()
    routed_before, fallbacks_before = counted(server, "routed"), counted(server, "fallbacks")
    streams = [server.stream(f"a long story {i}", LONG, {"X-data-parallel-rank": "0"}) for i in range(2)]
    readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in streams]
    for t in readers:
        t.start()
    try:
        assert wait_until(lambda: records(server)["num_running_reqs"].tolist() == [2, 0], timeout=SETTLE), \
            records(server)
        last = records(server)["num_received_reqs"].copy()
        assert (last - before).tolist() == [2, 0], (before, last)
        placed = []
        for i in range(10):
            in_view = board_view(server)
            status, answer = server.completion(f"short {i}", 4)
            assert status == 200, answer
            # answered, so received: the engine published its intake with the request's first step
            assert wait_until(lambda seen=last: int((records(server)["num_received_reqs"] - seen).sum()) == 1,
                              timeout=SETTLE), (last, records(server))
            now = records(server)["num_received_reqs"].copy()
            placed.append((int(np.argmax(now - last)), in_view))
            last = now
        running = records(server)["num_running_reqs"].tolist()
        assert running[0] == 2, (running, placed)  # the long ones held engine 0 all along
        assert [engine for engine, _ in placed] == [1] * 10, \
            (placed, "fallbacks to vLLM's pick:", counted(server, "fallbacks") - fallbacks_before)
    finally:
        for s in streams:
            s.close()  # vLLM aborts a stream whose client goes
    assert wait_until(lambda: settled(server), timeout=SETTLE), (records(server), sent(server))
    # the two pinned ones, as the API servers' dispatch record counts them
    counted_by_then(server, "routed", routed_before + 2, server.completion, settle=SETTLE)


def board_view(server) -> list[tuple[str, int, int, int]]:
    """Each engine's slot as read now: status, running, waiting, and the age of its last publish (ms)."""
    r = records(server)
    now = time.monotonic_ns()
    return [(SlotStatus(int(x["status"])).name, int(x["num_running_reqs"]), int(x["num_waiting_reqs"]),
             (now - int(x["monotonic_ns"])) // 1_000_000) for x in r]


def drain(response) -> None:
    try:
        while response.read(65536):
            pass
    except (OSError, ValueError, AttributeError):
        pass  # closed by the test: vLLM aborts the request


def test_dpboard_doctor_finds_the_deployment_healthy(server):
    result = subprocess.run([sys.executable, "-m", "dpboard.cli", "doctor", server.board, "--window", "4", "--json"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    report = json.loads(result.stdout)
    assert result.returncode == 0 and report["healthy"], report
    assert report["status_counts"]["live"] == DP
    found = report["dispatchers"]
    assert len(found) == API_SERVERS and all(d["alive"] and d["method"] == "inflight_requests" for d in found), found
    assert sorted(d["pid"] for d in found) == sorted(server.titled("VLLM::APIServer"))


def test_a_fault_in_dpboards_pick_is_answered_through_vllms_own_pick(server, fault_file):
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    answers = answered_while_dpboard_fails(server, fault_file, server.completion, settle=SETTLE)
    assert [status for status, _ in answers] == [200] * 8, answers
    assert all(a["usage"]["completion_tokens"] == 4 for _, a in answers)
    log = server.log()
    assert "RuntimeError: fault injected by the serving tests in dpboard's dispatch" in log
    assert "vLLM's own pick placed it (dpboard fault #1)" in log and "Traceback" in log
    assert wait_until(lambda: settled(server), timeout=SETTLE), (records(server), sent(server))


def test_sigterm_to_vllm_serve_leaves_nothing_in_dev_shm(server):
    """The last test: SIGTERM to vllm serve, as ``kill`` sends it. vLLM's launcher stops its API
    servers and engine cores (SIGTERM, then SIGKILL at once); nothing of the board stays."""
    assert server.pids()
    files = sorted(p.name for kind in SESSION_FILES for p in SHM_DIR.glob(f"{kind}{server.board}"))
    assert len(files) == 3, files  # the board, the sent record, the dispatch record
    took = server.stop(signal.SIGTERM)
    assert server.proc.returncode is not None and server.pids() == [], server.tail()
    left = sorted(p.name for kind in SESSION_FILES for p in SHM_DIR.glob(f"{kind}{server.board}"))
    assert left == [], (left, server.tail())
    assert took < 180
