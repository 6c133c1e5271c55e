"""The overlap scheduler's k+2 rule: a request that finishes in step k frees its slot and its KV only
once step k+1 has been formed (SGLang 0.5.23's event_loop_overlap forms the next batch before it
processes the last one's result), and the prefill delayer counts it in the running batch meanwhile.

Hand-worked on the rank of test_lockstep (prefill 10 ms + 100 us a token, decode 10 ms + 1 ms a
request, no KV term), the rank stepped by hand: every request is received between steps, so the
overlap scheduler's fence on requests received during a step plays no part.
"""

from __future__ import annotations

import dataclasses

import pytest

from dpboard.sim.model import DECODE, PREFILL, RankConfig, RankModel, SimRequest
from dpboard.sim.prefill_delayer import PrefillDelayer
from dpboard.sim.stepping import RankGroup
from tests.sim.test_lockstep import COST, RANK


def _run(rank: RankModel, steps: int, now: float = 0.0) -> tuple[list[int], list[float | None], float]:
    """Step ``rank`` alone ``steps`` times back to back: each step's state and duration."""
    states, durations = [], []
    for _ in range(steps):
        duration = rank.begin_step(now)
        states.append(rank.state)
        durations.append(duration)
        if duration is None:
            break
        now += duration
        rank.end_step(now)
    return states, durations, now


def _three_waiting(config: RankConfig, prompt: int, outputs: tuple[int, int, int], overlap: bool
                   ) -> tuple[RankModel, list[SimRequest]]:
    """A rank of ``config`` with A, B and C (``prompt`` tokens each, ``outputs`` out) waiting at t=0."""
    rank = RankModel(0, config, overlap=overlap)
    reqs = [SimRequest(i, 0.0, prompt, out) for i, out in enumerate(outputs)]
    for req in reqs:
        rank.receive(req, 0.0)
    return rank, reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_a_slot_freed_in_step_k_is_taken_in_step_k_plus_2_under_the_overlap_scheduler(overlap):
    # max_running 2. A (10 tokens, 2 out), B (10, 5 out), C (10, 2 out) wait at t=0.
    #   step 1: A and B prefill (C finds no slot): 10 + 0.1 * 20 = 12 ms
    #   step 2: A and B decode: 12 ms; A's last token, A finishes at 24 ms
    #   step 3: without overlap C takes A's slot: prefill 11 ms. With it step 3 is formed before
    #           step 2's result is processed: A still holds its slot, B decodes alone (11 ms, A is
    #           not decoded again)
    #   step 4: with overlap C prefills now, at 35 ms
    rank, (a, b, c) = _three_waiting(dataclasses.replace(RANK, max_running=2), 10, (2, 5, 2), overlap)
    states, durations, _ = _run(rank, 4)
    assert a.finished_s == pytest.approx(0.024)
    if overlap:
        assert states == [PREFILL, DECODE, DECODE, PREFILL]
        assert durations[:3] == pytest.approx([0.012, 0.012, 0.011])
        assert c.admitted_s == pytest.approx(0.035)
    else:
        assert states == [PREFILL, DECODE, PREFILL, DECODE]
        assert c.admitted_s == pytest.approx(0.024)


@pytest.mark.parametrize("overlap", [False, True])
def test_kv_freed_in_step_k_is_usable_in_step_k_plus_2_under_the_overlap_scheduler(overlap):
    # KV for 250 tokens, slots to spare. A (100 tokens, 2 out), B (100, 5 out), C (100, 2 out).
    # Admission keeps a prompt plus its first token free, and a decode token per running request:
    #   step 1: A and B take 101 each (48 left), C does not fit
    #   step 2: A and B decode; A finishes holding 102 tokens, B holds 102
    #   step 3: without overlap 250 - 102 - 1 = 147 free, C (101) prefills; with it A's 102 are
    #           still held (45 free): B decodes alone
    #   step 4: with overlap A's KV is back: 250 - 103 - 1 = 146 free, C prefills
    rank, _ = _three_waiting(dataclasses.replace(RANK, kv_capacity=250), 100, (2, 5, 2), overlap)
    states, _, _ = _run(rank, 4)
    if overlap:
        assert states == [PREFILL, DECODE, DECODE, PREFILL]
        assert rank.private_tokens == 103 + 101  # B's sequence, C's prompt and first token: A's KV is gone
    else:
        assert states == [PREFILL, DECODE, PREFILL, DECODE]


def test_a_lone_rank_whose_last_requests_finish_takes_the_waiting_one_at_once():
    # max_running 1: A (10 tokens, 2 out) runs, B waits. A finishes at the end of step 2; step 3,
    # formed with A's slot still held, has nothing to run (A does not decode again), so the loop
    # processes step 2's result and forms again: B prefills in step 3, at 23 ms, as without overlap.
    rank = RankModel(0, dataclasses.replace(RANK, max_running=1), overlap=True)
    a, b = SimRequest(0, 0.0, 10, 2), SimRequest(1, 0.0, 10, 2)
    for req in (a, b):
        rank.receive(req, 0.0)
    group = RankGroup(0, [rank])
    now = 0.0
    for _ in range(2):
        now += group.begin(now)
        group.end(now)
    assert a.finished_s == pytest.approx(0.011 + 0.011)
    assert group.begin(now) == pytest.approx(0.011)
    assert rank.state == PREFILL and b.admitted_s == pytest.approx(0.022)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_prefill_delayer_counts_requests_that_finished_in_the_step_just_ended(overlap):
    # Two ranks in lockstep, max_running 3, a delayer past its first skip. Rank 0 runs A (10 tokens,
    # 2 out) and B (10, 10 out), rank 1 runs C (10, 10 out): their first prefill batches were 2 and
    # 1. A finishes in step 2; then D reaches rank 0 and E rank 1. Both could prefill in step 3, so
    # the delayer holds it back if 3 - max(running batch) < 2. Without overlap rank 0's running batch
    # is B alone (1): allowed. With it step 3 is formed before step 2's result is processed: A is
    # still in the batch SGLang reports (2), so step 3 is held; it decodes, and D and E prefill in
    # step 4 once A is gone.
    cfg = dataclasses.replace(RANK, max_running=3)
    ranks = [RankModel(r, cfg, overlap=overlap) for r in range(2)]
    delayer = PrefillDelayer(2)
    group = RankGroup(0, ranks, COST, delayer)
    a, b, c, d, e = (SimRequest(i, 0.0, 10, out) for i, out in enumerate((2, 10, 10, 2, 2)))
    ranks[0].receive(a, 0.0)
    ranks[0].receive(b, 0.0)
    ranks[1].receive(c, 0.0)
    now = 0.0
    for _ in range(2):
        now += group.begin(now)
        group.end(now)
    assert a.finished_s == pytest.approx(now)
    delayer.skip_first = False
    ranks[0].receive(d, now)
    ranks[1].receive(e, now)
    assert ranks[0].running_batch == (2 if overlap else 1)
    duration = group.begin(now)
    if overlap:
        assert [rank.state for rank in ranks] == [DECODE, DECODE]
        assert delayer.held_passes == 1
        now += duration
        group.end(now)
        assert ranks[0].running_batch == 1
        group.begin(now)
    assert [rank.state for rank in ranks] == [PREFILL, PREFILL]
    assert d.admitted_s == e.admitted_s == pytest.approx(now)
    assert delayer.held_passes == (1 if overlap else 0)
