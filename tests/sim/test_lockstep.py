"""DP attention's lockstep (dpboard.sim.stepping) and the decode metrics: hand-worked cases.

The rank model of these cases (no KV term, whole prompts in one step):

    prefill step = 10 ms + 100 us per token     decode step = 10 ms + 1 ms per request
    lockstep: the routed experts are 40 us of a prompt token and 0.5 ms of a decode token, spread
    over the group; a decode batch run without its CUDA graph pays 5 ms more.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.model import DECODE, IDLE, PREFILL, RankModel, SimRequest
from dpboard.sim.profile import load_profile
from dpboard.sim.report import goodput_mask, summarize, tpot_s
from dpboard.sim.simulation import SimConfig, simulate
from dpboard.sim.stepping import LockstepCost, RankGroup
from dpboard.sim.trace import TraceSpec, generate_trace, scenario
from tests.support import traces

RANK = dataclasses.replace(traces.HAND_RANK, max_prefill_tokens=16384)
COST = LockstepCost(moe_prefill_s_per_token=40e-6, moe_decode_s_per_token=0.5e-3, eager_decode_s=0.005)


def lockstep_config(n_ranks: int = 2, **kw) -> SimConfig:
    # the hand-worked cases take each request into the step after it arrives (no overlap scheduler)
    kw.setdefault("overlap_schedule", False)
    return SimConfig(n_ranks=n_ranks, rank=RANK, lockstep=COST, send_delay_s=0.0, **kw)


def hand(arrivals, prompts, outputs, ranks=2):
    return traces.hand_trace(arrivals, prompts, outputs, ranks=ranks, spec=TraceSpec(name="hand"))


def test_a_decode_rank_beside_a_long_prefill_waits_for_it_and_runs_without_its_graph():
    # A (10 tokens, 3 out) on rank 0 at t=0; B (5000 tokens, 2 out) on rank 1 at 15 ms, during A's
    # first decode step.
    #   step 1 at 0:       A prefills, rank 1 idle: 10 + 0.06 * 10 + 0.04 * 10 / 2 = 10.8 ms
    #   step 2 at 10.8:    A decodes, rank 1 idle: 10 + 0.5 + 0.5 / 2 = 10.75 ms
    #   step 3 at 21.55:   A decodes (no graph: + 5 ms) beside B's prefill of 5000 tokens:
    #                      10 + max(0.06 * 5000, 0.5 + 5) + (0.04 * 5000 + 0.5) / 2 = 410.25 ms
    #   step 4 at 431.8:   B decodes, rank 0 idle: 10.75 ms
    (result,) = simulate(hand([0.0, 0.015], [10, 5000], [3, 2]), ["round_robin"], lockstep_config())
    a, b = result.requests
    assert (a.rank, b.rank) == (0, 1)
    assert a.first_token_s == pytest.approx(0.0108)
    extend_step = 0.010 + 0.06e-3 * 5000 + (0.04e-3 * 5000 + 0.5e-3) / 2
    assert extend_step == pytest.approx(0.41025)
    # A's last decode step is the one B's prefill set: it ends with B's first token
    assert a.finished_s == pytest.approx(0.0108 + 0.01075 + extend_step)
    assert a.finished_s == pytest.approx(b.first_token_s)
    assert b.finished_s == pytest.approx(b.first_token_s + 0.01075)
    assert result.group_steps == 4 and result.rank_steps == 8
    assert result.extend_steps == 2  # A's prefill, B's prefill
    assert result.eager_decode_rank_steps == 1  # A's decode in B's prefill step
    assert result.idle_rank_steps == 3  # rank 1 in steps 1-2, rank 0 in step 4
    s = summarize(result)
    assert s["idle_rank_step_share"] == pytest.approx(3 / 8)
    assert s["lockstep"] is True
    # The same requests on independent ranks: A never waits for B
    independent = SimConfig(n_ranks=2, rank=RANK, send_delay_s=0.0)
    (alone,) = simulate(hand([0.0, 0.015], [10, 5000], [3, 2]), ["round_robin"], independent)
    a_alone = alone.requests[0]
    assert a_alone.finished_s == pytest.approx(0.011 + 2 * 0.011)
    assert alone.idle_rank_steps == 0 and alone.rank_steps == alone.group_steps
    assert tpot_s(result)[0] == pytest.approx((0.01075 + extend_step) / 2)
    assert tpot_s(alone)[0] == pytest.approx(0.011)


def test_an_idle_rank_in_a_busy_group_runs_idle_steps_and_an_idle_group_does_not_step():
    # One request on rank 0 of three (prompt 100, 5 out), another 10 s later: each is one prefill
    # step and four decode steps; ranks 1 and 2 run an idle batch in every one of them, and nobody
    # steps in the 10 s between.
    trace = hand([0.0, 10.0], [100, 100], [5, 5], ranks=3)
    (result,) = simulate(trace, ["total_tokens"], lockstep_config(3))
    assert [r.rank for r in result.requests] == [0, 0]
    assert result.group_steps == 10
    assert result.rank_steps == 30
    assert result.idle_rank_steps == 20
    assert summarize(result)["idle_rank_step_share"] == pytest.approx(20 / 30)


def test_balanced_ranks_step_as_one_rank_alone():
    # With every rank holding the same batch the lockstep step is the independent rank's step.
    group_ranks = [RankModel(r, RANK) for r in range(4)]
    group = RankGroup(0, group_ranks, COST)
    solo = RankModel(9, RANK)
    for i, rank in enumerate([*group_ranks, solo]):
        rank.receive(SimRequest(i, 0.0, 700, 50), 0.0)
    prefill = solo.begin_step(0.0)
    assert group.begin(0.0) == pytest.approx(prefill)
    assert all(rank.state == PREFILL for rank in group_ranks)
    group.end(prefill)
    solo.end_step(prefill)
    decode = solo.begin_step(prefill)
    assert solo.state == DECODE
    assert group.begin(prefill) == pytest.approx(decode)
    assert group.idle_rank_steps == 0 and group.eager_decode_rank_steps == 0


def test_a_group_with_nothing_to_do_does_not_step():
    group = RankGroup(0, [RankModel(r, RANK) for r in range(2)], COST)
    assert group.begin(0.0) is None
    assert not group.busy and group.steps == 0
    assert all(rank.state == IDLE for rank in group.ranks)


def test_lockstep_costs_are_checked():
    with pytest.raises(InvalidInputError, match="moe_prefill_token_us"):
        LockstepCost(moe_prefill_s_per_token=200e-6).validate(RANK)
    with pytest.raises(InvalidInputError, match="moe_decode_token_us"):
        LockstepCost(moe_decode_s_per_token=2e-3).validate(RANK)
    with pytest.raises(InvalidInputError, match="eager_decode_s"):
        LockstepCost(eager_decode_s=-1.0).validate(RANK)
    with pytest.raises(InvalidInputError, match="independent ranks"):
        RankGroup(0, [RankModel(0, RANK), RankModel(1, RANK)])


def test_goodput_counts_only_requests_meeting_both_slos():
    # From the first case: A has TTFT 10.8 ms and TPOT 210.5 ms; B has TTFT 416.8 ms and TPOT
    # 10.75 ms; the run spans 0 to B's finish.
    trace = hand([0.0, 0.015], [10, 5000], [3, 2])
    cases = {
        (0.1, 0.1): [False, False],  # A misses TPOT, B misses TTFT
        (0.5, 0.1): [False, True],
        (0.1, 0.3): [True, False],
        (0.5, 0.3): [True, True],
    }
    for (ttft, tpot), expected in cases.items():
        (result,) = simulate(trace, ["round_robin"], lockstep_config(slo_ttft_s=ttft, slo_tpot_s=tpot))
        assert goodput_mask(result).tolist() == expected
        s = summarize(result)
        span = result.requests[1].finished_s
        assert s["goodput_rps"] == pytest.approx(sum(expected) / span)
        assert s["output_tokens_per_s"] == pytest.approx(5 / span)


def test_one_token_answers_have_no_tpot_to_miss():
    (result,) = simulate(hand([0.0], [10], [1], ranks=1), ["round_robin"], lockstep_config(1, slo_tpot_s=1e-6))
    assert tpot_s(result).size == 0
    assert goodput_mask(result).tolist() == [True]


def test_lockstep_runs_are_deterministic_per_seed():
    profile = load_profile("deepseek-v3-dp-attention-h100")
    assert profile.dp_attention
    config = SimConfig(n_ranks=4, rank=profile.rank, lockstep=profile.lockstep)
    trace = generate_trace(scenario("bursty").scaled(duration_s=2.0, load=0.3), 4, 5)
    methods = ["round_robin", "total_tokens", "vllm", "dynamo_kv", "inflight_ttft"]
    first = simulate(trace, methods, config)
    again = simulate(trace, methods, config)
    for a, b in zip(first, again, strict=True):
        assert [(r.rank, r.first_token_s, r.finished_s) for r in a.requests] == [
            (r.rank, r.first_token_s, r.finished_s) for r in b.requests
        ], a.method
        sa, sb = summarize(a), summarize(b)
        sa.pop("wall_s"), sb.pop("wall_s")
        assert repr(sa) == repr(sb)  # nan where the short trace has no burst
        assert a.idle_rank_steps > 0
    other = simulate(generate_trace(scenario("bursty").scaled(duration_s=2.0, load=0.3), 4, 6), methods[:1], config)
    assert not np.array_equal(
        [r.first_token_s for r in other[0].requests][:5], [r.first_token_s for r in first[0].requests][:5]
    )
