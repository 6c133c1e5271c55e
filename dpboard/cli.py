"""The ``dpboard`` command line: a thin shell over the library.

Each subcommand lives in the module named in ``COMMANDS`` and is imported only when it runs, so
that ``dpboard dump`` or ``dpboard top`` never pay for Numba. A command module provides
``add_<command>_arguments(parser)`` and ``run_<command>(args) -> int``, or plain ``add_arguments`` and
``run`` when it has one command.

Output into a closed pipe (``dpboard ls | head -1``) ends quietly with status 141, as a writer
killed by SIGPIPE does.

Errors: a ``DpboardError`` (bad input, a board that cannot be used as asked, a busy endpoint, ...),
an argument error and an unknown command (with the nearest command names: ``dpboard tpo`` asks
"did you mean top?") are printed as one line and exit with status 2. Anything else is a bug: it
shows its traceback, so that it never passes for a user's mistake.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Sequence

from dpboard import __version__
from dpboard.errors import DpboardError

USAGE_ERROR = 2  # argparse's own status for a bad command line
BROKEN_PIPE = 128 + 13  # the status of a writer killed by SIGPIPE, as the shell reports it

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ls": ("dpboard.views.inspect", "list the boards on this machine, their creator and whether it is alive"),
    "info": ("dpboard.views.inspect", "show a board's header, slot summary and collector counters"),
    "dump": ("dpboard.views.inspect", "print every slot of a board once (table or --json)"),
    "clean": ("dpboard.views.inspect", "remove boards that are not alive: creator dead and no fresh slot "
              "(--force: also live ones); without a name, also lock files no live process holds"),
    "top": ("dpboard.views.top", "live terminal view of a board"),
    "serve": ("dpboard.views.serve", "HTTP exporter: a live page at /, /v1/loads, /metrics, /healthz"),
    "doctor": ("dpboard.views.doctor", "why requests go where they go: the troubleshooting checklist answered "
               "from a board and its dispatcher's record, with evidence, cause and fix"),
    "controller": ("dpboard.controller.command", "run the ZMQ data-parallel controller"),
    "relay": ("dpboard.multinode.relay", "forward this node's board to node0's collector"),
    "collect": ("dpboard.multinode.collector", "own node0's load PULL socket and write relayed snapshots"),
    "demo": ("dpboard.demo.run", "run a simulated DP cluster on this machine with the live board"),
    "sim": ("dpboard.sim.cli", "trace-driven simulation comparing dispatch methods"),
    "calibrate": ("dpboard.sim.calibrate", "fit the simulator's rank model to step logs (DPBOARD_STEP_LOG) and "
                  "write it as a profile for `dpboard sim --profile-file`"),
    "bench": ("dpboard.bench.cli", "performance figures beside their baselines"),
    "steps": ("dpboard.steplog.summary", "summarize step logs (DPBOARD_STEP_LOG): steps by mode, step time by mode "
              "and batch size, time per prefill token and per decode request"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpboard",
        description="Load telemetry board and dispatcher for data-parallel LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"dpboard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = importlib.import_module(module)
            adder = getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments
            adder(p)
    return parser


def unknown_command(word: str) -> str:
    """The one-line error for a command that does not exist, naming the nearest ones."""
    near = difflib.get_close_matches(word, COMMANDS, n=2, cutoff=0.5)
    if near:
        return f"dpboard: no command {word!r}: did you mean {' or '.join(near)}? (dpboard --help lists them all)"
    return f"dpboard: no command {word!r}: the commands are {', '.join(COMMANDS)} (dpboard COMMAND --help for one)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # dpboard's own options take no value: the first word that is not an option is the command
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        print(unknown_command(command), file=sys.stderr)
        return USAGE_ERROR
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = importlib.import_module(COMMANDS[args.command][0])
    runner = getattr(mod, f"run_{args.command}", None) or mod.run
    try:
        status = int(runner(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that went away shows here, not at exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `dpboard ls | head -1`: the reader has what it wanted. End as a killed writer of a pipe does,
        # without a traceback, and keep the interpreter's last flush from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except DpboardError as e:
        print(f"dpboard {args.command}: {e}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
