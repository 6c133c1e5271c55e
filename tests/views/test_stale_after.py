"""One stale-after parser for every place a threshold is given, with the C reader's range (whole
nanoseconds, 1 ns .. 1e6 s): 1e-300 passed the command line's parser and then failed in the reader
with a ValueError traceback, in every view and in the relay; the plugins' DPBOARD_STALE_AFTER the
same. Real commands over a real board."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpboard import Board
from dpboard.errors import InvalidInputError
from tests.support.names import ROOT

pytestmark = pytest.mark.timeout(120)
COMMANDS = [["top", "{b}", "--once"], ["top", "{b}", "--json"], ["dump", "{b}"], ["info", "{b}"],
            ["doctor", "{b}", "--window", "0.1"], ["serve", "{b}", "--port", "0"],
            ["relay", "--board", "{b}", "--to", "tcp://127.0.0.1:9", "--node-id", "1", "--duration", "1"],
            ["controller", "--input", "tcp://127.0.0.1:0", "--workers", "tcp://127.0.0.1:9", "--board", "{b}"]]


def _run(argv: list[str], board: str, value: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *(a.format(b=board) for a in argv),
                           "--stale-after", value], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_a_stale_after_below_a_nanosecond_is_refused_by_the_parser(board_name, argv):
    with Board.create(board_name, 2):
        res = _run(argv, board_name, "1e-300")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines()[-1].endswith(
        "argument --stale-after: 1e-300 is outside [1e-09, 1e+06] seconds: a reader keeps it in whole nanoseconds")


def test_one_nanosecond_is_a_threshold_the_reader_takes(board_name):
    with Board.create(board_name, 2):
        res = _run(["dump", "{b}"], board_name, "1e-9")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("value", ["1e-300", "0", "-1", "inf", "nan", "1e7", "soon"])
def test_the_vllm_plugins_stale_after_is_the_same_parser(value):
    from dpboard.integrations.vllm.settings import stale_after

    with pytest.raises(InvalidInputError, match=rf"DPBOARD_STALE_AFTER='{value}' must be a number of seconds in "
                                                r"\[1e-09, 1e\+06\]"):
        stale_after({"DPBOARD_STALE_AFTER": value})
    assert stale_after({"DPBOARD_STALE_AFTER": "1e-9"}) == 1e-9


def test_the_sglang_plugins_stale_after_is_the_same_parser_with_its_floor():
    from dpboard.integrations.sglang.settings import read_settings

    with pytest.raises(InvalidInputError, match=r"DPBOARD_STALE_AFTER='1e-300' must be a number of seconds in "
                                                r"\[0.01, 1e\+06\]"):
        read_settings({"DPBOARD_STALE_AFTER": "1e-300"})
    assert read_settings({"DPBOARD_STALE_AFTER": "0.5"}).stale_after == 0.5
