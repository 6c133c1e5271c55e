"""The simulator's second pass over SGLang's DP-attention scheduler: the overlap scheduler's one-step
delay, the prefill delayer, DeepEP's normal mode in an extend step, the chunk rule and the load
against the lockstep group's capacity. Hand-worked cases on the rank model of test_lockstep:

    prefill step = 10 ms + 100 us per token     decode step = 10 ms + 1 ms per request
    lockstep: the routed experts are 40 us of a prompt token and 0.5 ms of a decode token, spread
    over the group; a decode batch run without its CUDA graph pays 5 ms more.
"""

from __future__ import annotations

import dataclasses
import io
from contextlib import redirect_stdout

import numpy as np
import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.cli import config_from_args
from dpboard.sim.profile import load_profile
from dpboard.sim.report import summarize
from dpboard.sim.simulation import SimConfig, simulate
from dpboard.sim.stepping import LockstepCost
from dpboard.sim.trace import scenario_trace
from dpboard.sim.workload import lockstep_offered_load, lockstep_step_s, offered_load
from tests.sim.test_lockstep import COST, RANK, hand, lockstep_config

DPA = "deepseek-v3-dp-attention-h100"


def test_a_request_received_during_a_step_waits_one_more_step_under_the_overlap_scheduler():
    # A (10 tokens, 3 out) on rank 0 at t=0, B (5000 tokens, 2 out) on rank 1 at 15 ms, during A's
    # first decode step (10.8 to 21.55 ms). Without the overlap scheduler B prefills in step 3
    # (test_lockstep's first case). With it, step 3 was formed as step 2 began, before B came:
    #   step 3 at 21.55:  A decodes alone (no extend): 10.75 ms; A is done at 32.3
    #   step 4 at 32.3:   B prefills, rank 0 idle: 10 + 0.06 * 5000 + 0.04 * 5000 / 2 = 410 ms
    #   step 5 at 442.3:  B decodes: 10.75 ms
    (result,) = simulate(hand([0.0, 0.015], [10, 5000], [3, 2]), ["round_robin"], lockstep_config(overlap_schedule=True))
    a, b = result.requests
    assert a.first_token_s == pytest.approx(0.0108)  # received while nothing ran: at once
    assert a.finished_s == pytest.approx(0.0323)
    assert b.admitted_s == pytest.approx(0.0323)
    assert b.first_token_s == pytest.approx(0.4423)
    assert b.finished_s == pytest.approx(0.45305)
    assert result.group_steps == 5 and result.extend_steps == 2
    assert result.eager_decode_rank_steps == 0  # A no longer decodes beside B's prefill


def test_the_overlap_scheduler_is_on_under_dp_attention_unless_turned_off():
    assert SimConfig(n_ranks=2, rank=RANK, lockstep=COST).overlap
    assert not SimConfig(n_ranks=2, rank=RANK).overlap
    assert not SimConfig(n_ranks=2, rank=RANK, lockstep=COST, overlap_schedule=False).overlap


def test_the_prefill_delayer_holds_a_lone_rank_for_29_passes_then_lets_it_prefill():
    # A (10 tokens, 40 out) on rank 0 at t=0: only rank 0 could prefill ("mixed"), so the delayer
    # holds it for 29 passes; nobody has tokens, so each is a pass without a forward (1 ms). At pass
    # 30 A prefills: first token at 29 + 10.8 ms. Then A decodes, 10.75 ms a step, from 39.8 ms.
    # B (100 tokens, 2 out) reaches rank 1 at 100 ms: held again for 29 passes, real decode steps of
    # A this time; the 35th boundary after A's first token (416.05 ms) lets it prefill beside A's
    # decode: 10 + max(0.06 * 100, 0.5 + 5) + (0.04 * 100 + 0.5) / 2 = 18.25 ms.
    config = lockstep_config(prefill_delayer=True)
    (result,) = simulate(hand([0.0, 0.100], [10, 100], [40, 2]), ["round_robin"], config)
    a, b = result.requests
    assert a.admitted_s == pytest.approx(0.029)
    assert a.first_token_s == pytest.approx(0.0398)
    assert b.admitted_s == pytest.approx(0.0398 + 35 * 0.01075)
    assert b.first_token_s == pytest.approx(0.0398 + 35 * 0.01075 + 0.01825)
    assert result.delayer_held_passes == 58 and result.delayer_timeouts == 2
    # the held passes without a forward are no group steps: A's prefill and its 39 decode steps
    assert result.group_steps == 40
    # without the delayer neither waits
    (free,) = simulate(hand([0.0, 0.100], [10, 100], [40, 2]), ["round_robin"], lockstep_config())
    assert free.requests[0].first_token_s == pytest.approx(0.0108)
    assert free.delayer_held_passes == 0


def test_a_pass_without_a_forward_costs_the_profiles_idle_pass():
    # The lone rank of the case above, held 29 passes with nobody holding tokens: each pass is the
    # lockstep cost's idle_pass_s (the profile's idle_pass_ms), here 4 ms: A prefills at 116 ms.
    config = lockstep_config(prefill_delayer=True)
    config = dataclasses.replace(config, lockstep=dataclasses.replace(COST, idle_pass_s=0.004))
    (result,) = simulate(hand([0.0], [10], [2]), ["round_robin"], config)
    assert result.requests[0].admitted_s == pytest.approx(29 * 0.004)
    assert result.requests[0].first_token_s == pytest.approx(29 * 0.004 + 0.0108)
    with pytest.raises(InvalidInputError, match="idle_pass_s must be > 0"):
        dataclasses.replace(COST, idle_pass_s=0.0).validate(RANK)


def test_ranks_that_all_could_prefill_are_not_held_and_a_chunked_prompt_goes_on_while_held():
    # Both ranks get a request at t=0. The first arrives alone ("mixed": one held pass of 1 ms, in
    # which the second arrives); then both could prefill ("all", and the decode batches have room):
    # allowed at once.
    (both,) = simulate(hand([0.0, 0.0], [10, 10], [2, 2]), ["round_robin"], lockstep_config(prefill_delayer=True))
    assert [r.admitted_s for r in both.requests] == pytest.approx([0.001, 0.001])
    assert both.delayer_held_passes == 1 and both.delayer_timeouts == 0
    # A 250-token prompt in chunks of 100 on rank 0 alone: held 29 idle passes, then chunked; the
    # delayer holds the next two passes too ("mixed") but a prompt mid-chunk goes on:
    # 29 ms + (10 + 6 + 2) + (10 + 6 + 2) + (10 + 3 + 1) ms.
    rank = dataclasses.replace(RANK, chunked_prefill_size=100)
    config = SimConfig(n_ranks=2, rank=rank, lockstep=COST, send_delay_s=0.0, overlap_schedule=False, prefill_delayer=True)
    (chunked,) = simulate(hand([0.0], [250], [2], ranks=2), ["round_robin"], config)
    assert chunked.requests[0].first_token_s == pytest.approx(0.029 + 0.018 + 0.018 + 0.014)
    assert chunked.delayer_held_passes == 31


def test_beside_the_prefill_delayer_inflight_lockstep_runs_the_plugins_shorter_horizon():
    # the SGLang plugin gives inflight_lockstep a horizon of 2 group steps where the delayer is on;
    # the simulator runs the same Dispatcher with the same rule, and a spec that names one wins
    from dpboard.sim.simulation import Simulation

    trace = hand([0.0], [10], [2])
    horizon = {}
    for delayer in (False, True):
        for spec in ("inflight_lockstep", "inflight_lockstep:lockstep_horizon=6"):
            sim = Simulation(trace, spec, lockstep_config(prefill_delayer=delayer))
            horizon[spec, delayer] = sim.policy.dispatcher.budget.core.horizon
    assert horizon == {("inflight_lockstep", False): 6, ("inflight_lockstep:lockstep_horizon=6", False): 6,
                       ("inflight_lockstep", True): 2, ("inflight_lockstep:lockstep_horizon=6", True): 6}
    # and it shows in a run: the bursty scenario on the DP-attention profile, 8 ranks, load 0.5
    profile = load_profile(DPA)
    rank, _ = profile.run_rank(8, dp_attention=True, pd=False, chunk_given=False)
    config = SimConfig(n_ranks=8, rank=rank, lockstep=profile.lockstep, prefill_delayer=True,
                       slo_ttft_s=profile.slo_ttft_s, slo_tpot_s=profile.slo_tpot_s)
    bursty = scenario_trace("bursty", 8, 0, load=0.5, rank=rank, lockstep=profile.lockstep)
    runs = simulate(bursty, ["inflight_lockstep", "inflight_lockstep:lockstep_horizon=2",
                             "inflight_lockstep:lockstep_horizon=6"], config)
    first = [[r.first_token_s for r in run.requests] for run in runs]
    assert first[0] == first[1] and first[0] != first[2]


def test_the_prefill_delayer_needs_lockstep():
    with pytest.raises(InvalidInputError, match="needs --dp-attention"):
        SimConfig(n_ranks=2, rank=RANK, prefill_delayer=True).validate()


def test_deepep_normal_mode_costs_every_extend_step_and_no_decode_step():
    # The first case of test_lockstep with 3 ms more on each step that extends: A's prefill (step 1)
    # and B's (step 3); A's decode step 2 and B's decode step 4 are unchanged.
    cost = dataclasses.replace(COST, extend_dispatch_s=0.003)
    config = SimConfig(n_ranks=2, rank=RANK, lockstep=cost, send_delay_s=0.0, overlap_schedule=False)
    (result,) = simulate(hand([0.0, 0.015], [10, 5000], [3, 2]), ["round_robin"], config)
    a, b = result.requests
    assert a.first_token_s == pytest.approx(0.0108 + 0.003)
    assert b.first_token_s == pytest.approx(0.0108 + 0.003 + 0.01075 + 0.41025 + 0.003)
    assert b.finished_s == pytest.approx(b.first_token_s + 0.01075)
    assert load_profile(DPA).lockstep.extend_dispatch_s == pytest.approx(0.006)
    with pytest.raises(InvalidInputError, match="extend_dispatch_s"):
        LockstepCost(extend_dispatch_s=-1.0).validate(RANK)


def _sim_args(*argv: str):
    from argparse import ArgumentParser

    from dpboard.sim.cli import add_arguments

    p = ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(("ranks", "chunk"), [(8, 1024), (16, 512), (32, 256)])
def test_colocated_dp_attention_takes_sglangs_chunk_rule_by_default(ranks, chunk):
    config, _, _ = config_from_args(_sim_args("--trace", "steady", "--profile", DPA, "--ranks", str(ranks)))
    assert config.rank.chunked_prefill_size == chunk  # 8192 // ranks
    # the flag gives the per-rank chunk itself
    config, _, _ = config_from_args(
        _sim_args("--trace", "steady", "--profile", DPA, "--ranks", str(ranks), "--chunked-prefill-size", "2048")
    )
    assert config.rank.chunked_prefill_size == 2048
    # independent ranks and PD pools keep the profile's (the blog's PD setting, 16,384 per rank)
    config, _, _ = config_from_args(_sim_args("--trace", "steady", "--profile", DPA, "--no-dp-attention"))
    assert config.rank.chunked_prefill_size == 16384
    config, _, _ = config_from_args(_sim_args("--trace", "steady", "--profile", DPA, "--pd", "2:2"))
    assert config.rank.chunked_prefill_size == 16384


def test_the_lockstep_capacity_is_the_step_formula_at_saturation():
    rank = dataclasses.replace(RANK, chunked_prefill_size=500, kv_capacity=1_000_000)
    # prompts only (one output token): every rank prefills every step, which costs what an
    # independent rank's full prefill step costs, plus the normal-mode dispatch
    prompts, outputs = np.full(100, 1000), np.ones(100, np.int64)
    cost = dataclasses.replace(COST, extend_dispatch_s=0.002)
    load = lockstep_offered_load(prompts, outputs, 10.0, 4, rank, cost)
    step = 0.010 + 0.002 + 100e-6 * 500
    assert lockstep_step_s(rank, cost, 4, 4, 64, 0.0) == pytest.approx(step)
    assert load == pytest.approx(100 * 2 * step / (4 * 10.0))
    assert offered_load(prompts, outputs, 10.0, 4, rank) == pytest.approx(100 * 1000 * (100e-6 + 0.010 / 500) / 40)
    # one prefilling rank beside three decoding 64 requests: its chunk's attention sets the step, the
    # others decode without their graph
    mixed = lockstep_step_s(rank, cost, 4, 1, 64, 0.0)
    assert mixed == pytest.approx(0.010 + 0.002 + max(60e-6 * 500, 0.5e-3 * 64 + 0.005) + (40e-6 * 500 + 0.5e-3 * 64 * 3) / 4)
    # with decode in the mix the group is slower than independent ranks: load is higher in lockstep
    outputs = np.full(100, 200)
    assert lockstep_offered_load(prompts, outputs, 10.0, 4, rank, cost) > offered_load(prompts, outputs, 10.0, 4, rank)


def test_the_header_states_the_load_against_the_lockstep_capacity_and_an_independent_ranks():
    args = _sim_args("--trace", "bursty", "--profile", DPA, "--ranks", "8", "--duration", "20", "--methods",
                     "round_robin", "--load", "0.5")
    config, trace, _ = config_from_args(args)
    assert trace.info["load"] == pytest.approx(0.5)
    assert trace.info["load_basis"] == "lockstep group"
    from dpboard.sim.report import header_text

    text = header_text(trace, config, ["round_robin"], DPA, chunk_rule="rule")
    assert "offered load 0.50 of the lockstep group's capacity per rank" in text
    assert f"({trace.info['independent_load']:.2f} of an independent rank's)" in text
    assert "chunked prefill 1024 (rule)" in text


def test_a_scenario_on_the_dpa_profile_runs_below_saturation_by_default():
    # `dpboard sim --trace bursty` with the DeepSeek profile: its rates were set for the synthetic
    # rank, several times what a DeepSeek rank prefills. Scaled to 0.75 of the lockstep capacity, the
    # run means something: most requests meet the TTFT SLO and goodput is not nil.
    from dpboard.sim.cli import run

    out = io.StringIO()
    with redirect_stdout(out):
        assert run(_sim_args("--trace", "bursty", "--profile", DPA, "--ranks", "8", "--methods", "round_robin",
                             "--json", "-")) == 0
    import json

    doc = json.loads(out.getvalue())
    (run_doc,) = doc["runs"]
    summary = run_doc["summary"]
    assert doc["trace"]["file"]["load"] == pytest.approx(0.75)
    assert summary["ttft_p50_ms"] < summary["slo_ttft_ms"]
    assert summary["goodput_rps"] > 0


def test_a_foreign_profiles_scenario_is_scaled_to_its_capacity():
    profile = load_profile(DPA)
    rank, _ = profile.run_rank(8, dp_attention=True, pd=False, chunk_given=False)
    trace = scenario_trace("steady", 8, 0, load=0.6, rank=rank, lockstep=profile.lockstep)
    span = trace.spec.duration_s * trace.info["time_scale"]
    assert lockstep_offered_load(trace.prompt_len, trace.output_len, span, 8, rank, profile.lockstep) == pytest.approx(0.6)
    # on its own profile a scenario's load multiplies its rates, as before
    own = scenario_trace("steady", 8, 0, load=0.5, rank=None)
    assert own.spec.rate_per_rank == pytest.approx(8.0) and not own.info


def test_summaries_carry_the_delayers_record():
    (result,) = simulate(hand([0.0], [10], [2], ranks=2), ["round_robin"], lockstep_config(prefill_delayer=True))
    s = summarize(result)
    assert s["delayer_held_passes"] == 29 and s["delayer_timeouts"] == 1


def test_a_prefill_step_stalls_the_running_requests_of_its_own_rank_only():
    # rank 0: A (10 tokens, 5 out) at t=0, then B (100 tokens, 2 out) at 15 ms: B's prefill step gives A
    # no token (one stalled decode). Rank 1: C (50 tokens, 3 out) at 5 ms prefills while A decodes on
    # rank 0: a step longer for A, but A gets its token, so nothing is stalled there.
    trace = hand([0.0, 0.005, 0.015], [10, 50, 100], [5, 3, 2])
    (result,) = simulate(trace, ["round_robin"], lockstep_config())
    assert [r.rank for r in result.requests] == [0, 1, 0]
    assert result.stalled_decodes == 1
    s = summarize(result)
    assert s["stalled_decode_share"] == pytest.approx(1 / (4 + 2 + 1))
