"""The board: API round trips, layout checks, liveness, and the seqlock under real processes."""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpboard import SNAPSHOT_DTYPE, Board, BoardError, BoardLayoutError, LoadSnapshot, SlotStatus
from dpboard.errors import InvalidInputError
from dpboard.snapshot import (
    DETAILED_DTYPE,
    HEADER_SIZE,
    LAYOUT_VERSION,
    OWNER_OFFSET,
    SLOT_SIZE,
    DisaggregationDetail,
    LoadDetail,
    LoraDetail,
    MemoryDetail,
    QueueDetail,
    SpeculativeDetail,
    pack_owner,
    slot_offset,
    unpack_detail,
)
from tests.support.names import new_board_name
from tests.support.other_user import as_nobody, error_as_nobody, need_root
from tests.support.pid_namespace import pid_namespace_prefix
from tests.support.private_shm import run_in_private_shm
from tests.support.procutil import read_line
from tests.support.raw import plant_board, raw_segment
from tests.support.sweeps import sweeping

PROCS = str(Path(__file__).parents[1] / "support" / "board_procs.py")
MAX = 2**63 - 1


def start(role: str, *args: object, stdin: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, PROCS, role, *map(str, args)],
        stdout=subprocess.PIPE,
        stdin=stdin,
        text=True,
    )


def result(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def results(writers: list[subprocess.Popen], readers: list[subprocess.Popen]) -> tuple[list[dict], list[dict]]:
    """Every writer's and reader's result; none is left running, whatever fails."""
    try:
        return [result(p) for p in writers], [result(p) for p in readers]
    finally:
        for p in writers + readers:
            p.kill()
            p.wait(timeout=10)


def first_line(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


@pytest.fixture
def board(board_name):
    with Board.create(board_name, n_slots=8) as b:
        yield b


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 2**31, 2**62, MAX - 1, MAX])
def test_every_field_round_trips(board, value):
    w = board.writer(3, node_id=7)
    sent = LoadSnapshot(3, value, value, value, value, value, value, value)
    before_wall, before_mono = time.time_ns(), time.monotonic_ns()
    w.publish(sent)
    after_wall, after_mono = time.time_ns(), time.monotonic_ns()
    got = board.reader().read(3)
    assert got[:8] == sent[:8]
    assert before_wall <= got.timestamp_ns <= after_wall
    assert before_mono <= got.monotonic_ns <= after_mono
    assert got.publish_seq == 1
    assert got.writer_pid == os.getpid()
    assert got.node_id == 7


def test_read_all_read_array_and_status_agree(board):
    board.writer(1).publish(LoadSnapshot(1, num_running_reqs=4, num_used_tokens=300, max_total_num_tokens=1000))
    board.writer(6).publish_values(2, 3, 40, 50, 45, 100, 9)
    r = board.reader()
    snaps = r.read_all()
    assert [i for i, s in enumerate(snaps) if s is not None] == [1, 6]
    assert snaps[6][1:8] == (2, 3, 40, 50, 45, 100, 9)
    assert snaps[1].token_usage == pytest.approx(0.3)
    arr = r.read_array()
    assert arr.dtype == SNAPSHOT_DTYPE and len(arr) == 8
    assert list(arr["status"]) == [SlotStatus.LIVE if i in (1, 6) else SlotStatus.EMPTY for i in range(8)]
    assert list(arr["dp_rank"]) == list(range(8))  # empty slots still say whose they are
    for rank in (1, 6):
        assert tuple(int(arr[rank][f]) for f in LoadSnapshot._fields) == tuple(snaps[rank])
        assert r.status(rank) is SlotStatus.LIVE
        assert r.read_with_status(rank) == (SlotStatus.LIVE, snaps[rank])
    assert r.status(0) is SlotStatus.EMPTY
    assert r.read(0) is None
    assert r.read_with_status(0) == (SlotStatus.EMPTY, None)


def test_read_array_reuses_its_array_or_fills_out(board):
    r = board.reader()
    assert r.read_array() is r.read_array()
    out = np.zeros(8, SNAPSHOT_DTYPE)
    board.writer(2).publish(LoadSnapshot(2, num_waiting_reqs=5))
    assert r.read_array(out) is out
    assert out[2]["num_waiting_reqs"] == 5
    with pytest.raises(ValueError, match="at least 8 SNAPSHOT_DTYPE records"):
        r.read_array(np.zeros(4, SNAPSHOT_DTYPE))


def test_publish_seq_counts_and_continues_after_writer_restart(board):
    w = board.writer(0)
    for _ in range(5):
        w.publish(LoadSnapshot(0))
    del w
    w2 = board.writer(0)  # a restarted writer re-attaches to its slot
    w2.publish(LoadSnapshot(0, num_running_reqs=1))
    snap = board.reader().read(0)
    assert snap.publish_seq == 6 and snap.num_running_reqs == 1


# -- bad input ----------------------------------------------------------------------------------


def test_rank_out_of_range_is_a_clear_error(board):
    r = board.reader()
    for bad in (8, -1, 100):
        with pytest.raises(IndexError, match=r"rank .* out of range.* 8 slots \(ranks 0\.\.7\)"):
            board.writer(bad)
        with pytest.raises(IndexError, match=r"out of range: this board has 8 slots"):
            r.read(bad)
        with pytest.raises(IndexError, match="out of range"):
            r.status(bad)


def test_bad_snapshots_are_refused_and_nothing_is_written(board):
    w = board.writer(3)
    r = board.reader()
    with pytest.raises(ValueError, match="dp_rank is 2 but this writer owns slot 3"):
        w.publish(LoadSnapshot(2))
    with pytest.raises(ValueError, match="num_waiting_reqs must be >= 0, got -1"):
        w.publish(LoadSnapshot(3, num_waiting_reqs=-1))
    with pytest.raises(ValueError, match=r"num_used_tokens must be an integer in \[0, 2\*\*63\)"):
        w.publish(LoadSnapshot(3, num_used_tokens=2**63))
    with pytest.raises(ValueError, match="num_total_tokens must be an integer"):
        w.publish(LoadSnapshot(3, num_total_tokens="many"))
    with pytest.raises(TypeError, match="publish\\(\\) takes a LoadSnapshot, got dict"):
        w.publish({"dp_rank": 3})
    assert r.status(3) is SlotStatus.EMPTY


@pytest.mark.parametrize("name", ["", "a/b", "x" * 65, "bad name", "ünï"])
def test_bad_board_names_are_refused(name):
    with pytest.raises(ValueError, match="board name .* is invalid"):
        Board.create(name, n_slots=2)


def test_bad_slot_counts_are_refused(board_name):
    for n in (0, -1, 65537):
        with pytest.raises(ValueError, match="n_slots must be an integer in"):
            Board.create(board_name, n_slots=n)


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), 1e10, "1"])
def test_bad_stale_after_is_refused(board, value):
    # inf and 1e10 used to overflow the reader's int64 nanoseconds (an OverflowError traceback)
    with pytest.raises(ValueError, match=r"stale_after must be a number of seconds in \[1e-09, 1e\+06\]"):
        board.reader(stale_after=value)


# -- creating and attaching -----------------------------------------------------------------------


def test_create_twice_and_attach_missing(board):
    with pytest.raises(FileExistsError, match=f"board '{board.name}' already exists"):
        Board.create(board.name, n_slots=8)
    same = Board.create(board.name, n_slots=8, exist_ok=True)
    assert same.generation == board.generation and not same.is_owner
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Board.attach(new_board_name())


def test_attach_with_another_slot_count_names_both(board):
    with pytest.raises(BoardLayoutError, match="has 8 slots, but 16 were expected"):
        Board.attach(board.name, n_slots=16)
    with pytest.raises(BoardLayoutError, match="has 8 slots, but 4 were expected"):
        Board.create(board.name, n_slots=4, exist_ok=True)


def test_attach_with_another_layout_version_names_both(board):
    with raw_segment(board.name) as raw:
        raw[8:12] = (99).to_bytes(4, "little")
    with pytest.raises(BoardLayoutError, match=f"layout version 99, but this dpboard reads layout version {LAYOUT_VERSION}"):
        Board.attach(board.name)


def test_attach_a_segment_that_is_not_a_board(board_name):
    Path("/dev/shm", f"dpboard.{board_name}").write_bytes(b"garbage!" * 100)
    try:
        with pytest.raises(BoardLayoutError, match="has no dpboard header"):
            Board.attach(board_name, timeout=0.05)
    finally:
        Path("/dev/shm", f"dpboard.{board_name}").unlink()


def test_header_describes_the_board(board):
    h = Board.attach(board.name).header
    assert (h.name, h.n_slots, h.slot_size, h.header_size, h.layout_version) == (board.name, 8, SLOT_SIZE, HEADER_SIZE, LAYOUT_VERSION)
    assert h.creator_pid == os.getpid() and h.creator_alive
    assert Path("/dev/shm", f"dpboard.{board.name}").stat().st_size == HEADER_SIZE + 8 * SLOT_SIZE


def test_reader_and_writer_keep_the_mapping_alive(board):
    r = Board.attach(board.name).reader()  # the attached Board object is dropped at once
    w = Board.attach(board.name).writer(4)
    gc.collect()
    w.publish(LoadSnapshot(4, num_running_reqs=9))
    assert r.read(4).num_running_reqs == 9
    board.close()  # the creator's own mapping goes too; the others keep theirs
    w.publish(LoadSnapshot(4, num_running_reqs=10))
    assert r.read(4).num_running_reqs == 10
    with pytest.raises(ValueError, match="is closed"):
        board.reader()


def test_context_manager_unlinks_the_creators_board(board_name):
    with Board.create(board_name, n_slots=2) as b:
        assert Path("/dev/shm", f"dpboard.{board_name}").exists()
        with Board.attach(board_name):
            pass  # an attacher's exit does not unlink
        assert Path("/dev/shm", f"dpboard.{board_name}").exists()
        assert b.is_owner
    assert not Path("/dev/shm", f"dpboard.{board_name}").exists()


def test_unlink_does_not_remove_a_newer_board_of_the_same_name(board_name):
    old = Board.create(board_name, n_slots=2)
    old.unlink()
    with Board.create(board_name, n_slots=2) as new:
        old._unlinked = False
        old.unlink()  # the old handle must not remove the new incarnation
        assert Path("/dev/shm", f"dpboard.{board_name}").exists()
        assert Board.attach(board_name).generation == new.generation


def test_segment_is_0600(board):
    mode = stat.S_IMODE(Path("/dev/shm", f"dpboard.{board.name}").stat().st_mode)
    assert mode == 0o600


def test_another_user_cannot_open_the_board(board):
    kind, message = error_as_nobody(lambda: Board.attach(board.name))
    assert kind == "AccessDeniedError"
    assert "belongs to uid 0 (root) and is mode 0o600" in message and "uid 65534" in message, message


# -- one writer per slot --------------------------------------------------------------------------


def test_a_slot_held_by_a_live_writer_is_refused(board):
    proc = start("hold_writer", board.name, 5, stdin=subprocess.PIPE)
    try:
        holder = first_line(proc)["pid"]
        assert board.owner_pid(5) == holder
        with pytest.raises(BoardError, match=f"held by the writer in live process {holder}"):
            board.writer(5)
        board.writer(5, takeover=True).publish(LoadSnapshot(5, num_running_reqs=3))
        assert board.reader().read(5).num_running_reqs == 3
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


# -- liveness -------------------------------------------------------------------------------------


def test_a_slot_not_published_within_the_threshold_is_stale(board):
    w = board.writer(2)
    r = board.reader(stale_after=0.05)
    w.publish(LoadSnapshot(2, num_running_reqs=1))
    assert r.status(2) is SlotStatus.LIVE
    time.sleep(0.1)
    assert r.status(2) is SlotStatus.STALE
    assert r.read(2).num_running_reqs == 1  # a stale snapshot is still data
    assert r.read_array()["status"][2] == SlotStatus.STALE
    assert board.reader(stale_after=10).status(2) is SlotStatus.LIVE
    w.publish(LoadSnapshot(2, num_running_reqs=2))
    assert r.status(2) is SlotStatus.LIVE


def test_writer_killed_mid_write_reads_torn_and_a_new_writer_repairs_it(board):
    proc = start("paused_writer", board.name, 3)
    try:
        first_line(proc)
        r = board.reader(max_retries=64)
        deadline = time.monotonic() + 10
        while r.status(3) is not SlotStatus.TORN:  # the writer is inside its paused publish
            assert time.monotonic() < deadline, "the paused writer never made its slot odd"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    # Readers return (bounded retries) and say torn; other slots are unaffected.
    assert r.read(3) is None
    assert r.read_with_status(3) == (SlotStatus.TORN, None)
    arr = r.read_array()
    assert arr["status"][3] == SlotStatus.TORN and arr["dp_rank"][3] == 3
    assert r.read_all()[3] is None
    # The dead writer's slot is free for a new writer, whose first publish makes it whole.
    w = board.writer(3)
    assert w.sequence % 2 == 1
    w.publish(LoadSnapshot(3, num_running_reqs=42))
    assert w.sequence % 2 == 0
    assert r.read_with_status(3)[0] is SlotStatus.LIVE
    assert r.read(3).num_running_reqs == 42
    assert r.read(3).publish_seq == 2  # the killed write never got as far as storing its publish_seq


def test_no_torn_reads_under_concurrent_writers_and_readers(board):
    """4 writer processes and 2 reader processes for several seconds; every snapshot's fields check
    each other, so a single mixed read fails the test."""
    seconds = 3.0
    writers = [start("writer", board.name, rank, seconds) for rank in (0, 2, 5, 7)]
    readers = [start("reader", board.name, seconds) for _ in range(2)]
    w_results, r_results = results(writers, readers)
    total_reads = sum(r["reads"] for r in r_results)
    print(f"torn-read stress: {sum(w['publishes'] for w in w_results)} publishes, {total_reads} reads, "
          f"{sum(r['torn'] for r in r_results)} slots reported busy")
    assert all(w["publishes"] > 1000 for w in w_results)
    assert total_reads > 10_000
    assert [r["bad"] for r in r_results] == [0, 0], r_results
    assert [r["went_backwards"] for r in r_results] == [0, 0], r_results
    final = board.reader().read_all()
    for w in w_results:
        assert final[w["rank"]].publish_seq == w["publishes"]


def test_details_and_fields_come_from_one_write_under_concurrency(board):
    """Writers alternate detailed and plain publishes; readers check every detail against the fields
    it was read with (one slot at a time and all at once)."""
    seconds = 2.0
    writers = [start("detailed_writer", board.name, rank, seconds) for rank in (1, 4)]
    readers = [start("detailed_reader", board.name, seconds) for _ in range(2)]
    w_results, r_results = results(writers, readers)
    assert all(w["publishes"] > 200 for w in w_results)
    assert sum(r["reads"] for r in r_results) > 1000
    assert [r["bad"] for r in r_results] == [0, 0], r_results


# -- the detail: an engine's whole snapshot beside the dispatch fields ---------------------------


FULL_DETAIL = LoadDetail(
    timestamp=1764498000.123456, num_waiting_uncached_tokens=5, num_prealloc_ready_tokens=6,
    max_running_requests=1024, token_usage=0.3125, gen_throughput=1234.5, cache_hit_rate=0.75,
    utilization=0.5, total_prefill_uncached_tokens=2**40, total_prefill_busy_us=123456789,
    decode_moments=(10.0, 20.5, 30.25, 40.0, 50.0, 60.0),
    memory=MemoryDetail(15.5, 60.25, 2.5, 500000),
    speculative=SpeculativeDetail(3.5, 0.875),
    lora=LoraDetail(2, 8, 0.25),
    disaggregation=DisaggregationDetail("decode", 1, 2, 3, 4, 5, 12.5, 0.75),
    queues=QueueDetail(1, 2, 3, 4, 5),
)


def test_a_detail_round_trips_field_for_field(board):
    w = board.writer(3)
    snap = LoadSnapshot(dp_rank=3, num_running_reqs=4, num_total_tokens=100)
    w.publish_detailed(snap, FULL_DETAIL)
    r = board.reader()
    status, got, detail = r.read_detail(3)
    assert status is SlotStatus.LIVE and got.num_running_reqs == 4 and got.num_total_tokens == 100
    assert detail == FULL_DETAIL
    # every section may be absent, and an empty list of moments is not None
    sparse = LoadDetail(timestamp=2.0, decode_moments=())
    w.publish_detailed(snap, sparse)
    assert r.read_detail(3)[2] == sparse
    # the dispatch read is unchanged by a detail
    assert r.read(3) == r.read_detail(3)[1]._replace(monotonic_ns=r.read(3).monotonic_ns)


def test_a_plain_publish_clears_the_detail(board):
    w = board.writer(0)
    w.publish_detailed(LoadSnapshot(dp_rank=0), FULL_DETAIL)
    w.publish(LoadSnapshot(dp_rank=0, num_running_reqs=1))
    r = board.reader()
    assert r.read_detail(0)[2] is None
    w.publish_detailed(LoadSnapshot(dp_rank=0), FULL_DETAIL)
    w.publish_values(1, 0, 0, 0, 0, 10, 0)
    assert r.read_detail(0)[2] is None
    assert r.read_detail(5) == (SlotStatus.EMPTY, None, None)


def test_read_detailed_array_holds_fields_status_and_detail(board):
    board.writer(2).publish_detailed(LoadSnapshot(dp_rank=2, num_waiting_reqs=3), FULL_DETAIL)
    board.writer(6).publish(LoadSnapshot(dp_rank=6, num_waiting_reqs=1))
    out = np.zeros(board.n_slots, DETAILED_DTYPE)
    arr = board.reader().read_detailed_array(out)
    assert arr is out
    assert [SlotStatus(s) for s in arr["load"]["status"]] == [
        SlotStatus.EMPTY, SlotStatus.EMPTY, SlotStatus.LIVE, SlotStatus.EMPTY, SlotStatus.EMPTY, SlotStatus.EMPTY,
        SlotStatus.LIVE, SlotStatus.EMPTY]
    assert list(arr["load"]["dp_rank"]) == list(range(8))
    assert unpack_detail(arr["detail"][2]) == FULL_DETAIL and arr["load"]["num_waiting_reqs"][2] == 3
    assert unpack_detail(arr["detail"][6]) is None
    with pytest.raises(ValueError, match="at least 8 DETAILED_DTYPE records"):
        board.reader().read_detailed_array(np.zeros(2, DETAILED_DTYPE))


def test_a_detail_that_does_not_fit_is_refused(board):
    w = board.writer(1)
    with pytest.raises(ValueError, match="does not fit the slot's 8-byte text"):
        w.publish_detailed(LoadSnapshot(dp_rank=1), FULL_DETAIL._replace(
            disaggregation=DisaggregationDetail("prefill-and-decode")))
    with pytest.raises(ValueError, match="decode_moments has 9 values; a slot holds 8"):
        w.publish_detailed(LoadSnapshot(dp_rank=1), LoadDetail(decode_moments=(0.0,) * 9))
    with pytest.raises(ValueError, match="detail must be 352 bytes"):
        w.publish(LoadSnapshot(dp_rank=1), b"short")
    assert board.reader().read(1) is None  # nothing was published


# -- boards on this machine -----------------------------------------------------------------------


def test_clean_removes_boards_of_dead_creators_only(board):
    dead = new_board_name()
    result(start("create_and_vanish", dead, 4))
    path = Path("/dev/shm", f"dpboard.{dead}")
    try:
        assert path.exists()
        ls = subprocess.run([sys.executable, "-m", "dpboard.cli", "ls", "--json"], capture_output=True,
                            text=True, timeout=60, check=True)
        listed = {entry["name"]: entry for entry in json.loads(ls.stdout)}
        assert listed[dead]["creator_alive"] is False
        assert listed[board.name]["creator_alive"] is True
        refused = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean", board.name],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "is in use" in refused.stderr and "--force" in refused.stderr
        cleaned = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean", dead], capture_output=True,
                                 text=True, timeout=60, check=True)
        assert f"removed /dev/shm/dpboard.{dead}" in cleaned.stdout
        assert not path.exists()
        assert Path("/dev/shm", f"dpboard.{board.name}").exists()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("command", [["dump"], ["dump", "--json"], ["info"], ["ls"]])
def test_read_only_commands_print_the_board_without_importing_numba(board, command):
    board.writer(2).publish(LoadSnapshot(2, num_running_reqs=7, num_used_tokens=64, max_total_num_tokens=128))
    # --stale-after 60: the slot published once stays live however long a loaded machine takes
    args = [command[0], *([board.name] if command[0] != "ls" else []), *command[1:], "--stale-after", "60"]
    code = (
        "import sys; from dpboard.cli import main; "
        f"rc = main({args!r}); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'cupy', 'llvmlite', 'zmq')); "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    if command == ["dump"]:
        row = next(line for line in proc.stdout.splitlines() if line.split()[:2] == ["2", "live"])
        assert row.split()[2] == "7" and "50.0%" in row
        assert "1 live" in proc.stdout and "7 empty" in proc.stdout
    elif command == ["dump", "--json"]:
        slots = json.loads(proc.stdout[: proc.stdout.rindex("HEAVY")])["slots"]
        assert [s["status"] for s in slots].count("live") == 1
        assert slots[2]["num_running_reqs"] == 7 and slots[2]["token_usage"] == 0.5
    elif command == ["info"]:
        assert f"8 slots x {SLOT_SIZE} B" in proc.stdout and "1 live" in proc.stdout
    else:
        assert board.name in proc.stdout


def test_clean_leaves_a_headerless_segment_unless_named(board_name):
    path = Path("/dev/shm", f"dpboard.{board_name}")
    path.write_bytes(b"\x00" * 600)  # what a creator that died before writing its header leaves
    try:
        with sweeping():
            swept = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean"], capture_output=True, text=True,
                                   timeout=60, check=True)
        assert board_name not in swept.stdout and path.exists()
        named = subprocess.run([sys.executable, "-m", "dpboard.cli", "clean", board_name], capture_output=True,
                               text=True, timeout=60, check=True)
        assert f"removed /dev/shm/dpboard.{board_name}" in named.stdout
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_recycled_owner_pid_does_not_hold_the_slot(board):
    board.writer(6).publish(LoadSnapshot(6))  # the writer is dropped at once: this process holds no writer
    # Same pid as a live process (ours), but another start time: the holder is gone, the pid recycled.
    with raw_segment(board.name) as raw:
        struct.pack_into("<Q", raw, slot_offset(6) + OWNER_OFFSET, pack_owner(os.getppid(), 1))
    board.writer(6).publish(LoadSnapshot(6, num_running_reqs=1))  # not refused
    assert board.owner_pid(6) == os.getpid()
    assert board.reader().read(6).num_running_reqs == 1


def test_read_array_fills_the_array_given_as_out(board):
    board.writer(2).publish(LoadSnapshot(dp_rank=2, num_running_reqs=9))
    reader = board.reader()
    mine = np.zeros(board.n_slots, dtype=SNAPSHOT_DTYPE)
    assert reader.read_array(out=mine) is mine and reader.read_array(mine) is mine
    assert mine["num_running_reqs"][2] == 9 and SlotStatus(mine["status"][2]) is SlotStatus.LIVE
    assert reader.read_array() is not mine
    with pytest.raises(TypeError, match="at most one argument, out"):
        reader.read_array(into=mine)
    with pytest.raises(ValueError, match="at least 8 SNAPSHOT_DTYPE records"):
        reader.read_array(out=np.zeros(2, dtype=SNAPSHOT_DTYPE))


# -- who may be trusted: owner, mode, links (a hostile local user) ----------------------------------


def _make_segment_as_nobody(name: str, mode: int, n_slots: int = 2) -> None:
    """As uid 65534: a segment named like a board, with a whole header and the given mode, made with
    posix_ipc directly, as a hostile user would (dpboard itself refuses such a mode)."""
    from dpboard.board.header import BoardHeader, pack_header
    from dpboard.snapshot import segment_size

    def make() -> None:
        import mmap

        import posix_ipc

        shm = posix_ipc.SharedMemory(f"/dpboard.{name}", posix_ipc.O_CREX, mode=mode, size=segment_size(n_slots))
        os.fchmod(shm.fd, mode)
        with mmap.mmap(shm.fd, segment_size(n_slots)) as mm:
            pack_header(mm, BoardHeader(name, LAYOUT_VERSION, HEADER_SIZE, n_slots, SLOT_SIZE, os.getpid(), 1, 7, 0, 0))
        shm.close_fd()

    as_nobody(make)


def test_a_board_another_user_made_writable_is_not_adopted(board_name):
    """Root's create(exist_ok=True) used to adopt a mode-0666 segment of another user, whose writes it
    would then have trusted."""
    need_root()
    _make_segment_as_nobody(board_name, 0o666)
    try:
        with pytest.raises(PermissionError, match=r"belongs to uid 65534 \(nobody\) \(mode 0o666\)"):
            Board.create(board_name, n_slots=2, exist_ok=True)
        with pytest.raises(PermissionError, match=r"--trust-uid 65534"):
            Board.attach(board_name)
        # Trusting the user is not enough while others may write it.
        with pytest.raises(PermissionError, match=r"mode 0o666: other users may write it"):
            Board.attach(board_name, trust_uids=(65534,))
    finally:
        Path("/dev/shm", f"dpboard.{board_name}").unlink()


def test_a_board_of_a_trusted_user_is_attached_and_read_only_when_not_writable(board_name):
    need_root()
    _make_segment_as_nobody(board_name, 0o644)
    try:
        with pytest.raises(PermissionError, match="uid 65534"):
            Board.attach(board_name)
        b = Board.attach(board_name, trust_uids=[65534])
        assert b.n_slots == 2 and not b.read_only  # root may write anything it opens
        assert b.reader().read_all() == [None, None]
    finally:
        Path("/dev/shm", f"dpboard.{board_name}").unlink()
    # The other way round: another user reads root's 0644 board, read-only, once it trusts root.
    with Board.create(board_name, n_slots=2, mode=0o644) as mine:
        mine.writer(1).publish(LoadSnapshot(1, num_running_reqs=5))

        def read_as_nobody() -> list:
            with pytest.raises(PermissionError, match=r"belongs to uid 0 \(root\)"):
                Board.attach(board_name)
            b = Board.attach(board_name, trust_uids=(0,))
            with pytest.raises(PermissionError, match="open read-only"):
                b.writer(0)
            return [b.read_only, b.reader().read(1).num_running_reqs]

        assert as_nobody(read_as_nobody) == [True, 5]


def test_boards_others_could_write_are_neither_made_nor_attached(board_name):
    for mode in (0o666, 0o660, 0o602, 0o400, 0o1600):
        with pytest.raises(ValueError, match="mode must give the owner read and write and nobody else write"):
            Board.create(board_name, n_slots=2, mode=mode)
    assert not Path("/dev/shm", f"dpboard.{board_name}").exists()
    with Board.create(board_name, n_slots=2):
        os.chmod(f"/dev/shm/dpboard.{board_name}", 0o620)  # made group-writable behind the creator's back
        with pytest.raises(PermissionError, match="mode 0o620: other users may write it"):
            Board.attach(board_name)


def test_a_board_name_that_is_a_symbolic_link_is_refused(board_name, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"\x00" * 4096)
    link = Path("/dev/shm", f"dpboard.{board_name}")
    link.symlink_to(victim)
    try:
        with pytest.raises(PermissionError, match="is a symbolic link, not a board"):
            Board.attach(board_name)
        with pytest.raises(PermissionError, match="is a symbolic link"):
            Board.create(board_name, n_slots=2, exist_ok=True)
    finally:
        link.unlink()
    assert victim.read_bytes() == b"\x00" * 4096


@pytest.mark.parametrize("name", ["rel\n", "rel\r", "\nrel", "rel\n\n", "rel "])
def test_a_name_with_a_line_break_is_refused_whole(name):
    """The name check once ended in `$`, which also matches before a final newline: `rel\\n` made
    /dev/shm/dpboard.rel\\n and broke `dpboard ls`."""
    with pytest.raises(ValueError, match="board name .* is invalid"):
        Board.create(name, n_slots=1)
    assert not Path("/dev/shm", f"dpboard.{name}").exists()


def test_ls_prints_a_leftover_name_with_a_line_break_on_one_line(board_name):
    leftover = Path("/dev/shm", f"dpboard.{board_name}\n")  # what such a create used to leave
    leftover.write_bytes(b"")
    try:
        out = _dpboard("ls")
        assert out.returncode == 0
        assert f"'{board_name}\\n'" in out.stdout  # shown escaped, on its own line
        assert not any(line.strip() == "" for line in out.stdout.splitlines())
    finally:
        leftover.unlink()


# -- attaching while the board is being created --------------------------------------------------


def test_attach_waits_for_a_board_whose_creator_has_not_sized_it_yet(board_name):
    """A creator makes the segment (0 bytes), then sizes it, then writes the header: an attacher in
    between used to fail at once ("is 0 bytes ... dpboard clean --force"); it must wait, bounded."""
    from dpboard.board.header import BoardHeader, pack_header
    from dpboard.snapshot import MAGIC, segment_size

    path = Path("/dev/shm", f"dpboard.{board_name}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # what shm_open(O_CREAT) leaves first
    proc = start("attach_wait", board_name, 10)
    try:
        assert first_line(proc)["started"]
        time.sleep(0.3)  # the attacher is inside attach, looking at a 0-byte segment
        assert proc.poll() is None, proc.communicate()
        os.ftruncate(fd, segment_size(3))
        with open(path, "r+b") as f:
            import mmap

            with mmap.mmap(f.fileno(), segment_size(3)) as mm:
                pack_header(mm, BoardHeader(board_name, LAYOUT_VERSION, HEADER_SIZE, 3, SLOT_SIZE, os.getpid(),
                                            1, 5, 0, 0), magic=b"\x00" * 8)
                time.sleep(0.1)
                mm[0:8] = MAGIC
        assert result(proc) == {"role": "attach_wait", "error": None, "n_slots": 3}
    finally:
        os.close(fd)
        proc.kill()
        proc.wait(timeout=10)
        path.unlink(missing_ok=True)


def test_attach_gives_up_on_a_segment_that_stays_empty(board_name):
    path = Path("/dev/shm", f"dpboard.{board_name}")
    path.write_bytes(b"")
    try:
        started = time.monotonic()
        with pytest.raises(BoardLayoutError, match=r"is 0 bytes, smaller than a board header, after 0.2 s"):
            Board.attach(board_name, timeout=0.2)
        assert time.monotonic() - started < 5
    finally:
        path.unlink()


def _create_race_worker(names, barrier, results, rank):
    import contextlib

    for name in names:
        barrier.wait(timeout=30)
        try:
            b = Board.create(name, n_slots=4, exist_ok=True)
            results.put((name, rank, "owner" if b.is_owner else "attached", ""))
        except Exception as e:
            results.put((name, rank, "error", f"{type(e).__name__}: {e}"))
        barrier.wait(timeout=30)  # nobody unlinks before every process has its board
        with contextlib.suppress(Exception):
            if b.is_owner:
                b.unlink()
        b = None


def test_processes_racing_to_create_one_board_all_get_it():
    """Four processes race Board.create(name, exist_ok=True), round after round: exactly one creates
    it, the others attach it, none fails."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    names = [new_board_name() for _ in range(30)]
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [ctx.Process(target=_create_race_worker, args=(names, barrier, results, k)) for k in range(4)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=60) for _ in range(4 * len(names))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [g for g in got if g[2] == "error"]
    assert not errors, errors[:3]
    for name in names:
        roles = sorted(g[2] for g in got if g[0] == name)
        assert roles == ["attached", "attached", "attached", "owner"], (name, roles)
        assert not Path("/dev/shm", f"dpboard.{name}").exists()


# -- one writer per slot, under a race and inside one process --------------------------------------


def _claim_race_worker(name, barrier, results, rank, rounds):
    board = Board.attach(name)
    for k in range(rounds):
        barrier.wait(timeout=30)
        try:
            w = board.writer(k % board.n_slots)
            w.publish(LoadSnapshot(k % board.n_slots, num_running_reqs=rank))
            results.put((k, rank, True))
        except BoardError:
            w = None
            results.put((k, rank, False))
        barrier.wait(timeout=30)  # the winner holds its writer (and lives) until both have tried


def test_two_processes_claiming_one_slot_at_once_never_both_win(board_name):
    import multiprocessing

    rounds = 400  # each round a fresh slot
    ctx = multiprocessing.get_context("fork")
    with Board.create(board_name, n_slots=rounds) as board:
        barrier = ctx.Barrier(2)
        results = ctx.Queue()
        procs = [ctx.Process(target=_claim_race_worker, args=(board_name, barrier, results, r, rounds))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = [results.get(timeout=60) for _ in range(2 * rounds)]
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        winners = {k: [rank for kk, rank, won in got if kk == k and won] for k in range(rounds)}
        assert all(len(w) == 1 for w in winners.values()), {k: w for k, w in winners.items() if len(w) != 1}
        r = board.reader()
        assert all(r.read(k).num_running_reqs == winners[k][0] for k in range(rounds))


def test_a_second_writer_in_the_same_process_is_refused_until_the_first_is_closed(board):
    w1 = board.writer(2)
    for k in range(3):
        w1.publish(LoadSnapshot(2, num_running_reqs=k))
    with pytest.raises(BoardError, match="already has an open writer in this process"):
        board.writer(2)
    with pytest.raises(BoardError, match="already has an open writer in this process"):
        Board.attach(board.name).writer(2)  # another Board object of the same board: same slot
    w1.close()
    with pytest.raises(ValueError, match="writer of slot 2 is closed"):
        w1.publish(LoadSnapshot(2))
    assert board.owner(2) == (0, 0)  # close() frees the slot for any process
    w2 = board.writer(2)
    w2.publish(LoadSnapshot(2, num_running_reqs=9))
    snap = board.reader().read(2)
    assert (snap.num_running_reqs, snap.publish_seq) == (9, 4)  # the sequence went on, never back
    del w2
    gc.collect()
    with board.writer(2) as w3:  # a dropped writer frees the slot too; a writer is a context manager
        w3.publish(LoadSnapshot(2))
    assert board.reader().read(2).publish_seq == 5


def test_takeover_in_the_same_process_closes_the_old_writer(board):
    old = board.writer(4)
    old.publish(LoadSnapshot(4, num_running_reqs=1))
    old.publish(LoadSnapshot(4, num_running_reqs=2))
    new = board.writer(4, takeover=True)
    new.publish(LoadSnapshot(4, num_running_reqs=3))
    seq_after_takeover = new.sequence
    with pytest.raises(ValueError, match="is closed"):
        old.publish(LoadSnapshot(4, num_running_reqs=99))  # used to move the sequence backwards (6 -> 2)
    assert new.sequence == seq_after_takeover
    snap = board.reader().read(4)
    assert (snap.num_running_reqs, snap.publish_seq) == (3, 3)


def test_a_closed_writer_frees_the_slot_for_another_process(board):
    w = board.writer(5)
    w.publish(LoadSnapshot(5))
    w.close()
    proc = start("hold_writer", board.name, 5, stdin=subprocess.PIPE)
    try:
        holder = first_line(proc)["pid"]  # not refused, though this process is alive
        assert board.owner_pid(5) == holder
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


# -- ls and clean: liveness that does not rest on a pid, and bad boards beside good ones -----------


def _dpboard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], capture_output=True, text=True, timeout=60)


def _sweep(*options: str) -> subprocess.CompletedProcess:
    """``dpboard clean`` of every board: never while another test file keeps a dead board on purpose."""
    with sweeping():
        return _dpboard("clean", *options)


def test_one_bad_board_never_hides_the_others(board, tmp_path):
    """A corrupt header with a pid >= 2**31 crashed ls, info and clean (OverflowError from os.kill), and
    then ls failed for every board. Damaged, hostile and foreign entries are listed with what is wrong."""
    victim = tmp_path / "victim"
    victim.write_text("not a board\n")
    huge_pid, huge_slots, truncated, link, folder = (new_board_name() for _ in range(5))
    made = []
    try:
        for name, n in ((huge_pid, 2), (huge_slots, 2)):
            result(start("create_and_vanish", name, n))
            made.append(name)
        with raw_segment(huge_pid) as raw:
            struct.pack_into("<q", raw, 24, 2**40)  # creator_pid
            struct.pack_into("<Q", raw, 128, 2**40)  # collector_pid
        with raw_segment(huge_slots) as raw:
            struct.pack_into("<I", raw, 16, 2**31)  # n_slots, far beyond the segment
        Path("/dev/shm", f"dpboard.{truncated}").write_bytes(b"DPBOARD\x00" + b"\x01" * 40)
        Path("/dev/shm", f"dpboard.{link}").symlink_to(victim)
        Path("/dev/shm", f"dpboard.{folder}").mkdir()
        made += [truncated, link, folder]

        ls = _dpboard("ls", "--json")
        assert ls.returncode == 0, ls.stderr
        listed = {entry["name"]: entry for entry in json.loads(ls.stdout)}
        assert listed[board.name]["alive"] is True and listed[board.name]["error"] is None
        assert listed[huge_pid]["creator_pid"] == 2**40 and listed[huge_pid]["alive"] is False
        assert listed[huge_slots]["n_slots"] == 2**31 and listed[huge_slots]["alive"] is False
        assert "claims 2147483648 slots" in listed[huge_slots]["error"]
        assert listed[truncated]["error"] == "no dpboard header"
        assert "symbolic link" in listed[link]["error"]
        assert listed[folder]["error"] == "not a regular file"
        text = _dpboard("ls")
        assert text.returncode == 0 and board.name in text.stdout and huge_pid in text.stdout
        info = _dpboard("info", huge_pid)
        assert info.returncode == 0 and "pid 1099511627776 (dead)" in info.stdout, info.stderr
        assert "collector    pid 1099511627776 (dead)" in info.stdout
        info = _dpboard("info", huge_slots)
        assert info.returncode == 2 and "claims 2147483648 slots, outside 1..65536" in info.stderr
        clean = _sweep()
        assert clean.returncode == 0, clean.stderr
        assert f"removed /dev/shm/dpboard.{huge_pid}" in clean.stdout
        assert f"removed /dev/shm/dpboard.{huge_slots}" in clean.stdout
        assert Path("/dev/shm", f"dpboard.{board.name}").exists()  # alive: kept
        assert Path("/dev/shm", f"dpboard.{link}").is_symlink()  # not a board, not named: kept
        assert victim.read_text() == "not a board\n"
        named = _dpboard("clean", link)  # named: the link itself goes, never what it points to
        assert named.returncode == 0 and not Path("/dev/shm", f"dpboard.{link}").exists()
        assert victim.read_text() == "not a board\n"
    finally:
        for name in made:
            p = Path("/dev/shm", f"dpboard.{name}")
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink(missing_ok=True)


def test_a_board_published_within_stale_after_is_alive_whatever_its_creator_pid(board_name):
    """Its creator is dead (or, in another PID namespace, only looks dead): while a slot is fresh the
    board is alive, and clean without --force leaves it."""
    result(start("create_and_vanish", board_name, 2))
    path = Path("/dev/shm", f"dpboard.{board_name}")
    try:
        w = Board.attach(board_name).writer(1)
        w.publish(LoadSnapshot(1))
        listed = {e["name"]: e for e in json.loads(_dpboard("ls", "--json", "--stale-after", "30").stdout)}
        assert listed[board_name]["creator_alive"] is False and listed[board_name]["alive"] is True
        assert 0 <= listed[board_name]["last_publish_age_s"] < 30
        assert _sweep("--stale-after", "30").returncode == 0 and path.exists()
        refused = _dpboard("clean", board_name, "--stale-after", "30")
        assert refused.returncode == 2 and "is in use: a slot was published" in refused.stderr
        assert "whatever its creator pid says" in refused.stderr and path.exists()
        w.close()
        time.sleep(0.3)
        swept = _sweep("--stale-after", "0.2")  # no publish for longer than that: dead
        assert f"removed {path}" in swept.stdout and not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_clean_leaves_a_live_board_made_in_another_pid_namespace(board_name):
    """`unshare --pid --fork --mount-proc`: the creator is pid 1 in its namespace, which from here is
    another process (or none); `ls` said not alive and `clean` removed the board while its slot was
    33 ms old."""
    in_pid_namespace = pid_namespace_prefix()
    code = f"""
import os, sys, time
from dpboard import Board, LoadSnapshot
b = Board.create({board_name!r}, n_slots=2)
w = b.writer(0)
print(os.getpid(), flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline and not os.path.exists({str(Path('/tmp') / (board_name + '.stop'))!r}):
    w.publish(LoadSnapshot(0, num_running_reqs=1))
    time.sleep(0.02)
os._exit(0)  # as a crash would: no unlink
"""
    stop_file = Path("/tmp") / (board_name + ".stop")
    proc = subprocess.Popen([*in_pid_namespace, sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).parents[2]))
    path = Path("/dev/shm", f"dpboard.{board_name}")
    try:
        assert read_line(proc, 30).strip() == "1"  # pid 1 in its own namespace
        listed = {e["name"]: e for e in json.loads(_dpboard("ls", "--json").stdout)}
        assert listed[board_name]["creator_pid"] == 1 and listed[board_name]["alive"] is True
        assert _sweep().returncode == 0 and path.exists()
        refused = _dpboard("clean", board_name)
        assert refused.returncode == 2 and "is in use" in refused.stderr and path.exists()
        stop_file.touch()
        proc.wait(timeout=30)
        time.sleep(0.3)
        swept = _dpboard("clean", board_name, "--stale-after", "0.2")
        assert swept.returncode == 0 and not path.exists(), swept.stderr
    finally:
        stop_file.unlink(missing_ok=True)
        proc.kill()
        proc.wait(timeout=10)
        path.unlink(missing_ok=True)


def test_a_planted_header_claiming_billions_of_slots_is_listed_as_damaged(board):
    """Any local user may leave /dev/shm/dpboard.<x> with a valid-looking header claiming 2**32-1
    (or 2**25) slots over a sparse file of the size those slots take: ls and clean once copied a word
    per claimed slot (`Unable to allocate 32.0 GiB`, then `BufferError: cannot close exported
    pointers exist`). They read every header field bounded, list the entry as damaged, and go on;
    each command runs here under a 1 GiB address-space limit, far below what it once allocated."""
    planted = [new_board_name(), new_board_name()]
    try:
        as_nobody(lambda: [plant_board(planted[0], 2**32 - 1), plant_board(planted[1], 2**25)])
        assert Path("/dev/shm", f"dpboard.{planted[0]}").stat().st_size == 2**41  # sparse: 2 TiB claimed

        def limited(*args: str) -> subprocess.CompletedProcess:
            def cap() -> None:
                resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
            return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], capture_output=True, text=True,
                                  timeout=60, preexec_fn=cap, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})

        ls = limited("ls", "--json")
        assert ls.returncode == 0, ls.stderr
        listed = {entry["name"]: entry for entry in json.loads(ls.stdout)}
        assert listed[board.name]["error"] is None and listed[board.name]["alive"] is True
        assert "claims 4294967295 slots, outside 1..65536" in listed[planted[0]]["error"]
        assert "claims 33554432 slots" in listed[planted[1]]["error"]
        text = limited("ls")
        assert text.returncode == 0 and "claims 4294967295 slots" in text.stdout, text.stderr
        with pytest.raises(BoardLayoutError, match="claims 33554432 slots, outside 1..65536"):
            Board.attach(planted[1], trust_uids=(65534,))
        with sweeping():
            clean = limited("clean")  # their claimed creator is dead: removed, the live board kept
        assert clean.returncode == 0, clean.stderr
        assert f"removed /dev/shm/dpboard.{planted[0]}" in clean.stdout
        assert Path("/dev/shm", f"dpboard.{board.name}").exists()
        as_nobody(lambda: plant_board(planted[0], 2**32 - 1, creator_pid=1))
        forced = limited("clean", planted[0], "--force")
        assert forced.returncode == 0 and f"removed /dev/shm/dpboard.{planted[0]}" in forced.stdout, forced.stderr
    finally:
        for name in planted:
            Path("/dev/shm", f"dpboard.{name}").unlink(missing_ok=True)


# -- a full /dev/shm, and header fields that do not fit --------------------------------------------

_FULL_SHM_SCRIPT = r"""
import json, os, signal, sys
from dpboard import Board, LoadSnapshot
from dpboard.errors import DpboardError
out = {}
try:
    Board.create("too-big", 4096)  # 2 MiB: more than this /dev/shm holds
except DpboardError as e:
    out["too_big"] = [type(e).__name__, str(e)]
out["left_after_too_big"] = sorted(os.listdir("/dev/shm"))
board = Board.create("fits", 64)  # 33 KiB, every page reserved now
fd = os.open("/dev/shm/filler", os.O_WRONLY | os.O_CREAT)  # then somebody fills /dev/shm
try:
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    os.close(fd)
w = board.writer(63)  # the last slot's page: once untouched, a SIGBUS at the first write
w.publish(LoadSnapshot(63, num_running_reqs=7))
out["published"] = board.reader().read(63).num_running_reqs
print(json.dumps(out))
"""


def test_a_full_dev_shm_is_a_clear_error_never_a_sigbus():
    """Board.create sized the segment with ftruncate only: with /dev/shm full the creator died with
    SIGBUS (exit 135, no message) and left a headerless segment, and a board made before /dev/shm
    filled killed writer(63) at the first touch of its page. Run in a private 1 MiB tmpfs mounted
    on /dev/shm in a mount namespace of its own (as Docker's small default /dev/shm)."""
    run = run_in_private_shm(_FULL_SHM_SCRIPT, size="1m", label="dpboard-full")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    kind, message = out["too_big"]
    assert kind == "BoardError"
    assert "no room for board 'too-big' (2097664 bytes) in /dev/shm: /dev/shm is 1.0 MiB with" in message
    assert "docker run --shm-size" in message
    assert out["left_after_too_big"] == []  # nothing left behind
    assert out["published"] == 7


def test_a_node_id_beyond_64_bits_is_refused_and_leaves_no_segment(board_name):
    """node_id=2**63 raised struct.error naming nothing and left a headerless segment that blocked
    the name until `clean --force`."""
    for bad in (2**63, -1, True, 1.5):
        with pytest.raises(InvalidInputError, match=r"node_id must be an integer in \[0, 9223372036854775807\]"):
            Board.create(board_name, 2, node_id=bad)
        assert not Path("/dev/shm", f"dpboard.{board_name}").exists()
    with Board.create(board_name, 2, node_id=2**63 - 1) as board:
        assert Board.attach(board_name).node_id == 2**63 - 1 == board.node_id


def test_a_board_grown_sparse_to_a_petabyte_attaches_without_being_mapped_whole(board_name):
    """Mapping 2**50 bytes fails with ENOMEM: an attacher reads the header first and maps only what
    the board's slots hold, so readers, top and the controller's follower work as on any board."""
    import subprocess
    import sys

    from tests.support.names import ROOT

    with Board.create(board_name, 2) as board:
        board.writer(1).publish(LoadSnapshot(1, num_waiting_reqs=3))
        os.truncate(f"/dev/shm/dpboard.{board_name}", 2**50)
        attached = Board.attach(board_name)
        assert attached.reader().read(1).num_waiting_reqs == 3
        attached.close()
        res = subprocess.run([sys.executable, "-m", "dpboard.cli", "top", board_name, "--once"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
