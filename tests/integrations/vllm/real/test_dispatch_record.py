"""vLLM's DPLBAsyncMPClient with DPBOARD_METHOD publishes its row of the board's dispatch record:
the requests it handed each engine, the explicit data_parallel_rank share, vLLM's own picks while no
engine is live (fallbacks), read back as ``dpboard doctor`` reads them."""

from __future__ import annotations

import time

import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.board.dispatch_record import read_dispatch_record
from tests.integrations.vllm.real.conftest import vllm_config
from tests.integrations.vllm.real.test_dispatch import engines_on_board, with_board
from tests.support.vllm_engine import engine_request, make_client

pytestmark = pytest.mark.timeout(120)


def test_each_api_server_publishes_its_row(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    with engines_on_board(board_name, [5, 1, 3, 2]) as (client, state):
        for i in range(6):
            client.get_core_engine_for_request(engine_request(f"r{i}", 8, data_parallel_rank=3 if i < 4 else None))
        time.sleep(0.12)  # past the record's publish interval: the next refresh publishes what came before
        sent_before = state.sent.totals()[:, 0].tolist()
        client.get_core_engine_for_request(engine_request("last", 8))
        (row,) = read_dispatch_record(board_name)
        assert (row.method, row.mode, row.row) == ("inflight_requests", "null", client.client_index)
        assert row.counts["requests"] == 6 and row.counts["routed"] == 4 and row.counts["fallbacks"] == 0
        assert row.routed_per_rank == [0, 0, 0, 4]
        assert row.per_rank == sent_before  # the same requests the sent record counts


def test_an_idle_api_servers_last_picks_reach_the_record(board_name, monkeypatch):
    """Picks made on a running event loop, as vLLM's API server makes them, then nothing: the loop's
    trailing turn puts them in the record within the tally's 0.1 s, with no later pick."""
    import asyncio

    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    with engines_on_board(board_name, [5, 1, 3, 2]) as (client, _):
        async def burst_then_idle() -> int:
            for i in range(7):
                client.get_core_engine_for_request(engine_request(f"r{i}", 8))
            for _ in range(50):  # bounded: 5 s
                (row,) = read_dispatch_record(board_name)
                if row.counts["requests"] == 7:
                    break
                await asyncio.sleep(0.1)
            return row.counts["requests"]

        assert asyncio.run(burst_then_idle()) == 7


def test_vllms_own_picks_while_no_engine_is_live_count_as_fallbacks(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
    Board.create(board_name, 3).close()  # nobody publishes: every slot EMPTY
    client = make_client(vllm_config(3), 3, client_index=1, client_count=3)
    state = with_board(client, board_name)
    try:
        for rid in "abc":
            client.get_core_engine_for_request(engine_request(rid, 8))
        time.sleep(0.12)  # the next refresh publishes what came before
        client.get_core_engine_for_request(engine_request("d", 8))
        rows = read_dispatch_record(board_name)
        assert [r.row for r in rows] == [1]  # row client_index of client_count rows
        assert rows[0].counts["fallbacks"] == 3 and rows[0].counts["requests"] == 3
    finally:
        state.close()
    # the last process of the board out (no slot written, its creator this one) removes it and its records
    assert not list(SHM_DIR.glob(f"*{board_name}"))
