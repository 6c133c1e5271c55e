"""The collector: validation and counting of every frame, single ownership, the command, CURVE."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpboard import Board, LoadSnapshot, SlotStatus
from dpboard.multinode.collector import (
    LOCK_DIR,
    LOCK_PREFIX,
    Collector,
    CollectorBusyError,
    board_lock_path,
    endpoint_lock_path,
)
from dpboard.multinode.relay import Relay, generate_certificates
from dpboard.multinode.wire import HEADER_SIZE, RECORD_DTYPE, pack_frame
from tests.support.names import new_board_name
from tests.support.procutil import read_line, stop, wait_until

CLI = [sys.executable, "-m", "dpboard.cli"]


def our_lock_files(*names: str) -> list[Path]:
    return [p for p in LOCK_DIR.glob(LOCK_PREFIX + "*") if any(n in p.name for n in names)]


def records(ranks: list[int], node_id: int = 1, running: int = 1) -> np.ndarray:
    rec = np.zeros(len(ranks), dtype=RECORD_DTYPE)
    rec["dp_rank"] = ranks
    rec["num_running_reqs"] = running
    rec["max_total_num_tokens"] = 100
    rec["timestamp_ns"] = time.time_ns()
    rec["publish_seq"] = 1
    rec["node_id"] = node_id
    return rec


def test_valid_frame_lands_in_the_board_with_receive_time(board_name):
    with Board.create(board_name, n_slots=4) as board, Collector(board, "tcp://127.0.0.1:*") as c:
        rec = records([1, 3], node_id=2, running=7)
        rec["monotonic_ns"] = 5  # another node's clock: meaningless here, replaced by the receive time
        before = time.monotonic_ns()
        assert c.handle_frame(pack_frame(rec, node_id=2, board=board_name, frame_seq=0)) == 2
        snap = board.reader().read(3)
        assert snap.num_running_reqs == 7 and snap.node_id == 2
        assert snap.timestamp_ns == rec["timestamp_ns"][1] and snap.publish_seq == 1
        assert snap.monotonic_ns >= before
        assert board.reader().status(0) == SlotStatus.EMPTY
        stats = board.collector_stats()
        assert stats["collector_pid"] == os.getpid() and stats["collector_alive"] == 1
        assert stats["frames_ok"] == 1 and stats["snapshots_ok"] == 2 and stats["frames_bad"] == 0


def test_foreign_and_misrouted_frames_are_counted(board_name):
    with Board.create(board_name, n_slots=4) as board, Collector(board, "tcp://127.0.0.1:*") as c:
        # Rank 0 is node0's own: a live local scheduler process holds its writer.
        child = subprocess.Popen([*CLI[:1], "-c", f"""
import sys, time
from dpboard import Board
w = Board.attach({board_name!r}).writer(0)
print("ready", flush=True)
time.sleep(30)
"""], stdout=subprocess.PIPE, text=True)
        try:
            assert read_line(child).strip() == "ready"
            frames = {
                "bad_identity": pack_frame(records([1]), node_id=1, board="other-board", frame_seq=0),
                "bad_node": pack_frame(records([1], node_id=0), node_id=0, board=board_name, frame_seq=0),
                "bad_rank": pack_frame(records([0, 1]), node_id=1, board=board_name, frame_seq=0),
            }
            for data in frames.values():
                assert c.handle_frame(data) == 0
        finally:
            child.kill()
            child.wait(10)
        stats = c.stats()
        assert {k: stats[k] for k in frames} == dict.fromkeys(frames, 1)
        assert stats["frames_bad"] == 3 and stats["frames_ok"] == 0
        assert board.reader().status(1) == SlotStatus.EMPTY  # nothing of a bad frame was written


def test_second_collector_is_refused_naming_the_owner(board_name, tmp_path):
    other = new_board_name()
    ipc = f"ipc://{tmp_path}/collector.sock"
    with Board.create(board_name, n_slots=2) as board, Board.create(other, n_slots=2) as board2:
        with Collector(board, ipc) as first:
            with pytest.raises(CollectorBusyError, match=rf"board {board_name!r}.*pid {os.getpid()}"):
                Collector(board, "tcp://127.0.0.1:*")
            # ipc would silently steal the path from the first: the endpoint lock refuses it.
            with pytest.raises(CollectorBusyError, match=rf"endpoint {re.escape(ipc)}.*pid {os.getpid()}"):
                Collector(board2, ipc)
            assert board2.collector_stats()["collector_pid"] == 0  # the refused one touched nothing
            assert first.poll(0) == 0
            paths = first.lock_paths
            assert paths == [board_lock_path(board_name), endpoint_lock_path(ipc)]
            assert all(p.exists() for p in paths)
        assert not any(p.exists() for p in paths)
        # After a clean exit the next owner starts at once.
        with Collector(board2, ipc):
            pass
    assert not our_lock_files(board_name, other, "collector.sock")


def test_missing_board_and_bad_endpoint_are_clear_errors(board_name):
    with pytest.raises(FileNotFoundError, match="--n-slots"):
        Collector(board_name, "tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="endpoint"):
        Collector(board_name, "127.0.0.1:5000")
    assert not our_lock_files(board_name)
    with Collector(board_name, "tcp://127.0.0.1:*", n_slots=3) as c:  # creates and owns the board
        assert Board.attach(board_name).n_slots == 3 and c.board.is_owner
    with pytest.raises(FileNotFoundError):
        Board.attach(board_name)


def test_cli_second_owner_fails_and_clean_exit_removes_locks(board_name):
    with Board.create(board_name, n_slots=2):
        first = subprocess.Popen([*CLI, "collect", "--board", board_name, "--bind", "tcp://127.0.0.1:*",
                                  "--quiet"], stdout=subprocess.PIPE, text=True)
        try:
            line = read_line(first)
            assert f"pid {first.pid} owns tcp://127.0.0.1:" in line
            second = subprocess.run([*CLI, "collect", "--board", board_name, "--bind", "tcp://127.0.0.1:*"],
                                    capture_output=True, text=True, timeout=30)
            assert second.returncode == 2
            assert f"pid {first.pid}" in second.stderr and "already has a collector" in second.stderr
            assert our_lock_files(board_name)
        finally:
            stop(first)
        assert first.returncode == 0
        assert not our_lock_files(board_name)


# -- the fuzz test over a real socket --------------------------------------------------------------


@pytest.fixture(scope="module")
def serving_collector():
    """A `dpboard collect` process and a PUSH socket connected to it."""
    name = new_board_name()
    board = Board.create(name, n_slots=8)
    proc = subprocess.Popen([*CLI, "collect", "--board", name, "--bind", "tcp://127.0.0.1:*", "--quiet"],
                            stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        endpoint = read_line(proc).split(" owns ")[1].split()[0]
        push.connect(endpoint)
        sent = {"n": 0}
        yield board, proc, push, sent
    finally:
        push.close(0)
        ctx.term()
        stop(proc)
        board.close()
        board.unlink()
    assert not our_lock_files(name)


def _processed(board: Board) -> int:
    s = board.collector_stats()
    return s["frames_ok"] + s["frames_bad"]


def _valid(board: Board, running: int) -> bytes:
    return pack_frame(records([5], running=running), node_id=1, board=board.name, frame_seq=0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(
    st.binary(max_size=400),
    st.binary(max_size=300).map(lambda b: b"DPRL" + b),
    st.tuples(st.integers(0, HEADER_SIZE + 103), st.integers(0, 255)).map(
        lambda t: bytes(b if i != t[0] else t[1] for i, b in enumerate(
            pack_frame(records([2]), node_id=1, board="fuzz", frame_seq=0)))),
))
def test_fuzzed_frames_are_dropped_and_counted_while_serving(serving_collector, data):
    board, proc, push, sent = serving_collector
    before = _processed(board)
    marker = 1000 + sent["n"]  # a valid frame after the fuzzed one: the collector got past it
    push.send(data)
    push.send(_valid(board, marker))
    sent["n"] += 2
    assert wait_until(lambda: _processed(board) >= before + 2, timeout=10), board.collector_stats()
    assert proc.poll() is None
    assert _processed(board) == before + 2  # each frame counted once, as ok or as bad
    assert board.reader().read(5).num_running_reqs == marker


def test_collector_still_serves_after_the_fuzz(serving_collector):
    board, proc, push, sent = serving_collector
    oversized = pack_frame(records(list(range(8)) * 2), node_id=1, board=board.name, frame_seq=0)
    truncated = _valid(board, 1)[:-3]
    for data in (oversized, truncated, b"DPRL", b"\x00" * 104):
        push.send(data)
    push.send(_valid(board, 42))
    total = sent["n"] + 5
    assert wait_until(lambda: _processed(board) >= total), board.collector_stats()
    assert proc.poll() is None
    s = board.collector_stats()
    assert s["frames_ok"] + s["frames_bad"] == total
    assert s["frames_ok"] >= 1 and s["frames_bad"] >= 4
    assert s["frames_bad"] == sum(v for k, v in s.items() if k.startswith("bad_"))
    assert board.reader().read(5).num_running_reqs == 42
    info = json.loads(subprocess.run([*CLI, "info", board.name, "--json"], capture_output=True, text=True,
                                     timeout=30, check=True).stdout)
    assert info["collector"]["frames_bad"] == s["frames_bad"] and info["collector"]["collector_pid"] == proc.pid


# -- CURVE ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE support")
def test_curve_admits_known_relays_only(tmp_path):
    server_pub, server_secret = generate_certificates(tmp_path / "server", "collector")
    _, relay_secret = generate_certificates(tmp_path / "relay", "node1")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (tmp_path / "relay" / "node1.key").rename(authorized / "node1.key")
    n0, n1, n2 = new_board_name(), new_board_name(), new_board_name()
    with Board.create(n0, n_slots=4) as b0, Board.create(n1, n_slots=4, node_id=1) as b1, \
            Board.create(n2, n_slots=4, node_id=2) as b2:
        b1.writer(1).publish(LoadSnapshot(dp_rank=1, num_running_reqs=11))
        b2.writer(2).publish(LoadSnapshot(dp_rank=2, num_running_reqs=22))
        with Collector(b0, "tcp://127.0.0.1:*", curve_secret_key=server_secret,
                       curve_authorized_keys=authorized) as c, \
                Relay(b1, c.endpoint, 1, remote_board=n0, curve_server_key=server_pub,
                      curve_secret_key=relay_secret) as known, \
                Relay(b2, c.endpoint, 2, remote_board=n0, curve_server_key=server_pub) as unknown:
            def step() -> bool:
                known.tick()
                unknown.tick()
                c.poll(10)
                return b0.reader().read(1) is not None
            assert wait_until(step, timeout=10)
            for _ in range(30):  # the unknown relay had as long and more: still nothing from it
                step()
            assert b0.reader().read(1).num_running_reqs == 11
            assert b0.reader().read(2) is None
            assert unknown.frames_sent == 0


# -- lock files a hostile local user planted ----------------------------------------------------


@pytest.mark.parametrize("which", ["board", "endpoint"])
def test_collect_refuses_a_lock_file_planted_as_a_symbolic_link(board_name, tmp_path, which):
    """As another user: `ln -s VICTIM /dev/shm/<the collector's lock>`; then root runs `dpboard collect`.
    The collector used to follow the link and write its pid over the root-owned 0600 victim."""
    from tests.support.other_user import as_nobody

    victim = tmp_path / "victim"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    ipc = f"ipc:///tmp/{board_name}.sock"
    lock = board_lock_path(board_name) if which == "board" else endpoint_lock_path(ipc)
    as_nobody(lambda: os.symlink(victim, lock))
    try:
        out = subprocess.run([*CLI, "collect", "--board", board_name, "--bind", ipc, "--n-slots", "2",
                              "--duration", "1"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"{lock} is a symbolic link" in out.stderr and "Traceback" not in out.stderr
        assert victim.read_text() == "root's secret\n"
        assert lock.is_symlink()  # refused, neither followed nor removed
        assert not Path("/dev/shm", f"dpboard.{board_name}").exists()  # nothing was started
    finally:
        lock.unlink(missing_ok=True)
        Path(f"/tmp/{board_name}.sock").unlink(missing_ok=True)


def test_collect_refuses_a_lock_file_of_another_user(board_name):
    from tests.support.other_user import as_nobody

    lock = board_lock_path(board_name)

    def plant() -> None:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.write(fd, b"1\n")
        os.close(fd)

    as_nobody(plant)
    try:
        with Board.create(board_name, n_slots=2):
            with pytest.raises(PermissionError, match=r"belongs to uid 65534 \(nobody\)"):
                Collector(board_name, "tcp://127.0.0.1:*")
            assert Board.attach(board_name).collector_stats()["collector_pid"] == 0
    finally:
        lock.unlink(missing_ok=True)


@pytest.mark.parametrize(("bind", "words"), [
    ("tcp://127.0.0.1:99999", "port 99999 is outside 1..65535"),  # ZMQ would have bound another port
    ("tcp://127.0.0.1:5757\n", "is not a ZMQ endpoint"),
    ("ipc://", "is not a ZMQ endpoint"),
])
def test_collect_refuses_an_endpoint_zmq_would_misread(board_name, bind, words):
    with Board.create(board_name, n_slots=2):
        out = subprocess.run([*CLI, "collect", "--board", board_name, "--bind", bind, "--duration", "1"],
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr


def test_a_relayed_frame_never_takes_a_node0_rank_before_its_scheduler_starts(board_name):
    """In SGLang's zmq mode the collector starts before node0's schedulers: a frame from node 1
    naming rank 0 once made the collector claim rank 0's writer and keep it, and node0's own
    scheduler then failed to start (`slot 0 ... is held by the writer in live process`). The
    collector writes only ranks that belong to the frame's node: never a local one (--local-ranks),
    and a rank another node announced first stays that node's."""
    with Board.create(board_name, n_slots=4) as board:
        collector = subprocess.Popen([*CLI, "collect", "--board", board_name, "--bind", "tcp://127.0.0.1:*",
                                      "--local-ranks", "0", "1", "--quiet"], stdout=subprocess.PIPE, text=True)
        ctx = zmq.Context()
        try:
            endpoint = re.search(r"owns (tcp://\S+)", read_line(collector)).group(1)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoint)
            push.send(pack_frame(records([0], node_id=1), node_id=1, board=board_name, frame_seq=0))
            push.send(pack_frame(records([2], node_id=1), node_id=1, board=board_name, frame_seq=1))
            push.send(pack_frame(records([2], node_id=2, running=9), node_id=2, board=board_name, frame_seq=0))
            push.send(pack_frame(records([3], node_id=2), node_id=2, board=board_name, frame_seq=1))
            assert wait_until(lambda: _processed(board) == 4, 20)
            stats = board.collector_stats()
            assert stats["frames_ok"] == 2 and stats["bad_rank"] == 2
            reader = board.reader()
            assert reader.status(0) == SlotStatus.EMPTY
            assert reader.read(2).node_id == 1 and reader.read(2).num_running_reqs == 1
            assert reader.read(3).node_id == 2
            # node0's own scheduler, in a process of its own, starts after all that and writes its rank
            scheduler = subprocess.run([*CLI[:1], "-c", f"""
from dpboard import Board, LoadSnapshot
w = Board.attach({board_name!r}).writer(0)
w.publish(LoadSnapshot(0, num_running_reqs=5))
"""], capture_output=True, text=True, timeout=30)
            assert scheduler.returncode == 0, scheduler.stderr
            assert board.reader(stale_after=60).read(0).num_running_reqs == 5
        finally:
            stop(collector)
            ctx.destroy(linger=0)
        assert collector.returncode == 0


def _rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_collector_buffers_only_what_its_board_can_receive(board_name):
    """MAXMSGSIZE was sized for 65,536 slots whatever the board, and RCVHWM was 10,000 frames: one
    peer made the owner hold 1.16 GB while its drain lagged. Both come from the board now: a frame
    larger than this board's largest is cut off by ZMQ, and the frames waiting for a drain stay
    within RECEIVE_BUFFER_BYTES. A real peer process floods a collector that does not drain."""
    from dpboard.multinode.collector import RECEIVE_BUFFER_BYTES, frame_bound

    with Board.create(board_name, n_slots=4) as board, Collector(board, "tcp://127.0.0.1:*") as c:
        assert frame_bound(4) == 104 + 4 * 456 == 1928
        assert c.socket.getsockopt(zmq.MAXMSGSIZE) == 1928
        assert c.socket.getsockopt(zmq.RCVHWM) * 1928 <= RECEIVE_BUFFER_BYTES
        before = _rss_mb()
        flood = f"""
import sys, zmq
ctx = zmq.Context()
push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.SNDHWM, 0)
push.connect({c.endpoint!r})
count, size = int(sys.argv[1]), int(sys.argv[2])
for _ in range(count):
    push.send(b"DPRL" + bytes(size))
push.close(linger=3000)
ctx.term()
"""
        # 1 MiB frames (a size a 65,536-slot board would take, not this one), then this board's largest
        for count, size in ((100, 2**20), (20000, 1860)):
            peer = subprocess.run([*CLI[:1], "-c", flood, str(count), str(size)], capture_output=True, text=True,
                                  timeout=120)
            assert peer.returncode == 0, peer.stderr
        time.sleep(1.0)  # ZMQ's I/O thread takes in what it will while nothing drains
        grown = _rss_mb() - before
        assert grown < RECEIVE_BUFFER_BYTES / 2**20 + 16, f"the collector's process grew {grown:.0f} MB"
        while c.drain() > 0:
            pass
        stats = c.stats()
        assert stats["bad_length"] == 0  # none of the 1 MiB frames got through ZMQ
        assert 0 < stats["bad_version"] < 20000  # some of the small ones did; the rest were never queued


# -- CURVE: damaged keys, one bad authorized key, a collector made again ------------------------


def _damage_key(path: Path, which: str) -> None:
    """Replace the value of ``which`` (public-key or secret-key) by 40 characters that are not Z85."""
    text = path.read_text()
    path.write_text(re.sub(rf'({which} = )"[^"]*"', r'\1"' + "~" * 40 + '"', text))


def test_a_certificate_with_malformed_keys_is_one_line_not_a_zmq_traceback(board_name, tmp_path):
    """A certificate whose key values are not CURVE keys was a raw ZMQError traceback (EINVAL from
    setsockopt), in the collector and in the relay."""
    server_pub, server_secret = generate_certificates(tmp_path / "server", "collector")
    _, relay_secret = generate_certificates(tmp_path / "relay", "node1")
    _damage_key(server_secret, "secret-key")
    _damage_key(server_pub, "public-key")
    with Board.create(board_name, n_slots=2):
        collect = subprocess.run([*CLI, "collect", "--board", board_name, "--bind", "tcp://127.0.0.1:*",
                                  "--curve-secret-key", str(server_secret), "--duration", "1"],
                                 capture_output=True, text=True, timeout=60)
        relay = subprocess.run([*CLI, "relay", "--board", board_name, "--to", "tcp://127.0.0.1:9",
                                "--node-id", "1", "--curve-server-key", str(server_pub),
                                "--curve-secret-key", str(relay_secret), "--duration", "1"],
                               capture_output=True, text=True, timeout=60)
    for out, path, which in ((collect, server_secret, "secret-key"), (relay, server_pub, "public-key")):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"{path}: its {which} is not a CURVE key (40 Z85 characters)" in out.stderr


def test_one_unparsable_authorized_key_refuses_the_start(board_name, tmp_path):
    """One unparsable file in --curve-authorized-keys let the collector start and then reject every
    relay, the authorized ones included: now the start is refused, naming the file."""
    _, server_secret = generate_certificates(tmp_path / "server", "collector")
    generate_certificates(tmp_path / "authorized", "node1")
    (tmp_path / "authorized" / "node1.key_secret").unlink()
    (tmp_path / "authorized" / "broken.key").write_text("this is not a certificate\n")
    with Board.create(board_name, n_slots=2):
        out = subprocess.run([*CLI, "collect", "--board", board_name, "--bind", "tcp://127.0.0.1:*",
                              "--curve-secret-key", str(server_secret), "--curve-authorized-keys",
                              str(tmp_path / "authorized"), "--duration", "5"],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{tmp_path / 'authorized' / 'broken.key'}" in out.stderr
    assert not our_lock_files(board_name)


def test_a_curve_collector_made_again_in_one_process_always_binds(board_name, tmp_path):
    """Re-creating a collector that admits known relays only intermittently failed with EADDRINUSE
    on inproc://zeromq.zap.01: its authenticator's name on the shared context was still taken."""
    _, server_secret = generate_certificates(tmp_path / "server", "collector")
    generate_certificates(tmp_path / "authorized", "node1")
    (tmp_path / "authorized" / "node1.key_secret").unlink()
    with Board.create(board_name, n_slots=2) as board:
        for _ in range(30):
            with Collector(board, "tcp://127.0.0.1:*", curve_secret_key=server_secret,
                           curve_authorized_keys=tmp_path / "authorized") as c:
                assert c.poll(1) == 0
