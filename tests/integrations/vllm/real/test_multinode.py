"""An engine core on another node: it publishes into its node's board, `dpboard relay` forwards its
slot to node0's collector, and the API server on node0 picks with its exact received count.

The two "nodes" share this machine's /dev/shm, so node 1's board has a name of its own and the relay
names node0's with ``--remote-board`` (docs/MULTINODE.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dpboard.board import SEGMENT_PREFIX, SHM_DIR, Board
from dpboard.integrations.vllm import dispatch
from dpboard.snapshot import LoadSnapshot
from tests.integrations.vllm.real.conftest import vllm_config
from tests.support.names import ROOT
from tests.support.procutil import read_line, stop, wait_until
from tests.support.vllm_engine import engine_request, make_client

pytestmark = pytest.mark.timeout(180)


def test_an_engine_of_another_node_reaches_node0s_api_server_through_the_relay(board_name, monkeypatch, tmp_path):
    node1_board = f"{board_name}n1"
    endpoint = f"ipc://{tmp_path}/collector"
    cli = [sys.executable, "-m", "dpboard.cli"]
    node0 = Board.create(board_name, 2)
    local = node0.writer(0)  # node0's own engine, busy
    local.publish(LoadSnapshot(dp_rank=0, num_running_reqs=50, max_total_num_tokens=1000))
    env = {**os.environ, "VLLM_PLUGINS": "dpboard", "DPBOARD_VLLM_BOARD": node1_board, "DPBOARD_VLLM_NODE_ID": "1"}
    procs = [subprocess.Popen([*cli, "collect", "--board", board_name, "--bind", endpoint, "--quiet"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    state = None
    try:
        engine = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_engine_proc", "1", "2"], cwd=ROOT,
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        procs.append(engine)
        assert json.loads(read_line(engine, timeout=120)) == {"ready": True}
        assert wait_until(lambda: (SHM_DIR / f"{SEGMENT_PREFIX}{node1_board}").exists(), timeout=30)
        procs.append(subprocess.Popen([*cli, "relay", "--board", node1_board, "--to", endpoint, "--node-id", "1",
                                       "--remote-board", board_name, "--quiet"], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        reader = node0.reader()
        assert wait_until(lambda: (reader.read(1) or LoadSnapshot()).node_id == 1, timeout=30)
        monkeypatch.setenv("DPBOARD_METHOD", "inflight_requests")
        monkeypatch.setenv("DPBOARD_VLLM_BOARD", board_name)
        client = make_client(vllm_config(2), 2)
        state = dispatch.client_dispatch(client)
        setattr(client, dispatch.STATE, state)
        picked = client.get_core_engine_for_request(engine_request("a", 32, 50))
        assert picked == (1).to_bytes(2, "little")  # node 1's idle engine, not node0's busy one
        engine.stdin.write(json.dumps({"id": "a", "tokens": 32, "max_tokens": 50}) + "\n")
        engine.stdin.flush()
        # node 1's engine took it in; its received count crossed the relay: nothing in flight any more
        assert wait_until(lambda: reader.read(1).num_received_reqs == 1, timeout=30)
        state.reader.read_array()
        assert state.reader.in_flight.tolist() == [0, 0]
    finally:
        if state is not None:
            state.close()
        for proc in reversed(procs):
            stop(proc)  # a clean exit: the collector releases its lock, the engine core its board
        local.close()
        node0.close()
        (SHM_DIR / f"{SEGMENT_PREFIX}{node1_board}").unlink(missing_ok=True)
