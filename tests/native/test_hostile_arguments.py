"""The C extensions given hostile arguments from Python: offsets near 2**63, sizes that overflow a
bounds check, a failed ``__init__`` on a live object, lists that change while they are read, arrays
of the wrong type. Each case runs in a child process of its own, so that a crash (a segfault, a
SIGBUS, a heap overflow caught by the allocator) shows as that child's death instead of the suite's;
every case must end in a Python exception that the child reports."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.names import ROOT

PRELUDE = """
import mmap, sys
import numpy as np
from dpboard.board import _seqlock
from dpboard.controller import _dispatch, _prefix
from dpboard.snapshot import SNAPSHOT_DTYPE, LoadSnapshot, SlotStatus
mapping = mmap.mmap(-1, 512 + 4 * 512)
statuses = tuple(SlotStatus)
out = np.zeros(4, SNAPSHOT_DTYPE)
def core_arrays(dtype, n=2):  # what ArgminCore reads of a DPBudget
    from types import SimpleNamespace
    return SimpleNamespace(total_tokens=np.zeros(n, dtype), total_requests=np.zeros(n, dtype),
                           candidate=np.ones(n, bool), routable=np.ones(n, bool), sent_reqs=np.zeros(n, dtype),
                           sent_tokens=np.zeros(n, dtype), ring=np.zeros(n * 4, dtype))
def raised(call):
    try:
        call()
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
    return "nothing"
"""

CASES = {
    "writer offset near 2**63": ("print(raised(lambda: _seqlock.SlotWriter(mapping, 2**63 - 512, 0, 0, 1)))",
                                 "ValueError: slot offset"),
    "slot_owner offset near 2**63": ("print(raised(lambda: _seqlock.slot_owner(mapping, 2**63 - 512)))",
                                     "ValueError: slot offset"),
    "claim_slot offset near 2**63": ("print(raised(lambda: _seqlock.claim_slot(mapping, 2**63 - 512, 0, 1)))",
                                     "ValueError: slot offset"),
    "view of 2**58 slots": (
        "print(raised(lambda: _seqlock.BoardView(mapping, 512, 2**58, LoadSnapshot, statuses, out, 10**9, 4)))",
        "ValueError: 288230376151711744 slots at offset 512 do not fit"),
    "writer re-initialised on a bad offset": ("""
w = _seqlock.SlotWriter(mapping, 512, 0, 0, 1)
print(raised(lambda: w.__init__(mapping, 2**40, 0, 0, 1)))
mapping.close()  # the writer's hold was released: the mapping may go
print(raised(lambda: w.publish_values(1, 2, 3, 4, 5, 6, 7)))
""", "closed: take a new one"),
    "view re-initialised on a bad size": ("""
v = _seqlock.BoardView(mapping, 512, 4, LoadSnapshot, statuses, out, 10**9, 4)
print(raised(lambda: v.__init__(mapping, 512, 10**6, LoadSnapshot, statuses, out, 10**9, 4)))
mapping.close()
print(raised(lambda: v.read(3)))
print(v.read_all())
""", "out of range"),
    "hash_token_blocks on a list its elements empty": ("""
class Shrinking:
    def __index__(self):
        ids.clear()
        return 7
ids = [1, Shrinking()] + list(range(4000))
print(raised(lambda: _prefix.hash_token_blocks(ids, 2)))
""", "ValueError: input_ids changed while it was read"),
    "pick_batch on a list a property empties": ("""
core = _dispatch.ArgminCore(core_arrays(np.int64))
class Req:
    routed_dp_rank = None
    @property
    def input_ids(self):
        reqs.clear()
        return [1, 2, 3]
reqs = [Req() for _ in range(3)] + [object() for _ in range(1000)]
print(raised(lambda: core.pick_batch(reqs)))
""", "input_ids"),
    # SeqRow and read_rows, the side records' seqlock (dpb_seqlock.h): words, offsets, sizes and row
    # counts near +-2**63, where a sum in a bounds check would wrap. add(2**63 - 1, ...) wrote 8 bytes
    # before the row: SIGSEGV.
    "SeqRow.add at word 2**63 - 1": ("""
import ctypes
# a row at the start of a page whose page before is PROT_NONE: a store before the row faults there
pages = mmap.mmap(-1, 2 * mmap.PAGESIZE)
guard = ctypes.addressof(ctypes.c_char.from_buffer(pages))
assert ctypes.CDLL(None, use_errno=True).mprotect(ctypes.c_void_p(guard), mmap.PAGESIZE, 0) == 0  # PROT_NONE
row = _seqlock.SeqRow(memoryview(pages)[mmap.PAGESIZE:], 0, 64)
print(raised(lambda: row.add(2**63 - 1, 1, 1)))
print(raised(lambda: row.add(2**63 - 2, 1, 1)))
""", "IndexError: word 9223372036854775807 and the next are not data words of this 8-word row: "
    "add(word, a, b) takes word in 1..6"),
    "SeqRow.add at words near -2**63 and past 2**63": ("""
row = _seqlock.SeqRow(mapping, 64, 64)
for word in (-2**63, -2**63 + 1, -1, 0, 7, 8):
    print(raised(lambda: row.add(word, 1, 1)))
print(raised(lambda: row.add(2**63, 1, 1)))
print(raised(lambda: row.add(-2**63 - 1, 1, 1)))
print(raised(lambda: row.add(1, 2**63, 0)))
row.add(1, 2**63 - 1, -2**63)  # the counters wrap as unsigned words: the row's own bytes only
print("added", row.sequence)
""", "OverflowError"),
    "SeqRow at offsets and sizes near 2**63": ("""
for offset, size in ((2**63 - 8, 64), (2**63 - 64, 64), (64, 2**63 - 8), (2**62, 2**62), (-2**63, 64),
                     (64, -2**63), (8, 8 * (2**60 - 1))):
    print(raised(lambda: _seqlock.SeqRow(mapping, offset, size)))
row = _seqlock.SeqRow(mapping, 64, 64)
print(raised(lambda: row.__init__(mapping, 2**63 - 8, 64)))  # a failed __init__ leaves no row
mapping.close()
print(raised(lambda: row.add(1, 1, 1)))
""", "ValueError: this row was released with its record"),
    "read_rows of offsets, sizes and counts near 2**63": ("""
rows_out = np.zeros(64, np.uint64)
whole = np.zeros(8, np.uint8)
for offset, size, rows in ((2**63 - 8, 64, 1), (64, 2**63 - 8, 1), (0, 2**62, 2), (0, 8, 2**63 - 1),
                           (0, 2**32, 2**31), (-2**63, 64, 1), (0, -2**63, 1), (0, 64, -2**63),
                           (8 * (2**59), 64, 2**59)):
    print(raised(lambda: _seqlock.read_rows(mapping, offset, size, rows, rows_out, whole, 4)))
print(raised(lambda: _seqlock.read_rows(mapping, 0, 64, 2**63, rows_out, whole, 4)))
print(raised(lambda: _seqlock.read_rows(mapping, 0, 64, 9, rows_out, whole, 4)))  # out holds 8 rows
print(raised(lambda: _seqlock.read_rows(mapping, 0, 64, 4, rows_out, whole, 2**63 - 1)))
print(raised(lambda: _seqlock.read_rows(mapping, 0, 64, 4, rows_out[:7], whole, 4)))
print("torn", _seqlock.read_rows(mapping, 0, 64, 4, rows_out, whole, 4))
""", "torn 0"),
    "ArgminCore given float64 arrays": ("""
print(raised(lambda: _dispatch.ArgminCore(core_arrays(np.float64))))
""", "total_tokens must be an array of int64, got format d"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_argument_is_an_exception_never_a_crash(case):
    body, words = CASES[case]
    child = subprocess.run([sys.executable, "-X", "dev", "-c", PRELUDE + textwrap.dedent(body)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, f"{case}: the child died ({child.returncode}): {child.stderr[-2000:]}"
    assert words in child.stdout, child.stdout
