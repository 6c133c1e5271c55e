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
