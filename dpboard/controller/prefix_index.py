"""The controller's prefix index: which prompt blocks each rank probably holds in its prefix cache.

An engine's rank keeps the KV of prompts it served in a prefix cache (SGLang's radix cache, vLLM's
prefix caching) and prefills only the part of a new prompt that it does not hold. The controller
cannot see those caches, but it sent every prompt itself: for each rank it remembers the chained
hashes of the prompt blocks it sent there, least recently used dropped first when the rank's
capacity in blocks (its ``max_total_num_tokens`` on the board) is exceeded. ``match`` then tells,
for a new prompt, how many of its leading tokens each rank probably holds.

It is an estimate: a rank evicts under its own pressure, and requests routed around the controller
are unseen. It errs towards the rank that served a prefix last, which is where the prefix most
probably still is. A rank the controller has not sent any prompt yet is no evidence either way: it
is taken to hold what every rank with a history holds, once two or more have one (a prefix all of
them hold, such as a shared system prompt, is one it will hold after its first request), so that a
fresh rank does not lose every comparison by that shared prefix and stay idle.

Block hashes are chained (a block's hash covers the prompt up to its end: equal hashes mean equal
prefixes) and come from ``dpboard.controller._prefix``: from a request frame's bytes or from a list
of token ids, without a Python object per token. ``block_hashes_py`` is the same function in
Python, the tests' oracle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError

try:
    from dpboard.controller._prefix import hash_frame_blocks, hash_token_blocks
except ImportError:  # a source tree without the built extension
    hash_frame_blocks = hash_token_blocks = None

DEFAULT_BLOCK_SIZE = 512  # tokens per block: the Mooncake trace's unit, 32 blocks for a 16k prompt
DEFAULT_CAPACITY_BLOCKS = 4096  # per rank, until the board tells the rank's real KV capacity
# The most blocks the index keeps for one rank, whatever capacity a board reports (a board slot is
# written by whoever may write it): 32M tokens of 512, about 13 MiB of index per rank at the most.
MAX_CAPACITY_BLOCKS = 65_536

_MASK = (1 << 64) - 1
_K_MUL = 0x9E3779B97F4A7C15
_SEED = 0x243F6A8885A308D3


def _finish(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _set_ranks(out: np.ndarray, ranks: int, tokens: int) -> None:
    """``out[r] = tokens`` for every rank r whose bit is set in ``ranks``."""
    while ranks:
        low = ranks & -ranks
        out[low.bit_length() - 1] = tokens
        ranks ^= low


def block_hashes_py(ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of every whole block of ``block_size`` tokens (a trailing partial block has
    none): the same values as ``_prefix.hash_token_blocks``, in plain Python."""
    if block_size < 1:
        raise InvalidInputError(f"block_size must be >= 1 token, got {block_size}")
    h = _SEED
    out = []
    for i in range(len(ids) // block_size * block_size):
        h = ((h ^ (ids[i] & _MASK)) * _K_MUL) & _MASK
        h ^= h >> 32
        if (i + 1) % block_size == 0:
            h = _finish(h)
            out.append(h)
    return out


def block_hashes(ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """Chained block hashes of a prompt given as token ids (C; no object per token)."""
    if hash_token_blocks is None:
        return block_hashes_py(ids, block_size)
    return memoryview(hash_token_blocks(ids, block_size)).cast("Q").tolist()


def frame_block_hashes(frame: bytes | memoryview, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[int, list[int]] | None:
    """(number of tokens, chained block hashes) of the ``input_ids`` of a msgpack request frame, read
    from its bytes; None when the frame carries no ``input_ids``."""
    if hash_frame_blocks is None:
        import msgpack

        ids = msgpack.unpackb(frame, raw=False, strict_map_key=False).get("input_ids")
        return None if ids is None else (len(ids), block_hashes_py(ids, block_size))
    found = hash_frame_blocks(frame, block_size)
    if found is None:
        return None
    n, raw = found
    return n, memoryview(raw).cast("Q").tolist()


class PrefixIndex:
    """Per rank, an LRU set of the prompt blocks sent to it; ``match`` gives a prompt's cached tokens
    on every rank, ``record`` remembers a prompt on the rank that got it.

    Memory: one dict entry per (block, holder set) and one ordered-dict entry per (rank, block),
    about 200 bytes per block a rank holds; the capacity bounds it (``capacity_blocks`` per rank,
    or ``set_capacity`` from the rank's KV capacity).
    """

    def __init__(self, num_ranks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise InvalidInputError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidInputError(f"block_size must be an int >= 1 (tokens per block), got {block_size!r}")
        self.num_ranks = num_ranks
        self.block_size = block_size
        self._holders: dict[int, int] = {}  # block hash -> bitmask of the ranks holding it
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_ranks)]
        self._capacity = [0] * num_ranks
        self._everyone = (1 << num_ranks) - 1
        self._warm = 0  # bitmask of the ranks that were sent a prompt (and not forgotten since)
        for r in range(num_ranks):
            self.set_capacity(r, capacity_blocks)

    # -- capacity -----------------------------------------------------------------------------------

    def set_capacity(self, rank: int, blocks: int) -> None:
        """How many blocks ``rank`` can hold; the least recently used beyond that are forgotten. At
        most MAX_CAPACITY_BLOCKS, whatever a board reports: the index's memory stays bounded."""
        if not isinstance(blocks, (int, np.integer)) or blocks < 0:
            raise InvalidInputError(f"capacity of rank {rank} must be an int >= 0 blocks, got {blocks!r}")
        self._capacity[rank] = min(int(blocks), MAX_CAPACITY_BLOCKS)
        self._evict(rank)

    def set_capacity_tokens(self, capacities: Iterable[int]) -> None:
        """Every rank's capacity from its KV capacity in tokens (``max_total_num_tokens``); a rank
        that reports none (0) keeps what it had."""
        for rank, tokens in enumerate(capacities):
            if tokens > 0 and min(tokens // self.block_size, MAX_CAPACITY_BLOCKS) != self._capacity[rank]:
                self.set_capacity(rank, int(tokens) // self.block_size)

    def capacity(self, rank: int) -> int:
        return self._capacity[rank]

    def held(self, rank: int) -> int:
        """Blocks the index believes ``rank`` holds."""
        return len(self._lru[rank])

    # -- the per-request path -------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Tokens of the prompt's leading blocks that each rank holds: int64, one per rank.

        A rank with no history gets what every rank with one holds (their minimum), once there are
        at least two of those: one rank's blocks say nothing of what is common."""
        if out is None:
            out = np.zeros(self.num_ranks, np.int64)
        else:
            out[:] = 0
        holders = self._holders
        alive = self._warm  # only ranks with a history are walked; the cold ones follow their minimum
        common = -1  # blocks held by every warm rank, once one of them drops out
        depth = 0
        for h in hashes:
            if not alive:
                break
            held = holders.get(h, 0) & alive
            if held != alive:
                if common < 0:
                    common = depth
                if depth:
                    _set_ranks(out, alive & ~held, depth * self.block_size)
                alive = held
            depth += 1
        _set_ranks(out, alive, depth * self.block_size)
        cold = self._everyone & ~self._warm
        if cold and self._warm & (self._warm - 1):  # at least two warm ranks agree on what is common
            _set_ranks(out, cold, (depth if common < 0 else common) * self.block_size)
        return out

    def record(self, rank: int, hashes: Sequence[int]) -> None:
        """``rank`` got this prompt: it now holds its blocks (most recently used)."""
        lru = self._lru[rank]
        bit = 1 << rank
        holders = self._holders
        self._warm |= bit
        # Deepest block first: a prefix cache evicts leaves before their prefix, so the leading block
        # must be the most recently used of the prompt's blocks.
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        self._evict(rank)

    def forget(self, rank: int) -> None:
        """``rank`` lost its cache (a restart): it holds nothing now."""
        bit = 1 << rank
        for h in self._lru[rank]:
            self._drop_holder(h, bit)
        self._lru[rank].clear()
        self._warm &= ~bit

    def _evict(self, rank: int) -> None:
        lru = self._lru[rank]
        bit = 1 << rank
        while len(lru) > self._capacity[rank]:
            h, _ = lru.popitem(last=False)
            self._drop_holder(h, bit)

    def _drop_holder(self, h: int, bit: int) -> None:
        left = self._holders.get(h, 0) & ~bit
        if left:
            self._holders[h] = left
        else:
            self._holders.pop(h, None)

    def __repr__(self) -> str:
        return (f"PrefixIndex(num_ranks={self.num_ranks}, block_size={self.block_size}, "
                f"blocks={len(self._holders)})")


def request_block_hashes(req: Any, block_size: int) -> list[int]:
    """A request's prompt block hashes: its ``block_hashes`` when it carries them (the simulator's
    trace ids, or the controller's hashes of the frame), else hashes of its ``input_ids``; [] when
    it has neither (a request with only ``num_tokens``)."""
    hashes = getattr(req, "block_hashes", None)
    if hashes is not None:
        return list(hashes)
    ids = getattr(req, "input_ids", None)
    return [] if ids is None else block_hashes(ids, block_size)
