"""Reference cases of the load formula and the GPU-direct publish, shared by the three paths that run
``dpboard/loads/formula.py``: the CPU (Python), the CUDA C of kernels/dpboard_loads.h (compiled for the
host) and numba-cuda (in the simulator). A case is the raw counters, the table size, the slot and
status words before the publish and the host's values; ``run_cpu`` gives the words after it.

One result is a list of ints: the six figures, has_errors, the DIRECT_SLOT_WORDS slot words and the
DIRECT_STATUS_WORDS status words after ``publish_raw`` (the same order in every path).
"""

from __future__ import annotations

from typing import NamedTuple

from dpboard.snapshot import DIRECT_SLOT_WORDS, DIRECT_STATUS_WORDS, FIELD_INDEX, FIELDS_OFFSET, RAW_FIELDS


class Case(NamedTuple):
    name: str
    raw: tuple[int, ...]  # RAW_FIELDS order
    num_pages: int
    page_size: int
    seq: int = 0  # the slot's sequence word before the publish
    publish_seq: int = 0  # the slot's publish_seq before
    host: tuple[int, ...] = (3, 77, 1_700_000_000_123_456_789, 5_555_000, 4242, 2, 9)
    # dp_rank, num_received_reqs, timestamp_ns, monotonic_ns, writer_pid, node_id, launch_id


HOST_NAMES = ("dp_rank", "num_received_reqs", "timestamp_ns", "monotonic_ns", "writer_pid", "node_id", "launch_id")
NUM_FIGURES = 6


def _raw(running=0, waiting=0, without_kv=0, awaiting=0, free=0, evictable=0, bad_req=0, bad_page=0, bad_len=0):
    return (running, waiting, without_kv, awaiting, free, evictable, bad_req, bad_page, bad_len)


assert len(_raw()) == len(RAW_FIELDS)

CASES = [
    Case("typical", _raw(5, 7, 10_000, 300, 100, 20), 1000, 16),
    Case("active clamped at zero", _raw(0, 3, 0, 5000, 10), 10, 1),
    Case("no pages", _raw(running=1), 0, 64),
    Case("every page free or evictable", _raw(2, 2, 4096, 4096, 60, 4), 64, 64, seq=8, publish_seq=4),
    Case("near the int64 bound", _raw(2**31, 2**31 - 1, 2**52, 2**51), 2**31 - 1, 2**31, seq=2**40, publish_seq=2**40),
    Case("more pages counted free than exist (arithmetic alone)", _raw(free=30, evictable=5), 10, 32),
    Case("slot left odd by a dead writer", _raw(1, 1, 1000, 0, 3, 0), 8, 16, seq=41, publish_seq=9),
    Case("negative publish_seq in the slot", _raw(4, 0, 0, 0, 1), 4, 2, seq=6, publish_seq=-5),
    Case("bad request states", _raw(5, 7, 10_000, 300, 100, 20, bad_req=3), 1000, 16, seq=10, publish_seq=5),
    Case("bad page states", _raw(1, 1, 1, 1, 1, 1, bad_page=1), 4, 4, seq=2, publish_seq=1),
    Case("bad seqlens", _raw(running=1, bad_len=4), 2, 16),
]

# Figures worked out by hand for the first cases (num_running, num_waiting, used, total, active, max).
GOLDEN = {
    "typical": (5, 7, (1000 - 120) * 16, (1000 - 120) * 16 + 10_000, (1000 - 120) * 16 + 10_000 - 300, 16_000),
    "active clamped at zero": (0, 3, 0, 0, 0, 10),
    "no pages": (1, 0, 0, 0, 0, 0),
    "every page free or evictable": (2, 2, 0, 4096, 0, 4096),
}

W0 = FIELDS_OFFSET // 8


def slot_before(case: Case) -> list[int]:
    """The slot's words before the publish: junk everywhere a kernel must overwrite or leave alone
    (the owner and reserved words), the case's sequence and publish_seq."""
    words = [1000 + k for k in range(DIRECT_SLOT_WORDS)]
    words[0] = case.seq
    words[W0 + FIELD_INDEX["publish_seq"]] = case.publish_seq
    return words


def status_before() -> list[int]:
    return [-1] * DIRECT_STATUS_WORDS


def encode(case: Case) -> list[int]:
    """A case as the numbers the C program reads: raw, num_pages, page_size, slot, status, host."""
    return [*case.raw, case.num_pages, case.page_size, *slot_before(case), *status_before(), *case.host]


def run_cpu(case: Case) -> list[int]:
    """The CPU path: finish_raw and raw_has_errors (counters.py), then formula.publish_raw on lists
    with the host's primitives."""
    from dpboard.loads import formula
    from dpboard.loads.counters import finish_raw, raw_has_errors

    figures = list(finish_raw(list(case.raw), case.num_pages, case.page_size))
    slot, status = slot_before(case), status_before()
    formula.publish_raw(list(case.raw), case.num_pages, case.page_size, slot, status, *case.host)
    return [*figures, int(raw_has_errors(list(case.raw))), *slot, *status]
