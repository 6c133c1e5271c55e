"""The dispatch rules of docs/DISPATCH.md ("The rules"), one test each, and their properties."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpboard import Board, LoadSnapshot
from dpboard.controller import (
    Dispatcher,
    DPBudget,
    LoadBalanceMethod,
    ReaderOwner,
    resolve_load_balance_method,
    zmq_reader_owner,
)
from dpboard.controller.budget import ArgminCore, PyArgminCore
from dpboard.methods import ArgminKey
from tests.support.dispatch import FakeClock, ListReader, Req, TokReq, make

M = LoadBalanceMethod
LOAD_AWARE = [M.TOTAL_REQUESTS, M.TOTAL_TOKENS, M.INFLIGHT_REQUESTS, M.INFLIGHT_TOKENS, M.INFLIGHT_BACKLOG]


# -- 5.1 methods and auto ------------------------------------------------------------------------------


def test_auto_without_pd_is_round_robin():
    assert resolve_load_balance_method("auto") is M.ROUND_ROBIN
    assert resolve_load_balance_method("auto", None) is M.ROUND_ROBIN
    assert resolve_load_balance_method("auto", "null") is M.ROUND_ROBIN


def test_auto_in_pd_prefill_follows_bootstrap_room():
    assert resolve_load_balance_method("auto", disaggregation_mode="prefill") is M.FOLLOW_BOOTSTRAP_ROOM


def test_auto_in_pd_decode_is_round_robin():
    assert resolve_load_balance_method("auto", disaggregation_mode="decode") is M.ROUND_ROBIN


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown load balance method 'shortest'.*total_tokens"):
        resolve_load_balance_method("shortest")


def test_unknown_disaggregation_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown disaggregation_mode 'encode'.*prefill, decode"):
        resolve_load_balance_method("auto", "encode")


def test_round_robin_in_prefill_warns_and_follows_the_room():
    with pytest.warns(UserWarning, match="round_robin.*follow_bootstrap_room"):
        assert resolve_load_balance_method("round_robin", "prefill") is M.FOLLOW_BOOTSTRAP_ROOM


def test_explicit_methods_resolve_to_themselves_in_any_mode():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mode in (None, "prefill", "decode"):
            for m in (M.TOTAL_TOKENS, M.TOTAL_REQUESTS, M.FOLLOW_BOOTSTRAP_ROOM, M.INFLIGHT_TOKENS,
                      M.INFLIGHT_BACKLOG):
                assert resolve_load_balance_method(m.value.upper().replace("_", "-"), mode) is m


# -- 5.2 routed_dp_rank -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", list(M))
def test_routed_dp_rank_wins_over_every_method(method):
    d, reader, _ = make(method, n=4)
    if reader is not None:
        reader.set(2, tokens=10**9, running=100)  # the busiest rank: a policy would never pick it
    assert [d.dispatch(Req(routed_dp_rank=2, bootstrap_room=1)) for _ in range(3)] == [2, 2, 2]


@pytest.mark.parametrize("method", list(M))
@pytest.mark.parametrize("bad", [-1, 4, 99])
def test_routed_rank_out_of_range_raises(method, bad):
    d, _, _ = make(method, n=4)
    with pytest.raises(ValueError, match=rf"^DP rank {bad} is not active\.$"):
        d.dispatch(Req(routed_dp_rank=bad, bootstrap_room=0))


@pytest.mark.parametrize("method", list(M))
def test_routed_rank_not_in_the_active_set_raises(method):
    d, _, _ = make(method, n=4, active=[0, 1])
    with pytest.raises(ValueError, match=r"^DP rank 3 is not active\.$"):
        d.dispatch(Req(routed_dp_rank=3, bootstrap_room=0))


@pytest.mark.parametrize("method", LOAD_AWARE)
def test_routed_request_is_counted_in_the_budget(method):
    d, _, _ = make(method, n=2)
    d.dispatch(Req(input_ids=[1] * 7, routed_dp_rank=0))
    assert d.budget.total_requests.tolist() == [1, 0]
    assert d.budget.total_tokens.tolist() == [7, 0]
    assert d.dispatch(Req()) == 1  # the routed request made rank 0 the busier one


def test_routed_rank_must_be_an_int():
    d, _, _ = make(M.TOTAL_TOKENS)
    with pytest.raises(ValueError, match="routed_dp_rank must be an int or None, got '1'"):
        d.dispatch(Req(routed_dp_rank="1"))


# -- 5.3 round robin ----------------------------------------------------------------------------------


def test_round_robin_cycles_over_the_active_set_only():
    d, _, _ = make(M.ROUND_ROBIN, n=8, active=[1, 4, 6])
    assert [d.dispatch(Req()) for _ in range(7)] == [1, 4, 6, 1, 4, 6, 1]


def test_round_robin_skips_unavailable_slots():
    d, _, _ = make(M.ROUND_ROBIN, n=4)
    d.set_status(1, False)
    assert [d.dispatch(Req()) for _ in range(6)] == [0, 2, 3, 0, 2, 3]
    d.set_status(1, True)
    assert sorted(d.dispatch(Req()) for _ in range(4)) == [0, 1, 2, 3]


def test_round_robin_with_every_active_rank_unavailable_raises():
    d, _, _ = make(M.ROUND_ROBIN, n=3)
    for r in range(3):
        d.set_status(r, False)
    with pytest.raises(RuntimeError, match="all 3 active DP ranks are unavailable"):
        d.dispatch(Req())


def test_round_robin_with_an_empty_active_set_raises():
    d, _, _ = make(M.ROUND_ROBIN, n=3, active=[])
    with pytest.raises(RuntimeError, match="active set is empty"):
        d.dispatch(Req())


def test_round_robin_never_reads_loads():
    reader = ListReader(4)
    d, _, _ = make(M.ROUND_ROBIN, n=4, reader=reader)
    reader.set(0, tokens=10**9)
    assert [d.dispatch(Req()) for _ in range(4)] == [0, 1, 2, 3]
    assert reader.reads == 0


# -- 5.3 follow_bootstrap_room ------------------------------------------------------------------------


def test_room_maps_modulo_every_slot_reserved_ones_included():
    d, _, _ = make(M.FOLLOW_BOOTSTRAP_ROOM, n=8, active=[0, 1])
    assert [d.dispatch(Req(bootstrap_room=room)) for room in (0, 5, 13, 8 * 10**12 + 7)] == [0, 5, 5, 7]


def test_room_ignores_status():
    d, _, _ = make(M.FOLLOW_BOOTSTRAP_ROOM, n=4)
    d.set_status(2, False)
    assert d.dispatch(Req(bootstrap_room=6)) == 2


def test_room_missing_is_an_error():
    d, _, _ = make(M.FOLLOW_BOOTSTRAP_ROOM, n=4)
    with pytest.raises(ValueError, match="no bootstrap_room.*through the router"):
        d.dispatch(Req())


# -- 5.3 total_requests and total_tokens ---------------------------------------------------------------


def test_total_requests_is_argmin_of_running_plus_waiting():
    d, reader, _ = make(M.TOTAL_REQUESTS, n=3)
    reader.set(0, running=3, waiting=1, tokens=0)
    reader.set(1, running=1, waiting=2, tokens=10**6)  # 3 requests: the least, tokens do not matter
    reader.set(2, running=0, waiting=5)
    assert d.dispatch(Req()) == 1


def test_total_requests_ties_go_to_the_lowest_index():
    d, reader, _ = make(M.TOTAL_REQUESTS, n=4)
    for r, q in enumerate([5, 2, 2, 2]):
        reader.set(r, running=q)
    assert [d.dispatch(Req()) for _ in range(4)] == [1, 2, 3, 1]


def test_total_tokens_is_lexicographic_tokens_then_requests():
    d, reader, _ = make(M.TOTAL_TOKENS, n=3)
    reader.set(0, tokens=100, running=9)
    reader.set(1, tokens=100, running=2)
    reader.set(2, tokens=101, running=0)
    assert d.dispatch(Req(input_ids=[])) == 1


def test_total_tokens_ties_go_to_the_lowest_index():
    d, reader, _ = make(M.TOTAL_TOKENS, n=3)
    for r in range(3):
        reader.set(r, tokens=50, running=1)
    assert d.dispatch(Req(input_ids=[])) == 0


# -- inflight_backlog (dpboard) -------------------------------------------------------------------------


def test_inflight_backlog_keys_on_queued_prefill_tokens_then_total_tokens():
    d, reader, _ = make(M.INFLIGHT_BACKLOG, n=3)
    reader.set(0, tokens=9000, used=9000, running=40)  # a big decode batch, nothing queued: backlog 0
    reader.set(1, tokens=500, used=100)  # light, but 400 prompt tokens wait for prefill
    reader.set(2, tokens=300, used=0, waiting=1)  # 300 queued
    # backlogs (0, 400, 300) -> 0; +250 -> (250, 400, 300) -> 0; (500, 400, 300) -> 2;
    # (500, 400, 550) -> 1; (500, 650, 550) -> 0
    assert [d.dispatch(Req(input_ids=[0] * 250)) for _ in range(5)] == [0, 0, 2, 1, 0]
    assert d.budget.backlog.tolist() == [750, 650, 550]
    assert d.budget.total_tokens.tolist() == [9750, 750, 550]


def test_inflight_backlog_breaks_equal_queues_by_the_lighter_decode_batch_and_rotates():
    d, reader, _ = make(M.INFLIGHT_BACKLOG, n=4)
    for r, used in enumerate([5000, 3000, 3000, 8000]):
        reader.set(r, tokens=used, used=used)  # every queue empty
    # (0, tokens): rank 1 and 2 tie at 3000 -> 1, the scan then starts at 2 -> 2 (3000 < 3010),
    # then backlogs (0 for 0 and 3, 10 for 1 and 2): 0 (5000 < 8000), then 3
    assert [d.dispatch(Req(input_ids=[0] * 10)) for _ in range(4)] == [1, 2, 0, 3]


def test_inflight_backlog_keeps_requests_in_flight_across_a_refresh():
    d, reader, clock = make(M.INFLIGHT_BACKLOG, n=2)
    reader.set(0, tokens=0, received=0)
    reader.set(1, tokens=0, received=0)
    assert [d.dispatch(Req(input_ids=[0] * 100)) for _ in range(2)] == [0, 1]
    assert d.dispatch(Req(input_ids=[0] * 100)) == 0
    # rank 0 received both of its requests, prefilled them (KV in use: no longer queued); rank 1's
    # request is still on its way, so its snapshot shows nothing yet
    reader.set(0, tokens=200, used=200, running=2, received=2)
    reader.set(1, tokens=0, received=0)
    clock.now += 0.03
    assert d.dispatch(Req(input_ids=[])) == 0  # refreshed: backlog (0, 100 in flight)
    assert d.budget.backlog.tolist() == [0, 100]
    assert d.budget.total_tokens.tolist() == [200, 100]
    assert d.budget.in_flight().tolist() == [1, 1]  # rank 0's: the empty request just sent


def test_inflight_backlog_is_health_aware(board_name):
    with Board.create(board_name, n_slots=2) as board:
        board.writer(0).publish_values(0, 0, 0, 0, 0, 100, 0)  # idle, but about to go stale
        time.sleep(0.06)
        board.writer(1).publish_values(0, 5, 0, 500, 500, 1000, 0)  # 500 queued tokens, alive
        d = Dispatcher(M.INFLIGHT_BACKLOG, 2, reader=board.reader(stale_after=0.05))
        assert d.dispatch(Req()) == 1


def test_inflight_backlog_on_the_command_line_and_in_the_sglang_signature():
    from dpboard.methods import METHOD_CHOICES

    assert "inflight_backlog" in METHOD_CHOICES
    assert resolve_load_balance_method("inflight-backlog") is M.INFLIGHT_BACKLOG
    budget = DPBudget(2, inflight_accounting=True)
    budget.update_budget([LoadSnapshot(dp_rank=0, num_used_tokens=0, num_total_tokens=50, publish_seq=1),
                          LoadSnapshot(dp_rank=1, num_used_tokens=900, num_total_tokens=900, publish_seq=1)])
    assert budget.dispatch(M.TOTAL_TOKENS, 10) == 0  # 50 < 900 tokens
    assert budget.dispatch(M.INFLIGHT_BACKLOG, 10) == 1  # 0 < 60 queued
    without_backlog = SimpleNamespace(**{name: getattr(budget, name) for name in (
        "total_tokens", "total_requests", "candidate", "routable", "sent_reqs", "sent_tokens")})
    for core_type in (PyArgminCore, ArgminCore):
        with pytest.raises(ValueError, match="key BACKLOG needs the backlog array"):
            core_type(without_backlog, key=ArgminKey.BACKLOG)


@pytest.mark.parametrize("method", [M.TOTAL_REQUESTS, M.TOTAL_TOKENS, M.INFLIGHT_BACKLOG])
def test_load_aware_picks_only_active_available_slots(method):
    d, reader, _ = make(method, n=4, active=[1, 2, 3])
    reader.set(0, tokens=0)
    reader.set(1, tokens=10, running=1)
    reader.set(2, tokens=5, running=1)
    reader.set(3, tokens=20, running=2)
    d.set_status(2, False)
    assert d.dispatch(Req(input_ids=[])) == 1  # 0 is reserved, 2 unavailable


def test_a_rank_without_snapshot_counts_as_zero_load():
    d, reader, _ = make(M.TOTAL_TOKENS, n=3)
    reader.set(0, tokens=10, running=1)
    reader.set(2, tokens=10, running=1)
    assert d.dispatch(Req()) == 1


def test_seed_methods_do_not_consult_staleness(board_name):
    with Board.create(board_name, n_slots=2) as board:
        board.writer(0).publish_values(0, 0, 0, 1, 1, 100, 0)
        time.sleep(0.06)
        board.writer(1).publish_values(0, 0, 0, 500, 500, 100, 0)
        reader = board.reader(stale_after=0.05)
        assert reader.status(0).label == "stale"
        d = Dispatcher(M.TOTAL_TOKENS, 2, reader=reader)
        assert d.dispatch(Req()) == 0  # stale but lightest: SGLang picks it


def test_load_aware_without_reader_is_an_error():
    with pytest.raises(ValueError, match="total_tokens reads loads and needs a reader"):
        Dispatcher(M.TOTAL_TOKENS, 4)


def test_refresh_is_throttled_to_20ms_on_the_injected_clock():
    d, reader, clock = make(M.TOTAL_REQUESTS, n=2)
    reader.set(0, running=5)
    assert d.dispatch(Req()) == 1
    assert reader.reads == 1
    reader.set(1, running=50)
    clock.now += 0.019
    assert d.dispatch(Req()) == 1  # still within 20 ms: the new load of rank 1 is not read
    assert reader.reads == 1
    clock.now += 0.001
    assert d.dispatch(Req()) == 0
    assert reader.reads == 2


def test_speculative_update_adds_one_request_and_the_input_length():
    d, reader, _ = make(M.TOTAL_TOKENS, n=2)
    reader.set(0, tokens=0)
    reader.set(1, tokens=100, running=1)
    assert d.dispatch(Req(input_ids=[7] * 60)) == 0
    assert d.budget.total_tokens.tolist() == [60, 100]
    assert d.budget.total_requests.tolist() == [1, 1]
    assert d.dispatch(TokReq(num_tokens=50)) == 0
    assert d.dispatch(Req(input_ids=[7] * 5)) == 1
    assert d.budget.total_tokens.tolist() == [110, 105]


def test_a_request_without_a_token_estimate_is_a_clear_error():
    d, _, _ = make(M.TOTAL_TOKENS, n=2)

    class Bare:
        routed_dp_rank = None

    with pytest.raises(ValueError, match="neither input_ids nor num_tokens"):
        d.dispatch(Bare())


def test_a_batch_refreshes_once_and_spreads_by_speculation():
    d, reader, clock = make(M.TOTAL_TOKENS, n=4)
    ranks = d.dispatch_batch([Req(input_ids=[0] * 10) for _ in range(8)])
    assert reader.reads == 1
    assert ranks == [0, 1, 2, 3, 0, 1, 2, 3]
    clock.now += 1
    d.dispatch_batch([Req() for _ in range(8)])
    assert reader.reads == 2


def test_a_batch_is_all_or_nothing():
    d, _, _ = make(M.TOTAL_TOKENS, n=2)
    before = (d.budget.total_tokens.tolist(), d.budget.total_requests.tolist())
    with pytest.raises(ValueError, match="DP rank 5 is not active"):
        d.dispatch_batch([Req(), Req(), Req(routed_dp_rank=5)])
    assert (d.budget.total_tokens.tolist(), d.budget.total_requests.tolist()) == before
    assert d.budget.sent_reqs.tolist() == [0, 0]


def test_an_unchanged_snapshot_does_not_overwrite_the_budget():
    d, reader, clock = make(M.TOTAL_TOKENS, n=2)
    reader.set(0, tokens=0, seq=1)
    reader.set(1, tokens=25, seq=1)
    assert [d.dispatch(Req(input_ids=[0] * 10)) for _ in range(3)] == [0, 0, 0]
    clock.now += 1  # a refresh happens, but the snapshots are the same ones: speculation stays
    assert d.dispatch(Req(input_ids=[0] * 10)) == 1
    assert d.budget.total_tokens.tolist() == [30, 35]
    reader.set(0, tokens=0)  # a new publish of rank 0 overwrites its speculative tokens
    clock.now += 1
    assert d.dispatch(Req(input_ids=[0] * 10)) == 0
    assert d.budget.total_tokens.tolist() == [10, 35]


def test_set_active_and_set_status_validate_ranks():
    d, _, _ = make(M.TOTAL_TOKENS, n=4)
    with pytest.raises(ValueError, match="active rank 4 is outside the 4 worker slots"):
        d.set_active([0, 4])
    with pytest.raises(ValueError, match="rank -1 is outside"):
        d.set_status(-1, False)
    d.set_active([3, 1, 1])
    assert d.active == (1, 3)


def test_elastic_ep_growth_makes_new_ranks_pickable():
    d, reader, _ = make(M.TOTAL_REQUESTS, n=4, active=[0, 1])
    reader.set(0, running=5)
    reader.set(1, running=5)
    assert d.dispatch(Req()) == 0
    d.set_active([0, 1, 2, 3])
    assert d.dispatch(Req()) == 2


def test_no_available_candidate_raises_for_load_aware():
    d, _, _ = make(M.TOTAL_TOKENS, n=2)
    d.set_status(0, False)
    d.set_status(1, False)
    with pytest.raises(RuntimeError, match="no DP rank can take the request"):
        d.dispatch(Req())


def test_budget_dispatch_has_sglang_signature():
    b = DPBudget(3)
    b.update_budget([LoadSnapshot(dp_rank=1, num_total_tokens=5, publish_seq=1),
                     LoadSnapshot(dp_rank=0, num_total_tokens=9, publish_seq=1)])
    assert b.dispatch(M.TOTAL_TOKENS, estimated_tokens=4) == 2
    assert b.dispatch(M.TOTAL_TOKENS, estimated_tokens=4) == 2
    assert b.dispatch(M.TOTAL_TOKENS, estimated_tokens=4) == 1
    assert b.dispatch(M.TOTAL_REQUESTS) == 0
    with pytest.raises(ValueError, match="needs a load-aware method"):
        b.dispatch(M.ROUND_ROBIN)


def test_the_real_board_drives_the_argmin(board_name):
    with Board.create(board_name, n_slots=4) as board:
        for r, tokens in enumerate([400, 100, 300, 200]):
            board.writer(r).publish_values(1, 0, 0, tokens, tokens, 1000, 0)
        d = Dispatcher(M.TOTAL_TOKENS, 4, reader=board.reader())
        assert d.dispatch_batch([Req(input_ids=[0] * 150) for _ in range(4)]) == [1, 3, 1, 2]


# -- zmq_reader_owner (MULTINODE.md) -------------------------------------------------------------------------


def test_the_controller_owns_the_load_socket_only_when_load_aware():
    assert zmq_reader_owner("total_tokens") is ReaderOwner.CONTROLLER
    assert zmq_reader_owner(M.INFLIGHT_REQUESTS, "decode") is ReaderOwner.CONTROLLER
    assert zmq_reader_owner("auto") is ReaderOwner.COLLECTOR
    assert zmq_reader_owner("auto", "prefill", standalone_collector=False) is ReaderOwner.TOKENIZER
    assert zmq_reader_owner("round_robin", "prefill") is ReaderOwner.COLLECTOR
    assert zmq_reader_owner("total_tokens", dp_size=1) is ReaderOwner.COLLECTOR  # no controller at dp 1
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        zmq_reader_owner("total_tokens", dp_size=0)


# -- properties ------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_round_robin_visits_every_available_active_rank_equally(n, data):
    active = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
    down = data.draw(st.sets(st.sampled_from(sorted(active)), max_size=len(active) - 1))
    rounds = data.draw(st.integers(1, 5))
    d, _, _ = make(M.ROUND_ROBIN, n=n, active=active)
    for r in down:
        d.set_status(r, False)
    up = sorted(active - down)
    picks = [d.dispatch(Req()) for _ in range(rounds * len(up))]
    assert {r: picks.count(r) for r in up} == {r: rounds for r in up}
    assert set(picks) <= set(up)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 16), rooms=st.lists(st.integers(0, 2**62), min_size=1, max_size=20), data=st.data())
def test_room_mapping_is_stable_across_active_and_status_changes(n, rooms, data):
    d, _, _ = make(M.FOLLOW_BOOTSTRAP_ROOM, n=n)
    first = [d.dispatch(Req(bootstrap_room=room)) for room in rooms]
    d.set_active(data.draw(st.sets(st.integers(0, n - 1))))
    d.set_status(data.draw(st.integers(0, n - 1)), False)
    assert [d.dispatch(Req(bootstrap_room=room)) for room in rooms] == first == [room % n for room in rooms]


@settings(max_examples=60, deadline=None)
@given(
    method=st.sampled_from(LOAD_AWARE),
    loads=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2000)), min_size=1, max_size=10),
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=40),
)
def test_argmin_never_picks_a_rank_with_a_strictly_lower_budget_elsewhere(method, loads, sizes):
    n = len(loads)
    d, reader, _ = make(method, n=n)
    for r, (q, tokens) in enumerate(loads):
        reader.set(r, running=q, tokens=tokens)
    d.refresh()
    b = d.budget
    for size in sizes:
        before = list(zip(b.total_tokens.tolist(), b.total_requests.tolist(), b.backlog.tolist(), strict=True))
        rank = d.dispatch(Req(input_ids=[0] * size))
        if method.by_backlog:
            key = lambda t: (t[2], t[0])  # noqa: E731
        elif method.by_tokens:
            key = lambda t: (t[0], t[1])  # noqa: E731
        else:
            key = lambda t: t[1]  # noqa: E731
        assert all(key(before[rank]) <= key(before[r]) for r in range(n))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 16), method=st.sampled_from([M.TOTAL_REQUESTS, M.TOTAL_TOKENS]))
def test_a_burst_inside_one_window_spreads_by_speculative_updates(n, method):
    d, reader, clock = make(method, n=n)
    for r in range(n):
        reader.set(r, running=0, tokens=0)
    picks = []
    for _ in range(1000):
        picks.append(d.dispatch(Req(input_ids=[0] * 32)))
        clock.now += 0.00001  # 1000 requests in 10 ms: one refresh for the burst
    assert reader.reads == 1
    counts = [picks.count(r) for r in range(n)]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 9),
    rotate=st.booleans(),
    key=st.sampled_from(list(ArgminKey)),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 50), st.one_of(st.none(), st.integers(-1, 9))),
        max_size=40,
    ),
    data=st.data(),
)
def test_the_c_core_and_the_python_twin_pick_the_same(n, rotate, key, ops, data):
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    # a snapshot per rank, so that the backlog (total - used) and the tokens disagree on the order
    # and a KV capacity (0: none published) that some of the picks overflow
    loads = data.draw(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(0, 700)),
                               min_size=n, max_size=n))
    snaps = [LoadSnapshot(dp_rank=r, num_used_tokens=used, num_total_tokens=used + queued, max_total_num_tokens=cap,
                          publish_seq=1, timestamp_ns=1) for r, (used, queued, cap) in enumerate(loads)]
    budgets = [DPBudget(n, key=key, rotate_ties=rotate, inflight_accounting=True, use_extension=use)
               for use in (True, False)]
    assert isinstance(budgets[1].core, PyArgminCore) and not isinstance(budgets[0].core, PyArgminCore)
    for b in budgets:
        b.set_candidates(mask)
        b.set_routable([not m for m in mask])
        b.update_budget(snaps)

    def outcome(b, op):
        kind, size, routed = op
        try:
            if kind == 0:
                return b.core.pick(TokReq(num_tokens=size, routed_dp_rank=routed))
            if kind == 1:
                return b.core.pick_batch([Req(input_ids=[0] * size), Req(routed_dp_rank=routed)])
            if kind == 2:
                return b.core.pick_tokens(size)
            # inflight_cache: each rank holds a different share of the prompt
            savings = np.array([(size * (r + 1)) % 60 for r in range(n)], np.int64)
            return b.core.pick_saving(TokReq(num_tokens=size, routed_dp_rank=routed), savings)
        except (ValueError, RuntimeError) as e:
            return type(e).__name__, str(e)

    for op in ops:
        results = [outcome(b, op) for b in budgets]
        assert results[0] == results[1]
    for name in ("total_tokens", "total_requests", "backlog", "sent_reqs", "sent_tokens", "ring"):
        assert getattr(budgets[0], name).tolist() == getattr(budgets[1], name).tolist()


# -- inflight_ttft: the queued prefill while the KV has room, the KV once it has not ---------------------


@pytest.mark.parametrize("use_extension", [True, False])
def test_inflight_ttft_prefers_ranks_whose_kv_holds_the_prompt(use_extension):
    reader = ListReader(3)
    # (used, total = used + waiting seqlens, capacity): rank 0 has no queue but a nearly full KV; rank 1
    # a queue of 300 tokens and room; rank 2 a queue of 100 and room
    for r, (used, total) in enumerate([(960, 960), (200, 500), (300, 400)]):
        reader.snaps[r] = LoadSnapshot(dp_rank=r, num_used_tokens=used, num_total_tokens=total,
                                       max_total_num_tokens=1000, publish_seq=1, timestamp_ns=1)
    d = Dispatcher(M.INFLIGHT_TTFT, 3, reader=reader, clock=FakeClock(), use_extension=use_extension)
    # 100 tokens: rank 0 would hold 960 + 100 > 1000, so it comes last; rank 2's queue (100 + 100)
    # beats rank 1's (300 + 100). inflight_backlog would take rank 0 (an empty queue).
    assert d.dispatch(TokReq(num_tokens=100)) == 2
    backlog = Dispatcher(M.INFLIGHT_BACKLOG, 3, reader=reader, clock=FakeClock(), use_extension=use_extension)
    assert backlog.dispatch(TokReq(num_tokens=100)) == 0
    # rank 2 now holds 400 + 100 = 500: a 600-token prompt fits nowhere (960, 500, 500 + 600 > 1000),
    # and the rank with the fewest tokens plus the prompt frees room first: rank 1 (500) before rank 2
    # (the 100 just charged: 500), scanning from the rank after the last pick
    assert d.dispatch(TokReq(num_tokens=600)) == 1
    assert d.budget.capacity.tolist() == [1000, 1000, 1000]


@dataclass
class HashedReq:
    """A request as the ZMQ controller hands it over: its prompt and the block hashes of its frame."""

    input_ids: list[int]
    block_hashes: list[int]
    routed_dp_rank: int | None = None


@pytest.mark.parametrize("use_extension", [True, False])
def test_inflight_ttft_with_room_everywhere_decides_as_inflight_cache(use_extension):
    from dpboard.controller.prefix_index import block_hashes

    prompts = [[1000 * (k % 7) + i for i in range(37 * (k % 5 + 1))] for k in range(60)]
    reqs = [HashedReq(p, block_hashes(p, 4)) for p in prompts]
    _, reader = cache_dispatcher(n=5)

    def made(method):
        return Dispatcher(method, 5, reader=reader, clock=FakeClock(), prefix_block_size=4, use_extension=use_extension)

    ttft, cache = made(M.INFLIGHT_TTFT), made(M.INFLIGHT_CACHE)
    picks = [ttft.dispatch(r) for r in reqs]
    assert picks == [cache.dispatch(r) for r in reqs]
    assert ttft.budget.backlog.tolist() == cache.budget.backlog.tolist()  # the same uncached parts charged
    assert made(M.INFLIGHT_TTFT).dispatch_batch(reqs) == made(M.INFLIGHT_CACHE).dispatch_batch(reqs)
    # a request that carries no block hashes is not hashed (that would cost more than the decision):
    # it takes the plain pick, with the same cost and no saving, as inflight_backlog does
    ttft, backlog = made(M.INFLIGHT_TTFT), made(M.INFLIGHT_BACKLOG)
    plain = [Req(input_ids=p) for p in prompts]
    assert [ttft.dispatch(r) for r in plain] == [backlog.dispatch(r) for r in plain]
    assert made(M.INFLIGHT_TTFT).dispatch_batch(plain) == made(M.INFLIGHT_BACKLOG).dispatch_batch(plain)
    assert ttft.prefix.held(0) == 0


# -- inflight_cache: exact loads plus the controller's prefix index ------------------------------------


def cache_dispatcher(n=4, capacity_tokens=100_000, **kw):
    reader = ListReader(n)
    for r in range(n):
        reader.snaps[r] = LoadSnapshot(dp_rank=r, max_total_num_tokens=capacity_tokens, publish_seq=1, timestamp_ns=1)
    return Dispatcher(M.INFLIGHT_CACHE, n, reader=reader, clock=FakeClock(), prefix_block_size=4, **kw), reader


def test_inflight_cache_sends_a_follow_up_turn_to_the_rank_that_holds_its_prefix():
    d, reader = cache_dispatcher()
    first = d.dispatch(Req(input_ids=list(range(100))))
    assert d.budget.backlog.tolist()[first] == 100
    # the first turn's prefill is done: the rank reports it as KV in use, nothing queued
    reader.snaps[first] = reader.snaps[first]._replace(num_used_tokens=100, num_total_tokens=100,
                                                         num_received_reqs=1, publish_seq=2, timestamp_ns=2)
    d._clock.now += 1  # past the refresh throttle
    follow_up = d.dispatch(Req(input_ids=list(range(140))))
    assert follow_up == first
    assert d._savings[first] == 100  # its first 100 tokens were cached there
    assert d.budget.backlog[first] == 40  # only the uncached 40 were charged as queued prefill


def test_inflight_cache_weighs_the_queue_against_the_cache():
    d, reader = cache_dispatcher(n=2)
    prefix = list(range(400))
    holder = d.dispatch(Req(input_ids=prefix))
    other = 1 - holder
    # the holder is now busy: 1000 queued prefill tokens; the other rank is idle
    reader.snaps[holder] = reader.snaps[holder]._replace(num_used_tokens=400, num_total_tokens=1400,
                                                           num_received_reqs=1, publish_seq=2, timestamp_ns=2)
    d._clock.now += 1
    # cost on the holder: 1000 queued + 20 uncached; on the other: 0 + 420 -> the other wins
    assert d.dispatch(Req(input_ids=prefix + list(range(1000, 1020)))) == other


def test_inflight_cache_without_reuse_is_inflight_backlog():
    """No two prompts share a block: the cache never saves anything and the picks are inflight_backlog's."""
    prompts = [[1000 * k + i for i in range(37 * (k % 5 + 1))] for k in range(60)]
    cache, _ = cache_dispatcher(n=5)
    backlog = Dispatcher(M.INFLIGHT_BACKLOG, 5, reader=cache.reader, clock=FakeClock())
    assert [cache.dispatch(Req(input_ids=p)) for p in prompts] == [backlog.dispatch(Req(input_ids=p)) for p in prompts]


def test_inflight_cache_routed_batches_retract_and_capacity():
    d, reader = cache_dispatcher(n=3, capacity_tokens=40)  # 10 blocks of 4 tokens per rank
    assert [d.prefix.capacity(r) for r in range(3)] == [4096] * 3  # until the first refresh
    assert d.dispatch(Req(input_ids=list(range(80)), routed_dp_rank=2)) == 2
    assert [d.prefix.capacity(r) for r in range(3)] == [10] * 3
    assert d.prefix.held(2) == 10  # 20 blocks sent, 10 kept: the rank's KV capacity
    # routed: charged the uncached part on the routed rank
    assert d.dispatch(Req(input_ids=list(range(80)), routed_dp_rank=2)) == 2
    assert d.budget.backlog[2] == 80 + 40
    # retract takes back exactly what the pick charged
    d.retract(2, Req(input_ids=list(range(80))))
    assert d.budget.backlog[2] == 80
    # a batch is all or nothing for the budget
    before = d.budget.backlog.tolist()
    with pytest.raises(ValueError, match="DP rank 7 is not active"):
        d.dispatch_batch([Req(input_ids=list(range(500, 540))), Req(routed_dp_rank=7)])
    assert d.budget.backlog.tolist() == before
    assert len(d.dispatch_batch([Req(input_ids=list(range(600, 640))) for _ in range(3)])) == 3


def test_inflight_cache_is_health_aware():
    d, reader = cache_dispatcher(n=2)
    holder = d.dispatch(Req(input_ids=list(range(100))))
    d.set_status(holder, False)
    assert d.dispatch(Req(input_ids=list(range(100)))) == 1 - holder
    d.set_status(1 - holder, False)
    with pytest.raises(RuntimeError, match="no DP rank can take the request"):
        d.dispatch(Req(input_ids=list(range(100))))


def test_the_backlog_methods_take_the_queued_prefill_an_engine_reports(board_name):
    """A writer that publishes a detail with num_waiting_uncached_tokens (SGLang's figure: cached
    prefixes out, a prompt in chunked prefill in) gives the backlog; without one, total - used."""
    from dpboard.snapshot import LoadDetail

    with Board.create(board_name, n_slots=3) as board:
        w = [board.writer(r) for r in range(3)]
        # rank 0 looks idle to total - used, but reports 9000 tokens of a chunked prompt still to prefill
        w[0].publish_detailed(LoadSnapshot(dp_rank=0, num_used_tokens=500, num_total_tokens=500),
                              LoadDetail(num_waiting_uncached_tokens=9000))
        # rank 1 has 4000 seqlen waiting, of which the engine says 3000 are cached
        w[1].publish_detailed(LoadSnapshot(dp_rank=1, num_used_tokens=500, num_total_tokens=4500),
                              LoadDetail(num_waiting_uncached_tokens=1000))
        # rank 2 publishes no detail: its backlog is total - used
        w[2].publish(LoadSnapshot(dp_rank=2, num_used_tokens=500, num_total_tokens=2500))
        for method in (M.INFLIGHT_BACKLOG, M.INFLIGHT_CACHE):
            d = Dispatcher(method, 3, reader=board.reader())
            d.refresh()
            assert d.budget.backlog.tolist() == [9000, 1000, 2000]
            assert d.dispatch(TokReq(num_tokens=10)) == 1
        # the token methods keep reading the dispatch fields only
        d = Dispatcher(M.INFLIGHT_TOKENS, 3, reader=board.reader())
        d.refresh()
        assert d.budget.total_tokens.tolist() == [500, 4500, 2500]
