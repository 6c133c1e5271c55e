"""Side records: a file of its own beside a board, in seqlocked rows that live processes hold.

The sent record (``dpboard.board.sent``) and the dispatch record (``dpboard.board.dispatch_record``)
are two of them. What they share is here, once: the file's life (created, attached, replaced and
removed with the board's checks) and its rows' (claimed, made consistent, given up). Each record
brings its ``SideFormat`` (its magic, version, header and row size) and what its rows hold.
docs/FORMAT.md ("Side records") has the rules; each record's section has its bytes.

A file of ``64 + rows x row_size`` bytes: a 64-byte header that starts with the magic (written last
by the creator), ``version``, ``rows``, ``slots``, ``row_size`` (u32 each) and ``creator_pid``, then
the rows. Every row starts with ``seq`` (u64, its seqlock sequence) and ``holder`` (u64, a board
slot's owner word: pid and start ticks; 0 while free). A row is written and read with the board's
seqlock (``dpb_seqlock.h``, in C: ``SeqRow`` writes one, ``read_rows`` copies rows whole), never
with NumPy alone: on aarch64 only its fences keep a reader from seeing a new ``seq`` before the
words it guards.

Locks (the kernel drops each when its process dies, so none outlives a SIGKILL):

- a process that holds row ``i`` holds an open-file-description (OFD) write lock on its bytes;
- a process that has the record open (holding rows or about to) holds a shared OFD lock on the
  header's last 8 bytes (``ATTACH_LOCK``), never written;
- one that replaces or removes the file holds an exclusive ``flock`` on it meanwhile, and one that
  attaches a shared ``flock`` until it holds its attach lock: no file is removed under an attacher.

A row is *held* while its holder runs with the recorded start time **or** its lock is held: a
process in a time namespace of its own reads another start time from here, but its lock stands.
The record is *held* while any row is, or any process has it open. The last process out (its
``close``, or its exit) removes it; an unheld record of another shape, version, board generation,
or a damaged one, is replaced. The size the header claims is checked before anything is mapped.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpboard.board._seqlock import SeqRow, read_rows
from dpboard.board.errors import BoardError, BoardLayoutError
from dpboard.board.liveness import process_alive, process_start_ticks
from dpboard.board.names import SHM_DIR, validate_name
from dpboard.board.reserve import reserve_pages
from dpboard.errors import AccessDeniedError, DpboardError, NotFoundError, UnavailableError
from dpboard.ownership import (
    any_lock_held,
    check_owned,
    lock_range,
    open_refusal,
    same_file,
    unlock_range,
    write_lock_held,
)
from dpboard.snapshot import RecordLayout, pack_owner, unpack_owner

HEADER_SIZE = 64
SEQ_WORD, HOLDER_WORD = 0, 1  # the first two words of every row
ATTACH_LOCK = (56, 8)  # (offset, length) in the header: the bytes every process that has it open locks
# (a read lock, shared, so asked for with any_lock_held: the record is mode 0600, and nobody but its owner
# can open it to take one; a row's holder takes a write lock, asked for with write_lock_held)
OPEN_ATTEMPTS = 50  # a record replaced or removed while we open it: open again, this many times at most
FLOCK_TRIES = 1000  # 1 ms apart: a replacer or an attacher holds the flock a moment at most
HEADER_WAIT = 5.0  # seconds an attacher waits for the magic of a file an older dpboard is creating
BASE_HEADER = {  # the fields every side record's header starts with
    "names": ["magic", "version", "rows", "slots", "row_size", "creator_pid"],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<i8"],
    "offsets": [0, 8, 12, 16, 20, 24],
}


@dataclass(frozen=True)
class SideFormat:
    """What makes a side record of one kind: its name, file prefix, magic, version, header and rows."""

    what: str  # "sent record", "dispatch record"
    prefix: str  # the file's name in /dev/shm before the board's: "dpboard-sent."
    magic: bytes
    version: int
    header: RecordLayout  # HEADER_SIZE bytes, BASE_HEADER's fields first
    row_size: Callable[[int], int]  # of a record of that many slots
    max_rows: int
    max_slots: int
    rows_are: str = "rows"  # what a row stands for, in messages: "rows (API servers)"
    one_shape: str = "stop the processes that hold it first"  # what to do about a live record of another shape

    def path(self, board: str) -> str:
        return f"{SHM_DIR}/{self.prefix}{validate_name(board)}"

    def size(self, rows: int, slots: int) -> int:
        return HEADER_SIZE + rows * self.row_size(slots)

    def row_offset(self, index: int, slots: int) -> int:
        return HEADER_SIZE + index * self.row_size(slots)

    def damage(self, header: Any, file_size: int) -> str | None:
        """Why a header with the magic does not describe a whole record of this kind, or None."""
        version, rows, slots = int(header["version"]), int(header["rows"]), int(header["slots"])
        if version != self.version:
            return f"has version {version}, this dpboard reads {self.version}"
        if not (1 <= rows <= self.max_rows and 1 <= slots <= self.max_slots
                and int(header["row_size"]) == self.row_size(slots)):
            return (f"claims {rows} rows of {slots} slots and row size {int(header['row_size'])}: damaged or not "
                    f"a {self.what}")
        if file_size != self.size(rows, slots):
            return (f"is {file_size} bytes, but {rows} rows of {slots} slots make {self.size(rows, slots)}: damaged "
                    f"or not a {self.what}")
        return None


# -- files ------------------------------------------------------------------------------------------


def open_existing(fmt: SideFormat, path: str, board: str, *, writable: bool = True,
                  trust_uids: tuple[int, ...] = ()) -> int | None:
    """A descriptor of the record at ``path``, checked like every dpboard file in /dev/shm (no link
    followed, a regular file of this user or a trusted uid, one link, nobody else may write it);
    None when it is gone (or was unlinked between our open and our look)."""
    what = f"the {fmt.what} of board {board!r}"
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
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
            return None
        check_owned(st, path, what, trust_uids,
                    hint=None if not trust_uids and writable else
                    f"read only the records your own user's processes made, or pass --trust-uid {st.st_uid} if "
                    f"you trust that user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(fmt: SideFormat, fd: int, path: str, *, wait: float = 0.0) -> tuple[Any, os.stat_result] | str:
    """The header of the record open at ``fd`` (waiting up to ``wait`` seconds for a creator's magic)
    and its stat, or why it is no whole record of this kind. Nothing is mapped: a sparse file of
    any size is judged by its header and size alone."""
    deadline = time.monotonic() + wait
    while True:  # a creator reserves the file, then writes the header, the magic last: a moment at most
        st = os.fstat(fd)
        raw = os.pread(fd, HEADER_SIZE, 0) if st.st_size >= HEADER_SIZE else b""
        if raw[:8] == fmt.magic or (raw and raw[:8] != bytes(8)):
            break
        if time.monotonic() >= deadline:
            break  # never initialised: its creator died creating it, or it is not one
        time.sleep(0.005)
    if raw[:8] != fmt.magic:
        return (f"has no {fmt.what} header: it is not one, or its creator died while creating it")
    header = fmt.header.unpack(raw)  # plain values: a reader (doctor, clean) needs no NumPy
    damage = fmt.damage(header, st.st_size)
    return damage if damage is not None else (header, st)


def _create(fmt: SideFormat, path: str, board: str, rows: int, slots: int,
            fields: dict[str, int]) -> tuple[int, mmap.mmap] | None:
    """(fd, mapping) of a new record at ``path``, its attach lock held, or None when one exists.

    The record is made whole before anybody can open it: an unnamed file in the directory
    (``O_TMPFILE``), its pages reserved (on a full /dev/shm that is an error here, never a SIGBUS
    later), its attach lock taken and its header written, is then given its name with ``linkat``,
    which fails when the name exists. So a record at ``path`` always has a whole header and a
    holder, and no attacher ever waits for a creator, or takes a slow one's file for a dead one's
    and replaces it (two processes would then hold one row in two files)."""
    size = fmt.size(rows, slots)
    try:
        fd = os.open(os.path.dirname(path), os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
    except PermissionError:
        raise AccessDeniedError(f"cannot create the {fmt.what} {path} of board {board!r}: permission denied "
                                f"in {SHM_DIR}") from None
    mapping = None
    try:
        os.fchmod(fd, 0o600)  # exact, whatever the umask
        reserve_pages(fd, size, f"the {fmt.what} of board {board!r}")
        lock_range(fd, *ATTACH_LOCK, shared=True)
        mapping = mmap.mmap(fd, size)
        import numpy as np

        header = np.ndarray((), fmt.header.dtype, mapping, 0)
        header["version"], header["rows"], header["slots"] = fmt.version, rows, slots
        header["row_size"], header["creator_pid"] = fmt.row_size(slots), os.getpid()
        for name, value in fields.items():
            header[name] = value
        del header
        mapping[0:8] = fmt.magic
        try:
            _link_unnamed(fd, path)
        except FileExistsError:
            mapping.close()
            os.close(fd)
            return None
        except PermissionError:
            raise AccessDeniedError(f"cannot create the {fmt.what} {path} of board {board!r}: permission "
                                    f"denied in {SHM_DIR}") from None
    except BaseException:
        if mapping is not None and not mapping.closed:
            mapping.close()
        if fd >= 0:
            try:
                os.close(fd)  # unnamed: nothing is left behind
            except OSError:
                pass
        raise
    return fd, mapping


def _link_unnamed(fd: int, path: str) -> None:
    """Give the unnamed file open at ``fd`` the name ``path``; FileExistsError when it exists. The
    link /proc/self/fd/N is followed (linkat with AT_SYMLINK_FOLLOW: a directory descriptor makes
    Python call linkat, not link, which would not follow it)."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _flock(fd: int, how: int, path: str, fmt: SideFormat) -> None:
    for _ in range(FLOCK_TRIES):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.001)  # another replacer or attacher, for a moment
    raise UnavailableError(f"{fmt.what} {path}: another process keeps it locked while replacing or attaching it; "
                           f"retry")


def row_alive(fmt: SideFormat, fd: int, index: int, slots: int, word: int) -> bool:
    """Whether the holder ``word`` of row ``index`` of the record open at ``fd`` still holds it: it
    runs with that start time, or another process holds the row's lock."""
    if not word:
        return False
    pid, ticks = unpack_owner(int(word))
    return process_alive(pid, ticks) or write_lock_held(fd, fmt.row_offset(index, slots), fmt.row_size(slots))


def live_holders(fmt: SideFormat, fd: int, rows: int, slots: int, *, besides: int = 0) -> list[int]:
    """Pids of the holders of the rows of the record open at ``fd`` (its size checked) that run, or
    whose row's lock is held; ``besides``: a pid not to count (this process, leaving)."""
    live = []
    for i in range(rows):
        word = struct.unpack("<Q", os.pread(fd, 8, fmt.row_offset(i, slots) + 8 * HOLDER_WORD))[0]
        pid = unpack_owner(word)[0]
        if (not besides or pid != besides) and row_alive(fmt, fd, i, slots, word):
            live.append(pid)
    return live


def held(fmt: SideFormat, fd: int, header: Any, *, besides: int = 0) -> list[int]:
    """Who holds the record open at ``fd``: its rows' live holders, then -1 for each other process
    that has it open (its attach lock) without a row; [] when nobody does."""
    live = live_holders(fmt, fd, int(header["rows"]), int(header["slots"]), besides=besides)
    if not live and any_lock_held(fd, *ATTACH_LOCK):
        live.append(-1)
    return live


def _unlink_locked(fd: int, path: str, fmt: SideFormat, check: Callable[[], bool] | None = None) -> bool:
    """Unlink the record open at ``fd`` under its exclusive flock, if ``path`` still names it and
    ``check()`` (asked under the flock) allows; True when it was removed. Replacers and removers
    take the flock first, so two of them never remove each other's new record, and an attacher
    (shared flock) never holds a file that is removed under it."""
    _flock(fd, fcntl.LOCK_EX, path, fmt)
    try:
        if not same_file(fd, path) or (check is not None and not check()):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def remove_if_unheld(fmt: SideFormat, path: str, *, inode: int | None = None, force: bool = False,
                     besides: int = 0, young: float = 0.0) -> bool:
    """Remove the record at ``path`` (this user's only) when nobody holds it (or with ``force``); only
    the file ``inode`` when given. A file with no whole header is left alone while younger than
    ``young`` seconds (its creator may be writing it). True when it was removed."""
    try:
        fd = open_existing(fmt, path, "?", writable=False)
    except DpboardError:
        return False  # another user's, a link, or not a file: not ours to remove
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if (inode is not None and st.st_ino != inode) or st.st_uid != os.geteuid():
            return False

        def unheld() -> bool:
            if force:
                return True
            found = read_header(fmt, fd, path)
            if isinstance(found, str):
                return time.time() - os.fstat(fd).st_mtime >= young and not any_lock_held(fd, *ATTACH_LOCK)
            return not held(fmt, fd, found[0], besides=besides)

        return _unlink_locked(fd, path, fmt, unheld)
    finally:
        os.close(fd)


# -- an open record ---------------------------------------------------------------------------------


class SideFile:
    """One side record, mapped read-write, as this process has it open: ``claim`` takes a row,
    ``release`` gives it up, ``close`` gives up every row and removes the record when this process
    is the last one out."""

    def __init__(self, fmt: SideFormat, board: str, fd: int, mapping: mmap.mmap, rows: int, slots: int,
                 *, owner: bool) -> None:
        self.fmt = fmt
        self.board = board
        self.path = fmt.path(board)
        self.rows = rows
        self.slots = slots
        self.is_owner = owner
        self.fd = fd
        self.mapping = mapping
        self.inode = os.fstat(fd).st_ino
        self.row_size = fmt.row_size(slots)
        import numpy as np

        self.table = np.ndarray((rows, self.row_size // 8), "<i8", mapping, HEADER_SIZE)
        self.holder = self.table[:, HOLDER_WORD].view("<u8")
        self.claimed: set[int] = set()
        self._seq_rows: dict[int, SeqRow] = {}
        self._pid = os.getpid()
        _open_files.add(self)

    @classmethod
    def open(cls, fmt: SideFormat, board: str, rows: int, slots: int, *, fields: dict[str, int] | None = None,
             stale: Callable[[Any], bool] | None = None, timeout: float = HEADER_WAIT,
             trust_uids: tuple[int, ...] = ()) -> SideFile:
        """Create the record of ``board`` for ``rows`` rows of ``slots`` slots (its header's extra
        ``fields`` set), or attach the one there is of that shape. A damaged one, one of another
        version, or one that ``stale(header)`` calls stale (an earlier board's) is replaced; so is
        one of another shape that nobody holds. One of another shape that a live process holds is
        refused, naming it."""
        path = fmt.path(board)
        for _ in range(OPEN_ATTEMPTS):
            created = _create(fmt, path, board, rows, slots, fields or {})
            if created is not None:
                return cls(fmt, board, *created, rows, slots, owner=True)
            fd = open_existing(fmt, path, board, trust_uids=trust_uids)
            if fd is None:
                continue  # removed meanwhile: create it
            try:
                mapping = _attach(fmt, fd, path, board, rows, slots, stale, timeout)
            except BaseException:
                os.close(fd)
                raise
            if mapping is None:
                os.close(fd)
                continue  # it was stale (or removed under us) and is gone now: create it, or attach a racer's
            return cls(fmt, board, fd, mapping, rows, slots, owner=False)
        raise UnavailableError(f"{fmt.what} {path} of board {board!r} keeps being replaced by other processes; "
                               f"retry")

    # -- rows -------------------------------------------------------------------------------------

    def claim(self, index: int, reset: Callable[[int], None], *, hint: str) -> None:
        """Take row ``index`` for this process: its lock, then, under its seqlock (left odd by a
        holder that died mid-write, made odd otherwise), the holder word and ``reset(index)`` (the
        row's content started again), then ``seq`` even: a consistent row of a new holder. A row
        whose lock another process holds is refused (``hint``: what to do)."""
        if index in self.claimed:
            return
        if not lock_range(self.fd, self.fmt.row_offset(index, self.slots), self.row_size):
            holder, _ = unpack_owner(int(self.holder[index]))
            who = f"live process {holder}" if holder else "a live process that is claiming it"
            raise BoardError(f"row {index} of the {self.fmt.what} of board {self.board!r} is held by {who}: {hint}")
        row = self.seq_row(index)
        row.begin()  # odd: a write is under way (already odd when the last holder died mid-write)
        pid = os.getpid()
        self.holder[index] = pack_owner(pid, process_start_ticks(pid))
        reset(index)
        row.end()  # even again
        self.claimed.add(index)

    def seq_row(self, index: int) -> SeqRow:
        """The seqlock writer of row ``index`` (one per row and process; its holder's to use)."""
        row = self._seq_rows.get(index)
        if row is None:
            row = self._seq_rows[index] = SeqRow(self.mapping, self.fmt.row_offset(index, self.slots), self.row_size)
        return row

    def read_rows(self, out: Any, whole: Any, retries: int) -> int:
        """Copy every row into ``out`` (rows x row_size bytes), each from one whole write; ``whole``
        (a byte per row) says which were. Returns the number of torn rows."""
        return read_rows(self.mapping, HEADER_SIZE, self.row_size, self.rows, out, whole, retries)

    def release(self, index: int) -> None:
        """Give row ``index`` up: its holder word cleared under the seqlock, then its lock."""
        if index not in self.claimed or self.fd < 0:
            return
        row = self.seq_row(index)
        row.begin()
        self.holder[index] = 0
        row.end()
        unlock_range(self.fd, self.fmt.row_offset(index, self.slots), self.row_size)
        self.claimed.discard(index)

    def row_alive(self, index: int, word: int) -> bool:
        """``row_alive`` of row ``index`` with holder ``word`` (this process's own rows are alive)."""
        return index in self.claimed or (self.fd >= 0 and row_alive(self.fmt, self.fd, index, self.slots, word))

    # -- closing ----------------------------------------------------------------------------------

    def close(self, *, remove: bool = True) -> None:
        """Give up this process's rows and drop the mapping; the last process out (nobody else holds
        the record) removes it, unless ``remove`` is False."""
        if self.fd < 0:
            return
        for index in list(self.claimed):
            self.release(index)
        os.close(self.fd)  # drops the attach lock and every row's
        self.fd = -1
        _open_files.discard(self)
        for row in self._seq_rows.values():
            row.release()  # a writer left with one is refused from now on, never writes an unmapped row
        self._seq_rows.clear()
        self.table = self.holder = None  # type: ignore[assignment]
        try:
            self.mapping.close()
        except BufferError:
            pass  # a writer's view is still alive somewhere; the mapping goes with the process
        if remove:
            remove_if_unheld(self.fmt, self.path, inode=self.inode)

    def leave(self) -> None:
        """Stop counting as a holder without closing (the board is being removed by this process):
        the rows' and the attach lock are given up, the mapping stays for writers still at work."""
        if self.fd >= 0:
            for index in list(self.claimed):
                unlock_range(self.fd, self.fmt.row_offset(index, self.slots), self.row_size)
            unlock_range(self.fd, *ATTACH_LOCK)


def _attach(fmt: SideFormat, fd: int, path: str, board: str, rows: int, slots: int,
            stale: Callable[[Any], bool] | None, timeout: float) -> mmap.mmap | None:
    """The mapping of the record open at ``fd`` when it is one of this shape (its attach lock then
    held); None after removing it when it is stale, damaged, or another shape nobody holds, or when
    it was removed meanwhile."""
    _flock(fd, fcntl.LOCK_SH, path, fmt)  # no replacer or remover between our look and our attach lock
    try:
        if not same_file(fd, path):
            return None
        found = read_header(fmt, fd, path, wait=timeout)
        fresh = not isinstance(found, str) and (stale is None or not stale(found[0]))
        if os.fstat(fd).st_uid != os.geteuid() and not (fresh and found[0]["rows"] == rows
                                                        and found[0]["slots"] == slots):
            # a trusted user's file: used as it is, or refused, never replaced
            why = found if isinstance(found, str) else (
                "is of an earlier board of that name" if not fresh else
                f"has {int(found[0]['rows'])} {fmt.rows_are} and {int(found[0]['slots'])} slots, this process "
                f"needs {rows} and {slots}")
            raise BoardLayoutError(f"{fmt.what} {path} of board {board!r} {why}; it belongs to another user: "
                                   f"have them remove it")
        if isinstance(found, str) and any_lock_held(fd, *ATTACH_LOCK):
            # a creator makes a record whole before naming it: one without a whole header that a live
            # process has open is another dpboard's, never a dead creator's, and is not replaced
            raise BoardLayoutError(f"{fmt.what} {path} of board {board!r} {found}, and a live process has it "
                                   f"open; stop the processes of that board first")
        if fresh:
            header = found[0]
            shape = (int(header["rows"]), int(header["slots"]))
            if shape == (rows, slots):
                lock_range(fd, *ATTACH_LOCK, shared=True)
                return mmap.mmap(fd, fmt.size(rows, slots))
            live = held(fmt, fd, header)
            if live:
                who = f"live process {live[0]}" if live[0] > 0 else "a live process"
                raise BoardLayoutError(
                    f"{fmt.what} {path} of board {board!r} has {shape[0]} {fmt.rows_are} and {shape[1]} slots, "
                    f"held by {who}; this process needs {rows} {fmt.rows_are} and {slots} slots: {fmt.one_shape}")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    # stale or damaged: replaced; another shape: replaced while nobody holds it (asked again under
    # the exclusive flock: an attacher of that shape may have come meanwhile)
    _unlink_locked(fd, path, fmt, None if not fresh else lambda: not held(fmt, fd, header))
    return None


def read_mapped(fmt: SideFormat, board: str, *, trust_uids: tuple[int, ...] = (),
                timeout: float = 0.2) -> tuple[int, mmap.mmap, Any]:
    """(fd, read-only mapping, header) of ``board``'s record, for a reader, after every check and with
    the size the header claims checked before mapping; NotFoundError when there is none, a one-line
    BoardError (or AccessDeniedError) for a file that is not a record to read. The caller closes both."""
    path = fmt.path(board)
    fd = open_existing(fmt, path, board, writable=False, trust_uids=trust_uids)
    if fd is None:
        raise NotFoundError(f"board {board!r} has no {fmt.what} ({path})")
    try:
        found = read_header(fmt, fd, path, wait=timeout)
        if isinstance(found, str):
            raise BoardLayoutError(f"{fmt.what} {path} {found}; remove it once its deployment is stopped")
        header, st = found
        try:
            mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        except OSError as e:
            raise BoardError(f"cannot map {fmt.what} {path}: {e.strerror}; remove it once its deployment is "
                             f"stopped") from None
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping, header


def leave_records_of(fmt: SideFormat, board: str) -> None:
    """This process's open records of ``board`` stop counting as holders (``SideFile.leave``)."""
    for side in list(_open_files):
        if side.fmt is fmt and side.board == board and side._pid == os.getpid():
            side.leave()


# Every record this process has open, until its close: each is closed at exit (the last one out
# removes it), never in a forked child, which inherited the parent's. Strong references: a record
# object that is dropped unclosed keeps its rows (a live process's, as its locks say) until exit.
_open_files: set[SideFile] = set()


def _close_at_exit() -> None:
    for side in list(_open_files):
        if side._pid == os.getpid():
            try:
                side.close()
            except (OSError, DpboardError):
                pass  # at exit: nothing more to do about it


atexit.register(_close_at_exit)


def base_header_layout(extra_names: list[str], extra_formats: list[str], extra_offsets: list[int]) -> RecordLayout:
    """A side record's header: ``BASE_HEADER``'s fields, then the record's own."""
    return RecordLayout({
        "names": BASE_HEADER["names"] + extra_names,
        "formats": BASE_HEADER["formats"] + extra_formats,
        "offsets": BASE_HEADER["offsets"] + extra_offsets,
        "itemsize": HEADER_SIZE,
    })
