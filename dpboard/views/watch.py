"""One look at a board, as ``dpboard top``, ``dpboard serve`` and ``dpboard demo`` show it.

``BoardWatch`` follows a board by name across its lifetime: it attaches, samples every slot into a
``Frame`` (rows, liveness counts, imbalance, totals, publish and request rates, a short per-rank
history), notices when the segment is removed or replaced, and attaches again when a board of that
name comes back. It imports only the board (NumPy and the C reader), never Numba or CuPy, so the
tools that use it start fast.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpboard.board import Board, BoardError, BoardReader, check_stale_after, segment_path, validate_name
from dpboard.errors import AccessDeniedError, DpboardError, InvalidInputError, NotFoundError
from dpboard.snapshot import DETAILED_DTYPE, SlotStatus
from dpboard.views.rows import in_flight, slot_rows, status_counts, status_of

DEFAULT_HISTORY = 32

SORT_KEYS: dict[str, tuple[str, bool]] = {
    # name -> (row field, descending)
    "rank": ("dp_rank", False),
    "total": ("num_total_tokens", True),
    "active": ("num_active_tokens", True),
    "running": ("num_running_reqs", True),
    "waiting": ("num_waiting_reqs", True),
    "usage": ("token_usage", True),
    "age": ("age_s", True),
    "status": ("status", False),
}


def imbalance(values: list[int]) -> float | None:
    """max / mean of the values (1.0 = perfectly even); None when there is nothing to compare."""
    if not values:
        return None
    mean = sum(values) / len(values)
    if mean <= 0:
        return None
    return max(values) / mean


@dataclass
class Frame:
    """Everything a view shows of one sample of a board."""

    board: str
    wall_time_ns: int
    n_slots: int = 0
    generation: int = 0
    node_id: int = 0
    creator_pid: int = 0
    stale_after: float = 1.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    imbalance: float | None = None
    totals: dict[str, int] = field(default_factory=dict)
    publish_rate: float | None = None  # publishes per second, all slots together
    request_rate: float | None = None  # requests received per second, all slots together
    gone: str | None = None  # why the board cannot be shown now (vanished, not created yet)
    doctor: dict[str, Any] | None = None  # dpboard.views.doctor's findings over a short window (top sets it)

    def sorted_rows(self, sort: str = "rank") -> list[dict[str, Any]]:
        key, descending = SORT_KEYS[sort]

        def sort_key(row: dict[str, Any]) -> tuple[int, Any, int]:
            value = row.get(key)
            missing = value is None
            if value is None:
                value = 0
            if descending and not isinstance(value, str):
                value = -value
            # Slots without a value sink to the bottom whatever the direction; rank breaks ties.
            return (int(missing), value, row["dp_rank"])

        return sorted(self.rows, key=sort_key)

    def as_dict(self) -> dict[str, Any]:
        """The frame as plain JSON-able data (``dpboard top --json``)."""
        return {
            "board": self.board,
            "timestamp_ns": self.wall_time_ns,
            "n_slots": self.n_slots,
            "generation": self.generation,
            "node_id": self.node_id,
            "creator_pid": self.creator_pid,
            "stale_after_s": self.stale_after,
            "gone": self.gone,
            "status_counts": self.counts,
            "imbalance": self.imbalance,
            "totals": self.totals,
            "publish_rate": self.publish_rate,
            "request_rate": self.request_rate,
            **({"doctor": self.doctor} if self.doctor is not None else {}),
            "ranks": self.rows,
        }


class BoardWatch:
    """Samples a board by name; survives the board vanishing and coming back.

    ``wait=False`` makes a board that does not exist yet an error at construction (a mistyped name
    should not wait forever); a board of another user (``AccessDeniedError``) is one even with
    ``wait=True``; once attached, a board that vanishes is reported in ``Frame.gone``
    and attached again when it comes back.
    """

    def __init__(self, name: str, *, stale_after: float = 1.0, history: int = DEFAULT_HISTORY,
                 wait: bool = False, trust_uids: Iterable[int] = ()) -> None:
        self.name = validate_name(name)
        check_stale_after(stale_after)
        self.trust_uids = tuple(trust_uids)
        if history < 1:
            raise InvalidInputError(f"history must be at least 1 sample, got {history!r}")
        self.stale_after = stale_after
        self.history_len = history
        self._path = segment_path(self.name)
        self._board: Board | None = None
        self._reader: BoardReader | None = None
        self._gone: str | None = None
        self._seen_board = False
        self._detailed: np.ndarray | None = None
        self.history: list[deque[int]] = []
        self._prev_seq: list[int] | None = None
        self._prev_recv: list[int] | None = None
        self._prev_time = 0.0
        self._error: DpboardError | None = None
        # A board of another user is refused at once even with ``wait``: waiting does not change
        # who owns it, and a watch that waited would only say "not created" at its deadline.
        if not self._attach() and (not wait or isinstance(self._error, AccessDeniedError)):
            if self._error is not None:
                raise self._error  # what is wrong with the board, as `dpboard info` says it
            raise NotFoundError(
                f"board {name!r} does not exist ({self._path}): check the name with `dpboard ls`, "
                f"or pass --wait to wait for it to be created"
            )

    # -- attach / vanish ----------------------------------------------------------------------

    def _attach(self) -> bool:
        self._error = None
        try:
            board = Board.attach(self.name, timeout=0.2, trust_uids=self.trust_uids)
        except FileNotFoundError:
            if self._seen_board:
                self._gone = (f"board {self.name!r} is gone (its segment {self._path} was removed); "
                              f"waiting for it to come back")
            else:
                self._gone = f"board {self.name!r} does not exist ({self._path}); waiting for it to be created"
            return False
        except (BoardError, PermissionError, OSError) as e:
            self._gone = f"board {self.name!r} cannot be read: {e}"
            self._error = e if isinstance(e, DpboardError) else BoardError(self._gone)
            return False
        reader = board.reader(stale_after=self.stale_after)
        # A new incarnation starts a new history: the old one described other writers.
        self.history = [deque(maxlen=self.history_len) for _ in range(board.n_slots)]
        self._board, self._reader, self._gone = board, reader, None
        self._seen_board = True
        self._prev_seq = self._prev_recv = None
        return True

    def _lose_board(self) -> None:
        name = self._board.name if self._board is not None else self.name
        if self._board is not None:
            self._board.close()
        self._board = self._reader = None
        self._gone = (f"board {name!r} is gone (its segment {self._path} was removed or replaced); "
                      f"waiting for it to come back")
        self._prev_seq = self._prev_recv = None

    @property
    def attached(self) -> bool:
        return self._board is not None

    @property
    def board(self) -> Board | None:
        return self._board

    # -- sampling -----------------------------------------------------------------------------

    def follow(self) -> None:
        """Notice a removed or replaced board, and attach again when one of this name is there."""
        if self._board is not None and not self._board.is_current():
            self._lose_board()
        if self._board is None:
            # Also right after a loss: a board of that name may already be back (a restarted creator).
            self._attach()

    @property
    def error(self) -> DpboardError | None:
        """What the last attempt to attach met, when it was more than a missing board."""
        return self._error

    @property
    def gone(self) -> str | None:
        """Why the board cannot be read now (None while it is attached)."""
        return self._gone

    def read_detailed(self) -> np.ndarray | None:
        """Every slot with its detail (``DETAILED_DTYPE``, one consistent read per slot), or None
        while the board is gone (``gone`` says why). The array is this watch's own, reused."""
        self.follow()
        if self._board is None or self._reader is None:
            return None
        if self._detailed is None or len(self._detailed) != self._board.n_slots:
            self._detailed = np.zeros(self._board.n_slots, DETAILED_DTYPE)
        return self._reader.read_detailed_array(self._detailed)

    def sample(self) -> Frame:
        """Read every slot once and derive what the views show, the rates and the history from this
        sample and the one before (one viewer's: each call moves them on)."""
        frame = self.frame()
        if frame.gone is not None:
            return frame
        self._rates(frame, time.monotonic())
        for row, hist in zip(frame.rows, self.history, strict=True):
            hist.append(row["num_total_tokens"] if status_of(row).has_snapshot else 0)
            row["history"] = list(hist)
        return frame

    def frame(self) -> Frame:
        """One read of every slot and what follows from it alone: no rates, no history, and nothing
        of this watch changed, so that any number of readers (``dpboard serve``'s ``/v1/board``)
        may call it; a reader derives rates from the rows' own ``publish_seq``,
        ``num_received_reqs`` and ``monotonic_ns`` between two frames."""
        self.follow()
        now_wall = time.time_ns()
        if self._board is None or self._reader is None:
            return Frame(board=self.name, wall_time_ns=now_wall, stale_after=self.stale_after, gone=self._gone)
        board = self._board
        rows = slot_rows(self._reader)
        header = board.header
        frame = Frame(
            board=board.name, wall_time_ns=now_wall, n_slots=board.n_slots, generation=board.generation,
            node_id=board.node_id, creator_pid=header.creator_pid, stale_after=self.stale_after, rows=rows,
            counts=status_counts(rows),
        )
        live = [row for row in rows if status_of(row) is SlotStatus.LIVE]
        frame.imbalance = imbalance([row["num_total_tokens"] for row in live])
        frame.totals = {
            "live_ranks": len(live),
            **{f: sum(row[f] for row in live) for f in (
                "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
                "num_active_tokens", "max_total_num_tokens", "num_received_reqs")},
        }
        # where vLLM's API servers keep a sent record: each engine's requests in flight
        flying = in_flight(board.name, board.generation, [row["num_received_reqs"] for row in rows],
                           trust_uids=self.trust_uids)
        if flying is not None:
            for row, n in zip(rows, flying, strict=True):
                row["in_flight"] = n
            frame.totals["in_flight"] = sum(flying)
        return frame

    def _rates(self, frame: Frame, now: float) -> None:
        rows = frame.rows
        seqs = [row["publish_seq"] for row in rows]
        recvs = [row["num_received_reqs"] for row in rows]
        rates: list[float | None] = [None] * len(rows)
        if self._prev_seq is not None and self._prev_recv is not None and now > self._prev_time:
            dt = now - self._prev_time
            total_pub = total_recv = 0
            for i in range(len(rows)):
                d_seq = seqs[i] - self._prev_seq[i]
                d_recv = recvs[i] - self._prev_recv[i]
                if d_seq >= 0:  # a restarted writer starts counting again from 1: skip that tick
                    rates[i] = d_seq / dt
                    total_pub += d_seq
                if d_recv >= 0:
                    total_recv += d_recv
            frame.publish_rate = total_pub / dt
            frame.request_rate = total_recv / dt
        for row, rate in zip(rows, rates, strict=True):
            row["publish_rate"] = rate
        self._prev_seq, self._prev_recv, self._prev_time = seqs, recvs, now

    def close(self) -> None:
        self._reader = None
        if self._board is not None:
            self._board.close()
            self._board = None
