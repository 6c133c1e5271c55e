"""LoadPublisher: compute from the tables and publish into a real board, seen by another process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dpboard
from dpboard import Board, LoadPublisher, PageState, ReqState, compute_loads

ROOT = Path(__file__).resolve().parents[2]
READ_SLOT = (
    "import json, sys; from dpboard import Board; "
    "s = Board.attach(sys.argv[1]).reader().read(int(sys.argv[2])); print(json.dumps(s and s._asdict()))"
)


def read_in_another_process(name: str, rank: int) -> dict | None:
    out = subprocess.run([sys.executable, "-c", READ_SLOT, name, str(rank)], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def make_tables(seed=0, n_req=512, n_pages=4096):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 7, n_req).astype(np.int8), rng.integers(1, 8000, n_req).astype(np.int32),
            rng.integers(0, 3, n_pages).astype(np.uint8))


def test_step_publishes_the_loads(board_name):
    tables = make_tables()
    with Board.create(board_name, n_slots=4) as board:
        publisher = LoadPublisher(board, 2, tables, page_size=16)
        assert publisher.backend == "numba"
        loads = publisher.step(num_received_reqs=123)
        assert loads == compute_loads(*tables, page_size=16, backend="numpy")
        seen = read_in_another_process(board_name, 2)
        assert seen is not None
        assert {k: seen[k] for k in loads._fields} == loads._asdict()
        assert (seen["dp_rank"], seen["num_received_reqs"], seen["publish_seq"]) == (2, 123, 1)

        # The tables are read in place: a change shows in the next step.
        tables[0][:] = ReqState.FREE
        tables[2][:] = PageState.USED
        loads = publisher.step(num_received_reqs=124)
        assert (loads.num_running_reqs, loads.num_waiting_reqs, loads.num_used_tokens) == (0, 0, 4096 * 16)
        assert board.reader().read(2).publish_seq == 2


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_bad_tables_publish_nothing(board_name, backend):
    state, seqlen, pages = make_tables()
    with Board.create(board_name, n_slots=1) as board:
        publisher = LoadPublisher(board, 0, (state, seqlen, pages), page_size=4, backend=backend)
        publisher.step(num_received_reqs=1)
        before = board.reader().read(0)
        pages[7] = 9
        with pytest.raises(ValueError, match=r"page_state\[7\] = 9.*nothing was published"):
            publisher.step(num_received_reqs=2)
        pages[7] = 0
        seqlen[3], state[3] = -1, ReqState.WAITING
        with pytest.raises(ValueError, match=r"req_seqlen\[3\] = -1"):
            publisher.step(num_received_reqs=2)
        assert board.reader().read(0) == before


def test_callable_tables_are_rechecked_when_they_change(board_name):
    current = {"tables": make_tables(1, 100, 64)}
    with Board.create(board_name, n_slots=1) as board:
        publisher = LoadPublisher(board, 0, lambda: current["tables"], page_size=2)
        first = publisher.step()
        current["tables"] = make_tables(2, 300, 640)  # the scheduler reallocated its tables
        second = publisher.step()
        assert second == compute_loads(*current["tables"], page_size=2, backend="numpy") != first
        current["tables"] = (np.zeros(3, np.int8), np.zeros(2, np.int32), np.zeros(1, np.int8))
        with pytest.raises(ValueError, match="req_state has 3 rows but req_seqlen has 2"):
            publisher.step()


def test_a_writer_can_be_given(board_name):
    with Board.create(board_name, n_slots=2, node_id=5) as board:
        writer = board.writer(1)
        publisher = LoadPublisher(writer, tables=make_tables(), page_size=1)
        publisher.step(num_received_reqs=9)
        snap = board.reader().read(1)
        assert (snap.dp_rank, snap.num_received_reqs, snap.node_id) == (1, 9, 5)
        with pytest.raises(ValueError, match="rank 0 does not match the writer's rank 1"):
            LoadPublisher(writer, 0, make_tables(), page_size=1)


def test_constructor_errors(board_name):
    with Board.create(board_name, n_slots=1) as board:
        with pytest.raises(ValueError, match="rank is required"):
            LoadPublisher(board, tables=make_tables(), page_size=1)
        with pytest.raises(ValueError, match="tables is required"):
            LoadPublisher(board, 0, page_size=1)
        with pytest.raises(ValueError, match="page_size must be a positive integer"):
            LoadPublisher(board, 0, make_tables(), page_size=0)
        with pytest.raises(ValueError, match="gpu_direct=True needs a CUDA backend"):
            LoadPublisher(board, 0, make_tables(), page_size=1, gpu_direct=True)
        with pytest.raises(ValueError, match="must be a dpboard Board or BoardWriter"):
            LoadPublisher("board", 0, make_tables(), page_size=1)


def test_lazy_exports():
    assert dpboard.LoadPublisher is LoadPublisher
    assert dpboard.KVLoads._fields == (
        "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens", "num_active_tokens",
        "max_total_num_tokens",
    )
