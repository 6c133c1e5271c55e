"""PD disaggregation in dpboard sim (dpboard.sim.pd, dpboard.sim.transfer): hand-worked cases.

Rank model: prefill step 10 ms + 100 us per token, decode step 10 ms + 1 ms per request, no KV
term; a transfer costs 5 ms + 1 ms per prompt token (1000 B per token over 1 MB/s).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.model import DECODE_ROLE, PREFILL_ROLE, RankModel, SimRequest
from dpboard.sim.pd import PdSimulation, bootstrap_rooms, simulate_any, split_pd_method
from dpboard.sim.profile import load_profile
from dpboard.sim.report import summarize
from dpboard.sim.simulation import SimConfig
from dpboard.sim.trace import TraceSpec, generate_trace, scenario
from dpboard.sim.transfer import PdConfig, parse_pd
from tests.support import traces

RANK = traces.HAND_RANK


def pd_config(p: int = 1, d: int = 1, **kw) -> SimConfig:
    pd = PdConfig(p, d, kv_bytes_per_token=1000.0, kv_link_bytes_per_s=1e6, kv_transfer_base_s=0.005,
                  bootstrap_rtt_s=0.002)  # fmt: skip
    return SimConfig(n_ranks=p + d, rank=RANK, send_delay_s=0.0, pd=pd, **kw)


def hand(arrivals, prompts, outputs, ranks):
    return traces.hand_trace(arrivals, prompts, outputs, ranks=ranks, spec=TraceSpec(name="hand"))


def test_ttft_includes_the_kv_transfer_and_decode_starts_after_it():
    # t=0: the decode rank pre-allocates at once (it is idle), so the prefill rank prefills at once:
    # 10 + 0.1 * 1000 = 110 ms; the transfer takes 5 + 1000 * 1 = 1005 ms; the first token reaches
    # the client with the KV, then two decode steps of 11 ms give the other two tokens.
    (result,) = simulate_any(hand([0.0], [1000], [3], 2), ["follow_bootstrap_room/round_robin"], pd_config())
    (req,) = result.requests
    assert req.prefilled_s == pytest.approx(0.110)
    assert req.kv_ready_s == pytest.approx(0.110 + 1.005)
    assert req.first_token_s - req.arrival_s == pytest.approx(0.110 + 1.005)
    assert req.finished_s == pytest.approx(1.115 + 2 * 0.011)
    s = summarize(result)
    assert s["method"] == "follow_bootstrap_room/round_robin"
    assert s["transfer_p50_ms"] == pytest.approx(1005.0)
    assert s["ttft_p50_ms"] == pytest.approx(1115.0)


def test_a_load_aware_prefill_pays_the_bootstrap_round_trips():
    # round_robin on the prefill side registers its pick, the decode side asks for it: 2 x 2 ms
    # before the decode rank can pre-allocate and the prefill can start.
    (follow,) = simulate_any(hand([0.0], [1000], [3], 2), ["follow_bootstrap_room/round_robin"], pd_config())
    (queried,) = simulate_any(hand([0.0], [1000], [3], 2), ["round_robin/round_robin"], pd_config())
    assert follow.pd["bootstrap_query"] is False and queried.pd["bootstrap_query"] is True
    delay = queried.requests[0].first_token_s - follow.requests[0].first_token_s
    assert delay == pytest.approx(0.004)


def test_a_second_transfer_waits_for_the_prefill_ranks_link():
    # Two 1000-token prompts at t=0: A's reservation reaches the prefill rank first, so A is
    # prefilled alone (0-110 ms), then B (110-220 ms). A's KV is on the link until 1115 ms, X
    # transfer starts then, not at 220 ms.
    trace = hand([0.0, 0.0], [1000, 1000], [2, 2], 3)
    (result,) = simulate_any(trace, ["follow_bootstrap_room/round_robin"], pd_config(1, 2))
    a, b = sorted(result.requests, key=lambda r: r.kv_ready_s)
    assert a.prefilled_s == pytest.approx(0.110) and b.prefilled_s == pytest.approx(0.220)
    assert a.kv_ready_s == pytest.approx(0.110 + 1.005)
    assert b.kv_ready_s == pytest.approx(0.110 + 2 * 1.005)
    assert {a.rank, b.rank} == {0, 1}  # round robin over the decode pool


def test_num_active_tokens_leaves_out_the_kv_still_in_transfer():
    rank = RankModel(0, RANK, role=DECODE_ROLE)
    req = SimRequest(0, 0.0, 1000, 5)
    rank.receive_remote(req, 0.0)
    snap = rank.snapshot(0.0, 1)
    # pre-allocation queue: a waiting request whose seqlen counts in the total, none of it active
    assert (snap.num_waiting_reqs, snap.num_used_tokens, snap.num_total_tokens, snap.num_active_tokens) == (1, 0, 1000, 0)
    assert rank.preallocate() == [req]
    snap = rank.snapshot(0.1, 2)
    # transfer queue: its KV (prompt + first token) is reserved, so used; still awaiting its KV
    assert (snap.num_waiting_reqs, snap.num_used_tokens, snap.num_total_tokens, snap.num_active_tokens) == (1, 1001, 1001, 1)
    assert rank.kv_arrived(req, 0.5) == 0
    snap = rank.snapshot(0.5, 3)
    assert (snap.num_waiting_reqs, snap.num_total_tokens, snap.num_active_tokens) == (0, 1001, 1001)
    assert rank.begin_step(0.5) == pytest.approx(0.011)  # it decodes from the next step


def test_a_prefill_ranks_bootstrap_queue_counts_as_waiting():
    rank = RankModel(0, RANK, role=PREFILL_ROLE)
    req = SimRequest(0, 0.0, 700, 5)
    rank.hold(req)
    snap = rank.snapshot(0.0, 1)
    assert (snap.num_waiting_reqs, snap.num_total_tokens, snap.num_received_reqs) == (1, 700, 1)
    assert rank.begin_step(0.0) is None  # nothing to prefill before the decode side has reserved
    rank.release(req, 0.1)
    assert rank.snapshot(0.1, 2).num_received_reqs == 1
    assert rank.begin_step(0.1) == pytest.approx(0.080)
    rank.end_step(0.18)
    assert rank.handed_off == [req] and req.prefilled_s == pytest.approx(0.18)
    assert rank.total_tokens == 0 and req.first_token_s < 0  # its first token leaves with the KV


def test_follow_bootstrap_room_on_random_rooms_is_a_uniform_hash():
    # 4000 requests on 8 prefill ranks: following the room puts each on room % 8, and the counts
    # spread as a uniform hash's do (chi-square with 7 degrees of freedom between its 0.1 % and
    # 99.9 % points), where round robin gives every rank exactly 500.
    n, p = 4000, 8
    trace = traces.hand_trace(
        np.linspace(0, 200, n), [200] * n, [2] * n, ranks=2 * p, spec=TraceSpec(name="flat")
    )  # fmt: skip
    follow, rr = simulate_any(trace, ["follow_bootstrap_room/round_robin", "round_robin"], pd_config(p, p))
    rooms = np.asarray(bootstrap_rooms(n, trace.seed), dtype=np.uint64)
    assert rooms.max() < 2**63
    counts = np.asarray(follow.pd["prefill_requests_per_rank"])
    assert counts.tolist() == np.bincount((rooms % p).astype(np.int64), minlength=p).tolist()
    chi2 = float(((counts - n / p) ** 2 / (n / p)).sum())
    assert 0.60 < chi2 < 24.3
    assert rr.pd["prefill_requests_per_rank"] == [n // p] * p
    assert counts.max() > n // p


def test_pd_runs_are_deterministic_per_seed_and_lockstep_pools_count_idle_steps():
    profile = load_profile("deepseek-v3-dp-attention-h100")
    config = SimConfig(n_ranks=6, rank=profile.rank, lockstep=profile.lockstep, pd=profile.pd(2, 4))
    trace = generate_trace(scenario("steady").scaled(duration_s=3.0, load=0.05), 6, 1)
    methods = ["auto", "total_tokens", "inflight_ttft:cadence=step/round_robin", "dynamo_kv/vllm"]
    first = simulate_any(trace, methods, config)
    again = simulate_any(trace, methods, config)
    for a, b in zip(first, again, strict=True):
        assert [(r.rank, r.prefill_rank, r.first_token_s, r.finished_s) for r in a.requests] == [
            (r.rank, r.prefill_rank, r.first_token_s, r.finished_s) for r in b.requests
        ]
        assert a.idle_rank_steps > 0
        assert all(r.first_token_s > r.prefilled_s > r.arrival_s for r in a.requests)
    assert [summarize(r)["method"] for r in first] == [
        "follow_bootstrap_room/round_robin", "total_tokens/total_tokens",
        "inflight_ttft:cadence=step/round_robin", "dynamo_kv/vllm",
    ]  # fmt: skip


def test_method_pairs_and_pd_arguments():
    assert split_pd_method("auto") == ("follow_bootstrap_room", "round_robin")
    assert split_pd_method("follow_bootstrap_room") == ("follow_bootstrap_room", "round_robin")
    assert split_pd_method("total_tokens:cadence=sglang") == ("total_tokens:cadence=sglang",) * 2
    assert split_pd_method("a/b") == ("a", "b")
    with pytest.raises(InvalidInputError, match="PREFILL/DECODE"):
        split_pd_method("total_tokens/")
    assert parse_pd("8:16") == (8, 16)
    for bad in ("8", "0:4", "x:y", "8:"):
        with pytest.raises(InvalidInputError, match="--pd"):
            parse_pd(bad)
    with pytest.raises(InvalidInputError, match="SimConfig.pd"):
        PdSimulation(hand([0.0], [10], [2], 2), "auto", SimConfig(n_ranks=2, rank=RANK))
    with pytest.raises(InvalidInputError, match="--pd 1:1 is 2 ranks"):
        SimConfig(n_ranks=3, rank=RANK, pd=PdConfig(1, 1)).validate()


def test_cli_pd_names_both_methods():
    proc = subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "sim", "--trace", "steady", "--pd", "1:2", "--duration", "0.5",
         "--load", "0.1", "--methods", "auto,total_tokens/round_robin"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| follow_bootstrap_room/round_robin |" in proc.stdout
    assert "| total_tokens/round_robin |" in proc.stdout
    assert "3 ranks" in proc.stdout and "PD 1 prefill : 2 decode" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "dpboard.cli", "sim", "--trace", "steady", "--pd", "1:2", "--ranks", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "leave --ranks out with --pd" in bad.stderr


def test_compare_methods_runs_pd_and_lockstep_cells(tmp_path):
    import json
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "compare_methods.py"
    out = tmp_path / "cell.json"
    proc = subprocess.run(
        [sys.executable, str(example), "--trace", "steady", "--load", "0.05", "--pd", "1:2", "--dp-attention",
         "--seeds", "2", "--methods", "auto,total_tokens", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "PD 1:2, lockstep (DP attention)" in proc.stdout and "goodput req/s" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["pd"] == "1:2" and doc["dp_attention"] is True
    runs = doc["runs"]["auto"]
    assert len(runs) == 2 and runs[0]["method"] == "follow_bootstrap_room/round_robin"
    assert all(r["idle_rank_step_share"] > 0 and r["goodput_rps"] > 0 for r in runs)
