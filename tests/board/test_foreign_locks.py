"""Read locks that another user takes on a board: they are no writer's lock.

A board made readable by others (``Board.create(mode=0o644)``) may be opened read-only by any local
user, who may then take OFD read locks on any of its bytes (never a write lock: that needs a
descriptor open for writing). Such a lock used to count as the writer's or the creator's proof of
life: a slot whose writer died stayed "held" (the kernel hands a waiting read lock over when the
writer's lock goes), its restarted writer was refused, a read lock taken before any engine started
stopped every first writer, and a board whose creator was gone could never be cleaned. Each test
here takes the lock as uid 65534 (nobody) in a forked child; they need root."""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dpboard.board import Board
from dpboard.board.listing import read_listing, remove_if_gone
from dpboard.snapshot import HEADER_SIZE, SLOT_SIZE, LoadSnapshot, slot_offset
from tests.support.names import ROOT
from tests.support.other_user import NOBODY, need_root
from tests.support.procutil import kill, read_line, wait_for
from tests.support.sweeps import keeping_a_dead_board

pytestmark = pytest.mark.timeout(180)

PROCS = str(Path(__file__).parents[1] / "support" / "board_procs.py")
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on x86-64 / aarch64 Linux
_HOLD = 120.0  # seconds a lock holder waits for the test to let it go, at most


class ForeignReadLock:
    """A forked child running as uid 65534 that opens ``path`` read-only and holds an OFD read lock
    on ``length`` bytes from ``start`` (0: to the end and beyond) until ``release()``. ``wait``:
    F_OFD_SETLKW, which waits for a writer's lock to go, and gets the bytes when it does."""

    def __init__(self, path: Path, start: int, length: int, *, wait: bool = False) -> None:
        need_root()
        self.path = path
        status_r, status_w = os.pipe()
        control_r, self._control = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(status_r)
                os.close(self._control)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                os.write(status_w, b"opened\n")
                command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
                fcntl.fcntl(fd, command, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, start, length, 0))
                os.write(status_w, b"locked\n")
                select.select([control_r], [], [], _HOLD)  # until the test closes its end
                code = 0
            except BaseException as e:  # said to the test, which fails with it
                os.write(status_w, f"error {type(e).__name__}: {e}\n".encode())
            finally:
                os._exit(code)
        os.close(status_w)
        os.close(control_r)
        self._status = os.fdopen(status_r, "rb", buffering=0)

    def line(self, timeout: float = 30.0) -> str:
        """The child's next line: ``opened``, ``locked`` or ``error ...``."""
        got = b""
        while not got.endswith(b"\n"):
            ready, _, _ = select.select([self._status], [], [], timeout)
            chunk = self._status.read(1) if ready else b""
            if not chunk:
                raise AssertionError(f"the lock holder (pid {self.pid}) said nothing more within {timeout} s: {got!r}")
            got += chunk
        return got.decode().strip()

    def locked(self) -> None:
        assert self.line() == "opened"
        said = self.line()
        assert said == "locked", said

    def release(self) -> None:
        if self._control >= 0:
            os.close(self._control)
            self._control = -1
            os.waitpid(self.pid, 0)
            self._status.close()


def _waiting_on(path: Path) -> bool:
    """Whether /proc/locks shows a lock request blocked on the file (a ``->`` line of its inode)."""
    inode = path.stat().st_ino
    return any("->" in line and f":{inode} " in line for line in Path("/proc/locks").read_text().splitlines())


def _gone(board: Board) -> tuple[int, ...]:
    """The slots without a writer, as a dispatcher's first look at the locks finds them."""
    locks = board.slot_locks()
    try:
        return locks.refresh()
    finally:
        locks.close()


def _second_writer(name: str, rank: int) -> str:
    """What ``writer(rank)`` says in another process of this user: ``ok`` or its error."""
    code = ("import sys\nfrom dpboard.board import Board\n"
            "try:\n    Board.attach(sys.argv[1]).writer(int(sys.argv[2])).close()\n    print('ok')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    run = subprocess.run([sys.executable, "-c", code, name, str(rank)], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_a_read_lock_taken_before_any_engine_starts_stops_no_writer(board_name):
    """nobody read-locked every slot of a board before its engines started: every writer(rank) was refused
    ("held by the writer in a live process that is claiming it"), so an onlooker of /dev/shm kept a
    server from starting; and a slot read as held with no writer at all."""
    need_root()
    with Board.create(board_name, 2, mode=0o644) as board:
        # every slot's bytes and beyond (the header's are the live creator's: its write lock refuses any other)
        onlooker = ForeignReadLock(Path("/dev/shm", f"dpboard.{board_name}"), HEADER_SIZE, 0)
        try:
            onlooker.locked()
            writer = board.writer(0)  # the first engine starts
            writer.publish(LoadSnapshot(0, num_running_reqs=3))
            assert _gone(board) == (1,)  # slot 1 has no writer, whoever read-locks it; slot 0's runs
            assert board.reader().read(0).num_running_reqs == 3
            # One writer per slot still holds: a second one, in another process, is refused.
            refused = _second_writer(board_name, 0)
            assert refused.startswith("BoardError") and f"live process {os.getpid()}" in refused, refused
            writer.close()
            assert _gone(board) == (0, 1)  # left: gone at once, as without the onlooker
            assert _second_writer(board_name, 0) == "ok"
        finally:
            onlooker.release()


def test_a_read_lock_handed_over_when_the_writer_dies_is_not_the_writer(board_name):
    """nobody waited for a read lock on slot 0 (F_OFD_SETLKW) while its engine wrote it; when the
    engine was killed, the kernel gave nobody the bytes. The slot then read as held for good
    (`SlotLocks` never reported rank 0 gone) and the restarted engine's writer(0) was refused with
    "held by the writer in live process <the dead engine's pid>"."""
    need_root()
    path = Path("/dev/shm", f"dpboard.{board_name}")
    with Board.create(board_name, 2, mode=0o644) as board:
        engine = subprocess.Popen([sys.executable, PROCS, "hold_writer", board_name, "0"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        onlooker = None
        try:
            dead = json.loads(read_line(engine, 60))["pid"]
            onlooker = ForeignReadLock(path, slot_offset(0), SLOT_SIZE, wait=True)
            assert onlooker.line() == "opened"
            wait_for(lambda: _waiting_on(path), 30, "nobody's read lock to wait for the engine's")
            assert _gone(board) == (1,)
            kill(engine)
            assert onlooker.line() == "locked"  # the kernel handed it the slot's bytes
            assert _gone(board) == (0, 1)  # the engine is gone, whoever reads its bytes
            restarted = board.writer(0)  # the restarted engine
            restarted.publish(LoadSnapshot(0, num_running_reqs=1))
            assert board.owner(0)[0] == os.getpid() != dead
            assert _gone(board) == (1,)
            restarted.close()
        finally:
            kill(engine)
            if onlooker is not None:
                onlooker.release()


_CREATE_AND_VANISH = """
import os, sys
from dpboard.board import Board
Board.create(sys.argv[1], 2, mode=0o644)
os._exit(0)  # as a crash would: the board stays, its creator's lock goes
"""


def test_a_read_lock_on_a_dead_creators_board_does_not_keep_it(board_name):
    """nobody read-locked the header of a board whose creator was gone: `dpboard clean` and the exit
    paths (`remove_if_gone`) took it as "a live process holds its lock" for as long as nobody
    liked."""
    need_root()
    path = Path("/dev/shm", f"dpboard.{board_name}")
    with keeping_a_dead_board():  # out of the reach of another file's machine-wide `dpboard clean`
        subprocess.run([sys.executable, "-c", _CREATE_AND_VANISH, board_name], check=True, timeout=60, cwd=ROOT)
        onlooker = ForeignReadLock(path, 0, HEADER_SIZE)
        try:
            onlooker.locked()
            entry = read_listing(board_name)
            assert not entry.held and entry.in_use() is None, entry.in_use()
            assert remove_if_gone(board_name) == [f"dpboard.{board_name}"] and not path.exists()
        finally:
            onlooker.release()
            path.unlink(missing_ok=True)


def test_a_live_creators_lock_is_not_blocked_by_a_read_lock(board_name):
    """The creator holds a write lock on its header (the proof of life `dpboard clean` asks for):
    nobody's read lock waits behind it, and the board stays in use by that proof alone."""
    need_root()
    path = Path("/dev/shm", f"dpboard.{board_name}")
    with Board.create(board_name, 2, mode=0o644):
        onlooker = ForeignReadLock(path, 0, HEADER_SIZE)
        try:
            said = [onlooker.line(), onlooker.line()]
            assert said[0] == "opened" and said[1].startswith("error"), said  # refused: the creator holds it
        finally:
            onlooker.release()
        assert read_listing(board_name).held
