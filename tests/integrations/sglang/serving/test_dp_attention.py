"""SGLang's DP attention with dpboard inside: ``sglang.launch_server --dp-size 2 --tp-size 2
--enable-dp-attention --load-balance-method total_tokens`` on the CPU (a server of its own; the
model and the one test shim it needs: tests/support/sglang_serving.py), ``DPBOARD_METHOD=auto``.

Under DP attention every rank runs each forward with the others, an idle one with an empty batch.
What the board says of it: each rank's ``lockstep`` section (the group's size, its prefill chunk as
SGLang's scheduler has it); ``auto`` resolved to inflight_lockstep (the log, the dispatch record);
requests answered on both ranks. And the lockstep itself: a rank with no request stopped
(SIGSTOP) stops the rank that decodes, whose slot goes stale with it; both resume together."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dpboard.board import SHM_DIR, Board
from dpboard.board.dispatch_record import read_dispatch_record
from dpboard.snapshot import LockstepDetail, SlotStatus
from tests.integrations.sglang.serving.conftest import serving
from tests.support.procutil import wait_until
from tests.support.sglang_serving import stream_generate

pytestmark = [pytest.mark.serving, pytest.mark.timeout(1200)]
DP = 2
STALE_AFTER = 1.0  # the plugin's threshold here (DPBOARD_STALE_AFTER): a heartbeat every 0.25 s
SETTLE = 120.0  # seconds for the board to show what the HTTP answers already said
LONG = 4000  # tokens of a streamed request: it decodes until the test closes it
LIVE, STALE = int(SlotStatus.LIVE), int(SlotStatus.STALE)
# SGLang's first scheduler logs the chunk a rank prefills at most (after its division by the DP size)
_CHUNK_LINE = re.compile(r"\] max_total_num_tokens=\d+, chunked_prefill_size=(\d+),")


@pytest.fixture(scope="module")
def server():
    with serving("auto", {"DPBOARD_STALE_AFTER": str(STALE_AFTER)}, dp_attention=True) as srv:
        yield srv


def records(server, stale_after: float = STALE_AFTER) -> np.ndarray:
    with Board.attach(server.board) as board:
        return board.reader(stale_after=stale_after).read_array().copy()


def details(server) -> list:
    with Board.attach(server.board) as board:
        reader = board.reader(stale_after=STALE_AFTER)
        return [reader.read_detail(rank)[2] for rank in range(DP)]


def decode_steps(server, rank: int) -> int:
    """The decode steps SGLang counted on ``rank`` (the first of its decode moments; 0 before any)."""
    moments = details(server)[rank].decode_moments
    return 0 if moments is None else int(moments[0])


def settled(server) -> bool:
    r = records(server)
    return (r["status"] == LIVE).all() and not r["num_running_reqs"].any() and not r["num_waiting_reqs"].any()


def statuses(server) -> list[int]:
    return records(server)["status"].tolist()


def test_each_rank_publishes_its_lockstep_section(server):
    """(group size, chunk tokens): every rank steps with both; the chunk is the one SGLang's
    scheduler logged, --chunked-prefill-size after its division by the DP size."""
    assert wait_until(lambda: statuses(server) == [LIVE, LIVE], timeout=SETTLE), records(server)
    chunks = {int(m[1]) for m in _CHUNK_LINE.finditer(server.log())}
    assert len(chunks) == 1, server.tail()
    assert [d.lockstep for d in details(server)] == [LockstepDetail(DP, chunks.pop())] * DP
    r = records(server)
    assert r["writer_pid"].tolist() == [p[0] for p in server.schedulers(DP)]


def test_auto_resolves_to_inflight_lockstep(server):
    log = server.log()
    assert f"dpboard: SGLang's loads are on board '{server.board}' (2 ranks)" in log
    assert re.search(rf"dpboard: DP dispatch by inflight_lockstep\b.* over board '{re.escape(server.board)}' "
                     rf"\(2 worker slots\)", log), log[-4000:]
    rows = [row for row in read_dispatch_record(server.board) or [] if row.alive]
    assert [(row.pid, row.method) for row in rows] == \
        [(server.titled("sglang::data_parallel_controller")[0], "inflight_lockstep")], rows


def test_requests_are_answered_on_both_ranks(server):
    """Eight at once: inflight_lockstep spreads them, both ranks answer, and each rank received on
    the board exactly what it served."""
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)
    before = records(server)["num_received_reqs"].astype(np.int64)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: server.generate(f"together {i}", 8), range(8)))
    for status, answer in answers:
        assert status == 200, answer
        assert answer["meta_info"]["completion_tokens"] == 8, answer["meta_info"]
    served = Counter(answer["meta_info"]["dp_rank"] for _, answer in answers)
    assert sorted(served) == [0, 1], (served, records(server), details(server), read_dispatch_record(server.board),
                                      [line for line in server.log().splitlines() if "dpboard" in line][-20:])
    assert wait_until(lambda: (records(server)["num_received_reqs"] - before).tolist() == [served[0], served[1]],
                      timeout=SETTLE), (served, before, records(server))


def test_a_stopped_idle_rank_stops_the_rank_that_decodes(server):
    """A long stream on rank 0, none on rank 1. Rank 1's scheduler stopped (SIGSTOP), rank 0's next
    forward waits for it: rank 0 publishes nothing more, not even its heartbeat, and reads STALE
    beside rank 1, its decode steps frozen. Continued (SIGCONT), both are LIVE again and rank 0
    decodes on. Ranks that step alone do not do this: test_scheduler_killed.py's dead rank leaves
    the other LIVE."""
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)
    before = records(server)["num_received_reqs"].astype(np.int64)
    conn = stream_generate(server, "a long story", LONG, 0)
    try:
        assert wait_until(lambda: records(server)["num_running_reqs"].tolist() == [1, 0], timeout=SETTLE), \
            records(server)
        first = decode_steps(server, 0)
        assert wait_until(lambda: decode_steps(server, 0) > first, timeout=SETTLE), details(server)
        assert statuses(server) == [LIVE, LIVE]
        idle = server.schedulers(DP)[1]
        assert len(idle) == 1, idle
        os.kill(idle[0], signal.SIGSTOP)
        try:
            assert wait_until(lambda: statuses(server) == [STALE, STALE], timeout=SETTLE, interval=0.1), \
                records(server)
            frozen = decode_steps(server, 0)
            seq = records(server)["publish_seq"].tolist()
            time.sleep(4 * STALE_AFTER)  # a live rank would publish a heartbeat in every quarter of this
            assert decode_steps(server, 0) == frozen
            assert records(server)["publish_seq"].tolist() == seq
            assert statuses(server) == [STALE, STALE]
        finally:
            os.kill(idle[0], signal.SIGCONT)
        assert wait_until(lambda: statuses(server) == [LIVE, LIVE], timeout=SETTLE, interval=0.1), records(server)
        assert wait_until(lambda: decode_steps(server, 0) > frozen, timeout=SETTLE), details(server)
        assert records(server)["num_running_reqs"].tolist() == [1, 0]
    finally:
        conn.close()  # SGLang aborts the streamed request
    assert wait_until(lambda: settled(server), timeout=SETTLE), records(server)
    assert (records(server)["num_received_reqs"] - before).tolist() == [1, 0]


def test_sigterm_to_the_server_leaves_nothing_of_the_board(server):
    """The last test: SIGTERM to the server's process group (SGLang then SIGKILLs its tree); the
    plugin's watcher removes the board and the dispatch record."""
    assert sorted(p.name for p in SHM_DIR.glob(f"dpboard*{server.board}")) == \
        [f"dpboard-dispatch.{server.board}", f"dpboard.{server.board}"]
    server.stop()
    assert server.pids() == [], server.tail()
    assert wait_until(lambda: not any(SHM_DIR.glob(f"dpboard*{server.board}")), timeout=60), \
        (sorted(SHM_DIR.glob(f"dpboard*{server.board}")), server.tail())
