"""The ZMQ controller process end to end: real sockets, fake scheduler processes publishing to a real
board, malformed frames, the error channel. Run as a script, this file is the fake scheduler."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import msgpack
import pytest
import zmq

from dpboard import Board
from dpboard.controller.codec import encode_request
from tests.support.names import ROOT
from tests.support.procutil import kill, wait_for


def _controller_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dpboard.cli", "controller", *args]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["inflight_tokens", "inflight_backlog", "inflight_cache", "round_robin"])
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
            errors = ctx.socket(zmq.PULL)
            errors.setsockopt(zmq.LINGER, 0)
            errors.bind(err_ep)
            reader = board.reader()
            wait_for(lambda: all(s is not None for s in reader.read_all()), 20, "the schedulers' first publish")
            controller = subprocess.Popen(
                _controller_cmd("--input", in_ep, "--workers", *ep.values(), "--errors", err_ep,
                                "--method", method, "--board", board_name, "--stats-json", "--log-every", "60"),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            procs.append(controller)
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(in_ep)

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

            assert errors.poll(20_000), "no error answer for the invalid routed rank"
            reply = msgpack.unpackb(errors.recv(), raw=False)
            assert reply == {"rid": "bad-rank", "error": "DP rank 7 is not active."}
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
