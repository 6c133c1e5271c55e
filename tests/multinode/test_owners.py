"""Who may speak for a node and hold a rank on node0 (dpboard.multinode.owners), against a real
`dpboard collect` process, a real `dpboard relay` and forging peers on loopback sockets.

Before: a loopback peer sending frames that claim node 1 overwrote node 1's ranks (the forged load
read LIVE on node0 in 25-50 % of reads, counted as good frames), with CURVE too, using node 2's
authorized key; and one frame naming ranks 4-7 as node 9's, sent before node 1's relay, made every
frame of node 1 `bad_rank` for the collector's whole life."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth

from dpboard import Board, LoadSnapshot, SlotStatus
from dpboard.multinode.curve import generate_certificates
from dpboard.multinode.wire import RECORD_DTYPE, pack_frame
from tests.support.names import new_board_name
from tests.support.procutil import read_line, stop, wait_until

CLI = [sys.executable, "-m", "dpboard.cli"]
FORGED = 999  # num_running_reqs no real writer here publishes
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")


def frame(board: str, node: int, ranks: list[int], seq: int) -> bytes:
    rec = np.zeros(len(ranks), RECORD_DTYPE)
    rec["dp_rank"] = ranks
    rec["num_running_reqs"] = FORGED
    rec["max_total_num_tokens"] = 100
    rec["node_id"] = node
    rec["timestamp_ns"] = time.time_ns()
    rec["publish_seq"] = 10**9 + seq
    return pack_frame(rec, node_id=node, board=board, frame_seq=seq)


class Cluster:
    """node0's board and a `dpboard collect` for it; node 1's board, written continuously by a
    thread, and (``relay()``) a `dpboard relay` of it."""

    def __init__(self, tmp_path: Path, ranks: tuple[int, ...], *collect_args: str) -> None:
        self.name0, self.name1 = new_board_name(), new_board_name()
        self.board0 = Board.create(self.name0, n_slots=8)
        self.board1 = Board.create(self.name1, n_slots=8, node_id=1)
        self.ranks = ranks
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self.ctx = zmq.Context()
        self.collector = self._start([*CLI, "collect", "--board", self.name0, "--bind", "tcp://127.0.0.1:*",
                                      "--quiet", *collect_args])
        self.endpoint = re.search(r"owns (tcp://\S+)", read_line(self.collector)).group(1)
        self.reader = self.board0.reader(stale_after=2.0)
        threading.Thread(target=self._publish, daemon=True).start()

    def _start(self, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def _publish(self) -> None:
        writers = [self.board1.writer(r) for r in self.ranks]
        k = 0
        while not self._stop.wait(0.005):
            k += 1
            for w in writers:
                w.publish(LoadSnapshot(dp_rank=w.rank, num_running_reqs=1, num_received_reqs=k))

    def relay(self, *extra: str) -> subprocess.Popen:
        proc = self._start([*CLI, "relay", "--board", self.name1, "--to", self.endpoint, "--node-id", "1",
                            "--remote-board", self.name0, "--quiet", *extra])
        assert "dpboard relay: pid" in read_line(proc)
        return proc

    def push(self, *, secret: Path | None = None, server: Path | None = None) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            public, private = zmq.auth.load_certificate(secret)
            sock.curve_publickey, sock.curve_secretkey = public, private
            sock.curve_serverkey = zmq.auth.load_certificate(server)[0]
        sock.connect(self.endpoint)
        return sock

    def node1_live(self) -> bool:
        for r in self.ranks:
            snap = self.reader.read(r)
            if snap is None or snap.node_id != 1 or snap.num_running_reqs == FORGED or \
                    self.reader.status(r) != SlotStatus.LIVE:
                return False
        return True

    def forged_reads(self, sock: zmq.Socket, node: int, seconds: float) -> tuple[int, int, int]:
        """Send forged frames for node 1's ranks as ``node`` for ``seconds``; how many of node0's reads
        of them showed the forged load LIVE, of how many reads, and how many frames were sent."""
        forged = reads = seq = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            seq += 1
            sock.send(frame(self.name0, node, list(self.ranks), seq))
            time.sleep(0.004)
            for r in self.ranks:
                snap = self.reader.read(r)
                reads += 1
                forged += snap is not None and snap.num_running_reqs == FORGED and \
                    self.reader.status(r) == SlotStatus.LIVE
        return forged, reads, seq

    def close(self) -> None:
        self._stop.set()
        for proc in reversed(self.procs):
            stop(proc)
        self.ctx.destroy(linger=0)
        for board in (self.board0, self.board1):
            board.close()
            board.unlink()


@contextmanager
def cluster(tmp_path: Path, ranks: tuple[int, ...], *collect_args: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ranks, *collect_args)
    try:
        yield c
    finally:
        c.close()


def test_a_peer_claiming_a_node_another_connection_speaks_for_is_dropped_and_counted(tmp_path):
    with cluster(tmp_path, (2, 3)) as c:
        c.relay()
        assert wait_until(c.node1_live, timeout=20), "node 1's relay never landed"
        forger = c.push()
        forged, reads, sent = c.forged_reads(forger, node=1, seconds=3.0)
        assert wait_until(lambda: c.board0.collector_stats()["bad_owner"] >= sent, timeout=10)
        stats = c.board0.collector_stats()
        print(f"forged load LIVE in {forged} of {reads} reads; bad_owner {stats['bad_owner']} of {sent} forged "
              f"frames, frames_ok {stats['frames_ok']}")
        assert forged == 0
        assert stats["bad_owner"] == sent  # every forged frame, dropped and counted
        assert c.node1_live()


def curve_keys(tmp_path: Path, *relays: str) -> tuple[Path, Path, Path, dict[str, Path]]:
    """The collector's pair, a directory of the relays' authorized public keys, their secret keys."""
    server_pub, server_secret = generate_certificates(tmp_path / "server", "collector")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    secrets = {}
    for name in relays:
        public, secrets[name] = generate_certificates(tmp_path / name, name)
        public.rename(authorized / public.name)
    return server_pub, server_secret, authorized, secrets


@needs_curve
def test_a_curve_key_speaks_only_for_the_nodes_it_is_configured_for(tmp_path):
    server_pub, server_secret, authorized, secrets = curve_keys(tmp_path, "node1", "node2", "spare")
    (tmp_path / "key-nodes").write_text("# spare speaks for node 5\nspare 5\n")
    with cluster(tmp_path, (2, 3), "--curve-secret-key", str(server_secret), "--curve-authorized-keys",
                 str(authorized), "--curve-key-nodes", str(tmp_path / "key-nodes")) as c:
        c.relay("--curve-server-key", str(server_pub), "--curve-secret-key", str(secrets["node1"]))
        assert wait_until(c.node1_live, timeout=20), "node 1's relay never landed"
        node2 = c.push(secret=secrets["node2"], server=server_pub)
        forged, reads, sent = c.forged_reads(node2, node=1, seconds=3.0)  # node 2's key, claiming node 1
        assert wait_until(lambda: c.board0.collector_stats()["bad_owner"] >= sent, timeout=10)
        print(f"node 2's key claiming node 1: forged load LIVE in {forged} of {reads} reads; "
              f"bad_owner {c.board0.collector_stats()['bad_owner']} of {sent} forged frames")
        assert forged == 0 and c.board0.collector_stats()["bad_owner"] == sent
        # the key still speaks for its own node, and a listed key for its listed node only
        node2.send(frame(c.name0, 2, [6], 1))
        spare = c.push(secret=secrets["spare"], server=server_pub)
        spare.send(frame(c.name0, 5, [7], 1))
        spare.send(frame(c.name0, 6, [5], 2))
        assert wait_until(lambda: c.reader.read(6) is not None and c.reader.read(7) is not None, timeout=10)
        assert c.reader.read(6).node_id == 2 and c.reader.read(7).node_id == 5
        assert wait_until(lambda: c.board0.collector_stats()["bad_owner"] == sent + 1, timeout=10)
        assert c.reader.read(5) is None and c.node1_live()


def test_a_first_frame_claim_is_let_go_when_its_connection_closes(tmp_path):
    with cluster(tmp_path, (4, 5, 6, 7), "--release-after", "600") as c:
        squatter = c.push()
        squatter.send(frame(c.name0, 9, [4, 5, 6, 7], 1))
        assert wait_until(lambda: c.reader.read(4) is not None, timeout=10)
        c.relay()
        assert wait_until(lambda: c.board0.collector_stats()["bad_rank"] > 0, timeout=20), \
            "node 1's relay never reached the collector"
        assert not c.node1_live(), "the squatter's claim did not hold while it was connected"
        squatter.close(linger=0)
        started = time.monotonic()
        assert wait_until(c.node1_live, timeout=15), "node 1's ranks stayed node 9's after its connection closed"
        print(f"node 1's ranks LIVE {time.monotonic() - started:.2f} s after the squatter closed")


def test_a_silent_first_frame_claim_is_let_go_after_release_after(tmp_path):
    with cluster(tmp_path, (4, 5, 6, 7), "--release-after", "3") as c:
        squatter = c.push()  # stays connected (its ZMQ answers pings)
        seq = 0

        def squat() -> bool:
            nonlocal seq
            seq += 1
            squatter.send(frame(c.name0, 9, [4, 5, 6, 7], seq))
            return c.board0.collector_stats()["bad_rank"] > 0

        squat()
        assert wait_until(lambda: c.reader.read(4) is not None, timeout=10)
        c.relay()
        # the squatter refreshes its claim until node 1's frames are seen refused, then goes silent
        assert wait_until(squat, timeout=20, interval=0.2), "node 1's relay never reached the collector"
        last = time.monotonic()
        assert wait_until(c.node1_live, timeout=20), "a silent claim was never let go"
        waited = time.monotonic() - last
        print(f"node 1's ranks LIVE {waited:.2f} s after the squatter's last frame (--release-after 3)")
        assert waited > 2.5  # it was the silence that let the claim go


@needs_curve
def test_an_authenticated_node_takes_a_rank_over_from_an_unauthenticated_claim(tmp_path):
    # relay-b is configured for no node: it is held as a plain connection is
    server_pub, server_secret, authorized, secrets = curve_keys(tmp_path, "node1", "relay-b")
    with cluster(tmp_path, (4, 5, 6, 7), "--curve-secret-key", str(server_secret), "--curve-authorized-keys",
                 str(authorized), "--release-after", "600") as c:
        squatter = c.push(secret=secrets["relay-b"], server=server_pub)
        squatter.send(frame(c.name0, 9, [4, 5, 6, 7], 1))
        assert wait_until(lambda: c.reader.read(4) is not None, timeout=10)
        c.relay("--curve-server-key", str(server_pub), "--curve-secret-key", str(secrets["node1"]))
        assert wait_until(c.node1_live, timeout=15), "node 1's authenticated relay did not win the ranks"
        # and the unauthenticated claim cannot take them back
        forged, _, _ = c.forged_reads(squatter, node=9, seconds=1.0)
        assert forged == 0 and c.board0.collector_stats()["bad_rank"] > 0
    err = c.collector.stderr.read()
    assert "relay-b.key speak for no configured node id" in err


@needs_curve
@pytest.mark.parametrize(("lines", "words"), [
    ("nobody 3\n", "line 1: no key nobody.key in the authorized keys directory (known: node1)"),
    ("# first\nnode1 one\n", "line 2: give the key's node ids as integers >= 0 after its name"),
    ("node1 1\nnode1 2\n", "line 2: key node1 is listed twice"),
])
def test_a_bad_key_nodes_file_is_one_line_at_start(tmp_path, lines, words):
    _, server_secret, authorized, _ = curve_keys(tmp_path, "node1")
    (tmp_path / "key-nodes").write_text(lines)
    with Board.create(new_board_name(), n_slots=2) as board:
        out = subprocess.run([*CLI, "collect", "--board", board.name, "--bind", "tcp://127.0.0.1:*",
                              "--curve-secret-key", str(server_secret), "--curve-authorized-keys", str(authorized),
                              "--curve-key-nodes", str(tmp_path / "key-nodes"), "--duration", "1"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr
