"""``Board``: one POSIX shared-memory segment, a header and one seqlocked slot per DP rank.

``Board.create`` makes the segment (``/dev/shm/dpboard.<name>``, mode 0600) and owns it: it is
unlinked when the creator closes the board as a context manager, calls ``unlink()``, or exits
cleanly. ``Board.attach`` opens an existing one and checks its layout. Writers and readers come
from ``board.writer(rank)`` and ``board.reader()``; each keeps the mapping alive on its own.
"""

from __future__ import annotations

import atexit
import errno
import logging
import mmap
import numbers
import os
import stat
import struct
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import posix_ipc

from dpboard.board.dispatch_record import remove_if_abandoned
from dpboard.board.errors import BoardError, BoardLayoutError
from dpboard.board.header import NO_MAGIC, BoardHeader, check_layout, pack_header, unpack_header
from dpboard.board.liveness import process_alive, process_exited, process_start_ticks
from dpboard.board.names import MAX_SLOTS, SHM_DIR, segment_name
from dpboard.board.reserve import reserve_pages
from dpboard.board.seqlock import (
    BoardReader,
    BoardWriter,
    claim_slot,
    forget_writer,
    live_writers,
    live_writers_lock,
    slot_owner,
)
from dpboard.board.stale import check_stale_after
from dpboard.errors import AccessDeniedError, AlreadyExistsError, InvalidInputError, NotFoundError
from dpboard.ownership import check_owned, describe_owner, lock_range, write_lock_held
from dpboard.snapshot import (
    COLLECTOR_STATS_FIELDS,
    COLLECTOR_STATS_OFFSET,
    HEADER_SIZE,
    MAGIC,
    OWNER_OFFSET,
    SLOT_SIZE,
    LoadSnapshot,
    SlotStatus,
    pack_owner,
    segment_size,
    slot_offset,
    unpack_owner,
)

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("dpboard.board")
DEFAULT_STALE_AFTER = 1.0
MAX_NODE_ID = 2**63 - 1  # the header's node_id is a signed 64-bit word
DEFAULT_MAX_RETRIES = 256
CLAIM_ATTEMPTS = 16  # compare-and-swap rounds on a slot's owner word before giving up
_STATUSES = tuple(SlotStatus)


def _unreadable(name: str, path: str) -> str:
    """Why this process may not open the segment at ``path``, naming its owner and mode."""
    try:
        st = os.lstat(path)
        whose = f"belongs to {describe_owner(st.st_uid)} and is mode {stat.S_IMODE(st.st_mode):#o}"
    except OSError:
        whose = "belongs to another user"
    return (f"board {name!r} ({path}) {whose}: this process ({describe_owner(os.geteuid())}) may not open "
            f"it; run as that user, or have its creator make it readable (mode 0o640 and a shared group, "
            f"or 0o644) and trust that user (trust_uids, --trust-uid)")


def _open_segment(name: str, seg: str, path: str) -> tuple[Any, bool]:
    """(the opened segment, read_only): read-write when this process may, else read-only (another
    user's board with read permission). shm_open adds O_NOFOLLOW: a symbolic link is refused."""
    for read_only in (False, True):
        try:
            return posix_ipc.SharedMemory(seg, read_only=read_only), read_only
        except posix_ipc.ExistentialError:
            raise NotFoundError(
                f"board {name!r} does not exist ({path}): create it with Board.create "
                f"or check the name with `dpboard ls`"
            ) from None
        except posix_ipc.PermissionsError:
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise AccessDeniedError(f"board {name!r} ({path}) is a symbolic link, not a board: dpboard "
                                        f"never follows one; remove it") from None
            raise BoardError(f"cannot open board {name!r} ({path}): {e.strerror}") from None
    raise AccessDeniedError(_unreadable(name, path))


def _unlink_at_exit(seg: str, generation: int, pid: int) -> None:
    # atexit handlers survive fork(): only the creating process may unlink.
    if os.getpid() != pid:
        return
    unlink_if_generation(seg, generation)


# The creators' locks of the boards this process made, per generation (Board.create): kept while
# the board lives, whatever becomes of the Board object; closed when this process removes it.
_creator_locks: dict[int, int] = {}


def drop_creator_lock(generation: int) -> None:
    """Give up this process's creator lock of the board of ``generation`` (it removes the board, or
    leaves it to the processes that still use it: its own lock is then no proof of anybody's life)."""
    fd = _creator_locks.pop(generation, None)
    if fd is not None:
        os.close(fd)


def _slot_lock(name: str, identity: tuple[int, int], offset: int) -> int | None:
    """A descriptor of the board's segment holding the OFD write lock on the slot at ``offset`` (a
    writer's proof of life), or None when another process holds a write lock there (a writer). A
    segment that is not the board any more (removed, or recreated under its name) has nobody else to
    lock out: no descriptor is given (-1). Neither is one when only read locks stand in the way:
    another user who may read the board took them (docs/SECURITY.md, "Read locks are no writer's");
    the writer goes on without its lock, and the owner word decides who writes."""
    path = SHM_DIR / segment_name(name)[1:]
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return -1
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != identity:
        os.close(fd)
        return -1
    if lock_range(fd, offset, SLOT_SIZE):
        return fd
    writer = write_lock_held(fd, offset, SLOT_SIZE)
    os.close(fd)
    if writer:
        return None
    log.warning("board %r: another process holds a read lock on the bytes of the slot at offset %d (another user "
                "who may read %s), so its writer holds no lock of its own; the slot's owner word (pid and start "
                "time) stands for it", name, offset, path)
    return -1


LOCK_CHECK_INTERVAL = 0.05  # seconds: how often a dispatcher looks at the slots' writer locks, at most


class SlotLocks:
    """The slots whose writer is gone, by the writer's lock on its slot: a writer holds an OFD write
    lock on its slot's bytes for as long as it writes it, and the kernel drops it when the writer dies
    (SIGKILL included) or gives the slot up. A dispatcher skips such a slot at once rather than
    after the stale threshold, whatever its last stamp says. A read lock is nobody's proof (any user
    who may read the board can take one), and a slot without a write lock whose owner word names a
    process that runs (a writer that another user's read lock kept from taking its lock) is not gone.

    ``refresh()`` looks at the locks (one ``F_OFD_GETLK`` per slot) at most every ``interval``
    seconds, and costs one clock read otherwise; ``gone`` holds the ranks found without a writer,
    the same tuple object while nothing changes. ``demote(status, stamps, positions)`` turns LIVE
    into STALE in a read's status column for those ranks, unless the slot was published after the
    look (its ``monotonic_ns`` stamp is later): a writer that started since then holds its lock, and
    the next look says so. Nothing is allocated when no writer is gone."""

    def __init__(self, name: str, identity: tuple[int, int], n_slots: int, *,
                 interval: float = LOCK_CHECK_INTERVAL) -> None:
        self.n_slots = n_slots
        self.interval = check_stale_after(interval, "interval")
        self.gone: tuple[int, ...] = ()
        self._next = 0.0
        self._looked_ns = 0  # CLOCK_MONOTONIC of the last look, as the writers stamp their slots
        self._fd = -1
        try:
            fd = os.open(SHM_DIR / segment_name(name)[1:], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # removed meanwhile: nothing to look at, nobody is taken for gone
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            os.close(fd)  # another board under that name now: its locks say nothing of ours
            return
        self._fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def refresh(self, now: float | None = None) -> tuple[int, ...]:
        """Look at the locks again when ``interval`` has passed since the last look; ``gone``."""
        if self._fd < 0:
            return self.gone
        now = time.monotonic() if now is None else now
        if now < self._next:
            return self.gone
        self._next = now + self.interval
        fd = self._fd
        self._looked_ns = time.monotonic_ns()  # before the look: a publish stamped later came after it
        gone = tuple(rank for rank in range(self.n_slots) if not _slot_held(fd, slot_offset(rank)))
        if gone != self.gone:
            self.gone = gone
        return self.gone

    def demote(self, status: Any, stamps: Any, positions: Any = None) -> None:
        """``status[i] = STALE`` where it is LIVE, slot ``positions[rank]`` (or ``rank``) had no writer
        at the last look, and ``stamps[i]`` (the read's ``monotonic_ns``) is not later than that look."""
        looked = self._looked_ns
        for rank in self.gone:
            i = rank if positions is None else positions.get(rank)
            if i is not None and status[i] == _LIVE_CODE and stamps[i] <= looked:
                status[i] = _STALE_CODE

    def close(self) -> None:
        if self._fd >= 0:
            self._close()
            self._fd = -1


_LIVE_CODE, _STALE_CODE = int(SlotStatus.LIVE), int(SlotStatus.STALE)


def _slot_held(fd: int, offset: int) -> bool:
    """Whether the slot at ``offset`` of the board open at ``fd`` has a writer: one holds its write
    lock, or its owner word names a process that runs (with that start time, and not a zombie). The
    second look is what a writer without its lock leaves (``_slot_lock``), and costs one ``pread``
    for a slot that nobody holds; a writer that closes its slot clears the word."""
    if write_lock_held(fd, offset, SLOT_SIZE):
        return True
    try:
        word = struct.unpack("<Q", os.pread(fd, 8, offset + OWNER_OFFSET))[0]
    except (OSError, struct.error):
        return False
    pid, ticks = unpack_owner(word)
    return pid != 0 and process_alive(pid, ticks) and not process_exited(pid)


def read_segment_header(seg: str) -> BoardHeader | None:
    """The header of the segment named ``seg`` now, or None (gone, unreadable, no board header)."""
    try:
        shm = posix_ipc.SharedMemory(seg, read_only=True)  # another user's readable board too
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError, OSError):
        return None
    try:
        with mmap.mmap(shm.fd, min(shm.size, HEADER_SIZE), prot=mmap.PROT_READ) as mm:
            magic, header = unpack_header(mm)
    except (ValueError, OSError, struct.error):
        return None
    finally:
        shm.close_fd()
    return header if magic == MAGIC else None


def unlink_if_generation(seg: str, generation: int) -> bool:
    """Unlink the segment only if it is still the board we know (not a newer one of that name)."""
    header = read_segment_header(seg)
    if header is None or header.generation != generation:
        return False
    try:
        posix_ipc.unlink_shared_memory(seg)
    except posix_ipc.ExistentialError:
        return False
    return True


class Board:
    """A dpboard shared-memory board. Use ``Board.create`` or ``Board.attach``."""

    def __init__(self, name: str, shm_size: int, mapping: mmap.mmap, header: BoardHeader, *, owner: bool,
                 identity: tuple[int, int] = (0, 0)):
        self._name = name
        self._size = shm_size
        self._mapping: mmap.mmap | None = mapping
        self._header = header
        self._owner = owner
        self._identity = identity  # (st_dev, st_ino) of the segment: a recreated board is another file
        self._read_only = False  # attached read-only: another user's board that this process may read
        self._unlinked = False

    # -- life cycle ---------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        n_slots: int,
        *,
        exist_ok: bool = False,
        mode: int = 0o600,
        node_id: int = 0,
        trust_uids: Iterable[int] = (),
    ) -> Board:
        """Create the board ``/dpboard.<name>`` with ``n_slots`` slots; this process owns it.

        ``mode`` is the segment's permission bits: 0600 (the default) or, to let other users read
        it, 0640 / 0644; a board nobody but its owner may write. With ``exist_ok=True`` an existing
        board of the same shape is attached instead (the caller does not own it then), with every
        check ``attach`` makes (``trust_uids`` included); one of another shape is an error naming both.
        """
        seg = segment_name(name)
        if not isinstance(n_slots, int) or not 1 <= n_slots <= MAX_SLOTS:
            raise InvalidInputError(f"n_slots must be an integer in [1, {MAX_SLOTS}], got {n_slots!r}")
        if not isinstance(mode, int) or mode & ~0o777 or mode & 0o022 or (mode & 0o600) != 0o600:
            raise InvalidInputError(
                f"mode must give the owner read and write and nobody else write (0o600, 0o640 or 0o644), "
                f"got {mode!r}: a board that others may write cannot be trusted by its readers"
            )
        if isinstance(node_id, bool) or not isinstance(node_id, int) or not 0 <= node_id <= MAX_NODE_ID:
            raise InvalidInputError(f"node_id must be an integer in [0, {MAX_NODE_ID}] (the header keeps it in "
                                    f"64 bits), got {node_id!r}")
        size = segment_size(n_slots)
        try:
            # 0600 until the creator's lock is held (below): nobody else can open the segment before,
            # so no other user's read lock stands in the way of that write lock
            shm = posix_ipc.SharedMemory(seg, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:
            if exist_ok:
                return cls.attach(name, n_slots=n_slots, trust_uids=trust_uids)
            raise AlreadyExistsError(
                f"board {name!r} already exists ({SHM_DIR}/{seg[1:]}): attach it with Board.attach({name!r}), "
                f"or remove it with `dpboard clean {name}` if its creator is gone"
            ) from None
        except posix_ipc.PermissionsError:
            raise AccessDeniedError(f"cannot create board {name!r} in {SHM_DIR}: permission denied") from None
        header = BoardHeader.new(name, n_slots, node_id)
        mapping = None
        try:
            # The creator's proof of life beside its pid and start ticks, held until it removes the
            # board or dies: `dpboard clean` never takes a board whose lock is held. A write lock:
            # nobody but the owner can take one, while any user who may read the board can take a
            # read lock (docs/SECURITY.md).
            creator_lock = os.dup(shm.fd)
            _creator_locks[header.generation] = creator_lock
            lock_range(creator_lock, 0, HEADER_SIZE)
            os.fchmod(shm.fd, mode)  # exact mode, whatever the umask: others may open it from here on
            st = os.fstat(shm.fd)
            reserve_pages(shm.fd, size, f"board {name!r}")
            mapping = mmap.mmap(shm.fd, size)
            # Every field but the magic first: an attacher that sees the magic sees a whole header.
            pack_header(mapping, header, magic=NO_MAGIC)
            mapping[0:8] = MAGIC
        except BaseException:
            if mapping is not None:
                mapping.close()
            shm.unlink()  # not a board yet (no magic): leave no segment behind
            drop_creator_lock(header.generation)
            raise
        finally:
            shm.close_fd()
        atexit.register(_unlink_at_exit, seg, header.generation, header.creator_pid)
        return cls(name, size, mapping, header, owner=True, identity=(st.st_dev, st.st_ino))

    @classmethod
    def attach(cls, name: str, *, n_slots: int | None = None, timeout: float = 1.0,
               trust_uids: Iterable[int] = ()) -> Board:
        """Open an existing board. ``n_slots``, when given, must match the board's.

        The segment must belong to this process's user (or to a uid in ``trust_uids``, e.g. ``(0,)``
        to read boards that root created) and be writable by its owner only; anything else is an
        ``AccessDeniedError`` naming its owner and mode. A board that is being created is waited for,
        at most ``timeout`` seconds, until its size and header are there.
        """
        seg = segment_name(name)
        path = f"{SHM_DIR}/{seg[1:]}"
        trusted = tuple(int(u) for u in trust_uids)
        shm, read_only = _open_segment(name, seg, path)
        deadline = time.monotonic() + timeout
        try:
            st = os.fstat(shm.fd)
            check_owned(st, path, f"board {name!r}", trusted,
                        hint=f"attach only boards your own user created, or pass trust_uids=({st.st_uid},) "
                             f"(--trust-uid {st.st_uid}) if you trust that user")
            # A creator makes the segment, then sizes it: wait for the size as for the magic.
            while st.st_size < HEADER_SIZE:
                if time.monotonic() >= deadline:
                    raise BoardLayoutError(
                        f"segment {path} is {st.st_size} bytes, smaller than a board header, after "
                        f"{timeout:g} s: it is not a dpboard board, or its creator died while creating it; "
                        f"remove it with `dpboard clean {name} --force`"
                    )
                time.sleep(0.001)
                st = os.fstat(shm.fd)
            size = st.st_size
            # The header is read, and the layout it claims checked, before anything is mapped: only
            # what a board of its slots holds is, so a sparse file of any size is never mapped whole.
            while True:
                magic, header = unpack_header(os.pread(shm.fd, HEADER_SIZE, 0).ljust(HEADER_SIZE, b"\0"))
                if magic == MAGIC:
                    break
                if magic != NO_MAGIC or time.monotonic() >= deadline:
                    raise BoardLayoutError(
                        f"segment {path} has no dpboard header (magic {magic!r}): it is not a board, or its "
                        f"creator died while creating it; remove it with `dpboard clean {name} --force`"
                    )
                time.sleep(0.001)
            check_layout(name, header, size, n_slots)
            size = segment_size(header.n_slots)
            mapping = mmap.mmap(shm.fd, size, prot=mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            shm.close_fd()
        board = cls(name, size, mapping, header, owner=False, identity=(st.st_dev, st.st_ino))
        board._read_only = read_only
        return board

    def close(self) -> None:
        """Drop this object's mapping. Readers and writers made from it keep theirs."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # readers, writers or a stats record still use it; unmapped when the last one goes

    def unlink(self) -> None:
        """Remove the segment's name; processes that have it mapped keep working until they close."""
        if not self._unlinked:
            unlink_if_generation(segment_name(self._name), self._header.generation)
            drop_creator_lock(self._header.generation)
            self._unlinked = True
            remove_if_abandoned(self._name, leaving=True)  # its dispatch record, once no other dispatcher of it runs

    def is_current(self) -> bool:
        """True while the segment of this name is still this board (not removed, not replaced by a
        new board of the same name: another file, or another generation). Long-running readers and
        writers call it to notice a recreated board."""
        try:
            st = os.stat(SHM_DIR / segment_name(self._name)[1:], follow_symlinks=False)
        except OSError:
            return False
        if (st.st_dev, st.st_ino) != self._identity:
            return False
        header = read_segment_header(segment_name(self._name))
        return header is not None and header.generation == self._header.generation

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

    # -- writers and readers ------------------------------------------------------------------

    def _require_mapping(self) -> mmap.mmap:
        if self._mapping is None:
            raise InvalidInputError(
                f"board {self._name!r} is closed: attach it again with Board.attach({self._name!r})"
            )
        return self._mapping

    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, numbers.Integral) or not 0 <= rank < self.n_slots:  # NumPy's integers too
            raise IndexError(
                f"rank {rank!r} is out of range: board {self._name!r} has {self.n_slots} slots "
                f"(ranks 0..{self.n_slots - 1})"
            )
        return int(rank)

    def owner(self, rank: int) -> tuple[int, int]:
        """(pid, start ticks) of the process that last took the slot's writer; (0, 0) if none ever did."""
        rank = self._check_rank(rank)
        return unpack_owner(slot_owner(self._require_mapping(), slot_offset(rank)))

    def owner_pid(self, rank: int) -> int:
        """Pid of the process that last took the slot's writer (0: never)."""
        return self.owner(rank)[0]

    def writer(self, rank: int, *, node_id: int | None = None, takeover: bool = False) -> BoardWriter:
        """The writer of slot ``rank``. A restarted writer re-attaches to its slot (and repairs it if
        its predecessor died mid-write).

        One writer per slot, between processes and inside one. The slot is claimed with a
        compare-and-swap on its owner word, so of two processes racing for it exactly one wins, and
        a slot held by another live process is refused. A second writer of a slot whose writer in
        this process is still open is refused too: ``close()`` (or drop) the first one before.

        ``takeover=True`` takes the slot anyway. From a writer of this process, which is closed (its
        later publishes raise). From another process, whose publishes would then interleave with
        ours: use it only for a holder that is gone or hung, never for one that still publishes.
        """
        rank = self._check_rank(rank)
        mapping = self._require_mapping()
        if self._read_only:
            raise AccessDeniedError(
                f"board {self._name!r} is open read-only in this process (it belongs to another user): "
                f"only its owner's processes write it"
            )
        offset = slot_offset(rank)
        pid = os.getpid()
        mine = pack_owner(pid, process_start_ticks(pid))
        key = (pid, self.generation, rank)
        with live_writers_lock:
            ref = live_writers.get(key)
            previous = ref() if ref is not None else None
            if previous is not None and not previous.closed and not takeover:
                raise BoardError(
                    f"slot {rank} of board {self._name!r} already has an open writer in this process: one "
                    f"writer per slot; close it (writer.close()) or drop it first, or pass takeover=True"
                )
            if previous is not None:
                previous._drop_lock()  # ours to give up before the slot's lock is taken again
            # The slot's lock first: of two processes racing for the slot, one gets it. A holder whose
            # start ticks read otherwise from here (a time namespace) still holds it: alive.
            lock = _slot_lock(self._name, self._identity, offset)
            if lock is None and not takeover:
                holder, _ = unpack_owner(slot_owner(mapping, offset))
                who = f"live process {holder}" if holder else "a live process that is claiming it"
                raise BoardError(f"slot {rank} of board {self._name!r} is held by the writer in {who} (it holds "
                                 f"the slot's lock): one writer per slot; stop it, or pass takeover=True")
            try:
                for _ in range(CLAIM_ATTEMPTS):
                    current = slot_owner(mapping, offset)
                    holder, holder_ticks = unpack_owner(current)
                    if not takeover and current not in (0, mine) and process_alive(holder, holder_ticks):
                        raise BoardError(
                            f"slot {rank} of board {self._name!r} is held by the writer in live process {holder}: "
                            f"one writer per slot; stop it, or pass takeover=True"
                        )
                    if current == mine or claim_slot(mapping, offset, current, mine):
                        break
                else:
                    raise BoardError(f"slot {rank} of board {self._name!r}: its owner word keeps changing; retry")
            except BaseException:
                if lock is not None and lock >= 0:
                    os.close(lock)
                raise
            if previous is not None:
                previous._release()  # taken over inside this process: the old writer writes no more
            w = BoardWriter(mapping, offset, rank, self.node_id if node_id is None else node_id, pid)
            w.board_name = self._name
            w._claim = (mapping, offset, mine, key)
            if lock is not None and lock >= 0:
                w._lock = weakref.finalize(w, os.close, lock)  # a dropped writer gives its lock up too
            live_writers[key] = weakref.ref(w, lambda ref, key=key: forget_writer(key, ref))
        return w

    def reader(self, *, stale_after: float = DEFAULT_STALE_AFTER, max_retries: int = DEFAULT_MAX_RETRIES,
               arrays: bool = True) -> BoardReader:
        """A reader of every slot. ``stale_after``: seconds without a publish before a slot is STALE,
        in [MIN_STALE_AFTER, MAX_STALE_AFTER] (``dpboard.board.stale``). ``arrays=False``: a reader for the
        plain reads only (``read``, ``read_all``, ``read_with_status``, ``status``: Python values), which
        loads no NumPy; its ``read_array`` then needs ``out``."""
        stale_after = check_stale_after(stale_after)
        out = None
        if arrays:
            import numpy as np

            from dpboard.snapshot import SNAPSHOT_DTYPE

            out = np.zeros(self.n_slots, dtype=SNAPSHOT_DTYPE)
        r = BoardReader(
            self._require_mapping(), HEADER_SIZE, self.n_slots, LoadSnapshot, _STATUSES, out,
            int(stale_after * 1e9), max_retries,
        )
        r.board_name = self._name
        return r

    def slot_locks(self, *, interval: float = LOCK_CHECK_INTERVAL) -> SlotLocks:
        """Which slots' writers are gone by their locks, looked at every ``interval`` seconds at most
        (``SlotLocks``): what a dispatcher checks beside the slots' stamps."""
        return SlotLocks(self._name, self._identity, self.n_slots, interval=interval)

    # -- the collector's statistics -------------------------------------------------------------

    def collector_stats_record(self) -> np.ndarray:
        """The header's collector statistics as a writable one-record COLLECTOR_STATS_DTYPE array.

        Only the board's collector writes it (dpboard.multinode.collector); it keeps this board's
        mapping alive while it is held."""
        import numpy as np

        from dpboard.snapshot import COLLECTOR_STATS_DTYPE

        return np.frombuffer(self._require_mapping(), dtype=COLLECTOR_STATS_DTYPE, count=1,
                             offset=COLLECTOR_STATS_OFFSET)

    def collector_stats(self) -> dict[str, Any]:
        """The collector's pid and frame counters, plus whether that collector is alive (plain
        values, read without NumPy)."""
        values = struct.unpack_from(f"<{len(COLLECTOR_STATS_FIELDS)}Q", self._require_mapping(), COLLECTOR_STATS_OFFSET)
        stats: dict[str, Any] = dict(zip(COLLECTOR_STATS_FIELDS, values, strict=True))
        stats["collector_alive"] = int(process_alive(stats["collector_pid"], stats["collector_start_ticks"]))
        return stats

    # -- facts ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def n_slots(self) -> int:
        return self._header.n_slots

    @property
    def header(self) -> BoardHeader:
        return self._header

    @property
    def generation(self) -> int:
        """Random 63-bit identity of this incarnation of the board."""
        return self._header.generation

    @property
    def node_id(self) -> int:
        return self._header.node_id

    @property
    def is_owner(self) -> bool:
        return self._owner

    @property
    def read_only(self) -> bool:
        """True when this process could open the segment for reading only (another user's board)."""
        return self._read_only

    def __repr__(self) -> str:
        return f"Board({self._name!r}, n_slots={self.n_slots}, owner={self._owner})"
