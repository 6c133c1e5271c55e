"""``DispatchSession``: one Dispatcher, its dispatch-record row and the counts every engine keeps, over
real boards and real dispatch records in /dev/shm."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

from dpboard import Board, LoadSnapshot
from dpboard.board.dispatch_record import RowCounts, dispatch_record_path, read_dispatch_record
from dpboard.controller import Dispatcher
from dpboard.controller.session import DispatchSession, logged_now
from dpboard.snapshot import SlotStatus
from tests.support.procutil import wait_until

log = logging.getLogger("dpboard.test_session")


def request(tokens: int = 10, routed: int | None = None, room: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(input_ids=list(range(tokens)), routed_dp_rank=routed, bootstrap_room=room)


def recorded(board_name: str, method: str = "round_robin", slots: int = 3, **kwargs) -> DispatchSession:
    return DispatchSession.with_record(board_name, slots, method=method, logger=log, own_path="Test's own dispatch",
                                       **kwargs)


def only_row(board_name: str):
    (row,) = read_dispatch_record(board_name)
    return row


def test_the_1st_10th_and_100th_times_are_logged():
    assert [n for n in range(1, 1001) if logged_now(n)] == [1, 10, 100, 1000]
    assert not logged_now(0)


def test_picks_routed_requests_fallbacks_and_rejections_read_back_from_the_record(board_name):
    session = recorded(board_name)
    try:
        session.use(Dispatcher("round_robin", 3))
        for rank in (0, 1, 1, 2):
            session.picked(rank, with_room=rank == 2)
        session.picked(0, routed=True)
        session.routed(2, 50)  # the engine routed it itself: nothing to charge without a budget
        assert session.fallback("no rank", "r7") == 1
        session.rejected(2)
        session.publish()
        row = only_row(board_name)
        assert (row.method, row.mode, row.alive) == ("round_robin", "null", True)
        assert row.per_rank == [2, 2, 2] and row.routed_per_rank == [1, 0, 1]
        assert row.counts == {"refreshes": 0, "requests": 6, "routed": 2, "with_room": 1, "fallbacks": 1,
                              "rejected": 2}
    finally:
        session.close()


def test_a_load_aware_budget_counts_its_picks_and_the_refreshes_publish_the_row(board_name):
    with Board.create(board_name, n_slots=2) as board:
        writers = [board.writer(r) for r in range(2)]
        for rank, running in enumerate((4, 0)):
            writers[rank].publish(LoadSnapshot(dp_rank=rank, num_running_reqs=running, max_total_num_tokens=1000))
        session = recorded(board_name, "inflight_requests", slots=2)
        try:
            dispatcher = Dispatcher("inflight_requests", 2, reader=session.reader(board.reader()), refresh_interval=0)
            session.use(dispatcher)
            picks = [dispatcher.dispatch(request()) for _ in range(3)]
            for rank in picks:
                session.picked(rank)  # the budget counts these itself: nothing added here
            assert picks == [1, 1, 1]
            session.routed(0, 10)  # charged to the budget: its in-flight count stays exact
            assert list(dispatcher.budget.in_flight()) == [1, 3]
            session.publish()
            row = only_row(board_name)
            assert row.per_rank == [1, 3] and row.routed_per_rank == [1, 0]
            assert row.counts["requests"] == 4 and row.counts["routed"] == 1
            # one read per refresh, and the Dispatcher's first, when it was made
            assert row.counts["refreshes"] == dispatcher.refresh_count + 1 == 4
        finally:
            session.close()
            for w in writers:
                w.close()
            board.unlink()


def test_an_idle_dispatchers_last_counts_reach_the_record_from_the_turns_of_its_loop(board_name):
    """A row was published only from its dispatcher's own refreshes (and ticks): the picks after
    its last publish stayed out of the record until the next pick, so `dpboard doctor` read an idle
    API server's old counts. A loop of the engine's that turns anyway (here, turns with no request,
    on the dispatcher's thread as in an engine) now brings them within 0.1 s of the last change, and
    publishes nothing while nothing changes."""
    with Board.create(board_name, n_slots=2) as board:
        writers = [board.writer(r) for r in range(2)]
        for rank in range(2):
            writers[rank].publish(LoadSnapshot(dp_rank=rank, max_total_num_tokens=1000))
        session = recorded(board_name, "inflight_requests", slots=2)
        try:
            # a refresh at most every 20 ms, the row at most every 0.1 s: vLLM's API server's throttle
            dispatcher = Dispatcher("inflight_requests", 2, reader=session.reader(board.reader()))
            session.use(dispatcher)
            for _ in range(6):
                dispatcher.dispatch(request())
            session.routed(0, 10)
            behind = only_row(board_name).counts["requests"]

            def turned_in() -> bool:
                session.turn()
                return only_row(board_name).counts["requests"] == 7

            # the engine serves nothing more; its loop turns
            assert wait_until(turned_in, timeout=10, interval=0.01), f"the record stays at {behind} of 7 requests"
            row = only_row(board_name)
            assert row.per_rank == [4, 3] and row.counts["routed"] == 1
            stamp = row.wall_ns
            for _ in range(30):  # turns past several publish intervals, nothing changed
                session.turn()
                time.sleep(0.01)
            assert only_row(board_name).wall_ns == stamp
        finally:
            session.close()
            for w in writers:
                w.close()
            board.unlink()


def test_faults_are_counted_and_logged_at_the_1st_10th_and_100th_time_the_first_with_its_traceback(board_name,
                                                                                                  caplog):
    session = recorded(board_name)
    try:
        session.use(Dispatcher("round_robin", 3))
        with caplog.at_level("WARNING", logger=log.name):
            for i in range(100):
                session.fault(RuntimeError(f"bug {i}"), f"r{i}")
            session.fault(KeyError("count"), "late", placed=False)
        said = [r for r in caplog.records if "dpboard fault #" in r.getMessage()]
        assert [r.getMessage() for r in said] == [
            f"dpboard: RuntimeError: bug {n - 1} in dpboard's dispatch of request r{n - 1}; Test's own dispatch "
            f"placed it (dpboard fault #{n})" for n in (1, 10, 100)]
        assert said[0].exc_info is not None and [r.exc_info for r in said[1:]] == [None, None]
        # placed by the engine's own path: each a fallback; the one after the send only a fault
        assert (session.faults, session.fallbacks) == (101, 100)
        session.publish()
        assert only_row(board_name).counts["fallbacks"] == 100
    finally:
        session.close()


def test_fallbacks_are_logged_at_the_1st_and_10th_time(caplog):
    session = DispatchSession(logger=log, own_path="its own pick", fallback_path="its budget's pick")
    session.use(Dispatcher("round_robin", 2))
    with caplog.at_level("WARNING", logger=log.name):
        counts = [session.fallback("every rank is stale", f"r{i}") for i in range(12)]
    assert counts == list(range(1, 13))
    assert [r.getMessage() for r in caplog.records] == [
        f"dpboard: every rank is stale; request r{i} placed by its budget's pick (fallback #{i + 1})" for i in (0, 9)]
    assert session.tally is None and session.count_fallbacks(3) == 15  # counted without a record too


def test_a_second_dispatcher_takes_the_ranks_and_the_record_keeps_counting(board_name):
    """An engine that counts every request itself (the ZMQ controller) gives its counts once; the
    row reads them, whichever Dispatcher picks."""
    session = recorded(board_name)
    per_rank, routed = [0, 0, 0], [0, 0, 0]
    try:
        first = Dispatcher("round_robin", 3)
        session.use(first)
        session.count_from(lambda: RowCounts(per_rank, routed, sum(routed), 0, 1, 2))
        first.set_active([0, 2])
        first.set_status(2, False)
        per_rank[0] += 1
        second = Dispatcher("total_requests", 3, reader=SimpleNamespace(read_all=lambda: [None] * 3))
        session.use(second)  # auto changed its mind
        assert session.dispatcher is second
        assert second.active == (0, 2) and second.available == (True, True, False)
        per_rank[0] += 1
        routed[0] += 1
        session.publish()
        row = only_row(board_name)
        assert row.method == "total_requests" and row.per_rank == [2, 0, 0] and row.routed_per_rank == [1, 0, 0]
        assert (row.counts["requests"], row.counts["routed"], row.counts["fallbacks"], row.counts["rejected"]) == (
            2, 1, 1, 2)
        assert row.wave is None and session.wave_counts() is None  # neither holds
    finally:
        session.close()


def test_a_slot_whose_writer_is_gone_reads_stale_and_reserved_slots_read_empty(board_name):
    with Board.create(board_name, n_slots=2) as board:
        writers = [board.writer(r) for r in range(2)]
        for rank in range(2):
            writers[rank].publish(LoadSnapshot(dp_rank=rank, max_total_num_tokens=1000))
        session = DispatchSession(logger=log)
        try:
            reader = session.reader(board.reader(stale_after=60.0), locks=board.slot_locks(interval=0.01),
                                    num_workers=3)
            status = reader.read_array()["status"].tolist()
            assert status == [SlotStatus.LIVE, SlotStatus.LIVE, SlotStatus.EMPTY]
            writers[1].close()  # its writer's lock goes with it: stale now, whatever its stamp says
            time.sleep(0.02)
            assert reader.read_array()["status"].tolist() == [SlotStatus.LIVE, SlotStatus.STALE, SlotStatus.EMPTY]
        finally:
            session.close()
            writers[0].close()
            board.unlink()


def test_a_writer_that_starts_after_a_look_at_the_locks_reads_live_until_the_next_look(board_name):
    """A look at the locks finds slot 1 without a writer (it has none yet); its writer starts and
    publishes before the next look. That publish came after the look, so the slot reads LIVE, not
    STALE from a look that no longer holds (a deployment's first picks used to skip such an engine)."""
    with Board.create(board_name, n_slots=2) as board:
        first = board.writer(0)
        first.publish(LoadSnapshot(dp_rank=0, max_total_num_tokens=1000))
        session = DispatchSession(logger=log)
        late = None
        try:
            reader = session.reader(board.reader(stale_after=60.0), locks=board.slot_locks(interval=60.0))
            assert reader.read_array()["status"].tolist() == [SlotStatus.LIVE, SlotStatus.EMPTY]  # the look
            late = board.writer(1)
            late.publish(LoadSnapshot(dp_rank=1, max_total_num_tokens=1000))
            assert reader.read_array()["status"].tolist() == [SlotStatus.LIVE, SlotStatus.LIVE]
        finally:
            session.close()
            for writer in (first, late):
                if writer is not None:
                    writer.close()
            board.unlink()


def test_close_leaves_nothing_and_is_idempotent(board_name):
    session = recorded(board_name)
    session.use(Dispatcher("round_robin", 3))
    assert Path(dispatch_record_path(board_name)).exists()
    session.close()
    session.close()
    assert not Path(dispatch_record_path(board_name)).exists()
    assert read_dispatch_record(board_name) is None


def test_a_record_of_another_shape_held_elsewhere_leaves_the_session_without_one(board_name, caplog):
    other = recorded(board_name, slots=4)
    try:
        with caplog.at_level("WARNING", logger=log.name):
            session = recorded(board_name, slots=3)
        assert session.tally is None
        assert any("no dispatch record for dpboard doctor" in r.getMessage() for r in caplog.records)
        session.use(Dispatcher("round_robin", 3))
        session.picked(1)
        session.fault(RuntimeError("x"), "r")  # counted all the same
        assert (session.faults, session.fallbacks) == (1, 1)
        session.close()
    finally:
        other.close()
