"""The delivery rule (docs/DISPATCH.md, "Delivery"): every request the controller takes is delivered
(a scheduler counts it) or answered with an error, never silently lost, with schedulers that die,
close their socket, or stop publishing. Real processes, boards and ZMQ sockets."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from dpboard import Board, LoadSnapshot
from dpboard.controller import DataParallelController, Dispatcher
from dpboard.controller.codec import encode_request
from dpboard.controller.delivery import DeliveryLedger
from dpboard.snapshot import SEQ_OFFSET, slot_offset
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, wait_for
from tests.support.raw import raw_segment
from tests.support.sockets import bound_pull, connected_push

CLI = [sys.executable, "-m", "dpboard.cli"]


# -- the ledger alone -------------------------------------------------------------------------------


def test_the_ledger_acknowledges_a_prefix_and_hands_back_the_rest():
    ledger = DeliveryLedger(2)
    ledger.start(0, 100)  # the scheduler had counted 100 requests before this controller
    for rid in "abcde":
        ledger.sent(0, rid)
    assert ledger.observe(0, 102) == 2 and list(ledger.pending[0]) == ["c", "d", "e"]
    assert ledger.observe(0, 101) == 0  # a count never takes back what it acknowledged
    assert ledger.observe(0, 103) == 1
    # its connection broke: the highest count seen acknowledges what it can, the rest comes back
    assert ledger.close_epoch(0, 0) == ["d", "e"]
    assert ledger.delivered == 3
    ledger.sent(0, "f")  # a new epoch from the count the rank has now (a restarted scheduler: 0)
    assert ledger.observe(0, 1) == 1 and ledger.unacknowledged() == 0


def test_a_count_beyond_what_was_sent_is_not_taken_for_acknowledgements():
    ledger = DeliveryLedger(1)
    ledger.start(0, 0)
    ledger.sent(0, "a")
    assert ledger.observe(0, 5) == 1  # four of those were not ours
    ledger.sent(0, "b")
    assert ledger.observe(0, 5) == 0 and list(ledger.pending[0]) == ["b"]
    assert ledger.observe(0, 6) == 1


# -- a scheduler killed mid-stream -----------------------------------------------------------------


def _read_rids(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["round_robin", "inflight_tokens"])
def test_a_scheduler_killed_mid_stream_loses_no_request(board_name, tmp_path, method):
    """Three schedulers; rank 1 is SIGKILLed while requests stream in. Every request ends up counted by
    a scheduler (the dead one's count on the board acknowledges a prefix of what it logged) or
    answered with an error: sent = delivered + errored, each exactly once."""
    n = 3
    eps = [f"ipc://{tmp_path}/w{r}" for r in range(n)]
    logs = [tmp_path / f"log-{r}" for r in range(n)]
    in_ep, err_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err"
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    with Board.create(board_name, n_slots=n) as board:
        try:
            for r in range(n):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.support.fake_scheduler", board_name, str(r), eps[r],
                     str(tmp_path / f"out-{r}.json"), "--log", str(logs[r])], cwd=ROOT, stdout=subprocess.PIPE,
                    text=True))
            for p in procs:
                read_line(p, 30)
            errors = bound_pull(ctx, err_ep)
            controller = subprocess.Popen(
                [*CLI, "controller", "--input", in_ep, "--workers", *eps, "--errors", err_ep, "--method", method,
                 "--board", board_name, "--stale-after", "0.5", "--stats-json", "--log-every", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(controller)
            push = connected_push(ctx, in_ep)
            # the controller is up and every scheduler connected before the stream starts
            for r in range(n):
                push.send(encode_request(f"warm{r}", num_tokens=1, routed_dp_rank=r))
            wait_for(lambda: all(f"warm{r}" in _read_rids(logs[r]) for r in range(n)), 30, "the controller to serve")
            sent = [f"warm{r}" for r in range(n)] + [f"q{i}" for i in range(600)]
            done_sending = threading.Event()

            def stream() -> None:
                for i, rid in enumerate(sent[n:]):
                    push.send(encode_request(rid, num_tokens=10 + i % 50))
                    time.sleep(0.002)
                done_sending.set()

            sender = threading.Thread(target=stream, daemon=True)
            sender.start()
            wait_for(lambda: len(_read_rids(logs[1])) >= 30, 30, "rank 1 to receive its first requests")
            procs[1].kill()  # mid-stream, no clean exit
            assert not done_sending.is_set(), "the stream ended before the kill: not mid-stream"
            sender.join(30)
            answered: list[str] = []
            reader = board.reader(stale_after=60)

            def accounted() -> bool:
                while errors.poll(0):
                    answered.append(msgpack.unpackb(errors.recv(), raw=False)["rid"])
                dead_count = reader.read(1).num_received_reqs
                delivered = _read_rids(logs[0]) + _read_rids(logs[2]) + _read_rids(logs[1])[:dead_count]
                return sorted(delivered + answered) == sorted(sent)

            wait_for(accounted, 30, "every request to be counted by a scheduler or answered")
            dead_count = reader.read(1).num_received_reqs
            delivered = _read_rids(logs[0]) + _read_rids(logs[2]) + _read_rids(logs[1])[:dead_count]
            assert len(set(delivered)) == len(delivered), "a request was delivered twice"
            assert not set(delivered) & set(answered)
            assert dead_count >= 1 and len(_read_rids(logs[0])) > 0 and len(_read_rids(logs[2])) > 0
            controller.send_signal(signal.SIGTERM)
            out, err = controller.communicate(timeout=30)
            assert controller.returncode == 0, err
            stats = json.loads(out.strip().splitlines()[-1])
            assert stats["received"] == len(sent)
            assert stats["delivered"] + stats["rejected"] + stats["unacknowledged"] == len(sent)
            assert stats["unacknowledged"] == 0 and stats["disconnects"] == 1
            assert "worker 1" in err and "disconnected" in err
        finally:
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)


# -- a scheduler that closes its socket, or stops publishing (in-process controller) ---------------


class Harness:
    """A controller in a thread, PULL sockets standing in for schedulers, the test publishing loads."""

    def __init__(self, tmp_path: Path, board: Board | None, method: str = "round_robin", n: int = 3,
                 stale_after: float = 0.3, torn_grace: float = 0.5):
        self.ctx = zmq.Context()
        self.eps = [f"ipc://{tmp_path}/w{r}" for r in range(n)]
        self.workers = [bound_pull(self.ctx, ep) for ep in self.eps]
        self.errors = bound_pull(self.ctx, f"ipc://{tmp_path}/err")
        reader = board.reader(stale_after=stale_after) if board is not None else None
        dispatcher = Dispatcher(method, n, reader=reader if method != "round_robin" else None, torn_grace=torn_grace)
        self.controller = DataParallelController(dispatcher, self.eps, f"ipc://{tmp_path}/in",
                                                 f"ipc://{tmp_path}/err", acks=reader)
        self.thread = threading.Thread(target=self.controller.run, kwargs={"duration": 60}, daemon=True)
        self.thread.start()
        self.push = connected_push(self.ctx, f"ipc://{tmp_path}/in")

    def drain(self, rank: int) -> list[str]:
        got = []
        sock = self.workers[rank]
        while sock is not None and sock.poll(0):
            got.append(msgpack.unpackb(sock.recv(), raw=False)["rid"])
        return got

    def answered(self) -> list[dict]:
        got = []
        while self.errors.poll(0):
            got.append(msgpack.unpackb(self.errors.recv(), raw=False))
        return got

    def close(self) -> None:
        self.controller.stop()
        self.thread.join(10)
        self.controller.close()
        self.ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_scheduler_that_closes_its_socket_gets_no_more_requests(tmp_path):
    """Round robin without a board: worker 1 closes its PULL. It used to keep getting every third
    request (lost in a pipe nobody reads: 20 of 40); now the controller sees the disconnect, marks it
    unavailable, and the others take everything."""
    h = Harness(tmp_path, board=None)
    try:
        wait_for(lambda: all(h.controller.dispatcher.available), 10, "the workers to connect")
        h.workers[1].close(linger=0)
        h.workers[1] = None
        wait_for(lambda: h.controller.stats["disconnects"] == 1, 10, "the controller to see the disconnect")
        for i in range(40):
            h.push.send(encode_request(f"r{i}", num_tokens=5))
        got: list[str] = []
        wait_for(lambda: len(got.__iadd__(h.drain(0) + h.drain(2))) == 40, 10, "every request to arrive")
        assert sorted(got) == sorted(f"r{i}" for i in range(40))
        assert h.controller.stats["per_rank"][1] == 0 and h.controller.stats["rejected"] == 0
        # routed to the closed rank: an answer, not a loss
        h.push.send(encode_request("pinned", num_tokens=5, routed_dp_rank=1))
        answers: list[dict] = []
        wait_for(lambda: answers.extend(h.answered()) or answers, 10, "the routed request to be answered")
        assert answers == [{"rid": "pinned", "error": "DP rank 1 is not taking requests (not connected)"}]
    finally:
        h.close()


@pytest.mark.timeout(60)
def test_a_scheduler_whose_slot_goes_stale_gets_no_more_requests_until_it_publishes(board_name, tmp_path):
    with Board.create(board_name, n_slots=3) as board:
        writers = [board.writer(r) for r in range(3)]
        stop = threading.Event()

        def publish(ranks: list[int]) -> None:
            while not stop.wait(0.02):
                for r in ranks:
                    writers[r].publish(LoadSnapshot(r, max_total_num_tokens=100))

        ranks = [0, 2]
        t = threading.Thread(target=publish, args=(ranks,), daemon=True)
        writers[1].publish(LoadSnapshot(1, max_total_num_tokens=100))  # once, then silence: stale in 0.3 s
        t.start()
        h = Harness(tmp_path, board=board, stale_after=0.3)
        try:
            wait_for(lambda: h.controller.dispatcher.available == (True, False, True), 10,
                     "the controller to see ranks 0 and 2 connected and rank 1 stale")
            for i in range(30):
                h.push.send(encode_request(f"a{i}", num_tokens=5))
            got: list[str] = []
            wait_for(lambda: len(got.__iadd__(h.drain(0) + h.drain(2))) == 30, 10, "every request to arrive")
            assert h.drain(1) == []
            ranks.append(1)  # rank 1 publishes again: it takes requests again
            wait_for(lambda: h.controller.dispatcher.available[1], 10, "rank 1 to be live again")
            for i in range(30):
                h.push.send(encode_request(f"b{i}", num_tokens=5))
            got1: list[str] = []
            wait_for(lambda: len(got1.__iadd__(h.drain(1))) >= 10, 10, "rank 1 to get its share")
        finally:
            stop.set()
            t.join(5)
            h.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("torn_grace", [60.0, 0.0])
def test_a_scheduler_caught_mid_write_keeps_its_requests_for_the_torn_grace(board_name, tmp_path, torn_grace):
    """Rank 1's slot is left odd (its writer stopped between its two sequence stores) after it read
    LIVE: within the grace (60 s) it takes its share of the requests; with none (0) it takes none,
    as a writer that died mid-write."""
    with Board.create(board_name, n_slots=3) as board:
        writers = [board.writer(r) for r in range(3)]
        stop = threading.Event()
        ranks = [0, 1, 2]

        def publish() -> None:
            while not stop.wait(0.02):
                for r in list(ranks):
                    writers[r].publish(LoadSnapshot(r, max_total_num_tokens=100))

        t = threading.Thread(target=publish, daemon=True)
        t.start()
        h = Harness(tmp_path, board=board, stale_after=60.0, torn_grace=torn_grace)
        try:
            wait_for(lambda: h.controller.dispatcher.available == (True, True, True), 10,
                     "the controller to see every rank connected and live")
            # its grace runs from an ack read that found it LIVE: wait for one (no such read: torn at once)
            wait_for(lambda: h.controller._torn.live_read_at[1] > 0, 10, "an ack read of rank 1 LIVE")
            ranks.remove(1)
            time.sleep(0.1)  # its last publish is done
            with raw_segment(board.name) as raw:
                seq = struct.unpack_from("<Q", raw, slot_offset(1) + SEQ_OFFSET)[0]
                struct.pack_into("<Q", raw, slot_offset(1) + SEQ_OFFSET, seq + 1)
            if torn_grace == 0.0:
                wait_for(lambda: not h.controller.dispatcher.available[1], 10, "rank 1 to be left")
            else:
                time.sleep(0.5)  # several ack reads find it torn
                assert h.controller.dispatcher.available == (True, True, True)
            for i in range(30):
                h.push.send(encode_request(f"a{i}", num_tokens=5))
            got: dict[int, list[str]] = {0: [], 1: [], 2: []}
            wait_for(lambda: sum(len(got[r].__iadd__(h.drain(r))) for r in got) == 30, 10,
                     "every request to arrive")
            assert board.reader(max_retries=4).status(1).label == "torn"  # torn all along
            # round robin over the ranks that take requests
            assert len(got[1]) == (10 if torn_grace else 0), {r: len(v) for r, v in got.items()}
        finally:
            stop.set()
            t.join(5)
            h.close()


@pytest.mark.timeout(60)
def test_requests_sent_to_a_closed_socket_are_sent_again_once_its_count_says_they_never_arrived(
        board_name, tmp_path):
    """With a board, the requests that reached worker 1's pipe but that it never counted (it closed its
    socket with them queued) go to the other ranks once its last count is in."""
    with Board.create(board_name, n_slots=3) as board:
        writers = [board.writer(r) for r in range(3)]
        counts = [0, 0, 0]
        stop = threading.Event()

        def publish() -> None:
            while not stop.wait(0.02):
                for r in range(3):
                    writers[r].publish(LoadSnapshot(r, max_total_num_tokens=100, num_received_reqs=counts[r]))

        t = threading.Thread(target=publish, daemon=True)
        t.start()
        h = Harness(tmp_path, board=board, stale_after=0.3)
        try:
            wait_for(lambda: all(h.controller.dispatcher.available), 10, "the workers to connect")
            for i in range(30):
                h.push.send(encode_request(f"r{i}", num_tokens=5))
            wait_for(lambda: h.controller.stats["dispatched"] == 30, 10, "every request to be dispatched")
            time.sleep(0.2)  # in worker 1's queue, unread
            first = h.drain(1)[:3]  # it counts three of what it read, then closes: the rest died with it
            counts[1] = len(first)
            time.sleep(0.1)
            h.workers[1].close(linger=0)
            h.workers[1] = None
            got = [*first]
            wait_for(lambda: len(got.__iadd__(h.drain(0) + h.drain(2))) == 30, 10,
                     "the unacknowledged requests to reach the other ranks")
            assert sorted(got) == sorted(f"r{i}" for i in range(30))
            stats = h.controller.stats
            assert stats["redelivered"] == 10 - 3 and stats["rejected"] == 0
        finally:
            stop.set()
            t.join(5)
            h.close()
