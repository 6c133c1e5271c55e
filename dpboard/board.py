"""The board: one POSIX shared-memory segment, a header and one seqlocked slot per DP rank.

``Board.create`` makes the segment (``/dev/shm/dpboard.<name>``, mode 0600) and owns it: it is
unlinked when the creator closes the board as a context manager, calls ``unlink()``, or exits
cleanly. ``Board.attach`` opens an existing one and checks its layout. Writers and readers come
from ``board.writer(rank)`` and ``board.reader()``; each keeps the mapping alive on its own.

The seqlock itself is in ``_seqlock.c`` (the memory-ordering argument is at its top); this module
is the thin Python shell around it: names, validation, the header and the segment's life cycle.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

from dpboard import _seqlock
from dpboard.snapshot import (
    HEADER_DTYPE,
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    OWNER_PID_OFFSET,
    OWNER_START_TICKS_OFFSET,
    SLOT_SIZE,
    SNAPSHOT_DTYPE,
    LoadSnapshot,
    SlotStatus,
    segment_size,
    slot_offset,
)

SEGMENT_PREFIX = "dpboard."
SHM_DIR = Path("/dev/shm")
MAX_SLOTS = 65536
DEFAULT_STALE_AFTER = 1.0
DEFAULT_MAX_RETRIES = 256
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The header's fields, little-endian, at the offsets HEADER_DTYPE gives them (packed in one call).
_HEADER_STRUCT = struct.Struct("<8sIIII q q Q 64s q Q")
assert _HEADER_STRUCT.size == HEADER_DTYPE.itemsize
_STATUSES = (SlotStatus.EMPTY, SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.TORN)


class BoardError(RuntimeError):
    """A board cannot be created or attached as asked (the message says why and what to do)."""


class BoardLayoutError(BoardError):
    """The segment exists but has another layout version or shape than the caller expects."""


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"board name {name!r} is invalid: use 1-64 characters from letters, digits, '_', '.', '-'"
        )
    return name


def segment_name(name: str) -> str:
    """The POSIX shared-memory name of a board: ``/dpboard.<name>``."""
    return "/" + SEGMENT_PREFIX + validate_name(name)


def process_start_ticks(pid: int) -> int:
    """Start time of a process in clock ticks since boot (0 when it does not exist).

    Stored beside the creator's pid so that a recycled pid is not mistaken for the creator.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def process_alive(pid: int, start_ticks: int = 0) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if start_ticks:
        return process_start_ticks(pid) == start_ticks
    return True


@dataclass(frozen=True)
class BoardHeader:
    name: str
    layout_version: int
    header_size: int
    n_slots: int
    slot_size: int
    creator_pid: int
    creation_time_ns: int
    generation: int
    node_id: int
    creator_start_ticks: int

    @property
    def creator_alive(self) -> bool:
        return process_alive(self.creator_pid, self.creator_start_ticks)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "creator_alive": self.creator_alive}


def _unpack_header(buf: Any) -> tuple[bytes, BoardHeader]:
    (magic, version, header_size, n_slots, slot_size, creator_pid, created, generation, raw_name,
     node_id, start_ticks) = _HEADER_STRUCT.unpack_from(buf, 0)
    header = BoardHeader(
        name=raw_name.rstrip(b"\x00").decode("utf-8", "replace"),
        layout_version=version,
        header_size=header_size,
        n_slots=n_slots,
        slot_size=slot_size,
        creator_pid=creator_pid,
        creation_time_ns=created,
        generation=generation,
        node_id=node_id,
        creator_start_ticks=start_ticks,
    )
    return magic, header


def _check_layout(name: str, header: BoardHeader, size: int, expected_slots: int | None) -> None:
    if header.layout_version != LAYOUT_VERSION:
        raise BoardLayoutError(
            f"board {name!r} has layout version {header.layout_version}, but this dpboard reads layout "
            f"version {LAYOUT_VERSION}: run the same dpboard version on both sides, or recreate the board"
        )
    if header.slot_size != SLOT_SIZE or header.header_size != HEADER_SIZE:
        raise BoardLayoutError(
            f"board {name!r} has {header.slot_size}-byte slots after a {header.header_size}-byte header, "
            f"this dpboard expects {SLOT_SIZE}-byte slots after a {HEADER_SIZE}-byte header"
        )
    if expected_slots is not None and header.n_slots != expected_slots:
        raise BoardLayoutError(
            f"board {name!r} has {header.n_slots} slots, but {expected_slots} were expected: "
            f"use n_slots={header.n_slots}, or remove the board (`dpboard clean {name} --force`) and recreate it"
        )
    if size < segment_size(header.n_slots):
        raise BoardLayoutError(
            f"board {name!r} is {size} bytes, too small for its {header.n_slots} slots "
            f"({segment_size(header.n_slots)} bytes): the segment is damaged; remove it with `dpboard clean`"
        )


def _unlink_at_exit(seg: str, generation: int, pid: int) -> None:
    # atexit handlers survive fork(): only the creating process may unlink.
    if os.getpid() != pid:
        return
    _unlink_if_generation(seg, generation)


def _unlink_if_generation(seg: str, generation: int) -> bool:
    """Unlink the segment only if it is still the board we created (not a newer one of that name)."""
    try:
        shm = posix_ipc.SharedMemory(seg)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return False
    try:
        with mmap.mmap(shm.fd, min(shm.size, HEADER_SIZE), prot=mmap.PROT_READ) as mm:
            _, header = _unpack_header(mm)
    except (ValueError, OSError, struct.error):
        return False
    finally:
        shm.close_fd()
    if header.generation != generation:
        return False
    try:
        posix_ipc.unlink_shared_memory(seg)
    except posix_ipc.ExistentialError:
        return False
    return True


class BoardWriter(_seqlock.SlotWriter):
    """The single writer of one slot. ``publish(LoadSnapshot)`` is the hot path (C, no allocation).

    The writer stamps ``timestamp_ns`` (CLOCK_REALTIME), ``monotonic_ns`` (CLOCK_MONOTONIC),
    ``publish_seq``, ``writer_pid`` and ``node_id``; whatever the caller put there is ignored.
    """

    board_name: str


class BoardReader(_seqlock.BoardView):
    """Seqlocked reads of every slot; bounded retries, so a slot stuck mid-write reads as TORN.

    ``read(rank)``, ``read_all()``, ``status(rank)``, ``read_with_status(rank)`` and
    ``read_array(out=None)`` are C methods. ``read_array()`` without ``out`` fills and returns the
    reader's own SNAPSHOT_DTYPE array, which the next call overwrites: copy what you keep.
    """

    board_name: str

    @property
    def stale_after(self) -> float:
        """Seconds without a publish after which a slot reads as STALE."""
        return self.stale_after_ns / 1e9


class Board:
    """A dpboard shared-memory board. Use ``Board.create`` or ``Board.attach``."""

    def __init__(self, name: str, shm_size: int, mapping: mmap.mmap, header: BoardHeader, *, owner: bool):
        self._name = name
        self._size = shm_size
        self._mapping: mmap.mmap | None = mapping
        self._header = header
        self._owner = owner
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
    ) -> Board:
        """Create the board ``/dpboard.<name>`` with ``n_slots`` slots; this process owns it.

        With ``exist_ok=True`` an existing board of the same shape is attached instead (the caller
        does not own it then); one of another shape is an error naming both.
        """
        seg = segment_name(name)
        if not isinstance(n_slots, int) or not 1 <= n_slots <= MAX_SLOTS:
            raise ValueError(f"n_slots must be an integer in [1, {MAX_SLOTS}], got {n_slots!r}")
        size = segment_size(n_slots)
        try:
            shm = posix_ipc.SharedMemory(seg, posix_ipc.O_CREX, mode=mode, size=size)
        except posix_ipc.ExistentialError:
            if exist_ok:
                return cls.attach(name, n_slots=n_slots)
            raise FileExistsError(
                f"board {name!r} already exists ({SHM_DIR}/{seg[1:]}): attach it with Board.attach({name!r}), "
                f"or remove it with `dpboard clean {name}` if its creator is gone"
            ) from None
        try:
            os.fchmod(shm.fd, mode)  # exact mode, whatever the umask
            mapping = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.unlink()  # not a board yet (no magic): leave no segment behind
            raise
        finally:
            shm.close_fd()
        pid = os.getpid()
        header = BoardHeader(
            name=name,
            layout_version=LAYOUT_VERSION,
            header_size=HEADER_SIZE,
            n_slots=n_slots,
            slot_size=SLOT_SIZE,
            creator_pid=pid,
            creation_time_ns=time.time_ns(),
            generation=secrets.randbits(63) | 1,
            node_id=node_id,
            creator_start_ticks=process_start_ticks(pid),
        )
        # Every field but the magic first: an attacher that sees the magic sees a whole header.
        _HEADER_STRUCT.pack_into(
            mapping, 0, b"\x00" * 8, header.layout_version, header.header_size, header.n_slots,
            header.slot_size, header.creator_pid, header.creation_time_ns, header.generation,
            name.encode(), header.node_id, header.creator_start_ticks,
        )
        mapping[0:8] = MAGIC
        atexit.register(_unlink_at_exit, seg, header.generation, pid)
        return cls(name, size, mapping, header, owner=True)

    @classmethod
    def attach(cls, name: str, *, n_slots: int | None = None, timeout: float = 1.0) -> Board:
        """Open an existing board. ``n_slots``, when given, must match the board's.

        Waits at most ``timeout`` seconds for a board that is being created to get its header.
        """
        seg = segment_name(name)
        try:
            shm = posix_ipc.SharedMemory(seg)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(
                f"board {name!r} does not exist ({SHM_DIR}/{seg[1:]}): create it with Board.create "
                f"or check the name with `dpboard ls`"
            ) from None
        except posix_ipc.PermissionsError:
            raise PermissionError(
                f"board {name!r} ({SHM_DIR}/{seg[1:]}) belongs to another user and is mode 0600: run as "
                f"that user, or have its creator use Board.create(..., mode=0o660) and a shared group"
            ) from None
        try:
            size = shm.size
            if size < HEADER_SIZE:
                raise BoardLayoutError(
                    f"segment {SHM_DIR}/{seg[1:]} is {size} bytes, smaller than a board header: "
                    f"it is not a dpboard board; remove it with `dpboard clean {name} --force`"
                )
            mapping = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        deadline = time.monotonic() + timeout
        while True:
            magic, header = _unpack_header(mapping)
            if magic == MAGIC:
                break
            if magic != b"\x00" * 8 or time.monotonic() >= deadline:
                mapping.close()
                raise BoardLayoutError(
                    f"segment {SHM_DIR}/{seg[1:]} has no dpboard header (magic {magic!r}): it is not a "
                    f"board, or its creator died while creating it; remove it with `dpboard clean {name} --force`"
                )
            time.sleep(0.001)
        try:
            _check_layout(name, header, size, n_slots)
        except BoardError:
            mapping.close()
            raise
        return cls(name, size, mapping, header, owner=False)

    def close(self) -> None:
        """Drop this object's mapping. Readers and writers made from it keep theirs."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # readers or writers still use it; it is unmapped when the last one goes

    def unlink(self) -> None:
        """Remove the segment's name; processes that have it mapped keep working until they close."""
        if not self._unlinked:
            _unlink_if_generation(segment_name(self._name), self._header.generation)
            self._unlinked = True

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

    # -- writers and readers ------------------------------------------------------------------

    def _require_mapping(self) -> mmap.mmap:
        if self._mapping is None:
            raise ValueError(f"board {self._name!r} is closed: attach it again with Board.attach({self._name!r})")
        return self._mapping

    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.n_slots:
            raise IndexError(
                f"rank {rank!r} is out of range: board {self._name!r} has {self.n_slots} slots "
                f"(ranks 0..{self.n_slots - 1})"
            )
        return int(rank)

    def owner_pid(self, rank: int) -> int:
        """Pid of the process that last took the slot's writer (0: never)."""
        rank = self._check_rank(rank)
        return struct.unpack_from("<q", self._require_mapping(), slot_offset(rank) + OWNER_PID_OFFSET)[0]

    def _slot_owner(self, rank: int) -> tuple[int, int]:
        return struct.unpack_from("<qQ", self._require_mapping(), slot_offset(rank) + OWNER_PID_OFFSET)

    def writer(self, rank: int, *, node_id: int | None = None, takeover: bool = False) -> BoardWriter:
        """The writer of slot ``rank``. A restarted writer re-attaches to its slot (and repairs it if
        its predecessor died mid-write). A slot held by another live process is refused unless
        ``takeover=True``: one writer per slot."""
        rank = self._check_rank(rank)
        mapping = self._require_mapping()
        pid = os.getpid()
        holder, holder_ticks = self._slot_owner(rank)
        if not takeover and holder not in (0, pid) and process_alive(holder, holder_ticks):
            raise BoardError(
                f"slot {rank} of board {self._name!r} is held by the writer in live process {holder}: "
                f"one writer per slot; stop it, or pass takeover=True"
            )
        w = BoardWriter(mapping, slot_offset(rank), rank, self.node_id if node_id is None else node_id, pid)
        # The writer stored its pid; its start time goes beside it (read only by the check above).
        struct.pack_into("<Q", mapping, slot_offset(rank) + OWNER_START_TICKS_OFFSET, process_start_ticks(pid))
        w.board_name = self._name
        return w

    def reader(self, *, stale_after: float = DEFAULT_STALE_AFTER, max_retries: int = DEFAULT_MAX_RETRIES) -> BoardReader:
        """A reader of every slot. ``stale_after``: seconds without a publish before a slot is STALE."""
        if not stale_after > 0:
            raise ValueError(f"stale_after must be > 0 seconds, got {stale_after!r}")
        out = np.zeros(self.n_slots, dtype=SNAPSHOT_DTYPE)
        r = BoardReader(
            self._require_mapping(), HEADER_SIZE, self.n_slots, LoadSnapshot, _STATUSES, out,
            int(stale_after * 1e9), max_retries,
        )
        r.board_name = self._name
        return r

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
    def mapping(self) -> mmap.mmap:
        """The raw mapping (header at 0, slots after it), for the collector's statistics region."""
        return self._require_mapping()

    def __repr__(self) -> str:
        return f"Board({self._name!r}, n_slots={self.n_slots}, owner={self._owner})"


# -- boards on this machine ---------------------------------------------------------------------


@dataclass(frozen=True)
class BoardListing:
    name: str
    size: int
    header: BoardHeader | None
    error: str | None = None

    @property
    def creator_alive(self) -> bool | None:
        return None if self.header is None else self.header.creator_alive


def list_boards() -> list[BoardListing]:
    """Every ``/dev/shm/dpboard.*`` segment with its header (or why it could not be read)."""
    listings = []
    for path in sorted(SHM_DIR.glob(SEGMENT_PREFIX + "*")):
        name = path.name[len(SEGMENT_PREFIX) :]
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_SIZE)
            size = path.stat().st_size
        except OSError as e:
            listings.append(BoardListing(name, 0, None, f"cannot read: {e.strerror}"))
            continue
        if len(raw) < _HEADER_STRUCT.size or raw[:8] != MAGIC:
            listings.append(BoardListing(name, size, None, "no dpboard header"))
            continue
        _, header = _unpack_header(raw)
        listings.append(BoardListing(name, size, header))
    return listings


def clean_boards(name: str | None = None, *, force: bool = False) -> list[str]:
    """Unlink boards whose creator is dead (all of them, or just ``name``); ``force`` also removes a
    board whose creator is alive. A segment without a board header is removed only when named or
    with ``force``. Returns the names removed. A live board without ``force``, or a missing ``name``,
    is an error."""
    listings = list_boards()
    if name is not None:
        validate_name(name)
        listings = [entry for entry in listings if entry.name == name]
        if not listings:
            raise FileNotFoundError(f"board {name!r} does not exist: `dpboard ls` lists the boards here")
    removed = []
    for entry in listings:
        if entry.header is None:
            # Not a readable board (another user's, or no header: being created, or not ours at all).
            if force or name is not None:
                try:
                    posix_ipc.unlink_shared_memory("/" + SEGMENT_PREFIX + entry.name)
                except posix_ipc.ExistentialError:
                    continue
                except posix_ipc.PermissionsError:
                    raise PermissionError(
                        f"cannot remove /dev/shm/{SEGMENT_PREFIX}{entry.name}: it belongs to another user"
                    ) from None
                removed.append(entry.name)
            continue
        if entry.creator_alive and not force:
            if name is not None:
                raise BoardError(
                    f"board {name!r} is in use: its creator (pid {entry.header.creator_pid}) is alive; "
                    f"stop it first, or pass --force"
                )
            continue
        # Only the incarnation that was listed: a board re-created since then under that name stays.
        if _unlink_if_generation("/" + SEGMENT_PREFIX + entry.name, entry.header.generation):
            removed.append(entry.name)
    return removed
