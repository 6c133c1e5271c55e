# Types of the C extension dpboard.board._seqlock (board_module.c and the files it lists: the seqlocked
# slot writer and board reader, the seqlocked rows of the side records, the owner claim).
from collections.abc import Sequence
from mmap import mmap

import numpy as np

from dpboard.snapshot import LoadSnapshot, SlotStatus

LAYOUT_VERSION: int
HEADER_SIZE: int
SLOT_SIZE: int
FIELDS_OFFSET: int
NUM_FIELDS: int
OWNER_OFFSET: int
OWNER_PID_BITS: int
RECORD_SIZE: int
RECORD_STATUS_OFFSET: int

def slot_owner(mapping: mmap, offset: int) -> int: ...
def claim_slot(mapping: mmap, offset: int, expected: int, new: int) -> bool: ...

class SlotWriter:
    rank: int
    node_id: int
    pid: int
    publish_seq: int
    @property
    def slot_address(self) -> int: ...
    @property
    def sequence(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def _release(self) -> None: ...
    def retire(self) -> None: ...
    def __init__(self, mapping: mmap, offset: int, rank: int, node_id: int, pid: int) -> None: ...
    def publish(self, snapshot: LoadSnapshot, detail: np.ndarray | bytes | None = None, /) -> None: ...
    def publish_values(
        self,
        num_running_reqs: int,
        num_waiting_reqs: int,
        num_used_tokens: int,
        num_total_tokens: int,
        num_active_tokens: int,
        max_total_num_tokens: int,
        num_received_reqs: int,
        /,
    ) -> None: ...
    def publish_relayed(self, snapshot: Sequence[int]) -> None: ...
    def _publish_paused(self, snapshot: LoadSnapshot, seconds: float, /) -> None: ...

class BoardView:
    stale_after_ns: int
    max_retries: int
    @property
    def n_slots(self) -> int: ...
    def __init__(
        self,
        mapping: mmap,
        offset: int,
        n_slots: int,
        snapshot_type: type[LoadSnapshot],
        statuses: tuple[SlotStatus, ...],
        out: np.ndarray | None,
        stale_after_ns: int,
        max_retries: int,
    ) -> None: ...
    def read(self, rank: int, /) -> LoadSnapshot | None: ...
    def read_with_status(self, rank: int, /) -> tuple[SlotStatus, LoadSnapshot | None]: ...
    def status(self, rank: int, /) -> SlotStatus: ...
    def read_all(self) -> list[LoadSnapshot | None]: ...
    def read_array(self, out: np.ndarray | None = None) -> np.ndarray: ...
    def read_detailed(self, rank: int, /) -> tuple[SlotStatus, LoadSnapshot | None, bytes | None]: ...
    def read_detailed_array(self, out: np.ndarray, /) -> np.ndarray: ...

def read_rows(
    mapping: mmap | bytes | memoryview,
    offset: int,
    row_size: int,
    rows: int,
    out: np.ndarray | bytearray,
    whole: np.ndarray | bytearray | None,
    max_retries: int,
    /,
) -> int: ...

class SeqRow:
    """One seqlocked row of a side record (dpb_seqlock.h): begin(), the stores, end()."""

    def __init__(self, mapping: mmap, offset: int, size: int) -> None: ...
    @property
    def sequence(self) -> int: ...
    def begin(self) -> None: ...
    def end(self) -> None: ...
    def add(self, word: int, a: int, b: int, /) -> None: ...
    def release(self) -> None: ...
