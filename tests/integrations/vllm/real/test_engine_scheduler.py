"""The engine core's published load against vLLM 0.33.0's own scheduler: vLLM's ``Scheduler`` and
``KVCacheManager`` on the CPU, stepped by vLLM's ``EngineCore.step`` (the model a stand-in that
samples one token), so chunked prefill, preemption and prefix caching happen as in vLLM. Each step's
slot is checked against the ``SchedulerStats`` vLLM made for that same step."""

from __future__ import annotations

import random

import pytest
from vllm.v1.request import RequestStatus

from dpboard.board import Board
from dpboard.integrations.vllm import engine_core, waiting
from tests.support.vllm_engine import (
    as_request,
    engine_config,
    engine_request,
    kv_cache_config,
    make_engine,
    make_scheduler,
    real_engine,
    step,
    take_in,
)


def close(engine) -> None:
    publisher = engine.__dict__.get(engine_core.STATE)
    if publisher:
        publisher.close()


def step_stats(engine):
    """One engine step; the SchedulerStats vLLM sent with its outputs (to one client)."""
    engine._process_engine_step()
    stats = []
    while not engine.output_queue.empty():
        _, outputs = engine.output_queue.get_nowait()
        if outputs.scheduler_stats is not None:
            stats.append(outputs.scheduler_stats)
    assert len(stats) == 1
    return stats[0]


def check_slot(reader, rank: int, engine, stats) -> None:
    """The slot, field by field, beside vLLM's own figures for the same step."""
    capacity = engine.vllm_config.cache_config.kv_cache_size_tokens  # vLLM's group-aware capacity
    snap = reader.read(rank)
    _, _, detail = reader.read_detail(rank)
    assert snap.num_running_reqs == stats.num_running_reqs
    assert snap.num_waiting_reqs == stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
    assert snap.max_total_num_tokens == capacity
    assert detail.token_usage == stats.kv_cache_usage
    assert snap.num_used_tokens == round(stats.kv_cache_usage * capacity)
    queued = waiting.walk(engine.scheduler)  # every waiting request's prefill still to do
    assert detail.num_waiting_uncached_tokens == queued
    assert snap.num_total_tokens == snap.num_used_tokens + queued


def test_each_step_publishes_what_vllms_scheduler_stats_say_through_chunks_preemption_and_prefix_hits(board_name):
    # 16 usable blocks of 16 tokens, at most 64 tokens a step: 60-token prompts take two steps,
    # four requests of 60 + 20 tokens (5 blocks each) do not fit together
    engine = real_engine(3, 2, num_blocks=17, max_num_batched_tokens=64)
    scheduler = engine.scheduler
    seen = {"chunked": 0, "preempted": 0, "hits": 0, "waiting": 0}
    try:
        for i in range(4):
            take_in(engine, engine_request(f"r{i}", 60, max_tokens=20, first_token=1000 * i))
        board = Board.attach(board_name)
        reader = board.reader()
        again = False
        for _ in range(400):
            if not scheduler.has_requests():
                if again:
                    break
                # r0's prompt again, and a longer one on it: r0's blocks are in vLLM's prefix cache
                take_in(engine, engine_request("again0", 60, max_tokens=4, first_token=0))
                take_in(engine, engine_request("again1", 70, max_tokens=4, first_token=0))
                again = True
            stats = step_stats(engine)
            check_slot(reader, 2, engine, stats)
            seen["chunked"] += any(r.is_prefill_chunk for r in scheduler.running)
            seen["preempted"] += stats.prefix_cache_stats.preempted_requests
            seen["hits"] += stats.prefix_cache_stats.hits
            seen["waiting"] += stats.num_waiting_reqs > 0 and stats.num_running_reqs > 0
        else:
            pytest.fail("vLLM's scheduler did not finish its requests in 400 steps")
        # what this test is about did happen, in vLLM's own scheduler
        assert seen["chunked"] and seen["preempted"] and seen["hits"] and seen["waiting"], seen
        snap = reader.read(2)
        assert (snap.num_running_reqs, snap.num_waiting_reqs, snap.num_used_tokens, snap.num_total_tokens) == (0, 0, 0, 0)
        assert snap.num_received_reqs == 6
        board.close()
    finally:
        close(engine)


def test_hybrid_model_capacity_is_vllms_group_aware_figure(board_name):
    # full attention beside a 32-token sliding window, one block pool: a request at max_model_len
    # takes all its blocks in the full group and only its window's in the other
    config = engine_config(1, 0, max_model_len=1024, max_num_batched_tokens=64)
    kv = kv_cache_config(129, sliding_window=32)
    scheduler = make_scheduler(config, kv)
    engine = make_engine(config, scheduler)
    try:
        assert len(scheduler.kv_cache_manager.coordinator.single_type_managers) == 2
        capacity = config.cache_config.kv_cache_size_tokens
        assert 0 < capacity < (kv.num_blocks - 1) * 16  # the blocks × block size overstates it
        for i in range(6):
            take_in(engine, engine_request(f"r{i}", 200, max_tokens=30, first_token=1000 * i))
        reader = Board.attach(board_name).reader()
        used = []
        for _ in range(300):
            stats = step_stats(engine)
            check_slot(reader, 0, engine, stats)
            used.append(reader.read(0).num_used_tokens)
            if not scheduler.has_requests():
                break
        assert max(used) > 0 and used[-1] == 0
        assert reader.read(0).max_total_num_tokens == capacity
    finally:
        close(engine)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_kept_waiting_figure_equals_a_walk_after_adds_preemptions_finishes_and_aborts(policy):
    """The sum waiting.py keeps as vLLM's queues change, beside a walk of every waiting request,
    after every operation of a random run through vLLM's scheduler."""
    rng = random.Random(7 if policy == "fcfs" else 8)
    config = engine_config(policy=policy, max_num_batched_tokens=96, max_num_seqs=6)
    scheduler = make_scheduler(config, kv_cache_config(25))
    engine = make_engine(config, scheduler)  # its request hasher, for prefix caching
    waiting.queued_tokens(scheduler)  # the queues counted from here on
    kept = waiting.QueuedTokens()  # the publisher's: the two queues looked up once
    seen = {"preempted": 0, "aborted waiting": 0, "finished": 0}
    for n in range(600):
        op = rng.random()
        if op < 0.35:
            request = engine_request(f"q{n}", rng.randint(1, 120), max_tokens=rng.randint(1, 40),
                                     first_token=rng.choice([1, 1000, 5000 * n]), priority=rng.randint(0, 3),
                                     arrival_time=float(n))
            scheduler.add_request(as_request(engine, request))
        elif op < 0.45 and scheduler.requests:
            ids = rng.sample(sorted(scheduler.requests), k=min(len(scheduler.requests), rng.randint(1, 3)))
            waiting_ids = {r.request_id for q in (scheduler.waiting, scheduler.kv_holding_waiting) for r in q}
            seen["aborted waiting"] += len(waiting_ids & set(ids))
            scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        else:
            before = sum(r.num_preemptions for r in scheduler.requests.values())
            outputs = step(scheduler)
            seen["preempted"] += sum(r.num_preemptions for r in scheduler.requests.values()) > before
            seen["finished"] += sum(o.finish_reason is not None for eco in outputs.values() for o in eco.outputs)
        assert kept(scheduler) == waiting.queued_tokens(scheduler) == waiting.walk(scheduler), (policy, n)
    assert all(seen.values()), seen


def test_the_publishers_figure_follows_a_queue_the_scheduler_replaces():
    config = engine_config()
    scheduler = make_scheduler(config, kv_cache_config(65))
    engine = make_engine(config, scheduler)
    kept = waiting.QueuedTokens()
    scheduler.add_request(as_request(engine, engine_request("a", 30)))
    assert kept(scheduler) == 30
    fresh = type(scheduler.waiting).__mro__[1]()  # vLLM's own queue class, a new object
    fresh.add_request(as_request(engine, engine_request("b", 12, first_token=500)))
    scheduler.waiting = fresh
    assert kept(scheduler) == 12 == waiting.walk(scheduler)
    scheduler.waiting.add_request(as_request(engine, engine_request("c", 5, first_token=900)))
    assert kept(scheduler) == 17 == waiting.walk(scheduler)


def test_a_queue_that_cannot_be_counted_is_walked():
    """A scheduler class of one's own (``--scheduler-cls``) may keep its waiting requests in a plain
    deque: it cannot take the counted class, and its figure is a walk, still exact."""
    from collections import deque

    config = engine_config()
    scheduler = make_scheduler(config, kv_cache_config(65))
    engine = make_engine(config, scheduler)
    scheduler.waiting = deque()
    for i in range(3):
        scheduler.waiting.append(as_request(engine, engine_request(f"w{i}", 10 * (i + 1), first_token=100 * i)))
    assert waiting.queued_tokens(scheduler) == 60 == waiting.walk(scheduler)
    kept = waiting.QueuedTokens()
    assert kept(scheduler) == 60
    scheduler.waiting.append(as_request(engine, engine_request("w3", 7, first_token=700)))
    assert kept(scheduler) == 67 == waiting.walk(scheduler)
    assert type(scheduler.waiting) is deque


def test_capacity_vllm_left_unset_is_vllms_own_function_over_the_schedulers_groups():
    config = engine_config(max_model_len=1024, max_num_batched_tokens=64)
    scheduler = make_scheduler(config, kv_cache_config(129, sliding_window=32))
    expected = config.cache_config.kv_cache_size_tokens  # what vLLM's engine core set
    config.cache_config.kv_cache_size_tokens = None
    assert engine_core.capacity_tokens(config, scheduler) == expected < 128 * 16
