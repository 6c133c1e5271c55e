"""The command prefix that runs a process as pid 1 of a PID namespace of its own (``unshare --pid
--fork --mount-proc``): from outside, its recorded pid is another process or none. Needs root and
util-linux's unshare, and a kernel that allows the namespace; the test skips, saying so, without."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def pid_namespace_prefix() -> list[str]:
    """``[unshare, --pid, --fork, --mount-proc]``, tried once on ``true`` first (else the test skips)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    prefix = [unshare, "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"this kernel refuses a new PID namespace: {probe.stderr.decode().strip()}")
    return prefix
