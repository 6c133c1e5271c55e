"""The host side of the ``cupy`` backend and of GPU-direct publish with CuPy, against stand-ins for
CuPy 13 and CuPy 14 that have exactly those releases' ``cupy.cuda.runtime`` / ``driver`` names
(tests/support/fake_cupy.py): prepared launches, the names both releases have, clean-up of a failed
construction. The kernel itself is checked by nvcc (test_cuda_sources.py) and on a GPU (test_gpu.py).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from dpboard import Board, LoadPublisher, compute_loads
from dpboard.errors import UnavailableError
from dpboard.loads import compute as loads_compute
from dpboard.loads import cuda as loads_cuda
from dpboard.loads import launch
from dpboard.loads.reference import raw_counts_numpy
from dpboard.publish import gpu_direct
from tests.support.cupy_names import RUNTIME_NAMES
from tests.support.fake_cupy import FakeDeviceArray, fake_cupy
from tests.support.kv_tables import step_tables

VERSIONS = sorted(RUNTIME_NAMES)


@pytest.fixture(params=VERSIONS)
def gpu(request, monkeypatch):
    """A fake CuPy of each release in sys.modules, and dpboard's per-process CUDA caches emptied."""
    cupy, state = fake_cupy(request.param)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(loads_cuda, "_runners", {})
    monkeypatch.setattr(loads_compute, "_last_call", type(loads_compute._last_call)())
    yield state
    assert not gpu_direct._registered, "a page stayed registered"


def tables(seed=0, n_req=300, n_pages=5000, dtypes=(np.int8, np.int32, np.int8)):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 7, n_req).astype(dtypes[0]), rng.integers(0, 5000, n_req).astype(dtypes[1]),
            rng.integers(0, 3, n_pages).astype(dtypes[2]))


def on_device(t):
    return tuple(FakeDeviceArray(x) for x in t)


def test_both_releases_lack_the_names_the_old_code_used():
    """Facts from CuPy's sources that the backend is built around."""
    for names in RUNTIME_NAMES.values():
        assert "hostGetDevicePointer" not in names and "cudaHostRegisterMapped" not in names
        assert {"hostRegister", "pointerGetAttributes", "memcpyAsync", "streamCreateWithFlags"} <= names
    assert "streamGetFlags" in RUNTIME_NAMES["14.2.0"] and "streamGetFlags" not in RUNTIME_NAMES["13.6.0"]


def test_the_fake_runtime_has_only_its_release_names(gpu):
    rt = sys.modules["cupy"].cuda.runtime
    with pytest.raises(AttributeError):
        rt.hostGetDevicePointer  # noqa: B018
    with pytest.raises(AttributeError):
        rt.cudaHostRegisterMapped  # noqa: B018


@pytest.mark.parametrize("dtypes", [(np.int8, np.int32, np.int8), (np.int32, np.int64, np.uint8),
                                    (np.int64, np.int16, np.uint16)])
def test_compute_loads_cupy_equals_the_reference(gpu, dtypes):
    t = tables(1, dtypes=dtypes)
    dev = on_device(t)
    expected = compute_loads(*t, page_size=16, backend="numpy")
    assert compute_loads(*dev, page_size=16, backend="cupy") == expected
    reads = [x.interface_reads for x in dev]
    for _ in range(3):  # the same tables again: the cached binding, no __cuda_array_interface__ read
        assert compute_loads(*dev, page_size=16, backend="cupy") == expected
    assert [x.interface_reads for x in dev] == reads
    assert compute_loads(*dev, page_size=16, backend="auto") == expected
    assert gpu.calls["launchKernel"] == 5 and gpu.calls["memcpyAsync"] == 5
    streams = set(gpu.streams.values())
    assert streams == {launch.STREAM_NON_BLOCKING}


def test_bad_tables_name_the_entry(gpu):
    state, seqlen, pages = tables(2)
    pages[77] = 5
    with pytest.raises(ValueError, match=r"page_state\[77\] = 5"):
        compute_loads(*on_device((state, seqlen, pages)), page_size=16, backend="cupy")


def test_a_step_reads_no_array_interface_and_copies_nine_integers(gpu, board_name):
    t = tables(3)
    dev = on_device(t)
    expected = compute_loads(*t, page_size=16, backend="numpy")
    with Board.create(board_name, n_slots=2) as board:
        pub = LoadPublisher(board, 1, dev, page_size=16, backend="cupy")
        reads = [x.interface_reads for x in dev]
        before = gpu.calls.copy()
        for k in range(50):
            assert pub.step(num_received_reqs=k) == expected
        assert [x.interface_reads for x in dev] == reads  # bound once, at construction
        done = gpu.calls - before
        assert done == {"launchKernel": 50, "memcpyAsync": 50, "streamSynchronize": 50}
        snap = board.reader().read(1)
        assert snap[1:7] == tuple(expected) and snap.num_received_reqs == 49


def test_moving_tables_rebind(gpu, board_name):
    sets = [on_device(tables(seed)) for seed in range(3)]
    current = [sets[0]]
    with Board.create(board_name, n_slots=1) as board:
        pub = LoadPublisher(board, 0, lambda: current[0], page_size=8, backend="auto")
        assert pub.backend == "cupy"
        for seed, dev in enumerate(sets):
            current[0] = dev
            assert pub.step() == compute_loads(*tables(seed), page_size=8, backend="numpy")


def test_gpu_direct_publishes_through_the_registered_page(gpu, board_name):
    sets = [on_device(step_tables(k)) for k in (1, 2, 3)]
    current = [sets[0]]
    with Board.create(board_name, n_slots=2, node_id=5) as board:
        pub = LoadPublisher(board, 1, lambda: current[0], page_size=16, backend="cupy", gpu_direct=True)
        for k in range(1, 7):
            current[0] = sets[(k - 1) % 3]
            assert pub.step(num_received_reqs=k) is None
        pub.synchronize()
        snap = board.reader().read(1)
        expected = compute_loads(*step_tables(3), page_size=16, backend="numpy")
        assert snap[1:7] == tuple(expected)
        assert (snap.num_received_reqs, snap.publish_seq, snap.node_id) == (6, 6, 5)
        assert len(gpu.registered) == 1 and gpu.calls["memcpyAsync"] == 0  # nothing comes back
        # bad tables: the next step raises, nothing was published
        bad = step_tables(2)
        bad[0][5] = 9
        current[0] = on_device(bad)
        pub.step(num_received_reqs=7)
        with pytest.raises(ValueError, match="published nothing"):
            pub.step(num_received_reqs=8)
        assert board.reader().read(1).publish_seq == 6
        pub.close()
    assert not gpu.registered and not gpu.host_allocs and not gpu.streams


@pytest.mark.parametrize("failing", ["pointerGetAttributes", "hostAlloc", "streamCreateWithFlags"])
def test_a_failed_construction_undoes_the_registration(gpu, board_name, failing):
    with Board.create(board_name, n_slots=1) as board:
        writer = board.writer(0)
        gpu.fail_next.add(failing)
        with pytest.raises(RuntimeError, match="injected"):
            gpu_direct.CupyDirectPublisher(writer, page_size=16)
        assert not gpu.registered and not gpu.host_allocs and not gpu.streams
        # the same page registers again (it would raise "already registered" otherwise)
        pub = gpu_direct.CupyDirectPublisher(writer, page_size=16)
        pub.publish(*on_device(step_tables(2)), num_received_reqs=1)
        pub.synchronize()
        assert board.reader().read(0).num_running_reqs == 2
        pub.close()
        pub.close()  # idempotent
    assert not gpu.registered and not gpu.host_allocs and not gpu.streams


def test_publishers_left_open_are_closed_at_exit(gpu, board_name):
    with Board.create(board_name, n_slots=1) as board:
        pub = gpu_direct.CupyDirectPublisher(board.writer(0), page_size=16)
        assert pub in gpu_direct._open
        gpu_direct._close_open_publishers()  # what atexit runs
        assert not gpu.registered and not gpu.host_allocs and pub not in gpu_direct._open


def test_cupy_without_cupy_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    monkeypatch.setattr(loads_cuda, "_runners", {})
    with pytest.raises(UnavailableError, match=r"cuda13 or cuda12 extra"):
        compute_loads(*on_device(tables()), page_size=16, backend="cupy")


def test_the_raw_counters_of_the_fake_launch_are_the_references(gpu):
    t = tables(4, n_req=33, n_pages=1001)
    binding = loads_cuda.runner("cupy").prepare(*on_device(t))
    assert binding.raw_counts().tolist() == raw_counts_numpy(*t).tolist()
    assert binding.prepared.grid == 1  # 1001 int8 pages are 63 chunks: one block


def test_auto_takes_cupy_where_numba_cuda_cannot_run(gpu):
    t = tables(5)
    with pytest.raises(UnavailableError):  # no GPU for numba-cuda here (or a compiler it cannot use)
        compute_loads(*on_device(t), page_size=16, backend="numba-cuda")
    assert compute_loads(*on_device(t), page_size=16, backend="auto") == compute_loads(*t, page_size=16,
                                                                                       backend="numpy")
