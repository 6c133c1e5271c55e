"""The ZMQ controller process end to end: real sockets, fake scheduler processes publishing to a real
board, malformed frames, the error channel. Run as a script, this file is the fake scheduler."""

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

from dpboard import Board
from dpboard.controller.codec import encode_request
from tests.support.names import ROOT
from tests.support.procutil import kill, stop, wait_for, wait_until
from tests.support.sockets import bound_pull, connected_push


def _controller_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dpboard.cli", "controller", *args]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["inflight_tokens", "inflight_backlog", "inflight_cache", "inflight_ttft", "round_robin"])
def test_controller_dispatches_to_scheduler_processes_and_survives_bad_frames(board_name, tmp_path, method):
    n = 3
    ep = {r: f"ipc://{tmp_path}/sched-{r}" for r in range(n)}
    in_ep, err_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err"
    procs: list[subprocess.Popen] = []
    ctx = zmq.Context()
    with Board.create(board_name, n_slots=n) as board:
        try:
            for r in range(n):
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.fake_scheduler", board_name, str(r), ep[r],
                                               str(tmp_path / f"out-{r}.json")], cwd=ROOT))
            errors = bound_pull(ctx, err_ep)
            reader = board.reader()
            wait_for(lambda: all(s is not None for s in reader.read_all()), 20, "the schedulers' first publish")
            controller = subprocess.Popen(
                _controller_cmd("--input", in_ep, "--workers", *ep.values(), "--errors", err_ep,
                                "--method", method, "--board", board_name, "--stats-json", "--log-every", "60"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            procs.append(controller)
            push = connected_push(ctx, in_ep)

            valid = []
            for i in range(30):
                routed = 2 if i % 10 == 0 else None
                valid.append((f"a{i}", routed))
                push.send(encode_request(f"a{i}", input_ids=list(range(10 + 7 * i)), routed_dp_rank=routed))
            malformed = [
                b"\xc1 not msgpack",
                msgpack.packb([1, 2, 3]),
                msgpack.packb({"input_ids": [1, 2]}),  # no rid
                msgpack.packb({"rid": "m", "input_ids": "abc"}),
                msgpack.packb({"rid": "m", "num_tokens": 4, "routed_dp_rank": "two"}),
            ]
            for frame in malformed:
                push.send(frame)
            push.send_multipart([b"two", b"frames"])
            push.send(encode_request("bad-rank", num_tokens=5, routed_dp_rank=7))
            for i in range(10):
                valid.append((f"b{i}", None))
                push.send(encode_request(f"b{i}", num_tokens=100 + i))

            replies = []
            for _ in range(3):  # the two malformed frames whose rid could be read, then the invalid rank
                assert errors.poll(20_000), f"no error answer after {replies}"
                replies.append(msgpack.unpackb(errors.recv(), raw=False))
            assert replies == [{"rid": "m", "error": "malformed request frame: input_ids must be a list, got str"},
                               {"rid": "m", "error": "malformed request frame: routed_dp_rank must be an int or "
                                                     "nil, got str"},
                               {"rid": "bad-rank", "error": "DP rank 7 is not active."}]
            wait_for(lambda: sum(s.num_received_reqs for s in reader.read_all()) == len(valid), 20,
                  "every valid request to reach a scheduler")

            controller.send_signal(signal.SIGTERM)
            out, err = controller.communicate(timeout=20)
            assert controller.returncode == 0, err
            stats = json.loads(out.strip().splitlines()[-1])
            assert stats["received"] == len(valid) + len(malformed) + 2
            assert stats["malformed"] == len(malformed) + 1
            assert stats["rejected"] == 1
            assert stats["dispatched"] == len(valid) == sum(stats["per_rank"])
            assert "malformed request frame" in err

            for p in procs[:n]:
                p.send_signal(signal.SIGTERM)
            for p in procs[:n]:
                assert p.wait(timeout=20) == 0
            got = {}
            for r in range(n):
                data = json.loads((tmp_path / f"out-{r}.json").read_text())
                for rid in data["rids"]:
                    assert rid not in got, f"{rid} delivered twice"
                    got[rid] = data["rank"]
            assert sorted(got) == sorted(rid for rid, _ in valid)
            assert all(got[rid] == routed for rid, routed in valid if routed is not None)
            assert sorted(got[rid] for rid, _ in valid).count(0) > 0  # the policy used more than one rank
            assert len(set(got.values())) == n
        finally:
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)


def test_controller_cli_explains_a_missing_board(tmp_path):
    res = subprocess.run(
        _controller_cmd("--input", f"ipc://{tmp_path}/in", "--workers", f"ipc://{tmp_path}/w0",
                        "--method", "total_tokens"),
        capture_output=True, text=True, timeout=30,
    )
    assert res.returncode == 2
    assert "give --board NAME" in res.stderr


def test_controller_cli_rejects_an_unknown_method(tmp_path):
    res = subprocess.run(
        _controller_cmd("--input", f"ipc://{tmp_path}/in", "--workers", "w", "--method", "fastest"),
        capture_output=True, text=True, timeout=30,
    )
    assert res.returncode == 2
    assert "invalid choice: 'fastest'" in res.stderr


def test_controller_refuses_an_active_rank_without_endpoint(tmp_path):
    from dpboard.controller import DataParallelController, Dispatcher

    d = Dispatcher("round_robin", 2)
    with pytest.raises(ValueError, match=r"active ranks \[1\] have no worker endpoint"):
        DataParallelController(d, [f"ipc://{tmp_path}/w0", None], f"ipc://{tmp_path}/in")


# -- bad endpoints and options: a clear error, every socket closed, no hang ---------------------


@pytest.mark.parametrize(("args", "words"), [
    (["--workers", "bogus"], "--workers (rank 0) 'bogus' is not a ZMQ endpoint"),
    (["--workers", "tcp://127.0.0.1:99999"], "port 99999 is outside 1..65535"),
    (["--workers", "tcp://-:5"], "cannot connect worker 0 on tcp://-:5: Invalid argument"),  # ZMQ refuses it
    (["--workers", "ipc:///tmp/w", "--errors", "tcp://-:5"], "cannot connect the error channel on tcp://-:5"),
    (["--workers", "ipc:///tmp/w", "--send-hwm", "-5"], "argument --send-hwm: -5 is outside [1, 100000000]"),
    (["--workers", "ipc:///tmp/w", "--stale-after", "inf"], "argument --stale-after: 'inf' is not a finite number"),
    (["--workers", "ipc:///tmp/w", "--stale-after", "1e10"], "argument --stale-after: 1e10 is outside"),
    (["--workers", "ipc:///tmp/w", "--duration", "0"], "argument --duration: 0 is outside (0, 1e+06] seconds"),
])
def test_a_bad_endpoint_or_option_fails_at_once_and_leaves_nothing_open(tmp_path, args, words):
    """`--workers bogus` (and `--send-hwm -5`) used to hang forever: the socket that failed was never
    closed, so Context.term() blocked."""
    in_ep = f"ipc://{tmp_path}/in"
    res = subprocess.run(_controller_cmd("--input", in_ep, *args, "--duration", "0.5"), capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2, res.stderr
    assert words in res.stderr and "Traceback" not in res.stderr
    from dpboard.ownership import endpoint_lock_path

    assert not endpoint_lock_path(in_ep).exists()  # the input's lock went with it


def test_a_controller_that_fails_to_start_closes_its_sockets_and_can_be_started_again(tmp_path):
    from dpboard.controller import DataParallelController, Dispatcher
    from dpboard.errors import UnavailableError

    in_ep = f"ipc://{tmp_path}/in"
    ctx = zmq.Context()
    try:
        with pytest.raises(UnavailableError, match=r"cannot connect worker 1 on tcp://-:5"):
            DataParallelController(Dispatcher("round_robin", 2), [f"ipc://{tmp_path}/w0", "tcp://-:5"], in_ep,
                                   context=ctx)
        # nothing was left bound or locked, and the shared context terminates at once
        with DataParallelController(Dispatcher("round_robin", 1), [f"ipc://{tmp_path}/w0"], in_ep, context=ctx):
            pass
    finally:
        ctx.term()


# -- one owner of an ipc:// input ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_second_controller_on_the_same_input_is_refused_and_the_first_keeps_serving(tmp_path):
    """ZMQ lets a second ipc:// bind take the path over silently: the first controller then received
    nothing. The second must fail at start, naming the first."""
    in_ep, w_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/w0"
    ctx = zmq.Context()
    worker = bound_pull(ctx, w_ep)
    first = subprocess.Popen(_controller_cmd("--input", in_ep, "--workers", w_ep, "--log-every", "60"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        from dpboard.ownership import endpoint_lock_path

        wait_for(lambda: endpoint_lock_path(in_ep).exists() or first.poll() is not None, 20, "the first to start")
        second = subprocess.run(_controller_cmd("--input", in_ep, "--workers", w_ep, "--duration", "5"),
                                capture_output=True, text=True, timeout=30)
        assert second.returncode == 2
        assert f"endpoint {in_ep} already has an owner: pid {first.pid}" in second.stderr
        push = connected_push(ctx, in_ep)
        push.send(encode_request("still-mine", num_tokens=3))
        assert worker.poll(20_000), "the first controller no longer receives"
        assert msgpack.unpackb(worker.recv(), raw=False)["rid"] == "still-mine"
        stop(first)
        assert first.returncode == 0 and not endpoint_lock_path(in_ep).exists()  # a clean exit frees it
    finally:
        kill(first)
        ctx.destroy(linger=0)


# -- a request too large for the budget ------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["inflight_tokens", "round_robin"])
def test_a_request_above_the_size_bound_is_answered_with_an_error(board_name, tmp_path, method):
    in_ep, err_ep, w_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err", f"ipc://{tmp_path}/w0"
    ctx = zmq.Context()
    with Board.create(board_name, n_slots=2) as board:
        board.writer(0).publish_values(0, 0, 0, 0, 0, 100, 0)
        board.writer(1).publish_values(0, 0, 0, 0, 0, 100, 0)
        workers = [bound_pull(ctx, ep) for ep in (w_ep, f"ipc://{tmp_path}/w1")]
        errors = bound_pull(ctx, err_ep)
        controller = subprocess.Popen(
            _controller_cmd("--input", in_ep, "--workers", w_ep, f"ipc://{tmp_path}/w1", "--errors", err_ep,
                            "--method", method, "--board", board_name, "--stale-after", "60", "--stats-json"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            push = connected_push(ctx, in_ep)
            push.send(encode_request("huge", num_tokens=2**63 - 1))
            push.send(encode_request("fine", num_tokens=10))
            assert errors.poll(20_000)
            assert msgpack.unpackb(errors.recv(), raw=False) == {
                "rid": "huge", "error": f"request of {2**63 - 1} tokens is larger than the 4294967296 tokens a "
                                        f"request may have"}
            wait_for(lambda: any(w.poll(0) for w in workers), 20, "the good request to be dispatched")
            controller.send_signal(signal.SIGTERM)
            out, err = controller.communicate(timeout=20)
            stats = json.loads(out.strip().splitlines()[-1])
            assert stats["rejected"] == 1 and stats["dispatched"] == 1 and stats["malformed"] == 0
        finally:
            kill(controller)
            ctx.destroy(linger=0)


# -- a board recreated under the controller --------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_controller_follows_a_recreated_board(board_name, tmp_path):
    """Unlink and recreate the board while the schedulers publish: the controller used to keep the old
    mapping, whose slots went stale a second later, and then rejected every request ("no DP rank can
    take the request")."""
    n = 2
    eps = [f"ipc://{tmp_path}/w{r}" for r in range(n)]
    in_ep, err_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err"
    ctx = zmq.Context()
    current = {"board": Board.create(board_name, n_slots=n)}
    current["writers"] = [current["board"].writer(r) for r in range(n)]
    stop = threading.Event()

    def publish() -> None:
        while not stop.wait(0.02):
            for w in current["writers"]:
                w.publish_values(0, 0, 0, 0, 0, 1000, 0)

    publisher = threading.Thread(target=publish, daemon=True)
    publisher.start()
    workers = [bound_pull(ctx, ep) for ep in eps]
    errors = bound_pull(ctx, err_ep)
    controller = subprocess.Popen(
        _controller_cmd("--input", in_ep, "--workers", *eps, "--errors", err_ep, "--method", "inflight_tokens",
                        "--board", board_name, "--stale-after", "0.3", "--stats-json"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        push = connected_push(ctx, in_ep)

        def send_and_count(prefix: str, count: int) -> None:
            for i in range(count):
                push.send(encode_request(f"{prefix}{i}", num_tokens=5))
            got = []

            def arrived() -> bool:
                for w in workers:
                    while w.poll(0):
                        got.append(w.recv())
                return len(got) == count

            wait_for(arrived, 20, f"the {prefix} requests to reach the schedulers")

        send_and_count("before", 10)
        old = current["board"]
        old.close()
        old.unlink()
        new = Board.create(board_name, n_slots=n)
        current["writers"] = [new.writer(r) for r in range(n)]
        current["board"] = new
        time.sleep(1.0)  # the old board's slots are stale by now
        send_and_count("after", 20)
        assert not errors.poll(0), msgpack.unpackb(errors.recv(), raw=False)
        controller.send_signal(signal.SIGTERM)
        out, err = controller.communicate(timeout=20)
        assert controller.returncode == 0, err
        assert f"board '{board_name}' was replaced" in err and "attached the new one" in err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["dispatched"] == 30 and stats["rejected"] == 0
    finally:
        stop.set()
        publisher.join(5)
        kill(controller)
        ctx.destroy(linger=0)
        current["board"].close()
        current["board"].unlink()


def _peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(120)
def test_a_msgpack_bomb_is_refused_without_stalling_or_reaching_a_scheduler(tmp_path):
    """16 MB frames whose input_ids are 16M empty maps once took 4.7 s and 1.16 GB each to decode,
    and the non-integer input_ids reached the schedulers as valid requests. The frame is read
    without an object per element and refused at its first non-int; a frame over MAX_FRAME_BYTES is
    dropped by ZMQ; frames with str16 keys, repeated keys or deep unrelated nesting are read by one
    rule. Every valid request still goes out, and the controller's memory stays near its frames'."""
    from dpboard.controller.connections import MAX_FRAME_BYTES

    ep = [f"ipc://{tmp_path}/sched-{r}" for r in range(2)]
    in_ep = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    pulls = [bound_pull(ctx, e) for e in ep]
    controller = subprocess.Popen(_controller_cmd("--input", in_ep, "--workers", *ep, "--method", "round_robin",
                                                  "--stats-json", "--log-every", "60"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        push = connected_push(ctx, in_ep)
        bomb = b"\x82\xa3rid\xa4bomb\xa9input_ids\xdd" + (16 * 2**20).to_bytes(4, "big") + b"\x80" * (16 * 2**20)
        for _ in range(3):
            push.send(bomb)
        strings = msgpack.packb({"rid": "s", "input_ids": ["a", "b"]})
        floats = msgpack.packb({"rid": "f", "input_ids": [1, 2.5]})
        maps = msgpack.packb({"rid": "m", "input_ids": [{}, {}]})
        # msgpack itself refuses more than 1024 levels (and packs fewer)
        too_deep = b"\x83\xa3rid\xa1d\xaanum_tokens\x03\xa5extra" + b"\x91" * 1100 + b"\x00"
        for frame in (strings, floats, maps, too_deep):
            push.send(frame)
        # str16 key for input_ids, and a repeated rid (the last counts, as msgpack reads a map)
        str16 = b"\x83\xa3rid\xa2ok\xda\x00\x09input_ids\x93\x01\x02\x03\xa3rid\xa3ok2"
        push.send(str16)
        push.send(encode_request("after", input_ids=[5, 6, 7]))
        got = []
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            for sock in pulls:
                if sock.poll(50):
                    got.append(msgpack.unpackb(sock.recv(), raw=False))
        assert sorted(m["rid"] for m in got) == ["after", "ok2"]
        assert all(isinstance(t, int) for m in got for t in m["input_ids"])
        peak = _peak_rss_mb(controller.pid)
        assert peak < 3 * 16 + 250, f"the controller peaked at {peak:.0f} MB"
        over = connected_push(ctx, in_ep)  # a frame over the bound: ZMQ drops it (and its connection)
        over.send(encode_request("huge", input_ids=[1]) + b"\x00" * MAX_FRAME_BYTES)
        push.send(encode_request("last", num_tokens=4))
        assert any(sock.poll(20_000) for sock in pulls)
        rids = [msgpack.unpackb(sock.recv(), raw=False)["rid"] for sock in pulls if sock.poll(100)]
        assert rids == ["last"]
        controller.send_signal(signal.SIGTERM)
        out, err = controller.communicate(timeout=30)
        assert controller.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["malformed"] == 3 + 4 and stats["dispatched"] == 3
        assert "input_ids[0] is not an integer" in err and "nested too deeply" in err
    finally:
        kill(controller)
        ctx.destroy(linger=0)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_the_delivery_ledger_stays_bounded_when_ranks_never_count(board_name, tmp_path):
    """On a board whose ranks never count num_received_reqs (a vLLM board, schedulers that pass no
    count), 4,000 requests of 70 KB once took the controller from 39 to 330 MB: every frame was kept
    for a redelivery that could never be decided. The ledger lets such a rank go after
    UNCOUNTED_AFTER requests and says once, clearly, that delivery cannot be proven there."""
    from dpboard.controller.delivery import UNCOUNTED_AFTER

    n = 2
    ep = {r: f"ipc://{tmp_path}/sched-{r}" for r in range(n)}
    in_ep = f"ipc://{tmp_path}/in"
    procs: list[subprocess.Popen] = []
    ctx = zmq.Context()
    with Board.create(board_name, n_slots=n) as board:
        try:
            for r in range(n):
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.fake_scheduler", board_name,
                                               str(r), ep[r], str(tmp_path / f"out-{r}.json"), "--no-count"],
                                              cwd=ROOT))
            reader = board.reader()
            wait_for(lambda: all(s is not None for s in reader.read_all()), 20, "the schedulers' first publish")
            controller = subprocess.Popen(
                _controller_cmd("--input", in_ep, "--workers", *ep.values(), "--method", "inflight_tokens",
                                "--board", board_name, "--stats-json", "--log-every", "60"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(controller)
            push = connected_push(ctx, in_ep)
            payload = "x" * 70_000
            for burst in range(20):  # paced, so that ZMQ's queues stay short and the ledger is what is measured
                for i in range(200):
                    push.send(encode_request(f"r{burst}-{i}", num_tokens=10, prompt=payload))
                wait_for(lambda b=burst: sum(s.num_waiting_reqs for s in reader.read_all()) == 200 * (b + 1), 60,
                         "every request to reach a scheduler")
            peak = _peak_rss_mb(controller.pid)
            controller.send_signal(signal.SIGTERM)
            out, err = controller.communicate(timeout=30)
            assert controller.returncode == 0, err
            stats = json.loads(out.strip().splitlines()[-1])
            assert stats["dispatched"] == 4000 and stats["delivered"] == 0
            assert stats["unacknowledged"] == 0 and stats["untracked"] == 4000
            assert err.count("delivery cannot be proven on this board") == 1
            assert f"took {UNCOUNTED_AFTER} requests without counting one" in err
            assert peak < 150, f"the controller peaked at {peak:.0f} MB"  # 4,000 frames kept: 280 MB more
        finally:
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)


@pytest.mark.timeout(120)
def test_a_sigterm_while_the_controller_starts_is_a_clean_exit(board_name, tmp_path):
    """The dispatch record appears before the sockets are set up, and SIGTERM used to meet the
    default handler then (exit -15, the record and lock files left). Signals count from the start."""
    from pathlib import Path

    from dpboard.board.dispatch_record import dispatch_record_path

    with Board.create(board_name, n_slots=2):
        for i in range(3):
            proc = subprocess.Popen(_controller_cmd("--input", f"ipc://{tmp_path}/in{i}", "--workers",
                                                    f"ipc://{tmp_path}/w0", f"ipc://{tmp_path}/w1", "--board",
                                                    board_name, "--method", "round_robin"),
                                    stderr=subprocess.PIPE, text=True)
            try:
                # at once: the old window was a few milliseconds wide
                assert wait_until(lambda p=proc: Path(dispatch_record_path(board_name)).exists() or p.poll() is not None,
                                  timeout=30, interval=0.001)
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=30)
            finally:
                kill(proc)
            assert proc.returncode == 0, err
            assert not Path(dispatch_record_path(board_name)).exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "horizon"), [((), 6), (("--prefill-delayer",), 2),
                                               (("--prefill-delayer", "--lockstep-horizon", "4"), 4)],
                         ids=["default", "delayer", "given"])
def test_the_controller_takes_the_delayers_horizon_for_inflight_lockstep(board_name, tmp_path, args, horizon):
    # the engines run SGLang's --enable-prefill-delayer: the same horizon the SGLang plugin picks
    in_ep, w_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/w0"
    ctx = zmq.Context()
    bound_pull(ctx, w_ep)
    with Board.create(board_name, n_slots=1):
        proc = subprocess.Popen(_controller_cmd("--input", in_ep, "--workers", w_ep, "--method", "inflight_lockstep",
                                                "--board", board_name, "--log-every", "60", *args),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines: list[str] = []

            def said() -> bool:
                lines.append(proc.stderr.readline())
                return "controller: method" in lines[-1] or proc.poll() is not None

            wait_for(said, 60, "the controller's method line")
            assert f"method inflight_lockstep (horizon {horizon} group steps)" in lines[-1], lines
            stop(proc)
            assert proc.returncode == 0
        finally:
            kill(proc)
            ctx.destroy(linger=0)
