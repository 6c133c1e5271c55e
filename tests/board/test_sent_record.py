"""The sent record (/dev/shm/dpboard-sent.<board>) against what breaks it for real: another user's
planted record (a real uid 65534 process), links, damaged files, senders SIGKILLed or stopped in
the middle of ``add``, pid reuse, a full /dev/shm, and a record left by an earlier deployment."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpboard.board import Board
from dpboard.board.errors import BoardError, BoardLayoutError
from dpboard.board.liveness import process_start_ticks
from dpboard.board.sent import (
    LIVENESS_INTERVAL,
    SENT_HEADER_SIZE,
    SENT_PREFIX,
    SentRecord,
    record_size,
    row_size,
)
from dpboard.errors import AccessDeniedError
from dpboard.snapshot import pack_owner
from tests.support.names import ROOT
from tests.support.other_user import as_nobody, error_as_nobody, need_root
from tests.support.private_shm import run_in_private_shm
from tests.support.procutil import kill, read_line, wait_until

ROWS, SLOTS = 2, 4


@pytest.fixture
def board(board_name):
    """A board of SLOTS slots; its sent record is removed afterwards (the leak check covers boards)."""
    b = Board.create(board_name, SLOTS)
    yield b
    b.close()
    b.unlink()
    Path("/dev/shm", SENT_PREFIX + board_name).unlink(missing_ok=True)


def record_path(board) -> Path:
    return Path("/dev/shm", SENT_PREFIX + board.name)


def open_record(board, rows=ROWS, **kw) -> SentRecord:
    return SentRecord.open(board.name, rows, SLOTS, generation=board.generation, **kw)


# A sender in a process of its own: takes row ROW, sends N requests to SLOT, prints "sent", then does
# what it is told: "wait" (until stdin closes); "tear-kill" / "tear-stop": the first half of an add,
# then SIGKILL / SIGSTOP itself (a sender killed or stopped between the two seq increments); with
# "-gated", it waits for a line on stdin before tearing.
_SENDER = """
import os, signal, sys
from dpboard.board.sent import SentRecord
board, gen, rows, slots, row, slot, n, then = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:8]), sys.argv[8]
record = SentRecord.open(board, rows, slots, generation=gen)
writer = record.row(row)
for _ in range(n):
    writer.add(slot, 10)
print("sent", flush=True)
if then.endswith("-gated"):
    sys.stdin.readline()
if then.startswith("tear"):
    writer._row.begin()  # odd: the first half of an add ...
    writer._counts[slot, 0] += 1  # ... its request counted, its tokens not yet
    os.kill(os.getpid(), signal.SIGKILL if then.startswith("tear-kill") else signal.SIGSTOP)
sys.stdin.read()
"""


def sender(board, row, slot, n, then="wait", rows=ROWS) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, board.name, str(board.generation), str(rows), str(SLOTS),
                             str(row), str(slot), str(n), then],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert read_line(proc, timeout=60).strip() == "sent"
    return proc


def stopped(proc) -> bool:
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def settled_totals(record, departed=None):
    """totals() once every row's holder has been looked at again (after LIVENESS_INTERVAL)."""
    record.totals(departed=departed)
    time.sleep(LIVENESS_INTERVAL * 1.5)
    return record.totals(departed=departed)


# -- 28.3: ownership, mode, size, links ----------------------------------------------------------


def _plant(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.fchmod(fd, mode)
    os.write(fd, data)
    os.close(fd)


def _record_bytes(board, rows=ROWS, *, counts=0, holder=0, seq=0) -> bytes:
    """A whole version-2 record of this board with ``counts`` requests to slot 0 in every row."""
    header = struct.pack("<8sIIIIqQq", b"DPBSENT\x00", 2, rows, SLOTS, row_size(SLOTS), 1, board.generation, 0)
    header += bytes(SENT_HEADER_SIZE - len(header))
    row = struct.pack("<QQ16xqq", seq, holder, counts, counts * 10).ljust(row_size(SLOTS), b"\0")
    return header + row * rows


def test_another_users_record_is_refused_with_one_line(board):
    """A 0666 record planted by uid 65534 with skewed counts was attached: 200 of 200 picks went to rank 3."""
    need_root()
    path = record_path(board)
    as_nobody(lambda: _plant(path, _record_bytes(board, counts=1000), 0o666))
    with pytest.raises(AccessDeniedError, match=r"belongs to uid 65534 .*mode 0o666.*not to this process") as e:
        open_record(board)
    assert "\n" not in str(e.value)
    assert path.stat().st_uid == 65534  # left alone: not ours to remove


def test_a_0666_record_of_our_own_is_refused(board):
    _plant(record_path(board), _record_bytes(board), 0o666)
    with pytest.raises(AccessDeniedError, match=r"is mode 0o666: other users may write it"):
        open_record(board)


def test_a_72_byte_record_of_another_user_is_refused_and_one_of_ours_is_replaced(board):
    """A 72-byte record gave `TypeError: buffer is too small`."""
    need_root()
    path = record_path(board)
    as_nobody(lambda: _plant(path, _record_bytes(board)[:72], 0o600))
    with pytest.raises(AccessDeniedError, match="belongs to uid 65534"):
        open_record(board)
    path.unlink()
    _plant(path, _record_bytes(board)[:72], 0o600)
    record = open_record(board)
    try:
        assert path.stat().st_size == record_size(ROWS, SLOTS)  # a new, whole record
        record.row(0).add(1, 5)
        assert record.totals()[1].tolist() == [1, 5]
    finally:
        record.close()


def test_a_symbolic_link_is_refused_never_followed(board, tmp_path):
    """A symlink gave a raw ELOOP OSError."""
    target = tmp_path / "target"
    target.write_bytes(_record_bytes(board))
    target.chmod(0o600)
    record_path(board).symlink_to(target)
    with pytest.raises(AccessDeniedError, match="is a symbolic link: dpboard never follows links"):
        open_record(board)
    assert target.read_bytes() == _record_bytes(board)


def test_our_record_is_refused_to_another_user(board):
    need_root()
    record = open_record(board)  # held open: the last one out removes it
    try:
        kind, message = error_as_nobody(lambda: SentRecord.open(board.name, ROWS, SLOTS, generation=board.generation))
    finally:
        record.close()
    assert kind == "AccessDeniedError" and "belongs to uid 0 (root)" in message


def test_an_odd_seq_at_start_and_pid_1_in_every_row_neither_fail_nor_count(board):
    """A planted odd seq gave TornReadError at start; pid 1 in every row refused the start."""
    planted = _record_bytes(board, counts=1000, holder=pack_owner(1, process_start_ticks(1)), seq=7)
    _plant(record_path(board), planted, 0o600)
    record = open_record(board)
    try:
        assert record.totals().sum() == 0  # torn rows never seen whole: nothing from them
        writer = record.row(0)  # pid 1 holds no lock on it: taken, made consistent, counted from zero
        writer.add(2, 3)
        totals = record.totals()
        assert totals[2].tolist() == [1, 3] and totals[0].tolist() == [0, 0]
        assert record.holders()[0][0] == os.getpid()
    finally:
        record.close()


# -- 28.4: a sender killed or stopped in the middle of add ----------------------------------------


def test_a_sender_killed_mid_add_leaves_a_row_that_never_fails_and_is_taken_over(board):
    """A SIGKILL between the two seq increments left the row odd; the restarted row() kept the parity,
    so restarts failed with TornReadError and a running server failed a request at every refresh."""
    record = open_record(board)
    live = sender(board, row=0, slot=3, n=2)
    try:
        killed = sender(board, row=1, slot=1, n=5, then="tear-kill")
        killed.wait(30)
        assert killed.returncode == -signal.SIGKILL
        departed = np.zeros((SLOTS, 2), np.int64)
        for _ in range(50):  # every read answers, the torn row at its last whole value or not at all
            totals = record.totals(departed=departed)
            assert totals[3].tolist() == [2, 20]
        assert settled_totals(record)[1].tolist() == [0, 0]  # its holder is dead: it stops counting
        restarted = SentRecord.open(board.name, ROWS, SLOTS, generation=board.generation)
        try:
            writer = restarted.row(1)  # the dead holder's row: consistent again, from zero
            writer.add(1, 7)
            assert restarted.totals()[1].tolist() == [1, 7]
            assert settled_totals(record)[1].tolist() == [1, 7]
        finally:
            restarted.close()
    finally:
        kill(live)
        record.close()


def test_a_row_torn_by_a_stopped_sender_reads_as_its_last_whole_value(board):
    record = open_record(board)
    gated = sender(board, row=0, slot=1, n=6, then="tear-stop-gated")
    try:
        assert record.totals()[1].tolist() == [6, 60]  # read whole
        gated.stdin.write("\n")
        gated.stdin.flush()
        assert wait_until(lambda: stopped(gated), 10)  # its row is odd for good now
        late = open_record(board)  # a reader that never saw it whole
        try:
            for _ in range(20):
                assert record.totals()[1].tolist() == [6, 60]  # never the torn [7, 60], never an error
                assert late.totals()[1].tolist() == [0, 0]
            assert settled_totals(record)[1].tolist() == [6, 60]  # its holder lives: it still counts
            with pytest.raises(BoardError, match=rf"row 0 .* is held by live process {gated.pid}"):
                late.row(0)
        finally:
            late.close()
    finally:
        kill(gated)
        record.close()


# -- 28.9: pid and start time ---------------------------------------------------------------------


def test_a_holder_whose_pid_was_reused_does_not_count_nor_block(board):
    """The holder check used the pid alone: a killed server whose pid another process had taken
    could not restart ("held by live process")."""
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        reused = pack_owner(other.pid, process_start_ticks(other.pid) + 12345)  # that pid, another process
        _plant(record_path(board), _record_bytes(board, counts=100, holder=reused), 0o600)
        record = open_record(board)
        try:
            assert record.totals().sum() == 0
            record.row(1).add(0, 1)  # not refused
            assert record.totals()[0].tolist() == [1, 1]
        finally:
            record.close()
    finally:
        kill(other)


# -- 28.5: a full /dev/shm ------------------------------------------------------------------------

_FULL_SHM_SCRIPT = """
import json, os
from dpboard.board import Board
from dpboard.board.sent import SentRecord
from dpboard.errors import DpboardError
out = {}
board = Board.create("full", 4)
try:
    SentRecord.open("full", 4096, 60, generation=board.generation)
except DpboardError as e:
    out["error"] = [type(e).__name__, str(e)]
out["left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("dpboard-sent."))
record = SentRecord.open("full", 2, 4, generation=board.generation)
record.row(1).add(3, 9)
out["totals"] = record.totals().tolist()
print(json.dumps(out))
"""


def test_a_full_dev_shm_is_a_clear_error_and_leaves_no_record():
    """SentRecord.open on a full /dev/shm died with SIGBUS (exit 135) and left a record without a
    header; the next start failed after 5 s, "never initialised". Run in a private 1 MiB tmpfs on
    /dev/shm, in a mount namespace of its own."""
    run = run_in_private_shm(_FULL_SHM_SCRIPT, size="1m", label="dpboard-full")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    kind, message = out["error"]
    assert kind == "BoardError"
    assert message.startswith(f"no room for the sent record of board 'full' ({record_size(4096, 60)} bytes) in "
                              f"/dev/shm: /dev/shm is 1.0 MiB with")
    assert "\n" not in message
    assert out["left"] == []
    assert out["totals"][3] == [1, 9]


# -- 28.7 and 27.3: earlier deployments, other shapes ----------------------------------------------


def test_a_record_of_an_earlier_board_is_replaced_not_inherited(board_name):
    """A record left by a SIGKILLed deployment poisoned the next one: in-flight [1000, 1000, 1000, 0]."""
    old = Board.create(board_name, SLOTS)
    killed = sender(old, row=0, slot=0, n=1000, then="tear-kill")
    killed.wait(10)
    path = Path("/dev/shm", SENT_PREFIX + board_name)
    try:
        assert path.exists()
        old.close()
        old.unlink()
        with Board.create(board_name, SLOTS) as new:
            assert new.generation != old.generation
            record = SentRecord.open(board_name, ROWS, SLOTS, generation=new.generation)
            try:
                assert record.totals().sum() == 0
                assert int(np.frombuffer(path.read_bytes()[32:40], "<u8")[0]) == new.generation
            finally:
                record.close()
    finally:
        path.unlink(missing_ok=True)


def test_a_restart_with_another_server_count_works_and_a_live_other_count_is_refused(board):
    """A restart with another --api-server-count refused to start."""
    live = sender(board, row=1, slot=0, n=3)
    try:
        with pytest.raises(BoardLayoutError, match=rf"has 2 rows .* held by live process {live.pid}; this process "
                                                   r"needs 3 rows"):
            open_record(board, rows=3)
    finally:
        kill(live)
    record = open_record(board, rows=3)  # its holder is dead: replaced
    try:
        record.row(2).add(1, 4)
        assert record.totals()[1].tolist() == [1, 4] and record.totals()[0].tolist() == [0, 0]
    finally:
        record.close()


def test_a_dead_or_closed_senders_row_departs_once_with_its_last_counts(board):
    record = open_record(board)
    proc = sender(board, row=1, slot=2, n=7)
    try:
        departed = np.zeros((SLOTS, 2), np.int64)
        assert settled_totals(record, departed)[2].tolist() == [7, 70]
        assert departed.sum() == 0
        kill(proc)
        assert settled_totals(record, departed)[2].tolist() == [0, 0]
        # reported once, by the read that saw it go (settled_totals reads twice: the first one did)
        record.totals(departed=departed)
        assert departed.sum() == 0
        mine = SentRecord.open(board.name, ROWS, SLOTS, generation=board.generation)
        mine.row(0).add(3, 2)
        seen = record.totals(departed=departed)
        assert seen[3].tolist() == [1, 2]
        mine.close()  # gives the row up
        seen = record.totals(departed=departed)
        assert seen[3].tolist() == [0, 0] and departed[3].tolist() == [1, 2]
    finally:
        kill(proc)
        record.close()


def test_a_request_sent_while_the_record_closes_counts_nowhere_and_never_raises(board):
    record = open_record(board)
    writer = record.row(0)
    writer.add(1, 10)
    record.close()  # its rows' seqlock writers are released with the mapping
    writer.add(1, 10)  # a request on its way while the server shuts down
    again = open_record(board)
    try:
        assert again.totals()[1].tolist() == [0, 0]  # the row left with its holder
    finally:
        again.close()
