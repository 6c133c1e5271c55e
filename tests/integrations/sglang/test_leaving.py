"""The watcher the SGLang plugin starts beside a server's board (dpboard/integrations/sglang/leaving.py),
with real processes standing where SGLang's stand: a "main" process that creates the board and starts
the watcher, and a "dispatcher" process (SGLang's DP controller) that holds a row of the board's
dispatch record. SGLang's two ways out: SIGKILL to everything, and a main process that removes its
board at its exit but lingers (its interpreter's finalisation) while its dispatcher is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from dpboard.board import SHM_DIR
from tests.support.names import ROOT, new_board_name
from tests.support.procutil import wait_until

MAIN = textwrap.dedent("""
    import os, sys, time
    from dpboard.board import Board
    from dpboard.integrations.sglang import leaving
    name, linger = sys.argv[1], float(sys.argv[2])
    board = Board.create(name, 2)
    print(leaving.watch(board.name, board.generation), flush=True)
    sys.stdin.readline()  # the test's word: leave
    if linger:
        board.close()
        board.unlink()  # what the creator's exit does, then a slow end
        time.sleep(linger)
    os._exit(0)
""")
DISPATCHER = textwrap.dedent("""
    import sys, time
    from dpboard.board.dispatch_record import open_tally
    tally = open_tally(sys.argv[1], 1, 0, 2, method="inflight_tokens")
    tally.tick()
    print("ready", flush=True)
    time.sleep(600)
""")


def python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)


def left(name: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"dpboard*.{name}"))


def deployment(name: str, linger: float) -> tuple[subprocess.Popen, subprocess.Popen, int]:
    main = python(MAIN, name, str(linger))
    watcher = int(main.stdout.readline())
    dispatcher = python(DISPATCHER, name)
    assert dispatcher.stdout.readline().strip() == "ready"
    assert left(name) == [f"dpboard-dispatch.{name}", f"dpboard.{name}"]
    return main, dispatcher, watcher


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_everything_sigkilled_leaves_nothing_once_the_watcher_has_seen_it():
    name = new_board_name()
    main, dispatcher, watcher = deployment(name, 0)
    assert not gone(watcher)
    for proc in (dispatcher, main):
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert wait_until(lambda: left(name) == [], timeout=60), left(name)
    assert wait_until(lambda: gone(watcher), timeout=30)


def test_a_board_removed_by_its_lingering_creator_still_has_its_dispatch_record_removed():
    """The creator removes the board at its exit and ends 6 s later (longer than the watcher's look
    at the board every 5 s), its dispatcher SIGKILLed meanwhile: the record goes too."""
    name = new_board_name()
    main, dispatcher, watcher = deployment(name, 6.0)
    main.stdin.write("leave\n")
    main.stdin.flush()
    assert wait_until(lambda: f"dpboard.{name}" not in left(name), timeout=30)
    dispatcher.send_signal(signal.SIGKILL)
    dispatcher.wait(timeout=30)
    main.wait(timeout=60)
    assert wait_until(lambda: left(name) == [], timeout=60), left(name)
    assert wait_until(lambda: gone(watcher), timeout=30)
