"""The SGLang gateway's cache_aware policy and Dynamo's KV router, worked by hand on their own,
and wired to the ranks' KV events in a run. (vLLM's policy is in test_sim.py.)"""

from __future__ import annotations

import numpy as np

from dpboard.sim.peers import DynamoKvPolicy, GatewayCacheAwarePolicy
from dpboard.sim.prefix_cache import STORED
from dpboard.sim.simulation import SimConfig, Simulation
from dpboard.sim.trace import BlockTable, Trace


class Req:
    def __init__(self, rid: int, prompt: int, ids: tuple[int, ...] = ()):
        self.rid = rid
        self.prompt_len = prompt
        self.block_ids = ids
        self.routed_dp_rank = None
        self.rank = -1


def send(policy, req: Req) -> int:
    req.rank = policy.dispatch(req)
    return req.rank


def test_cache_aware_follows_the_prefix_above_the_threshold():
    policy = GatewayCacheAwarePolicy(3)
    assert send(policy, Req(0, 1536, (1, 2, 3))) == 0  # nothing matched: least loaded, first index
    assert send(policy, Req(1, 1536, (1, 2, 3))) == 0  # all of it matched on rank 0
    assert send(policy, Req(2, 1536, (1, 9, 10))) == 0  # 512 of 1536 = 33 % > 30 %
    assert send(policy, Req(3, 2048, (1, 11, 12, 13))) == 1  # 512 of 2048 = 25 %: least loaded
    assert policy.load == [3, 1, 0]
    assert send(policy, Req(4, 100)) == 2  # no block ids: least loaded
    # a prompt starting 1, 11 matches two blocks; the deeper one was sent to rank 1 only
    assert send(policy, Req(5, 1100, (1, 11, 14))) == 1


def test_cache_aware_balances_by_its_own_in_flight_counts_when_imbalanced():
    policy = GatewayCacheAwarePolicy(3, balance_abs_threshold=2, balance_rel_threshold=1.5)
    reqs = [Req(i, 1536, (1, 2, 3)) for i in range(4)]
    # the first three follow the cache to rank 0; at (3, 0, 0) the loads are imbalanced
    assert [send(policy, r) for r in reqs] == [0, 0, 0, 1]
    # the gateway learns of finishes only from its own responses
    for r in reqs[:3]:
        policy.on_finish(r)
    assert policy.load == [0, 1, 0]
    # the matched node's tenant is the worker whose prompt created it (rank 0), not the last sent
    assert send(policy, Req(9, 1536, (1, 2, 3))) == 0


def test_cache_aware_least_loaded_ties_go_to_fewer_processed_requests():
    """smg model_gateway/src/policies/cache_aware.rs at 73da68ca9, lines 781-797: the least loaded
    worker is the lowest (load, processed, index), processed counting every request routed to it."""
    policy = GatewayCacheAwarePolicy(3)
    reqs = [Req(i, 100) for i in range(3)]
    assert [send(policy, r) for r in reqs] == [0, 1, 2]
    for r in reqs[1:]:
        policy.on_finish(r)
    policy.on_finish(reqs[0])
    assert policy.load == [0, 0, 0] and policy.processed == [1, 1, 1]
    fourth = Req(3, 100)
    assert send(policy, fourth) == 0  # all tie: the lowest index
    policy.on_finish(fourth)
    # loads (0, 0, 0), processed (2, 1, 1): rank 1, where the first-index rule said rank 0
    assert send(policy, Req(4, 100)) == 1


def test_dynamo_cost_is_prefill_blocks_less_overlap_plus_decode_blocks():
    """Dynamo's cost in blocks of the engine's page size (16): selector/default.rs's
    prefill term plus potential_decode_blocks (active blocks + the prompt's new full blocks)."""
    policy = DynamoKvPolicy(3, seed=1)
    policy.on_kv_event(1, STORED, [1, 2, 3])  # rank 1 holds the first three 512-token blocks: 96 pages
    a = Req(0, 2048, (1, 2, 3, 4))
    # costs: rank 0 = 2048/16 + 128 new blocks = 256; rank 1 = 128 - 96 + 128 = 160; rank 2 = 256
    assert send(policy, a) == 1
    assert policy.active_tokens == [0, 512, 0] and policy.active_blocks == [0, 128, 0]
    b = Req(1, 2048, (1, 2, 3, 5))
    # rank 1: (512 + 2048)/16 - 96 = 64, plus 128 in flight + 32 new (block 5) = 224 < 256
    assert send(policy, b) == 1
    c = Req(2, 2048, (1, 2, 3, 6))
    # rank 1: (1024 + 2048)/16 - 96 = 96, plus 160 + 32 = 288 > 256: ranks 0 and 2 tie at 256
    assert send(policy, c) in (0, 2)
    policy.on_first_token(a)
    policy.on_finish(a)
    assert policy.active_tokens[1] == 512  # b's prefill is still pending
    # a's block 4 is no longer in flight on rank 1; 1, 2, 3 still are (b)
    assert policy._unique[1] == {1: 1, 2: 1, 3: 1, 5: 1} and policy.active_blocks[1] == 128


def test_dynamo_counts_the_decode_blocks_of_a_short_prompt():
    # A 300-token prompt is 18 full 16-token blocks. Counted in 512-token blocks it would be none,
    # and a rank decoding it would look as free as an idle one.
    policy = DynamoKvPolicy(2, seed=0)
    first = Req(0, 300)
    rank = send(policy, first)
    policy.on_first_token(first)  # its prefill is done; its 18 blocks stay until it finishes
    # the busy rank: 300/16 + 18 + 18 = 54.75; the idle one: 18.75 + 18 = 36.75
    assert send(policy, Req(1, 300)) == 1 - rank
    # a partial last trace block counts its full pages only: 700 tokens = 32 + 11 pages
    assert policy._keys(Req(2, 700, (7, 8))) == [(7, 32), ((8, 11), 11)]


def test_dynamo_ties_are_random_but_seeded():
    def picks(seed: int) -> list[int]:
        policy = DynamoKvPolicy(4, seed=seed)
        out = []
        for i in range(12):
            req = Req(i, 100)
            out.append(send(policy, req))
            policy.on_first_token(req)
            policy.on_finish(req)  # every rank is empty again: a four-way tie each time
        return out

    assert picks(3) == picks(3)
    assert len(set(picks(3))) > 1
    assert picks(3) != picks(4)


def test_dynamo_hears_the_ranks_kv_events_in_a_run():
    # one prompt, then the same prompt again: the second goes where the first is cached
    n = 2
    trace = Trace(
        name="hand",
        n_ranks=4,
        seed=0,
        arrival_s=np.array([0.0, 2.0]),
        prompt_len=np.array([4096, 4096]),
        output_len=np.array([3, 3]),
        is_burst=np.zeros(n, dtype=bool),
        blocks=BlockTable(offsets=np.array([0, 8, 16]), ids=np.array(list(range(8)) * 2)),
    )
    sim = Simulation(trace, "dynamo_kv", SimConfig(n_ranks=4))
    result = sim.run()
    first, second = result.requests
    assert second.rank == first.rank
    assert second.cached_tokens == 4095
    assert sim.policy.indexer.overlap(list(range(8)))[first.rank] == 8
