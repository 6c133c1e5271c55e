"""The leaf contract: a rank's snapshot, its byte layout, and every code the layers share.

Everything about bytes and codes is written here once: the board header and the slot layout, the
NumPy record that ``BoardReader.read_array`` fills, the slot statuses, the request and page state
codes of the load kernels, the kernels' raw counters and the GPU-direct status words. The C
extension and the CUDA source get the same facts from ``kernels/dpboard_layout.h``, which
``python -m dpboard.c_layout`` generates from this module (a test fails when it is stale), and the
board checks at import that the compiled extension agrees. docs/FORMAT.md describes the layout
byte by byte.

This module imports only the standard library at import; the NumPy records (``HEADER_DTYPE``,
``SNAPSHOT_DTYPE``, ``DETAIL_DTYPE``, ...) are built from the plain facts here when first asked for,
so that the commands that need no array (``dpboard ls``, ``info``, ``clean``) never load NumPy.
"""

from __future__ import annotations

import enum
import functools
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import numpy as np

LAYOUT_VERSION = 3
MAGIC = b"DPBOARD\x00"
MAX_INT64 = 2**63 - 1

# -- fixed records ------------------------------------------------------------------------------

_STRUCT_CODES = {"u1": "B", "<u4": "I", "<i4": "i", "<u8": "Q", "<i8": "q", "<f8": "d"}


class RecordLayout:
    """A fixed little-endian record given once as a NumPy-style spec (names, formats, offsets,
    itemsize): ``dtype`` (NumPy, built on first use, for arrays over a mapping) and ``struct`` /
    ``unpack`` (the standard library, for a plain read that needs no NumPy)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.names: tuple[str, ...] = tuple(spec["names"])
        fields = sorted(zip(spec["offsets"], spec["formats"], strict=True))
        fmt, at = "<", 0
        for offset, code in fields:
            fmt += "x" * (offset - at) + (f"{code[1:]}s" if code[0] == "S" else _STRUCT_CODES[code])
            at = offset + (int(code[1:]) if code[0] == "S" else struct.calcsize("<" + _STRUCT_CODES[code]))
        self.struct = struct.Struct(fmt + "x" * (spec["itemsize"] - at))
        self._order = [spec["names"][spec["offsets"].index(offset)] for offset, _ in fields]
        assert self.struct.size == spec["itemsize"], (self.struct.size, spec["itemsize"])

    @functools.cached_property
    def dtype(self) -> np.dtype:
        import numpy as np

        return np.dtype(self.spec)

    def unpack(self, buf: Any, offset: int = 0) -> dict[str, Any]:
        """The record at ``offset`` of ``buf`` as a dict of plain values."""
        return dict(zip(self._order, self.struct.unpack_from(buf, offset), strict=True))


# -- the board header -------------------------------------------------------------------------

HEADER_SIZE = 512
HEADER_LAYOUT = RecordLayout({
    "names": [
        "magic",
        "layout_version",
        "header_size",
        "n_slots",
        "slot_size",
        "creator_pid",
        "creation_time_ns",
        "generation",
        "name",
        "node_id",
        "creator_start_ticks",
    ],
    "formats": ["S8", "<u4", "<u4", "<u4", "<u4", "<i8", "<i8", "<u8", "S64", "<i8", "<u8"],
    "offsets": [0, 8, 12, 16, 20, 24, 32, 40, 48, 112, 120],
    "itemsize": 128,
})
# Bytes 128..255 of the header belong to the collector that writes relayed snapshots into this
# board (dpboard.multinode.collector): its pid and frame counters, written only by it.
# Bytes 256..511 are reserved and zero.
COLLECTOR_STATS_OFFSET = 128
COLLECTOR_STATS_FIELDS: tuple[str, ...] = (
    "collector_pid",  # 0: no collector has run on this board
    "collector_start_ticks",  # the collector's process start time, to tell a recycled pid
    "frames_ok",
    "snapshots_ok",
    "frames_bad",  # sum of the bad_* counters below
    "bad_magic",
    "bad_version",
    "bad_length",
    "bad_rank",
    "bad_identity",  # a frame for another board (name) than this one
    "bad_node",
    "last_frame_monotonic_ns",
    "bad_load",  # a negative load field (appended: the fields above keep their offsets)
    "bad_owner",  # a frame for a node id another connection or CURVE key speaks for (appended too)
)
COLLECTOR_STATS_SIZE = 8 * len(COLLECTOR_STATS_FIELDS)  # COLLECTOR_STATS_DTYPE: one <u8 per field
assert COLLECTOR_STATS_OFFSET + COLLECTOR_STATS_SIZE <= 256

# -- the slot ---------------------------------------------------------------------------------


class LoadSnapshot(NamedTuple):
    """The load of one DP rank, as published into its board slot.

    The first eight fields are the scheduler's; the writer stamps the last five itself
    (``timestamp_ns``, ``monotonic_ns``, ``publish_seq``, ``writer_pid``, ``node_id``), so a caller
    leaves them at 0. The field order is the slot's byte order.
    """

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    num_active_tokens: int = 0
    max_total_num_tokens: int = 0
    num_received_reqs: int = 0
    timestamp_ns: int = 0
    monotonic_ns: int = 0
    publish_seq: int = 0
    writer_pid: int = 0
    node_id: int = 0

    @property
    def token_usage(self) -> float:
        """Share of the KV capacity in use (0.0 when the capacity is unknown)."""
        return token_usage(self.num_used_tokens, self.max_total_num_tokens)

    @property
    def num_total_requests(self) -> int:
        return self.num_running_reqs + self.num_waiting_reqs


def token_usage(used: int, capacity: int) -> float:
    """``used / capacity``, the share of the KV cache in use; 0.0 when the capacity is unknown."""
    return used / capacity if capacity > 0 else 0.0


FIELD_NAMES: tuple[str, ...] = LoadSnapshot._fields
NUM_FIELDS = len(FIELD_NAMES)
FIELD_INDEX: dict[str, int] = {name: i for i, name in enumerate(FIELD_NAMES)}
LOAD_FIELDS: tuple[str, ...] = FIELD_NAMES[1:8]  # what a scheduler supplies besides its rank
STAMPED_FIELDS: tuple[str, ...] = FIELD_NAMES[8:]  # what the writer supplies

# A slot is four 128-byte lines: the dispatch line (the sequence, the fields above, the owner word)
# and the detail (below), all under the one sequence. Dispatch reads only the first line.
SLOT_SIZE = 512
SEQ_OFFSET = 0  # the seqlock sequence, first word of each slot
FIELDS_OFFSET = 8  # the snapshot's fields follow it, int64 each, in LoadSnapshot's order
# The slot's owner outside the seqlock, one 64-bit word stored at once: the pid of the process that
# holds the slot's writer in the low OWNER_PID_BITS bits (Linux pids are below 2**22), its start
# time in clock ticks since boot above them, so that a recycled pid is not taken for the owner.
OWNER_OFFSET = 112
OWNER_PID_BITS = 22
RESERVED_OFFSET = 120  # zero
DETAIL_OFFSET = 128  # the detail's words (DETAIL_DTYPE), its flags word first

assert FIELDS_OFFSET + 8 * NUM_FIELDS <= OWNER_OFFSET < RESERVED_OFFSET < DETAIL_OFFSET


def pack_owner(pid: int, start_ticks: int) -> int:
    """The owner word of a slot (0: nobody)."""
    if not 0 < pid < 1 << OWNER_PID_BITS:
        raise ValueError(f"pid {pid} does not fit the slot's owner word ({OWNER_PID_BITS} bits)")
    return (start_ticks << OWNER_PID_BITS | pid) & (2**64 - 1)


def unpack_owner(word: int) -> tuple[int, int]:
    """(pid, start_ticks) of an owner word; (0, 0) when nobody holds the slot."""
    return word & ((1 << OWNER_PID_BITS) - 1), word >> OWNER_PID_BITS


class SlotStatus(enum.IntEnum):
    """What a reader found in a slot. The integer values are the ``status`` column of read_array."""

    EMPTY = 0  # never written
    LIVE = 1  # a whole snapshot, published within the stale threshold
    STALE = 2  # a whole snapshot, but older than the stale threshold
    TORN = 3  # the sequence stayed odd through every retry: a writer died or stalls mid-write

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def has_snapshot(self) -> bool:
        """LIVE and STALE slots hold a whole snapshot; EMPTY and TORN ones hold none."""
        return self in (SlotStatus.LIVE, SlotStatus.STALE)

    def __str__(self) -> str:  # print(reader.status(r)) says "live", not "1"
        return self.label


# One record per slot: every snapshot field plus the reader's verdict, fields at the same offsets
# as in a slot minus the sequence word, so the C reader copies them in one run.
RECORD_SIZE = 112
RECORD_STATUS_OFFSET = 8 * NUM_FIELDS
_SNAPSHOT_SPEC: dict[str, Any] = {
    "names": [*FIELD_NAMES, "status"],
    "formats": ["<i8"] * NUM_FIELDS + ["u1"],
    "offsets": [8 * i for i in range(NUM_FIELDS)] + [RECORD_STATUS_OFFSET],
    "itemsize": RECORD_SIZE,
}


# -- the detail: what an engine reports beyond the dispatch fields --------------------------------
#
# Everything SGLang's LoadSnapshot carries that the fields above do not (its 17 scalars minus the
# dispatch ones, decode_moments and the five optional sections), under the slot's sequence, so a
# detailed read is as consistent as a dispatch read. Names are SGLang's. A slot published without a
# detail has flags 0 and reads back with detail None.

MAX_DECODE_MOMENTS = 8  # SGLang sends 6 cumulative sums; room for two more
DETAIL_MODE_BYTES = 8  # disaggregation.mode: "null", "prefill" or "decode" (UTF-8, NUL-padded)


class MemoryDetail(NamedTuple):
    weight_gb: float
    kv_cache_gb: float
    graph_gb: float
    token_capacity: int


class SpeculativeDetail(NamedTuple):
    accept_length: float
    accept_rate: float


class LoraDetail(NamedTuple):
    slots_used: int
    slots_total: int
    utilization: float


class DisaggregationDetail(NamedTuple):
    mode: str
    prefill_bootstrap_queue_reqs: int = 0
    prefill_inflight_queue_reqs: int = 0
    decode_prealloc_queue_reqs: int = 0
    decode_transfer_queue_reqs: int = 0
    decode_retracted_queue_reqs: int = 0
    kv_transfer_speed_gb_s: float = 0.0
    kv_transfer_latency_ms: float = 0.0


class QueueDetail(NamedTuple):
    waiting: int
    grammar: int
    paused: int
    retracted: int
    prealloc_ready: int


class LockstepDetail(NamedTuple):
    """How a rank steps, for dispatch (dpboard's, not SGLang's: its LoadSnapshot has no such section).

    Under DP attention (SGLang's ``--enable-dp-attention``, vLLM's MoE data parallelism) every rank
    of a group runs each forward together: one rank's prefill makes the step an extend step for all.
    """

    group_size: int = 1  # ranks that step together, this one included (1: it steps alone)
    chunk_tokens: int = 0  # prompt tokens one prefill step computes at most on this rank (SGLang's
    # --chunked-prefill-size after its division by the attention-DP size); 0: not known


class LoadDetail(NamedTuple):
    """A rank's load beyond the dispatch fields: the rest of SGLang's LoadSnapshot, field for field.

    ``timestamp`` is the engine's own wall-clock time (float seconds), kept as the engine wrote it;
    the slot's ``timestamp_ns`` is dpboard's. A section is None when the engine did not report it.
    """

    timestamp: float = 0.0
    num_waiting_uncached_tokens: int = 0
    num_prealloc_ready_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    utilization: float = 0.0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    decode_moments: tuple[float, ...] | None = None
    memory: MemoryDetail | None = None
    speculative: SpeculativeDetail | None = None
    lora: LoraDetail | None = None
    disaggregation: DisaggregationDetail | None = None
    queues: QueueDetail | None = None
    lockstep: LockstepDetail | None = None  # dpboard's own section, after SGLang's


# SGLang's sections, in its order
DETAIL_SECTIONS: dict[str, type[NamedTuple]] = {
    "memory": MemoryDetail,
    "speculative": SpeculativeDetail,
    "lora": LoraDetail,
    "disaggregation": DisaggregationDetail,
    "queues": QueueDetail,
}
# dpboard's own sections, after SGLang's (an SGLang snapshot carries none of them)
OWN_SECTIONS: dict[str, type[NamedTuple]] = {"lockstep": LockstepDetail}
ALL_SECTIONS: dict[str, type[NamedTuple]] = {**DETAIL_SECTIONS, **OWN_SECTIONS}
DETAIL_SCALARS: tuple[str, ...] = LoadDetail._fields[:10]
# flags: bit 0 = the slot holds a detail; bit 1 = decode_moments present; bits 2.. = the sections.
DETAIL_PRESENT = 1
DETAIL_FLAG: dict[str, int] = {
    name: 1 << (i + 1) for i, name in enumerate(("decode_moments", *ALL_SECTIONS))
}


def _columns(prefix: str, record: type[NamedTuple]) -> list[tuple[str, str]]:
    """DETAIL_DTYPE columns of a NamedTuple's int, float and str fields (from their annotations)."""
    formats = {"float": "<f8", "int": "<i8", "str": f"S{DETAIL_MODE_BYTES}"}
    # NamedTuple keeps the annotations as ForwardRefs here (postponed evaluation): compare their text.
    kinds = {f: getattr(a, "__forward_arg__", a) for f, a in record.__annotations__.items()}
    return [(prefix + f, formats[kinds[f]]) for f in record._fields if kinds[f] in formats]


_DETAIL_COLUMNS: list[tuple[Any, ...]] = (
    [("flags", "<u8")]
    + _columns("", LoadDetail)  # the scalars (the sections and decode_moments are not plain types)
    + [("decode_moments_count", "<i8"), ("decode_moments", "<f8", (MAX_DECODE_MOMENTS,))]
    + [col for name, section in ALL_SECTIONS.items() for col in _columns(f"{name}_", section)]
)
assert tuple(c[0] for c in _DETAIL_COLUMNS[1 : 1 + len(DETAIL_SCALARS)]) == DETAIL_SCALARS


def _column_size(column: tuple[Any, ...]) -> int:
    """Bytes of one packed column: "<i8", "<u8", "<f8" and "S<n>" formats, times its shape."""
    fmt = column[1]
    size = int(fmt[1:]) if fmt[0] == "S" else int(fmt[-1])
    for n in column[2] if len(column) > 2 else ():
        size *= n
    return size


DETAIL_SIZE = sum(_column_size(c) for c in _DETAIL_COLUMNS)  # DETAIL_DTYPE.itemsize (checked when built)
# where each column of the detail starts in its bytes (DETAIL_DTYPE's offsets): a plain read of a few
# of them (``BoardReader.read_detailed``'s bytes) needs no NumPy
DETAIL_FIELD_OFFSETS: dict[str, int] = {
    c[0]: sum(_column_size(b) for b in _DETAIL_COLUMNS[:i]) for i, c in enumerate(_DETAIL_COLUMNS)}
DETAIL_WORDS = DETAIL_SIZE // 8
assert DETAIL_SIZE % 8 == 0 and DETAIL_OFFSET + DETAIL_SIZE <= SLOT_SIZE
# What a GPU-direct kernel writes, as int64 words from the slot's start: the sequence, the fields,
# and the detail's flags word (0: a kernel publishes no detail).
DIRECT_SLOT_WORDS = DETAIL_OFFSET // 8 + 1



def pack_detail(detail: LoadDetail | None, out: np.ndarray | None = None) -> np.ndarray:
    """``detail`` as one DETAIL_DTYPE record (into ``out`` when given): what ``publish`` stores."""
    if out is None:
        import numpy as np

        out = np.zeros(1, _numpy_records()["DETAIL_DTYPE"])
    rec = out
    rec[0] = 0
    if detail is None:
        return rec
    flags = DETAIL_PRESENT
    for f in DETAIL_SCALARS:
        rec[f] = getattr(detail, f)
    if detail.decode_moments is not None:
        moments = tuple(detail.decode_moments)
        if len(moments) > MAX_DECODE_MOMENTS:
            raise ValueError(f"decode_moments has {len(moments)} values; a slot holds {MAX_DECODE_MOMENTS}")
        rec["decode_moments_count"] = len(moments)
        rec["decode_moments"][0, : len(moments)] = moments
        flags |= DETAIL_FLAG["decode_moments"]
    for name in ALL_SECTIONS:
        section = getattr(detail, name)
        if section is None:
            continue
        flags |= DETAIL_FLAG[name]
        for f, value in zip(section._fields, section, strict=True):
            if isinstance(value, str):
                raw = value.encode()
                if len(raw) > DETAIL_MODE_BYTES or b"\x00" in raw:
                    raise ValueError(f"{name}.{f} {value!r} does not fit the slot's {DETAIL_MODE_BYTES}-byte text")
                value = raw
            rec[f"{name}_{f}"] = value
    rec["flags"] = flags
    return rec


def moments_count(count: int) -> int | None:
    """How many decode_moments a detail that declares ``count`` of them holds: ``count`` itself
    within 0..MAX_DECODE_MOMENTS, else None (a malformed detail: its moments are unknown). The one
    rule of every reader (the SGLang plugin, ``serve``, ``unpack_detail``)."""
    return count if 0 <= count <= MAX_DECODE_MOMENTS else None


def unpack_detail(rec: np.void | np.ndarray) -> LoadDetail | None:
    """The LoadDetail of one DETAIL_DTYPE record (None when the slot holds none)."""
    flags = int(rec["flags"])
    if not flags & DETAIL_PRESENT:
        return None
    values: dict[str, object] = {f: rec[f].item() for f in DETAIL_SCALARS}
    count = moments_count(int(rec["decode_moments_count"]))
    if flags & DETAIL_FLAG["decode_moments"] and count is not None:
        values["decode_moments"] = tuple(float(v) for v in rec["decode_moments"][:count])
    for name, section in ALL_SECTIONS.items():
        if flags & DETAIL_FLAG[name]:
            items = [rec[f"{name}_{f}"].item() for f in section._fields]
            values[name] = section(*(v.decode() if isinstance(v, bytes) else v for v in items))
    return LoadDetail(**values)


def detail_problem(details: np.ndarray) -> str | None:
    """What makes any of these DETAIL_DTYPE records one ``unpack_detail`` cannot read back as the
    engine wrote it (a detail that came from elsewhere: a relay frame), or None when all are sound."""
    import numpy as np

    _PRESENT_BIT, _UNKNOWN_BITS, _MOMENTS_BIT, _DISAGGREGATION_BIT = _flag_words()
    flags = details["flags"]
    if not len(flags):
        return None
    if (flags & _UNKNOWN_BITS).any():
        return "has flag bits this version does not know: run the same dpboard version everywhere"
    if ((flags != 0) & ((flags & _PRESENT_BIT) == 0)).any():
        return "has section flags without its present bit"
    counts = details["decode_moments_count"]
    if (counts.astype(np.uint64) > MAX_DECODE_MOMENTS).any():  # a negative count wraps to a huge one
        if ((flags & _MOMENTS_BIT) != 0)[(counts < 0) | (counts > MAX_DECODE_MOMENTS)].any():
            return f"declares a decode_moments count outside 0..{MAX_DECODE_MOMENTS}"
    modes = details["disaggregation_mode"]
    if modes.astype(f"S{DETAIL_MODE_BYTES}").view(np.uint8).max() >= 0x80:  # ASCII is UTF-8
        for mode in modes[(flags & _DISAGGREGATION_BIT) != 0].tolist():
            try:
                mode.decode()
            except UnicodeDecodeError:
                return f"has a disaggregation mode {mode!r} that is not UTF-8"
    return None


def segment_size(n_slots: int) -> int:
    return HEADER_SIZE + n_slots * SLOT_SIZE


def slot_offset(rank: int) -> int:
    return HEADER_SIZE + rank * SLOT_SIZE


# -- the NumPy records, built from the facts above on first use ------------------------------------


@functools.cache
def _numpy_records() -> dict[str, Any]:
    import numpy as np

    header = HEADER_LAYOUT.dtype
    snapshot = np.dtype(_SNAPSHOT_SPEC)
    detail = np.dtype(_DETAIL_COLUMNS)
    assert detail.itemsize == DETAIL_SIZE, (detail.itemsize, DETAIL_SIZE)
    assert {name: detail.fields[name][1] for name in detail.names} == DETAIL_FIELD_OFFSETS
    stats = np.dtype([(f, "<u8") for f in COLLECTOR_STATS_FIELDS])
    assert stats.itemsize == COLLECTOR_STATS_SIZE
    return {
        "HEADER_DTYPE": header,
        "COLLECTOR_STATS_DTYPE": stats,
        "SNAPSHOT_DTYPE": snapshot,
        "DETAIL_DTYPE": detail,
        # read_detailed_array(): a read_array record followed by the slot's detail words, one consistent read
        "DETAILED_DTYPE": np.dtype({"names": ["load", "detail"], "formats": [snapshot, detail],
                                    "offsets": [0, RECORD_SIZE], "itemsize": RECORD_SIZE + DETAIL_SIZE}),
    }


@functools.cache
def _flag_words() -> tuple[Any, Any, Any, Any]:
    import numpy as np

    return (np.uint64(DETAIL_PRESENT), ~np.uint64(DETAIL_PRESENT | sum(DETAIL_FLAG.values())),
            np.uint64(DETAIL_FLAG["decode_moments"]), np.uint64(DETAIL_FLAG["disaggregation"]))


def __getattr__(name: str) -> Any:
    """``HEADER_DTYPE``, ``SNAPSHOT_DTYPE``, ... : NumPy is imported when one is first asked for."""
    if name in _NUMPY_RECORDS:
        value = _numpy_records()[name]
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_NUMPY_RECORDS = ("HEADER_DTYPE", "COLLECTOR_STATS_DTYPE", "SNAPSHOT_DTYPE", "DETAIL_DTYPE", "DETAILED_DTYPE")


# -- the load kernels' codes ------------------------------------------------------------------


class ReqState(enum.IntEnum):
    """State of one row of a scheduler's request table (``req_state``)."""

    FREE = 0  # empty row: not a request
    RUNNING = 1  # in the running batch; holds its KV
    WAITING = 2  # waiting queue; no KV yet
    BOOTSTRAP = 3  # PD prefill bootstrap queue; no KV yet
    PREALLOC = 4  # PD decode prealloc queue; no KV yet, and waits for a transfer
    TRANSFER = 5  # PD decode transfer queue; holds its KV, waits for the transfer to finish
    RETRACTED = 6  # retracted from the running batch; its KV was freed


class PageState(enum.IntEnum):
    """State of one KV page (``page_state``)."""

    FREE = 0
    USED = 1  # held by a request or a locked prefix
    EVICTABLE = 2  # cached prefix nobody references


# The longest sequence a request row may hold, in tokens. A row of a request (not FREE) with a seqlen
# outside [0, MAX_SEQLEN] is a bad table, counted by every backend in the same pass. With the number
# of rows bounded too (dpboard.loads.tables), no int64 sum of the kernels can overflow.
MAX_SEQLEN = 2**32

# The raw counters every load backend produces, in this order (the CUDA source indexes them alike).
RAW_FIELDS: tuple[str, ...] = (
    "running",  # #RUNNING
    "waiting",  # #WAITING + #BOOTSTRAP + #PREALLOC + #TRANSFER + #RETRACTED
    "seqlen_without_kv",  # sum of seqlen over WAITING, BOOTSTRAP, PREALLOC, RETRACTED
    "seqlen_awaiting_transfer",  # sum of seqlen over PREALLOC, TRANSFER
    "free_pages",
    "evictable_pages",
    "bad_req_states",  # codes outside ReqState
    "bad_page_states",  # codes outside PageState
    "bad_seqlens",  # seqlens outside [0, MAX_SEQLEN] in rows that are not FREE
)
NUM_RAW = len(RAW_FIELDS)
RAW_INDEX: dict[str, int] = {name: i for i, name in enumerate(RAW_FIELDS)}

# The words a GPU-direct publish kernel leaves in mapped host memory for the host to read later.
DIRECT_STATUS_FIELDS: tuple[str, ...] = (
    "launch_id",  # the launch these words describe (written last)
    "published",  # 1: the snapshot was published; 0: rejected (bad tables)
    "bad_req_states",
    "bad_page_states",
    "bad_seqlens",
    "publish_seq",
)
DIRECT_STATUS_WORDS = 8  # room for the fields above
DIRECT_STATUS_INDEX: dict[str, int] = {name: i for i, name in enumerate(DIRECT_STATUS_FIELDS)}
assert len(DIRECT_STATUS_FIELDS) <= DIRECT_STATUS_WORDS
