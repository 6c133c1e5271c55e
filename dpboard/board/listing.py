"""The boards on this machine: ``list_boards`` (``dpboard ls``) and ``clean_boards`` (``dpboard clean``).

A board is *alive* when its creator runs (pid and start time) **or** any of its slots was published
within ``stale_after``: a pid alone says nothing about a creator in another PID namespace (a
container, ``unshare --pid``), where it may be pid 1. ``clean`` without ``--force`` never removes a
live board. Every segment is read on its own, so one damaged or hostile entry (a corrupt header, a
symbolic link, another user's board) is listed with what is wrong and never hides the others.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass

import posix_ipc

from dpboard.board.dispatch_record import DISPATCH_PREFIX, remove_abandoned_records
from dpboard.board.errors import BoardError
from dpboard.board.header import HEADER_STRUCT, BoardHeader, unpack_header
from dpboard.board.names import MAX_SLOTS, SEGMENT_PREFIX, SHM_DIR, validate_name
from dpboard.board.segment import (
    DEFAULT_STALE_AFTER,
    drop_creator_lock,
    read_segment_header,
    unlink_if_generation,
)
from dpboard.board.sent import SENT_PREFIX, record_state, remove_record
from dpboard.board.stale import check_stale_after
from dpboard.errors import AccessDeniedError, DpboardError, NotFoundError
from dpboard.ownership import write_lock_held
from dpboard.snapshot import (
    FIELD_INDEX,
    FIELDS_OFFSET,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    SLOT_SIZE,
    segment_size,
)

_SEQ_WORD = 0
_MONOTONIC_WORD = FIELDS_OFFSET // 8 + FIELD_INDEX["monotonic_ns"]
# a slot's sequence word and its monotonic stamp, the words between them skipped
_SEQ_AND_STAMP = struct.Struct(f"<q{8 * (_MONOTONIC_WORD - _SEQ_WORD - 1)}xq")


@dataclass(frozen=True)
class BoardListing:
    name: str
    size: int
    header: BoardHeader | None
    error: str | None = None
    owner_uid: int | None = None
    mode: int | None = None
    last_publish_age: float | None = None  # seconds since the latest publish into any slot (None: never;
    #                                         negative: stamped ahead of this node's clock)
    stale_after: float = DEFAULT_STALE_AFTER
    held: bool = False  # a process holds a write lock on the segment: its creator, or a slot's writer (a
    #                     read lock, which any user who may read it can take, is nobody's proof of life)

    @property
    def creator_alive(self) -> bool | None:
        return None if self.header is None else self.header.creator_alive

    @property
    def recently_published(self) -> bool:
        # A stamp from the future is not a recent publish, as readers hold (docs/FORMAT.md, "Liveness").
        return self.last_publish_age is not None and -self.stale_after <= self.last_publish_age <= self.stale_after

    @property
    def alive(self) -> bool | None:
        """Its creator runs, a process holds its lock, or a slot was published within ``stale_after``
        (None: not a readable board)."""
        if self.header is None:
            return None
        return self.in_use() is not None

    def in_use(self, *, besides: int = 0) -> str | None:
        """Why the board is alive, or None when it is abandoned: the one rule for "gone" (``dpboard
        clean``'s, the vLLM plugin's exit paths'). ``besides``: a pid that does not count as its
        creator (this process, leaving it; its own locks given up first). None too for an entry that
        is not a readable board (``clean`` decides about those on its own)."""
        if self.header is None:
            return None
        if self.recently_published:
            return (f"a slot was published {self.last_publish_age:.3g} s ago (within {self.stale_after:g} s), "
                    f"whatever its creator pid says")
        if self.held:
            return ("a live process holds its lock (its creator, or a slot's writer), whatever its creator pid "
                    "and start time read as from here")
        if self.header.creator_pid != besides and self.creator_alive:
            return f"its creator (pid {self.header.creator_pid}) is alive"
        return None

    def why_alive(self) -> str:
        return self.in_use() or "it is not"



def own_files(name: str) -> list[str]:
    """The files of board ``name`` in /dev/shm that this user made: the board, its sent record, its
    dispatch record, each a regular file of this user's (another user's file under such a name, or
    a link, is never this user's to wait for or remove)."""
    own = []
    for prefix in (SEGMENT_PREFIX, SENT_PREFIX, DISPATCH_PREFIX):
        try:
            st = os.lstat(SHM_DIR / (prefix + name))
        except OSError:
            continue
        if st.st_uid == os.geteuid() and stat.S_ISREG(st.st_mode):
            own.append(prefix + name)
    return own


def _damage(header: BoardHeader, size: int) -> str | None:
    """Why a header of this layout does not describe a board, or None.
    Every field is bounded before any slot is looked at: anybody may plant a header (and a sparse
    file of any size) under /dev/shm/dpboard.*, and the listing reads only what a real board holds."""
    if not 1 <= header.n_slots <= MAX_SLOTS:
        return f"claims {header.n_slots} slots, outside 1..{MAX_SLOTS}: damaged or not a board"
    if size != segment_size(header.n_slots):
        return (f"is {size} bytes, but {header.n_slots} slots make {segment_size(header.n_slots)}: "
                f"damaged or not a board")
    return None


def _last_publish_age(mm: mmap.mmap, n_slots: int) -> float | None:
    """Seconds since the latest whole publish into any slot, from the slots' monotonic stamps.
    ``n_slots`` is bounded by ``_damage`` first: at most MAX_SLOTS * 16 bytes are read (plain
    values: the listing loads no NumPy)."""
    latest = None
    for rank in range(n_slots):
        seq, stamp = _SEQ_AND_STAMP.unpack_from(mm, HEADER_SIZE + rank * SLOT_SIZE)
        if seq != 0 and seq % 2 == 0 and (latest is None or stamp > latest):
            latest = stamp
    if latest is None:
        return None
    return (time.monotonic_ns() - latest) / 1e9  # negative: a stamp ahead of this clock (not recent)


def read_listing(name: str, *, stale_after: float = DEFAULT_STALE_AFTER) -> BoardListing:
    """The listing of the one entry ``/dev/shm/dpboard.<name>`` (what ``list_boards`` shows for it),
    without looking at any other entry. A missing entry is a NotFoundError."""
    validate_name(name)
    stale_after = check_stale_after(stale_after)
    if not os.path.lexists(SHM_DIR / (SEGMENT_PREFIX + name)):
        raise NotFoundError(f"board {name!r} does not exist: `dpboard ls` lists the boards here")
    return _read_listing(name, stale_after)


def _read_listing(name: str, stale_after: float) -> BoardListing:
    path = SHM_DIR / (SEGMENT_PREFIX + name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return BoardListing(name, 0, None, "a symbolic link, not a board (dpboard never follows one)")
        owner = mode = None
        try:
            st = os.lstat(path)
            owner, mode = st.st_uid, stat.S_IMODE(st.st_mode)
        except OSError:
            pass
        return BoardListing(name, 0, None, f"cannot read: {e.strerror}", owner, mode)
    try:
        st = os.fstat(fd)
        owner, mode, size = st.st_uid, stat.S_IMODE(st.st_mode), st.st_size
        if not stat.S_ISREG(st.st_mode):
            return BoardListing(name, 0, None, "not a regular file", owner, mode)
        if size < HEADER_STRUCT.size:
            return BoardListing(name, size, None, "no dpboard header", owner, mode)
        # The header alone first: its fields say how much more there is to read, once bounded.
        with mmap.mmap(fd, HEADER_STRUCT.size, prot=mmap.PROT_READ) as mm:
            magic, header = unpack_header(mm)
        if magic != MAGIC:
            return BoardListing(name, size, None, "no dpboard header", owner, mode)
        held = write_lock_held(fd)
        if (header.layout_version, header.header_size, header.slot_size) != (LAYOUT_VERSION, HEADER_SIZE, SLOT_SIZE):
            # Another dpboard version's board: listed with its header, its slots left unread.
            return BoardListing(name, size, header, None, owner, mode, None, stale_after, held)
        damage = _damage(header, size)
        if damage is not None:  # listed with the header it claims (clean judges its creator), slots unread
            return BoardListing(name, size, header, damage, owner, mode, None, stale_after, held)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            age = _last_publish_age(mm, header.n_slots)
        return BoardListing(name, size, header, None, owner, mode, age, stale_after, held)
    except (OSError, ValueError, struct.error, BufferError, MemoryError) as e:  # damaged: say so, list the others
        return BoardListing(name, 0, None, f"cannot read: {e}")
    finally:
        os.close(fd)


def list_boards(*, stale_after: float = DEFAULT_STALE_AFTER) -> list[BoardListing]:
    """Every ``/dev/shm/dpboard.*`` segment with its header, owner, mode and latest publish (or why
    it could not be read). ``stale_after`` decides which boards count as recently published."""
    stale_after = check_stale_after(stale_after)
    return [_read_listing(path.name[len(SEGMENT_PREFIX) :], stale_after)
            for path in sorted(SHM_DIR.glob(SEGMENT_PREFIX + "*"))]


def clean_boards(name: str | None = None, *, force: bool = False,
                 stale_after: float = DEFAULT_STALE_AFTER) -> list[str]:
    """Unlink boards that are not alive (all of them, or just ``name``): neither their creator runs
    nor was any slot published within ``stale_after``. ``force`` also removes live ones. A segment
    without a board header is removed only when named or with ``force``. Returns the names removed.
    A live board without ``force``, or a missing ``name``, is an error."""
    # A named board is read alone: what other entries hold (anybody's) never stands in its way.
    listings = (list_boards(stale_after=stale_after) if name is None
                else [read_listing(name, stale_after=stale_after)])
    removed = []
    for entry in listings:
        if entry.header is None:
            # Not a readable board (another user's, a link, or no header: being created, or not ours at all).
            if force or name is not None:
                try:
                    posix_ipc.unlink_shared_memory("/" + SEGMENT_PREFIX + entry.name)
                except posix_ipc.ExistentialError:
                    continue
                except posix_ipc.PermissionsError:
                    raise AccessDeniedError(
                        f"cannot remove /dev/shm/{SEGMENT_PREFIX}{entry.name}: it belongs to another user"
                    ) from None
                removed.append(entry.name)
            continue
        why = entry.in_use()
        if why is not None and not force:
            if name is not None:
                raise BoardError(f"board {name!r} is in use: {why}; stop it first, or pass --force")
            continue
        # Only the incarnation that was listed: a board re-created since then under that name stays.
        if unlink_if_generation("/" + SEGMENT_PREFIX + entry.name, entry.header.generation):
            removed.append(entry.name)
    remove_abandoned_records(name)  # dispatch records whose board is gone and no dispatcher runs
    return removed


ABANDONED_RECORD_AGE = 10.0  # seconds: a record without a whole header younger than this may be being created


def clean_sent_records(name: str | None = None, *, force: bool = False) -> list[str]:
    """Unlink sent records (``/dev/shm/dpboard-sent.<board>``) that no board uses any more: of a
    board that is gone or was created again since (another generation), or damaged, and whose rows
    no live process holds. ``force`` also removes held ones; ``name``: only that board's record.
    Only this user's records are looked at. Returns the boards whose record was removed (run it
    after ``clean_boards``, so that a board removed there takes its record with it)."""
    if name is not None:
        validate_name(name)
        paths = [SHM_DIR / (SENT_PREFIX + name)]
    else:
        paths = sorted(SHM_DIR.glob(SENT_PREFIX + "*"))
    removed = []
    now = time.time()
    for path in paths:
        board = path.name[len(SENT_PREFIX):]
        try:
            validate_name(board)
        except ValueError:
            continue  # not a name dpboard gives: not ours to judge
        state = record_state(str(path))
        if state is None:
            continue  # gone, or not a file of ours (another user's, a link): left alone
        generation, live = state
        if live and not force:
            continue  # an API server still writes it
        if generation is None:  # no whole header: its creator may be writing it this moment
            try:
                young = now - path.lstat().st_mtime < ABANDONED_RECORD_AGE
            except OSError:
                continue
            if young and not force:
                continue
        else:
            header = read_segment_header("/" + SEGMENT_PREFIX + board)
            if header is not None and header.generation == generation and _ours(board) and not force:
                continue  # its board is there: the next API server of that deployment takes its rows
        if remove_record(str(path), force=force):
            removed.append(board)
    return removed


def _ours(name: str) -> bool:
    """Whether ``/dev/shm/dpboard.<name>`` is a file of this process's user: only such a board is the
    one this user's records were made for (any user may leave a file of that name, with any header)."""
    try:
        return os.stat(SHM_DIR / (SEGMENT_PREFIX + name), follow_symlinks=False).st_uid == os.geteuid()
    except OSError:
        return False


def remove_if_gone(name: str, *, started_after: int = 0, leaving: bool = False) -> list[str]:
    """Remove board ``name``, its sent record and its dispatch record when nothing of them lives, by
    the rule ``dpboard clean`` applies (``BoardListing.in_use``): no slot published within the stale
    threshold, no lock held on the board (its creator's, a slot writer's: a writer in another PID
    namespace shows no pid here, but its lock stands), and its creator not running.
    ``started_after``: only a board whose creator started at or after that many clock ticks since
    boot (a board of this launcher's deployment, not an older one of that name). ``leaving``: this
    process, on its way out, does not count as the board's creator and gives its creator lock up
    (it has given up its slot or its rows already). A board of another user under that name (any
    user may leave one) is not this deployment's: it is left alone, and its records are judged
    without it. What was removed."""
    removed = []
    me = os.getpid()
    try:
        entry = read_listing(name)
    except DpboardError:
        entry = None  # gone already (or not a name of ours): the records may still be there
    header = None if entry is None or entry.owner_uid != os.geteuid() else entry.header
    # An older deployment's board (its creator started before started_after) stays; its records are
    # judged on their own all the same, as `dpboard clean` judges them.
    if header is not None and header.creator_start_ticks >= started_after:
        if leaving:
            drop_creator_lock(header.generation)  # done with it: its own lock is no proof of anybody's life
            entry = read_listing(name)
        if (entry.header is not None and entry.header.generation == header.generation
                and entry.in_use(besides=me if leaving else 0) is None
                and unlink_if_generation("/" + SEGMENT_PREFIX + name, header.generation)):
            removed.append(f"{SEGMENT_PREFIX}{name}")
    removed += [f"{SENT_PREFIX}{n}" for n in clean_sent_records(name)]
    removed += [f"{DISPATCH_PREFIX}{n}" for n in remove_abandoned_records(name)]
    return removed
