"""The demo's end when its terminal goes away or it is killed: a closed terminal (SIGHUP) cleans up
as Ctrl-C does, and a SIGKILLed demo takes its children with it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from dpboard.ownership import LOCK_DIR, LOCK_PREFIX
from tests.demo.test_demo import processes_mentioning
from tests.support.mixed_board import PYTHON
from tests.support.names import new_board_name
from tests.support.procutil import kill, read_line

pytestmark = pytest.mark.timeout(180)


def demo_locks(workdirs: set[Path]) -> list[Path]:
    """Lock files of endpoints inside these demo work folders (the controller's input)."""
    stems = [w.name.replace("-", "_") for w in workdirs]
    return [p for p in LOCK_DIR.glob(f"{LOCK_PREFIX}*.lock") if any(stem in p.name.replace("-", "_") for stem in stems)]


def wait_until_gone(name: str, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_closing_the_terminal_mid_demo_leaves_nothing_behind():
    name = new_board_name()
    # a temporary folder of this demo's own: another test's demo running meanwhile is not this one's
    tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")
    socket = f"dpboard-hangup-{os.getpid()}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    command = f"{PYTHON} -m dpboard.cli demo --duration 120 --ranks 2 --board {name} --interval 0.3"
    subprocess.run([*tmux, "new-session", "-d", "-s", "demo", "-x", "120", "-y", "30", command],
                   check=True, timeout=30, env={**os.environ, "TERM": "xterm-256color", "TMPDIR": tmp})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "demo"], capture_output=True,
                                    text=True, timeout=30).stdout
            if "2 live" in screen:
                break
            time.sleep(0.3)
        assert "2 live" in screen, screen
        workdirs = set(Path(tmp).glob("dpboard-demo-*"))
        assert workdirs and demo_locks(workdirs)  # the controller's input is locked while it runs
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)  # the terminal closes
        assert wait_until_gone(name) == [], "a child of the demo outlived its terminal"
        deadline = time.monotonic() + 30
        while Path(f"/dev/shm/dpboard.{name}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/dev/shm/dpboard.{name}").exists()
        assert not any(w.exists() for w in workdirs)
        assert demo_locks(workdirs) == []
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_killed_demo_takes_its_children_with_it():
    name = new_board_name()
    tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")  # this demo's own (see above)
    proc = subprocess.Popen([PYTHON, "-m", "dpboard.cli", "demo", "--duration", "120", "--ranks", "2",
                             "--board", name, "--print-every", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": tmp})
    try:
        deadline = time.monotonic() + 120
        while "2 live" not in read_line(proc, max(1.0, deadline - time.monotonic())):
            pass
        children = [pid for pid in processes_mentioning(name) if pid != proc.pid]
        assert len(children) == 4  # two schedulers, the controller and the reaper
        (workdir,) = Path(tmp).glob("dpboard-demo-*")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert wait_until_gone(name) == [], "children outlived the demo"
        # the reaper removed what the demo could not: the board, the work folder, no file of theirs left
        assert not Path(f"/dev/shm/dpboard.{name}").exists() and not workdir.exists()
        assert [n for n in os.listdir("/dev/shm") if name in n or workdir.name in n] == []
    finally:
        kill(proc)
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        Path(f"/dev/shm/dpboard.{name}").unlink(missing_ok=True)  # only if the test failed
        shutil.rmtree(tmp, ignore_errors=True)  # this demo's work folder with it, never another's
