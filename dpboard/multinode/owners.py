"""``Owners``: who may speak for a node, and which node a rank belongs to (the collector's identity
rules, docs/MULTINODE.md "Who speaks for a node").

A relay frame names a node id and ranks; nothing in its bytes proves either. What proves them is
where the frame came from:

- **A configured key** (CURVE with ``--curve-authorized-keys``): a key speaks for the node ids it
  is configured for (its file named ``node<N>.key``, or a ``--curve-key-nodes`` line) and for no
  other; a node id configured for a key is spoken for by that key only. Such a speaker is
  *authenticated*.
- **Otherwise, a connection** (plain TCP, ``ipc://``, CURVE without client authentication, an
  authorized key configured for no node): a node id belongs to the first connection that sent a
  valid frame for it, until that connection closes or stays silent for ``release_after`` seconds.

A frame read after its connection closed (it was queued) writes only what nobody holds, and claims
nothing. A rank belongs to the first node whose valid frame names it, until that node has not relayed it for
``release_after`` seconds, or the connection that spoke for it closes; an authenticated node takes a
rank over from an unauthenticated claim at once. A frame that breaks one of these rules is dropped
whole and counted: ``bad_owner`` (a node id another connection or key speaks for), ``bad_rank`` (a
rank another node holds).

Pure: plain values and an injectable clock; the collector feeds it each frame's speaker, and the
connections its guard saw close.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dpboard.errors import InvalidInputError, NotFoundError
from dpboard.multinode.wire import BAD_OWNER, BAD_RANK, FrameError

DEFAULT_RELEASE_AFTER = 10.0  # seconds of silence before a node's or a rank's claim is let go
_NODE_KEY = re.compile(r"node-?(?P<node>[0-9]{1,18})")


@dataclass(frozen=True)
class Speaker:
    """Where a frame came from: its connection (None: it closed before the frame was read), and the
    CURVE key it authenticated with (its public key, Z85), when the collector knows the key's node ids."""

    connection: Hashable
    key: str | None = None


GONE = Speaker(connection=None)  # a frame read after its connection closed: it may write, never claim


@dataclass
class _Claim:
    node: int
    speaker: Speaker
    authenticated: bool
    seen: float


def key_nodes_from_name(name: str) -> frozenset[int] | None:
    """The node a key file's name gives (``node1``, ``node-12``), or None."""
    m = _NODE_KEY.fullmatch(name)
    return frozenset({int(m.group("node"))}) if m else None


def read_key_nodes(path: str | Path, names: Iterable[str]) -> dict[str, frozenset[int]]:
    """A ``--curve-key-nodes`` file: one line per key, ``NAME NODE [NODE ...]`` (``#`` starts a
    comment), NAME a key file's name without ``.key`` in the authorized directory."""
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"--curve-key-nodes {p} does not exist: one line per key, `NAME NODE [NODE ...]`")
    known = set(names)
    out: dict[str, frozenset[int]] = {}
    for number, raw in enumerate(p.read_text(errors="replace").splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        name, ids = words[0], words[1:]
        where = f"--curve-key-nodes {p} line {number}"
        if name not in known:
            raise InvalidInputError(f"{where}: no key {name}.key in the authorized keys directory "
                                    f"(known: {', '.join(sorted(known)) or 'none'})")
        if not ids or not all(w.isdigit() and len(w) <= 18 for w in ids):
            raise InvalidInputError(f"{where}: give the key's node ids as integers >= 0 after its name, "
                                    f"e.g. `{name} 1 2`")
        if name in out:
            raise InvalidInputError(f"{where}: key {name} is listed twice: give all its node ids on one line")
        out[name] = frozenset(int(w) for w in ids)
    return out


class Owners:
    """The identity rules of one collector (see the module). ``key_nodes`` maps a CURVE public key
    (Z85) to the node ids it speaks for."""

    def __init__(self, key_nodes: Mapping[str, frozenset[int]] | None = None, *,
                 release_after: float = DEFAULT_RELEASE_AFTER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.key_nodes = dict(key_nodes or {})
        self._reserved: dict[int, set[str]] = {}  # node -> the keys configured for it
        for key, nodes in self.key_nodes.items():
            for node in nodes:
                self._reserved.setdefault(node, set()).add(key)
        self.release_after = release_after
        self._clock = clock
        self._nodes: dict[int, _Claim] = {}  # node -> the connection that speaks for it (unauthenticated)
        self._ranks: dict[int, _Claim] = {}  # rank -> the node that holds it
        self.released = 0  # claims let go (a connection closed, silence, an authenticated node)

    def authenticated(self, speaker: Speaker | None) -> bool:
        return speaker is not None and speaker.key in self.key_nodes

    def check(self, speaker: Speaker | None, node: int, ranks: Iterable[int]) -> list[int]:
        """Raise ``FrameError`` unless ``speaker`` may write ``ranks`` as ``node``'s; returns the ranks
        it takes (claimed or taken over) so that the caller can say so. Nothing changes on a refusal;
        ``accept`` records a frame once it is written."""
        now = self._clock()
        auth = self.authenticated(speaker)
        if auth:
            if node not in self.key_nodes[speaker.key]:
                nodes = ", ".join(map(str, sorted(self.key_nodes[speaker.key])))
                raise FrameError(BAD_OWNER, f"frame claims node {node}, but its key speaks for node {nodes} only")
        elif node in self._reserved:
            raise FrameError(BAD_OWNER, f"frame claims node {node}, which speaks only with its configured CURVE key")
        else:
            claim = self._nodes.get(node)
            if claim is not None and claim.speaker.connection != _connection(speaker) and not self._silent(claim, now):
                raise FrameError(BAD_OWNER, f"frame claims node {node}, which another connection speaks for")
        taken = []
        for rank in ranks:
            claim = self._ranks.get(rank)
            if claim is None or claim.node == node or self._silent(claim, now):
                if claim is None or claim.node != node:
                    taken.append(rank)
                continue
            if auth and not claim.authenticated:
                taken.append(rank)  # an authenticated node wins over an unauthenticated claim
                continue
            raise FrameError(BAD_RANK, f"frame from node {node} names rank {rank}, which node {claim.node} relays")
        return taken

    def accept(self, speaker: Speaker | None, node: int, ranks: Iterable[int], taken: Iterable[int] = ()) -> None:
        """``speaker``'s frame for ``node`` naming ``ranks`` was written (after ``check``)."""
        now = self._clock()
        auth = self.authenticated(speaker)
        speaker = speaker or _DIRECT
        if speaker.connection is None:
            return  # a connection that is gone claims nothing (it wrote what nobody held)
        if not auth:
            claim = self._nodes.get(node)
            if claim is None or claim.speaker.connection != speaker.connection:
                self._nodes[node] = _Claim(node, speaker, False, now)
            else:
                claim.seen = now
        for rank in taken:
            if rank in self._ranks:
                self.released += 1
            self._ranks[rank] = _Claim(node, speaker, auth, now)
        for rank in ranks:
            claim = self._ranks.get(rank)
            if claim is None:
                self._ranks[rank] = _Claim(node, speaker, auth, now)
            else:
                claim.seen = now

    def owner_of(self, rank: int) -> int | None:
        claim = self._ranks.get(rank)
        return None if claim is None or self._silent(claim, self._clock()) else claim.node

    def connection_closed(self, connection: Hashable) -> list[int]:
        """Let go of every claim the unauthenticated connection ``connection`` made; returns the
        node ids it spoke for."""
        nodes = [n for n, c in self._nodes.items() if c.speaker.connection == connection]
        for node in nodes:
            del self._nodes[node]
        ranks = [r for r, c in self._ranks.items() if not c.authenticated and c.speaker.connection == connection]
        for rank in ranks:
            del self._ranks[rank]
        self.released += len(nodes) + len(ranks)
        return nodes

    def expire(self) -> None:
        """Forget claims silent for longer than ``release_after`` (``check`` already ignores them)."""
        now = self._clock()
        for table in (self._nodes, self._ranks):
            stale = [k for k, c in table.items() if self._silent(c, now)]
            for k in stale:
                del table[k]
            self.released += len(stale)

    def clear(self) -> None:
        self._nodes.clear()
        self._ranks.clear()

    def _silent(self, claim: _Claim, now: float) -> bool:
        return now - claim.seen > self.release_after


_DIRECT = Speaker(connection="direct")  # frames handed to handle_frame by the embedding process


def _connection(speaker: Speaker | None) -> Hashable:
    return (speaker or _DIRECT).connection
