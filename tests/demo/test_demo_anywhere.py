"""The demo's children do not depend on the directory it is started from: run from the folder that
holds a checkout named dpboard/, that folder must not shadow the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.demo.test_demo import check_summary, processes_mentioning
from tests.support.names import new_board_name

pytestmark = pytest.mark.timeout(180)


def test_the_demo_runs_from_the_folder_that_holds_the_checkout(tmp_path):
    (tmp_path / "dpboard").mkdir()  # as ~/dpboard is for a clone made in ~: a folder without __init__.py
    (tmp_path / "dpboard" / "README.md").write_text("a checkout's top folder\n")
    name = new_board_name()
    dpboard = Path(sys.executable).with_name("dpboard")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    try:
        proc = subprocess.run([str(dpboard), "demo", "--duration", "3", "--ranks", "2", "--board", name,
                               "--print-every", "1"], capture_output=True, text=True, timeout=150,
                              cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "ImportError" not in proc.stderr
        check_summary(proc.stdout, 2)
    finally:
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        Path(f"/dev/shm/dpboard.{name}").unlink(missing_ok=True)
