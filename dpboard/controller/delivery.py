"""``DeliveryLedger``: which requests each rank has acknowledged. The pure part of the delivery rule;
``RankAvailability``: whether each rank takes requests now (connection, board slot, draining, full
queue), what the controller tells its Dispatcher.

docs/DISPATCH.md ("Delivery") states the rule; the controller process applies it. In short: a
request that ZMQ took for a connected scheduler is *dispatched*; it is *delivered* once that
scheduler counts it in the ``num_received_reqs`` it publishes in its board slot. Requests reach a
rank through one PUSH -> PULL pipe, in order, and the scheduler counts them in that order, so the
count acknowledges a prefix of what was sent: the ledger keeps, per rank, the requests sent and not
yet acknowledged, in order, and drops them from the front as the count grows.

When a rank's connection breaks, the requests it has not acknowledged are not thrown away: once the
scheduler has had the time to publish its last count (the board's staleness threshold), the
controller *closes the epoch*: the ones still unacknowledged are handed back, to be sent to another
rank or answered with an error, and a new epoch starts from the count the rank has then.

Assumes this controller is the rank's only sender (as SGLang's DP controller is): a count that
grows beyond what was sent is taken as the rank's own business and re-based.
"""

from __future__ import annotations

from collections import deque
from typing import Any

# A rank that took this many requests in an epoch without its count moving does not count them (a
# vLLM board, a scheduler that passes no count): its requests are no longer kept.
UNCOUNTED_AFTER = 256
# What one rank's unacknowledged requests may hold (frames); beyond it the oldest are let go, as
# requests whose delivery the controller no longer vouches for.
MAX_PENDING = 65_536
MAX_PENDING_BYTES = 64 * 2**20


def _size(item: Any) -> int:
    raw = getattr(item, "raw", None)
    return len(raw) if raw is not None else 0


class DeliveryLedger:
    """Per rank: the requests sent and not yet acknowledged, oldest first, and the count they follow.

    Bounded: at most ``max_pending`` requests and ``max_bytes`` of frames per rank (the oldest are
    let go beyond, counted in ``untracked``), and none at all for a rank that took
    ``uncounted_after`` requests in an epoch without counting one (``uncounted``: delivery cannot
    be proven there; its count moving again brings it back)."""

    def __init__(self, num_workers: int, *, max_pending: int = MAX_PENDING, max_bytes: int = MAX_PENDING_BYTES,
                 uncounted_after: int = UNCOUNTED_AFTER) -> None:
        self.num_workers = num_workers
        self.pending: list[deque[Any]] = [deque() for _ in range(num_workers)]
        self._bytes = [0] * num_workers
        self._base = [0] * num_workers  # the rank's count when the epoch started
        self._acked = [0] * num_workers  # acknowledged in this epoch
        self._peak = [0] * num_workers  # the highest count seen in this epoch
        self._sent = [0] * num_workers  # sent in this epoch
        self._started = [False] * num_workers
        self.uncounted = [False] * num_workers  # took requests and never counted one: nothing kept
        self.max_pending, self.max_bytes, self.uncounted_after = max_pending, max_bytes, uncounted_after
        self.delivered = 0  # acknowledged, all ranks, all epochs
        self.untracked = 0  # let go unacknowledged (limits, or an uncounting rank): delivery unknown

    def start(self, rank: int, received: int) -> None:
        """A new epoch from the rank's count now (0 for a slot that was never written)."""
        self._base[rank] = self._peak[rank] = received
        self._acked[rank] = 0
        self._sent[rank] = 0
        self._started[rank] = True

    def sent(self, rank: int, item: Any) -> bool:
        """Keep ``item`` until ``rank`` acknowledges it. Returns True when this send showed that the
        rank does not count what it takes (the caller says so once)."""
        self._sent[rank] += 1
        if self.uncounted[rank]:
            self.untracked += 1
            return False
        if self._sent[rank] > self.uncounted_after and self._peak[rank] == self._base[rank] and self._started[rank]:
            self.uncounted[rank] = True
            self.untracked += len(self.pending[rank]) + 1
            self.pending[rank].clear()
            self._bytes[rank] = 0
            return True
        pending = self.pending[rank]
        pending.append(item)
        self._bytes[rank] += _size(item)
        while len(pending) > self.max_pending or (self._bytes[rank] > self.max_bytes and len(pending) > 1):
            self._bytes[rank] -= _size(pending.popleft())
            self.untracked += 1
            self._base[rank] += 1  # its acknowledgement, when it comes, acknowledges nothing kept
        return False

    def observe(self, rank: int, received: int) -> int:
        """The rank published ``received``: drop what it acknowledges; returns how many."""
        if not self._started[rank]:
            self.start(rank, received)  # sends before the first count are acknowledged only by a larger one
        if self.uncounted[rank] and received > self._peak[rank]:
            self.uncounted[rank] = False  # it counts after all: a new epoch from this count
            self.start(rank, received)
            return 0
        if received > self._peak[rank]:
            self._peak[rank] = received
        new = received - self._base[rank] - self._acked[rank]
        if new <= 0:
            return 0  # nothing new, or a count that went back (a restarted scheduler: its epoch closes)
        pending = self.pending[rank]
        k = min(new, len(pending))
        for _ in range(k):
            self._bytes[rank] -= _size(pending.popleft())
        self._acked[rank] += k
        self.delivered += k
        if new > k:  # counted more than was sent: not ours to account for
            self._base[rank] += new - k
        return k

    def close_epoch(self, rank: int, received_now: int) -> list[Any]:
        """End the rank's epoch: what its highest count acknowledged is delivered, the rest is
        returned (never acknowledged: to be sent elsewhere or answered); a new epoch starts from
        ``received_now``."""
        self.observe(rank, self._peak[rank])
        lost = list(self.pending[rank])
        self.pending[rank].clear()
        self._bytes[rank] = 0
        self.start(rank, received_now)
        return lost

    def unacknowledged(self, rank: int | None = None) -> int:
        if rank is not None:
            return len(self.pending[rank])
        return sum(len(p) for p in self.pending)


class RankAvailability:
    """Whether each rank takes requests now, and why not. Besides its connection (a pipe's
    ``connected`` and ``backlogged``, see ``dpboard.controller.connections.Pipe``): its board slot
    stale or torn (``stale``), its connection broken with requests not yet acknowledged
    (``draining``: rank -> when those go elsewhere), its queue refusing a send in this batch
    (``full``). ``told`` is what the dispatcher last heard of each rank, so that it hears only of
    changes (``update``)."""

    def __init__(self, num_workers: int) -> None:
        self.stale = [False] * num_workers
        self.draining: dict[int, float] = {}
        self.full: set[int] = set()
        self.told: list[bool | None] = [None] * num_workers

    def takes(self, rank: int, pipe: Any) -> bool:
        return (pipe is not None and pipe.connected and not pipe.backlogged and not self.stale[rank]
                and rank not in self.draining and rank not in self.full)

    def update(self, rank: int, pipe: Any, dispatcher: Any) -> None:
        """Tell ``dispatcher`` (``set_status``) whether ``rank`` takes requests, when that changed."""
        ok = self.takes(rank, pipe)
        if ok != self.told[rank]:
            self.told[rank] = ok
            dispatcher.set_status(rank, ok)

    def forget_told(self) -> None:
        """A new dispatcher heard nothing yet: the next ``update`` of each rank tells it."""
        self.told = [None] * len(self.told)

    def why_not(self, rank: int, pipe: Any) -> str:
        """Why ``rank`` does not take requests now, in words."""
        if pipe is None:
            return "a reserved slot with no worker"
        if not pipe.connected:
            return "not connected"
        if pipe.backlogged:
            return (f"it has not taken the {pipe.queue.queued / 2**20:.1f} MiB queued for it, over "
                    f"--max-queued-mib {pipe.max_queued_bytes // 2**20}")
        if rank in self.draining:
            return "its connection broke; waiting for its last count"
        if self.stale[rank]:
            return "its board slot is stale"
        return "its queue is full"
