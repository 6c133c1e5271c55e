"""Progress on the commands that run for minutes, `dpboard sim` and the sweep's `run`
(tools/lockstep_sweep.py): a rich progress bar on stderr where stderr is a terminal, here a real
pseudo-terminal (the `pty` module); without one, nothing on stderr, and stdout the same either way
(a CI log, a pipe and `--json -` read as they did)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading

from dpboard.sim.report import Progress
from tests.support.names import ROOT

SIM = [sys.executable, "-m", "dpboard.cli", "sim", "--quick", "--methods", "round_robin,total_tokens"]
# the sweep's own run loop on two cells, each cell's runs made up (a real cell takes minutes)
SWEEP = [sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(ROOT / "tools")!r})
import lockstep_sweep as sweep
def run_cell(cell, trace_files, on_run=None):
    for label in ("round_robin", "total_tokens"):
        time.sleep(0.05)
        on_run(label)
    return {{"cell": cell, "runs": {{}}, "wall_s": 0.1}}
sweep.run_cell = run_cell
sweep._runs = lambda cell: [0, 1]
sys.exit(sweep.main(["run", "--out", sys.argv[1], "--only", "azure-8-0.5,azure-8-0.75"]))
"""]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")}
    return {**env, "TERM": "xterm-256color"}


def on_terminal(command: list[str], timeout: float = 120) -> tuple[bytes, bytes, int]:
    """Run ``command`` with stderr on a pseudo-terminal of 120 columns and stdout on a pipe:
    (stdout, every byte the terminal received, exit status)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                            env=environment(), cwd=ROOT)
    os.close(slave)
    stdout: list[bytes] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))
    reader.start()
    screen = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            assert ready, f"{command[:4]} wrote nothing to the terminal for {timeout} s"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other side is closed, the command is gone
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(master)
        status = proc.wait(timeout=timeout)
        reader.join(timeout)
    return stdout[0], screen, status


def piped(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, env=environment(), cwd=ROOT, timeout=120)


def test_sim_shows_a_bar_on_a_terminal_and_leaves_stdout_as_it_is():
    stdout, screen, status = on_terminal(SIM)
    assert status == 0, screen.decode(errors="replace")
    # each method named as it runs, counted out of two
    assert b"round_robin" in screen and b"total_tokens" in screen, screen
    assert b"/2" in screen and b"methods" in screen, screen
    assert b"\x1b" not in stdout  # no escape sequence reached the pipe
    plain = piped(SIM)
    assert plain.returncode == 0 and plain.stderr == b""  # without a terminal: nothing added
    assert stdout == plain.stdout and b"| round_robin |" in stdout and b"| total_tokens |" in stdout


def test_sim_json_on_stdout_stays_json_with_a_bar_on_the_terminal():
    stdout, screen, status = on_terminal([*SIM, "--json", "-"])
    assert status == 0, screen.decode(errors="replace")
    doc = json.loads(stdout)
    assert [run["summary"]["method"] for run in doc["runs"]] == ["round_robin", "total_tokens"]
    assert b"methods" in screen and b"| round_robin |" in screen  # the bar, then the table, on stderr


def test_the_sweep_shows_a_bar_over_cells_and_runs_and_prints_a_line_per_cell(tmp_path):
    stdout, screen, status = on_terminal([*SWEEP, str(tmp_path / "tty")])
    assert status == 0, screen.decode(errors="replace")
    assert b"azure-8-0.5" in screen and b"azure-8-0.75" in screen and b"cells" in screen, screen
    assert b"runs" in screen and b"total_tokens" in screen, screen  # the current cell's runs
    plain = piped([*SWEEP, str(tmp_path / "pipe")])
    assert plain.returncode == 0 and plain.stderr == b"", plain.stderr
    # one plain line per finished cell, as before the bar, with a terminal or without (a cell's seconds
    # are its own: a loaded machine may take one more)
    for out in (stdout, plain.stdout):
        assert re.fullmatch(rb"azure-8-0\.5: \d+ s\nazure-8-0\.75: \d+ s\n", out), out
    assert sorted(p.name for p in (tmp_path / "pipe").iterdir()) == ["azure-8-0.5.json", "azure-8-0.75.json"]


def test_progress_without_a_terminal_prints_only_the_lines_asked_for(capsys):
    with Progress(2, "cells", lines=True) as progress:
        assert not progress.shown
        for name in ("a", "b"):
            progress.start(name, parts=3)
            progress.part("run")
            progress.done(f"{name}: done")
    with Progress(1, "methods") as progress:
        progress.start("x")
        progress.done("not printed: no lines asked for")
    out = capsys.readouterr()
    assert out.out == "a: done\nb: done\n" and out.err == ""
