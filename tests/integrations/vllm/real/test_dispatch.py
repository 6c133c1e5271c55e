"""API-server side: vLLM's DPLBAsyncMPClient picks through dpboard's Dispatcher with DPBOARD_METHOD,
keeping vLLM's own rules, and exactly as vLLM does without it."""

from __future__ import annotations

import asyncio
import contextlib
import copy

import pytest
from vllm.pooling_params import LateInteractionParams, PoolingParams
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.core_client import DPLBAsyncMPClient
from vllm.v1.pool.late_interaction import get_late_interaction_engine_index

from dpboard.board import Board
from dpboard.errors import InvalidInputError
from dpboard.integrations.vllm import dispatch, versions
from dpboard.snapshot import LoadSnapshot
from tests.integrations.vllm.real.conftest import vllm_config
from tests.support.vllm_engine import engine_request, make_client


def with_board(client, board_name):
    state = dispatch.client_dispatch(client)
    setattr(client, dispatch.STATE, state)
    return state


@contextlib.contextmanager
def engines_on_board(board_name, running, *, n_engines=None, first_rank=0):
    """A board whose engines publish ``running`` requests each, and a client over ``n_engines`` of
    them from ``first_rank`` (all by default) picking through it; yields (client, state)."""
    board = Board.create(board_name, len(running))
    writers = []
    for rank, load in enumerate(running):
        writers.append(board.writer(rank))
        writers[-1].publish(LoadSnapshot(dp_rank=rank, num_running_reqs=load, max_total_num_tokens=1000))
    client = make_client(vllm_config(len(running)), n_engines or len(running), first_rank=first_rank)
    state = with_board(client, board_name)
    try:
        yield client, state
    finally:
        state.close()
        for w in writers:
            w.close()
        board.close()
        board.unlink()


def test_the_plugin_wraps_vllms_client():
    assert DPLBAsyncMPClient._dpboard_patched
    assert DPLBAsyncMPClient._dpboard_original_pick.__module__ == "vllm.v1.engine.core_client"


def test_without_dpboard_method_vllms_pick_is_untouched(monkeypatch):
    monkeypatch.delenv("DPBOARD_METHOD", raising=False)
    patched = make_client(vllm_config(4), 4, client_index=1, client_count=2)
    assert dispatch.client_dispatch(patched) is None
    setattr(patched, dispatch.STATE, None)
    shipped = make_client(vllm_config(4), 4, client_index=1, client_count=2)
    loads = [[3, 1, 0.9], [0, 2, 0.1], [5, 0, 0.6], [0, 0, 0.0]]
    patched.lb_engines, shipped.lb_engines = copy.deepcopy(loads), copy.deepcopy(loads)
    requests = [engine_request(f"r{i}", 8, data_parallel_rank=2 if i == 5 else None) for i in range(12)]
    picks = [patched.get_core_engine_for_request(r) for r in requests]
    expected = [DPLBAsyncMPClient._dpboard_original_pick(shipped, r) for r in requests]
    assert picks == expected
    assert (patched.lb_engines, patched.eng_start_index, patched.engine_inflight) == \
        (shipped.lb_engines, shipped.eng_start_index, shipped.engine_inflight)


def test_dpboard_method_picks_the_least_loaded_engine_on_the_board(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    with engines_on_board(board_name, [5, 1, 3, 2]) as (client, state):
        picks = [client.get_core_engine_for_request(engine_request(f"r{i}", 8)) for i in range(4)]
        ranks = [int.from_bytes(e, "little") for e in picks]
        # running 5,1,3,2; each pick adds one; equal loads go to the first rank after the last pick
        assert ranks == [1, 3, 1, 2]
        assert client.engine_inflight == {e: picks.count(e) for e in set(picks)}
        assert client.reqs_in_flight == {f"r{i}": picks[i] for i in range(4)}
        assert state.sent.totals()[:, 0].tolist() == [0, 2, 1, 1]
        assert client.lb_engines == [[0, 0, 0.0]] * 4  # vLLM's coordinator counts are not touched


def test_vllms_own_routing_rules_hold_with_dpboard_method(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    with engines_on_board(board_name, [0, 9, 9, 9]) as (client, state):
        # an explicit data_parallel_rank is kept, and charged
        assert client.get_core_engine_for_request(engine_request("x", 8, data_parallel_rank=2)) == client.core_engines[2]
        # streaming input: the session's later chunks go where its first went, and count as sent there;
        # vLLM 0.33 keeps the session in streaming_reqs, 0.32 has no such set (and its pick none either)
        sessions = versions.support_for(versions.vllm_version()).streaming_sessions
        assert hasattr(client, "streaming_reqs") is sessions
        first = client.get_core_engine_for_request(engine_request("s", 8, data_parallel_rank=3, resumable=True))
        assert not sessions or "s" in client.streaming_reqs
        again = client.get_core_engine_for_request(engine_request("s", 4, resumable=True))
        last = client.get_core_engine_for_request(engine_request("s", 4, resumable=False))
        assert first == again == last == client.core_engines[3]
        assert not sessions or "s" not in client.streaming_reqs
        assert state.sent.totals()[3, 0] == 3 and client.engine_inflight[client.core_engines[3]] == 1
        # late interaction: a query's requests stay on the engine vLLM pins its query key to
        params = PoolingParams(late_interaction_params=LateInteractionParams(mode="score_doc", query_key="q7"))
        pinned = get_late_interaction_engine_index(params, 4)
        request = engine_request("li", 8)
        request.pooling_params = params
        assert client.get_core_engine_for_request(request) == client.core_engines[pinned]
        # vLLM's own finish bookkeeping sees every pick
        outputs = EngineCoreOutputs(engine_index=2, finished_requests={"x"})
        asyncio.run(DPLBAsyncMPClient.process_engine_outputs(client, outputs))
        assert "x" not in client.reqs_in_flight and client.engine_inflight[client.core_engines[2]] == 0


def test_hybrid_client_maps_its_local_engines_to_their_global_slots(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    # this node's engines: ranks 4..7; rank 6 idle
    with engines_on_board(board_name, [9, 9, 9, 9, 9, 9, 0, 9], n_engines=4, first_rank=4) as (client, state):
        assert client.get_core_engine_for_request(engine_request("a", 8)) == (6).to_bytes(2, "little")
        assert state.sent.totals()[6, 0] == 1


def test_a_bad_method_or_no_board_is_refused_with_the_fix(monkeypatch, board_name):
    client = make_client(vllm_config(2), 2)
    monkeypatch.setenv("DPBOARD_METHOD", "fastest")
    with pytest.raises(InvalidInputError, match="DPBOARD_METHOD='fastest'"):
        dispatch.client_dispatch(client)
    monkeypatch.setenv("DPBOARD_METHOD", "follow_bootstrap_room")
    with pytest.raises(InvalidInputError, match="which vLLM's requests do not carry"):
        dispatch.client_dispatch(client)
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_wave")
    with pytest.raises(InvalidInputError, match="holds requests for waves.*use inflight_lockstep here"):
        dispatch.client_dispatch(client)
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    monkeypatch.delenv("DPBOARD_VLLM_BOARD")
    with pytest.raises(InvalidInputError, match="DPBOARD_VLLM_BOARD=NAME"):
        dispatch.client_dispatch(client)


def test_while_no_engine_is_live_vllms_own_pick_decides(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    Board.create(board_name, 3).close()  # nobody publishes: every slot EMPTY
    client = make_client(vllm_config(3), 3, client_index=1, client_count=3)
    client.lb_engines = [[0, 4, 0.2], [0, 0, 0.0], [0, 9, 0.2]]
    state = with_board(client, board_name)
    try:
        engine = client.get_core_engine_for_request(engine_request("a", 8))
        assert engine == client.core_engines[1]  # vLLM's score: the empty engine
        assert client.reqs_in_flight == {"a": engine} and state.sent.totals()[1, 0] == 1
    finally:
        state.close()


def test_an_exception_in_dpboards_pick_or_accounting_is_answered_by_vllms_own_pick(board_name, monkeypatch, caplog):
    """A bug in dpboard's pick (here: the dispatcher raising) or in its accounting (the sent row
    raising) never reaches the request: vLLM's own pick places it, with vLLM's bookkeeping; each is
    counted (a fallback in the dispatch record, the session's ``faults``) and logged at the 1st, 10th, ... time."""
    from dpboard.board.dispatch_record import read_dispatch_record

    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    with engines_on_board(board_name, [0, 0, 0]) as (client, state):
        shipped = make_client(vllm_config(3), 3)

        def broken(request):
            raise RuntimeError("injected")

        monkeypatch.setattr(state.dispatcher, "dispatch", broken)
        requests = [engine_request(f"r{i}", 8) for i in range(12)]
        with caplog.at_level("WARNING", logger="dpboard.vllm"):
            picks = [client.get_core_engine_for_request(r) for r in requests]
        assert picks == [DPLBAsyncMPClient._dpboard_original_pick(shipped, r) for r in requests]
        assert client.reqs_in_flight == {f"r{i}": picks[i] for i in range(12)}
        assert client.engine_inflight == shipped.engine_inflight
        assert state.sent.totals()[:, 0].sum() == 12  # still counted as sent: in flight stays exact
        assert state.session.faults == 12 and state.session.tally.fallbacks == 12
        said = [r for r in caplog.records if "injected" in r.getMessage()]
        assert [f"#{n}" in r.getMessage() for r, n in zip(said, (1, 10), strict=True)] == [True, True]
        assert said[0].exc_info is not None and said[1].exc_info is None  # the first with its traceback
        state.session.publish()
        rows = [row for row in read_dispatch_record(board_name) if row.alive]
        assert [row.counts["fallbacks"] for row in rows] == [12]

        # the accounting raising after dpboard picked: vLLM's pick again, and the request is placed once
        monkeypatch.undo()
        monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")

        def no_row(slot, tokens):
            raise OSError("injected accounting")

        monkeypatch.setattr(state.row, "add", no_row)
        engine = client.get_core_engine_for_request(engine_request("acc", 8))
        assert client.reqs_in_flight["acc"] == engine and sum(client.engine_inflight.values()) == 13
        assert state.session.faults == 14  # the pick's accounting, then the fallback's: both counted
