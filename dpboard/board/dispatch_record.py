"""The dispatch record beside a board: what each dispatcher that reads the board says of itself.

A board says what each engine holds; it cannot say how requests were picked. The ZMQ controller
and the SGLang and vLLM plugins' dispatchers publish that here, in a segment of its own,
``/dpboard-dispatch.<board>`` (/dev/shm/dpboard-dispatch.<board>), so that ``dpboard doctor`` can
answer the seed's checklist: which method is in effect, how often the budget is refreshed against
its throttle, how many requests went to each rank, how many came with ``routed_dp_rank`` or a
``bootstrap_room``, how many were placed by a fallback or rejected; and, for ``inflight_wave``, what
its hold did (``WaveCounts``: requests held, waves, releases by reason, the longest hold against
its bound, bytes held), which ``dpboard top`` and ``dpboard serve``'s ``/metrics`` show. The board's
layout is unchanged. docs/FORMAT.md ("The dispatch record") has it byte by byte.

Layout (little-endian): a 64-byte header (``DISPATCH_HEADER``: magic ``DPBDISP\\0``, version,
rows, slots, row size, creator pid), then ``rows`` rows of ``row_size(slots)`` bytes: a 256-byte row
head (``ROW_HEAD``: ``seq``, ``pid``, method, disaggregation mode, the publish's wall and monotonic
stamps, the refresh interval, the cumulative counters, then the wave's counters) and per slot
``dispatched`` and ``routed`` (i64 each). One row per dispatching process (the vLLM API servers
each have one). Version 1 had a 128-byte row head, without the wave's counters: a reader reads it
still (``read_dispatch_record``: its rows' ``wave`` is None); a writer replaces one that nobody
holds, as a side record of another version.

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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, NamedTuple

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
DISPATCH_VERSION = 2
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
# why an inflight_wave hold released its requests (``dpboard.controller.wave`` decides): the wave
# was full; what it held reached the byte bound; the group could no longer wait; the oldest reached
# its bound; the dispatcher stopped; a control message must not overtake them (the SGLang plugin)
WAVE_REASONS = ("full", "bytes", "busy", "bound", "shutdown", "order")
WAVE_COUNTERS: tuple[str, ...] = (
    "wave",  # 1: the row's dispatcher holds arrivals for waves (inflight_wave); 0: the rest are 0
    "wave_held",  # requests held for a wave, cumulative
    "wave_holding",  # requests held now
    "waves",  # waves released
    "wave_hold_sum_ns",  # time held, summed over the released requests
    "wave_hold_max_ns",  # the longest one request was held
    "wave_max_hold_ns",  # the hold's budget (--wave-max-hold): what wave_hold_max_ns is checked against
    "wave_held_bytes",  # bytes of the frames held now
    "wave_held_bytes_max",  # the most held at once
    *(f"wave_released_{reason}" for reason in WAVE_REASONS),  # requests released, by why their wave left
)
ROW_HEAD_SIZE = 256
ROW_HEAD_V1_SIZE = 128
_HEAD = {
    # holder: the owner word of a board's slot (pid and start time, snapshot.pack_owner): pids are recycled
    "names": ["seq", "holder", "method", "mode", "wall_ns", "monotonic_ns", "refresh_interval_ns", *COUNTERS],
    "formats": ["<u8", "<u8", f"S{METHOD_BYTES}", f"S{MODE_BYTES}", "<i8", "<i8", "<i8"] + ["<i8"] * len(COUNTERS),
    "offsets": [0, 8, 16, 48, 56, 64, 72] + [80 + 8 * i for i in range(len(COUNTERS))],
}
ROW_HEAD = RecordLayout({  # version 2: version 1's head, then the wave's counters, then 8 bytes reserved
    "names": _HEAD["names"] + list(WAVE_COUNTERS),
    "formats": _HEAD["formats"] + ["<i8"] * len(WAVE_COUNTERS),
    "offsets": _HEAD["offsets"] + [ROW_HEAD_V1_SIZE + 8 * i for i in range(len(WAVE_COUNTERS))],
    "itemsize": ROW_HEAD_SIZE,
})
ROW_HEAD_V1 = RecordLayout({**_HEAD, "itemsize": ROW_HEAD_V1_SIZE})
MAX_ROWS = 4096
READ_RETRIES = 4096  # attempts per row (a pause between two, none asleep): a publish is a few microseconds
PUBLISH_INTERVAL = 0.1  # seconds between two publishes of a row, at most
# seconds between two looks of ``DispatchTally.trail`` at counts that have not changed: a change is
# in the row within PUBLISH_INTERVAL, and an idle loop compares them 20 times a second
TRAIL_LOOK = PUBLISH_INTERVAL / 2
ABANDONED_RECORD_AGE = 10.0  # seconds: a record without a whole header younger than this may be being created


def row_size(slots: int) -> int:
    raw = ROW_HEAD_SIZE + 16 * slots
    return (raw + 63) // 64 * 64


def row_size_v1(slots: int) -> int:
    """A version 1 row: the 128-byte head, then the slots'."""
    return (ROW_HEAD_V1_SIZE + 16 * slots + 63) // 64 * 64


DISPATCH_FORMAT = SideFormat("dispatch record", DISPATCH_PREFIX, DISPATCH_MAGIC, DISPATCH_VERSION,
                             DISPATCH_HEADER, row_size, MAX_ROWS, MAX_SLOTS, rows_are="rows (dispatchers)",
                             one_shape="one dispatcher count per board; stop the other dispatchers first")
DISPATCH_FORMAT_V1 = replace(DISPATCH_FORMAT, version=1, row_size=row_size_v1)


@dataclass(frozen=True)
class _ReadFormat(SideFormat):
    """The dispatch record as a reader takes it: of this version, or of version 1 (what a dispatcher
    of an earlier dpboard still writes), each checked against its own row size."""

    def damage(self, header: Any, file_size: int) -> str | None:
        fmt = DISPATCH_FORMAT_V1 if int(header["version"]) == 1 else DISPATCH_FORMAT
        return SideFormat.damage(fmt, header, file_size)


_READ_FORMAT = _ReadFormat(**{f.name: getattr(DISPATCH_FORMAT, f.name) for f in fields(SideFormat)})


@dataclass(frozen=True)
class WaveCounts:
    """An ``inflight_wave`` hold's counters (``dpboard.controller.wave.WaveHold.counts``), as a row
    carries them: cumulative but for ``holding`` and ``held_bytes`` (now)."""

    held: int = 0  # requests held for a wave
    holding: int = 0  # requests held now
    waves: int = 0  # waves released
    hold_sum_s: float = 0.0  # seconds held, summed over the released requests
    hold_max_s: float = 0.0  # the longest one request was held
    max_hold_s: float = 0.0  # the hold's budget (--wave-max-hold)
    held_bytes: int = 0  # frames held now
    held_bytes_max: int = 0  # the most held at once
    released: tuple[int, ...] = (0,) * len(WAVE_REASONS)  # requests released, by WAVE_REASONS

    def after(self, earlier: WaveCounts | None) -> WaveCounts:
        """These counts following ``earlier``'s (a dispatcher's before this one's): the totals summed,
        the maxima the larger, what is held now and the budget this one's."""
        if earlier is None:
            return self
        return replace(self, held=self.held + earlier.held, waves=self.waves + earlier.waves,
                       hold_sum_s=self.hold_sum_s + earlier.hold_sum_s,
                       hold_max_s=max(self.hold_max_s, earlier.hold_max_s),
                       held_bytes_max=max(self.held_bytes_max, earlier.held_bytes_max),
                       released=tuple(a + b for a, b in zip(self.released, earlier.released, strict=True)))

    def released_by(self, reason: str) -> int:
        return self.released[WAVE_REASONS.index(reason)]

    def row_fields(self) -> tuple[int, ...]:
        """The row's ``WAVE_COUNTERS``, in order."""
        return (1, self.held, self.holding, self.waves, _ns(self.hold_sum_s), _ns(self.hold_max_s),
                _ns(self.max_hold_s), self.held_bytes, self.held_bytes_max, *self.released)

    def as_dict(self) -> dict[str, Any]:
        """What a reader shows (``DispatchRowSample.wave``, ``dpboard top --json``)."""
        return {"held": self.held, "holding": self.holding, "waves": self.waves, "hold_sum_s": self.hold_sum_s,
                "hold_max_s": self.hold_max_s, "max_hold_s": self.max_hold_s, "held_bytes": self.held_bytes,
                "held_bytes_max": self.held_bytes_max, "released": dict(zip(WAVE_REASONS, self.released, strict=True))}

    @classmethod
    def of_row(cls, head: dict[str, Any]) -> WaveCounts | None:
        """The counts a version 2 row head holds (``ROW_HEAD.unpack``), or None where it holds none."""
        if not head["wave"]:
            return None
        return cls(held=int(head["wave_held"]), holding=int(head["wave_holding"]), waves=int(head["waves"]),
                   hold_sum_s=int(head["wave_hold_sum_ns"]) / 1e9, hold_max_s=int(head["wave_hold_max_ns"]) / 1e9,
                   max_hold_s=int(head["wave_max_hold_ns"]) / 1e9, held_bytes=int(head["wave_held_bytes"]),
                   held_bytes_max=int(head["wave_held_bytes_max"]),
                   released=tuple(int(head[f"wave_released_{r}"]) for r in WAVE_REASONS))


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


class RowCounts(NamedTuple):
    """A dispatcher's counts as its row carries them, but for the refreshes (which the row's reader
    counts): from a dispatcher that counts every request itself (the ZMQ controller)."""

    per_rank: Sequence[int]  # requests handed to each rank (a redelivered one counts again)
    routed_per_rank: Sequence[int]  # of them, with routed_dp_rank
    routed: int
    with_room: int
    fallbacks: int
    rejected: int


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
            for name in (*COUNTERS, *WAVE_COUNTERS):
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

    @property
    def next_at(self) -> float:
        """When the row is due again (``time.monotonic()`` seconds)."""
        return self._next

    def set_method(self, method: str) -> None:
        """Stamp the row with another method (a dispatcher whose ``auto`` changed), under its seqlock."""
        if self.closed:
            return
        raw = _text(method, METHOD_BYTES, "method")
        self._begin()
        self._head["method"] = raw
        self._end()

    def publish(self, refreshes: int, requests: int, routed: int, with_room: int, fallbacks: int, rejected: int,
                per_rank: Any, routed_per_rank: Any = None, *, wave: WaveCounts | None = None) -> None:
        """Copy the dispatcher's cumulative counts into the row (``per_rank[k]``: requests sent to
        rank k; ``routed_per_rank[k]``: of them with routed_dp_rank; sequences of the row's slots;
        ``wave``: its wave's counters, None for a dispatcher that holds nothing)."""
        if self.closed:
            return
        head = self._head
        self._begin()
        head["refreshes"], head["requests"], head["routed"] = refreshes, requests, routed
        head["with_room"], head["fallbacks"], head["rejected"] = with_room, fallbacks, rejected
        if wave is not None:
            for name, value in zip(WAVE_COUNTERS, wave.row_fields(), strict=True):
                head[name] = value
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
    while requests come; the last ones before a pause wait for ``trail``, which a loop of the
    engine's that turns anyway calls: it publishes what changed since the row's last publish once
    the row is due, and costs one comparison on most turns.

    A dispatcher that counts every request itself (the ZMQ controller) gives ``counted`` instead:
    the row reads every count but the refreshes from it. ``wave``, where given, says what the
    dispatcher's inflight_wave hold did (None while it holds nothing), read at each publish."""

    __slots__ = ("row", "record", "per_rank", "routed", "routed_per_rank", "with_room", "fallbacks",
                 "rejected", "refreshes", "countdown", "source", "counted", "wave", "_published", "_next_trail")
    PER_TICK = 32

    def __init__(self, record: DispatchRecord, row: DispatchRow) -> None:
        self.record = record
        self.row = row
        self.routed = self.with_room = self.fallbacks = self.rejected = self.refreshes = 0
        self.countdown = self.PER_TICK
        self.per_rank = [0] * record.slots
        self.routed_per_rank = [0] * record.slots
        self.source: Any = None  # () -> requests per rank so far, when the dispatcher counts them
        self.counted: Callable[[], RowCounts] | None = None  # every count but the refreshes, counted elsewhere
        self.wave: Callable[[], WaveCounts | None] | None = None
        self._published: tuple[Any, ...] | None = None  # the counts the row last got (``_counts``)
        self._next_trail = 0.0  # time.monotonic() seconds: when ``trail`` looks at the counts again

    def requests_per_rank(self) -> Any:
        return self.per_rank if self.source is None else self.source()

    def tick(self) -> None:
        self.countdown = self.PER_TICK
        if self.row.due(time.monotonic()):
            self.publish()

    def _row_counts(self) -> tuple[RowCounts, WaveCounts | None]:
        if self.counted is not None:
            counts = self.counted()
        else:
            counts = RowCounts(self.requests_per_rank(), self.routed_per_rank, self.routed, self.with_room,
                               self.fallbacks, self.rejected)
        return counts, None if self.wave is None else self.wave()

    def publish(self) -> None:
        counts, wave = self._row_counts()
        self.row.publish(self.refreshes, int(sum(counts.per_rank)), counts.routed, counts.with_room,
                         counts.fallbacks, counts.rejected, counts.per_rank, counts.routed_per_rank, wave=wave)
        self._published = self._counts(counts, wave)

    def _counts(self, counts: RowCounts, wave: WaveCounts | None) -> tuple[Any, ...]:
        """What the row says, as one value to compare (the requests per rank as bytes: a
        retracted pick taken again elsewhere leaves their sum as it was)."""
        return (self.refreshes, counts.routed, counts.with_room, counts.fallbacks, counts.rejected,
                array("q", (int(n) for n in counts.per_rank)).tobytes(),
                array("q", (int(n) for n in counts.routed_per_rank)).tobytes(), wave)

    def trail(self, now: float) -> bool:
        """A turn of a loop that runs anyway (``now``: ``time.monotonic()``): the counts go into the
        row if they changed since its last publish and it is due, so that the last ones before a
        pause are there within ``PUBLISH_INTERVAL``. True when it published."""
        if now < self._next_trail:
            return False
        if not self.row.due(now):
            self._next_trail = self.row.next_at  # no publish before then anyway
            return False
        self._next_trail = now + TRAIL_LOOK
        if self._counts(*self._row_counts()) == self._published:
            return False
        self.publish()
        return True

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
    wave: WaveCounts | None = None  # an inflight_wave hold's counters; None: it holds nothing, or a version 1 row

    def as_dict(self) -> dict[str, Any]:
        return {"row": self.row, "pid": self.pid, "alive": self.alive, "method": self.method, "mode": self.mode,
                "refresh_interval_s": self.refresh_interval, "age_s": self.age_s, "torn": self.torn,
                **self.counts, "per_rank": self.per_rank, "routed_per_rank": self.routed_per_rank,
                **({"wave": self.wave.as_dict()} if self.wave is not None else {})}


def read_dispatch_record(board: str, *, trust_uids: tuple[int, ...] = (),
                         timeout: float = 0.2) -> list[DispatchRowSample] | None:
    """Every claimed row of ``board``'s dispatch record, each read whole (or marked torn), or None
    when the board has no record. A record that is not one (another user's, the wrong size, a
    link) is refused with one line, as a board would be. A version 1 record (an earlier dpboard's
    dispatcher) is read too: its rows have no wave's counters."""
    try:
        fd, mapping, header = read_mapped(_READ_FORMAT, board, trust_uids=trust_uids, timeout=timeout)
    except NotFoundError:
        return None
    try:
        rows, slots = int(header["rows"]), int(header["slots"])
        v1 = int(header["version"]) == 1
        fmt, layout = (DISPATCH_FORMAT_V1, ROW_HEAD_V1) if v1 else (DISPATCH_FORMAT, ROW_HEAD)
        size = fmt.row_size(slots)
        now = time.monotonic_ns()
        out = []
        for index in range(rows):
            off = DISPATCH_HEADER_SIZE + index * size
            raw = _read_row(mapping, off, size)
            torn = raw is None
            if torn:
                raw = bytes(mapping[off: off + size])  # the pid and method only, for the report
            head = layout.unpack(raw)
            word = int(head["holder"])
            pid = unpack_owner(word)[0]
            if pid == 0:
                continue
            per = struct.unpack_from(f"<{2 * slots}q", raw, layout.struct.size)
            out.append(DispatchRowSample(
                row=index, pid=pid, alive=row_alive(fmt, fd, index, slots, word),
                method=head["method"].rstrip(b"\0").decode(errors="replace"),
                mode=head["mode"].rstrip(b"\0").decode(errors="replace"),
                refresh_interval=int(head["refresh_interval_ns"]) / 1e9,
                age_s=(now - int(head["monotonic_ns"])) / 1e9, wall_ns=int(head["wall_ns"]),
                counts={name: int(head[name]) for name in COUNTERS},
                per_rank=list(per[0::2]), routed_per_rank=list(per[1::2]), torn=torn,
                wave=None if v1 or torn else WaveCounts.of_row(head)))
        return out
    finally:
        mapping.close()
        os.close(fd)


def read_wave_rows(board: str, *, trust_uids: tuple[int, ...] = ()) -> list[DispatchRowSample]:
    """The rows of ``board``'s dispatch record whose dispatcher runs and holds arrivals for waves
    (``inflight_wave``), each with its ``wave``: what ``dpboard top`` and ``/metrics`` show. None
    where the board has no record, or one that cannot be read (``dpboard doctor`` says why)."""
    try:
        rows = read_dispatch_record(board, trust_uids=trust_uids)
    except DpboardError:
        return []
    return [r for r in rows or [] if r.alive and not r.torn and r.wave is not None]


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
