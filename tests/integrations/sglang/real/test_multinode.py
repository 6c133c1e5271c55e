"""SGLang's zmq mode (multi-node DP attention): a scheduler of node 1 publishes into its node's own
board and relays its slot; on node 0 the reader SGLang's ``zmq_reader_owner`` names owns the
collector, the single PULL socket, and node 1's rank shows up on node 0's board.

"Node 1" is a process in a mount namespace of its own with a private /dev/shm (``unshare``), so
its board is not node 0's although both carry the instance's name; it needs root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from dpboard.errors import UnavailableError
from dpboard.integrations.sglang.transport import BoardLoadReader
from dpboard.multinode.collector import CollectorBusyError
from tests.integrations.sglang.real.conftest import ls
from tests.support import sglang as sgl
from tests.support.sglang_proc import SchedulerProc

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and util-linux's unshare for a private /dev/shm"),
]

PRIVATE_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs dpboard-node1 /dev/shm && exec "$@"', "sh"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_of_another_node_reaches_node0_through_relay_and_collector(instance):
    probe = subprocess.run([*PRIVATE_SHM, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private /dev/shm here: {probe.stderr.strip()}")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    context = dict(dp_size=2, nnodes=2, attn_dp_enabled=True, load_balance_method="total_tokens")
    sgl.set_context(node_rank=0, role="dp_controller", **context)
    port_args = sgl.PortArgs(instance_id=instance.port_args.instance_id, load_collector_ipc_name=endpoint)
    assert ls.should_use_zmq() and ls.zmq_reader_owner("DataParallelController")
    assert not ls.zmq_reader_owner("TokenizerManager")
    local = ls.create_load_snapshot_writer(port_args, 2, 0)  # node 0's own rank: its board, no relay
    owner: BoardLoadReader = ls.create_load_snapshot_reader(port_args, caller="DataParallelController")
    other = ls.create_load_snapshot_reader(port_args, caller="TokenizerManager")
    node1 = SchedulerProc("plugin", "1", "2", instance.port_args.instance_id, "nnodes=2", "node_rank=1",
                          "attn_dp_enabled=1", env={"COLLECTOR": endpoint}, wrap=PRIVATE_SHM)
    try:
        with pytest.raises(UnavailableError):  # the collector drains in its own thread: no fd to watch
            owner.fileno()
        # exactly one PULL owner: a second one for this board is refused, naming the first
        with pytest.raises(CollectorBusyError):
            ls.create_load_snapshot_reader(port_args, caller="DataParallelController")
        deadline = time.monotonic() + 60
        k = 0
        while time.monotonic() < deadline:
            k += 1
            # node 0's scheduler keeps publishing too, as a live one does: a slow start of node 1 on
            # a loaded machine must not age rank 0 out of the readers (stale after 5 s)
            local.write(sgl.full_snapshot(0, 1))
            node1.publish(k)
            loads = {s.dp_rank: s for s in other.read_all()}
            if 1 in loads and loads[1].num_total_tokens == sgl.full_snapshot(1, k).num_total_tokens:
                break
            time.sleep(0.05)
        else:
            pytest.fail("node 1's rank never reached node 0's board")
        # Nothing SGLang shows is lost on the way: every field and section of node 1's snapshot
        got, sent = loads[1].to_dict(include={"all"}), sgl.full_snapshot(1, k).to_dict(include={"all"})
        assert got == sent
        assert "memory" in got and got["decode_moments"] is not None
        # node 0's own rank keeps everything
        assert loads[0].to_dict(include={"all"}) == sgl.full_snapshot(0, 1).to_dict(include={"all"})
        assert [s.dp_rank for s in owner.read_all()] == [0, 1]
        node1.close()
        assert node1.proc.returncode == 0
    finally:
        node1.kill()
        owner.close()
        local.close()


def test_the_multi_tokenizer_router_drains_the_collector_in_its_event_loop(instance):
    """With several tokenizer workers and a round-robin controller, SGLang names its
    MultiTokenizerRouter the PULL owner: it registers the reader's ``fileno()`` with its event loop
    and calls ``poll()``; node 1's frames reach node 0's board through those calls alone."""
    from dpboard import Board, LoadSnapshot
    from dpboard.multinode.relay import Relay
    from tests.support.names import new_board_name

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sgl.set_context(dp_size=2, nnodes=2, attn_dp_enabled=True, load_balance_method="round_robin", node_rank=0,
                    tokenizer_worker_num=2, role="tokenizer")
    port_args = sgl.PortArgs(instance_id=instance.port_args.instance_id, load_collector_ipc_name=endpoint)
    assert ls.zmq_reader_owner("MultiTokenizerRouter") and not ls.zmq_reader_owner("DataParallelController")
    router = ls.create_load_snapshot_reader(port_args, caller="MultiTokenizerRouter")
    tokenizer = ls.create_load_snapshot_reader(port_args, caller="TokenizerManager")
    node1_board = Board.create(new_board_name(), 2, node_id=1)  # node 1's board, under another name here
    relay = Relay(node1_board, endpoint, 1, ranks=[1], remote_board=instance.board)
    try:
        assert isinstance(router.fileno(), int)
        node1_board.writer(1).publish(LoadSnapshot(dp_rank=1, num_total_tokens=4321, max_total_num_tokens=9000))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and tokenizer.read(1) is None:
            relay.tick()
            router.poll()  # what the router's event loop calls when the descriptor is readable
            time.sleep(0.02)
        assert tokenizer.read(1) is not None and tokenizer.read(1).num_total_tokens == 4321
    finally:
        relay.close()
        router.close()
        node1_board.close()
        node1_board.unlink()
