"""The demo's reaper: what a demo killed with SIGKILL could not remove, removed once it is gone.

``dpboard demo`` starts it as its first child. Like every child it gets SIGTERM when the demo dies
(``PR_SET_PDEATHSIG``); a demo that stops on its own sends it SIGUSR1 instead, and it just exits.
When its parent is gone, it waits (bounded) for the demo's other children, whose pids the demo wrote to
``pids`` in its work folder as it started them, to exit (each removes what it owns on SIGTERM), then
removes the demo's board, what a child killed past its stop could not remove (its lock files, the
board's dispatch record), and the work folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from dpboard.board.dispatch_record import remove_if_abandoned
from dpboard.board.names import segment_name
from dpboard.board.segment import unlink_if_generation
from dpboard.ownership import endpoint_lock_key, process_exited, remove_abandoned_locks
from dpboard.stopping import SignalRelay

CHILDREN_TIMEOUT = 15.0  # seconds for the demo's other children to exit once it is gone
PARENT_TIMEOUT = 5.0  # seconds for a dying demo's last thread to exit after its death signal


def remove_leftovers(board: str, requests_endpoint: str) -> None:
    """What a demo's child killed with SIGKILL had no chance to remove: the controller's lock files
    (its board's, its input endpoint's) and the board's dispatch record, once nobody holds them."""
    remove_abandoned_locks(0.0, keys=(board, endpoint_lock_key(requests_endpoint)))
    remove_if_abandoned(board)


def _children(workdir: Path) -> list[int]:
    try:
        return [int(w) for w in (workdir / "pids").read_text().split()]
    except (OSError, ValueError):
        return []


def reap(board: str, generation: int, workdir: Path, requests_endpoint: str) -> None:
    """Once the demo's other children have exited (bounded), remove its board (that incarnation
    only), their leftovers and the work folder."""
    deadline = time.monotonic() + CHILDREN_TIMEOUT
    while any(not process_exited(pid) for pid in _children(workdir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    unlink_if_generation(segment_name(board), generation)
    remove_leftovers(board, requests_endpoint)
    shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpboard.demo.reaper")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--board", required=True)
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--requests", required=True)
    args = p.parse_args(argv)
    dying = threading.Event()
    done = threading.Event()
    # SIGTERM: PR_SET_PDEATHSIG, the demo (or its thread) died; SIGUSR1: the demo stops on its own and
    # cleans up itself. Set through the relay: a handler that set an event could deadlock in wait().
    SignalRelay({signal.SIGTERM: dying, signal.SIGUSR1: done}).__enter__()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the demo's to handle
    print("ready", flush=True)
    while not (dying.is_set() or done.is_set()) and os.getppid() == args.parent:
        dying.wait(1.0)  # a death signal lost: the parent's change says it all the same
    if done.is_set():
        return 0
    # The signal comes when the thread that started us exits; the demo's other threads may still be
    # going down a moment, and we are only handed to another parent once the last of them has.
    deadline = time.monotonic() + PARENT_TIMEOUT
    while os.getppid() == args.parent and not done.is_set():
        if time.monotonic() >= deadline:
            return 0  # the demo lives on: not ours to clean
        time.sleep(0.01)
    if done.is_set():
        return 0
    reap(args.board, args.generation, args.workdir, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
