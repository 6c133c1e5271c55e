"""The command line's contract for errors: a DpboardError or a bad argument is one line and status 2;
anything else is a bug and keeps its traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpboard import cli
from dpboard.errors import DpboardError, InvalidInputError
from tests.support.names import new_board_name


def dpboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [
    ["info", "no-such-board-here"],  # a NotFoundError
    ["dump", "bad name!"],  # an InvalidInputError from the name check
    ["clean", "no-such-board-here"],
])
def test_a_dpboard_error_is_one_line_and_status_2(args):
    out = dpboard(*args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"dpboard {args[0]}: ")
    assert "Traceback" not in out.stderr


def test_a_bad_argument_is_status_2():
    out = dpboard("info", new_board_name(), "--stale-after", "soon")
    assert out.returncode == 2 and "argument --stale-after: 'soon' is not a number" in out.stderr and "Traceback" not in out.stderr


def test_a_bug_keeps_its_traceback(monkeypatch):
    from dpboard.views import inspect

    def broken(args):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr(inspect, "run_ls", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["ls"])


def test_errors_the_commands_raise_are_dpboard_errors(monkeypatch, capsys):
    from dpboard.views import inspect

    def refuses(args):
        raise InvalidInputError("--thing must be > 0, got -1")

    monkeypatch.setattr(inspect, "run_ls", refuses)
    assert cli.main(["ls"]) == 2
    assert capsys.readouterr().err == "dpboard ls: --thing must be > 0, got -1\n"
    assert issubclass(InvalidInputError, DpboardError) and issubclass(InvalidInputError, ValueError)
