"""The watcher the SGLang plugin starts beside a server's board (dpboard/integrations/sglang/leaving.py),
with real processes standing where SGLang's stand: a "main" process that creates the board and starts
the watcher, and a "dispatcher" process (SGLang's DP controller) that holds a row of the board's
dispatch record. SGLang's two ways out: SIGKILL to everything, and a main process that removes its
board at its exit but lingers (its interpreter's finalisation) while its dispatcher is SIGKILLed.

And the races a watcher meets: a new server's board under the name while the old server's watcher
still waits (it is left alone, and the watcher ends without waiting for it), the watched pid taken by
another process (``take_pid``: the kernel's ``ns_last_pid``, root only), and another user's file
under the name (a real second uid, 65534: never removed, never waited for)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.board.liveness import process_start_ticks
from dpboard.board.segment import read_segment_header
from dpboard.integrations.sglang import leaving
from tests.support.names import ROOT, new_board_name
from tests.support.other_user import NOBODY, as_nobody, need_root
from tests.support.procutil import NoWait, kill, read_line, wait_until

MAIN = textwrap.dedent("""
    import os, sys, time
    from dpboard.board import Board
    from dpboard.integrations.sglang import leaving, transport
    name, linger = sys.argv[1], float(sys.argv[2])
    # as the plugin opens it: a board of that name whose creator is gone is replaced
    board = transport.open_instance_board(name, 2, 0, replace_dead=True)
    print(leaving.watch(board.name, board.generation) if len(sys.argv) < 4 else "none", flush=True)
    print(board.generation, leaving.process_start_ticks(os.getpid()), flush=True)
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
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def python(code: str, *args: str, stderr: int | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, cwd=ROOT)


def left(name: str) -> list[str]:
    """This user's files of board ``name`` in /dev/shm."""
    found = []
    for path in SHM_DIR.glob(f"dpboard*.{name}"):
        try:
            if path.lstat().st_uid == os.geteuid():
                found.append(path.name)
        except FileNotFoundError:
            pass  # removed as we looked
    return sorted(found)


class Deployment:
    """A main process (its board, its watcher) and a dispatcher holding the board's dispatch record."""

    def __init__(self, name: str, linger: float = 0, *, watcher: bool = True) -> None:
        self.name = name
        self.main = python(MAIN, name, str(linger), *(() if watcher else ("--no-watcher",)),
                           stderr=subprocess.PIPE)
        first = read_line(self.main, 60).strip()
        self.watcher = int(first) if watcher else None
        generation, ticks = read_line(self.main, 60).split()
        self.generation, self.start_ticks = int(generation), int(ticks)
        self.dispatcher = python(DISPATCHER, name)
        assert read_line(self.dispatcher, 60).strip() == "ready"
        assert left(name) == [f"dpboard-dispatch.{name}", f"dpboard.{name}"]

    def leave(self) -> None:
        self.main.stdin.write("leave\n")
        self.main.stdin.flush()

    def kill(self) -> None:
        for proc in (self.dispatcher, self.main):
            kill(proc)

    def log(self) -> str:
        """What the main process and its watcher wrote on their stderr (once both have ended)."""
        return self.main.stderr.read()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def pid_in_use(pid: int) -> bool:
    """Whether ``pid`` names a process or thread, or the process group or session of one (zombies
    included): the kernel gives such a number to no new process."""
    if os.path.exists(f"/proc/{pid}"):
        return True
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if pid in (int(fields[2]), int(fields[3])):  # its process group, its session
                return True
    return False


def take_pid(pid: int, argv: list[str], *, wait: float = 120.0, attempts: int = 100) -> subprocess.Popen:
    """``argv`` started as process ``pid`` (a pid whose process has ended and been reaped): the kernel
    gives a new process the pid after ``ns_last_pid`` when it is free, and root may set that (in its
    own PID namespace). Skips where it may not. It waits (at most ``wait`` seconds) for the number to
    be free (a session leader's pid stays taken while a process of its session, a zombie too, is
    left), and tries again where another process forked in between, a bounded number of times."""
    need_root()
    if not wait_until(lambda: not pid_in_use(pid), timeout=wait, interval=0.1):
        raise AssertionError(f"pid {pid} is still in use (a process, or a group or session of one) after {wait:g} s")
    for _ in range(attempts):
        try:
            NS_LAST_PID.write_text(str(pid - 1))
        except OSError as e:
            pytest.skip(f"cannot write {NS_LAST_PID} ({e.strerror}): no way here to have a pid reused at once")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        if proc.pid == pid:
            return proc
        kill(proc)  # another process forked in between: try again
        if not wait_until(lambda: not pid_in_use(pid), timeout=wait, interval=0.1):
            break
    raise AssertionError(f"pid {pid} could not be taken in {attempts} attempts: other processes kept taking it")


def plant_foreign_board(name: str) -> None:
    """What another user (uid 65534) may leave under the name: a real board of theirs, readable by
    all (0644), its creator started after this server's and gone (it never removes it)."""
    need_root()

    def plant() -> int:
        board = Board.create(name, 2, mode=0o644)
        plant.keep = board  # type: ignore[attr-defined]  # the child ends with os._exit: nothing removed
        return board.generation

    as_nobody(plant)
    assert (SHM_DIR / f"dpboard.{name}").stat().st_uid == NOBODY


def remove_foreign(name: str) -> None:
    (SHM_DIR / f"dpboard.{name}").unlink(missing_ok=True)


def test_everything_sigkilled_leaves_nothing_once_the_watcher_has_seen_it():
    name = new_board_name()
    dep = Deployment(name)
    assert not gone(dep.watcher)
    dep.kill()
    assert wait_until(lambda: left(name) == [], timeout=60), left(name)
    assert wait_until(lambda: gone(dep.watcher), timeout=30)


def test_a_board_removed_by_its_lingering_creator_still_has_its_dispatch_record_removed():
    """The creator removes the board at its exit and ends 6 s later (longer than the watcher's look
    at the board every 5 s), its dispatcher SIGKILLed meanwhile: the record goes too."""
    name = new_board_name()
    dep = Deployment(name, 6.0)
    dep.leave()
    assert wait_until(lambda: f"dpboard.{name}" not in left(name), timeout=30)
    kill(dep.dispatcher)
    dep.main.wait(timeout=60)
    assert wait_until(lambda: left(name) == [], timeout=60), left(name)
    assert wait_until(lambda: gone(dep.watcher), timeout=30)


def test_a_new_board_of_the_name_ends_the_old_watcher_and_keeps_everything_of_the_new_one():
    """Server A is SIGKILLed while its watcher is held back (SIGSTOP: a watcher the loaded machine
    has not run yet); server B starts on the name (its start replaces A's dead board, as the plugin's
    does) and its dispatcher takes the record. A's watcher, let go, leaves B's board and record alone
    and ends at once. Before: it took B's board for A's (made after A started), waited 30 s for it
    and logged "dpboard.<name>, dpboard-dispatch.<name> left in /dev/shm 30 s after its SGLang server
    ended" about a server that runs."""
    name = new_board_name()
    a = Deployment(name)
    os.kill(a.watcher, signal.SIGSTOP)
    try:
        a.kill()
        b = Deployment(name)
        try:
            assert b.generation != a.generation
        finally:
            os.kill(a.watcher, signal.SIGCONT)
        assert wait_until(lambda: gone(a.watcher), timeout=60)
        assert "left in /dev/shm" not in a.log()
        assert left(name) == [f"dpboard-dispatch.{name}", f"dpboard.{name}"]
        assert read_segment_header(f"/dpboard.{name}").generation == b.generation
        b.kill()
        assert wait_until(lambda: left(name) == [], timeout=60), left(name)
        assert wait_until(lambda: gone(b.watcher), timeout=30)
    finally:
        if not gone(a.watcher):
            os.kill(a.watcher, signal.SIGCONT)


def test_a_pid_reused_before_the_watcher_looks_is_not_the_server():
    """The server's main process is gone (SIGKILLed, reaped) and its pid already names another
    process when the watcher first looks (``--pid``/``--start-ticks`` as the plugin passes them): the
    watcher takes the server for ended, and the board's creator for dead (its recorded start time is
    not the new process's), and removes the board and the record while the new process runs."""
    name = new_board_name()
    dep = Deployment(name, watcher=False)
    pid = dep.main.pid
    dep.kill()
    other = take_pid(pid, ["sleep", "120"])
    try:
        assert process_start_ticks(pid) != dep.start_ticks
        starter = subprocess.run([sys.executable, "-m", "dpboard.integrations.sglang.leaving", "--board", name,
                                  "--generation", str(dep.generation), "--pid", str(pid),
                                  "--start-ticks", str(dep.start_ticks)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
        watcher = int(starter.stdout)
        assert wait_until(lambda: left(name) == [], timeout=60), left(name)
        assert other.poll() is None  # the pid's new process ran all along
        assert wait_until(lambda: gone(watcher), timeout=30)
    finally:
        kill(other)


def test_another_users_board_planted_while_the_creator_lingers_does_not_end_the_watcher():
    """The creator removes its board at its exit and lingers; another user (uid 65534) leaves a board
    of theirs under the name meanwhile. The watcher's look at the name (every 5 s) took that board
    for a new server's and ended, and the dispatch record stayed; now the record goes, and the other
    user's board stays."""
    need_root()
    name = new_board_name()
    dep = Deployment(name, 6.0)
    try:
        dep.leave()
        assert wait_until(lambda: f"dpboard.{name}" not in left(name), timeout=30)
        plant_foreign_board(name)
        kill(dep.dispatcher)
        dep.main.wait(timeout=60)
        assert wait_until(lambda: left(name) == [], timeout=60), left(name)
        assert wait_until(lambda: gone(dep.watcher), timeout=30)
        assert (SHM_DIR / f"dpboard.{name}").stat().st_uid == NOBODY
    finally:
        dep.kill()
        remove_foreign(name)


def test_another_users_board_is_neither_removed_nor_waited_for(monkeypatch, caplog):
    """The server's processes are gone, its board too, and another user's readable board (made after
    the server started) has the name: the watcher removes this user's dispatch record and returns
    without a wait. Before, it waited the full 30 s for that board, then logged it as left behind."""
    need_root()
    name = new_board_name()
    dep = Deployment(name, watcher=False)
    dep.kill()
    (SHM_DIR / f"dpboard.{name}").unlink()
    plant_foreign_board(name)
    monkeypatch.setattr(leaving, "time", NoWait)
    try:
        with caplog.at_level(logging.WARNING, logger="dpboard.sglang"):
            removed = leaving.remove_when_gone(name, dep.start_ticks, dep.generation)
        assert removed == [f"dpboard-dispatch.{name}"]
        assert left(name) == [] and not caplog.records
        assert (SHM_DIR / f"dpboard.{name}").stat().st_uid == NOBODY
    finally:
        remove_foreign(name)


HOLD_SLOT = textwrap.dedent("""
    import sys
    from dpboard.board import Board
    from dpboard.snapshot import LoadSnapshot
    board = Board.attach(sys.argv[1])
    writer = board.writer(1)
    writer.publish(LoadSnapshot(1))
    print("holding", flush=True)
    sys.stdin.readline()
""")


def test_a_board_whose_creator_is_gone_but_a_scheduler_still_writes_is_refused_in_sglangs_words():
    """An earlier server's main process is gone while one of its schedulers still holds a slot (it is
    exiting): a new server under the name is refused with what to do as an SGLang user (wait, or
    another DPBOARD_BOARD), not with `dpboard clean`'s `--force`, and the board is left alone."""
    from dpboard.errors import AlreadyExistsError
    from dpboard.integrations.sglang import transport

    name = new_board_name()
    creator = python("import sys\nfrom dpboard.board import Board\nBoard.create(sys.argv[1], 2)\n"
                     "print('made', flush=True)\nsys.stdin.readline()\nimport os\nos._exit(0)\n", name)
    holder = None
    try:
        assert read_line(creator, 30).strip() == "made"
        holder = python(HOLD_SLOT, name)
        assert read_line(holder, 30).strip() == "holding"
        creator.stdin.close()  # the main process leaves without removing its board
        creator.wait(30)
        with pytest.raises(AlreadyExistsError) as refused:
            transport.open_instance_board(name, 2, 0, replace_dead=True)
        said = str(refused.value)
        assert "of an earlier server under this name is still in use" in said and "DPBOARD_BOARD" in said
        assert "--force" not in said
        assert left(name) == [f"dpboard.{name}"]
        holder.stdin.close()  # the scheduler ends: once its last publish is stale, the board is replaced
        holder.wait(30)
        from dpboard.board.listing import read_listing
        wait_until(lambda: read_listing(name).in_use() is None, 10)
        board = transport.open_instance_board(name, 2, 0, replace_dead=True)
        try:
            assert board.header.creator_pid == os.getpid()
        finally:
            board.close()
            board.unlink()
    finally:
        for proc in (creator, holder):
            if proc is not None:
                kill(proc)
        for path in left(name):
            (SHM_DIR / path).unlink(missing_ok=True)
