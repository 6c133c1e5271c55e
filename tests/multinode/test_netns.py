"""A relay and a collector on two "hosts": network namespaces with their own addresses, joined by a
veth pair. Needs root and iproute2; skipped otherwise. The test only ever configures addresses
inside the two namespaces it creates, and deletes them (and with them the veth pair) at the end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from dpboard import Board, LoadSnapshot, SlotStatus
from tests.support.names import new_board_name
from tests.support.procutil import read_line, stop

CLI = [sys.executable, "-m", "dpboard.cli"]
PORT = 5757

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2's `ip` to create network namespaces",
)


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """(namespace, address) of node0 and node1, joined by a veth pair."""
    tag = f"{os.getpid() % 100000}"
    ns0, ns1 = f"dpboard-t{tag}-n0", f"dpboard-t{tag}-n1"
    veth0, veth1 = f"dpb{tag}a", f"dpb{tag}b"  # interface names: at most 15 characters
    addr0, addr1 = "10.213.77.1", "10.213.77.2"
    steps = [
        ("netns", "add", ns0),
        ("netns", "add", ns1),
        ("link", "add", veth0, "netns", ns0, "type", "veth", "peer", "name", veth1, "netns", ns1),
        ("-n", ns0, "addr", "add", f"{addr0}/24", "dev", veth0),
        ("-n", ns1, "addr", "add", f"{addr1}/24", "dev", veth1),
        ("-n", ns0, "link", "set", veth0, "up"),
        ("-n", ns1, "link", "set", veth1, "up"),
        ("-n", ns0, "link", "set", "lo", "up"),
        ("-n", ns1, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build the two-namespace network (`ip {' '.join(step)}`: "
                            f"{done.stderr.strip()})")
        yield (ns0, addr0), (ns1, addr1)
    finally:
        ip("netns", "del", ns0)
        ip("netns", "del", ns1)


def _in_ns(ns: str, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_relay_across_network_namespaces(two_hosts):
    (ns0, addr0), (ns1, _) = two_hosts
    # /dev/shm is shared by every network namespace: each "host" gets its own board name.
    name0, name1 = new_board_name(), new_board_name()
    procs: list[subprocess.Popen] = []
    with Board.create(name0, n_slots=8) as board0, Board.create(name1, n_slots=8, node_id=1) as board1:
        try:
            collector = _in_ns(ns0, *CLI, "collect", "--board", name0, "--bind", f"tcp://{addr0}:{PORT}", "--quiet")
            procs.append(collector)
            assert f"owns tcp://{addr0}:{PORT}" in read_line(collector)
            relay = _in_ns(ns1, *CLI, "relay", "--board", name1, "--to", f"tcp://{addr0}:{PORT}", "--node-id", "1",
                           "--remote-board", name0, "--quiet")
            procs.append(relay)
            assert "dpboard relay" in read_line(relay)
            writers = {rank: board1.writer(rank) for rank in range(4, 8)}
            reader = board0.reader()
            deadline = time.monotonic() + 20
            value = 0
            while time.monotonic() < deadline:
                value += 1
                for rank, w in writers.items():
                    w.publish(LoadSnapshot(dp_rank=rank, num_waiting_reqs=value))
                snaps = reader.read_all()
                if all(snaps[r] is not None and snaps[r].num_waiting_reqs >= 1 for r in writers):
                    break
                time.sleep(0.01)
            snaps = reader.read_all()
            assert all(snaps[r] is not None and snaps[r].node_id == 1 for r in writers), snaps
            # Then one last, distinct publish per rank: node0 must end up with exactly that one.
            final = {rank: 10**6 + rank for rank in writers}
            for rank, w in writers.items():
                w.publish(LoadSnapshot(dp_rank=rank, num_waiting_reqs=final[rank], num_running_reqs=rank))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                snaps = reader.read_all()
                if all(snaps[r].num_waiting_reqs == final[r] for r in writers):
                    break
                time.sleep(0.01)
            assert {r: (snaps[r].num_waiting_reqs, snaps[r].num_running_reqs) for r in writers} == {
                r: (final[r], r) for r in writers}
            assert all(snaps[r]._replace(monotonic_ns=0) == board1.reader().read(r)._replace(monotonic_ns=0)
                       for r in writers)
            assert all(reader.status(r) == SlotStatus.EMPTY for r in range(4))
            assert collector.poll() is None and relay.poll() is None
        finally:
            for proc in procs:
                stop(proc)
        assert all(proc.returncode == 0 for proc in procs), [(p.returncode, p.stderr.read()) for p in procs]
