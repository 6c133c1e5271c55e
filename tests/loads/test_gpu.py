"""The CUDA backends and GPU-direct publish on a real GPU (skipped where there is none).

tools/gpu_check.sh runs this file on a GPU machine; with DPBOARD_GPU_CHECK_OUT set, the
GPU-direct check also writes its reader's counts there as JSON.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpboard import Board, LoadPublisher, compute_loads
from tests.support.kv_tables import step_tables
from tests.support.procutil import kill

ROOT = Path(__file__).resolve().parents[2]


def gpu_backends() -> list[str]:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return []
    from dpboard.loads import cuda as loads_cuda

    found = []
    try:
        from numba import cuda

        if cuda.is_available():
            found.append("numba-cuda")
    except Exception:  # numba-cuda missing or broken
        pass
    if loads_cuda.cupy_available():
        found.append("cupy")
    return found


BACKENDS = gpu_backends()
pytestmark = pytest.mark.skipif(not BACKENDS, reason="no CUDA GPU here (tools/gpu_check.sh runs these on one)")


def device(tables, backend):
    if backend == "cupy":
        import cupy

        return tuple(cupy.asarray(t) for t in tables)
    from numba import cuda

    return tuple(cuda.to_device(t) for t in tables)


@pytest.mark.parametrize("backend", BACKENDS or ["none"])
@pytest.mark.parametrize("n_req,n_pages", [(0, 0), (1, 1), (256, 65536), (4096, 1 << 20), (16384, 1 << 20)])
@pytest.mark.parametrize("dtypes", [(np.int8, np.int32, np.int8), (np.int32, np.int64, np.uint8)])
def test_gpu_backend_equals_reference(backend, n_req, n_pages, dtypes):
    rng = np.random.default_rng(n_req + n_pages)
    tables = (rng.integers(0, 7, n_req).astype(dtypes[0]),
              rng.integers(2**31 - 5000, 2**31 - 1, n_req).astype(dtypes[1]),
              rng.integers(0, 3, n_pages).astype(dtypes[2]))
    expected = compute_loads(*tables, page_size=64, backend="numpy")
    for _ in range(3):  # the accumulators must come back to zero after every launch
        assert compute_loads(*device(tables, backend), page_size=64, backend=backend) == expected
    assert compute_loads(*device(tables, backend), page_size=64, backend="auto") == expected
    bad = list(tables)
    if n_pages:
        bad[2] = bad[2].copy()
        bad[2][n_pages // 2] = 7
        with pytest.raises(ValueError, match="outside PageState"):
            compute_loads(*device(bad, backend), page_size=64, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS or ["none"])
def test_gpu_direct_publish_with_a_concurrent_reader(backend, board_name):
    page_size, num_pages, steps = 16, 4096, 20000
    reader = ROOT / "tests" / "loads" / "cudasim" / "reader_proc.py"
    with Board.create(board_name, n_slots=2) as board:
        tables = [device(step_tables(k % 30 + 1, n_pages=num_pages), backend) for k in range(30)]
        current = [tables[0]]
        publisher = LoadPublisher(board, 1, lambda: current[0], page_size=page_size, backend=backend,
                                  gpu_direct=True)
        last_k = steps % 30 or 30
        proc = subprocess.Popen([sys.executable, str(reader), board_name, "1", str(page_size), str(num_pages),
                                 "1000000", "30"], stdout=subprocess.PIPE, text=True)
        try:
            # publish only once the reader is reading (and will answer SIGTERM with its counts)
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready and proc.stdout.readline().strip() == "ready", "the reader process did not start"
            for k in range(1, steps + 1):
                current[0] = tables[(k - 1) % 30]  # the scheduler's tables change every step
                publisher.step(num_received_reqs=(k - 1) % 30 + 1)
            publisher.synchronize()
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
        finally:
            kill(proc)
        final = board.reader().read(1)
        publisher.close()
    assert final.publish_seq == steps and final.num_running_reqs == last_k
    result = {"backend": backend, "steps": steps, "final_publish_seq": final.publish_seq, "reader": out.strip()}
    target = os.environ.get("DPBOARD_GPU_CHECK_OUT")
    if target:
        Path(target, f"gpu_direct_{backend}.json").write_text(json.dumps(result, indent=1))
    counts = json.loads(out)
    assert counts["whole"] > 0  # the reader did read the slot while it was being published
    assert counts["inconsistent"] == 0 and counts["seq_backwards"] == 0, counts
