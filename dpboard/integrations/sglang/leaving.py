"""An SGLang server's way out: nothing of its board is left in /dev/shm once its processes are gone.

SGLang ends a server with ``kill_process_tree`` (sglang/srt/utils/common.py): SIGKILL to every child
and, on most paths, to the server's main process itself (a scheduler that dies makes the DP
controller or the scheduler send SIGQUIT to the main process, whose handler kills the tree, itself
included; a SIGTERM to the process group gets there too). The main process created the board and
would remove it at its exit, but a SIGKILLed process runs nothing. So the main process starts a
watcher when it creates the board: a small process of its own session, not a child of any SGLang
process (``kill_process_tree`` walks children, a process-group SIGTERM reaches the group), that
waits for the main process to end and then removes the board, its sent record and its dispatch
record by dpboard's one rule for "gone" (``BoardListing.in_use``, the rule ``dpboard clean``
applies): never while any process of the deployment still holds a slot, publishes, or runs.

The watcher holds no descriptor of SGLang's (no port, no pipe beyond stderr) and ends once its job
is done, or when another board of this user takes the name (a new server's: another generation),
whenever that happens; from then on the name's board and records are that server's, and this watcher
touches none of them (a new server's start removes what of ours it finds abandoned, or its processes
take it over). A board its creator removed at its exit does not end it: SGLang's DP controller,
SIGKILLed meanwhile, leaves its dispatch record behind. Nor does a file of another user under the
name (anybody may leave one): it is never this server's, never removed, and never waited for.

"Gone" never rests on a pid: the main process is watched through a pidfd, taken while it runs and
checked against its start time (a pid that names another process by then means it has ended), and
the board's creator counts as running only with its recorded start time; a recycled pid is another
process.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import subprocess
import sys
import time

from dpboard.board.dispatch_record import DISPATCH_PREFIX, remove_abandoned_records
from dpboard.board.listing import BoardListing, clean_sent_records, own_files, read_listing
from dpboard.board.liveness import process_start_ticks
from dpboard.board.names import SEGMENT_PREFIX, SHM_DIR
from dpboard.board.segment import unlink_if_generation
from dpboard.board.sent import SENT_PREFIX
from dpboard.errors import DpboardError, NotFoundError

log = logging.getLogger("dpboard.sglang")
# How long the watcher waits, once the main process is gone, for the schedulers it killed to be
# gone too (a scheduler of several GB takes a moment after SIGKILL) and for the last publish to age
# past the stale threshold.
EXIT_WAIT = 30.0
# How often the watcher looks whether the board is still there while its creator runs (a board
# removed by a clean exit, or replaced, ends the watcher).
BOARD_CHECK_EVERY = 5.0
STARTUP_WAIT = 10.0  # for the first fork of the watcher to return


def watch(board_name: str, generation: int) -> int | None:
    """Start the watcher of ``board_name`` (made by this process, of that generation) for this
    process's end. Returns the watcher's pid, or None where it could not start (logged once)."""
    me = os.getpid()
    ticks = process_start_ticks(me)
    if ticks is None:
        return None
    argv = [sys.executable, "-m", __name__, "--board", board_name, "--generation", str(generation),
            "--pid", str(me), "--start-ticks", str(ticks)]
    try:
        # It forks once more and its first process exits at once: the watcher is then no child of
        # this process (which kill_process_tree would SIGKILL) and of its own session.
        starter = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True,
                                   close_fds=True)
        out, _ = starter.communicate(timeout=STARTUP_WAIT)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("dpboard: could not start the watcher that removes board %r after this server ends (%s): "
                    "`dpboard clean` removes it by hand", board_name, e)
        return None
    try:
        return int(out.decode().strip())
    except ValueError:
        log.warning("dpboard: the watcher of board %r did not start (exit %s): `dpboard clean` removes it by hand",
                    board_name, starter.returncode)
        return None


def _own_board(name: str) -> BoardListing | None:
    """The listing of ``/dev/shm/dpboard.<name>`` when it is a file of this user; None when there is
    none, or it is another user's (anybody may leave a file under any name: never this server's)."""
    try:
        entry = read_listing(name)
    except NotFoundError:
        return None
    if entry.owner_uid is None:  # not even its owner could be read: gone meanwhile, or not a file
        try:
            owner = os.lstat(SHM_DIR / (SEGMENT_PREFIX + name)).st_uid
        except OSError:
            return None
        if owner != os.geteuid():
            return None
    elif entry.owner_uid != os.geteuid():
        return None
    return entry


def _replaced(name: str, generation: int) -> bool:
    """Whether another board of this user now has the name (a new server of that name): then this
    watcher's job is done. A board that is merely gone is not: its creator removes it at its exit,
    before it ends, and the records its other processes leave are still this watcher's to remove.
    Nor is another user's file under the name."""
    try:
        entry = _own_board(name)
    except DpboardError:
        return False  # unreadable for a moment
    return entry is not None and (entry.header is None or entry.header.generation != generation)


def wait_for_end(pid: int, start_ticks: int, name: str, generation: int) -> bool:
    """Wait until process ``pid`` (started at ``start_ticks``) ends; False when another board took the
    name meanwhile, so there is nothing to do."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if process_start_ticks(pid) != start_ticks:
            return True  # the pid names another process already: ours has ended
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll(int(BOARD_CHECK_EVERY * 1000)):
            if _replaced(name, generation):
                return False
        return True
    finally:
        os.close(pidfd)


def _remove_board(entry: BoardListing, generation: int) -> bool:
    """Unlink this server's board (``generation``) when nothing of it lives, by the rule ``dpboard
    clean`` applies (``BoardListing.in_use``); a board of another generation is never touched."""
    if entry.header is None or entry.header.generation != generation or entry.in_use() is not None:
        return False
    return unlink_if_generation("/" + SEGMENT_PREFIX + entry.name, generation)


def remove_when_gone(name: str, start_ticks: int, generation: int, *, wait: float = EXIT_WAIT) -> list[str]:
    """Remove what is left of board ``name`` (this server's: ``generation``, made by a process that
    started at ``start_ticks``) once nothing of it lives, waiting at most ``wait`` seconds. The board
    and its records each go when their own processes are gone (a dispatcher exits a moment after
    the schedulers whose slots it reads, say), so it waits for all of them. It stops at once, removing
    nothing more, when another board of this user has the name (a new server's, or an older one's):
    the name's records are then that server's. Another user's file under the name is left alone and
    not waited for."""
    deadline = time.monotonic() + wait
    removed: list[str] = []
    while True:
        try:
            entry = _own_board(name)
        except DpboardError as e:
            log.warning("dpboard: board %r left in /dev/shm: %s", name, e)
            return removed
        if entry is not None and (entry.header is None or entry.header.generation != generation
                                  or entry.header.creator_start_ticks < start_ticks):
            return removed  # another server's board by that name now: its records are its own
        if entry is not None and _remove_board(entry, generation):
            removed.append(SEGMENT_PREFIX + name)
            entry = None
        if _replaced(name, generation):
            return removed  # a new server's board made meanwhile: the records are its own from now on
        removed += [SENT_PREFIX + n for n in clean_sent_records(name)]
        removed += [DISPATCH_PREFIX + n for n in remove_abandoned_records(name)]
        left = own_files(name)
        if not left:
            return removed
        if time.monotonic() >= deadline:
            why = entry.in_use() if entry is not None else None
            log.warning("dpboard: %s left in /dev/shm %.0f s after its SGLang server ended: %s; "
                        "`dpboard clean %s` removes it once nothing of it runs", ", ".join(left), wait,
                        why or "a process that holds its record still runs", name)
            return removed
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="remove an SGLang server's board once the server has ended")
    parser.add_argument("--board", required=True)
    parser.add_argument("--generation", type=int, required=True)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-ticks", type=int, required=True)
    args = parser.parse_args(argv)
    child = os.fork()
    if child:
        print(child, flush=True)  # the starter learns the watcher's pid, then this process ends
        return 0
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the starter's pipe: closed here so that it reads its end
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if wait_for_end(args.pid, args.start_ticks, args.board, args.generation):
        removed = remove_when_gone(args.board, args.start_ticks, args.generation)
        if removed:
            log.info("dpboard: removed %s after SGLang server %d ended", ", ".join(removed), args.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
