"""Run a command while busy processes keep every core loaded: how `make test-under-load` finds the
tests that wait for a fixed time instead of for what they need.

    python tools/cpu_hog.py [--hogs N] -- COMMAND [ARG ...]

N busy-looping Python processes (default: one per core) start first, at the same niceness as the
command; the command's exit status is this script's. The hogs are killed when the command ends,
and with this script on SIGTERM, SIGINT or SIGHUP (each hog also dies with its parent: it polls
its parent pid), so none outlives a run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

# A hog spins and checks every ~0.1 s of work that its parent still runs: a killed script leaves
# no spinner behind.
HOG = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpu_hog.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.hogs < 1:
        p.error(f"--hogs must be >= 1, got {args.hogs}")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())], stdin=subprocess.DEVNULL)
            for _ in range(args.hogs)]
    print(f"cpu_hog: {len(hogs)} busy processes on {os.cpu_count()} cores while: {' '.join(command)}",
          file=sys.stderr, flush=True)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    child = None
    try:
        child = subprocess.Popen(command)
        return child.wait()
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(10)


if __name__ == "__main__":
    sys.exit(main())
