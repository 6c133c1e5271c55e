"""An unchanged SGLang 0.5.23 serving with dpboard inside: ``sglang.launch_server --dp-size 2`` on the
CPU (tests/support/sglang_serving.py), its real DataParallelController and schedulers, real HTTP,
the board read in this process and by dpboard's own commands. One server for the session
(conftest.py); the tests run in this file's order, the last one stops it with SIGTERM to its
process group. Every check of the board waits for what it needs, bounded for a loaded machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.snapshot import SlotStatus
from tests.integrations.serving_faults import (
    answered_while_dpboard_fails,
    counted,
    counted_by_then,
    dispatchers,
)
from tests.integrations.sglang.serving.conftest import METHOD
from tests.support.names import ROOT, SESSION_FILES
from tests.support.procutil import kill, wait_until
from tests.support.serving import get, start_server
from tests.support.sglang_serving import KV_TOKENS, Gateway, stream_generate

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1200)]
DP = 2
SETTLE = 120.0  # seconds for the board to show what the HTTP answers already said
LONG = 3500  # tokens: two fit a rank's KV cache at once, and hold it for a minute or more here
# keys of SGLang's loads that change while nothing else does
MOVING = {"timestamp"}


def records(server, stale_after: float = 5.0) -> np.ndarray:
    with Board.attach(server.board) as board:
        return board.reader(stale_after=stale_after).read_array().copy()


def settled(server) -> bool:
    r = records(server)
    return (r["status"] == int(SlotStatus.LIVE)).all() and not r["num_running_reqs"].any() \
        and not r["num_waiting_reqs"].any()


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def served_by(answers: list[tuple[int, dict]]) -> Counter:
    """How many of the answers each DP rank served, as SGLang says it (``meta_info.dp_rank``)."""
    for status, answer in answers:
        assert status == 200, answer
    return Counter(answer["meta_info"]["dp_rank"] for _, answer in answers)


def test_two_live_slots_with_the_schedulers_pids_and_sglangs_kv_capacity(server):
    schedulers = server.schedulers(DP)
    assert [len(p) for p in schedulers] == [1, 1], (schedulers, server.tail())
    assert server.kv_capacity() == {0: KV_TOKENS, 1: KV_TOKENS}, server.tail()
    assert wait_until(lambda: (records(server)["status"] == int(SlotStatus.LIVE)).all(), timeout=60), records(server)
    r = records(server)
    assert r["writer_pid"].tolist() == [p[0] for p in schedulers]
    assert r["max_total_num_tokens"].tolist() == [KV_TOKENS, KV_TOKENS]
    assert r["dp_rank"].tolist() == [0, 1]
    assert f"dpboard: SGLang's loads are on board '{server.board}' (2 ranks)" in server.log()
    assert f"dpboard: DP dispatch by {METHOD} over board '{server.board}' (2 worker slots)" in server.log()


def test_an_idle_scheduler_publishes_its_heartbeat_not_every_turn_of_its_loop(server):
    """SGLang's idle loop asks its writer to publish on every turn (thousands a second); an unchanged
    load is published only as a heartbeat, a few times a second, so a live rank never reads stale."""
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)
    first = records(server)["publish_seq"].astype(np.int64)
    t0 = time.monotonic()
    time.sleep(3.0)
    rates = (records(server)["publish_seq"].astype(np.int64) - first) / (time.monotonic() - t0)
    assert (rates > 0).all() and (rates < 20).all(), rates
    assert (records(server, stale_after=1.0)["status"] == int(SlotStatus.LIVE)).all()


def test_dpboard_ls_top_and_doctor_read_sglangs_board(server):
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    listing = cli("ls", "--json")
    assert listing.returncode == 0, listing.stderr
    entry = next(b for b in json.loads(listing.stdout) if b["name"] == server.board)
    assert entry["creator_pid"] == server.proc.pid and entry["n_slots"] == DP, entry
    top = cli("top", server.board, "--once", "--json")
    assert top.returncode == 0, top.stderr
    ranks = json.loads(top.stdout)["ranks"]
    assert [r["status"] for r in ranks] == ["live", "live"], ranks
    assert [r["writer_pid"] for r in ranks] == [p[0] for p in server.schedulers(DP)]
    doctor = cli("doctor", server.board, "--window", "4", "--json")
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and report["healthy"], report
    found = report["dispatchers"]
    assert [(d["pid"], d["method"], d["alive"]) for d in found] == \
        [(server.titled("sglang::data_parallel_controller")[0], METHOD, True)], found


def core(load: dict) -> dict:
    return {k: v for k, v in load.items() if k not in MOVING}


def test_v1_loads_of_the_server_equals_the_board_and_dpboard_serve(server):
    """SGLang's own /v1/loads (its tokenizer manager reads the board through the plugin's reader),
    dpboard serve's /v1/loads on the same board, and the board's slots: the same ranks, key for key."""
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    proc, url = start_server(server.board)
    try:
        def same() -> bool:
            status, ours = server.get("/v1/loads?include=all")
            assert status == 200, ours
            code, _, text = get(f"{url}/v1/loads?include=all")
            assert code == 200, text
            theirs = json.loads(text)
            sglang_keys = [core(load) for load in ours["loads"]]
            served = [{k: v for k, v in core(load).items() if k in ours["loads"][0]} for load in theirs["loads"]]
            same.last = (sglang_keys, served)
            return len(sglang_keys) == DP and sglang_keys == served

        assert wait_until(same, timeout=SETTLE, interval=0.5), same.last
        sglang_loads = same.last[0]
        r = records(server)
        for rank, load in enumerate(sglang_loads):
            assert load["dp_rank"] == rank
            for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
                        "num_active_tokens", "max_total_num_tokens"):
                assert load[key] == int(r[key][rank]), (key, load, r[rank])
        assert set(sglang_loads[0]) >= {"memory", "queues", "decode_moments", "total_prefill_busy_us"}
    finally:
        kill(proc)


def test_requests_are_answered_and_each_rank_received_what_sglang_says_it_served(server):
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    before = records(server)["num_received_reqs"].astype(np.int64)
    with ThreadPoolExecutor(8) as pool:
        generated = list(pool.map(lambda i: server.generate(f"bada kime sora {i}", 8), range(16)))
        completions = list(pool.map(lambda i: server.completion(f"tell me about {i}", 8), range(8)))
    by_rank = served_by(generated)
    assert all(a["meta_info"]["completion_tokens"] == 8 for _, a in generated)
    for status, answer in completions:
        assert status == 200 and answer["usage"]["completion_tokens"] == 8, answer
    # /v1/completions answers carry no rank: the board's count covers both kinds
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    received = records(server)["num_received_reqs"].astype(np.int64) - before
    assert int(received.sum()) == 24, received
    assert all(received[rank] >= by_rank[rank] for rank in range(DP)), (received, by_rank)
    assert (received > 0).all(), received


def test_long_requests_held_on_one_rank_send_new_ones_to_the_other(server):
    """Two long streams routed to rank 0 (``routed_dp_rank``: SGLang's own routing goes first, and
    dpboard charges them to rank 0), then short requests one after another: dpboard's pick
    (inflight_tokens) sends every one to rank 1, and each rank received exactly what it served."""
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    before = records(server)["num_received_reqs"].astype(np.int64)
    routed_before = counted(server, "routed")
    streams = [stream_generate(server, f"a long story {i}", LONG, 0) for i in range(2)]
    try:
        assert wait_until(lambda: records(server)["num_running_reqs"].tolist() == [2, 0], timeout=SETTLE), \
            records(server)
        answers = [server.generate(f"short {i}", 4) for i in range(8)]
        assert served_by(answers) == Counter({1: 8}), [a["meta_info"] for _, a in answers]
        assert records(server)["num_running_reqs"][0] == 2, records(server)  # the long ones still hold rank 0
        assert wait_until(lambda: (records(server)["num_received_reqs"] - before).tolist() == [2, 8],
                          timeout=SETTLE), (before, records(server))
    finally:
        for conn in streams:
            conn.close()  # SGLang aborts a streamed request whose client goes
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)

    counted_by_then(server, "routed", routed_before + 2, server.generate, settle=SETTLE)


def test_a_fault_in_dpboards_pick_is_answered_through_sglangs_own_pick_and_logged_once(server, fault_file):
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    answers = answered_while_dpboard_fails(server, fault_file, server.generate, settle=SETTLE)
    assert sum(served_by(answers).values()) == 8
    assert all(a["meta_info"]["completion_tokens"] == 4 for _, a in answers)
    assert all("dpboard" not in json.dumps(a) for _, a in answers)
    log = server.log()
    lines = [line for line in log.splitlines() if "in dpboard's dispatch of request" in line]
    assert len(lines) == 1, lines  # faults 1 to 8: logged at the first only (then the 10th, 100th...)
    assert "RuntimeError: fault injected by the serving tests" in lines[0]
    assert "SGLang's own dispatch placed it (dpboard fault #1)" in lines[0]
    assert "Traceback" in log


@pytest.fixture
def gateway(request, server):
    policy, dp_aware = request.param
    gw = Gateway(server, policy, dp_aware=dp_aware)
    try:
        gw.wait_ready()
        yield gw
    finally:
        gw.kill()
        gw.log_path.unlink(missing_ok=True)


@pytest.mark.parametrize("gateway", [("least_load", False)], indirect=True)
def test_the_model_gateway_reads_the_real_v1_loads_and_serves_through_it(server, gateway):
    """smg's load monitor polls the server's /v1/loads (served from the board through the plugin's
    reader) and shows both ranks in its /get_loads with the board's values; requests sent through
    the gateway are answered, and the ranks received them."""
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    r = records(server)

    def monitored() -> bool:
        status, loads = gateway.get("/get_loads")
        mine = sorted((x["dp_rank"], x["max_total_num_tokens"]) for x in loads.get("loads", [])
                      if x.get("worker") == server.url)
        monitored.last = loads
        return status == 200 and mine == [(rank, int(r["max_total_num_tokens"][rank])) for rank in range(DP)]

    assert wait_until(monitored, timeout=60, interval=0.5), monitored.last
    before = records(server)["num_received_reqs"].astype(np.int64)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: gateway.post("/generate", {
            "text": f"through the gateway {i}", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}),
            range(8)))
    assert sum(served_by(answers).values()) == 8
    assert wait_until(lambda: int((records(server)["num_received_reqs"] - before).sum()) == 8, timeout=SETTLE)


@pytest.mark.parametrize("gateway", [("least_load", True)], indirect=True)
def test_the_dp_aware_gateway_picks_the_rank_and_dpboard_keeps_it(server, gateway):
    """With --dp-aware, smg registers URL@0 and URL@1 and sends each request with routed_dp_rank:
    SGLang's routing goes first, dpboard's pick never overrides it and counts it as routed."""
    status, workers = gateway.get("/workers")
    assert status == 200
    assert sorted(w["url"] for w in workers["workers"]) == [f"{server.url}@{rank}" for rank in range(DP)]
    assert wait_until(lambda: settled(server), timeout=SETTLE)
    routed_before = counted(server, "routed")
    answers = [gateway.post("/generate", {"text": f"rank chosen by smg {i}",
                                          "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
               for i in range(8)]
    by_rank = served_by(answers)
    assert sum(by_rank.values()) == 8

    counted_by_then(server, "routed", routed_before + 8, server.generate, settle=SETTLE)
    row = dispatchers(server)[0]
    assert sum(row.routed_per_rank) >= 8


def test_sigterm_to_the_server_leaves_nothing_in_dev_shm(server):
    """The last test: SIGTERM to the server's process group. SGLang ends its tree with SIGKILL, its
    main process included; the plugin's watcher removes the board and the dispatch record."""
    files = sorted(p.name for kind in SESSION_FILES for p in SHM_DIR.glob(f"{kind}{server.board}"))
    assert files == [f"dpboard-dispatch.{server.board}", f"dpboard.{server.board}"], files
    took = server.stop()
    assert server.pids() == [], server.tail()
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{server.board}")), timeout=60), \
        (sorted(SHM_DIR.glob(f"dpboard*{server.board}")), server.tail())
    assert took < 120
    assert f"after SGLang server {server.proc.pid} ended" in server.log()
