"""Prefix caches over 512-token blocks: what a rank holds, and what a router believes ranks hold.

A prompt is a sequence of blocks of ``BLOCK_TOKENS`` tokens (the last one may be shorter), each named
by a block id. Ids are *chained*, as in Mooncake's traces and in vLLM's and SGLang's block hashes:
equal ids mean equal content **and** equal prefix, so a block id determines its whole path from the
root, and the longest cached prefix of a prompt is the longest run of its leading ids that the
cache holds.

Three structures, for three points of view:

- ``PrefixCache``: one rank's own cache, a radix tree of blocks sharing the rank's KV pool. Running
  requests pin the blocks they use (a reference count on each block of their path, like SGLang's
  ``inc_lock_ref``); unpinned blocks are evictable, least recently used leaves first, when running
  requests need the KV. It reports every block it stores or drops to an optional listener: these are
  the KV events (vLLM's and SGLang's ``BlockStored`` / ``BlockRemoved``) a router can subscribe to.
- ``BlockOwners``: a router's index of which ranks hold which blocks, fed by those events (what
  Dynamo's KV indexer keeps). ``overlap(ids)`` answers, for every rank at once, how many of a
  prompt's leading blocks it holds.
- ``RoutedPrefixTree``: a router's approximate tree of what it *sent* where, with no word from the
  ranks (what SGLang's model gateway keeps for ``cache_aware``), with per-rank LRU eviction by size.

All three answer the same question a cache-aware policy asks: how many of this request's prompt
blocks does rank r hold, by this observer's knowledge.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Sequence

BLOCK_TOKENS = 512  # tokens per block: Mooncake's hash_ids granularity

# Event kinds passed to a PrefixCache listener.
STORED = 1
REMOVED = 2

KvListener = Callable[[int, list[int]], None]  # (STORED | REMOVED, block ids)


def block_tokens(prompt_len: int, n_blocks: int, index: int) -> int:
    """Tokens in block ``index`` of a prompt of ``prompt_len`` tokens cut into ``n_blocks`` blocks."""
    if index < n_blocks - 1:
        return BLOCK_TOKENS
    return prompt_len - BLOCK_TOKENS * (n_blocks - 1)


def prefix_tokens(prompt_len: int, n_blocks: int, matched: int) -> int:
    """Tokens in the first ``matched`` blocks of such a prompt."""
    if matched <= 0:
        return 0
    if matched < n_blocks:
        return matched * BLOCK_TOKENS
    return prompt_len



def leading_blocks(ids: Sequence[int], held: Container[int]) -> int:
    """How many leading blocks of ``ids`` are in ``held``."""
    n = 0
    for block_id in ids:
        if block_id not in held:
            break
        n += 1
    return n

class _Block:
    __slots__ = ("parent", "children", "refs", "tokens", "stamp")

    def __init__(self, parent: int, tokens: int, stamp: int):
        self.parent = parent  # -1 for a block at the root
        self.children = 0
        self.refs = 0  # running requests whose path includes this block
        self.tokens = tokens
        self.stamp = stamp  # last use, for LRU eviction


class PrefixCache:
    """One rank's prefix cache: a radix tree of blocks, pinned by running requests, LRU-evicted.

    It keeps token counts, not token ids: ``tokens`` stored in all, ``locked_tokens`` in blocks that
    some running request pins, ``evictable_tokens`` the rest. The rank's KV pool holds these tokens
    besides the private KV of its requests; ``evict`` frees evictable tokens when that pool runs short.
    """

    def __init__(self, listener: KvListener | None = None):
        self._blocks: dict[int, _Block] = {}
        self._evictable: list[tuple[int, int]] = []  # heap of (stamp, id) of unpinned leaves; lazily cleaned
        self._stamp = 0
        self.tokens = 0
        self.locked_tokens = 0
        self.listener = listener
        self.evicted_tokens = 0

    @property
    def evictable_tokens(self) -> int:
        return self.tokens - self.locked_tokens

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def match(self, ids: Sequence[int]) -> int:
        """How many leading blocks of ``ids`` this cache holds (no side effect)."""
        return leading_blocks(ids, self._blocks)

    def acquire(self, ids: Sequence[int], n: int) -> None:
        """Pin the first ``n`` blocks of ``ids`` (all held: call ``match`` first) for a running request."""
        self._repin(ids, n, 1)

    def release(self, ids: Sequence[int], n: int) -> None:
        """Unpin the first ``n`` blocks of ``ids``; a block nobody pins becomes evictable."""
        self._repin(ids, n, -1)

    def _repin(self, ids: Sequence[int], n: int, delta: int) -> None:
        """One more (``delta`` 1) or one fewer (-1) pin on the first ``n`` blocks of ``ids``, all
        stamped now: the tokens locked follow the blocks that gain their first pin or lose their last."""
        self._stamp += 1
        stamp = self._stamp
        blocks = self._blocks
        for i in range(n):
            block = blocks[ids[i]]
            was_pinned = block.refs > 0
            block.refs += delta
            block.stamp = stamp
            if was_pinned != (block.refs > 0):
                self.locked_tokens += block.tokens if delta > 0 else -block.tokens
                if delta < 0 and block.children == 0:
                    heapq.heappush(self._evictable, (stamp, ids[i]))

    def insert(self, ids: Sequence[int], sizes: Sequence[int], start: int) -> int:
        """Store blocks ``start..`` of ``ids`` (``sizes`` tokens each) and pin all of ``ids``.

        Blocks ``0..start-1`` must be held and pinned by the caller already (``acquire``). A block that
        another request stored in the meantime is shared, not stored twice. Returns the tokens newly
        stored (the rest of the request's copy of those blocks is freed by the caller)."""
        self._stamp += 1
        stamp = self._stamp
        blocks = self._blocks
        parent = ids[start - 1] if start > 0 else -1
        stored: list[int] = []
        added = 0
        for i in range(start, len(ids)):
            block_id = ids[i]
            block = blocks.get(block_id)
            if block is None:
                block = _Block(parent, sizes[i], stamp)
                blocks[block_id] = block
                if parent >= 0:
                    blocks[parent].children += 1
                self.tokens += block.tokens
                added += block.tokens
                stored.append(block_id)
            if block.refs == 0:
                self.locked_tokens += block.tokens
            block.refs += 1
            block.stamp = stamp
            parent = block_id
        if stored and self.listener is not None:
            self.listener(STORED, stored)
        return added

    def evict(self, tokens_needed: int) -> int:
        """Drop unpinned blocks, least recently used leaves first, until ``tokens_needed`` are freed
        or nothing evictable is left. Returns the tokens freed."""
        freed = 0
        heap = self._evictable
        blocks = self._blocks
        removed: list[int] = []
        while freed < tokens_needed and heap:
            stamp, block_id = heapq.heappop(heap)
            block = blocks.get(block_id)
            if block is None or block.refs or block.children or block.stamp != stamp:
                continue  # pinned, grown or touched since this entry was pushed
            del blocks[block_id]
            freed += block.tokens
            removed.append(block_id)
            parent = blocks.get(block.parent)
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    heapq.heappush(heap, (parent.stamp, block.parent))
        self.tokens -= freed
        self.evicted_tokens += freed
        if removed and self.listener is not None:
            self.listener(REMOVED, removed)
        return freed


class BlockOwners:
    """A router's index of which ranks hold which blocks, built from the ranks' KV events."""

    def __init__(self, n_ranks: int):
        self.n_ranks = n_ranks
        self._owners: dict[int, int] = {}  # block id -> bit mask of ranks holding it

    def stored(self, rank: int, ids: Sequence[int]) -> None:
        bit = 1 << rank
        owners = self._owners
        for block_id in ids:
            owners[block_id] = owners.get(block_id, 0) | bit

    def removed(self, rank: int, ids: Sequence[int]) -> None:
        keep = ~(1 << rank)
        owners = self._owners
        for block_id in ids:
            mask = owners.get(block_id, 0) & keep
            if mask:
                owners[block_id] = mask
            else:
                owners.pop(block_id, None)

    def holds(self, rank: int, block_id: int) -> bool:
        return bool(self._owners.get(block_id, 0) >> rank & 1)

    def overlap(self, ids: Sequence[int]) -> list[int]:
        """Per rank, how many leading blocks of ``ids`` it holds (by the events seen so far)."""
        counts = [0] * self.n_ranks
        alive = (1 << self.n_ranks) - 1  # ranks whose run of held blocks has not ended yet
        owners = self._owners
        depth = 0
        for block_id in ids:
            held = owners.get(block_id, 0) & alive
            ended = alive & ~held
            while ended:
                low = ended & -ended
                counts[low.bit_length() - 1] = depth
                ended ^= low
            alive = held
            if not alive:
                return counts
            depth += 1
        while alive:
            low = alive & -alive
            counts[low.bit_length() - 1] = depth
            alive ^= low
        return counts


class RoutedPrefixTree:
    """A router's approximate tree of the prompts it sent, per rank, with no word from the ranks.

    Each block remembers which ranks it was sent to, in the order they were first sent it.
    ``longest_match`` walks the prompt's leading blocks that any rank was sent and returns that depth
    with the deepest block's tenant: the rank that created it (the gateway's string tree caches a
    node's ``last_tenant`` when the node is created and keeps it while that tenant holds the node;
    once it is evicted there, another holder, here the next oldest). ``evict_to(max_tokens)`` trims each rank's share to a size,
    least recently sent first (a rank's blocks are kept in send order, leaves before their parents
    on a tie, so a block never outlives its parent).
    """

    def __init__(self, n_ranks: int):
        self.n_ranks = n_ranks
        self._tenants: dict[int, dict[int, None]] = {}  # block id -> ranks, in send order
        self._per_rank: list[dict[int, int]] = [{} for _ in range(n_ranks)]  # rank -> {block id: tokens}, LRU first
        self.rank_tokens = [0] * n_ranks

    def longest_match(self, ids: Sequence[int]) -> tuple[int, int]:
        """(leading blocks of ``ids`` sent to some rank, the deepest one's tenant; -1 if none)."""
        tenants = self._tenants
        depth = leading_blocks(ids, tenants)
        if depth == 0:
            return 0, -1
        return depth, next(iter(tenants[ids[depth - 1]]))

    def insert(self, ids: Sequence[int], sizes: Sequence[int], rank: int) -> None:
        """Record that the prompt ``ids`` was sent to ``rank`` (refreshing what was there)."""
        tenants = self._tenants
        mine = self._per_rank[rank]
        # Leaf first, so that on equal recency a block's children are evicted before it.
        for i in range(len(ids) - 1, -1, -1):
            block_id = ids[i]
            ranks = tenants.get(block_id)
            if ranks is None:
                tenants[block_id] = {rank: None}
            elif rank not in ranks:
                ranks[rank] = None
            size = mine.pop(block_id, None)
            if size is None:
                size = sizes[i]
                self.rank_tokens[rank] += size
            mine[block_id] = size

    def evict_to(self, max_tokens: int) -> int:
        """Trim every rank's share to at most ``max_tokens`` tokens; returns the tokens dropped."""
        dropped = 0
        tenants = self._tenants
        for rank, mine in enumerate(self._per_rank):
            while self.rank_tokens[rank] > max_tokens and mine:
                block_id = next(iter(mine))
                size = mine.pop(block_id)
                self.rank_tokens[rank] -= size
                dropped += size
                ranks = tenants[block_id]
                del ranks[rank]
                if not ranks:
                    del tenants[block_id]
        return dropped
