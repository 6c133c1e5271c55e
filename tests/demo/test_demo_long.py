"""`dpboard demo` runs its whole duration, well past its processes' internal timeouts (the
controller's 2 s connect wait, the demo's own 5 s stop bound), with every rank live to the end and
every request received: no inner deadline ends the run early, as one once ended `dpboard relay`."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime

import pytest

from tests.demo.test_demo import processes_mentioning
from tests.support.mixed_board import PYTHON
from tests.support.names import new_board_name

pytestmark = pytest.mark.timeout(180)

DURATION = 14.0


def test_demo_runs_its_whole_duration_with_every_rank_live():
    name = new_board_name()
    try:
        proc = subprocess.run(
            [PYTHON, "-m", "dpboard.cli", "demo", "--duration", f"{DURATION:g}", "--ranks", "2", "--board", name,
             "--print-every", "1"],
            capture_output=True, text=True, timeout=170,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = proc.stdout
        stamps = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S")
                  for s in re.findall(rf"board {name} .* (\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d) UTC", out)]
        assert stamps and (stamps[-1] - stamps[0]).total_seconds() >= DURATION - 3, stamps
        frames = re.findall(r"ranks +(\d+) live +(\d+) stale", out)
        assert len(frames) == len(stamps) and all(f == ("2", "0") for f in frames), frames
        assert f"{DURATION:.1f} s of load" in out
        sent = int(re.search(r"requests sent (\d+)", out).group(1))
        assert sent > 0 and f"received by schedulers {sent}," in out
        assert "Traceback" not in proc.stderr
    finally:
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
