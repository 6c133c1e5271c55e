"""Prefix caches: a rank's own (pinning, LRU leaf eviction, KV events), and the routers' views of them."""

from __future__ import annotations

from dpboard.sim.prefix_cache import (
    BLOCK_TOKENS,
    REMOVED,
    STORED,
    BlockOwners,
    PrefixCache,
    RoutedPrefixTree,
    prefix_tokens,
)


def sizes_of(ids, last: int = BLOCK_TOKENS) -> list[int]:
    return [BLOCK_TOKENS] * (len(ids) - 1) + [last]


def test_prefix_tokens_counts_a_short_last_block():
    assert prefix_tokens(1100, 3, 0) == 0
    assert prefix_tokens(1100, 3, 2) == 1024
    assert prefix_tokens(1100, 3, 3) == 1100


def test_match_stops_at_the_first_missing_block():
    cache = PrefixCache()
    cache.insert([1, 2, 3], sizes_of([1, 2, 3], 100), 0)
    assert cache.match([1, 2, 3]) == 3
    assert cache.match([1, 2, 9, 3]) == 2
    assert cache.match([5, 1]) == 0
    assert cache.tokens == 1124 and cache.locked_tokens == 1124


def test_pinned_blocks_are_never_evicted_and_lru_leaves_go_first():
    events = []
    cache = PrefixCache(listener=lambda kind, ids: events.append((kind, list(ids))))
    a = [1, 2, 3]  # a conversation, then a second turn that extends it
    b = [1, 2, 3, 4]
    c = [7, 8]
    cache.insert(a, sizes_of(a), 0)
    cache.release(a, 3)
    n = cache.match(b)
    cache.acquire(b, n)
    cache.insert(b, sizes_of(b), n)  # stores block 4 only
    cache.insert(c, sizes_of(c), 0)
    cache.release(c, 2)  # nobody uses c now: its blocks are the only evictable ones
    assert events == [(STORED, [1, 2, 3]), (STORED, [4]), (STORED, [7, 8])]
    assert cache.tokens == 6 * BLOCK_TOKENS and cache.evictable_tokens == 2 * BLOCK_TOKENS
    # b pins 1-4; only c's blocks can go, leaf (8) before its parent (7)
    assert cache.evict(BLOCK_TOKENS) == BLOCK_TOKENS
    assert events[-1] == (REMOVED, [8])
    assert cache.evict(10 * BLOCK_TOKENS) == BLOCK_TOKENS
    assert events[-1] == (REMOVED, [7])
    assert cache.match(b) == 4 and cache.tokens == 4 * BLOCK_TOKENS
    # b done: 4 is a leaf and goes before 3, 2, 1
    cache.release(b, 4)
    cache.evict(BLOCK_TOKENS)
    assert events[-1] == (REMOVED, [4]) and cache.match(b) == 3
    assert cache.evicted_tokens == 3 * BLOCK_TOKENS


def test_least_recently_used_branch_is_evicted_first():
    cache = PrefixCache()
    old = [1, 2]
    new = [1, 3]
    for ids in (old, new):
        n = cache.match(ids)
        cache.acquire(ids, n)
        cache.insert(ids, sizes_of(ids), n)
        cache.release(ids, 2)
    # reuse the old branch: now the new one is the least recently used
    cache.acquire(old, 2)
    cache.release(old, 2)
    cache.evict(1)
    assert 3 not in cache and 2 in cache and 1 in cache


def test_block_owners_overlap_per_rank():
    owners = BlockOwners(4)
    owners.stored(0, [1, 2, 3])
    owners.stored(1, [1, 2])
    owners.stored(2, [9])
    owners.stored(3, [1, 5, 3])  # holds 3 but not 2: its run ends at 1
    assert owners.overlap([1, 2, 3, 4]) == [3, 2, 0, 1]
    owners.removed(0, [3])
    assert owners.overlap([1, 2, 3]) == [2, 2, 0, 1]
    owners.removed(1, [1, 2])
    owners.removed(3, [1])
    assert owners.overlap([1, 2, 3]) == [2, 0, 0, 0]
    assert owners.holds(3, 5) and not owners.holds(1, 1)


def test_routed_tree_names_the_block_creator_and_evicts_by_size():
    tree = RoutedPrefixTree(3)
    tree.insert([1, 2, 3], sizes_of([1, 2, 3]), rank=0)
    tree.insert([1, 2], sizes_of([1, 2]), rank=1)
    assert tree.longest_match([1, 2, 3, 4]) == (3, 0)
    # block 2 was created by rank 0's prompt; rank 1 sent it later, but the tenant stays the creator
    assert tree.longest_match([1, 2, 7]) == (2, 0)
    assert tree.longest_match([8]) == (0, -1)
    assert tree.rank_tokens == [3 * BLOCK_TOKENS, 2 * BLOCK_TOKENS, 0]
    # trim rank 0 to one block: its leaves go first, 3 then 2
    assert tree.evict_to(BLOCK_TOKENS) == 3 * BLOCK_TOKENS  # rank 0 drops 2 blocks, rank 1 drops 1
    assert tree.longest_match([1, 2, 3]) == (1, 0)
    assert tree.rank_tokens == [BLOCK_TOKENS, BLOCK_TOKENS, 0]
    # once the creator no longer holds a block, the next holder is its tenant
    tree.insert([5], sizes_of([5]), rank=2)
    tree.insert([5], sizes_of([5]), rank=1)
    tree.insert([6], sizes_of([6]), rank=2)
    assert tree.longest_match([5]) == (1, 2)
    tree.evict_to(BLOCK_TOKENS)  # rank 2 drops block 5, its least recently sent; rank 1 keeps it
    assert tree.longest_match([5]) == (1, 1)
    assert tree.rank_tokens == [BLOCK_TOKENS, BLOCK_TOKENS, BLOCK_TOKENS]
