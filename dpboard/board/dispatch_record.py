"""The dispatch record beside a board: what each dispatcher that reads the board says of itself.

A board says what each engine holds; it cannot say how requests were picked. The ZMQ controller
and the SGLang and vLLM plugins' dispatchers publish that here, in a segment of its own,
``/dpboard-dispatch.<board>`` (/dev/shm/dpboard-dispatch.<board>), so that ``dpboard doctor`` can
answer the seed's checklist: which method is in effect, how often the budget is refreshed against
its throttle, how many requests went to each rank, how many came with ``routed_dp_rank`` or a
``bootstrap_room``, how many were placed by a fallback or rejected. The board's layout is unchanged.
docs/FORMAT.md ("The dispatch record") has it byte by byte.

Layout (little-endian): a 64-byte header (``DISPATCH_HEADER``: magic ``DPBDISP\\0``, version,
rows, slots, row size, creator pid), then ``rows`` rows of ``row_size(slots)`` bytes: a 128-byte row
head (``ROW_HEAD``: ``seq``, ``pid``, method, disaggregation mode, the publish's wall and monotonic
stamps, the refresh interval, then the cumulative counters) and per slot ``dispatched`` and
``routed`` (i64 each). One row per dispatching process (the vLLM API servers each have one).

Counters are cumulative: a reader computes rates by reading twice. A dispatcher counts in its own
per-request path as it already does and copies its counts here at most every ``PUBLISH_INTERVAL``
(``DispatchRow.due``), so the record costs nothing per request. Each row is a seqlocked row, with
the board's own seqlock (``dpb_seqlock.h``, in C, with the fences aarch64 needs): the writer makes
``seq`` odd (``SeqRow.begin``), writes the row, makes it even again (``SeqRow.end``); a reader
copies a row whole (``read_rows``), trying again a bounded number of times, then calls it torn.

The file, its rows and their holders follow ``dpboard.board.side_record``, as the sent record does.
Attaching checks what attaching a board checks (``check_owned``: a regular file of this user, or of
a trusted uid, that nobody else may write, one link; no symbolic link followed) and the size the
header claims; anything else is refused with one line naming the file and the fix.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpboard.board._seqlock import SeqRow, read_rows
from dpboard.board.names import MAX_SLOTS, SEGMENT_PREFIX, SHM_DIR, validate_name
from dpboard.board.side_record import (
    HEADER_SIZE,
    SideFile,
    SideFormat,
    base_header_layout,
    leave_records_of,
    read_mapped,
    remove_if_unheld,
    row_alive,
)
from dpboard.errors import DpboardError, InvalidInputError, NotFoundError
from dpboard.snapshot import RecordLayout, unpack_owner

if TYPE_CHECKING:
    import numpy as np

DISPATCH_MAGIC = b"DPBDISP\x00"
DISPATCH_VERSION = 1
DISPATCH_PREFIX = "dpboard-dispatch."
DISPATCH_HEADER_SIZE = HEADER_SIZE
DISPATCH_HEADER = base_header_layout([], [], [])
METHOD_BYTES = 32
MODE_BYTES = 8
COUNTERS: tuple[str, ...] = (
    "refreshes",  # budget refreshes from the board (reads of every slot)
    "requests",  # requests handed to a rank (a redelivered one counts again)
    "routed",  # of them, with routed_dp_rank
    "with_room",  # of them, carrying a bootstrap_room
    "fallbacks",  # placed by a fallback pick: the method had no rank (every rank stale, ...)
    "rejected",  # answered with an error instead of dispatched
)
ROW_HEAD_SIZE = 128
ROW_HEAD = RecordLayout({
    # holder: the owner word of a board's slot (pid and start time, snapshot.pack_owner): pids are recycled
    "names": ["seq", "holder", "method", "mode", "wall_ns", "monotonic_ns", "refresh_interval_ns", *COUNTERS],
    "formats": ["<u8", "<u8", f"S{METHOD_BYTES}", f"S{MODE_BYTES}", "<i8", "<i8", "<i8"] + ["<i8"] * len(COUNTERS),
    "offsets": [0, 8, 16, 48, 56, 64, 72] + [80 + 8 * i for i in range(len(COUNTERS))],
    "itemsize": ROW_HEAD_SIZE,
})
MAX_ROWS = 4096
READ_RETRIES = 4096  # attempts per row (a pause between two, none asleep): a publish is a few microseconds
PUBLISH_INTERVAL = 0.1  # seconds between two publishes of a row, at most
ABANDONED_RECORD_AGE = 10.0  # seconds: a record without a whole header younger than this may be being created


def row_size(slots: int) -> int:
    raw = ROW_HEAD_SIZE + 16 * slots
    return (raw + 63) // 64 * 64


DISPATCH_FORMAT = SideFormat("dispatch record", DISPATCH_PREFIX, DISPATCH_MAGIC, DISPATCH_VERSION,
                             DISPATCH_HEADER, row_size, MAX_ROWS, MAX_SLOTS, rows_are="rows (dispatchers)",
                             one_shape="one dispatcher count per board; stop the other dispatchers first")


def dispatch_segment_name(board: str) -> str:
    return "/" + DISPATCH_PREFIX + validate_name(board)


def dispatch_record_path(board: str) -> str:
    return DISPATCH_FORMAT.path(board)


def record_size(rows: int, slots: int) -> int:
    return DISPATCH_FORMAT.size(rows, slots)


def _text(value: str, size: int, what: str) -> bytes:
    raw = value.encode()
    if len(raw) > size or b"\x00" in raw:
        raise InvalidInputError(f"{what} {value!r} does not fit the dispatch record's {size}-byte text")
    return raw


class DispatchRecord:
    """The dispatch record of one board, mapped for writing: ``row(index, ...)`` claims a row."""

    def __init__(self, side: SideFile) -> None:
        self.board = side.board
        self.rows = side.rows
        self.slots = side.slots
        self.is_owner = side.is_owner
        self._side = side
        self._mapping = side.mapping
        self._size = row_size(side.slots)
        self._writers: list[DispatchRow] = []

    @classmethod
    def open(cls, board: str, rows: int, slots: int, *, timeout: float = 5.0,
             trust_uids: tuple[int, ...] = ()) -> DispatchRecord:
        """Create the record (``rows`` dispatchers, ``slots`` ranks), or attach the one that exists
        with that shape (with a board's checks). A damaged one, or one of another shape that nobody
        holds (a controller killed, then started with another ``--workers`` count), is replaced; one
        of another shape that a live dispatcher holds is refused, naming it. The last dispatcher out
        removes it."""
        if not 1 <= rows <= MAX_ROWS or not 1 <= slots <= MAX_SLOTS:
            raise InvalidInputError(f"dispatch record of board {board!r}: rows must be in [1, {MAX_ROWS}] and "
                                    f"slots in [1, {MAX_SLOTS}], got rows={rows}, slots={slots}")
        return cls(SideFile.open(DISPATCH_FORMAT, board, rows, slots, timeout=timeout, trust_uids=trust_uids))

    def row(self, index: int, *, method: str, mode: str = "null", refresh_interval: float = 0.0) -> DispatchRow:
        """This process's row ``index``, stamped with its method, disaggregation mode and refresh
        interval (seconds; 0: a refresh per dispatch). A row held by another live process is refused;
        a dead one's is taken over, made consistent and started again from zero."""
        if not 0 <= index < self.rows:
            raise InvalidInputError(f"dispatch record of board {self.board!r} has rows 0..{self.rows - 1}, "
                                    f"not {index}")
        method_raw = _text(method, METHOD_BYTES, "method")
        mode_raw = _text(mode, MODE_BYTES, "disaggregation mode")
        off = DISPATCH_HEADER_SIZE + index * self._size
        import numpy as np

        head = np.ndarray((), ROW_HEAD.dtype, self._mapping, off)
        per_slot = np.ndarray((self.slots, 2), "<i8", self._mapping, off + ROW_HEAD_SIZE)

        def reset(_: int) -> None:
            head["method"], head["mode"] = method_raw, mode_raw
            head["refresh_interval_ns"] = int(round(refresh_interval * 1e9))
            for name in COUNTERS:
                head[name] = 0
            per_slot[:] = 0
            head["wall_ns"], head["monotonic_ns"] = time.time_ns(), time.monotonic_ns()

        self._side.claim(index, reset, hint="one dispatcher per row")
        writer = DispatchRow(head, per_slot, self._side.seq_row(index))
        self._writers.append(writer)
        return writer

    def close(self) -> None:
        """Give up this process's rows; the last dispatcher out removes the record."""
        for writer in self._writers:
            writer.closed = True
            writer._head = writer._per_slot = None  # type: ignore[assignment]
        self._writers.clear()
        self._mapping = None  # type: ignore[assignment]
        self._side.close()

    def unlink(self) -> None:
        remove_if_unheld(DISPATCH_FORMAT, dispatch_record_path(self.board), force=True)


class DispatchRow:
    """One dispatcher's row. The dispatcher keeps its own counts; ``publish`` copies them here.

    ``due(now)`` says whether ``PUBLISH_INTERVAL`` has passed since the last publish (``now`` in
    ``time.monotonic()`` seconds), so a caller can check it on a path it runs anyway."""

    def __init__(self, head: np.ndarray, per_slot: np.ndarray, row: SeqRow) -> None:
        self._head = head
        self._per_slot = per_slot
        self._next = 0.0
        self.closed = False
        self._begin = row.begin  # odd: a write is under way
        self._end = row.end  # even: the write is whole

    def due(self, now: float) -> bool:
        return now >= self._next

    def set_method(self, method: str) -> None:
        """Stamp the row with another method (a dispatcher whose ``auto`` changed), under its seqlock."""
        if self.closed:
            return
        raw = _text(method, METHOD_BYTES, "method")
        self._begin()
        self._head["method"] = raw
        self._end()

    def publish(self, refreshes: int, requests: int, routed: int, with_room: int, fallbacks: int, rejected: int,
                per_rank: Any, routed_per_rank: Any = None) -> None:
        """Copy the dispatcher's cumulative counts into the row (``per_rank[k]``: requests sent to
        rank k; ``routed_per_rank[k]``: of them with routed_dp_rank; sequences of the row's slots)."""
        if self.closed:
            return
        head = self._head
        self._begin()
        head["refreshes"], head["requests"], head["routed"] = refreshes, requests, routed
        head["with_room"], head["fallbacks"], head["rejected"] = with_room, fallbacks, rejected
        n = min(len(per_rank), len(self._per_slot))
        self._per_slot[:n, 0] = per_rank[:n]
        if routed_per_rank is not None:
            self._per_slot[:n, 1] = routed_per_rank[:n]
        head["wall_ns"], head["monotonic_ns"] = time.time_ns(), time.monotonic_ns()
        self._end()
        self._next = time.monotonic() + PUBLISH_INTERVAL


class DispatchTally:
    """A plugin dispatcher's counts, copied into its row at most every ``PUBLISH_INTERVAL``.

    Nothing is added per request on a load-aware dispatcher's path: the requests per rank are what
    its budget already counts (``DPBudget.sent_reqs``; vLLM's own sent row), given as ``source``
    and read when the row is published, and the row is published from the dispatcher's refreshes
    (``TickingReader``: at most one per 20 ms). Only the requests off that path add here: routed
    ones (which refresh nothing, so they ``tick`` every ``PER_TICK``), fallbacks, rejections; and a
    dispatcher that reads no loads (follow_bootstrap_room) counts ``per_rank`` and ``with_room``
    itself and ticks every ``PER_TICK`` requests. The row is at most ``PUBLISH_INTERVAL`` behind
    while requests come; the last ones before a pause wait for the next refresh or tick."""

    __slots__ = ("row", "record", "per_rank", "routed", "routed_per_rank", "with_room", "fallbacks",
                 "rejected", "refreshes", "countdown", "source")
    PER_TICK = 32

    def __init__(self, record: DispatchRecord, row: DispatchRow) -> None:
        self.record = record
        self.row = row
        self.routed = self.with_room = self.fallbacks = self.rejected = self.refreshes = 0
        self.countdown = self.PER_TICK
        self.per_rank = [0] * record.slots
        self.routed_per_rank = [0] * record.slots
        self.source: Any = None  # () -> requests per rank so far, when the dispatcher counts them

    def requests_per_rank(self) -> Any:
        return self.per_rank if self.source is None else self.source()

    def tick(self) -> None:
        self.countdown = self.PER_TICK
        if self.row.due(time.monotonic()):
            self.publish()

    def publish(self) -> None:
        per_rank = self.requests_per_rank()
        self.row.publish(self.refreshes, int(sum(per_rank)), self.routed, self.with_room, self.fallbacks,
                         self.rejected, per_rank, self.routed_per_rank)

    def close(self) -> None:
        self.record.close()


class TickingReader:
    """A dispatcher's board reader that counts its reads (the refreshes) and ticks a tally at each:
    the record is published from the refresh path, never per request."""

    def __init__(self, reader: Any, tally: DispatchTally) -> None:
        self._reader = reader
        self._tally = tally
        self.n_slots = getattr(reader, "n_slots", None)
        self.stale_after = getattr(reader, "stale_after", None)
        if hasattr(reader, "read_detailed_array"):  # the backlog methods read the detail instead
            detailed = reader.read_detailed_array

            def read_detailed_array(out: Any = None) -> Any:
                arr = detailed() if out is None else detailed(out)
                self._ticked()
                return arr

            self.read_detailed_array = read_detailed_array

    def read_array(self, out: Any = None) -> Any:
        arr = self._reader.read_array() if out is None else self._reader.read_array(out)
        self._ticked()
        return arr

    def _ticked(self) -> None:
        tally = self._tally
        tally.refreshes += 1
        if tally.row.due(time.monotonic()):
            tally.publish()


def open_tally(board: str, rows: int, index: int, slots: int, *, method: str, mode: str = "null",
               refresh_interval: float = 0.0, logger: Any = None, trust_uids: tuple[int, ...] = ()) -> DispatchTally | None:
    """Row ``index`` of ``board``'s dispatch record, as a tally; a record that cannot be used is
    logged and done without (None): it is for diagnosis and never keeps a dispatcher from serving.
    ``trust_uids``: also attach a record these users created (the controller's ``--trust-uid``)."""
    try:
        record = DispatchRecord.open(board, rows, slots, trust_uids=trust_uids)
    except DpboardError as e:
        if logger is not None:
            logger.warning("dpboard: no dispatch record for dpboard doctor: %s", e)
        return None
    try:
        return DispatchTally(record, record.row(index, method=method, mode=mode, refresh_interval=refresh_interval))
    except DpboardError as e:
        record.close()
        if logger is not None:
            logger.warning("dpboard: no dispatch record for dpboard doctor: %s", e)
        return None


# -- reading ---------------------------------------------------------------------------------------


@dataclass
class DispatchRowSample:
    """One dispatcher's row as read: plain values (what ``dpboard doctor`` diagnoses)."""

    row: int
    pid: int
    alive: bool
    method: str
    mode: str
    refresh_interval: float  # seconds; 0: a refresh per dispatch
    age_s: float  # since the row's last publish
    wall_ns: int
    counts: dict[str, int] = field(default_factory=dict)  # COUNTERS
    per_rank: list[int] = field(default_factory=list)
    routed_per_rank: list[int] = field(default_factory=list)
    torn: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"row": self.row, "pid": self.pid, "alive": self.alive, "method": self.method, "mode": self.mode,
                "refresh_interval_s": self.refresh_interval, "age_s": self.age_s, "torn": self.torn,
                **self.counts, "per_rank": self.per_rank, "routed_per_rank": self.routed_per_rank}


def read_dispatch_record(board: str, *, trust_uids: tuple[int, ...] = (),
                         timeout: float = 0.2) -> list[DispatchRowSample] | None:
    """Every claimed row of ``board``'s dispatch record, each read whole (or marked torn), or None
    when the board has no record. A record that is not one (another user's, the wrong size, a
    link) is refused with one line, as a board would be."""
    try:
        fd, mapping, header = read_mapped(DISPATCH_FORMAT, board, trust_uids=trust_uids, timeout=timeout)
    except NotFoundError:
        return None
    try:
        rows, slots = int(header["rows"]), int(header["slots"])
        size = row_size(slots)
        now = time.monotonic_ns()
        out = []
        for index in range(rows):
            off = DISPATCH_HEADER_SIZE + index * size
            raw = _read_row(mapping, off, size)
            torn = raw is None
            if torn:
                raw = bytes(mapping[off: off + size])  # the pid and method only, for the report
            head = ROW_HEAD.unpack(raw)
            word = int(head["holder"])
            pid = unpack_owner(word)[0]
            if pid == 0:
                continue
            per = struct.unpack_from(f"<{2 * slots}q", raw, ROW_HEAD_SIZE)
            out.append(DispatchRowSample(
                row=index, pid=pid, alive=row_alive(DISPATCH_FORMAT, fd, index, slots, word),
                method=head["method"].rstrip(b"\0").decode(errors="replace"),
                mode=head["mode"].rstrip(b"\0").decode(errors="replace"),
                refresh_interval=int(head["refresh_interval_ns"]) / 1e9,
                age_s=(now - int(head["monotonic_ns"])) / 1e9, wall_ns=int(head["wall_ns"]),
                counts={name: int(head[name]) for name in COUNTERS},
                per_rank=list(per[0::2]), routed_per_rank=list(per[1::2]), torn=torn))
        return out
    finally:
        mapping.close()
        os.close(fd)


def _read_row(mapping: mmap.mmap, off: int, size: int) -> bytes | None:
    raw = bytearray(size)
    return None if read_rows(mapping, off, size, 1, raw, None, READ_RETRIES) else bytes(raw)


def remove_if_abandoned(board: str, *, leaving: bool = False) -> bool:
    """Remove ``board``'s dispatch record when nobody holds it any more (dispatchers killed with
    SIGKILL leave theirs). ``leaving``: this process counts as gone too (it is removing the board
    itself, so its own dispatcher of that board is done with it). A record of another user, or one
    that is not a record, is left alone. True when it was removed."""
    path = dispatch_record_path(board)
    if leaving:
        leave_records_of(DISPATCH_FORMAT, board)
    return remove_if_unheld(DISPATCH_FORMAT, path, besides=os.getpid() if leaving else 0,
                            young=ABANDONED_RECORD_AGE)


def remove_abandoned_records(board: str | None = None) -> list[str]:
    """``remove_if_abandoned`` for ``board``, or for every dispatch record here whose board is gone;
    the boards whose record was removed."""
    if board is not None:
        return [board] if remove_if_abandoned(board) else []
    removed = []
    for path in sorted(SHM_DIR.glob(DISPATCH_PREFIX + "*")):
        name = path.name[len(DISPATCH_PREFIX):]
        try:
            validate_name(name)
        except DpboardError:
            continue
        if not (SHM_DIR / (SEGMENT_PREFIX + name)).exists() and remove_if_abandoned(name):
            removed.append(name)
    return removed


def __getattr__(name: str) -> Any:
    """``DISPATCH_HEADER_DTYPE`` and ``ROW_DTYPE``, the records' NumPy types, built on first use."""
    layouts = {"DISPATCH_HEADER_DTYPE": DISPATCH_HEADER, "ROW_DTYPE": ROW_HEAD}
    if name in layouts:
        return layouts[name].dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
