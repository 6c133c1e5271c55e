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
with no workers, answering the RPCs of ``EngineCore.__init__`` and each scheduled batch with the
model's made-up output), ``DeviceConfig(device="cpu")``, and
torch (tests/support/vllm.py's stand-in package; ``Tensor``, ``nn.Module``, ``dtype``/``float16``,
``tensor``, ``distributed.TCPStore``, ``rendezvous``, ``Backend`` and ``DistNetworkError`` given a
working answer). The dense deployment serves requests end to end; the MoE one only picks, since its
engines' lockstep all-reduce needs torch.distributed.

Before the fix, the dense deployment failed as users saw it: three engine cores died with
``BoardError: slot 0 ... held by the writer in live process`` (each read ``data_parallel_rank`` 0
and ``data_parallel_size`` 1), and the API server with ``BoardLayoutError: board has 1 slots, but 4
were expected``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from dpboard.board import SEGMENT_PREFIX, SHM_DIR, Board
from dpboard.board.sent import SentRecord
from dpboard.snapshot import SlotStatus
from tests.support.names import ROOT, SESSION_FILES, new_board_name
from tests.support.procutil import read_line, stop, wait_until
from tests.support.session_server import free_port
from tests.support.vllm_startup import TOKEN

DP = 4
# The API servers' staleness threshold here: an idle engine core republishes every 0.25 s, and on a
# loaded 2-core machine one can go unscheduled past the 1 s default, which leaves its slot STALE and
# out of the picks. These tests are about which engines a server picks, not about a late heartbeat
# (tests/integrations/vllm/test_*.py test staleness), so a starved engine core must not change them.
STALE_AFTER = "30"
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


class ApiServer:
    """One ``python -m tests.support.vllm_startup`` process (an API server and the engine cores and DP
    coordinator vLLM starts for it), in a session of its own so that all of them are killed with it."""

    def __init__(self, spec: dict, env: dict[str, str]) -> None:
        self.logs = tempfile.TemporaryFile("w+")
        self.engine_pids: list[int] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_startup", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logs, text=True,
                                     cwd=ROOT, env={**os.environ, "VLLM_PLUGINS": "dpboard",
                                                                 "DPBOARD_STALE_AFTER": STALE_AFTER, **env},
                                     start_new_session=True)

    def ready(self) -> dict:
        ready = json.loads(read_line(self.proc, timeout=240))
        assert ready.get("ready"), (ready, self.tail())
        self.engine_pids = ready["engine_pids"]
        return ready

    def ask(self, command: dict, timeout: float = 60) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(read_line(self.proc, timeout=timeout))
        assert "error" not in answer, (answer, self.tail())
        return answer

    def close_stdin(self) -> None:
        self.proc.stdin.close()  # the API server shuts down: vLLM stops its engine cores

    def stopped(self) -> None:
        assert self.proc.wait(timeout=60) == 0, self.tail()
        assert wait_until(lambda: not any(_alive(pid) for pid in self.engine_pids), timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None or any(_alive(pid) for pid in self.engine_pids):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        self.logs.close()

    def tail(self) -> str:
        self.logs.seek(0)
        return self.logs.read()[-4000:]


def live_slots(name: str, ranks: list[int], server: ApiServer, dp: int = DP) -> np.ndarray:
    """Board ``name``'s records once the slots ``ranks`` are LIVE (the others must be EMPTY)."""
    # the first engine core creates the board when its busy loop first waits for work, which can
    # come after the handshake that let the API server report ready
    assert wait_until(lambda: (SHM_DIR / f"{SEGMENT_PREFIX}{name}").exists(), timeout=60), server.tail()
    board = Board.attach(name)
    try:
        assert board.n_slots == dp
        reader = board.reader(stale_after=2.0)
        # every engine core's busy loop opened its own slot and keeps it live while idle
        assert wait_until(lambda: all(reader.status(r) is SlotStatus.LIVE for r in ranks), timeout=60), \
            ([reader.status(r) for r in range(dp)], server.tail())
        assert [reader.status(r) for r in range(dp) if r not in ranks] == [SlotStatus.EMPTY] * (dp - len(ranks))
        return reader.read_array()
    finally:
        board.close()


def board_state(name: str) -> list[tuple[str, int, int, int]]:
    """Board ``name``'s slots as the API servers see them (a failed pick's context): each slot's
    status, running, waiting and received requests."""
    board = Board.attach(name)
    try:
        reader = board.reader(stale_after=float(STALE_AFTER))
        recs = reader.read_array()
        return [(reader.status(r).name, int(recs["num_running_reqs"][r]), int(recs["num_waiting_reqs"][r]),
                 int(recs["num_received_reqs"][r])) for r in range(board.n_slots)]
    finally:
        board.close()


def sent_totals(name: str) -> list[int]:
    board = Board.attach(name)
    try:
        record = SentRecord.open(name, 1, DP, generation=board.generation)
    finally:
        board.close()
    try:
        return record.totals()[:, 0].tolist()
    finally:
        record.close()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_vllms_own_start_up_gives_four_live_slots_and_picks_across_them(board_name, moe):
    server = ApiServer({"moe": moe, "dp": DP}, {"DPBOARD_METHOD": "inflight_requests", "DPBOARD_VLLM_BOARD": board_name})
    try:
        ready = server.ready()
        assert ready["client"] == "DPLBAsyncMPClient" and ready["engines"] == list(range(DP))
        records = live_slots(board_name, list(range(DP)), server)
        assert records["dp_rank"].tolist() == list(range(DP))
        assert records["writer_pid"].tolist() == server.engine_pids  # slot r: the process EngineCore_DP{r}
        assert (records["max_total_num_tokens"] > 0).all()  # from the engine's own KV cache
        # the API server's picks through the board: the least in-flight engine each time, all four
        if moe:
            # picks only: a MoE deployment's engines step in lockstep, through an all-reduce over their
            # DP group that the stand-in torch cannot do
            ranks = server.ask({"op": "pick", "n": 2 * DP})["ranks"]
        else:
            # requests sent as AsyncLLM sends them, run by the engines' real scheduler, all answered
            answer = server.ask({"op": "send", "n": 2 * DP, "tokens": 40, "max_tokens": 3}, timeout=180)
            ranks = answer["ranks"]
            assert answer["tokens"] == [[TOKEN] * 3] * (2 * DP)
            board = Board.attach(board_name)
            try:
                reader = board.reader(stale_after=2.0)

                def settled() -> bool:  # every request received at its engine, none left running or waiting
                    r = reader.read_array()
                    return (r["num_received_reqs"].tolist() == [2] * DP
                            and not r["num_running_reqs"].any()
                            and not r["num_waiting_reqs"].any())

                assert wait_until(settled, timeout=60), reader.read_array()
            finally:
                board.close()
        assert sorted(ranks) == sorted(list(range(DP)) * 2), (ranks, board_state(board_name))
        assert sent_totals(board_name) == [2] * DP  # with the received counts above: nothing in flight
        server.close_stdin()
        server.stopped()
    finally:
        server.kill()


@contextlib.contextmanager
def api_servers(*other_boards: str) -> Iterator[list[ApiServer]]:
    """The test's API servers (appended by the test): asked to stop all at once (stdin closed) and
    waited for once the test's body is through, killed however it ends; the files of the other
    nodes' boards removed, the board and its two records (the suite's leak check knows only ``board_name``)."""
    servers: list[ApiServer] = []
    try:
        yield servers
        for server in servers:
            server.close_stdin()
        for server in servers:
            server.stopped()
    finally:
        for server in servers:
            server.kill()
        for name in other_boards:  # a killed server leaves all three
            for kind in SESSION_FILES:
                (SHM_DIR / f"{kind}{name}").unlink(missing_ok=True)


def board_files(name: str) -> list[str]:
    """What of board ``name`` is in /dev/shm: the board, its sent record, its dispatch record."""
    return sorted(p.name for kind in SESSION_FILES for p in SHM_DIR.glob(f"{kind}{name}"))


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_sigterm_or_ctrl_c_leaves_no_board_sent_or_dispatch_record(board_name, how):
    """The way out of a served deployment: SIGTERM to the API server (``kill`` of ``vllm serve``), or
    SIGINT to every process of its group (Ctrl-C in its terminal). vLLM's own shutdown runs (the
    client's, whose engine manager stops the engine cores with SIGTERM; the engine cores' own signal
    handler and ``run_engine_core``'s way out), and nothing of the board is left in /dev/shm. Before
    the fix, the board, its sent record and its dispatch record all stayed (engine cores are forked,
    and a forked child runs no ``atexit``; nothing closed the API server's records)."""
    server = ApiServer({"moe": False, "dp": 2}, {"DPBOARD_METHOD": "inflight_requests", "DPBOARD_VLLM_BOARD": board_name})
    try:
        server.ready()
        live_slots(board_name, [0, 1], server, dp=2)
        answer = server.ask({"op": "send", "n": 4, "tokens": 40, "max_tokens": 3}, timeout=180)
        assert sorted(answer["ranks"]) == [0, 0, 1, 1]
        assert board_files(board_name) == [f"{kind}{board_name}" for kind in SESSION_FILES[::-1]]
        if how == "sigterm":
            server.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.proc.pid, signal.SIGINT)
        server.stopped()
        assert board_files(board_name) == [], server.tail()
    finally:
        server.kill()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hybrid_load_balancing_each_node_picks_its_engines_from_its_own_board(board_name, moe):
    """``--data-parallel-hybrid-lb`` on two "nodes" (one machine, a board name each, as boards are
    node-local): node 0 (ranks 0-1, the coordinator, the handshake with every engine) and node 1
    (``--data-parallel-start-rank 2``), over TCP on 127.0.0.1 as across machines."""
    boards = [board_name, new_board_name()]
    rpc_port = free_port()
    local = DP // 2
    with api_servers(boards[1]) as servers:
        for node, name in enumerate(boards):
            parallel = {"data_parallel_size_local": local, "data_parallel_rank": node * local,
                        "data_parallel_hybrid_lb": True, "data_parallel_master_ip": "127.0.0.1",
                        "data_parallel_rpc_port": rpc_port}
            servers.append(ApiServer({"moe": moe, "dp": DP, "parallel": parallel},
                                     {"DPBOARD_METHOD": "inflight_requests", "DPBOARD_VLLM_BOARD": name,
                                      "DPBOARD_VLLM_NODE_ID": str(node)}))
        for node, (name, server) in enumerate(zip(boards, servers, strict=True)):
            mine = list(range(node * local, (node + 1) * local))
            ready = server.ready()
            assert ready["client"] == "DPLBAsyncMPClient" and ready["engines"] == mine
            records = live_slots(name, mine, server)
            assert records["writer_pid"][mine].tolist() == server.engine_pids
            assert records["node_id"][mine].tolist() == [node] * local
            ranks = server.ask({"op": "pick", "n": 2 * local})["ranks"]
            assert sorted(ranks) == sorted(mine * 2), (ranks, board_state(name), server.tail())
            assert sent_totals(name) == [2 if r in mine else 0 for r in range(DP)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_several_nodes_headless_engines_reach_node0_through_the_relay(board_name, moe, tmp_path):
    """Internal load balancing over two "nodes": node 0's ``vllm serve`` (ranks 0-1, every API-server
    pick) and node 1's ``vllm serve --headless --data-parallel-start-rank 2`` (ranks 2-3), handshaking
    over TCP; node 1's engine cores publish into node 1's board (its own name here, one machine), and
    ``dpboard relay`` brings their slots to node 0's ``dpboard collect``, where the API server picks
    across all four."""
    node1_board = new_board_name()
    rpc_port = free_port()
    endpoint = f"ipc://{tmp_path}/collector"
    cli = [sys.executable, "-m", "dpboard.cli"]
    local = DP // 2
    common = {"data_parallel_size_local": local, "data_parallel_master_ip": "127.0.0.1",
              "data_parallel_rpc_port": rpc_port}
    tools: list[subprocess.Popen] = []
    try:
        tools.append(subprocess.Popen([*cli, "collect", "--board", board_name, "--bind", endpoint, "--n-slots", str(DP),
                                       "--local-ranks", *map(str, range(local)), "--quiet"], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with api_servers(node1_board) as servers:
            servers.append(ApiServer({"moe": moe, "dp": DP, "parallel": common},
                                     {"DPBOARD_METHOD": "inflight_requests", "DPBOARD_VLLM_BOARD": board_name}))
            servers.append(ApiServer({"moe": moe, "dp": DP, "headless": True,
                                      "parallel": {**common, "data_parallel_rank": local}},
                                     {"DPBOARD_VLLM_BOARD": node1_board, "DPBOARD_VLLM_NODE_ID": "1"}))
            node0, node1 = servers
            assert node1.ready()["engines"] == list(range(local, DP))
            ready = node0.ready()  # once vLLM's handshake with all four engine cores is done
            assert ready["client"] == "DPLBAsyncMPClient" and ready["engines"] == list(range(DP))
            live_slots(node1_board, list(range(local, DP)), node1)
            tools.append(subprocess.Popen([*cli, "relay", "--board", node1_board, "--to", endpoint, "--node-id", "1",
                                           "--remote-board", board_name, "--quiet"], cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            records = live_slots(board_name, list(range(DP)), node0)
            assert records["writer_pid"].tolist() == node0.engine_pids + node1.engine_pids
            assert records["node_id"].tolist() == [0] * local + [1] * local
            ranks = node0.ask({"op": "pick", "n": 2 * DP})["ranks"]
            assert sorted(ranks) == sorted(list(range(DP)) * 2), (ranks, board_state(board_name), node0.tail())
    finally:
        for proc in reversed(tools):
            stop(proc)


def test_external_load_balancing_each_rank_publishes_its_own_slot(board_name):
    """``--data-parallel-external-lb``: one API server per rank (``--data-parallel-rank R``), each with
    its one engine core (rank 0's front-end also handshakes with the others', over TCP); vLLM picks
    nothing here (``DPAsyncMPClient``), so the board is for the router in front. DP = 2 on one node.
    A MoE model only: vLLM 0.33.0's ``EngineArgs`` refuses external DP for a dense one ("Non-MoE models
    do not support external data parallel mode", engine/arg_utils.py:2455-2465)."""
    moe = True
    dp = 2
    rpc_port = free_port()
    with api_servers() as servers:
        for rank in range(dp):
            parallel = {"data_parallel_size_local": 1, "data_parallel_rank": rank, "data_parallel_external_lb": True,
                        "data_parallel_master_ip": "127.0.0.1", "data_parallel_rpc_port": rpc_port}
            servers.append(ApiServer({"moe": moe, "dp": dp, "parallel": parallel}, {"DPBOARD_VLLM_BOARD": board_name}))
        for rank, server in enumerate(servers):
            ready = server.ready()
            assert ready["client"] == "DPAsyncMPClient" and ready["engines"] == [rank]
        records = live_slots(board_name, list(range(dp)), servers[0], dp)
        assert records["dp_rank"].tolist() == list(range(dp))
        assert records["writer_pid"].tolist() == [server.engine_pids[0] for server in servers]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
