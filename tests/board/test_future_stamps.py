"""A monotonic stamp from the future is not live (issue 28, item 11).

A writer whose CLOCK_MONOTONIC runs ahead of the reader's (a time namespace, a forged slot) used to
read as LIVE and "0ms" old for as long as the reader's clock had not caught up: days, for a namespace
10**6 s ahead. Every reader now takes a stamp more than ``stale_after`` ahead of its own clock as
STALE: the C reader (read_array, status, read_detailed), and what the views built on it show
(``dpboard dump --json``, ``dpboard top --once --json``, ``dpboard serve``'s /v1/loads and /metrics).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from dpboard import Board, LoadSnapshot
from dpboard.snapshot import DETAILED_DTYPE, FIELDS_OFFSET, SlotStatus, slot_offset
from dpboard.views.rows import fmt_age
from tests.support import serving
from tests.support.names import ROOT
from tests.support.procutil import stop
from tests.support.raw import raw_segment

pytestmark = pytest.mark.timeout(120)

AHEAD_S = 1_000_000  # the time namespace: CLOCK_MONOTONIC 10**6 s ahead of ours
STALE_AFTER = 1.0

# Publishes one snapshot into rank 0 of the board named by argv[1], prints its stamp, and exits.
WRITER = """
import sys, time
from dpboard import Board, LoadSnapshot
board = Board.attach(sys.argv[1])
with board.writer(0) as w:
    w.publish(LoadSnapshot(dp_rank=0, num_running_reqs=3, num_total_tokens=700, max_total_num_tokens=1000))
print(board.reader(stale_after=1e6).read(0).monotonic_ns, time.monotonic_ns(), flush=True)
board.close()
"""


def _time_namespace_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--time", "--monotonic", str(AHEAD_S), "--fork", "cat", "/proc/uptime"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def publish_from_the_future(name: str) -> int:
    """A real writer process in a time namespace ``AHEAD_S`` ahead publishes rank 0 once and exits;
    returns the stamp it wrote."""
    if not _time_namespace_works():
        pytest.skip("needs `unshare --time` (root, Linux >= 5.6) for a writer in a time namespace")
    out = subprocess.run(["unshare", "--time", "--monotonic", str(AHEAD_S), "--fork", sys.executable, "-c", WRITER,
                          name], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    stamp, writer_now = (int(x) for x in out.stdout.split())
    # The writer's clock really was ahead: its stamp is far beyond ours.
    assert stamp - time.monotonic_ns() > (AHEAD_S - 60) * 10**9
    assert writer_now >= stamp
    return stamp


def plant_stamp(name: str, rank: int, monotonic_ns: int) -> None:
    """Rank ``rank``'s slot as one consistent write stamped ``monotonic_ns`` (raw bytes: the writer
    API stamps its own clock)."""
    base = slot_offset(rank)
    with raw_segment(name) as mm:
        seq = struct.unpack_from("<Q", mm, base)[0]
        struct.pack_into("<Q", mm, base, seq | 1)
        fields = LoadSnapshot(dp_rank=rank, num_running_reqs=1, num_total_tokens=10, max_total_num_tokens=100,
                              monotonic_ns=monotonic_ns, publish_seq=1)
        struct.pack_into(f"<{len(fields)}q", mm, base + FIELDS_OFFSET, *fields)
        struct.pack_into("<Q", mm, base, (seq | 1) + 1)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpboard.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_writer_in_a_time_namespace_ahead_is_stale_in_every_reader(board_name):
    with Board.create(board_name, n_slots=2) as board:
        with board.writer(1) as here:  # a writer on our clock beside it, published just before each read
            here.publish(LoadSnapshot(dp_rank=1, num_total_tokens=5))
            stamp = publish_from_the_future(board_name)
            time.sleep(0.2)  # as in the issue, the reads come a little after the publish

            reader = board.reader(stale_after=STALE_AFTER)
            here.publish(LoadSnapshot(dp_rank=1, num_total_tokens=5))
            arr = reader.read_array()
            assert arr["monotonic_ns"][0] == stamp  # the slot holds what the writer wrote
            assert SlotStatus(int(arr["status"][0])) is SlotStatus.STALE
            assert SlotStatus(int(arr["status"][1])) is SlotStatus.LIVE
            assert reader.status(0) is SlotStatus.STALE
            status, snap = reader.read_with_status(0)
            assert status is SlotStatus.STALE and snap.num_total_tokens == 700
            assert reader.read_detailed(0)[0] is SlotStatus.STALE
            detailed = reader.read_detailed_array(np.zeros(2, DETAILED_DTYPE))
            assert SlotStatus(int(detailed[0]["load"]["status"])) is SlotStatus.STALE

            here.publish(LoadSnapshot(dp_rank=1, num_total_tokens=5))
            dump = cli("dump", board_name, "--json", "--stale-after", "30")
            assert dump.returncode == 0, dump.stderr
            slots = json.loads(dump.stdout)["slots"]
            assert slots[0]["status"] == "stale" and slots[1]["status"] == "live"
            assert slots[0]["age_s"] < -(AHEAD_S - 60)  # shown as what it is: stamped ahead

            here.publish(LoadSnapshot(dp_rank=1, num_total_tokens=5))
            top = cli("top", board_name, "--once", "--json", "--stale-after", "30")
            assert top.returncode == 0, top.stderr
            frame = json.loads(top.stdout)
            assert frame["ranks"][0]["status"] == "stale"
            assert frame["status_counts"]["live"] == 1 and frame["status_counts"]["stale"] == 1
            assert frame["totals"]["num_total_tokens"] == 5  # the future rank's load is not counted

            proc, url = serving.start_server(board_name, "--stale-after", "30")
            try:
                here.publish(LoadSnapshot(dp_rank=1, num_total_tokens=5))
                code, _, body = serving.get(f"{url}/v1/loads")
                assert code == 200
                doc = json.loads(body)
                assert [load["dp_rank"] for load in doc["loads"]] == [1]
                assert [(o["dp_rank"], o["status"]) for o in doc["omitted_ranks"]] == [(0, "stale")]
                code, _, text = serving.get(f"{url}/metrics")
                assert code == 200
                page = serving.samples(text)
                assert page[("dpboard_slot_status", (("board", board_name), ("dp_rank", "0"),
                                                     ("status", "stale")))] == 1.0
                assert page[("dpboard_slot_status", (("board", board_name), ("dp_rank", "0"),
                                                     ("status", "live")))] == 0.0
            finally:
                stop(proc)


@pytest.mark.parametrize("stale_after", [0.5, 5.0])
def test_ahead_within_the_threshold_is_live_and_beyond_it_stale(board_name, stale_after):
    """The rule is symmetric: within ``stale_after`` of the reader's clock on either side is LIVE."""
    with Board.create(board_name, n_slots=4) as board:
        reader = board.reader(stale_after=stale_after)
        now = time.monotonic_ns()
        margin = 10**9 * stale_after
        plant_stamp(board_name, 0, now + int(margin * 0.5))   # a little ahead: LIVE
        plant_stamp(board_name, 1, now + int(margin * 3))     # ahead by more than the threshold: STALE
        plant_stamp(board_name, 2, 2**63 - 1)                 # the largest stamp a word holds
        plant_stamp(board_name, 3, -(2**63))                  # and the smallest
        statuses = [SlotStatus(int(s)) for s in reader.read_array()["status"]]
        assert statuses == [SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.STALE, SlotStatus.STALE]
        assert [reader.status(r) for r in range(4)] == statuses


def test_a_future_age_reads_as_ahead():
    assert fmt_age(-3.0) == "ahead" and fmt_age(-1e6) == "ahead"
    assert fmt_age(0.25) == "250ms"


def test_the_reader_threshold_stays_in_range(board_name):
    with Board.create(board_name, n_slots=1) as board:
        reader = board.reader()
        for bad in (0, -1, 10**15 + 1, 2**63 - 1):
            with pytest.raises(ValueError, match="stale_after_ns must be in"):
                reader.stale_after_ns = bad
        reader.stale_after_ns = 2 * 10**9
        assert reader.stale_after == 2.0
