"""The load formula and the GPU-direct publish, written once (docs/KERNELS.md, "One source").

Every function below runs on three paths:

- the CPU: ``finish_raw`` and ``raw_has_errors`` (counters.py) call ``load_figures`` and
  ``has_errors`` on Python ints;
- numba-cuda: ``dpboard.loads.cuda`` compiles these very functions as device functions, with the
  seqlock primitives (``seq_open``, ``seq_close``, ``fence_system``) bound to its own;
- CUDA C: ``tools/gen_layout.py`` translates them (``dpboard.loads.formula_c``) into
  ``kernels/dpboard_loads.h`` (``dpb_load_figures``, ``dpb_publish_raw``, ...), which
  ``kernels/loads.cu`` includes, with the primitives of ``kernels/dpb_seqlock_gpu.h``. The test suite
  fails when the committed header is stale (``python tools/gen_layout.py --check``).

So the functions keep to a subset of Python that all three read alike: int64 arithmetic (``+ - *
& //``), comparisons, ``and``/``or``/``not``, ``max`` of two ints, ``if`` without ``else``,
assignments to names and to array items, tuple results unpacked into names, calls of each other and
of the primitives. Arguments are annotated: ``int`` (int64), ``Counters`` (the raw counters, read
only) or ``Words`` (int64 words that the host reads: the board slot, the status block). Constants
are module-level ints made from ``dpboard.snapshot``; the C gets them as its ``DPB_*`` macros.

The primitives defined here are the host's stand-ins, plain stores with no fence, for running the
functions on NumPy arrays (the tests, the CuPy stand-in of the test suite). A real writer orders its
stores as ``dpboard/board/dpb_seqlock.h`` does: the odd sequence store [W0], a release fence [W1],
the data [WD], the even store as a release [W2] (the GPU's: ``kernels/dpb_seqlock_gpu.h`` and
``dpboard.loads.cuda``).
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence

from dpboard.snapshot import (
    DETAIL_OFFSET,
    DIRECT_STATUS_INDEX,
    FIELD_INDEX,
    FIELDS_OFFSET,
    RAW_INDEX,
    SEQ_OFFSET,
)

Counters = Sequence[int]  # the raw counters (dpboard.snapshot.RAW_FIELDS), read only
Words = MutableSequence[int]  # int64 words a host reads: a board slot from its start, the status block

# The functions below, callees first, and the primitives each GPU language binds its own way.
FUNCTIONS = ("load_figures", "has_errors", "write_slot", "publish_raw")
PRIMITIVES = ("seq_open", "seq_close", "fence_system")

# The raw counters, by index.
RUNNING = RAW_INDEX["running"]
WAITING = RAW_INDEX["waiting"]
SEQLEN_WITHOUT_KV = RAW_INDEX["seqlen_without_kv"]
SEQLEN_AWAITING_TRANSFER = RAW_INDEX["seqlen_awaiting_transfer"]
FREE_PAGES = RAW_INDEX["free_pages"]
EVICTABLE_PAGES = RAW_INDEX["evictable_pages"]
BAD_REQ_STATES = RAW_INDEX["bad_req_states"]
BAD_PAGE_STATES = RAW_INDEX["bad_page_states"]
BAD_SEQLENS = RAW_INDEX["bad_seqlens"]

# A board slot as int64 words: the sequence word, the LoadSnapshot fields, the detail flags word.
SEQ_WORD = SEQ_OFFSET // 8
W_DP_RANK = FIELDS_OFFSET // 8 + FIELD_INDEX["dp_rank"]
W_NUM_RUNNING_REQS = FIELDS_OFFSET // 8 + FIELD_INDEX["num_running_reqs"]
W_NUM_WAITING_REQS = FIELDS_OFFSET // 8 + FIELD_INDEX["num_waiting_reqs"]
W_NUM_USED_TOKENS = FIELDS_OFFSET // 8 + FIELD_INDEX["num_used_tokens"]
W_NUM_TOTAL_TOKENS = FIELDS_OFFSET // 8 + FIELD_INDEX["num_total_tokens"]
W_NUM_ACTIVE_TOKENS = FIELDS_OFFSET // 8 + FIELD_INDEX["num_active_tokens"]
W_MAX_TOTAL_NUM_TOKENS = FIELDS_OFFSET // 8 + FIELD_INDEX["max_total_num_tokens"]
W_NUM_RECEIVED_REQS = FIELDS_OFFSET // 8 + FIELD_INDEX["num_received_reqs"]
W_TIMESTAMP_NS = FIELDS_OFFSET // 8 + FIELD_INDEX["timestamp_ns"]
W_MONOTONIC_NS = FIELDS_OFFSET // 8 + FIELD_INDEX["monotonic_ns"]
W_PUBLISH_SEQ = FIELDS_OFFSET // 8 + FIELD_INDEX["publish_seq"]
W_WRITER_PID = FIELDS_OFFSET // 8 + FIELD_INDEX["writer_pid"]
W_NODE_ID = FIELDS_OFFSET // 8 + FIELD_INDEX["node_id"]
W_DETAIL_FLAGS = DETAIL_OFFSET // 8

# The GPU-direct status words (dpboard.snapshot.DIRECT_STATUS_FIELDS).
S_LAUNCH_ID = DIRECT_STATUS_INDEX["launch_id"]
S_PUBLISHED = DIRECT_STATUS_INDEX["published"]
S_BAD_REQ_STATES = DIRECT_STATUS_INDEX["bad_req_states"]
S_BAD_PAGE_STATES = DIRECT_STATUS_INDEX["bad_page_states"]
S_BAD_SEQLENS = DIRECT_STATUS_INDEX["bad_seqlens"]
S_PUBLISH_SEQ = DIRECT_STATUS_INDEX["publish_seq"]


def load_figures(raw: Counters, num_pages: int, page_size: int) -> tuple[int, int, int, int, int, int]:
    """The load formula: a snapshot's six figures from the raw counters, in KVLoads' order."""
    num_running_reqs = raw[RUNNING]
    num_waiting_reqs = raw[WAITING]
    num_used_tokens = (num_pages - raw[FREE_PAGES] - raw[EVICTABLE_PAGES]) * page_size
    num_total_tokens = num_used_tokens + raw[SEQLEN_WITHOUT_KV]
    num_active_tokens = max(0, num_total_tokens - raw[SEQLEN_AWAITING_TRANSFER])
    max_total_num_tokens = num_pages * page_size
    return (num_running_reqs, num_waiting_reqs, num_used_tokens, num_total_tokens, num_active_tokens,
            max_total_num_tokens)


def has_errors(raw: Counters) -> bool:
    """Whether the tables had bad entries: then nothing is published."""
    return raw[BAD_REQ_STATES] != 0 or raw[BAD_PAGE_STATES] != 0 or raw[BAD_SEQLENS] != 0


def write_slot(slot: Words, raw: Counters, num_pages: int, page_size: int, dp_rank: int, num_received_reqs: int,
               timestamp_ns: int, monotonic_ns: int, writer_pid: int, node_id: int) -> int:
    """The seqlocked write of a whole snapshot into a board slot by its only writer; returns its
    publish_seq (the slot's own count, continued). A kernel publishes no detail: its flags word is 0."""
    (num_running_reqs, num_waiting_reqs, num_used_tokens, num_total_tokens, num_active_tokens,
     max_total_num_tokens) = load_figures(raw, num_pages, page_size)
    seq = slot[SEQ_WORD]
    if seq & 1:  # left odd by a writer that died mid-write: step past it
        seq += 1
    publish_seq = max(0, slot[W_PUBLISH_SEQ]) + 1
    seq_open(slot, seq + 1)  # [W0] odd: a write is in progress, [W1]
    slot[W_DP_RANK] = dp_rank  # [WD] from here to W_DETAIL_FLAGS
    slot[W_NUM_RUNNING_REQS] = num_running_reqs
    slot[W_NUM_WAITING_REQS] = num_waiting_reqs
    slot[W_NUM_USED_TOKENS] = num_used_tokens
    slot[W_NUM_TOTAL_TOKENS] = num_total_tokens
    slot[W_NUM_ACTIVE_TOKENS] = num_active_tokens
    slot[W_MAX_TOTAL_NUM_TOKENS] = max_total_num_tokens
    slot[W_NUM_RECEIVED_REQS] = num_received_reqs
    slot[W_TIMESTAMP_NS] = timestamp_ns
    slot[W_MONOTONIC_NS] = monotonic_ns
    slot[W_PUBLISH_SEQ] = publish_seq
    slot[W_WRITER_PID] = writer_pid
    slot[W_NODE_ID] = node_id
    slot[W_DETAIL_FLAGS] = 0
    seq_close(slot, seq + 1)  # [W2] even: the snapshot is whole
    return publish_seq


def publish_raw(raw: Counters, num_pages: int, page_size: int, slot: Words, status: Words, dp_rank: int,
                num_received_reqs: int, timestamp_ns: int, monotonic_ns: int, writer_pid: int, node_id: int,
                launch_id: int) -> None:
    """What a GPU-direct publish does with the totals: the snapshot into the slot, unless the tables
    were bad, and the outcome into the status words, the launch id last (the host reads it first)."""
    status[S_BAD_REQ_STATES] = raw[BAD_REQ_STATES]
    status[S_BAD_PAGE_STATES] = raw[BAD_PAGE_STATES]
    status[S_BAD_SEQLENS] = raw[BAD_SEQLENS]
    if has_errors(raw):  # never publish numbers made from a broken table
        status[S_PUBLISHED] = 0
        fence_system()
        status[S_LAUNCH_ID] = launch_id
        return
    publish_seq = write_slot(slot, raw, num_pages, page_size, dp_rank, num_received_reqs, timestamp_ns,
                             monotonic_ns, writer_pid, node_id)
    status[S_PUBLISH_SEQ] = publish_seq
    status[S_PUBLISHED] = 1
    fence_system()
    status[S_LAUNCH_ID] = launch_id


# -- the host's primitives: stand-ins without fences (see the module's docstring) -------------------


def seq_open(slot: Words, odd: int) -> None:
    """The odd sequence store that opens a write, [W0] ([W1] follows it in a real writer)."""
    slot[SEQ_WORD] = odd


def seq_close(slot: Words, odd: int) -> None:
    """The even sequence store that closes the write opened with ``odd``, [W2] (a release in a real
    writer)."""
    slot[SEQ_WORD] = odd + 1


def fence_system() -> None:
    """A system-scope fence on a GPU; nothing for the host's stand-ins."""
