"""dpboard sim: determinism, conservation, hand-checked dispatch, and why throttle and speculation matter.

These drive the real ``dpboard.controller.Dispatcher`` through the simulator (no stand-in), on tiny
traces so the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dpboard.sim.methods import parse_method_spec
from dpboard.sim.model import RankConfig
from dpboard.sim.peers import VllmPolicy
from dpboard.sim.policy import SimBoard
from dpboard.sim.report import summarize
from dpboard.sim.simulation import PublishConfig, SimConfig, Simulation, simulate
from dpboard.sim.trace import Trace, TraceSpec, generate_trace, scenario
from tests.support import traces

ALL_METHODS = [
    "round_robin",
    "total_requests",
    "total_tokens",
    "vllm",
    "cache_aware",
    "dynamo_kv",
    "inflight_requests",
    "inflight_tokens",
    "inflight_backlog",
    "inflight_cache",
]


def small_trace(name: str = "bursty", ranks: int = 4, seed: int = 7, duration: float = 3.0) -> Trace:
    spec = scenario(name).scaled(duration_s=duration)
    return generate_trace(spec, ranks, seed)


def hand_trace(arrivals: list[float], prompts: list[int], outputs: list[int], ranks: int) -> Trace:
    return traces.hand_trace(arrivals, prompts, outputs, ranks=ranks, spec=TraceSpec(name="hand"))


def outcome(result) -> list[tuple[int, float, float, float]]:
    return [(r.rank, r.admitted_s, r.first_token_s, r.finished_s) for r in result.requests]


# -- determinism ----------------------------------------------------------------------------------


def test_same_seed_same_result():
    config = SimConfig(n_ranks=4, publish=PublishConfig(cadence="sglang", visibility_delay_s=0.002))
    first = simulate(small_trace(seed=3), ALL_METHODS, config)
    again = simulate(small_trace(seed=3), ALL_METHODS, config)
    for a, b in zip(first, again, strict=True):
        assert outcome(a) == outcome(b), a.method
        assert np.array_equal(a.sample_tokens, b.sample_tokens)
        sa, sb = summarize(a), summarize(b)
        sa.pop("wall_s"), sb.pop("wall_s")
        assert sa == sb
    other = generate_trace(scenario("bursty").scaled(duration_s=3.0), 4, 4)
    assert not np.array_equal(other.arrival_s, small_trace(seed=3).arrival_s)


def test_trace_is_seeded_and_shaped_as_named():
    bursty = generate_trace(scenario("bursty").scaled(duration_s=20.0), 8, 1)
    assert np.array_equal(
        bursty.arrival_s, generate_trace(scenario("bursty").scaled(duration_s=20.0), 8, 1).arrival_s
    )
    assert np.all(np.diff(bursty.arrival_s) >= 0)
    burst_size = round(scenario("bursty").burst_per_rank * 8)
    assert bursty.is_burst.sum() > 0 and bursty.is_burst.sum() % burst_size == 0
    # each burst's requests land within the burst span
    times = np.sort(bursty.arrival_s[bursty.is_burst]).reshape(-1, burst_size)
    assert np.all(times[:, -1] - times[:, 0] <= scenario("bursty").burst_span_s)
    longshort = generate_trace(scenario("longshort").scaled(duration_s=20.0), 8, 1)
    long_share = np.mean(longshort.prompt_len > 4000)
    assert 0.03 < long_share < 0.15
    assert np.median(longshort.prompt_len) < 1000
    assert longshort.output_len.min() >= 1 and longshort.output_len.max() <= scenario("longshort").output_max


# -- conservation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_request_is_served_once_on_one_rank(method):
    # A small KV cache forces retractions too: a retracted request goes back to its own rank's queue.
    config = SimConfig(n_ranks=3, rank=RankConfig(kv_capacity=12_000, max_running=16))
    spec = TraceSpec(name="tight", duration_s=2.0, rate_per_rank=12.0, prompt_max=4000, output_max=2000)
    trace = generate_trace(spec, 3, 11)
    sim = Simulation(trace, method, config)
    result = sim.run()
    n = len(trace)
    assert n > 20
    assert sum(rank.received for rank in sim.ranks) == n
    finished_on = Counter()
    for rank in sim.ranks:
        for req in rank.finished:
            assert req.rank == rank.rank
            finished_on[req.rid] += 1
    assert finished_on == Counter(range(n))
    for req in result.requests:
        assert 0 <= req.rank < 3
        assert req.arrival_s <= req.received_s <= req.admitted_s < req.first_token_s <= req.finished_s
        assert req.generated == req.output_len
    assert all(not rank.running and not rank.waiting and rank.used_tokens == 0 for rank in sim.ranks)
    if method == "round_robin":
        assert result.retractions > 0  # the tight cache did exercise retraction


def test_single_request_ttft_is_transit_plus_prefill():
    cfg = RankConfig(
        prefill_base_s=0.004, prefill_s_per_token=40e-6, decode_base_s=0.01, decode_s_per_kv_token=0.0
    )
    config = SimConfig(n_ranks=2, rank=cfg, send_delay_s=0.001)
    trace = hand_trace([0.25], [1000], [5], ranks=2)
    (result,) = simulate(trace, ["total_tokens"], config)
    req = result.requests[0]
    assert req.rank == 0
    assert req.first_token_s - req.arrival_s == pytest.approx(0.001 + 0.004 + 1000 * 40e-6)
    # then four decode steps of 10 ms each
    assert req.finished_s - req.first_token_s == pytest.approx(4 * 0.01)


# -- a scenario small enough to work out by hand --------------------------------------------------

# Three ranks. Prefill takes 1 ms whatever the length; a decode step takes 1 s, so after its prefill
# each rank sits in its first decode step (publishing at its start) for the rest of the story.
# Requests spend 30 ms in transit, so at D's refresh A, B, C are still on their way, and the ranks'
# idle publishes (every 10 ms, as SGLang's idle loop) still show them empty.
#
#   A t=0.010 1000 tokens   B t=0.011 100   C t=0.012 100   D t=0.031 100   (D: 21 ms after A: refresh)
#   E t=0.550 10            F t=0.551 10    G t=0.552 10    (refresh; every rank is in its decode step)
#
# round_robin:       A0 B1 C2 D0 | E1 F2 G0  (the counter just turns)
# total_requests:    A0 B1 C2 | D's refresh overwrites the budget with the idle ranks' zeros -> D0 |
#                    at E rank 0's snapshot (taken at its decode step, before D arrived) says 1 request,
#                    like ranks 1 and 2 -> E0 F1 G2
# total_tokens:      A0 B1 C2 | zeros again -> D0 | tokens (1001, 101, 101) -> E1 (tie with 2, lowest),
#                    F2 (111 vs 101), G1 (111, 111: requests tie too, lowest index)
# inflight_requests: rotation starts after the last pick: A0 B1 C2 | snapshot 0 + in flight (1,1,1),
#                    start 0 -> D0 | rank 0: snapshot 1 + D in flight = 2; (2,1,1) from 1 -> E1, F2, G0
# inflight_tokens:   A0 B1 C2 | 0 + in flight (1000,100,100) from 0 -> D1 | rank 1: 101 + D's 100 = 201,
#                    rank 2: 101, scanning from 2 -> E2 (111), F2 (121), G2 (131)
# inflight_backlog:  keys (queued tokens, total tokens), both with in flight added; rotation as above:
#                    A0 B1 C2 | (1000,1000) (100,100) (100,100) from 0 -> D1 | rank 0 (0, 1001),
#                    rank 1 (0 + D's 100, 201), rank 2 (0, 101), from 2 -> E2, now (10, 111); from 0:
#                    rank 0's queue is empty -> F0, now (10, 1011); from 1 -> G2 (10, 111) over rank 0
# vllm (one API server): score max(in flight, waiting + running), scan start moving on after each pick:
#                    A0 B1 C2 (all 0), D from 0: (1,1,1) -> D0 | the coordinator published at 0.1 s
#                    (waiting, running) = (0,1) on every rank; in flight (2,1,1): from 1 -> E1 (1),
#                    from 2 -> F2 (1; rank 1 is now 2), from 0: (2,2,2) -> G0
# cache_aware:       no block ids, so always its least-in-flight worker, ties to the first:
#                    A0 B1 C2 D0 | nothing finished yet: (2,1,1) -> E1, F2, then (2,2,2) -> G0
# (dynamo_kv breaks ties at random, so it is worked by hand on its own in test_peers.py)
HAND_EXPECTED = {
    "round_robin": [0, 1, 2, 0, 1, 2, 0],
    "total_requests": [0, 1, 2, 0, 0, 1, 2],
    "total_tokens": [0, 1, 2, 0, 1, 2, 1],
    "inflight_requests": [0, 1, 2, 0, 1, 2, 0],
    "inflight_tokens": [0, 1, 2, 1, 2, 2, 2],
    "vllm:api_servers=1": [0, 1, 2, 0, 1, 2, 0],
    "cache_aware": [0, 1, 2, 0, 1, 2, 0],
    "inflight_backlog": [0, 1, 2, 1, 2, 0, 2],
}


@pytest.mark.parametrize("method", list(HAND_EXPECTED))
def test_hand_computed_assignment(method):
    # a prefill takes 1 ms whatever its size, a decode step 1 s: the picks alone decide the times
    rank = RankConfig(kv_capacity=100_000, prefill_base_s=0.001, prefill_s_per_token=0.0, decode_base_s=1.0,
                      decode_s_per_kv_token=0.0)
    config = SimConfig(
        n_ranks=3,
        rank=rank,
        publish=PublishConfig(cadence="step", idle_publish_s=0.01),
        send_delay_s=0.03,
        refresh_interval_s=0.02,
    )
    trace = hand_trace(
        [0.010, 0.011, 0.012, 0.031, 0.550, 0.551, 0.552],
        [1000, 100, 100, 100, 10, 10, 10],
        [3] * 7,
        ranks=3,
    )
    (result,) = simulate(trace, [method], config)
    assert [r.rank for r in result.requests] == HAND_EXPECTED[method]


# -- the throttle and speculative updates ---------------------------------------------------------


def burst_ranks(method: str, *, refresh_interval: float) -> Counter:
    # 64 requests within 2 ms on 4 idle ranks; they reach their rank 5 ms later. The ranks publish
    # all the time while idle (every 10 us; SGLang's idle loop publishes on every pass), so every
    # read of the board sees a new snapshot of an empty rank until the burst arrives.
    n = 64
    trace = hand_trace(
        list(0.1 + np.arange(n) * (0.002 / n)),
        [500] * n,
        [1] * n,
        ranks=4,
    )
    config = SimConfig(
        n_ranks=4,
        publish=PublishConfig(cadence="step", idle_publish_s=1e-5),
        send_delay_s=0.005,
        refresh_interval_s=refresh_interval,
    )
    (result,) = simulate(trace, [method], config)
    return Counter(r.rank for r in result.requests)


@pytest.mark.parametrize("method", ["total_requests", "total_tokens"])
def test_without_throttle_and_speculation_a_burst_lands_on_one_rank(method):
    # Refreshing before every pick lets each fresh (but empty) snapshot overwrite the speculative
    # charges, which is the same as having none: every request of the burst sees four idle ranks.
    assert burst_ranks(method, refresh_interval=0.0) == Counter({0: 64})
    # With SGLang's 20 ms throttle the speculative +1 / +tokens spread the burst evenly.
    assert burst_ranks(method, refresh_interval=0.02) == Counter({0: 16, 1: 16, 2: 16, 3: 16})


@pytest.mark.parametrize("method", ["inflight_requests", "inflight_tokens", "inflight_backlog"])
def test_inflight_accounting_spreads_a_burst_even_without_the_throttle(method):
    # A fresh snapshot that has not seen the burst yet cannot erase it: what is in flight is added.
    assert burst_ranks(method, refresh_interval=0.0) == Counter({0: 16, 1: 16, 2: 16, 3: 16})


# -- vLLM's score, on its own ---------------------------------------------------------------------


class FakeRank:
    """What vLLM's engine reports of a rank: its queues and KV usage."""

    def __init__(self, rank: int, waiting: int, running: int, kv: float = 0.0):
        self.rank, self.num_waiting, self.num_running, self.kv_usage = rank, waiting, running, kv


class FakeRequest:
    _next = 0

    def __init__(self, rank: int = -1):
        FakeRequest._next += 1
        self.rid = FakeRequest._next
        self.routed_dp_rank = None
        self.rank = rank


def send(policy, req=None):
    req = req or FakeRequest()
    req.rank = policy.dispatch(req)
    return req


def test_vllm_scores_inflight_floor_rotation_and_kv_penalty():
    now = [0.0]
    policy = VllmPolicy(3, lambda: now[0], stats_interval_s=0.1, api_servers=1)
    # The engines report (waiting, running, kv); the coordinator publishes them at its tick.
    for rank in (FakeRank(0, 2, 3, kv=0.9), FakeRank(1, 0, 4), FakeRank(2, 1, 1, kv=0.75)):
        policy.on_rank_step(rank, 0.0)
    policy.on_tick(0.0, [])
    # scores: rank 0 = max(0, 5) + 2 * 6 * 0.4 = 9.8; rank 1 = 4; rank 2 = max(0, 2) + 1 * 6 * 0.25 = 3.5
    assert send(policy).rank == 2
    # rank 2 now waits 2 locally: 3 + 2 * 1.5 = 6; rank 1 = 4 (scan starts at 1 now) -> 1
    assert send(policy).rank == 1
    counts = policy.counts[0]
    assert counts[1][0] == 1 and counts[2][0] == 2 and policy.inflight == [[0, 1, 1]]
    # rank 1 = max(1, 5) = 5, rank 2 = 6, rank 0 = 9.8; scan starts at 2 -> rank 1
    assert send(policy).rank == 1
    assert policy.start == [0]


def test_vllm_inflight_floor_survives_a_stale_publication():
    now = [0.0]
    policy = VllmPolicy(2, lambda: now[0], stats_interval_s=0.1, api_servers=1)
    sent = [send(policy) for _ in range(4)]
    assert [r.rank for r in sent] == [0, 1, 0, 1] and policy.inflight == [[2, 2]]
    # The engines still report empty queues (the requests have not arrived): the publication wipes the
    # local waiting counts, but not the client's own in-flight counts.
    for rank in (FakeRank(0, 0, 0), FakeRank(1, 0, 0)):
        policy.on_rank_step(rank, 0.05)
    policy.on_tick(0.1, [])
    now[0] = 0.1
    assert send(policy).rank == 0  # (2, 2): a tie, first scanned (the start is back at 0)
    assert policy.counts == [[[1, 0, 0.0], [0, 0, 0.0]]] and policy.inflight == [[3, 2]]
    assert send(policy).rank == 1
    # a finish drops the floor
    policy.on_finish(sent[0])
    policy.on_finish(sent[2])
    assert policy.inflight == [[1, 3]]


def test_vllm_coordinator_publishes_only_changes():
    now = [0.0]
    policy = VllmPolicy(2, lambda: now[0], stats_interval_s=0.1, delay_s=0.01, api_servers=1)
    policy.on_rank_step(FakeRank(0, 3, 1), 0.0)
    policy.on_tick(0.0, [])
    assert len(policy._pending) == 1
    # the same counts again are not a change; a kv change alone is not either (vLLM publishes on
    # (running, waiting) changes)
    policy.on_rank_step(FakeRank(0, 3, 1, kv=0.8), 0.05)
    policy.on_tick(0.1, [])
    assert len(policy._pending) == 1
    now[0] = 0.005  # not visible yet
    assert send(policy).rank == 0 and policy.counts[0][0][0] == 1
    now[0] = 0.2
    send(policy)
    assert policy.counts[0][0][:2] == [3, 1]


def test_vllm_serve_runs_one_balancer_per_rank_each_blind_to_the_others_in_flight():
    """vllm serve --data-parallel-size 4 (internal LB): api_server_count = 4 (cli/serve.py), each
    server a DPLBAsyncMPClient with client_count 4 and start index 4 * client_index // 4
    (core_client.py). Each scores max(4 * its own in flight, waiting + running) on the same 100 ms
    counts, and adds client_count (4) to its local waiting count of the engine it picks."""
    now = [0.0]
    policy = VllmPolicy(4, lambda: now[0], api_servers=4, seed=0)
    assert policy.client_count == 4 and policy.start == [0, 1, 2, 3]
    for rank in (FakeRank(0, 0, 2), FakeRank(1, 0, 1), FakeRank(2, 0, 1), FakeRank(3, 0, 3)):
        policy.on_rank_step(rank, 0.0)
    policy.on_tick(0.0, [])
    # Put the next requests on servers 0 and 1 by hand (the kernel's choice is random).
    servers = iter([0, 1, 0, 1])
    policy._rng.randrange = lambda n: next(servers)
    # server 0, scan from 0: scores (2, 1, 1, 3) -> rank 1 (first of the tie scanned); it now
    # counts rank 1 as 4 waiting: 4 + 1 = 5
    a = send(policy)
    assert a.rank == 1 and policy.counts[0][1][0] == 4
    # server 1 knows nothing of that pick: scan from 1, scores (2, 1, 1, 3) -> rank 1 again
    b = send(policy)
    assert b.rank == 1 and policy.inflight == [[0, 1, 0, 0], [0, 1, 0, 0], [0] * 4, [0] * 4]
    # server 0 again, scan from 1: rank 1 = max(4 * 1, 4 + 1) = 5, rank 2 = 1 -> rank 2
    assert send(policy).rank == 2
    # server 1, scan from 2: rank 2 = 1 in its view (it did not send there) -> rank 2 too
    assert send(policy).rank == 2
    policy.on_finish(b)
    assert policy.inflight[1] == [0, 0, 1, 0]


def test_sim_board_delays_visibility():
    now = [0.0]
    board = SimBoard(2, lambda: now[0], delay_s=0.005)
    from dpboard.snapshot import LoadSnapshot

    board.publish(1, LoadSnapshot(dp_rank=1, num_waiting_reqs=3), 0.0)
    assert board.read_all() == [None, None]
    now[0] = 0.005
    assert board.read_all()[1].num_waiting_reqs == 3


# -- bad input ------------------------------------------------------------------------------------


def test_bad_methods_and_settings_are_named():
    trace = small_trace(duration=0.5)
    with pytest.raises(ValueError, match="unknown dispatch method 'fastest'") as bad:
        Simulation(trace, "fastest", SimConfig(n_ranks=4))
    # the message names one list, and every name in it is a method the simulation runs
    listed = str(bad.value).split("use one of ", 1)[1].split(", ")
    assert "auto" in listed and "inflight_ttft" in listed and "dynamo_kv" in listed
    assert "expected one of" not in str(bad.value)
    for name in listed:
        Simulation(trace, name, SimConfig(n_ranks=4))
    with pytest.raises(ValueError, match="Dispatcher has no option 'turbo'"):
        Simulation(trace, "total_tokens:turbo=1", SimConfig(n_ranks=4))
    with pytest.raises(ValueError, match="not key=value"):
        parse_method_spec("total_tokens:refresh_interval")
    with pytest.raises(ValueError, match="unknown publish cadence"):
        Simulation(trace, "vllm", SimConfig(n_ranks=4, publish=PublishConfig(cadence="sometimes")))
    with pytest.raises(ValueError, match="trace was drawn for 4 ranks"):
        Simulation(trace, "vllm", SimConfig(n_ranks=8))
    with pytest.raises(ValueError, match="KV capacity"):
        Simulation(trace, "vllm", SimConfig(n_ranks=4, rank=RankConfig(kv_capacity=1000)))
    with pytest.raises(ValueError, match="unknown trace 'calm'"):
        scenario("calm")
    with pytest.raises(RuntimeError, match="did not drain"):
        Simulation(trace, "vllm", SimConfig(n_ranks=4, drain_limit_s=0.01)).run()
    with pytest.raises(ValueError, match="--queued-prefill 'cached'"):
        Simulation(trace, "vllm", SimConfig(n_ranks=4, queued_prefill="cached"))
    with pytest.raises(ValueError, match="vllm api_servers must be >= 1"):
        Simulation(trace, "vllm:api_servers=0", SimConfig(n_ranks=4))
    with pytest.raises(ValueError, match="block_size must divide"):
        Simulation(trace, "dynamo_kv:block_size=24", SimConfig(n_ranks=4))


# -- the command ----------------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "sim", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_prints_table_and_writes_json_and_plot(tmp_path: Path):
    out_json = tmp_path / "sim.json"
    out_png = tmp_path / "sim.png"
    proc = run_cli(
        "--trace", "bursty", "--ranks", "4", "--duration", "3", "--seed", "2",
        "--methods", "total_tokens,vllm,inflight_tokens,total_tokens:refresh_interval=0",
        "--json", str(out_json), "--plot", str(out_png),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| method | p50 TTFT ms | p99 TTFT ms" in proc.stdout
    for name in ("total_tokens", "vllm", "inflight_tokens", "total_tokens:refresh_interval=0"):
        assert f"| {name} |" in proc.stdout
    doc = json.loads(out_json.read_text())
    assert [run["summary"]["method"] for run in doc["runs"]] == [
        "total_tokens", "vllm", "inflight_tokens", "total_tokens:refresh_interval=0",
    ]  # fmt: skip
    assert doc["trace"]["n_ranks"] == 4 and doc["trace"]["seed"] == 2
    for run in doc["runs"]:
        s = run["summary"]
        assert s["requests"] == doc["trace"]["requests"]
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"]
        assert s["imbalance_mean"] >= 1.0 and not math.isnan(s["imbalance_p99"])
        assert len(run["imbalance_series"]["t_s"]) == len(run["imbalance_series"]["max_over_mean"]) > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_method_exits_1_with_the_name():
    proc = run_cli("--quick", "--methods", "total_tokens,warp_speed")
    assert proc.returncode == 2
    assert "warp_speed" in proc.stderr and "inflight_tokens" in proc.stderr


def test_a_method_can_name_its_own_cadence():
    trace = small_trace(seed=5)
    sglang = SimConfig(n_ranks=4, publish=PublishConfig(cadence="sglang"))
    step = SimConfig(n_ranks=4, publish=PublishConfig(cadence="step"))
    (own,) = simulate(trace, ["total_tokens:cadence=step"], sglang)
    (plain_step,) = simulate(trace, ["total_tokens"], step)
    (plain_sglang,) = simulate(trace, ["total_tokens"], sglang)
    assert own.method == "total_tokens:cadence=step"
    assert outcome(own) == outcome(plain_step)
    assert own.publishes == plain_step.publishes > plain_sglang.publishes


def test_compare_methods_example_runs():
    example = Path(__file__).resolve().parents[2] / "examples" / "compare_methods.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--trace", "steady", "--ranks", "2", "--seeds", "2",
         "--methods", "total_tokens,vllm,inflight_backlog"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "seeds 0..1" in proc.stdout
    for name in ("total_tokens", "vllm", "inflight_backlog"):
        assert f"| {name} |" in proc.stdout
    assert "best dpboard method by p99 TTFT: inflight_backlog" in proc.stdout


def conversation_trace_file(path: Path, conversations: int = 30, turns: int = 4) -> Path:
    """A Mooncake-format file of multi-turn conversations: every prompt starts with one shared block
    (a system prompt), and each turn's blocks extend the turn before it."""
    rows = []
    next_id = 1
    for c in range(conversations):
        ids = [0]
        for turn in range(turns):
            ids = ids + list(range(next_id, next_id + 2))
            next_id += 2
            rows.append({"timestamp": 200 * c + 2000 * turn, "input_length": 512 * len(ids) - 100,
                         "output_length": 30 + 7 * (c % 5), "hash_ids": ids})
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def index_table(stdout: str) -> dict[str, list[float]]:
    """The --index-check table: label -> its six shares, in percent."""
    rows = {}
    part = stdout.split("prefix index against the ranks' caches", 1)[1]
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[1].endswith("%"):
            rows[cells[0]] = [float(c.rstrip("%")) for c in cells[1:]]
    return rows


def test_compare_methods_index_check(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "compare_methods.py"
    trace = conversation_trace_file(tmp_path / "conv.jsonl")
    proc = subprocess.run(
        [sys.executable, str(example), "--trace-file", str(trace), "--ranks", "4", "--load", "0.8", "--seeds", "1",
         "--methods", "inflight_backlog,inflight_cache", "--index-check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for label in ("inflight_cache", "inflight_cache (exact caches)", "inflight_cache (index seeded with the shared prefix)"):
        assert f"| {label} |" in proc.stdout
    rows = index_table(proc.stdout)
    assert set(rows) == {"inflight_cache", "inflight_cache (exact caches)",
                         "inflight_cache (index seeded with the shared prefix)"}  # fmt: skip
    believed, held, over, under, left_known, left_unknown = rows["inflight_cache"]
    assert held > 0  # follow-up turns found their conversation's blocks
    assert believed - over + under == pytest.approx(held, abs=0.2)  # one decimal per printed share
    assert min(over, under, left_known, left_unknown) >= 0.0
    # the exact variant reads the caches themselves: it believes what they hold, and knows all reuse
    believed, held, over, under, left_known, left_unknown = rows["inflight_cache (exact caches)"]
    assert believed == held and over == under == left_unknown == 0.0


def test_compare_methods_index_check_needs_an_index():
    example = Path(__file__).resolve().parents[2] / "examples" / "compare_methods.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--trace", "steady", "--ranks", "2", "--seeds", "1",
         "--methods", "inflight_backlog,dynamo_kv", "--index-check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--index-check needs a method that keeps a prefix index" in proc.stderr


def test_vllm_board_is_every_api_server_reading_the_board_at_each_pick():
    trace = hand_trace([0.01, 0.02, 0.03], [100, 200, 300], [2, 2, 2], ranks=2)
    sim = Simulation(trace, "vllm_board", SimConfig(n_ranks=2))
    dispatcher = sim.policy.dispatcher
    assert dispatcher.method.value == "inflight_ttft" and dispatcher.refresh_interval == 0
    assert sim.config.publish.cadence == "step"  # the engines publish from their schedulers every step
    other = Simulation(trace, "vllm_board:method=inflight_backlog", SimConfig(n_ranks=2))
    assert other.policy.dispatcher.method.value == "inflight_backlog"
    assert len(sim.run().requests) == 3
