"""The sent record beside a board: how many requests each front-end process sent to each slot.

A board says what each engine has received (``num_received_reqs``); this record says what was sent
to it, by every process that sends (each vLLM API server, say), so any of them can tell an engine's
requests in flight from all of them: ``sum of sent over the rows - received``. The board's layout is
unchanged: this is a segment of its own, ``/dpboard-sent.<board>`` (/dev/shm/dpboard-sent.<board>),
created beside the board by the first sender. docs/FORMAT.md ("The sent record") has it byte by byte.

Layout (little-endian): a 64-byte header (``SENT_HEADER_DTYPE``: magic ``DPBSENT\\0``, version, rows,
slots, row size, creator pid), then ``rows`` rows of ``row_size`` bytes: ``seq`` (u64), ``pid``
(i64, 0 while the row is free), then per slot ``sent_reqs`` and ``sent_tokens`` (i64 each).

One writer per row (a process claims row ``index`` and stamps its pid; a row held by another live
process is refused). The same seqlock rule as a board slot: the writer makes ``seq`` odd, updates
the counts, makes it even again; a reader copies a row between two equal even reads of ``seq`` and
copies again otherwise (a bounded number of times, then the row counts as torn: ``totals`` raises
``TornReadError`` rather than return a mixed row). The counters only grow, and x86-64 keeps stores
in program order, which is what the rule needs from the plain NumPy stores here.
"""

from __future__ import annotations

import atexit
import mmap
import os
import time

import numpy as np
import posix_ipc

from dpboard.board.errors import BoardError
from dpboard.board.liveness import process_alive
from dpboard.board.names import validate_name
from dpboard.errors import InvalidInputError, UnavailableError

SENT_MAGIC = b"DPBSENT\x00"
SENT_VERSION = 1
SENT_PREFIX = "dpboard-sent."
SENT_HEADER_SIZE = 64
SENT_HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "rows", "slots", "row_size", "creator_pid"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<i8"],
    "offsets": [0, 8, 12, 16, 20, 24],
    "itemsize": SENT_HEADER_SIZE,
})
ROW_HEADER = 16  # seq, pid
MAX_ROWS = 4096
READ_RETRIES = 64


class TornReadError(BoardError):
    """A sent-record row kept changing while it was read."""


def sent_segment_name(board: str) -> str:
    return "/" + SENT_PREFIX + validate_name(board)


def row_size(slots: int) -> int:
    raw = ROW_HEADER + 16 * slots
    return (raw + 63) // 64 * 64


class SentRecord:
    """The sent record of one board, mapped; ``row(index)`` to write, ``totals()`` to read."""

    def __init__(self, board: str, mapping: mmap.mmap, rows: int, slots: int, owner: bool) -> None:
        self.board = board
        self.rows = rows
        self.slots = slots
        self.is_owner = owner
        self._mapping = mapping
        size = row_size(slots)
        words = size // 8
        table = np.ndarray((rows, words), "<i8", mapping, SENT_HEADER_SIZE)
        self._seq = table[:, 0].view("<u8")
        self._pid = table[:, 1]
        self._counts = table[:, 2: 2 + 2 * slots].reshape(rows, slots, 2)
        self._copy = np.zeros((rows, slots, 2), np.int64)
        self._row_writers: dict[int, SentWriter] = {}

    @classmethod
    def open(cls, board: str, rows: int, slots: int, *, timeout: float = 5.0) -> SentRecord:
        """Create the record (``rows`` senders, ``slots`` engines), or attach the one that exists
        with that shape; this process owns and later removes the one it creates."""
        name = sent_segment_name(board)
        if not 1 <= rows <= MAX_ROWS or slots < 1:
            raise InvalidInputError(f"sent record of board {board!r}: rows must be in [1, {MAX_ROWS}] and slots "
                                    f">= 1, got rows={rows}, slots={slots}")
        size = SENT_HEADER_SIZE + rows * row_size(slots)
        deadline = time.monotonic() + timeout
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:
            shm = None
        if shm is not None:
            try:
                mapping = mmap.mmap(shm.fd, size)
            finally:
                shm.close_fd()
            header = np.ndarray((), SENT_HEADER_DTYPE, mapping, 0)
            header["version"], header["rows"], header["slots"] = SENT_VERSION, rows, slots
            header["row_size"], header["creator_pid"] = row_size(slots), os.getpid()
            header["magic"] = SENT_MAGIC  # last: an attacher that sees the magic sees a whole header
            atexit.register(_unlink, name, os.getpid())
            return cls(board, mapping, rows, slots, owner=True)
        mapping = _map_when_sized(name, board, deadline)
        header = np.ndarray((), SENT_HEADER_DTYPE, mapping, 0)
        deadline = time.monotonic() + timeout
        while mapping[0:8] != SENT_MAGIC:
            if time.monotonic() >= deadline:
                del header
                mapping.close()
                raise UnavailableError(f"sent record {name} of board {board!r} was never initialised by its "
                                       f"creator: remove /dev/shm{name} if that process is gone")
            time.sleep(0.005)
        found = (int(header["version"]), int(header["rows"]), int(header["slots"]))
        if found != (SENT_VERSION, rows, slots):
            del header
            mapping.close()
            raise InvalidInputError(
                f"sent record {name} of board {board!r} has version {found[0]}, {found[1]} rows and {found[2]} "
                f"slots; this process needs version {SENT_VERSION}, {rows} rows and {slots} slots: remove "
                f"/dev/shm{name} once its deployment is stopped")
        return cls(board, mapping, rows, slots, owner=False)

    def row(self, index: int) -> SentWriter:
        """This process's writer of row ``index`` (a row held by another live process is refused)."""
        if not 0 <= index < self.rows:
            raise InvalidInputError(f"sent record of board {self.board!r} has rows 0..{self.rows - 1}, not {index}")
        pid = os.getpid()
        holder = int(self._pid[index])
        if holder not in (0, pid) and process_alive(holder):
            raise BoardError(f"row {index} of the sent record of board {self.board!r} is held by live process "
                             f"{holder}: one sender per row")
        self._pid[index] = pid
        writer = SentWriter(self._seq[index: index + 1], self._counts[index])
        self._row_writers[index] = writer
        return writer

    def totals(self, out: np.ndarray | None = None) -> np.ndarray:
        """Per slot, (sent requests, sent tokens) summed over every row, each row read whole."""
        out = np.zeros((self.slots, 2), np.int64) if out is None else out
        for _ in range(READ_RETRIES):
            before = self._seq.copy()
            self._copy[:] = self._counts
            after = self._seq
            if not ((before & 1).any() or (before != after).any()):
                np.sum(self._copy, axis=0, out=out)
                return out
        raise TornReadError(f"the sent record of board {self.board!r} kept changing over {READ_RETRIES} reads")

    def close(self) -> None:
        for writer in self._row_writers.values():
            writer.closed = True
        self._row_writers.clear()
        self._seq = self._pid = self._counts = None  # type: ignore[assignment]
        try:
            self._mapping.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process

    def unlink(self) -> None:
        _unlink(sent_segment_name(self.board), os.getpid())


class SentWriter:
    """One sender's row: ``add(slot, tokens)`` counts one request sent to ``slot``."""

    def __init__(self, seq: np.ndarray, counts: np.ndarray) -> None:
        self._seq = seq
        self._counts = counts
        self.closed = False

    def add(self, slot: int, tokens: int) -> None:
        seq = self._seq
        seq += 1  # odd: a write is under way
        row = self._counts[slot]
        row[0] += 1
        row[1] += tokens
        seq += 1

    def sent(self, slot: int) -> tuple[int, int]:
        return int(self._counts[slot, 0]), int(self._counts[slot, 1])


def _map_when_sized(name: str, board: str, deadline: float) -> mmap.mmap:
    """Map an existing record, once its creator has sized it (it may be a moment behind)."""
    while True:
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise UnavailableError(f"sent record {name} of board {board!r} was removed while opening it; "
                                   f"retry") from None
        try:
            if os.fstat(shm.fd).st_size >= SENT_HEADER_SIZE:
                return mmap.mmap(shm.fd, 0)
        finally:
            shm.close_fd()
        if time.monotonic() >= deadline:
            raise UnavailableError(f"sent record {name} of board {board!r} was never sized by its creator: "
                                   f"remove /dev/shm{name} if that process is gone")
        time.sleep(0.005)


def _unlink(name: str, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child does not remove its parent's record
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
