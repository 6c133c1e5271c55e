"""The dispatch record beside a board: real processes write it, readers in other processes read it
whole or call it torn, and a record that is not ours (another user's, the wrong size, a link, a
mode others may write) is refused with one line, by the library and by ``dpboard doctor``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpboard import Board
from dpboard.board.dispatch_record import (
    DISPATCH_HEADER_DTYPE,
    DISPATCH_MAGIC,
    DISPATCH_VERSION,
    DispatchRecord,
    dispatch_record_path,
    read_dispatch_record,
    record_size,
    row_size,
)
from dpboard.errors import AccessDeniedError, DpboardError
from tests.support.names import ROOT
from tests.support.other_user import as_nobody, need_root
from tests.support.procutil import kill, read_line, wait_for

SLOTS = 3
PLANTED: set[Path] = set()  # files a test planted on purpose: removed after it, not a leak


@pytest.fixture(autouse=True)
def no_leaked_record(board_name):
    yield
    path = Path(dispatch_record_path(board_name))
    leaked = path.exists() and path not in PLANTED
    path.unlink(missing_ok=True)
    assert not leaked, f"{path} was left behind"


def _writer(board: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.board.test_dispatch_record", board, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert read_line(proc, 30).startswith("ready")
    return proc


def test_a_row_written_in_one_process_reads_back_in_another(board_name):
    proc = _writer(board_name, "once")
    try:
        rows = read_dispatch_record(board_name)
        (row,) = rows
        assert (row.pid, row.alive, row.method, row.mode) == (proc.pid, True, "inflight_tokens", "decode")
        assert row.refresh_interval == 0.02 and not row.torn
        assert row.counts == {"refreshes": 7, "requests": 60, "routed": 6, "with_room": 5, "fallbacks": 2,
                              "rejected": 1}
        assert row.per_rank == [10, 20, 30] and row.routed_per_rank == [0, 6, 0]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert not Path(dispatch_record_path(board_name)).exists()  # its creator removed it at exit


def test_a_board_without_a_record_reads_none(board_name):
    assert read_dispatch_record(board_name) is None


def test_concurrent_reads_never_mix_two_publishes(board_name):
    """A writer process publishes counts that all derive from one counter; every read must agree."""
    proc = _writer(board_name, "spin")
    try:
        seen = set()
        for _ in range(3000):
            (row,) = read_dispatch_record(board_name)
            if row.torn:
                continue
            k = row.counts["requests"]
            assert row.counts == {"refreshes": k // 3, "requests": k, "routed": k // 2, "with_room": k // 5,
                                  "fallbacks": k // 7, "rejected": k // 11}, row
            assert row.per_rank == [k, 2 * k, 3 * k] and row.routed_per_rank == [k // 2, 0, 0]
            seen.add(k)
        assert len(seen) > 10  # the writer did move while we read
    finally:
        kill(proc)
        Path(dispatch_record_path(board_name)).unlink(missing_ok=True)


def test_a_writer_stopped_mid_publish_reads_torn(board_name):
    proc = _writer(board_name, "torn")
    try:
        (row,) = read_dispatch_record(board_name)
        assert row.torn and row.pid == proc.pid and row.method == "round_robin"
    finally:
        kill(proc)
        Path(dispatch_record_path(board_name)).unlink(missing_ok=True)


def test_a_holder_whose_pid_was_reused_neither_counts_as_alive_nor_blocks_its_row(board_name):
    """A row holds its dispatcher's pid and start time, as a board's slot does: a dead dispatcher whose
    pid now belongs to another process (here pid 1, which runs, but started at another time) is gone."""
    from dpboard.board.dispatch_record import DISPATCH_HEADER_SIZE
    from dpboard.board.liveness import process_start_ticks
    from dpboard.snapshot import pack_owner

    proc = _writer(board_name, "once")
    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        kill(proc)  # its row's lock dies with it; the holder word stays
        with open(dispatch_record_path(board_name), "r+b") as f:  # the row's holder word, at byte 8 of the row
            f.seek(DISPATCH_HEADER_SIZE + 8)
            f.write(pack_owner(1, process_start_ticks(1) + 12345).to_bytes(8, "little"))
        (read,) = read_dispatch_record(board_name)
        assert (read.pid, read.alive) == (1, False)
        record.row(0, method="total_tokens")  # taken over, not "held by live process 1"
        (read,) = read_dispatch_record(board_name)
        assert (read.pid, read.alive, read.method) == (os.getpid(), True, "total_tokens")
    finally:
        record.close()


def test_a_row_of_a_live_process_is_refused_and_a_dead_ones_taken_over(board_name):
    proc = _writer(board_name, "once")
    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        assert not record.is_owner
        with pytest.raises(DpboardError, match=f"held by live process {proc.pid}"):
            record.row(0, method="round_robin")
        kill(proc)  # SIGKILL: the row keeps its dead pid
        row = record.row(0, method="round_robin")
        (read,) = read_dispatch_record(board_name)
        assert read.pid == os.getpid() and read.counts["requests"] == 0
        row.publish(1, 2, 0, 0, 0, 0, [1, 1, 0])
        assert read_dispatch_record(board_name)[0].per_rank == [1, 1, 0]
    finally:
        record.close()
        Path(dispatch_record_path(board_name)).unlink(missing_ok=True)


def test_an_inflight_wave_holds_counters_read_back_from_its_row(board_name):
    """Version 2 carries an inflight_wave hold's counters in each row (``dpboard top`` and ``/metrics``
    show them); a row whose dispatcher holds nothing says so."""
    from dpboard.board.dispatch_record import WaveCounts, read_wave_rows

    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        row = record.row(0, method="inflight_wave")
        row.publish(1, 0, 0, 0, 0, 0, [0, 0, 0])
        (read,) = read_dispatch_record(board_name)
        assert read.wave is None and read_wave_rows(board_name) == []
        wave = WaveCounts(held=7, holding=2, waves=2, hold_sum_s=3.25, hold_max_s=1.5, max_hold_s=2.0, held_bytes=300,
                          held_bytes_max=900, released=(3, 0, 1, 1, 0, 0))
        row.publish(2, 5, 0, 0, 0, 0, [2, 3, 0], wave=wave)
        (read,) = read_dispatch_record(board_name)
        assert read.wave == wave and read.counts["requests"] == 5 and read.per_rank == [2, 3, 0]
        assert [r.wave for r in read_wave_rows(board_name)] == [wave]
        assert read.as_dict()["wave"]["released"] == {"full": 3, "bytes": 0, "busy": 1, "bound": 1, "shutdown": 0,
                                                     "order": 0}
    finally:
        record.close()


def test_a_version_1_record_of_an_earlier_dpboard_still_reads_and_is_replaced_once_unheld(board_name):
    """A dispatcher of an earlier dpboard writes version 1 (a 128-byte row head, no wave's counters):
    doctor, top and /metrics read it still; a dispatcher of this version replaces it once nobody has it
    open, as a side record of another version."""
    from dpboard.board.dispatch_record import ROW_HEAD_V1, ROW_HEAD_V1_SIZE, read_wave_rows, row_size_v1
    from dpboard.board.liveness import process_start_ticks
    from dpboard.snapshot import pack_owner

    path = Path(dispatch_record_path(board_name))
    header = bytearray(DISPATCH_HEADER_DTYPE.itemsize)
    view = np.ndarray((), DISPATCH_HEADER_DTYPE, header)
    view["magic"], view["version"], view["rows"], view["slots"] = DISPATCH_MAGIC, 1, 1, SLOTS
    view["row_size"], view["creator_pid"] = row_size_v1(SLOTS), 1
    row = bytearray(row_size_v1(SLOTS))
    head = np.ndarray((), ROW_HEAD_V1.dtype, row)
    head["seq"], head["holder"] = 2, pack_owner(os.getpid(), process_start_ticks(os.getpid()))
    head["method"], head["mode"], head["requests"], head["rejected"] = b"round_robin", b"null", 9, 1
    np.ndarray((SLOTS, 2), "<i8", row, ROW_HEAD_V1_SIZE)[:, 0] = [4, 5, 0]
    PLANTED.add(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, bytes(header) + bytes(row))
    os.close(fd)
    assert row_size_v1(SLOTS) < row_size(SLOTS) and path.stat().st_size == 64 + row_size_v1(SLOTS)

    (read,) = read_dispatch_record(board_name)
    assert (read.method, read.alive, read.torn, read.wave) == ("round_robin", True, False, None)
    assert read.counts == {"refreshes": 0, "requests": 9, "routed": 0, "with_room": 0, "fallbacks": 0, "rejected": 1}
    assert read.per_rank == [4, 5, 0] and read_wave_rows(board_name) == []
    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        assert record.is_owner and path.stat().st_size == record_size(1, SLOTS)
    finally:
        record.close()


def test_a_record_of_another_shape_is_refused_naming_both(board_name):
    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        with pytest.raises(DpboardError, match=r"has 1 rows \(dispatchers\) and 3 slots, held by a live process; "
                                               r"this process needs 2 rows \(dispatchers\) and 3 slots"):
            DispatchRecord.open(board_name, 2, SLOTS)
    finally:
        record.close()
        record.unlink()


def _plant(board: str, *, rows: int = 1, slots: int = SLOTS, size: int | None = None, mode: int = 0o600) -> Path:
    path = Path(dispatch_record_path(board))
    header = bytearray(DISPATCH_HEADER_DTYPE.itemsize)
    view = np.ndarray((), DISPATCH_HEADER_DTYPE, header)
    view["magic"], view["version"], view["rows"], view["slots"] = DISPATCH_MAGIC, DISPATCH_VERSION, rows, slots
    view["row_size"], view["creator_pid"] = row_size(slots), 1
    data = bytes(header).ljust(record_size(rows, slots) if size is None else size, b"\0")
    PLANTED.add(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, data)
    os.fchmod(fd, mode)
    os.close(fd)
    return path


@pytest.mark.parametrize("size", [record_size(1, SLOTS) + 64, 40])
def test_a_record_of_the_wrong_size_is_refused_with_one_line(board_name, size):
    _plant(board_name, size=size)
    with pytest.raises(DpboardError, match="dispatch record .* remove it"):
        read_dispatch_record(board_name, timeout=0.05)
    assert _doctor_finding(board_name)["evidence"].startswith(f"dispatch record {dispatch_record_path(board_name)}")


def _doctor_finding(board: str) -> dict:
    """The finding `dpboard doctor --json` makes of the refused record (it reports, never exits 2)."""
    import json

    with Board.create(board, SLOTS):
        res = subprocess.run([sys.executable, "-m", "dpboard.cli", "doctor", board, "--window", "0.2", "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    # stderr holds doctor's progress over its window, nothing else: no error, no traceback
    assert res.returncode == 1 and all(line.startswith("dpboard doctor: watching board")
                                       for line in res.stderr.splitlines()), res.stderr
    (found,) = [f for f in json.loads(res.stdout)["findings"] if f["id"] == "record_refused"]
    return found


def test_a_record_others_may_write_is_refused(board_name):
    _plant(board_name, mode=0o666)
    with pytest.raises(AccessDeniedError, match="mode 0o666"):
        read_dispatch_record(board_name)
    with pytest.raises(AccessDeniedError, match="mode 0o666"):
        DispatchRecord.open(board_name, 1, SLOTS)


def test_a_symbolic_link_is_never_followed(board_name, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * record_size(1, SLOTS))
    os.symlink(target, dispatch_record_path(board_name))
    PLANTED.add(Path(dispatch_record_path(board_name)))
    with pytest.raises(AccessDeniedError, match="symbolic link"):
        read_dispatch_record(board_name)


def test_a_record_planted_by_another_user_is_refused(board_name):
    need_root()
    path = Path(dispatch_record_path(board_name))

    def plant() -> None:
        _plant(board_name, mode=0o644)  # readable by everyone, written by nobody but its owner

    PLANTED.add(path)
    as_nobody(plant)
    assert path.stat().st_uid == 65534
    with pytest.raises(AccessDeniedError, match="belongs to uid 65534"):
        read_dispatch_record(board_name)
    with pytest.raises(AccessDeniedError, match="belongs to uid 65534"):
        DispatchRecord.open(board_name, 1, SLOTS)  # a dispatcher never writes into it either
    assert read_dispatch_record(board_name, trust_uids=(65534,)) == []  # trusted: read (no row claimed)
    assert "belongs to uid 65534" in _doctor_finding(board_name)["evidence"]


# -- the writer processes -----------------------------------------------------------------------------


def _main(board: str, role: str, rows: int = 1, index: int = 0, gate: str = "") -> None:
    import time

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if role == "slow":
        # a creator descheduled for longer than an attacher waits for a header (a loaded machine):
        # held up right after it has a file, before it writes the header
        from dpboard.board import side_record

        reserve = side_record.reserve_pages

        def held_up(*args, **kwargs):
            print("creating", flush=True)
            time.sleep(side_record.HEADER_WAIT + 1)
            return reserve(*args, **kwargs)

        side_record.reserve_pages = held_up
        role = "race"
    record = DispatchRecord.open(board, rows, SLOTS)
    if role == "race":  # once the gate file appears, every racer claims every row, in the same order
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            pass
        granted = []
        for i in range(rows):
            try:
                record.row(i, method="round_robin")
                granted.append(str(i))
            except DpboardError:
                pass
        print(" ".join(granted) or "-", flush=True)
        time.sleep(60)
    elif role == "hold":  # row `index` of a record of `rows` rows, published once
        record.row(index, method="round_robin").publish(1, 3, 0, 0, 0, 0, [1, 1, 1])
        print("ready", flush=True)
        time.sleep(60)
    elif role == "once":
        row = record.row(0, method="inflight_tokens", mode="decode", refresh_interval=0.02)
        row.publish(7, 60, 6, 5, 2, 1, [10, 20, 30], [0, 6, 0])
        print("ready", flush=True)
        time.sleep(60)
    elif role == "spin":
        row = record.row(0, method="inflight_tokens")
        k = 0
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            k += 1
            row.publish(k // 3, k, k // 2, k // 5, k // 7, k // 11, [k, 2 * k, 3 * k], [k // 2, 0, 0])
    elif role == "torn":
        row = record.row(0, method="round_robin")
        row._begin()  # the sequence odd, as a writer killed in the middle of a publish leaves it
        print("ready", flush=True)
        time.sleep(60)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:5]), *sys.argv[5:])


def test_a_controller_over_a_planted_record_serves_without_one(board_name, tmp_path):
    """A record the controller may not use (here: others may write it) never keeps it from serving:
    it says why once, and dispatches; the doctor reports the refused file as a finding."""
    from dpboard.controller.codec import encode_request
    from tests.views.test_doctor import controller

    path = _plant(board_name, mode=0o666)
    with controller(board_name, tmp_path, 2, "--method", "round_robin") as (push, ctl):
        for i in range(4):
            push.send(encode_request(f"r{i}", num_tokens=5))
        board = Board.attach(board_name)
        reader = board.reader()
        wait_for(lambda: sum(s.num_received_reqs for s in reader.read_all() if s) >= 4, 20,
                 "the controller to dispatch")
        board.close()
        res = subprocess.run([sys.executable, "-m", "dpboard.cli", "doctor", board_name, "--window", "0.2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert res.returncode == 1 and "[warning] the dispatch record is refused" in res.stdout
        assert "mode 0o666" in res.stdout
    assert "no dispatch record for dpboard doctor" in ctl.stderr.read()
    assert path.stat().st_mode & 0o777 == 0o666  # left as it was: not ours to change


def test_a_boards_unlink_takes_its_abandoned_record_and_leaves_a_live_ones(board_name):
    path = Path(dispatch_record_path(board_name))
    board = Board.create(board_name, SLOTS)
    live = _writer(board_name, "once")
    try:
        board.unlink()  # a dispatcher of it still runs: its record stays
        assert path.exists()
        board.close()
        board = Board.create(board_name, SLOTS)
        kill(live)  # SIGKILL: the record is left with a dead creator and a dead row holder
        assert path.exists()
        board.unlink()
        assert not path.exists()
    finally:
        kill(live)
        board.close()
        board.unlink()


def test_clean_removes_the_record_of_the_board_it_removes(board_name):
    path = Path(dispatch_record_path(board_name))
    board = Board.create(board_name, SLOTS)
    try:
        kill(_writer(board_name, "once"))
        assert path.exists()
        res = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean", board_name, "--force"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert not path.exists()
    finally:
        board.close()
        board.unlink()


def test_a_record_of_another_user_is_never_removed_as_abandoned(board_name):
    need_root()
    from dpboard.board.dispatch_record import remove_abandoned_records

    path = Path(dispatch_record_path(board_name))
    PLANTED.add(path)
    as_nobody(lambda: _plant(board_name, mode=0o644) and None)
    assert remove_abandoned_records(board_name) == [] and path.exists()


_FULL_SHM = """
import json, os
from dpboard.board.dispatch_record import DispatchRecord
from dpboard.errors import DpboardError
out = {}
try:
    DispatchRecord.open("full", 4096, 60)
except DpboardError as e:
    out["error"] = [type(e).__name__, str(e)]
out["left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("dpboard-dispatch."))
small = DispatchRecord.open("full", 2, 4)  # what fits is made as usual
out["small"] = os.path.getsize("/dev/shm/dpboard-dispatch.full")
print(json.dumps(out))
"""


def test_a_dispatch_record_on_a_full_dev_shm_is_a_clear_error_and_leaves_nothing():
    """The record's pages are reserved when it is made: on a full /dev/shm that is one line naming
    the record and the room left, never a SIGBUS at the first write. A private 1 MiB tmpfs on
    /dev/shm, in a mount namespace of its own."""
    import json

    from dpboard.board.dispatch_record import record_size
    from tests.support.private_shm import run_in_private_shm

    run = run_in_private_shm(_FULL_SHM, size="1m", label="dpboard-full")
    assert run.returncode == 0, run.stderr  # not killed by SIGBUS (status -7)
    out = json.loads(run.stdout)
    kind, message = out["error"]
    assert kind == "BoardError", message
    assert message.startswith(f"no room for the dispatch record of board 'full' ({record_size(4096, 60)} bytes) "
                              f"in /dev/shm: /dev/shm is 1.0 MiB with"), message
    assert out["left"] == []
    assert out["small"] == record_size(2, 4)


SPARSE = 2**50  # bytes: a sparse file, as `truncate -s 1P` makes it


def _plant_sparse(board: str) -> Path:
    """A record with a whole header whose file was then grown, sparse, to a petabyte."""
    path = _plant(board)
    os.truncate(path, SPARSE)
    return path


def test_a_sparse_oversized_record_is_refused_before_it_is_mapped(board_name):
    """Mapping 2**50 bytes fails with ENOMEM: the header's size is checked first. A reader refuses the
    record with one line; a dispatcher replaces a damaged record of its own user that nobody holds,
    and refuses a trusted user's with one line."""
    path = _plant_sparse(board_name)
    with pytest.raises(DpboardError, match=f"is {SPARSE} bytes, but 1 rows of {SLOTS} slots make"):
        read_dispatch_record(board_name)
    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        assert record.is_owner and path.stat().st_size == record_size(1, SLOTS)
    finally:
        record.close()


def test_a_trusted_users_sparse_record_is_refused_not_replaced(board_name):
    need_root()
    path = Path(dispatch_record_path(board_name))
    PLANTED.add(path)
    as_nobody(lambda: _plant_sparse(board_name) and None)
    with pytest.raises(DpboardError, match=f"is {SPARSE} bytes"):
        read_dispatch_record(board_name, trust_uids=(65534,))
    with pytest.raises(DpboardError, match=f"is {SPARSE} bytes, but 1 rows of {SLOTS} slots make .* belongs to "
                                           f"another user"):
        DispatchRecord.open(board_name, 1, SLOTS, trust_uids=(65534,))
    assert path.stat().st_size == SPARSE


def test_a_controller_over_a_sparse_record_dispatches_with_a_new_one(board_name, tmp_path):
    from dpboard.controller.codec import encode_request
    from tests.views.test_doctor import controller

    _plant_sparse(board_name)
    with controller(board_name, tmp_path, 2, "--method", "round_robin") as (push, ctl):
        for i in range(4):
            push.send(encode_request(f"r{i}", num_tokens=5))
        board = Board.attach(board_name)
        reader = board.reader()
        wait_for(lambda: sum(s.num_received_reqs for s in reader.read_all() if s) >= 4 or ctl.poll() is not None,
                 20, "the controller to dispatch")
        board.close()
        assert ctl.poll() is None, ctl.stderr.read()
        wait_for(lambda: (read_dispatch_record(board_name) or [None])[0] is not None, 20, "the controller's row")
        (row,) = read_dispatch_record(board_name)
        assert row.pid == ctl.pid and row.alive
    assert "Traceback" not in ctl.stderr.read()


# -- rows and their holders, as the sent record's (one side-record module for both) ---------------------


def test_of_eight_processes_racing_for_a_row_exactly_one_is_granted_it(board_name, tmp_path):
    """Eight processes started together claim each of 16 rows in the same order: each row goes to
    exactly one of them (its lock), and the record names that one."""
    gate = tmp_path / "go"
    rows = 16
    racers = [_writer(board_name, "race", str(rows), "0", str(gate)) for _ in range(8)]
    try:
        gate.touch()
        granted = {p.pid: [int(w) for w in read_line(p, 30).split() if w != "-"] for p in racers}
        per_row = sorted(i for got in granted.values() for i in got)
        assert per_row == list(range(rows)), granted  # no row granted twice, none left out
        holders = {r.row: r.pid for r in read_dispatch_record(board_name)}
        assert holders == {i: pid for pid, got in granted.items() for i in got}
    finally:
        for p in racers:
            kill(p)
    from dpboard.board.dispatch_record import remove_if_abandoned

    assert remove_if_abandoned(board_name)  # every holder killed: abandoned, and removed


def test_a_creator_held_up_before_its_header_keeps_its_file_and_no_row_is_granted_twice(board_name, tmp_path):
    """The first process to open the record is held up (longer than an attacher waits for a header)
    between making the file and writing its header; seven more open it meanwhile. However late the
    first one's header comes, every process ends up in one file: each row goes to exactly one."""
    gate = tmp_path / "go"
    rows = 4
    slow = subprocess.Popen([sys.executable, "-m", "tests.board.test_dispatch_record", board_name, "slow", str(rows),
                             "0", str(gate)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    racers = [slow]
    try:
        assert read_line(slow, 30).startswith("creating")
        racers += [_writer(board_name, "race", str(rows), "0", str(gate)) for _ in range(7)]
        assert read_line(slow, 30).startswith("ready")
        gate.touch()
        granted = {p.pid: [int(w) for w in read_line(p, 30).split() if w != "-"] for p in racers}
        per_row = sorted(i for got in granted.values() for i in got)
        assert per_row == list(range(rows)), granted  # no row granted twice, none left out
    finally:
        for p in racers:
            kill(p)
    from dpboard.board.dispatch_record import remove_if_abandoned

    assert remove_if_abandoned(board_name)


def _round_racer(board, barrier, results, rounds):
    """One of the processes racing, round after round, to open the record, claim its one row, and close
    it (the last one out removes it, the next round's first one makes it again)."""
    for k in range(rounds):
        barrier.wait(timeout=120)
        record = None
        try:
            record = DispatchRecord.open(board, 1, SLOTS)
            record.row(0, method="round_robin")
            results.put((k, os.getpid(), True))
        except DpboardError:
            results.put((k, os.getpid(), False))
        barrier.wait(timeout=120)  # every winner still holds its row while the others try
        if record is not None:
            record.close()


def test_eight_processes_opening_claiming_and_closing_round_after_round_never_share_a_row(board_name):
    """Eight processes open the record, claim its row and close it, all at once, 300 rounds: records
    are made, attached and removed under each other, and each round's row goes to one process."""
    import multiprocessing

    rounds, n = 300, 8
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_round_racer, args=(board_name, barrier, results, rounds)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=120) for _ in range(n * rounds)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    winners: dict[int, list[int]] = {}
    for k, pid, won in got:
        if won:
            winners.setdefault(k, []).append(pid)
    assert {k: w for k, w in winners.items() if len(w) != 1} == {}
    assert len(winners) == rounds  # and none went to nobody
    assert not os.path.exists(dispatch_record_path(board_name))  # the last one out of the last round removed it


def test_a_row_left_odd_by_a_killed_dispatcher_is_made_consistent_by_the_next(board_name):
    proc = _writer(board_name, "torn")  # SIGKILLed in the middle of a publish: its row's seq stays odd
    kill(proc)
    assert read_dispatch_record(board_name, timeout=0.05)[0].torn
    record = DispatchRecord.open(board_name, 1, SLOTS)
    try:
        row = record.row(0, method="total_tokens")
        for k in range(1, 4):
            row.publish(k, 10 * k, 0, 0, 0, 0, [k, k, 8 * k])
            (read,) = read_dispatch_record(board_name)
            assert not read.torn and read.counts["requests"] == 10 * k and read.per_rank == [k, k, 8 * k]
    finally:
        record.close()


def test_a_record_of_another_shape_that_nobody_holds_is_replaced(board_name):
    """A controller killed, then started again with another --workers count: the dead one's record
    (1 row of 3 slots) gives way to one of the new shape (1 row of 5)."""
    kill(_writer(board_name, "once"))
    record = DispatchRecord.open(board_name, 1, 5)
    try:
        record.row(0, method="round_robin").publish(1, 5, 0, 0, 0, 0, [1, 1, 1, 1, 1])
        (read,) = read_dispatch_record(board_name)
        assert (read.pid, read.alive, read.per_rank) == (os.getpid(), True, [1, 1, 1, 1, 1])
    finally:
        record.close()


def test_the_creator_leaving_never_removes_a_record_another_dispatcher_holds(board_name):
    """Two vLLM API servers, say: the first one out leaves the record to the second; the last out
    removes it."""
    creator = _writer(board_name, "hold", "2", "0")
    record = DispatchRecord.open(board_name, 2, SLOTS)
    try:
        assert not record.is_owner
        row = record.row(1, method="round_robin")
        creator.send_signal(signal.SIGTERM)  # a clean exit: its atexit hook runs
        assert creator.wait(10) == 0
        assert Path(dispatch_record_path(board_name)).exists()
        row.publish(2, 9, 0, 0, 0, 0, [3, 3, 3])
        (read,) = read_dispatch_record(board_name)  # the creator's row was given up at its exit
        assert (read.row, read.pid, read.per_rank) == (1, os.getpid(), [3, 3, 3])
    finally:
        kill(creator)
        record.close()
    assert not Path(dispatch_record_path(board_name)).exists()  # the last one out removed it
