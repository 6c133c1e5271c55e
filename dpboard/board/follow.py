"""``BoardFollower``: a board followed by name, for processes that run longer than one board lives.

A scheduler that restarts may remove its board and create a new one of the same name. A process
holding the old mapping keeps reading (or writing) slots nobody uses any more: the controller then
sees every rank go stale and rejects requests, a relay sends nothing, a collector writes into the
void. The follower notices a removed or replaced segment (``Board.is_current``: another file or
another generation) at most every ``check_interval`` seconds, attaches the board that now has the
name, and logs it; its user rebuilds its readers or writers when ``poll()`` says so.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from dpboard.board.segment import DEFAULT_STALE_AFTER, Board
from dpboard.errors import DpboardError, NotFoundError
from dpboard.snapshot import DETAILED_DTYPE, SNAPSHOT_DTYPE, LoadSnapshot

LOGGER_NAME = "dpboard.board"

if TYPE_CHECKING:
    import logging

DEFAULT_CHECK_INTERVAL = 0.25  # seconds between two looks at the segment's name (a stat and a header read)
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def _out_of_fds() -> bool:
    """Whether this process cannot open a file now: a board it could not look at is then not known
    to be removed or replaced."""
    try:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return e.errno in _OUT_OF_FDS
    os.close(fd)
    return False


class BoardFollower:
    """The board of a name, re-attached when the segment is replaced.

    ``board`` is a Board (followed by its name from then on) or a name (attached here). A new board
    with fewer than ``min_slots`` slots is not adopted: the follower keeps the old one and says why.
    """

    def __init__(self, board: Board | str, *, min_slots: int = 1, check_interval: float = DEFAULT_CHECK_INTERVAL,
                 trust_uids: Iterable[int] = (), clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        self._opened = not isinstance(board, Board)
        self.trust_uids = tuple(trust_uids)
        self.board = Board.attach(board, trust_uids=self.trust_uids) if self._opened else board
        self.name = self.board.name
        self.min_slots = min_slots
        self.check_interval = check_interval
        self._clock = clock
        self._next_check = clock() + check_interval
        self._logger = logger
        self._said: str | None = None  # the last problem logged, so that a lasting one is said once
        self.reattached = 0

    def poll(self) -> bool:
        """True when another board of this name was attached just now (rebuild readers and writers)."""
        now = self._clock()
        if now < self._next_check:
            return False
        self._next_check = now + self.check_interval
        return self.check()

    def check(self) -> bool:
        """``poll()`` without the interval: look now."""
        if self.board.is_current():
            return False
        if _out_of_fds():
            return self._cannot_look()
        try:
            new = Board.attach(self.name, timeout=0.05, trust_uids=self.trust_uids)
        except OSError as e:
            if e.errno in _OUT_OF_FDS:
                return self._cannot_look()
            raise
        except NotFoundError:
            self._say(f"board {self.name!r} was removed; still reading the last one until a board of that "
                      f"name is back")
            return False
        except DpboardError as e:
            if _out_of_fds():
                return self._cannot_look()
            self._say(f"board {self.name!r} was replaced by one this process cannot use ({e}); still "
                      f"reading the last one")
            return False
        if new.generation == self.board.generation and new._identity == self.board._identity:
            new.close()  # the same board: only the last look failed (e.g. fds ran out meanwhile)
            return False
        if new.n_slots < self.min_slots:
            self._say(f"board {self.name!r} was replaced by one of {new.n_slots} slots, fewer than the "
                      f"{self.min_slots} this process needs; still reading the last one")
            new.close()
            return False
        self._log().warning("board %r was replaced (generation %#x -> %#x, %d slots): attached the new one",
                          self.name, self.board.generation, new.generation, new.n_slots)
        old, self.board = self.board, new
        if self._opened:
            old.close()  # readers and writers made from it keep their own mapping until they go
        self._opened = True
        self._said = None
        self.reattached += 1
        return True

    def _cannot_look(self) -> bool:
        self._say(f"cannot look at board {self.name!r} now: this process is out of fds (raise `ulimit -n`); "
                  f"still using the one attached")
        return False

    def _log(self) -> Any:
        # logging is imported on the first line logged: the read-only tools that import the board
        # never pay for it
        if self._logger is None:
            import logging

            self._logger = logging.getLogger(LOGGER_NAME)
        return self._logger

    def _say(self, message: str) -> None:
        if message != self._said:
            self._log().warning("%s", message)
            self._said = message

    def close(self) -> None:
        if self._opened:
            self.board.close()


class FollowingReader:
    """A reader of the first ``n_slots`` slots of a followed board: ``read_array()`` fills and
    returns its own SNAPSHOT_DTYPE array, from whichever board has the name now. What a
    ``Dispatcher`` and the controller's acknowledgements read."""

    def __init__(self, follower: BoardFollower, *, stale_after: float = DEFAULT_STALE_AFTER,
                 n_slots: int | None = None) -> None:
        self.follower = follower
        self.stale_after = stale_after
        self.n_slots = follower.board.n_slots if n_slots is None else n_slots
        follower.min_slots = max(follower.min_slots, self.n_slots)
        self._records = np.zeros(self.n_slots, SNAPSHOT_DTYPE)
        self._attach()

    def _attach(self) -> None:
        board = self.follower.board
        self._reader = board.reader(stale_after=self.stale_after)
        # a larger board than needed is read whole, then cut to the slots in use
        self._full = None if board.n_slots == self.n_slots else np.zeros(board.n_slots, SNAPSHOT_DTYPE)
        self._full_detailed: np.ndarray | None = None  # the same for detailed reads, made at the first

    def read_array(self) -> np.ndarray:
        if self.follower.poll():
            self._attach()
        if self._full is None:
            return self._reader.read_array(self._records)
        self._reader.read_array(self._full)
        self._records[:] = self._full[: self.n_slots]
        return self._records

    def read_all(self) -> list[LoadSnapshot | None]:
        if self.follower.poll():
            self._attach()
        return self._reader.read_all()[: self.n_slots]

    def read_detailed_array(self, out: np.ndarray) -> np.ndarray:
        """``BoardReader.read_detailed_array`` of the followed board, its first ``n_slots`` records in
        ``out`` (the engines' detail: what the backlog and lockstep methods read beyond the fields)."""
        if self.follower.poll():
            self._attach()
        if self._full is None:
            return self._reader.read_detailed_array(out)
        full = self._full_detailed
        if full is None or len(full) != len(self._full):
            full = self._full_detailed = np.zeros(len(self._full), DETAILED_DTYPE)
        self._reader.read_detailed_array(full)
        out[: self.n_slots] = full[: self.n_slots]
        return out
