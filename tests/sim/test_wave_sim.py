"""``inflight_wave`` in ``dpboard sim``: the simulator holds what the real Dispatcher holds, on its
clock, and sends a wave's requests together, so that they prefill in the same group step. Hand
cases on test_lockstep's rank model (2 ranks in lockstep, no send delay, no overlap scheduler)."""

from __future__ import annotations

import pytest

from dpboard.sim.report import summarize
from dpboard.sim.simulation import simulate
from tests.sim.test_lockstep import hand, lockstep_config

WAVE = "inflight_wave:cadence=step,wave_per_rank=1,wave_max_hold=1"


def test_arrivals_while_both_ranks_decode_leave_together_and_prefill_in_one_step():
    # A and A2 at 0 (the group is idle: placed at once), one per rank, 200 tokens out each; B at
    # 50 ms and C at 80 ms come while both ranks decode: B is held, C fills the wave (one per rank)
    trace = hand([0.0, 0.0, 0.05, 0.08], [10, 10, 10, 10], [200, 200, 2, 2])
    wave, lockstep = simulate(trace, [WAVE, "inflight_lockstep:cadence=step"], lockstep_config())
    a, a2, b, c = wave.requests
    assert a.received_s == a2.received_s == 0.0
    assert b.received_s == c.received_s == pytest.approx(0.08)
    assert list(wave.held_s) == pytest.approx([0.0, 0.0, 0.03, 0.0])
    assert b.admitted_s == c.admitted_s  # one extend step for both
    # placed as they come, B and C prefill in two steps
    lb, lc = lockstep.requests[2:]
    assert lb.admitted_s < lc.admitted_s
    assert wave.extend_steps < lockstep.extend_steps
    summary = summarize(wave)
    assert summary["held_share"] == pytest.approx(0.25) and summary["held_p99_ms"] == pytest.approx(30, abs=1)
    assert summarize(lockstep)["held_share"] == 0.0


def test_a_lone_arrival_leaves_at_its_bound_and_every_run_drains():
    # B alone while both decode: no wave fills, so it leaves at its bound: 1 s less the group step
    # the board reports (one request decoding per rank at 10.75 ms a step: SGLang's gen_throughput
    # of about 93 tokens/s, logged every 40 decode steps); a refresh interval of 0 still lets time
    # pass between looks
    trace = hand([0.0, 0.0, 0.05], [10, 10, 10], [400, 400, 2])
    (result,) = simulate(trace, [WAVE + ",refresh_interval=0"], lockstep_config())
    b = result.requests[2]
    assert b.received_s == pytest.approx(0.05 + 1.0 - 0.01075, abs=5e-4)
    assert all(r.finished_s > 0 for r in result.requests)
