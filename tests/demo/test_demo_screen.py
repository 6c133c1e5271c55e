"""`make demo`'s own screen in a real terminal (tmux) at the widths people have: every rank has a
readable row, and headings are whole columns, never cut to an ellipsis."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.demo.test_demo import processes_mentioning
from tests.support.names import new_board_name

ROOT = Path(__file__).resolve().parents[2]
RANKS = 4
STATES = ("live", "stale", "torn", "empty")

pytestmark = [
    pytest.mark.timeout(480),
    pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("make") is None,
                       reason="tmux and make are needed to drive `make demo` in a real terminal"),
]


def rank_rows(screen: str) -> dict[int, str]:
    rows = {}
    for line in screen.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].isdigit() and words[1] in STATES:
            rows[int(words[0])] = line
    return rows


@pytest.mark.parametrize(("columns", "cold"), [(80, True), (100, False), (132, False)])
def test_make_demo_fits_the_terminal_width(columns, cold, tmp_path):
    """At 80 columns with an empty Numba cache, as on a fresh machine: the first run's compile note
    is on screen too, and fits like the rest."""
    name = new_board_name()
    socket = f"dpboard-demo-{os.getpid()}-{columns}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    venv = Path(os.environ.get("VIRTUAL_ENV") or Path(sys.executable).parents[1])
    # Ctrl-C ends the demo, never its --duration: on a loaded machine every rank may take a minute to show live
    command = (f"make -s -C {ROOT} demo VENV={venv} "
               f"DEMO_ARGS='--duration 600 --ranks {RANKS} --board {name} --interval 0.3'; sleep 120")
    # the venv's bin folder off PATH, as in a shell where `make demo` was typed
    venv_bin = str(venv / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {**os.environ, "TERM": "xterm-256color", "PATH": path}
    if cold:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
    subprocess.run([*tmux, "new-session", "-d", "-s", "demo", "-x", str(columns), "-y", "30", command],
                   check=True, timeout=30, env=env)
    # Ctrl-C reaches make and the shell too, which end as soon as the demo does: the pane keeps what
    # the demo printed last instead of closing with them
    subprocess.run([*tmux, "set-option", "-t", "demo", "remain-on-exit", "on"], check=True, timeout=30)
    try:
        deadline = time.monotonic() + (300 if cold else 120)  # a cold cache compiles first: minutes on a loaded machine
        screen = ""
        while time.monotonic() < deadline:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "demo"], capture_output=True, text=True,
                                    timeout=30).stdout
            rows = rank_rows(screen)
            if len(rows) == RANKS and all(row.split()[1] == "live" for row in rows.values()):
                break
            time.sleep(0.3)
        rows = rank_rows(screen)
        assert sorted(rows) == list(range(RANKS)), f"not every rank has a readable row:\n{screen}"
        heading = next((line for line in screen.splitlines() if line.lstrip().startswith("RANK")), "")
        assert heading, f"no heading line:\n{screen}"
        assert "…" not in heading, heading
        for title in ("RANK", "STATE", "RUN", "WAIT", "TOTAL TOK"):
            assert title in heading, (title, heading)
        assert "…" not in "".join(rows.values()), screen
        assert all(len(line.rstrip()) <= columns for line in screen.splitlines())

        # Ctrl-C: the summary and the last lines, each line within the width (-J joins the lines the
        # terminal itself wrapped: one longer than the width would have been cut mid-figure)
        subprocess.run([*tmux, "send-keys", "-t", "demo", "C-c"], check=True, timeout=30)
        deadline = time.monotonic() + 60
        joined = ""
        while "not on PATH" not in joined and time.monotonic() < deadline:
            time.sleep(0.3)
            joined = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-t", "demo"], capture_output=True,
                                    text=True, timeout=30).stdout
        assert "dpboard demo: " in joined, f"no summary within 60 s of Ctrl-C:\n{joined}"
        if cold:  # the board's screen gone, the first run's compile note is back above the summary
            assert "Numba is compiling the load kernels" in joined, joined
        summary = [line for line in joined[joined.index("dpboard demo: "):].rstrip().splitlines()
                   if not line.startswith("Pane is dead")]  # tmux's own line under a pane kept on exit
        while summary and not summary[-1].strip():
            summary.pop()
        assert any(line.startswith("  queueing delay") for line in summary), joined
        assert all(len(line) <= columns for line in summary), "\n".join(summary)
        assert summary[-1].startswith("  `. ") and "/activate` puts it there" in summary[-1], joined
    finally:
        subprocess.run([*tmux, "send-keys", "-t", "demo", "C-c"], capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while processes_mentioning(name) and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)
        for pid in processes_mentioning(name):
            subprocess.run(["kill", "-9", str(pid)], check=False)
