"""One bad request must not take the cluster down: real ``dpboard controller`` processes, real
scheduler processes and real ZMQ sockets.

A frame the controller's reader accepted but msgpack refused (a str holding bytes ff fe) once
reached a demo scheduler, which exited on it; the controller then sent the unacknowledged request
to the next rank, which exited too, until none was left ("redelivered 3"). Now the controller
refuses such a frame and answers it, a scheduler survives a frame it cannot use, and a request
whose receivers keep dying is redelivered at most ``--max-redeliveries`` times, then answered."""

from __future__ import annotations

import json
import os
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
from tests.support.sockets import bound_pull, connected_push

CLI = [sys.executable, "-m", "dpboard.cli", "controller"]


def _errors_until(sock: zmq.Socket, n: int, timeout_ms: int = 30_000) -> list[dict]:
    got = []
    while len(got) < n and sock.poll(timeout_ms):
        got.append(msgpack.unpackb(sock.recv()))
    return got


def _stats(controller: subprocess.Popen) -> tuple[dict, str]:
    controller.send_signal(signal.SIGTERM)
    out, err = controller.communicate(timeout=30)
    assert controller.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


# The frames of issue 28, rid first (as encode_request writes it): each one msgpack refuses.
POISON = {
    "poison-utf8": b"\x83\xa3rid\xabpoison-utf8\xaanum_tokens\x05\xa4note\xa2\xff\xfe",
    "poison-ext": b"\x83\xa3rid\xaapoison-ext\xaanum_tokens\x05\xa4note\xd4\xfb\x00",
    "poison-ts3": b"\x83\xa3rid\xaapoison-ts3\xaanum_tokens\x05\xa4note\xc7\x03\xff\x00\x00\x00",
    "poison-key": b"\x83\xa3rid\xaapoison-key\xaanum_tokens\x05\x91\x00\x01",
}


@pytest.mark.timeout(180)
def test_a_poison_frame_is_answered_and_every_demo_scheduler_stays_alive(board_name, tmp_path):
    n = 3
    eps = [f"ipc://{tmp_path}/sched-{r}" for r in range(n)]
    in_ep, err_ep, results_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err", f"ipc://{tmp_path}/results"
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    with Board.create(board_name, n_slots=n) as board:
        try:
            results = bound_pull(ctx, results_ep)
            errors = bound_pull(ctx, err_ep)
            for r in range(n):
                with open(tmp_path / f"sched-{r}.err", "w") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "dpboard.demo.scheduler", "--board", board_name, "--rank", str(r),
                         "--requests", eps[r], "--results", results_ep, "--step-ms", "10"],
                        cwd=ROOT, env=env, stderr=log))
            reader = board.reader(stale_after=60)
            wait_for(lambda: all(s is not None for s in reader.read_all()) or any(p.poll() is not None for p in procs),
                     120, "the demo schedulers' first publish")
            controller = subprocess.Popen(
                CLI + ["--input", in_ep, "--workers", *eps, "--errors", err_ep, "--method", "round_robin",
                       "--board", board_name, "--stats-json", "--log-every", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            push = connected_push(ctx, in_ep)
            for frame in POISON.values():
                push.send(frame)
            answers = _errors_until(errors, len(POISON))
            assert sorted(a["rid"] for a in answers) == sorted(POISON)
            assert all(a["error"].startswith("malformed request frame: not msgpack (") for a in answers), answers

            # and straight to a scheduler, past the controller: frames it cannot use are dropped, counted
            direct = connected_push(ctx, eps[0])
            direct.send(POISON["poison-utf8"])
            direct.send(msgpack.packb({"rid": "bad-type", "num_tokens": "many"}))
            direct.send(msgpack.packb([1, 2]))
            wait_for(lambda: reader.read_all()[0].num_received_reqs >= 3, 30, "rank 0 to count the direct frames")

            good = [f"good-{i}" for i in range(30)]
            for rid in good:
                push.send(encode_request(rid, num_tokens=20, output_len=3))
            done: set = set()

            def finished() -> bool:
                while results.poll(0):
                    done.update(rec["rid"] for rec in msgpack.unpackb(results.recv())["done"])
                return done >= set(good)

            wait_for(finished, 60, "every good request to be served")
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]  # every scheduler alive
            stats, err = _stats(controller)
            assert stats["malformed"] == len(POISON) and stats["dispatched"] == len(good)
            assert stats["redelivered"] == 0 and stats["rejected"] == 0
            assert "(rid 'poison-utf8', answered)" in err
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                assert p.wait(timeout=30) == 0
            said = (tmp_path / "sched-0.err").read_text()
            assert said.count("scheduler rank 0: dropped a request frame it cannot use") == 3, said
            assert "not msgpack: UnicodeDecodeError" in said and "num_tokens must be an int >= 0" in said
        finally:
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_redeliveries", [0, 1])
def test_a_request_that_kills_its_receivers_is_redelivered_at_most_n_times(board_name, tmp_path, max_redeliveries):
    """Each scheduler that takes the poison request dies of it (SIGKILL, before counting it). Without
    a bound the controller sent it to every rank in turn, until none was left."""
    n = 3
    eps = [f"ipc://{tmp_path}/sched-{r}" for r in range(n)]
    in_ep, err_ep = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/err"
    ctx = zmq.Context()
    procs: list[subprocess.Popen] = []
    with Board.create(board_name, n_slots=n) as board:
        try:
            errors = bound_pull(ctx, err_ep)
            for r in range(n):
                with open(tmp_path / f"took-{r}", "w") as took:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "tests.controller.dying_scheduler", board_name, str(r), eps[r]],
                        cwd=ROOT, stdout=took))
            reader = board.reader(stale_after=60)
            wait_for(lambda: all(s is not None for s in reader.read_all()), 60, "the schedulers' first publish")
            controller = subprocess.Popen(
                CLI + ["--input", in_ep, "--workers", *eps, "--errors", err_ep, "--method", "round_robin",
                       "--board", board_name, "--stale-after", "0.5", "--max-redeliveries", str(max_redeliveries),
                       "--stats-json", "--log-every", "60"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            push = connected_push(ctx, in_ep)
            push.send(encode_request("poison", num_tokens=5))
            answers = _errors_until(errors, 1, 60_000)
            who = "a scheduler whose connection" if max_redeliveries == 0 else "2 schedulers whose connections"
            assert answers == [{"rid": "poison", "error": (
                f"the request was lost by {who} broke before acknowledging it; it is not sent again "
                f"(max_redeliveries {max_redeliveries})")}]
            dead = [r for r, p in enumerate(procs) if p.poll() is not None]
            assert len(dead) == max_redeliveries + 1, dead
            assert all(procs[r].returncode == -signal.SIGKILL for r in dead)
            for r in range(n):  # the dead took the poison request, the living never saw it
                took = (tmp_path / f"took-{r}").read_text().split()
                assert took == (["poison"] if r in dead else [])
            alive = [r for r in range(n) if r not in dead]
            good = [f"good-{i}" for i in range(10)]
            for rid in good:
                push.send(encode_request(rid, num_tokens=5))
            wait_for(lambda: sum(reader.read_all()[r].num_received_reqs for r in alive) == len(good), 30,
                     "the good requests to reach the living schedulers")
            assert not errors.poll(0)
            stats, err = _stats(controller)
            assert stats["redelivered"] == max_redeliveries and stats["redelivery_exhausted"] == 1
            assert stats["rejected"] == 1 and stats["disconnects"] == max_redeliveries + 1
            assert stats["dispatched"] == max_redeliveries + 1 + len(good)
            assert "(1 lost too often)" in err
        finally:
            for p in procs:
                kill(p)
            ctx.destroy(linger=0)


@pytest.mark.parametrize(("value", "words"), [
    ("101", "argument --max-redeliveries: 101 is outside [0, 100]"),
    ("-1", "argument --max-redeliveries: -1 is outside [0, 100]"),
    ("two", "argument --max-redeliveries"),
])
def test_a_bad_max_redeliveries_is_refused_at_start(tmp_path, value, words):
    res = subprocess.run(CLI + ["--input", f"ipc://{tmp_path}/in", "--workers", f"ipc://{tmp_path}/w0",
                                "--max-redeliveries", value, "--duration", "0.5"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("value", [True, -1, 101, 1.0])
def test_the_library_refuses_a_bad_max_redeliveries(tmp_path, value):
    from dpboard.controller.process import ControllerSettings
    from dpboard.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"max_redeliveries must be an int in 0\.\.100"):
        ControllerSettings(max_redeliveries=value)
