"""The vLLM plugin's ways out (leaving.py) judge a board gone by the rule `dpboard clean` applies:
a board whose writer runs in another PID namespace (a container sharing /dev/shm, ``docker
--ipc=host``) and publishes is left in place by every exit path; an abandoned one is removed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dpboard.board import SEGMENT_PREFIX, SHM_DIR
from dpboard.integrations.vllm import leaving
from tests.support.names import ROOT
from tests.support.pid_namespace import pid_namespace_prefix
from tests.support.procutil import read_line, wait_until

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
