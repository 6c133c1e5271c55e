"""Engine side: vLLM's engine-core intake and step, patched by dpboard's general plugin, publish each
engine's load into its rank's slot with an exact count of the requests it took in."""

from __future__ import annotations

import time

import vllm.v1.engine.core as core
from vllm.v1.engine.core import EngineShutdownState

from dpboard.board import Board
from dpboard.integrations.vllm import engine_core, waiting
from dpboard.snapshot import LoadDetail, LockstepDetail, SlotStatus
from tests.support.procutil import wait_until
from tests.support.vllm_engine import engine_request, real_engine, take_in


def close(engine) -> None:
    publisher = engine.__dict__.get(engine_core.STATE)
    if publisher:
        publisher.close()


def test_vllm_loads_the_plugin_into_the_engine_core_class():
    assert core.EngineCoreProc._dpboard_patched
    # DPEngineCoreProc (data parallel) inherits the patched methods
    assert core.DPEngineCoreProc._process_engine_step is core.EngineCoreProc._process_engine_step


def test_no_board_named_nothing_published(monkeypatch):
    monkeypatch.delenv("DPBOARD_VLLM_BOARD", raising=False)
    monkeypatch.delenv("DPBOARD_VLLM", raising=False)
    engine = real_engine(2, 1)
    scheduler = engine.scheduler
    take_in(engine, engine_request("a", 10))
    engine._process_engine_step()
    assert engine.__dict__[engine_core.STATE] is None
    assert len(scheduler.running) == 1  # vLLM's own work goes on untouched


def test_each_step_publishes_the_scheduler_and_the_exact_received_count(board_name):
    engine = real_engine(3, 2, num_blocks=9)  # 8 usable blocks of 16 tokens
    scheduler = engine.scheduler
    try:
        for i in range(3):
            # 3 blocks each for their prompts: vLLM's scheduler admits two, the third waits
            take_in(engine, engine_request(f"r{i}", 40, max_tokens=8, first_token=1000 * i))
        board = Board.attach(board_name)
        reader = board.reader()
        engine._process_engine_step()
        snap = reader.read(2)
        assert reader.status(2) is SlotStatus.LIVE
        assert snap.num_received_reqs == 3
        assert (snap.num_running_reqs, snap.num_waiting_reqs) == scheduler.get_request_counts() == (2, 1)
        usage = scheduler.kv_cache_manager.usage
        capacity = engine.vllm_config.cache_config.kv_cache_size_tokens
        assert snap.max_total_num_tokens == capacity
        assert snap.num_used_tokens == round(usage * capacity) > 0
        assert snap.num_total_tokens == snap.num_used_tokens + 40  # plus the prompt still waiting for admission
        status, _, detail = reader.read_detail(2)
        # the detail is what pack_detail packs of these figures and the engine's lockstep section (3
        # engines under DP, its step budget the chunk), nothing else set
        section = LockstepDetail(group_size=3, chunk_tokens=engine.vllm_config.scheduler_config.max_num_batched_tokens)
        assert engine_core.lockstep_section(engine.vllm_config) == section
        assert detail == LoadDetail(timestamp=detail.timestamp, num_waiting_uncached_tokens=40, token_usage=usage,
                                    max_running_requests=engine.vllm_config.scheduler_config.max_num_seqs,
                                    lockstep=section)
        assert abs(detail.timestamp - time.time()) < 60
        stamped = detail.timestamp
        take_in(engine, engine_request("r3", 5, max_tokens=1))
        assert reader.read(2).num_received_reqs == 3  # taken in, published with the queue it joins
        engine._process_engine_step()
        assert reader.read(2).num_received_reqs == 4
        _, _, detail = reader.read_detail(2)
        assert detail.timestamp >= stamped and detail.token_usage == scheduler.kv_cache_manager.usage
        assert detail.num_waiting_uncached_tokens == waiting.walk(scheduler)
        for _ in range(100):
            if not scheduler.has_requests():
                break
            engine._process_engine_step()
        snap = reader.read(2)
        assert (snap.num_running_reqs, snap.num_waiting_reqs, snap.num_used_tokens) == (0, 0, 0)
        assert snap.num_received_reqs == 4
        board.close()
    finally:
        close(engine)


def test_refused_and_malformed_requests_count_as_received(board_name):
    engine = real_engine(2, 0)
    sent_errors = []
    engine._send_error_outputs_to_client = lambda ids, client: sent_errors.append(ids)
    engine._send_finish_outputs_to_client = lambda ids, client, *args: sent_errors.append(ids)
    engine._send_abort_outputs_to_client = lambda ids, client, *args: sent_errors.append(ids)
    try:
        take_in(engine, engine_request("ok", 4))
        engine._handle_request_preproc_error(engine_request("bad", 4))  # the input thread answers it
        refused = []
        if hasattr(engine, "_reject_add_while_paused"):  # vLLM 0.33 pauses: it refuses new requests with an error
            engine.reject_new_requests = True
            take_in(engine, engine_request("paused", 4))
            engine.reject_new_requests = False
            refused.append(["paused"])
        engine.shutdown_state = EngineShutdownState.REQUESTED  # shutting down: vLLM aborts new requests
        take_in(engine, engine_request("late", 4))
        engine.shutdown_state = EngineShutdownState.RUNNING
        refused.append(["late"])
        engine._process_engine_step()
        reader = Board.attach(board_name).reader()
        assert reader.read(0).num_received_reqs == 2 + len(refused)
        assert sent_errors == [["bad"], *refused]
    finally:
        close(engine)


def test_an_idle_engine_stays_live_and_a_dead_one_goes_stale(board_name):
    engine = real_engine(2, 1)
    take_in(engine, engine_request("a", 4, max_tokens=1))
    engine._process_engine_step()  # finished: idle from here on, blocked on its input queue
    board = Board.attach(board_name)
    reader = board.reader(stale_after=0.6)
    try:
        first = reader.read(1).publish_seq
        assert wait_until(lambda: reader.read(1).publish_seq >= first + 3, timeout=10)
        assert reader.status(1) is SlotStatus.LIVE
    finally:
        close(engine)
    time.sleep(0.8)
    assert reader.status(1) is SlotStatus.STALE
    board.close()


def test_an_engine_asked_to_shut_down_leaves_its_slot_at_once_and_the_heartbeat_never_brings_it_back(board_name):
    """SIGTERM in an engine core sets its shutdown state (vLLM's run_engine_core); its busy loop asks
    ``_handle_shutdown`` next. From there on the slot reads STALE, before vLLM's teardown, however long
    that takes: the heartbeat, which kept an idle engine LIVE, is stopped first and publishes no more."""
    engine = real_engine(2, 1)
    take_in(engine, engine_request("a", 4, max_tokens=1))
    engine._process_engine_step()  # idle from here on: only the heartbeat publishes
    board = Board.attach(board_name)
    reader = board.reader(stale_after=30)  # no threshold can be what makes it stale here
    publisher = engine.__dict__[engine_core.STATE]
    try:
        first = reader.read(1).publish_seq
        assert wait_until(lambda: reader.read(1).publish_seq >= first + 2, timeout=10)  # the heartbeat runs
        assert reader.status(1) is SlotStatus.LIVE
        engine.shutdown_state = EngineShutdownState.REQUESTED  # what vLLM's signal handler does
        engine._handle_shutdown()  # the busy loop's next round
        assert reader.status(1) is SlotStatus.STALE  # at once, not after 30 s
        assert not publisher._thread.is_alive() and publisher.writer.closed
        seq = board.header.generation, reader.read(1).publish_seq
        engine._process_engine_step()  # a drain's step publishes nothing either
        assert (board.header.generation, reader.read(1).publish_seq) == seq
        assert reader.status(1) is SlotStatus.STALE and board.owner(1) == (0, 0)
    finally:
        close(engine)
        board.close()


def test_an_engine_on_another_node_stamps_its_node_for_the_relay(board_name, monkeypatch):
    monkeypatch.setenv("DPBOARD_VLLM_NODE_ID", "2")
    engine = real_engine(4, 3)
    try:
        take_in(engine, engine_request("a", 4))
        engine._process_engine_step()
        board = Board.attach(board_name)
        assert board.node_id == 2  # the engine core created its node's board
        snap = board.reader().read(3)
        assert (snap.node_id, snap.num_received_reqs) == (2, 1)  # what `dpboard relay --node-id 2` forwards
        board.close()
    finally:
        close(engine)
