"""`dpboard clean` and the files beside boards: sent records left by killed deployments, a live
record whose name ends in .lock, and owners starting while clean removes abandoned locks.

A whole `dpboard clean` looks at every dpboard file in /dev/shm, so those tests run in a private
/dev/shm (a tmpfs of their own, in a mount namespace of their own): they never touch files of
other runs on the machine."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpboard.board.listing import clean_sent_records, remove_if_gone
from dpboard.board.liveness import process_start_ticks
from dpboard.board.segment import read_segment_header
from dpboard.board.sent import SENT_PREFIX
from dpboard.ownership import lock_path
from tests.support.names import ROOT
from tests.support.other_user import as_nobody, need_root
from tests.support.private_shm import run_in_private_shm
from tests.support.procutil import kill, read_line
from tests.support.sweeps import keeping_a_dead_board

# A deployment's API server in a process of its own: the board (as its first engine core makes it),
# the sent record, row ROW with N requests sent to each of slots 0..2; then it waits to be killed.
_DEPLOYMENT = """
import sys
from dpboard.board import Board
from dpboard.board.sent import SentRecord
name, row, n, make_board = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
board = Board.create(name, 4) if make_board else Board.attach(name)
writer = SentRecord.open(name, 2, 4, generation=board.generation).row(row)
for slot in range(3):
    for _ in range(n):
        writer.add(slot, 1)
print("sent", flush=True)
sys.stdin.read()
"""


def deployment(name: str, row: int = 0, n: int = 1000, make_board: bool = True) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _DEPLOYMENT, name, str(row), str(n), "1" if make_board else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert read_line(proc, timeout=60).strip() == "sent"
    return proc


def clean(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard", "clean", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


@pytest.fixture
def paths(board_name):
    """The board's and its sent record's paths, removed after the test. The tests using it kill their
    deployment and then look at what it left in the machine's /dev/shm: a machine-wide sweep in
    another file (xdist) would remove those leftovers first, so the sweep lock is held shared."""
    board, record = Path("/dev/shm", f"dpboard.{board_name}"), Path("/dev/shm", SENT_PREFIX + board_name)
    with keeping_a_dead_board():
        yield board, record
    board.unlink(missing_ok=True)
    record.unlink(missing_ok=True)


def test_clean_removes_the_sent_record_of_a_sigkilled_deployment(board_name, paths):
    """`dpboard clean` said "nothing to remove" of the record a SIGKILLed deployment left, and the
    next deployment inherited it (400 of 400 picks to rank 3)."""
    board, record = paths
    kill(deployment(board_name))
    assert board.exists() and record.exists()
    out = clean(board_name)
    assert out.returncode == 0, out.stderr
    assert f"removed {board}" in out.stdout
    assert f"removed {record} (the sent record of board {board_name!r}, held by no live process)" in out.stdout
    assert not board.exists() and not record.exists()


def test_clean_of_a_board_gone_removes_its_record_but_not_one_a_live_server_holds(board_name, paths):
    board, record = paths
    server = deployment(board_name)
    try:
        os.unlink(board)  # its board is gone (removed under it)
        out = clean(board_name)
        assert out.returncode == 0, out.stderr
        assert record.exists() and "nothing to remove" in out.stdout  # a live server holds a row
    finally:
        kill(server)
    out = clean(board_name)
    assert out.returncode == 0, out.stderr
    assert f"removed {record}" in out.stdout and not record.exists()


def _in_private_shm(script: str, timeout: float = 240) -> dict:
    run = run_in_private_shm(script, size="16m", label="dpboard-clean", timeout=timeout)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


_LOCK_NAMED_RECORD = f"""
import json, os, subprocess, sys, time
from tests.board.test_clean import _DEPLOYMENT
from tests.support.other_user import as_nobody
from dpboard.board import clean_boards  # noqa: F401  (used when WHOLE)
from dpboard.ownership import remove_abandoned_locks
live = subprocess.Popen([sys.executable, "-c", _DEPLOYMENT, "m.lock", "0", "5", "1"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
dead = subprocess.Popen([sys.executable, "-c", _DEPLOYMENT, "gone", "1", "5", "1"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
try:
    assert live.stdout.readline().strip() == "sent" and dead.stdout.readline().strip() == "sent"
    dead.kill(); dead.wait(10)
    os.unlink("/dev/shm/dpboard.gone")  # its board went; the record stays
    def plant():
        fd = os.open("/dev/shm/{SENT_PREFIX}theirs", os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
    as_nobody(plant)
    from dpboard.ownership import lock_path
    abandoned = lock_path("collector.board", "gone")  # its collector was killed: no live holder
    fd = os.open(abandoned, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, b"999999999 1\\n")
    os.close(fd)
    old = time.time() - 3600  # mmap writes leave the mtime old: as a record written for hours
    for name in os.listdir("/dev/shm"):
        os.utime("/dev/shm/" + name, (old, old))
    out = {{"locks": [p.name for p in remove_abandoned_locks(min_age=0)]}}
    out["after_locks"] = sorted(os.listdir("/dev/shm"))
    if WHOLE:
        from dpboard.board.listing import clean_sent_records
        out["boards"], out["records"] = clean_boards(), clean_sent_records()
    out["left"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out))
finally:
    for p in (live, dead):
        p.kill(); p.wait(10)
"""


def test_clean_of_lock_files_keeps_a_live_record_named_like_a_lock():
    """The lock glob dpboard-*.lock matched dpboard-sent.m.lock: `dpboard clean` unlinked the live
    sent record of board `m.lock` (mmap writes leave its mtime old), and its two servers stopped
    seeing each other's sends."""
    out = _in_private_shm(_LOCK_NAMED_RECORD.replace("WHOLE", "False"))
    assert out["locks"] == [lock_path("collector.board", "gone").name]  # a real abandoned lock goes
    assert "dpboard-sent.m.lock" in out["after_locks"]


def test_a_whole_clean_removes_only_the_dead_deployments_record():
    out = _in_private_shm(_LOCK_NAMED_RECORD.replace("WHOLE", "True"))
    assert out["locks"] == [lock_path("collector.board", "gone").name]
    assert out["boards"] == []  # m.lock's creator runs
    assert out["records"] == ["gone"]  # the dead deployment's record, whose board is gone
    assert out["left"] == ["dpboard-sent.m.lock", "dpboard-sent.theirs", "dpboard.m.lock"]  # not another user's


_RACE = """
import json, os, sys, time
from dpboard.errors import DpboardError
from dpboard.ownership import OwnerLock, lock_path, remove_abandoned_locks
path = lock_path("endpoint", "race")
cleaner = os.fork()
if cleaner == 0:
    while not os.path.exists("/dev/shm/stop"):
        remove_abandoned_locks(min_age=0)
    os._exit(0)
failures = []
try:
    for _ in range(ROUNDS):
        # the lock file an owner of an older dpboard left, run as pid 1 in a container: a pid alone
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.write(fd, b"1\\n")
            os.close(fd)
        except FileExistsError:
            pass
        try:
            OwnerLock(path, "endpoint race").release()
        except DpboardError as e:
            failures.append(str(e))
finally:
    open("/dev/shm/stop", "w").close()
    os.waitpid(cleaner, 0)
print(json.dumps({"failures": failures}))
"""


def test_an_owner_starting_while_clean_removes_its_abandoned_lock_retries():
    """clean (min_age=0) racing a starting owner, 3,000 rounds: the starter failed 1-2 times with
    "has 0 hard links" or "already has owner: pid 1"."""
    out = _in_private_shm(_RACE.replace("ROUNDS", "3000"))
    assert out["failures"] == []


_EMPTY_MACHINE = """
import json, subprocess, sys
from dpboard import Board
first = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean"], capture_output=True, text=True, timeout=60)
board = Board.create("lonely", n_slots=1)
board.writer(0).publish_values(0, 0, 0, 0, 0, 1, 0)
second = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean"], capture_output=True, text=True, timeout=60)
board.close(); board.unlink()
print(json.dumps({"first": first.stdout, "second": second.stdout, "codes": [first.returncode, second.returncode]}))
"""


def test_clean_on_a_machine_without_boards_says_there_are_none():
    out = _in_private_shm(_EMPTY_MACHINE)
    assert out["codes"] == [0, 0]
    assert out["first"].strip() == "nothing to remove: there are no boards on this machine", out
    assert "every board is alive" in out["second"], out  # a live board: the other message



def _plant_board_as_nobody(name: str, generation: int) -> None:
    """What another user may leave under the name of a board that went: a readable (0644)
    ``dpboard.<name>`` with a whole header, the generation the board had (anybody who could read it
    knows it), pid 1 for its creator and no start time (0)."""
    from dpboard.board.header import BoardHeader, pack_header
    from dpboard.snapshot import HEADER_SIZE, LAYOUT_VERSION, SLOT_SIZE, segment_size

    header = BoardHeader(name=name, layout_version=LAYOUT_VERSION, header_size=HEADER_SIZE, n_slots=4,
                         slot_size=SLOT_SIZE, creator_pid=1, creation_time_ns=1, generation=generation,
                         node_id=0, creator_start_ticks=0)

    def plant() -> None:
        fd = os.open(f"/dev/shm/dpboard.{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.ftruncate(fd, segment_size(4))
            with mmap.mmap(fd, HEADER_SIZE) as mm:
                pack_header(mm, header)
        finally:
            os.close(fd)

    as_nobody(plant)


def test_a_board_another_user_plants_after_the_exit_keeps_no_record(board_name, paths):
    """The deployment's API servers are SIGKILLed (vLLM's way) and its board removed; another user
    then leaves a readable board of that name, its creator's start time 0. The launcher's way out,
    remove_if_gone(started_after=its own start), took it for an older deployment's board and
    returned at once, and the sent record stayed; with the generation copied, `clean` kept the
    record for the board "still there"."""
    need_root()
    board, record = paths
    kill(deployment(board_name))
    generation = read_segment_header("/dpboard." + board_name).generation
    board.unlink()  # its engine core removed it on its way out
    _plant_board_as_nobody(board_name, generation)
    assert board.stat().st_uid == 65534 and record.exists()
    removed = remove_if_gone(board_name, started_after=process_start_ticks(os.getpid()))
    assert removed == [SENT_PREFIX + board_name] and not record.exists()
    assert board.exists()  # another user's file: never removed from here
    # The same record and board, and `dpboard clean` (no deployment's start time) instead.
    kill(deployment(board_name + "b"))
    try:
        generation = read_segment_header("/dpboard." + board_name + "b").generation
        Path("/dev/shm", f"dpboard.{board_name}b").unlink()
        _plant_board_as_nobody(board_name + "b", generation)
        assert clean_sent_records(board_name + "b") == [board_name + "b"]
    finally:
        for prefix in ("dpboard.", SENT_PREFIX):
            Path("/dev/shm", prefix + board_name + "b").unlink(missing_ok=True)
