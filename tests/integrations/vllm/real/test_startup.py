"""A DP = 4 deployment started by vLLM's own start-up code, for a dense and a MoE model.

One API-server process (tests/support/vllm_startup.py) asks vLLM for its client as ``AsyncLLM``
does; ``DPLBAsyncMPClient.__init__`` launches the DP coordinator and four engine-core processes
through ``CoreEngineProcManager``, each running ``EngineCoreProc.run_engine_core``, which for a dense
model reconfigures the engine as an independent DP = 1 rank (``EngineCoreProc``) and for a MoE model
keeps its DP fields (``DPEngineCoreProc``). Each engine core does vLLM's handshake with the API
server, runs ``EngineCore.__init__`` (KV-cache sizing, vLLM's real ``Scheduler``) and its busy loop,
where dpboard's plugin opens its slot.

Stand-ins (named in tests/support/vllm_startup.py, and only these): the model (a class registered
with vLLM's ``ModelRegistry`` and a ``config.json``, never run), the executor (a vLLM ``Executor``
with no workers, answering the RPCs of ``EngineCore.__init__``), ``DeviceConfig(device="cpu")``, and
torch (tests/support/vllm.py's stand-in package; ``Tensor``, ``nn.Module``, ``dtype``/``float16``,
``tensor``, ``distributed.TCPStore``, ``rendezvous``, ``Backend`` and ``DistNetworkError`` given a
working answer). The engines take no request: the stand-in executor runs no batch.

Before the fix, the dense deployment failed as users saw it: three engine cores died with
``BoardError: slot 0 ... held by the writer in live process`` (each read ``data_parallel_rank`` 0
and ``data_parallel_size`` 1), and the API server with ``BoardLayoutError: board has 1 slots, but 4
were expected``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from dpboard.board import Board
from dpboard.board.sent import SentRecord
from dpboard.snapshot import SlotStatus
from tests.support.names import ROOT
from tests.support.procutil import read_line, wait_until

DP = 4
pytestmark = pytest.mark.timeout(300)


def test_a_dense_engines_slot_survives_vllms_reconfigure():
    """What run_engine_core does to a dense engine's ParallelConfig (vLLM's own method), and the slot
    dpboard reads from it: its global rank and the launch's size, not rank 0 of 1."""
    from vllm.config import ParallelConfig

    from dpboard.errors import InvalidInputError
    from dpboard.integrations.vllm.settings import engine_slot

    for rank in range(DP):
        parallel = ParallelConfig(data_parallel_size=DP, data_parallel_size_local=DP)
        parallel.data_parallel_index = rank  # run_engine_core, core.py:1546
        parallel.reconfigure_for_independent_dp_rank()
        assert (parallel.data_parallel_size, parallel.data_parallel_rank) == (1, 0)
        assert engine_slot(parallel) == (rank, DP)
    moe = ParallelConfig(data_parallel_size=DP, data_parallel_rank=3)  # DPEngineCoreProc keeps its fields
    assert engine_slot(moe) == (3, DP)
    assert engine_slot(ParallelConfig()) == (0, 1)
    broken = ParallelConfig(data_parallel_size=DP)
    broken.data_parallel_index = DP
    with pytest.raises(InvalidInputError, match="DP rank 4 is outside its data_parallel_size 4"):
        engine_slot(broken)


def ask(proc: subprocess.Popen, command: dict) -> dict:
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()
    return json.loads(read_line(proc, timeout=60))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vllms_own_start_up_gives_four_live_slots_and_picks_across_them(board_name, moe):
    env = {**os.environ, "VLLM_PLUGINS": "dpboard", "DPBOARD_METHOD": "inflight_requests",
           "DPBOARD_VLLM_BOARD": board_name}
    with tempfile.TemporaryFile("w+") as logs:
        # its own session: the engine cores and the coordinator it starts are killed with it
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_startup", json.dumps({"moe": moe, "dp": DP})],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs, text=True, cwd=ROOT,
                                env=env, start_new_session=True)
        try:
            ready = json.loads(read_line(proc, timeout=240))
            assert ready.get("ready"), (ready, _tail(logs))
            assert ready["client"] == "DPLBAsyncMPClient" and ready["engines"] == list(range(DP))
            engine_pids = ready["engine_pids"]

            board = Board.attach(board_name)
            try:
                assert board.n_slots == DP
                reader = board.reader(stale_after=2.0)
                # every engine core's busy loop opened its own slot and keeps it live while idle
                assert wait_until(lambda: all(reader.status(r) is SlotStatus.LIVE for r in range(DP)), timeout=60), \
                    ([reader.status(r) for r in range(DP)], _tail(logs))
                records = reader.read_array()
                assert records["dp_rank"].tolist() == list(range(DP))
                assert records["writer_pid"].tolist() == engine_pids  # slot r: the process EngineCore_DP{r}
                assert (records["max_total_num_tokens"] > 0).all()  # from the engine's own KV cache
            finally:
                board.close()

            # the API server's picks through the board: the least in-flight engine each time, all four
            ranks = ask(proc, {"op": "pick", "n": 2 * DP})["ranks"]
            assert sorted(ranks) == sorted(list(range(DP)) * 2), ranks
            record = SentRecord.open(board_name, 1, DP)
            try:
                assert record.totals()[:, 0].tolist() == [2] * DP
            finally:
                record.close()

            proc.stdin.close()  # the API server shuts down: vLLM stops its engine cores
            assert proc.wait(timeout=60) == 0, _tail(logs)
            assert wait_until(lambda: not any(_alive(pid) for pid in engine_pids), timeout=30)
        finally:
            if proc.poll() is None or any(_alive(pid) for pid in locals().get("engine_pids", ())):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _tail(logs) -> str:
    logs.seek(0)
    return logs.read()[-4000:]
