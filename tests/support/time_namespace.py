"""A Python process in a time namespace of its own (``unshare --time --boottime``): its start time
in ``/proc/PID/stat`` reads one way inside and another from here, as a container's may. Needs root
and util-linux's unshare; the test skips, saying so, without."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dpboard.ownership import process_exited
from tests.support.names import ROOT
from tests.support.procutil import kill, read_line, wait_for

BOOTTIME_OFFSET = 100_000  # seconds added to the namespace's boot clock: start ticks differ by that much


def start_in_time_namespace(script: str, *args: str) -> tuple[subprocess.Popen, int]:
    """``python -c script args`` in a new time namespace; waits for its first line, ``ready PID``,
    and returns the process (unshare's: killing it kills the Python process too) and the Python
    process's pid."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and util-linux's unshare for a time namespace")
    proc = subprocess.Popen(["unshare", "--time", "--boottime", str(BOOTTIME_OFFSET), "--fork", "--kill-child", sys.executable,
                             "-c", script, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = read_line(proc, 60)
    except AssertionError:
        err = proc.stderr.read() if proc.poll() is not None else ""
        kill(proc)
        if "unshare" in err and "Traceback" not in err:
            pytest.skip(f"cannot make a time namespace here: {err.strip()}")
        raise
    word, pid = line.split()
    assert word == "ready", line
    return proc, int(pid)


def kill_in_time_namespace(proc: subprocess.Popen, pid: int) -> None:
    """Kill it (SIGKILL) and wait, bounded, until the Python process has exited too (its locks gone)."""
    kill(proc)
    wait_for(lambda: process_exited(pid), 30, f"process {pid} in the time namespace to exit")
