"""The controller as node0's load fan-in owner (a relay feeding its embedded collector), and requests
whose send fails being taken back out of a rank's load. Real processes, boards and ZMQ sockets."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from dpboard import Board, LoadSnapshot
from dpboard.controller import DataParallelController, Dispatcher
from dpboard.controller.codec import encode_request
from dpboard.controller.process import ControllerSettings
from dpboard.multinode.collector import Collector, CollectorBusyError, board_lock_path, endpoint_lock_path
from tests.support.names import new_board_name
from tests.support.procutil import kill, wait_for
from tests.support.sockets import bound_pull, connected_push

CLI = [sys.executable, "-m", "dpboard.cli"]


def _drain(sock: zmq.Socket, quiet: float = 0.3, bound: float = 10.0) -> list[dict]:
    """Every message that arrives until none has come for ``quiet`` seconds."""
    got: list[dict] = []
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and sock.poll(int(quiet * 1000)):
        while True:
            try:
                got.append(msgpack.unpackb(sock.recv(zmq.NOBLOCK), raw=False))
            except zmq.Again:
                break
    return got


@pytest.mark.timeout(180)  # five processes start; a loaded 2-core machine takes its time
def test_controller_hosts_the_collector_and_dispatches_on_relayed_loads(tmp_path):
    """Rank 0 publishes on node0; ranks 1 and 2 live on node 1 and reach node0 only through a relay
    into the controller's own collector. Rank 1 is heavily loaded, rank 2 idle, rank 0 in between:
    with total_tokens every request must go to rank 2. Without the relayed loads ranks 1 and 2 would
    be empty (zero load) and rank 1, the lowest index, would get requests."""
    n = 3
    name0, name1 = new_board_name(), new_board_name()
    loads_ep = f"ipc://{tmp_path}/loads"
    in_ep = f"ipc://{tmp_path}/in"
    worker_eps = [f"ipc://{tmp_path}/w{r}" for r in range(n)]
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    publishing = threading.Event()
    publisher: threading.Thread | None = None
    with Board.create(name0, n_slots=n) as board0, Board.create(name1, n_slots=n, node_id=1) as board1:
        try:
            # The ranks keep publishing, as schedulers do: on a busy machine the controller's start
            # can take longer than the stale threshold, and a rank published once would be stale by then.
            loads = [(board0.writer(0), LoadSnapshot(dp_rank=0, num_running_reqs=2, num_total_tokens=5000,
                                                     num_used_tokens=5000, max_total_num_tokens=10**6)),
                     (board1.writer(1), LoadSnapshot(dp_rank=1, num_running_reqs=50, num_total_tokens=900_000,
                                                     num_used_tokens=900_000, max_total_num_tokens=10**6)),
                     (board1.writer(2), LoadSnapshot(dp_rank=2, max_total_num_tokens=10**6))]

            def publish_until_the_end() -> None:
                while not publishing.wait(0.05):
                    for writer, snap in loads:
                        writer.publish(snap)

            for writer, snap in loads:
                writer.publish(snap)
            publisher = threading.Thread(target=publish_until_the_end, daemon=True)
            publisher.start()
            workers = [bound_pull(ctx, ep) for ep in worker_eps]
            controller = subprocess.Popen(
                [*CLI, "controller", "--input", in_ep, "--workers", *worker_eps, "--method", "total_tokens",
                 "--board", name0, "--collect-bind", loads_ep, "--stats-json", "--log-every", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(controller)
            wait_for(lambda: board_lock_path(name0).exists() or controller.poll() is not None, 60,
                  "the controller to own the collector")
            assert controller.poll() is None, controller.communicate()[1]
            relay = subprocess.Popen(
                [*CLI, "relay", "--board", name1, "--to", loads_ep, "--node-id", "1", "--remote-board", name0,
                 "--tick-ms", "5", "--quiet"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            procs.append(relay)
            reader0 = board0.reader()
            wait_for(lambda: all(s is not None for s in reader0.read_all()), 60,
                  "the relayed ranks to appear on node0's board")
            snaps = reader0.read_all()
            assert snaps[1].num_total_tokens == 900_000 and snaps[1].node_id == 1
            assert snaps[2].num_total_tokens == 0 and snaps[2].node_id == 1

            # nobody else may own the fan-in while the controller does: not by board, not by endpoint
            second = subprocess.run([*CLI, "collect", "--board", name0, "--bind", loads_ep, "--quiet"],
                                    capture_output=True, text=True, timeout=30)
            assert second.returncode == 2
            assert f"already has a collector: pid {controller.pid}" in second.stderr
            with pytest.raises(CollectorBusyError, match=f"pid {controller.pid}"):
                Collector(name0, f"ipc://{tmp_path}/other")
            other_board = new_board_name()
            with Board.create(other_board, n_slots=n), pytest.raises(CollectorBusyError, match="endpoint"):
                Collector(other_board, loads_ep)

            push = connected_push(ctx, in_ep)
            count = 20
            for i in range(count):
                push.send(encode_request(f"r{i}", input_ids=list(range(10))))
            got = [[] for _ in range(n)]
            deadline = time.monotonic() + 60
            while sum(map(len, got)) < count and time.monotonic() < deadline:
                for r, sock in enumerate(workers):
                    while sock.poll(0):
                        got[r].append(msgpack.unpackb(sock.recv(), raw=False)["rid"])
                time.sleep(0.01)
            assert [len(g) for g in got] == [0, 0, count], got

            controller.send_signal(signal.SIGTERM)
            out, err = controller.communicate(timeout=20)
            assert controller.returncode == 0, err
            stats = json.loads(out.strip().splitlines()[-1])
            assert stats["per_rank"] == [0, 0, count]
            assert stats["collector"]["frames_ok"] >= 1 and stats["collector"]["frames_bad"] == 0
            assert not board_lock_path(name0).exists()
            assert not endpoint_lock_path(loads_ep).exists()
        finally:
            publishing.set()
            if publisher is not None:
                publisher.join(timeout=10)
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)
            board1.unlink()
            board0.unlink()


@pytest.mark.parametrize("method", ["round_robin", "follow_bootstrap_room"])
def test_collect_bind_is_refused_when_the_method_reads_no_loads(tmp_path, method):
    res = subprocess.run(
        [*CLI, "controller", "--input", f"ipc://{tmp_path}/in", "--workers", f"ipc://{tmp_path}/w0",
         f"ipc://{tmp_path}/w1", "--method", method, "--collect-bind", f"ipc://{tmp_path}/loads"],
        capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert f"method {method} does not read loads" in res.stderr
    assert "run `dpboard collect --board NAME" in res.stderr


def test_collect_curve_options_need_collect_bind(tmp_path):
    res = subprocess.run(
        [*CLI, "controller", "--input", f"ipc://{tmp_path}/in", "--workers", f"ipc://{tmp_path}/w0",
         "--collect-curve-secret-key", "k.key_secret"],
        capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    assert "give --collect-bind ENDPOINT too" in res.stderr


PAD = b"x" * 200_000  # a frame this large fills a pipe (and the socket buffers under it) in a few sends


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["inflight_tokens", "total_tokens"])
@pytest.mark.parametrize("batched", [True, False])
def test_a_request_whose_send_fails_leaves_no_trace_in_the_ranks_load(board_name, tmp_path, method, batched):
    """Rank 0's scheduler never reads and its pipe holds little: most sends to it fail. Afterwards
    the budget and the in-flight ledger of rank 0 hold exactly what rank 0 received."""
    per_request_tokens = 7
    count = 60
    ctx = zmq.Context()
    eps = [f"ipc://{tmp_path}/w{r}" for r in range(2)]
    in_ep, err_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err"
    with Board.create(board_name, n_slots=2) as board:
        stuck = bound_pull(ctx, eps[0], rcvhwm=1)
        healthy = bound_pull(ctx, eps[1])
        errors = bound_pull(ctx, err_ep)
        dispatcher = Dispatcher(method, 2, reader=board.reader())
        settings = ControllerSettings(send_hwm=1, max_batch=count if batched else 1)
        controller = DataParallelController(dispatcher, eps, in_ep, err_ep, settings=settings)
        thread = threading.Thread(target=controller.run, kwargs={"duration": 30}, daemon=True)
        try:
            push = connected_push(ctx, in_ep)
            frames = [encode_request(f"r{i}", num_tokens=per_request_tokens, routed_dp_rank=0, pad=PAD)
                      for i in range(count)]
            if batched:  # everything queued before the loop starts: it takes them as one batch
                for frame in frames:
                    push.send(frame)
                wait_for(lambda: controller.connections.input.socket.poll(0), 10, "the requests to reach the controller")
                thread.start()
            else:
                thread.start()
                for frame in frames:
                    push.send(frame)
            wait_for(lambda: controller.stats["received"] == count, 20, "the controller to take every request")
            rejected = _drain(errors, quiet=0.3)
            assert len(rejected) == controller.stats["send_dropped"] > 0
            assert all("queue is full" in m["error"] for m in rejected)
            controller.stop()
            thread.join(10)
            assert not thread.is_alive()
            # what the controller got out still flows to rank 0 once its scheduler reads
            delivered = _drain(stuck, quiet=0.5)
            sent = controller.stats["per_rank"][0]
            assert len(delivered) == sent < count
            assert sorted(m["rid"] for m in delivered + rejected) == sorted(f"r{i}" for i in range(count))
            assert controller.stats["retracted"] == count - sent
            budget = dispatcher.budget
            assert budget.sent_reqs[0] == sent
            assert budget.sent_tokens[0] == sent * per_request_tokens
            assert budget.total_requests[0] == sent
            assert budget.total_tokens[0] == sent * per_request_tokens
            if budget.inflight_accounting:
                assert budget.in_flight()[0] == sent
            assert budget.sent_reqs[1] == budget.total_requests[1] == 0
            assert healthy.poll(0) == 0
        finally:
            controller.stop()
            if thread.is_alive():
                thread.join(10)
            controller.close()
            ctx.destroy(linger=0)
