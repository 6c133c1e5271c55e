"""``ConnectionGuard``: how many connections a server holds, and which it lets go first.

Every dpboard server that listens on a port (the collector's relay fan-in, the controller's
``--input``, ``dpboard serve``) spends a descriptor on each connection, and a peer can open them
faster than they are worth serving. One set of rules bounds them all (docs/SECURITY.md):

- **A cap**: at most ``wanted`` connections, and never more than the descriptors RLIMIT_NOFILE
  leaves the process, less a reserve for everything else (``fd_budget``).
- **Shedding by proof**: over the cap, connections are closed until ``keep`` of the cap is left,
  those whose peers proved the least first (``Proof``): a peer that has sent nothing, then one that
  sent something but nothing valid (the oldest first among those: they had the longest to prove
  themselves; among the silent, one that has not sent a byte before one that started a handshake),
  then one authenticated by its key, then one that sent something valid (the youngest first: an
  established peer is the last to go; or, with ``shed_proved="idlest"``, the one idle longest
  first, for clients that come and go between requests). Bytes alone never rank a peer above
  another: junk is loud. Connections busy answering a request are never shed.
- **Out of descriptors anyway** (``accept`` failed with EMFILE or ENFILE: they went elsewhere):
  the cap comes down to what fits (``keep`` of the connections open, one fewer at least) until
  ``restore_after`` seconds pass without the error; connections are shed at most once per
  ``hold``; with none to shed, the server stops accepting for a back-off that doubles, from
  ``backoff[0]`` to ``backoff[1]``, and starts short again after ``restore_after`` without the error.

The guard is the policy only, with an injectable clock: its shells
(``dpboard.multinode.peers.PeerGuard`` for ZMQ sockets, ``dpboard serve``'s HTTP server) tell it
what opens, closes and proves what, and close what it names. It is thread-safe.
"""

from __future__ import annotations

import enum
import os
import resource
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


class Proof(enum.IntEnum):
    """What a connection's peer has shown so far; a higher value is shed later."""

    NOTHING = 0  # connected, nothing usable received
    SPOKE = 1  # sent something (a malformed frame, a request the server refused), nothing valid
    KEY = 2  # authenticated by a key the server knows
    VALID = 3  # sent something valid (a relay frame, a request)


def fd_budget(wanted: int, reserve: int, minimum: int = 1, *, in_use: int | None = None) -> int:
    """``wanted``, but never more than the descriptors this process has left under its
    RLIMIT_NOFILE less ``reserve``; at least ``minimum``. ``in_use``: the descriptors that count as
    taken (default: every one open now)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = wanted
    if soft != resource.RLIM_INFINITY:
        if in_use is None:
            in_use = len(os.listdir("/proc/self/fd"))
        cap = min(cap, soft - in_use - reserve)
    return max(minimum, cap)


@dataclass
class _Entry:
    opened: float
    since: float  # its last activity (``touch``)
    proof: Proof = Proof.NOTHING
    busy: bool = False


@dataclass
class OutOfFds:
    """What to do after an ``accept`` found no descriptor: close ``victims``; or, with nothing to
    close, stop accepting for the back-off ``pause`` (seconds); ``wait``: the failure came within
    the hold after the last decision, which stands (seconds until the hold ends)."""

    victims: list[Hashable] = field(default_factory=list)
    pause: float = 0.0
    wait: float = 0.0


class ConnectionGuard:
    """The cap, the shedding order and the out-of-descriptors back-off of one listening socket."""

    def __init__(self, cap: int, *, keep: float = 7 / 8, minimum: int = 1, hold: float = 0.05,
                 backoff: tuple[float, float] = (0.1, 2.0), restore_after: float = 30.0,
                 spoke: Callable[[Hashable], bool] | None = None, shed_proved: str = "youngest",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cap < 1 or not 0 < keep <= 1 or shed_proved not in ("youngest", "idlest"):
            raise ValueError(f"a guard needs cap >= 1, keep in (0, 1] and shed_proved youngest or idlest, got "
                             f"{cap}, {keep}, {shed_proved!r}")
        self._idlest = shed_proved == "idlest"
        self.full_cap = cap
        self.cap = cap  # lower while descriptors run out for other reasons
        self.keep, self.minimum, self.hold = keep, minimum, hold
        self.backoff_first, self.backoff_max = backoff
        self.restore_after = restore_after
        self._spoke = spoke
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Hashable, _Entry] = {}
        self._hold_until = float("-inf")
        self._last_failure = float("-inf")
        self._backoff = self.backoff_first
        self.shed = 0  # connections this guard named to close
        self.refused = 0  # newcomers refused: nothing could be shed for them
        self.accept_failures = 0
        self.pauses = 0

    @property
    def open_count(self) -> int:
        return len(self._entries)

    def proof_of(self, key: Hashable) -> Proof | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.proof

    # -- what the shell reports -----------------------------------------------------------------

    def opened(self, key: Hashable, *, protect: bool = False) -> tuple[list[Hashable], bool]:
        """A connection opened. Returns ``(victims, refused)``: the connections to close so that the
        guard stays within its cap, and, with ``protect`` (the newcomer is never chosen), whether the
        newcomer must be refused because nothing else could go."""
        with self._lock:
            now = self._clock()
            if self.cap < self.full_cap and now - self._last_failure > self.restore_after:
                self.cap = self.full_cap  # descriptors have been plentiful for a while: the whole cap again
            self._entries[key] = _Entry(now, now)
            over = len(self._entries) - self.cap
            if over <= 0:
                return [], False
            target = over if protect else max(over, len(self._entries) - self._keep_count())
            victims = self._pick(target, exclude=key if protect else None)
            if protect and len(victims) < over:
                del self._entries[key]
                self.refused += 1
                return victims, True
            return victims, False

    def closed(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def prove(self, key: Hashable, proof: Proof) -> None:
        """The peer of ``key`` has shown ``proof`` (a connection's proof only goes up)."""
        entry = self._entries.get(key)
        if entry is not None and proof > entry.proof:
            entry.proof = proof

    def set_busy(self, key: Hashable, busy: bool) -> None:
        """A busy connection (answering a request) is never shed; either change is activity."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.busy = busy
            entry.since = self._clock()

    def out_of_fds(self, fits: int | None = None) -> OutOfFds:
        """An ``accept`` failed for want of descriptors; ``fits``: how many connections the shell
        knows the limit leaves room for now, if it knows."""
        with self._lock:
            now = self._clock()
            self.accept_failures += 1
            if now - self._last_failure > self.restore_after:
                self._backoff = self.backoff_first  # not a run of failures: start short again
            self._last_failure = now
            if now < self._hold_until:
                return OutOfFds(wait=self._hold_until - now)
            self._hold_until = now + self.hold
            n = len(self._entries)
            if n:
                # Fewer descriptors than the cap assumed: the cap comes down to what fits, until they
                # have been plentiful again for a while.
                self.cap = max(self.minimum, min(self.cap, int(n * self.keep), n - 1,
                                                 n if fits is None else fits))
                victims = self._pick(max(1, n - self._keep_count()))
                if victims:
                    return OutOfFds(victims)
            pause = self._backoff
            self._backoff = min(self.backoff_max, self._backoff * 2)
            self.pauses += 1
            return OutOfFds(pause=pause)

    # -- the order ----------------------------------------------------------------------------------

    def _keep_count(self) -> int:
        return max(1, int(self.cap * self.keep))

    def _pick(self, n: int, exclude: Hashable | None = None) -> list[Hashable]:
        """The ``n`` connections that go first (see the module); they leave the table."""
        if n <= 0:
            return []
        candidates = [(k, e) for k, e in self._entries.items() if not e.busy and k != exclude]

        def order(item: tuple[Hashable, _Entry]) -> tuple:
            key, entry = item
            if entry.proof >= Proof.KEY:
                # an established peer goes last, or the one idle longest goes first
                return (int(entry.proof), entry.since if self._idlest else -entry.opened)
            spoke = entry.proof == Proof.SPOKE or (self._spoke is not None and self._spoke(key))
            return (int(entry.proof), int(spoke), entry.opened)  # the oldest first

        candidates.sort(key=order)
        victims = [k for k, _ in candidates[:n]]
        for k in victims:
            del self._entries[k]
        self.shed += len(victims)
        return victims
