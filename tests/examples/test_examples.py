"""Every script in examples/ runs, briefly, as a user would run it, and says what it should."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpboard import Board, LoadSnapshot
from tests.support.names import ROOT
from tests.support.procutil import read_line, stop

EXAMPLES = ROOT / "examples"
PYTHON = sys.executable


def run_example(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@contextlib.contextmanager
def publishing(board: Board, snapshot: LoadSnapshot) -> Iterator[None]:
    """``snapshot`` published every 50 ms while the example runs: its rank stays live however long
    the example takes to start (a single publish goes stale after 1 s on a busy machine)."""
    stop_event = threading.Event()
    writer = board.writer(snapshot.dp_rank)

    def run() -> None:
        while True:
            writer.publish(snapshot)
            if stop_event.wait(0.05):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop_event.set()
        thread.join(10)
        writer.close()


def test_every_example_has_a_test():
    tested = {m.group(1) for m in re.finditer(r'"(\w+\.py)"', Path(__file__).read_text())}
    assert {p.name for p in EXAMPLES.glob("*.py")} <= tested


def test_embed_writer(board_name):
    out = run_example("embed_writer.py", "--board", board_name, "--steps", "50", "--interval", "0",
                      "--backend", "numba")
    assert out.returncode == 0, out.stderr
    assert "published 50 snapshots from rank 0 (numba)" in out.stdout
    assert not (Path("/dev/shm") / f"dpboard.{board_name}").exists()  # it created the board, so it removed it


def test_run_controller():
    out = run_example("run_controller.py")
    assert out.returncode == 0, out.stderr
    received = [int(n) for n in re.findall(r"rank \d: received (\d+) requests", out.stdout)]
    assert len(received) == 2 and sum(received) == 500 and min(received) > 0, out.stdout
    assert "'dispatched': 500" in out.stdout and "'rejected': 0" in out.stdout
    assert "'delivered': 500" in out.stdout  # the schedulers' published counts acknowledged every one


def test_relay_two_nodes():
    out = run_example("relay_two_nodes.py")
    assert out.returncode == 0, out.stderr
    ranks = dict(re.findall(r"rank (\d): node (\d)", out.stdout))
    # node0's board shows its own four ranks and node1's four, relayed
    assert ranks == {**{str(r): "0" for r in range(4)}, **{str(r): "1" for r in range(4, 8)}}, out.stdout
    assert re.search(r"rank 7: node 1, running 7, waiting 19", out.stdout), out.stdout
    assert "(frames_dropped: ticks whose frame could not be queued" in out.stdout


def test_watch_board(board_name):
    with Board.create(board_name, n_slots=2) as board, publishing(
            board, LoadSnapshot(dp_rank=0, num_total_tokens=300, max_total_num_tokens=1000)):
        out = run_example("watch_board.py", board_name, "--seconds", "1.2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) >= 2
    assert f"{board_name}: 1 live, 0 stale, imbalance 1.00, total tokens 300" in lines[0]


def test_serve_board(board_name):
    with Board.create(board_name, n_slots=2) as board, publishing(
            board, LoadSnapshot(dp_rank=1, num_total_tokens=77, max_total_num_tokens=1000)):
        proc = subprocess.Popen([PYTHON, str(EXAMPLES / "serve_board.py"), board_name], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            deadline = time.monotonic() + 30
            lines = []
            while not lines or not lines[-1].startswith("serving board"):
                lines.append(read_line(proc, max(1.0, deadline - time.monotonic())))
            assert any(re.match(r"rank 1: live\s+total tokens 77", line) for line in lines), lines
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)  # a loaded machine: the exit is bounded, generously
            assert proc.returncode == 0
        finally:
            stop(proc)


@pytest.mark.timeout(300)
def test_compare_methods():
    out = run_example("compare_methods.py", "--trace", "bursty", "--ranks", "4", "--seeds", "1",
                      "--methods", "total_tokens,inflight_tokens", timeout=280)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^\| total_tokens \|", out.stdout, re.M) and re.search(r"^\| inflight_tokens \|", out.stdout, re.M)
    assert "best dpboard method by p99 TTFT: inflight_tokens" in out.stdout



@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_every_example_has_help_with_its_defaults(name):
    out = run_example(name, "--help", timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: "), out.stderr
    assert "default" in out.stdout


@pytest.mark.parametrize("name", ["watch_board.py", "serve_board.py"])
def test_an_example_without_its_board_name_says_so(name):
    out = run_example(name, timeout=60)
    assert out.returncode == 2 and "the following arguments are required: name" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_board_waits_for_a_board_when_told(board_name):
    out = run_example("serve_board.py", board_name, timeout=60)
    assert out.returncode == 2 and "--wait" in out.stderr and "Traceback" not in out.stderr
    proc = subprocess.Popen([PYTHON, str(EXAMPLES / "serve_board.py"), board_name, "--wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert read_line(proc, 30).startswith("/v1/loads: 503 board")  # no board yet: the server says so
        assert read_line(proc, 30).startswith(f"serving board {board_name!r}")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        assert proc.returncode == 0
    finally:
        stop(proc)


def test_embed_writer_lingers_for_a_reader(board_name):
    proc = subprocess.Popen([PYTHON, str(EXAMPLES / "embed_writer.py"), "--board", board_name, "--steps", "5",
                             "--interval", "0", "--backend", "numpy", "--linger", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert read_line(proc, 60).startswith(f"board {board_name!r} stays 30 s more")
        dump = subprocess.run([PYTHON, "-m", "dpboard", "dump", board_name, "--json"], capture_output=True,
                              text=True, timeout=60)
        assert dump.returncode == 0, dump.stderr
        assert json.loads(dump.stdout)["slots"][0]["publish_seq"] == 5, dump.stdout
    finally:
        stop(proc, signal.SIGINT)  # Ctrl-C: the board is removed on the way out


def test_compare_methods_load_changes_a_synthetic_trace():
    """--load scales a --trace scenario as dpboard sim --load does: a lighter load queues less."""
    p99 = {}
    for load in ("0.3", "1.0"):
        out = run_example("compare_methods.py", "--trace", "steady", "--ranks", "2", "--seeds", "1",
                          "--methods", "total_tokens", "--load", load)
        assert out.returncode == 0, out.stderr
        assert f"steady, load {float(load):g}," in out.stdout
        row = re.search(r"^\| total_tokens \| ([\d.]+) \| ([\d.]+) \|", out.stdout, re.M)
        p99[load] = float(row.group(2))
    assert p99["0.3"] < p99["1.0"], p99


@pytest.mark.parametrize(("name", "args", "words"), [
    ("compare_methods.py", ["--trace-file", "/nonexistent/trace.csv"], "trace file /nonexistent/trace.csv does not exist"),
    ("embed_writer.py", ["--backend", "cupy", "--board", "{board}"], "backend 'cupy' needs CuPy"),
])
def test_an_example_s_error_is_one_line(board_name, name, args, words):
    out = run_example(name, *(a.format(board=board_name) for a in args), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
    assert not (Path("/dev/shm") / f"dpboard.{board_name}").exists()  # the board it made is gone


def test_run_controller_gives_rooms_to_follow_bootstrap_room():
    out = run_example("run_controller.py", "--method", "follow_bootstrap_room")
    assert out.returncode == 0, out.stderr
    received = [int(n) for n in re.findall(r"rank \d: received (\d+) requests", out.stdout)]
    assert sum(received) == 500 and min(received) > 0, out.stdout
    assert "'rejected': 0" in out.stdout
