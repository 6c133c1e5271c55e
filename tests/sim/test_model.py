"""The rank model: chunked prefill, prefix reuse, eviction, and KV accounting, worked by hand."""

from __future__ import annotations

import pytest

from dpboard.sim.model import RankConfig
from dpboard.sim.report import summarize
from dpboard.sim.simulation import PublishConfig, SimConfig, Simulation, simulate
from tests.support.traces import hand_trace

BASE = 0.005
PER_TOKEN = 1e-5


def config(chunk: int, kv: int = 100_000, ranks: int = 1) -> SimConfig:
    rank = RankConfig(
        kv_capacity=kv,
        chunked_prefill_size=chunk,
        prefill_base_s=BASE,
        prefill_s_per_token=PER_TOKEN,
        decode_base_s=0.01,
        decode_s_per_kv_token=0.0,
    )
    return SimConfig(n_ranks=ranks, rank=rank, send_delay_s=0.0, publish=PublishConfig(cadence="step"))


def test_chunked_prefill_splits_a_long_prompt_and_fills_the_last_chunk():
    trace = hand_trace([0.0, 0.001], [20_000, 1_000], [2, 2])
    (result,) = simulate(trace, ["round_robin"], config(chunk=8192))
    long, short = result.requests
    # three steps: 8192, 8192, then the last 3616 with the short prompt's 1000 (4616 tokens)
    end = 3 * BASE + 20_000 * PER_TOKEN + 1_000 * PER_TOKEN
    assert long.first_token_s == pytest.approx(end)
    assert short.first_token_s == pytest.approx(end)
    assert short.admitted_s == pytest.approx(2 * BASE + 2 * 8192 * PER_TOKEN)


def test_without_chunking_a_long_prompt_is_one_step_and_the_next_waits():
    trace = hand_trace([0.0, 0.001], [20_000, 1_000], [2, 2])
    (result,) = simulate(trace, ["round_robin"], config(chunk=0))
    long, short = result.requests
    assert long.first_token_s == pytest.approx(BASE + 20_000 * PER_TOKEN)
    assert short.first_token_s == pytest.approx(long.first_token_s + BASE + 1_000 * PER_TOKEN)


def test_a_cached_prefix_is_not_computed_again():
    # three requests one after another on one rank: the second repeats the first prompt (1100
    # tokens, blocks 1 2 3), the third shares its first two blocks (1024 tokens) and adds 476.
    trace = hand_trace(
        [0.0, 1.0, 2.0],
        [1100, 1100, 1500],
        [2, 2, 2],
        blocks=[(1, 2, 3), (1, 2, 3), (1, 2, 4)],
    )
    sim = Simulation(trace, "round_robin", config(chunk=8192))
    result = sim.run()
    first, again, sibling = result.requests
    assert first.first_token_s - first.arrival_s == pytest.approx(BASE + 1100 * PER_TOKEN)
    assert again.cached_tokens == 1099  # the last token is always computed
    assert again.first_token_s - again.arrival_s == pytest.approx(BASE + 1 * PER_TOKEN)
    assert sibling.cached_tokens == 1024
    assert sibling.first_token_s - sibling.arrival_s == pytest.approx(BASE + 476 * PER_TOKEN)
    assert summarize(result)["cache_hit_rate"] == pytest.approx((1099 + 1024) / 3700)
    rank = sim.ranks[0]
    # all done: nothing private, nothing pinned; the blocks stay cached (1, 2, 3, 4)
    assert rank.private_tokens == 0 and rank.cache.locked_tokens == 0 and rank.used_tokens == 0
    assert rank.cache.tokens == 1100 + 476


def test_without_block_ids_nothing_is_shared():
    trace = hand_trace([0.0, 1.0], [1100, 1100], [2, 2])
    (result,) = simulate(trace, ["round_robin"], config(chunk=8192))
    assert [r.cached_tokens for r in result.requests] == [0, 0]
    assert summarize(result)["cache_hit_rate"] == 0.0


def test_cached_blocks_give_way_when_running_requests_need_the_kv():
    # 30 distinct 1024-token prompts, 2 at a time on a 5000-token pool: the cache must evict.
    n = 30
    blocks = [(2 * i, 2 * i + 1) for i in range(n)]
    trace = hand_trace([0.05 * i for i in range(n)], [1024] * n, [50] * n, blocks=blocks)
    sim = Simulation(trace, "round_robin", config(chunk=8192, kv=5000))
    result = sim.run()
    rank = sim.ranks[0]
    assert result.evicted_tokens > 0
    assert all(r.finished_s > 0 for r in result.requests)
    assert rank.cache.tokens <= 5000 and rank.private_tokens == 0 and rank.cache.locked_tokens == 0
    assert rank.cache.tokens + result.evicted_tokens == n * 1024


def test_a_shared_prefix_is_stored_once_while_two_requests_use_it():
    # two requests with the same prompt in one prefill batch: both compute it (neither is cached
    # yet), the cache keeps one copy, pinned by both
    trace = hand_trace([0.0, 0.0], [1536, 1536], [200, 200], blocks=[(1, 2, 3), (1, 2, 3)])
    sim = Simulation(trace, "round_robin", config(chunk=8192))
    rank = sim.ranks[0]
    seen = []
    rank.on_first_token = lambda req: seen.append((rank.cache.tokens, rank.cache.locked_tokens, rank.private_tokens))
    sim.run()
    # after the shared prefill: 1536 cached tokens pinned, and the two first tokens private
    assert seen[-1] == (1536, 1536, 2)


def test_a_rank_reports_its_queued_prefill_as_sglang_does():
    """num_waiting_uncached_tokens: waiting prompts less their cached prefix, plus the rest of the
    prompt whose chunked prefill is under way (the part a board's total - used does not show)."""
    from dpboard.sim.model import RankModel, SimRequest

    rank = RankModel(0, config(chunk=8192).rank)
    rank.receive(SimRequest(0, 0.0, 20_000, 2), 0.0)
    rank.receive(SimRequest(1, 0.0, 1_000, 2), 0.0)
    assert rank.queued_prefill_tokens == 21_000
    assert rank.begin_step(0.0) is not None  # the first chunk (8192) of the long prompt
    rank.end_step(0.1)
    snap = rank.snapshot(0.1, 1)
    # the board's view: only the short prompt waits; the long one's remaining 11808 tokens are invisible
    assert snap.num_total_tokens - snap.num_used_tokens == 1_000
    assert rank.queued_prefill_tokens == 1_000 + 20_000 - 8192


def test_an_exact_report_leaves_a_cached_prefix_out_of_the_queue():
    from dpboard.sim.model import RankModel, SimRequest

    rank = RankModel(0, config(chunk=0).rank, queued_prefill="exact")
    first = SimRequest(0, 0.0, 1024, 1, block_ids=(11, 12))
    rank.receive(first, 0.0)
    rank.begin_step(0.0)
    rank.end_step(0.1)  # its two blocks are in the cache now
    rank.receive(SimRequest(1, 0.2, 1536, 1, block_ids=(11, 12, 13)), 0.2)
    assert rank.queued_prefill_tokens == 512


def test_sglang_discounts_the_queue_by_its_hit_rate_of_the_last_15_seconds():
    """SGLang 0.5.23 under its defaults (fcfs, no waiting-queue matching), load_inquirer.py:82-107:
    each waiting request counts int(seqlen * (1 - hit rate)); metrics_reporter.py:79-97 keeps the
    hit rate over the prefill batches of the last 15 s."""
    from dpboard.sim.model import RankModel, SimRequest

    rank = RankModel(0, config(chunk=0).rank)
    rank.receive(SimRequest(0, 0.0, 1024, 1, block_ids=(11, 12)), 0.0)
    rank.begin_step(0.0)
    rank.end_step(0.1)  # no hit: the window holds (0 hit, 1024 total)
    rank.receive(SimRequest(1, 0.2, 1536, 1, block_ids=(11, 12, 13)), 0.2)
    assert rank.queued_prefill_tokens == 1536  # a hit rate of 0: the whole prompt, cached or not
    rank.begin_step(0.2)
    rank.end_step(0.3)  # 1024 cached, 512 computed: the window is 1024 hit of 2560, 40 %
    assert rank.recent_hit_rate == pytest.approx(0.4)
    rank.receive(SimRequest(2, 0.4, 1000, 1), 0.4)
    rank.receive(SimRequest(3, 0.4, 333, 1), 0.4)
    # int(1000 * 0.6) + int(333 * 0.6) = 600 + 199, whatever each prompt shares with the cache
    assert rank.queued_prefill_tokens == 799
    rank.begin_step(15.2)
    rank.end_step(15.25)  # the first batch (at 0.1 s) leaves the window; 1333 new tokens, no hit
    assert rank.recent_hit_rate == pytest.approx(1024 / (1536 + 1333))


def test_a_rank_reports_running_and_used_tokens_as_sglang_does():
    """load_inquirer.py:109-148: num_running_reqs is the running (decode) batch only, and
    num_used_tokens is the KV allocated, which grows chunk by chunk."""
    from dpboard.sim.model import RankModel, SimRequest

    rank = RankModel(0, config(chunk=8192).rank)
    rank.receive(SimRequest(0, 0.0, 1000, 50), 0.0)
    rank.begin_step(0.0)
    rank.end_step(0.1)  # prefilled: 1000 prompt tokens and its first token, now decoding
    rank.receive(SimRequest(1, 0.1, 20_000, 2), 0.1)
    rank.begin_step(0.1)  # first chunk of the long prompt, 8192 tokens
    snap = rank.snapshot(0.1, 1)
    assert rank.num_running == 2  # what the rank holds
    assert snap.num_running_reqs == 1  # what SGLang reports: the chunked request is not in its running batch
    assert rank.used_tokens == 1001 + 20_000
    assert snap.num_used_tokens == 1001 + 8192
    assert snap.num_total_tokens == 1001 + 8192  # the rest of the chunked prompt is neither used nor waiting
    rank.end_step(0.2)
    rank.begin_step(0.2)  # second chunk
    assert rank.snapshot(0.2, 2).num_used_tokens == 1001 + 16_384
    rank.end_step(0.3)
    rank.begin_step(0.3)  # last chunk, 3616 tokens
    rank.end_step(0.4)
    snap = rank.snapshot(0.4, 3)
    assert snap.num_running_reqs == 2
    assert snap.num_used_tokens == rank.used_tokens == 1001 + 20_001
