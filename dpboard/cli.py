"""The ``dpboard`` command line: a thin shell over the library.

Each subcommand lives in the module named in ``COMMANDS`` and is imported only when it runs, so
that ``dpboard dump`` or ``dpboard top`` never pay for Numba. A command module provides
``add_<command>_arguments(parser)`` and ``run_<command>(args) -> int``, or plain ``add_arguments`` and
``run`` when it has one command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ls": ("dpboard.inspect", "list the boards on this machine, their creator and whether it is alive"),
    "info": ("dpboard.inspect", "show a board's header, slot summary and collector counters"),
    "dump": ("dpboard.inspect", "print every slot of a board once (table or --json)"),
    "clean": ("dpboard.inspect", "remove boards whose creator is dead (--force: also live ones)"),
    "top": ("dpboard.top", "live terminal view of a board"),
    "serve": ("dpboard.serve", "HTTP exporter: /v1/loads, /metrics, /healthz"),
    "controller": ("dpboard.controller.process", "run the ZMQ data-parallel controller"),
    "relay": ("dpboard.relay", "forward this node's board to node0's collector"),
    "collect": ("dpboard.collector", "own node0's load PULL socket and write relayed snapshots"),
    "demo": ("dpboard.demo", "run a simulated DP cluster on this machine with the live board"),
    "sim": ("dpboard.sim", "trace-driven simulation comparing dispatch methods"),
    "bench": ("dpboard.bench.cli", "performance figures beside their baselines"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpboard",
        description="Load telemetry board and dispatcher for data-parallel LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod = importlib.import_module(module)
            adder = getattr(mod, f"add_{name}_arguments", None) or mod.add_arguments
            adder(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = importlib.import_module(COMMANDS[args.command][0])
    runner = getattr(mod, f"run_{args.command}", None) or mod.run
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        return 130
    # BoardError is a RuntimeError: every error the commands raise on purpose is a message, not a traceback.
    except (FileNotFoundError, FileExistsError, PermissionError, ValueError, RuntimeError) as e:
        print(f"dpboard {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
