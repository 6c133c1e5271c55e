"""The dispatch record beside a board: what each dispatcher that reads the board says of itself.

A board says what each engine holds; it cannot say how requests were picked. The ZMQ controller
and the SGLang and vLLM plugins' dispatchers publish that here, in a segment of its own,
``/dpboard-dispatch.<board>`` (/dev/shm/dpboard-dispatch.<board>), so that ``dpboard doctor`` can
answer the seed's checklist: which method is in effect, how often the budget is refreshed against
its throttle, how many requests went to each rank, how many came with ``routed_dp_rank`` or a
``bootstrap_room``, how many were placed by a fallback or rejected. The board's layout is unchanged.
docs/FORMAT.md ("The dispatch record") has it byte by byte.

Layout (little-endian): a 64-byte header (``DISPATCH_HEADER_DTYPE``: magic ``DPBDISP\\0``, version,
rows, slots, row size, creator pid), then ``rows`` rows of ``row_size(slots)`` bytes: a 128-byte row
head (``ROW_DTYPE``: ``seq``, ``pid``, method, disaggregation mode, the publish's wall and monotonic
stamps, the refresh interval, then the cumulative counters) and per slot ``dispatched`` and
``routed`` (i64 each). One row per dispatching process (the vLLM API servers each have one).

Counters are cumulative: a reader computes rates by reading twice. A dispatcher counts in its own
per-request path as it already does and copies its counts here at most every ``PUBLISH_INTERVAL``
(``DispatchRow.due``), so the record costs nothing per request. The seqlock rule is a board slot's:
the writer makes ``seq`` odd, writes the row, makes it even again; a reader copies a row between two
equal even reads of ``seq`` and tries again otherwise, a bounded number of times, then calls the
row torn (x86-64 keeps stores in program order, which is what the rule needs from NumPy stores).

Attaching checks what attaching a board checks (``check_owned``: a regular file of this user, or of
a trusted uid, that nobody else may write, one link; no symbolic link followed) and the size the
header claims; anything else is refused with one line naming the file and the fix.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import posix_ipc

from dpboard.board.errors import BoardError, BoardLayoutError
from dpboard.board.liveness import process_alive, process_start_ticks
from dpboard.board.names import MAX_SLOTS, SEGMENT_PREFIX, SHM_DIR, validate_name
from dpboard.board.reserve import reserve_pages
from dpboard.errors import AccessDeniedError, DpboardError, InvalidInputError, NotFoundError
from dpboard.ownership import check_owned, refuse_link
from dpboard.snapshot import RecordLayout, pack_owner, unpack_owner

if TYPE_CHECKING:
    import numpy as np

DISPATCH_MAGIC = b"DPBDISP\x00"
DISPATCH_VERSION = 1
DISPATCH_PREFIX = "dpboard-dispatch."
DISPATCH_HEADER_SIZE = 64
DISPATCH_HEADER = RecordLayout({
    "names": ["magic", "version", "rows", "slots", "row_size", "creator_pid"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<i8"],
    "offsets": [0, 8, 12, 16, 20, 24],
    "itemsize": DISPATCH_HEADER_SIZE,
})
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
READ_RETRIES = 64
PUBLISH_INTERVAL = 0.1  # seconds between two publishes of a row, at most


def dispatch_segment_name(board: str) -> str:
    return "/" + DISPATCH_PREFIX + validate_name(board)


def dispatch_record_path(board: str) -> str:
    return f"{SHM_DIR}/{DISPATCH_PREFIX}{validate_name(board)}"


def row_size(slots: int) -> int:
    raw = ROW_HEAD_SIZE + 16 * slots
    return (raw + 63) // 64 * 64


def record_size(rows: int, slots: int) -> int:
    return DISPATCH_HEADER_SIZE + rows * row_size(slots)


def _text(value: str, size: int, what: str) -> bytes:
    raw = value.encode()
    if len(raw) > size or b"\x00" in raw:
        raise InvalidInputError(f"{what} {value!r} does not fit the dispatch record's {size}-byte text")
    return raw


class DispatchRecord:
    """The dispatch record of one board, mapped for writing: ``row(index, ...)`` claims a row."""

    def __init__(self, board: str, mapping: mmap.mmap, rows: int, slots: int, owner: bool) -> None:
        self.board = board
        self.rows = rows
        self.slots = slots
        self.is_owner = owner
        self._mapping = mapping
        self._size = row_size(slots)
        self._writers: list[DispatchRow] = []

    @classmethod
    def open(cls, board: str, rows: int, slots: int, *, timeout: float = 5.0,
             trust_uids: tuple[int, ...] = ()) -> DispatchRecord:
        """Create the record (``rows`` dispatchers, ``slots`` ranks), or attach the one that exists
        with that shape (with a board's checks); this process owns and later removes the one it creates."""
        name = dispatch_segment_name(board)
        path = dispatch_record_path(board)
        if not 1 <= rows <= MAX_ROWS or not 1 <= slots <= MAX_SLOTS:
            raise InvalidInputError(f"dispatch record of board {board!r}: rows must be in [1, {MAX_ROWS}] and "
                                    f"slots in [1, {MAX_SLOTS}], got rows={rows}, slots={slots}")
        size = record_size(rows, slots)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:
            shm = None
        except posix_ipc.PermissionsError:
            raise AccessDeniedError(f"cannot create the dispatch record {path}: permission denied") from None
        if shm is not None:
            try:
                os.fchmod(shm.fd, 0o600)  # exact, whatever the umask
                reserve_pages(shm.fd, size, f"the dispatch record of board {board!r}")
                mapping = mmap.mmap(shm.fd, size)
            except BaseException:
                shm.unlink()  # not a record yet (no magic): leave nothing behind
                raise
            finally:
                shm.close_fd()
            import numpy as np

            header = np.ndarray((), DISPATCH_HEADER.dtype, mapping, 0)
            header["version"], header["rows"], header["slots"] = DISPATCH_VERSION, rows, slots
            header["row_size"], header["creator_pid"] = row_size(slots), os.getpid()
            header["magic"] = DISPATCH_MAGIC  # last: an attacher that sees the magic sees a whole header
            del header
            atexit.register(_unlink, name, os.getpid())
            return cls(board, mapping, rows, slots, owner=True)
        mapping = _attach(board, path, time.monotonic() + timeout, trust_uids, writable=True)
        found = _header_of(mapping)
        if found[:3] != (DISPATCH_VERSION, rows, slots):
            mapping.close()
            raise BoardLayoutError(
                f"dispatch record {path} has version {found[0]}, {found[1]} rows and {found[2]} slots; this "
                f"dispatcher needs version {DISPATCH_VERSION}, {rows} rows and {slots} slots: remove {path} "
                f"once its deployment is stopped")
        return cls(board, mapping, rows, slots, owner=False)

    def row(self, index: int, *, method: str, mode: str = "null", refresh_interval: float = 0.0) -> DispatchRow:
        """This process's row ``index``, stamped with its method, disaggregation mode and refresh
        interval (seconds; 0: a refresh per dispatch). A row held by another live process is refused."""
        if not 0 <= index < self.rows:
            raise InvalidInputError(f"dispatch record of board {self.board!r} has rows 0..{self.rows - 1}, "
                                    f"not {index}")
        method_raw = _text(method, METHOD_BYTES, "method")
        mode_raw = _text(mode, MODE_BYTES, "disaggregation mode")
        off = DISPATCH_HEADER_SIZE + index * self._size
        import numpy as np

        head = np.ndarray((), ROW_HEAD.dtype, self._mapping, off)
        holder, holder_ticks = unpack_owner(int(head["holder"]))
        pid = os.getpid()
        if holder not in (0, pid) and process_alive(holder, holder_ticks):
            raise BoardError(f"row {index} of the dispatch record of board {self.board!r} is held by live process "
                             f"{holder}: one dispatcher per row")
        per_slot = np.ndarray((self.slots, 2), "<i8", self._mapping, off + ROW_HEAD_SIZE)
        writer = DispatchRow(head, per_slot)
        writer._begin()
        head["holder"] = pack_owner(pid, process_start_ticks(pid))
        head["method"], head["mode"] = method_raw, mode_raw
        head["refresh_interval_ns"] = int(round(refresh_interval * 1e9))
        for name in COUNTERS:
            head[name] = 0
        per_slot[:] = 0
        head["wall_ns"], head["monotonic_ns"] = time.time_ns(), time.monotonic_ns()
        writer._end()
        self._writers.append(writer)
        return writer

    def close(self) -> None:
        for writer in self._writers:
            writer.closed = True
            writer._head = writer._per_slot = None  # type: ignore[assignment]
        self._writers.clear()
        try:
            self._mapping.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        # The last dispatcher out removes the record: none of its writers runs any more but this one.
        remove_if_abandoned(self.board, leaving=True)

    def unlink(self) -> None:
        _unlink(dispatch_segment_name(self.board), os.getpid())


class DispatchRow:
    """One dispatcher's row. The dispatcher keeps its own counts; ``publish`` copies them here.

    ``due(now)`` says whether ``PUBLISH_INTERVAL`` has passed since the last publish (``now`` in
    ``time.monotonic()`` seconds), so a caller can check it on a path it runs anyway."""

    def __init__(self, head: np.ndarray, per_slot: np.ndarray) -> None:
        self._head = head
        self._per_slot = per_slot
        self._next = 0.0
        self.closed = False
        self._one = head.dtype["seq"].type(1)  # the sequence's own type: never a float on the way

    def due(self, now: float) -> bool:
        return now >= self._next

    def _begin(self) -> None:
        self._head["seq"] += self._one  # odd: a write is under way

    def _end(self) -> None:
        self._head["seq"] += self._one

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
               refresh_interval: float = 0.0, logger: Any = None) -> DispatchTally | None:
    """Row ``index`` of ``board``'s dispatch record, as a tally; a record that cannot be used is
    logged and done without (None): it is for diagnosis and never keeps a dispatcher from serving."""
    try:
        record = DispatchRecord.open(board, rows, slots)
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
    path = dispatch_record_path(board)
    try:
        mapping = _attach(board, path, time.monotonic() + timeout, trust_uids, writable=False)
    except NotFoundError:
        return None
    try:
        _version, rows, slots, size = _header_of(mapping)
        now = time.monotonic_ns()
        out = []
        for index in range(rows):
            off = DISPATCH_HEADER_SIZE + index * size
            raw = _read_row(mapping, off, size)
            torn = raw is None
            if torn:
                raw = bytes(mapping[off: off + size])  # the pid and method only, for the report
            head = ROW_HEAD.unpack(raw)
            pid, start_ticks = unpack_owner(int(head["holder"]))
            if pid == 0:
                continue
            per = struct.unpack_from(f"<{2 * slots}q", raw, ROW_HEAD_SIZE)
            out.append(DispatchRowSample(
                row=index, pid=pid, alive=process_alive(pid, start_ticks),
                method=head["method"].rstrip(b"\0").decode(errors="replace"),
                mode=head["mode"].rstrip(b"\0").decode(errors="replace"),
                refresh_interval=int(head["refresh_interval_ns"]) / 1e9,
                age_s=(now - int(head["monotonic_ns"])) / 1e9, wall_ns=int(head["wall_ns"]),
                counts={name: int(head[name]) for name in COUNTERS},
                per_rank=list(per[0::2]), routed_per_rank=list(per[1::2]), torn=torn))
        return out
    finally:
        mapping.close()


def _read_row(mapping: mmap.mmap, off: int, size: int) -> bytes | None:
    for _ in range(READ_RETRIES):
        before = int.from_bytes(mapping[off: off + 8], "little")
        if before & 1:
            time.sleep(0)
            continue
        raw = bytes(mapping[off: off + size])
        if int.from_bytes(mapping[off: off + 8], "little") == before:
            return raw
    return None


def _header_of(mapping: mmap.mmap) -> tuple[int, int, int, int]:
    header = DISPATCH_HEADER.unpack(mapping)
    return header["version"], header["rows"], header["slots"], header["row_size"]


def _attach(board: str, path: str, deadline: float, trust_uids: tuple[int, ...], *, writable: bool) -> mmap.mmap:
    """Map an existing record after a board's checks: no link followed, ours (or a trusted uid's),
    nobody else may write it, one link, a whole header with the magic, and the size it claims."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise NotFoundError(f"board {board!r} has no dispatch record ({path})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refuse_link(path, "dispatch record") from None
        if e.errno == errno.EACCES:
            check_owned(os.lstat(path), path, "dispatch record", trust_uids)
        raise BoardError(f"cannot open dispatch record {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        check_owned(st, path, "dispatch record", trust_uids,
                    hint=f"read only the records your own user's dispatchers made, or pass --trust-uid "
                         f"{st.st_uid} if you trust that user")
        while True:
            if st.st_size >= DISPATCH_HEADER_SIZE:
                mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
                if mapping[0:8] == DISPATCH_MAGIC:
                    break
                mapping.close()
            if time.monotonic() >= deadline:
                raise BoardLayoutError(f"dispatch record {path} has no dispatch-record header: it is not one, or "
                                       f"its creator died while creating it; remove it")
            time.sleep(0.005)
            st = os.fstat(fd)
    finally:
        os.close(fd)
    version, rows, slots, size = _header_of(mapping)
    problem = None
    if version != DISPATCH_VERSION:
        problem = f"has version {version}, this dpboard reads {DISPATCH_VERSION}"
    elif not (1 <= rows <= MAX_ROWS and 1 <= slots <= MAX_SLOTS and size == row_size(slots)):
        problem = f"claims {rows} rows of {slots} slots and row size {size}: damaged or not a dispatch record"
    elif st.st_size != record_size(rows, slots):
        problem = (f"is {st.st_size} bytes, but {rows} rows of {slots} slots make {record_size(rows, slots)}: "
                   f"damaged or not a dispatch record")
    if problem is not None:
        mapping.close()
        raise BoardLayoutError(f"dispatch record {path} {problem}; remove it once its deployment is stopped")
    return mapping


def remove_if_abandoned(board: str, *, leaving: bool = False) -> bool:
    """Remove ``board``'s dispatch record when no process that wrote it runs any more (its creator
    and every row's holder gone: dispatchers killed with SIGKILL leave theirs). ``leaving``: this
    process counts as gone too (it is removing the board itself, so its own dispatcher of that board
    is done with it). A record of another user, or one that is not a record, is left alone. True
    when it was removed."""
    path = dispatch_record_path(board)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode) or st.st_size < DISPATCH_HEADER_SIZE:
            return False
        head = os.pread(fd, DISPATCH_HEADER_SIZE, 0)
        header = DISPATCH_HEADER.unpack(head)
        rows, slots = int(header["rows"]), int(header["slots"])
        if (head[:8] != DISPATCH_MAGIC or not 1 <= rows <= MAX_ROWS or not 1 <= slots <= MAX_SLOTS
                or st.st_size != record_size(rows, slots)):
            return False
        writers = [(int(header["creator_pid"]), 0)]  # the header keeps the creator's pid alone
        for index in range(rows):  # 8 bytes a row: never more than the rows' holder words are read
            word = os.pread(fd, 8, DISPATCH_HEADER_SIZE + index * row_size(slots) + 8)
            writers.append(unpack_owner(int.from_bytes(word, "little")))
    finally:
        os.close(fd)
    me = os.getpid() if leaving else 0
    if any(pid > 0 and pid != me and process_alive(pid, ticks) for pid, ticks in writers):
        return False
    try:
        posix_ipc.unlink_shared_memory(dispatch_segment_name(board))
    except posix_ipc.ExistentialError:
        return False
    return True


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


def _unlink(name: str, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child does not remove its parent's record
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def __getattr__(name: str) -> Any:
    """``DISPATCH_HEADER_DTYPE`` and ``ROW_DTYPE``, the records' NumPy types, built on first use."""
    layouts = {"DISPATCH_HEADER_DTYPE": DISPATCH_HEADER, "ROW_DTYPE": ROW_HEAD}
    if name in layouts:
        return layouts[name].dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
