"""The two sides of the seqlock, ``BoardWriter`` and ``BoardReader``, over the C extension.

The C extension ``_seqlock`` (slot_writer.c, board_reader.c, side_rows.c, claim.c; the seqlock and its
memory-ordering argument in dpb_seqlock.h) is compiled against
``kernels/dpboard_layout.h``, generated from ``dpboard.snapshot``. It exports the layout it was
compiled with, and importing this module compares that with ``dpboard.snapshot``: an extension
built from another layout is an ImportError naming both values, never a silent misread.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from dpboard import snapshot
from dpboard.board import _seqlock
from dpboard.snapshot import LoadDetail, LoadSnapshot, SlotStatus, pack_detail, unpack_detail

if TYPE_CHECKING:
    import numpy as np

# The facts the extension's reads and writes depend on, compared at import.
_COMPILED_LAYOUT = (
    "LAYOUT_VERSION",
    "HEADER_SIZE",
    "SLOT_SIZE",
    "FIELDS_OFFSET",
    "NUM_FIELDS",
    "OWNER_OFFSET",
    "OWNER_PID_BITS",
    "RECORD_SIZE",
    "RECORD_STATUS_OFFSET",
    "DETAIL_OFFSET",
    "DETAIL_SIZE",
)


def _check_compiled_layout() -> None:
    mismatched = [
        f"{name} is {getattr(_seqlock, name, None)} in the extension but {getattr(snapshot, name)} in snapshot.py"
        for name in _COMPILED_LAYOUT
        if getattr(_seqlock, name, None) != getattr(snapshot, name)
    ]
    if mismatched:
        raise ImportError(
            f"dpboard's C extension {_seqlock.__file__} was built for another slot layout: "
            f"{'; '.join(mismatched)}. Regenerate the header and rebuild: `make layout` (or "
            f"`python tools/gen_layout.py && pip install -e .`)"
        )


_check_compiled_layout()


class BoardWriter(_seqlock.SlotWriter):
    """The single writer of one slot. ``publish(LoadSnapshot)`` is the hot path (C, no allocation).

    The writer stamps ``timestamp_ns`` (CLOCK_REALTIME), ``monotonic_ns`` (CLOCK_MONOTONIC),
    ``publish_seq``, ``writer_pid`` and ``node_id``; whatever the caller put there is ignored.
    ``publish_detailed(snapshot, detail)`` also stores a ``LoadDetail`` (an engine's whole snapshot
    beyond the dispatch fields) under the same sequence; a plain ``publish`` clears it.
    """

    board_name: str
    _detail_buffer: np.ndarray | None = None
    _claim: tuple | None = None  # what close() releases (set by Board.writer)
    _lock: weakref.finalize | None = None  # closes the descriptor that holds the slot's lock

    def close(self) -> None:
        """Stop writing into the slot: later publishes raise, and the slot is free at once for a new
        writer, in this process or another. Dropping the writer frees it for this process too."""
        with live_writers_lock:
            if self._claim is not None:
                mapping, offset, mine, key = self._claim
                if not self.closed:
                    claim_slot(mapping, offset, mine, 0)  # only while still ours: a takeover keeps its claim
                ref = live_writers.get(key)
                if ref is not None and ref() is self:
                    del live_writers[key]
                self._claim = None
            self._drop_lock()
            self._release()

    def leave(self) -> None:
        """Say that this writer leaves, then ``close()``: the slot reads STALE from the next read on
        (its monotonic stamp 0, written under the seqlock; its last fields kept), not once the stale
        threshold has passed, so readers and dispatchers stop picking it at once. Only a slot that is
        still this writer's is marked (never one another process has taken over)."""
        with live_writers_lock:
            if self._claim is not None and not self.closed:
                mapping, offset, mine, _ = self._claim
                if slot_owner(mapping, offset) == mine:
                    self.retire()
        self.close()

    def _drop_lock(self) -> None:
        """Give the slot's lock up (its descriptor closed), once this writer is done with the slot."""
        if self._lock is not None:
            self._lock()
            self._lock = None

    def __enter__(self) -> BoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish_detailed(self, snapshot: LoadSnapshot, detail: LoadDetail | None) -> None:
        """Publish the fields and the detail as one write (None: no detail, as ``publish``)."""
        if self._detail_buffer is None:
            import numpy as np

            from dpboard.snapshot import DETAIL_DTYPE

            self._detail_buffer = np.zeros(1, DETAIL_DTYPE)
        self.publish(snapshot, pack_detail(detail, self._detail_buffer))


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

    def read_detail(self, rank: int) -> tuple[SlotStatus, LoadSnapshot | None, LoadDetail | None]:
        """The slot's status, snapshot and detail, from one write (the detail is None when the writer
        published none, and with the snapshot when the slot is EMPTY or TORN)."""
        import numpy as np

        from dpboard.snapshot import DETAIL_DTYPE

        status, snap, raw = self.read_detailed(rank)
        detail = None if raw is None else unpack_detail(np.frombuffer(raw, DETAIL_DTYPE)[0])
        return status, snap, detail


slot_owner = _seqlock.slot_owner
claim_slot = _seqlock.claim_slot

# The open writers of this process, per (pid, board generation, rank): one writer per slot holds
# inside a process too (two writers with their own sequence counters would move the slot backwards).
# Weak references: a writer that is dropped frees its slot; the pid keeps a forked child's inherited
# entries from counting as its own. Board.writer fills it.
live_writers: dict[tuple[int, int, int], weakref.ref] = {}
live_writers_lock = threading.Lock()


def forget_writer(key: tuple[int, int, int], ref: weakref.ref) -> None:
    with live_writers_lock:
        if live_writers.get(key) is ref:
            del live_writers[key]
