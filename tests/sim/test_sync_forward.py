"""A forward that runs in the scheduler's own thread (a CPU): under SGLang's overlap scheduler the
loop processes step k's result only after step k+1's forward (``run_batch`` of k+1 returns once it is
computed), so step k's tokens reach the client at the end of step k+1, or at once when nothing runs
next. Hand-worked on test_lockstep's rank: prefill 10 ms + 100 us a token, decode 10 ms + 1 ms a
request, no KV term.
"""

from __future__ import annotations

import dataclasses

import pytest

from dpboard.errors import InvalidInputError
from dpboard.sim.model import RankConfig, RankModel, SimRequest
from dpboard.sim.profile import load_profile_file
from dpboard.sim.simulation import SimConfig, Simulation
from tests.sim.test_lockstep import COST, RANK
from tests.sim.test_profiles import GOOD
from tests.support.traces import hand_trace

SYNC = dataclasses.replace(RANK, sync_forward=True)


def _step_until_idle(rank: RankModel, now: float = 0.0) -> float:
    for _ in range(100):
        duration = rank.begin_step(now)
        if duration is None:
            rank.flush_results(now)
            return now
        now += duration
        rank.end_step(now)
    raise AssertionError("the rank never went idle")


@pytest.mark.parametrize("sync", [False, True])
def test_a_lone_request_gets_its_first_token_one_forward_later_and_ends_when_the_rank_idles(sync):
    # A: 100 tokens, 3 out, alone. Prefill 20 ms (first token computed at 20), decode 11 ms (31),
    # decode 11 ms (42, last token). Synchronous: the first token comes out when the next forward
    # ends, at 31; the last step's result at once (nothing runs next), at 42.
    trace = hand_trace([0.0], [100], [3])
    config = SimConfig(n_ranks=1, rank=SYNC if sync else RANK, send_delay_s=0.0, overlap_schedule=True)
    (req,) = Simulation(trace, "round_robin", config).run().requests
    assert req.first_token_s == pytest.approx(0.031 if sync else 0.020)
    assert req.finished_s == pytest.approx(0.042)


@pytest.mark.parametrize("sync", [False, True])
def test_an_end_waits_for_the_next_forward_while_another_request_runs(sync):
    # A (100 tokens, 2 out) and B (100, 5 out) wait at t=0. Step 1 prefills both: 30 ms; step 2
    # decodes both: 12 ms (42; A's last token); step 3 decodes B alone (A is not decoded again): 11 ms
    # (53). Synchronous: A's and B's first tokens come out at 42, A's end at 53.
    rank = RankModel(0, SYNC if sync else RANK, overlap=True)
    a, b = SimRequest(0, 0.0, 100, 2), SimRequest(1, 0.0, 100, 5)
    told: list[tuple[str, int]] = []
    rank.on_first_token = lambda r: told.append(("first", r.rid))
    rank.on_finish = lambda r: told.append(("end", r.rid))
    for req in (a, b):
        rank.receive(req, 0.0)
    end = _step_until_idle(rank)
    assert a.first_token_s == b.first_token_s == pytest.approx(0.042 if sync else 0.030)
    assert a.finished_s == pytest.approx(0.053 if sync else 0.042)
    assert b.finished_s == pytest.approx(end)  # the last step's result: at once, nothing runs next
    assert told == [("first", 0), ("first", 1), ("end", 0), ("end", 1)]  # told when the client would know


def test_without_the_overlap_scheduler_a_synchronous_forward_changes_nothing():
    trace = hand_trace([0.0, 0.005], [100, 300], [3, 4])
    runs = [Simulation(trace, "round_robin", SimConfig(n_ranks=1, rank=rank, send_delay_s=0.0,
                                                       overlap_schedule=False)).run()
            for rank in (RANK, SYNC)]
    assert [(r.first_token_s, r.finished_s) for r in runs[0].requests] == \
        [(r.first_token_s, r.finished_s) for r in runs[1].requests]


def test_a_lockstep_group_gives_every_result_out():
    trace = hand_trace([0.0, 0.001, 0.002, 0.030], [100, 200, 50, 80], [3, 1, 6, 2], ranks=2)
    config = SimConfig(n_ranks=2, rank=SYNC, lockstep=COST, send_delay_s=0.0, overlap_schedule=True)
    result = Simulation(trace, "round_robin", config).run()
    for req in result.requests:
        assert req.arrival_s < req.first_token_s <= req.finished_s <= result.end_s


def test_the_profile_key_and_its_refusal(tmp_path):
    path = tmp_path / "cpu.profile"
    path.write_text(GOOD + "sync_forward = 1\n")
    assert load_profile_file(path).rank.sync_forward is True
    path.write_text(GOOD)
    assert load_profile_file(path).rank.sync_forward is False
    path.write_text(GOOD + "sync_forward = 2\n")
    with pytest.raises(InvalidInputError, match="sync_forward is 0 or 1"):
        load_profile_file(path)
    with pytest.raises(InvalidInputError, match="sync_forward"):
        RankConfig(sync_forward=3).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("sync", [False, True])
def test_a_request_received_during_a_step_joins_the_next_one_when_the_forward_is_synchronous(sync):
    # A (100 tokens, 4 out) prefills from t=0 (20 ms). B (100 tokens) arrives at 5 ms, during it. On a
    # GPU the overlap scheduler formed step 2 while step 1 ran: B is left out of it (step 2 decodes A,
    # 11 ms, to 31) and prefills in step 3. With the forward in the loop's thread, the loop receives
    # B after step 1's forward, before it forms step 2: B prefills in step 2, from 20 ms.
    trace = hand_trace([0.0, 0.005], [100, 100], [4, 4])
    config = SimConfig(n_ranks=1, rank=SYNC if sync else RANK, send_delay_s=0.0, overlap_schedule=True)
    a, b = Simulation(trace, "round_robin", config).run().requests
    assert b.admitted_s == pytest.approx(0.020 if sync else 0.031)


def test_a_result_comes_out_at_its_share_of_the_next_step():
    # The lone request of the first test with result_share 0.8: the first token, computed by the
    # prefill at 20 ms, is processed 0.8 into the decode step that follows (11 ms): at 28.8 ms. The
    # last step's result comes out at once (nothing runs next): 42 ms as before. The end of a request
    # behind another's step: A (2 out) ends in step 2 (30 to 42), processed 0.8 into step 3 (11 ms).
    rank = dataclasses.replace(SYNC, result_share=0.8)
    trace = hand_trace([0.0], [100], [3])
    (req,) = Simulation(trace, "round_robin", SimConfig(n_ranks=1, rank=rank, send_delay_s=0.0,
                                                        overlap_schedule=True)).run().requests
    assert req.first_token_s == pytest.approx(0.0288)
    assert req.finished_s == pytest.approx(0.042)
    model = RankModel(0, rank, overlap=True)
    a, b = SimRequest(0, 0.0, 100, 2), SimRequest(1, 0.0, 100, 5)
    for r in (a, b):
        model.receive(r, 0.0)
    _step_until_idle(model)
    assert a.first_token_s == pytest.approx(0.030 + 0.8 * 0.012)
    assert a.finished_s == pytest.approx(0.042 + 0.8 * 0.011)


def test_the_result_share_key_and_its_refusal(tmp_path):
    path = tmp_path / "cpu.profile"
    path.write_text(GOOD + "sync_forward = 1\nresult_share = 0.81\n")
    assert load_profile_file(path).rank.result_share == pytest.approx(0.81)
    path.write_text(GOOD + "sync_forward = 1\n")
    assert load_profile_file(path).rank.result_share == 1.0
    for bad in ("0", "1.5"):
        path.write_text(GOOD + f"sync_forward = 1\nresult_share = {bad}\n")
        with pytest.raises(InvalidInputError, match=r"result_share is a share of a step, in \(0, 1\]"):
            load_profile_file(path)
    with pytest.raises(InvalidInputError, match="result_share"):
        RankConfig(result_share=0.0).validate()
