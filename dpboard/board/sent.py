"""The sent record beside a board: how many requests each front-end process sent to each slot.

A board says what each engine has received (``num_received_reqs``); this record says what was sent
to it, by every process that sends (each vLLM API server, say), so any of them can tell an engine's
requests in flight from all of them: ``sum of sent over the rows - received``. The board's layout is
unchanged: this is a file of its own, ``/dev/shm/dpboard-sent.<board>``, created beside the board by
the first sender. docs/FORMAT.md ("The sent record") has it byte by byte.

Layout (little-endian): a 64-byte header (``SENT_HEADER_DTYPE``: magic ``DPBSENT\\0``, version, rows,
slots, row size, creator pid, the board's generation, creator start ticks), then ``rows`` rows of
``row_size`` bytes: ``seq`` (u64), ``holder`` (the owner word of a board slot: pid and start ticks;
0 while free), ``shared`` (1 once ``base`` holds something), 8 reserved bytes, then per slot
``sent_reqs`` and ``sent_tokens`` (i64 each), then per slot ``base`` (i64: what the holder's reader
takes out of that slot's in-flight count, for readers that start later).

A row belongs to a live process, as a board slot does. A process takes row ``index`` with an
open-file-description lock on the row's bytes (the kernel drops it when the process dies, so a
dead holder never blocks its successor, whatever became of its pid), then, under the row's seqlock,
stamps itself as holder and zeroes the counts: the row is consistent again even when its last
holder died half-way through ``add``. Readers count a row only while its holder runs (pid and start
time, ``dpboard.board.liveness``); a row whose holder died, or that a new holder took, leaves the
totals and is reported as *departed* once, with its last counts (``totals(departed=...)``).

The seqlock rule of a board slot: the writer makes ``seq`` odd, updates the counts, makes it even
again; a reader copies every row between two reads of ``seq`` and keeps, per row, the last copy
that was whole (equal even reads). A row torn for good (its writer stopped or died mid-write) reads
as its last whole value: a torn row never fails a read. The counters only grow while a holder
keeps its row, and x86-64 keeps stores in program order, which is what the rule needs from the plain
NumPy stores here.

The record names the board's generation: a record left by an earlier board of that name (a
deployment killed with SIGKILL) is replaced, never inherited, and so is one of another shape (another
API-server count) that no live process holds. Like every dpboard file in /dev/shm it is opened with
``O_NOFOLLOW``, created with ``O_EXCL`` and mode 0600, and refused unless it is a regular file of
ours with one link that nobody else may write (``dpboard.ownership.check_owned``).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import mmap
import os
import stat
import struct
import time
from typing import Any

from dpboard.board.errors import BoardError, BoardLayoutError
from dpboard.board.liveness import process_alive, process_start_ticks
from dpboard.board.names import SHM_DIR, validate_name
from dpboard.board.reserve import reserve_pages
from dpboard.errors import AccessDeniedError, InvalidInputError, UnavailableError
from dpboard.ownership import check_owned, open_refusal
from dpboard.snapshot import RecordLayout, pack_owner, unpack_owner

# NumPy, bound by the first record opened: record_state and remove_record (what `dpboard clean`
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
SENT_HEADER_SIZE = 64
SENT_HEADER = RecordLayout({
    "names": ["magic", "version", "rows", "slots", "row_size", "creator_pid", "generation", "creator_start_ticks"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<i8", "<u8", "<i8"],
    "offsets": [0, 8, 12, 16, 20, 24, 32, 40],
    "itemsize": SENT_HEADER_SIZE,
})
ROW_HEADER = 32  # seq, holder, shared, reserved
HOLDER_WORD = 1
SHARED_WORD = 2  # 1 once the holder has shared its base
COUNTS_WORD = ROW_HEADER // 8
MAX_ROWS = 4096
MAX_SLOTS = 1 << 16
READ_RETRIES = 4  # whole copies of the rows per read before a torn row falls back to its last value
LIVENESS_INTERVAL = 0.25  # seconds between two checks of the rows' holders by one reader
OPEN_ATTEMPTS = 50  # a record replaced or removed while we open it: open again, this many times at most
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on x86-64 / aarch64 Linux


def sent_segment_name(board: str) -> str:
    return "/" + SENT_PREFIX + validate_name(board)


def sent_path(board: str) -> str:
    return f"{SHM_DIR}/{SENT_PREFIX}{validate_name(board)}"


def row_size(slots: int) -> int:
    raw = ROW_HEADER + 24 * slots
    return (raw + 63) // 64 * 64


def record_size(rows: int, slots: int) -> int:
    return SENT_HEADER_SIZE + rows * row_size(slots)


def holder_alive(word: int) -> bool:
    """Whether the process an owner word names still runs (pid and start time)."""
    if not word:
        return False
    pid, ticks = unpack_owner(int(word))
    return process_alive(pid, ticks)


class SentRecord:
    """The sent record of one board, mapped; ``row(index)`` to write, ``totals()`` to read."""

    def __init__(self, board: str, fd: int, mapping: mmap.mmap, rows: int, slots: int, generation: int,
                 owner: bool) -> None:
        self.board = board
        self.rows = rows
        self.slots = slots
        self.generation = generation
        self.is_owner = owner
        self._fd = fd
        self._mapping = mapping
        words = row_size(slots) // 8
        _numpy()
        self._table = np.ndarray((rows, words), "<i8", mapping, SENT_HEADER_SIZE)
        self._seq = self._table[:, 0].view("<u8")
        self._holder = self._table[:, HOLDER_WORD].view("<u8")
        # what one read copies, and the views of the copy it looks at
        self._copy = np.zeros((rows, words), np.int64)
        self._copy_holder = self._copy[:, HOLDER_WORD].view("<u8")
        self._copy_counts = self._copy[:, COUNTS_WORD: COUNTS_WORD + 2 * slots].reshape(rows, slots, 2)
        self._before = np.zeros(rows, np.uint64)
        self._parity = np.zeros(rows, np.uint64)
        self._whole = np.zeros(rows, bool)
        self._even = np.zeros(rows, bool)
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
        path = sent_path(board)
        if not 1 <= rows <= MAX_ROWS or not 1 <= slots <= MAX_SLOTS:
            raise InvalidInputError(f"sent record of board {board!r}: rows must be in [1, {MAX_ROWS}] and slots in "
                                    f"[1, {MAX_SLOTS}], got rows={rows}, slots={slots}")
        if not 0 < generation < 2**64:
            raise InvalidInputError(f"sent record of board {board!r}: generation must be the board's (a positive "
                                    f"64-bit number), got {generation!r}")
        size = record_size(rows, slots)
        for _ in range(OPEN_ATTEMPTS):
            created = _create(path, board, size, rows, slots, generation)
            if created is not None:
                fd, mapping = created
                atexit.register(_unlink_at_exit, path, os.fstat(fd).st_ino, os.getpid())
                return cls(board, fd, mapping, rows, slots, generation, owner=True)
            fd = _open_existing(path, board)
            if fd is None:
                continue  # removed meanwhile: create it
            try:
                mapping = _check_or_replace(fd, path, board, rows, slots, generation, size, timeout)
            except BaseException:
                os.close(fd)
                raise
            if mapping is None:
                os.close(fd)
                continue  # it was stale and is gone now: create it (or attach a racer's)
            return cls(board, fd, mapping, rows, slots, generation, owner=False)
        raise UnavailableError(f"sent record {path} of board {board!r} keeps being replaced by other processes; "
                               f"retry")

    # -- writing ------------------------------------------------------------------------------

    def row(self, index: int) -> SentWriter:
        """This process's writer of row ``index``. A row held by another live process is refused;
        a dead holder's row is taken over, made consistent and started again from zero."""
        if not 0 <= index < self.rows:
            raise InvalidInputError(f"sent record of board {self.board!r} has rows 0..{self.rows - 1}, not {index}")
        writer = self._row_writers.get(index)
        if writer is not None:
            return writer
        start = SENT_HEADER_SIZE + index * row_size(self.slots)
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start,
                                                                  row_size(self.slots), 0))
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder, _ = unpack_owner(int(self._holder[index]))
            raise BoardError(f"row {index} of the sent record of board {self.board!r} is held by live process "
                             f"{holder}: one sender per row (each API server has its own client index)") from None
        pid = os.getpid()
        seq = self._seq[index: index + 1]
        if not seq[0] & 1:
            seq += 1  # odd: a write is under way (already odd when the last holder died mid-add)
        self._holder[index] = pack_owner(pid, process_start_ticks(pid))
        self._table[index, SHARED_WORD:] = 0
        seq += 1  # even again: a consistent row of a new holder
        base = COUNTS_WORD + 2 * self.slots
        writer = SentWriter(seq, self._table[index, COUNTS_WORD: base].reshape(self.slots, 2),
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
        for _ in range(READ_RETRIES):
            np.copyto(self._before, self._seq)
            np.copyto(self._copy, self._table)
            np.equal(self._before, self._seq, out=self._whole)
            np.bitwise_and(self._before, 1, out=self._parity)
            np.logical_not(self._parity, out=self._even)
            np.logical_and(self._whole, self._even, out=self._whole)
            np.not_equal(self._copy_holder, self._identity, out=self._changed)
            np.logical_and(self._changed, self._whole, out=self._changed)
            if self._changed.any():
                self._new_holders(departed)
            np.copyto(self._last, self._copy_counts, where=self._whole_rows)
            if self._whole.all():
                break
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
        return [(*unpack_owner(int(w)), holder_alive(int(w))) for w in self._holder]

    def _new_holders(self, departed: np.ndarray | None) -> None:
        for i in np.flatnonzero(self._changed):
            if self._counted[i] and departed is not None:
                departed += self._last[i]
            self._identity[i] = self._copy_holder[i]
            self._counted[i] = holder_alive(int(self._identity[i]))

    def _check_holders(self, departed: np.ndarray | None) -> None:
        for i in np.flatnonzero(self._counted):
            if not holder_alive(int(self._identity[i])):
                self._counted[i] = 0
                if departed is not None:
                    departed += self._last[i]

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Give up this process's rows (they stop counting) and drop the mapping."""
        if self._fd < 0:
            return
        for index, writer in self._row_writers.items():
            writer.closed = True
            seq = self._seq[index: index + 1]
            seq += 1
            self._holder[index] = 0
            seq += 1
        self._row_writers.clear()
        os.close(self._fd)  # drops the rows' locks
        self._fd = -1
        self._table = self._seq = self._holder = None  # type: ignore[assignment]
        try:
            self._mapping.close()
        except BufferError:
            pass  # a writer's view is still alive somewhere; the mapping goes with the process

    def unlink(self) -> None:
        remove_record(sent_path(self.board), force=True)


class SentWriter:
    """One sender's row: ``add(slot, tokens)`` counts one request sent to ``slot``; ``share`` makes
    its reader's base known to readers that start later."""

    def __init__(self, seq: np.ndarray, counts: np.ndarray, shared: np.ndarray, base: np.ndarray) -> None:
        self._seq = seq
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
        seq = self._seq
        seq += 1  # odd: a write is under way
        row = self._counts[slot]
        row[0] += 1
        row[1] += tokens
        seq += 1

    def sent(self, slot: int) -> tuple[int, int]:
        return int(self._counts[slot, 0]), int(self._counts[slot, 1])


# -- files ------------------------------------------------------------------------------------


def _create(path: str, board: str, size: int, rows: int, slots: int,
            generation: int) -> tuple[int, mmap.mmap] | None:
    """(fd, mapping) of a new record at ``path``, or None when one exists. Every page is reserved
    before the first touch: on a full /dev/shm that is an error here, never a SIGBUS later."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return None
    except PermissionError:
        raise AccessDeniedError(f"cannot create the sent record {path} of board {board!r}: permission denied "
                                f"in {SHM_DIR}") from None
    mapping = None
    try:
        os.fchmod(fd, 0o600)  # exact, whatever the umask
        reserve_pages(fd, size, f"the sent record of board {board!r}")
        mapping = mmap.mmap(fd, size)
        header = _numpy().ndarray((), SENT_HEADER.dtype, mapping, 0)
        pid = os.getpid()
        header["version"], header["rows"], header["slots"] = SENT_VERSION, rows, slots
        header["row_size"], header["creator_pid"] = row_size(slots), pid
        header["generation"], header["creator_start_ticks"] = generation, process_start_ticks(pid)
        del header
        mapping[0:8] = SENT_MAGIC  # last: an attacher that sees the magic sees a whole header
    except BaseException:
        if mapping is not None:
            mapping.close()
        try:
            os.unlink(path)  # not a record yet: leave nothing behind
        finally:
            os.close(fd)
        raise
    return fd, mapping


def _open_existing(path: str, board: str) -> int | None:
    """A read-write descriptor of the existing record, checked like every dpboard file in /dev/shm;
    None when it is gone (or was unlinked between our open and our look)."""
    what = f"the sent record of board {board!r}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        refusal = open_refusal(e, path, what)
        if refusal is not None:
            raise refusal from None
        raise BoardError(f"cannot open {what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_nlink == 0 and stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None  # removed by a replacer or `dpboard clean` after we opened it
        check_owned(st, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_or_replace(fd: int, path: str, board: str, rows: int, slots: int, generation: int, size: int,
                      timeout: float) -> mmap.mmap | None:
    """The mapping of the record open at ``fd`` when it is this board's, of this shape; None after
    removing it when it is stale (another generation, damaged, or another shape nobody holds)."""
    deadline = time.monotonic() + timeout
    while True:  # a creator reserves the file, then writes the header, magic last: a moment at most
        st = os.fstat(fd)
        found = os.pread(fd, SENT_HEADER_SIZE, 0) if st.st_size >= SENT_HEADER_SIZE else b""
        if found[:8] == SENT_MAGIC or (found and found[:8] != bytes(8)):
            break
        if time.monotonic() >= deadline:
            break  # never initialised: its creator died creating it
        time.sleep(0.005)
    if found[:8] != SENT_MAGIC:
        _replace(fd, path)
        return None
    header = SENT_HEADER.unpack(found)
    version, found_rows, found_slots = header["version"], header["rows"], header["slots"]
    whole = (version == SENT_VERSION and int(header["row_size"]) == row_size(found_slots) and
             1 <= found_rows <= MAX_ROWS and 1 <= found_slots <= MAX_SLOTS and
             st.st_size == record_size(found_rows, found_slots))
    if not whole or int(header["generation"]) != generation:
        _replace(fd, path)  # damaged, an older dpboard's, or left by an earlier board of that name
        return None
    if (found_rows, found_slots) != (rows, slots):
        live = _live_holders(fd, found_rows, found_slots)
        if live:
            raise BoardLayoutError(
                f"sent record {path} of board {board!r} has {found_rows} rows (API servers) and {found_slots} "
                f"slots, held by live process {live[0]}; this process needs {rows} rows and {slots} slots: one "
                f"API-server count per deployment, stop the other servers first")
        _replace(fd, path)
        return None
    return mmap.mmap(fd, size)


def _live_holders(fd: int, rows: int, slots: int) -> list[int]:
    """Pids of the live holders of the rows of the record open at ``fd`` (its size checked)."""
    step = row_size(slots)
    live = []
    for i in range(rows):
        word = struct.unpack("<Q", os.pread(fd, 8, SENT_HEADER_SIZE + i * step + 8 * HOLDER_WORD))[0]
        if holder_alive(word):
            live.append(unpack_owner(word)[0])
    return live


def _replace(fd: int, path: str) -> None:
    """Unlink the record open at ``fd`` if ``path`` still names it. Replacers take the old file's
    flock first, so two of them never remove each other's new record."""
    for _ in range(1000):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            time.sleep(0.001)  # another replacer, for a moment
    else:
        raise UnavailableError(f"sent record {path}: another process keeps it locked while replacing it; retry")
    try:
        a = os.fstat(fd)
        b = os.stat(path, follow_symlinks=False)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def record_state(path: str) -> tuple[int | None, list[int]] | None:
    """(the board generation it names, None if damaged; pids of its live holders) of the record at
    ``path``, opened as ``SentRecord.open`` does; None when it is not ours or gone."""
    try:
        fd = _open_existing(path, "?")
    except (AccessDeniedError, BoardError):
        return None
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        found = os.pread(fd, SENT_HEADER_SIZE, 0)
        if len(found) < SENT_HEADER_SIZE or found[:8] != SENT_MAGIC:
            return None, []
        header = SENT_HEADER.unpack(found)
        rows, slots = header["rows"], header["slots"]
        if (int(header["version"]) != SENT_VERSION or not 1 <= rows <= MAX_ROWS or not 1 <= slots <= MAX_SLOTS
                or st.st_size != record_size(rows, slots)):
            return None, []
        return int(header["generation"]), _live_holders(fd, rows, slots)
    finally:
        os.close(fd)


def remove_record(path: str, *, force: bool = False, inode: int | None = None) -> bool:
    """Remove the record at ``path`` (ours only) when no live process holds a row of it, or with
    ``force``; only the file ``inode`` when given. True when it was removed."""
    try:
        fd = _open_existing(path, "?")
    except (AccessDeniedError, BoardError):
        return False
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if inode is not None and st.st_ino != inode:
            return False
        if not force:
            state = record_state(path)
            if state is not None and [p for p in state[1] if p != os.getpid()]:
                return False
        b = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (b.st_dev, b.st_ino):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def _unlink_at_exit(path: str, inode: int, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child does not remove its parent's record
    remove_record(path, inode=inode)


def __getattr__(name: str) -> Any:
    """``SENT_HEADER_DTYPE``, the header's NumPy type, built on first use."""
    if name == "SENT_HEADER_DTYPE":
        return SENT_HEADER.dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
