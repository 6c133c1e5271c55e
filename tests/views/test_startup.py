"""The commands that print a table or a report of a board start without NumPy: ``ls``, ``info``,
``clean``, ``dump`` and ``doctor --json`` read through the C reader's plain values (their start-up
against ``python -c pass`` is ``dpboard bench startup``, docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpboard import Board, LoadSnapshot

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("command", [["ls"], ["info"], ["dump"], ["clean"], ["doctor", "--window", "0.3", "--json"]])
def test_a_read_only_command_loads_no_numpy(board_name, command):
    # the slot stays live however long a loaded machine takes to start the command
    args = [command[0], *([board_name] if command[0] != "ls" else []), *command[1:], "--stale-after", "60"]
    code = (
        "import sys; from dpboard.cli import main; "
        f"rc = main({args!r}); "
        "print('NUMPY', sorted(m for m in sys.modules if m.split('.')[0] == 'numpy')[:3]); sys.exit(rc)"
    )
    with Board.create(board_name, n_slots=4) as board, board.writer(1) as writer:
        writer.publish(LoadSnapshot(1, num_running_reqs=7, num_used_tokens=64, max_total_num_tokens=128))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "NUMPY []" in proc.stdout, (proc.stdout, proc.stderr)
    out = proc.stdout
    if command[0] == "clean":  # a live board is refused, and says why
        assert proc.returncode == 2 and "is in use" in proc.stderr
    elif command[0] == "doctor":
        assert proc.returncode in (0, 1), proc.stderr
        report = json.loads(out[: out.rindex("NUMPY")])
        assert report["status_counts"]["live"] == 1 and report["status_counts"]["empty"] == 3
        assert any(f["id"] == "one_live_rank" for f in report["findings"])
    else:
        assert proc.returncode == 0, proc.stderr
        assert board_name in out
        if command[0] in ("info", "dump"):
            assert "1 live" in out and "3 empty" in out
        if command[0] == "dump":
            row = next(line for line in out.splitlines() if line.split()[:2] == ["1", "live"])
            assert row.split()[2] == "7" and "50.0%" in row
