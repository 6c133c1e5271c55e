"""The numba-cuda kernels in Numba's CUDA simulator: results against the NumPy reference, and the
GPU-direct publish writing a real board slot (the seqlock logic; GPU memory ordering needs a GPU)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpboard import Board, LoadSnapshot, PageState, ReqState, compute_loads
from dpboard.loads import cuda as kc
from dpboard.publish import gpu_direct
from dpboard.snapshot import LoadDetail
from tests.support.procutil import kill

assert kc.simulator_enabled(), "run with NUMBA_ENABLE_CUDASIM=1"


def random_tables(seed, n_req, n_pages, seqlen_dtype=np.int64, huge=False):
    rng = np.random.default_rng(seed)
    low, high = (2**31 - 100, 2**31 - 1) if huge else (0, 5000)
    return (
        rng.integers(0, 7, n_req).astype(np.int8),
        rng.integers(low, high, n_req, endpoint=True).astype(seqlen_dtype),
        rng.integers(0, 3, n_pages).astype(np.uint8),
    )


@pytest.mark.parametrize(
    "n_req,n_pages,seqlen_dtype,huge",
    [(0, 0, np.int32, False), (1, 1, np.int32, False), (37, 5, np.int64, False), (5, 200, np.int32, True),
     (150, 90, np.int64, True)],
)
def test_raw_kernel_equals_reference(n_req, n_pages, seqlen_dtype, huge):
    tables = random_tables(n_req * 1000 + n_pages, n_req, n_pages, seqlen_dtype, huge)
    for page_size in (1, 64):
        expected = compute_loads(*tables, page_size=page_size, backend="numpy")
        assert compute_loads(*tables, page_size=page_size, backend="numba-cuda") == expected


def test_raw_kernel_every_state_and_bad_codes():
    S = ReqState
    state = np.array(list(S), np.int32)
    seqlen = np.array([-1, 10, 100, 1000, 10_000, 100_000, 1_000_000], np.int32)
    pages = np.array([0, 1, 1, 2, 1], np.int8)
    got = compute_loads(state, seqlen, pages, page_size=16, backend="numba-cuda")
    assert got == compute_loads(state, seqlen, pages, page_size=16, backend="numpy")
    assert got.num_waiting_reqs == 5
    with pytest.raises(ValueError, match=r"req_state\[2\] = 9"):
        compute_loads(np.array([1, 2, 9], np.int8), np.ones(3, np.int32), pages, page_size=1, backend="numba-cuda")
    with pytest.raises(ValueError, match=r"page_state\[1\] = 3"):
        compute_loads(state, seqlen, np.array([0, 3], np.int8), page_size=1, backend="numba-cuda")
    # The accumulators were reset by the failed launches' last blocks: the next result is right.
    assert compute_loads(state, seqlen, pages, page_size=16, backend="numba-cuda") == got


def step_tables(k, n_rows=40, n_pages=30):
    """Publish k: k RUNNING and k WAITING rows of 1000 tokens, k USED pages."""
    state = np.zeros(n_rows, np.int8)
    state[:k] = ReqState.RUNNING
    state[k : 2 * k] = ReqState.WAITING
    seqlen = np.full(n_rows, 1000, np.int32)
    pages = np.full(n_pages, PageState.FREE, np.int8)
    pages[:k] = PageState.USED
    return state, seqlen, pages


def test_gpu_direct_publish_writes_a_whole_snapshot(board_name):
    name = board_name
    with Board.create(name, n_slots=4, node_id=3) as board:
        writer = board.writer(2)
        # publish_seq 1 by the host, with a detail that a kernel's publish must clear
        writer.publish_detailed(LoadSnapshot(dp_rank=2, num_running_reqs=1), LoadDetail(timestamp=1.0))
        assert board.reader().read_detail(2)[2] == LoadDetail(timestamp=1.0)
        pub = gpu_direct.NumbaDirectPublisher(writer, page_size=16, node_id=3)
        tables = step_tables(4)
        pub.publish(*tables, num_received_reqs=77)
        pub.synchronize()
        snap = board.reader().read(2)
        expected = compute_loads(*tables, page_size=16, backend="numpy")
        assert snap[1:7] == tuple(expected)
        assert (snap.dp_rank, snap.num_received_reqs, snap.publish_seq, snap.writer_pid, snap.node_id) == (
            2, 77, 2, os.getpid(), 3)
        assert pub.poll()["published"] == 1 and pub.poll()["publish_seq"] == 2
        assert board.reader().read_detail(2)[2] is None
        seq_before = gpu_direct.slot_view(writer.slot_address)[0]
        assert seq_before % 2 == 0

        # Bad tables: nothing published, and the host hears about it without waiting.
        state, seqlen, pages = step_tables(5)
        state[3] = 42
        pub.publish(state, seqlen, pages, num_received_reqs=78)
        with pytest.raises(ValueError, match="published nothing"):
            pub.synchronize()
        assert board.reader().read(2) == snap
        assert gpu_direct.slot_view(writer.slot_address)[0] == seq_before

        # A slot left odd (a writer died mid-write) is repaired by the next publish.
        gpu_direct.slot_view(writer.slot_address)[0] = seq_before + 1
        assert board.reader(max_retries=4).read(2) is None
        pub.publish(*step_tables(6), num_received_reqs=79)
        pub.synchronize()
        repaired = board.reader().read(2)
        assert repaired.num_running_reqs == 6 and repaired.publish_seq == 3
        assert gpu_direct.slot_view(writer.slot_address)[0] == seq_before + 4  # odd 5 -> 6, then 7, 8
        pub.close()


def test_gpu_direct_publish_with_a_concurrent_reader(board_name):
    name = board_name
    page_size, num_pages, steps = 16, 30, 12
    reader_script = Path(__file__).with_name("reader_proc.py")
    with Board.create(name, n_slots=2) as board:
        pub = gpu_direct.NumbaDirectPublisher(board.writer(1), page_size=page_size)
        proc = subprocess.Popen(
            [sys.executable, str(reader_script), name, "1", str(page_size), str(num_pages), str(steps), "120"],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            # Publish only once the reader is attached and reading, so that the two overlap.
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, "the reader process never said it was ready"
            first = proc.stdout.readline()
            for k in range(1, steps + 1):
                pub.publish(*step_tables(k, n_pages=num_pages), num_received_reqs=k)
            pub.synchronize()
            out, _ = proc.communicate(timeout=120)
            out = first + out
        finally:
            kill(proc)
        pub.close()
    lines = out.splitlines()
    assert lines[0] == "ready", out
    counts = json.loads(lines[-1])
    assert counts["max_k"] == steps  # it saw the last publish
    assert counts["whole"] > 0
    assert counts["inconsistent"] == 0 and counts["seq_backwards"] == 0, counts


@pytest.mark.parametrize(("states", "seqlens"), [
    ([ReqState.WAITING] * 4, [2**62] * 4),  # their sum used to wrap, and num_total_tokens to be wrong
    ([ReqState.PREALLOC, ReqState.TRANSFER], [2**63 - 1, 2**63 - 1]),
    ([ReqState.RUNNING, ReqState.WAITING], [-1, 10]),
    ([ReqState.WAITING], [2**32 + 1]),
])
def test_seqlens_that_would_overflow_are_refused_as_on_the_cpu(states, seqlens):
    from dpboard.loads.reference import raw_counts_numpy

    state = np.array(states, np.int8)
    seqlen = np.array(seqlens, np.int64)
    pages = np.array([1, 1], np.int8)
    with pytest.raises(ValueError, match=r"outside \[0, 4294967296\]"):
        compute_loads(state, seqlen, pages, page_size=16, backend="numba-cuda")
    raw = kc.runner("numba-cuda").raw_counts(state, seqlen, pages)
    assert raw.tolist() == raw_counts_numpy(state, seqlen, pages).tolist()


def test_gpu_direct_publishes_nothing_for_seqlens_that_would_overflow(board_name):
    with Board.create(board_name, n_slots=1) as board:
        writer = board.writer(0)
        pub = gpu_direct.NumbaDirectPublisher(writer, page_size=16)
        pub.publish(np.full(4, ReqState.WAITING, np.int8), np.full(4, 2**62, np.int64), np.ones(2, np.int8), 0)
        with pytest.raises(ValueError, match=r"4 seqlen\(s\) outside \[0, 2\*\*32\]"):
            pub.synchronize()
        assert board.reader().read(0) is None  # nothing was published


def test_a_numba_cuda_that_cannot_compile_is_unavailable_and_names_the_fix(monkeypatch):
    """numba-cuda 0.30 on numpy 2.5 fails inside its compiler; dpboard says what to install."""
    import numba.cuda

    from dpboard.errors import UnavailableError
    from dpboard.loads import compute

    def jit_on_numpy_25(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(numba.cuda, "jit", jit_on_numpy_25)
    monkeypatch.setattr(kc, "_numba_kernels", {})
    monkeypatch.setattr(kc, "_runners", {})
    monkeypatch.setattr(compute, "_last_call", type(compute._last_call)())
    with pytest.raises(UnavailableError, match=r"row_stack.*pip install 'numpy<2\.5'.*backend='cupy'"):
        compute_loads(*random_tables(1, 5, 5), page_size=16, backend="numba-cuda")

    class KernelOnNumpy25:  # numba-cuda's dispatcher failing where it compiles: at specialisation
        def specialize(self, *args):
            raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    with pytest.raises(UnavailableError, match=r"numpy<2\.5"):
        kc.specialize(KernelOnNumpy25(), ())


def test_bindings_are_reused_and_moving_tables_rebind(board_name):
    from dpboard import LoadPublisher

    sets = [random_tables(seed, 40, 70) for seed in range(3)]
    current = [sets[0]]
    with Board.create(board_name, n_slots=1) as board:
        pub = LoadPublisher(board, 0, lambda: current[0], page_size=4, backend="numba-cuda")
        first = pub._kernel
        assert pub.step() == compute_loads(*sets[0], page_size=4, backend="numpy")
        assert pub._kernel is first  # the same tables: the same prepared launch
        for t in sets[1:]:
            current[0] = t
            assert pub.step() == compute_loads(*t, page_size=4, backend="numpy")
        assert pub._kernel is not first
