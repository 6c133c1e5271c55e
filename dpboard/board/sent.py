"""The sent record beside a board: how many requests each front-end process sent to each slot.

A board says what each engine has received (``num_received_reqs``); this record says what was sent
to it, by every process that sends (each vLLM API server, say), so any of them can tell an engine's
requests in flight from all of them: ``sum of sent over the rows - received``. The board's layout is
unchanged: this is a file of its own, ``/dev/shm/dpboard-sent.<board>``, created beside the board by
the first sender. docs/FORMAT.md ("The sent record") has it byte by byte.

Layout (little-endian): a 64-byte header (``SENT_HEADER``: magic ``DPBSENT\\0``, version, rows,
slots, row size, creator pid, the board's generation, creator start ticks), then ``rows`` rows of
``row_size`` bytes: ``seq`` (u64), ``holder`` (the owner word of a board slot: pid and start ticks;
0 while free), ``shared`` (1 once ``base`` holds something), 8 reserved bytes, then per slot
``sent_reqs`` and ``sent_tokens`` (i64 each), then per slot ``base`` (i64: what the holder's reader
takes out of that slot's in-flight count, for readers that start later).

The file, its rows and their holders follow ``dpboard.board.side_record``, as the dispatch record
does: a process takes row ``index`` with an open-file-description lock on the row's bytes (the
kernel drops it when the process dies, so a dead holder never blocks its successor, whatever became
of its pid), then, under the row's seqlock, stamps itself as holder and zeroes the counts: the row
is consistent again even when its last holder died half-way through ``add``. Readers count a row
only while it is held (its holder runs with the recorded start time, or its lock is held); a row
whose holder died, or that a new holder took, leaves the totals and is reported as *departed* once,
with its last counts (``totals(departed=...)``).

Every row is a seqlocked row (``dpb_seqlock.h``, the board's own seqlock, in C): a writer's
``add`` makes ``seq`` odd, updates the counts and makes it even again, with the fences that aarch64
needs; a reader copies every row whole (``SideFile.read_rows``) and keeps, per row, the last copy
that was whole. A row torn for good (its writer stopped or died mid-write) reads as its last whole
value: a torn row never fails a read. The counters only grow while a holder keeps its row.

The record names the board's generation: a record left by an earlier board of that name (a
deployment killed with SIGKILL) is replaced, never inherited, and so is one of another shape (another
API-server count) that no live process holds. Like every dpboard file in /dev/shm it is opened with
``O_NOFOLLOW``, created with ``O_EXCL`` and mode 0600, and refused unless it is a regular file of
ours with one link that nobody else may write (``dpboard.ownership.check_owned``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from dpboard.board._seqlock import SeqRow, read_rows
from dpboard.board.liveness import process_alive, process_start_ticks
from dpboard.board.names import validate_name
from dpboard.board.side_record import (
    HEADER_SIZE,
    HOLDER_WORD,
    SideFile,
    SideFormat,
    base_header_layout,
    held,
    open_existing,
    read_header,
    read_mapped,
    remove_if_unheld,
    row_alive,
)
from dpboard.errors import DpboardError, InvalidInputError, NotFoundError
from dpboard.snapshot import unpack_owner

# NumPy, bound when the first record is opened: record_state and remove_record (what `dpboard clean`
# calls) read headers with the standard library and load no NumPy.
np: Any = None


def _numpy() -> Any:
    global np
    if np is None:
        import numpy

        np = numpy
    return np


SENT_MAGIC = b"DPBSENT\x00"
SENT_VERSION = 2
SENT_PREFIX = "dpboard-sent."
SENT_HEADER_SIZE = HEADER_SIZE
SENT_HEADER = base_header_layout(["generation", "creator_start_ticks"], ["<u8", "<i8"], [32, 40])
ROW_HEADER = 32  # seq, holder, shared, reserved
SHARED_WORD = 2  # 1 once the holder has shared its base
COUNTS_WORD = ROW_HEADER // 8
MAX_ROWS = 4096
MAX_SLOTS = 1 << 16
READ_RETRIES = 4  # attempts per row and read before a torn row falls back to its last value
LIVENESS_INTERVAL = 0.25  # seconds between two checks of the rows' holders by one reader


def sent_segment_name(board: str) -> str:
    return "/" + SENT_PREFIX + validate_name(board)


def sent_path(board: str) -> str:
    return SENT_FORMAT.path(board)


def row_size(slots: int) -> int:
    raw = ROW_HEADER + 24 * slots
    return (raw + 63) // 64 * 64


def record_size(rows: int, slots: int) -> int:
    return SENT_FORMAT.size(rows, slots)


SENT_FORMAT = SideFormat("sent record", SENT_PREFIX, SENT_MAGIC, SENT_VERSION, SENT_HEADER, row_size,
                         MAX_ROWS, MAX_SLOTS, rows_are="rows (API servers)",
                         one_shape="one API-server count per deployment, stop the other servers first")


def holder_alive(word: int) -> bool:
    """Whether the process an owner word names still runs (pid and start time)."""
    if not word:
        return False
    pid, ticks = unpack_owner(int(word))
    return process_alive(pid, ticks)


class SentRecord:
    """The sent record of one board, mapped; ``row(index)`` to write, ``totals()`` to read."""

    def __init__(self, side: SideFile, generation: int) -> None:
        self.board = side.board
        self.rows = rows = side.rows
        self.slots = slots = side.slots
        self.generation = generation
        self.is_owner = side.is_owner
        self._side = side
        _numpy()
        words = row_size(slots) // 8
        self._table = side.table
        self._holder = side.holder
        # what one read copies, and the views of the copy it looks at
        self._copy = np.zeros((rows, words), np.int64)
        self._copy_holder = self._copy[:, HOLDER_WORD].view("<u8")
        self._copy_counts = self._copy[:, COUNTS_WORD: COUNTS_WORD + 2 * slots].reshape(rows, slots, 2)
        self._whole = np.zeros(rows, bool)
        self._changed = np.zeros(rows, bool)
        self._whole_rows = self._whole[:, None, None]
        # per row: the holder it was last read with, whether that holder counts, its last whole counts
        self._identity = np.zeros(rows, np.uint64)
        self._counted = np.zeros(rows, np.int64)
        self._counted_rows = self._counted[:, None, None]
        self._last = np.zeros((rows, slots, 2), np.int64)
        self._weighted = np.zeros((rows, slots, 2), np.int64)
        self._next_liveness = 0.0
        self._stale = np.zeros(rows, bool)
        self.torn = False  # at the last read: some counted row was read at an older, last whole value
        self._row_writers: dict[int, SentWriter] = {}

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(cls, board: str, rows: int, slots: int, *, generation: int, timeout: float = 5.0) -> SentRecord:
        """Create the record of board ``board`` (generation ``generation``: ``Board.generation``) for
        ``rows`` senders and ``slots`` engines, or attach the one there is of that board and shape.

        A record of an earlier board of that name, or a damaged one, is replaced; so is one of another
        shape that no live process holds (a restart with another API-server count). One of another
        shape held by a live process is refused, naming it. This process owns and removes at exit a
        record it creates (unless other live senders still hold rows of it)."""
        if not 1 <= rows <= MAX_ROWS or not 1 <= slots <= MAX_SLOTS:
            raise InvalidInputError(f"sent record of board {board!r}: rows must be in [1, {MAX_ROWS}] and slots in "
                                    f"[1, {MAX_SLOTS}], got rows={rows}, slots={slots}")
        if not 0 < generation < 2**64:
            raise InvalidInputError(f"sent record of board {board!r}: generation must be the board's (a positive "
                                    f"64-bit number), got {generation!r}")
        pid = os.getpid()
        side = SideFile.open(SENT_FORMAT, board, rows, slots, timeout=timeout,
                             fields={"generation": generation, "creator_start_ticks": process_start_ticks(pid)},
                             stale=lambda header: int(header["generation"]) != generation)
        return cls(side, generation)

    # -- writing ------------------------------------------------------------------------------

    def row(self, index: int) -> SentWriter:
        """This process's writer of row ``index``. A row held by another live process is refused;
        a dead holder's row is taken over, made consistent and started again from zero."""
        if not 0 <= index < self.rows:
            raise InvalidInputError(f"sent record of board {self.board!r} has rows 0..{self.rows - 1}, not {index}")
        writer = self._row_writers.get(index)
        if writer is not None:
            return writer

        def reset(i: int) -> None:
            self._table[i, SHARED_WORD:] = 0

        self._side.claim(index, reset, hint="one sender per row (each API server has its own client index)")
        base = COUNTS_WORD + 2 * self.slots
        writer = SentWriter(self._side.seq_row(index), self._table[index, COUNTS_WORD: base].reshape(self.slots, 2),
                            self._table[index, SHARED_WORD: SHARED_WORD + 1], self._table[index, base: base + self.slots])
        self._row_writers[index] = writer
        return writer

    # -- reading ------------------------------------------------------------------------------

    def totals(self, out: np.ndarray | None = None, departed: np.ndarray | None = None) -> np.ndarray:
        """Per slot, (sent requests, sent tokens) summed over the rows whose holder runs, each row at
        its last whole value. ``departed`` (same shape, optional) receives the last counts of the
        rows that stopped counting since the previous call: their holder died or closed, or a new
        holder took the row. Never raises on a torn row; ``torn`` then says that a counted row was
        taken at its last whole value (which may lag)."""
        out = np.zeros((self.slots, 2), np.int64) if out is None else out
        if departed is not None:
            departed.fill(0)
        self._side.read_rows(self._copy, self._whole, READ_RETRIES)
        np.not_equal(self._copy_holder, self._identity, out=self._changed)
        np.logical_and(self._changed, self._whole, out=self._changed)
        if self._changed.any():
            self._new_holders(departed)
        np.copyto(self._last, self._copy_counts, where=self._whole_rows)
        now = time.monotonic()
        if now >= self._next_liveness:
            self._next_liveness = now + LIVENESS_INTERVAL
            self._check_holders(departed)
        np.logical_not(self._whole, out=self._stale)
        np.logical_and(self._stale, self._counted, out=self._stale)
        self.torn = bool(self._stale.any())
        np.multiply(self._last, self._counted_rows, out=self._weighted)
        np.sum(self._weighted, axis=0, out=out)
        return out

    def peer_base(self, out: np.ndarray) -> bool:
        """Copy into ``out`` (one int64 per slot) the base that the holder of another counted row
        shared (``SentWriter.share``); False when none has. A reader that starts late takes it up:
        its peers have seen what it has not (a dead server's requests that arrived)."""
        base = COUNTS_WORD + 2 * self.slots
        for i in np.flatnonzero(self._counted):
            if int(i) not in self._row_writers and self._table[i, SHARED_WORD] == 1:
                np.copyto(out, self._table[i, base: base + self.slots])
                return True
        return False

    def holders(self) -> list[tuple[int, int, bool]]:
        """(pid, start ticks, alive) of every row's holder as the record says now; (0, 0, False): free."""
        return [(*unpack_owner(int(w)), self._side.row_alive(i, int(w))) for i, w in enumerate(self._holder)]

    def _new_holders(self, departed: np.ndarray | None) -> None:
        for i in np.flatnonzero(self._changed):
            if self._counted[i] and departed is not None:
                departed += self._last[i]
            self._identity[i] = self._copy_holder[i]
            self._counted[i] = self._side.row_alive(int(i), int(self._identity[i]))

    def _check_holders(self, departed: np.ndarray | None) -> None:
        for i in np.flatnonzero(self._counted):
            if not self._side.row_alive(int(i), int(self._identity[i])):
                self._counted[i] = 0
                if departed is not None:
                    departed += self._last[i]

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Give up this process's rows (they stop counting) and drop the mapping; the last process out
        removes the record."""
        if self._side.fd < 0:
            return
        for writer in self._row_writers.values():
            writer.closed = True
            writer._add = _closed_add  # a request sent while the record closes counts nowhere, never raises
        self._row_writers.clear()
        self._table = self._holder = None  # type: ignore[assignment]
        self._side.close()

    def unlink(self) -> None:
        remove_record(sent_path(self.board), force=True)


def _closed_add(word: int, a: int, b: int) -> None:
    pass


class SentWriter:
    """One sender's row: ``add(slot, tokens)`` counts one request sent to ``slot``; ``share`` makes
    its reader's base known to readers that start later."""

    def __init__(self, row: SeqRow, counts: np.ndarray, shared: np.ndarray, base: np.ndarray) -> None:
        self._row = row
        self._add = row.add
        self._counts = counts
        self._shared = shared
        self._base = base
        self.closed = False

    def share(self, slots: np.ndarray, base: np.ndarray) -> None:
        """Publish ``base[i]`` for slot ``slots[i]``: requests its reader takes out of the slot's
        in-flight count. Word by word, outside the seqlock: each word is whole, and a peer that
        takes them up reads them once, at its start."""
        self._base[slots] = base
        self._shared[0] = 1

    def add(self, slot: int, tokens: int) -> None:
        """One request of ``tokens`` tokens sent to ``slot``: both counts, as one seqlocked write."""
        self._add(COUNTS_WORD + 2 * slot, 1, tokens)

    def sent(self, slot: int) -> tuple[int, int]:
        return int(self._counts[slot, 0]), int(self._counts[slot, 1])


# -- reading, for the views ------------------------------------------------------------------


def read_sent(board: str, *, generation: int, trust_uids: tuple[int, ...] = (),
              timeout: float = 0.2) -> tuple[list[int], list[int]] | None:
    """Per slot, (requests sent by the rows whose holder runs, the base a holder shared: what the
    senders take out of that slot's in-flight count), read-only: None when ``board`` (of generation
    ``generation``) has no sent record, or only an earlier board's. Nothing is created, no row
    taken; a row torn at every retry counts at its last copy. A file that is not a record to read
    is refused with one line (``read_mapped``). The in-flight count of slot k is then
    ``max(0, sent[k] - received[k] - base[k])``, what every sender dispatches with."""
    try:
        fd, mapping, header = read_mapped(SENT_FORMAT, board, trust_uids=trust_uids, timeout=timeout)
    except NotFoundError:
        return None
    table = None
    try:
        if int(header["generation"]) != generation:
            return None
        _numpy()
        rows, slots = int(header["rows"]), int(header["slots"])
        words = row_size(slots) // 8
        copy = np.zeros((rows, words), np.int64)
        whole = np.zeros(rows, bool)
        if read_rows(mapping, SENT_HEADER_SIZE, row_size(slots), rows, copy, whole, READ_RETRIES):
            table = np.frombuffer(mapping, "<i8", rows * words, SENT_HEADER_SIZE).reshape(rows, words)
            copy[~whole] = table[~whole]  # torn at every retry: counted at a plain copy
        sent = np.zeros(slots, np.int64)
        base = np.zeros(slots, np.int64)
        shared = False
        for i in range(rows):
            word = int(copy[i, HOLDER_WORD]) & (2**64 - 1)
            if not row_alive(SENT_FORMAT, fd, i, slots, word):
                continue
            sent += copy[i, COUNTS_WORD: COUNTS_WORD + 2 * slots: 2]
            if not shared and copy[i, SHARED_WORD] == 1:
                base[:] = copy[i, COUNTS_WORD + 2 * slots: COUNTS_WORD + 3 * slots]
                shared = True
        return sent.tolist(), base.tolist()
    finally:
        table = None  # noqa: F841 - the view lets go of the mapping before it is closed
        mapping.close()
        os.close(fd)


# -- files ------------------------------------------------------------------------------------


def record_state(path: str) -> tuple[int | None, list[int]] | None:
    """(the board generation it names, None if damaged; pids of who holds it, -1 for a process that
    has it open without a row) of the record at ``path``; None when it is not ours or gone."""
    try:
        fd = open_existing(SENT_FORMAT, path, "?", writable=False)
    except DpboardError:
        return None
    if fd is None:
        return None
    try:
        found = read_header(SENT_FORMAT, fd, path)
        if isinstance(found, str):
            return None, []
        return int(found[0]["generation"]), held(SENT_FORMAT, fd, found[0])
    finally:
        os.close(fd)


def remove_record(path: str, *, force: bool = False, inode: int | None = None) -> bool:
    """Remove the record at ``path`` (ours only) when nobody holds it, or with ``force``; only the file
    ``inode`` when given. True when it was removed."""
    return remove_if_unheld(SENT_FORMAT, path, force=force, inode=inode)


def __getattr__(name: str) -> Any:
    """``SENT_HEADER_DTYPE``, the header's NumPy type, built on first use."""
    if name == "SENT_HEADER_DTYPE":
        return SENT_HEADER.dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
