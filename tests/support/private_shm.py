"""A Python script run with a /dev/shm of its own: a tmpfs of a given size mounted on /dev/shm in a
mount namespace of its own (as Docker's small default /dev/shm, or to see every dpboard file there
without other runs' files). Needs root and util-linux's unshare; the test skips, saying so, without."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.names import ROOT


def run_in_private_shm(script: str, *, size: str, label: str = "dpboard-private",
                       timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -c script`` (from the repository's root) over a fresh ``size`` tmpfs on /dev/shm."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and util-linux's unshare for a private /dev/shm")
    run = subprocess.run(["unshare", "--mount", "sh", "-c", f'mount -t tmpfs -o size={size} {label} /dev/shm && '
                          'exec "$@"', "sh", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {run.stderr.strip()}")
    return run
