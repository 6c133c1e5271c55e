"""The vLLM plugin's ways out (leaving.py) judge a board gone by the rule `dpboard clean` applies:
a board whose writer runs in another PID namespace (a container sharing /dev/shm, ``docker
--ipc=host``) and publishes is left in place by every exit path; an abandoned one is removed. What
the launcher may not remove (another user's file under the name, an older deployment's board) it
leaves at once, without waiting for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dpboard.board import SEGMENT_PREFIX, SHM_DIR, Board
from dpboard.board.dispatch_record import DISPATCH_PREFIX
from dpboard.board.liveness import process_start_ticks
from dpboard.integrations.vllm import leaving
from tests.support.names import ROOT
from tests.support.other_user import NOBODY, as_nobody, need_root
from tests.support.pid_namespace import pid_namespace_prefix
from tests.support.procutil import NoWait, kill, read_line, wait_until

WRITER = """
import os, sys, time
from dpboard import Board, LoadSnapshot
board = Board.create(sys.argv[1], n_slots=2)
writer = board.writer(0)
print(os.getpid(), flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not os.path.exists(sys.argv[2]):
    writer.publish(LoadSnapshot(0, num_running_reqs=1))
    time.sleep(0.01)  # every 10 ms, as an engine under load
os._exit(0)  # as a killed container would: nothing removed
"""


def test_a_board_written_from_another_pid_namespace_outlives_every_exit_path_until_abandoned(board_name, tmp_path,
                                                                                           monkeypatch):
    prefix = pid_namespace_prefix()
    name = f"vllm-{board_name}"  # a board DPBOARD_VLLM=1 covers: the launcher looks at every vllm-* board
    path = SHM_DIR / f"{SEGMENT_PREFIX}{name}"
    stop = tmp_path / "stop"
    proc = subprocess.Popen([*prefix, sys.executable, "-c", WRITER, name, str(stop)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    monkeypatch.setattr(leaving, "EXIT_WAIT", 0.5)  # the launcher's wait for its children: none here
    try:
        assert read_line(proc, 60).strip() == "1"  # pid 1 in its namespace: another process, or none, from here
        assert leaving.remove_if_gone(name) == []
        assert leaving.remove_if_gone(name, leaving=True) == []  # an API server's close, an engine core's
        leaving.at_launcher_exit(os.getpid(), 0, {"DPBOARD_VLLM": "1"})
        leaving.at_launcher_exit(os.getpid(), 0, {"DPBOARD_VLLM_BOARD": name})
        assert path.exists()
        refused = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean", name], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "is in use" in refused.stderr  # the same verdict as clean's
        stop.touch()
        proc.wait(timeout=30)
        # abandoned once its last publish is older than the stale threshold: removed by the same paths
        removed: list[str] = []
        assert wait_until(lambda: removed.extend(leaving.remove_if_gone(name)) or not path.exists(), timeout=30)
        assert removed == [f"{SEGMENT_PREFIX}{name}"]
    finally:
        stop.touch()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        Path(path).unlink(missing_ok=True)


def test_the_launcher_removes_an_abandoned_board_at_its_exit(board_name, monkeypatch):
    """A deployment's board whose processes are all gone (a writer killed outright) is removed."""
    code = ("import os, sys\nfrom dpboard import Board, LoadSnapshot\nb = Board.create(sys.argv[1], n_slots=2)\n"
            "b.writer(1).publish(LoadSnapshot(1))\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code, board_name], cwd=ROOT, check=True, timeout=60)
    path = SHM_DIR / f"{SEGMENT_PREFIX}{board_name}"
    assert path.exists()
    monkeypatch.setattr(leaving, "EXIT_WAIT", 30.0)  # until its last publish is older than the threshold
    leaving.at_launcher_exit(os.getpid(), 0, {"DPBOARD_VLLM_BOARD": board_name})
    assert not path.exists()


ABANDONED_RECORD = """
import os, sys
from dpboard.board.dispatch_record import open_tally
open_tally(sys.argv[1], 1, 0, 2, method="inflight_requests").tick()
os._exit(0)  # an API server killed outright: its row's holder gone, the record left
"""
CREATOR = """
import os, sys, time
from dpboard import Board
board = Board.create(sys.argv[1], n_slots=2)
print(os.getpid(), flush=True)
time.sleep(120)
"""


def test_another_users_board_under_the_name_is_left_at_once(board_name, monkeypatch, caplog):
    """Another user (uid 65534) leaves a readable board (0644) under the deployment's name, its creator
    started after the launcher; this user's dispatch record beside it is abandoned. The launcher's
    exit removes the record and returns without a wait, the other user's board untouched. Before, the
    board stayed on the list of what was left, and the exit waited the full EXIT_WAIT (15 s) for it."""
    need_root()
    started = process_start_ticks(os.getpid())
    subprocess.run([sys.executable, "-c", ABANDONED_RECORD, board_name], cwd=ROOT, check=True, timeout=60)
    record = SHM_DIR / f"{DISPATCH_PREFIX}{board_name}"
    path = SHM_DIR / f"{SEGMENT_PREFIX}{board_name}"
    assert record.exists()

    def plant() -> None:
        plant.keep = Board.create(board_name, 2, mode=0o644)  # type: ignore[attr-defined]  # never removed

    as_nobody(plant)
    monkeypatch.setattr(leaving, "time", NoWait)
    try:
        assert path.stat().st_uid == NOBODY
        with caplog.at_level("WARNING", logger="dpboard.vllm"):
            leaving.at_launcher_exit(os.getpid(), started, {"DPBOARD_VLLM_BOARD": board_name})
        assert not record.exists()
        assert path.stat().st_uid == NOBODY  # another user's: never removed from here
        assert not [r for r in caplog.records if r.levelno >= 30], caplog.text
    finally:
        path.unlink(missing_ok=True)


def test_an_older_deployments_board_of_the_name_is_left_at_once(board_name, monkeypatch, caplog):
    """A board of this user under the name whose creator (alive) started before the launcher: an
    older deployment's, which the launcher never removes. Its exit returns without waiting for it."""
    creator = subprocess.Popen([sys.executable, "-c", CREATOR, board_name], stdout=subprocess.PIPE, text=True,
                               cwd=ROOT)
    path = SHM_DIR / f"{SEGMENT_PREFIX}{board_name}"
    try:
        pid = int(read_line(creator, 60))
        started = process_start_ticks(pid) + 1  # the launcher started after it
        monkeypatch.setattr(leaving, "time", NoWait)
        with caplog.at_level("WARNING", logger="dpboard.vllm"):
            leaving.at_launcher_exit(os.getpid(), started, {"DPBOARD_VLLM_BOARD": board_name})
        assert path.exists() and not caplog.records, caplog.text
    finally:
        kill(creator)
        Path(path).unlink(missing_ok=True)
