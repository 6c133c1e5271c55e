"""Relays and the collector as real processes over TCP loopback: delivery, restarts, dead relays."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq
import zmq.auth

from dpboard import Board, LoadSnapshot, SlotStatus
from dpboard.multinode.collector import LOCK_DIR, LOCK_PREFIX, Collector
from dpboard.multinode.relay import Relay, parse_ranks
from tests.support.board_procs import consistent_detail
from tests.support.names import new_board_name
from tests.support.procutil import read_line, stop, wait_until

CLI = [sys.executable, "-m", "dpboard.cli"]
RANKS_PER_NODE = 4


class Cluster:
    """node0's board plus one local board per other node, each with the cluster's shape; the test
    process writes every node's ranks (as the schedulers would) and runs the tools as processes."""

    def __init__(self, n_nodes: int):
        self.n_slots = n_nodes * RANKS_PER_NODE
        self.name0 = new_board_name()
        self.board0 = Board.create(self.name0, n_slots=self.n_slots)
        self.nodes = [Board.create(new_board_name(), n_slots=self.n_slots, node_id=k) for k in range(1, n_nodes + 1)]
        self.writers = {
            rank: node.writer(rank)
            for k, node in enumerate(self.nodes)
            for rank in range(k * RANKS_PER_NODE, (k + 1) * RANKS_PER_NODE)
        }
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.value = 0

    def publish(self, value: int) -> None:
        self.value = value
        for rank, w in self.writers.items():
            w.publish(LoadSnapshot(dp_rank=rank, num_running_reqs=rank, num_received_reqs=value,
                                   max_total_num_tokens=1000, num_used_tokens=value % 1000))

    def start_publishing(self, period: float = 0.02) -> None:
        def loop() -> None:
            value = self.value
            while not self._stop.wait(period):
                value += 1
                self.publish(value)

        self._stop.clear()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop_publishing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def collector(self, bind: str = "tcp://127.0.0.1:*") -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([*CLI, "collect", "--board", self.name0, "--bind", bind, "--quiet"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        line = read_line(proc)
        assert " owns " in line, (line, proc.poll())
        return proc, line.split(" owns ")[1].split()[0]

    def relay(self, k: int, endpoint: str, *extra: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [*CLI, "relay", "--board", self.nodes[k].name, "--to", endpoint, "--node-id", str(k + 1),
             "--remote-board", self.name0, "--tick-ms", "5", "--quiet", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        assert "dpboard relay: pid" in read_line(proc)
        return proc

    def node0_values(self, ranks: range | None = None) -> list[int | None]:
        reader = self.board0.reader()
        snaps = reader.read_all()
        ranks = range(self.n_slots) if ranks is None else ranks
        return [None if snaps[r] is None else snaps[r].num_received_reqs for r in ranks]

    def node_ranks(self, k: int) -> range:
        return range(k * RANKS_PER_NODE, (k + 1) * RANKS_PER_NODE)

    def close(self) -> None:
        self.stop_publishing()
        for proc in self.procs:
            stop(proc)
        for board in [self.board0, *self.nodes]:
            board.close()
            board.unlink()
        leftover = [p for p in LOCK_DIR.glob(LOCK_PREFIX + "*") if self.name0 in p.name]
        assert not leftover, f"lock files left behind: {leftover}"


@contextmanager
def cluster(n_nodes: int) -> Iterator[Cluster]:
    c = Cluster(n_nodes)
    try:
        yield c
    finally:
        c.close()


def test_every_ranks_latest_snapshot_arrives():
    with cluster(3) as c:
        collector, endpoint = c.collector()
        relays = [c.relay(k, endpoint) for k in range(3)]
        for value in range(1, 40):
            c.publish(value)
            time.sleep(0.002)
        assert wait_until(lambda: c.node0_values() == [39] * c.n_slots), c.node0_values()
        snaps = c.board0.reader().read_all()
        for k in range(3):
            for rank in c.node_ranks(k):
                local = c.nodes[k].reader().read(rank)
                assert snaps[rank].node_id == k + 1
                # Everything but node0's receive time is the node's own record.
                assert snaps[rank]._replace(monotonic_ns=0) == local._replace(monotonic_ns=0)
        for proc in [collector, *relays]:
            assert proc.poll() is None
        stop(collector)
        assert collector.returncode == 0


def test_collector_killed_and_restarted_relays_reconnect():
    with cluster(2) as c:
        collector, endpoint = c.collector()
        # A long local stale threshold: the resync after the restart must send the idle ranks too.
        relays = [c.relay(k, endpoint, "--stale-after", "60") for k in range(2)]
        c.publish(1)
        assert wait_until(lambda: c.node0_values() == [1] * c.n_slots)
        collector.kill()
        collector.wait(10)
        c.publish(2)  # sent (and dropped) while node0 is down: carried again once it is back
        time.sleep(0.3)
        assert all(r.poll() is None for r in relays)
        collector, _ = c.collector(bind=endpoint)  # the killed one's lock does not block its restart
        assert wait_until(lambda: c.node0_values() == [2] * c.n_slots), c.node0_values()
        # node0 comes back with a fresh, empty board: every live rank must arrive without a new publish.
        collector.kill()
        collector.wait(10)
        c.board0.close()
        c.board0.unlink()
        c.board0 = Board.create(c.name0, n_slots=c.n_slots)
        collector, _ = c.collector(bind=endpoint)
        assert wait_until(lambda: c.node0_values() == [2] * c.n_slots), c.node0_values()
        c.publish(3)
        assert wait_until(lambda: c.node0_values() == [3] * c.n_slots), c.node0_values()
        for proc in [collector, *relays]:
            assert proc.poll() is None
        for r in relays:
            stop(r)
            assert r.returncode == 0
            assert "Traceback" not in r.stderr.read()


def test_killed_relay_makes_its_ranks_stale_on_node0():
    with cluster(2) as c:
        collector, endpoint = c.collector()
        relays = [c.relay(k, endpoint) for k in range(2)]
        c.start_publishing(0.02)
        reader = c.board0.reader(stale_after=0.4)

        def statuses(k: int) -> set[SlotStatus]:
            return {reader.status(r) for r in c.node_ranks(k)}

        assert wait_until(lambda: statuses(0) == statuses(1) == {SlotStatus.LIVE})
        relays[0].kill()
        relays[0].wait(10)
        killed_at = time.monotonic()
        assert wait_until(lambda: statuses(0) == {SlotStatus.STALE}, timeout=5)
        assert time.monotonic() - killed_at < 5
        assert statuses(1) == {SlotStatus.LIVE}  # the other node is unaffected
        assert collector.poll() is None


# -- the Relay class, driven tick by tick ----------------------------------------------------------


def test_sends_only_changed_slots_of_its_own_node():
    name0, name1 = new_board_name(), new_board_name()
    with Board.create(name0, n_slots=8) as b0, Board.create(name1, n_slots=8, node_id=1) as b1, \
            Collector(b0, "tcp://127.0.0.1:*") as col, \
            Relay(b1, col.endpoint, 1, remote_board=name0, ranks=range(0, 6)) as relay:
        # Let the relay see its connection first: the handshake makes it resend every live slot, which
        # would add a frame below if it came after the first publish.
        def connected() -> bool:
            relay.tick()
            return relay.connects >= 1

        assert wait_until(connected, timeout=10)
        assert relay.frames_sent == 0
        for rank in (0, 1, 2):
            b1.writer(rank).publish(LoadSnapshot(dp_rank=rank, num_running_reqs=1))
        b1.writer(3, node_id=4).publish(LoadSnapshot(dp_rank=3))  # another node's slot: not ours to send
        b1.writer(7).publish(LoadSnapshot(dp_rank=7))  # outside --ranks

        def first_frame() -> bool:
            relay.tick()
            col.poll(5)
            return relay.frames_sent == 1

        assert wait_until(first_frame, timeout=10)
        assert relay.snapshots_sent == 3
        assert col.stats()["snapshots_ok"] == 3
        for _ in range(5):  # nothing changed: nothing sent
            relay.tick()
        assert relay.frames_sent == 1
        b1.writer(1).publish(LoadSnapshot(dp_rank=1, num_running_reqs=9))
        assert relay.tick() == 1
        reader0 = b0.reader()

        def new_value_landed() -> bool:
            col.poll(5)  # handling a frame is not enough: its record must reach node0's board
            return reader0.read(1).num_running_reqs == 9

        assert wait_until(new_value_landed, timeout=10), (reader0.read(1), col.stats())
        assert col.stats()["frames_ok"] == 2 and col.stats()["snapshots_ok"] == 4
        assert col.stats()["frames_bad"] == 0
        assert reader0.read(0).num_running_reqs == reader0.read(2).num_running_reqs == 1
        assert reader0.status(3) == reader0.status(7) == SlotStatus.EMPTY


def test_a_slots_detail_reaches_node0_with_its_fields():
    """An engine's whole snapshot (SGLang's sections) crosses the relay: node0 reads the remote rank's
    detail as its own node does, and a later plain publish clears it there too."""
    name0, name1 = new_board_name(), new_board_name()
    with Board.create(name0, n_slots=4) as b0, Board.create(name1, n_slots=4, node_id=1) as b1, \
            Collector(b0, "tcp://127.0.0.1:*") as col, Relay(b1, col.endpoint, 1, remote_board=name0) as relay:
        w = b1.writer(2)
        reader0 = b0.reader()

        def lands(expected_running: int) -> bool:
            relay.tick()
            col.poll(5)
            snap = reader0.read(2)
            return snap is not None and snap.num_running_reqs == expected_running

        for k in (1, 2, 4, 5):  # consistent_detail(5) is None: the plain publish of a detail-less slot
            detail = consistent_detail(k)
            w.publish_detailed(LoadSnapshot(dp_rank=2, num_running_reqs=k, max_total_num_tokens=100), detail)
            assert wait_until(lambda k=k: lands(k), timeout=10), col.stats()
            status, snap, got = reader0.read_detail(2)
            assert status is SlotStatus.LIVE and got == detail, k
            assert snap.publish_seq == b1.reader().read(2).publish_seq  # the writer's own counter
        assert col.stats()["frames_bad"] == 0


def test_no_collector_means_counted_drops_never_a_stall():
    name1 = new_board_name()
    with Board.create(name1, n_slots=4, node_id=1) as b1:
        w = b1.writer(0)
        # A port nobody listens on: ZMQ keeps trying to connect in the background.
        with Relay(b1, "tcp://127.0.0.1:9", 1) as relay:
            started = time.monotonic()
            for i in range(50):
                w.publish(LoadSnapshot(dp_rank=0, num_running_reqs=i))
                assert relay.tick() == 0
            assert time.monotonic() - started < 10  # a bound, not a speed figure: it never blocks
            assert relay.frames_dropped == 50 and relay.frames_sent == 0


def test_bad_relay_arguments_are_clear_errors(board_name):
    with Board.create(board_name, n_slots=4, node_id=1) as b1:
        with pytest.raises(ValueError, match="--to"):
            Relay(b1, "127.0.0.1:5000", 1)
        with pytest.raises(ValueError, match="outside board"):
            Relay(b1, "tcp://127.0.0.1:9", 1, ranks=[2, 9])
        with pytest.raises(ValueError, match="node_id"):
            Relay(b1, "tcp://127.0.0.1:9", -1)
    assert parse_ranks("8-11,3") == [3, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="--ranks"):
        parse_ranks("5-2")
    out = subprocess.run([*CLI, "relay", "--board", "x"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--to" in out.stderr and "--node-id" in out.stderr
    out = subprocess.run([*CLI, "relay", "--board", board_name, "--to", "tcp://127.0.0.1:9", "--node-id", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--node-id: 0 is outside [1, " in out.stderr and "node 0 is node0" in out.stderr


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")
def test_keygen_writes_a_certificate_pair(tmp_path):
    out = subprocess.run([*CLI, "relay", "--keygen", str(tmp_path / "keys"), "--key-name", "node3"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "keys" / "node3.key", tmp_path / "keys" / "node3.key_secret"
    assert public.is_file() and secret.stat().st_mode & 0o777 == 0o600
    pub, sec = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (pub, None) and len(sec) == 40


def test_relay_and_collector_follow_boards_recreated_under_them(caplog):
    """A node's board, then node0's board, is removed and created again (schedulers restarting): the
    relay used to keep sending the old board's stale slots (then nothing), and the collector to write
    into a segment nobody reads any more."""
    import logging

    caplog.set_level(logging.WARNING)
    name0, name1 = new_board_name(), new_board_name()
    boards = {"0": Board.create(name0, n_slots=4), "1": Board.create(name1, n_slots=4, node_id=1)}
    try:
        with Collector(boards["0"], "tcp://127.0.0.1:*") as collector, \
                Relay(boards["1"], collector.endpoint, 1, remote_board=name0) as relay:
            value = [0]

            def shows(expected_board: str) -> bool:
                value[0] += 1
                writer.publish(LoadSnapshot(1, num_running_reqs=value[0]))
                relay.tick()
                collector.poll(10)
                snap = Board.attach(expected_board).reader().read(1)
                return snap is not None and snap.num_running_reqs == value[0]

            writer = boards["1"].writer(1)
            assert wait_until(lambda: shows(name0), timeout=10)
            # node 1's board is recreated: the relay reads the new one
            writer.close()
            boards["1"].close()
            boards["1"].unlink()
            boards["1"] = Board.create(name1, n_slots=4, node_id=1)
            writer = boards["1"].writer(1)
            assert wait_until(lambda: shows(name0), timeout=10)
            # node0's board is recreated: the collector writes into the new one
            boards["0"].close()
            boards["0"].unlink()
            boards["0"] = Board.create(name0, n_slots=4)
            assert wait_until(lambda: shows(name0), timeout=10)
            assert Board.attach(name0).generation == boards["0"].generation
            assert Board.attach(name0).collector_stats()["collector_pid"] > 0
        replaced = [r.getMessage() for r in caplog.records if "was replaced" in r.getMessage()]
        assert any(name1 in m for m in replaced) and any(name0 in m for m in replaced)
    finally:
        for b in boards.values():
            b.close()
            b.unlink()


def test_a_rank_range_beyond_the_board_is_refused_before_it_is_expanded(board_name):
    """`relay --ranks 0-20000000` took 10 s and 1.7 GB before failing."""
    with Board.create(board_name, n_slots=4, node_id=1):
        out = subprocess.run([*CLI, "relay", "--board", board_name, "--to", "tcp://127.0.0.1:9", "--node-id", "1",
                              "--ranks", "0-20000000"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "--ranks '0-20000000' names rank 20000000, but the board has 4 slots (ranks 0..3)" in out.stderr
    with pytest.raises(ValueError, match="names rank 99999999999"):
        parse_ranks("1-99999999999")  # the library's own bound (MAX_SLOTS) without a board
    assert parse_ranks("2-3,0", n_slots=4) == [0, 2, 3]


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")
def test_keygen_never_overwrites_keys_without_force(tmp_path):
    keys = tmp_path / "keys"
    first = subprocess.run([*CLI, "relay", "--keygen", str(keys), "--key-name", "n1"], capture_output=True,
                           text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    secret = keys / "n1.key_secret"
    before = secret.read_bytes()
    again = subprocess.run([*CLI, "relay", "--keygen", str(keys), "--key-name", "n1"], capture_output=True,
                           text=True, timeout=30)
    assert again.returncode == 2 and "already exist" in again.stderr and "--force" in again.stderr
    assert secret.read_bytes() == before
    forced = subprocess.run([*CLI, "relay", "--keygen", str(keys), "--key-name", "n1", "--force"],
                            capture_output=True, text=True, timeout=30)
    assert forced.returncode == 0 and secret.read_bytes() != before
    assert secret.stat().st_mode & 0o777 == 0o600 and (keys / "n1.key").stat().st_mode & 0o777 == 0o644
    assert not list(keys.glob(".dpboard-keygen-*"))  # the private folder is gone


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")
def test_keygen_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "n2.key_secret").symlink_to(victim)
    refused = subprocess.run([*CLI, "relay", "--keygen", str(keys), "--key-name", "n2"], capture_output=True,
                             text=True, timeout=30)
    assert refused.returncode == 2 and "already exist" in refused.stderr
    forced = subprocess.run([*CLI, "relay", "--keygen", str(keys), "--key-name", "n2", "--force"],
                            capture_output=True, text=True, timeout=30)
    assert forced.returncode == 0, forced.stderr
    assert victim.read_text() == "precious\n" and not (keys / "n2.key_secret").is_symlink()
    assert zmq.auth.load_certificate(keys / "n2.key_secret")[1] is not None


# -- the CLI relay runs past its own internal deadlines ---------------------------------------------


def _remote_ranks_stay_live(c: Cluster, relay: subprocess.Popen, seconds: float) -> None:
    """Samples node0's board every 0.25 s for ``seconds``: every rank the relay forwards must be LIVE
    at every sample, and the relay must still be running. The relay's status loop wakes every 5 s, so
    the window covers at least one such wake-up and a stale threshold after it."""
    reader = c.board0.reader(stale_after=2.0)
    assert wait_until(lambda: {reader.status(r) for r in c.node_ranks(0)} == {SlotStatus.LIVE}, timeout=30)
    started = time.monotonic()
    samples = 0
    while time.monotonic() - started < seconds:
        assert relay.poll() is None, f"the relay exited ({relay.returncode}) {time.monotonic() - started:.1f} s in"
        statuses = {r: reader.status(r) for r in c.node_ranks(0)}
        assert set(statuses.values()) == {SlotStatus.LIVE}, \
            f"{time.monotonic() - started:.1f} s in, node0 reads {statuses}"
        samples += 1
        time.sleep(0.25)
    assert samples >= seconds * 2  # sampled throughout, not once at the end


def test_cli_relay_with_a_duration_keeps_forwarding_until_it_ends():
    """`dpboard relay --duration 30` exited after 5.3 s: the inner run's 5 s deadline set the CLI's
    own stop event. It must forward for the whole duration, then exit cleanly."""
    with cluster(1) as c:
        c.start_publishing(0.02)
        _, endpoint = c.collector()
        relay = c.relay(0, endpoint, "--duration", "14")
        _remote_ranks_stay_live(c, relay, 9.0)
        relay.wait(30)  # its own duration ends it
        assert relay.returncode == 0, relay.stderr.read()


def test_cli_relay_without_a_duration_runs_until_sigterm():
    with cluster(1) as c:
        c.start_publishing(0.02)
        _, endpoint = c.collector()
        relay = c.relay(0, endpoint)
        _remote_ranks_stay_live(c, relay, 9.0)
        stop(relay)
        assert relay.returncode == 0
        assert "Traceback" not in relay.stderr.read()
