"""The command line's contract for errors: a DpboardError or a bad argument is one line and status 2;
anything else is a bug and keeps its traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dpboard import cli
from dpboard.errors import DpboardError, InvalidInputError
from dpboard.options import output_file
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


@pytest.mark.parametrize(("typo", "meant"), [("tpo", "top"), ("servee", "serve"), ("lss", "ls"), ("bnech", "bench")])
def test_a_mistyped_command_is_one_line_naming_the_command_meant(typo, meant):
    out = dpboard(typo, "cluster")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stdout == ""
    assert out.stderr.startswith(f"dpboard: no command {typo!r}: did you mean {meant}")


def test_a_word_like_no_command_lists_every_command():
    out = dpboard("xyzzy")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert all(name in out.stderr for name in cli.COMMANDS) and "did you mean" not in out.stderr


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


# -- every numeric option is range-checked by the parser ------------------------------------------

COMMANDS_CHECKED = [c for c in cli.COMMANDS if c != "sim"]  # sim's options belong to the simulator


def _numeric_actions(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _numeric_actions(sub)
        elif action.option_strings and action.nargs != 0 and action.type not in (None, output_file):
            yield parser.prog, action


def _parsers():
    from dpboard.bench import dispatch as bench_dispatch
    from dpboard.bench import relay as bench_relay

    for command in COMMANDS_CHECKED:
        yield command, cli.build_parser(command)
    yield "bench dispatch", bench_dispatch.parser()
    yield "bench relay", bench_relay._parser()


def test_no_numeric_option_takes_an_unchecked_int_or_float():
    """An option typed plain int or float takes inf, nan, 1e10 or -1 and crashes later."""
    unchecked = [f"{prog} {action.option_strings[0]}" for _, parser in _parsers()
                 for prog, action in _numeric_actions(parser) if action.type in (int, float)]
    assert not unchecked, f"use dpboard.options types for: {unchecked}"


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "abc"])
def test_every_numeric_option_refuses_what_is_not_a_finite_number(value, capsys):
    checked = 0
    for command, parser in _parsers():
        for prog, action in _numeric_actions(parser):
            option = action.option_strings[0]
            argv = [*(command.split()[1:] if command.startswith("bench") else [command]), option, value]
            with pytest.raises(SystemExit) as e:
                parser.parse_args(argv)
            assert e.value.code == 2, (prog, option)
            assert f"argument {option}" in capsys.readouterr().err, (prog, option)
            checked += 1
    assert checked >= 30


@pytest.mark.parametrize(("args", "words"), [
    (["info", "x", "--stale-after", "inf"], "argument --stale-after: 'inf' is not a finite number"),
    (["dump", "x", "--stale-after", "1e10"], "argument --stale-after: 1e10 is outside [1e-09, 1e+06] seconds"),
    (["top", "x", "--stale-after", "1e10"], "argument --stale-after: 1e10 is outside"),
    (["serve", "x", "--stale-after", "inf"], "argument --stale-after: 'inf' is not a finite number"),
    (["serve", "x", "--port", "70000"], "argument --port: 70000 is outside [0, 65535]"),
    (["controller", "--input", "ipc:///tmp/x", "--workers", "ipc:///tmp/y", "--stale-after", "inf"],
     "argument --stale-after"),
    (["relay", "--board", "x", "--to", "tcp://h:1", "--node-id", "1", "--stale-after", "1e10"],
     "argument --stale-after: 1e10 is outside"),
    (["relay", "--board", "x", "--to", "tcp://h:1", "--node-id", "1", "--sndhwm", "-1"],
     "argument --sndhwm: -1 is outside [1, 1000000]"),
    (["relay", "--board", "x", "--to", "tcp://h:1", "--node-id", "1", "--tick-ms", "0"], "argument --tick-ms"),
    (["collect", "--board", "x", "--bind", "tcp://127.0.0.1:*", "--n-slots", "0"], "argument --n-slots"),
    (["top", "x", "--iterations", "-1"], "argument --iterations/-n: -1 is outside"),
    (["demo", "--long-share", "2"], "argument --long-share: 2 is outside [0, 1]"),
    (["bench", "relay", "--tick-ms", "-5"], "argument --tick-ms: -5 is outside"),
])
def test_out_of_range_options_are_one_line_errors_not_tracebacks(args, words):
    out = dpboard(*args)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# -- the first minutes: version, python -m, the error base at the package top ----------------------

def test_version_from_the_command_and_from_python_m():
    import dpboard as package

    for argv in ([sys.executable, "-m", "dpboard", "--version"], [sys.executable, "-m", "dpboard.cli", "--version"]):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == f"dpboard {package.__version__}"


def test_python_m_dpboard_runs_the_command_line_with_its_error_contract():
    out = subprocess.run([sys.executable, "-m", "dpboard", "info", "no-such-board-here"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("dpboard info: ") and out.stderr.count("\n") == 1


def test_the_error_base_is_importable_from_the_package_top():
    import dpboard as package

    assert package.DpboardError is DpboardError and "DpboardError" in package.__all__
    assert issubclass(package.BoardError, package.DpboardError)


def test_sim_plot_without_matplotlib_is_refused_before_the_simulation(tmp_path):
    # matplotlib hidden from this interpreter: sys.modules[name] = None makes find_spec and import fail
    code = ("import sys; sys.modules['matplotlib'] = None; from dpboard.cli import main; "
            f"sys.exit(main(['sim', '--quick', '--plot', {str(tmp_path / 'x.png')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("dpboard sim: --plot needs matplotlib") and out.stderr.count("\n") == 1
    assert out.stdout == ""  # nothing was simulated


def test_sim_plot_to_a_missing_folder_is_refused_by_the_parser(tmp_path):
    out = dpboard("sim", "--quick", "--plot", str(tmp_path / "no" / "x.png"))
    assert out.returncode == 2 and "argument --plot:" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize("args", [["dump", "{name}", "--json"], ["info", "{name}", "--json"], ["dump", "{name}"],
                                  ["ls"]])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(board_name, args):
    """`dpboard ls | head -1`: no traceback, and the status of a writer that SIGPIPE would have killed."""
    from dpboard import Board, LoadSnapshot

    with Board.create(board_name, n_slots=4096) as board:
        for rank in range(0, 4096, 7):
            board.writer(rank).publish(LoadSnapshot(dp_rank=rank, num_running_reqs=rank))
        proc = subprocess.Popen([sys.executable, "-m", "dpboard.cli", *(a.format(name=board_name) for a in args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout.read(10)
            proc.stdout.close()  # as `head -c 10` does once it has its bytes
            err = proc.stderr.read().decode()
            status = proc.wait(timeout=60)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        board.unlink()
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert status in (0, cli.BROKEN_PIPE), (status, err)


def test_sim_methods_help_names_every_method_the_run_accepts():
    refused = dpboard("sim", "--quick", "--methods", "no_such_method")
    assert refused.returncode == 2
    accepted = refused.stderr.rsplit("use one of ", 1)[1].strip().split(", ")
    assert {"inflight_ttft", "vllm_board"} <= set(accepted)
    help_text = " ".join(dpboard("sim", "--help").stdout.split())
    methods_help = help_text.split("--methods METHODS", 1)[1]
    missing = [name for name in accepted if name not in methods_help]
    assert not missing, f"dpboard sim --methods help leaves out {missing}"
